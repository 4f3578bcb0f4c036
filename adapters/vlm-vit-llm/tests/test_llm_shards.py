"""`vlm-vit llm train --data SHARDS`: caption and LLaVA tar shards give the folder datasets'
items and batches, train through the CLI, and bad samples are named and skipped."""

import io
import json
import logging
import pickle

import pytest
import torch
from conftest import photos, tiny_llm, tiny_tower
from PIL import Image
from test_conversation_data import gpt, human, write_images, write_records

from vlm_vit.cli import main
from vlm_vit.data.samples import UndecodableImage
from vlm_vit.data.shards import Sample, expand_shards, iter_samples
from vlm_vit.data.shards.writer import write_shards
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.records import ConversationRecords
from vlm_vit_llm.train import (
    CaptionCollate,
    CaptionFolder,
    CaptionShardDecode,
    ConversationCollate,
    ConversationDataset,
    ConversationItem,
    ConversationShardDecode,
)

CAPTION_LINES = [
    {"image": "0.png", "caption": "a red square"},
    {"image": "1.png", "caption": "two blue dogs", "prompt": "<image>\nWhat is it?"},
    {"image": "2.png", "caption": "the green tree"},
    {"image": "3.png", "caption": "one yellow star"},
]
# One image or none per record: a shard sample holds one image.
RECORDS = [
    {"id": "one", "image": "0.png",
     "conversations": [human("<image>\nWhat is in the image?"), gpt("two blue dogs"),
                       human("Which colour?"), gpt("blue")]},
    {"id": "text", "conversations": [human("describe the picture"), gpt("a red square")]},
    {"id": "role", "image": "1.png",
     "messages": [{"role": "user", "content": "<image> what is it?"},
                  {"role": "assistant", "content": "the green tree"}]},
    {"id": "last", "image": "3.png",
     "conversations": [{"from": "system", "value": "Be brief."},
                       human("What is it? <image>"), gpt("one yellow star")]},
]


def png_bytes(index: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(photos(index + 1)[index]).save(buffer, format="png")
    return buffer.getvalue()


def caption_shards(tmp_path):
    """Four captioned images as a folder, a captions file and two shards."""
    images = write_images(tmp_path / "images")
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps(line) + "\n" for line in CAPTION_LINES))
    write_shards(images, tmp_path / "shards", per_shard=3, captions=captions, progress=False)
    return images, captions, tmp_path / "shards"


def llava_shards(tmp_path):
    images = write_images(tmp_path / "images")
    records = write_records(tmp_path / "records.json", RECORDS, lines=False)
    write_shards(images, tmp_path / "shards", per_shard=3, llava=records, progress=False)
    return images, records, tmp_path / "shards"


def write_bad_shard(path, samples):
    import webdataset as wds

    with wds.TarWriter(str(path), encoder=False) as writer:
        for key, fields in samples.items():
            writer.write({"__key__": key, **fields})
    return str(path)


def shard_items(shards, decode, key):
    """The decoded samples of every shard once, by `key(sample)`."""
    return {key(sample): decode(sample) for sample in iter_samples(expand_shards(shards))}


def test_caption_shards_give_the_folder_items_and_batches(tmp_path, mm):
    images, captions, shards = caption_shards(tmp_path)
    folder = CaptionFolder(images, captions, mm.processor)
    decode = CaptionShardDecode(mm.processor, mm.image_token)
    pickle.dumps(decode)  # DataLoader workers may get copies
    by_image = shard_items(shards, decode, lambda sample: sample.json()["path"])
    assert sorted(by_image) == [line["image"] for line in CAPTION_LINES]
    expected = [folder[i] for i in range(len(folder))]
    got = [by_image[row.image.name] for row in folder.rows]
    for (pixels, caption, prompt), (their_pixels, their_caption, their_prompt) in zip(
            got, expected, strict=True):
        assert torch.equal(pixels, their_pixels)
        assert (caption, prompt) == (their_caption, their_prompt)
    assert got[1][2] == "<image>\nWhat is it?"  # a line's own prompt travels in the json

    collate = CaptionCollate(mm, prompt="<image>\nDescribe it.\n")
    ours, theirs = collate(got), collate(expected)
    assert torch.equal(ours.pixel_values, theirs.pixel_values)
    assert torch.equal(ours.labels, theirs.labels) and ours.undecodable == []


def test_llava_shards_give_the_folder_items_and_batches(tmp_path, chat_tokenizer):
    mm = MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chat_tokenizer)
    images, records, shards = llava_shards(tmp_path)
    dataset = ConversationDataset(ConversationRecords(records, images), mm.processor)
    decode = ConversationShardDecode(mm.processor, mm.image_token)
    pickle.dumps(decode)
    by_id = shard_items(shards, decode, lambda sample: sample.json()["id"])
    expected = [dataset[i] for i in range(len(dataset))]
    got = [by_id[record["id"]] for record in RECORDS]
    for ours, theirs, record in zip(got, expected, RECORDS, strict=True):
        assert isinstance(ours, ConversationItem), ours
        assert ours.where.endswith(f" (id {record['id']})") and ".tar:" in ours.where
        assert ours.turns == theirs.turns
        assert len(ours.pixels) == len(theirs.pixels) == ("image" in record)
        assert all(torch.equal(a, b) for a, b in zip(ours.pixels, theirs.pixels, strict=True))

    collate = ConversationCollate(mm, template="vicuna_v1")
    ours, theirs = collate(got).pixel_values, collate(expected).pixel_values
    assert ours.input_ids == theirs.input_ids and ours.labels == theirs.labels
    assert [len(row) for row in ours.images] == [1, 0, 1, 1]
    assert all(torch.equal(a, b) for row, their_row in zip(ours.images, theirs.images, strict=True)
               for a, b in zip(row, their_row, strict=True))


def test_bad_caption_samples_are_named_or_counted(mm):
    decode = CaptionShardDecode(mm.processor, mm.image_token)

    def sample(key, **fields):
        return Sample(key, "s.tar", 0, 0, 0, fields)

    pixels, caption, prompt = decode(sample("json", png=png_bytes(),
                                            json=b'{"caption": "a red square"}'))
    assert pixels.shape == (3, 32, 32) and (caption, prompt) == ("a red square", None)
    assert decode(sample("no-image", txt=b"a red square")) is None  # counted as no image
    cases = {"corrupt": ({"png": b"not a png", "txt": b"a red square"}, "s.tar:corrupt"),
             "mute": ({"png": png_bytes(), "json": b'{"path": "0.png"}'}, "no caption"),
             "list": ({"png": png_bytes(), "json": b"[1]"}, "is a list, not an object"),
             "broken": ({"png": png_bytes(), "json": b"{no"}, "its json field is not JSON"),
             "prompt": ({"png": png_bytes(), "txt": b"x", "json": b'{"prompt": "hi"}'},
                        "holding '<image>' once")}
    for key, (fields, reason) in cases.items():
        item = decode(sample(key, **fields))
        assert isinstance(item[0], UndecodableImage), key
        assert item[0].path == f"s.tar:{key}" and reason in item[0].reason, item
    batch = CaptionCollate(mm)([decode(sample(key, **fields))
                                for key, (fields, _) in cases.items()])
    assert [bad.path for bad in batch.undecodable] == [f"s.tar:{key}" for key in cases]


def test_bad_llava_samples_are_named_and_text_only_ones_kept(mm):
    decode = ConversationShardDecode(mm.processor, mm.image_token)

    def sample(key, record=None, **fields):
        if record is not None:
            fields["json"] = record if isinstance(record, bytes) else json.dumps(record).encode()
        return Sample(key, "s.tar", 0, 0, 0, fields)

    text_only = decode(sample("text", RECORDS[1]))
    assert isinstance(text_only, ConversationItem) and text_only.pixels == []
    # A record without "image" takes the sample's own.
    own = decode(sample("own", {"conversations": [human("<image>"), gpt("x")]},
                        png=png_bytes()))
    assert isinstance(own, ConversationItem) and own.pixels[0].shape == (3, 32, 32)
    cases = {
        "broken": ((b"{no", {}), "s.tar:broken", "its json field is not JSON"),
        "bare": ((None, {"png": png_bytes()}), "s.tar:bare", "no json field"),
        "lost": ((RECORDS[0], {}), "s.tar:lost (id one)", "needs image '0.png' but the sample"),
        "corrupt": ((RECORDS[0], {"png": b"not a png"}), "s.tar:corrupt (id one)",
                    "image s.tar:corrupt"),
        "many": (({"id": 7, "image": ["0.png", "1.png"],
                   "conversations": [human("<image><image>"), gpt("x")]}, {}),
                 "s.tar:many (id 7)", "names 2 images; a shard sample holds one"),
        "mute": (({"conversations": [human("hello")]}, {}), "s.tar:mute", "no assistant"),
    }
    for key, ((record, fields), where, reason) in cases.items():
        item = decode(sample(key, record, **fields))
        assert isinstance(item, UndecodableImage), key
        assert item.path == where and reason in item.reason, item


def cli_parts(tmp_path, tokenizer):
    tiny_tower().encoder.save_pretrained(tmp_path / "encoder")
    tiny_llm(vocab_size=512).save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    return ["llm", "train", "--tower", str(tmp_path / "encoder"), "--llm", str(tmp_path / "llm"),
            "--steps", "4", "--batch-size", "2", "--num-workers", "0", "--device", "cpu"]


def test_train_on_caption_shards_skips_and_names_bad_samples(tmp_path, tokenizer, capsys,
                                                              caplog):
    _, _, shards = caption_shards(tmp_path)
    bad = write_bad_shard(shards / "bad.tar", {
        "corrupt": {"png": b"not a png", "txt": b"a red square"},
        "mute": {"png": png_bytes(), "json": b'{"path": "0.png"}'},
        "no-image": {"txt": b"a red square"}})
    common = cli_parts(tmp_path, tokenizer)
    with caplog.at_level(logging.WARNING):
        assert main([*common, "--data", str(shards), "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "trained stage 1 for 4 steps" in captured.out
    assert f"skipping {bad}:corrupt (cannot load image {bad}:corrupt" in caplog.text
    assert f"skipping {bad}:mute (no caption" in caplog.text
    assert "skipped 1 shard samples without an image" in caplog.text
    assert "skipped 2 bad sample(s) of the shards (2 distinct" in captured.err
    assert (tmp_path / "run" / "model" / "multimodal_config.json").is_file()
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["objective"]["type"].endswith("CaptionObjective")


def test_train_on_llava_shards_skips_and_names_bad_records(tmp_path, chat_tokenizer, capsys,
                                                           caplog):
    _, _, shards = llava_shards(tmp_path)
    bad = write_bad_shard(shards / "bad.tar", {
        "broken": {"json": b"{no"},
        "lost": {"json": json.dumps(RECORDS[0]).encode()}})
    common = cli_parts(tmp_path, chat_tokenizer)
    with caplog.at_level(logging.WARNING):
        assert main([*common, "--data-format", "llava", "--data", f"{shards}/*.tar",
                     "--template", "plain", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "trained stage 1 for 4 steps" in captured.out
    assert f"skipping {bad}:broken (its json field is not JSON" in caplog.text
    assert f"skipping {bad}:lost (id one) (it needs image '0.png'" in caplog.text
    assert "without an image" not in caplog.text  # the text-only record is no such sample
    assert "skipped 2 bad sample(s) of the shards" in captured.err
    assert (tmp_path / "run" / "model" / "multimodal_config.json").is_file()
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["objective"]["type"].endswith("ConversationObjective")


@pytest.mark.parametrize(("extra", "message"), [
    (["--data-format", "llava", "--group-by-length"],
     "--group-by-length is for a folder or conversations file, not tar shards"),
    (["--captions", "captions.jsonl"], "--captions is for a folder or conversations file"),
    (["--data-format", "llava", "--image-folder", "images"], "LLaVA shards carry their images"),
    (["--data-format", "llava", "--strict"], "shards are checked as they stream"),
])
def test_folder_only_flags_are_refused_with_shards_in_one_line(tmp_path, capsys, extra,
                                                                message):
    shards = write_bad_shard(tmp_path / "00000.tar", {"a": {"txt": b"x"}})
    assert main(["llm", "train", "--data", shards, "--out", str(tmp_path / "run"),
                 "--tower", "none", "--llm", "none", *extra]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_missing_shards_are_named_before_the_model_loads(tmp_path, capsys):
    assert main(["llm", "train", "--data", str(tmp_path / "{00000..00003}.tar"), "--out",
                 str(tmp_path / "run"), "--tower", "none", "--llm", "none"]) == 1
    err = capsys.readouterr().err
    assert f"--data: shard {tmp_path}/00000.tar does not exist (4 of the 4 shards" in err
