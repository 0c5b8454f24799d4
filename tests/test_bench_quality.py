"""``powertrain bench quality`` end to end on the tiny preset (2 workers, 2 seeds, 8 steps, then run to target), and
its kept results: a second call runs only what is missing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from powertrain.bench import network, quality
from powertrain.bench.quality import CAP, PRESETS, run_quality_bench, seconds_to, select_rows
from powertrain.bench.sidebyside import Spec
from powertrain.models import GPT
from powertrain.train.config import TrainConfig
from powertrain.train.data import load_data


@pytest.mark.timeout(300)
def test_quality_bench_tiny(tmp_path, monkeypatch):
    launched: list[list[str]] = []
    real, real_time = quality._launch, quality._time

    def recording(p, rows, steps, seed, target):
        launched.append([r.key for r in rows])
        return real(p, rows, steps, seed, target)

    def timing(p, rows):
        launched.append(["timing"] + [r.key for r in rows])
        return real_time(p, rows)

    monkeypatch.setattr(quality, "_launch", recording)
    monkeypatch.setattr(quality, "_time", timing)
    out, md = tmp_path / "kept", tmp_path / "B.md"
    report = run_quality_bench(preset="tiny", rows=["torch-r4", "alt-r4", "fp32-frozen"], out=str(out), write=str(md))
    p = PRESETS["tiny"]
    # the timing launch (every row and the compute-only model), fp32 alone every seed (it sets the target), then
    # the other rows side by side, every seed
    rest = ["torch-r4", "alt-r4", "fp32-frozen"]
    assert launched == [["timing", "fp32", *rest], ["fp32"], ["fp32"], rest, rest]
    assert set(report["step_s"]) == {"", "fp32", *rest} and all(t > 0 for t in report["step_s"].values())
    [h] = report["horizons"]
    assert h["steps"] == 8 and [r["key"] for r in h["rows"]] == ["fp32", "torch-r4", "alt-r4", "fp32-frozen"]
    fp32, _hook, ours, frozen = h["rows"]
    assert frozen["val_mean"] != fp32["val_mean"]  # the row's optimizer options reach its optimizer
    assert h["target"] == pytest.approx(1.01 * fp32["val_mean"], rel=1e-12)
    assert ours["fraction"] < 0.5

    model = GPT(p.model)
    # What a row keeps: its curve from the run, and bytes counted as sent. After the warm-up's dense steps
    # powertrain's must equal what the compressor says a rank-4 step sends (alternating: P and Q on alternate
    # steps, so the compressed steps average them).
    kept = {k: json.loads((out / "tiny" / "h8" / "s0" / f"{k}.json").read_text())["measured"]
            for k in ("fp32", "alt-r4", "torch-r4")}  # fmt: skip
    # torch's hook counts nothing: its exact warm-up, then P and Q of its rank (computed)
    hook = kept["torch-r4"]
    hook_low = network.modelled_bytes(Spec("h", "torch_psgd", {"rank": 4}), model)
    assert hook["warm"] == p.start and hook["low"] == hook_low
    m = kept["alt-r4"]
    low = network.modelled_bytes(Spec("r4", "powersgd", {"rank": 4, "variant": "alternating"}), model)["all_reduce"]
    assert m["warm"] == p.start and m["dense"] == {"all_reduce": 4.0 * model.num_params()}
    assert m["low"]["all_reduce"] == pytest.approx(low, rel=1e-9)
    assert kept["fp32"]["steps_run"] == 8 and kept["fp32"]["warm"] == 0  # fp32 runs its horizon only
    # a run to target has every evaluation of its horizon, then stops at the first one at or below the target
    assert [k for k, _ in m["curve"]][: 8 // p.eval_every] == list(range(p.eval_every, 9, p.eval_every))
    hit = next((k for k, v in m["curve"] if v <= h["target"] and k >= 8), None)
    assert m["steps_run"] == (hit if hit is not None else CAP * 8), m
    for r in h["rows"]:
        assert r["val_min"] <= r["val_mean"] <= r["val_max"] and len(r["hits"]) == p.seeds
        assert all(k is None or (k % p.eval_every == 0 and 0 < k <= CAP * 8) for k in r["hits"]), r["hits"]

    # the model: the first k steps' time grows with k and shrinks with the link rate
    t = report["step_s"]["alt-r4"]
    assert seconds_to(4, m, t, 10.0) > seconds_to(4, m, t, 1000.0) > seconds_to(2, m, t, 1000.0) > 2 * t
    text = md.read_text()
    for rate in quality.RATES:  # per link rate, the fastest row to the target
        assert f"- {rate:g} Mbit/s: fastest " in text
    assert "<!-- bench:quality-tiny -->" in text and "| powertrain powersgd r4 (alternating" in text
    assert "time to target @ 10 Mbit/s" in text

    # a second call runs nothing that is kept: the same report from the kept results; a row whose definition changed
    # would run again (a changed preset too)
    launched.clear()
    again = run_quality_bench(preset="tiny", rows=["fp32-frozen", "alt-r4", "torch-r4"], out=str(out), write=None)
    assert launched == []
    by_key = {r["key"]: r for r in again["horizons"][0]["rows"]}
    assert all(by_key[r["key"]] == r for r in report["horizons"][0]["rows"])
    # a horizon limited to some rows (rows_at: the long one) runs and reports only those, fp32 first; the kept
    # results stay valid (rows_at is not part of a result's identity)
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(p, rows_at={8: ("alt-r4",)}))
    only = run_quality_bench(preset="tiny", rows=["fp32-frozen", "alt-r4", "torch-r4"], out=str(out), write=None)
    assert launched == [] and [r["key"] for r in only["horizons"][0]["rows"]] == ["fp32", "alt-r4"]
    monkeypatch.setitem(PRESETS, "tiny", p)
    path = out / "tiny" / "h8" / "s1" / "alt-r4.json"
    changed = json.loads(path.read_text())
    changed["identity"]["row"]["options"]["rank"] = 2
    path.write_text(json.dumps(changed))
    keep, alt = quality._Kept(out / "tiny", p), select_rows(["alt-r4"])[1]
    assert keep.get(8, 1, alt, h["target"]) is None
    # a lower target than the run stopped at cannot be decided from its curve, unless it ran to the cap
    assert (keep.get(8, 0, alt, 0.0) is None) == (m["steps_run"] < CAP * 8)


def test_rows_are_chosen_by_key_with_fp32_first():
    assert [r.key for r in select_rows(["r32", "bf16", "r32"])] == ["fp32", "r32", "bf16"]
    with pytest.raises(ValueError, match=r"Unknown quality row.*nope: choose from fp32, bf16"):
        select_rows(["nope"])
    with pytest.raises(ValueError, match=r"Invalid horizons=\[7\]"):
        run_quality_bench(preset="tiny", horizons=[7], write=None)


def _resnet_side_by_side(rank: int, world: int) -> dict:
    from powertrain.bench import sidebyside

    rows = [quality.FP32, *select_rows(["r8-frozen"])[1:]]
    specs = [quality._spec(r, 6, 2, None) for r in rows]
    return sidebyside.run(specs, model=None, batch=8, warmup=0, timed=6, start=2, eval_every=3)


def test_the_second_workload_trains_the_resnet_on_mnist1d():
    """The mnist1d preset's runs: the ResNet, side by side, validated; PowerSGD r8 sends less once compressing."""
    from dist_utils import run_ranks

    res = run_ranks(_resnet_side_by_side, 2, timeout=120)
    r0 = res[0]
    assert [len(c) for c in r0["val_curve"]] == [2, 2] and all(0 < v < 5 for v in r0["val_loss"])
    assert r0["val_loss"] == res[1]["val_loss"]  # the mean over ranks
    fp32, r8 = (sum(s.values()) for s in r0["sent_per_step"])
    assert fp32 == 4 * r0["params"] and r8 < fp32 / 2  # 2 of 6 steps exact
    assert PRESETS["mnist1d"].model is None
    # accuracy over the whole validation split (every rank its share): a whole number of its samples correct
    n_val = load_data(TrainConfig(model="resnet", data="mnist1d")).x_val.shape[0]
    accs = [a for curve in r0["acc_curve"] for _, a in curve]
    assert len(accs) == 4 and all(0 <= a <= 1 and abs(a * n_val - round(a * n_val)) < 1e-6 for a in accs)
    assert r0["acc_curve"] == res[1]["acc_curve"]
