"""Google's hybrid `.npz` layout (`R50+ViT-B_16.npz`, paper section 3.1) loads to the same
function as timm's `vit_base_r50_s16_384` architecture filled by timm's own npz loader, at
tiny size: every hidden state within 1e-5 (issue 33)."""

import functools

import numpy as np
import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .test_jax_npz import BASE, google_arrays, save, timm_blocks

vision_transformer = pytest.importorskip("timm.models.vision_transformer")

LAYERS = (1, 2)  # two ResNet stages (stride 8), the second of two units; R50's (3, 4, 9)
# vit_jax's unit modules -> timm's, as timm's `_load_weights` reads them
UNIT = {"conv1": "conv1", "conv2": "conv2", "conv3": "conv3", "gn1": "norm1", "gn2": "norm2",
        "gn3": "norm3", "conv_proj": "downsample.conv", "gn_proj": "downsample.norm"}


def timm_hybrid():
    """timm's ViT over a HybridEmbed of `_resnetv2(LAYERS)` (vit_base_r50_s16_384's helper),
    with the tiny ViT of the npz tests."""
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer_hybrid import _resnetv2

    embed = functools.partial(HybridEmbed, backbone=_resnetv2(LAYERS))
    return vision_transformer.VisionTransformer(**{**BASE, "patch_size": 1,
                                                   "embed_layer": embed}).eval()


def hybrid_arrays(model):
    """The paper's npz layout of a timm hybrid: the ViT's arrays (`google_arrays`) and the
    ResNet's under vit_jax's names, the inverse of timm's `_load_weights`."""
    arrays = google_arrays(model)
    sd = {k.removeprefix("patch_embed.backbone."): v.detach().numpy().copy()
          for k, v in model.state_dict().items() if k.startswith("patch_embed.backbone.")}
    arrays["conv_root/kernel"] = sd["stem.conv.weight"].transpose(2, 3, 1, 0)  # HWIO
    arrays["gn_root/scale"], arrays["gn_root/bias"] = sd["stem.norm.weight"], sd["stem.norm.bias"]
    for stage, depth in enumerate(LAYERS):
        for unit in range(depth):
            ours, theirs = f"stages.{stage}.blocks.{unit}.", f"block{stage + 1}/unit{unit + 1}/"
            for flax, torch_name in UNIT.items():
                if ours + torch_name + ".weight" not in sd:
                    continue  # no projection shortcut in this unit
                if flax.startswith("conv"):
                    arrays[f"{theirs}{flax}/kernel"] = \
                        sd[f"{ours}{torch_name}.weight"].transpose(2, 3, 1, 0)
                else:
                    arrays[f"{theirs}{flax}/scale"] = sd[f"{ours}{torch_name}.weight"]
                    arrays[f"{theirs}{flax}/bias"] = sd[f"{ours}{torch_name}.bias"]
    return arrays


def hybrid_npz(folder):
    """A tiny R50+ViT-style npz (random, perturbed weights) at `folder / "r50_vit.npz"`."""
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    return save(folder / "r50_vit.npz", hybrid_arrays(perturbed(timm_hybrid())))


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    path = hybrid_npz(tmp_path_factory.mktemp("hybrid"))
    torch.manual_seed(1)  # a fresh model, filled by timm's own loader
    reference = timm_hybrid()
    reference.load_pretrained(str(path))
    return path, reference


def test_every_array_is_read_and_the_architecture_recovered(npz):
    path, _ = npz
    checkpoint = read_checkpoint(path)
    assert detect_format(checkpoint).name == "jax_npz"
    config = load_encoder(path).config
    assert config.hybrid_layers == LAYERS and config.patch_size == 8 and config.grid == (4, 4)
    assert (config.width, config.depth, config.heads, config.in_channels) == (32, 2, 4, 3)


@pytest.mark.parametrize("size", [(32, 32), (48, 24)])
def test_every_hidden_state_matches_timms_loader(npz, size):
    path, reference = npz
    ours = load_encoder(path).eval()
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        if size != (32, 32):  # timm resizes its table once at load; ours per grid, alike
            reference = type(reference)(**{**reference_args(), "img_size": size}).eval()
            reference.load_pretrained(str(path))
        blocks = timm_blocks(reference, x)
        final = reference.forward_features(x)
    for mine, theirs in zip(out.hidden_states[1:], blocks, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, final, atol=1e-5, rtol=1e-5)


def reference_args():
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer_hybrid import _resnetv2

    return {**BASE, "patch_size": 1,
            "embed_layer": functools.partial(HybridEmbed, backbone=_resnetv2(LAYERS))}


def test_the_tower_pools_the_class_token(npz):
    path, _ = npz
    tower = load_tower(path)
    assert tower.pooler.pooler_spec["name"] == "cls"


def test_a_missing_unit_array_is_named(npz, tmp_path):
    path, _ = npz
    arrays = dict(np.load(path))
    del arrays["block2/unit2/gn3/scale"]
    with pytest.raises(ValueError, match=r"block2\.2\.norm3\.weight|stages\.1\.blocks\.1\.norm3"):
        load_encoder(save(tmp_path / "broken.npz", arrays))
