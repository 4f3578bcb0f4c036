"""A tiny objective and image folders for the training tests (also used by ddp_worker.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.processor import NORMALIZATION
from vlm_vit.train import ImageFolder, TrainConfig

TINY = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)


class Interrupted(Exception):
    """Stands in for a kill in the middle of a run."""


class ToyObjective(nn.Module):
    """MSE of a linear head on the mean patch token to each image's mean colour.

    Deterministic given the batch unless `dropout` > 0, which draws from the global torch RNG
    (so resuming must restore it).

    Args:
        encoder: the encoder trained.
        dropout: on the pooled token.
        nan_at_calls: forward calls (1-based) whose loss is NaN.
        crash_at_call: the forward call that raises `Interrupted`.
    """

    def __init__(self, encoder: VisionEncoder, dropout: float = 0.0,
                 nan_at_calls: tuple[int, ...] = (), crash_at_call: int | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.width, 3)
        self.dropout = dropout
        self.nan_at_calls = set(nan_at_calls)
        self.crash_at_call = crash_at_call
        self.calls = 0

    def forward(self, pixel_values: torch.Tensor) -> ObjectiveOutput:
        self.calls += 1
        if self.calls == self.crash_at_call:
            raise Interrupted(f"interrupted at forward call {self.calls}")
        pooled = self.encoder(pixel_values).patch_tokens.mean(dim=1)  # (B, D)
        pooled = F.dropout(pooled, self.dropout, self.training)
        target = pixel_values.mean(dim=(2, 3))  # (B, 3)
        loss = F.mse_loss(self.head(pooled).float(), target.float())
        if self.calls in self.nan_at_calls:
            loss = loss * float("nan")
        return ObjectiveOutput(loss, {"target_mean": float(target.mean())})


def toy_objective(seed: int = 0, **kwargs) -> ToyObjective:
    torch.manual_seed(seed)
    return ToyObjective(VisionEncoder(EncoderConfig(**TINY)), **kwargs)


def write_noise_images(directory: Path, count: int, *, seed: int = 0,
                       size: tuple[int, int] = (40, 48)) -> list[Path]:
    """`count` random RGB PNGs of (height, width) `size`, with brightness varying by image."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for index in range(count):
        high = int(rng.integers(64, 256))
        pixels = rng.integers(0, high, (*size, 3), dtype=np.uint8)
        path = directory / f"img_{index:03d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def write_bad_images(directory: Path) -> list[Path]:
    """A truncated PNG and a text file named .jpg."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 48, 3), 128, np.uint8)).save(buffer, format="PNG")
    truncated = directory / "truncated.png"
    truncated.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    text = directory / "notes.jpg"
    text.write_text("this is not a JPEG\n")
    return [truncated, text]


def image_folder(root: Path, seed: int = 0) -> ImageFolder:
    mean, std = NORMALIZATION["imagenet"]
    return ImageFolder(root, 32, mean=mean, std=std, seed=seed)


def config(**overrides) -> TrainConfig:
    """A few steps of global batch 4 on the CPU, no workers, a checkpoint every 2 steps."""
    base = dict(steps=6, batch_size=4, lr=1e-3, min_lr=1e-4, warmup_steps=2,
                checkpoint_every=2, keep_checkpoints=0, log_every=1, num_workers=0,
                device="cpu", seed=0)
    return TrainConfig(**{**base, **overrides})


def real_images(count: int, size: tuple[int, int] = (40, 48)) -> list[bytes]:
    """`count` PNGs of real pictures, (height, width) `size`: scikit-image's sample photos
    and scikit-learn's handwritten digits, in turn."""
    from skimage import data as photos
    from sklearn.datasets import load_digits

    sources = [photos.astronaut(), photos.coffee(), photos.chelsea(), photos.rocket(),
               np.stack([photos.camera()] * 3, axis=-1)]
    digits = load_digits().images  # (1797, 8, 8) in [0, 16]
    encoded = []
    for index in range(count):
        if index % 2 == 0:
            photo = Image.fromarray(sources[(index // 2) % len(sources)])
            # A different crop of the photo each time, so no two images are equal.
            left = (index * 37) % max(photo.width - 200, 1)
            picture = photo.crop((left, 0, left + 200, 200))
        else:
            digit = (digits[index % len(digits)] * 255 / 16).astype(np.uint8)
            picture = Image.fromarray(np.stack([digit] * 3, axis=-1))
        buffer = io.BytesIO()
        picture.resize(size[::-1], Image.BICUBIC).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return encoded


def write_shards(directory: Path, shards: int, per_shard: int, *, labels: int = 0,
                 start: int = 0) -> dict[str, list[str]]:
    """`shards` WebDataset tars of `per_shard` real images each, written with webdataset's
    TarWriter as `directory/shard-NN.tar`; keys `sNN-III`. With `labels`, a `cls` field of
    index mod `labels`. Returns shard path -> its keys, in order."""
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    images = real_images(shards * per_shard)
    written = {}
    for shard in range(shards):
        path = directory / f"shard-{start + shard:02d}.tar"
        keys = []
        with wds.TarWriter(str(path)) as writer:
            for index in range(per_shard):
                key = f"s{start + shard:02d}-{index:03d}"
                sample = {"__key__": key, "png": images[shard * per_shard + index]}
                if labels:
                    sample["cls"] = str((shard * per_shard + index) % labels).encode()
                writer.write(sample)
                keys.append(key)
        written[str(path)] = keys
    return written
