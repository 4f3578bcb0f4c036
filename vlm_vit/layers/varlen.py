"""Attention restricted to each image of a packed sequence (NaViT's "Patch n' Pack",
Dehghani et al. 2023): the tokens of several images lie end to end in one `[T, D]` matrix,
and a token attends only to the tokens of its own image. The `(T x T)` block-diagonal mask
is never built: each backend works on the segments themselves.

Backends (`Segments.backend`, "auto" picks the first that applies):
- "flash": FlashAttention's `flash_attn_varlen_func` (CUDA, `flash_attn` importable, float16
  or bfloat16), which takes the segment boundaries (`cu_seqlens`) directly.
- "nested": PyTorch `scaled_dot_product_attention` on jagged nested tensors (CUDA; it also
  runs on a CPU, where it is slower than "segments").
- "segments": one `scaled_dot_product_attention` per image length, the images of that length
  as one batch (the CPU default). Only attention is split; every Linear, norm and MLP around it runs
  once on the packed matrix, and those hold most of the FLOPs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "flash", "nested", "segments")


@dataclass(frozen=True)
class Segments:
    """Where each image's tokens lie in a packed sequence.

    Attributes:
        lengths: tokens per image, in order.
        backend: one of `BACKENDS`.
    """

    lengths: tuple[int, ...]
    backend: str = "auto"
    offsets: tuple[int, ...] = field(init=False)  # cu_seqlens: 0, L_0, L_0 + L_1, ..., T

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend {self.backend!r} is not one of {BACKENDS}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"every segment needs at least one token, got {self.lengths}")
        offsets = [0]
        for length in self.lengths:
            offsets.append(offsets[-1] + length)
        object.__setattr__(self, "offsets", tuple(offsets))

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The boundaries as FlashAttention takes them, int32 `[n + 1]`."""
        return torch.tensor(self.offsets, dtype=torch.int32, device=device)

    def resolve(self, q: torch.Tensor) -> str:
        """The backend that runs for queries `q` (device, dtype)."""
        if self.backend != "auto":
            return self.backend
        if q.device.type == "cuda":
            if q.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
                return "flash"
            return "nested"
        return "segments"


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
    need_weights: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Block-diagonal attention over packed queries, keys and values.

    Args:
        q, k, v: `[T, heads, head_dim]`, the images' tokens end to end.
        segments: the images' lengths (summing to T) and the backend.
        need_weights: also return each image's maps (computed explicitly, softmax in
            float32, as `Attention` does).

    Returns:
        The output `[T, heads, head_dim]` and, when asked, one `[heads, L_i, L_i]` map per
        image.
    """
    total = q.shape[0]
    if segments.offsets[-1] != total:
        raise ValueError(f"the segments hold {segments.offsets[-1]} tokens, the sequence {total}")
    bounds = list(pairwise(segments.offsets))
    if need_weights:
        out = torch.empty_like(q)
        maps = []
        for start, stop in bounds:
            # (L, heads, head_dim) -> (heads, L, head_dim)
            qs, ks, vs = (t[start:stop].transpose(0, 1).float() for t in (q, k, v))
            weights = ((qs @ ks.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(dim=-1)
            out[start:stop] = (weights @ vs).transpose(0, 1).to(q.dtype)
            maps.append(weights)  # (heads, L, L)
        return out, tuple(maps)
    backend = segments.resolve(q)
    if backend == "flash":
        flash = _flash_varlen()
        if flash is None:
            raise ImportError("attention backend 'flash' needs flash_attn: pip install flash-attn")
        cu = segments.cu_seqlens(q.device)
        longest = max(segments.lengths)
        return flash(q, k, v, cu, cu, longest, longest), None
    if backend == "nested":
        offsets = torch.tensor(segments.offsets, dtype=torch.int64, device=q.device)
        with warnings.catch_warnings():  # the jagged layout is marked a prototype
            warnings.simplefilter("ignore")
            # each (n, j, heads, head_dim) -> (n, heads, j, head_dim)
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets)
                          .transpose(1, 2)
                          for t in (q, k, v))
            return F.scaled_dot_product_attention(nq, nk, nv).transpose(1, 2).values(), None
    # "segments": the images split apart (one split, whose backward is one concatenation,
    # where a slice per image would each write a zero gradient the size of the whole
    # sequence), and the images of one length run as one batch of one kernel call: each
    # batch element is computed as that image alone would be.
    q, k, v = (t.transpose(0, 1)[None].split(segments.lengths, dim=2)  # (1, heads, L, hd)
               for t in (q, k, v))
    by_length: dict[int, list[int]] = {}
    for index, length in enumerate(segments.lengths):
        by_length.setdefault(length, []).append(index)
    parts: list[torch.Tensor | None] = [None] * len(segments.lengths)
    for indices in by_length.values():
        if len(indices) == 1:
            index = indices[0]
            parts[index] = F.scaled_dot_product_attention(q[index], k[index], v[index])
            continue
        out = F.scaled_dot_product_attention(*(torch.cat([t[i] for i in indices])
                                               for t in (q, k, v)))
        for index, part in zip(indices, out.split(1), strict=True):
            parts[index] = part
    return torch.cat(parts, dim=2)[0].transpose(0, 1), None  # (T, heads, head_dim)
