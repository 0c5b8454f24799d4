"""Gradient compressors behind one interface (:class:`Compressor`), each with its own error feedback.

``make_compressor(name, params, **options)`` builds one from the names the command line uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from powertrain.compress.base import Compressor, NonFiniteGradientError
from powertrain.compress.exact import AllReduceCompressor
from powertrain.compress.hierarchical import HierarchicalCompressor
from powertrain.compress.powersgd import PowerSGDCompressor, recommended_config
from powertrain.compress.quantize import QuantizedCompressor
from powertrain.compress.sign import SignCompressor
from powertrain.compress.sparse import RandomKCompressor, TopKCompressor

__all__ = [
    "ALL_REDUCE_DTYPES",
    "COMPRESSORS",
    "AllReduceCompressor",
    "Compressor",
    "HierarchicalCompressor",
    "NonFiniteGradientError",
    "PowerSGDCompressor",
    "QuantizedCompressor",
    "RandomKCompressor",
    "SignCompressor",
    "TopKCompressor",
    "compressor_class",
    "make_compressor",
]

#: The exact all-reduce compressors' names, with the dtype each sums in (None: the gradient's own).
ALL_REDUCE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_CLASSES: dict[str, type[Compressor]] = {
    **dict.fromkeys(ALL_REDUCE_DTYPES, AllReduceCompressor),
    "powersgd": PowerSGDCompressor,
    "int8": QuantizedCompressor,
    "int4": QuantizedCompressor,
    "topk": TopKCompressor,
    "randk": RandomKCompressor,
    "sign": SignCompressor,
}
#: The names :func:`make_compressor` builds (the command's ``--compressor``), in the order the docs list them.
COMPRESSORS = tuple(_CLASSES)


def compressor_class(name: str) -> type[Compressor]:
    """The class :func:`make_compressor` builds for ``name`` (what it supports, e.g. ``reduce_scatter``)."""
    if name not in _CLASSES:
        raise ValueError(f"Unknown compressor {name!r}: choose one of {', '.join(COMPRESSORS)}")
    return _CLASSES[name]


def make_compressor(
    name: str,
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> Compressor:
    """Build the compressor called ``name`` (one of :data:`COMPRESSORS`) with its keyword options.

    ``none`` is exact fp32 averaging; ``powersgd`` takes :class:`~powertrain.powersgd.Config` fields, each one not
    given from ``powertrain.compress.powersgd.RECOMMENDED`` (the measured best: rank 32, the paper variant, bf16
    factors, 5 exact steps), not the reference Config's defaults; the others take their class's keyword
    arguments. Unknown names or options raise ValueError naming them.

    Args:
        name: one of :data:`COMPRESSORS`.
        params: ``model.parameters()`` or ``model.named_parameters()`` (errors then name the parameter); those
            that do not require grad are left out.
        group: process group to average over (``None``, the default: the default group).
        **options: the named compressor's keyword options, as above.
    """
    try:
        match name:
            case "none":
                return AllReduceCompressor(params, group=group, **options)
            case "fp16" | "bf16":
                dtype = ALL_REDUCE_DTYPES[name]
                assert dtype is not None, "fp16 and bf16 name their dtype"
                return AllReduceCompressor(params, dtype=dtype, group=group, **options)
            case "powersgd":
                return PowerSGDCompressor(params, config=recommended_config(**options), group=group)
            case "int8" | "int4":
                return QuantizedCompressor(params, bits=int(name[3:]), group=group, **options)
            case "topk":
                return TopKCompressor(params, group=group, **options)
            case "randk":
                return RandomKCompressor(params, group=group, **options)
            case "sign":
                return SignCompressor(params, group=group, **options)
    except TypeError as e:  # an unknown keyword option
        raise ValueError(f"Bad option for compressor {name!r}: {e}") from None
    raise ValueError(f"Unknown compressor {name!r}: choose one of {', '.join(COMPRESSORS)}")
