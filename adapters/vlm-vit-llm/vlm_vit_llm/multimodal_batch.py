"""`MultimodalBatch`: prompts (and targets) as `MultimodalLM` runs them, and how
`MultimodalLM.prepare` builds one.

Each prompt is tokenised, every image placeholder expanded to the image's token count, and
the projected image tokens gathered from one tower call; the sequences are then padded one
per row, or laid end to end in packed rows (`vlm_vit_llm.packing`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from vlm_vit_llm.batch_types import IGNORE_INDEX, MultimodalBatch
from vlm_vit_llm.parallel import idle_image_features

if TYPE_CHECKING:
    from vlm_vit_llm.model import MultimodalLM

def prepare(mm: MultimodalLM, texts: Sequence[str | Sequence[int]],
            images: Sequence[Sequence[Any]] | None = None,
            targets: Sequence[str | Sequence[int]] | None = None, *,
            token_labels: Sequence[Sequence[int]] | None = None,
            padding_side: str = "right",
            pack: Sequence[Sequence[int]] | None = None) -> MultimodalBatch:
    """`MultimodalLM.prepare` (arguments and errors as there)."""
    images = _checked_arguments(texts, images, targets, token_labels, padding_side)
    token_ids = [_prompt_ids(mm, text, prompt) for prompt, text in enumerate(texts)]
    pixels, counts, owners = _pixels_per_image(mm, texts, images, token_ids)
    features = mm.image_features(pixels) if pixels else []  # one tower call
    idle = None if pixels else idle_image_features(mm)  # see vlm_vit_llm.parallel

    sequences, label_rows = _expanded(mm, token_ids, counts, targets, token_labels)
    limit = getattr(getattr(mm.llm, "config", None), "max_position_embeddings", None)
    longest = max(len(s) for s in sequences)
    if limit is not None and longest > limit:
        raise ValueError(f"a sequence of {longest} tokens (image tokens included) is longer "
                         f"than the LLM's context of {limit}")

    with_labels = targets is not None or token_labels is not None
    if pack is not None:
        return replace(_packed(mm, sequences, label_rows, pack, features, owners,
                               with_labels=with_labels), idle_features=idle)
    return _padded(mm, sequences, label_rows, features, padding_side, with_labels, idle)


def _checked_arguments(texts: Sequence[str | Sequence[int]], images: Any,
                       targets: Sequence[str | Sequence[int]] | None,
                       token_labels: Sequence[Sequence[int]] | None,
                       padding_side: str) -> list[list[Any]]:
    """`prepare`'s arguments checked against each other; the images one list per prompt."""
    if isinstance(texts, str):
        raise ValueError("texts must be a list of prompts, not one string")
    if len(texts) == 0:
        raise ValueError("texts is empty: give one prompt or more (strings, or lists of "
                         "token ids)")
    images = _images_per_prompt(images, len(texts))
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


def _pixels_per_image(mm: MultimodalLM, texts: Sequence[str | Sequence[int]],
                      images: list[list[Any]], token_ids: list[list[int]]
                      ) -> tuple[list[Any], list[int], list[int]]:
    """Every image of the batch in order as the tower takes it, with its token count and
    the prompt it belongs to; a prompt whose placeholders do not match its images is
    refused."""
    pixels, counts, owners = [], [], []
    for prompt, per_prompt in enumerate(images):
        placeholders = token_ids[prompt].count(mm.image_token_id)
        if placeholders != len(per_prompt):
            raise ValueError(f"prompt {prompt} has {placeholders} {mm.image_token!r} "
                             f"placeholder(s) but {len(per_prompt)} image(s): "
                             f"{str(texts[prompt])[:80]!r}")
        for image in per_prompt:
            pixels.append(mm._pixels(image, prompt))
            counts.append(mm._num_image_tokens(pixels[-1]))
            owners.append(prompt)
    return pixels, counts, owners


def _expanded(mm: MultimodalLM, token_ids: list[list[int]], counts: list[int],
              targets: Sequence[str | Sequence[int]] | None,
              token_labels: Sequence[Sequence[int]] | None
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's ids with every image token repeated its image's count, its target
    appended; and the labels of those positions."""
    sequences, label_rows, image_counts = [], [], iter(counts)
    for prompt, ids in enumerate(token_ids):
        expanded, labels = [], []
        given = (_token_ids(mm, token_labels[prompt], f"token_labels[{prompt}]", labels=True)
                 if token_labels is not None else [IGNORE_INDEX] * len(ids))
        for token, label in zip(ids, given, strict=True):
            if token == mm.image_token_id:  # never learned, whatever the label says
                count = next(image_counts)
                expanded.extend([token] * count)
                labels.extend([IGNORE_INDEX] * count)
            else:
                expanded.append(token)
                labels.append(label)
        if targets is not None:
            target = targets[prompt]
            target = mm.encode_target(target) if isinstance(target, str) else \
                _token_ids(mm, target, f"targets[{prompt}]", labels=True)
            target = [t for t in target if t != IGNORE_INDEX]
            if mm.image_token_id in target:
                raise ValueError(f"target {prompt} holds the image token "
                                 f"{mm.image_token!r}; targets are text only")
            expanded, labels = expanded + target, labels + target
        if not expanded:
            raise ValueError(f"texts[{prompt}] is empty: it gives no token (and no target "
                             f"follows it); every sequence needs one token or more")
        sequences.append(expanded)
        label_rows.append(labels)
    return sequences, label_rows


def _padded(mm: MultimodalLM, sequences: list[list[int]], label_rows: list[list[int]],
            features: list[torch.Tensor], padding_side: str, with_labels: bool,
            idle: torch.Tensor | None) -> MultimodalBatch:
    """`prepare`'s padded rows: one sequence per row, padded on `padding_side`."""
    width = mm.llm.get_input_embeddings().embedding_dim
    batch, length = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((batch, length), mm.pad_token_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row, (sequence, label_row) in enumerate(zip(sequences, label_rows, strict=True)):
        span = slice(length - len(sequence), length) if padding_side == "left" \
            else slice(0, len(sequence))
        input_ids[row, span] = torch.tensor(sequence, dtype=torch.long)
        labels[row, span] = torch.tensor(label_row, dtype=torch.long)
        attention_mask[row, span] = 1
    image_mask = (input_ids == mm.image_token_id) & attention_mask.bool()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    record_index = torch.where(attention_mask.bool(), torch.arange(batch)[:, None], -1)
    device = mm.device
    image_features = torch.cat(features) if features else torch.zeros(0, width)
    return MultimodalBatch(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device), image_mask=image_mask.to(device),
        image_features=image_features.to(device),
        labels=labels.to(device) if with_labels else None,
        record_index=record_index.to(device), idle_features=idle)


def _packed(mm: MultimodalLM, sequences: list[list[int]], label_rows: list[list[int]],
            pack: Sequence[Sequence[int]], features: list[torch.Tensor],
            owners: list[int], with_labels: bool) -> MultimodalBatch:
    """`prepare`'s packed rows: the prompts laid out as `pack` says, their image tokens
    reordered to match (still from the one tower call)."""
    from vlm_vit_llm.packing import ONE_ROW_PATHS, layout_rows

    path = mm.packed_attention()
    layout = layout_rows(sequences, label_rows, pack, mm.pad_token_id,
                         one_row=path in ONE_ROW_PATHS)
    order = [index for row in pack for index in row]
    per_prompt: list[list[torch.Tensor]] = [[] for _ in sequences]
    for owner, tokens in zip(owners, features, strict=True):
        per_prompt[owner].append(tokens)
    in_order = [tokens for index in order for tokens in per_prompt[index]]
    width = mm.llm.get_input_embeddings().embedding_dim
    image_features = torch.cat(in_order) if in_order else torch.zeros(0, width)
    attention_mask = layout["attention_mask"]
    device = mm.device
    return MultimodalBatch(
        input_ids=layout["input_ids"].to(device), attention_mask=attention_mask.to(device),
        position_ids=layout["position_ids"].to(device),
        image_mask=((layout["input_ids"] == mm.image_token_id)
                    & attention_mask.bool()).to(device),
        image_features=image_features.to(device),
        labels=layout["labels"].to(device) if with_labels else None,
        record_index=layout["record_index"].to(device), packing=path)


def _images_per_prompt(images: Any, count: int) -> list[list[Any]]:
    """`prepare`'s images as one list per prompt (None or [] for a prompt without).

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


def _prompt_ids(mm: MultimodalLM, text: str | Sequence[int], prompt: int) -> list[int]:
    if not isinstance(text, str):
        return _token_ids(mm, text, f"texts[{prompt}]")
    ids = list(mm.tokenizer(text)["input_ids"])
    if ids.count(mm.image_token_id) != text.count(mm.image_token):
        raise ValueError(f"prompt {prompt}: the tokenizer reads "
                         f"{ids.count(mm.image_token_id)} image tokens in "
                         f"{text.count(mm.image_token)} placeholders: {text[:80]!r}")
    return ids


def _token_ids(mm: MultimodalLM, ids: Sequence[int] | torch.Tensor, name: str, *,
               labels: bool = False) -> list[int]:
    """`ids` as a list of ints, each a row of the LLM's embeddings (or, for `labels`,
    `IGNORE_INDEX`).

    Raises:
        ValueError: naming `name[position]` for an entry that is no int or out of range.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, torch.Tensor)):
        raise ValueError(f"{name} is a {type(ids).__name__}; give a string or a list of "
                         "token ids [L]")
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    rows = mm.llm.get_input_embeddings().num_embeddings
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}[{position}] is {value!r}, not a token id: {name} must "
                             f"be a flat list of ints [L] in 0..{rows - 1}")
        if not 0 <= value < rows and not (labels and value == IGNORE_INDEX):
            raise ValueError(f"{name}[{position}] is token id {value}, outside the "
                             f"vocabulary 0..{rows - 1} of the LLM's embeddings")
    return [int(value) for value in values]
