"""Per-token projectors into an LLM's width: LLaVA's linear and MLP connectors.

Their parameter names match LLaVA's `mm_projector` (`weight`; `0.weight`, `2.weight`, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.poolers.base import (
    MAX_POOLER_DEPTH,
    TokenWise,
    check_count,
    register_pooler,
    split_tokens,
)


@register_pooler("linear")
class LinearProjector(TokenWise, nn.Linear):
    """One linear layer on every token (LLaVA v1, Liu et al. 2023)."""

    def __init__(self, in_dim: int, out_dim: int | None = None):
        super().__init__(in_dim, out_dim or in_dim)
        self.in_dim, self.out_dim = in_dim, out_dim or in_dim

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        return self.map_tokens(tokens)  # [B, prefix + N, out]

    def map_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.Linear.forward(self, tokens)

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return num_prefix_tokens + grid[0] * grid[1]


@register_pooler("mlp2x_gelu")
class MLPProjector(TokenWise, nn.Sequential):
    """Linear, then (GELU, Linear) x (depth - 1), on every token (LLaVA-1.5, Liu et al. 2024).

    `build_pooler("mlp{N}x_gelu")` gives depth N.
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, depth: int = 2):
        depth = check_count("depth", depth, MAX_POOLER_DEPTH)
        out_dim = out_dim or in_dim
        layers: list[nn.Module] = [nn.Linear(in_dim, out_dim)]
        for _ in range(depth - 1):
            layers += [nn.GELU(), nn.Linear(out_dim, out_dim)]
        super().__init__(*layers)
        self.in_dim, self.out_dim, self.depth = in_dim, out_dim, depth

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        return self.map_tokens(tokens)  # [B, prefix + N, out]

    def map_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.Sequential.forward(self, tokens)

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return num_prefix_tokens + grid[0] * grid[1]
