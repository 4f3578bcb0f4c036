"""`vlm-vit demo --resume` (issue 47, 1): a demo stopped by SIGTERM, in pretraining or while
fine-tuning, continues where it stopped and reports what an uninterrupted demo reports; a
rerun without --resume refuses the folder and deletes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("skimage")
pytest.importorskip("torchvision")

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "40", "--batch-size", "16", "--images-per-class", "12", "--width", "32",
        "--depth", "1", "--shots", "1", "--finetune-steps", "60", "--finetune-lr", "1e-2",
        "--seeds", "2", "--labels", "all", "--workers", "1", "--quiet"]


def demo(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vlm_vit.cli", "demo", "--out", str(out), *ARGS, *extra]


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(demo(out, *extra), capture_output=True, text=True, timeout=600,
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def stop_when(out: Path, ready, *extra: str) -> subprocess.CompletedProcess:
    """Starts the demo, sends SIGTERM once `ready(out)` holds, and waits for it to end."""
    process = subprocess.Popen(demo(out, *extra), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while not ready(out) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the demo ended before it could be stopped"
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def pretraining_logged(out: Path) -> bool:
    metrics = out / "runs" / "mae" / "metrics.csv"
    return metrics.is_file() and len(metrics.read_text().splitlines()) >= 3


def one_finetune_recorded(out: Path) -> bool:
    try:
        return len(json.loads((out / "demo.json").read_text())["finetune_accuracy"]) >= 1
    except (OSError, ValueError, KeyError):
        return False


def numbers(report: dict) -> dict:
    """What a resume must reproduce: everything but the times."""
    report = json.loads(json.dumps(report))
    for arm in report["arms"].values():
        if arm["pretraining"] is not None:
            del arm["pretraining"]["seconds"]
    del report["seconds"]
    return report


@pytest.mark.slow
def test_a_stopped_demo_resumes_to_the_uninterrupted_report(tmp_path):
    reference = run(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = tmp_path / "stopped"

    stopped = stop_when(out, pretraining_logged)  # SIGTERM while pretraining
    assert stopped.returncode != 0 and "continue with --resume" in stopped.stderr
    before = sorted(path.relative_to(out) for path in out.rglob("*"))
    refused = run(out)  # a rerun without --resume: one line, nothing deleted
    assert refused.returncode == 1
    command = " ".join(["vlm-vit", "demo", "--out", str(out), *ARGS])
    assert refused.stderr.strip().splitlines() == [
        f"vlm-vit demo: error: --out {out} holds a demo run ({command}): continue it with "
        "--resume, start afresh with --overwrite, or choose another --out"]
    assert sorted(path.relative_to(out) for path in out.rglob("*")) == before

    stopped = stop_when(out, one_finetune_recorded, "--resume")  # SIGTERM while fine-tuning
    assert stopped.returncode != 0 and "continue with --resume" in stopped.stderr
    recorded = json.loads((out / "demo.json").read_text())["finetune_accuracy"]
    assert 1 <= len(recorded) < 4

    resumed = run(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{len(recorded)} of 4 runs already done" in resumed.stdout
    report = json.loads((out / "report.json").read_text())
    expected = json.loads((tmp_path / "reference" / "report.json").read_text())
    assert numbers(report) == numbers(expected)
    state = json.loads((out / "demo.json").read_text())
    assert state["command"].endswith("--quiet --resume") and "--steps 40" in state["command"]
    run_config = json.loads((out / "runs" / "mae" / "run_config.json").read_text())
    assert run_config["command"].startswith("vlm-vit demo --out ")
