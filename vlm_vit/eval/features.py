"""One pooled vector per image from a frozen encoder (`extract_features`), and the readers
that give the protocol its images, labels and keys: a class-labelled folder
(`read_class_folder`) and labelled tar shards (`sample_key`, `KeyedDecode`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vlm_vit.data.listing import class_folders
from vlm_vit.model import VisionEncoder
from vlm_vit.presets import POOLINGS as POOLINGS
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)



# -- features from an encoder ---------------------------------------------------------------


def _batches(images, batch_size: int, processor: ImageProcessor):
    """Yields (pixels, labels or None) and says how many batches there will be."""
    if isinstance(images, (list, tuple, np.ndarray, torch.Tensor)):
        if isinstance(images, torch.Tensor) and images.ndim != 4:
            raise ValueError(f"a tensor of images must be [B, C, H, W], got shape "
                             f"{list(images.shape)}")
        if len(images) == 0:
            raise ValueError("got no images to encode")
        total = -(-len(images) // batch_size)

        def generate():
            for start in range(0, len(images), batch_size):
                chunk = images[start:start + batch_size]
                yield processor(chunk if isinstance(chunk, torch.Tensor) else list(chunk)), None
        return generate(), total

    def unpack():
        for index, batch in enumerate(images):
            if isinstance(batch, torch.Tensor):
                yield batch, None
            elif isinstance(batch, dict) and "pixel_values" in batch:
                yield batch["pixel_values"], batch.get("labels", batch.get("label"))
            elif isinstance(batch, (list, tuple)) and len(batch) == 2:
                yield batch[0], batch[1]
            else:
                raise ValueError(f"batch {index} from the loader is a {type(batch).__name__}; "
                                 "expected pixel values [B, C, H, W], (pixels, labels) or a "
                                 "dict with 'pixel_values' and 'labels'")
    return unpack(), len(images) if hasattr(images, "__len__") else None


def _default_processor(encoder: VisionEncoder) -> ImageProcessor:
    """ImageNet normalisation at the encoder's image size, for callers that give none."""
    size = encoder.config.image_size
    logger.info("no processor given: imagenet normalisation at %dx%d", *size)
    return ImageProcessor.for_family("imagenet", size=size)


def extract_features(
    encoder: VisionEncoder,
    images_or_loader: Sequence | torch.Tensor | Iterable,
    *,
    pooling: str = "cls",
    batch_size: int = 32,
    processor: ImageProcessor | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encodes images under `torch.inference_mode()` and pools one vector per image.

    Args:
        encoder: the frozen encoder; it runs in eval mode (its mode is restored after).
        images_or_loader: either images (a list of anything `ImageProcessor` takes: paths,
            PIL images, arrays, tensors; or a `[B, C, H, W]` tensor of raw images in [0, 1]),
            preprocessed `batch_size` at a time; or any other iterable of already
            preprocessed batches (a `DataLoader`): each a pixel tensor `[B, C, H, W]`, a
            `(pixels, labels)` pair, or a dict with `pixel_values` and `labels`.
        pooling: "cls", the class token after the final norm (the paper's representation,
            eq. 4); or "mean", the mean of the final patch tokens (prefix tokens excluded).
            A model without a class token raises for "cls" rather than quietly measuring
            a different representation: ask for "mean".
        batch_size: images per forward pass (images only; a loader batches itself).
        processor: preprocessing for images; default imagenet normalisation at the
            encoder's image size.
        device: where to run; default the encoder's device. The encoder is moved there.
        progress: show a progress bar.

    Returns:
        `[N, D]` float32 CPU features, and the `[N]` labels the loader gave (None for
        images or label-less batches).

    Raises:
        ValueError: for an unknown pooling, "cls" on a model without a class token, a batch
            size below 1, no images, or a loader batch of an unknown shape.
    """
    _check_extraction(encoder, images_or_loader, pooling, batch_size)
    from vlm_vit.poolers import build_pooler

    pooler = build_pooler(pooling, in_dim=encoder.config.width)
    processor = processor or _default_processor(encoder)
    parameter = next(encoder.parameters())
    device = torch.device(device) if device is not None else parameter.device
    encoder.to(device)
    was_training = encoder.training
    encoder.eval()
    batches, total = _batches(images_or_loader, batch_size, processor)
    features, labels, unlabelled = [], [], 0
    try:
        with torch.inference_mode():
            for pixels, batch_labels in tqdm(batches, total=total, desc="extracting features",
                                             unit="batch", disable=not progress):
                out = encoder(pixels.to(device=device, dtype=parameter.dtype))
                pooled = pooler(out.tokens, num_prefix_tokens=out.num_prefix_tokens,
                                grid=out.grid)  # (B, D)
                features.append(pooled.float().cpu())
                if batch_labels is None:
                    unlabelled += 1
                else:
                    labels.append(torch.as_tensor(batch_labels).reshape(-1).cpu())
    finally:
        encoder.train(was_training)
    return _joined(features, labels, unlabelled)


def _check_extraction(encoder: VisionEncoder, images_or_loader: Any, pooling: str,
                      batch_size: int) -> None:
    """`extract_features`'s argument checks, before anything is encoded."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if pooling == "cls" and not encoder.config.class_token:
        raise ValueError("pooling 'cls' needs a class token, and this encoder has none "
                         "(class_token=False); use pooling='mean'")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if isinstance(images_or_loader, (str, os.PathLike)):
        raise ValueError(f"got the single path {str(images_or_loader)!r}; pass a list of "
                         "images (or use evaluate_folder for a class-labelled folder)")


def _joined(features: list[torch.Tensor], labels: list[torch.Tensor], unlabelled: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batches' `[B, D]` features and `[B]` labels as `[N, D]` and `[N]` (None when no
    batch had labels); errors for no batches, or labels on some batches only."""
    if not features:
        raise ValueError("the loader gave no batches")
    if labels and unlabelled:
        raise ValueError(f"{unlabelled} of {len(features)} loader batches had no labels")
    features = torch.cat(features)
    labels = torch.cat(labels) if labels else None
    if labels is not None and len(labels) != len(features):
        raise ValueError(f"the loader gave {len(labels)} labels for {len(features)} images")
    return features, labels


# -- a class-labelled folder ----------------------------------------------------------------


def read_class_folder(root: str | Path) -> tuple[list[Path], np.ndarray, list[str]]:
    """The images of a class-labelled folder (`vlm_vit.data.listing.class_folders`), with the labels
    as an `[N]` array."""
    files, labels, classes = class_folders(root)
    return files, np.asarray(labels), classes


def sample_key(sample: Any) -> str:
    """A shard sample's key for the split (`key_order`): the `path` its json records (the
    image's path relative to the folder `vlm-vit shards` read), else its `__key__`."""
    try:
        record = sample.json()
    except ValueError:  # a json field that is not JSON: the label check reports it
        record = None
    path = record.get("path") if isinstance(record, dict) else None
    return path if isinstance(path, str) and path else sample.key


class _KeyedDecode:
    """A `LabelledDecode` that also records, in order, the key of each sample it decodes
    into an image and a label (the rows `LabelledBatches` yields)."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self.keys: list[str] = []

    def __call__(self, sample: Any) -> Any:
        from vlm_vit.data.samples import UndecodableImage

        item = self.decode(sample)
        if item is not None and not isinstance(item, UndecodableImage):
            self.keys.append(sample_key(sample))
        return item
