"""Qwen2-VL's patch merger: each 2x2 window of neighbouring patches becomes one token. Every
patch is LayerNormed first, then the window's four tokens are concatenated and an MLP maps
them to the LLM's width (Wang et al. 2024, "Qwen2-VL"; transformers' `PatchMerger`).
Qwen2.5-VL's merger is the same with an RMSNorm (`norm="rmsnorm"`); Qwen3-VL's DeepStack
mergers norm the concatenated window instead (`merged_norm=True`, its `use_postshuffle_norm`).

Unlike `pixel_shuffle` (which norms the merged vector), the norm acts per patch before the
merge, and a grid the window does not divide is refused rather than padded: Qwen2-VL's
processor always makes sides multiples of patch x merge (28 pixels).
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.layers.norm import build_norm
from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.poolers.base import check_count, register_pooler, split_tokens

MAX_MERGE = 8  # Qwen2-VL and Qwen2.5-VL merge 2 x 2
MAX_MERGED_WIDTH = 1 << 18  # in_dim * merge**2: Qwen2-VL's 1280 x 4 = 5120


@register_pooler("patch_merger")
class PatchMerger(nn.Module):
    """LayerNorm per patch, m x m windows concatenated (in Qwen2-VL's window order), then
    Linear, GELU, Linear. Prefix tokens are dropped.

    Parameter names are transformers' (`ln_q`, `mlp.0`, `mlp.2`), so its weights load as
    they are.

    Args:
        in_dim: token width D.
        out_dim: output width (the LLM's hidden size); in_dim when None.
        merge_size: m, the window side (`spatial_merge_size`).
        eps: the norm's epsilon (1e-6 in Qwen2-VL and Qwen2.5-VL).
        norm: "layernorm" (Qwen2-VL) or "rmsnorm" (Qwen2.5-VL).
        merged_norm: norm each window's concatenated m*m*D vector rather than each patch
            (Qwen3-VL's DeepStack mergers).
    """

    def __init__(self, in_dim: int, out_dim: int | None = None, merge_size: int = 2,
                 eps: float = 1e-6, norm: str = "layernorm", merged_norm: bool = False):
        super().__init__()
        merge_size = check_count("merge_size", merge_size, MAX_MERGE)
        self.in_dim, self.out_dim, self.merge_size = in_dim, out_dim or in_dim, merge_size
        self.grid_multiple = merge_size  # the grids it takes: sides multiples of this
        merged = in_dim * merge_size * merge_size
        if merged > MAX_MERGED_WIDTH:
            raise ValueError(f"patch_merger: in_dim {in_dim} x merge_size {merge_size} squared "
                             f"= {merged} merged channels, more than {MAX_MERGED_WIDTH}")
        self.merged_norm = bool(merged_norm)
        self.ln_q = build_norm(norm, merged if self.merged_norm else in_dim, eps)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(),
                                 nn.Linear(merged, self.out_dim))

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        """Maps `[B, prefix + N, D]` row-major tokens to `[B, N / m^2, out_dim]`, windows
        row-major.

        Raises:
            ValueError: for a grid whose sides are not multiples of the merge size.
        """
        _, patches = split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        order = merge_window_order(grid, self.merge_size).to(patches.device)
        x = patches[:, order]  # (B, N, D), each window's m*m patches together
        x = x if self.merged_norm else self.ln_q(x)
        merged = x.reshape(x.shape[0], x.shape[1] // self.merge_size**2, -1)  # (B, M, m*m*D)
        return self.mlp(self.ln_q(merged) if self.merged_norm else merged)

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return (grid[0] // self.merge_size) * (grid[1] // self.merge_size)
