import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, available_variants
from vlm_vit.config import VARIANTS
from vlm_vit.registry import UnknownNameError

PAPER_SIZES = {  # (width, depth, heads, mlp) from the paper's Table 1 and DeiT
    "vit-ti": (192, 12, 3, 768),
    "vit-s": (384, 12, 6, 1536),
    "vit-b": (768, 12, 12, 3072),
    "vit-l": (1024, 24, 16, 4096),
    "vit-h": (1280, 32, 16, 5120),
}


def meta_encoder(name: str) -> VisionEncoder:
    with torch.device("meta"):
        return VisionEncoder(EncoderConfig.from_name(name))


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_paper_parameter_counts():
    assert count(meta_encoder("vit-b/16")) == 85_798_656
    assert count(meta_encoder("vit-h/14")) == 630_764_800


def test_variant_table_is_complete():
    expected = {"vit-ti/16", "vit-s/16", "vit-b/16", "vit-b/32", "vit-l/14", "vit-l/16",
                "vit-l/32", "vit-h/14", "clip-vit-b/32", "clip-vit-b/16", "clip-vit-l/14",
                "clip-vit-l/14-336", "r50+vit-b/16"}
    assert set(available_variants()) == expected


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_has_its_sizes(name):
    config = EncoderConfig.from_name(name)
    family = name.removeprefix("clip-").removeprefix("r50+").split("/")[0]
    assert (config.width, config.depth, config.heads, config.mlp_width) == PAPER_SIZES[family]
    patch = int(name.split("/")[1].split("-")[0])
    assert config.patch_size == patch
    model = meta_encoder(name)
    rows, cols = config.grid
    assert model.pos_embed.shape == (1, 1 + rows * cols, config.width)
    assert len(model.blocks) == config.depth
    if name.startswith("clip-"):
        assert (config.pre_norm, config.act, config.norm_eps, config.patch_bias) == (
            True, "quick_gelu", 1e-5, False)
        assert model.patch_embed.proj.bias is None and model.norm_pre is not None
    else:
        assert not config.pre_norm and config.act == "gelu" and config.norm_eps == 1e-6


def test_clip_336_size():
    assert EncoderConfig.from_name("clip-vit-l/14-336").image_size == (336, 336)
    assert EncoderConfig.from_name("clip-vit-l/14-336").grid == (24, 24)


def test_unknown_variant_lists_close_matches():
    with pytest.raises(UnknownNameError, match="vit-b/16"):
        EncoderConfig.from_name("vit-b/61")


@pytest.mark.parametrize("kwargs, message", [
    (dict(width=100, heads=3), "not divisible by heads"),
    (dict(act="relu"), "act 'relu'"),
    (dict(image_size=(225, 224)), "225x224 is not a multiple of patch size 16"),
    (dict(depth=0), "depth must be a positive int"),
    (dict(pos_resize_mode="nearest"), "pos_resize_mode"),
])
def test_bad_config_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncoderConfig(**kwargs)


def test_dict_round_trip_and_unknown_fields():
    config = EncoderConfig.from_name("clip-vit-b/16", image_size=(224, 320))
    assert EncoderConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown EncoderConfig fields: colour"):
        EncoderConfig.from_dict({**config.to_dict(), "colour": 1})
