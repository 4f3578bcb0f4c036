"""Prefix tokens have one name and polarity (issue 41): `keep_prefix` in the tower, the
poolers and `load_tower`; a pooler that keeps them in a tower that drops them is refused;
towers saved with the old `drop_prefix` still load."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from vlm_vit import VisionEncoder, VisionTower, available_poolers, build_pooler
from vlm_vit.io.loading import load_tower
from vlm_vit.poolers import POOLERS

from .conftest import tiny_config


def encoder(**overrides) -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(tiny_config(**overrides)).eval()


@pytest.mark.parametrize("api", ["VisionTower", "load_tower", *available_poolers()])
def test_one_name_for_the_prefix_tokens(api):
    """Every API that decides about prefix tokens spells it `keep_prefix`, never the old
    `drop_prefix` with the opposite polarity."""
    target = {"VisionTower": VisionTower, "load_tower": load_tower}.get(api) or POOLERS.get(api)
    parameters = inspect.signature(target).parameters
    assert "drop_prefix" not in parameters
    if api in ("VisionTower", "load_tower", "all"):
        assert "keep_prefix" in parameters


def test_a_pooler_that_keeps_the_prefix_in_a_tower_that_drops_it_is_refused():
    pooler = build_pooler("all", in_dim=32, keep_prefix=True)
    with pytest.raises(ValueError, match=r"pooler keeps the prefix tokens \(its keep_prefix="
                                         r"True\).*\(VisionTower keep_prefix=False\)"):
        VisionTower(encoder(), pooler)


@pytest.mark.parametrize("registers", [0, 2])
def test_keep_prefix_in_both_gives_the_prefix_tokens(registers):
    model = encoder(num_register_tokens=registers)
    tower = VisionTower(model, build_pooler("all", in_dim=32, keep_prefix=True),
                        keep_prefix=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out, tokens = tower(x), model(x).tokens
    assert out.shape == (2, 1 + registers + 16, 32) == (2, tower.num_image_tokens(), 32)
    assert torch.equal(out, tokens)
    with torch.no_grad():  # packed, too
        torch.testing.assert_close(tower([x[0], x[1]])[1], tokens[1])


def test_a_tower_keeping_the_prefix_hands_it_to_a_pooler_that_drops_it():
    tower = VisionTower(encoder(), build_pooler("all", in_dim=32), keep_prefix=True)
    assert tower.num_prefix_tokens == 1 and tower.num_image_tokens() == 16
    assert not VisionTower(encoder(), build_pooler("all", in_dim=32)).keep_prefix  # default


@pytest.mark.parametrize("value", [1, "yes", None])
def test_keep_prefix_must_be_a_bool(value):
    with pytest.raises(ValueError, match=f"keep_prefix must be true or false.*{value!r}"):
        VisionTower(encoder(), build_pooler("mean", in_dim=32), keep_prefix=value)


def test_load_tower_keeps_the_prefix_for_a_pooler_that_keeps_it(tmp_path):
    encoder().save_pretrained(tmp_path / "encoder")
    tower = load_tower(tmp_path / "encoder", "all", pooler_options={"keep_prefix": True})
    assert tower.keep_prefix and tower.num_image_tokens() == 17
    assert not load_tower(tmp_path / "encoder", "all").keep_prefix


def saved(tmp_path, pooler: str, keep_prefix: bool, legacy: dict) -> tuple[VisionTower, str]:
    """A tower saved, then its config rewritten as before issue 41 (`legacy` replaces
    `keep_prefix` in the tower section)."""
    tower = VisionTower(encoder(), build_pooler(pooler, in_dim=32), keep_prefix=keep_prefix)
    tower.save_pretrained(tmp_path / "tower", model_card=False)
    path = tmp_path / "tower" / "config.json"
    config = json.loads(path.read_text())
    assert config["tower"].pop("keep_prefix") is keep_prefix  # what is written now
    config["tower"].update(legacy)
    path.write_text(json.dumps(config))
    return tower, tmp_path / "tower"


@pytest.mark.parametrize("pooler, keep_prefix", [("mean", False), ("cls", True)])
def test_a_tower_saved_with_drop_prefix_still_loads(tmp_path, pooler, keep_prefix):
    tower, directory = saved(tmp_path, pooler, keep_prefix, {"drop_prefix": not keep_prefix})
    for load in (VisionTower.from_pretrained, load_tower):
        loaded = load(directory)
        assert loaded.keep_prefix is keep_prefix
        x = torch.randn(1, 3, 32, 32)
        with torch.no_grad():
            assert torch.equal(loaded(x), tower(x))


@pytest.mark.parametrize("legacy, text", [
    ({"drop_prefix": True, "keep_prefix": False}, "both keep_prefix and drop_prefix"),
    ({"drop_prefix": "yes"}, r"tower\.drop_prefix must be true or false, got 'yes'"),
])
def test_a_bad_legacy_drop_prefix_is_refused_naming_the_file(tmp_path, legacy, text):
    _, directory = saved(tmp_path, "mean", False, legacy)
    with pytest.raises(ValueError, match=text) as info:
        VisionTower.from_pretrained(directory)
    assert str(directory / "config.json") in str(info.value)
