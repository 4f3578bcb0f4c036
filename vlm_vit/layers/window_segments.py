"""Window attention as packed segments (Qwen2.5-VL's windowed vision blocks; Swin-like
non-overlapping windows without the shift): reorder an image's tokens so each window's
tokens lie together, and a window is just one more segment of `vlm_vit.layers.varlen`.

Windows tile the patch grid from the top-left corner; those on the bottom and right edges
are cut short when the window does not divide the grid (Qwen2.5-VL pads and drops the pad,
the same windows). Inside a window the tokens keep the merge-window order of
`rope_2d.merge_window_order`, so the reordering and a 2x2 patch merger agree: Qwen2.5-VL's
`window_index` permutes whole merge windows and never splits one.

The encoder keeps its tokens row-major; a windowed block gathers q, k and v into window
order (`Windows.order`), attends within each window and scatters the output back, so every
hidden state stays row-major and blocks with full attention are untouched. Windows are
grouped by length (every image of a packed sequence together), so on a CPU the many
full-size windows run as one batched SDPA call.

Under `torch.export` with a dynamic size the grid is symbolic, so no index can be computed
in Python: there (`GridWindows`) the grid is padded at the bottom and right to whole windows,
cut into `[window * window]` tiles, and the padding masked out of the keys, all as tensor
operations on the symbolic sizes: the same windows, so the same output, for any size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby, pairwise

import torch
import torch.nn.functional as F

from vlm_vit.layers.pos_embed import is_symbolic
from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.layers.varlen import Segments, varlen_attention


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
        ValueError: for a window below 1 or not a multiple of `merge_size`, or a grid the
            merger does not divide. A window larger than the grid is one window over the whole
            image, as in Qwen2.5-VL (whose processor takes images down to 4x4 patches).
    """
    rows, cols = grid
    if window < 1 or window % merge_size:
        raise ValueError(
            f"attention window {window} must be a positive multiple of the merge size "
            f"{merge_size}"
        )
    unit_tokens = merge_window_order(grid, merge_size).reshape(-1, merge_size**2)  # (units, m*m)
    unit_rows, unit_cols, side = rows // merge_size, cols // merge_size, window // merge_size
    units = torch.arange(unit_rows * unit_cols).reshape(unit_rows, unit_cols)
    windows = [units[top:top + side, left:left + side].flatten()
               for top in range(0, unit_rows, side)
               for left in range(0, unit_cols, side)]
    order = unit_tokens[torch.cat(windows)].flatten()
    return WindowPartition(order, tuple(len(w) * merge_size**2 for w in windows))


@dataclass(frozen=True)
class Windows:
    """The windows of a whole sequence (a batch or a packed list of images, end to end).

    Attributes:
        order: `[T]` int64; `tokens[order]` lists each window's tokens together, the windows
            grouped by length.
        lengths: tokens per window, in that order.
        window_ids: `[T]` int64, each token's window (in sequence order), for explicit maps.
        images: the images' segments, for maps per image.
        backend: the attention backend (`varlen.BACKENDS`).
    """

    order: torch.Tensor
    lengths: tuple[int, ...]
    window_ids: torch.Tensor
    images: Segments
    backend: str = "auto"
    runs: tuple[tuple[int, int, int], ...] = field(init=False)  # (start, count, length)

    def __post_init__(self) -> None:
        runs, start = [], 0
        for length, group in groupby(self.lengths):
            count = len(list(group))
            runs.append((start, count, length))
            start += count * length
        object.__setattr__(self, "runs", tuple(runs))


@dataclass(frozen=True)
class GridWindows:
    """The windows of a `[B, rows * cols]` batch of one (symbolic) grid: padded tiles."""

    window: int
    grid: tuple
    batch: int


def build_windows(window: int | None, grids, tokens: int, *, batch: int = 1,
                  backend: str = "auto", device: torch.device | str | None = None
                  ) -> Windows | GridWindows | None:
    """The windows of `batch` copies of `grids` laid end to end (None without a window).

    Args:
        window: the window side in patches (`EncoderConfig.window_size`), or None.
        grids: each image's (rows, cols); its tokens are row-major, with no prefix.
        tokens: the sequence's length, which must be the grids' patches times `batch`.
        batch: copies of the grids (a `[B, T, D]` batch is B copies of one grid).
        backend: as in `varlen.Segments`.
        device: where the index tensors go.

    Returns:
        `Windows`; for a symbolic grid (export with a dynamic size), `GridWindows`.

    Raises:
        ValueError: for no grids, tokens that are not the grids' patches (MAE's `keep`), or
            a symbolic grid in a packed sequence of several images.
    """
    if window is None:
        return None
    if not grids:
        raise ValueError("window attention needs each image's patch grid (grids=[...])")
    if any(is_symbolic(grid) for grid in grids):
        if len(grids) != 1:
            raise ValueError("window attention exports a batch of one size, not a packed "
                             "sequence of several images")
        return GridWindows(window, tuple(grids[0]), batch)
    grids = list(grids) * batch
    if tokens != sum(rows * cols for rows, cols in grids):
        raise ValueError(f"window attention needs every patch of grids {grids} in order, got "
                         f"{tokens} tokens (MAE's keep is not supported with windows)")
    pieces, window_ids, offset, windows_seen = [], [], 0, 0
    for grid in grids:
        partition = window_partition(grid, window)
        parts = (partition.order + offset).split(partition.lengths)
        pieces.extend(parts)
        ids = torch.empty(grid[0] * grid[1], dtype=torch.int64)
        for number, part in enumerate(parts):
            ids[part - offset] = windows_seen + number
        window_ids.append(ids)
        offset, windows_seen = offset + grid[0] * grid[1], windows_seen + len(parts)
    pieces.sort(key=len, reverse=True)  # stable: equal windows together, in sequence order
    return Windows(torch.cat(pieces).to(device), tuple(len(p) for p in pieces),
                   torch.cat(window_ids).to(device),
                   Segments(tuple(r * c for r, c in grids), backend), backend)


def _tile_indices(grid: tuple, window: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index arithmetic for `GridWindows` (tensor operations only, so symbolic sizes pass):

    Returns:
        `gather` `[tiles * window * window]`: the row-major token at each place of each tile
        (tiles row-major over the grid padded to whole windows), `rows * cols` (a zero row
        appended to the tokens) where the place is padding; and `scatter` `[rows * cols]`:
        each row-major token's place among the tiles'.
    """
    rows, cols = grid
    tile_cols = (cols + window - 1) // window
    tiles = (rows + window - 1) // window * tile_cols
    place = torch.arange(tiles * window * window, device=device)
    tile, within = place // (window * window), place % (window * window)
    row = tile // tile_cols * window + within // window
    col = (tile - tile // tile_cols * tile_cols) * window + within % window
    real = (row < rows) & (col < cols)
    gather = torch.where(real, row * cols + col, rows * cols)
    token = torch.arange(rows * cols, device=device)
    row = token // cols  # ONNX's exporter has no remainder by a symbolic size
    col = token - row * cols
    scatter = ((row // window * tile_cols + col // window) * window * window
               + row % window * window + col % window)
    return gather, scatter


def grid_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          windows: GridWindows) -> torch.Tensor:
    """`window_attention` for `GridWindows`: `[B * rows * cols, heads, head_dim]` in, out."""
    (rows, cols), window, batch = windows.grid, windows.window, windows.batch
    heads, head_dim = q.shape[1:]
    gather, scatter = _tile_indices(windows.grid, window, q.device)
    area = window * window

    def tiles(t: torch.Tensor) -> torch.Tensor:
        # (B * rows * cols, heads, head_dim) -> (B * tiles, heads, w * w, head_dim)
        t = t.reshape(batch, rows * cols, heads * head_dim)
        t = torch.cat([t, t.new_zeros(batch, 1, heads * head_dim)], dim=1)  # the padding row
        t = t.index_select(1, gather).reshape(-1, area, heads, head_dim)
        return t.transpose(1, 2)

    keys = (gather < rows * cols).reshape(1, -1, area)  # (1, tiles, w * w): real keys
    mask = keys.expand(batch, -1, -1).reshape(-1, 1, 1, area)
    out = F.scaled_dot_product_attention(tiles(q), tiles(k), tiles(v), attn_mask=mask)
    out = out.transpose(1, 2).reshape(batch, -1, heads * head_dim)  # tiles' places in order
    return out.index_select(1, scatter).reshape(q.shape)


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: Windows | GridWindows,
    need_weights: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Attention within each window of `windows`.

    Args:
        q, k, v: `[T, heads, head_dim]` in sequence order (row-major per image).
        windows: from `build_windows`.
        need_weights: also return each image's maps, `[heads, L_i, L_i]` in its token order,
            zero between tokens of different windows (computed explicitly, softmax in float32).

    Returns:
        The output `[T, heads, head_dim]` in sequence order, and the maps when asked.
    """
    if isinstance(windows, GridWindows):
        if need_weights:
            raise ValueError("attention maps are not exported (need_weights with a symbolic "
                             "grid)")
        return grid_window_attention(q, k, v, windows), None
    if need_weights:
        out, maps = torch.empty_like(q), []
        for start, stop in pairwise(windows.images.offsets):
            # (L, heads, head_dim) -> (heads, L, head_dim)
            qs, ks, vs = (t[start:stop].transpose(0, 1).float() for t in (q, k, v))
            ids = windows.window_ids[start:stop]
            scores = (qs @ ks.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (heads, L, L)
            weights = scores.masked_fill(ids[:, None] != ids[None, :], float("-inf")).softmax(-1)
            out[start:stop] = (weights @ vs).transpose(0, 1).to(q.dtype)
            maps.append(weights)
        return out, tuple(maps)
    q, k, v = (t[windows.order] for t in (q, k, v))  # (T, heads, head_dim), window order
    segments = Segments(windows.lengths, windows.backend)
    if segments.resolve(q) == "segments":
        # one SDPA call per run of equal windows: (count, heads, length, head_dim)
        parts = []
        for start, count, length in windows.runs:
            stop = start + count * length
            qs, ks, vs = (t[start:stop].unflatten(0, (count, length)).transpose(1, 2)
                          for t in (q, k, v))
            parts.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).flatten(0, 1))
        attended = torch.cat(parts) if len(parts) > 1 else parts[0]
    else:
        attended, _ = varlen_attention(q, k, v, segments)
    out = torch.empty_like(attended)
    out[windows.order] = attended  # back to sequence order
    return out, None
