"""`vlm-vit encode --layer` takes several layers, and a folder a `TappedTower` was saved to
gets each tap through its own pooler, from the same encoder run (issue 45): `layer_K` equals
the encoder's hidden state K, `tap_NAME` the tower's tap, each with its exact token count; the
cache keys on the taps' poolers; a native-resolution encode refuses taps by name."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from vlm_vit import ImageProcessor, VisionEncoder, VisionTower, build_pooler
from vlm_vit.cli import main
from vlm_vit.taps import TappedTower

from ..conftest import tiny_config


def tapped_tower(seed: int = 0) -> TappedTower:
    """A tiny tower with a mean pooler and two taps: a pixel shuffle of layer 1 and the
    class token of layer -1 (the tower keeps its prefix)."""
    torch.manual_seed(seed)
    encoder = VisionEncoder(tiny_config())
    width = encoder.config.width
    tower = VisionTower(encoder, build_pooler("mean", in_dim=width), keep_prefix=True,
                        processor=ImageProcessor.for_family("clip", size=32))
    shuffle = build_pooler("pixel_shuffle", in_dim=width, out_dim=24)
    with torch.no_grad():
        for parameter in shuffle.parameters():
            parameter.add_(torch.randn_like(parameter))
    return TappedTower(tower, {"shuffled": (1, shuffle),
                               "cls": (-1, build_pooler("cls", in_dim=width))})


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for name in ["a.png", "b.png", "c.jpg"]:
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(
            tmp_path / "imgs" / name)
    return tmp_path / "imgs"


def read(path):
    with safe_open(path, "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()  # noqa: SIM118


def test_several_layers_and_every_tap_are_written_as_the_library_gives_them(tmp_path, folder):
    tapped = tapped_tower().eval()
    tapped.save_pretrained(tmp_path / "tapped")
    out = tmp_path / "out.safetensors"
    assert main(["encode", str(tmp_path / "tapped"), str(folder), "-o", str(out),
                 "--layer", "0", "-2", "--layer", "1", "--batch-size", "3", "--quiet"]) == 0
    tensors, metadata = read(out)
    assert set(tensors) == {"layer_0", "layer_-2", "layer_1", "tap_shuffled", "tap_cls"}
    pixels = tapped.tower.processor(json.loads(metadata["files"]))
    with torch.no_grad():
        taps = tapped(pixels).taps
        features = tapped.tower.encoder(pixels, feature_layers=[0, -2, 1]).features
    for name, expected in zip(["layer_0", "layer_-2", "layer_1"], features, strict=True):
        torch.testing.assert_close(tensors[name], expected, atol=1e-6, rtol=0)
    for name, expected in taps.items():
        torch.testing.assert_close(tensors[f"tap_{name}"], expected, atol=1e-6, rtol=0)
    assert tensors["tap_shuffled"].shape == (3, tapped.num_tap_tokens("shuffled", 32), 24)
    assert tensors["tap_cls"].shape == (3, 32)


def test_without_layers_the_tokens_come_with_the_taps(tmp_path, folder):
    tapped = tapped_tower().eval()
    tapped.save_pretrained(tmp_path / "tapped")
    out = tmp_path / "out.safetensors"
    assert main(["encode", str(tmp_path / "tapped"), str(folder), "-o", str(out),
                 "--quiet"]) == 0
    tensors, metadata = read(out)
    assert set(tensors) == {"tokens", "tap_shuffled", "tap_cls"}
    pixels = tapped.tower.processor(json.loads(metadata["files"]))
    with torch.no_grad():
        tokens = tapped.tower.encoder(pixels).tokens
    torch.testing.assert_close(tensors["tokens"], tokens, atol=1e-6, rtol=0)


def test_the_cache_keys_on_the_taps_poolers(tmp_path, folder):
    cache = tmp_path / "cache"
    outputs = []
    for seed, name in ((0, "first"), (0, "again"), (1, "other")):
        tapped = tapped_tower(0)
        if seed:  # the same encoder, another tap pooler
            with torch.no_grad():
                next(tapped.taps["shuffled"].parameters()).add_(1.0)
        tapped.save_pretrained(tmp_path / name / "tapped")
        out = tmp_path / name / "out.safetensors"
        assert main(["encode", str(tmp_path / name / "tapped"), str(folder), "-o", str(out),
                     "--cache", str(cache), "--quiet"]) == 0
        outputs.append(read(out)[0])
    first, again, other = outputs
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert torch.equal(first["tokens"], other["tokens"])
    assert not torch.equal(first["tap_shuffled"], other["tap_shuffled"])  # not a stale hit


def test_a_native_resolution_encode_refuses_taps_by_name(tmp_path, folder, capsys):
    tapped_tower().save_pretrained(tmp_path / "tapped")
    assert main(["encode", str(tmp_path / "tapped"), str(folder), "-o",
                 str(tmp_path / "out.safetensors"), "--native-resolution", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "is a tapped tower" in err and "--native-resolution" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()
