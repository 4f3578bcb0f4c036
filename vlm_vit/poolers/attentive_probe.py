"""The attentive probe: one learned query attends over the tokens' keys and values, then a
Linear (El-Nouby et al. 2024, AIM; AIMv2's head, transformers' `Aimv2AttentionPoolingHead`).

Unlike the MAP head (`attention_pool`), the query is used as it is (no query projection),
and there is neither an output projection inside the attention nor an MLP after it:

    out = proj(softmax(q k^T / sqrt(d)) v),  q = query, k = k(tokens), v = v(tokens)

per head, the heads concatenated (`[B, D]`) before `proj`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.config import check_bool
from vlm_vit.poolers.base import check_heads, default_heads, register_pooler, split_tokens


@register_pooler("attentive_probe")
class AttentiveProbe(nn.Module):
    """One learned query over every token (prefix tokens included), one vector out.

    Args:
        in_dim: token width D.
        out_dim: output width of `proj` (default D).
        heads: attention heads (default: the largest of up to 16 that divides D); AIMv2's
            head uses the tower's.
        qkv_bias: whether the key and value Linears have biases (AIMv2's `qkv_bias`).
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, heads: int | None = None,
                 qkv_bias: bool = False) -> None:
        super().__init__()
        heads = check_heads(heads, in_dim)
        self.in_dim, self.out_dim = in_dim, out_dim or in_dim
        self.heads = heads or default_heads(in_dim)
        bias = check_bool("qkv_bias", qkv_bias)
        self.query = nn.Parameter(torch.empty(1, 1, in_dim))
        nn.init.normal_(self.query, std=0.02)  # transformers' initializer_range
        self.k = nn.Linear(in_dim, in_dim, bias=bias)
        self.v = nn.Linear(in_dim, in_dim, bias=bias)
        self.proj = nn.Linear(in_dim, self.out_dim)

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        batch, count, width = tokens.shape
        head_width = width // self.heads
        # (B, T, D) -> (B, heads, T, D / heads)
        keys = self.k(tokens).reshape(batch, count, self.heads, head_width).transpose(1, 2)
        values = self.v(tokens).reshape(batch, count, self.heads, head_width).transpose(1, 2)
        query = self.query.to(tokens.dtype).expand(batch, -1, -1) \
            .reshape(batch, 1, self.heads, head_width).transpose(1, 2)  # (B, heads, 1, D / h)
        pooled = F.scaled_dot_product_attention(query, keys, values)  # (B, heads, 1, D / h)
        return self.proj(pooled.transpose(1, 2).reshape(batch, width))  # [B, out]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> None:
        return None
