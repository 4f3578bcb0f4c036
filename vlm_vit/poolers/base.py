"""The pooler interface, its registry, and `build_pooler`.

A pooler (or projector: the same interface) maps the encoder's tokens to what a pipeline
wants: a fixed number of tokens of the LLM's width, or one vector. It is an `nn.Module`:

    pooler(tokens, *, num_prefix_tokens, grid)   # [B, prefix + N, D] -> [B, M, out] or [B, out]
    pooler.num_output_tokens(grid, num_prefix_tokens=0)  # M, or None for a vector

Packed input (images of different sizes end to end, `vlm_vit.packing`) goes through
`pool_packed`: a pooler with a `forward_packed` method takes the whole `[total, D]` matrix
at once (the per-token projectors do); any other runs once per image, automatically.

Sizes are bounded before anything is allocated, so a tower config cannot ask for a pooler
that exhausts memory: `in_dim` and `out_dim` 1..65536 (`MAX_POOLER_WIDTH`, four times the
widest LLM's 16384), `mlp{N}x_gelu` and other depths 1..64 (`MAX_POOLER_DEPTH`), query and
latent counts 1..4096 (`MAX_POOLER_TOKENS`), MLP ratios in (0, 64].

Built-ins register with `@register_pooler(name)`; other installed distributions add theirs
through the entry-point group `vlm_vit.poolers` (the entry's name is the pooler's name, its
object the class or a factory taking `in_dim`, `out_dim=None` and options).
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from vlm_vit.config import ConfigError, check_int, is_real
from vlm_vit.layers import build_activation
from vlm_vit.registry import Registry

POOLERS = Registry("pooler", entry_point_group="vlm_vit.poolers")
_MLP_DEPTH = re.compile(r"mlp(\d+)x_gelu")

MAX_POOLER_WIDTH = 65_536  # in_dim, out_dim
MAX_POOLER_DEPTH = 64  # mlp{N}x_gelu's N, the perceiver's layers
MAX_POOLER_TOKENS = 4_096  # learned queries or latents (Qwen-VL: 256, Flamingo: 64)
MAX_MLP_RATIO = 64.0


def check_width(name: str, value: Any, optional: bool = False) -> int | None:
    """A pooler width (`in_dim`, `out_dim`): an int in 1..`MAX_POOLER_WIDTH` (or None when
    `optional`).

    Raises:
        ConfigError: (a ValueError) naming the field, the bounds and the value.
    """
    if optional and value is None:
        return None
    try:
        return check_int(name, value, 1, MAX_POOLER_WIDTH)
    except ConfigError as error:
        if not optional:
            raise
        raise ConfigError(name, value, f"{error.allowed} or None") from None


def check_count(name: str, value: Any, high: int) -> int:
    """A pooler's depth or token count: an int in 1..`high`, else a ConfigError."""
    return check_int(name, value, 1, high)


def check_heads(value: Any, width: int) -> int | None:
    """Attention heads: None (the default) or a positive int dividing `width`."""
    if value is None:
        return None
    heads = check_int("heads", value, 1, width)
    if width % heads:
        raise ConfigError("heads", value, f"a divisor of the width {width}")
    return heads


def check_mlp_ratio(value: Any) -> float:
    """An MLP hidden width as a multiple of the token width: a finite number in (0, 64]."""
    if not (is_real(value) and 0 < value <= MAX_MLP_RATIO):
        raise ConfigError("mlp_ratio", value, f"a finite number in (0, {MAX_MLP_RATIO:g}]")
    return float(value)


@runtime_checkable
class Pooler(Protocol):
    """What every pooler provides (see the module docstring)."""

    def __call__(
        self, tokens: torch.Tensor, *, num_prefix_tokens: int, grid: tuple[int, int]
    ) -> torch.Tensor: ...

    def num_output_tokens(
        self, grid: tuple[int, int], *, num_prefix_tokens: int = 0
    ) -> int | None:
        """How many tokens the pooler returns for an image of `grid` patches (with
        `num_prefix_tokens` class and register tokens before them), or None for one vector
        per image."""
        ...


def register_pooler(name: str):
    """A class decorator: `@register_pooler("name")`. A taken name is a ValueError."""
    return POOLERS.register(name)


def available_poolers() -> list[str]:
    """Every pooler name, plugins included (`mlp{N}x_gelu` works for any N >= 1)."""
    return POOLERS.names()


def build_pooler(name: str, *, in_dim: int, out_dim: int | None = None, **options: Any):
    """Builds a pooler by name.

    Args:
        name: a name from `available_poolers()`, or `mlp{N}x_gelu` for an N-layer MLP.
        in_dim: the width of the tokens it receives.
        out_dim: the width it returns; default `in_dim`. Poolers without weights refuse
            any other value.
        **options: the pooler's own options (e.g. `num_queries=4`, `scale=2`).

    Returns:
        The pooler, with `pooler_spec` recording how it was built (for saving).

    Raises:
        UnknownNameError: for an unknown name, with the close matches.
        ValueError: for options the pooler does not take, or bad values; for sizes out of
            their bounds (see the module docstring), before anything is allocated.
    """
    if not isinstance(name, str):
        raise ValueError(f"a pooler name must be a string, got {name!r}")
    in_dim = check_width("in_dim", in_dim)
    out_dim = check_width("out_dim", out_dim, optional=True)
    match = _MLP_DEPTH.fullmatch(name)
    if match and name not in POOLERS:
        depth = match[1]  # digits; a thousand of them are not turned into an int
        if len(depth) > 2 or not 1 <= int(depth) <= MAX_POOLER_DEPTH:
            raise ValueError(f"{name}: the depth {depth} is out of range; mlp{{N}}x_gelu "
                             f"takes N in 1..{MAX_POOLER_DEPTH}")
        factory, extra = POOLERS.get("mlp2x_gelu"), {"depth": int(depth)}
    else:
        factory, extra = POOLERS.get(name), {}
    try:
        pooler = factory(in_dim=in_dim, out_dim=out_dim, **extra, **options)
    except TypeError as error:
        raise ValueError(f"cannot build pooler {name!r} with options {options}: {error}") from error
    pooler.pooler_spec = {"name": name, "in_dim": in_dim, "out_dim": out_dim,
                          "options": dict(options)}
    return pooler


def no_weights_out_dim(name: str, in_dim: int, out_dim: int | None) -> int:
    """The output width of a pooler without weights: `in_dim`, and nothing else."""
    if out_dim is not None and out_dim != in_dim:
        raise ValueError(
            f"pooler {name!r} has no weights and returns width {in_dim}; it cannot give "
            f"out_dim={out_dim} (put a projector such as 'mlp2x_gelu' after it)"
        )
    return in_dim


def split_tokens(
    tokens: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int], in_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks `[B, prefix + rows * cols, D]` tokens and splits them into prefix and patches."""
    rows, cols = grid
    expected = num_prefix_tokens + rows * cols
    if tokens.ndim != 3 or tokens.shape[1] != expected:
        raise ValueError(
            f"tokens of shape {list(tokens.shape)} do not fit {num_prefix_tokens} prefix "
            f"tokens and a {rows}x{cols} grid (expected [B, {expected}, D])"
        )
    if in_dim is not None and tokens.shape[-1] != in_dim:
        raise ValueError(f"tokens have width {tokens.shape[-1]}, the pooler expects {in_dim}")
    return tokens[:, :num_prefix_tokens], tokens[:, num_prefix_tokens:]


def pool_packed(
    pooler: nn.Module, tokens: torch.Tensor, *, lengths: tuple[int, ...] | list[int],
    grids: tuple[tuple[int, int], ...] | list[tuple[int, int]], num_prefix_tokens: int,
) -> list[torch.Tensor]:
    """Pools packed tokens image by image.

    Args:
        pooler: any pooler.
        tokens: `[total, D]`, each image's `prefix + rows * cols` tokens end to end.
        lengths: tokens per image.
        grids: each image's patch grid.
        num_prefix_tokens: prefix tokens at the front of each image.

    Returns:
        One `[M_i, out]` tensor per image (`[out]` for a pooler that returns a vector).

    Raises:
        ValueError: when lengths, grids and tokens disagree.
    """
    if len(lengths) != len(grids):
        raise ValueError(f"{len(lengths)} lengths for {len(grids)} grids")
    for index, (length, (rows, cols)) in enumerate(zip(lengths, grids, strict=True)):
        if length != num_prefix_tokens + rows * cols:
            raise ValueError(f"image {index}: {length} tokens do not fit {num_prefix_tokens} "
                             f"prefix tokens and a {rows}x{cols} grid")
    if tokens.ndim != 2 or tokens.shape[0] != sum(lengths):
        raise ValueError(f"packed tokens must be [{sum(lengths)}, D], got {list(tokens.shape)}")
    forward_packed = getattr(pooler, "forward_packed", None)
    if forward_packed is not None:
        return forward_packed(tokens, lengths=tuple(lengths), grids=tuple(grids),
                              num_prefix_tokens=num_prefix_tokens)
    return [pooler(part[None], num_prefix_tokens=num_prefix_tokens, grid=grid)[0]
            for part, grid in zip(tokens.split(list(lengths)), grids, strict=True)]


class TokenWise:
    """For poolers that map every token on its own (`map_tokens`, `[..., D] -> [..., out]`):
    packed tokens go through in one call, every token kept."""

    def map_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_packed(self, tokens: torch.Tensor, *, lengths: tuple[int, ...],
                       grids: tuple[tuple[int, int], ...],
                       num_prefix_tokens: int) -> list[torch.Tensor]:
        """`[total, D]` to one `[L_i, out]` tensor per image (see `pool_packed`)."""
        if tokens.shape[-1] != self.in_dim:
            raise ValueError(f"tokens have width {tokens.shape[-1]}, the pooler expects "
                             f"{self.in_dim}")
        return list(self.map_tokens(tokens).split(list(lengths)))


def default_heads(width: int, most: int = 16) -> int:
    """The largest head count up to `most` that divides `width`."""
    return next(h for h in range(min(most, width), 0, -1) if width % h == 0)


class FeedForward(nn.Sequential):
    """LayerNorm, Linear, activation, Linear: the MLP inside the attention poolers."""

    def __init__(self, width: int, hidden: int, act: str = "gelu", eps: float = 1e-5) -> None:
        if not (is_real(eps) and 0 < eps <= 1):
            raise ConfigError("eps", eps, "a finite number in (0, 1]")
        super().__init__(nn.LayerNorm(width, eps=eps), nn.Linear(width, hidden),
                         build_activation(act), nn.Linear(hidden, width))
