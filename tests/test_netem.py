"""The emulated bandwidth-limited cluster: cost model, validation of the emulation, clean-up."""

from __future__ import annotations

import subprocess

import pytest

from powertrain.bench.netem import FRAMING, EmulatedCluster, collective_seconds, unavailable, validate


def test_cost_model():
    mb = 1e6
    # 2 ranks: ring all-reduce sends the whole payload once per rank; 4 ranks: 1.5 times.
    assert collective_seconds("all_reduce", 16 * mb, 2, 1000) == pytest.approx(16 * mb * 8 * FRAMING / 1e9)
    assert collective_seconds("all_reduce", 16 * mb, 4, 1000) == pytest.approx(1.5 * 16 * mb * 8 * FRAMING / 1e9)
    assert collective_seconds("all_gather", mb, 4, 100) == pytest.approx(3 * mb * 8 * FRAMING / 1e8)
    assert collective_seconds("reduce_scatter", mb, 2, 100) == pytest.approx(0.5 * mb * 8 * FRAMING / 1e8)
    assert collective_seconds("all_reduce", mb, 1, 100) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"world": 1, "rate_mbit": 100}, "world=1"), ({"world": 2, "rate_mbit": 0}, "rate_mbit=0"),
     ({"world": 2, "rate_mbit": 10, "subnet": 300}, "subnet=300")],
)  # fmt: skip
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EmulatedCluster(**kwargs)


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("pt")]


needs_root = pytest.mark.skipif(unavailable() is not None, reason=f"namespaces unavailable: {unavailable()}")


@needs_root
@pytest.mark.timeout(120)
def test_emulated_allreduce_matches_bandwidth_and_cleans_up():
    before = _ours()
    with EmulatedCluster(2, 100) as cluster:
        assert set(cluster.namespaces) <= set(_ours())
        result = validate(cluster, megabytes=2, repeats=3)
    # tbf shapes the links: the measured time follows bytes / bandwidth (measured 0.99-1.09 here)
    assert 0.9 < result["ratio"] < 1.2, result
    assert _ours() == before


@needs_root
@pytest.mark.timeout(60)
def test_cleanup_on_error_kills_processes_and_removes_namespaces():
    before = _ours()
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(2, None) as cluster:
        proc = cluster.spawn(1, ["sleep", "300"])
        raise RuntimeError("boom")
    assert proc.poll() is not None, "the process started in the namespace must be gone"
    assert _ours() == before


def test_cost_model_refuses_unknown_collectives():
    with pytest.raises(ValueError, match="Unknown collective 'broadcast'"):
        collective_seconds("broadcast", 1.0, 2, 100)


@pytest.mark.timeout(240)
def test_network_bench_end_to_end_tiny(tmp_path):
    """The short sweep (namespaces where available, else loopback): every configuration has a row, the
    emulation is checked, results.json and the Markdown section are written."""
    import json

    from powertrain.train.cli import main

    target = tmp_path / "B.md"
    main(["bench", "network", "--preset", "tiny", "--out", str(tmp_path / "out"), "--write", str(target)])
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    text = target.read_text()
    assert "<!-- bench:network-tiny -->" in text and "| powertrain powersgd r4 |" in text
    for rate in report["rates"]:
        labels = {row["label"] for row in rate["rows"]}
        assert {"DDP fp32", "torch powerSGD_hook r4", "powertrain powersgd r4", "powertrain int8"} <= labels
        if rate["check"] is not None:
            assert 0.8 < rate["check"]["ratio"] < 1.3
    if report["emulated"]:
        assert [r["rate_mbit"] for r in report["rates"]] == [None, 100.0]
        assert _ours() == []  # nothing left behind
