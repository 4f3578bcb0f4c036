"""The plugin's benchmark scripts run at toy sizes, so they cannot rot (no timing asserted)."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_checkpoint_size_runs_and_the_bridge_checkpoint_is_smaller(tmp_path):
    out = tmp_path / "sizes.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "checkpoint_size.py"), "--hidden", "64", "--layers",
         "2", "--heads", "4", "--mlp", "128", "--vocab", "1000", "--lora-rank", "4",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["stage"] for row in rows] == ["stage 1", "stage 2"]
    for row in rows:
        assert 0 < row["trainable"] < row["parameters"]
        assert row["objective_after_mb"] < row["objective_before_mb"] / 2
        assert row["checkpoint_after_mb"] == row["objective_after_mb"] + row["optimizer_mb"]
    assert "stage 2" in result.stdout
