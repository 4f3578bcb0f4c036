"""The demo's scoring: the `--sweep` on the validation split, then the final scoring of every
arm (frozen-feature probes and fine-tuning runs) and of raw pixels on the scored split.

The order is the guarantee: `sweep` reads the labelled pool and the validation split only,
and nothing reads the scored split before `score_arms` and `pixel_baseline`.
"""

from __future__ import annotations

import argparse

import numpy as np

from vlm_vit.recipes import demo_state
from vlm_vit.recipes.demo_state import SWEEP_GRID, SWEEP_LABELS, DemoData, job_key, trial_key


def frozen_accuracy(encoder, images, labels, train, test, shots, seed) -> dict:
    """Few-shot, k-NN (DINO's weighted vote, k = 20) and linear-probe accuracy of mean-pooled
    frozen features on held-out images (`images`: every digit's pixels, `[N, 3, 32, 32]`,
    preprocessed once for all uses)."""
    from vlm_vit.eval import extract_features

    # A generator of preprocessed batches, which extract_features takes as they are.
    features, _ = extract_features(encoder, iter(images.split(128)), pooling="mean",
                                   progress=False)
    return probes(features.numpy(), labels, train, test, shots, seed)


def probes(features: np.ndarray, labels, train, test, shots: int, seed: int) -> dict:
    """The three frozen probes of `features` `[N, D]`, fitted on rows `train`, scored on
    rows `test`."""
    from vlm_vit.eval import few_shot_accuracy, knn_accuracy, linear_probe_accuracy

    return {
        "few_shot_accuracy": few_shot_accuracy(features[train], labels[train], features[test],
                                               labels[test], shots=shots, seed=seed),
        "knn_accuracy": knn_accuracy(features[train], labels[train], features[test],
                                     labels[test]),
        "linear_probe_accuracy": linear_probe_accuracy(features[train], labels[train],
                                                       features[test], labels[test]),
    }


def sweep(args: argparse.Namespace, starts: dict, images, data: DemoData,
          finished: dict[str, float]) -> tuple[dict, dict]:
    """Every arm's `SWEEP_GRID` trials, each a fine-tuning run from `SWEEP_LABELS` labels per
    class of the labelled pool (seed `args.seed`) scored on the validation split; the best
    trial of each arm (ties: the earlier in grid order, fewer steps first) is its recipe.

    Returns:
        (each arm's chosen {"lr", "steps"}, the sweep's record for the report).
    """
    from vlm_vit.recipes.label_efficiency import FinetuneJob, shot_rows

    shots = min(SWEEP_LABELS, data.fewest)
    rows = shot_rows(data.labels, data.pool, shots, args.seed)
    grid = [{"lr": lr, "steps": steps} for steps in SWEEP_GRID["steps"]
            for lr in SWEEP_GRID["lr"]]
    jobs = [(trial_key(arm, trial["lr"], trial["steps"]),
             FinetuneJob(start, rows, args.seed, _recipe(args, trial)))
            for arm, start in starts.items() for trial in grid]
    print(f"sweep: {len(grid)} fine-tuning recipes per arm, {shots} labels per class, scored "
          f"on the {len(data.validation)} validation images")
    accuracies = run_recorded(args, jobs, images, data.labels, data.validation, finished)
    recipes, trials = {}, {}
    for arm in starts:
        trials[arm] = [{**trial, "accuracy": accuracies[trial_key(arm, trial["lr"],
                                                                  trial["steps"])]}
                       for trial in grid]
        best = max(trials[arm], key=lambda trial: trial["accuracy"])  # the first of equals
        recipes[arm] = {"lr": best["lr"], "steps": best["steps"]}
    return recipes, {"labels_per_class": shots, "seed": args.seed, "scored_on": "validation",
                     "validation_images": len(data.validation), "trials": trials}


def score_arms(args: argparse.Namespace, report: dict, starts: dict, recipes: dict, images,
               data: DemoData, keys: list[str], counts: list[int | None], seeds: int,
               finished: dict[str, float]) -> None:
    """Each arm's frozen probes, then every fine-tuning run (label count x arm x seed) with the
    arm's recipe, scored on `data.scored`; the numbers go into `report["arms"][arm]`."""
    from vlm_vit.recipes.label_efficiency import FinetuneJob, fingerprint, shot_rows

    labels, arms = data.labels, report["arms"]
    for name, model in starts.items():
        arms[name].update(frozen_accuracy(model, images, labels, data.pool, data.scored,
                                          args.shots, args.seed))
        arms[name]["finetune_start_fingerprint"] = fingerprint(model)
        arms[name]["recipe"] = _recipe(args, recipes[name]).to_dict()
    jobs = [(job_key(key, name, seed),
             FinetuneJob(model, shot_rows(labels, data.pool, count, seed), seed,
                         _recipe(args, recipes[name])))
            for key, count in zip(keys, counts, strict=True) for name, model in starts.items()
            for seed in range(args.seed, args.seed + seeds)]
    print(f"fine-tuning {len(jobs)} runs ({len(keys)} label counts x {len(starts)} arms x "
          f"{seeds} seeds), scored on the {args.eval_on} images")
    accuracies = run_recorded(args, jobs, images, labels, data.scored, finished)
    for name in starts:
        arms[name]["finetune_accuracy"] = {
            key: _spread([accuracies[job_key(key, name, seed)]
                          for seed in range(args.seed, args.seed + seeds)]) for key in keys}


def pixel_baseline(images, data: DemoData, keys: list[str], counts: list[int | None],
                   seeds: int, shots: int, seed: int) -> dict:
    """Raw pixels (as preprocessed, flattened) as the features: the three probes on the pool,
    and a logistic regression on the same k labelled rows as each fine-tuning run."""
    from vlm_vit.eval import linear_probe_accuracy
    from vlm_vit.recipes.label_efficiency import shot_rows

    pixels, labels = images.flatten(1).numpy(), data.labels
    result = probes(pixels, labels, data.pool, data.scored, shots, seed)

    def logistic(rows) -> float:
        return linear_probe_accuracy(pixels[rows], labels[rows], pixels[data.scored],
                                     labels[data.scored])

    result["logistic_accuracy"] = {
        key: _spread([logistic(shot_rows(labels, data.pool, count, s))
                      for s in range(seed, seed + seeds)])
        for key, count in zip(keys, counts, strict=True)}
    return result


def run_recorded(args: argparse.Namespace, jobs: list, images, labels, eval_rows,
                 finished: dict[str, float]) -> dict[str, float]:
    """Runs the keyed fine-tuning jobs not `finished` already (a resume's) in `args.workers`
    processes, each recorded in `demo.json` as it ends; returns every job's accuracy."""
    from vlm_vit.recipes.label_efficiency import finetune_many

    accuracies = {key: finished[key] for key, _ in jobs if key in finished}
    todo = [(key, job) for key, job in jobs if key not in accuracies]
    if len(todo) < len(jobs):
        print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already done")

    def done(index: int, accuracy: float) -> None:
        accuracies[todo[index][0]] = accuracy
        demo_state.record(args.out, todo[index][0], accuracy)

    finetune_many([job for _, job in todo], images, labels, eval_rows, None,
                  workers=max(1, min(args.workers, len(todo))), progress=not args.quiet,
                  done=done)
    return accuracies


def _recipe(args: argparse.Namespace, chosen: dict):
    from vlm_vit.recipes.label_efficiency import FinetuneRecipe

    return FinetuneRecipe(steps=chosen["steps"], lr=chosen["lr"], layer_decay=args.layer_decay)


def _spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values),
            "per_seed": values}
