"""`vlm-vit demo`: the whole path on a fresh machine, with no downloads.

Pretrains a small ViT with the paper's masked patch prediction on scikit-learn's handwritten
digits, measures few-shot and linear-probe accuracy of its frozen features against the same
encoder at random initialisation on held-out digits, encodes scikit-image's photos through two
poolers, and writes a report with a loss plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from vlm_vit.config import EncoderConfig
from vlm_vit.files import atomic_write
from vlm_vit.optional import require
from vlm_vit.processor import NORMALIZATION, ImageProcessor

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="pretrain, evaluate and encode on bundled data (no downloads)",
        description=__doc__.splitlines()[0] + " " + " ".join(__doc__.splitlines()[2:6]))
    parser.add_argument("--out", type=Path, default=Path("vlm-vit-demo"), metavar="DIR")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--patch-size", type=int, default=4, help="pixels; images are 32 x 32")
    parser.add_argument("--shots", type=int, default=10, help="examples per class, few-shot")
    parser.add_argument("--images-per-class", type=int, default=None,
                        help="use at most this many digits per class (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)


def write_digits(root: Path, per_class: int | None) -> int:
    """scikit-learn's 8 x 8 digits as 32 x 32 PNGs, one sub-folder per class."""
    import numpy as np
    from PIL import Image

    datasets = require("sklearn.datasets", "train", "the demo's digits")
    digits = datasets.load_digits()
    counts: dict[int, int] = {}
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        if per_class is not None and counts.get(int(label), 0) >= per_class:
            continue
        counts[int(label)] = counts.get(int(label), 0) + 1
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16.0 * 255).astype(np.uint8)  # 17 grey levels, 0..16
        Image.fromarray(pixels).resize((32, 32), Image.Resampling.BICUBIC).save(
            folder / f"{index:04d}.png")
    return sum(counts.values())


def frozen_accuracy(encoder, files, labels, train, test, processor, shots, seed) -> dict:
    """Few-shot and linear-probe accuracy of mean-pooled frozen features on held-out images."""
    from vlm_vit.evaluate import extract_features, few_shot_accuracy, linear_probe_accuracy

    features, _ = extract_features(encoder, [str(f) for f in files], pooling="mean",
                                   processor=processor, batch_size=128, progress=False)
    features = features.numpy()
    return {
        "few_shot_accuracy": few_shot_accuracy(features[train], labels[train], features[test],
                                               labels[test], shots=shots, seed=seed),
        "linear_probe_accuracy": linear_probe_accuracy(features[train], labels[train],
                                                       features[test], labels[test]),
    }


def plot_losses(losses: list[float], path: Path) -> bool:
    """A PNG of the pretraining loss; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is missing: no loss plot (pip install 'vlm-vit[train]')")
        return False
    figure, axes = plt.subplots(figsize=(5, 3), dpi=100)
    axes.plot(range(1, len(losses) + 1), losses, linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("masked patch prediction loss")
    axes.set_title("pretraining on digits")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from vlm_vit.cli.pretrain import build_objective
    from vlm_vit.evaluate import read_class_folder, stratified_split
    from vlm_vit.model import VisionEncoder
    from vlm_vit.poolers import build_pooler
    from vlm_vit.train import TrainConfig, Trainer
    from vlm_vit.train.data import ImageFolder

    started = time.perf_counter()
    out = args.out
    data = out / "data" / "digits"
    if not data.is_dir():
        print(f"writing scikit-learn's digits to {data}")
        write_digits(data, args.images_per_class)
    files, labels, classes = read_class_folder(data)
    train, test = stratified_split(labels, test_fraction=0.5, seed=args.seed)
    pretrain_dir = out / "pretrain_images"  # the unlabelled training half only
    if not pretrain_dir.is_dir():
        pretrain_dir.mkdir(parents=True)
        for index in train:
            (pretrain_dir / f"{index:05d}.png").write_bytes(files[index].read_bytes())

    mean, std = NORMALIZATION["inception"]
    config = EncoderConfig(image_size=32, patch_size=args.patch_size, width=args.width,
                           depth=args.depth, heads=4, mlp_width=4 * args.width)
    processor = ImageProcessor(size=32, mean=mean, std=std)
    torch.manual_seed(args.seed)
    random_init = VisionEncoder(config)
    encoder = VisionEncoder(config)
    encoder.load_state_dict(random_init.state_dict())  # the same starting point
    print(f"{len(files)} digits in {len(classes)} classes: {len(train)} to pretrain and "
          f"train the probes on, {len(test)} held out")

    objective = build_objective("mpp", encoder, mean=mean, std=std)
    dataset = ImageFolder(pretrain_dir, 32, mean=mean, std=std, scale=(0.6, 1.0), flip=False,
                          seed=args.seed)
    train_config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=2e-3,
                               warmup_steps=max(1, args.steps // 10), weight_decay=0.05,
                               checkpoint_every=0, seed=args.seed, num_workers=0,
                               log_every=max(1, args.steps // 10), device="cpu")
    if args.quiet:
        logging.getLogger("vlm_vit.train").setLevel(logging.WARNING)
    result = Trainer(objective, dataset, train_config, out / "run",
                     command=f"vlm-vit demo --out {out}", progress_bar=not args.quiet).fit()
    encoder = objective.encoder.eval()
    encoder.save_pretrained(out / "encoder")
    processor.save_pretrained(out / "encoder")

    report = {"classes": len(classes), "train_images": len(train), "test_images": len(test),
              "shots": args.shots, "pooling": "mean",
              "pretraining": {"objective": "mpp", "steps": result.step,
                              "first_loss": result.losses[0], "final_loss": result.losses[-1],
                              "encoder": config.to_dict()}}
    for name, model in (("random_init", random_init.eval()), ("pretrained", encoder)):
        report[name] = frozen_accuracy(model, files, labels, train, test, processor,
                                       args.shots, args.seed)

    from skimage import data as photos

    images = [photos.astronaut(), photos.coffee(), photos.chelsea()]
    pixels = processor(images)
    report["photos"] = {}
    with torch.inference_mode():
        tokens = encoder(pixels)
        for name in ("mean", "pixel_shuffle"):
            pooler = build_pooler(name, in_dim=config.width).eval()
            pooled = pooler(tokens.tokens, num_prefix_tokens=tokens.num_prefix_tokens,
                            grid=tokens.grid)
            report["photos"][name] = list(pooled.shape)
    report["loss_plot"] = "loss.png" if plot_losses(result.losses, out / "loss.png") else None
    report["seconds"] = round(time.perf_counter() - started, 1)
    with atomic_write(out / "report.json", "w") as handle:
        json.dump(report, handle, indent=2)

    chance = 1 / len(classes)
    print(f"\n{'held-out accuracy':<26}{'random init':>12}{'pretrained':>12}   (chance "
          f"{chance:.2f})")
    for metric, label in (("few_shot_accuracy", f"{args.shots}-shot linear (LS)"),
                          ("linear_probe_accuracy", "linear probe (logistic)")):
        print(f"{label:<26}{report['random_init'][metric]:>12.3f}"
              f"{report['pretrained'][metric]:>12.3f}")
    print(f"\npretraining loss {result.losses[0]:.3f} -> {np.mean(result.losses[-10:]):.3f} "
          f"over {result.step} steps")
    for name, shape in report["photos"].items():
        print(f"3 photos through '{name}': {shape}")
    print(f"report: {out / 'report.json'}, encoder: {out / 'encoder'} "
          f"({report['seconds']:.0f} s)")
    return 0
