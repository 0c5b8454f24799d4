"""Save, load into a fresh process group, keep training == the uninterrupted run, bitwise."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from models import batch, flat_params, loss_fn, make_model
from powertrain.compress import PowerSGDCompressor
from powertrain.compress.powersgd import Config
from powertrain.powersgd import PowerSGD, optimizer_step

TOTAL, SAVE_AT = 10, 5


def _build(api: str, variant: str):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = Config(
        rank=2,
        min_compression_rate=0,
        num_iters_per_step=1,
        start_compressing_after_num_steps=2,
        variant=variant,
    )
    if api == "reference":
        agg = PowerSGD(list(model.parameters()), config=cfg)
    else:
        agg = PowerSGDCompressor(model.named_parameters(), config=cfg)
    return model, opt, agg


def _step(api, model, opt, agg, rank, step):
    loss_fn(model, *batch(rank, step)).backward()
    if api == "reference":
        optimizer_step(opt, agg)
    else:
        agg.reduce_gradients()
        opt.step()
        opt.zero_grad()


CASES = [("reference", "alternating"), ("compressor", "paper"), ("compressor", "alternating")]


def train(rank: int, api: str, variant: str, ckpt_dir: str, resume: bool) -> torch.Tensor:
    model, opt, agg = _build(api, variant)
    path = f"{ckpt_dir}/{api}-{variant}-rank{rank}.pt"
    start = 0
    if resume:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        agg.load_state_dict(state["powersgd"])
        start = SAVE_AT
    for step in range(start, TOTAL):
        if step == SAVE_AT and not resume:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "powersgd": agg.state_dict()}
            torch.save(state, path)
        _step(api, model, opt, agg, rank, step)
    return flat_params(model)


def train_all(rank: int, world_size: int, ckpt_dir: str, resume: bool) -> dict[str, torch.Tensor]:
    return {f"{api}-{variant}": train(rank, api, variant, ckpt_dir, resume) for api, variant in CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def runs(request, tmp_path_factory):
    """Uninterrupted run (saving at SAVE_AT), then a new set of processes and process group resuming."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    full = run_ranks(train_all, request.param, ckpt, False, timeout=60)
    resumed = run_ranks(train_all, request.param, ckpt, True, timeout=60)
    return full, resumed


@pytest.mark.parametrize(("api", "variant"), CASES)
def test_resume_is_bitwise(runs, api, variant):
    # Bitwise on any CPU: the state is saved and restored bit for bit, and the resumed processes then run the
    # same operations on the same shapes (one thread per rank) as the uninterrupted ones.
    full, resumed = runs
    key = f"{api}-{variant}"
    for a, b in zip(full, resumed, strict=True):
        assert torch.equal(a[key], b[key])
    assert not torch.equal(full[0][key], flat_params(make_model())), "training must have changed the model"
