"""Position-embedding similarity (ViT paper, Figure 7 centre): how alike the learned
positions of two patches are."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_similarity(embeddings: torch.Tensor) -> torch.Tensor:
    """The cosine similarity of every patch's position embedding with every other.

    Args:
        embeddings: `[N, D]`, the patch entries of a position table (no class entry),
            row-major over the grid.

    Returns:
        `[N, N]` float32 in [-1, 1]; row n, reshaped to the grid, is patch n's small heatmap.
    """
    if embeddings.ndim != 2:
        raise ValueError(f"position embeddings must be [N, D], got {list(embeddings.shape)}")
    unit = F.normalize(embeddings.detach().double(), dim=-1)
    return (unit @ unit.T).clamp(-1.0, 1.0).float()


def patch_position_embeddings(pos_embed: torch.Tensor, grid: tuple[int, int],
                              class_token: bool) -> torch.Tensor:
    """The patch entries of an encoder's position table.

    Args:
        pos_embed: `[1, class + rows * cols, D]` (`VisionEncoder.pos_embed`).
        grid: the grid the table is for (`config.grid`).
        class_token: whether the table starts with the class token's entry.

    Returns:
        `[rows * cols, D]`.
    """
    expected = int(class_token) + grid[0] * grid[1]
    if pos_embed.ndim != 3 or pos_embed.shape[1] != expected:
        raise ValueError(f"position table {list(pos_embed.shape)} does not fit grid {grid} "
                         f"(expected [1, {expected}, D])")
    return pos_embed[0, int(class_token):]
