"""Declarative key maps and the few named tensor fix-ups converters share.

A key map is a dict from a source name to a native name; `{}` stands for the block index:

    {"encoder.layers.{}.layer_norm1.weight": "blocks.{}.norm1.weight", ...}
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch


def expand(key_map: Mapping[str, str], depth: int) -> dict[str, str]:
    """The exact source -> target names for `depth` blocks."""
    exact: dict[str, str] = {}
    for source, target in key_map.items():
        indices = range(depth) if "{}" in source else [None]
        for i in indices:
            exact[source.replace("{}", str(i))] = target.replace("{}", str(i))
    return exact


def invert(key_map: Mapping[str, str]) -> dict[str, str]:
    """The reverse map (native -> source), for writing a checkpoint back."""
    return {target: source for source, target in key_map.items()}


def rename(
    tensors: Mapping[str, torch.Tensor],
    key_map: Mapping[str, str],
    depth: int,
    *,
    ignore: Iterable[str] = (),
    source: object = "checkpoint",
) -> dict[str, torch.Tensor]:
    """Renames tensors by `key_map`; a pure function.

    Args:
        tensors: the source tensors.
        key_map: source -> target names, `{}` for the block index.
        depth: the number of blocks.
        ignore: regular expressions of source names that are deliberately dropped (a text
            tower, a classifier head).
        source: named in the error.

    Raises:
        ValueError: listing every tensor that is neither mapped nor ignored.
    """
    exact = expand(key_map, depth)
    patterns = [re.compile(p) for p in ignore]
    renamed, unknown = {}, []
    for name, tensor in tensors.items():
        if name in exact:
            renamed[exact[name]] = tensor
        elif not any(p.match(name) for p in patterns):
            unknown.append(name)
    if unknown:
        raise ValueError(f"{source} has tensors this converter does not know: "
                         f"{', '.join(sorted(unknown))}")
    return renamed


def count_blocks(keys: Iterable[str], pattern: str) -> int:
    """The number of blocks: 1 + the largest index matched by `pattern`'s one group."""
    compiled = re.compile(pattern)
    indices = [int(m.group(1)) for key in keys if (m := compiled.match(key))]
    if not indices:
        raise ValueError(f"no block matches {pattern!r}")
    return max(indices) + 1


def held_stages(keys: Iterable[str], pattern: str, first: int = 0) -> tuple[int, ...]:
    """Blocks per stage: `pattern`'s two groups are the stage and block indices (the hybrid's
    `stages.S.blocks.B.`), counted from `first` (1 in Google's `block1/unit1/`); () when
    nothing matches."""
    compiled = re.compile(pattern)
    blocks: dict[int, int] = {}
    for key in keys:
        if m := compiled.match(key):
            stage, block = int(m.group(1)) - first, int(m.group(2)) - first
            blocks[stage] = max(blocks.get(stage, 0), block + 1)
    return tuple(blocks.get(i, 0) for i in range(max(blocks) + 1)) if blocks else ()


def origins(tensors: Iterable[str], key_map: Mapping[str, str], depth: int) -> dict[str, str]:
    """native -> source name of each tensor `rename` maps (a key map may list several source
    spellings of one tensor: only the one the checkpoint holds is named)."""
    present = set(tensors)
    return {target: name for name, target in expand(key_map, depth).items() if name in present}


def qkv_shapes(width: int, part: str = "blocks.{}.attn.{}") -> dict[str, list[int]]:
    """The shapes our attention needs of q, k and v and of the fused qkv, weights and biases
    (`{}` the block index): `[D, D]` and `[D]` apart, `[3D, D]` and `[3D]` fused."""
    shapes = {}
    for name, rows in (("q", width), ("k", width), ("v", width), ("qkv", 3 * width)):
        shapes[part.format("{}", f"{name}.weight")] = [rows, width]
        shapes[part.format("{}", f"{name}.bias")] = [rows]
    return shapes


def check_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, list[int]],
                 depth: int, *, source: object = "checkpoint",
                 origin: Mapping[str, str] | None = None) -> None:
    """Raises for the first tensor of `state` whose shape is not `expected`'s, before a
    fix-up concatenates, splits or permutes it (and fails inside torch, or silently takes
    the wrong rows).

    Args:
        state: the tensors, under the names `expected` uses.
        expected: name -> shape, `{}` for the block index (`qkv_shapes`); absent tensors
            are left to the strict load.
        depth: the number of blocks.
        source: the checkpoint, named in the error.
        origin: native -> source names (`origins`), so that the error names the tensor as
            the file does.

    Raises:
        ValueError: naming `source`, the tensor and both shapes, e.g. "DIR: encoder.layer.0.
            attention.attention.key.weight has shape [32, 37], expected [32, 32]".
    """
    exact = {name: shape for template, shape in expected.items()
             for name in expand({template: template}, depth)}
    origin = origin or {}
    for name, tensor in state.items():
        shape = exact.get(name)
        if shape is not None and list(tensor.shape) != shape:
            raise ValueError(f"{source}: {origin.get(name, name)} has shape "
                             f"{list(tensor.shape)}, expected {shape}")


def fuse_qkv(state: dict[str, torch.Tensor], depth: int, part: str = "blocks.{}.attn.{}", *,
             width: int | None = None, source: object = "checkpoint",
             origin: Mapping[str, str] | None = None) -> None:
    """Concatenates `q`, `k`, `v` weights and biases into the fused `qkv` (in place).

    Expects `blocks.N.attn.q.weight` etc.; writes `blocks.N.attn.qkv.weight`. The copies run
    on a few threads: from a memory-mapped file they are page-fault bound, and they are the
    one part of loading a Hugging Face checkpoint that copies weights.

    Args:
        state: native-named tensors.
        depth: the number of blocks.
        part: the name of a block's attention tensor, block index and tensor left open.
        width: the model width; converters pass it, so that every q, k and v is checked
            first (`check_shapes`), naming `source` and, through `origin`, the source's name
            for a tensor of the wrong shape. They are checked against the width the weights
            hold (the patch embedding's `[D, ...]`) where `state` has one: a config that says
            another width is named as such by `base.check_config_fits`.
        source, origin: as in `check_shapes`.

    Raises:
        ValueError: for a q, k or v of another shape than `width` needs.
    """
    if width is not None:
        patch = state.get("patch_embed.proj.weight")
        held = patch.shape[0] if isinstance(patch, torch.Tensor) and patch.ndim else width
        check_shapes(state, qkv_shapes(held, part), depth, source=source, origin=origin)
    groups = {}
    for i in range(depth):
        for kind in ("weight", "bias"):
            names = [part.format(i, f"{x}.{kind}") for x in "qkv"]
            if all(n in state for n in names):
                groups[part.format(i, f"qkv.{kind}")] = [state.pop(n) for n in names]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        fused = pool.map(torch.cat, groups.values())
        state.update(zip(groups, fused, strict=True))


def split_qkv(state: dict[str, torch.Tensor], depth: int, part: str = "blocks.{}.attn.{}") -> None:
    """The inverse of `fuse_qkv` (in place)."""
    for i in range(depth):
        for kind in ("weight", "bias"):
            fused = part.format(i, f"qkv.{kind}")
            if fused in state:
                for x, chunk in zip("qkv", state.pop(fused).chunk(3, dim=0), strict=True):
                    state[part.format(i, f"{x}.{kind}")] = chunk.clone()
