"""timm's AIMv2 towers (`aimv2_{large,huge,1b,3b}_patch14_{224,336,448}`: timm's
`VisionTransformer` with an `embed_norm_layer`; Fini et al. 2025).

The tensors are timm's ViT names and ours (`patch_embed.norm` included: our `patch_norm`);
what they do not show comes from `config.json` (`model_args` over the registration's own
arguments, `ARCHITECTURES`, copied from timm's `vision_transformer.py`):

* RMSNorm (eps 1e-5, the registrations' `partial(RmsNorm, eps=1e-5)`; `norm_eps` in
  config.json overrides it) where the norms have no bias, SwiGLU where the MLP has `fc1_g`,
  SiLU (`act_layer`);
* heads (`num_heads`): not in the tensors: `heads=` when given, else the config's
  (`model_args.num_heads` or the registration's), else `KNOWN_HEADS` when the width, depth
  and MLP width are a registration's, else refused, naming `heads=` (`bare.resolve`). A
  bare state dict takes the registrations' shared arguments (`AIMV2_DEFAULTS`) and the
  square image size its position table holds;
* `proj_bias=False` (every registration): the attention output and the MLP have no bias;
  they get zero biases here (the same function), and `write` drops them again while zero;
* `global_pool="avg"` (every registration): the mean of the patch tokens after the final
  norm, our `mean` pooler; "token" is the `cls` pooler; `fc_norm` and the other pools are
  refused by name.

`write` goes the other way, to what `timm.create_model("local-dir:DIR", pretrained=True)`
builds as an AIMv2 (every size in `model_args`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig
from vlm_vit.convert.bare import resolve
from vlm_vit.convert.base import Checkpoint, Converted, NativePooler, register_format
from vlm_vit.convert.hf_aimv2 import OPTIONAL_BIASES, nonzero, zero_absent_biases
from vlm_vit.convert.hf_writing import detached, mismatches
from vlm_vit.convert.keymap import count_blocks
from vlm_vit.convert.timm import (
    EVA_ATTENTION,
    PATCH_NORM,
    TIMM_FIELDS,
    _fold_positions,
    _grid_tokens,
    _processor,
    check_model_args,
    write_timm_directory,
)
from vlm_vit.io.native import MODEL_TYPE
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
# What every AIMv2 registration sets and a state dict does not show.
AIMV2_DEFAULTS: dict[str, Any] = dict(num_heads=None, img_size=224, act_layer="silu",
                                      global_pool="avg", fc_norm=False, norm_eps=1e-5)
_HEADS = {"large": 8, "huge": 12, "1b": 16, "3b": 24}  # 1024, 1536, 2048, 3072 wide
ARCHITECTURES: dict[str, dict[str, Any]] = {
    f"aimv2_{size}_patch14_{pixels}": dict(num_heads=heads, img_size=pixels)
    for size, heads in _HEADS.items() for pixels in (224, 336, 448)}
# (width, depth, SwiGLU hidden width) -> (heads, the registration), for a bare state dict.
KNOWN_HEADS: dict[tuple[int, int, int], tuple[int, str]] = {
    (width, 24, hidden): (_HEADS[size], f"aimv2_{size}_patch14_224")
    for size, width, hidden in (("large", 1024, 2816), ("huge", 1536, 4096),
                                ("1b", 2048, 5632), ("3b", 3072, 8192))}
POOLS = {"avg": "mean", "token": "cls"}
# What timm's AIMv2 builds from a config file, in EncoderConfig fields; `write` refuses the rest.
WRITE_ARCHITECTURE = dict(norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", act="silu",
                          patch_norm=True, pos_embed="learned", class_token=False,
                          num_register_tokens=0, pre_norm=False, final_norm=True,
                          patch_bias=True, layer_scale_init=None, mlp_norm=False,
                          hybrid_layers=None, rope_theta=None, temporal_patch_size=None,
                          window_size=None)
WRITE_REGISTRATION = "aimv2_large_patch14_224"  # model_args override each of its sizes


def aimv2_settings(checkpoint: Checkpoint, source: object, rules: list[str]) -> dict[str, Any]:
    """`heads=` over `model_args` over the registration's (`ARCHITECTURES`) over AIMv2's
    shared arguments; heads and a bare state dict's image size as the module docstring says.

    Raises:
        ValueError: naming `source`, for `model_args` that is not an object, or heads that
            neither an argument, a config nor the sizes give (`bare.resolve`).
    """
    config, tensors = checkpoint.config, checkpoint.tensors
    model_args = (config or {}).get("model_args", {})
    if not isinstance(model_args, dict):
        raise ValueError(f"{source}: model_args must be a JSON object, got "
                         f"{type(model_args).__name__}")
    name = (config or {}).get("architecture")
    name = name.partition(".")[0] if isinstance(name, str) else ""
    settings = {**AIMV2_DEFAULTS, **ARCHITECTURES.get(name, {}), **model_args}
    if "norm_eps" in (config or {}):
        settings["norm_eps"] = config["norm_eps"]
    patch = tensors["patch_embed.proj.weight"]  # [D, C, P, P]
    if config is None and "pos_embed" in tensors:
        registers = tensors["reg_token"].shape[1] if "reg_token" in tensors else 0
        grid = _grid_tokens(tensors["pos_embed"].shape[1], int("cls_token" in tensors),
                            registers)
        settings["img_size"] = math.isqrt(grid) * patch.shape[2]
        rules.append(f"no config.json: square grid assumed, image size {settings['img_size']}")
    if settings["num_heads"] is None or "heads" in checkpoint.given:
        hidden = tensors.get("blocks.0.mlp.fc1_g.weight", tensors.get("blocks.0.mlp.fc1.weight"))
        proven = {"width": patch.shape[0], "depth": count_blocks(tensors, r"blocks\.(\d+)\."),
                  "mlp_width": None if hidden is None else hidden.shape[0]}
        settings["num_heads"] = resolve(
            "heads", proven, KNOWN_HEADS, checkpoint.given, rules, source=source,
            family="timm AIMv2", recorded_by="timm's config.json beside it with its "
            "architecture (e.g. aimv2_large_patch14_224) or model_args.num_heads")
    return settings


class TimmAimv2Format:
    """timm `VisionTransformer` state dicts with a patch-embedding norm (AIMv2)."""

    name = "timm_aimv2"

    def matches(self, checkpoint: Checkpoint) -> bool:
        native = (checkpoint.config or {}).get("model_type") == MODEL_TYPE
        return not native and checkpoint.has_prefix(PATCH_NORM) and \
            not checkpoint.has_prefix(*EVA_ATTENTION) and \
            {"patch_embed.proj.weight", "blocks.0.attn.qkv.weight"} <= set(checkpoint.tensors)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE if checkpoint.config else checkpoint.path
        rules: list[str] = []
        settings = aimv2_settings(checkpoint, source, rules)
        tensors = checkpoint.tensors
        if settings["fc_norm"] or "fc_norm.weight" in tensors:
            raise ValueError(f"{source}: timm AIMv2 with fc_norm (a norm of the pooled tokens) "
                             "is not a pooler vlm-vit has")
        pool = settings["global_pool"]
        if pool not in POOLS:
            raise ValueError(f"{source}: timm AIMv2 with global_pool={pool!r} is not read; "
                             f"vlm-vit reads {', '.join(map(repr, POOLS))}")
        state = {k: v for k, v in tensors.items() if not k.startswith("head.")}
        rules += ["ignored the classifier head"] if len(state) < len(tensors) else []
        patch = state["patch_embed.proj.weight"]  # [D, C, P, P]
        depth = count_blocks(state, r"blocks\.(\d+)\.")
        check_model_args(settings, {"embed_dim": (patch.shape[0], "patch_embed.proj.weight"),
                                    "depth": (depth, f"blocks.0 to blocks.{depth - 1}"),
                                    "in_chans": (patch.shape[1], "patch_embed.proj.weight")},
                         source)
        norm = "layernorm" if "blocks.0.norm1.bias" in state else "rmsnorm"
        if ("patch_embed.norm.bias" in state) != (norm == "layernorm"):
            raise ValueError(f"{source}: the patch-embedding norm and the blocks' norms differ "
                             "(one has a bias, the other not); vlm-vit's patch_norm is the "
                             "blocks' norm")
        registers = state["reg_token"].shape[1] if "reg_token" in state else 0
        if "pos_embed" in state:
            _fold_positions(state, _grid_tokens(state["pos_embed"].shape[1],
                                                int("cls_token" in state), registers), rules)
        swiglu = "blocks.0.mlp.fc1_g.weight" in state
        try:
            config = EncoderConfig(
                image_size=settings["img_size"], patch_size=patch.shape[2], width=patch.shape[0],
                depth=depth, heads=settings["num_heads"],
                mlp_width=state[f"blocks.0.mlp.{'fc1_g' if swiglu else 'fc1'}.weight"].shape[0],
                in_channels=patch.shape[1], class_token="cls_token" in state,
                num_register_tokens=registers, final_norm="norm.weight" in state,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                patch_bias="patch_embed.proj.bias" in state, act=settings["act_layer"],
                norm_eps=settings["norm_eps"], norm=norm, mlp="swiglu" if swiglu else "mlp",
                patch_norm=True, pos_embed="learned" if "pos_embed" in state else "none")
        except ConfigError as error:
            raise error.located(source, TIMM_FIELDS.get(error.field)) from None
        if added := zero_absent_biases(state, config):
            rules.append(f"zero biases for the Linears timm builds without (proj_bias=False): "
                         f"{', '.join(added)}")
        pooler = NativePooler(POOLS[pool], config.width, None, {}, {})
        return Converted(config=config, state=state, pooler=pooler,
                         processor=_processor(checkpoint.config, config, source), rules=rules,
                         source=checkpoint.path,
                         config_file=CONFIG_FILE if checkpoint.config else "the shapes")

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None) -> None:
        """Writes `model.safetensors` and timm's `config.json` (an AIMv2 registration, every
        size in `model_args`) into `destination`. The pooler is not written, as by the other
        timm writers: timm's AIMv2 pools with the mean of the patch tokens (`global_pool`).

        Raises:
            ValueError: naming every field timm's AIMv2 cannot hold (`WRITE_ARCHITECTURE`);
                nothing is written then.
        """
        config = encoder.config
        problems = mismatches(config, WRITE_ARCHITECTURE, "timm's AIMv2")
        if problems:
            raise ValueError("timm's AIMv2 cannot hold this encoder: " + "; ".join(problems))
        state = detached(encoder)
        proj_bias = bool(nonzero(state, list(OPTIONAL_BIASES), config.depth))
        if not proj_bias:
            state = {k: v for k, v in state.items()
                     if not any(k.endswith(f".{bias}") for bias in OPTIONAL_BIASES)}
        write_timm_directory(destination, WRITE_REGISTRATION,
                             timm_model_args(config, proj_bias), config, state, processor)


def timm_model_args(config: EncoderConfig, proj_bias: bool) -> dict[str, Any]:
    """The AIMv2 registration's arguments for `config`: each size given, and an `mlp_ratio`
    timm turns back into exactly `mlp_width` (`int(width * mlp_ratio)`)."""
    ratio = config.mlp_width / config.width
    if int(config.width * ratio) != config.mlp_width:
        ratio = (config.mlp_width + 0.5) / config.width
    return dict(img_size=list(config.image_size), patch_size=config.patch_size,
                in_chans=config.in_channels, embed_dim=config.width, depth=config.depth,
                num_heads=config.heads, mlp_ratio=ratio, qkv_bias=config.qkv_bias,
                proj_bias=proj_bias, global_pool="avg", num_classes=0)


register_format(TimmAimv2Format())
