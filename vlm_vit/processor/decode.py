"""Decoding: files, encoded bytes, PIL images and arrays to RGB, with EXIF orientation,
grayscale, 16-bit, palette, CMYK and transparency handled, and every failure raised as one
of two errors naming the image (`ImageLoadError`, `ImageTooLargeError`)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

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


@dataclasses.dataclass(frozen=True)
class Decoder:
    """Decodes one input to RGB as `ImageProcessor.load` documents, refusing more than
    `max_pixels` pixels and compositing transparency onto `background` (the processor's two
    settings that decoding reads)."""

    max_pixels: int | None
    background: tuple[int, int, int]

    def load(self, image: Any, name: str = "image") -> Image.Image | torch.Tensor:
        """See `ImageProcessor.load`."""
        if isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
            source, label = _encoded(image, name)
            with _decoding(label):
                return self._pil_to_rgb(self._open(source, label), label)
        if isinstance(image, Image.Image):
            self._check_pixels(image.height, image.width, name)  # before a lazy image loads
            with _decoding(name):
                return self._pil_to_rgb(ImageOps.exif_transpose(image), name)
        if isinstance(image, np.ndarray):
            return self._from_array(image, f"array {name}")
        if isinstance(image, torch.Tensor):
            return self.from_tensor(image, name)
        raise TypeError(f"{name} has unsupported type {type(image).__name__}; expected a PIL "
                        "image, numpy array, torch tensor, file path or a list of these")

    def _check_pixels(self, height: int, width: int, name: str) -> None:
        if self.max_pixels is not None and height * width > self.max_pixels:
            raise ImageTooLargeError(f"{name} is {width}x{height} = {height * width} pixels, "
                                     f"more than max_pixels={self.max_pixels}")

    @contextlib.contextmanager
    def _header(self, source: Path | IO[bytes], label: str) -> Iterator[Image.Image]:
        """The image file `source` opened lazily (only its header read) and size-checked."""
        with Image.open(source) as img:
            self._check_pixels(img.height, img.width, label)
            yield img

    def _open(self, source: Path | IO[bytes], label: str) -> Image.Image:
        """Opens, size-checks, then decodes a file (or an encoded file's bytes)."""
        with self._header(source, label) as img:
            img.load()
            return ImageOps.exif_transpose(img)  # a copy, valid after the file closes

    def oriented_size(self, image: str | os.PathLike | bytes, name: str
                      ) -> tuple[int, int, str]:
        """(height, width, how errors name it) of an image file from its header alone, its
        EXIF orientation applied (see `ImageProcessor.output_size`)."""
        source, label = _encoded(image, name)
        with _decoding(label), self._header(source, label) as img:
            width, height = img.size
            if img.getexif().get(_EXIF_ORIENTATION, 1) in _QUARTER_TURNS:
                width, height = height, width
        return height, width, label

    def _pil_to_rgb(self, img: Image.Image, name: str) -> Image.Image:
        mode = img.mode
        if mode == "RGB":
            return img
        if mode == "P":
            if not img.has_transparency_data:
                return img.convert("RGB")
            img, mode = img.convert("RGBA"), "RGBA"
        if mode in _ALPHA_MODES:
            rgba = np.asarray(img if mode == "RGBA" else img.convert("RGBA"))
            return Image.fromarray(_composite(rgba, np.array(self.background)))
        if mode in ("I", "F") or mode.startswith("I;16"):
            return Image.fromarray(_gray_to_uint8(np.asarray(img), mode, name)).convert("RGB")
        try:  # "1", "L", "CMYK", "YCbCr", "RGBX", ... have PIL converters
            return img.convert("RGB")
        except (ValueError, OSError) as e:
            raise ImageLoadError(f"{name} has PIL mode {mode!r}, which cannot be converted to "
                                 f"RGB: {e}") from e

    def from_tensor(self, t: torch.Tensor, name: str) -> Image.Image | torch.Tensor:
        if t.ndim != 3 or t.shape[0] not in (1, 3):
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected [C, H, W] "
                             "or [B, C, H, W] with C = 1 or 3")
        if t.dtype != torch.uint8 and not t.dtype.is_floating_point:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, expected torch.uint8 "
                            "(0..255) or a floating dtype (0..1)")
        if 0 in t.shape[1:]:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, an empty image")
        t = t.detach().cpu()
        t = t if t.dtype == torch.uint8 else t.float()  # bfloat16 has no numpy dtype
        return self._from_array(t.permute(1, 2, 0).numpy(), f"tensor {name}")

    def _from_array(self, arr: np.ndarray, name: str) -> Image.Image | torch.Tensor:
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
            raise ValueError(f"{name} has shape {arr.shape}, expected HxW, HxWx1, HxWx3 or "
                             "HxWx4 (channels last)")
        if arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"{name} has shape {arr.shape}, an empty image")
        if arr.dtype != np.uint8 and arr.dtype.kind != "f":
            raise TypeError(f"{name} has dtype {arr.dtype}, expected uint8 (0..255) or float "
                            "(0..1)")
        self._check_pixels(arr.shape[0], arr.shape[1], name)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float32, copy=False)
            lo, hi = float(arr.min()), float(arr.max())
            if not (lo >= 0.0 and hi <= 1.0):  # also catches NaN
                raise ValueError(f"{name} is float with values in [{lo:.4g}, {hi:.4g}], "
                                 "expected [0, 1] (use uint8 for 0..255)")
        if arr.shape[2] == 4:
            bg = np.array(self.background, dtype=np.float32)
            arr = _composite(arr, bg if arr.dtype == np.uint8 else bg / 255.0)
        elif arr.shape[2] == 1:
            arr = np.repeat(arr, 3, axis=2)
        if arr.dtype == np.uint8:  # resized by PIL like the reference processors
            return Image.fromarray(np.ascontiguousarray(arr))
        return torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)  # [3, H, W]
