"""Local updates across slow links: DiLoCo and Streaming DiLoCo, with any powertrain compressor on the outer step.

Data parallelism sends a gradient every step. With local updates each replica (a process, or a group of processes
that train one model copy exactly, e.g. with DDP inside a node) takes ``sync_every`` = H steps of its own *inner*
optimizer on its own data, then the replicas exchange what they learned and agree on one model again:

1. the pseudo-gradient ``delta = anchor - local`` (the anchor: the weights every replica agreed on at the last
   synchronisation; ``local``: this replica's weights now);
2. ``delta`` is averaged over the replicas through a :class:`~powertrain.compress.Compressor` with its error feedback
   (int4 by default; int8, PowerSGD, top-k, or exact fp32 with "none": what a message leaves out is sent later);
3. an *outer* SGD with Nesterov momentum steps the anchor with the average as its gradient (lr 1 and no momentum by
   default: plain averaging, which measured far better from scratch at H 10-50 than DiLoCo's lr 0.7, momentum 0.9),
   and the replica continues from the new anchor.

Every setting is a field of :class:`DiLoCoConfig`, the one type a script and ``powertrain train --parallel diloco``
share: ``DiLoCo(params, inner)`` runs the command's defaults.

This is DiLoCo (Douillard et al., arXiv 2311.08105); with outer SGD at lr 1 and no momentum it is plain model
averaging (local SGD). Streaming DiLoCo (Douillard et al., arXiv 2501.18512) adds, and this class takes:

* ``fragments`` = F: the parameters split into F groups, fragment ``i`` synchronised at inner steps ``i * H / F``
  (mod H), so a sync carries 1/F of the model and the link's peak load drops F-fold;
* ``sync_delay`` = tau: a fragment's collectives run in the background (:class:`powertrain.compress.chain.Chain`)
  while the next tau inner steps compute; its outer update is applied after them, mixed with what the replica learned
  meanwhile (``sync_mix`` = alpha: ``local <- alpha * local + (1 - alpha) * anchor``; 0 takes the anchor as it is).

Compute waits for the link only when a sync has not arrived when it is due (its wait is counted in
``stats.comm_s`` and :attr:`DiLoCo.waited_s`).

SparseLoCo's outer step (Sarfi et al., arXiv 2508.15706: top-k at 1-3% with 2-bit values, the compressor's decayed
error-feedback accumulator in place of outer momentum) is ``DiLoCoConfig(compressor="topk", compressor_options={"ratio":
0.02, "bits": 2, "error_decay": 0.95})`` with the default outer step (plain averaging); with
``error_decay=1`` what a sync leaves out is carried undecayed into the next one (classic error feedback).

Usage (each process a replica)::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model.named_parameters(), inner)  # or DiLoCo(..., DiLoCoConfig(sync_every=50, ...))
    for x, y in loader:
        model(x, y).backward()
        diloco.step()       # the inner step; every 25 steps also the outer one
        diloco.zero_grad()
    diloco.finish()         # one last synchronisation: every replica holds the same model

A replica's checkpoint is three states, each rank its own (replicas' weights differ between synchronisations, and DCP
keeps one copy of equally named tensors): the model's, the inner optimizer's and :meth:`DiLoCo.state_dict`'s (anchor,
outer momentum, error feedback, a sync in flight); docs/local-updates.md shows a save and a resume.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain._diloco_config import DiLoCoConfig, schedule
from powertrain._diloco_state import Layout, SavedState
from powertrain._outer_sync import OuterSync, Pending
from powertrain.comm import CommStats, Communicator, group_of_its_own
from powertrain.compress.base import Compressor, placeholder, run_program
from powertrain.ops.flat import local_tensor

__all__ = ["DiLoCo", "DiLoCoConfig", "schedule", "split_by_size"]


def split_by_size(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Consecutive positions ``0..len(sizes) - 1`` in ``fragments`` groups of about equal total size, none empty: group
    ``k`` ends before the first position at which the running total reaches ``(k + 1) / fragments`` of the whole.
    ``sizes``: each parameter's size (``numel()``), in order; ``fragments`` is at most ``len(sizes)``."""
    check_int("fragments", fragments, 1)
    n = len(sizes)
    if fragments > n:
        raise ValueError(f"Invalid fragments={fragments}: there are only {n} parameters to split")
    total = sum(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for k in range(1, fragments):
        end = next((e for e in range(1, n + 1) if prefix[e] * fragments >= k * total), n)
        cuts.append(min(max(end, cuts[-1] + 1), n - (fragments - k)))  # every group keeps at least one parameter
    cuts.append(n)
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


class DiLoCo:
    """Local updates with a compressed, optionally streamed and overlapped, outer step (see the module docstring).

    Args:
        params: the replica's trainable parameters (``model.named_parameters()`` or ``model.parameters()``), the ones
            ``inner`` steps; FSDP2's sharded parameters (DTensors) take part with their local shards.
        inner: the inner optimizer (any ``torch.optim.Optimizer``, powertrain's included). :meth:`step` steps it.
        config: the settings (default ``DiLoCoConfig()``: what ``powertrain train --parallel diloco`` runs).
        group: the process group whose ranks are the replicas (default: the world). Ranks that train one replica
            together (DDP or FSDP2 inside a node) pass a group of one rank per replica, or a ``HierarchicalCompressor``
            as the config's compressor.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        inner: torch.optim.Optimizer,
        config: DiLoCoConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        config = DiLoCoConfig() if config is None else config
        if not isinstance(config, DiLoCoConfig):
            raise ValueError(
                f"config must be a DiLoCoConfig, got {type(config).__name__}: DiLoCo(params, inner, "
                "DiLoCoConfig(sync_every=..., ...))"
            )
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if getattr(inner, "communicates", False):
            fix = "build it with split=False" if hasattr(inner, "split") else "use an optimizer that steps alone"
            raise ValueError(
                f"The inner {type(inner).__name__} communicates across ranks in its step (it assumes averaged "
                f"gradients, or sends its own); each replica of local updates steps alone: {fix}"
            )
        named = [item if isinstance(item, tuple) else (f"param[{i}]", item) for i, item in enumerate(params)]
        named = [(n, p) for n, p in named if p.requires_grad]
        if not named:
            raise ValueError("DiLoCo got no trainable parameters: pass model.named_parameters()")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        stepped = {id(p) for g in inner.param_groups for p in g["params"]}
        if missing := [n for n, p in named if id(p) not in stepped]:
            raise ValueError(f"The inner optimizer does not step {missing[:3]}: build it on the same parameters")
        self.inner = inner
        self.config = config
        local = self._locals()
        self.fragments = _fragments(config.fragments, [t.numel() for t in local])
        nf = len(self.fragments)
        #: fragment k starts its syncs at inner steps offsets[k] + j * sync_every (j >= 0; never at step 0)
        self.offsets = schedule(self.config.sync_every, len(self.fragments), self.config.sync_delay)
        self.compressor = self._compressor(config.compressor, dict(config.compressor_options), group, local)
        #: averages every step's gradients during the warm-up (None without one): the replicas train as one
        self.warmup_compressor = (
            self._compressor(config.warmup_compressor, dict(config.warmup_options), group, local, own_group=False)
            if self.config.sync_warmup
            else None
        )
        if self.warmup_compressor is not None and isinstance(config.warmup_compressor, str):  # one count of sends
            warm = self.warmup_compressor
            warm.comm = Communicator(warm.comm.group, stats=self.compressor.comm.stats)
        #: the anchors, the outer optimizer and the sync in flight
        self.sync = OuterSync(
            self.compressor, local, self.fragments, lr=config.outer_lr, momentum=config.outer_momentum
        )
        _check_same_start(self.sync.anchors, group)
        self.step_count = 0  # inner steps taken
        self._lr_scale: float | None = None  # the outer rate's multiplier at the latest inner step (None: none yet)
        self._updated_at = [self.config.sync_warmup] * nf  # the inner step of each fragment's latest outer update

    def _locals(self) -> list[torch.Tensor]:
        """This rank's tensor of every parameter (a DTensor's local shard: FSDP2 keeps its storage, so writes land)."""
        with torch.no_grad():
            return [local_tensor(p) for p in self.params]

    def _compressor(
        self,
        spec: str | Compressor,
        options: dict[str, Any],
        group: dist.ProcessGroup | None,
        local: list[torch.Tensor],
        own_group: bool = True,
    ) -> Compressor:
        if isinstance(spec, Compressor):  # the config checked that no options came with it
            shapes = [tuple(p.shape) for p in spec.params]
            if shapes != [tuple(t.shape) for t in local]:
                raise ValueError(
                    f"The compressor was built for parameters of shapes {shapes[:3]}..., not this "
                    "replica's (local) parameters: build it on the same parameters"
                )
            used = spec.communicators() or [spec.comm]  # the groups its requests go to
            # the outer step's collectives overlap training's; the warm-up's run inside the step, on its group
            if (
                own_group
                and self.config.sync_delay
                and any(c.is_distributed and c.group in (None, dist.group.WORLD) for c in used)
            ):
                raise ValueError(
                    "With sync_delay > 0 the outer compressor's collectives overlap training, whose own "
                    "collectives use the default group: build DiLoCoConfig's compressor on a group of its own "
                    "(dist.new_group(...)), or pass its name"
                )
            return spec
        if own_group:
            return outer_compressor(zip(self.names, local, strict=True), spec, options, group)
        from powertrain.compress import make_compressor

        # the warm-up's collectives run in the step, on the training's group
        shaped = [(n, placeholder(t.shape, t)) for n, t in zip(self.names, local, strict=True)]
        return make_compressor(spec, shaped, group=group, **options)

    # ------------------------------------------------------------------ the optimizer's face

    @property
    def anchors(self) -> list[torch.Tensor]:
        """The weights every replica agreed on at each fragment's latest synchronisation (this rank's tensors)."""
        return self.sync.anchors

    @property
    def syncs(self) -> int:
        """Fragment synchronisations applied."""
        return self.sync.syncs

    @property
    def late(self) -> int:
        """Syncs that had not arrived when their update was due."""
        return self.sync.late

    @property
    def waited_s(self) -> float:
        """Compute time lost waiting for syncs that had not arrived when due."""
        return self.sync.waited_s

    @property
    def stats(self) -> CommStats:
        """What the outer step and a warm-up compressor given by name sent (the outer compressor's counts), and as
        ``comm_s`` the compute time lost waiting for syncs."""
        return self.compressor.comm.stats

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's (learning-rate schedulers attach to the inner optimizer)."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad`` (the outer step keeps no gradients of its own)."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One inner step; then the outer update of the fragment whose sync is due, and the start of the syncs that
        begin at this step (waited for at once when ``sync_delay`` is 0). Returns the closure's loss, if one was
        given."""
        if self.step_count < self.config.sync_warmup:
            if closure is not None:
                raise ValueError(
                    "A closure recomputes the gradients after the warm-up averaged them: call step() "
                    "without a closure during the warm-up (sync_warmup steps)"
                )
            self._average_gradients()
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        # the rate this step took: a scheduler steps after it, and finish() may come after the last scheduler step
        self._lr_scale = self._outer_lr_scale()
        self.step_count += 1
        s = self.step_count
        if s == self.config.sync_warmup:  # the replicas trained as one: the local updates start from their weights
            self.sync.reanchor(self._locals())
        if self.sync.pending is not None and self.sync.pending.due == s:
            self._apply(self.sync.wait(lost=True))
        for f in self.fragments_to_sync(s):
            self.sync.start(f, self._locals(), due=s + self.config.sync_delay)
            if self.config.sync_delay == 0:
                self._apply(self.sync.wait(lost=True))
        return loss

    def finish(self) -> None:
        """Bring every replica to the same weights: apply a sync in flight, then synchronise (at once) every fragment
        that has trained since its latest outer update. Training may go on afterwards as before."""
        if self.step_count <= self.config.sync_warmup:  # the replicas trained as one so far
            return
        if self.sync.pending is not None:  # waited for now by design: not a sync the link was late with
            self._apply(self.sync.wait(lost=False))
        for f in range(len(self.fragments)):
            # mixed weights differ between the replicas
            if self._updated_at[f] != self.step_count or self.config.sync_mix:
                self.sync.start(f, self._locals(), due=self.step_count)
                self._apply(self.sync.wait(lost=False), mix=0.0)

    def fragments_to_sync(self, step: int) -> list[int]:
        """The fragments whose sync starts after inner step ``step`` (1-based; the schedule starts after the
        warm-up)."""
        s = step - self.config.sync_warmup
        return [f for f, o in enumerate(self.offsets) if s > 0 and s >= o and (s - o) % self.config.sync_every == 0]

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """The warm-up: every gradient replaced by its mean over the replicas (the warm-up compressor's), so that the
        replicas take the same inner step. A parameter without a gradient counts as a zero one."""
        comp = self.warmup_compressor
        assert comp is not None, "a warm-up has its compressor"
        grads = [
            local_tensor(p.grad) if p.grad is not None else torch.zeros_like(t)
            for p, t in zip(self.params, self._locals(), strict=True)
        ]
        averaged = run_program(comp.program(grads), comp.comm)
        for p, g, a in zip(self.params, grads, averaged, strict=True):
            if p.grad is None:  # a zeros_like keeps a DTensor's sharding
                p.grad = torch.zeros_like(p)
                g = local_tensor(p.grad)
            g.copy_(a)

    def _apply(self, pending: Pending, mix: float | None = None) -> None:
        """Apply an arrived sync's outer update to the replica (mixed by ``mix``, default the config's)."""
        mix = float(self.config.sync_mix) if mix is None else mix
        scale = self._lr_scale if self._lr_scale is not None else self._outer_lr_scale()
        self.sync.apply(pending, self._locals(), mix, scale)
        self._updated_at[pending.fragment] = self.step_count

    def _outer_lr_scale(self) -> float:
        """The outer rate's multiplier now: 1, or the inner schedule's (``outer_lr_schedule="inner"``), in [0, 1]."""
        if self.config.outer_lr_schedule == "constant":
            return 1.0
        group = self.inner.param_groups[0]
        if "initial_lr" not in group:
            raise ValueError(
                "outer_lr_schedule='inner' follows the inner optimizer's LR scheduler, and its first parameter group "
                "has no 'initial_lr' (torch's schedulers set it): attach a scheduler to the inner optimizer, or use "
                "outer_lr_schedule='constant'"
            )
        lr, initial = float(group["lr"]), float(group["initial_lr"])
        if not initial > 0 or not 0 <= lr <= initial:
            raise ValueError(
                f"outer_lr_schedule='inner' scales the outer rate by the inner lr over its initial_lr, {lr:g} / "
                f"{initial:g} here, which must lie in [0, 1] (a schedule that rises above its initial rate, such as "
                "OneCycleLR or CyclicLR, would multiply the outer step): use outer_lr_schedule='constant'"
            )
        return lr / initial

    # ------------------------------------------------------------------ state

    def _settings(self) -> dict[str, Any]:
        """The settings a state is saved with and must match to be resumed, under the config's names."""
        return {
            "sync_every": self.config.sync_every,
            "fragments": [list(f) for f in self.fragments],
            "sync_delay": self.config.sync_delay,
            "sync_mix": float(self.config.sync_mix),
            "sync_warmup": self.config.sync_warmup,
            "outer_lr_schedule": self.config.outer_lr_schedule,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume bit-identically besides the replica's weights and the inner optimizer's state (each
        rank's own: save them with it). A sync in flight is waited for and saved with its result."""
        pending = self.sync.settled_pending()  # first: the sync in flight commits the compressor's state as it ends
        saved = SavedState(
            step=self.step_count,
            syncs=self.syncs,
            updated_at=list(self._updated_at),
            anchors=list(self.sync.anchors),
            outer=self.sync.outer.state_dict(),
            compressor=self.compressor.state_dict(),
            warmup_compressor=None if self.warmup_compressor is None else self.warmup_compressor.state_dict(),
            pending=pending,
        )
        return saved.as_dict(self._settings())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result; ValueError (nothing changed) if it does not fit this DiLoCo."""
        saved = SavedState.read(
            state,
            Layout(
                settings=self._settings(),
                shapes=[t.shape for t in self._locals()],
                outer_groups=self.sync.outer.state_dict()["param_groups"],
                fragments_to_sync=self.fragments_to_sync,
                warmup_compressor=self.warmup_compressor is not None,
                outer_keys=frozenset({"momentum_buffer"}),  # the outer SGD's
            ),
        )
        self.sync.drain()
        # the parts check what they are given as they load: if one refuses, the ones loaded before it are put back
        parts: list[Any] = [self.compressor, self.sync.outer]
        given: list[Any] = [saved.compressor, saved.outer]
        if self.warmup_compressor is not None:
            parts.append(self.warmup_compressor)
            given.append(saved.warmup_compressor)
        before = [part.state_dict() for part in parts]  # references to the current state: loading replaces it
        done = 0
        try:
            for part, part_state in zip(parts, given, strict=True):
                part.load_state_dict(part_state)
                done += 1
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            for part, old in zip(parts[:done], before, strict=False):
                part.load_state_dict(old)
            raise ValueError(f"DiLoCo state_dict does not fit: {' '.join(str(e).split())[:300]}") from None
        self.sync.restore(saved.anchors, saved.syncs, saved.pending)
        self.step_count, self._updated_at = saved.step, list(saved.updated_at)
        self._lr_scale = None  # the next inner step records it; finish() before one reads the schedule now


def outer_compressor(
    params: Iterable[tuple[str, torch.Tensor]],
    name: str,
    options: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
) -> Compressor:
    """The compressor ``name`` for the pseudo-gradients of ``params`` (this rank's tensors: a DTensor's local shard),
    built on placeholders of their shapes (it never touches the parameters) and on a process group of its own with
    the ranks of ``group``: a sync in flight overlaps training's collectives, which use their own groups. PowerSGD
    compresses from the first sync unless ``options`` say otherwise."""
    from powertrain.compress import make_compressor

    if name == "powersgd":  # its exact warm-up steps would send whole pseudo-gradients: compress from the first sync
        options = {"start_compressing_after_num_steps": 0, **options}
    shaped = [(n, placeholder(t.shape, t)) for n, t in params]
    return make_compressor(name, shaped, group=group_of_its_own(group), **options)


@torch.no_grad()
def _check_same_start(anchors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """ValueError unless every replica of ``group`` starts from the same weights: the anchors only ever move by the
    same averaged step on every replica, so replicas that start apart never meet (DDP broadcasts rank 0's weights;
    this class checks instead, so that it never overwrites weights a replica loaded). A fingerprint per tensor (its
    sum and sum of squares in float64) compared in one all-reduce at construction."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    from powertrain.comm import collective_device

    device = collective_device(group)
    if anchors:
        prints = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for t in anchors]).flatten()
    else:
        prints = torch.zeros(0, dtype=torch.float64)
    both = torch.cat([prints, -prints]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both.split(prints.numel())
    if not torch.equal(high, -low):  # one host sync, once, at construction
        raise ValueError(
            "DiLoCo's replicas start from different weights, and local updates would never bring them "
            "together: give every replica the same initial weights (the same seed, or broadcast rank "
            "0's), and build DiLoCo before loading a checkpoint's per-replica weights"
        )


def _fragments(spec: int | Sequence[Sequence[int]], sizes: list[int]) -> list[list[int]]:
    if isinstance(spec, bool):
        raise ValueError(f"Invalid fragments={spec!r}: an int or groups of parameter positions")
    if isinstance(spec, int):
        return split_by_size(sizes, spec)
    groups = [list(g) for g in spec]
    flat = sorted(i for g in groups for i in g)
    if not groups or any(not g for g in groups) or flat != list(range(len(sizes))):
        raise ValueError(
            f"fragments must be an int or groups of parameter positions that cover 0..{len(sizes) - 1} "
            "once each, none empty"
        )
    return [sorted(g) for g in groups]
