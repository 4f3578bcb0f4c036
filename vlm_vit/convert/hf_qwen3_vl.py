"""Hugging Face `Qwen3VLVisionModel` directories (model_type "qwen3_vl_vision"; the vision
tower of Qwen3-VL, Qwen team 2025), and the tower inside a saved `Qwen3VLModel` /
`Qwen3VLForConditionalGeneration` (model_type "qwen3_vl", its `vision_config`, the weights
under `model.visual.`; the language model's are left alone).

Qwen2-VL's tower (`hf_qwen2_vl`: pre-norm LayerNorm blocks, eps 1e-6, fused `attn.qkv`, 2D
RoPE with shared row/column frequencies, Conv3d patches over `temporal_patch_size` frames, a
2x2 merger, merge-window token order) with:

* a bias in the Conv3d patch embedding;
* a learned square table of `num_position_embeddings` entries (`pos_embed.weight`, 48 x 48 in
  the released towers) added before the blocks as well as RoPE, resized to each image's grid
  bilinearly with the corners aligned: our `pos_resize_mode="bilinear_corners"`
  (`layers.pos_resize_corners`), without antialias;
* the MLP's `linear_fc1` / `linear_fc2` (ours `mlp.fc1` / `fc2`) with `hidden_act` (tanh GELU
  in the released towers);
* the merger's `norm` / `linear_fc1` / `linear_fc2`: the `patch_merger` pooler's `ln_q`,
  `mlp.0`, `mlp.2` (a LayerNorm per patch before the 2x2 windows are concatenated);
* DeepStack (`deepstack_visual_indexes`): after those blocks, further mergers whose LayerNorm
  acts on the concatenated window (`use_postshuffle_norm=True`) feed the language model's
  early layers. The encoder does not run them; `deepstack_taps` gives each as (the hidden
  state it reads, a `patch_merger` pooler with `merged_norm=True` holding its weights).

Our tokens stay row-major: every hidden state is transformers' permuted by
`layers.rope_2d.merge_window_order` (their token i is our token order[i]).

What the file fixes, recorded in `Converted.rules`: `image_size` is the table's side in
patches (48 x 16 = 768 pixels), and the processor is Qwen3-VL's (`Qwen2VLImageProcessor`
with patch 16 x merge 2, 65,536 to 16,777,216 pixels, mean and std 0.5).

`write` goes the other way: a `Qwen3VLVisionModel` directory with the `patch_merger` pooler
as its merger (required) and, given `deepstack=`, the DeepStack mergers.
"""

from __future__ import annotations

from math import isqrt
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig, is_int
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
from vlm_vit.convert.hf_qwen2_vl import (
    BLOCK_PATTERN,
    NORM_EPS,
    QWEN_ARCHITECTURE,
    merge_size,
    merger_tensors,
    qwen_preprocessor,
    qwen_problems,
    strip_prefix,
)
from vlm_vit.convert.hf_writing import HF_ACTIVATIONS, detached, refuse, write_hf_directory
from vlm_vit.convert.keymap import invert, rename
from vlm_vit.io.native import check_state_dict
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import NORMALIZATION, ImageProcessor

MODEL_TYPES = ("qwen3_vl_vision",)
FULL_MODEL_TYPES = ("qwen3_vl",)  # Qwen3VLModel, Qwen3VLForConditionalGeneration
CONFIG_FILE = "config.json"
MIN_PIXELS, MAX_PIXELS = 65_536, 16_777_216  # Qwen3-VL's preprocessor_config.json size bounds

# transformers' Qwen3VLVisionConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
    num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
    out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
    rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
)
# Our EncoderConfig fields -> the config.json keys they are read from (named in refusals).
HF_FIELDS = {"width": "hidden_size", "depth": "depth", "heads": "num_heads",
             "mlp_width": "intermediate_size", "in_channels": "in_channels",
             "patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "image_size": "num_position_embeddings", "act": "hidden_act"}

_BLOCK = "blocks.{}."
KEY_MAP = {
    "patch_embed.proj.weight": "patch_embed.proj.weight",
    "patch_embed.proj.bias": "patch_embed.proj.bias",
    "pos_embed.weight": "pos_embed",  # [N, D] there, [1, N, D] here (`with_table_batch`)
    **{_BLOCK + f"{theirs}.{kind}": _BLOCK + f"{ours}.{kind}"
       for theirs, ours in (("norm1", "norm1"), ("norm2", "norm2"), ("attn.qkv", "attn.qkv"),
                            ("attn.proj", "attn.proj"), ("mlp.linear_fc1", "mlp.fc1"),
                            ("mlp.linear_fc2", "mlp.fc2"))
       for kind in ("weight", "bias")},
}
# A merger's names -> the `patch_merger` pooler's.
MERGER_MAP = {f"{theirs}.{kind}": f"{ours}.{kind}"
              for theirs, ours in (("norm", "ln_q"), ("linear_fc1", "mlp.0"),
                                   ("linear_fc2", "mlp.2"))
              for kind in ("weight", "bias")}
MERGER, DEEPSTACK = "merger.", "deepstack_merger_list.{}."


def vision_config(config: dict[str, Any]) -> dict[str, Any]:
    """The tower's config, with transformers' defaults: the file itself, or a multimodal
    model's `vision_config`."""
    if config.get("model_type") in FULL_MODEL_TYPES:
        config = config.get("vision_config") or {}
    return {**HF_DEFAULTS, **config}


def table_side(hf: dict[str, Any], source: object = CONFIG_FILE) -> int:
    """The position table's side: `num_position_embeddings` must be a square.

    Raises:
        ConfigError: naming `source` and `num_position_embeddings`, for anything else
            (transformers would read the floor of its square root and ignore the rest).
    """
    entries = hf["num_position_embeddings"]
    if not (is_int(entries) and entries > 0 and isqrt(entries) ** 2 == entries):
        raise ConfigError("num_position_embeddings", entries, "a positive square int (the "
                          "table is a square grid)", source=source)
    return isqrt(entries)


def deepstack_layers(hf: dict[str, Any], source: object = CONFIG_FILE) -> list[int]:
    """`deepstack_visual_indexes` (block indices from 0), checked.

    Raises:
        ConfigError: naming `source` and `deepstack_visual_indexes`, for anything but
            distinct block indices.
    """
    indexes, depth = hf["deepstack_visual_indexes"], hf["depth"]
    if not (isinstance(indexes, (list, tuple)) and is_int(depth)
            and all(is_int(i) and 0 <= i < depth for i in indexes)
            and len(set(indexes)) == len(indexes)):
        raise ConfigError("deepstack_visual_indexes", indexes,
                          f"distinct block indices in 0..depth-1 (depth {depth!r})",
                          source=source)
    return [int(i) for i in indexes]


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a Qwen3VLVisionConfig dict (its defaults filled in).

    Raises:
        ValueError: for settings vlm-vit refuses, naming `source` and the key.
    """
    hf = {**HF_DEFAULTS, **hf}
    merge_size(hf, source)
    side, patch = table_side(hf, source), hf["patch_size"]
    deepstack_layers(hf, source)
    try:
        return EncoderConfig(
            **{ours: hf[theirs] for ours, theirs in HF_FIELDS.items()
               if ours not in ("image_size", "act")},
            image_size=side * patch if is_int(patch) else patch,
            act=activation(hf["hidden_act"], source), norm_eps=NORM_EPS, class_token=False,
            final_norm=False, patch_bias=True, pos_embed="learned",
            pos_resize_mode="bilinear_corners", pos_resize_antialias=False,
            rope_theta=rope_theta(hf, source), rope_frequencies="shared")
    except ConfigError as error:
        raise error.located(source, HF_FIELDS.get(error.field)) from None
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def qwen3_processor(patch_size: int, merge: int) -> ImageProcessor:
    """Qwen3-VL's: native resolution, sides multiples of patch x merge (32 pixels), 65,536 to
    16,777,216 pixels, mean and std 0.5."""
    mean, std = NORMALIZATION["inception"]
    return ImageProcessor(
        resize_mode="native", resample="bicubic", patch_multiple=patch_size * merge,
        min_output_pixels=MIN_PIXELS, max_output_pixels=MAX_PIXELS, mean=mean, std=std)


def merger_weights(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A merger's tensors under the `patch_merger` pooler's names (`ln_q`, `mlp.0`, `mlp.2`);
    a tensor the pooler lacks keeps its name, for the strict load to list."""
    return {MERGER_MAP.get(key.removeprefix(prefix), key.removeprefix(prefix)): tensor
            for key, tensor in tensors.items() if key.startswith(prefix)}


def with_table_batch(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' `nn.Embedding` table `[N, D]` as our `pos_embed` `[1, N, D]`."""
    table = state.get("pos_embed")
    if isinstance(table, torch.Tensor) and table.ndim == 2:
        state["pos_embed"] = table[None]
    return state


class HfQwen3VLVisionFormat:
    """`Qwen3VLVisionModel` (or a `Qwen3VLModel` holding one) saved by `save_pretrained`."""

    name = "hf_qwen3_vl"

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
                                        ignore=[r"merger\.", r"deepstack_merger_list\."],
                                        source=checkpoint.path))
        merge, side = merge_size(hf, source), table_side(hf, source)
        pooler = NativePooler("patch_merger", config.width, hf["out_hidden_size"],
                              {"merge_size": merge}, merger_weights(tensors, MERGER))
        rules = [f"a learned {side}x{side} table (image_size {config.image_size[0]}) resized "
                 "bilinearly with the corners aligned, and 2D RoPE "
                 f"(theta {config.rope_theta:g})",
                 f"merger: patch_merger pooler, {merge}x{merge} windows to width "
                 f"{hf['out_hidden_size']}",
                 f"DeepStack mergers after blocks {deepstack_layers(hf, source)} are not run "
                 "by the encoder (hf_qwen3_vl.deepstack_taps)",
                 f"Conv3d patch embedding over {config.temporal_patch_size} frames; an image "
                 "is its frame repeated"]
        return Converted(config=config, state=state, pooler=pooler,
                         processor=qwen3_processor(config.patch_size, merge), rules=rules,
                         source=checkpoint.path, config_file=CONFIG_FILE)

    def hf_tensors(self, encoder: nn.Module, pooler: nn.Module | None,
                   deepstack: dict[str, tuple[int, nn.Module]] | None = None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The tower's config.json and its tensors under transformers' names (the merger's
        from `pooler`, the DeepStack mergers' from `deepstack`), as `write` writes them.

        Raises:
            ValueError: as `write`.
        """
        refuse(qwen_problems(encoder.config, WRITE_ARCHITECTURE, "Qwen3-VL"), "Qwen3-VL")
        merger, merge, out_dim = qwen3_merger_tensors(pooler, MERGER, merged=False)
        layers, stacked = [], {}
        for index, (name, (layer, tap)) in enumerate(sorted((deepstack or {}).items(),
                                                            key=lambda item: item[1][0])):
            tensors, tap_merge, tap_out = qwen3_merger_tensors(
                tap, DEEPSTACK.format(index), merged=True, what=f"DeepStack tap {name!r}")
            if (tap_merge, tap_out) != (merge, out_dim) or not 1 <= layer <= encoder.config.depth:
                raise ValueError(f"DeepStack tap {name!r}: Qwen3-VL's taps read a block's "
                                 f"output (hidden state 1..{encoder.config.depth}, got {layer}) "
                                 f"with the merger's merge size {merge} and width {out_dim} "
                                 f"(got {tap_merge}, {tap_out})")
            layers.append(layer - 1)
            stacked.update(tensors)
        if len(set(layers)) != len(layers):
            raise ValueError(f"DeepStack taps read the same hidden state twice: {layers}")
        hf = qwen3_vl_config(encoder, merge, out_dim, layers)
        state = detached(encoder)
        state["pos_embed"] = state["pos_embed"][0]  # [1, N, D] -> transformers' [N, D]
        return hf, {**rename(state, invert(KEY_MAP), encoder.config.depth,
                             source="the encoder"), **merger, **stacked}

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              deepstack: dict[str, tuple[int, nn.Module]] | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `Qwen3VLVisionModel.from_pretrained` reads: config.json, the
        weights with `pooler` as the merger and `deepstack` (`deepstack_taps`' form) as the
        DeepStack mergers, and the processor as `Qwen2VLImageProcessor`'s
        preprocessor_config.json.

        Raises:
            ValueError: naming every field Qwen3-VL's tower cannot hold (`WRITE_ARCHITECTURE`,
                a square table, 2D RoPE, a Conv3d patch embedding), or no LayerNorm
                `patch_merger` pooler, or a DeepStack tap that is not a `merged_norm` one of
                the same merge size and width; nothing is written then.
        """
        hf, tensors = self.hf_tensors(encoder, pooler, deepstack)
        settings = None if processor is None else qwen_preprocessor(processor, hf)
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# What Qwen3-VL's tower fixes, in EncoderConfig fields; `write` refuses anything else.
WRITE_ARCHITECTURE = dict(QWEN_ARCHITECTURE, norm="layernorm", mlp="mlp", window_size=None,
                          patch_bias=True, pos_embed="learned",
                          pos_resize_mode="bilinear_corners", pos_resize_antialias=False)


def qwen3_merger_tensors(pooler: nn.Module | None, prefix: str, *, merged: bool,
                         what: str = "the merger") -> tuple[dict[str, torch.Tensor], int, int]:
    """A `patch_merger` pooler's weights under a Qwen3-VL merger's names (`prefix` + `norm`,
    `linear_fc1`, `linear_fc2`), its merge size and its output width.

    Raises:
        ValueError: for no pooler, another pooler, another norm or eps, or the norm in the
            other place (`merged`: after the window is concatenated, DeepStack's).
    """
    tensors, merge, out_dim = merger_tensors(pooler, "layernorm", "Qwen3-VL")
    options = pooler.pooler_spec.get("options", {})
    held = bool(options.get("merged_norm", False))
    if held != merged:
        where = "the concatenated window" if merged else "each patch"
        raise ValueError(f"{what}: Qwen3-VL norms {where} (patch_merger merged_norm="
                         f"{merged}), this one has merged_norm={held}")
    ours = invert(MERGER_MAP)
    return ({prefix + ours[key.removeprefix(MERGER)]: tensor for key, tensor in tensors.items()},
            merge, out_dim)


def qwen3_vl_config(encoder: nn.Module, merge: int, out_dim: int,
                    deepstack: list[int]) -> dict[str, Any]:
    """The `config.json` of a `Qwen3VLVisionModel` holding `encoder`.

    Raises:
        ValueError: naming every field Qwen3-VL's tower cannot hold.
    """
    config = encoder.config
    problems = qwen_problems(config, WRITE_ARCHITECTURE, "Qwen3-VL")
    rows, cols = config.grid
    if rows != cols:
        problems.append(f"image_size={config.image_size} (Qwen3-VL's position table is a "
                        f"square grid, this one {rows}x{cols})")
    refuse(problems, "Qwen3-VL")
    return {
        "architectures": ["Qwen3VLVisionModel"],
        "model_type": "qwen3_vl_vision", "depth": config.depth,
        "hidden_size": config.width, "intermediate_size": config.mlp_width,
        "out_hidden_size": out_dim, "hidden_act": HF_ACTIVATIONS[config.act],
        "num_heads": config.heads, "in_channels": config.in_channels,
        "patch_size": config.patch_size, "spatial_merge_size": merge,
        "temporal_patch_size": config.temporal_patch_size,
        "num_position_embeddings": rows * cols, "deepstack_visual_indexes": deepstack,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "axial"},
        "dtype": str(encoder.patch_embed.proj.weight.dtype).removeprefix("torch."),
    }


def deepstack_taps(checkpoint: Checkpoint) -> dict[str, tuple[int, nn.Module]]:
    """Qwen3-VL's DeepStack mergers, each as the hidden state it reads and a pooler.

    transformers runs `deepstack_merger_list.k` on block `deepstack_visual_indexes[k]`'s
    output, which is our hidden state `deepstack_visual_indexes[k] + 1` (0 is the
    embeddings); the merger is a `patch_merger` pooler with `merged_norm=True` (the norm on
    each concatenated 2x2 window, transformers' `use_postshuffle_norm=True`).

    Args:
        checkpoint: a Qwen3-VL checkpoint (`vlm_vit.io.loading.read_checkpoint(path)`).

    Returns:
        `{"deepstack_k": (hidden-state index, pooler)}`, a `vlm_vit.taps.TappedTower`'s
        taps, in transformers' order; each pooler maps `[B, N, D]` row-major tokens to
        `[B, N / 4, out_hidden_size]` as the merger does.

    Raises:
        ValueError: for a checkpoint that is not Qwen3-VL's, a config refused as in
            `to_native`, or merger weights that do not fit the pooler (strict load).
    """
    from vlm_vit.poolers import build_pooler

    if not FORMAT.matches(checkpoint):
        raise ValueError(f"{checkpoint.path} is not a Qwen3-VL checkpoint (model_type "
                         f"{(checkpoint.config or {}).get('model_type')!r})")
    source = checkpoint.path / CONFIG_FILE
    hf = vision_config(checkpoint.config)
    config, tensors = encoder_config(hf, source), strip_prefix(checkpoint.tensors)
    taps = {}
    for k, block in enumerate(deepstack_layers(hf, source)):
        pooler = build_pooler("patch_merger", in_dim=config.width, out_dim=hf["out_hidden_size"],
                              merge_size=merge_size(hf, source), merged_norm=True)
        check_state_dict(pooler, merger_weights(tensors, DEEPSTACK.format(k)),
                         f"DeepStack merger {k} of {checkpoint.path}")
        pooler.load_state_dict(merger_weights(tensors, DEEPSTACK.format(k)))
        taps[f"deepstack_{k}"] = (block + 1, pooler.eval())
    return taps


FORMAT = register_format(HfQwen3VLVisionFormat())
