"""open_clip and OpenAI CLIP image towers (`visual.*`), both ways.

OpenAI's CLIP state dicts and open_clip's share one layout: `visual.conv1`,
`visual.class_embedding` `[D]`, `visual.positional_embedding` `[T, D]`, `visual.ln_pre`,
`visual.transformer.resblocks.N.{ln_1, attn.in_proj_*, attn.out_proj, ln_2, mlp.c_fc,
mlp.c_proj}`, `visual.ln_post` and `visual.proj` `[D, E]` (applied as `x @ proj`). A visual-only
state dict (`model.visual.state_dict()`, the same names without `visual.`) reads the same way.
The text tower is ignored.

The architecture comes from the shapes; the rest from `open_clip_config.json` (as on the
Hugging Face hub) when it is there:

- heads: `width // vision_cfg.head_width`; without a config, `heads=` when given, else
  `KNOWN_HEADS` when the width, depth and MLP width are an open_clip model config's (ViT-H/14
  has 16 heads of 80, not 20 of 64), else refused, naming `heads=` (`bare.resolve`).
- activation: `model_cfg.quick_gelu`; without a config, `act=` when given, else refused: no
  shape tells QuickGELU (OpenAI's, MetaCLIP's weights) from GELU (LAION's, DataComp's), as
  every shape was trained with both.
- preprocessing: `preprocess_cfg`; without a config open_clip's defaults (OpenAI mean and std,
  bicubic, shortest edge then centre crop, at the image size).
- pre-norm: whether `ln_pre` is there (open_clip's vision_cfg.no_ln_pre drops it).

The projection `visual.proj` becomes a `cls_linear` pooler without bias, so `load_tower(path)`
computes open_clip's `encode_image`: `ln_post` on the class token, then `@ proj`. Towers that
pool otherwise (attentional pooling, average pooling), timm or ResNet towers, layer scale and
open_clip's custom attention blocks are refused with the feature named.

Writing (`OpenClipFormat.write`) to a directory gives what `open_clip.create_model(
"local-dir:DIR")` builds and loads (`write_directory`). To a `.safetensors` path it gives a
`visual.*` safetensors file that a default open_clip `VisionTransformer` loads; `visual.proj`
is written only for a `cls_linear` pooler without bias or activation, and left out without a
pooler (open_clip then loads with ``strict=False``, or after ``model.visual.proj = None``).
The activation and preprocessing have no place in a state dict and are not written there;
reading the file back applies the rules above.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import PAPER_MECHANISMS, ConfigError, EncoderConfig, is_int
from vlm_vit.convert.bare import resolve
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    read_processor,
    register_format,
)
from vlm_vit.convert.keymap import count_blocks, expand, invert, rename
from vlm_vit.io.files import atomic_directory, write_safetensors
from vlm_vit.model import VisionEncoder
from vlm_vit.optional import require
from vlm_vit.poolers.simple import ClassToken, ClassTokenLinear
from vlm_vit.processor import NORMALIZATION, ImageProcessor

logger = logging.getLogger(__name__)

CONFIG_FILE = "open_clip_config.json"
# Where open_clip's config (or the shapes) gives an EncoderConfig field, for errors.
OPEN_CLIP_FIELDS = {"heads": "width // vision_cfg.head_width",
                    "norm_eps": "vision_cfg.norm_kwargs.eps",
                    "image_size": "vision_cfg.image_size"}
OPENAI_HEAD_WIDTH = 64  # open_clip's CLIPVisionCfg.head_width default; OpenAI's width // 64
NORM_EPS = 1e-5  # torch's LayerNorm default, which open_clip and OpenAI use

KEY_MAP = {
    "conv1.weight": "patch_embed.proj.weight",
    "class_embedding": "cls_token",
    "positional_embedding": "pos_embed",
    "ln_pre.weight": "norm_pre.weight",
    "ln_pre.bias": "norm_pre.bias",
    "transformer.resblocks.{}.ln_1.weight": "blocks.{}.norm1.weight",
    "transformer.resblocks.{}.ln_1.bias": "blocks.{}.norm1.bias",
    "transformer.resblocks.{}.attn.in_proj_weight": "blocks.{}.attn.qkv.weight",  # q, k, v rows
    "transformer.resblocks.{}.attn.in_proj_bias": "blocks.{}.attn.qkv.bias",
    "transformer.resblocks.{}.attn.out_proj.weight": "blocks.{}.attn.proj.weight",
    "transformer.resblocks.{}.attn.out_proj.bias": "blocks.{}.attn.proj.bias",
    "transformer.resblocks.{}.ln_2.weight": "blocks.{}.norm2.weight",
    "transformer.resblocks.{}.ln_2.bias": "blocks.{}.norm2.bias",
    "transformer.resblocks.{}.mlp.c_fc.weight": "blocks.{}.mlp.fc1.weight",
    "transformer.resblocks.{}.mlp.c_fc.bias": "blocks.{}.mlp.fc1.bias",
    "transformer.resblocks.{}.mlp.c_proj.weight": "blocks.{}.mlp.fc2.weight",
    "transformer.resblocks.{}.mlp.c_proj.bias": "blocks.{}.mlp.fc2.bias",
    "ln_post.weight": "norm.weight",
    "ln_post.bias": "norm.bias",
}
PROJECTION = "proj"  # [D, E], becomes the cls_linear pooler's weight (transposed)
REQUIRED = ("conv1.weight", "positional_embedding", "transformer.resblocks.0.mlp.c_fc.weight")
# The head counts of open_clip 3.3's model configs (`model_configs/*.json`, OpenAI's shapes
# among them) by what their tensors prove: (width, depth, MLP width) -> (heads, a config).
KNOWN_HEADS: dict[tuple[int, int, int], tuple[int, str]] = {
    (384, 12, 1536): (6, "ViT-S-16"), (512, 12, 2048): (8, "ViT-M-16"),
    (768, 12, 3072): (12, "ViT-B-16"), (896, 12, 3584): (14, "ViT-B-16-plus"),
    (1024, 24, 4096): (16, "ViT-L-14"), (1280, 32, 5120): (16, "ViT-H-14"),
    (1408, 40, 6144): (16, "ViT-g-14"), (1664, 48, 8192): (16, "ViT-bigG-14"),
    (1792, 56, 15360): (16, "ViT-e-14")}
RECORDED_BY = f"an {CONFIG_FILE} beside it (open_clip's hub layout)"

# Native tensors whose layout differs beyond the name: (to native, to open_clip).
Reshape = Callable[[torch.Tensor], torch.Tensor]
RESHAPES: dict[str, tuple[Reshape, Reshape]] = {
    "cls_token": (lambda t: t.reshape(1, 1, -1), lambda t: t.reshape(-1)),  # [D] <-> [1, 1, D]
    "pos_embed": (lambda t: t.unsqueeze(0), lambda t: t.squeeze(0)),  # [T, D] <-> [1, T, D]
}

# The text tower and the model-level scalars of a full CLIP state dict; OpenAI's TorchScript
# state dicts also hold input_resolution, context_length and vocab_size as tensors.
TEXT_TOWER = (r"text\.", r"transformer\.", r"token_embedding\.", r"positional_embedding$",
              r"ln_final\.", r"text_projection", r"logit_scale$", r"logit_bias$", r"attn_mask$",
              r"input_resolution$", r"context_length$", r"vocab_size$")

# Tensor names (after the `visual.` prefix) of image towers this format cannot express.
UNSUPPORTED_KEYS = {
    r"trunk\.": "a timm image tower (vision_cfg.timm_model_name)",
    r"layer\d\.|attnpool\.": "a ModifiedResNet image tower (the RN50 family), not a ViT",
    r"attn_pool": "attentional pooling (vision_cfg.attentional_pool, CoCa)",
    r"transformer\.resblocks\.\d+\.ls_\d": "layer scale (vision_cfg.ls_init_value)",
    r"transformer\.resblocks\.\d+\.(ln_attn|mlp\.ln)\.": "scale_attn / scale_fc block norms",
    r"transformer\.resblocks\.\d+\.attn\.(ln_q|ln_k|ln_inner|logit_scale|head_scale)":
        "qk_norm / scaled_cosine_attn / scale_attn_inner / scale_heads attention",
}

# vision_cfg fields whose other values compute something our encoder does not, and the values
# it can express. final_ln_after_pool is absent on purpose: with class-token pooling, ln_post
# on the pooled token equals ln_post on every token, then the class token.
SUPPORTED_VISION_CFG: dict[str, tuple[Any, ...]] = {
    "timm_model_name": (None,),
    "attentional_pool": (False,),
    "pool_type": ("tok",),
    "ls_init_value": (None,),
    "act_kwargs": (None, {}),
    "pos_embed_type": ("learnable", "sin_cos_2d"),  # both are a stored table
    "block_type": (None, "default", "custom"),  # custom without the options below is the same
    "qk_norm": (False,),
    "scaled_cosine_attn": (False,),
    "scale_heads": (False,),
    "scale_attn_inner": (False,),
    "scale_attn": (False,),
    "scale_fc": (False,),
}

# open_clip's preprocess_cfg spellings in ours; "random" interpolation is bicubic at eval.
RESIZE_MODES = {"shortest": "shortest_edge", "squash": "squash"}
RESAMPLE = {"bicubic": "bicubic", "bilinear": "bilinear", "random": "bicubic"}

# What a default open_clip VisionTransformer fixes, as EncoderConfig facts, for writing.
WRITABLE = {
    "class_token": True, "num_register_tokens": 0, "pre_norm": True, "final_norm": True,
    "qkv_bias": True, "patch_bias": False, "in_channels": 3, "norm_eps": NORM_EPS,
    "head_width": OPENAI_HEAD_WIDTH, "square_image": True, **PAPER_MECHANISMS,
}


def _prefix(tensors: dict[str, torch.Tensor]) -> str:
    """`visual.` for a whole CLIP state dict, "" for `model.visual.state_dict()`."""
    return "" if "conv1.weight" in tensors and "visual.conv1.weight" not in tensors else "visual."


def _widen_mixed_floats(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One float dtype for all: the widest present (a lossless upcast).

    OpenAI's released state dicts keep convolution, linear and projection weights in float16
    and the rest (LayerNorms, class and position embeddings) in float32.
    """
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) < 2:
        return dict(tensors)
    widest = functools.reduce(torch.promote_types, dtypes)  # float16 with bfloat16: float32
    return {k: t.to(widest) if t.is_floating_point() else t for k, t in tensors.items()}


def _check_vision_cfg(vision_cfg: dict[str, Any], source: object) -> None:
    """Raises naming every vision_cfg setting that this format cannot express."""
    unsupported = [f"{name}={vision_cfg[name]!r}" for name, allowed in SUPPORTED_VISION_CFG.items()
                   if name in vision_cfg and vision_cfg[name] not in allowed]
    if not isinstance(vision_cfg.get("layers", 0), int):
        unsupported.append(f"layers={vision_cfg['layers']!r} (a ModifiedResNet tower)")
    if not isinstance(vision_cfg.get("norm_kwargs") or {}, dict):
        raise ValueError(f"{source}: vision_cfg.norm_kwargs must be a JSON object, got "
                         f"{vision_cfg['norm_kwargs']!r}")
    unknown_norm = sorted(set(vision_cfg.get("norm_kwargs") or {}) - {"eps"})
    if unknown_norm:
        unsupported.append(f"norm_kwargs={vision_cfg['norm_kwargs']!r}")
    if unsupported:
        raise ValueError(f"{source}: open_clip vision_cfg settings vlm-vit's encoder cannot "
                         f"express: {', '.join(unsupported)}")



def _heads_and_act(checkpoint: Checkpoint, model_cfg: dict | bool, vision_cfg: dict,
                   sizes: tuple[int, int, int], rules: list[str], config_source: object
                   ) -> tuple[int, str]:
    """The head count and activation: from the config (`model_cfg`, False without one), else
    by the bare-state-dict rule (`vlm_vit.convert.bare.resolve`: given, or a known shape)."""
    width, depth, mlp_width = sizes
    if model_cfg is False:
        source = checkpoint.path
        heads = resolve("heads", {"width": width, "depth": depth, "mlp_width": mlp_width},
                        KNOWN_HEADS, checkpoint.given, rules, source=source,
                        family="open_clip / OpenAI CLIP", recorded_by=RECORDED_BY)
        act = resolve("act", {}, {}, checkpoint.given, rules, source=source,
                      family="open_clip / OpenAI CLIP", recorded_by=RECORDED_BY,
                      example="act='quick_gelu' for OpenAI's and MetaCLIP's weights, "
                      "act='gelu' for LAION's and DataComp's")
        return heads, act
    head_width = vision_cfg.get("head_width", OPENAI_HEAD_WIDTH)
    quick_gelu = model_cfg.get("quick_gelu", False)
    if not (is_int(head_width) and head_width > 0) or not isinstance(quick_gelu, bool):
        raise ValueError(f"{config_source}: vision_cfg.head_width must be a positive int "
                         f"and quick_gelu true or false, got {head_width!r} and {quick_gelu!r}")
    # open_clip leaves quick_gelu out of configs trained with GELU.
    return width // head_width, "quick_gelu" if quick_gelu else "gelu"

def _grid(positions: int, vision_cfg: dict[str, Any], patch: int, source: object) -> tuple:
    """The patch grid: from vision_cfg.image_size when given, else the square T - 1 = g^2."""
    size = vision_cfg.get("image_size")
    if size is not None:
        pair = [size, size] if is_int(size) else size
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(s) and s > 0
                                                                  for s in pair)):
            raise ValueError(f"{source}: vision_cfg.image_size must be a positive int or a "
                             f"[height, width] pair of them, got {size!r}")
        height, width = pair
        grid = (height // patch, width // patch)
    else:
        side = round((positions - 1) ** 0.5)
        grid = (side, side)
    if grid[0] * grid[1] != positions - 1:
        raise ValueError(f"{source}: positional_embedding has {positions} rows, not 1 + a "
                         f"{grid[0]}x{grid[1]} grid; a non-square table needs an "
                         f"{CONFIG_FILE} with vision_cfg.image_size beside the weights")
    return grid


def _processor(preprocess_cfg: dict[str, Any] | None, image_size: tuple[int, int],
               rules: list[str], source: object = CONFIG_FILE) -> ImageProcessor | None:
    """open_clip's eval preprocessing in our terms (its defaults where the config is silent).

    Raises:
        ValueError: naming `source`, for settings the processor refuses.
    """
    if not isinstance(preprocess_cfg or {}, dict):
        raise ValueError(f"{source}: preprocess_cfg must be a JSON object, got "
                         f"{preprocess_cfg!r}")
    settings = {"mean": NORMALIZATION["clip"][0], "std": NORMALIZATION["clip"][1],
                "interpolation": "bicubic", "resize_mode": "shortest", "size": image_size,
                **{k: v for k, v in (preprocess_cfg or {}).items() if v is not None}}
    if not isinstance(settings["resize_mode"], str) or settings["resize_mode"] not in RESIZE_MODES \
            or not isinstance(settings["interpolation"], str) \
            or settings["interpolation"] not in RESAMPLE:
        rules.append(f"preprocess_cfg resize_mode={settings['resize_mode']!r}, interpolation="
                     f"{settings['interpolation']!r} has no vlm-vit equivalent: no processor")
        return None
    mean, std = settings["mean"], settings["std"]
    return read_processor(
        source,
        size=settings["size"], resize_mode=RESIZE_MODES[settings["resize_mode"]],
        resample=RESAMPLE[settings["interpolation"]],
        mean=mean if isinstance(mean, (list, tuple)) else (mean,) * 3,  # open_clip allows one
        std=std if isinstance(std, (list, tuple)) else (std,) * 3,
    )


def _projection_of(pooler: nn.Module | None, width: int) -> dict[str, torch.Tensor]:
    """`{"proj": [D, E]}` from a cls_linear pooler without bias or activation; {} for None
    or a bare `cls` pooler (the final-norm class token, which is what open_clip returns
    without a projection: a projection-less Hugging Face CLIP reads as that)."""
    if pooler is None or isinstance(pooler, ClassToken):
        return {}
    name = getattr(pooler, "pooler_spec", {}).get("name", type(pooler).__name__)
    if not (isinstance(pooler, ClassTokenLinear) and pooler.proj.bias is None
            and isinstance(pooler.act, nn.Identity) and pooler.in_dim == width):
        raise ValueError(f"open_clip's image projection is a bias-free linear map of the class "
                         f"token (width {width}); the pooler {name!r} is not one (write it "
                         f"without a pooler, or with cls_linear, bias=False, act=None)")
    return {PROJECTION: pooler.proj.weight.detach().T.contiguous()}


class OpenClipFormat:
    """open_clip / OpenAI CLIP state dicts (see the module docstring)."""

    name = "open_clip"

    def matches(self, checkpoint: Checkpoint) -> bool:
        """A CLIP state dict with `visual.*` tensors, or a visual-only one (by its keys)."""
        keys = checkpoint.tensors
        clip_model = "logit_scale" in keys and checkpoint.has_prefix("visual.")
        return ("visual.conv1.weight" in keys or clip_model
                or {"conv1.weight", "class_embedding", "positional_embedding"} <= keys.keys())

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        """The image tower in native terms, `visual.proj` as its pooler.

        Raises:
            ValueError: naming the open_clip feature (by tensor name or vision_cfg setting)
                that the encoder cannot express, or listing tensors that are neither the
                image tower nor the text tower.
        """
        source = checkpoint.path
        prefix = _prefix(checkpoint.tensors)
        visual = {k.removeprefix(prefix): t for k, t in checkpoint.tensors.items()
                  if k.startswith(prefix)}
        others = {k: t for k, t in checkpoint.tensors.items() if not k.startswith(prefix)}
        found = sorted({feature for pattern, feature in UNSUPPORTED_KEYS.items()
                        for key in visual if re.match(pattern, key)})
        if found:
            raise ValueError(f"{source}: this open_clip image tower has {'; '.join(found)}, "
                             "which vlm-vit's encoder cannot express")
        missing = [prefix + name for name in REQUIRED if name not in visual]
        if missing:
            raise ValueError(f"{source}: not an open_clip ViT image tower, it lacks "
                             f"{', '.join(missing)}")
        settings = checkpoint.files.get(CONFIG_FILE)
        config_source = source if settings is None else source / CONFIG_FILE
        model_cfg = settings.get("model_cfg", settings) if settings is not None else {}
        vision_cfg = model_cfg.get("vision_cfg", {}) if isinstance(model_cfg, dict) else None
        if not isinstance(vision_cfg, dict):
            raise ValueError(f"{config_source}: model_cfg and its vision_cfg must be JSON "
                             f"objects")
        _check_vision_cfg(vision_cfg, config_source)
        width, channels, patch, patch_cols = visual["conv1.weight"].shape  # [D, C, P, P]
        depth = count_blocks(visual, r"transformer\.resblocks\.(\d+)\.")
        mlp_width = visual["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
        rules: list[str] = []
        heads, act = _heads_and_act(checkpoint, settings is not None and model_cfg,
                                    vision_cfg, (width, depth, mlp_width), rules, config_source)
        if patch != patch_cols:
            raise ValueError(f"{source}: non-square patches {patch}x{patch_cols} are not supported")
        grid = _grid(visual["positional_embedding"].shape[0], vision_cfg, patch, config_source)
        try:
            config = EncoderConfig(
                image_size=(grid[0] * patch, grid[1] * patch), patch_size=patch, width=width,
                depth=depth, heads=heads, mlp_width=mlp_width,
                in_channels=channels, class_token=True, pre_norm="ln_pre.weight" in visual,
                final_norm=True, act=act,
                norm_eps=(vision_cfg.get("norm_kwargs") or {}).get("eps", NORM_EPS),
                qkv_bias=True, patch_bias=False,
            )
        except ConfigError as error:
            raise error.located(config_source, OPEN_CLIP_FIELDS.get(error.field)) from None
        rules += [] if settings is not None else [
            f"no {CONFIG_FILE}: preprocessing is open_clip's default (OpenAI mean/std, "
            "bicubic, shortest edge + centre crop)"]

        rename(others, {}, 0, ignore=TEXT_TOWER, source=source)  # only the text tower is left
        visual = _widen_mixed_floats(visual)
        projection = visual.pop(PROJECTION, None)
        state = rename(visual, KEY_MAP, config.depth, source=f"the image tower ({prefix}*) "
                       f"of {source}")
        state.update({name: to_native(state[name]) for name, (to_native, _) in RESHAPES.items()
                      if name in state})
        pooler = None if projection is None else NativePooler(
            "cls_linear", in_dim=width, out_dim=projection.shape[1], options={"bias": False},
            weights={"proj.weight": projection.T.contiguous()})  # x @ proj = Linear(proj.T)
        preprocess_cfg = settings.get("preprocess_cfg") if settings is not None else None
        processor = _processor(preprocess_cfg, config.image_size, rules, config_source)
        return Converted(config=config, state=state, pooler=pooler, processor=processor,
                         rules=rules, source=source,
                         config_file=CONFIG_FILE if settings is not None else "the shapes")

    def from_native(self, encoder: VisionEncoder,
                    pooler: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The encoder (and pooler) as an open_clip `visual.*` state dict; a pure function.

        Args:
            encoder: the encoder to write.
            pooler: a `cls_linear` pooler without bias or activation, written as
                `visual.proj`; None leaves `visual.proj` out.

        Raises:
            ValueError: naming every setting a default open_clip `VisionTransformer` cannot
                load (no class token, registers, no pre-norm, patch bias, head width other
                than 64, non-square image size, no final norm, no qkv bias, eps other than
                1e-5), or a pooler that is not such a projection.
        """
        config = encoder.config
        facts = {**config.to_dict(), "head_width": config.width // config.heads,
                 "square_image": config.image_size[0] == config.image_size[1]}
        problems = [f"{name}={facts[name]!r} (open_clip needs {needed!r})"
                    for name, needed in WRITABLE.items() if facts[name] != needed]
        if problems:
            raise ValueError("cannot write this encoder as an open_clip state dict: "
                             + "; ".join(problems))
        state = {name: tensor.detach() for name, tensor in encoder.state_dict().items()}
        state.update({name: to_open_clip(state[name])
                      for name, (_, to_open_clip) in RESHAPES.items()})
        names = invert(expand(KEY_MAP, config.depth))
        written = {names[k]: t for k, t in state.items()} | _projection_of(pooler, config.width)
        return {"visual." + name: tensor for name, tensor in written.items()}

    def write(self, encoder: VisionEncoder, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None) -> Path:
        """Writes `from_native(encoder, pooler)` as a safetensors file, atomically; or, for a
        destination without a suffix, a directory open_clip's own factory loads
        (`write_directory`).

        Args:
            encoder: the encoder to write.
            destination: a file path ending in `.safetensors` (its folder is created), or a
                directory.
            pooler: as in `from_native`.
            processor: written in the directory form; a bare state dict has no place for
                preprocessing, so there it is not written (logged).

        Returns:
            The written file or directory.

        Raises:
            ValueError: for a destination with another suffix, and as `from_native`.
        """
        destination = Path(destination)
        if not destination.suffix:
            return self.write_directory(encoder, destination, pooler=pooler, processor=processor)
        if destination.suffix != ".safetensors":
            raise ValueError(f"open_clip is written as one .safetensors file or a directory; "
                             f"got {destination}")
        tensors = self.from_native(encoder, pooler)
        destination.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(tensors, destination)
        if processor is not None:
            logger.info("%s: an open_clip state dict has no place for preprocessing; not "
                        "written (%s)", destination, processor)
        return destination


    def write_directory(self, encoder: VisionEncoder, directory: str | Path, *,
                        pooler: nn.Module | None = None,
                        processor: ImageProcessor | None = None) -> Path:
        """A directory `open_clip.create_model("local-dir:DIR")` builds and loads strictly:
        `open_clip_config.json` (the vision config, `quick_gelu`, the preprocessing) and
        `open_clip_model.safetensors`, a whole CLIP whose text tower is a one-block
        placeholder at open_clip's own initialisation (open_clip builds both towers; only
        `encode_image` means anything). Without a projection, `visual.proj` is the identity,
        so `encode_image` is the final-norm class token.

        Raises:
            ValueError: as `from_native`, or for an activation open_clip does not build.
            ImportError: without open_clip (the `clip` extra).
        """
        config = encoder.config
        if config.act not in ("gelu", "quick_gelu"):
            raise ValueError(f"open_clip builds GELU or QuickGELU towers; this encoder has "
                             f"act={config.act!r}")
        visual = self.from_native(encoder, pooler)
        if "visual." + PROJECTION not in visual:
            visual["visual." + PROJECTION] = torch.eye(config.width)
        model_cfg = {
            "embed_dim": visual["visual." + PROJECTION].shape[1],
            "quick_gelu": config.act == "quick_gelu",
            "vision_cfg": {"image_size": config.image_size[0], "layers": config.depth,
                           "width": config.width, "head_width": config.width // config.heads,
                           "patch_size": config.patch_size,
                           "mlp_ratio": config.mlp_width / config.width},
            "text_cfg": PLACEHOLDER_TEXT_CFG,
        }
        model_module = require("open_clip.model", "clip", "writing an open_clip directory")
        with torch.random.fork_rng():  # the placeholder's initialisation draws no user RNG
            torch.manual_seed(0)
            clip = model_module.CLIP(model_cfg["embed_dim"], quick_gelu=model_cfg["quick_gelu"],
                                     vision_cfg=model_module.CLIPVisionCfg(
                                         **model_cfg["vision_cfg"]),
                                     text_cfg=model_module.CLIPTextCfg(**PLACEHOLDER_TEXT_CFG))
        clip.visual.load_state_dict({k.removeprefix("visual."): v for k, v in visual.items()})
        config_json = {"model_cfg": model_cfg, "preprocess_cfg": (
            _preprocess_cfg(processor) if processor is not None else {})}
        with atomic_directory(directory) as temp:
            write_safetensors({k: v.detach().contiguous() for k, v in clip.state_dict().items()},
                              temp / OPEN_CLIP_WEIGHTS)
            (temp / CONFIG_FILE).write_text(json.dumps(config_json, indent=2))
        return Path(directory)


# open_clip always builds a text tower; the smallest it accepts stands in for one.
PLACEHOLDER_TEXT_CFG = {"context_length": 2, "vocab_size": 2, "width": 64, "heads": 1,
                        "layers": 1}
OPEN_CLIP_WEIGHTS = "open_clip_model.safetensors"


def _preprocess_cfg(processor: ImageProcessor) -> dict[str, Any]:
    """open_clip's `preprocess_cfg` for a processor (its PreprocessCfg fields)."""
    return {"size": list(processor.size), "mean": list(processor.mean),
            "std": list(processor.std), "interpolation": processor.resample,
            "resize_mode": "squash" if processor.resize_mode == "squash" else "shortest"}


register_format(OpenClipFormat())
