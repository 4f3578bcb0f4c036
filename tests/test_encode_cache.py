"""The encoder-output cache (`vlm_vit.io.encode_cache`, `vlm-vit encode --cache`; issue 46):
a hit gives the bytes the computation gave; every key component misses when it changes; a
killed writer leaves no entry a reader accepts; two concurrent writers leave valid entries;
a damaged entry is a miss; least-recently-used eviction keeps the cache within its size."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from vlm_vit import ImageProcessor
from vlm_vit.cli import main
from vlm_vit.io.encode_cache import EncodeCache
from vlm_vit.model import VisionEncoder

from .conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "ckpt")
    ImageProcessor.for_family("clip", size=32).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for index in range(5):
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(
            tmp_path / "imgs" / f"{index}.png")
    return tmp_path / "imgs"


def read(path):
    with safe_open(path, "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()  # noqa: SIM118


def encode(checkpoint, folder, out, *extra):
    return main(["encode", str(checkpoint), str(folder), "-o", str(out), "--batch-size", "2",
                 "--quiet", *extra])


def test_a_warm_encode_is_bit_identical_and_all_hits(tmp_path, checkpoint, folder, capsys):
    cache = tmp_path / "cache"
    assert encode(checkpoint, folder, tmp_path / "plain.safetensors") == 0
    assert encode(checkpoint, folder, tmp_path / "cold.safetensors", "--cache", str(cache)) == 0
    assert "0 hit(s), 5 miss(es)" in capsys.readouterr().out
    assert encode(checkpoint, folder, tmp_path / "warm.safetensors", "--cache", str(cache)) == 0
    assert "5 hit(s), 0 miss(es)" in capsys.readouterr().out
    plain, plain_meta = read(tmp_path / "plain.safetensors")
    for name in ("cold", "warm"):
        tensors, metadata = read(tmp_path / f"{name}.safetensors")
        assert torch.equal(tensors["tokens"], plain["tokens"])  # bit for bit
        assert metadata["grid"] == plain_meta["grid"] and metadata["files"] == plain_meta["files"]


@pytest.mark.parametrize("change", ["weights", "processor", "layers", "prefix", "dtype"])
def test_every_key_component_misses_when_it_changes(tmp_path, checkpoint, folder, capsys,
                                                    change):
    cache = tmp_path / "cache"
    assert encode(checkpoint, folder, tmp_path / "first.safetensors", "--cache", str(cache)) == 0
    capsys.readouterr()
    extra = []
    if change == "weights":
        encoder = VisionEncoder.from_pretrained(checkpoint)
        with torch.no_grad():
            encoder.blocks[0].mlp.fc1.bias[0] += 1e-3  # one weight, slightly
        processor = ImageProcessor.from_pretrained(checkpoint)
        encoder.save_pretrained(checkpoint)  # replaces the folder's .json files
        processor.save_pretrained(checkpoint)  # the same processor again: only weights differ
    elif change == "processor":
        extra = ["--normalize", "imagenet"]
    elif change == "layers":
        extra = ["--feature-layer", "-2"]
    elif change == "prefix":
        extra = ["--no-keep-prefix"]
    else:
        extra = ["--dtype", "bfloat16"]
    assert encode(checkpoint, folder, tmp_path / "second.safetensors", "--cache", str(cache),
                  *extra) == 0
    assert "0 hit(s), 5 miss(es)" in capsys.readouterr().out


def test_the_same_pixels_in_another_file_is_another_key(tmp_path, checkpoint):
    cache = EncodeCache(tmp_path / "cache")
    encoder = VisionEncoder.from_pretrained(checkpoint)
    context = cache.context(encoder, ImageProcessor.from_pretrained(checkpoint))
    cache.put(context, b"image one", {"tokens": torch.ones(2, 3)})
    assert cache.get(context, b"image two") is None
    assert torch.equal(cache.get(context, b"image one")["tokens"], torch.ones(2, 3))


def test_a_damaged_entry_is_a_miss_and_is_removed(tmp_path, checkpoint, caplog):
    cache = EncodeCache(tmp_path / "cache")
    context = cache.context(VisionEncoder.from_pretrained(checkpoint), None)
    path = cache.put(context, b"image", {"tokens": torch.arange(12.0).view(3, 4)})
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the tensor bytes
    path.write_bytes(bytes(data))
    assert cache.get(context, b"image") is None and not path.exists()
    assert "removed a damaged cache entry" in caplog.text
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"not safetensors at all")
    assert cache.get(context, b"image") is None


WRITER = textwrap.dedent("""
    import sys, time, torch
    from vlm_vit.io import encode_cache
    from vlm_vit.io.encode_cache import EncodeCache, CacheContext

    cache = EncodeCache(sys.argv[1])
    context = CacheContext(sys.argv[2], {})
    real_fsync = encode_cache.os.fsync
    if sys.argv[3] == "stall":  # written, not renamed: killed here
        def stall(fd):
            print("writing", flush=True)
            time.sleep(60)
        encode_cache.os.fsync = stall
    for round in range(int(sys.argv[4])):
        cache.put(context, b"shared image", {"tokens": torch.full((64, 64), 7.0)})
    print("done", flush=True)
""")


def test_a_killed_writer_leaves_no_entry_a_reader_accepts(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "cache"), "k",
                               "stall", "1"], stdout=subprocess.PIPE, text=True, env=env)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    cache = EncodeCache(tmp_path / "cache")
    from vlm_vit.io.encode_cache import CacheContext

    assert cache.get(CacheContext("k", {}), b"shared image") is None
    assert cache.entries() == []  # only the temporary file, which no reader opens
    assert list((tmp_path / "cache").glob("*/.*.tmp"))


def test_two_concurrent_writers_leave_one_valid_entry(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "cache"), "k",
                                 "go", "30"], stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(2)]
    for writer in writers:
        assert writer.communicate(timeout=120)[0].strip() == "done"
    from vlm_vit.io.encode_cache import CacheContext

    cache = EncodeCache(tmp_path / "cache")
    assert torch.equal(cache.get(CacheContext("k", {}), b"shared image")["tokens"],
                       torch.full((64, 64), 7.0))
    assert len(cache.entries()) == 1 and not list((tmp_path / "cache").glob("*/.*.tmp"))


def test_least_recently_used_entries_are_evicted_to_fit(tmp_path):
    from vlm_vit.io.encode_cache import CacheContext

    context = CacheContext("k", {})
    cache = EncodeCache(tmp_path / "cache")
    paths = [cache.put(context, f"image {index}".encode(), {"tokens": torch.zeros(256)})
             for index in range(4)]
    size = paths[0].stat().st_size
    for age, path in enumerate(paths):  # oldest first: 0, 1, 2, 3
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    assert cache.get(context, b"image 0") is not None  # now the most recently used
    bounded = EncodeCache(tmp_path / "cache", max_bytes=3 * size)
    bounded.put(context, b"image 4", {"tokens": torch.zeros(256)})
    kept = {path.name for path, _, _ in bounded.entries()}
    assert paths[1].name not in kept and paths[2].name not in kept  # the two least recent
    assert paths[0].name in kept and paths[3].name in kept and len(kept) == 3


@pytest.mark.parametrize("arguments, message", [
    (["--cache-max-gb", "1"], "--cache-max-gb needs --cache"),
    (["--cache", "CACHE", "--cache-max-gb", "0"], "a size above 0"),
    (["--cache", "CACHE", "--native-resolution"], "not --native-resolution"),
])
def test_cache_flags_that_cannot_go_together_are_one_line(tmp_path, checkpoint, folder, capsys,
                                                          arguments, message):
    arguments = [str(tmp_path / "c") if a == "CACHE" else a for a in arguments]
    assert encode(checkpoint, folder, tmp_path / "out.safetensors", *arguments) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_bad_max_bytes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        EncodeCache(tmp_path / "cache", max_bytes=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        EncodeCache(tmp_path / "file")
