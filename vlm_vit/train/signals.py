"""Signals: Ctrl-C and SIGTERM end a run after a checkpoint, never in the middle of a step."""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)


def _ignore_interrupts(worker_id: int) -> None:
    """DataLoader workers ignore Ctrl-C (it reaches the whole process group): the main
    process finishes its step, checkpoints, and then shuts them down itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class StopSignals:
    """While entered, SIGINT and SIGTERM ask the run to finish the current step, checkpoint it
    and stop (a second signal stops at once, as Python would). Only the main thread can take
    signals, so elsewhere nothing changes.

    Attributes:
        received: the name of the signal that asked the run to stop, or None.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._handlers: dict = {}

    def __enter__(self) -> StopSignals:
        self.received = None
        if threading.current_thread() is threading.main_thread():
            self._handlers = {number: signal.signal(number, self._request_stop)
                              for number in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def requested(self) -> bool:
        """Whether a signal has asked the run to stop."""
        return self.received is not None

    def _request_stop(self, number: int, frame: object) -> None:
        if self.received is not None:  # asked twice: stop now
            self._restore()
            raise KeyboardInterrupt
        self.received = signal.Signals(number).name
        logger.warning("%s: finishing step, then saving a checkpoint (again to stop now)",
                       self.received)

    def _restore(self) -> None:
        for number, handler in self._handlers.items():
            signal.signal(number, handler)
        self._handlers = {}
