"""How encoding cost grows: with the batch (linear) and with the image size (tokens), where
the attention term grows with the square of the token count.

    python benchmarks/scaling.py --variant vit-s/16

Reports seconds per image against batch size at a fixed size, and against image side at
batch 1, beside the model's multiply-adds per image (`vlm_vit.flops.count_macs`), so the
measured growth can be read against the arithmetic.
"""

from __future__ import annotations

import argparse

import torch
from timing import (
    add_model_arguments,
    alternate,
    autocast,
    config_from_args,
    synchronized,
    write_json,
)

from vlm_vit import VisionEncoder
from vlm_vit.flops import count_macs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-s/16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sides", type=int, nargs="+", default=[112, 224, 336, 448])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = config_from_args(args)
    torch.manual_seed(0)
    encoder = VisionEncoder(config).eval().to(args.device)
    side = config.image_size[0]
    rows = []

    def timed(inputs: dict) -> dict:
        return alternate({key: synchronized(lambda x=x: encoder(x), args.device)
                          for key, x in inputs.items()}, args.repeats)

    with torch.inference_mode(), autocast(args.device, getattr(torch, args.dtype)):
        batch_inputs = {b: torch.randn(b, 3, side, side, device=args.device)
                        for b in args.batches}
        per_batch = timed(batch_inputs)
        for b, seconds in per_batch.items():
            rows.append({"axis": "batch", "batch": b, "side": side,
                         "tokens": encoder.config.num_prefix_tokens + (side // config.patch_size)
                         ** 2, "seconds_per_image": seconds / b,
                         "gmacs_per_image": count_macs(config, (side, side)) / 1e9})
        size_inputs = {s: torch.randn(1, 3, s, s, device=args.device) for s in args.sides}
        per_side = timed(size_inputs)
        for s, seconds in per_side.items():
            rows.append({"axis": "size", "batch": 1, "side": s,
                         "tokens": encoder.config.num_prefix_tokens + (s // config.patch_size) ** 2,
                         "seconds_per_image": seconds,
                         "gmacs_per_image": count_macs(config, (s, s)) / 1e9})
    print(f"{args.variant} ({config.depth} blocks), {args.device} {args.dtype}: seconds per image")
    print(f"  {'axis':<6}{'batch':>6}{'side':>6}{'tokens':>8}{'GMACs':>9}{'s/image':>10}"
          f"{'GMAC/s':>9}")
    for row in rows:
        rate = row["gmacs_per_image"] / row["seconds_per_image"]
        print(f"  {row['axis']:<6}{row['batch']:>6}{row['side']:>6}{row['tokens']:>8}"
              f"{row['gmacs_per_image']:>9.2f}{row['seconds_per_image']:>10.4f}{rate:>9.1f}")
    write_json(args.json, {"variant": args.variant, "depth": config.depth,
                           "device": args.device, "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
