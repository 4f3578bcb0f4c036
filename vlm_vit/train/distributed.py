"""Data-parallel training with `torchrun`: process setup, DDP wrapping and sharded batches.

    torchrun --nproc_per_node 8 -m your_recipe ...

Each process reads `RANK`, `WORLD_SIZE` and `LOCAL_RANK` from the environment torchrun sets,
joins a process group (NCCL on CUDA, gloo on CPU) and trains a DDP-wrapped copy of the
objective. Every global batch is one slice of a permutation seeded by (seed, epoch); rank r
takes the r-th of its `world_size` equal parts, so the images a step sees do not depend on
the number of processes.

Rank 0 alone logs, writes metrics and checkpoints; every rank reads the checkpoint to resume,
so the run directory must be on a file system all processes share.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlm_vit.data.sampler import GlobalBatchSampler, batches_per_epoch
from vlm_vit.train.signals import LauncherWatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands.

    Attributes:
        rank: this process's index, 0 to world_size - 1.
        world_size: the number of processes.
        local_rank: the index on this machine (the CUDA device it uses).
        device: the device this process trains on.
        owns_group: whether `setup` created the process group (and `teardown` destroys it).
        launcher: under torchrun, what ends this process once torchrun is gone (`setup` arms
            it, `FailureWatch` polls it, `teardown` disarms it); None otherwise.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False
    launcher: LauncherWatch | None = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes metrics and checkpoints."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 when not launched by torchrun), before any
    process group exists."""
    return _env_int("RANK", 0)


def launched_rank_and_world() -> tuple[int, int]:
    """This process's RANK and the WORLD_SIZE from the environment (torchrun sets both), or
    (0, 1) when neither is set: for commands that split work by rank without a process
    group (`vlm-vit encode` over shards).

    Raises:
        ValueError: when only one is set, either is not an integer, or RANK is outside
            0..WORLD_SIZE-1.
    """
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return 0, 1
    try:
        values = int(rank or ""), int(world or "")
    except ValueError:
        raise ValueError(f"RANK={rank!r} and WORLD_SIZE={world!r} must both be set to integers "
                         "(torchrun sets them)") from None
    if not 0 <= values[0] < values[1]:
        raise ValueError(f"RANK={rank} must lie in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return values


def launched_local_rank() -> int | None:
    """LOCAL_RANK as torchrun set it (this process's GPU on its node), or None."""
    value = os.environ.get("LOCAL_RANK")
    return None if value is None else _env_int("LOCAL_RANK", 0)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """A device from a config string; "auto" is CUDA when available, else CPU.

    Under torchrun, a bare "cuda" means this process's device, `cuda:LOCAL_RANK`.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available")
        if resolved.index is None:
            resolved = torch.device("cuda", local_rank)
    return resolved


def setup(device: str = "auto") -> DistributedContext:
    """Joins the process group torchrun describes, or returns a single-process context.

    Args:
        device: "auto", "cpu", "cuda", "cuda:N", ...

    Returns:
        The context; `owns_group` is False when the group already existed (the caller set
        it up) or there is a single process.

    Raises:
        ValueError: for malformed torchrun variables or a rank outside the world.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} does not fit WORLD_SIZE={world_size}")
    resolved = resolve_device(device, local_rank)
    # torchrun's workers live in sessions of their own: a kill of torchrun reaches none.
    launcher = LauncherWatch(rank).arm() if "TORCHELASTIC_RUN_ID" in os.environ else None
    if world_size == 1:
        return DistributedContext(device=resolved, launcher=launcher)

    import torch.distributed as dist

    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)  # NCCL and all_gather_object use the current device
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if resolved.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world_size)
        owns = True
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"the process group has rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, the environment says {rank} of {world_size}")
    if rank == 0:
        logger.info("data parallel on %d processes (%s backend)", world_size, dist.get_backend())
    return DistributedContext(rank, world_size, local_rank, resolved, owns, launcher)


_FAILED_KEY = "vlm_vit/failed"


CLOSE_WAIT_SECONDS = 10.0  # beyond one poll: a store call in flight finishes within it


class FailureWatch:
    """Makes every rank stop at once when one fails, with that rank's one-line error.

    A rank that raises (bad data, out of memory) never reaches the next collective, so the
    others would wait in it until the collective timeout (30 minutes by default). Instead
    the failing rank writes its error to the rendezvous store torchrun runs (`fail`), and a
    daemon thread on every rank polls for it, prints it on one line and ends the process
    (exit status 1) without waiting for anything. The same thread checks at every poll that
    torchrun itself still runs (`context.launcher`), and goes on checking once the store is gone.

    Args:
        context: this process's place; a single process watches no store.
        poll_seconds: how often the store and the launcher are asked.
    """

    def __init__(self, context: DistributedContext, poll_seconds: float = 0.5) -> None:
        import threading

        self.context, self.poll_seconds = context, poll_seconds
        self.key = f"{_FAILED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.store = _store() if context.is_distributed else None
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None or context.launcher is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="vlm-vit-failure-watch")
            self._thread.start()

    def fail(self, error: BaseException) -> None:
        """Tells the other ranks that this one failed with `error`."""
        if self.store is None:
            return
        reason = (str(error).strip().splitlines() or [""])[0][:500]
        message = f"rank {self.context.rank} failed: {type(error).__name__}: {reason}"
        self._stop.set()  # this rank raises normally; it need not watch any more
        with contextlib.suppress(Exception):  # a store gone (the launcher ended): nobody to tell
            self.store.set(self.key, message)

    def close(self) -> None:
        """Stops watching and waits for the thread to leave the store: a daemon thread still
        inside a store call when the interpreter exits aborts the process ("terminate called
        without an active exception", C++ unwinding through a release of the GIL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_seconds + CLOSE_WAIT_SECONDS)

    def _watch(self) -> None:
        store, launcher = self.store, self.context.launcher
        while not self._stop.wait(self.poll_seconds):
            if launcher is not None:
                launcher.check()
                if launcher.being_killed():
                    continue  # a store call to a dying torchrun fails, printing C++ stacks
            if store is None:
                continue
            try:
                if not store.check([self.key]):
                    continue
                message = store.get(self.key).decode(errors="replace")
            except Exception:  # the store closed: the run is ending, or torchrun is gone
                store = None
                continue
            if self._stop.is_set():
                return
            import sys

            print(f"vlm-vit: rank {self.context.rank} stopping: {message}", file=sys.stderr,
                  flush=True)
            os._exit(1)


def _store():
    """A client of the store torchrun serves at MASTER_ADDR:MASTER_PORT, of its own (the
    watch thread never shares the process group's connection), or None without one."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return None
    import datetime

    import torch.distributed as dist

    try:
        return dist.TCPStore(address, int(port), is_master=False,
                             timeout=datetime.timedelta(seconds=30))
    except Exception as error:
        logger.warning("cannot reach the rendezvous store at %s:%s (%s); a failing rank will "
                       "not stop the others early", address, port, error)
        return None


def teardown(context: DistributedContext) -> None:
    """Destroys the process group if `setup` created it, and stops watching the launcher."""
    if context.launcher is not None:
        context.launcher.disarm()
    if context.owns_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def shard(objective: nn.Module, context: DistributedContext, strategy: str = "ddp", *,
          precision: str = "fp32", cpu_offload: bool = False) -> None:
    """The first half of a strategy, before the optimiser is built: "fsdp" shards the
    objective in place over the processes (`vlm_vit.train.fsdp`); "ddp", and any strategy on
    one process, leave it whole.
    """
    if cpu_offload and context.device.type != "cuda":
        raise ValueError(f"cpu_offload moves a GPU's parameters and optimizer state to host "
                         f"memory; this run trains on {context.device} already")
    if strategy == "fsdp" and context.is_distributed:
        from vlm_vit.train.fsdp import shard as fully_shard_objective

        fully_shard_objective(objective, context.device, precision=precision,
                              cpu_offload=cpu_offload)


def wrap(module: nn.Module, context: DistributedContext, strategy: str = "ddp") -> nn.Module:
    """The second half, after the optimiser and the resume: the module in
    DistributedDataParallel when there are several processes and the strategy is "ddp",
    else itself (an FSDP2-sharded module synchronises itself).

    DDP copies rank 0's parameters and buffers to every rank here, so all ranks start (and,
    since gradients are averaged, stay) identical.
    """
    if not context.is_distributed or strategy == "fsdp":
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids)


def no_sync(module: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's `no_sync` (skip the gradient all-reduce of an accumulation micro-batch), or a no-op."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


def barrier(context: DistributedContext) -> None:
    """Waits for every process (no-op for one)."""
    if context.is_distributed:
        import torch.distributed as dist

        dist.barrier()


def all_reduce(values: torch.Tensor, context: DistributedContext, op: str = "sum") -> torch.Tensor:
    """Sums (or takes the min / max of) a tensor over processes, returning it on the CPU.

    Args:
        values: any shape; float64 keeps counts and loss sums exact.
        op: "sum", "min" or "max".
    """
    if not context.is_distributed:
        return values
    import torch.distributed as dist

    reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    # NCCL reduces device tensors only; gloo CPU ones.
    moved = values.to(context.device)
    dist.all_reduce(moved, op=reduce_op)
    return moved.cpu()


def all_gather_objects(value: Any, context: DistributedContext) -> list[Any]:
    """Every process's `value` (picklable), in rank order."""
    if not context.is_distributed:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def split_batch(batch_size: int, world_size: int, grad_accumulation: int) -> tuple[int, int]:
    """Images per process per step, and per micro-batch.

    Raises:
        ValueError: when `batch_size` is not a multiple of world_size x grad_accumulation.
    """
    parts = world_size * grad_accumulation
    if batch_size % parts:
        raise ValueError(
            f"batch_size {batch_size} must be divisible by world_size {world_size} x "
            f"grad_accumulation {grad_accumulation} = {parts}"
        )
    return batch_size // world_size, batch_size // parts


# The sampler moved to vlm_vit.data.sampler; its names stay importable from here.
__all__ = ["DistributedContext", "FailureWatch", "GlobalBatchSampler", "all_gather_objects",
           "all_reduce", "barrier", "batches_per_epoch", "launched_rank", "no_sync",
           "resolve_device", "setup", "shard", "split_batch", "teardown", "wrap"]
