"""Image preprocessing: PIL images, arrays, tensors or files to a normalised pixel batch.

The pipeline is: decode (files) -> EXIF orientation -> RGB (alpha composited onto a
background) -> resize -> centre crop -> [0, 1] -> (x - mean) / std. uint8 inputs are
resized with PIL so results match the CLIP and Hugging Face processors; float inputs are
resized with ``torch.nn.functional.interpolate`` (antialiased) to keep their precision.

``resize_mode="native"`` keeps each image's aspect ratio instead (NaViT, Qwen2-VL): no
crop, each side rounded to a multiple of ``patch_multiple`` within a pixel budget (see
``native_size``), so a list of images becomes a list of differently sized tensors.

``tiling`` (AnyRes, LLaVA-NeXT / OneVision, ``anyres.py``) turns each image into its views,
``[1 + tiles, 3, t, t]``, also a list.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vlm_vit.io.files import atomic_write, read_json
from vlm_vit.io.hub import resolve
from vlm_vit.presets import NORMALIZATION as NORMALIZATION  # (mean, std) per family
from vlm_vit.processor.anyres import Tiling, as_tiling, tile_views
from vlm_vit.processor.decode import (
    Decoder,
    ImageTooLargeError,
    _label,
)
from vlm_vit.processor.geometry import (
    MAX_OUTPUT_PIXELS,
    MAX_SIDE,
    PIXEL_CEILING,
    _check_pixel_bound,
    _is_int,
    naflex_size,
    native_size,
)

logger = logging.getLogger(__name__)

PROCESSOR_CONFIG_NAME = "processor_config.json"

RESIZE_MODES = ("shortest_edge", "squash", "native")
CROP_ROUNDINGS = ("round", "floor")
_PIL_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}

ImageInput = Image.Image | np.ndarray | torch.Tensor | str | os.PathLike


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """Turns images into a normalised ``float32`` batch ``[B, 3, H, W]``.

    In ``"native"`` resize mode each image keeps its own aspect ratio and size (within the
    pixel bounds), so the result is a list of ``[3, H_i, W_i]`` tensors instead.

    Attributes:
        resize_mode: ``"shortest_edge"`` scales the image to cover ``size`` keeping its
            aspect ratio, then centre crops (CLIP / timm eval); ``"squash"`` resizes
            straight to ``size`` (Google ViT); ``"native"`` resizes each image to
            ``native_size`` of its own size, without a crop (NaViT, Qwen2-VL).
        resample: ``"bicubic"`` or ``"bilinear"``.
        size: Output (height, width); an int means a square. Each side at most ``MAX_SIDE``
            (16384). Unused in native mode.
        mean: Per-channel mean subtracted after scaling to [0, 1]: 3 finite numbers.
        std: Per-channel standard deviation divided by after subtracting ``mean``: 3 finite
            numbers > 0.
        max_pixels: Larger images are refused before decoding, and no image is resized to
            more pixels than this (or than ``size``, if that is more) before the centre crop;
            at most ``PIXEL_CEILING``. None disables the decoding check, and the resize is
            then bounded by ``PIXEL_CEILING``.
        background: RGB colour (0..255) that transparent pixels are composited onto.
        crop_rounding: How a centre crop's offset ``(resized - size) / 2`` drops a .5:
            ``"round"`` rounds half to even like torchvision's ``center_crop`` (OpenAI CLIP,
            open_clip, timm); ``"floor"`` floors like transformers' ``center_crop``
            (``CLIPImageProcessor``, LLaVA), so an exported model sees our pixels.
        patch_multiple: Native mode (where it is required): every output side is a multiple
            of this, the encoder's patch size or patch size x merge for a pixel-shuffle
            pooler (Qwen2-VL: 14 x 2 = 28); 1..16384 (``MAX_SIDE``).
        min_output_pixels: Native mode: smaller images are scaled up to at least this many
            pixels after resizing (at most ``MAX_OUTPUT_PIXELS``, 16384**2); None: at least
            one ``patch_multiple`` per side.
        max_output_pixels: Native mode: larger images are scaled down to at most this many
            pixels after resizing (a token budget: at most ``max_output_pixels / P**2``
            patches of side P), at most ``MAX_OUTPUT_PIXELS``; None: no bound beyond the
            input's. Not ``max_pixels``, which bounds the input.
        max_aspect_ratio: Shortest-edge and native modes: images whose long side / short side
            is over this are refused (Qwen2-VL's 200; a thin strip would otherwise end one
            patch wide, or, scaled to cover ``size``, become a strip of millions of pixels
            before the crop). A squash resize ends at ``size`` whatever the input's shape,
            and takes any.
        max_num_patches: Native mode: SigLIP 2's NaFlex sizes (``naflex_size``: scaled up or
            down to fill at most this many patches) instead of the output pixel bounds.
        tiling: AnyRes (a ``Tiling``, or its ``to_dict`` form): each image becomes its base
            view and tiles, ``[1 + rows * cols, 3, t, t]`` (``size`` must be ``(t, t)``; not
            with native mode; ``max_aspect_ratio`` unused: the pinpoints bound the output).

    Raises:
        ValueError: on construction, for a field of the wrong type or out of its range,
            naming the field and the value.
    """

    size: tuple[int, int] = (224, 224)
    resize_mode: str = "shortest_edge"
    resample: str = "bicubic"
    mean: tuple[float, float, float] = NORMALIZATION["imagenet"][0]
    std: tuple[float, float, float] = NORMALIZATION["imagenet"][1]
    max_pixels: int | None = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS
    background: tuple[int, int, int] = (255, 255, 255)
    crop_rounding: str = "round"  # torchvision's; "floor" for transformers' processors
    patch_multiple: int | None = None
    min_output_pixels: int | None = None
    max_output_pixels: int | None = None
    max_aspect_ratio: float = 200.0
    tiling: Tiling | None = None
    max_num_patches: int | None = None

    def __post_init__(self) -> None:
        size = (self.size, self.size) if _is_int(self.size) else self.size
        size = tuple(size) if isinstance(size, (tuple, list)) else size
        if not (isinstance(size, tuple) and len(size) == 2
                and all(_is_int(s) and 0 < s <= MAX_SIDE for s in size)):
            raise ValueError(f"size must be a positive int or (height, width) of them "
                             f"(1..{MAX_SIDE} each), got {size!r}")
        size = (int(size[0]), int(size[1]))
        for name, choices in [("resize_mode", RESIZE_MODES), ("resample", tuple(_PIL_RESAMPLE)),
                              ("crop_rounding", CROP_ROUNDINGS)]:
            value = getattr(self, name)
            if not (isinstance(value, str) and value in choices):
                raise ValueError(f"{name} {value!r} is not one of {choices}")
        mean = _finite_triple(self.mean)
        if mean is None:
            raise ValueError(f"mean must be 3 values, one finite number per channel, got "
                             f"{self.mean!r}")
        std = _finite_triple(self.std)
        if std is None or min(std) <= 0:
            raise ValueError(f"std must be 3 values, one finite number > 0 (nonzero) per "
                             f"channel, got {self.std!r}")
        _check_pixel_bound("max_pixels", self.max_pixels, PIXEL_CEILING)
        background = tuple(self.background) if isinstance(self.background, (tuple, list)) \
            else None
        if background is None or len(background) != 3 \
                or not all(_is_int(c) and 0 <= c <= 255 for c in background):
            raise ValueError(f"background must be 3 ints in 0..255, got {self.background!r}")
        max_aspect_ratio = self._check_native_fields()
        tiling = as_tiling(self.tiling)
        if tiling is not None and (self.resize_mode == "native" or size != (tiling.tile_size,) * 2):
            raise ValueError(f"tiling cuts {tiling.tile_size}-pixel tiles: it needs size "
                             f"{(tiling.tile_size,) * 2} and a resize_mode other than 'native', "
                             f"got size {size} and resize_mode {self.resize_mode!r}")
        for name, value in [("size", size), ("mean", mean), ("std", std), ("tiling", tiling),
                            ("background", background), ("max_aspect_ratio", max_aspect_ratio)]:
            object.__setattr__(self, name, value)  # frozen: normalise lists to tuples once

    def _check_native_fields(self) -> float:
        """Validates the native-mode fields; returns ``max_aspect_ratio`` as a float."""
        multiple = self.patch_multiple
        if multiple is not None and not (_is_int(multiple) and 0 < multiple <= MAX_SIDE):
            raise ValueError(f"patch_multiple must be a positive int or None, got {multiple!r} "
                             f"(allowed: 1..{MAX_SIDE})")
        for name in ("min_output_pixels", "max_output_pixels"):
            _check_pixel_bound(name, getattr(self, name), MAX_OUTPUT_PIXELS)
        if self.resize_mode == "native" and self.patch_multiple is None:
            raise ValueError("resize_mode 'native' needs patch_multiple (the patch size, or "
                             "patch size x merge for a pixel-shuffle pooler), got None")
        low, high = self.min_output_pixels, self.max_output_pixels
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_output_pixels {low} is more than max_output_pixels {high}")
        if high is not None and self.patch_multiple is not None \
                and high < self.patch_multiple ** 2:
            raise ValueError(f"max_output_pixels {high} is less than one patch_multiple "
                             f"squared, {self.patch_multiple}**2 = {self.patch_multiple ** 2}")
        budget = self.max_num_patches
        if budget is not None and not (
                _is_int(budget) and self.resize_mode == "native" and low is None and high is None
                and 0 < budget * self.patch_multiple ** 2 <= MAX_OUTPUT_PIXELS):
            raise ValueError(f"max_num_patches {budget!r} needs resize_mode 'native' without "
                             "min/max_output_pixels, and 1..MAX_OUTPUT_PIXELS / patch_multiple**2")
        ratio = self.max_aspect_ratio
        is_real = isinstance(ratio, (int, float, np.integer, np.floating)) \
            and not isinstance(ratio, bool)
        if not (is_real and math.isfinite(ratio) and ratio >= 1):
            raise ValueError(f"max_aspect_ratio must be a finite number >= 1, got {ratio!r}")
        return float(ratio)

    @classmethod
    def for_family(cls, name: str, size: int | tuple[int, int] = (224, 224),
                   **kwargs: Any) -> ImageProcessor:
        """Builds a processor with the mean/std preset of a model family.

        Args:
            name: A key of ``NORMALIZATION`` (``"clip"``, ``"imagenet"``, ``"inception"``).
            size: Output (height, width) or a square side.
            **kwargs: Other fields, e.g. ``resize_mode``.

        Returns:
            The processor.

        Raises:
            ValueError: If ``name`` is not a known family.
        """
        if name not in NORMALIZATION:
            raise ValueError(f"unknown family {name!r}; known: {sorted(NORMALIZATION)}")
        mean, std = NORMALIZATION[name]
        return cls(size=size, mean=mean, std=std, **kwargs)

    # ---- configuration I/O ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Returns the settings as JSON-compatible values (tuples become lists)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.to_dict() if isinstance(v, Tiling) else list(v) if isinstance(v, tuple)
                else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: object = None) -> ImageProcessor:
        """Builds a processor from ``to_dict`` output; missing keys take their defaults.

        Args:
            d: Settings keyed by field name.
            source: The file ``d`` was read from, named in every error.

        Returns:
            The processor.

        Raises:
            TypeError: If ``d`` is not a dict (a ValueError naming ``source`` when given).
            ValueError: If ``d`` has unknown keys or invalid values.
        """
        where = "" if source is None else f"{source}: "
        if not isinstance(d, dict):
            error = TypeError if source is None else ValueError
            raise error(f"{where}processor config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"{where}unknown processor config keys {unknown}; known: "
                             f"{sorted(known)}")
        try:
            return cls(**d)
        except ValueError as e:
            if source is None:
                raise
            raise ValueError(f"{where}{e}") from None

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Writes ``directory/processor_config.json`` atomically, creating ``directory``.

        Args:
            directory: Where to write; created with its parents if missing.

        Returns:
            The directory, as every ``save_pretrained`` returns it.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / PROCESSOR_CONFIG_NAME
        with atomic_write(path, "w") as handle:
            json.dump(self.to_dict(), handle, indent=2, sort_keys=True)
            handle.write("\n")
        logger.info("saved processor config to %s", path)
        return directory

    @classmethod
    def from_pretrained(cls, name: str | os.PathLike) -> ImageProcessor:
        """Reads a processor saved by ``save_pretrained``.

        Args:
            name: The directory holding ``processor_config.json``, or a Hub name of one
                (``org/name[@revision]``, ``hf-hub:org/name``), as
                ``VisionEncoder.from_pretrained`` takes (``vlm_vit.io.hub.resolve``).

        Returns:
            The processor.

        Raises:
            FileNotFoundError: If ``processor_config.json`` does not exist there
                (``vlm_vit.io.hub.NotCachedError`` for a name neither cached nor reachable).
            ValueError: If the file is not valid JSON or holds invalid settings.
        """
        path = resolve(name) / PROCESSOR_CONFIG_NAME
        return cls.from_dict(read_json(path), source=path)

    # ---- preprocessing ----------------------------------------------------------------

    def __call__(self, images: ImageInput | list[ImageInput]
                 ) -> torch.Tensor | list[torch.Tensor]:
        """Preprocesses one image or a list of images.

        Args:
            images: A PIL image, numpy array (HxW, HxWx1, HxWx3 or HxWx4; uint8 or float
                in [0, 1]), tensor ([C, H, W] or a [B, C, H, W] batch, C in 1 or 3),
                file path, or a list mixing these.

        Returns:
            ``float32`` contiguous ``pixel_values`` of shape ``[B, 3, height, width]``. In
            native mode, where sizes differ, a list of B ``float32`` ``[3, H_i, W_i]``
            tensors in input order (a list of one for a single image); with ``tiling``, a
            list of B ``[1 + tiles_i, 3, t, t]`` (the sizes the tower needs: ``tile``).

        Raises:
            ImageLoadError: If a file cannot be read as an image.
            ImageTooLargeError: If an image has more than ``max_pixels`` pixels.
            ValueError: If an array or tensor has an unsupported shape or values, or, in
                native mode, an image's aspect ratio or resized size is out of bounds.
            TypeError: If an input has an unsupported type or dtype.
        """
        out = [self._finish(image, name) for image, name in self._decoded(images)]
        if self.resize_mode == "native" or self.tiling is not None:
            return out  # sizes or view counts differ: no stack
        return torch.stack(out).contiguous()

    def tile(self, images: ImageInput | list[ImageInput]
             ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """With ``tiling``: each image's views ``[1 + tiles_i, 3, t, t]`` (as ``__call__``)
        and its decoded (height, width), which ``VisionTower`` packs by (``image_sizes``).

        Raises:
            ValueError: without ``tiling``; and as ``__call__``.
        """
        if self.tiling is None:
            raise ValueError("tile() needs a processor with tiling (AnyRes); this one has none")
        out = [(self._finish(image, name), _size(image)) for image, name in self._decoded(images)]
        return [views for views, _ in out], [size for _, size in out]

    def _decoded(self, images: ImageInput | list[ImageInput]):
        """Yields (decoded image, name) one input at a time; a 4D tensor is B inputs."""
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        if not items:
            raise ValueError("got an empty list of images")
        count = 0
        for i, item in enumerate(items):
            name = f"images[{i}]" if isinstance(images, (list, tuple)) else "image"
            if isinstance(item, torch.Tensor) and item.ndim == 4:
                for b, t in enumerate(item):
                    count += 1
                    yield self._decoder.from_tensor(t, f"{name}[{b}]"), f"{name}[{b}]"
            else:
                count += 1
                yield self.load(item, name), _label(item, name)
        if not count:
            raise ValueError("got a tensor batch with 0 images")

    def preprocess_one(self, image: ImageInput) -> torch.Tensor:
        """Preprocesses a single image (not a list or a 4D batch).

        Args:
            image: Any single input ``__call__`` accepts.

        Returns:
            ``float32`` ``[3, height, width]``; in native mode ``[3, H, W]`` with H, W from
            ``native_size``; with ``tiling``, the views ``[1 + tiles, 3, t, t]``.
        """
        return self._finish(self.load(image, "image"), _label(image, "image"))

    def load(self, image: Any, name: str = "image") -> Image.Image | torch.Tensor:
        """Decodes one input without resizing: an RGB PIL image (uint8 inputs: files, PIL
        images, uint8 arrays) or a float `[3, H, W]` tensor in [0, 1]; `name` is used in
        errors. Training data pipelines use it to decode exactly as inference does.

        Raises:
            ImageLoadError: for a file, encoded bytes or lazy PIL image that fails to open,
                decode or convert to RGB, whatever PIL raised, naming it (so a pipeline can
                skip and count it).
            ImageTooLargeError: for more than ``max_pixels`` pixels, or PIL's bomb check.
        """
        return self._decoder.load(image, name)

    @property
    def _decoder(self) -> Decoder:
        return Decoder(self.max_pixels, self.background)

    def output_size(self, image: str | os.PathLike | bytes, name: str = "image"
                    ) -> tuple[int, int]:
        """The (height, width) ``__call__`` gives an image file, from its header alone (its
        EXIF orientation applied): how a batch is planned before anything is decoded.

        Args:
            image: A file path, or an encoded file's bytes (named ``name`` in errors).
            name: What errors call bytes, e.g. ``"image shard.tar:key"``.

        Returns:
            ``size``; in native mode, ``native_size`` of the oriented image.

        Raises:
            ImageLoadError: If the file cannot be read as an image.
            ImageTooLargeError: If it has more than ``max_pixels`` pixels.
            ValueError: If its aspect ratio or resized size is out of bounds.
        """
        height, width, label = self._decoder.oriented_size(image, name)
        resized = self._resized_size(height, width, label)
        return resized if self.resize_mode == "native" else self.size

    def _resized_size(self, height: int, width: int, name: str) -> tuple[int, int]:
        if self.resize_mode == "native":
            try:
                if self.max_num_patches is not None:
                    return naflex_size(height, width, patch=self.patch_multiple,
                                       max_num_patches=self.max_num_patches)
                return native_size(height, width, multiple=self.patch_multiple,
                                   min_pixels=self.min_output_pixels,
                                   max_pixels=self.max_output_pixels,
                                   max_aspect=self.max_aspect_ratio)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
        th, tw = self.size
        if self.resize_mode == "squash":
            return th, tw
        # Scale to cover the target: for a square target this is torchvision's
        # Resize(shortest) (long side truncated with int()), as CLIP uses.
        if th * width >= tw * height:  # th/h >= tw/w: height is the binding side
            out = th, max(tw, int(th * width / height))
        else:
            out = max(th, int(tw * height / width)), tw
        self._check_resize(height, width, out, name)
        return out

    def _check_resize(self, height: int, width: int, out: tuple[int, int], name: str) -> None:
        """Refuses a cover resize to ``out`` (before the crop) of an image of extreme aspect
        ratio or whose result has too many pixels (see ``max_aspect_ratio``, ``max_pixels``)."""
        aspect = max(height, width) / min(height, width)
        image = f"{name} (height {height}, width {width})"
        becomes = f"{out[0]} x {out[1]} = {out[0] * out[1]} pixels before the crop"
        if aspect > self.max_aspect_ratio:
            raise ValueError(f"{image} has aspect ratio {aspect:.6g}, more than the maximum "
                             f"{self.max_aspect_ratio:g} (max_aspect_ratio); it would be "
                             f"resized to {becomes}")
        limit = max(self.max_pixels or PIXEL_CEILING, self.size[0] * self.size[1])
        if out[0] * out[1] > limit:
            bound = f"max_pixels={limit}" if limit == self.max_pixels else f"{limit} pixels"
            raise ImageTooLargeError(f"{image} would be resized to {becomes}, more than "
                                     f"{bound}")

    def _crop_offset(self, overhang: int) -> int:
        """Where a centre crop starts, given how many pixels it leaves out on one axis."""
        if self.crop_rounding == "floor":
            return overhang // 2  # transformers' center_crop
        return int(round(overhang / 2.0))  # torchvision's center_crop: .5 rounds to even

    def _resize(self, image: Image.Image | torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """``image`` resized to ``size`` (height, width): uint8 (PIL) or float ``[3, h, w]``."""
        h, w = size
        if isinstance(image, Image.Image):
            image = image.resize((w, h), resample=_PIL_RESAMPLE[self.resample])
            return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
        if (h, w) != tuple(image.shape[1:]):
            image = F.interpolate(image[None], size=(h, w), mode=self.resample,
                                  align_corners=False, antialias=True)[0].clamp_(0, 1)
        return image

    def _finish(self, image: Image.Image | torch.Tensor, name: str) -> torch.Tensor:
        """Resizes, centre crops and normalises to ``float32 [3, height, width]`` (with
        ``tiling``: the views, ``[1 + tiles, 3, t, t]``)."""
        if self.tiling is not None:
            try:
                x = tile_views(self.tiling, _size(image), functools.partial(self._resize, image))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
        else:
            h, w = self._resized_size(*_size(image), name)
            x = self._resize(image, (h, w))
            th, tw = (h, w) if self.resize_mode == "native" else self.size  # native: no crop
            top, left = self._crop_offset(h - th), self._crop_offset(w - tw)
            x = x[..., top:top + th, left:left + tw]
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return ((x - mean) / std).contiguous()


def _size(image: Image.Image | torch.Tensor) -> tuple[int, int]:
    """A decoded image's (height, width)."""
    if isinstance(image, Image.Image):
        return image.height, image.width
    return int(image.shape[1]), int(image.shape[2])


def _finite_triple(values: Any) -> tuple[float, float, float] | None:
    """Three finite numbers (not bools, not strings) as floats; None for anything else."""
    if not (isinstance(values, (tuple, list)) and len(values) == 3):
        return None
    if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
               and math.isfinite(v) for v in values):
        return None
    return (float(values[0]), float(values[1]), float(values[2]))
