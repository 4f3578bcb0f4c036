"""`vlm-vit consolidate`: a run's checkpoint as an encoder directory; every failure a user can
cause is one line on stderr and exit status 1."""

from __future__ import annotations

import shutil
import tempfile

import pytest

import vlm_vit
from tests.train.test_consolidate import assert_bit_equal, damage, live_encoder, train
from vlm_vit.cli import main
from vlm_vit.train import checkpoint as ckpt


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train(tmp_path_factory.mktemp("consolidate_cli"), "fsdp")


@pytest.fixture(autouse=True)
def traceback_files(tmp_path, monkeypatch):
    """Tracebacks of unexpected errors go to the system temp dir: here, the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def one_line(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("vlm-vit consolidate: error: "), err
    assert "unexpected" not in lines[0], err
    return lines[0]


def test_consolidate_writes_the_runs_encoder(run_dir, tmp_path, capsys):
    assert main(["consolidate", str(run_dir), "--out", str(tmp_path / "encoder")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == (f"wrote {tmp_path / 'encoder'} from {run_dir} "
                                    f"(checkpoints/step_00000004, step 4)")
    assert captured.err == ""
    assert_bit_equal(vlm_vit.load_encoder(tmp_path / "encoder").state_dict(),
                     live_encoder(run_dir))
    assert main(["consolidate", str(run_dir), "--out", str(tmp_path / "two"), "--step", "2"]) == 0
    assert "(checkpoints/step_00000002, step 2)" in capsys.readouterr().out


def test_a_damaged_file_is_one_line_naming_it(run_dir, tmp_path, capsys):
    run = shutil.copytree(run_dir, tmp_path / "run")
    shard = ckpt.sharded_checkpoint_path(run, 4) / "__0_0.distcp"
    damage(shard)
    line = one_line(capsys, ["consolidate", str(run), "--out", str(tmp_path / "encoder"),
                             "--step", "4"])
    assert f"{shard} does not match its recorded hash" in line
    assert not (tmp_path / "encoder").exists()


@pytest.mark.parametrize("case, expected", [
    ("no run", "run directory {tmp}/nowhere does not exist"),
    ("no checkpoint", "{tmp}/empty holds no training checkpoint"),
    ("no such step", "has no checkpoint of step 9; it has steps 2, 4"),
    ("out in the run", "would replace the run directory"),
    ("not a run", "has no run_config.json"),
    ("bad shard size", "--max-shard-size: shard size 'big' is not a size like 5GB"),
])
def test_user_errors_are_one_line(run_dir, tmp_path, capsys, case, expected):
    (tmp_path / "empty").mkdir()
    bare = shutil.copytree(run_dir, tmp_path / "bare", ignore=shutil.ignore_patterns(
        "run_config.json"))
    argv = {
        "no run": [str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")],
        "no checkpoint": [str(tmp_path / "empty"), "--out", str(tmp_path / "out")],
        "no such step": [str(run_dir), "--out", str(tmp_path / "out"), "--step", "9"],
        "out in the run": [str(run_dir), "--out", str(run_dir / "checkpoints")],
        "not a run": [str(bare), "--out", str(tmp_path / "out")],
        "bad shard size": [str(run_dir), "--out", str(tmp_path / "out"), "--max-shard-size",
                           "big"],
    }[case]
    line = one_line(capsys, ["consolidate", *argv])
    assert expected.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "out").exists()


def test_out_that_is_the_user_s_folder_or_a_link_is_refused_and_kept(run_dir, tmp_path, capsys):
    """Issue 40: `consolidate --out` on a user's folder deleted its .json and .safetensors
    files, and through a symlinked --out replaced the link's target."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "labels.json").write_text("[]")
    (mine / "features.safetensors").write_bytes(b"features")
    line = one_line(capsys, ["consolidate", str(run_dir), "--out", str(mine)])
    assert f"{mine} holds files but no model" in line
    assert sorted(p.name for p in mine.iterdir()) == ["features.safetensors", "labels.json"]
    link = tmp_path / "link"
    link.symlink_to(mine)
    line = one_line(capsys, ["consolidate", str(run_dir), "--out", str(link)])
    assert f"{link} is a symbolic link" in line
    assert sorted(p.name for p in mine.iterdir()) == ["features.safetensors", "labels.json"]
