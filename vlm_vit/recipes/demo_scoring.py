"""The demo's scoring: frozen-feature probes and the fine-tuning runs of every arm."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import numpy as np

from vlm_vit.recipes import demo_state
from vlm_vit.recipes.demo_state import job_key

if TYPE_CHECKING:
    from vlm_vit.recipes.demo import DemoData


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
