"""AdamW whose second moment stops moving after a warm-up: the optimizer side of error feedback.

Error feedback (PowerSGD, top-k, sign, ...) delivers every gradient component in full, but late: what a step's
compressed message misses accumulates in the error buffer and arrives in a later step, often as a burst. SGD
with momentum is linear in the gradients, so a late component moves the weights as far as an on-time one. Adam
is not: the burst raises the second moment of its coordinates, and dividing by it shrinks exactly the delayed
update (with beta2 = 0.95 a burst k times a coordinate's usual gradient moves it by about
``1 / sqrt(1 - beta2) ~ 4.5`` steps' worth instead of k). DeepSpeed's 1-bit Adam (Tang et al., ICML 2021)
therefore runs exact Adam for a warm-up and then freezes the variance, after which the update
``m_hat / (sqrt(v_hat) + eps)`` is linear in the gradients (up to the bound below) and error feedback's delay
costs nothing.

:class:`FrozenVarianceAdamW` is torch's AdamW, operation for operation (bitwise equal to
``torch.optim.AdamW(foreach=False)``), for its first ``freeze_after`` steps; from then on each parameter's
denominator is ``sqrt(v_hat) + eps`` with the bias-corrected second moment ``v_hat`` of step ``freeze_after``,
which ``exp_avg_sq`` holds from then on (the state keeps AdamW's keys, so checkpoints load into a fresh optimizer
like AdamW's). Weight decay (decoupled), the first moment and its bias correction continue as in AdamW.

Coordinates that had no gradient before the freeze (``v_hat`` exactly 0: the embedding row of a token not seen
yet) are not frozen: a frozen 0 would make their first step ``m_hat / eps``, about 1e7 times AdamW's. They keep
AdamW's second moment, stored negated in ``exp_avg_sq`` (its sign bit marks them; ``-0.0`` until their first
gradient), so the state keeps its keys and a checkpoint resumes them bitwise. Every other coordinate is frozen.

A frozen coordinate never steps further in one step than AdamW itself could at that step: ``lr`` times the largest
``|m_hat| / sqrt(v_hat)`` any gradient history gives AdamW there (``_adamw_step_bound`` derives it; it tends to 1.16
at betas (0.9, 0.95), 7.27 at (0.9, 0.999), and grows without limit where beta1**2 >= beta2). Without it, a
coordinate seen rarely before the freeze keeps the tiny second moment its last gradient decayed to (beta2 = 0.95
forgets within about 20 steps), and its next gradient moves it by thousands of AdamW's steps: a rare byte's embedding
row that did so took a GPT's whole training with it (docs/notes/compression.md). The bound is per step: such a
coordinate still moves the bound's full step for as long as its momentum keeps it there, further in all than AdamW
would. Where the bound does not bind, the update is the unbounded one, bit for bit; where it binds, the update is
no longer linear in that coordinate's gradient, so a delayed burst beyond it counts only up to the bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from powertrain._checks import check_int

__all__ = ["FrozenVarianceAdamW"]


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW for ``freeze_after`` steps, then with each parameter's second moment frozen (see the module).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate, as :class:`torch.optim.AdamW`'s (default 1e-3).
        betas: ``(beta1, beta2)``, the moments' EMA factors, as AdamW's (default ``(0.9, 0.999)``); beta2 is
            no longer used once frozen, except by coordinates that had no gradient before the freeze.
        eps: added to the denominator ``sqrt(v_hat)``, as AdamW's (default 1e-8).
        weight_decay: decoupled weight decay, as AdamW's (default 1e-2).
        freeze_after: AdamW steps before the second moment freezes (>= 1); counted per parameter, so a
            parameter that skipped steps (no gradient) freezes later.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        freeze_after: int,
    ) -> None:
        check_int("freeze_after", freeze_after, 1, " (AdamW steps first)")
        limits = {
            "lr": (lr, lr >= 0, ">= 0"),
            "eps": (eps, eps > 0, "> 0"),
            "weight_decay": (weight_decay, weight_decay >= 0, ">= 0"),
            "betas": (betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "two in [0, 1)"),
        }
        for name, (value, ok, what) in limits.items():
            if not ok:
                raise ValueError(f"Invalid {name}={value!r}: must be {what}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "freeze_after": freeze_after}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient: AdamW's up to its ``freeze_after``-th step, then with the
        frozen second moment (see the module). Returns ``closure()``'s loss when a closure is given; ValueError for a
        sparse gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, freeze = group["lr"], group["eps"], group["weight_decay"], group["freeze_after"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FrozenVarianceAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                _update(p, p.grad, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd, freeze=freeze)
        return loss


def _update(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    wd: float,
    freeze: int,
) -> None:
    """One step of one parameter: torch's single-tensor AdamW (same operations, same order) up to the freeze; after
    it, ``exp_avg_sq`` holds the frozen, bias-corrected second moment of step ``freeze`` (AdamW's, negated, where that
    was 0: see the module)."""
    state["step"] += 1
    step = state["step"].item()
    if wd != 0:
        p.mul_(1 - lr * wd)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    step_size = lr / (1 - beta1**step)
    if step > freeze:
        live = torch.signbit(exp_avg_sq)  # no gradient before the freeze: AdamW's v, negated
        adamw = exp_avg_sq.mul(beta2).sub_(grad * grad * (1 - beta2))
        exp_avg_sq.copy_(torch.where(live, adamw, exp_avg_sq))
        live_denom = exp_avg_sq.abs().sqrt() / (1 - beta2**step) ** 0.5  # AdamW's (where live)
        denom = torch.where(live, live_denom, exp_avg_sq.sqrt()).add_(eps)
        most = lr * _adamw_step_bound(beta1, beta2, step)
        if not most < torch.finfo(p.dtype).max:  # no finite bound (inf, or nan from lr 0): AdamW's is unbounded
            p.addcdiv_(exp_avg, denom, value=-step_size)
            return
        # the unbounded update where the bound leaves it (addcdiv's own bits on any device and dtype), else the bound
        over = exp_avg.abs().div_(denom).mul_(step_size).gt(most)
        p.copy_(torch.where(over, p.sub(exp_avg.sign(), alpha=most), p.addcdiv(exp_avg, denom, value=-step_size)))
        return
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)
    if step == freeze:  # v_hat, fixed from now on; where it is 0 (no gradient yet) -0.0 marks AdamW's, live
        exp_avg_sq.div_(bias_correction2)
        exp_avg_sq.masked_fill_(exp_avg_sq == 0, -0.0)


def _adamw_step_bound(beta1: float, beta2: float, step: float) -> float:
    """The furthest AdamW's update can move one coordinate at ``step`` (1-based), in learning rates: the largest
    ``|m_hat| / sqrt(v_hat)`` over every gradient history, with eps 0.

    With ``q = beta1**2 / beta2``, Cauchy-Schwarz on ``m = (1 - beta1) * sum_k beta1**k * g_k`` against
    ``v = (1 - beta2) * sum_k beta2**k * g_k**2`` (``k`` steps back, ``k < step``) gives
    ``|m| <= (1 - beta1) * sqrt(sum_k q**k) * sqrt(v / (1 - beta2))``, with equality for ``g_k`` proportional to
    ``(beta1 / beta2)**k``; times the bias corrections ``sqrt(1 - beta2**step) / (1 - beta1**step)``, that is the value
    returned. It is 1 at step 1 and tends to ``(1 - beta1) / sqrt((1 - beta2) * (1 - q))`` for ``q < 1`` (1.16 at
    betas (0.9, 0.95), 7.27 at (0.9, 0.999)); for ``q >= 1`` it grows without limit (inf once it overflows).
    """
    if beta2 == 0:  # v_hat is the last gradient's square alone: only beta1 = 0 bounds m_hat by it
        return 1.0 if beta1 == 0 or step <= 1 else math.inf
    q = beta1**2 / beta2
    try:
        terms = step if q == 1 else (1 - q**step) / (1 - q)
    except OverflowError:
        return math.inf
    return (1 - beta1) / (1 - beta1**step) * math.sqrt(terms * (1 - beta2**step) / (1 - beta2))
