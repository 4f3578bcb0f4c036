"""One run per run directory: a live lock refuses a second run by pid; a dead one's doesn't."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from vlm_vit.train.run_lock import RunDirectoryInUse, RunLock

pytest.importorskip("fcntl")

HOLD = ("import sys, time\nfrom vlm_vit.train.run_lock import RunLock\n"
        "with RunLock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n")


def test_a_second_process_is_refused_by_pid_until_the_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryInUse, match=rf"in use by another run \(pid "
                                                    rf"{holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no clean-up: the kernel drops the lock
        holder.wait()
    with RunLock(tmp_path) as lock:  # the dead holder's file is no obstacle
        assert str(os.getpid()) in lock.path.read_text()


def test_the_lock_is_released_on_exit_and_refuses_within_one_process_too(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirectoryInUse):
        RunLock(tmp_path).acquire()  # a second open file description: flock refuses it
    first.release()
    started = time.monotonic()
    with RunLock(tmp_path):
        pass
    assert time.monotonic() - started < 1  # never waits
