"""Named taps on one encoder run (`vlm_vit.taps`; issue 45): each tap equals a tower built on
its layer and pooler, batched, packed and for clips, with its exact token count; the encoder
runs once; saved and read back bit for bit; bad taps refused by name."""

import json

import pytest
import torch

from vlm_vit import VisionTower, build_pooler
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import Tiling
from vlm_vit.taps import TAPS_CONFIG_NAME, TappedTower

from .conftest import tiny_config


def tapped(keep_prefix: bool = False, feature_layer=-2, **config):
    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config(**config)).eval()
    width = encoder.config.width
    tower = VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=width, out_dim=24),
                        feature_layer=feature_layer, keep_prefix=keep_prefix)
    taps = {"early": (1, build_pooler("patch_merger", in_dim=width, out_dim=24, merge_size=2)),
            "mean": (-3, build_pooler("mean", in_dim=width))}
    if keep_prefix:
        taps["cls"] = (2, build_pooler("cls", in_dim=width))
    return TappedTower(tower, taps)


def alone(model, name):
    """The tap as a tower of its own: what it must equal."""
    return VisionTower(model.tower.encoder, model.taps[name], feature_layer=model.layers[name],
                       keep_prefix=model.tower.keep_prefix)


@pytest.mark.parametrize("keep_prefix", [False, True])
@pytest.mark.parametrize("feature_layer", [-2, None])
def test_each_tap_equals_a_tower_on_its_layer(keep_prefix, feature_layer):
    model = tapped(keep_prefix, feature_layer)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        assert torch.equal(out.tokens, model.tower(x))
        for name in model.taps:
            assert torch.equal(out.taps[name], alone(model, name)(x)), name
            count = model.num_tap_tokens(name)
            assert (out.taps[name].shape[1] if count is not None else None) == count
    assert model.num_tap_tokens("early") == 4 and model.num_tap_tokens("mean") is None


def test_packed_images_of_several_sizes_and_one_encoder_run():
    model = tapped()
    calls = []
    model.tower.encoder.register_forward_hook(lambda *_: calls.append(1))
    images = [torch.randn(3, 32, 32), torch.randn(3, 16, 48), torch.randn(3, 48, 16)]
    with torch.no_grad():
        out = model(images)
        assert len(calls) == 1
        for name in model.taps:
            for index, (mine, theirs) in enumerate(zip(out.taps[name], alone(model, name)(images),
                                                       strict=True)):
                assert torch.allclose(mine, theirs, atol=1e-6, rtol=0), (name, index)
        assert model.num_tap_tokens("early", (16, 48)) == out.taps["early"][1].shape[0] == 3


def test_a_clip_gives_its_slices_end_to_end():
    model = tapped(temporal_patch_size=2, class_token=False, pos_embed="none", rope_theta=100.0)
    model = TappedTower(model.tower, {"early": (model.layers["early"], model.taps["early"])})
    inputs = [torch.randn(4, 3, 32, 32), torch.randn(3, 32, 32)]  # a 4-frame clip, an image
    with torch.no_grad():
        out = model(inputs)
        expected = alone(model, "early")(inputs)
    for mine, theirs in zip(out.taps["early"], expected, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6, rtol=0)
    assert out.taps["early"][0].shape[0] == model.num_tap_tokens("early", 32, frames=4) == 8


def test_saved_and_read_back_bit_for_bit(tmp_path):
    model = tapped(keep_prefix=True)
    model.save_pretrained(tmp_path / "tapped")
    again = TappedTower.from_pretrained(tmp_path / "tapped")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        first, second = model(x), again(x)
    assert torch.equal(first.tokens, second.tokens) and again.layers == model.layers
    assert all(torch.equal(first.taps[name], second.taps[name]) for name in model.taps)
    # A plain tower saved over it leaves no taps behind: the new save wins.
    model.tower.save_pretrained(tmp_path / "tapped")
    assert not (tmp_path / "tapped" / TAPS_CONFIG_NAME).exists()


def test_a_malformed_taps_file_is_named(tmp_path):
    tapped().save_pretrained(tmp_path / "t")
    path = tmp_path / "t" / TAPS_CONFIG_NAME
    spec = json.loads(path.read_text())
    spec["early"]["layer"] = "8"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"taps.json: tap 'early' must be \{\"layer\": int"):
        TappedTower.from_pretrained(tmp_path / "t", verify=False)


@pytest.mark.parametrize(("taps", "message"), [
    ({}, "taps must map 1 to 64 names"),
    ({"no good": (1, None)}, "tap name 'no good' is not an identifier"),
    ({"a": 1}, r"tap 'a': give \(layer, pooler\)"),
    ({"a": (9, build_pooler("mean", in_dim=32))}, "layer"),
    ({"a": (1, build_pooler("mean", in_dim=16))}, "its pooler takes width 16, the encoder "
                                                 "gives 32"),
    ({"a": (1, build_pooler("cls", in_dim=32))}, "reads the class token, which the tower drops"),
])
def test_bad_taps_are_refused_by_name(taps, message):
    tower = tapped().tower
    with pytest.raises(ValueError, match=message):
        TappedTower(tower, taps)


def test_a_tiled_tower_is_not_tapped():
    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config()).eval()
    tower = VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=32, out_dim=8),
                        tiling=Tiling(tile_size=32, pinpoints=((32, 64),)))
    with pytest.raises(ValueError, match="a tiled tower"):
        TappedTower(tower, {"a": (1, build_pooler("mean", in_dim=32))})
