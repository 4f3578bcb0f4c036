"""`.ci/run` lints with the venv's ruff after the install and before the tests, and otherwise
runs exactly the README's install-and-test command."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUFF = ".venv/bin/ruff check ."


def steps(command: str) -> list[str]:
    return [step.strip() for step in command.split("&&") if step.strip()]


def test_ci_runs_ruff_between_the_install_and_the_readme_s_tests():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"exactly what `\.ci/run` runs\):\n\n```bash\n(.+?)\n```", readme, re.S)
    assert block, "README.md no longer shows the command .ci/run runs"
    script = (REPO / ".ci" / "run").read_text().splitlines()
    commands = script[script.index('cd "$(dirname "$0")/.."') + 1:]
    ci = [step for line in commands if line.strip() and not line.startswith("#")
          for step in steps(line)]
    assert RUFF in ci, ".ci/run does not run ruff"
    pip = next(i for i, step in enumerate(ci) if "pip install" in step)
    pytest = next(i for i, step in enumerate(ci) if "-m pytest" in step)
    assert pip < ci.index(RUFF) < pytest  # with ruff installed, before any test
    assert [s for s in ci if s != RUFF] == [s for s in steps(block[1]) if s != RUFF]


def test_the_readme_installs_torch_s_cpu_build_and_nothing_replaces_it():
    """Issue 27, 10: on a CPU machine the README installs PyTorch's CPU build first, and no
    requirement of ours or of a plugin pins torch or torchvision in a way that would make pip
    replace it with the CUDA build."""
    readme = (REPO / "README.md").read_text()
    quickstart = readme.index("## Quickstart")
    cpu = readme.index("pip install torch torchvision --index-url "
                       "https://download.pytorch.org/whl/cpu")
    assert quickstart < cpu < readme.index("## Using it")
    for pyproject in [REPO / "pyproject.toml", *REPO.glob("adapters/*/pyproject.toml")]:
        for name, spec in re.findall(r'"(torchvision|torch)\b\s*([^";]*)', pyproject.read_text()):
            assert spec == "" or re.fullmatch(r">=\s*[\d.]+", spec), (pyproject, name, spec)


def test_the_test_command_names_a_failure_as_it_happens_and_the_slowest_at_the_end(tmp_path):
    """Issue 47, 8: a contributor learns a failing test's name without waiting for the end."""
    import subprocess
    import sys

    readme = (REPO / "README.md").read_text()
    assert "HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q --durations=25\n" in readme
    (tmp_path / "conftest.py").write_text((REPO / "conftest.py").read_text())
    (tmp_path / "test_two.py").write_text(
        "def test_breaks():\n    assert 1 == 2\n\n\ndef test_later():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--durations=25", "-ra", "test_two.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    live = lines.index("FAILED test_two.py::test_breaks (call)")
    assert live < next(i for i, line in enumerate(lines) if "FAILURES" in line), done.stdout
    assert any("slowest" in line and "durations" in line for line in lines), done.stdout
    assert "FAILED test_two.py::test_breaks - assert 1 == 2" in done.stdout  # the summary
