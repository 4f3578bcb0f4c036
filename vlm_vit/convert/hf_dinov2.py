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
"""

from __future__ import annotations

from typing import Any

import torch

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
from vlm_vit.convert.keymap import fuse_qkv, rename
from vlm_vit.processor import NORMALIZATION, ImageProcessor

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
        fuse_qkv(state, config.depth)
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


register_format(HfDinov2Format())
