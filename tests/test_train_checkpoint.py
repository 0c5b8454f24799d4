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


def test_a_tensors_chunks_must_tile_it_each_with_data():
    """DCP fills whatever chunks overlap a destination and leaves the rest as it was: a crafted .metadata that
    dropped rank 1's shard of a weight left that rank's freshly initialised rows in place, exit 0. The chunks must
    tile the tensor exactly, each with stored data, in this run's dtype (DCP casts)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from powertrain.checkpoint import _check_stored

    def check(
        *chunks: tuple[tuple[int, int], tuple[int, int]],
        data: bool = True,
        shape: tuple = (4, 3),
        dtype: torch.dtype = torch.float32,
    ) -> None:
        stored = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]
        tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((4, 3)), stored)
        index = {MetadataIndex("w", c.offsets): None for c in stored} if data else {}
        _check_stored("w", tensor, torch.empty(shape, dtype=dtype), Metadata({"w": tensor}, storage_data=index))

    check(((0, 0), (2, 3)), ((2, 0), (2, 3)))  # two ranks' rows
    check(((0, 0), (4, 3)))
    for chunks, data, match in (
        ((((0, 0), (2, 3)),), True, "leave part of it out"),  # rank 1's rows dropped
        ((((0, 0), (3, 3)), ((2, 0), (2, 3))), True, "overlapping chunks"),
        ((((0, 0), (2, 3)), ((2, 0), (3, 3))), True, "a chunk outside its shape"),
        ((((0, 0), (4, 3)),), False, "without data"),
    ):
        with pytest.raises(CheckpointError, match=match):
            check(*chunks, data=data)
    with pytest.raises(
        CheckpointError, match=r"stored as torch.float32 \(4, 3\), this run's is torch.float32 \(3, 4\)"
    ):
        check(((0, 0), (4, 3)), shape=(3, 4))
    with pytest.raises(CheckpointError, match=r"this run's is torch.complex64 \(4, 3\)"):  # DCP would cast
        check(((0, 0), (4, 3)), dtype=torch.complex64)
