"""Reading the same images from tar shards and from a folder: the data pipeline alone, and
`vlm-vit encode`, with one and two processes.

    python benchmarks/shards_vs_folder.py --json shards.json            # 4,000 images, CPU
    python benchmarks/shards_vs_folder.py --images 400 --repeats 1 --no-encode

The workload is `--images` small real photos (crops of scikit-image's sample photos and
scikit-learn's digits, 96 x 128 JPEG, quality 90), written once as a folder and once as
WebDataset shards by `vlm_vit.data.shards.writer.write_shards` (`--per-shard` each).

- data: decode + pretraining augmentation (random-resized crop to 224, flip, normalise) of
  every image once, batches of 64, through the trainer's own loaders: `ImageFolder` under a
  DataLoader, and `ShardStream` (`configure(...).loader()`), with 1 and 2 worker processes.
  The candidates take turns (`timing.alternate`); medians of `--repeats` passes.
- encode: the wall time of `vlm-vit encode vit-ti/16 --random-init` over the folder (one
  process, writing one file) and over the shards (one process, and two processes started
  together with RANK=0/1, each encoding its half of the shards), every process with
  cores / processes threads. `--encode-repeats` alternating runs, medians.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from timing import alternate, write_json

BATCH = 64


def write_workload(root: Path, count: int, per_shard: int) -> tuple[Path, Path]:
    """`count` JPEGs in root/folder, and the same bytes as shards in root/shards."""
    from skimage import data as photos
    from sklearn.datasets import load_digits

    from vlm_vit.data.shards.writer import write_shards

    folder = root / "folder"
    folder.mkdir(parents=True)
    sources = [photos.astronaut(), photos.coffee(), photos.chelsea(), photos.rocket(),
               np.stack([photos.camera()] * 3, axis=-1)]
    digits = load_digits().images
    rng = np.random.default_rng(0)
    for index in range(count):
        if index % 4:
            source = sources[index % len(sources)]
            top = int(rng.integers(0, source.shape[0] - 192))
            left = int(rng.integers(0, source.shape[1] - 256))
            picture = Image.fromarray(source[top:top + 192, left:left + 256])
        else:
            digit = (digits[index % len(digits)] * 255 / 16).astype(np.uint8)
            picture = Image.fromarray(np.stack([digit] * 3, axis=-1))
        buffer = io.BytesIO()
        picture.resize((128, 96), Image.BICUBIC).save(buffer, format="JPEG", quality=90)
        (folder / f"{index:06d}.jpg").write_bytes(buffer.getvalue())
    shards = root / "shards"
    write_shards(folder, shards, per_shard=per_shard, shuffle=False, progress=False)
    return folder, shards


def data_passes(folder: Path, shards: Path, count: int) -> dict:
    """One full pass per candidate: loader construction, worker start-up and every batch."""
    import torch

    from vlm_vit.data.folders import Augmentation, ImageFolder
    from vlm_vit.data.samples import collate_images
    from vlm_vit.data.shards import ImageDecode, ShardStream
    from vlm_vit.processor import NORMALIZATION

    mean, std = NORMALIZATION["imagenet"]
    batches = count // BATCH
    images = ImageFolder(folder, 224, mean=mean, std=std)
    stream = ShardStream(shards, ImageDecode(Augmentation(224, mean=mean, std=std)),
                         shuffle=False)

    def folder_pass(workers: int):
        def run():
            loader = torch.utils.data.DataLoader(
                images, batch_size=BATCH, drop_last=True, num_workers=workers,
                collate_fn=collate_images)
            seen = sum(len(batch.pixel_values) for batch in loader)
            assert seen == batches * BATCH, seen
        return run

    def shard_pass(workers: int):
        def run():
            stream.configure(BATCH, collate_images, workers=workers)
            seen = 0
            for index, item in enumerate(stream.loader()):
                seen += len(item.batch.pixel_values)
                if index + 1 == batches:
                    break
            assert seen == batches * BATCH, seen
        return run

    return {"folder, 1 process": folder_pass(1), "folder, 2 processes": folder_pass(2),
            "shards, 1 process": shard_pass(1), "shards, 2 processes": shard_pass(2)}


def encode_runs(folder: Path, shards: Path, work: Path) -> dict:
    """The three `vlm-vit encode` jobs, each a callable that runs it to the end."""
    cores = os.cpu_count() or 1
    base = [sys.executable, "-m", "vlm_vit.cli", "encode", "vit-ti/16", "--random-init",
            "--quiet", "--batch-size", "32"]

    def environment(threads: int, **extra: str) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", **extra}

    def folder_job():
        out = work / "folder.safetensors"
        out.unlink(missing_ok=True)
        subprocess.run([*base, str(folder), "-o", str(out)], env=environment(cores),
                       check=True, capture_output=True)

    def shard_job(processes: int):
        def run():
            out = work / f"shards-{processes}"
            shutil.rmtree(out, ignore_errors=True)
            threads = max(cores // processes, 1)
            jobs = [subprocess.Popen(
                [*base, str(shards), "-o", str(out)], stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=environment(threads, RANK=str(rank), WORLD_SIZE=str(processes)))
                for rank in range(processes)]
            for job in jobs:
                _, error = job.communicate()
                if job.returncode:
                    raise RuntimeError(error.decode()[-2000:])
        return run

    return {"folder, 1 process": folder_job, "shards, 1 process": shard_job(1),
            "shards, 2 processes": shard_job(2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5, help="data-only passes, each")
    parser.add_argument("--encode-repeats", type=int, default=1)
    parser.add_argument("--no-encode", action="store_true", help="the data pipeline only")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.images < BATCH:
        raise SystemExit(f"--images must be at least one batch ({BATCH})")

    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        started = time.perf_counter()
        folder, shards = write_workload(root, args.images, args.per_shard)
        print(f"wrote {args.images} images as a folder and {len(list(shards.glob('*.tar')))} "
              f"shards in {time.perf_counter() - started:.1f} s")
        count = args.images // BATCH * BATCH
        seconds = alternate(data_passes(folder, shards, args.images), args.repeats)
        data = {name: count / value for name, value in seconds.items()}
        result = {
            "images": args.images, "per_shard": args.per_shard, "cpu_count": os.cpu_count(),
            "data_images_per_second": data,
            "data_ratio_shards_over_folder_1": data["shards, 1 process"]
            / data["folder, 1 process"],
            "data_ratio_shards_over_folder_2": data["shards, 2 processes"]
            / data["folder, 2 processes"],
            "data_ratio_2_over_1_shards": data["shards, 2 processes"]
            / data["shards, 1 process"],
            "data_ratio_2_over_1_folder": data["folder, 2 processes"]
            / data["folder, 1 process"],
        }
        if not args.no_encode:
            seconds = alternate(encode_runs(folder, shards, root), args.encode_repeats,
                                warmup=0)
            encode = {name: args.images / value for name, value in seconds.items()}
            result |= {
                "encode_images_per_second": encode,
                "encode_ratio_shards_over_folder": encode["shards, 1 process"]
                / encode["folder, 1 process"],
                "encode_ratio_2_over_1_shards": encode["shards, 2 processes"]
                / encode["shards, 1 process"],
            }
    for name, value in result.items():
        if isinstance(value, dict):
            for candidate, rate in value.items():
                print(f"{name} {candidate}: {rate:.1f}")
        else:
            print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
