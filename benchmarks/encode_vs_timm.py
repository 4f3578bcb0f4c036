"""Encode throughput against timm, Hugging Face CLIP and open_clip on identical weights.

    python benchmarks/encode_vs_timm.py                            # clip-vit-b/16, all three
    python benchmarks/encode_vs_timm.py --variant vit-b/16 --anchors timm
    python benchmarks/encode_vs_timm.py --device cuda --dtype bfloat16 --batch-size 256

Every model encodes all tokens (after the final norm) of the same pixels; the candidates
alternate call by call after a warm-up, so machine noise hits them alike, and the figure that
carries over between machines is the ratio of the medians. The anchors are built on our
weights by the repository's converters (`anchors.py`); transformers and open_clip hold
CLIP-shaped encoders only and are skipped, with a note, for other variants. The same run
measures the machine's matrix-multiply rate (float32 on a CPU, bf16 on a GPU) and reports the
share of it the encoder reaches (MFU on a GPU). `--compile` times `torch.compile`d models
(every candidate), with the compile time reported apart.
"""

from __future__ import annotations

import argparse
import time

import torch
from anchors import ANCHORS, build_anchor
from timing import (
    add_model_arguments,
    alternate,
    autocast,
    config_from_args,
    matmul_peak_flops,
    synchronized,
    write_json,
)

from vlm_vit import VisionEncoder
from vlm_vit.flops import count_macs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "clip-vit-b/16")
    parser.add_argument("--anchors", nargs="+", choices=ANCHORS, default=list(ANCHORS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--peak-sides", type=int, nargs="+",
                        help="square matmul sides for the peak (default: three large ones)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    config = config_from_args(args)
    ours = VisionEncoder(config).eval()
    calls = {"vlm-vit": ours}
    skipped = {}
    for name in args.anchors:
        try:
            model, call = build_anchor(name, ours)
        except ValueError as error:
            skipped[name] = str(error)
            continue
        model.eval().to(args.device)
        calls[name] = call
    ours.to(args.device)
    pixels = torch.randn(args.batch_size, 3, *config.image_size, device=args.device)

    compile_seconds = {}
    if args.compile:
        calls = {name: torch.compile(call) for name, call in calls.items()}
    with torch.inference_mode(), autocast(args.device, dtype):
        reference = ours(pixels).tokens.float()
        difference = {}
        for name, call in calls.items():
            started = time.perf_counter()
            out = call(pixels)
            out = out.tokens if name == "vlm-vit" else out
            compile_seconds[name] = time.perf_counter() - started
            difference[name] = (out.float() - reference[:, -out.shape[1]:]).abs().max().item()
        medians = alternate({name: synchronized(lambda c=c: c(pixels), args.device)
                             for name, c in calls.items()}, args.repeats, args.warmup)
    peak = matmul_peak_flops(args.device, dtype, sides=args.peak_sides)
    encoder_flops = 2 * count_macs(config) * args.batch_size / medians["vlm-vit"]

    rates = {name: args.batch_size / m for name, m in medians.items()}
    result = {
        "variant": args.variant, "image_size": list(config.image_size), "depth": config.depth,
        "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype,
        "compiled": args.compile, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "max_abs_difference": difference, "images_per_second": rates,
        **{f"ratio_vlm_vit_over_{name}": rates["vlm-vit"] / rates[name]
           for name in rates if name != "vlm-vit"},
        "skipped": skipped, "matmul_peak_gflops": peak / 1e9,
        "encoder_gflops": encoder_flops / 1e9, "fraction_of_matmul_peak": encoder_flops / peak,
    }
    if args.compile:
        result["first_call_seconds"] = compile_seconds
    print(f"{args.variant} at {config.image_size[0]}, batch {args.batch_size}, {args.device} "
          f"{args.dtype}{', compiled' if args.compile else ''}, {result['threads']} threads, "
          f"median of {args.repeats}")
    for name, rate in rates.items():
        ratio = "" if name == "vlm-vit" else (
            f"   vlm-vit / {name}: {rates['vlm-vit'] / rate:.3f} "
            f"(max |difference| {difference[name]:.2e})")
        print(f"  {name:<13} {rate:9.2f} images/s{ratio}")
    for name, reason in skipped.items():
        print(f"  {name:<13} skipped: {reason}")
    print(f"  {encoder_flops / 1e9:.1f} GFLOP/s = {result['fraction_of_matmul_peak']:.0%} of this "
          f"machine's measured matmul peak ({peak / 1e9:.1f} GFLOP/s, {args.dtype})")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
