"""Masked patch prediction, the paper's self-supervised objective (section 4.6, Appendix
B.1.2): corrupt half of the patch embeddings, predict each corrupted patch's 3-bit mean
colour (512 classes) from its output token.

Choices the paper leaves open, made here:

- Exact counts per image, not just in expectation: of N patches, `round(N / 2)` are
  corrupted; of those `round(0.8 n)` become the learned [mask] embedding, `round(0.1 n)`
  another patch's embedding, and the rest stay as they are.
- The "random other patch" is drawn uniformly from every other patch embedding of the batch
  (any image, any position, never itself), as BERT draws a random token from the vocabulary.
- The target is the mean of each RGB channel of the un-normalised patch, in [0, 1],
  quantised to 8 levels (`floor(8 * mean)`, 1.0 going to level 7), combined as
  `64 * red + 8 * green + blue`: pure red is class 448, pure blue class 7.
- The head is one Linear from the final-norm output token to 512 logits (the paper's head is
  unspecified); the loss is cross-entropy over the corrupted patches only, including the ones
  kept as they are. The class token is never corrupted; it is simply not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.model import VisionEncoder
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.pretrain.masking import split_counts


@dataclass
class CorruptionPlan:
    """Which patches are corrupted, and how. All `[B, N]`.

    Attributes:
        corrupted: the patches the loss is computed on.
        masked: those that become the [mask] embedding.
        replaced: those that take another patch's embedding.
        source_index: for every patch, the flat index (into B * N) of the embedding it takes;
            its own index unless `replaced`.
    """

    corrupted: torch.Tensor
    masked: torch.Tensor
    replaced: torch.Tensor
    source_index: torch.Tensor


def color_targets(pixels: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """The mean colour class of every patch of un-normalised pixels in [0, 1].

    Args:
        pixels: `[B, 3, H, W]` in [0, 1].
        patch_size: P.
        bits: levels per channel = 2 ** bits.

    Returns:
        `[B, N]` classes in [0, 2 ** (3 * bits)), row-major over the patch grid.
    """
    levels = 2**bits
    means = F.avg_pool2d(pixels.float(), patch_size)  # (B, 3, rows, cols)
    quantised = (means * levels).floor().clamp_(0, levels - 1).long()
    red, green, blue = quantised.unbind(1)
    return (red * levels * levels + green * levels + blue).flatten(1)  # (B, N)


class MaskedPatchPrediction(nn.Module):
    """The paper's masked patch prediction around an encoder.

    Args:
        encoder: the `VisionEncoder` to pretrain.
        mean, std: the normalisation of the pixels it receives, to recover colours.
        corrupt_ratio: fraction of patches corrupted (0.5).
        split: fractions of the corrupted that are masked / replaced / kept (0.8, 0.1, 0.1).
        bits: colour bits per channel (3: 512 classes).
    """

    def __init__(self, encoder: VisionEncoder, *, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                 corrupt_ratio: float = 0.5, split: tuple[float, float, float] = (0.8, 0.1, 0.1),
                 bits: int = 3) -> None:
        super().__init__()
        if abs(sum(split) - 1.0) > 1e-6 or not 0 < corrupt_ratio <= 1:
            raise ValueError(f"split must sum to 1 and corrupt_ratio lie in (0, 1], got "
                             f"{split} and {corrupt_ratio}")
        width = encoder.config.width
        self.encoder = encoder
        self.corrupt_ratio, self.split, self.bits = corrupt_ratio, tuple(split), bits
        self.mask_token = nn.Parameter(torch.zeros(width))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = nn.Linear(width, 2 ** (3 * bits))
        self.register_buffer("mean", torch.tensor(mean).reshape(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).reshape(1, 3, 1, 1), persistent=False)

    def plan(self, batch: int, patches: int, *, generator: torch.Generator | None = None,
             device: torch.device | str | None = None) -> CorruptionPlan:
        """Draws the corruption of a batch, with exact counts per image."""
        corrupt = int(round(patches * self.corrupt_ratio))
        n_mask, n_replace, _ = split_counts(corrupt, self.split)
        order = torch.rand(batch, patches, generator=generator, device=device).argsort(dim=1)
        rank = order.argsort(dim=1)  # each patch's position in the random order
        corrupted, masked = rank < corrupt, rank < n_mask
        replaced = (rank >= n_mask) & (rank < n_mask + n_replace)
        own = torch.arange(batch * patches, device=device).reshape(batch, patches)
        # another patch of the batch, uniformly, never itself: draw from B*N - 1 and skip own
        other = torch.randint(0, batch * patches - 1, (batch, patches), generator=generator,
                              device=device)
        other = other + (other >= own).long()
        return CorruptionPlan(corrupted, masked, replaced, torch.where(replaced, other, own))

    def forward(self, pixel_values: torch.Tensor, *,
                generator: torch.Generator | None = None) -> ObjectiveOutput:
        """One step: corrupt, encode, predict colours, cross-entropy on corrupted patches."""
        pixels = pixel_values * self.std + self.mean  # un-normalised, [0, 1]
        targets = color_targets(pixels, self.encoder.config.patch_size, self.bits)  # (B, N)
        batch, patches = targets.shape
        plan = self.plan(batch, patches, generator=generator, device=pixel_values.device)
        out = self.encoder(pixel_values, mask=plan.masked, mask_token=self.mask_token,
                           source_index=plan.source_index)
        logits = self.head(out.patch_tokens[plan.corrupted]).float()  # (corrupted, classes)
        wanted = targets[plan.corrupted]
        loss = F.cross_entropy(logits, wanted)
        accuracy = (logits.argmax(-1) == wanted).float().mean().item()
        return ObjectiveOutput(loss=loss, metrics={"accuracy": accuracy})
