"""Qwen3-VL's clips: each temporal patch of a clip is its own vision span, after the time it
shows as text (Bai et al. 2025, Qwen3-VL's "text-based time alignment"), as transformers'
`Qwen3VLProcessor` writes them:

    <|vision_start|><|video_pad|><|vision_end|>what happens
    -> <0.5 seconds><|vision_start|><|video_pad|>...<|vision_end|><1.5 seconds><|vision_start|>...

The chat template's wrapper around a clip's placeholder is collapsed (each frame brings its
own); a placeholder without one is replaced alone. The time of a temporal patch is the mean of
its first and last frame's, frame i at `i / fps` (the last frame repeated to fill the last
patch, as the video processor pads it); `fps` is the `Video`'s, else transformers' 24.

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

from vlm_vit_llm.batch_types import Video
from vlm_vit_llm.mrope import DEFAULT_FPS
from vlm_vit_llm.peft_helpers import split_peft

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")  # the LLMs whose clips carry timestamps
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def takes_timestamps(mm: Any) -> bool:
    """Whether `mm`'s language model writes a timestamp before each temporal patch."""
    config = getattr(split_peft(mm.llm)[0], "config", None)
    return getattr(config, "model_type", None) in MODEL_TYPES


def patch_times(frames: int, fps: float | None, temporal: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's.

    Raises:
        ValueError: for no frames or an fps that is not a positive number.
    """
    fps = DEFAULT_FPS if fps is None else fps
    if frames < 1 or not (isinstance(fps, (int, float)) and fps > 0):
        raise ValueError(f"a clip needs frames and a positive fps, got {frames} frame(s) at "
                         f"fps {fps!r}")
    indices = list(range(frames)) + [frames - 1] * (-frames % temporal)
    return [(indices[start] + indices[start + temporal - 1]) / 2 / fps
            for start in range(0, len(indices), temporal)]


def split_clip(video: Video, temporal: int) -> list[Video]:
    """The clip's temporal patches, each a `Video` of `temporal` frames (the last frame
    repeated to fill the last one), at the clip's fps."""
    frames = video.frames
    count = len(frames)
    fill = -count % temporal
    if isinstance(frames, torch.Tensor):
        frames = torch.cat([frames, frames[-1:].expand(fill, *frames.shape[1:])]) if fill \
            else frames
    else:
        frames = list(frames) + [frames[-1]] * fill
    return [Video(frames[start:start + temporal], video.fps)
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
    if not takes_timestamps(mm) or not any(isinstance(image, Video)
                                           for per_prompt in images for image in per_prompt):
        return list(texts), images
    temporal = mm.tower.encoder.config.temporal_patch_size or 1
    tokens = [token for token in (mm.image_token, mm.video_token) if token]
    pattern = re.compile("|".join(map(re.escape, tokens)))
    new_texts, new_images = [], []
    for prompt, (text, per_prompt) in enumerate(zip(texts, images, strict=True)):
        if not any(isinstance(image, Video) for image in per_prompt):
            new_texts.append(text)
            new_images.append(per_prompt)
            continue
        if not isinstance(text, str):
            raise ValueError(f"prompt {prompt} holds a clip but is given as token ids: "
                             "Qwen3-VL writes each frame's time as text before it; give the "
                             "prompt as a string")
        pieces, kept, cursor, matched = [], [], 0, 0
        for found in pattern.finditer(text):
            if matched == len(per_prompt):
                break  # more placeholders than images: `prepare` names the mismatch
            image = per_prompt[matched]
            matched += 1
            if not isinstance(image, Video):
                kept.append(image)
                continue
            start, end = found.span()
            if text.endswith(VISION_START, 0, start) and text.startswith(VISION_END, end):
                start, end = start - len(VISION_START), end + len(VISION_END)
            pieces.append(text[cursor:start])
            times = patch_times(len(image.frames), image.fps, temporal)
            pieces.extend(f"<{time:.1f} seconds>{VISION_START}{found.group()}{VISION_END}"
                          for time in times)
            kept.extend(split_clip(image, temporal))
            cursor = end
        pieces.append(text[cursor:])
        new_texts.append("".join(pieces))
        new_images.append(kept + list(per_prompt[matched:]))
    return new_texts, new_images
