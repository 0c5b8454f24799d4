"""Divergence is never success, and every JSON file powertrain writes is strict JSON (issue 35, item 2)."""

from __future__ import annotations

import ast
import json
import math
import types
from pathlib import Path

import pytest
import torch

from cli_utils import run_cli
from powertrain import _json
from powertrain.comm import Communicator
from powertrain.train.config import resolve
from powertrain.train.loop import _check_weights

ROOT = Path(__file__).resolve().parents[1]


def _strict(text: str) -> object:
    """json.loads that refuses NaN and Infinity, as strict parsers (JavaScript's, Go's, jq's) do."""

    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _lines(text: str) -> list[str]:
    """stderr's lines less Python's warnings (a warning and the source line under it)."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith(" ") and "Warning" not in line]


def test_nan_validation_loss_fails_the_run_and_summary_is_strict_json(tmp_path):
    out = tmp_path / "run"
    r = run_cli(
        "train",
        "--preset",
        "tiny",
        "--nproc",
        "1",
        "--steps",
        "1",
        "--lr",
        "1e30",
        "--compressor",
        "none",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        "--quiet",
    )
    assert r.returncode == 1, r.stderr[-2000:]
    lines = _lines(r.stderr)
    assert len(lines) == 1, r.stderr[-2000:]
    assert "training stopped at step 1: validation loss nan" in lines[0] and "no good checkpoint" in lines[0], lines
    summary = _strict((out / "summary.json").read_text())
    assert isinstance(summary, dict)
    assert summary["status"] == "diverged" and summary["stopped"] in lines[0], summary
    assert summary["val_loss"] is None and summary["non_finite"] == {"val_loss": "nan"}, summary
    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_loss"] is None and rows[-1]["non_finite"] == {"val_loss": "nan"}, rows  # type: ignore[index]
    assert not (out / "checkpoints").exists()  # its weights gave NaN: never saved as a checkpoint


def test_divergence_after_a_checkpoint_names_it(tmp_path):
    """AdamW at lr 1e30: step 1 is finite, step 2's gradient is not; the line names step 1's checkpoint."""
    out = tmp_path / "run"
    r = run_cli(
        "train",
        "--preset",
        "tiny",
        "--nproc",
        "1",
        "--steps",
        "3",
        "--lr",
        "1e30",
        "--compressor",
        "none",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        "--quiet",
    )
    assert r.returncode == 1, r.stderr[-2000:]
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "training stopped at step 2: " in lines[0], r.stderr[-2000:]
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_00000001'}" in lines[0], lines
    summary = _strict((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps_done"] == 1, summary  # type: ignore[index]


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    cfg = resolve("tiny", None, {"out": str(tmp_path), "checkpoint_every": 1})
    model = torch.nn.Linear(3, 2)
    run = types.SimpleNamespace(model=model, device=torch.device("cpu"), metrics=Communicator(), out=tmp_path, cfg=cfg)
    _check_weights(run, 4)  # type: ignore[arg-type]  # finite: passes
    with torch.no_grad():
        model.bias[1] = math.inf
    with pytest.raises(FloatingPointError, match="training stopped at step 5: non-finite weights after the update"):
        _check_weights(run, 4)  # type: ignore[arg-type]


def test_strict_json_round_trip():
    obj = {"a": math.nan, "b": [1.0, [math.inf, 2.0]], "c": {"d": -math.inf}, "e": "nan", "f": None}
    text = _json.dumps(obj)
    strict = _strict(text)
    assert strict == {
        "a": None,
        "b": [1.0, [None, 2.0]],
        "c": {"d": None, "non_finite": {"d": "-inf"}},
        "e": "nan",
        "f": None,
        "non_finite": {"a": "nan", "b[1][0]": "inf"},
    }
    back = _json.loads(text)
    assert math.isnan(back["a"]) and back["b"] == [1.0, [math.inf, 2.0]] and back["c"] == {"d": -math.inf}
    assert back["e"] == "nan" and back["f"] is None and "non_finite" not in back


def _writes_json(call: ast.Call) -> bool:
    """``X.write_text(... json.dumps(...) ...)``, ``X.write(...)``, ``write_atomic(...)`` or ``json.dump(...)``."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name == "dump" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "json":
        return True
    if name not in ("write_text", "write", "write_atomic", "write_bytes"):
        return False
    calls = [n.func for n in ast.walk(call) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return any(f.attr == "dumps" and isinstance(f.value, ast.Name) and f.value.id == "json" for f in calls)


def test_every_json_file_is_written_through_the_strict_writer():
    """json.dump/json.dumps write NaN as a bare token: a file is written with powertrain._json.dumps instead."""
    for bad in ("p.write_text(json.dumps(x) + '\\n')", "write_atomic(p, json.dumps(x))", "json.dump(x, f)"):
        assert _writes_json(ast.parse(bad).body[0].value), bad  # type: ignore[attr-defined]  # the scan sees them
    assert not _writes_json(ast.parse("p.write_text(_json.dumps(x))").body[0].value)  # type: ignore[attr-defined]
    found = []
    for path in sorted([*ROOT.glob("src/**/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("examples/*.py")]):
        tree = ast.parse(path.read_text())
        found += [
            f"{path.relative_to(ROOT)}:{n.lineno}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _writes_json(n)
        ]
    assert not found, f"JSON written without powertrain._json.dumps: {found}"
