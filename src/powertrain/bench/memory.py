"""Host memory in use, from glibc's allocator (CPU tensors and inductor's buffers alike)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                              "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        lib.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return lib


_LIBC = _libc()


def available() -> bool:
    """Whether :func:`heap_in_use` works here (glibc >= 2.33)."""
    return _LIBC is not None


def heap_in_use() -> int:
    """Bytes currently allocated through malloc (small blocks and mmap-ed large ones), after a GC pass."""
    if _LIBC is None:
        raise RuntimeError("heap_in_use needs glibc's mallinfo2 (glibc >= 2.33)")
    gc.collect()
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
