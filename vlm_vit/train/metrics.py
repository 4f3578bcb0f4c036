"""What a run reports as it goes: metrics.csv (and TensorBoard when installed)."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

from vlm_vit.files import atomic_write

METRICS_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"


class _Silent:
    """Stands in for the logger on ranks other than 0."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _MetricsLog:
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

