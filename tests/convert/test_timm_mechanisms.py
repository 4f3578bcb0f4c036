"""timm's DINOv2 with registers, the hybrid R50+ViT (`vit_base_r50_s16_384`'s architecture at
tiny size) and LayerScale / SwiGLU / RMSNorm towers load to the same function as timm's own
VisionTransformer: every hidden state within 1e-5 on tiny random weights (issue 33)."""

import functools
import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder
from vlm_vit.convert.timm import build_timm_model, to_timm_state_dict
from vlm_vit.io.files import write_safetensors
from vlm_vit.testing import perturbed

vision_transformer = pytest.importorskip("timm.models.vision_transformer")

# vit_small_patch14_reg4_dinov2's model_args at tiny size: a 4 x 4 grid of 7-pixel patches
DINOV2_REG = dict(img_size=28, patch_size=7, embed_dim=32, depth=2, num_heads=4,
                  init_values=1e-5, reg_tokens=4, no_embed_class=True, num_classes=0,
                  dynamic_img_size=True)
HYBRID_LAYERS = (1, 1)  # two ResNet stages: stride 8 (R50+ViT-B/16 has (3, 4, 9): 16)


def timm_states(model, x):
    """timm's tokens after the embedding and after every block, and the final tokens."""
    tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    states = [tokens]
    for block in model.blocks:
        tokens = block(tokens)
        states.append(tokens)
    return states, model.norm(tokens)


def assert_parity(ours, theirs, size, atol=1e-5):
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final = timm_states(theirs, x)
    assert len(out.hidden_states) == len(states) == ours.config.depth + 1
    for mine, expected in zip(out.hidden_states, states, strict=True):
        torch.testing.assert_close(mine, expected, atol=atol, rtol=atol)
    torch.testing.assert_close(out.tokens, final, atol=atol, rtol=atol)


@pytest.fixture(scope="module")
def dinov2_reg(tmp_path_factory):
    torch.manual_seed(0)
    model = perturbed(vision_transformer.VisionTransformer(**DINOV2_REG))
    folder = tmp_path_factory.mktemp("dinov2_reg")
    write_safetensors(model.state_dict(), folder / "model.safetensors")
    args = {k: v for k, v in DINOV2_REG.items() if k != "dynamic_img_size"}
    (folder / "config.json").write_text(json.dumps(
        {"architecture": "vit_small_patch14_reg4_dinov2", "num_classes": 0,
         "model_args": args}))
    return folder, model


@pytest.mark.parametrize("size", [(28, 28), (42, 21), (14, 35)])
def test_timm_dinov2_with_registers(dinov2_reg, size):
    folder, theirs = dinov2_reg
    ours = load_encoder(folder).eval()
    config = ours.config
    assert (config.num_register_tokens, config.layer_scale_init, config.heads) == (4, 1e-5, 4)
    assert ours.pos_embed.shape == (1, 1 + 16, 32)  # a zero class entry, none for registers
    # timm resizes with bicubic antialias: our default
    assert_parity(ours, theirs, size)


def test_timm_dinov2_state_dict_without_config(dinov2_reg, tmp_path):
    _, theirs = dinov2_reg
    write_safetensors(theirs.state_dict(), tmp_path / "bare.safetensors")
    ours = load_encoder(tmp_path / "bare.safetensors", heads=4).eval()  # not in the tensors
    assert ours.config.layer_scale_init == 1e-5  # DINOv2's, when model_args do not say
    assert_parity(ours, theirs, (28, 28))


@pytest.mark.parametrize("mechanisms", [
    dict(layer_scale_init=0.1, mlp="swiglu", act="silu"),
    dict(norm="rmsnorm", pre_norm=True, patch_bias=False),
], ids=["layer_scale_swiglu", "rmsnorm"])
def test_timm_twin_and_state_dict_of_each_mechanism(tmp_path, mechanisms):
    torch.manual_seed(0)
    config = EncoderConfig(image_size=32, patch_size=8, width=128, depth=2, heads=2,
                           mlp_width=256, **mechanisms)
    encoder = perturbed(VisionEncoder(config))
    theirs = build_timm_model(config, dynamic_img_size=True).eval()
    theirs.load_state_dict(to_timm_state_dict(encoder.state_dict(), config), strict=True)
    assert_parity(encoder, theirs, (32, 32))
    assert_parity(encoder, theirs, (24, 40))
    write_safetensors(theirs.state_dict(), tmp_path / "timm.safetensors")
    read = load_encoder(tmp_path / "timm.safetensors", heads=2).eval()  # not in the tensors
    assert {k: v for k, v in read.config.to_dict().items() if k != "layer_scale_init"} == \
        {k: v for k, v in config.to_dict().items() if k != "layer_scale_init"}
    assert_parity(read, theirs, (32, 32))


# -- the hybrid ----------------------------------------------------------------------------

def timm_hybrid(layers=HYBRID_LAYERS, **options):
    """timm's VisionTransformer over a HybridEmbed of a ResNetV2 built as
    `vit_base_r50_s16_384` builds its own (`_resnetv2`), with fewer blocks and a tiny ViT."""
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer_hybrid import _resnetv2

    torch.manual_seed(0)
    embed = functools.partial(HybridEmbed, backbone=_resnetv2(layers))
    args = dict(img_size=32, patch_size=1, embed_dim=32, depth=2, num_heads=4, num_classes=0,
                embed_layer=embed)
    return perturbed(vision_transformer.VisionTransformer(**{**args, **options}))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    model = timm_hybrid()
    path = tmp_path_factory.mktemp("hybrid") / "r50_vit.safetensors"
    write_safetensors(model.state_dict(), path)
    return path, model


def test_timm_hybrid_state_dict(hybrid):
    path, theirs = hybrid
    ours = load_encoder(path, heads=4).eval()  # a bare state dict does not record heads
    assert ours.config.hybrid_layers == HYBRID_LAYERS and ours.config.patch_size == 8
    assert ours.config.grid == (4, 4)
    # float32: the ResNet's standardised convs and group norms differ from timm's by
    # rounding (var_mean against batch_norm): measured 2.4e-6 on tokens up to 3.8 (3 inputs)
    assert_parity(ours, theirs, (32, 32))
    with torch.no_grad():  # and the same arithmetic in float64
        x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
        mine = ours.double()(x, output_hidden_states=True).hidden_states
        states, _ = timm_states(theirs.double(), x)
    ours.float(), theirs.float()
    for a, b in zip(mine, states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_the_timm_twin_of_a_hybrid(hybrid):
    path, theirs = hybrid
    ours = load_encoder(path, heads=4).eval()
    twin = build_timm_model(ours.config).eval()
    twin.load_state_dict(theirs.state_dict(), strict=True)
    assert_parity(ours, twin, (32, 32))


def test_the_hybrids_grid_at_224_and_384():
    with torch.device("meta"):
        for side, grid in ((224, (14, 14)), (384, (24, 24))):
            encoder = VisionEncoder(EncoderConfig.from_name("r50+vit-b/16", image_size=side))
            out = encoder.patch_embed(torch.empty(1, 3, side, side))
            assert out[1] == grid and out[0].shape == (1, grid[0] * grid[1], 768)
            assert encoder.pos_embed.shape == (1, 1 + grid[0] * grid[1], 768)


def test_full_size_hybrid_has_timms_parameters():
    import timm

    with torch.device("meta"):
        theirs = timm.create_model("vit_base_r50_s16_384", pretrained=False, num_classes=0)
        ours = VisionEncoder(EncoderConfig.from_name("r50+vit-b/16"))
    shapes = {name: tuple(t.shape) for name, t in ours.state_dict().items()}
    assert shapes == {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 98_181_952


def test_a_hybrid_is_refused_by_timms_config_file_writer(tmp_path):
    from vlm_vit.cli import main

    torch.manual_seed(0)
    VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1, heads=4,
                                mlp_width=64, hybrid_layers=HYBRID_LAYERS)
                  ).save_pretrained(tmp_path / "native", model_card=False)
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "t"), "--to", "timm"]) == 1


def test_dinov2_converted_to_timm_loads_in_timm(tmp_path):
    import timm

    from vlm_vit.cli import main

    from .test_matrix import saved_by_transformers

    source = saved_by_transformers("Dinov2Model", "Dinov2Config")(tmp_path)
    assert main(["convert", str(source), str(tmp_path / "timm"), "--to", "timm"]) == 0
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    assert theirs.blocks[0].ls1.gamma.shape == (128,)  # LayerScale built from init_values
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs.forward_features(x),
                                   load_encoder(source).eval()(x).tokens, atol=1e-5, rtol=1e-5)


# vit_intern300m_patch14_448 (InternViT-300M, InternVL 2.5's tower) at tiny size: LayerScale
# 0.1, a class token, no final norm's change (timm's VisionTransformer), a 4 x 4 grid.
INTERN = dict(embed_dim=32, depth=2, num_heads=4, img_size=56)


@pytest.fixture(scope="module")
def intern300m(tmp_path_factory):
    import timm

    torch.manual_seed(0)
    model = perturbed(timm.create_model("vit_intern300m_patch14_448", pretrained=False,
                                        num_classes=0, **INTERN)).eval()
    folder = tmp_path_factory.mktemp("intern300m")
    write_safetensors(model.state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"architecture": "vit_intern300m_patch14_448", "num_classes": 0,
         "model_args": INTERN}))
    return folder, model


@pytest.mark.parametrize("size", [(56, 56), (42, 70)])
def test_timm_intern_vit_300m_every_hidden_state(intern300m, size):
    """InternViT-300M (issue 45) through the generic timm reader: LayerScale read from
    `ls1.gamma` / `ls2.gamma`, every hidden state and the final tokens within 1e-5, at the
    native size and another."""
    folder, theirs = intern300m
    ours = load_encoder(folder).eval()
    assert ours.config.layer_scale_init is not None and ours.config.class_token
    assert_parity(ours, theirs, size)


def test_timm_intern_vit_300m_writes_back_and_timm_loads_it_strictly(intern300m, tmp_path):
    import timm

    from vlm_vit.convert.timm import TimmFormat

    folder, theirs = intern300m
    ours = load_encoder(folder).eval()
    TimmFormat().write(ours, tmp_path / "back")
    back = timm.create_model(f"local-dir:{tmp_path / 'back'}", pretrained=True).eval()
    x = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back.forward_features(x), theirs.forward_features(x),
                                   atol=1e-6, rtol=0)
