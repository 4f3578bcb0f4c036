"""`load_encoder`: the one entry point that reads an encoder from a path.

Today it reads the native format; the checkpoint converters register further formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlm_vit.model import CONFIG_NAME, WEIGHTS_NAME, VisionEncoder


def load_encoder(
    path: str | Path, *, format: str | None = None, dtype: torch.dtype | None = None,
    **overrides: Any,
) -> VisionEncoder:
    """Loads an encoder from a checkpoint.

    Args:
        path: a native checkpoint directory (`config.json` + `model.safetensors`).
        format: the checkpoint format; None detects it ("native" is the only one so far).
        dtype: cast the weights to this dtype (default: as stored).
        **overrides: `EncoderConfig` fields to change, e.g. ``image_size=(384, 384)``.

    Raises:
        FileNotFoundError: when `path` does not exist.
        ValueError: when the format is unknown or the files are malformed, naming the file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if format is None:
        format = "native" if (path / CONFIG_NAME).is_file() else None
    if format != "native":
        found = "" if format is None else f" {format!r}"
        raise ValueError(
            f"cannot load{found} checkpoint {path}: the native format (a directory with "
            f"{CONFIG_NAME} and {WEIGHTS_NAME}) is the only one supported so far"
        )
    return VisionEncoder.from_pretrained(path, dtype=dtype, **overrides)
