"""Local updates (powertrain.diloco.DiLoCo) on real gloo processes: parity with a plain reference implementation of
DiLoCo and Streaming DiLoCo, error feedback's conservation on the outer step, bitwise resume with a sync in flight,
non-finite pseudo-gradients, DDP inside a node with the hierarchical compressor between nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_utils import EPS32, EPS64, case, feedback_bound, guard, run_ranks, same_on_all_ranks, within
from models import batch, loss_fn, make_model
from powertrain.checkpoint import from_blob, to_blob
from powertrain.compress import NonFiniteGradientError
from powertrain.diloco import DiLoCo, DiLoCoConfig, split_by_size

LR = 1e-2  # the inner AdamW's


def _inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _train(model: torch.nn.Module, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        opt.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------- a plain reference, written from the papers


class _Reference:
    """DiLoCo as the papers state it, with blocking collectives: fragment k's pseudo-gradient ``anchor - local`` is
    averaged in fp32 (divided by W, then summed) after inner steps ``offset_k + j H``, and its Nesterov-SGD outer step
    is applied after ``delay`` more inner steps, then mixed into the local weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        H: int,
        groups: list[list[int]],
        delay: int,
        mix: float,
        lr: float,
        momentum: float,
        warmup: int = 0,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.warmup = warmup
        self.inner = _inner(model)
        self.anchors = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.H, self.groups, self.delay, self.mix = H, groups, delay, mix
        self.offsets = [k * H // len(groups) for k in range(len(groups))]
        self.step_count, self.pending = 0, None

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        if self.step_count < self.warmup:  # every gradient averaged in fp32 (divided by W, then summed)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(dist.get_world_size())
            dist.all_reduce(flat)
            for p, v in zip(self.params, flat.split([g.numel() for g in grads]), strict=True):
                p.grad = v.view(p.shape).clone()
        self.inner.step()
        self.step_count += 1
        if self.step_count == self.warmup:
            for a, p in zip(self.anchors, self.params, strict=True):
                a.copy_(p)
        s = self.step_count - self.warmup
        if self.pending is not None and self.pending[1] == self.step_count:
            self._apply(*self.pending[::2])
            self.pending = None
        for k, o in enumerate(self.offsets):
            if s > 0 and s >= o and (s - o) % self.H == 0:
                group = self.groups[k]
                flat = torch.cat([(self.anchors[i] - self.params[i]).reshape(-1) for i in group])
                flat.div_(dist.get_world_size())
                dist.all_reduce(flat)
                avg = [
                    v.view(self.params[i].shape)
                    for i, v in zip(group, flat.split([self.params[i].numel() for i in group]), strict=True)
                ]
                self.pending = (k, self.step_count + self.delay, avg)
                if self.delay == 0:
                    self._apply(k, avg)
                    self.pending = None

    def _apply(self, k: int, avg: list[torch.Tensor]) -> None:
        for a in self.anchors:
            a.grad = None
        for i, v in zip(self.groups[k], avg, strict=True):
            self.anchors[i].grad = v
        self.outer.step()
        for i in self.groups[k]:
            if self.mix:
                self.params[i].mul_(self.mix).add_(self.anchors[i], alpha=1 - self.mix)
            else:
                self.params[i].copy_(self.anchors[i])


PLAIN = {
    "H": 3,
    "fragments": 1,
    "sync_delay": 0,
    "sync_mix": 0.0,
    "lr": 0.7,
    "momentum": 0.9,
    "steps": 10,
    "sync_warmup": 0,
}
STREAMING = {
    "H": 6,
    "fragments": 3,
    "sync_delay": 1,
    "sync_mix": 0.5,
    "lr": 0.8,
    "momentum": 0.5,
    "steps": 14,
    "sync_warmup": 0,
}
#: three steps of exact gradient averaging first, then model averaging every 4 steps in two fragments
WARM = {
    "H": 4,
    "fragments": 2,
    "sync_delay": 1,
    "sync_mix": 0.0,
    "lr": 1.0,
    "momentum": 0.0,
    "steps": 12,
    "sync_warmup": 3,
}
SETTINGS = {"plain": PLAIN, "streaming": STREAMING, "warm": WARM}


def _parity(rank: int, setting: dict[str, Any]) -> dict[str, Any]:
    """DiLoCo and the reference, bitwise: the same operations on the same values in the same order."""
    model, ref_model = make_model(), make_model()
    diloco = DiLoCo(
        model.named_parameters(),
        _inner(model),
        DiLoCoConfig(
            sync_every=setting["H"],
            compressor="none",
            outer_lr=setting["lr"],
            outer_momentum=setting["momentum"],
            fragments=setting["fragments"],
            sync_delay=setting["sync_delay"],
            sync_mix=setting["sync_mix"],
            sync_warmup=setting["sync_warmup"],
        ),
    )
    ref = _Reference(
        ref_model,
        setting["H"],
        diloco.fragments,
        setting["sync_delay"],
        setting["sync_mix"],
        setting["lr"],
        setting["momentum"],
        setting["sync_warmup"],
    )
    mismatch, trajectory = [], []
    for step in range(setting["steps"]):
        _train(model, diloco, rank, range(step, step + 1))
        _train(ref_model, ref, rank, range(step, step + 1))
        if any(not torch.equal(a, b) for a, b in zip(_params(model), _params(ref_model), strict=True)):
            mismatch.append(step + 1)
        trajectory.append(torch.cat([p.reshape(-1) for p in _params(model)]))
    sizes = [sum(_params(model)[i].numel() for i in f) for f in diloco.fragments]
    syncs, sent = diloco.syncs, diloco.stats.bytes_sent
    diloco.finish()  # the replicas end on one model (mixed weights too)
    return {
        "mismatch": mismatch,
        "trajectory": trajectory,
        "syncs": syncs,
        "bytes": sent,
        "sizes": sizes,
        "finished": torch.cat([p.reshape(-1) for p in _params(model)]),
    }


def _conservation(rank: int, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Per sync: each rank's input (pseudo-gradient + old residual), the average and the new residual."""
    model = make_model(torch.float64)
    diloco = DiLoCo(
        model.named_parameters(),
        _inner(model),
        DiLoCoConfig(sync_every=2, fragments=2, compressor=name, compressor_options=options),
    )
    comp = diloco.compressor
    records = []
    program = comp.program

    def recorded(grads: list[torch.Tensor], indices: list[int], **kw: Any) -> Any:
        old = comp.residuals()  # type: ignore[attr-defined]
        x = [g.clone() + old[i].to(g.dtype) for g, i in zip(grads, indices, strict=True)]
        untouched = [old[i].clone() for i in range(len(old)) if i not in indices]
        records.append({"idx": list(indices), "x": x, "untouched": untouched})
        return program(grads, indices, **kw)

    comp.program = recorded  # type: ignore[method-assign]
    applied = []
    apply = diloco._apply

    def recorded_apply(pending: Any, mix: float | None = None) -> None:
        applied.append([a.clone() for a in pending.average])
        records[len(applied) - 1]["new"] = [r.clone() for r in comp.residuals()]  # type: ignore[attr-defined]
        apply(pending, mix)

    diloco._apply = recorded_apply  # type: ignore[method-assign]
    for step in range(6):
        diloco.zero_grad()
        loss_fn(model, *batch(rank, step, torch.float64)).backward()
        diloco.step()
    for r, avg in zip(records, applied, strict=True):
        r["avg"] = avg
        r["new_untouched"] = [r["new"][i] for i in range(len(r["new"])) if i not in r["idx"]]
    return {"records": records}


def _resume(rank: int) -> dict[str, Any]:
    """Save after inner step 6 (fragment 0's sync starts there and is due at step 7: in flight), restore into fresh
    objects, finish the run; the uninterrupted run must end bit-identical."""
    # with outer momentum: its buffer is resumed too
    settings = DiLoCoConfig(
        sync_every=6, fragments=3, sync_delay=1, sync_mix=0.5, compressor="int8", outer_lr=0.7, outer_momentum=0.9
    )

    def build() -> tuple[torch.nn.Module, DiLoCo]:
        model = make_model()
        return model, DiLoCo(model.named_parameters(), _inner(model), settings)

    model, diloco = build()
    _train(model, diloco, rank, range(14))
    diloco.finish()
    whole = _params(model)

    model, diloco = build()
    _train(model, diloco, rank, range(6))
    in_flight = diloco.sync.pending is not None
    saved = {
        "diloco": to_blob(diloco.state_dict()),
        "inner": to_blob(diloco.inner.state_dict()),
        "model": to_blob(model.state_dict()),
    }
    _train(model, diloco, rank, range(6, 9))  # the original goes on; the copy must not depend on it
    model, diloco = build()
    model.load_state_dict(from_blob(saved["model"]))
    diloco.inner.load_state_dict(from_blob(saved["inner"]))
    diloco.load_state_dict(from_blob(saved["diloco"]))
    _train(model, diloco, rank, range(6, 14))
    diloco.finish()
    resumed = _params(model)
    fresh = make_model()
    other = DiLoCo(fresh.named_parameters(), _inner(fresh), DiLoCoConfig(sync_every=5))
    try:
        other.load_state_dict(from_blob(saved["diloco"]))
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {
        "in_flight": in_flight,
        "same": all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True)),
        "refused": refused,
    }


def _nonfinite(rank: int) -> dict[str, Any]:
    model = make_model()
    diloco = DiLoCo(
        model.named_parameters(), _inner(model), DiLoCoConfig(sync_every=2, sync_delay=1, compressor="int8")
    )
    _train(model, diloco, rank, range(1))
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
    try:
        _train(model, diloco, rank, range(1, 3))  # the sync starts at step 2 and is due at step 3
        return {"raised": ""}
    except NonFiniteGradientError as e:
        return {"raised": str(e)}


def _crafted(rank: int) -> dict[str, Any]:
    """A state saved with a sync in flight (and outer momentum), then changed as an attacker would: each change is
    refused at load in one line, and a finish()'s syncs are not counted as late ones."""
    settings = DiLoCoConfig(
        sync_every=6, fragments=3, sync_delay=1, compressor="int8", outer_lr=0.7, outer_momentum=0.9
    )
    model = make_model()
    diloco = DiLoCo(model.named_parameters(), _inner(model), settings)
    _train(model, diloco, rank, range(6))
    good = from_blob(to_blob(diloco.state_dict()))
    late = diloco.late
    diloco.finish()
    refused: dict[str, str] = {}

    def attempt(name: str, change: Any, **other: Any) -> None:
        state = from_blob(to_blob(good))
        change(state)
        fresh = make_model()
        target = DiLoCo(fresh.named_parameters(), _inner(fresh), dataclasses.replace(settings, **other))
        try:
            target.load_state_dict(state)
            refused[name] = ""
        except ValueError as e:
            refused[name] = str(e)

    momentum = next(k for k, v in good["outer"]["state"].items() if "momentum_buffer" in v)
    attempt("due now", lambda st: st["pending"].update(due=st["step"]))
    attempt("due later", lambda st: st["pending"].update(due=st["step"] + 1000))
    attempt("other fragment", lambda st: st["pending"].update(fragment=1))
    attempt("momentum shape", lambda st: st["outer"]["state"][momentum].update(momentum_buffer=torch.zeros(3)))
    attempt("momentum nan", lambda st: st["outer"]["state"][momentum]["momentum_buffer"].fill_(float("nan")))
    attempt("lr nan", lambda st: st["outer"]["param_groups"][0].update(lr=float("nan")))
    attempt("other outer", lambda st: None, outer_lr=1.0, outer_momentum=0.0)
    return {"refused": refused, "in_flight": good["pending"] is not None, "late": (late, diloco.late)}


def _apart(rank: int) -> dict[str, Any]:
    """Replicas built on different weights: refused on every rank at construction (they would never meet); and an
    inner Muon that would share its work as if the replicas' gradients were averaged (its results from the owners'
    own momenta), refused before anything is sent, while split=False trains."""
    from powertrain.optim import Dion, Muon

    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    out = {}
    try:
        DiLoCo(model.named_parameters(), _inner(model), DiLoCoConfig(sync_every=2))
        out["raised"] = ""
    except ValueError as e:
        out["raised"] = str(e)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    try:
        DiLoCo(mlp.named_parameters(), Muon(mlp.named_parameters()), DiLoCoConfig(sync_every=2))
        out["shared"] = ""
    except ValueError as e:
        out["shared"] = str(e)
    try:
        DiLoCo(mlp.named_parameters(), Dion(mlp.named_parameters()), DiLoCoConfig(sync_every=2))
        out["dion"] = ""
    except ValueError as e:
        out["dion"] = str(e)
    diloco = DiLoCo(mlp.named_parameters(), Muon(mlp.named_parameters(), split=False), DiLoCoConfig(sync_every=2))
    for step in range(4):
        diloco.zero_grad()
        mlp(torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * rank + step))).pow(2).mean().backward()
        diloco.step()
    diloco.finish()
    out["muon"] = torch.cat([p.detach().reshape(-1) for p in mlp.parameters()])
    # a warm-up compressor on the training's group runs inside the step: not refused for overlapping with training
    from powertrain.compress import make_compressor

    warm = make_compressor("none", mlp.named_parameters())
    try:
        settings = DiLoCoConfig(sync_every=2, sync_delay=1, sync_warmup=2, warmup_compressor=warm)
        DiLoCo(mlp.named_parameters(), _inner(mlp), settings)
        out["warm"] = ""
    except ValueError as e:
        out["warm"] = str(e)
    return out


def _cases(rank: int, world: int) -> dict[str, Any]:
    out = {
        **{name: guard(_parity, rank, setting) for name, setting in SETTINGS.items()},
        "resume": guard(_resume, rank),
        "nonfinite": guard(_nonfinite, rank),
        "crafted": guard(_crafted, rank),
        "apart": guard(_apart, rank),
    }
    if world == 2:
        out["int8"] = guard(_conservation, rank, "int8", {})
        exact_factors = {
            "rank": 2,
            "start_compressing_after_num_steps": 0,
            "min_compression_rate": 0.0,
            "factor_dtype": "fp32",
        }
        out["powersgd"] = guard(_conservation, rank, "powersgd", exact_factors)
        out["topk-2bit"] = guard(_conservation, rank, "topk", {"ratio": 0.1, "bits": 2})  # SparseLoCo's message
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_ranks(_cases, request.param, timeout=120)


def _starts(setting: dict[str, Any]) -> list[tuple[int, int]]:
    """(inner step, fragment) of every sync a run of ``setting`` starts: fragment k at offset_k + j H, never at 0."""
    H, F, w = setting["H"], setting["fragments"], setting["sync_warmup"]
    return [
        (s + w, k)
        for s in range(1, setting["steps"] - w + 1)
        for k in range(F)
        if s >= k * H // F and (s - k * H // F) % H == 0
    ]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_matches_the_reference_bitwise(results, name):
    runs = case(results, name)
    for r in runs:
        assert r["mismatch"] == [], f"DiLoCo left the reference after inner steps {r['mismatch']}"
    setting = SETTINGS[name]
    starts = _starts(setting)
    assert runs[0]["syncs"] == sum(1 for s, _ in starts if s + setting["sync_delay"] <= setting["steps"])
    # exact fp32 averaging: 4 bytes per value of the fragment, handed to one all-reduce per started sync; the warm-up
    # sends every gradient every step
    warm = setting["sync_warmup"] * 4 * sum(runs[0]["sizes"])
    assert runs[0]["bytes"] == warm + sum(4 * runs[0]["sizes"][k] for _, k in starts)
    if setting["sync_warmup"]:  # the replicas train as one through the warm-up, then apart
        w = setting["sync_warmup"]
        assert all(torch.equal(r["trajectory"][w - 1], runs[0]["trajectory"][w - 1]) for r in runs)
        assert not torch.equal(runs[0]["trajectory"][w], runs[1]["trajectory"][w])
    assert all(torch.equal(r["finished"], runs[0]["finished"]) for r in runs), "finish() leaves one model"
    if name == "plain":  # right after a sync (step 9, no delay, no mix) every replica holds the anchor
        assert all(torch.equal(r["trajectory"][8], runs[0]["trajectory"][8]) for r in runs)
        assert not torch.equal(runs[0]["trajectory"][9], runs[1]["trajectory"][9])  # then each trains on its own


@pytest.mark.parametrize("name", ["int8", "powersgd", "topk-2bit"])
def test_outer_error_feedback_is_conserved(results, name):
    if len(results) != 2:
        pytest.skip("run at 2 ranks")
    runs = case(results, name)
    n_syncs = len(runs[0]["records"])
    assert n_syncs == 6  # fragment 1 (offset 1) at steps 1, 3, 5, fragment 0 at 2, 4, 6
    for s in range(n_syncs):
        recs = [r["records"][s] for r in runs]
        assert recs[0]["idx"] == recs[1]["idx"]
        for j, i in enumerate(recs[0]["idx"]):
            x = torch.stack([r["x"][j] for r in recs])
            e1 = torch.stack([r["new"][i].to(torch.float64) for r in recs])
            avg = recs[0]["avg"][j].to(torch.float64)
            err = (x.mean(0) - (avg + e1.mean(0))).abs()
            matrix = name == "powersgd" and x[0].dim() >= 2
            # int8 works in fp32 (its x is the fp32 sum: one more rounding, inside the bound's 3 W terms), PowerSGD in
            # the parameters' float64
            eps = EPS64 if name == "powersgd" else EPS32
            within(
                err,
                feedback_bound(x, e1, eps=eps, iters=1 if matrix else 0, rank=2, matrix=matrix),
                f"{name} sync {s} param {i}",
            )
        for r in recs:  # the other fragment's residuals are not touched by this sync
            for before, after in zip(r["untouched"], r["new_untouched"], strict=True):
                assert torch.equal(before.to(after.dtype), after)


def test_resume_with_a_sync_in_flight_is_bitwise(results):
    for r in case(results, "resume"):
        assert r["in_flight"], "the checkpoint was meant to catch a sync in flight"
        assert r["same"], "the resumed run differs from the uninterrupted one"
        assert "sync_every=6 -> 5" in r["refused"]


def test_crafted_state_is_refused_at_load_in_one_line(results):
    for r in case(results, "crafted"):
        assert r["in_flight"], "the state was saved with a sync in flight"
        for name, message in r["refused"].items():
            assert message and "\n" not in message, (name, message)
        assert "sync in flight is invalid" in r["refused"]["due later"]
        assert "not finite" in r["refused"]["momentum nan"] and "shape" in r["refused"]["momentum shape"]
        assert "other settings" in r["refused"]["lr nan"] and "other settings" in r["refused"]["other outer"]
        assert r["late"][0] == r["late"][1], "finish() waits for its syncs by design: not late ones"


def test_replicas_that_start_apart_are_refused(results):
    for r in case(results, "apart"):
        assert "start from different weights" in r["raised"], r["raised"]
        assert "build it with split=False" in r["shared"], r["shared"]
        assert "use an optimizer that steps alone" in r["dion"], r["dion"]  # Dion sends its factors every step
        assert r["warm"] == "", r["warm"]
    same_on_all_ranks(case(results, "apart"), "muon")  # an inner Muon per replica, then the replicas averaged


def test_nonfinite_pseudo_gradient_raises_on_every_rank(results):
    for r in case(results, "nonfinite"):
        assert "non-finite" in r["raised"], r["raised"]


def test_split_by_size():
    assert split_by_size([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert split_by_size([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_by_size([1, 1, 1, 10], 2) == [[0, 1, 2], [3]]
    assert split_by_size([100, 1, 1], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="only 2 parameters"):
        split_by_size([1, 1], 3)


def test_bad_settings_are_refused_in_one_line():
    model = make_model()
    inner = _inner(model)
    for kwargs, text in [
        ({"sync_every": 0}, "sync_every=0"),
        ({"sync_every": 4, "sync_delay": 4}, "sync_delay=4"),
        ({"sync_every": 4, "fragments": 2, "sync_delay": 2}, "sync_delay=2"),
        ({"sync_every": 2, "fragments": 3}, "fragments=3"),
        ({"sync_every": 4, "sync_mix": 1.0}, "sync_mix=1.0"),
        ({"sync_every": 4, "sync_mix": 0.5}, "sync_mix=0.5 with sync_delay=0"),
        ({"sync_every": 4, "fragments": [[0]]}, "cover"),
        ({"sync_every": 4, "fragments": [[0], []]}, "none empty"),
        ({"sync_every": 4, "compressor": "zip"}, "Unknown compressor"),
        ({"compressor": "int8", "compressor_options": 3}, "mapping"),
        ({"outer_lr": 0}, "outer_lr=0"),
        ({"outer_lr": float("nan")}, "outer_lr=nan"),
        ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
        ({"outer_lr": 10**400}, "outer_lr=1000"),
        ({"compressor": "int4", "compressor_options": {"bogus": 1}}, "Bad compressor 'int4' options"),
        ({"fragments": [[0], "x"]}, "Invalid fragments="),
        ({"sync_warmup": -1}, "sync_warmup=-1"),
        ({"outer_lr_schedule": "cosine"}, "outer_lr_schedule='cosine'"),
    ]:
        with pytest.raises(ValueError, match=text.replace("[", r"\[")) as e:
            DiLoCo(model.named_parameters(), inner, DiLoCoConfig(**kwargs))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not step"):
        DiLoCo(model.named_parameters(), torch.optim.SGD(model.fc1.parameters(), lr=1), DiLoCoConfig(sync_every=2))
    with pytest.raises(ValueError, match="config must be a DiLoCoConfig"):
        DiLoCo(model.named_parameters(), inner, {"sync_every": 2})  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="warmup_compressor='int8' has no effect without sync_warmup"):
        DiLoCoConfig(warmup_compressor="int8")
    with pytest.raises(ValueError, match="Bad warmup_compressor 'none' options"):  # exact averaging takes none
        DiLoCoConfig(warmup_options={"chunk": 64})


def test_a_script_and_the_command_compress_the_outer_step_alike():
    """PowerSGD on the outer step compresses from the first sync in a script as in the command (its exact warm-up
    steps would send whole pseudo-gradients), and the command warns once of a setting without effect."""
    import warnings

    from powertrain.train.config import TrainConfig

    model = make_model()
    script = DiLoCo(model.named_parameters(), _inner(model), DiLoCoConfig(compressor="powersgd"))
    command = TrainConfig(parallel="diloco", compressor="powersgd").local_updates
    assert command is not None and command.compressor_options["start_compressing_after_num_steps"] == 0
    assert script.compressor.config.start_compressing_after_num_steps == 0  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = TrainConfig(parallel="diloco", warmup_compressor="int8")
        cfg.local_updates, cfg.local_updates  # noqa: B018
    assert sum("no effect without sync_warmup" in str(w.message) for w in seen) == 1, [str(w.message) for w in seen]


def test_one_process_is_local_training_with_an_outer_step():
    """World size 1: the average is the replica's own pseudo-gradient, so with outer SGD at lr 1 and no momentum the
    first sync gives back the local weights, up to the roundings of anchor - (anchor - local) in fp32."""
    model, plain = make_model(), make_model()
    diloco = DiLoCo(
        model.named_parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        DiLoCoConfig(sync_every=2, compressor="none", outer_lr=1.0, outer_momentum=0.0),
    )
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    _train(model, diloco, 0, range(1))
    _train(plain, sgd, 0, range(1))
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(plain), strict=True)) and diloco.syncs == 0
    anchors = [a.clone() for a in diloco.anchors]
    _train(model, diloco, 0, range(1, 2))
    _train(plain, sgd, 0, range(1, 2))
    assert diloco.syncs == 1
    for got, local, anchor in zip(_params(model), _params(plain), anchors, strict=True):
        # fl(anchor - fl(anchor - local)): two roundings of size u = EPS32 / 2, of |anchor - local| and of |local|
        # (to first order); 2x safety
        within((got - local).abs(), EPS32 * ((anchor - local).abs() + local.abs()), "outer step at lr 1")


def test_the_outer_rate_follows_the_inner_schedule_when_asked():
    """outer_lr_schedule='inner': each outer step at outer_lr times the inner schedule's multiplier then. With the
    inner rate held at half its initial value, the run is bitwise the constant schedule's at half the outer rate
    (halving a float is exact, so the outer SGD multiplies by the same number), and at a multiplier of 1 it is the
    constant schedule's; an inner optimizer with no scheduler is refused at the first sync, saying what to attach."""

    def run(schedule: str, outer_lr: float, factor: float | None) -> list[torch.Tensor]:
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        if factor is not None:
            torch.optim.lr_scheduler.LambdaLR(inner, lambda step: factor)  # sets initial_lr, and lr to factor x it
        config = DiLoCoConfig(
            sync_every=2, compressor="none", outer_lr=outer_lr, outer_momentum=0.9, outer_lr_schedule=schedule
        )
        _train(model, DiLoCo(model.named_parameters(), inner, config), 0, range(6))
        return _params(model)

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    followed = run("inner", 0.7, 0.5)
    assert same(followed, run("constant", 0.7 * 0.5, 0.5))
    assert not same(followed, run("constant", 0.7, 0.5))  # the check bites: the schedule changed the outer steps
    assert same(run("inner", 0.7, 1.0), run("constant", 0.7, 1.0))
    with pytest.raises(ValueError, match=r"no 'initial_lr'.*attach a scheduler"):
        run("inner", 0.7, None)
    with pytest.raises(ValueError, match=r"0.2 / 0.1 here, which must lie in \[0, 1\]"):  # a rate above its start
        run("inner", 0.7, 2.0)


def test_finish_takes_the_outer_rate_of_the_last_inner_step():
    """A script steps its scheduler after each step and calls finish() after the last: the last sync's outer step
    takes the rate of the last inner step, not the scheduler's next one (0 here, which would throw the last period
    away). Its state names the schedule: a DiLoCo with the other refuses it, and a state from before the setting
    existed loads as the held rate's."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 0.5 if step < 3 else 0.0)
    config = DiLoCoConfig(sync_every=2, compressor="none", outer_lr=1.0, outer_momentum=0.0, outer_lr_schedule="inner")
    diloco = DiLoCo(model.named_parameters(), inner, config)
    for step in range(3):
        _train(model, diloco, 0, range(step, step + 1))
        sched.step()
    assert inner.param_groups[0]["lr"] == 0.0
    anchors, local = [a.clone() for a in diloco.anchors], _params(model)
    diloco.finish()  # world 1: the average is this replica's own progress, taken at half the rate
    for got, a, t in zip(_params(model), anchors, local, strict=True):
        torch.testing.assert_close(got, a - 0.5 * (a - t), rtol=0, atol=EPS32 * (a.abs() + t.abs()).max().item())
    assert not all(torch.equal(a, g) for a, g in zip(anchors, _params(model), strict=True))
    state = diloco.state_dict()
    held = DiLoCo(
        model.named_parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        DiLoCoConfig(sync_every=2, compressor="none", outer_lr=1.0, outer_momentum=0.0),
    )
    with pytest.raises(ValueError, match="outer_lr_schedule='inner' -> 'constant'"):
        held.load_state_dict(state)
    held.load_state_dict({k: v for k, v in held.state_dict().items() if k != "outer_lr_schedule"})


def test_the_summary_says_what_the_link_cost_and_when_streaming_pays():
    """The run's summary: no wait; a small wait (delay 0: --sync-delay named); a wait past STREAM_ABOVE of this
    process's training time (the measured streamed settings named, whatever the run's H); a resumed run's share of
    its own training time; a streamed run whose link did not keep up."""
    from powertrain.train.config import TrainConfig
    from powertrain.train.loop import STREAM_ABOVE, STREAMED, _wait_text

    plain = TrainConfig(parallel="diloco", sync_every=10)
    streamed = TrainConfig(parallel="diloco", fragments=5, sync_delay=4, sync_mix=0.5)
    # docs/local-updates.md's figures: 10 Mbit/s waits 9.7% (unstreamed was the sooner there), 1 Mbit/s 59% (streamed)
    assert (0.68 - 0.614) / 0.68 < STREAM_ABOVE < (1.49 - 0.614) / 1.49 and 0.19 < STREAM_ABOVE < 0.2
    assert _wait_text({"late_syncs": 0, "waited_s": 0.0, "wall_s": 9.0}, plain, 9.0, False).startswith("the link kept")
    small = _wait_text({"late_syncs": 3, "waited_s": 1.9, "wall_s": 10.0}, plain, 10.0, False)
    assert "1.9 s for them, 19.0% of the 10.0 s it trained (--sync-delay" in small and "--fragments" not in small
    large = _wait_text({"late_syncs": 3, "waited_s": 2.0, "wall_s": 10.0}, plain, 10.0, False)
    assert "20.0% of the 10.0 s it trained: past 19.3%, streamed syncs" in large
    assert "(--sync-every 25 --fragments 5 --sync-delay 4 --sync-mix 0.5;" in large
    flags = STREAMED.split()
    named = {
        k[2:].replace("-", "_"): float(v) if "." in v else int(v) for k, v in zip(flags[::2], flags[1::2], strict=True)
    }
    TrainConfig(parallel="diloco", **named)  # the settings it names are valid together
    resumed = _wait_text({"late_syncs": 3, "waited_s": 2.0, "wall_s": 100.0}, plain, 4.0, True)
    assert "50.0% of the 4.0 s it trained since the resume" in resumed  # not 2% of the whole run's 100 s
    late = _wait_text({"late_syncs": 2, "waited_s": 5.0, "wall_s": 10.0}, streamed, 10.0, False)
    assert "5.0 s for 2 of them: the link did not keep up (raise --sync-every" in late


def test_a_presets_per_step_compressor_yields_to_the_outer_default_and_says_so():
    """``--preset tiny --parallel diloco`` ran its outer step through the preset's powersgd:rank=2 (measured badly on
    the outer step) with nothing said: local updates' default applies, a warning says why; a named one is taken."""
    from powertrain.train.config import DEFAULT_OUTER_COMPRESSOR, resolve

    with pytest.warns(UserWarning, match="--preset tiny sets compressor='powersgd:rank=2,start=2'.*int4, applies"):
        cfg = resolve("tiny", None, {"parallel": "diloco"})
    assert cfg.compressor == DEFAULT_OUTER_COMPRESSOR
    assert resolve("tiny", None, {"parallel": "diloco", "compressor": "int8"}).compressor == "int8"
    assert resolve("tiny", None, {"parallel": "ddp"}).compressor == "powersgd:rank=2,start=2"  # per step: the preset's


def test_command_settings_are_checked_before_any_worker_starts():
    from powertrain.train.config import TrainConfig

    cfg = TrainConfig(parallel="diloco", compressor="powersgd:rank=4", sync_every=10, fragments=2, sync_delay=4)
    assert cfg.compressor == "powersgd:rank=4,start=0"  # the outer step compresses from its first sync
    assert cfg.adam_freeze == 0  # the inner AdamW is torch's: PowerSGD sends pseudo-gradients here
    assert cfg.local_updates is not None and cfg.local_updates.sync_delay == 4
    assert TrainConfig(parallel="diloco").compressor == "int4"  # the measured default
    # one default: a script's DiLoCo(params, inner) runs what the command runs
    assert TrainConfig(parallel="diloco").local_updates == DiLoCoConfig()
    for fields, text in [
        ({"parallel": "ddp", "sync_every": 10}, "sync_every=10 applies to parallel='diloco'"),
        ({"parallel": "diloco", "sync_every": 4, "fragments": 5}, "fragments=5"),
        ({"parallel": "diloco", "sync_every": 10, "fragments": 2, "sync_delay": 5}, "delay=5"),
        ({"parallel": "diloco", "outer_momentum": 1.0}, "outer_momentum=1.0"),
        ({"parallel": "diloco", "optimizer": "shampoo"}, "optimizer='adamw', 'sgd' or 'muon'"),
        ({"parallel": "diloco", "sync_mix": -0.1}, "sync_mix=-0.1"),
        ({"parallel": "diloco", "sync_mix": 0.5}, "sync_mix=0.5 with sync_delay=0"),
    ]:
        with pytest.raises(ValueError, match=text) as e:
            TrainConfig(**fields)
        assert "\n" not in str(e.value)
    # options that would do nothing are accepted with a warning that says so
    with pytest.warns(UserWarning, match="never sync before the run's end"):
        TrainConfig(parallel="diloco", steps=20, sync_every=20)
    with pytest.warns(UserWarning, match="no effect without sync_warmup"):
        TrainConfig(parallel="diloco", warmup_compressor="int8")


# ---------------------------------------------------------------- one replica = several ranks (2 nodes x 2 ranks)

NODES, LOCAL = 2, 2


def _inside_node(rank: int, inner_kind: str) -> dict[str, Any]:
    """DDP (with the hierarchical compressor between nodes) or FSDP2 (with the compressor over the ranks holding the
    same shard) inside each node, local updates between nodes; per sync, every rank's pseudo-gradient and the average
    it applied."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    if inner_kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from powertrain.compress.hierarchical import HierarchicalCompressor

        wrapped = DistributedDataParallel(model, process_group=mesh["shard"].get_group(), find_unused_parameters=True)
        comp = HierarchicalCompressor(model.named_parameters(), "none", local_world=LOCAL)
        diloco = DiLoCo(
            model.named_parameters(), _inner(model), DiLoCoConfig(sync_every=3, sync_delay=1, compressor=comp)
        )
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model, mesh=mesh["shard"])
        diloco = DiLoCo(
            model.named_parameters(),
            _inner(model),
            DiLoCoConfig(sync_every=3, sync_delay=1, compressor="none"),
            group=mesh["replicate"].get_group(),
        )
    records: list[dict[str, Any]] = []
    program = diloco.compressor.program

    def recorded(grads: list[torch.Tensor], indices: list[int], **kw: Any) -> Any:
        records.append({"delta": [g.clone() for g in grads]})
        return program(grads, indices, **kw)

    diloco.compressor.program = recorded  # type: ignore[method-assign]
    apply = diloco._apply

    def recorded_apply(pending: Any, mix: float | None = None) -> None:
        records[diloco.syncs]["avg"] = [a.clone() for a in pending.average]
        apply(pending, mix)

    diloco._apply = recorded_apply  # type: ignore[method-assign]
    losses, full = [], []
    for step in range(8):
        diloco.zero_grad()
        loss = loss_fn(wrapped, *batch(rank, step))
        loss.backward()
        diloco.step()
        losses.append(loss.item())
        full.append(
            torch.cat(
                [
                    (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                    for p in model.parameters()
                    if p.requires_grad
                ]
            )
        )
    return {"records": records, "losses": losses, "full": full, "bytes": diloco.stats.bytes_sent}


def _node_cases(rank: int, world: int) -> dict[str, Any]:
    return {"ddp": guard(_inside_node, rank, "ddp"), "fsdp": guard(_inside_node, rank, "fsdp")}


@pytest.fixture(scope="module")
def nodes() -> list[dict[str, Any]]:
    return run_ranks(_node_cases, NODES * LOCAL, timeout=120)


@pytest.mark.parametrize("inner_kind", ["ddp", "fsdp"])
def test_replicas_of_several_ranks(nodes, inner_kind):
    runs = case(nodes, inner_kind)
    for step in range(8):
        # inside a node the ranks hold one model: DDP keeps it, FSDP2's shards gathered are it
        for n in range(NODES):
            assert torch.equal(runs[n * LOCAL]["full"][step], runs[n * LOCAL + 1]["full"][step]), (step, n)
    # syncs start after steps 3 and 6 and are applied one step later (delay 1): then every rank holds the anchor
    # plus one step of its node's own training; right after an application the nodes differ by that step only, so
    # compare what was averaged instead: each average is the exact mean of the nodes' pseudo-gradients
    assert len(runs[0]["records"]) == 2
    for s in range(2):
        for j in range(len(runs[0]["records"][s]["avg"])):
            if inner_kind == "ddp":  # every rank sends its node's whole pseudo-gradient (identical in the node)
                deltas = [runs[n * LOCAL]["records"][s]["delta"][j] for n in range(NODES)]
                avg = runs[0]["records"][s]["avg"][j]
                for r in runs:  # the hierarchical compressor hands every rank the same average
                    assert torch.equal(r["records"][s]["avg"][j], avg)
            else:  # each rank its shard, over the ranks holding the same shard
                for local in range(LOCAL):
                    deltas = [runs[n * LOCAL + local]["records"][s]["delta"][j] for n in range(NODES)]
                    avg = runs[local]["records"][s]["avg"][j]
                    for n in range(NODES):
                        assert torch.equal(runs[n * LOCAL + local]["records"][s]["avg"][j], avg)
            exact = torch.stack([d.double() for d in deltas]).mean(0)
            # fp32: each node's delta halved (exact), then a 2-term sum: one rounding of size u = EPS32 / 2; 2x safety
            within((avg.double() - exact).abs(), EPS32 * exact.abs(), f"{inner_kind} sync {s} param {j}")
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]
    assert runs[0]["bytes"] > 0


def test_a_state_that_does_not_fit_changes_nothing():
    """A resume refused part-way (here the warm-up compressor's state, loaded after the compressor's and the outer
    optimizer's) leaves every part as it was."""
    model = make_model()
    diloco = DiLoCo(
        model.named_parameters(),
        _inner(model),
        # outer momentum: its buffers are a part that must be left as it was
        DiLoCoConfig(
            sync_every=1, compressor="int8", sync_warmup=1, warmup_compressor="int8", outer_lr=0.7, outer_momentum=0.9
        ),
    )
    _train(model, diloco, 0, range(3))
    saved = from_blob(to_blob(diloco.state_dict()))
    _train(model, diloco, 0, range(3, 5))
    now = from_blob(to_blob(diloco.state_dict()))
    bad = dict(saved)
    bad["warmup_compressor"] = {**saved["warmup_compressor"], "steps": "x"}
    with pytest.raises(ValueError, match="does not fit") as e:
        diloco.load_state_dict(bad)
    assert "\n" not in str(e.value)
    after = from_blob(to_blob(diloco.state_dict()))
    same = lambda a, b: a is b is None or (a is not None and b is not None and torch.equal(a, b))
    assert after["step"] == now["step"] != saved["step"]
    assert all(same(a, b) for a, b in zip(after["anchors"], now["anchors"], strict=True))
    # the compressor was loaded (it is checked first), then put back
    assert after["compressor"]["steps"] == now["compressor"]["steps"] != saved["compressor"]["steps"]
    assert all(same(a, b) for a, b in zip(after["compressor"]["errors"], now["compressor"]["errors"], strict=True))
    # and the outer optimizer (loaded second) too: its momentum is the current run's, not the saved one's
    moments = [
        (
            after["outer"]["state"][k]["momentum_buffer"],
            now["outer"]["state"][k]["momentum_buffer"],
            saved["outer"]["state"][k]["momentum_buffer"],
        )
        for k in now["outer"]["state"]
    ]
    assert moments and all(torch.equal(a, n) for a, n, _ in moments)
    assert any(not torch.equal(n, s) for _, n, s in moments)


def test_a_state_saved_under_the_old_names_resumes_as_saved():
    """A state saved before each setting had one name (``delay``, ``mix``, ``warmup``, ``applied``) loads as the
    same state under today's names, and a mismatch is named in today's."""
    config = DiLoCoConfig(
        sync_every=2, compressor="int8", sync_warmup=1, warmup_compressor="int8", outer_lr=0.7, outer_momentum=0.9
    )
    model = make_model()
    diloco = DiLoCo(model.named_parameters(), _inner(model), config)
    _train(model, diloco, 0, range(5))
    saved = from_blob(to_blob(diloco.state_dict()))
    names = {"sync_delay": "delay", "sync_mix": "mix", "sync_warmup": "warmup", "updated_at": "applied"}
    old = {names.get(k, k): v for k, v in saved.items()}
    assert set(old) - set(saved) == set(names.values())
    fresh_model = make_model()
    fresh = DiLoCo(fresh_model.named_parameters(), _inner(fresh_model), config)
    fresh.load_state_dict(old)
    got = fresh.state_dict()
    assert set(got) == set(saved)
    for key in ("step", "syncs", "updated_at", "sync_delay", "sync_mix", "sync_warmup"):
        assert got[key] == saved[key], key
    assert all(torch.equal(a, b) for a, b in zip(got["anchors"], saved["anchors"], strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(got["compressor"]["errors"], saved["compressor"]["errors"], strict=True)
    )
    with pytest.raises(ValueError, match="sync_delay=3 -> 0"):
        fresh.load_state_dict({**old, "delay": 3})
    with pytest.raises(ValueError, match="holds 'delay' and 'sync_delay'"):  # the same setting under both names
        fresh.load_state_dict({**saved, "delay": 3})


def test_loading_waits_for_the_sync_in_flight():
    """A sync still in flight when a state is loaded finishes first: its program would otherwise commit the
    compressor's state over the loaded one (on NCCL it now ends on the chain's worker, later than the call); its failure
    is not raised by the resumed run."""
    import threading

    from powertrain._outer_sync import Pending

    model = make_model()
    diloco = DiLoCo(model.named_parameters(), _inner(model), DiLoCoConfig(sync_every=2, compressor="int8"))
    _train(model, diloco, 0, range(3))
    saved = from_blob(to_blob(diloco.state_dict()))
    for outcome in ("result", "failure"):
        fut: torch.futures.Future = torch.futures.Future()
        diloco.sync.pending = Pending(0, diloco.step_count + 1, fut)
        end = lambda fut=fut, outcome=outcome: (
            fut.set_result([]) if outcome == "result" else fut.set_exception(RuntimeError("lost peer"))
        )
        timer = threading.Timer(0.3, end)
        timer.start()
        diloco.load_state_dict(saved)
        assert fut.done(), f"load returned with the sync ({outcome}) still in flight"
        timer.join()
        _train(model, diloco, 0, range(3, 5))  # the resumed run goes on, the lost sync's error forgotten
