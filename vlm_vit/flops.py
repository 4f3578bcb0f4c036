"""What an encoder costs per image, computed from the config alone."""

from __future__ import annotations

from vlm_vit.config import EncoderConfig


def count_macs(config: EncoderConfig, image_size: tuple[int, int] | None = None) -> int:
    """Multiply-adds for one image (matrix products only; norms and softmax are ignored).

    Args:
        config: the architecture.
        image_size: (height, width); default the config's.
    """
    height, width = image_size or config.image_size
    p, d, m = config.patch_size, config.width, config.mlp_width
    if height % p or width % p:
        raise ValueError(f"image size {height}x{width} is not a multiple of patch size {p}")
    patches = (height // p) * (width // p)
    tokens = patches + config.num_prefix_tokens
    per_block = tokens * d * 3 * d + 2 * tokens * tokens * d + tokens * d * d + 2 * tokens * d * m
    return patches * config.in_channels * p * p * d + config.depth * per_block
