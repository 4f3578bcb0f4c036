import math

import pytest
import torch

from vlm_vit.analysis import (
    attention_distance,
    attention_rollout,
    mean_attention_distance,
    patch_attention,
    patch_distances,
    prefix_attention,
    rollout_grid,
)


def test_distance_is_the_attention_weighted_mean_of_pixel_distances():
    weights = torch.tensor([0.5, 0.3, 0.2])
    distances = torch.tensor([0.0, 16.0, 64.0])
    assert attention_distance(weights, distances).item() == pytest.approx(17.6)


def test_prefix_tokens_are_dropped_and_each_query_renormalised_over_the_patches():
    # One class token, a 1 x 5 grid of 16-pixel patches: patch 0 lies 0, 16, 32, 48, 64
    # pixels from patches 0..4. Patch 0 gives half its weight to the class token; over the
    # patches its weights are 0.25, 0.15, 0, 0, 0.1, i.e. 0.5, 0.3, 0, 0, 0.2 renormalised.
    attention = torch.full((1, 1, 6, 6), 1 / 6)
    attention[0, 0, 1] = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0, 0.1])
    weights = patch_attention(attention, num_prefix_tokens=1)  # (1, 1, 5, 5)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 1, 5))
    distances = patch_distances((1, 5), 16)
    assert distances[0].tolist() == [0.0, 16.0, 32.0, 48.0, 64.0]
    assert attention_distance(weights[0, 0, 0], distances[0]).item() == pytest.approx(17.6)
    share = prefix_attention(attention, num_prefix_tokens=1)  # patch queries on the class
    assert share.item() == pytest.approx((0.5 + 4 / 6) / 5)


def test_uniform_attention_gives_the_closed_form_mean_distance():
    rows = cols = 3
    patch = 16
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    total = 0.0
    for r1, c1 in cells:  # every query, every key, Euclidean distance between centres
        for r2, c2 in cells:
            total += math.hypot((r1 - r2) * patch, (c1 - c2) * patch)
    expected = total / len(cells) ** 2
    heads, prefix = 2, 1
    tokens = prefix + rows * cols
    uniform = torch.full((1, heads, tokens, tokens), 1 / tokens)
    result = mean_attention_distance(uniform, (rows, cols), patch, num_prefix_tokens=prefix)
    assert result.shape == (1, heads)
    assert torch.allclose(result, torch.full((1, heads), expected, dtype=torch.float32))


def test_attention_to_itself_has_distance_zero():
    attention = torch.eye(4).expand(2, 3, 4, 4)
    assert mean_attention_distance(attention, (2, 2), 8).abs().max() == 0


def test_mean_attention_distance_checks_the_token_count():
    with pytest.raises(ValueError, match="over 5 tokens do not fit 10 tokens"):
        mean_attention_distance(torch.ones(1, 1, 5, 5) / 5, (3, 3), 16, num_prefix_tokens=1)


def test_rollout_of_identity_attention_is_the_identity():
    eye = torch.eye(5).expand(2, 3, 5, 5)
    rollout = attention_rollout([eye, eye, eye])
    assert torch.equal(rollout, torch.eye(5).expand(2, 5, 5))


def test_rollout_rows_sum_to_one():
    torch.manual_seed(0)
    maps = [torch.randn(2, 4, 7, 7).softmax(-1) for _ in range(5)]
    rollout = attention_rollout(maps)
    assert torch.allclose(rollout.sum(-1), torch.ones(2, 7), atol=1e-6)


def test_rollout_of_two_layers_matches_the_hand_computation():
    # Two heads per layer whose mean is the map A below.
    first = torch.tensor([[[[0.9, 0.1], [0.3, 0.7]], [[0.7, 0.3], [0.5, 0.5]]]])  # A1
    second = torch.tensor([[[[0.6, 0.4], [0.0, 1.0]], [[0.4, 0.6], [0.2, 0.8]]]])  # A2
    # A1 = [[0.8, 0.2], [0.4, 0.6]] -> 0.5 A1 + 0.5 I = [[0.9, 0.1], [0.2, 0.8]]
    # A2 = [[0.5, 0.5], [0.1, 0.9]] -> 0.5 A2 + 0.5 I = [[0.75, 0.25], [0.05, 0.95]]
    # R = A2' A1' = [[0.75 * 0.9 + 0.25 * 0.2, 0.75 * 0.1 + 0.25 * 0.8],
    #                [0.05 * 0.9 + 0.95 * 0.2, 0.05 * 0.1 + 0.95 * 0.8]]
    expected = torch.tensor([[[0.725, 0.275], [0.235, 0.765]]])
    assert torch.allclose(attention_rollout([first, second]), expected, atol=1e-6)


def test_rollout_grid_reads_the_class_row_or_the_mean_of_the_patch_rows():
    # 1 class + 1 register token, a 2 x 2 grid: T = 6.
    rollout = torch.arange(36, dtype=torch.float32).reshape(1, 6, 6)
    with_class = rollout_grid(rollout, (2, 2), num_prefix_tokens=2, class_token=True)
    assert with_class.tolist() == [[[2.0, 3.0], [4.0, 5.0]]]
    without = rollout_grid(rollout, (2, 2), num_prefix_tokens=2, class_token=False)
    patch_rows = rollout[0, 2:, 2:]  # rows 2..5, columns 2..5
    assert torch.equal(without[0], patch_rows.mean(0).reshape(2, 2))
