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
