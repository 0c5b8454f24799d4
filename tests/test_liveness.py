"""The heartbeat that names lost peers when a collective fails (powertrain.train.liveness)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from powertrain.train.launch import _loopback_store
from powertrain.train.liveness import Heartbeat


def _store(monkeypatch: pytest.MonkeyPatch) -> tuple[dist.TCPStore, int]:
    """A rendezvous store on a free loopback port (the launcher's own, no port race), named by MASTER_ADDR /
    MASTER_PORT as a launcher does."""
    master, port = _loopback_store(5.0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return master, port


@pytest.fixture
def store(monkeypatch):
    return _store(monkeypatch)[0]


@pytest.mark.timeout(60)
def test_the_ranks_that_stop_beating_are_named_by_node_and_address(store, monkeypatch):
    beats = []
    for rank, node in ((0, "0"), (1, "0"), (2, "1"), (3, "1")):
        monkeypatch.setenv("GROUP_RANK", node)
        beats.append(Heartbeat(rank, 4, timeout_s=5, period_s=0.2))
    assert beats[0].diagnose() == ""  # everyone beats
    beats[2].stop()
    beats[3].stop()
    assert beats[0].diagnose() == "no heartbeat for 0.5 s from node 1 (127.0.0.1): ranks 2, 3"
    beats[1].stop()
    lost = beats[0].diagnose()
    assert lost == "no heartbeat for 0.5 s from node 0 (127.0.0.1): rank 1; node 1 (127.0.0.1): ranks 2, 3"
    beats[0].stop()


@pytest.mark.timeout(60)
def test_a_rank_that_never_beat_is_named_and_a_lost_store_names_node_0(monkeypatch):
    store, port = _store(monkeypatch)
    monkeypatch.setenv("GROUP_RANK", "1")
    beat = Heartbeat(0, 2, timeout_s=1, period_s=0.2)
    assert beat.diagnose() == "no heartbeat for 0.5 s from node ? (never started its heartbeat): rank 1"
    del store  # the store (on node 0) is gone
    lost = beat.diagnose()
    # its host answers (connection refused): the process that held the store is gone, not the node
    assert lost == (
        f"the rendezvous store at 127.0.0.1:{port} refused the connection: the process that hosted it "
        "(rank 0's, or torchrun's) exited"
    ), lost
    beat.stop()


@pytest.mark.timeout(60)
def test_malformed_heartbeat_records_never_replace_the_error(store, monkeypatch):
    """Any process that reaches the store can write its keys: a diagnosis reads them as data, and a diagnosis that
    fails anyway leaves the worker's own error in place (a note, never a new exception)."""
    monkeypatch.setenv("GROUP_RANK", "0")
    beat = Heartbeat(0, 3, timeout_s=5, period_s=0.2)
    store.set("powertrain/heartbeat/0/who/1", b"garbage")  # no address
    store.set("powertrain/heartbeat/0/who/2", b"\xff\x1b[2J " + b"x" * 500)  # not UTF-8, an escape, long
    lost = beat.diagnose()
    assert lost == (
        "no heartbeat for 0.5 s from node garbage (unknown address): rank 1; node \ufffd?[2J (" + "x" * 80 + "): rank 2"
    ), lost
    beat.stop()

    from powertrain.train.loop import _diagnose

    class Broken:
        def diagnose(self) -> str:
            raise ValueError("not enough values to unpack")

    assert _diagnose(Broken()) == "(which peers are lost is unknown: the diagnosis failed with ValueError)"  # type: ignore[arg-type]
    assert _diagnose(None) == ""
