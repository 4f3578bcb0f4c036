"""I-JEPA's predictor: a narrow ViT over the context encoder's tokens and one mask token per
target patch, which predicts the target encoder's features there (Assran et al. 2023,
section 3, "Predictor"; the official `VisionTransformerPredictor`).

Each target block is predicted in a sequence of its own: the context tokens, embedded to the
predictor's width and given their positions, then the target block's mask tokens with
theirs, through the blocks and the norm; the mask tokens' outputs are projected back to the
encoder's width. Positions are the fixed 2D sin-cos table of each image's own grid.

`forward` takes a stacked batch (every context and every target block of one length, the
official layout); `forward_packed` takes one image's masks each, of any grid and length,
and runs all the (image, target block) sequences as one packed call whose attention stays
inside each sequence.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.layers import sincos_2d_pos_embed
from vlm_vit.layers.varlen import Segments
from vlm_vit.model import Block


class JEPAPredictor(nn.Module):
    """The predictor (see the module docstring).

    Args:
        encoder_width: the context and target encoders' width.
        width: the predictor's width (I-JEPA: 384).
        depth: its blocks (I-JEPA: 6 by default in code; 12 for ViT-H/14).
        heads: its attention heads (I-JEPA: the encoder's).
        patch_size, image_size: the encoder's, for the blocks' config.
    """

    def __init__(self, encoder_width: int, *, width: int = 384, depth: int = 6,
                 heads: int = 12, patch_size: int = 16,
                 image_size: int | tuple[int, int] = 224) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"predictor width {width} is not divisible by its {heads} heads")
        if width % 4:
            raise ValueError(f"predictor width {width} must be divisible by 4 (its 2D sin-cos "
                             "positions)")
        config = EncoderConfig(image_size=image_size, patch_size=patch_size, width=width,
                               depth=depth, heads=heads, mlp_width=4 * width, norm_eps=1e-6)
        self.width = width
        self.embed = nn.Linear(encoder_width, width)
        self.mask_token = nn.Parameter(torch.zeros(width))
        self.blocks = nn.ModuleList(Block(config) for _ in range(depth))
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.proj = nn.Linear(width, encoder_width)
        self._positions: dict[tuple, torch.Tensor] = {}  # the sin-cos table per grid
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The official initialisation: truncated normal (std 0.02) Linears and mask token,
        zero biases, unit LayerNorms, then block l's output projections divided by
        sqrt(2 l) (`fix_init_weight`)."""
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        with torch.no_grad():
            for layer, block in enumerate(self.blocks, start=1):
                block.attn.proj.weight.div_(math.sqrt(2.0 * layer))
                block.mlp.fc2.weight.div_(math.sqrt(2.0 * layer))

    def positions(self, grid: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """The fixed `[rows * cols, width]` sin-cos table of `grid` (cached)."""
        key = (tuple(grid), like.device, like.dtype)
        if key not in self._positions:
            self._positions[key] = sincos_2d_pos_embed(grid, self.width).to(like.device,
                                                                             like.dtype)
        return self._positions[key]

    def forward(self, context: torch.Tensor, context_index: torch.Tensor,
                targets: list[torch.Tensor], grid: tuple[int, int]) -> torch.Tensor:
        """Predictions for a stacked batch.

        Args:
            context: `[B, K_c, D]`, the context encoder's patch tokens (no prefix).
            context_index: `[B, K_c]`, their patch indices on `grid`.
            targets: one `[B, K_t]` index tensor per target block.
            grid: the images' patch grid.

        Returns:
            `[len(targets) * B, K_t, D]`, target block-major (block j of image b at row
            `j * B + b`), as the official predictor orders them.
        """
        table = self.positions(grid, context)
        x = self.embed(context) + table[context_index]
        queries = self.mask_token.to(x.dtype) + table[torch.cat(targets)]  # (n B, K_t, W)
        x = torch.cat([x.repeat(len(targets), 1, 1), queries], dim=1)
        for block in self.blocks:
            x = block(x)[0]
        return self.proj(self.norm(x[:, context.shape[1]:]))

    def forward_packed(self, context: list[torch.Tensor], context_index: list[torch.Tensor],
                       targets: list[list[torch.Tensor]],
                       grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Predictions for images of any grids and mask lengths, in one packed call.

        Args:
            context: per image, `[K_c, D]`.
            context_index: per image, `[K_c]` indices on its grid.
            targets: per image, one `[K_t]` index tensor per target block.
            grids: per image, its patch grid.

        Returns:
            Per image, one `[K_t, D]` prediction per target block.
        """
        sequences, lengths, spans = [], [], []
        for tokens, index, blocks, grid in zip(context, context_index, targets, grids,
                                               strict=True):
            table = self.positions(grid, tokens)
            embedded = self.embed(tokens) + table[index]
            for block in blocks:
                queries = self.mask_token.to(embedded.dtype) + table[block]
                sequences += [embedded, queries]
                spans.append((sum(lengths) + len(embedded), len(block)))
                lengths.append(len(embedded) + len(block))
        x = torch.cat(sequences)[None]  # (1, total, W)
        segments = Segments(tuple(lengths))
        for block in self.blocks:
            x = block(x, segments=segments)[0]
        x = self.proj(self.norm(x[0]))
        predictions = [x[start:start + length] for start, length in spans]
        out, at = [], 0
        for blocks in targets:
            out.append(predictions[at:at + len(blocks)])
            at += len(blocks)
        return out


def lightly_state_dict(predictor: JEPAPredictor) -> dict[str, torch.Tensor]:
    """`predictor`'s weights under lightly's `IJEPAPredictorTIMM` names (the same blocks as
    timm's; its positions, a buffer-like parameter, are left to lightly's own table)."""
    state = {}
    for name, value in predictor.state_dict().items():
        if name.startswith("embed."):
            state["predictor_embed." + name.removeprefix("embed.")] = value
        elif name.startswith("proj."):
            state["predictor_proj." + name.removeprefix("proj.")] = value
        elif name == "mask_token":
            state["decoder.mask_token"] = value.reshape(1, 1, -1)
        else:
            state["decoder." + name] = value
    return state
