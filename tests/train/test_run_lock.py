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
        assert str(os.getpid()) in lock.holder()  # read through the held descriptor


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
                          tmp_path / "run", progress=False)
        with pytest.raises(RunDirectoryInUse, match=f"pid {holder.pid}"):
            trainer.fit()
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


HOLD_AND_FORK = (
    "import os, sys, time\nfrom vlm_vit.train.run_lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\nchild = os.fork()  # as a DataLoader worker is forked\n"
    "if child == 0:\n    time.sleep(60)\n    os._exit(0)\nprint(child, flush=True)\n"
    "time.sleep(60)\n")


def test_the_lock_dies_with_its_holder_not_with_the_children_it_forked(tmp_path):
    """`kill -9 PID` of the trainer alone leaves its DataLoader workers alive for a while;
    they must not hold the run directory (issue 26, item 5)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        assert not another_process_gets_it(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)  # the holder alone, not its process group
        holder.wait()
        os.kill(child, 0)  # the forked child still lives ...
        assert another_process_gets_it(tmp_path)  # ... and holds nothing
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_lock_that_is_a_symlink_is_refused_and_its_target_left_alone(tmp_path):
    """`R/.lock -> ../victim.txt` must not let a run truncate the victim (issue 26, item 1)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").symlink_to("../victim.txt")
    with pytest.raises(FileExistsError, match=r"run/\.lock is a symbolic link") as error:
        RunLock(run_dir).acquire()
    assert "not a regular file" in str(error.value)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_that_is_not_a_regular_file_is_refused_by_name(tmp_path, kind):
    lock = tmp_path / ".lock"
    lock.mkdir() if kind == "directory" else os.mkfifo(lock)
    with pytest.raises(FileExistsError, match=rf"{lock} is a {kind}, not a regular file"):
        RunLock(tmp_path).acquire()


def test_a_run_into_a_directory_whose_lock_is_a_symlink_writes_nothing(tmp_path):
    from tests.train.toy import config, image_folder, toy_objective, write_noise_images
    from vlm_vit.train import Trainer

    write_noise_images(tmp_path / "data", 4)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(victim)
    trainer = Trainer(toy_objective(), image_folder(tmp_path / "data"), config(steps=1),
                      tmp_path / "run", progress=False)
    with pytest.raises(FileExistsError, match="symbolic link"):
        trainer.fit()
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
