"""CAPI's predictor (Darcet et al. 2025, section 3.2): one mask token per masked patch, which
cross-attends to the student's visible tokens and never to the other queries; positions
enter only through 2D RoPE on queries and keys (the patch's row and column).

As lightly's `CAPIPredictorTIMM`: blocks of `queries + proj(attention(norm_q(queries),
norm_c(context)))` then `queries + mlp(norm(queries))`, biases and affine LayerNorms, and a
final LayerNorm. Our RoPE pairs channel i with i + head_dim / 2 (`vlm_vit.layers.rope_2d`,
the "shared" frequencies) where timm's `RotaryEmbeddingCat` pairs 2i with 2i + 1: the same
angles, so a per-head permutation of the query and key rows carries weights across
(`timm_qk_order`).

Images are given as lists (their own grids and counts): the Linears and norms run once over
every image's tokens, the attention per image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.layers.rope_2d import Rope2D, apply_rope


def timm_qk_order(head_dim: int) -> torch.Tensor:
    """For one head, the channel of timm's interleaved RoPE layout that each of ours holds:
    ours i is timm's 2i, ours i + head_dim / 2 is timm's 2i + 1."""
    half = head_dim // 2
    return torch.stack([torch.arange(half) * 2, torch.arange(half) * 2 + 1]).flatten()


class CrossAttentionBlock(nn.Module):
    """Queries attend to a context (no self-attention), then an MLP; both residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.query_norm = nn.LayerNorm(width)
        self.context_norm = nn.LayerNorm(width)
        self.to_query = nn.Linear(width, width)
        self.to_key_value = nn.Linear(width, 2 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, queries: torch.Tensor, context: torch.Tensor,
                query_rope: tuple[torch.Tensor, torch.Tensor],
                context_rope: tuple[torch.Tensor, torch.Tensor],
                query_counts: list[int], context_counts: list[int]) -> torch.Tensor:
        """`queries` `[Q, W]` and `context` `[C, W]`: every image's, end to end, with their
        RoPE cos and sin `[Q or C, head_dim]` and each image's counts."""
        q = self.to_query(self.query_norm(queries)).unflatten(-1, (self.heads, self.head_dim))
        k, v = self.to_key_value(self.context_norm(context)).unflatten(
            -1, (2, self.heads, self.head_dim)).unbind(1)
        q = apply_rope(q, query_rope[0][:, None], query_rope[1][:, None])
        k = apply_rope(k, context_rope[0][:, None], context_rope[1][:, None])
        outputs = []
        for q_i, k_i, v_i in zip(q.split(query_counts), k.split(context_counts),
                                 v.split(context_counts), strict=True):
            outputs.append(F.scaled_dot_product_attention(
                q_i.transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1)
            ).transpose(0, 1).flatten(1))
        queries = queries + self.projection(torch.cat(outputs))
        return queries + self.fc2(F.gelu(self.fc1(self.mlp_norm(queries))))


class CAPIPredictor(nn.Module):
    """The predictor (see the module docstring).

    Args:
        width: the encoder's width (queries, context and outputs).
        depth: cross-attention blocks (lightly's default 12; CAPI's ViT-L decoder 12).
        heads: attention heads; `width / heads` a multiple of 4 (2D RoPE).
        mlp_ratio: the MLP's hidden width over `width`.
        theta: RoPE's frequency base (timm's 10000).
    """

    def __init__(self, width: int, *, depth: int = 12, heads: int = 6,
                 mlp_ratio: float = 4.0, theta: float = 10000.0) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"predictor width {width} is not divisible by its {heads} heads")
        self.rope = Rope2D(width // heads, theta)
        self.mask_token = nn.Parameter(torch.zeros(width))
        self.blocks = nn.ModuleList(CrossAttentionBlock(width, heads, mlp_ratio)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, context: list[torch.Tensor], context_positions: list[torch.Tensor],
                query_positions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Predictions at the masked positions.

        Args:
            context: per image, its visible tokens `[C_i, W]` (the student's output).
            context_positions: per image, their (row, col) `[C_i, 2]`.
            query_positions: per image, the (row, col) `[Q_i, 2]` to predict.

        Returns:
            Per image, `[Q_i, W]`.
        """
        query_counts = [len(p) for p in query_positions]
        context_counts = [len(c) for c in context]
        tokens = torch.cat(context)
        query_rope = self.rope(torch.cat(query_positions))
        context_rope = self.rope(torch.cat(context_positions))
        queries = self.mask_token.to(tokens.dtype).expand(sum(query_counts), -1)
        for block in self.blocks:
            queries = block(queries, tokens, query_rope, context_rope, query_counts,
                            context_counts)
        return list(self.norm(queries).split(query_counts))


def lightly_state_dict(predictor: CAPIPredictor) -> dict[str, torch.Tensor]:
    """`predictor`'s weights under lightly's `CAPIPredictorTIMM` names, the query and key rows
    of each head in timm's interleaved RoPE order (`timm_qk_order`)."""
    width = predictor.mask_token.shape[0]
    heads = predictor.blocks[0].heads if len(predictor.blocks) else 1
    head_dim = width // heads
    rows = torch.cat([h * head_dim + torch.argsort(timm_qk_order(head_dim))
                      for h in range(heads)])  # lightly's row r is our row rows[r]
    state = {"mask_token": predictor.mask_token.detach().reshape(1, 1, -1)}
    for name, value in predictor.state_dict().items():
        if name.startswith("blocks."):
            if ".to_query." in name:
                value = value[rows]
            elif ".to_key_value." in name:  # keys first, then values
                value = torch.cat([value[:width][rows], value[width:]])
            state[name.replace(".fc1.", ".mlp.0.").replace(".fc2.", ".mlp.2.")] = value
        elif name.startswith("norm."):
            state[name] = value
    return state
