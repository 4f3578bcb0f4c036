"""Encoder configuration and the table of named variants.

Sizes come from Dosovitskiy et al. 2021, Table 1 (Base, Large, Huge), from Touvron et al.
2021 (DeiT: Tiny, Small, the sizes timm and big_vision use) and from Radford et al. 2021
(CLIP's image towers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vlm_vit.registry import unknown_name_error

ACTIVATIONS = ("gelu", "quick_gelu", "gelu_tanh")
POS_RESIZE_MODES = ("bicubic", "bilinear")


def _as_pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise ValueError(f"{name} must be an int or a (height, width) pair of ints, got {value!r}")


@dataclass
class EncoderConfig:
    """Every architecture fact a ViT checkpoint family needs.

    The defaults are ViT-B/16 at 224 x 224 as in the paper.
    """

    image_size: tuple[int, int] = (224, 224)  # (height, width) the position table was trained at
    patch_size: int = 16
    width: int = 768  # D, the token width
    depth: int = 12  # L, the number of blocks
    heads: int = 12
    mlp_width: int = 3072
    in_channels: int = 3
    class_token: bool = True
    num_register_tokens: int = 0  # extra learned prefix tokens without position (Darcet et al.)
    pre_norm: bool = False  # a LayerNorm before the first block (CLIP's ln_pre)
    final_norm: bool = True  # the LayerNorm after the last block (ViT's norm, CLIP's ln_post)
    act: str = "gelu"  # gelu (exact erf), quick_gelu (OpenAI CLIP), gelu_tanh (the JAX code)
    norm_eps: float = 1e-6  # 1e-6 in the paper's code and timm, 1e-5 in CLIP
    qkv_bias: bool = True
    patch_bias: bool = True  # CLIP's patch convolution has no bias
    # How the learned position table is resized to another grid (paper section 3.2).
    # bicubic with antialias matches timm and open_clip; Hugging Face uses bicubic without
    # antialias; the JAX code uses bilinear.
    pos_resize_mode: str = "bicubic"
    pos_resize_antialias: bool = True

    def __post_init__(self) -> None:
        self.image_size = _as_pair(self.image_size, "image_size")
        for name in ("patch_size", "width", "depth", "heads", "mlp_width", "in_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_register_tokens < 0:
            raise ValueError(f"num_register_tokens must be >= 0, got {self.num_register_tokens}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"act {self.act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.pos_resize_mode not in POS_RESIZE_MODES:
            raise ValueError(
                f"pos_resize_mode {self.pos_resize_mode!r} is not one of "
                f"{', '.join(POS_RESIZE_MODES)}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        height, width = self.image_size
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"image_size {height}x{width} is not a multiple of patch size {self.patch_size}"
            )

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid (rows, cols) at `image_size`."""
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    @property
    def num_prefix_tokens(self) -> int:
        """Class token plus register tokens, placed before the patch tokens."""
        return int(self.class_token) + self.num_register_tokens

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> EncoderConfig:
        """The config of a named variant, e.g. ``"vit-b/16"`` or ``"clip-vit-l/14-336"``.

        Args:
            name: a name from `available_variants()`.
            **overrides: any field to change, e.g. ``image_size=(384, 384)``.

        Raises:
            UnknownNameError: (a KeyError) for an unknown name, listing the close matches.
        """
        key = name.lower()
        if key not in VARIANTS:
            raise unknown_name_error("variant", name, VARIANTS)
        return cls(**{**VARIANTS[key], **overrides})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["image_size"] = list(self.image_size)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        """Builds a config from `to_dict()` output; unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown EncoderConfig fields: {', '.join(unknown)}")
        return cls(**data)


def _vit(width: int, depth: int, heads: int, mlp_width: int, patch: int, **extra: Any) -> dict:
    return dict(width=width, depth=depth, heads=heads, mlp_width=mlp_width, patch_size=patch,
                **extra)


# CLIP towers: a LayerNorm before the blocks, QuickGELU, eps 1e-5, no bias in the patch conv.
_CLIP = dict(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False)

VARIANTS: dict[str, dict[str, Any]] = {
    # DeiT sizes (Touvron et al. 2021), used by timm and big_vision.
    "vit-ti/16": _vit(192, 12, 3, 768, 16),
    "vit-s/16": _vit(384, 12, 6, 1536, 16),
    # Paper, Table 1.
    "vit-b/16": _vit(768, 12, 12, 3072, 16),
    "vit-b/32": _vit(768, 12, 12, 3072, 32),
    "vit-l/14": _vit(1024, 24, 16, 4096, 14),
    "vit-l/16": _vit(1024, 24, 16, 4096, 16),
    "vit-l/32": _vit(1024, 24, 16, 4096, 32),
    "vit-h/14": _vit(1280, 32, 16, 5120, 14),
    # CLIP (Radford et al. 2021) image towers.
    "clip-vit-b/32": _vit(768, 12, 12, 3072, 32, **_CLIP),
    "clip-vit-b/16": _vit(768, 12, 12, 3072, 16, **_CLIP),
    "clip-vit-l/14": _vit(1024, 24, 16, 4096, 14, **_CLIP),
    "clip-vit-l/14-336": _vit(1024, 24, 16, 4096, 14, image_size=(336, 336), **_CLIP),
}


def available_variants() -> list[str]:
    """Names accepted by `EncoderConfig.from_name`."""
    return list(VARIANTS)
