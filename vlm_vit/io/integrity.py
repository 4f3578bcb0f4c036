"""Content hashes: weights changed after they were written are refused, never used silently.

What vlm-vit writes records the sha256 of each weight file, verified when it is read back:

* a native directory (`VisionEncoder.save_pretrained`) holds `manifest.json`,
  `{"format": "vlm-vit-manifest", "version": 1, "files": {name: {"sha256", "size"}}}`;
* a trainer checkpoint `step_XXXXXXXX.pt` has a `step_XXXXXXXX.pt.sha256` sidecar in
  `sha256sum`'s format (`sha256sum -c` checks it), written before the checkpoint is renamed
  into place (a checkpoint without one is refused); both the hash and the file name it
  records are checked, so files swapped together with their sidecars are refused.

Verification is on by default. `verify=False` where a loader takes it, or the environment
variable `VLM_VIT_VERIFY=0` (for every loader without an explicit `verify`), skips it. Files
without a manifest or sidecar (written by other libraries or older versions) load as before.

Hashing streams the file in 8 MiB chunks (constant memory) through OpenSSL's sha256: measured
at 1.3 to 1.4 GB/s on one core with the file in the page cache, 0.71 to 0.78 s for a 1 GB file,
so verifying roughly adds the time of one more read of the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vlm_vit.io.files import atomic_write, read_json

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "vlm-vit-manifest"
MANIFEST_VERSION = 1
SIDECAR_SUFFIX = ".sha256"
VERIFY_ENV = "VLM_VIT_VERIFY"
CHUNK_BYTES = 8 * 2**20
_HEX = re.compile(r"^[0-9a-f]{64}$")
_SIDECAR_BYTES = 4096  # a sha256, two spaces and a file name
_OFF = ("0", "false", "no", "off")


class IntegrityError(ValueError):
    """A file whose content does not match the hash recorded when it was written."""


def verify_enabled(verify: bool | None = None) -> bool:
    """Whether to verify hashes: `verify` when given, else `VLM_VIT_VERIFY` (default on)."""
    if verify is not None:
        return bool(verify)
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in _OFF


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file, read in `CHUNK_BYTES` chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _relative(directory: Path, file: str | Path) -> str:
    """`file`'s name in a manifest: its path relative to `directory`, with `/`."""
    file = Path(file)
    try:
        return file.relative_to(directory).as_posix()
    except ValueError:  # a name already relative to `directory`
        return file.as_posix()


def _mismatch(path: Path, what: str, remedy: str = "") -> IntegrityError:
    return IntegrityError(f"{path} does not match its {what} hash: the file is corrupt or was "
                          f"changed; {remedy + ', or ' if remedy else ''}pass verify=False (or "
                          f"set {VERIFY_ENV}=0) to load it anyway")


# -- native directories: manifest.json ----------------------------------------------------


def write_manifest(directory: str | Path, files: Iterable[str | Path], *,
                   merge: bool = False) -> Path:
    """Records the sha256 and size of `files` (inside `directory`) in its `manifest.json`,
    written atomically.

    Args:
        directory: the checkpoint directory.
        files: its weight files, as paths in it or names relative to it.
        merge: keep the entries of an existing manifest (for a writer adding files to a
            directory another one wrote, e.g. a pooler beside an encoder's weights).

    Returns:
        The manifest's path.
    """
    directory = Path(directory)
    entries = dict(read_manifest(directory) or {}) if merge else {}
    for file in files:
        name = _relative(directory, file)
        path = directory / name
        entries[name] = {"sha256": file_sha256(path), "size": path.stat().st_size}
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "files": dict(sorted(entries.items()))}
    with atomic_write(directory / MANIFEST_NAME, "w") as handle:
        json.dump(manifest, handle, indent=2)
        handle.write("\n")
    return directory / MANIFEST_NAME


def read_manifest(directory: str | Path) -> dict[str, dict[str, Any]] | None:
    """The `files` a directory's manifest records, or None when it has none.

    Raises:
        ValueError: for a manifest of another shape, naming it and the entry.
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = read_json(path)
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r} is not a vlm-vit manifest (expected "
                         f"format {MANIFEST_FORMAT!r}, version {MANIFEST_VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{path}: files must map file names to {{sha256, size}}, got "
                         f"{type(files).__name__}")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and _HEX.match(entry["sha256"]) and type(entry.get("size")) is int
                and entry["size"] >= 0):
            raise ValueError(f"{path}: the entry for {name!r} must be {{\"sha256\": 64 hex "
                             f"digits, \"size\": bytes}}, got {entry!r}")
    return files


def verify_files(directory: str | Path, files: Iterable[str | Path],
                 verify: bool | None = None) -> None:
    """Checks `files` (read from `directory`) against its manifest, when it has one.

    Args:
        directory: the checkpoint directory.
        files: the files about to be read from it.
        verify: as `verify_enabled`.

    Raises:
        IntegrityError: for a file whose size or sha256 differs from its manifest entry, or
            a file the manifest does not list.
        ValueError: for a malformed manifest.
    """
    if not verify_enabled(verify):
        return
    directory = Path(directory)
    recorded = read_manifest(directory)
    if recorded is None:
        logger.debug("%s has no %s: its weights are not verified", directory, MANIFEST_NAME)
        return
    for file in files:
        name = _relative(directory, file)
        path = directory / name
        entry = recorded.get(name)
        if entry is None:
            raise IntegrityError(
                f"{path} is not listed in {directory / MANIFEST_NAME}: the directory was "
                f"changed after vlm-vit wrote it; re-create it, or pass verify=False (or set "
                f"{VERIFY_ENV}=0) to load it anyway")
        if path.stat().st_size != entry["size"] or file_sha256(path) != entry["sha256"]:
            raise _mismatch(path, "manifest", "re-download or re-create it")


# -- single files: the `.sha256` sidecar ----------------------------------------------------


def sidecar_path(path: str | Path) -> Path:
    """Where the hash of `path` is kept: `path` + ".sha256"."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def write_sidecar(path: str | Path, digest: str | None = None) -> Path:
    """Writes `path`'s sha256 beside it, atomically, as `sha256sum` does.

    Args:
        path: the file.
        digest: its hex sha256 when already known (hashed while written, so the sidecar can
            exist before `path` does); default: read from `path`.
    """
    path = Path(path)
    sidecar = sidecar_path(path)
    with atomic_write(sidecar, "w") as handle:
        handle.write(f"{digest or file_sha256(path)}  {path.name}\n")
    return sidecar


def verify_sidecar(path: str | Path, verify: bool | None = None) -> bool:
    """Checks `path` against its sidecar: the hash, and the file name it records (so two
    files swapped together with their sidecars are refused, as `sha256sum -c` would).

    Returns:
        True when it was verified; False when there is no sidecar or verification is off.

    Raises:
        IntegrityError: when the hash or the name differs, or the sidecar is unreadable.
    """
    path = Path(path)
    sidecar = sidecar_path(path)
    if not verify_enabled(verify) or not sidecar.is_file():
        return False
    unchecked = f"pass verify=False (or set {VERIFY_ENV}=0) to load {path.name} unchecked"
    try:
        with open(sidecar, "rb") as handle:  # a line, never a whole file however large
            line = handle.read(_SIDECAR_BYTES).decode("ascii").rstrip("\r\n")
    except (UnicodeDecodeError, OSError) as error:
        raise IntegrityError(f"{sidecar} is not a sha256 line ({str(error)[:100]}); "
                             f"{unchecked}") from error
    recorded, _, name = line.partition("  ")
    if not _HEX.match(recorded):
        raise IntegrityError(f"{sidecar} holds {recorded[:80]!r}, not a sha256 of 64 hex "
                             f"digits; {unchecked}")
    if name.removeprefix("*") != path.name:  # "*": sha256sum's binary mode
        raise IntegrityError(f"{sidecar} records the hash of {name[:100]!r}, not of "
                             f"{path.name}: the files were swapped or renamed; {unchecked}")
    if file_sha256(path) != recorded:
        raise _mismatch(path, "recorded")
    return True


def plain_file(directory: str | Path, name: object, named_by: str) -> Path:
    """`directory / name`, checked to be a file of `directory` itself: `name` is a plain
    file name (no separator, not "." or ".."), and the file a regular one, not a symbolic
    link (whose target could be anywhere).

    Args:
        directory: where the file must be.
        name: the name as a file recorded it.
        named_by: what recorded it, for the error.

    Raises:
        ValueError: naming `named_by` and the name.
    """
    directory = Path(directory)
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name \
            or "\0" in name:
        raise ValueError(f"{named_by} names the file {str(name)[:200]!r}, which is not a plain "
                         f"file name in {directory}, where the files it names must be; refusing it")
    path = directory / name
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link (named by {named_by}): a checkpoint's "
                         f"files must be its own, not links to elsewhere; refusing it")
    if not path.is_file():
        raise ValueError(f"{path} (named by {named_by}) "
                         f"{'is not a regular file' if path.exists() else 'does not exist'}")
    return path
