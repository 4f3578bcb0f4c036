"""The optimiser's parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlm_vit.train.config import TrainConfig

# Parameters that are not weight-decayed besides every one with ndim <= 1 (norms, biases):
# learned tables and tokens, following MAE, DINOv2 and timm's `no_weight_decay`.
NO_DECAY_NAMES = ("pos_embed", "cls_token", "reg_token", "mask_token")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight-decayed matrices, and everything else without decay.

    No decay for parameters with ndim <= 1 (norm scales and shifts, biases) and those whose
    names contain one of `NO_DECAY_NAMES` (position tables and learned tokens): shrinking
    them towards zero has no regularising meaning.

    Args:
        model: its trainable parameters are grouped; frozen ones are left out.
        weight_decay: for the decayed group.

    Returns:
        Two groups, each with "params", "weight_decay" and "names" (for inspection).
    """
    decay: tuple[list, list] = ([], [])
    no_decay: tuple[list, list] = ([], [])
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        exempt = parameter.ndim <= 1 or any(part in name for part in NO_DECAY_NAMES)
        group = no_decay if exempt else decay
        group[0].append(parameter)
        group[1].append(name)
    return [
        {"params": decay[0], "weight_decay": weight_decay, "names": decay[1]},
        {"params": no_decay[0], "weight_decay": 0.0, "names": no_decay[1]},
    ]


def optimizer_groups(objective: nn.Module, config: TrainConfig) -> list[dict[str, Any]]:
    """The objective's own `parameter_groups(weight_decay)` where it has one (layer-wise
    learning rates: a group's `lr_scale` multiplies `config.lr`), else `parameter_groups`.
    Groups are ordered by descending scale, so the first (whose LR is logged) runs at the
    schedule's own LR when any does."""
    own = getattr(objective, "parameter_groups", None)
    groups = own(config.weight_decay) if callable(own) else \
        parameter_groups(objective, config.weight_decay)
    for group in groups:
        group["lr"] = config.lr * group.get("lr_scale", 1.0)
    return sorted(groups, key=lambda group: -group.get("lr_scale", 1.0))


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int,
                  total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based).

    Linear warmup, `lr * (step + 1) / warmup_steps`, reaches `lr` at step warmup_steps - 1;
    then a half cosine from `lr` at step `warmup_steps` towards `min_lr`, which it would
    reach at step `total_steps` (one past the last, so the last step still learns).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer,
                    config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `learning_rate`; each group's LR is its starting LR (config.lr,
    times its `lr_scale`) times the schedule's factor."""
    def factor(step: int) -> float:
        return learning_rate(step, lr=config.lr, min_lr=config.min_lr,
                             warmup_steps=config.warmup_steps,
                             total_steps=config.steps) / config.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class Optimization:
    """The optimiser, its LR schedule and the fp16 loss scaler: what a step updates and a
    checkpoint saves beside the objective."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler

    @classmethod
    def build(cls, objective: nn.Module, config: TrainConfig, device_type: str) -> Optimization:
        """AdamW over `optimizer_groups`, `build_scheduler`'s schedule, and a scaler enabled
        for fp16 only."""
        optimizer = torch.optim.AdamW(optimizer_groups(objective, config), lr=config.lr,
                                      betas=config.betas)
        return cls(optimizer, build_scheduler(optimizer, config),
                   torch.amp.GradScaler(device_type, enabled=config.precision == "fp16"))

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's "optimizer", "scheduler" and "scaler" entries."""
        return {"optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
