"""Masked autoencoders (He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR
2022): mask most patches per image, encode only the visible ones, reconstruct the pixels of
the masked ones with a light decoder.

Split as MAE's own code: `patchify`, `random_masking`, `forward_encoder`, `forward_decoder`,
`forward_loss`. The decoder's positions are the fixed 2D sin-cos table (zero for the prefix
tokens); the target is the (normalised) input pixels of each masked patch, itself normalised
per patch with `norm_pix_loss` (MAE's best setting).
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.layers import sincos_2d_pos_embed
from vlm_vit.model import Block, VisionEncoder
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.pretrain.masking import random_masking


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[B, C, H, W]` to `[B, N, P * P * C]`, each patch row-major over (p, q, channel) as
    MAE's `patchify`."""
    batch, channels, height, width = pixels.shape
    p = patch_size
    rows, cols = height // p, width // p
    x = pixels.reshape(batch, channels, rows, p, cols, p)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(batch, rows * cols, p * p * channels)


def unpatchify(patches: torch.Tensor, patch_size: int, grid: tuple[int, int],
               channels: int = 3) -> torch.Tensor:
    """The inverse of `patchify`: `[B, N, P * P * C]` to `[B, C, H, W]`."""
    p, (rows, cols) = patch_size, grid
    x = patches.reshape(patches.shape[0], rows, cols, p, p, channels)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(patches.shape[0], channels, rows * p,
                                                      cols * p)


class MaskedAutoencoder(nn.Module):
    """MAE pretraining around an encoder.

    Args:
        encoder: the `VisionEncoder` to pretrain.
        mask_ratio: fraction of patches masked per image (0.75). 0 encodes every patch.
        decoder_width, decoder_depth, decoder_heads: the light decoder (512, 8, 16).
        norm_pix_loss: normalise each target patch by its own mean and variance.
    """

    def __init__(self, encoder: VisionEncoder, *, mask_ratio: float = 0.75,
                 decoder_width: int = 512, decoder_depth: int = 8, decoder_heads: int = 16,
                 norm_pix_loss: bool = True) -> None:
        super().__init__()
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
        c = encoder.config
        self.encoder = encoder
        self.mask_ratio, self.norm_pix_loss = mask_ratio, norm_pix_loss
        decoder = EncoderConfig(image_size=c.image_size, patch_size=c.patch_size,
                                width=decoder_width, depth=decoder_depth, heads=decoder_heads,
                                mlp_width=4 * decoder_width, norm_eps=1e-6)
        self.decoder_embed = nn.Linear(c.width, decoder_width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_width))
        self.decoder_blocks = nn.ModuleList(Block(decoder) for _ in range(decoder_depth))
        self.decoder_norm = nn.LayerNorm(decoder_width, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_width, c.patch_size**2 * c.in_channels)
        nn.init.normal_(self.mask_token, std=0.02)
        self._positions: dict[tuple, torch.Tensor] = {}  # the decoder's sin-cos table per grid
        for module in [self.decoder_embed, self.decoder_pred, *self.decoder_blocks.modules()]:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)  # MAE's initialisation
                nn.init.zeros_(module.bias)

    def forward_encoder(self, pixels: torch.Tensor, ids_keep: torch.Tensor) -> torch.Tensor:
        """Encodes the visible patches only: `[B, prefix + K, D]` after the final norm."""
        return self.encoder(pixels, keep=ids_keep).tokens

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor,
                        grid: tuple[int, int]) -> torch.Tensor:
        """Predicts every patch's pixels from the visible latents.

        Args:
            latent: `[B, prefix + K, D]` from `forward_encoder`.
            ids_restore: `[B, N]` from `random_masking`.
            grid: the patch grid.

        Returns:
            `[B, N, P * P * C]`.
        """
        prefix = self.encoder.num_prefix_tokens
        x = self.decoder_embed(latent)  # (B, prefix + K, Dd)
        batch, patches, width = x.shape[0], ids_restore.shape[1], x.shape[-1]
        masked = self.mask_token.to(x.dtype).expand(batch, patches - (x.shape[1] - prefix), -1)
        tokens = torch.cat([x[:, prefix:], masked], dim=1)  # (B, N, Dd), visible first
        tokens = torch.gather(tokens, 1, ids_restore[..., None].expand(-1, -1, width))
        key = (tuple(grid), x.device, x.dtype)
        if key not in self._positions:  # fixed, so computed once per grid
            self._positions[key] = sincos_2d_pos_embed(grid, width).to(x.device, x.dtype)
        positions = self._positions[key]
        x = torch.cat([x[:, :prefix], tokens + positions], dim=1)  # prefix has position zero
        for block in self.decoder_blocks:
            x = block(x)[0]
        return self.decoder_pred(self.decoder_norm(x))[:, prefix:]

    def forward_loss(self, pixels: torch.Tensor, prediction: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error on the masked patches (on every patch when none is masked).

        Args:
            pixels: `[B, C, H, W]`, the encoder's input.
            prediction: `[B, N, P * P * C]`.
            mask: `[B, N]`, 1 for masked.
        """
        target = patchify(pixels, self.encoder.config.patch_size).float()
        if self.norm_pix_loss:  # MAE: per patch, unbiased variance, eps 1e-6
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        per_patch = ((prediction.float() - target) ** 2).mean(dim=-1)  # (B, N)
        if mask.sum() == 0:  # mask_ratio 0: a plain reconstruction loss
            return per_patch.mean()
        return (per_patch * mask).sum() / mask.sum()

    def forward(self, pixel_values: torch.Tensor, *, noise: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> ObjectiveOutput:
        """One step. `noise` `[B, N]` (or `generator`) makes the masks reproducible."""
        grid = self.encoder.patch_embed.grid(*pixel_values.shape[-2:])
        batch, patches = pixel_values.shape[0], grid[0] * grid[1]
        ids_keep, mask, ids_restore = random_masking(
            batch, patches, self.mask_ratio, noise=noise, generator=generator,
            device=pixel_values.device)
        latent = self.forward_encoder(pixel_values, ids_keep)
        prediction = self.forward_decoder(latent, ids_restore, grid)
        loss = self.forward_loss(pixel_values, prediction, mask)
        return ObjectiveOutput(loss=loss, metrics={"visible": float(ids_keep.shape[1])})
