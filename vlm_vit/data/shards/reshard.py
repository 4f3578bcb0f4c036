"""A shard stream's checkpoint resumed on another number of ranks or workers.

Every old rank's `StreamState` together says which shard positions are read, which are
untouched and how many samples of each position under way were consumed. What is left is
a short list of leftovers, (position, samples already read), and every position from some
`start` on. The new state deals the leftovers over the new slots first, then the positions
from `start` as a fresh run would (see `StreamState.lane`), so across the new ranks and
workers each sample not yet consumed is read exactly once and none read is read again.
A resume on the same ranks and workers keeps its state as it is, so it stays bit-exact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vlm_vit.data.shards.stream import StreamState

logger = logging.getLogger(__name__)

# What every old rank's state must agree on, besides its own rank and position.
_SHARED = ("seed", "shuffle", "block", "shards", "shard_list", "world_size", "workers",
           "start", "leftovers")


def resharded_state(states: Sequence[dict[str, Any]], *, rank: int, world_size: int,
                    workers: int) -> dict[str, Any]:
    """This rank's state for `world_size` processes of `workers` DataLoader workers each,
    from every old rank's state.

    On the old layout the rank's own state is returned as it is (an exact resume); on
    another, the remaining work is dealt anew (`remaining`). The skipped-sample counts and
    truncated shards go to rank 0, so their sum over the ranks is kept; `batches` continues
    from the old ranks' count.

    Args:
        states: `StreamState.to_dict()` of every old rank.
        rank, world_size: this process and the number of processes.
        workers: this run's DataLoader workers (0: read in the main process, one slot).

    Raises:
        ValueError: when the states disagree with one another (see `check_states`).
    """
    roles = max(workers, 1)
    if len(states) == world_size and states[rank]["world_size"] == world_size \
            and states[rank]["workers"] == roles:
        return dict(states[rank])
    old = check_states(states)
    leftovers, start = remaining(old)
    logger.info("shard stream resumed from %d ranks x %d workers onto %d x %d",
                old[0].world_size, old[0].workers, world_size, roles)
    truncated: list[list] = []
    for state in old:
        truncated += [entry for entry in state.truncated
                      if entry[0] not in {known[0] for known in truncated}]
    first = old[0]
    return StreamState(
        first.seed, first.shuffle, first.block, first.shards, first.shard_list, world_size,
        rank, roles, [[0, 0] for _ in range(roles)],
        batches=max(state.batches for state in old),
        no_image=sum(state.no_image for state in old) if rank == 0 else 0,
        truncated=truncated if rank == 0 else [], start=start,
        leftovers=[list(entry) for entry in leftovers]).to_dict()


def check_states(states: Sequence[dict[str, Any]]) -> list[StreamState]:
    """The states as `StreamState`s in rank order.

    Raises:
        ValueError: when they are not one per rank of the run that wrote them, or disagree
            on the order (shards, seed, shuffle, block, layout, leftovers).
    """
    if not states:
        raise ValueError("the checkpoint holds no shard stream state")
    old = sorted((StreamState(**state) for state in states), key=lambda state: state.rank)
    ranks = [state.rank for state in old]
    if ranks != list(range(old[0].world_size)):
        raise ValueError(f"the checkpoint's shard stream states are of ranks {ranks}, but "
                         f"say they were written by a run of {old[0].world_size} processes")
    for state in old[1:]:
        differs = [name for name in _SHARED if getattr(state, name) != getattr(old[0], name)]
        if differs:
            raise ValueError(f"the checkpoint's shard stream states of ranks 0 and "
                             f"{state.rank} disagree on {', '.join(differs)}")
    return old


def remaining(states: Sequence[StreamState]) -> tuple[list[tuple[int, int]], int]:
    """What the ranks of `states` have left to read: the leftovers, (position, samples
    already read) in position order, and the first position of which nothing was read.

    A slot has read every position of its lane before its current one, a prefix of the
    current one (the samples consumed) and nothing after it. So the regular positions
    (from `start`) below the lowest current one are all read, and those from the highest
    on are untouched but for that one; the ones between, and the slots' leftovers not yet
    passed, are the new leftovers.
    """
    first = states[0]
    count = first.world_size * first.workers
    leftovers: list[tuple[int, int]] = []
    frontier: dict[int, tuple[int, int]] = {}  # slot -> (first regular position not read, skip)
    for state in states:
        for role, (ordinal, consumed) in enumerate(state.slots):
            slot = role * first.world_size + state.rank
            owned = first.leftovers[slot::count]
            if ordinal < len(owned):  # still on its leftovers: no regular position begun
                position, skip = owned[ordinal]
                leftovers.append((position, max(skip, consumed)))
                leftovers += [(position, skip) for position, skip in owned[ordinal + 1:]]
                frontier[slot] = (first.start + slot, 0)
            else:
                frontier[slot] = (state.lane(role, ordinal)[0], consumed)
    low = min(position for position, _ in frontier.values())
    high = max(position for position, _ in frontier.values())
    for position in range(low, high + 1):
        current, consumed = frontier[(position - first.start) % count]
        if position >= current:  # the slot's current position, or one after it
            leftovers.append((position, consumed if position == current else 0))
    return sorted(leftovers), high + 1
