import functools
import json
import logging
import os
import re
import tarfile

import numpy as np
import pytest
import skimage.data
import webdataset
from PIL import Image
from sklearn.datasets import load_digits

from vlm_vit.cli import main
from vlm_vit.data.shards import writer as shard_writer
from vlm_vit.data.shards.writer import write_shards

PHOTOS = ("astronaut", "camera", "coffee", "chelsea")


@functools.cache
def photo(name, size=(20, 16)):
    return Image.fromarray(getattr(skimage.data, name)()).resize(size)


@functools.cache
def digits():
    return load_digits()


def digit(index):
    pixels = (digits().images[index] * 255 / 16).astype(np.uint8)
    return Image.fromarray(pixels).resize((16, 16))


@pytest.fixture
def folder(tmp_path):
    """20 images: 4 photos as PNG, 4 as JPEG (one with an upper-case suffix), 12 digits."""
    root = tmp_path / "images"
    (root / "photos").mkdir(parents=True)
    (root / "digits" / "deeper").mkdir(parents=True)
    for name in PHOTOS:
        photo(name).save(root / "photos" / f"{name}.png")
        photo(name).convert("RGB").save(root / f"{name}.jpg")
    (root / "chelsea.jpg").rename(root / "chelsea.JPEG")
    for index in range(12):
        digit(index).save(root / "digits" / ("deeper" if index % 2 else "") / f"{index}.png")
    (root / "notes.txt").write_text("not an image")
    return root


@pytest.fixture
def class_folder(tmp_path):
    """Four classes, sorted by name: digit classes 0, 1, 2 (4 images each) and photos."""
    root = tmp_path / "classes"
    for label in range(3):
        (root / str(label)).mkdir(parents=True)
        for n, index in enumerate(np.flatnonzero(digits().target == label)[:4]):
            digit(index).save(root / str(label) / f"{n}.png")
    (root / "photo").mkdir()
    for name in PHOTOS:
        photo(name).convert("RGB").save(root / "photo" / f"{name}.jpg")
    return root


def read_tars(out):
    """Per shard name: the samples in tar order, each {"__key__": key, suffix: bytes}."""
    shards = {}
    for path in sorted(out.glob("*.tar")):
        samples = {}
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                key, suffix = member.name.split(".", 1)
                samples.setdefault(key, {"__key__": key})[suffix] = tar.extractfile(
                    member).read()
        shards[path.name] = list(samples.values())
    return shards


def read_webdataset(out, index):
    urls = [str(out / shard["name"]) for shard in index["shards"]]
    return [{k: v for k, v in sample.items() if not k.startswith("__") or k == "__key__"}
            for sample in webdataset.WebDataset(urls, shardshuffle=False)]


def samples_of(out):
    return [sample for shard in read_tars(out).values() for sample in shard]


def meta(sample):
    return json.loads(sample["json"].decode("utf-8"))


def shards(tmp_path, source, *options):
    out = tmp_path / "out"
    return main(["shards", str(source), "--out", str(out), "--quiet", *options]), out


def test_a_folder_becomes_shards_of_the_same_bytes(tmp_path, folder, capsys):
    code, out = shards(tmp_path, folder, "--per-shard", "6")
    assert code == 0
    assert capsys.readouterr().out.strip() == f"wrote 20 samples in 4 shards to {out} (0 skipped)"
    index = json.loads((out / "dataset.json").read_text())
    assert index == {"format": "vlm-vit-shards", "version": 1, "kind": "images",
                     "classes": None, "samples": 20, "skipped": [], "seed": 0,
                     "shards": [{"name": f"0000{n}.tar", "samples": size}
                                for n, size in enumerate([6, 6, 6, 2])]}
    tars = read_tars(out)
    assert list(tars) == [shard["name"] for shard in index["shards"]]
    assert [len(samples) for samples in tars.values()] == [6, 6, 6, 2]
    samples = [sample for shard in tars.values() for sample in shard]
    assert [s["__key__"] for s in samples] == [f"{n:09d}" for n in range(20)]
    sources = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
               if p.suffix.lower() in {".png", ".jpg", ".jpeg"}}
    assert sorted(meta(s)["path"] for s in samples) == sorted(sources)  # each exactly once
    for sample in samples:
        path = sources[meta(sample)["path"]]
        suffix = path.suffix.lower()[1:]
        assert set(sample) == {"__key__", suffix, "json"}
        assert sample[suffix] == path.read_bytes()  # copied, not re-encoded
        assert meta(sample) == {"path": path.relative_to(folder).as_posix()}
    assert any("jpeg" in sample for sample in samples)  # chelsea.JPEG, lower-cased
    assert read_webdataset(out, index) == samples
    assert sorted(p.name for p in out.iterdir()) == [*tars, "dataset.json"]  # no .tmp left


def test_the_api_returns_the_index_it_writes(tmp_path, folder):
    index = write_shards(folder, tmp_path / "out", per_shard=7, progress=False)
    assert index == json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert [shard["samples"] for shard in index["shards"]] == [7, 7, 6]


def test_classes_are_written_and_shuffled_across_shards(tmp_path, class_folder):
    code, out = shards(tmp_path, class_folder, "--classes", "--per-shard", "4")
    assert code == 0
    index = json.loads((out / "dataset.json").read_text())
    assert index["kind"] == "classes" and index["classes"] == ["0", "1", "2", "photo"]
    tars = read_tars(out)
    samples = [sample for shard in tars.values() for sample in shard]
    assert len(samples) == index["samples"] == 16
    for sample in samples:
        folder_name = meta(sample)["path"].split("/")[0]
        assert meta(sample)["class"] == folder_name
        assert sample["cls"] == str(index["classes"].index(folder_name)).encode("ascii")
        suffix = "jpg" if folder_name == "photo" else "png"
        assert sample[suffix] == (class_folder / meta(sample)["path"]).read_bytes()
    # Sorted, every shard of 4 would hold one class; shuffled, they mix.
    assert any(len({s["cls"] for s in shard}) > 1 for shard in tars.values())
    assert read_webdataset(out, index) == samples


def order(out):
    return [meta(sample)["path"] for sample in samples_of(out)]


def test_shuffling_changes_the_order_not_the_set_and_the_seed_repeats_it(tmp_path, folder):
    runs = {}
    for name, options in {"sorted": ["--no-shuffle"], "seed0": [], "again": ["--seed", "0"],
                          "seed1": ["--seed", "1"]}.items():
        out = tmp_path / name
        assert main(["shards", str(folder), "--out", str(out), "--quiet", *options]) == 0
        runs[name] = order(out)
    assert runs["sorted"] == [p.relative_to(folder).as_posix() for p in sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix != ".txt")]
    assert runs["seed0"] == runs["again"]
    assert runs["seed0"] != runs["sorted"] and runs["seed1"] != runs["seed0"]
    assert sorted(runs["seed0"]) == sorted(runs["seed1"]) == sorted(runs["sorted"])
    assert json.loads((tmp_path / "sorted" / "dataset.json").read_text())["seed"] is None
    assert json.loads((tmp_path / "seed1" / "dataset.json").read_text())["seed"] == 1


def test_captions_go_to_txt_and_a_missing_image_is_skipped(tmp_path, folder, capsys):
    rows = [{"image": "photos/astronaut.png", "caption": "an astronaut, ünïcode"},
            {"image": "coffee.jpg", "caption": "a cup of coffee", "prompt": "Describe:"},
            {"image": "photos/missing.png", "caption": "nothing there"},
            {"image": "photos/astronaut.png", "caption": "a second caption"}]
    captions = tmp_path / "captions.jsonl"
    captions.write_text("\n".join(json.dumps(row) for row in rows[:2]) + "\n\n"
                        + "\n".join(json.dumps(row) for row in rows[2:]) + "\n")
    code, out = shards(tmp_path, folder, "--captions", str(captions), "--no-shuffle")
    assert code == 0
    assert capsys.readouterr().out.strip() == f"wrote 3 samples in 1 shards to {out} (1 skipped)"
    index = json.loads((out / "dataset.json").read_text())
    assert index["kind"] == "captions" and index["samples"] == 3
    assert [s["path"] for s in index["skipped"]] == ["photos/missing.png"]
    samples = samples_of(out)
    for sample, row in zip(samples, [rows[0], rows[1], rows[3]], strict=True):
        assert sample["txt"].decode("utf-8") == row["caption"]
        assert meta(sample) == {"path": row["image"], **{k: v for k, v in row.items()
                                                         if k != "image"}}
        suffix = row["image"].rsplit(".", 1)[1]
        assert sample[suffix] == (folder / row["image"]).read_bytes()
    assert read_webdataset(out, index) == samples


LLAVA = [
    {"id": "a", "image": "photos/camera.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?"},
        {"from": "gpt", "value": "A man with a camera."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Hello"},
                                  {"from": "gpt", "value": "Hi."}]},
    {"id": "c", "image": "gone.jpg", "conversations": []},
    {"id": "d", "image": "chelsea.JPEG", "conversations": [
        {"from": "human", "value": "<image>\nAnimal?"}, {"from": "gpt", "value": "A cat."}]},
]


@pytest.mark.parametrize("layout", ["array", "lines"])
def test_llava_records_are_kept_whole(tmp_path, folder, layout):
    llava = tmp_path / "llava.json"
    llava.write_text(json.dumps(LLAVA, indent=1) if layout == "array"
                     else "\n".join(json.dumps(record) for record in LLAVA))
    code, out = shards(tmp_path, folder, "--llava", str(llava), "--no-shuffle")
    assert code == 0
    index = json.loads((out / "dataset.json").read_text())
    assert index["kind"] == "llava" and index["samples"] == 3
    assert index["skipped"][0]["path"] == "gone.jpg"
    samples = samples_of(out)
    kept = [LLAVA[0], LLAVA[1], LLAVA[3]]
    assert [meta(s) for s in samples] == [{"path": r.get("image"), **r} for r in kept]
    assert set(samples[1]) == {"__key__", "json"}  # text only
    assert samples[0]["png"] == (folder / "photos" / "camera.png").read_bytes()
    assert samples[2]["jpeg"] == (folder / "chelsea.JPEG").read_bytes()
    assert read_webdataset(out, index) == samples


def test_a_corrupt_image_is_skipped_and_named(tmp_path, folder, capsys, caplog):
    (folder / "photos" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    (folder / "zero.jpg").write_bytes(b"")
    damaged = bytearray((folder / "digits" / "0.png").read_bytes())
    damaged[damaged.index(b"IDAT") + 6] ^= 0xFF  # opens, but its checksum fails verify()
    (folder / "digits" / "damaged.png").write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING, logger="vlm_vit.data.shards.writer"):
        code, out = shards(tmp_path, folder, "--per-shard", "8")
    assert code == 0
    assert capsys.readouterr().out.strip() == f"wrote 20 samples in 3 shards to {out} (3 skipped)"
    index = json.loads((out / "dataset.json").read_text())
    assert sorted(s["path"] for s in index["skipped"]) == ["digits/damaged.png",
                                                           "photos/broken.png", "zero.jpg"]
    assert all(s["reason"] for s in index["skipped"])
    assert all(name in caplog.text for name in ("damaged.png", "broken.png", "zero.jpg"))
    assert [shard["samples"] for shard in index["shards"]] == [8, 8, 4]
    paths = [meta(sample)["path"] for sample in samples_of(out)]
    assert not {"digits/damaged.png", "photos/broken.png", "zero.jpg"} & set(paths)
    assert len(paths) == 20
    assert [s["__key__"] for s in samples_of(out)] == [f"{n:09d}" for n in range(20)]


def test_the_summary_counts_the_skipped(tmp_path, folder, capsys):
    (folder / "broken.png").write_bytes(b"not a png at all")
    code, out = shards(tmp_path, folder)
    assert code == 0
    assert capsys.readouterr().out.strip() == f"wrote 20 samples in 1 shards to {out} (1 skipped)"


def test_an_existing_folder_is_refused_and_overwrite_replaces_only_its_own(tmp_path, folder,
                                                                            capsys):
    code, out = shards(tmp_path, folder, "--per-shard", "3")
    assert code == 0 and len(list(out.glob("*.tar"))) == 7
    before = (out / "00000.tar").read_bytes()
    capsys.readouterr()
    assert shards(tmp_path, folder, "--per-shard", "15")[0] == 1
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "00000.tar").read_bytes() == before and len(list(out.glob("*.tar"))) == 7
    (out / "README.md").write_text("mine")
    (out / ".00009.tar.tmp").write_bytes(b"a crashed run's leftover")
    assert shards(tmp_path, folder, "--per-shard", "15", "--overwrite")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["00000.tar", "00001.tar", "README.md",
                                                     "dataset.json"]
    assert [len(s) for s in read_tars(out).values()] == [15, 5]
    assert json.loads((out / "dataset.json").read_text())["samples"] == 20


def test_a_failure_half_way_leaves_whole_shards_and_no_index(tmp_path, folder, monkeypatch):
    entries, calls = shard_writer._entries, []

    def failing(sample, skipped):
        calls.append(sample)
        if len(calls) == 8:
            raise RuntimeError("disk on fire")
        return entries(sample, skipped)

    monkeypatch.setattr(shard_writer, "_entries", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_shards(folder, tmp_path / "out", per_shard=3, progress=False)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["00000.tar", "00001.tar"]
    assert [len(s) for s in read_tars(out).values()] == [3, 3]


@pytest.mark.parametrize("make, options, message", [
    (lambda root, tmp: tmp / "nowhere", [], "nowhere does not exist"),
    (lambda root, tmp: root / "notes.txt", [], "notes.txt is not a folder"),
    (lambda root, tmp: (tmp / "empty").mkdir() or tmp / "empty", [], "empty holds no image"),
    (lambda root, tmp: root, ["--per-shard", "0"], "per-shard must be at least 1, got 0"),
    (lambda root, tmp: root, ["--captions", "c.jsonl", "--llava", "l.json"], "not both"),
    (lambda root, tmp: root, ["--classes", "--captions", "c.jsonl"], "do not combine"),
    (lambda root, tmp: root / "photos", ["--classes"], "at least 2 classes"),
    (lambda root, tmp: root, ["--captions", "CAPTIONS"], "captions.jsonl line 2 is not JSON"),
    (lambda root, tmp: root, ["--captions", "MISSING"], "no captions file"),
    (lambda root, tmp: root, ["--llava", "CAPTIONS"], "llava.jsonl line 2 is not JSON"),
    (lambda root, tmp: root, ["--llava", "MISSING"], "missing.json"),
])
def test_user_errors_are_one_line(tmp_path, folder, capsys, make, options, message):
    bad = '{"image": "coffee.jpg", "caption": "fine"}\n{"image": oops\n'
    (tmp_path / "captions.jsonl").write_text(bad)
    (tmp_path / "llava.jsonl").write_text(bad)
    where = {"CAPTIONS": str(tmp_path / "captions.jsonl"), "MISSING": str(
        tmp_path / "missing.json")}
    if "--llava" in options and "CAPTIONS" in options:
        where["CAPTIONS"] = str(tmp_path / "llava.jsonl")
    options = [where.get(option, option) for option in options]
    code, out = shards(tmp_path, make(folder, tmp_path), *options)
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("vlm-vit shards: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # nothing written for a user error


def test_when_no_image_reads_nothing_is_left(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.png").write_bytes(b"nope")
    code, out = shards(tmp_path, tmp_path / "bad")
    assert code == 1 and "none of the 1 images" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture
def outside(tmp_path):
    """A readable image beside the image folder, which no record may reach."""
    (tmp_path / "outside").mkdir()
    photo("coffee").save(tmp_path / "outside" / "secret.png")
    return tmp_path / "outside" / "secret.png"


@pytest.mark.parametrize("make_name", [
    lambda root, secret: "../outside/secret.png",
    lambda root, secret: str(secret),  # absolute
    lambda root, secret: "photos/../../outside/secret.png",
    lambda root, secret: (root / "photos" / "link.png").symlink_to(secret) or "photos/link.png",
], ids=["dotdot", "absolute", "inner-dotdot", "symlink"])
@pytest.mark.parametrize("source", ["llava", "captions"])
def test_a_record_image_outside_the_folder_is_skipped_and_named(
        tmp_path, folder, outside, caplog, capsys, source, make_name):
    name = make_name(folder, outside)
    rows = [{"image": "coffee.jpg", "caption": "a cup"}, {"image": name, "caption": "secret"}]
    if source == "llava":
        rows = [{"id": str(n), "image": row["image"], "conversations": []}
                for n, row in enumerate(rows)]
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="vlm_vit.data.shards.writer"):
        code, out = shards(tmp_path, folder, f"--{source}", str(records), "--no-shuffle")
    assert code == 0
    assert capsys.readouterr().out.strip() == f"wrote 1 samples in 1 shards to {out} (1 skipped)"
    index = json.loads((out / "dataset.json").read_text())
    assert index["skipped"] == [{"path": name, "reason": "image outside the image folder"}]
    assert name in caplog.text
    secret = outside.read_bytes()
    assert [meta(s)["path"] for s in samples_of(out)] == ["coffee.jpg"]
    assert all(secret not in path.read_bytes() for path in out.glob("*.tar"))


def test_a_folder_image_that_links_outside_is_still_written(tmp_path, folder, outside):
    """Only paths a records file names are held to the folder: a folder of links (a class
    subset made with `ln -s`) is the user's own choice of files."""
    (folder / "photos" / "link.png").symlink_to(outside)
    index = write_shards(folder, tmp_path / "out", progress=False)
    assert index["samples"] == 21 and index["skipped"] == []


@pytest.mark.parametrize("kind", ["dds", "im"])
@pytest.mark.parametrize("layout", ["folder", "captions"])
def test_an_image_pil_fails_on_in_any_way_is_skipped_and_named(
        tmp_path, folder, caplog, capsys, kind, layout):
    """DDS: PIL raises NotImplementedError; IM: it opens and passes verify(), and loading it
    raises TypeError. Neither may reach a shard."""
    from tests.hostile_images import HOSTILE

    (folder / "photos" / "hostile.jpg").write_bytes(HOSTILE[kind]())
    options = []
    if layout == "captions":
        captions = tmp_path / "captions.jsonl"
        captions.write_text("\n".join(json.dumps({"image": image, "caption": "x"}) for image in
                                      ("coffee.jpg", "photos/hostile.jpg")) + "\n")
        options = ["--captions", str(captions)]
    with caplog.at_level(logging.WARNING, logger="vlm_vit.data.shards.writer"):
        code, out = shards(tmp_path, folder, *options)
    assert code == 0
    written = 1 if layout == "captions" else 20
    assert capsys.readouterr().out.strip() == \
        f"wrote {written} samples in 1 shards to {out} (1 skipped)"
    (skipped,) = json.loads((out / "dataset.json").read_text())["skipped"]
    assert skipped["path"] == "photos/hostile.jpg"
    assert ("NotImplementedError" if kind == "dds" else "TypeError") in skipped["reason"]
    assert "hostile.jpg" in caplog.text
    assert "photos/hostile.jpg" not in [meta(s)["path"] for s in samples_of(out)]


def test_a_decompression_bomb_header_is_skipped_not_written(tmp_path, folder):
    from tests.hostile_images import huge_png

    (folder / "bomb.png").write_bytes(huge_png())
    index = write_shards(folder, tmp_path / "out", progress=False)
    assert [s["path"] for s in index["skipped"]] == ["bomb.png"]
    assert "too large" in index["skipped"][0]["reason"]


@pytest.mark.parametrize("where", ["same", "inside", "link"])
def test_an_out_in_the_image_folder_is_refused_and_nothing_deleted(tmp_path, folder, capsys,
                                                                   where):
    (folder / "00000.tar").write_bytes(b"a user's tar among the images")
    (folder / "dataset.json").write_text("{}")
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    out = {"same": folder, "inside": folder / "digits" / "shards",
           "link": tmp_path / "link"}[where]
    if where == "link":
        out.symlink_to(folder / "photos")
    code = main(["shards", str(folder), "--out", str(out), "--overwrite", "--quiet"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("vlm-vit shards: error: ") and len(err.strip().splitlines()) == 1
    where = "is" if where == "same" else "is inside"
    assert f"output folder {out} {where} the image folder {folder}; write the shards" in err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert not (folder / "digits" / "shards").exists()


@pytest.mark.parametrize("source, line, message", [
    ("llava", '{"id": "\\ud800", "image": "coffee.jpg", "conversations": []}',
     r"line 2 holds a lone surrogate \('\\ud800'\)"),
    ("llava", '{"id": "x", "image": "\\udfff.png", "conversations": []}',
     r"line 2 holds a lone surrogate \('\\udfff'\)"),
    ("llava", "[" * 100_000 + "]" * 100_000, "line 2 is nested too deeply"),
    ("llava-array", "[" * 100_000 + "]" * 100_000, "is nested too deeply"),
    ("captions", '{"image": "coffee.jpg", "caption": "\\ud800"}',
     r"line 2 holds a lone surrogate \('\\ud800'\)"),
])
def test_a_record_json_cannot_hold_is_one_line_naming_it(tmp_path, folder, capsys, source,
                                                          line, message):
    """A lone surrogate (a `\\ud800` escape) cannot be written as UTF-8, and json recurses
    once per bracket: each was an unnamed error or a traceback, after reading every record."""
    records = tmp_path / "records.jsonl"
    good = '{"id": "a", "image": "coffee.jpg", "caption": "fine", "conversations": []}'
    records.write_text(line if source == "llava-array" else f"{good}\n{line}\n")
    flag = "--captions" if source == "captions" else "--llava"
    code, out = shards(tmp_path, folder, flag, str(records))
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("vlm-vit shards: error: ") and len(err.splitlines()) == 1
    assert str(records) in err
    assert re.search(message, err), err
    assert not out.exists()


def test_a_file_name_that_is_not_utf8_is_skipped_by_its_escaped_name(tmp_path, folder,
                                                                     caplog):
    """Its json entry could not be written: one such file ended the whole run, unnamed."""
    (folder / os.fsdecode(b"photos/\xff.png")).write_bytes((folder / "coffee.jpg").read_bytes())
    with caplog.at_level(logging.WARNING, logger="vlm_vit.data.shards.writer"):
        index = write_shards(folder, tmp_path / "out", progress=False)
    assert index["samples"] == 20
    assert index["skipped"] == [{"path": "photos/\\xff.png", "reason": "file name is not UTF-8"}]
    assert "photos/\\xff.png" in caplog.text
    assert json.loads((tmp_path / "out" / "dataset.json").read_text()) == index


def test_a_class_folder_that_is_not_utf8_is_refused_before_writing(tmp_path, class_folder,
                                                                   capsys):
    (class_folder / "photo").rename(class_folder / os.fsdecode(b"ph\xffto"))
    code, out = shards(tmp_path, class_folder, "--classes")
    assert code == 1
    err = capsys.readouterr().err
    assert "class folder ph\\xffto" in err and str(class_folder) in err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_file_over_the_readers_member_bound_is_skipped_unread(tmp_path, folder, monkeypatch):
    """The readers skip a member over tar_shards.MAX_MEMBER_BYTES: the writer does not read
    such a file into memory to write a sample no reader will take."""
    from vlm_vit.data.shards import reader as tar_shards

    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*")
             if p.suffix.lower() in {".png", ".jpg", ".jpeg"}}
    bound = max(sizes.values()) - 1
    monkeypatch.setattr(tar_shards, "MAX_MEMBER_BYTES", bound)
    index = write_shards(folder, tmp_path / "out", progress=False)
    largest = [path for path, size in sizes.items() if size > bound]
    assert index["skipped"] == [{"path": path, "reason": f"{sizes[path]:,} bytes, over the "
                                 f"{bound:,} a shard member may hold"} for path in largest]
    assert index["samples"] == len(sizes) - len(largest)
