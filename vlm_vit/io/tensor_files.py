"""Weight-file readers that name the file in every error: safetensors (the header checked
against the file's size before anything is allocated) and `.npz` archives read by their `.npy`
headers, never unpickled."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any

import torch

# The safetensors library's own bound on its header.
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
# A zip member claiming to inflate more than this is refused (deflate's maximum is ~1032).
MAX_NPZ_INFLATION = 1100


# -- safetensors ---------------------------------------------------------------------------

# Bits per element of each safetensors dtype (the format's own list, sub-byte floats included).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16,
    "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64,
    "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def check_safetensors_header(path: str | Path) -> dict[str, Any]:
    """Reads and checks a safetensors header against the file before any tensor is read.

    The header length must fit the file and `MAX_SAFETENSORS_HEADER_BYTES`; every tensor's
    `data_offsets` must lie inside the data and span exactly shape x dtype size.

    Returns:
        The parsed header.

    Raises:
        ValueError: naming the file (and the tensor) for anything else.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is {size} bytes, too short for a safetensors file "
                             f"(8-byte header length first)")
        declared = int.from_bytes(prefix, "little")
        if declared > min(size - 8, MAX_SAFETENSORS_HEADER_BYTES) or declared < 2:
            raise ValueError(f"{path} declares a header of {declared} bytes, but the file has "
                             f"{size - 8} after the length (and a header may be 2 to "
                             f"{MAX_SAFETENSORS_HEADER_BYTES} bytes): truncated or not "
                             f"safetensors")
        raw = handle.read(declared)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: the safetensors header is not valid JSON: "
                         f"{type(error).__name__}: {str(error)[:200]}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header must be a JSON object, found "
                         f"{type(header).__name__}")
    data_size = size - 8 - declared
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be {{dtype, shape, data_offsets}}, got {entry!r:.80}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BITS:
            raise ValueError(f"{where} has dtype {dtype!r:.40}, not one of "
                             f"{', '.join(SAFETENSORS_DTYPE_BITS)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{where} has shape {shape!r:.80}, not a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{where} has data_offsets {offsets!r:.80}, not [begin, end] "
                             f"with 0 <= begin <= end")
        if offsets[1] > data_size:
            raise ValueError(f"{where} has data_offsets {offsets}, outside the "
                             f"{data_size} bytes of data the file holds: truncated or corrupt")
        expected = (math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype] + 7) // 8
        if offsets[1] - offsets[0] != expected:
            raise ValueError(f"{where} spans {offsets[1] - offsets[0]} bytes, but shape "
                             f"{shape} x {dtype} needs {expected}")
    return header


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Reads every tensor of a safetensors file, naming `path` when it is missing or broken.

    The header is checked against the file size first (`check_safetensors_header`).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    check_safetensors_header(path)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error


# The safetensors name of each torch dtype a checkpoint holds.
TORCH_SAFETENSORS_DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64",
}


class SafetensorsStream:
    """Writes one safetensors file tensor by tensor, so a file larger than memory can be
    written one group of tensors at a time (the safetensors library writes a whole dict).

    The header is laid out from `layout` first (every tensor's shape and dtype, in the order
    they will be written); `write` then appends each tensor's bytes and checks it is the next
    one declared, with the declared shape and dtype. Open it with `atomic_write`.

    Args:
        handle: the binary file to write.
        layout: name -> (shape, dtype), in writing order.
        metadata: the header's `__metadata__` (strings).
    """

    def __init__(self, handle, layout: dict[str, tuple[torch.Size, torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, (shape, dtype) in layout.items():
            if dtype not in TORCH_SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors "
                                 "files here do not hold")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": TORCH_SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the library's
        handle.write(len(raw).to_bytes(8, "little") + raw)
        self._handle, self._pending = handle, list(layout.items())

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self._pending or self._pending[0][0] != name:
            expected = self._pending[0][0] if self._pending else "nothing more"
            raise ValueError(f"tensor {name!r} written out of order: {expected!r} is next")
        shape, dtype = self._pending[0][1]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"declared {tuple(shape)} {dtype}")
        self._pending.pop(0)
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._handle.write(memoryview(data))

    def close(self) -> None:
        """Raises ValueError when a declared tensor was never written."""
        if self._pending:
            raise ValueError(f"{len(self._pending)} declared tensors were not written, "
                             f"{self._pending[0][0]!r} first")


# -- npz -----------------------------------------------------------------------------------


def read_npz(path: str | Path) -> dict[str, torch.Tensor]:
    """Every array of a numpy `.npz` archive as a tensor, each header checked first.

    Nothing is unpickled (object arrays are refused) and nothing is allocated before the
    member's header is checked against the sizes the zip records: an array may not declare
    more bytes than its member holds, and a member may not claim to inflate more than
    `MAX_NPZ_INFLATION` times its compressed size (deflate's own limit is about 1032).

    Raises:
        ValueError: naming the file and the array for anything unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            names = [m.filename for m in members]
            if len(set(names)) != len(names):
                raise ValueError(f"{path} names an array twice: not a numpy .npz archive")
            return {m.filename.removesuffix(".npy"): _read_npy_member(archive, m, path)
                    for m in members}
    except (OSError, zipfile.BadZipFile, EOFError, NotImplementedError) as error:
        raise ValueError(f"{path} is not a readable .npz file (truncated or corrupt?): "
                         f"{error}") from error


def _read_npy_member(archive: zipfile.ZipFile, member: zipfile.ZipInfo,
                     path: Path) -> torch.Tensor:
    import numpy as np
    from numpy.lib import format as npy

    name = member.filename.removesuffix(".npy")
    where = f"{path}: array {name!r}"
    archive_size = path.stat().st_size
    if member.compress_size > archive_size:
        raise ValueError(f"{where}: its zip entry claims {member.compress_size} compressed "
                         f"bytes, more than the {archive_size}-byte file holds")
    stored = member.compress_type == zipfile.ZIP_STORED
    inflation = member.file_size / max(member.compress_size, 1)
    if (stored and member.file_size != member.compress_size) or inflation > MAX_NPZ_INFLATION:
        raise ValueError(f"{where}: its zip entry claims {member.file_size} bytes from "
                         f"{member.compress_size} compressed ones: corrupt or a zip bomb")
    with archive.open(member) as handle:
        try:
            version = npy.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = npy.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran, dtype = npy.read_array_header_2_0(handle)
            else:
                raise ValueError(f".npy format version {version} is not 1.0 or 2.0")
        except ValueError as error:
            raise ValueError(f"{where} has no readable .npy header: {error}") from error
        if dtype.hasobject:
            raise ValueError(f"{where} has dtype {dtype}: object arrays need unpickling, "
                             f"which vlm-vit never does; refused")
        if dtype.fields is not None or dtype.subdtype is not None or not dtype.itemsize:
            raise ValueError(f"{where} has the structured dtype {dtype}, which torch cannot "
                             f"hold")
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        header_bytes = handle.tell()
        if nbytes > member.file_size - header_bytes:
            raise ValueError(f"{where} declares shape {shape} of {dtype} ({nbytes} bytes), "
                             f"but its member holds {member.file_size - header_bytes} bytes "
                             f"after the header: corrupt or hostile")
        array = np.empty(count, dtype=dtype)
        view = memoryview(array.view(np.uint8))  # (nbytes,): filled in place, no copy
        filled = 0
        while filled < nbytes:
            read = handle.readinto(view[filled:])
            if not read:
                raise ValueError(f"{where} ends after {filled} of its {nbytes} bytes: "
                                 f"truncated")
            filled += read
    array = array.reshape(shape, order="F" if fortran else "C")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(array)
    except TypeError as error:
        raise ValueError(f"{where} has dtype {dtype}, which torch cannot hold") from error
