"""Run a function on N real processes joined by a gloo process group, with a hard timeout.

``run_ranks(fn, world_size)`` spawns the ranks, each calls ``fn(rank, world_size, *args)`` and returns a
picklable-by-torch value (dicts/lists of tensors, numbers, strings), which comes back to the parent
through ``torch.save`` / ``torch.load(weights_only=True)``. If any rank fails, the others are killed at
once and the rank's traceback is raised in the parent; if the run exceeds ``timeout`` seconds, all ranks
are killed and the test fails: a hang never eats the CI budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import json
import os
import re
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    pass


def leave_without_teardown() -> NoReturn:
    """The end of a torchrun script's rank whose results are written: wait for every rank, flush, and exit without
    the interpreter's teardown (as ``powertrain train`` under torchrun and :func:`_entry` do). A gloo thread that
    frees a finished collective's tensor while the interpreter finalises takes the GIL and aborts the process
    (pytorch/pytorch#190489; backtrace: ProcessGroupGloo::runLoop -> decref_pyobject -> PyEval_AcquireThread ->
    pthread_exit): tests/lightning_fit.py aborted so in 2 runs of 22 ending with barrier + destroy_process_group, 1
    of 25 without either, none of 25 ending here."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, tmp: str, args: tuple, pg_timeout: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # bind to loopback only
    torch.set_num_threads(1)
    import torch.distributed as dist

    # A rank killed by a signal (an abort in C++, or the SIGABRT of a timeout) leaves no traceback of its own: each
    # thread's Python stack is written here, and run_ranks shows it
    fatal = open(f"{tmp}/fatal_{rank}.txt", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(fatal, all_threads=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # such a signal leaves no core file in the working directory

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, f"{tmp}/result_{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{tmp}/error_{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    # Skip interpreter finalisation: everything is saved, and gloo's background threads have been seen to
    # abort ("terminate called without an active exception") while the interpreter tears down.
    os._exit(0)


#: Ranks start from a fork server that has imported torch and the modules every test needs once (a fresh
#: interpreter per rank, as "spawn" gives, but ~2.5 s faster per 4-rank launch on 2 cores). The server holds no
#: threads and no process group; it inherits the environment pytest started with (no test changes it for ranks).
#: torch._dynamo: every torch optimizer imports it when the first one is built (its __init__ is dynamo-disabled).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "dist_utils",
    "models",
    "powertrain.compress",
    "powertrain.ddp",
    "powertrain.fsdp",
]


# faulthandler's list of loaded C extensions after a fatal signal's stacks: over 4 kB here (scipy, PIL...), so a test's
# tail of stderr showed only it when a worker aborted (CI, test_lightning); the lines above it are the story
EXTENSIONS = re.compile(r"^Extension modules: .*?\(total: \d+\)\n?", re.MULTILINE | re.DOTALL)


def _stacks(tmp: str, ranks: list[int]) -> str:
    """What faulthandler wrote for ``ranks`` (each thread's Python stack at a fatal signal), without its list of
    loaded extension modules."""
    out = []
    for r in ranks:
        with contextlib.suppress(OSError), open(f"{tmp}/fatal_{r}.txt") as f:
            text = EXTENSIONS.sub("", f.read()).strip()
            if text:
                out.append(f"\n--- rank {r}: Python stacks at the signal ---\n{text[-8000:]}")
    return "".join(out)


#: Seconds the ranks still running after a peer failed get to end by themselves before the runner stops them.
PEER_GRACE = 3.0


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, pg_timeout: float = 30.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="powertrain-test-") as tmp:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, tmp, args, pg_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        timed_out = False
        first: set[int] | None = None  # the ranks that had failed when the runner saw a failure (None: all, unknown)
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    first = {r for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                    # One rank failed. Its peers usually fail by themselves at once (gloo sees the reset connection)
                    # and write their own error, which a SIGABRT part-way through formatting it would lose (CI: a
                    # peer killed inside traceback.format_exc); one that still runs after the grace waits elsewhere.
                    grace = time.monotonic() + PEER_GRACE
                    while any(p.is_alive() for p in procs) and time.monotonic() < min(grace, deadline):
                        time.sleep(0.05)
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            # Ranks still running when the run ended badly (a timeout, or another rank failed): SIGABRT first, on which
            # faulthandler writes where each one waits, all at once (a rank may end by itself when a peer dies)
            stopped = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGABRT)
            for r in stopped:
                procs[r].join(5)
                procs[r].kill()  # a no-op for a process that has ended
            for p in procs:
                p.join(5)
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        # A rank that a signal killed, other than the runner, died on its own (an abort in C++): it comes first, as
        # the others' errors (a peer's reset connection) follow from it; unless it died after a peer had failed
        # (inside the grace), from that failure: then it comes after the tracebacks.
        signalled = [r for r, c in codes.items() if c is not None and c < 0 and r not in stopped]
        later = [r for r in signalled if first is not None and r not in first]
        causes = [r for r in signalled if r not in later]
        parts = []
        if causes:
            parts.append(f"ranks {causes} killed by a signal (exit codes {codes}), no traceback{_stacks(tmp, causes)}")
        for r in range(world_size):
            path = f"{tmp}/error_{r}.txt"
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read()
                if text:  # empty: killed by the runner while it wrote
                    parts.append(f"--- rank {r} ---\n{text}")
        if later:
            parts.append(
                f"ranks {later} killed by a signal after a peer failed (exit codes {codes}){_stacks(tmp, later)}"
            )
        if timed_out:
            parts.append(f"timed out after {timeout:.0f}s: ranks {stopped} hung{_stacks(tmp, stopped)}")
        elif stopped:
            parts.append(f"ranks {stopped} were still running when the run failed{_stacks(tmp, stopped)}")
        if not parts and any(c != 0 for c in codes.values()):
            parts.append(f"ranks exited with codes {codes}, no traceback")
        if parts:
            raise RankFailed("\n".join(parts))
        return [torch.load(f"{tmp}/result_{r}.pt", weights_only=True) for r in range(world_size)]


# ---------------------------------------------------------------- sub-case helpers shared by the test modules


@dataclasses.dataclass
class WorkerRecord:
    """What :func:`programs_finished_on_the_worker` saw: the threads that finished a call, and the threads that
    issued each collective."""

    finished: list[str] = dataclasses.field(default_factory=list)
    issued: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def programs_finished_on_the_worker() -> Iterator[WorkerRecord]:
    """Inside: every chained program (DDP's hook, DiLoCo's outer step) is finished on its chain's worker after its last
    (checked) collective, as NCCL on CUDA gets it (gloo's callbacks, on threads of their own, would not go there).
    Records which threads finished calls and which issued collectives (the worker must issue none)."""
    from powertrain.comm import Communicator
    from powertrain.compress import chain

    record = WorkerRecord()
    finish, hold = chain.Chain._finish, chain._read_would_hold
    reduce, gather = Communicator.all_reduce_, Communicator.all_gather

    def finished(self: Any, *args: Any) -> None:
        record.finished.append(threading.current_thread().name)
        finish(self, *args)

    def issued(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            record.issued.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    chain.Chain._finish, chain._read_would_hold = finished, lambda device, inline: True  # type: ignore[method-assign]
    Communicator.all_reduce_, Communicator.all_gather = issued(reduce), issued(gather)  # type: ignore[method-assign]
    try:
        yield record
    finally:
        chain.Chain._finish, chain._read_would_hold = finish, hold  # type: ignore[method-assign]
        Communicator.all_reduce_, Communicator.all_gather = reduce, gather  # type: ignore[method-assign]


def guard(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one sub-case inside a rank; a failure becomes ``{"error": traceback}`` so the others still run."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        return {"error": traceback.format_exc()}


def case(per_rank: list[dict[str, Any]], name: str) -> list[Any]:
    """Sub-case ``name`` from every rank's results; fails with the rank's traceback if it raised."""
    out = [r[name] for r in per_rank]
    for rank, r in enumerate(out):
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank} failed in {name}:\n{r['error']}"
    return out


def same_on_all_ranks(runs: list[dict[str, Any]], key: str = "params") -> None:
    """Bitwise: every rank runs the same operations (same shapes, one thread each) on the same inputs, since
    a collective hands every rank the same bits (gloo's ring all-reduce all-gathers the reduced chunks, and
    gathered messages are decoded in rank order everywhere); nothing here depends on the CPU's code path."""
    for r in runs[1:]:
        assert torch.equal(r[key], runs[0][key]), "ranks diverged"


# ---------------------------------------------------------------- derived tolerances

EPS32 = torch.finfo(torch.float32).eps  # 2**-23; the unit roundoff u is eps / 2
EPS64 = torch.finfo(torch.float64).eps  # 2**-52


def basis_errors(method: str, n: int, r: int, dtype: torch.dtype) -> tuple[float, float]:
    """Bounds on an orthonormalisation's output Q of an n x r input Y: (max |Q^T Q - I|, ||F||_F / ||Y||_F where Q
    is an exact orthonormal-up-to-the-first basis of Y + F), in absolute terms. Householder QR in ``dtype``: 2 sqrt(r)
    n r u and n r u (Higham, Thm 19.4). :func:`cholesky_qr`: its float64 passes end with two plain ones (CholQR2),
    whose departure from orthonormality is at most 6 (n r + r (r + 1)) u64 (Yamamoto et al., ETNA 44, 2015) once the
    shifted passes have made the condition number small, then the cast to ``dtype`` adds 2 u (each entry off by u,
    columns of norm 1); its span: the completion sqrt(r) u64, the two scalings 2 u64 and four triangular solves
    4 r^2 u64 (the function's docstring), and the cast moves the projector by 2 sqrt(r) u."""
    u, u64 = torch.finfo(dtype).eps / 2, EPS64 / 2
    if method == "householder":
        return 2 * r**0.5 * n * r * u, n * r * u
    return 6 * (n * r + r * (r + 1)) * u64 + 2 * u, 2 * r**0.5 * u + (r**0.5 + 2 + 4 * r * r) * u64


def within(err: torch.Tensor | float, bound: torch.Tensor | float, what: str) -> None:
    """Assert ``err <= bound`` (elementwise for tensors); the message names the worst element.

    Each bound is derived next to its call. With ``POWERTRAIN_TOLERANCE_LOG`` set to a file, the worst
    ``err / bound`` is appended there as a JSON line, to compare the margins of every CPU code path.
    """
    err_t = torch.as_tensor(err, dtype=torch.float64)
    bound_t = torch.as_tensor(bound, dtype=torch.float64).expand_as(err_t)
    ratio = torch.where(err_t == 0, 0.0, err_t / bound_t)  # inf where the bound is 0 and the error is not
    worst = int(ratio.argmax()) if ratio.numel() else 0
    e, b = (err_t.reshape(-1)[worst].item(), bound_t.reshape(-1)[worst].item()) if ratio.numel() else (0.0, 0.0)
    log = os.environ.get("POWERTRAIN_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a") as f:
            f.write(
                json.dumps({"test": test, "what": what, "err": e, "bound": b, "ratio": e / b if b else None}) + "\n"
            )
    assert not ratio.isnan().any() and (err_t <= bound_t).all(), f"{what}: error {e:.3e} > bound {b:.3e}"


def final_loss(runs: list[dict[str, Any]], last: int = 5) -> float:
    """Mean over ranks of the mean of the last ``last`` losses."""
    return sum(sum(r["losses"][-last:]) / last for r in runs) / len(runs)


def value_errors(attempts: dict[str, Callable[[], Any]]) -> dict[str, str]:
    """Run each attempt; its ValueError message, or "" when it did not raise (the test then fails on it)."""
    out = {}
    for name, fn in attempts.items():
        try:
            fn()
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    return out


def feedback_bound(
    x: torch.Tensor, e1: torch.Tensor, *, eps: float, iters: int = 0, rank: int = 0, matrix: bool = False
) -> torch.Tensor:
    """Elementwise bound on ``|mean_w(x_w) - (average + mean_w(e1_w))|``: error feedback's conservation, in
    floating point. ``x`` and ``e1`` are stacked over the ``W`` ranks (dim 0): each rank's input (gradient +
    old error) and new error. ``iters`` and ``rank`` describe PowerSGD's power iterations (0 for the other
    compressors); ``matrix`` says the tensor was compressed as a matrix by PowerSGD.

    Derivation, in roundings of size u = eps / 2: each rank's ``e1 = x - sent`` (1); PowerSGD's 2 * iters
    updates of (rank + 1)-term sums (residual and approximation) over terms <= |x| + (iters + 2) * ||x||_F
    (|P Q^T|_ij <= ||x||_F when P has orthonormal columns); the W-term sum over ranks (W - 1), and the test's
    two means over W and its final sum (2 (W - 1) + 1), over terms <= |x| + |e1|. Together
    u * (2 iters (rank + 1) + 3 W) * (|x| + |e1| + (iters + 2) ||x||_F); 2x safety makes it eps * (...).
    """
    world = x.shape[0]
    frob = x.flatten(1).norm(dim=1).max() if matrix else x.new_zeros(())
    scale = x.abs().amax(0) + e1.abs().amax(0) + (iters + 2) * frob
    return eps * (2 * iters * (rank + 1) + 3 * world) * scale
