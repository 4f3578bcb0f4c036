"""Random masks with exact counts per image, shared by the objectives."""

from __future__ import annotations

import torch


def random_masking(
    batch: int,
    patches: int,
    mask_ratio: float,
    *,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAE's per-sample random masking: sort noise, keep the lowest-noise patches.

    Args:
        batch: B.
        patches: N.
        mask_ratio: the fraction of patches masked; `int(N * (1 - ratio))` are kept, as MAE.
        noise: `[B, N]` to sort instead of fresh uniform noise (reproducible masks).
        generator: draws the noise when none is given.
        device: where the noise is drawn.

    Returns:
        ids_keep `[B, K]` (the visible patches, in noise order), mask `[B, N]` (1.0 for a
        masked patch, in patch order) and ids_restore `[B, N]` (un-shuffles
        `[visible; masked]` back to patch order). A ratio of 0 keeps every patch in order.
    """
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    keep = int(patches * (1 - mask_ratio))
    if mask_ratio == 0:  # deterministic: every patch, in order
        ids = torch.arange(patches, device=device).expand(batch, -1)
        return ids, torch.zeros(batch, patches, device=device), ids
    if noise is None:
        noise = torch.rand(batch, patches, generator=generator, device=device)
    elif noise.shape != (batch, patches):
        raise ValueError(f"noise must be [{batch}, {patches}], got {list(noise.shape)}")
    ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small noise is kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    mask = torch.ones(batch, patches, device=noise.device)
    mask[:, :keep] = 0
    return ids_shuffle[:, :keep], torch.gather(mask, 1, ids_restore), ids_restore


def split_counts(total: int, fractions: tuple[float, ...]) -> tuple[int, ...]:
    """Exact integer counts of `total` for each fraction, rounding to the nearest, the last
    taking the rest (so 98 split 0.8 / 0.1 / 0.1 gives 78 / 10 / 10)."""
    counts = [int(round(total * f)) for f in fractions[:-1]]
    if sum(counts) > total:
        raise ValueError(f"fractions {fractions} of {total} do not fit")
    return (*counts, total - sum(counts))
