"""Hugging Face `Glm4vVisionModel` directories (model_type "glm4v_vision"; the vision tower of
GLM-4.1V-Thinking, GLM-V team 2025), and the tower inside a saved `Glm4vModel` /
`Glm4vForConditionalGeneration` (model_type "glm4v", its `vision_config`, the weights under
`visual.` or `model.visual.`; the language model's are left alone).

The tower is Qwen2.5-VL's block (`hf_qwen2_5_vl`: RMSNorm, fused `attn.qkv`, SwiGLU with
`gate_proj`, `up_proj`, `down_proj` -> `fc1_g`, `fc1_x`, `fc2`; 2D RoPE with shared row/column
frequencies; Conv3d patches over `temporal_patch_size` frames) without window attention, with:

* eps `rms_norm_eps`, `attn.qkv`'s bias only with `attention_bias`, no bias in `attn.proj` or
  the MLP, whose width is `out_hidden_size` (not `intermediate_size`, the merger's);
* a bias in the Conv3d and an RMSNorm over each patch embedding (`post_conv_layernorm`, our
  `patch_norm`);
* a learned square table of (image_size / patch_size)^2 entries added before the blocks as
  well as RoPE, read for each image's grid by `grid_sample` bicubically at the patch centres:
  our `pos_resize_mode="bicubic_grid_sample"` (`layers.pos_resize_sampled`);
* a final RMSNorm (`post_layernorm`, our `norm`);
* `downsample` (a Conv2d over each 2x2 window) and `merger` (Linear, LayerNorm, GELU,
  SwiGLU to `intermediate_size` and back): the `conv_merger` pooler.

Our tokens stay row-major: every hidden state is transformers' permuted by
`layers.rope_2d.merge_window_order` (their token i is our token order[i]); the pooler's
windows come out in their order.

What the file fixes, recorded in `Converted.rules`:

* zero biases where our block has one and GLM-4V none (`attn.proj`, the MLP): the same
  function;
* `image_size` is the table's side in patches times the patch (336 pixels in the released
  tower); the processor is `Glm4vImageProcessor`'s (patch x merge multiples, CLIP's mean
  and std, its pixel bounds counted over the two frames an image is repeated to, so halved
  here).

`write` goes the other way: a `Glm4vVisionModel` directory with the `conv_merger` pooler as
its downsample and merger (required).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import LIMITS, ConfigError, EncoderConfig, check_int, is_int
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_aimv2 import nonzero, zero_absent_biases
from vlm_vit.convert.hf_common import activation
from vlm_vit.convert.hf_pixtral import rope_theta
from vlm_vit.convert.hf_qwen2_vl import (
    BLOCK_PATTERN,
    QWEN_ARCHITECTURE,
    merge_size,
    qwen_problems,
    strip_prefix,
)
from vlm_vit.convert.hf_qwen3_vl import with_table_batch
from vlm_vit.convert.hf_writing import (
    detached,
    native_resolution_preprocessor,
    refuse,
    write_hf_directory,
)
from vlm_vit.convert.keymap import invert, rename
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import NORMALIZATION, ImageProcessor

MODEL_TYPES = ("glm4v_vision",)
FULL_MODEL_TYPES = ("glm4v",)  # Glm4vModel, Glm4vForConditionalGeneration
CONFIG_FILE = "config.json"
# Glm4vImageProcessor's size bounds, over an image repeated to `temporal_patch_size` frames.
MIN_PIXELS, MAX_PIXELS = 112 * 112, 28 * 28 * 15_000

# transformers' Glm4vVisionConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    depth=24, hidden_size=1536, hidden_act="silu", attention_bias=False, num_heads=12,
    in_channels=3, image_size=336, patch_size=14, rms_norm_eps=1e-5, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=4096, intermediate_size=13696,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
)
# Our EncoderConfig fields -> the config.json keys they are read from (named in refusals).
HF_FIELDS = {"width": "hidden_size", "depth": "depth", "heads": "num_heads",
             "mlp_width": "out_hidden_size", "in_channels": "in_channels",
             "patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "norm_eps": "rms_norm_eps", "qkv_bias": "attention_bias", "image_size": "image_size",
             "act": "hidden_act"}

_BLOCK = "blocks.{}."
KEY_MAP = {
    "patch_embed.proj.weight": "patch_embed.proj.weight",
    "patch_embed.proj.bias": "patch_embed.proj.bias",
    "post_conv_layernorm.weight": "patch_embed.norm.weight",
    "embeddings.position_embedding.weight": "pos_embed",  # [N, D] there, [1, N, D] here
    "post_layernorm.weight": "norm.weight",
    _BLOCK + "norm1.weight": _BLOCK + "norm1.weight",
    _BLOCK + "norm2.weight": _BLOCK + "norm2.weight",
    _BLOCK + "attn.qkv.weight": _BLOCK + "attn.qkv.weight",
    _BLOCK + "attn.qkv.bias": _BLOCK + "attn.qkv.bias",
    _BLOCK + "attn.proj.weight": _BLOCK + "attn.proj.weight",
    _BLOCK + "mlp.gate_proj.weight": _BLOCK + "mlp.fc1_g.weight",
    _BLOCK + "mlp.up_proj.weight": _BLOCK + "mlp.fc1_x.weight",
    _BLOCK + "mlp.down_proj.weight": _BLOCK + "mlp.fc2.weight",
}
# The biases our block holds and GLM-4V's has not (`hf_aimv2.zero_absent_biases` adds them).
ABSENT_BIASES = ["attn.proj.bias", "mlp.fc1_g.bias", "mlp.fc1_x.bias", "mlp.fc2.bias"]
MERGER, DOWNSAMPLE = "merger.", "downsample."  # the conv_merger pooler's names, unprefixed


def vision_config(config: dict[str, Any]) -> dict[str, Any]:
    """The tower's config, with transformers' defaults: the file itself, or a multimodal
    model's `vision_config`."""
    if config.get("model_type") in FULL_MODEL_TYPES:
        config = config.get("vision_config") or {}
    return {**HF_DEFAULTS, **config}


def table_side(hf: dict[str, Any], source: object = CONFIG_FILE) -> int:
    """The position table's side in patches, `image_size // patch_size` as transformers counts
    it.

    Raises:
        ConfigError: naming `source` and `image_size`, for anything but an int of at least
            one patch (transformers cannot read a (height, width) pair here either).
    """
    size, patch = hf["image_size"], hf["patch_size"]
    if not (is_int(size) and is_int(patch) and 0 < patch <= size <= LIMITS["image_size"][1]):
        raise ConfigError("image_size", size, f"an int of at least one patch ({patch!r}) and "
                          f"at most {LIMITS['image_size'][1]}", source=source)
    return int(size) // int(patch)


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a Glm4vVisionConfig dict (its defaults filled in).

    Raises:
        ValueError: for settings vlm-vit refuses, naming `source` and the key: an
            `intermediate_size` out of the pooler's bounds, a `head_dim` other than
            hidden_size / num_heads (the attention splits by the latter, RoPE by the former),
            an activation other than SiLU (the gate of both SwiGLUs), any `EncoderConfig`
            refusal.
    """
    hf = {**HF_DEFAULTS, **hf}
    merge_size(hf, source)
    try:
        check_int("intermediate_size", hf["intermediate_size"], *LIMITS["mlp_width"])
    except ConfigError as error:
        raise error.located(source) from None
    width, heads = hf["hidden_size"], hf["num_heads"]
    if is_int(width) and is_int(heads) and heads > 0 and \
            hf.get("head_dim") not in (None, width // heads):
        raise ValueError(f"{source}: head_dim {hf['head_dim']!r} is not hidden_size {width} / "
                         f"num_heads {heads}; GLM-4V's attention and RoPE would disagree")
    patch = hf["patch_size"]
    side = table_side(hf, source) if is_int(patch) else None
    try:
        return EncoderConfig(
            **{ours: hf[theirs] for ours, theirs in HF_FIELDS.items()
               if ours not in ("image_size", "act")},
            image_size=patch if side is None else side * patch,
            act=activation(hf["hidden_act"], source), norm="rmsnorm", mlp="swiglu",
            class_token=False, final_norm=True, patch_bias=True, patch_norm=True,
            pos_embed="learned", pos_resize_mode="bicubic_grid_sample",
            pos_resize_antialias=False, rope_theta=rope_theta(hf, source),
            rope_frequencies="shared")
    except ConfigError as error:
        raise error.located(source, HF_FIELDS.get(error.field)) from None
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def glm4v_processor(patch_size: int, merge: int, frames: int) -> ImageProcessor:
    """GLM-4V's: native resolution, sides multiples of patch x merge (28 pixels), CLIP's mean
    and std, `Glm4vImageProcessor`'s bounds over `frames` repeats of the image."""
    mean, std = NORMALIZATION["clip"]
    return ImageProcessor(
        resize_mode="native", resample="bicubic", patch_multiple=patch_size * merge,
        min_output_pixels=-(-MIN_PIXELS // frames), max_output_pixels=MAX_PIXELS // frames,
        mean=mean, std=std)


def merger_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`downsample.*` and `merger.*` under the `conv_merger` pooler's names (`downsample.*`,
    and the merger's without its prefix)."""
    return {key.removeprefix(MERGER): tensor for key, tensor in tensors.items()
            if key.startswith((MERGER, DOWNSAMPLE))}


def check_merger_width(tensors: dict[str, torch.Tensor], hidden: int, width: int,
                       source: object = CONFIG_FILE) -> None:
    """Refuses an `intermediate_size` the merger's weights do not hold, before its pooler is
    built (the encoder's own sizes are checked against its weights by `Converted`).

    Raises:
        ValueError: naming `source`, `intermediate_size` and the shape held.
    """
    held = tensors.get(MERGER + "gate_proj.weight")
    if held is not None and tuple(held.shape) != (hidden, width):
        raise ValueError(f"{source}: intermediate_size {hidden} and out_hidden_size {width}, "
                         f"but the merger's gate_proj holds {list(held.shape)}")


class HfGlm4vVisionFormat:
    """`Glm4vVisionModel` (or a `Glm4vModel` holding one) saved by `save_pretrained`."""

    name = "hf_glm4v"

    def matches(self, checkpoint: Checkpoint) -> bool:
        config = checkpoint.config or {}
        return config.get("model_type") in MODEL_TYPES or (
            config.get("model_type") in FULL_MODEL_TYPES
            and isinstance(config.get("vision_config"), dict))

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE
        hf = vision_config(checkpoint.config)
        config = encoder_config(hf, source)
        tensors = strip_prefix(checkpoint.tensors)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        state = with_table_batch(rename(tensors, KEY_MAP, config.depth,
                                        ignore=[r"merger\.", r"downsample\."],
                                        source=checkpoint.path))
        added = zero_absent_biases(state, config)
        merge = merge_size(hf, source)
        check_merger_width(tensors, hf["intermediate_size"], config.mlp_width, source)
        pooler = NativePooler("conv_merger", config.width, config.mlp_width,
                              {"merge_size": merge, "hidden_dim": hf["intermediate_size"]},
                              merger_weights(tensors))
        side = config.grid[0]
        rules = [f"a learned {side}x{side} table (image_size {config.image_size[0]}) read "
                 "bicubically by grid_sample at each patch centre, and 2D RoPE "
                 f"(theta {config.rope_theta:g})",
                 f"zero biases for the Linears GLM-4V has without: {', '.join(added)}",
                 f"downsample and merger: conv_merger pooler, {merge}x{merge} windows to "
                 f"width {config.mlp_width}, SwiGLU width {hf['intermediate_size']}",
                 f"Conv3d patch embedding over {config.temporal_patch_size} frames; an image "
                 "is its frame repeated"]
        return Converted(config=config, state=state, pooler=pooler,
                         processor=glm4v_processor(config.patch_size, merge,
                                                   config.temporal_patch_size),
                         rules=rules, source=checkpoint.path, config_file=CONFIG_FILE)

    def hf_tensors(self, encoder: nn.Module, pooler: nn.Module | None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The tower's config.json and its tensors under transformers' names (the downsample's
        and merger's from `pooler`), as `write` writes them.

        Raises:
            ValueError: as `write`.
        """
        config = encoder.config
        problems = qwen_problems(config, WRITE_ARCHITECTURE, "GLM-4V")
        rows, cols = config.grid
        if rows != cols:
            problems.append(f"image_size={config.image_size} (GLM-4V's position table is a "
                            f"square grid, this one {rows}x{cols})")
        refuse(problems, "GLM-4V")
        state = detached(encoder)
        if held := nonzero(state, ABSENT_BIASES, config.depth):
            refuse([f"{held[0]} is not zero (GLM-4V's attention output and MLP have no "
                    "bias)"], "GLM-4V")
        state = {key: tensor for key, tensor in state.items()
                 if not key.endswith(tuple(f".{name}" for name in ABSENT_BIASES))}
        state["pos_embed"] = state["pos_embed"][0]  # [1, N, D] -> transformers' [N, D]
        merger, merge, hidden = conv_merger_tensors(pooler, config)
        hf = {
            "architectures": ["Glm4vVisionModel"], "model_type": "glm4v_vision",
            "depth": config.depth, "hidden_size": config.width, "hidden_act": "silu",
            "attention_bias": config.qkv_bias, "num_heads": config.heads,
            "in_channels": config.in_channels, "image_size": rows * config.patch_size,
            "patch_size": config.patch_size, "rms_norm_eps": config.norm_eps,
            "spatial_merge_size": merge, "temporal_patch_size": config.temporal_patch_size,
            "out_hidden_size": config.mlp_width, "intermediate_size": hidden,
            "initializer_range": 0.02,
            "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "axial"},
            "dtype": str(encoder.patch_embed.proj.weight.dtype).removeprefix("torch."),
        }
        return hf, {**rename(state, invert(KEY_MAP), config.depth, source="the encoder"),
                    **merger}

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `Glm4vVisionModel.from_pretrained` reads: config.json, the
        weights with `pooler` as the downsample and merger, and the processor as
        `Glm4vImageProcessor`'s preprocessor_config.json.

        Raises:
            ValueError: naming every field GLM-4V's tower cannot hold (`WRITE_ARCHITECTURE`,
                2D RoPE, a Conv3d patch embedding, a square table), a bias GLM-4V lacks that
                is not zero, or no `conv_merger` pooler whose width is the MLP's; nothing is
                written then.
        """
        hf, tensors = self.hf_tensors(encoder, pooler)
        settings = None if processor is None else glm4v_preprocessor(processor, hf)
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# What GLM-4V's tower fixes, in EncoderConfig fields; `write` refuses anything else (eps and
# the qkv bias are its config's).
WRITE_ARCHITECTURE = {
    **{field: value for field, value in QWEN_ARCHITECTURE.items()
       if field not in ("norm_eps", "qkv_bias")},
    "final_norm": True, "patch_bias": True, "patch_norm": True, "pos_embed": "learned",
    "pos_resize_mode": "bicubic_grid_sample", "norm": "rmsnorm", "mlp": "swiglu",
    "window_size": None}


def conv_merger_tensors(pooler: nn.Module | None, config: EncoderConfig
                        ) -> tuple[dict[str, torch.Tensor], int, int]:
    """A `conv_merger` pooler's weights under transformers' names (`downsample.*`,
    `merger.*`), its merge size and its SwiGLU width.

    Raises:
        ValueError: for no pooler, another pooler, or one whose width is not the encoder's
            MLP width (GLM-4V's `out_hidden_size` is both).
    """
    from vlm_vit.poolers.conv_merger import ConvMerger  # converters name poolers lazily

    if not isinstance(pooler, ConvMerger):
        found = "none" if pooler is None else repr(
            getattr(pooler, "pooler_spec", {}).get("name", type(pooler).__name__))
        raise ValueError("a Hugging Face GLM-4V vision tower always ends in its downsample "
                         f"and merger: write it with the conv_merger pooler, not {found}")
    if (pooler.in_dim, pooler.out_dim) != (config.width, config.mlp_width):
        refuse([f"conv_merger in_dim {pooler.in_dim} and out_dim {pooler.out_dim} (GLM-4V's "
                f"merger reads the width {config.width} and returns out_hidden_size, its MLP "
                f"width {config.mlp_width})"], "GLM-4V")
    tensors = {(name if name.startswith(DOWNSAMPLE) else MERGER + name): tensor.detach()
               for name, tensor in pooler.state_dict().items()}
    return tensors, pooler.merge_size, pooler.gate_proj.out_features


def glm4v_preprocessor(processor: ImageProcessor, hf: dict[str, Any]) -> dict[str, Any]:
    """`processor` as `Glm4vImageProcessor`'s preprocessor_config.json (its pixel bounds over
    the `temporal_patch_size` frames an image becomes)."""
    frames = hf["temporal_patch_size"]
    low = (processor.min_output_pixels or -(-MIN_PIXELS // frames)) * frames
    high = (processor.max_output_pixels or MAX_PIXELS // frames) * frames
    return native_resolution_preprocessor(
        processor, "Glm4vImageProcessor", size={"shortest_edge": low, "longest_edge": high},
        patch_size=hf["patch_size"], temporal_patch_size=frames,
        merge_size=hf["spatial_merge_size"])


register_format(HfGlm4vVisionFormat())
