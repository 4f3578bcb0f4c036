"""Checkpoint files: atomic, weights_only-loadable, newest found; RNG state round trips."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vlm_vit.train.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_stale_temporaries,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(3)


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()
    path = save_checkpoint({"rng": rng_state()}, tmp_path / "state.pt")
    expected = draws()
    set_rng_state(load_checkpoint(path)["rng"])
    got = draws()
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_latest_checkpoint_ignores_temporaries_and_pruning_keeps_the_newest(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (2, 10, 4):
        save_checkpoint({"step": step}, checkpoint_path(tmp_path, step))
    stale = tmp_path / "checkpoints" / ".step_00000012.pt.abc.tmp"
    stale.write_bytes(b"half")
    orphan = tmp_path / "checkpoints" / "step_00000012.pt.sha256"  # killed before the rename
    orphan.write_text("0" * 64 + "  step_00000012.pt\n")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)
    assert remove_stale_temporaries(tmp_path) == [stale, orphan]
    assert not stale.exists() and not orphan.exists()
    assert (tmp_path / "checkpoints" / "step_00000010.pt.sha256").is_file()
    assert prune_checkpoints(tmp_path, keep=2) == [checkpoint_path(tmp_path, 2)]
    assert prune_checkpoints(tmp_path, keep=0) == []
    assert load_checkpoint(checkpoint_path(tmp_path, 10))["step"] == 10


def test_loading_refuses_pickled_code_and_names_broken_files(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "thing": object()}, path)
    with pytest.raises(ValueError, match="evil.pt.*objects other than tensors"):
        load_checkpoint(path, verify=False)  # the reader itself refuses it
    truncated = tmp_path / "truncated.pt"
    good = save_checkpoint({"x": torch.zeros(100)}, tmp_path / "good.pt").read_bytes()
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="truncated.pt.*truncated or corrupt"):
        load_checkpoint(truncated, verify=False)
