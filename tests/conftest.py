"""Shared fixtures. Tests run offline: no model hub is ever contacted."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vlm_vit import EncoderConfig, VisionEncoder  # noqa: E402

TINY = dict(image_size=(32, 32), patch_size=8, width=32, depth=3, heads=4, mlp_width=64)


def tiny_config(**overrides) -> EncoderConfig:
    """A 3-block, width-32 encoder on 32 x 32 images: fast enough for any test."""
    return EncoderConfig(**{**TINY, **overrides})


@pytest.fixture
def tiny_encoder() -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(tiny_config()).eval()
