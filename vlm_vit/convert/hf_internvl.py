"""Hugging Face InternVL vision towers (`InternVLVisionModel`, model_type "internvl_vision";
Chen et al. 2024, "InternVL: Scaling up Vision Foundation Models and Aligning for Generic
Visual-Linguistic Tasks"), InternViT-300M's shape.

InternViT's block is the pre-norm ViT block with LayerScale on both branches (`lambda_1`,
`lambda_2`, our `ls1.gamma`, `ls2.gamma`), LayerNorm or RMSNorm (`norm_type`, eps
`layer_norm_eps`) before attention and MLP, q, k and v Linears biased or not
(`attention_bias`), an output projection and a GELU MLP always biased. A class token leads;
the learned table (`use_absolute_position_embeddings`) holds its position and the patches'
at `image_size`, resized for other grids bicubically without antialias
(`interpolate_pos_encoding`). After the last block a LayerNorm (`use_mean_pooling` false,
our `final_norm`) or nothing (`use_mean_pooling` true, the released towers).

What the file fixes, recorded in `Converted.rules`:

* `pooler_output` is not computed by transformers; the pooler is what its config documents:
  the mean of the patch tokens (`use_mean_pooling`, our `mean`) or the final class token
  (`cls`);
* the masked-image-modelling token (`use_mask_token`) is not read.

Refused by name, before a model is built: `use_qk_norm` (InternViT-6B's RMSNorm over q and
k across the whole width: our block has no q/k norm), a `norm_type` other than layer_norm or
rms_norm, rms_norm with a final LayerNorm (`use_mean_pooling` false: our `norm` is every
norm's), non-square patches, and a non-square `image_size` with a position table (transformers
reshapes the table to a square).

`write` goes the other way: an `InternVLVisionModel` directory; an encoder without LayerScale
gets scales of one (the same function).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_common import (
    PREPROCESSOR_NAME,
    ImageProcessorClass,
    hf_encoder_config,
    squash_processor,
)
from vlm_vit.convert.hf_writing import (
    HF_ACTIVATIONS,
    detached,
    mismatches,
    parameter_free,
    refuse,
    write_hf_directory,
)
from vlm_vit.convert.keymap import fuse_qkv, invert, rename, split_qkv
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)

MODEL_TYPE = "internvl_vision"
CONFIG_FILE = "config.json"
BLOCK_PATTERN = r"encoder\.layer\.(\d+)\."
# transformers' InternVLVisionConfig defaults (InternViT-300M at 448), for keys a file omits.
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, attention_bias=False,
    use_qk_norm=False, intermediate_size=4096, hidden_act="gelu", norm_type="layer_norm",
    layer_norm_eps=1e-6, image_size=448, patch_size=14, num_channels=3, use_mask_token=False,
    use_absolute_position_embeddings=True, layer_scale_init_value=0.1, use_mean_pooling=True)
SWITCHES = ("attention_bias", "use_qk_norm", "use_mask_token",
            "use_absolute_position_embeddings", "use_mean_pooling")
NORM_TYPES = {"layer_norm": "layernorm", "rms_norm": "rmsnorm"}
# What an InternViT tower fixes, in EncoderConfig fields; `write` refuses anything else.
INTERNVL_ARCHITECTURE = dict(class_token=True, num_register_tokens=0, pre_norm=False,
                             patch_bias=True, mlp="mlp", mlp_norm=False, patch_norm=False,
                             hybrid_layers=None, rope_theta=None, temporal_patch_size=None,
                             window_size=None)
# GotOcr2ImageProcessor's: a resize straight to {height, width}, bicubic, ImageNet mean/std.
GOT_OCR2_IMAGE_PROCESSOR = ImageProcessorClass("GotOcr2ImageProcessor", resample=3)
IGNORED = (r"embeddings\.mask_token$",)

_LAYER = "encoder.layer.{}."
_BLOCK = "blocks.{}."
KEY_MAP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
    _LAYER + "lambda_1": _BLOCK + "ls1.gamma",
    _LAYER + "lambda_2": _BLOCK + "ls2.gamma",
    **{_LAYER + f"{theirs}.{kind}": _BLOCK + f"{ours}.{kind}"
       for theirs, ours in (("layernorm_before", "norm1"), ("layernorm_after", "norm2"),
                            ("attention.q_proj", "attn.q"), ("attention.k_proj", "attn.k"),
                            ("attention.v_proj", "attn.v"),
                            ("attention.projection_layer", "attn.proj"),
                            ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"))
       for kind in ("weight", "bias")},
}


def hf_settings(config: dict[str, Any], source: object) -> dict[str, Any]:
    """The config with transformers' defaults filled in, checked for what our encoder cannot
    hold exactly.

    Raises:
        ValueError: naming `source` and the key, for a switch that is not true or false,
            `use_qk_norm` (InternViT-6B's q/k RMSNorm), an unknown `norm_type`, rms_norm with
            the final LayerNorm, non-square patches, or a non-square image with a table.
    """
    hf = {**HF_DEFAULTS, **config}
    for key in SWITCHES:
        if not isinstance(hf[key], bool):
            raise ValueError(f"{source}: {key} must be true or false, got {hf[key]!r}")
    if hf["use_qk_norm"]:
        raise ValueError(f"{source}: use_qk_norm true (InternViT-6B's RMSNorm of q and k over "
                         "the whole width) has no vlm-vit equivalent: our block has no q/k norm")
    if not isinstance(hf["norm_type"], str) or hf["norm_type"] not in NORM_TYPES:
        raise ValueError(f"{source}: norm_type {hf['norm_type']!r} is not one of "
                         f"{', '.join(NORM_TYPES)}")
    if hf["norm_type"] == "rms_norm" and not hf["use_mean_pooling"]:
        raise ValueError(f"{source}: norm_type 'rms_norm' with use_mean_pooling false ends in a "
                         "LayerNorm after RMSNorm blocks; vlm-vit's norm is one kind throughout")
    for key in ("patch_size", "image_size"):
        value = hf[key]
        if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
            hf[key] = value[0]
        elif isinstance(value, (list, tuple)) and (
                key == "patch_size" or hf["use_absolute_position_embeddings"]):
            raise ValueError(f"{source}: {key} {list(value)!r} is not square; "
                             + ("vlm-vit's patches are" if key == "patch_size" else
                                "transformers resizes InternVL's position table as a square"))
    return hf


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from an InternVLVisionConfig dict (`hf_settings`).

    Raises:
        ValueError: for settings vlm-vit refuses (sizes out of range, heads that do not
            divide the width, an unknown activation), naming `source`.
    """
    return hf_encoder_config(
        hf, source, qkv_bias=hf["attention_bias"], norm=NORM_TYPES[hf["norm_type"]],
        final_norm=not hf["use_mean_pooling"], layer_scale_init=hf["layer_scale_init_value"],
        pos_embed="learned" if hf["use_absolute_position_embeddings"] else "none",
        # InternVLVisionEmbeddings.interpolate_pos_encoding: bicubic, no antialias
        pos_resize_mode="bicubic", pos_resize_antialias=False,
        **{k: v for k, v in INTERNVL_ARCHITECTURE.items() if v is not None})


def image_processor(settings: dict[str, Any] | None, image_size: tuple[int, int],
                    source: object) -> tuple[ImageProcessor, list[str]]:
    """The ImageProcessor of a `preprocessor_config.json`; without one, GotOcr2's (squash
    resize, bicubic, ImageNet mean and std) at the model's image size. Its tiling into
    448-pixel crops (`crop_to_patches`) is the VLM's, not the tower's, and is not read."""
    return squash_processor(settings, image_size, source, resample="bicubic",
                            family="GotOcr2's", processor_class=GOT_OCR2_IMAGE_PROCESSOR)


class HfInternVLFormat:
    """`InternVLVisionModel` saved by `save_pretrained`."""

    name = "hf_internvl"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.config is not None and checkpoint.config.get("model_type") == MODEL_TYPE

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE
        hf = hf_settings(checkpoint.config, source)
        config = encoder_config(hf, source)
        tensors = dict(checkpoint.tensors)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        state = rename(tensors, KEY_MAP, config.depth, ignore=IGNORED, source=checkpoint.path)
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path)
        processor, rules = image_processor(checkpoint.files.get(PREPROCESSOR_NAME),
                                           config.image_size, checkpoint.path)
        if config.pos_embed == "learned":
            rules.append(f"positions: a learned {config.grid[0]}x{config.grid[1]} table, resized "
                         "bicubically without antialias as interpolate_pos_encoding")
        pooling = "mean" if hf["use_mean_pooling"] else "cls"
        rules.append(f"pooler {pooling!r}: InternVLVisionModel computes no pooler_output; its "
                     f"config documents the {pooling} of the final tokens")
        return Converted(config=config, state=state,
                         pooler=NativePooler(pooling, config.width, None, {}, {}),
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE)

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `InternVLVisionModel.from_pretrained` reads: config.json, the
        weights and, given a processor, a CLIPImageProcessor preprocessor_config.json.

        Raises:
            ValueError: naming every field InternVL's tower cannot hold
                (`INTERNVL_ARCHITECTURE`, sin-cos positions, a non-square image with a table,
                RMSNorm with a final norm), or a pooler with weights; nothing is written then.
        """
        hf = internvl_config(encoder)
        parameter_free(pooler, "InternVL")
        tensors = internvl_tensors(encoder)
        settings = None
        if processor is not None:
            from vlm_vit.convert.hf_clip import preprocessor_config

            settings = preprocessor_config(processor)
        if encoder.config.pos_resize_antialias or encoder.config.pos_resize_mode != "bicubic":
            logger.info("InternVLVisionModel resizes its position table bicubically without "
                        "antialias; this encoder's other grids differ")
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


def internvl_config(encoder: nn.Module) -> dict[str, Any]:
    """The `config.json` of an InternVLVisionModel holding `encoder`.

    Raises:
        ValueError: naming every field InternVL's tower cannot hold.
    """
    config = encoder.config
    problems = mismatches(config, INTERNVL_ARCHITECTURE, "InternVL")
    if config.pos_embed == "sincos":
        problems.append("pos_embed='sincos' (InternVL needs 'learned' or 'none')")
    if config.pos_embed == "learned" and config.image_size[0] != config.image_size[1]:
        problems.append(f"image_size={config.image_size} (InternVL resizes its table as a "
                        "square)")
    if config.final_norm and config.norm != "layernorm":
        problems.append(f"final_norm=True with norm={config.norm!r} (InternVL's final norm is a "
                        "LayerNorm)")
    refuse(problems, "InternVL")
    height, width = config.image_size
    return {
        "architectures": ["InternVLVisionModel"], "model_type": MODEL_TYPE,
        "hidden_size": config.width, "intermediate_size": config.mlp_width,
        "num_hidden_layers": config.depth, "num_attention_heads": config.heads,
        "attention_bias": config.qkv_bias, "use_qk_norm": False,
        "hidden_act": HF_ACTIVATIONS[config.act],
        "norm_type": {ours: theirs for theirs, ours in NORM_TYPES.items()}[config.norm],
        "layer_norm_eps": config.norm_eps, "image_size": [height, width],
        "patch_size": [config.patch_size, config.patch_size], "num_channels": config.in_channels,
        "use_mask_token": False,
        "use_absolute_position_embeddings": config.pos_embed == "learned",
        "layer_scale_init_value": config.layer_scale_init or 1.0,
        "use_mean_pooling": not config.final_norm,
        "hidden_dropout_prob": 0.0, "attention_dropout": 0.0, "projection_dropout": 0.0,
        "initializer_range": 0.02,
        "dtype": str(encoder.cls_token.dtype).removeprefix("torch."),
    }


def internvl_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under the names `save_pretrained` writes (a pure function):
    LayerScale of one where the encoder has none."""
    config = encoder.config
    state = detached(encoder)
    split_qkv(state, config.depth)
    for i in range(config.depth):
        for name in (f"blocks.{i}.ls1.gamma", f"blocks.{i}.ls2.gamma"):
            state.setdefault(name, state["cls_token"].new_ones(config.width))
    return rename(state, invert(KEY_MAP), config.depth, source="the encoder")


register_format(HfInternVLFormat())
