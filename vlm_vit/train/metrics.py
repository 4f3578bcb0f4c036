"""What a run reports as it goes: metrics.csv (and TensorBoard when installed), the progress
bar, log lines and the per-rank sample log."""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vlm_vit.data.shards.reader import escape_name, unescape_name
from vlm_vit.io.files import atomic_write

METRICS_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"
SAMPLES_DIR = "samples"  # the trainer's per-rank sample logs (TrainConfig.log_samples)


class Silent:
    """Stands in for the logger on ranks other than 0."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class MetricsLog:
    """metrics.csv (and TensorBoard when installed), written by rank 0.

    On a resume, rows after the checkpoint's step (written before the interruption) are
    dropped so every step appears once.
    """

    def __init__(self, run_dir: Path, resumed_step: int | None) -> None:
        self.path = run_dir / METRICS_NAME
        self.columns: list[str] | None = None
        self._file = None
        self._writer = None
        if resumed_step is not None and self.path.is_file():
            with self.path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                self.columns = list(reader.fieldnames or []) or None
                kept = [row for row in reader if int(row["step"]) <= resumed_step]
            if self.columns:
                with atomic_write(self.path, "w") as handle:
                    writer = csv.DictWriter(handle, self.columns)
                    writer.writeheader()
                    writer.writerows(kept)
                self._open()
        elif self.path.exists():
            self.path.unlink()
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            pass
        else:
            self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD_DIR))

    def _open(self) -> None:
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, self.columns, extrasaction="ignore")

    def write(self, row: dict[str, float]) -> None:
        if self._writer is None:
            self.columns = list(row)
            self._open()
            self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()
        if self.tensorboard is not None:
            for name, value in row.items():
                if name != "step":
                    self.tensorboard.add_scalar(f"train/{name}", value, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()



class RunReport:
    """What a run shows and records as it goes: metrics.csv (rank 0), the progress bar and a
    log line every `log_every` steps (rank 0), and each rank's sample log when asked for.

    Args:
        run_dir: the run's directory.
        config: the training settings (steps, log_every).
        context: this process.
        progress: show the progress bar (rank 0 only).
        step: the step the run starts after (a resume's checkpoint step, else 0).
        resumed: whether the run resumed (the logs then keep their rows up to `step`).
        sample_log: write samples/rank_R.tsv (`SampleLog`).
        log: the logger (silent on ranks other than 0).
    """

    def __init__(self, run_dir: Path, config: Any, context: Any, *, progress: bool, step: int,
                 resumed: bool, sample_log: bool, log: Any) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.config, self.log = config, log
        resumed_step = step if resumed else None
        self.metrics = MetricsLog(run_dir, resumed_step) if context.is_main else None
        self.samples = SampleLog(run_dir, context.rank, resumed_step) if sample_log else None
        shown = context.is_main and progress
        self.bar = tqdm(total=config.steps, initial=step, disable=not shown, desc="train",
                        dynamic_ncols=True)
        # Log lines go through the bar's writer, so a warning never lands glued to it.
        self._redirect = contextlib.ExitStack()
        if shown:
            self._redirect.enter_context(logging_redirect_tqdm())

    def drawn(self, step: int, samples: list[tuple[int, str, str]] | None) -> None:
        """Records the samples step `step` is about to train on (where the source names them)."""
        if self.samples is not None and samples is not None:
            self.samples.write(step, samples)

    def stepped(self, row: dict[str, float]) -> None:
        """Records a finished step's metrics row."""
        if self.metrics is not None:
            self.metrics.write(row)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{row['loss']:.4g}", lr=f"{row['lr']:.3g}",
                             img_s=f"{row['images_per_s']:.1f}", refresh=False)
        if row["step"] % self.config.log_every == 0:
            self.log.info("step %d/%d  loss %.4f  lr %.3g  grad norm %.3g  %.1f img/s",
                          row["step"], self.config.steps, row["loss"], row["lr"],
                          row["grad_norm"], row["images_per_s"])

    def close(self) -> None:
        """Closes the bar and the logs (again: nothing)."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.samples is not None:
            self.samples.close()
        self.metrics = self.samples = None
        self._redirect.close()


class SampleLog:
    """samples/rank_R.tsv: `step, epoch, shard, key` for every sample a step trained on
    (not the ones it skipped), names escaped by `escape_name`.

    On a resume, lines after the checkpoint's step are dropped, so the file reads as the
    log of one uninterrupted run.
    """

    def __init__(self, run_dir: Path, rank: int, resumed_step: int | None) -> None:
        from vlm_vit.io.files import atomic_write

        folder = Path(run_dir) / SAMPLES_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank_{rank}.tsv"
        if resumed_step is not None and self.path.is_file():
            kept = [line + "\n" for line in _log_lines(self.path)
                    if int(line.split("\t", 1)[0]) <= resumed_step]
            with atomic_write(self.path, "w") as handle:
                handle.writelines(kept)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, samples: Sequence[tuple[int, str, str]]) -> None:
        self._file.writelines(f"{step}\t{epoch}\t{escape_name(shard)}\t{escape_name(key)}\n"
                              for epoch, shard, key in samples)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _log_lines(path: Path) -> list[str]:
    """The whole lines of a sample log (a line cut by a kill has no newline: dropped)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1]


def read_sample_log(run_dir: str | Path, rank: int = 0) -> list[tuple[int, int, str, str]]:
    """The (step, epoch, shard, key) lines a run's `SampleLog` wrote for `rank`."""
    path = Path(run_dir) / SAMPLES_DIR / f"rank_{rank}.tsv"
    rows = []
    for line in _log_lines(path):
        step, epoch, shard, key = line.split("\t")
        rows.append((int(step), int(epoch), unescape_name(shard), unescape_name(key)))
    return rows
