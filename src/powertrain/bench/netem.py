"""An emulated bandwidth-limited cluster on one machine: one network namespace per worker.

Layout: a hub namespace holds a bridge; each rank gets a namespace joined to the bridge by a veth pair,
with ``tc tbf`` limiting both ends (what a rank sends, and what it receives). Addresses come from a private
/24 that exists only inside these namespaces; nothing touches the host's own interfaces. ``tbf`` shapes
bandwidth only: this kernel has no netem, so latency, where wanted, must be added in software.

Everything created is removed on exit, also on errors and Ctrl-C (namespaces, and with them the links;
processes started here are killed by PID). Needs root and iproute2; :func:`unavailable` says why not.

The alpha-beta cost model (:func:`collective_seconds`, and :func:`comm_seconds` for a whole step's collectives) is
what the benchmarks compare measured step times with; :func:`validate` checks the emulation itself: a measured
all-reduce against bytes / bandwidth.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from powertrain.comm import ring_cost

__all__ = ["EmulatedCluster", "collective_seconds", "comm_seconds", "unavailable", "validate"]

#: TCP/IPv4/Ethernet framing: 1448 payload bytes cost 1514 on the wire; :func:`validate` times an all-reduce against
#: the model built on it (the network bench's "Emulation check" lines in BENCHMARKS.md).
FRAMING = 1514 / 1448


def collective_seconds(
    op: str,
    payload_bytes: float,
    world: int,
    rate_mbit: float,
    *,
    framing: float = FRAMING,
    latency_s: float = 0.0,
    collectives: int = 1,
) -> float:
    """Time a ring collective needs on links of ``rate_mbit``, per rank: the alpha-beta model of
    :func:`powertrain.comm.ring_cost` (what each collective sends), the one cost model of the benchmarks (the emulated
    links', and the clusters' on paper).

    ``payload_bytes`` is what one rank hands to the collective (the tensor for all-reduce, its own part for all-gather;
    gloo runs reduce-scatter as an all-reduce: use "all_reduce" for it there; for all-to-all what leaves the rank,
    :meth:`powertrain.comm.Communicator.all_to_all`). ``framing``: wire bytes per payload byte (TCP over Ethernet by
    default; 1 counts payload only). ``latency_s``: alpha, the cost of one message (0: bandwidth only, what the
    emulated links add); ``collectives``: how many collectives the payload is split into, each paying its messages'
    latency.
    """
    per_byte, messages = ring_cost(op, world)
    if payload_bytes <= 0:
        return 0.0
    return per_byte * payload_bytes * framing * 8 / (rate_mbit * 1e6) + collectives * messages * latency_s


#: What the benchmarks' per-step byte counts are costed as: gloo runs a reduce-scatter as a full all-reduce, and
#: FSDP2's weight all-gathers (counted apart from the gradients' collectives) are all-gathers.
_COST_AS = {"reduce_scatter": "all_reduce", "all_gather_weights": "all_gather"}


def comm_seconds(by_op: dict[str, float], rate_mbit: float | None, world: int = 2) -> float:
    """Bandwidth time of one step's collectives on gloo: ``by_op`` maps a collective (as :func:`collective_seconds`
    names them, or ``all_gather_weights``) to its payload bytes per step. 0 for ``rate_mbit`` None (unthrottled)."""
    if rate_mbit is None:
        return 0.0
    return float(sum(collective_seconds(_COST_AS.get(op, op), n, world, rate_mbit) for op, n in by_op.items()))


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None if they can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _sh(*args: str) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr.strip()}")


class EmulatedCluster:
    """``world`` namespaces on a bridge, each link limited to ``rate_mbit`` (None: unlimited).

    Use as a context manager; :meth:`spawn` starts a command inside rank ``r``'s namespace with the
    environment a torch.distributed worker needs (RANK, WORLD_SIZE, MASTER_ADDR/PORT, GLOO_SOCKET_IFNAME).
    As a multi-node cluster each namespace is a node: :meth:`torchrun` starts torch's launcher there with
    several workers, which talk to each other over the namespace's loopback (the fast link inside a node) and
    to the other nodes over the shaped link (:meth:`sent_bytes` counts what crossed it).
    """

    def __init__(self, world: int, rate_mbit: float | None, *, subnet: int = 231) -> None:
        if world < 2:
            raise ValueError(f"Invalid world={world}: an emulated cluster needs at least 2 ranks")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"Invalid rate_mbit={rate_mbit!r}: must be > 0 (or None for unthrottled)")
        if not 0 <= subnet <= 255:
            raise ValueError(f"Invalid subnet={subnet}: must be 0..255 (the third octet of 10.x.<subnet>.0/24)")
        self.world, self.rate_mbit = world, rate_mbit
        self.tag = f"pt{os.getpid() % 100000}"
        self.hub = f"{self.tag}hub"
        self.namespaces = [f"{self.tag}r{r}" for r in range(world)]
        self.addresses = [f"10.{subnet}.{os.getpid() % 250}.{r + 1}" for r in range(world)]
        self.port = 29500 + os.getpid() % 20000
        self._procs: list[subprocess.Popen[str]] = []
        self._created: list[str] = []

    def __enter__(self) -> EmulatedCluster:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"Cannot emulate a cluster: {reason}")
        # SIGTERM (kill, a CI timeout) would end the process without running __exit__: turn it into
        # SystemExit so the namespaces are deleted, as they are on Ctrl-C and on errors.
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    def _create(self) -> None:
        _sh("ip", "netns", "add", self.hub)
        self._created.append(self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for r, (ns, addr) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            _sh("ip", "netns", "add", ns)
            self._created.append(ns)
            inner, outer = f"{self.tag}e{r}", f"{self.tag}h{r}"
            _sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.hub)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
            _sh("ip", "-n", self.hub, "link", "set", outer, "up")
            if self.rate_mbit is not None:
                # Both directions: tbf on the rank's end shapes what it sends, on the hub's end what it gets.
                burst = max(32_000, int(self.rate_mbit * 1e6 / 8 / 250))  # at least one timer tick's worth
                for where, dev in ((ns, inner), (self.hub, outer)):
                    _sh(
                        "ip",
                        "netns",
                        "exec",
                        where,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{self.rate_mbit}mbit",
                        "burst",
                        str(burst),
                        "latency",
                        "400ms",
                    )

    def interface(self, rank: int) -> str:
        return f"{self.tag}e{rank}"

    def spawn(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` in rank ``rank``'s namespace as a torch.distributed worker of this cluster."""
        worker = {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(self.world),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(self.port),
            "GLOO_SOCKET_IFNAME": self.interface(rank),
            "OMP_NUM_THREADS": "1",
        }
        return self.exec(rank, argv, {**(env or {}), **worker})

    def exec(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` in namespace ``node`` with ``env`` over this process's environment (no torch variables:
        for a launcher such as torchrun that sets up its workers itself). Killed on :meth:`close`."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[node], *argv],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def torchrun(
        self, node: int, nproc: int, args: Sequence[str], *, max_restarts: int = 0, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Run ``torchrun`` on ``node`` as a user runs it on each machine of a cluster: ``nproc`` workers per node,
        every namespace one node, c10d rendezvous at node 0's address. ``args``: what follows torchrun's own
        options (``-m powertrain train ...``). Workers of one node talk over its loopback, nodes over the
        bridge (``GLOO_SOCKET_IFNAME``: the node's link)."""
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(self.world),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.addresses[0]}:{self.port}",
            "--rdzv-id",
            self.tag,
            "--max-restarts",
            str(max_restarts),
            # torch finds which node hosts the store, and where a node's workers are, from the host name, the
            # same in every namespace: say both
            "--rdzv-conf",
            f"is_host={int(node == 0)}",
            "--local-addr",
            self.addresses[node],
            *args,
        ]
        return self.exec(
            node, argv, {"GLOO_SOCKET_IFNAME": self.interface(node), "OMP_NUM_THREADS": "1", **(env or {})}
        )

    def sent_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent on its link to the bridge (the kernel's counter: headers included)."""
        out = subprocess.run(
            ["ip", "-n", self.namespaces[node], "-j", "-s", "link", "show", "dev", self.interface(node)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        """Kill what this cluster started (by PID, and whatever runs in its namespaces) and delete its namespaces.
        Safe to call twice."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()
        for ns in reversed(self._created):
            # what those started in their own sessions (torchrun's workers) left in this cluster's namespaces
            left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()


_ALLREDUCE_WORKER = """
import json, os, statistics, time, datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(int(os.environ["PT_NUMEL"]))
dist.all_reduce(t)  # warm-up: connections
times, small, one = [], [], torch.ones(1)
for _ in range(int(os.environ["PT_REPEATS"])):
    dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - t0)
for _ in range(20):  # latency: a 4-byte all-reduce is all per-message cost
    dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(one); small.append(time.perf_counter() - t0)
print(json.dumps({"median_s": statistics.median(times), "latency_s": statistics.median(small)}), flush=True)
os._exit(0)  # no destructors: a gloo group with peers is never destroyed (powertrain.train.launch.leave_world)
"""


def validate(
    cluster: EmulatedCluster, *, megabytes: float = 4.0, repeats: int = 3, timeout: float = 120
) -> dict[str, float]:
    """Time an fp32 all-reduce of ``megabytes`` on the cluster; compare with the alpha-beta model.

    Also measures the per-collective latency (alpha: the median time of a 4-byte all-reduce)."""
    numel = int(megabytes * 1e6 / 4)
    env = {"PT_NUMEL": str(numel), "PT_REPEATS": str(repeats)}
    procs = [cluster.spawn(r, [sys.executable, "-c", _ALLREDUCE_WORKER], env) for r in range(cluster.world)]
    results = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"validation worker failed: {err.strip()[-800:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    measured = max(r["median_s"] for r in results)
    expected = (
        collective_seconds("all_reduce", numel * 4, cluster.world, cluster.rate_mbit) if cluster.rate_mbit else 0.0
    )
    return {
        "bytes": numel * 4.0,
        "measured_s": measured,
        "expected_s": expected,
        "ratio": measured / expected if expected else float("nan"),
        "latency_s": max(r["latency_s"] for r in results),
    }
