"""A :class:`powertrain.diloco.DiLoCo` state (:class:`SavedState`) and what it must be before any of it is applied: the
settings it was saved with, its counters, anchors, the sync in flight and the outer optimizer's state, each checked
against the DiLoCo that loads it (:class:`Layout`), so that a crafted or mismatched state is refused in one line and
changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import torch

from powertrain.compress.base import check_state_tensors

__all__ = ["Layout", "SavedState"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the loading DiLoCo is: the settings a state must have been saved with (``sync_every``, ``fragments``,
    ``sync_delay``, ``sync_mix``, ``sync_warmup``, ``outer_lr_schedule``), its local tensors' shapes, its outer
    optimizer's param_groups, its fragment schedule (``fragments_to_sync(step)``: the fragments whose sync starts after
    ``step``) and whether it has a warm-up compressor."""

    settings: dict[str, Any]
    shapes: list[torch.Size]
    outer_groups: list[dict[str, Any]]
    fragments_to_sync: Callable[[int], list[int]]
    warmup_compressor: bool
    #: the per-anchor state keys the outer optimizer writes (torch's SGD: momentum_buffer), None where unknown
    outer_keys: frozenset[str] | None = None


#: the settings a state saved before they existed ran with
_BEFORE = {"outer_lr_schedule": "constant"}
#: the keys a state saved before the settings had one name each used (the command's and the class's names since)
_RENAMED = {"delay": "sync_delay", "mix": "sync_mix", "warmup": "sync_warmup", "applied": "updated_at"}


@dataclasses.dataclass(frozen=True)
class SavedState:
    """What a DiLoCo saves besides its settings: written by :meth:`as_dict`, read back (checked) by :meth:`read`."""

    step: int  # inner steps taken
    syncs: int  # fragment synchronisations applied
    updated_at: list[int]  # the inner step of each fragment's latest outer update
    anchors: list[torch.Tensor]
    outer: Mapping[str, Any]  # the outer optimizer's state_dict
    compressor: Mapping[str, Any]
    warmup_compressor: Mapping[str, Any] | None
    pending: Mapping[str, Any] | None  # the sync in flight: fragment, due step, its arrived average

    def as_dict(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The state_dict: the settings it was saved with (which :meth:`read` compares), then the fields."""
        return {"kind": "DiLoCo", **settings, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def read(cls, state: Any, layout: Layout) -> SavedState:
        """The state a DiLoCo of ``layout`` can resume from; ValueError in one line otherwise (the compressors and the
        outer optimizer check the inside of their own parts as they load)."""
        state = _check(state, layout)
        return cls(**{f.name: state.get(f.name) for f in dataclasses.fields(cls)})


def _check(state: Any, layout: Layout) -> Mapping[str, Any]:
    """``state`` under today's keys (one saved under :data:`_RENAMED`'s old ones is read as well), checked."""
    if not isinstance(state, Mapping) or state.get("kind") != "DiLoCo":
        raise ValueError("Not a DiLoCo state_dict")
    both = [old for old, new in _RENAMED.items() if old in state and new in state]
    if both:
        raise ValueError(f"DiLoCo state_dict holds {both[0]!r} and {_RENAMED[both[0]]!r}, the same setting twice")
    today = {k: v for k, v in state.items() if k not in _RENAMED}
    today.update({new: state[old] for old, new in _RENAMED.items() if old in state})
    state = today
    mine = layout.settings
    saved = {k: state.get(k, _BEFORE.get(k)) for k in mine}
    if saved != mine:
        diff = ", ".join(f"{k}={saved[k]!r:.80} -> {mine[k]!r}" for k in mine if saved[k] != mine[k])
        raise ValueError(
            f"DiLoCo state was saved with other settings ({diff}): resume with the same sync_every, "
            "fragments, sync_delay, sync_mix, sync_warmup and outer_lr_schedule"
        )
    fragments, delay, warmup = mine["fragments"], mine["sync_delay"], mine["sync_warmup"]
    step, syncs, updated = state.get("step"), state.get("syncs"), state.get("updated_at")
    if not (_is_int(step) and _is_int(syncs) and syncs >= 0 and step >= 0):
        raise ValueError(f"DiLoCo state_dict has invalid counters: step={step!r:.40}, syncs={syncs!r:.40}")
    if not (
        isinstance(updated, list)
        and len(updated) == len(fragments)
        and all(_is_int(a) and 0 <= a <= max(step, warmup) for a in updated)
    ):
        raise ValueError("DiLoCo state_dict's latest outer update per fragment is invalid")
    check_state_tensors("DiLoCo", "anchors", state.get("anchors"), layout.shapes)
    if any(a is None for a in state["anchors"]):
        raise ValueError("DiLoCo state_dict lacks an anchor")
    pending = state.get("pending")
    if pending is not None:
        f, due = (pending.get("fragment"), pending.get("due")) if isinstance(pending, Mapping) else (None, None)
        if not (
            _is_int(f)
            and _is_int(due)
            and 0 <= f < len(fragments)
            and step < due <= step + delay
            and f in layout.fragments_to_sync(due - delay)
        ):
            raise ValueError(
                f"DiLoCo state_dict's sync in flight is invalid (fragment {f!r:.40}, due {due!r:.40} at "
                f"step {step!r}): not a sync this schedule starts"
            )
        check_state_tensors(
            "DiLoCo", "pending average", pending.get("average"), [layout.shapes[i] for i in fragments[f]]
        )
    if layout.warmup_compressor and not isinstance(state.get("warmup_compressor"), Mapping):
        raise ValueError("DiLoCo state_dict lacks the warm-up compressor's state")
    if not isinstance(state.get("outer"), Mapping) or not isinstance(state.get("compressor"), Mapping):
        raise ValueError("DiLoCo state_dict lacks the outer optimizer's or the compressor's state")
    _check_outer(state["outer"], layout)
    return state


def _check_outer(outer: Mapping[str, Any], layout: Layout) -> None:
    """The outer optimizer's state: its hyperparameters (a resume with another outer learning rate or momentum is
    refused, as with other settings), and per-anchor tensors of the anchor's shape, finite."""
    groups = outer.get("param_groups")
    mine = _hyper(layout.outer_groups)
    if not isinstance(groups, list) or len(groups) != len(mine) or _hyper(groups) != mine:
        raise ValueError(
            f"DiLoCo state_dict's outer optimizer has other settings ({_hyper(groups)!r:.200} -> "
            f"{mine!r:.200}): resume with the same outer optimizer"
        )
    saved = outer.get("state")
    if not isinstance(saved, Mapping):
        raise ValueError("DiLoCo state_dict's outer optimizer state is not a mapping")
    for key, per in saved.items():
        if type(key) is not int or not 0 <= key < len(layout.shapes) or not isinstance(per, Mapping):
            raise ValueError(f"DiLoCo state_dict's outer optimizer has state for an unknown anchor {key!r:.50}")
        unknown = set(per) - layout.outer_keys if layout.outer_keys is not None else set()
        if unknown:
            raise ValueError(
                f"DiLoCo state_dict's outer optimizer has {sorted(map(str, unknown))!s:.100} for anchor "
                f"{key}, which it never writes"
            )
        for name, value in per.items():
            shape = layout.shapes[key]
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"DiLoCo state_dict's outer {name!r:.50} of anchor {key} is a {type(value).__name__}, not a tensor"
                )
            scalar_step = name == "step" and isinstance(value, torch.Tensor) and value.numel() == 1
            if isinstance(value, torch.Tensor) and value.shape != shape and not scalar_step:
                raise ValueError(
                    f"DiLoCo state_dict's outer {name!r:.50} of anchor {key} has shape "
                    f"{tuple(value.shape)}, not {tuple(shape)}"
                )
            if isinstance(value, torch.Tensor) and (value.is_complex() or not torch.isfinite(value).all()):
                raise ValueError(f"DiLoCo state_dict's outer {name!r:.50} of anchor {key} is not finite")


def _is_int(x: object) -> TypeGuard[int]:
    return type(x) is int


def _hyper(groups: Any) -> list[dict[str, Any]]:
    """An optimizer's param_groups without their parameters: its hyperparameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups] if isinstance(groups, list) else []
