"""Embedding filters (ViT paper, Figure 7 left): the principal components of the patch
embedding's weights, each one a P x P picture in the input's channels."""

from __future__ import annotations

import torch

PAPER_COMPONENTS = 28  # the paper shows the top 28


def embedding_filters(weight: torch.Tensor, count: int = PAPER_COMPONENTS
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top principal components of the patch-embedding weights.

    The D rows of the flattened weights `[D, C * P * P]` are the samples: they are centred,
    and the right singular vectors are the components. A component's sign is arbitrary;
    each is flipped so that its largest-magnitude entry is positive, for reproducible
    pictures.

    Args:
        weight: `[D, C, P, P]` (`patch_embed.proj.weight`).
        count: components wanted; fewer come back when D or C * P * P is smaller.

    Returns:
        Components `[k, C, P, P]` (unit norm when flattened) and the share of the variance
        each explains, `[k]`, largest first.
    """
    if weight.ndim != 4:
        raise ValueError(f"patch-embedding weights must be [D, C, P, P], got "
                         f"{list(weight.shape)}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    width, channels, height, side = weight.shape
    flat = weight.detach().double().reshape(width, -1)  # (D, C * P * P)
    centred = flat - flat.mean(0, keepdim=True)
    _, singular, components = torch.linalg.svd(centred, full_matrices=False)  # (k, CPP)
    count = min(count, components.shape[0])
    components = components[:count]
    peak = components.gather(1, components.abs().argmax(1, keepdim=True))  # (k, 1)
    components = components * torch.where(peak < 0, -1.0, 1.0)
    variance = singular**2
    share = variance[:count] / variance.sum().clamp_min(torch.finfo(variance.dtype).tiny)
    return components.reshape(count, channels, height, side).float(), share.float()
