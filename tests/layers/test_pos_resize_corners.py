"""Qwen3-VL's position-table resize (`pos_resize_mode="bilinear_corners"`): bilinear with the
corners aligned, equal to transformers' gather of taps and weights, the table's corners on
the grid's corners; the encoder resizes with it per grid and once in `resize_image`."""

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.config import ConfigError
from vlm_vit.layers.pos_embed import resample_pos_embed
from vlm_vit.layers.pos_resize_corners import resample_position_table

SIDE, WIDTH = 5, 8
GRIDS = [(2, 2), (3, 7), (8, 4), (10, 10)]  # shrunk, both, stretched


def table(prefix=0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, prefix + SIDE * SIDE, WIDTH, generator=generator)


@pytest.mark.parametrize("grid", GRIDS)
def test_equals_transformers_taps_and_weights(grid):
    vision_utils = pytest.importorskip("transformers.vision_utils")
    weights_of = vision_utils.get_vision_interpolation_indices_and_weights
    indices, weights = weights_of(torch.tensor([[1, *grid]]), SIDE, mode="bilinear",
                                  align_corners=True)
    rows = table()[0]
    expected = (rows[indices] * weights[:, :, None]).sum(1)  # (N, D), row-major
    resized = resample_position_table(table(), (SIDE, SIDE), grid, mode="bilinear_corners",
                                      antialias=False)
    torch.testing.assert_close(resized[0], expected, atol=1e-6, rtol=1e-6)


def test_the_corners_land_on_the_corners_and_the_prefix_stays():
    original = table(prefix=1)
    resized = resample_position_table(original, (SIDE, SIDE), (3, 7), num_prefix_tokens=1,
                                      mode="bilinear_corners", antialias=False)
    grid = resized[0, 1:].reshape(3, 7, WIDTH)
    source = original[0, 1:].reshape(SIDE, SIDE, WIDTH)
    for corner in ((0, 0), (0, -1), (-1, 0), (-1, -1)):
        torch.testing.assert_close(grid[corner], source[corner], atol=1e-6, rtol=0)
    assert torch.equal(resized[:, :1], original[:, :1])
    assert resample_position_table(original, (SIDE, SIDE), (SIDE, SIDE), 1,
                                   "bilinear_corners") is original


def test_other_modes_are_resample_pos_embeds():
    for mode, antialias in (("bicubic", True), ("bilinear", False)):
        torch.testing.assert_close(
            resample_position_table(table(), (SIDE, SIDE), (3, 7), 0, mode, antialias),
            resample_pos_embed(table(), (SIDE, SIDE), (3, 7), 0, mode, antialias))


def test_the_encoder_resizes_with_it():
    config = EncoderConfig(image_size=SIDE * 4, patch_size=4, width=WIDTH, depth=1, heads=2,
                           mlp_width=16, class_token=False, pos_resize_mode="bilinear_corners",
                           pos_resize_antialias=False)
    encoder = VisionEncoder(config)
    with torch.no_grad():
        expected = resample_position_table(encoder.pos_embed, (SIDE, SIDE), (3, 7),
                                           mode="bilinear_corners", antialias=False)
        torch.testing.assert_close(encoder.position_table((3, 7)), expected)
        encoder.resize_image((12, 28))
    torch.testing.assert_close(encoder.pos_embed.data, expected)


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ConfigError, match="pos_resize_mode 'bilinear_corner' is not one of "
                                          "bicubic, bilinear, bilinear_corners"):
        EncoderConfig(pos_resize_mode="bilinear_corner")
