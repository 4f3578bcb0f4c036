"""CAPI (Darcet et al., "Cluster and Predict Latent Patches for Improved Masked Image
Modeling", TMLR 2025): the student predicts, at masked positions, which online cluster the
teacher puts each patch in.

Per image an inverse block mask (`inverse_block_masking`: 65% of the patches masked, one
visible block, rolled). The teacher, an exponential moving average of the student's encoder,
encodes the whole image; a clustering head (a Linear with bias on the L2-normalised patch
features) gives each patch's cluster logits, and a position-wise Sinkhorn-Knopp over the
batch (`cluster_losses.positionwise_sinkhorn`, temperature 0.06) turns them into soft
assignments. The student encodes the visible patches only; the predictor
(`capi_predictor`) cross-attends from a mask token at each masked position to them; the
student head (cosine similarity to unit-norm prototypes) gives logits whose softmax at
temperature 0.12 is scored against the teacher's assignments (cross-entropy). The clustering
head learns from the same cross-entropy of its own logits against their assignments (the
teacher's features detached). The loss is the sum of the two.

As lightly's CAPI (its `CAPILoss`, heads and predictor, one optimiser for everything, the EMA
of the encoder alone) with the official schedules where lightly leaves them to the user: the
momentum from 0.996 along a cosine to 1 (`after_optimizer_step`). Not the official code's:
its own AdamW for the clustering head, its RMSNorm and RoPE encoder, and predicting only 5%
of the masked patches (`predict_fraction` does that).

Every image in one packed call per network (`packed=True`) or one call each (`packed=False`):
the same loss and gradients. The teacher's encoder is `objective.encoder`, what a run exports;
the student's is `objective.student`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import distributed as dist
from torch import nn

from vlm_vit.layers.rope_2d import grid_positions
from vlm_vit.model import VisionEncoder
from vlm_vit.pretrain.base import (
    EMATeacher,
    ObjectiveOutput,
    ema_update,
    images_grids_masks,
    mask_generator,
)
from vlm_vit.pretrain.capi_predictor import CAPIPredictor
from vlm_vit.pretrain.cluster_losses import cluster_cross_entropy, positionwise_sinkhorn
from vlm_vit.pretrain.inverse_block_masking import (
    InverseBlockMask,
    batch_inverse_block_masks,
)
from vlm_vit.pretrain.schedules import cosine


class ClusterPredictiveMasking(EMATeacher):
    """CAPI around an encoder (see the module docstring).

    Args:
        encoder: the `VisionEncoder` to pretrain (absolute positions: the student drops the
            masked patches).
        clusters: K, the clusters and the student head's prototypes (CAPI: 16384).
        predictor_depth, predictor_heads: the predictor (lightly's example: 2 and 6 at
            ViT-S; CAPI's ViT-L: 12 and 16).
        mask_ratio, min_aspect: the inverse block masks (0.65, 0.5).
        teacher_temp, student_temp: the assignments' and the predictions' temperatures.
        sinkhorn_iterations: 3.
        momentum: the EMA momentum's (start, end).
        predict_fraction: the share of each image's masked patches scored (1: all, as
            lightly; the official code 0.05; at least one per image).
        packed: every image in one packed call per network.
    """

    def __init__(self, encoder: VisionEncoder, *, clusters: int = 16384,
                 predictor_depth: int = 12, predictor_heads: int | None = None,
                 mask_ratio: float = 0.65, min_aspect: float = 0.5,
                 teacher_temp: float = 0.06, student_temp: float = 0.12,
                 sinkhorn_iterations: int = 3, momentum: tuple[float, float] = (0.996, 1.0),
                 predict_fraction: float = 1.0, packed: bool = True) -> None:
        super().__init__()
        if encoder.rope is not None:
            raise ValueError("capi needs an encoder with absolute positions: its student "
                             "drops the masked patches, which 2D RoPE does not support here")
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"the mask ratio must lie in (0, 1), got {mask_ratio}")
        if not 0.0 < predict_fraction <= 1.0:
            raise ValueError(f"predict_fraction must lie in (0, 1], got {predict_fraction}")
        if clusters < 2:
            raise ValueError(f"capi needs at least 2 clusters, got {clusters}")
        width = encoder.config.width
        heads = predictor_heads or encoder.config.heads
        self.student = encoder
        self.predictor = CAPIPredictor(width, depth=predictor_depth, heads=heads)
        # The student head: cosine similarity to K unit-norm prototypes.
        self.prototypes = nn.Parameter(torch.empty(clusters, width))
        nn.init.trunc_normal_(self.prototypes, std=0.02)
        self.encoder = copy.deepcopy(encoder).requires_grad_(False)  # the teacher
        # Trained by the clustering loss; CAPI's initialisation (normal, std 1; zero bias).
        self.clustering = nn.Linear(width, clusters)
        nn.init.normal_(self.clustering.weight, std=1.0)
        nn.init.zeros_(self.clustering.bias)
        self.mask_ratio, self.min_aspect = mask_ratio, min_aspect
        self.teacher_temp, self.student_temp = teacher_temp, student_temp
        self.sinkhorn_iterations, self.momentum = sinkhorn_iterations, tuple(momentum)
        self.predict_fraction, self.packed = predict_fraction, packed

    def draw_masks(self, grids: list[tuple[int, int]]) -> list[InverseBlockMask]:
        """Masks for images of these grids, from the process RNG (checkpointed)."""
        generator = mask_generator()
        masks = batch_inverse_block_masks(grids, generator, ratio=self.mask_ratio,
                                          min_aspect=self.min_aspect)
        if self.predict_fraction < 1.0:  # the official code's prediction subsampling
            masks = [InverseBlockMask(m.visible, m.masked[torch.randperm(
                len(m.masked), generator=generator)[:max(1, int(len(m.masked)
                                                             * self.predict_fraction))]
                .sort().values]) for m in masks]
        return masks

    def head(self, tokens: torch.Tensor) -> torch.Tensor:
        """The student head's logits: cosine similarities to the prototypes."""
        return F.linear(F.normalize(tokens, dim=-1), F.normalize(self.prototypes, dim=-1))

    def forward(self, pixel_values: Any, *,
                masks: list[InverseBlockMask] | None = None) -> ObjectiveOutput:
        """One step on a stacked batch or a list of images; `masks` (one per image) in place
        of drawn ones."""
        images, grids, masks = images_grids_masks(pixel_values, self.student.config.patch_size,
                                                  masks, self.draw_masks)
        device = images[0].device
        visible = [m.visible.to(device) for m in masks]
        masked = [m.masked.to(device) for m in masks]

        with torch.no_grad():
            teacher = self.encode(self.encoder, images, None)
        features = torch.cat(teacher)  # (T, D), every image's patches
        logits = self.clustering(F.normalize(features, dim=-1, eps=1e-7))
        positions, count = self.positions(grids, device)
        assignments = positionwise_sinkhorn(logits.detach(), positions, count,
                                            self.teacher_temp, self.sinkhorn_iterations)
        clustering = cluster_cross_entropy(logits, assignments, self.student_temp)

        context = self.encode(self.student, images, visible)
        where = [grid_positions(grid, device=device) for grid in grids]
        predictions = self.predictor(context, [w[v] for w, v in zip(where, visible,
                                                                     strict=True)],
                                     [w[m] for w, m in zip(where, masked, strict=True)])
        starts = torch.tensor([0, *[g[0] * g[1] for g in grids]], device=device).cumsum(0)
        targets = assignments[torch.cat([m + start for m, start in zip(masked, starts,
                                                                       strict=False)])]
        student = cluster_cross_entropy(self.head(torch.cat(predictions)), targets,
                                        self.student_temp)
        return ObjectiveOutput(loss=student + clustering, metrics={
            "student": float(student.detach()), "clustering": float(clustering.detach()),
            "predicted": float(sum(len(m) for m in masked)) / len(masks)})

    def encode(self, encoder: VisionEncoder, images: list[torch.Tensor],
               keeps: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Each image's patch tokens `[N_i, D]` (only the kept ones with `keeps`)."""
        if self.packed:
            out = encoder.forward_packed(images, keeps=keeps)
            return [part.patch_tokens[0] for part in out.split()]
        keeps = keeps or [None] * len(images)
        return [encoder(image[None], **({} if keep is None else {"keep": keep[None]}))
                .patch_tokens[0] for image, keep in zip(images, keeps, strict=True)]

    @staticmethod
    def positions(grids: list[tuple[int, int]], device: torch.device
                  ) -> tuple[torch.Tensor, int]:
        """Each patch's position in a grid holding every image's (on every rank): `[T]`, and
        that grid's size."""
        largest = torch.tensor([max(g[0] for g in grids), max(g[1] for g in grids)],
                               device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        rows, cols = (int(v) for v in largest)
        index = torch.cat([(grid_positions(g, device=device) * torch.tensor(
            [cols, 1], device=device)).sum(-1) for g in grids])
        return index, rows * cols

    @torch.no_grad()
    def after_optimizer_step(self, step: int, steps: int,
                             optimizer: torch.optim.Optimizer | None = None) -> None:
        """The EMA of the student's encoder into the teacher at this step's momentum."""
        ema_update(self.encoder.parameters(), self.student.parameters(),
                   cosine(*self.momentum, step, steps))

