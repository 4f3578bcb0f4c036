"""timm's `Eva` state dicts (`timm.models.eva`): EVA-02 (Fang et al. 2023) and EVA-01.

An EVA-02 block is the pre-norm block with 2D RoPE on q and k, a SwiGLU MLP and optional
LayerScale; its attention has q and v biases and none for k. Converting it:

- the fused `qkv.weight` (or `q_proj`/`k_proj`/`v_proj`) and `q_bias`, `v_bias` become our
  `qkv` with a zero k bias (the same function: timm adds a zero buffer);
- timm's RoPE (`RotaryEmbeddingCat`) turns channel pairs (2i, 2i+1) of each head; ours pairs
  i with i + head_dim/2. Its frequencies are our "shared" layout (head_dim/4 bands
  theta^(-4j/head_dim), the first half of the pairs with the row, the second with the column),
  so permuting the rows of q and k in each head (even channels first, then odd) makes the two
  rotations one; q.k is unchanged because q and k get the same permutation;
- the packed SwiGLU (`GluMlp`, `fc1` of 2 x hidden, the gate first) splits into `fc1_g` and
  `fc1_x`; with `scale_mlp` (eva02 base and large, the EVA-02 CLIP towers) timm's `SwiGLU`
  holds them apart already, and its `mlp.norm` (the block's LayerNorm over the hidden
  activation, before `fc2`) is our `mlp_norm`; `gamma_1`/`gamma_2` are LayerScale's `ls1`/`ls2`;
- `ref_feat_shape` (the 336 and 448 variants: RoPE positions scaled to the pretraining grid,
  t / grid * ref, at every input size) is our `rope_reference_grid`;
- the position table and register tokens are read as in timm's ViT (`convert.timm`);
- heads are not in the tensors: `heads=` when given, else `model_args.num_heads`, else the
  registration's (`ARCHITECTURES`), else `KNOWN_SIZES` when the width, depth and MLP width
  are a released EVA-02's (tiny 192 / 3, small 384 / 6, base 768 / 12, large 1024 / 16),
  else refused, naming `heads=` (`bare.resolve`). The permutation below needs them. A q, k
  or v of another shape than the width needs is refused by name before it is permuted
  (`keymap.check_shapes`).

Most of an Eva's architecture is code, not tensors (RoPE, SwiGLU, heads): it comes from
`config.json`'s `model_args` over the registration's own arguments (`ARCHITECTURES`, copied
from timm's `eva.py`) over `Eva`'s defaults. What our block cannot hold is refused by name:
the norm inside attention (`scale_attn_inner`: the EVA-02 CLIP towers), a norm inside the GELU
MLP (`scale_mlp` without SwiGLU), the post-norm block (eva02 enormous), and the other RoPE
kinds of timm's `Eva` (PE, mixed; DINOv3's is read by `timm_dinov3`).

`write` goes the other way, to what `timm.create_model("local-dir:DIR", pretrained=True)`
builds as an `Eva`: the permutation undone, SwiGLU packed again, the qkv bias split into
`q_bias` and `v_bias` (a k bias that is not zero is refused: Eva has none), and every
argument in `model_args`: `scale_mlp` from `mlp_norm` (SwiGLU then unpacked, as timm holds
it), `ref_feat_shape` from `rope_reference_grid` (null for none: positions are patch indices
at every size, as ours).
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
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_writing import detached, mismatches
from vlm_vit.convert.keymap import check_shapes, fuse_qkv, invert, qkv_shapes, rename
from vlm_vit.convert.timm import (
    EVA_ATTENTION,
    _fold_positions,
    _grid_tokens,
    _processor,
    check_model_args,
    to_timm_state_dict,
    write_timm_directory,
)
from vlm_vit.convert.timm_dinov3 import is_timm_dinov3
from vlm_vit.convert.timm_pe_registrations import is_timm_pe
from vlm_vit.io.native import MODEL_TYPE
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
BLOCK_PATTERN = r"blocks\.(\d+)\."
# Dropped on purpose: a classifier head and the norm of the pooled token.
IGNORED = (r"head\.", r"fc_norm\.")

# `timm.models.eva.Eva`'s defaults for what the tensors do not show; `num_heads` None: not
# given (Eva's default is 12), so `eva_heads` applies the bare-state-dict rule.
EVA_DEFAULTS: dict[str, Any] = dict(
    img_size=224, num_heads=None, swiglu_mlp=False, swiglu_align_to=0, scale_mlp=False,
    scale_attn_inner=False, attn_type="eva", qk_norm=False, num_kv_heads=None,
    attn_only_layer_scale=False, use_rot_pos_emb=False, rope_type="cat", rope_grid_offset=0.0,
    rope_grid_indexing="ij", rope_temperature=10000.0, rope_rotate_half=False,
    use_post_norm=False, ref_feat_shape=None, global_pool="avg", attn_head_dim=None,
)
_EVA02 = dict(patch_size=14, swiglu_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(16, 16))
_EVA02_SCALED = dict(_EVA02, scale_mlp=True)
_EVA02_CLIP = dict(_EVA02_SCALED, scale_attn_inner=True, global_pool="token")
# The registrations of timm/models/eva.py (timm 1.0), by architecture name: the arguments a
# state dict does not record.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "eva_giant_patch14_224": dict(num_heads=16),
    "eva_giant_patch14_336": dict(num_heads=16, img_size=336),
    "eva_giant_patch14_560": dict(num_heads=16, img_size=560),
    "eva_giant_patch14_clip_224": dict(num_heads=16, global_pool="token"),
    "eva02_tiny_patch14_224": dict(_EVA02, num_heads=3),
    "eva02_small_patch14_224": dict(_EVA02, num_heads=6),
    "eva02_base_patch14_224": dict(_EVA02_SCALED, num_heads=12),
    "eva02_large_patch14_224": dict(_EVA02_SCALED, num_heads=16),
    "eva02_tiny_patch14_336": dict(_EVA02, num_heads=3, img_size=336),
    "eva02_small_patch14_336": dict(_EVA02, num_heads=6, img_size=336),
    "eva02_base_patch14_448": dict(_EVA02_SCALED, num_heads=12, img_size=448),
    "eva02_large_patch14_448": dict(_EVA02_SCALED, num_heads=16, img_size=448),
    "eva02_base_patch16_clip_224": dict(_EVA02_CLIP, num_heads=12),
    "eva02_large_patch14_clip_224": dict(_EVA02_CLIP, num_heads=16),
    "eva02_large_patch14_clip_336": dict(_EVA02_CLIP, num_heads=16, img_size=336),
    "eva02_enormous_patch14_clip_224": dict(num_heads=16, use_post_norm=True,
                                            global_pool="token"),
}
# The EVA-02 registrations a bare state dict is read as, by what their tensors prove:
# (width, depth, SwiGLU hidden width) -> the registration. Every Eva registration of timm
# 1.0.31 with q and v biases and these sizes has the registration's heads.
KNOWN_SIZES: dict[tuple[int, int, int], str] = {
    (192, 12, 512): "eva02_tiny_patch14_224", (384, 12, 1024): "eva02_small_patch14_224",
    (768, 12, 2048): "eva02_base_patch14_224", (1024, 24, 2730): "eva02_large_patch14_224"}
KNOWN_HEADS = {sizes: (ARCHITECTURES[name]["num_heads"], name)
               for sizes, name in KNOWN_SIZES.items()}
# Settings our block cannot hold: (setting, the value we can, why), refused by name.
UNSUPPORTED = (
    ("scale_attn_inner", False, "a norm inside attention (`attn.norm`)"),
    ("use_post_norm", False, "the post-norm block"),
    ("qk_norm", False, "q/k norms"),
    ("attn_type", "eva", "another attention module"),
    ("num_kv_heads", None, "grouped-query attention"),
    ("attn_only_layer_scale", False, "LayerScale on the attention branch only"),
    ("attn_head_dim", None, "a head width other than width / heads"),
    ("swiglu_align_to", 0, "SwiGLU widths padded to a multiple"),
    ("rope_type", "cat", "another RoPE (PE, DINOv3, mixed, M-RoPE)"),
    ("rope_grid_offset", 0.0, "RoPE positions offset from 0"),
    ("rope_grid_indexing", "ij", "RoPE with columns before rows"),
)

KEY_MAP = {
    **{name: name for name in ("cls_token", "reg_token", "pos_embed", "norm_pre.weight",
                               "norm_pre.bias", "norm.weight", "norm.bias",
                               "patch_embed.proj.weight", "patch_embed.proj.bias")},
    **{f"blocks.{{}}.{source}": f"blocks.{{}}.{target}" for source, target in {
        **{f"{part}.{kind}": f"{part}.{kind}" for kind in ("weight", "bias")
           for part in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc1_g",
                        "mlp.fc1_x", "mlp.norm", "mlp.fc2")},
        "gamma_1": "ls1.gamma", "gamma_2": "ls2.gamma",
    }.items()},
}


def is_timm_eva(checkpoint: Checkpoint) -> bool:
    """An Eva state dict: q and v biases apart from the qkv projection, or separate q/k/v
    projections under timm's names (`timm.EVA_ATTENTION`, which timm's ViT format leaves to
    this one), or a config.json naming an Eva registration (an Eva without qkv biases has a
    ViT's tensors: `format="timm_eva"` settles it)."""
    config = checkpoint.config or {}
    if config.get("model_type") == MODEL_TYPE or "patch_embed.proj.weight" not in \
            checkpoint.tensors or is_timm_dinov3(checkpoint) or is_timm_pe(checkpoint):
        return False  # DINOv3's RoPE is `timm_dinov3`'s, Perception Encoder's `timm_pe`'s
    return checkpoint.has_prefix(*EVA_ATTENTION) or \
        _architecture(config) in ARCHITECTURES


def _architecture(config: dict[str, Any]) -> str:
    """timm's registration name, without a pretrained tag (`eva02_tiny_patch14_224.mim_in22k`)."""
    name = config.get("architecture")
    return name.partition(".")[0] if isinstance(name, str) else ""


def eva_settings(config: dict[str, Any] | None, source: object,
                 rules: list[str]) -> dict[str, Any]:
    """`Eva`'s arguments: `model_args` over the registration's (`ARCHITECTURES`) over `Eva`'s
    defaults; with no config.json, eva02's (RoPE, SwiGLU) at the model's own grid.

    Raises:
        ValueError: for `model_args` that is not an object, naming `source`.
    """
    if config is None:
        rules.append("no config.json: EVA-02's RoPE (theta 10000) and SwiGLU assumed")
        return {**EVA_DEFAULTS, **_EVA02, "ref_feat_shape": None}
    model_args = config.get("model_args", {})
    if not isinstance(model_args, dict):
        raise ValueError(f"{source}: model_args must be a JSON object, got "
                         f"{type(model_args).__name__}")
    architecture = _architecture(config)
    if architecture not in ARCHITECTURES:
        rules.append(f"architecture {architecture or 'unnamed'!r} is no Eva registration "
                     "vlm-vit knows: Eva's defaults and model_args only")
    return {**EVA_DEFAULTS, **ARCHITECTURES.get(architecture, {}), **model_args}


def eva_heads(settings: dict[str, Any], proven: dict[str, int], given: dict[str, Any],
              source: object, rules: list[str]) -> Any:
    """The head count: `heads=`, else the config's (`model_args.num_heads` or the
    registration's), else `bare.resolve` over `KNOWN_HEADS` with the `proven` width, depth
    and MLP width.

    Raises:
        ValueError: naming `source` and `heads=`, when neither an argument nor a config gives
            the heads and the sizes are no released EVA-02's.
    """
    if settings["num_heads"] is not None and "heads" not in given:
        return settings["num_heads"]  # EncoderConfig checks it is an int dividing width
    return resolve("heads", proven, KNOWN_HEADS, given, rules, source=source,
                   family="timm Eva", recorded_by="timm's config.json beside it with "
                   "model_args.num_heads or its architecture (e.g. eva02_tiny_patch14_224)")


def refuse_unsupported(settings: dict[str, Any], tensors: dict[str, torch.Tensor],
                       source: object) -> None:
    """Raises for what our block cannot hold (see `UNSUPPORTED`), naming the setting.

    Raises:
        ValueError: naming `source`, the setting and what it is.
    """
    found = dict(settings)
    found["scale_attn_inner"] = found["scale_attn_inner"] or "blocks.0.attn.norm.weight" \
        in tensors
    for setting, ours, what in UNSUPPORTED:
        if found[setting] != ours:
            raise ValueError(f"{source}: timm Eva with {setting}={found[setting]!r} ({what}) "
                             "is not representable in vlm-vit's block")
    if has_mlp_norm(settings, tensors) and not found["swiglu_mlp"]:
        raise ValueError(f"{source}: timm Eva with scale_mlp=True and swiglu_mlp=False (a norm "
                         "inside the GELU MLP) is not representable in vlm-vit's block: "
                         "mlp_norm is SwiGLU's")
    if "blocks.0.norm1.weight" in tensors and "blocks.0.norm1.bias" not in tensors:
        raise ValueError(f"{source}: timm Eva with norms without bias (RmsNorm) is not an "
                         "EVA-02 vlm-vit reads")


def has_mlp_norm(settings: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """timm's `scale_mlp`: a norm inside the MLP, by the setting or by its tensor."""
    return bool(settings["scale_mlp"]) or "blocks.0.mlp.norm.weight" in tensors


def rope_reference(settings: dict[str, Any]) -> Any:
    """`ref_feat_shape` for `EncoderConfig.rope_reference_grid` (an int or a pair, which it
    validates), None without RoPE."""
    reference = settings["ref_feat_shape"]
    if not settings["use_rot_pos_emb"] or reference is None:
        return None
    return tuple(reference) if isinstance(reference, list) else reference


def table_grid_tokens(table_length: int, cls: int, registers: int, grid_tokens: int) -> int:
    """Patch entries in Eva's position table: the config's grid when a prefix layout fits it,
    else guessed from the length (`timm._grid_tokens`). The guess alone would take a 6 x 4
    grid with a class token (25 entries) for a 5 x 5 one without."""
    if table_length - grid_tokens in (cls + registers, cls, 0):
        return grid_tokens
    return _grid_tokens(table_length, cls, registers)


def split_packed_swiglu(state: dict[str, torch.Tensor], depth: int) -> None:
    """timm's `GluMlp` (`fc1` `[2 x hidden, D]`, gate first) as `fc1_g` and `fc1_x` (in place)."""
    for i in range(depth):
        for kind in ("weight", "bias"):
            packed = state.pop(f"blocks.{i}.mlp.fc1.{kind}", None)
            if packed is not None:
                gate, value = packed.chunk(2, dim=0)
                state[f"blocks.{i}.mlp.fc1_g.{kind}"] = gate
                state[f"blocks.{i}.mlp.fc1_x.{kind}"] = value


def fuse_attention(state: dict[str, torch.Tensor], depth: int) -> None:
    """Eva's `q_bias`/`v_bias` (or `q_proj`/`k_proj`/`v_proj`) as our fused `qkv` with a zero
    k bias (in place)."""
    for i in range(depth):
        attn = f"blocks.{i}.attn."
        for x in "qkv":
            for kind in ("weight", "bias"):
                if (tensor := state.pop(f"{attn}{x}_proj.{kind}", None)) is not None:
                    state[f"{attn}{x}.{kind}"] = tensor
        q_bias, v_bias = state.pop(f"{attn}q_bias", None), state.pop(f"{attn}v_bias", None)
        if q_bias is None and f"{attn}q.bias" in state:  # separate projections
            q_bias, v_bias = state.pop(f"{attn}q.bias"), state.pop(f"{attn}v.bias")
        if q_bias is not None:
            state[f"{attn}qkv.bias"] = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])
    fuse_qkv(state, depth)


def eva_attention_shapes(width: int) -> dict[str, list[int]]:
    """The shapes of Eva's attention tensors at `width` (`{}` the block index): the fused
    `qkv` or `q_proj`/`k_proj`/`v_proj`, and `q_bias`/`v_bias`."""
    attn = "blocks.{}.attn."
    return {**qkv_shapes(width),
            **{f"{attn}{x}_proj.weight": [width, width] for x in "qkv"},
            **{f"{attn}{name}": [width] for name in ("q_bias", "v_bias", "q_proj.bias",
                                                      "k_proj.bias", "v_proj.bias")}}


def interleaved_to_half(state: dict[str, torch.Tensor], depth: int, heads: int,
                        inverse: bool = False) -> None:
    """Permutes the q and k rows of every head from RoPE's interleaved pairs (2i, 2i+1) to
    our halves (i, i + head_dim/2): even channels first, then odd (in place); `inverse` goes
    back."""
    for i in range(depth):
        for kind in ("weight", "bias"):
            name = f"blocks.{i}.attn.qkv.{kind}"
            if name not in state:
                continue
            qkv = state[name]  # (3 * D, ...)
            width = qkv.shape[0] // 3
            head_dim = width // heads
            order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
            order = torch.argsort(order) if inverse else order
            rows = (torch.arange(heads)[:, None] * head_dim + order).flatten()  # (D,)
            rows = torch.cat([rows, rows + width, torch.arange(2 * width, 3 * width)])
            state[name] = qkv[rows]


class TimmEvaFormat:
    """timm's `Eva` saved as a state dict (timm's hub layout: `model.safetensors` and a
    config.json with its architecture and model_args)."""

    name = "timm_eva"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return is_timm_eva(checkpoint)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE if checkpoint.config else checkpoint.path
        rules: list[str] = []
        settings = eva_settings(checkpoint.config, source, rules)
        tensors = checkpoint.tensors
        depth = held_blocks(tensors, BLOCK_PATTERN)
        check_block_count(settings.get("depth", depth), depth, checkpoint.path, CONFIG_FILE)
        patch = tensors["patch_embed.proj.weight"]  # (D, C, P, P)
        width, patch_size = patch.shape[0], patch.shape[-1]
        image_size = settings["img_size"]
        height, width_px = (image_size, image_size) if isinstance(image_size, int) \
            else tuple(image_size)
        check_model_args(settings, {"embed_dim": (width, "patch_embed.proj.weight")}, source)
        refuse_unsupported(settings, tensors, source)
        state = rename(tensors, {**KEY_MAP, **_attention_names()}, depth, ignore=IGNORED,
                       source=checkpoint.path)
        check_shapes(state, eva_attention_shapes(width), depth, source=checkpoint.path)
        registers = state["reg_token"].shape[1] if "reg_token" in state else 0
        has_table = "pos_embed" in state
        if has_table:
            grid = (height // patch_size) * (width_px // patch_size)  # rows * cols
            grid_tokens = table_grid_tokens(state["pos_embed"].shape[1],
                                            int("cls_token" in state), registers, grid)
            _fold_positions(state, grid_tokens, rules)
        fuse_attention(state, depth)
        if settings["swiglu_mlp"]:
            split_packed_swiglu(state, depth)
        mlp = "swiglu" if settings["swiglu_mlp"] else "mlp"
        hidden = state[f"blocks.0.mlp.{'fc1_g' if mlp == 'swiglu' else 'fc1'}.weight"]
        heads = eva_heads(settings, {"width": width, "depth": depth,
                                     "mlp_width": hidden.shape[0]},
                          checkpoint.given, source, rules)
        rope = settings["use_rot_pos_emb"]
        if rope and not settings["rope_rotate_half"] and isinstance(heads, int) and heads > 0 \
                and width % heads == 0:
            interleaved_to_half(state, depth, heads)
            rules.append("RoPE's interleaved channel pairs permuted to rotate-half order in q "
                         "and k")
        if rope_reference(settings) is not None:
            rules.append(f"RoPE positions scaled to ref_feat_shape {settings['ref_feat_shape']} "
                         "from every image's own grid")
        if "fc_norm.weight" in tensors:
            rules.append("fc_norm (the norm of the pooled token) dropped with the head")
        scale = None
        if "blocks.0.ls1.gamma" in state:
            scale = settings.get("init_values") or 1e-5
            rules.append(f"LayerScale (gamma_1, gamma_2), init {scale:g}")
        try:
            config = EncoderConfig(
                image_size=(height, width_px), patch_size=patch_size, width=width, depth=depth,
                heads=heads, mlp_width=hidden.shape[0], in_channels=patch.shape[1],
                class_token="cls_token" in state, num_register_tokens=registers,
                pre_norm="norm_pre.weight" in state, final_norm="norm.weight" in state,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                patch_bias="patch_embed.proj.bias" in state,
                act="silu" if mlp == "swiglu" else "gelu", norm_eps=1e-6,
                layer_scale_init=scale, mlp=mlp, pos_embed="learned" if has_table else "none",
                rope_theta=settings["rope_temperature"] if rope else None,
                rope_frequencies="shared", mlp_norm=has_mlp_norm(settings, tensors),
                rope_reference_grid=rope_reference(settings))
        except ConfigError as error:
            raise error.located(source) from None
        pool = "cls" if settings["global_pool"] == "token" and config.class_token else "mean"
        return Converted(config=config, state=state,
                         pooler=NativePooler(pool, width, None, {}, {}),
                         processor=_processor(checkpoint.config, config, source), rules=rules,
                         source=checkpoint.path,
                         config_file=CONFIG_FILE if checkpoint.config else "the shapes")

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None) -> None:
        """Writes `model.safetensors` and a timm `config.json` (an Eva registration with every
        argument in `model_args`) into `destination`.

        Raises:
            ValueError: naming every field timm's Eva cannot hold (`WRITE_ARCHITECTURE`, an
                activation other than its MLP's, a patch bias not the opposite of pre-norm),
                or a k bias that is not zero; nothing is written then.
        """
        config = encoder.config
        args = eva_model_args(config)
        architecture = "eva02_tiny_patch14_224" if args["use_rot_pos_emb"] else \
            "eva_giant_patch14_224"
        write_timm_directory(destination, architecture, args, config, eva_tensors(encoder),
                             processor)


def _attention_names() -> dict[str, str]:
    """Eva's attention tensors kept under their own names for `fuse_attention`."""
    names = ["q_bias", "v_bias", *(f"{x}_proj.{kind}" for x in "qkv"
                                   for kind in ("weight", "bias"))]
    return {f"blocks.{{}}.attn.{name}": f"blocks.{{}}.attn.{name}" for name in names}


# What timm's Eva builds from a config file, in EncoderConfig fields; `write` refuses the rest.
WRITE_ARCHITECTURE = dict(norm="layernorm", norm_eps=1e-6, hybrid_layers=None,
                          rope_frequencies="shared", temporal_patch_size=None, window_size=None,
                          patch_norm=False, rope_positions="index")


def eva_model_args(config: EncoderConfig) -> dict[str, Any]:
    """`Eva`'s arguments for `config`, each given (the registration's own are overridden).

    Raises:
        ValueError: naming every field timm's Eva cannot hold.
    """
    swiglu = config.mlp == "swiglu"
    problems = mismatches(config, WRITE_ARCHITECTURE, "timm's Eva")
    if not swiglu and config.act != "gelu":
        problems.append(f"act={config.act!r} (timm's Eva MLP needs 'gelu')")
    if config.pos_embed == "sincos":
        problems.append("pos_embed='sincos' (timm's Eva has a learned table or none)")
    if config.patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.patch_bias} with pre_norm={config.pre_norm} "
                        "(timm's Eva ties the patch bias to no pre-norm)")
    if problems:
        raise ValueError("timm's Eva cannot hold this encoder: " + "; ".join(problems))
    rope = config.rope_theta is not None
    return dict(
        img_size=list(config.image_size), patch_size=config.patch_size,
        in_chans=config.in_channels, embed_dim=config.width, depth=config.depth,
        num_heads=config.heads, mlp_ratio=config.mlp_width / config.width,
        qkv_bias=config.qkv_bias, swiglu_mlp=swiglu, scale_mlp=config.mlp_norm,
        class_token=config.class_token, num_reg_tokens=config.num_register_tokens,
        no_embed_class=False, use_abs_pos_emb=config.pos_embed == "learned",
        use_rot_pos_emb=rope, rope_temperature=config.rope_theta if rope else 10000.0,
        ref_feat_shape=None if config.rope_reference_grid is None
        else list(config.rope_reference_grid), init_values=config.layer_scale_init,
        use_pre_transformer_norm=config.pre_norm, use_post_transformer_norm=config.final_norm,
        use_fc_norm=False, global_pool="token" if config.class_token else "avg",
        num_classes=0)


def eva_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under `Eva`'s names (a pure function).

    Raises:
        ValueError: naming the blocks whose k bias is not zero.
    """
    config = encoder.config
    depth = config.depth
    state = to_timm_state_dict(detached(encoder), config)
    if config.rope_theta is not None:
        interleaved_to_half(state, depth, config.heads, inverse=True)
    nonzero = []
    for i in range(depth):
        attn, mlp = f"blocks.{i}.attn.", f"blocks.{i}.mlp."
        if (bias := state.pop(attn + "qkv.bias", None)) is not None:
            q_bias, k_bias, v_bias = bias.chunk(3)
            nonzero += [f"{attn}qkv.bias"] if k_bias.any() else []
            state[attn + "q_bias"], state[attn + "v_bias"] = q_bias, v_bias
        # timm's Eva packs SwiGLU (GluMlp) unless it has the inner norm (SwiGLU, fc1_g, fc1_x)
        for kind in ("weight", "bias") if config.mlp == "swiglu" and not config.mlp_norm else ():
            gate, value = state.pop(f"{mlp}fc1_g.{kind}"), state.pop(f"{mlp}fc1_x.{kind}")
            state[f"{mlp}fc1.{kind}"] = torch.cat([gate, value])  # GluMlp: the gate first
    if nonzero:
        raise ValueError(f"timm's Eva has no k bias, but this encoder's is not zero in "
                         f"{', '.join(nonzero)}")
    return rename(state, invert({**KEY_MAP, **_attention_names()}), depth,
                  source="the encoder")


register_format(TimmEvaFormat())
