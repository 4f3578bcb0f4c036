"""Image files that make PIL raise something other than the usual OSError (issue 26, section
4): each is bytes, to be written under any name (`.jpg` included) or put into a tar shard.

- `unknown_dds()`: a 320-byte DirectDraw Surface whose pixel-format flags are 0; PIL's
  `Image.open` raises `NotImplementedError("Unknown pixel format flags 0")`.
- `fractional_im()`: a 2 KB IFUNC IM file whose size line is `4.5*4`; it opens (and passes
  `verify()`), then `load()` raises `TypeError` (a float where PIL needs an int).
- `huge_png()`: a 60000 x 60000 PNG header with no pixel data (under 100 bytes); PIL's
  `Image.open` raises `DecompressionBombError`, which is no OSError.
"""

from __future__ import annotations

import struct
import zlib

#: PIL's DDS header: magic, then 124 bytes (flags, height, width, ..., pixel format at 72).
_DDS_HEADER_SIZE = 124


def unknown_dds() -> bytes:
    """A 320-byte DDS file that PIL's `Image.open` refuses with `NotImplementedError`."""
    flags, height, width = 0x1007, 8, 8  # CAPS | HEIGHT | WIDTH | PIXELFORMAT
    header = struct.pack("<3I", flags, height, width).ljust(68, b"\0")
    header += struct.pack("<4I", 32, 0, 0, 0)  # pixel format: size 32, flags 0: unknown
    header = header.ljust(_DDS_HEADER_SIZE - 4, b"\0")
    data = b"DDS " + struct.pack("<I", _DDS_HEADER_SIZE) + header
    return data.ljust(320, b"\0")


def fractional_im() -> bytes:
    """A 2 KB IM file that opens and verifies, then raises `TypeError` on `load()`."""
    header = b"Image type: L image\r\nName: x\r\nImage size (x*y): 4.5*4\r\n"
    return (header + b"\0" * 10 + b"\x1a").ljust(2048, b"\0")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + \
        struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def huge_png(side: int = 60_000) -> bytes:
    """A PNG of `side` x `side` RGB pixels by its header, with no pixel data at all."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IEND", b"")


#: Each hostile file by name, as the function that builds its bytes.
HOSTILE = {"dds": unknown_dds, "im": fractional_im}
