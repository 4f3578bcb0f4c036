"""What every checkpoint converter provides, and the registry of formats.

A format is an object with a `name`, a `matches(checkpoint)` test on the checkpoint's content
(keys and config, never the file name) and `to_native(checkpoint)`; formats that can be
written back also have `write(encoder, destination, *, pooler=None, processor=None)`, which
`vlm-vit convert` calls. The weight renaming inside is a pure `state_dict -> state_dict`
function built from a declarative key map (`keymap.py`), in both directions.

Every conversion ends in a `Converted`, which checks the config's sizes against the weights'
shapes (`check_config_fits`) before any caller builds a model from it: a config.json that
asks for more blocks, a wider model or a larger grid than its weights hold is refused at
once, naming the file and both numbers, instead of building (or hanging on) that model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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
        given: `EncoderConfig` fields the caller gave (`load_encoder(path, heads=3)`):
            what a reader takes where the tensors and config do not say (`bare.resolve`).
    """

    path: Path
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    given: dict[str, Any] = field(default_factory=dict)

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
        source: the checkpoint (file or directory), named in errors.
        config_file: where `config`'s sizes were read ("config.json"), named in errors.
        format: the name of the format it was read as ("timm", "native", ...).

    Raises:
        ValueError: on construction, when `config` asks for sizes `state` does not hold
            (`check_config_fits`).
    """

    config: EncoderConfig
    state: dict[str, torch.Tensor]
    pooler: NativePooler | None = None
    processor: ImageProcessor | None = None
    rules: list[str] = field(default_factory=list)
    source: object = "the checkpoint"
    config_file: str = "the config"
    format: str = ""  # the format it was read as (`loading.convert_checkpoint` sets it)

    def __post_init__(self) -> None:
        check_config_fits(self.config, self.state, self.source, self.config_file)


def _shape(state: dict[str, torch.Tensor], name: str, ndim: int) -> list[int] | None:
    tensor = state.get(name)
    return list(tensor.shape) if isinstance(tensor, torch.Tensor) and tensor.ndim == ndim \
        else None


def held_blocks(keys: Iterable[str], pattern: str) -> int:
    """How many blocks the weights hold: 1 + the largest index `pattern`'s one group matches
    (0 when none does). Indices over nine digits are not counted (the strict load names
    those keys)."""
    compiled = re.compile(pattern)
    indices = [int(m[1]) for key in keys if (m := compiled.match(key)) and len(m[1]) <= 9]
    return max(indices) + 1 if indices else 0


def block_count_problem(depth: int, held: int, config_file: str = "the config") -> str | None:
    """The words for a depth the weights do not hold (None when they do)."""
    if depth == held:
        return None
    return f"{config_file} says depth {depth} but the weights hold {held} blocks"


def check_block_count(depth: int, held: int, source: object,
                      config_file: str = "the config") -> None:
    """Raises when a config's depth is not the number of blocks in the weights; converters
    call it before renaming, whose key map is expanded over `depth`.

    Raises:
        ValueError: naming `source`, `config_file` and both numbers.
    """
    problem = block_count_problem(depth, held, config_file)
    if problem:
        raise ValueError(f"{source}: {problem}")


def size_problems(config: EncoderConfig, state: dict[str, torch.Tensor],
                  config_file: str = "the config") -> list[str]:
    """Every size of `config` that the native-named weights `state` do not hold.

    Compared, from shapes alone (no model is built): depth with the `blocks.N` present,
    width, input channels and patch size with `patch_embed.proj.weight` `[D, C, P, P]` (for
    the hybrid, width from its 1x1 projection and channels from the ResNet's stem),
    mlp_width with `blocks.0.mlp.fc1.weight` `[M, D]` (SwiGLU's `fc1_g`), the position entries of
    `image_size` with `pos_embed` `[1, class + rows * cols, D]`, registers with `reg_token`
    `[1, R, D]` and the class token with `cls_token`. A tensor that is missing or of
    another rank is left to the strict load, which lists it.
    """
    says = f"{config_file} says"
    problems = []
    depth = block_count_problem(config.depth, held_blocks(state, r"blocks\.(\d+)\."),
                                config_file)
    problems += [depth] if depth else []
    patch = _shape(state, "patch_embed.proj.weight", 4)  # [D, C, P, P]
    if config.hybrid_layers is not None:  # the 1x1 projection of the ResNet's features
        stem = _shape(state, "patch_embed.backbone.stem.conv.weight", 4)  # [64, C, 7, 7]
        patch = None if patch is None or stem is None \
            else [patch[0], stem[1], config.patch_size, config.patch_size]
    if patch is not None:
        if patch[0] != config.width:
            problems.append(f"{says} width {config.width} but the weights hold width "
                            f"{patch[0]} (patch_embed.proj.weight {patch})")
        if patch[1] != config.in_channels:
            problems.append(f"{says} in_channels {config.in_channels} but the weights hold "
                            f"{patch[1]} (patch_embed.proj.weight {patch})")
        if patch[2:] != [config.patch_size] * 2:
            problems.append(f"{says} patch_size {config.patch_size} but the weights hold "
                            f"{patch[2]}x{patch[3]} patches")
    fc1_name = "blocks.0.mlp.fc1_g.weight" if config.mlp == "swiglu" else "blocks.0.mlp.fc1.weight"
    fc1 = _shape(state, fc1_name, 2)  # [M, D]
    if fc1 is not None and fc1[0] != config.mlp_width:
        problems.append(f"{says} mlp_width {config.mlp_width} but the weights hold {fc1[0]} "
                        f"({fc1_name} {fc1})")
    positions = _shape(state, "pos_embed", 3)  # [1, class + rows * cols, D]
    rows, cols = config.grid
    if positions is not None and positions[1] != int(config.class_token) + rows * cols:
        entries = f"1 + {rows * cols}" if config.class_token else f"{rows * cols}"
        height, width = config.image_size
        problems.append(f"{says} image_size {height}x{width} ({entries} position entries) but "
                        f"the weights hold {positions[1]} (pos_embed {positions})")
    registers = _shape(state, "reg_token", 3)  # [1, R, D]
    held = registers[1] if registers is not None else 0
    if "reg_token" in state and registers is None:
        held = config.num_register_tokens  # of another rank: the strict load says so
    if held != config.num_register_tokens:
        problems.append(f"{says} num_register_tokens {config.num_register_tokens} but the "
                        f"weights hold {held}")
    if config.class_token != ("cls_token" in state):
        problems.append(f"{says} class_token {str(config.class_token).lower()} but the "
                        f"weights hold {'a' if 'cls_token' in state else 'no'} cls_token")
    return problems


def check_config_fits(config: EncoderConfig, state: dict[str, torch.Tensor], source: object,
                      config_file: str = "the config") -> None:
    """Refuses a config whose sizes the weights cannot hold, before any model is built.

    Args:
        config: the architecture the source's config gives.
        state: the weights, under native names.
        source: the checkpoint, named in the error.
        config_file: where `config` was read, named in the error.

    Raises:
        ValueError: listing every size that differs (see `size_problems`), with both numbers,
            e.g. "config.json says depth 1000 but the weights hold 2 blocks".
    """
    problems = size_problems(config, state, config_file)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None:
    such a weight makes every feature non-finite, yet loads and runs without an error.

    A sum per tensor, which a NaN or an infinity makes non-finite (0.1 s for ViT-L's 300M
    weights here; an elementwise test takes 30 times as long), confirmed elementwise only
    where the sum is not finite (large float16 weights can overflow it).
    """
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.sum())) and \
                not bool(torch.isfinite(tensor).all()):
            return name
    return None


def non_finite_weight(converted: Converted) -> str | None:
    """`first_non_finite` over the encoder's weights, then its pooling head's (named as
    such)."""
    name = first_non_finite(converted.state)
    if name is None and converted.pooler is not None:
        head = first_non_finite(converted.pooler.weights)
        name = None if head is None else f"the pooling head's {head}"
    return name


def read_processor(source: object, **settings: Any) -> ImageProcessor:
    """An `ImageProcessor` from settings a converter read out of a source's preprocessing
    config (`preprocessor_config.json`, open_clip's `preprocess_cfg`, timm's
    `pretrained_cfg`).

    Raises:
        ValueError: naming `source`, for settings the processor refuses (a size over its
            bounds, a mean that is not 3 finite numbers, ...).
    """
    try:
        return ImageProcessor(**settings)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


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
