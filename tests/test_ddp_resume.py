"""DDP + compressor: save, load in new processes (plain per-rank state dicts and DCP), keep training ==
the uninterrupted run, bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dist_utils import run_ranks
from models import flat_params, make_model
from powertrain import checkpoint
from powertrain.checkpoint import CompressorState
from powertrain.compress import make_compressor
from test_ddp import CASES, _ddp, _loss, _teacher_batch

RESUME_CASES = ["powersgd", "powersgd_paper_k2", "int8", "int4", "topk", "randk", "sign"]
TOTAL, SAVE_AT = 8, 4


def _run(rank: int, name: str, ckpt: str, mode: str) -> torch.Tensor:
    """mode: "full" (trains TOTAL steps, saving at SAVE_AT both ways), "plain" or "dcp" (resumes)."""
    model = make_model()
    ddp, hook = _ddp(model, *CASES[name])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0
    if mode == "plain":
        state = torch.load(f"{ckpt}/{name}-rank{rank}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        hook.load_state_dict(state["compressor"])
        start = SAVE_AT
    elif mode == "dcp":
        model_sd, optim_sd = get_state_dict(model, opt)  # initialises the optimizer state DCP loads into
        state = {"model": model_sd, "optim": optim_sd, "compressor": CompressorState(hook.compressor)}
        # The unused layer never had Adam state; get_state_dict makes a slot for it that the checkpoint lacks.
        checkpoint.load(state, f"{ckpt}/{name}-dcp", optional=checkpoint.never_stepped("optim"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = SAVE_AT
    for step in range(start, TOTAL):
        if step == SAVE_AT and mode == "full":
            plain = {"model": model.state_dict(), "optim": opt.state_dict(), "compressor": hook.state_dict()}
            torch.save(plain, f"{ckpt}/{name}-rank{rank}.pt")
            model_sd, optim_sd = get_state_dict(model, opt)
            checkpoint.save(
                {"model": model_sd, "optim": optim_sd, "compressor": CompressorState(hook.compressor)},
                f"{ckpt}/{name}-dcp",
            )
        opt.zero_grad()
        _loss(ddp, *_teacher_batch(rank, step)).backward()
        opt.step()
    return flat_params(model)


def run_all(rank: int, world_size: int, ckpt: str, mode: str) -> dict[str, Any]:
    return {name: _run(rank, name, ckpt, mode) for name in RESUME_CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def runs(request, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ddp-ckpt"))
    return {mode: run_ranks(run_all, request.param, ckpt, mode, timeout=120) for mode in ("full", "plain", "dcp")}


@pytest.mark.parametrize("name", RESUME_CASES)
@pytest.mark.parametrize("mode", ["plain", "dcp"])
def test_resume_is_bitwise(runs, name, mode):
    # Bitwise on any CPU: the state is restored bit for bit, then the same operations run (see test_powersgd_resume).
    for full, resumed in zip(runs["full"], runs[mode], strict=True):
        assert torch.equal(full[name], resumed[name])


def test_dcp_refuses_another_world_size(tmp_path):
    """A checkpoint from 2 ranks does not fit 1 process: a clear error, not silently dropped state."""
    model = make_model()
    comp = make_compressor("int8", model.parameters())
    state = {"rank0_of_2": None}
    with pytest.raises(ValueError, match="world size it was saved with"):
        CompressorState(comp).load_state_dict(state)
