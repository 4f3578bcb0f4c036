"""A clip's frames as Qwen-VL's video processors make them (transformers'
`Qwen2VLVideoProcessor`, which Qwen2.5-VL uses too, and `Qwen3VLVideoProcessor`), where the
image processor would size each frame alone:

- the frames are decoded as the image processor decodes an image (`ImageProcessor.load`) and
  must share one size;
- the clip gets one size from its frame count and the video processor's own pixel bounds:
  Qwen2-VL's bound each frame (`smart_resize` per frame), Qwen3-VL's bound the clip, its
  frame count rounded to temporal patches (`smart_resize` over `t x h x w`); with
  `cap_pixels_per_frame` each frame's share of a token budget bounds it as well
  (qwen-vl-utils' rule, as transformers applies it);
- each frame is resized by torch's antialiased filter on its 8-bit pixels, the kernel
  torchvision runs on the CPU, then scaled and normalised by the video processor's mean and std.

A `Video`'s frames are taken as they are (transformers' `do_sample_frames=False`);
`VideoProcessor.sample` picks frames from a whole decoded video as the video processor's
`sample_frames` does (Qwen3-VL: 2 a second by default, their indices kept for its timestamps;
Qwen2-VL: at the settings' `fps`, the clip's rate then the sampled one).
`VideoProcessor.from_transformers` reads the settings as transformers reads them, and
`to_transformers` gives them back for a folder transformers reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlm_vit import ImageProcessor
from vlm_vit.config import is_int
from vlm_vit_llm.batch_types import Video
from vlm_vit_llm.mrope import DEFAULT_FPS

# How the clip's size is bounded: "qwen2_vl" per frame, "qwen3_vl" over the clip's frames.
RULES = ("qwen2_vl", "qwen3_vl")
RULE_OF = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl"}  # by model
# transformers' class defaults, per rule: the pixel bounds (`size`), the token budget of
# `cap_pixels_per_frame` and the normalisation (`Qwen2VLVideoProcessor` keeps CLIP's).
DEFAULT_BOUNDS = {"qwen2_vl": (128 * 28 * 28, 28 * 28 * 768),
                  "qwen3_vl": (128 * 32 * 32, 32 * 32 * 768)}
DEFAULT_VIDEO_TOKENS = {"qwen2_vl": 128000, "qwen3_vl": 768}
DEFAULT_SAMPLE_FPS = {"qwen2_vl": None, "qwen3_vl": 2}  # frames a second `sample` keeps
DEFAULT_MEAN_STD = {"qwen2_vl": ((0.48145466, 0.4578275, 0.40821073),
                                 (0.26862954, 0.26130258, 0.27577711)),
                    "qwen3_vl": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}
RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's numbers, as the configs hold them
MAX_ASPECT = 200  # smart_resize's
MAX_CLIP_PIXELS = 1 << 31  # decoded pixels of one clip's frames together: 6 GiB as RGB bytes


@dataclass(frozen=True)
class VideoProcessor:
    """How a clip's frames become pixels `[T, 3, H, W]` (see the module).

    Attributes:
        rule: "qwen2_vl" (Qwen2-VL and Qwen2.5-VL: the bounds hold per frame) or "qwen3_vl"
            (the bounds hold over the clip's frames, rounded to temporal patches).
        multiple: every side a multiple of this, the patch size times the merge (Qwen2-VL: 28).
        temporal: frames per temporal patch (the tower's `temporal_patch_size`).
        min_pixels, max_pixels: the pixel bounds (transformers' `size` shortest_edge and
            longest_edge).
        mean, std: per channel, after scaling to [0, 1].
        resample: "bicubic" or "bilinear".
        cap_pixels_per_frame: each frame also bounded by its share of `max_video_tokens`.
        max_video_tokens: that budget, in tokens (Qwen2-VL: for the whole clip, 90% of it
            spent; Qwen3-VL: per frame).
        sample_fps: the frames a second `sample` keeps (transformers' `fps`); None: all.
        min_frames, max_frames: the fewest and most frames `sample` keeps.
    """

    rule: str
    multiple: int
    temporal: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: str = "bicubic"
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    sample_fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule {self.rule!r} is not one of {RULES}")
        for name in ("multiple", "temporal", "min_pixels", "max_pixels", "max_video_tokens",
                     "min_frames", "max_frames"):
            value = getattr(self, name)
            if not (is_int(value) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is more than max_pixels "
                             f"{self.max_pixels}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if not (isinstance(value, (tuple, list)) and len(value) == 3 and all(
                    isinstance(v, (int, float)) and math.isfinite(v) for v in value)):
                raise ValueError(f"{name} must be 3 finite numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if min(self.std) <= 0:
            raise ValueError(f"std must be positive per channel, got {self.std!r}")
        if self.resample not in RESAMPLE.values():
            raise ValueError(f"resample {self.resample!r} is not one of "
                             f"{sorted(RESAMPLE.values())}")
        fps = self.sample_fps
        if fps is not None and not (isinstance(fps, (int, float)) and 0 < fps < math.inf):
            raise ValueError(f"sample_fps must be a positive number or null, got {fps!r}")
        if not isinstance(self.cap_pixels_per_frame, bool):
            raise ValueError(f"cap_pixels_per_frame must be true or false, got "
                             f"{self.cap_pixels_per_frame!r}")

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) every frame of a clip of `frames` frames of this size gets.

        Raises:
            ValueError: for an aspect ratio over 200, or (Qwen3-VL) fewer frames than a
                temporal patch, as transformers refuses them.
        """
        aspect = max(height, width) / max(1, min(height, width))
        if aspect > MAX_ASPECT:
            raise ValueError(f"frames of height {height} and width {width} have aspect ratio "
                             f"{aspect:.4g}, more than {MAX_ASPECT}")
        factor, high = self.multiple, self.max_pixels
        if self.rule == "qwen2_vl":
            if self.cap_pixels_per_frame:
                budget = int(self.max_video_tokens * factor * factor * 0.9)
                high = max(min(high, budget * self.temporal // frames),
                           int(self.min_pixels * 1.05))
            return _bounded(height, width, 1, 1, factor, self.min_pixels, high)
        if frames < self.temporal:
            raise ValueError(f"a clip of {frames} frame(s) is fewer than a temporal patch "
                             f"({self.temporal} frames), which Qwen3-VL's video processor "
                             "cannot size: give a single frame as an image")
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, high // frames),
                            int(self.min_pixels * 1.05))
            high = per_frame * frames
        if height < factor or width < factor:  # Qwen3-VL scales tiny frames up first
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        rounded = round(frames / self.temporal) * self.temporal
        return _bounded(height, width, frames, rounded, factor, self.min_pixels, high)

    def __call__(self, frames: Sequence[Any], decoder: ImageProcessor,
                 name: str = "clip") -> torch.Tensor:
        """The clip's frames (PIL images, files, arrays, `[C, H, W]` tensors) as pixels
        `[T, 3, H, W]`, decoded by `decoder` (`ImageProcessor.load`: its input bounds, EXIF
        orientation and background), sized, resized and normalised.

        Raises:
            ValueError: naming `name`, for no frames, frames of different sizes, more than
                `MAX_CLIP_PIXELS` decoded pixels (checked as each frame decodes), or a size
                `size` refuses; the decoder's errors (ImageLoadError, ImageTooLargeError).
        """
        if len(frames) == 0:
            raise ValueError(f"{name}: a clip without frames")
        decoded, held = [], 0
        for index, frame in enumerate(frames):
            decoded.append(decoder.load(frame, f"{name} frame {index}"))
            held += math.prod(_size(decoded[-1]))
            if held > MAX_CLIP_PIXELS:  # before any more is decoded
                raise ValueError(f"{name}: its first {index + 1} frames hold {held} decoded "
                                 f"pixels, more than a clip may ({MAX_CLIP_PIXELS}, "
                                 "MAX_CLIP_PIXELS): give fewer or smaller frames")
        sizes = sorted({_size(frame) for frame in decoded})
        if len(sizes) > 1:
            raise ValueError(f"{name}: the frames of a clip must share one size, got "
                             f"{len(sizes)} sizes {sizes[:4]}")
        pixels = _stacked(decoded)  # [T, 3, H, W], uint8 (or float in [0, 1])
        height, width = sizes[0]
        try:
            target = self.size(len(decoded), height, width)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        if target != (height, width):
            pixels = F.interpolate(pixels, size=target, mode=self.resample, antialias=True,
                                   align_corners=False)
        scale = 255.0 if pixels.dtype == torch.uint8 else 1.0
        mean = torch.tensor(self.mean).view(3, 1, 1) * scale
        std = torch.tensor(self.std).view(3, 1, 1) * scale
        # one copy into float32 in `[T, 3, H, W]` order, then normalised in place
        return pixels.to(torch.float32, memory_format=torch.contiguous_format).sub_(mean) \
            .div_(std)

    def sample(self, video: Video) -> Video:
        """The frames transformers' video processor samples from `video`, a whole decoded
        video at its rate `video.fps` (None: transformers' 24), as its `sample_frames` picks
        them: Qwen3-VL `sample_fps` a second (at least `min_frames`, at most `max_frames` and
        the video's), evenly from the first frame to the last, their indices kept
        (`Video.indices`: its timestamps); Qwen2-VL as many, rounded down to temporal
        patches, evenly from the first, at the rate they then have (its positions follow it).

        Raises:
            ValueError: for a video without frames, one already sampled (its indices set),
                or (Qwen2-VL) one too short to keep a temporal patch.
        """
        total, rate = len(video.frames), video.fps or DEFAULT_FPS
        if total == 0 or video.indices is not None:
            raise ValueError("sample takes a whole video's frames, got "
                             + ("none" if total == 0 else "frames already sampled (indices)"))
        if self.sample_fps is None:
            return video
        wanted = total / rate * self.sample_fps
        if self.rule == "qwen3_vl":
            count = min(max(int(wanted), self.min_frames), self.max_frames, total)
            picked = np.linspace(0, total - 1, count).round().astype(int).tolist()
            return Video(_pick(video.frames, picked), rate, tuple(picked))
        most = math.floor(min(self.max_frames, total) / self.temporal) * self.temporal
        count = math.floor(min(max(wanted, self.min_frames), most, total)
                           / self.temporal) * self.temporal
        if count == 0:
            raise ValueError(f"a video of {total} frame(s) at {rate:g} fps keeps no temporal "
                             f"patch of {self.temporal} frames at {self.sample_fps:g} a second")
        picked = torch.arange(0, total, total / count).int().tolist()
        return Video(_pick(video.frames, picked), len(picked) / total * rate)

    def to_dict(self) -> dict[str, Any]:
        """The fields, as `from_dict` reads them (JSON-ready)."""
        return {key: list(value) if isinstance(value, tuple) else value
                for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, settings: Any, source: object = "video processor") -> VideoProcessor:
        """What `to_dict` wrote.

        Raises:
            ValueError: naming `source`, for a field missing, unknown or out of range.
        """
        fields = set(cls.__dataclass_fields__)
        if not isinstance(settings, dict) or set(settings) - fields:
            unknown = sorted(set(settings) - fields) if isinstance(settings, dict) else settings
            raise ValueError(f"{source}: not a video processor's settings ({unknown!r:.80})")
        try:
            return cls(**settings)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def from_transformers(cls, settings: dict[str, Any], rule: str, *, multiple: int,
                          temporal: int, source: object) -> VideoProcessor:
        """transformers' video processor settings (a `video_preprocessor_config.json`, or
        what transformers falls back to) as ours, transformers' class defaults for what they
        leave out.

        Raises:
            ValueError: naming `source` and the setting, for a step turned off (resize,
                rescale, normalise), another rescale factor, another resampling filter, or
                bounds that are not positive ints in order.
        """
        for step in ("do_resize", "do_rescale", "do_normalize"):
            if settings.get(step, True) is not True:
                raise ValueError(f"{source}: {step} {settings[step]!r}: vlm-vit reads Qwen's "
                                 "video processor with every step on")
        factor = settings.get("rescale_factor", 1 / 255)
        if not (isinstance(factor, (int, float)) and math.isclose(factor, 1 / 255)):
            raise ValueError(f"{source}: rescale_factor {factor!r:.40} is not 1/255")
        size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
        low = size.get("shortest_edge", DEFAULT_BOUNDS[rule][0])
        high = size.get("longest_edge", DEFAULT_BOUNDS[rule][1])
        if rule == "qwen2_vl":  # Qwen2-VL's older keys win; Qwen3-VL's class ignores them
            low, high = settings.get("min_pixels", low), settings.get("max_pixels", high)
        resample = RESAMPLE.get(settings.get("resample", 3))
        mean, std = DEFAULT_MEAN_STD[rule]
        cap = settings.get("cap_pixels_per_frame")
        sampling = {"sample_fps": settings.get("fps", DEFAULT_SAMPLE_FPS[rule]),
                    "min_frames": settings.get("min_frames", 4),
                    "max_frames": settings.get("max_frames", 768)}
        try:
            if resample is None:
                raise ValueError(f"resample {settings.get('resample')!r:.40} is not bilinear "
                                 "(2) or bicubic (3)")
            return cls(rule, multiple, temporal, low, high,
                       tuple(settings.get("image_mean") or mean),
                       tuple(settings.get("image_std") or std), resample,
                       False if cap is None else cap,
                       settings.get("max_video_tokens") or DEFAULT_VIDEO_TOKENS[rule],
                       **sampling)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {str(error)[:200]}") from None

    def to_transformers(self) -> dict[str, Any]:
        """The settings transformers' video processor takes for this one (its keyword
        arguments; the patch and merge sizes are the caller's)."""
        return {"size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "image_mean": list(self.mean), "image_std": list(self.std),
                "resample": {name: number for number, name in RESAMPLE.items()}[self.resample],
                "cap_pixels_per_frame": self.cap_pixels_per_frame,
                "max_video_tokens": self.max_video_tokens,
                "temporal_patch_size": self.temporal, "fps": self.sample_fps,
                "min_frames": self.min_frames, "max_frames": self.max_frames}


def checked_video_processor(video: VideoProcessor | None, tower: Any
                            ) -> VideoProcessor | None:
    """`video` when it fits `tower` (a `VisionTower`): its temporal patch is the tower's.

    Raises:
        ValueError: naming both temporal patches.
    """
    if video is None:
        return None
    if not isinstance(video, VideoProcessor):
        raise ValueError(f"video_processor must be a VideoProcessor, got "
                         f"{type(video).__name__}")
    temporal = tower.encoder.config.temporal_patch_size
    if video.temporal != temporal:
        raise ValueError(f"the video processor's temporal patch is {video.temporal} frames, "
                         f"but the tower's temporal_patch_size is {temporal}")
    return video


def _bounded(height: int, width: int, frames: int, rounded: int, factor: int, low: int,
             high: int) -> tuple[int, int]:
    """`smart_resize`: sides rounded to multiples of `factor`, then scaled down (floored)
    or up (ceiled) until `rounded` frames of that size hold `low` to `high` pixels, the
    scale taken from `frames` frames of the input."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if rounded * h_bar * w_bar > high:
        beta = math.sqrt(frames * height * width / high)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif rounded * h_bar * w_bar < low:
        beta = math.sqrt(low / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar == 0 or w_bar == 0:
        raise ValueError(f"frames of height {height} and width {width} round to no "
                         f"multiple of {factor}")
    return h_bar, w_bar


def _pick(frames: Sequence[Any] | torch.Tensor, picked: list[int]) -> Any:
    """The frames at `picked`, as a tensor for a tensor, else a list."""
    if isinstance(frames, torch.Tensor):
        return frames[picked]
    return [frames[index] for index in picked]


def _size(frame: Any) -> tuple[int, int]:
    """A decoded frame's (height, width): a PIL image's, or a `[3, H, W]` tensor's."""
    if isinstance(frame, torch.Tensor):
        return tuple(frame.shape[1:])
    return frame.height, frame.width


def _stacked(frames: list[Any]) -> torch.Tensor:
    """Decoded frames of one size (RGB PIL images, or float `[3, H, W]` tensors in [0, 1]) as
    `[T, 3, H, W]`: uint8 from PIL as transformers converts them, copied once in their own
    pixel order (channels last; the resize reads that order fastest); float when any frame
    is."""
    if all(not isinstance(frame, torch.Tensor) for frame in frames):
        array = np.stack([np.asarray(frame, dtype=np.uint8) for frame in frames])
        return torch.from_numpy(array).permute(0, 3, 1, 2)
    return torch.stack([frame if isinstance(frame, torch.Tensor) else
                        torch.from_numpy(np.asarray(frame, dtype=np.float32) / 255.0)
                        .permute(2, 0, 1) for frame in frames])
