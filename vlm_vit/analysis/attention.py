"""Numbers from attention maps: mean attention distance (ViT paper, Appendix D.7) and
attention rollout (Abnar and Zuidema, "Quantifying Attention Flow in Transformers", 2020).

Maps are `[B, heads, T, T]` with T = prefix + N tokens, the prefix (class token, registers)
first and the N patches row-major on a (rows, cols) grid, as `EncoderOutput.attentions`.

Prefix tokens in the distance: they have no place in the image, so the distance keeps the
patch-to-patch part of each map (patch queries, patch keys) and renormalises each query's
weights over the patches. What the renormalisation removes, the share each patch query gives
the prefix, is measured by `prefix_attention`, so it can be reported beside the distance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IDENTITY_WEIGHT = 0.5  # the residual's share in rollout, as Abnar and Zuidema


def patch_distances(grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """Euclidean distances in pixels between the centres of every pair of patches.

    Patch (i, j) has its centre at ((i + 0.5) P, (j + 0.5) P), so two patches lie
    P * hypot(di, dj) pixels apart.

    Returns:
        `[N, N]` float32, row-major over the grid.
    """
    rows, cols = grid
    y, x = torch.meshgrid(torch.arange(rows, dtype=torch.float64),
                          torch.arange(cols, dtype=torch.float64), indexing="ij")
    centres = torch.stack([y.reshape(-1), x.reshape(-1)], dim=1) * patch_size  # (N, 2)
    return torch.cdist(centres, centres).float()


def _check_maps(attention: torch.Tensor, tokens: int | None = None) -> None:
    if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(f"attention maps must be [B, heads, T, T], got {list(attention.shape)}")
    if tokens is not None and attention.shape[-1] != tokens:
        raise ValueError(f"attention maps over {attention.shape[-1]} tokens do not fit "
                         f"{tokens} tokens (prefix + patches)")


def patch_attention(attention: torch.Tensor, num_prefix_tokens: int = 0) -> torch.Tensor:
    """The patch-to-patch part of attention maps, each query's weights renormalised to sum 1.

    Args:
        attention: `[B, heads, T, T]`.
        num_prefix_tokens: class and register tokens at the front of T.

    Returns:
        `[B, heads, N, N]`.
    """
    _check_maps(attention)
    weights = attention[..., num_prefix_tokens:, num_prefix_tokens:]  # (B, heads, N, N)
    if num_prefix_tokens:
        # A softmax row is never all zero on the patches, but keep a hand-made one finite.
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
    return weights


def prefix_attention(attention: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """The mean weight patch queries give the prefix tokens (what `patch_attention` drops).

    Returns:
        `[B, heads]`; zeros when there is no prefix.
    """
    _check_maps(attention)
    queries = attention[..., num_prefix_tokens:, :num_prefix_tokens]  # (B, heads, N, prefix)
    return queries.sum(-1).mean(-1)


def attention_distance(weights: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """Each query's attention-weighted mean distance to the keys: sum_k w[q, k] d[q, k].

    Args:
        weights: `[..., Q, K]` (or `[..., K]` for one query), each row summing to one.
        distances: `[Q, K]` (or `[K]`) in pixels.

    Returns:
        `[..., Q]` (or `[...]`) in pixels.
    """
    if weights.shape[-distances.ndim:] != distances.shape:
        raise ValueError(f"weights {list(weights.shape)} do not end in the distances' shape "
                         f"{list(distances.shape)}")
    return (weights * distances.to(weights.dtype)).sum(-1)


def mean_attention_distance(
    attention: torch.Tensor, grid: tuple[int, int], patch_size: int, num_prefix_tokens: int = 0
) -> torch.Tensor:
    """The paper's mean attention distance of one layer: per head, averaged over queries.

    Patch-to-patch attention only, renormalised over the patches (see the module docstring).

    Args:
        attention: `[B, heads, T, T]`, T = prefix + rows * cols.
        grid: the patch grid (rows, cols).
        patch_size: P, pixels per patch side.
        num_prefix_tokens: class and register tokens at the front of T.

    Returns:
        `[B, heads]` in pixels, one value per image and head.
    """
    _check_maps(attention, num_prefix_tokens + grid[0] * grid[1])
    weights = patch_attention(attention, num_prefix_tokens)  # (B, heads, N, N)
    distances = patch_distances(grid, patch_size).to(device=weights.device, dtype=weights.dtype)
    # einsum rather than attention_distance: no second [B, heads, N, N] tensor for the product
    return torch.einsum("bhqk,qk->bh", weights, distances) / distances.shape[0]


def attention_rollout(attentions: Sequence[torch.Tensor],
                      identity_weight: float = IDENTITY_WEIGHT) -> torch.Tensor:
    """Attention rollout: how much each output token draws on each input token.

    Per layer the heads are averaged, the residual connection is modelled by mixing in the
    identity (A' = (1 - w) A + w I, w = 0.5 in the paper), rows are renormalised, and the
    layers are multiplied: R = A'_L ... A'_2 A'_1.

    Args:
        attentions: one `[B, heads, T, T]` map per layer, first layer first.
        identity_weight: w, the residual's share.

    Returns:
        `[B, T, T]`: row t is output token t's distribution over the input tokens.
    """
    if not attentions:
        raise ValueError("attention rollout needs at least one layer's attention maps")
    if not 0.0 <= identity_weight <= 1.0:
        raise ValueError(f"identity_weight must lie in [0, 1], got {identity_weight}")
    rollout = None
    for attention in attentions:
        _check_maps(attention)
        mixed = attention.float().mean(1)  # (B, T, T)
        eye = torch.eye(mixed.shape[-1], dtype=mixed.dtype, device=mixed.device)
        mixed = (1.0 - identity_weight) * mixed + identity_weight * eye
        mixed = mixed / mixed.sum(-1, keepdim=True)
        rollout = mixed if rollout is None else mixed @ rollout
    return rollout


def rollout_grid(
    rollout: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int, class_token: bool
) -> torch.Tensor:
    """The rollout's view of the patches as an image-shaped map.

    With a class token, its row over the patches (what the paper's Figure 6 shows); without
    one, the mean of the patch rows over the patches. The values are the shares of that row
    drawn from each patch input, not renormalised: the rest comes from prefix inputs.

    Args:
        rollout: `[B, T, T]` from `attention_rollout`.
        grid: (rows, cols).
        num_prefix_tokens: class and register tokens at the front of T; the class token,
            when there is one, is token 0.
        class_token: whether token 0 is a class token.

    Returns:
        `[B, rows, cols]`.
    """
    rows, cols = grid
    if rollout.ndim != 3 or rollout.shape[-1] != num_prefix_tokens + rows * cols:
        raise ValueError(f"rollout {list(rollout.shape)} does not fit grid {grid} with "
                         f"{num_prefix_tokens} prefix tokens")
    if class_token and num_prefix_tokens < 1:
        raise ValueError("a class token counts as a prefix token; num_prefix_tokens is 0")
    if class_token:
        patches = rollout[:, 0, num_prefix_tokens:]  # (B, N)
    else:
        patches = rollout[:, num_prefix_tokens:, num_prefix_tokens:].mean(1)  # (B, N)
    return patches.reshape(-1, rows, cols)
