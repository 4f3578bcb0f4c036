"""Encode throughput against timm on identical weights, in one process.

    python benchmarks/encode_vs_timm.py --variant vit-b/16 --batch-size 8 --repeats 10

The two models alternate call by call after a warm-up, so machine noise hits both alike;
the figure that carries over between machines is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import alternate

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.convert.timm import build_timm_model
from vlm_vit.flops import count_macs


def matmul_peak_gflops(side: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matrix-multiply rate, measured now: the reference for how much
    of the hardware the encoder uses."""
    a, b = torch.randn(side, side), torch.randn(side, side)
    seconds = alternate({"mm": lambda: a @ b}, repeats)["mm"]
    return 2 * side**3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vit-b/16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    ours = VisionEncoder(EncoderConfig.from_name(args.variant, image_size=args.image_size)).eval()
    theirs = build_timm_model(ours.config).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    pixels = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    with torch.inference_mode():
        difference = (ours(pixels).tokens - theirs.forward_features(pixels)).abs().max().item()
        medians = alternate({"vlm-vit": lambda: ours(pixels),
                             "timm": lambda: theirs.forward_features(pixels)},
                            args.repeats, args.warmup)
        peak = matmul_peak_gflops()
    encoder_gflops = 2 * count_macs(ours.config) * args.batch_size / medians["vlm-vit"] / 1e9

    rates = {name: args.batch_size / m for name, m in medians.items()}
    result = {
        "variant": args.variant, "image_size": args.image_size, "batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "max_abs_difference": difference, "images_per_second": rates,
        "ratio_vlm_vit_over_timm": rates["vlm-vit"] / rates["timm"],
        "matmul_peak_gflops": peak, "encoder_gflops": encoder_gflops,
        "fraction_of_matmul_peak": encoder_gflops / peak,
    }
    print(f"{args.variant} at {args.image_size}, batch {args.batch_size}, "
          f"{result['threads']} threads, median of {args.repeats}")
    for name, rate in rates.items():
        print(f"  {name:<8} {rate:8.2f} images/s")
    print(f"  ratio vlm-vit / timm: {result['ratio_vlm_vit_over_timm']:.3f} "
          f"(max |difference| {difference:.2e})")
    print(f"  {encoder_gflops:.1f} GFLOP/s = {result['fraction_of_matmul_peak']:.0%} of this "
          f"machine's measured matmul peak ({peak:.1f} GFLOP/s, float32 2048^3)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
