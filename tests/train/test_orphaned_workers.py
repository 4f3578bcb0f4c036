"""A torchrun worker whose launcher is gone stops at once, with one line and no checkpoint.

torchrun starts each worker in a session of its own, so a SIGKILL of the torchrun process a
user sees reaches no worker; `LauncherWatch` (armed by `distributed.setup`) ends them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.train.test_distributed import free_port
from vlm_vit import EncoderConfig, VisionEncoder

REPO = Path(__file__).resolve().parents[2]
SIGNALS = REPO / "vlm_vit" / "train" / "signals.py"
TINY = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)
EXIT_SECONDS = 15.0  # from the launcher's end to its workers' end
LINE = re.compile(r"vlm-vit: rank (\d+): the launcher \(torchrun, pid (\d+)\) is gone; "
                  r"stopping without a checkpoint")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find the launcher's children")


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie its new parent has not reaped yet has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_gone(pids: list[int], seconds: float) -> float:
    """Seconds until every pid ended, or `seconds` if some still run then."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not any(alive(pid) for pid in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    return seconds


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# A launcher of one child, in a session of its own as torchrun starts its workers; the child
# loads signals.py alone (standard library only), without vlm_vit's torch imports.
LAUNCHER = f"""
import os, subprocess, sys, time
child = '''
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("signals", {str(SIGNALS)!r})
signals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(signals)
signals.LauncherWatch(rank=3).arm()
print("armed", flush=True)
while True:
    sum(range(1000))  # the main thread busy in Python, as a training step
'''
subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
os.close(1)  # the child's "armed", or its end, is what the test reads
time.sleep(600)
"""


def test_a_worker_stops_with_one_line_once_its_launcher_is_killed(tmp_path):
    stderr = tmp_path / "stderr"
    with stderr.open("w") as errors:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stderr=errors,
                                    stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        assert launcher.stdout.readline() == "armed\n", stderr.read_text()
        workers = children(launcher.pid)
        assert len(workers) == 1, workers
        launcher.kill()
        launcher.wait(timeout=30)
        assert wait_until_gone(workers, EXIT_SECONDS) < EXIT_SECONDS, "the child runs on"
    finally:
        launcher.kill()
        kill_all(workers)
        launcher.stdout.close()
    lines = stderr.read_text().splitlines()
    assert [line for line in lines if LINE.fullmatch(line)] == lines, lines
    assert len(lines) == 1 and LINE.fullmatch(lines[0]).groups() == ("3", str(launcher.pid))


@pytest.fixture
def pretraining_data(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    for index in range(8):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "images" / f"{index}.png")
    torch.manual_seed(0)
    VisionEncoder(EncoderConfig(**TINY)).save_pretrained(tmp_path / "encoder")
    return tmp_path


def checkpoints(run_dir: Path) -> set[str]:
    folder = run_dir / "checkpoints"
    return {path.name for path in folder.glob("step_*")} if folder.is_dir() else set()


@pytest.mark.slow  # two ranks of `vlm-vit pretrain` under torchrun: 15 to 30 s on 2 busy cores
def test_killing_torchrun_stops_both_workers_without_a_checkpoint(pretraining_data):
    run_dir, stderr = pretraining_data / "run", pretraining_data / "stderr"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m",
               "vlm_vit.cli", "pretrain", "--objective", "mae", "--decoder-width", "32",
               "--decoder-depth", "1", str(pretraining_data / "encoder"),
               "--data", str(pretraining_data / "images"), "--out", str(run_dir),
               "--steps", "300", "--batch-size", "4", "--checkpoint-every", "50",
               "--num-workers", "0", "--device", "cpu", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    with stderr.open("w") as errors:
        torchrun = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=errors)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not checkpoints(run_dir):  # training has begun: step 50's checkpoint
            assert torchrun.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.05)
        workers = children(torchrun.pid)
        assert len(workers) == 2, workers
        torchrun.kill()  # SIGKILL to the agent alone: the workers are in sessions of their own
        torchrun.wait(timeout=30)
        before = checkpoints(run_dir)
        took = wait_until_gone(workers, EXIT_SECONDS)
        assert took < EXIT_SECONDS, f"workers still running {EXIT_SECONDS} s after torchrun"
    finally:
        torchrun.kill()
        kill_all(workers)
    assert checkpoints(run_dir) == before  # no newer one
    assert not (run_dir / "encoder").exists()
    text = stderr.read_text()
    found = sorted(LINE.search(line).groups() for line in text.splitlines() if LINE.search(line))
    assert found == [("0", str(torchrun.pid)), ("1", str(torchrun.pid))], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
