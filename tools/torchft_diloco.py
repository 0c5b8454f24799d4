"""torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, torchft 0.2.0) on powertrain's GPT and data, timed on the link
beside powertrain's local updates: ``python tools/torchft_diloco.py [--preset local]``.

A comparison for powertrain's own claims, not a feature of the package: it lives in the repository's tools/ and needs
torchft 0.2.0, which it was written against (``pip install torchft==0.2.0``); :func:`main` says what it measures.

:func:`run_torchft` trains ``world`` replicas of one process each, as ``powertrain bench quality``'s local-update rows
train theirs (:mod:`powertrain.bench.sidebyside`): the model seeded with ``seed``, replica r's batch at step s
``corpus.batch("train", r, world, (seed, r, s), ...)``, the inner AdamW and its schedule built by ``powertrain
train``'s own functions, the outer step (SGD with Nesterov momentum at ``outer_lr``, ``outer_momentum``) on fp32
pseudo-gradients. torchft does the rest: its Manager (quorum through a lighthouse, the cross-replica gloo group) and
its DiLoCo (pseudo-gradients averaged by per-parameter all-reduces, sum then divide by the participants; the outer
step on the model; fragments).

What is measured, per run:

* ``val_curve``: every ``eval_every`` steps and at the end, the validation loss of each replica's own current model on
  its own 8 validation batches (``corpus.batch("val", r, world, (1, r, j), ...)``), averaged over all samples of all
  replicas, summed in the order sidebyside's ``_Run.evaluate`` sums them (bitwise the same number for equal models).
* ``step_times``: seconds per step without barriers (a barrier would be a collective torchft does not make). Each
  replica times its steps in two parts: its own computation (batch, forward, backward, AdamW, schedule) and the time
  spent in torchft's optimizer hook (the quorum, the all-reduces it waits for, the outer step). The replicas run
  freely between the steps at which they meet (where a sync starts: its quorum; where it is applied); between two
  meetings the steps are those of the slower replica there (the most computation: the one the others wait for), and a
  meeting step adds the smallest hook time (the last to arrive waits for nobody; the others' wait is that slower
  computation, already counted). So the times add up to the run's time without its evaluations, also when a loaded
  machine stalls one replica at a time, which a maximum per step would count once for each replica.
* ``bytes_per_sync``: the bytes every replica handed to the process group's all-reduce for each committed sync (a
  counting subclass of torchft's ``ProcessGroupGloo``): 4 bytes per parameter of the fragment in fp32.

Where torchft's DiLoCo differs from powertrain's rows (``powertrain.diloco.DiLoCo`` in sidebyside), to be stated
beside any comparison (with one fragment, no delay and ``steps`` a multiple of H there is no difference: at 2
replicas the runs agree bitwise, ``tests/test_bench_torchft.py``):

* the end: powertrain's rows end with ``DiLoCo.finish()``, one more sync of every fragment that has trained since
  its latest outer update; torchft has no such step, so with fragments, or ``steps`` not a multiple of H, its final
  loss is that of replicas that differ;
* a delay tau: torchft starts a fragment's sync tau steps before its turn and applies it at its turn
  (k H / F - tau -> k H / F); powertrain starts it at its turn and applies it tau steps later: the same period,
  shifted by tau (torchft's first sync covers H / F - tau steps);
* alpha: torchft ``global.lerp_(local, alpha)``, powertrain ``alpha * local + (1 - alpha) * global``: equal up to
  rounding;
* the messages: one all-reduce per parameter (torchft's default, no bucketing), after a quorum (RPCs through the
  lighthouse) on every sync, both in its measured sync time, and the replicas' heartbeats to the lighthouse share the
  link; powertrain sends one flat buffer;
* no quantisation: torchft's ``should_quantize`` needs triton and an accelerator (silently fp32 on CPU without
  triton, an error with it).

Sockets: the lighthouse (``torchft_lighthouse``), each replica's TCPStore and ManagerServer, and gloo bind to
127.0.0.1, or with ``rate_mbit`` to the addresses of an :class:`~powertrain.bench.netem.EmulatedCluster` (one network
namespace per replica, the lighthouse in replica 0's), never to all interfaces: torchft's Manager binds its server to
``[::]``, so the worker rewrites that one argument. There is no checkpoint server (``init_sync=False``: the replicas
start from the same seeded weights; nobody joins late, so nothing is ever healed).

Worker entry point (started by :func:`run_torchft`): ``python tools/torchft_diloco.py --worker JSON``. Importing this
module does not import torchft.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from powertrain import _json
from powertrain._checks import check_int
from powertrain._files import read_tail
from powertrain.bench import netem
from powertrain.models import GPT, GPTConfig
from powertrain.train.config import DEFAULT_SYNC_EVERY, TrainConfig

TORCHFT_VERSION = "0.2.0"  # the version this comparison was written against
_MISSING = f"torchft is not installed: install it with pip install torchft=={TORCHFT_VERSION}"
_VAL_BATCHES = 8  # as sidebyside's eval_batches


@dataclasses.dataclass(frozen=True)
class TorchftResult:
    """One :func:`run_torchft` run (see the module docstring for how each is measured)."""

    val_curve: list[tuple[int, float]]  # (step, validation loss) every eval_every steps and at the last step
    step_times: list[float]  # seconds, per step: the slower replica's steps between syncs, a sync as the last sees it
    bytes_per_sync: list[int]  # payload bytes per replica of each committed sync
    sync_steps: list[int]  # the steps (1-based) after which a sync was committed (its outer update applied)
    val_loss: float  # the final validation loss (the curve's last point)


def _config(
    steps: int,
    sync_every: int,
    fragments: int,
    sync_delay: int,
    sync_mix: float,
    outer_lr: float,
    outer_momentum: float,
) -> TrainConfig:
    """The config of the powertrain diloco row this run mirrors: it checks the values, and builds the inner AdamW and
    its schedule exactly as sidebyside does."""
    return TrainConfig(
        optimizer="adamw",
        parallel="diloco",
        compressor="none",
        steps=steps,
        sync_every=sync_every,
        fragments=fragments,
        sync_delay=sync_delay,
        sync_mix=sync_mix,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
    )


def run_torchft(
    *,
    model: GPTConfig,
    batch: int,
    steps: int,
    sync_every: int,
    seed: int,
    eval_every: int,
    data_mb: float,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    fragments: int = 1,
    sync_delay: int = 0,
    sync_mix: float = 0.0,
    world: int = 2,
    rate_mbit: float | None = None,
    timeout: float = 3600.0,
) -> TorchftResult:
    """Train ``world`` torchft DiLoCo replicas of the GPT ``model`` for ``steps`` steps; see the module docstring.

    Args:
        sync_every: H, inner steps between two syncs of a fragment; torchft needs ``fragments`` to divide it.
        fragments, sync_delay, sync_mix: Streaming DiLoCo's F, tau (torchft's ``fragment_sync_delay``) and alpha
            (``fragment_update_alpha``); the fragments are powertrain's (:func:`powertrain.diloco.split_by_size`),
            handed to torchft in the order that makes its schedule powertrain's (fragment k first at step k H / F).
        eval_every: validation every this many steps (0: at the end only).
        rate_mbit: run on an emulated cluster whose links carry this many Mbit/s (needs root); None: loopback.
        timeout: seconds for the whole run (also torchft's quorum and collective timeout).

    Raises ValueError for invalid settings, RuntimeError when a replica fails or a sync is not committed."""
    cfg = _config(steps, sync_every, fragments, sync_delay, sync_mix, outer_lr, outer_momentum)
    if sync_every % fragments:
        raise ValueError(
            f"Invalid fragments={fragments} for sync_every={sync_every}: torchft needs fragments to divide sync_every"
        )
    for name, value, low in (("batch", batch, 1), ("seed", seed, 0), ("eval_every", eval_every, 0)):
        check_int(name, value, low)
    if rate_mbit is None:
        check_int("world", world, 1)
    else:
        check_int("world", world, 2, " on an emulated cluster (rate_mbit)")
    if not timeout > 0:
        raise ValueError(f"Invalid timeout={timeout!r}: must be > 0 seconds")
    if importlib.util.find_spec("torchft") is None:
        raise ModuleNotFoundError(_MISSING)
    if (version := installed_version()) != TORCHFT_VERSION:
        warnings.warn(f"torchft {version} is installed; this bench was written for {TORCHFT_VERSION}", stacklevel=2)
    if rate_mbit is not None and (reason := netem.unavailable()):
        raise RuntimeError(
            f"rate_mbit={rate_mbit} needs an emulated cluster, unavailable here: {reason} (use "
            "rate_mbit=None for loopback)"
        )
    job = {
        "model": dataclasses.asdict(model),
        "batch": batch,
        "steps": steps,
        "seed": seed,
        "eval_every": eval_every,
        "data_mb": data_mb,
        "world": world,
        "timeout": timeout,
        "outer_lr": outer_lr,
        "outer_momentum": outer_momentum,
        "sync_every": sync_every,
        "fragments": fragments,
        "sync_delay": sync_delay,
        "sync_mix": sync_mix,
    }
    with tempfile.TemporaryDirectory(prefix="powertrain-torchft-") as tmp, contextlib.ExitStack() as stack:
        cluster = stack.enter_context(netem.EmulatedCluster(world, rate_mbit)) if rate_mbit is not None else None
        results = _launch(job, Path(tmp), cluster, timeout)
    return _combine(results, steps, cfg.sync_every // cfg.fragments)


def installed_version() -> str:
    """The installed torchft's version (PackageNotFoundError without it)."""
    return importlib.metadata.version("torchft")


def available() -> bool:
    """Whether torchft is installed (not a dependency: ``pip install torchft==0.2.0``)."""
    return importlib.util.find_spec("torchft") is not None


def link_seconds_per_step(
    *, model: GPTConfig, batch: int, sync_every: int, data_mb: float, rate_mbit: float, world: int = 2
) -> float:
    """torchft's DiLoCo (the paper's outer step, fp32, one fragment) on an emulated link of ``rate_mbit`` Mbit/s: its
    seconds per step over its second sync period (the first has the start-up), as
    :func:`powertrain.bench.timetotarget.seconds_per_step` times powertrain's local updates."""
    res = run_torchft(
        model=model,
        batch=batch,
        steps=2 * sync_every,
        sync_every=sync_every,
        seed=0,
        eval_every=0,
        data_mb=data_mb,
        world=world,
        rate_mbit=rate_mbit,
    )
    return sum(res.step_times[sync_every:]) / sync_every


# ------------------------------------------------------------------------------------------------------ driver


def _launch(job: dict[str, Any], tmp: Path, cluster: netem.EmulatedCluster | None, timeout: float) -> list[Any]:
    """Start the lighthouse and the replicas (in the cluster's namespaces, if any); return each replica's result."""
    world = job["world"]
    hosts = cluster.addresses if cluster is not None else ["127.0.0.1"] * world
    port = cluster.port if cluster is not None else _free_port()
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[Any]] = []
    try:
        lighthouse = [_lighthouse_binary(), "--bind", f"{hosts[0]}:{port}", "--min_replicas", str(world)]
        procs.append(_start(lighthouse, tmp / "lighthouse.log", env, cluster, 0))
        for r in range(world):
            args = {
                **job,
                "replica": r,
                "host": hosts[r],
                "lighthouse": f"{hosts[0]}:{port}",
                "result": str(tmp / f"replica{r}.json"),
            }
            ifname = cluster.interface(r) if cluster is not None else "lo"
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)]
            procs.append(_start(argv, tmp / f"replica{r}.log", {**env, "GLOO_SOCKET_IFNAME": ifname}, cluster, r))
        deadline = time.monotonic() + timeout
        workers = procs[1:]
        while any(p.poll() is None for p in workers) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in workers) or procs[0].poll() is not None:
                break  # a replica failed (its peers would wait for it until torchft's timeout), or the lighthouse
            time.sleep(0.2)
        failed = [r for r, p in enumerate(workers) if p.poll() != 0 or not (tmp / f"replica{r}.json").exists()]
        if failed and procs[0].poll() is not None:
            raise RuntimeError(
                f"The torchft lighthouse exited ({procs[0].returncode}); its log ends:\n{_tail(tmp / 'lighthouse.log')}"
            )
        if failed:
            r = failed[0]
            why = "still running at the timeout" if workers[r].poll() is None else f"exit {workers[r].returncode}"
            log = _tail(tmp / f"replica{r}.log") or _tail(tmp / "lighthouse.log")
            raise RuntimeError(f"torchft replica {r} failed ({why}); its log ends:\n{log}")
        return [_json.load(tmp / f"replica{r}.json", RESULT_LIMIT, "torchft replica result") for r in range(world)]
    finally:
        for p in reversed(procs):
            _kill(p)


def _start(
    argv: list[str], log: Path, env: dict[str, str], cluster: netem.EmulatedCluster | None, node: int
) -> subprocess.Popen[Any]:
    """``argv`` in its own session (in namespace ``node`` of ``cluster``, if any), its output into ``log``."""
    if cluster is not None:  # the cluster pipes the output; redirect it in the namespace so that no pipe fills up
        return cluster.exec(node, ["sh", "-c", 'exec "$@" >"$0" 2>&1', str(log), *argv], env)
    with open(log, "w") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )


def _kill(p: subprocess.Popen[Any]) -> None:
    """End ``p`` and its session (started here with its own), by its PID."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _lighthouse_binary() -> str:
    path = Path(sysconfig.get_path("scripts")) / "torchft_lighthouse"
    if not path.exists():
        raise ModuleNotFoundError(f"{_MISSING} (its torchft_lighthouse is not in {path.parent})")
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: bytes a replica's result file may hold (one takes ~1 kB)
RESULT_LIMIT = 1 << 20


def _tail(path: Path, size: int = 2000) -> str:
    """The last ``size`` bytes of a log, decoded (the log itself is never read whole)."""
    if not path.exists():
        return ""
    with path.open("rb") as f:
        return read_tail(f, size)


def _combine(results: list[dict[str, Any]], steps: int, period: int) -> TorchftResult:
    """The replicas' results as one: see the module docstring."""
    syncs = results[0]["syncs"]
    if any(r["syncs"] != syncs for r in results):
        raise RuntimeError(f"The replicas committed different syncs: {[r['syncs'] for r in results]}")
    if len(syncs) != steps // period:
        raise RuntimeError(
            f"torchft committed {len(syncs)} of {steps // period} syncs (a failed all-reduce makes it "
            f"skip one): committed at steps {[s for s, _ in syncs]}"
        )
    # validation: sidebyside sums (loss x samples, samples) per rank in float64 and all-reduces the sums
    curve = []
    for i, (step, _, _) in enumerate(results[0]["evals"]):
        total = sum(r["evals"][i][1] for r in results)
        samples = sum(r["evals"][i][2] for r in results)
        curve.append((step, total / samples))
    meets = results[0]["meets"]  # steps whose hook met the other replicas (a quorum, an all-reduce waited for)
    if any(r["meets"] != meets for r in results):
        raise RuntimeError(f"The replicas synchronised at different steps: {[r['meets'] for r in results]}")
    times: list[float] = []
    for start, end in itertools.pairwise([0, *(m for m in meets if m < steps), steps]):
        slow = max(results, key=lambda r: sum(r["compute_s"][start:end]))
        for i in range(start, end):  # a meeting as the last replica to arrive saw it
            hook = min(r["hook_s"][i] for r in results) if i + 1 in meets else slow["hook_s"][i]
            times.append(slow["compute_s"][i] + hook)
    return TorchftResult(
        val_curve=curve,
        step_times=times,
        bytes_per_sync=[b for _, b in syncs],
        sync_steps=[s for s, _ in syncs],
        val_loss=curve[-1][1],
    )


# ------------------------------------------------------------------------------------------------------ worker


class _Fragment(torch.nn.Module):
    """Some of a model's parameters (the same tensors) as a module: what torchft takes as a fragment."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def _torchft_fragments(model: torch.nn.Module, fragments: int) -> list[_Fragment]:
    """powertrain's fragments (consecutive parameters, :func:`powertrain.diloco.split_by_size`) in the order torchft
    syncs them: torchft's i-th fragment first at step (i + 1) H / F, powertrain's k-th at k H / F (0 at H)."""
    from powertrain.diloco import split_by_size

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = split_by_size([p.numel() for _, p in named], fragments)
    return [_Fragment([named[j] for j in groups[(i + 1) % fragments]]) for i in range(fragments)]


def _wait_for(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"No torchft lighthouse at {host}:{port} after {seconds:g} s") from None
            time.sleep(0.1)


def _worker(a: dict[str, Any]) -> None:
    """One replica: train, evaluate, write the result JSON to ``a["result"]``."""
    torch.set_num_threads(1)
    try:
        import torchft.manager as tf_manager
        from torchft.checkpointing.transport import CheckpointTransport
        from torchft.local_sgd import DiLoCo
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        raise SystemExit(f"{_MISSING} ({e})") from None

    from torch.distributed import TCPStore

    from powertrain.train.data import TokenData, load_data
    from powertrain.train.optimizers import build_optimizer, build_scheduler

    r, world, host, timeout = a["replica"], a["world"], a["host"], timedelta(seconds=a["timeout"])
    cfg = _config(
        a["steps"], a["sync_every"], a["fragments"], a["sync_delay"], a["sync_mix"], a["outer_lr"], a["outer_momentum"]
    )
    server = tf_manager.ManagerServer

    def bound_server(*args: Any, **kw: Any) -> Any:  # torchft's Manager binds its server to "[::]:port"
        if "bind" not in kw:
            raise RuntimeError(
                f"torchft's Manager no longer passes bind= to its server: this bench needs torchft {TORCHFT_VERSION}"
            )
        kw["bind"] = f"{host}:{kw['bind'].rsplit(':', 1)[1]}"
        return server(*args, **kw)

    tf_manager.ManagerServer = bound_server  # this worker process only

    class NoCheckpoints(CheckpointTransport):  # init_sync=False and no late joiners: nothing is ever healed
        def metadata(self) -> str:
            return "none"

        def send_checkpoint(self, dst_ranks: Any, step: Any, state_dict: Any, timeout: Any) -> None:
            raise RuntimeError("this bench does not heal replicas")

        def recv_checkpoint(self, src_rank: Any, metadata: Any, step: Any, timeout: Any) -> Any:
            raise RuntimeError("this bench does not heal replicas")

    sent: list[int] = []  # bytes handed to each all-reduce

    class CountingGloo(ProcessGroupGloo):
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            sent.append(sum(t.numel() * t.element_size() for t in tensors))
            return super().allreduce(tensors, opts)

    # the model, data and inner optimizer as sidebyside builds them for a diloco row
    corpus = load_data(TrainConfig(data_max_mb=a["data_mb"]))
    assert isinstance(corpus, TokenData), "the GPT trains on tokens"
    gpt, batch, seed = GPTConfig(**a["model"]), a["batch"], a["seed"]
    block = gpt.block_size
    val = [corpus.batch("val", r, world, (1, r, j), batch, block) for j in range(_VAL_BATCHES)]
    torch.manual_seed(seed)
    model = GPT(gpt)
    inner = build_optimizer(cfg, model).optimizer
    schedule = build_scheduler(cfg, inner)
    fragments = _torchft_fragments(model, cfg.fragments)
    m = cfg.outer_momentum  # DiLoCo's outer step: SGD with Nesterov momentum
    outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=m, nesterov=m > 0) for f in fragments]

    listener = socket.create_server((host, 0))  # the store's socket, on this replica's address only
    store = TCPStore(
        host,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
        timeout=timeout,
    )
    lh_host, lh_port = a["lighthouse"].rsplit(":", 1)
    _wait_for(lh_host, int(lh_port), 60)
    manager = tf_manager.Manager(
        pg=CountingGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=world,
        use_async_quorum=False,
        init_sync=False,
        replica_id=f"powertrain_{r}",
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=f"http://{a['lighthouse']}",
        hostname=host,
        port=0,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timedelta(seconds=60),
        checkpoint_transport=NoCheckpoints(),
    )

    @torch.no_grad()
    def evaluate() -> tuple[float, int]:
        model.eval()
        total = torch.zeros((), dtype=torch.float64)  # as sidebyside's float64 sums, in the same order
        for x, y in val:
            total += model(x, y).item() * y.shape[0]
        model.train()
        return total.item(), batch * len(val)

    eval_every = a["eval_every"]
    marks: list[float] = []
    inner.register_step_post_hook(lambda *_: marks.append(time.perf_counter()))  # before torchft's hook: AdamW done
    compute_s, hook_s, evals, syncs, meets = [], [], [], [], []
    with DiLoCo(
        manager,
        fragments,
        inner,
        outer,
        sync_every=cfg.sync_every,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        fragment_sync_delay=cfg.sync_delay,
        fragment_update_alpha=cfg.sync_mix,
    ):
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            x, y = corpus.batch("train", r, world, (seed, r, step), batch, block)
            inner.zero_grad(set_to_none=True)
            model(x, y).backward()
            committed, issued = manager.current_step(), len(sent)
            inner.step()  # torchft's post-hook starts and finishes the syncs
            t_hook = time.perf_counter() - marks[-1]
            schedule.step()
            compute_s.append(time.perf_counter() - t0 - t_hook)
            hook_s.append(t_hook)
            if manager.current_step() > committed or len(sent) > issued:
                meets.append(step + 1)
            if manager.current_step() > committed:
                syncs.append((step + 1, sum(sent)))  # sent since the last commit (the sync starts tau steps earlier)
                sent.clear()
            if step + 1 == cfg.steps or (eval_every and (step + 1) % eval_every == 0):
                evals.append((step + 1, *evaluate()))
    Path(a["result"]).write_text(
        _json.dumps({"compute_s": compute_s, "hook_s": hook_s, "evals": evals, "syncs": syncs, "meets": meets})
    )
    manager.shutdown(wait=False)


# ------------------------------------------------------------------------------ the comparison on the link

#: torchft's DiLoCo and powertrain's local-update rows are timed on the link in alternation: a run of torchft, then a
#: launch of powertrain's rows, this many pairs at a rate (one below timetotarget.SLOW Mbit/s, where a pair takes
#: about 12 minutes and the link, not the machine's load, sets the step)
TORCHFT_PAIRS = 3


def link_pairs(p: Any, rows: list[Any], path: Path) -> dict[str, list[dict[str, float]]]:
    """torchft's DiLoCo at the paper row's H on the link, timed side by side with the local-update rows among
    ``rows`` (quality bench rows of preset ``p``; kept in ``path``), per rate: a list of pairs, each {"torchft": s,
    row key: s, ...} seconds per step over one sync period after another; nothing without the paper row."""
    from powertrain.bench import quality, timetotarget

    paper = next((r for r in rows if r.key == quality.PAPER.key), None)
    if paper is None or p.model is None or not p.rates:
        return {}
    h = int(paper.optimizer_options["sync_every"])
    ours = [r for r in rows if r.parallel == "diloco" and not r.optimizer_options.get("sync_warmup")]  # as _phases
    specs = [quality._spec(r, 0, p.start, None) for r in ours]
    periods = [
        timetotarget.Timing(int(s.optimizer_options["sync_every"]), int(s.optimizer_options["sync_every"]))
        for s in specs
    ]
    kept: dict[str, Any] = _json.load(path, timetotarget.KEPT_LIMIT, "Kept torchft timings") if path.exists() else {}
    names = ",".join(r.key for r in ours)
    keys = {rate: f"{rate:g}/h{h}/w{p.workers}/{names}" for rate in p.rates}
    for rate, key in keys.items():
        pairs = kept.get(key, [])
        while len(pairs) < (TORCHFT_PAIRS if rate >= timetotarget.SLOW else 1):
            print(f"[torchft] torchft's DiLoCo and {names} on the link at {rate:g} Mbit/s, pair {len(pairs) + 1}")
            theirs = link_seconds_per_step(
                model=p.model, batch=p.batch, sync_every=h, data_mb=p.data_mb, rate_mbit=rate, world=p.workers
            )
            mine = timetotarget.seconds_per_step(
                specs, periods, model=p.model, batch=p.batch, rate=rate, data_mb=p.data_mb, world=p.workers
            )
            pairs.append({"torchft": theirs, **{r.key: t for r, t in zip(ours, mine, strict=True)}})
            kept[key] = pairs
            timetotarget.write_kept(path, kept)  # after every pair: a stopped call loses one
    return {str(rate): kept[key] for rate, key in keys.items()}


def pairs_text(pairs_at: dict[str, list[dict[str, float]]]) -> str:
    """torchft's DiLoCo against powertrain's local-update rows on the link, timed in alternation, at each rate."""
    if not pairs_at:
        raise ValueError("No pairs timed: the preset runs no paper row, no GPT or no link rate")
    out = []
    for rate, pairs in pairs_at.items():
        ours = [k for k in pairs[0] if k != "torchft"]
        ratios = "; ".join(
            f"{k} {statistics.median(p[k] for p in pairs):.3g} s "
            f"({'/'.join(format(p[k] / p['torchft'], '.2f') for p in pairs)}x torchft's)"
            for k in ours
        )
        n = f"median of {len(pairs)} pairs" if len(pairs) > 1 else "one pair"
        out.append(
            f"at {float(rate):g} Mbit/s ({n}) torchft {statistics.median(p['torchft'] for p in pairs):.3g} s, {ratios}"
        )
    return (
        "torchft's DiLoCo (the paper's outer step, fp32, an all-reduce per parameter after a quorum) timed "
        "side by side with powertrain's local-update rows, seconds per step over one sync period after another, "
        "a run of torchft then one launch of powertrain's rows per pair (each pair's ratio in brackets): "
        + "; ".join(out)
        + "."
    )


#: the powertrain rows at whose outer step torchft's DiLoCo is trained for its loss (each one fragment, no delay, an
#: fp32 outer step: what torchft runs): the paper's Nesterov step, and the command's, plain averaging. ``local`` (the
#: command's default, int4 with error feedback at that same step) is trained beside them: what powertrain adds
LOSS_ROWS = ("diloco-paper", f"h{DEFAULT_SYNC_EVERY}-none")
DEFAULT_ROW = "local"
#: what the kept torchft losses were trained by: a kept result of another format is trained again
LOSS_FORMAT = 1


def _outer_step(row: Any) -> dict[str, Any]:
    """The settings of the torchft run that mirrors ``row`` (a local-update row torchft can run: else ValueError)."""
    o = row.optimizer_options
    if row.parallel != "diloco" or row.kind != "none" or o.get("fragments", 1) != 1 or o.get("sync_delay", 0):
        raise ValueError(f"Row {row.key!r} is not one torchft's DiLoCo runs (fp32, one fragment, no delay)")
    return {"sync_every": int(o["sync_every"]), "outer_lr": o["outer_lr"], "outer_momentum": o["outer_momentum"]}


def loss_runs(p: Any, steps: int, seeds: int, path: Path) -> dict[str, list[dict[str, float]]]:
    """torchft's DiLoCo at the outer step of each of :data:`LOSS_ROWS`, trained ``steps`` steps on the preset's
    model, data and replicas on loopback, seeds 0 .. ``seeds`` - 1 (as the quality bench seeds its rows); kept in
    ``path`` under their settings and reused. Row key -> per seed {"val_loss", "bytes"} (a replica's, all syncs)."""
    from powertrain.bench import quality, timetotarget

    kept: dict[str, Any] = _json.load(path, timetotarget.KEPT_LIMIT, "Kept torchft losses") if path.exists() else {}
    out: dict[str, list[dict[str, float]]] = {}
    version = installed_version()
    for row in quality.select_rows(LOSS_ROWS)[1:]:
        step = _outer_step(row)
        if steps % step["sync_every"]:  # powertrain's rows end with a sync of their own there, torchft's not
            raise ValueError(f"{steps} steps is not a multiple of {row.key}'s H, {step['sync_every']}")
        out[row.key] = []
        for seed in range(seeds):
            run = dict(
                model=p.model,
                batch=p.batch,
                data_mb=p.data_mb,
                eval_every=p.eval_every,
                world=p.workers,
                steps=steps,
                seed=seed,
                **step,
            )
            what = {**run, "model": dataclasses.asdict(p.model), "torchft": version, "format": LOSS_FORMAT}
            key = json.dumps(what, sort_keys=True)
            if key not in kept:
                print(f"[torchft] torchft's DiLoCo at {row.key}'s outer step, {steps} steps, seed {seed}")
                res = run_torchft(**run)
                kept[key] = {"val_loss": res.val_loss, "bytes": sum(res.bytes_per_sync)}
                timetotarget.write_kept(path, kept)  # after every run: a stopped call loses one
            out[row.key].append(kept[key])
    return out


def powertrain_losses(p: Any, steps: int, seeds: int, root: Path) -> dict[str, list[dict[str, float]]]:
    """powertrain's rows :data:`LOSS_ROWS` and :data:`DEFAULT_ROW` as the quality bench kept them in ``root`` (trained
    to their horizon only: ``powertrain bench quality --horizon-only``), per seed {"val_loss", "bytes"}."""
    from powertrain.bench import quality

    kept = quality._Kept(root, p)
    out: dict[str, list[dict[str, float]]] = {}
    for row in quality.select_rows([*LOSS_ROWS, DEFAULT_ROW])[1:]:
        row = dataclasses.replace(row, to_target=False)
        ms = [kept.get(steps, seed, row, None) for seed in range(seeds)]
        if any(m is None for m in ms):
            raise RuntimeError(f"The quality bench has not kept {row.key!r} at {steps} steps in {root}")
        out[row.key] = [{"val_loss": quality._at(m, steps), "bytes": quality._bytes(m, steps)} for m in ms if m]
    return out


def loss_text(steps: int, theirs: dict[str, list[dict[str, float]]], ours: dict[str, list[dict[str, float]]]) -> str:
    """torchft's and powertrain's validation losses at the same outer steps, and powertrain's default beside them."""
    from powertrain.bench import quality

    def loss(runs: list[dict[str, float]]) -> str:
        vs = [r["val_loss"] for r in runs]
        return f"{statistics.mean(vs):.4f} ({min(vs):.4f}-{max(vs):.4f})"

    def mb(runs: list[dict[str, float]]) -> str:
        return f"{statistics.median(r['bytes'] for r in runs) / 1e6:.2f} MB"

    lines = [
        f"| outer step (H, fp32, one fragment) | torchft's DiLoCo, val loss at {steps} | powertrain's DiLoCo | "
        "largest difference of a seed | bytes a replica sends (torchft / powertrain) |",
        "|---|---|---|---|---|",
    ]
    for key, runs in [*(("torchft " + k, v) for k, v in theirs.items()), *ours.items()]:
        if not all(math.isfinite(r["val_loss"]) for r in runs):
            raise ValueError(f"{key}: a non-finite validation loss, {[r['val_loss'] for r in runs]}")
    for row in quality.select_rows(LOSS_ROWS)[1:]:
        t, o = theirs[row.key], ours[row.key]
        if all(a["val_loss"] == b["val_loss"] for a, b in zip(t, o, strict=True)):
            same = "0 (the same bits)"
        else:
            same = f"{max(abs(a['val_loss'] - b['val_loss']) for a, b in zip(t, o, strict=True)):.2g}"
        s = _outer_step(row)
        lines.append(
            f"| H {s['sync_every']}, lr {s['outer_lr']:g}, momentum {s['outer_momentum']:g} ({row.key}) | {loss(t)} | "
            f"{loss(o)} | {same} | {mb(t)} / {mb(o)} |"
        )
    avg, default = theirs[LOSS_ROWS[1]], ours[DEFAULT_ROW]
    gap = statistics.mean(d["val_loss"] for d in default) / statistics.mean(a["val_loss"] for a in avg) - 1
    ratio = statistics.median(a["bytes"] for a in avg) / statistics.median(d["bytes"] for d in default)
    label = quality.select_rows([DEFAULT_ROW])[1].label
    return (
        "\n".join(lines)
        + f"\n\nWhat powertrain adds at the command's outer step: {label}, {loss(default)}, {gap:+.2%} against "
        f"torchft's DiLoCo at the same outer step, for 1/{ratio:.1f} of its bytes ({mb(default)})."
    )


def main(argv: list[str] | None = None) -> int:
    """``python tools/torchft_diloco.py [--preset local] [--workers N] [--out DIR] [--write FILE]``: torchft's DiLoCo
    and the quality preset's local-update rows timed on the emulated link in alternation (needs root), the pairs
    kept beside the quality bench's results (``DIR/PRESET[-wN]/torchft_link.json``, reused), the section
    ``torchft-PRESET[-wN]`` of FILE (default: the repository's BENCHMARKS.md) rewritten.

    ``--losses``: instead, torchft's DiLoCo trained at the outer steps of :data:`LOSS_ROWS` over the preset's first
    horizon and seeds on loopback (no root), beside powertrain's same rows and its default (trained by the quality
    bench), all kept in ``DIR/torchft-loss/PRESET[-wN]/`` (torchft's in ``torchft_loss.json``) and reused; the section
    ``torchft-loss-PRESET[-wN]``.
    ``--worker JSON``: one replica of :func:`run_torchft` (started by it)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        if len(argv) != 2:
            raise SystemExit("usage: python tools/torchft_diloco.py --worker JSON (started by run_torchft)")
        _worker(json.loads(argv[1]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: torchft's manager threads and gloo's have been seen to abort it
    import argparse

    from powertrain.bench import quality
    from powertrain.bench.report import footer, publish, section

    parser = argparse.ArgumentParser(
        prog="tools/torchft_diloco.py",
        description="torchft's DiLoCo beside a quality preset's local-update rows: timed on the emulated link in "
        "alternation (needs root), or with --losses trained at the same outer steps (loopback)",
    )
    # the presets that time their rows on a link and run the paper's outer step, which torchft's DiLoCo runs
    with_paper = [n for n, p in quality.PRESETS.items() if quality.PAPER.key in (p.rows or ()) and p.model and p.rates]
    parser.add_argument("--preset", choices=with_paper, default="local")
    parser.add_argument("--workers", type=int, default=None, help="replicas (default: the preset's)")
    parser.add_argument("--out", default=quality.KEPT, help="the quality bench's kept results")
    parser.add_argument("--write", default=str(Path(__file__).resolve().parents[1] / "BENCHMARKS.md"))
    parser.add_argument(
        "--losses",
        action="store_true",
        help="train torchft's DiLoCo at the paper's outer step and at plain averaging, beside powertrain's same rows "
        "(validation losses and bytes; loopback, no root)",
    )
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 2:
        parser.error(f"--workers {args.workers}: local updates need 2 or more replicas")
    if not available():
        print(_MISSING, file=sys.stderr)
        return 2
    p = quality.PRESETS[args.preset]
    if args.workers is not None:
        p = dataclasses.replace(p, workers=args.workers)
    name = quality.run_name(args.preset, p.workers)
    flags = [] if args.workers is None else ["--workers", str(args.workers)]
    if args.losses:
        return _losses(args, p, name, flags)
    reason = netem.unavailable()
    if reason:
        print(
            f"tools/torchft_diloco.py times on an emulated link, which needs network namespaces: {reason}",
            file=sys.stderr,
        )
        return 2
    pairs = link_pairs(p, quality.select_rows(p.rows), Path(args.out) / name / "torchft_link.json")
    text = (
        f"## torchft's DiLoCo and powertrain's local updates on the link ({p.workers} replicas)\n\n"
        f"The quality bench's preset {args.preset!r} ({p.batch} sequences a step per replica).\n\n"
        + pairs_text(pairs)
        + "\n\n"
        + footer(" ".join(["python tools/torchft_diloco.py --preset", args.preset, *flags]))
    )
    publish(text, args.write, section("torchft", name))
    return 0


def _losses(args: Any, p: Any, name: str, flags: list[str]) -> int:
    """``--losses`` for preset ``p`` (the run's name and its command's flags): see :func:`main`."""
    from powertrain.bench import quality
    from powertrain.bench.report import footer, publish, section

    if p.recipe:  # run_torchft trains the command's schedule
        print(
            f"--losses: preset {args.preset!r} trains another recipe, {p.recipe}, which torchft's runs do not take",
            file=sys.stderr,
        )
        return 2
    steps = p.horizons[0]
    # a folder of their own: these rows train their horizon only, which the preset's kept runs to target are not
    out = Path(args.out) / "torchft-loss"
    root = out / name
    quality.run_quality_bench(  # what it has kept already is reused
        preset=args.preset,
        rows=[*LOSS_ROWS, DEFAULT_ROW],
        horizons=(steps,),
        workers=args.workers,
        rates=(),
        out=str(out),
        write=None,
        horizon_only=True,
    )
    theirs = loss_runs(p, steps, p.seeds, root / "torchft_loss.json")
    ours = powertrain_losses(p, steps, p.seeds, root)
    text = (
        f"## torchft's DiLoCo and powertrain's at the same outer step: validation loss ({p.workers} replicas)\n\n"
        f"The quality bench's preset {args.preset!r} ({p.batch} sequences a step per replica, {p.seeds} seeds, "
        f"{steps} steps, loopback): torchft {installed_version()}'s DiLoCo trained at the outer step of each "
        "powertrain row, the same seeded models, batches, inner AdamW and schedule; bytes counted at each one's "
        "all-reduce.\n\n"
        + loss_text(steps, theirs, ours)
        + "\n\n"
        + footer(" ".join(["python tools/torchft_diloco.py --losses --preset", args.preset, *flags]))
    )
    publish(text, args.write, section("torchft-loss", name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
