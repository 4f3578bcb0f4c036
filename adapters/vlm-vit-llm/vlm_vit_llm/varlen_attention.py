"""Attention confined to each packed record without a mask: SDPA run once per record.

    name = register()                            # transformers' AttentionInterface entry
    llm.set_attn_implementation(name)            # padded calls still run transformers' sdpa
    llm(inputs_embeds=x, position_ids=p, attention_mask=None, use_cache=False,
        **record_boundaries(p))                  # packed rows: one causal SDPA per record

transformers' packed-sequence path for sdpa builds a dense `[R, 1, L, L]` block-diagonal mask
and runs SDPA over the whole row, so a row costs L^2 whatever its records, and a row padded
to the longest row pays for its padding too. FlashAttention's varlen kernel (CUDA) instead
takes the records' boundaries (`cu_seqlens`) and costs the sum of the records' squares. This
is that contract for SDPA on any device: the boundaries come in as FlashAttention's
`cu_seq_lens_q` (computed once per batch, `record_boundaries`) or, absent, from the
restarting `position_ids` (transformers' own detection), and each record runs a plain causal
SDPA on its slice of the row, with no mask. Rows can then be laid end to end in one row
without padding, as for the varlen kernel.

A call with a padding mask (the padded path), or a query shorter than its keys (decoding
with a cache), goes to transformers' `sdpa_attention_forward` unchanged, on the mask
transformers builds for sdpa.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "vlm_vit_varlen_sdpa"


def register() -> str:
    """Registers `NAME` with transformers' attention and mask interfaces (idempotent);
    returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_sdpa_forward)
    AttentionMaskInterface.register(NAME, _padding_mask_only)
    return NAME


def record_boundaries(position_ids: torch.Tensor) -> dict[str, Any]:
    """FlashAttention's varlen arguments for packed rows: where each record starts in the
    rows laid end to end, from positions that restart at every record (a row's padding
    counts as a record of its own).

    Args:
        position_ids: `[R, L]`.

    Returns:
        `cu_seq_lens_q` and `cu_seq_lens_k` (int32 `[records + 1]`: 0, the starts, R * L),
        `max_length_q` and `max_length_k` (the longest record).
    """
    rows, length = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1  # (R, L)
    flat = starts.flatten().nonzero().flatten()
    total = torch.tensor([rows * length], device=flat.device, dtype=flat.dtype)
    bounds = torch.cat([flat, total]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest,
            "max_length_k": longest}


def varlen_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: Any
                        ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: `query` `[B, H, L, d]`, `key` and `value`
    `[B, H_kv, S, d]`; returns `([B, L, H, d], None)`.

    Without a mask and with L == S, causal attention within each record (boundaries from
    `cu_seq_lens_q`, else from `position_ids`, else the whole row); otherwise transformers'
    sdpa.

    Raises:
        ValueError: for a sliding window, a soft cap or a position bias (the records would
            lose them silently).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, _, length, _ = query.shape
    if attention_mask is not None or key.shape[2] != length:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    for name in ("sliding_window", "softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} passes {name}={kwargs[name]!r}; "
                             f"{NAME} runs plain causal attention per record and has none")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(B', H, n, d) each -> (B', n, H, d)."""
        return nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout if module.training else 0.0, scale=scaling,
            is_causal=causal and query.shape[2] > 1,
            enable_gqa=query.shape[1] != key.shape[1]).transpose(1, 2)

    spans = _spans(kwargs, batch, length)
    if all(row == [(0, length)] for row in spans):  # one record a row: one batched call
        return attend(query, key, value).contiguous(), None
    # Records as split views (not slices): autograd then joins their gradients with one
    # concatenation instead of a zero-filled row per record.
    rows = []
    for records, *tensors in zip(spans, query.split(1), key.split(1), value.split(1),
                                 strict=True):
        sizes = [end - start for start, end in records]
        pieces = zip(*(tensor.split(sizes, dim=2) for tensor in tensors), strict=True)
        outputs = [attend(*piece) for piece in pieces]
        rows.append(torch.cat(outputs, dim=1) if len(outputs) > 1
                    else outputs[0].contiguous())  # (1, L, H, d)
    return (torch.cat(rows) if len(rows) > 1 else rows[0]), None


def _spans(kwargs: dict[str, Any], batch: int, length: int) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each record in it."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None or position_ids.shape[-1] != length:
            return [[(0, length)] for _ in range(batch)]
        bounds = record_boundaries(position_ids.expand(batch, -1))["cu_seq_lens_q"]
    flat = bounds.tolist()
    if flat[-1] != batch * length:
        raise ValueError(f"cu_seq_lens_q ends at {flat[-1]}, but the rows hold "
                         f"{batch} x {length} tokens")
    spans: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
    for start, end in zip(flat[:-1], flat[1:], strict=True):
        row = start // length
        if (end - 1) // length != row:
            raise ValueError(f"a record spans rows {row} and {(end - 1) // length} "
                             f"(tokens {start}..{end} of rows of {length})")
        spans[row].append((start - row * length, end - row * length))
    return spans


def _padding_mask_only(*, attention_mask: torch.Tensor | None = None, **kwargs: Any
                       ) -> torch.Tensor | None:
    """transformers' sdpa mask when a padding mask is given or the queries are fewer than
    the keys (a cache); none otherwise (the records are then found from their boundaries or
    positions, never from a dense mask)."""
    if attention_mask is None and kwargs.get("q_length") == kwargs.get("kv_length"):
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)
