"""What orthonormalized optimizers (:class:`~powertrain.optim.Muon`, :class:`~powertrain.optim.Dion`) share: the rule
that picks the hidden matrices they step, and the AdamW that steps every other parameter inside the same optimizer.

Muon and Dion are for a network's hidden matrices. Embeddings (a row per token: a lookup, not a linear map), the
output head (its rows are the classes), norms' gains and biases (vectors) are trained with AdamW, as in Keller
Jordan's Muon, Moonlight and microsoft/dion. :func:`default_rule` decides by shape and by the name of the parameter's
module; a model whose names it misreads passes ``rule=`` or explicit parameter groups.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from powertrain._compat import adamw_functional, optimizer_scalar_dtype

__all__ = [
    "MatrixOptimizer",
    "Rule",
    "check_adamw_options",
    "check_algorithms",
    "check_matrices",
    "default_rule",
    "is_embedding_or_head",
    "row_sharded",
    "split_params",
    "step_adamw",
]

Rule = Callable[[str, torch.Tensor], bool]

#: Module names (the last part of a parameter's module path that is not an index, lower case) of embeddings and output
#: layers besides those containing "embed": nanoGPT's and GPT-2's (wte, wpe, lm_head), torchtitan's Llama (output),
#: powertrain's GPT (tok, pos, head), T5's tied embedding (shared), classifiers.
_NOT_HIDDEN = frozenset(
    {"wte", "wpe", "tok", "pos", "shared", "lm_head", "head", "heads", "output", "classifier", "score"}
)
#: Names of parameters registered on a module directly (not a layer's ``weight``) that are embeddings.
_EMBEDDINGS = frozenset({"pos_emb", "tok_emb", "cls_token", "class_token"})


def is_embedding_or_head(name: str) -> bool:
    """Whether the parameter called ``name`` (as ``named_parameters()`` gives it, e.g. ``"blocks.0.qkv.weight"``)
    belongs to an embedding or an output layer: its own name contains ``embed`` (``positional_embedding``) or is one
    of ``pos_emb``, ``tok_emb``, ``cls_token``, ``class_token``; or its module's (the last part of the path that is not
    an index: ``head.0.weight``'s is ``head``) contains ``embed`` or is one of ``wte``, ``wpe``, ``tok``, ``pos``,
    ``shared``, ``lm_head``, ``head``, ``heads``, ``output``, ``classifier``, ``score``. A name it misreads (BERT's
    ``cls.predictions.decoder``, say) needs ``rule=`` or explicit groups."""
    *path, own = name.lower().split(".")
    modules = [part for part in path if not part.isdigit()]
    module = modules[-1] if modules else ""
    return "embed" in own or own in _EMBEDDINGS or "embed" in module or module in _NOT_HIDDEN


def default_rule(name: str, param: torch.Tensor) -> bool:
    """Whether a Muon- or Dion-style optimizer takes ``param``: a 2-D parameter that is not an embedding or output
    layer (``is_embedding_or_head``). Everything else (vectors, embeddings, the head, convolution kernels) is
    AdamW's."""
    return param.ndim == 2 and not is_embedding_or_head(name)


def split_params(
    params: Iterable[Any], algorithm: str, rule: Rule, owner: str
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The parameter groups of a composite optimizer, and a name for each parameter (by ``id``).

    ``params`` is ``model.named_parameters()`` (split by ``rule`` into a group with ``"algorithm": algorithm`` and
    one with ``"algorithm": "adamw"``; an empty one is left out), or parameter groups (dicts) that each name their
    ``"algorithm"``. Plain tensors are refused: without names the rule cannot tell an embedding from a hidden matrix.
    Parameters that do not require grad are kept (torch optimizers skip them while they have no gradient)."""
    items = list(params)
    if not items:
        raise ValueError(f"{owner} got no parameters: pass model.named_parameters()")
    names: dict[int, str] = {}
    if all(isinstance(x, dict) for x in items):
        groups = []
        for i, group in enumerate(items):
            if group.get("algorithm") not in (algorithm, "adamw"):
                raise ValueError(
                    f"{owner}'s parameter group {i} has algorithm={group.get('algorithm')!r}: each group names "
                    f"'{algorithm}' or 'adamw'"
                )
            tensors = group.get("params")
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or [])
            for j, p in enumerate(tensors):
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"{owner}'s parameter group {i} holds a {type(p).__name__}: pass tensors")
                names.setdefault(id(p), f"group {i} parameter {j}")
            groups.append({**group, "params": tensors})
        return groups, names
    if not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor) for x in items):
        raise ValueError(
            f"{owner} needs model.named_parameters() (the names tell embeddings and the output head, which AdamW "
            f"steps, from hidden matrices), or parameter groups each with 'algorithm': '{algorithm}' or 'adamw'"
        )
    chosen: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for name, p in items:
        if id(p) in names:
            raise ValueError(f"Parameter {name} is listed twice (also as {names[id(p)]}): pass each parameter once")
        names[id(p)] = name
        (chosen if rule(name, p) else rest).append(p)
    groups = [{"params": ps, "algorithm": a} for ps, a in ((chosen, algorithm), (rest, "adamw")) if ps]
    return groups, names


def check_matrices(owner: str, algorithm: str, groups: list[dict[str, Any]], names: dict[int, str]) -> None:
    """ValueError in one line for a parameter the ``algorithm`` groups cannot step (not a matrix, or empty); a warning
    when they hold none (the optimizer would be AdamW alone)."""
    chosen = [p for g in groups if g["algorithm"] == algorithm for p in g["params"]]
    for p in chosen:
        if p.ndim < 2 or p.numel() == 0:
            what = f"has shape {tuple(p.shape)}" if p.ndim < 2 else "has no entries"
            name = names.get(id(p), "a parameter")
            raise ValueError(f"{owner} steps matrices; {name} {what}: give it to the 'adamw' group")
    if not chosen:
        warnings.warn(
            f"{owner} took no parameter as a hidden matrix (its rule or groups): it is AdamW alone", stacklevel=4
        )


#: AdamW's options that no schedule moves (see :attr:`MatrixOptimizer.fixed_options`)
_ADAMW_FIXED = frozenset({"eps"})


def _option(value: Any) -> Any:
    """An option as compared at load: a sequence as a tuple (a state through JSON or DCP may hold a list)."""
    return tuple(value) if isinstance(value, list | tuple) else value


def check_algorithms(owner: str, saved: Any, groups: list[dict[str, Any]]) -> None:
    """ValueError in one line unless a state dict's parameter groups name this optimizer's groups' algorithms, in
    order (torch would relabel them and fail in a later step)."""
    saved_groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        return  # torch's own load refuses it, naming the groups
    for i, (s, g) in enumerate(zip(saved_groups, groups, strict=True)):
        got = s.get("algorithm") if isinstance(s, dict) else None
        if got != g["algorithm"]:
            raise ValueError(
                f"{owner} state_dict's parameter group {i} is {got!r}'s and this optimizer's {g['algorithm']!r}'s: "
                "load a state written by the same optimizer and groups"
            )


def row_sharded(
    owner: str, matrices: list[torch.Tensor], names: dict[int, str]
) -> tuple[dist.ProcessGroup | None, bool]:
    """Whether the matrices are row-sharded DTensors (and their mesh's group), or replicated (plain tensors or
    DTensors replicated on every mesh dimension). A mix, another placement or several meshes are refused."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sharded = [
        p for p in matrices if isinstance(p, DTensor) and not all(isinstance(x, Replicate) for x in p.placements)
    ]
    if not sharded:
        return None, False
    meshes = {id(p.device_mesh) for p in sharded}
    for p in matrices:
        name = names.get(id(p), "a parameter")
        if not isinstance(p, DTensor) or p.placements != (Shard(0),) or p.device_mesh.ndim != 1 or len(meshes) > 1:
            placement = p.placements if isinstance(p, DTensor) else "a plain tensor"
            raise ValueError(
                f"{owner} steps sharded matrices that are all row-sharded on one 1-D mesh (FSDP2, SimpleFSDP "
                f"fully_shard: Shard(0)); {name} is {placement}. Tensor parallelism and HSDP meshes are not supported"
            )
    return sharded[0].device_mesh.get_group(), True


def check_adamw_options(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """ValueError in one line for an AdamW option out of its range (torch.optim.AdamW's checks)."""
    for name, value in (("adamw_lr", lr), ("adamw_eps", eps), ("adamw_weight_decay", weight_decay)):
        if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(f"Invalid {name}={value!r}: must be a finite number >= 0")
    numbers = isinstance(betas, tuple | list) and all(
        isinstance(b, int | float) and not isinstance(b, bool) for b in betas
    )
    if not (numbers and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"Invalid adamw_betas={betas!r}: must be two numbers in [0, 1)")


def adamw_defaults(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> dict[str, Any]:
    """An AdamW group's hyperparameters, as :func:`step_adamw` reads them."""
    return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}


def step_adamw(group: Mapping[str, Any], state: Mapping[torch.Tensor, dict[str, Any]], *, local: bool = False) -> None:
    """One AdamW step of ``group``'s parameters that have a gradient: torch.optim.AdamW's state (``step``,
    ``exp_avg``, ``exp_avg_sq``, created as it creates them) and its functional update with its default choices
    (no amsgrad, not fused, foreach where torch would take it), so bitwise ``torch.optim.AdamW`` with these settings.
    ``local``: on each DTensor's local shard, with plain tensors as state (an optimizer whose state is per rank)."""
    from powertrain.ops.flat import local_tensor

    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise ValueError("AdamW (inside a composite optimizer) does not support sparse gradients")
        st = state[p]
        w, grad = (local_tensor(p), local_tensor(p.grad)) if local else (p, p.grad)
        if not st:
            st["step"] = torch.tensor(0.0, dtype=optimizer_scalar_dtype(), device="cpu")
            st["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
        params.append(w)
        grads.append(grad)
        exp_avgs.append(st["exp_avg"])
        exp_avg_sqs.append(st["exp_avg_sq"])
        steps.append(st["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    adamw_functional(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=None,
        has_complex=any(torch.is_complex(p) for p in params),
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


class MatrixOptimizer(torch.optim.Optimizer):
    """An optimizer of a model's hidden matrices (the ``algorithm`` groups) with AdamW on the other parameters: the
    groups, their defaults and checks, and the state's checks at load, for :class:`~powertrain.optim.Muon` and
    :class:`~powertrain.optim.Dion`. Subclasses set :attr:`algorithm` and step the matrices themselves."""

    #: the name of the matrices' groups' algorithm ("muon", "dion")
    algorithm: ClassVar[str]
    #: the options of the matrices' groups that define the algorithm rather than a schedule's value: a state saved with
    #: others is refused at load. Learning rates, momenta, betas and weight decay follow torch's load (the saved
    #: values replace the built ones), as schedules move them (OneCycleLR cycles a group's momentum).
    fixed_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        params: Iterable[Any],
        matrix_defaults: dict[str, Any],
        adamw: tuple[float, tuple[float, float], float, float],
        rule: Rule,
        check_options: Callable[[dict[str, Any]], None],
    ) -> None:
        """``matrix_defaults``: the matrices' groups' options (checked by ``check_options``); ``adamw``: the AdamW
        groups' ``(lr, betas, eps, weight_decay)``."""
        owner = type(self).__name__
        check_options(matrix_defaults)
        check_adamw_options(*adamw)
        self._check_options = check_options
        self._group_defaults = {self.algorithm: matrix_defaults, "adamw": adamw_defaults(*adamw)}
        groups, self._names = split_params(params, self.algorithm, rule, owner)
        self._built = False
        super().__init__(groups, {})
        lr, betas, eps, weight_decay = adamw
        adamw_options = {
            "adamw_lr": lr,
            "adamw_betas": tuple(betas),
            "adamw_eps": eps,
            "adamw_weight_decay": weight_decay,
        }
        self.defaults = {**matrix_defaults, **adamw_options}
        check_matrices(owner, self.algorithm, self.param_groups, self._names)
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while the constructor builds the groups: after that ValueError (pass every group to the constructor).
        A group needs ``"algorithm"`` (the optimizer's own, e.g. ``"muon"``, or ``"adamw"``); its missing options take
        that algorithm's defaults, and unknown or invalid ones raise ValueError."""
        if self._built:
            raise ValueError(
                f"{type(self).__name__}'s groups are fixed when it is built (its matrices' work and state are set up "
                "then): pass every parameter group to the constructor"
            )
        algorithm = param_group.get("algorithm")
        if algorithm not in self._group_defaults:
            raise ValueError(
                f"A {type(self).__name__} parameter group needs 'algorithm': '{self.algorithm}' or 'adamw', got "
                f"{algorithm!r}"
            )
        known = {"params", "algorithm", "name", "param_names", *self._group_defaults[algorithm]}
        if unknown := sorted(set(param_group) - known):
            raise ValueError(
                f"A {type(self).__name__} '{algorithm}' group has the unknown option(s) {unknown}: its options are "
                f"{sorted(self._group_defaults[algorithm])}"
            )
        filled = {**self._group_defaults[algorithm], **param_group}
        if algorithm == self.algorithm:
            self._check_options(filled)
        else:
            check_adamw_options(filled["lr"], filled["betas"], filled["eps"], filled["weight_decay"])
        super().add_param_group(filled)

    def state_shapes(self, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The shape of each of ``p``'s state tensors, what a loaded state is checked against: here an AdamW
        parameter's (its moments the parameter's local shape, its step a scalar); subclasses add their matrices'."""
        from powertrain.ops.flat import local_tensor

        local = tuple(local_tensor(p).shape)
        return {"step": (), "exp_avg": local, "exp_avg_sq": local}

    def _refuse_sparse(self) -> None:
        """ValueError in one line, before anything changes, for a sparse gradient (an ``nn.Embedding(sparse=True)``):
        neither the matrices' algorithm nor the AdamW groups step one."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    name = self._names.get(id(p), "a parameter")
                    raise ValueError(
                        f"{type(self).__name__} does not step sparse gradients, and {name} has one: build its module "
                        "with sparse=False"
                    )

    def _nonfinite_names(self, *state_keys: str) -> list[str]:
        """The names of the parameters whose gradient on this rank (a shard's local part), or state tensor under one of
        ``state_keys``, holds NaN or Inf: what an error names after a step's finiteness check failed (the step has
        refused sparse gradients before)."""
        from powertrain.ops.finite import all_finite
        from powertrain.ops.flat import local_tensor

        bad = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state.get(p, {})
                if not all_finite(local_tensor(t) for t in [p.grad, *(st[k] for k in state_keys if k in st)]):
                    bad.append(self._names.get(id(p), "a parameter"))
        return bad

    def _saved_keys(self, state_dict: dict[str, Any]) -> dict[Any, torch.Tensor]:
        """Which of this optimizer's parameters each key of a saved state names: the saved groups' ``params`` list
        the keys in the order of the parameters (indices, or names through torch.distributed.checkpoint's state
        dicts), as torch's load maps them."""
        keys = [k for g in state_dict["param_groups"] for k in g.get("params", ())]
        return dict(zip(keys, (p for g in self.param_groups for p in g["params"]), strict=False))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, after checking what it would take as it is: each group's algorithm and options (the
        constructor's checks: a saved ``weight_decay=-5`` was taken), each state tensor's shape (a wrong one failed
        at the next step) and values (finite: a NaN momentum made NaN weights)."""
        from powertrain.ops.finite import all_finite
        from powertrain.ops.flat import local_tensor

        owner = type(self).__name__
        check_algorithms(owner, state_dict, self.param_groups)
        for group in state_dict["param_groups"]:
            defaults = self._group_defaults[group["algorithm"]]
            filled = {**defaults, **{k: v for k, v in group.items() if k in defaults}}
            if group["algorithm"] == self.algorithm:
                self._check_options(filled)
            else:
                check_adamw_options(filled["lr"], filled["betas"], filled["eps"], filled["weight_decay"])
        for i, (group, built) in enumerate(zip(state_dict["param_groups"], self.param_groups, strict=False)):
            fixed = self.fixed_options if built["algorithm"] == self.algorithm else _ADAMW_FIXED
            for key in sorted(fixed):
                # torch's load replaces the built group's options by the saved ones: a setting given to the
                # constructor would be dropped without a word
                if key not in group:
                    continue
                was, now = _option(group[key]), _option(built[key])
                if was != now:
                    raise ValueError(
                        f"{owner} state_dict's parameter group {i} ({built['algorithm']}) was saved with "
                        f"{key}={was!r}, this optimizer has {key}={now!r}: build it with {key}={was!r} to continue"
                    )
        saved = state_dict.get("state", {})
        params = self._saved_keys(state_dict)
        for index, st in saved.items() if isinstance(saved, dict) else ():
            if index not in params or not isinstance(st, dict):
                raise ValueError(
                    f"{owner} state_dict has an entry {index!r:.40} for none of its {len(params)} parameters"
                )
            name = self._names.get(id(params[index]), "a parameter")
            for key, want in self.state_shapes(params[index]).items():
                if not isinstance(st.get(key), torch.Tensor):
                    continue  # a missing or misnamed entry is torch's load's (or the caller's check's) to refuse
                got = local_tensor(st[key])  # a DTensor through DCP's state dicts: its local rows, as want
                if tuple(got.shape) != want:
                    raise ValueError(
                        f"{owner} state_dict's {key} for {name} is {tuple(got.shape)}, this optimizer's is {want} "
                        "(another model, rank fraction or world size: a sharded matrix's state is this rank's rows)"
                    )
                if got.is_complex() or not all_finite([got]):
                    raise ValueError(f"{owner} state_dict's {key} for {name} holds non-finite or complex values")
        super().load_state_dict(state_dict)
