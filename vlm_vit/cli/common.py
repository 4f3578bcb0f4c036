"""Pieces the subcommands share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from vlm_vit.config import EncoderConfig, available_variants
from vlm_vit.model import VisionEncoder


def check_device(device: str) -> None:
    """Refuses a `--device` that is not one, or not on this machine, in one line.

    Raises:
        ValueError: naming the device and what to use instead.
    """
    import torch

    if device == "auto":
        return
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a device; use auto, cpu, cuda or "
                         f"cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} asked for, but CUDA is not available on this "
                             f"machine; use --device cpu (or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device} asked for, but MPS is not available; use --device "
                         f"cpu")
    elif resolved.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: vlm-vit runs on cpu, cuda or mps")


def image_size(values: list[int] | None) -> tuple[int, int] | None:
    """`--image-size SIDE` or `--image-size HEIGHT WIDTH` as (height, width); None if absent."""
    if not values:
        return None
    if len(values) not in (1, 2):
        raise ValueError(f"--image-size takes SIDE or HEIGHT WIDTH, got {values}")
    return (values[0], values[-1])


def is_variant(model: str) -> bool:
    """Whether a command that takes variants and checkpoints reads `model` as a variant: an
    existing path wins, then a known variant name (`vit-b/16`); anything else, and any
    `hf-hub:` name, is a checkpoint or a model name (`vlm_vit.hub`)."""
    return model in available_variants() and not Path(model).exists()


def variant_or_checkpoint(model: str, size: tuple[int, int] | int | None) -> VisionEncoder:
    """A named variant at random init (see `is_variant`), else a checkpoint's encoder."""
    overrides = {"image_size": size} if size else {}
    if is_variant(model):
        return VisionEncoder(EncoderConfig.from_name(model, **overrides))
    from vlm_vit.loading import load_encoder

    with not_a_variant_either(model):
        return load_encoder(model, **overrides)


@contextlib.contextmanager
def not_a_variant_either(model: str) -> Iterator[None]:
    """Adds the variant names to the error of a name that is no path, variant or cached
    model, since a mistyped variant (`vit-b/17`) ends there too."""
    from vlm_vit.hub import NotCachedError

    try:
        yield
    except NotCachedError as error:
        try:
            EncoderConfig.from_name(model)
        except (KeyError, ValueError) as unknown:  # UnknownNameError, with close matches
            raise NotCachedError(f"{error}. Nor a variant: {unknown}") from error
        raise
