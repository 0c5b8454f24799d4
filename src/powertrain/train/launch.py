"""Start N local workers bound to loopback, or run in place under ``torchrun``.

The single-node launcher is small on purpose; what it guarantees:

* Every socket it opens listens on 127.0.0.1: the rendezvous store is a ``TCPStore`` served from a socket this
  process binds to loopback (torch's store and its elastic agent listen on all interfaces whatever host name
  the clients use), the workers join it as clients (``TORCHELASTIC_USE_AGENT_STORE``), and gloo binds to ``lo``
  unless ``GLOO_SOCKET_IFNAME`` is set.
* A worker that fails or dies stops the others within seconds (SIGTERM, then SIGKILL after ``grace_s``), and
  the failure reaches the caller as :class:`WorkerFailed` carrying the worker's own one-line cause (its
  exception's type and message, uncut; or the signal that killed it); a traceback goes to a file or stderr.
* Ctrl-C, SIGTERM or SIGHUP stops every worker and raises :class:`Interrupted`, without a traceback from each
  worker; if the launcher itself dies (SIGKILL), its workers are killed too (``PR_SET_PDEATHSIG``).
* Workers are forked from a fork server (``multiprocessing``'s ``forkserver``) that imported torch once: each is a
  fresh interpreter's state as with ``spawn`` (no threads, no CUDA context, no process group inherited), without
  importing torch and ``torch._dynamo`` again per worker (seconds of CPU each, which a short run or a test
  pays per launch); the server starts at the first launch and serves every later one of the process. The workers see the
  launcher's environment as it is when they start; what torch and the C libraries read from it when they load
  (``OMP_NUM_THREADS``, ``LD_PRELOAD``) and the stdout and stderr they write to are the server's, the process's
  at its first launch.
* A worker that returned exits without interpreter finalisation, which can race torch's background threads
  for the GIL and hang (pytorch/pytorch#75097): its result is written and its output flushed by then.
* Worker functions end their collectives with :func:`leave_world`, which never destroys a group that has peers
  (why: its docstring).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import errno
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Interrupted", "WorkerFailed", "disk_full", "launch", "leave_world", "under_torchrun"]

T = TypeVar("T")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_shared_store() -> Literal["one node", "nodes"] | None:
    """Where torchrun hands its workers its own rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``), which torch 2.x
    keeps across restarts without separating the attempts (pytorch/pytorch#135712): on ``"one node"`` (every worker
    has the same restart count) or across ``"nodes"`` (each agent counts its own); None when it does not."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return "one node" if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE") else "nodes"


def leave_world() -> None:
    """A worker's last distributed call: wait for every rank, then leave the default process group in place.

    Destroying a gloo group (``destroy_process_group``, or freeing the last object that holds it, such as DDP's
    reducer) joins the group's threads while this thread holds the GIL. A group thread that is still freeing a
    finished collective's work needs the GIL to release its tensors' Python objects: the two wait for each other
    forever. Seen here once in 57 two-worker ``powertrain train`` runs on ATen's scalar kernels (stack:
    ``~ProcessGroupGloo`` -> ``thread::join`` against ``~AsyncBarrierWork`` -> ``gil_scoped_acquire``). So a group
    with peers is never destroyed: the launcher's workers and ``powertrain`` under torchrun end with
    ``os._exit``, which runs no destructor. A world of one in this process (no launcher) is destroyed, so that a
    caller can start another run; its last collective has returned by then.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()  # no rank leaves while a peer may still need it
        return
    dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class Failure:
    rank: int
    pid: int
    cause: str  # "ValueError: ...", or "killed by SIGKILL", or "exit code 3"


class WorkerFailed(RuntimeError):
    """One or more workers failed; ``failures`` in the order they were seen (the first is the likely cause)."""

    def __init__(self, failures: list[Failure]) -> None:
        self.failures = failures
        super().__init__(self.describe())

    def describe(self) -> str:
        groups: dict[str, list[Failure]] = {}
        for f in self.failures:
            groups.setdefault(f.cause.rstrip(". "), []).append(f)
        parts = []
        for cause, fs in groups.items():
            who = (
                f"worker rank {fs[0].rank} (pid {fs[0].pid})"
                if len(fs) == 1
                else "worker ranks " + ", ".join(str(f.rank) for f in fs)
            )
            parts.append(f"{who} failed: {cause}")
        return "; ".join(parts) + ". The other workers were stopped."


class Interrupted(KeyboardInterrupt):
    """The launcher was interrupted (Ctrl-C or SIGTERM) and stopped its workers."""

    def __init__(self, signal_name: str) -> None:
        self.signal_name = signal_name
        super().__init__(signal_name)


def _cause(e: BaseException) -> str:
    """An exception as one line: its type and message (multi-line messages joined); for DCP's CheckpointException,
    which gathers every rank's traceback into its message, each rank's own exception instead."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        causes: dict[str, list[str]] = {}
        for rank, f in sorted(failures.items()):
            inner = f[0] if isinstance(f, tuple) and f and isinstance(f[0], BaseException) else None
            causes.setdefault(_cause(inner) if inner is not None else "unknown", []).append(str(rank))
        return f"{type(e).__name__}: " + "; ".join(f"rank {', '.join(r)}: {c}" for c, r in causes.items())
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


#: Below this much free space where a run writes, a failure to write is taken for a full disk: writers that meet
#: ENOSPC do not all say so (torch.save reports a short write as "unexpected pos").
NEARLY_FULL = 1 << 20


def run_command(prog: str, call: Callable[[], int], where: str) -> int:
    """``call()``, a command's body, with its expected failures in one line: a ValueError (status 2, as argparse's
    own errors), an interrupt before any worker started (130; the workers' are the launcher's), a full disk, also
    while writing under ``where`` (1). Anything else keeps its traceback."""
    try:
        return call()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:
        full = disk_full(e, where)
        if full is None:
            raise
        print(f"{prog}: {full}", file=sys.stderr)
        return 1


def disk_full(e: BaseException, where: str) -> str | None:
    """One line when ``e`` comes from a full disk: ENOSPC among its causes (its ``__cause__``/``__context__`` chain,
    and the failures DCP gathers from every rank), or an error other than a ValueError or FloatingPointError (which
    carry their own story) while the file system of ``where`` has less than :data:`NEARLY_FULL` bytes free. The
    line names what was being written (the file, else ``where``) and the fix; None otherwise."""
    todo: list[BaseException | None] = [e]
    seen: set[int] = set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            target = x.filename if x.filename else where
            return f"no space left on device while writing {target}: free space there or choose another --out"
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            todo += [
                f[0] if isinstance(f, tuple) and f and isinstance(f[0], BaseException) else None
                for f in failures.values()
            ]
    if isinstance(e, ValueError | FloatingPointError | KeyboardInterrupt):
        return None
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= NEARLY_FULL:
        return None
    return (
        f"no space left on device in {where} ({free:,} bytes free; {_cause(e)[:200]}): free space there or "
        "choose another --out"
    )


def _die_with(launcher: int) -> None:
    """Be killed when the launcher dies, whatever kills it (Linux's PR_SET_PDEATHSIG): no orphan keeps training.

    The signal comes when this process's parent dies: the launcher (spawn), or its fork server, which exits when
    the launcher does (it reads EOF from a pipe only the launcher holds open)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still stop us
        return
    if os.getppid() == launcher:  # spawned, and the launcher had not died before the request took effect
        return
    if not _alive(launcher):  # it died before the request took effect (forked: before its server exits)
        os._exit(1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: exists, and is not a zombie (a process that died and was not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:  # no /proc: existing is all we know
        return True


def _release_fork_server() -> None:
    """Let the fork server exit when the launcher does. Each child it forks inherits a copy of the pipe whose EOF
    tells the server that its last client is gone (so that the child could fork through it too, which a worker
    never does): kept, it would keep the server, and so the worker, alive after the launcher died."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # CPython's since 3.4; without it (spawn) there is nothing to release
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]  # not in typeshed


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    tmp: str,
    trace_dir: str | None,
    parent: int,
    env: dict[str, str],
    args: tuple,
) -> None:
    _release_fork_server()
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops us
    # started with SIGINT blocked (launch), so that a Ctrl-C while a spawned worker imported stayed pending: now
    # ignored, it is dropped; unblocked, later ones are ignored too
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if os.environ != env:  # the fork server's is the launcher's when the server started
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the launcher's loopback store as a client (env:// init)
        }
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    code = 0
    try:
        result = fn(*args)
        with open(f"{tmp}/result_{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException as e:
        code = 1
        full = disk_full(e, str(Path(trace_dir).parent) if trace_dir is not None else "the run directory")
        cause = _cause(e) if full is None else f"OSError: {full}"
        # ValueError and FloatingPointError carry their whole story in the message; a full disk takes no traceback
        if full is None and not isinstance(e, ValueError | FloatingPointError):
            trace = traceback.format_exc()
            if trace_dir is None:
                sys.stderr.write(f"[rank {rank}] {trace}")
            else:
                path = Path(trace_dir) / f"rank{rank}.traceback"
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(trace)
                    cause += f" (traceback: {path})"
                except OSError as w:  # the report must not replace the error it reports, nor leave an empty file
                    path.unlink(missing_ok=True)
                    cause += f" (its traceback could not be written to {path}: {w.strerror or w})"
        try:
            with open(f"{tmp}/error_{rank}.txt", "w") as f:
                f.write(cause)
        except OSError:  # the launcher then reports the exit code; the cause is on stderr
            sys.stderr.write(f"[rank {rank}] {cause}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _loopback_store(timeout_s: float) -> tuple[dist.TCPStore, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, port


#: Imported by the fork server, once, rather than by every worker: torch, and torch._dynamo, which torch imports
#: when the first optimizer or ``fully_shard`` is built (~1.2 s each here).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


def _context() -> Any:
    """The fork server's context, started; spawn's where there is none, or where it cannot listen: its Unix
    socket lives in TMPDIR, and a path longer than a socket address takes (108 bytes on Linux) fails to bind."""
    if "forkserver" not in mp.get_all_start_methods():  # not POSIX
        return mp.get_context("spawn")
    from multiprocessing import forkserver, resource_tracker

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs (an earlier launch started it)
    # The server ignores Ctrl-C once it has imported (CPython's forkserver sets SIG_IGN, which also discards one
    # pending); while it imports, a Ctrl-C would print its traceback and fail the launch. So it starts with SIGINT
    # blocked: a child inherits this thread's signal mask. Blocked, not ignored: the launcher's handler still records a
    # Ctrl-C in this window (another thread takes it, or this one when it unblocks); ignored, it was lost and the run
    # went on to exit 0. The resource tracker is started first because starting it unblocks SIGINT on the way.
    try:
        resource_tracker.ensure_running()  # inside the try as when forkserver.ensure_running started it
        with _sigint_blocked():
            forkserver.ensure_running()
    except OSError:
        return mp.get_context("spawn")
    if not _server_stopper:
        _server_stopper.append(True)
        atexit.register(_stop_server)
    return ctx


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while the block runs (a child started here inherits the mask); on the way out
    the mask is restored, and the handler of a Ctrl-C that arrived meanwhile runs before the next statement
    (pthread_sigmask runs pending handlers before it returns)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


_server_stopper: list[bool] = []


def _stop_server() -> None:
    """At exit, kill the fork server rather than let it exit on its own: it would tear down its torch for about a
    second, holding this process's stdout and stderr open (a caller reading them waits for it)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # CPython's since 3.4
    if isinstance(pid, int):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _stop(procs: list[Any], grace_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def launch(
    fn: Callable[..., T],
    nproc: int,
    *args: Any,
    trace_dir: str | Path | None = None,
    grace_s: float = 5.0,
    store_timeout_s: float = 300.0,
) -> dict[int, T]:
    """Run ``fn(*args)`` on ``nproc`` local processes (forked from the fork server); return each rank's result.

    Under ``torchrun`` (or any launcher that sets RANK/WORLD_SIZE), runs ``fn`` in this process only, in the world
    that launcher set up. ``nproc == 1`` runs it in this process. Raises :class:`WorkerFailed` or
    :class:`Interrupted` as the module docstring says; a worker's traceback (other than a ValueError's or a
    FloatingPointError's, whose message says it all) goes to ``trace_dir/rankN.traceback``, or to stderr.
    """
    if under_torchrun():
        return {int(os.environ.get("RANK", "0")): fn(*args)}
    if nproc == 1:
        return {0: fn(*args)}
    store, port = _loopback_store(store_timeout_s)
    trace = None if trace_dir is None else str(trace_dir)
    interrupted: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        interrupted.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    procs: list[Any] = []
    try:
        ctx = _context()
        if interrupted:
            raise Interrupted(interrupted[0])
        with tempfile.TemporaryDirectory(prefix="powertrain-launch-") as tmp:
            env = dict(os.environ)  # every rank's, as it is at this launch
            # Workers start with SIGINT blocked, as the fork server does: spawned ones (no fork server) import torch
            # before _worker ignores SIGINT, and a Ctrl-C then printed each one's KeyboardInterrupt traceback. The
            # launcher's handler gets a Ctrl-C of this window at the unblock; the workers started are then stopped.
            try:
                with _sigint_blocked():
                    for rank in range(nproc):
                        p = ctx.Process(
                            target=_worker,
                            args=(fn, rank, nproc, port, tmp, trace, os.getpid(), env, args),
                            daemon=False,
                        )
                        p.start()
                        procs.append(p)
            except (EOFError, OSError):  # the fork server died: of a SIGTERM or SIGHUP while it imports, say
                if interrupted:  # recorded at the unblock
                    raise Interrupted(interrupted[0]) from None
                raise
            failures: list[Failure] = []
            while any(p.exitcode is None for p in procs) and not failures and not interrupted:
                time.sleep(0.05)
                _collect(procs, Path(tmp), failures)
            if failures or interrupted:
                time.sleep(0.2)  # ranks failing for the same reason (every rank raises on a NaN) report it too
                _collect(procs, Path(tmp), failures)
                _stop(procs, grace_s)
                if interrupted:
                    raise Interrupted(interrupted[0])
                raise WorkerFailed(failures)
            for p in procs:
                p.join()
            return {rank: pickle.loads((Path(tmp) / f"result_{rank}.pkl").read_bytes()) for rank in range(nproc)}
    finally:
        _stop(procs, grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)
        del store


def _collect(procs: list[Any], tmp: Path, failures: list[Failure]) -> None:
    """Append the workers that failed since the last call, with their causes."""
    known = {f.rank for f in failures}
    for rank, p in enumerate(procs):
        if p.exitcode in (None, 0) or rank in known:
            continue
        error_file = tmp / f"error_{rank}.txt"
        if error_file.is_file():
            cause = error_file.read_text().strip() or f"exit code {p.exitcode}"
        elif p.exitcode < 0:
            cause = f"killed by {signal.Signals(-p.exitcode).name}"
        else:
            cause = f"exit code {p.exitcode}"
        failures.append(Failure(rank, p.pid, cause))
