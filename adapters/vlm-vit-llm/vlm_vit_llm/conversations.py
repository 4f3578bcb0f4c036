"""LLaVA's instruction data: conversations (`vlm_vit_llm.records`) with their images
preprocessed (`ConversationDataset`), rendered with the chat template, truncated without
cutting an image and batched (`ConversationCollate`) for `vlm_vit_llm.train`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from vlm_vit import ImageProcessor
from vlm_vit.data.samples import ImageBatch, UndecodableImage
from vlm_vit_llm.batch_types import IGNORE_INDEX
from vlm_vit_llm.chat import bounded_turns, chat_template, tokenize_conversation
from vlm_vit_llm.conversation_batch import (
    ImageTokens,
    Pixels,
    _flattened,
    _max_length,
    _packed_batch,
    _records_batch,
    load_pixels,
)
from vlm_vit_llm.model import MultimodalLM
from vlm_vit_llm.records import BadRecord, ConversationRecords, Turn
from vlm_vit_llm.timestamps import clip_settings, takes_timestamps, timestamped_turns
from vlm_vit_llm.video_processor import VideoProcessor


class ConversationItem(NamedTuple):
    """A record with its images preprocessed."""

    where: str
    turns: list[Turn]
    pixels: list[Pixels]  # as `load_pixels` gives them


class ConversationDataset(torch.utils.data.Dataset):
    """LLaVA-format conversations (`vlm_vit_llm.records`) with their images preprocessed.

    Items are `ConversationItem`s, or an `UndecodableImage` naming the record and the file
    when one of its images does not decode, or the record no longer reads as it did at
    indexing (the file changed; its images, at most `records.MAX_IMAGES`, are counted
    against `max_length` again before any is decoded): the collate drops the record, the
    trainer counts and names it.

    Args:
        records: the indexed file.
        processor: the tower's preprocessing (with a tiling, images load as `TiledImage`s).
        image_tokens: tokens one image takes in the LLM (for `lengths`, and `max_length`
            unless `least_image_tokens` is given); for a tiled tower, an estimate
            (`ConversationCollate.image_tokens`).
        max_length: the longest sequence (`ConversationCollate`'s); records whose images
            alone are longer are dropped from `records` here, before any image is decoded
            (`ConversationRecords.limit_length`). None: no such check.
        least_image_tokens: the fewest tokens an image can take, for that check, when the
            count varies by image size (a tiled tower: `ConversationCollate.least_image_tokens`;
            the collate checks each record's exact count). None: `image_tokens`, exact.
        video_processor: what sizes a video record's frames together (the model's
            `video_processor`); None: each frame as an image.

    Attributes:
        lengths: `[N]` estimated tokens per record (text characters / 4 plus image tokens),
            negative for text-only records: what length-grouped batching sorts by (LLaVA's
            `modality_lengths`).
    """

    def __init__(self, records: ConversationRecords, processor: ImageProcessor,
                 image_tokens: int = 0, max_length: int | None = None, *,
                 least_image_tokens: int | None = None,
                 video_processor: VideoProcessor | None = None):
        self.records, self.processor = records, processor
        self.video_processor = video_processor
        self.root = records.path
        self.max_length = max_length
        self.least_image_tokens = image_tokens if least_image_tokens is None \
            else least_image_tokens
        if max_length is not None:
            if least_image_tokens is None or least_image_tokens == image_tokens:  # untiled
                records.limit_length(max_length, image_tokens,  # a video: at least one image's
                                     exact=not getattr(records, "has_videos", False))
            else:
                records.limit_length(max_length, least_image_tokens, exact=False)
        estimate = records.text_lengths // 4 + records.image_counts * image_tokens + 1
        self.lengths = np.where(records.image_counts > 0, estimate, -estimate)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> ConversationItem | UndecodableImage:
        try:
            record = self.records[index]
        except BadRecord as bad:  # the file changed after indexing
            return UndecodableImage(bad.where, bad.reason)
        least = len(record.images) * self.least_image_tokens  # changed, too: before decoding
        if self.max_length is not None and least > self.max_length:
            return UndecodableImage(record.where, f"its {len(record.images)} image(s) take at "
                                    f"least {least} tokens, more than max_length "
                                    f"{self.max_length}")
        pixels = []
        for path in record.images:
            try:
                pixels.append(load_pixels(self.processor, path, self.video_processor))
            except (ValueError, OSError) as error:  # ImageLoadError, ImageTooLargeError, I/O
                return UndecodableImage(f"{record.where} image {path}", str(error))
        return ConversationItem(record.where, record.turns, pixels)


def truncate(ids: list[int], image_token_id: int, image_tokens: int | Sequence[int],
             max_length: int) -> int:
    """How many leading tokens to keep so the sequence, each image token expanded to
    `image_tokens` positions (one count for every image, or each image's in order), fits in
    `max_length` without cutting through an image.

    Returns:
        The number of prompt tokens to keep (all of them when the sequence fits).
    """
    counts = itertools.repeat(image_tokens) if isinstance(image_tokens, int) \
        else iter(image_tokens)
    length = 0
    for position, token in enumerate(ids):
        length += next(counts) if token == image_token_id else 1
        if length > max_length:
            return position
    return len(ids)


class ConversationCollate:
    """Renders and tokenises records with the chat template (`vlm_vit_llm.chat`), truncates
    them to `max_length` without ever cutting an image, and batches them as an `ImageBatch`
    holding a `ConversationBatch`. Holds the tokenizer and a few numbers, so it pickles
    cheaply into DataLoader workers.

    Records are dropped, each named with the reason as an `UndecodableImage` the trainer
    counts and logs, when: an image does not decode; its images alone do not fit in
    `max_length`; or truncation leaves no assistant token to learn. With a tiled tower each
    image counts the tokens of its original size (`ImageTokens`).

    Args:
        mm: the model whose tokenizer, image token and tower to use.
        template: "auto" (the tokenizer's own chat template, else `vicuna_v1`) or a preset
            name from `vlm_vit_llm.chat.PRESETS`.
        max_length: the longest sequence, image tokens included (default: the LLM's context);
            with `packing`, the longest packed row as well.
        image_size: the preprocessed image size (default: the processor's); untiled only.
        packing: pack the batch's records into rows of at most `max_length` tokens
            (first-fit decreasing on each record's length after truncation: text tokens plus
            its images' tokens), positions restarting per record (`vlm_vit_llm.packing`).

    Attributes:
        image_tokens: tokens one image takes (a tiled tower's: a tile-sized image's, an
            estimate for `ConversationDataset.lengths`).
        least_image_tokens: the fewest tokens one image can take (untiled: `image_tokens`),
            for `ConversationDataset`'s check before decoding.
    """

    def __init__(self, mm: MultimodalLM, template: str = "auto", max_length: int | None = None,
                 image_size: tuple[int, int] | None = None, *, packing: bool = False):
        self.packing = packing
        self.tokenizer, self.image_token_id = mm.tokenizer, mm.image_token_id
        self.image_token = mm.image_token
        self.template = chat_template(mm.tokenizer, template)
        if image_size is not None and mm.tower.tiling is not None:
            raise ValueError(f"image_size {image_size} is for an untiled tower; a tiled "
                             "tower counts each image by its original size")
        self.count_tokens = ImageTokens.of(mm, image_size)
        self.image_tokens, self.least_image_tokens = (self.count_tokens.fixed,
                                                      self.count_tokens.least)
        self.max_length = _max_length(mm, max_length)
        self.clips = clip_settings(mm) if takes_timestamps(mm) else None  # Qwen3-VL's

    def encode(self, item: ConversationItem) -> tuple[list[int], list[int], list[Pixels]]:
        """Ids, labels and pixels of one record after truncation (Qwen3-VL's clips as
        timestamped temporal patches, `vlm_vit_llm.timestamps`).

        Raises:
            ValueError: naming the record when it cannot be used (see the class docstring).
        """
        turns, pixels = item.turns, item.pixels
        if self.clips is not None:
            turns, pixels = timestamped_turns(turns, pixels, self.clips)
        counts = [self.count_tokens(one) for one in pixels]
        ids, labels = self._truncated(turns, counts)
        return ids, labels, pixels[:ids.count(self.image_token_id)]

    def _truncated(self, all_turns: Sequence[Turn], counts: list[int]
                   ) -> tuple[list[int], list[int]]:
        """Ids and labels of a record whose images take `counts` tokens, after truncation."""
        # Only the turns that can reach max_length tokens are rendered (`bounded_turns`).
        turns = bounded_turns(all_turns, self.max_length)
        ids, labels = tokenize_conversation(self.tokenizer, turns, self.template)
        placeholders = ids.count(self.image_token_id)
        images = len(counts) if turns == list(all_turns) else sum(  # the kept ones
            turn.text.count(self.image_token) for turn in turns if turn.role == "user")
        if placeholders != images:
            raise ValueError(f"the tokenizer reads {placeholders} image tokens for "
                             f"{images} image(s)")
        if sum(counts) > self.max_length:
            raise ValueError(f"its {len(counts)} image(s) take {sum(counts)} tokens, more "
                             f"than max_length {self.max_length}")
        keep = truncate(ids, self.image_token_id, counts, self.max_length)
        ids, labels = ids[:keep], labels[:keep]
        if all(label == IGNORE_INDEX for label in labels):
            raise ValueError(f"no assistant token is left within max_length {self.max_length}")
        return ids, labels

    def drops_all(self, records: ConversationRecords) -> list[tuple[str, str]] | None:
        """Whether this collate would drop every record of `records`, judged before any
        image is decoded: on the text, each image (or clip) counted at the fewest tokens it
        can take (`least_image_tokens`), so a record dropped here is dropped in training too.
        Reading stops at the first record kept: a usable file costs one record.

        Returns:
            None when a record is kept; else every record's (where, why it is dropped).
        """
        dropped = []
        for index in range(len(records)):
            try:
                record = records[index]
                self._truncated(record.turns, [self.least_image_tokens] * len(record.images))
            except BadRecord as bad:  # the file changed after indexing
                dropped.append((bad.where, bad.reason))
            except ValueError as error:
                dropped.append((record.where, str(error)))
            else:
                return None
        return dropped

    def __call__(self, items: Sequence[ConversationItem | UndecodableImage]) -> ImageBatch:
        items = _flattened(items)
        dropped = [item for item in items if isinstance(item, UndecodableImage)]
        rows = []
        for item in items:
            if isinstance(item, UndecodableImage):
                continue
            try:
                rows.append(self.encode(item))
            except ValueError as error:
                dropped.append(UndecodableImage(item.where, str(error)))
        if self.packing:
            return ImageBatch(_packed_batch(rows, self.image_token_id, self.count_tokens,
                                            self.max_length), dropped)
        return ImageBatch(_records_batch(rows), dropped)
