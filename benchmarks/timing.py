"""Alternating timing shared by the benchmarks: every figure is a ratio of medians measured
in one process, the candidates taking turns so machine noise hits them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(calls: dict[str, Callable[[], object]], repeats: int,
              warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each named callable, after `warmup` rounds, taking turns.

    The order flips every round (A B, B A, ...), so neither candidate always runs straight
    after the other's allocations and cache traffic.
    """
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else names[::-1]:
            call = calls[name]
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def peak_memory_mib(run: Callable[[], object], device: str) -> float:
    """The peak memory `run` adds, in MiB: the CUDA allocator's peak on a GPU; on a CPU the
    growth of the resident set's high-water mark, reset through /proc/self/clear_refs (Linux).
    Run it in a fresh process per candidate, after building the model, so they do not mix."""
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    base = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - base) / 1024


def peak_memory_in_child(script: str, arguments: list[str]) -> float:
    """Runs `script` with `arguments` (which must make it print `peak_memory_mib` of its work
    as the last line) in a fresh process, and returns that number."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, script, *arguments], capture_output=True,
                            text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1])


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), for a result's `cpu` field."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def synchronized(call: Callable[[], object], device: str) -> Callable[[], object]:
    """`call` that waits for the device to finish, so the time taken is the work's."""
    if device != "cuda":
        return call
    import torch

    def wrapped() -> object:
        result = call()
        torch.cuda.synchronize()
        return result

    return wrapped


def matmul_peak_flops(device: str, dtype, repeats: int = 5,
                      sides: tuple[int, ...] | None = None) -> float:
    """The best rate of square matrix multiplies measured now, in FLOP/s (`dtype` on `device`:
    float32 on a CPU, bfloat16 on a GPU): the reference for the share of the hardware a model
    uses (MFU on a GPU). Several sides are tried and the fastest kept, so the reference is not
    flattered by an unlucky size."""
    import torch

    sides = sides or ((4096, 8192, 16384) if device == "cuda" else (1024, 2048, 4096))
    best = 0.0
    for side in sides:
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        seconds = alternate({"mm": synchronized(lambda a=a, b=b: a @ b, device)},
                            repeats)["mm"]
        best = max(best, 2 * side**3 / seconds)
    return best


def autocast(device: str, dtype):
    """Mixed precision for a float dtype below float32 (bf16 matmuls; LayerNorm and the softmax
    inside SDPA stay in float32 on a GPU), a no-op for float32."""
    import torch

    return torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)


def flush_denormals(keep: bool) -> None:
    """Treats denormal floats as zero on a CPU (unless `keep`), for every candidate alike.

    A training step on random data drives some gradients and Adam moments into the denormal
    range, where x86 arithmetic is up to a hundred times slower: at small sizes that, not the
    model, decides the step time. GPUs run denormals at full speed.
    """
    import torch

    torch.set_flush_denormal(not keep)


def add_timing_arguments(parser, repeats: int = 5, warmup: int = 1) -> None:
    """The timing options of the alternating benchmarks: `--repeats`, `--warmup`,
    `--keep-denormals` (see `flush_denormals`) and `--json`."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--json", help="also write the results to this file")


def add_model_arguments(parser, variant: str, image_size: int | None = None) -> None:
    """The options every benchmark shares: the model, its size, where and how it runs."""
    import torch

    cuda = torch.cuda.is_available()
    parser.add_argument("--variant", default=variant)
    parser.add_argument("--image-size", type=int, default=image_size,
                        help="the image side (default: the variant's)")
    parser.add_argument("--depth", type=int, help="fewer blocks than the variant (quick runs)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        default="bfloat16" if cuda else "float32",
                        help="bfloat16 runs under autocast")


def config_from_args(args):
    """The `EncoderConfig` the shared options name."""
    from vlm_vit import EncoderConfig

    overrides = {}
    if args.image_size:
        overrides["image_size"] = args.image_size
    if args.depth:
        overrides["depth"] = args.depth
    return EncoderConfig.from_name(args.variant, **overrides)


def write_json(path: str | None, result: dict) -> None:
    """Writes a script's result to `path` (its `--json` argument), when one was given."""
    if path:
        import json

        with open(path, "w") as handle:
            json.dump(result, handle, indent=2)
