"""One run per run directory: an OS file lock, held for the run and released when the process
ends, however it ends.

    with RunLock(run_dir):
        ...  # a second run on the same directory is refused, naming this process

The lock file, `RUN_DIR/.lock`, holds the holder's pid and host for the message; a stale file
left by a crash is no obstacle, since only a live lock counts.

It is a POSIX record lock (`fcntl.lockf`), not `flock`: a record lock belongs to the process,
so the DataLoader workers a trainer forks do not hold it, and the kernel drops it the moment
the holder dies (a `flock` belongs to the open file, which forked children share: a trainer
killed alone left its workers holding the run for seconds). The price: closing any descriptor
of the lock file releases the process's lock, so the file is opened once per process and
read only through `RunLock.holder()`. The lock file is never followed through a symbolic link
and must be a regular file, so `.lock -> ../victim.txt` cannot make a run truncate the victim.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import time
from pathlib import Path

LOCK_NAME = ".lock"
_HELD: dict[Path, list] = {}  # lock files this process holds -> [descriptor, holders] (reentrant)
_KINDS = {stat.S_IFDIR: "directory", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket",
          stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}


class RunDirectoryInUse(FileExistsError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive, non-blocking lock on a run directory (created if needed).

    Args:
        run_dir: the directory.

    Raises (on entering):
        RunDirectoryInUse: naming the holder's pid, host and start time.
        NotADirectoryError: when `run_dir` is a file.
        FileExistsError: when `run_dir/.lock` is a symbolic link or not a regular file.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._key: Path | None = None  # set while this object holds (or shares) the lock

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
        key = self.path.parent.resolve() / LOCK_NAME  # never through a link named .lock
        if key in _HELD:  # this process holds it already (a command around the trainer)
            _HELD[key][1] += 1
            self._key = key
            return
        descriptor = _open_lock_file(self.path)
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(descriptor)
                raise
            holder = _describe(_read(descriptor))
            os.close(descriptor)  # this process holds no lock on it to lose
            raise RunDirectoryInUse(
                f"{self.path.parent} is in use by another run ({holder}); wait for it to "
                "finish, stop it, or use another run directory") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        _HELD[key] = [descriptor, 1]
        self._key = key

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None or key not in _HELD:
            return
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            with contextlib.suppress(OSError):
                os.close(_HELD.pop(key)[0])  # closing drops the record lock

    def holder(self) -> str:
        """What the lock file records of its holder, read through the held descriptor (opening
        and closing the file anew would release this process's lock)."""
        held = _HELD.get(self._key) if self._key is not None else None
        return _read(held[0]) if held else self.path.read_text()


def _open_lock_file(path: Path) -> int:
    """A read-write descriptor of the lock file (created if needed), refusing a symbolic link
    or anything but a regular file, naming it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    remedy = "remove it; a run directory's lock must be a plain file the run creates"
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise FileExistsError(f"{path} is a symbolic link, not a regular file; {remedy}") \
                from None
        if error.errno == errno.EISDIR:
            raise FileExistsError(f"{path} is a directory, not a regular file; {remedy}") \
                from None
        raise
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = _KINDS.get(stat.S_IFMT(mode), "special file")
        raise FileExistsError(f"{path} is a {kind}, not a regular file; {remedy}")
    return descriptor


def _read(descriptor: int) -> str:
    return os.pread(descriptor, 4096, 0).decode("utf-8", "replace")


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"
