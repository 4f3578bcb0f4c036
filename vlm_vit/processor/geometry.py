"""Geometry: the bounds on sizes and pixel counts, and the native-resolution size rule
(`native_size`); the processor's resize and crop use them."""

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


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_pixel_bound(name: str, value: Any, high: int) -> None:
    """A pixel count setting: None, or a positive int up to ``high``."""
    if value is not None and not (_is_int(value) and 0 < value <= high):
        raise ValueError(f"{name} must be a positive int or None, got {value!r} (allowed: "
                         f"1..{high})")
