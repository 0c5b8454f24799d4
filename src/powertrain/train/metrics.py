"""What a run writes: config.toml, metrics.jsonl, summary.json, TensorBoard events, PNG plots, progress.

Only rank 0 writes. ``metrics.jsonl`` has one JSON object per logged step with ``step``, ``loss`` (mean over
ranks), ``lr``, ``step_time_s``, ``compute_s`` (forward + backward; under DDP/FSDP this includes the
communication that overlaps backward), ``comm_s`` (time blocked in synchronous collectives), ``compress_s``
(compressor math), ``bytes_sent`` (payload bytes this rank sent in the step) and ``bytes_uncompressed`` (what
a plain fp32 all-reduce of the gradients sends), plus ``val_loss`` where a validation ran. ``comm_s``,
``compress_s`` and ``bytes_sent`` add up the gradients' communication and the optimizer's own (Shampoo's and
DeMo's all-gathers, DeMo's compression, GaLore's refresh).
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from powertrain import _json
from powertrain._files import quote, write_atomic


class Progress:
    """Training progress. On a terminal: one line rewritten in place at every step, at most ``REFRESH_S`` apart
    (a bar, step, loss, throughput, bytes per step against an fp32 all-reduce's, time left). Elsewhere (a log file,
    a pipe): a plain line per logged step."""

    REFRESH_S = 0.1

    def __init__(self, total: int, *, quiet: bool, stream: TextIO = sys.stdout, start: int = 0) -> None:
        self.total, self.quiet, self.stream, self.start = total, quiet, stream, start
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self._drawn = -math.inf

    def update(
        self, step: int, loss: float, rate: float, unit: str, mb: float, dense_mb: float, *, logged: bool = True
    ) -> None:
        """Step ``step`` is done (``logged``: a step metrics.jsonl records)."""
        if self.quiet or not (self.tty or logged):
            return
        now = time.perf_counter()
        if self.tty and not logged and step != self.total and now - self._drawn < self.REFRESH_S:
            return
        self._drawn = now
        # the time left from this process's own steps (a resumed run did the others earlier)
        eta = (now - self.t0) / max(step - self.start, 1) * (self.total - step)
        if mb <= 0:
            ratio = "  no comm"
        else:
            ratio = f"{dense_mb / mb:6.1f}x less" if mb <= dense_mb else f"{mb / max(dense_mb, 1e-12):6.1f}x more"
        if not self.tty:
            self.stream.write(
                f"step {step:5d}/{self.total}  loss {loss:.4f}  {rate:8.0f} {unit}/s  sent {mb:7.3f} MB/step "
                f"(all-reduce {dense_mb:.3f} MB, {ratio})  ETA {eta:5.0f}s\n"
            )
        else:
            filled = round(20 * step / self.total)
            line = (
                f"[{'#' * filled}{'.' * (20 - filled)}] {step}/{self.total}  loss {loss:.4f}  {rate:,.0f} {unit}/s"
                f"  {mb:.3f} MB/step ({ratio.strip()})  {_clock(eta)} left"
            )
            width = shutil.get_terminal_size((120, 24)).columns
            self.stream.write("\r" + line[: width - 1] + "\x1b[K" + ("\n" if step == self.total else ""))
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
        self.stream.write(text + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    """``seconds`` as h:mm:ss (m:ss under an hour)."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def supersede(out: Path, step: int) -> list[dict[str, Any]]:
    """Keep the rows of ``OUT/metrics.jsonl`` up to ``step`` and return them. Later rows belong to a trajectory
    that a resumed or restarted run replaces: they move to ``metrics.superseded.jsonl`` (appended), nothing is
    deleted."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    kept: list[dict[str, Any]] = []
    later = 0
    for line in _lines(path):  # the file may be another run's: its rows are checked and bounded one by one
        row = _row(line, path)
        if row["step"] > step:
            later += 1
        elif len(kept) < step:
            kept.append(row)
        else:
            raise ValueError(
                f"{str(path)!r} has more rows up to step {step} than steps: not this run's log; choose another --out"
            )
    if later:
        with (out / "metrics.superseded.jsonl").open("a") as f:
            f.writelines(line + "\n" for line in _lines(path) if _row(line, path)["step"] > step)
        write_atomic(path, "".join(_json.dumps(r) + "\n" for r in kept))
    return kept


#: The longest row metrics.jsonl holds (a row is ~400 bytes).
ROW_LIMIT = 64 << 10
#: What a bad metrics log's error tells to do: a run continued in place, and a bench reading a run it launched.
_RESUME = "choose another --out"
_BENCH = "a run the bench launched wrote it: a bug, please report it"
#: The largest summary.json read back (a run's is ~2 kB).
SUMMARY_LIMIT = 1 << 20


def read_run(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What a finished run left in ``out``: its summary (read within :data:`SUMMARY_LIMIT`) and its logged rows, each
    read within :data:`ROW_LIMIT`, at most one per step the summary says it took; for the benches that launch
    ``powertrain train`` and read its results."""
    summary = _json.load(out / "summary.json", SUMMARY_LIMIT, "Run summary")
    steps = summary.get("steps_done") if isinstance(summary, dict) else None
    if type(steps) is not int or steps < 0:
        raise ValueError(f"{str(out / 'summary.json')!r} has no steps_done count: not a finished run's summary")
    path = out / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    for line in _lines(path, _BENCH):
        if len(rows) == steps:
            raise ValueError(f"{str(path)!r} has more rows than the run's {steps} steps: not this run's log")
        rows.append(_row(line, path, _BENCH))
    return rows, summary


def _lines(path: Path, fix: str = _RESUME) -> Iterator[str]:
    """The non-empty lines of ``path``, read one at a time within :data:`ROW_LIMIT` bytes each."""
    with path.open("rb") as f:
        while raw := f.readline(ROW_LIMIT + 1):
            if len(raw) > ROW_LIMIT:
                raise ValueError(f"{str(path)!r} has a line longer than {ROW_LIMIT:,} bytes: not a metrics log; {fix}")
            if line := raw.decode(errors="replace").strip():
                yield line


def _row(line: str, path: Path, fix: str = _RESUME) -> dict[str, Any]:
    """One metrics row; ValueError in one line (quoting a short prefix) if it is not one."""
    try:
        row = _json.loads(line)
    except (ValueError, RecursionError):
        row = None
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        raise ValueError(f"{str(path)!r} holds {quote(line)}, not a metrics row; {fix}")
    return row


class RunWriter:
    """Files of one run directory (rank 0)."""

    def __init__(self, out: Path, *, resume_step: int | None, tensorboard: bool = False) -> None:
        self.out = out
        self.metrics_path = out / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        if self.metrics_path.exists():
            if resume_step is None:
                raise AssertionError(f"{self.metrics_path} exists: a new run must start in an empty directory")
            self.rows = supersede(out, resume_step)  # continue the same log
        else:
            self.metrics_path.touch()
        self.steps: list[tuple[int, float, float, float]] = []  # every step of this process: step, loss, wall, bytes
        self.tb = None
        if tensorboard:  # asked for: the command checked that tensorboard is installed
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))

    def every_step(self, step: int, loss: float, wall_s: float, bytes_total: float) -> None:
        """Every step's training loss, for the plots (metrics.jsonl keeps the logged steps only)."""
        self.steps.append((step, loss, wall_s, bytes_total))

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(_json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self.tb.add_scalar(key, value, row["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        write_atomic(self.out / "summary.json", _json.dumps(summary, indent=2) + "\n")
        if self.tb is not None:
            self.tb.close()
        self.plot()

    def series(
        self,
    ) -> tuple[list[tuple[int, float, float, float]], list[float], list[tuple[int, float, float, float]]]:
        """What the plots draw: the training loss of every step this process trained, after the logged rows of
        the steps before it (a resumed run), as (step, loss, wall_s, bytes_total); its moving average; and the
        validation points as (step, wall_s, bytes_total, val_loss)."""
        rows = [r for r in self.rows if "loss" in r]
        first = self.steps[0][0] if self.steps else math.inf
        train = [
            (r["step"], r["loss"], r.get("wall_s", 0.0), r.get("bytes_total", 0)) for r in rows if r["step"] < first
        ] + self.steps
        smooth = _ema([loss for _, loss, _, _ in train], span=max(1, len(train) // 25))
        val = [
            (r["step"], r.get("wall_s", 0.0), r.get("bytes_total", 0), r["val_loss"]) for r in rows if "val_loss" in r
        ]
        return train, smooth, val

    def plot(self) -> list[Path]:
        """loss vs step, vs wall-clock, vs bytes sent (PNG); skipped without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return []
        train, smooth, val = self.series()
        if not train:
            return []
        paths = []
        for name, axis, label in (
            ("loss_vs_step", 0, "step"),
            ("loss_vs_wallclock", 2, "wall-clock (s)"),
            ("loss_vs_bytes", 3, "MB sent per worker"),
        ):
            scale = 1e-6 if axis == 3 else 1.0  # cumulative gradient bytes per worker, in MB
            xs = [t[axis] * scale for t in train]
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(xs, [t[1] for t in train], color="tab:blue", alpha=0.25, linewidth=0.8, label="train (every step)")
            ax.plot(xs, smooth, color="tab:blue", label="train (smoothed)")
            if val:
                vx = [v[{0: 0, 2: 1, 3: 2}[axis]] * scale for v in val]
                ax.plot(vx, [v[3] for v in val], "o-", color="tab:orange", label="validation")
            ax.set_xlabel(label)
            ax.set_ylabel("loss")
            ax.legend()
            ax.grid(alpha=0.3)
            fig.tight_layout()
            path = self.out / f"{name}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
        return paths


def _ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average with pandas' ``span`` convention (alpha = 2 / (span + 1)), bias-corrected."""
    alpha, avg, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out
