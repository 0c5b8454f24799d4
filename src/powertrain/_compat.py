"""Every private or version-dependent torch API powertrain uses, in one place.

One exception, by import cost: FSDP2's custom-communication base classes (``AllGather`` and ``ReduceScatter`` of
``torch.distributed.fsdp._fully_shard._fsdp_api``, the same path and interface in torch 2.11 and 2.13) are imported
by :mod:`powertrain.fsdp` itself, since importing them here would cost every importer of this module (every
worker) about 0.7 s."""

from __future__ import annotations

import functools
import io
import pickle
import re
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# torch.optim.AdamW's functional form and the dtype of its step counter (torch.optim.optimizer's private helper): a
# composite optimizer (powertrain.optim.Muon, Dion) steps its AdamW groups with exactly AdamW's code and state.
from torch.optim.adamw import adamw as adamw_functional
from torch.optim.optimizer import _get_scalar_dtype as optimizer_scalar_dtype

# Fused in-place list ops (what torch.optim's foreach implementations use); stable since torch 2.0.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; 2.11 has only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["adamw_functional", "all_gather_single", "foreach_add_", "foreach_copy_", "optimizer_scalar_dtype"]


def fsdp_param_groups(module: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one ``fully_shard`` module (FSDP2's private state). torch 2.13 keeps a list,
    ``_fsdp_param_groups`` (per-parameter meshes give a module several); torch 2.11 has one attribute,
    ``_fsdp_param_group``, None for a module that manages no parameter. (2.13 also has ``_fsdp_param_group``, as a
    property that raises when there are several groups: the list is asked first.)"""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_managed_params(module: Any) -> list[tuple[torch.nn.Parameter, torch.Size, int]]:
    """(sharded parameter, unsharded size, shard dim) for each parameter one ``fully_shard`` module
    manages, in the order its reduce-scatter lays them out. FSDP2 has no public accessor for this; the
    ``FSDPParam`` fields read here are the same in torch 2.11 and 2.13."""
    out = []
    for group in fsdp_param_groups(module):
        for p in group.fsdp_params:
            out.append((p.sharded_param, p._orig_size, p.fsdp_placement.dim))
    return out


def fsdp_param_group_count(module: Any) -> int:
    return len(fsdp_param_groups(module))


# pickle's pure-Python unpickler: unlike the C one, its opcodes can be hooked (typeshed does not describe it)
_PyUnpickler: Any = pickle._Unpickler


class SafeUnpickler(_PyUnpickler):
    """Unpickles DCP checkpoint metadata (``.metadata``, a plain pickle in torch) without running code.

    * ``find_class`` admits an exact list of (module, name) pairs: DCP's metadata dataclasses, ``torch.Size``,
      dtypes, layouts and memory formats, ``PosixPath`` and plain containers. Dotted names (pickle protocol 4
      resolves ``os.system`` inside any admitted module) and ``builtins.getattr`` are refused.
    * ``BUILD`` only fills instances of admitted classes: setting attributes on a class (or on anything else)
      is refused, so a stream cannot patch the classes it may name.
    Every callable a stream can reach is therefore the constructor of an admitted class, none of which has side
    effects. torch's own ``weights_only`` unpickler cannot be used here: it rejects protocol 4's framing, which
    DCP writes.
    """

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        }
        | {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch", "device"),
            ("torch.serialization", "_get_layout"),  # how torch.strided and friends pickle themselves
            ("pathlib", "PosixPath"),  # the checkpoint id DCP records
            ("pathlib", "PurePosixPath"),
            ("collections", "OrderedDict"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
            ("builtins", "slice"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            torch_value = module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
            )
            if torch_value or (module, name) in self._ALLOWED:
                return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names {module}.{name}, which is not allowed: refusing to load it"
        )

    def load_build(self) -> None:
        inst = self.stack[-2]  # BUILD pops the state (stack[-1]) and applies it to the object below it
        kind = type(inst)
        if isinstance(inst, type) or (kind.__module__, kind.__qualname__) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"checkpoint metadata sets the state of a {kind.__module__}.{kind.__qualname__}, which is not "
                "allowed: refusing to load it"
            )
        super().load_build()

    dispatch: ClassVar[dict[int, Any]] = {**_PyUnpickler.dispatch, pickle.BUILD[0]: load_build}


_DATA_FILE = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")


def safe_dcp_reader(path: str, files: frozenset[str], metadata_limit: int) -> Any:
    """A DCP FileSystemReader that cannot be made to run code or inflate data:

    * its metadata (at most ``metadata_limit`` bytes, read within that bound) is read by :class:`SafeUnpickler`
      (DCP itself uses plain pickle), may name only the data files in ``files`` (the checkpoint's manifest) and no
      stream transforms (decompression has no size bound);
    * each item's bytes are read whole (within its file) and checked by
      :func:`powertrain.serialize.check_torch_pickle` before DCP's ``torch.load(weights_only=True)`` sees them.
    ``FileSystemReader._slice_file`` is DCP's (private) hook for reading one item; it exists in torch 2.11-2.13.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from powertrain.serialize import TENSOR_GLOBALS, check_torch_pickle

    if not hasattr(FileSystemReader, "_slice_file"):
        raise RuntimeError("this torch's FileSystemReader has no _slice_file: powertrain cannot read items safely")

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as f:
                data = f.read(metadata_limit + 1)
            if len(data) > metadata_limit:
                raise pickle.UnpicklingError(f"{meta_path} holds more than {metadata_limit:,} bytes")
            metadata = SafeUnpickler(io.BytesIO(data)).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{meta_path} holds a {type(metadata).__name__}, not DCP metadata")
            for info in (metadata.storage_data or {}).values():
                name = getattr(info, "relative_path", None)
                if not isinstance(name, str) or not _DATA_FILE.fullmatch(name) or name not in files:
                    raise pickle.UnpicklingError(
                        f"{meta_path} names the data file {str(name)[:80]!r}, which is not a file of the checkpoint"
                    )
                if getattr(info, "transform_descriptors", None):
                    raise pickle.UnpicklingError(
                        f"{meta_path} asks for stream transforms, which powertrain never writes"
                    )
                if not (
                    type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
                ):
                    raise pickle.UnpicklingError(f"{meta_path} has a malformed byte range")
            storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            file.seek(0, io.SEEK_END)
            if sinfo.offset + sinfo.length > file.tell():
                raise pickle.UnpicklingError(f"an item's byte range lies outside {sinfo.relative_path}")
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            check_torch_pickle(data, allowed=TENSOR_GLOBALS, what=f"an item of {sinfo.relative_path}")
            return io.BytesIO(data)

    return _Reader(path)


@functools.cache
def _redistribute_casts() -> bool:
    """Asked on first use, not at import: importing DTensor costs about a second, which every worker of a run
    that never uses it would pay."""
    import inspect

    from torch.distributed.tensor import DTensor

    return "forward_dtype" in inspect.signature(DTensor.redistribute).parameters


def redistribute(
    t: Any, placements: list[Any], forward_dtype: torch.dtype | None, backward_dtype: torch.dtype | None
) -> Any:
    """``DTensor.redistribute`` with a compute dtype for forward and a reduce dtype for backward.

    torch >= 2.13 casts inside ``redistribute`` (``forward_dtype``/``backward_dtype``). Older versions: cast
    the shard before (so the all-gather runs in ``forward_dtype``) and the gradient through a cast node,
    which leaves the reduction in the compute dtype."""
    if _redistribute_casts():
        return t.redistribute(placements=placements, forward_dtype=forward_dtype, backward_dtype=backward_dtype)
    if forward_dtype is not None:
        t = t.to(forward_dtype)
    return t.redistribute(placements=placements)


def inductor_has_configs(*names: str) -> bool:
    """Whether this torch's inductor knows every config option in ``names`` (they vary across versions)."""
    import torch._inductor.config as inductor_config

    return all(n in inductor_config._config for n in names)  # type: ignore[attr-defined]


def funcol_all_gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Functional (traceable) all-gather along dim 0, waited; torch 2.13 renamed all_gather_tensor."""
    import torch.distributed._functional_collectives as funcol

    fn = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(fn(t, 0, group))


def funcol_reduce_scatter_avg(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Functional reduce-scatter (average) along dim 0, waited; torch 2.13 renamed reduce_scatter_tensor."""
    import torch.distributed._functional_collectives as funcol

    fn = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return funcol.wait_tensor(fn(t, "avg", 0, group))
