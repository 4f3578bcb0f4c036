"""Block-wise masks: bounds, counts, reproducibility, and lightly's statistics."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_vit.pretrain.block_masking import batch_block_masks, block_mask

lightly_utils = pytest.importorskip("lightly.models.utils")


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


@settings(max_examples=60, deadline=None)
@given(height=st.integers(1, 24), width=st.integers(1, 24), share=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_a_mask_fits_its_grid_and_never_exceeds_the_count(height, width, share, seed):
    num_masked = int(height * width * share)
    mask = block_mask((height, width), num_masked, seeded(seed))
    assert mask.shape == (height, width) and mask.dtype == torch.bool
    assert mask.sum() <= num_masked
    if height == 1 or width == 1:  # every block must be smaller than the grid
        assert not mask.any()


def test_counts_reach_the_target_on_a_roomy_grid():
    counts = [int(block_mask((14, 14), n, seeded(n)).sum()) for n in (19, 50, 98)]
    assert counts[0] >= 15 and counts[1] >= 45 and counts[2] >= 90  # near, never over
    assert all(c <= n for c, n in zip(counts, (19, 50, 98), strict=True))


@pytest.mark.parametrize("probability", [0.0, 0.3, 0.5, 1.0])
def test_exactly_int_b_times_p_images_are_masked_each_in_its_own_grid(probability):
    grids = [(14, 14), (7, 20), (16, 9), (3, 5), (10, 10), (12, 4), (9, 16)]
    masked = int(len(grids) * probability)
    for seed in range(20):
        masks = batch_block_masks(grids, seeded(seed), mask_probability=probability)
        assert [tuple(m.shape) for m in masks] == grids
        assert sum(bool(m.any()) for m in masks) <= masked
        for mask in masks:  # a masked image holds at most int(N * 0.5) patches
            assert mask.sum() <= int(mask.numel() * 0.5)
    roomy = [(14, 14)] * 8  # 0.1 * 196 >= 19 patches: the first block always fits
    for seed in range(20):
        masks = batch_block_masks(roomy, seeded(seed), mask_probability=probability)
        assert sum(bool(m.any()) for m in masks) == int(8 * probability)


def test_ratios_are_stratified_over_the_masked_images():
    """With ratio (0.2, 0.6) and 4 masked images, each batch holds one image in each of
    [0.2, 0.3), [0.3, 0.4), [0.4, 0.5), [0.5, 0.6) of requested patches (up to shortfall)."""
    for seed in range(20):
        masks = batch_block_masks([(20, 20)] * 8, seeded(seed), ratio=(0.2, 0.6))
        shares = sorted(float(m.float().mean()) for m in masks if m.any())
        assert len(shares) == 4
        assert all(share < 0.3 + 0.1 * i for i, share in enumerate(shares))
        assert shares[-1] >= 0.4  # the top stratum asks at least 0.5 * 400 patches


def test_masks_are_reproducible_and_depend_on_the_seed():
    grids = [(14, 14), (16, 9), (8, 8), (14, 14)]
    first = batch_block_masks(grids, seeded(5))
    again = batch_block_masks(grids, seeded(5))
    other = batch_block_masks(grids, seeded(6))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    # resumable: a generator restored to a saved state continues the same sequence
    generator = seeded(7)
    batch_block_masks(grids, generator)
    state = generator.get_state()
    following = batch_block_masks(grids, generator)
    resumed = batch_block_masks(grids, torch.Generator().set_state(state))
    assert all(torch.equal(a, b) for a, b in zip(following, resumed, strict=True))


def test_no_global_randomness_is_used_or_consumed():
    random.seed(0)
    torch.manual_seed(0)
    python_state, torch_state = random.getstate(), torch.get_rng_state()
    batch_block_masks([(14, 14)] * 8, seeded(0))
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mask_probability=1.5), r"mask probability must lie in \[0, 1\], got 1.5"),
    (dict(ratio=(0.1, 1.5)), r"mask ratio must lie in \[0, 1\), got \(0.1, 1.5\)"),
    (dict(ratio=(-0.1, 0.5)), r"mask ratio must lie in \[0, 1\), got \(-0.1, 0.5\)"),
    (dict(ratio=(0.5, 0.1)), r"min <= max, got \(0.5, 0.1\)"),
])
def test_bad_settings_are_refused_with_their_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        batch_block_masks([(14, 14)] * 4, seeded(), **kwargs)


def statistics(masks: torch.Tensor) -> dict[str, torch.Tensor]:
    """`masks` `[draws, B, H, W]`: the masked fraction of each masked image, the within-batch
    sorted fractions (one per stratum), each patch's masking frequency, the adjacency of
    masked patches within a masked image, the share of images masked."""
    fractions = masks.flatten(2).float().mean(-1)  # (draws, B)
    masked = fractions > 0
    images = masks[masked]  # (masked images, H, W)
    count = images.flatten(1).sum(1)
    # the blocks' size and shape: how many masked patches have a masked right / lower neighbour
    across = (images[:, :, 1:] & images[:, :, :-1]).flatten(1).sum(1) / count
    down = (images[:, 1:] & images[:, :-1]).flatten(1).sum(1) / count
    return dict(masked_share=masked.float().mean(), fractions=fractions[masked],
                sorted=fractions.sort(dim=1).values, per_patch=masks.float().mean((0, 1)),
                adjacency=torch.stack([across, down], dim=1))


def z_scores(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """(mean difference) / (its standard error), along dim 0."""
    error = (ours.var(0) / len(ours) + theirs.var(0) / len(theirs)).sqrt()
    return (ours.mean(0) - theirs.mean(0)).abs() / error


@pytest.mark.slow  # 4000 batches drawn by each implementation (about 8 s)
@pytest.mark.parametrize("grid", [(14, 14), (16, 9)])
def test_mask_statistics_match_lightly(grid):
    """DINOv2's defaults (p 0.5, ratio (0.1, 0.5)) over 2000 batches of 8 in each.

    Five standard errors bound each mean's difference: under equal distributions a seed
    exceeds that with probability 6e-7 per comparison (about 1e-4 over the ~200 made here).
    Measured with these seeds, largest z: 2.7 per-patch frequency, 2.2 stratum mean, 1.4
    adjacency, 0.5 spread, 0.3 mean fraction (largest per-patch frequency difference 0.0097).
    Capping blocks at a quarter of the grid instead of half moves the adjacency by z 6 to 7.
    """
    draws, batch = 2000, 8
    random.seed(0)  # lightly draws from Python's random
    theirs = torch.stack([lightly_utils.random_block_mask((batch, *grid))
                          for _ in range(draws)])
    generator = seeded(0)
    ours = torch.stack([torch.stack(batch_block_masks([grid] * batch, generator))
                        for _ in range(draws)])
    a, b = statistics(ours), statistics(theirs)
    assert a["masked_share"] == b["masked_share"] == 0.5
    assert z_scores(a["fractions"], b["fractions"]) < 5  # mean masked fraction (about 0.3)
    # the spread: standard errors of the standard deviation under a normal approximation,
    # which overstates them for this flatter-than-normal distribution (conservative)
    std_a, std_b = a["fractions"].std(), b["fractions"].std()
    error = math.sqrt(std_a**2 / (2 * len(a["fractions"]))
                      + std_b**2 / (2 * len(b["fractions"])))
    assert abs(std_a - std_b) < 5 * error
    strata = slice(batch // 2, None)  # the masked half, one image per stratum
    assert (z_scores(a["sorted"][:, strata], b["sorted"][:, strata]) < 5).all()
    assert (z_scores(a["adjacency"], b["adjacency"]) < 5).all()  # block sizes and shapes
    frequency_a, frequency_b = a["per_patch"], b["per_patch"]  # where blocks fall
    error = ((frequency_a * (1 - frequency_a) + frequency_b * (1 - frequency_b))
             / (draws * batch)).sqrt()
    assert ((frequency_a - frequency_b).abs() < 5 * error).all()
