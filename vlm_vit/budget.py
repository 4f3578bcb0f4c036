"""Fixed-capacity packed encoding: images packed into buffers of exactly `tokens` tokens, the
shape a server captures once (a CUDA graph, an exported program) and replays for any mix of
image sizes.

    out = encode_budget(encoder, [image_0, image_1, ...], tokens=1024)
    out.tokens[i]          # image i's tokens [L_i, D], in the order given
    out.buffers            # which images each buffer holds (first-fit decreasing)

Images are grouped as the native encode groups them (first-fit decreasing on their token
counts, `vlm_vit.train.token_budget.first_fit_decreasing`); each buffer holds its images end
to end, then one padding segment of zeros up to `tokens`, which attends only to itself. So
every image's tokens are those of the unpadded packed call (`VisionEncoder.forward_packed`)
up to float32 rounding: the same operations, but CPU kernels block a matrix of other rows, and
window attention batches windows of one shape across the pass, in other sums (tested over
random sizes and budgets within 1e-5; measured up to 1.0e-6, often bit-identical). Not bit for
bit, as the issue asks: that needs kernels whose rows do not depend on the rest of the matrix.

An encoder with 2D RoPE and prefix tokens (class or registers) is refused: each segment's
angles start with the prefix, so a padding segment shorter than the prefix has no grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_vit.layers.varlen import Segments
from vlm_vit.packing import check_images
from vlm_vit.train.token_budget import first_fit_decreasing

MAX_BUDGET = 1 << 20  # tokens in one buffer


@dataclass
class BudgetOutput:
    """What `encode_budget` gives.

    Attributes:
        tokens: per image, in the order given, its tokens after the final norm `[L_i, D]`.
        buffers: per buffer, the indices of the images it holds, in their order there.
        lengths: per image, its token count (prefix included).
        capacity: the tokens every buffer has (its images' plus padding).
    """

    tokens: list[torch.Tensor]
    buffers: list[list[int]]
    lengths: list[int]
    capacity: int

    def padding(self) -> list[int]:
        """The padding tokens of each buffer."""
        return [self.capacity - sum(self.lengths[i] for i in buffer) for buffer in self.buffers]


@dataclass(frozen=True)
class BudgetPlan:
    """Where `encode_budget` puts each image, before anything is encoded: shared with the
    exported program's inputs (`vlm_vit.deploy.budget_export`), so both lay out a buffer
    alike.

    Attributes:
        grids: per image, its patch grid (rows, cols).
        lengths: per image, its token count (prefix included).
        buffers: per buffer, the indices of the images it holds, in their order there.
        capacity: the tokens every buffer has.
    """

    grids: list[tuple[int, int]]
    lengths: list[int]
    buffers: list[list[int]]
    capacity: int

    def layout(self, buffer: int) -> tuple[list[int], list[tuple[int, int]]]:
        """The segments of buffer `buffer`: their lengths and grids, its images' in order,
        then the padding's (one segment of grid `(1, pad)`) where the images leave room."""
        indices = self.buffers[buffer]
        sizes = [self.lengths[i] for i in indices]
        grids = [self.grids[i] for i in indices]
        pad = self.capacity - sum(sizes)
        if pad:  # a segment of its own: no image attends to it
            sizes.append(pad)
            grids.append((1, pad))
        return sizes, grids


def plan_budget(encoder, images: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                tokens: int) -> BudgetPlan:
    """Checks `encode_budget`'s arguments and groups the images into buffers (see the module).

    Raises:
        ValueError: as `encode_budget`.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_BUDGET:
        raise ValueError(f"tokens must be an integer from 1 to {MAX_BUDGET}, got {tokens!r}")
    if getattr(encoder, "rope", None) is not None and encoder.num_prefix_tokens:
        raise ValueError("encode_budget does not take an encoder with 2D RoPE and prefix "
                         "(class or register) tokens yet: a padding segment shorter than the "
                         "prefix has no grid for its angles")
    if any(getattr(image, "ndim", 3) != 3 for image in images):
        raise ValueError("encode_budget takes images [C, H, W]; encode clips with "
                         "forward_packed")
    grids = check_images(encoder, images)
    lengths = [encoder.num_prefix_tokens + rows * cols for rows, cols in grids]
    for index, length in enumerate(lengths):
        if length > tokens:
            raise ValueError(f"image {index} ({tuple(images[index].shape[-2:])}) takes "
                             f"{length} tokens, more than the budget of {tokens}")
    return BudgetPlan(grids, lengths, first_fit_decreasing(lengths, tokens), tokens)


def encode_budget(encoder, images: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                  tokens: int, backend: str = "auto") -> BudgetOutput:
    """Encodes `images` (`[C, H_i, W_i]`, sides multiples of the patch) in buffers of exactly
    `tokens` tokens (see the module).

    Raises:
        ValueError: for a budget out of 1 to `MAX_BUDGET`, a clip (images only), a bad image
            list (`vlm_vit.packing.check_images`), or an image of more tokens than the budget
            (naming it).
    """
    plan = plan_budget(encoder, images, tokens=tokens)
    parts = [encoder.prepare_tokens(image[None])[0] for image in images]  # (1, L_i, D)
    out: list[torch.Tensor | None] = [None] * len(images)
    for number, buffer in enumerate(plan.buffers):
        sizes, buffer_grids = plan.layout(number)
        pieces = [parts[i] for i in buffer]
        if len(sizes) > len(buffer):  # the padding: zeros
            pieces.append(parts[0].new_zeros(1, sizes[-1], parts[0].shape[-1]))
        run = encoder.run_blocks(torch.cat(pieces, dim=1),
                                 segments=Segments(tuple(sizes), backend=backend),
                                 grids=buffer_grids)
        for index, piece in zip(buffer, run.tokens[0].split(sizes)[:len(buffer)], strict=True):
            out[index] = piece
    return BudgetOutput(out, plan.buffers, plan.lengths, tokens)
