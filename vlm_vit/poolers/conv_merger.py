"""GLM-4V's projector (GLM-V team 2025, "GLM-4.1V-Thinking"; transformers' `downsample` and
`Glm4vVisionPatchMerger`): a Conv2d with kernel = stride = m maps each m x m window of patches
to one token of the LLM's width, then Linear, LayerNorm, GELU and a SwiGLU (`down_proj` of
`silu(gate_proj) * up_proj`) keep that width.

Where Qwen2-VL's `patch_merger` concatenates a window and maps it with an MLP, the Conv2d is
the same linear map of the window with its weights laid out `[out, D, m, m]`; it runs here
over the whole row-major grid, so the windows come out row-major (transformers' merge-window
order) without gathering them. A grid the window does not divide is refused, as the patch
merger refuses it: GLM-4V's processor makes sides multiples of patch x merge (28 pixels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.poolers.base import check_count, check_width, register_pooler, split_tokens
from vlm_vit.poolers.patch_merger import MAX_MERGE, MAX_MERGED_WIDTH

NORM_EPS = 1e-5  # nn.LayerNorm's default, which GLM-4V's merger keeps


@register_pooler("conv_merger")
class ConvMerger(nn.Module):
    """Conv2d over m x m windows, then Linear, LayerNorm, GELU and SwiGLU. Prefix tokens are
    dropped.

    Parameter names are transformers' (`downsample`, then the merger's `proj`,
    `post_projection_norm`, `gate_proj`, `up_proj`, `down_proj`), so its weights load as
    they are.

    Args:
        in_dim: token width D.
        out_dim: output width (the LLM's hidden size, GLM-4V's `out_hidden_size`); in_dim
            when None.
        merge_size: m, the window side (`spatial_merge_size`).
        hidden_dim: the SwiGLU's hidden width (GLM-4V's `intermediate_size`); out_dim when
            None.
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, merge_size: int = 2,
                 hidden_dim: int | None = None):
        super().__init__()
        merge_size = check_count("merge_size", merge_size, MAX_MERGE)
        self.in_dim, self.out_dim, self.merge_size = in_dim, out_dim or in_dim, merge_size
        hidden_dim = check_width("hidden_dim", hidden_dim or self.out_dim)
        self.grid_multiple = merge_size  # the grids it takes: sides multiples of this
        window = in_dim * merge_size * merge_size
        if window > MAX_MERGED_WIDTH:
            raise ValueError(f"conv_merger: in_dim {in_dim} x merge_size {merge_size} squared "
                             f"= {window} inputs per window, more than {MAX_MERGED_WIDTH}")
        self.downsample = nn.Conv2d(in_dim, self.out_dim, merge_size, stride=merge_size)
        self.proj = nn.Linear(self.out_dim, self.out_dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(self.out_dim, eps=NORM_EPS)
        self.gate_proj = nn.Linear(self.out_dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(self.out_dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, self.out_dim, bias=False)

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        """Maps `[B, prefix + N, D]` row-major tokens to `[B, N / m^2, out_dim]`, windows
        row-major.

        Raises:
            ValueError: for a grid whose sides are not multiples of the merge size.
        """
        _, patches = split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        rows, cols = grid
        if rows % self.merge_size or cols % self.merge_size:
            raise ValueError(f"conv_merger: a {rows}x{cols} grid is not a whole number of "
                             f"{self.merge_size}x{self.merge_size} windows")
        x = patches.transpose(1, 2).reshape(patches.shape[0], self.in_dim, rows, cols)
        x = self.downsample(x).flatten(2).transpose(1, 2)  # (B, M, out), windows row-major
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return (grid[0] // self.merge_size) * (grid[1] // self.merge_size)
