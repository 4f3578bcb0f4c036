"""Multimodal rotary positions (M-RoPE; Qwen2-VL, Wang et al. 2024; Qwen2.5-VL, Qwen3-VL):
the (temporal, height, width) position ids the LLM of a Qwen-VL model rotates by.

Text counts on by one in all three rows. An image or video of `(t, h, w)` LLM tokens (after
the spatial merge), starting at position p, takes ids `p + i * time_step` (truncated),
`p + row` and `p + col` for its token at frame i, row and col, listed frame by frame, row by
row; the text after it resumes at `p + max(h, w)` (the temporal extent does not advance it).
Qwen2.5-VL spaces a video's frames by `tokens_per_second * seconds_per_grid` (`time_step`);
Qwen3-VL separates a video's frames with timestamp text, so each frame is its own span of
t = 1. These are the ids transformers' `get_rope_index` gives, which tests check on mixed
prompts with left padding.

Packed rows (several records in one row) restart the ids at 0 for each record, so every
record sees the positions it would see alone; `packed_batch_positions` puts the 1-D text
positions before them (`[4, R, L]`), as transformers' Qwen-VL models take packed input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpan:
    """One image or video in a record.

    Attributes:
        start: the index, within the record's tokens, of its first token.
        grid: `(t, h, w)` in LLM tokens: frames after the temporal patch, rows and columns
            after the spatial merge; it covers `t * h * w` consecutive tokens.
        time_step: the temporal id step between its frames (1 for images and Qwen2-VL;
            Qwen2.5-VL's videos: `tokens_per_second * seconds per grid`).
    """

    start: int
    grid: tuple[int, int, int]
    time_step: float = 1.0

    @property
    def length(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def record_positions(length: int, spans: Sequence[VisionSpan]) -> torch.Tensor:
    """The `[3, length]` M-RoPE ids of one record of `length` tokens holding `spans` (in
    order, not overlapping).

    Raises:
        ValueError: for spans out of order, overlapping or past the record's end.
    """
    pieces, position, cursor = [], 0, 0
    for span in spans:
        if span.start < cursor or span.start + span.length > length or min(span.grid) < 1:
            raise ValueError(f"vision span at {span.start} with grid {span.grid} does not fit "
                             f"a record of {length} tokens after position {cursor}")
        text = span.start - cursor
        pieces.append(torch.arange(text).expand(3, -1) + position)
        position += text
        t, h, w = span.grid
        frames = (torch.arange(t, dtype=torch.float64) * span.time_step).long()
        ids = torch.stack(torch.meshgrid(frames, torch.arange(h), torch.arange(w),
                                         indexing="ij")).reshape(3, -1)
        pieces.append(ids + position)
        position += max(h, w)
        cursor = span.start + span.length
    pieces.append(torch.arange(length - cursor).expand(3, -1) + position)
    return torch.cat(pieces, dim=1)


def batch_positions(attention_mask: torch.Tensor,
                    spans: Sequence[Sequence[VisionSpan]]) -> torch.Tensor:
    """`[3, B, L]` ids for padded rows, one record each: its spans counted over its real
    tokens (`attention_mask` 1), padding at 0, as transformers gives them.

    Args:
        attention_mask: `[B, L]`.
        spans: per row, its spans, `start` counted among the row's real tokens.
    """
    rows, width = attention_mask.shape
    if len(spans) != rows:
        raise ValueError(f"{len(spans)} rows of spans for {rows} rows")
    positions = torch.zeros(3, rows, width, dtype=torch.long)
    for row in range(rows):
        real = attention_mask[row].bool()
        positions[:, row, real] = record_positions(int(real.sum()), spans[row])
    return positions


def packed_positions(lengths: Sequence[int], spans: Sequence[Sequence[VisionSpan]],
                     width: int | None = None) -> torch.Tensor:
    """`[3, width]` ids for one packed row: each record's own ids, restarting at 0, one record
    after another; positions after the last record (padding to `width`) at 0.

    Args:
        lengths: each record's token count, in row order.
        spans: per record, its spans, `start` counted within the record.
        width: the row's length (default: the records' total).
    """
    if len(spans) != len(lengths):
        raise ValueError(f"{len(spans)} records of spans for {len(lengths)} records")
    total = sum(lengths)
    width = total if width is None else width
    if width < total:
        raise ValueError(f"{total} packed tokens do not fit a row of {width}")
    positions = torch.zeros(3, width, dtype=torch.long)
    offset = 0
    for length, own in zip(lengths, spans):
        positions[:, offset:offset + length] = record_positions(length, own)
        offset += length
    return positions


def packed_batch_positions(position_ids: torch.Tensor, record_index: torch.Tensor,
                           image_mask: torch.Tensor, grids: Sequence[tuple[int, int, int]],
                           owners: Sequence[int],
                           time_steps: Sequence[float] | None = None) -> torch.Tensor:
    """`[4, R, L]` ids for packed rows, as transformers' Qwen-VL models read packed input:
    the 1-D text positions first (restarting per record: what its packed-sequence detection
    and our varlen path read), then each record's own 3-D ids, restarting at 0, as it has
    them alone. Padding and text-only records count on as text.

    Args:
        position_ids: `[R, L]`, restarting at every record (`packing.layout_rows`).
        record_index: `[R, L]`, each token's record (-1 on padding).
        image_mask: `[R, L]`, True on image tokens.
        grids: each image's `(t, h, w)` LLM-token grid, in the batch's image order.
        owners: each image's record.
        time_steps: each image's temporal id step (`time_step`; default 1).

    Raises:
        ValueError: when a record's image positions do not hold its images' tokens.
    """
    out = position_ids.unsqueeze(0).repeat(4, 1, 1)
    for record in sorted(set(owners)):
        rows, columns = torch.nonzero(record_index == record, as_tuple=True)
        row, start, end = int(rows[0]), int(columns[0]), int(columns[-1]) + 1
        mine = [index for index, owner in enumerate(owners) if owner == record]
        length = end - start
        steps = [1.0 if time_steps is None else time_steps[index] for index in mine]
        spans = image_spans(image_mask[row, start:end][None],
                            torch.ones(1, length, dtype=torch.long),
                            [grids[index] for index in mine], [0] * len(mine), steps)[0]
        out[1:, row, start:end] = record_positions(length, spans).to(out.device)
    return out


def rope_delta(positions: torch.Tensor, length: int) -> int:
    """How far a record's next text id is from its length (`max id + 1 - length`): what
    generation adds to each new token's position, as transformers' `rope_deltas`."""
    return int(positions.max()) + 1 - length


def multimodal_rope(config) -> bool:
    """Whether a config's rotary positions are multimodal (3-D), as Qwen2-VL's: in its own
    rope settings or its text config's."""
    for part in (config, getattr(config, "text_config", None)):
        for name in ("rope_parameters", "rope_scaling"):
            settings = getattr(part, name, None)
            if isinstance(settings, dict) and ("mrope_section" in settings
                                               or settings.get("rope_type") == "mrope"
                                               or settings.get("type") == "mrope"):
                return True
    return False


def context_length(llm) -> int | None:
    """The LLM's `max_position_embeddings`: its config's, or its text config's (where a
    multimodal class, as Qwen-VL's, keeps it); None when neither has one."""
    config = getattr(llm, "config", None)
    for part in (config, getattr(config, "text_config", None)):
        value = getattr(part, "max_position_embeddings", None)
        if value is not None:
            return value
    return None


def token_side(tower) -> int:
    """The pixels a side of one LLM token covers: the patch, times the patch merger's
    `merge_size` (1 without one)."""
    side = tower.encoder.config.patch_size
    side = side[0] if isinstance(side, (tuple, list)) else side
    return side * getattr(tower.pooler, "merge_size", 1)


def token_grid(tower, pixels) -> tuple[int, int, int]:
    """The `(t, h, w)` grid of LLM tokens an image (`[C, H, W]` pixels) or a clip (a `Video`
    of `[T, C, H, W]` pixels) becomes in a tower with a patch merger (its windows of
    `merge_size` patches a side; 1 without one)."""
    frames = getattr(pixels, "frames", None)
    shape = tuple((frames if frames is not None else pixels).shape[-2:])
    side = token_side(tower)
    temporal = tower.encoder.config.temporal_patch_size or 1
    count = 1 if frames is None else -(-len(frames) // temporal)
    return count, shape[0] // side, shape[1] // side


DEFAULT_FPS = 24.0  # transformers' rate for video frames given without metadata


def time_step(config, tower, pixels) -> float:
    """The temporal id step between a clip's temporal patches: Qwen2.5-VL's
    `tokens_per_second * temporal_patch_size / fps` (its vision config has
    `tokens_per_second`); 1 for an image, and for Qwen2-VL's clips."""
    vision = getattr(config, "vision_config", None)
    per_second = getattr(vision, "tokens_per_second", None)
    frames = getattr(pixels, "frames", None)
    if frames is None or per_second is None:
        return 1.0
    return per_second * (tower.encoder.config.temporal_patch_size or 1) / clip_rate(pixels)


def clip_rate(video) -> float:
    """The frame rate a clip's positions follow (Qwen2.5-VL): its fps, else transformers' 24.

    Raises:
        ValueError: for an fps that is not a positive number, or a clip given by its frames'
            indices (their rate is not the clip's).
    """
    fps = video.fps or DEFAULT_FPS
    if not fps > 0:
        raise ValueError(f"a Video's fps must be a positive number, got {fps!r}")
    if getattr(video, "indices", None) is not None:
        raise ValueError("Qwen2.5-VL spaces a clip's temporal patches by its frames' rate, "
                         "not their indices: give the sampled frames' own rate as fps "
                         "(VideoProcessor.sample of this model does)")
    return fps


def image_spans(image_mask: torch.Tensor, attention_mask: torch.Tensor,
                grids: Sequence[tuple[int, int, int]], owners: Sequence[int],
                time_steps: Sequence[float] | None = None) -> list[list[VisionSpan]]:
    """Each padded row's spans: its images' grids (in order; `owners[i]` is image i's row)
    placed at the row's image positions, `start` counted among the row's real tokens.

    Raises:
        ValueError: when a row's image positions do not hold its images' tokens.
    """
    spans: list[list[VisionSpan]] = [[] for _ in range(image_mask.shape[0])]
    steps = time_steps or [1.0] * len(grids)
    for row in range(image_mask.shape[0]):
        real = attention_mask[row].bool()
        where = torch.nonzero(image_mask[row][real]).flatten().tolist()
        taken = 0
        for grid, owner, step in zip(grids, owners, steps):
            if owner != row:
                continue
            span = VisionSpan(where[taken], grid, step) if taken < len(where) else None
            if span is None or where[taken:taken + span.length] != list(
                    range(span.start, span.start + span.length)):
                raise ValueError(f"row {row}: its image positions do not hold an image of "
                                 f"grid {grid} at image token {taken}")
            spans[row].append(span)
            taken += span.length
        if taken != len(where):
            raise ValueError(f"row {row}: {len(where)} image positions for {taken} image tokens")
    return spans


def generation_inputs(batch) -> dict:
    """What transformers' `generate` needs besides the embeddings for an M-RoPE model: the
    prefill's 3D ids. Each decoding step then continues from its row's last id plus one
    (transformers extends `position_ids` so), which is where `get_rope_index`'s rope delta
    puts the next text token."""
    return {"position_ids": batch.position_ids}
