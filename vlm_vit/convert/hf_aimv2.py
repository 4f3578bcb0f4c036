"""Hugging Face AIMv2 vision towers (`Aimv2VisionModel`, model_type "aimv2_vision_model", and
the vision half of `Aimv2Model`, "aimv2"; Fini et al. 2025, "Multimodal Autoregressive
Pre-training of Large Vision Encoders").

AIMv2's tower is the pre-norm ViT with RMSNorm everywhere (eps `rms_norm_eps`), a SwiGLU MLP
(`gate_proj`, `up_proj`, `down_proj` -> `fc1_g`, `fc1_x`, `fc2`), no class token, a final
RMSNorm, and an RMSNorm over the patch embeddings before the positions are added (our
`patch_norm`). Its positions are a learned table (`position_embedding`, one entry per patch
at `image_size`; transformers cannot run at another size) or, with `is_native`, the 2D
sin-cos table computed for every image's grid (our `pos_embed="sincos"`, the same
`[sin_w | cos_w | sin_h | cos_h]` layout). Its pooled output is the attention-pooling head
(`use_head`): the `attentive_probe` pooler.

What the file fixes, recorded in `Converted.rules`:

* the Linears without a bias (`qkv_bias` false: q, k, v and `out_proj`; `mlp_bias` false: the
  MLP) get zero biases where our block has one (`attn.proj`, the MLP): the same function;
* `Aimv2Model`'s text tower and `visual_projection` are not read: the pooler is the vision
  model's head (`pooler_output`).

`write` goes the other way: an `Aimv2VisionModel` directory; a bias our encoder holds that
AIMv2 ties to none (`out_proj` without `qkv_bias`) must be zero, and the MLP's biases are
written (`mlp_bias`) only when one is not zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_clip import preprocessor_config
from vlm_vit.convert.hf_common import (
    CLIP_IMAGE_PROCESSOR,
    HF_FIELDS,
    PREPROCESSOR_NAME,
    activation,
    processor_from_hf,
)
from vlm_vit.convert.hf_writing import detached, mismatches, refuse, write_hf_directory
from vlm_vit.convert.keymap import fuse_qkv, invert, rename, split_qkv
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
MODEL_TYPES = ("aimv2_vision_model", "aimv2")
BLOCK_PATTERN = r"encoder\.layers\.(\d+)\."
# transformers' Aimv2VisionConfig defaults (aimv2-large-patch14-224), for keys a file omits.
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=8,
    num_channels=3, image_size=224, patch_size=14, hidden_act="silu", rms_norm_eps=1e-5,
    qkv_bias=False, mlp_bias=False, use_head=True, is_native=False)
# What an AIMv2 tower fixes, in EncoderConfig fields (`pos_embed` learned or sincos).
AIMV2_ARCHITECTURE = dict(class_token=False, num_register_tokens=0, pre_norm=False,
                          final_norm=True, patch_bias=True, patch_norm=True, norm="rmsnorm",
                          mlp="swiglu", act="silu", mlp_norm=False, layer_scale_init=None,
                          hybrid_layers=None, rope_theta=None, temporal_patch_size=None,
                          window_size=None)

_LAYER = "encoder.layers.{}."
_BLOCK = "blocks.{}."
KEY_MAP = {
    "embeddings.patch_embed.weight": "patch_embed.proj.weight",
    "embeddings.patch_embed.bias": "patch_embed.proj.bias",
    "embeddings.rms_norm.weight": "patch_embed.norm.weight",
    "embeddings.position_embedding.weight": "pos_embed",
    "rms_norm.weight": "norm.weight",
    _LAYER + "rms_norm1.weight": _BLOCK + "norm1.weight",
    _LAYER + "rms_norm2.weight": _BLOCK + "norm2.weight",
    **{_LAYER + f"{theirs}.{kind}": _BLOCK + f"{ours}.{kind}"
       for theirs, ours in (("attention.q_proj", "attn.q"), ("attention.k_proj", "attn.k"),
                            ("attention.v_proj", "attn.v"), ("attention.out_proj", "attn.proj"),
                            ("ffn.gate_proj", "mlp.fc1_g"), ("ffn.up_proj", "mlp.fc1_x"),
                            ("ffn.down_proj", "mlp.fc2"))
       for kind in ("weight", "bias")},
}
# The head -> the `attentive_probe` pooler's weights.
HEAD_MAP = {"head.cls_token": "query", "head.k_proj.weight": "k.weight",
            "head.k_proj.bias": "k.bias", "head.v_proj.weight": "v.weight",
            "head.v_proj.bias": "v.bias", "head.output_proj.weight": "proj.weight",
            "head.output_proj.bias": "proj.bias"}
# Our block's biases that AIMv2 may lack: block-relative name -> its width ("width" or "mlp").
OPTIONAL_BIASES = {"attn.proj.bias": "width", "mlp.fc1_g.bias": "mlp", "mlp.fc1_x.bias": "mlp",
                   "mlp.fc2.bias": "width"}


def zero_absent_biases(state: dict[str, torch.Tensor], config: EncoderConfig) -> list[str]:
    """Adds a zero bias for each of `OPTIONAL_BIASES` a block lacks (in place): a Linear
    without a bias computes what one with a zero bias does. Returns the names added in block 0."""
    added = []
    for i in range(config.depth):
        for name, size in OPTIONAL_BIASES.items():
            key = f"blocks.{i}.{name}"
            if key not in state:
                reference = state[f"blocks.{i}.norm1.weight"]
                width = config.width if size == "width" else config.mlp_width
                state[key] = reference.new_zeros(width)
                added += [name] if i == 0 else []
    return added


def nonzero(state: dict[str, torch.Tensor], names: list[str], depth: int) -> list[str]:
    """Which of the block-relative `names` hold a value other than zero in some block."""
    return [f"blocks.{i}.{name}" for i in range(depth) for name in names
            if bool(state[f"blocks.{i}.{name}"].any())]


def vision_part(checkpoint: Checkpoint) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The vision config (defaults filled in) and the vision tensors (prefix stripped) of an
    `Aimv2VisionModel` or `Aimv2Model` directory.

    Raises:
        ValueError: for an `Aimv2Model` config whose vision_config is not an object.
    """
    config = checkpoint.config or {}
    if config.get("model_type") != "aimv2":
        return {**HF_DEFAULTS, **config}, dict(checkpoint.tensors)
    vision = config.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise ValueError(f"{checkpoint.path / CONFIG_FILE}: vision_config must be a JSON "
                         f"object, got {type(vision).__name__}")
    prefix = "vision_model."
    return {**HF_DEFAULTS, **vision}, {k[len(prefix):]: v for k, v in checkpoint.tensors.items()
                                       if k.startswith(prefix)}


def encoder_config(hf: dict[str, Any], source: object) -> EncoderConfig:
    """Our architecture from an Aimv2VisionConfig dict (defaults filled in).

    Raises:
        ValueError: for a setting vlm-vit refuses (an activation other than SiLU, which our
            SwiGLU gates with; a size out of bounds; heads that do not divide the width; an
            `is_native` or `qkv_bias` that is not a bool), naming `source` and the key.
    """
    for key in ("is_native", "qkv_bias", "mlp_bias", "use_head"):
        if not isinstance(hf[key], bool):
            raise ValueError(f"{source}: {key} must be true or false, got {hf[key]!r}")
    fields = {ours: hf[theirs] for ours, theirs in HF_FIELDS.items() if ours != "norm_eps"}
    try:
        return EncoderConfig(**fields, norm_eps=hf["rms_norm_eps"],
                             act=activation(hf["hidden_act"], source),
                             qkv_bias=hf["qkv_bias"],
                             pos_embed="sincos" if hf["is_native"] else "learned",
                             **{k: v for k, v in AIMV2_ARCHITECTURE.items() if k != "act"})
    except ConfigError as error:
        spelled = {**HF_FIELDS, "norm_eps": "rms_norm_eps", "pos_embed": "is_native"}
        raise error.located(source, spelled.get(error.field)) from None


class HFAimv2Format:
    """`Aimv2VisionModel` and `Aimv2Model` directories saved by `save_pretrained`."""

    name = "hf_aimv2"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return (checkpoint.config or {}).get("model_type") in MODEL_TYPES

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE
        hf, tensors = vision_part(checkpoint)
        config = encoder_config(hf, source)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        head = {HEAD_MAP[k]: v for k, v in tensors.items() if k in HEAD_MAP}
        state = rename(tensors, KEY_MAP, config.depth, ignore=[r"head\."],
                       source=checkpoint.path)
        table = state.get("pos_embed")
        if isinstance(table, torch.Tensor) and table.ndim == 2:  # nn.Embedding's [N, D]
            state["pos_embed"] = table[None]
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path)
        rules = []
        if added := zero_absent_biases(state, config):
            rules.append(f"zero biases for the Linears AIMv2 has without: {', '.join(added)}")
        if checkpoint.config.get("model_type") == "aimv2":
            rules.append("Aimv2Model: the vision tower and its head read; the text tower and "
                         "visual_projection are not")
        rules.append("positions: the 2D sin-cos table of each grid (is_native)"
                     if config.pos_embed == "sincos" else
                     f"positions: a learned {config.grid[0]}x{config.grid[1]} table "
                     "(transformers runs it at image_size only; resized bicubically here)")
        pooler = None
        if hf["use_head"]:
            pooler = NativePooler("attentive_probe", config.width, None,
                                  {"heads": config.heads, "qkv_bias": config.qkv_bias}, head)
        return Converted(config=config, state=state, pooler=pooler,
                         processor=self.processor(checkpoint, config, rules), rules=rules,
                         source=checkpoint.path, config_file=CONFIG_FILE)

    def processor(self, checkpoint: Checkpoint, config: EncoderConfig,
                  rules: list[str]) -> ImageProcessor:
        """CLIPImageProcessor's preprocessing (AIMv2's), from preprocessor_config.json when
        there is one."""
        fallback = ImageProcessor.for_family("clip", size=config.image_size,
                                             crop_rounding="floor")
        settings = checkpoint.files.get(PREPROCESSOR_NAME)
        if settings is None:
            rules.append(f"no {PREPROCESSOR_NAME}: CLIPImageProcessor's OpenAI mean and std")
            return fallback
        return processor_from_hf(settings, fallback, rules,
                                 source=checkpoint.path / PREPROCESSOR_NAME,
                                 processor_class=CLIP_IMAGE_PROCESSOR)

    def hf_tensors(self, encoder: nn.Module, pooler: nn.Module | None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The `Aimv2VisionModel` config.json and its tensors, as `write` writes them.

        Raises:
            ValueError: as `write`.
        """
        config = encoder.config
        state = detached(encoder)
        problems = mismatches(config, AIMV2_ARCHITECTURE, "AIMv2")
        if config.pos_embed == "none":
            problems.append("pos_embed='none' (AIMv2 needs 'learned' or 'sincos')")
        if config.image_size[0] != config.image_size[1]:
            problems.append(f"image_size={config.image_size} (AIMv2's config holds one side)")
        refuse(problems, "AIMv2")
        if not config.qkv_bias and (tied := nonzero(state, ["attn.proj.bias"], config.depth)):
            refuse([f"{tied[0]} is not zero, and AIMv2 without qkv_bias has no out_proj bias"],
                   "AIMv2")
        mlp_bias = bool(nonzero(state, ["mlp.fc1_g.bias", "mlp.fc1_x.bias", "mlp.fc2.bias"],
                                config.depth))
        dropped = [name for name, keep in (("attn.proj.bias", config.qkv_bias),
                                           ("mlp.fc1_g.bias", mlp_bias),
                                           ("mlp.fc1_x.bias", mlp_bias),
                                           ("mlp.fc2.bias", mlp_bias)) if not keep]
        state = {k: v for k, v in state.items()
                 if not any(k.endswith(f".{name}") for name in dropped)}
        if config.pos_embed == "learned":
            state["pos_embed"] = state["pos_embed"][0]
        split_qkv(state, config.depth)
        tensors = rename(state, invert(KEY_MAP), config.depth, source="the encoder")
        # A pooler without weights (the mean of timm's AIMv2) is not written: no head.
        use_head = pooler is not None and any(True for _ in pooler.parameters())
        if use_head:
            tensors.update(head_tensors(pooler, config))
        hf = {"architectures": ["Aimv2VisionModel"], "model_type": "aimv2_vision_model",
              "hidden_size": config.width, "intermediate_size": config.mlp_width,
              "num_hidden_layers": config.depth, "num_attention_heads": config.heads,
              "num_channels": config.in_channels, "image_size": config.image_size[0],
              "patch_size": config.patch_size, "hidden_act": "silu",
              "rms_norm_eps": config.norm_eps, "qkv_bias": config.qkv_bias,
              "mlp_bias": mlp_bias, "use_head": use_head,
              "is_native": config.pos_embed == "sincos", "attention_dropout": 0.0,
              "initializer_range": 0.02,
              "dtype": str(encoder.patch_embed.proj.weight.dtype).removeprefix("torch.")}
        return hf, tensors

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `Aimv2VisionModel.from_pretrained` reads: config.json, the
        weights (the `attentive_probe` pooler as its head, `use_head` false without a
        pooler or with one without weights) and, given a processor, a CLIPImageProcessor
        preprocessor_config.json.

        Raises:
            ValueError: naming every field AIMv2's tower cannot hold (`AIMV2_ARCHITECTURE`,
                no position table, a non-square image size), a non-zero attention-output
                bias without `qkv_bias`, or a pooler that is not an `attentive_probe` with
                the tower's heads, width and key/value biases; nothing is written then.
        """
        hf, tensors = self.hf_tensors(encoder, pooler)
        settings = None if processor is None else preprocessor_config(processor)
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


def head_tensors(pooler: nn.Module, config: EncoderConfig) -> dict[str, torch.Tensor]:
    """An `attentive_probe` pooler's weights under `Aimv2AttentionPoolingHead`'s names.

    Raises:
        ValueError: for another pooler, or one whose heads, widths or key/value biases are
            not the tower's (AIMv2's head takes them from the tower's config).
    """
    from vlm_vit.poolers.attentive_probe import AttentiveProbe  # converters name poolers lazily

    if not isinstance(pooler, AttentiveProbe):
        spec = getattr(pooler, "pooler_spec", {}).get("name", type(pooler).__name__)
        refuse([f"pooler {spec!r} (AIMv2's head is an 'attentive_probe' pooler)"], "AIMv2")
    problems = [f"pooler {field} {ours} (AIMv2's head needs the tower's {theirs})"
                for field, ours, theirs in (
                    ("heads", pooler.heads, config.heads),
                    ("out_dim", pooler.out_dim, config.width),
                    ("in_dim", pooler.in_dim, config.width),
                    ("qkv_bias", pooler.k.bias is not None, config.qkv_bias))
                if ours != theirs]
    refuse(problems, "AIMv2")
    weights = {name: tensor.detach() for name, tensor in pooler.state_dict().items()}
    return {theirs: weights[ours] for theirs, ours in HEAD_MAP.items() if ours in weights}


register_format(HFAimv2Format())
