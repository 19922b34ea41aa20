"""``MultiWorkerMirroredStrategy``: the same replica functions across processes, on MPI.

Every process (a *worker*) runs the same program (``mpiexec -n 4 python train.py``)
and holds some replicas; replica ids are global (worker 0's first, then worker
1's, ...). A collective is done in three steps:

1. **locally**: the worker's replicas meet at the usual rendezvous, and their
   values are combined inside the worker (``ReductionToOneDevice``);
2. **across workers**, on a private duplicate of ``MPI.COMM_WORLD``: first every
   worker sends every other a small *header* (what it is calling, the shapes,
   its place in the order) with non-blocking point-to-point messages; when all
   headers are in and agree, the data goes through one non-blocking MPI
   collective (``Iallreduce``, ``Iallgatherv``, ``Ibcast``). Every MPI call is
   made on one communication thread (``_Progress``), never on the loop's: with a
   dead peer, MPI's progress engine can block forever, and the loop must still
   report it when ``timeout_seconds`` expires;
3. **locally** again: every replica receives the result.

**The order rule.** MPI matches collectives by the order they are issued in, so
every worker must issue the same cross-worker operations in the same order.
Within a run that is the call order, which the local rendezvous already checks.
Across runs, ``strategy.run`` calls on one strategy are *serialised*: a run
starts when the previous one has finished, so concurrent runs never interleave
their collectives (they are numbered in submission order). Cross-replica calls
(``strategy.reduce``, ``gather``, ``extended.reduce_to``) take their place in
the same sequence. The headers make any break of the rule an error instead of
a deadlock: a worker calling something else at the same place is named
(``CollectiveMismatchError``), a worker that never arrives — slow, stuck or
dead — is named when ``timeout_seconds`` expires (``RendezvousTimeoutError``).
Each run is numbered (one making no cross-worker call too: every worker makes
the same runs), and a collective's header holds the run's number and its call
number, so call #0 of run 1 never meets call #0 of run 2. A
run that fails on one worker (a replica raises, or it is cancelled) sends a
*failure header* in place of its next call: the other workers raise naming it at
once (``ReplicaExitedError``), and the order is kept. A collective of that run
whose header was already sent finishes first, before the run raises
(``World.operate``): the others may wait in its data step.
After a timeout the cross-worker order is lost for good: the worker tells every
peer (an abort message, whose arrival fails the peer's operations in flight),
every later cross-worker call raises at once, and when the program exits it ends the whole
job with ``MPI_Abort`` (a clean ``MPI_Finalize`` would wait for the lost worker
forever). Note that ``mpiexec`` itself ends the job at once when a worker
*process dies*; the timeout is what reports a worker that hangs, stops
responding, or calls something else.

With GPU replicas, step 1 to 3 are one NCCL collective instead: one
communicator spans every GPU of every worker (worker 0 makes its unique id
and sends it over MPI; each worker creates its ranks between ``groupStart()``
and ``groupEnd()``), and after the header exchange each replica's rank is
issued on that replica's stream, the same code as on one machine. Every
worker holds replicas of one kind (all CPU or all GPU).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import json
import math
import numbers
import queue
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _nest, _poll, _stall
from ._checks import options_or_default, whole_number
from ._devices import HOST as _HOST
from ._devices import Device
from ._errors import (
    AiodistError,
    CollectiveMismatchError,
    ContextError,
    DeviceError,
    InvalidArgumentError,
    RendezvousError,
    RendezvousTimeoutError,
    ReplicaExitedError,
)
from ._ops import ReduceOp

__all__ = ["World", "import_mpi"]

_ABORT_GRACE_SECONDS = 1.0
_HEADER_TAG = 7001
_ABORT_TAG = 7002  # "this worker lost the order": every peer's operations fail at once
_ABORT_BYTES = 4096
_CLOSE = object()  # the work item that ends the progress thread
_CLOSE_WAIT_SECONDS = 5.0
_MPI_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.MEAN: "SUM",  # divided by the global replica count after
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.PRODUCT: "PROD",
}


def import_mpi() -> Any:
    """mpi4py's ``MPI`` module; ``InvalidArgumentError`` saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise InvalidArgumentError(
            f"MultiWorkerMirroredStrategy needs mpi4py and an MPI library ({exc}); install "
            "them with pip install 'aiodist[mpi]' (mpi4py and MPICH from PyPI), then start "
            "every worker with mpiexec -n <workers> python your_program.py."
        ) from None
    return MPI


def _short(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters once non-ASCII ones are escaped (JSON
    would escape them anyway, to up to 12 bytes each)."""
    return text.encode("ascii", "backslashreplace").decode()[:limit]


def _span(first: int, count: int) -> str:
    if count == 1:
        return f"replica {first}"
    return f"replicas {first}-{first + count - 1}"


class _Progress:
    """The one thread that makes every MPI call after start-up.

    MPI's non-blocking calls need someone to call ``Test`` until they complete,
    and with a dead peer MPICH's progress engine can block inside ``Test``
    forever. So no MPI call is ever made on the event loop's thread: work is
    handed to this thread (``submit``), which posts the requests and tests them
    with growing pauses, and the loop awaits a future with its own deadline. A
    worker whose peer died therefore still raises a clear timeout error; only
    this thread stays stuck (a daemon thread: it does not keep the process up).
    """

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        # The receives of the peers' abort messages (``watch``) and, once one came,
        # (worker, its error's class name, its message): every request in flight
        # then fails, and so does every later one.
        self._watches: list = []
        self.aborted: tuple[int, str, str] | None = None
        self._thread = threading.Thread(target=self._main, name="aiodist-mpi", daemon=True)
        self._thread.start()

    def watch(self, start: Callable[[], list]) -> None:
        """Post ``start()``'s receives (``(worker, request, buffer)`` each) on the
        thread and test them while any work is in flight."""
        self._work.put((start, None, None))

    def submit(self, start: Callable[[], list]) -> tuple[concurrent.futures.Future, list]:
        """Run ``start()`` (which posts MPI requests and returns them) on the thread;
        the future completes when every request has. ``marks[i]`` turns True as
        request ``i`` completes (read it after a timeout to see which did)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        marks: list[bool] = []
        self._work.put((start, future, marks))
        return future, marks

    def close(self, finish: Callable[[bool], None], wait: float) -> None:
        """End the thread: it calls ``finish(idle)`` (``idle``: no request of its own
        in flight) as its last step; wait for that for at most ``wait`` seconds."""
        self._work.put((finish, _CLOSE, None))
        # The finalizer may run on this very thread (the cyclic garbage collector runs
        # wherever an allocation triggers it): it can only leave the close queued.
        if threading.current_thread() is not self._thread:
            self._thread.join(wait)

    def _main(self) -> None:
        active: list = []
        pause = 0.0
        while True:
            try:
                item = self._work.get(block=not active)
            except queue.Empty:
                item = None
            if item is not None:
                start, future, marks = item
                if future is _CLOSE:
                    start(not active and self.aborted is None)
                    for _requests, waiting, _marks in active:  # nothing completes them now
                        if not waiting.done():
                            waiting.set_exception(_closed_error())
                    return
                if future is not None and self.aborted is not None:
                    future.set_exception(_abort_error(self.aborted))
                    item = None
                    continue
                try:
                    requests = start()
                except BaseException as exc:  # e.g. an MPI error posting the requests
                    if future is not None:
                        future.set_exception(exc)
                else:
                    if future is None:  # watch()
                        self._watches.extend(requests)
                    else:
                        marks.extend([False] * len(requests))
                        active.append((requests, future, marks))
            if self._watches and self.aborted is None:
                self._test_watches()
            if self.aborted is not None:
                for _requests, future, _marks in active:
                    if not future.done():
                        future.set_exception(_abort_error(self.aborted))
                active = []
            progressed = False
            for entry in list(active):
                requests, future, marks = entry
                for i, request in enumerate(requests):
                    if not marks[i] and request.Test():
                        marks[i] = progressed = True
                if all(marks):
                    active.remove(entry)
                    if not future.done():
                        future.set_result(None)
            if progressed or item is not None:
                pause = 0.0
            elif active:
                time.sleep(pause)
                pause = _poll.next_pause(pause)

    def _test_watches(self) -> None:
        for worker, request, buffer in self._watches:
            if request.Test():
                kind, _, text = bytes(buffer).rstrip(b"\0").decode().partition(":")
                self.aborted = (worker, kind, text)
                return


def _release(pause: asyncio.Future, _: object = None) -> None:
    if not pause.done():
        pause.set_result(None)


async def _until(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future, when: float) -> None:
    """Wait until ``waiter`` is done or the loop's clock reaches ``when``. The timer
    and callback run in an empty context: the caller's (a replica's, holding its
    run and strategy) would stay alive in the loop's heap of cancelled timers
    until the deadline, and a dropped strategy with it. A new one per call: one
    context shared by loops in two threads cannot be entered by both at once
    (the second callback would fail, and its wait never end)."""
    pause = loop.create_future()
    wake = functools.partial(_release, pause)
    empty = contextvars.Context()
    timer = None if when == math.inf else loop.call_at(when, wake, context=empty)
    waiter.add_done_callback(wake, context=empty)
    try:
        await pause
    finally:
        if timer is not None:
            timer.cancel()
        waiter.remove_done_callback(wake)


def _closed_error() -> InvalidArgumentError:
    return InvalidArgumentError(
        "this MultiWorkerMirroredStrategy was closed (strategy.close()); build a "
        "new one, at the same point on every worker, to make cross-worker calls."
    )


def _fail_soon(waiter: asyncio.Future, error: Callable[[], BaseException]) -> None:
    """Fail ``waiter`` (an asyncio future) with ``error()``, from any thread."""

    def fail() -> None:
        if not waiter.done():
            waiter.set_exception(error())

    loop = waiter.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fail()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fail)


def _abort_error(aborted: tuple[int, str, str]) -> RendezvousError:
    """The error a peer's abort message raises here: of the class the peer raised."""
    worker, kind, text = aborted
    cls = {c.__name__: c for c in (RendezvousTimeoutError, CollectiveMismatchError)}.get(
        kind, RendezvousError
    )
    return cls(
        f"worker {worker} lost the workers' order of operations, so every cross-worker "
        f"operation stops: {text}"
    )


class _Receive:
    """One peer's header, of any length: probed, then received at the length the
    probe found (MPI cannot receive a message of unknown length otherwise). It
    looks like a request to ``_Progress`` (``Test``). ``previous`` is the receive
    posted before it from the same peer: this one probes only once that one has
    matched, or its probe could take that one's message."""

    def __init__(self, comm: Any, MPI: Any, source: int, previous: _Receive | None):
        self._comm, self._MPI, self._source = comm, MPI, source
        self._previous = previous
        self._request: Any = None
        self.buffer: np.ndarray | None = None

    def Test(self) -> bool:  # (an MPI request's name: _Progress calls it)
        if self._request is None:
            if self._previous is not None and self._previous._request is None:
                return False
            status = self._MPI.Status()
            message = self._comm.Improbe(self._source, _HEADER_TAG, status)
            if message is None:
                return False
            self.buffer = np.empty(status.Get_count(self._MPI.BYTE), np.uint8)
            self._request = message.Irecv([self.buffer, self._MPI.BYTE])
            self._previous = None  # (no chain of receives kept alive)
        return self._request.Test()


class _Turn:
    """One asynchronous operation's place for its data step (``World.take_turn``):
    its header's order number, whether every worker agreed to it there, and whether
    its turn has come; and the run its headers are of (``World.operate``)."""

    __slots__ = ("agreed", "held", "run", "ticket")

    def __init__(self, run: int | None) -> None:
        self.ticket: int | None = None
        self.agreed = self.held = False
        self.run = run


class _Run:
    """One ``strategy.run``: its number among this worker's runs (set by
    ``World.begin_run`` as its turn comes), its strategy's world, and the future
    done when it ends (set by ``World.end_run``). It is in flight while it has a
    number and has not ended; a task it started that outlives it still posts
    headers of it (``World._run_now``), so it is held until collected too."""

    __slots__ = ("ended", "number", "world")

    def __init__(self, world: World, ended: asyncio.Future):
        self.number: int | None = None
        self.world, self.ended = world, ended

    def __del__(self) -> None:
        # Collected: let go of it (see World.begin_run). Maybe on the garbage
        # collector's thread, so only an append, drained on the loop's thread. (Not
        # a weakref.finalize: an entry in its global registry per run, about 1 us.)
        if self.number is not None:
            self.world._collected.append(self.number)


# The run the current task belongs to (its replicas' and collectives' tasks inherit it
# from strategy.run; a cross-replica call made beside a run, in another task, does not).
_current_run: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "aiodist_mpi_run", default=None
)

# The operation the current task is making (each runs in its own task).
_current_turn: contextvars.ContextVar[_Turn | None] = contextvars.ContextVar(
    "aiodist_mpi_turn", default=None
)

# In the task whose cross-worker operation finished after that task was cancelled,
# what the operation failed with (its message: no traceback kept), if it failed
# losing the order (a timeout): a merge_fn cancelled at its timeout then names the
# workers it waited for (_WorkerGroup._merged), not only its own slowness.
_failed_after_cancel: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "aiodist_mpi_failed_after_cancel", default=None
)


class _Posted(NamedTuple):
    """One header exchange in flight: this worker's header, the peers' buffers, the
    future and per-request marks from ``_Progress``, and the send buffer (kept
    alive until the sends complete)."""

    mine: dict
    peers: list
    received: dict
    future: concurrent.futures.Future
    marks: list
    send: np.ndarray


class World:
    """The workers of one job: rank, size, each worker's replicas, the order.

    ``counts[w]`` is how many replicas worker ``w`` holds; its replicas' global
    ids start at ``offsets[w]``.
    """

    def __init__(
        self,
        local_replicas: int,
        kind: str,
        timeout: float | None,
        failure: str | None = None,
        gpus: Sequence[str] = (),
    ):
        self.MPI = MPI = import_mpi()
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.size = MPI.COMM_WORLD.Get_size()
        self.counts: list[int] = []  # known once every worker has said
        self.order = 0  # cross-worker operations issued so far
        # Asynchronous operations begun and not finished (operate()): what each is.
        self._operations: list[str] = []
        # The data steps' turns (take_turn): the order number whose turn it is, the
        # numbers done out of turn, and the operations waiting for theirs.
        self._next_turn = 1
        self._released: set[int] = set()
        self._turn_waiters: dict[int, asyncio.Future] = {}
        self.broken: RendezvousError | None = None
        # Runs started on this worker (each is numbered as its turn comes, whether it
        # makes a cross-worker call or not: every worker makes the same runs, so a
        # number is the same run on every worker): its headers hold that number. A
        # failure header of a run numbered further than this worker's count (workers
        # whose runs differ) moves the count on.
        self.runs = 0
        # Runs known failed on every worker (a failure header sent or received, a
        # mismatch every worker saw): such a run has nothing left to tell, and a
        # header of it that a peer sent is stale (see _agreed). Each with where it
        # became known failed: the order number of the place that told it (its
        # failure header's, a mismatch's). A place is classified from what the
        # places before it told, which every worker knows alike (see _agreed).
        # Forgotten once no header of the run can still come (forget_failed_runs).
        self.failed_runs: dict[int, int] = {}
        # The runs this worker may still post a header of, each with how many hold
        # it: the run while its _Run is referenced (in flight, or by a task it
        # started that outlives it, whose calls are of that run: _run_now), and
        # each operation it started while that is in flight (operate), as it may
        # still post. Every header says the lowest run its sender may still post a
        # header of ("low", see _low); _peer_lows keeps, for each peer, the places
        # where its low rose: (place, low), in place order.
        self._holders: dict[int, int] = {}
        # The numbers of runs whose _Run was collected, to let go of (see begin_run).
        self._collected: list[int] = []
        self._peer_lows: dict[int, collections.deque] = {}
        # The places this worker posted a header at whose peers' headers are not
        # read yet (_headers reads them): the lowest is where forget_failed_runs
        # stops, the places before it being classified for good.
        self._unread: set[int] = set()
        # Operations finishing for nobody, each with what it keeps alive (operate).
        self._background: dict[asyncio.Task, object] = {}
        # Operations finishing after their caller was cancelled wait on these too:
        # done when a run becomes known failed (see _finish_cancelled).
        self._failure_news: list[asyncio.Future] = []
        # After a run failed, or ended here while it may have failed on another
        # worker (run_ended), stale headers may follow (see _agreed): until one
        # exchange completes without one (``_probe``, done when it ends), exchanges
        # are posted one at a time, so each one found stale is made again before
        # the next is posted, and no later one meets the place it should have had.
        self._recovering = False
        self._probe: asyncio.Future | None = None
        self._told: list = []  # abort messages sent (their buffers)
        # Exchanges nobody waits for (failure headers, exchanges given up) until their
        # peers' headers are read and their sends done (_read_unread), the order
        # numbers of those read, and what a failure header found there said, by run
        # (forgotten with failed_runs).
        self._pending: list[_Posted] = []
        self._read: set[int] = set()
        self._failures: dict[int, str] = {}
        self.closed = False
        self.stall_warning_seconds: float | None = None  # the strategy's, once it is built
        self._progress = _Progress()
        self._last_receive: dict[int, _Receive] = {}  # each peer's latest header receive
        self.comm = None
        self.comm = self._private_comm(timeout)
        self._watch_aborts()
        # Start-up: every worker says how many replicas of which kind it holds, or
        # why it could not build its strategy (``failure``): then every worker
        # raises, instead of the others waiting for it. A worker that never gets
        # here is named when the timeout expires.
        headers = self.agree_now(
            "starting MultiWorkerMirroredStrategy",
            "start",
            timeout,
            replicas=local_replicas,
            kind=kind,
            failure=failure,
            gpus=list(gpus),
        )
        self.counts = [int(h["replicas"]) for h in headers]
        if failure is not None:
            return  # the caller raises its own error (and closes this)
        try:
            self._check_start(headers)
        except DeviceError:  # refused on every worker: its thread and communicator end
            self.close()
            raise
        self.offsets = [sum(self.counts[:w]) for w in range(self.size)]
        self.total = sum(self.counts)

    @staticmethod
    def _check_start(headers: list[dict]) -> None:
        """Refuse (``DeviceError``) what every worker's start-up header says cannot
        work together, on every worker alike."""
        failed = [(w, h["failure"]) for w, h in enumerate(headers) if h["failure"]]
        if failed:
            raise DeviceError(
                "MultiWorkerMirroredStrategy could not start: "
                + "; ".join(f"worker {w} failed with {text}" for w, text in failed)
                + ". Every worker must be able to build it."
            )
        kinds = [h["kind"] for h in headers]
        if len(set(kinds)) > 1:
            # NCCL (GPU) and MPI (CPU) collectives cannot meet: refuse on every worker.
            raise DeviceError(
                "workers hold replicas of different kinds ("
                + ", ".join(f"worker {w}: {k}" for w, k in enumerate(kinds))
                + "); every worker's replicas must be all CPU or all GPU."
            )
        users: dict[str, list[int]] = {}
        for w, h in enumerate(headers):
            for gpu in h["gpus"]:
                users.setdefault(gpu, []).append(w)
        shared = {gpu: ws for gpu, ws in users.items() if len(ws) > 1}
        if shared:
            # NCCL serves one rank per GPU: it would fail or wait inside groupEnd.
            raise DeviceError(
                "workers share GPUs ("
                + "; ".join(f"{gpu} by workers {ws}" for gpu, ws in shared.items())
                + "); give every worker GPUs of its own, for example "
                "devices_per_worker=[f'GPU:{local_rank}']."
            )

    def _private_comm(self, timeout: float | None) -> Any:
        """A duplicate of ``COMM_WORLD``, so our messages never meet the program's
        own. Duplicating is collective: a worker that never builds its strategy
        makes it time out (naming no one: MPI does not say who is missing)."""
        made: list = []

        def start() -> list:
            comm, request = self.MPI.COMM_WORLD.Idup()
            made.append(comm)
            return [request]

        future, _marks = self._progress.submit(start)
        if not self._wait_now(future, timeout):
            raise self._break(
                RendezvousTimeoutError(
                    f"starting MultiWorkerMirroredStrategy: timed out after {timeout:g} s "
                    f"waiting for the other workers ({self.size} in this job): at least one "
                    "never started building its strategy. Every worker must build it at the "
                    "same point of the program."
                )
            )
        return made[0]

    def refuse_close(self, running: bool) -> None:
        """``InvalidArgumentError`` if a cross-worker operation (or a run: ``running``)
        of this worker is in flight: closing would leave it waiting until its
        timeout, and the other workers waiting for its next step."""
        if self.closed or not (self._operations or running):
            return
        busy = [*self._operations] or ["a strategy.run"]
        raise InvalidArgumentError(
            f"strategy.close() was called while {len(busy)} cross-worker operation(s) of "
            f"this worker are in flight ({'; '.join(busy)}); the other workers wait for "
            "their next steps. Await them (or cancel them) first, then close the "
            "strategy on every worker; one a failed or cancelled run left behind "
            "finishes on its own, within timeout_seconds."
        )

    def close(self) -> None:
        """End the communication thread and free the private communicator (unless
        the order is lost: then MPI calls may block, and the job ends anyway).
        Later cross-worker calls raise. Idempotent. Operations still in flight (a
        dropped strategy's, or at exit) fail with the closed error."""
        if self.closed:
            return
        self.closed = True
        waiters, self._turn_waiters = self._turn_waiters, {}
        for waiter in waiters.values():
            _fail_soon(waiter, _closed_error)
        watches = self._progress._watches
        comm = self.comm

        def finish(idle: bool) -> None:
            if not idle or self.broken is not None or comm is None:
                return
            for _worker, request, _buffer in watches:  # the abort receives
                request.Cancel()
                request.Wait()
            comm.Free()

        self._progress.close(finish, 0 if self.broken is not None else _CLOSE_WAIT_SECONDS)

    def _watch_aborts(self) -> None:
        """A receive from every peer for its abort message (``_break``)."""
        comm, BYTE = self.comm, self.MPI.BYTE
        peers = [w for w in range(self.size) if w != self.rank]

        def start() -> list:
            posted = []
            for w in peers:
                buffer = np.zeros(_ABORT_BYTES, np.uint8)
                request = comm.Irecv([buffer, BYTE], source=w, tag=_ABORT_TAG)
                posted.append((w, request, buffer))
            return posted

        self._progress.watch(start)

    def _run_failed(self, run: int | None, place: int) -> None:
        """Run ``run`` failed, as the place of order number ``place`` told."""
        if run is None:
            return
        if run not in self.failed_runs:
            self._recovering = True
        self.failed_runs[run] = min(place, self.failed_runs.get(run, place))
        for news in self._failure_news:  # (operations finishing may be given up now)
            _release(news)

    def run_ended(self) -> None:
        """A run ended on this worker without failing. Another worker's run may still
        have failed after its last cross-worker call: its failure header then takes
        the place of this worker's next exchange, which is stale (see ``_agreed``).
        Exchanges posted beside that one would each meet the peers' exchange made
        one place earlier: a mismatch, or two ``strategy.reduce`` of one shape
        silently pairing the wrong values. So the next exchange is posted alone
        (``_recovering``): only the first of a run's overlapped collectives waits,
        for one header exchange."""
        if self.size > 1:
            self._recovering = True

    def _failed_before(self, run: int | None, place: int) -> bool:
        return run is not None and self.failed_runs.get(run, math.inf) < place

    def begin_run(self, run: _Run) -> int:
        """Number ``run``, whose turn has come, and hold it while anything can still
        make a call of it: until the ``_Run`` is collected, which is after it ends
        (its ``strategy.run`` holds it until then), and later if a task it started
        outlives it (that task's calls are of it: ``_run_now``). (Its ``__del__``
        may run on another thread, the garbage collector's: it only appends to
        ``_collected``, which the loop's thread drains, see ``_low``.)"""
        self.runs += 1
        number = run.number = self.runs
        self._hold(number)  # (let go by _Run.__del__)
        return number

    def end_run(self, run: _Run) -> None:
        """``run`` has ended (called once, after ``begin_run``; it stays held until
        collected, see there): the failed runs no header can still be classified
        against are forgotten, and its end is set, whatever happens (the runs after
        it wait for it)."""
        try:
            self.forget_failed_runs()
        finally:
            run.ended.set_result(None)

    def _hold(self, run: int) -> None:
        self._holders[run] = self._holders.get(run, 0) + 1

    def _let_go(self, run: int) -> None:
        left = self._holders.pop(run) - 1
        if left:
            self._holders[run] = left

    def _run_now(self) -> int | None:
        """The run a header posted now is of: the calling operation's (``operate``),
        else that of the run the caller belongs to (also from a task the run
        started, once the run has ended: which run it is must not depend on when
        the run ended on each worker), else None (outside any run)."""
        turn = _current_turn.get()
        if turn is not None:
            return turn.run
        current = _current_run.get()
        return None if current is None else current.number  # (set once numbered)

    def _low(self) -> int:
        """The lowest run number this worker may still post a header of: its lowest
        held run's, else the next run's. Runs are numbered upwards and one is held
        only from its start, so it never goes down."""
        collected = self._collected
        while collected:  # (runs collected since: pop is atomic, appends may race)
            self._let_go(collected.pop())
        return min(self._holders, default=self.runs + 1)

    def forget_failed_runs(self) -> None:
        """Forget the failed runs no header can still be classified against, so a
        long-lived server whose runs fail now and then keeps a few entries, not one
        per failure (and no ``_failures`` text); and the peers' lows that no longer
        matter, so that it keeps a few of those too, whether runs fail or not (a
        peer's low rises with each of its runs). Called as each run ends.

        Let ``first`` be the lowest place this worker posted a header at whose
        peers' headers are not read yet (``_unread``: an exchange in flight, one of
        ``_pending``), or the next place: every place before it is classified for
        good, and every header at ``first`` or later is one no lookup has met yet.
        A peer's carries a run of at least the ``low`` its last header before
        ``first`` said (a peer posts its headers in place order, and never one of a
        run below a low it sent): of each peer's lows, that one and those after it
        are all that is kept. This worker's headers carry a run of at least its
        own ``_low()``. Lookups by run number are of those headers' runs, or of
        this worker's live runs. So a run below all of these is never looked up
        again: forgotten, nothing can change."""
        self._read_unread(math.inf)
        first = min(self._unread, default=self.order + 1)
        floor = self._low()
        for worker in range(self.size):
            if worker == self.rank:
                continue
            stairs = self._peer_lows.get(worker)
            while stairs and len(stairs) > 1 and stairs[1][0] < first:
                stairs.popleft()  # (``first`` never goes down: not needed again)
            low = stairs[0][1] if stairs and stairs[0][0] < first else 0
            floor = min(floor, low)
        for runs in (self.failed_runs, self._failures):
            if runs:
                for run in [r for r in runs if r < floor]:
                    del runs[run]

    def who(self, worker: int) -> str:
        if not self.counts:  # during start-up
            return f"worker {worker}"
        return f"worker {worker} ({_span(self.offsets[worker], self.counts[worker])})"

    def _usable(self) -> None:
        if self.closed:
            raise _closed_error()
        aborted = self._progress.aborted
        if aborted is not None and self.broken is None:
            self._break(_abort_error(aborted), tell=False)
        if self.broken is not None:
            raise self._broken_error()

    def _broken_error(self) -> RendezvousError:
        assert self.broken is not None
        return type(self.broken)(
            f"a cross-worker operation failed earlier ({self.broken}); the workers' "
            "order of operations is lost, so no further cross-worker call can be "
            "matched. Stop every worker and restart the job."
        )

    @property
    def in_flight(self) -> int:
        return len(self._operations)

    async def operate(
        self, what: str, body: Callable[[], Awaitable[Any]], owner: object = None
    ) -> Any:
        """``await body()``, an asynchronous cross-worker operation (headers, then
        data), in a task of its own. From this call on the operation is in flight,
        so that a synchronous one (or ``close()``) cannot come in the middle of it;
        it gets its turn for the data step (``take_turn``).

        Cancelled (its run failed: a replica raised, or the run was cancelled) once
        it has posted its header, it is not given up: the other workers may have
        matched that header and wait in its data step. It finishes first, with this
        worker's data (its exchange, then every data step; each bounded by the
        timeout), its result thrown away, and only then is the cancellation raised:
        so the run that failed (it waits for its collectives' tasks) ends with
        nothing of it in flight, the run's failure header follows it in the order,
        and a synchronous cross-worker call made right after the run is not refused
        on this worker while the others make it. Cancelled before, nothing of it was
        sent: it is cancelled at once. Cancelled again while it finishes (the
        loop's shutdown, a caller that will not wait), it is left to finish in the
        background; ``owner`` (its strategy) is kept alive until then: collected,
        the strategy would close this world under it, and the others would wait in
        its data step until their timeout."""
        turn = _Turn(self._run_now())
        self._operations.append(what)
        if turn.run is not None:
            self._hold(turn.run)  # (its headers are of that run, even once it ended)

        async def run_it() -> Any:
            _current_turn.set(turn)  # (in the task's own context)
            # Nor the run itself: the turn says which run its headers are of, and a
            # kept traceback of the caller's failure holds this task (through this
            # frame), whose context would hold the run for forgetting for ever (see
            # World.begin_run).
            _current_run.set(None)
            return await body()

        def ended(_: object = None) -> None:  # (also where the task never started)
            self._operations.remove(what)
            if turn.ticket is not None:
                self._release(turn.ticket)
            if turn.run is not None:
                self._let_go(turn.run)

        try:
            task = asyncio.ensure_future(run_it())
        except BaseException:
            ended()
            raise
        task.add_done_callback(ended)  # (before the caller's: it is out of flight first)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                await self._finish_cancelled(task, turn)
            except asyncio.CancelledError:  # cancelled again: it finishes on its own
                self._background[task] = owner
                task.add_done_callback(functools.partial(self._finished_after_failing, what))
                raise
            self._finished_after_failing(what, task)
            failure = None if task.cancelled() else task.exception()
            if isinstance(failure, RendezvousError) and not isinstance(failure, ReplicaExitedError):
                _failed_after_cancel.set(str(failure.args[0]))
            raise

    async def _finish_cancelled(self, task: asyncio.Task, turn: _Turn) -> None:
        """Wait for ``task``, an operation whose caller was cancelled, to end. It is
        cancelled where nobody can wait for its data step: it posted no header yet,
        or its header exchange, not agreed yet, is of a run known failed on every
        worker before its place (``_given_up`` then leaves the exchange to complete
        on the thread, and the order is kept; waiting for it would wait for the
        other workers' next call, which may never come). Such a run may become
        known failed while it waits (``_run_failed`` wakes it)."""
        loop = asyncio.get_running_loop()
        while not task.done():
            ticket = turn.ticket
            if ticket is None or (not turn.agreed and self._failed_before(turn.run, ticket)):
                task.cancel()
                await asyncio.wait([task])
                return
            news = loop.create_future()
            self._failure_news.append(news)
            try:
                await asyncio.wait([task, news], return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._failure_news.remove(news)

    def _finished_after_failing(self, what: str, task: asyncio.Task) -> None:
        """``task``, an operation finished after its caller was cancelled, has ended."""
        self._background.pop(task, None)
        if task.cancelled():
            return
        # Its caller was cancelled, so its error is nobody's to raise; said once on
        # the logger instead (a timeout or a lost peer there also lost the order,
        # which the next cross-worker call raises, if any: the program may end
        # first). A ReplicaExitedError says only that it was given up, its run
        # having failed on every worker, with the order kept: nothing to report.
        exc = task.exception()
        if exc is not None and not isinstance(exc, ReplicaExitedError):
            _stall.logger.warning(
                "%s, finished after its run failed (or it was cancelled), failed "
                "on worker %d: %s: %s",
                what,
                self.rank,
                type(exc).__name__,
                exc,
            )

    async def take_turn(self, what: str) -> None:
        """Wait until every operation before this one in the order (its header's
        order number) has made its data step's MPI (or NCCL) calls and finished.
        Operations overlap (a replica may start a collective and await it later,
        or ``asyncio.gather`` two ``strategy.reduce``), and their headers may agree
        in any order on each worker; MPI matches collectives by the order they are
        issued in, so their data steps follow the order of their headers."""
        turn = _current_turn.get()
        if turn is None or turn.held or turn.ticket is None:
            return
        if self._next_turn != turn.ticket:
            waiter = asyncio.get_running_loop().create_future()
            self._turn_waiters[turn.ticket] = waiter
            try:
                await waiter
            except asyncio.CancelledError:
                self._turn_waiters.pop(turn.ticket, None)
                self._lost(what, "was cancelled while waiting for its turn to move its data")
                raise
        turn.held = True
        self._usable()  # (the order may have been lost, or the strategy closed, meanwhile)

    def _release(self, ticket: int) -> None:
        """Order number ``ticket`` has made its data step (or has none): the next
        operation may make its own."""
        self._released.add(ticket)
        while self._next_turn in self._released:
            self._released.discard(self._next_turn)
            self._next_turn += 1
        waiter = self._turn_waiters.pop(self._next_turn, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @contextlib.contextmanager
    def issuing(self, what: str) -> Any:
        """Around NCCL calls issued after the headers agreed: the other workers have
        issued theirs and their GPUs wait for this worker's ranks, so a failure
        here (out of memory, an NCCL error) loses the order for good."""
        try:
            yield
        except BaseException as exc:
            self._lost(what, f"failed after every worker had agreed to it ({exc!r})")
            raise

    # -- waiting (on the loop, or on a synchronous caller's thread) --------------------

    async def _wait(
        self,
        future: concurrent.futures.Future,
        what: str,
        timeout: float | None,
        missing: Callable[[], list[int]] | None = None,
        cancelled: Callable[[str], None] | None = None,
    ) -> bool:
        """Whether ``future`` completed within ``timeout``; re-raises its error.
        ``missing()``: the workers not heard from yet (a header exchange's), for
        stall reports; None in a data step, where every worker had arrived."""
        loop = asyncio.get_running_loop()
        waiter = asyncio.wrap_future(future, loop=loop)
        started = loop.time()
        deadline = math.inf if timeout is None else started + timeout
        # Stall reports (SPEC 11): one, after stall_warning_seconds, as the local
        # watchdog's; it never fails the call.
        warn_after = self.stall_warning_seconds
        try:
            while not waiter.done() and loop.time() < deadline:
                report = math.inf if warn_after is None else started + warn_after
                await _until(loop, waiter, min(deadline, report))
                if not waiter.done() and loop.time() >= report:
                    _stall.logger.warning(self._stall_report(what, loop.time() - started, missing))
                    warn_after = None  # reported: once per wait
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled(what)
            else:
                self._lost(what, "was cancelled while waiting for the other workers")
            raise
        if waiter.done():
            self._result(waiter.result)
            return True
        return False

    def _stall_report(self, what: str, waited: float, missing: Any) -> str:
        if missing is None:
            where = (
                f"every worker ({', '.join(self.who(w) for w in range(self.size))}) arrived; "
                "the data step waits for the others' MPI calls"
            )
        else:
            gone = missing()
            here = [w for w in range(self.size) if w not in gone]
            where = (
                f"{', '.join(self.who(w) for w in here)} arrived, "
                f"{', '.join(self.who(w) for w in gone) or 'no worker'} missing"
            )
        return (
            f"{what} has waited {waited:.1f} s for the other workers: {where}. This is a "
            "warning, not an error; set CommunicationOptions(timeout_seconds=...) to fail "
            "sooner, or stall_warning_seconds=None to silence it."
        )

    def _wait_now(self, future: concurrent.futures.Future, timeout: float | None) -> bool:
        try:
            self._result(lambda: future.result(timeout))
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _result(self, result: Callable[[], Any]) -> None:
        """``result()``; a peer's abort breaks this worker's order too."""
        try:
            result()
        except RendezvousError as exc:
            if self._progress.aborted is not None:
                raise self._break(exc, tell=False) from None
            raise

    # -- the header exchange -----------------------------------------------------------

    def _post_headers(self, what: str, key: str, extra: dict, run: int | None = None) -> _Posted:
        self._usable()
        if len(key) > 512:  # long structures: their digest is what must agree
            key = hashlib.sha256(key.encode()).hexdigest()
        if run is None:
            run = self._run_now()
        mine = {
            "order": self.order + 1,
            "what": _short(what, 2000),
            "key": key,
            "run": run,
            "low": self._low(),
        }
        mine.update(extra)
        # Headers have any length (a long list's shapes): each is sent as it is, and
        # received at the length a probe finds. No worker refuses a header another
        # accepts (a fixed limit did, where shapes differ between workers).
        send = np.frombuffer(json.dumps(mine).encode(), np.uint8)
        self.order += 1
        self._unread.add(self.order)
        MPI, comm = self.MPI, self.comm
        peers = [w for w in range(self.size) if w != self.rank]
        received = {w: _Receive(comm, MPI, w, self._last_receive.get(w)) for w in peers}
        self._last_receive.update(received)

        def start() -> list:  # receives first: marks[i] for i < len(peers) are theirs
            sends = [comm.Isend([send, MPI.BYTE], dest=w, tag=_HEADER_TAG) for w in peers]
            return [*received.values(), *sends]

        future, marks = self._progress.submit(start)
        return _Posted(mine, peers, received, future, marks, send)

    def _headers(self, mine: dict, received: dict) -> list[dict]:
        headers = {self.rank: mine}
        place = mine["order"]
        self._unread.discard(place)
        for worker, receive in received.items():
            headers[worker] = header = json.loads(bytes(receive.buffer))
            # Where its low rose (forget_failed_runs). A place read after a later
            # one is left out: its low is at most that one's, so the lows kept are
            # never above a place's own (a forgotten run is only ever one too few).
            stairs = self._peer_lows.setdefault(worker, collections.deque())
            if not stairs or (place > stairs[-1][0] and header["low"] > stairs[-1][1]):
                stairs.append((place, header["low"]))
        return [headers[w] for w in range(self.size)]

    def _check(self, headers: list[dict], what: str) -> None:
        # The run too: a cross-replica call's key has none (a collective's has), and
        # a merge_fn's strategy.reduce in one worker's run would otherwise pair with
        # a strategy.reduce outside any run on another, silently.
        if len({(h["order"], h["key"], h["run"]) for h in headers}) == 1:
            return
        mine = headers[self.rank]
        self._run_failed(mine["run"], mine["order"])  # (every worker sees this mismatch)
        seen = "; ".join(
            f"{self.who(w)}: {h['what']} (cross-worker operation #{h['order']})"
            for w, h in enumerate(headers)
        )
        # Calls that read alike can still differ in what must agree (a variable's
        # shape or dtype, an all_reduce's bytes_per_pack): then each one's key says it.
        keys_by_text: dict[tuple, set] = {}
        for h in headers:
            keys_by_text.setdefault((h["what"], h["order"]), set()).add(h["key"])
        alike = [w for w, h in enumerate(headers) if len(keys_by_text[h["what"], h["order"]]) > 1]
        if alike:
            seen += (
                ". Where the calls read alike, what each must agree on differs ("
                + "; ".join(f"{self.who(w)}: {headers[w]['key']}" for w in alike)
                + ")"
            )
        runs = [h["run"] for h in headers]
        if len(set(runs)) > 1:
            # Every run is numbered, those making no cross-worker call too.
            seen += (
                ". The workers are at different runs ("
                + ", ".join(
                    f"{self.who(w)}: " + ("outside any run" if r is None else f"run {r}")
                    for w, r in enumerate(runs)
                )
                + "): every worker must make the same strategy.run calls, those that "
                "make no cross-worker call included; runs made on one worker only (a "
                "Batcher serving each worker's own requests) need a strategy of their own"
            )
        raise CollectiveMismatchError(
            f"workers disagree on cross-worker operation #{mine['order']}: {seen}. Every "
            "worker must make the same collective calls, with the same shapes and dtypes, "
            "in the same order (runs on one strategy are serialised; cross-replica "
            "calls count in the same sequence)."
        )

    def _break(self, error: RendezvousError, tell: bool = True) -> RendezvousError:
        """Record that the cross-worker order is lost; tell every peer (``tell``),
        whose operations in flight then fail at once instead of at their timeout;
        at exit, abort the job.

        MPI cannot finish cleanly with a peer that died or stopped (``MPI_Finalize``
        would wait for it forever), so the process ends the job with
        ``MPI_Abort`` once the program is done reporting the error.
        """
        if self.broken is None:
            atexit.register(self._abort)
            if tell and self.comm is not None and self._progress.aborted is None:
                self._tell_abort(error)
        self.broken = error
        # Operations queued for their data step's turn would each wait for the one
        # before it, then its own timeout (N x timeout): they fail now.
        waiters, self._turn_waiters = self._turn_waiters, {}
        for waiter in waiters.values():
            _fail_soon(waiter, lambda: self._broken_error())
        return error

    def _tell_abort(self, error: RendezvousError) -> None:
        text = f"{type(error).__name__}:{_short(str(error.args[0]), _ABORT_BYTES - 100)}"
        send = np.zeros(_ABORT_BYTES, np.uint8)
        data = text.encode()[: _ABORT_BYTES - 1]
        send[: len(data)] = np.frombuffer(data, np.uint8)
        comm, BYTE = self.comm, self.MPI.BYTE
        peers = [w for w in range(self.size) if w != self.rank]
        self._told.append(send)  # (kept alive until the job ends: the peer may be gone)
        self._progress.submit(
            lambda: [comm.Isend([send, BYTE], dest=w, tag=_ABORT_TAG) for w in peers]
        )

    def _abort(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        # The other workers hit the same timeout at about the same time: give them
        # a moment to report it themselves before the job ends.
        time.sleep(_ABORT_GRACE_SECONDS)
        self.MPI.COMM_WORLD.Abort(1)

    def _missing(self, what: str, timeout: float | None, peers: list, marks: list) -> None:
        missing = [w for i, w in enumerate(peers) if not (marks and marks[i])]
        arrived = [w for w in range(self.size) if w not in missing]
        raise self._break(
            RendezvousTimeoutError(
                f"{what}: timed out after {timeout:g} s waiting for "
                f"{', '.join(self.who(w) for w in missing) or 'no worker'}; "
                f"{', '.join(self.who(w) for w in arrived)} arrived. A worker that died, is "
                "stuck, or is calling something else never arrives; raise "
                "CommunicationOptions(timeout_seconds=...) if they are just slow."
            )
        )

    def _stalled(self, what: str, timeout: float | None) -> None:
        # Every worker had sent its header, so a worker that never completes the data
        # step died or gave up (its own timeout) after that.
        raise self._break(
            RendezvousTimeoutError(
                f"{what}: timed out after {timeout:g} s while the data moved between workers: "
                "every worker had arrived, but one stopped since (it died, or timed out "
                "waiting for this worker). Stop every worker and restart the job."
            )
        )

    async def agree(self, what: str, key: str, timeout: float | None, **extra: Any) -> list:
        """Every worker's header for the next cross-worker operation, once all agree.
        Where a peer's header at that place was stale (of a run that failed), the
        exchange is made again at the next place."""
        turn = _current_turn.get()
        run = self._run_now()
        self._read_unread(math.inf)
        if run is not None and run in self.failed_runs:
            # (a header of it would only be stale for the others)
            raise ReplicaExitedError(self._dead(what, run))
        while self._probe is not None:  # one exchange at a time after a failed run
            await asyncio.shield(self._probe)
        probe = None
        if self._recovering:
            probe = self._probe = asyncio.get_running_loop().create_future()
        try:
            return await self._agree(what, key, timeout, extra, turn)
        finally:
            if probe is not None:
                self._probe = None
                probe.set_result(None)

    async def _agree(
        self, what: str, key: str, timeout: float | None, extra: dict, turn: _Turn | None
    ) -> list:
        while True:
            posted = self._post_headers(what, key, extra)
            order = posted.mine["order"]
            if turn is not None and turn.ticket is None:
                turn.ticket = order  # released when the operation ends
            else:
                self._release(order)

            def missing(posted: _Posted = posted) -> list[int]:
                marks = posted.marks
                return [w for i, w in enumerate(posted.peers) if not (marks and marks[i])]

            arrived = await self._wait(
                posted.future, what, timeout, missing, functools.partial(self._given_up, posted)
            )
            headers = self._agreed(posted, arrived, what, timeout)
            if headers is not None:
                if turn is not None and turn.ticket == order:
                    turn.agreed = True  # (its data step follows: never given up now)
                return headers
            if turn is not None and turn.ticket == order:  # (no data step at this place)
                turn.ticket = None
                self._release(order)
            run = posted.mine["run"]
            if run is not None and run in self.failed_runs:
                # Its run failed since this exchange was posted (this worker's failure
                # header, or a peer's, already took a later place): it posts no more.
                raise ReplicaExitedError(self._dead(what, run))

    def _given_up(self, posted: _Posted, what: str) -> None:
        """``posted``'s wait was cancelled (``operate`` cancels an operation that
        posted its header only where its run failed on every worker before its
        place; otherwise its own task was, at the loop's shutdown). If its run had
        failed on every worker before this place, each of them takes this place as
        stale (``_agreed``): the exchange is left to complete on the thread, and
        the order is kept. Otherwise (its run failed later, or not at all: a
        collective finishing for a run that failed after it was posted) the others
        may have matched it and wait for its data step: the order is lost, and
        they are told at once."""
        if self._failed_before(posted.mine["run"], posted.mine["order"]):
            self._pending.append(posted)
        else:
            self._lost(what, "was cancelled while waiting for the other workers")

    def agree_now(self, what: str, key: str, timeout: float | None, **extra: Any) -> list:
        """``agree`` for synchronous code (creating a variable, reading a sync-on-read
        one): the same exchange, waited for on the caller's thread."""
        if self.in_flight:
            # Its next step needs the loop this call blocks: the other workers would
            # wait for that step while this worker waits for them, until the timeout.
            raise InvalidArgumentError(
                f"{what}: a synchronous cross-worker call was made while {self.in_flight} "
                "asynchronous one(s) of this worker are in flight (a strategy.run, "
                "strategy.reduce or gather not yet finished). Make it between them, or "
                "inside merge_fn, at the same point on every worker."
            )
        while True:
            posted = self._post_headers(what, key, extra)
            self._release(posted.mine["order"])  # nothing is in flight: its turn is now
            arrived = self._wait_now(posted.future, timeout)
            headers = self._agreed(posted, arrived, what, timeout)
            if headers is not None:
                return headers

    def _agreed(
        self, posted: _Posted, arrived: bool, what: str, timeout: float | None
    ) -> list | None:
        """Every worker's header, after checking they all came and agree; None where
        this place was stale for this worker (the caller exchanges again).

        A run that failed (``failed_runs``) leaves headers behind on the others: its
        failure header, which takes the run's next place and is never read back by
        its sender, and the headers of its exchanges that were in flight where
        the others learned of the failure first. Every worker sees the same
        headers at a place, and a place is classified only from the failures the
        places before it told (``failed_runs``: a failure header's place, a
        mismatch's), which every worker knows alike; so all classify it alike (an
        exchange this worker posted before its own run failed, which the others
        matched, still agrees, and makes its data step: ``operate``):

        - a failure header for this worker's run in flight (or a run it never
          numbered) fails that run: ``ReplicaExitedError``, naming the worker;
          one for a later run (the peer ended this run and failed its next) fails
          it too, and marks that later run failed without counting it here: this
          worker's run of that number raises at its first cross-worker call;
        - a failure header for a run this worker already finished, or any header
          of a failed run that is not this worker's, is stale: the place is
          consumed, and the exchange is made again at the next one, so the run
          numbers and places of every worker stay paired;
        - an exchange of this worker's own run, failed before this place, raises,
          whatever it met.
        """
        if not arrived:
            self._missing(what, timeout, posted.peers, posted.marks)
        self._read_unread(posted.mine["order"])
        headers = self._headers(posted.mine, posted.received)
        run, place = posted.mine["run"], posted.mine["order"]
        dead = self._failed_before(run, place)
        failed, stale = [], False
        for worker, header in enumerate(headers):
            if worker == self.rank:
                continue
            theirs = header.get("run")
            if header.get("failed"):
                said = self._peer_failed(worker, theirs, place, header["failed"])
                if run is not None and theirs > run:
                    # The peer ended run ``run`` and failed its next one before this
                    # worker's run ``run`` made this call: this worker has not started
                    # that one. Not counted (as in _read_unread): its run of that
                    # number raises at its first cross-worker call, naming the peer.
                    # Counted, this worker's next run would be numbered one further,
                    # and its runs would pair for good with the peer's next ones.
                    self._failures.setdefault(theirs, said)
                    if not dead:  # (a run already failed here raises as such, below)
                        failed.append(said)
                    continue
                self.runs = max(self.runs, theirs)  # (it made more runs than this one)
                if run is not None and theirs == run:
                    failed.append(said)
                else:
                    stale = True
            elif theirs != run and self._failed_before(theirs, place):
                stale = True
        if failed:
            self._run_failed(run, place)
            raise ReplicaExitedError(
                f"{what}: "
                + "; ".join(failed)
                + ". A run that fails on one worker fails on every worker (its next "
                "cross-worker call raises this); the workers' order of operations is kept, "
                "so the program may go on with its next run."
            )
        if dead:
            raise ReplicaExitedError(self._dead(what, run))
        if stale:
            return None
        self._recovering = False  # (no stale header follows a place without one)
        self._check(headers, what)
        return headers

    def _peer_failed(self, worker: int, run: int, place: int, text: str) -> str:
        """Peer ``worker``'s failure header at place ``place`` says its run ``run``
        failed (``text``: how): that run is failed here too (``_run_failed``).
        Returns what this worker's run of that number raises with."""
        self._run_failed(run, place)
        return f"{self.who(worker)} will not join it: {text}"

    def _dead(self, what: str, run: int) -> str:
        known = self._failures.get(run)
        if known is not None:  # met beside this worker's own failure header
            return (
                f"{what}: {known}. A run that fails on one worker fails on every worker; "
                "the workers' order of operations is kept, so the program may go on "
                "with its next run."
            )
        return (
            f"{what}: its run {run} already failed on every worker (see that run's "
            "first error), so this call of it is given up; the workers' order of "
            "operations is kept."
        )

    def _read_unread(self, before: float) -> None:
        """Read the peers' headers at the places of this worker's exchanges nobody
        waits for (``_pending``: its failure headers, exchanges given up) before
        ``before``. A peer's failure header can share such a place (two runs
        failed on two workers): every other worker saw it there, so this one must
        know that run failed too, or its own run of that number would meet the
        others' next run (a mismatch). Each peer's headers arrive in order, so
        once a later place's are in, these are. One read whose sends are done too
        has nothing left to keep: it is dropped."""
        if not self._pending:
            return
        for posted in self._pending:
            order = posted.mine["order"]
            count = len(posted.peers)
            marks = posted.marks[:count]  # (empty until the thread posts them)
            if order in self._read or order >= before or len(marks) < count or not all(marks):
                continue
            self._read.add(order)
            for worker, header in enumerate(self._headers(posted.mine, posted.received)):
                theirs = header.get("run")
                if worker != self.rank and header.get("failed") and theirs not in self.failed_runs:
                    # (not counted: this worker runs it still)
                    self._failures[theirs] = self._peer_failed(
                        worker, theirs, order, header["failed"]
                    )
        # (a read dropped takes its send buffer with it: MPI is done with it)
        keep = [p for p in self._pending if not (p.mine["order"] in self._read and p.future.done())]
        if len(keep) < len(self._pending):
            self._read.intersection_update(p.mine["order"] for p in keep)
            self._pending = keep

    def tell_failure(self, run: int, text: str) -> None:
        """This worker's run number ``run`` failed (``text`` says how): a *failure
        header* takes the run's next place in the order, where the other workers
        wait for (or will make) its next cross-worker call, and they raise naming
        this worker instead of waiting for it until their timeout (or, where they
        had finished that run, take the place as stale). Not waited for here: the
        peers' headers for that place need no check."""
        self._read_unread(math.inf)
        self._run_failed(run, self.order + 1)  # (the place its failure header takes)
        if self.broken is not None or self._progress.aborted is not None or self.size == 1:
            return
        if self.closed:
            return  # (the run's own error is raised, not the closed one)
        posted = self._post_headers("a failed run", "failed", {"failed": text}, run)
        self._release(posted.mine["order"])  # (no data step)
        self._pending.append(posted)

    def _lost(self, what: str, how: str) -> None:
        self._break(
            RendezvousError(
                f"{what} {how}; the other workers' order of operations can no longer be "
                "matched, so stop every worker and restart the job."
            )
        )

    async def _data(self, start: Callable[[], Any], what: str, timeout: float | None) -> None:
        self._usable()
        await self.take_turn(what)
        future, _marks = self._progress.submit(lambda: [start()])
        if not await self._wait(future, what, timeout):
            self._stalled(what, timeout)

    # -- data ---------------------------------------------------------------------------

    async def all_reduce(
        self, op: ReduceOp, buffer: np.ndarray, what: str, timeout: float | None
    ) -> np.ndarray:
        """``buffer`` (this worker's contiguous share) reduced with ``op`` across workers."""
        start, finish = self._all_reduce_call(op, buffer)
        await self._data(start, what, timeout)
        return finish()

    def _all_reduce_call(self, op: ReduceOp, buffer: np.ndarray) -> tuple:
        """(``start``: posts the ``Iallreduce``, ``finish``: its result) for ``buffer``.

        MIN and MAX of floats are not left to MPI: its MIN/MAX of NaN or of -0.0
        and 0.0 depends on the operand order and differs from NumPy's (a NaN was
        dropped on one worker and kept on another). Nor of complex values, which
        MPI's MIN/MAX do not take, and NumPy orders lexicographically (as one
        process reduces them). Every worker's share is gathered instead and
        folded with ``np.minimum``/``np.maximum`` in worker order, which gives one
        process's result over the replicas in order."""
        buffer = _native_order(buffer)
        if op in (ReduceOp.MIN, ReduceOp.MAX) and buffer.dtype.kind in "fc":
            share = np.array(buffer, order="C", copy=None).reshape(-1)
            every = np.empty((self.size, share.size), share.dtype)
            BYTE = self.MPI.BYTE
            raw, out = share.view(np.uint8), every.reshape(-1).view(np.uint8)

            def fold() -> np.ndarray:
                ufunc = np.minimum if op is ReduceOp.MIN else np.maximum
                total = every[0].copy()
                for row in every[1:]:
                    ufunc(total, row, out=total)
                return total.reshape(buffer.shape)

            return lambda: self.comm.Iallgather([raw, BYTE], [out, BYTE]), fold
        send, restore = _travel(buffer)
        out = np.empty_like(send)
        mpi_op = getattr(self.MPI, _MPI_OPS[op])
        return lambda: self.comm.Iallreduce(send, out, op=mpi_op), lambda: restore(out)

    async def all_gather_bytes(
        self, data: np.ndarray, sizes: Sequence[int], what: str, timeout: float | None
    ) -> list[np.ndarray]:
        """Every worker's bytes (``sizes[w]`` from worker ``w``), in worker order."""
        out = np.empty(sum(sizes), np.uint8)
        offsets = [sum(sizes[:w]) for w in range(self.size)]
        BYTE = self.MPI.BYTE
        await self._data(
            lambda: self.comm.Iallgatherv([data, BYTE], [out, list(sizes), offsets, BYTE]),
            what,
            timeout,
        )
        return [out[offsets[w] : offsets[w] + sizes[w]] for w in range(self.size)]

    def _data_now(self, start: Callable[[], Any], what: str, timeout: float | None) -> None:
        future, _marks = self._progress.submit(lambda: [start()])
        if not self._wait_now(future, timeout):
            self._stalled(what, timeout)

    def broadcast_now(
        self, array: np.ndarray, what: str, timeout: float | None, name: str | None = None
    ) -> np.ndarray:
        """Worker 0's ``array`` on every worker (synchronous; shapes must agree, and
        ``name``, what the value is of, where given: a variable's)."""
        key = _broadcast_key(array)
        if name is not None:
            key = f"{key} of {name!r}"
        self.agree_now(what, key, timeout)
        buffer, start = self._broadcast_call(array)
        self._data_now(start, what, timeout)
        return buffer

    async def broadcast(
        self,
        array: np.ndarray,
        what: str,
        timeout: float | None,
        owner: object = None,
        name: str | None = None,
    ) -> np.ndarray:
        """``broadcast_now`` without blocking the loop."""
        key = _broadcast_key(array)
        if name is not None:
            key = f"{key} of {name}"

        async def body() -> np.ndarray:
            await self.agree(what, key, timeout)
            buffer, start = self._broadcast_call(array)
            await self._data(start, what, timeout)
            return buffer

        return await self.operate(what, body, owner)

    def _broadcast_call(self, array: np.ndarray) -> tuple[np.ndarray, Callable[[], Any]]:
        """(the buffer that receives worker 0's bytes, ``start``: posts the ``Ibcast``)."""
        buffer = np.array(array, order="C", copy=True)
        raw = buffer.reshape(-1).view(np.uint8)
        return buffer, lambda: self.comm.Ibcast([raw, self.MPI.BYTE], root=0)

    def nccl_unique_id(self, timeout: float | None) -> bytes:
        """Worker 0's new NCCL unique id, on every worker (synchronous)."""
        from . import _cuda

        mine = _cuda.unique_id() if self.rank == 0 else bytes(128)
        raw = np.frombuffer(mine, np.uint8)
        return self.broadcast_now(raw, "the NCCL unique id", timeout).tobytes()

    def bounded(self, fn: Callable[[], Any], what: str, timeout: float | None) -> Any:
        """``fn()`` on a helper thread, waited for at most ``timeout``: for calls that
        wait for every worker inside a library (NCCL's ``groupEnd`` when creating
        ranks) and would wait forever for a worker that failed."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=call, name="aiodist-bounded", daemon=True).start()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self._break(
                RendezvousTimeoutError(
                    f"{what}: timed out after {timeout:g} s; a worker failed or is stuck "
                    "before joining it. Stop every worker and restart the job."
                )
            ) from None

    def all_reduce_now(
        self,
        op: ReduceOp,
        buffer: np.ndarray,
        what: str,
        timeout: float | None,
        name: str | None = None,
    ) -> np.ndarray:
        """``all_reduce`` for synchronous code, headers included (shapes must agree,
        and ``name``, what the value is of, where given: a variable's)."""
        buffer = _native_order(buffer)  # (as every worker's is, those of several copies)
        key = f"all_reduce {op.name} {buffer.dtype.str}{buffer.shape}"
        if name is not None:
            key = f"{key} of {name!r}"
        self.agree_now(what, key, timeout)
        start, finish = self._all_reduce_call(op, buffer)
        self._data_now(start, what, timeout)
        return finish()


def _broadcast_key(array: np.ndarray) -> str:
    return f"broadcast {array.dtype.str}{array.shape}"


def _native_order(array: np.ndarray) -> np.ndarray:
    """``array`` in this machine's byte order. A worker of one replica holds its
    share as given ('>f4', read from a file of a big-endian machine), which MPI's
    typed reductions refuse (mpi4py's BufferError); a worker combining several
    has it in native order already, as one process's reductions give it."""
    dtype = array.dtype
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def _travel(buffer: np.ndarray) -> tuple:
    """The array MPI reduces for ``buffer``, and how to turn the result back.

    MPI has no half floats and no MIN/MAX of C booleans: float16 travels as
    float32 and bool as uint8. (MIN and MAX of floats and complex values never
    come here: ``_all_reduce_call`` folds them itself.)
    """
    buffer = np.array(buffer, order="C", copy=None)  # (ascontiguousarray makes 0-d 1-d)
    kind = buffer.dtype
    if kind == np.float16:
        return buffer.astype(np.float32), lambda out: out.astype(np.float16)
    if kind == np.bool_:
        return buffer.view(np.uint8), lambda out: out.view(np.bool_)
    return buffer, lambda out: out


def local_devices(devices_per_worker: Any) -> tuple[Device, ...]:
    """The devices of this worker's replicas."""
    from ._strategy import _default_devices, _parse_devices

    if devices_per_worker is None:
        devices = _default_devices()
    elif isinstance(devices_per_worker, numbers.Integral) and not isinstance(
        devices_per_worker, bool | np.bool_
    ):  # (a NumPy int too: whole_number takes those, as every count argument does)
        count = whole_number(devices_per_worker, "devices_per_worker", 1)
        devices = tuple(Device("CPU", i) for i in range(count))
    elif isinstance(devices_per_worker, numbers.Number | np.bool_ | str | bytes):
        # (One machine's device-list message would leave out the count this takes,
        # and for a string suggest it in a list, or OneDeviceStrategy, even where
        # it is no device.)
        kind = type(devices_per_worker).__name__
        raise DeviceError(
            f"devices_per_worker={devices_per_worker!r} (of type {kind}); expected None "
            "(the default devices), an int k >= 1 (CPU devices cpu:0 ... cpu:k-1) "
            "or a list of device strings such as ['cpu:0', 'cpu:1'] or ['GPU:0']."
        )
    else:
        devices = _parse_devices(devices_per_worker, "devices_per_worker")
    return devices


# -- the strategy ------------------------------------------------------------------------

from . import _context  # noqa: E402  (the World above needs none of these)
from ._arrays import leaf_text, mean_of_sum, mean_operand  # noqa: E402
from ._backends import cpu_backend  # noqa: E402
from ._cross_device_ops import (  # noqa: E402
    NcclAllReduce,
    ReductionToOneDevice,
    _pack_indices,
    _split,
    resolve_destinations,
)
from ._options import CommunicationOptions  # noqa: E402
from ._rendezvous import Rendezvous  # noqa: E402
from ._replica_context import ARRAYS, AXIS, OP, OPTIONS  # noqa: E402
from ._scheduler import RunGroup  # noqa: E402
from ._strategy import (  # noqa: E402
    Strategy,
    StrategyExtended,
    _local_parts,
    ambiguous_reduction,
    run_options_refused,
)
from ._values import DistributedValues, PerReplica, refuse_structure  # noqa: E402

DEFAULT_TIMEOUT_SECONDS = 300.0


async def _reduce_leaves(
    world: World, op: ReduceOp, leaves: list, what: str, timeout: float | None
) -> list:
    """Each worker's (locally combined) ``leaves`` reduced across workers with ``op``
    (not MEAN: the caller divides), one MPI call per dtype."""
    out: list = [None] * len(leaves)
    for members in _pack_indices(leaves, 0):  # one pack per dtype
        if len(members) == 1:
            buffer = np.ascontiguousarray(leaves[members[0]]).reshape(-1)
        else:
            buffer = np.concatenate([np.asarray(leaves[i]).reshape(-1) for i in members])
        total = await world.all_reduce(op, buffer, what, timeout)
        for i, piece in zip(members, _split(total, [leaves[i] for i in members]), strict=True):
            out[i] = piece
    return out


async def _all_reduce_packs(
    world: World,
    ops: Any,
    op: ReduceOp,
    arrays: list[list],
    devices: Sequence[Device],
    options: CommunicationOptions,
    what: str,
) -> list:
    """This worker's replicas' leaves (``arrays[r][i]``) reduced over every worker's
    replicas, as host arrays. Each pack is combined over the local replicas by
    ``ops`` into one flat buffer, which goes to MPI as it is (one call per pack) and
    is cut into the leaves once, at the end."""
    local_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    if op is ReduceOp.MEAN:  # summed here, divided below: integers as float64
        arrays = [[mean_operand(leaf) for leaf in leaves] for leaves in arrays]
    leaves: list = [None] * len(arrays[0])
    for pack, split, reduced in ops._reduced_packs(local_op, arrays, devices, options):
        flat = np.asarray(reduced).reshape(-1)
        total = await world.all_reduce(local_op, flat, what, options.timeout_seconds)
        if op is ReduceOp.MEAN:
            total = mean_of_sum(np, total, world.total)
        for index, piece in zip(pack, split(total), strict=True):
            leaves[index] = piece
    return leaves


async def _gather_leaves(
    world: World, leaves: list, headers: list, axis: int, what: str, timeout: float | None
) -> list:
    """Each worker's (locally gathered) ``leaves`` concatenated along ``axis`` in
    worker order; the headers carry every worker's shapes."""
    data = [np.ascontiguousarray(leaf).reshape(-1).view(np.uint8) for leaf in leaves]
    mine = np.concatenate(data) if data else np.zeros(0, np.uint8)
    items = [leaf.dtype.itemsize for leaf in leaves]
    sizes = [
        sum(int(np.prod(shape)) * item for shape, item in zip(h["shapes"], items, strict=True))
        for h in headers
    ]
    blocks = await world.all_gather_bytes(mine, sizes, what, timeout)
    out = []
    offsets = [0] * world.size
    for index, leaf in enumerate(leaves):
        parts = []
        for worker, header in enumerate(headers):
            shape = tuple(header["shapes"][index])
            count = int(np.prod(shape)) * items[index]
            raw = blocks[worker][offsets[worker] : offsets[worker] + count]
            offsets[worker] += count
            parts.append(raw.view(leaf.dtype).reshape(shape))
        out.append(np.concatenate(parts, axis=axis))
    return out


class _WorkerGroup(RunGroup):
    """A run's local replicas; its collectives continue across workers."""

    @property
    def rendezvous(self) -> Rendezvous:
        """``RunGroup.rendezvous``, whose messages name this worker's replicas by
        their global ids (its local replica 0 is global replica
        ``strategy._replica_offset``), as ``replica_id_in_sync_group`` does: a
        message that reaches the other workers (a failure header) would otherwise
        name their replicas."""
        made = self._rendezvous is None
        rendezvous = RunGroup.rendezvous.fget(self)
        if made:
            rendezvous.first_id = self.strategy._replica_offset
        return rendezvous

    async def _merged(self, coro: Any, number: int, timeout: float | None) -> list:
        """``RunGroup._merged``; where merge_fn's timeout cancelled it in a
        cross-worker operation (a strategy.reduce, a variable's aggregated
        update) that then failed waiting for the other workers, the error names
        them, as that operation's own does: their timeouts are one, and merge_fn's
        started first, so it always expired first, blaming merge_fn's speed."""
        _failed_after_cancel.set(None)  # (in merge_fn's own context: none before it)
        try:
            return await super()._merged(coro, number, timeout)
        except RendezvousTimeoutError:
            failure = _failed_after_cancel.get()
            if failure is None or timeout is None:
                raise
        # (Raised outside the handler, as RunGroup._merged's: no __context__ held.)
        raise self._merge_timed_out(
            number, timeout, f" while it waited for the other workers: {failure}"
        )

    def _collective(self, number: int, signature: Any, payloads: list) -> Any:
        self._count_bytes(signature.name, payloads)
        return self._spawn(self._across_workers(number, signature, payloads))

    def _replica_failed(self, rid: int, exc: BaseException) -> None:
        if self._failure is None and not isinstance(exc, asyncio.CancelledError):
            # (its global id: named in the failure header; and its exception where
            # it is one that leaves the loop at once, which the failure header names
            # in place of the run's cancellation. Any other is the run's own error,
            # not kept here: its traceback holds the replica's frames and their
            # arrays until the next run, or for good after the last.)
            self.strategy._failed_replica = self.strategy._replica_offset + rid
            if isinstance(exc, SystemExit | KeyboardInterrupt):
                self.strategy._failed_with = exc
        super()._replica_failed(rid, exc)

    async def _across_workers(self, number: int, signature: Any, payloads: list) -> list:
        strategy = self.strategy
        world = strategy._world
        first = payloads[0]  # (template, arrays, op or axis, options)
        options = first[OPTIONS]
        timeout = options.timeout_seconds
        # The run's number and the call's are in the key: a call can only ever meet
        # the same call of the same run on the other workers. (The run is in flight:
        # it waits for this task. So this is the run its headers say, from one source.)
        run = world._run_now()
        what = f"{signature.text}, call #{number} of run {run}"
        # (stable_repr, not repr: the same text on every worker, whatever its hash
        # seed, for a structure keyed by frozensets of str too.)
        key = _nest.stable_repr((run, number, signature.name, signature.key))
        arrays = [payload[ARRAYS] for payload in payloads]
        if strategy._nccl is not None:  # GPU replicas: one NCCL call over every worker
            out = await world.operate(
                what,
                lambda: self._nccl_across(first, signature.name, arrays, what, key, timeout),
                strategy,
            )
            return self._per_replica(payloads, out)
        ops = strategy.extended._cross_device_ops
        devices, streams = self.devices, self.streams

        async def body() -> list:
            if signature.name == "all_reduce":
                # The packs decide how many MPI calls are made: they must agree too.
                packs = f"{key} bytes_per_pack={options.bytes_per_pack}"
                await world.agree(what, packs, timeout)
                return await _all_reduce_packs(
                    world, ops, first[OP], arrays, devices, options, what
                )
            local = ops._all_gather_flat(arrays, first[AXIS], devices, options, streams)[0]
            shapes = [list(leaf.shape) for leaf in local]
            headers = await world.agree(what, key, timeout, shapes=shapes)
            return await _gather_leaves(world, list(local), headers, first[AXIS], what, timeout)

        leaves = await world.operate(what, body, strategy)
        out = [[cpu_backend.shared_view(leaf) for leaf in leaves] for _ in payloads]
        return self._per_replica(payloads, out)

    async def _nccl_across(
        self, first: Any, name: str, arrays: list, what: str, key: str, timeout: float | None
    ) -> list[list]:
        """The collective on every worker's GPUs: headers first (the order and the
        shapes, over MPI), then one NCCL call issued on each replica's stream."""
        from . import _cuda

        world, comms = self.strategy._world, self.strategy._nccl
        backend = self.slots[0].backend
        if name == "all_reduce":
            # The packs decide how many NCCL calls are made: they must agree too.
            packs = self.strategy.extended._cross_device_ops.num_packs
            key = f"{key} packs={packs},{first[OPTIONS].bytes_per_pack}"
            await world.agree(what, key, timeout)
            await world.take_turn(what)
            with world.issuing(what):
                return _cuda.all_reduce(
                    first[OP],
                    arrays,
                    self.devices,
                    self.streams,
                    packs,
                    first[OPTIONS].bytes_per_pack,
                    backend,
                    comms=comms,
                    count=world.total,
                )
        axis = first[AXIS]
        lengths = [[leaves[i].shape[axis] for leaves in arrays] for i in range(len(arrays[0]))]
        headers = await world.agree(what, key, timeout, lengths=lengths)
        every = [[n for h in headers for n in h["lengths"][i]] for i in range(len(lengths))]
        await world.take_turn(what)
        with world.issuing(what):
            return _cuda.all_gather(
                arrays,
                axis,
                self.devices,
                self.streams,
                backend,
                comms=comms,
                lengths_by_leaf=every,
            )


class _MultiWorkerExtended(StrategyExtended):
    """``strategy.extended`` of a multi-worker strategy: reductions are global."""

    async def reduce_to(
        self, reduce_op: Any, value: Any, destinations: Any, options: Any = None
    ) -> Any:
        _context.require_cross_replica(self._strategy, "reduce_to")
        op = ReduceOp.of(reduce_op)
        devices = resolve_destinations(destinations)
        (total,) = await self._strategy._reduce_across(op, [value], None, options, "reduce_to")
        return self._cross_device_ops._deliver(total, devices)

    async def batch_reduce_to(
        self, reduce_op: Any, value_destination_pairs: Sequence[tuple], options: Any = None
    ) -> list:
        """Every pair's value reduced across workers together: one header exchange
        and one MPI call per dtype for the whole batch, not two round trips a pair."""
        _context.require_cross_replica(self._strategy, "batch_reduce_to")
        op = ReduceOp.of(reduce_op)
        pairs = self._pairs(op, value_destination_pairs)
        if not pairs:
            return []
        values = [value for value, _ in pairs]
        totals = await self._strategy._reduce_across(op, values, None, options, "batch_reduce_to")
        return [
            self._cross_device_ops._deliver(total, resolve_destinations(destinations))
            for total, (_, destinations) in zip(totals, pairs, strict=True)
        ]

    def _distributed(self, op: ReduceOp, value: Any) -> Any:
        """Across workers a value that is not distributed is each local replica's
        (``_per_local_replica``); ``_reduce_across`` refuses SUM and PRODUCT of it
        on every worker where a worker holds several replicas."""
        return value


def _worker_options(given: Any) -> CommunicationOptions:
    """The strategy's default options; cross-worker calls always have a bound (a
    dead worker is reported): ``timeout_seconds`` defaults to 300 s."""
    options = options_or_default(CommunicationOptions, given, "communication_options")
    if options.timeout_seconds is None:
        options = options.merge(CommunicationOptions(timeout_seconds=DEFAULT_TIMEOUT_SECONDS))
    return options


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism across processes (workers) started by MPI.

    Start the same program in every process with ``mpiexec -n <workers> python
    program.py``; each builds this strategy at the same point. Rank and size come
    from MPI (``mpi4py``, installed by ``pip install 'aiodist[mpi]'``).

    Args:
        devices_per_worker: this worker's replica devices: ``None`` for the
            default devices (``["cpu:0"]`` without GPUs), an int ``k`` for CPU
            devices ``cpu:0`` … ``cpu:k-1``, or a list of device strings.
            Workers may hold different numbers of replicas.
        communication_options: defaults for every collective. Cross-worker
            calls need a bound: when ``timeout_seconds`` is not given it is
            300 s, so a dead worker is reported instead of waited for forever.

    ``num_replicas_in_sync`` counts the replicas of every worker and replica ids
    are global (worker 0's replicas first); ``experimental_local_results``
    gives this worker's components. Runs on one strategy are serialised (see
    the order rule in ``docs/multi-worker.md``).
    """

    _group_class = _WorkerGroup

    def __init__(
        self,
        devices_per_worker: Any = None,
        communication_options: CommunicationOptions | None = None,
    ):
        failure: Exception | None = None
        gpus: list[str] = []
        try:  # everything local first: a failure is told to the other workers
            devices = local_devices(devices_per_worker)
            options = _worker_options(communication_options)
            gpu = devices[0].kind == "GPU"
            ops = NcclAllReduce() if gpu else ReductionToOneDevice()
            ops._check_devices(devices)  # NCCL and the GPUs, before telling the others
            if gpu:
                from . import _cuda

                gpus = _cuda.gpu_identities(tuple(d.index for d in devices))
        except Exception as exc:
            failure = exc
            devices = ()
            options = CommunicationOptions(timeout_seconds=DEFAULT_TIMEOUT_SECONDS)
        kind = devices[0].kind if devices else "CPU"
        text = None if failure is None else _short(f"{type(failure).__name__}: {failure}", 1500)
        world = World(len(devices), kind, options.timeout_seconds, text, gpus)
        try:
            if failure is not None:
                raise failure
            self._world = world
            self._replica_offset = world.offsets[world.rank]
            world.stall_warning_seconds = options.stall_warning_seconds
            super().__init__(devices, ops, options)
            # This worker's ranks of the NCCL communicator over every worker's GPUs.
            self._nccl: list | None = None
            if gpu:
                timeout = options.timeout_seconds
                uid = world.nccl_unique_id(timeout)
                indices, first = tuple(d.index for d in devices), self._replica_offset
                self._nccl = world.bounded(
                    lambda: _cuda.world_communicators(uid, world.total, first, indices),
                    "creating the NCCL communicator over every worker's GPUs",
                    timeout,
                )
            self._extended = _MultiWorkerExtended(self, self._extended._cross_device_ops)
            # The end of the run submitted last, on the loop it runs on: the next run
            # starts once it is done (runs are serialised: the order rule).
            self._last_end: dict[Any, asyncio.Future] = {}
            # The replica whose exception failed the run in flight (runs are
            # serialised), and that exception if it is a SystemExit or a
            # KeyboardInterrupt (see _WorkerGroup._replica_failed).
            self._failed_replica: int | None = None
            self._failed_with: SystemExit | KeyboardInterrupt | None = None
            # The thread and communicator end with the strategy (close(), or once it is
            # garbage, or at exit); the finalizer holds the world, never the strategy.
            self._finalizer = weakref.finalize(self, world.close)
        except BaseException:  # its thread and communicator: nothing else ends them
            world.close()
            raise

    def close(self) -> None:
        """End this worker's communication thread and free its private MPI
        communicator. Call it on every worker when done with the strategy (it is
        also done when the strategy is garbage, and at exit); later cross-worker
        calls on it raise ``InvalidArgumentError``. Refused (``InvalidArgumentError``,
        naming them) while a run or cross-worker operation of it is in flight."""
        self._world.refuse_close(any(not end.done() for end in self._last_end.values()))
        self._finalizer()

    def __repr__(self) -> str:
        devices = ", ".join(repr(str(d)) for d in self._devices)
        return (
            f"MultiWorkerMirroredStrategy(worker {self._world.rank} of {self._world.size}, "
            f"devices=[{devices}], {self.num_replicas_in_sync} replicas in all)"
        )

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas on every worker together."""
        return self._world.total

    @property
    def worker_index(self) -> int:
        """This process's rank among the workers (0 is the chief)."""
        return self._world.rank

    @property
    def num_workers(self) -> int:
        return self._world.size

    async def run(self, fn: Any, args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
        """``Strategy.run``, one run at a time per strategy (the order rule)."""
        if _context.current_replica() is not None:  # raises the usual error
            return await super().run(fn, args, kwargs, options)
        if options is not None:  # before the run is numbered: no run of it on any worker
            raise run_options_refused(options)
        world = self._world
        outer = _current_run.get()
        if outer is not None and outer.world is world and not outer.ended.done():
            # (from a merge_fn of a run of this strategy, or a task it started)
            raise ContextError(
                "strategy.run() was called inside a run of this MultiWorkerMirroredStrategy "
                "(from its merge_fn, or a task started there); runs on it are serialised, "
                "so it would wait forever for the end of the run that waits for it. Call "
                "it after that run; inside merge_fn, reduce with strategy.reduce() or "
                "strategy.extended.batch_reduce_to()."
            )
        loop = asyncio.get_running_loop()
        previous = self._last_end.get(loop)
        ended = loop.create_future()  # done once this run has ended: the next may start
        self._last_end = {loop: ended}  # (strategies outlive loops: only this one's kept)
        run = _Run(world, ended)
        if previous is not None and not previous.done():
            try:
                await asyncio.shield(previous)  # (shielded: the runs after it wait too)
            except asyncio.CancelledError:
                # Cancelled while waiting for its turn: on the other workers, the run
                # at this place may have started. It keeps its place, and when its turn
                # comes it fails as a run cancelled while running does, so the runs
                # after it pair with the other workers' runs.
                previous.add_done_callback(functools.partial(self._never_started, run))
                raise
        try:
            # Numbered now, whether it makes a cross-worker call or not: where it fails
            # on one worker only, its failure header then names the same run on every
            # worker (numbered only once it called, a run without a call that failed
            # on one worker counted there alone, and every later run paired with the
            # others' next one: wrong values, silently).
            number = world.begin_run(run)
            token = _current_run.set(run)
            self._failed_replica = self._failed_with = None
            try:
                result = await super().run(fn, args, kwargs, options)
            except BaseException as exc:
                if number not in world.failed_runs:  # the others do not know yet
                    world.tell_failure(number, self._failure_text(number, exc))
                raise
            finally:
                _current_run.reset(token)
            world.run_ended()  # (before the next run's exchanges)
            return result
        finally:
            world.end_run(run)  # (and its end is set: the runs after it may start)
            # Not held by this frame once it ends: a traceback of the run's failure
            # that the program keeps (a last error) holds the frame, and the run
            # would stay held for forgetting (see World.begin_run) for ever. Nor
            # the run it was called from (outer, and the token's old value), which
            # may have ended: a task that run started may make this one.
            run = outer = token = None

    def _never_started(self, run: _Run, _: object = None) -> None:
        """The turn of ``run``, cancelled while it waited for it, has come: its failure
        header takes its place (the other workers' run there raises, naming it)."""
        world = self._world
        try:
            number = world.begin_run(run)
            if number not in world.failed_runs:
                world.tell_failure(number, f"its run {number} was cancelled before it started")
        finally:
            world.end_run(run)

    def _failure_text(self, run: int, exc: BaseException) -> str:
        if isinstance(exc, asyncio.CancelledError) and self._failed_with is not None:
            # It left the event loop at once (asyncio's rule for these two), and the
            # loop's shutdown then cancelled the run: the replica's is the cause.
            exc = self._failed_with
        if isinstance(exc, asyncio.CancelledError):
            how = "was cancelled"
        else:
            how = f"raised {type(exc).__name__}: {exc}"
            if self._failed_replica is not None:
                how = f"failed: replica {self._failed_replica} {how}"
        return _short(f"its run {run} {how}", 1500)

    async def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any:
        """``Strategy.reduce`` over every worker's replicas; a NumPy array on every worker."""
        _context.require_cross_replica(self, "reduce")
        op = ReduceOp.of(reduce_op)
        return (await self._reduce_across(op, [value], axis, None))[0]

    def _per_local_replica(self, value: Any) -> tuple[Any, bool]:
        """``value`` as this worker's replicas' values, and whether it was copied to
        each of several: a variable's are its copies; a value that is not
        distributed is each local replica's (as when every replica passed the same
        object), so with one local replica it is simply that replica's value (with
        several, ``_reduce_across`` refuses SUM and PRODUCT of it, as one machine
        does). A variable made outside any scope is its value, as
        ``Strategy.reduce`` takes it (its one copy is not one per local replica)."""
        if hasattr(value, "_aiodist_local_results"):
            if value._aiodist_distributed:  # a strategy's variable: never read it whole
                return PerReplica(list(value._aiodist_local_results()), self._devices), False
            value = value.read_value()
        if isinstance(value, DistributedValues) or len(self._slots) == 1:
            return value, False
        return PerReplica([value] * len(self._slots), self._devices), True

    def _refusal(self, what: str, exc: Exception) -> str | None:
        """The header text a call (``what``) outside any run, refused on this worker
        before its header was sent (values of another shape on one worker), takes
        its place in the order with: one no call of the others can match, so they
        raise at once (``CollectiveMismatchError``, naming this refusal) instead of
        waiting for this worker until their timeout, which lost the order for good
        (or pairing with its next call). The caller then raises its own error.
        None where nobody needs telling: one worker, or in a run (the run's failure
        header tells them already)."""
        world = self._world
        if world.size == 1 or world._run_now() is not None:
            return None
        text = exc.args[0] if isinstance(exc, AiodistError) and exc.args else str(exc)
        return f"{what}, which it refused: {type(exc).__name__}: {text}"

    async def _tell_refusal(self, what: str, exc: Exception, timeout: float | None) -> None:
        """A cross-replica call's refusal (``_refusal``), told to the others."""
        world, what = self._world, self._refusal(what, exc)
        if what is None:
            return
        # (An error here: the others made the call, and raise too; or the strategy is
        # closed, or the order lost. This worker's own error says what went wrong.)
        with contextlib.suppress(AiodistError):
            await world.operate(what, lambda: world.agree(what, "refused", timeout), self)

    def _tell_refusal_now(self, what: str, exc: Exception) -> None:
        """A synchronous call's refusal (``_refusal``: creating a variable whose
        initial value this worker refuses), told to the others."""
        what = self._refusal(what, exc)
        if what is None:
            return
        with contextlib.suppress(AiodistError):  # (as in _tell_refusal)
            self._world.agree_now(what, "refused", self._communication_options.timeout_seconds)

    async def _reduce_across(
        self,
        op: ReduceOp,
        values: Sequence[Any],
        axis: Any,
        options: Any,
        method: str = "strategy.reduce",
    ) -> list[np.ndarray]:
        """Each of ``values`` reduced over every worker's replicas, as host arrays:
        each first combined over this worker's replicas, then all of them across
        workers with one header exchange and one MPI call per dtype."""
        timeout = self._communication_options.merge(options).timeout_seconds
        local_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
        totals, counts = [], []
        ambiguous = None  # (why this worker refuses the reduction, if it does)
        along = "" if axis is None else f", axis={axis!r}"
        try:
            for value in values:
                refuse_structure(value, method.removeprefix("extended."))
                local_values, copied = self._per_local_replica(value)
                if copied and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
                    # One machine refuses this (StrategyExtended._distributed): a value that
                    # is not distributed may be one replica's value or every replica's. Told
                    # in the header, so every worker refuses it at this place alike (one
                    # that holds a single replica takes such a value as its replica's, and
                    # would wait for this worker's data step until the timeout).
                    ambiguous = f"{type(value).__name__} for its {len(self._slots)} replicas"
                parts = await self._host_components(local_values, method)
                # The checks and per-replica reductions of strategy.reduce (MEAN: sums).
                parts, count = _local_parts(op, parts, axis)
                parts = [np.asarray(p) for p in parts]
                if op is ReduceOp.MEAN:  # summed here, divided below: integers as float64
                    parts = [mean_operand(p) for p in parts]
                local = self.extended._cross_device_ops._reduce_arrays(
                    local_op,
                    parts,
                    _HOST,  # host parts: reduced there
                )
                # (In native order, as a worker of several replicas has it: the
                # header's dtype and the packs must agree on every worker.)
                totals.append(_native_order(np.asarray(local)))
                counts.append(count)
        except Exception as exc:  # refused here: the others are told at once
            await self._tell_refusal(f"{method}({op.name}{along})", exc, timeout)
            raise
        what = f"{method}({op.name}, {', '.join(map(leaf_text, totals))}{along})"
        # The method and axis too: strategy.reduce on one worker and reduce_to (or
        # batch_reduce_to, or a reduce along an axis) on another, with results of one
        # shape, would otherwise pair silently as one operation.
        key = repr((method, op.name, axis, [(t.dtype.str, t.shape) for t in totals]))
        world = self._world

        async def body() -> tuple:
            headers = await world.agree(what, key, timeout, counts=counts, ambiguous=ambiguous)
            refusing = [(w, h["ambiguous"]) for w, h in enumerate(headers) if h["ambiguous"]]
            if refusing:  # (no data step at this place, on any worker)
                whose = "; ".join(f"{world.who(w)}: {text}" for w, text in refusing)
                raise InvalidArgumentError(
                    f"{what}: "
                    + ambiguous_reduction(op, whose, "on a worker holding several replicas")
                    + " (With one replica per worker, such a value is that worker's "
                    "replica's.)"
                )
            return headers, await _reduce_leaves(world, local_op, totals, what, timeout)

        headers, totals = await world.operate(what, body, self)
        if op is ReduceOp.MEAN:  # by the true element count of every worker's values
            return [
                mean_of_sum(np, total, sum(h["counts"][i] for h in headers))
                for i, total in enumerate(totals)
            ]
        return totals

    async def gather(self, value: Any, axis: int) -> Any:
        """``Strategy.gather`` over every worker's replicas, in global replica order."""
        timeout = self._communication_options.timeout_seconds
        try:
            local = await super().gather(value, axis)
        except Exception as exc:  # refused here: the others are told at once
            await self._tell_refusal(f"strategy.gather(axis={axis!r})", exc, timeout)
            raise
        what = f"strategy.gather(axis={axis}, {leaf_text(local)})"
        shape = list(local.shape)
        shape[axis] = -1
        world = self._world

        async def body() -> np.ndarray:
            headers = await world.agree(
                what, repr((local.dtype.str, shape)), timeout, shapes=[list(local.shape)]
            )
            return (await _gather_leaves(world, [local], headers, axis, what, timeout))[0]

        return await world.operate(what, body, self)
