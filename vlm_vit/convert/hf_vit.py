"""Hugging Face `ViTModel`, `ViTForImageClassification` and ViTMAE directories (model_type
"vit", "vit_mae").

The files on disk use the names `save_pretrained` writes (`encoder.layer.N.attention.attention.
query`, ...), under `vit.` in `ViTForImageClassification`; the names of transformers 5's
modules (`layers.N.attention.q_proj`, ...), found in a state dict saved by hand, are read too.
The architecture comes from `config.json`, with `ViTConfig`'s defaults for keys it lacks.
`ViTPooler` (dense + tanh on the final-norm class token) becomes the `cls_linear` pooler;
without it the checkpoint's pooling is the class token.
"""

from __future__ import annotations

from typing import Any

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
    VIT_IMAGE_PROCESSOR,
    hf_encoder_config,
    processor_from_hf,
)
from vlm_vit.convert.keymap import fuse_qkv, origins, rename
from vlm_vit.processor import NORMALIZATION, ImageProcessor

MODEL_TYPE = "vit"
# ViTMAE's encoder is ViT's under the same names (its sin-cos position table is stored); the
# MAE decoder of ViTMAEForPreTraining is dropped like a classifier.
MODEL_TYPES = (MODEL_TYPE, "vit_mae")
PREFIX = "vit."  # ViTForImageClassification / ViTForMaskedImageModeling wrap the ViTModel
PREPROCESSOR_CONFIG = PREPROCESSOR_NAME
CONFIG_FILE = "config.json"

# transformers' ViTConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3,
    qkv_bias=True, pooler_act="tanh",
)

POOLER_ACTIVATIONS = {"tanh": "tanh", "linear": None}

# Source module -> native module; each has a weight and a bias.
_MODULES = {
    "embeddings.patch_embeddings.projection": "patch_embed.proj",
    "layernorm": "norm",
    # as saved by save_pretrained
    "encoder.layer.{}.layernorm_before": "blocks.{}.norm1",
    "encoder.layer.{}.attention.attention.query": "blocks.{}.attn.q",
    "encoder.layer.{}.attention.attention.key": "blocks.{}.attn.k",
    "encoder.layer.{}.attention.attention.value": "blocks.{}.attn.v",
    "encoder.layer.{}.attention.output.dense": "blocks.{}.attn.proj",
    "encoder.layer.{}.layernorm_after": "blocks.{}.norm2",
    "encoder.layer.{}.intermediate.dense": "blocks.{}.mlp.fc1",
    "encoder.layer.{}.output.dense": "blocks.{}.mlp.fc2",
    # transformers 5's module names (a state_dict() saved without save_pretrained)
    "layers.{}.layernorm_before": "blocks.{}.norm1",
    "layers.{}.attention.q_proj": "blocks.{}.attn.q",
    "layers.{}.attention.k_proj": "blocks.{}.attn.k",
    "layers.{}.attention.v_proj": "blocks.{}.attn.v",
    "layers.{}.attention.o_proj": "blocks.{}.attn.proj",
    "layers.{}.layernorm_after": "blocks.{}.norm2",
    "layers.{}.mlp.fc1": "blocks.{}.mlp.fc1",
    "layers.{}.mlp.fc2": "blocks.{}.mlp.fc2",
}

KEY_MAP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    **{f"{source}.{kind}": f"{target}.{kind}"
       for source, target in _MODULES.items() for kind in ("weight", "bias")},
}
POOLER_KEY_MAP = {"pooler.dense.weight": "proj.weight", "pooler.dense.bias": "proj.bias"}

# Deliberately dropped: the classifier, and the masked-image-modelling decoder and mask token.
IGNORED = (r"classifier\.", r"decoder\.", r"embeddings\.mask_token$", r"pooler\.")
BLOCK_PATTERN = r"(?:encoder\.layer|layers)\.(\d+)\."
SIGNATURES = ("encoder.layer.0.attention.attention.query.weight",
              "layers.0.attention.q_proj.weight")


def strip_prefix(tensors: dict) -> dict:
    """The ViTModel's tensors, without the `vit.` of the task models (their heads kept)."""
    if not any(key.startswith(PREFIX + "embeddings.") for key in tensors):
        return dict(tensors)
    return {key.removeprefix(PREFIX): tensor for key, tensor in tensors.items()}


def encoder_config(hf: dict[str, Any], source: object = "config.json") -> EncoderConfig:
    """Our architecture from a ViTConfig dict (its defaults filled in).

    Raises:
        ValueError: for a `hidden_act` vlm-vit does not have, or sizes it refuses, naming
            `source` and the key.
    """
    hf = {**HF_DEFAULTS, **hf}
    # ViTEmbeddings.interpolate_pos_encoding: bicubic, align_corners=False, no antialias
    extra = dict(pos_resize_mode="bicubic", pos_resize_antialias=False)
    if not isinstance(hf["qkv_bias"], bool):
        raise ValueError(f"{source}: qkv_bias must be true or false, got {hf['qkv_bias']!r}")
    return hf_encoder_config(hf, source, qkv_bias=hf["qkv_bias"], **extra)


def native_pooler(tensors: dict, hf: dict[str, Any], width: int,
                  source: object = "checkpoint") -> NativePooler:
    """`ViTPooler` as `cls_linear` when its weights are there, else the class token.

    Raises:
        ValueError: for a `pooler_act` other than tanh or linear.
    """
    if "pooler.dense.weight" not in tensors:
        return NativePooler("cls", in_dim=width, out_dim=None, options={}, weights={})
    act = {**HF_DEFAULTS, **hf}["pooler_act"]
    if act not in POOLER_ACTIVATIONS:
        raise ValueError(f"{source}: pooler_act {act!r} has no vlm-vit equivalent; known: "
                         f"{', '.join(POOLER_ACTIVATIONS)}")
    weights = rename({k: v for k, v in tensors.items() if k.startswith("pooler.")},
                     POOLER_KEY_MAP, 1, source="the ViT pooler")
    return NativePooler("cls_linear", in_dim=width, out_dim=weights["proj.weight"].shape[0],
                        options={"bias": "proj.bias" in weights,
                                 "act": POOLER_ACTIVATIONS[act]},
                        weights=weights)


def image_processor(settings: dict[str, Any] | None, image_size: tuple[int, int],
                    source: object) -> tuple[ImageProcessor, list[str]]:
    """The ImageProcessor a `preprocessor_config.json` describes, and the rules applied.

    ViTImageProcessor resizes straight to {"height", "width"} (no crop), bilinear unless the
    file says otherwise, then rescales and normalises (`hf_common.processor_from_hf`, the
    parser every Hugging Face family shares). Without the file, its defaults are used at the
    model's image size.

    Raises:
        ValueError: for settings the ImageProcessor cannot reproduce, naming them.
    """
    mean, std = NORMALIZATION["inception"]  # ViTImageProcessor's default 0.5 / 0.5
    defaults = ImageProcessor(size=image_size, resize_mode="squash", resample="bilinear",
                              mean=mean, std=std, crop_rounding="floor")
    if settings is None:
        return defaults, [f"no {PREPROCESSOR_CONFIG}: ViTImageProcessor's defaults (squash "
                          f"resize, bilinear, mean/std 0.5) at the model's image size "
                          f"{image_size}"]
    rules: list[str] = []
    processor = processor_from_hf(settings, defaults, rules, source,
                                  processor_class=VIT_IMAGE_PROCESSOR)
    return processor, rules


class HfVitFormat:
    """`ViTModel` / `ViTForImageClassification` saved by `save_pretrained`."""

    name = "hf_vit"

    def matches(self, checkpoint: Checkpoint) -> bool:
        if checkpoint.config is not None:
            return checkpoint.config.get("model_type") in MODEL_TYPES
        tensors = strip_prefix(checkpoint.tensors)
        return any(key in tensors for key in SIGNATURES)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        if checkpoint.config is None:
            raise ValueError(f"{checkpoint.path} looks like a Hugging Face ViT checkpoint but has "
                             "no config.json beside it; the head count cannot be read from the "
                             "weights, so put the model's config.json next to them")
        hf = checkpoint.config
        missing = sorted(set(HF_DEFAULTS) - set(hf))
        config = encoder_config(hf, checkpoint.path / CONFIG_FILE)
        tensors = strip_prefix(checkpoint.tensors)
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        state = rename(tensors, KEY_MAP, config.depth, ignore=IGNORED, source=checkpoint.path)
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path,
                 origin=origins(tensors, KEY_MAP, config.depth))
        processor, rules = image_processor(checkpoint.files.get(PREPROCESSOR_CONFIG),
                                           config.image_size, checkpoint.path)
        rules.append("position table resized like ViTEmbeddings.interpolate_pos_encoding "
                     "(bicubic, no antialias)")
        if missing:
            rules.append(f"config.json lacks {', '.join(missing)}: ViTConfig's defaults used")
        return Converted(config=config, state=state,
                         pooler=native_pooler(tensors, hf, config.width, checkpoint.path),
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE)


register_format(HfVitFormat())
