"""How gradients are averaged across ranks in one parallel mode (``--parallel`` of ``powertrain train``).

* ``reference``: the reference PowerSGD API (``optimizer_step``; the residual lives in ``p.grad``) for
  ``powersgd``, and a compressor's ``reduce_gradients()`` after backward for the others;
* ``ddp``: ``DistributedDataParallel`` with the compressor as its comm hook (overlapped with backward);
* ``fsdp``: FSDP2 ``fully_shard`` on every block and the root, the compressor as its reduce-scatter;
* ``simple_fsdp``: :func:`powertrain.simple_fsdp.data_parallel` (fully sharded), gradients reduced in fp32
  (``none``) or 16 bits (``bf16``/``fp16`` as the reduce dtype). Its gradient traffic is computed, not
  counted: one reduce-scatter of every gradient per micro-step (it has no ``no_sync``: every backward
  reduces).
* ``rtp``: :func:`powertrain.rtp.rotated_tensor_parallel`: Linear and Embedding weights sharded and rotated
  around the ring, the rest replicated. The ring's messages are counted; the replicated parameters'
  all-reduce is computed (every backward reduces, as with ``simple_fsdp``).
* ``diloco``: local updates (:class:`powertrain.diloco.DiLoCo`): each rank trains alone for ``sync_every`` steps, then
  the pseudo-gradients are averaged through the compressor (on a process group of its own) and an outer Nesterov SGD
  steps the shared weights; with ``hierarchical``, DDP inside each node and the compressor between nodes
  (:class:`~powertrain.compress.hierarchical.HierarchicalCompressor`).
* ``tp``: :func:`powertrain.tp.tensor_parallel` on a ``(world / tp, tp)`` mesh: torch's tensor parallelism in each
  ``tp`` group (which reads the same batches: ``data_rank`` / ``data_world``), FSDP2 across them. Its traffic is
  computed (:func:`powertrain.tp.traffic`: sequence parallelism's all-gathers and reduce-scatters, FSDP2's); with
  a compressor, FSDP2's reduce-scatter runs through it (:func:`powertrain.fsdp.compress_gradients`, built on each
  rank's tensor-parallel blocks), which counts its own bytes.

With ``gradient_sync=False`` (optimizers that exchange their own messages instead of gradients: DeMo),
``reference`` leaves every rank's local gradient in place and ``ddp`` registers
:func:`powertrain.ddp.local_gradients` as DDP's comm hook.

Shared by the training loop and the side-by-side benchmark, so both measure the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from powertrain.comm import CommStats
from powertrain.compress import ALL_REDUCE_DTYPES, COMPRESSORS, Compressor, compressor_class, make_compressor
from powertrain.compress.powersgd import Config
from powertrain.ops.flat import local_tensor, shard_rows
from powertrain.powersgd import PowerSGD, optimizer_step

if TYPE_CHECKING:
    from powertrain.diloco import DiLoCoConfig

Parallel = Literal["reference", "ddp", "fsdp", "simple_fsdp", "rtp", "tp", "diloco"]


class Strategy:
    """How gradients are averaged in one parallel mode."""

    model: torch.nn.Module  # what forward runs on
    data_group: tuple[int, int] | None = None  # (rank, world) of the data split; None: the process group's
    stats: CommStats
    state: Any  # per-rank state to checkpoint (state_dict / load_state_dict)

    #: Per-rank state besides ``state`` (checkpointed under each rank's own key), by name.
    own_state: Mapping[str, Any] = MappingProxyType({})
    #: Whether the optimizer's state differs per rank in this mode (local updates: each replica's inner optimizer).
    own_optimizer: bool = False

    #: Traffic this mode's collectives do not count themselves: op -> (payload bytes, collectives) per backward,
    #: recorded in ``stats`` by the default :meth:`sync`, with more than one rank (as :mod:`powertrain.comm` counts:
    #: nothing is sent at world size 1).
    computed: Mapping[str, tuple[int, int]] = MappingProxyType({})

    def sync(self, last_micro: bool) -> contextlib.AbstractContextManager[None]:
        if dist.is_initialized() and dist.get_world_size() > 1:
            for op, (nbytes, collectives) in self.computed.items():
                self.stats.record_bytes(nbytes, op, collectives=collectives)
        return contextlib.nullcontext()

    def loss_scope(self) -> contextlib.AbstractContextManager[None]:
        """Around the loss's forward and its backward (and validation's forward)."""
        return contextlib.nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad()

    def take_error(self) -> BaseException | None:
        """What the gradient communication failed with, where backward() reports it under another type."""
        return None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once with the optimizer, built after the model was wrapped (local updates wrap it)."""

    def finish(self) -> None:
        """After the run's last step (local updates end with every replica on the same weights)."""

    def report(self) -> dict[str, Any]:
        """What this mode adds to the run's summary."""
        return {}


def _compressor(model: torch.nn.Module, name: str, options: dict[str, Any], hierarchical: bool) -> Compressor:
    if hierarchical:
        from powertrain.compress.hierarchical import HierarchicalCompressor

        return HierarchicalCompressor(model.named_parameters(), name, **options)
    return make_compressor(name, model.named_parameters(), **options)


class _Reference(Strategy):
    def __init__(self, model: torch.nn.Module, name: str, options: dict[str, Any], hierarchical: bool) -> None:
        self.model = model
        if name == "powersgd" and not hierarchical:
            self.agg: PowerSGD | None = PowerSGD(list(model.parameters()), config=Config(**options))
            self.state, self.stats = self.agg, self.agg.comm.stats
        else:
            self.agg = None
            self.comp = _compressor(model, name, options, hierarchical)
            self.state, self.stats = self.comp, self.comp.comm.stats

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.agg is not None:
            optimizer_step(optimizer, self.agg)  # no zero_grad: p.grad keeps the residual
        else:
            self.comp.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad()


class _Local(Strategy):
    """No gradient communication: the optimizer exchanges what it needs (``gradient_sync=False``)."""

    def __init__(self, model: torch.nn.Module, ddp: bool) -> None:
        self.model = model
        if ddp:
            from torch.nn.parallel import DistributedDataParallel

            from powertrain.ddp import local_gradients

            self.model = local_gradients(DistributedDataParallel(model))
        self.state, self.stats = _NoState(), CommStats()


class _DDP(Strategy):
    def __init__(self, model: torch.nn.Module, name: str, options: dict[str, Any], hierarchical: bool) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from powertrain.ddp import register_compressor

        self.model = DistributedDataParallel(model)
        comp = _compressor(model, name, options, hierarchical)
        self.hook = register_compressor(self.model, comp)
        self.state, self.stats = comp, comp.comm.stats

    def sync(self, last_micro: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last_micro else self.model.no_sync()  # type: ignore[operator]

    def take_error(self) -> BaseException | None:
        return self.hook.take_error()


class _FSDP(Strategy):
    """FSDP2 over the world; ``hierarchical``: HSDP, sharded inside each node and the compressor over the nodes
    (:func:`powertrain.fsdp.compress_replicas`)."""

    def __init__(self, model: torch.nn.Module, name: str, options: dict[str, Any], hierarchical: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from powertrain import fsdp

        device = next(model.parameters()).device
        if hierarchical:
            from powertrain.compress.hierarchical import node_layout

            nodes, local = node_layout()
            hsdp = init_device_mesh(device.type, (nodes, local), mesh_dim_names=("replicate", "shard"))
            mesh = hsdp["shard"]
        else:
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        if hierarchical:
            comp = fsdp.compress_replicas(model, name, group=hsdp["replicate"].get_group(), **options)
        else:
            comp = make_compressor(name, model.named_parameters(), **options)
            fsdp.register_compressor(model, comp)
        self.state, self.stats = comp, comp.comm.stats

    @contextlib.contextmanager
    def sync(self, last_micro: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(last_micro)  # type: ignore[operator]
        yield


class _SimpleFSDP(Strategy):
    def __init__(self, model: torch.nn.Module, name: str, options: dict[str, Any], compiled: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from powertrain import simple_fsdp
        from powertrain.simple_fsdp import data_parallel

        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        world = mesh.size()
        shard_bytes = sum(
            (shard_rows(p.shape[0], world) * (p.numel() // p.shape[0]) if p.ndim else 1) * p.element_size()
            for p in model.parameters()
        )  # this rank's padded dim-0 shard of every parameter
        exact = name in ALL_REDUCE_DTYPES
        reduce_dtype = ALL_REDUCE_DTYPES.get(name)
        # Eager: one all-gather / reduce-scatter per block and one for the rest, as FSDP2's units; compiled:
        # per parameter, and inductor buckets them (compile_model).
        blocks = getattr(model, "blocks", None)
        if compiled:
            buckets: list[torch.nn.Module] = []
        elif isinstance(blocks, torch.nn.ModuleList):
            buckets = [*blocks, model]
        else:
            buckets = [model]
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        self.model = data_parallel(model, mesh, mp_policy=policy, buckets=buckets)
        self.stats = CommStats()
        self.state: Any = _NoState()
        if not exact:  # powertrain's compressed reduce-scatter on the buckets: it counts its own bytes
            comp = make_compressor(name, model.named_parameters(), **options)
            simple_fsdp.register_compressor(self.model, comp)
            self.state, self.stats = comp, comp.comm.stats
            return
        grad_size = torch.finfo(reduce_dtype).bits // 8 if reduce_dtype is not None else 4
        # Gradient traffic only, as for fsdp (weight all-gathers are not gradient communication): one reduce-scatter
        # per parameter.
        self.computed = {"reduce_scatter": (world * shard_bytes * grad_size // 4, sum(1 for _ in model.parameters()))}


class _RTP(Strategy):
    def __init__(self, model: torch.nn.Module, name: str, options: dict[str, Any]) -> None:
        from powertrain.rtp import comm_stats, replicated_traffic, rotated_tensor_parallel

        self.model = rotated_tensor_parallel(model)
        self.stats = comm_stats(self.model)
        self.state: Any = _NoState()
        nbytes, collectives = replicated_traffic(self.model)
        if collectives:  # one all-reduce per replicated parameter per backward
            self.computed = {"all_reduce": (nbytes, collectives)}


class _TP(Strategy):
    def __init__(self, model: torch.nn.Module, name: str, options: dict[str, Any], tp: int, batch: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from powertrain.tp import tensor_parallel, traffic

        world = dist.get_world_size()
        if world % tp:
            raise ValueError(f"tp={tp} does not divide the world size {world}: choose a tp that divides it")
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        cfg: Any = model.cfg
        # the logits stay sharded over the vocabulary: the loss is computed on the shards (loss_scope)
        self.model = tensor_parallel(model, mesh, loss_parallel=True)  # type: ignore[arg-type]
        self.data_group = (mesh["dp"].get_local_rank(), world // tp)
        self.stats = CommStats()
        self.state: Any = _NoState()
        dp = world // tp
        if name != "none" or options:  # FSDP2's reduce-scatter over dp through the compressor, on the tp blocks
            from powertrain.fsdp import compress_gradients

            comp = compress_gradients(self.model, name, group=mesh["dp"].get_group(), **options)
            self.state, self.stats, dp = comp, comp.comm.stats, 1  # it counts its own bytes
        self.computed = traffic(cfg, tp, dp, batch, cfg.block_size, loss_parallel=True)

    def loss_scope(self) -> contextlib.AbstractContextManager[None]:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


class _DiLoCo(Strategy):
    """Local updates (:class:`powertrain.diloco.DiLoCo`); ``hierarchical``: DDP inside each node, the compressor
    between nodes. Each rank's weights and inner optimizer are its own: ``replica`` checkpoints the weights."""

    def __init__(
        self, model: torch.nn.Module, name: str, options: dict[str, Any], local: DiLoCoConfig, hierarchical: bool
    ) -> None:
        self.model, self.local = model, local
        if hierarchical:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.nn.parallel import DistributedDataParallel

            from powertrain.compress.hierarchical import HierarchicalCompressor, node_layout

            nodes, ranks = node_layout()
            device = next(model.parameters()).device
            mesh = init_device_mesh(device.type, (nodes, ranks), mesh_dim_names=("replicate", "shard"))
            self.model = DistributedDataParallel(model, process_group=mesh["shard"].get_group())
            self.comp: Compressor = HierarchicalCompressor(model.named_parameters(), name, **options)
        else:
            from powertrain.diloco import outer_compressor

            trained = [(n, local_tensor(p)) for n, p in model.named_parameters() if p.requires_grad]
            self.comp = outer_compressor(trained, name, options)
        self.module = model
        self.stats = self.comp.comm.stats
        self.state: Any = _NoState()
        self.own_state = {"replica": _Replica(model)}
        self.own_optimizer = True
        self.diloco: Any = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        from powertrain.diloco import DiLoCo

        # the compressor built here (on a group of its own, or hierarchical) in place of its name and options
        with warnings.catch_warnings():  # checked, and its warnings given, where the settings were built
            warnings.simplefilter("ignore", UserWarning)
            config = dataclasses.replace(self.local, compressor=self.comp, compressor_options={})
        self.diloco = DiLoCo(self.module.named_parameters(), optimizer, config)
        self.state = self.diloco

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.diloco is not None and self.diloco.inner is optimizer, "attach() the optimizer first"
        self.diloco.step()
        optimizer.zero_grad()

    def finish(self) -> None:
        self.diloco.finish()

    def report(self) -> dict[str, Any]:
        d = self.diloco
        return {
            "syncs": d.syncs,
            "late_syncs": d.late,
            "waited_s": d.waited_s,
            "sync_every": d.config.sync_every,
            "fragments": len(d.fragments),
        }


class _Replica:
    """This rank's own weights (local updates: the replicas differ between syncs, and DCP keeps one copy of equally
    named tensors), as per-rank state."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"weights": [p.detach() for p in self.model.parameters()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from powertrain.compress.base import check_state_tensors

        params = list(self.model.parameters())
        check_state_tensors("replica", "weights", state.get("weights"), [p.shape for p in params])
        if any(w is None for w in state["weights"]):
            raise ValueError("replica state_dict lacks a weight")
        with torch.no_grad():
            for p, w in zip(params, state["weights"], strict=True):
                p.copy_(w)


class _NoState:
    """Per-rank state of a strategy that keeps none (checkpoints store an empty dict)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(
                f"Unexpected per-rank state {sorted(state)}: was the checkpoint written with "
                "another --parallel mode or --compressor?"
            )


def _names(keep: Any) -> str:
    """The compressors' names ``keep`` accepts, as ``a, b or c``."""
    names = [n for n in COMPRESSORS if keep(n)]
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def check(
    parallel: str,
    name: str,
    options: Mapping[str, Any],
    *,
    compiled: bool = False,
    gradient_sync: bool = True,
    hierarchical: bool = False,
) -> None:
    """Refuse, in one line naming the value and the fix, a compressor or option that ``parallel`` cannot run (as
    :func:`build_strategy` takes them); the command checks its flags with this before it starts any worker."""
    if not gradient_sync and parallel not in ("reference", "ddp"):
        raise ValueError(f"gradient_sync=False runs with parallel='reference' or 'ddp', not {parallel!r}")
    if hierarchical and (parallel not in ("reference", "ddp", "fsdp", "diloco") or not gradient_sync):
        raise ValueError(
            f"hierarchy='node' compresses gradients between nodes with parallel='ddp', 'reference', 'fsdp' (HSDP) or "
            f"'diloco' (DDP inside a node) and gradient synchronisation on, not parallel={parallel!r}: use --parallel "
            "ddp, or hierarchy='flat'"
        )
    if not gradient_sync and parallel == "diloco":
        raise ValueError("parallel='diloco' averages what the inner optimizer learned: it needs gradient_sync")
    if parallel == "rtp" and (name != "none" or options):
        raise ValueError(
            f"compressor={name!r} does not apply to parallel={parallel!r} (its gradients are reduced inside "
            "backward): drop --compressor or use none"
        )
    if compiled and parallel in ("ddp", "fsdp", "diloco"):
        raise ValueError(
            f"compile=True is supported with parallel='simple_fsdp' (whole graph, communication included) "
            f"or 'reference', not {parallel!r}"
        )
    if parallel in ("fsdp", "simple_fsdp", "tp") and not compressor_class(name).reduce_scatter:
        raise ValueError(
            f"compressor={name!r} cannot run under parallel={parallel!r} (its messages have no reduce-scatter "
            f"form): use {_names(lambda n: compressor_class(n).reduce_scatter)} with {parallel}, or parallel='ddp'"
        )
    if parallel == "simple_fsdp" and name in ALL_REDUCE_DTYPES and options:
        raise ValueError(f"compressor={name!r} takes no options with parallel='simple_fsdp', got {dict(options)}")
    if parallel == "simple_fsdp" and compiled and name not in ALL_REDUCE_DTYPES:
        raise ValueError(
            f"compressor={name!r} with parallel='simple_fsdp' runs on eager buckets: drop compile, or use "
            f"compressor {_names(ALL_REDUCE_DTYPES.__contains__)} (an exact all-reduce) with compile"
        )


def build_strategy(
    parallel: Parallel,
    model: torch.nn.Module,
    name: str,
    options: dict[str, Any],
    *,
    compiled: bool = False,
    gradient_sync: bool = True,
    tp: int = 1,
    batch: int = 0,
    hierarchical: bool = False,
    local: DiLoCoConfig | None = None,
) -> Strategy:
    """Wrap ``model`` for ``parallel`` with compressor ``name`` (options as for :func:`make_compressor`);
    ``compiled``: the model will be compiled (SimpleFSDP then leaves bucketing to inductor);
    ``gradient_sync=False``: no gradient communication at all (``reference`` or ``ddp`` only); ``tp``: the
    tensor-parallel degree of ``tp``, whose byte count takes ``batch`` sequences per micro-batch; ``hierarchical``:
    exact inside each node, the compressor between nodes (:mod:`powertrain.compress.hierarchical` with reference or
    ddp; HSDP with a compressed replicate dimension with fsdp; DDP inside a node with diloco); ``local``: the settings
    of diloco (required there). A diloco strategy must be given the optimizer (:meth:`Strategy.attach`)."""
    check(parallel, name, options, compiled=compiled, gradient_sync=gradient_sync, hierarchical=hierarchical)
    if not gradient_sync:
        return _Local(model, ddp=parallel == "ddp")
    match parallel:
        case "reference":
            return _Reference(model, name, options, hierarchical)
        case "ddp":
            return _DDP(model, name, options, hierarchical)
        case "fsdp":
            return _FSDP(model, name, options, hierarchical)
        case "simple_fsdp":
            return _SimpleFSDP(model, name, options, compiled)
        case "rtp":
            return _RTP(model, name, options)
        case "tp":
            return _TP(model, name, options, tp, batch)
        case "diloco":
            if local is None:
                raise ValueError("parallel='diloco' needs its settings: local=DiLoCoConfig(...)")
            return _DiLoCo(model, name, options, local, hierarchical)
    raise ValueError(f"Invalid parallel={parallel!r}: choose reference, ddp, fsdp, simple_fsdp, rtp, tp or diloco")
