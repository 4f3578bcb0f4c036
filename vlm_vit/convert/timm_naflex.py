"""timm's NaFlexVit towers, NVIDIA's C-RADIO among them (`naflexvit_*_patch16_radio_v3/v4`;
Ranzinger et al. 2024, arXiv 2412.07679, and C-RADIOv4, arXiv 2601.17237).

A NaFlexVit is the paper's pre-norm block behind `embeds`, which timm runs on whole images
or on pre-patchified rows with patch coordinates and a validity mask (its NaFlex path); both
give the same function of an image, which ours is:

- `embeds.proj` is a Linear over each patch flattened (row, column, channel) when
  `patchify_channels_last` (timm's default), else (channel, row, column): our Conv2d's
  weight `[D, C, P, P]` is that Linear's, reordered;
- `embeds.pos_embed` `[1, rows, cols, D]` holds positions for the patches only (the class
  and register tokens get none: a zero class entry in ours, registers carry none anyway);
  it is resized per image as `pos_embed_interp_mode`, `pos_embed_antialias` and
  `pos_embed_align_corners` say, to the grid or, with `pos_embed_ar_preserving` (RADIO),
  to the square of its longer side, the top-left kept: our `pos_resize_mode`
  "bilinear_square_crop" / "bilinear_corners_square_crop" (`layers.pos_resize_square_crop`).
  RADIO's table is 128 x 128 patches, so our `image_size` is 2048 while its processor
  (`pretrained_cfg.input_size`) asks for 512;
- RADIO's summary tokens (one class token per teacher, Ranzinger et al. section 3) are timm's
  class token and its first registers: every prefix token is in our output (`keep_prefix`),
  and the `summary` pooler returns the first `count` of them; timm's own pooled output is
  its `global_pool` ("token": our `cls`; "avg" without a final norm: our `mean`).

What the tensors do not show comes from `config.json`: `model_args` over the registration's
own arguments (`ARCHITECTURES`, copied from timm 1.0.31's `naflexvit.py`) over NaFlexVit's
defaults (`NAFLEX_DEFAULTS`). An architecture that is no registration we know is read only
when `model_args` give the heads; a bare state dict is refused, naming the config it needs
(the resize settings are code, not tensors). What our block cannot hold (`UNSUPPORTED`,
grid-sampled positions, factorized or RoPE positions, an fc_norm, a MAP head) is refused by
name before a model is built.

`write` goes the other way, to what `timm.create_model("local-dir:DIR", pretrained=True)`
builds: a RADIO registration with every size and resize setting in `model_args`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig
from vlm_vit.convert.bare import resolve
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_writing import detached, mismatches
from vlm_vit.convert.keymap import check_shapes, invert, rename
from vlm_vit.convert.timm import (
    TIMM_FIELDS,
    _processor,
    check_model_args,
    write_timm_directory,
)
from vlm_vit.convert.timm_pe import mlp_ratio
from vlm_vit.convert.timm_pe_registrations import _architecture
from vlm_vit.io.native import MODEL_TYPE
from vlm_vit.layers.pos_resize_square_crop import SQUARE_CROP_MODES
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
BLOCK_PATTERN = r"blocks\.(\d+)\."
IGNORED = (r"head\.",)  # a classifier head (global_pool decides the pooled features)
NAFLEX_EPS = 1e-6  # timm's LayerNorm, NaFlexVit's norm_layer unless a config names another
# NaFlexVitCfg's defaults for what the tensors do not show (timm 1.0.31).
NAFLEX_DEFAULTS: dict[str, Any] = dict(
    num_heads=None, mlp_ratio=4.0, scale_mlp_norm=False, num_kv_heads=None, qk_norm=False,
    proj_bias=True, scale_attn_inner_norm=False, init_values=None, pos_embed="learned",
    pos_embed_interp_mode="bicubic", pos_embed_ar_preserving=False, pos_embed_antialias=True,
    pos_embed_align_corners=False, pos_embed_use_grid_sample=False, rope_type="",
    patchify_channels_last=True, final_norm=True, fc_norm=None, global_pool="map",
    pool_include_prefix=False, input_norm_layer=None, embed_norm_layer=None, norm_layer=None,
    act_layer=None, block_fn=None, mlp_layer=None, attn_layer=None, attn_type="standard",
    enable_patch_interpolator=False)
# `_radio_vit_cfg` and the RADIO registrations: name -> (width, depth, heads, MLP ratio,
# registers, LayerScale init, corners aligned).
RADIO_ARGS = dict(patch_size=16, class_token=True, global_pool="token", final_norm=False,
                  pos_embed_interp_mode="bilinear", pos_embed_ar_preserving=True,
                  pos_embed_antialias=False)
_RADIO = {
    "naflexvit_base_patch16_radio_v3": (768, 12, 12, 4.0, 7, 1e-5, True),
    "naflexvit_large_patch16_radio_v3": (1024, 24, 16, 4.0, 7, 1e-5, False),
    "naflexvit_huge_patch16_radio_v3": (1280, 32, 16, 4.0, 7, None, True),
    "naflexvit_giant_patch16_radio_v3": (1536, 40, 24, 4.0, 7, None, False),
    "naflexvit_so400m_patch16_radio_v4": (1152, 27, 16, 4304 / 1152, 9, None, False),
    "naflexvit_huge_patch16_radio_v4": (1280, 32, 16, 4.0, 9, None, False),
}
ARCHITECTURES: dict[str, dict[str, Any]] = {
    name: {**RADIO_ARGS, "embed_dim": width, "depth": depth, "num_heads": heads,
           "mlp_ratio": ratio, "reg_tokens": registers, "init_values": scale,
           "pos_embed_align_corners": corners}
    for name, (width, depth, heads, ratio, registers, scale, corners) in _RADIO.items()}
# Settings our block cannot hold: (setting, the values we can, why), refused by name.
UNSUPPORTED = (
    ("pos_embed", ("learned",), "factorized, RoPE or no positions"),
    ("pos_embed_use_grid_sample", (False,), "positions sampled by grid_sample"),
    ("rope_type", ("",), "RoPE"),
    ("qk_norm", (False,), "q/k norms"),
    ("scale_mlp_norm", (False,), "a norm inside the MLP"),
    ("scale_attn_inner_norm", (False,), "a norm inside attention"),
    ("num_kv_heads", (None,), "grouped-query attention"),
    ("proj_bias", (True,), "attention and MLP projections without a bias"),
    ("input_norm_layer", (None,), "a norm of the raw patches"),
    ("embed_norm_layer", (None,), "a norm of the patch embeddings"),
    ("norm_layer", (None, "layernorm"), "another norm layer"),
    ("act_layer", (None, "gelu"), "another activation"),
    ("block_fn", (None,), "another block"),
    ("mlp_layer", (None,), "another MLP"),
    ("attn_layer", (None,), "another attention"),
    ("attn_type", ("standard",), "Eva's or RoPE attention"),
    ("pool_include_prefix", (False,), "pooling over the prefix tokens too"),
    ("enable_patch_interpolator", (False,), "resized patch embeddings (FlexiViT)"),
)
POOLS = {"token": "cls", "avg": "mean", "": "all", "none": "all"}
# (interp mode, align corners, square of the longer side) -> our pos_resize_mode
RESIZE_MODES = {("bicubic", False, False): "bicubic", ("bilinear", False, False): "bilinear",
                ("bilinear", True, False): "bilinear_corners",
                **{("bilinear", corners, True): mode
                   for mode, corners in SQUARE_CROP_MODES.items()}}
KEY_MAP = {
    **{f"embeds.{name}": name for name in ("cls_token", "reg_token")},
    "embeds.proj.bias": "patch_embed.proj.bias",
    **{name: name for name in ("norm_pre.weight", "norm_pre.bias", "norm.weight",
                               "norm.bias")},
    **{f"blocks.{{}}.{part}.{kind}": f"blocks.{{}}.{part}.{kind}" for kind in ("weight", "bias")
       for part in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")},
    **{f"blocks.{{}}.{scale}.gamma": f"blocks.{{}}.{scale}.gamma" for scale in ("ls1", "ls2")},
}
SPECIAL = ("embeds.proj.weight", "embeds.pos_embed")  # reshaped, not renamed


def naflex_settings(config: dict[str, Any], source: object) -> dict[str, Any]:
    """`model_args` over the registration's over NaFlexVit's defaults.

    Raises:
        ValueError: naming `source`, for `model_args` that is not an object, or an
            architecture we do not know without `model_args.num_heads`.
    """
    model_args = config.get("model_args", {})
    if not isinstance(model_args, dict):
        raise ValueError(f"{source}: model_args must be a JSON object, got "
                         f"{type(model_args).__name__}")
    name = _architecture(config)
    registration = ARCHITECTURES.get(name)
    if registration is None and "num_heads" not in model_args:
        raise ValueError(f"{source}: timm NaFlexVit architecture {name!r} is not one vlm-vit "
                         f"knows ({', '.join(ARCHITECTURES)}); its settings are code, so give "
                         "them all in model_args (num_heads at least)")
    return {**NAFLEX_DEFAULTS, **(registration or {}), **model_args}


def refuse_unsupported(settings: dict[str, Any], tensors: dict[str, torch.Tensor],
                       source: object) -> str:
    """Raises for what our block cannot hold (see `UNSUPPORTED`), naming the setting;
    returns our `pos_resize_mode`.

    Raises:
        ValueError: naming `source`, the setting and what it is.
    """
    for setting, ours, what in UNSUPPORTED:
        if settings[setting] not in ours:
            raise ValueError(f"{source}: timm NaFlexVit with {setting}={settings[setting]!r} "
                             f"({what}) is not representable in vlm-vit's block")
    pool = settings["global_pool"]
    if pool not in POOLS:
        raise ValueError(f"{source}: timm NaFlexVit with global_pool={pool!r} is not read; "
                         f"vlm-vit reads {', '.join(map(repr, POOLS))}")
    fc_norm = settings["fc_norm"]
    if (pool == "avg" if fc_norm is None else bool(fc_norm)) and settings["final_norm"] or \
            "fc_norm.weight" in tensors:
        raise ValueError(f"{source}: timm NaFlexVit with an fc_norm (a norm of the pooled "
                         "tokens) is not representable in vlm-vit's poolers")
    key = (settings["pos_embed_interp_mode"], bool(settings["pos_embed_align_corners"]),
           bool(settings["pos_embed_ar_preserving"]))
    if key not in RESIZE_MODES:
        raise ValueError(f"{source}: timm NaFlexVit resizing positions with "
                         f"pos_embed_interp_mode={key[0]!r}, pos_embed_align_corners={key[1]}, "
                         f"pos_embed_ar_preserving={key[2]} is not representable in vlm-vit; "
                         f"it reads {', '.join(map(str, RESIZE_MODES))}")
    return RESIZE_MODES[key]


def patch_weight(linear: torch.Tensor, channels: int, patch: int, channels_last: bool
                 ) -> torch.Tensor:
    """timm's patch Linear `[D, P*P*C]` as our Conv2d weight `[D, C, P, P]`."""
    if channels_last:
        return linear.reshape(-1, patch, patch, channels).permute(0, 3, 1, 2).contiguous()
    return linear.reshape(-1, channels, patch, patch).contiguous()


class TimmNaflexFormat:
    """timm's NaFlexVit (RADIO's) saved as a state dict with timm's config.json."""

    name = "timm_naflex"

    def matches(self, checkpoint: Checkpoint) -> bool:
        native = bool(checkpoint.config) and checkpoint.config.get("model_type") == MODEL_TYPE
        return not native and {"embeds.proj.weight", "blocks.0.attn.qkv.weight"} <= \
            set(checkpoint.tensors)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        if not checkpoint.config:
            raise ValueError(f"{checkpoint.path}: a bare timm NaFlexVit state dict is not read: "
                             "how it resizes positions is code, not tensors; give timm's "
                             "config.json beside it with its architecture (e.g. "
                             "naflexvit_base_patch16_radio_v3)")
        source = checkpoint.path / CONFIG_FILE
        settings = naflex_settings(checkpoint.config, source)
        tensors = checkpoint.tensors
        mode = refuse_unsupported(settings, tensors, source)
        proj, table = tensors["embeds.proj.weight"], tensors.get("embeds.pos_embed")
        width = proj.shape[0]
        depth = held_blocks(tensors, BLOCK_PATTERN)
        channels = settings.get("in_chans", 3)
        patch = settings.get("patch_size", 16)
        if proj.ndim == 2 and not (isinstance(channels, int) and isinstance(patch, int) and
                                   channels > 0 and patch > 0 and
                                   proj.shape[1] == channels * patch * patch):
            raise ValueError(f"{source}: embeds.proj.weight {list(proj.shape)} is not a Linear "
                             f"over {patch} x {patch} patches of {channels} channels "
                             "(model_args.patch_size, model_args.in_chans)")
        if proj.ndim == 4:
            channels, patch = proj.shape[1], proj.shape[-1]
        check_model_args(settings, {"embed_dim": (width, "embeds.proj.weight"),
                                    "depth": (depth, f"blocks.0 to blocks.{depth - 1}")},
                         source)
        if table is None or table.ndim != 4 or table.shape[0] != 1 or table.shape[-1] != width:
            raise ValueError(f"{source}: embeds.pos_embed must be [1, rows, cols, {width}], "
                             f"got {None if table is None else list(table.shape)}")
        hidden = tensors.get("blocks.0.mlp.fc1.weight", torch.empty(0, 0)).shape[0]
        rules = [f"positions resized as {mode!r}", f"LayerNorm eps {NAFLEX_EPS:g}"]
        heads = settings["num_heads"]
        if "heads" in checkpoint.given:
            heads = resolve("heads", {"width": width, "depth": depth, "mlp_width": hidden}, {},
                            checkpoint.given, rules, source=source, family="timm NaFlexVit",
                            recorded_by="model_args.num_heads")
        state = rename({k: v for k, v in tensors.items() if k not in SPECIAL}, KEY_MAP, depth,
                       ignore=IGNORED, source=checkpoint.path)
        check_shapes(state, {"blocks.{}.attn.qkv.weight": [3 * width, width]}, depth,
                     source=checkpoint.path)
        state["patch_embed.proj.weight"] = proj if proj.ndim == 4 else patch_weight(
            proj, channels, patch, settings["patchify_channels_last"])
        rows, cols = table.shape[1:3]
        patches = table.reshape(1, rows * cols, width)
        if "cls_token" in state:  # timm gives the class token no position
            patches = torch.cat([patches.new_zeros(1, 1, width), patches], dim=1)
            rules.append("no position for the class token: a zero entry added")
        state["pos_embed"] = patches
        scale = None
        if "blocks.0.ls1.gamma" in state:
            scale = settings["init_values"] or 1e-5
        try:
            config = EncoderConfig(
                image_size=(rows * patch, cols * patch), patch_size=patch, width=width,
                depth=depth, heads=heads, mlp_width=hidden, in_channels=channels,
                class_token="cls_token" in state,
                num_register_tokens=state["reg_token"].shape[1] if "reg_token" in state else 0,
                pre_norm="norm_pre.weight" in state, final_norm="norm.weight" in state,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                patch_bias="patch_embed.proj.bias" in state, act="gelu", norm_eps=NAFLEX_EPS,
                layer_scale_init=scale, pos_resize_mode=mode,
                pos_resize_antialias=bool(settings["pos_embed_antialias"]))
        except ConfigError as error:
            raise error.located(source, TIMM_FIELDS.get(error.field)) from None
        name = POOLS[settings["global_pool"]]  # no pooling: every token, the prefix's too
        pooler = NativePooler(name, width, None, {"keep_prefix": True} if name == "all" else {},
                              {})
        return Converted(config=config, state=state, pooler=pooler,
                         processor=_processor(checkpoint.config, config, source), rules=rules,
                         source=checkpoint.path, config_file=CONFIG_FILE)

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None) -> None:
        """Writes `model.safetensors` and timm's `config.json` (a RADIO registration, every
        size and resize setting in `model_args`) into `destination`; a `cls` pooler is
        written as "token", `mean` as "avg", anything else as no pooling.

        Raises:
            ValueError: naming every field timm's NaFlexVit cannot hold
                (`WRITE_ARCHITECTURE`, a resize mode it has not, a class position that is not
                zero, a patch bias not the opposite of pre-norm); nothing is written then.
        """
        config = encoder.config
        name = getattr(pooler, "pooler_spec", {}).get("name")
        pool = {"cls": "token", "mean": "avg"}.get(name, "")
        args = naflex_model_args(config, pool)
        state = naflex_tensors(encoder)
        architecture = "naflexvit_base_patch16_radio_v3" if args["pos_embed_align_corners"] \
            else "naflexvit_large_patch16_radio_v3"
        write_timm_directory(destination, architecture, args, config, state, processor)


# What timm's NaFlexVit builds from a config file, in EncoderConfig fields; `write` refuses
# the rest.
WRITE_ARCHITECTURE = dict(norm="layernorm", norm_eps=NAFLEX_EPS, mlp="mlp", act="gelu",
                          mlp_norm=False, hybrid_layers=None, temporal_patch_size=None,
                          window_size=None, patch_norm=False, pos_embed="learned",
                          rope_theta=None)


def naflex_model_args(config: EncoderConfig, pool: str) -> dict[str, Any]:
    """`model_args` for `config` and its pool, each setting given.

    Raises:
        ValueError: naming every field timm's NaFlexVit cannot hold.
    """
    problems = mismatches(config, WRITE_ARCHITECTURE, "timm's NaFlexVit")
    resize = next((key for key, mode in RESIZE_MODES.items()
                   if mode == config.pos_resize_mode), None)
    if resize is None:
        problems.append(f"pos_resize_mode={config.pos_resize_mode!r} (timm's NaFlexVit "
                        f"resizes as {', '.join(RESIZE_MODES.values())})")
    if config.patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.patch_bias} with pre_norm={config.pre_norm} "
                        "(timm's NaFlexVit ties the patch bias to no pre-norm)")
    if pool == "token" and not config.class_token:
        problems.append("class_token=False with a cls pooler")
    if pool == "avg" and config.final_norm:
        problems.append("a mean pooler with a final norm (timm's NaFlexVit moves it after "
                        "the pooling, as fc_norm)")
    if problems:
        raise ValueError("timm's NaFlexVit cannot hold this encoder: " + "; ".join(problems))
    interp, corners, square = resize
    return dict(
        img_size=list(config.image_size), patch_size=config.patch_size,
        in_chans=config.in_channels, embed_dim=config.width, depth=config.depth,
        num_heads=config.heads, mlp_ratio=mlp_ratio(config.mlp_width, config.width),
        qkv_bias=config.qkv_bias, class_token=config.class_token,
        reg_tokens=config.num_register_tokens, init_values=config.layer_scale_init,
        pos_embed_grid_size=list(config.grid), pos_embed_interp_mode=interp,
        pos_embed_align_corners=corners, pos_embed_ar_preserving=square,
        pos_embed_antialias=config.pos_resize_antialias, pre_norm=config.pre_norm,
        final_norm=config.final_norm, fc_norm=False, global_pool=pool, num_classes=0)


def naflex_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under NaFlexVit's names: the patch Linear (row, column,
    channel), the position table without its class entry.

    Raises:
        ValueError: for a class position that is not zero (NaFlexVit has none).
    """
    config = encoder.config
    state = detached(encoder)
    table = state.pop("pos_embed")
    cls = int(config.class_token)
    if cls and table[:, 0].abs().max() > 0:
        raise ValueError("timm's NaFlexVit cannot hold this encoder: its class token has a "
                         "position (NaFlexVit gives it none)")
    weight = state.pop("patch_embed.proj.weight")  # (D, C, P, P)
    renamed = rename(state, invert(KEY_MAP), config.depth, source="the encoder")
    renamed["embeds.proj.weight"] = weight.permute(0, 2, 3, 1).reshape(config.width, -1)
    renamed["embeds.pos_embed"] = table[:, cls:].reshape(1, *config.grid, config.width)
    return renamed


register_format(TimmNaflexFormat())
