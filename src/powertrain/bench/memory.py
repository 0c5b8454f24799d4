"""Host memory in use, from glibc's allocator (CPU tensors and inductor's buffers alike), and the peak of tensor
memory over a piece of code, from the profiler's allocation events."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

_MARK = "powertrain.peak_allocated"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


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


def peak_allocated(fn: Callable[[], object]) -> int:
    """Call ``fn()`` twice and return the highest number of bytes of CPU tensor memory the second call had
    allocated at any moment, above what was allocated when it started (0 if it never allocated more).

    Counted from the profiler's allocation and free events (every tensor c10's CPU allocator serves:
    activations, gradients, gathered or received weights, communication buffers, optimizer state), in the order
    they happened: the true peak inside ``fn``, which heap readings before and after cannot see. The profiler
    does not see the release of memory allocated before it started, so the first call only runs under it: every
    block the second call frees (the first call's leftovers too) was allocated while profiling.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        with record_function(_MARK):
            fn()
    events = prof.profiler.kineto_results.events()
    start = next(e.start_ns() for e in events if e.name() == _MARK)
    memory = sorted(
        ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU),
        key=lambda e: e[0],
    )
    level = sum(n for t, n in memory if t < start)
    base = peak = level
    for _, n in (m for m in memory if m[0] >= start):
        level += n
        peak = max(peak, level)
    return peak - base
