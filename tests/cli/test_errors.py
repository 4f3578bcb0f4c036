"""Every failure a user can cause is one line on stderr and exit status 1 (issue 19, sections 5
and 6); an unexpected one is one line too, naming where its full traceback was written."""

import errno
import json
import os
import tempfile

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.cli import main
from vlm_vit.train import checkpoint as ckpt

TINY = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A native encoder directory, 2 blocks wide 32 on 32 x 32 images."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("models") / "tiny"
    VisionEncoder(EncoderConfig(**TINY)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two class folders of six 32 x 32 PNGs each (for pretrain and finetune alike)."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for label in range(2):
        (root / f"c{label}").mkdir()
        for index in range(6):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
                root / f"c{label}" / f"{index}.png")
    return root


@pytest.fixture(autouse=True)
def traceback_files(tmp_path, monkeypatch):
    """Tracebacks of unexpected errors go to the system temp dir: here, the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def one_line(capsys, argv, *, training=False):
    """Runs the command, expects exit 1, returns its one error line. A training command also
    writes a progress bar and log lines to stderr; of its lines exactly one is the error."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    if training:
        lines = [line for line in lines if line.startswith("vlm-vit ")]
    assert len(lines) == 1, err
    return lines[0]


def pretrain(tiny, images, out, *extra):
    return ["pretrain", "--objective", "mpp", str(tiny), "--data", str(images),
            "--out", str(out), "--batch-size", "4", "--num-workers", "0", "--device", "cpu",
            "--steps", "2", "--checkpoint-every", "2", *extra]


def finetune(tiny, images, out, *extra):
    return ["finetune", str(tiny), "--data", str(images), "--out", str(out),
            "--batch-size", "4", "--num-workers", "0", "--device", "cpu", "--steps", "2",
            *extra]


# -- reading checkpoints -----------------------------------------------------------------------


def test_info_on_a_text_file_says_it_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "text.pt").write_text("hello\n")  # torch.load: KeyError: 101
    line = one_line(capsys, ["info", str(tmp_path / "text.pt")])
    assert "text.pt is not a readable weight file" in line


def test_random_bytes_are_not_called_a_pickle_that_needs_code(tmp_path, capsys):
    (tmp_path / "model.bin").write_bytes(np.random.default_rng(1).bytes(300))
    line = one_line(capsys, ["info", str(tmp_path / "model.bin")])
    assert "model.bin is not a readable weight file" in line
    assert "arbitrary code" not in line


def test_a_pickle_that_needs_code_is_still_refused_as_such(tmp_path, capsys):
    torch.save({"weight": torch.zeros(2), "call": print}, tmp_path / "evil.pt")
    line = one_line(capsys, ["info", str(tmp_path / "evil.pt")])
    assert "evil.pt is a PyTorch file whose pickle needs code" in line


@pytest.mark.parametrize("command", ["info", "convert", "encode"])
def test_a_pickle_calling_a_blocked_module_is_named_as_such_and_never_run(tmp_path, images,
                                                                          capsys, command):
    from tests.test_loading import save_payload

    path = save_payload(tmp_path / "evil.pt", tmp_path / "ran")
    argv = {"info": ["info", str(path)],
            "convert": ["convert", str(path), str(tmp_path / "out"), "--to", "native"],
            "encode": ["encode", str(path), str(images), "-o", str(tmp_path / "x.safetensors"),
                       "--quiet"]}[command]
    line = one_line(capsys, argv)
    assert "evil.pt is a PyTorch file whose pickle needs code to load" in line
    assert "never ran" in line and "unexpected" not in line
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def int32_copy(tiny, tmp_path):
    folder = tmp_path / "int32"
    folder.mkdir()
    (folder / "config.json").write_text((tiny / "config.json").read_text())
    weights = load_file(tiny / "model.safetensors")
    save_file({k: (v * 100).to(torch.int32) for k, v in weights.items()},
              folder / "model.safetensors")
    return folder


def test_int32_weights_are_one_line(tiny, images, tmp_path, capsys):
    folder = int32_copy(tiny, tmp_path)
    one_line(capsys, ["encode", str(folder), str(images), "-o",
                      str(tmp_path / "tokens.safetensors"), "--quiet"])


def test_int32_weights_name_the_dtype(tiny, images, tmp_path, capsys):
    folder = int32_copy(tiny, tmp_path)
    line = one_line(capsys, ["encode", str(folder), str(images), "-o",
                             str(tmp_path / "tokens.safetensors"), "--quiet"])
    assert "int32" in line and "unexpected" not in line


# -- LoRA adapters -----------------------------------------------------------------------------


def test_merge_of_a_pickled_adapter_is_one_line(tiny, images, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(finetune(tiny, images, run, "--lora", "--lora-r", "2")) == 0
    adapter = run / "adapter"
    weights = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({**weights, "call": print}, adapter / "adapter_model.bin")
    capsys.readouterr()
    line = one_line(capsys, ["merge", str(run), "--out", str(tmp_path / "merged")],
                    training=True)
    assert "adapter_model.bin" in line and "arbitrary code" in line
    assert not (tmp_path / "merged").exists()


# -- run directories ---------------------------------------------------------------------------


def test_out_naming_a_file_is_refused(tiny, images, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    for argv in (pretrain(tiny, images, tmp_path / "afile"),
                 finetune(tiny, images, tmp_path / "afile")):
        line = one_line(capsys, argv, training=True)
        assert "afile is a file, not a run directory" in line
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_read_only_out_is_one_line(tiny, images, tmp_path, capsys, monkeypatch):
    from pathlib import Path

    mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):  # as a read-only folder refuses, even to root
        if tmp_path / "read-only" in (self, *self.parents):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    line = one_line(capsys, pretrain(tiny, images, tmp_path / "read-only" / "run"),
                    training=True)
    assert line.endswith("read-only/run: Permission denied")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_really_read_only_out_is_one_line(tiny, images, tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        line = one_line(capsys, pretrain(tiny, images, tmp_path / "ro" / "run"), training=True)
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert "Permission denied" in line


def test_a_full_disk_at_the_first_checkpoint_is_one_line(tiny, images, tmp_path, capsys,
                                                         monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    line = one_line(capsys, pretrain(tiny, images, tmp_path / "run"), training=True)
    assert "No space left on device" in line and str(tmp_path / "run") in line


def test_a_rerun_into_a_finished_run_is_one_line(tiny, images, tmp_path, capsys):
    assert main(pretrain(tiny, images, tmp_path / "run")) == 0
    capsys.readouterr()
    line = one_line(capsys, pretrain(tiny, images, tmp_path / "run"), training=True)
    assert "already holds checkpoints" in line and "--resume" in line


def test_resume_with_another_model_names_the_settings_that_differ(tiny, images, tmp_path,
                                                                  capsys):
    assert main(pretrain(tiny, images, tmp_path / "run")) == 0
    deeper = tmp_path / "deeper"
    VisionEncoder(EncoderConfig(**{**TINY, "depth": 3, "mlp_width": 96})).save_pretrained(deeper)
    capsys.readouterr()
    line = one_line(capsys, pretrain(deeper, images, tmp_path / "run", "--resume"),
                    training=True)
    assert "encoder depth 2 -> 3" in line and "encoder mlp_width 64 -> 96" in line
    assert "state_dict" not in line


def crafted_checkpoint(run):
    """A run whose one checkpoint lacks every key but the format version and the step."""
    run.mkdir()
    ckpt.save_checkpoint({"step": 1}, ckpt.checkpoint_path(run, 1))


def test_a_checkpoint_missing_keys_is_one_line(tiny, images, tmp_path, capsys):
    crafted_checkpoint(tmp_path / "run")
    one_line(capsys, pretrain(tiny, images, tmp_path / "run", "--resume"), training=True)


def test_a_checkpoint_missing_keys_names_them(tiny, images, tmp_path, capsys):
    crafted_checkpoint(tmp_path / "run")
    line = one_line(capsys, pretrain(tiny, images, tmp_path / "run", "--resume"),
                    training=True)
    assert "step_00000001.pt" in line and "'config'" in line and "unexpected" not in line


# -- training that fails -----------------------------------------------------------------------


@pytest.mark.parametrize("every, newest", [("4", "step_00000008.pt"),
                                           ("1000", "No checkpoint was written yet")])
def test_a_diverging_run_is_one_line_naming_the_newest_checkpoint(tiny, images, tmp_path,
                                                                  capsys, every, newest):
    argv = pretrain(tiny, images, tmp_path / "run", "--lr", "1e6", "--steps", "40",
                    "--checkpoint-every", every, "--warmup-steps", "0")
    line = one_line(capsys, argv, training=True)
    assert "consecutive steps" in line and newest in line and "None" not in line


def test_a_refused_finetune_rerun_leaves_finetune_json_alone(tiny, images, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(finetune(tiny, images, run, "--lora", "--lora-r", "2")) == 0
    before = (run / "finetune.json").read_text()
    other = tmp_path / "other"
    VisionEncoder(EncoderConfig(**TINY)).save_pretrained(other)  # same shapes, other weights
    capsys.readouterr()
    line = one_line(capsys, finetune(other, images, run, "--lora", "--lora-r", "2", "--pooling",
                                     "mean"), training=True)
    assert "already holds checkpoints" in line
    line = one_line(capsys, finetune(other, images, run, "--lora", "--lora-r", "2", "--pooling",
                                     "mean", "--resume"), training=True)
    assert f"encoder {str(tiny)!r} -> {str(other)!r}" in line
    assert "pooling 'cls' -> 'mean'" in line
    assert (run / "finetune.json").read_text() == before
    assert json.loads(before)["encoder"] == str(tiny)


# -- encode's output ---------------------------------------------------------------------------


@pytest.mark.parametrize("target, message", [
    ("MODEL/model.safetensors", "is inside the model folder"),
    ("MODEL/sub/tokens.safetensors", "is inside the model folder"),
    ("INPUT", "is one of the inputs"),
])
def test_encode_never_writes_over_its_model_or_inputs(tiny, images, tmp_path, capsys, target,
                                                      message):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((tiny / name).read_bytes())
    given = tmp_path / "given.safetensors"  # an input file that is no image
    given.write_bytes(b"mine")
    before = (model / "model.safetensors").read_bytes()
    out = target.replace("MODEL", str(model)).replace("INPUT", str(given))
    line = one_line(capsys, ["encode", str(model), str(images),
                             *([str(given)] if target == "INPUT" else []), "-o", out, "--quiet"])
    assert message in line
    assert (model / "model.safetensors").read_bytes() == before
    assert given.read_bytes() == b"mine"


# -- the one line itself -----------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_naming_its_traceback_file(tmp_path, capsys,
                                                                   monkeypatch):
    from vlm_vit.cli import info

    def broken(model):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(info, "resolve", broken)
    line = one_line(capsys, ["info", "vit-ti/16"])
    written = tmp_path / f"vlm-vit-traceback-{os.getpid()}.txt"
    assert "unexpected ZeroDivisionError: a bug of ours" in line and str(written) in line
    text = written.read_text()
    assert "Traceback" in text and "in broken" in text and "a bug of ours" in text


def test_verbose_prints_the_traceback_too(tmp_path, capsys, monkeypatch):
    from vlm_vit.cli import info

    def broken(model):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(info, "resolve", broken)
    assert main(["-v", "info", "vit-ti/16"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err
    assert err.strip().splitlines()[-1].startswith("vlm-vit info: error: unexpected")
