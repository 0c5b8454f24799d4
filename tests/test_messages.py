"""Small one-line messages that must say something true and followable (issue 35, item 7)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from powertrain.checkpoint import CheckpointError, read_metadata
from powertrain.train.checkpoint import save_checkpoint
from powertrain.train.config import resolve


def test_a_compressor_start_at_the_last_step_suggests_a_value_that_works():
    with pytest.raises(ValueError, match=r"starts compressing after 2 steps and the run has 2: .* below 2 or raise"):
        resolve("tiny", None, {"steps": 2})  # the tiny preset's start=2: a suggestion of start=2 would be no fix
    assert resolve("tiny", None, {"steps": 3}).steps == 3


def test_a_metadata_pickle_that_cannot_be_read_gives_a_reason(tmp_path):
    """A BINBYTES8 that claims 2**62 bytes: the unpickler's EOFError has no message, the line names it."""
    ckpt = save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), None, {})
    (ckpt / ".metadata").write_bytes(b"\x80\x04\x8e" + (2**62).to_bytes(8, "little"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"\.metadata' cannot be read safely: EOFError$"):
        read_metadata(ckpt)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["overhead", "--repeats", "-3"], "Invalid repeats=-3: must be an integer >= 1"),
        (["overhead", "--repeats", "0"], "Invalid repeats=0: must be an integer >= 1"),
        (["overhead", "--threads", "0"], "Invalid threads=0: must be an integer >= 1"),
        (["overhead", "--threads", "100000"], "Invalid threads=100000: this machine has"),
        (["overhead", "--write", "FILE/BENCHMARKS.md"], "is not a file in an existing directory"),
    ],
)
def test_bench_flags_are_checked_before_anything_runs(args, message, tmp_path, capsys):
    from powertrain.cli import main

    (tmp_path / "FILE").write_text("a file, not a directory")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_bench_writes_benchmarks_md_only_where_one_exists(tmp_path, monkeypatch, capsys):
    from powertrain.bench.cli import _write_target

    monkeypatch.chdir(tmp_path)
    assert _write_target(None) is None and "no BENCHMARKS.md here" in capsys.readouterr().err
    assert not (tmp_path / "BENCHMARKS.md").exists()
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    assert _write_target(None) == "BENCHMARKS.md" and _write_target("") is None
    assert _write_target(str(tmp_path / "other.md")) == str(tmp_path / "other.md")


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1, 2], "world_size None, ranks NoneType"),
        ({"world_size": "1", "ranks": []}, "world_size '1', ranks list"),
        ({"world_size": 1, "ranks": "x"}, "world_size 1, ranks str"),
        ({"world_size": 1, "ranks": [[1, 2]]}, "world_size 1, ranks list"),
        (
            {"world_size": 2, "ranks": [torch.zeros(1, dtype=torch.uint8)] * 2},
            "written by 2 workers and this fit has 1",
        ),
    ],
)
def test_lightning_callback_state_of_the_wrong_shape_is_one_line(state, message):
    pytest.importorskip("lightning")
    import torch.distributed as dist

    from powertrain.compress import make_compressor
    from powertrain.lightning import GradientCompression

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        callback = GradientCompression("powersgd")
        callback.compressor = make_compressor("powersgd", torch.nn.Linear(4, 4).named_parameters())
        with pytest.raises(ValueError, match=r"^[^\n]*$") as exc:
            callback.load_state_dict(state)
        assert message in str(exc.value), str(exc.value)
    finally:
        dist.destroy_process_group()


def test_hf_callback_names_what_is_wrong_with_its_state_file(tmp_path):
    """Not 'missing' for another world size's file, a directory, a FIFO or a 2 GiB file: each its own line."""
    pytest.importorskip("transformers")
    import os
    import types

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from powertrain.hf import GradientCompression

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ckpt = tmp_path / "checkpoint-10"
        ckpt.mkdir()
        mine = ckpt / "powertrain_compressor_rank0_of_1.bin"
        args, state = types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(global_step=10)

        def begin() -> str:
            ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
            callback = GradientCompression(types.SimpleNamespace(model_wrapped=ddp))  # type: ignore[arg-type]
            with pytest.raises((ValueError, FileNotFoundError)) as exc:
                callback.on_train_begin(args, state, None)  # type: ignore[arg-type]
            return str(exc.value)

        assert "is missing" in begin()
        (ckpt / "powertrain_compressor_rank0_of_2.bin").write_bytes(b"")
        assert "holds the compressor state of 2 workers: resume with that many" in begin()
        mine.mkdir()
        assert "is not a regular file" in begin()
        mine.rmdir()
        os.mkfifo(mine)
        assert "is not a regular file" in begin()
        mine.unlink()
        mine.touch()
        os.truncate(mine, 2 << 30)
        assert "is 2,147,483,648 bytes, more than the" in begin()
    finally:
        dist.destroy_process_group()
