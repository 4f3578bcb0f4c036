"""LLaVA's two training stages on vlm-vit's trainer, from a folder of captioned images.

    data = CaptionFolder("images/", "captions.jsonl", mm.processor)
    mm.train_projector_only()                          # stage 1: the projector alone
    # mm.add_lora(r=16)                                 # stage 2: + LoRA on the LLM
    Trainer(CaptionObjective(mm), data, TrainConfig(...), "runs/s1",
            collate=CaptionCollate(mm, prompt="<image>\n")).fit()  # writes runs/s1/model/

Captions file: JSON lines, one per image, `{"image": "relative/path.jpg", "caption": "..."}`
(paths relative to the image folder). A line may carry its own `"prompt"` (with the image
token once), as instruction data does (`{"image": ..., "prompt": "<image>\nWhat is it?",
"caption": "A dog."}`); the others get the collate's prompt. The loss is on the caption tokens
(and the end of sequence) only, never on the prompt or the image positions.

With a tiled tower (AnyRes, `VisionTower(tiling=...)`) every image is loaded as a
`TiledImage` (its views and original size, `load_pixels`), each counts the tokens its size
makes (`ImageTokens`), and batches hold the images as lists (padded captions as a
`ConversationBatch`, one record per caption) instead of a stacked tensor.

Tar shards (`vlm-vit shards --captions` / `--llava`) stream through `ShardStream` with
`CaptionShardDecode` / `ConversationShardDecode`, which give the same items as `CaptionFolder`
/ `ConversationDataset`, for the same collates:

    stream = ShardStream("shards/{00000..00031}.tar", CaptionShardDecode(mm.processor))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from vlm_vit import ImageProcessor
from vlm_vit.data.folders import read_caption_lines
from vlm_vit.data.samples import ImageBatch, UndecodableImage
from vlm_vit.files import resolves_inside
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.processor import Tiling
from vlm_vit.processor.anyres import num_image_tokens as tiled_tokens
from vlm_vit_llm.chat import bounded_turns, chat_template, tokenize_conversation
from vlm_vit_llm.model import IGNORE_INDEX, MultimodalLM, TiledImage, target_ids
from vlm_vit_llm.objective import BridgeObjective
from vlm_vit_llm.packing import LOSS_REDUCTIONS, loss_terms, loss_units, pack_rows, split_rows
from vlm_vit_llm.records import BadRecord, ConversationRecords, Turn, parse_record

Pixels = torch.Tensor | TiledImage  # `[3, H, W]`, or a tiled tower's views with their size


def load_pixels(processor: ImageProcessor, image: Any) -> Pixels:
    """One image preprocessed as `MultimodalLM` takes it: `[3, H, W]` pixels
    (`preprocess_one`), or with the processor's tiling a `TiledImage` (`tile`: the views and
    the original size, which sets the image's token count).

    Raises:
        ValueError: as `preprocess_one` (ImageLoadError, ImageTooLargeError).
    """
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
    """

    fixed: int
    tiling: Tiling | None = None
    tile_side: int = 0

    @classmethod
    def of(cls, mm: MultimodalLM, image_size: tuple[int, int] | None = None) -> ImageTokens:
        """The counts of `mm`'s tower, untiled at `image_size` (default: the processor's)."""
        tiling = mm.tower.tiling
        if tiling is None:
            return cls(mm.tower.num_image_tokens(image_size or mm.processor.size))
        side = tiling.tile_size
        return cls(mm.tower.num_image_tokens((side, side)), tiling, mm.tower.tile_side)

    def __call__(self, pixels: Pixels) -> int:
        """The tokens of one image as `load_pixels` gives it."""
        if self.tiling is None:
            return self.fixed
        return tiled_tokens(self.tiling, tuple(pixels.size), self.tile_side)

    @property
    def least(self) -> int:
        """The fewest tokens any image can take: what can be checked before decoding (a
        tiled image has at least its base view's; its grid and newlines can shrink away)."""
        if self.tiling is None:
            return self.fixed
        return self.tile_side ** 2 * self.tiling.base_image


class Caption(NamedTuple):
    """One line of a captions file."""

    image: Path
    caption: str
    prompt: str | None = None  # None: the collate's prompt


def read_captions(captions_file: str | Path, root: str | Path) -> list[Caption]:
    """The lines of a JSON lines captions file (see the module docstring).

    Raises:
        FileNotFoundError: for a missing captions file or image (naming the line).
        ValueError: for a line that is not an object with string "image" and "caption" (and
            a string "prompt", if any), a line whose image resolves outside `root` (`..`, an
            absolute path, a symbolic link out), or an empty file.
    """
    root = Path(root)
    resolved_root = root.resolve()
    rows = []
    for where, row in read_caption_lines(captions_file):
        path = root / row["image"]
        if not resolves_inside(path, resolved_root):
            raise ValueError(f"{where}: image {row['image']!r} resolves outside the image "
                             f"folder {root}")
        if not path.is_file():
            raise FileNotFoundError(f"{where}: no image {path}")
        rows.append(Caption(path, row["caption"], row.get("prompt")))
    return rows


class CaptionFolder(torch.utils.data.Dataset):
    """Images with captions (see the module docstring), preprocessed as at inference.

    Items are `(pixels, caption, prompt or None)`, the pixels as `load_pixels` gives them
    (`[3, H, W]`, or a `TiledImage` for a tiled tower), with an `UndecodableImage` in
    place of the pixels for a file that does not decode (the trainer skips it and names it).
    """

    def __init__(self, root: str | Path, captions_file: str | Path, processor: ImageProcessor):
        self.root = Path(root)
        self.rows = read_captions(captions_file, root)
        self.processor = processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Pixels | UndecodableImage, str, str | None]:
        path, caption, prompt = self.rows[index]
        try:
            return load_pixels(self.processor, path), caption, prompt
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(str(path), str(error)), caption, prompt


class CaptionCollate:
    """Collates `CaptionFolder` items into an `ImageBatch` whose labels are `[B, 2, L]` token
    ids padded with `IGNORE_INDEX`: row 0 the prompt (the item's own, else `prompt`), row 1 the
    caption and end of sequence. Holds only the tokenizer, so it pickles cheaply into
    DataLoader workers.

    With `packing`, the batch is instead a `ConversationBatch` (prompt and caption as one
    record each) packed into rows of at most `max_length` tokens (`vlm_vit_llm.packing`); a
    record longer than that is dropped and named (a tiled image counts the tokens of its
    original size). Unpacked with a tiled tower, the batch is that `ConversationBatch`
    without a packing plan (one padded row per caption): tiled images do not stack.

    Args:
        mm: the model whose tokenizer and image token to use.
        prompt: the prompt of items without their own.
        packing: pack records into rows instead of one padded row each.
        max_length: with `packing`, the longest row, image tokens included (default: the
            LLM's context).

    Raises:
        ValueError: for a prompt without exactly one image token (at collation for an item's
            own prompt, naming it).
    """

    def __init__(self, mm: MultimodalLM, prompt: str = "<image>\n", *, packing: bool = False,
                 max_length: int | None = None):
        self.tokenizer, self.image_token = mm.tokenizer, mm.image_token
        self.prompt = self._checked(prompt)
        self.packing, self.tiled = packing, mm.tower.tiling is not None
        self.image_token_id = mm.image_token_id
        if packing:
            self.count_tokens = ImageTokens.of(mm)
            self.image_tokens = self.count_tokens.fixed
            self.max_length = _max_length(mm, max_length)

    def _checked(self, prompt: str) -> str:
        if prompt.count(self.image_token) != 1:
            raise ValueError(f"a prompt must hold the image token {self.image_token!r} exactly "
                             f"once, got {prompt!r}")
        return prompt

    def __call__(self, items: Sequence[tuple[Any, str, str | None]]) -> ImageBatch:
        items = _flattened(items)
        good = [item for item in items if isinstance(item[0], (torch.Tensor, TiledImage))]
        bad = [item[0] for item in items if isinstance(item[0], UndecodableImage)]
        if self.packing:
            return self._packed(good, bad)
        if self.tiled:
            return ImageBatch(_records_batch([self._record(*item) for item in good]), bad)
        if not good:
            return ImageBatch(torch.zeros(0, 3, 1, 1), bad,
                              torch.zeros(0, 2, 1, dtype=torch.long))
        rows = [(list(self.tokenizer(self._checked(prompt or self.prompt))["input_ids"]),
                 target_ids(self.tokenizer, caption)) for _, caption, prompt in good]
        length = max(len(part) for row in rows for part in row)
        labels = torch.full((len(rows), 2, length), IGNORE_INDEX, dtype=torch.long)
        for index, row in enumerate(rows):
            for part, ids in enumerate(row):
                labels[index, part, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return ImageBatch(torch.stack([item[0] for item in good]), bad, labels)

    def _record(self, pixels: Pixels, caption: str, prompt: str | None
                ) -> tuple[list[int], list[int], list[Pixels]]:
        """One caption as a record: ids, labels (the caption's tokens only) and its image."""
        prompt_ids = list(self.tokenizer(self._checked(prompt or self.prompt))["input_ids"])
        target = target_ids(self.tokenizer, caption)
        return prompt_ids + target, [IGNORE_INDEX] * len(prompt_ids) + target, [pixels]

    def _packed(self, good: list, bad: list[UndecodableImage]) -> ImageBatch:
        rows = []
        for pixels, caption, prompt in good:
            ids, labels, images = self._record(pixels, caption, prompt)
            length = _expanded_length(ids, self.image_token_id,
                                      [self.count_tokens(pixels)])
            if length > self.max_length:
                bad.append(UndecodableImage(f"caption {caption[:40]!r}", f"its {length} tokens "
                                            f"are more than max_length {self.max_length}"))
                continue
            rows.append((ids, labels, images))
        return ImageBatch(_packed_batch(rows, self.image_token_id, self.count_tokens,
                                        self.max_length), bad)


def _max_length(mm: MultimodalLM, max_length: int | None) -> int:
    """`max_length`, or the LLM's context; never longer than the context."""
    context = getattr(getattr(mm.llm, "config", None), "max_position_embeddings", None)
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


class CaptionObjective(BridgeObjective):
    """Caption loss for the trainer, on batches from `CaptionCollate`: each image's prompt,
    then its caption.

    Set up the stage on `mm` first (`train_projector_only()` or `add_lora(...)`); frozen parts
    get no gradients, and a frozen encoder runs without an autograd graph. Checkpoints hold
    what trains (`BridgeObjective`). Packed batches (`CaptionCollate(packing=True)`) train
    as `ConversationObjective` trains them, with `loss_reduction`; padded ones take the mean
    over each micro-batch's caption tokens, as before.
    """

    def __init__(self, mm: MultimodalLM, loss_reduction: str = "token"):
        super().__init__(mm)
        self.loss_reduction = _checked_reduction(loss_reduction)

    def forward(self, pixel_values: torch.Tensor | ConversationBatch,
                labels: torch.Tensor | None = None) -> ObjectiveOutput:
        if isinstance(pixel_values, ConversationBatch):
            return conversation_loss(self.mm, pixel_values, self.loss_reduction)
        prompts, targets = ([row[row != IGNORE_INDEX].tolist() for row in labels[:, part]]
                            for part in (0, 1))
        images = [[image] for image in pixel_values]
        out = self.mm(prompts, images, targets=targets)
        return ObjectiveOutput(out.loss, {"target_tokens": float(sum(map(len, targets)))})


# -- conversations (LLaVA's instruction data) ------------------------------------------------


class ConversationItem(NamedTuple):
    """A record with its images preprocessed."""

    where: str
    turns: list[Turn]
    pixels: list[Pixels]  # as `load_pixels` gives them


class ConversationDataset(torch.utils.data.Dataset):
    """LLaVA-format conversations (`vlm_vit_llm.records`) with their images preprocessed.

    Items are `ConversationItem`s, or an `UndecodableImage` naming the record and the file
    when one of its images does not decode, or the record no longer reads as it did at
    indexing (the file changed): the collate drops the record, the trainer counts and names
    it.

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

    Attributes:
        lengths: `[N]` estimated tokens per record (text characters / 4 plus image tokens),
            negative for text-only records: what length-grouped batching sorts by (LLaVA's
            `modality_lengths`).
    """

    def __init__(self, records: ConversationRecords, processor: ImageProcessor,
                 image_tokens: int = 0, max_length: int | None = None, *,
                 least_image_tokens: int | None = None):
        self.records, self.processor = records, processor
        self.root = records.path
        if max_length is not None:
            if least_image_tokens is None or least_image_tokens == image_tokens:  # untiled
                records.limit_length(max_length, image_tokens)
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
        pixels = []
        for path in record.images:
            try:
                pixels.append(load_pixels(self.processor, path))
            except (ValueError, OSError) as error:  # ImageLoadError, ImageTooLargeError, I/O
                return UndecodableImage(f"{record.where} image {path}", str(error))
        return ConversationItem(record.where, record.turns, pixels)


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

    def encode(self, item: ConversationItem) -> tuple[list[int], list[int], list[Pixels]]:
        """Ids, labels and pixels of one record after truncation.

        Raises:
            ValueError: naming the record when it cannot be used (see the class docstring).
        """
        # Only the turns that can reach max_length tokens are rendered (`bounded_turns`).
        turns = bounded_turns(item.turns, self.max_length)
        ids, labels = tokenize_conversation(self.tokenizer, turns, self.template)
        placeholders = ids.count(self.image_token_id)
        images = len(item.pixels) if turns == list(item.turns) else sum(  # the kept ones
            turn.text.count(self.image_token) for turn in turns if turn.role == "user")
        if placeholders != images:
            raise ValueError(f"the tokenizer reads {placeholders} image tokens for "
                             f"{images} image(s)")
        counts = [self.count_tokens(pixels) for pixels in item.pixels]
        if sum(counts) > self.max_length:
            raise ValueError(f"its {len(item.pixels)} image(s) take {sum(counts)} tokens, more "
                             f"than max_length {self.max_length}")
        keep = truncate(ids, self.image_token_id, counts, self.max_length)
        ids, labels = ids[:keep], labels[:keep]
        if all(label == IGNORE_INDEX for label in labels):
            raise ValueError(f"no assistant token is left within max_length {self.max_length}")
        return ids, labels, item.pixels[:ids.count(self.image_token_id)]

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


# -- tar shards (`vlm-vit shards --captions` / `--llava`) ------------------------------------


def _shard_pixels(processor: ImageProcessor, sample: Any, data: bytes) -> Pixels:
    """A sample's encoded image, decoded and preprocessed as `load_pixels` does a file.

    Raises:
        ValueError: naming `shard:key` when it does not decode or is too large.
    """
    return load_pixels(processor, processor.load(data, f"image {sample.name}"))


def _own_reason(error: ValueError, name: str) -> str:
    """An error's message without the leading `name: ` (the marker names the sample)."""
    return str(error).removeprefix(f"{name}: ")


class CaptionShardDecode:
    """A caption shard sample as a `CaptionFolder` item, for `ShardStream`: the image through
    the inference preprocessing, the caption from the `txt` field (else the `json` field's
    "caption"), the prompt from the `json` field's "prompt" (else None: the collate's).

    Small and picklable: each DataLoader worker holds a copy.

    Returns (from a call on a `Sample`): `(pixels, caption, prompt or None)`, the pixels as
    `load_pixels` gives them;
    `(UndecodableImage, caption, prompt)` for an image that does not decode, and
    `(UndecodableImage, "", None)` for a bad record (no caption; a json field that is not a
    JSON object; a prompt that is not a string holding the image token once), each naming
    `shard:key` (`CaptionCollate` drops them, the trainer counts and names them); None for a
    sample without an image (the stream counts those as "no image").

    Args:
        processor: the tower's preprocessing.
        image_token: what a record's own prompt must hold once.
    """

    def __init__(self, processor: ImageProcessor, image_token: str = "<image>"):
        self.processor, self.image_token = processor, image_token

    def __call__(self, sample: Any
                 ) -> tuple[Pixels | UndecodableImage, str, str | None] | None:
        data = sample.image()
        if data is None:
            return None
        try:
            meta = sample.json() if "json" in sample.fields else {}
            if not isinstance(meta, dict):
                raise ValueError(f"its json field is a {type(meta).__name__}, not an object")
            caption = sample.text("txt") if "txt" in sample.fields else meta.get("caption")
            prompt = meta.get("prompt")
            if not isinstance(caption, str) or not caption:
                raise ValueError("no caption (a txt field, or a string 'caption' in its json "
                                 "field)")
            if prompt is not None and (not isinstance(prompt, str)
                                       or prompt.count(self.image_token) != 1):
                raise ValueError(f"its prompt must be a string holding {self.image_token!r} "
                                 f"once, got {prompt!r:.80}")
        except ValueError as error:
            return UndecodableImage(sample.name, _own_reason(error, sample.name)), "", None
        try:
            return _shard_pixels(self.processor, sample, data), caption, prompt
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(sample.name, str(error)), caption, prompt


class ConversationShardDecode:
    """A LLaVA shard sample as a `ConversationDataset` item, for `ShardStream`: the record
    from the `json` field, checked by `parse_record` as a file's records are, and its image
    from the sample's image field (`jpg`, `png`, ...).

    A record without an "image" whose sample holds an image takes that image (placeholders
    must still match); a text-only record (no placeholder, no image) is an item without
    pixels, not a sample without an image. Small and picklable: each DataLoader worker holds
    a copy.

    Returns (from a call on a `Sample`): a `ConversationItem` named `shard:key (id ...)`, or
    an `UndecodableImage` naming it with the reason (`ConversationCollate` drops it, the
    trainer counts and names it) when: its json field is missing or not JSON; the record
    fails a check; it needs an image the sample lacks, or more than the one a sample holds;
    or its image does not decode. Never None: every sample is a record.

    Args:
        processor: the tower's preprocessing.
        image_token: the placeholder in human turns.
    """

    def __init__(self, processor: ImageProcessor, image_token: str = "<image>"):
        self.processor, self.image_token = processor, image_token

    def __call__(self, sample: Any) -> ConversationItem | UndecodableImage:
        where = sample.name
        try:
            raw = sample.json()
        except ValueError as error:
            return UndecodableImage(where, _own_reason(error, where))
        if raw is None:
            return UndecodableImage(where, f"no json field to hold the record (fields "
                                    f"{sorted(sample.fields)})")
        data = sample.image()
        if isinstance(raw, dict):
            if raw.get("id") is not None:
                where = f"{where} (id {raw['id']})"
            if data is not None and raw.get("image", raw.get("images")) is None:
                raw = {**raw, "image": sample.key}  # the sample's own image
        try:
            # Only the names' count matters: the image comes from the sample, not a folder.
            record = parse_record(raw, where, Path(), self.image_token, check_files=False)
        except BadRecord as bad:
            return UndecodableImage(where, bad.reason)
        if len(record.images) > 1:
            return UndecodableImage(where, f"it names {len(record.images)} images; a shard "
                                    "sample holds one")
        if not record.images:
            return ConversationItem(where, record.turns, [])
        if data is None:
            return UndecodableImage(where, f"it needs image {record.images[0].as_posix()!r} but "
                                    f"the sample holds none (fields {sorted(sample.fields)})")
        try:
            pixels = _shard_pixels(self.processor, sample, data)
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(where, str(error))
        return ConversationItem(where, record.turns, [pixels])


class ConversationObjective(BridgeObjective):
    """The loss on the assistant turns of `ConversationBatch`es (from `ConversationCollate`).

    Set up the stage on `mm` first (`train_projector_only()` or `add_lora(...)`); checkpoints
    hold what trains (`BridgeObjective`).

    Args:
        mm: the model.
        loss_reduction: "token" (the default, as padded training always did): the mean over
            all supervised tokens of the batch; "record": each record's mean, then the mean
            over records. Exact under gradient accumulation either way (`conversation_loss`).
    """

    def __init__(self, mm: MultimodalLM, loss_reduction: str = "token"):
        super().__init__(mm)
        self.loss_reduction = _checked_reduction(loss_reduction)

    def forward(self, batch: ConversationBatch) -> ObjectiveOutput:
        return conversation_loss(self.mm, batch, self.loss_reduction)


class TokenBudgetPacks(torch.utils.data.Dataset):
    """A map-style dataset whose items are packs of another's items, each pack holding at
    most `max_tokens` tokens by the records' `lengths` (`vlm_vit.train.token_budget`'s
    first-fit decreasing): with the trainer's `batch_size` counting packs, every batch costs
    about the same. The collates open the packs (`ConversationCollate(packing=True)` then
    lays each batch into rows of `max_length`).

    The packs are a function of the lengths and the budget, made once here, so a resumed
    run rebuilds the same ones; the trainer shuffles their order with its seed and epoch.

    Args:
        dataset: a dataset with `lengths` (per item, its estimated tokens, negative for
            text-only records, as `ConversationDataset.lengths`).
        max_tokens: the budget of one pack.
        max_length: the longest record after truncation: a length is counted as at most
            this. `max_tokens` must be at least this.

    Raises:
        ValueError: for a dataset without `lengths`, or `max_tokens` below `max_length`.
    """

    def __init__(self, dataset: Any, max_tokens: int, max_length: int):
        from vlm_vit.train.token_budget import first_fit_decreasing

        lengths = getattr(dataset, "lengths", None)
        if lengths is None:
            raise ValueError(f"token-budget batches need a dataset with `lengths`; "
                             f"{type(dataset).__name__} has none")
        if max_tokens < max_length:
            raise ValueError(f"max_tokens_per_batch {max_tokens} is less than max_length "
                             f"{max_length}: the longest record could fit in no batch")
        self.dataset, self.max_tokens = dataset, max_tokens
        counts = np.minimum(np.abs(np.asarray(lengths, dtype=np.int64)), max_length)
        self.packs = first_fit_decreasing(counts, max_tokens)
        self.root = getattr(dataset, "root", None)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.dataset[item] for item in self.packs[index]]

    def describe(self) -> dict[str, Any]:
        """What run_config.json records: the packs, and the dataset they cover."""
        from vlm_vit.data.folders import describe_dataset

        return {"type": type(self).__name__, "length": len(self), "max_tokens": self.max_tokens,
                "dataset": describe_dataset(self.dataset)}
