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


TRY = ("import sys\nfrom vlm_vit.train.run_lock import RunDirectoryInUse, RunLock\n"
       "try:\n    RunLock(sys.argv[1]).acquire()\nexcept RunDirectoryInUse:\n    sys.exit(3)\n")


def another_process_gets_it(directory) -> bool:
    return subprocess.run([sys.executable, "-c", TRY, str(directory)]).returncode == 0


def test_within_one_process_the_lock_is_reentrant_until_the_outermost_release(tmp_path):
    """A command may hold it around the trainer, which takes it again."""
    outer = RunLock(tmp_path)
    outer.acquire()
    started = time.monotonic()
    with RunLock(tmp_path):  # the trainer inside the command
        pass
    assert time.monotonic() - started < 1  # never waits
    assert not another_process_gets_it(tmp_path)  # the inner release kept it
    outer.release()
    assert another_process_gets_it(tmp_path)


def test_two_pretrain_runs_on_one_directory_cannot_mix(tmp_path):
    """The second of two runs started together is refused, naming the first's pid."""
    from tests.train.toy import config, image_folder, toy_objective, write_noise_images
    from vlm_vit.train import Trainer

    write_noise_images(tmp_path / "data", 8)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        trainer = Trainer(toy_objective(), image_folder(tmp_path / "data"), config(steps=2),
                          tmp_path / "run", progress_bar=False)
        with pytest.raises(RunDirectoryInUse, match=f"pid {holder.pid}"):
            trainer.fit()
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
