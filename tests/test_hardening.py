"""What an attacker or a careless user tries: crafted checkpoints, exposed sockets, lost state, bad input.

Code-execution tests check the side effect (a marker file a payload would create), not only that loading
raised; each attack also has a control showing that it does run code through the path torch offers by default
(plain pickle, DCP's default planner), so the test cannot pass because the payload was inert.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli_utils import children, run_cli
from powertrain import checkpoint
from powertrain.checkpoint import CheckpointError, CompressorState
from powertrain.cli import main
from powertrain.compress import make_compressor
from powertrain.train.checkpoint import load_checkpoint, save_checkpoint
from powertrain.train.config import resolve
from powertrain.train.data import load_data

TINY = ["train", "--preset", "tiny", "--quiet"]


_run = run_cli


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and "Warning" not in line and "warn(" not in line]


@pytest.fixture(scope="module")
def run2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-worker run of 4 steps with checkpoints after steps 2 and 4 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("run2") / "run"
    r = _run(*TINY, "--steps", "4", "--checkpoint-every", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


# ---------------------------------------------------------------- 1. checkpoints cannot run code


def _small_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return save_checkpoint(tmp_path, 1, model, opt, {}), model, opt


def _rewrite_manifest(ckpt: Path) -> None:
    """What an attacker who edits files also does: make the checksums match again."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (ckpt / name).read_bytes()
        import hashlib

        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _global(module: str, name: str) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"


def _str(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


def _payloads(marker: Path) -> dict[str, bytes]:
    cmd = _str(f"touch {marker}")
    return {
        # a plain os.system reduce
        "reduce": b"\x80\x04" + _global("os", "system") + cmd + b"\x85R.",
        # protocol 4 resolves dotted names inside an admitted module
        "dotted": b"\x80\x04" + _global("torch.distributed.checkpoint.filesystem", "os.system") + cmd + b"\x85R.",
        # getattr(getattr(getattr(PosixPath, "__init__"), "__globals__")...) reaches os
        "getattr": b"\x80\x04"
        + _global("builtins", "getattr")
        + _global("pathlib", "PosixPath")
        + _str("__init__")
        + b"\x86R.",
        # BUILD on an admitted class patches it for everyone
        "build_on_class": b"\x80\x04"
        + _global("torch.distributed.checkpoint.metadata", "Metadata")
        + b"}"
        + _str("pwned")
        + b"\x88sb.",  # {"pwned": True} applied to the class
        # BUILD with slot state: setattr on the class
        "build_slots": b"\x80\x04"
        + _global("torch.distributed.checkpoint.metadata", "Metadata")
        + b"N}"
        + _str("pwned")
        + b"\x88s\x86b.",
    }


def test_crafted_metadata_runs_nothing(tmp_path):
    ckpt, model, opt = _small_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    from torch.distributed.checkpoint import metadata as md

    for name, payload in _payloads(marker).items():
        if name == "reduce":  # the control: plain pickle, as DCP's own reader does, runs it
            pickle.loads(payload)
            assert marker.exists(), "the payload must be live for the test to mean anything"
            marker.unlink()
        (ckpt / ".metadata").write_bytes(payload)
        _rewrite_manifest(ckpt)
        with pytest.raises((pickle.UnpicklingError, CheckpointError)) as e:
            load_checkpoint(ckpt, model, opt, {})
        assert "not allowed" in str(e.value), (name, e.value)
        assert not marker.exists(), name
        assert not hasattr(md.Metadata, "pwned"), name


def test_metadata_may_only_name_files_inside_the_checkpoint(tmp_path):
    ckpt, model, opt = _small_checkpoint(tmp_path)
    meta = checkpoint.read_metadata(ckpt)
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match="which is not a file of the checkpoint"):
        load_checkpoint(ckpt, model, opt, {})


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted(tmp_path: Path, where: str, marker: Path) -> Path:
    """A checkpoint shaped like save_checkpoint's with a code-running pickle in one item, checksums updated."""
    _, model, opt = _small_checkpoint(tmp_path / "base")
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    rank = CompressorState(_Holder({}))
    progress = {k: torch.tensor(0.0, dtype=torch.float64) for k in ("wall_s", "bytes_total", "first_loss")}
    state = {"model": model_sd, "optim": optim_sd, "rank": rank, "step": torch.tensor(1), "progress": progress}
    evil = _Evil(marker)
    if where == "param_group":  # a bytes item DCP reads with torch.load(weights_only=False)
        optim_sd["param_groups"][0]["lr"] = evil
    elif where == "step":  # the step counter as older versions stored it: a bytes item
        state["step"] = evil
    elif where == "rank_blob":  # the per-rank state tensor holding a pickle that runs code
        buf = io.BytesIO()
        torch.save({"rng": evil}, buf)
        state["rank"] = {"rank0_of_1": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
    out = tmp_path / "crafted"
    checkpoint.save(state, out, extra={"step": 1})
    return out


class _Holder:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


@pytest.mark.parametrize("where", ["param_group", "step", "rank_blob"])
def test_crafted_data_items_run_nothing(tmp_path, where):
    marker = tmp_path / "pwned"
    ckpt = _crafted(tmp_path, where, marker)
    assert not marker.exists()
    _, model, opt = _small_checkpoint(tmp_path / "fresh")
    with pytest.raises((CheckpointError, pickle.UnpicklingError)):
        load_checkpoint(ckpt, model, opt, {})
    assert not marker.exists(), where
    if where != "rank_blob":  # the control: DCP's default planner does run it
        from torch.distributed.checkpoint.state_dict import get_state_dict

        _, optim_sd = get_state_dict(model, opt)
        state = {"optim": optim_sd} if where == "param_group" else {"step": 0}
        dcp.load(state, checkpoint_id=str(ckpt), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        assert marker.exists(), "the payload must be live for the test to mean anything"


def test_loading_is_strict_and_names_what_is_missing(tmp_path):
    ckpt, model, _ = _small_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"lacks 1 entries this run needs.*extra\.x"):
        checkpoint.load({"extra": {"x": torch.zeros(2)}, "model": model.state_dict()}, ckpt)


# ---------------------------------------------------------------- 2. the launcher listens on loopback only


def _listeners(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket the processes hold, from /proc."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                hexaddr = local.split(":")[0]
                addr = (
                    socket.inet_ntop(socket.AF_INET, bytes.fromhex(hexaddr)[::-1])
                    if width == 8
                    else socket.inet_ntop(
                        socket.AF_INET6, b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, 32, 8))
                    )
                )
                found.append((inodes[inode], addr))
    return found


def test_listener_check_sees_a_wildcard_socket():
    """The control for the next test: a socket on every interface is reported as such."""
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    try:
        assert (os.getpid(), "0.0.0.0") in _listeners([os.getpid()])
    finally:
        s.close()


def test_launcher_and_workers_listen_on_loopback_only_and_sigterm_stops_cleanly(tmp_path):
    out = tmp_path / "run"
    args = [
        *TINY,
        "--steps",
        "2000",
        "--block-size",
        "64",
        "--batch-size",
        "8",
        "--out",
        str(out),
        "--checkpoint-every",
        "1000",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "powertrain", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 90
        while not ((out / "pids" / "rank1").exists() and (out / "pids" / "rank0").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        time.sleep(1.0)  # the process group is up: gloo's listeners exist by now
        pids = [proc.pid] + [int((out / "pids" / f"rank{r}").read_text()) for r in range(2)]
        found = _listeners(pids)
        assert any(pid == proc.pid for pid, _ in found), f"the launcher's store should be listening: {found}"
        assert all(addr in ("127.0.0.1", "::1") for _, addr in found), found
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]  # a shell's status for SIGTERM: 143
    lines = _lines(err)
    # stopped before its first checkpoint (every 1000 steps): the way on is the same command, not a --resume
    assert len(lines) == 1 and "interrupted (SIGTERM)" in lines[0] and "starts the run over" in lines[0], err[-2000:]
    for pid in pids[1:]:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _children_running(launcher: int, marker: bytes) -> int:
    """The launcher's children whose command line holds ``marker`` (the fork server's, spawned workers')."""
    count = 0
    for child in children(launcher):
        with contextlib.suppress(OSError):  # a child that exits while we look is not counted
            count += marker in Path(f"/proc/{child}/cmdline").read_bytes()
    return count


CTRL_C_IN_START = """
import os, signal, sys, time
from multiprocessing import forkserver
from powertrain.train import launch as L

real = forkserver.ensure_running
def ensure_running():  # the fork server is spawned, and a Ctrl-C arrives before the launcher's window closes
    real()
    os.kill(os.getpid(), signal.SIGINT)
    # This thread blocks SIGINT, so the kernel hands it to another thread (torch's, the store's), which runs the C
    # handler when it is next scheduled: on a loaded CPU after the window closed, and the workers then start before
    # they are stopped. A Ctrl-C "arrives" once a thread has taken it off the process's pending set.
    deadline = time.monotonic() + 30
    while signal.SIGINT in signal.sigpending() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.2)  # past the few instructions from taking it to setting the flag the main thread reads
forkserver.ensure_running = ensure_running
try:
    L.launch(print, 2, "a worker ran")
except L.Interrupted as e:
    sys.exit(0 if e.signal_name == "SIGINT" else 3)
sys.exit(4)  # the Ctrl-C was lost: the workers ran
"""


def test_a_ctrl_c_while_the_fork_server_starts_is_not_lost():
    """A Ctrl-C while the launcher spawns the fork server (SIGINT blocked there, so that the server does not die of
    it while it imports; CI once saw it ignored there instead, lost, and the run exit 0) reaches the launcher's
    handler, and the launch stops before any worker starts."""
    r = subprocess.run([sys.executable, "-c", CTRL_C_IN_START], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "a worker ran" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize(
    ("when", "sig"),
    [
        ("training", signal.SIGINT),
        ("starting", signal.SIGINT),
        ("importing", signal.SIGTERM),
        ("spawned", signal.SIGINT),
    ],
)
def test_an_interrupt_stops_every_worker_with_one_line(tmp_path, when, sig):
    """Ctrl-C (to the whole group, as a terminal sends it) while training, and also just as the workers' fork
    server is spawned (it keeps Ctrl-C from its start, as the launcher handles it). SIGTERM to the group while the
    server imports torch kills the server (only SIGINT is kept from it): the launcher, waiting on it for its first
    worker, says it was interrupted in one line (it printed EOFError's traceback and exited 1). Without a fork server
    (a TMPDIR too long for its socket: workers spawned), a Ctrl-C while the workers import torch: each printed its
    KeyboardInterrupt's traceback (67 lines, measured) before they started with SIGINT blocked."""
    out = tmp_path / "run"
    args = [*TINY, "--steps", "2000", "--block-size", "64", "--batch-size", "8", "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if when == "spawned":  # a Unix socket's path takes at most 108 bytes
        (tmp_path / ("t" * 110)).mkdir()
        env["TMPDIR"] = str(tmp_path / ("t" * 110))
    proc = subprocess.Popen(
        [sys.executable, "-m", "powertrain", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        if when == "training":
            while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
                assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
                time.sleep(0.2)
        elif when == "spawned":
            while _children_running(proc.pid, b"spawn_main") < 2:
                assert proc.poll() is None and time.monotonic() < deadline, "no workers spawned"
                time.sleep(0.02)
            time.sleep(0.3)  # inside their import of torch (seconds)
        else:  # the fork server has just been spawned, perhaps still in the launcher's window (launch._context)
            while not _children_running(proc.pid, b"forkserver"):
                assert proc.poll() is None and time.monotonic() < deadline, "no fork server started"
                time.sleep(0.02)
            if when == "importing":
                time.sleep(0.3)  # inside the server's import of torch (seconds), past the spawn
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, err[-2000:]  # a shell's status for the signal: 130 SIGINT, 143 SIGTERM
    lines = _lines(err)
    assert len(lines) == 1 and f"interrupted ({sig.name})" in lines[0], err[-2000:]


def _proc_status(pid: int) -> dict[str, str]:
    """``/proc/PID/status`` as a dict (empty once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _terminal_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_terminals_ctrl_c_at_any_moment_is_one_line_and_130(tmp_path):
    """A terminal sends SIGINT to the whole foreground process group. Sent to the console script at 0 to 3 s after its
    code starts (while it imports torch, parses, launches, trains): every time status 130 and one line. Before, the
    first second ended with -2 (killed by the signal) and 13-51 lines of traceback, a KeyboardInterrupt inside numpy's
    initialisation with exit 1 ("cannot load module more than once"), or was swallowed (the run finished, exit 0)."""
    script = Path(sys.executable).parent / "powertrain"
    for i, delay in enumerate((0.0, 0.1, 0.3, 0.6, 1.0, 1.5, 3.0)):
        args = [*TINY, "--steps", "2000", "--out", str(tmp_path / f"run{i}")]
        # with a terminal's SIGINT disposition (a shell's background job, as a CI runner may start this suite in,
        # ignores SIGINT, and a process honours the SIG_IGN it inherits until the launcher installs its handler)
        proc = subprocess.Popen(
            [str(script), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_terminal_sigint,
        )
        try:
            # from when the command's code runs: its entry holds SIGINT back first (the bit in /proc's mask of blocked
            # signals). Before that the interpreter starts up (tens of milliseconds: a Ctrl-C there is Python's own
            # "Fatal Python error: init_import_site", or the kernel's default, which a shell reports as 130)
            deadline = time.monotonic() + 30
            while not int(_proc_status(proc.pid).get("SigBlk", "0"), 16) & (1 << (signal.SIGINT - 1)):
                assert proc.poll() is None and time.monotonic() < deadline, "the interpreter did not start"
                time.sleep(0.005)
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lines = _lines(err)
        assert proc.returncode == 130 and len(lines) == 1 and "interrupted" in lines[0], (delay, err[-2000:])


# ---------------------------------------------------------------- 3-6. resumes that lose nothing, clear errors


def test_resume_with_another_world_size_is_refused(run2, tmp_path):
    r = _run(*TINY, "--steps", "6", "--nproc", "1", "--out", str(tmp_path / "one"), "--resume", str(run2))
    assert r.returncode == 2
    assert "written by 2 worker(s) and this run has 1" in r.stderr and "--nproc 2" in r.stderr, r.stderr[-2000:]
    # what cannot follow the run to another world size, named for this run (the tiny preset compresses)
    assert "--nnodes x --nproc-per-node = 2" in r.stderr, r.stderr[-2000:]
    assert "each worker's stream of batches" in r.stderr and "compressor's state of each worker" in r.stderr
    single = tmp_path / "single"
    r = _run(*TINY, "--steps", "3", "--nproc", "1", "--checkpoint-every", "3", "--out", str(single))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run(*TINY, "--steps", "4", "--out", str(tmp_path / "two"), "--resume", str(single))
    assert r.returncode == 2 and "written by 1 worker(s) and this run has 2" in r.stderr, r.stderr[-2000:]


def test_a_new_run_never_overwrites_an_old_one_and_the_same_command_continues_it(run2, tmp_path):
    """An --out holding checkpoints is the run they belong to: the same settings continue it (what torchrun's
    restarts need, with no flag changed), other settings are refused naming them, and nothing is touched."""
    out = _copy(run2, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = _run(*TINY, "--steps", "4", "--weight-decay", "0.5", "--out", str(out))
    assert r.returncode == 2 and "holds a run that this command would continue" in r.stderr, r.stderr[-2000:]
    assert "weight_decay=0.1 -> 0.5" in r.stderr, r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    other = tmp_path / "other"  # files but no checkpoint: another run's, never taken over
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("checkpoints"))
    r = _run(*TINY, "--steps", "4", "--out", str(other))
    assert r.returncode == 2 and "is not empty" in r.stderr, r.stderr[-2000:]
    r = _run(*TINY, "--steps", "4", "--out", str(out))
    assert r.returncode == 0 and "Nothing to do" in r.stdout, r.stderr[-2000:]


def test_a_raised_manifest_step_is_refused_before_anything_is_decided(run2, tmp_path):
    """A manifest whose step was raised by 1,000 made a resume print "Nothing to do: the checkpoint has 1004 steps" and
    exit 0 (issue 49): the step is read from the checkpoint's verified data first, and a manifest that disagrees with
    it is refused in one line; nothing is written."""
    out = _copy(run2, tmp_path)
    ckpt = out / "checkpoints" / "step_00000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["step"] += 1000
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = _run(*TINY, "--steps", "6", "--out", str(tmp_path / "b"), "--resume", str(ckpt))
    assert r.returncode == 2 and "holds step 4 and its manifest names step '1004'" in r.stderr, r.stderr[-2000:]
    assert "Nothing to do" not in r.stdout and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_resume_into_the_same_directory_from_an_older_checkpoint(run2, tmp_path):
    """As after a kill between a checkpoint's rename and the update of ``latest``: latest names step 2 while
    step 4 exists. The resumed run saves step 4 again (replacing it), keeps every metrics row, and continues the
    same trajectory."""
    out = _copy(run2, tmp_path)
    old = _metrics(out)
    config_before = (out / "config.toml").read_bytes()
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    r = _run(*TINY, "--steps", "6", "--checkpoint-every", "2", "--out", str(out), "--resume", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    superseded = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [row["step"] for row in superseded] == [3, 4]  # moved, not deleted
    assert [row["loss"] for row in rows[:4]] == [row["loss"] for row in old]  # the same trajectory, bitwise
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert (out / "config.toml").read_bytes() == config_before and (out / "config.resume1.toml").is_file()
    checkpoint.verify(out / "checkpoints" / "step_00000004")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(run2, tmp_path, damage):
    out = _copy(run2, tmp_path)
    ckpt = out / "checkpoints" / "step_00000004"
    data = sorted(ckpt.glob("*.distcp"))[0]
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        mid = len(raw) // 2
        raw[mid : mid + 400] = bytes(b ^ 0xFF for b in raw[mid : mid + 400])
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "delete":
        data.unlink()
    else:
        (ckpt / "manifest.json").unlink()
    r = _run(*TINY, "--steps", "6", "--out", str(tmp_path / "again"), "--resume", str(out))
    assert r.returncode == 2, r.stderr[-2000:]
    expect = {
        "flip": "is corrupted",
        "truncate": "is corrupted",
        "delete": "is missing",
        "manifest": "no manifest.json",
    }
    assert expect[damage] in r.stderr and (damage == "manifest" or data.name in r.stderr), r.stderr[-2000:]
    assert "an older complete checkpoint is" in r.stderr and "step_00000002" in r.stderr, r.stderr[-2000:]
    assert len(_lines(r.stderr)) == 1, r.stderr


def test_worker_failures_reach_the_user_as_one_line(run2, tmp_path):
    # another model shape: refused before any worker starts, naming the setting
    r = _run(*TINY, "--steps", "6", "--block-size", "16", "--out", str(tmp_path / "a"), "--resume", str(run2))
    assert r.returncode == 2
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "block_size=32 -> 16" in lines[0], r.stderr[-3000:]
    # a non-finite gradient under DDP surfaces as the compressor's error, not as DDP's RuntimeError
    r = _run(
        *TINY,
        "--steps",
        "4",
        "--parallel",
        "ddp",
        "--compressor",
        "int8",
        "--lr",
        "1e30",
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--checkpoint-every",
        "1",
        "--out",
        str(tmp_path / "b"),
    )
    assert r.returncode == 1
    lines = [line for line in _lines(r.stderr) if not line.startswith("Resume from")]
    assert len(lines) == 1 and "training stopped at step 2: QuantizedCompressor: non-finite gradient" in lines[0]
    assert "the last good checkpoint is" in lines[0], lines
    assert "at a lower learning rate with the same command and --resume" in lines[0], lines
    # too little data for two workers: refused before any worker starts (and before --out exists), once
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "one.txt").write_text("0123456789")
    r = _run(*TINY, "--data", "textdir", "--data-path", str(texts), "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and len(_lines(r.stderr)) == 1 and "too small" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "c").exists()


def test_resumed_run_reports_the_whole_run(run2, tmp_path):
    """A resume into a new directory continues the run's byte and time counters (the summary's ratio)."""
    step2 = run2 / "checkpoints" / "step_00000002"
    r = _run(*TINY, "--steps", "4", "--out", str(tmp_path / "resumed"), "--resume", str(step2))
    assert r.returncode == 0, r.stderr[-2000:]
    full = json.loads((run2 / "summary.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["bytes_sent"] == full["bytes_sent"] and resumed["bytes_uncompressed"] == full["bytes_uncompressed"]
    assert resumed["first_loss"] == full["first_loss"] and resumed["final_loss"] == full["final_loss"]


def test_one_worker_under_ddp_and_the_tiny_preset_with_demo(tmp_path):
    r = _run(*TINY, "--steps", "3", "--parallel", "ddp", "--nproc", "1", "--out", str(tmp_path / "ddp1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert resolve("tiny", None, {"optimizer": "demo"}).compressor == "none"  # the preset's choice yields
    assert resolve("tiny", None, {}).compressor == "powersgd:rank=2,start=2"


# ---------------------------------------------------------------- 7. bad input: one clear line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "100000"], "Invalid threads=100000: this machine has"),
        (["--data-max-mb", "inf"], "Invalid data_max_mb=inf: must be a finite number"),
        (["--timeout-s", "1e300"], "Invalid timeout_s=1e+300: must be from 1 to"),
        (["--seed", "12345678901234567890123"], "Invalid seed=12345678901234567890123: must fit in 64 bits"),
        (["--compressor", "powersgd:rank=4,rank=8"], "'rank' is given twice"),
        (["--compressor", "powersgd:iters=2,num_iters_per_step=3"], "both by its short and its long name"),
        (["--compressor", "int8:stochastic=maybe"], "Invalid stochastic='maybe'"),
        (["--data-max-mb", "1e300"], "must be at most"),
        (["--data-max-mb", "1e-9"], "at least 0.001"),
        (["--lr", "1e300"], "must be at most"),
        (["--block-size", "1099511627776"], "must be at most"),
        (["--nproc", "100000"], "must be at most"),
        (["--timeout-s", "1e-9"], "must be from 1"),
        (["--backend", "nccl"], "needs CUDA"),
        (["--out", ""], "give --out a path"),
        (["--compressor", "powersgd:seed=99999999999999999999"], "below 2**63"),
        (["--config", "/proc/self/mem"], "cannot be read"),
    ],
)
def test_bad_values_are_one_line_errors(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "tiny", "--out", str(tmp_path / "o"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"train.bin": 3}, "an odd number"),
        ({"train.bin": 4}, "holds 2 tokens"),
        ({"train.bin": 4000, "val.bin": 1001}, "an odd number"),
        ({"train.bin": 4000, "val.bin": 0}, "holds 0 tokens"),
    ],
)
def test_malformed_bin_files_are_refused(files, message, capsys, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for name, size in files.items():
        (d / name).write_bytes(bytes(size))
    with pytest.raises(SystemExit):
        main(["train", "--preset", "tiny", "--data", "bin", "--data-path", str(d), "--out", str(tmp_path / "o")])
    assert message in capsys.readouterr().err


def test_data_max_mb_holds_inside_one_file(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "big.txt").write_bytes(b"abcdefgh" * 250_000)  # 2 MB in one file
    data = load_data(resolve("tiny", None, {"data": "textdir", "data_path": str(d), "data_max_mb": 0.5}))
    assert data.train.numel() + data.val.numel() == 500_000


def test_compressor_refuses_a_parameter_twice_and_misshapen_state():
    p = torch.nn.Parameter(torch.randn(64, 48))
    with pytest.raises(ValueError, match="listed twice"):
        make_compressor("int8", [p, p])
    for name, key in (("int8", "errors"), ("powersgd", "q")):
        comp = make_compressor(
            name, [("w", p)], **({"rank": 2, "start_compressing_after_num_steps": 0} if name == "powersgd" else {})
        )
        p.grad = torch.randn(64, 48)
        comp.reduce_gradients()
        state = comp.state_dict()
        bad = dict(state, **{key: [torch.zeros(7, 3)]})
        with pytest.raises(ValueError, match=rf"{key}\[0\] is \[7, 3\]"):
            comp.load_state_dict(bad)
        nan = dict(state, **{key: [torch.full_like(state[key][0], float("nan"))]})
        with pytest.raises(ValueError, match="NaN or Inf"):
            comp.load_state_dict(nan)
        comp.load_state_dict(state)  # the real one still loads


# ---------------------------------------------------------------- found by trying to break the above


def _bytearray_bomb(n: int) -> bytes:
    """A torch.save payload whose pickle builds bytearray(n): weights_only admits it, so it is a memory bomb."""
    buf = io.BytesIO()
    torch.save(0.1, buf)
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = b"\x80\x02cbuiltins\nbytearray\n\x8a\x08" + n.to_bytes(8, "little") + b"\x85R."
            dst.writestr(info.filename, data)
    return out.getvalue()


def test_allocation_bombs_are_refused_before_loading(tmp_path):
    from powertrain.serialize import TENSOR_GLOBALS, UnsafeData, check_torch_pickle

    bomb = _bytearray_bomb(1 << 40)  # a terabyte, from 800 bytes
    assert len(bomb) < 2000
    for allowed in ((), TENSOR_GLOBALS):
        with pytest.raises(UnsafeData, match=r"names builtins\.bytearray"):
            check_torch_pickle(bomb, allowed=allowed, what="item")
    small = _bytearray_bomb(16)  # the control: torch's weights_only loader does build it
    assert torch.load(io.BytesIO(small), weights_only=True) == bytearray(16)
    # through a checkpoint: an optimizer item replaced by the bomb, checksums updated
    ckpt, model, opt = _small_checkpoint(tmp_path)
    meta = checkpoint.read_metadata(ckpt)
    info = next(v for i, v in meta.storage_data.items() if i.fqn == "optim.param_groups.0.lr")
    data = ckpt / info.relative_path
    raw = data.read_bytes()
    evil = _bytearray_bomb(1 << 40)
    data.write_bytes(raw[: info.offset] + evil + raw[info.offset + info.length :])
    shift = len(evil) - info.length
    for v in meta.storage_data.values():
        if v.relative_path == info.relative_path and v.offset > info.offset:
            v.offset += shift
    info.length = len(evil)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match="bytearray"):
        load_checkpoint(ckpt, model, opt, {})


def test_blob_size_is_bounded_by_what_is_stored(tmp_path):
    ckpt, model, opt = _small_checkpoint(tmp_path)
    meta = checkpoint.read_metadata(ckpt)
    key = next(k for k in meta.state_dict_metadata if k.startswith("rank."))
    meta.state_dict_metadata[key].size = torch.Size([8_000_000_000])
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match="claims a size its data file does not hold"):
        load_checkpoint(ckpt, model, opt, {})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "symlink", "transform", "junk_manifest", "step_type"])
def test_special_files_and_junk_are_refused_without_hanging(tmp_path, kind):
    ckpt, model, opt = _small_checkpoint(tmp_path)
    data = next(ckpt.glob("*.distcp"))
    if kind == "fifo":  # a listed name that is a pipe: open() would block for ever
        data.unlink()
        os.mkfifo(data)
        match = "not a regular file"
    elif kind == "symlink":
        target = tmp_path / "elsewhere.distcp"
        shutil.move(data, target)
        data.symlink_to(target)
        match = "not a regular file"
    elif kind == "transform":  # decompression has no size bound
        meta = checkpoint.read_metadata(ckpt)
        next(iter(meta.storage_data.values())).transform_descriptors = ["stream.zstd/1"]
        (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
        _rewrite_manifest(ckpt)
        match = "stream transforms"
    elif kind == "junk_manifest":
        (ckpt / "manifest.json").write_text("[1, 2]")
        match = "not a format-3 powertrain manifest"
    else:
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["step"] = "abc"
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        match = "step is not a valid count"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt, model, opt, {})


def test_reference_powersgd_refuses_misfit_residuals_before_changing_anything():
    from powertrain.powersgd import Config, PowerSGD

    params = [torch.nn.Parameter(torch.randn(32, 24))]
    ps = PowerSGD(params, config=Config(rank=2, start_compressing_after_num_steps=0))
    state = ps.state_dict()
    before = ps.compressor.state_dict()
    for bad, match in (([torch.full((32, 24), float("nan"))], "NaN or Inf"), ([torch.zeros(3, 3)], r"\[3, 3\]")):
        with pytest.raises(ValueError, match=match):
            ps.load_state_dict(dict(state, residuals=bad))
        assert ps.compressor.state_dict()["steps"] == before["steps"]
    with pytest.raises(ValueError, match="missing"):
        ps.load_state_dict({"compressor": state["compressor"]})


def test_resume_guards(run2, tmp_path):
    """A failed resume changes nothing; another run's directory is never taken over; settings a checkpoint restores
    cannot silently differ; two runs never share a directory."""
    out = _copy(run2, tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    # another model: latest, config and checkpoints stay as they were
    step2 = out / "checkpoints" / "step_00000002"
    r = _run(*TINY, "--steps", "6", "--block-size", "16", "--out", str(out), "--resume", str(step2))
    assert r.returncode == 2 and "block_size=32 -> 16" in r.stderr, r.stderr[-2000:]  # refused before any worker
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    # a checkpoint of a run in a subdirectory does not make --out resumable
    sub = out / "sub" / "checkpoints"
    sub.mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000002", sub / "step_00000002")
    r = _run(*TINY, "--steps", "6", "--out", str(out), "--resume", str(sub / "step_00000002"))
    assert r.returncode == 2 and "is not empty" in r.stderr, r.stderr[-2000:]
    # a run holding the lock keeps a second one out
    import fcntl

    with (out / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r = _run(*TINY, "--steps", "6", "--out", str(out), "--resume", str(out))
    assert r.returncode == 2 and "Another run is using" in r.stderr, r.stderr[-2000:]


def test_validation_split_too_small_fails_before_training(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("x" * 3000)
    r = _run(
        *TINY,
        "--data",
        "textdir",
        "--data-path",
        str(texts),
        "--block-size",
        "200",
        "--steps",
        "50",
        "--out",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2 and "val split" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists(), "it failed before --out was made"


def test_workers_die_with_the_launcher(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--steps", "3000", "--block-size", "64", "--batch-size", "8", "--out", str(out)]
    (tmp_path / "tmp").mkdir()  # a launcher killed with SIGKILL cannot remove its temporary directory: keep it here
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "powertrain", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        deadline = time.monotonic() + 90
        while not ((out / "pids" / "rank0").exists() and (out / "pids" / "rank1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        pids = [int((out / "pids" / f"rank{r}").read_text()) for r in range(2)]
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        alive = lambda pid: Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in pids), "orphaned workers kept running"
    finally:
        if proc.poll() is None:
            proc.kill()
