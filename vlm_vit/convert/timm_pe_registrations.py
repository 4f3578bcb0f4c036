"""Perception Encoder's timm registrations (timm/models/eva.py, timm 1.0.31) and how a
checkpoint is told to be one: apart from `timm_pe`'s reader, so the generic `timm` reader can
ask without importing it (which imports `timm`)."""

from __future__ import annotations

from typing import Any

from vlm_vit.convert.base import Checkpoint
from vlm_vit.io.native import MODEL_TYPE

# Eva's defaults for what the tensors do not show (timm.models.eva.Eva.__init__).
EVA_DEFAULTS: dict[str, Any] = dict(
    img_size=224, num_heads=None, global_pool="avg", use_fc_norm=None, attn_type="eva",
    use_rot_pos_emb=False, rope_type="cat", rope_rotate_half=False, rope_grid_offset=0.0,
    rope_grid_indexing="ij", rope_temperature=10000.0, ref_feat_shape=None, init_values=None,
    swiglu_mlp=False, scale_mlp=False, scale_attn_inner=False, use_post_norm=False,
    qk_norm=False, num_kv_heads=None, attn_only_layer_scale=False, attn_head_dim=None,
    qkv_fused=True, attn_pool_num_heads=None, attn_pool_mlp_ratio=None)
PE_ARGS = dict(attn_type="rope", use_rot_pos_emb=True, use_pre_transformer_norm=True,
           rope_grid_offset=1.0, rope_grid_indexing="xy")
CORE_ARGS = dict(PE_ARGS, global_pool="map", attn_pool_num_heads=8, attn_pool_mlp_ratio=4.0)
_SPATIAL = dict(PE_ARGS, use_post_transformer_norm=False, use_fc_norm=False)
_LANG = dict(_SPATIAL, init_values=0.1)
_GIGANTIC = dict(mlp_ratio=8960 / 1536, class_token=False, rope_grid_offset=0.0)
# name -> (family, patch, pixels, width, depth, heads, ref_feat_shape side, extra)
_REGISTRATIONS = {
    "vit_pe_core_tiny_patch16_384": (CORE_ARGS, 16, 384, 192, 12, 3, 24, {}),
    "vit_pe_core_small_patch16_384": (CORE_ARGS, 16, 384, 384, 12, 6, 24, {}),
    "vit_pe_core_base_patch16_224": (CORE_ARGS, 16, 224, 768, 12, 12, 14, {}),
    "vit_pe_core_large_patch14_336": (CORE_ARGS, 14, 336, 1024, 24, 16, 24, {}),
    "vit_pe_core_gigantic_patch14_448": (CORE_ARGS, 14, 448, 1536, 50, 16, 32, _GIGANTIC),
    "vit_pe_lang_large_patch14_448": (_LANG, 14, 448, 1024, 23, 16, 32, {}),
    "vit_pe_lang_gigantic_patch14_448": (_LANG, 14, 448, 1536, 47, 16, 32, _GIGANTIC),
    "vit_pe_spatial_tiny_patch16_512": (_SPATIAL, 16, 512, 192, 12, 3, 32, {}),
    "vit_pe_spatial_small_patch16_512": (_SPATIAL, 16, 512, 384, 12, 6, 32, {}),
    "vit_pe_spatial_base_patch16_512": (_SPATIAL, 16, 512, 768, 12, 12, 32, {}),
    "vit_pe_spatial_large_patch14_448": (_SPATIAL, 14, 448, 1024, 24, 16, 32, {}),
    "vit_pe_spatial_gigantic_patch14_448": (_SPATIAL, 14, 448, 1536, 50, 16, 32,
                                            dict(_GIGANTIC, init_values=0.1)),
}
# The registrations of timm/models/eva.py (timm 1.0.31), by architecture name; img_size is
# their pretrained_cfg's input size, which timm passes when model_args give none.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    name: {**family, "patch_size": patch, "img_size": pixels, "embed_dim": width,
           "depth": depth, "num_heads": heads, "mlp_ratio": 4.0,
           "ref_feat_shape": (side, side), **extra}
    for name, (family, patch, pixels, width, depth, heads, side, extra)
    in _REGISTRATIONS.items()}
# (width, depth, MLP width) -> (heads, a registration), for a bare state dict: every
# registration with these sizes has these heads and this RoPE offset.
KNOWN_HEADS: dict[tuple[int, int, int], tuple[int, str]] = {}
for _name, _args in ARCHITECTURES.items():
    _sizes = (_args["embed_dim"], _args["depth"], int(_args["embed_dim"] * _args["mlp_ratio"]))
    KNOWN_HEADS.setdefault(_sizes, (_args["num_heads"], _name))

def _architecture(config: dict[str, Any]) -> str:
    """timm's registration name, without a pretrained tag (`vit_pe_core_base_patch16_224.fb`)."""
    name = config.get("architecture")
    return name.partition(".")[0] if isinstance(name, str) else ""


def is_timm_pe(checkpoint: Checkpoint) -> bool:
    """A timm state dict whose config.json names a PE registration (its tensors are a timm
    ViT's: only the config tells PE's RoPE apart)."""
    config = checkpoint.config
    return bool(config) and config.get("model_type") != MODEL_TYPE and \
        "patch_embed.proj.weight" in checkpoint.tensors and \
        _architecture(config) in ARCHITECTURES
