"""LLaVA-format conversation data: reading, bad records, truncation, batching, training."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import photos, tiny_llm, tiny_tower
from PIL import Image

from vlm_vit.data.samples import UndecodableImage
from vlm_vit.train import TrainConfig, Trainer
from vlm_vit.train.distributed import GlobalBatchSampler
from vlm_vit_llm import IGNORE_INDEX, MultimodalLM
from vlm_vit_llm.chat import PRESETS, adopt_chat_template, chat_prompt
from vlm_vit_llm.objective import MODEL_DIR
from vlm_vit_llm.records import ConversationRecords, Turn
from vlm_vit_llm.train import (
    ConversationCollate,
    ConversationDataset,
    ConversationObjective,
    truncate,
)


def human(text):
    return {"from": "human", "value": text}


def gpt(text):
    return {"from": "gpt", "value": text}


GOOD = [
    {"id": "one", "image": "0.png",
     "conversations": [human("<image>\nWhat is in the image?"), gpt("two blue dogs"),
                       human("Which colour?"), gpt("blue")]},
    {"id": "two", "image": ["1.png", "2.png"],
     "conversations": [human("<image> and <image>: what differs?"), gpt("the green tree")]},
    {"id": "text", "conversations": [human("describe the picture"), gpt("a red square")]},
    {"id": "last", "image": "3.png",
     "conversations": [{"from": "system", "value": "Be brief."},
                       human("What is it? <image>"), gpt("one yellow star")]},
]


def write_images(folder, count=4):
    folder.mkdir(parents=True, exist_ok=True)
    for index, photo in enumerate(photos(count)):
        Image.fromarray(photo).save(folder / f"{index}.png")
    return folder


def write_records(path, records, lines=True):
    if lines:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                                for r in records))
    else:
        path.write_text(json.dumps(records, indent=2, ensure_ascii=False))
    return path


@pytest.mark.parametrize("lines", [True, False], ids=["jsonl", "json"])
def test_records_read_lazily_from_json_and_json_lines(tmp_path, lines):
    images = write_images(tmp_path / "images")
    records = [dict(GOOD[0], id="ünïcode ✓"), *GOOD[1:]]  # offsets are bytes, not characters
    path = write_records(tmp_path / ("data.jsonl" if lines else "data.json"), records, lines)
    index = ConversationRecords(path, images)
    assert len(index) == 4 and index.skipped.count == 0
    # Only numbers are kept per record, in numpy arrays (shared by forked workers).
    assert all(isinstance(getattr(index, name), np.ndarray)
               for name in ("starts", "ends", "lines", "image_counts", "text_lengths"))
    assert index.image_counts.tolist() == [1, 2, 0, 1]
    first, second, text, last = (index[i] for i in range(4))
    assert "ünïcode ✓" in first.where
    assert first.turns == [Turn("user", "<image>\nWhat is in the image?"),
                           Turn("assistant", "two blue dogs"), Turn("user", "Which colour?"),
                           Turn("assistant", "blue")]
    assert second.images == [images / "1.png", images / "2.png"]
    assert text.images == []
    assert last.turns[0] == Turn("system", "Be brief.")


BAD = [
    ("not json at all", "not JSON", None),
    ({"id": "many", "image": "0.png", "conversations": [human("<image> <image>"), gpt("x")]},
     "2 '<image>' placeholder(s) but 1 image(s)", "many"),
    ({"id": "few", "image": ["0.png", "1.png"], "conversations": [human("<image>"), gpt("x")]},
     "1 '<image>' placeholder(s) but 2 image(s)", "few"),
    ({"id": "gone", "image": "missing.png", "conversations": [human("<image>"), gpt("x")]},
     "no image", "gone"),
    ({"id": "role", "conversations": [{"from": "robot", "value": "hi"}, gpt("x")]},
     "unknown role 'robot'", "role"),
    ({"id": "empty", "conversations": []}, "non-empty list of turns", "empty"),
    ({"id": "mute", "conversations": [human("hello")]}, "no assistant", "mute"),
    ({"id": "late", "image": "0.png", "conversations": [human("hi"), gpt("<image>")]},
     "images go in human turns", "late"),
]


@pytest.mark.parametrize(("bad", "message", "record_id"), BAD,
                         ids=[m.split()[0] for _, m, _ in BAD])
def test_a_bad_record_is_skipped_and_named_or_refused_with_strict(tmp_path, caplog, bad,
                                                                  message, record_id):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", [GOOD[0], bad, GOOD[2]])
    index = ConversationRecords(path, images)
    assert len(index) == 2 and index.skipped.count == 1
    named = index.skipped.named[0]
    assert "data.jsonl:2" in named and message in named
    if record_id is not None:
        assert f"(id {record_id})" in named
    assert message in caplog.text
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        ConversationRecords(path, images, strict=True)
    assert "data.jsonl:2" in str(error.value)


def test_a_broken_json_array_is_refused_with_its_line(tmp_path):
    images = write_images(tmp_path / "images")
    path = tmp_path / "data.json"
    path.write_text(json.dumps(GOOD[:2], indent=1)[:-3] + "\n  oops\n]")
    with pytest.raises(ValueError, match="is not a JSON array of records"):
        ConversationRecords(path, images)
    empty = write_records(tmp_path / "empty.jsonl", ["not json"])
    with pytest.raises(ValueError, match="holds no usable records"):
        ConversationRecords(empty, images)


@pytest.fixture
def chat_mm(chat_tokenizer):
    return MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chat_tokenizer)


def test_truncation_never_cuts_through_an_image():
    image = 9
    ids = [1, 5, image, 6, 7, image, 8]
    # Each image is 4 positions: 1 5 [9 9 9 9] 6 7 [9 9 9 9] 8 = 13 positions.
    assert truncate(ids, image, 4, 13) == 7
    assert truncate(ids, image, 4, 12) == 6    # drops the 8
    assert truncate(ids, image, 4, 10) == 5    # the second image would be cut: it goes
    assert truncate(ids, image, 4, 5) == 2     # the first one too


def test_the_collate_truncates_and_drops_what_cannot_be_learned(tmp_path, chat_mm):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", GOOD)
    dataset = ConversationDataset(ConversationRecords(path, images), chat_mm.processor,
                                  image_tokens=chat_mm.tower.num_image_tokens())
    per_image = chat_mm.tower.num_image_tokens()
    items = [dataset[i] for i in range(4)]
    full = ConversationCollate(chat_mm, template="vicuna_v1")(items)
    assert len(full.pixel_values) == 4 and full.undecodable == []
    lengths = [len(ids) + ids.count(chat_mm.image_token_id) * (per_image - 1)
               for ids in full.pixel_values.input_ids]

    # Room for both images of record "two" but not its whole answer; record "one" is cut
    # after its first answer; the text-only record fits.
    limit = lengths[1] - 2
    collate = ConversationCollate(chat_mm, template="vicuna_v1", max_length=limit)
    batch = collate(items)
    assert [len(ids) for ids in batch.pixel_values.input_ids][1] == \
        len(full.pixel_values.input_ids[1]) - 2
    for ids, labels, pixels in zip(batch.pixel_values.input_ids, batch.pixel_values.labels,
                                   batch.pixel_values.images, strict=True):
        expanded = len(ids) + ids.count(chat_mm.image_token_id) * (per_image - 1)
        assert expanded <= limit
        assert ids.count(chat_mm.image_token_id) == len(pixels)
        assert any(label != IGNORE_INDEX for label in labels)

    # Two images of 16 tokens do not fit in 20: record "two" is dropped and named.
    small = ConversationCollate(chat_mm, template="vicuna_v1", max_length=2 * per_image - 1)
    batch = small(items)
    assert len(batch.pixel_values) < 4
    reasons = {bad.path: bad.reason for bad in batch.undecodable}
    two = next(path for path in reasons if "(id two)" in path)
    assert "2 image(s) take 32 tokens, more than max_length 31" in reasons[two]


def test_an_undecodable_image_drops_its_record_by_name(tmp_path, chat_mm):
    images = write_images(tmp_path / "images")
    (images / "2.png").write_bytes(b"not a png")
    path = write_records(tmp_path / "data.jsonl", GOOD)
    dataset = ConversationDataset(ConversationRecords(path, images), chat_mm.processor)
    item = dataset[1]
    assert isinstance(item, UndecodableImage)
    assert "(id two)" in item.path and "2.png" in item.path
    batch = ConversationCollate(chat_mm, template="vicuna_v1")([dataset[0], item])
    assert len(batch.pixel_values) == 1 and batch.undecodable == [item]


def test_batches_split_into_micro_batches_in_order(tmp_path, chat_mm):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", GOOD)
    dataset = ConversationDataset(ConversationRecords(path, images), chat_mm.processor)
    batch = ConversationCollate(chat_mm)([dataset[i] for i in range(4)]).pixel_values
    parts = batch.tensor_split(3)
    assert [len(p) for p in parts] == [2, 1, 1]
    assert sum((p.input_ids for p in parts), []) == batch.input_ids
    assert sum((p.images for p in parts), []) == batch.images


def test_length_grouped_batches_cover_the_epoch_once_and_hold_similar_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 500, size=400)
    lengths[::3] *= -1  # text-only records
    plain = GlobalBatchSampler(400, 8, seed=0)
    grouped = GlobalBatchSampler(400, 8, seed=0, lengths=lengths.tolist(), group_batches=10)
    batches = list(grouped)
    assert sorted(i for b in batches for i in b) == list(range(400))

    def spread(sampled):  # the share of padding in the padded batches
        padded = sum(np.abs(lengths[b]).max() * len(b) for b in sampled)
        return 1 - sum(np.abs(lengths[b]).sum() for b in sampled) / padded

    assert spread(batches) < spread(list(plain)) / 2.5  # measured: 0.13 against 0.42
    mixed = sum(len(set(np.sign(lengths[b]))) > 1 for b in batches)
    assert mixed <= 10  # at most one batch per window mixes the modalities
    # Deterministic, and a resume continues with the same batches.
    resumed = GlobalBatchSampler(400, 8, seed=0, lengths=lengths.tolist(), group_batches=10,
                                 start_batch=7)
    assert list(resumed) == batches[7:]
    # Two ranks split each global batch.
    halves = [list(GlobalBatchSampler(400, 8, seed=0, lengths=lengths.tolist(),
                                      group_batches=10, rank=r, world_size=2))
              for r in (0, 1)]
    assert [a + b for a, b in zip(*halves, strict=True)] == batches


def fit(mm, dataset, collate, run_dir, steps, lr, **config):
    settings = dict(steps=steps, batch_size=4, lr=lr, warmup_steps=5, weight_decay=0.0,
                    num_workers=0, checkpoint_every=0, log_every=100, device="cpu")
    return Trainer(ConversationObjective(mm), dataset, TrainConfig(**(settings | config)),
                   run_dir, collate=collate, progress=False).fit()


def test_training_learns_multi_turn_multi_image_and_text_only_records(tmp_path, chat_mm):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.json", GOOD, lines=False)
    dataset = ConversationDataset(ConversationRecords(path, images), chat_mm.processor,
                                  image_tokens=chat_mm.tower.num_image_tokens())
    mm = chat_mm.train_projector_only()
    mm.llm.requires_grad_(True)  # the tiny LLM learns the answers; the projector the images
    template = adopt_chat_template(mm.tokenizer, "vicuna_v1")
    result = fit(mm, dataset, ConversationCollate(mm), tmp_path / "run", steps=60, lr=1e-2,
                 group_by_length=True)
    assert result.losses[-1] < 0.2 * result.losses[0]
    mm.eval()
    for record_index in (0, 1):
        record = dataset.records[record_index]
        prompt = chat_prompt(mm.tokenizer, record.turns[:1], template)
        answer = mm.generate([prompt], [dataset[record_index].pixels], do_sample=False,
                             max_new_tokens=8)[0]
        assert answer == record.turns[1].text
    # The saved model keeps the template it learned with.
    loaded = MultimodalLM.from_pretrained(tmp_path / "run" / MODEL_DIR)
    assert loaded.tokenizer.chat_template == PRESETS["vicuna_v1"]


def test_group_by_length_needs_lengths(tmp_path, chat_mm):
    data = torch.utils.data.TensorDataset(torch.zeros(8, 3, 32, 32))
    with pytest.raises(ValueError, match="group_by_length needs a dataset with `lengths`"):
        fit(chat_mm, data, None, tmp_path / "run", steps=1, lr=1e-3, group_by_length=True)
