"""Building blocks of the encoder, one idea per file."""

from vlm_vit.layers.attention import Attention
from vlm_vit.layers.mlp import Mlp, build_activation
from vlm_vit.layers.patch_embed import PatchEmbed
from vlm_vit.layers.pos_embed import resample_pos_embed, sincos_2d_pos_embed
from vlm_vit.layers.varlen import Segments, varlen_attention

__all__ = [
    "Attention", "Mlp", "PatchEmbed", "Segments", "build_activation", "resample_pos_embed",
    "sincos_2d_pos_embed", "varlen_attention",
]
