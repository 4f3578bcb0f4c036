"""Small real images for pretraining tests: crops of scikit-image's sample photos."""

import pytest
import torch


def photo_batch(size: int = 32, count: int = 8) -> torch.Tensor:
    """`count` crops of real photos, `[count, 3, size, size]` normalised with 0.5 / 0.5."""
    data = pytest.importorskip("skimage.data")
    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    crops = []
    for index in range(count):
        photo = torch.from_numpy(photos[index % len(photos)]).permute(2, 0, 1).float() / 255
        top, left = 37 * (index // len(photos)), 53 * (index // len(photos))
        crop = photo[:, top:top + 4 * size, left:left + 4 * size]
        crops.append(torch.nn.functional.avg_pool2d(crop[None], 4)[0])  # downscale x4
    return (torch.stack(crops) - 0.5) / 0.5


def train_briefly(objective: torch.nn.Module, pixels: torch.Tensor,
                  steps: int = 40) -> list[float]:
    """The losses of `steps` AdamW steps on one batch, masks from a seeded generator."""
    optimizer = torch.optim.AdamW(objective.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = objective(pixels, generator=generator).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
