"""What a resume may change, and what it checks in the state it restores (issue 35, items 3 and 6).

The learning rate and its schedule may change on resume (the advice after a divergence is a lower ``--lr``); every
field of the per-rank state a checkpoint restores is checked at load against the form this run would have written,
so a crafted one is refused in one line instead of failing later, or being taken silently.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_utils import run_cli
from powertrain.checkpoint import CheckpointError
from powertrain.compress import make_compressor
from powertrain.train.checkpoint import load_checkpoint, save_checkpoint
from powertrain.train.config import resolve
from powertrain.train.optimizers import build_scheduler, lr_factor


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith(" ") and "Warning" not in line]


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- item 3: the advice after a divergence can be taken


def test_a_run_that_holds_another_optimizers_setting_resumes():
    """A run written before another optimizer's settings were refused may hold one it ignored (--momentum with
    --optimizer muon): its resume compares only what the run used; sgd's own momentum still may not change."""
    import dataclasses

    from powertrain.train.checkpoint import config_changes
    from powertrain.train.config import TrainConfig

    now = dataclasses.asdict(TrainConfig(optimizer="muon"))
    assert config_changes({**now, "momentum": 0.5, "galore_rank": 3}, now) == ""
    sgd = dataclasses.asdict(TrainConfig(optimizer="sgd"))
    assert config_changes({**sgd, "momentum": 0.5}, sgd) == "momentum=0.5 -> 0.9"


def test_the_advice_after_a_divergence_names_the_matrices_rate_of_muon_and_dion(tmp_path):
    """Muon's and Dion's matrices step at --muon-lr, the rest at --lr: a divergence's advice halves both (halving --lr
    alone left the rate that diverged as it was)."""
    from powertrain.train.loop import _nonfinite_message

    for optimizer, rate in (("muon", "0.02"), ("dion", "0.01")):
        cfg = resolve("tiny", None, {"optimizer": optimizer, "compressor": "none"})
        text = _nonfinite_message(1, "loss nan", tmp_path, cfg)
        assert text.endswith(
            f"try lower rates (--lr 0.001, --muon-lr {2 * float(rate):g} now; e.g. --lr 0.0005 --muon-lr {rate})"
        ), text
        (tmp_path / "ckpt").mkdir(exist_ok=True)
        resumed = resolve(
            "tiny", None, {"optimizer": optimizer, "compressor": "none", "resume": str(tmp_path / "ckpt")}
        )
        text = _nonfinite_message(1, "loss nan", tmp_path, resumed)
        assert text.endswith(f"--lr 0.0005 --muon-lr {rate}"), text
    adamw = _nonfinite_message(1, "loss nan", tmp_path, resolve("tiny", None, {"compressor": "none"}))
    assert adamw.endswith("try a lower --lr (now 0.001, e.g. 0.0005)") and "muon" not in adamw, adamw


def test_the_advice_after_a_divergence_is_followed_and_the_lower_lr_takes_effect(tmp_path):
    """A run continued at a far too high --lr (a change a resume accepts, and logs) diverges; its one line says how
    to continue from a checkpoint at a lower --lr; doing so (with a sane lr, from the step before) is accepted and
    sets the new rate from the resumed step on: lr x the schedule's factor at each step, exactly as a run started
    with it would have."""
    out = tmp_path / "run"
    common = [
        "train",
        "--preset",
        "tiny",
        "--nproc",
        "1",
        "--compressor",
        "none",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        "--log-every",
        "1",
    ]
    assert run_cli(*common, "--steps", "1", "--quiet").returncode == 0
    r = run_cli(*common, "--steps", "3", "--lr", "1e30")  # the same command continues the run in --out
    assert "with changed settings: steps=1 -> 3, lr=0.001 -> 1e+30, quiet=True -> False (from step 1 on)" in r.stdout, (
        r.stdout
    )
    assert r.returncode == 1, r.stderr[-2000:]
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "training stopped at step" in lines[0], lines
    named = lines[0].split("the last good checkpoint is ")[1].split(";")[0]
    advice = f"continue from it at a lower learning rate with the same command and --resume {named} --lr 5e+29"
    assert advice in lines[0], lines
    first = out / "checkpoints" / "step_00000001"
    r = run_cli(*common, "--steps", "3", "--resume", str(first), "--lr", "0.002", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = resolve("tiny", None, {"steps": 3, "lr": 0.002})
    logged = {row["step"]: row["lr"] for row in _metrics(out) if "lr" in row}
    assert logged[2] == 0.002 * lr_factor(2, cfg) and logged[3] == 0.002 * lr_factor(3, cfg), logged
    # what a resume may not change is still refused, in one line, before any worker starts
    r = run_cli(*common, "--steps", "3", "--resume", str(first), "--weight-decay", "0.5", "--quiet")
    assert r.returncode == 2 and "weight_decay=0.1 -> 0.5" in r.stderr and len(_lines(r.stderr)) == 1, r.stderr


# ---------------------------------------------------------------- item 6: crafted per-rank state, refused at load


class _Crafted:
    """A per-rank part whose saved state is whatever the attacker chose."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:  # pragma: no cover - only saved
        raise AssertionError


def _run_parts(lr: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cfg = resolve("tiny", None, {"steps": 10, "lr": lr})
    return model, opt, build_scheduler(cfg, opt)


def _stepped(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, opt, schedule = _run_parts()
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        schedule.step()
    return model, opt, schedule


def _refused(tmp_path: Path, step: int, saved: dict[str, Any], match: str, progress: dict | None = None) -> str:
    model, opt, _ = _stepped(2)
    ckpt = save_checkpoint(
        tmp_path / f"c{len(list(tmp_path.iterdir()))}",
        step,
        model,
        opt,
        {k: _Crafted(v) for k, v in saved.items()},
        progress,
    )
    fresh_model, fresh_opt, schedule = _run_parts()
    with pytest.raises((CheckpointError, ValueError), match=match) as e:  # the run maps resume's ValueError
        load_checkpoint(ckpt, fresh_model, fresh_opt, {"scheduler": schedule})
        schedule.resume(step)  # what the run does next
    assert "\n" not in str(e.value) and len(str(e.value)) < 500, str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("optimizer", 5, "optimizer"),
        ("get_lr", 0, "get_lr"),
        ("last_epoch", "x", "last_epoch is of type str, expected int"),
        ("last_epoch", True, "last_epoch is of type bool"),
        ("last_epoch", -1, "at step -1"),
        ("base_lrs", [0.1, 0.1], "base_lrs has 2 entries, expected 1"),
        ("base_lrs", [math.inf], "base_lrs\\[0\\] is inf"),
        ("_last_lr", "0.1", "_last_lr is of type str"),
    ],
)
def test_a_crafted_schedule_is_refused_at_load(tmp_path, field, value, match):
    """LambdaLR restores its state through ``__dict__.update``: an ``optimizer=5`` or ``get_lr=0`` crashed
    mid-run, ``last_epoch="x"`` too. The schedule's state must have exactly the keys and types this run writes."""
    _, _, schedule = _stepped(2)
    state = schedule.state_dict()
    if field in state:
        state[field] = value
    else:
        state = {**state, field: value}
    _refused(tmp_path, 2, {"scheduler": state}, match)


def test_a_crafted_rate_never_reaches_the_optimizer_and_the_schedule_must_be_at_the_checkpoints_step(tmp_path):
    """``base_lrs=[1e30]`` was applied: the rate now comes from this run's --lr and the step. A schedule saved at
    another step than the checkpoint's is refused."""
    model, opt, schedule = _stepped(2)
    state = schedule.state_dict()
    ckpt = save_checkpoint(
        tmp_path / "a", 2, model, opt, {"scheduler": _Crafted({**state, "base_lrs": [1e30], "_last_lr": [1e30]})}
    )
    fresh_model, fresh_opt, fresh = _run_parts()
    step, _ = load_checkpoint(ckpt, fresh_model, fresh_opt, {"scheduler": fresh})
    fresh.resume(step)
    cfg = resolve("tiny", None, {"steps": 10, "lr": 0.1})
    assert fresh.get_last_lr() == [0.1 * lr_factor(2, cfg)] == [g["lr"] for g in fresh_opt.param_groups]
    fresh.step()
    assert fresh.get_last_lr() == [0.1 * lr_factor(3, cfg)]
    # the same, unchanged, is bitwise what the uninterrupted schedule does
    schedule.step()
    assert schedule.get_last_lr() == fresh.get_last_lr()
    _refused(tmp_path, 3, {"scheduler": state}, "the schedule's state is at step 2 and the checkpoint at 3")


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (-3, "manifest.json' is not a format-3 powertrain manifest: step is not a valid count"),
        (0, "holds step 0, which no run saves"),
    ],
)
def test_a_step_counter_that_no_run_writes_is_refused(tmp_path, step, match):
    """A step of -3 trained steps -2 ... and wrote step_-0000002; a run saves after its first step at the earliest.
    (A step that differs from the manifest's: the next test.)"""
    model, opt, _ = _stepped(2)
    ckpt = save_checkpoint(tmp_path / "a", step, model, opt, {})
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt, *_run_parts()[:2], {})


def test_a_step_that_differs_from_the_manifest_and_damaged_counters_are_refused(tmp_path):
    model, opt, _ = _stepped(2)
    ckpt = save_checkpoint(tmp_path / "a", 2, model, opt, {})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["step"] = 7
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="holds step 2 and its manifest names step '7'"):
        load_checkpoint(ckpt, *_run_parts()[:2], {})
    for progress, name in (
        ({"wall_s": -1.0}, "wall_s=-1.0"),
        ({"bytes_total": math.inf}, "bytes_total=inf"),
        ({"wall_s": math.nan}, "wall_s=nan"),
    ):
        ckpt = save_checkpoint(tmp_path / name, 2, model, opt, {}, progress)
        with pytest.raises(CheckpointError, match=f"holds {name}, which no run writes"):
            load_checkpoint(ckpt, *_run_parts()[:2], {})
    ckpt = save_checkpoint(tmp_path / "ok", 2, model, opt, {}, {"first_loss": math.nan, "wall_s": 1.5})
    assert load_checkpoint(ckpt, *_run_parts()[:2], {})[1]["wall_s"] == 1.5  # NaN first loss: not logged yet


@pytest.mark.parametrize("name", ["powersgd", "int8"])
@pytest.mark.parametrize(
    ("steps", "match"),
    [
        ([], "has 0 steps, expected one per parameter \\(2\\)"),
        ([1, -3], "steps\\[1\\] is -3, expected a count"),
        ([1, True], "steps\\[1\\] is True"),
        ("12", "has str steps"),
    ],
)
def test_a_compressors_step_counters_are_checked(name, steps, match):
    """A PowerSGD ``steps`` list shorter than the parameters gave an IndexError inside a later step."""
    params = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12, 8))]
    comp = make_compressor(name, params, **({"rank": 2} if name == "powersgd" else {}))
    for p in params:
        p.grad = torch.randn_like(p)
    comp.reduce_gradients()
    state = comp.state_dict()
    with pytest.raises(ValueError, match=match):
        comp.load_state_dict({**state, "steps": steps})
    comp.load_state_dict(state)  # the real one still loads


# ---------------------------------------------------------------- per-rank optimizers and local updates: checked


def _stepped_optimizer(make: Any, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    opt = make(model.parameters())
    for _ in range(steps):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _set(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """``state`` with the entry at ``path`` replaced by ``value`` (or removed: ``...``)."""
    import copy

    out = copy.deepcopy(state)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("param_groups", 0, "weight_decay"), 50.0, "weight_decay \\(group 0\\) is 50.0 and this run's 0.01"),
        (("param_groups", 0, "lr"), "0.1", "lr \\(group 0\\) is of type str, expected float"),
        (("param_groups", 0, "lr"), math.nan, "lr \\(group 0\\) is nan"),
        (("param_groups", 0, "extra"), 1, "parameter group 0 holds .*'extra'"),
        (("param_groups", 0, "betas"), [0.9, 0.999], "betas \\(group 0\\) is of type list, expected tuple"),
        (("state", 0, "exp_avg"), torch.zeros(3), "exp_avg for parameter 0 is \\(3,\\), expected a tensor of shape"),
        (("state", 0, "exp_avg_sq"), ..., "state for parameter 0 holds \\['exp_avg', 'step'\\]"),
        (("state", 0, "step"), 2, "step for parameter 0 is int, expected a tensor of shape \\(\\)"),
        (("state", 0, "exp_avg"), torch.full((6, 8), math.inf), "non-finite or complex"),
        (("state", 0, "step"), torch.tensor(-1.0), r"its step is \[-1.0\], expected a count >= 0"),
        (("state", 0, "exp_avg_sq"), torch.full((6, 8), -1.0), "its exp_avg_sq holds negative values"),
        (("state", 0, "exp_avg"), torch.zeros(6, 8, dtype=torch.int64), "exp_avg is a torch.int64 tensor, expected"),
        (("state", 7), {}, "entry 7 for none of its 4 parameters"),
        (("state", -1), {}, "entry -1 for none of its 4 parameters"),
    ],
)
def test_a_per_rank_optimizers_crafted_state_is_refused_at_load(path, value, match):
    """A per-rank optimizer (shampoo, galore, demo; local updates' inner AdamW) loaded through torch's
    ``load_state_dict`` as it was saved: a momentum of the wrong shape failed steps later, a group's
    ``weight_decay=50`` (a setting a resume may not change) or a missing moment (restarted from zeros) were taken."""
    from powertrain.train.optimizers import RankOptimizer

    make = lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01)
    _, saved = _stepped_optimizer(make)
    state = saved.state_dict()
    _, fresh = _stepped_optimizer(make, steps=0)
    part = RankOptimizer(fresh)
    with pytest.raises(ValueError, match=match) as e:
        part.load_state_dict(_set(state, path, value))
    assert "\n" not in str(e.value) and len(str(e.value)) < 500, str(e.value)
    assert not fresh.state  # nothing was taken
    part.load_state_dict(state)  # the real one loads
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("state", 0, "step"), ..., "with step None"),
        (("state", 0, "step"), "x", "with step 'x'"),
        (("state", 0, "step"), True, "with step True"),
        (("state", 0, "exp_avg_sq"), ..., "holds \\['exp_avg', 'proj_left', 'step'\\]"),
        (("state", -1), {}, "entry -1 for none of its 4 parameters"),
        (("galore", "seed"), 1.5, "its seed is 1.5"),
    ],
)
def test_a_galore_state_is_checked_at_load(path, value, match):
    """GaLore's ``st["step"] += 1`` met a string step, or a missing ``exp_avg_sq``, in a later step (a traceback); a
    missing step restarted the bias correction and a negative index loaded into another parameter, silently."""
    from powertrain.optim import GaLoreAdamW

    _refused_then_loads(lambda ps: GaLoreAdamW(ps, lr=1e-2, rank=2, update_proj_gap=2), path, value, match)


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("shampoo", "steps"), "7", "step count is '7', expected an int >= 0"),
        (("shampoo", "steps"), -1, "step count is -1"),
        (("state", 0, "blocks", 0, "graft"), torch.zeros(3), "graft of block 0 of parameter 0 is \\(3,\\), the block"),
        (("state", 0, "blocks", 0, "roots"), [torch.zeros(3, 3)], r"roots of block 0 of parameter 0 is \[\(3, 3\)\]"),
        (("state", 0, "blocks", 0, "failures"), ..., "factors without their failure count"),
        (("state", 0, "blocks", 0, "extra"), torch.zeros(1), "holds 'extra', which no block keeps"),
        # a block that stepped without what it keeps from its first step: torch took it and restarted those
        (("state", 0, "blocks", 0, "graft"), ..., r"block 0 of parameter 0 lacks \['graft'\], which every block"),
        (("state", 0, "blocks", 0, "filtered"), ..., r"lacks \['filtered'\]"),
        (("state", 0, "blocks", 5), {}, "holds block 5 of parameter 0, which this rank does not own"),
        (("state", 0, "momentum"), torch.zeros(3), r"momentum of parameter 0 is \(3,\), the parameter is \(6, 8\)"),
        # an entry of another type reached an attribute lookup (AttributeError); counters that are not counts were
        # refused only after torch's loader had replaced the state
        (("state", 0), 5, "entry 0 is not a parameter's blocks and momentum"),
        (("shampoo", "root_stats"), {"computed": "x"}, "root statistics are .*, expected counts"),
    ],
)
def test_a_shampoo_state_is_checked_at_load(path, value, match):
    """DistributedShampoo checked its factors' shapes only: a graft of the wrong shape failed in a later step, a step
    count ``"7"`` was taken through ``int()``."""
    from powertrain.optim import DistributedShampoo

    make = lambda ps: DistributedShampoo(ps, lr=1e-2, precondition_frequency=1, grafting="adam", momentum=0.9)
    _refused_then_loads(make, path, value, match)


def _refused_then_loads(make: Any, path: tuple[Any, ...], value: Any, match: str) -> None:
    """An optimizer built by ``make`` refuses its stepped state with ``value`` at ``path`` (``match``), and then
    loads the real one."""
    _, saved = _stepped_optimizer(make)
    state = saved.state_dict()
    _, fresh = _stepped_optimizer(make, steps=0)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(_set(state, path, value))
    fresh.load_state_dict(state)


def test_complex_tensors_and_a_scalar_outer_momentum_are_refused():
    """A complex tensor's Inf passed the finite check (``is_floating_point`` is False for it) and survived the cast
    to the buffer's dtype; DiLoCo's outer momentum of one element was taken for any anchor and failed at the sync."""
    from powertrain.diloco import DiLoCo, DiLoCoConfig

    params = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12, 8))]
    comp = make_compressor("int8", params)
    for p in params:
        p.grad = torch.randn_like(p)
    comp.reduce_gradients()
    state = comp.state_dict()
    bad = torch.full((16, 12), complex(math.inf, 0))
    with pytest.raises(ValueError, match=r"errors\[0\] is a torch\.complex64 tensor, expected real numbers"):
        comp.load_state_dict({**state, "errors": [bad, state["errors"][1]]})
    model = torch.nn.Linear(4, 3)
    diloco = DiLoCo(
        model.named_parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        DiLoCoConfig(sync_every=1, outer_lr=0.7, outer_momentum=0.9),  # with momentum: the buffer the test needs
    )
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        diloco.step()
    state = diloco.state_dict()
    assert state["outer"]["state"], "the outer optimizer has stepped"
    crafted = _set(state, ("outer", "state", 0, "momentum_buffer"), torch.zeros(1))
    with pytest.raises(ValueError, match="outer 'momentum_buffer' of anchor 0 has shape \\(1,\\), not \\(3, 4\\)"):
        diloco.load_state_dict(crafted)
    crafted = _set(state, ("outer", "state", 0, "momentum_buffer"), torch.full((3, 4), complex(math.inf, 0)))
    with pytest.raises(ValueError, match="outer 'momentum_buffer' of anchor 0 is not finite"):
        diloco.load_state_dict(crafted)
    # a value torch's SGD would take and fail on at the next sync, and a key it never writes (found by the probe)
    crafted = _set(state, ("outer", "state", 0, "momentum_buffer"), "x")
    with pytest.raises(ValueError, match="outer 'momentum_buffer' of anchor 0 is a str, not a tensor"):
        diloco.load_state_dict(crafted)
    crafted = _set(state, ("outer", "state", 0, "exp_avg"), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"outer optimizer has \['exp_avg'\] for anchor 0, which it never writes"):
        diloco.load_state_dict(crafted)
    diloco.load_state_dict(state)


def test_the_run_checks_a_per_rank_optimizer_at_load(tmp_path):
    """``powertrain train`` stores a per-rank optimizer through :class:`RankOptimizer`: a DeMo momentum of the wrong
    shape is refused in one line at load (it was a traceback in the step after the resume)."""
    r = run_cli(
        "train",
        "--preset",
        "tiny",
        "--nproc",
        "1",
        "--compressor",
        "none",
        "--optimizer",
        "demo",
        "--steps",
        "1",
        "--checkpoint-every",
        "1",
        "--out",
        str(tmp_path / "run"),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    from powertrain.train import loop
    from powertrain.train.optimizers import RankOptimizer

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    cfg = resolve("tiny", None, {**json.loads((ckpt / "manifest.json").read_text())["config"], "out": str(tmp_path)})
    run = loop._setup(cfg, torch.device("cpu"))
    assert isinstance(run.per_rank["optimizer"], RankOptimizer)
    load_checkpoint(ckpt, run.model, run.dcp_optimizer, run.per_rank)
    saved = {name: part.state_dict() for name, part in run.per_rank.items()}
    saved["optimizer"]["state"][0]["momentum"] = torch.zeros(3)
    crafted = save_checkpoint(tmp_path / "crafted", 1, run.model, None, {k: _Crafted(v) for k, v in saved.items()})
    with pytest.raises(CheckpointError, match="momentum for parameter 0 is \\(3,\\), expected a tensor of shape"):
        load_checkpoint(crafted, run.model, run.dcp_optimizer, run.per_rank)


def test_the_replicated_optimizers_hyperparameters_are_this_runs(tmp_path):
    """adamw and sgd travel through DCP, which restored the saved param_groups as they were: a weight_decay of 50 in
    the file was taken silently. The saved groups must be this run's; the learning rate is the schedule's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    crafted = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=50.0)
    model(torch.randn(2, 4)).sum().backward()
    crafted.step()
    ckpt = save_checkpoint(tmp_path / "a", 1, model, crafted, {})
    fresh = torch.nn.Linear(4, 3)
    with pytest.raises(CheckpointError, match=r"weight_decay \(group 0\) is 50.0 and this run's 0.1: a resume"):
        load_checkpoint(ckpt, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1, weight_decay=0.1), {})
    opt = torch.optim.AdamW(fresh.parameters(), lr=0.1, weight_decay=50.0)  # the same settings, another lr: loads
    load_checkpoint(ckpt, fresh, opt, {})
    assert opt.param_groups[0]["weight_decay"] == 50.0 and torch.equal(fresh.weight, model.weight)


def test_the_replicated_optimizers_state_values_are_checked(tmp_path):
    """adamw, sgd and Muon under DDP or FSDP travel through DCP, whose state torch took as it was: a step of -1
    divided by zero in AdamW's first step, a negative second moment gave NaN a step later, an integer momentum was
    cast. Each is refused at load in one line."""
    for name, value, match in (
        ("step", torch.tensor(-1.0), "its step is \\[-1.0\\], expected a count >= 0"),
        ("exp_avg_sq", -torch.ones(3, 4), "its exp_avg_sq holds negative values"),
        ("exp_avg", torch.ones(3, 4, dtype=torch.int64), "stored as torch.int64 \\(3, 4\\), this run's is"),
        ("exp_avg", torch.full((3, 4), math.nan), "non-finite or complex"),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        crafted = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        crafted.step()
        crafted.state[model.weight][name] = value
        ckpt = save_checkpoint(tmp_path / name / str(len(match)), 1, model, crafted, {})
        fresh = torch.nn.Linear(4, 3)
        with pytest.raises(CheckpointError, match=match) as e:
            load_checkpoint(ckpt, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1), {})
        assert "\n" not in str(e.value) and "weight" in str(e.value), str(e.value)


def _composite(kind: str) -> Any:
    """Muon or Dion on the first (6 x 8) weight, AdamW on the rest."""
    from powertrain.optim import Dion, Muon

    def make(ps: Any) -> torch.optim.Optimizer:
        ps = list(ps)
        if kind == "dion":
            return Dion(
                [{"params": ps[:1], "algorithm": "dion"}, {"params": ps[1:], "algorithm": "adamw"}], rank_fraction=0.5
            )
        return Muon([{"params": ps[:1], "algorithm": "muon"}, {"params": ps[1:], "algorithm": "adamw"}])

    return make


@pytest.mark.parametrize(
    ("kind", "path", "value", "match"),
    [
        (
            "dion",
            ("state", 0, "Q"),
            torch.zeros(8, 3),
            r"Q for parameter 0 is \(8, 3\), expected a tensor of shape \(6, 3\)",
        ),
        ("dion", ("state", 0, "momentum"), ..., r"state for parameter 0 holds \['Q'\], expected \['Q', 'momentum'\]"),
        ("dion", ("state", 0, "Q"), torch.full((6, 3), math.nan), "non-finite or complex"),
        ("dion", ("state", 0), ..., r"no entry for parameter\(s\) \[0\], which this optimizer always keeps state"),
        ("dion", ("state", 0), {}, r"no entry for parameter\(s\) \[0\]"),
        ("dion", ("param_groups", 0, "rank_fraction"), 1.0, r"rank_fraction \(group 0\) is 1.0 and this run's 0.5"),
        ("dion", ("state", 1, "exp_avg"), torch.zeros(6, 8), r"exp_avg for parameter 1 is \(6, 8\), expected"),
        ("muon", ("state", 0, "momentum_buffer"), torch.zeros(3), r"momentum_buffer for parameter 0 is \(3,\)"),
        ("muon", ("state", 0, "exp_avg"), torch.zeros(6, 8), r"holds \['exp_avg', 'momentum_buffer'\]"),
        ("muon", ("param_groups", 0, "ns_steps"), 3, r"ns_steps \(group 0\) is 3 and this run's 5"),
        ("muon", ("param_groups", 1, "algorithm"), "muon", r"algorithm \(group 1\) is 'muon' and this run's 'adamw'"),
    ],
)
def test_a_composite_optimizers_state_is_checked_per_group_at_load(kind, path, value, match):
    """Muon's and Dion's state as a per-rank part (Dion always; Muon inside local updates): each parameter's keys and
    shapes are its group's algorithm's (Dion's right factor is min(shape) x rank, not the parameter's shape)."""
    from powertrain.train.optimizers import RankOptimizer

    _, saved = _stepped_optimizer(_composite(kind))
    state = saved.state_dict()
    _, fresh = _stepped_optimizer(_composite(kind), steps=0)
    before = fresh.state_dict()  # Dion's matrices have their state from the start: zero momentum, a random Q
    part = RankOptimizer(fresh)
    with pytest.raises(ValueError, match=match) as e:
        part.load_state_dict(_set(state, path, value))
    assert "\n" not in str(e.value) and len(str(e.value)) < 500, str(e.value)
    after = fresh.state_dict()  # nothing was taken
    assert after["state"].keys() == before["state"].keys()
    assert all(
        torch.equal(a, b)
        for k in before["state"]
        for a, b in zip(before["state"][k].values(), after["state"][k].values(), strict=True)
    )
    part.load_state_dict(state)
