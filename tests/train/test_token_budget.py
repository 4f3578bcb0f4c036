"""Token-budget batching: first-fit decreasing packs, the batch sampler, token counts."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_vit.train import TokenBudgetBatchSampler, collate_packed
from vlm_vit.train.token_budget import first_fit_decreasing, tokens_for_size


def assert_packs_cover_within_budget(packs, lengths, max_tokens):
    """Every pack is non-empty and within budget, and every index is in exactly one."""
    assert all(packs), packs
    assert all(sum(lengths[i] for i in pack) <= max_tokens for pack in packs)
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))


# ---- first_fit_decreasing -----------------------------------------------------------


def test_ffd_worked_example():
    # Longest first: 7 opens pack 0; 6 cannot join it (13) and opens pack 1; 5 joins
    # neither (12, 11) and opens pack 2; 4 skips pack 0 (11) and joins 6 (10); 3 joins 7
    # (10); 2 finds packs 0 and 1 full and joins 5 (7).
    packs = first_fit_decreasing([5, 7, 3, 2, 4, 6], max_tokens=10)
    assert packs == [[1, 2], [5, 4], [0, 3]]
    assert [[[5, 7, 3, 2, 4, 6][i] for i in pack] for pack in packs] == [[7, 3], [6, 4], [5, 2]]


def test_ffd_known_behaviour():
    # Ties keep index order; an exact fit fills a pack; a zero-token item joins pack 0.
    assert first_fit_decreasing([3, 3, 3, 3], max_tokens=6) == [[0, 1], [2, 3]]
    assert first_fit_decreasing([4, 0, 6], max_tokens=10) == [[2, 0, 1]]
    assert first_fit_decreasing([10, 10], max_tokens=10) == [[0], [1]]
    assert first_fit_decreasing([], max_tokens=10) == []
    assert first_fit_decreasing([6, 5, 5, 4, 4, 3, 3], max_tokens=10) == \
        [[0, 3], [1, 2], [4, 5, 6]]  # 6+4, 5+5, 4+3+3
    assert first_fit_decreasing([2, 5, 4, 7, 1, 3, 8], max_tokens=10) == \
        [[6, 0], [3, 5], [1, 2, 4]]  # 8+2, 7+3, 5+4+1
    # Not optimal: three 4s and six 3s fill 3 packs as 4+3+3 each, but FFD puts two 4s
    # together (8, no room for a 3) and needs a fourth pack.
    assert first_fit_decreasing([4, 4, 4, 3, 3, 3, 3, 3, 3], max_tokens=10) == \
        [[0, 1], [2, 3, 4], [5, 6, 7], [8]]


def test_ffd_matches_a_plain_quadratic_reference():
    def reference(lengths, max_tokens):
        packs, free = [], []
        for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            slot = next((p for p, room in enumerate(free) if room >= lengths[index]), None)
            if slot is None:
                packs.append([])
                free.append(max_tokens)
                slot = len(packs) - 1
            packs[slot].append(index)
            free[slot] -= lengths[index]
        return packs

    rng = random.Random(0)
    for trial in range(200):
        max_tokens = rng.randint(1, 300)
        lengths = [rng.randint(0, max_tokens) for _ in range(rng.randint(0, 60))]
        assert first_fit_decreasing(lengths, max_tokens) == reference(lengths, max_tokens), trial


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500).flatmap(
    lambda budget: st.tuples(st.just(budget), st.lists(st.integers(0, budget), max_size=80))))
def test_ffd_packs_are_within_budget_and_cover_every_index_once(case):
    max_tokens, lengths = case
    packs = first_fit_decreasing(lengths, max_tokens)
    assert_packs_cover_within_budget(packs, lengths, max_tokens)
    # First fit never leaves two packs at most half full: the later one's first item
    # (at most half the budget) would have fitted in the earlier one.
    loads = [sum(lengths[i] for i in pack) for pack in packs]
    assert sum(2 * load <= max_tokens for load in loads) <= 1


def test_ffd_accepts_tensors_and_arrays():
    expected = [[1, 2], [5, 4], [0, 3]]
    assert first_fit_decreasing(torch.tensor([5, 7, 3, 2, 4, 6]), 10) == expected
    assert first_fit_decreasing(np.array([5, 7, 3, 2, 4, 6], dtype=np.int32), 10) == expected


def test_over_budget_item_is_refused_naming_its_index_and_count():
    with pytest.raises(ValueError, match=r"item 2 has 11 tokens, more than the budget "
                                         r"max_tokens=10"):
        first_fit_decreasing([3, 4, 11, 2], max_tokens=10)
    with pytest.raises(ValueError, match="item 2 has 11 tokens"):
        TokenBudgetBatchSampler([3, 4, 11, 2], max_tokens=10)


@pytest.mark.parametrize("lengths, max_tokens, text", [
    ([1, -2], 10, "item 1 has token count -2"),
    ([1, 2.5], 10, "item 1 has token count 2.5"),
    ([1, True], 10, "item 1 has token count True"),
    (torch.tensor([1.0, 2.0]), 10, "item 0 has token count 1.0"),
    ([1, 2], 0, "max_tokens must be a positive int, got 0"),
    ([1, 2], 10.0, "max_tokens must be a positive int, got 10.0"),
])
def test_bad_lengths_and_budgets_are_refused(lengths, max_tokens, text):
    with pytest.raises(ValueError, match=text):
        first_fit_decreasing(lengths, max_tokens)


# ---- the batch sampler --------------------------------------------------------------


def photo_token_counts(count: int = 100, seed: int = 0) -> list[int]:
    """Token counts of photo-like sizes: patch 16, sides 64..448, a class token."""
    rng = random.Random(seed)
    return [tokens_for_size((16 * rng.randint(4, 28), 16 * rng.randint(4, 28)), 16, 1)
            for _ in range(count)]


def test_sampler_packs_are_within_budget_and_every_index_appears_once_per_epoch():
    lengths = photo_token_counts()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=1024, shuffle=True, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        packs = list(sampler)
        assert len(packs) == len(sampler) == len(first_fit_decreasing(lengths, 1024))
        assert_packs_cover_within_budget(packs, lengths, 1024)


def test_unshuffled_sampler_yields_ffd_order_every_epoch():
    lengths = [5, 7, 3, 2, 4, 6]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=10)
    assert list(sampler) == [[1, 2], [5, 4], [0, 3]]
    sampler.set_epoch(5)
    assert list(sampler) == [[1, 2], [5, 4], [0, 3]]
    next(iter(sampler)).append(99)  # the batches are copies: the packs stay as they are
    assert list(sampler)[0] == [1, 2]


def test_shuffling_is_deterministic_per_seed_and_epoch_and_differs_across_epochs():
    lengths = photo_token_counts()

    def epoch_order(seed, epoch):
        sampler = TokenBudgetBatchSampler(lengths, max_tokens=1024, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert epoch_order(0, 0) == epoch_order(0, 0)
    assert epoch_order(0, 1) == epoch_order(0, 1)
    orders = [epoch_order(0, epoch) for epoch in range(4)]
    assert all(a != b for i, a in enumerate(orders) for b in orders[i + 1:])
    assert epoch_order(0, 0) != epoch_order(1, 0)
    # Only the order changes: the same packs every epoch and seed.
    assert all(sorted(order) == sorted(orders[0]) for order in orders + [epoch_order(1, 0)])


def test_set_epoch_and_seed_are_checked():
    sampler = TokenBudgetBatchSampler([1, 2], max_tokens=4)
    with pytest.raises(ValueError, match="epoch must be a non-negative int, got -1"):
        sampler.set_epoch(-1)
    with pytest.raises(ValueError, match="seed must be a non-negative int, got -1"):
        TokenBudgetBatchSampler([1, 2], max_tokens=4, seed=-1)


class VariableSizeImages(torch.utils.data.Dataset):
    """Random ``[3, H_i, W_i]`` images whose sides are multiples of the patch size 16."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, index):
        height, width = self.sizes[index]
        return torch.full((3, height, width), float(index))

    @property
    def lengths(self):
        return [tokens_for_size(size, patch_size=16, num_prefix_tokens=1) for size in self.sizes]


def test_usable_as_a_dataloader_batch_sampler_with_a_list_collate():
    rng = random.Random(1)
    sizes = [(16 * rng.randint(1, 12), 16 * rng.randint(1, 12)) for _ in range(40)]
    dataset = VariableSizeImages(sizes)
    sampler = TokenBudgetBatchSampler(dataset.lengths, max_tokens=200, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=list)
    assert len(loader) == len(sampler)
    seen = []
    for batch in loader:
        assert isinstance(batch, list) and all(img.ndim == 3 for img in batch)
        tokens = sum((img.shape[1] // 16) * (img.shape[2] // 16) + 1 for img in batch)
        assert tokens <= 200
        seen.extend(int(img[0, 0, 0]) for img in batch)  # each image holds its index
    assert sorted(seen) == list(range(len(sizes)))
    assert len({tuple(img.shape) for img in dataset}) > 1  # the sizes really differ


# ---- tokens_for_size ----------------------------------------------------------------


def test_tokens_for_size():
    assert tokens_for_size((742, 1330), 14) == 53 * 95 == 5035
    assert tokens_for_size((742, 1330), 14, num_prefix_tokens=1) == 5036
    assert tokens_for_size((224, 224), 16, num_prefix_tokens=5) == 196 + 5  # cls + 4 regs
    assert tokens_for_size((32, 48), (16, 8)) == 2 * 6


@pytest.mark.parametrize("args, text", [
    (((225, 224), 16), "height 225 and width 224 is not a multiple of the patch size 16 x 16"),
    (((0, 224), 16), r"size must be a \(height, width\) of positive ints, got \(0, 224\)"),
    (((224, 224), 0), "patch_size must be a positive int"),
    (((224, 224), 16, -1), "num_prefix_tokens must be a non-negative int, got -1"),
])
def test_tokens_for_size_refuses_bad_values(args, text):
    with pytest.raises(ValueError, match=text):
        tokens_for_size(*args)


class VariableSizeDigits(torch.utils.data.Dataset):
    """Labelled random images of several shapes (sides multiples of the patch size 8)."""

    SIZES = [(32, 32), (24, 40), (40, 16), (16, 48), (8, 32), (32, 24)]

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        height, width = self.SIZES[index % len(self.SIZES)]
        return torch.randn(3, height, width, generator=generator), index % 3


def test_collate_packed_keeps_sizes_and_labels():
    items = [VariableSizeDigits()[i] for i in range(3)]
    batch = collate_packed(items)
    assert [tuple(image.shape) for image in batch.pixel_values] == \
        [(3, 32, 32), (3, 24, 40), (3, 40, 16)]
    assert batch.labels.tolist() == [0, 1, 2]
    assert collate_packed([items[0][0]]).labels is None
    with pytest.raises(TypeError, match="item 1 of type str"):
        collate_packed([items[0][0], "x"])


def test_the_trainer_fine_tunes_on_packed_batches_and_accumulates_exactly(tmp_path):
    from vlm_vit import EncoderConfig, VisionEncoder
    from vlm_vit.adapt.finetune import ImageClassifier
    from vlm_vit.train import TrainConfig, Trainer, load_checkpoint
    from vlm_vit.train.checkpoint import checkpoint_path

    moments = []
    for accumulation in (1, 2):
        torch.manual_seed(0)
        encoder = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=2,
                                              heads=4, mlp_width=64))
        classifier = ImageClassifier(encoder, 3, pooling="mean")
        config = TrainConfig(steps=1, batch_size=6, lr=1e-3, num_workers=0, device="cpu",
                             seed=0, log_every=1, checkpoint_every=1,
                             grad_accumulation=accumulation)
        run_dir = tmp_path / f"accumulate_{accumulation}"
        result = Trainer(classifier, VariableSizeDigits(), config, run_dir,
                         collate=collate_packed).fit()
        assert result.losses[0] == pytest.approx(math.log(3))  # zero head: chance
        state = load_checkpoint(checkpoint_path(run_dir, 1))["optimizer"]["state"]
        moments.append({index: s["exp_avg"] for index, s in state.items()})
    assert moments[0].keys() == moments[1].keys()
    for index, moment in moments[0].items():
        torch.testing.assert_close(moment, moments[1][index], atol=1e-7, rtol=1e-5)
