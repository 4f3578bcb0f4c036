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
