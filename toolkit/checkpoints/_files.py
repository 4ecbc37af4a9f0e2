"""Durable files: fsync'ed writes, atomic replacement, fast checksums.

A file or folder is only durable once its data *and* the directory entry naming it reach
the disk: ``fsync`` the file, then the folder holding it (after a rename, the parent).
"""

import json
import math
import mmap
import os
import stat
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors.torch import save_file

CHECKSUM = "xxh3_128"  # ~20 GB/s here; the standard library's crc32 made loads 1.3-2.5x slower
JSON_LIMIT = 64 << 20  # bytes: the largest JSON file read (a manifest of ~500k files)


def checksum(path: Path) -> str:
    """The file's xxh3-128 digest (hex), read through a memory map (no copy into Python)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:  # mmap refuses empty files
            return xxhash.xxh3_128_hexdigest(b"")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_128_hexdigest(view)


def fsync_dir(path: Path) -> None:
    """Make a file's data, or a folder's entries (new, renamed or removed names), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_token() -> int:
    """A non-negative int for :func:`temp_name`: this pid and 32 random bits."""
    return (os.getpid() << 32) | int(uuid.uuid4().hex[:8], 16)


def write_bytes(path: Path, data: bytes) -> None:
    """Write a new file and fsync it."""
    with open(path, "xb", buffering=0) as file:  # unbuffered: written when fsync'ed
        file.write(data)
        os.fsync(file.fileno())


def write_json(path: Path, document: Any) -> None:
    """Write ``document`` as a new JSON file and fsync it; NaN and inf are refused (the codec
    tags them)."""
    write_bytes(path, json.dumps(document, allow_nan=False, ensure_ascii=False, indent=1).encode())


def read_regular(path: Path, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of ``path`` if it is a regular file (not a symlink) of at most ``limit`` bytes.

    Anything else (a FIFO, a device, a link to ``/dev/zero``, a huge sparse file) is a
    ValueError, found without blocking (``O_NONBLOCK``) and without reading it.
    """
    # A symbolic link: OSError ELOOP; a FIFO opens without waiting for a writer.
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW), "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise ValueError(f"not a regular file of at most {limit} bytes")
        return file.read(limit)


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):  # NaN, Infinity, 1e400
        raise ValueError(f"{text} is not a finite number (the codec tags inf and NaN)")
    return value


def read_json(path: Path) -> Any:
    """Parse a JSON file (UTF-8); the only reader of non-tensor data on the load path.

    Raises OSError, or ValueError for anything but a regular file of at most
    :data:`JSON_LIMIT` bytes of strict JSON (no NaN, Infinity or 1e400); RecursionError for
    nesting the parser cannot follow.
    """
    return json.loads(read_regular(path).decode(), parse_constant=_finite, parse_float=_finite)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write CPU tensors as a new safetensors file, with the metadata ``{"format": "pt"}``
    that hub tools expect, and fsync it."""
    save_file(dict(tensors), path, metadata={"format": "pt"})
    fsync_dir(path)


def temp_name(kind: str, name: str, token: int | None = None) -> str:
    """A hidden sibling name, unique per process and call: ``.{kind}-{name}-{pid}-{hex}``.

    ``token`` (from :func:`new_token`) replaces a new one: ranks that write one checkpoint
    together name its temporary folder from the token rank 0 drew.
    """
    token = new_token() if token is None else token
    return f".{kind}-{name}-{token >> 32}-{token & 0xFFFFFFFF:08x}"


def replace_file(path: Path, write: Callable[[Path], None]) -> None:
    """Replace ``path`` atomically: readers see the old content or the new, never a mix.

    ``write(temp)`` creates the new content (durably: the writers here fsync) in a hidden
    sibling, which then takes the name.
    """
    temp = path.parent / temp_name("tmp", path.name)
    try:
        write(temp)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
