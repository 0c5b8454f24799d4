"""Bytes one compressor call reads and writes on the 124m GPT's gradients, counted per ATen operation on the CPU.

A device-independent figure for what a GPU cannot hide: on an H100 (~3 TB/s of HBM) every pass over the 163M
float32 gradients (0.65 GB) costs about 0.2 ms whatever the kernels, so the passes a call makes bound its time from
below. Counted as the sizes of each operation's tensor arguments (read) and results (written; an in-place one is
both, unless the operation only overwrites it: a fill, a random draw, a copy's destination, an ``out=``), views not at
all: the true traffic for elementwise work, a floor for matrix products (each operand read once). World size 1 (no
collectives; an all-gather compressor decodes one message per rank, so its traffic grows with the ranks). Usage:
``python tools/compressor_traffic.py powersgd rank=32 start=0``; ``fused=auto``: the fused kernels
(:mod:`powertrain.ops.fused`, as CUDA runs by default), ``fused=1``: those and PowerSGD's Triton kernel
(:mod:`powertrain.ops.lowrank_kernels`, ``POWERTRAIN_FUSED=1``), each counted as one operation by its inputs and
outputs. ``TOP=N`` in the environment lists the N operations that move the most bytes (10).
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpu_measure import SIZES
from powertrain.compress import make_compressor
from powertrain.models import GPT

#: Operations that move no data (views, allocations, the host's reads of a flag).
FREE = frozenset(
    {
        "view",
        "_unsafe_view",
        "as_strided",
        "reshape",
        "slice",
        "select",
        "unbind",
        "split",
        "t",
        "split_with_sizes",
        "transpose",
        "expand",
        "alias",
        "detach",
        "unsqueeze",
        "squeeze",
        "permute",
        "narrow",
        "view_as",
        "lift_fresh",
        "_reshape_alias",
        "empty",
        "empty_like",
        "new_empty",
        "empty_strided",
        "_local_scalar_dense",
    }
)


#: Operations that overwrite their first argument without reading it (their other tensor arguments are read).
WRITE_ONLY_FIRST = frozenset(
    {
        "zero_",
        "fill_",
        "uniform_",
        "normal_",
        "random_",
        "bernoulli_",
        "exponential_",
        "copy_",
        "_foreach_copy_",
        "_foreach_zero_",
    }
)
#: Operations that take only the shape of their tensor argument.
SHAPE_ONLY = frozenset(
    {"zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_zeros", "new_ones", "new_full"}
)


def count_fused(traffic: Traffic, kernels: bool) -> None:
    """Count each fused kernel (:func:`powertrain.ops.fused.fused_or_eager`) as one operation reading its tensor
    arguments and writing its result, computed by its eager twin (the same values) unseen by ``traffic``."""
    from torch.utils._python_dispatch import _disable_current_modes

    from powertrain.ops import fused

    def fused_or_eager(name: str, _fused: Any, eager: Any, device: torch.device) -> Any:
        def call(*args: Any) -> Any:
            with _disable_current_modes():
                out = eager(*args)
            tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
            traffic.bytes[f"fused {name}"] += sum(t.numel() * t.element_size() for t in tensors)
            traffic.calls[f"fused {name}"] += 1
            return out

        return call

    os.environ["POWERTRAIN_FUSED"] = "1"  # the fusion CUDA's default does, counted here on the CPU
    fused.fused_or_eager = fused_or_eager  # type: ignore[assignment]
    if kernels:
        count_lowrank_kernels(traffic)


def count_lowrank_kernels(traffic: Traffic) -> None:
    """Count PowerSGD's Triton kernel (:mod:`powertrain.ops.lowrank_kernels`, as CUDA runs it) as one operation that
    reads its tensor arguments once and writes its outputs (``owed`` and ``p``, also arguments: counted once each, as
    written only), computed by its eager twin unseen by ``traffic``."""
    from torch.utils._python_dispatch import _disable_current_modes

    from powertrain.ops import lowrank_kernels as kernels

    def counted(name: str, eager: Any) -> Any:
        def call(*args: Any) -> Any:
            with _disable_current_modes():
                out = eager(*args)
            tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
            traffic.bytes[f"kernel {name}"] += sum(t.numel() * t.element_size() for t in tensors)
            traffic.calls[f"kernel {name}"] += 1
            return out

        return call

    kernels.usable = lambda device, dtype: dtype == torch.float32
    kernels.sum_project = counted("sum_project", kernels.sum_project_eager)


class Traffic(TorchDispatchMode):
    """Counts, per operation name, the calls and the bytes of their tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in FREE:
            written = out if out is not None or not name.endswith("_") else args[0]  # in-place foreach: None
            inputs = {k: v for k, v in kwargs.items() if k != "out"}  # an out= is written, not read
            read = [] if name in SHAPE_ONLY else (args[1:] if name in WRITE_ONLY_FIRST else args, inputs)
            tensors = [t for t in tree_flatten((read, written))[0] if isinstance(t, torch.Tensor)]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
            self.calls[name] += 1
        return out


def main(argv: list[str]) -> None:
    name, options = argv[0], dict(kv.split("=", 1) for kv in argv[1:])
    opts: dict[str, Any] = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in options.items()}
    if "start" in opts:
        opts["start_compressing_after_num_steps"] = opts.pop("start")
    fused = str(opts.pop("fused", 0))
    if fused not in ("0", "auto", "1"):
        raise SystemExit(f"fused={fused}: choose 0 (eager), auto (CUDA's default) or 1 (POWERTRAIN_FUSED=1)")
    config, _ = SIZES["124m"]
    torch.manual_seed(0)
    model = GPT(config)
    grads = [torch.randn_like(p) for p in model.parameters()]
    comp = make_compressor(name, model.named_parameters(), **opts)
    for _ in range(2):  # warm-up: error buffers, factors
        comp.aggregate(grads)
    traffic = Traffic()
    if fused != "0":
        count_fused(traffic, kernels=fused == "1")
    with traffic:
        comp.aggregate(grads)
    total, gradient = sum(traffic.bytes.values()), 4 * sum(g.numel() for g in grads)
    print(
        f"{name} {opts} fused={fused}: {sum(traffic.calls.values())} operations, {total / 1e9:.2f} GB, "
        f"{total / gradient:.1f} passes over the float32 gradients"
    )
    for op, n in traffic.bytes.most_common(int(os.environ.get("TOP", "10"))):
        print(f"  {op:20s} {traffic.calls[op]:4d} calls {n / 1e9:6.2f} GB")


if __name__ == "__main__":
    main(sys.argv[1:])
