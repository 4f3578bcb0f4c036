"""I-JEPA (Assran et al., "Self-Supervised Learning from Images with a Joint-Embedding
Predictive Architecture", CVPR 2023): predict, in representation space, what a target
encoder sees in several blocks of an image from what a context encoder sees in another.

Per image: multi-block masks (`multiblock_masking`: one large context block with the four
target blocks removed from it). The context encoder (the student) encodes the context
patches only; the predictor (`jepa_predictor`) predicts, from them, each target block's
features; the target encoder, an exponential moving average of the context encoder, encodes
the whole image, and its patch features, layer-normalised (no affine), are the targets at
the target blocks. The loss is the official code's smooth L1 (beta 1) averaged over every
predicted feature. The EMA momentum rises linearly from 0.996 to 1 over the run and the
weight decay along a cosine from its starting value to 0.4 (`after_optimizer_step`).

A stacked batch `[B, C, H, W]` runs as the official code does (`packed=False`: every mask
of the batch cut to the shortest of its kind, one batched call per network); a list of
`[C, H_i, W_i]` images of any sizes runs packed (each image's blocks on its own grid, the
context, the target and every (image, target block) predictor sequence in one packed call
each, nothing cut), and equals each image's own stacked call.

The target encoder is `objective.encoder`, what a run exports (as I-JEPA releases it); the
context encoder is `objective.student`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from vlm_vit.model import VisionEncoder
from vlm_vit.pretrain.base import (
    EMATeacher,
    ObjectiveOutput,
    ema_update,
    images_grids_masks,
    mask_generator,
)
from vlm_vit.pretrain.jepa_predictor import JEPAPredictor
from vlm_vit.pretrain.multiblock_masking import (
    BlockMasks,
    batch_masks,
    block_size,
    common_length,
)
from vlm_vit.pretrain.schedules import cosine_weight_decay


def linear(start: float, end: float, step: int, steps: int) -> float:
    """I-JEPA's momentum schedule: linear from `start` (step 0) to `end` (step `steps`)."""
    return start + (end - start) * min(step, steps) / max(steps, 1)


def check_block_sizes(grid: tuple[int, int], context_scale: tuple[float, float],
                      target_scale: tuple[float, float], aspect_ratio: tuple[float, float],
                      min_keep: int) -> None:
    """Refuses, before any training, masks that cannot be drawn on `grid` (the encoder's
    image size): a block that holds no more than `min_keep` patches at some draw.

    Raises:
        ValueError: naming the block, the grid and what to change.
    """
    for name, scale, aspect in (("target", target_scale, aspect_ratio),
                                ("context", context_scale, (1.0, 1.0))):
        fewest = min(height * width for height, width in (
            block_size(draw, grid, scale, aspect) for draw in (0.0, 0.25, 0.5, 0.75, 0.999)))
        if fewest <= min_keep:
            raise ValueError(
                f"ijepa's {name} blocks on the encoder's {grid[0]}x{grid[1]} patch grid hold "
                f"as few as {fewest} patch{'es' if fewest > 1 else ''}, not more than "
                f"min_keep={min_keep}: use larger images, a smaller patch or a smaller "
                "min_keep")


class JointEmbeddingPredictive(EMATeacher):
    """I-JEPA around an encoder (see the module docstring).

    Args:
        encoder: the `VisionEncoder` to pretrain (the context encoder; the target encoder
            starts as its copy). Absolute positions only (no 2D RoPE).
        predictor_width, predictor_depth, predictor_heads: the predictor (I-JEPA: 384, 6,
            and the encoder's heads when None).
        context_scale, target_scale, aspect_ratio, targets, min_keep: the masks
            (`multiblock_masking.batch_masks`; I-JEPA's configs: (0.85, 1), (0.15, 0.2),
            (0.75, 1.5), 4, 10).
        momentum: the EMA momentum's (start, end).
        weight_decay_end: where the weight decay's cosine ends (None: left alone).
        packed: encode a stacked batch packed too (lists always are).
    """

    def __init__(self, encoder: VisionEncoder, *, predictor_width: int = 384,
                 predictor_depth: int = 6, predictor_heads: int | None = None,
                 context_scale: tuple[float, float] = (0.85, 1.0),
                 target_scale: tuple[float, float] = (0.15, 0.2),
                 aspect_ratio: tuple[float, float] = (0.75, 1.5), targets: int = 4,
                 min_keep: int = 10, momentum: tuple[float, float] = (0.996, 1.0),
                 weight_decay_end: float | None = 0.4, packed: bool = False) -> None:
        super().__init__()
        if encoder.rope is not None:
            raise ValueError("ijepa needs an encoder with absolute positions: its context "
                             "encoder drops patches, which 2D RoPE does not support here")
        for name, (low, high) in (("context_scale", context_scale),
                                  ("target_scale", target_scale)):
            if not 0.0 < low <= high <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1] with min <= max, got "
                                 f"{(low, high)}")
        if not 0.0 < aspect_ratio[0] <= aspect_ratio[1]:
            raise ValueError(f"aspect_ratio must be positive with min <= max, got "
                             f"{tuple(aspect_ratio)}")
        if targets < 1:
            raise ValueError(f"ijepa needs at least one target block, got {targets}")
        config = encoder.config
        side = config.image_size
        rows, cols = (side, side) if isinstance(side, int) else side
        check_block_sizes((rows // config.patch_size, cols // config.patch_size),
                          context_scale, target_scale, aspect_ratio, min_keep)
        self.student = encoder
        self.predictor = JEPAPredictor(
            config.width, width=predictor_width, depth=predictor_depth,
            heads=predictor_heads or config.heads, patch_size=config.patch_size,
            image_size=config.image_size)
        self.encoder = copy.deepcopy(encoder).requires_grad_(False)  # the target encoder
        self.masking = {"context_scale": tuple(context_scale),
                        "target_scale": tuple(target_scale),
                        "aspect_ratio": tuple(aspect_ratio), "targets": targets,
                        "min_keep": min_keep}
        self.momentum, self.weight_decay_end = tuple(momentum), weight_decay_end
        self.packed = packed

    def draw_masks(self, grids: list[tuple[int, int]]) -> list[BlockMasks]:
        """Masks for images of these grids, from the process RNG (checkpointed, so a resume
        draws the same)."""
        return batch_masks(grids, mask_generator(), **self.masking)

    def forward(self, pixel_values: Any, *,
                masks: list[BlockMasks] | None = None) -> ObjectiveOutput:
        """One step on a stacked batch or a list of images; `masks` (one per image) in place
        of drawn ones."""
        packed = self.packed or not isinstance(pixel_values, torch.Tensor)
        images, grids, masks = images_grids_masks(pixel_values, self.student.config.patch_size,
                                                  masks, self.draw_masks)
        if packed:
            predictions, targets = self.predict_packed(images, masks, grids)
        else:
            masks = common_length(masks)
            predictions, targets = self.predict_stacked(pixel_values, masks, grids[0])
        dtype = torch.promote_types(predictions.dtype, torch.float32)  # bf16 -> float32
        loss = F.smooth_l1_loss(predictions.to(dtype), targets.to(dtype))
        return ObjectiveOutput(loss=loss, metrics={
            "context": float(sum(len(m.context) for m in masks)) / len(masks),
            "target": float(sum(len(t) for m in masks for t in m.targets)) / len(masks)})

    def predict_stacked(self, pixels: torch.Tensor, masks: list[BlockMasks],
                        grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Predictions and targets `[n B, K_t, D]` for a stacked batch (the official
        layout: target block-major)."""
        device = pixels.device
        context_index = torch.stack([m.context for m in masks]).to(device)
        target_index = [torch.stack([m.targets[j] for m in masks]).to(device)
                        for j in range(len(masks[0].targets))]
        with torch.no_grad():
            features = self.encoder(pixels).patch_tokens
            features = F.layer_norm(features, features.shape[-1:])
            width = features.shape[-1]
            targets = torch.cat([torch.gather(features, 1, index[..., None].expand(
                -1, -1, width)) for index in target_index])
        context = self.student(pixels, keep=context_index).patch_tokens
        return self.predictor(context, context_index, target_index, grid), targets

    def predict_packed(self, images: list[torch.Tensor], masks: list[BlockMasks],
                       grids: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Predictions and targets `[total, D]` (image-major, then target block) for images
        of any sizes, each network in one packed call."""
        device = images[0].device
        context_index = [m.context.to(device) for m in masks]
        target_index = [[t.to(device) for t in m.targets] for m in masks]
        with torch.no_grad():
            parts = self.encoder.forward_packed(images).split()
            targets = []
            for part, blocks in zip(parts, target_index, strict=True):
                features = part.patch_tokens[0]
                features = F.layer_norm(features, features.shape[-1:])
                targets += [features[block] for block in blocks]
        context = [part.patch_tokens[0] for part in self.student.forward_packed(
            images, keeps=context_index).split()]
        predictions = self.predictor.forward_packed(context, context_index, target_index,
                                                    grids)
        return (torch.cat([p for blocks in predictions for p in blocks]),
                torch.cat(targets))

    @torch.no_grad()
    def after_optimizer_step(self, step: int, steps: int,
                             optimizer: torch.optim.Optimizer | None = None) -> None:
        """The EMA of the context encoder into the target encoder at this step's momentum,
        then the next step's weight decay."""
        ema_update(self.encoder.parameters(), self.student.parameters(),
                   linear(*self.momentum, step, steps))
        if optimizer is not None and self.weight_decay_end is not None:
            cosine_weight_decay(optimizer, self.weight_decay_end, step + 1, steps)
