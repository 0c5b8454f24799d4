"""tools/torchft_diloco.py: torchft's DiLoCo on powertrain's GPT and data, its parity with powertrain's diloco rows
(powertrain.bench.sidebyside) on a tiny GPT, and its timing beside them on the link.

Why the parity is bitwise at 2 replicas: both runs build the same seeded model, draw the same batches, take the same
AdamW steps on the same schedule and the same SGD outer steps, and evaluate with the same sums; they differ only in
how the pseudo-gradients a and b are averaged. torchft sums, then divides by the participants: fl(fl(a + b) / 2);
powertrain divides by the world size, then sums: fl(a / 2 + b / 2). Dividing by 2 is exact in binary floating point
(barring subnormals, 2^-126 and below), and rounding commutes with scaling by a power of two, so
fl(a / 2 + b / 2) = fl(a + b) / 2: the same bits (and a + b = b + a for gloo's two-rank sum). With more replicas the
sum's order inside gloo can differ between powertrain's one flat buffer and torchft's per-parameter all-reduces, and
only a tolerance would hold; these tests stay at 2.

torchft is not a dependency (``pip install torchft==0.2.0``): without it the runs are skipped, and the install hint is
checked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from powertrain.bench.netem import collective_seconds
from powertrain.bench.sidebyside import Spec, SpecResult, by_spec, launch_args, worker
from powertrain.models import GPT, GPTConfig
from powertrain.train.launch import launch
from torchft_diloco import TorchftResult, _combine, run_torchft

TOOLS = Path(__file__).resolve().parents[1] / "tools"  # where the comparison lives: a checkout's
HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None
needs_torchft = pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install torchft==0.2.0)")

TINY = GPTConfig(256, 32, 1, 2, 32)
RUN: dict[str, Any] = {"model": TINY, "batch": 2, "seed": 0, "data_mb": 0.5, "eval_every": 2, "timeout": 120}
#: label -> (steps, sync_every, fragments, outer_lr, outer_momentum)
ROWS = {"diloco": (6, 3, 1, 0.7, 0.9), "average": (6, 3, 1, 1.0, 0.0), "streaming": (8, 4, 2, 0.7, 0.9)}


def _torchft(label: str, **extra: Any) -> TorchftResult:
    steps, h, f, lr, momentum = ROWS[label]
    return run_torchft(**RUN, steps=steps, sync_every=h, fragments=f, outer_lr=lr, outer_momentum=momentum, **extra)


@pytest.fixture(scope="module")
def powertrain_rows() -> dict[str, SpecResult]:
    """The same rows as powertrain's diloco rows, side by side in one launch of 2 workers."""
    specs = [
        Spec(
            label,
            "none",
            steps=steps,
            optimizer="adamw",
            parallel="diloco",
            optimizer_options={"sync_every": h, "fragments": f, "outer_lr": lr, "outer_momentum": momentum},
        )
        for label, (steps, h, f, lr, momentum) in ROWS.items()
    ]
    rounds = max(s.steps for s in specs)
    args = launch_args(
        specs,
        model=TINY,
        batch=RUN["batch"],
        warmup=0,
        timed=rounds,
        start=0,
        eval_every=RUN["eval_every"],
        data_mb=RUN["data_mb"],
        seed=RUN["seed"],
    )
    return dict(zip(ROWS, by_spec(launch(worker, 2, args)), strict=True))


@pytest.fixture(scope="module")
def diloco() -> TorchftResult:
    return _torchft("diloco")


def test_importing_the_bench_does_not_import_torchft() -> None:
    code = "import sys, torchft_diloco; assert 'torchft' not in sys.modules, 'torchft was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=TOOLS)


def test_invalid_settings_are_named() -> None:
    with pytest.raises(ValueError, match="fragments=2 for sync_every=3"):
        run_torchft(**RUN, steps=6, sync_every=3, fragments=2)
    with pytest.raises(ValueError, match="world=1"):
        run_torchft(**RUN, steps=6, sync_every=3, world=1, rate_mbit=10.0)
    with pytest.raises(ValueError, match="sync_every=0"):
        run_torchft(**RUN, steps=6, sync_every=0)


def test_step_times_follow_the_slower_replica_between_meetings() -> None:
    """Replica A stalls at step 2, B at step 1, and they meet at step 2 (A arrives last: its hook is the sync alone):
    the steps up to there are A's, and the times add up to the run's (a per-step maximum would count both stalls)."""
    a = {
        "compute_s": [1.0, 5.0, 1.0, 1.0],
        "hook_s": [0.0, 0.5, 0.0, 0.3],
        "meets": [2, 4],
        "syncs": [[2, 8], [4, 8]],
        "evals": [[2, 10.0, 4], [4, 8.0, 4]],
    }
    b = {**a, "compute_s": [4.0, 1.0, 1.0, 1.0], "hook_s": [0.0, 1.5, 0.0, 0.2], "evals": [[2, 12.0, 4], [4, 8.0, 4]]}
    got = _combine([a, b], steps=4, period=2)
    assert got.step_times == [1.0, 5.5, 1.0, 1.2]
    assert got.val_curve == [(2, 22.0 / 8), (4, 2.0)] and got.val_loss == 2.0
    assert got.sync_steps == [2, 4] and got.bytes_per_sync == [8, 8]
    with pytest.raises(RuntimeError, match="committed 1 of 2 syncs"):
        _combine([{**a, "syncs": [[2, 8]]}, {**b, "syncs": [[2, 8]]}], steps=4, period=2)


@pytest.mark.skipif(HAVE_TORCHFT, reason="torchft is installed")
def test_without_torchft_says_how_to_install() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"pip install torchft==0\.2\.0"):
        _torchft("diloco")


@needs_torchft
@pytest.mark.timeout(240)
def test_tiny_run_on_loopback(diloco: TorchftResult, powertrain_rows: dict[str, SpecResult]) -> None:
    params = sum(p.numel() for p in GPT(TINY).parameters())
    assert diloco.sync_steps == [3, 6]
    assert diloco.bytes_per_sync == [4 * params] * 2, "fp32 pseudo-gradients of every parameter"
    assert [s for s, _ in diloco.val_curve] == [2, 4, 6]
    assert all(math.isfinite(v) and v < math.log(256) for _, v in diloco.val_curve), diloco.val_curve
    assert diloco.val_loss == diloco.val_curve[-1][1]
    assert len(diloco.step_times) == 6 and all(t > 0 for t in diloco.step_times)
    pt = powertrain_rows["diloco"].first  # Nesterov 0.7 / 0.9: bitwise too (see the module docstring)
    assert diloco.val_curve == pt.val_curve and diloco.val_loss == pt.val_loss


@needs_torchft
@pytest.mark.timeout(240)
def test_plain_averaging_matches_powertrain_bitwise(powertrain_rows: dict[str, SpecResult]) -> None:
    tf, pt = _torchft("average"), powertrain_rows["average"].first
    assert tf.val_curve == pt.val_curve and tf.val_loss == pt.val_loss


@needs_torchft
@pytest.mark.timeout(240)
def test_streaming_matches_powertrain_until_its_final_sync(powertrain_rows: dict[str, SpecResult]) -> None:
    """Two fragments, H=4: torchft syncs the same fragments at the same steps as powertrain (2, 4, 6, 8). At the end
    powertrain's rows synchronise every fragment once more (DiLoCo.finish); torchft has no such step."""
    tf, pt = _torchft("streaming"), powertrain_rows["streaming"].first
    params = [p.numel() for p in GPT(TINY).parameters()]
    assert tf.sync_steps == [2, 4, 6, 8]
    assert sum(tf.bytes_per_sync[:2]) == 4 * sum(params) and tf.bytes_per_sync[:2] == tf.bytes_per_sync[2:]
    assert tf.val_curve[:-1] == pt.val_curve[:-1]
    assert tf.val_curve[-1] != pt.val_curve[-1], "powertrain's final sync of the other fragment"


@needs_torchft
@pytest.mark.netem
@pytest.mark.timeout(240)
def test_emulated_link(diloco: TorchftResult) -> None:
    """On an emulated 2 Mbit/s link the run computes what it computes on loopback, and a sync step takes at least
    about the link's time for the bytes (tbf's burst lets a little through at once)."""
    rate = 2.0
    slow = _torchft("diloco", rate_mbit=rate)
    assert slow.val_curve == diloco.val_curve and slow.bytes_per_sync == diloco.bytes_per_sync
    link_s = collective_seconds("all_reduce", slow.bytes_per_sync[0], 2, rate)
    for step in slow.sync_steps:
        assert slow.step_times[step - 1] > 0.6 * link_s, (step, slow.step_times, link_s)


def test_torchft_is_timed_in_alternation_with_the_local_update_rows(tmp_path, monkeypatch):
    """torchft's DiLoCo and powertrain's local-update rows take turns on the link (torchft, then one launch of ours,
    TORCHFT_PAIRS times at a rate of timetotarget.SLOW or more, once below); the pairs are kept and reused, and the
    text gives each row's median and each pair's ratio to torchft's step."""
    import torchft_diloco
    from powertrain.bench import timetotarget
    from powertrain.bench.quality import PRESETS, select_rows

    calls: list[str] = []
    theirs = iter([0.7, 0.72, 0.69, 6.0])
    ours = iter([[0.8, 0.83], [0.79, 0.81], [0.9, 0.85], [2.0, 6.5]])

    def torchft_link(**kw):
        calls.append(f"torchft {kw['rate_mbit']:g} h{kw['sync_every']}")
        return next(theirs)

    def ours_link(specs, timings, **kw):
        assert [t.timed for t in timings] == [int(s.optimizer_options["sync_every"]) for s in specs]
        calls.append(f"ours {kw['rate']:g} " + ",".join(s.label for s in specs))
        return next(ours)

    monkeypatch.setattr(torchft_diloco, "link_seconds_per_step", torchft_link)
    monkeypatch.setattr(timetotarget, "seconds_per_step", ours_link)
    p = dataclasses.replace(PRESETS["local"], rates=(100.0, 1.0))
    rows = select_rows(["bf16", "local", "local-h5-warm", "diloco-paper"])  # the warm row is not timed on the link
    path = tmp_path / "torchft_link.json"
    got = torchft_diloco.link_pairs(p, rows, path)
    assert calls == ["torchft 100 h25", "ours 100 local,diloco-paper"] * torchft_diloco.TORCHFT_PAIRS + [
        "torchft 1 h25",
        "ours 1 local,diloco-paper",
    ]
    assert got["100.0"][1] == {"torchft": 0.72, "local": 0.79, "diloco-paper": 0.81} and len(got["1.0"]) == 1
    calls.clear()
    assert torchft_diloco.link_pairs(p, rows, path) == got and calls == []  # kept: nothing runs again
    text = torchft_diloco.pairs_text(got)
    assert "at 100 Mbit/s (median of 3 pairs) torchft 0.7 s, local 0.8 s (1.14/1.10/1.30x torchft's)" in text
    assert "at 1 Mbit/s (one pair) torchft 6 s, local 2 s (0.33x torchft's)" in text
    # without the paper row (the same H and outer step as torchft's) there is nothing to compare with
    assert torchft_diloco.link_pairs(p, select_rows(["local"]), path) == {} and calls == []


def test_the_command_publishes_its_own_section(tmp_path, monkeypatch, capsys):
    """``python tools/torchft_diloco.py``: without torchft it says how to install it (exit 2, nothing written); with it,
    the preset's pairs land in the section ``torchft-PRESET`` of --write, with the command that reproduces them."""
    import torchft_diloco
    from powertrain.bench import timetotarget

    out = tmp_path / "B.md"
    monkeypatch.setattr(torchft_diloco, "available", lambda: False)
    assert torchft_diloco.main(["--out", str(tmp_path), "--write", str(out)]) == 2
    assert "pip install torchft==0.2.0" in capsys.readouterr().err and not out.exists()
    monkeypatch.setattr(torchft_diloco, "available", lambda: True)
    monkeypatch.setattr(torchft_diloco.netem, "unavailable", lambda: None)  # the link is stubbed: no root needed
    monkeypatch.setattr(torchft_diloco, "link_seconds_per_step", lambda **kw: 1.0)
    monkeypatch.setattr(timetotarget, "seconds_per_step", lambda specs, timings, **kw: [0.5] * len(specs))
    out.write_text("# Benchmarks\n")
    assert torchft_diloco.main(["--preset", "local", "--out", str(tmp_path), "--write", str(out)]) == 0
    text = out.read_text()
    assert "<!-- bench:torchft-local -->" in text and "(2 replicas)" in text
    assert "local 0.5 s (0.50/0.50/0.50x torchft's)" in text
    assert "Command: `python tools/torchft_diloco.py --preset local`" in text
    assert (tmp_path / "local" / "torchft_link.json").is_file()


def test_losses_compare_torchft_and_powertrain_at_the_same_outer_step(tmp_path, monkeypatch):
    """``--losses``: torchft's DiLoCo is trained at the paper row's and at plain averaging's outer step on every seed
    of the preset's first horizon, beside powertrain's same rows and its default (the quality bench's kept results);
    the runs are kept and reused, and the section says each pair's loss, their largest per-seed difference, the bytes,
    and what powertrain's default adds."""
    import torchft_diloco
    from powertrain.bench import quality

    p = quality.PRESETS["local"]
    steps = p.horizons[0]
    calls: list[tuple[Any, ...]] = []

    def fake_torchft(**kw: Any) -> TorchftResult:
        calls.append((kw["outer_lr"], kw["outer_momentum"], kw["sync_every"], kw["seed"], kw["steps"], kw["world"]))
        loss = 2.0 + kw["outer_momentum"] + kw["seed"] / 100
        return TorchftResult([(steps, loss)], [], [400] * (steps // kw["sync_every"]), [], loss)

    def fake_quality_bench(**kw: Any) -> None:
        assert kw["horizons"] == (steps,) and kw["horizon_only"] and kw["rates"] == () and kw["write"] is None
        kept = quality._Kept(tmp_path / "torchft-loss" / "local", p)
        for row in quality.select_rows(kw["rows"])[1:]:
            row = dataclasses.replace(row, to_target=False)
            for seed in range(p.seeds):
                loss = 2.0 + row.optimizer_options["outer_momentum"] + seed / 100
                # the paper row's seed 2 differs by 1e-4; the default ends 0.02 higher on 1/96 of the bytes
                loss += {"diloco-paper": 1e-4 if seed == 2 else 0.0, "local": 0.02}.get(row.key, 0.0)
                sent = 50 if row.key == "local" else 4800
                measured = {"curve": [[steps, loss]], "steps_run": steps, "warm": 0, "dense": {}}
                kept.put(steps, seed, row, {**measured, "low": {"all_reduce": sent / steps}})

    monkeypatch.setattr(torchft_diloco, "available", lambda: True)
    monkeypatch.setattr(torchft_diloco, "installed_version", lambda: "0.2.0")
    monkeypatch.setattr(torchft_diloco, "run_torchft", fake_torchft)
    monkeypatch.setattr(quality, "run_quality_bench", fake_quality_bench)
    out = tmp_path / "B.md"
    argv = ["--losses", "--preset", "local", "--out", str(tmp_path), "--write", str(out)]
    assert torchft_diloco.main(argv) == 0
    assert sorted(calls) == [(0.7, 0.9, 25, s, steps, 2) for s in range(3)] + [
        (1.0, 0.0, 25, s, steps, 2) for s in range(3)
    ]
    text = out.read_text()
    assert "<!-- bench:torchft-loss-local -->" in text
    assert (
        "| H 25, lr 1, momentum 0 (h25-none) | 2.0100 (2.0000-2.0200) | 2.0100 (2.0000-2.0200) | 0 (the same bits) "
        "| 0.00 MB / 0.00 MB |" in text
    )
    assert (
        "| H 25, lr 0.7, momentum 0.9 (diloco-paper) | 2.9100 (2.9000-2.9200) | 2.9100 (2.9000-2.9201) | 0.0001 |"
        in text
    )
    assert "int4 outer with error feedback, outer lr 1, momentum 0), 2.0300 (2.0200-2.0400), +1.00% against" in text
    assert "for 1/96.0 of its bytes" in text
    assert "Command: `python tools/torchft_diloco.py --losses --preset local`" in text
    calls.clear()
    assert torchft_diloco.main(argv) == 0 and calls == []  # kept: nothing trains again
    assert not (tmp_path / "local").exists(), "the preset's own kept runs (trained to target) are left alone"
    monkeypatch.setattr(torchft_diloco, "installed_version", lambda: "0.3.0")
    assert torchft_diloco.main(argv) == 0 and len(calls) == 6  # another torchft: trained again
    # a non-finite loss is refused, wherever it is: it can never read as the same bits
    theirs = {k: [{"val_loss": 2.0, "bytes": 1.0}] for k in torchft_diloco.LOSS_ROWS}
    ours = {**theirs, "local": [{"val_loss": 2.0, "bytes": 1.0}]}
    for side in ("theirs", "ours"):
        bad = {k: [{"val_loss": float("nan"), "bytes": 1.0}] for k in torchft_diloco.LOSS_ROWS}
        args = (bad, ours) if side == "theirs" else (theirs, {**ours, **bad})
        with pytest.raises(ValueError, match="non-finite validation loss"):
            torchft_diloco.loss_text(steps, *args)
    assert "| 0 (the same bits) |" in torchft_diloco.loss_text(steps, theirs, ours)
    monkeypatch.setattr(quality, "run_quality_bench", lambda **kw: None)
    with pytest.raises(RuntimeError, match="has not kept 'diloco-paper' at 300 steps"):
        torchft_diloco.main([*argv[:-4], "--out", str(tmp_path / "empty"), "--write", str(out)])


def test_only_rows_torchft_runs_are_mirrored() -> None:
    import torchft_diloco
    from powertrain.bench import quality

    for key in ("local", "local-streaming", "bf16"):
        (row,) = quality.select_rows([key])[1:]
        with pytest.raises(ValueError, match=f"Row '{key}' is not one torchft's DiLoCo runs"):
            torchft_diloco._outer_step(row)


def test_the_command_refuses_one_replica_and_a_machine_without_namespaces(tmp_path, monkeypatch, capsys):
    """Each refusal names the value or the reason in one error line, exits 2 and writes nothing."""
    import torchft_diloco

    out = tmp_path / "B.md"
    with pytest.raises(SystemExit) as exit_:
        torchft_diloco.main(["--workers", "1", "--write", str(out)])
    assert exit_.value.code == 2 and "--workers 1: local updates need 2 or more replicas" in capsys.readouterr().err
    monkeypatch.setattr(torchft_diloco, "available", lambda: True)
    monkeypatch.setattr(torchft_diloco.netem, "unavailable", lambda: "not root")
    assert torchft_diloco.main(["--out", str(tmp_path), "--write", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tools/torchft_diloco.py times on an emulated link, which needs network namespaces: not root"
    assert not out.exists()


def test_kept_pairs_larger_than_they_can_be_are_refused_before_reading(tmp_path, monkeypatch):
    """A kept torchft_link.json larger than any kept result is refused in one line naming it, before it is read."""
    import torchft_diloco
    from powertrain._files import FileTooLarge
    from powertrain.bench import timetotarget
    from powertrain.bench.quality import PRESETS, select_rows

    path = tmp_path / "torchft_link.json"
    path.write_text(" " * 100 + "{}")
    monkeypatch.setattr(timetotarget, "KEPT_LIMIT", 64)
    with pytest.raises(
        FileTooLarge, match=r"Kept torchft timings '.*torchft_link\.json' is 102 bytes, more than the 64"
    ):
        torchft_diloco.link_pairs(PRESETS["local"], select_rows(["local", "diloco-paper"]), path)
