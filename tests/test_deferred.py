"""powertrain.compress.deferred on its own (one process, world size 1: every flag is still a device flag read at the
end of backward): which backward a deferred call belongs to. Nested backwards (reentrant checkpointing), a backward
that raises before its end, and backwards in two threads each settle their own calls. The multi-rank behaviour
(FSDP2, SimpleFSDP) is tested in test_fsdp.py and test_simple_fsdp.py."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from powertrain.compress import NonFiniteGradientError, make_compressor
from powertrain.compress.deferred import run_deferred
from test_fsdp import same_state

pytestmark = pytest.mark.timeout(60)


def _compressor() -> Any:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12))]
    return make_compressor("int8", params), [torch.randn_like(p) for p in params]


def _nothing() -> None:
    pass


def in_backward(work: Callable[[], object]) -> Callable[[torch.Tensor], torch.Tensor]:
    """An autograd function, the identity, whose backward runs ``work()``: what runs there runs as FSDP2's
    reduce-scatter does, inside an autograd graph task."""

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            work()
            return g

    return InBackward.apply  # type: ignore[return-value]


def _reducing(
    comp: Any, grads: list[torch.Tensor], then: Callable[[], None] = _nothing, first: Callable[[], None] = _nothing
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An autograd function whose backward runs ``first()``, a deferred call of ``comp`` on ``grads``, then
    ``then()``."""
    return in_backward(lambda: (first(), run_deferred(comp, grads), then()))


def test_a_nested_backward_settles_only_its_own_calls():
    """Backward runs the outer call (NaN) first, then a reentrant checkpoint's own backward with a finite call: the
    nested backward's end settles the finite call only, and the outer backward still raises at its end, with the
    failed call's state as before."""
    bad, grads = _compressor()
    good, good_grads = _compressor()
    nan = [g * float("nan") for g in grads]
    before = copy.deepcopy(bad.state_dict())
    x = torch.ones(3, requires_grad=True)
    inner = _reducing(good, good_grads)
    y = checkpoint(lambda t: inner(t * 2), x, use_reentrant=True)
    with pytest.raises(NonFiniteGradientError, match="at the end of backward"):
        _reducing(bad, nan)(y).sum().backward()
    assert same_state(before, bad.state_dict())
    assert good.state_dict()["steps"] == [1, 1], "the nested backward's finite call was undone"


def test_a_backward_that_raises_first_settles_its_calls():
    """A deferred call with a NaN input, then an error later in the same backward: the backward raises that error,
    and by the time it returns the failed call's state is as before (the next call must not see its counters)."""
    comp, grads = _compressor()
    comp.aggregate(grads)
    before = copy.deepcopy(comp.state_dict())

    def fail() -> None:
        raise RuntimeError("out of memory (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        _reducing(comp, [g * float("nan") for g in grads], fail)(torch.ones(3, requires_grad=True)).sum().backward()
    assert same_state(before, comp.state_dict())


def test_backwards_in_two_threads_settle_their_own_calls():
    """Two threads in backward at once, one call each (the NaN's first, then the finite one), both made before either
    backward ends: only the NaN's backward raises, and each compressor ends as its own call decided."""
    barrier = threading.Barrier(2, timeout=20)
    nan_called = threading.Event()
    outcome: dict[str, Any] = {}

    def train(key: str, poisoned: bool) -> None:
        comp, grads = _compressor()
        before = copy.deepcopy(comp.state_dict())
        inputs = [g * float("nan") for g in grads] if poisoned else grads
        first = _nothing if poisoned else lambda: nan_called.wait(20)  # type: ignore[func-returns-value]
        then = (lambda: (nan_called.set(), barrier.wait())) if poisoned else barrier.wait
        try:
            _reducing(comp, inputs, then, first)(torch.ones(3, requires_grad=True)).sum().backward()
            outcome[key] = ("finished", comp.state_dict()["steps"])
        except NonFiniteGradientError:
            outcome[key] = ("raised", same_state(before, comp.state_dict()))

    threads = [threading.Thread(target=train, args=(k, k == "nan")) for k in ("nan", "finite")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outcome == {"nan": ("raised", True), "finite": ("finished", [1, 1])}, outcome
