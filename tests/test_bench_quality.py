"""``powertrain bench quality`` end to end on the tiny preset (2 workers, 2 seeds, 8 steps, then run to target)."""

from __future__ import annotations

import json

import pytest

from powertrain.bench import network
from powertrain.bench.quality import PRESETS, ROWS, run_quality_bench, seconds_to
from powertrain.bench.sidebyside import Spec
from powertrain.train.model import GPT


@pytest.mark.timeout(300)
def test_quality_bench_tiny(tmp_path):
    by_label = {r.label: r for r in ROWS}
    r4 = by_label["powertrain powersgd r4 (alternating)"]
    frozen_fp32 = next(r for r in ROWS if r.kind == "none" and r.optimizer_options)
    rows = [ROWS[0], by_label["torch powerSGD_hook r4"], r4, frozen_fp32]
    target_md = tmp_path / "B.md"
    report = run_quality_bench(preset="tiny", rows=rows, out=str(tmp_path / "out"), write=str(target_md),
                               run_to_target=True)  # fmt: skip
    assert json.loads((tmp_path / "out" / "results.json").read_text())["preset"] == "tiny"
    p = PRESETS["tiny"]
    [h] = report["horizons"]
    assert h["steps"] == 8 and [r["label"] for r in h["rows"]] == [r.label for r in rows]
    fp32, hook, ours, frozen = h["rows"]
    assert frozen["val_mean"] != fp32["val_mean"]  # the row's optimizer options reach its optimizer
    assert h["target"] == pytest.approx(1.01 * fp32["val_mean"], rel=1e-12)
    assert fp32["fraction"] == 1.0 and fp32["warm"] == 0 and ours["warm"] == p.start == hook["warm"]
    # Bytes: powertrain's are counted as sent; after the warm-up's dense steps they must equal what the compressor
    # says a rank-4 step sends (alternating: P and Q on alternate steps, so the 6 compressed steps average them).
    model = GPT(p.model)
    low = network._model_bytes(Spec("r4", "powersgd", dict(r4.options)), model)["all_reduce"]
    assert ours["bytes_per_step"] == pytest.approx(low, rel=1e-9)
    assert ours["bytes"] == pytest.approx(p.start * fp32["dense_per_step"] + (8 - p.start) * low, rel=1e-9)
    assert ours["fraction"] < 0.5
    for r in h["rows"]:
        assert r["val_min"] <= r["val_mean"] <= r["val_max"] and len(r["steps_to_target"]) == p.seeds
        # a step to target is an evaluation at or below the target
        for hits, key in ((r["steps_to_target"], "steps"), (r["run_to_target"], "to target")):
            assert all(k is None or (k % p.eval_every == 0 and 0 < k <= 3 * 8) for k in hits), (key, hits)
    for run in h["to_target"]:
        assert run[0]["steps"] == 8  # fp32 sets the target: it runs its horizon
        for res in run[1:]:  # a row that reached the target stopped at that evaluation (no more steps taken)
            hit = next((k for k, v in res["val_curve"] if v <= h["target"]), None)
            assert hit is None or res["steps"] == hit, res
    # the model: the first k steps' time grows with k and shrinks with the link rate
    assert seconds_to(4, ours, 10.0) > seconds_to(4, ours, 1000.0) > seconds_to(2, ours, 1000.0) > 0
    text = target_md.read_text()
    assert "<!-- bench:quality-tiny -->" in text and "| powertrain powersgd r4 (alternating) |" in text
    assert "time to target @ 10 Mbit/s" in text
