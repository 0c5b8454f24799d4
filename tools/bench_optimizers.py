"""``python tools/bench_optimizers.py [--preset tiny] [--shampoo-reference CLONE]``: Shampoo, SOAP, GaLore and DeMo
against AdamW, side by side in one run. It backs the repository's claims about its optimizers on a fixed GPT, so it
runs from a checkout and is not installed (docs/benchmarks.md says which suites are).

1. **Scaling**: Shampoo's step time against AdamW's with 1, 2 and 4 workers (loopback; 4 workers share the 2
   cores, so absolute times there include time slicing, the ratio is what to read), with its 1-D blocks updated
   by the graft (the train command's default) and, side by side, preconditioned like the other blocks.
2. **Quality and time** (2 workers, loopback, one thread each): every optimizer trains the default GPT side by
   side (:mod:`powertrain.bench.sidebyside`: one step of each per round, same batches) on ``powertrain
   train``'s warm-up + cosine schedule, plus Shampoo once more with the steps that AdamW's time buys it (from
   the 2-worker ratio of part 1), on a schedule over those steps: the equal-wall-clock comparison. AdamW's and
   Shampoo's peak learning rates are tuned first over ``lr_grid`` at the same number of steps; AdamW, Shampoo
   and the budgeted Shampoo then run again over ``long_steps`` (1,000 by default) with the same rates. Per
   run: mean step time (it includes the amortised root, eigenbasis and subspace work, which a median would
   hide) and median, total training time, payload bytes per step and the final validation loss.
3. **DeMo on a slow link**: AdamW with fp32 DDP all-reduce against DeMo (no all-reduce, one all-gather of DCT
   components) on an emulated 100 Mbit/s link (:mod:`powertrain.bench.netem`; loopback, labelled, without
   root), constant learning rates: bytes per step, validation loss at equal steps and at equal wall-clock
   (each run's last validation within the faster run's training time).
4. **GaLore**: optimizer-state bytes against AdamW on the default GPT (rank d_model/4 on the blocks' 2-D
   weights), and ``step()`` time against galore-torch's AdamW (the reference, exact SVD) without and with a
   subspace refresh, for powertrain's randomized (GaLore 2) and exact refresh.
5. **Shampoo against its reference** (``shampoo_reference``: a clone of facebookresearch/optimizers, imported from
   there, never a dependency; skipped without one): ``step()`` and training-step times of powertrain's Shampoo and
   eigenvalue-corrected Shampoo (SOAP) against the reference's two and, where heavyball is importable, its SOAP and
   KLShampoo (eager), on the default GPT in one process, one thread, in interleaved rounds
   (:func:`powertrain.bench.rounds.interleaved`). That the reference's updates agree with powertrain's is a test,
   tests/test_shampoo_reference.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib
import importlib.util
import logging
import statistics
import subprocess
import sys
import time
import tomllib
import types
from contextlib import suppress
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from powertrain._files import read_bounded
from powertrain.bench import network
from powertrain.bench.cli import script
from powertrain.bench.netem import unavailable
from powertrain.bench.report import cell, command, footer, publish, rate_name, section, table
from powertrain.bench.rounds import interleaved, torch_threads
from powertrain.bench.sidebyside import Spec, SpecResult, side_by_side
from powertrain.models import GPT, GPTConfig
from powertrain.optim.shampoo.optimizer import DistributedShampoo
from powertrain.train.config import TrainConfig
from powertrain.train.data import TokenData, load_data
from powertrain.train.optimizers import galore_split

__all__ = ["load_galore_torch", "load_shampoo_reference", "reference_like", "run_optimizers_bench"]

PROG = "tools/bench_optimizers.py"
DEMO_LR = 3e-4  # sign updates: an order of magnitude below Adam's, as for Lion


def _specs(p: Preset, steps: int = 0, lr: float = 1e-3, shampoo_lr: float | None = None) -> list[Spec]:
    """AdamW, Shampoo, SOAP, GaLore, DeMo. ``steps`` > 0: each run trains that many steps on ``powertrain
    train``'s schedule (warm-up over ``p.lr_warmup`` steps, cosine decay to a tenth); 0: constant rates.
    ``lr``: AdamW's and GaLore's peak rate; ``shampoo_lr`` Shampoo's and SOAP's (default ``lr``)."""
    common: dict[str, Any] = {"lr": lr, **({"warmup_steps": p.lr_warmup} if steps else {})}
    shampoo = {**common, "lr": shampoo_lr or lr, "shampoo_frequency": p.frequency, "shampoo_max_dim": p.max_dim}
    soap = {**shampoo, "shampoo_preconditioner": "eigenvalue_corrected"}
    blocks = f"blocks {p.max_dim}, every {p.frequency}"
    return [
        Spec(label, "none", optimizer=optimizer, optimizer_options=options, steps=steps)
        for label, optimizer, options in (
            (f"AdamW lr {lr:g}", "adamw", common),
            (f"Shampoo ({blocks}) lr {shampoo['lr']:g}", "shampoo", shampoo),
            (f"SOAP ({blocks}) lr {shampoo['lr']:g}", "shampoo", soap),
            (f"GaLore r{p.galore_rank} (randomized) lr {lr:g}", "galore", {**common, "galore_rank": p.galore_rank}),
            (f"DeMo lr {DEMO_LR:g}", "demo", {**common, "lr": DEMO_LR}),
        )
    ]


def budgeted_steps(steps: int, ratio: float) -> int:
    """Steps that take about as long as ``steps`` AdamW steps for an optimizer ``ratio`` times slower per step."""
    if ratio <= 0:
        raise ValueError(f"step-time ratio {ratio} must be positive")
    return max(1, int(steps / ratio))


@dataclasses.dataclass(frozen=True)
class Preset:
    model: GPTConfig
    batch: int  # sequences per worker per step
    quality_steps: int  # steps of the learning-rate and equal-steps parts
    eval_every: int
    frequency: int  # Shampoo's precondition_frequency
    max_dim: int  # Shampoo's max_preconditioner_dim
    galore_rank: int
    scaling_steps: int  # timed steps of the scaling part (a multiple of the frequency)
    link_steps: int  # steps of the DeMo-on-a-slow-link part
    link_rate: float  # Mbit/s
    lr_warmup: int  # warm-up steps of the quality runs' schedule
    lr_grid: tuple[float, ...]  # peak learning rates AdamW and Shampoo are tuned over
    long_steps: int  # AdamW's steps in the longer-horizon equal-wall-clock part
    reference_frequency: int  # Shampoo's precondition_frequency in the part against the reference
    reference_rounds: int  # its timed rounds


PRESETS = {
    "default": Preset(
        GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128),
        16,
        quality_steps=200,
        eval_every=25,
        frequency=50,
        max_dim=256,
        galore_rank=64,
        scaling_steps=50,
        link_steps=100,
        link_rate=100.0,
        lr_warmup=20,
        lr_grid=(5e-4, 1e-3, 2e-3),
        long_steps=1000,
        reference_frequency=10,
        reference_rounds=20,
    ),
    "tiny": Preset(
        GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32),
        2,
        quality_steps=4,
        eval_every=2,
        frequency=2,
        max_dim=16,
        galore_rank=8,
        scaling_steps=2,
        link_steps=2,
        link_rate=100.0,
        lr_warmup=1,
        lr_grid=(1e-3, 3e-3),
        long_steps=6,
        reference_frequency=2,
        reference_rounds=3,
    ),
}


# ---------------------------------------------------------------- analysis (pure; unit-tested)


def at_equal_wall_clock(times: list[list[float]], curves: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """Each run's last validation loss reached within the shortest run's total time.

    Args:
        times: per run, the step times in order (seconds).
        curves: per run, (step, validation loss) pairs in order.

    Returns:
        ``budget_s`` and, per run, ``(step, loss)`` of its last evaluation within the budget (None if none).
    """
    totals = [sum(t) for t in times]
    budget = min(totals)
    reached = []
    for t, curve in zip(times, curves, strict=True):
        clock = [0.0]
        for x in t:
            clock.append(clock[-1] + x)
        inside = [(s, v) for s, v in curve if clock[s] <= budget * (1 + 1e-9)]
        reached.append(inside[-1] if inside else None)
    return {"budget_s": budget, "reached": reached}


def _rows(results: list[SpecResult], specs: list[Spec], skip: int) -> dict[str, Any]:
    """Per optimizer: step times, bytes and losses; ``budget_s``: the equal-wall-clock budget."""
    times = [res.step_times() for res in results]
    equal = at_equal_wall_clock(times, [res.first.val_curve for res in results])
    rows: list[dict[str, Any]] = []
    for i, (spec, res) in enumerate(zip(specs, results, strict=True)):
        t = times[i][skip:]
        reached = equal["reached"][i]
        rows.append(
            {
                "label": spec.label,
                "steps": len(times[i]),
                "mean_s": statistics.fmean(t),
                "median_s": statistics.median(t),
                "bytes": sum(res.first.sent_per_step.values()),
                "val_loss": res.first.val_loss,
                "val_curve": res.first.val_curve,
                "total_s": sum(times[i]),
                "wall_step": reached[0] if reached else None,
                "wall_loss": reached[1] if reached else None,
            }
        )
    base = rows[0]
    for row in rows:
        row["time_vs_adamw"] = row["mean_s"] / base["mean_s"]
        row["loss_vs_adamw"] = row["val_loss"] / base["val_loss"] - 1
    return {"rows": rows, "budget_s": equal["budget_s"]}


# ---------------------------------------------------------------- the parts


def _side_by_side(
    p: Preset, specs: list[Spec], steps: int, nproc: int = 2, *, rate: float | None = None, eval_every: int = 0
) -> tuple[list[SpecResult], dict[str, float] | None]:
    """``specs`` side by side for ``steps`` steps: on loopback, or with ``rate`` (Mbit/s) on an emulated link of that
    rate (validated first: the check is returned); validation every ``eval_every`` steps (0: at the end only)."""
    return side_by_side(
        specs,
        world=nproc,
        rate=rate,
        emulate=rate is not None,
        check=rate is not None,
        model=p.model,
        batch=p.batch,
        warmup=0,
        timed=steps,
        start=network.START,
        eval_every=eval_every,
    )


def best_lr(rows: list[dict[str, Any]]) -> float:
    """The peak learning rate of the run with the lowest final validation loss."""
    return float(min(rows, key=lambda r: r["val_loss"])["lr"])


def _sweep(p: Preset) -> dict[str, Any]:
    """AdamW and Shampoo at every rate of ``p.lr_grid``, ``p.quality_steps`` steps on the schedule, side by
    side; each optimizer's best rate is the one the quality part uses."""
    specs = [s for lr in p.lr_grid for s in _specs(p, p.quality_steps, lr)[:2]]
    print(f"[bench optimizers] learning rates: {len(specs)} runs x {p.quality_steps} steps", file=sys.stderr)
    results, _ = _side_by_side(p, specs, p.quality_steps)
    rows = _rows(results, specs, skip=min(5, p.quality_steps - 1))["rows"]
    for row, spec in zip(rows, specs, strict=True):
        row["optimizer"], row["lr"] = spec.optimizer, spec.optimizer_options["lr"]
    best = {name: best_lr([r for r in rows if r["optimizer"] == name]) for name in ("adamw", "shampoo")}
    return {"rows": rows, "best": best}


def _quality(p: Preset, ratio: float, lr: float, shampoo_lr: float, steps: int, every: bool = True) -> dict[str, Any]:
    """Every optimizer (``every``; else AdamW and Shampoo) ``steps`` steps on the train command's schedule, plus
    Shampoo again with the steps AdamW's time buys it (``ratio``: Shampoo's step time over AdamW's), on a
    schedule over those steps: the equal-wall-clock comparison."""
    specs = _specs(p, steps, lr, shampoo_lr)[: None if every else 2]
    budget = budgeted_steps(steps, ratio)
    shampoo = specs[1]
    specs.append(dataclasses.replace(shampoo, label=f"{shampoo.label}, AdamW's time", steps=budget))
    print(f"[bench optimizers] quality: {len(specs)} runs x up to {steps} steps", file=sys.stderr)
    results, _ = _side_by_side(p, specs, steps)
    return {"steps": steps, "ratio": ratio, **_rows(results, specs, skip=min(5, budget - 1))}


def _scaling(p: Preset) -> list[dict[str, Any]]:
    adamw, shampoo = _specs(p)[:2]
    # and Shampoo with full factors on the 1-D blocks too, as the reference implementation does by default
    vectors = dataclasses.replace(
        shampoo,
        label=f"{shampoo.label}, 1-D blocks preconditioned",
        optimizer_options={**shampoo.optimizer_options, "shampoo_vectors": "shampoo"},
    )
    specs = [adamw, shampoo, vectors]
    out = []
    for world in (1, 2, 4):
        print(f"[bench optimizers] scaling: {world} worker(s)", file=sys.stderr)
        # Shampoo preconditions from step p.frequency on (its default start) and uses only the graft before:
        # timing from 5 steps past that start, the timed steps span whole precondition periods (one root each)
        warmup = p.frequency + 5
        results, _ = _side_by_side(p, specs, warmup + p.scaling_steps, world)
        t = [statistics.fmean(res.step_times()[warmup:]) for res in results]
        out.append(
            {
                "world": world,
                "adamw_s": t[0],
                "shampoo_s": t[1],
                "ratio": t[1] / t[0],
                "vectors_s": t[2],
                "vectors_ratio": t[2] / t[0],
            }
        )
    return out


def _slow_link(p: Preset, lr: float) -> dict[str, Any]:
    specs = [_specs(p, lr=lr)[i] for i in (0, 4)]  # AdamW (fp32 all-reduce), DeMo
    reason = unavailable()
    rate = p.link_rate if reason is None else None
    print(f"[bench optimizers] DeMo vs AdamW at {rate_name(rate)}", file=sys.stderr)
    results, check = _side_by_side(p, specs, p.link_steps, rate=rate, eval_every=p.eval_every)
    result = _rows(results, specs, skip=min(2, p.link_steps - 1))
    rows = result["rows"]
    return {
        "rate_mbit": rate,
        "unavailable": reason,
        "check": check,
        "steps": p.link_steps,
        **result,
        "bytes_ratio": rows[0]["bytes"] / max(rows[1]["bytes"], 1),
    }


def load_galore_torch() -> Any:
    """galore-torch's AdamW, loaded from its installed files without running the package ``__init__`` (which
    imports bitsandbytes); its ``adamw.py`` imports transformers only for a version check, which a stand-in
    provides while the file is imported when transformers is absent. None when galore-torch is not installed."""
    spec = importlib.util.find_spec("galore_torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = types.ModuleType("_galore_torch_files")
    pkg.__path__ = list(spec.submodule_search_locations)
    stand_ins: dict[str, types.ModuleType] = {"_galore_torch_files": pkg}
    if importlib.util.find_spec("transformers") is None:
        versions = types.ModuleType("transformers.utils.versions")
        versions.require_version = lambda *args, **kwargs: None  # type: ignore[attr-defined]
        stand_ins |= {
            "transformers": types.ModuleType("transformers"),
            "transformers.utils": types.ModuleType("transformers.utils"),
            "transformers.utils.versions": versions,
        }
    before = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module("_galore_torch_files.adamw").AdamW
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@torch_threads(1)
def _galore(p: Preset, repeats: int) -> dict[str, Any]:
    """State bytes and ``step()`` times on the default GPT's parameters with fixed random gradients, one thread."""
    from powertrain.optim.galore import GaLoreAdamW, optimizer_state_bytes

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(p.model, vocab_size=256))
    mats, rest = galore_split(model, list(model.parameters()))
    grads = {id(q): torch.randn_like(q) * 1e-2 for q in model.parameters()}
    gap = 1000  # refreshes are timed on their own: steps 1 (refresh) and 2.. (no refresh)

    def groups(**low: Any) -> list[dict[str, Any]]:
        return [{"params": mats, "rank": p.galore_rank, "update_proj_gap": gap, "scale": 0.25, **low}, {"params": rest}]

    makers: dict[str, Any] = {
        "torch AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
        "powertrain GaLoreAdamW, randomized": lambda: GaLoreAdamW(groups(svd="randomized"), lr=1e-3),
        "powertrain GaLoreAdamW, exact SVD": lambda: GaLoreAdamW(groups(svd="exact"), lr=1e-3),
    }
    reference = load_galore_torch()
    if reference is not None:
        makers["galore-torch AdamW (exact SVD)"] = lambda: reference(groups(proj_type="std"), lr=1e-3)
    rows: list[dict[str, Any]] = []
    initial = [q.detach().clone() for q in model.parameters()]
    for label, make in makers.items():
        refresh: list[float] = []
        plain: list[float] = []
        for _ in range(repeats):
            with torch.no_grad():
                for q, q0 in zip(model.parameters(), initial, strict=True):
                    q.copy_(q0)
            opt = make()
            for step in range(4):
                for q in model.parameters():
                    q.grad = grads[id(q)].clone()
                t0 = time.perf_counter()
                opt.step()
                (refresh if step == 0 else plain).append(time.perf_counter() - t0)
        rows.append(
            {
                "label": label,
                "state_bytes": optimizer_state_bytes(opt),
                "projected_bytes": optimizer_state_bytes(opt, mats),
                "first_s": statistics.median(refresh),
                "step_s": statistics.median(plain),
            }
        )
    base, base_projected = rows[0]["state_bytes"], rows[0]["projected_bytes"]
    for row in rows:
        row["state_vs_adamw"] = row["state_bytes"] / base - 1
        row["projected_vs_adamw"] = row["projected_bytes"] / base_projected - 1
        # per step with a refresh every 200 steps (the default update_proj_gap)
        row["amortized_s"] = row["step_s"] + (row["first_s"] - row["step_s"]) / 200
    return {
        "rank": p.galore_rank,
        "params": sum(q.numel() for q in model.parameters()),
        "rows": rows,
        "reference": reference is not None,
    }


def load_shampoo_reference(path: str | None) -> Any:
    """facebookresearch/optimizers' ``distributed_shampoo`` package, imported from the clone at ``path`` (None: as
    installed)."""
    if path is not None:
        root = Path(path).expanduser().resolve()
        if not (root / "distributed_shampoo" / "__init__.py").is_file():
            raise ValueError(
                f"Invalid Shampoo reference {path!r}: no distributed_shampoo/ package there; give the root of a clone "
                "of https://github.com/facebookresearch/optimizers"
            )
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    module = importlib.import_module("distributed_shampoo")
    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)  # it logs every option at INFO/WARNING
    return module


def _checked_reference(path: str) -> Any:
    """:func:`load_shampoo_reference`, with both optimizers built once on a stand-in parameter: a clone whose package
    does not import or whose API differs is refused in one line before any part runs."""
    try:
        ref = load_shampoo_reference(path)
        for kind in ("shampoo", "eigenvalue_corrected"):
            rel_eps = 0.0 if kind == "shampoo" else None  # the reference damps Shampoo's roots by epsilon alone
            like = DistributedShampoo([torch.nn.Parameter(torch.zeros(2, 2))], preconditioner=kind, rel_eps=rel_eps)
            reference_like(ref, [torch.nn.Parameter(torch.zeros(2, 2))], like, exact=False)
    except (ImportError, AttributeError, TypeError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(
            f"Invalid Shampoo reference {path!r}: its distributed_shampoo does not run here ({type(e).__name__}: "
            f"{first}); use a clone at the commit BENCHMARKS.md records"
        ) from None
    return ref


def reference_like(
    ref: Any, params: Any, like: DistributedShampoo, dtype: torch.dtype = torch.float32, exact: bool = True
) -> Any:
    """The reference's ``DistributedShampoo`` (``ref``: :func:`load_shampoo_reference`) set up as powertrain's
    ``like`` (one parameter group), its factors, roots and eigenbases in ``dtype``.

    ``grafting`` -> ``grafting_config`` (Adam, RMSprop, AdaGrad ``PreconditionerConfig``; none: None); ``momentum``
    -> ``ClassicMomentumConfig``; decoupled weight decay; powertrain's blocking (``target_parameter_dimensionality=2``
    where the reference has it); ``preconditioner`` -> root-inverse (eigh) or eigenvalue-corrected Shampoo;
    ``use_bias_correction`` (powertrain corrects the factors by default and the filtered gradient always). Refused
    (ValueError), as the reference has no counterpart: nesterov, root_method other than eigh, exponent_multiplier
    other than 1, bias_correction=False, precondition_1d=False, Shampoo's rel_eps other than 0 (the reference damps
    by epsilon alone), a parameter group with options of its own. ``exact``: epsilon added after the
    eigendecomposition and unpacked factors, as powertrain computes; else the reference's own defaults, which differ
    only in round-off.
    """
    o = like.defaults
    unmapped = {
        "nesterov": False,
        "root_method": "eigh",
        "exponent_multiplier": 1.0,
        "bias_correction": True,
        "precondition_1d": True,
    }
    if like.preconditioner == "shampoo":
        unmapped["rel_eps"] = 0.0  # the reference damps by epsilon alone
    for name, value in unmapped.items():
        have = o[name] if name in o else getattr(like, name)
        if have != value:
            raise ValueError(
                f"reference_like cannot map {name}={have!r} to the reference: build powertrain's optimizer with "
                f"{name}={value!r}"
            )
    if any(group[k] != o[k] for group in like.param_groups for k in o):
        raise ValueError("reference_like maps the optimizer's defaults: give no parameter group options of its own")
    stability = ref.PerturbationConfig(perturb_before_computation=not exact)
    common = dict(factor_matrix_dtype=dtype, use_symmetric_packing=not exact)
    if like.preconditioner == "shampoo":
        roots = ref.EigenConfig(rank_deficient_stability_config=stability)
        pre = ref.RootInvShampooPreconditionerConfig(
            amortized_computation_config=roots, inv_factor_matrix_dtype=dtype, **common
        )
    else:
        pre = ref.EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=ref.EighEigendecompositionConfig(rank_deficient_stability_config=stability),
            factor_matrix_eigenvectors_dtype=dtype,
            corrected_eigenvalues_dtype=dtype,
            **common,
        )
    beta2, eps = o["grafting_beta2"], o["grafting_eps"]
    graft = {
        "adam": lambda: ref.AdamPreconditionerConfig(beta2=beta2, epsilon=eps),
        "rmsprop": lambda: ref.RMSpropPreconditionerConfig(beta2=beta2, epsilon=eps),
        "adagrad": lambda: ref.AdaGradPreconditionerConfig(epsilon=eps),
        "none": lambda: None,
    }[o["grafting"]]()
    shampoo_types = importlib.import_module("distributed_shampoo.shampoo_types")
    extra: dict[str, Any] = {}
    single = getattr(ref, "SingleDeviceDistributedConfig", None)
    if single is not None and "target_parameter_dimensionality" in {f.name for f in dataclasses.fields(single)}:
        extra["distributed_config"] = single(target_parameter_dimensionality=2)
    return ref.DistributedShampoo(
        params,
        lr=o["lr"],
        betas=o["betas"],
        epsilon=o["eps"],
        weight_decay=o["weight_decay"],
        weight_decay_type=shampoo_types.WeightDecayType.DECOUPLED,
        max_preconditioner_dim=like.max_dim,
        precondition_frequency=like.frequency,
        start_preconditioning_step=like.start,
        use_bias_correction=True,
        grafting_config=graft,
        iterate_averaging_config=shampoo_types.ClassicMomentumConfig(momentum=o["momentum"]) if o["momentum"] else None,
        preconditioner_config=pre,
        **extra,
    )


def _provenance(ref: Any) -> str:
    """The reference's name, version and commit, as far as its clone says."""
    root = Path(ref.__file__).resolve().parents[1]
    name = "distributed_shampoo"
    with suppress(OSError, KeyError, ValueError):  # ValueError: too large, not UTF-8, not TOML
        text = read_bounded(root / "pyproject.toml", 1 << 20, "The reference's pyproject.toml").decode()
        project = tomllib.loads(text)["project"]
        name = f"{project['name']} {project.get('version', '')}".strip()
    where = " (commit unknown: not a git clone)"
    if (root / ".git").exists():  # else git would name the commit of a repository around the files, if any
        with suppress(OSError, subprocess.SubprocessError):
            commit = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            where = f" at commit `{commit[:12]}`"
    return name + where


@torch_threads(1)
def _shampoo_reference(p: Preset, ref: Any) -> dict[str, Any]:
    """Step times of powertrain's Shampoo and SOAP against the reference's and heavyball's: each optimizer on its own
    copy of the GPT (same initial weights), every round a forward + backward and a ``step()`` of each on the same
    batch, timed apart, in one thread (as :func:`_galore`). Hyperparameters as the train command's, roots every
    ``p.reference_frequency`` steps."""
    try:
        heavyball: Any = importlib.import_module("heavyball")
    except ImportError:
        heavyball = None
    corpus = load_data(TrainConfig(data_max_mb=2.0))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"
    torch.manual_seed(0)
    base = GPT(p.model)
    models: dict[str, GPT] = {}

    def params(label: str) -> list[torch.Tensor]:
        models[label] = copy.deepcopy(base)
        return list(models[label].parameters())

    f = p.reference_frequency
    adamw: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    # rel_eps 0: damped by epsilon alone, as the reference is
    shampoo = {**adamw, "betas": (0.9, 0.999), "grafting_beta2": 0.999, "precondition_frequency": f, "rel_eps": 0.0}
    soap = {
        **adamw,
        "eps": 1e-8,
        "grafting": "none",
        "preconditioner": "eigenvalue_corrected",
        "precondition_frequency": f,
    }
    opts: dict[str, Any] = {
        "torch AdamW": torch.optim.AdamW(params("torch AdamW"), **adamw),
        "powertrain Shampoo": DistributedShampoo(params("powertrain Shampoo"), **shampoo),
        "powertrain eigenvalue-corrected": DistributedShampoo(params("powertrain eigenvalue-corrected"), **soap),
    }
    for kind in ("Shampoo", "eigenvalue-corrected"):  # the reference as its users run it
        opts[f"reference {kind}"] = reference_like(
            ref, params(f"reference {kind}"), opts[f"powertrain {kind}"], exact=False
        )
    for name in ("SOAP", "KLShampoo") if heavyball else ():
        opts[f"heavyball {name}"] = getattr(heavyball, name)(
            params(f"heavyball {name}"),
            **adamw,
            shampoo_beta=0.95,
            eps=1e-8,
            precondition_frequency=f,
            max_precond_dim=1024,
        )
    batches = [corpus.batch("train", 0, 1, (0, r), p.batch, p.model.block_size) for r in range(2 + p.reference_rounds)]
    losses: dict[str, list[float]] = {label: [] for label in opts}
    errors: dict[str, str] = {}

    def forward_backward(label: str, r: int) -> None:
        if label not in errors:
            opts[label].zero_grad(set_to_none=True)
            loss = models[label](*batches[r])
            loss.backward()
            losses[label].append(loss.item())

    def step(label: str, _r: int) -> None:
        try:
            if label not in errors:
                opts[label].step()
        except Exception as e:  # a third-party optimizer failing must not lose the others' rows
            errors[label] = f"{type(e).__name__}: {e}".splitlines()[0][:200]

    saved = heavyball.utils.compile_mode if heavyball else None
    if heavyball:
        heavyball.utils.compile_mode = None  # eager like the others (it compiles by default; read at call time)
    try:
        steps = [functools.partial(run, label) for label in opts for run in (forward_backward, step)]
        times = interleaved(steps, warmup=2, timed=p.reference_rounds)
    finally:
        if heavyball:
            heavyball.utils.compile_mode = saved
    rows = []
    for i, label in enumerate(opts):
        st = times[2 * i + 1]
        train = [a + b for a, b in zip(times[2 * i], st, strict=True)]
        rows.append(
            {
                "label": label,
                "error": errors.get(label),
                "step_median_s": statistics.median(st),
                "step_mean_s": statistics.fmean(st),
                "train_median_s": statistics.median(train),
                "train_mean_s": statistics.fmean(train),
                "loss": statistics.fmean(losses[label][-5:]) if losses[label] else None,
            }
        )
    version = "not installed: no heavyball rows"
    if heavyball:
        version = "(version unknown)"
        with suppress(metadata.PackageNotFoundError):
            version = metadata.version("heavyball")
    return {
        "reference": _provenance(ref),
        "heavyball": version,
        "frequency": f,
        "rounds": p.reference_rounds,
        "rows": rows,
    }


# ---------------------------------------------------------------- report


def _quality_table(rows: list[dict[str, Any]], budget: float | None = None) -> str:
    """One row per run; with ``budget``, each run's last validation within that many seconds of training."""
    cells = [
        [
            r["label"],
            r["steps"],
            cell(r["mean_s"]),
            cell(r["median_s"]),
            f"{r['time_vs_adamw']:.2f}x",
            cell(r["total_s"], ".1f"),
            f"{r['bytes'] / 1e6:.2f}",
            cell(r["val_loss"]),
            f"{100 * r['loss_vs_adamw']:+.1f}%",
        ]
        for r in rows
    ]
    head = [
        "optimizer",
        "steps",
        "mean s/step",
        "median s/step",
        "time vs AdamW",
        "training s",
        "MB sent/step",
        "val loss",
        "vs AdamW",
    ]
    if budget is not None:
        head.append(f"val loss at {budget:.1f} s")
        for row, r in zip(cells, rows, strict=True):
            row.append(f"{cell(r['wall_loss'])} (step {r['wall_step']})" if r["wall_step"] else "-")
    return table(head, cells)


def equal_time_sentence(q: dict[str, Any]) -> str:
    """The equal-wall-clock comparison of the quality part, in words: AdamW (first row) against Shampoo trained
    for the steps AdamW's time buys it (last row)."""
    adamw, shampoo = q["rows"][0], q["rows"][-1]
    verdict = "lower" if shampoo["val_loss"] < adamw["val_loss"] else "not lower"
    return (
        f"**At equal wall-clock**: the scaling part measured Shampoo's step at {q['ratio']:.2f}x AdamW's with 2 "
        f"workers, so Shampoo got {shampoo['steps']} steps (its schedule over them) against AdamW's "
        f"{adamw['steps']}. It trained for {shampoo['total_s']:.1f} s against AdamW's {adamw['total_s']:.1f} s "
        f"({shampoo['total_s'] / adamw['total_s']:.2f}x) and reached a validation loss of "
        f"{shampoo['val_loss']:.3f} against {adamw['val_loss']:.3f} ({100 * shampoo['loss_vs_adamw']:+.1f}%, "
        f"{verdict})."
    )


def markdown(report: dict[str, Any], cmd: str) -> str:
    p = PRESETS[report["preset"]]
    q = report["quality"]
    sweep = report["lr_sweep"]
    grid = ", ".join(f"{lr:g}" for lr in p.lr_grid)
    parts = [
        "## Optimizers: Shampoo, SOAP, GaLore and DeMo against AdamW\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({report['params'] / 1e6:.2f}M parameters), "
        f"{p.batch}x{p.model.block_size} tokens per worker, 2 workers on loopback, one torch thread each; betas "
        "(0.9, 0.95) for AdamW and GaLore, Shampoo/SOAP grafted on Adam (their 1-D blocks by the graft alone); "
        "weight decay 0.1. Every optimizer trains its own copy side by side, one step of each per round on the "
        "same batches. Mean step time "
        "includes the amortised root / eigenbasis / subspace work (Shampoo/SOAP every "
        f"{p.frequency} steps on blocks of at most {p.max_dim}, GaLore every 200). Runs follow `powertrain "
        f"train`'s schedule over their own steps ({p.lr_warmup} warm-up steps, cosine decay to a tenth of the "
        "peak) and are compared on the validation loss at their end, on the same held-out batches.",
        f"### Peak learning rate: AdamW and Shampoo over {grid}\n\n{p.quality_steps} steps each; the best rate "
        f"of each (AdamW {sweep['best']['adamw']:g}, Shampoo {sweep['best']['shampoo']:g}) is used below, "
        f"AdamW's also for GaLore and Shampoo's for SOAP; DeMo's sign updates use {DEMO_LR:g}.\n\n"
        + table(
            ["optimizer", "peak lr", "mean s/step", "val loss"],
            [[r["optimizer"], f"{r['lr']:g}", cell(r["mean_s"]), cell(r["val_loss"])] for r in sweep["rows"]],
        ),
        f"### Quality: {q['steps']} steps, tuned rates\n\nThe last row is Shampoo with only the steps that "
        "AdamW's time buys it, on a schedule over those steps.\n\n"
        + _quality_table(q["rows"])
        + "\n\n"
        + equal_time_sentence(q),
        f"### Longer horizon: AdamW and Shampoo, {report['long']['steps']} steps\n\nThe same comparison over "
        f"{report['long']['steps']} steps (rates as tuned over {q['steps']}); the last row is Shampoo with the steps "
        "AdamW's time buys it.\n\n"
        + _quality_table(report["long"]["rows"])
        + "\n\n"
        + equal_time_sentence(report["long"]),
    ]
    sc = report["scaling"]
    parts.append(
        "### Shampoo's overhead against AdamW by number of workers (loopback)\n\nMean step time over "
        f"{p.scaling_steps} steps after {p.frequency + 5} warm-up steps (Shampoo preconditions from step "
        f"{p.frequency} on; the timed steps are whole precondition periods). With W workers "
        "every rank preconditions about 1/W of the blocks and one all-gather shares the directions; 4 workers "
        "time-slice the 2 cores. Shampoo updates its 1-D blocks (biases, norm gains: 0.3% of the parameters) "
        "by the Adam graft alone (`--shampoo-vectors graft`, the default, as SOAP does); the last two columns "
        "are Shampoo with full factors on them too (`--shampoo-vectors shampoo`, the reference implementation's "
        "way), in the same run.\n\n"
        + table(
            [
                "workers",
                "AdamW s/step",
                "Shampoo s/step",
                "Shampoo / AdamW",
                "1-D preconditioned s/step",
                "1-D preconditioned / AdamW",
            ],
            [
                [
                    s["world"],
                    cell(s["adamw_s"]),
                    cell(s["shampoo_s"]),
                    f"{s['ratio']:.2f}x",
                    cell(s["vectors_s"]),
                    f"{s['vectors_ratio']:.2f}x",
                ]
                for s in sc
            ],
        )
    )
    link = report["slow_link"]
    where = (
        f"an emulated {link['rate_mbit']:g} Mbit/s link (2 workers in network namespaces, tc tbf)"
        if link["rate_mbit"]
        else f"loopback (**no emulated network: {link['unavailable']}**)"
    )
    check = link["check"]
    parts.append(
        f"### DeMo against AdamW (fp32 DDP all-reduce) on {where}\n\n{link['steps']} steps at constant "
        "learning rates; the last column is each run's last validation within the faster run's training time. "
        f"DeMo sends {link['bytes_ratio']:.1f}x fewer bytes per step."
        + (
            f" Emulation check: a {check['bytes'] / 1e6:g} MB all-reduce took {check['measured_s']:.2f} s against "
            f"{check['expected_s']:.2f} s expected ({check['ratio']:.2f}x)."
            if check
            else ""
        )
        + "\n\n"
        + _quality_table(link["rows"], link["budget_s"])
    )
    g = report["galore"]
    parts.append(
        f"### GaLore: optimizer state and step time (default GPT, rank {g['rank']} on the blocks' 2-D weights, one "
        "thread)\n\nState: bytes of optimizer state after a step. Step: median `step()` time without a subspace "
        "refresh; first step: with the refresh (and state allocation); amortised: with a refresh every 200 "
        "steps. "
        + ("" if g["reference"] else "**galore-torch is not installed: no reference row.** ")
        + "\n\n"
        + table(
            [
                "optimizer",
                "state MB, projected weights",
                "vs AdamW",
                "state MB, whole model",
                "vs AdamW",
                "step ms",
                "first step (refresh) ms",
                "amortised ms",
            ],
            [
                [
                    r["label"],
                    f"{r['projected_bytes'] / 1e6:.2f}",
                    f"{100 * r['projected_vs_adamw']:+.1f}%",
                    f"{r['state_bytes'] / 1e6:.2f}",
                    f"{100 * r['state_vs_adamw']:+.1f}%",
                    f"{1e3 * r['step_s']:.1f}",
                    f"{1e3 * r['first_s']:.1f}",
                    f"{1e3 * r['amortized_s']:.1f}",
                ]
                for r in g["rows"]
            ],
        )
    )
    return "\n\n".join([*parts, footer(cmd)])


def _reference_markdown(p: Preset, r: dict[str, Any], params: int) -> str:
    head = "## Shampoo side by side: powertrain vs facebookresearch/optimizers and heavyball\n\n"
    m = p.model
    intro = (
        f"Reference: {r['reference']} (local clone); heavyball {r['heavyball']}. GPT {m.n_layer} layers x d_model "
        f"{m.d_model} ({params / 1e6:.2f}M parameters), {p.batch}x{m.block_size} tokens; {r['rounds']} timed rounds "
        "after 2 warm-up rounds, each a forward + backward and a `step()` of every optimizer on the same batch, timed "
        f"apart. Shampoo-type optimizers recompute roots/eigenbases every {r['frequency']} steps "
        "(max_preconditioner_dim 1024): the *median* of `step()` leaves those steps out, the *mean* amortises them; "
        "a train step is forward, backward and `step()`. heavyball eager (compile_mode=None). The loss is the mean of "
        "the last 5 rounds. That the updates agree is a test: tests/test_shampoo_reference.py (float64, a derived "
        "bound)."
    )
    base = r["rows"][0]  # torch AdamW
    cells = [
        [row["label"], "failed", "", "", "", "", "", row["error"].replace("|", "/")]
        if row["error"]
        else [
            row["label"],
            f"{1e3 * row['step_median_s']:.1f}",
            f"{1e3 * row['step_mean_s']:.1f}",
            f"{row['train_median_s']:.3f}",
            f"{row['train_mean_s']:.3f}",
            f"{row['train_mean_s'] / base['train_mean_s']:.2f}x",
            f"{row['step_mean_s'] / base['step_mean_s']:.1f}x",
            f"{row['loss']:.3f}",
        ]
        for row in r["rows"]
    ]
    head_row = [
        "optimizer",
        "step() median (ms)",
        "step() mean (ms)",
        "train step median (s)",
        "train step mean (s)",
        "train step mean vs AdamW",
        "step() mean vs AdamW",
        "loss (last 5)",
    ]
    return head + intro + "\n\n" + table(head_row, cells)


def run_optimizers_bench(
    *, preset: str = "default", write: str | None = "BENCHMARKS.md", shampoo_reference: str | None = None
) -> dict[str, Any]:
    """The five parts (the last with ``shampoo_reference``, a clone of facebookresearch/optimizers)."""
    p = PRESETS[preset]
    ref = None if shampoo_reference is None else _checked_reference(shampoo_reference)  # a bad clone fails now
    report: dict[str, Any] = {"preset": preset, "params": GPT(p.model).num_params()}
    report["scaling"] = _scaling(p)
    two = next(s for s in report["scaling"] if s["world"] == 2)
    report["lr_sweep"] = _sweep(p)
    best = report["lr_sweep"]["best"]
    report["quality"] = _quality(p, two["ratio"], best["adamw"], best["shampoo"], p.quality_steps)
    report["long"] = _quality(p, two["ratio"], best["adamw"], best["shampoo"], p.long_steps, every=False)
    report["slow_link"] = _slow_link(p, best["adamw"])
    report["galore"] = _galore(p, repeats=3 if preset == "default" else 1)
    publish(markdown(report, command(PROG, preset)), write, section("optimizers", preset))
    if ref is not None and shampoo_reference is not None:  # a section of its own (the agreement is a test)
        report["shampoo_reference"] = _shampoo_reference(p, ref)
        text = _reference_markdown(p, report["shampoo_reference"], report["params"])
        cmd = command(PROG, preset, "--shampoo-reference", shampoo_reference)
        publish(f"{text}\n\n{footer(cmd)}", write, section("shampoo-reference", preset))
    return report


def _reference_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shampoo-reference",
        default=None,
        metavar="CLONE",
        help="a clone of facebookresearch/optimizers: time Shampoo against it (and heavyball, if importable)",
    )


def main(argv: list[str] | None = None) -> int:
    what = (
        "Shampoo, SOAP, GaLore and DeMo against AdamW (quality, time, scaling, DeMo on a 100 Mbit/s link, GaLore "
        "memory; with --shampoo-reference, Shampoo's step time against the reference implementation's)"
    )
    return script(PROG, what, run_optimizers_bench, argv, extra=_reference_flag)


if __name__ == "__main__":
    sys.exit(main())
