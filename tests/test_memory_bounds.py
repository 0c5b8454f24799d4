"""No file a user may be handed can exhaust memory (issue 35, item 1): every read is bounded by a size checked
before it, container formats are parsed by the rules their consumer uses, and errors quote at most a short prefix.

Each refusal runs in a child of a fresh Python, which reports the child's peak RSS (``ru_maxrss`` of its
children): the bound, 600 MB, is well above a refused resume's (~300 MB: torch imported) and far below what the
files would take if read (2 GB sparse files, 0 bytes on disk; a 1.5 GB bytearray).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from powertrain._files import FileTooLarge, quote, read_bounded
from powertrain.serialize import UnsafeData, check_torch_pickle

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"  # the GPU check's modules, run from a checkout
SPARSE = 2 << 30  # 2 GiB, none of it on disk
PEAK_MB = 600

_PROBE = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(r.stderr)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _refusal(*cmd: str) -> tuple[int, list[str], float]:
    """Run ``cmd`` as a child of a fresh Python: its exit code, its stderr's lines (Python's warnings left out) and
    its peak RSS in MB."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _PROBE, *cmd], capture_output=True, text=True, timeout=120, env=env)
    code, kb = r.stdout.split()[-2:]
    lines = [
        line for line in r.stderr.splitlines() if line.strip() and not line.startswith(" ") and "Warning" not in line
    ]
    return int(code), lines, int(kb) / 1024


def _sparse(path: Path, size: int = SPARSE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.truncate(path, size)
    return path


TRAIN = (sys.executable, "-m", "powertrain", "train", "--preset", "tiny", "--nproc", "1", "--steps", "3", "--quiet")


def test_a_huge_checkpoint_pointer_is_refused_with_little_memory(tmp_path):
    run = tmp_path / "run"
    _sparse(run / "checkpoints" / "latest")
    for args in (("--out", str(tmp_path / "new"), "--resume", str(run)), ("--out", str(run))):  # resume; continue
        code, lines, peak = _refusal(*TRAIN, *args)
        assert code == 2 and len(lines) == 1, lines
        assert "checkpoint pointer" in lines[0] and f"is {SPARSE:,} bytes, more than the 256" in lines[0], lines
        assert len(lines[0]) < 400 and peak < PEAK_MB, (peak, lines)
        assert not (tmp_path / "new").exists()


def test_a_checkpoint_pointer_is_quoted_short_and_escaped(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_bytes(b"step_\x1b[2J" + b"x" * 200 + b"\n")  # a terminal escape, then junk
    code, lines, _ = _refusal(*TRAIN, "--out", str(tmp_path / "new"), "--resume", str(run))
    assert code == 2 and len(lines) == 1, lines
    assert "names 'step_\\x1b[2J" in lines[0] and "\x1b" not in lines[0] and "x" * 41 not in lines[0], lines


def test_a_huge_manifest_is_refused_before_it_is_read(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    _sparse(ckpt / "manifest.json")
    code, lines, peak = _refusal(*TRAIN, "--out", str(tmp_path / "new"), "--resume", str(ckpt))
    assert code == 2 and len(lines) == 1, lines
    assert f"Checkpoint manifest {str(ckpt / 'manifest.json')!r} is {SPARSE:,} bytes" in lines[0], lines
    assert peak < PEAK_MB, (peak, lines)


def _archive(extra: str | None, payload: bytes) -> bytes:
    """torch.save({"a": 1}) with one more member, ``extra``, stored after its archive/data.pkl (None: ``payload``
    replaces archive/data.pkl)."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name: that is the attack
        for info in src.infolist():
            is_pickle = info.filename == "archive/data.pkl"
            dst.writestr(info.filename, payload if is_pickle and extra is None else src.read(info.filename))
            if is_pickle and extra is not None:
                dst.writestr(extra, payload)
    return out.getvalue()


BOMB = b"\x80\x02cbuiltins\nbytearray\n\x8a\x08" + (1_500_000_000).to_bytes(8, "little") + b"\x85R."


@pytest.mark.parametrize("extra", ["archive/DATA.PKL", "archive/data.pkl", "ARCHIVE/data.pkl"])
def test_zip_members_whose_names_collide_are_refused(extra):
    # the control: torch reads the member stored after archive/data.pkl, which a check of "data.pkl" alone skips
    control = _archive(extra, pickle.dumps({"a": 2}, protocol=2))
    if extra != "ARCHIVE/data.pkl":
        assert torch.load(io.BytesIO(control), weights_only=True) == {"a": 2}
    with pytest.raises(UnsafeData, match="members whose names collide"):
        check_torch_pickle(_archive(extra, BOMB), allowed=(), what="item")


def test_a_case_colliding_bytearray_bomb_is_refused_with_little_memory(tmp_path):
    """The issue's payload: a harmless archive/data.pkl, and an archive/DATA.PKL building bytearray(1.5e9)."""
    path = tmp_path / "item.pt"
    path.write_bytes(_archive("archive/DATA.PKL", BOMB))
    script = (
        "import io, sys, torch; from powertrain.serialize import check_torch_pickle; "
        "data = open(sys.argv[1], 'rb').read(); check_torch_pickle(data, allowed=(), what='item'); "
        "torch.load(io.BytesIO(data), weights_only=True)"
    )
    code, lines, peak = _refusal(sys.executable, "-c", script, str(path))
    assert code == 1 and "UnsafeData: item has members whose names collide" in lines[-1], lines
    assert peak < PEAK_MB, peak


def _example() -> object:
    spec = importlib.util.spec_from_file_location("nanogpt_ddp", ROOT / "examples" / "nanogpt_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_checkpoint_loader_is_bounded(tmp_path):
    ex = _example()
    model = ex.GPT()  # type: ignore[attr-defined]
    state = {"model": model.state_dict(), "step": 3}
    from powertrain import serialize

    good = tmp_path / "good.pt"
    good.write_bytes(serialize.dumps(state))
    loaded = ex.load_checkpoint(good, model)  # type: ignore[attr-defined]
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["pos.weight"], model.pos.weight)
    bomb = tmp_path / "bomb.pt"  # 1.5 GB from torch.load(weights_only=True), the example's loader before
    bomb.write_bytes(_archive(None, BOMB))
    with pytest.raises(UnsafeData):
        ex.load_checkpoint(bomb, model)  # type: ignore[attr-defined]
    huge = _sparse(tmp_path / "huge.pt")
    script = (
        "import importlib.util, sys; from pathlib import Path; "
        "spec = importlib.util.spec_from_file_location('ex', sys.argv[1]); "
        "ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex); "
        "ex.load_checkpoint(Path(sys.argv[2]), ex.GPT())"
    )
    code, lines, peak = _refusal(sys.executable, "-c", script, str(ROOT / "examples" / "nanogpt_ddp.py"), str(huge))
    assert code == 1 and f"huge.pt is {SPARSE:,} bytes, more than this model's checkpoint can be" in lines[-1], lines
    assert peak < PEAK_MB, peak


def test_read_bounded_checks_before_reading(tmp_path):
    small = tmp_path / "small"
    small.write_bytes(b"abc")
    assert read_bounded(small, 3, "A file") == b"abc"
    with pytest.raises(FileTooLarge, match=r"A file '.*small' is 3 bytes, more than the 2 it can be"):
        read_bounded(small, 2, "A file")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block without a writer: refused without blocking
    with pytest.raises(FileTooLarge, match="not a regular file"):
        read_bounded(fifo, 100, "A file")
    assert quote(b"x" * 100) == repr(b"x" * 40) + "..." and quote("\x1b[2J") == repr("\x1b[2J")


def test_a_huge_config_file_or_a_directory_is_refused(tmp_path):
    huge = _sparse(tmp_path / "huge.toml")
    code, lines, peak = _refusal(*TRAIN, "--config", str(huge), "--out", str(tmp_path / "o"))
    assert code == 2 and len(lines) == 1 and f"is {SPARSE:,} bytes, more than the 1,048,576" in lines[0], lines
    assert peak < PEAK_MB, peak
    code, lines, _ = _refusal(*TRAIN, "--config", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2 and len(lines) == 1 and "is not a regular file" in lines[0], lines


def _manifest(ckpt: Path, files: dict[str, dict[str, object]]) -> None:
    (ckpt / "manifest.json").write_text(json.dumps({"format": 3, "world_size": 1, "step": 1, "files": files}))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def test_huge_dcp_metadata_is_refused_before_it_is_read(tmp_path):
    ckpt = tmp_path / "ckpt"
    meta = _sparse(ckpt / ".metadata")
    _manifest(ckpt, {".metadata": {"bytes": SPARSE, "sha256": "0" * 64}})  # the size is checked before the hash
    code, lines, peak = _refusal(*TRAIN, "--out", str(tmp_path / "o"), "--resume", str(ckpt))
    assert code == 2 and len(lines) == 1, lines
    assert f"{str(meta)!r} is {SPARSE:,} bytes, more than DCP metadata can be" in lines[0], lines
    assert peak < PEAK_MB, peak


def test_an_item_longer_than_its_destination_is_refused_before_it_is_read(tmp_path):
    """A tensor item whose stored byte range is 1 GiB (of a sparse data file, checksums made to match): DCP would
    read it whole; the planner refuses it first."""
    from powertrain import checkpoint
    from powertrain.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path, 1, torch.nn.Linear(4, 3), None, {})
    meta = checkpoint.read_metadata(ckpt)
    info = next(v for i, v in meta.storage_data.items() if i.fqn == "model.weight")
    data = ckpt / info.relative_path
    info.length = 1 << 30
    os.truncate(data, max(data.stat().st_size, info.offset + info.length))
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _manifest(
        ckpt,
        {
            p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in ckpt.iterdir()
            if p.name != "manifest.json"
        },
    )
    script = (
        "import sys, torch; from pathlib import Path; from powertrain.train.checkpoint import load_checkpoint; "
        "load_checkpoint(Path(sys.argv[1]), torch.nn.Linear(4, 3), None, {})"
    )
    code, lines, peak = _refusal(sys.executable, "-c", script, str(ckpt))
    assert code == 1, lines
    assert (
        "Checkpoint item 'model.weight' is stored in 1,073,741,824 bytes, more than its destination takes" in lines[-1]
    ), lines
    assert peak < PEAK_MB, peak


def test_a_metrics_log_is_read_row_by_row_within_a_bound(tmp_path):
    from powertrain.train.metrics import supersede

    _sparse(tmp_path / "metrics.jsonl")  # one 2 GiB "line" of NUL bytes
    script = (
        "import sys; from pathlib import Path; from powertrain.train.metrics import supersede; "
        "supersede(Path(sys.argv[1]), 3)"
    )
    code, lines, peak = _refusal(sys.executable, "-c", script, str(tmp_path))
    assert code == 1 and "has a line longer than 65,536 bytes: not a metrics log" in lines[-1], lines
    assert peak < PEAK_MB, peak
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' * 5)  # more rows than steps
    with pytest.raises(ValueError, match="has more rows up to step 3 than steps"):
        supersede(tmp_path, 3)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' + "\x1b[2J" + "y" * 100 + "\n")
    with pytest.raises(ValueError, match=r"holds '\\x1b\[2Jyyy.*'\.\.\., not a metrics row"):
        supersede(tmp_path, 3)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 5}\n')  # the control: it works
    assert supersede(tmp_path, 3) == [{"step": 1}, {"step": 2}]
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == '{"step": 5}\n'


def test_what_the_benches_read_back_from_their_own_runs_is_bounded(tmp_path):
    """bench cluster and the GPU check read the run directories of the ``powertrain train`` runs they launch, the
    torchft bench its replicas' logs: every one of those reads is bounded (2 GiB sparse files are refused, or tailed, in
    moments and without the memory they would take)."""
    import gpu_stages as gpu
    import torchft_diloco
    from powertrain.train.metrics import read_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_time_s": 0.25}\n')
    (run / "summary.json").write_text('{"steps_done": 2}')
    assert read_run(run) == ([{"step": 1, "step_time_s": 0.5}, {"step": 2, "step_time_s": 0.25}], {"steps_done": 2})
    (run / "summary.json").write_text('{"steps_done": 1}')  # many short rows: no more than one a step is kept
    with pytest.raises(ValueError, match="has more rows than the run's 1 steps: not this run's log"):
        read_run(run)
    (run / "summary.json").write_text('{"steps": 2}')
    with pytest.raises(ValueError, match="has no steps_done count"):
        read_run(run)
    _sparse(run / "summary.json")
    with pytest.raises(FileTooLarge, match=r"Run summary .* is 2,147,483,648 bytes, more than the 1,048,576"):
        read_run(run)
    (run / "summary.json").write_text('{"steps_done": 2}')
    _sparse(run / "metrics.jsonl")
    with pytest.raises(ValueError, match="has a line longer than 65,536 bytes: not a metrics log; a run the bench"):
        read_run(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.5}\n')
    (run / "summary.json").write_text('{"steps_done": 1}')
    _sparse(run / "config.toml")
    with pytest.raises(FileTooLarge, match=r"Config file .* more than the 1,048,576"):
        gpu._train_result(run, "")
    # a GPU check stage's result file: refused before it is read, the stage (not the run) fails in one line
    stage = gpu.Stage("probe", [sys.executable, "-c", "pass"], 60, result=_sparse(tmp_path / "probe.json"))
    res = gpu.run_stage(stage, time.monotonic() + 120, io.StringIO())
    assert not res["ok"] and "FileTooLarge: Stage probe's result" in res["error"] and "16,777,216" in res["error"]
    log = _sparse(tmp_path / "replica0.log")
    with log.open("r+b") as f:  # the log's last bytes are what a failure shows
        f.seek(SPARSE - 5)
        f.write(b"boom\n")
    assert torchft_diloco._tail(log, 10) == "\x00" * 5 + "boom\n"
    script = (
        f"import sys; from pathlib import Path; sys.path.insert(0, {str(TOOLS)!r}); from torchft_diloco import _tail; "
        "sys.exit(0 if _tail(Path(sys.argv[1])).endswith('boom\\n') else 3)"
    )
    code, lines, peak = _refusal(sys.executable, "-c", script, str(log))
    assert code == 0 and peak < PEAK_MB, (code, lines, peak)
    assert torchft_diloco._tail(tmp_path / "none.log") == ""


CHATTY = """
import sys
block = (b"x" * 1023 + b"\\n") * 1024  # 1 MiB of 1 KiB lines
for _ in range(700):
    sys.stdout.buffer.write(block)
sys.stdout.buffer.write(b"ValueError: the end\\n")
sys.exit(1)
"""


def test_a_gpu_check_stage_s_output_is_read_back_from_its_end_only():
    """The GPU check keeps a stage's output on disk and reads back its last OUTPUT_TAIL bytes: a stage that prints
    700 MiB (held whole, with its lines, it would take over twice the bound) fails in its one error line and its
    tail, within the memory bound."""
    script = (
        f"import io, sys, time; sys.path.insert(0, {str(TOOLS)!r}); import gpu_stages as gpu; "
        f"stage = gpu.Stage('chatty', [sys.executable, '-c', {CHATTY!r}], 120); "
        "res = gpu.run_stage(stage, time.monotonic() + 300, io.StringIO()); "
        "ok = res['error'] == 'ValueError: the end' and res['tail'].splitlines()[-2] == 'x' * 1023; "
        "sys.exit(0 if ok and not res['ok'] else 3)"
    )
    code, lines, peak = _refusal(sys.executable, "-c", script)
    assert code == 0 and peak < PEAK_MB, (code, lines, peak)


def test_the_item_bound_admits_what_a_large_model_saves(tmp_path):
    """The control for the item bound: an optimizer's list of 2,000 parameter names is one ~80 KB item, which loads."""
    from powertrain.train.checkpoint import load_checkpoint, save_checkpoint

    model = torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(1000)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 1)).sum().backward()
    opt.step()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {})
    assert load_checkpoint(ckpt, model, opt, {})[0] == 1


@pytest.mark.parametrize(("source", "per_worker"), [("textdir", "2.0"), ("bin", "6.0")])
def test_a_corpus_larger_than_memory_is_refused_before_any_worker_starts(tmp_path, monkeypatch, source, per_worker):
    """Every worker holds the whole corpus (a user's directory, a .bin file, or a sparse file in one): more than the
    machine has available is a line naming --data-max-mb, and the value it names fits."""
    from powertrain.train import data
    from powertrain.train.config import resolve

    d = tmp_path / "corpus"
    d.mkdir()
    (d / ("a.txt" if source == "textdir" else "train.bin")).write_bytes(b"ab" * 1_000_000)  # 2 MB
    monkeypatch.setattr(data, "memory_available", lambda: 5_000_000)  # 4 MB to spend
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = dataclasses.replace(resolve("tiny", None, {"data": source, "data_path": str(d)}), data_max_mb=None)
    with pytest.raises(
        ValueError,
        match=rf"data='{source}' would take {per_worker} MB in each of 4 worker\(s\), more "
        r"than this machine has available \(5.0 MB\): pass --data-max-mb",
    ) as e:
        data.check_sizes(cfg, 4)
    fits = float(str(e.value).rsplit("--data-max-mb ", 1)[1].split()[0])
    data.check_sizes(dataclasses.replace(cfg, data_max_mb=fits), 4)  # what the line names fits
    if source == "textdir":
        data.check_sizes(cfg, 2)  # 2 x 2 MB: fits
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # under torchrun: this machine's workers only
        data.check_sizes(cfg, 4)
