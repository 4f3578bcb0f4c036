"""The paper's hybrid patch embedding (Dosovitskiy et al. 2021, section 3.1 "Hybrid
Architecture"; R50+ViT-B/16 of Table 1 and timm's `vit_base_r50_s16_384`): a ResNet's feature
map takes the place of the image patches, each feature-map cell one token ("patch size" 1 on
the features), projected to D by a 1x1 convolution.

The ResNet is the one of the paper's BiT baselines (Kolesnikov et al. 2020): ResNet-v2 layout
with group normalisation (32 groups) and weight-standardised convolutions, TensorFlow "SAME"
padding, and, as the paper says, a third stage of 9 blocks instead of 6 in place of the fourth
(layers 3, 4, 9): stride 16 overall, so a 224 x 224 image gives a 14 x 14 grid and 384 x 384 a
24 x 24 grid. The blocks are post-activation bottlenecks (timm's `Bottleneck`, `preact=False`),
as in the released hybrid checkpoints.

Parameter names follow timm (`backbone.stem.conv`, `backbone.stem.norm`,
`backbone.stages.S.blocks.B.{conv1,norm1,conv2,norm2,conv3,norm3,downsample.conv,
downsample.norm}`, `proj`), so timm's `patch_embed.*` weights load without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow "SAME" padding of one side: the output has ceil(size / stride) cells, the
    extra pixel (if the total is odd) goes after, not before."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def same_padding_divisible(kernel: int, stride: int) -> tuple[int, int, int, int]:
    """`F.pad`'s (left, right, top, bottom) for "SAME" on a side divisible by the stride,
    where the total, kernel - stride, does not depend on the size: fixed at construction, so
    `forward` takes no Python integers from tensor shapes (`torch.export`). The hybrid's
    input sides are multiples of its overall stride, so every layer's input is divisible by
    its own stride."""
    before, after = same_padding(stride, kernel, stride)
    return before, after, before, after


class WeightStandardizedConv2d(nn.Conv2d):
    """A bias-free Conv2d whose kernel is standardised per output channel before use
    (Qiao et al. 2019): (W - mean) / sqrt(var + eps), mean and biased variance over the
    channel's inputs and taps; "SAME" padding for inputs whose sides the stride divides.

    Args:
        in_channels, out_channels, kernel_size, stride: as `nn.Conv2d` (square kernels).
        eps: 1e-8 in the hybrid checkpoints (timm passes it; BiT's own is 1e-10).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int = 1, eps: float = 1e-8) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, bias=False)
        self.eps = eps
        self.same_pad = same_padding_divisible(kernel_size, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        variance, mean = torch.var_mean(weight, dim=(1, 2, 3), correction=0, keepdim=True)
        weight = (weight - mean) * torch.rsqrt(variance + self.eps)
        return F.conv2d(F.pad(x, self.same_pad), weight, None, self.stride)


def group_norm(channels: int) -> nn.GroupNorm:
    """BiT's normalisation: 32 groups, eps 1e-5, affine."""
    return nn.GroupNorm(32, channels, eps=1e-5)


class Downsample(nn.Module):
    """The projection shortcut of a stage's first block: 1x1 conv (strided), group norm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv = WeightStandardizedConv2d(in_channels, out_channels, 1, stride=stride)
        self.norm = group_norm(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, each followed by group norm; ReLU after the
    first two and after the residual sum (post-activation)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        mid = out_channels // 4
        needs_projection = stride != 1 or in_channels != out_channels
        self.downsample = Downsample(in_channels, out_channels, stride) \
            if needs_projection else None
        self.conv1 = WeightStandardizedConv2d(in_channels, mid, 1)
        self.norm1 = group_norm(mid)
        self.conv2 = WeightStandardizedConv2d(mid, mid, 3, stride=stride)
        self.norm2 = group_norm(mid)
        self.conv3 = WeightStandardizedConv2d(mid, out_channels, 1)
        self.norm3 = group_norm(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        return F.relu(self.norm3(self.conv3(x)) + shortcut)


class Stage(nn.Module):
    """`depth` bottlenecks; the first changes the width and applies the stride."""

    def __init__(self, in_channels: int, out_channels: int, depth: int, stride: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(
            Bottleneck(in_channels if i == 0 else out_channels, out_channels,
                       stride if i == 0 else 1)
            for i in range(depth)
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Stem(nn.Module):
    """7x7 conv stride 2, group norm, ReLU, 3x3 max pool stride 2 ("SAME", padded with -inf)."""

    def __init__(self, in_channels: int, width: int) -> None:
        super().__init__()
        self.conv = WeightStandardizedConv2d(in_channels, width, 7, stride=2)
        self.norm = group_norm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))
        x = F.pad(x, same_padding_divisible(3, 2), value=-math.inf)
        return F.max_pool2d(x, 3, stride=2)


class ResNetV2Backbone(nn.Module):
    """Stem and stages: `[B, C, H, W]` to `[B, 256 * 2^(S-1), H / stride, W / stride]`.

    Args:
        layers: blocks per stage (3, 4, 9 for R50+ViT-B/16; 3, 4, 6, 3 for a whole R50).
        in_channels: C.
        stem_width: the stem's output channels (64).
    """

    def __init__(self, layers: tuple[int, ...] = (3, 4, 9), in_channels: int = 3,
                 stem_width: int = 64) -> None:
        super().__init__()
        self.stem = Stem(in_channels, stem_width)
        stages, channels = [], stem_width
        for index, depth in enumerate(layers):
            out_channels = 256 * 2**index
            stages.append(Stage(channels, out_channels, depth, stride=1 if index == 0 else 2))
            channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.out_channels = channels
        self.stride = 4 * 2 ** (len(layers) - 1)  # stem 4, then 2 per stage after the first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


class HybridPatchEmbed(nn.Module):
    """The hybrid's patch embedding: ResNet features, a 1x1 projection to D, one token per
    feature-map cell. Same contract as `PatchEmbed` (`patch_size` is the backbone's stride).

    Args:
        width: D.
        layers: blocks per ResNet stage (3, 4, 9: stride 16).
        in_channels: C.
        stem_width: the stem's output channels.
        bias: whether the projection has a bias (timm's and Google's have one).

    Raises:
        ValueError: for an empty `layers` (timm's stem-only variant is not offered) or a
            stem width the 32 groups do not divide.
    """

    def __init__(self, width: int, layers: tuple[int, ...] = (3, 4, 9), in_channels: int = 3,
                 stem_width: int = 64, bias: bool = True) -> None:
        super().__init__()
        if not layers or min(layers) < 1:
            raise ValueError(f"the hybrid's ResNet needs at least one stage of at least one "
                             f"block, got layers {tuple(layers)}")
        if stem_width % 32:
            raise ValueError(f"stem width {stem_width} is not divisible by group norm's 32 "
                             "groups")
        self.backbone = ResNetV2Backbone(tuple(layers), in_channels, stem_width)
        self.proj = nn.Conv2d(self.backbone.out_channels, width, 1, bias=bias)
        self.patch_size = self.backbone.stride
        self.in_channels = in_channels

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The token grid (rows, cols): the image over the backbone's stride, which must
        divide it (as the patch size does for `PatchEmbed`)."""
        stride = self.patch_size
        if height % stride or width % stride or height <= 0 or width <= 0:
            raise ValueError(f"image size {height}x{width} is not a positive multiple of the "
                             f"hybrid backbone's stride {stride}")
        return height // stride, width // stride

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Embeds `[B, C, H, W]` as `[B, N, D]`, row-major over the grid, and the grid."""
        if pixel_values.ndim != 4 or pixel_values.shape[1] != self.in_channels:
            raise ValueError(f"pixel_values must be [B, {self.in_channels}, H, W], "
                             f"got shape {list(pixel_values.shape)}")
        grid = self.grid(pixel_values.shape[2], pixel_values.shape[3])
        features = self.backbone(pixel_values.to(self.proj.weight.dtype))  # (B, 1024, rows, cols)
        return self.proj(features).flatten(2).transpose(1, 2), grid
