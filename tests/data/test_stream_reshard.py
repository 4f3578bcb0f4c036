"""Resume at any world size (issue 29): a shard stream's checkpoint remapped onto other
ranks and workers reads every sample of the epoch not yet read exactly once, and a folder's
onto other ranks too. Ranks are simulated one after another in this process."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.train.test_tar_shards import decode
from tests.train.toy import write_shards
from vlm_vit.data import MapSource, ShardSource
from vlm_vit.data.samples import collate_images
from vlm_vit.data.shards import ShardStream, StreamState
from vlm_vit.data.shards.reshard import remaining, resharded_state

SHARDS, PER_SHARD = 7, 5  # 35 samples: dealt unevenly over 2, 3, 4 and 6 slots
EPOCH = SHARDS * PER_SHARD


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[str]]:
    return write_shards(tmp_path_factory.mktemp("reshard"), SHARDS, PER_SHARD)


def shard_source(written: dict[str, list[str]]) -> ShardSource:
    # Blocks of 3 in shards of 5: a resume point may fall inside a shuffled block.
    return ShardSource(ShardStream(sorted(written), decode(), seed=3, shuffle_block=3))


def run_ranks(written, world_size: int, workers: int, batches: int, states=None, *,
              batch_size: int = 2):
    """Each of `world_size` ranks draws `batches` batches, after loading `states` if given.
    Returns every rank's batches and every rank's state after them."""
    drawn, saved = [], []
    for rank in range(world_size):
        source = shard_source(written)
        source.configure(batch_size, collate_images, seed=0, rank=rank,
                         world_size=world_size, workers=workers)
        if states is not None:
            source.load_state_dict(states)
        loader = source.loader()
        drawn.append([next(loader) for _ in range(batches)])
        loader.close()
        saved.append(source.state_dict())
    return drawn, saved


def keys_per_epoch(*runs) -> dict[int, Counter]:
    """Sample keys per epoch over every batch of every rank of `runs`."""
    epochs: dict[int, Counter] = {}
    for run in runs:
        for batches in run:
            for batch in batches:
                for epoch, _, key in batch.samples:
                    epochs.setdefault(epoch, Counter())[key] += 1
    return epochs


def assert_exactly_once(written, epochs: dict[int, Counter], complete: int) -> None:
    """Epochs before `complete` hold every key once; the later ones repeat none."""
    everything = Counter(key for keys in written.values() for key in keys)
    for epoch in range(complete):
        assert epochs[epoch] == everything, epoch
    assert all(max(counts.values()) == 1 for counts in epochs.values())


def batches_for(samples: int, world_size: int, batch_size: int = 2) -> int:
    """Batches per rank for `world_size` ranks to draw at least `samples` between them."""
    return -(-samples // (world_size * batch_size))


@pytest.mark.parametrize(("old", "new"), [((2, 2), (1, 0)), ((2, 2), (3, 2)),
                                          ((2, 0), (3, 0)), ((1, 1), (1, 2)),
                                          ((3, 0), (2, 2))],
                         ids=["2x2-1x0", "2x2-3x2", "2x0-3x0", "1x1-1x2", "3x0-2x2"])
@pytest.mark.parametrize("before", [5, 13], ids=["mid-epoch", "next-epoch"])
def test_a_shard_stream_resumed_on_other_ranks_or_workers_reads_each_sample_once(
        written, old, new, before, caplog):
    (world_size, workers), (new_world, new_workers) = old, new
    first, states = run_ranks(written, world_size, workers, before)
    # Three epochs in all: the first two must then be complete, whatever the drift.
    after = batches_for(3 * EPOCH - before * world_size * 2, new_world)
    with caplog.at_level(logging.INFO, logger="vlm_vit.data.shards.reshard"):
        rest, _ = run_ranks(written, new_world, new_workers, after, states)
    assert_exactly_once(written, keys_per_epoch(first, rest), complete=2)
    assert (f"shard stream resumed from {world_size} ranks x {max(workers, 1)} workers onto "
            f"{new_world} x {max(new_workers, 1)}") in caplog.text


def test_a_resume_on_the_same_ranks_and_workers_is_the_uninterrupted_run(written, caplog):
    whole, _ = run_ranks(written, 2, 2, 9)
    first, states = run_ranks(written, 2, 2, 4)
    # States written before remapping existed have no "start" or "leftovers".
    older = [{k: v for k, v in s.items() if k not in ("start", "leftovers")} for s in states]
    with caplog.at_level(logging.INFO):
        rest, _ = run_ranks(written, 2, 2, 5, states)
        rest_of_older, _ = run_ranks(written, 2, 2, 5, older)
    assert "resumed from" not in caplog.text  # nothing remapped
    for rank in range(2):
        resumed = first[rank] + rest[rank]
        assert [b.samples for b in resumed] == [b.samples for b in whole[rank]]
        assert [b.samples for b in rest_of_older[rank]] == [b.samples for b in rest[rank]]
        for got, expected in zip(resumed, whole[rank], strict=True):
            assert torch.equal(got.batch.pixel_values, expected.batch.pixel_values)


def test_a_remapped_stream_resumes_again_bit_exactly_and_on_yet_other_ranks(written):
    first, states = run_ranks(written, 2, 2, 5)
    # The remapped state resumed on its own layout continues exactly.
    whole, _ = run_ranks(written, 3, 0, 8, states)
    part, remapped = run_ranks(written, 3, 0, 3, states)
    assert remapped[0]["leftovers"] and remapped[0]["start"] > 0
    rest, _ = run_ranks(written, 3, 0, 5, remapped)
    for rank in range(3):
        assert [b.samples for b in part[rank] + rest[rank]] == \
            [b.samples for b in whole[rank]]
    # And on yet another layout, nothing is read twice or skipped.
    drawn = 20 + 3 * 3 * 2
    last, _ = run_ranks(written, 1, 2, batches_for(3 * EPOCH - drawn, 1), remapped)
    assert_exactly_once(written, keys_per_epoch(first, part, last), complete=2)


def test_the_trainer_resumes_shards_on_other_workers_with_each_sample_once(written, tmp_path):
    """Killed after the step-3 checkpoint with 2 workers, resumed with none: the sample log
    (rewound to the checkpoint) holds each key of epoch 0 once, and none twice after."""
    from tests.train.toy import Interrupted, config, toy_objective
    from vlm_vit.train import Trainer
    from vlm_vit.train.metrics import read_sample_log

    def stream() -> ShardStream:
        return ShardStream(sorted(written), decode(), seed=3, shuffle_block=3)

    run = tmp_path / "run"
    steps = dict(steps=12, log_samples=True, checkpoint_every=3)  # 48 samples: 1.4 epochs
    with pytest.raises(Interrupted):
        Trainer(toy_objective(crash_at_call=6), stream(), config(**steps, num_workers=2),
                run, progress=False).fit()
    result = Trainer(toy_objective(), stream(), config(**steps, num_workers=0), run,
                     progress=False).fit(resume=True)
    assert result.step == 12
    log = read_sample_log(run)
    assert len(log) == 12 * 4
    epochs: dict[int, Counter] = {}
    for _, epoch, _, key in log:
        epochs.setdefault(epoch, Counter())[key] += 1
    assert_exactly_once(written, epochs, complete=1)


def state(rank: int, world_size: int, slots: list[list[int]], **extra) -> dict:
    """A hand-made StreamState of 7 shards, for the remapping's arithmetic."""
    return StreamState(0, True, 3, SHARDS, 0, world_size, rank, len(slots), slots,
                       **extra).to_dict()


def test_the_remaining_work_is_the_leftovers_and_every_position_from_start():
    # 2 ranks x 1 worker: slot 0 reads positions 0, 2, 4, ..., slot 1 positions 1, 3, ...
    # Slot 0 stands at its second (position 2) with 3 samples read, slot 1 at its first
    # (position 1) with 4: position 0 is read, 1 and 2 are leftovers, 3 on untouched.
    old = [state(0, 2, [[1, 3]]), state(1, 2, [[0, 4]])]
    assert remaining([StreamState(**s) for s in old]) == ([(1, 4), (2, 3)], 3)
    new = [StreamState(**resharded_state(old, rank=rank, world_size=3, workers=0))
           for rank in range(3)]
    lanes = [[s.lane(0, ordinal) for ordinal in range(3)] for s in new]
    assert lanes == [[(1, 4), (3, 0), (6, 0)],  # leftovers first, then from 3 in threes
                     [(2, 3), (4, 0), (7, 0)],
                     [(5, 0), (8, 0), (11, 0)]]
    # Remapped again from there: slot 0 at position 3 (2 read), slot 1 still on its
    # leftover (3 read, none since), slot 2 done with 5 and at 8 (none read).
    again = [dict(s.to_dict(), slots=slots) for s, slots in
             zip(new, [[[1, 2]], [[0, 3]], [[1, 0]]], strict=True)]
    assert remaining([StreamState(**s) for s in again]) == \
        ([(2, 3), (3, 2), (4, 0), (6, 0), (7, 0), (8, 0)], 9)
    assert [StreamState(**s).epoch() for s in again] == [0, 0, 1]


LENGTH = 3  # samples per shard in the property test below


def read_up_to(states: list[StreamState], draw, horizon: int | None = None):
    """The (position, sample) pairs the ranks of `states` read next, and their states after.

    Each slot reads on a few positions and part of one more, as `draw` picks; with
    `horizon`, it reads every position of its lane below the horizon instead.
    """
    pairs, moved = [], []
    for rank_state in states:
        slots = []
        for role, (current, already) in enumerate(rank_state.slots):
            ordinal, consumed = current, already
            if horizon is None:
                ordinal += draw(st.integers(0, 3))
                least = max(already if ordinal == current else 0,
                            rank_state.lane(role, ordinal)[1])
                consumed = draw(st.integers(least, LENGTH))
            for index in itertools.count(current):
                position, skip = rank_state.lane(role, index)
                if index > ordinal if horizon is None else position >= horizon:
                    break  # (the leftovers lie before `start`, so below the horizon)
                first = max(skip, already if index == current else 0)
                last = consumed if index == ordinal and horizon is None else LENGTH
                pairs += [(position, sample) for sample in range(first, last)]
            slots.append([ordinal, consumed])
        moved.append(dataclasses.replace(rank_state, slots=slots))
    return pairs, moved


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_remap_of_any_positions_reads_each_sample_exactly_once(data):
    """Abstract shards of 3 samples: read some way on one layout, remapped onto a second,
    read on, remapped onto a third and read to the end; every sample of every position
    below the end is read once."""
    layout = st.tuples(st.integers(1, 4), st.integers(0, 3))
    world_size, workers = data.draw(layout)
    states = [StreamState(**state(rank, world_size, [[0, 0]] * max(workers, 1)))
              for rank in range(world_size)]
    read: list[tuple[int, int]] = []
    for _ in range(2):
        pairs, moved = read_up_to(states, data.draw)
        read += pairs
        world_size, workers = data.draw(layout)
        old = [s.to_dict() for s in moved]
        states = [StreamState(**resharded_state(old, rank=rank, world_size=world_size,
                                                workers=workers))
                  for rank in range(world_size)]
    horizon = max([states[0].start + 2 * world_size * max(workers, 1)]
                  + [position + 1 for position, _ in read])
    read += read_up_to(states, data.draw, horizon)[0]
    assert sorted(read) == [(position, sample) for position in range(horizon)
                            for sample in range(LENGTH)]


def test_the_states_must_be_one_per_rank_and_agree(written):
    source = shard_source(written)
    source.configure(2, collate_images, world_size=1)
    with pytest.raises(ValueError, match=r"of ranks \[0, 0\], but say they were written by "
                                         r"a run of 1 processes"):
        source.load_state_dict([source.state_dict()] * 2)
    old = [state(0, 2, [[1, 3]]), state(1, 2, [[0, 4]], start=5)]
    with pytest.raises(ValueError, match="states of ranks 0 and 1 disagree on start"):
        resharded_state(old, rank=0, world_size=1, workers=0)
    # The order itself must still match: another seed is refused, naming it.
    _, states = run_ranks(written, 2, 0, 1)
    other = ShardSource(ShardStream(sorted(written), decode(), seed=4, shuffle_block=3))
    other.configure(2, collate_images, world_size=3, rank=1)
    with pytest.raises(ValueError, match="read with seed 3; this run has seed 4: resume "
                                         "with the same shards and seed"):
        other.load_state_dict(states)


class Indices(torch.utils.data.Dataset):
    """Item i is i, so the batches name what they hold."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_folder_resumed_on_other_ranks_sees_every_sample_once_per_epoch(new_world):
    """Global batches of 6 (4 per epoch of 24): 2 ranks x 3 for 5 batches (into epoch 1),
    then `new_world` ranks for the remaining 3 of epoch 1 and all 4 of epoch 2."""
    def run(world_size: int, batches: int, states=None):
        drawn, saved = [], []
        for rank in range(world_size):
            source = MapSource(Indices())
            source.configure(6 // world_size, list, seed=7, rank=rank, world_size=world_size)
            if states is not None:
                source.load_state_dict(states)
            loader = source.loader()
            drawn += [(source.position()[0], next(loader).batch) for _ in range(batches)]
            loader.close()
            saved.append(source.state_dict())
        return drawn, saved

    first, states = run(2, 5)
    rest, _ = run(new_world, 7, states)
    epochs: dict[int, Counter] = {}
    for epoch, items in first + rest:
        epochs.setdefault(epoch, Counter()).update(items)
    assert epochs == {epoch: Counter(range(24)) for epoch in range(3)}
