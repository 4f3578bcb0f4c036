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

    rates = {name: args.batch_size / m for name, m in medians.items()}
    result = {
        "variant": args.variant, "image_size": args.image_size, "batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "max_abs_difference": difference, "images_per_second": rates,
        "ratio_vlm_vit_over_timm": rates["vlm-vit"] / rates["timm"],
    }
    print(f"{args.variant} at {args.image_size}, batch {args.batch_size}, "
          f"{result['threads']} threads, median of {args.repeats}")
    for name, rate in rates.items():
        print(f"  {name:<8} {rate:8.2f} images/s")
    print(f"  ratio vlm-vit / timm: {result['ratio_vlm_vit_over_timm']:.3f} "
          f"(max |difference| {difference:.2e})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
