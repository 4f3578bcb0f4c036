"""The training settings (`TrainConfig`), what a run returns (`TrainResult`) and the
errors that end a run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
# How the model is spread over processes (`vlm_vit.train.distributed.shard` and `wrap`):
# "ddp" replicates it on every rank; "fsdp" shards parameters, gradients and optimizer state
# per block (FSDP2) and writes distributed checkpoints that resume at any number of ranks.
STRATEGIES = ("ddp", "fsdp")
# Config fields that may change between a checkpoint and its resume without a warning.
HARMLESS_CHANGES = frozenset({"log_every", "checkpoint_every", "keep_checkpoints",
                               "num_workers", "device", "compile", "max_bad_steps",
                               "strategy", "cpu_offload"})


@dataclass
class TrainConfig:
    """How to train. The defaults follow MAE's pretraining recipe where it has one."""

    steps: int = 1000  # optimizer steps in the whole run (a resumed run counts from 0 too)
    batch_size: int = 256  # global: images per optimizer step, over processes and micro-batches
    grad_accumulation: int = 1  # micro-batches per step, to fit a large batch in memory
    lr: float = 1.5e-4  # the peak, reached at the end of warmup
    min_lr: float = 0.0  # where the cosine decay ends
    weight_decay: float = 0.05  # not applied to norms, biases, tables and tokens
    betas: tuple[float, float] = (0.9, 0.95)  # MAE's beta2; 0.999 reacts slowly to spikes
    warmup_steps: int = 0  # LR rises linearly to `lr` over these steps
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    precision: str = "fp32"  # "bf16" autocasts; "fp16" autocasts and scales the loss
    grad_checkpointing: bool = False  # recompute block activations in backward: less memory
    group_by_length: bool = False  # batches of similar `dataset.lengths`: less padding
    compile: bool = False  # torch.compile the objective's forward (slow first step)
    checkpoint_every: int = 1000  # steps between checkpoints; 0: only the one at the end
    keep_checkpoints: int = 2  # newest checkpoints kept on disk; 0 keeps every one
    log_every: int = 10  # steps between log lines; metrics.csv gets every step
    seed: int = 0  # data order, augmentation and the objective's RNG (plus the rank)
    num_workers: int = 4  # DataLoader worker processes per training process
    max_bad_steps: int = 10  # consecutive non-finite losses or gradients before aborting
    device: str = "auto"  # "auto" is CUDA when available, else CPU
    # Treat denormal floats as zero while training on a CPU (torch.set_flush_denormal):
    # gradients and Adam moments drift into that range, where x86 arithmetic is up to a
    # hundred times slower (random-data steps measured 4-25x slower without). GPUs are
    # unaffected. The flag is process-wide; `fit` sets it for the run and clears it after.
    flush_denormal: bool = True
    # Write the key of every sample each step trains on to samples/rank_R.tsv (shard
    # streams only): the data order, checkable against the shards.
    log_samples: bool = False
    # "ddp" (the default: every rank holds the whole model, its gradients and AdamW's two
    # moments, 16 bytes per parameter) or "fsdp" (FSDP2: each rank holds 1/world_size of
    # them; use it when a model's 16 bytes per parameter do not fit one device).
    strategy: str = "ddp"
    cpu_offload: bool = False  # fsdp only: keep parameters and optimizer state on the CPU

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)
        positive = ("steps", "batch_size", "grad_accumulation", "log_every", "max_bad_steps")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "checkpoint_every", "keep_checkpoints", "num_workers",
                     "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.batch_size % self.grad_accumulation:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by "
                             f"grad_accumulation {self.grad_accumulation}")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr} "
                             f"min_lr={self.min_lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"weight_decay and grad_clip must be >= 0, got "
                             f"{self.weight_decay} and {self.grad_clip}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ValueError("strategy 'fsdp' trains in fp32 or bf16 (FSDP2's mixed precision "
                             "has no fp16 loss scaler here); use precision 'bf16'")
        if self.cpu_offload and self.strategy != "fsdp":
            raise ValueError("cpu_offload needs strategy 'fsdp'")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


@dataclass
class TrainResult:
    """What a run did.

    Attributes:
        step: optimizer steps taken in total, including those before a resume.
        losses: the loss of every step from the first (NaN where it was not finite or the
            batch was empty); its length is `step`.
        skipped_steps: steps without an update (non-finite loss or gradient, fp16 overflow,
            or no decodable image).
        undecodable_images: how many times an image failed to decode (a file counts once
            per epoch it is drawn in).
        undecodable_paths: the distinct files that failed, sorted.
        run_dir: where everything was written.
        without_image: shard samples skipped for having no image, over every rank.
        truncated_shards: (shard, samples read, error) for each truncated or unreadable
            shard met (shard streams only).
    """

    step: int
    losses: list[float]
    skipped_steps: int
    undecodable_images: int
    undecodable_paths: list[str]
    run_dir: Path
    without_image: int = 0
    truncated_shards: list[tuple[str, int, str]] = field(default_factory=list)


class NonFiniteLossError(RuntimeError):
    """Training produced `max_bad_steps` non-finite losses or gradients in a row."""


class NothingTrainedError(ValueError):
    """No step of the run updated the weights (every batch undecodable or non-finite): there
    is nothing to export."""
