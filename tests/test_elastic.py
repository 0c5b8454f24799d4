"""The command under torch's own launcher, and elastic recovery: ``torchrun --max-restarts 1`` trains in the world
it is given (docs/multi-node.md, "Elastic restart"), restarts the workers after one is killed with SIGKILL mid-run,
and the unchanged ``powertrain train`` command continues from the latest complete checkpoint in its run directory and
ends on its own. The losses it logs equal those of the command's own launcher, uninterrupted, bitwise: the same two
processes, thread count, kernels and data order, and the restarted steps repeat the same operations on the same
bits (weights, optimizer, error feedback and data streams all come from the checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_utils import children, run_cli
from powertrain.train.cli import _continues_in_place
from powertrain.train.config import resolve, to_toml
from powertrain.train.launch import torchrun_shared_store

STEPS, EVERY = 120, 40
RUN = [
    "train",
    "--preset",
    "tiny",
    "--parallel",
    "ddp",
    "--quiet",
    "--steps",
    str(STEPS),
    "--checkpoint-every",
    str(EVERY),
]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_torchrun_restarts_a_killed_worker_and_the_run_continues_bitwise(tmp_path):
    ref = tmp_path / "ref"
    r = run_cli(*RUN, "--out", str(ref), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "elastic"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--max-restarts",
        "1",
        "-m",
        "powertrain",
        *RUN,
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        # kill one worker after the first checkpoint, between two checkpoints
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").is_file() or len(_rows(out)) <= EVERY + 3:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not reach its first checkpoint"
            time.sleep(0.05)
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        killed_at = len(_rows(out))
        out_text, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert killed_at < STEPS, f"the run ended before the kill (step {killed_at}): raise STEPS"
    assert proc.returncode == 0, err[-3000:]
    assert "continuing from the latest" in out_text, out_text[-2000:]  # the restart resumed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["parallel"] == "ddp"
    rows, expect = _rows(out), _rows(ref)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows] == [row["loss"] for row in expect]
    superseded = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded and all(row["step"] > EVERY for row in superseded)  # the steps the restart redid, kept


def test_a_restart_before_the_first_checkpoint_starts_over_and_other_settings_are_refused(tmp_path, monkeypatch):
    """What the command decides from the run directory alone (no workers): the same settings continue in place,
    from the start when torchrun restarts a run that had no checkpoint yet; a first attempt never takes over."""
    cfg = dataclasses.replace(resolve("tiny", None, {}), out=str(tmp_path))
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert _continues_in_place(cfg) is False  # not a restart: the directory is another run's
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _continues_in_place(cfg) == "start over"
    with pytest.raises(ValueError, match=r"other settings \(weight_decay=0.1 -> 0.5\)"):
        _continues_in_place(dataclasses.replace(cfg, weight_decay=0.5))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
    assert _continues_in_place(cfg) == "checkpoint"


def test_where_torchrun_shares_its_store(monkeypatch):
    """One node: restarted workers key a namespace by the restart count. Across nodes: the command warns."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert torchrun_shared_store() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert torchrun_shared_store() == "one node"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert torchrun_shared_store() == "nodes"
