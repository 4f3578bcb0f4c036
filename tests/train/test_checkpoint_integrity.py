"""Corrupt trainer checkpoints (issue 19, section 4): each carries its sha256, loading checks
it, and a resume skips a newest checkpoint that fails its hash or cannot be read, saying so."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from tests.train.test_trainer import assert_same_weights, weights
from tests.train.toy import Interrupted, config, image_folder, toy_objective, write_noise_images
from vlm_vit.io.integrity import VERIFY_ENV, IntegrityError, sidecar_path
from vlm_vit.testing import flip_bytes
from vlm_vit.train import Trainer
from vlm_vit.train.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


def flip_tensor_data(path: Path) -> None:
    """8 bytes in the middle of the largest tensor's data: the zip still reads, the weights
    change."""
    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)
    local = path.read_bytes()[member.header_offset:member.header_offset + 30]
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    start = member.header_offset + 30 + name_length + extra_length
    flip_bytes(path, start + member.file_size // 2, 8)


def flip_zip_directory(path: Path) -> None:
    """8 bytes of a member name in the zip's central directory."""
    flip_bytes(path, path.read_bytes().rindex(b"PK\x01\x02") + 46, 8)


def killed_before_its_hash_then_flipped(path: Path) -> None:
    """What a kill between the checkpoint's rename and its sidecar's would leave (issue 26,
    item 1): no sidecar; then tensor bytes change."""
    sidecar_path(path).unlink()
    flip_tensor_data(path)


@pytest.fixture
def saved(tmp_path) -> Path:
    return save_checkpoint({"step": 4, "w": torch.arange(1000, dtype=torch.float32)},
                           checkpoint_path(tmp_path, 4))


def test_a_checkpoint_is_saved_with_its_sha256_beside_it(saved):
    line = sidecar_path(saved).read_text()
    assert line == f"{hashlib.sha256(saved.read_bytes()).hexdigest()}  {saved.name}\n"
    assert [path for _, path in list_checkpoints(saved.parent.parent)] == [saved]


def test_flipped_bytes_fail_the_hash_naming_the_file(saved, monkeypatch):
    flip_tensor_data(saved)
    with pytest.raises(IntegrityError, match="does not match its recorded hash") as error:
        load_checkpoint(saved)
    assert str(saved) in str(error.value)
    changed = load_checkpoint(saved, verify=False)["w"]  # the bytes were tensor data
    assert not torch.equal(changed, torch.arange(1000, dtype=torch.float32))
    monkeypatch.setenv(VERIFY_ENV, "0")
    load_checkpoint(saved)


def test_a_damaged_zip_directory_is_a_value_error_naming_the_file(saved):
    flip_zip_directory(saved)
    with pytest.raises(ValueError, match="corrupt") as error:
        load_checkpoint(saved, verify=False)  # unverified: the reader itself names the file
    assert str(saved) in str(error.value)


def test_the_hash_exists_before_the_checkpoint_does(tmp_path, monkeypatch):
    """A kill at any moment never leaves a checkpoint without its hash: the sidecar is
    written before the rename that makes the checkpoint appear."""
    real_replace, seen = os.replace, {}

    def replace(source, destination):
        if str(destination).endswith(".pt"):
            seen[Path(destination).name] = sidecar_path(destination).read_text()
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    path = save_checkpoint({"w": torch.arange(10)}, checkpoint_path(tmp_path, 4))
    assert seen == {path.name: sidecar_path(path).read_text()}
    assert load_checkpoint(path)["w"].tolist() == list(range(10))


def test_a_checkpoint_without_its_hash_is_refused_unless_unverified(saved, monkeypatch):
    sidecar_path(saved).unlink()
    with pytest.raises(IntegrityError, match=r"has no .*\.sha256") as error:
        load_checkpoint(saved)
    assert str(saved) in str(error.value)
    assert load_checkpoint(saved, verify=False)["step"] == 4
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert load_checkpoint(saved)["step"] == 4


def test_pruning_removes_the_sidecars_too(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint({"step": step}, checkpoint_path(tmp_path, step))
    prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["step_00000006.pt", "step_00000006.pt.sha256"]


def test_latest_usable_checkpoint_skips_a_corrupt_newest(tmp_path, caplog):
    for step in (2, 4):
        save_checkpoint({"step": step}, checkpoint_path(tmp_path, step))
    flip_zip_directory(checkpoint_path(tmp_path, 4))
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 4)
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path, usable=True) == checkpoint_path(tmp_path, 2)
    assert "step_00000004.pt does not match its recorded hash" in caplog.text
    assert "trying the previous checkpoint" in caplog.text


# -- resuming ---------------------------------------------------------------------------------


@pytest.fixture
def data(tmp_path) -> Path:
    write_noise_images(tmp_path / "data", 8)
    return tmp_path / "data"


def interrupted_run(data: Path, run_dir: Path) -> None:
    """4 steps of 6, a checkpoint after steps 2 and 4, then killed in step 5."""
    with pytest.raises(Interrupted):
        Trainer(toy_objective(crash_at_call=5), image_folder(data), config(), run_dir).fit()
    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, 4)


@pytest.mark.parametrize("damage", [flip_tensor_data, flip_zip_directory,
                                    killed_before_its_hash_then_flipped])
def test_resume_skips_a_corrupt_newest_checkpoint_and_says_so(data, tmp_path, caplog, damage):
    whole = toy_objective()
    Trainer(whole, image_folder(data), config(), tmp_path / "whole").fit()
    run_dir = tmp_path / "run"
    interrupted_run(data, run_dir)
    newest = checkpoint_path(run_dir, 4)
    damage(newest)

    caplog.set_level(logging.WARNING, logger="vlm_vit")  # the default verbosity
    resumed = toy_objective(seed=5)
    result = Trainer(resumed, image_folder(data), config(), run_dir).fit(resume=True)

    assert result.step == 6
    assert_same_weights(weights(resumed), weights(whole))  # steps 3..6 from step 2's state
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in m and "trying the previous" in m for m in warnings), warnings
    assert any(f"resuming from {checkpoint_path(run_dir, 2)}" in m for m in warnings), warnings
    assert newest.with_name(newest.name + ".corrupt").is_file()  # kept for a post-mortem
    assert load_checkpoint(newest)["step"] == 4  # rewritten whole by the resumed run


def test_resume_with_no_usable_checkpoint_is_one_clear_error(data, tmp_path):
    run_dir = tmp_path / "run"
    interrupted_run(data, run_dir)
    flip_tensor_data(checkpoint_path(run_dir, 2))
    flip_zip_directory(checkpoint_path(run_dir, 4))
    with pytest.raises(ValueError, match="none of the 2 checkpoints") as error:
        Trainer(toy_objective(), image_folder(data), config(), run_dir).fit(resume=True)
    assert "step_00000002.pt" in str(error.value) and "step_00000004.pt" in str(error.value)
    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, 4)  # nothing moved
