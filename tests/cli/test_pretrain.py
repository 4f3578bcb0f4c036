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
    argv = ["pretrain", "--objective", objective, "--model", str(setup / "start"), "--data",
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
    assert main(["pretrain", "--objective", "mpp", "--model", "vit-ti/16", "--data",
                 str(setup / "nowhere"), "--out", str(setup / "run")]) == 1
    err = capsys.readouterr().err
    assert "nowhere is not a folder" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("variant, decoder", [("vit-ti/16", (192, 4)), ("vit-b/16", (512, 8))])
def test_the_mae_decoder_is_scaled_to_the_encoder(variant, decoder):
    from vlm_vit import EncoderConfig
    from vlm_vit.cli.pretrain import build_objective

    with torch.device("meta"):
        encoder = VisionEncoder(EncoderConfig.from_name(variant))
        objective = build_objective("mae", encoder, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert (objective.decoder_embed.out_features, len(objective.decoder_blocks)) == decoder
    decoder_parameters = sum(p.numel() for p in objective.parameters()) - sum(
        p.numel() for p in encoder.parameters())
    if variant == "vit-ti/16":  # MAE's 512 x 8 would be 5x the encoder here
        assert decoder_parameters < sum(p.numel() for p in encoder.parameters())


def test_pretrain_prints_what_it_trains(setup, capsys):
    assert main(["pretrain", "--objective", "mae", "--model", str(setup / "start"), "--data",
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
    for path in ("demo/report.json", "vlm-vit-demo/encoder/config.json", "runs/a/metrics.csv"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=root).returncode == 0, path


def test_a_second_run_into_the_same_directory_needs_resume_or_overwrite(setup, capsys):
    argv = ["pretrain", "--objective", "mpp", "--model", str(setup / "start"), "--data",
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
