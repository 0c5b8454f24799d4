"""Run checkpoints at world size 1: atomic layout, resume picks the newest complete one, clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from powertrain.checkpoint import CheckpointError
from powertrain.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


def test_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    model, opt = _model_and_opt()
    counter = _Counter()
    counter.value = 7
    first = save_checkpoint(tmp_path, 3, model, opt, {"c": counter})
    # A save that died half-way: its files exist only under the .tmp name, and "latest" was never moved.
    second = save_checkpoint(tmp_path, 6, model, opt, {"c": counter})
    shutil.move(second, second.with_name(second.name + ".tmp"))
    (tmp_path / "checkpoints" / "latest").write_text(first.name + "\n")
    assert find_checkpoint(tmp_path) == first
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    loaded = _Counter()
    assert load_checkpoint(first, fresh, fresh_opt, {"c": loaded})[0] == 3
    assert loaded.value == 7
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="No checkpoint at"):
        find_checkpoint(tmp_path)
    model, opt = _model_and_opt()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {})
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(ValueError, match="made for another model"):
        load_checkpoint(ckpt, other, torch.optim.AdamW(other.parameters()), {})


def test_metadata_cannot_run_code(tmp_path):
    """DCP pickles its metadata; a crafted .metadata naming anything else is refused, never executed."""
    import pickle

    model, opt = _model_and_opt()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {})

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata' is corrupted"):  # the checksum catches it first
        load_checkpoint(ckpt, model, opt, {})
    import hashlib
    import json

    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"names builtins\.print, which is not allowed"):  # then the unpickler
        load_checkpoint(ckpt, model, opt, {})
