"""One rank of `fsdp_memory.py`, started by torchrun:

    torchrun --nproc_per_node 2 benchmarks/fsdp_memory_worker.py --strategy fsdp --out DIR

Builds the MAE objective and applies the strategy as `Trainer.fit` does (`distributed.setup`,
`distributed.shard`, `Optimization.build`, `distributed.wrap`), then runs real steps on random
pixels: forward, backward, gradient clipping, AdamW. Right after the first `optimizer.step()`,
while the gradients still exist, it counts the bytes this rank holds in parameters, gradients
and optimizer state (the distinct storages behind the local tensors: `to_local()` of a DTensor,
so a padded shard counts with its padding and FSDP2's flat gradient buffer once). Writes
DIR/rank{R}.json with those bytes, the step times and the process's peak memory: the resident
set's high-water mark (VmHWM) on a CPU, the CUDA allocator's peak on a GPU.

On a CPU the two figures need glibc's allocator set two ways. glibc raises its mmap threshold
as large blocks are freed (up to 32 MiB), after which FSDP2's per-step gathers and gradient
buffers come from the heap, whose freed pages stay resident: on vit-b/16 the resident set grew
by 0.2-0.4 GB a step and its high-water mark matched DDP's. So the first `MEMORY_STEPS` steps
run with the threshold fixed at 1 MiB (every larger tensor mapped and unmapped on its own: the
mark follows live memory, but each fresh buffer faults its pages in, which slowed FSDP2's
steps 1.3-3x on vit-b/16; DDP's buckets persist), and the timed steps, after one more warm-up
step, at 32 MiB (glibc's own ceiling, where its default settles). `--default-malloc` leaves
glibc alone.

On a single process the trainer never shards; here `--strategy fsdp` on one process still
applies FSDP2 (over a one-rank group), so a one-GPU machine measures FSDP2's own overhead.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import torch
from timing import flush_denormals

import vlm_vit.train.distributed as distributed
from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.pretrain.build import build_objective
from vlm_vit.processor import NORMALIZATION
from vlm_vit.train import TrainConfig
from vlm_vit.train.fsdp import shard as fully_shard_objective
from vlm_vit.train.optim import Optimization

MEMORY_STEPS = 2  # the second step starts with the moments already allocated
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also stops its adjustment
MEMORY_THRESHOLD, TIMING_THRESHOLD = 1 << 20, 32 << 20


def set_mmap_threshold(size: int) -> bool:
    """glibc's `mallopt(M_MMAP_THRESHOLD, size)`; False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, size))
    except (OSError, AttributeError):
        return False


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the local shard of a DTensor, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def held_bytes(objective: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the distinct storages behind this rank's parameters, gradients and optimizer
    state (AdamW's `exp_avg`, `exp_avg_sq` and `step`); a storage shared by several tensors
    counts once, under the first kind that reaches it."""
    seen: set[tuple[str, int]] = set()
    counted = {"parameters": 0, "gradients": 0, "optimizer": 0}

    def add(kind: str, tensor: torch.Tensor) -> None:
        storage = local(tensor).untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            counted[kind] += storage.nbytes()

    for parameter in objective.parameters():
        add("parameters", parameter)
        if parameter.grad is not None:
            add("gradients", parameter.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add("optimizer", value)
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--variant", default="vit-l/16")
    parser.add_argument("--depth", type=int, help="fewer blocks than the variant")
    parser.add_argument("--image-size", type=int, default=64,
                        help="the side of the images fed (the position table is resampled; "
                             "the parameters stay the variant's)")
    parser.add_argument("--batch-size", type=int, default=2, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps, after the "
                        "memory steps and one warm-up step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's mmap threshold to adjust itself")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fixed_malloc = args.device == "cpu" and not args.default_malloc and \
        set_mmap_threshold(MEMORY_THRESHOLD)
    baseline_rss = status_bytes("VmRSS")  # after the imports, before any model
    trace: list[tuple[str, int, int]] = []  # (where, resident set, its high-water mark so far)

    def note(where: str) -> None:
        trace.append((where, status_bytes("VmRSS"), status_bytes("VmHWM")))

    context = distributed.setup(args.device)
    device = context.device
    precision = "bf16" if args.dtype == "bfloat16" else "fp32"
    one_rank_group = args.strategy == "fsdp" and not context.is_distributed
    if one_rank_group:  # FSDP2 needs a process group even for one rank
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method="env://", rank=0, world_size=1)
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        flush_denormals(keep=False)  # as the trainer does on a CPU
    else:
        torch.cuda.reset_peak_memory_stats()

    torch.manual_seed(0)
    config = EncoderConfig.from_name(args.variant,
                                     **({"depth": args.depth} if args.depth else {}))
    mean, std = NORMALIZATION["inception"]
    objective = build_objective("mae", VisionEncoder(config), mean=mean, std=std)
    parameters = sum(p.numel() for p in objective.parameters())
    objective.to(device).train()
    note("built")
    settings = TrainConfig(steps=MEMORY_STEPS + 1 + args.steps,
                           batch_size=args.batch_size * context.world_size,
                           strategy=args.strategy, precision=precision, device=args.device)
    if one_rank_group:
        fully_shard_objective(objective, device, precision=precision)
    else:
        distributed.shard(objective, context, args.strategy, precision=precision)
    optimization = Optimization.build(objective, settings, device.type)
    optimizer = optimization.optimizer
    model = distributed.wrap(objective, context, args.strategy)
    note("strategy applied")

    generator = torch.Generator().manual_seed(context.rank)
    pixels = torch.randn(args.batch_size, 3, args.image_size, args.image_size,
                         generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    held: dict[str, int] = {}
    seconds: list[float] = []
    peak = 0
    for step in range(MEMORY_STEPS + 1 + args.steps):
        if step == MEMORY_STEPS:  # memory measured; the rest is timing
            peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                    else status_bytes("VmHWM"))
            if fixed_malloc:
                set_mmap_threshold(TIMING_THRESHOLD)
        if device.type == "cuda":
            torch.cuda.synchronize()
        distributed.barrier(context)
        started = time.perf_counter()
        with autocast:
            loss = model(pixels).loss.float()
        loss.backward()
        trained = [p for p in objective.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(trained, settings.grad_clip)
        optimizer.step()
        if step == 0:  # gradients, parameters and both moments all exist now
            held = held_bytes(objective, optimizer)
            note("first optimizer step")
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        distributed.barrier(context)
        if step > MEMORY_STEPS:
            seconds.append(time.perf_counter() - started)
        note(f"step {step + 1}")

    result = {"rank": context.rank, "world_size": context.world_size,
              "strategy": args.strategy, "parameters": parameters,
              "held_bytes": held, "held_bytes_total": sum(held.values()),
              "peak_memory_bytes": peak,
              "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda"
              else "resident set high-water mark (VmHWM)",
              "baseline_rss_bytes": baseline_rss, "rss_trace": trace,
              "malloc": f"mmap threshold {MEMORY_THRESHOLD} B while measuring memory, "
              f"{TIMING_THRESHOLD} B while timing" if fixed_malloc else "default",
              "step_seconds": seconds, "median_step_seconds": statistics.median(seconds),
              "loss": float(loss.detach())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{context.rank}.json").write_text(json.dumps(result, indent=2))
    if one_rank_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    distributed.teardown(context)


if __name__ == "__main__":
    main()
