"""timm's DINOv3 ViTs (`vit_{tiny,small,small_plus,base,large,huge_plus,7b}_patch16_dinov3[_qkvb]`:
`timm.models.eva.Eva` with `rope_type="dinov3"`; Siméoni et al. 2025).

The tensors are Eva's: our names but for LayerScale (`gamma_1`, `gamma_2`: our `ls1.gamma`,
`ls2.gamma`) and the q and v biases of the `_qkvb` variants (`attn.q_bias`, `attn.v_bias`: our
fused `qkv.bias` with a zero k bias, the same function, as Eva has none). There is no position
table: 2D RoPE (`RotaryEmbeddingDinoV3`, rotate-half layout) turns q and k of the patch tokens
by their centres normalised to [-1, 1] over each image's own grid, at periods
theta^(4j/head_dim) (`rope_positions="centered"`, `layers.rope_centered`; theta
`rope_temperature`, 100); the class and register tokens are not turned. Its shift, jitter and
rescale augmentations apply in training only.

What the tensors do not show comes from `config.json`: `model_args` over the registration's own
arguments (`ARCHITECTURES`, copied from timm's `eva.py`) over Eva's defaults; a bare state dict
(read with `format="timm_dinov3"`) takes the arguments every registration shares (`_DINOV3`).
Heads are not in the tensors: `heads=` when given, else `model_args.num_heads`, else the
registration's, else `KNOWN_HEADS` when the width, depth and MLP width are a registration's,
else refused, naming `heads=` (`bare.resolve`). The registrations' LayerNorm eps is 1e-5
(`norm_layer`, code a config cannot give; Eva's own default, 1e-6, for an Eva named by
`model_args.rope_type` alone). Pooling is
timm's `global_pool`: "avg" (every registration: the mean of the patch tokens after the final
norm, our `mean`) or "token" (`cls`). What our block cannot hold is refused by name
(`UNSUPPORTED`): a learned position table beside the RoPE, `fc_norm`, interleaved RoPE pairs,
other attention or norm placements, separate q/k/v projections, GluMlp's packed SwiGLU.

`write` goes the other way, to what `timm.create_model("local-dir:DIR", pretrained=True)`
builds (a DINOv3 registration, every size in `model_args`, `dynamic_img_size` on).
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
from vlm_vit.convert.keymap import check_shapes, fuse_qkv, invert, rename
from vlm_vit.convert.timm import TIMM_FIELDS, _processor, check_model_args, write_timm_directory
from vlm_vit.io.native import MODEL_TYPE
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
BLOCK_PATTERN = r"blocks\.(\d+)\."
IGNORED = (r"head\.",)  # a classifier head (global_pool decides the pooled features)
REGISTRATION_EPS, EVA_EPS = 1e-5, 1e-6
# Eva's defaults for what the tensors do not show (timm.models.eva.Eva.__init__).
EVA_DEFAULTS: dict[str, Any] = dict(
    img_size=224, num_heads=None, global_pool="avg", use_fc_norm=None, use_abs_pos_emb=True,
    use_rot_pos_emb=False, rope_type="cat", rope_rotate_half=False, rope_grid_offset=0.0,
    rope_grid_indexing="ij", rope_temperature=10000.0, init_values=None, swiglu_mlp=False,
    swiglu_align_to=0, scale_mlp=False, scale_attn_inner=False, use_post_norm=False,
    qk_norm=False, attn_type="eva", num_kv_heads=None, attn_only_layer_scale=False,
    attn_head_dim=None, qkv_fused=True)
_DINOV3 = dict(patch_size=16, use_abs_pos_emb=False, use_rot_pos_emb=True, rope_type="dinov3",
               rope_rotate_half=True, rope_temperature=100.0, init_values=1e-5,
               num_reg_tokens=4, use_fc_norm=False, dynamic_img_size=True)
# size -> (embed_dim, depth, num_heads, SwiGLU hidden aligned to, mlp_ratio, qkv-bias variants)
_SIZES = {"tiny": (192, 12, 3, 0, 4.0, ("_qkvb",)), "small": (384, 12, 6, 0, 4.0, ("", "_qkvb")),
          "small_plus": (384, 12, 6, 8, 4.0, ("", "_qkvb")),
          "base": (768, 12, 12, 0, 4.0, ("", "_qkvb")),
          "large": (1024, 24, 16, 0, 4.0, ("", "_qkvb")),
          "huge_plus": (1280, 32, 20, 8, 4.0, ("", "_qkvb")), "7b": (4096, 40, 32, 64, 2.0, ("",))}
# The registrations of timm/models/eva.py (timm 1.0.31), by architecture name.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    f"vit_{size}_patch16_dinov3{suffix}": dict(
        _DINOV3, embed_dim=width, depth=depth, num_heads=heads, qkv_bias=bool(suffix),
        swiglu_mlp=bool(align), swiglu_align_to=align, mlp_ratio=ratio)
    for size, (width, depth, heads, align, ratio, suffixes) in _SIZES.items()
    for suffix in suffixes}
# (width, depth, MLP width) -> (heads, a registration), for what no config names.
KNOWN_HEADS: dict[tuple[int, int, int], tuple[int, str]] = {
    (width, depth, int(width * ratio)): (heads, f"vit_{size}_patch16_dinov3{suffixes[0]}")
    for size, (width, depth, heads, _, ratio, suffixes) in _SIZES.items()}
# Settings our block cannot hold: (setting, the value we can, why), refused by name.
UNSUPPORTED = (
    ("use_abs_pos_emb", False, "a learned position table beside DINOv3's RoPE"),
    ("use_rot_pos_emb", True, "no RoPE"),
    ("rope_rotate_half", True, "RoPE on interleaved channel pairs"),
    ("rope_grid_offset", 0.0, "RoPE coordinates offset"),
    ("rope_grid_indexing", "ij", "RoPE with columns before rows"),
    ("use_fc_norm", False, "a norm of the pooled tokens (fc_norm)"),
    ("scale_attn_inner", False, "a norm inside attention"),
    ("scale_mlp", False, "a norm inside the MLP"),
    ("use_post_norm", False, "the post-norm block"),
    ("qk_norm", False, "q/k norms"),
    ("attn_type", "eva", "another attention module"),
    ("num_kv_heads", None, "grouped-query attention"),
    ("attn_only_layer_scale", False, "LayerScale on the attention branch only"),
    ("attn_head_dim", None, "a head width other than width / heads"),
    ("qkv_fused", True, "separate q/k/v projections"),
)
POOLS = {"avg": "mean", "token": "cls"}
KEY_MAP = {
    **{name: name for name in ("cls_token", "reg_token", "norm_pre.weight", "norm_pre.bias",
                               "norm.weight", "norm.bias", "patch_embed.proj.weight",
                               "patch_embed.proj.bias")},
    **{f"blocks.{{}}.{source}": f"blocks.{{}}.{target}" for source, target in {
        **{f"{part}.{kind}": f"{part}.{kind}" for kind in ("weight", "bias")
           for part in ("norm1", "norm2", "attn.proj", "mlp.fc1", "mlp.fc1_g", "mlp.fc1_x",
                        "mlp.fc2")},
        "attn.qkv.weight": "attn.qkv.weight", "attn.q_bias": "attn.q_bias",
        "attn.v_bias": "attn.v_bias", "gamma_1": "ls1.gamma", "gamma_2": "ls2.gamma",
    }.items()},
}


def _architecture(config: dict[str, Any]) -> str:
    """timm's registration name, without a pretrained tag (`vit_small_patch16_dinov3.lvd1689m`)."""
    name = config.get("architecture")
    return name.partition(".")[0] if isinstance(name, str) else ""


def is_timm_dinov3(checkpoint: Checkpoint) -> bool:
    """A timm state dict whose config.json names a DINOv3 registration, or an Eva with
    `model_args.rope_type` "dinov3" (which `timm_eva` leaves to this format)."""
    config = checkpoint.config
    if not config or config.get("model_type") == MODEL_TYPE or \
            "patch_embed.proj.weight" not in checkpoint.tensors:
        return False
    model_args = config.get("model_args")
    rope_type = model_args.get("rope_type") if isinstance(model_args, dict) else None
    return _architecture(config) in ARCHITECTURES or rope_type == "dinov3"


def dinov3_settings(config: dict[str, Any] | None, source: object) -> dict[str, Any]:
    """`model_args` over the registration's over Eva's defaults, with the LayerNorm eps;
    without a config, the arguments every registration shares (`_DINOV3`, eps 1e-5).

    Raises:
        ValueError: naming `source`, for `model_args` that is not an object.
    """
    if config is None:
        return {**EVA_DEFAULTS, **_DINOV3, "norm_eps": REGISTRATION_EPS}
    model_args = config.get("model_args", {})
    if not isinstance(model_args, dict):
        raise ValueError(f"{source}: model_args must be a JSON object, got "
                         f"{type(model_args).__name__}")
    registration = ARCHITECTURES.get(_architecture(config))
    eps = REGISTRATION_EPS if registration is not None else EVA_EPS
    return {**EVA_DEFAULTS, **(registration or {}), **model_args, "norm_eps": eps}


def refuse_unsupported(settings: dict[str, Any], tensors: dict[str, torch.Tensor],
                       source: object) -> None:
    """Raises for what our block cannot hold (see `UNSUPPORTED`), naming the setting.

    Raises:
        ValueError: naming `source`, the setting and what it is.
    """
    found = dict(settings)
    found["use_abs_pos_emb"] = found["use_abs_pos_emb"] or "pos_embed" in tensors
    found["use_fc_norm"] = bool(found["use_fc_norm"]) or "fc_norm.weight" in tensors
    found["qkv_fused"] = found["qkv_fused"] and "blocks.0.attn.q_proj.weight" not in tensors
    for setting, ours, what in UNSUPPORTED:
        if found[setting] != ours:
            raise ValueError(f"{source}: timm DINOv3 with {setting}={found[setting]!r} ({what}) "
                             "is not representable in vlm-vit's block")
    if "blocks.0.mlp.fc1.weight" in tensors and settings["swiglu_mlp"]:
        raise ValueError(f"{source}: timm DINOv3 with swiglu_mlp=True and swiglu_align_to=0 "
                         "(GluMlp's packed SwiGLU) is not read; every DINOv3 registration "
                         "aligns it (separate fc1_g, fc1_x)")
    if settings["global_pool"] not in POOLS:
        raise ValueError(f"{source}: timm DINOv3 with global_pool={settings['global_pool']!r} "
                         f"is not read; vlm-vit reads {', '.join(map(repr, POOLS))}")


def fuse_q_v_biases(state: dict[str, torch.Tensor], depth: int) -> None:
    """Eva's `q_bias` and `v_bias` as our fused `qkv.bias` with a zero k bias (in place)."""
    for i in range(depth):
        attn = f"blocks.{i}.attn."
        if f"{attn}q_bias" in state:
            q_bias, v_bias = state.pop(f"{attn}q_bias"), state.pop(f"{attn}v_bias")
            state[f"{attn}qkv.bias"] = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])


class TimmDinov3Format:
    """timm's DINOv3 `Eva` saved as a state dict with timm's config.json."""

    name = "timm_dinov3"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return is_timm_dinov3(checkpoint)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE if checkpoint.config else checkpoint.path
        settings = dinov3_settings(checkpoint.config, source)
        tensors = checkpoint.tensors
        refuse_unsupported(settings, tensors, source)
        patch = tensors["patch_embed.proj.weight"]  # (D, C, P, P)
        width = patch.shape[0]
        depth = held_blocks(tensors, BLOCK_PATTERN)
        check_model_args(settings, {"embed_dim": (width, "patch_embed.proj.weight"),
                                    "depth": (depth, f"blocks.0 to blocks.{depth - 1}"),
                                    "in_chans": (patch.shape[1], "patch_embed.proj.weight")},
                         source)
        rules: list[str] = [] if checkpoint.config else [
            "no config.json: the arguments every DINOv3 registration shares"]
        heads = settings["num_heads"]
        if heads is None or "heads" in checkpoint.given:
            hidden = tensors.get("blocks.0.mlp.fc1_g.weight",
                                 tensors.get("blocks.0.mlp.fc1.weight"))
            proven = {"width": width, "depth": depth,
                      "mlp_width": None if hidden is None else hidden.shape[0]}
            heads = resolve("heads", proven, KNOWN_HEADS, checkpoint.given, rules,
                            source=source, family="timm DINOv3",
                            recorded_by="timm's config.json beside it with its architecture "
                            "(e.g. vit_small_patch16_dinov3) or model_args.num_heads")
        state = rename(tensors, KEY_MAP, depth, ignore=IGNORED, source=checkpoint.path)
        check_shapes(state, {"blocks.{}.attn.qkv.weight": [3 * width, width],
                             "blocks.{}.attn.q_bias": [width], "blocks.{}.attn.v_bias": [width]},
                     depth, source=checkpoint.path)
        fuse_q_v_biases(state, depth)
        fuse_qkv(state, depth)  # nothing apart to fuse: Eva's qkv is fused
        swiglu = "blocks.0.mlp.fc1_g.weight" in state
        rules += [f"LayerNorm eps {settings['norm_eps']:g} (the "
                 f"{'registration' if settings['norm_eps'] == REGISTRATION_EPS else 'Eva'}'s)",
                 f"RoPE at DINOv3's patch centres in [-1, 1] (temperature "
                 f"{settings['rope_temperature']:g}); its training-only augmentations are not "
                 "applied"]
        scale = None
        if "blocks.0.ls1.gamma" in state:
            scale = settings["init_values"] or 1e-5
        try:
            config = EncoderConfig(
                image_size=settings["img_size"], patch_size=patch.shape[-1], width=width,
                depth=depth, heads=heads,
                mlp_width=state[f"blocks.0.mlp.{'fc1_g' if swiglu else 'fc1'}.weight"].shape[0],
                in_channels=patch.shape[1], class_token="cls_token" in state,
                num_register_tokens=state["reg_token"].shape[1] if "reg_token" in state else 0,
                pre_norm="norm_pre.weight" in state, final_norm="norm.weight" in state,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                patch_bias="patch_embed.proj.bias" in state, act="silu" if swiglu else "gelu",
                norm_eps=settings["norm_eps"], layer_scale_init=scale,
                mlp="swiglu" if swiglu else "mlp", pos_embed="none",
                rope_theta=settings["rope_temperature"], rope_frequencies="shared",
                rope_positions="centered")
        except ConfigError as error:
            raise error.located(source, TIMM_FIELDS.get(error.field)) from None
        pooler = NativePooler(POOLS[settings["global_pool"]], width, None, {}, {})
        return Converted(config=config, state=state, pooler=pooler,
                         processor=_processor(checkpoint.config, config, source), rules=rules,
                         source=checkpoint.path,
                         config_file=CONFIG_FILE if checkpoint.config else "the shapes")

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None) -> None:
        """Writes `model.safetensors` and timm's `config.json` (a DINOv3 registration, every
        size in `model_args`) into `destination`. A `cls` pooler is written as
        `global_pool="token"`, anything else as the registrations' "avg".

        Raises:
            ValueError: naming every field timm's DINOv3 cannot hold (`WRITE_ARCHITECTURE`, an
                activation other than its MLP's, a patch bias not the opposite of pre-norm),
                or a k bias that is not zero; nothing is written then.
        """
        config = encoder.config
        pool = "token" if getattr(pooler, "pooler_spec", {}).get("name") == "cls" else "avg"
        args = dinov3_model_args(config, pool)
        write_timm_directory(destination, write_architecture(config), args, config,
                             dinov3_tensors(encoder), processor)


# What timm's DINOv3 builds from a config file, in EncoderConfig fields; `write` refuses the rest.
WRITE_ARCHITECTURE = dict(norm="layernorm", norm_eps=REGISTRATION_EPS, hybrid_layers=None,
                          pos_embed="none", rope_positions="centered", rope_frequencies="shared",
                          mlp_norm=False, temporal_patch_size=None, window_size=None,
                          patch_norm=False)


def dinov3_model_args(config: EncoderConfig, pool: str) -> dict[str, Any]:
    """The registration's arguments for `config`, each given.

    Raises:
        ValueError: naming every field timm's DINOv3 cannot hold.
    """
    swiglu = config.mlp == "swiglu"
    problems = mismatches(config, WRITE_ARCHITECTURE, "timm's DINOv3")
    if not swiglu and config.act != "gelu":
        problems.append(f"act={config.act!r} (timm's Eva MLP needs 'gelu')")
    if config.patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.patch_bias} with pre_norm={config.pre_norm} "
                        "(timm's Eva ties the patch bias to no pre-norm)")
    if pool == "token" and not config.class_token:
        problems.append("class_token=False with a cls pooler")
    if problems:
        raise ValueError("timm's DINOv3 cannot hold this encoder: " + "; ".join(problems))
    ratio = config.mlp_width / config.width
    if int(config.width * ratio) != config.mlp_width:
        ratio = (config.mlp_width + 0.5) / config.width
    return dict(
        _DINOV3, img_size=list(config.image_size), patch_size=config.patch_size,
        in_chans=config.in_channels, embed_dim=config.width, depth=config.depth,
        num_heads=config.heads, mlp_ratio=ratio, qkv_bias=config.qkv_bias, swiglu_mlp=swiglu,
        swiglu_align_to=1 if swiglu else 0,  # 1: SwiGLU's fc1_g and fc1_x apart, unpadded
        class_token=config.class_token, num_reg_tokens=config.num_register_tokens,
        init_values=config.layer_scale_init, rope_temperature=config.rope_theta,
        use_pre_transformer_norm=config.pre_norm, use_post_transformer_norm=config.final_norm,
        global_pool=pool, num_classes=0)


def write_architecture(config: EncoderConfig) -> str:
    """The registration with `config`'s sizes and switches (qkv bias, SwiGLU), else the first
    with its switches (model_args override each of its sizes)."""
    switches = (config.qkv_bias, config.mlp == "swiglu")
    same = [name for name, args in ARCHITECTURES.items()
            if (args["qkv_bias"], args["swiglu_mlp"]) == switches]
    for name in same:
        args = ARCHITECTURES[name]
        if (args["embed_dim"], args["depth"], args["num_heads"]) == \
                (config.width, config.depth, config.heads):
            return name
    return same[0]


def dinov3_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under Eva's names (a pure function).

    Raises:
        ValueError: naming the blocks whose k bias is not zero.
    """
    config = encoder.config
    state = detached(encoder)
    nonzero = []
    for i in range(config.depth):
        attn = f"blocks.{i}.attn."
        if (bias := state.pop(attn + "qkv.bias", None)) is not None:
            q_bias, k_bias, v_bias = bias.chunk(3)
            nonzero += [f"{attn}qkv.bias"] if k_bias.any() else []
            state[attn + "q_bias"], state[attn + "v_bias"] = q_bias, v_bias
    if nonzero:
        raise ValueError(f"timm's DINOv3 has no k bias, but this encoder's is not zero in "
                         f"{', '.join(nonzero)}")
    return rename(state, invert(KEY_MAP), config.depth, source="the encoder")


register_format(TimmDinov3Format())
