"""The run directory's plots (powertrain.train.metrics.RunWriter): every step's training loss, not only the
logged ones, a moving average over it, and the validation points."""

from __future__ import annotations

import pytest

from powertrain.train.metrics import RunWriter, _ema


def _train(writer: RunWriter, steps: range, log_every: int) -> None:
    for step in steps:
        loss = 5.0 / step
        writer.every_step(step, loss, wall_s=0.1 * step, bytes_total=1e6 * step)
        if step % log_every == 0:
            writer.log({"step": step, "loss": loss, "wall_s": 0.1 * step, "bytes_total": 1e6 * step,
                        **({"val_loss": 6.0 / step} if step % (2 * log_every) == 0 else {})})  # fmt: skip


def test_the_plots_show_every_step_a_smoothed_line_and_the_validation(tmp_path):
    pytest.importorskip("matplotlib")
    writer = RunWriter(tmp_path, resume_step=None)
    _train(writer, range(1, 61), log_every=25)
    train, smooth, val = writer.series()
    assert [t[0] for t in train] == list(range(1, 61))  # the first 25 steps' drop included
    assert [t[1] for t in train] == [5.0 / s for s in range(1, 61)] and len(smooth) == 60
    assert [(v[0], v[3]) for v in val] == [(50, 6.0 / 50)]
    assert [p.name for p in writer.plot()] == ["loss_vs_step.png", "loss_vs_wallclock.png", "loss_vs_bytes.png"]
    assert all(p.stat().st_size > 1000 for p in writer.plot())

    # resumed after step 50: the logged rows before it, then every step of this process
    again = RunWriter(tmp_path, resume_step=50)
    _train(again, range(51, 61), log_every=25)
    train, _, val = again.series()
    assert [t[0] for t in train] == [25, 50, *range(51, 61)] and [v[0] for v in val] == [50]


def test_the_moving_average_is_bias_corrected():
    assert _ema([2.0, 2.0, 2.0], span=9) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    assert _ema([0.0, 1.0], span=1) == [0.0, 1.0]  # span 1: no smoothing
    out = _ema([0.0, 10.0], span=3)  # alpha 1/2: (0.5 * 10) / (1 - 0.25)
    assert out == pytest.approx([0.0, 10.0 * 0.5 / 0.75])
