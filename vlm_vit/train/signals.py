"""Signals: Ctrl-C and SIGTERM end a run after a checkpoint, never in the middle of a step;
a torchrun worker whose launcher is gone ends at once, without one."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


def ignore_interrupts(worker_id: int) -> None:
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


# A real-time signal nobody else sends: SIGTERM means "checkpoint and stop" here, SIGHUP and
# SIGINT torchrun passes on to its workers, and cluster schedulers warn with SIGUSR1/SIGUSR2.
LAUNCHER_GONE_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else None
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_ENDING = threading.Lock()  # one line, whether the signal or the watch thread notices first


class LauncherWatch:
    """Ends this torchrun worker, with one line on stderr and no checkpoint, once its
    launcher (the torchrun process, this worker's parent) is gone.

    torchrun starts each worker in a session of its own (`start_new_session=True`), so a
    SIGKILL of the torchrun process a user sees reaches no worker, and the workers would
    train on, alone, to the last step. Two ways notice the launcher's end: on Linux the
    kernel sends `LAUNCHER_GONE_SIGNAL` the moment the parent dies (`prctl(PR_SET_PDEATHSIG)`,
    `arm`), and `check`, which `FailureWatch`'s thread calls at every poll, compares the
    parent's pid with the launcher's (a Python signal handler waits while the main thread is
    inside a collective; the thread does not). The process ends with `os._exit`, so no
    checkpoint, encoder or C++ store destructor runs after the line.

    Args:
        rank: this process's rank, for the line.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid = os.getppid()  # the launcher, recorded before the kernel is asked to watch it
        self._armed = False
        self._previous_handler: object = signal.SIG_DFL

    def arm(self) -> LauncherWatch:
        """Asks the kernel for `LAUNCHER_GONE_SIGNAL` when the launcher dies (on Linux, from
        the main thread; elsewhere `check` alone notices), then checks once: a launcher that
        died before the kernel watched it sends nothing."""
        if (LAUNCHER_GONE_SIGNAL is not None and sys.platform.startswith("linux")
                and threading.current_thread() is threading.main_thread()):
            self._previous_handler = signal.signal(LAUNCHER_GONE_SIGNAL, self._signalled)
            self._armed = True
            if _parent_death_signal(LAUNCHER_GONE_SIGNAL) != 0:
                logger.debug("prctl(PR_SET_PDEATHSIG) failed (errno %d); polling the launcher "
                             "only", ctypes.get_errno())
        self.check()
        return self

    def disarm(self) -> None:
        """Stops the kernel's watch and restores the signal's earlier handler."""
        if not self._armed:
            return
        _parent_death_signal(0)
        signal.signal(LAUNCHER_GONE_SIGNAL, self._previous_handler or signal.SIG_DFL)
        self._armed = False

    def check(self) -> None:
        """Ends the process when the launcher is gone (its orphans get another parent)."""
        if os.getppid() == self.pid or not _ENDING.acquire(blocking=False):
            return  # the launcher lives, or the other way is ending the process already
        with contextlib.suppress(Exception):  # a write interrupted by the signal: let it be
            sys.stdout.flush()
            sys.stderr.flush()
        # Written to the file descriptor, not logged: the process ends on the next line, and
        # a rank other than 0 may have no handler that would show it.
        os.write(2, f"vlm-vit: rank {self.rank}: the launcher (torchrun, pid {self.pid}) is "
                    "gone; stopping without a checkpoint\n".encode())
        os._exit(1)

    def being_killed(self) -> bool:
        """Whether the launcher has a SIGKILL pending (read from Linux's /proc; elsewhere
        False). It stops answering at once, but its sockets close, and its workers learn of
        its end, only once the kernel has torn it down, up to a few hundred ms later."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return False
        for line in status.splitlines():
            if line.startswith("ShdPnd:"):  # the process's pending signals, a hex bit mask
                return bool(int(line.split()[1], 16) >> (signal.SIGKILL - 1) & 1)
        return False

    def _signalled(self, number: int, frame: object) -> None:
        self.check()  # the parent thread of a still-living launcher may send it too


def _parent_death_signal(number: int) -> int:
    """`prctl(PR_SET_PDEATHSIG, number)`: 0 on success, -1 (errno set) on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    unused = ctypes.c_ulong(0)
    return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(number)), unused, unused, unused)
