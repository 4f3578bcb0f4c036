"""One protocol for every source of training batches, and its two implementations.

The trainer configures a source for its rank, iterates `loader()` (endless: the source moves
from epoch to epoch itself) and checkpoints `state_dict()`; a resume hands back every rank's
saved state through `load_state_dict`. Whether the samples come from a map-style dataset (a
folder) or a stream of tar shards is decided once, by `as_source`.

Exact resume: a source's order and augmentation are functions of (seed, epoch, position),
never of the global RNG, so its state is a few integers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from vlm_vit.data.folders import describe_dataset
from vlm_vit.data.sampler import GlobalBatchSampler, batches_per_epoch
from vlm_vit.data.samples import mixed_seed
from vlm_vit.data.shards.reshard import resharded_state
from vlm_vit.data.shards.spec import is_shard_spec
from vlm_vit.data.shards.stream import ShardStream, StreamState


@dataclass
class SourceBatch:
    """One batch a source yields.

    Attributes:
        batch: what the collate function made of this rank's items.
        samples: (epoch, shard, key) of each sample in it, for the sample log; None where the
            source does not name its samples (a folder).
    """

    batch: Any
    samples: list[tuple[int, str, str]] | None = None


@runtime_checkable
class DataSource(Protocol):
    """Batches for one rank, and the state that resumes them exactly."""

    names_samples: bool  # its batches carry `samples` (TrainConfig.log_samples)

    def configure(self, batch_size: int, collate: Callable[[list], Any], *, seed: int,
                  rank: int, world_size: int, workers: int,
                  group_by_length: bool = False) -> None:
        """Sets the source up, fresh, for this rank: `batch_size` items per rank per step."""

    def loader(self, *, pin_memory: bool = False,
               worker_init_fn: Callable[[int], None] | None = None) -> Iterator[SourceBatch]:
        """This rank's batches, endlessly, from where the state stands; the state moves past
        each batch as it is yielded."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's position, JSON-ready; a checkpoint holds every rank's."""

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Continues from a checkpoint's states, one per rank of the run that wrote it (how
        they map onto this run's ranks is the source's business)."""

    def position(self) -> tuple[int, int]:
        """(epoch, batches drawn in it, or in all for a stream), for the run's progress."""

    def skipped(self) -> dict[str, Any]:
        """What this rank passed over: "no_image" (a count) and "truncated" (shards)."""

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description for the run configuration."""


class MapSource:
    """A map-style dataset (`ImageFolder`, `LabelledImageFolder`, ...) as a source.

    Epoch e visits a permutation seeded by (seed, e) in global batches (`GlobalBatchSampler`,
    the last incomplete batch dropped); the state is (epoch, next batch within it), the same
    for every rank. A dataset with `set_epoch(epoch)` has it called before each epoch's
    loader starts; its randomness must depend only on (epoch, index), as ImageFolder's does.
    """

    names_samples = False

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset
        self.epoch = self.batch_index = 0

    def configure(self, batch_size: int, collate: Callable[[list], Any], *, seed: int = 0,
                  rank: int = 0, world_size: int = 1, workers: int = 0,
                  group_by_length: bool = False) -> None:
        """See `DataSource.configure`.

        Raises:
            ValueError: when the dataset is smaller than one global batch, or
                `group_by_length` is set and the dataset has no `lengths`.
        """
        self.global_batch_size = batch_size * world_size
        self.steps_per_epoch = batches_per_epoch(len(self.dataset), self.global_batch_size)
        if group_by_length and getattr(self.dataset, "lengths", None) is None:
            raise ValueError(f"group_by_length needs a dataset with `lengths`; "
                             f"{type(self.dataset).__name__} has none")
        self.collate, self.seed, self.rank, self.world_size = collate, seed, rank, world_size
        self.workers, self.group_by_length = workers, group_by_length
        self.epoch = self.batch_index = 0

    def loader(self, *, pin_memory: bool = False,
               worker_init_fn: Callable[[int], None] | None = None) -> Iterator[SourceBatch]:
        while True:
            for batch in self._epoch_loader(pin_memory, worker_init_fn):
                self.batch_index += 1
                if self.batch_index == self.steps_per_epoch:
                    self.epoch, self.batch_index = self.epoch + 1, 0
                yield SourceBatch(batch)

    def _epoch_loader(self, pin_memory: bool, worker_init_fn: Callable[[int], None] | None
                      ) -> torch.utils.data.DataLoader:
        """This rank's batches of the current epoch from the current batch on."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)  # workers start afresh per loader and copy this
        sampler = GlobalBatchSampler(
            len(self.dataset), self.global_batch_size, seed=self.seed, epoch=self.epoch,
            start_batch=self.batch_index, rank=self.rank, world_size=self.world_size,
            lengths=self.dataset.lengths if self.group_by_length else None)
        # The loader draws its workers' base seed from this generator; without one it would
        # draw from the global RNG, which the objective's draws must not depend on.
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, self.epoch, self.rank))
        return torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, collate_fn=self.collate,
            num_workers=self.workers, pin_memory=pin_memory, generator=generator,
            worker_init_fn=worker_init_fn if self.workers else None)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        # Every rank stands at the same batch, so any number of ranks may resume it.
        self.epoch, self.batch_index = int(states[0]["epoch"]), int(states[0]["batch_index"])

    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch_index

    def skipped(self) -> dict[str, Any]:
        return {"no_image": 0, "truncated": []}

    def describe(self) -> dict[str, Any]:
        return describe_dataset(self.dataset)


class ShardSource:
    """A `ShardStream` (tar shards) as a source; its state is the rank's `StreamState`."""

    names_samples = True

    def __init__(self, stream: ShardStream) -> None:
        self.stream = stream
        self._state: StreamState | None = None

    def configure(self, batch_size: int, collate: Callable[[list], Any], *, seed: int = 0,
                  rank: int = 0, world_size: int = 1, workers: int = 0,
                  group_by_length: bool = False) -> None:
        if group_by_length:
            raise ValueError("group_by_length needs a map-style dataset with `lengths`; a "
                             "shard stream has none")
        self._settings = dict(batch_size=batch_size, collate=collate, rank=rank,
                              world_size=world_size, workers=workers)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._state = self.stream.configure(batch_size, collate, rank=rank,
                                            world_size=world_size, workers=workers)

    def loader(self, *, pin_memory: bool = False,
               worker_init_fn: Callable[[int], None] | None = None) -> Iterator[SourceBatch]:
        state = self._state
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, state.batches,
                                                             self.rank))
        for drawn in self.stream.loader(generator=generator, worker_init_fn=worker_init_fn,
                                        pin_memory=pin_memory):
            state.advance(drawn)  # a StreamBatch: where this rank's stream stands after it
            yield SourceBatch(drawn.batch, drawn.samples)

    def state_dict(self) -> dict[str, Any]:
        return self._state.to_dict()

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Continues from every old rank's state: as it is on the same processes and
        workers, else remapped onto this run's (`resharded_state`), each sample of the epoch
        not yet read then read exactly once.

        Raises:
            ValueError: when the states disagree with one another, or come from another
                shard list, seed, shuffle or block (`ShardStream.configure`).
        """
        settings = dict(self._settings)
        state = resharded_state(states, rank=self.rank, world_size=self.world_size,
                                workers=settings["workers"])
        self._state = self.stream.configure(settings.pop("batch_size"), settings.pop("collate"),
                                            **settings, state=state)

    def position(self) -> tuple[int, int]:
        return self._state.epoch(), self._state.batches

    def skipped(self) -> dict[str, Any]:
        return {"no_image": self._state.no_image,
                "truncated": [tuple(entry) for entry in self._state.truncated]}

    def describe(self) -> dict[str, Any]:
        return self.stream.describe()


def as_source(data: Any) -> DataSource:
    """`data` as a `DataSource`: a source as it is, a `ShardStream` as a `ShardSource`, any
    other (map-style) dataset as a `MapSource`."""
    if isinstance(data, ShardStream):
        return ShardSource(data)
    if isinstance(data, DataSource):
        return data
    return MapSource(data)


def storage(spec: Any, name: str | None = None, *, check_folder: bool = True
            ) -> Literal["shards", "folder"]:
    """What `spec` names: tar shards (see `is_shard_spec`) or a folder. The one place that
    decides; `open_source`, and every command that reads a folder or shards, asks it.

    Args:
        spec: a shard spec or a folder.
        name: how the caller's user gave it (`--data`), for the error.
        check_folder: refuse a `spec` that is neither shards nor an existing folder; without
            it, anything but shards is "folder", for a caller that reads the path and names
            what is missing in its own words (or reads a file there, as the LLM plugin's
            conversations).

    Raises:
        FileNotFoundError: when `spec` is neither (and `check_folder`).
    """
    if is_shard_spec(spec):
        return "shards"
    if check_folder and not Path(spec).is_dir():
        raise FileNotFoundError(f"{f'{name} ' if name else ''}{spec} is neither a folder nor "
                                "tar shards")
    return "folder"


def open_source(spec: Any, decode: Any, *, seed: int = 0,
                select: Callable[[Any], bool] | None = None,
                name: str | None = None) -> DataSource:
    """The source `spec` names, over the items `decode` makes.

    Args:
        spec: tar shards (a brace pattern, a glob, a list, a folder of `.tar` files, a URL)
            or an image folder.
        decode: turns a shard `Sample` into a dataset item (`ImageDecode`, a plugin's
            decoder); its `folder(root)` is the map-style dataset of the same items over a
            folder.
        seed: the shards' order and block shuffle (a folder's order comes from the trainer).
        select: keeps a shard sample when true (a `KeySplit`).
        name: as in `storage`.

    Returns:
        A `ShardSource` over the shards, or a `MapSource` over `decode.folder(spec)`.

    Raises:
        FileNotFoundError: when `spec` is neither tar shards nor a folder.
    """
    if storage(spec, name) == "shards":
        return ShardSource(ShardStream(spec, decode, seed=seed, select=select))
    return MapSource(decode.folder(Path(spec)))
