"""A video in the bridge (issues 33, 41): a clip, `Video(frames)` (its frames, or their pixels
`[T, 3, H, W]`; a LLaVA record's `video`: its frames' paths) goes through the tower's temporal
patches as one visual item, `num_image_tokens((H, W), frames=T)` positions in the LLM, in
prompts, conversation records, padded and packed batches; only a `Video` is a clip (a tuple of
images is that many images); what cannot take a clip says so."""

import json

import numpy as np
import pytest
import torch
from conftest import LLM_WIDTH, tiny_llm, tiny_tower
from PIL import Image
from test_conversation_data import gpt, human, write_records
from test_llm_train_anyres import alone_loss, one_step

from vlm_vit import ImageProcessor, load_tower
from vlm_vit.data.shards import Sample
from vlm_vit.processor import NORMALIZATION
from vlm_vit_llm import MultimodalLM, Video
from vlm_vit_llm.chat import adopt_chat_template, tokenize_conversation
from vlm_vit_llm.records import ConversationRecords
from vlm_vit_llm.shard_decode import ConversationShardDecode
from vlm_vit_llm.train import (
    ConversationCollate,
    ConversationDataset,
    ConversationItem,
    ConversationObjective,
)

transformers = pytest.importorskip("transformers")

SIDE, FRAMES = 16, 3  # 4 x 4 patches of 4, merged 2 x 2: 4 tokens a temporal slice
LOSS_RTOL = 1e-6  # as test_llm_train_anyres: the objective's sum against the LLM's mean
PACKED_ATOL = 1e-5
RECORDS = [
    {"id": "clip", "video": ["v/0.png", "v/1.png", "v/2.png"],
     "conversations": [human("<image>\nWhat happens?"), gpt("the red square moves")]},
    {"id": "photo", "image": "v/0.png",
     "conversations": [human("<image> and?"), gpt("a green tree")]},
    {"id": "text", "conversations": [human("describe the picture"), gpt("two blue dogs")]},
]


def video_mm(tmp_path, tokenizer, template=None):
    """Qwen2-VL's vision tower at tiny size (temporal patches of 2, its merger into the LLM's
    width) on a tiny Llama."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=LLM_WIDTH, num_heads=4,
                                 patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
    Qwen2VisionTransformerPretrainedModel(config).save_pretrained(tmp_path / "qwen2_vl")
    mean, std = NORMALIZATION["clip"]
    mm = MultimodalLM(load_tower(tmp_path / "qwen2_vl"), tiny_llm(vocab_size=512), tokenizer,
                      processor=ImageProcessor(size=SIDE, mean=mean, std=std))
    if template is not None:
        adopt_chat_template(mm.tokenizer, template)
    return mm


def write_frames(folder):
    (folder / "v").mkdir(parents=True, exist_ok=True)
    for index in range(FRAMES):
        pixels = np.random.default_rng(index).integers(0, 256, (SIDE, SIDE, 3))
        Image.fromarray(pixels.astype(np.uint8)).save(folder / "v" / f"{index}.png")
    return folder


def test_a_clip_in_a_prompt_is_its_temporal_slices_tokens(tmp_path, tokenizer):
    mm = video_mm(tmp_path, tokenizer)
    clip = torch.randn(FRAMES, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(1))
    count = mm.tower.num_image_tokens((SIDE, SIDE), frames=FRAMES)
    assert count == 2 * mm.tower.num_image_tokens((SIDE, SIDE)) == 8  # 3 frames: 2 slices
    for given in (Video(clip), Video(tuple(clip))):  # its pixels, or its frames
        batch = mm.prepare(["<image>\nWhat happens?"], [[given]])
        assert batch.image_mask.sum().item() == count
        with torch.no_grad():
            embedded = mm.embed(batch)[batch.image_mask]
            assert torch.equal(embedded, mm.tower([clip])[0])
    with torch.no_grad():  # a clip beside an image in one prompt: one packed tower call
        batch = mm.prepare(["<image> then <image>"], [[Video(clip), clip[0]]])
        tokens = mm.embed(batch)[batch.image_mask]
        expected = torch.cat(mm.tower([clip, clip[0]]))
    assert torch.equal(tokens, expected) and len(tokens) == count + 4
    assert mm.generate(["<image>\nWhat happens?"], [[Video(clip)]], max_new_tokens=2)


def test_a_tuple_of_images_is_images_and_only_a_video_is_a_clip(tmp_path, tokenizer):
    mm = video_mm(tmp_path, tokenizer)
    frames = tuple(torch.randn(FRAMES, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(2)))
    image_tokens = mm.tower.num_image_tokens((SIDE, SIDE))
    clip_tokens = mm.tower.num_image_tokens((SIDE, SIDE), frames=FRAMES)
    assert (image_tokens, clip_tokens) == (4, 8)
    as_images = mm.prepare(["<image>" * FRAMES], [frames])  # a tuple of 3 images: 3 images
    assert as_images.image_mask.sum().item() == FRAMES * image_tokens == 12
    as_clip = mm.prepare(["<image>"], [[Video(frames)]])  # a Video of 3 frames: one clip
    assert as_clip.image_mask.sum().item() == clip_tokens
    with torch.no_grad():
        assert torch.equal(as_clip.image_features, mm.tower([torch.stack(frames)])[0])
    with pytest.raises(ValueError, match="prompt 0: a tuple of 3 is not an image"):
        mm.prepare(["<image>"], [[frames]])  # no clip from nesting
    with pytest.raises(ValueError, match=r"prompt 0: a pixel tensor of 3 frames .* Video"):
        mm.prepare(["<image>"], [[torch.stack(frames)]])  # nor from a tensor's rank
    with pytest.raises(ValueError, match="give a clip as Video"):
        mm.image_features([torch.stack(frames)])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_video_record_trains_as_the_record_built_by_hand(tmp_path, chat_tokenizer, packing):
    mm = video_mm(tmp_path, chat_tokenizer, template="vicuna_v1").train_projector_only()
    folder = write_frames(tmp_path / "data")
    records = ConversationRecords(write_records(tmp_path / "data.jsonl", RECORDS), folder)
    assert records.image_counts.tolist() == [1, 1, 0] and records.has_videos
    collate = ConversationCollate(mm, max_length=256, packing=packing)
    dataset = ConversationDataset(records, mm.processor, image_tokens=collate.image_tokens,
                                  max_length=256)
    items = [dataset[index] for index in range(len(dataset))]
    frames = [mm.processor.preprocess_one(folder / "v" / f"{i}.png") for i in range(FRAMES)]
    assert torch.equal(items[0].pixels[0].frames, torch.stack(frames))

    assert collate.count_tokens(items[0].pixels[0]) == 8  # what packing and truncation use
    batch = collate(items)
    assert batch.undecodable == []
    rows = []
    for item, pixels in zip(items, ([Video(torch.stack(frames))], [frames[0]], []),
                            strict=True):
        ids, labels = tokenize_conversation(mm.tokenizer, item.turns, mm.tokenizer.chat_template)
        rows.append((ids, labels, pixels))
    with torch.no_grad():
        loss = ConversationObjective(mm)(batch.pixel_values).loss
        if packing:
            torch.testing.assert_close(loss, alone_loss(mm, rows), atol=PACKED_ATOL, rtol=0)
        else:
            prepared = mm.prepare([r[0] for r in rows], [r[2] for r in rows],
                                  token_labels=[r[1] for r in rows])
            assert prepared.image_mask.sum().item() == 8 + 4
            torch.testing.assert_close(loss, mm.run(prepared).loss, rtol=LOSS_RTOL, atol=0)
    result = one_step(ConversationObjective(mm), dataset, collate, tmp_path / "run", 3)
    assert result.losses[0] == pytest.approx(loss.item(), rel=LOSS_RTOL)  # measured 1.1e-7


def test_a_clip_is_refused_where_it_cannot_go(tmp_path, tokenizer, chat_tokenizer):
    plain = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
    with pytest.raises(ValueError, match=r"prompt 0: a clip of 3 frames needs a tower with "
                                         r"temporal patches"):
        plain.prepare(["<image>"], [[Video(torch.zeros(3, 3, 32, 32))]])
    folder = write_frames(tmp_path / "data")
    bad = [
        {"id": "file", "video": "v.mp4", "conversations": [human("<image>"), gpt("x")]},
        {"id": "both", "image": "v/0.png", "video": ["v/1.png"],
         "conversations": [human("<image>"), gpt("x")]},
        {"id": "empty", "video": [], "conversations": [human("<image>"), gpt("x")]},
        {"id": "outside", "video": ["v/0.png", "../x.png"],
         "conversations": [human("<image>"), gpt("x")]},
        {"id": "missing", "video": ["v/0.png", "v/9.png"],
         "conversations": [human("<image>"), gpt("x")]},
        {"id": "rate", "video": ["v/0.png"], "fps": 0, "conversations": [human("<image>"),
                                                                      gpt("x")]},
        {"id": "rate of an image", "image": "v/0.png", "fps": 2,
         "conversations": [human("<image>"), gpt("x")]},
        RECORDS[0],
    ]
    records = ConversationRecords(write_records(tmp_path / "bad.jsonl", bad), folder)
    assert len(records) == 1
    reasons = dict(records.skipped.by_reason)
    assert reasons == {"malformed video field": 2, "image and video": 1,
                       "image outside the image folder": 1, "missing image": 1,
                       "malformed fps": 2}
    assert records[0].images[0].fps is None
    timed = ConversationRecords(write_records(tmp_path / "timed.jsonl",
                                              [{**RECORDS[0], "fps": 2.5}]), folder)
    assert timed[0].images[0].fps == 2.5
    item = ConversationDataset(records, plain.processor)[0]  # decodes; the collate refuses
    batch = ConversationCollate(plain, max_length=256)([item])
    assert [u.reason for u in batch.undecodable] == [
        "a clip needs a tower with temporal patches (temporal_patch_size); this one has none"]


@pytest.mark.parametrize("fields", [{}, {"png": b"an image"}], ids=["alone", "with-image"])
def test_a_video_record_in_a_shard_is_named(tokenizer, fields):
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
    record = json.dumps(RECORDS[0]).encode()
    sample = Sample("clip", "s.tar", 0, 0, 0, {"json": record, **fields})
    item = ConversationShardDecode(mm.processor, mm.image_token)(sample)
    assert not isinstance(item, ConversationItem)
    assert item.path == "s.tar:clip (id clip)"
    assert "a video record" in item.reason and "from a folder" in item.reason
