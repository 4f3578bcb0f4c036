"""Safe, loud file helpers: atomic writes, and readers that name the file in every error.

Nothing here unpickles: weights are read with safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Opens a temporary file beside `path` and moves it onto `path` only on success.

    A crash half-way leaves the old file (or none), never a truncated one.
    """
    path = Path(path)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def read_json(path: str | Path) -> dict[str, Any]:
    """Reads a JSON object, naming `path` when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Reads every tensor of a safetensors file, naming `path` when it is missing or broken."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Writes tensors to a safetensors file atomically."""
    from safetensors.torch import save

    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    data = save(tensors, metadata={"format": "pt", **(metadata or {})})
    with atomic_write(path, "wb") as handle:
        handle.write(data)
