"""Perception Encoder's RoPE positions (`rope_positions="one_based"`): the patch indices plus 1,
scaled to the reference grid, exactly timm's `_build_grid(grid_offset=1.)` at every grid; the
encoder builds them only from a config that asks, which refuses them without RoPE."""

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.config import ConfigError
from vlm_vit.layers.rope_2d import Rope2D
from vlm_vit.layers.rope_one_based import OneBasedRope2D, build_rope

pos_embed_sincos = pytest.importorskip("timm.layers.pos_embed_sincos")


@pytest.mark.parametrize("reference", [None, (24, 24), (14, 32)])
@pytest.mark.parametrize("grid", [(4, 4), (6, 3), (1, 7)])
def test_positions_are_timms_grid_counted_from_one(grid, reference):
    ours = OneBasedRope2D(8, reference_grid=reference).positions(grid)
    theirs = pos_embed_sincos._build_grid(list(grid), ref_feat_shape=reference,
                                          grid_offset=1.0)  # (rows, cols, 2): row, col
    assert torch.equal(ours, theirs.reshape(-1, 2))


def test_they_are_the_index_positions_shifted_by_one_and_turn_the_prefix_not_at_all():
    grid = (3, 5)
    shifted = OneBasedRope2D(8).positions(grid)
    assert torch.equal(shifted, Rope2D(8).positions(grid).float() + 1)
    cos, sin = OneBasedRope2D(8).for_grids([grid], num_prefix_tokens=1)
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    assert not torch.equal(cos[1], torch.ones(8))  # patch (0, 0) sits at (1, 1)


def test_the_encoder_builds_them_only_when_asked():
    assert type(build_rope(8, 100.0, positions="index")) is Rope2D
    assert build_rope(8, None, positions="one_based") is None
    config = EncoderConfig(image_size=16, patch_size=8, width=32, depth=1, heads=4,
                           mlp_width=64, rope_theta=100.0, rope_positions="one_based")
    rope = VisionEncoder(config).rope
    assert isinstance(rope, OneBasedRope2D) and "positions=one_based" in repr(rope)
    with pytest.raises(ConfigError, match="rope_positions 'one_based' .*needs rope_theta"):
        EncoderConfig(rope_positions="one_based")
