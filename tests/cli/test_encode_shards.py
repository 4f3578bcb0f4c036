"""`vlm-vit encode` over WebDataset tar shards: one output file per shard."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from vlm_vit import ImageProcessor
from vlm_vit.cli import main
from vlm_vit.model import VisionEncoder

from ..conftest import tiny_config
from ..train.toy import real_images, write_shards

pytest.importorskip("webdataset")

SHARDS, PER_SHARD = 4, 6
NAMES = [f"shard-{i:02d}.safetensors" for i in range(SHARDS)]


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(path)
    ImageProcessor.for_family("clip", size=32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """4 shards of 6 real 40x48 PNGs: {shard path: keys}."""
    return write_shards(tmp_path_factory.mktemp("data") / "shards", SHARDS, PER_SHARD)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, checkpoint, shards):
    """A single-process run over the shards folder."""
    out = tmp_path_factory.mktemp("reference")
    folder = os.path.dirname(next(iter(shards)))
    assert main(["encode", str(checkpoint), folder, "-o", str(out), "--quiet"]) == 0
    return out


def read(path):
    with safe_open(str(path), "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()  # noqa: SIM118


def listing(out):
    """The names in an output folder, less its job locks (`.lock`, `.rank_R/`)."""
    return sorted(p.name for p in out.iterdir()
                  if p.name != ".lock" and not re.fullmatch(r"\.rank_\d+", p.name))


def assert_same_outputs(out, expected):
    assert listing(out) == listing(expected)
    for path in sorted(expected.glob("*.safetensors")):
        tensors, metadata = read(out / path.name)
        want, want_metadata = read(path)
        assert metadata == want_metadata, path.name
        assert tensors.keys() == want.keys()
        for name in want:
            assert torch.equal(tensors[name], want[name]), (path.name, name)


def command(checkpoint, inputs, out, *extra):
    return [sys.executable, "-m", "vlm_vit.cli", "encode", str(checkpoint), *map(str, inputs),
            "-o", str(out), "--quiet", *extra]


def start(argv, rank, world):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", RANK=str(rank), WORLD_SIZE=str(world))
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(process):
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    return stdout


@pytest.mark.parametrize("options", [
    [],
    ["--feature-layer", "-2", "--feature-layer", "0", "--no-keep-prefix", "--batch-size", "3",
     "--dtype", "bfloat16"],
])
def test_each_shard_gives_one_file_with_the_folder_paths_tokens(tmp_path, checkpoint, shards,
                                                                 options, capsys):
    out = tmp_path / "tokens"
    pattern = os.path.join(os.path.dirname(next(iter(shards))), "shard-{00..03}.tar")
    assert main(["encode", str(checkpoint), pattern, "-o", str(out), "--quiet", *options]) == 0
    assert (capsys.readouterr().out.strip() == f"wrote 4 shards (24 images) to {out} (0 "
            "already complete, 0 skipped samples)")
    assert sorted(p.name for p in out.iterdir()) == [".lock", *NAMES]  # no temporary file
    # The same PNG bytes as a folder, named so that sorted order is the shards' order.
    (tmp_path / "images").mkdir()
    keys = [key for shard_keys in shards.values() for key in shard_keys]
    for key, data in zip(keys, real_images(len(keys)), strict=True):
        (tmp_path / "images" / f"{key}.png").write_bytes(data)
    single = tmp_path / "folder.safetensors"
    assert main(["encode", str(checkpoint), str(tmp_path / "images"), "-o", str(single),
                 "--quiet", *options]) == 0
    expected, expected_metadata = read(single)
    parts = {name: [] for name in expected}
    for (shard, shard_keys), name in zip(shards.items(), NAMES, strict=True):
        tensors, metadata = read(out / name)
        assert json.loads(metadata["keys"]) == shard_keys
        assert metadata["shard"] == shard and metadata["complete"] == "true"
        assert metadata["samples"] == "6" and json.loads(metadata["skipped"]) == []
        assert metadata["truncated"] == "false" and metadata["model"] == str(checkpoint)
        for key in ("grid", "num_prefix_tokens"):
            assert metadata[key] == expected_metadata[key]
        assert tensors.keys() == expected.keys()
        for tensor_name, tensor in tensors.items():
            parts[tensor_name].append(tensor)
    for name, tensor in expected.items():
        torch.testing.assert_close(torch.cat(parts[name]), tensor, atol=1e-6, rtol=1e-6)
        assert tensor.dtype == (torch.bfloat16 if options else torch.float32)


def test_two_processes_write_what_one_writes(tmp_path, checkpoint, shards, reference):
    out = tmp_path / "tokens"
    folder = os.path.dirname(next(iter(shards)))
    processes = [start(command(checkpoint, [folder], out), rank, 2) for rank in (0, 1)]
    printed = [finish(process) for process in processes]
    assert printed[0].strip() == (f"rank 0 of 2: wrote 2 shards (12 images) to {out} (0 "
                                  "already complete, 0 skipped samples)")
    assert printed[1] == ""  # rank 0 prints the summary
    assert_same_outputs(out, reference)


def test_a_killed_job_resumes_when_rerun(tmp_path, checkpoint, shards):
    """Rank 0's second shard comes through a pipe that waits while `block` exists, so the
    kill lands after its first output and before its second, every time."""
    paths = list(shards)
    block = tmp_path / "block"
    waiting = (f"pipe:sh -c 'while [ -e {block} ]; do sleep 0.05; done; "
               f"exec cat {paths[2]}'")
    inputs = [paths[0], paths[1], waiting, paths[3]]
    expected = tmp_path / "expected"
    assert main(["encode", str(checkpoint), *inputs, "-o", str(expected), "--quiet"]) == 0
    assert listing(expected) == NAMES

    out = tmp_path / "tokens"
    block.touch()
    argv = command(checkpoint, inputs, out)
    rank0, rank1 = start(argv, 0, 2), start(argv, 1, 2)
    finish(rank1)  # shards 1 and 3
    deadline = time.monotonic() + 120
    while not (out / NAMES[0]).exists():
        assert rank0.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(rank0.pid, signal.SIGKILL)
    rank0.communicate()
    assert rank0.returncode == -signal.SIGKILL
    assert listing(out) == [NAMES[0], NAMES[1], NAMES[3]]
    # What a kill during a write leaves (atomic_write's temporary names):
    (out / f".{NAMES[2]}.k1ll3d_0.tmp").write_bytes(b"half a file")
    (out / f".{NAMES[3]}.k1ll3d_1.tmp").write_bytes(b"half a file")

    block.unlink()
    rank0, rank1 = start(argv, 0, 2), start(argv, 1, 2)
    assert finish(rank0).strip() == (f"rank 0 of 2: wrote 1 shards (6 images) to {out} (1 "
                                     "already complete, 0 skipped samples)")
    finish(rank1)
    assert not list(out.rglob("*.tmp"))
    assert_same_outputs(out, expected)


def tar(path, samples):
    import webdataset as wds

    with wds.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


def test_bad_samples_and_a_truncated_shard_are_skipped_and_named(tmp_path, checkpoint,
                                                                  shards, capsys, caplog):
    data = tmp_path / "bad"
    data.mkdir()
    good = real_images(2)
    tar(data / "a-mixed.tar", [
        {"__key__": "good-0", "png": good[0]},
        {"__key__": "corrupt", "png": b"these bytes are no PNG"},
        {"__key__": "text-only", "txt": b"a caption and no image"},
        {"__key__": "good-1", "png": good[1]},
    ])
    tar(data / "b-empty.tar", [{"__key__": "text-only", "txt": b"no image here"}])
    whole, keys = next(iter(shards.items()))
    with open(whole, "rb") as handle:
        cut = handle.read()
    (data / "c-cut.tar").write_bytes(cut[:int(len(cut) * 0.6)])
    out = tmp_path / "tokens"
    assert main(["encode", str(checkpoint), str(data), "-o", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()

    tensors, metadata = read(out / "a-mixed.safetensors")
    assert json.loads(metadata["keys"]) == ["good-0", "good-1"] and tensors["tokens"].shape[0] == 2
    skipped = {s["key"]: s["reason"] for s in json.loads(metadata["skipped"])}
    assert skipped.keys() == {"corrupt", "text-only"}
    assert "not a recognised image format" in skipped["corrupt"]
    assert skipped["text-only"] == "no image (fields: txt)"
    assert metadata["read"] == "4" and metadata["samples"] == "2"
    assert f"skipped 2 samples of shard {data / 'a-mixed.tar'}" in captured.err

    tensors, metadata = read(out / "b-empty.safetensors")
    assert tensors["tokens"].shape == (0, 17, 32) and json.loads(metadata["keys"]) == []

    tensors, metadata = read(out / "c-cut.safetensors")
    count = int(metadata["samples"])
    assert 0 < count < PER_SHARD and tensors["tokens"].shape[0] == count
    assert json.loads(metadata["keys"]) == keys[:count]
    assert metadata["truncated"] == "true" and metadata["read"] == str(count)
    assert f"shard {data / 'c-cut.tar'} is truncated after {count} samples" in captured.err
    said = [r.getMessage() for r in caplog.records] + captured.err.splitlines()
    assert sum("c-cut.tar is truncated" in line for line in said) == 1  # once (issue 27, 9)
    assert captured.out.strip() == (f"wrote 3 shards ({2 + count} images) to {out} (0 already "
                                    "complete, 3 skipped samples)")
    # A rerun reads the truncated shard again (it may have been repaired), and only it.
    assert main(["encode", str(checkpoint), str(data), "-o", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote 1 shards ({count} images) to {out} (2 "
                                               "already complete, 0 skipped samples)")


@pytest.mark.parametrize("inputs, out, extra, message", [
    (["SHARDS"], "x.safetensors", [], "with tar shards, -o is a folder"),
    (["SHARDS"], "CKPT/tokens", [], "is inside the model folder"),
    (["SHARDS"], "SHARDS", [], "is the folder of the input shards"),
    (["SHARDS/shard-00.tar", "IMAGE"], "tokens", [], "encode shards and images in separate"),
    (["SHARDS"], "tokens", ["--native-resolution"], "--native-resolution is for images"),
    (["SHARDS/shard-{00..09}.tar"], "tokens", [], "6 of the 10 shards"),
    (["pipe:cat SHARDS/shard-00.tar.part"], "tokens", [], "cannot name the output"),
])
def test_user_errors_are_one_line(tmp_path, checkpoint, shards, capsys, inputs, out, extra,
                                  message):
    folder = os.path.dirname(next(iter(shards)))
    (tmp_path / "image.png").write_bytes(real_images(1)[0])

    def fill(text):
        return (text.replace("SHARDS", folder).replace("CKPT", str(checkpoint))
                .replace("IMAGE", str(tmp_path / "image.png")))

    target = fill(out) if out in ("SHARDS", "CKPT/tokens") else str(tmp_path / out)
    before = sorted(os.listdir(folder)), sorted(os.listdir(checkpoint))
    assert main(["encode", str(checkpoint), *map(fill, inputs), "-o", target, "--quiet",
                 *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (sorted(os.listdir(folder)), sorted(os.listdir(checkpoint))) == before
    assert not (tmp_path / out).exists()


def test_a_rank_outside_the_world_is_an_error(tmp_path, checkpoint, shards, monkeypatch,
                                              capsys):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = os.path.dirname(next(iter(shards)))
    assert main(["encode", str(checkpoint), folder, "-o", str(tmp_path / "out"), "--quiet"]) == 1
    assert "RANK=2 must lie in 0..WORLD_SIZE-1" in capsys.readouterr().err


def test_a_rerun_with_other_settings_does_not_touch_the_outputs(tmp_path, checkpoint, shards,
                                                                reference, capsys):
    folder = os.path.dirname(next(iter(shards)))
    out = tmp_path / "tokens"
    assert main(["encode", str(checkpoint), folder, "-o", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["encode", str(checkpoint), folder, "-o", str(out), "--quiet",
                 "--no-keep-prefix"]) == 1
    err = capsys.readouterr().err
    assert "shard-00.safetensors was encoded with settings" in err and "remove it" in err
    assert len(err.strip().splitlines()) == 1
    assert_same_outputs(out, reference)


# -- issue 26: trust at the new surfaces -------------------------------------------------------

# Holds a RunLock; run_lock.py is loaded alone (standard library only), not through
# vlm_vit.train, which imports torch: seconds saved per test.
HOLD = ("import importlib.util, sys, time\n"
        "spec = importlib.util.spec_from_file_location('run_lock', sys.argv[2])\n"
        "run_lock = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(run_lock)\n"
        "with run_lock.RunLock(sys.argv[1]):\n    print('held', flush=True)\n"
        "    time.sleep(60)\n")


@pytest.mark.parametrize("rank, world, held", [(0, 1, ""), (1, 2, ".rank_1")])
def test_a_second_job_on_the_same_out_is_refused_naming_the_holder(
        tmp_path, checkpoint, shards, monkeypatch, capsys, rank, world, held):
    """Another job's process holds OUT (rank 0's lock) or OUT/.rank_1: this job's process of
    the same rank writes nothing and exits 1 with one line naming OUT and the holder."""
    pytest.importorskip("fcntl")
    out = tmp_path / "tokens"
    from vlm_vit.train import run_lock

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / held), run_lock.__file__],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(out.rglob("*"))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        folder = os.path.dirname(next(iter(shards)))
        assert main(["encode", str(checkpoint), folder, "-o", str(out), "--quiet"]) == 1
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    captured = capsys.readouterr()
    assert captured.err.startswith(f"vlm-vit encode: error: -o {out} is in use by another "
                                   f"encode job (pid {holder.pid} on ")
    assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""
    assert sorted(out.rglob("*")) == before  # nothing written, no temporary file removed


def encode_quietly(checkpoint, inputs, out, capsys):
    assert main(["encode", str(checkpoint), *map(str, inputs), "-o", str(out), "--quiet"]) == 0
    return capsys.readouterr()


def test_shards_rewritten_with_another_seed_are_encoded_again(tmp_path, checkpoint, capsys):
    """`vlm-vit shards --seed 1 --overwrite` deals the same images into the same shard names
    in another order: a rerun encodes every shard again, and its features are the new
    shards', as a fresh job's."""
    images = tmp_path / "images"
    images.mkdir()
    for number, data in enumerate(real_images(8)):
        (images / f"img-{number}.png").write_bytes(data)
    data = tmp_path / "shards"

    def write(*extra):
        assert main(["shards", str(images), "--out", str(data), "--per-shard", "4",
                     "--quiet", *extra]) == 0
        capsys.readouterr()  # its summary

    write()
    out = tmp_path / "tokens"
    encode_quietly(checkpoint, [data], out, capsys)
    first = {path.name: read(path) for path in out.glob("*.safetensors")}
    write("--seed", "1", "--overwrite")
    captured = encode_quietly(checkpoint, [data], out, capsys)
    assert captured.out.strip() == (f"wrote 2 shards (8 images) to {out} (0 already complete, "
                                    "0 skipped samples)")
    assert "dataset.json changed since it was encoded; encoding it again" in captured.err
    fresh = tmp_path / "fresh"
    encode_quietly(checkpoint, [data], fresh, capsys)
    assert_same_outputs(out, fresh)
    name = "00000.safetensors"
    assert not torch.equal(first[name][0]["tokens"], read(out / name)[0]["tokens"])
    assert encode_quietly(checkpoint, [data], out, capsys).out.strip() == (
        f"wrote 0 shards (0 images) to {out} (2 already complete, 0 skipped samples)")


@pytest.mark.parametrize("change", ["content, same time", "time, same content"])
def test_a_shard_changed_since_its_output_is_encoded_again(tmp_path, checkpoint, capsys,
                                                          change):
    """Without a dataset.json: the shard's size and modification time tell."""
    images = real_images(8)
    data = tmp_path / "shards"
    data.mkdir()
    shard = data / "one.tar"
    tar(shard, [{"__key__": "old-a", "png": images[0]}, {"__key__": "old-b", "png": images[1]}])
    out = tmp_path / "tokens"
    encode_quietly(checkpoint, [shard], out, capsys)
    status = shard.stat()
    if change == "content, same time":
        keys = [f"new-{number}" for number in range(6)]  # more than one 10 KiB tar record
        tar(shard, [{"__key__": key, "png": image}
                    for key, image in zip(keys, images[2:], strict=True)])
        assert shard.stat().st_size != status.st_size
        os.utime(shard, ns=(status.st_atime_ns, status.st_mtime_ns))
        words = "its size changed"
    else:
        os.utime(shard, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
        keys, words = ["old-a", "old-b"], "its modification time changed"
    captured = encode_quietly(checkpoint, [shard], out, capsys)
    assert f"shard {shard}: {words} since it was encoded; encoding it again" in captured.err
    assert captured.out.strip().startswith(f"wrote 1 shards ({len(keys)} images)")
    fresh = tmp_path / "fresh"
    encode_quietly(checkpoint, [shard], fresh, capsys)
    assert_same_outputs(out, fresh)
    assert json.loads(read(out / "one.safetensors")[1]["keys"]) == keys


def test_names_that_are_not_utf8_or_hold_a_newline_are_escaped_in_the_outputs(
        tmp_path, checkpoint, capsys):
    """Member names with a newline or bytes that are not UTF-8, in a shard whose file name
    is not UTF-8: written as `escape_name` writes them, readable back, and a rerun finds the
    output complete."""
    import io
    import tarfile

    from vlm_vit.data.shards import unescape_name

    images = real_images(2)
    data = tmp_path / "shards"
    data.mkdir()
    shard = os.path.join(os.fsencode(data), b"caf\xe9\nx.tar")  # Latin-1, and a newline
    members = [("line\nbreak.png", images[0]), ("caf\udce9.png", images[1]),
               ("bad\udcff.png", b"no image")]  # surrogates: the bytes as tarfile reads them
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as archive:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    out = tmp_path / "tokens"
    captured = encode_quietly(checkpoint, [data], out, capsys)
    assert captured.out.strip() == (f"wrote 1 shards (2 images) to {out} (0 already "
                                    "complete, 1 skipped samples)")
    assert listing(out) == ["caf\\xe9\\x0ax.safetensors"]
    tensors, metadata = read(out / "caf\\xe9\\x0ax.safetensors")
    keys = json.loads(metadata["keys"])
    assert keys == ["line\\x0abreak", "caf\\xe9"] and tensors["tokens"].shape[0] == 2
    assert [unescape_name(key) for key in keys] == ["line\nbreak", "caf\udce9"]
    assert os.fsencode(unescape_name(metadata["shard"])) == shard
    assert [entry["key"] for entry in json.loads(metadata["skipped"])] == ["bad\\xff"]
    assert "\n" not in captured.err.strip()  # the warning naming them is one line
    assert encode_quietly(checkpoint, [data], out, capsys).out.strip().endswith(
        "(1 already complete, 0 skipped samples)")


def test_a_folder_a_killed_shards_job_left_is_named_with_what_is_missing(
        tmp_path, checkpoint, shards, capsys, caplog):
    """Whole 00000.tar and 00001.tar, a .00002.tar.tmp and no dataset.json: encode warns
    (logging, which the command line prints on stderr) and encodes what is there."""
    import logging
    import shutil

    folder = tmp_path / "unfinished"
    folder.mkdir()
    for number, path in enumerate(sorted(shards)[:2]):
        shutil.copy(path, folder / f"{number:05d}.tar")
    (folder / ".00002.tar.tmp").write_bytes(b"half a shard")
    out = tmp_path / "tokens"
    with caplog.at_level(logging.WARNING):
        captured = encode_quietly(checkpoint, [folder], out, capsys)
    assert f"{folder} holds .00002.tar.tmp" in caplog.text
    assert "no dataset.json" in caplog.text and "still to write are missing" in caplog.text
    assert captured.out.strip().startswith("wrote 2 shards (12 images)")
