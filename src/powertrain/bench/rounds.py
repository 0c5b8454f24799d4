"""The benchmarks' timing loop: configurations stepped in interleaved rounds, so that load from other processes
hits every configuration alike."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from powertrain.models import GPTConfig

__all__ = ["Workload", "interleaved", "slowest", "torch_threads"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a side-by-side step timing trains: the model, its sequences per worker per step, and the rounds of
    :func:`interleaved` (``warmup`` before the ``timed`` ones)."""

    model: GPTConfig
    batch: int
    warmup: int
    timed: int


def interleaved(
    steps: Sequence[Callable[[int], object]], *, warmup: int, timed: int, rotate: bool = False
) -> list[list[float]]:
    """Run ``warmup + timed`` rounds; in each, ``steps[i](round)`` for every configuration ``i``, each after a barrier
    (every rank starts it together: the slower rank's time is the step's; none outside a process group) and timed on
    its own. ``rotate``: start each round one configuration later, so that none is always first. Returns each
    configuration's times of the timed rounds."""
    times: list[list[float]] = [[] for _ in steps]
    order = list(range(len(steps)))
    for round_ in range(warmup + timed):
        shift = round_ % len(order) if rotate and order else 0
        for i in order[shift:] + order[:shift]:
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            steps[i](round_)
            elapsed = time.perf_counter() - t0
            if round_ >= warmup:
                times[i].append(elapsed)
    return times


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per round, the slowest rank's time (``per_rank``: each rank's times of the same rounds): a step is over when
    every rank is done."""
    return [max(round_s) for round_s in zip(*per_rank, strict=True)]


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` (None: left as they are) inside, and given back after: a part timed in
    the calling process must not leave its thread count to whatever runs next there (a test, another part)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
