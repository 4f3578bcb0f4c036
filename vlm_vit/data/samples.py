"""What a dataset item and a batch are, whatever the storage: `UndecodableImage`, `ImageBatch`,
the collates that drop bad files, and `mixed_seed`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch


class UndecodableImage(NamedTuple):
    """What a dataset returns in place of an image it cannot read.

    A bare None would lose the file name on its way out of a worker process; this marker
    carries it to `collate_images`, which drops it and reports the path.

    Attributes:
        path: the file.
        reason: the decoder's error message.
    """

    path: str
    reason: str


@dataclass
class ImageBatch:
    """A collated batch of training images.

    Attributes:
        pixel_values: `[B, 3, H, W]` float32, B the images that decoded; or any batch of B
            samples with `len`, `.to(device)` and `.tensor_split(n)` (the LLM bridge's
            conversations, with several images or none per sample), handed to the objective
            as it is.
        undecodable: the dropped files (path "<unknown>" for a bare None from the dataset),
            or dropped samples, each named with the reason.
        labels: what the objective gets as `labels=`, split with the images over
            micro-batches along the first axis: `[B]` class indices for labelled data
            (`collate_labelled`), or `[B, L]` target token ids padded with -100 (the LLM
            bridge's captions).
    """

    pixel_values: torch.Tensor | Any
    undecodable: list[UndecodableImage] = field(default_factory=list)
    labels: torch.Tensor | None = None


def decoded_items(items: Sequence[Any], kind: type, collate: str, expected: str
                  ) -> tuple[list[Any], list[UndecodableImage]]:
    """The items of type `kind`, in order, and the files that did not decode (None counts as
    one), for the collate function named `collate`.

    Raises:
        TypeError: for an item of any other type, naming `expected`.
    """
    decoded, bad = [], []
    for item in items:
        if isinstance(item, kind):
            decoded.append(item)
        elif isinstance(item, UndecodableImage):
            bad.append(item)
        elif item is None:
            bad.append(UndecodableImage("<unknown>", "the dataset returned None"))
        else:
            raise TypeError(f"{collate} got a {type(item).__name__}; expected {expected}, an "
                            "UndecodableImage or None")
    return decoded, bad


def collate_images(items: Sequence[torch.Tensor | UndecodableImage | None]) -> ImageBatch:
    """Stacks the images of a batch, dropping files that did not decode.

    Args:
        items: `[3, H, W]` tensors, `UndecodableImage` markers, or None.

    Returns:
        The batch; `pixel_values` has 0 rows when nothing decoded.

    Raises:
        TypeError: for an item of any other type.
    """
    images, bad = decoded_items(items, torch.Tensor, "collate_images", "a [3, H, W] tensor")
    pixel_values = torch.stack(images) if images else torch.empty(0)
    return ImageBatch(pixel_values, bad)


def collate_native(items: Sequence[torch.Tensor | UndecodableImage | None]) -> ImageBatch:
    """As `collate_images`, for images of different sizes (`vlm_vit.data.native_crop`):
    `pixel_values` is a `vlm_vit.packing.PackedImages` of them, in order."""
    from vlm_vit.packing import PackedImages

    images, bad = decoded_items(items, torch.Tensor, "collate_native", "a [3, H, W] tensor")
    return ImageBatch(PackedImages(images), bad)


def collate_labelled(items: Sequence[tuple[torch.Tensor, int] | UndecodableImage]
                     ) -> ImageBatch:
    """Stacks `(image [3, H, W], label)` pairs, as `LabelledImageFolder` returns them,
    dropping `UndecodableImage` markers (a shard's bad images) into `undecodable`."""
    bad = [item for item in items if isinstance(item, UndecodableImage)]
    pairs = [item for item in items if not isinstance(item, UndecodableImage)]
    if not pairs:
        return ImageBatch(torch.empty(0), bad, torch.empty(0, dtype=torch.long))
    images, labels = zip(*pairs, strict=True)
    return ImageBatch(torch.stack(images), bad, torch.tensor(labels, dtype=torch.long))


def mixed_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from non-negative integers, e.g. (seed, epoch, index).

    Neighbouring inputs give unrelated seeds, unlike `seed + index`, whose streams overlap
    across epochs.
    """
    state = np.random.SeedSequence(values).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])
