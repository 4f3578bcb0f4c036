"""The projection head of DINO (Caron et al., "Emerging Properties in Self-Supervised Vision
Transformers", ICCV 2021) as DINOv2 builds it (Oquab et al., "DINOv2: Learning Robust Visual
Features without Supervision", TMLR 2024): an MLP to a bottleneck, L2 normalisation, and a
weight-normalised linear layer onto K prototypes.

Module names follow DINOv2's `DINOHead` (`mlp.{i}`, `last_layer`), so its checkpoints map by
renaming the old `weight_norm`'s `last_layer.weight_g` / `weight_v` to this one's
`last_layer.parametrizations.weight.original0` / `original1`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm


class DINOHead(nn.Module):
    """DINOv2's `DINOHead`: `last_layer(normalize(mlp(x)))`.

    The MLP has `layers` linear layers with GELU between them (no batch norm, as for a ViT),
    each initialised truncated-normal with std 0.02 and zero bias. The last layer is bias-free
    and weight-normalised (`w = g * v / ||v||` per prototype) with every magnitude g set to 1,
    so each logit is a cosine similarity between the bottleneck and a prototype.

    g stays trainable, as in DINOv2's `DINOHead` and lightly's `DINOv2ProjectionHead` (DINO v1
    froze it by default, `norm_last_layer=True`); to freeze it, call
    `head.last_layer.parametrizations.weight.original0.requires_grad_(False)`. DINOv2 also keeps
    the last layer's gradients off for the first epoch: `forward(x, freeze_prototypes=True)`.

    Args:
        in_dim: the encoder's width D.
        out_dim: K, the prototypes (65536, DINOv2's default config).
        hidden_dim: the MLP's width (2048).
        bottleneck_dim: the width before the last layer (256).
        layers: linear layers in the MLP, at least 1 (3).
    """

    def __init__(self, in_dim: int, out_dim: int = 65536, hidden_dim: int = 2048,
                 bottleneck_dim: int = 256, layers: int = 3) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"a DINO head needs at least 1 MLP layer, got {layers}")
        widths = [in_dim, *[hidden_dim] * (layers - 1), bottleneck_dim]
        modules: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            if index:
                modules.append(nn.GELU())
            modules.append(nn.Linear(width_in, width_out))
        self.mlp = nn.Sequential(*modules)
        for module in self.mlp:
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)  # cut at +-2, as DINOv2
                nn.init.zeros_(module.bias)
        # v keeps nn.Linear's default initialisation, as in DINOv2
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        with torch.no_grad():
            self.last_layer.parametrizations.weight.original0.fill_(1.0)  # g: (K, 1)

    def forward(self, x: torch.Tensor, freeze_prototypes: bool = False) -> torch.Tensor:
        """`[..., in_dim]` to the logits `[..., out_dim]`.

        Args:
            freeze_prototypes: the last layer gets zero gradients (DINOv2's
                `freeze_last_layer`, which sets them to None: with AdamW both leave the
                prototypes' directions where they are; zeros keep every parameter in the
                graph, as DDP needs).
        """
        x = self.mlp(x)
        eps = 1e-6 if x.dtype == torch.float16 else 1e-12  # 1e-12 underflows in float16
        x = F.normalize(x, dim=-1, p=2, eps=eps)
        if not freeze_prototypes:
            return self.last_layer(x)
        weight = self.last_layer.weight
        return F.linear(x, weight.detach() + weight * 0.0)
