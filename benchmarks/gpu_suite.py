"""The benchmark suite on a GPU in bf16, in one call of under eight minutes.

    python benchmarks/gpu_suite.py --out gpu.json             # on a machine with CUDA
    python benchmarks/gpu_suite.py --tiny                     # the same logic, CPU, toy sizes

Runs `run_all.py`'s `gpu` preset (every script under autocast bf16: bf16 matmuls, LayerNorm
and the softmax inside SDPA in float32) and then prints, for vit-b/16 and clip-vit-l/14-336,
images/s and MFU: the encoder's FLOP/s over this GPU's bf16 matmul rate measured in the same
run, beside the ratio against timm on the same weights (target: at least 1.0). The preset's
"fsdp memory" run (`fsdp_memory.py`) starts `torchrun --nproc_per_node N` on all N visible
GPUs (NCCL) for vit-l/16 MAE steps in bf16, once with DDP and once with FSDP2, and the summary
gives both strategies' step times and peak CUDA memory per rank (on one GPU FSDP2 runs over a
one-rank group: its own overhead, nothing sharded). Without CUDA it says so and exits with
status 2; `--tiny` runs the `tiny` preset on the CPU in bf16 instead, so the script is
exercised where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from run_all import PRESETS, environment, print_table, run_benchmarks

MFU_BENCHMARKS = ("encode vit-b/16", "encode clip-vit-l/14-336")
FSDP_BENCHMARK = "fsdp memory"
BUDGET_SECONDS = 8 * 60


def summary(results: dict) -> list[str]:
    """One line per encoder: images/s, MFU and the ratio against timm."""
    lines = []
    for name in MFU_BENCHMARKS:
        result = results.get(name)
        if result is None:
            lines.append(f"  {name}: not run")
            continue
        lines.append(
            f"  {result['variant']:<18} {result['images_per_second']['vlm-vit']:9.1f} images/s, "
            f"MFU {result['fraction_of_matmul_peak']:.1%} (of {result['matmul_peak_gflops']:.0f} "
            f"GFLOP/s {result['dtype']} measured), vs timm "
            f"{result['ratio_vlm_vit_over_timm']:.3f}")
    return lines


def fsdp_summary(results: dict) -> list[str]:
    """FSDP2 against DDP: step time and peak memory per rank, and the held state's ratio."""
    result = results.get(FSDP_BENCHMARK)
    if result is None:
        return [f"  {FSDP_BENCHMARK}: not run"]
    ddp, fsdp = result["ddp"], result["fsdp"]
    gib = 2**30
    return [
        f"  {result['variant']} MAE, {result['ranks']} x {result['device']} "
        f"({result['backend']}, {result['dtype']}), batch {result['batch_size']} per rank:",
        f"    step       DDP {ddp['median_step_seconds']:.3f} s, FSDP2 "
        f"{fsdp['median_step_seconds']:.3f} s (x{result['time_ratio_fsdp_over_ddp']:.3f})",
        f"    peak mem   DDP {ddp['peak_memory_bytes_per_rank'] / gib:.2f} GiB, FSDP2 "
        f"{fsdp['peak_memory_bytes_per_rank'] / gib:.2f} GiB "
        f"(x{result['peak_memory_ratio_fsdp_over_ddp']:.3f}; {result['peak_memory_kind']})",
        f"    weights+grads+AdamW per rank x{result['memory_ratio_fsdp_over_ddp']:.3f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="no GPU needed: toy sizes on the CPU, in bf16")
    parser.add_argument("--only", nargs="+", choices=sorted(PRESETS["gpu"]), metavar="NAME")
    parser.add_argument("--out", type=Path, help="write every result to this JSON file")
    args = parser.parse_args(argv)
    if not (args.tiny or torch.cuda.is_available()):
        print("no CUDA device: gpu_suite.py needs a GPU (run it with --tiny to exercise it on "
              "the CPU)", file=sys.stderr)
        return 2
    preset = "tiny" if args.tiny else "gpu"
    extra = ["--device", "cpu" if args.tiny else "cuda", "--dtype", "bfloat16"]
    only = [name for name in PRESETS[preset]  # loading reads files: it has no device
            if name != "load" and (not args.only or name in args.only)]
    started = time.perf_counter()
    results, failures = run_benchmarks(preset, only, extra)
    seconds = time.perf_counter() - started
    print_table(results, failures)
    print(f"\nbf16 encode on {environment()['machine']} ({seconds:.0f} s in all, budget "
          f"{BUDGET_SECONDS} s):")
    print("\n".join(summary(results)))
    print("\nFSDP2 against DDP (torchrun):")
    print("\n".join(fsdp_summary(results)))
    if args.out:
        args.out.write_text(json.dumps({"environment": environment(), "preset": preset,
                                        "seconds": seconds, "results": results}, indent=2))
    return 1 if failures or seconds > BUDGET_SECONDS else 0


if __name__ == "__main__":
    sys.exit(main())
