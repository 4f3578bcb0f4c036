"""An encoder-output cache that is never stale: each image's outputs stored under a key made
of the image's content and of everything that changes them.

    cache = EncodeCache("~/.cache/vlm-vit/encode", max_bytes=50 * 2**30)
    context = cache.context(encoder, processor, layers=[-2], keep_prefix=False)
    tensors = cache.get(context, image_bytes)       # None on a miss
    cache.put(context, image_bytes, {"layer_-2": tokens})

The key is the SHA-256 of the image file's bytes together with the context: a hash of the
encoder's weights (every tensor's bytes, dtype and shape) and config, the processor's
settings, the layers, the prefix, the dtype and the device type. A change of any of them is
another key, so a cache entry is never returned for outputs it does not hold; an entry holds
the bytes the computation gave, so a hit is bit-identical to it.

Entries are safetensors files written to a temporary name and renamed into place (`os.replace`
is atomic): a writer killed half-way leaves only a temporary file, which no reader opens and
a later eviction removes; two writers of one key both write complete files and the last
rename wins, with the same bytes. Each entry's metadata holds a SHA-256 of its tensors, which
a read checks: a damaged entry is a miss (and is removed), never returned. With `max_bytes`,
the least recently used entries (by modification time, which a hit refreshes) are evicted
after each write until the cache fits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT = "vlm-vit-encode-cache/1"
SUFFIX = ".safetensors"
STALE_TEMPORARY_SECONDS = 3600.0  # a temporary file this old belongs to a dead writer


@dataclass(frozen=True)
class CacheContext:
    """Everything besides the image that an entry's outputs depend on, hashed once per run.

    Attributes:
        digest: the SHA-256 of the parts below, hex.
        parts: what was hashed (weights' digest, config, processor, layers, ...), for the log.
    """

    digest: str
    parts: dict[str, Any]


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 over every tensor of the module's state dict: its name, dtype, shape and
    bytes, in name order (a change of any weight changes it)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def open_cache(directory: str | os.PathLike | None, max_gb: float | None = None
               ) -> EncodeCache | None:
    """The commands' `--cache DIR` and `--cache-max-gb GB`: the cache, or None without a
    directory.

    Raises:
        ValueError: for `max_gb` without a directory, or not above 0.
    """
    if max_gb is not None and (directory is None or not max_gb > 0):
        raise ValueError(f"--cache-max-gb needs --cache and a size above 0, got {max_gb}")
    if directory is None:
        return None
    return EncodeCache(directory, max_bytes=None if max_gb is None
                       else max(1, int(max_gb * 2**30)))


class EncodeCache:
    """A folder of cached encoder outputs (see the module).

    Args:
        directory: the cache's folder (created when missing).
        max_bytes: evict the least recently used entries beyond this total size (None: keep
            everything).

    Raises:
        ValueError: for a `max_bytes` that is not a positive integer, or a `directory` that
            is a file.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or
                                      not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"the cache {self.directory} is a file, not a folder")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = self.misses = 0

    @staticmethod
    def context(encoder: torch.nn.Module, processor: Any, **settings: Any) -> CacheContext:
        """The key's context for outputs of `encoder` (a `VisionEncoder` or a tower: its
        weights and config) on pixels from `processor`, with `settings` (layers, prefix,
        pooler, ...: anything else the caller's outputs depend on, JSON-serialisable)."""
        parameter = next(encoder.parameters())
        config = getattr(getattr(encoder, "encoder", encoder), "config", None)
        parts = {"format": FORMAT, "weights": weights_digest(encoder),
                 "config": config.to_dict() if hasattr(config, "to_dict") else repr(config),
                 "processor": processor.to_dict() if hasattr(processor, "to_dict")
                 else repr(processor),
                 "dtype": str(parameter.dtype), "device": parameter.device.type,
                 "settings": settings}
        text = json.dumps(parts, sort_keys=True, default=repr)
        return CacheContext(hashlib.sha256(text.encode()).hexdigest(), parts)

    def _path(self, context: CacheContext, image: bytes) -> Path:
        key = hashlib.sha256(context.digest.encode() + b"|" + image).hexdigest()
        return self.directory / key[:2] / (key + SUFFIX)

    def get(self, context: CacheContext, image: bytes) -> dict[str, torch.Tensor] | None:
        """The outputs stored for `image` (its file's bytes) under `context`, or None."""
        from safetensors import SafetensorError, safe_open

        path = self._path(context, image)
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except (FileNotFoundError, SafetensorError, OSError):
            self.misses += 1
            return None
        if metadata.get("format") != FORMAT or metadata.get("sha256") != tensors_digest(tensors):
            logger.warning("removed a damaged cache entry %s", path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self.misses += 1
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # recently used
        self.hits += 1
        return tensors

    def put(self, context: CacheContext, image: bytes,
            tensors: dict[str, torch.Tensor]) -> Path:
        """Stores `tensors` (on the CPU, as computed) for `image` under `context`,
        atomically; then evicts down to `max_bytes`."""
        from safetensors.torch import save

        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        data = save(tensors, metadata={"format": FORMAT, "sha256": tensors_digest(tensors)})
        path = self._path(context, image)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        if self.max_bytes is not None:
            self.evict(self.max_bytes)
        return path

    def entries(self) -> list[tuple[Path, int, float]]:
        """(path, size, last use) of every complete entry."""
        found = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                status = path.stat()
                found.append((path, status.st_size, status.st_mtime))
        return found

    def evict(self, max_bytes: int) -> int:
        """Removes the least recently used entries until the rest fit in `max_bytes`, and
        temporary files of writers dead for `STALE_TEMPORARY_SECONDS`; the count removed."""
        now, removed = time.time(), 0
        for temp in self.directory.glob("*/.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                if now - temp.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                    temp.unlink()
        entries = sorted(self.entries(), key=lambda entry: entry[2])
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total <= max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
            total -= size
        return removed
