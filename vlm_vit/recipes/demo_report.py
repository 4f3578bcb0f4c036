"""The demo's outputs for people: its loss plot, its label-efficiency figure and its terminal
table."""

from __future__ import annotations

import logging
from pathlib import Path

from vlm_vit.recipes.demo_pretrain import OBJECTIVE_NAMES

logger = logging.getLogger(__name__)


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


def plot_losses(losses: dict[str, list[float]], path: Path) -> bool:
    """A PNG of each pretrained arm's loss, one panel each; False when matplotlib is missing
    or no arm was pretrained."""
    plt = _pyplot("loss plot") if losses else None
    if plt is None:
        return False
    figure, panels = plt.subplots(1, len(losses), figsize=(4 * len(losses), 3), dpi=100,
                                  squeeze=False)
    for axes, (arm, values) in zip(panels[0], losses.items(), strict=True):
        axes.plot(range(1, len(values) + 1), values, linewidth=1)
        axes.set_xlabel("step")
        axes.set_ylabel(f"{OBJECTIVE_NAMES[arm]} loss")
        axes.set_title(f"{arm}: pretraining on digits")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def plot_label_efficiency(report: dict, path: Path) -> bool:
    """Accuracy against labels per class: each arm fine-tuned, and a logistic regression on
    raw pixels, each median with the seeds' range; False when matplotlib is missing."""
    plt = _pyplot("label-efficiency figure")
    if plt is None:
        return False
    keys = report["finetune"]["labels"]
    counts = [report["labelled_per_class"][key] for key in keys]
    figure, axes = plt.subplots(figsize=(5, 3.5), dpi=100)
    lines = [(arm, report["arms"][arm]["finetune_accuracy"], "-")
             for arm in report["arms"]]
    lines.append(("raw pixels (logistic)", report["pixels"]["logistic_accuracy"], "--"))
    for label, results, style in lines:
        results = [results[key] for key in keys]
        axes.plot(counts, [r["median"] for r in results], marker="o", linestyle=style,
                  label=label)
        axes.fill_between(counts, [r["min"] for r in results], [r["max"] for r in results],
                          alpha=0.2)
    axes.set_xscale("log")
    axes.set_xticks(counts, [f"{c}" if k != "all" else f"all ({c})"
                             for c, k in zip(counts, keys, strict=True)])
    axes.set_xlabel("labelled examples per class")
    axes.set_ylabel("held-out accuracy" if report["evaluated_on"] == "test"
                    else "validation accuracy")
    axes.set_title(f"median and range over {report['finetune']['seeds']} seeds")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def print_report(report: dict, classes: list[str]) -> None:
    """The terminal table, a Markdown table of the numbers of report.json (the README's is
    pasted from it), then the sweep's trials when there was one."""
    where = "held-out" if report["evaluated_on"] == "test" else "validation"
    arms, pixels = report["arms"], report["pixels"]
    seeds = report["finetune"]["seeds"]
    print(f"\n| {where} accuracy (chance {1 / len(classes):.2f}) | raw pixels | "
          + " | ".join(arms) + " |")
    print("|---" * (len(arms) + 2) + "|")
    for key in report["finetune"]["labels"]:
        cells = [_cell(pixels["logistic_accuracy"][key], seeds)]
        cells += [_cell(arms[arm]["finetune_accuracy"][key], seeds) for arm in arms]
        label = f"{key} per class" if key != "all" else \
            f"all labels ({report['labelled_per_class'][key]} per class)"
        print(f"| fine-tune, {label} | " + " | ".join(cells) + " |")
    for metric, label in (("few_shot_accuracy", f"frozen {report['shots']}-shot linear (LS)"),
                          ("knn_accuracy", "frozen k-NN (20 neighbours)"),
                          ("linear_probe_accuracy", "frozen linear probe (logistic)")):
        cells = [f"{pixels[metric]:.3f}"] + [f"{arms[arm][metric]:.3f}" for arm in arms]
        print(f"| {label} | " + " | ".join(cells) + " |")
    recipes = [f"lr {arms[arm]['recipe']['lr']:g}, {arms[arm]['recipe']['steps']} steps"
               for arm in arms]
    print("| fine-tuning recipe | - | " + " | ".join(recipes) + " |")
    pretrained = ["-" if arms[arm]["pretraining"] is None else
                  f"{arms[arm]['pretraining']['steps']} steps, "
                  f"{arms[arm]['pretraining']['seconds']:.0f} s" for arm in arms]
    print("| pretraining | - | " + " | ".join(pretrained) + " |")
    print(f"\nfine-tuning: median (min-max) over {seeds} seed(s), each arm's recipe "
          f"{RECIPES_FROM[report['finetune']['recipes_from']]}; raw pixels: a logistic "
          "regression on the same labelled images")
    if report["sweep"] is not None:
        _print_sweep(report["sweep"])
    photos = report["photos"]
    for name in ("mean", "pixel_shuffle"):
        print(f"3 photos through {photos['encoder']} and '{name}': {photos[name]}")


RECIPES_FROM = {"sweep": "chosen by this run's sweep on the validation split",
                "recorded": "as the recorded sweep chose it (docs/demo.md)",
                "flags": "as --finetune-lr / --finetune-steps set it"}


def _cell(spread: dict, seeds: int) -> str:
    if seeds == 1:
        return f"{spread['median']:.3f}"
    return f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"


def _print_sweep(sweep: dict) -> None:
    """Each arm's trials on the validation split, the chosen one starred."""
    trials = sweep["trials"]
    grid = next(iter(trials.values()))
    print(f"\nsweep ({sweep['labels_per_class']} labels per class, seed {sweep['seed']}, "
          f"{sweep['validation_images']} validation images; * chosen)")
    print("| arm | " + " | ".join(f"lr {t['lr']:g}, {t['steps']} steps" for t in grid) + " |")
    print("|---" * (len(grid) + 1) + "|")
    for arm, tried in trials.items():
        best = max(range(len(tried)), key=lambda index: tried[index]["accuracy"])
        print(f"| {arm} | " + " | ".join(f"{t['accuracy']:.3f}" + ("*" if i == best else "")
                                         for i, t in enumerate(tried)) + " |")
