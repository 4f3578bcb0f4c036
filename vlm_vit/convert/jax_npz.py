"""Google's JAX `.npz` checkpoints: the paper's code (google-research/vision_transformer) and
big_vision.

Layouts read (told apart by their keys, never the file name):

* the paper's: `embedding/kernel`, `cls`, `Transformer/posembed_input/pos_embedding`,
  `Transformer/encoderblock_N/{LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2,
  MlpBlock_3}`, `Transformer/encoder_norm`, optional `pre_logits` and `head`;
* big_vision's: the same under `params/` with `pos_embedding` at the top (added before the
  class token is prepended, so it has no class entry), blocks named `LayerNorm_0,
  MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0`, scanned blocks stacked along a
  leading depth axis under `Transformer/encoderblock/`, and a `MAPHead_0`;
* an `opt/target/` prefix (checkpoints saved with a flax optimizer), and `params/img/` (the
  image tower of a two-tower model; the other tower is dropped).

What the file cannot tell is fixed by the Google code, and recorded in `Converted.rules`:

* act "gelu_tanh": both codebases call flax's `nn.gelu`, whose default is the tanh
  approximation;
* norm_eps 1e-6: flax's `nn.LayerNorm` default;
* position tables resize bilinearly: both codebases use `scipy.ndimage.zoom(order=1)`.
  We resample with half-pixel centres and no antialiasing (what timm does when it loads
  these files); zoom aligns the corners, which `F.interpolate` offers but the config does not;
* preprocessing: a squash resize to the square training size, bilinear, mean and std 0.5
  (pixels in [-1, 1]);
* the hybrid (`R50+ViT-B_16.npz`, paper section 3.1): the ResNet's `conv_root`, `gn_root` and
  `block{S}/unit{U}/{conv1..3, gn1..3, conv_proj, gn_proj}` become `patch_embed.backbone.*`
  (stages counted from the names), `embedding` its 1x1 projection; the patch size is the
  ResNet's stride. Weights are standardised as timm's port does (eps 1e-8 under the square
  root; the Google code divides by std + 1e-5, a relative difference of 1e-5 / std);
* pooling: a MAP head where there is one (`attention_pool`), else the class token through
  `pre_logits` (Dense + tanh, `cls_linear`) where there is one, else the class token, else
  (no class token) the mean of the tokens, big_vision's default `gap`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from vlm_vit.config import EncoderConfig, hybrid_stride
from vlm_vit.convert.base import Checkpoint, Converted, NativePooler, register_format
from vlm_vit.convert.keymap import count_blocks, fuse_qkv, held_stages, rename
from vlm_vit.processor import NORMALIZATION, ImageProcessor

# Longest first: `params/img/` must win over `params/`.
PREFIXES = ("opt/target/", "params/img/", "params/", "")
SCANNED = "Transformer/encoderblock/"
BLOCK = "Transformer/encoderblock_{}/"

# Flax module -> native module; the block's submodules are numbered differently in the
# paper's code (MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3) and big_vision's.
_MODULES = {
    "embedding": "patch_embed.proj",
    "Transformer/encoder_norm": "norm",
    BLOCK + "LayerNorm_0": "blocks.{}.norm1",
    **{BLOCK + f"MultiHeadDotProductAttention_{n}/{source}": f"blocks.{{}}.attn.{target}"
       for n in (0, 1)
       for source, target in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "proj"))},
    **{BLOCK + f"LayerNorm_{n}": "blocks.{}.norm2" for n in (1, 2)},
    **{BLOCK + f"MlpBlock_{n}/Dense_{d}": f"blocks.{{}}.mlp.fc{d + 1}"
       for n in (0, 3) for d in (0, 1)},
}
KEY_MAP = {
    "cls": "cls_token",
    "Transformer/posembed_input/pos_embedding": "pos_embed",  # the paper's code
    "Transformer/pos_embedding": "pos_embed",  # big_vision before 2022
    "pos_embedding": "pos_embed",  # big_vision
    **{f"{source}/{flax}": f"{target}.{torch_name}"
       for source, target in _MODULES.items()
       for flax, torch_name in (("kernel", "weight"), ("scale", "weight"), ("bias", "bias"))},
}
# The hybrid's ResNet (vit_jax's models_resnet): unit module -> native module, per stage S and
# unit U (both counted from 1 in the file, from 0 here).
_HYBRID_UNIT = {"conv1": "conv1", "conv2": "conv2", "conv3": "conv3", "gn1": "norm1",
                "gn2": "norm2", "gn3": "norm3", "conv_proj": "downsample.conv",
                "gn_proj": "downsample.norm"}
_HYBRID_STEM = {"conv_root/kernel": "stem.conv.weight", "gn_root/scale": "stem.norm.weight",
                "gn_root/bias": "stem.norm.bias"}
HYBRID_UNIT_PATTERN = r"block(\d+)/unit(\d+)/"


def hybrid_key_map(layers: tuple[int, ...]) -> dict[str, str]:
    """The hybrid ResNet's names for `layers` blocks per stage (exact names: a unit has two
    indices, which the `{}` of a block key map does not cover)."""
    backbone = "patch_embed.backbone."
    names = {flax: backbone + ours for flax, ours in _HYBRID_STEM.items()}
    for stage, depth in enumerate(layers):
        for unit in range(depth):
            for module, ours in _HYBRID_UNIT.items():
                for flax, torch_name in (("kernel", "weight"), ("scale", "weight"),
                                         ("bias", "bias")):
                    names[f"block{stage + 1}/unit{unit + 1}/{module}/{flax}"] = \
                        f"{backbone}stages.{stage}.blocks.{unit}.{ours}.{torch_name}"
    return names


# big_vision's MAPHead -> the `attention_pool` pooler (nn.MultiheadAttention + FeedForward).
_MAP = "MAPHead_0/"
_MAP_ATTENTION = _MAP + "MultiHeadDotProductAttention_0/"
MAP_KEY_MAP = {
    _MAP + "probe": "probe",
    **{f"{_MAP_ATTENTION}{source}/{flax}": f"attn.{target}.{torch_name}"
       for source, target in (("query", "q"), ("key", "k"), ("value", "v"),
                              ("out", "out_proj"))
       for flax, torch_name in (("kernel", "weight"), ("bias", "bias"))},
    **{f"{_MAP}{source}/{flax}": f"mlp.{index}.{torch_name}"
       for source, index in (("LayerNorm_0", 0), ("MlpBlock_0/Dense_0", 1),
                             ("MlpBlock_0/Dense_1", 3))
       for flax, torch_name in (("kernel", "weight"), ("scale", "weight"), ("bias", "bias"))},
}
PRE_LOGITS_KEY_MAP = {"pre_logits/kernel": "proj.weight", "pre_logits/bias": "proj.bias"}
# Read separately (pooler) or deliberately dropped (the classifier).
HEADS = (r"MAPHead_0/", r"pre_logits/", r"head/")


# -- named fix-ups: flax kernel layouts to PyTorch weight layouts ------------------------------

def conv_from_hwio(kernel: torch.Tensor) -> torch.Tensor:
    """A flax Conv kernel `[P, P, C, D]` as a Conv2d weight `[D, C, P, P]`."""
    if kernel.ndim != 4:
        raise ValueError(f"embedding/kernel of shape {list(kernel.shape)} is not a "
                         "[P, P, C, D] convolution kernel (a Dense patch embedding, as in "
                         "NaFlex, is not supported)")
    return kernel.permute(3, 2, 0, 1)


def resnet_conv_from_hwio(kernel: torch.Tensor) -> torch.Tensor:
    """A ResNet conv kernel `[k, k, C_in, C_out]` as a Conv2d weight `[C_out, C_in, k, k]`."""
    return kernel.permute(3, 2, 0, 1)


def linear_from_dense(kernel: torch.Tensor) -> torch.Tensor:
    """A flax Dense kernel `[in, out]` as a Linear weight `[out, in]`."""
    return kernel.T


def linear_from_heads_in(kernel: torch.Tensor) -> torch.Tensor:
    """A query/key/value kernel `[D, heads, head_dim]` as a Linear weight `[D, D]`."""
    return kernel.flatten(1).T


def linear_from_heads_out(kernel: torch.Tensor) -> torch.Tensor:
    """The attention output kernel `[heads, head_dim, D]` as a Linear weight `[D, D]`."""
    return kernel.flatten(0, 1).T


def flatten_heads(bias: torch.Tensor) -> torch.Tensor:
    """A query/key/value bias `[heads, head_dim]` as `[D]`."""
    return bias.flatten()


# By the last two parts of the flax name (module and parameter); other tensors keep their shape.
LAYOUT_FIXUPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "embedding/kernel": conv_from_hwio,
    **{f"{qkv}/kernel": linear_from_heads_in for qkv in ("query", "key", "value")},
    **{f"{qkv}/bias": flatten_heads for qkv in ("query", "key", "value")},
    "out/kernel": linear_from_heads_out,
    **{f"{conv}/kernel": resnet_conv_from_hwio
       for conv in ("conv_root", "conv1", "conv2", "conv3", "conv_proj")},
    **{f"{dense}/kernel": linear_from_dense for dense in ("Dense_0", "Dense_1", "pre_logits")},
}


def to_torch_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor in PyTorch's layout, by `LAYOUT_FIXUPS` (a pure function)."""
    converted = {}
    for name, tensor in tensors.items():
        fix = LAYOUT_FIXUPS.get("/".join(name.split("/")[-2:]))
        converted[name] = fix(tensor).contiguous() if fix else tensor
    return converted


def unstack_scanned_blocks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """big_vision's scanned encoder (`scan=True`): `Transformer/encoderblock/X` `[L, ...]`
    becomes `Transformer/encoderblock_i/X` for each of the L blocks."""
    unstacked = {}
    for name, tensor in tensors.items():
        if name.startswith(SCANNED):
            leaf = name.removeprefix(SCANNED)
            unstacked.update({BLOCK.format(i) + leaf: t.clone() for i, t in enumerate(tensor)})
        else:
            unstacked[name] = tensor
    return unstacked


def add_class_position(state: dict[str, torch.Tensor], source: object) -> tuple[int, int]:
    """Gives the class token a zero position entry where the table has none (big_vision adds
    positions before prepending the class token); returns the square patch grid.

    Raises:
        ValueError: when the table's length fits no square grid.
    """
    table = state["pos_embed"]  # [1, (class +) N, D]
    has_class = "cls_token" in state
    side = math.isqrt(table.shape[1])
    if has_class and side * side == table.shape[1]:
        state["pos_embed"] = torch.cat([torch.zeros_like(table[:, :1]), table], dim=1)
        return (side, side)
    patches = table.shape[1] - int(has_class)
    side = math.isqrt(max(patches, 0))
    if side * side != patches:
        raise ValueError(f"{source}: a position table of {table.shape[1]} entries "
                         f"({'with' if has_class else 'without'} a class token) fits no "
                         "square patch grid")
    return (side, side)


def fuse_attention_pool_qkv(weights: dict[str, torch.Tensor]) -> None:
    """q, k, v of the MAP head into `nn.MultiheadAttention`'s `in_proj_{weight,bias}`."""
    for kind in ("weight", "bias"):
        parts = [weights.pop(f"attn.{x}.{kind}") for x in "qkv"]
        weights[f"attn.in_proj_{kind}"] = torch.cat(parts)


# -- the format ----------------------------------------------------------------------------

def find_prefix(tensors: dict[str, torch.Tensor]) -> str | None:
    """The prefix the model's tensors sit under, or None for no Google layout."""
    return next((p for p in PREFIXES if f"{p}embedding/kernel" in tensors), None)


def heads_of(tensors: dict[str, torch.Tensor], module: str, source: object = "checkpoint") -> int:
    """The head count, from a flax query kernel `[D, heads, head_dim]` under `module`."""
    pattern = re.compile(re.escape(module) + r"MultiHeadDotProductAttention_\d+/query/kernel")
    kernel = next((t for k, t in tensors.items() if pattern.fullmatch(k)), None)
    if kernel is None or kernel.ndim != 3:
        shape = None if kernel is None else list(kernel.shape)
        raise ValueError(f"{source}: no [D, heads, head_dim] query kernel under {module!r} "
                         f"(found {shape})")
    return kernel.shape[1]


def native_pooler(tensors: dict[str, torch.Tensor], raw: dict[str, torch.Tensor],
                  config: EncoderConfig) -> tuple[NativePooler | None, list[str]]:
    """The checkpoint's own pooling (see the module docstring) and the rules applied."""
    width = config.width
    pre_logits = "pre_logits/kernel" in tensors
    if pre_logits and (_MAP + "probe" in tensors or not config.class_token):
        return None, ["pre_logits after a MAP head or mean pooling has no single vlm-vit "
                      "pooler; load_tower needs a pooler named"]
    if _MAP + "probe" in tensors:
        weights = rename(tensors, MAP_KEY_MAP, 1, ignore=[f"(?!{_MAP})"], source="MAPHead_0")
        fuse_attention_pool_qkv(weights)
        hidden = weights["mlp.1.weight"].shape[0]
        # big_vision's MAPHead: flax's MultiHeadDotProductAttention, LayerNorm and nn.gelu
        options = dict(heads=heads_of(raw, _MAP, "MAPHead_0"), mlp_ratio=hidden / width,
                       act="gelu_tanh", eps=1e-6)
        return NativePooler("attention_pool", width, None, options, weights), []
    if pre_logits:
        weights = rename(tensors, PRE_LOGITS_KEY_MAP, 1, ignore=["(?!pre_logits/)"],
                         source="pre_logits")
        return NativePooler("cls_linear", width, weights["proj.weight"].shape[0],
                            dict(bias=True, act="tanh"), weights), []
    if config.class_token:
        return NativePooler("cls", width, None, {}, {}), []
    return NativePooler("mean", width, None, {}, {}), [
        "no class token and no MAP head: pooling is the mean of the tokens (big_vision's gap)"]


class JaxNpzFormat:
    """Google's `.npz` checkpoints (see the module docstring)."""

    name = "jax_npz"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.config is None and find_prefix(checkpoint.tensors) is not None

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path
        prefix = find_prefix(checkpoint.tensors)
        if prefix is None:
            raise ValueError(f"{source} has no embedding/kernel under any of the prefixes "
                             f"{PREFIXES}: not a Google ViT .npz")
        rules = []
        outside = sorted(k for k in checkpoint.tensors if not k.startswith(prefix))
        if outside:
            rules.append(f"{len(outside)} tensors outside {prefix!r} dropped "
                         f"({', '.join(outside[:3])}, ...)")
        raw = unstack_scanned_blocks({k.removeprefix(prefix): v
                                      for k, v in checkpoint.tensors.items()
                                      if k.startswith(prefix)})
        tensors = to_torch_layout(raw)
        depth = count_blocks(tensors, r"Transformer/encoderblock_(\d+)/")
        hybrid_layers = held_stages(tensors, HYBRID_UNIT_PATTERN, first=1) or None
        key_map = {**KEY_MAP, **hybrid_key_map(hybrid_layers)} if hybrid_layers else KEY_MAP
        state = rename(tensors, key_map, depth, ignore=HEADS, source=source)
        patch = state.get("patch_embed.proj.weight")  # [D, ...]: the width q, k, v must have
        fuse_qkv(state, depth, width=None if patch is None else patch.shape[0], source=source)
        missing = [n for n in ("patch_embed.proj.weight", "pos_embed", "blocks.0.mlp.fc1.weight")
                   if n not in state]
        if missing:
            raise ValueError(f"{source} lacks the tensors for {', '.join(missing)} (a fixed "
                             "sin-cos position table, as big_vision's posemb='sincos2d', is "
                             "not stored and not supported)")
        grid = add_class_position(state, source)
        patch = state["patch_embed.proj.weight"]  # [D, C, P, P]; the hybrid's [D, 1024, 1, 1]
        patch_size, channels = patch.shape[-1], patch.shape[1]
        if hybrid_layers:
            patch_size = hybrid_stride(hybrid_layers)
            channels = state["patch_embed.backbone.stem.conv.weight"].shape[1]
            rules.append(f"hybrid: ResNet stages {hybrid_layers}, stride {patch_size}; weights "
                         "standardised as timm's port (eps 1e-8)")
        config = EncoderConfig(
            image_size=(grid[0] * patch_size, grid[1] * patch_size),
            patch_size=patch_size, width=patch.shape[0], depth=depth,
            heads=heads_of(raw, BLOCK.format(0), source),
            mlp_width=state["blocks.0.mlp.fc1.weight"].shape[0], in_channels=channels,
            class_token="cls_token" in state, act="gelu_tanh", norm_eps=1e-6,
            qkv_bias="blocks.0.attn.qkv.bias" in state,
            patch_bias="patch_embed.proj.bias" in state,
            pos_resize_mode="bilinear", pos_resize_antialias=False, hybrid_layers=hybrid_layers,
        )
        pooler, pooler_rules = native_pooler(tensors, raw, config)
        mean, std = NORMALIZATION["inception"]
        processor = ImageProcessor(size=config.image_size, resize_mode="squash",
                                   resample="bilinear", mean=mean, std=std)
        rules += [
            "act gelu_tanh (flax nn.gelu's default, used by the Google code)",
            "norm_eps 1e-6 (flax nn.LayerNorm's default)",
            "position table resized bilinearly like the Google code (scipy.ndimage.zoom, "
            "order 1), with half-pixel centres and no antialias as timm's npz loader",
            f"preprocessing: squash resize to {config.image_size}, bilinear, mean/std 0.5",
            *pooler_rules,
        ]
        return Converted(config=config, state=state, pooler=pooler, processor=processor,
                         rules=rules)


register_format(JaxNpzFormat())
