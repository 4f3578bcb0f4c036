import re

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit import VisionEncoder, load_encoder
from vlm_vit.cli import main

from ..conftest import tiny_config

pytest.importorskip("torchvision")


@pytest.fixture
def setup(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "images" / "nested").mkdir(parents=True)
    for index in range(12):
        folder = tmp_path / "images" / ("nested" if index % 2 else "")
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(
            folder / f"{index}.png")
    (tmp_path / "images" / "broken.jpg").write_text("not an image")
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "start")
    return tmp_path


@pytest.mark.parametrize("objective", ["mpp", "mae"])
def test_pretrain_leaves_a_loadable_encoder_and_resumes(setup, objective, capsys):
    run = setup / f"run-{objective}"
    argv = ["pretrain", "--objective", objective, str(setup / "start"), "--data",
            str(setup / "images"), "--out", str(run), "--batch-size", "4", "--num-workers", "0",
            "--checkpoint-every", "2", "--decoder-width", "32", "--decoder-depth", "1"]
    assert main([*argv, "--steps", "2"]) == 0
    assert "1 undecodable images skipped" in capsys.readouterr().out
    assert main([*argv, "--steps", "4", "--resume"]) == 0
    encoder = load_encoder(run / "encoder")
    start = load_encoder(setup / "start")
    assert encoder.config == start.config
    assert not torch.equal(encoder.blocks[0].attn.qkv.weight, start.blocks[0].attn.qkv.weight)
    assert (run / "run_config.json").read_text().count("pretrain") >= 1


def test_pretrain_user_errors(setup, capsys):
    assert main(["pretrain", "--objective", "mpp", "vit-ti/16", "--data",
                 str(setup / "nowhere"), "--out", str(setup / "run")]) == 1
    err = capsys.readouterr().err
    assert "nowhere is neither a folder nor tar shards" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("variant, decoder", [("vit-ti/16", (192, 4)), ("vit-b/16", (512, 8))])
def test_the_mae_decoder_is_scaled_to_the_encoder(variant, decoder):
    from vlm_vit import EncoderConfig
    from vlm_vit.pretrain.build import build_objective

    with torch.device("meta"):
        encoder = VisionEncoder(EncoderConfig.from_name(variant))
        objective = build_objective("mae", encoder, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert (objective.decoder_embed.out_features, len(objective.decoder_blocks)) == decoder
    decoder_parameters = sum(p.numel() for p in objective.parameters()) - sum(
        p.numel() for p in encoder.parameters())
    if variant == "vit-ti/16":  # MAE's 512 x 8 would be 5x the encoder here
        assert decoder_parameters < sum(p.numel() for p in encoder.parameters())


def test_pretrain_prints_what_it_trains(setup, capsys):
    assert main(["pretrain", "--objective", "mae", str(setup / "start"), "--data",
                 str(setup / "images"), "--out", str(setup / "run"), "--batch-size", "4",
                 "--num-workers", "0", "--steps", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    encoder = sum(p.numel() for p in load_encoder(setup / "start").parameters())
    assert line.startswith("mae: ") and f"{encoder:,} in the encoder" in line


def test_run_outputs_in_the_repository_root_are_ignored_by_git():
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("demo/report.json", "vlm-vit-demo/encoders/mae/config.json", "runs/a/metrics.csv"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=root).returncode == 0, path


def test_a_second_run_into_the_same_directory_needs_resume_or_overwrite(setup, capsys):
    argv = ["pretrain", "--objective", "mpp", str(setup / "start"), "--data",
            str(setup / "images"), "--out", str(setup / "run"), "--batch-size", "4",
            "--num-workers", "0", "--steps", "1", "--checkpoint-every", "0"]
    assert main(argv) == 0
    metrics = (setup / "run" / "metrics.csv").read_bytes()
    capsys.readouterr()
    assert main(argv) == 1  # a fresh run over a finished one
    err = capsys.readouterr().err
    assert "--overwrite" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (setup / "run" / "metrics.csv").read_bytes() == metrics
    assert main([*argv, "--overwrite"]) == 0


def test_help_shows_the_checkpoint_default(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "steps between checkpoints (default 500" in capsys.readouterr().out


KILLED_RUNS = {  # the objective's own flags
    "mae": ["--objective", "mae", "--decoder-width", "32", "--decoder-depth", "1"],
    # the EMA teacher, the schedules' position and the crops' and masks' RNG (issue 42)
    "ibot": ["--objective", "ibot", "--prototypes", "32", "--head-hidden", "32",
             "--head-bottleneck", "16", "--local-crops", "2", "--native"],
    # the target encoder and the masks' RNG (issue 43)
    "ijepa": ["--objective", "ijepa", "--predictor-width", "32", "--predictor-depth", "1",
              "--min-keep", "0", "--native"],
    "capi": ["--objective", "capi", "--clusters", "16", "--predictor-depth", "1", "--native"],
}


@pytest.mark.slow  # tests/train/test_tar_shards.py checks the resume in one process
@pytest.mark.parametrize("objective", sorted(KILLED_RUNS))
def test_pretrain_on_shards_killed_at_a_random_moment_resumes_bit_exactly(tmp_path, objective):
    """SIGKILL (no chance to save) at a seeded random moment after the first checkpoint;
    `--resume` then ends with the weights and the sample sequence of a run never stopped."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from tests.train.toy import write_shards
    from vlm_vit.train.metrics import read_sample_log

    write_shards(tmp_path / "shards", 8, 5)
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "start")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def command(out):
        return [sys.executable, "-m", "vlm_vit.cli", "pretrain", *KILLED_RUNS[objective],
                str(tmp_path / "start"), "--data", str(tmp_path / "shards"),
                "--out", str(out), "--batch-size", "4", "--num-workers", "2", "--steps", "40",
                "--checkpoint-every", "3", "--log-samples"]

    subprocess.run(command(tmp_path / "whole"), env=env, check=True, capture_output=True)
    killed = subprocess.Popen(command(tmp_path / "run"), env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints.is_dir() and any(checkpoints.glob("*.pt"))):
        assert killed.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(random.Random(7).uniform(0, 0.3))
    os.killpg(killed.pid, signal.SIGKILL)  # the trainer and its DataLoader workers
    killed.wait()
    assert not (tmp_path / "run" / "encoder").exists(), "the run ended before the kill"
    done = subprocess.run([*command(tmp_path / "run"), "--resume"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["resumed_from"]
    whole = load_encoder(tmp_path / "whole" / "encoder").state_dict()
    resumed = load_encoder(tmp_path / "run" / "encoder").state_dict()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    # ...and the whole objective: ibot's and ijepa's student, heads, predictor too
    whole, resumed = (torch.load(tmp_path / run / "objective.pt", weights_only=True)
                      for run in ("whole", "run"))
    assert whole.keys() == resumed.keys()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    assert read_sample_log(tmp_path / "run") == read_sample_log(tmp_path / "whole")
    assert len(read_sample_log(tmp_path / "whole")) == 40 * 4


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_hides_the_progress_bar(setup, quiet, capsys):
    """Issue 27, 9: `--quiet` (as encode and probe have it) on pretrain too."""
    assert main(["pretrain", "--objective", "mpp", str(setup / "start"), "--data",
                 str(setup / "images"), "--out", str(setup / "run"), "--batch-size", "4",
                 "--num-workers", "0", "--steps", "2", *(["--quiet"] if quiet else [])]) == 0
    captured = capsys.readouterr()
    assert ("it/s]" in captured.err or "s/it]" in captured.err) != quiet, captured.err
    assert "trained 2 steps" in captured.out


# -- ibot (issue 42) -------------------------------------------------------------------------

IBOT = ["--objective", "ibot", "--prototypes", "32", "--head-hidden", "32",
        "--head-bottleneck", "16", "--local-crops", "2", "--batch-size", "4",
        "--num-workers", "0", "--checkpoint-every", "2", "--quiet"]
IJEPA = ["--objective", "ijepa", "--predictor-width", "32", "--predictor-depth", "1",
         "--min-keep", "0", "--batch-size", "4", "--num-workers", "0", "--checkpoint-every",
         "2", "--quiet"]
CAPI = ["--objective", "capi", "--clusters", "16", "--predictor-depth", "1", "--batch-size",
        "4", "--num-workers", "0", "--checkpoint-every", "2", "--quiet"]
EMA_TEACHERS = {"ibot": IBOT, "ijepa": IJEPA, "capi": CAPI}


@pytest.mark.parametrize("objective", sorted(EMA_TEACHERS))
@pytest.mark.parametrize(("storage", "native"), [("folder", True), ("shards", False)],
                         ids=["folder-native", "shards-square"])
def test_an_ema_objective_trains_resumes_bit_exactly_and_exports_the_teacher(
        setup, tmp_path, storage, native, objective):
    """A copy of a four-step run cut back to its step-2 checkpoint resumes to the same
    weights (the teacher, its schedules and the RNG of the masks and crops all
    checkpointed); `encoder/` is the teacher (ibot's EMA teacher, ijepa's target
    encoder)."""
    import shutil

    from tests.train.toy import write_shards
    from vlm_vit.train import checkpoint as ckpt

    data = setup / "images"
    if storage == "shards":
        write_shards(tmp_path / "shards", 2, 6)
        data = tmp_path / "shards"
    common = ["pretrain", str(setup / "start"), *EMA_TEACHERS[objective], "--data", str(data),
              *(["--native"] if native else [])]
    assert main([*common, "--out", str(tmp_path / "whole"), "--steps", "4"]) == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "run")
    for step, path in ckpt.list_checkpoints(tmp_path / "run"):
        if step > 2:
            path.unlink() if path.is_file() else shutil.rmtree(path)
    (tmp_path / "run" / "objective.pt").unlink()
    shutil.rmtree(tmp_path / "run" / "encoder")
    assert main([*common, "--out", str(tmp_path / "run"), "--steps", "4", "--resume"]) == 0
    whole = torch.load(tmp_path / "whole" / "objective.pt", weights_only=True)
    resumed = torch.load(tmp_path / "run" / "objective.pt", weights_only=True)
    assert whole.keys() == resumed.keys()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    exported = load_encoder(tmp_path / "run" / "encoder").state_dict()
    for name, value in exported.items():
        assert torch.equal(value, resumed[f"encoder.{name}"]), name  # the teacher
    assert not torch.equal(resumed["encoder.blocks.0.attn.qkv.weight"],
                           resumed["student.blocks.0.attn.qkv.weight"])
    if objective == "ibot":
        assert int(resumed["steps_done"]) == 4
    # the student, written from the final checkpoint (`vlm-vit consolidate --module student`)
    assert main(["consolidate", str(tmp_path / "run"), "--module", "student",
                 "--out", str(tmp_path / "student")]) == 0
    student = load_encoder(tmp_path / "student").state_dict()
    for name, value in student.items():
        assert torch.equal(value, resumed[f"student.{name}"]), name


def test_a_run_without_a_student_refuses_to_export_one(setup, tmp_path, capsys):
    assert main(["pretrain", str(setup / "start"), "--objective", "mae", "--data",
                 str(setup / "images"), "--out", str(tmp_path / "run"), "--steps", "1",
                 "--batch-size", "4", "--num-workers", "0", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["consolidate", str(tmp_path / "run"), "--module", "student",
                 "--out", str(tmp_path / "student")]) == 1
    err = capsys.readouterr().err
    assert "holds no `student.` weights" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "student").exists()


def test_ibot_s_and_ijepa_s_weight_decay_starts_at_their_papers(setup, tmp_path):
    import json

    for objective, extra, expected in (("ibot", IBOT, 0.04), ("ijepa", IJEPA, 0.04),
                                       ("capi", CAPI, 0.1), ("mae", [], 0.05)):
        out = tmp_path / objective
        assert main(["pretrain", str(setup / "start"), "--objective", objective, *extra,
                     "--data", str(setup / "images"), "--out", str(out), "--steps", "1",
                     "--batch-size", "4", "--num-workers", "0", "--quiet"]) == 0
        assert json.loads((out / "run_config.json").read_text())["train"]["weight_decay"] \
            == expected


@pytest.mark.parametrize(("options", "message"), [
    (["--mask-ratio", "0.1", "1.5"], r"--mask-ratio must lie in \[0, 1\) with MIN <= MAX, "
                                     r"got 0.1 1.5"),
    (["--mask-ratio", "0.3"], "--mask-ratio takes MIN MAX for ibot, got 0.3"),
    (["--local-crops", "-1"], "local_crops must be a non-negative int"),
])
def test_ibot_bad_options_are_one_line(setup, tmp_path, capsys, options, message):
    assert main(["pretrain", str(setup / "start"), *IBOT, "--data", str(setup / "images"),
                 "--out", str(tmp_path / "run"), "--steps", "1", *options]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize(("options", "message"), [
    (["--mask-ratio", "0.5"], "--mask-ratio is for mae, ibot and capi"),
    (["--min-keep", "10"], "ijepa's target blocks on the encoder's 4x4 patch grid hold as few "
                           "as 1 patch, not more than min_keep=10"),
    (["--predictor-width", "30"], "divisible"),
])
def test_ijepa_bad_options_are_one_line(setup, tmp_path, capsys, options, message):
    assert main(["pretrain", str(setup / "start"), *IJEPA, "--data", str(setup / "images"),
                 "--out", str(tmp_path / "run"), "--steps", "1", *options]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_native_is_refused_for_square_only_objectives(setup, tmp_path, capsys):
    assert main(["pretrain", str(setup / "start"), "--objective", "mae", "--native", "--data",
                 str(setup / "images"), "--out", str(tmp_path / "run"), "--steps", "1"]) == 1
    assert "--native is for ibot, ijepa and capi; mae trains on square crops" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("options", "message"), [
    (["--mask-ratio", "1.0"], r"--mask-ratio must lie in \[0, 1\)"),
    (["--mask-ratio", "0.0"], "the mask ratio must lie in \\(0, 1\\)"),
    (["--predict-fraction", "0"], "predict_fraction must lie in"),
    (["--clusters", "1"], "at least 2 clusters"),
])
def test_capi_bad_options_are_one_line(setup, tmp_path, capsys, options, message):
    assert main(["pretrain", str(setup / "start"), *CAPI, "--data", str(setup / "images"),
                 "--out", str(tmp_path / "run"), "--steps", "1", *options]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
