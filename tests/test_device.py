"""The device leg: what only a GPU shows, and the multi-rank and command cases again on the device's tensors.

``POWERTRAIN_TEST_DEVICE=cuda pytest -m device`` (``make gpu-check``'s test leg) runs every test marked ``device``
on CUDA: the world-size-1 math of test_compressors_unit.py and test_powersgd_unit.py, and this module:

* CUDA against the CPU: the same gradients through the compressors on both (CUDA only);
* no host synchronisation in the compressors' and optimizers' hot paths but the documented flag reads
  (:mod:`powertrain.ops.finite`; CUDA only);
* DDP on 2 gloo ranks whose tensors live on the device (gloo all-reduces and all-gathers CUDA tensors through
  host copies; NCCL refuses two ranks on one GPU);
* every ``--parallel`` mode of ``powertrain train`` at world size 1, on NCCL with CUDA (gloo on the CPU);
* a run's checkpoint saved on the GPU, resumed on the CPU and back on the GPU (CUDA only).

Without POWERTRAIN_TEST_DEVICE the CPU suite already covers what the multi-rank and command cases would repeat on
the CPU (test_ddp.py, test_cli.py, test_train_checkpoint.py), so they skip; POWERTRAIN_TEST_DEVICE=cpu runs them on
the CPU (``make gpu-check DEVICE=cpu``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from cli_utils import run_cli
from conftest import DEVICE_ENV
from dist_utils import EPS64, basis_errors, case, guard, run_ranks, within
from models import batch, loss_fn, make_model
from powertrain.compress import make_compressor
from powertrain.compress.base import GatherRequest, Program

pytestmark = pytest.mark.device


def _cuda_only(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip(f"needs CUDA: {DEVICE_ENV}=cuda")


def _asked_for(device: torch.device) -> None:
    """Cases the CPU suite covers on the CPU run only when a device was asked for explicitly."""
    if DEVICE_ENV not in os.environ:
        pytest.skip(f"on the CPU the suite's own tests cover this; {DEVICE_ENV}=cpu or cuda runs it")


def _drive(program: Program, comm: Any) -> tuple[list[torch.Tensor], int]:
    """Run ``program`` at world size 1 as :func:`powertrain.compress.base.run_program` does; also return how many
    collectives it issued."""
    n, result = 0, None
    try:
        request = next(program)
        while True:
            n += 1
            result = comm.all_gather(request.tensor)[0] if isinstance(request, GatherRequest) else None
            request = program.send(result)
    except StopIteration as stop:
        return stop.value, n


# ---------------------------------------------------------------- CUDA against the CPU


def _grads(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    loss_fn(model, *(t.to(device) for t in batch(0, step, dtype))).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def test_cuda_gives_the_cpus_results(device):
    """The same gradients and state through each compressor on the CPU and on CUDA.

    Bitwise where every operation is correctly rounded on both (casts, exact max and top-k selection, a sum over
    one rank): fp32/bf16 all-reduce and top-k. int8 with nearest rounding, one step: CUDA divides by a Python
    number as a product with its reciprocal (one more rounding than the CPU's division), so a chunk's scale may
    differ in its last bit and a code at a rounding boundary by one: each output within one quantisation step of
    the other, the largest step of its parameter being max|g| / 127 (2x safety for the scales' own rounding). PowerSGD
    (paper variant, float64, one step from the same initial Q, identical on both: drawn on the CPU) within a bound:
    each device computes Y = M Q with |dY| <= m u |M| |Q| and an orthonormal basis of Y + F (the CPU by Householder
    QR, CUDA by a Cholesky QR: ||F||_F and the departure from orthonormality as dist_utils.basis_errors bounds them),
    so its projector is within d = (m u ||M||_F ||Q||_F + ||F||_F) / sigma_r(Y) of the exact one (Wedin); the
    approximation P P^T M differs between the devices by <= (d_cpu + d_cuda) ||M||_F, plus each device's two products'
    roundings (2 (n + r) u) and P's departure from orthonormality (r times its entrywise bound), relative to
    ||M||_F; u = eps64 / 2, 2x safety.
    A zero gradient (the model's unused layer; the bound would be 0 / 0) must give exactly equal outputs."""
    _cuda_only(device)
    cases = [("none", {}), ("bf16", {}), ("topk", {"ratio": 0.1})]
    model = make_model()
    cpu = make_compressor("int8", model.named_parameters(), stochastic=False)
    gpu = make_compressor("int8", list(make_model().to(device).named_parameters()), stochastic=False)
    g = _grads(model, torch.device("cpu"), torch.float32, 0)
    for a, b, x, pname in zip(cpu.aggregate(g), gpu.aggregate([t.to(device) for t in g]), g, cpu.names, strict=True):
        within((a - b.cpu()).abs(), 2 * x.abs().max() / 127, f"int8 {pname}")
    for name, opts in cases:
        cpu = make_compressor(name, model.named_parameters(), **opts)
        gpu = make_compressor(name, list(make_model().to(device).named_parameters()), **opts)
        for step in range(3):
            g = _grads(model, torch.device("cpu"), torch.float32, step)
            ours, theirs = cpu.aggregate(g), gpu.aggregate([t.to(device) for t in g])
            for a, b, pname in zip(ours, theirs, cpu.names, strict=True):
                assert torch.equal(a, b.cpu()), f"{name} step {step}: {pname} differs between the CPU and CUDA"
    model64 = make_model(torch.float64)
    opts = {
        "rank": 2,
        "variant": "paper",
        "factor_dtype": "fp32",
        "start_compressing_after_num_steps": 0,
        "min_compression_rate": 0,
    }
    cpu = make_compressor("powersgd", model64.named_parameters(), **opts)
    gpu = make_compressor("powersgd", list(make_model(torch.float64).to(device).named_parameters()), **opts)
    q0 = cpu.state_dict()["q"]
    g = _grads(model64, torch.device("cpu"), torch.float64, 0)
    ours, theirs = cpu.aggregate(g), gpu.aggregate([t.to(device) for t in g])
    u = EPS64 / 2
    for a, b, m, q, pname in zip(ours, theirs, g, q0, cpu.names, strict=True):
        if q is None:  # sent exactly: a cast and a division by 1
            assert torch.equal(a, b.cpu()), pname
            continue
        mat = m.reshape(m.shape[0], -1)
        if not mat.any():  # an unused layer's zero gradient: Y = 0 has no basis to perturb, both send exact zeros
            within((a - b.cpu()).norm(), 0.0, f"PowerSGD {pname} (a zero gradient)")
            continue
        n, cols, r = mat.shape[0], mat.shape[1], q.shape[1]
        y = mat @ q
        errors = [basis_errors(method, n, r, torch.float64) for method in ("householder", "cholesky")]
        d = sum(
            (cols * u * mat.norm() * q.norm() + span * y.norm()) / torch.linalg.svdvals(y)[r - 1] for _, span in errors
        )
        bound = 2 * (d + sum(2 * (n + r) * u + r * orth for orth, _ in errors)) * mat.norm()
        assert torch.isfinite(bound), f"PowerSGD {pname}: Y = M Q has rank < {r}, the bound is {bound}"
        within((a - b.cpu()).norm(), bound, f"PowerSGD {pname}")


# ---------------------------------------------------------------- host synchronisation


TORCH_DIR = Path(torch.__file__).resolve().parent
#: The warnings machinery's own frames (Python 3.14 moved it to _py_warnings).
WARNINGS_FILES = {Path(m.__file__).resolve() for m in (warnings, sys.modules.get("_py_warnings")) if m and m.__file__}


def _site(frame: FrameType | None, skip: tuple[Path, ...]) -> str:
    """``path:line`` of the innermost frame outside the ``skip`` directories and the warnings machinery: the project's
    (or a test's) line that led to the synchronisation, also when the warning was raised inside torch's own Python."""
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path not in WARNINGS_FILES and not any(path.is_relative_to(d) for d in skip):
            return f"{path.as_posix()}:{frame.f_lineno}"
        frame = frame.f_back
    return "no frame outside torch"


def _sync_sites(fn: Callable[[], object], skip: tuple[Path, ...] = (TORCH_DIR,)) -> list[str]:
    """``path:line`` of every synchronising CUDA operation ``fn`` makes (sync-debug mode "warn": each one warns), each
    at the first frame outside torch (:func:`_site`). Only warnings raised while ``fn`` runs count: switching the mode
    on warns by itself in torch 2.11 ("a prototype feature and does not yet detect all synchronizing operations",
    raised inside torch/cuda/__init__.py)."""
    sites: list[str] = []
    running = False

    def record(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if running and "synchronizing" in str(message):
            sites.append(_site(sys._getframe(1), skip))

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # called while the warning is raised: its stack is the caller's
        set_mode = torch.cuda.set_sync_debug_mode if torch.cuda.is_available() else lambda mode: None
        set_mode("warn")
        try:
            running = True
            fn()
        finally:
            running = False
            set_mode("default")
    return sites


def test_sync_sites_names_the_first_frame_outside_torch(tmp_path):
    """The harness on any device: a "synchronizing" warning raised inside a stand-in for torch's Python is reported at
    the line here that called it, one raised here at its own line, other warnings not at all."""
    import importlib.util

    (tmp_path / "inner.py").write_text(
        "import warnings\n\ndef sync():\n    warnings.warn('called a synchronizing "
        "CUDA operation')\n    warnings.warn('something else')\n"
    )
    spec = importlib.util.spec_from_file_location("inner", tmp_path / "inner.py")
    assert spec is not None and spec.loader is not None
    inner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inner)
    here = Path(__file__).resolve().as_posix()
    skip = (tmp_path, TORCH_DIR)
    line = sys._getframe().f_lineno + 1
    sites = _sync_sites(lambda: (inner.sync(), warnings.warn("a synchronizing one", stacklevel=1)), skip=skip)
    assert sites == [f"{here}:{line}", f"{here}:{line}"]
    assert _sync_sites(inner.sync, skip=()) == [f"{(tmp_path / 'inner.py').resolve().as_posix()}:4"]


FLAG_READS = "powertrain/ops/finite.py"  # read_flag: the documented reads (one per collective at most)
SYNC_CASES = [
    ("none", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int4", {"chunk": 64}),
    ("topk", {"ratio": 0.05}),
    ("randk", {"ratio": 0.05}),
    ("sign", {}),
    ("powersgd", {"rank": 4, "start_compressing_after_num_steps": 0}),  # recommended: paper, bf16 factors
    (
        "powersgd",
        {"rank": 4, "variant": "alternating", "num_iters_per_step": 2, "start_compressing_after_num_steps": 0},
    ),
]


def test_no_host_sync_in_hot_paths(device):
    """Under ``torch.cuda.set_sync_debug_mode``: a compressor's call reads at most one flag per collective (PowerSGD
    one a call), all in :func:`powertrain.ops.finite.read_flag` (whether to raise NonFiniteGradientError: every rank
    must decide before committing); an optimizer's step (not a refresh step of Shampoo's roots or GaLore's subspace,
    whose eigh / SVD check their results on the host) makes none, except DeMo's one layout check per step (its
    comment says why)."""
    _cuda_only(device)
    # the harness itself: an .item() is one synchronisation, reported at its line here; "error" mode raises
    line = sys._getframe().f_lineno + 1
    assert _sync_sites(lambda: torch.ones(1, device=device).item()) == [f"{Path(__file__).resolve().as_posix()}:{line}"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            torch.ones(1, device=device).item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    from powertrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(64, 16, 2, 2, 32)).to(device)
    grads = [torch.randn_like(p) for p in model.parameters()]
    failures = []
    for name, opts in SYNC_CASES:
        comp = make_compressor(name, model.named_parameters(), **opts)
        for _ in range(2):  # warm-up: error buffers, factors, caches
            _drive(comp.program(grads), comp.comm)
        counts: list[int] = []
        sites = _sync_sites(lambda comp=comp, counts=counts: counts.append(_drive(comp.program(grads), comp.comm)[1]))
        stray = [s for s in sites if FLAG_READS not in s]
        allowed = 1 if name == "powersgd" else counts[0]  # its earlier collectives' flags stay on the device
        if stray or len(sites) > allowed:
            failures.append(
                f"{name} {opts}: {len(sites)} syncs for {counts[0]} collectives ({allowed} allowed), "
                f"not in read_flag: {stray}"
            )
    for name, build, allowed in _optimizers():
        model.zero_grad()
        opt = build(model)
        for _ in range(3):  # warm-up: state, caches, the first refresh
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
            opt.step()
        sites = _sync_sites(opt.step)
        stray = [s for s in sites if FLAG_READS not in s]
        if stray or len(sites) > allowed:
            failures.append(f"{name}: {len(sites)} syncs in a step ({allowed} allowed), not in read_flag: {stray}")
    assert not failures, "\n".join(failures)


def test_a_chained_call_leaves_the_issuing_thread_free(device):
    """NCCL completes a collective's future as soon as it is queued, so a chained program (DDP's hook, DiLoCo's outer
    step) runs in the thread that issued it up to its checked collective, whose host read goes to the chain's worker
    (:mod:`powertrain.compress.chain`). With about a second of GPU work queued ahead, each compressor's chained call
    (world size 1: its futures complete at once, as NCCL's) returns while the GPU still runs that work: the issuing
    thread waited for nothing. Its result equals a synchronous call's on a twin compressor up to rounding (the worker
    thread has its own cuBLAS handle, which may pick another kernel: fp32's default tolerance)."""
    _cuda_only(device)
    from powertrain.compress.chain import Chain, Sequencer
    from powertrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(64, 16, 2, 2, 32)).to(device)
    grads = [torch.randn_like(p) for p in model.parameters()]

    def chained(comp: Any) -> torch.futures.Future:
        chains: list[Chain] = []
        seq = Sequencer([comp.comm] * comp.max_collectives_per_call())
        chains.append(
            Chain(comp.program(grads), seq, 0, lambda out: chains[0].future.set_result(out), lambda e: None, device)
        )
        return chains[0].start()

    held = []
    for name, opts in SYNC_CASES:
        sync, chain = (make_compressor(name, model.named_parameters(), **opts) for _ in range(2))
        for _ in range(2):  # warm-up: state, caches, the allocator's blocks
            sync.aggregate(grads)
            chained(chain).wait()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s at the H100's clock
        fut = chained(chain)
        if torch.cuda.current_stream().query():
            held.append(f"{name} {opts}")
        for got, want in zip(fut.wait(), sync.aggregate(grads), strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
    assert not held, f"these calls waited for the GPU in the issuing thread: {held}"


def test_a_deferred_call_in_backward_waits_for_nothing(device):
    """FSDP2's and SimpleFSDP's compressed reduce-scatter runs its program inside backward, synchronously, on the
    caller's stream (:mod:`powertrain.compress.deferred`). With about a second of GPU work queued ahead, each
    compressor FSDP2 takes returns from such a call, inside a backward, while the GPU still runs that work, with no
    synchronising operation; the one flag read happens at the end of backward, where a NaN input then raises."""
    _cuda_only(device)
    from powertrain.compress import NonFiniteGradientError
    from powertrain.compress.deferred import run_deferred
    from powertrain.models import GPT, GPTConfig
    from test_deferred import in_backward

    torch.manual_seed(0)
    model = GPT(GPTConfig(64, 16, 2, 2, 32)).to(device)
    grads = [torch.randn_like(p) for p in model.parameters()]
    seen: dict[str, Any] = {}

    def work() -> None:
        torch.cuda._sleep(2_000_000_000)  # ~1 s at the H100's clock
        seen["sites"] = _sync_sites(lambda: run_deferred(seen["comp"], seen["grads"]))
        seen["busy"] = not torch.cuda.current_stream().query()

    reduce = in_backward(work)

    failures = []
    for name, opts in [c for c in SYNC_CASES if c[0] in ("none", "bf16", "int8", "int4", "powersgd")]:
        seen["comp"] = comp = make_compressor(name, model.named_parameters(), **opts)
        for _ in range(2):  # warm-up: state, caches, the allocator's blocks
            comp.aggregate(grads)
        for bad in (False, True):
            seen["grads"] = [g * float("nan") for g in grads] if bad else grads
            x = torch.ones(1, device=device, requires_grad=True)
            try:
                reduce(x).sum().backward()
                raised = False
            except NonFiniteGradientError:
                raised = True
            if seen["sites"] or not seen["busy"] or raised != bad:
                got = f"syncs {seen['sites']}, busy {seen['busy']}, raised {raised}"
                failures.append(f"{name} {opts} (NaN: {bad}): {got}")
    assert not failures, "\n".join(failures)


def test_fused_quantisation_on_cuda_matches_eager(device, monkeypatch):
    """The fused rounding kernel (Triton, :mod:`powertrain.ops.fused`) against eager CUDA: the same scales; codes equal
    except where ``noise + x / scale`` lies within 4 float32 ulps of a rounding boundary (Triton's division may be
    off by 2 ulps, the add by half of one, against eager's correctly rounded ones), and there off by one."""
    _cuda_only(device)
    from powertrain.ops import fused
    from powertrain.ops import quantize as q

    torch.manual_seed(0)
    n, chunk = 1 << 20, 1024
    x = (torch.randn(n) * torch.logspace(-3, 3, n)).to(device)
    for bits in (8, 4):
        for noise in (None, torch.rand(n, device=device)):
            monkeypatch.setenv("POWERTRAIN_FUSED", "0")
            want, scales = q.quantize(x, bits, chunk, noise)
            monkeypatch.setenv("POWERTRAIN_FUSED", "1")
            got, got_scales = q.quantize(x, bits, chunk, noise)
            assert torch.equal(scales, got_scales)
            differ = got != want
            y = (x.double().view(-1, chunk) / torch.where(scales > 0, scales, 1.0).double()[:, None]).view(-1)
            y = y + (noise.double() if noise is not None else 0.0)
            boundary = y.floor() if noise is not None else (y - 0.5).floor() + 0.5  # floor's and round's edges
            near = torch.minimum((y - boundary).abs(), (y - boundary - 1).abs()) <= 4 * 2**-23 * y.abs().clamp(min=1)
            assert bool(((got.int() - want.int()).abs() <= 1).all()) and bool(near[differ].all()), (bits, noise is None)
    assert "rounded_codes" in fused._COMPILED and not fused._FAILED, fused._FAILED


def test_lowrank_kernels_on_cuda_match_eager(device, monkeypatch):
    """PowerSGD's Triton kernel (:mod:`powertrain.ops.lowrank_kernels`) compiled for the GPU against its eager twin
    there (tolerances derived in tests/lowrank_kernels_cases.py, which runs the same cases interpreted on the CPU): the
    sum and its extremes bitwise without kept factors (one IEEE float32 addition an entry); with them within
    ``2 gamma_{r+1} (|e| + |P| |Q|^T)`` plus one rounding of each; the product within the sums' difference times
    ``|Q|`` plus ``gamma_m`` of each (the kernel multiplies in exact float32, no TF32); the 124m GPT's matrix sizes and
    sizes off the blocks."""
    _cuda_only(device)
    from powertrain.ops import lowrank_kernels as K

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("POWERTRAIN_FUSED", "1")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    K._kernels.cache_clear()
    u = 2.0**-24
    gamma = lambda k: k * u / (1 - k * u)
    torch.manual_seed(0)
    for n, m, r in ((768, 3072, 32), (3072, 768, 32), (70, 130, 4), (17, 200, 33)):
        g, e, q = (torch.randn(n, m, device=device), torch.randn(n, m, device=device), torch.randn(m, r, device=device))
        kept = (torch.randn(n, r, device=device), torch.randn(m, r, device=device))
        for k in (None, kept):
            want_m, got_m = torch.empty_like(g), torch.empty_like(g)
            want_p, got_p = g.new_empty(n, r), g.new_empty(n, r)
            want_x = K.sum_project_eager(want_m, g, e, k, q, want_p)
            got_x = K.sum_project(got_m, g, e, k, q, got_p)
            assert torch.equal(got_x, torch.stack(torch.aminmax(got_m))), (n, m, r)
            if k is None:
                assert torch.equal(got_m, want_m) and torch.equal(got_x, want_x), (n, m, r)
            else:
                sums = 2 * gamma(r + 1) * (e.abs() + k[0].abs() @ k[1].abs().T) + u * (got_m.abs() + want_m.abs())
                assert bool(((got_m - want_m).abs() <= sums).all()), (n, m, r)
            bound = (got_m - want_m).abs() @ q.abs() + gamma(m) * ((got_m.abs() + want_m.abs()) @ q.abs())
            assert bool(((got_p - want_p).abs() <= bound).all()), (n, m, r, k is None)
    assert not K._FAILED, K._FAILED


@pytest.mark.parametrize("tf32", [False, True])
def test_powersgd_paper_feedback_loses_only_roundings(device, monkeypatch, tf32):
    """The paper variant sends P Q^T and, a step later, subtracts P Q^T recomputed from the kept M (another kernel):
    what it sent over 20 steps plus what it still owes must equal the gradients up to the roundings of those
    residuals and sums. Each residual M - P Q^T is a sum of r + 1 terms, within gamma_{r+1} (|M| + |P| |Q|^T) of the
    exact one in any order, as sent and as subtracted; each new M one rounding (u |M|). With TF32 on (CUDA) both
    products take TF32-rounded P and Q and stay inside that bound only if both kernels round them the same way: a
    kernel that did not would lose about 2^-11 of the approximation a step, which no later step feeds back."""
    if tf32:
        _cuda_only(device)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    from powertrain.compress import PowerSGDCompressor
    from powertrain.compress.powersgd import Config

    r, u = 8, 2.0**-24
    gamma = (r + 1) * u / (1 - (r + 1) * u)
    param = torch.nn.Parameter(torch.zeros(512, 384, device=device))
    comp = PowerSGDCompressor([param], config=Config(rank=r, variant="paper", start_compressing_after_num_steps=0))
    gen = torch.Generator().manual_seed(0)
    sent = torch.zeros(512, 384, dtype=torch.float64, device=device)
    given, bound = sent.clone(), sent.clone()
    for _ in range(20):
        g = torch.randn(512, 384, generator=gen).to(device)
        (out,) = comp.aggregate([g])
        given += g.double()
        sent += out.double()
        state = comp.state_dict()
        m, pq = state["m"][0].double(), state["p"][0].abs().double() @ state["q"][0].abs().double().T
        bound += 2 * gamma * (m.abs() + pq) + u * m.abs()
    lost = (given - sent - comp.residuals()[0].double()).abs()
    assert bool((lost <= bound).all()), float((lost - bound).max())


def _optimizers() -> list[tuple[str, Callable[[torch.nn.Module], torch.optim.Optimizer], int]]:
    from powertrain.optim import DeMo, Dion, DistributedShampoo, FrozenVarianceAdamW, GaLoreAdamW, Muon

    matrices = lambda m: [p for p in m.parameters() if p.ndim == 2]
    others = lambda m: [p for p in m.parameters() if p.ndim != 2]
    galore = lambda m: GaLoreAdamW([{"params": others(m)}, {"params": matrices(m), "rank": 4}], update_proj_gap=100)
    shampoo = lambda m: DistributedShampoo(m.parameters(), precondition_frequency=100, start_preconditioning_step=1)
    return [
        ("FrozenVarianceAdamW", lambda m: FrozenVarianceAdamW(m.parameters(), freeze_after=2), 0),
        ("GaLoreAdamW", galore, 0),
        ("DistributedShampoo", shampoo, 0),
        ("DeMo", lambda m: DeMo(m.parameters()), 1),
        ("Muon", lambda m: Muon(m.named_parameters()), 1),  # bfloat16 Newton-Schulz; its finiteness flag's one read
        ("Dion", lambda m: Dion(m.named_parameters(), rank_fraction=0.25), 1),  # its program's one flag read
    ]


# ---------------------------------------------------------------- DDP on two gloo ranks, tensors on the device


def _ddp_on_device(rank: int, world: int, device: str) -> dict[str, Any]:
    from test_ddp import CASES, _conservation, _train

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU: gloo copies through the host
        torch.backends.cudnn.allow_tf32 = False
    out: dict[str, Any] = {"plain": guard(_train, rank, None, {}, device=device)}
    for name in ("none", "powersgd", "powersgd_paper_k2", "int8"):
        out[f"train/{name}"] = guard(_train, rank, *CASES[name], device=device)
    for name in ("powersgd_paper_k2", "int8"):
        out[f"conserve/{name}"] = guard(_conservation, rank, *CASES[name], device=device)
    return out


def test_ddp_hook_on_device_tensors(device):
    """DDP with powertrain's hook on 2 gloo ranks, model and gradients on the device: lossless is plain DDP bitwise
    (test_ddp's argument holds: gloo sums the same host copies), PowerSGD (the hook's chained programs) and int8
    (an all-gather) conserve what they owe and learn as on the CPU (test_ddp's bounds)."""
    _asked_for(device)
    from test_ddp import CASES, LOSS_GAP, check_conservation

    runs = run_ranks(_ddp_on_device, 2, device.type, timeout=150)
    for a, b in zip(case(runs, "plain"), case(runs, "train/none"), strict=True):
        assert torch.equal(a["params"], b["params"]), "the lossless hook differs from plain DDP"
    exact = sum(sum(r["losses"][-5:]) / 5 for r in case(runs, "train/none")) / 2
    for name in ("powersgd", "powersgd_paper_k2", "int8"):
        trained = case(runs, f"train/{name}")
        assert torch.equal(trained[0]["params"], trained[1]["params"]), f"{name}: ranks diverged"
        first = sum(r["losses"][0] for r in trained) / 2
        got = sum(sum(r["losses"][-5:]) / 5 for r in trained) / 2
        within((got - exact) / first, LOSS_GAP[name], f"{name}: final loss {got:.5f} vs exact {exact:.5f}")
    for name in ("powersgd_paper_k2", "int8"):
        check_conservation([r["records"] for r in case(runs, f"conserve/{name}")], 2, *CASES[name])


# ---------------------------------------------------------------- the command, world size 1


def test_every_parallel_mode_trains_at_world_size_1(device, tmp_path):
    """Each ``--parallel`` mode (and the DDP hook's gather program, and SimpleFSDP compiled) trains 4 steps of the
    tiny preset with one worker: NCCL on CUDA, gloo on the CPU. Every loss is finite, the run says where it ran (the
    reference mode, without a process group, too) and that it sent nothing."""
    _asked_for(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    tests = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)}
    r = run_cli(backend, str(tmp_path), module="device_modes", env=env, timeout=170)
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    failed = {mode: res.get("error") or res for mode, res in results.items() if res.get("code") != 0}
    assert not failed, "\n".join(f"--- {mode}\n{why}" for mode, why in failed.items())
    for mode, res in results.items():
        assert len(res["losses"]) == 4 and all(math.isfinite(x) for x in res["losses"]), (mode, res["losses"])
        assert res["summary"]["device"].startswith(device.type), (mode, res["summary"]["device"])
        assert res["summary"]["bytes_sent"] == 0, (mode, "one worker sends nothing", res["summary"]["bytes_sent"])


def test_checkpoint_from_the_gpu_resumes_on_the_cpu_and_back(device, tmp_path):
    """A DDP + PowerSGD run checkpoints on the GPU (NCCL), continues on the CPU (gloo) from it, and back on the GPU:
    the model, AdamW and the compressor's error feedback and factors cross devices in both directions."""
    _cuda_only(device)
    out = tmp_path / "run"
    common = [
        "train",
        "--preset",
        "tiny",
        "--nproc",
        "1",
        "--parallel",
        "ddp",
        "--checkpoint-every",
        "2",
        "--quiet",
        "--out",
        str(out),
    ]
    for steps, backend in ((4, "nccl"), (6, "gloo"), (8, "nccl")):
        resume = ["--resume", str(out)] if steps > 4 else []
        r = run_cli(*common, "--steps", str(steps), "--backend", backend, *resume, timeout=180)
        assert r.returncode == 0, f"{backend} to step {steps}: {r.stderr[-3000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 9)) and all(math.isfinite(row["loss"]) for row in rows)
