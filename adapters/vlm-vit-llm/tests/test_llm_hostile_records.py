"""Hostile conversation and caption records (issue 26): paths out of the image folder,
records whose images alone are too long, surrogates, deep nesting and CRLF arrays."""

import json
import os

import pytest
from conftest import tiny_llm, tiny_tower
from PIL import Image
from test_conversation_data import GOOD, gpt, human, write_images, write_records
from test_llm_train import write_captions

from vlm_vit.data.samples import UndecodableImage
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.records import ConversationRecords
from vlm_vit_llm.train import ConversationDataset, read_captions


@pytest.fixture
def wroot(tmp_path):
    """An image folder, with `outside/secret.png` beside it and a link out of it."""
    images = write_images(tmp_path / "wroot")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "outside" / "secret.png")
    os.symlink(tmp_path / "outside" / "secret.png", images / "link.png")
    return images


ESCAPES = ["../outside/secret.png", "{outside}/secret.png", "link.png",
           "sub/../../outside/secret.png"]


@pytest.mark.parametrize("name", ESCAPES)
def test_a_record_naming_an_image_outside_the_folder_is_a_bad_record(tmp_path, wroot, name):
    name = name.format(outside=tmp_path / "outside")
    escaping = {"id": "escape", "image": name,
                "conversations": [human("<image>\nwhat"), gpt("a secret")]}
    path = write_records(tmp_path / "data.jsonl", [GOOD[0], escaping, GOOD[2]])
    index = ConversationRecords(path, wroot)
    assert len(index) == 2 and index.skipped.count == 1
    assert index.skipped.by_reason == {"image outside the image folder": 1}
    assert "(id escape)" in index.skipped.named[0] and "outside the image folder" in \
        index.skipped.named[0]
    with pytest.raises(ValueError, match="outside the image folder"):
        ConversationRecords(path, wroot, strict=True)
    with pytest.raises(ValueError, match="outside the image folder"):  # unchecked files too
        ConversationRecords(path, wroot, strict=True, check_files=False)


@pytest.mark.parametrize("name", ESCAPES)
def test_a_captions_line_naming_an_image_outside_the_folder_is_refused(tmp_path, wroot, name):
    captions = write_captions(tmp_path / "data", ["a red square"])
    line = json.dumps({"image": name.format(outside=tmp_path / "outside"), "caption": "x"})
    captions.write_text(captions.read_text() + line + "\n")
    with pytest.raises(ValueError, match="line 2: .*outside the image folder"):
        read_captions(captions, wroot)


def test_records_whose_images_alone_pass_max_length_are_refused_at_indexing(
        tmp_path, tokenizer, monkeypatch):
    images = write_images(tmp_path / "images")
    # 200 images: within MAX_IMAGES (10,000 is a bad record at indexing, test_llm_trust.py)
    bomb = {"id": "bomb", "image": ["0.png"] * 200,
            "conversations": [human("<image>" * 200), gpt("x")]}
    path = write_records(tmp_path / "data.jsonl", [GOOD[0], bomb, GOOD[2]])
    records = ConversationRecords(path, images)
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
    decoded = []
    monkeypatch.setattr(type(mm.processor), "preprocess_one",
                        lambda self, image: decoded.append(image) or pytest.fail("decoded"))
    dataset = ConversationDataset(records, mm.processor, image_tokens=16, max_length=200)
    assert len(dataset) == 2 and len(dataset.lengths) == 2 and decoded == []
    assert records.skipped.by_reason == {"images longer than max_length": 1}
    assert "(id bomb)" in records.skipped.named[0]
    assert "200 image(s) take 3200 tokens, more than max_length 200" in \
        records.skipped.named[0]
    strict = ConversationRecords(path, images, strict=True)
    with pytest.raises(ValueError, match="id bomb"):
        strict.limit_length(200, 16)


def test_a_lone_surrogate_is_a_bad_record(tmp_path):
    images = write_images(tmp_path / "images")
    raw = json.dumps({"id": "sur", "conversations": [human("hi"), gpt("x")]})
    path = write_records(tmp_path / "data.jsonl", [GOOD[0], raw.replace("hi", "\\ud800")])
    index = ConversationRecords(path, images)
    assert len(index) == 1 and index.skipped.count == 1
    assert "(id sur)" in index.skipped.named[0] and "surrogate" in index.skipped.named[0]


def test_a_record_nested_too_deeply_is_a_bad_record_or_a_named_error(tmp_path):
    images = write_images(tmp_path / "images")
    deep = '{"id": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = write_records(tmp_path / "data.jsonl", [GOOD[0], deep, GOOD[2]])
    index = ConversationRecords(path, images)
    assert len(index) == 2 and index.skipped.by_reason == {"not JSON": 1}
    assert "data.jsonl:2" in index.skipped.named[0] and "nested" in index.skipped.named[0]
    array = tmp_path / "data.json"
    array.write_text("[" + json.dumps(GOOD[0]) + ",\n" + deep + "]")
    with pytest.raises(ValueError, match=r"data.json: the record at line 2 is nested"):
        ConversationRecords(array, images)


def test_a_captions_line_nested_too_deeply_is_refused_by_line(tmp_path):
    captions = write_captions(tmp_path / "data", ["a red square"])
    captions.write_text(captions.read_text() + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_captions(captions, tmp_path / "data")


def test_a_json_array_with_crlf_line_ends_reads_every_record(tmp_path):
    images = write_images(tmp_path / "images")
    path = tmp_path / "data.json"
    path.write_bytes(json.dumps(GOOD, indent=2, ensure_ascii=False).replace(
        "\n", "\r\n").encode())
    index = ConversationRecords(path, images)
    assert len(index) == len(GOOD)
    assert [index[i].turns[-1].text for i in range(len(GOOD))] == [
        record["conversations"][-1]["value"] for record in GOOD]


def test_a_record_changed_after_indexing_is_a_named_bad_item(tmp_path, tokenizer):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", GOOD)
    records = ConversationRecords(path, images)
    path.write_bytes(b"x" * path.stat().st_size)
    item = ConversationDataset(records, MultimodalLM(
        tiny_tower(), tiny_llm(), tokenizer).processor)[1]
    assert isinstance(item, UndecodableImage)
    assert str(path) in item.path and "not JSON" in item.reason
