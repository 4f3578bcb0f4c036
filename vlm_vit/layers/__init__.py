"""Building blocks of the encoder, one idea per file."""

from vlm_vit.layers.attention import Attention
from vlm_vit.layers.layer_scale import LayerScale, build_layer_scale
from vlm_vit.layers.mlp import Mlp, build_activation, build_mlp
from vlm_vit.layers.norm import build_norm
from vlm_vit.layers.patch_embed import PatchEmbed, build_patch_embed
from vlm_vit.layers.patch_masking import keep_patches, mask_patches
from vlm_vit.layers.pos_embed import (
    resample_pos_embed,
    resample_pos_embed_cached,
    sincos_2d_pos_embed,
    sincos_position_table,
)
from vlm_vit.layers.residual import add_residual
from vlm_vit.layers.rope_2d import Rope2D, apply_rope, build_rope
from vlm_vit.layers.varlen import Segments, varlen_attention
from vlm_vit.layers.window_segments import Windows, build_windows

__all__ = [
    "Attention", "LayerScale", "Mlp", "PatchEmbed", "Rope2D", "Segments", "add_residual",
    "apply_rope", "build_activation", "build_layer_scale", "build_mlp", "build_norm",
    "build_patch_embed", "Windows", "build_rope", "build_windows", "keep_patches",
    "mask_patches", "resample_pos_embed", "resample_pos_embed_cached", "sincos_2d_pos_embed",
    "sincos_position_table",
    "varlen_attention",
]
