"""Image folders for training and evaluation (plain, by class, captions).

Training augmentation (random-resized crop, horizontal flip) draws its randomness from a
generator seeded by (seed, epoch, index), never from the process-wide RNG, so the batches
are the same whatever the number of workers and after a resume in the middle of an epoch.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vlm_vit.data.listing import IMAGE_SUFFIXES, class_folders, image_files
from vlm_vit.data.samples import UndecodableImage, mixed_seed
from vlm_vit.optional import require
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)

def read_caption_lines(path: str | Path) -> list[tuple[str, dict[str, str]]]:
    """The records of a JSON Lines captions file, each `{"image": relative path, "caption":
    text}` with an optional string "prompt", with where each is (`FILE line N`); blank
    lines are skipped. Read by `vlm-vit shards --captions` and the LLM plugin's captions.

    Raises:
        FileNotFoundError: for a missing file.
        ValueError: for a file that is not UTF-8, a line that is not JSON, nests too deeply
            to parse or is not such an object (naming the line), or a file without a caption.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no captions file {path}")
    rows = []
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where} is not JSON: {error}") from None
                except RecursionError:  # json's C scanner recurses once per [ or {
                    raise ValueError(f"{where} is nested too deeply to read (JSON arrays or "
                                     "objects inside one another)") from None
                if not isinstance(row, dict) or not all(
                        isinstance(row.get(key), str) for key in ("image", "caption")) \
                        or not isinstance(row.get("prompt", ""), str):
                    raise ValueError(f"{where} needs string fields 'image' and 'caption' (and "
                                     f"optionally 'prompt'), got {line.strip()[:100]}")
                rows.append((where, row))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from None
    if not rows:
        raise ValueError(f"captions file {path} holds no captions")
    return rows


def find_images(root: str | Path) -> list[Path]:
    """Every image file under `root`, recursively, sorted by path relative to `root`.

    Raises:
        FileNotFoundError: when `root` is not a directory or holds no image file.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist or is not a directory")
    files = image_files(root)
    if not files:
        raise FileNotFoundError(f"no image files under {root} (extensions: "
                                f"{', '.join(sorted(IMAGE_SUFFIXES))})")
    return files



class Augmentation:
    """MAE / DINO training augmentation: random-resized crop, maybe a flip, normalisation.

    Inputs are decoded like `vlm_vit.processor` does (EXIF orientation, alpha composited onto
    white, 16-bit grey scaled) through `decoder.load`. Calling it with a seed draws the crop
    and flip from that seed only, leaving the caller's RNG untouched.

    Args:
        image_size: output side, or (height, width).
        mean: per-channel mean, e.g. `NORMALIZATION["imagenet"][0]`.
        std: per-channel standard deviation.
        scale: range of the crop's area as a fraction of the image (MAE uses (0.2, 1.0)).
        flip: flip horizontally with probability 0.5.
    """

    def __init__(self, image_size: int | tuple[int, int], *, mean: Sequence[float],
                 std: Sequence[float], scale: tuple[float, float] = (0.2, 1.0),
                 flip: bool = True) -> None:
        transforms = require("torchvision.transforms.v2", "train", "training augmentation")
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        # The processor only decodes here; its size and resizing are unused.
        self.decoder = ImageProcessor(size=size, mean=tuple(mean), std=tuple(std))
        self.image_size = size
        self.scale, self.flip = tuple(scale), flip  # for `ImageDecode.folder`
        steps = [transforms.ToImage(),
                 transforms.RandomResizedCrop(size, scale=scale, antialias=True)]
        if flip:
            steps.append(transforms.RandomHorizontalFlip())
        steps += [transforms.ToDtype(torch.float32, scale=True),
                  transforms.Normalize(list(self.decoder.mean), list(self.decoder.std))]
        self.transform = transforms.Compose(steps)

    def __call__(self, image: Any, seed: int) -> torch.Tensor:
        """The augmented `[3, H, W]` image; `image` as `decoder.load` returns it."""
        # torchvision's v2 transforms draw from the global torch RNG; fork it so the draws
        # depend on `seed` only and the caller's RNG is left untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(image)


class ImageFolder(torch.utils.data.Dataset):
    """Unlabelled images for self-supervised pretraining, augmented by `Augmentation` or by
    a ready `augmentation` (e.g. `vlm_vit.data.multicrop.MultiCrop`).

    Args:
        root: searched recursively for image files (see `vlm_vit.data.listing.IMAGE_SUFFIXES`).
        image_size, mean, std, scale, flip: as in `Augmentation`; not with `augmentation`.
        seed: with the epoch and the index, fixes each item's augmentation.
        augmentation: called as `augmentation(image, seed)` on what its `decoder.load`
            returns, in place of an `Augmentation` built from the arguments above.

    Raises:
        FileNotFoundError: when `root` holds no image.
        ValueError: for a negative seed, or for `augmentation` together with any of image_size,
            mean, std, scale and flip, or neither.
    """

    def __init__(
        self,
        root: str | Path,
        image_size: int | tuple[int, int] | None = None,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        scale: tuple[float, float] | None = None,
        flip: bool | None = None,
        seed: int = 0,
        augmentation: Any = None,
    ) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        settings = {"image_size": image_size, "mean": mean, "std": std, "scale": scale,
                    "flip": flip}
        if augmentation is None:
            if image_size is None or mean is None or std is None:
                raise ValueError("ImageFolder needs image_size, mean and std, or a ready "
                                 "augmentation=")
            augmentation = Augmentation(image_size, mean=mean, std=std,
                                        scale=(0.2, 1.0) if scale is None else scale,
                                        flip=True if flip is None else flip)
        elif given := [name for name, value in settings.items() if value is not None]:
            raise ValueError(f"ImageFolder takes augmentation= or {', '.join(given)}, not both")
        self.augmentation = augmentation
        self.root = Path(root)
        self.files = find_images(self.root)
        # What `describe_dataset` records; a multi-crop has no single image size.
        self.image_size = getattr(augmentation, "image_size", None)
        self.transform = getattr(augmentation, "transform", augmentation)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch whose augmentation `__getitem__` draws (the trainer calls this)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor | Any | UndecodableImage:
        """The augmented image `[3, H, W]` (or what `augmentation` returns, e.g. `Views`),
        or an `UndecodableImage` for a file that fails."""
        path = self.files[index]
        try:
            image = self.augmentation.decoder.load(path, str(path))  # as inference decodes
        except ValueError as error:  # ImageLoadError, ImageTooLargeError, odd PIL modes
            return UndecodableImage(str(path), str(error))
        return self.augmentation(image, mixed_seed(self.seed, self.epoch, index))


class LabelledImageFolder(torch.utils.data.Dataset):
    """Labelled images for evaluation (linear probes, k-NN): one sub-folder per class.

    Each image goes through the inference `ImageProcessor` (shortest side resized to the
    output size, centre crop, normalisation), so results do not depend on any RNG. A file
    that fails to decode raises rather than being skipped: a silently smaller evaluation
    set would change the reported accuracy.

    Args:
        root: holds one directory per class; sub-directories within a class count for it.
        image_size: output side, or (height, width).
        mean: per-channel mean.
        std: per-channel standard deviation.
        resample: "bicubic" or "bilinear".

    Attributes:
        classes: the class names (directory names), sorted; a label indexes this list.
        samples: (path, label) per image.

    Raises:
        FileNotFoundError: when `root` does not exist.
        ValueError: with fewer than 2 class directories, or a class without images.
    """

    def __init__(
        self,
        root: str | Path,
        image_size: int | tuple[int, int],
        *,
        mean: Sequence[float],
        std: Sequence[float],
        resample: str = "bicubic",
    ) -> None:
        self.root = Path(root)
        # The same discovery as `vlm_vit.evaluate`, so labels mean the same everywhere.
        files, labels, self.classes = class_folders(self.root)
        self.samples = list(zip(files, labels, strict=True))
        self.processor = ImageProcessor(size=image_size, mean=tuple(mean), std=tuple(std),
                                        resample=resample)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """The preprocessed image `[3, H, W]` and its label.

        Raises:
            ImageLoadError: naming the file that cannot be decoded.
        """
        path, label = self.samples[index]
        return self.processor.preprocess_one(path), label


def describe_dataset(dataset: Any) -> dict[str, Any]:
    """A JSON-ready description of a dataset for the run configuration."""
    if callable(getattr(dataset, "describe", None)):  # a shard stream describes itself
        return dataset.describe()
    info: dict[str, Any] = {"type": type(dataset).__name__}
    with contextlib.suppress(TypeError):  # datasets without a length
        info["length"] = len(dataset)
    for name in ("root", "image_size", "seed"):
        value = getattr(dataset, name, None)
        if value is not None:
            info[name] = str(value) if isinstance(value, Path) else (
                list(value) if isinstance(value, tuple) else value)
    if isinstance(dataset, ImageFolder):
        info["transform"] = repr(dataset.transform)
    return info


__all__ = ["Augmentation", "ImageFolder", "LabelledImageFolder", "describe_dataset",
           "find_images", "read_caption_lines"]
