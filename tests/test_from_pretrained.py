"""One loading API: every `from_pretrained` (encoder, tower, classifier) takes a path or a Hub
name, as `load_encoder` does, and `verify` and `dtype` as keywords."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlm_vit import VisionEncoder, VisionTower, build_pooler
from vlm_vit.finetune import ImageClassifier
from vlm_vit.integrity import IntegrityError
from vlm_vit.testing import flip_bytes, offline_hub_cache, put_in_hub_cache

from .conftest import tiny_config

pytest.importorskip("huggingface_hub")

WEIGHTS = {"encoder": "model.safetensors", "tower": "pooler.safetensors",
           "classifier": "classifier_head.safetensors"}


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config())
    if kind == "encoder":
        return encoder.eval()
    tower = VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=32, out_dim=16))
    if kind == "tower":
        return tower.eval()
    classifier = ImageClassifier(encoder, num_classes=3)
    torch.nn.init.normal_(classifier.head.weight)
    return classifier.eval()


def loader(kind: str):
    return {"encoder": VisionEncoder, "tower": VisionTower,
            "classifier": ImageClassifier}[kind].from_pretrained


def cached(kind: str, tmp_path: Path, monkeypatch, *, corrupt: bool = False) -> torch.nn.Module:
    """Saves one `kind`, optionally flips a byte of its own weight file, and puts it in an
    offline Hub cache as `org/tiny-<kind>`."""
    model = build(kind)
    model.save_pretrained(tmp_path / "saved")
    if corrupt:
        flip_bytes(tmp_path / "saved" / WEIGHTS[kind], -3)  # inside the last tensor's bytes
    put_in_hub_cache(offline_hub_cache(tmp_path / "hf_home", monkeypatch), f"org/tiny-{kind}",
                     tmp_path / "saved")
    return model


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ours, theirs = a.state_dict(), b.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_a_hub_name_loads_through_from_pretrained_as_its_path_does(kind, tmp_path, monkeypatch):
    model = cached(kind, tmp_path, monkeypatch)
    by_name = loader(kind)(f"org/tiny-{kind}")
    assert isinstance(by_name, type(model))
    assert same_state(by_name, model)
    assert same_state(loader(kind)(tmp_path / "saved"), model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours, theirs = by_name(x), model(x)
    if kind == "encoder":
        ours, theirs = ours.tokens, theirs.tokens
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_verify_false_skips_the_manifest_check(kind, tmp_path, monkeypatch):
    cached(kind, tmp_path, monkeypatch, corrupt=True)
    with pytest.raises(IntegrityError, match=f"{WEIGHTS[kind]} does not match"):
        loader(kind)(f"org/tiny-{kind}")
    assert isinstance(loader(kind)(f"org/tiny-{kind}", verify=False), torch.nn.Module)


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_dtype_casts_every_weight(kind, tmp_path, monkeypatch):
    cached(kind, tmp_path, monkeypatch)
    loaded = loader(kind)(f"org/tiny-{kind}", dtype=torch.bfloat16)
    assert {t.dtype for t in loaded.state_dict().values()} == {torch.bfloat16}
    with torch.no_grad():
        loaded(torch.randn(1, 3, 32, 32, dtype=torch.bfloat16))  # and runs in it
