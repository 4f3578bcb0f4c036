"""Hugging Face `Qwen2VisionTransformerPretrainedModel` directories (model_type
"qwen2_vl_vision"; the vision tower of Qwen2-VL, Wang et al. 2024).

The tower is the paper's pre-norm block (LayerNorm eps 1e-6, fused `attn.qkv`, `mlp.fc1` /
`fc2` with QuickGELU: our own names already) over a Conv3d patch embedding of
`temporal_patch_size` frames without bias, with 2D RoPE (Qwen2-VL's shared row/column
frequencies) and neither a position table, a class token nor a final norm. Its 2x2
`merger` (a LayerNorm per patch, four neighbours concatenated, Linear, GELU, Linear to the
LLM's width) becomes the `patch_merger` pooler.

Qwen2-VL lists an image's patches window by window (the 2x2 merge windows, row-major); ours
stay row-major and carry their own (row, col) angles, which gives each token the same
attention, and the merger gathers each window itself. So our hidden states are
transformers' permuted by `layers.rope_2d.merge_window_order`.

What the file fixes, recorded in `Converted.rules`:

* `image_size` is 16 patches a side: the tower has no native size (no position table) and
  takes any grid the merger divides;
* the processor resizes at native resolution to multiples of patch x merge (28 pixels) within
  Qwen2-VL's `smart_resize` bounds (3,136 to 1,003,520 pixels), CLIP's mean and std.

`write` goes the other way: a `Qwen2VisionTransformerPretrainedModel` directory, the
`patch_merger` pooler written as its merger (transformers' tower always has one, so writing
without it is refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig, is_int, is_real
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_common import activation
from vlm_vit.convert.hf_pixtral import rope_theta
from vlm_vit.convert.hf_writing import (
    HF_ACTIVATIONS,
    detached,
    mismatches,
    native_resolution_preprocessor,
    refuse,
    write_hf_directory,
)
from vlm_vit.convert.keymap import invert, rename
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.poolers.patch_merger import MAX_MERGE
from vlm_vit.processor import NORMALIZATION, ImageProcessor

MODEL_TYPES = ("qwen2_vl_vision",)
PREFIXES = ("visual.", "model.visual.")  # inside Qwen2VLForConditionalGeneration
CONFIG_FILE = "config.json"
NORM_EPS = 1e-6  # LayerNorm(embed_dim, eps=1e-6) in Qwen2VLVisionBlock and PatchMerger
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2VLImageProcessor's smart_resize bounds

# transformers' Qwen2VLVisionConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4,
    num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
)

_BLOCK = "blocks.{}."
KEY_MAP = {
    "patch_embed.proj.weight": "patch_embed.proj.weight",
    **{_BLOCK + f"{module}.{kind}": _BLOCK + f"{module}.{kind}"
       for module in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
       for kind in ("weight", "bias")},
}
MERGER = "merger."  # ln_q, mlp.0, mlp.2: the `patch_merger` pooler's own names
BLOCK_PATTERN = r"blocks\.(\d+)\."


def strip_prefix(tensors: dict) -> dict:
    """The vision tower's tensors, without the prefix of the model that holds it."""
    for prefix in PREFIXES:
        if any(key.startswith(prefix + "patch_embed.") for key in tensors):
            return {key.removeprefix(prefix): tensor for key, tensor in tensors.items()
                    if key.startswith(prefix)}
    return dict(tensors)


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a Qwen2VLVisionConfig dict (its defaults filled in).

    Raises:
        ValueError: for settings vlm-vit refuses, naming `source` and the key.
    """
    hf = {**HF_DEFAULTS, **hf}
    width, ratio, patch = hf["embed_dim"], hf["mlp_ratio"], hf["patch_size"]
    if not (is_real(ratio) and ratio > 0) or not isinstance(width, int):
        raise ValueError(f"{source}: mlp_ratio must be a positive number, got {ratio!r}")
    fields = dict(width=width, depth=hf["depth"], heads=hf["num_heads"],
                  mlp_width=int(width * ratio), in_channels=hf["in_channels"],
                  patch_size=patch, temporal_patch_size=hf["temporal_patch_size"])
    try:
        return EncoderConfig(
            **fields, image_size=patch * 16 if isinstance(patch, int) else patch,
            act=activation(hf["hidden_act"], source), norm_eps=NORM_EPS, class_token=False,
            final_norm=False, patch_bias=False, pos_embed="none",
            rope_theta=rope_theta(hf, source), rope_frequencies="shared")
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def merge_size(hf: dict[str, Any], source: object = CONFIG_FILE) -> int:
    """`spatial_merge_size`, the merger's window side in patches.

    Raises:
        ConfigError: naming `source` and `spatial_merge_size`, for anything but an int in
            1..`MAX_MERGE` (the `patch_merger` pooler's bound; Qwen2-VL and Qwen2.5-VL use 2).
    """
    merge = hf["spatial_merge_size"]
    if not (is_int(merge) and 1 <= merge <= MAX_MERGE):
        raise ConfigError("spatial_merge_size", merge, f"a positive int (1..{MAX_MERGE})",
                          source=source)
    return int(merge)


def merger_pooler(tensors: dict, config: EncoderConfig, merge: int, out_dim: int,
                  **options: Any) -> NativePooler:
    """The `merger.*` weights as the `patch_merger` pooler (out: the LLM's width)."""
    weights = {key.removeprefix(MERGER): tensor for key, tensor in tensors.items()
               if key.startswith(MERGER)}
    return NativePooler("patch_merger", config.width, out_dim,
                        {"merge_size": merge, **options}, weights)


def qwen_processor(patch_size: int, merge: int) -> ImageProcessor:
    """Qwen2-VL's and Qwen2.5-VL's: native resolution, sides multiples of patch x merge,
    `smart_resize`'s pixel bounds, CLIP's mean and std."""
    mean, std = NORMALIZATION["clip"]
    return ImageProcessor(
        resize_mode="native", resample="bicubic", patch_multiple=patch_size * merge,
        min_output_pixels=MIN_PIXELS, max_output_pixels=MAX_PIXELS, mean=mean, std=std)


class HfQwen2VLVisionFormat:
    """`Qwen2VisionTransformerPretrainedModel` saved by `save_pretrained`."""

    name = "hf_qwen2_vl"

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
        processor = qwen_processor(config.patch_size, merge)
        rules = [f"2D RoPE (theta {config.rope_theta:g}), no position table; image_size "
                 f"{config.image_size[0]} is nominal",
                 f"merger: patch_merger pooler, {merge}x{merge} windows to width "
                 f"{hf['hidden_size']}",
                 f"Conv3d patch embedding over {config.temporal_patch_size} frames; an image "
                 "is its frame repeated"]
        pooler = merger_pooler(tensors, config, merge, hf["hidden_size"])
        return Converted(config=config, state=state, pooler=pooler,
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE)


    def hf_tensors(self, encoder: nn.Module, pooler: nn.Module | None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The tower's config.json and its tensors under transformers' names (the merger's
        from `pooler`), as `write` writes them; a multimodal model's writer prefixes them.

        Raises:
            ValueError: as `write`.
        """
        refuse(qwen_problems(encoder.config, WRITE_ARCHITECTURE, "Qwen2-VL"), "Qwen2-VL")
        merger, merge, out_dim = merger_tensors(pooler, "layernorm", "Qwen2-VL")
        hf = qwen2_vl_config(encoder, merge, out_dim)
        return hf, {**rename(detached(encoder), invert(KEY_MAP), encoder.config.depth,
                             source="the encoder"), **merger}

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `Qwen2VisionTransformerPretrainedModel.from_pretrained` reads:
        config.json, the weights with `pooler` as the merger, and the processor as
        `Qwen2VLImageProcessor`'s preprocessor_config.json.

        Raises:
            ValueError: naming every field Qwen2-VL's tower cannot hold (`WRITE_ARCHITECTURE`,
                2D RoPE, a Conv3d patch embedding, the MLP width), or no LayerNorm
                `patch_merger` pooler; nothing is written then.
        """
        hf, tensors = self.hf_tensors(encoder, pooler)
        settings = None if processor is None else qwen_preprocessor(processor, hf)
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# -- writing ----------------------------------------------------------------------------------

# What both Qwen towers fix, in EncoderConfig fields; their writers refuse anything else.
QWEN_ARCHITECTURE = dict(rope_reference_grid=None, mlp_norm=False,
                         class_token=False, num_register_tokens=0, pre_norm=False,
                         final_norm=False, qkv_bias=True, patch_bias=False, norm_eps=NORM_EPS,
                         layer_scale_init=None, hybrid_layers=None, pos_embed="none",
                         rope_frequencies="shared", patch_norm=False, rope_positions="index")
WRITE_ARCHITECTURE = dict(QWEN_ARCHITECTURE, norm="layernorm", mlp="mlp", window_size=None)


def qwen_problems(config: EncoderConfig, architecture: dict[str, Any], family: str) -> list[str]:
    """What a Qwen tower cannot hold: `architecture`'s fields, no RoPE, a Conv2d patch."""
    problems = mismatches(config, architecture, family)
    if config.rope_theta is None:
        problems.insert(0, f"rope_theta=None ({family} needs 2D RoPE)")
    if config.temporal_patch_size is None:
        problems.insert(0, f"temporal_patch_size=None ({family} embeds patches with a Conv3d "
                           "over frames)")
    return problems


def merger_tensors(pooler: nn.Module | None, norm: str, family: str
                   ) -> tuple[dict[str, torch.Tensor], int, int]:
    """The `patch_merger` pooler's weights under the merger's names, its merge size and its
    output width.

    Raises:
        ValueError: for no pooler, another pooler, or a merger with another norm or eps.
    """
    spec = getattr(pooler, "pooler_spec", None) or {}
    if spec.get("name") != "patch_merger":
        found = "none" if pooler is None else repr(spec.get("name", type(pooler).__name__))
        raise ValueError(f"a Hugging Face {family} vision tower always ends in its merger: "
                         f"write it with the patch_merger pooler (norm {norm!r}), not {found}")
    options = {"norm": "layernorm", "eps": NORM_EPS, **spec.get("options", {})}
    if (options["norm"], options["eps"]) != (norm, NORM_EPS):
        raise ValueError(f"a Hugging Face {family} merger norms with {norm!r}, eps "
                         f"{NORM_EPS:g}; this patch_merger has norm {options['norm']!r}, eps "
                         f"{options['eps']:g}")
    tensors = {MERGER + name: tensor.detach() for name, tensor in pooler.state_dict().items()}
    return tensors, pooler.merge_size, pooler.out_dim


def mlp_ratio_for(config: EncoderConfig) -> float | None:
    """The `mlp_ratio` whose `int(embed_dim * mlp_ratio)` is the MLP width (a whole one where
    it can), or None."""
    for ratio in (*range(1, 9), config.mlp_width / config.width):
        if int(config.width * ratio) == config.mlp_width:
            return ratio
    return None


def qwen2_vl_config(encoder: nn.Module, merge: int, out_dim: int) -> dict[str, Any]:
    """The `config.json` of a `Qwen2VisionTransformerPretrainedModel` holding `encoder`.

    Raises:
        ValueError: naming every field Qwen2-VL's tower cannot hold.
    """
    config = encoder.config
    problems = qwen_problems(config, WRITE_ARCHITECTURE, "Qwen2-VL")
    ratio = mlp_ratio_for(config)
    if ratio is None:
        problems.append(f"mlp_width={config.mlp_width} (Qwen2-VL's is int(embed_dim x "
                        "mlp_ratio))")
    refuse(problems, "Qwen2-VL")
    return {
        "architectures": ["Qwen2VisionTransformerPretrainedModel"],
        "model_type": "qwen2_vl_vision", "depth": config.depth, "embed_dim": config.width,
        "hidden_size": out_dim, "hidden_act": HF_ACTIVATIONS[config.act], "mlp_ratio": ratio,
        "num_heads": config.heads, "in_channels": config.in_channels,
        "patch_size": config.patch_size, "spatial_merge_size": merge,
        "temporal_patch_size": config.temporal_patch_size, "initializer_range": 0.02,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "axial"},
        "dtype": str(encoder.patch_embed.proj.weight.dtype).removeprefix("torch."),
    }


def qwen_preprocessor(processor: ImageProcessor, hf: dict[str, Any]) -> dict[str, Any]:
    """`processor` as `Qwen2VLImageProcessor`'s preprocessor_config.json (Qwen2.5-VL's too)."""
    low = processor.min_output_pixels or MIN_PIXELS
    high = processor.max_output_pixels or MAX_PIXELS
    return native_resolution_preprocessor(
        processor, "Qwen2VLImageProcessor", size={"shortest_edge": low, "longest_edge": high},
        min_pixels=low, max_pixels=high, patch_size=hf["patch_size"],
        temporal_patch_size=hf["temporal_patch_size"], merge_size=hf["spatial_merge_size"])


register_format(HfQwen2VLVisionFormat())
