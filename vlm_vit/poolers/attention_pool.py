"""Attention pooling: learned queries attend over the tokens (the MAP head of big_vision,
used by SigLIP; Lee et al. 2019's pooling by multihead attention)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.config import check_bool
from vlm_vit.poolers.base import (
    MAX_POOLER_TOKENS,
    FeedForward,
    check_count,
    check_heads,
    check_mlp_ratio,
    default_heads,
    register_pooler,
    split_tokens,
)


@register_pooler("attention_pool")
class AttentionPool(nn.Module):
    """Multihead attention pooling (big_vision's `MAPHead`).

    One query returns a vector `[B, out]`; several return `[B, num_queries, out]`.

    Args:
        in_dim: token width D.
        out_dim: output width (a final Linear when it differs from D).
        num_queries: learned queries M.
        heads: attention heads (default: the largest of up to 16 that divides D).
        mlp_ratio: hidden width of the MLP after attention, as a multiple of D.
        act: the MLP's activation (SigLIP's head uses "gelu_tanh").
        eps: the MLP's LayerNorm epsilon (SigLIP: 1e-6).
        keep_prefix: attend over the class and register tokens too (a tower then hands them
            over): the MAP head of timm's Perception Encoder core towers.
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, num_queries: int = 1,
                 heads: int | None = None, mlp_ratio: float = 4.0, act: str = "gelu",
                 eps: float = 1e-5, keep_prefix: bool = False):
        super().__init__()
        self.keep_prefix = check_bool("keep_prefix", keep_prefix)
        num_queries = check_count("num_queries", num_queries, MAX_POOLER_TOKENS)
        heads, mlp_ratio = check_heads(heads, in_dim), check_mlp_ratio(mlp_ratio)
        self.in_dim, self.out_dim, self.num_queries = in_dim, out_dim or in_dim, num_queries
        self.probe = nn.Parameter(torch.empty(1, num_queries, in_dim))
        nn.init.xavier_uniform_(self.probe)
        self.attn = nn.MultiheadAttention(in_dim, heads or default_heads(in_dim),
                                          batch_first=True)
        self.mlp = FeedForward(in_dim, round(in_dim * mlp_ratio), act=act, eps=eps)
        self.proj = nn.Linear(in_dim, self.out_dim) if self.out_dim != in_dim else nn.Identity()

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        queries = self.probe.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
        x = self.attn(queries, tokens, tokens, need_weights=False)[0]  # [B, M, D]
        x = self.proj(x + self.mlp(x))
        return x[:, 0] if self.num_queries == 1 else x

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int | None:
        return None if self.num_queries == 1 else self.num_queries
