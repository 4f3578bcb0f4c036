"""Masked-patch inputs, applied to the patch embeddings in the encoder's token preparation
(DINOv2's `prepare_tokens_with_masks`): the paper's masked patch prediction (a learned [mask]
embedding, a random other patch; section 4.6, BEiT) and MAE's kept patches. The objectives
in `vlm_vit.pretrain` draw the masks; these functions only check and apply them."""

from __future__ import annotations

import torch


def mask_patches(
    x: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    mask_token: torch.Tensor | None = None,
    source_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Patch embeddings `[B, N, D]` with patches swapped (`source_index`, `[B, N]` indices into
    the batch's B * N embeddings), then masked ones (`mask`, `[B, N]` bool) replaced by
    `mask_token` (`[D]`); see `VisionEncoder.prepare_tokens`.

    Raises:
        ValueError: for an index or mask of the wrong shape, dtype or range, or a mask without
            a mask token of the width.
    """
    batch, patches, width = x.shape
    if source_index is not None:
        check_indices(source_index, (batch, patches), batch * patches, "source_index")
        x = x.reshape(batch * patches, width)[source_index.reshape(-1)].reshape(x.shape)
    if mask is not None:
        if mask.shape != (batch, patches) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor [{batch}, {patches}], got "
                             f"{mask.dtype} {list(mask.shape)}")
        if mask_token is None or mask_token.shape[-1] != width:
            raise ValueError(f"a mask needs a mask_token of width {width}")
        x = torch.where(mask[..., None], mask_token.to(x.dtype).reshape(1, 1, width), x)
    return x


def keep_patches(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The patches `keep` (`[B, K]` indices) of `x` `[B, N, D]`, in its order: `[B, K, D]`.

    Raises:
        ValueError: for indices of the wrong shape, dtype or range.
    """
    batch, patches, width = x.shape
    check_indices(keep, (batch, keep.shape[-1]), patches, "keep")
    return torch.gather(x, 1, keep[..., None].expand(-1, -1, width))  # (B, K, D)


def check_indices(index: torch.Tensor, shape: tuple[int, int], limit: int, name: str) -> None:
    """Raises a ValueError unless `index` is an integer tensor of `shape` with values in
    `[0, limit)` (the values checked on a CPU only)."""
    if index.dtype not in (torch.int64, torch.int32) or tuple(index.shape) != shape:
        raise ValueError(f"{name} must be an integer tensor {list(shape)}, got {index.dtype} "
                         f"{list(index.shape)}")
    # The range check reads values, which would stall a GPU every step; there the gather
    # itself asserts on a bad index.
    if index.device.type == "cpu" and index.numel() and (index.min() < 0 or index.max() >= limit):
        raise ValueError(f"{name} values must lie in [0, {limit}), got "
                         f"[{index.min().item()}, {index.max().item()}]")
