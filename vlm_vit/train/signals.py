"""Signals: Ctrl-C and SIGTERM end a run after a checkpoint, never in the middle of a step."""

from __future__ import annotations

import signal


def _ignore_interrupts(worker_id: int) -> None:
    """DataLoader workers ignore Ctrl-C (it reaches the whole process group): the main
    process finishes its step, checkpoints, and then shuts them down itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
