"""The encoder's normalisation layer by name (`EncoderConfig.norm`): LayerNorm (the paper's)
or RMSNorm (`rms_norm.py`; Qwen2.5-VL's vision blocks)."""

from __future__ import annotations

from torch import nn

from vlm_vit.layers.rms_norm import RMSNorm

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": RMSNorm}


def build_norm(name: str, width: int, eps: float) -> nn.Module:
    """The norm named `name` over a last dimension of `width`, with `eps`.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in NORMS:
        raise ValueError(f"unknown norm {name!r}; known: {', '.join(NORMS)}")
    return NORMS[name](width, eps=eps)
