"""One model size's measurements for ``make gpu-check`` (tools/gpu_stages.py), in one process (``python
tools/gpu_measure.py SIZE DEVICE JSON``).

Under bf16 autocast, one micro-batch of ``batch x block_size`` tokens, at world size 1:

1. forward and backward time (medians, the device synchronised around each);
2. each compressor's compress + decompress time: ``aggregate`` at world size 1 runs all of its math and none of its
   collectives (PowerSGD ranks 4, 32 and what ``rank=auto`` picks for this backward on a 100 Gbit/s link between
   2 nodes of 8 GPUs; int8; bf16), as a fraction of backward; PowerSGD rank 32 and int8 above :data:`TARGET` of
   backward get a ``torch.profiler`` table of their top operations (:data:`PROFILED`);
3. peak memory of a training step (AdamW) with each way to train (``powertrain train``'s own strategies on a world
   of one: DDP, DDP with PowerSGD, FSDP2, RTP, SimpleFSDP compiled) and GaLore's optimizer state against AdamW's.

Every item is recorded on its own (an error becomes ``{"error": ...}`` and the next one runs) and the JSON file is
rewritten after each, so a stage stopped by its timeout still returns what it measured.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_cluster import ALPHA_S, GPUS, NODES
from powertrain import _json
from powertrain._device import synchronize
from powertrain.models import GPT, GPTConfig

#: (model, sequences per micro-batch) per size name. The GPT-2 shapes with nanoGPT's vocabulary (50304); powertrain's
#: GPT does not tie its output head to the embedding, so "124m" has 163M parameters and "350m" 406M.
SIZES: dict[str, tuple[GPTConfig, int]] = {
    "124m": (GPTConfig(50304, 1024, 12, 12, 768), 8),
    "350m": (GPTConfig(50304, 1024, 24, 16, 1024), 8),
    "tiny": (GPTConfig(256, 64, 2, 2, 64), 4),  # the CPU dry run's stand-ins
    "small": (GPTConfig(256, 64, 2, 4, 128), 4),
}
#: The issue's target: PowerSGD rank 32's compress + decompress at most this fraction of backward (124M, H100).
TARGET = 0.10
PSGD = {"start_compressing_after_num_steps": 0}  # the recommended config (paper, bf16 factors), compressing at once
COMPRESSORS: dict[str, tuple[str, dict[str, Any]]] = {
    "PowerSGD r4": ("powersgd", {"rank": 4, **PSGD}),
    "PowerSGD r32": ("powersgd", {"rank": 32, **PSGD}),
    "int8": ("int8", {}),
    "bf16": ("bf16", {}),
}
#: Compressors whose top operations are profiled (``torch.profiler``) when above :data:`TARGET` of backward, with the
#: result's key and the file the GPU check writes it to: the target's rank 32, and int8 (99.8% of backward on the
#: H100's first run, a compressor whose math is a few passes over the gradients: per-parameter calls were suspected).
PROFILED: dict[str, tuple[str, str]] = {
    "PowerSGD r32": ("powersgd_r32_profile", "powersgd_profile.txt"),
    "int8": ("int8_profile", "int8_profile.txt"),
}
#: The link rank=auto is asked about, one of tools/gpu_cluster.py's: 100 Gbit/s between nodes, its smaller cluster in
#: one ring (the link carries a GPU's whole ring traffic); Link's latency is a whole all-reduce's (what measure_link
#: measures), for which the cluster model's per-message alpha stands in, as it did on the H100's run.
AUTO_LINK = (100e9 / 8, ALPHA_S, NODES[0] * GPUS)  # Link(bytes_per_s, latency_s, world)
#: Ways to train whose step's peak memory is measured: powertrain train's --parallel, compressor, compiled.
MEMORY: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "ddp": ("ddp", "none", {}, False),
    "ddp + PowerSGD r32": ("ddp", "powersgd", {"rank": 32, **PSGD}, False),
    "fsdp2": ("fsdp", "none", {}, False),
    "rtp": ("rtp", "none", {}, False),
    "simple_fsdp compiled": ("simple_fsdp", "none", {}, True),  # last: inductor's compile takes longest
}


def _median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _error() -> dict[str, str]:
    lines = traceback.format_exc().strip().splitlines()
    return {"error": lines[-1][:500], "traceback": "\n".join(lines[-12:])}


class _Record:
    """The stage's results, rewritten to ``path`` after every item."""

    def __init__(self, path: Path, **head: Any) -> None:
        self.path, self.data = path, dict(head)
        self.save()

    def item(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            self.data[key] = fn()
        except Exception:
            self.data[key] = _error()
        self.save()
        return self.data[key]

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(_json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def _batch(cfg: GPTConfig, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def _passes(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, repeats: int
) -> dict[str, float]:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    forward, backward = [], []
    for _ in range(repeats + 2):  # two warm-ups: cuBLAS handles, the allocator's pool
        model.zero_grad(set_to_none=False)
        synchronize(device)
        t0 = time.perf_counter()
        with autocast:
            loss = model(x, y)
        synchronize(device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(device)
        forward.append(t1 - t0)
        backward.append(time.perf_counter() - t1)
    return {"forward_s": statistics.median(forward[2:]), "backward_s": statistics.median(backward[2:])}


def _compressors(model: torch.nn.Module, backward_s: float, device: torch.device, repeats: int) -> dict[str, Any]:
    from powertrain.compress.auto import Link, choose

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == sum(1 for p in model.parameters() if p.requires_grad), "a backward pass first"
    dense = 4 * sum(g.numel() for g in grads)
    choice = choose(model.named_parameters(), backward_s=backward_s, link=Link(*AUTO_LINK))
    specs = dict(COMPRESSORS)
    specs["PowerSGD auto"] = (choice.name, {**choice.options, **(PSGD if choice.name == "powersgd" else {})})
    if device.type == "cuda":  # torch's default keeps fp32 matmuls exact; TF32 is a user's choice (one flag)
        specs["PowerSGD r32, TF32"] = COMPRESSORS["PowerSGD r32"]
        specs[HOUSEHOLDER] = COMPRESSORS["PowerSGD r32"]
        specs[TRITON] = COMPRESSORS["PowerSGD r32"]
    out: dict[str, Any] = {"auto_choice": choice.reason}
    for label, (name, options) in specs.items():
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = label.endswith("TF32")
        try:
            with _variant(label):
                out[label] = _time_compressor(model, grads, name, options, backward_s, dense, device, repeats)
        except Exception:
            out[label] = _error()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def _optimizer_steps(
    model: torch.nn.Module, passes: dict[str, float], device: torch.device, repeats: int
) -> dict[str, Any]:
    """Each optimizer's ``step()`` on the gradients of the last backward, at world size 1 (no work to split): seconds
    (median of ``repeats`` after 2 warm-ups, the parameters restored after) and the share of forward + backward +
    step. Muon's Newton-Schulz runs in bf16 on CUDA (float32 on the CPU: the dry run)."""
    from powertrain.optim import Dion, Muon

    builds = {
        "AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
        "Muon": lambda: Muon(model.named_parameters(), lr=0.02),
        "Dion rank 1/4": lambda: Dion(model.named_parameters(), lr=0.04, rank_fraction=0.25),
    }
    saved = [p.detach().clone() for p in model.parameters()]
    compute = passes["forward_s"] + passes["backward_s"]
    out: dict[str, Any] = {}
    for label, build in builds.items():
        try:
            opt = build()
            for _ in range(2):  # state, cuBLAS handles
                opt.step()
            seconds = _median_s(opt.step, device, repeats)
            out[label] = {"seconds": seconds, "of_step": seconds / (compute + seconds)}
        except Exception:
            out[label] = _error()
        finally:
            with torch.no_grad():
                for p, q in zip(model.parameters(), saved, strict=True):
                    p.copy_(q)
    return out


#: PowerSGD rank 32 with Householder QR on the device too (powertrain.ops.lowrank.householder_qr, the CPU's choice in
#: its orthonormalize): the A/B of the Cholesky QR that orthonormalize runs on CUDA.
HOUSEHOLDER = "PowerSGD r32, Householder QR"


#: PowerSGD rank 32 with its Triton kernel (powertrain.ops.lowrank_kernels, POWERTRAIN_FUSED=1): fewer passes over
#: the gradients, one launch a matrix; it runs by default once this row shows it faster than the one above.
TRITON = "PowerSGD r32, Triton kernels"


@contextlib.contextmanager
def _variant(label: str) -> Iterator[None]:
    """While the block runs: PowerSGD's orthonormalisation as torch.linalg.qr on every device (:data:`HOUSEHOLDER`),
    or its Triton kernel asked for (:data:`TRITON`); else nothing changes."""
    from powertrain.compress import powersgd
    from powertrain.ops.lowrank import householder_qr

    chosen, fused = powersgd.orthonormalize, os.environ.get("POWERTRAIN_FUSED")
    if label == HOUSEHOLDER:
        powersgd.orthonormalize = householder_qr
    elif label == TRITON:
        os.environ["POWERTRAIN_FUSED"] = "1"
    try:
        yield
    finally:
        powersgd.orthonormalize = chosen
        if fused is None:
            os.environ.pop("POWERTRAIN_FUSED", None)
        else:
            os.environ["POWERTRAIN_FUSED"] = fused


def _time_compressor(
    model: torch.nn.Module,
    grads: list[torch.Tensor],
    name: str,
    options: dict[str, Any],
    backward_s: float,
    dense: int,
    device: torch.device,
    repeats: int,
) -> dict[str, Any]:
    """One compressor's ``aggregate`` at world size 1: its median time, as a fraction of backward, and its bytes."""
    from powertrain.compress import make_compressor

    comp = make_compressor(name, model.named_parameters(), **options)
    for _ in range(2):  # error buffers and factors are allocated by the first calls
        comp.aggregate(grads)
    seconds = _median_s(lambda: comp.aggregate(grads), device, repeats)
    return {
        "compressor": name,
        "options": options,
        "seconds": seconds,
        "of_backward": seconds / backward_s,
        "bytes_per_step": _bytes(comp),
        "dense_bytes": dense,
    }


def _bytes(comp: Any) -> int:
    """What the compressor sends per step per rank (PowerSGD: its own count; int8 and bf16: their payload)."""
    if hasattr(comp, "bytes_per_step"):
        return int(comp.bytes_per_step(0))
    n = sum(p.numel() for p in comp.params)
    if type(comp).__name__ == "QuantizedCompressor":
        return n * comp.bits // 8 + 4 * -(-n // comp.chunk)
    return n * comp.dtype.itemsize


def _profile(model: torch.nn.Module, device: torch.device, label: str) -> str:
    """The top operations of the compressor ``label``'s compress + decompress (3 calls), by their own device time."""
    from torch.profiler import ProfilerActivity, profile

    from powertrain.compress import make_compressor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    name, options = COMPRESSORS[label]
    comp = make_compressor(name, model.named_parameters(), **options)
    comp.aggregate(grads)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            comp.aggregate(grads)
        synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=25))


def _memory(kind: str, cfg: GPTConfig, batch: int, device: torch.device) -> dict[str, Any]:
    """Peak memory of one AdamW training step with ``kind`` (a :data:`MEMORY` key), its step time and the memory
    held between steps (parameters, gradients, optimizer and compressor state)."""
    from powertrain.simple_fsdp import compile_model
    from powertrain.train.strategy import build_strategy

    parallel, name, options, compiled = MEMORY[kind]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    strategy = build_strategy(parallel, model, name, dict(options), compiled=compiled)  # type: ignore[arg-type]
    if compiled:
        strategy.model = compile_model(strategy.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = _batch(cfg, batch, device)
    return _train_step_memory(strategy, opt, x, y, device)


def _train_step_memory(
    strategy: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> dict[str, Any]:
    def step() -> None:
        with strategy.loss_scope(), torch.autocast(device.type, dtype=torch.bfloat16):
            loss = strategy.model(x, y)
        loss.backward()
        strategy.step(opt)

    t0 = time.perf_counter()
    step()  # the first step builds the optimizer's state (and compiles)
    synchronize(device)
    first_s = time.perf_counter() - t0
    step_s = _median_s(step, device, 3)
    out: dict[str, Any] = {"first_step_s": first_s, "step_s": step_s}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        out.update(held_gb=held / 1e9, peak_gb=torch.cuda.max_memory_allocated(device) / 1e9)
    else:
        from powertrain.bench.memory import peak_allocated

        out["step_peak_above_held_gb"] = peak_allocated(step) / 1e9
    return out


def _galore_state(cfg: GPTConfig, batch: int, device: torch.device) -> dict[str, Any]:
    """Optimizer state bytes of GaLoreAdamW (rank d_model / 4 on the blocks' and head's matrices, the command's
    choice for the default GPT) against AdamW's, after one step each; and GaLore's step peak."""
    from powertrain.optim import GaLoreAdamW

    out: dict[str, Any] = {"galore_rank": cfg.d_model // 4}
    for name in ("adamw", "galore"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        if name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            mats = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("tok.", "pos."))]
            rest = [p for p in model.parameters() if all(p is not m for m in mats)]
            opt = GaLoreAdamW([{"params": rest}, {"params": mats, "rank": cfg.d_model // 4}], lr=1e-4)
        from powertrain.train.strategy import build_strategy

        strategy = build_strategy("reference", model, "none", {})
        x, y = _batch(cfg, batch, device)
        step = _train_step_memory(strategy, opt, x, y, device)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in _tensors(s))
        out[name] = {"state_gb": state / 1e9, **step}
        del model, opt, strategy
        _free(device)
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    size: str,
    device: torch.device,
    path: Path,
    *,
    repeats: int = 10,
    memory: tuple[str, ...] = tuple(MEMORY),
    profile_above: float = TARGET,
) -> dict[str, Any]:
    """Every measurement of one size (module docstring; ``memory``: which :data:`MEMORY` ways to train;
    ``profile_above``: the share of backward past which a :data:`PROFILED` compressor is profiled), written to
    ``path`` as it goes."""
    cfg, batch = SIZES[size]
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device (set_device takes an index: torch 2.11 refuses "cuda")
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device.index)
    else:  # the dry run: one thread, as powertrain train's workers (spinning OpenMP threads on a shared CPU crawl)
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    joined = not dist.is_initialized()
    if joined:  # the strategies' world of one, left again at the end
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        head = {
            "size": size,
            "batch": batch,
            "block_size": cfg.block_size,
            "tokens": batch * cfg.block_size,
            "n_layer": cfg.n_layer,
            "d_model": cfg.d_model,
            "vocab": cfg.vocab_size,
        }
        rec = _Record(path, **head)
        _compute(rec, cfg, batch, device, repeats, profile_above)  # its model is gone when it returns
        _free(device)
        rec.item("galore", lambda: _galore_state(cfg, batch, device))
        for kind in memory:
            if MEMORY[kind][3] and device.type != "cuda":  # inductor on the CPU takes minutes here; the suite covers it
                rec.data[f"memory/{kind}"] = {"skipped": "compiled on CUDA only (test_simple_fsdp.py compiles on CPU)"}
                continue
            rec.item(f"memory/{kind}", lambda kind=kind: _memory(kind, cfg, batch, device))  # type: ignore[misc]
            _free(device)
        return rec.data
    finally:
        if joined:
            dist.destroy_process_group()


def _compute(
    rec: _Record, cfg: GPTConfig, batch: int, device: torch.device, repeats: int, profile_above: float
) -> None:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    rec.data["params"] = model.num_params()
    x, y = _batch(cfg, batch, device)
    passes = rec.item("passes", lambda: _passes(model, x, y, device, repeats))
    if "backward_s" not in passes:
        return
    rec.item("optimizers", lambda: _optimizer_steps(model, passes, device, repeats))
    comps = rec.item("compressors", lambda: _compressors(model, passes["backward_s"], device, repeats))
    for label, (key, _) in PROFILED.items():
        timed = comps.get(label, {}) if isinstance(comps, dict) else {}
        if timed.get("of_backward", 0) > profile_above:
            rec.item(key, lambda label=label: _profile(model, device, label))  # type: ignore[misc]


if __name__ == "__main__":
    size_, device_, json_ = sys.argv[1:4]
    measure(size_, torch.device(device_), Path(json_))
