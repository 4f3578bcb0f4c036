"""Damaged and contradictory checkpoints are refused by name, or loaded with a rule that
holds for the family, never turned into wrong numbers without a word (issue 40): a
wrong-shaped q/k/v named with both shapes before any fix-up touches it, a bare EVA-02 state
dict with the heads given (or refused naming heads=), timm `model_args` that contradict the weights,
non-finite weights said at WARNING, and Qwen2-VL's `spatial_merge_size` out of range."""

import functools
import json
import logging

import pytest
import torch

from vlm_vit import load_encoder
from vlm_vit.cli import main
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.tensor_files import read_safetensors
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
timm_hub = pytest.importorskip("timm.models._hub")

EVA_TINY = dict(img_size=28, patch_size=7, embed_dim=32, depth=2, num_heads=2,
                ref_feat_shape=(4, 4), num_classes=0)


def save_hf(folder, model_class, config_class, **sizes):
    """A tiny transformers vision model at random init, saved with `save_pretrained`."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**sizes)
    getattr(transformers, model_class)(config).save_pretrained(folder)
    return folder


def save_timm_eva(folder, **options):
    """A tiny eva02_tiny-shaped timm Eva, saved in timm's hub layout."""
    torch.manual_seed(0)
    args = {**EVA_TINY, **options}
    model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, **args)
    timm_hub.save_for_hf(model, str(folder), model_args=args, safe_serialization=True)
    return folder


SOURCES = {
    "dinov2": (lambda folder: save_hf(folder, "Dinov2Model", "Dinov2Config", hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      image_size=28, patch_size=7),
               "encoder.layer.1.attention.attention.key.weight"),
    "pixtral": (lambda folder: save_hf(folder, "PixtralVisionModel", "PixtralVisionConfig",
                                       hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                                       image_size=64, patch_size=8, hidden_act="silu"),
                "transformer.layers.1.attention.k_proj.weight"),
    "siglip2": (lambda folder: save_hf(folder, "Siglip2VisionModel", "Siglip2VisionConfig",
                                       hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=48,
                                       patch_size=8, num_patches=64),
                "encoder.layers.1.self_attn.v_proj.weight"),
    "eva02": (save_timm_eva, "blocks.1.attn.qkv.weight"),
    "eva02_q_bias": (save_timm_eva, "blocks.1.attn.q_bias"),
    "eva02_unfused": (functools.partial(save_timm_eva, qkv_fused=False),
                      "blocks.1.attn.k_proj.weight"),
}
# Wider inputs fail inside torch.cat (or timm's RoPE permutation); more rows pass the
# concatenation, and a q bias one longer even loaded (its extra row dropped by the permutation).
DAMAGE = {"columns": lambda shape: [*shape[:-1], shape[-1] + 5],
          "rows": lambda shape: [shape[0] + 1, *shape[1:]]}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("family", sorted(SOURCES))
def test_a_wrong_shaped_qkv_is_named_with_both_shapes(tmp_path, family, damage):
    save, name = SOURCES[family]
    folder = save(tmp_path / family)
    weights = folder / "model.safetensors"
    tensors = read_safetensors(weights)
    good = list(tensors[name].shape)
    bad = DAMAGE[damage](good)
    tensors[name] = torch.zeros(bad)
    write_safetensors(tensors, weights)
    with pytest.raises(ValueError) as info:
        load_encoder(folder)
    message = str(info.value)
    assert message.startswith(str(folder)) and name in message and "\n" not in message, message
    assert f"{bad}, expected {good}" in message, message


def bare_eva02(tmp_path, width, heads):
    """eva02_tiny_patch14_224 (3 heads of 64 at width 192) cut to two blocks, its
    `state_dict()` saved without timm's config."""
    torch.manual_seed(0)
    model = perturbed(timm.create_model("eva02_tiny_patch14_224", pretrained=False, depth=2,
                                        embed_dim=width, num_heads=heads, num_classes=0))
    path = tmp_path / "eva02.safetensors"
    write_safetensors({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path, model


def test_a_bare_eva02_state_dict_takes_the_heads_given(tmp_path):
    path, model = bare_eva02(tmp_path, width=192, heads=3)
    ours = load_encoder(path, heads=3).eval()  # two blocks: no released EVA-02's sizes
    assert ours.config.heads == 3  # Eva's default (12) was taken before: tokens off by 3e-3
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine, theirs = ours(x).tokens, model.forward_features(x)
    # measured 1.3e-6 on tokens up to 6.3 (with Eva's default 12 heads: 0.78)
    torch.testing.assert_close(mine, theirs, atol=3e-6, rtol=0)


def test_a_bare_eva_of_no_known_size_is_refused_naming_heads(tmp_path):
    path, _ = bare_eva02(tmp_path, width=96, heads=3)
    with pytest.raises(ValueError, match=r"width 96, .*pass heads=.*num_heads") as info:
        load_encoder(path)
    assert str(path) in str(info.value)


def save_timm_hybrid(folder, **model_args):
    """timm's ViT over a ResNetV2 stem (as `vit_base_r50_s16_384`, two stages, tiny ViT)
    in timm's hub layout: config.json with `model_args`, and model.safetensors."""
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer import VisionTransformer
    from timm.models.vision_transformer_hybrid import _resnetv2

    torch.manual_seed(0)
    embed = functools.partial(HybridEmbed, backbone=_resnetv2((1, 1)))
    model = VisionTransformer(img_size=32, patch_size=1, embed_dim=32, depth=2, num_heads=4,
                              num_classes=0, embed_layer=embed)
    folder.mkdir()
    write_safetensors(model.state_dict(), folder / "model.safetensors")
    args = {"embed_dim": 32, "depth": 2, "num_heads": 4, "img_size": 32, **model_args}
    (folder / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_r50_s16_384", "num_classes": 0, "model_args": args}))
    return folder


def test_a_hybrid_whose_model_args_agree_loads(tmp_path):
    encoder = load_encoder(save_timm_hybrid(tmp_path / "hybrid"))
    assert (encoder.config.width, encoder.config.depth) == (32, 2)


@pytest.mark.parametrize("field, value, held", [("embed_dim", 64, 32), ("depth", 12, 2),
                                                ("in_chans", 1, 3)])
def test_hybrid_model_args_contradicting_the_weights_are_refused(tmp_path, capsys, field,
                                                                 value, held):
    folder = save_timm_hybrid(tmp_path / "hybrid", **{field: value})
    assert main(["convert", str(folder), str(tmp_path / "out"), "--to", "native"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 300, err
    assert f"{folder / 'config.json'}: model_args.{field} is {value} but the weights hold " \
        f"{held}" in err, err
    assert not (tmp_path / "out").exists()


def test_non_finite_weights_are_said_at_warning_naming_file_and_tensor(tmp_path, caplog):
    folder = save_timm_eva(tmp_path / "eva")
    weights = folder / "model.safetensors"
    tensors = read_safetensors(weights)
    tensors["blocks.1.mlp.fc2.weight"][0, 0] = float("nan")
    tensors["blocks.1.norm2.weight"][0] = float("inf")  # later in the state: not named
    write_safetensors(tensors, weights)
    with caplog.at_level(logging.WARNING, logger="vlm_vit"):
        encoder = load_encoder(folder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(folder) in warnings[0] and "blocks.1.mlp.fc2.weight" in warnings[0], warnings
    assert "\n" not in warnings[0]
    with torch.no_grad():  # the features are indeed NaN: the warning is the only word
        assert encoder(torch.randn(1, 3, 28, 28)).tokens.isnan().any()


def test_finite_weights_say_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vlm_vit"):
        load_encoder(save_timm_eva(tmp_path / "eva"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


QWEN = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel",
                 dict(embed_dim=32, hidden_size=48)),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig",
                   "Qwen2_5_VisionTransformerPretrainedModel",
                   dict(hidden_size=32, intermediate_size=48, out_hidden_size=48,
                        window_size=16, fullatt_block_indexes=[1])),
}


@pytest.mark.parametrize("merge", [0, 1e6, 1_000_000, "2"])
@pytest.mark.parametrize("family", sorted(QWEN))
def test_qwen_spatial_merge_size_out_of_range_names_file_and_field(tmp_path, capsys, family,
                                                                   merge):
    import importlib

    module, config_class, model_class, sizes = QWEN[family]
    package = f"transformers.models.{module}"
    config = getattr(importlib.import_module(f"{package}.configuration_{module}"),
                     config_class)(depth=2, num_heads=4, patch_size=4, temporal_patch_size=2,
                                   spatial_merge_size=2, **sizes)
    torch.manual_seed(0)
    getattr(importlib.import_module(f"{package}.modeling_{module}"),
            model_class)(config).save_pretrained(tmp_path / "tower")
    path = tmp_path / "tower" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "spatial_merge_size": merge}))
    capsys.readouterr()  # transformers' progress bar
    assert main(["info", str(tmp_path / "tower")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 300, err
    assert f"{path}: spatial_merge_size must be a positive int (1..8), got {merge!r}" in err, err
