"""One loading API: every `from_pretrained` (encoder, tower, classifier, processor) takes a
path or a Hub name as `name`, as `load_encoder` does, and the models `verify` and `dtype` as
keywords; every `save_pretrained` returns the directory."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from vlm_vit import ImageProcessor, VisionEncoder, VisionTower, build_pooler
from vlm_vit.adapt.finetune import ImageClassifier
from vlm_vit.io.integrity import IntegrityError
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


# Every class with save_pretrained and from_pretrained, each with a small instance.
SAVED = {
    "encoder": (VisionEncoder, lambda: build("encoder")),
    "tower": (VisionTower, lambda: build("tower")),
    "classifier": (ImageClassifier, lambda: build("classifier")),
    "processor": (ImageProcessor, lambda: ImageProcessor.for_family("inception", size=48)),
}


def same(a, b) -> bool:
    return same_state(a, b) if isinstance(a, torch.nn.Module) else a == b


@pytest.mark.parametrize("kind", sorted(SAVED))
def test_every_save_pretrained_returns_the_directory(kind, tmp_path):
    _, make = SAVED[kind]
    assert make().save_pretrained(tmp_path / "saved") == tmp_path / "saved"
    assert make().save_pretrained(str(tmp_path / "again")) == tmp_path / "again"


@pytest.mark.parametrize("kind", sorted(SAVED))
def test_every_from_pretrained_takes_a_hub_name_as_name(kind, tmp_path, monkeypatch):
    cls, make = SAVED[kind]
    assert next(iter(inspect.signature(cls.from_pretrained).parameters)) == "name"
    model = make()
    put_in_hub_cache(offline_hub_cache(tmp_path / "hf_home", monkeypatch), f"org/tiny-{kind}",
                     model.save_pretrained(tmp_path / "saved"))
    assert same(cls.from_pretrained(f"org/tiny-{kind}"), model)
    assert same(cls.from_pretrained(name=tmp_path / "saved"), model)
