"""Window attention as packed segments (Qwen2.5-VL's windowed vision blocks; Swin-like
non-overlapping windows without the shift): reorder an image's tokens so each window's
tokens lie together, and a window is just one more segment of `vlm_vit.layers.varlen`.

Windows tile the patch grid from the top-left corner; those on the bottom and right edges
are cut short when the window does not divide the grid (Qwen2.5-VL pads and drops the pad,
the same windows). Inside a window the tokens keep the merge-window order of
`rope_2d.merge_window_order`, so the reordering and a 2x2 patch merger agree: Qwen2.5-VL's
`window_index` permutes whole merge windows and never splits one.

The order is applied once after the patch embedding (to tokens and RoPE angles alike) and
undone once at the end: blocks with full attention take the image as one segment, for which
the order does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.layers.varlen import Segments


@dataclass(frozen=True)
class WindowPartition:
    """An image's tokens regrouped by window.

    Attributes:
        order: `[rows * cols]` int64; `tokens_row_major[:, order]` puts each window's tokens
            together, windows row-major.
        lengths: tokens per window, in that order (they sum to rows * cols).
    """

    order: torch.Tensor
    lengths: tuple[int, ...]

    def segments(self, backend: str = "auto") -> Segments:
        """The windows as varlen segments. For a packed sequence of several images, concatenate
        the images' `lengths` (and offset each `order` by its image's first token)."""
        return Segments(self.lengths, backend)

    def inverse(self) -> torch.Tensor:
        """`[rows * cols]`: `tokens_window_order[:, inverse]` is row-major again."""
        return torch.argsort(self.order)


def window_partition(
    grid: tuple[int, int], window: int, merge_size: int = 1
) -> WindowPartition:
    """The token order and window lengths of window attention on one image.

    Args:
        grid: (rows, cols) of patches.
        window: the window side in patches (Qwen2.5-VL: `window_size` 112 pixels / patch 14
            = 8); a multiple of `merge_size`.
        merge_size: the patch merger's side (2 in Qwen2.5-VL; 1 without a merger).

    Returns:
        The `WindowPartition`.

    Raises:
        ValueError: for a window below 1 or not a multiple of `merge_size`, a grid the merger
            does not divide, or a window larger than the grid on both sides (one window, which
            is global attention under another name: give those blocks full attention).
    """
    rows, cols = grid
    if window < 1 or window % merge_size:
        raise ValueError(
            f"attention window {window} must be a positive multiple of the merge size "
            f"{merge_size}"
        )
    if window > rows and window > cols:
        raise ValueError(
            f"attention window {window}x{window} is larger than the patch grid {rows}x{cols}: "
            "it would be one window (global attention); use a smaller window or full "
            "attention"
        )
    unit_tokens = merge_window_order(grid, merge_size).reshape(-1, merge_size**2)  # (units, m*m)
    unit_rows, unit_cols, side = rows // merge_size, cols // merge_size, window // merge_size
    units = torch.arange(unit_rows * unit_cols).reshape(unit_rows, unit_cols)
    windows = [units[top:top + side, left:left + side].flatten()
               for top in range(0, unit_rows, side)
               for left in range(0, unit_cols, side)]
    order = unit_tokens[torch.cat(windows)].flatten()
    return WindowPartition(order, tuple(len(w) * merge_size**2 for w in windows))
