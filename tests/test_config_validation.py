"""Configs are validated before anything is built (issue 19, sections 2 and 3).

Every field's type and range is checked in one place, each refusal is one `ValueError` that
names the file, the field and the value, and a config's sizes are checked against the weights
that come with it, so a small file cannot hang a command or exhaust memory.
"""

import json
import math

import numpy as np
import pytest
import torch

from vlm_vit import VisionEncoder, VisionTower, build_pooler, load_encoder, load_tower
from vlm_vit.cli import main
from vlm_vit.config import LIMITS, ConfigError, EncoderConfig
from vlm_vit.convert.hf_clip import save_hf_clip
from vlm_vit.convert.hf_vit import KEY_MAP as HF_VIT_KEY_MAP
from vlm_vit.convert.keymap import invert, rename, split_qkv
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import convert_checkpoint

from .conftest import TINY, tiny_config

GIANT = 10**9


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def native_dir(tmp_path, **encoder_changes):
    """A tiny native encoder directory whose config.json's encoder section is edited."""
    torch.manual_seed(0)
    directory = tmp_path / "tiny"
    VisionEncoder(tiny_config()).save_pretrained(directory, model_card=False)
    edit_json(directory / "config.json", lambda data: data["encoder"].update(encoder_changes))
    return directory


# -- EncoderConfig: every field's type and range ---------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("norm_eps", math.nan), ("norm_eps", math.inf), ("norm_eps", "NaN"), ("norm_eps", 2.0),
    ("norm_eps", True),
    ("class_token", "no"), ("class_token", 1), ("pre_norm", None), ("qkv_bias", "yes"),
    ("final_norm", 0), ("patch_bias", "false"), ("pos_resize_antialias", 1.0),
    ("num_register_tokens", 1.5), ("num_register_tokens", 65), ("num_register_tokens", "2"),
    ("depth", GIANT), ("depth", 257), ("depth", True), ("depth", "12"), ("depth", 12.0),
    ("width", 16_384 * 2), ("mlp_width", GIANT), ("mlp_width", 65_537),
    ("in_channels", GIANT), ("heads", 1.5), ("patch_size", "8"),
    ("act", 5), ("pos_resize_mode", None),
])
def test_every_field_is_type_and_range_checked(field, value):
    with pytest.raises(ConfigError) as info:
        tiny_config(**{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message, message
    assert (info.value.field, info.value.value) == (field, value)


@pytest.mark.parametrize("changes, text", [
    (dict(width=GIANT, mlp_width=GIANT, heads=4), r"width must be a positive int \(1\.\.16384\)"),
    (dict(image_size=(10**6, 10**6)), r"image_size .*1\.\.16384"),
    (dict(image_size=(16_384, 16_384), patch_size=8),
     r"a 2048x2048 grid of 4194304 patches, more than 1048576"),
    (dict(patch_size=64), "not a multiple of patch size 64"),
])
def test_sizes_and_their_combinations_are_bounded(changes, text):
    with pytest.raises(ConfigError, match=text):
        tiny_config(**changes)


SWIGLU = dict(mlp="swiglu", act="silu")


@pytest.mark.parametrize("changes, message", [
    (dict(mlp_norm=True), "mlp_norm normalises SwiGLU's gated hidden activation: it needs mlp "
     "'swiglu', got mlp 'mlp'"),
    (dict(SWIGLU, mlp_norm="yes"), "mlp_norm must be true or false, got 'yes'"),
    (dict(rope_reference_grid=(16, 16)), "rope_reference_grid rescales 2D RoPE positions: it "
     "needs rope_theta, which is null (got (16, 16))"),
    (dict(rope_theta=10000, rope_reference_grid=(16, 0)), "rope_reference_grid must be an int "
     "or a (height, width) pair of ints (1..16384), got (16, 0)"),
    (dict(rope_theta=10000, rope_reference_grid=[16, 16, 16]), "rope_reference_grid must be an "
     "int or a (height, width) pair of ints (1..16384), got [16, 16, 16]"),
])
def test_eva02_sub_ln_and_rope_reference_grid_are_validated(changes, message):
    with pytest.raises(ConfigError) as info:
        tiny_config(**changes)
    assert str(info.value) == message


def test_eva02_sub_ln_and_rope_reference_grid_round_trip():
    config = tiny_config(**SWIGLU, mlp_norm=True, rope_theta=10000, rope_reference_grid=[16, 16])
    assert (config.mlp_norm, config.rope_reference_grid) == (True, (16, 16))
    assert tiny_config(rope_theta=10000, rope_reference_grid=np.int64(24)).rope_reference_grid \
        == (24, 24)  # timm's to_2tuple
    data = json.loads(json.dumps(config.to_dict()))
    assert data["rope_reference_grid"] == [16, 16] and EncoderConfig.from_dict(data) == config


def test_the_largest_real_vits_and_numpy_ints_pass():
    # ViT-22B (Dehghani et al. 2023): width 6144, depth 48, 48 heads, MLP 24576, patch 14.
    giant = EncoderConfig(width=6144, depth=48, heads=48, mlp_width=24576, patch_size=14)
    assert giant.depth == 48
    most_registers = LIMITS["num_register_tokens"][1]
    config = tiny_config(depth=np.int64(2), norm_eps=1, num_register_tokens=most_registers)
    assert type(config.depth) is int and config.depth == 2
    assert type(config.norm_eps) is float


def test_from_dict_names_the_file():
    with pytest.raises(ConfigError, match=r"^dir/config\.json: norm_eps must be .*got 'NaN'$"):
        EncoderConfig.from_dict({**tiny_config().to_dict(), "norm_eps": "NaN"},
                                source="dir/config.json")
    with pytest.raises(ValueError, match=r"^dir/config\.json: .*JSON object.*got list"):
        EncoderConfig.from_dict([1, 2], source="dir/config.json")


# -- native directories: the reproductions of section 3 ---------------------------------------

@pytest.mark.parametrize("field, value", [
    ("norm_eps", math.nan), ("norm_eps", math.inf), ("norm_eps", "NaN"),
    ("class_token", "no"), ("num_register_tokens", 1.5),
])
def test_native_config_values_are_refused_naming_file_and_field(tmp_path, field, value):
    directory = native_dir(tmp_path, **{field: value})
    with pytest.raises(ValueError) as info:
        load_encoder(directory)
    message = str(info.value)
    assert str(directory / "config.json") in message and field in message, message


def test_info_on_a_depth_of_a_billion_is_one_line_at_once(tmp_path, capsys):
    directory = native_dir(tmp_path, depth=GIANT)
    assert main(["info", str(directory)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "depth" in err and "1000000000" in err, err


def test_a_width_of_a_billion_is_refused(tmp_path):
    directory = native_dir(tmp_path, width=GIANT, mlp_width=GIANT)
    with pytest.raises(ValueError, match=r"config\.json: width must be .*got 1000000000"):
        load_encoder(directory)


# -- sizes against the weights, before anything is built --------------------------------------

@pytest.mark.parametrize("changes, text", [
    (dict(depth=5), "config.json says depth 5 but the weights hold 3 blocks"),
    (dict(width=64), "says width 64 but the weights hold width 32"),
    (dict(mlp_width=128), "says mlp_width 128 but the weights hold 64"),
    (dict(patch_size=16), "says patch_size 16 but the weights hold 8x8 patches"),
    (dict(image_size=[64, 64]),
     r"says image_size 64x64 \(1 \+ 64 position entries\) but the weights hold 17"),
    (dict(num_register_tokens=2), "says num_register_tokens 2 but the weights hold 0"),
])
def test_config_sizes_are_checked_against_the_weights(tmp_path, capsys, changes, text):
    directory = native_dir(tmp_path, **changes)
    with pytest.raises(ValueError, match=text) as info:
        convert_checkpoint(directory)  # what `info` and every loader read first
    assert str(directory) in str(info.value)
    assert main(["info", str(directory)]) == 1  # `info` builds no model, and says so too
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "says" in err, err


CLIP_SHAPED = dict(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False)


def hf_clip_dir(tmp_path, **config_changes):
    torch.manual_seed(0)
    directory = tmp_path / "clip"
    save_hf_clip(VisionEncoder(tiny_config(**CLIP_SHAPED)), directory)
    edit_json(directory / "config.json", lambda data: data.update(config_changes))
    return directory


@pytest.mark.parametrize("layers", [300, GIANT])
def test_hf_clip_num_hidden_layers_out_of_range(tmp_path, layers):
    directory = hf_clip_dir(tmp_path, num_hidden_layers=layers)
    with pytest.raises(ValueError, match=rf"config\.json: depth must be a positive int "
                       rf"\(1\.\.256\), got {layers} \(num_hidden_layers\)"):
        load_encoder(directory)


@pytest.mark.parametrize("changes, text", [
    (dict(num_hidden_layers=5), "config.json says depth 5 but the weights hold 3 blocks"),
    (dict(hidden_size=64), "says width 64 but the weights hold width 32"),
    (dict(layer_norm_eps="NaN"), r"norm_eps must be .*got 'NaN' \(layer_norm_eps\)"),
    (dict(num_attention_heads="4"), r"heads must be .*got '4' \(num_attention_heads\)"),
])
def test_hf_clip_config_is_checked(tmp_path, changes, text):
    directory = hf_clip_dir(tmp_path, **changes)
    with pytest.raises(ValueError, match=text) as info:
        convert_checkpoint(directory)
    assert str(directory) in str(info.value)


def hf_vit_dir(tmp_path, **config_changes):
    """A Hugging Face ViTModel directory written by hand from a tiny encoder."""
    torch.manual_seed(0)
    directory = tmp_path / "vit"
    directory.mkdir(parents=True)
    state = dict(VisionEncoder(tiny_config(norm_eps=1e-12)).state_dict())
    split_qkv(state, TINY["depth"])
    saved_names = {k: v for k, v in HF_VIT_KEY_MAP.items() if not k.startswith("layers.")}
    write_safetensors(rename(state, invert(saved_names), TINY["depth"]),
                      directory / "model.safetensors")
    config = {**dict(model_type="vit", hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8),
              **config_changes}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_hf_vit_directory_reads_and_its_sizes_are_checked(tmp_path):
    assert load_encoder(hf_vit_dir(tmp_path / "ok")).config.depth == 3
    with pytest.raises(ValueError, match=r"depth must be .*got 1000000000 \(num_hidden_layers\)"):
        load_encoder(hf_vit_dir(tmp_path / "deep", num_hidden_layers=GIANT))
    with pytest.raises(ValueError, match="says mlp_width 96 but the weights hold 64"):
        load_encoder(hf_vit_dir(tmp_path / "wide", intermediate_size=96))


# -- poolers: names and sizes -----------------------------------------------------------------

@pytest.mark.parametrize("name, options, text", [
    ("mlp1000000000x_gelu", {}, r"mlp1000000000x_gelu: the depth 1000000000 .* 1\.\.64"),
    ("mlp65x_gelu", {}, r"depth 65 .* 1\.\.64"),
    ("mlp0x_gelu", {}, r"depth 0 .* 1\.\.64"),
    ("linear", dict(out_dim=70_000), r"out_dim must be .*1\.\.65536.*got 70000"),
    ("linear", dict(out_dim=True), r"out_dim must be .*got True"),
    ("mean", dict(in_dim=GIANT), r"in_dim must be .*got 1000000000"),
    ("attention_pool", dict(num_queries=GIANT), r"num_queries must be .*got 1000000000"),
    ("attention_pool", dict(mlp_ratio=1e9), r"mlp_ratio must be .*got 1000000000\.0"),
    ("perceiver", dict(num_latents=GIANT), r"num_latents must be .*got 1000000000"),
    ("perceiver", dict(depth=GIANT), r"depth must be .*got 1000000000"),
    ("pixel_shuffle", dict(scale=10**5), r"scale must be .*got 100000"),
    ("mlp2x_gelu", dict(depth="2"), r"depth must be .*got '2'"),
])
def test_pooler_sizes_are_bounded(name, options, text):
    options = {"in_dim": 32, **options}
    with pytest.raises(ValueError, match=text):
        build_pooler(name, **options)


def test_mlp_depth_in_range_builds():
    assert len(build_pooler("mlp3x_gelu", in_dim=8)) == 5
    assert len(build_pooler("mlp64x_gelu", in_dim=2)) == 127


# -- tower configs ----------------------------------------------------------------------------

def tower_dir(tmp_path, change):
    torch.manual_seed(0)
    directory = tmp_path / "tower"
    tower = VisionTower(VisionEncoder(tiny_config()), build_pooler("mlp2x_gelu", in_dim=32))
    tower.save_pretrained(directory, model_card=False)
    edit_json(directory / "config.json", lambda data: change(data["tower"]))
    return directory


@pytest.mark.parametrize("change, text", [
    (lambda tower: tower.pop("pooler"), r"tower\.pooler is missing"),
    (lambda tower: tower.update(pooler="mlp2x_gelu"), r"tower\.pooler must be a JSON object"),
    (lambda tower: tower["pooler"].update(name="mlp1000000000x_gelu"),
     r"mlp1000000000x_gelu: the depth 1000000000 .* 1\.\.64"),
    (lambda tower: tower["pooler"].update(out_dim=GIANT), r"out_dim must be .*got 1000000000"),
    (lambda tower: tower["pooler"].pop("in_dim"), r"tower\.pooler\.in_dim is missing"),
    (lambda tower: tower["pooler"].update(options=[]), r"tower\.pooler\.options must be"),
    (lambda tower: tower["pooler"].update(name=7), r"tower\.pooler\.name must be"),
    (lambda tower: tower.update(keep_prefix="yes"), r"tower\.keep_prefix must be .*'yes'"),
    (lambda tower: tower.update(feature_layer="last"), r"tower\.feature_layer must be"),
    (lambda tower: tower.update(feature_layer=[1.5]), r"tower\.feature_layer must be"),
])
def test_tower_config_is_validated_naming_file_and_field(tmp_path, change, text):
    directory = tower_dir(tmp_path, change)
    for load in (VisionTower.from_pretrained, load_tower):
        with pytest.raises(ValueError, match=text) as info:
            load(directory)
        assert str(directory / "config.json") in str(info.value)
