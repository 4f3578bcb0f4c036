"""Qwen3-VL's clips: each temporal patch of a clip is its own vision span, after the time it
shows as text (Bai et al. 2025, Qwen3-VL's "text-based time alignment"), as transformers'
`Qwen3VLProcessor` writes them:

    <|vision_start|><|video_pad|><|vision_end|>what happens
    -> <0.5 seconds><|vision_start|><|video_pad|>...<|vision_end|><1.5 seconds><|vision_start|>...

The chat template's wrapper around a clip's placeholder is collapsed (each frame brings its
own); a placeholder without one is replaced alone. The time of a temporal patch is the mean of
its first and last frame's (the last frame repeated to fill the last patch, as the video
processor pads it). Frame i is at `i / fps`, or at `indices[i] / fps` for frames sampled from
a video (`Video.indices`, `VideoProcessor.sample`); `fps` is the `Video`'s, else
transformers' 24.

`timestamped_clips` rewrites string prompts so, and gives each temporal patch as a clip of
its own (`Video` of `temporal_patch_size` frames): the tower encodes a clip's temporal
patches apart anyway, so the tokens are the clip's, and each patch is a span of one frame
for M-RoPE, which is how transformers' `get_rope_index` counts them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from vlm_vit.config import is_int
from vlm_vit_llm.batch_types import Video
from vlm_vit_llm.mrope import DEFAULT_FPS
from vlm_vit_llm.peft_helpers import split_peft
from vlm_vit_llm.pixels import as_pixels

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")  # the LLMs whose clips carry timestamps
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


class TemporalPatch(Video):
    """One temporal patch of a clip whose timestamp is already in the prompt (what
    `split_clip` gives): `timestamped_clips` leaves it, and a prompt of token ids may hold
    it."""


def takes_timestamps(mm: Any) -> bool:
    """Whether `mm`'s language model writes a timestamp before each temporal patch."""
    config = getattr(split_peft(mm.llm)[0], "config", None)
    return getattr(config, "model_type", None) in MODEL_TYPES


def patch_times(frames: int, fps: float | None, temporal: int,
                indices: Sequence[int] | None = None) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's, frame
    i at `indices[i] / fps` (default: `i / fps`).

    Raises:
        ValueError: for no frames, an fps that is not a positive number, or indices that are
            not one non-negative int per frame.
    """
    fps = DEFAULT_FPS if fps is None else fps
    if frames < 1 or not (isinstance(fps, (int, float)) and fps > 0):
        raise ValueError(f"a clip needs frames and a positive fps, got {frames} frame(s) at "
                         f"fps {fps!r}")
    if indices is None:
        indices = range(frames)
    elif len(indices) != frames or not all(is_int(i) and i >= 0 for i in indices):
        raise ValueError(f"a clip of {frames} frame(s) needs one frame index (an int >= 0) "
                         f"per frame, got {list(indices)[:8]!r:.80}")
    indices = list(indices) + [indices[-1]] * (-frames % temporal)
    return [(indices[start] + indices[start + temporal - 1]) / 2 / fps
            for start in range(0, len(indices), temporal)]


def split_clip(video: Video, temporal: int) -> list[Video]:
    """The clip's temporal patches, each a `Video` of `temporal` frames (the last frame
    repeated to fill the last one), at the clip's fps, with their frames' indices."""
    frames = video.frames
    count = len(frames)
    fill = -count % temporal
    if isinstance(frames, torch.Tensor):
        frames = torch.cat([frames, frames[-1:].expand(fill, *frames.shape[1:])]) if fill \
            else frames
    else:
        frames = list(frames) + [frames[-1]] * fill
    indices = None if video.indices is None else \
        tuple(video.indices) + (video.indices[-1],) * fill
    return [TemporalPatch(frames[start:start + temporal], video.fps,
                          None if indices is None else indices[start:start + temporal])
            for start in range(0, len(frames), temporal)]


def timestamped_clips(mm: Any, texts: Sequence[Any], images: list[list[Any]]
                      ) -> tuple[list[Any], list[list[Any]]]:
    """For a model whose clips carry timestamps (`takes_timestamps`), each string prompt
    with its clips written as Qwen3-VL's processor writes them and each clip given as its
    temporal patches (see the module); other models' prompts and images as they are.

    Raises:
        ValueError: for a clip in a prompt given as token ids (its timestamps are text: give
            the prompt as a string).
    """
    if not takes_timestamps(mm) or not any(_untimed(image) for per_prompt in images
                                           for image in per_prompt):
        return list(texts), images
    temporal, pattern = clip_settings(mm)
    new_texts, new_images = [], []
    for prompt, (text, per_prompt) in enumerate(zip(texts, images, strict=True)):
        if any(map(_untimed, per_prompt)) and not isinstance(text, str):
            raise ValueError(f"prompt {prompt} holds a clip but is given as token ids: "
                             "Qwen3-VL writes each frame's time as text before it; give the "
                             "prompt as a string")
        if isinstance(text, str):
            # A clip's frames are sized together (its video processor) before it is split.
            per_prompt = [as_pixels(image, mm.tower, mm.processor, prompt, mm.video_processor)
                          if _untimed(image) else image for image in per_prompt]
            text, kept, matched = timestamp_text(text, per_prompt, pattern, temporal)
            per_prompt = kept + list(per_prompt[matched:])
        new_texts.append(text)
        new_images.append(per_prompt)
    return new_texts, new_images


def timestamped_turns(turns: Sequence[Any], images: Sequence[Any],
                      settings: tuple[int, re.Pattern]) -> tuple[list[Any], list[Any]]:
    """`timestamped_clips` for a conversation: its user turns' placeholders take `images`
    in order (`Turn`s, as `vlm_vit_llm.chat` renders them); `settings` are
    `clip_settings(mm)`."""
    if not any(map(_untimed, images)):
        return list(turns), list(images)
    temporal, pattern = settings
    new_turns, kept, taken = [], [], 0
    for turn in turns:
        if turn.role != "user":
            new_turns.append(turn)
            continue
        text, pieces, matched = timestamp_text(turn.text, images[taken:], pattern, temporal)
        new_turns.append(turn._replace(text=text))
        kept.extend(pieces)
        taken += matched
    return new_turns, kept + list(images[taken:])


def clip_settings(mm: Any) -> tuple[int, re.Pattern]:
    """The tower's frames per temporal patch, and the pattern of the placeholders."""
    tokens = [token for token in (mm.image_token, mm.video_token) if token]
    return (mm.tower.encoder.config.temporal_patch_size or 1,
            re.compile("|".join(map(re.escape, tokens))))


def timestamp_text(text: str, images: Sequence[Any], pattern: re.Pattern, temporal: int
                   ) -> tuple[str, list[Any], int]:
    """`text` with each placeholder (`pattern`) that takes a clip of `images` (in order)
    written as its timestamped temporal patches; the images with each clip split into them;
    and how many of `images` the text's placeholders took."""
    pieces, kept, cursor, matched = [], [], 0, 0
    for found in pattern.finditer(text):
        if matched == len(images):
            break  # more placeholders than images: `prepare` names the mismatch
        image = images[matched]
        matched += 1
        if not _untimed(image):
            kept.append(image)
            continue
        start, end = found.span()
        if text.endswith(VISION_START, 0, start) and text.startswith(VISION_END, end):
            start, end = start - len(VISION_START), end + len(VISION_END)
        pieces.append(text[cursor:start])
        times = patch_times(len(image.frames), image.fps, temporal, image.indices)
        pieces.extend(f"<{time:.1f} seconds>{VISION_START}{found.group()}{VISION_END}"
                      for time in times)
        kept.extend(split_clip(image, temporal))
        cursor = end
    pieces.append(text[cursor:])
    return "".join(pieces), kept, matched


def _untimed(image: Any) -> bool:
    """Whether `image` is a clip whose timestamps are still to be written."""
    return isinstance(image, Video) and not isinstance(image, TemporalPatch)
