"""Hugging Face `Dinov2Model` and `Dinov2WithRegistersModel` directories (model_type "dinov2",
"dinov2_with_registers"; Oquab et al. 2024, Darcet et al. 2024).

A DINOv2 block is the paper's with LayerScale on both branches (`layer_scale1.lambda1`, our
`ls1.gamma`), and for ViT-g a SwiGLU MLP whose gate and value Linears are stored fused
(`mlp.weights_in`, split by `split_swiglu`). The registers model puts its
`embeddings.register_tokens` after the class token, without position: our layout.

The files on disk use the names `save_pretrained` writes (`encoder.layer.N.attention.attention.
query`, `mlp.weights_in`); the names of transformers 5's modules (`attention.q_proj`,
`mlp.gate_proj`), found in a state dict saved by hand, are read too.

What the file fixes, recorded in `Converted.rules`:

* the position table is resized bicubically without antialias for `Dinov2Model` and with it
  for `Dinov2WithRegistersModel` (their `interpolate_pos_encoding`: size, not the original
  code's scale factor with an offset of 0.1);
* the MLP width is `int(hidden_size * mlp_ratio)`, for SwiGLU two thirds of that rounded up to
  a multiple of 8 (`Dinov2SwiGLUFFN`), gated by SiLU whatever `hidden_act` says;
* pooling is the class token after the final norm (`pooler_output`).

`write` goes the other way: a `Dinov2Model` directory (`Dinov2WithRegistersModel` with
registers) under the names `save_pretrained` writes, SwiGLU's gate and value fused again into
`mlp.weights_in`; an encoder without LayerScale gets scales of one (the same function).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import EncoderConfig, is_real
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_common import (
    CLIP_IMAGE_PROCESSOR,
    PREPROCESSOR_NAME,
    hf_encoder_config,
    processor_from_hf,
)
from vlm_vit.convert.hf_writing import (
    HF_ACTIVATIONS,
    detached,
    mismatches,
    parameter_free,
    refuse,
    write_hf_directory,
)
from vlm_vit.convert.keymap import fuse_qkv, origins, rename, split_qkv
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import NORMALIZATION, ImageProcessor

logger = logging.getLogger(__name__)

MODEL_TYPES = ("dinov2", "dinov2_with_registers")
PREFIXES = ("dinov2.", "dinov2_with_registers.")  # the classification models wrap the model
CONFIG_FILE = "config.json"

# transformers' Dinov2Config defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, mlp_ratio=4,
    hidden_act="gelu", layer_norm_eps=1e-6, image_size=224, patch_size=14, num_channels=3,
    qkv_bias=True, layerscale_value=1.0, use_swiglu_ffn=False, num_register_tokens=0,
)

_LAYER = "encoder.layer.{}."
# Source module -> native module; each has a weight and a bias.
_MODULES = {
    "embeddings.patch_embeddings.projection": "patch_embed.proj",
    "layernorm": "norm",
    **{_LAYER + source: "blocks.{}." + target for source, target in {
        "norm1": "norm1", "norm2": "norm2",
        # as saved by save_pretrained
        "attention.attention.query": "attn.q", "attention.attention.key": "attn.k",
        "attention.attention.value": "attn.v", "attention.output.dense": "attn.proj",
        "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
        "mlp.weights_in": "mlp.weights_in",  # gate and value, split by `split_swiglu`
        "mlp.weights_out": "mlp.fc2",
        # transformers 5's module names (a state_dict() saved without save_pretrained)
        "attention.q_proj": "attn.q", "attention.k_proj": "attn.k",
        "attention.v_proj": "attn.v", "attention.o_proj": "attn.proj",
        "mlp.gate_proj": "mlp.fc1_g", "mlp.up_proj": "mlp.fc1_x", "mlp.down_proj": "mlp.fc2",
    }.items()},
}
KEY_MAP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.register_tokens": "reg_token",
    _LAYER + "layer_scale1.lambda1": "blocks.{}.ls1.gamma",
    _LAYER + "layer_scale2.lambda1": "blocks.{}.ls2.gamma",
    **{f"{source}.{kind}": f"{target}.{kind}"
       for source, target in _MODULES.items() for kind in ("weight", "bias")},
}
# Deliberately dropped: the masked-image-modelling token and the classifier.
IGNORED = (r"embeddings\.mask_token$", r"classifier\.")
BLOCK_PATTERN = r"encoder\.layer\.(\d+)\."


def split_swiglu(state: dict[str, torch.Tensor], depth: int) -> None:
    """`mlp.weights_in` `[2H, D]` (and its bias) as SwiGLU's gate `fc1_g` (the first H rows,
    `Dinov2SwiGLUFFN`'s `x1`) and value `fc1_x` (in place)."""
    for i in range(depth):
        for kind in ("weight", "bias"):
            fused = state.pop(f"blocks.{i}.mlp.weights_in.{kind}", None)
            if fused is not None:
                gate, value = fused.chunk(2, dim=0)
                state[f"blocks.{i}.mlp.fc1_g.{kind}"] = gate.clone()
                state[f"blocks.{i}.mlp.fc1_x.{kind}"] = value.clone()


def strip_prefix(tensors: dict) -> dict:
    """The model's tensors, without the prefix of the classification models."""
    for prefix in PREFIXES:
        if any(key.startswith(prefix + "embeddings.") for key in tensors):
            return {key.removeprefix(prefix): tensor for key, tensor in tensors.items()}
    return dict(tensors)


def mlp_width(hf: dict[str, Any], source: object) -> int:
    """The MLP's hidden width (`Dinov2MLP`, `Dinov2SwiGLUFFN`).

    Raises:
        ValueError: for an `mlp_ratio` that is not a positive number, naming `source`.
    """
    ratio = hf["mlp_ratio"]
    if not (is_real(ratio) and ratio > 0) or not isinstance(hf["hidden_size"], int):
        raise ValueError(f"{source}: mlp_ratio must be a positive number, got {ratio!r}")
    hidden = int(hf["hidden_size"] * ratio)
    return (int(hidden * 2 / 3) + 7) // 8 * 8 if hf["use_swiglu_ffn"] is True else hidden


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a Dinov2Config dict (its defaults filled in).

    Raises:
        ValueError: for settings vlm-vit refuses, naming `source` and the key.
    """
    hf = {**HF_DEFAULTS, **hf}
    for key in ("qkv_bias", "use_swiglu_ffn"):
        if not isinstance(hf[key], bool):
            raise ValueError(f"{source}: {key} must be true or false, got {hf[key]!r}")
    swiglu = hf["use_swiglu_ffn"]
    fields = {**hf, "intermediate_size": mlp_width(hf, source),
              "hidden_act": "silu" if swiglu else hf["hidden_act"]}
    return hf_encoder_config(
        fields, source, qkv_bias=hf["qkv_bias"], num_register_tokens=hf["num_register_tokens"],
        layer_scale_init=hf["layerscale_value"], mlp="swiglu" if swiglu else "mlp",
        pos_resize_mode="bicubic", pos_resize_antialias=hf["model_type"] != "dinov2",
    )


def image_processor(settings: dict[str, Any] | None, image_size: tuple[int, int],
                    source: object) -> tuple[ImageProcessor, list[str]]:
    """The ImageProcessor of a `preprocessor_config.json` (DINOv2 ships `BitImageProcessor`'s:
    shortest edge, centre crop, bicubic, ImageNet mean and std); without one, those at the
    model's image size."""
    mean, std = NORMALIZATION["imagenet"]
    defaults = ImageProcessor(size=image_size, resize_mode="shortest_edge", resample="bicubic",
                              mean=mean, std=std, crop_rounding="floor")
    if settings is None:
        return defaults, [f"no {PREPROCESSOR_NAME}: shortest-edge resize, centre crop, "
                          f"bicubic, ImageNet mean/std at the model's image size {image_size}"]
    rules: list[str] = []
    return processor_from_hf(settings, defaults, rules, source,
                             processor_class=CLIP_IMAGE_PROCESSOR), rules


class HfDinov2Format:
    """`Dinov2Model` / `Dinov2WithRegistersModel` (and their classifiers) saved by
    `save_pretrained`."""

    name = "hf_dinov2"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.config is not None and \
            checkpoint.config.get("model_type") in MODEL_TYPES

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        hf = {"model_type": "dinov2", **checkpoint.config}
        config = encoder_config(hf, checkpoint.path / CONFIG_FILE)
        tensors = strip_prefix(checkpoint.tensors)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        state = rename(tensors, KEY_MAP, config.depth, ignore=IGNORED, source=checkpoint.path)
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path,
                 origin=origins(tensors, KEY_MAP, config.depth))
        split_swiglu(state, config.depth)
        processor, rules = image_processor(checkpoint.files.get(PREPROCESSOR_NAME),
                                           config.image_size, checkpoint.path)
        antialias = "with" if config.pos_resize_antialias else "without"
        rules.append(f"position table resized like {hf['model_type']}'s "
                     f"interpolate_pos_encoding (bicubic, {antialias} antialias)")
        if config.mlp == "swiglu":
            rules.append(f"SwiGLU MLP of width {config.mlp_width}, gated by SiLU")
        return Converted(config=config, state=state,
                         pooler=NativePooler("cls", config.width, None, {}, {}),
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE)


    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `Dinov2Model.from_pretrained` (`Dinov2WithRegistersModel`'s
        with registers) and `AutoModel` read: config.json and the weights, and the processor
        as `BitImageProcessor`'s preprocessor_config.json.

        Raises:
            ValueError: naming every field DINOv2 cannot hold (see `WRITE_ARCHITECTURE`), a
                pooler with weights, or a processor `BitImageProcessor` cannot express;
                nothing is written then.
        """
        hf = dinov2_config(encoder)  # the architecture first, then the pooler
        parameter_free(pooler, "DINOv2")
        tensors = dinov2_tensors(encoder)
        settings = None
        if processor is not None:
            from vlm_vit.convert.hf_clip import preprocessor_config

            settings = {**preprocessor_config(processor),
                        "image_processor_type": "BitImageProcessor"}
        if encoder.config.pos_resize_antialias != (hf["model_type"] != "dinov2"):
            logger.info("%s resizes its position table bicubically %s antialias; this encoder's "
                        "other grids differ", hf["architectures"][0],
                        "with" if hf["model_type"] != "dinov2" else "without")
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# -- writing ----------------------------------------------------------------------------------

# What a DINOv2 model fixes, in EncoderConfig fields; `write` refuses anything else.
WRITE_ARCHITECTURE = dict(mlp_norm=False,
                          class_token=True, pre_norm=False, final_norm=True, patch_bias=True,
                          norm="layernorm", hybrid_layers=None, pos_embed="learned",
                          rope_theta=None, temporal_patch_size=None, window_size=None,
                          patch_norm=False)
# Native module -> the name `save_pretrained` writes (each has a weight and a bias).
_WRITE_MODULES = {
    "patch_embed.proj": "embeddings.patch_embeddings.projection",
    "norm": "layernorm",
    **{"blocks.{}." + ours: _LAYER + theirs for ours, theirs in {
        "norm1": "norm1", "norm2": "norm2",
        "attn.q": "attention.attention.query", "attn.k": "attention.attention.key",
        "attn.v": "attention.attention.value", "attn.proj": "attention.output.dense",
        "mlp.fc1": "mlp.fc1", "mlp.weights_in": "mlp.weights_in",
    }.items()},
}
WRITE_KEY_MAP = {
    "cls_token": "embeddings.cls_token",
    "pos_embed": "embeddings.position_embeddings",
    "reg_token": "embeddings.register_tokens",
    "mask_token": "embeddings.mask_token",  # what save_pretrained writes; unused here (zeros)
    "blocks.{}.ls1.gamma": _LAYER + "layer_scale1.lambda1",
    "blocks.{}.ls2.gamma": _LAYER + "layer_scale2.lambda1",
    **{f"{ours}.{kind}": f"{theirs}.{kind}"
       for ours, theirs in _WRITE_MODULES.items() for kind in ("weight", "bias")},
}


def mlp_ratio_for(config: EncoderConfig) -> float | None:
    """The `mlp_ratio` that gives `config`'s MLP width (a whole one where it can), or None."""
    swiglu = config.mlp == "swiglu"
    candidates = [*range(1, 9), config.mlp_width / config.width,
                  config.mlp_width * 3 / 2 / config.width]
    for ratio in candidates:
        fields = {"hidden_size": config.width, "mlp_ratio": ratio, "use_swiglu_ffn": swiglu}
        if mlp_width(fields, CONFIG_FILE) == config.mlp_width:
            return ratio
    return None


def dinov2_config(encoder: nn.Module) -> dict[str, Any]:
    """The `config.json` of a DINOv2 model holding `encoder`.

    Raises:
        ValueError: naming every field DINOv2 cannot hold.
    """
    config = encoder.config
    problems = mismatches(config, WRITE_ARCHITECTURE, "DINOv2")
    if config.image_size[0] != config.image_size[1]:
        problems.append(f"image_size={config.image_size} (DINOv2's position table is square)")
    ratio = mlp_ratio_for(config)
    if ratio is None:
        problems.append(f"mlp_width={config.mlp_width} (DINOv2's is int(hidden_size x "
                        "mlp_ratio), for SwiGLU two thirds of it rounded up to a multiple of 8)")
    refuse(problems, "DINOv2")
    registers = config.num_register_tokens
    return {
        "architectures": ["Dinov2WithRegistersModel" if registers else "Dinov2Model"],
        "model_type": "dinov2_with_registers" if registers else "dinov2",
        "hidden_size": config.width, "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads, "mlp_ratio": ratio,
        "hidden_act": HF_ACTIVATIONS[config.act], "layer_norm_eps": config.norm_eps,
        "image_size": config.image_size[0], "patch_size": config.patch_size,
        "num_channels": config.in_channels, "qkv_bias": config.qkv_bias,
        "layerscale_value": config.layer_scale_init or 1.0,
        "use_swiglu_ffn": config.mlp == "swiglu",
        **({"num_register_tokens": registers} if registers else {}),
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "drop_path_rate": 0.0, "initializer_range": 0.02, "apply_layernorm": True,
        "reshape_hidden_states": True,
        "dtype": str(encoder.pos_embed.dtype).removeprefix("torch."),
    }


def fuse_swiglu(state: dict[str, torch.Tensor], depth: int) -> None:
    """The inverse of `split_swiglu`: `fc1_g` then `fc1_x` as `mlp.weights_in` (in place)."""
    for i in range(depth):
        for kind in ("weight", "bias"):
            parts = [state.pop(f"blocks.{i}.mlp.{x}.{kind}") for x in ("fc1_g", "fc1_x")]
            state[f"blocks.{i}.mlp.weights_in.{kind}"] = torch.cat(parts)


def dinov2_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under the names `save_pretrained` writes (a pure function)."""
    config = encoder.config
    state = detached(encoder)
    split_qkv(state, config.depth)
    if config.mlp == "swiglu":
        fuse_swiglu(state, config.depth)
    width = config.width
    reference = state["cls_token"]
    for i in range(config.depth):  # no LayerScale: scales of one are the same function
        for name in (f"blocks.{i}.ls1.gamma", f"blocks.{i}.ls2.gamma"):
            state.setdefault(name, reference.new_ones(width))
    state["mask_token"] = reference.new_zeros(1, width)
    fc2 = "mlp.weights_out" if config.mlp == "swiglu" else "mlp.fc2"
    key_map = {**WRITE_KEY_MAP, **{f"blocks.{{}}.mlp.fc2.{kind}": f"{_LAYER}{fc2}.{kind}"
                                   for kind in ("weight", "bias")}}
    return rename(state, key_map, config.depth, source="the encoder")


register_format(HfDinov2Format())
