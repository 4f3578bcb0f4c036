"""Pieces the subcommands share."""

from __future__ import annotations

from pathlib import Path

from vlm_vit.config import EncoderConfig
from vlm_vit.model import VisionEncoder


def image_size(values: list[int] | None) -> tuple[int, int] | None:
    """`--image-size SIDE` or `--image-size HEIGHT WIDTH` as (height, width); None if absent."""
    if not values:
        return None
    if len(values) not in (1, 2):
        raise ValueError(f"--image-size takes SIDE or HEIGHT WIDTH, got {values}")
    return (values[0], values[-1])


def variant_or_checkpoint(model: str, size: tuple[int, int] | int | None) -> VisionEncoder:
    """A checkpoint's encoder when `model` is a path, else a named variant at random init."""
    overrides = {"image_size": size} if size else {}
    if Path(model).exists():
        from vlm_vit.loading import load_encoder

        return load_encoder(model, **overrides)
    return VisionEncoder(EncoderConfig.from_name(model, **overrides))
