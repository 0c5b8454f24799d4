"""Files written whole or not at all, and files read within a bound checked before the read (or only their end)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename, so a reader (or a
    resume after a crash) sees the old file or the new one, never part of one. The temporary name carries the
    process id: two processes writing the same path do not write into each other's file."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


class FileTooLarge(ValueError):
    """A file is larger than what it can legitimately hold, or is not a regular file: refused before reading it."""


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refused before anything is read (:class:`FileTooLarge`, one line
    naming ``what`` and the size) when it holds more than ``limit`` bytes or is not a regular file; OSError when it
    cannot be opened. The size is taken from the open file, and the read itself is bounded: a file that grows after
    the check cannot make it read more."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not block the open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileTooLarge(f"{what} {str(path)!r} is not a regular file (a pipe, device or directory)")
        if st.st_size > limit:
            raise FileTooLarge(f"{what} {str(path)!r} is {st.st_size:,} bytes, more than the {limit:,} it can be")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileTooLarge(f"{what} {str(path)!r} grew past {limit:,} bytes while it was read")
    return data


def read_tail(f: BinaryIO, size: int) -> str:
    """The last ``size`` bytes of the open binary file ``f``, decoded (bytes that do not decode are replaced): a log's
    end, never the whole of it."""
    f.seek(max(0, f.seek(0, os.SEEK_END) - size))
    return f.read(size).decode(errors="replace")


def quote(data: bytes | str, limit: int = 40) -> str:
    """A short, escaped prefix of file content for a one-line message: ``'abc'`` or ``'abc'...`` (cut)."""
    text = repr(data[:limit])
    return text + ("..." if len(data) > limit else "")
