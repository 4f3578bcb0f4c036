"""The per-step schedules of the EMA-teacher objectives (`ibot`, `ijepa`): DINOv2's cosine
and linear warm-up, and the weight decay that rises along a cosine."""

from __future__ import annotations

import math

import torch


def cosine(start: float, end: float, step: int, steps: int) -> float:
    """DINOv2's cosine schedule from `start` (step 0) to `end` (step `steps`)."""
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * min(step, steps) / max(steps, 1)))


def warmup(start: float, end: float, step: int, steps: int) -> float:
    """Linear from `start` to `end` over `steps` steps (DINOv2's teacher temperature; its
    `linspace` reaches `end` at step `steps - 1`), then `end`."""
    if step >= steps - 1 or steps <= 1:
        return end
    return start + (end - start) * step / (steps - 1)


def cosine_weight_decay(optimizer: torch.optim.Optimizer, end: float, step: int,
                        steps: int) -> None:
    """Sets each decayed group's weight decay for `step`: a cosine from the group's starting
    value (kept in the group as `initial_weight_decay`) to `end` at `steps`."""
    for group in optimizer.param_groups:
        start = group.setdefault("initial_weight_decay", group["weight_decay"])
        if start > 0:
            group["weight_decay"] = cosine(start, end, step, steps)
