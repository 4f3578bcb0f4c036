"""Decoders: a raw `Sample` into exactly what the folder datasets return, so the collates are
shared."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from vlm_vit.data.samples import UndecodableImage, mixed_seed
from vlm_vit.data.shards.reader import Sample, ShardProblems, iter_samples

logger = logging.getLogger(__name__)

# -- decoding ---------------------------------------------------------------------------------

class ImageDecode:
    """A sample's image, augmented for pretraining; seeds from (seed, epoch, shard, index).

    Returns a `[3, H, W]` tensor, an `UndecodableImage` naming `shard:key`, or None for a
    sample without an image (the stream counts those).
    """

    def __init__(self, augmentation: Callable[[Any, int], torch.Tensor], seed: int = 0) -> None:
        self.augmentation = augmentation
        self.seed = seed

    def __call__(self, sample: Sample) -> torch.Tensor | UndecodableImage | None:
        data = sample.image()
        if data is None:
            return None
        try:
            image = self.augmentation.decoder.load(data, f"image {sample.name}")
        except ValueError as error:
            return UndecodableImage(sample.name, str(error))
        return self.augmentation(image, mixed_seed(self.seed, sample.epoch,
                                                   sample.shard_index, sample.index))

    def folder(self, root: Path) -> Any:
        """The `ImageFolder` of `root` that augments as this does (same settings and seed)."""
        from vlm_vit.data.folders import ImageFolder

        return ImageFolder(root, augmentation=self.augmentation, seed=self.seed)


class LabelledDecode:
    """A sample's image through the inference processor, and its class label.

    Args:
        processor: the `ImageProcessor` (resize, crop, normalise).
        label_field: None for the `cls` field, else a field of the `json` field.
        num_classes: when given, a label outside 0..num_classes-1 is refused.

    A sample whose label is missing, not an integer or out of range comes back as an
    `UndecodableImage` naming it and the reason, so it is skipped and reported like a bad
    image rather than stopping the run.
    """

    def __init__(self, processor: Any, label_field: str | None = None,
                 num_classes: int | None = None) -> None:
        self.processor = processor
        self.label_field = label_field
        self.num_classes = num_classes

    def __call__(self, sample: Sample) -> tuple[torch.Tensor, int] | UndecodableImage | None:
        data = sample.image()
        if data is None:
            return None
        try:
            label = sample.label(self.label_field)
        except ValueError as error:
            return UndecodableImage(sample.name, str(error))
        if self.num_classes is not None and label >= self.num_classes:
            return UndecodableImage(sample.name, f"class {label} is out of range for "
                                                 f"{self.num_classes} classes")
        try:
            image = self.processor.load(data, f"image {sample.name}")
        except ValueError as error:
            return UndecodableImage(sample.name, str(error))
        return self.processor.preprocess_one(image), label


class LabelledBatches:
    """(pixels `[B, 3, H, W]`, labels `[B]`) batches from shards read once in order (for
    evaluation); what it skips (no image, undecodable) is kept for the report.

    Args:
        shards: the shard URLs.
        decode: a `LabelledDecode`.
        batch_size: samples per batch (the last may be smaller).
        select: keeps a sample when true (e.g. the held-out part of a `KeySplit`).
    """

    def __init__(self, shards: Sequence[str], decode: Callable[[Sample], Any], batch_size: int,
                 select: Callable[[Sample], bool] | None = None) -> None:
        self.shards, self.decode, self.batch_size = list(shards), decode, batch_size
        self.select = select
        self.problems = ShardProblems()
        self.no_image: list[str] = []
        self.undecodable: list[tuple[str, str]] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pixels, labels = [], []
        for sample in iter_samples(self.shards, self.problems):
            if self.select is not None and not self.select(sample):
                continue
            item = self.decode(sample)
            if item is None:
                self.no_image.append(sample.name)
            elif isinstance(item, UndecodableImage):
                self.undecodable.append((item.path, item.reason))
            else:
                pixels.append(item[0])
                labels.append(item[1])
                if len(pixels) == self.batch_size:
                    yield torch.stack(pixels), torch.tensor(labels)
                    pixels, labels = [], []
        if pixels:
            yield torch.stack(pixels), torch.tensor(labels)

    def skipped(self) -> dict[str, int]:
        """The counts, after a warning that names the skipped samples."""
        if self.no_image or self.undecodable:
            named = [f"{name} (no image)" for name in self.no_image[:5]]
            named += self.described(5)
            logger.warning("skipped %d samples without an image and %d whose image or label "
                           "cannot be read: %s%s",
                           len(self.no_image), len(self.undecodable), "; ".join(named),
                           "; ..." if len(self.no_image) > 5 or len(self.undecodable) > 5
                           else "")
        return {"no_image": len(self.no_image), "undecodable": len(self.undecodable),
                "truncated_shards": len(self.problems.truncated)}

    def described(self, count: int) -> list[str]:
        """The first `count` undecodable samples, each named once with its reason."""
        return [reason if name in reason else f"{name}: {reason}"
                for name, reason in self.undecodable[:count]]

