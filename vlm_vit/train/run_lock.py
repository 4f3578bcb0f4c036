"""One run per run directory: an OS file lock, held for the run and released when the process
ends, however it ends (the kernel drops `flock` locks of a dead process).

    with RunLock(run_dir):
        ...  # a second run on the same directory is refused, naming this process

The lock file, `RUN_DIR/.lock`, holds the holder's pid and host for the message; a stale file
left by a crash is no obstacle, since only a live lock counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"
_HELD: dict[Path, int] = {}  # lock files this process holds -> how many holders, reentrant


class RunDirectoryInUse(FileExistsError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive, non-blocking lock on a run directory (created if needed).

    Args:
        run_dir: the directory.

    Raises (on entering):
        RunDirectoryInUse: naming the holder's pid, host and start time.
        NotADirectoryError: when `run_dir` is a file.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._handle = None
        self._nested = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, as before (documented)
            return
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise NotADirectoryError(f"{self.path.parent} is a file, not a run directory; "
                                     "give --out (run_dir) a folder")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in _HELD:  # this process holds it already (a command around the trainer)
            _HELD[key] += 1
            self._nested = True
            return
        handle = open(self.path, "a+")  # noqa: SIM115  (held open for the lock's lifetime)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _describe(handle.read())
            handle.close()
            raise RunDirectoryInUse(
                f"{self.path.parent} is in use by another run ({holder}); wait for it to "
                "finish, stop it, or use another run directory") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        self._handle = handle
        _HELD[key] = 1

    def release(self) -> None:
        key = self.path.resolve()
        if self._nested:
            _HELD[key] -= 1
            self._nested = False
            return
        if self._handle is not None:
            _HELD.pop(key, None)
            with contextlib.suppress(OSError):
                self._handle.close()  # closing drops the flock
            self._handle = None


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"
