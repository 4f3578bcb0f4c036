"""Pixel shuffle: each s x s block of neighbouring patches becomes one token with s^2 times
the channels, then an MLP (InternVL, Chen et al. 2024; Idefics3, Laurencon et al. 2024)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.poolers.base import check_count, register_pooler, split_tokens

MAX_SCALE = 16  # InternVL and Idefics3 merge 2 x 2 to 4 x 4 blocks
MAX_MERGED_WIDTH = 1 << 18  # in_dim * scale**2: Idefics3's 1152 x 16 = 18432


@register_pooler("pixel_shuffle")
class PixelShuffle(nn.Module):
    """Space-to-depth over the patch grid, then LayerNorm, Linear, GELU, Linear (InternVL).

    Prefix tokens are dropped. A grid side that is not a multiple of `scale` is padded with
    zero tokens at the bottom / right, so a rows x cols grid gives exactly
    ceil(rows / s) * ceil(cols / s) tokens.

    Args:
        in_dim: token width D.
        out_dim: output width.
        scale: s, the side of the merged block.
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, scale: int = 2):
        super().__init__()
        scale = check_count("scale", scale, MAX_SCALE)
        self.in_dim, self.out_dim, self.scale = in_dim, out_dim or in_dim, scale
        merged = in_dim * scale * scale
        if merged > MAX_MERGED_WIDTH:
            raise ValueError(f"pixel_shuffle: in_dim {in_dim} x scale {scale} squared = "
                             f"{merged} merged channels, more than {MAX_MERGED_WIDTH}")
        self.mlp = nn.Sequential(nn.LayerNorm(merged), nn.Linear(merged, self.out_dim),
                                 nn.GELU(), nn.Linear(self.out_dim, self.out_dim))

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        _, patches = split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        s, (rows, cols) = self.scale, grid
        x = patches.reshape(-1, rows, cols, self.in_dim)
        x = F.pad(x, (0, 0, 0, -cols % s, 0, -rows % s))  # [B, rows', cols', D], multiples of s
        batch, rows, cols, width = x.shape
        # [B, rows/s, s, cols/s, s, D] -> [B, rows/s, cols/s, s, s, D] -> [B, M, s*s*D]
        x = x.reshape(batch, rows // s, s, cols // s, s, width).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(batch, (rows // s) * (cols // s), s * s * width)
        return self.mlp(x)

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return -(-grid[0] // self.scale) * -(-grid[1] // self.scale)
