"""Hugging Face `PixtralVisionModel` directories (model_type "pixtral"; Mistral's Pixtral-12B
vision encoder): 2D RoPE without a position table, RMSNorm, a SwiGLU MLP, no class token, any
aspect ratio.

A Pixtral block is the pre-norm block with RMSNorm (`attention_norm`, `ffn_norm`, eps 1e-5
in transformers' code, not in its config), separate q/k/v/o projections and a SwiGLU
`feed_forward` (`gate_proj`, `up_proj`, `down_proj`); an RMSNorm `ln_pre` comes before the
first block and there is no final norm. Its rotary frequencies alternate between rows and
columns (`PixtralVisionRotaryEmbedding`: `inv_freq[0::2]` for rows, `inv_freq[1::2]` for
columns), our `rope_frequencies="alternating"`.

What the file fixes, recorded in `Converted.rules`:

* no Linear of Pixtral has a bias: q, k and v map to `qkv_bias=False`; the output projection
  and the MLP, which always have one here, get zeros (the same function);
* `image_size` is Pixtral's largest side, the processor's bound: the encoder takes any
  multiple of the patch size;
* pooling is the mean of the patch tokens (the tower has no pooled output).

`write` goes the other way: a `PixtralVisionModel` directory, the zero biases dropped (any
other is refused: Pixtral's Linears have none).
"""

from __future__ import annotations

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
from vlm_vit.convert.hf_common import PREPROCESSOR_NAME, hf_encoder_config
from vlm_vit.convert.hf_writing import (
    detached,
    mismatches,
    native_resolution_preprocessor,
    parameter_free,
    refuse,
    write_hf_directory,
)
from vlm_vit.convert.keymap import fuse_qkv, invert, origins, rename, split_qkv
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import NORMALIZATION, ImageProcessor

MODEL_TYPES = ("pixtral",)
PREFIXES = ("vision_tower.", "model.vision_tower.")  # inside a LLaVA-style model
CONFIG_FILE = "config.json"
NORM_EPS = 1e-5  # PixtralRMSNorm(..., eps=1e-5) in every place the model builds one

# transformers' PixtralVisionConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    num_channels=3, image_size=1024, patch_size=16, hidden_act="gelu", head_dim=None,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
)

_LAYER = "transformer.layers.{}."
KEY_MAP = {
    "patch_conv.weight": "patch_embed.proj.weight",
    "ln_pre.weight": "norm_pre.weight",
    **{_LAYER + source: "blocks.{}." + target for source, target in {
        "attention_norm.weight": "norm1.weight", "ffn_norm.weight": "norm2.weight",
        "attention.q_proj.weight": "attn.q.weight", "attention.k_proj.weight": "attn.k.weight",
        "attention.v_proj.weight": "attn.v.weight",
        "attention.o_proj.weight": "attn.proj.weight",
        "feed_forward.gate_proj.weight": "mlp.fc1_g.weight",
        "feed_forward.up_proj.weight": "mlp.fc1_x.weight",
        "feed_forward.down_proj.weight": "mlp.fc2.weight",
    }.items()},
}
BLOCK_PATTERN = r"transformer\.layers\.(\d+)\."
# The Linears that have a bias in our block but none in Pixtral's: zeros keep the function.
ZERO_BIASES = ("attn.proj", "mlp.fc1_g", "mlp.fc1_x", "mlp.fc2")


def strip_prefix(tensors: dict) -> dict:
    """The vision tower's tensors, without the prefix of a model that holds it."""
    for prefix in PREFIXES:
        if any(key.startswith(prefix + "patch_conv.") for key in tensors):
            return {key.removeprefix(prefix): tensor for key, tensor in tensors.items()
                    if key.startswith(prefix)}
    return dict(tensors)


def rope_theta(hf: dict[str, Any], source: object) -> Any:
    """The rotary base: `rope_parameters["rope_theta"]` (transformers 5) or `rope_theta`.

    Raises:
        ValueError: for a rope type other than axial, naming `source`.
    """
    parameters = hf.get("rope_parameters") or {}
    if not isinstance(parameters, dict) or parameters.get("rope_type", "axial") != "axial":
        raise ValueError(f"{source}: rope_parameters {parameters!r} is not axial 2D RoPE")
    return parameters.get("rope_theta", hf.get("rope_theta", 10000.0))


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a PixtralVisionConfig dict (its defaults filled in).

    Raises:
        ValueError: for settings vlm-vit refuses, naming `source` and the key: a `head_dim`
            other than hidden_size / heads (the attention splits by the latter, RoPE by the
            former), an activation other than SiLU (the gate of our SwiGLU), any
            `EncoderConfig` refusal.
    """
    hf = {**HF_DEFAULTS, **hf}
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    if isinstance(heads, int) and heads > 0 and isinstance(width, int) and \
            hf["head_dim"] not in (None, width // heads):
        raise ValueError(f"{source}: head_dim {hf['head_dim']!r} is not hidden_size {width} / "
                         f"num_attention_heads {heads}; Pixtral's attention and RoPE would "
                         "disagree")
    return hf_encoder_config(
        {**hf, "layer_norm_eps": NORM_EPS}, source, class_token=False, pre_norm=True,
        final_norm=False, qkv_bias=False, patch_bias=False, norm="rmsnorm", mlp="swiglu",
        pos_embed="none", rope_theta=rope_theta(hf, source), rope_frequencies="alternating",
    )


def add_zero_biases(state: dict[str, torch.Tensor], depth: int) -> None:
    """Zero biases for the Linears `ZERO_BIASES` names, which Pixtral has without (in place)."""
    for i in range(depth):
        for module in ZERO_BIASES:
            weight = state[f"blocks.{i}.{module}.weight"]
            state[f"blocks.{i}.{module}.bias"] = weight.new_zeros(weight.shape[0])


def image_processor(settings: dict[str, Any] | None, config: EncoderConfig
                    ) -> tuple[ImageProcessor, list[str]]:
    """Native-resolution preprocessing (Pixtral keeps each image's aspect ratio): sides
    multiples of the patch, at most `image_size` squared pixels, CLIP's mean and std unless
    a `preprocessor_config.json` gives others."""
    settings = settings or {}
    mean, std = NORMALIZATION["clip"]
    side = max(config.image_size)
    rules = [f"Pixtral fits the longest side into {side}; approximated by at most {side}x{side} "
             f"pixels, each side a multiple of {config.patch_size}"]
    processor = ImageProcessor(
        resize_mode="native", resample="bicubic", patch_multiple=config.patch_size,
        max_output_pixels=side * side, mean=tuple(settings.get("image_mean", mean)),
        std=tuple(settings.get("image_std", std)), size=config.image_size)
    return processor, rules


class HfPixtralFormat:
    """`PixtralVisionModel` saved by `save_pretrained` (or its tensors inside a LLaVA-style
    model, under `vision_tower.`, with the vision config)."""

    name = "hf_pixtral"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.config is not None and \
            checkpoint.config.get("model_type") in MODEL_TYPES

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        config = encoder_config(checkpoint.config, checkpoint.path / CONFIG_FILE)
        tensors = strip_prefix(checkpoint.tensors)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        state = rename(tensors, KEY_MAP, config.depth, source=checkpoint.path)
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path,
                 origin=origins(tensors, KEY_MAP, config.depth))
        add_zero_biases(state, config.depth)
        processor, rules = image_processor(checkpoint.files.get(PREPROCESSOR_NAME), config)
        rules += ["no bias in Pixtral's output projection and MLP: zeros",
                  "2D RoPE with Pixtral's alternating row/column frequencies, no position table"]
        return Converted(config=config, state=state,
                         pooler=NativePooler("mean", config.width, None, {}, {}),
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE)


    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `PixtralVisionModel.from_pretrained` reads: config.json, the
        weights, and the processor as `PixtralImageProcessor`'s preprocessor_config.json.

        Raises:
            ValueError: naming every field Pixtral cannot hold (`WRITE_ARCHITECTURE`, 2D RoPE),
                a bias that is not zero, a pooler with weights, or a processor that does not
                keep the aspect ratio; nothing is written then.
        """
        hf = pixtral_config(encoder)  # the architecture first, then the pooler
        parameter_free(pooler, "Pixtral")
        tensors = pixtral_tensors(encoder)
        settings = None if processor is None else native_resolution_preprocessor(
            processor, "PixtralImageProcessor", size={"longest_edge": hf["image_size"]},
            patch_size={"height": hf["patch_size"], "width": hf["patch_size"]})
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# -- writing ----------------------------------------------------------------------------------

# What a Pixtral tower fixes, in EncoderConfig fields; `write` refuses anything else.
WRITE_ARCHITECTURE = dict(rope_reference_grid=None, mlp_norm=False,
                          class_token=False, num_register_tokens=0, pre_norm=True,
                          final_norm=False, qkv_bias=False, patch_bias=False, norm="rmsnorm",
                          mlp="swiglu", norm_eps=NORM_EPS, layer_scale_init=None,
                          hybrid_layers=None, pos_embed="none", rope_frequencies="alternating",
                          temporal_patch_size=None, window_size=None, patch_norm=False,
                          rope_positions="index")


def pixtral_config(encoder: nn.Module) -> dict[str, Any]:
    """The `config.json` of a `PixtralVisionModel` holding `encoder`.

    Raises:
        ValueError: naming every field Pixtral cannot hold.
    """
    config = encoder.config
    problems = mismatches(config, WRITE_ARCHITECTURE, "Pixtral")
    if config.rope_theta is None:
        problems.insert(0, "rope_theta=None (Pixtral needs 2D RoPE)")
    refuse(problems, "Pixtral")
    return {
        "architectures": ["PixtralVisionModel"], "model_type": "pixtral",
        "hidden_size": config.width, "intermediate_size": config.mlp_width,
        "num_hidden_layers": config.depth, "num_attention_heads": config.heads,
        "head_dim": config.width // config.heads, "num_channels": config.in_channels,
        "image_size": max(config.image_size), "patch_size": config.patch_size,
        "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "axial"},
        "dtype": str(encoder.patch_embed.proj.weight.dtype).removeprefix("torch."),
    }


def pixtral_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under `PixtralVisionModel`'s names (a pure function).

    Raises:
        ValueError: naming the biases (`ZERO_BIASES`) that are not zero.
    """
    depth = encoder.config.depth
    state = detached(encoder)
    nonzero = []
    for i in range(depth):
        for module in ZERO_BIASES:
            name = f"blocks.{i}.{module}.bias"
            if state.pop(name).any():
                nonzero.append(name)
    if nonzero:
        more = f" and {len(nonzero) - 3} more" if len(nonzero) > 3 else ""
        raise ValueError(f"a Hugging Face Pixtral model has no biases in its output projection "
                         f"and MLP, but this encoder's are not zero: "
                         f"{', '.join(nonzero[:3])}{more}")
    split_qkv(state, depth)
    return rename(state, invert(KEY_MAP), depth, source="the encoder")


register_format(HfPixtralFormat())
