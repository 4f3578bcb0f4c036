"""What every checkpoint converter provides, and the registry of formats.

A format is an object with a `name`, a `matches(checkpoint)` test on the checkpoint's content
(keys and config, never the file name) and `to_native(checkpoint)`; formats that can be
written back also have `write(encoder, destination, *, pooler=None, processor=None)`, which
`vlm-vit convert` calls. The weight renaming inside is a pure `state_dict -> state_dict`
function built from a declarative key map (`keymap.py`), in both directions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from vlm_vit.config import EncoderConfig
from vlm_vit.processor import ImageProcessor
from vlm_vit.registry import Registry

FORMATS = Registry("checkpoint format")


@dataclass
class Checkpoint:
    """The content of a checkpoint, read safely.

    Attributes:
        path: where it came from (a file or a directory).
        tensors: every tensor, under the source's own names.
        config: the source's `config.json` (Hugging Face and native directories), if any.
        files: other JSON files found beside the weights, by file name
            (`preprocessor_config.json`, `open_clip_config.json`, ...).
    """

    path: Path
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def has_prefix(self, *prefixes: str) -> bool:
        """Whether any tensor name starts with one of `prefixes`."""
        return any(key.startswith(prefixes) for key in self.tensors)


@dataclass
class NativePooler:
    """The source's own pooling head, as a vlm-vit pooler: name, options and weights."""

    name: str
    in_dim: int
    out_dim: int | None
    options: dict[str, Any]
    weights: dict[str, torch.Tensor]


@dataclass
class Converted:
    """A checkpoint in native terms.

    Attributes:
        config: the architecture, from the source's config or shapes.
        state: the encoder's weights under native names.
        pooler: the source's own pooling head, where it has one.
        processor: the preprocessing the source records (mean, std, size, resize mode).
        rules: the documented rules applied where the source could not tell (logged).
    """

    config: EncoderConfig
    state: dict[str, torch.Tensor]
    pooler: NativePooler | None = None
    processor: ImageProcessor | None = None
    rules: list[str] = field(default_factory=list)


class CheckpointFormat(Protocol):
    """One checkpoint family (see the module docstring)."""

    name: str

    def matches(self, checkpoint: Checkpoint) -> bool: ...

    def to_native(self, checkpoint: Checkpoint) -> Converted: ...


def register_format(fmt: Any) -> Any:
    """Registers a format object under its `name`; returns it."""
    FORMATS.add(fmt.name, fmt)
    return fmt


def detect_format(checkpoint: Checkpoint) -> CheckpointFormat:
    """The one registered format whose `matches` accepts the checkpoint.

    Raises:
        ValueError: when none or several match, naming the file, a few of its keys and the
            formats that `format=` accepts.
    """
    matching = [FORMATS.get(name) for name in FORMATS.names()
                if FORMATS.get(name).matches(checkpoint)]
    if len(matching) == 1:
        return matching[0]
    sample = ", ".join(sorted(checkpoint.tensors)[:4]) or "no tensors"
    if not matching:
        raise ValueError(f"cannot tell the checkpoint format of {checkpoint.path} (keys: "
                         f"{sample}, ...); pass format= one of {', '.join(FORMATS.names())}")
    raise ValueError(f"{checkpoint.path} matches several formats "
                     f"({', '.join(f.name for f in matching)}); pass format= to choose")
