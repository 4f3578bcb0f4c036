"""Multi-head self-attention with a fused qkv projection (paper eq. 2, Appendix A)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.layers.rope_2d import apply_rope
from vlm_vit.layers.varlen import Segments, varlen_attention
from vlm_vit.layers.window_segments import Windows, window_attention

Angles = tuple[torch.Tensor, torch.Tensor]  # RoPE's cos and sin, `[T, head_dim]` each


class Attention(nn.Module):
    """Multi-head self-attention.

    The fast path is `scaled_dot_product_attention`; when the attention maps are asked for,
    the same weights compute them explicitly (softmax in float32), so a model built for speed
    can still be inspected without being rebuilt. Given RoPE angles, q and k are rotated
    (`rope_2d.apply_rope`) before either path.
    """

    def __init__(self, width: int, heads: int, qkv_bias: bool = True) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.proj = nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, need_weights: bool = False, segments: Segments | None = None,
        rope: Angles | None = None, windows: Windows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """Attends every token to every token (of its own image, with `segments`; of its own
        window, with `windows`).

        Args:
            x: tokens `[B, T, D]`; with `segments`, `[1, T, D]`, several images end to end.
            need_weights: also return the attention maps.
            segments: the images of a packed sequence (`vlm_vit.layers.varlen`): attention
                stays within each; the projections still run once on all T tokens.
            rope: cos and sin `[T, head_dim]` per token (`rope_2d.Rope2D.for_grids`), or None.
            windows: window attention over all B * T tokens (`window_segments.build_windows`).

        Returns:
            The output `[B, T, D]` and the maps `[B, heads, T, T]` (with `segments`: one
            `[heads, L_i, L_i]` per image), or None.
        """
        batch, tokens, width = x.shape
        if windows is not None:
            return self._windowed(x, need_weights, rope, windows, stack=segments is None)
        if segments is not None:
            if batch != 1:
                raise ValueError(f"a packed sequence is [1, T, D], got {list(x.shape)}")
            # (T, 3, heads, head_dim) -> three (T, heads, head_dim)
            q, k, v = self.qkv(x[0]).reshape(tokens, 3, self.heads, self.head_dim).unbind(1)
            if rope is not None:  # (T, head_dim) -> (T, 1, head_dim) over the heads
                q, k = (apply_rope(t, rope[0][:, None], rope[1][:, None]) for t in (q, k))
            out, maps = varlen_attention(q, k, v, segments, need_weights)
            return self.proj(out.reshape(1, tokens, width)), maps
        # (B, T, 3, heads, head_dim) -> (3, B, heads, T, head_dim)
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if rope is not None:  # (T, head_dim) broadcasts over (B, heads)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        weights = None
        if need_weights:
            scores = (q.float() @ k.float().transpose(-2, -1)) * self.head_dim**-0.5
            weights = scores.softmax(dim=-1)  # (B, heads, T, T)
            out = (weights @ v.float()).to(v.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, T, head_dim)
        out = out.transpose(1, 2).reshape(batch, tokens, width)
        return self.proj(out), weights

    def _windowed(self, x: torch.Tensor, need_weights: bool, rope: Angles | None,
                  windows: Windows, stack: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """`forward` with window attention: the B * T tokens as one sequence."""
        batch, tokens, width = x.shape
        # (B * T, 3, heads, head_dim) -> three (B * T, heads, head_dim)
        q, k, v = self.qkv(x.reshape(batch * tokens, width)).reshape(
            batch * tokens, 3, self.heads, self.head_dim).unbind(1)
        if rope is not None:  # (T, head_dim) per image -> (B * T, 1, head_dim)
            cos, sin = (t.repeat(batch * tokens // t.shape[0], 1)[:, None] for t in rope)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, maps = window_attention(q, k, v, windows, need_weights)
        if maps is not None and stack:
            maps = torch.stack(maps)  # (B, heads, T, T)
        return self.proj(out.reshape(batch, tokens, width)), maps
