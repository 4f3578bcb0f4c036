"""timm's `VisionTransformer` state dicts.

Our parameter names are timm's, so the key map is the identity; what needs care is the
architecture, which a timm state dict only partly records:

- sizes, class token, registers, pre-norm, final norm and biases come from the tensors;
  `model_args` that contradict them (`embed_dim`, `depth`, `in_chans`) are refused, naming
  the field and both values (`check_model_args`): the weights would decide without a word;
- heads cannot be read from shapes: `heads=` when given, else `config.json`'s
  `model_args.num_heads`, else `KNOWN_HEADS` when the width, depth, MLP width and class
  token are those of timm's registrations with one head count, else refused, naming
  `heads=` (`bare.resolve`; a width alone decides nothing: ViT-H/14 is 1280 wide with 16);
- act is exact GELU (timm's default) and eps 1e-6, unless overridden by keyword;
- LayerScale (`blocks.N.ls1.gamma`, DINOv2), SwiGLU (`mlp.fc1_g`, act SiLU), RMSNorm (norms
  without a bias) and the hybrid's ResNet (`patch_embed.backbone.*`, its stages counted from
  the tensors, the patch size its stride) come from the tensors too;
- `no_embed_class` tables (no position for the class token) get a zero class position, and
  tables with entries for register tokens have them folded into the register tokens
  (a constant added to a constant), since our registers carry no position.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import (
    ConfigError,
    EncoderConfig,
    hybrid_stride,
    is_int,
    is_real,
)
from vlm_vit.convert.bare import resolve
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    read_processor,
    register_format,
)
from vlm_vit.convert.keymap import count_blocks, held_stages
from vlm_vit.io.files import atomic_directory, atomic_write, write_safetensors
from vlm_vit.io.native import MODEL_TYPE
from vlm_vit.optional import require
from vlm_vit.processor import ImageProcessor

# Dropped on purpose: a classifier head (not part of the encoder) and its pooled norm.
logger = logging.getLogger(__name__)
IGNORED = ("head.", "fc_norm.")
# timm's Eva (`timm_eva`): q and v biases apart from qkv, or separate q/k/v projections.
EVA_ATTENTION = ("blocks.0.attn.q_bias", "blocks.0.attn.q_proj.")
PATCH_NORM = "patch_embed.norm."  # timm_aimv2 reads these (`embed_norm_layer`)
CONFIG_FILE = "config.json"
# Where timm's config.json gives an EncoderConfig field, for errors.
TIMM_FIELDS = {"heads": "model_args.num_heads", "image_size": "model_args.img_size",
               "act": "model_args.act_layer"}


def timm_model_kwargs(config: EncoderConfig) -> dict[str, Any]:
    """Keyword arguments for `timm.models.vision_transformer.VisionTransformer` that build
    the same architecture without a head (`forward_features` gives our `tokens`).

    Register tokens get entries in timm's position table (zeros on export, see `write`).
    """
    return dict(
        img_size=config.image_size, patch_size=config.patch_size, in_chans=config.in_channels,
        num_classes=0, global_pool="token" if config.class_token else "avg", fc_norm=False,
        embed_dim=config.width, depth=config.depth, num_heads=config.heads,
        mlp_ratio=config.mlp_width / config.width, qkv_bias=config.qkv_bias,
        class_token=config.class_token, reg_tokens=config.num_register_tokens,
        pre_norm=config.pre_norm, final_norm=config.final_norm,
        act_layer=config.act,  # timm knows the same names
        norm_layer=functools.partial(nn.LayerNorm, eps=config.norm_eps),
        init_values=config.layer_scale_init,
    )


# What only code can give timm's VisionTransformer, so a config file cannot: `write` refuses
# these, `build_timm_model` builds them.
CODE_ONLY = dict(norm="layernorm", mlp="mlp", hybrid_layers=None, patch_norm=False)


def _timm_modules(config: EncoderConfig) -> dict[str, Any]:
    """The `VisionTransformer` arguments for RMSNorm, SwiGLU and the hybrid (needs timm)."""
    layers = require("timm.layers", "dev", "a timm twin")
    modules: dict[str, Any] = {}
    if config.norm == "rmsnorm":
        modules["norm_layer"] = functools.partial(layers.RmsNorm, eps=config.norm_eps)
    if config.mlp == "swiglu":
        modules["mlp_layer"] = layers.SwiGLU
    if config.hybrid_layers is not None:
        hybrid = require("timm.models.vision_transformer_hybrid", "dev", "a timm twin")
        backbone = hybrid._resnetv2(config.hybrid_layers, in_chans=config.in_channels)
        modules["embed_layer"] = functools.partial(hybrid.HybridEmbed, backbone=backbone)
        modules["patch_size"] = 1  # on the ResNet's feature map
    return modules


def build_timm_model(config: EncoderConfig, **extra: Any) -> nn.Module:
    """timm's `VisionTransformer` for `config` (needs timm), at random initialisation.

    With registers, load weights exported by `to_timm_state_dict`, which gives them
    position entries.
    """
    vision_transformer = require("timm.models.vision_transformer", "dev", "a timm twin")
    model = vision_transformer.VisionTransformer(
        **{**timm_model_kwargs(config), **_timm_modules(config), **extra})
    proj = model.patch_embed.proj  # timm ties the patch bias to pre_norm; ours is separate
    if not config.patch_bias:
        proj.bias = None
    elif proj.bias is None:
        proj.bias = nn.Parameter(torch.zeros(config.width))
    return model


def to_timm_state_dict(state: dict[str, torch.Tensor], config: EncoderConfig) -> dict:
    """Native weights as timm's: identical, but registers get zero position entries."""
    state = dict(state)
    if config.num_register_tokens and "pos_embed" in state:
        table = state["pos_embed"]
        cls = int(config.class_token)
        zeros = table.new_zeros(1, config.num_register_tokens, table.shape[-1])
        state["pos_embed"] = torch.cat([table[:, :cls], zeros, table[:, cls:]], dim=1)
    return state


def check_model_args(model_args: dict[str, Any], held: dict[str, tuple[int, str]],
                     source: object) -> None:
    """Refuses `model_args` sizes the weights contradict (timm would fail to load them).

    Args:
        model_args: timm's `model_args` (or settings over them).
        held: argument -> (the size the weights hold, the tensor that shows it).
        source: the config file, named in the error.

    Raises:
        ValueError: naming `source`, the argument, both values and the tensor.
    """
    for name, (value, tensor) in held.items():
        given = model_args.get(name, value)
        if not (is_int(given) and given == value):
            raise ValueError(f"{source}: model_args.{name} is {given!r} but the weights hold "
                             f"{value} ({tensor})")


# The head counts of timm 1.0.31's `vision_transformer.py` registrations in this layout, by
# what their tensors prove: (width, depth, MLP width, class token) -> (heads, one of them).
# Left out, so refused: 768 wide, 12 deep, MLP 3072, no class token (vit_base_patch16_gap_224
# has 16 heads, the SigLIP bases 12).
KNOWN_HEADS: dict[tuple[int, int, int, bool], tuple[int, str]] = {
    (192, 12, 768, True): (3, "vit_tiny_patch16_224"),
    (256, 10, 1024, True): (4, "vit_xsmall_patch16_clip_224"),
    (256, 14, 1280, False): (4, "vit_wee_patch16_reg1_gap_256"),
    (320, 14, 1792, False): (5, "vit_little_patch16_reg1_gap_256"),
    (384, 12, 1536, True): (6, "vit_small_patch16_224"),
    (384, 36, 1536, True): (6, "vit_small_patch16_36x1_224"),
    (512, 12, 2048, False): (8, "vit_medium_patch16_gap_256"),
    (512, 12, 2048, True): (8, "vit_medium_patch16_clip_224"),
    (512, 20, 2048, False): (8, "vit_mediumd_patch16_reg4_gap_256"),
    (640, 12, 2560, False): (10, "vit_betwixt_patch16_gap_256"),
    (640, 12, 2560, True): (10, "vit_betwixt_patch32_clip_224"),
    (768, 12, 3072, True): (12, "vit_base_patch16_224"),
    (832, 21, 2176, False): (13, "vit_so150m2_patch16_reg1_gap_256"),
    (896, 12, 3584, True): (14, "vit_base_patch16_plus_240"),
    (896, 18, 2304, False): (14, "vit_so150m_patch16_reg4_gap_256"),
    (1024, 24, 4096, False): (16, "vit_large_patch16_siglip_256"),
    (1024, 24, 4096, True): (16, "vit_large_patch16_224"),
    (1152, 27, 4304, False): (16, "vit_so400m_patch14_siglip_224"),
    (1152, 27, 4304, True): (16, "vit_so400m_patch16_radio_v4"),
    (1280, 32, 5120, False): (16, "vit_huge_patch14_gap_224"),
    (1280, 32, 5120, True): (16, "vit_huge_patch14_224"),
    (1408, 40, 6144, False): (16, "vit_giant_patch16_gap_224"),
    (1408, 40, 6144, True): (16, "vit_giant_patch14_224"),
    (1536, 40, 6144, False): (16, "vit_giantopt_patch16_siglip_256"),
    (1536, 40, 6144, True): (24, "vit_giant_patch16_radio_v3"),
    (1536, 40, 8192, True): (24, "vit_giant_patch14_dinov2"),
    (1664, 48, 8192, True): (16, "vit_gigantic_patch14_224"),
}


def _heads(state: dict[str, torch.Tensor], width: int, depth: int, model_args: dict[str, Any],
           given: dict[str, Any], rules: list[str], source: object) -> Any:
    """`heads=`, else `model_args.num_heads`, else `bare.resolve` over `KNOWN_HEADS`."""
    if "num_heads" in model_args and "heads" not in given:
        return model_args["num_heads"]  # EncoderConfig checks it is an int dividing width
    proven = {"width": width, "depth": depth, "mlp_width": _mlp_width(state),
              "class_token": "cls_token" in state}
    return resolve("heads", proven, KNOWN_HEADS, given, rules, source=source,
                   family="timm ViT",
                   recorded_by="timm's config.json beside it with model_args.num_heads")


def _fold_positions(state: dict[str, torch.Tensor], grid_tokens: int, rules: list[str]) -> None:
    """Moves timm's layout of the position table onto ours (in place)."""
    table = state["pos_embed"]
    in_table = table.shape[1] - grid_tokens  # prefix entries in timm's table
    registers = state["reg_token"].shape[1] if "reg_token" in state else 0
    has_cls = "cls_token" in state
    if in_table == 0 and has_cls:  # no_embed_class: the class token has no position
        state["pos_embed"] = torch.cat([table.new_zeros(1, 1, table.shape[-1]), table], dim=1)
        rules.append("no position for the class token (no_embed_class): a zero entry added")
    elif in_table == int(has_cls) + registers and registers:
        cls = int(has_cls)
        state["reg_token"] = state["reg_token"] + table[:, cls:cls + registers]
        state["pos_embed"] = torch.cat([table[:, :cls], table[:, cls + registers:]], dim=1)
        rules.append("register position entries folded into the register tokens")


class TimmFormat:
    name = "timm"

    def matches(self, checkpoint: Checkpoint) -> bool:
        native = bool(checkpoint.config) and checkpoint.config.get("model_type") == MODEL_TYPE
        # A norm on the patch embeddings (AIMv2's) is `timm_aimv2`'s, as Eva's attention is
        # `timm_eva`'s and a config naming a Perception Encoder (a ViT's tensors) `timm_pe`'s.
        from vlm_vit.convert.timm_pe_registrations import is_timm_pe

        return not native and not checkpoint.has_prefix(*EVA_ATTENTION, PATCH_NORM) and \
            not is_timm_pe(checkpoint) and {
            "patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight"
        } <= set(checkpoint.tensors)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        tensors = checkpoint.tensors
        state = {k: v for k, v in tensors.items() if not k.startswith(IGNORED)}
        dropped = sorted(k for k in tensors if k not in state)
        rules = [f"ignored the classifier tensors {', '.join(dropped)}"] if dropped else []
        config_source = checkpoint.path / CONFIG_FILE if checkpoint.config else checkpoint.path
        model_args = (checkpoint.config or {}).get("model_args", {})
        if not isinstance(model_args, dict):
            raise ValueError(f"{config_source}: model_args must be a JSON object, got "
                             f"{type(model_args).__name__}")
        width, channels, patch_size, hybrid_layers = _patch_embedding(state)
        depth = count_blocks(state, r"blocks\.(\d+)\.")
        stem = "patch_embed.backbone.stem.conv.weight" if hybrid_layers else \
            "patch_embed.proj.weight"
        check_model_args(model_args, {"embed_dim": (width, "patch_embed.proj.weight"),
                                      "depth": (depth, f"blocks.0 to blocks.{depth - 1}"),
                                      "in_chans": (channels, stem)}, config_source)
        registers = state["reg_token"].shape[1] if "reg_token" in state else 0
        grid_tokens = _grid_tokens(state["pos_embed"].shape[1], int("cls_token" in state),
                                   registers)
        _fold_positions(state, grid_tokens, rules)
        image_size = model_args.get("img_size")
        if image_size is None:
            side = math.isqrt(grid_tokens) * patch_size
            image_size = (side, side)
            rules.append(f"square grid assumed: image size {side}")
        try:
            config = EncoderConfig(
                image_size=image_size, patch_size=patch_size, width=width, depth=depth,
                heads=_heads(state, width, depth, model_args, checkpoint.given, rules,
                             config_source),
                mlp_width=_mlp_width(state), in_channels=channels,
                class_token="cls_token" in state, num_register_tokens=registers,
                pre_norm="norm_pre.weight" in state, final_norm="norm.weight" in state,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                patch_bias="patch_embed.proj.bias" in state,
                act=model_args.get("act_layer", "silu" if "blocks.0.mlp.fc1_g.weight" in state
                                   else "gelu"),
                norm_eps=(checkpoint.config or {}).get("norm_eps", 1e-6),
                **_mechanisms(state, model_args, hybrid_layers, rules),
            )
        except ConfigError as error:
            raise error.located(config_source, TIMM_FIELDS.get(error.field)) from None
        pooler = NativePooler("cls" if config.class_token else "mean", width, None, {}, {})
        return Converted(config=config, state=state, pooler=pooler,
                         processor=_processor(checkpoint.config, config, config_source),
                         rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE if checkpoint.config else "the shapes")

    def write(self, encoder, destination: str | Path, *, pooler=None, processor=None) -> None:
        """Writes `model.safetensors` and a timm `config.json` into `destination`, which
        `timm.create_model("local-dir:DIR", pretrained=True)` loads (see `timm_architecture`).

        Raises:
            ValueError: for what timm's factory cannot build from a config file: RMSNorm,
                SwiGLU or the hybrid (`CODE_ONLY`), a Conv3d patch embedding or window
                attention, 2D RoPE or no position table, RADIO's square-crop resize, a norm eps
                other than 1e-5 above 1e-6 (smaller ones are built as 1e-6), or a patch bias
                that is not the opposite of pre-norm (timm ties the two).
        """
        config = encoder.config
        architecture = timm_architecture(config)
        args = {k: v for k, v in timm_model_kwargs(config).items() if k != "norm_layer"}
        args["img_size"] = list(config.image_size)
        write_timm_directory(destination, architecture, args, config,
                             to_timm_state_dict(encoder.state_dict(), config), processor)


def write_timm_directory(destination: str | Path, architecture: str, model_args: dict[str, Any],
                         config: EncoderConfig, state: dict[str, torch.Tensor],
                         processor: ImageProcessor | None = None) -> None:
    """Writes timm's hub layout into `destination`: `config.json` (the registration, its
    `model_args` and `pretrained_cfg`) and `model.safetensors`, both appearing at once."""
    meta = {"architecture": architecture, "num_classes": 0, "model_args": model_args,
            "norm_eps": config.norm_eps}
    # timm reads a config without "pretrained_cfg" as a flat legacy one: always write it.
    meta["pretrained_cfg"] = {"input_size": [config.in_channels, *config.image_size]}
    if processor is not None:
        meta["pretrained_cfg"] = {"mean": list(processor.mean), "std": list(processor.std),
                                  "input_size": [3, *processor.size]}
    with atomic_directory(Path(destination)) as temp:  # both files appear at once
        with atomic_write(temp / "config.json", "w") as handle:
            json.dump(meta, handle, indent=2)
        write_safetensors(state, temp / "model.safetensors")


# timm registrations whose LayerNorm eps a config file cannot set (its `norm_layer` is code):
# every other setting comes from `model_args`, which override a registration's own.
ARCHITECTURE_FOR_EPS = {1e-6: "vit_base_patch16_224", 1e-5: "vit_base_patch16_clip_224"}
# The paper's variants as timm registers them (eps 1e-6, no pre-norm, GELU, 224 pixels).
PAPER_ARCHITECTURES = {(192, 12, 3, 16): "vit_tiny_patch16_224",
                       (384, 12, 6, 16): "vit_small_patch16_224",
                       (768, 12, 12, 16): "vit_base_patch16_224",
                       (768, 12, 12, 32): "vit_base_patch32_224",
                       (1024, 24, 16, 16): "vit_large_patch16_224",
                       (1024, 24, 16, 32): "vit_large_patch32_224",
                       (1280, 32, 16, 14): "vit_huge_patch14_224"}


def timm_architecture(config: EncoderConfig) -> str:
    """The timm model name to write for `config`: the paper variant's own name when it is
    one, else a registration with the same LayerNorm eps, its other settings overridden by
    the written `model_args`.

    Raises:
        ValueError: as `TimmFormat.write`.
    """
    code_only = [f"{field}={getattr(config, field)!r}" for field, plain in CODE_ONLY.items()
                 if getattr(config, field) != plain]
    if code_only:
        raise ValueError(f"timm's factory cannot build {', '.join(code_only)} from a config "
                         "file (its VisionTransformer takes them as modules)")
    video_or_windows = [f"{field}={getattr(config, field)!r}"
                        for field in ("temporal_patch_size", "window_size")
                        if getattr(config, field) is not None]
    if video_or_windows:
        raise ValueError(f"timm's VisionTransformer has neither a Conv3d patch embedding nor "
                         f"window attention; this encoder has {', '.join(video_or_windows)}")
    if config.rope_theta is not None or config.pos_embed != "learned":
        raise ValueError(f"timm's VisionTransformer has no 2D RoPE and always a learned position "
                         f"table; this encoder has rope_theta={config.rope_theta!r}, "
                         f"pos_embed={config.pos_embed!r}")
    if config.pos_resize_mode.endswith("_square_crop"):
        raise ValueError(f"timm's VisionTransformer resizes its table to each grid, not to "
                         f"the square of the longer side; this encoder has pos_resize_mode="
                         f"{config.pos_resize_mode!r} (RADIO's: write timm_naflex)")
    if config.patch_bias == config.pre_norm:
        raise ValueError(f"timm ties the patch embedding's bias to pre-norm (bias = not "
                         f"pre_norm); this encoder has patch_bias={config.patch_bias} with "
                         f"pre_norm={config.pre_norm}")
    eps = config.norm_eps
    if eps not in ARCHITECTURE_FOR_EPS:
        if eps >= 1e-6:
            raise ValueError(f"timm's factory builds LayerNorm eps 1e-6 or 1e-5 from a config "
                             f"file; this encoder has norm_eps={eps}")
        # Hugging Face's ViT port says 1e-12 for weights trained with 1e-6; against unit
        # variances either is negligible, so timm's 1e-6 registration stands in.
        logger.info("timm will build LayerNorm eps 1e-6 for this encoder's %g", eps)
        eps = 1e-6
    paper = PAPER_ARCHITECTURES.get((config.width, config.depth, config.heads,
                                     config.patch_size))
    plain = (eps == 1e-6 and not config.pre_norm and config.act == "gelu"
             and config.mlp_width == 4 * config.width and config.image_size == (224, 224))
    return paper if paper and plain else ARCHITECTURE_FOR_EPS[eps]


def _patch_embedding(state: dict[str, torch.Tensor]) -> tuple[int, int, int, Any]:
    """(width, input channels, patch size, hybrid stages or None) from the tensors: the
    patch convolution `[D, C, P, P]`, or the hybrid's 1x1 projection, stem and stages."""
    patch = state["patch_embed.proj.weight"]  # [D, C, P, P]; the hybrid's [D, 1024, 1, 1]
    if "patch_embed.backbone.stem.conv.weight" not in state:
        return patch.shape[0], patch.shape[1], patch.shape[2], None
    layers = held_stages(state, r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.")
    stem = state["patch_embed.backbone.stem.conv.weight"]  # [64, C, 7, 7]
    return patch.shape[0], stem.shape[1], hybrid_stride(layers) if layers else 0, layers


def _mlp_width(state: dict[str, torch.Tensor]) -> int:
    gate = state.get("blocks.0.mlp.fc1_g.weight")  # SwiGLU's [M, D]
    return (gate if gate is not None else state["blocks.0.mlp.fc1.weight"]).shape[0]


def _mechanisms(state: dict[str, torch.Tensor], model_args: dict[str, Any],
                hybrid_layers: Any, rules: list[str]) -> dict[str, Any]:
    """The EncoderConfig mechanism fields the tensors show."""
    scale = None
    if "blocks.0.ls1.gamma" in state:
        scale = model_args.get("init_values")
        scale = scale if is_real(scale) and scale > 0 else 1e-5
        rules.append(f"LayerScale (blocks.N.ls1.gamma), init {scale:g}")
    norm = "layernorm" if "blocks.0.norm1.bias" in state else "rmsnorm"
    if norm == "rmsnorm":
        rules.append("norms without a bias read as RMSNorm (timm's RmsNorm)")
    return dict(layer_scale_init=scale, norm=norm, hybrid_layers=hybrid_layers,
                mlp="swiglu" if "blocks.0.mlp.fc1_g.weight" in state else "mlp")


def _grid_tokens(table_length: int, cls: int, registers: int) -> int:
    """Patch entries in a timm table, whichever prefix layout it has."""
    for prefix in (cls + registers, cls, 0):
        if math.isqrt(table_length - prefix) ** 2 == table_length - prefix:
            return table_length - prefix
    return table_length - cls - registers  # a non-square grid: the config must say


def _processor(config: dict | None, encoder_config: EncoderConfig,
               source: object = CONFIG_FILE) -> ImageProcessor | None:
    """The preprocessing of timm's `pretrained_cfg` (mean, std, input size), if it has one.

    Raises:
        ValueError: naming `source`, for settings the processor refuses.
    """
    cfg = (config or {}).get("pretrained_cfg")
    if not isinstance(cfg, dict) or "mean" not in cfg or "std" not in cfg:
        return None
    input_size = cfg.get("input_size", [3, *encoder_config.image_size])
    if not (isinstance(input_size, list) and len(input_size) == 3):
        raise ValueError(f"{source}: pretrained_cfg.input_size must be [channels, height, "
                         f"width], got {input_size!r}")
    return read_processor(source, size=tuple(input_size[1:]), mean=cfg["mean"], std=cfg["std"])


register_format(TimmFormat())
