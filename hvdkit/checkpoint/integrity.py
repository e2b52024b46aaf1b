"""Two integrity layers of a checkpoint file, checked before anything trusts its content.

1. **A sealed header.** The file starts with a 512-byte HDF5 user block (HDF5 and
   ``h5dump`` skip it) holding ``hvdkit-checkpoint 2``, the size and the SHA-256 of every
   byte after it. :func:`unseal` checks that digest *before* HDF5 parses anything: HDF5 can
   crash the process on a damaged file (a segfault on 1 of a few hundred random byte flips).
2. **A content checksum.** A CRC-32 over every name, attribute and dataset byte, stored as
   the root attribute ``checksum`` (:func:`content_checksum`), plus a CRC-32 per dataset
   (written by :mod:`hvdkit.h5tree`), so a damaged tensor is named.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import numpy as np

from ..h5tree import crc32_of

__all__ = ["USERBLOCK", "MAGIC", "seal", "unseal", "content_checksum", "HeaderError"]

USERBLOCK = 512
MAGIC = b"hvdkit-checkpoint 2\n"  # the header's version, not the layout's (format_version)


class HeaderError(ValueError):
    """The sealed header is missing, damaged, or does not match the content."""


def seal(data: bytearray) -> bytes:
    """Write the header into the (zeroed) user block of an encoded file; returns the file."""
    body = memoryview(data)[USERBLOCK:]
    header = MAGIC + f"size {len(body)}\nsha256 {hashlib.sha256(body).hexdigest()}\n".encode()
    data[: len(header)] = header
    return bytes(data)


def unseal(data: bytes) -> None:
    """Raise :class:`HeaderError` unless ``data`` is a sealed file whose digest matches."""
    if not data.startswith(MAGIC):
        if data.startswith(b"\x89HDF"):
            raise HeaderError("is an HDF5 file but not an hvdkit checkpoint (v2)")
        raise HeaderError("has a damaged header or is not a checkpoint")
    try:
        lines = data[len(MAGIC):USERBLOCK].split(b"\n")
        size = int(lines[0].removeprefix(b"size "))
        digest = lines[1].removeprefix(b"sha256 ").decode("ascii")
        padding_clean = not any(b"\n".join(lines[2:]))
    except (IndexError, ValueError, UnicodeDecodeError):
        raise HeaderError("has a damaged header") from None
    body = memoryview(data)[USERBLOCK:]
    if len(body) != size:
        raise HeaderError(f"is truncated or padded: {len(body)} of {size} bytes")
    if not padding_clean or hashlib.sha256(body).hexdigest() != digest:
        raise HeaderError("is corrupt: SHA-256 of its content does not match the digest written with it")


def _attr_bytes(value: Any) -> bytes:
    """A stable byte form of one attribute value (arrays in full, never abbreviated)."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str}{value.shape}".encode() + value.tobytes()
    return repr(value).encode()


def content_checksum(f: Any) -> int:
    """CRC-32 over everything an open HDF5 file holds, except the root ``checksum`` attribute.

    Every group and dataset by name, every attribute (the root's too) by name and value,
    every dataset's dtype, shape and *actual* bytes (not the CRC recorded beside it).
    One flipped bit anywhere in the content changes it.
    """
    import h5py

    crc = 0

    def add(data: bytes) -> None:
        nonlocal crc
        crc = zlib.crc32(data, crc)

    def add_attrs(name: str, node: Any) -> None:
        for key in sorted(node.attrs):
            if not (name == "/" and key == "checksum"):
                add(f"A {name} {key} ".encode() + _attr_bytes(node.attrs[key]) + b"\n")

    add_attrs("/", f)
    nodes: list[tuple[str, Any]] = []
    f.visititems(lambda name, node: nodes.append((name, node)))
    for name, node in sorted(nodes, key=lambda item: item[0]):
        if isinstance(node, h5py.Dataset):
            add(f"D {name} {node.dtype.str} {node.shape}\n".encode())
            crc = crc32_of(np.asarray(node[()]), crc)
        else:
            add(f"G {name}\n".encode())
        add_attrs(name, node)
    return crc & 0xFFFFFFFF
