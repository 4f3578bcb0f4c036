"""Poolers of the class token or all patches: every patch token, the class token, the mean,
the class token through a linear map, and the summary tokens (the first prefix tokens)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.config import check_bool
from vlm_vit.poolers.base import check_count, no_weights_out_dim, register_pooler, split_tokens


@register_pooler("all")
class AllTokens(nn.Module):
    """Every patch token unchanged (LLaVA's selection), or with `keep_prefix` the prefix
    tokens before them (in a tower, one built with `keep_prefix=True` too, which hands them
    over)."""

    def __init__(self, in_dim: int, out_dim: int | None = None, keep_prefix: bool = False):
        super().__init__()
        self.in_dim = self.out_dim = no_weights_out_dim("all", in_dim, out_dim)
        self.keep_prefix = check_bool("keep_prefix", keep_prefix)

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        _, patches = split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        return tokens if self.keep_prefix else patches  # [B, (prefix +) N, D]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return grid[0] * grid[1] + (num_prefix_tokens if self.keep_prefix else 0)


@register_pooler("cls")
class ClassToken(nn.Module):
    """The class token, the paper's image representation (eq. 4)."""

    requires_class_token = True  # a tower checks its encoder has one and keeps the prefix

    def __init__(self, in_dim: int, out_dim: int | None = None):
        super().__init__()
        self.in_dim = self.out_dim = no_weights_out_dim("cls", in_dim, out_dim)

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        if num_prefix_tokens < 1:
            raise ValueError("the 'cls' pooler needs the class token at position 0, but these "
                             "tokens have no prefix tokens (a model without a class token, or "
                             "a tower with keep_prefix=False); use 'mean' or 'attention_pool'")
        return tokens[:, 0]  # [B, D]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> None:
        return None


@register_pooler("mean")
class MeanPatch(nn.Module):
    """The mean of the patch tokens (the paper's global-average-pooling ablation, App. D.3)."""

    def __init__(self, in_dim: int, out_dim: int | None = None):
        super().__init__()
        self.in_dim = self.out_dim = no_weights_out_dim("mean", in_dim, out_dim)

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        _, patches = split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        return patches.mean(dim=1)  # [B, D]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> None:
        return None


@register_pooler("cls_linear")
class ClassTokenLinear(nn.Module):
    """The class token through a Linear (CLIP's image projection, bias=False) and an optional
    activation (the paper's pre-logits layer: bias and tanh, Appendix B.1)."""

    requires_class_token = True

    def __init__(self, in_dim: int, out_dim: int | None = None, bias: bool = True,
                 act: str | None = None):
        super().__init__()
        if act not in (None, "tanh"):
            raise ValueError(f"act must be None or 'tanh', got {act!r}")
        self.in_dim, self.out_dim = in_dim, out_dim or in_dim
        self.proj = nn.Linear(in_dim, self.out_dim, bias=check_bool("bias", bias))
        self.act = nn.Tanh() if act == "tanh" else nn.Identity()

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        if num_prefix_tokens < 1:
            raise ValueError("the 'cls_linear' pooler needs the class token at position 0, but "
                             "these tokens have no prefix tokens")
        return self.act(self.proj(tokens[:, 0]))  # [B, out]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> None:
        return None


@register_pooler("summary")
class SummaryTokens(nn.Module):
    """The first `count` prefix tokens, `[B, count, D]`: RADIO's summary tokens, one class
    token per teacher it was distilled from (Ranzinger et al. 2024; timm keeps the first as
    its class token and the others as registers), in their order."""

    requires_class_token = True

    def __init__(self, in_dim: int, out_dim: int | None = None, count: int = 1):
        super().__init__()
        self.in_dim = self.out_dim = no_weights_out_dim("summary", in_dim, out_dim)
        self.count = check_count("count", count, 64)

    def forward(self, tokens, *, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        split_tokens(tokens, num_prefix_tokens, grid, self.in_dim)
        if num_prefix_tokens < self.count:
            raise ValueError(f"the 'summary' pooler reads {self.count} prefix tokens, but these "
                             f"tokens have {num_prefix_tokens} (class and register tokens)")
        return tokens[:, :self.count]  # [B, count, D]

    def num_output_tokens(self, grid, *, num_prefix_tokens: int = 0) -> int:
        return self.count
