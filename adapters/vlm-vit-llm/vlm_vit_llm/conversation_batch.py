"""What the LLM collates build and the loss on it: `ConversationBatch` (records as token
ids, labels and pixels, padded one per row or with a packing plan) and `conversation_loss`,
shared by the caption and the conversation data (`vlm_vit_llm.captions`,
`vlm_vit_llm.conversations`).

With a tiled tower (AnyRes, `VisionTower(tiling=...)`) every image is loaded as a
`TiledImage` (its views and original size, `load_pixels`), each counts the tokens its size
makes (`ImageTokens`), and batches hold the images as lists (padded captions as a
`ConversationBatch`, one record per caption) instead of a stacked tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vlm_vit import ImageProcessor
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.processor import Tiling
from vlm_vit.processor.anyres import num_image_tokens as tiled_tokens
from vlm_vit_llm.batch_types import TiledImage, Video
from vlm_vit_llm.model import MultimodalLM
from vlm_vit_llm.mrope import context_length, token_side
from vlm_vit_llm.packing import LOSS_REDUCTIONS, loss_terms, loss_units, pack_rows, split_rows
from vlm_vit_llm.pixels import Pixels
from vlm_vit_llm.video_processor import VideoProcessor


def load_pixels(processor: ImageProcessor, image: Any,
                video: VideoProcessor | None = None) -> Pixels:
    """One image preprocessed as `MultimodalLM` takes it: `[3, H, W]` pixels
    (`preprocess_one`), or with the processor's tiling a `TiledImage` (`tile`: the views and
    the original size, which sets the image's token count). A `Video` (a `Record`'s clip)
    becomes a `Video` of its frames' pixels `[T, 3, H, W]`: sized together by `video` (the
    model's `video_processor`), else each frame preprocessed alone.

    Raises:
        ValueError: as `preprocess_one` (ImageLoadError, ImageTooLargeError); for a clip with
            a tiling, or whose frames preprocess to different sizes.
    """
    if isinstance(image, Video):
        if processor.tiling is not None:
            raise ValueError("a tiled (AnyRes) tower takes images, not video frames")
        if video is not None:
            return replace(image, frames=video(image.frames, processor))
        frames = [processor.preprocess_one(frame) for frame in image.frames]
        shapes = {tuple(frame.shape) for frame in frames}
        if len(shapes) > 1:
            raise ValueError(f"the frames of a clip preprocess to different sizes {sorted(shapes)}")
        return replace(image, frames=torch.stack(frames))
    if processor.tiling is None:
        return processor.preprocess_one(image)
    views, sizes = processor.tile([image])
    return TiledImage(views[0], sizes[0])


@dataclass(frozen=True)
class ImageTokens:
    """The positions an image takes in the LLM, counted as `MultimodalLM` counts them but
    without the tower, so a collate holding it still pickles cheaply into DataLoader workers.

    Attributes:
        fixed: untiled, every image's count (at the processor's size); tiled, a tile-sized
            image's, only an estimate (for length-grouped and token-budget batches).
        tiling: the tower's tiling (AnyRes), or None: each image counts by its original size.
        tile_side: a tile's tokens per side after the pooler (`VisionTower.tile_side`).
        temporal: frames per temporal patch (a clip of T frames counts ceil(T / temporal)
            images), or None for a tower without temporal patches.
        native_side: for a processor that keeps each image's own size (native resolution,
            as Qwen-VL's), the pixels a side of one LLM token covers: each image counts by
            its pixels (`fixed` is only an estimate then); 0 otherwise.
        native_least: the fewest tokens such an image takes (its processor's
            `min_output_pixels`).
    """

    fixed: int
    tiling: Tiling | None = None
    tile_side: int = 0
    temporal: int | None = None
    native_side: int = 0
    native_least: int = 1

    @classmethod
    def of(cls, mm: MultimodalLM, image_size: tuple[int, int] | None = None) -> ImageTokens:
        """The counts of `mm`'s tower, untiled at `image_size` (default: the processor's)."""
        tiling = mm.tower.tiling
        temporal = mm.tower.encoder.config.temporal_patch_size
        if tiling is None and image_size is None and mm.processor.resize_mode == "native":
            side = token_side(mm.tower)
            estimate = mm.tower.num_image_tokens(mm.processor.size)  # never above the bound
            most = mm.processor.max_output_pixels
            return cls(estimate if most is None else min(estimate, max(1, most // side ** 2)),
                       temporal=temporal, native_side=side,
                       native_least=max(1, (mm.processor.min_output_pixels or 0) // side ** 2))
        if tiling is None:
            return cls(mm.tower.num_image_tokens(image_size or mm.processor.size),
                       temporal=temporal)
        side = tiling.tile_size
        return cls(mm.tower.num_image_tokens((side, side)), tiling, mm.tower.tile_side)

    def __call__(self, pixels: Pixels) -> int:
        """The tokens of one image (or clip) as `load_pixels` gives it."""
        frames = pixels.frames if isinstance(pixels, Video) else None
        one = self.fixed
        if self.native_side:
            height, width = (frames if frames is not None else pixels).shape[-2:]
            one = (height // self.native_side) * (width // self.native_side)
        if frames is not None:
            if self.temporal is None:
                raise ValueError("a clip needs a tower with temporal patches "
                                 "(temporal_patch_size); this one has none")
            return -(-len(frames) // self.temporal) * one
        if self.tiling is None:
            return one
        return tiled_tokens(self.tiling, tuple(pixels.size), self.tile_side)

    @property
    def least(self) -> int:
        """The fewest tokens any image can take: what can be checked before decoding (a
        tiled image has at least its base view's; its grid and newlines can shrink away, and
        without a base view an image still takes a token)."""
        if self.tiling is None:
            return self.native_least if self.native_side else self.fixed
        return max(1, self.tile_side ** 2 * self.tiling.base_image)


def _max_length(mm: MultimodalLM, max_length: int | None) -> int:
    """`max_length`, or the LLM's context; never longer than the context."""
    context = context_length(mm.llm)
    max_length = max_length or context
    if max_length is None:
        raise ValueError("give max_length: the LLM's config has no max_position_embeddings")
    if context is not None and max_length > context:
        raise ValueError(f"max_length {max_length} is longer than the LLM's context of "
                         f"{context}")
    return max_length


def _expanded_length(ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> int:
    """A record's length in the LLM: its text tokens plus its images' tokens (`counts`, one
    per image token in `ids`)."""
    return len(ids) - ids.count(image_token_id) + sum(counts)


def _flattened(items: Sequence[Any]) -> list[Any]:
    """Items, with the lists `TokenBudgetPacks` gives (one pack of items each) opened."""
    return [inner for item in items
            for inner in (item if isinstance(item, list) else [item])]


def _records_batch(rows: list[tuple[list[int], list[int], list[Pixels]]],
                   plan: list[list[int]] | None = None) -> ConversationBatch:
    """Encoded records (ids, labels, images) as a `ConversationBatch`."""
    return ConversationBatch([row[0] for row in rows], [row[1] for row in rows],
                             [row[2] for row in rows], rows=plan)


def _packed_batch(rows: list[tuple[list[int], list[int], list[Pixels]]],
                  image_token_id: int, count_tokens: ImageTokens,
                  max_length: int) -> ConversationBatch:
    """Encoded records as a `ConversationBatch` with its packing plan: first-fit
    decreasing on each record's known length (text tokens plus its images' tokens)."""
    lengths = [_expanded_length(ids, image_token_id, [count_tokens(image) for image in images])
               for ids, _, images in rows]
    return _records_batch(rows, pack_rows(lengths, max_length) if rows else [])


@dataclass
class ConversationBatch:
    """Tokenised conversations for `ConversationObjective`: prompts as token ids (one image
    token per image), labels aligned with them, and each record's pixels.

    It splits into micro-batches and moves to a device like a tensor, so the trainer handles
    it as it handles a pixel batch. Its length is its number of records.

    Attributes:
        rows: None for one padded row per record; else the packing plan, per row the
            indices of the records laid end to end there (`vlm_vit_llm.packing`).
        whole: (records, supervised tokens, records with a supervised token) of the whole
            batch a micro-batch was split from, so each part's loss can be its exact share
            of the whole batch's (`conversation_loss`).
    """

    input_ids: list[list[int]]
    labels: list[list[int]]
    images: list[list[Pixels]]
    rows: list[list[int]] | None = None
    whole: tuple[int, int, int] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.whole is None:
            self.whole = (len(self.input_ids), loss_units(self.labels, "token"),
                          loss_units(self.labels, "record"))

    def __len__(self) -> int:
        return len(self.input_ids)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ConversationBatch:
        images = [[_moved(image, device, non_blocking) for image in row] for row in self.images]
        return replace(self, images=images)

    def tensor_split(self, sections: int) -> list[ConversationBatch]:
        """`sections` near-equal parts in order, as `torch.tensor_split` does: of the
        records, or of the packed rows (whole rows; with fewer rows than `sections`, rows of
        several records are first split, so there are fewer parts only when there are fewer
        records: under data parallelism every rank then runs as many micro-batches)."""
        units = ([[index] for index in range(len(self))] if self.rows is None
                 else split_rows(self.rows, sections))
        size, extra = divmod(len(units), sections)
        parts, start = [], 0
        for part in range(sections):
            end = start + size + (part < extra)
            chosen = units[start:end]
            start = end
            if not chosen and self.rows is not None:
                continue
            records = [index for unit in chosen for index in unit]
            renumbered, rows = iter(range(len(records))), None
            if self.rows is not None:
                rows = [[next(renumbered) for _ in unit] for unit in chosen]
            parts.append(ConversationBatch([self.input_ids[i] for i in records],
                                           [self.labels[i] for i in records],
                                           [self.images[i] for i in records],
                                           rows=rows, whole=self.whole))
        return parts


def _moved(image: Pixels, device: torch.device | str, non_blocking: bool) -> Pixels:
    if isinstance(image, TiledImage):
        return replace(image, views=image.views.to(device, non_blocking=non_blocking))
    if isinstance(image, Video):
        return replace(image, frames=image.frames.to(device, non_blocking=non_blocking))
    return image.to(device, non_blocking=non_blocking)


def conversation_loss(mm: MultimodalLM, batch: ConversationBatch,
                      reduction: str = "token") -> ObjectiveOutput:
    """The loss of a (part of a) `ConversationBatch`, padded or packed, under `reduction`
    (`vlm_vit_llm.packing.loss_terms`): "token", the mean over all supervised tokens of the
    whole batch; "record", the mean over its records of each record's mean.

    vlm-vit's trainer weighs a micro-batch's loss by its share of the records
    (`len(part) / len(whole)`); the loss returned here is the part's exact share of the whole
    batch's loss divided by that weight, so the accumulated gradient is exactly the whole
    batch's under either reduction, however the rows split (one process: under data
    parallelism every rank's mean is averaged).
    """
    prepared = mm.prepare(batch.input_ids, batch.images, token_labels=batch.labels,
                          pack=batch.rows)
    logits = mm.run(replace(prepared, labels=None)).logits
    total, _ = loss_terms(logits, prepared.labels, prepared.record_index, reduction)
    records, tokens, learned = batch.whole
    units = tokens if reduction == "token" else learned
    loss = total / max(units, 1) * (records / len(batch))
    return ObjectiveOutput(loss, {"target_tokens": float(tokens),
                                  "rows": float(logits.shape[0])})


def _checked_reduction(reduction: str) -> str:
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    return reduction
