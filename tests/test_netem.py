"""The emulated bandwidth-limited cluster: cost model, validation of the emulation, clean-up."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from dist_utils import within
from powertrain.bench.netem import FRAMING, EmulatedCluster, collective_seconds, validate

EPS = sys.float_info.epsilon  # Python floats are IEEE doubles, correctly rounded on every machine


def test_cost_model():
    mb = 1e6
    # Each side rounds twice (x FRAMING, / rate; the ring factors, payloads, 8 and the rates are exact in binary):
    # <= 4 u = 2 eps relative; 2x safety. (abs=0: pytest.approx would otherwise allow 1e-12 s.)
    close = lambda x: pytest.approx(x, rel=4 * EPS, abs=0)
    # 2 ranks: ring all-reduce sends the whole payload once per rank; 4 ranks: 1.5 times.
    assert collective_seconds("all_reduce", 16 * mb, 2, 1000) == close(16 * mb * 8 * FRAMING / 1e9)
    assert collective_seconds("all_reduce", 16 * mb, 4, 1000) == close(1.5 * 16 * mb * 8 * FRAMING / 1e9)
    assert collective_seconds("all_gather", mb, 4, 100) == close(3 * mb * 8 * FRAMING / 1e8)
    assert collective_seconds("reduce_scatter", mb, 2, 100) == close(0.5 * mb * 8 * FRAMING / 1e8)
    assert collective_seconds("all_reduce", mb, 1, 100) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world": 1, "rate_mbit": 100}, "world=1"),
        ({"world": 2, "rate_mbit": 0}, "rate_mbit=0"),
        ({"world": 2, "rate_mbit": 10, "subnet": 300}, "subnet=300"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EmulatedCluster(**kwargs)


def _ours() -> list[str]:
    """This suite's network namespaces; none where iproute2 is not installed (no namespace can have been made)."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("pt")]


@pytest.mark.netem
@pytest.mark.timeout(120)
def test_emulated_allreduce_matches_bandwidth_and_cleans_up():
    before = _ours()
    with EmulatedCluster(2, 100) as cluster:
        assert set(cluster.namespaces) <= set(_ours())
        result = validate(cluster, megabytes=2, repeats=3)
    # tbf shapes the links: the measured time follows bytes / bandwidth (measured 0.99-1.09 here)
    assert 0.9 < result["ratio"] < 1.2, result
    assert _ours() == before


@pytest.mark.netem
@pytest.mark.timeout(60)
def test_cleanup_on_error_kills_processes_and_removes_namespaces():
    before = _ours()
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(2, None) as cluster:
        proc = cluster.spawn(1, ["sleep", "300"])
        raise RuntimeError("boom")
    assert proc.poll() is not None, "the process started in the namespace must be gone"
    assert _ours() == before


_SIGTERM_CHILD = """
import sys, time
from powertrain.bench.netem import EmulatedCluster
with EmulatedCluster(2, 100) as c:
    c.spawn(1, ["sleep", "300"])
    print(" ".join(c.namespaces), flush=True)
    time.sleep(300)
"""


@pytest.mark.netem
@pytest.mark.timeout(60)
def test_sigterm_removes_namespaces():
    """A benchmark killed with SIGTERM (kill, a CI timeout) still deletes its namespaces."""
    import signal
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    names = proc.stdout.readline().split()
    assert names and set(names) <= set(_ours())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not set(names) & set(_ours())


def test_break_even_solves_the_serial_model():
    """16-bit sends 8 MB at 1.0 s unthrottled, a compressor 1 MB at 1.1 s: with k = seconds per Mbit/s,
    1.1 + k_c / B = 1.0 + k_16 / B at B = (k_16 - k_c) / 0.1."""
    from powertrain.bench.netem import comm_seconds
    from powertrain.bench.network import SIXTEEN, Row, _break_even
    from powertrain.bench.sidebyside import Spec

    def row(kind: str, median_s: float, sent: float) -> Row:  # not run: its step time is its model's
        return Row(Spec(kind, kind), {"all_reduce": sent}, 1.0, None, median_s, median_s, None)

    rows = {key: row("torch_fp16", 1.0 + i, 8e6) for i, key in enumerate(SIXTEEN)}
    rows |= {"c": row("powersgd", 1.1, 1e6), "free": row("powersgd", 0.9, 1e6), "bigger": row("int8", 1.2, 9e6)}
    be = _break_even(rows)
    assert set(be) == {"c", "free", "bigger"}  # by key: the 16-bit rows are the baseline
    k16, kc = comm_seconds({"all_reduce": 8e6}, 1.0), comm_seconds({"all_reduce": 1e6}, 1.0)
    # The code divides by 1.1 - 1.0, which is off from the literal 0.1 by <= 1.1 u + 0.1 u absolute (12 u
    # relative), plus one division per side: 14 u; 2x safety.
    assert be["c"] == pytest.approx((k16 - kc) / 0.1, rel=14 * EPS, abs=0)
    # check: at that rate both rows take the same time (4 roundings on values <= 1.12 and b's two, times
    # (k16 - kc) / b = 0.1: < 2.6 u absolute, < 2.4 u relative; 2x safety)
    b = be["c"]
    assert 1.1 + kc / b == pytest.approx(1.0 + k16 / b, rel=2.4 * EPS, abs=0)
    assert be["free"] is None  # faster even without a network: pays at every bandwidth
    assert be["bigger"] == 0.0  # sends more than 16-bit: never pays


def test_fsdp_weight_gathers_counted_per_block_twice():
    from powertrain.bench.network import fsdp2_weight_bytes
    from powertrain.models import GPT, GPTConfig

    m = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8))
    blocks = sum(p.numel() for p in m.blocks.parameters())
    total = sum(p.numel() for p in m.parameters())
    assert fsdp2_weight_bytes(m, 2) == 4.0 * (2 * blocks + (total - blocks)) / 2


def test_cost_model_refuses_unknown_collectives():
    with pytest.raises(ValueError, match="Unknown collective 'broadcast'"):
        collective_seconds("broadcast", 1.0, 2, 100)


def _val_loss_per_ulp() -> tuple[float, float]:
    """For the tiny preset's initial model and validation batches (as the sweep builds them, 2 ranks): the
    first-order change of the validation loss when every weight moves by one ulp in its worst direction,
    sum |dL/dw| ulp(w), and the loss evaluation's own float32 noise (the change a random one-ulp move causes)."""
    import torch

    from powertrain.bench.network import PRESETS
    from powertrain.models import GPT
    from powertrain.train.config import TrainConfig
    from powertrain.train.data import load_data

    p = PRESETS["tiny"]
    torch.manual_seed(0)  # the sweep's initial model
    model = GPT(p.model)
    corpus = load_data(TrainConfig(data_max_mb=4.0))
    batches = [corpus.batch("val", r, 2, (1, r, j), p.batch, p.model.block_size) for r in range(2) for j in range(8)]
    loss = sum(model(x, y) for x, y in batches) / len(batches)
    loss.backward()
    inf = torch.tensor(float("inf"))
    with torch.no_grad():
        coherent = sum(
            (w.grad.abs() * (torch.nextafter(w.abs(), inf) - w.abs())).sum().item() for w in model.parameters()
        )
        gen = torch.Generator().manual_seed(0)
        for w in model.parameters():
            w.copy_(torch.nextafter(w, torch.where(torch.rand(w.shape, generator=gen) < 0.5, inf, -inf)))
        moved = sum(model(x, y).item() for x, y in batches) / len(batches)
    return coherent, abs(moved - loss.item())


@pytest.mark.xdist_group("netem")  # runs without root too (on loopback), but makes namespaces where it can
@pytest.mark.timeout(240)
def test_network_bench_end_to_end_tiny(tmp_path):
    """The short sweep (namespaces where available, else loopback): every configuration has a row, the
    emulation is checked, results.json and the Markdown section are written."""
    import json

    from powertrain.cli import main

    target = tmp_path / "B.md"
    before = _ours()
    main(["bench", "network", "--preset", "tiny", "--out", str(tmp_path / "out"), "--write", str(target)])
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    text = target.read_text()
    assert "<!-- bench:network-tiny -->" in text and "| powertrain powersgd r4 |" in text
    from powertrain.bench.network import SPECS

    for rate in report["rates"]:
        assert [row["label"] for row in rate["rows"]] == [s.label for s in SPECS.values()]
        for row in rate["rows"]:
            assert row["median_s"] > 0 and row["ideal_s"] <= row["model_s"], row
        if rate["check"] is not None:
            assert 0.8 < rate["check"]["ratio"] < 1.3  # a timing (tbf's shaping), not a rounding bound
    # FSDP2, DDP and the reference API apply the same PowerSGD update (and FSDP2 fp32 the same as DDP fp32): the
    # rows differ only in rounding (sum order, elementwise kernels' vector body and tail over other shard shapes,
    # FSDP's rows of P Q^T), <= 2 ulp per weight per step over the sweep's S steps; to first order that moves the
    # validation loss by <= 2 S sum |dL/dw| ulp(w) (measured here at the initial model), plus the evaluation's
    # float32 noise on each side; 4x safety.
    from powertrain.bench.network import PRESETS

    coherent, noise = _val_loss_per_ulp()
    steps = PRESETS["tiny"].warmup + PRESETS["tiny"].timed
    bound = 4 * (2 * steps * coherent + 2 * noise)
    rows = dict(zip(SPECS, report["rates"][0]["rows"], strict=True))  # in SPECS' order (checked above)
    psgd = [rows[key]["val_loss"] for key in ("r4", "r4-2mb", "r4-reference", "fsdp-r4")]
    within(max(psgd) - min(psgd), bound, f"PowerSGD rows' validation losses {psgd}")
    within(abs(rows["fsdp-fp32"]["val_loss"] - rows["fp32"]["val_loss"]), bound, "FSDP2 fp32 vs DDP fp32")
    assert "Where compression stops paying off" in text
    assert (tmp_path / "out" / "speedup_vs_bandwidth.png").stat().st_size > 1000
    if report["emulated"]:
        assert [r["rate_mbit"] for r in report["rates"]] == [None, 100.0]
        assert _ours() == before  # nothing left behind


def test_equal_wall_clock_picks_the_last_evaluation_within_the_fastest_run():
    from bench_optimizers import at_equal_wall_clock

    times = [[1.0] * 4, [0.5] * 4, [2.0] * 4]  # totals 4, 2, 8: the budget is 2 s
    curves = [[(2, 3.0), (4, 2.0)], [(2, 3.5), (4, 2.5)], [(2, 2.8), (4, 1.0)]]
    out = at_equal_wall_clock(times, curves)
    assert out["budget_s"] == 2.0
    # run 0 is at 2 s after step 2; run 1 finishes exactly at 2 s; run 2 has no evaluation within 2 s
    assert out["reached"] == [(2, 3.0), (4, 2.5), None]
