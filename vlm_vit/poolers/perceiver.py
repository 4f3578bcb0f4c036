"""A perceiver resampler: M learned latents cross-attend to the tokens over a few layers
(Flamingo, Alayrac et al. 2022), with 2D sin-cos positions on the patch tokens as in Qwen-VL
(Bai et al. 2023), so the output knows where each patch was."""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.layers import sincos_2d_pos_embed
from vlm_vit.poolers.base import (
    MAX_POOLER_DEPTH,
    MAX_POOLER_TOKENS,
    FeedForward,
    check_count,
    check_heads,
    check_mlp_ratio,
    default_heads,
    register_pooler,
    split_tokens,
)


class ResamplerLayer(nn.Module):
    """Latents attend to [tokens; latents] (Flamingo), then a feed-forward, both residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm_media = nn.LayerNorm(width)
        self.norm_latents = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = FeedForward(width, int(width * mlp_ratio))

    def forward(self, latents: torch.Tensor, media: torch.Tensor) -> torch.Tensor:
        query = self.norm_latents(latents)  # [B, M, D]
        keys = torch.cat([self.norm_media(media), query], dim=1)  # [B, T + M, D]
        latents = latents + self.attn(query, keys, keys, need_weights=False)[0]
        return latents + self.mlp(latents)


@register_pooler("perceiver")
class PerceiverResampler(nn.Module):
    """Perceiver resampler to a fixed number of tokens.

    Args:
        in_dim: token width D (a multiple of 4, for the 2D sin-cos positions).
        out_dim: output width (a final Linear when it differs from D).
        num_latents: M, the number of output tokens.
        depth: resampler layers.
        heads: attention heads (default: the largest of up to 16 that divides D).
        mlp_ratio: feed-forward width as a multiple of D.
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, num_latents: int = 64,
                 depth: int = 2, heads: int | None = None, mlp_ratio: float = 4.0):
        super().__init__()
        num_latents = check_count("num_latents", num_latents, MAX_POOLER_TOKENS)
        depth = check_count("depth", depth, MAX_POOLER_DEPTH)
        heads, mlp_ratio = check_heads(heads, in_dim), check_mlp_ratio(mlp_ratio)
        if in_dim % 4:
            raise ValueError(f"the perceiver needs in_dim divisible by 4 (2D sin-cos "
                             f"positions), got {in_dim}")
        self.in_dim, self.out_dim = in_dim, out_dim or in_dim
        self.latents = nn.Parameter(torch.randn(1, num_latents, in_dim) * 0.02)
        heads = heads or default_heads(in_dim)
        self.layers = nn.ModuleList(ResamplerLayer(in_dim, heads, mlp_ratio)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(in_dim)
        self.proj = nn.Linear(in_dim, self.out_dim) if self.out_dim != in_dim else nn.Identity()

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        prefix, patches = split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        positions = sincos_2d_pos_embed(grid, self.in_dim).to(tokens.device, tokens.dtype)
        media = torch.cat([prefix, patches + positions], dim=1)  # prefix tokens have no place
        latents = self.latents.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
        for layer in self.layers:
            latents = layer(latents, media)
        return self.proj(self.norm(latents))  # [B, M, out]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return self.latents.shape[1]
