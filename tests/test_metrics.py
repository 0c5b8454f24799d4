"""What a run shows (powertrain.train.metrics): plots of every step's training loss, not only the logged ones, a
moving average over it and the validation points; the progress display on a terminal and in a log."""

from __future__ import annotations

import io
import os
import shutil
import time

import pytest

from powertrain.train.metrics import Progress, RunWriter, _clock, _ema


def _train(writer: RunWriter, steps: range, log_every: int) -> None:
    for step in steps:
        loss = 5.0 / step
        writer.every_step(step, loss, wall_s=0.1 * step, bytes_total=1e6 * step)
        if step % log_every == 0:
            writer.log(
                {
                    "step": step,
                    "loss": loss,
                    "wall_s": 0.1 * step,
                    "bytes_total": 1e6 * step,
                    **({"val_loss": 6.0 / step} if step % (2 * log_every) == 0 else {}),
                }
            )


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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line_every_step_with_a_bar_rate_and_time_left(monkeypatch):
    clock = iter(float(t) for t in range(1000))  # one second per call: every step is due for a redraw
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(120, 24): os.terminal_size((160, 24)))
    out = _Terminal()
    progress = Progress(10, quiet=False, stream=out, start=4)  # resumed after step 4
    for step in range(5, 11):
        progress.update(step, 2.0, 1234.0, "tok", 0.5, 2.0, logged=step == 10)
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 6 and out.getvalue().endswith("\n") and "\n" not in "".join(frames[:-1])
    assert frames[0].startswith("[" + "#" * 10 + "." * 10 + "] 5/10") and "1,234 tok/s" in frames[0]
    assert "4.0x less" in frames[0] and "\x1b[K" in frames[0]
    # the time left from this process's own steps: 1 s per step here, 5 steps left after step 5
    assert "0:05 left" in frames[0] and frames[-1].startswith("[" + "#" * 20 + "] 10/10")


def test_progress_throttles_on_a_terminal_and_writes_logged_steps_only_elsewhere(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # no time passes: only logged steps and the last draw
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        progress = Progress(100, quiet=False, stream=stream)
        for step in range(1, 101):
            progress.update(step, 1.0, 10.0, "tok", 1.0, 1.0, logged=step % 25 == 0)
    assert tty.getvalue().count("\r") == 5  # the first step at once, then steps 25, 50, 75, 100
    assert [line.split()[1] for line in log.getvalue().splitlines()] == ["25/100", "50/100", "75/100", "100/100"]


def test_clock():
    assert [_clock(s) for s in (0, 59.4, 61, 3600, 3725)] == ["0:00", "0:59", "1:01", "1:00:00", "1:02:05"]


def test_a_narrow_terminal_gets_the_line_cut_not_wrapped(monkeypatch):
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(120, 24): os.terminal_size((40, 24)))
    out = _Terminal()
    Progress(10, quiet=False, stream=out).update(1, 2.0, 1.0, "tok", 1.0, 1.0)
    assert out.getvalue() == "\r" + "[##" + "." * 18 + "] 1/10  loss 2.000" + "\x1b[K"
