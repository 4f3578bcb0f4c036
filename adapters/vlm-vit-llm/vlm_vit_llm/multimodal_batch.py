"""How `MultimodalLM.prepare` lays prompts out for the LLM, as pure functions of token ids,
each image's token count and the image tokens themselves: no model, tokenizer or tower.

    sequences, labels = expand([[5, IMAGE, 6]], [3], IMAGE)    # [[5, IMAGE, IMAGE, IMAGE, 6]]
    batch = build_batch(sequences, labels, [[tokens]], image_token_id=IMAGE, pad_token_id=0,
                        width=tokens.shape[1])                 # a MultimodalBatch, one row

Every image placeholder becomes as many positions as the image has tokens; the sequences are
then padded one per row, or laid end to end in packed rows (`vlm_vit_llm.packing`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from vlm_vit_llm.batch_types import IGNORE_INDEX, MultimodalBatch
from vlm_vit_llm.packing import ONE_ROW_PATHS, PATHS, layout_rows


def checked_arguments(texts: Sequence[str | Sequence[int]], images: Any,
                       targets: Sequence[str | Sequence[int]] | None,
                       token_labels: Sequence[Sequence[int]] | None,
                       padding_side: str) -> list[list[Any]]:
    """`MultimodalLM.prepare`'s arguments checked against each other (errors as there).

    Returns:
        The images, one list per prompt.
    """
    if isinstance(texts, str):
        raise ValueError("texts must be a list of prompts, not one string")
    if len(texts) == 0:
        raise ValueError("texts is empty: give one prompt or more (strings, or lists of "
                         "token ids)")
    images = images_per_prompt(images, len(texts))
    if targets is not None and len(targets) != len(texts):
        raise ValueError(f"{len(texts)} prompts but {len(targets)} targets")
    if token_labels is not None:
        if targets is not None:
            raise ValueError("give targets or token_labels, not both")
        if len(token_labels) != len(texts) or any(
                isinstance(text, str) or len(text) != len(row)
                for text, row in zip(texts, token_labels, strict=True)):
            raise ValueError("token_labels need prompts as token ids, one label per token")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    return images


def images_per_prompt(images: Any, count: int) -> list[list[Any]]:
    """`MultimodalLM.prepare`'s images as one list per prompt (None or [] for a prompt without).

    Raises:
        ValueError: for images not given as a list of `count` lists, naming the entry.
    """
    if images is None:
        return [[] for _ in range(count)]
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"images must be a list with one list of images per prompt, got a "
                         f"{type(images).__name__}: for one prompt with one image, [[image]]")
    if len(images) != count:
        raise ValueError(f"{count} prompts but images for {len(images)}")
    for index, per_prompt in enumerate(images):
        if per_prompt is not None and not isinstance(per_prompt, (list, tuple)):
            raise ValueError(f"images[{index}] is a {type(per_prompt).__name__}, not a list of "
                             f"that prompt's images: images takes one list per prompt, "
                             f"[[image]] for one prompt with one image")
    return [list(per_prompt or []) for per_prompt in images]


def expand(token_ids: Sequence[Sequence[int]], counts: Sequence[int],
           image_token_id: int | Sequence[int],
           *, labels: Sequence[Sequence[int]] | None = None,
           targets: Sequence[Sequence[int]] | None = None
           ) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's ids with every image token repeated its image's count, its target
    appended; and the labels of those positions.

    Args:
        token_ids: per prompt, its token ids, one `image_token_id` per image.
        counts: every image's token count, in the order of the image tokens across prompts.
        image_token_id: the placeholder's id, or the ids of several kinds of placeholder
            (an image's and a clip's).
        labels: per prompt, a label per token (`IGNORE_INDEX` where nothing is learned);
            default: nothing learned. An image's positions are never learned.
        targets: per prompt, the ids learned after it (`IGNORE_INDEX` entries dropped).

    Returns:
        (sequences, labels), one list per prompt each.

    Raises:
        ValueError: for a target holding the image token, or a prompt left without a token.
    """
    sequences, label_rows, image_counts = [], [], iter(counts)
    placeholders = _ids(image_token_id)
    for prompt, ids in enumerate(token_ids):
        expanded, row = [], []
        given = labels[prompt] if labels is not None else [IGNORE_INDEX] * len(ids)
        for token, label in zip(ids, given, strict=True):
            if token in placeholders:  # never learned, whatever the label says
                count = next(image_counts)
                expanded.extend([token] * count)
                row.extend([IGNORE_INDEX] * count)
            else:
                expanded.append(token)
                row.append(label)
        if targets is not None:
            target = [t for t in targets[prompt] if t != IGNORE_INDEX]
            held = placeholders.intersection(target)
            if held:
                raise ValueError(f"target {prompt} holds the image token (id {min(held)}); "
                                 "targets are text only")
            expanded, row = expanded + target, row + target
        if not expanded:
            raise ValueError(f"texts[{prompt}] is empty: it gives no token (and no target "
                             f"follows it); every sequence needs one token or more")
        sequences.append(expanded)
        label_rows.append(row)
    return sequences, label_rows


def build_batch(sequences: Sequence[Sequence[int]], label_rows: Sequence[Sequence[int]],
                features: Sequence[Sequence[torch.Tensor]], *,
                image_token_id: int | Sequence[int],
                pad_token_id: int, width: int, with_labels: bool = True,
                padding_side: str = "right", pack: Sequence[Sequence[int]] | None = None,
                packing: str | None = None,
                device: torch.device | str = "cpu") -> MultimodalBatch:
    """Expanded sequences (`expand`) as a `MultimodalBatch`: one per row, padded on
    `padding_side`; or, with `pack`, laid out as it says (`vlm_vit_llm.packing.layout_rows`).

    Args:
        sequences, label_rows: per prompt, its expanded ids and their labels.
        features: per prompt, its images' tokens `[M_i, width]` in placeholder order.
        image_token_id, pad_token_id: the id (or ids, as `expand`) of an image position and
            the id of padding.
        width: the LLM's embedding width (the features' second dimension).
        with_labels: keep the labels (else `labels` is None).
        padding_side: "right" or "left", for one prompt per row.
        pack: per row, the indices of the prompts laid end to end there.
        packing: with `pack`, the attention path that confines each record (one of
            `vlm_vit_llm.packing.PATHS`).
        device: where the tensors go.

    Raises:
        ValueError: for `pack` without a known `packing` path.
    """
    if pack is None:
        layout = _padded(sequences, label_rows, pad_token_id, padding_side)
        order = range(len(sequences))
    else:
        if packing not in PATHS:
            raise ValueError(f"packed rows need an attention path, one of {PATHS}; got "
                             f"{packing!r}")
        layout = layout_rows(sequences, label_rows, pack, pad_token_id,
                             one_row=packing in ONE_ROW_PATHS)
        order = [index for row in pack for index in row]
    in_order = [tokens for index in order for tokens in features[index]]
    image_features = torch.cat(in_order) if in_order else torch.zeros(0, width)
    input_ids, attention_mask = layout["input_ids"], layout["attention_mask"]
    return MultimodalBatch(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
        position_ids=layout["position_ids"].to(device),
        image_mask=(torch.isin(input_ids, torch.tensor(sorted(_ids(image_token_id))))
                    & attention_mask.bool()).to(device),
        image_features=image_features.to(device),
        labels=layout["labels"].to(device) if with_labels else None,
        record_index=layout["record_index"].to(device), packing=packing if pack else None)


def _padded(sequences: Sequence[Sequence[int]], label_rows: Sequence[Sequence[int]],
            pad_token_id: int, padding_side: str) -> dict[str, torch.Tensor]:
    """One sequence per row, padded on `padding_side`: the tensors `layout_rows` gives."""
    batch, length = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row, (sequence, label_row) in enumerate(zip(sequences, label_rows, strict=True)):
        span = slice(length - len(sequence), length) if padding_side == "left" \
            else slice(0, len(sequence))
        input_ids[row, span] = torch.tensor(sequence, dtype=torch.long)
        labels[row, span] = torch.tensor(label_row, dtype=torch.long)
        attention_mask[row, span] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "record_index": torch.where(attention_mask.bool(), torch.arange(batch)[:, None], -1)}


def token_ids(ids: Sequence[int] | torch.Tensor, name: str, vocabulary: int, *,
              labels: bool = False) -> list[int]:
    """`ids` as a list of ints, each in `range(vocabulary)` (the rows of the LLM's
    embeddings) or, for `labels`, `IGNORE_INDEX`.

    Raises:
        ValueError: naming `name[position]` for an entry that is no int or out of range.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, torch.Tensor)):
        raise ValueError(f"{name} is a {type(ids).__name__}; give a string or a list of "
                         "token ids [L]")
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    rows = vocabulary
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}[{position}] is {value!r}, not a token id: {name} must "
                             f"be a flat list of ints [L] in 0..{rows - 1}")
        if not 0 <= value < rows and not (labels and value == IGNORE_INDEX):
            raise ValueError(f"{name}[{position}] is token id {value}, outside the "
                             f"vocabulary 0..{rows - 1} of the LLM's embeddings")
    return [int(value) for value in values]


def _ids(image_token_id: int | Sequence[int]) -> set[int]:
    return {image_token_id} if isinstance(image_token_id, int) else set(image_token_id)
