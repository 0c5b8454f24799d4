"""``powersgd:rank=auto``: the rank the link allows, or plain bf16 all-reduce when the link is fast enough.

The rule: DDP (and FSDP) overlap gradient communication with the backward pass, so a message that takes less
time on the link than backward costs (almost) nothing. Given the backward time and the link (bandwidth and
per-collective latency, measured once at start-up with :func:`measure_link`), :func:`choose` picks

1. bf16 all-reduce if its message hides behind backward: exact up to bf16 rounding, and no compression work;
2. otherwise the largest PowerSGD rank (of :data:`RANKS`) whose message hides behind backward;
3. otherwise the smallest rank of :data:`RANKS`: nothing hides, so the step is link-bound and the fewest bytes
   win.

A message's time is the ring all-reduce cost ``latency * collectives + 2 (W - 1) / W * bytes / bandwidth``.
Every rank measures, then all take the slowest rank's figures, so all choose the same.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from powertrain._device import synchronize
from powertrain.comm import Communicator, ring_cost
from powertrain.compress.powersgd import Config, PowerSGDCompressor, recommended_options

__all__ = ["RANKS", "Choice", "Link", "choose", "measure_link", "slowest"]

#: Ranks ``auto`` chooses from, largest first. Below 4 the loss gap grows fast (docs/compression.md, "What it costs,
#: measured").
RANKS = (64, 32, 16, 8, 4)


@dataclasses.dataclass(frozen=True)
class Link:
    """What an all-reduce costs as :func:`measure_link` measures it: ``latency_s`` (a whole small all-reduce's time)
    plus the ring's bytes (:func:`powertrain.comm.ring_cost`) at ``bytes_per_s``."""

    bytes_per_s: float  # inf: too fast to measure with the probe
    latency_s: float
    world: int

    def all_reduce_s(self, nbytes: float, collectives: int = 1) -> float:
        """Seconds to all-reduce ``nbytes`` of payload split into ``collectives`` all-reduces."""
        per_byte, _ = ring_cost("all_reduce", self.world)
        if not per_byte:
            return 0.0
        return collectives * self.latency_s + per_byte * nbytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str  # "bf16" or "powersgd"
    options: dict[str, Any]
    reason: str  # one line: the figures the choice was made from

    @property
    def spec(self) -> str:
        """The choice as a ``--compressor`` spec."""
        return self.name + "".join(f"{',' if i else ':'}{k}={v}" for i, (k, v) in enumerate(self.options.items()))


def measure_link(
    comm: Communicator,
    *,
    min_probe_s: float = 0.25,
    max_probe_bytes: int = 64 << 20,
    device: torch.device | str = "cpu",
) -> Link:
    """Time all-reduces of 4 bytes (latency) and of a probe that grows 4x from 1 MB until it takes
    ``min_probe_s`` (so that a token bucket's burst and TCP's ramp-up are a small part of it) or reaches
    ``max_probe_bytes``. Each size: one warm-up, then the fastest of two, then the slowest rank's time, so every
    rank returns the same :class:`Link`. Nothing is counted in ``comm.stats``. Every rank of ``comm`` must call
    it; ``device``: where the group's tensors live (CUDA for NCCL)."""
    world = comm.world_size
    if not comm.is_distributed:
        return Link(float("inf"), 0.0, world)
    latency = _timed_all_reduce(comm, 4, device)
    size = 1 << 20
    while True:
        seconds = _timed_all_reduce(comm, size, device)
        if seconds >= min_probe_s or size >= max_probe_bytes:
            break
        size *= 4
    extra = seconds - latency
    wire = ring_cost("all_reduce", world)[0] * (size - 4)
    return Link(wire / extra if extra > 0 else float("inf"), latency, world)


def _timed_all_reduce(comm: Communicator, nbytes: int, device: torch.device | str) -> float:
    import torch.distributed as dist

    t = torch.zeros(max(1, nbytes // 4), device=device)
    dist.all_reduce(t, group=comm.group)  # warm-up: connections, buffers
    best = float("inf")
    for _ in range(2):
        dist.barrier(group=comm.group)
        synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=comm.group)
        synchronize(device)  # NCCL returns once the all-reduce is queued
        best = min(best, time.perf_counter() - t0)
    return slowest(comm, best, device)


def slowest(comm: Communicator, seconds: float, device: torch.device | str = "cpu") -> float:
    """The largest of every rank's ``seconds``: what all ranks decide from, so that they decide alike. Not counted
    in ``comm.stats``; every rank of ``comm`` must call it (``device``: where the group reduces, CUDA for NCCL)."""
    if not comm.is_distributed:
        return seconds
    import torch.distributed as dist

    agreed = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=comm.group)
    return agreed.item()


def choose(
    params: Iterable[tuple[str, torch.Tensor]],
    *,
    backward_s: float,
    link: Link,
    options: Mapping[str, Any] | None = None,
) -> Choice:
    """The compressor for ``params`` (``model.named_parameters()``) on ``link``, given the backward pass's time.

    ``options``: the user's other PowerSGD options (``rank`` is ignored); unset ones are
    :data:`~powertrain.compress.powersgd.RECOMMENDED`'s."""
    named = [(n, p) for n, p in params if p.requires_grad]
    numel = sum(p.numel() for _, p in named)
    bf16 = link.all_reduce_s(2 * numel)
    seen = f"backward {backward_s:.3g} s, link {_rate(link)}, latency {1e3 * link.latency_s:.2g} ms"
    if bf16 <= backward_s:
        return Choice(
            "bf16",
            {},
            f"rank=auto chose bf16 all-reduce: its {2 * numel / 1e6:.2f} MB take {bf16:.3g} s, "
            f"hidden behind backward ({seen})",
        )
    base = {k: v for k, v in recommended_options(options or {}).items() if k != "rank"}
    costs = []
    for rank in RANKS:
        comp = PowerSGDCompressor(named, config=Config(rank=rank, **base))
        nbytes = comp.bytes_per_step(0)
        seconds = link.all_reduce_s(nbytes, comp.max_collectives_per_call())
        costs.append((rank, nbytes, seconds))
        if seconds <= backward_s:
            why = (
                f"rank=auto chose rank {rank}: the largest whose {nbytes / 1e6:.2f} MB per step take "
                f"{seconds:.3g} s, hidden behind backward ({seen}; bf16 all-reduce: {bf16:.3g} s)"
            )
            return Choice("powersgd", {"rank": rank, **base}, why)
    rank, nbytes, seconds = costs[-1]
    return Choice(
        "powersgd",
        {"rank": rank, **base},
        f"rank=auto chose rank {rank}, the smallest offered: no message hides behind backward ({seen}); "
        f"its {nbytes / 1e6:.2f} MB per step take {seconds:.3g} s, bf16 all-reduce {bf16:.3g} s",
    )


def _rate(link: Link) -> str:
    if link.bytes_per_s == float("inf"):
        return "faster than the probe can tell"
    return f"{8 * link.bytes_per_s / 1e6:,.1f} Mbit/s"
