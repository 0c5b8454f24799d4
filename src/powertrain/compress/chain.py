"""Running a compressor's collective program asynchronously: each collective's completion advances the program.

:func:`~powertrain.compress.base.run_program` runs a program's collectives one after the other, blocking. Here a
program runs as a chain of futures instead (:class:`Chain`): its first collective is issued by the caller, every later
one from the completion callback of the one before, which never blocks on a future, so the caller goes on computing
(DDP's backward with the next buckets, the next inner steps of local updates) while the messages travel.

Collectives must be issued in the same order on every rank, and callbacks run on communication threads in whatever
order the collectives complete. A :class:`Sequencer` therefore gives the c-th collective of every call a communicator
of its own (a process group) and issues the calls' collectives on each strictly in call order (a call whose program
ends early releases its later slots). Drivers: :mod:`powertrain.ddp` (one call per gradient bucket) and
:mod:`powertrain.diloco` (one call per outer synchronisation).

NCCL completes a collective's future as soon as the collective is queued, so a callback runs inline, in the thread
that issued the collective (DDP's backward, the inner steps), and a program's check of a result's finiteness there
(:func:`~powertrain.ops.finite.read_flag`, a host read of a CUDA value) would hold that thread until the collective is
done: no overlap. A checked result (a program's last collective: ``check`` says no collective follows) that arrives
inline on CUDA is therefore read, and the program finished (committed, its outputs written), on a :class:`_Worker`
thread, on the callback's stream; the caller goes on at once. The worker never issues a collective, so every
collective is still issued in the same order on every rank (NCCL needs that across its communicators too). gloo runs
callbacks on its own threads, where waiting costs the caller nothing.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch

from powertrain.comm import Communicator
from powertrain.compress.base import Compressor, GatherRequest, Program, Request

__all__ = ["Chain", "ChainedCalls", "Sequencer", "future_on", "sequencer_for"]


def sequencer_for(compressor: Compressor, *, calls_overlap: bool) -> Sequencer:
    """The sequencer whose communicators carry ``compressor``'s chained programs, one per collective of a call:
    the compressor's own (``communicators()``, e.g. a hierarchical one's per level) when it names them; else, where
    calls overlap (DDP: several buckets' programs in flight at once), its communicator for a call's first collective
    and a new process group of the same ranks for each later one (``max_collectives_per_call``), so that the c-th
    collectives of all calls are ordered on a group of their own; where one call is in flight at a time (local
    updates' syncs), its communicator for every collective."""
    comms = compressor.communicators()
    if comms is not None:
        return Sequencer(comms)
    n = compressor.max_collectives_per_call()
    if not calls_overlap or n == 1:
        return Sequencer([compressor.comm] * n)
    import torch.distributed as dist

    group = compressor.comm.group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    extra = [Communicator(dist.new_group(ranks=ranks), stats=compressor.comm.stats) for _ in range(n - 1)]
    return Sequencer([compressor.comm, *extra])


class Sequencer:
    """Issues the collectives of every call on each communicator in call order (a call uses each at most once)."""

    def __init__(self, comms: list[Communicator]) -> None:
        self.comms = comms
        self.worker = _Worker()  # continues the programs whose result check would hold the caller
        self._lock = threading.Lock()
        self._next = [0] * len(comms)  # next call number allowed to issue on each slot
        self._pending: list[dict[int, Callable[[], Callable[[], None]]]] = [{} for _ in comms]
        self._skipped: list[set[int]] = [set() for _ in comms]

    def key(self, comm: Communicator) -> int:
        """The position of ``comm`` (a communicator a request named) in this sequencer's list."""
        for k, c in enumerate(self.comms):
            if c is comm:
                return k
        raise RuntimeError("a compressor's request named a communicator its communicators() does not list")

    def submit(self, slot: int, call_no: int, launch: Callable[[], Callable[[], None]]) -> None:
        """``launch()`` issues the collective and returns what to run outside the lock (attach its completion
        callback); it must not raise. ``slot``: the communicator's position."""
        with self._lock:
            self._pending[slot][call_no] = launch
            attach = self._drain(slot)
        for a in attach:  # outside the lock: a completed future runs its callback inline
            a()

    def finish(self, call_no: int, used: set[int]) -> None:
        """Call number ``call_no`` issued collectives on the communicators ``used`` and will issue no more."""
        attach: list[Callable[[], None]] = []
        with self._lock:
            for slot in set(range(len(self.comms))) - used:
                self._skipped[slot].add(call_no)
                attach += self._drain(slot)
        for a in attach:
            a()

    def _drain(self, slot: int) -> list[Callable[[], None]]:
        attach = []
        pending, skipped = self._pending[slot], self._skipped[slot]
        while True:
            n = self._next[slot]
            if n in skipped:
                skipped.discard(n)
            elif n in pending:
                attach.append(pending.pop(n)())  # issue now, under the lock: this fixes the order
            else:
                return attach
            self._next[slot] = n + 1


_THREAD = "powertrain-chain"  # the worker thread's name


class _Worker:
    """Runs functions in the order given, on a thread of its own that exists only while it has some to run (no
    thread is left waiting for work: a driver that is dropped, or rebuilt on an elastic restart, leaves none). Not a
    daemon: the interpreter waits for it at exit rather than stop it inside a CUDA call (which aborts the process)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._running = False
        self._runner: int | None = None  # the thread running the functions now

    def wait_idle(self) -> None:
        """Return once every function submitted so far has run (at once when called from one of them)."""
        if threading.get_ident() == self._runner:
            return
        with self._lock:
            self._lock.wait_for(lambda: not self._running)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` after the functions submitted before it. ``fn`` reports its own failures: an exception that
        escapes it is printed (``sys.excepthook``) and the functions after it still run."""
        with self._lock:
            self._queue.append(fn)
            if self._running:
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name=_THREAD).start()
        except BaseException:  # no thread to be had: run them here (the caller waits, as it would without a worker)
            self._run()

    def _run(self) -> None:
        self._runner = threading.get_ident()
        while True:
            with self._lock:
                if not self._queue:
                    self._running, self._runner = False, None
                    self._lock.notify_all()
                    return
                fn = self._queue.popleft()
            try:
                fn()
            except BaseException:  # a bug in fn: say so, and keep the calls queued after it going
                sys.excepthook(*sys.exc_info())


def _read_would_hold(device: torch.device | None, inline: bool) -> bool:
    """Whether a host read of a result on ``device``, in a completion callback, would hold the thread that issued the
    collective: the callback runs in that thread (``inline``) and the read waits for the work queued on the device
    (CUDA; the CPU computed it already)."""
    return inline and device is not None and device.type == "cuda"


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``stream`` (and its device) current in this thread; nothing to set for None (the CPU)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def future_on(device: torch.device | None) -> torch.futures.Future:
    """A future for a value on ``device``. On CUDA it records an event on the current streams when its result is
    set and makes a waiter's streams wait for it: a program's later steps run in callbacks on the streams a CUDA
    future (NCCL's) hands them, not on the stream the caller reads the result on."""
    return torch.futures.Future(devices=[device] if device is not None and device.type == "cuda" else None)


class ChainedCalls:
    """A driver's side of its chained programs: the sequencer their collectives go through, the calls' numbers (in
    the order the driver issues them, the same on every rank), and the first failure a chain reported from a
    communication thread, kept for the driver to raise in its own thread (:meth:`take_error`)."""

    def __init__(self, seq: Sequencer) -> None:
        self.seq = seq
        self.count = 0  # calls issued so far: the next call's number
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # failures arrive on communication threads, several at once

    def chain(
        self, program: Program, done: Callable[[list[torch.Tensor]], None], device: torch.device | None = None
    ) -> Chain:
        """The next call's chain, not yet started (``start()`` issues its first collective)."""

        def failed(e: BaseException) -> None:
            with self._lock:
                if self.error is None:
                    self.error = e

        chain = Chain(program, self.seq, self.count, done, failed, device)
        self.count += 1
        return chain

    def take_error(self) -> BaseException | None:
        """The first failure since the last call, forgotten."""
        with self._lock:
            error, self.error = self.error, None
        return error

    def restart(self) -> None:
        """Number the calls afresh on the same communicators (every rank does, with no call in flight)."""
        self.seq, self.count = Sequencer(self.seq.comms), 0
        self.take_error()


class Chain:
    """Runs one program: each collective's completion advances the program to the next one. ``device``: where the
    program's tensors are (None: the CPU)."""

    def __init__(
        self,
        program: Program,
        seq: Sequencer,
        call_no: int,
        done: Callable[[list[torch.Tensor]], None],
        failed: Callable[[BaseException], None],
        device: torch.device | None = None,
    ) -> None:
        self.program, self.seq, self.call_no, self.done, self.failed = program, seq, call_no, done, failed
        self.device = device
        self.future = future_on(device)
        self.issued = 0  # collectives issued so far
        self.used: set[int] = set()  # the communicators they used
        self.released = False  # its unused slots went to the calls after it: it issues no more collectives

    def _fail(self, e: BaseException) -> None:
        # ``failed`` first: a waiter on the future (DDP's backward) may ask what failed as soon as it is set
        self.failed(e)
        self.future.set_exception(e)

    def _abort(self, e: BaseException) -> None:
        """Fail mid-program: its later collective slots are released (other calls go on), then the future fails."""
        with contextlib.suppress(BaseException):  # the program's own clean-up failed too: ``e`` is what to report
            self.program.close()
        self._release()
        self._fail(e)

    def _release(self) -> None:
        """This call issues no more collectives: its unused slots go to the calls after it, whose collectives waiting
        for them are issued now, by this thread (once: later calls do nothing)."""
        if not self.released:
            self.released = True
            self.seq.finish(self.call_no, self.used)

    def start(self) -> torch.futures.Future:
        self._advance(None)
        return self.future

    def _advance(self, value: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        try:
            request = next(self.program) if self.issued == 0 else self.program.send(value)
            self.seq.comms[0].stats.add_time(compress_s=time.perf_counter() - t0)
        except StopIteration as stop:
            self.seq.comms[0].stats.add_time(compress_s=time.perf_counter() - t0)
            self._release()
            try:
                self.done(stop.value)
            except BaseException as e:
                self._fail(e)
            return
        except BaseException as e:
            self._release()
            self._fail(e)
            return
        try:
            if self.released:  # its slots are given away, and it may be on the worker: a collective now would be
                raise RuntimeError(  # issued out of order
                    "a compressor's program issued a collective after a checked one (check=True must mark its last)"
                )
            slot = self.issued if request.comm is None else self.seq.key(request.comm)
            if slot >= len(self.seq.comms) or slot in self.used:
                raise RuntimeError(
                    f"a compressor issued {self.issued + 1} collectives in one call but declared at most "
                    f"{len(self.seq.comms)} (max_collectives_per_call), or named one communicator twice"
                )
        except RuntimeError as e:
            self._abort(e)
            return
        self.issued += 1
        self.used.add(slot)
        if request.check:  # the last: release the other slots here, in the issuing thread, not where the program ends
            self._release()  # (the worker, which must issue no collective, not even the calls' after this one)
        self.seq.submit(slot, self.call_no, lambda: self._launch(slot, request))

    def _launch(self, slot: int, request: Request) -> Callable[[], None]:
        """Issue the collective (under the sequencer's lock); what to run outside it: attach the completion
        callback, or, if issuing failed, fail this call (its slot is used, so the calls after it go on)."""
        comm = self.seq.comms[slot]
        try:
            if isinstance(request, GatherRequest):
                out, fut = comm.all_gather(request.tensor, async_op=True)
            else:
                out, fut = None, comm.all_reduce_(request.tensor, request.op, async_op=True)
            assert fut is not None, "async collectives return a future"
        except BaseException as e:
            return functools.partial(self._abort, e)

        def attach() -> None:
            caller = threading.get_ident()
            fut.then(lambda f: self._completed(f, out, request.check, threading.get_ident() == caller))

        return attach

    def _completed(self, fut: torch.futures.Future, out: torch.Tensor | None, checked: bool, inline: bool) -> None:
        """The collective ``fut`` is done (or, on NCCL, queued): advance the program. ``checked``: it was the program's
        last, whose finiteness the program reads on the host next; ``inline``: this callback runs in the thread that
        attached it (the future was complete already: NCCL's always are). Where that read would hold this thread, the
        worker finishes the program instead, on this callback's stream, and this thread goes on."""
        if checked and _read_would_hold(self.device, inline):
            try:
                cuda = self.device is not None and self.device.type == "cuda"
                stream = torch.cuda.current_stream(self.device) if cuda else None
            except BaseException as e:
                self._abort(e)
                return
            self.seq.worker.submit(lambda: self._finish(fut, out, stream))
            return
        self._resume(fut, out)

    def _finish(self, fut: torch.futures.Future, out: torch.Tensor | None, stream: torch.cuda.Stream | None) -> None:
        """On the worker: the program after its last collective (it must issue none: :meth:`_advance` refuses)."""
        try:
            with _on_stream(stream):
                self._resume(fut, out)
        except BaseException as e:  # switching streams failed (the program's own failures end its call in _resume)
            if not self.future.done():
                self._abort(e)

    def _resume(self, fut: torch.futures.Future, out: torch.Tensor | None) -> None:
        try:
            fut.value()  # re-raises a failed collective (timeout, lost peer)
        except BaseException as e:
            self._abort(e)
            return
        self._advance(out)
