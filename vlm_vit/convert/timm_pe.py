"""timm's Perception Encoder towers (`vit_pe_{core,spatial,lang}_*`: `timm.models.eva.Eva` with
`attn_type="rope"`; Bolya et al. 2025, arXiv 2504.13181).

A PE block is the pre-norm ViT block (GELU MLP, a fused qkv with all three biases, LayerScale
in the lang and spatial gigantic towers) after a LayerNorm over the embeddings (`norm_pre`, so
no patch bias), with a learned position table and 2D RoPE on q and k of the patch tokens:

- timm's RoPE (`RotaryEmbeddingCat`) turns channel pairs (2i, 2i+1) at the head_dim/4
  frequencies theta^(-4j/head_dim) of EVA-02 (our "shared"); with `rope_grid_indexing="xy"`
  (every PE registration) its first head_dim/4 pairs turn with the column and the others with
  the row. Ours pairs i with i + head_dim/2, rows first, so the q and k rows of each head are
  permuted (`pe_rope_order`); q.k is unchanged, as q and k get the same permutation;
- its positions are the patch indices plus `rope_grid_offset` (1 but in the gigantic towers:
  PE's class token holds (0, 0)), scaled to `ref_feat_shape` from each image's own grid: our
  `rope_positions="one_based"` (`layers.rope_one_based`) or "index", and
  `rope_reference_grid`. The class token is not turned, in timm as in ours;
- the core towers pool with `global_pool="map"`: timm's `AttentionPoolLatent` (a latent query,
  `q` and `kv` projections, `proj`, then `x + mlp(norm(x))`) is our `attention_pool` pooler
  (nn.MultiheadAttention's in_proj holds q over kv; its out_proj is `proj`; LayerNorm, fc1,
  GELU, fc2), with `attn_pool_num_heads` heads; the spatial and lang towers have no final norm
  and timm's "avg" (our `mean`).

What the tensors do not show comes from `config.json`: `model_args` over the registration's
own arguments (`ARCHITECTURES`, copied from timm 1.0.31's `eva.py`) over Eva's defaults. A
bare state dict (`format="timm_pe"`) takes the arguments the registrations share (`PE_ARGS`), the
grid its position table holds as image size and reference grid, the gigantic towers' offset
where the sizes are theirs, and heads by `bare.resolve`. The registrations' LayerNorm eps is
1e-5 (`norm_layer`, code a config cannot give; Eva's own 1e-6 for an architecture that is no
registration). What our block cannot hold is refused by name (`UNSUPPORTED`, offsets other than
0 and 1, fc_norm, other pools), before a model is built.

`write` goes the other way, to what `timm.create_model("local-dir:DIR", pretrained=True)`
builds: a core registration with an `attention_pool` pooler (`global_pool="map"`), else a
spatial one ("token" for a `cls` pooler, else "avg"), every size in `model_args`,
`dynamic_img_size` on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import ConfigError, EncoderConfig, is_int
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
    _fold_positions,
    _processor,
    check_model_args,
    to_timm_state_dict,
    write_timm_directory,
)
from vlm_vit.convert.timm_pe_registrations import (
    ARCHITECTURES,
    CORE_ARGS,
    EVA_DEFAULTS,
    KNOWN_HEADS,
    PE_ARGS,
    _architecture,
    is_timm_pe,
)
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
BLOCK_PATTERN = r"blocks\.(\d+)\."
IGNORED = (r"head\.",)  # a classifier head (global_pool decides the pooled features)
REGISTRATION_EPS, EVA_EPS = 1e-5, 1e-6
# Settings our block cannot hold: (setting, the value we can, why), refused by name.
UNSUPPORTED = (
    ("attn_type", "rope", "Eva's attention with q/v biases"),
    ("use_rot_pos_emb", True, "no RoPE"),
    ("rope_type", "cat", "another RoPE (DINOv3, mixed, M-RoPE)"),
    ("rope_rotate_half", False, "RoPE on rotate-half channel pairs"),
    ("use_fc_norm", False, "a norm of the pooled tokens (fc_norm)"),
    ("swiglu_mlp", False, "a SwiGLU MLP"),
    ("scale_attn_inner", False, "a norm inside attention"),
    ("scale_mlp", False, "a norm inside the MLP"),
    ("use_post_norm", False, "the post-norm block"),
    ("qk_norm", False, "q/k norms"),
    ("num_kv_heads", None, "grouped-query attention"),
    ("attn_only_layer_scale", False, "LayerScale on the attention branch only"),
    ("attn_head_dim", None, "a head width other than width / heads"),
    ("qkv_fused", True, "separate q/k/v projections"),
)
OFFSETS = {0.0: "index", 1.0: "one_based"}  # rope_grid_offset -> EncoderConfig.rope_positions
INDEXINGS = ("ij", "xy")
POOLS = {"map": "attention_pool", "avg": "mean", "token": "cls"}
KEY_MAP = {
    **{name: name for name in ("cls_token", "reg_token", "pos_embed", "norm_pre.weight",
                               "norm_pre.bias", "norm.weight", "norm.bias",
                               "patch_embed.proj.weight", "patch_embed.proj.bias")},
    **{f"blocks.{{}}.{source}": f"blocks.{{}}.{target}" for source, target in {
        **{f"{part}.{kind}": f"{part}.{kind}" for kind in ("weight", "bias")
           for part in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")},
        "gamma_1": "ls1.gamma", "gamma_2": "ls2.gamma",
    }.items()},
}
# timm's AttentionPoolLatent -> our attention_pool (q and kv are fused into in_proj apart).
MAP_KEY_MAP = {
    "attn_pool.latent": "probe",
    **{f"attn_pool.{source}.{kind}": f"{target}.{kind}" for kind in ("weight", "bias")
       for source, target in (("q", "q"), ("kv", "kv"), ("proj", "attn.out_proj"),
                              ("norm", "mlp.0"), ("mlp.fc1", "mlp.1"), ("mlp.fc2", "mlp.3"))},
}


def pe_settings(config: dict[str, Any] | None, source: object) -> dict[str, Any]:
    """`model_args` over the registration's over Eva's defaults, with the LayerNorm eps;
    without a config, the arguments the registrations share (`PE_ARGS`, eps 1e-5).

    Raises:
        ValueError: naming `source`, for `model_args` that is not an object.
    """
    if config is None:
        return {**EVA_DEFAULTS, **PE_ARGS, "norm_eps": REGISTRATION_EPS}
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
    fc_norm = settings["use_fc_norm"]
    found["use_fc_norm"] = (settings["global_pool"] == "avg" if fc_norm is None else
                            bool(fc_norm)) or "fc_norm.weight" in tensors  # Eva's default
    found["qkv_fused"] = found["qkv_fused"] and "blocks.0.attn.q_proj.weight" not in tensors
    found["attn_type"] = "eva" if "blocks.0.attn.q_bias" in tensors else found["attn_type"]
    for setting, ours, what in UNSUPPORTED:
        if found[setting] != ours:
            raise ValueError(f"{source}: timm PE with {setting}={found[setting]!r} ({what}) "
                             "is not representable in vlm-vit's block")
    if found["rope_grid_offset"] not in OFFSETS:
        raise ValueError(f"{source}: timm PE with rope_grid_offset="
                         f"{found['rope_grid_offset']!r} is not representable in vlm-vit's "
                         "block: RoPE positions start at 0 or 1")
    if found["rope_grid_indexing"] not in INDEXINGS:
        raise ValueError(f"{source}: timm PE with rope_grid_indexing="
                         f"{found['rope_grid_indexing']!r} is not 'ij' or 'xy'")
    pool = settings["global_pool"]
    if pool not in POOLS:
        raise ValueError(f"{source}: timm PE with global_pool={pool!r} is not read; vlm-vit "
                         f"reads {', '.join(map(repr, POOLS))}")
    if (pool == "map") != ("attn_pool.latent" in tensors):
        raise ValueError(f"{source}: timm PE with global_pool={pool!r} "
                         f"{'needs' if pool == 'map' else 'has no'} attn_pool tensors")


def pe_rope_order(head_dim: int, xy: bool) -> torch.Tensor:
    """For each of our q/k channels of a head (pairs i, i + head_dim/2; rows turn in the
    first quarter of each half, columns in the second), the channel of timm's interleaved
    layout (pairs 2p, 2p+1) that turns with it; `[head_dim]` int64. With "xy" timm's first
    head_dim/4 pairs turn with the column, so our row pairs are its second quarter."""
    quarter = head_dim // 4
    pairs = torch.arange(2 * quarter)
    pairs = pairs.roll(-quarter) if xy else pairs  # (hd/2,): timm's pair for our pair i
    return torch.cat([2 * pairs, 2 * pairs + 1])


def permute_rope_rows(state: dict[str, torch.Tensor], depth: int, heads: int, xy: bool,
                      inverse: bool = False) -> None:
    """Moves the q and k rows of every head from timm's RoPE layout to ours
    (`pe_rope_order`), in place; `inverse` goes back."""
    for i in range(depth):
        for kind in ("weight", "bias"):
            name = f"blocks.{i}.attn.qkv.{kind}"
            if name not in state:
                continue
            qkv = state[name]  # (3 * D, ...)
            width = qkv.shape[0] // 3
            order = pe_rope_order(width // heads, xy)
            order = torch.argsort(order) if inverse else order
            rows = (torch.arange(heads)[:, None] * (width // heads) + order).flatten()  # (D,)
            rows = torch.cat([rows, rows + width, torch.arange(2 * width, 3 * width)])
            state[name] = qkv[rows]


def map_pooler(tensors: dict[str, torch.Tensor], settings: dict[str, Any], width: int,
               heads: Any, source: object) -> NativePooler:
    """timm's `AttentionPoolLatent` as an `attention_pool` pooler (see the module docstring).

    Raises:
        ValueError: naming `source` and `model_args.attn_pool_num_heads` for heads that do
            not divide the width, or the tensor of another shape than the width needs.
    """
    pool_heads = settings["attn_pool_num_heads"] or heads
    if not (is_int(pool_heads) and 0 < pool_heads <= width and width % pool_heads == 0):
        raise ValueError(f"{source}: model_args.attn_pool_num_heads is {pool_heads!r}, not a "
                         f"divisor of width {width}")
    head = {name: tensor for name, tensor in tensors.items() if name.startswith("attn_pool.")}
    weights = rename(head, MAP_KEY_MAP, 0, source=source)
    missing = sorted(source_name for source_name, name in MAP_KEY_MAP.items()
                     if name not in weights)
    if missing:
        raise ValueError(f"{source}: timm PE's MAP head lacks {', '.join(missing)}")
    hidden = weights.get("mlp.1.weight", torch.empty(0, 0)).shape[0]
    check_shapes(weights, {"probe": [1, 1, width], "q.weight": [width, width],
                           "q.bias": [width], "kv.weight": [2 * width, width],
                           "kv.bias": [2 * width], "attn.out_proj.weight": [width, width],
                           "mlp.1.weight": [hidden, width], "mlp.3.weight": [width, hidden]},
                 0, source=source)
    for kind in ("weight", "bias"):
        weights[f"attn.in_proj_{kind}"] = torch.cat([weights.pop(f"q.{kind}"),
                                                     weights.pop(f"kv.{kind}")])
    options = dict(num_queries=1, heads=pool_heads, mlp_ratio=hidden / width, act="gelu",
                   eps=settings["norm_eps"], keep_prefix=True)  # timm's attends over them all
    return NativePooler("attention_pool", width, None, options, weights)


def rope_reference(settings: dict[str, Any]) -> Any:
    """`ref_feat_shape` for `EncoderConfig.rope_reference_grid` (which validates it)."""
    reference = settings["ref_feat_shape"]
    return tuple(reference) if isinstance(reference, list) else reference


class TimmPeFormat:
    """timm's Perception Encoder `Eva` saved as a state dict with timm's config.json."""

    name = "timm_pe"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return is_timm_pe(checkpoint)

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE if checkpoint.config else checkpoint.path
        settings = pe_settings(checkpoint.config, source)
        tensors = checkpoint.tensors
        patch = tensors["patch_embed.proj.weight"]  # (D, C, P, P)
        width, patch_size = patch.shape[0], patch.shape[-1]
        depth = held_blocks(tensors, BLOCK_PATTERN)
        check_model_args(settings, {"embed_dim": (width, "patch_embed.proj.weight"),
                                    "depth": (depth, f"blocks.0 to blocks.{depth - 1}"),
                                    "in_chans": (patch.shape[1], "patch_embed.proj.weight")},
                         source)
        hidden = tensors.get("blocks.0.mlp.fc1.weight", torch.empty(0, 0)).shape[0]
        proven = {"width": width, "depth": depth, "mlp_width": hidden}
        rules: list[str] = []
        if checkpoint.config is None:
            settings.update(self._bare_settings(tensors, proven, patch_size, rules))
        refuse_unsupported(settings, tensors, source)
        heads = settings["num_heads"]
        if heads is None or "heads" in checkpoint.given:
            heads = resolve("heads", proven, KNOWN_HEADS, checkpoint.given, rules,
                            source=source, family="timm PE",
                            recorded_by="timm's config.json beside it with its architecture "
                            "(e.g. vit_pe_core_base_patch16_224) or model_args.num_heads")
        pooler = NativePooler(POOLS[settings["global_pool"]], width, None, {}, {})
        if settings["global_pool"] == "map":
            pooler = map_pooler(tensors, settings, width, heads, source)
        state = rename(tensors, KEY_MAP, depth, ignore=(*IGNORED, r"attn_pool\."),
                       source=checkpoint.path)
        check_shapes(state, {"blocks.{}.attn.qkv.weight": [3 * width, width],
                             "blocks.{}.attn.qkv.bias": [3 * width]},
                     depth, source=checkpoint.path)
        registers = state["reg_token"].shape[1] if "reg_token" in state else 0
        offset = float(settings["rope_grid_offset"])
        rules += [f"LayerNorm eps {settings['norm_eps']:g}",
                  f"RoPE at patch indices + {offset:g} scaled to ref_feat_shape "
                  f"{settings['ref_feat_shape']}, grid indexing "
                  f"{settings['rope_grid_indexing']!r} (q and k rows permuted to rotate-half "
                  "order)"]
        scale = None
        if "blocks.0.ls1.gamma" in state:
            scale = settings["init_values"] or 1e-5
        try:
            config = EncoderConfig(
                image_size=settings["img_size"], patch_size=patch_size, width=width, depth=depth,
                heads=heads, mlp_width=hidden, in_channels=patch.shape[1],
                class_token="cls_token" in state, num_register_tokens=registers,
                pre_norm="norm_pre.weight" in state, final_norm="norm.weight" in state,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                patch_bias="patch_embed.proj.bias" in state, act="gelu",
                norm_eps=settings["norm_eps"], layer_scale_init=scale,
                pos_embed="learned" if "pos_embed" in state else "none",
                rope_theta=settings["rope_temperature"], rope_frequencies="shared",
                rope_reference_grid=rope_reference(settings),
                rope_positions=OFFSETS[offset])
        except ConfigError as error:
            raise error.located(source, TIMM_FIELDS.get(error.field)) from None
        if "pos_embed" in state:
            _fold_positions(state, config.grid[0] * config.grid[1], rules)
        permute_rope_rows(state, depth, config.heads, settings["rope_grid_indexing"] == "xy")
        return Converted(config=config, state=state, pooler=pooler,
                         processor=_processor(checkpoint.config, config, source), rules=rules,
                         source=checkpoint.path,
                         config_file=CONFIG_FILE if checkpoint.config else "the shapes")

    @staticmethod
    def _bare_settings(tensors: dict[str, torch.Tensor], proven: dict[str, int],
                       patch_size: int, rules: list[str]) -> dict[str, Any]:
        """What a bare state dict's tensors imply: the square grid its position table holds
        as image size and reference grid (every registration's reference is its own grid),
        the pool its head shows, and the offset of the registration its sizes are."""
        prefix = int("cls_token" in tensors) + (tensors["reg_token"].shape[1]
                                                if "reg_token" in tensors else 0)
        table = tensors.get("pos_embed")
        side = int(round((table.shape[1] - prefix) ** 0.5)) if table is not None else 0
        settings: dict[str, Any] = dict(
            global_pool="map" if "attn_pool.latent" in tensors else "avg",
            attn_pool_num_heads=CORE_ARGS["attn_pool_num_heads"],  # every core registration's
            img_size=side * patch_size, ref_feat_shape=(side, side) if side else None)
        known = KNOWN_HEADS.get(tuple(proven.values()))
        if known is not None:
            settings["rope_grid_offset"] = ARCHITECTURES[known[1]]["rope_grid_offset"]
        rules.append(f"no config.json: the arguments PE's registrations share (a MAP head of "
                     f"8 heads), image size {side * patch_size} and ref_feat_shape {side} from "
                     "the position table")
        return settings

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None) -> None:
        """Writes `model.safetensors` and timm's `config.json` (a PE registration, every size
        in `model_args`) into `destination`. An `attention_pool` pooler is written as the
        core towers' MAP head (`global_pool="map"`), a `cls` one as "token", anything else
        as "avg".

        Raises:
            ValueError: naming every field timm's PE cannot hold (`WRITE_ARCHITECTURE`, no
                RoPE, a patch bias not the opposite of pre-norm, a MAP head of another shape
                than timm's); nothing is written then.
        """
        config = encoder.config
        name = getattr(pooler, "pooler_spec", {}).get("name")
        pool = {"attention_pool": "map", "cls": "token"}.get(name, "avg")
        args = pe_model_args(config, pool, pooler)
        state = pe_tensors(encoder)
        if pool == "map":
            state.update(map_tensors(pooler))
        write_timm_directory(destination, write_architecture(config, pool), args, config,
                             state, processor)


# What timm's PE builds from a config file, in EncoderConfig fields; `write` refuses the rest.
WRITE_ARCHITECTURE = dict(norm="layernorm", norm_eps=REGISTRATION_EPS, mlp="mlp", act="gelu",
                          mlp_norm=False, hybrid_layers=None, rope_frequencies="shared",
                          temporal_patch_size=None, window_size=None, patch_norm=False)


def pe_model_args(config: EncoderConfig, pool: str, pooler: nn.Module | None) -> dict[str, Any]:
    """The registration's arguments for `config` and its pool, each given.

    Raises:
        ValueError: naming every field timm's PE cannot hold.
    """
    problems = mismatches(config, WRITE_ARCHITECTURE, "timm's PE")
    if config.rope_theta is None:
        problems.append("rope_theta=None (timm's PE turns q and k by 2D RoPE)")
    if config.rope_positions not in OFFSETS.values():
        problems.append(f"rope_positions={config.rope_positions!r} (timm's PE needs 'index' "
                        "or 'one_based')")
    if config.pos_embed == "sincos":
        problems.append("pos_embed='sincos' (timm's PE has a learned table or none)")
    if config.patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.patch_bias} with pre_norm={config.pre_norm} "
                        "(timm's Eva ties the patch bias to no pre-norm)")
    if pool == "token" and not config.class_token:
        problems.append("class_token=False with a cls pooler")
    head: dict[str, Any] = {}
    if pool == "map":
        head = map_args(pooler, config, problems)
    if problems:
        raise ValueError("timm's PE cannot hold this encoder: " + "; ".join(problems))
    offset = next(value for value, kind in OFFSETS.items() if kind == config.rope_positions)
    return dict(
        img_size=list(config.image_size), patch_size=config.patch_size,
        in_chans=config.in_channels, embed_dim=config.width, depth=config.depth,
        num_heads=config.heads, mlp_ratio=mlp_ratio(config.mlp_width, config.width),
        qkv_bias=config.qkv_bias, class_token=config.class_token,
        num_reg_tokens=config.num_register_tokens, no_embed_class=False,
        init_values=config.layer_scale_init, use_abs_pos_emb=config.pos_embed == "learned",
        attn_type="rope", use_rot_pos_emb=True, rope_type="cat", rope_temperature=config.rope_theta,
        rope_grid_offset=offset, rope_grid_indexing="xy",
        ref_feat_shape=None if config.rope_reference_grid is None
        else list(config.rope_reference_grid),
        use_pre_transformer_norm=config.pre_norm, use_post_transformer_norm=config.final_norm,
        use_fc_norm=False, global_pool=pool, num_classes=0, dynamic_img_size=True, **head)


def mlp_ratio(hidden: int, width: int) -> float:
    """A ratio timm's `int(width * ratio)` turns back into `hidden`."""
    ratio = hidden / width
    return ratio if int(width * ratio) == hidden else (hidden + 0.5) / width


def map_args(pooler: nn.Module, config: EncoderConfig, problems: list[str]) -> dict[str, Any]:
    """`attn_pool_num_heads` and `attn_pool_mlp_ratio` for an `attention_pool` pooler, or what
    timm's `AttentionPoolLatent` cannot hold of it (added to `problems`)."""
    options = pooler.pooler_spec.get("options", {})
    if pooler.num_queries != 1 or pooler.out_dim != config.width:
        problems.append(f"an attention_pool with {pooler.num_queries} queries and out_dim "
                        f"{pooler.out_dim} (timm's MAP head has 1 query and the width)")
    if config.num_prefix_tokens and not pooler.keep_prefix:
        problems.append("an attention_pool with keep_prefix=False (timm's MAP head attends "
                        "over the class and register tokens too)")
    if options.get("act", "gelu") != "gelu":
        problems.append(f"an attention_pool with act={options['act']!r} (timm's needs 'gelu')")
    if pooler.mlp[0].eps != config.norm_eps:
        problems.append(f"an attention_pool with eps {pooler.mlp[0].eps:g} (timm's is the "
                        f"encoder's, {config.norm_eps:g})")
    hidden = pooler.mlp[1].out_features
    return dict(attn_pool_num_heads=pooler.attn.num_heads,
                attn_pool_mlp_ratio=mlp_ratio(hidden, config.width))


def map_tensors(pooler: nn.Module) -> dict[str, torch.Tensor]:
    """An `attention_pool` pooler's weights under `AttentionPoolLatent`'s names."""
    weights = {name: tensor.detach() for name, tensor in pooler.state_dict().items()}
    width = weights["probe"].shape[-1]
    for kind in ("weight", "bias"):
        fused = weights.pop(f"attn.in_proj_{kind}")
        weights[f"q.{kind}"], weights[f"kv.{kind}"] = fused[:width], fused[width:]
    return rename(weights, invert(MAP_KEY_MAP), 0, source="the pooler")


def write_architecture(config: EncoderConfig, pool: str) -> str:
    """The registration of `pool`'s family (core for "map", else spatial) with `config`'s
    sizes, else that family's first (model_args override each of its sizes)."""
    family = "vit_pe_core_" if pool == "map" else "vit_pe_spatial_"
    same = [name for name in ARCHITECTURES if name.startswith(family)]
    for name in same:
        args = ARCHITECTURES[name]
        if (args["embed_dim"], args["depth"], args["num_heads"]) == \
                (config.width, config.depth, config.heads):
            return name
    return same[0]


def pe_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under Eva's names, q and k rows back in timm's RoPE layout
    ("xy", which `pe_model_args` writes); a pure function."""
    config = encoder.config
    state = to_timm_state_dict(detached(encoder), config)
    permute_rope_rows(state, config.depth, config.heads, xy=True, inverse=True)
    return rename(state, invert(KEY_MAP), config.depth, source="the encoder")


register_format(TimmPeFormat())
