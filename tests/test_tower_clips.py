"""A tuple's length never changes its meaning (issue 41): `num_image_tokens` takes
(height, width) and a clip's frame count in `frames=`; a 3-tuple is refused, not read as a
clip."""

from __future__ import annotations

import pytest
import torch

from vlm_vit import VisionEncoder, VisionTower, build_pooler

from .conftest import tiny_config


def tower(temporal: int | None = None) -> VisionTower:
    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config(temporal_patch_size=temporal)).eval()
    return VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=32, out_dim=16)).eval()


@pytest.mark.parametrize("temporal", [None, 2])
def test_a_three_tuple_is_refused_not_read_as_a_clip(temporal):
    """(3, 32, 32) looks like an RGB image's shape: on a tower with temporal patches it used
    to count a 3-frame clip (twice an image's tokens)."""
    with pytest.raises(ValueError, match=r"image_size \(3, 32, 32\) is not \(height, width\).*"
                                         r"frames="):
        tower(temporal).num_image_tokens((3, 32, 32))


@pytest.mark.parametrize("frames, slices", [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)])
def test_frames_counts_a_clip_as_the_tower_encodes_it(frames, slices):
    model = tower(2)
    image = model.num_image_tokens((32, 24))
    assert image == model.num_image_tokens((32, 24), frames=1) == 12
    assert model.num_image_tokens((32, 24), frames=frames) == slices * image
    clip = torch.randn(frames, 3, 32, 24, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        assert len(model([clip])[0]) == slices * image


@pytest.mark.parametrize("frames", [0, -1, 1.5, "3", True])
def test_frames_must_be_a_positive_count(frames):
    with pytest.raises(ValueError, match="needs a positive frame count"):
        tower(2).num_image_tokens((32, 32), frames=frames)


def test_a_tower_without_temporal_patches_takes_no_clip():
    model = tower()
    assert model.num_image_tokens(32, frames=1) == model.num_image_tokens() == 16
    with pytest.raises(ValueError, match="a clip of 2 frames needs .*temporal patches"):
        model.num_image_tokens((32, 32), frames=2)
