"""``powertrain bench quality`` end to end on the tiny preset (2 workers, 2 seeds, 8 steps, then run to target), and
its kept results: a second call runs only what is missing."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest

from powertrain.bench import network, quality, timetotarget
from powertrain.bench.quality import CAP, PRESETS, run_quality_bench, select_rows
from powertrain.bench.sidebyside import Spec
from powertrain.models import GPT
from powertrain.train.config import TrainConfig
from powertrain.train.data import load_data

#: local updates at the tiny horizon: H 4, int4 on the outer step (two syncs in 8 steps)
TINY_LOCAL = quality.Row(
    "h4-int4",
    "local updates H 4, int4 outer",
    "int4",
    optimizer_options={"sync_every": 4, "outer_lr": 1.0, "outer_momentum": 0.0},
    parallel="diloco",
)


@pytest.mark.netem
@pytest.mark.timeout(400)
def test_quality_bench_tiny(tmp_path, monkeypatch):
    launched: list[list[str]] = []
    real, real_link = quality._launch, timetotarget.seconds_per_step

    def recording(p, rows, steps, seed, target):
        launched.append([r.key for r in rows])
        return real(p, rows, steps, seed, target)

    def link(specs, timings, **kw):
        launched.append([f"link {kw['rate']:g}"] + [f"{s.label}/{s.bucket_cap_mb}" for s in specs])
        return real_link(specs, timings, **kw)

    monkeypatch.setattr(quality, "_launch", recording)
    monkeypatch.setattr(timetotarget, "seconds_per_step", link)
    monkeypatch.setattr(quality, "GRID", [TINY_LOCAL])
    out, md = tmp_path / "kept", tmp_path / "B.md"
    rest = ["torch-r4", "alt-r4", "fp32-frozen", "h4-int4"]
    report = run_quality_bench(preset="tiny", rows=rest, out=str(out), write=str(md))
    p = PRESETS["tiny"]
    # first the link: per rate, the per-step configurations side by side, as the command builds them (alt-r4
    # compressing from its first step, its exact steps timed as fp32's), then local updates over whole periods in a
    # launch of their own; torch's hook is not timed. Then fp32 alone every seed (it sets the target), then the
    # other rows side by side, every seed
    one = ["fp32/None", "alt-r4/None", "fp32-frozen/None"]
    assert launched == [
        ["link 1", *one],
        ["link 1", "h4-int4/None"],
        ["link 100", *one],
        ["link 100", "h4-int4/None"],
        ["fp32"],
        ["fp32"],
        rest,
        rest,
    ]
    link_s = report["link_s"]
    assert set(link_s) == {"1.0", "100.0"} and set(link_s["1.0"]) == {"fp32", "alt-r4", "fp32-frozen", "h4-int4"}
    assert len(link_s["1.0"]["alt-r4"]) == 2 and link_s["1.0"]["alt-r4"][0] == link_s["1.0"]["fp32"][0]
    # a dense fp32 step on a 1 Mbit/s link takes longer than on a 100 Mbit/s one (the model's 4 bytes a parameter)
    assert link_s["1.0"]["fp32"][0] > link_s["100.0"]["fp32"][0] > 0
    [h] = report["horizons"]
    assert h["steps"] == 8 and [r["key"] for r in h["rows"]] == ["fp32", *rest]
    fp32, _hook, ours, frozen, local = h["rows"]
    assert frozen["val_mean"] != fp32["val_mean"]  # the row's optimizer options reach its optimizer
    assert h["target"] == pytest.approx(1.01 * fp32["val_mean"], rel=1e-12)
    assert ours["fraction"] < 0.5
    # local updates: two int4 syncs of the model in 8 steps (the finishing sync falls on the last scheduled one)
    model = GPT(p.model)
    assert local["fraction"] < 2 * 0.6 / 8 and "seconds" not in _hook

    # What a row keeps: its curve from the run, and bytes counted as sent. After the warm-up's dense steps
    # powertrain's must equal what the compressor says a rank-4 step sends (alternating: P and Q on alternate
    # steps, so the compressed steps average them).
    kept = {
        k: json.loads((out / "tiny" / "h8" / "s0" / f"{k}.json").read_text())["measured"]
        for k in ("fp32", "alt-r4", "torch-r4")
    }
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
    # time to target: each phase's share of the median seed's steps at that phase's measured seconds (alt-r4: its
    # exact steps at fp32's); every row that reached the target in every seed has one, fp32 among them
    timed = [r for r in h["rows"] if "seconds" in r]
    assert "fp32" in [r["key"] for r in timed] and "torch-r4" not in [r["key"] for r in timed]
    for r in timed:
        k = statistics.median(r["hits"])
        for rate in p.rates:
            per = link_s[str(rate)][r["key"]]
            split = [min(k, p.start), max(0, k - p.start)] if r["key"] == "alt-r4" else [k]
            assert r["seconds"][str(rate)] == pytest.approx(sum(n * t for n, t in zip(split, per, strict=True)))
    text = md.read_text()
    for rate in p.rates:  # per link rate, the fastest row to the target
        assert f"- {rate:g} Mbit/s: fastest " in text
    assert "<!-- bench:quality-tiny -->" in text and "| powertrain powersgd r4 (alternating" in text
    assert "time to target @ 1 Mbit/s" in text and "measured on an emulated link" in text

    # a second call runs nothing that is kept (the link timings neither): the same report from the kept results; a
    # row whose definition changed would run again (a changed preset too)
    launched.clear()
    again = run_quality_bench(preset="tiny", rows=rest[::-1], out=str(out), write=None)
    assert launched == []
    by_key = {r["key"]: r for r in again["horizons"][0]["rows"]}
    assert all(by_key[r["key"]] == r for r in report["horizons"][0]["rows"])
    # some rows under a section of their own: the preset's full section stays as it was
    full = md.read_text().split("<!-- bench:quality-tiny -->")[1].split("<!-- /bench:quality-tiny -->")[0]
    run_quality_bench(preset="tiny", rows=rest[:1], out=str(out), write=str(md), section="quality-tiny-hook")
    text = md.read_text()
    assert f"<!-- bench:quality-tiny -->{full}<!-- /bench:quality-tiny -->" in text and launched == []
    hook_section = text.split("<!-- bench:quality-tiny-hook -->")[1].split("<!-- /bench:quality-tiny-hook -->")[0]
    assert "torch powerSGD_hook r4" in hook_section and "alternating" not in hook_section
    with pytest.raises(ValueError, match=r"Invalid section='x -->': use lower-case letters"):
        run_quality_bench(preset="tiny", out=str(out), write=str(md), section="x -->")
    # a horizon limited to some rows (rows_at: the long one) runs and reports only those, fp32 first; the kept
    # results stay valid (rows_at is not part of a result's identity)
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(p, rows_at={8: ("alt-r4",)}))
    only = run_quality_bench(preset="tiny", rows=rest, out=str(out), write=None)
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


def test_the_median_seeds_steps_decide_the_time_to_target():
    """A seed that never reached the target counts as slower than every seed that did: with 3 seeds the median is
    known once two reached it (a time to target from it), not while the median seed itself is missing."""
    from powertrain.bench.quality_text import _hits_text
    from powertrain.bench.timetotarget import median_steps

    assert median_steps([275, None, 250]) == 275 and median_steps([300, 275, 250]) == 275
    assert median_steps([100, None, None]) is None and median_steps([None]) is None
    assert median_steps([100, 200, 300, None]) == 250 and median_steps([100, 200, None, None]) is None
    # the table prints the same median: the seeds that reached it, and where the median seed did not, only how many
    assert _hits_text([275, None, 250], 300) == "275 (2/3 seeds)" and _hits_text([100, None, None], 300) == "1/3 seeds"
    assert _hits_text([None, None], 300) == "not within 300" and _hits_text([100, 150], 300) == "125"


def test_phases_add_up_per_phase():
    """seconds_to: each phase's share of the first k steps at its own seconds per step."""
    a, b = Spec("a", "none"), Spec("b", "int4")
    phases = [timetotarget.Phase(3, a), timetotarget.Phase(None, b)]
    sec = {timetotarget.timing_key(a): 10.0, timetotarget.timing_key(b): 1.0}
    assert timetotarget.seconds_to(2, phases, sec) == 20.0
    assert timetotarget.seconds_to(7.5, phases, sec) == 30.0 + 4.5
    got = timetotarget.phases_of(b, exact_warmup=3, exact=a)
    assert [(ph.until, ph.spec) for ph in got] == [(3, a), (None, b)]
    assert [(ph.until, ph.spec) for ph in timetotarget.phases_of(b, exact_warmup=0, exact=a)] == [(None, b)]
    with pytest.raises(ValueError, match="torch's PowerSGD hook"):
        timetotarget.measure(
            [Spec("t", "torch_psgd", {"rank": 4})],
            [10.0],
            model=None,
            batch=1,
            data_mb=0.0,
            kept=Path("/nonexistent/kept.json"),
        )


def test_a_bucket_size_the_runner_would_not_apply_is_refused():
    """A row with an optimizer and a powertrain compressor runs DDP as the command builds it (torch's buckets): a bucket
    size there was ignored (time to target once timed '2 MB buckets' that were torch's default); refused now. Where
    the runner builds DDP itself (torch's hooks, or no optimizer) the size applies and is accepted."""
    for kwargs in (
        {"kind": "int8", "optimizer": "adamw"},
        {"kind": "none", "optimizer": "adamw"},
        {"kind": "int8", "parallel": "fsdp"},
    ):
        with pytest.raises(ValueError, match=r"bucket_cap_mb=2\.0 is for DDP the runner builds itself"):
            Spec("a", bucket_cap_mb=2.0, **kwargs)
    Spec("a", "int8", bucket_cap_mb=2.0)
    Spec("a", "torch_fp16", bucket_cap_mb=2.0, optimizer="adamw")


def test_a_muon_rows_exact_steps_are_timed_as_the_row_runs_them():
    """PowerSGD's exact warm-up behind Muon: the row itself before it compresses (every rank orthogonalizing every
    matrix, no all-gather), not fp32's Muon row, whose work split sends an all-gather beside the all-reduce."""
    from powertrain.bench.quality import PRESETS, _phases, select_rows

    (row,) = select_rows(["muon-r32"])[1:]  # after fp32
    exact, rest = _phases(PRESETS["muon"], row, 300)
    assert exact.until == PRESETS["muon"].start == 5 and rest.until is None
    assert exact.spec.kind == "powersgd" and exact.spec.optimizer == "muon"
    assert exact.spec.options["start_compressing_after_num_steps"] == timetotarget.EXACT_ONLY
    assert timetotarget._timed(exact.spec).options == exact.spec.options  # timed as given
    assert timetotarget._timed(rest.spec).options["start_compressing_after_num_steps"] == 0


def test_a_local_update_warm_up_is_a_fraction_of_each_horizon_trained_to_it_only():
    """The warm row's per-step warm-up is a quarter of whichever horizon it trains (its AdamW freezes there too); a run
    on to the target would spread its dense warm-up bytes over steps it did not take: refused, not guessed."""
    from powertrain.bench.quality import _spec

    (row,) = select_rows(["local-h5-warm"])[1:]
    assert not row.to_target
    for steps in (300, 1000):
        opts = _spec(row, steps, 5, None).optimizer_options
        cfg = TrainConfig(optimizer="adamw", compressor="none", steps=steps, parallel="diloco", **opts)  # the runner's
        assert cfg.sync_warmup == cfg.freeze_after == steps // 4
    with pytest.raises(ValueError, match="local-h5-warm: a local-update warm-up"):
        _spec(row, 300, 5, 2.0)
    with pytest.raises(ValueError, match="local-h5-warm: its warm-up is a fraction of the horizon, and 0 steps"):
        _spec(row, 0, 5, None)  # a spec at steps 0 would have no warm-up: the link times the phases apart


def test_a_local_update_warm_up_is_timed_in_its_phases():
    """The warm row on the link: its warm-up compressor's exact steps, its compressed steps (both averaged every step,
    after backward), then local updates; each phase's spec runs only that phase (a warm-up longer than the timing's
    rounds, or none), is one the runner builds, and ends where the horizon puts it."""
    from powertrain.bench.quality import PRESETS, WARMUP_ONLY, _phases

    (row,) = select_rows(["local-h5-warm"])[1:]
    for steps in (300, 1000):
        exact, warm, local = _phases(PRESETS["local"], row, steps)
        assert (exact.until, warm.until, local.until) == (5, steps // 4, None)
    for phase, start in ((exact, timetotarget.EXACT_ONLY), (warm, 0)):
        o = phase.spec.optimizer_options
        assert o["sync_warmup"] == WARMUP_ONLY and o["sync_every"] == 5 and o["adam_freeze"] == 0.25
        assert o["warmup_compressor"] == (
            f"powersgd:rank=32,variant=paper,factor_dtype=bf16,start_compressing_after_num_steps={start}"
        )
    assert "sync_warmup" not in local.spec.optimizer_options and "warmup_compressor" not in local.spec.optimizer_options
    assert local.spec.kind == "int4" and local.spec.parallel == "diloco" and local.spec.steps == 0
    # timed per step, as a per-step configuration is (whatever its H): every timed round is a warm-up step
    for rate in (1.0, 100.0):
        assert timetotarget._timing(warm.spec, rate) == timetotarget._timing(Spec("x", "none"), rate)
    h50 = dataclasses.replace(warm.spec, optimizer_options={**warm.spec.optimizer_options, "sync_every": 50})
    assert max(t.warmup + t.timed for t in (timetotarget._timing(h50, r) for r in (1.0, 100.0))) < WARMUP_ONLY
    assert timetotarget._timing(local.spec, 100.0) == timetotarget.Timing(5, 10)  # local steps: whole periods
    for phase in (exact, warm, local):  # as the runner builds them (its TrainConfig; steps: the command's default)
        TrainConfig(optimizer="adamw", compressor="none", parallel="diloco", **phase.spec.optimizer_options)
    for compressor in ("bf16", "none"):  # no exact steps of its own: the warm-up, then local updates
        plain = dataclasses.replace(row, optimizer_options={**row.optimizer_options, "warmup_compressor": compressor})
        first, then = _phases(PRESETS["local"], plain, 300)
        assert (first.until, first.spec.optimizer_options["warmup_compressor"], then.until) == (75, compressor, None)
        TrainConfig(optimizer="adamw", compressor="none", parallel="diloco", **first.spec.optimizer_options)
    seconds = {timetotarget.timing_key(ph.spec): t for ph, t in ((exact, 10.0), (warm, 2.0), (local, 1.0))}
    # 1,000 steps (the loop's last): 5 exact steps, 245 more of the warm-up, then local updates
    assert timetotarget.seconds_to(300, [exact, warm, local], seconds) == 5 * 10.0 + 245 * 2.0 + 50 * 1.0


@pytest.mark.timeout(240)
def test_a_warm_up_phase_spec_averages_every_step_and_the_local_one_syncs():
    """The phases' specs run what they are timed for (loopback, a tiny GPT, a rank-2 warm-up compressor that
    compresses there): the exact phase sends the whole gradient every step, the compressed phase PowerSGD's factors
    every step, the local phase one int4 sync per 5 steps."""
    from powertrain.bench.quality import _phases
    from powertrain.bench.sidebyside import side_by_side

    p = PRESETS["tiny"]
    (warm_row,) = select_rows(["local-h5-warm"])[1:]
    row = dataclasses.replace(
        warm_row, optimizer_options={**warm_row.optimizer_options, "warmup_compressor": "powersgd:rank=2"}
    )
    phases = _phases(p, row, 100)
    results, _ = side_by_side(
        [ph.spec for ph in phases], model=p.model, batch=p.batch, warmup=0, timed=5, start=p.start, data_mb=0.5
    )
    exact, warm, local = (sum(r.first.sent_per_step.values()) for r in results)
    dense = 4.0 * GPT(p.model).num_params()
    assert exact == pytest.approx(dense, rel=1e-6)  # fp32, every parameter, every step
    assert 0 < warm < dense / 2 and 0 < local < warm / 2


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


def test_horizon_only_runs_no_row_on_to_the_target(tmp_path, monkeypatch):
    """--horizon-only: every row but fp32 (which sets the target) trains its horizon only: its spec has no extra
    steps and no stopping loss."""
    seen: list[tuple[str, bool, int, object]] = []

    class Stop(Exception):
        pass

    def recording(p, rows, steps, seed, target):
        if rows[0].key == quality.FP32.key:  # fp32 first: pretend it ran (its curve sets the target)
            return [{"curve": [[steps, 2.0]]} for _ in rows]
        for r in rows:
            spec = quality._spec(r, steps, p.start, target if r.to_target else None)
            seen.append((r.key, r.to_target, spec.extra_steps, spec.stop_below))
        raise Stop

    monkeypatch.setattr(quality, "_launch", recording)
    monkeypatch.setattr(quality, "_measured", lambda row, res, p, model: {**res, "row": row.key})
    monkeypatch.setattr(quality._Kept, "put", lambda self, steps, seed, row, m: None)
    monkeypatch.setattr(
        quality._Kept,
        "get",
        lambda self, steps, seed, row, target: {"curve": [[steps, 2.0]]} if row.key == quality.FP32.key else None,
    )
    with pytest.raises(Stop):
        run_quality_bench(preset="tiny", rows=["int4"], rates=[], out=str(tmp_path), write="", horizon_only=True)
    assert seen == [("int4", False, 0, None)]
    seen.clear()
    with pytest.raises(Stop):
        run_quality_bench(preset="tiny", rows=["int4"], rates=[], out=str(tmp_path), write="")
    assert seen and seen[0][:2] == ("int4", True) and seen[0][2] > 0 and seen[0][3] is not None
    # a preset's horizon_only_at does the same at those horizons only (the local preset's 1,000 steps)
    seen.clear()
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], horizon_only_at=(8,)))
    with pytest.raises(Stop):
        run_quality_bench(preset="tiny", rows=["int4"], rates=[], out=str(tmp_path), write="")
    assert seen == [("int4", False, 0, None)]
    local = PRESETS["local"]
    chosen = select_rows(local.rows)
    at300, at1000 = quality.rows_at(local, chosen, 300), quality.rows_at(local, chosen, 1000)
    assert [(r.key, r.to_target) for r in at1000] == [("fp32", True), ("bf16", False), ("local", False)]
    assert [r.key for r in at300] == [r.key for r in chosen] and [r.to_target for r in at300] == [
        r.to_target for r in chosen
    ]
    assert any(r.to_target for r in at300[1:])  # the rows that run on to the target at 300 still do


def test_kept_results_larger_than_they_can_be_are_refused_before_reading(tmp_path, monkeypatch):
    """A file in a reused --out that is larger than any kept result (or not a regular file) is refused in one line
    naming it, before it is read: the bench's kept rows and link timings alike."""
    from powertrain._files import FileTooLarge

    p = PRESETS["tiny"]
    row = select_rows(["int4"])[1]
    path = tmp_path / "tiny" / "h8" / "s0" / "int4.json"
    path.parent.mkdir(parents=True)
    path.write_text(" " * 100 + "{}")
    monkeypatch.setattr(timetotarget, "KEPT_LIMIT", 64)
    with pytest.raises(FileTooLarge, match=r"Kept quality result '.*int4\.json' is 102 bytes, more than the 64"):
        quality._Kept(tmp_path / "tiny", p).get(8, 0, row, None)
    link = tmp_path / "linktime.json"
    os.mkfifo(link)  # a pipe would block a plain read
    with pytest.raises(FileTooLarge, match=r"Kept link timings .* is not a regular file"):
        timetotarget.measure([], [1.0], model=p.model, batch=p.batch, data_mb=p.data_mb, kept=link)


def test_the_text_says_which_horizons_ran_no_row_on_to_the_target():
    """A horizon whose rows trained it only (horizon_only_at) is named as such; the others run on to the target."""
    from powertrain.bench.quality_text import markdown

    def row(key: str, to_target: bool) -> dict:
        return {
            "key": key,
            "label": key,
            "to_target": to_target,
            "hits": [None],
            "fraction": 0.5,
            "val_mean": 2.0,
            "val_min": 2.0,
            "val_max": 2.0,
        }

    p = dataclasses.replace(PRESETS["tiny"], rates=())
    horizon = [
        {"steps": 8, "target": 2.02, "rows": [row("fp32", True), row("int4", True)]},
        {"steps": 16, "target": 2.02, "rows": [row("fp32", True), row("int4", False)]},
    ]
    report = {"preset": "tiny", "params": 1000, "link_s": {}, "horizons": horizon}
    text = markdown(report, p, 1, CAP)
    assert f"until they reach it (at most {CAP}x the horizon); at 16 steps every row trained its horizon only" in text
    assert "| int4 | 2.0000 (2.0000-2.0000) | +0.00% | 1/2.0 | not within 16 |" in text  # not CAP x 16
    report["horizons"] = horizon[1:]
    assert "every row trained its horizon only (`--horizon-only`)" in markdown(report, p, 1, CAP)
    report["horizons"] = horizon[:1]
    assert "horizon only" not in markdown(report, p, 1, CAP)


#: preset -> the rows its rows_at names that are not among its rows: they run at that horizon only when asked for
ASKED_ONLY = {"local": {"fp32-frozen", "local-h5-warm"}}  # issue 48's 1,000-step AdamW gap


def test_every_preset_names_known_rows():
    """A preset's rows, its baseline (which sets the target) and its per-horizon rows are rows that exist, and some of
    the baseline's rows run at every horizon (the target needs one; the report names those that ran)."""
    for name, p in PRESETS.items():
        chosen = {r.key for r in quality.select_rows(p.rows)}
        assert set(p.baseline) <= chosen, (name, p.baseline)
        for steps, keys in p.rows_at.items():
            quality.select_rows(keys)  # raises ValueError on a row that does not exist
            # a row of the preset, or one of the few that run there only when asked for (--rows)
            assert set(keys) <= chosen | ASKED_ONLY.get(name, set()), (name, steps, keys)
            here = {r.key for r in quality.rows_at(p, quality.select_rows(p.rows), steps)}
            assert set(p.baseline) & here, (name, steps)
    muon = PRESETS["muon"]
    assert muon.target == 1.0 and len(muon.baseline) >= 4  # a swept AdamW, its best loss itself the target


def test_a_presets_recipe_trains_every_row_fp32_included(tmp_path, monkeypatch):
    """outer-const's constant-rate AdamW reaches the spec of fp32 (which sets the target) and of every other row,
    whose own options (the outer step, Muon's rate) are kept beside it."""
    recipe = quality.PRESETS["outer-const"].recipe
    seen: dict[str, dict] = {}

    class Stop(Exception):
        pass

    def recording(p, rows, steps, seed, target):
        seen.update({r.key: quality._spec(r, steps, p.start, None).optimizer_options for r in rows})
        if rows[0].key == quality.FP32.key:
            return [{"curve": [[steps, 2.0]]} for _ in rows]
        raise Stop

    monkeypatch.setattr(quality, "_launch", recording)
    monkeypatch.setattr(quality, "_measured", lambda row, res, p, model: res)
    monkeypatch.setattr(quality._Kept, "put", lambda self, steps, seed, row, m: None)
    monkeypatch.setattr(
        quality._Kept,
        "get",
        lambda self, steps, seed, row, target: {"curve": [[steps, 2.0]]} if row.key in seen else None,
    )
    with pytest.raises(Stop):
        run_quality_bench(
            preset="outer-const", rows=["muon-outer-1-0.5"], seeds=1, rates=[], out=str(tmp_path), write=""
        )
    assert seen["fp32"] == recipe
    # kept results: a recipe tells rows apart through their options, and the presets without one keep the identity
    # their results were kept under before recipes existed
    const, held = (quality.PRESETS[n] for n in ("outer-const", "outer"))
    with_recipe = dataclasses.replace(quality.FP32, optimizer_options=recipe)
    assert quality._identity(with_recipe, const) != quality._identity(quality.FP32, held)
    assert "recipe" not in quality._identity(quality.FP32, quality.PRESETS["default"])["preset"]
    assert seen["muon-outer-1-0.5"] == {
        **recipe,
        "sync_every": 25,
        "outer_lr": 1.0,
        "outer_momentum": 0.5,
        "muon_lr": 0.04,
    }


def test_every_quality_preset_can_be_named_on_the_command_line():
    """The command's --preset choices name every workload of bench quality (the list is written out in the CLI so
    that parsing arguments imports no torch)."""
    from powertrain.bench.cli import QUALITY_ONLY

    assert set(quality.PRESETS) == {"default", "tiny", *QUALITY_ONLY}
