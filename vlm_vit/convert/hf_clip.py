"""Hugging Face CLIP and SigLIP vision towers, read and (for CLIP) written.

Reads the directories `save_pretrained` writes for `CLIPVisionModel`,
`CLIPVisionModelWithProjection`, `CLIPModel`, `SiglipVisionModel` and `SiglipModel`, with the
vision names bare (`embeddings.class_embedding`, what transformers 5 writes for the vision-only
classes) or under `vision_model.` (the composite models, and older files); text towers are
dropped. SigLIP 2's fixed-resolution checkpoints are `SiglipModel`s and load here (its
NaFlex ones are `hf_siglip2`). `save_hf_clip` writes a `CLIPVisionModel` (or, with a projection,
`CLIPVisionModelWithProjection`) directory without importing transformers.

Where the outputs line up with Hugging Face's:

- CLIP: HF applies `post_layernorm` to the pooled class token only, and its
  `last_hidden_state` is the last block's raw output. Our `tokens` apply the final norm to
  every token, so HF `last_hidden_state` is our `hidden_states[-1]`, HF `pooler_output` is our
  `cls_token`, and HF `hidden_states[i]` is ours for every i.
- SigLIP: HF applies `post_layernorm` to every token, so its `last_hidden_state` is our `tokens`.
- The checkpoint's own pooler (`load_tower`): CLIP's projected class token
  (`get_image_features`), the bare class token (`pooler_output`) without a projection, and
  SigLIP's MAP head (`pooler_output`).
- Other image sizes: HF's `interpolate_pos_encoding=True` resizes the position table
  bicubically without antialiasing; loaded encoders keep the library's default (antialiased,
  as timm and open_clip). `load_encoder(path, pos_resize_antialias=False)` matches HF.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import PAPER_MECHANISMS, EncoderConfig
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_common import (
    PIL_RESAMPLE,
    PREPROCESSOR_NAME,
    activation,
    hf_encoder_config,
    processor_from_hf,
)
from vlm_vit.convert.keymap import fuse_qkv, invert, origins, rename, split_qkv
from vlm_vit.io.files import atomic_directory, atomic_write
from vlm_vit.io.native import CONFIG_NAME
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE, write_weights
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import ImageProcessor

VISION_PREFIX = "vision_model."  # composite models, and vision-only files before transformers 5
POOLER_PREFIX = "pooler."  # where renaming parks the pooling head's weights, apart from the encoder

# Source tensors deliberately dropped: the text tower, the contrastive scale and bias, and the
# `position_ids` buffer that older transformers saved.
IGNORED = (r"text_model\.", r"text_projection\.", r"logit_(scale|bias)$", r".*position_ids$")

# Ours -> the Hugging Face names written back.
HF_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def with_params(modules: dict[str, str]) -> dict[str, str]:
    """A module-name map as a tensor-name map: each module's `weight` and `bias`."""
    return {f"{source}.{kind}": f"{target}.{kind}"
            for source, target in modules.items() for kind in ("weight", "bias")}


# The Transformer blocks, the same in CLIP and SigLIP; q, k, v are fused after renaming.
BLOCK_KEYS = with_params({
    "encoder.layers.{}.layer_norm1": "blocks.{}.norm1",
    "encoder.layers.{}.self_attn.q_proj": "blocks.{}.attn.q",
    "encoder.layers.{}.self_attn.k_proj": "blocks.{}.attn.k",
    "encoder.layers.{}.self_attn.v_proj": "blocks.{}.attn.v",
    "encoder.layers.{}.self_attn.out_proj": "blocks.{}.attn.proj",
    "encoder.layers.{}.layer_norm2": "blocks.{}.norm2",
    "encoder.layers.{}.mlp.fc1": "blocks.{}.mlp.fc1",
    "encoder.layers.{}.mlp.fc2": "blocks.{}.mlp.fc2",
})

# Names inside the vision model (bare, or under `vision_model.`).
CLIP_KEYS = {
    "embeddings.class_embedding": "cls_token",  # [D]; ours is [1, 1, D]
    "embeddings.patch_embedding.weight": "patch_embed.proj.weight",  # no bias in CLIP
    "embeddings.position_embedding.weight": "pos_embed",  # [1 + N, D]; ours is [1, 1 + N, D]
    **with_params({"pre_layrnorm": "norm_pre", "post_layernorm": "norm"}),  # "layrnorm" (sic)
    **BLOCK_KEYS,
}
SIGLIP_KEYS = {
    "embeddings.position_embedding.weight": "pos_embed",  # [N, D]: no class token
    **with_params({"embeddings.patch_embedding": "patch_embed.proj", "post_layernorm": "norm"}),
    **BLOCK_KEYS,
    # The MAP head -> the `attention_pool` pooler (both use nn.MultiheadAttention).
    "head.probe": POOLER_PREFIX + "probe",
    "head.attention.in_proj_weight": POOLER_PREFIX + "attn.in_proj_weight",
    "head.attention.in_proj_bias": POOLER_PREFIX + "attn.in_proj_bias",
    **with_params({
        "head.attention.out_proj": POOLER_PREFIX + "attn.out_proj",
        "head.layernorm": POOLER_PREFIX + "mlp.0",
        "head.mlp.fc1": POOLER_PREFIX + "mlp.1",
        "head.mlp.fc2": POOLER_PREFIX + "mlp.3",
    }),
}
# Names beside the vision model (`CLIPModel`, `CLIPVisionModelWithProjection`).
CLIP_OUTER_KEYS = {"visual_projection.weight": POOLER_PREFIX + "proj.weight"}

# What each architecture fixes, in EncoderConfig fields; the writer refuses anything else.
CLIP_ARCHITECTURE = dict(class_token=True, num_register_tokens=0, pre_norm=True,
                         patch_bias=False, qkv_bias=True, final_norm=True, **PAPER_MECHANISMS)
SIGLIP_ARCHITECTURE = dict(class_token=False, num_register_tokens=0, pre_norm=False,
                           patch_bias=True, qkv_bias=True, final_norm=True, **PAPER_MECHANISMS)

# transformers' defaults for the fields a config.json may leave out (CLIPVisionConfig and
# SiglipVisionConfig: ViT-B/32 and ViT-B/16 at 224).
CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                     hidden_act="quick_gelu", layer_norm_eps=1e-5)
SIGLIP_DEFAULTS = {**CLIP_DEFAULTS, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}


# -- named tensor fix-ups ---------------------------------------------------------------------

def add_batch_axis(state: dict[str, torch.Tensor]) -> None:
    """HF keeps the class embedding as `[D]` and the position table as an `nn.Embedding`
    `[T, D]`; ours are `[1, 1, D]` and `[1, T, D]` (in place)."""
    for name in ("cls_token", "pos_embed"):
        if name in state:
            state[name] = state[name].reshape(1, -1, state[name].shape[-1])


def drop_batch_axis(state: dict[str, torch.Tensor]) -> None:
    """The inverse of `add_batch_axis` (in place)."""
    state["cls_token"] = state["cls_token"].reshape(-1)  # [1, 1, D] -> [D]
    state["pos_embed"] = state["pos_embed"].squeeze(0)  # [1, T, D] -> [T, D]


def split_pooler(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Takes the pooling head's weights (parked under `pooler.`) out of `state`."""
    names = [name for name in state if name.startswith(POOLER_PREFIX)]
    return {name.removeprefix(POOLER_PREFIX): state.pop(name) for name in names}


# -- reading ----------------------------------------------------------------------------------

class HFVisionFormat:
    """What the Hugging Face CLIP and SigLIP towers share: names, config, processor.

    Subclasses set the class attributes and say what the native pooler and the default
    processor are.
    """

    name: str
    family: str  # for messages
    model_types: tuple[str, ...]  # config.json `model_type`s: vision-only and composite
    marker: str  # a vision tensor only this layout has, for files without a config
    keys: dict[str, str]  # inside the vision model
    outer_keys: dict[str, str] = {}  # beside it
    architecture: dict[str, Any]
    defaults: dict[str, Any]

    def matches(self, checkpoint: Checkpoint) -> bool:
        model_type = (checkpoint.config or {}).get("model_type")
        if model_type is not None:
            return model_type in self.model_types
        return any(key in checkpoint.tensors for key in (self.marker, VISION_PREFIX + self.marker))

    def vision_config(self, checkpoint: Checkpoint, rules: list[str]) -> dict[str, Any]:
        """The vision tower's config: `vision_config` of a composite model, else the top level,
        with transformers' defaults for what it leaves out (each named in `rules`)."""
        if checkpoint.config is None:
            raise ValueError(f"{checkpoint.path} holds a Hugging Face {self.family} vision "
                             f"tower but no config.json, which gives its head count and "
                             f"activation; load the directory it came from")
        config = checkpoint.config
        for key in ("vision_config", "vision_config_dict"):
            if not isinstance(config.get(key) or {}, dict):
                raise ValueError(f"{checkpoint.path / CONFIG_NAME}: {key} must be a JSON object, "
                                 f"got {type(config[key]).__name__}")
        # Early CLIP configs (openai/clip-vit-*) also keep the tower's settings in
        # `vision_config_dict`, which wins over `vision_config` (as in CLIPConfig).
        vision = {**(config.get("vision_config") or config),
                  **(config.get("vision_config_dict") or {})}
        missing = {k: v for k, v in self.defaults.items() if k not in vision}
        if missing:
            rules.append(f"config.json does not give {', '.join(missing)}; using "
                         f"transformers' defaults {missing}")
        return {**self.defaults, **vision}

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        rules: list[str] = []
        vision = self.vision_config(checkpoint, rules)
        config = hf_encoder_config(vision, checkpoint.path / CONFIG_NAME, **self.architecture)
        prefix = VISION_PREFIX if checkpoint.has_prefix(VISION_PREFIX) else ""
        # Before renaming, whose key map is expanded over the depth the config gives.
        held = held_blocks(checkpoint.tensors, re.escape(prefix) + r"encoder\.layers\.(\d+)\.")
        check_block_count(config.depth, held, checkpoint.path, CONFIG_NAME)
        key_map = {**{prefix + source: target for source, target in self.keys.items()},
                   **self.outer_keys}
        state = rename(checkpoint.tensors, key_map, config.depth, ignore=IGNORED,
                       source=checkpoint.path)
        head = split_pooler(state)
        add_batch_axis(state)
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path,
                 origin=origins(checkpoint.tensors, key_map, config.depth))
        self.fix_up(state, config, checkpoint.path)
        processor = self.image_processor(checkpoint.files.get(PREPROCESSOR_NAME), config, rules,
                                         checkpoint.path / PREPROCESSOR_NAME)
        return Converted(config=config, state=state, pooler=self.pooler(vision, head),
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_NAME)

    def fix_up(self, state: dict[str, torch.Tensor], config: EncoderConfig,
               source: object) -> None:
        """A family's own tensor fix-ups after renaming (in place); none for CLIP and SigLIP."""

    def image_processor(self, settings: dict[str, Any] | None, config: EncoderConfig,
                        rules: list[str], source: object) -> ImageProcessor:
        """The preprocessing of `settings` (a `preprocessor_config.json`), else the family's."""
        processor = self.default_processor(config.image_size)
        if settings is None:
            rules.append(f"no {PREPROCESSOR_NAME}: using {self.family}'s preprocessing "
                         f"{processor.to_dict()}")
            return processor
        return processor_from_hf(settings, processor, rules, source=source)

    def pooler(self, vision: dict[str, Any], head: dict[str, torch.Tensor]) -> NativePooler | None:
        raise NotImplementedError

    def default_processor(self, image_size: tuple[int, int]) -> ImageProcessor:
        raise NotImplementedError


class HFClipFormat(HFVisionFormat):
    """`CLIPVisionModel`, `CLIPVisionModelWithProjection` and `CLIPModel` directories."""

    name = "hf_clip"
    family = "CLIP"
    model_types = ("clip", "clip_vision_model")
    marker = "embeddings.class_embedding"
    keys = CLIP_KEYS
    outer_keys = CLIP_OUTER_KEYS
    architecture = CLIP_ARCHITECTURE
    defaults = CLIP_DEFAULTS

    def pooler(self, vision: dict[str, Any], head: dict[str, torch.Tensor]) -> NativePooler:
        """The projected class token (`get_image_features`) where there is a projection, else
        the class token (`pooler_output`)."""
        width = vision["hidden_size"]
        if "proj.weight" not in head:
            return NativePooler("cls", width, None, {}, {})
        return NativePooler("cls_linear", width, head["proj.weight"].shape[0],
                            {"bias": False}, head)

    def default_processor(self, image_size: tuple[int, int]) -> ImageProcessor:
        # CLIPImageProcessor's, which floors the crop offset like every transformers processor.
        return ImageProcessor.for_family("clip", size=image_size, crop_rounding="floor")

    def from_native(self, encoder: VisionEncoder,
                    pooler: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The encoder's (and projection's) weights under HF names; see `save_hf_clip`."""
        return hf_clip_tensors(encoder, pooler)

    def write(self, encoder: VisionEncoder, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a Hugging Face directory; see `save_hf_clip`."""
        return save_hf_clip(encoder, destination, processor=processor, pooler=pooler,
                            max_shard_size=max_shard_size)


class HFSiglipFormat(HFVisionFormat):
    """`SiglipVisionModel` and `SiglipModel` directories: no class token, a MAP head."""

    name = "hf_siglip"
    family = "SigLIP"
    model_types = ("siglip", "siglip_vision_model")
    marker = "embeddings.patch_embedding.bias"  # CLIP's patch embedding has no bias
    keys = SIGLIP_KEYS
    architecture = SIGLIP_ARCHITECTURE
    defaults = {**SIGLIP_DEFAULTS, "vision_use_head": True}

    def pooler(self, vision: dict[str, Any],
               head: dict[str, torch.Tensor]) -> NativePooler | None:
        """The MAP head (`pooler_output`); None for towers built with `vision_use_head=False`."""
        if not isinstance(vision["vision_use_head"], bool):
            raise ValueError(f"config.json: vision_use_head must be true or false, got "
                             f"{vision['vision_use_head']!r}")
        if not vision["vision_use_head"]:
            return None
        width = vision["hidden_size"]
        options = dict(num_queries=1, heads=vision["num_attention_heads"],
                       mlp_ratio=vision["intermediate_size"] / width,
                       act=activation(vision["hidden_act"]),  # the head's MLP is a block's
                       eps=vision["layer_norm_eps"])
        return NativePooler("attention_pool", width, None, options, head)

    def default_processor(self, image_size: tuple[int, int]) -> ImageProcessor:
        # SiglipImageProcessor: a plain resize to the square, mean and std 0.5.
        return ImageProcessor.for_family("inception", size=image_size, resize_mode="squash",
                                         crop_rounding="floor")


# -- writing ----------------------------------------------------------------------------------

def check_expressible(config: EncoderConfig) -> None:
    """Raises a ValueError naming every field CLIP's architecture cannot express."""
    problems = [f"{field}={getattr(config, field)!r} (CLIP needs {required!r})"
                for field, required in CLIP_ARCHITECTURE.items()
                if getattr(config, field) != required]
    height, width = config.image_size
    if height != width:
        problems.append(f"image_size=({height}, {width}) (CLIP's config holds one side)")
    if problems:
        raise ValueError("a Hugging Face CLIP vision model cannot express this encoder: "
                         + "; ".join(problems))


def projection_of(pooler: nn.Module | None) -> torch.Tensor | None:
    """The projection matrix of a `cls_linear` pooler without bias or activation (CLIP's
    `visual_projection`); None for no pooler or a bare `cls`."""
    # Imported here: converters name poolers by string and otherwise leave that package alone.
    from vlm_vit.poolers.simple import ClassToken, ClassTokenLinear

    if pooler is None or isinstance(pooler, ClassToken):
        return None
    if isinstance(pooler, ClassTokenLinear) and pooler.proj.bias is None and \
            isinstance(pooler.act, nn.Identity):
        return pooler.proj.weight
    raise ValueError(f"a Hugging Face CLIP vision model pools with the class token, optionally "
                     f"projected without bias; it cannot hold a {type(pooler).__name__} "
                     f"pooler ({getattr(pooler, 'pooler_spec', None)})")


def hf_clip_tensors(encoder: VisionEncoder,
                    pooler: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The encoder's weights under `CLIPVisionModelWithProjection`'s names (a pure function).

    Names go under `vision_model.`: transformers 5 reads that layout as well as the bare one,
    and transformers 4 reads only it. A projection adds `visual_projection.weight`.

    Raises:
        ValueError: for an encoder or pooler CLIP cannot express, naming the fields.
    """
    check_expressible(encoder.config)
    projection = projection_of(pooler)
    state = {name: tensor.detach() for name, tensor in encoder.state_dict().items()}
    split_qkv(state, encoder.config.depth)
    drop_batch_axis(state)
    key_map = {VISION_PREFIX + source: target for source, target in CLIP_KEYS.items()}
    tensors = rename(state, invert(key_map), encoder.config.depth, source="the encoder")
    if projection is not None:
        tensors["visual_projection.weight"] = projection.detach()
    return tensors


def preprocessor_config(processor: ImageProcessor) -> dict[str, Any]:
    """`processor` as a `CLIPImageProcessor` config that gives the same pixels.

    Raises:
        ValueError: for a non-square shortest-edge resize, which CLIP's processor cannot do,
            or a shortest-edge resize with `crop_rounding="round"`: transformers floors the
            centre crop's offset, so some images would be cropped one pixel off; or a
            native-resolution processor, which CLIPImageProcessor has no setting for.
    """
    if processor.resize_mode == "native":
        raise ValueError("processor resize_mode 'native' keeps each image's size, which "
                         "CLIPImageProcessor cannot do (it always ends at one size); use "
                         "resize_mode 'shortest_edge' or 'squash'")
    height, width = processor.size
    shortest_edge = processor.resize_mode == "shortest_edge"
    if shortest_edge and height != width:
        raise ValueError(f"processor size {processor.size} with resize_mode 'shortest_edge': "
                         f"CLIPImageProcessor resizes the shortest edge and crops; use a "
                         f"square size or resize_mode 'squash'")
    if shortest_edge and processor.crop_rounding != "floor":
        raise ValueError(f"processor crop_rounding={processor.crop_rounding!r} with resize_mode "
                         f"'shortest_edge': CLIPImageProcessor floors the centre crop's offset, "
                         f"so images that overhang the crop by 3 mod 4 pixels would be cropped "
                         f"one pixel off; use crop_rounding='floor' (vlm-vit convert "
                         f"--crop-rounding floor, dataclasses.replace(processor, "
                         f"crop_rounding='floor'), or \"crop_rounding\": \"floor\" in "
                         f"processor_config.json) or resize_mode 'squash'")
    crop = {"height": height, "width": width}
    codes = {name: code for code, name in PIL_RESAMPLE.items()}
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": height} if shortest_edge else crop,
        "resample": codes[processor.resample],
        "do_center_crop": shortest_edge,
        "crop_size": crop,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(processor.mean),
        "image_std": list(processor.std),
        "do_convert_rgb": True,
    }


def hf_clip_config(encoder: VisionEncoder, projection_dim: int | None = None) -> dict[str, Any]:
    """The `config.json` of a Hugging Face CLIP vision model holding `encoder` (checked with
    `check_expressible` by `hf_clip_tensors`); a projection makes it
    `CLIPVisionModelWithProjection`."""
    config = encoder.config
    architecture = "CLIPVisionModel" if projection_dim is None else "CLIPVisionModelWithProjection"
    return {
        "architectures": [architecture],
        "model_type": "clip_vision_model",
        "hidden_size": config.width,
        "intermediate_size": config.mlp_width,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads,
        "num_channels": config.in_channels,
        "image_size": config.image_size[0],
        "patch_size": config.patch_size,
        "hidden_act": HF_ACTIVATIONS[config.act],
        "layer_norm_eps": config.norm_eps,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "initializer_factor": 1.0,
        "dtype": str(encoder.pos_embed.dtype).removeprefix("torch."),
        **({"projection_dim": projection_dim} if projection_dim is not None else {}),
    }


def write_json(data: dict[str, Any], path: Path) -> None:
    with atomic_write(path, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def save_hf_clip(encoder: VisionEncoder, directory: str | Path, *,
                 processor: ImageProcessor | None = None,
                 pooler: nn.Module | None = None,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Writes `encoder` as a Hugging Face `CLIPVisionModel` directory (no transformers needed).

    Args:
        encoder: a CLIP-shaped encoder (class token, pre-norm, final norm, patch embedding
            without bias, q/k/v with bias, no registers, a square image size).
        directory: created if needed; gets `config.json` and `model.safetensors`.
        processor: also written, as a `CLIPImageProcessor`'s `preprocessor_config.json`.
        pooler: None or a `cls` pooler for `CLIPVisionModel`; a `cls_linear` without bias or
            activation becomes the projection of a `CLIPVisionModelWithProjection`.
        max_shard_size: larger weights are written as transformers' shards and index.

    Returns:
        The directory.

    Raises:
        ValueError: naming every field of the encoder, pooler or processor that CLIP cannot
            express; nothing is written then.
    """
    tensors = hf_clip_tensors(encoder, pooler)
    settings = preprocessor_config(processor) if processor is not None else None
    projection = tensors.get("visual_projection.weight")
    hf_config = hf_clip_config(encoder, None if projection is None else projection.shape[0])
    directory = Path(directory)
    with atomic_directory(directory) as temp:  # every file appears at once
        write_json(hf_config, temp / CONFIG_NAME)
        write_weights(tensors, temp, max_shard_size)
        if settings is not None:
            write_json(settings, temp / PREPROCESSOR_NAME)
    return directory


HF_CLIP = register_format(HFClipFormat())
HF_SIGLIP = register_format(HFSiglipFormat())
