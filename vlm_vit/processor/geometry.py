"""Geometry: the bounds on sizes and pixel counts, and the native-resolution size rules
(`native_size`, SigLIP 2's `naflex_size`); the processor's resize and crop use them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: The largest output side (``size``, ``patch_multiple``): the encoder's largest image side.
MAX_SIDE = 16_384
#: ``max_pixels`` may be set up to this, 2**32 pixels (12 GiB as 8-bit RGB); with
#: ``max_pixels=None`` it bounds resizing instead.
PIXEL_CEILING = 1 << 32
#: Native mode's ``min_output_pixels`` and ``max_output_pixels`` may be set up to this: the
#: encoder's largest image, 16384 x 16384 pixels.
MAX_OUTPUT_PIXELS = MAX_SIDE * MAX_SIDE


def native_size(height: int, width: int, *, multiple: int, min_pixels: int | None = None,
                max_pixels: int | None = None, max_aspect: float = 200.0) -> tuple[int, int]:
    """The (height, width) an image is resized to at native resolution.

    Each side is rounded to the nearest multiple of ``multiple`` (at least one multiple).
    If that area is over ``max_pixels``, both sides are scaled by ``1 / beta`` with
    ``beta = sqrt(height * width / max_pixels)`` and floored to multiples; if under
    ``min_pixels``, scaled by ``beta = sqrt(min_pixels / (height * width))`` and ceiled. The
    aspect ratio is kept to within one multiple per side. This is the rule of Qwen2-VL's
    ``smart_resize`` (which uses multiple 28 = patch 14 x merge 2, ``min_pixels`` 3,136 and
    ``max_pixels`` 1,003,520), except that a side shorter than half a multiple becomes one
    multiple instead of being refused.

    Worked numbers, (height, width) -> (height, width):

    - A 1080 x 1920 photo, multiple 14, max 1,003,520 pixels: rounding gives 1078 x 1918
      (2,067,604 pixels, too many); beta = 1.4375, so 751.3 x 1335.7 floors to 742 x 1330
      (986,860 pixels; 53 x 95 = 5,035 patches of 14).
    - The same photo with multiple 28 (Qwen2-VL's): 728 x 1316 (958,048 pixels; 26 x 47 =
      1,222 tokens after a 2 x 2 merge).
    - ``skimage.data.coffee()``, 400 x 600, multiple 16, no bounds: 400 x 608.
    - A 20 x 30 icon, multiple 14, min 3,136 pixels: rounding gives 14 x 28 (392 pixels,
      too few); beta = 2.2862, so 45.7 x 68.6 ceils to 56 x 70 (3,920 pixels).

    Args:
        height: The image's height in pixels.
        width: The image's width in pixels.
        multiple: Every output side is a positive multiple of this: the patch size, or
            patch size x merge for a pixel-shuffle pooler.
        min_pixels: Smaller results are scaled up to at least this many pixels; None: no
            lower bound beyond one multiple per side.
        max_pixels: Larger results are scaled down to at most this many pixels; None: no
            upper bound.
        max_aspect: The largest long side / short side accepted.

    Returns:
        (height, width), each a positive multiple of ``multiple``.

    Raises:
        ValueError: If a size or bound is not a positive int, the bounds are crossed, the
            aspect ratio is over ``max_aspect``, or the result would still be outside the
            bounds (a very thin image whose short side cannot shrink below one multiple).
    """
    for label, value in [("height", height), ("width", width), ("multiple", multiple),
                         ("min_pixels", min_pixels), ("max_pixels", max_pixels)]:
        optional = label.endswith("_pixels")
        if not ((optional and value is None) or (_is_int(value) and value > 0)):
            expected = "a positive int or None" if optional else "a positive int"
            raise ValueError(f"{label} must be {expected}, got {value!r}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"min_pixels {min_pixels} is more than max_pixels {max_pixels}")
    height, width, multiple = int(height), int(width), int(multiple)
    aspect = max(height, width) / min(height, width)
    if aspect > max_aspect:
        raise ValueError(f"image of height {height} and width {width} has aspect ratio "
                         f"{aspect:.4g}, more than the maximum {max_aspect:g}")
    # Python's round (half to even), as smart_resize; a side under half a multiple -> one.
    out_h = max(1, round(height / multiple)) * multiple
    out_w = max(1, round(width / multiple)) * multiple
    if max_pixels is not None and out_h * out_w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        out_h = max(1, math.floor(height / beta / multiple)) * multiple
        out_w = max(1, math.floor(width / beta / multiple)) * multiple
    elif min_pixels is not None and out_h * out_w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        out_h = math.ceil(height * beta / multiple) * multiple
        out_w = math.ceil(width * beta / multiple) * multiple
    too_many = max_pixels is not None and out_h * out_w > max_pixels
    too_few = min_pixels is not None and out_h * out_w < min_pixels
    if too_many or too_few:
        bound = f"max_pixels {max_pixels}" if too_many else f"min_pixels {min_pixels}"
        raise ValueError(f"image of height {height} and width {width} would be resized to "
                         f"{out_h} x {out_w} = {out_h * out_w} pixels (multiples of "
                         f"{multiple}), outside {bound}")
    return out_h, out_w


#: SigLIP 2's NaFlex search (`Siglip2ImageProcessor`): the scale is bisected between
#: ``NAFLEX_SCALE_BOUNDS`` until the bracket is narrower than ``NAFLEX_TOLERANCE`` (the upper
#: bound caps upscaling at 100x). Kept as they are: the checkpoints were trained on these sizes.
NAFLEX_TOLERANCE = 1e-5
NAFLEX_SCALE_BOUNDS = (NAFLEX_TOLERANCE / 10, 100.0)


def naflex_size(height: int, width: int, *, patch: int,
                max_num_patches: int) -> tuple[int, int]:
    """The (height, width) SigLIP 2's NaFlex processor resizes an image to.

    Both sides are scaled by one factor, each rounded *up* to a multiple of ``patch`` (at
    least one patch), and the factor is the largest one bisection finds for which the patch
    grid holds at most ``max_num_patches`` patches: a bisection of [1e-6, 100] to within
    1e-5, keeping the lower end (``NAFLEX_SCALE_BOUNDS``, ``NAFLEX_TOLERANCE``). This
    reproduces transformers' ``get_image_size_for_max_num_patches`` size for size.
    Unlike ``native_size``, small images are scaled *up* to fill the budget, and the aspect
    ratio may drift by up to one patch per side (the rounding is upward on both).

    Worked numbers, (height, width) -> (height, width), patch 16:

    - A 1080 x 1920 photo: 192 x 336 (12 x 21 = 252 patches) with 256; 384 x 672 with 1024.
    - ``skimage.data.coffee()``, 400 x 600: 208 x 304 (13 x 19 = 247 patches) with 256.
    - A 224 x 224 image with 256: 256 x 256 (scaled up to 16 x 16).
    - A 1 x 100,000 strip with 256: 16 x 4096 (one row of 256 patches).

    Args:
        height: The image's height in pixels.
        width: The image's width in pixels.
        patch: The patch size; every output side is a positive multiple of it.
        max_num_patches: The most patches the output may hold (SigLIP 2's ``max_num_patches``,
            256 by default, and the sequence length its padded batches have).

    Returns:
        (height, width), each a positive multiple of ``patch``, with at most
        ``max_num_patches`` patches.

    Raises:
        ValueError: If a size, ``patch`` or ``max_num_patches`` is not a positive int, or no
            scale fits (a side over a million patches long).
    """
    for label, value in [("height", height), ("width", width), ("patch", patch),
                         ("max_num_patches", max_num_patches)]:
        if not (_is_int(value) and value > 0):
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    height, width, patch = int(height), int(width), int(patch)

    def grid(scale: float) -> tuple[int, int]:
        # (rows, cols): each scaled side rounded up to whole patches, at least one
        return (max(1, math.ceil(height * scale / patch)),
                max(1, math.ceil(width * scale / patch)))

    low, high = NAFLEX_SCALE_BOUNDS  # grid(low) is 1 x 1 for sides up to 1e6 patches
    while high - low >= NAFLEX_TOLERANCE:
        middle = (low + high) / 2
        rows, cols = grid(middle)
        if rows * cols <= max_num_patches:
            low = middle
        else:
            high = middle
    rows, cols = grid(low)
    if rows * cols > max_num_patches:  # a side over a million patches: no scale fits
        raise ValueError(f"image of height {height} and width {width} cannot be scaled to at "
                         f"most {max_num_patches} patches of {patch} (the smallest scale, "
                         f"{NAFLEX_SCALE_BOUNDS[0]:g}, gives {rows} x {cols})")
    return rows * patch, cols * patch


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_pixel_bound(name: str, value: Any, high: int) -> None:
    """A pixel count setting: None, or a positive int up to ``high``."""
    if value is not None and not (_is_int(value) and 0 < value <= high):
        raise ValueError(f"{name} must be a positive int or None, got {value!r} (allowed: "
                         f"1..{high})")
