"""Every registered pooler, built-in or plugin, honours the interface.

New poolers are tested here automatically: the parametrisation reads `available_poolers()`.
"""

import pytest
import torch

from vlm_vit import available_poolers, build_pooler
from vlm_vit.poolers import pool_packed

IN_DIM = 32
GRIDS = [(4, 4), (3, 5), (1, 2)]


def build(name):
    torch.manual_seed(0)
    try:
        return build_pooler(name, in_dim=IN_DIM, out_dim=48)
    except ValueError as error:
        if "has no weights" not in str(error):
            raise
        return build_pooler(name, in_dim=IN_DIM)  # out_dim must stay the input width


def fitted(pooler, grid):
    """`grid` scaled by the sides the pooler needs (`grid_multiple`: the patch merger's 2x2
    windows), so every pooler meets the same shapes of grid."""
    multiple = getattr(pooler, "grid_multiple", 1)
    return (grid[0] * multiple, grid[1] * multiple)


def tokens_for(grid, prefix, batch=3, requires_grad=False):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, prefix + grid[0] * grid[1], IN_DIM, generator=generator)
    return x.requires_grad_(requires_grad)


@pytest.mark.parametrize("name", available_poolers())
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1, 3])
def test_shape_matches_the_declared_count(name, grid, prefix):
    pooler = build(name).eval()
    if getattr(pooler, "requires_class_token", False) and prefix == 0:
        pytest.skip("needs a class token")
    grid = fitted(pooler, grid)
    out = pooler(tokens_for(grid, prefix), num_prefix_tokens=prefix, grid=grid)
    count = pooler.num_output_tokens(grid, num_prefix_tokens=prefix)
    out_dim = pooler.out_dim
    expected = (3, out_dim) if count is None else (3, count, out_dim)
    assert tuple(out.shape) == expected


@pytest.mark.parametrize("name", available_poolers())
def test_samples_do_not_depend_on_the_batch(name):
    pooler = build(name).eval()
    grid = fitted(pooler, (3, 5))
    x = tokens_for(grid, 1)
    with torch.no_grad():
        together = pooler(x, num_prefix_tokens=1, grid=grid)
        alone = pooler(x[:1], num_prefix_tokens=1, grid=grid)
        changed = x.clone()
        changed[1:] = torch.randn_like(changed[1:])
        others_changed = pooler(changed, num_prefix_tokens=1, grid=grid)
    torch.testing.assert_close(alone[0], together[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(others_changed[0], together[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", available_poolers())
def test_gradients_reach_parameters_and_tokens(name):
    pooler = build(name).train()
    grid = fitted(pooler, (4, 4))
    x = tokens_for(grid, 1, requires_grad=True)
    pooler(x, num_prefix_tokens=1, grid=grid).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for param_name, param in pooler.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, param_name


@pytest.mark.parametrize("name", available_poolers())
def test_runs_under_bf16_autocast(name):
    pooler = build(name).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        grid = fitted(pooler, (3, 5))
        out = pooler(tokens_for(grid, 1), num_prefix_tokens=1, grid=grid)
    assert torch.isfinite(out.float()).all()
    assert out.shape[-1] == pooler.out_dim


@pytest.mark.parametrize("name", available_poolers())
def test_wrong_token_count_is_refused(name):
    pooler = build(name)
    with pytest.raises(ValueError, match=r"4x5|\(4, 5\)"):  # the message names the grid
        pooler(tokens_for((4, 4), 1), num_prefix_tokens=1, grid=(4, 5))


@pytest.mark.parametrize("name", available_poolers())
@pytest.mark.parametrize("prefix", [0, 1])
def test_packed_tokens_pool_as_each_image_alone(name, prefix):
    pooler = build(name).eval()
    if getattr(pooler, "requires_class_token", False) and prefix == 0:
        pytest.skip("needs a class token")
    grids = [fitted(pooler, grid) for grid in [(4, 4), (3, 5), (1, 2), (2, 1)]]
    images = [tokens_for(grid, prefix, batch=1) for grid in grids]
    packed = torch.cat([image[0] for image in images])  # [total, D]
    with torch.no_grad():
        pooled = pool_packed(pooler, packed, lengths=[image.shape[1] for image in images],
                             grids=grids, num_prefix_tokens=prefix)
        assert len(pooled) == len(grids)
        for image, grid, out in zip(images, grids, pooled, strict=True):
            alone = pooler(image, num_prefix_tokens=prefix, grid=grid)[0]
            torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
            count = pooler.num_output_tokens(grid, num_prefix_tokens=prefix)
            assert out.shape == ((pooler.out_dim,) if count is None else (count, pooler.out_dim))


def test_packed_lengths_that_do_not_fit_the_grids_are_refused():
    pooler = build("mean")
    with pytest.raises(ValueError, match="image 1: 5 tokens do not fit 1 prefix tokens and a 2x3"):
        pool_packed(pooler, torch.zeros(10, IN_DIM), lengths=[5, 5], grids=[(2, 2), (2, 3)],
                    num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"packed tokens must be \[10, D\]"):
        pool_packed(pooler, torch.zeros(9, IN_DIM), lengths=[5, 5], grids=[(2, 2), (2, 2)],
                    num_prefix_tokens=1)
