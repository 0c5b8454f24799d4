"""powertrain's ``DistributedShampoo`` side by side with the reference implementation and heavyball.

The reference is facebookresearch/optimizers (``distributed_shampoo``, published as torch-shampoo), imported at
run time from a local clone (``reference_path``), never a dependency; heavyball (PyPI) is optional. One
process, one torch thread by default.

1. Agreement. For each :class:`Case` and dtype, the same small model (same initial weights, same batches) is
   trained by powertrain's optimizer and by the reference's with the options mapped one to one
   (:func:`reference_optimizer`), in two ways:

   * teacher-forced: before every step the reference model gets powertrain's parameters and gradients, and
     the relative difference of the two updates ``||u_ref - u_pt|| / ||u_pt||`` is recorded, so differences do
     not compound: this is the per-step disagreement of the two optimizers;
   * free-running: each model follows its own trajectory; recorded are the largest parameter difference, the
     relative difference of all parameters, and both loss curves.

   A noise floor is measured too: the reference against itself with options that are equal in exact
   arithmetic (epsilon added before instead of after the eigendecomposition, packed symmetric storage).
2. Step time: the default GPT of ``powertrain train`` on the standard-library corpus, one model copy per
   optimizer (same initial weights), each round one training step of every optimizer on the same batch
   (interleaved, so load from other processes hits all alike). Reported: median and mean of ``step()`` (the
   mean includes the amortised root/eigenbasis recomputations) and of the whole training step (forward,
   backward, ``step()``). heavyball runs eager unless asked to compile (it compiles by default).
3. :func:`markdown` renders the results (with the reference's version and commit) for BENCHMARKS.md.

Run: ``python tools/shampoo_reference.py --reference-path /tmp/ref/optimizers`` (a development tool against a local
clone of another library: not part of the installed package). The agreement is also a test with a derived tolerance,
``tests/test_shampoo_reference.py`` (it runs where ``POWERTRAIN_SHAMPOO_REFERENCE`` names a clone).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import inspect
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from powertrain import _json
from powertrain.bench.report import machine_info, publish, table
from powertrain.models import GPT, GPTConfig
from powertrain.optim.shampoo.optimizer import DistributedShampoo, Grafting, Preconditioner
from powertrain.train.config import GPT_SIZES, TrainConfig
from powertrain.train.data import TokenData, load_data

__all__ = ["Case", "compare", "default_cases", "load_reference", "markdown", "reference_optimizer"]


#: Found by reading both implementations (as of the recorded reference commit); each is visible in a row of the
#: agreement table or set equal in its runs. powertrain's side of each is a test (tests/test_shampoo_math.py).
DESIGN_DIFFERENCES: list[str] = [
    "Damping of the factors' eigenvalues: powertrain adds max(eps, rel_eps * lambda_max) with rel_eps "
    "defaulting to the factor dtype's unit round-off (float32: 1.2e-7); the reference damps by epsilon alone unless "
    "told otherwise. With float32 factors and epsilon 1e-12, a rank-deficient factor's round-off eigenvalues weigh up "
    "to epsilon^(-1/2k) in the root, and the preconditioned direction can be mostly round-off (issue 19). The "
    "agreement runs set powertrain's rel_eps=0.",
    "Factor bias correction: both divide the factors by 1 - beta2^t before the root (powertrain's "
    "bias_correction=True, the reference's use_bias_correction=True); the reference flag also switches the bias "
    "correction of the filtered gradient, which powertrain always applies (equal with beta1 = 0 or the flag on).",
    "The reference's lr and its bias corrections of the filtered gradient and of Adam grafting are float32 "
    "scalars even for float64 parameters: a ~1e-7 .. 1e-5 relative floor in float64 (lr 2^-7 avoids the lr's).",
    "Weight decay with momentum: the reference adds weight_decay * W to the direction before momentum; "
    "powertrain decays the weights outside the momentum buffer. Equal without momentum.",
    "Eigenvalue-corrected Shampoo on rank-deficient factors (vectors, first steps): the eigenvectors of the "
    "null space are arbitrary, so both implementations (and the reference against itself) disagree there.",
    "Grafting: the reference divides by ||shampoo|| + 1e-16, powertrain by ||shampoo|| (if > 0).",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One agreement configuration; the options mean what :class:`DistributedShampoo`'s do.

    ``lr`` defaults to 2^-7 because the reference multiplies by a float32 copy of ``lr``: a power of two is
    exact there, which keeps that rounding out of the float64 comparison.
    """

    name: str
    model: Literal["mlp", "conv"] = "mlp"
    preconditioner: Preconditioner = "shampoo"
    lr: float = 2.0**-7
    betas: tuple[float, float] = (0.9, 1.0)
    epsilon: float = 1e-12
    momentum: float = 0.0
    weight_decay: float = 0.0
    grafting: Grafting = "adam"
    grafting_beta2: float = 0.999
    grafting_epsilon: float = 1e-8
    max_preconditioner_dim: int = 32
    precondition_frequency: int = 5
    batch: int = 64

    def __post_init__(self) -> None:
        if self.precondition_frequency < 1 or self.max_preconditioner_dim < 1 or self.batch < 1:
            raise ValueError(f"Invalid Case {self.name!r}: frequency, max dim and batch must be >= 1")


def default_cases() -> list[Case]:
    cases = [
        Case(name="Shampoo, AdaGrad factors, Adam grafting"),
        Case(name="same, epsilon 1e-6", epsilon=1e-6),
        Case(name="no filtering, EMA factors, AdaGrad grafting", betas=(0.0, 0.999), grafting="adagrad"),
        Case(name="train CLI settings: EMA factors, weight decay", betas=(0.9, 0.999), weight_decay=0.1),
        Case(name="momentum 0.9", momentum=0.9),
        Case(name="momentum 0.9, weight decay 0.1", momentum=0.9, weight_decay=0.1),
        Case(name="conv1d weight (8, 3, 5)", model="conv"),
    ]
    if "preconditioner" in inspect.signature(DistributedShampoo).parameters:
        cases += [
            Case(
                name="eigenvalue-corrected, Adam grafting",
                preconditioner="eigenvalue_corrected",
                betas=(0.9, 0.95),
                epsilon=1e-8,
            ),
            Case(
                name="eigenvalue-corrected, no grafting",
                preconditioner="eigenvalue_corrected",
                betas=(0.9, 0.95),
                epsilon=1e-8,
                grafting="none",
            ),
        ]
    return cases


# -- the two optimizers ----------------------------------------------------------------------------------------


def load_reference(path: str | None) -> Any:
    """The reference's ``distributed_shampoo`` package: from the clone at ``path``, or (``None``) from the
    environment if installed there; ``None`` when not found and no path was given."""
    if path is not None:
        root = Path(path).expanduser().resolve()
        if not (root / "distributed_shampoo" / "__init__.py").is_file():
            raise ValueError(
                f"Invalid reference_path={path!r}: no distributed_shampoo/ package there; clone "
                "facebookresearch/optimizers and pass the clone's root"
            )
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("distributed_shampoo")
    except ImportError:
        if path is not None:
            raise
        return None
    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)  # it logs every option at INFO/WARNING
    return module


def reference_version(ref: Any, commit: str | None = None) -> dict[str, str]:
    """Where the reference came from: its package version (pyproject) and commit (``commit`` or git)."""
    root = Path(ref.__file__).resolve().parent.parent
    out = {"path": str(root), "package": "distributed_shampoo", "commit": commit or "unknown"}
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        fields = dict(
            line.split("=", 1) for line in pyproject.read_text().splitlines() if line.startswith(("name", "version"))
        )
        out["package"] = " ".join(v.strip().strip('"') for v in fields.values())
    if commit is None:
        with suppress(OSError, subprocess.SubprocessError):
            out["commit"] = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
    return out


def powertrain_optimizer(params: Any, case: Case) -> DistributedShampoo:
    extra: dict[str, Any] = {"preconditioner": case.preconditioner}
    if case.preconditioner == "shampoo":
        extra["rel_eps"] = 0.0  # the reference damps by epsilon alone
    return DistributedShampoo(
        params,
        lr=case.lr,
        betas=case.betas,
        eps=case.epsilon,
        momentum=case.momentum,
        weight_decay=case.weight_decay,
        max_preconditioner_dim=case.max_preconditioner_dim,
        precondition_frequency=case.precondition_frequency,
        start_preconditioning_step=case.precondition_frequency,
        grafting=case.grafting,
        grafting_beta2=case.grafting_beta2,
        grafting_eps=case.grafting_epsilon,
        **extra,
    )


def reference_optimizer(ref: Any, params: Any, case: Case, dtype: torch.dtype, *, variant: bool = False) -> Any:
    """The reference ``DistributedShampoo`` configured as powertrain's optimizer for ``case``.

    Mapping: ``grafting`` -> ``grafting_config`` (Adam/RMSprop/AdaGrad ``PreconditionerConfig`` with
    ``beta2``/``epsilon``; none -> ``None``); ``momentum`` -> ``iterate_averaging_config=ClassicMomentumConfig``;
    decoupled weight decay; ``start_preconditioning_step = precondition_frequency``; blocking as powertrain's
    (``target_parameter_dimensionality=2``, where the reference has it); ``preconditioner`` ->
    ``RootInvShampooPreconditionerConfig(EigenConfig)`` or ``EigenvalueCorrectedShampooPreconditionerConfig(
    EighEigendecompositionConfig)``, all matrices in ``dtype``; epsilon added after the eigendecomposition
    (``perturb_before_computation=False``), unpacked storage; ``use_bias_correction=True`` (powertrain
    corrects the factors by default and the filtered gradient always). ``variant``: the same in exact arithmetic
    (epsilon before eigh, packed storage), for the noise floor.
    """
    types = importlib.import_module("distributed_shampoo.shampoo_types")
    perturb = ref.PerturbationConfig(perturb_before_computation=variant)
    common = dict(factor_matrix_dtype=dtype, use_symmetric_packing=variant)
    if case.preconditioner == "shampoo":
        pre = ref.RootInvShampooPreconditionerConfig(
            amortized_computation_config=ref.EigenConfig(rank_deficient_stability_config=perturb),
            inv_factor_matrix_dtype=dtype,
            **common,
        )
    else:
        pre = ref.EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=ref.EighEigendecompositionConfig(rank_deficient_stability_config=perturb),
            factor_matrix_eigenvectors_dtype=dtype,
            corrected_eigenvalues_dtype=dtype,
            **common,
        )
    match case.grafting:
        case "adam":
            graft = ref.AdamPreconditionerConfig(beta2=case.grafting_beta2, epsilon=case.grafting_epsilon)
        case "rmsprop":
            graft = ref.RMSpropPreconditionerConfig(beta2=case.grafting_beta2, epsilon=case.grafting_epsilon)
        case "adagrad":
            graft = ref.AdaGradPreconditionerConfig(epsilon=case.grafting_epsilon)
        case _:
            graft = None
    momentum = types.ClassicMomentumConfig(momentum=case.momentum) if case.momentum > 0 else None
    extra: dict[str, Any] = {}
    single = getattr(ref, "SingleDeviceDistributedConfig", None)
    if single is not None and "target_parameter_dimensionality" in {f.name for f in dataclasses.fields(single)}:
        extra["distributed_config"] = single(target_parameter_dimensionality=2)  # powertrain's blocking
    return ref.DistributedShampoo(
        params,
        lr=case.lr,
        betas=case.betas,
        epsilon=case.epsilon,
        weight_decay=case.weight_decay,
        weight_decay_type=types.WeightDecayType.DECOUPLED,
        max_preconditioner_dim=case.max_preconditioner_dim,
        precondition_frequency=case.precondition_frequency,
        start_preconditioning_step=case.precondition_frequency,
        use_bias_correction=True,
        grafting_config=graft,
        iterate_averaging_config=momentum,
        preconditioner_config=pre,
        **extra,
    )


# -- 1. agreement ---------------------------------------------------------------------------------------------


def _small_model(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":  # 48 and 40 rows split into blocks of <= 32 rows; biases are 1-D blocks
        model: nn.Module = nn.Sequential(nn.Linear(20, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 10))
    else:  # a 3-D weight, which the two implementations block differently
        model = nn.Sequential(nn.Conv1d(3, 8, 5), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 16, 10))
    return model.to(dtype)


def _batches(case: Case, steps: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian inputs labelled by a fixed random linear teacher (a learnable task)."""
    g = torch.Generator().manual_seed(1)
    shape = (case.batch, 20) if case.model == "mlp" else (case.batch, 3, 20)
    teacher = torch.randn(shape[1] * (shape[2] if len(shape) == 3 else 1), 10, generator=g, dtype=torch.float64)
    out = []
    for _ in range(steps):
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        out.append((x.to(dtype), (x.reshape(case.batch, -1) @ teacher).argmax(dim=1)))
    return out


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


Factory = Callable[[Any], Any]


def _forced(case: Case, steps: int, dtype: torch.dtype, make_a: Factory, make_b: Factory) -> list[float]:
    """Per step ``||u_b - u_a|| / ||u_a||`` when model b gets model a's parameters and gradients each step."""
    a, b = _small_model(case.model, dtype), _small_model(case.model, dtype)
    opt_a, opt_b = make_a(a.parameters()), make_b(b.parameters())
    out = []
    for x, y in _batches(case, steps, dtype):
        with torch.no_grad():
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                pb.copy_(pa)  # in place: the reference's blocks are views of the parameters
        before = _flat(a)
        opt_a.zero_grad()
        nn.functional.cross_entropy(a(x), y).backward()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            pb.grad = None if pa.grad is None else pa.grad.clone()
        opt_a.step()
        opt_b.step()
        ua, ub = _flat(a) - before, _flat(b) - before
        out.append(float((ub - ua).norm() / ua.norm()))
    return out


def _free(case: Case, steps: int, dtype: torch.dtype, ref: Any) -> dict[str, list[float]]:
    a, b = _small_model(case.model, dtype), _small_model(case.model, dtype)
    opt_a, opt_b = powertrain_optimizer(a.parameters(), case), reference_optimizer(ref, b.parameters(), case, dtype)
    out: dict[str, list[float]] = {
        "max_abs_param_diff": [],
        "rel_param_diff": [],
        "loss_powertrain": [],
        "loss_reference": [],
    }
    for x, y in _batches(case, steps, dtype):
        for model, opt, key in ((a, opt_a, "loss_powertrain"), (b, opt_b, "loss_reference")):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            out[key].append(loss.item())
        pa, pb = _flat(a), _flat(b)
        out["max_abs_param_diff"].append(float((pa - pb).abs().max()))
        out["rel_param_diff"].append(float((pa - pb).norm() / pa.norm()))
    return out


def agreement(ref: Any, case: Case, *, steps: int, dtype: torch.dtype) -> dict[str, Any]:
    """One case in one dtype: teacher-forced update differences, the reference's noise floor, free run."""
    forced = _forced(
        case, steps, dtype, lambda p: powertrain_optimizer(p, case), lambda p: reference_optimizer(ref, p, case, dtype)
    )
    floor = _forced(
        case,
        steps,
        dtype,
        lambda p: reference_optimizer(ref, p, case, dtype),
        lambda p: reference_optimizer(ref, p, case, dtype, variant=True),
    )
    free = _free(case, steps, dtype, ref)
    start = case.precondition_frequency - 1  # index of the first preconditioned step
    return {
        "case": dataclasses.asdict(case),
        "dtype": str(dtype).removeprefix("torch."),
        "forced_rel_update_diff": forced,
        "noise_floor": floor,
        **free,
        "summary": {
            "graft_phase": max(forced[:start], default=0.0),
            "shampoo_phase": max(forced[start:], default=0.0),
            "noise_floor": max(floor[start:], default=0.0),
            "final_max_abs_param_diff": free["max_abs_param_diff"][-1],
            "final_rel_param_diff": free["rel_param_diff"][-1],
            "final_loss_powertrain": free["loss_powertrain"][-1],
            "final_loss_reference": free["loss_reference"][-1],
        },
    }


# -- 2. step time ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingPreset:
    model: GPTConfig
    batch: int


TIMING_PRESETS = {
    "default": TimingPreset(GPTConfig(256, 128, *GPT_SIZES["default"]), batch=16),  # powertrain train's default
    "tiny": TimingPreset(GPTConfig(256, 32, *GPT_SIZES["tiny"]), batch=2),
}


@contextmanager
def _heavyball_mode(hb: Any, compiled: bool) -> Iterator[None]:
    """heavyball compiles its kernels unless ``heavyball.utils.compile_mode`` is None (read at call time)."""
    saved = hb.utils.compile_mode
    hb.utils.compile_mode = saved if compiled else None
    try:
        yield
    finally:
        hb.utils.compile_mode = saved


def _timing_optimizers(ref: Any, hb: Any, frequency: int) -> list[tuple[str, Callable[[Any], Any]]]:
    """(label, factory) for every optimizer timed; hyperparameters as ``powertrain train`` uses them."""
    shampoo = Case(
        name="timing",
        lr=3e-3,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=0.1,
        max_preconditioner_dim=1024,
        precondition_frequency=frequency,
    )
    soap = dataclasses.replace(
        shampoo, preconditioner="eigenvalue_corrected", betas=(0.9, 0.95), epsilon=1e-8, grafting="none"
    )
    out: list[tuple[str, Callable[[Any], Any]]] = [
        ("torch AdamW", lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)),
        ("powertrain Shampoo", lambda p: powertrain_optimizer(p, shampoo)),
    ]
    if "preconditioner" in inspect.signature(DistributedShampoo).parameters:
        out.append(("powertrain eigenvalue-corrected", lambda p: powertrain_optimizer(p, soap)))
    if ref is not None:
        # the reference's own defaults for everything that does not change the math (packed storage, epsilon
        # added before eigh), as its users run it
        def ref_default(case: Case) -> Callable[[Any], Any]:
            return lambda p: reference_optimizer(ref, p, case, torch.float32, variant=True)

        out += [("reference Shampoo", ref_default(shampoo)), ("reference eigenvalue-corrected", ref_default(soap))]
    if hb is not None:
        kw = dict(
            lr=3e-3,
            betas=(0.9, 0.95),
            shampoo_beta=0.95,
            eps=1e-8,
            weight_decay=0.1,
            precondition_frequency=frequency,
            max_precond_dim=1024,
        )
        out += [
            ("heavyball SOAP", lambda p: hb.SOAP(p, **kw)),
            ("heavyball KLShampoo", lambda p: hb.KLShampoo(p, **kw)),
        ]
    return out


def step_times(
    ref: Any, hb: Any, *, preset: str, warmup: int, timed: int, frequency: int = 10, heavyball_compile: bool = False
) -> dict[str, Any]:
    """Interleaved training rounds of every optimizer on its own copy of the GPT (see the module docstring)."""
    p = TIMING_PRESETS[preset]
    corpus = load_data(TrainConfig(data_max_mb=2.0))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"
    torch.manual_seed(0)
    base = GPT(p.model)
    runs = []
    for label, factory in _timing_optimizers(ref, hb, frequency):
        model = copy.deepcopy(base)
        runs.append(
            {
                "name": label,
                "model": model,
                "opt": factory(list(model.parameters())),
                "opt_s": [],
                "step_s": [],
                "loss": [],
                "error": None,
            }
        )
    for step in range(warmup + timed):
        x, y = corpus.batch("train", 0, 1, (0, step), p.batch, p.model.block_size)
        for run in runs:
            if run["error"]:
                continue
            hb_run = run["name"].startswith("heavyball")
            t0 = time.perf_counter()
            try:
                run["opt"].zero_grad(set_to_none=True)
                loss = run["model"](x, y)
                loss.backward()
                t1 = time.perf_counter()
                if hb_run:
                    with _heavyball_mode(hb, heavyball_compile):
                        run["opt"].step()
                else:
                    run["opt"].step()
            except Exception as e:  # a third-party optimizer failing must not lose the others' results
                run["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                continue
            t2 = time.perf_counter()
            run["loss"].append(loss.item())
            if step >= warmup:
                run["opt_s"].append(t2 - t1)
                run["step_s"].append(t2 - t0)
    rows = []
    for run in runs:
        row: dict[str, Any] = {"name": run["name"], "error": run["error"]}
        if not run["error"]:
            row |= {
                "opt_median_s": statistics.median(run["opt_s"]),
                "opt_mean_s": statistics.fmean(run["opt_s"]),
                "step_median_s": statistics.median(run["step_s"]),
                "step_mean_s": statistics.fmean(run["step_s"]),
                "final_loss": statistics.fmean(run["loss"][-5:]),
            }
        rows.append(row)
    return {
        "preset": preset,
        "model": dataclasses.asdict(p.model),
        "batch": p.batch,
        "warmup": warmup,
        "timed": timed,
        "frequency": frequency,
        "threads": torch.get_num_threads(),
        "params": sum(q.numel() for q in base.parameters()),
        "heavyball_compile": heavyball_compile,
        "rows": rows,
    }


# -- 3. entry points ------------------------------------------------------------------------------------------


def compare(
    reference_path: str | None,
    *,
    steps: int,
    timing_steps: int = 20,
    warmup: int = 2,
    preset: str = "default",
    threads: int = 1,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64),
    cases: list[Case] | None = None,
    heavyball_compile: bool = False,
    reference_commit: str | None = None,
) -> dict[str, Any]:
    """Agreement with the reference (``steps`` per case and dtype; 0: skip) and step times (``timing_steps``
    timed rounds after ``warmup``; 0: skip). Returns a JSON-serialisable dict for :func:`markdown`.

    Args:
        reference_path: root of a clone of facebookresearch/optimizers (None: an installed
            ``distributed_shampoo`` if any, else the reference is left out).
        steps: optimizer steps per agreement run.
        timing_steps, warmup: timed and untimed rounds of the step-time comparison.
        preset: the GPT of the step-time comparison (``default``: ``powertrain train``'s; ``tiny``).
        threads: torch threads for everything (restored afterwards).
        dtypes: parameter dtypes of the agreement runs.
        cases: agreement configurations (default: :func:`default_cases`).
        heavyball_compile: let heavyball torch.compile its kernels (default: eager, like the others).
        reference_commit: the clone's commit, when ``reference_path`` has no ``.git`` (e.g. a ``git archive``).
    """
    if steps < 0 or timing_steps < 0 or warmup < 0:
        raise ValueError(f"Invalid steps={steps}, timing_steps={timing_steps}, warmup={warmup}: must be >= 0")
    if preset not in TIMING_PRESETS:
        raise ValueError(f"Invalid preset={preset!r}: choose {', '.join(TIMING_PRESETS)}")
    ref = load_reference(reference_path)
    try:
        hb: Any = importlib.import_module("heavyball")
    except ImportError:
        hb = None
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results: dict[str, Any] = {
            "reference": None if ref is None else reference_version(ref, reference_commit),
            "heavyball": None if hb is None else getattr(hb, "__version__", _dist_version("heavyball")),
            "torch": torch.__version__,
            "machine": machine_info(),
            "threads": threads,
            "differences": [] if ref is None else list(DESIGN_DIFFERENCES),
            "agreement": [],
            "timing": None,
        }
        if ref is not None and steps > 0:
            for case in default_cases() if cases is None else cases:
                for dtype in dtypes:
                    results["agreement"].append(agreement(ref, case, steps=steps, dtype=dtype))
        if timing_steps > 0:
            results["timing"] = step_times(
                ref, hb, preset=preset, warmup=warmup, timed=timing_steps, heavyball_compile=heavyball_compile
            )
    finally:
        torch.set_num_threads(saved_threads)
    return results


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def _sci(x: float) -> str:
    return f"{x:.1e}"


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown section (agreement table, design differences, step-time table)."""
    ref = results["reference"]
    lines = ["## Shampoo side by side: powertrain vs facebookresearch/optimizers and heavyball", ""]
    lines.append(
        f"Reference: {ref['package']} at commit `{ref['commit'][:12]}` (local clone)."
        if ref
        else "Reference: not available (no clone given), so only step times of the others are shown."
    )
    lines.append(
        f"heavyball: {results['heavyball'] or 'not installed'}. torch {results['torch']}, "
        f"{results['threads']} thread(s).\n"
    )
    if results["agreement"]:
        first = results["agreement"][0]
        c = first["case"]
        lines.append(
            f"### Agreement ({len(first['forced_rel_update_diff'])} steps per run)\n\n"
            "Small models (MLP 20-48-40-10 with tanh, or a conv1d (8, 3, 5) + linear), cross-entropy on Gaussian "
            f"inputs labelled by a fixed random linear teacher, batch {c['batch']}, max_preconditioner_dim "
            f"{c['max_preconditioner_dim']} (blocks and 1-D factors), precondition_frequency = "
            f"start_preconditioning_step = {c['precondition_frequency']}, "
            f"lr {c['lr']:g}, eigh roots. *Update diff*: teacher-forced (same parameters and gradient every "
            "step), max over steps of ||u_ref - u_pt|| / ||u_pt||, in the grafting-only phase and from the first "
            "preconditioned step on. *Floor*: the reference against itself with options equal in exact "
            "arithmetic. *Free run*: each on its own trajectory; last step's max |p_ref - p_pt|, relative "
            "parameter difference and losses.\n"
        )
        rows = []
        for a in results["agreement"]:
            s, c = a["summary"], a["case"]
            rows.append(
                [
                    c["name"],
                    a["dtype"],
                    f"{c['betas'][0]:g}, {c['betas'][1]:g}",
                    f"{c['epsilon']:g}",
                    c["grafting"],
                    _sci(s["graft_phase"]),
                    _sci(s["shampoo_phase"]),
                    _sci(s["noise_floor"]),
                    _sci(s["final_max_abs_param_diff"]),
                    _sci(s["final_rel_param_diff"]),
                    f"{s['final_loss_powertrain']:.5f} / {s['final_loss_reference']:.5f}",
                ]
            )
        headers = [
            "case",
            "dtype",
            "betas",
            "epsilon",
            "grafting",
            "update diff (graft phase)",
            "update diff (preconditioned)",
            "floor (ref vs ref)",
            "free: max abs diff",
            "free: rel diff",
            "free: final loss pt / ref",
        ]
        lines += [table(headers, rows), ""]
        n = len(first["loss_powertrain"])
        picks = sorted({0, *range(4, n, 5), n - 1})
        curve = [[i + 1, f"{first['loss_powertrain'][i]:.5f}", f"{first['loss_reference'][i]:.5f}"] for i in picks]
        lines += [
            f"Loss curves of the first case ({first['dtype']}, free-running):\n",
            table(["step", "powertrain", "reference"], curve),
            "",
        ]
        lines += ["Differences (found by reading both; most are visible in a row above):\n"]
        lines += [f"- {d}" for d in results["differences"]] + [""]
    t = results["timing"]
    if t:
        m = t["model"]
        lines.append(
            f"### Step time\n\nGPT {m['n_layer']} layers x d_model {m['d_model']} ({t['params'] / 1e6:.2f}M "
            f"parameters), {t['batch']}x{m['block_size']} tokens, {t['threads']} thread(s), one process; "
            f"{t['timed']} timed rounds after {t['warmup']} warm-up rounds, every optimizer one step per round on "
            f"the same batch. Shampoo-type optimizers recompute roots/eigenbases every {t['frequency']} steps "
            "(max_preconditioner_dim 1024): the *median* of `step()` leaves those steps out, the *mean* amortises "
            "them; a train step is forward, backward and `step()`. heavyball "
            f"{'compiled' if t['heavyball_compile'] else 'eager (compile_mode=None)'}. Timings on a shared machine "
            "are noisy: compare ratios within one run.\n"
        )
        rows = []
        ok = [r for r in t["rows"] if not r["error"]]
        base = next((r for r in ok if r["name"] == "torch AdamW"), ok[0] if ok else None)
        for r in t["rows"]:
            if r["error"] or base is None:
                rows.append([r["name"], "failed", "", "", "", "", "", r["error"] or ""])
                continue
            rows.append(
                [
                    r["name"],
                    f"{1e3 * r['opt_median_s']:.1f}",
                    f"{1e3 * r['opt_mean_s']:.1f}",
                    f"{r['step_median_s']:.3f}",
                    f"{r['step_mean_s']:.3f}",
                    f"{r['step_mean_s'] / base['step_mean_s']:.2f}x",
                    f"{r['opt_mean_s'] / base['opt_mean_s']:.1f}x",
                    f"{r['final_loss']:.3f}",
                ]
            )
        headers = [
            "optimizer",
            "step() median (ms)",
            "step() mean (ms)",
            "train step median (s)",
            "train step mean (s)",
            "train step mean vs AdamW",
            "step() mean vs AdamW",
            "loss (last 5)",
        ]
        lines += [table(headers, rows), ""]
    lines.append(f"Machine: {results['machine']}.\n")
    if results.get("command"):
        lines.append(f"Command: `{results['command']}`\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/shampoo_reference.py", description=__doc__.split("\n")[0])
    ap.add_argument("--reference-path", default=None, help="root of a facebookresearch/optimizers clone")
    ap.add_argument("--reference-commit", default=None, help="its commit, if the clone has no .git")
    ap.add_argument("--steps", type=int, default=30, help="steps per agreement run (0: skip)")
    ap.add_argument("--timing-steps", type=int, default=20, help="timed rounds (0: skip the step-time part)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(TIMING_PRESETS), default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heavyball-compile", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--write", default="", help="Markdown file whose 'shampoo-reference' section to update")
    args = ap.parse_args(argv)
    results = compare(
        args.reference_path,
        steps=args.steps,
        timing_steps=args.timing_steps,
        warmup=args.warmup,
        preset=args.preset,
        threads=args.threads,
        heavyball_compile=args.heavyball_compile,
        reference_commit=args.reference_commit,
    )
    results["command"] = "python tools/shampoo_reference.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.json:
        Path(args.json).write_text(_json.dumps(results, indent=1))
    publish(markdown(results), args.write or None, "shampoo-reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
