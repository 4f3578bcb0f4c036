"""Hugging Face `Qwen2_5_VisionTransformerPretrainedModel` directories (model_type
"qwen2_5_vl_vision"; the vision tower of Qwen2.5-VL, Bai et al. 2025).

Qwen2-VL's tower (`hf_qwen2_vl`: Conv3d patch embedding without bias, 2D RoPE with shared
row/column frequencies, no position table, class token or final norm, a 2x2 merger) with
RMSNorm (eps 1e-6) in place of LayerNorm, a SwiGLU MLP with biases (`gate_proj`, `up_proj`,
`down_proj` -> `fc1_g`, `fc1_x`, `fc2`), and window attention in every block but
`fullatt_block_indexes`. Its merger norms with RMSNorm: the `patch_merger` pooler with
`norm="rmsnorm"`.

Qwen2.5-VL orders an image's tokens window by window (its `window_index`: whole 2x2 merge
units, windows row-major, padding dropped) before the first block and keeps that order to
the end; ours stay row-major and each windowed block gathers its windows itself
(`layers.window_segments`), so our hidden states are transformers' permuted by
`window_partition(grid, window, merge).order`.

What the file fixes, recorded in `Converted.rules`:

* `window_size` is in pixels there (112) and in patches here: 112 // merge // patch merge
  units of `spatial_merge_size` patches, 8 patches for patch 14 and merge 2; a window that
  is not a whole number of merge units is refused (transformers would floor it);
* `image_size` is 16 patches a side, nominal as in `hf_qwen2_vl`; the processor is Qwen2-VL's.

`write` goes the other way: a `Qwen2_5_VisionTransformerPretrainedModel` directory, the
RMSNorm `patch_merger` pooler as its merger (required, as for Qwen2-VL). An encoder without
window attention is written with every block in `fullatt_block_indexes` (the same function).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig, is_int
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_common import activation
from vlm_vit.convert.hf_pixtral import rope_theta
from vlm_vit.convert.hf_qwen2_vl import (
    BLOCK_PATTERN,
    QWEN_ARCHITECTURE,
    merge_size,
    merger_pooler,
    merger_tensors,
    qwen_preprocessor,
    qwen_problems,
    qwen_processor,
    strip_prefix,
)
from vlm_vit.convert.hf_writing import HF_ACTIVATIONS, detached, refuse, write_hf_directory
from vlm_vit.convert.keymap import invert, rename
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import ImageProcessor

MODEL_TYPES = ("qwen2_5_vl_vision",)
CONFIG_FILE = "config.json"
NORM_EPS = 1e-6  # Qwen2_5_VLRMSNorm(hidden_size, eps=1e-6) in the blocks and the merger

# transformers' Qwen2_5_VLVisionConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31],
    rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
)

_BLOCK = "blocks.{}."
KEY_MAP = {
    "patch_embed.proj.weight": "patch_embed.proj.weight",
    _BLOCK + "norm1.weight": _BLOCK + "norm1.weight",
    _BLOCK + "norm2.weight": _BLOCK + "norm2.weight",
    **{_BLOCK + f"{theirs}.{kind}": _BLOCK + f"{ours}.{kind}"
       for theirs, ours in (("attn.qkv", "attn.qkv"), ("attn.proj", "attn.proj"),
                            ("mlp.gate_proj", "mlp.fc1_g"), ("mlp.up_proj", "mlp.fc1_x"),
                            ("mlp.down_proj", "mlp.fc2"))
       for kind in ("weight", "bias")},
}


def window_patches(hf: dict[str, Any], source: object = CONFIG_FILE) -> int:
    """Qwen2.5-VL's `window_size` (pixels) as our window side in patches.

    Raises:
        ConfigError: for a window that is not a positive whole number of merge units
            (patch_size x spatial_merge_size pixels).
    """
    pixels, patch, merge = hf["window_size"], hf["patch_size"], hf["spatial_merge_size"]
    unit = patch * merge if is_int(patch) and is_int(merge) else None
    if not (is_int(pixels) and unit and pixels > 0 and pixels % unit == 0):
        raise ConfigError("window_size", pixels,
                          f"a positive multiple of patch_size x spatial_merge_size = {unit} pixels",
                          source=source,
                          problem=f"window_size {pixels!r} pixels is not a positive multiple of "
                          f"patch_size {patch} x spatial_merge_size {merge}: a window must hold "
                          "whole merge units")
    return pixels // patch


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a Qwen2_5_VLVisionConfig dict (its defaults filled in).

    Raises:
        ValueError: for settings vlm-vit refuses, naming `source` and the key.
    """
    hf = {**HF_DEFAULTS, **hf}
    patch = hf["patch_size"]
    merge_size(hf, source)  # before the window, which is counted in merge units
    window = window_patches(hf, source)
    try:
        return EncoderConfig(
            width=hf["hidden_size"], depth=hf["depth"], heads=hf["num_heads"],
            mlp_width=hf["intermediate_size"], in_channels=hf["in_channels"], patch_size=patch,
            temporal_patch_size=hf["temporal_patch_size"],
            image_size=patch * max(16, window) if is_int(patch) else patch,
            act=activation(hf["hidden_act"], source), norm="rmsnorm", mlp="swiglu",
            norm_eps=NORM_EPS, class_token=False, final_norm=False, patch_bias=False,
            pos_embed="none", rope_theta=rope_theta(hf, source), rope_frequencies="shared",
            window_size=window, full_attention_blocks=tuple(hf["fullatt_block_indexes"]))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{source}: {error}") from None


class HfQwen2_5VLVisionFormat:
    """`Qwen2_5_VisionTransformerPretrainedModel` saved by `save_pretrained`."""

    name = "hf_qwen2_5_vl"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.config is not None and \
            checkpoint.config.get("model_type") in MODEL_TYPES

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        hf = {**HF_DEFAULTS, **checkpoint.config}
        config = encoder_config(hf, checkpoint.path / CONFIG_FILE)
        tensors = strip_prefix(checkpoint.tensors)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        state = rename(tensors, KEY_MAP, config.depth, ignore=[r"merger\."],
                       source=checkpoint.path)
        merge = merge_size(hf, checkpoint.path / CONFIG_FILE)
        pooler = merger_pooler(tensors, config, merge, hf["out_hidden_size"], norm="rmsnorm")
        rules = [f"window attention: {config.window_size} patches a side (window_size "
                 f"{hf['window_size']} pixels), full attention in blocks "
                 f"{list(config.full_attention_blocks)}",
                 f"2D RoPE (theta {config.rope_theta:g}), no position table; image_size "
                 f"{config.image_size[0]} is nominal",
                 f"merger: patch_merger pooler (RMSNorm), {merge}x{merge} windows to width "
                 f"{hf['out_hidden_size']}",
                 f"Conv3d patch embedding over {config.temporal_patch_size} frames; an image "
                 "is its frame repeated"]
        return Converted(config=config, state=state, pooler=pooler,
                         processor=qwen_processor(config.patch_size, merge), rules=rules,
                         source=checkpoint.path, config_file=CONFIG_FILE)


    def hf_tensors(self, encoder: nn.Module, pooler: nn.Module | None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The tower's config.json and its tensors under transformers' names (the merger's
        from `pooler`), as `write` writes them; a multimodal model's writer prefixes them.

        Raises:
            ValueError: as `write`.
        """
        refuse(qwen_problems(encoder.config, WRITE_ARCHITECTURE, "Qwen2.5-VL"), "Qwen2.5-VL")
        merger, merge, out_dim = merger_tensors(pooler, "rmsnorm", "Qwen2.5-VL")
        hf = qwen2_5_vl_config(encoder, merge, out_dim)
        return hf, {**rename(detached(encoder), invert(KEY_MAP), encoder.config.depth,
                             source="the encoder"), **merger}

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `Qwen2_5_VisionTransformerPretrainedModel.from_pretrained`
        reads: config.json, the weights with `pooler` as the merger, and the processor as
        `Qwen2VLImageProcessor`'s preprocessor_config.json.

        Raises:
            ValueError: naming every field Qwen2.5-VL's tower cannot hold
                (`WRITE_ARCHITECTURE`, 2D RoPE, a Conv3d patch embedding, a window of whole
                merge units), or no RMSNorm `patch_merger` pooler; nothing is written then.
        """
        hf, tensors = self.hf_tensors(encoder, pooler)
        settings = None if processor is None else qwen_preprocessor(processor, hf)
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# What Qwen2.5-VL's tower fixes, in EncoderConfig fields; `write` refuses anything else.
WRITE_ARCHITECTURE = dict(QWEN_ARCHITECTURE, norm="rmsnorm", mlp="swiglu")


def qwen2_5_vl_config(encoder: nn.Module, merge: int, out_dim: int) -> dict[str, Any]:
    """The `config.json` of a `Qwen2_5_VisionTransformerPretrainedModel` holding `encoder`.

    Raises:
        ValueError: naming every field Qwen2.5-VL's tower cannot hold.
    """
    config = encoder.config
    problems = qwen_problems(config, WRITE_ARCHITECTURE, "Qwen2.5-VL")
    window, full = config.window_size, list(config.full_attention_blocks)
    if window is None:  # every block global
        window, full = merge, list(range(config.depth))
    elif window % merge:
        problems.append(f"window_size={window} (Qwen2.5-VL's windows are whole "
                        f"{merge}x{merge} merge units)")
    refuse(problems, "Qwen2.5-VL")
    return {
        "architectures": ["Qwen2_5_VisionTransformerPretrainedModel"],
        "model_type": "qwen2_5_vl_vision", "depth": config.depth,
        "hidden_size": config.width, "intermediate_size": config.mlp_width,
        "out_hidden_size": out_dim, "hidden_act": HF_ACTIVATIONS[config.act],
        "num_heads": config.heads, "in_channels": config.in_channels,
        "patch_size": config.patch_size, "spatial_merge_size": merge,
        "temporal_patch_size": config.temporal_patch_size,
        "window_size": window * config.patch_size, "fullatt_block_indexes": full,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "axial"},
        "dtype": str(encoder.patch_embed.proj.weight.dtype).removeprefix("torch."),
    }


register_format(HfQwen2_5VLVisionFormat())
