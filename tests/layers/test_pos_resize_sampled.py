"""GLM-4V's position-table read (`pos_resize_mode="bicubic_grid_sample"`): `grid_sample`
bicubically at each patch centre, equal to transformers' `Glm4vVisionEmbeddings` to rounding
where `F.interpolate`'s bicubic (the same function) is not; sampled on the table's own grid
too; the encoder reads its table with it per grid and once in `resize_image`."""

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.config import ConfigError
from vlm_vit.layers.pos_embed import resample_pos_embed
from vlm_vit.layers.pos_resize_sampled import resize_position_table, sample_position_table

SIDE, WIDTH = 24, 16  # GLM-4.1V's table: 336 / 14 = 24 a side
GRIDS = [(24, 24), (10, 76), (100, 30), (2, 2)]  # its own, both ways, stretched, shrunk


def table(prefix=0, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, prefix + SIDE * SIDE, WIDTH, generator=generator) * scale


def transformers_read(weights, grid):
    """`Glm4vVisionEmbeddings` itself on zero embeddings: the positions it adds, `[N, D]` in
    merge-window order (2x2 windows; every grid here has even sides)."""
    glm4v = pytest.importorskip("transformers.models.glm4v.modeling_glm4v")
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.vision_utils import get_vision_position_ids

    embeddings = glm4v.Glm4vVisionEmbeddings(Glm4vVisionConfig(
        hidden_size=WIDTH, image_size=SIDE * 14, patch_size=14))
    with torch.no_grad():
        embeddings.position_embedding.weight.copy_(weights[0])
    grid_thw = torch.tensor([[1, *grid]])
    positions = get_vision_position_ids(grid_thw, 2)
    count = grid[0] * grid[1]
    with torch.no_grad():
        return embeddings(torch.zeros(count, WIDTH), [count], grid_thw, positions[:, 0],
                          positions[:, 1])


def window_order(grid):
    from vlm_vit.layers.rope_2d import merge_window_order

    return merge_window_order(grid, 2)


@pytest.mark.parametrize("grid", GRIDS)
def test_equals_transformers_glm4v_embeddings(grid):
    expected = transformers_read(table(), grid)
    ours = sample_position_table(table(), (SIDE, SIDE), grid)[0, window_order(grid)]
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)  # the same arithmetic


def test_interpolate_bicubic_is_the_same_function_but_not_within_1e_5():
    """Why the mode exists: on a table of scale 3, `F.interpolate` strays past 1e-5."""
    grid = (100, 30)
    expected = transformers_read(table(), grid)
    interpolated = resample_pos_embed(table(), (SIDE, SIDE), grid, mode="bicubic",
                                      antialias=False)[0, window_order(grid)]
    torch.testing.assert_close(interpolated, expected, atol=1e-3, rtol=0)
    assert (interpolated - expected).abs().max() > 1e-5


def test_the_own_grid_is_sampled_and_the_prefix_stays():
    original = table(prefix=1)
    read = sample_position_table(original, (SIDE, SIDE), (SIDE, SIDE), num_prefix_tokens=1)
    assert torch.equal(read[:, :1], original[:, :1])
    torch.testing.assert_close(read, original, atol=1e-4, rtol=0)  # near, as transformers'
    assert not torch.equal(read, original)  # but not the identity, which transformers is not
    assert read.shape == original.shape and read.dtype == original.dtype


def test_other_modes_resize_as_before():
    resized = resize_position_table(table(), (SIDE, SIDE), (10, 76), mode="bicubic",
                                    antialias=True)
    assert torch.equal(resized, resample_pos_embed(table(), (SIDE, SIDE), (10, 76)))


def test_a_table_that_does_not_fit_the_grid_is_refused():
    with pytest.raises(ValueError, match=r"does not fit grid \(5, 5\)"):
        sample_position_table(table(), (5, 5), (2, 2))


def test_the_encoder_reads_its_table_with_it():
    config = EncoderConfig(image_size=16, patch_size=4, width=16, depth=1, heads=2,
                           mlp_width=32, class_token=False, pos_resize_mode="bicubic_grid_sample")
    encoder = VisionEncoder(config).eval()
    table_for = encoder.position_table((6, 10))
    torch.testing.assert_close(table_for, sample_position_table(encoder.pos_embed, (4, 4),
                                                                (6, 10)), atol=0, rtol=0)
    expected = sample_position_table(encoder.pos_embed.detach(), (4, 4), (6, 6))
    encoder.resize_image(24)
    torch.testing.assert_close(encoder.pos_embed.detach(), expected, atol=0, rtol=0)


def test_the_mode_is_validated_by_name():
    with pytest.raises(ConfigError, match="pos_resize_mode 'bicubic_gridsample' is not one of"):
        EncoderConfig(pos_resize_mode="bicubic_gridsample")
