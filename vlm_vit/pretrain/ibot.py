"""Masked self-distillation as DINOv2 trains (Oquab et al., "DINOv2: Learning Robust Visual
Features without Supervision", 2023), named after its masked-patch part, iBOT (Zhou et al.,
"iBOT: Image BERT Pre-Training with Online Tokenizer", ICLR 2022).

A student and a teacher of the same encoder. Each image comes as two global and several
local crops (`vlm_vit.data.multicrop`). The teacher, an exponential moving average of the
student, sees the global crops; the student sees every crop, its global crops with
block-wise masks (`block_masking`). Three terms:

- DINO: the student's class token after the head (prototype logits) on every crop predicts
  the teacher's, centred and sharpened, on every *other* global crop (`dino_loss`);
- iBOT: the student's patch tokens at the masked positions of its global crops predict the
  teacher's at the same positions, which the teacher saw unmasked (`ibot_patch_loss`);
- KoLeo: spreads the student's class tokens within each global crop (`koleo_loss`).

The teacher's targets are centred by Sinkhorn-Knopp (DINOv2's default) or by a running mean
and a softmax (DINO's). Schedules as DINOv2's: the teacher temperature warms up linearly
from 0.04 to 0.07 over the first 30% of steps, the EMA momentum follows a cosine from 0.992
to 1, the weight decay a cosine from its starting value to 0.4 (`after_optimizer_step`).
As in DINOv2's default, the iBOT head is the DINO head.

At native resolution each crop keeps its own size and masks lie on its own grid: all the
views of a batch go through each network in one packed call (`packed=True`); `packed=False`
encodes each group of same-sized views as a batch (the square crops of the usual recipe), and
both give the same loss and gradients.

The teacher's encoder is `objective.encoder`, what a run exports (as DINOv2 releases its
teacher); the student's is `objective.student`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vlm_vit.model import VisionEncoder
from vlm_vit.pretrain.base import EMATeacher, ObjectiveOutput, ema_update, mask_generator
from vlm_vit.pretrain.block_masking import batch_block_masks
from vlm_vit.pretrain.dino_head import DINOHead
from vlm_vit.pretrain.distillation_losses import (
    Center,
    dino_loss,
    ibot_patch_loss,
    koleo_loss,
    sinkhorn_knopp,
    softmax_center,
)
from vlm_vit.pretrain.schedules import cosine, cosine_weight_decay, warmup

CENTERINGS = ("sinkhorn_knopp", "softmax")


class Encoded:
    """One network's class tokens `[n, D]` and patch tokens (`[N_i, D]` per view)."""

    def __init__(self, cls: torch.Tensor, patches: list[torch.Tensor]) -> None:
        self.cls, self.patches = cls, patches


def encode_views(encoder: VisionEncoder, views: list[torch.Tensor], *, packed: bool,
                 masks: Sequence[torch.Tensor | None] | None = None,
                 mask_token: torch.Tensor | None = None) -> Encoded:
    """The class and patch tokens of `views` (`[3, h, w]` each), masked by `masks` (one bool
    `[rows, cols]` per view, or None): one packed call, or one batched call per view size."""
    masks = list(masks) if masks is not None else [None] * len(views)
    if packed:
        out = encoder.forward_packed(views, masks=masks if any(
            m is not None for m in masks) else None, mask_token=mask_token)
        parts = out.split()
        return Encoded(torch.cat([part.cls_token for part in parts]),
                       [part.patch_tokens[0] for part in parts])
    cls: list[Any] = [None] * len(views)
    patches: list[Any] = [None] * len(views)
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, view in enumerate(views):
        groups.setdefault(tuple(view.shape), []).append(index)
    for indices in groups.values():
        batch = torch.stack([views[i] for i in indices])
        options = {}
        if any(masks[i] is not None for i in indices):
            grid = encoder.patch_embed.grid(*batch.shape[-2:])
            blank = torch.zeros(grid, dtype=torch.bool, device=batch.device)
            options = {"mask": torch.stack([blank if masks[i] is None else masks[i]
                                            for i in indices]).flatten(1),
                       "mask_token": mask_token}
        out = encoder(batch, **options)
        for row, index in enumerate(indices):
            cls[index], patches[index] = out.cls_token[row], out.patch_tokens[row]
    return Encoded(torch.stack(cls), patches)


class MaskedSelfDistillation(EMATeacher):
    """DINOv2's objective around an encoder (see the module docstring).

    Args:
        encoder: the `VisionEncoder` to pretrain (it needs a class token); it becomes the
            student, and a copy of it the teacher.
        prototypes: the head's output width K (DINOv2: 65536).
        head_hidden, head_bottleneck: the head's MLP widths (2048, 256).
        student_temp: 0.1.
        teacher_temp: (warm-up start, final): (0.04, 0.07).
        teacher_temp_warmup: the fraction of the steps the warm-up takes (30 of 100 epochs).
        momentum: the EMA momentum's cosine (start, end): (0.992, 1.0).
        weight_decay_end: the weight decay's cosine ends here (0.4; None leaves it alone).
        freeze_prototypes: the fraction of the steps during which the head's last layer gets
            no gradient (DINOv2's `freeze_last_layer_epochs`: 1 of 100 epochs, 0.01).
        centering: "sinkhorn_knopp" (DINOv2) or "softmax" (DINO's running centre).
        center_momentum: the running centre's momentum (softmax centering).
        dino_weight, ibot_weight, koleo_weight: 1.0, 1.0, 0.1 (DINOv2).
        mask_probability: the share of images whose global crops are masked (0.5).
        mask_ratio: each masked crop's ratio range, stratified over the batch (0.1, 0.5).
        packed: every view of a batch in one packed call per network.
        steps: the run's length, for the schedules (the trainer passes it to
            `after_optimizer_step` too); 0 (unknown) skips the temperature warm-up.

    Raises:
        ValueError: for an encoder without a class token, an unknown centering, or a mask
            setting out of range (one line naming it).
    """

    teacher_modules = ("encoder", "teacher_head")  # DINOv2 builds its teacher without drop path

    def __init__(self, encoder: VisionEncoder, *, prototypes: int = 65536,
                 head_hidden: int = 2048, head_bottleneck: int = 256,
                 student_temp: float = 0.1, teacher_temp: tuple[float, float] = (0.04, 0.07),
                 teacher_temp_warmup: float = 0.3,
                 momentum: tuple[float, float] = (0.992, 1.0),
                 weight_decay_end: float | None = 0.4, freeze_prototypes: float = 0.01,
                 centering: str = "sinkhorn_knopp",
                 center_momentum: float = 0.9, dino_weight: float = 1.0,
                 ibot_weight: float = 1.0, koleo_weight: float = 0.1,
                 mask_probability: float = 0.5, mask_ratio: tuple[float, float] = (0.1, 0.5),
                 packed: bool = True, steps: int = 0) -> None:
        super().__init__()
        if encoder.cls_token is None:
            raise ValueError("ibot needs an encoder with a class token (class_token=True): "
                             "the DINO loss reads it")
        if centering not in CENTERINGS:
            raise ValueError(f"centering must be one of {', '.join(CENTERINGS)}, got "
                             f"{centering!r}")
        if not 0.0 <= freeze_prototypes <= 1.0:
            raise ValueError(f"freeze_prototypes is a fraction of the steps in [0, 1], got "
                             f"{freeze_prototypes}")
        if not 0.0 <= mask_probability <= 1.0:
            raise ValueError(f"mask probability must lie in [0, 1], got {mask_probability}")
        if not 0.0 <= mask_ratio[0] <= mask_ratio[1] < 1.0:
            raise ValueError(f"mask ratio must lie in [0, 1) with min <= max, got "
                             f"{tuple(mask_ratio)}")
        width = encoder.config.width
        self.student = encoder
        self.head = DINOHead(width, prototypes, hidden_dim=head_hidden,
                             bottleneck_dim=head_bottleneck)
        # DINOv2's mask token: zeros, in the student's input only.
        self.mask_token = nn.Parameter(torch.zeros(width))
        # The teacher: the student's weights, never trained by the optimiser.
        self.encoder = copy.deepcopy(encoder).requires_grad_(False)
        self.teacher_head = copy.deepcopy(self.head).requires_grad_(False)
        self.centering = centering
        if centering == "softmax":
            self.dino_center = Center(prototypes, momentum=center_momentum)
            self.ibot_center = Center(prototypes, momentum=center_momentum)
        self.student_temp, self.teacher_temps = student_temp, tuple(teacher_temp)
        self.teacher_temp_warmup, self.momentum = teacher_temp_warmup, tuple(momentum)
        self.weight_decay_end, self.freeze_prototypes = weight_decay_end, freeze_prototypes
        self.weights = {"dino": dino_weight, "ibot": ibot_weight, "koleo": koleo_weight}
        self.mask_probability, self.mask_ratio = mask_probability, tuple(mask_ratio)
        self.packed = packed
        # The schedules' position: the optimiser steps taken (checkpointed as a buffer).
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        self.register_buffer("total_steps", torch.tensor(steps, dtype=torch.long))

    def teacher_temperature(self) -> float:
        total = int(self.total_steps)
        steps = max(int(round(self.teacher_temp_warmup * total)), 1) if total else 1
        return warmup(*self.teacher_temps, int(self.steps_done), steps)

    def prototypes_frozen(self) -> bool:
        """Whether this step's head keeps its last layer (the prototypes) fixed."""
        return int(self.steps_done) < round(self.freeze_prototypes * int(self.total_steps))

    def targets(self, logits: torch.Tensor, center: Center | None) -> torch.Tensor:
        """The teacher's centred, sharpened probabilities for `logits` `[n, K]`."""
        temperature = self.teacher_temperature()
        # Called on every rank even without rows: both centerings all-reduce across ranks.
        if self.centering == "sinkhorn_knopp":
            return sinkhorn_knopp(logits.float(), temperature)
        probabilities = softmax_center(logits.float(), center.center, temperature)
        center.update(logits.float())
        return probabilities

    def draw_masks(self, grids: list[tuple[int, int]],
                   device: torch.device) -> list[torch.Tensor]:
        """Block masks for the global crops (`grids`, view-major: crop v of image i at
        `v * images + i`), from the process RNG (checkpointed, so a resume draws the same)."""
        generator = mask_generator()
        masks = batch_block_masks(grids, generator, mask_probability=self.mask_probability,
                                  ratio=self.mask_ratio)
        return [mask.to(device) for mask in masks]

    def forward(self, views: Any) -> ObjectiveOutput:
        """One step on a `ViewBatch`: B images' global crops (`views.global_views`, one list
        or stacked tensor per crop index) and local crops (`views.local_views`)."""
        global_views = [list(view) for view in views.global_views]
        local_views = [list(view) for view in views.local_views]
        if len(global_views) < 2:
            raise ValueError(f"ibot needs two global crops per image, got {len(global_views)}")
        images = len(global_views[0])
        flat_global = [image for view in global_views for image in view]  # view-major
        flat_local = [image for view in local_views for image in view]
        patch = self.student.config.patch_size
        grids = [(image.shape[-2] // patch, image.shape[-1] // patch) for image in flat_global]
        masks = self.draw_masks(grids, flat_global[0].device)

        with torch.no_grad():
            teacher = encode_views(self.encoder, flat_global, packed=self.packed)
            teacher_cls = self.teacher_head(teacher.cls)
            masked_teacher = torch.cat([tokens[mask.reshape(-1)]
                                        for tokens, mask in zip(teacher.patches, masks,
                                                                strict=True)])
            teacher_patch = self.teacher_head(masked_teacher)
            dino_targets = self.targets(teacher_cls, getattr(self, "dino_center", None))
            ibot_targets = self.targets(teacher_patch, getattr(self, "ibot_center", None))

        student = encode_views(self.student, flat_global + flat_local, packed=self.packed,
                               masks=masks + [None] * len(flat_local),
                               mask_token=self.mask_token)
        frozen = self.prototypes_frozen()
        student_cls = self.head(student.cls, freeze_prototypes=frozen)
        count = len(global_views) + len(local_views)
        dino = dino_loss(list(student_cls.chunk(count)), list(dino_targets.chunk(len(
            global_views))), student_temp=self.student_temp)
        masked_student = torch.cat([tokens[mask.reshape(-1)] for tokens, mask in zip(
            student.patches[:len(flat_global)], masks, strict=True)])
        image_index = torch.cat([torch.full((int(mask.sum()),), index, dtype=torch.long,
                                            device=masked_student.device)
                                 for index, mask in enumerate(masks)])
        ibot = ibot_patch_loss(self.head(masked_student, freeze_prototypes=frozen),
                               ibot_targets, image_index, len(flat_global),
                               student_temp=self.student_temp)
        global_cls = student.cls[:len(flat_global)].float().chunk(len(global_views))
        koleo = sum(koleo_loss(crop) for crop in global_cls) if images > 1 \
            else student_cls.sum() * 0.0
        loss = (self.weights["dino"] * dino + self.weights["ibot"] * ibot
                + self.weights["koleo"] * koleo)
        # The mask token in the graph whatever the masks: DDP needs every parameter to get
        # a gradient on every rank, also where no patch of this rank's crops was masked.
        loss = loss + self.mask_token.sum() * 0.0
        return ObjectiveOutput(loss=loss, metrics={
            "dino": float(dino.detach()), "ibot": float(ibot.detach()),
            "koleo": float(koleo.detach()),
            "masked": float(sum(int(mask.sum()) for mask in masks)),
            "teacher_temp": self.teacher_temperature()})

    @torch.no_grad()
    def after_optimizer_step(self, step: int, steps: int,
                             optimizer: torch.optim.Optimizer | None = None) -> None:
        """The EMA of the student into the teacher at this step's momentum, then the next
        step's schedules (the weight decay of the optimiser's decayed groups)."""
        ema_update([*self.encoder.parameters(), *self.teacher_head.parameters()],
                   [*self.student.parameters(), *self.head.parameters()],
                   cosine(*self.momentum, step, steps))
        self.steps_done.fill_(step + 1)
        self.total_steps.fill_(steps)
        if optimizer is not None and self.weight_decay_end is not None:
            cosine_weight_decay(optimizer, self.weight_decay_end, step + 1, steps)
