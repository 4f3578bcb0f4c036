"""Pretraining on a GPU: a few hundred steps of each objective on vit-b/16 at 224, in bf16.

    python benchmarks/gpu_pretrain.py --steps 300 --batch-size 128   # one call, < 8 minutes

Trains on random crops of scikit-image's photos (shipped with the package, no downloads),
checks that each loss falls, and prints images/s and peak GPU memory. Exits with status 2
when no GPU is present; CPU tests never need it.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from timing import write_json

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.cli.pretrain import build_objective
from vlm_vit.processor import NORMALIZATION


def write_photos(folder: Path) -> None:
    from PIL import Image
    from skimage import data

    for name in ("astronaut", "coffee", "chelsea", "rocket", "camera", "cat", "hubble_deep_field",
                 "immunohistochemistry", "motorcycle_left", "retina"):
        image = getattr(data, name)()
        Image.fromarray(image).convert("RGB").save(folder / f"{name}.png")


def run_objective(name: str, data: Path, out: Path, args: argparse.Namespace) -> dict:
    from vlm_vit.data.folders import ImageFolder
    from vlm_vit.train import TrainConfig, Trainer

    mean, std = NORMALIZATION["inception"]
    torch.manual_seed(0)
    encoder = VisionEncoder(EncoderConfig.from_name(args.variant))
    objective = build_objective(name, encoder, mean=mean, std=std)
    dataset = ImageFolder(data, 224, mean=mean, std=std, seed=0)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=1.5e-4 * args.batch_size
                         / 256 * 4, warmup_steps=args.steps // 10, precision="bf16",
                         checkpoint_every=0, num_workers=args.workers, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = Trainer(objective, dataset, config, out / name, command=" ".join(sys.argv)).fit()
    seconds = time.perf_counter() - started
    with open(out / name / "metrics.csv") as handle:
        rates = [float(row["images_per_s"]) for row in csv.DictReader(handle)]
    first = statistics.mean(result.losses[:10])
    last = statistics.mean(result.losses[-10:])
    return {"objective": name, "steps": result.step, "first_loss": first, "last_loss": last,
            "loss_fell": last < first, "median_images_per_s": statistics.median(rates[5:]),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "wall_seconds": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vit-b/16")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        data, out = Path(scratch, "photos"), Path(scratch, "runs")
        data.mkdir()
        write_photos(data)
        results = [run_objective(name, data, out, args) for name in ("mpp", "mae")]
    print(f"{args.variant} at 224, bf16, batch {args.batch_size}, {torch.cuda.get_device_name()}")
    for r in results:
        print(f"  {r['objective']}: loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} "
              f"({'falls' if r['loss_fell'] else 'DOES NOT FALL'}), "
              f"{r['median_images_per_s']:.0f} images/s, peak {r['peak_memory_gib']:.1f} GiB")
    write_json(args.json, results)
    return 0 if all(r["loss_fell"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
