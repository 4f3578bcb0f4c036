"""Decoding: files, encoded bytes, PIL images and arrays to RGB, with EXIF orientation,
grayscale, 16-bit, palette, CMYK and transparency handled, and every failure raised as one
of two errors naming the image (`ImageLoadError`, `ImageTooLargeError`)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
from PIL import Image, UnidentifiedImageError

logger = logging.getLogger(__name__)

_ALPHA_MODES = frozenset({"LA", "La", "PA", "RGBA", "RGBa"})
_EXIF_ORIENTATION = 0x0112
_QUARTER_TURNS = (5, 6, 7, 8)  # EXIF orientations that swap height and width


class ImageLoadError(ValueError):
    """An image file is missing, unreadable, corrupt, truncated or not an image."""


class ImageTooLargeError(ValueError):
    """An image has more pixels than the processor's ``max_pixels``."""


def _composite(rgba: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Blends ``[H, W, 4]`` colours onto ``background`` (same scale as the colour values)."""
    alpha = rgba[..., 3:].astype(np.float32) / (255.0 if rgba.dtype == np.uint8 else 1.0)
    out = rgba[..., :3].astype(np.float32) * alpha + background.astype(np.float32) * (1 - alpha)
    return np.round(out).astype(np.uint8) if rgba.dtype == np.uint8 else out


def _gray_to_uint8(arr: np.ndarray, mode: str, name: str) -> np.ndarray:
    """Scales a 16-bit, 32-bit int or float grayscale ``[H, W]`` array to 0..255."""
    values = arr.astype(np.float64)
    lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and hi > 255 and hi <= 65535):
        values = values / 257.0  # 65535 -> 255 exactly
    elif mode == "F" and lo >= 0 and hi <= 1:
        values = values * 255.0
    elif lo < 0 or hi > 255:  # no known range: stretch what is there
        logger.warning("%s: %s image has values in [%g, %g]; stretching to 0..255",
                       name, mode, lo, hi)
        values = (values - lo) * (255.0 / (hi - lo) if hi > lo else 0.0)
    return np.clip(np.round(values), 0, 255).astype(np.uint8)


def _encoded(image: str | os.PathLike | bytes, name: str) -> tuple[Path | IO[bytes], str]:
    """What PIL opens for a file path or an encoded file's bytes, and how errors name it."""
    if isinstance(image, (str, os.PathLike)):
        return Path(image), f"image file {str(image)!r}"
    return io.BytesIO(image), name


@contextlib.contextmanager
def _decoding(label: str) -> Iterator[None]:
    """Whatever opening, decoding or converting the image ``label`` raises becomes one of
    ours naming it, so callers can skip and count it: ``ImageTooLargeError`` for PIL's
    decompression-bomb check, ``ImageLoadError`` for anything else (on hostile files PIL
    raises NotImplementedError, TypeError, ... as well as OSError)."""
    try:
        yield
    except (ImageLoadError, ImageTooLargeError, MemoryError):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLargeError(f"{label} is too large: {e}") from e
    except FileNotFoundError as e:
        raise ImageLoadError(f"cannot load {label}: no such file") from e
    except UnidentifiedImageError as e:
        raise ImageLoadError(f"cannot load {label}: not a recognised image format or "
                             "corrupt") from e
    except (OSError, SyntaxError, EOFError, ValueError) as e:  # truncated, bad data
        raise ImageLoadError(f"cannot load {label}: {e}") from e
    except Exception as e:  # PIL's plugins raise anything on crafted files
        raise ImageLoadError(f"cannot load {label}: {type(e).__name__}: {e}") from e


def _label(image: Any, name: str) -> str:
    """How errors after decoding name an input: its position, and its file if it has one."""
    return f"{name} (file {str(image)!r})" if isinstance(image, (str, os.PathLike)) else name
