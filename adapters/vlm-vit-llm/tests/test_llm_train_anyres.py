"""Training on a tiled (AnyRes) tower: images load as `TiledImage`s, each counts the tokens
of its original size in truncation, the images-alone drop and packing; a collated batch
trains as the same records built by hand give (`mm.run(mm.prepare(...))`), packed rows as
the records alone."""

import json

import pytest
import torch
from conftest import CAPTIONS, tiny_llm, tiny_tower
from test_conversation_data import gpt, human, write_records
from test_llm_anyres import PINPOINTS, image

from vlm_vit import VisionTower
from vlm_vit.processor import Tiling
from vlm_vit.train import TrainConfig, Trainer
from vlm_vit_llm import IGNORE_INDEX, MultimodalLM, TiledImage
from vlm_vit_llm.chat import adopt_chat_template, tokenize_conversation
from vlm_vit_llm.parallel import idle_image_features
from vlm_vit_llm.records import ConversationRecords
from vlm_vit_llm.train import (
    CaptionCollate,
    CaptionFolder,
    CaptionObjective,
    ConversationBatch,
    ConversationCollate,
    ConversationDataset,
    ConversationObjective,
)

# The same records batched by the collate or by hand: the objective sums the token losses
# itself, the LLM takes their mean, a rounding step or two apart at a loss of 13.5 (float32
# steps there are 9.5e-7), so relative.
LOSS_RTOL = 1e-6
PACKED_ATOL = 1e-5  # packed rows against each record alone
# A landscape and a portrait (LLaVA-NeXT's 950 x 1256 and a 640 x 427 scaled to a 32-pixel
# tile: 70 and 72 tokens), and a wide strip (52 tokens).
SIZES = [(90, 120), (61, 41), (40, 100)]
PROMPT = "<image>\nwhat is in the image"
BRIEF = {"from": "system", "value": "Be brief."}  # in place of vicuna_v1's long one
RECORDS = [
    {"id": "both", "image": ["0.png", "1.png"],
     "conversations": [BRIEF, human("<image> and <image>"), gpt("the green tree")]},
    {"id": "one", "image": "1.png",
     "conversations": [BRIEF, human("<image>\nWhat is in the image?"), gpt("two blue dogs"),
                       human("Which colour?"), gpt("blue")]},
    {"id": "strip", "image": "2.png",
     "conversations": [BRIEF, human("<image>"), gpt("a red square")]},
]


def tiled_mm(tokenizer, vocab_size=128, template=None):
    """A tiny CLIP-shaped tower tiling 32-pixel tiles (4 x 4 tokens each) on a tiny Llama."""
    base = tiny_tower()
    tower = VisionTower(base.encoder, base.pooler, feature_layer=-2,
                        tiling=Tiling(pinpoints=PINPOINTS, tile_size=32))
    mm = MultimodalLM(tower, tiny_llm(vocab_size=vocab_size), tokenizer)
    if template is not None:
        adopt_chat_template(mm.tokenizer, template)
    return mm


def write_images(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for index, size in enumerate(SIZES):
        image(*size).save(folder / f"{index}.png")
    return folder


def by_hand(mm, folder, names):
    """Each file as the tiled tower takes it, straight from the processor."""
    views, sizes = mm.processor.tile([folder / name for name in names])
    return [TiledImage(v, s) for v, s in zip(views, sizes, strict=True)]


def write_caption_folder(folder):
    write_images(folder)
    lines = [{"image": "0.png", "caption": CAPTIONS[0]},
             {"image": "1.png", "caption": CAPTIONS[1], "prompt": PROMPT},
             {"image": "2.png", "caption": CAPTIONS[2]}]
    (folder / "captions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return CAPTIONS[:3], ["<image>\n", PROMPT, "<image>\n"]


def conversation_data(tmp_path, mm, records, max_length):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", records)
    collate = ConversationCollate(mm, max_length=max_length)
    dataset = ConversationDataset(ConversationRecords(path, images), mm.processor,
                                  image_tokens=collate.image_tokens, max_length=max_length,
                                  least_image_tokens=collate.least_image_tokens)
    return images, dataset


def encoded_by_hand(mm, images, dataset):
    """Each record's ids, labels and tiled images, from the chat template and the files."""
    rows = []
    for index in range(len(dataset)):
        record = dataset.records[index]
        ids, labels = tokenize_conversation(mm.tokenizer, record.turns,
                                            mm.tokenizer.chat_template)
        rows.append((ids, labels, by_hand(mm, images, [p.name for p in record.images])
                     if record.images else []))
    return rows


def one_step(objective, dataset, collate, run_dir, records):
    """One optimizer step over the whole dataset, one record per micro-batch."""
    config = TrainConfig(steps=1, batch_size=records, grad_accumulation=records, lr=1e-2,
                         warmup_steps=0, weight_decay=0.0, num_workers=0, checkpoint_every=0,
                         log_every=100, device="cpu")
    return Trainer(objective, dataset, config, run_dir, collate=collate, progress=False).fit()


def alone_loss(mm, rows):
    """The token-mean loss of records each run alone (a batch of one)."""
    total, tokens = 0.0, 0
    for ids, labels, images in rows:
        batch = mm.prepare([ids], [images], token_labels=[labels])
        count = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
        total, tokens = total + mm.run(batch).loss * count, tokens + count
    return total / tokens


def test_tiled_captions_train_as_records_built_by_hand(tmp_path, tokenizer):
    folder = tmp_path / "data"
    captions, prompts = write_caption_folder(folder)
    mm = tiled_mm(tokenizer).train_projector_only()
    dataset = CaptionFolder(folder, folder / "captions.jsonl", mm.processor)
    items = [dataset[index] for index in range(len(dataset))]
    assert [item[0].size for item in items] == SIZES
    counts = [mm.tower.num_image_tokens(size) for size in SIZES]
    assert len(set(counts)) == 3  # each size its own count

    batch = CaptionCollate(mm)(items)
    assert isinstance(batch.pixel_values, ConversationBatch) and batch.pixel_values.rows is None
    images = [[one] for one in by_hand(mm, folder, ["0.png", "1.png", "2.png"])]
    expected = mm.prepare(prompts, images, captions)
    assert expected.image_mask.sum().item() == sum(counts)
    with torch.no_grad():
        expected = mm.run(expected).loss
        loss = CaptionObjective(mm)(batch.pixel_values).loss
    torch.testing.assert_close(loss, expected, rtol=LOSS_RTOL, atol=0)

    frozen = mm.tower.encoder.blocks[0].attn.qkv.weight.detach().clone()
    projector = mm.tower.pooler.state_dict()
    projector = {name: tensor.clone() for name, tensor in projector.items()}
    result = one_step(CaptionObjective(mm), dataset, CaptionCollate(mm), tmp_path / "run", 3)
    assert result.losses[0] == pytest.approx(expected.item(), rel=LOSS_RTOL)
    assert torch.equal(mm.tower.encoder.blocks[0].attn.qkv.weight, frozen)
    assert any(not torch.equal(tensor, projector[name])
               for name, tensor in mm.tower.pooler.state_dict().items())


def test_tiled_conversations_train_as_records_built_by_hand(tmp_path, chat_tokenizer):
    mm = tiled_mm(chat_tokenizer, vocab_size=512, template="vicuna_v1").train_projector_only()
    images, dataset = conversation_data(tmp_path, mm, RECORDS, max_length=256)
    items = [dataset[index] for index in range(len(dataset))]
    assert [pixels.size for pixels in items[0].pixels] == SIZES[:2]

    batch = ConversationCollate(mm, max_length=256)(items)
    assert batch.undecodable == []
    rows = encoded_by_hand(mm, images, dataset)
    assert batch.pixel_values.input_ids == [row[0] for row in rows]  # nothing truncated
    prepared = mm.prepare(*zip(*[(ids, images) for ids, _, images in rows], strict=True),
                          token_labels=[row[1] for row in rows])
    counts = [mm.tower.num_image_tokens(size) for size in (SIZES[0], SIZES[1], SIZES[1],
                                                           SIZES[2])]
    assert prepared.image_mask.sum().item() == sum(counts)
    with torch.no_grad():
        expected = mm.run(prepared).loss
        loss = ConversationObjective(mm)(batch.pixel_values).loss
    torch.testing.assert_close(loss, expected, rtol=LOSS_RTOL, atol=0)

    collate = ConversationCollate(mm, max_length=256)
    result = one_step(ConversationObjective(mm), dataset, collate, tmp_path / "run", 3)
    assert result.losses[0] == pytest.approx(expected.item(), rel=LOSS_RTOL)


def test_tiled_packed_rows_train_as_records_alone_with_exact_lengths(tmp_path, chat_tokenizer,
                                                                     tokenizer):
    mm = tiled_mm(chat_tokenizer, vocab_size=512, template="vicuna_v1")
    images, dataset = conversation_data(tmp_path, mm, RECORDS, max_length=256)
    items = [dataset[index] for index in range(len(dataset))]
    rows = encoded_by_hand(mm, images, dataset)
    lengths = [int(mm.prepare([ids], [images]).attention_mask.sum()) for ids, _, images in rows]
    # The two shortest fill a row exactly: a count off by one either way shows.
    shortest = sorted(range(3), key=lengths.__getitem__)[:2]
    limit = lengths[shortest[0]] + lengths[shortest[1]]
    assert max(lengths) <= limit <= 256
    packed = ConversationCollate(mm, max_length=limit, packing=True)(items).pixel_values
    assert packed.input_ids == [row[0] for row in rows]
    assert sorted(map(sorted, packed.rows)) == sorted([sorted(shortest),
                                                        [3 - sum(shortest)]])
    prepared = mm.prepare(packed.input_ids, packed.images, token_labels=packed.labels,
                          pack=packed.rows)
    for record, length in enumerate(lengths):
        assert (prepared.record_index == record).sum().item() == length
    with torch.no_grad():
        expected = alone_loss(mm, rows)
        loss = ConversationObjective(mm)(packed).loss
    torch.testing.assert_close(loss, expected, rtol=0, atol=PACKED_ATOL)

    # Captions pack the same way.
    folder = tmp_path / "captions"
    captions, prompts = write_caption_folder(folder)
    mm = tiled_mm(tokenizer)
    dataset = CaptionFolder(folder, folder / "captions.jsonl", mm.processor)
    items = [dataset[index] for index in range(len(dataset))]
    packed = CaptionCollate(mm, packing=True, max_length=256)(items).pixel_values
    assert len(packed.rows) < 3
    pictures = by_hand(mm, folder, ["0.png", "1.png", "2.png"])
    rows = []
    for prompt, caption, picture in zip(prompts, captions, pictures, strict=True):
        prompt_ids = list(mm.tokenizer(prompt)["input_ids"])
        target = mm.encode_target(caption)
        rows.append((prompt_ids + target, [IGNORE_INDEX] * len(prompt_ids) + target, [picture]))
    with torch.no_grad():
        expected = alone_loss(mm, rows)
        loss = CaptionObjective(mm)(packed).loss
    torch.testing.assert_close(loss, expected, rtol=0, atol=PACKED_ATOL)


def test_a_record_whose_tiled_image_alone_is_too_long_is_dropped_and_named(tmp_path,
                                                                          chat_tokenizer,
                                                                          tokenizer):
    mm = tiled_mm(chat_tokenizer, vocab_size=512, template="plain")
    counts = [mm.tower.num_image_tokens(size) for size in SIZES]  # 70, 72, 52
    limit = 64
    records = [
        {"id": "landscape", "image": "0.png",
         "conversations": [human("<image>"), gpt("the green tree")]},
        {"id": "strip", "image": "2.png", "conversations": [human("<image>"), gpt("blue")]},
        # Cut within its second answer, at max_length exactly (at the strip's 52 tokens).
        {"id": "cut", "image": "2.png", "conversations": [
            human("<image>"), gpt("blue"), human("and?"), gpt("two blue dogs " * 8)]},
        # At least 5 x 16 base-view tokens: dropped before any image is decoded.
        {"id": "five", "image": ["2.png"] * 5, "conversations": [human("<image>" * 5),
                                                                 gpt("blue")]},
    ]
    _, dataset = conversation_data(tmp_path, mm, records, max_length=limit)
    assert len(dataset) == 3
    assert dataset.records.skipped.named == [
        f"{tmp_path / 'data.jsonl'}:4 (id five): its 5 image(s) take at least 80 tokens, "
        f"more than max_length {limit}"]
    items = [dataset[index] for index in range(len(dataset))]
    for packing in (False, True):
        batch = ConversationCollate(mm, max_length=limit, packing=packing)(items)
        assert len(batch.pixel_values) == 2  # the strip whole, the cut record truncated
        kept = batch.pixel_values
        cut = mm.prepare(kept.input_ids[1:], kept.images[1:])
        assert cut.attention_mask.sum().item() == limit  # counted at 52 image tokens
        assert [(bad.path, bad.reason) for bad in batch.undecodable] == [
            (f"{tmp_path / 'data.jsonl'}:1 (id landscape)",
             f"its 1 image(s) take {counts[0]} tokens, more than max_length {limit}")]

    folder = tmp_path / "captions"
    write_caption_folder(folder)
    mm = tiled_mm(tokenizer)
    dataset = CaptionFolder(folder, folder / "captions.jsonl", mm.processor)
    batch = CaptionCollate(mm, packing=True, max_length=limit)(
        [dataset[index] for index in range(len(dataset))])
    assert len(batch.pixel_values) == 1
    assert [bad.path for bad in batch.undecodable] == [f"caption {CAPTIONS[0]!r}",
                                                       f"caption {CAPTIONS[1]!r}"]
    assert "more than max_length 64" in batch.undecodable[0].reason


def test_a_batch_without_images_runs_the_tiled_tower_on_one_blank_tile(tokenizer):
    """Stage 1 on a text-only batch: the tower runs on a blank tile-sized image (its views
    and size), which changes no value but gives the projector a (zero) gradient."""
    mm = tiled_mm(tokenizer).train_projector_only()
    idle = idle_image_features(mm)
    assert idle.shape == (mm.tower.num_image_tokens((32, 32)), 64)
    out = mm(["describe the picture"], targets=["a red square"])
    out.loss.backward()
    gradients = [p.grad for p in mm.tower.pooler.parameters()]
    assert all(g is not None and not g.any() for g in gradients)
