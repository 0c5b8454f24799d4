"""Files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


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
