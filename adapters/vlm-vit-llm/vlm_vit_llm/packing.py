"""Padding-free packed LLM rows: several records per row, each attending only to itself.

    rows = pack_rows([len(a), len(b), len(c)], max_length=2048)    # first-fit decreasing
    batch = mm.prepare(ids, images, token_labels=labels, pack=rows)
    out = mm.run(batch)                                              # logits [R, L, V]

A packed row holds whole records end to end, then padding. Positions restart at 0 for every
record (the padding is a record of its own, with no label), the first token of every record
has no label (no record learns to predict the next record's first token), and attention is
confined to each record by one of four paths, chosen once per model and logged:

- `flash_attention_2`: the LLM runs transformers' FlashAttention-2 (CUDA, `flash_attn`
  installed). All rows are laid end to end in one row without padding; transformers finds
  each record from the restarting `position_ids` and calls the varlen kernel.
- `varlen_sdpa`: an LLM on transformers' sdpa runs `vlm_vit_llm.varlen_attention` instead
  (registered with transformers' attention interface): one causal SDPA per record, its
  boundaries given as FlashAttention's `cu_seq_lens_q` (once per batch), no mask. Rows are
  laid end to end in one row without padding, as for the varlen kernel, so attention costs
  the sum of the records' squares and no token is padding. Padded calls on the same LLM run
  transformers' sdpa unchanged.
- `position_ids`: transformers' packed-sequence path for sdpa and eager: `attention_mask=None`,
  the restarting `position_ids` and `use_cache=False`. transformers detects packing from the
  positions only in exactly that case; with the cache on (the default) records silently
  attend to each other (logits off by 0.12-0.25 on a tiny Llama, transformers 5.24).
  transformers builds a dense `[R, 1, L, L]` mask from the positions: every row costs L^2.
- `block_mask`: a `[R, 1, L, L]` additive block-diagonal causal mask, for a model whose masks
  do not come from transformers' `create_causal_mask`.

The chosen path is checked once against two records run separately
(`check_packed_attention`); a mismatch is an error naming the model class, so a transformers
release that changes the detection cannot leak silently. A multimodal-RoPE LLM (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) takes `[4, R, L]` positions: the restarting text positions, which every
path reads as above, then each record's own 3-D ids (`vlm_vit_llm.mrope.packed_batch_positions`);
Qwen3-VL's DeepStack features follow the packed image tokens (`vlm_vit_llm.deepstack`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import vlm_vit_llm.varlen_attention as varlen_attention
from vlm_vit.train.token_budget import first_fit_decreasing
from vlm_vit_llm.batch_types import IGNORE_INDEX
from vlm_vit_llm.mrope import multimodal_rope
from vlm_vit_llm.presets import LOSS_REDUCTIONS as LOSS_REDUCTIONS

logger = logging.getLogger(__name__)

PATHS = ("flash_attention_2", "varlen_sdpa", "position_ids", "block_mask")
ONE_ROW_PATHS = ("flash_attention_2", "varlen_sdpa")  # all rows end to end, no padding
# The check's tolerance on logits, relative to their largest magnitude: a leak moves them by
# tenths; float32 kernels agree to ~1e-6, half-precision ones to ~1e-2.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 3e-2


class PackingLeakError(RuntimeError):
    """Packed records do not give the logits they give alone: attention leaks across them."""


def pack_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Record indices grouped into rows of at most `max_length` tokens (first-fit decreasing,
    `vlm_vit.train.token_budget.first_fit_decreasing`): rows in opening order, each row's
    records longest first.

    Raises:
        ValueError: naming a record longer than `max_length`.
    """
    return first_fit_decreasing(list(lengths), max_length)


def split_rows(rows: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """A packing plan with its fullest row halved (records kept in order) until it has
    `count` rows or one record in each; a record alone fits wherever it fitted with others.
    Micro-batches take whole rows, so this lets a batch split into `count` of them."""
    rows = [list(row) for row in rows]
    while len(rows) < count:
        fullest = max(range(len(rows)), key=lambda index: len(rows[index]))
        row = rows[fullest]
        if len(row) < 2:
            break
        rows[fullest:fullest + 1] = [row[:len(row) // 2], row[len(row) // 2:]]
    return rows


def layout_rows(sequences: Sequence[Sequence[int]], labels: Sequence[Sequence[int]],
                rows: Sequence[Sequence[int]], pad_id: int, *, one_row: bool = False
                ) -> dict[str, torch.Tensor]:
    """Packed rows of token ids, labels, positions and record numbers.

    Args:
        sequences, labels: per record, its token ids and labels (`IGNORE_INDEX` unlearned).
        rows: the packing plan: per row, the indices of its records, in order.
        pad_id: the id written on padding.
        one_row: lay every row end to end in a single row without padding (the varlen
            kernel's layout).

    Returns:
        `input_ids`, `labels`, `attention_mask` (1 on record tokens), `position_ids`
        (0, 1, ... per record; the padding restarts too), `record_index` (the record's index,
        -1 on padding): each `[R, L]`.

    Raises:
        ValueError: when `rows` is not a partition of the records.
    """
    seen = sorted(index for row in rows for index in row)
    if seen != list(range(len(sequences))) or any(not row for row in rows):
        raise ValueError(f"the packing plan must hold every one of the {len(sequences)} "
                         f"records exactly once in non-empty rows, got {list(map(list, rows))}")
    if one_row:
        rows = [[index for row in rows for index in row]]
    length = max(sum(len(sequences[index]) for index in row) for row in rows)
    shape = (len(rows), length)
    out = {"input_ids": torch.full(shape, pad_id, dtype=torch.long),
           "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
           "attention_mask": torch.zeros(shape, dtype=torch.long),
           "position_ids": torch.zeros(shape, dtype=torch.long),
           "record_index": torch.full(shape, -1, dtype=torch.long)}
    for row_number, row in enumerate(rows):
        start = 0
        for index in row:
            ids, row_labels = sequences[index], list(labels[index])
            if row_labels:
                row_labels[0] = IGNORE_INDEX  # the join: never predicted from the previous record
            span = slice(start, start + len(ids))
            out["input_ids"][row_number, span] = torch.tensor(ids, dtype=torch.long)
            out["labels"][row_number, span] = torch.tensor(row_labels, dtype=torch.long)
            out["attention_mask"][row_number, span] = 1
            out["position_ids"][row_number, span] = torch.arange(len(ids))
            out["record_index"][row_number, span] = index
            start += len(ids)
        out["position_ids"][row_number, start:] = torch.arange(length - start)
    return out


def choose_packed_attention(llm: nn.Module) -> str:
    """The attention path for packed rows on `llm` (a transformers causal LM, or peft on one).

    Raises:
        ValueError: for a model whose positions are not 1-D (multimodal RoPE), naming it.
    """
    return explain_packed_attention(llm)[0]


def explain_packed_attention(llm: nn.Module) -> tuple[str, str]:
    """`choose_packed_attention`'s path for `llm`, and why, in a few words (what `vlm-vit llm
    train --packing` prints).

    Raises:
        ValueError: as `choose_packed_attention`.
    """
    base = _base_model(llm)
    config = _language_config(getattr(base, "config", None))
    implementation = str(getattr(config, "_attn_implementation", None) or "eager")
    if "flash" in implementation:  # transformers' flash_attention_2 / hub flash kernels
        return "flash_attention_2", (f"the LLM runs {implementation}: records kept apart by "
                                     "its varlen kernel's cu_seqlens")
    if not getattr(base, "_supports_attention_backend", False):
        return "block_mask", (f"{type(base).__name__} takes no transformers attention "
                              "backend: records kept apart by a block-diagonal causal mask")
    if implementation in ("sdpa", varlen_attention.NAME) and _full_attention_only(config):
        return "varlen_sdpa", ("an sdpa LLM with full attention in every layer: records kept "
                               "apart by cu_seqlens, one causal SDPA per record")
    if implementation in ("sdpa", "eager", varlen_attention.NAME):
        why = "an eager LLM" if implementation == "eager" else \
            "an sdpa LLM with sliding-window or chunked layers"
        return "position_ids", (f"{why}: records kept apart by transformers' packed-sequence "
                                "path, restarting position_ids")
    return "block_mask", (f"attention implementation {implementation!r}: records kept apart "
                          "by a block-diagonal causal mask")


def packed_llm_inputs(path: str, position_ids: torch.Tensor, record_index: torch.Tensor,
                      dtype: torch.dtype) -> dict[str, Any]:
    """The keyword arguments that confine the LLM's attention to each record, for `path`.

    Args:
        position_ids: `[R, L]`, restarting at every record; for a multimodal-RoPE LLM
            `[4, R, L]`, those text positions first (`mrope.packed_batch_positions`).
        record_index: `[R, L]`, the record of every token (-1 on padding).
        dtype: the dtype of the LLM's activations (for the block mask).
    """
    if path not in PATHS:
        raise ValueError(f"unknown packed attention path {path!r}; known: {PATHS}")
    inputs: dict[str, Any] = {"position_ids": position_ids, "attention_mask": None,
                              "use_cache": False}  # the cache would hide the packing
    if path == "block_mask":
        inputs["attention_mask"] = block_causal_mask(record_index, dtype)
    if path == "varlen_sdpa":
        text = position_ids[0] if position_ids.dim() == 3 else position_ids
        inputs.update(varlen_attention.record_boundaries(text))
    return inputs


def block_causal_mask(record_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[R, 1, L, L]` additive mask: 0 where a token sees an earlier token of its own record
    (padding counts as one record of its own), the dtype's minimum elsewhere."""
    length = record_index.shape[-1]
    same = record_index[:, :, None] == record_index[:, None, :]  # (R, L, L)
    causal = torch.ones(length, length, dtype=torch.bool, device=record_index.device).tril()
    allowed = same & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=record_index.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def run_packed(llm: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
               record_index: torch.Tensor, path: str, **llm_kwargs: Any) -> Any:
    """The LLM's output on packed rows, attention confined to each record by `path`.

    Raises:
        ValueError: when `llm_kwargs` turn the cache on or bring their own mask (either
            would let records attend to each other).
    """
    for name in ("use_cache", "attention_mask", "past_key_values", "position_ids"):
        if llm_kwargs.get(name) not in (None, False):
            raise ValueError(f"{name}={llm_kwargs[name]!r} cannot go with packed rows: the "
                             "packing sets the positions and the attention itself")
        llm_kwargs.pop(name, None)
    _set_implementation(llm, path)
    inputs = packed_llm_inputs(path, position_ids, record_index, inputs_embeds.dtype)
    return llm(inputs_embeds=inputs_embeds, **inputs, **llm_kwargs)


def check_packed_attention(llm: nn.Module, path: str, lengths: tuple[int, int] = (5, 7)
                           ) -> float:
    """Runs two random records packed in one row (and the second again beside padding) and
    each alone (a plain causal forward); returns the largest difference of their logits.

    The LLM runs in eval mode (no dropout) without gradients and on no RNG but its own
    generator, so a run's random stream is untouched.

    Raises:
        PackingLeakError: naming the model class and path, when they differ beyond the
            tolerance of the LLM's dtype.
    """
    embeddings = llm.get_input_embeddings()
    weight = embeddings.weight
    generator = torch.Generator().manual_seed(0)
    vocab = min(embeddings.num_embeddings, 1000)
    records = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    rows = [[0, 1]] if path in ONE_ROW_PATHS else [[0, 1], [2]]
    sequences = records + ([records[1]] if len(rows) > 1 else [])
    layout = layout_rows(sequences, sequences, rows, pad_id=0,
                         one_row=path in ONE_ROW_PATHS)
    # Padding beside the lone record: the second row is longer than its record.
    was_training = llm.training
    llm.eval()
    try:
        with torch.no_grad():
            embeds = embeddings(layout["input_ids"].to(weight.device))
            positions = layout["position_ids"]
            if multimodal_rope(getattr(_base_model(llm), "config", None)):  # text: all 4 alike
                positions = positions.expand(4, -1, -1)
            packed = run_packed(llm, embeds, positions.to(weight.device),
                                layout["record_index"].to(weight.device), path).logits
            worst, scale = 0.0, 1.0
            for index, ids in enumerate(sequences):
                alone_ids = torch.tensor([ids], device=weight.device)
                alone = llm(inputs_embeds=embeddings(alone_ids),
                            attention_mask=torch.ones_like(alone_ids),
                            position_ids=torch.arange(len(ids), device=weight.device)[None],
                            use_cache=False).logits[0]
                where = (layout["record_index"] == index).to(weight.device)
                worst = max(worst, (packed[where].float() - alone.float()).abs().max().item())
                scale = max(scale, alone.float().abs().max().item())
    finally:
        llm.train(was_training)
    tolerance = CHECK_TOLERANCE.get(weight.dtype, HALF_TOLERANCE) * scale
    name = type(_base_model(llm)).__name__
    if not worst <= tolerance:
        raise PackingLeakError(
            f"packed records leak into each other on {name} with the {path!r} attention path: "
            f"their logits differ from the same records run alone by {worst:.3g} (tolerance "
            f"{tolerance:.3g}). This transformers version does not confine attention this way "
            f"for {name}; train without packing, or choose another path "
            f"(MultimodalLM.set_packed_attention, one of {PATHS})")
    logger.info("packed attention on %s: %s (checked against records alone: max logit "
                "difference %.2g)", name, path, worst)
    return worst


def _set_implementation(llm: nn.Module, path: str) -> None:
    """Puts an sdpa LLM on `varlen_attention` for the `varlen_sdpa` path, and back on sdpa
    for the others (the padded path runs the same either way). The LLM keeps it: gradient
    checkpointing recomputes the forward after this call has returned."""
    base = _base_model(llm)
    config = getattr(base, "config", None)
    language = _language_config(config)
    current = getattr(language, "_attn_implementation", None)
    wanted = varlen_attention.register() if path == "varlen_sdpa" else \
        "sdpa" if current == varlen_attention.NAME else current
    if wanted != current:  # a multimodal class: its language model only (its tower is ours)
        base.set_attn_implementation(wanted if language is config else {"text_config": wanted})


def _language_config(config: Any) -> Any:
    """The config whose attention packing acts on: a multimodal-RoPE class's text config
    (Qwen-VL: the LLM is the multimodal class, its vision tower dropped), else `config`."""
    text = getattr(config, "text_config", None)
    return text if text is not None and multimodal_rope(config) else config


def _full_attention_only(config: Any) -> bool:
    """Whether every layer attends to all earlier tokens (no sliding window, no chunks)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types) and not (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


def _base_model(llm: nn.Module) -> nn.Module:
    base = getattr(llm, "get_base_model", None)
    return base() if base is not None and hasattr(llm, "peft_config") else llm


# -- losses ---------------------------------------------------------------------------------


def loss_terms(logits: torch.Tensor, labels: torch.Tensor, record_index: torch.Tensor,
               reduction: str) -> tuple[torch.Tensor, int]:
    """The summed loss of a batch's supervised tokens under `reduction`, and its unit count.

    Position t predicts label t + 1 (transformers' causal LM loss), in float32.

    Args:
        logits: `[R, L, V]`.
        labels: `[R, L]`, `IGNORE_INDEX` where nothing is learned.
        record_index: `[R, L]`, the record of every token (any id per record; -1 on padding).
        reduction: "token": every supervised token weighs 1, units are tokens; "record":
            each record's tokens weigh 1 / (its supervised tokens), units are records with
            a supervised token.

    Returns:
        (sum, units): the mean is `sum / units`; over micro-batches, the sums add up and
        so do the units.
    """
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    targets = labels[:, 1:]
    supervised = targets != IGNORE_INDEX  # (R, L - 1)
    losses = nn.functional.cross_entropy(logits[:, :-1][supervised].float(),
                                         targets[supervised], reduction="none")
    if reduction == "token":
        return losses.sum(), int(supervised.sum())
    owners = record_index[:, 1:][supervised]
    _, inverse, counts = torch.unique(owners, return_inverse=True, return_counts=True)
    weights = 1.0 / counts[inverse].to(losses.dtype)
    return (losses * weights).sum(), int(counts.numel())


def loss_units(labels: Sequence[Sequence[int]], reduction: str) -> int:
    """The units `loss_terms` counts for records given as label lists (a record's first
    label is never predicted, as in a packed row and a record alone)."""
    supervised = [sum(label != IGNORE_INDEX for label in row[1:]) for row in labels]
    if reduction == "token":
        return sum(supervised)
    return sum(count > 0 for count in supervised)
