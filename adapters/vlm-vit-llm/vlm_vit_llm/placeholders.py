"""The placeholder tokens prompts hold for images: in the tokenizer, and rows of the LLM's
embeddings for them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def add_image_token(tokenizer: Any, llm: nn.Module, image_token: str) -> int:
    """The id of `image_token` in `tokenizer`, added as a special token when missing and the
    LLM's embeddings grown to match (new rows at the mean of the old ones).

    Raises:
        ValueError: when the tokenizer splits the token.
    """
    if image_token not in tokenizer.get_vocab():
        tokenizer.add_tokens([image_token], special_tokens=True)
        logger.info("added %r to the tokenizer", image_token)
    ids = tokenizer(image_token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the tokenizer splits the image token {image_token!r} into "
                         f"{len(ids)} tokens; it must be one")
    rows = llm.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        llm.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        # LLaVA's recipe: new rows start at the mean of the old ones, in the input and
        # the output embeddings. Not random, so every process builds the same model (a
        # resumed run's frozen base matches its checkpoint's); a tied matrix is one.
        matrices = {id(m.weight): m.weight for m in (llm.get_input_embeddings(),
                                                     llm.get_output_embeddings())
                    if m is not None}
        with torch.no_grad():
            for matrix in matrices.values():  # (V, D)
                matrix[rows:] = matrix[:rows].mean(dim=0, keepdim=True)
        logger.info("resized the LLM's embeddings to %d rows", len(tokenizer))
    return ids[0]


def existing_token_id(tokenizer: Any, token: str, what: str) -> int:
    """The id of `token`, which the tokenizer must already hold as one token (a clip's
    placeholder, which the model was trained with).

    Raises:
        ValueError: naming `what`, when the tokenizer lacks it or splits it.
    """
    if not isinstance(token, str) or token not in tokenizer.get_vocab():
        raise ValueError(f"the {what} {str(token)[:60]!r} is not one token of the tokenizer")
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the {what} {token!r} is not one token of the tokenizer")
    return ids[0]
