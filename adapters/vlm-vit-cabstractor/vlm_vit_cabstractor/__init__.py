"""C-Abstractor: Honeybee's convolutional projector, packaged as a vlm-vit pooler plugin.

vlm-vit finds :class:`CAbstractor` through the ``vlm_vit.poolers`` entry point
``c_abstractor``. This module imports torch only, never vlm_vit, so loading the entry point
cannot cause a circular import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["CAbstractor"]
__version__ = "0.1.0"


def _positive_int(name: str, value: object) -> int:
    """Returns ``value`` if it is an int > 0 (bools excluded), else raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _output_grid(value: int | Sequence[int]) -> tuple[int, int]:
    """Normalises ``output_grid`` (an int for a square grid, or (rows, cols)) to a pair."""
    if isinstance(value, int) and not isinstance(value, bool):
        pair: tuple[object, ...] = (value, value)
    elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        pair = tuple(value)
    else:
        raise ValueError(f"output_grid must be an int or (rows, cols), got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ValueError(f"output_grid sizes must be positive ints, got {value!r}")
    return pair[0], pair[1]  # type: ignore[return-value]


class _ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of each position of a [B, C, H, W] map (Honeybee's
    LayerNorm2d): per sample and per position, so independent of the batch and of other
    positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, C, H, W] -> [B, H, W, C] -> normalise over C -> [B, C, H, W]
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _RegBlock(nn.Module):
    """Bottleneck residual block (a simplified RegNet block, Honeybee's "RegBlock").

    ``x + conv1x1(SiLU(norm(dwconv3x3(SiLU(norm(conv1x1(x)))))))`` at a constant width.

    Args:
        dim: Channels in and out.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=1, bias=False)
        self.norm1 = _ChannelLayerNorm(dim)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim, bias=False)
        self.norm2 = _ChannelLayerNorm(dim)
        self.conv3 = nn.Conv2d(dim, dim, kernel_size=1)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [B, dim, H, W] to [B, dim, H, W]."""
        y = self.act(self.norm1(self.conv1(x)))  # [B, dim, H, W]
        y = self.act(self.norm2(self.conv2(y)))  # [B, dim, H, W], depthwise 3x3
        return x + self.conv3(y)  # [B, dim, H, W]


class CAbstractor(nn.Module):
    """C-Abstractor projector of Honeybee (Cha et al., CVPR 2024, arXiv:2312.06742).

    Drops the prefix (class/register) tokens, lays the patch tokens out as a
    ``[B, hidden_dim, rows, cols]`` map, runs ``depth`` residual bottleneck blocks,
    adaptive-average-pools the map to ``output_grid``, runs ``depth`` more blocks, and reads
    every pooled position out with an MLP (Linear, SiLU, Linear). The output always has
    ``output_rows * output_cols`` tokens, in row-major order, whatever the input grid.

    The pooling is ``nn.AdaptiveAvgPool2d``: a grid larger than ``output_grid`` is averaged
    over (possibly overlapping) windows; a grid smaller than ``output_grid`` along an axis is
    upsampled by repeating its rows/columns (nearest neighbour), so e.g. a 2x2 grid pooled to
    4x4 yields each input position as a 2x2 block of equal positions before the second stage.

    Normalisation is a LayerNorm over channels at each position (as in Honeybee), never
    BatchNorm, so each sample's output is independent of the rest of the batch. Unlike
    Honeybee, there is no learned absolute position embedding (it would fix the input grid);
    the zero-padded depthwise convolutions give the blocks their sense of position.

    Args:
        in_dim: Width of the input tokens.
        out_dim: Width of the output tokens; defaults to ``in_dim``.
        output_grid: Output grid, an int for a square grid or ``(rows, cols)``. Default 4
            (16 output tokens).
        depth: Residual blocks before and after the pooling (each). 0 leaves only the input
            projection, the pooling and the readout. Default 2.
        hidden_dim: Channels of the convolutional stages; defaults to ``out_dim``.

    Raises:
        ValueError: If a dimension or ``output_grid`` is not a positive int, or ``depth`` is
            negative.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None = None,
        *,
        output_grid: int | tuple[int, int] = 4,
        depth: int = 2,
        hidden_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.in_dim = _positive_int("in_dim", in_dim)
        self.out_dim = _positive_int("out_dim", in_dim if out_dim is None else out_dim)
        self.hidden_dim = _positive_int(
            "hidden_dim", self.out_dim if hidden_dim is None else hidden_dim
        )
        self.output_grid = _output_grid(output_grid)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth must be an int >= 0, got {depth!r}")
        self.depth = depth

        self.proj = nn.Linear(self.in_dim, self.hidden_dim)  # per token, = a 1x1 conv
        self.stage1 = nn.Sequential(*(_RegBlock(self.hidden_dim) for _ in range(depth)))
        self.pool = nn.AdaptiveAvgPool2d(self.output_grid)
        self.stage2 = nn.Sequential(*(_RegBlock(self.hidden_dim) for _ in range(depth)))
        self.readout = nn.Sequential(
            nn.Linear(self.hidden_dim, self.out_dim),
            nn.SiLU(),
            nn.Linear(self.out_dim, self.out_dim),
        )

    def num_output_tokens(self, grid: tuple[int, int], *, num_prefix_tokens: int = 0) -> int:
        """Number of output tokens: ``output_rows * output_cols``, for any grid and prefix.

        Args:
            grid: Input patch grid ``(rows, cols)``; does not affect the result.
            num_prefix_tokens: Prefix tokens of the input; does not affect the result.

        Returns:
            The number of tokens :meth:`forward` returns per sample.
        """
        rows, cols = self.output_grid
        return rows * cols

    def forward(
        self, tokens: torch.Tensor, *, num_prefix_tokens: int, grid: tuple[int, int]
    ) -> torch.Tensor:
        """Projects and pools encoder tokens to a fixed ``output_grid`` of tokens.

        Args:
            tokens: ``[B, num_prefix_tokens + rows * cols, in_dim]``: prefix tokens first,
                then the patch tokens row-major over ``grid``.
            num_prefix_tokens: Leading class/register tokens to drop.
            grid: Patch grid ``(rows, cols)``.

        Returns:
            ``[B, output_rows * output_cols, out_dim]``, row-major over ``output_grid``.

        Raises:
            ValueError: If ``tokens`` is not 3-D or its shape does not match
                ``num_prefix_tokens``, ``grid`` and ``in_dim``.
        """
        if tokens.ndim != 3:
            raise ValueError(
                f"tokens must be [B, N, in_dim], got {tokens.ndim}-D shape {tuple(tokens.shape)}"
            )
        if len(grid) != 2 or any(isinstance(g, bool) or int(g) != g or g <= 0 for g in grid):
            raise ValueError(f"grid must be (rows, cols) of positive ints, got {grid!r}")
        if num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        rows, cols = int(grid[0]), int(grid[1])
        batch, num_tokens, dim = tokens.shape
        if num_tokens != num_prefix_tokens + rows * cols:
            raise ValueError(
                f"tokens shape {tuple(tokens.shape)} has {num_tokens} tokens, expected "
                f"num_prefix_tokens + rows * cols = {num_prefix_tokens} + {rows} * {cols} = "
                f"{num_prefix_tokens + rows * cols} for grid {(rows, cols)}"
            )
        if dim != self.in_dim:
            raise ValueError(
                f"tokens shape {tuple(tokens.shape)} has last dim {dim}, expected "
                f"in_dim = {self.in_dim}"
            )

        x = self.proj(tokens[:, num_prefix_tokens:])  # [B, rows*cols, hidden]
        x = x.transpose(1, 2).reshape(batch, self.hidden_dim, rows, cols)  # [B, hidden, r, c]
        x = self.stage1(x)  # [B, hidden, rows, cols]
        x = self.pool(x)  # [B, hidden, out_rows, out_cols]
        x = self.stage2(x)  # [B, hidden, out_rows, out_cols]
        x = x.flatten(2).transpose(1, 2)  # [B, out_rows*out_cols, hidden], row-major
        return self.readout(x)  # [B, out_rows*out_cols, out_dim]

    def extra_repr(self) -> str:
        return (
            f"in_dim={self.in_dim}, out_dim={self.out_dim}, hidden_dim={self.hidden_dim}, "
            f"output_grid={self.output_grid}, depth={self.depth}"
        )
