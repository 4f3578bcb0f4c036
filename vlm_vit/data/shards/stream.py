"""The endless, exactly resumable stream of batches from tar shards.

    stream = ShardStream("shards/{00000..00127}.tar", ImageDecode(augmentation, seed=0))

A shard spec is a brace pattern, a glob, a list, a directory of `.tar` files, or any URL
`webdataset` opens (`pipe:aws s3 cp ...`, `https://...`). The tars are read by `webdataset`
as raw bytes; only the fields we decode ourselves (images, `cls`, `txt`, `json`) are ever
looked at, so nothing in a shard is unpickled (webdataset's own decoders would unpickle
`.pyd` and `.pth` members).

Order and bookkeeping (see docs/architecture.md, "Shards"):

- Epoch e deals the shards in an order seeded by (seed, e). The epochs follow one another
  as one endless sequence of shard positions, and position p goes to slot p mod (ranks x
  workers): worker w of rank r is slot w x ranks + r. So the ranks and workers read
  disjoint shards, every sample is read once per epoch across all of them, and an uneven
  last round is neither dropped nor padded: it continues into the next epoch's shards.
- Within a shard, blocks of `shuffle_block` samples are shuffled, seeded by (seed, epoch,
  shard, block), so a shard written in class order still mixes.
- Each worker batches its own samples. A batch carries its slot's position after it (the
  shard ordinal and the samples consumed in that shard), so a checkpoint records, per rank,
  where each slot stands, and a resume skips exactly the consumed samples: nothing is
  repeated or skipped. DataLoader takes batches from its workers in turn, so the next batch
  comes from slot `batches mod workers`; a resumed loader rotates the slots to match.
- A resume on another number of ranks or workers (`reshard.py`) turns every old rank's
  state into what is left: a few "leftover" positions, each with the samples already read
  of it, and every position from `start` on. Leftover i goes to slot i mod (ranks x
  workers), and each slot then reads its positions start + slot, start + slot + ranks x
  workers, ...; with no leftovers and `start` 0 this is the dealing above.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_vit.data.samples import UndecodableImage, mixed_seed
from vlm_vit.data.shards.reader import Sample, ShardProblems, read_shard
from vlm_vit.data.shards.spec import expand_shards, read_dataset_index

logger = logging.getLogger(__name__)

# What a resume may change when every rank's states are remapped (`reshard.py`).
_LAYOUT = {"world_size", "rank", "workers"}

# -- the stream -------------------------------------------------------------------------------

@dataclass
class StreamBatch:
    """One worker's collated batch and where its slot stands after it.

    Attributes:
        batch: what the collate made of the decoded samples.
        samples: (epoch, shard, key) of each sample in the batch that decoded, in order.
        role: the slot's worker role (0..workers-1).
        position: (shard ordinal within the slot, samples consumed in that shard).
        no_image: samples skipped for having no image since the slot's previous batch.
        truncated: (shard, samples read, error) of shards found truncated since then.
    """

    batch: Any
    samples: list[tuple[int, str, str]]
    role: int
    position: tuple[int, int]
    no_image: int
    truncated: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class StreamState:
    """Where one rank's stream stands: recorded in checkpoints, one per rank.

    Attributes:
        seed, shuffle, block, shards, world_size, rank, workers: what fixes the order; a
            resume must match them (or be remapped, see `reshard.py`).
        shard_list: a CRC-32 of the shard URLs, so a resume on other shards is refused.
        slots: per worker role, [ordinal in the slot's lane, samples consumed in its shard].
        batches: batches this rank has drawn (the next comes from role batches mod workers).
        no_image: samples skipped so far for having no image.
        truncated: [shard, samples read, error] of each truncated shard met, once each.
        start: the first position dealt in the regular way (0 until a remapped resume).
        leftovers: [position, samples already read] of the positions before `start` still
            to read, dealt round-robin over the slots before their regular positions; the
            same on every rank.
    """

    seed: int
    shuffle: bool
    block: int
    shards: int
    shard_list: int
    world_size: int
    rank: int
    workers: int
    slots: list[list[int]]
    batches: int = 0
    no_image: int = 0
    truncated: list[list] = field(default_factory=list)
    start: int = 0
    leftovers: list[list[int]] = field(default_factory=list)

    def advance(self, batch: StreamBatch) -> None:
        """Records that `batch` was drawn."""
        self.slots[batch.role] = list(batch.position)
        self.batches += 1
        self.no_image += batch.no_image
        known = {entry[0] for entry in self.truncated}
        self.truncated += [list(t) for t in batch.truncated if t[0] not in known]

    def lane(self, role: int, ordinal: int) -> tuple[int, int]:
        """The `ordinal`-th (position, samples to skip) that worker role `role` reads: its
        share of the leftovers, then every (ranks x workers)-th position from `start`."""
        count = self.world_size * self.workers
        slot = role * self.world_size + self.rank
        owned = len(range(slot, len(self.leftovers), count))
        if ordinal < owned:
            position, skip = self.leftovers[slot + ordinal * count]
            return position, skip
        return self.start + (ordinal - owned) * count + slot, 0

    def epoch(self) -> int:
        """The oldest epoch a slot is still reading."""
        return min(self.lane(role, ordinal)[0] // self.shards
                   for role, (ordinal, _) in enumerate(self.slots))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ShardStream(torch.utils.data.IterableDataset):
    """An endless, exactly resumable stream of batches from tar shards.

    The trainer calls `configure` and iterates a DataLoader over it (`loader`); for one
    pass in order, use `iter_samples` instead.

    Args:
        shards: a shard spec (see `expand_shards`).
        decode: turns a `Sample` into a dataset item (a tensor, `(tensor, label)`, an
            `UndecodableImage`, ...), or None to skip it as having no image.
        select: keeps a sample when true (e.g. a `KeySplit`); others are passed over.
        seed: fixes the shard order per epoch and the block shuffle.
        shuffle: shuffle the shard order per epoch, and blocks within shards.
        shuffle_block: samples per shuffled block within a shard (1: tar order); each worker
            holds one block's raw bytes.

    Raises:
        FileNotFoundError, ValueError: from `expand_shards`.
    """

    def __init__(self, shards: str | Path | Sequence[str], decode: Callable[[Sample], Any], *,
                 select: Callable[[Sample], bool] | None = None, seed: int = 0,
                 shuffle: bool = True, shuffle_block: int = 256) -> None:
        super().__init__()
        if shuffle_block < 1:
            raise ValueError(f"shuffle_block must be at least 1, got {shuffle_block}")
        self.spec = shards
        self.shards = expand_shards(shards)
        self.decode = decode
        self.select = select
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_block = shuffle_block
        self.index = read_dataset_index(self.shards)
        # Set by `configure` before a loader starts; workers get copies.
        self._batch_size = 1
        self._collate: Callable[[list], Any] = list
        self._state: StreamState | None = None
        self._num_workers = 0

    # -- order --------------------------------------------------------------------------------

    def shard_order(self, epoch: int) -> list[int]:
        """The shard indices in the order epoch `epoch` deals them."""
        if not self.shuffle:
            return list(range(len(self.shards)))
        rng = np.random.default_rng(mixed_seed(self.seed, epoch))
        return rng.permutation(len(self.shards)).tolist()

    def _blocks(self, shard_index: int, epoch: int, skip: int,
                problems: ShardProblems) -> Iterator[Sample]:
        """The shard's samples in block-shuffled order, from the `skip`-th on."""
        url = self.shards[shard_index]
        size = self.shuffle_block if self.shuffle else 1
        first = skip // size * size  # whole blocks before the resume point are not decoded
        block: list[Sample] = []
        number = first // size

        def shuffled(samples: list[Sample], number: int) -> list[Sample]:
            if size == 1:
                return samples
            rng = np.random.default_rng(mixed_seed(self.seed, epoch, shard_index, number))
            return [samples[i] for i in rng.permutation(len(samples))]

        emitted = first
        for sample in read_shard(url, shard_index, epoch=epoch, skip=first, problems=problems):
            block.append(sample)
            if len(block) == size:
                for item in shuffled(block, number):
                    if emitted >= skip:
                        yield item
                    emitted += 1
                block, number = [], number + 1
        for item in shuffled(block, number):  # the shard's last, partial block
            if emitted >= skip:
                yield item
            emitted += 1

    # -- the trainer's side -------------------------------------------------------------------

    def configure(self, batch_size: int, collate: Callable[[list], Any], *, rank: int = 0,
                  world_size: int = 1, workers: int = 0, state: dict | None = None
                  ) -> StreamState:
        """Sets up this rank's stream, fresh or from a checkpoint's state; returns the state
        the caller advances with each batch drawn.

        Raises:
            ValueError: when the saved state was made with another shard list, seed, number
                of processes or of workers, naming what differs (`ShardSource` remaps every
                rank's states onto other processes and workers first, see `reshard.py`).
        """
        roles = max(workers, 1)

        listed = "\n".join(self.shards).encode("utf-8", "surrogateescape")  # names are bytes
        fresh = StreamState(self.seed, self.shuffle, self.shuffle_block, len(self.shards),
                            zlib.crc32(listed), world_size, rank, roles,
                            [[0, 0] for _ in range(roles)])
        if state is not None:
            saved = StreamState(**copy.deepcopy(state))  # advancing must not edit `state`
            differs = {name: (getattr(saved, name), getattr(fresh, name))
                       for name in ("seed", "shuffle", "block", "shards", "shard_list",
                                    "world_size", "rank", "workers")
                       if getattr(saved, name) != getattr(fresh, name)}
            if differs:
                raise ValueError(
                    "the checkpoint's shard stream was read with " + ", ".join(
                        f"{name} {old}" for name, (old, _) in differs.items())
                    + "; this run has " + ", ".join(
                        f"{name} {new}" for name, (_, new) in differs.items())
                    + (": resume with the same shards and seed" if differs.keys() - _LAYOUT
                       else ": remap every rank's states with reshard.resharded_state")
                    + " (or start afresh with --overwrite)")
            fresh = saved
        self._batch_size, self._collate, self._state = batch_size, collate, fresh
        self._num_workers = workers
        return fresh

    def loader(self, generator: torch.Generator | None = None,
               worker_init_fn: Callable[[int], None] | None = None,
               pin_memory: bool = False) -> torch.utils.data.DataLoader:
        """A DataLoader of `StreamBatch`es for the configured rank (see `configure`)."""
        if self._state is None:
            raise RuntimeError("ShardStream.configure must be called before loader()")
        return torch.utils.data.DataLoader(
            self, batch_size=None, num_workers=self._num_workers, generator=generator,
            worker_init_fn=worker_init_fn if self._num_workers else None,
            pin_memory=pin_memory, collate_fn=_identity)

    def __iter__(self) -> Iterator[StreamBatch]:
        state = self._state
        if state is None:
            raise RuntimeError("ShardStream.configure must be called before iterating")
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        role = (worker + state.batches) % state.workers
        slot_count = state.world_size * state.workers
        ordinal, consumed = state.slots[role]
        problems = ShardProblems()
        items, names, no_image, idle = [], [], 0, 0
        while True:
            position, skip = state.lane(role, ordinal)
            consumed = max(consumed, skip)  # a leftover comes with samples read before
            epoch, within = divmod(position, len(self.shards))
            shard_index = self.shard_order(epoch)[within]
            read_any = consumed > 0  # resumed at a shard's end: read before, not empty
            for sample in self._blocks(shard_index, epoch, consumed, problems):
                read_any = True
                consumed += 1
                if self.select is not None and not self.select(sample):
                    continue
                item = self.decode(sample)
                if item is None:
                    no_image += 1
                    logger.debug("skipping %s: no image (fields %s)", sample.name,
                                 sorted(sample.fields))
                    continue
                items.append(item)
                if not isinstance(item, UndecodableImage):  # the collate drops those
                    names.append((epoch, sample.shard, sample.key))
                if len(items) == self._batch_size:
                    yield StreamBatch(self._collate(items), names, role, (ordinal, consumed),
                                      no_image, list(problems.truncated))
                    items, names, no_image = [], [], 0
                    problems.truncated.clear()  # the shard being read still holds it
            idle = 0 if read_any else idle + 1
            if idle >= slot_count * len(self.shards):
                raise ValueError(f"worker {role} of rank {state.rank} read no sample from "
                                 f"{idle} shards in a row: are the shards of {self.spec} "
                                 "empty?")
            ordinal, consumed = ordinal + 1, 0

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description for the run configuration."""
        return {"type": type(self).__name__, "shards": len(self.shards),
                "first": self.shards[0], "last": self.shards[-1], "seed": self.seed,
                "shuffle": self.shuffle, "shuffle_block": self.shuffle_block}


def _identity(batch: Any) -> Any:
    return batch

