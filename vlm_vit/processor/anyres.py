"""AnyRes tiling: LLaVA-NeXT (Liu et al. 2024) and LLaVA-OneVision (Li et al. 2024).

Pixels: an image is resized, keeping its aspect ratio, to fit the best of a few canvases
(the "pinpoints"), padded with black to fill it, and cut into encoder-sized tiles; a copy of
the whole image squashed to one tile (the base view) goes first: `[1 + rows * cols, 3, t, t]`.

Features: each view is encoded and projected to a `side x side` grid; the tiles' grids are
stitched into one `rows * side x cols * side` grid, the rows or columns that saw only padding
are cut off (by the original size), OneVision shrinks a grid holding more than N tiles' worth
(bilinear), and a learned newline token ends every row. The tokens are the base view's, then
the grid's row by row.

Every integer rule here (canvas choice, resized size, padding, unpadding, downscale) is
transformers' (`select_best_resolution`, `get_patch_output_size`, `unpad_image`,
`pack_image_features`, the processors' `_get_number_of_features`), so token counts and
features agree with theirs exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vlm_vit.config import is_int
from vlm_vit.processor.geometry import MAX_OUTPUT_PIXELS, MAX_SIDE

MAX_TILES = 144  # tiles in one canvas (12 x 12); OneVision's largest pinpoint has 36
MAX_PINPOINTS = 1024
DOWNSCALE_SLACK = 1.1  # OneVision shrinks a grid only past 1.1x its budget's side


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How images are tiled (a processor option) and their features packed (a tower option).

    Attributes:
        pinpoints: the canvases an image may be fitted to, as (height, width) pixels, each a
            multiple of `tile_size`: transformers' `image_grid_pinpoints`, in its order (a tie
            goes to the first). LLaVA-NeXT: (336, 672), (672, 336), (672, 672), (1008, 336),
            (336, 1008).
        tile_size: the encoder's input side, the tile's and the base view's (LLaVA-NeXT: 336).
        base_image: put the whole image, squashed to one tile, before the tiles.
        newline: end every row of the tile grid with the tower's learned `image_newline`.
        max_feature_tiles: OneVision's `anyres_max_N` (N, e.g. 9): a packed grid of more than
            about N tiles' worth of tokens is shrunk (bilinear) to about that; None: never.

    Raises:
        ValueError: on construction, for an empty pinpoint list, a pinpoint that is not a
            multiple of the tile size or needs more than `MAX_TILES` tiles, or a field of the
            wrong type, naming the field and the value.
    """

    pinpoints: tuple[tuple[int, int], ...]
    tile_size: int
    base_image: bool = True
    newline: bool = True
    max_feature_tiles: int | None = None

    def __post_init__(self) -> None:
        tile = self.tile_size
        if not (is_int(tile) and 0 < tile <= MAX_SIDE):
            raise ValueError(f"tiling tile_size must be an int in 1..{MAX_SIDE}, got {tile!r}")
        raw = self.pinpoints
        if not isinstance(raw, (list, tuple)) or not raw or len(raw) > MAX_PINPOINTS:
            raise ValueError(f"tiling pinpoints must be a non-empty list of at most "
                             f"{MAX_PINPOINTS} (height, width) pairs, got {raw!r}")
        pinpoints = tuple(self._check_pinpoint(p, int(tile)) for p in raw)
        for name in ("base_image", "newline"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tiling {name} must be true or false, got "
                                 f"{getattr(self, name)!r}")
        most = self.max_feature_tiles
        if most is not None and not (is_int(most) and 0 < most <= MAX_TILES):
            raise ValueError(f"tiling max_feature_tiles (OneVision's anyres_max_N) must be None "
                             f"or an int in 1..{MAX_TILES}, got {most!r}")
        object.__setattr__(self, "pinpoints", pinpoints)  # frozen: lists to tuples once
        object.__setattr__(self, "tile_size", int(tile))
        if most is not None:
            object.__setattr__(self, "max_feature_tiles", int(most))

    @staticmethod
    def _check_pinpoint(pinpoint: Any, tile: int) -> tuple[int, int]:
        if not (isinstance(pinpoint, (list, tuple)) and len(pinpoint) == 2
                and all(is_int(side) and side > 0 for side in pinpoint)):
            raise ValueError(f"tiling pinpoint {pinpoint!r} is not a (height, width) pair of "
                             f"positive ints")
        height, width = int(pinpoint[0]), int(pinpoint[1])
        if height % tile or width % tile:
            raise ValueError(f"tiling pinpoint ({height}, {width}) is not a multiple of the "
                             f"tile size {tile} on both sides")
        tiles = (height // tile) * (width // tile)
        if tiles > MAX_TILES or height * width > MAX_OUTPUT_PIXELS:
            raise ValueError(f"tiling pinpoint ({height}, {width}) needs {tiles} tiles of "
                             f"{tile}x{tile}, more than the budget of {MAX_TILES} (MAX_TILES)"
                             f" or {MAX_OUTPUT_PIXELS} pixels")
        return height, width

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (pinpoints as lists)."""
        return {"pinpoints": [list(p) for p in self.pinpoints], "tile_size": self.tile_size,
                "base_image": self.base_image, "newline": self.newline,
                "max_feature_tiles": self.max_feature_tiles}

    @classmethod
    def from_dict(cls, d: Any) -> Tiling:
        """Builds a tiling from `to_dict` output.

        Raises:
            ValueError: for something other than a dict, unknown or missing keys, or bad values.
        """
        if not isinstance(d, dict):
            raise ValueError(f"tiling must be a JSON object of {_FIELDS}, got {d!r}")
        if unknown := sorted(set(d) - set(_FIELDS)):
            raise ValueError(f"tiling has unknown keys {unknown}; known: {list(_FIELDS)}")
        if missing := [key for key in ("pinpoints", "tile_size") if key not in d]:
            raise ValueError(f"tiling is missing {missing}")
        return cls(**d)


_FIELDS = tuple(field.name for field in dataclasses.fields(Tiling))


def as_tiling(value: Any) -> Tiling | None:
    """None, a `Tiling`, or its `to_dict` form, as a `Tiling` (or None)."""
    return value if value is None or isinstance(value, Tiling) else Tiling.from_dict(value)


def _check_image_size(tiling: Tiling, image_size: Any) -> tuple[int, int]:
    if not (isinstance(image_size, (list, tuple)) and len(image_size) == 2
            and all(is_int(side) and side > 0 for side in image_size)):
        raise ValueError(f"image size {image_size!r} (height, width) must be two positive ints "
                         f"to tile it (tile_size {tiling.tile_size}, pinpoints "
                         f"{list(tiling.pinpoints)})")
    return int(image_size[0]), int(image_size[1])


# ---- pixels -------------------------------------------------------------------------------

def best_resolution(tiling: Tiling, image_size: tuple[int, int]) -> tuple[int, int]:
    """The pinpoint (height, width) an image is fitted to: the most of its pixels kept after
    a downscale, then the least canvas wasted (LLaVA-NeXT's `select_best_resolution`)."""
    height, width = _check_image_size(tiling, image_size)
    best, most_kept, least_wasted = tiling.pinpoints[0], 0, math.inf
    for canvas_height, canvas_width in tiling.pinpoints:
        scale = min(canvas_width / width, canvas_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_width * canvas_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (canvas_height, canvas_width), kept, wasted
    return best


def fitted_size(image_size: tuple[int, int], canvas: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) an image is resized to inside `canvas`, aspect ratio kept
    (transformers' `get_patch_output_size`): one side fills it, the other is rounded up."""
    height, width = image_size
    canvas_height, canvas_width = canvas
    scale_width, scale_height = canvas_width / width, canvas_height / height
    if scale_width < scale_height:
        return min(math.ceil(height * scale_width), canvas_height), canvas_width
    return canvas_height, min(math.ceil(width * scale_height), canvas_width)


def tile_grid(tiling: Tiling, image_size: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of tiles an image of this (height, width) is cut into."""
    canvas_height, canvas_width = best_resolution(tiling, image_size)
    return canvas_height // tiling.tile_size, canvas_width // tiling.tile_size


def num_views(tiling: Tiling, image_size: tuple[int, int]) -> int:
    """Encoder inputs per image: the tiles, plus the base view when it is on."""
    rows, cols = tile_grid(tiling, image_size)
    return rows * cols + tiling.base_image


def tile_views(tiling: Tiling, image_size: tuple[int, int],
               resize: Callable[[tuple[int, int]], torch.Tensor]) -> torch.Tensor:
    """An image's views, `[num_views, 3, t, t]`: the base view, then the tiles row by row.

    Args:
        tiling: the tiling.
        image_size: the image's (height, width).
        resize: gives the whole image resized to a (height, width), `[3, height, width]` (uint8
            or float in [0, 1]; the padding is 0 in either, black, as in transformers).
    """
    tile = tiling.tile_size
    canvas = best_resolution(tiling, image_size)
    fitted = fitted_size(image_size, canvas)
    top, left = (canvas[0] - fitted[0]) // 2, (canvas[1] - fitted[1]) // 2  # extra goes last
    padded = F.pad(resize(fitted), (left, canvas[1] - fitted[1] - left,
                                    top, canvas[0] - fitted[0] - top))
    rows, cols = canvas[0] // tile, canvas[1] // tile
    tiles = padded.reshape(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4)  # (r, c, 3, t, t)
    views = [resize((tile, tile))[None]] if tiling.base_image else []
    return torch.cat([*views, tiles.reshape(rows * cols, 3, tile, tile)])


# ---- features -----------------------------------------------------------------------------

def unpadded_box(grid: tuple[int, int], image_size: tuple[int, int]
                 ) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the part of a stitched feature grid that saw the image,
    not the padding (transformers' `unpad_image`: equal margins cut on the padded axis)."""
    rows, cols = grid
    height, width = image_size
    if width / height > cols / rows:  # wider than the canvas: padded above and below
        margin = (rows - int(round(height * (cols / width), 7))) // 2
        return margin, rows - margin, 0, cols
    margin = (cols - int(round(width * (rows / height), 7))) // 2
    return 0, rows, margin, cols - margin


def downscaled_grid(grid: tuple[int, int], max_feature_tiles: int | None, side: int
                    ) -> tuple[int, int]:
    """OneVision's `anyres_max_N`: a (rows, cols) grid of more than 1.1^2 x N tiles of
    `side x side` is shrunk by the square root of that excess, sides floored."""
    rows, cols = grid
    if max_feature_tiles is None:
        return grid
    ratio = math.sqrt(rows * cols / (max_feature_tiles * side ** 2))
    if ratio > DOWNSCALE_SLACK:
        return int(rows // ratio), int(cols // ratio)
    return grid


def feature_grid(tiling: Tiling, image_size: tuple[int, int], side: int) -> tuple[int, int]:
    """(rows, cols) of an image's packed tile features (the base view and newlines apart),
    for tiles of `side x side` tokens."""
    rows, cols = tile_grid(tiling, image_size)
    top, bottom, left, right = unpadded_box((rows * side, cols * side), image_size)
    return downscaled_grid((bottom - top, right - left), tiling.max_feature_tiles, side)


def num_image_tokens(tiling: Tiling, image_size: tuple[int, int], side: int) -> int:
    """Exactly how many tokens an image of this (height, width) becomes: the base view's
    `side**2`, the unpadded (and maybe shrunk) grid, and one newline per grid row.

    Args:
        tiling: the tiling.
        image_size: the original image's (height, width).
        side: tokens per tile side after the pooler (CLIP-L/14-336 with an MLP: 24).

    Raises:
        ValueError: for an image size that is not two positive ints, naming the setting.
    """
    rows, cols = feature_grid(tiling, image_size, side)
    return side * side * tiling.base_image + rows * cols + rows * tiling.newline


def stitch_views(features: torch.Tensor, tiling: Tiling, image_size: tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's views `[num_views, side**2, D]` (as `tile_views` orders them) to the base
    view's tokens `[base * side**2, D]` and the tiles' grid stitched and unpadded,
    `[rows, cols, D]` (the first half of LLaVA-NeXT's `pack_image_features`).

    Raises:
        ValueError: when the views do not fit the image size's tile grid.
    """
    rows, cols = tile_grid(tiling, image_size)
    views, tokens, width = features.shape
    side = math.isqrt(tokens)
    if views != rows * cols + tiling.base_image or side * side != tokens:
        raise ValueError(f"features of shape {list(features.shape)} do not fit an image of "
                         f"size {tuple(image_size)}: {rows}x{cols} tiles"
                         f"{' and the base view' if tiling.base_image else ''}, each a square "
                         "grid of tokens")
    base, tiles = features[:tiling.base_image], features[tiling.base_image:]
    grid = tiles.reshape(rows, cols, side, side, width).transpose(1, 2)
    grid = grid.reshape(rows * side, cols * side, width)
    top, bottom, left, right = unpadded_box(tuple(grid.shape[:2]), image_size)
    return base.reshape(-1, width), grid[top:bottom, left:right]


def finish_grid(base: torch.Tensor, grid: torch.Tensor, tiling: Tiling, side: int,
                newline: torch.Tensor | None = None) -> torch.Tensor:
    """The base view's tokens `[B, D]` and an unpadded grid `[rows, cols, D]` (`stitch_views`)
    to the image's tokens: the grid (OneVision) shrunk, a newline after each row, flattened
    after the base view's (the second half of `pack_image_features`)."""
    width = grid.shape[-1]
    target = downscaled_grid(tuple(grid.shape[:2]), tiling.max_feature_tiles, side)
    if target != tuple(grid.shape[:2]):
        grid = (F.interpolate(grid.permute(2, 0, 1)[None], size=target, mode="bilinear")[0]
                .permute(1, 2, 0)) if min(target) \
            else grid.new_zeros(*target, width)  # a thin strip can shrink to nothing
    if tiling.newline:
        if newline is None:
            raise ValueError("this tiling ends every row with a newline token; pass it")
        ends = newline.to(grid)[None, None].expand(grid.shape[0], 1, width)
        grid = torch.cat([grid, ends], dim=1)  # (rows, cols + 1, D)
    return torch.cat([base, grid.reshape(-1, width)])


def pack_features(features: torch.Tensor, tiling: Tiling, image_size: tuple[int, int],
                  newline: torch.Tensor | None = None) -> torch.Tensor:
    """One image's projected views `[num_views, side**2, D]` (as `tile_views` orders them)
    to its tokens `[num_image_tokens, D]` (LLaVA-NeXT's `pack_image_features`).

    Args:
        features: the views' tokens, each a row-major `side x side` grid.
        tiling: the tiling the views were cut by.
        image_size: the original image's (height, width).
        newline: `[D]`, appended to every grid row when `tiling.newline` is on.

    Raises:
        ValueError: when the views do not fit the image size's tile grid, or the newline
            token is missing.
    """
    base, grid = stitch_views(features, tiling, image_size)
    return finish_grid(base, grid, tiling, math.isqrt(features.shape[1]), newline)
