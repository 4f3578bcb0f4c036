"""The demo recipe (`vlm-vit demo`): the whole path on a fresh machine, with no downloads.

Pretrains a small ViT (MAE by default; MPP, ibot, I-JEPA or CAPI) on the unlabelled half of
scikit-learn's handwritten digits, then fine-tunes it whole with k labels per class against
the same fine-tuning from the same random initialisation (the paper's protocol), and reports
held-out accuracy against k, with the frozen-feature probes beside it; encodes scikit-image's
photos through two poolers, and writes a report, a label-efficiency figure and a loss plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlm_vit.config import EncoderConfig
from vlm_vit.io.files import atomic_write
from vlm_vit.optional import require
from vlm_vit.processor import NORMALIZATION, ImageProcessor
from vlm_vit.recipes import demo_state
from vlm_vit.recipes.demo_state import DEFAULTS, QUICK, job_key

logger = logging.getLogger(__name__)

VALIDATION_FRACTION = 0.2  # of the training half; the labelled pool is the rest
MAE_SETTINGS = {"mask_ratio": 0.75, "decoder_width": 64, "decoder_depth": 2}  # sized to the demo


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


def frozen_accuracy(encoder, images, labels, train, test, shots, seed) -> dict:
    """Few-shot, k-NN (DINO's weighted vote, k = 20) and linear-probe accuracy of mean-pooled
    frozen features on held-out images (`images`: every digit's pixels, `[N, 3, 32, 32]`,
    preprocessed once for all uses)."""
    from vlm_vit.eval import (
        extract_features,
        few_shot_accuracy,
        knn_accuracy,
        linear_probe_accuracy,
    )

    # A generator of preprocessed batches, which extract_features takes as they are.
    features, _ = extract_features(encoder, iter(images.split(128)), pooling="mean",
                                   progress=False)
    features = features.numpy()
    return {
        "few_shot_accuracy": few_shot_accuracy(features[train], labels[train], features[test],
                                               labels[test], shots=shots, seed=seed),
        "knn_accuracy": knn_accuracy(features[train], labels[train], features[test],
                                     labels[test]),
        "linear_probe_accuracy": linear_probe_accuracy(features[train], labels[train],
                                                       features[test], labels[test]),
    }


def _pyplot(what: str):
    """matplotlib's pyplot on the Agg backend, or None (with a warning) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is missing: no %s (pip install 'vlm-vit[train]')", what)
        return None
    return plt


def plot_losses(losses: list[float], path: Path, objective: str = "mpp") -> bool:
    """A PNG of the pretraining loss; False when matplotlib is missing."""
    plt = _pyplot("loss plot")
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(5, 3), dpi=100)
    axes.plot(range(1, len(losses) + 1), losses, linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel(f"{OBJECTIVE_NAMES[objective]} loss")
    axes.set_title("pretraining on digits")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def plot_label_efficiency(report: dict, path: Path) -> bool:
    """Held-out accuracy against labels per class, pretrained and random init, each with the
    seeds' range; False when matplotlib is missing."""
    plt = _pyplot("label-efficiency figure")
    if plt is None:
        return False
    keys = list(report["random_init"]["finetune_accuracy"])
    counts = [report["labelled_per_class"][key] for key in keys]
    figure, axes = plt.subplots(figsize=(5, 3.5), dpi=100)
    for arm, label in (("random_init", "random init"),
                       ("pretrained", f"pretrained ({report['pretraining']['objective']})")):
        results = [report[arm]["finetune_accuracy"][key] for key in keys]
        median = [r["median"] for r in results]
        axes.plot(counts, median, marker="o", label=label)
        axes.fill_between(counts, [r["min"] for r in results], [r["max"] for r in results],
                          alpha=0.25)
    axes.set_xscale("log")
    axes.set_xticks(counts, [f"{c}" if k != "all" else f"all ({c})"
                             for c, k in zip(counts, keys, strict=True)])
    axes.set_xlabel("labelled examples per class")
    axes.set_ylabel("held-out accuracy" if report["evaluated_on"] == "test"
                    else "validation accuracy")
    axes.set_title(f"fine-tuning, median and range over {report['finetune']['seeds']} seeds")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


OBJECTIVE_NAMES = {"mpp": "masked patch prediction", "mae": "MAE reconstruction",
                   "ibot": "masked self-distillation (DINOv2)",
                   "ijepa": "latent block prediction (I-JEPA)",
                   "capi": "cluster prediction (CAPI)"}
# ibot at the demo's size: a head as wide as the encoder's MLP, 1024 prototypes, and
# DINOv2's crops scaled to 32-pixel digits (global 32, local 16: 96/224 of 32, rounded to
# the patch).
IBOT_SETTINGS = {"prototypes": 1024, "head_bottleneck": 64, "local_crops": 2, "local_size": 16}
# I-JEPA and CAPI at the demo's size (4 x 4 patches: I-JEPA's blocks hold 1 to 3 patches, so
# no minimum), with their papers' crops; lr 1e-3, measured on validation (notes/issue43_demo.md).
# Their EMA teachers lag the student over a run this short (CAPI after 1500 steps: k-NN 0.598
# for the teacher, 0.698 for the student), so the demo scores the student.
SINGLE_VIEW = {
    "ijepa": {"objective": {"predictor_width": 96, "predictor_depth": 2, "min_keep": 0},
              "crop": {"scale": (0.3, 1.0), "flip": False}, "lr": 1e-3},
    "capi": {"objective": {"clusters": 256, "predictor_depth": 2},
             "crop": {"scale": (0.6, 1.0), "flip": True}, "lr": 1e-3},
}


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


@dataclass
class DemoData:
    """The digits and their splits (row indices into `files`), as `demo_splits` gives them;
    `scored` is `test` or `validation` (--eval-on)."""

    files: list[Path]
    labels: np.ndarray
    classes: list[str]
    train: np.ndarray
    pool: np.ndarray
    validation: np.ndarray
    test: np.ndarray
    scored: np.ndarray
    fewest: int  # images of the pool's smallest class: what "all" labels per class means


def run(args: argparse.Namespace) -> int:
    """The demo, from `vlm-vit demo`'s arguments: prints its table and writes its outputs
    under `args.out`; returns the exit status."""
    from vlm_vit.recipes.label_efficiency import FinetuneRecipe

    schedule = _schedule(args)
    command = getattr(args, "command_line", None) or f"vlm-vit demo --out {args.out}"
    finished = demo_state.open_run(args.out, demo_state.settings(args, schedule), command,
                                   resume=args.resume, overwrite=args.overwrite)
    started = time.perf_counter()
    data = _prepare_digits(args, schedule["counts"])
    encoder, random_init, start_fingerprint, result, processor = _pretrain(
        args, data, schedule["steps"], command)
    pretrain_seconds = time.perf_counter() - started

    images = processor([str(f) for f in data.files])
    recipe = FinetuneRecipe(steps=schedule["finetune_steps"], lr=schedule["finetune_lr"],
                            layer_decay=args.layer_decay)
    counts, seeds = schedule["counts"], schedule["seeds"]
    keys = ["all" if count is None else str(count) for count in counts]
    report = _report_head(args, data, keys, counts, result, pretrain_seconds,
                          start_fingerprint, encoder.config)
    report["finetune"] = {"recipe": recipe.to_dict(), "seeds": seeds, "labels": keys}
    arms = (("random_init", random_init.eval()), ("pretrained", encoder))
    with _terminated_as_interrupt():
        _score_arms(args, report, arms, images, data, recipe, keys, counts, seeds, finished)
    report["photos"] = _encode_photos(encoder, processor)
    out = args.out
    report["loss_plot"] = "loss.png" if plot_losses(result.losses, out / "loss.png",
                                                    args.objective) else None
    report["label_efficiency_plot"] = ("label_efficiency.png" if plot_label_efficiency(
        report, out / "label_efficiency.png") else None)
    report["seconds"] = round(time.perf_counter() - started, 1)
    with atomic_write(out / "report.json", "w") as handle:
        json.dump(report, handle, indent=2)
    print_report(report, data.classes)
    print(f"report: {out / 'report.json'}, figure: {out / 'label_efficiency.png'}, encoder: "
          f"{out / 'encoder'} ({report['seconds']:.0f} s)")
    return 0


def _schedule(args: argparse.Namespace) -> dict:
    """Steps, fine-tuning steps, seeds, fine-tuning lr (the preset's unless given) and the
    label counts, checked."""
    preset = QUICK if args.quick else DEFAULTS
    steps = preset["steps"] if args.steps is None else args.steps
    finetune_steps = preset["finetune_steps"] if args.finetune_steps is None \
        else args.finetune_steps
    seeds = preset["seeds"] if args.seeds is None else args.seeds
    finetune_lr = preset["finetune_lr"] if args.finetune_lr is None else args.finetune_lr
    counts = label_counts(args.labels)
    for name, value in (("--steps", steps), ("--finetune-steps", finetune_steps),
                        ("--seeds", seeds), ("--workers", args.workers)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    return {"steps": steps, "finetune_steps": finetune_steps, "seeds": seeds,
            "finetune_lr": finetune_lr, "counts": counts}


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


def _pretrain(args: argparse.Namespace, data: DemoData, steps: int, command: str):
    """Pretrains a fresh encoder on the unlabelled training half and saves it with its
    processor under `args.out/encoder`.

    Returns:
        (the pretrained encoder, a copy of its random initialisation, that copy's
        fingerprint, the trainer's result, the processor).
    """
    import torch

    from vlm_vit.model import VisionEncoder
    from vlm_vit.recipes.label_efficiency import fingerprint
    from vlm_vit.train import TrainConfig, Trainer

    out = args.out
    mean, std = NORMALIZATION["inception"]
    config = EncoderConfig(image_size=32, patch_size=args.patch_size, width=args.width,
                           depth=args.depth, heads=4, mlp_width=4 * args.width)
    processor = ImageProcessor(size=32, mean=mean, std=std)
    torch.manual_seed(args.seed)
    random_init = VisionEncoder(config)
    encoder = VisionEncoder(config)
    encoder.load_state_dict(random_init.state_dict())  # the same starting point
    start_fingerprint = fingerprint(encoder)
    print(f"{len(data.files)} digits in {len(data.classes)} classes: {len(data.train)} to "
          f"pretrain on (labels from {len(data.pool)} of them, {len(data.validation)} for "
          f"validation), {len(data.test)} held out; scoring on the {args.eval_on} images")

    objective, dataset, collate = _objective_and_data(args, encoder, steps, mean, std)
    lr = SINGLE_VIEW.get(args.objective, {}).get("lr", 2e-3)
    train_config = TrainConfig(steps=steps, batch_size=args.batch_size, lr=lr,
                               warmup_steps=max(1, steps // 10),
                               # DINOv2's start of its weight-decay cosine for ibot
                               weight_decay=0.04 if args.objective == "ibot" else 0.05,
                               checkpoint_every=0, seed=args.seed,
                               # ibot's six crops per image cost more than its step on one
                               # thread: one worker process makes them beside the training
                               num_workers=1 if args.objective == "ibot" else 0,
                               log_every=max(1, steps // 10), device="cpu")
    if args.quiet:
        logging.getLogger("vlm_vit.train").setLevel(logging.WARNING)
    print(f"pretraining with {OBJECTIVE_NAMES[args.objective]} for {steps} steps")
    # A resume continues from the newest checkpoint (a stopped run saved one); an earlier
    # run is otherwise refused or removed by `demo_state.open_run`.
    result = Trainer(objective, dataset, train_config, out / "run", command=command,
                     collate=collate, progress=not args.quiet).fit(resume=args.resume)
    scored = objective.student if args.objective in SINGLE_VIEW else objective.encoder
    encoder = scored.eval()
    encoder.save_pretrained(out / "encoder")
    processor.save_pretrained(out / "encoder")
    return encoder, random_init, start_fingerprint, result, processor


def _objective_and_data(args: argparse.Namespace, encoder, steps: int, mean, std):
    """The pretraining objective around `encoder`, its dataset of the unlabelled training half
    (`args.out / "pretrain_images"`) and its collate function (None: the default)."""
    from vlm_vit.data.folders import ImageFolder
    from vlm_vit.pretrain.build import build_objective

    collate = None
    out = args.out
    if args.objective == "ibot":
        from vlm_vit.data.multicrop import MultiCrop, collate_views
        from vlm_vit.pretrain.ibot import MaskedSelfDistillation

        settings = IBOT_SETTINGS
        objective = MaskedSelfDistillation(
            encoder, prototypes=settings["prototypes"], head_hidden=4 * args.width,
            head_bottleneck=settings["head_bottleneck"], steps=steps)
        crops = MultiCrop(patch_size=args.patch_size, global_size=32,
                          local_size=settings["local_size"], local_crops=settings["local_crops"],
                          mean=mean, std=std)
        dataset = ImageFolder(out / "pretrain_images", augmentation=crops, seed=args.seed)
        collate = collate_views
    elif args.objective in SINGLE_VIEW:
        from vlm_vit.pretrain.capi import ClusterPredictiveMasking
        from vlm_vit.pretrain.ijepa import JointEmbeddingPredictive

        settings = SINGLE_VIEW[args.objective]
        build = JointEmbeddingPredictive if args.objective == "ijepa" \
            else ClusterPredictiveMasking
        objective = build(encoder, **settings["objective"])
        dataset = ImageFolder(out / "pretrain_images", 32, mean=mean, std=std,
                              seed=args.seed, **settings["crop"])
    else:
        objective = build_objective(args.objective, encoder, mean=mean, std=std,
                                    **MAE_SETTINGS if args.objective == "mae" else {})
        dataset = ImageFolder(out / "pretrain_images", 32, mean=mean, std=std,
                              scale=(0.6, 1.0), flip=False, seed=args.seed)
    return objective, dataset, collate


def _report_head(args: argparse.Namespace, data: DemoData, keys: list[str],
                 counts: list[int | None], result, pretrain_seconds: float,
                 start_fingerprint: str, config: EncoderConfig) -> dict:
    """The report's settings, splits and pretraining numbers."""
    return {"classes": len(data.classes), "train_images": len(data.train),
            "test_images": len(data.test), "labelled_pool": len(data.pool),
            "validation_images": len(data.validation), "evaluated_on": args.eval_on,
            "scored_images": len(data.scored), "shots": args.shots, "pooling": "mean",
            "labelled_per_class": {key: count or data.fewest
                                   for key, count in zip(keys, counts, strict=True)},
            "pretraining": {"objective": args.objective, "steps": result.step,
                            "first_loss": result.losses[0], "last_loss": result.losses[-1],
                            "final_loss_mean_of_last_10": float(np.mean(result.losses[-10:])),
                            "seconds": round(pretrain_seconds, 1),
                            "start_fingerprint": start_fingerprint,
                            "encoder": config.to_dict()}}


def _score_arms(args: argparse.Namespace, report: dict, arms, images, data: DemoData,
                recipe, keys: list[str], counts: list[int | None], seeds: int,
                finished: dict[str, float]) -> None:
    """Each arm's frozen probes, then every fine-tuning run (label count x seed x arm) not
    `finished` already (a resume's), in `args.workers` processes, each recorded as it ends;
    their numbers go into `report` under the arm's name."""
    from vlm_vit.recipes.label_efficiency import FinetuneJob, finetune_many, fingerprint, shot_rows

    labels = data.labels
    for name, model in arms:
        report[name] = frozen_accuracy(model, images, labels, data.pool, data.scored,
                                       args.shots, args.seed)
        report[name]["finetune_start_fingerprint"] = fingerprint(model)
        report[name]["finetune_accuracy"] = {}
    jobs = [(job_key(key, name, seed),
             FinetuneJob(model, shot_rows(labels, data.pool, count, seed), seed))
            for key, count in zip(keys, counts, strict=True) for name, model in arms
            for seed in range(args.seed, args.seed + seeds)]
    accuracies = dict(finished)
    todo = [(key, job) for key, job in jobs if key not in accuracies]
    workers = max(1, min(args.workers, len(todo)))
    print(f"fine-tuning {len(jobs)} runs ({len(keys)} label counts x {seeds} seeds x 2 "
          f"starts, {recipe.steps} steps each) in {workers} process(es)"
          + (f"; {len(jobs) - len(todo)} already done" if len(todo) < len(jobs) else ""))

    def done(index: int, accuracy: float) -> None:
        accuracies[todo[index][0]] = accuracy
        demo_state.record(args.out, todo[index][0], accuracy)

    finetune_many([job for _, job in todo], images, labels, data.scored, recipe,
                  workers=workers, progress=not args.quiet, done=done)
    for key in keys:
        for name, _ in arms:
            values = [accuracies[job_key(key, name, seed)]
                      for seed in range(args.seed, args.seed + seeds)]
            report[name]["finetune_accuracy"][key] = {
                "median": float(np.median(values)), "min": min(values), "max": max(values),
                "per_seed": values}


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


def print_report(report: dict, classes: list[str]) -> None:
    """The terminal table: the numbers of report.json."""
    chance = 1 / len(classes)
    where = "held-out" if report["evaluated_on"] == "test" else "validation"
    print(f"\n{where + ' accuracy':<30}{'random init':>12}{'pretrained':>12}{'gain':>8}   "
          f"(chance {chance:.2f})")
    seeds = report["finetune"]["seeds"]
    for key in report["finetune"]["labels"]:
        a, b = (report[arm]["finetune_accuracy"][key] for arm in ("random_init", "pretrained"))
        label = f"fine-tune, {key} per class"
        print(f"{label:<30}{a['median']:>12.3f}{b['median']:>12.3f}"
              f"{b['median'] - a['median']:>+8.3f}   range {a['min']:.3f}-{a['max']:.3f} / "
              f"{b['min']:.3f}-{b['max']:.3f}")
    for metric, label in (("few_shot_accuracy", f"frozen {report['shots']}-shot linear (LS)"),
                          ("knn_accuracy", "frozen k-NN (20 neighbours)"),
                          ("linear_probe_accuracy", "frozen linear probe (logistic)")):
        a, b = report["random_init"][metric], report["pretrained"][metric]
        print(f"{label:<30}{a:>12.3f}{b:>12.3f}{b - a:>+8.3f}")
    pretraining = report["pretraining"]
    print(f"\nfine-tuning: median (range) over {seeds} seeds; pretraining "
          f"({pretraining['objective']}) loss {pretraining['first_loss']:.3f} -> "
          f"{pretraining['final_loss_mean_of_last_10']:.3f} (mean of the last 10 of "
          f"{pretraining['steps']} steps)")
    for name, shape in report["photos"].items():
        print(f"3 photos through '{name}': {shape}")
