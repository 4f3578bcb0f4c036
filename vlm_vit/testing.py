"""Helpers for testing code that loads model names offline (ours and yours)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def put_in_hub_cache(cache: str | Path, repo_id: str, source: str | Path,
                     revision: str = "main", commit: str | None = None) -> Path:
    """Copies every file under `source` into a Hugging Face cache as `huggingface_hub`
    stores a downloaded snapshot, so `snapshot_download(..., local_files_only=True)` and
    every vlm-vit loader find it by name with no network.

    The layout: content-addressed `blobs/`, `snapshots/<commit>/<file>` symbolic links to
    them, and `refs/<revision>` holding the commit.

    Args:
        cache: the hub cache (`HF_HUB_CACHE`, or `HF_HOME/hub`).
        repo_id: `org/name`.
        source: a saved model directory.
        revision: the branch or tag the snapshot is under.
        commit: its 40-hex commit id (default: a hash of the content and revision).

    Returns:
        The snapshot directory.
    """
    cache, source = Path(cache), Path(source)
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in source.rglob("*") if p.is_file())
    commit = commit or hashlib.sha1(
        b"".join(p.read_bytes() for p in files) + revision.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for path in files:
        data = path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot


def offline_hub_cache(home: str | Path, monkeypatch) -> Path:
    """An empty Hub cache under `home` made the one in use (`HF_HOME`), offline
    (`HF_HUB_OFFLINE=1`), for the length of a test; returns the cache (`home/hub`).

    Args:
        home: a folder to become `HF_HOME`.
        monkeypatch: pytest's fixture, which undoes the environment changes.
    """
    cache = Path(home) / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def perturbed(model, scale: float = 0.05, seed: int = 0):
    """`model` in eval mode with every weight nudged by seeded noise (`scale` standard
    deviations), so biases, norms and zero-initialised tokens are not trivial in parity
    tests; changed in place and returned."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)
    return model.eval()


def flip_bytes(path: str | Path, offset: int, count: int = 1) -> None:
    """Inverts `count` bytes of the file `path` from `offset` (negative: from the end): the
    corruption the integrity tests plant."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    start = offset % len(data)
    for index in range(start, start + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))
