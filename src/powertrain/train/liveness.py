"""Which peers are gone when a collective fails: a heartbeat per worker through the launcher's store.

A failed collective says little about who failed. gloo names the peer whose connection was reset (a killed
process), but a peer that is cut off (a dead link, a machine that lost power) only shows as a timeout: every rank
waited ``--timeout-s`` for someone. Each worker therefore counts up a key of its own in the rendezvous store once
a second (``MASTER_ADDR:MASTER_PORT``: torchrun's store, or the one rank 0 hosts, on node 0), next to what node it
runs on and its address. When a run fails, :meth:`Heartbeat.diagnose` reads every counter twice, a few periods
apart, and names the ranks (grouped by node) whose counter stood still. A worker that cannot reach the store at
all says whether the store's process exited (connection refused) or node 0, which holds it, is out of reach.

gloo only: NCCL's watchdog ends a process whose collective timed out before Python sees an error.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from powertrain.train.launch import torchrun_shared_store

PERIOD_S = 1.0
WAIT_PERIODS = 2.5  # a live peer beats at least twice while diagnose waits


class Heartbeat:
    """Beats for ``rank`` from a daemon thread until :meth:`stop`; ``timeout_s`` bounds each store operation."""

    def __init__(self, rank: int, world: int, timeout_s: float, period_s: float = PERIOD_S) -> None:
        self.rank, self.world, self.period_s = rank, world, period_s
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # torchrun's store outlives a restart on one node: the attempt separates the counts (see _restart_store)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if torchrun_shared_store() == "one node" else "0"
        self._prefix = f"powertrain/heartbeat/{attempt}"
        # the beat never waits behind a diagnosis; a diagnosis that cannot reach the store says so within seconds
        self._beat = self._client(datetime.timedelta(seconds=timeout_s))
        self._ask = self._client(datetime.timedelta(seconds=min(timeout_s, max(5.0, 5 * period_s))))
        node = os.environ.get("GROUP_RANK", "0")
        self._ask.set(f"who/{rank}", f"{node} {_local_address(self.host, self.port)}")
        self._beat.add(f"beat/{rank}", 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="powertrain-heartbeat", daemon=True)
        self._thread.start()

    def _client(self, timeout: datetime.timedelta) -> dist.Store:
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        return dist.PrefixStore(self._prefix, store)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._beat.add(f"beat/{self.rank}", 1)
            except Exception:  # the store is gone (the run is ending, or node 0 is out of reach): nothing to tell
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s)  # no beat lands after this (unless the store hangs it)

    def diagnose(self) -> str:
        """One line naming the ranks that stopped beating, by node and address; empty when every peer beats."""
        wait = WAIT_PERIODS * self.period_s
        try:
            before = [self._ask.add(f"beat/{r}", 0) for r in range(self.world)]
            time.sleep(wait)
            after = [self._ask.add(f"beat/{r}", 0) for r in range(self.world)]
            silent = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
            where = {
                r: (
                    _who(self._ask.get(f"who/{r}"))
                    if self._ask.check([f"who/{r}"])
                    else ("?", "never started its heartbeat")
                )
                for r in silent
            }
        except Exception as e:  # the store failed us
            store = f"the rendezvous store at {self.host}:{self.port}"
            text = str(e).lower()
            if any(w in text for w in ("refused", "reset", "closed")):  # its host answered: the store's process is gone
                return f"{store} refused the connection: the process that hosted it (rank 0's, or torchrun's) exited"
            if os.environ.get("GROUP_RANK", "0") == "0":
                return f"{store} did not answer ({type(e).__name__})"
            return f"{store} did not answer ({type(e).__name__}): node 0, which hosts it, is lost or out of reach"
        if not silent:
            return ""
        nodes: dict[tuple[str, str], list[int]] = {}
        for r in silent:
            node, address = where[r]
            nodes.setdefault((node, address), []).append(r)
        lost = "; ".join(
            f"node {node} ({address}): rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
            for (node, address), rs in sorted(nodes.items())
        )
        return f"no heartbeat for {wait:g} s from {lost}"


def _who(raw: bytes) -> tuple[str, str]:
    """A ``who/RANK`` value, ``"NODE ADDRESS"``, as (node, address); whatever a store holds there (any process that
    reaches it can write it) gives a short, printable pair rather than an error."""
    text = "".join(c if c.isprintable() else "?" for c in raw[:200].decode(errors="replace"))
    node, _, address = text.partition(" ")
    return node[:40] or "?", address[:80] or "unknown address"


def _local_address(host: str, port: int) -> str:
    """This machine's address on the route to the store (what its peers know it by), without sending anything."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()
