"""`vlm-vit demo`: the whole path on a fresh machine, with no downloads.

Pretrains a small ViT (MAE by default; MPP, ibot, I-JEPA or CAPI: the arms) on the unlabelled
half of scikit-learn's handwritten digits, then fine-tunes each arm whole with k labels per
class beside the same architecture from the same random initialisation (the paper's
protocol), each with its own recipe chosen on a validation split of the labelled half, and
reports held-out accuracy against k over three seeds, with frozen-feature probes and a
logistic regression on raw pixels beside them; encodes scikit-image's photos through two
poolers, and writes a report, a label-efficiency figure and a loss plot.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vlm_vit.recipes.demo_state import ARMS, DEFAULTS, QUICK, SWEEP_GRID, SWEEP_LABELS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="pretrain, evaluate and encode on bundled data (no downloads)",
        description=" ".join(__doc__.split("\n\n")[1].split()))
    parser.add_argument("--out", type=Path, default=Path("vlm-vit-demo"), metavar="DIR")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--arms", nargs="+", choices=(*ARMS, "all"), metavar="ARM",
                       help="what to fine-tune: 'scratch' (random init) and the pretraining "
                       f"objectives {', '.join(ARMS[1:])}, or 'all' (default "
                       f"{' '.join(DEFAULTS['arms'])}: about 8 minutes on two CPU cores; all six: "
                       "about 40)")
    which.add_argument("--objective", choices=ARMS[1:],
                       help="short for --arms scratch OBJECTIVE")
    parser.add_argument("--sweep", action="store_true",
                        help="choose each arm's fine-tuning lr and steps on the validation "
                        f"split ({len(SWEEP_GRID['lr']) * len(SWEEP_GRID['steps'])} trials per "
                        f"arm at {SWEEP_LABELS} labels per class) instead of using the recorded "
                        "choices")
    parser.add_argument("--quick", action="store_true",
                        help="a three-minute first look: shorter pretraining, one seed, the same "
                        "outputs")
    parser.add_argument("--steps", type=int, help="pretraining steps (default "
                        f"{DEFAULTS['steps']}, quick {QUICK['steps']})")
    parser.add_argument("--batch-size", type=int, default=64, help="pretraining batch")
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--patch-size", type=int, default=8, help="pixels; images are 32 x 32")
    parser.add_argument("--finetune-steps", type=int, help="fine-tuning steps of every arm "
                        "(default: each arm's recorded or swept choice)")
    parser.add_argument("--finetune-lr", type=float, help="peak fine-tuning learning rate of "
                        "every arm (default: each arm's recorded or swept choice)")
    parser.add_argument("--layer-decay", type=float, default=DEFAULTS["layer_decay"],
                        help="layer-wise learning-rate decay when fine-tuning (1: off)")
    parser.add_argument("--labels", nargs="+", default=["1", "10", "all"], metavar="K",
                        help="labels per class to fine-tune with (a number or 'all')")
    parser.add_argument("--seeds", type=int, help="fine-tuning seeds per k (default "
                        f"{DEFAULTS['seeds']}, quick {QUICK['seeds']})")
    parser.add_argument("--shots", type=int, default=10,
                        help="examples per class for the frozen few-shot probe")
    parser.add_argument("--eval-on", choices=("test", "validation"), default="test",
                        help="score on the held-out half (test) or on the validation split "
                        "of the training half, for choosing settings without the test set")
    parser.add_argument("--images-per-class", type=int, default=None,
                        help="use at most this many digits per class (default: all)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="fine-tuning processes, one thread each (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--resume", action="store_true",
                        help="continue the demo stopped in --out (Ctrl-C or SIGTERM): "
                        "pretraining from its checkpoint, fine-tuning with the runs not yet "
                        "recorded; the settings must be the run's")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an --out that holds a demo run (its run, encoder "
                        "and report are removed; the cached digits kept)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vlm_vit.recipes.demo import run as run_demo

    return run_demo(args)
