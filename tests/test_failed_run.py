"""A failed run leaves ``--out`` reusable (issue 35, item 4): what can be checked is checked before ``--out`` exists,
and what a run leaves before its first logged step does not block the same command run again."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cli_utils import run_cli

TINY = ["train", "--preset", "tiny", "--nproc", "1", "--steps", "3"]


def _lines(text: str) -> list[str]:
    """stderr's lines less Python's warnings (a warning and the source line under it)."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith(" ") and "Warning" not in line]


def test_too_little_data_is_refused_before_out_exists_and_the_rerun_works(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "one.txt").write_text("0123456789")
    out = tmp_path / "run"
    r = run_cli("train", "--preset", "tiny", "--data", "textdir", "--data-path", str(texts), "--out", str(out))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "The train split has 9 tokens: a shard of 2 is too small" in lines[0], lines
    assert not out.exists()  # nothing was created
    (texts / "one.txt").write_text("def f(x):\n    return x + 1\n" * 200)  # good data: the same command runs
    r = run_cli(*TINY, "--data", "textdir", "--data-path", str(texts), "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "summary.json").is_file()


def _leftovers(out: Path) -> None:
    """What a run that failed in its workers before its first logged step leaves (see cli.UNSTARTED)."""
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "rank1.traceback").write_text("Traceback ...\n")
    (out / "pids").mkdir()
    (out / "pids" / "rank0").write_text("123\n")
    (out / "config.toml").write_text("steps = 2\n")
    (out / "metrics.jsonl").touch()
    (out / ".lock").touch()


def test_what_a_run_left_before_its_first_step_does_not_block_the_rerun(tmp_path):
    out = tmp_path / "run"
    _leftovers(out)
    r = run_cli(*TINY, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "held only a run that ended before its first logged step (config.toml, logs, metrics.jsonl, pids)" in r.stdout
    ), r.stdout[-2000:]
    assert not (out / "logs" / "rank1.traceback").exists() and (out / "summary.json").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_run_that_logged_a_step_or_an_unknown_file_still_blocks(tmp_path):
    for name, damage in (
        ("logged", lambda o: (o / "metrics.jsonl").write_text('{"step": 1}\n')),
        ("other", lambda o: (o / "notes.txt").write_text("mine")),
        ("link", lambda o: (o / "logs").rename(o / "elsewhere") or (o / "logs").symlink_to(o / "elsewhere")),
    ):
        out = tmp_path / name
        _leftovers(out)
        damage(out)
        r = run_cli(*TINY, "--out", str(out), "--quiet")
        assert r.returncode == 2, (name, r.stderr[-2000:])
        assert "is not empty (it holds another run)" in r.stderr, (name, r.stderr[-2000:])
        assert (out / "config.toml").read_text() == "steps = 2\n", name  # untouched


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root only; skipped elsewhere): room for a run's config and logs, not for a checkpoint."""
    where = tmp_path / "disk"
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_full_disk_is_named_in_one_line(small_disk, nproc):
    out = small_disk / f"run{nproc}"
    r = run_cli(
        "train",
        "--preset",
        "tiny",
        "--nproc",
        nproc,
        "--steps",
        "3",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        "--quiet",
    )
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [line for line in _lines(r.stderr) if not line.startswith(("Resume from", "No checkpoint was written"))]
    assert len(lines) == 1, r.stderr[-3000:]
    # ENOSPC itself names the file; a writer that reports a short write instead (torch.save's zip writer: "unexpected
    # pos") is caught by the free space left, and the line names --out: which one a run meets depends on timing.
    assert "no space left on device" in lines[0] and str(out) in lines[0], lines
    assert "free space there or choose another --out" in lines[0], lines
    assert not list(out.glob("logs/*.traceback")), "no empty traceback files"
    if (out / "checkpoints" / "latest").exists():  # what a resume would take is complete
        from powertrain.checkpoint import verify
        from powertrain.train.checkpoint import find_checkpoint

        verify(find_checkpoint(out))


def test_disk_full_is_found_among_the_causes(tmp_path):
    """ENOSPC behind other exceptions (DCP gathers each rank's): the line names the file; other errors are not it."""
    import errno

    from powertrain.train.launch import _cause, disk_full

    enospc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.distcp"))
    try:
        try:
            raise enospc
        except OSError:
            raise RuntimeError("write failed") from None  # the context keeps it
    except RuntimeError as e:
        wrapped = e
    assert disk_full(wrapped, str(tmp_path)) == (
        f"no space left on device while writing {tmp_path / 'x.distcp'}: free space there or choose another --out"
    )

    from torch.distributed.checkpoint.api import CheckpointException  # each rank's (exception, traceback)

    gathered = CheckpointException(
        "ranks", {0: (RuntimeError("other"), None), 1: (OSError(errno.ENOSPC, "No space left on device"), None)}
    )
    assert disk_full(gathered, "/somewhere") == (
        "no space left on device while writing /somewhere: free space there or choose another --out"
    )
    assert _cause(gathered) == (
        "CheckpointException: rank 0: RuntimeError: other; rank 1: OSError: [Errno 28] No space left on device"
    )
    assert disk_full(RuntimeError("unrelated"), str(tmp_path)) is None  # tmp_path has room
    assert disk_full(ValueError("bad input"), str(tmp_path)) is None
