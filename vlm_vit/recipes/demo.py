"""The demo recipe (`vlm-vit demo`): the whole path on a fresh machine, with no downloads.

Pretrains small ViTs (the arms: MAE by default; MPP, ibot, I-JEPA, CAPI) on the unlabelled
half of scikit-learn's handwritten digits from one random initialisation, then fine-tunes each
whole with k labels per class beside that random initialisation (the paper's protocol), each
arm with its own recipe chosen on a validation split of the labelled half (`--sweep`, or the
recorded choices), and reports held-out accuracy against k over three seeds, with frozen-
feature probes and raw pixels beside them; encodes scikit-image's photos through two poolers,
and writes a report, a label-efficiency figure and a loss plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from vlm_vit.io.files import atomic_write
from vlm_vit.optional import require
from vlm_vit.processor import NORMALIZATION, ImageProcessor
from vlm_vit.recipes import demo_state
from vlm_vit.recipes.demo_pretrain import pretrain, random_init
from vlm_vit.recipes.demo_report import plot_label_efficiency, plot_losses, print_report
from vlm_vit.recipes.demo_scoring import pixel_baseline, score_arms, sweep
from vlm_vit.recipes.demo_state import ARMS, DEFAULTS, QUICK, RECIPES, DemoData

logger = logging.getLogger(__name__)

VALIDATION_FRACTION = 0.2  # of the training half; the labelled pool is the rest



def write_digits(root: Path, per_class: int | None) -> int:
    """scikit-learn's 8 x 8 digits as 32 x 32 PNGs, one sub-folder per class."""
    import numpy as np
    from PIL import Image

    datasets = require("sklearn.datasets", "train", "the demo's digits")
    digits = datasets.load_digits()
    counts: dict[int, int] = {}
    for index, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        if per_class is not None and counts.get(int(label), 0) >= per_class:
            continue
        counts[int(label)] = counts.get(int(label), 0) + 1
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16.0 * 255).astype(np.uint8)  # 17 grey levels, 0..16
        Image.fromarray(pixels).resize((32, 32), Image.Resampling.BICUBIC).save(
            folder / f"{index:04d}.png")
    return sum(counts.values())


def demo_splits(labels, seed: int):
    """Row indices (train, pool, validation, test): the training half (pretrained on,
    unlabelled), inside it the labelled pool and a validation split, and the held-out half.
    Settings are chosen on validation; test is scored once."""
    from vlm_vit.eval import stratified_split

    train, test = stratified_split(labels, test_fraction=0.5, seed=seed)
    pool_part, validation_part = stratified_split(labels[train], VALIDATION_FRACTION, seed=seed)
    return train, train[pool_part], train[validation_part], test


def label_counts(values: list[str]) -> list[int | None]:
    """`--labels` as ints per class, None for 'all'; errors name the bad value."""
    counts = []
    for value in values:
        if value == "all":
            counts.append(None)
        elif value.isdigit() and int(value) > 0:
            counts.append(int(value))
        else:
            raise ValueError(f"--labels takes positive numbers or 'all', got {value!r}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"--labels lists a count twice: {' '.join(values)}")
    return counts


def run(args: argparse.Namespace) -> int:
    """The demo, from `vlm-vit demo`'s arguments: prints its table and writes its outputs
    under `args.out`; returns the exit status."""
    schedule = _schedule(args)
    command = getattr(args, "command_line", None) or f"vlm-vit demo --out {args.out}"
    finished = demo_state.open_run(args.out, demo_state.settings(args, schedule), command,
                                   resume=args.resume, overwrite=args.overwrite)
    started = time.perf_counter()
    data = _prepare_digits(args, schedule["counts"])
    mean, std = NORMALIZATION["inception"]
    processor = ImageProcessor(size=32, mean=mean, std=std)
    start = random_init(args)
    counts, seeds = schedule["counts"], schedule["seeds"]
    keys = ["all" if count is None else str(count) for count in counts]
    report = _report_head(args, data, keys, counts, start)
    starts, losses = {}, {}
    for arm in schedule["arms"]:  # every arm pretrained before anything is scored
        report["arms"][arm] = {"pretraining": None}
        starts[arm] = start
        if arm != "scratch":
            starts[arm], report["arms"][arm]["pretraining"], losses[arm] = pretrain(
                args, arm, start, schedule["steps"], command, processor)
    images = processor([str(f) for f in data.files])
    with _terminated_as_interrupt():
        recipes = schedule["recipes"]
        if recipes is None:  # --sweep: chosen on the validation split
            recipes, report["sweep"] = sweep(args, starts, images, data, finished)
        report["finetune"] = {"seeds": seeds, "labels": keys,
                              "recipes_from": schedule["recipes_from"]}
        score_arms(args, report, starts, recipes, images, data, keys, counts, seeds, finished)
    report["pixels"] = pixel_baseline(images, data, keys, counts, seeds, args.shots,
                                      args.seed)
    _write_outputs(args, report, starts, losses, processor, started)
    print_report(report, data.classes)
    out = args.out
    print(f"report: {out / 'report.json'}, figure: {out / 'label_efficiency.png'}, encoders: "
          f"{out / 'encoders'} ({report['seconds']:.0f} s)")
    return 0


def _write_outputs(args: argparse.Namespace, report: dict, starts: dict, losses: dict,
                   processor: ImageProcessor, started: float) -> None:
    """The photos through the first pretrained arm (random init if none), the plots and
    `report.json`."""
    out = args.out
    shown = next((arm for arm in starts if arm != "scratch"), "scratch")
    report["photos"] = {"encoder": shown, **_encode_photos(starts[shown], processor)}
    report["loss_plot"] = "loss.png" if plot_losses(losses, out / "loss.png") else None
    report["label_efficiency_plot"] = ("label_efficiency.png" if plot_label_efficiency(
        report, out / "label_efficiency.png") else None)
    report["seconds"] = round(time.perf_counter() - started, 1)
    with atomic_write(out / "report.json", "w") as handle:
        json.dump(report, handle, indent=2)


def _schedule(args: argparse.Namespace) -> dict:
    """The arms, pretraining steps, seeds (the preset's unless given), the label counts and
    each arm's fine-tuning recipe (None: `--sweep` chooses them), checked."""
    preset = QUICK if args.quick else DEFAULTS
    steps = preset["steps"] if args.steps is None else args.steps
    seeds = preset["seeds"] if args.seeds is None else args.seeds
    counts = label_counts(args.labels)
    for name, value in (("--steps", steps), ("--finetune-steps", args.finetune_steps),
                        ("--seeds", seeds), ("--workers", args.workers)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if args.finetune_lr is not None and not args.finetune_lr > 0:
        raise ValueError(f"--finetune-lr must be positive, got {args.finetune_lr}")
    given = [flag for flag, value in (("--finetune-lr", args.finetune_lr),
                                      ("--finetune-steps", args.finetune_steps))
             if value is not None]
    if args.sweep and given:
        raise ValueError(f"--sweep chooses each arm's fine-tuning lr and steps: drop "
                         f"{' and '.join(given)}, or --sweep")
    if args.objective is not None:
        arms = ["scratch", args.objective]
    elif args.arms is None:
        arms = list(DEFAULTS["arms"])
    else:
        arms = list(ARMS) if "all" in args.arms else list(dict.fromkeys(args.arms))
    recipes = None if args.sweep else {
        arm: {"lr": RECIPES[arm]["lr"] if args.finetune_lr is None else args.finetune_lr,
              "steps": RECIPES[arm]["steps"] if args.finetune_steps is None
              else args.finetune_steps} for arm in arms}
    recipes_from = "sweep" if args.sweep else "flags" if given else "recorded"
    return {"arms": arms, "steps": steps, "seeds": seeds, "counts": counts,
            "recipes": recipes, "recipes_from": recipes_from}


def _prepare_digits(args: argparse.Namespace, counts: list[int | None]) -> DemoData:
    """The digits written once under `args.out`, split, and the unlabelled training half
    copied to the folder pretraining reads."""
    from vlm_vit.eval import read_class_folder

    out = args.out
    data = out / "data" / "digits"
    if not data.is_dir():
        print(f"writing scikit-learn's digits to {data}")
        write_digits(data, args.images_per_class)
    files, labels, classes = read_class_folder(data)
    train, pool, validation, test = demo_splits(labels, args.seed)
    scored = test if args.eval_on == "test" else validation
    fewest = int(np.bincount(labels[pool]).min())
    if max((count for count in counts if count is not None), default=0) > fewest:
        raise ValueError(f"--labels {' '.join(args.labels)}: the labelled pool has only "
                         f"{fewest} images of its smallest class")
    pretrain_dir = out / "pretrain_images"  # the unlabelled training half only
    if not pretrain_dir.is_dir():
        pretrain_dir.mkdir(parents=True)
        for index in train:
            (pretrain_dir / f"{index:05d}.png").write_bytes(files[index].read_bytes())
    return DemoData(files, labels, classes, train, pool, validation, test, scored, fewest)


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the fine-tuning runs as Ctrl-C does (the finished ones are recorded),
    saying how to continue."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        logger.warning("the demo was stopped while fine-tuning; the runs that finished are "
                       "recorded: continue with --resume")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_head(args: argparse.Namespace, data: DemoData, keys: list[str],
                 counts: list[int | None], start) -> dict:
    """The report's settings and splits; the arms come after."""
    from vlm_vit.recipes.label_efficiency import fingerprint

    print(f"{len(data.files)} digits in {len(data.classes)} classes: {len(data.train)} to "
          f"pretrain on (labels from {len(data.pool)} of them, {len(data.validation)} for "
          f"validation), {len(data.test)} held out; scoring on the {args.eval_on} images")
    return {"classes": len(data.classes), "train_images": len(data.train),
            "test_images": len(data.test), "labelled_pool": len(data.pool),
            "validation_images": len(data.validation), "evaluated_on": args.eval_on,
            "scored_images": len(data.scored), "shots": args.shots, "pooling": "mean",
            "labelled_per_class": {key: count or data.fewest
                                   for key, count in zip(keys, counts, strict=True)},
            "encoder": start.config.to_dict(), "start_fingerprint": fingerprint(start),
            "sweep": None, "arms": {}}


def _encode_photos(encoder, processor: ImageProcessor) -> dict:
    """scikit-image's three photos through the encoder and two poolers: each pooler's output
    shape."""
    import torch
    from skimage import data as photos

    from vlm_vit.poolers import build_pooler

    pixels = processor([photos.astronaut(), photos.coffee(), photos.chelsea()])
    shapes = {}
    with torch.inference_mode():
        tokens = encoder(pixels)
        for name in ("mean", "pixel_shuffle"):
            pooler = build_pooler(name, in_dim=encoder.config.width).eval()
            pooled = pooler(tokens.tokens, num_prefix_tokens=tokens.num_prefix_tokens,
                            grid=tokens.grid)
            shapes[name] = list(pooled.shape)
    return shapes


