"""Shared machinery of compressors that send a function of ``x = gradient + error`` (error feedback).

Per call, the gradients of the selected parameters and their error buffers are summed into one flat
float32 vector ``x``; a subclass's :meth:`ErrorFeedbackCompressor._exchange` sends a compressed form of
``x`` (one collective) and returns what its own message decodes to and the mean over ranks of all decoded
messages. The new error is ``x - own decoded message`` (classic error feedback, Seide et al. 2014;
Karimireddy et al. 2019), so ``mean(x) == returned mean + mean(new errors)``: nothing is lost.

Everything a subclass does is per parameter: quantisation chunks start at each parameter, top-k and random-k
pick within each parameter, and random numbers come from a generator keyed by ``(seed, rank, parameter, that
parameter's step)``, on the compressor's device (a CUDA run draws other numbers than a CPU run with the same
seed: CUDA's generator is Philox, the CPU's a Mersenne twister; each is reproducible). Results therefore do
not depend on how parameters are grouped into calls (DDP buckets differ before and after DDP's rebuild, and on
resume), and a resumed run draws exactly the random numbers the uninterrupted one would have.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain._compat import foreach_add_, foreach_copy_
from powertrain.compress.base import (
    Compressor,
    Program,
    Request,
    Rows,
    check_state_counts,
    check_state_tensors,
    guard_nonfinite,
    slice_rows,
)
from powertrain.ops.finite import finite_flag
from powertrain.ops.flat import pack

Exchange = Generator[Request, "torch.Tensor | None", tuple[torch.Tensor, torch.Tensor]]


class ErrorFeedbackCompressor(Compressor):
    """Base class: per-parameter error buffers and random streams, flat packing, transactions, state.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        group: process group (``None``: the default group).
        seed: seed of the random streams (see ``_shared_randomness``).
        error_dtype: dtype the error buffers are stored in.
        error_decay: ``beta`` of ``x = gradient + beta * error`` (1: classic error feedback, nothing lost). Below 1
            the accumulator decays, as SparseLoCo's (Sarfi et al., arXiv 2508.15706), where it stands in for the outer
            momentum of local updates: what a message leaves out fades unless later messages send it.
    """

    #: True if every rank must draw the same random numbers (random-k); False gives each rank its own.
    _shared_randomness = False
    # a commit stores a new error buffer; the random streams are seeded again from the step counts at each step
    replaced_state = ("_errors",)
    counted_state = ("_steps",)
    #: True if :meth:`_new_error` needs the error buffers as they were (LoCo's moving average); else they are added to
    #: the gradients directly, without a copy of their own.
    _keeps_old = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        error_dtype: torch.dtype = torch.float32,
        error_decay: float = 1.0,
    ) -> None:
        check_int("seed", seed, 0)
        if isinstance(error_decay, bool) or not isinstance(error_decay, int | float) or not 0 < error_decay <= 1:
            raise ValueError(f"Invalid error_decay={error_decay!r}: must be in (0, 1] (1: classic error feedback)")
        if error_decay != 1 and self._keeps_old:
            raise ValueError(f"{type(self).__name__} keeps its own moving average of the error: error_decay must be 1")
        super().__init__(params, group=group)
        self.seed = seed
        self.error_dtype = error_dtype
        self.error_decay = float(error_decay)
        self._errors: list[torch.Tensor | None] = [None] * len(self.params)
        self._steps = [0] * len(self.params)
        self._generators: dict[int, torch.Generator] = {}

    @abc.abstractmethod
    def _exchange(self, x: torch.Tensor, parts: list[torch.Tensor], idx: list[int]) -> Exchange:
        """Send compressed ``x`` in one collective (``parts``: its views holding each parameter ``idx``'s values, in
        the layout of :meth:`_layout_chunk`, padding zero); return (own message decoded, mean of all decoded
        messages), both laid out as ``x``."""

    def _new_error(self, x: torch.Tensor, sent: torch.Tensor, old: torch.Tensor | None, idx: list[int]) -> torch.Tensor:
        """The error to keep (``old``: the error buffers as they were, if :attr:`_keeps_old`); classic error feedback
        keeps exactly what was not sent."""
        return x - sent

    def _rng(self, i: int) -> torch.Generator:
        """The random stream of parameter ``i`` at its current step (rank-specific unless shared), on the
        compressor's device: drawing on the CPU and copying would make the host wait on CUDA."""
        rank = -1 if self._shared_randomness else self.comm.rank
        digest = hashlib.blake2b(repr((self.seed, rank, i, self._steps[i])).encode(), digest_size=8).digest()
        generator = self._generators.get(i)
        if generator is None:  # made once per parameter and seeded again at each step
            generator = torch.Generator() if self.device.type == "cpu" else torch.Generator(device=self.device)
            self._generators[i] = generator
        return generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))

    @torch.no_grad()
    def program(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> Program:
        """The collectives that average ``grads`` (aligned with ``indices``, default all parameters; ``rows``: only
        rows ``lo:hi`` of each average): each gradient plus its (decayed) error buffer is encoded, the encodings
        exchanged and decoded, and what its own encoding lost kept in the buffer for the next step."""
        idx = self._resolve(grads, indices, rows)
        numels = [self._shapes[i].numel() for i in idx]
        lengths = chunk_lengths(numels, self._layout_chunk())
        if lengths == numels:
            x = pack(grads, torch.float32, self.device)
        else:  # each gradient at the start of its chunks, zeros after it: the chunks a subclass cuts never span two
            x = torch.empty(sum(lengths), dtype=torch.float32, device=self.device)
            torch._foreach_zero_([t[n:] for t, n in zip(x.split(lengths), numels, strict=True) if t.numel() > n])
            foreach_copy_(_views(x, numels, lengths), [g.reshape(-1) for g in grads])
        old = torch.zeros_like(x) if self._keeps_old else None
        owed = _views(x if old is None else old, numels, lengths)
        pairs = [(v, e) for v, i in zip(owed, idx, strict=True) if (e := self._errors[i]) is not None]
        if pairs and self.error_decay != 1:  # SparseLoCo's decayed accumulator (not with _keeps_old: checked)
            foreach_add_([v for v, _ in pairs], [e.reshape(-1) for _, e in pairs], alpha=self.error_decay)
        elif pairs:
            foreach_add_([v for v, _ in pairs], [e.reshape(-1) for _, e in pairs])
            if old is not None:
                x.add_(old)
        names = [self.names[i] for i in idx]
        error = lambda: self._nonfinite_error(names, grads, [self._errors[i] for i in idx])
        program = self._run(x, old, idx, grads, rows, (numels, lengths))
        return guard_nonfinite(program, local_ok=finite_flag([x]), error=error)

    def _layout_chunk(self) -> int:
        """The values per chunk of the layout ``x`` is packed in: each gradient starts a chunk and is padded with zeros
        to whole chunks (1: no padding), so that a subclass's chunks never span two parameters."""
        return 1

    def _run(
        self,
        x: torch.Tensor,
        old: torch.Tensor | None,
        idx: list[int],
        grads: Sequence[torch.Tensor],
        rows: Rows,
        layout: tuple[list[int], list[int]],
    ) -> Program:
        sent, mean = yield from self._exchange(x, _views(x, *layout), idx)
        new = self._new_error(x, sent, old, idx).to(self.error_dtype)
        for i, e in zip(idx, _views(new, *layout), strict=True):
            self._errors[i] = e.view(self._shapes[i])
            self._steps[i] += 1
        out = [m.view(g.shape).to(g.dtype) for m, g in zip(_views(mean, *layout), grads, strict=True)]
        return slice_rows(out, rows)

    def residuals(self) -> list[torch.Tensor]:
        """Each parameter's error buffer (zeros before its first step), aligned with ``self.params``."""
        return [
            torch.zeros(s, dtype=self.error_dtype, device=self.device) if e is None else e.view(s)
            for s, e in zip(self._shapes, self._errors, strict=True)
        ]

    def settings(self) -> dict[str, Any]:
        """What this compressor was built with that decides what it sends and what it keeps: saved with its state,
        and a state saved with other settings is refused at load (its error buffers are another compressor's)."""
        return {"error_decay": self.error_decay, "error_dtype": str(self.error_dtype).removeprefix("torch.")}

    def state_dict(self) -> dict[str, Any]:
        """The error buffers, each parameter's step count and the seed, with the settings and shapes they belong to:
        what a resume needs to send the same bytes."""
        return {
            "kind": type(self).__name__,
            "settings": self.settings(),
            "shapes": [list(s) for s in self._shapes],
            "errors": _compact(self._errors),
            "steps": list(self._steps),
            "seed": self.seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ValueError if it is another compressor's, for other shapes or
        saved with other settings."""
        missing = {"kind", "shapes", "errors", "steps", "seed"} - set(state)
        if missing:
            raise ValueError(f"{type(self).__name__} state_dict is missing {sorted(missing)}")
        shapes = [list(s) for s in self._shapes]
        if state["kind"] != type(self).__name__ or [list(s) for s in state["shapes"]] != shapes:
            raise ValueError(
                f"state_dict of a {state['kind']} for shapes {state['shapes']} does not fit this "
                f"{type(self).__name__} for {shapes}"
            )
        saved = state.get("settings")  # absent from a state written before it was saved: nothing to check it by
        if saved is not None:
            ours = self.settings()
            if not isinstance(saved, Mapping) or set(saved) != set(ours):
                raise ValueError(f"{type(self).__name__} state_dict's settings are {saved!r:.100}, expected {ours}")
            differ = [key for key, value in ours.items() if saved[key] != value]
            if differ:
                was = ", ".join(f"{key}={saved[key]!r}" for key in differ)
                now = ", ".join(f"{key}={ours[key]!r}" for key in differ)
                raise ValueError(
                    f"{type(self).__name__} state_dict was saved with {was}, this compressor has {now}: build it with "
                    "the settings the state was saved with"
                )
        check_state_tensors(type(self).__name__, "errors", state["errors"], self._shapes)
        steps = check_state_counts(type(self).__name__, "steps", state["steps"], len(self._shapes))
        seed = state["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"{type(self).__name__} state_dict's seed is {seed!r:.40}, expected an int")
        self._errors = [None if e is None else e.to(self.device, self.error_dtype, copy=True) for e in state["errors"]]
        self._steps = steps
        self.seed = seed


def _compact(errors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The error buffers as views of one new buffer of their values only: each is a view of its call's padded layout
    (up to ``chunk - 1`` values of padding a parameter, kept alive with it), which a checkpoint must not carry."""
    present = [e for e in errors if e is not None]
    if not present:
        return list(errors)
    flat = iter(torch.cat([e.reshape(-1) for e in present]).split([e.numel() for e in present]))
    return [None if e is None else next(flat).view(e.shape) for e in errors]


def _views(buffer: torch.Tensor, numels: list[int], lengths: list[int]) -> list[torch.Tensor]:
    """The 1-D views of ``buffer`` (laid out as ``lengths``) holding ``numels`` values each."""
    if numels == lengths:
        return list(buffer.split(numels))
    return [v[:n] for v, n in zip(buffer.split(lengths), numels, strict=True)]


def chunk_lengths(numels: Sequence[int], chunk: int) -> list[int]:
    """Each length padded to whole chunks (the layout :meth:`ErrorFeedbackCompressor._layout_chunk` asks for)."""
    return [-(-n // chunk) * chunk for n in numels]


def real_views(padded: torch.Tensor, parts: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """The views of a padded layout (``lengths``) that hold each part's real values (its padding left out)."""
    return _views(padded, [p.numel() for p in parts], lengths)


def _unpadded(parts: list[torch.Tensor], lengths: list[int]) -> bool:
    return all(n == p.numel() for p, n in zip(parts, lengths, strict=True))


def unpad(padded: torch.Tensor, parts: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """The real values of a padded layout, concatenated (``padded`` itself where nothing is padding)."""
    if not parts:
        return padded[:0]
    if _unpadded(parts, lengths):
        return padded
    return torch.cat(real_views(padded, parts, lengths))


def repad(real: torch.Tensor, parts: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Inverse of :func:`unpad` (padding positions get zeros; ``real`` itself where there is no padding): padding is
    never sent."""
    if _unpadded(parts, lengths):
        return real
    out = real.new_zeros(sum(lengths))
    if parts:
        foreach_copy_(real_views(out, parts, lengths), list(real.split([p.numel() for p in parts])))
    return out
