"""``python tools/bench_optimizers.py``: the side-by-side runner's schedule, the equal-wall-clock budget, and one
tiny end-to-end run of every part (the full default run is a benchmark, not a test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_optimizers import best_lr, budgeted_steps
from dist_utils import run_ranks
from powertrain.bench.sidebyside import Spec
from powertrain.train.config import TrainConfig
from powertrain.train.optimizers import lr_factor


def test_budgeted_steps():
    assert budgeted_steps(200, 1.08) == 185  # floor: never more time than AdamW's
    assert budgeted_steps(200, 0.5) == 400 and budgeted_steps(3, 10.0) == 1
    with pytest.raises(ValueError, match="ratio 0 must be positive"):
        budgeted_steps(200, 0)


def test_torch_threads_are_given_back():
    """A part timed in the calling process sets its thread count and gives the caller's back, also when it fails."""
    from powertrain.bench.rounds import torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)

        @torch_threads(1)
        def part() -> int:
            return torch.get_num_threads()

        assert part() == 1 and torch.get_num_threads() == 3
        assert part() == 1 and torch.get_num_threads() == 3  # a decorator holds for every call
        with pytest.raises(RuntimeError, match="inside"), torch_threads(2):
            assert torch.get_num_threads() == 2
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 3
        with torch_threads(None):
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_best_lr_is_the_lowest_validation_loss():
    rows = [{"lr": 5e-4, "val_loss": 2.4}, {"lr": 1e-3, "val_loss": 2.3}, {"lr": 2e-3, "val_loss": 2.35}]
    assert best_lr(rows) == 1e-3


def test_spec_steps_refused_without_an_optimizer():
    with pytest.raises(ValueError, match="steps=-1"):
        Spec("x", "none", optimizer="adamw", steps=-1)
    with pytest.raises(ValueError, match="only with an optimizer"):
        Spec("x", "none", steps=5)


def _scheduled_lrs(rank: int, world: int) -> list[float]:
    from powertrain.bench.sidebyside import _Run
    from powertrain.models import GPT, GPTConfig

    spec = Spec(
        "AdamW",
        "none",
        optimizer="adamw",
        steps=5,
        optimizer_options={"lr": 1e-2, "warmup_steps": 2, "min_lr_ratio": 0.1},
    )
    torch.manual_seed(0)
    run = _Run(spec, GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=16)), 0, 25.0)
    x, y = torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8))
    lrs = []
    for _ in range(5):
        lrs.append(run.opt.param_groups[0]["lr"])
        run.step(x, y)
    return lrs


def test_a_run_with_steps_follows_the_train_schedule():
    lrs = run_ranks(_scheduled_lrs, 1, timeout=60)[0]
    cfg = TrainConfig(steps=5, warmup_steps=2, min_lr_ratio=0.1)
    # Bitwise: LambdaLR computes base_lr * lr_factor(step), the same Python float operations as here (IEEE
    # doubles, correctly rounded on every machine); 1e-2 * 0.5 and 1e-2 * 1.0 are exact scalings.
    assert lrs == [1e-2 * lr_factor(s, cfg) for s in range(5)]
    assert lrs[0] == 5e-3 and lrs[1] == 1e-2 and lrs[-1] < lrs[2]


@pytest.mark.timeout(300)
def test_optimizers_bench_end_to_end_tiny(tmp_path):
    from bench_optimizers import PRESETS, run_optimizers_bench

    target = tmp_path / "B.md"
    before = torch.get_num_threads()
    try:  # the scaling part's one worker and the GaLore part run in this process: its thread count is given back
        torch.set_num_threads(2)
        report = run_optimizers_bench(preset="tiny", write=str(target))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    text = target.read_text()
    assert "<!-- bench:optimizers-tiny -->" in text and "At equal wall-clock" in text
    assert [s["world"] for s in report["scaling"]] == [1, 2, 4]
    assert all(s["vectors_s"] > 0 and s["vectors_ratio"] > 0 for s in report["scaling"])
    assert "1-D preconditioned / AdamW" in text
    assert "Shampoo side by side" not in text  # without a clone of the reference, no part against it
    grid = PRESETS["tiny"].lr_grid
    sweep = report["lr_sweep"]
    assert [(r["optimizer"], r["lr"]) for r in sweep["rows"]] == [(o, lr) for lr in grid for o in ("adamw", "shampoo")]
    assert sweep["best"]["adamw"] in grid and sweep["best"]["shampoo"] in grid
    assert f"lr {sweep['best']['adamw']:g}" in report["quality"]["rows"][0]["label"]
    q = report["quality"]
    steps = PRESETS["tiny"].quality_steps
    rows = q["rows"]
    assert [r["label"].split()[0] for r in rows] == ["AdamW", "Shampoo", "SOAP", "GaLore", "DeMo", "Shampoo"]
    # the last run sits out the rounds after the steps AdamW's time buys it
    assert [r["steps"] for r in rows] == [steps] * 5 + [budgeted_steps(steps, q["ratio"])]
    assert all(r["mean_s"] > 0 and r["val_loss"] > 0 for r in rows)
    long = report["long"]
    steps = PRESETS["tiny"].long_steps
    assert [r["label"].split()[0] for r in long["rows"]] == ["AdamW", "Shampoo", "Shampoo"]
    assert [r["steps"] for r in long["rows"]] == [steps, steps, budgeted_steps(steps, q["ratio"])]
    assert f"Longer horizon: AdamW and Shampoo, {steps} steps" in text and text.count("At equal wall-clock") == 2
    link = report["slow_link"]
    assert link["bytes_ratio"] > 1 and [r["label"].split()[0] for r in link["rows"]] == ["AdamW", "DeMo"]
    galore = {r["label"]: r for r in report["galore"]["rows"]}
    assert galore["powertrain GaLoreAdamW, randomized"]["projected_vs_adamw"] < 0 and "torch AdamW" in galore


def test_bench_muon_tiny_end_to_end(tmp_path):
    """``python tools/bench_muon.py --preset tiny``: every kind timed at 1 and 2 workers, the section written."""
    from bench_muon import run_muon_bench

    out = tmp_path / "BENCHMARKS.md"
    before = torch.get_num_threads()
    try:  # the one-worker row runs in this process, on one thread, and gives this process's count back
        torch.set_num_threads(2)
        report = run_muon_bench(preset="tiny", write=str(out))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert [r["world"] for r in report["rows"]] == [1, 2]
    for r in report["rows"]:
        assert all(r[f"{k}_s"] > 0 for k in ("split", "alone", "adamw", "forward_backward")), r
        assert 0 < r["split_share"] < 1 and r["split_over_alone"] > 0, r
    assert report["matrices"] == 4  # the tiny GPT's one block: qkv, proj, fc, fc_out
    assert "<!-- bench:muon-tiny -->" in out.read_text()


def test_a_suite_script_runs_as_main_from_another_directory(tmp_path):
    """``python tools/bench_muon.py --preset tiny`` started from a directory outside the checkout: its workers
    re-import the script as their main module, and ./BENCHMARKS.md there, where one exists, gets the section."""
    script = Path(__file__).resolve().parents[1] / "tools" / "bench_muon.py"
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    r = subprocess.run(
        [sys.executable, str(script), "--preset", "tiny"], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- bench:muon-tiny -->" in text and "`python tools/bench_muon.py --preset tiny`" in text
    (tmp_path / "BENCHMARKS.md").unlink()  # none here: printed only, and said so under the script's own name
    r = subprocess.run(
        [sys.executable, str(script), "--preset", "tiny"], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0 and "tools/bench_muon.py: no BENCHMARKS.md here" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "BENCHMARKS.md").exists() and "## Muon's optimizer step" in r.stdout
