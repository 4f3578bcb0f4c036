"""What the encoder returns: `EncoderOutput` for a batch, `PackedOutput` for a packed list of
images of different sizes (`vlm_vit.packing`), and `BlocksOutput`, what the blocks return
(collected by `BlocksRecorder` as they run).

A leaf module: it imports only torch and `vlm_vit.layers`, so the model, the packed path, the
tower, poolers and analysis all depend on it and it on none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import torch

from vlm_vit.layers.varlen import Segments


@dataclass
class EncoderOutput:
    """What the encoder returns.

    Attributes:
        tokens: every token after the final norm, `[B, T, D]`; None when `feature_layers`
            stopped the run before the last block.
        patch_tokens: `tokens` without the prefix tokens, `[B, N, D]` (or None likewise).
        cls_token: the class token after the final norm, `[B, D]`; None for models without
            one (or when the run stopped early).
        num_prefix_tokens: class token plus register tokens at the front of `tokens`.
        grid: the patch grid (rows, cols); N = rows * cols, row-major.
        hidden_states: when asked, depth + 1 raw residual-stream tensors `[B, T, D]`: index 0
            the embeddings (after the pre-norm where there is one), index i the output of
            block i, no final norm (the Hugging Face convention).
        features: the raw tokens `[B, T, D]` of each of `feature_layers`, in the order asked,
            indexed like `hidden_states`.
        attentions: when asked, one `[B, heads, T, T]` map per block.
    """

    tokens: torch.Tensor | None
    patch_tokens: torch.Tensor | None
    cls_token: torch.Tensor | None
    num_prefix_tokens: int
    grid: tuple[int, int]
    hidden_states: tuple[torch.Tensor, ...] | None = None
    features: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def from_blocks(cls, run: BlocksOutput, grid: tuple[int, int], num_prefix_tokens: int,
                    has_class_token: bool) -> EncoderOutput:
        """A batch's output from what its blocks returned."""
        tokens = run.tokens
        return cls(
            tokens=tokens,
            patch_tokens=tokens[:, num_prefix_tokens:] if tokens is not None else None,
            cls_token=tokens[:, 0] if tokens is not None and has_class_token else None,
            num_prefix_tokens=num_prefix_tokens,
            grid=grid,
            hidden_states=run.hidden_states,
            features=run.features,
            attentions=run.attentions,
        )


class BlocksOutput(NamedTuple):
    """What `VisionEncoder.run_blocks` returns (see `EncoderOutput` for each field)."""

    tokens: torch.Tensor | None
    hidden_states: tuple[torch.Tensor, ...] | None
    features: tuple[torch.Tensor, ...] | None
    attentions: tuple | None


class BlocksRecorder:
    """Keeps what a run of the blocks was asked for, block by block: every hidden state, the
    attention maps, the raw tokens of the wanted feature layers.

    Args:
        x: the tokens entering the first block (hidden state 0).
        wanted: hidden-state indices (0 to depth) whose tokens to keep, in the order asked.
        output_hidden_states, output_attentions: as in `VisionEncoder.forward`.
    """

    def __init__(self, x: torch.Tensor, wanted: list[int], output_hidden_states: bool,
                 output_attentions: bool) -> None:
        self.wanted = wanted
        self.hidden_states = [x] if output_hidden_states else None
        self.attentions = [] if output_attentions else None
        self.kept = {0: x} if 0 in wanted else {}

    def add(self, index: int, x: torch.Tensor, weights: object) -> None:
        """Records block `index`'s output `x` and its attention maps `weights`."""
        if self.hidden_states is not None:
            self.hidden_states.append(x)
        if self.attentions is not None:
            self.attentions.append(weights)
        if index in self.wanted:
            self.kept[index] = x

    def output(self, tokens: torch.Tensor | None) -> BlocksOutput:
        """What was recorded, with the final `tokens` (None when the run stopped early)."""
        return BlocksOutput(
            tokens=tokens,
            hidden_states=tuple(self.hidden_states) if self.hidden_states is not None else None,
            features=tuple(self.kept[i] for i in self.wanted) if self.wanted else None,
            attentions=tuple(self.attentions) if self.attentions is not None else None,
        )


@dataclass
class PackedOutput:
    """What the encoder returns for a list of images: every image's tokens, end to end.

    Attributes:
        tokens: every token after the final norm, `[total, D]`, image after image, each
            image's prefix tokens first; None when `feature_layers` stopped the run early.
        lengths: tokens per image (prefix + rows * cols).
        grids: each image's patch grid (rows, cols).
        num_prefix_tokens: class token plus register tokens at the front of each image.
        hidden_states: when asked, depth + 1 tensors `[total, D]` (as `EncoderOutput`).
        features: the raw tokens `[total, D]` of each of `feature_layers`, in the order asked.
        attentions: when asked, per block a tuple of one `[heads, L_i, L_i]` map per image.
        frames: per input, the segments it gave: 1 for an image, a clip's temporal slices
            (`vlm_vit.packing`); `lengths`, `grids` and `split` count segments. None: one
            each.
    """

    tokens: torch.Tensor | None
    lengths: tuple[int, ...]
    grids: tuple[tuple[int, int], ...]
    num_prefix_tokens: int
    has_class_token: bool
    hidden_states: tuple[torch.Tensor, ...] | None = None
    features: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    frames: tuple[int, ...] | None = None

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each image starts, and the total at the end: 0, L_0, L_0 + L_1, ..."""
        return Segments(self.lengths).offsets

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """`offsets` as FlashAttention takes them, int32 `[n + 1]`."""
        return Segments(self.lengths).cu_seqlens()

    def __len__(self) -> int:
        return len(self.lengths)

    def split(self) -> list[EncoderOutput]:
        """One `EncoderOutput` per image, batch size 1, as `encoder(image[None])` gives."""
        prefix = self.num_prefix_tokens
        outputs = []
        for index, (start, stop) in enumerate(pairwise(self.offsets)):
            def part(x: torch.Tensor | None, start=start, stop=stop) -> torch.Tensor | None:
                return None if x is None else x[start:stop][None]

            tokens = part(self.tokens)
            outputs.append(EncoderOutput(
                tokens=tokens,
                patch_tokens=tokens[:, prefix:] if tokens is not None else None,
                cls_token=tokens[:, 0] if tokens is not None and self.has_class_token else None,
                num_prefix_tokens=prefix,
                grid=self.grids[index],
                hidden_states=tuple(part(h) for h in self.hidden_states)
                if self.hidden_states is not None else None,
                features=tuple(part(f) for f in self.features)
                if self.features is not None else None,
                attentions=tuple(maps[index][None] for maps in self.attentions)
                if self.attentions is not None else None,
            ))
        return outputs

    def patch_mask(self) -> torch.Tensor:
        """`[total]` bool: True at patch tokens, False at each image's prefix tokens."""
        device = next(t.device for t in (self.tokens, *(self.features or ()),
                                         *(self.hidden_states or ())) if t is not None)
        mask = torch.ones(self.offsets[-1], dtype=torch.bool, device=device)
        for start in self.offsets[:-1]:
            mask[start:start + self.num_prefix_tokens] = False
        return mask
