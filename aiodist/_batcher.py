"""Request batching for distributed inference inside async servers.

A ``Batcher`` turns many concurrent single requests into few batches:

- ``await batcher.submit(rows)`` queues one request (a 2-D array of rows) and
  returns exactly its own output rows;
- a batching task waits for the first request, then up to ``max_wait_seconds``
  for more (never more than ``max_batch_size`` rows, and only requests whose rows
  have the first's width and dtype), concatenates them, splits
  the batch across the replicas (``strategy.run``), and hands each caller its
  slice of the result, in the dtype the step computed its rows in (never
  promoted to join another replica's output: ``_MixedRows``; under
  ``MultiWorkerMirroredStrategy``, each worker's batcher batches its own
  requests over its own replicas);
- admission is bounded: when a request's rows would take the rows waiting past
  ``max_queue_rows``, ``submit`` raises ``Overloaded`` at once instead of
  queueing without limit;
- a caller cancelled while queued (its client went away) is dropped from the
  batch; one cancelled while its batch runs just does not get the result; the
  others never notice either;
- if the step raises, every caller of that batch gets the exception, and the
  batcher goes on serving;
- ``start()`` warms up (devices, a first run) and starts the batching task;
  ``stop(deadline)`` stops admitting, lets queued and running batches (or
  ``start()``'s warm-up run) finish within ``deadline`` seconds, then cancels
  what is left, and returns once nothing is left running (a batching task
  cancelled by anything else stops admitting too, and answers its queued
  callers). ``lifespan()`` wraps both for an ASGI lifespan (Starlette's
  ``lifespan=``); aiohttp can call ``start``/``stop`` from
  ``on_startup``/``on_cleanup``;
- like a strategy, a batcher may outlive its event loop: one left serving on a
  loop that has closed starts afresh on the next loop's ``start()``. ``submit``
  on another loop raises ``NotServing``, and so does ``start()`` while the first
  loop is still open.

No web framework is imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np

from . import _context, _nest
from ._checks import (
    async_generator_function,
    not_callable,
    seconds,
    short_repr,
    whole_number,
)
from ._errors import AiodistError, ContextError, InvalidArgumentError, RendezvousError
from ._input import split_batch
from ._scheduler import MERGE_TASK_NAME, REPLICA_TASK_PREFIX
from ._strategy import Strategy
from ._values import regroup

__all__ = ["Batcher", "BatcherStats", "NotServing", "Overloaded"]


class Overloaded(AiodistError, RuntimeError):
    """The batcher's queue is full: retry later (an HTTP server answers 503)."""


class NotServing(AiodistError, RuntimeError):
    """The batcher is not accepting requests (not started yet, or stopping)."""


# The batcher whose batch (or warm-up) the current task runs, as its replicas' tasks
# see it (they copy the context of the task that runs the batch): see _own_step.
_SERVING: contextvars.ContextVar[Batcher | None] = contextvars.ContextVar(
    "aiodist_batcher_serving", default=None
)


class _Request:
    __slots__ = ("future", "rows", "submitted", "taken")

    def __init__(self, rows: np.ndarray, future: asyncio.Future):
        self.rows = rows
        self.future = future
        self.submitted = time.perf_counter()
        self.taken = False  # left the queue (batched, or dropped); its rows are uncounted


def _as_rows(rows: Any, name: str) -> np.ndarray:
    """``rows`` as one 2-D array of at least one row: a request's rows, or the
    warm-up's. ``name`` says whose, in the message (``"submit: rows"``)."""
    try:
        array = np.asarray(rows)
    except (TypeError, ValueError) as exc:  # rows of different lengths: NumPy's words only
        raise InvalidArgumentError(
            f"{name}={short_repr(rows)} is not one array ({exc}); expected a 2-D "
            "array with at least one row, every row of one length."
        ) from None
    if array.ndim == 0:  # not rows at all (aiohttp's on_startup passes its app): name it
        raise InvalidArgumentError(
            f"{name}={short_repr(rows)} is not an array of rows; expected a 2-D array "
            "with at least one row."
        )
    if array.ndim != 2 or len(array) == 0:
        raise InvalidArgumentError(
            f"{name} of shape {array.shape}; expected a 2-D array with at least one row."
        )
    return array


def _not_rows(value: Any) -> str:
    """A step's output that has no rows, in words for a message."""
    if value is None:  # (the step's last line computed, but did not return)
        return "None (is its `return` missing?)"
    if hasattr(value, "ndim"):  # a 0-d array, or a NumPy or CuPy scalar
        return f"a value of shape {np.shape(value)}"
    return f"a {type(value).__name__}, not an array"


def _note_empty_shares(exc: BaseException, rows: int, replicas: int, row_shape: tuple) -> None:
    """Add a note to ``exc``, raised by the step for a batch of fewer ``rows`` than
    ``replicas``: the last replicas ran it on no rows, which a step written for
    "a batch" may not expect (np.stack of no rows raises, for one), and which only
    happens when traffic is light, so the failure looks random."""
    idle = list(range(rows, replicas))
    remedy = "make it return no rows for them (e.g. np.empty((0, width)))"
    if isinstance(exc, RendezvousError):  # (a collective the step skipped on no rows)
        remedy += ", after the same collective calls as the replicas with rows make"
    note = (
        f"aiodist Batcher: this batch had {rows} row{'' if rows == 1 else 's'} for "
        f"{replicas} replicas, so replica{'s' if len(idle) > 1 else ''} "
        f"{', '.join(map(str, idle))} ran the step on no rows (shape {(0, *row_shape)}); "
        f"if it fails there, {remedy}."
    )
    if note not in getattr(exc, "__notes__", ()):  # (a step that raises one object twice)
        exc.add_note(note)


class _MixedRows:
    """A batch's output whose replicas returned rows of different dtypes (an int64
    id on one replica's rows, a float64 NaN for an unknown one on another's).

    ``np.concatenate`` would promote every row to one dtype: int64 ids above 2**53
    would come back rounded as float64, int32 and uint32 as int64, for callers
    whose rows were computed in neither. Instead each request's rows are cut from
    the replica output that computed them, in that output's dtype. A request
    whose rows were split across replicas of different dtypes has no one dtype
    to get: it gets ``InvalidArgumentError`` (the others of its batch are served).
    """

    __slots__ = ("_ends", "_parts", "_replicas")

    def __init__(self, parts: list[np.ndarray], replicas: list[int]):
        self._parts = parts  # each non-empty share's output, in row order
        self._replicas = replicas  # the replica that computed each
        self._ends = np.cumsum([len(part) for part in parts]).tolist()

    def rows(self, offset: int, size: int) -> np.ndarray:
        """Rows ``offset`` to ``offset + size`` of the batch's output."""
        pieces, start = [], 0
        for part, replica, end in zip(self._parts, self._replicas, self._ends, strict=True):
            if start < offset + size and offset < end:
                low, high = max(offset, start) - start, min(offset + size, end) - start
                pieces.append((replica, part[low:high]))
            start = end
        if len({piece.dtype for _, piece in pieces}) == 1:
            # (a copy, as the joined output's slices are: never a view of what the
            # step returned, which may be its own array)
            return np.concatenate([piece for _, piece in pieces])
        shown = ", ".join(f"{piece.dtype} on replica {replica}" for replica, piece in pieces)
        raise InvalidArgumentError(
            f"Batcher: this request's rows were split across replicas whose outputs have "
            f"different dtypes ({shown}); joining them would change what the step computed. "
            "Make the step return one dtype on every replica (cast with .astype)."
        )


def _joins_exactly(dtypes: set) -> bool:
    """Whether outputs of ``dtypes`` concatenate without changing any value's
    dtype: one dtype, or strings (or bytes) of several lengths, which only widen."""
    if len(dtypes) == 1:
        return True
    kinds = {dtype.kind for dtype in dtypes}
    return len(kinds) == 1 and kinds <= {"U", "S"}


def _fail(requests: Any, exc: BaseException) -> int:
    """Answer every request still waiting with ``exc`` (one object for all); how
    many were."""
    answered = 0
    for request in requests:
        if not request.future.done():
            request.future.set_exception(exc)
            answered += 1
    return answered


class BatcherStats:
    """Counters and recent latencies of a batcher (``batcher.stats()``).

    - ``requests``: requests answered with their rows;
    - ``batches``, ``rows``: batches whose step ran to the end, and their rows
      (``mean_batch_size`` is their ratio);
    - ``rejected``: requests refused at once by ``submit`` (``Overloaded``);
    - ``failed``: batches that failed (the step raised, or its output was
      refused): each of their callers got the error;
    - ``failed_requests``: requests answered with an error of their batch's step:
      every waiting caller of a failed batch, and a request that failed alone in a
      batch otherwise served (its rows were split across replicas whose outputs
      have different dtypes). Requests withdrawn by their caller, or answered
      ``NotServing`` (the batcher stopped), are in no counter.

    ``latency_seconds``: p50, p90 and p99 of the latest answered requests' times
    from ``submit`` to their rows.
    """

    def __init__(
        self,
        requests: int,
        batches: int,
        rows: int,
        rejected: int,
        failed: int,
        latencies: list[float],
        failed_requests: int = 0,
    ):
        self.requests = requests
        self.batches = batches
        self.rows = rows
        self.rejected = rejected
        self.failed = failed
        self.failed_requests = failed_requests
        self.mean_batch_size = rows / batches if batches else 0.0
        ordered = sorted(latencies)

        def percentile(p: float) -> float:
            # Nearest rank: the smallest latency with at least p% of them at or below.
            if not ordered:
                return 0.0
            return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

        self.latency_seconds = {"p50": percentile(50), "p90": percentile(90), "p99": percentile(99)}

    def __repr__(self) -> str:
        latency = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.latency_seconds.items())
        return (
            f"BatcherStats(requests={self.requests}, batches={self.batches}, rows={self.rows}, "
            f"mean_batch_size={self.mean_batch_size:.1f}, rejected={self.rejected}, "
            f"failed={self.failed}, failed_requests={self.failed_requests}, latency: {latency})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "batches": self.batches,
            "rows": self.rows,
            "mean_batch_size": self.mean_batch_size,
            "rejected": self.rejected,
            "failed": self.failed,
            "failed_requests": self.failed_requests,
            "latency_ms": {k: v * 1e3 for k, v in self.latency_seconds.items()},
        }


class Batcher:
    """Coalesce concurrent requests into batches run across replicas (this
    process's replicas, under ``MultiWorkerMirroredStrategy``).

    Args:
        strategy: the strategy whose replicas run the step.
        step_fn: ``async def step_fn(rows)`` run once per replica on that
            replica's share of the batch rows; returns one array with one row
            per input row (not a tuple, list or dict of outputs), of one dtype
            on every replica (each caller gets its rows in the dtype its replica
            returned; one whose rows span replicas of different dtypes gets
            ``InvalidArgumentError``). A batch of
            fewer rows than replicas gives the last replicas no rows (shape
            ``(0, width)``): the step runs there too and returns no rows.
        max_batch_size: most rows in one batch.
        max_wait_seconds: how long the first request of a batch may wait for
            company.
        max_queue_rows: most rows waiting; beyond, ``submit`` raises
            ``Overloaded``.
        max_batches_in_flight: batches running at once (each is one
            ``strategy.run``).
    """

    def __init__(
        self,
        strategy: Any,
        step_fn: Callable[[Any], Awaitable[Any]],
        *,
        max_batch_size: int = 64,
        max_wait_seconds: float = 0.002,
        max_queue_rows: int = 4096,
        max_batches_in_flight: int = 2,
    ):
        max_batch_size = whole_number(max_batch_size, "max_batch_size", 1)
        max_queue_rows = whole_number(max_queue_rows, "max_queue_rows", 1)
        max_batches_in_flight = whole_number(max_batches_in_flight, "max_batches_in_flight", 1)
        if not isinstance(strategy, Strategy):
            raise InvalidArgumentError(
                f"Batcher: strategy={strategy!r}; expected an aiodist strategy "
                "(e.g. aiodist.MirroredStrategy)."
            )
        if not callable(step_fn):
            raise not_callable(
                step_fn,
                f"Batcher: step_fn={step_fn!r} is not callable; expected "
                "`async def step_fn(rows)` returning one output row per input row.",
            )
        if async_generator_function(step_fn):  # (it failed only once serving)
            raise InvalidArgumentError(
                f"Batcher: step_fn={step_fn!r} is an async generator function (an async "
                "def with yield in it); expected `async def step_fn(rows)` returning "
                "one output row per input row."
            )
        self.strategy = strategy
        self.step_fn = step_fn
        self.max_batch_size = max_batch_size
        self.max_wait_seconds = seconds(max_wait_seconds, "max_wait_seconds", zero=True)
        self.max_queue_rows = max_queue_rows
        self.max_batches_in_flight = max_batches_in_flight
        self._queue: deque[_Request] = deque()
        self._queued_rows = 0
        self._accepting = False
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._starting: asyncio.Future | None = None  # set while start() warms up
        self._warming: asyncio.Task | None = None  # the warm-up's run, while it runs
        self._stop_requested = False
        self._stops = 0  # stop() calls so far
        self._stopping: asyncio.Future | None = None  # set while stop() drains
        self._running: set[asyncio.Task] = set()
        self._slots: asyncio.Semaphore | None = None
        self._requests = self._batches = self._rows = self._rejected = self._failed = 0
        self._failed_requests = 0
        self._latencies: deque[float] = deque(maxlen=10_000)

    def __repr__(self) -> str:
        if self._stopping is not None:
            state = "stopping"
        elif self._starting is not None:
            state = "starting"
        elif self._accepting:
            state = "serving"
        else:
            state = "not serving"
        step = getattr(self.step_fn, "__qualname__", None) or repr(self.step_fn)
        rows, batches = self._queued_rows, len(self._running)
        return (
            f"<Batcher {state}: {rows} row{'' if rows == 1 else 's'} queued, {batches} "
            f"batch{'' if batches == 1 else 'es'} in flight; step {step}, "
            f"max_batch_size={self.max_batch_size}>"
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, warmup_rows: np.ndarray | None = None) -> None:
        """Warm up (one run of ``warmup_rows``, if given) and start batching. A call
        made while another is warming up waits for it (and starts afresh if a
        ``stop()`` made before this call kept that one from starting); one made while
        ``stop()`` is draining waits for the stop to end, then starts. A batcher left serving on an
        event loop that has since closed (a test that never called ``stop()``) starts
        afresh on this one. ``warmup_rows`` are rows as a request's (a 2-D array with at
        least one row); anything else raises ``InvalidArgumentError`` at once. The
        warm-up and every batch run outside any strategy scope, whatever scope (or
        replica function) the caller is in."""
        if warmup_rows is not None:
            warmup_rows = _as_rows(warmup_rows, "start: warmup_rows")
        self._forget_a_closed_loop()
        while self._stopping is not None:  # (another start may have waited too)
            await asyncio.shield(self._stopping)
        if self._loop_task is not None:
            if not self._loop_task.done():
                return
            self._loop_task = None  # ended without stop() (see _batching_ended): start anew
        stops = self._stops  # stop() calls made before this start
        while self._starting is not None:  # another start() is warming up: wait for it
            await asyncio.shield(self._starting)
            if self._loop_task is not None:
                return
            # That warm-up ended without starting: it failed (its caller has the
            # error), or a stop() ran during it. A stop made before this call is not
            # this start's, which then starts afresh (a stop-then-start was refused).
            if not self._stop_requested or self._stops != stops:
                raise NotServing(
                    "the batcher did not start (its warm-up failed, or stop() ran during "
                    "it); call start() again to serve."
                )
        self._starting = starting = asyncio.get_running_loop().create_future()
        self._stop_requested = False
        try:
            await self._start(warmup_rows)
        finally:
            self._starting = None
            starting.set_result(None)

    def _forget_a_closed_loop(self) -> None:
        """Drop the state of a loop that closed while this batcher served on it: its
        batching task, batches and queued callers are gone with it. (Like a strategy,
        a batcher may outlive its loop: pytest-asyncio gives each test its own.)"""
        owner = next(
            (
                item.get_loop()
                for item in (self._loop_task, self._starting, self._stopping)
                if item is not None
            ),
            None,
        )
        if owner is None or owner is asyncio.get_running_loop():
            return
        if not owner.is_closed():
            raise NotServing(
                "the batcher is serving on another event loop, which is still open; "
                "stop() it there before starting it on this one."
            )
        self._accepting = False
        self._loop_task = self._starting = self._stopping = self._warming = None
        self._wakeup = self._slots = None
        self._running.clear()
        self._drop_queue()

    def _drop_queue(self, error: BaseException | None = None) -> None:
        """Empty the queue: its requests taken (their callers must not uncount their
        rows again when cancelled), and failed with ``error`` when one is given."""
        for request in self._queue:
            request.taken = True
        if error is not None:
            _fail(self._queue, error)
        self._queue.clear()
        self._queued_rows = 0

    async def _start(self, warmup_rows: np.ndarray | None) -> None:
        # The warm-up and the batching task (and so every batch) run outside any
        # scope, whatever start()'s caller is in: a task keeps the context it was
        # made in, and one started under another strategy's scope failed every
        # batch with "Mixing different aiodist strategies" long after that scope
        # was left.
        loop = asyncio.get_running_loop()
        if warmup_rows is not None:
            await self._warm_up(warmup_rows)
        if self._stop_requested:  # stop() ran during the warm-up: it wins
            return
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.max_batches_in_flight)
        self._accepting = True
        self._loop_task = loop.create_task(
            self._batching(), name="aiodist-batcher", context=_context.outside_any_scope()
        )
        self._loop_task.add_done_callback(self._batching_ended)

    async def _warm_up(self, rows: np.ndarray) -> None:
        """Run ``rows`` as a batch, in a task of its own (``_warming``) that ``stop()``
        waits for within its deadline and then cancels: a stop() that returned while
        the warm-up still ran left it running on the strategy, after a caller had
        moved on to close it or its loop. A cancellation of start() itself reaches
        the warm-up too (awaiting a task passes it on)."""
        warming = self._warming = asyncio.get_running_loop().create_task(
            self._run_batch(rows),
            name="aiodist-batcher-warm-up",
            context=_context.outside_any_scope(),  # (see _start)
        )
        try:
            await warming
        except asyncio.CancelledError:
            # stop() cancelled the warm-up past its deadline: start() returns without
            # starting, as after any stop() during the warm-up.
            current = asyncio.current_task()
            if not (warming.cancelled() and self._stop_requested and not current.cancelling()):
                raise
        finally:
            self._warming = None

    def _batching_ended(self, task: asyncio.Task) -> None:
        """The batching task ended. ``stop()`` ends it after it stops admitting; if it
        ends while the batcher still admits (cancelled by code that cancels every
        task, such as ``asyncio.run`` closing its loop), nobody would ever batch the
        queued requests: stop admitting, and answer them ``NotServing``. (Batches
        already running finish on their own.)"""
        if task is not self._loop_task or not self._accepting:
            return
        self._accepting = False
        why = "was cancelled" if task.cancelled() else f"failed ({task.exception()!r})"
        self._drop_queue(
            NotServing(
                f"the batcher's batching task {why} without stop(), before this request "
                "was batched; call `await batcher.start()` to serve again."
            )
        )

    async def stop(self, deadline: float = 10.0) -> None:
        """Stop admitting; finish queued and running batches within ``deadline`` seconds,
        then cancel what is left (those callers get ``NotServing``). Stopping during
        ``start``'s warm-up keeps the batcher from starting; the warm-up's run is let
        finish within ``deadline`` too, then cancelled, and ``stop`` returns only once
        it has ended. A ``start`` made while this drains waits for it to end. Called
        inside a batch (the step, or a merge_fn it awaits), which it would wait for,
        it raises ``ContextError``: start it in a task the step does not await."""
        deadline = seconds(deadline, "stop: deadline", zero=True)
        where = self._own_step()
        if where is not None:
            raise ContextError(
                f"Batcher.stop() was called from inside a batch it serves ({where}): "
                "stop() waits for the batches in flight, this one too, which waits for "
                "this call, so it would wait for itself for ever. "
                "Call it from a task of its own that the step does not await "
                "(asyncio.create_task(batcher.stop())), or from outside the batcher."
            )
        self._forget_a_closed_loop()
        self._accepting = False
        self._stop_requested = True
        self._stops += 1
        if self._stopping is not None:  # another stop() is draining: wait for it
            await asyncio.shield(self._stopping)
            return
        # The batching task, or start()'s warm-up (then nothing is queued or running
        # besides it, and what follows waits for it alone).
        task = self._loop_task or self._warming
        if task is None:
            return
        self._stopping = stopping = asyncio.get_running_loop().create_future()
        if self._wakeup is not None:  # (None during the warm-up)
            self._wakeup.set()
        end = time.perf_counter() + deadline
        try:
            try:
                # The batching loop drains the queue (starting batches as it goes),
                # then the batches it started finish; both within the deadline.
                await asyncio.wait({task}, timeout=deadline)
                if self._running:
                    await asyncio.wait(
                        set(self._running), timeout=max(0.0, end - time.perf_counter())
                    )
            finally:  # also when stop() itself is cancelled: nothing is left serving
                for leftover in (task, *self._running):
                    if not leftover.done():
                        leftover.cancel()
                self._loop_task = None
                self._drop_queue(
                    NotServing("the batcher stopped before this request ran; retry elsewhere.")
                )
            await asyncio.gather(task, *self._running, return_exceptions=True)
        finally:
            self._stopping = None
            stopping.set_result(None)

    def _own_step(self) -> str | None:
        """Where the current task runs one of this batcher's batches (or its warm-up),
        which the batch waits for: "replica N's step" (a replica's task), "a merge_fn
        the step called" (an async merge_fn's task); None anywhere else (a task a step
        started, which the batch does not wait for, too)."""
        if _SERVING.get() is not self:
            return None
        task = asyncio.current_task()
        if task is None:
            return None
        name = task.get_name()
        _, replica, _, group = _context.current_state()
        # (By name too: on Python 3.12+ a replica's first step runs as its task is
        # made, before the run has it in its list.)
        if (
            replica is not None
            and group is not None
            and (task in group._tasks or name.startswith(REPLICA_TASK_PREFIX))
        ):
            return f"replica {replica.replica_id_in_sync_group}'s step"
        if name == MERGE_TASK_NAME:
            return "a merge_fn the step called"
        return None

    @contextlib.asynccontextmanager
    async def lifespan(
        self, app: Any = None, *, warmup_rows: Any = None, deadline: float = 10.0
    ) -> AsyncIterator[None]:
        """``start`` on entry, ``stop(deadline)`` on exit: an ASGI lifespan."""
        await self.start(warmup_rows)
        try:
            yield
        finally:
            await self.stop(deadline)

    # -- requests ------------------------------------------------------------------------

    async def submit(self, rows: Any) -> np.ndarray:
        """Run ``rows`` (a 2-D array, one request) and return its output rows."""
        loop = asyncio.get_running_loop()
        task = self._loop_task  # (set whenever the batcher accepts)
        if not self._accepting or task is None or task.get_loop() is not loop:
            raise self._not_accepting()  # (not started or stopping, or on another loop)
        rows = _as_rows(rows, "submit: rows")
        if len(rows) > self.max_batch_size:
            raise InvalidArgumentError(
                f"submit: a request of {len(rows)} rows is larger than one batch "
                f"(max_batch_size={self.max_batch_size}); split it into smaller requests."
            )
        if len(rows) > self.max_queue_rows:
            raise InvalidArgumentError(
                f"submit: a request of {len(rows)} rows can never be admitted "
                f"(max_queue_rows={self.max_queue_rows}); split it into smaller requests."
            )
        if self._queued_rows + len(rows) > self.max_queue_rows:
            self._rejected += 1
            raise Overloaded(
                f"{self._queued_rows} rows are already queued (max_queue_rows="
                f"{self.max_queue_rows}): no room for this request's {len(rows)} "
                f"row{'' if len(rows) == 1 else 's'}; retry later."
            )
        future = loop.create_future()
        request = _Request(rows, future)
        self._queue.append(request)
        self._queued_rows += len(rows)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            if not request.taken:  # still queued: free its rows now; the loop skips it
                request.taken = True
                self._queued_rows -= len(rows)
            future.cancel()
            raise
        except BaseException:
            # The batch failed. Its error, raised here, has a traceback holding this
            # frame: holding the future that holds that error too would make a
            # cycle, left for the garbage collector, of every caller of the batch.
            future = request = None
            raise

    def _not_accepting(self) -> NotServing:
        """Why ``submit`` is refused, as the error to raise."""
        task = self._loop_task
        if task is not None and task.get_loop() is not asyncio.get_running_loop():
            return NotServing(
                "the batcher was started on another event loop; call `await batcher.start()` "
                "on this one (after stop() on the other, if it is still running)."
            )
        if task is not None and task.done() and not self._stop_requested:
            why = "was cancelled" if task.cancelled() else f"failed ({task.exception()!r})"
            return NotServing(
                f"the batcher's batching task {why} without stop(); call `await "
                "batcher.start()` to serve again."
            )
        return NotServing("the batcher is not accepting requests (not started, or stopping).")

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a batch (admission refuses beyond ``max_queue_rows``)."""
        return self._queued_rows

    def stats(self) -> BatcherStats:
        return BatcherStats(
            self._requests,
            self._batches,
            self._rows,
            self._rejected,
            self._failed,
            list(self._latencies),
            self._failed_requests,
        )

    # -- batching ------------------------------------------------------------------------

    def _take_batch(self) -> list[_Request]:
        """The requests of the next batch, in arrival order: up to ``max_batch_size``
        rows, all of the first request's kind (row width and dtype). A request of
        another kind ends the batch and starts the next one: one caller's odd rows
        can neither fail the others' batch nor change their outputs' dtype."""
        taken, rows, kind = [], 0, None
        while self._queue:
            request = self._queue[0]
            if request.future.done():  # cancelled while queued: drop it
                self._queue.popleft()
                if not request.taken:
                    request.taken = True
                    self._queued_rows -= len(request.rows)
                continue
            if taken and (
                rows + len(request.rows) > self.max_batch_size
                or (request.rows.shape[1:], request.rows.dtype) != kind
            ):
                break
            kind = (request.rows.shape[1:], request.rows.dtype)
            self._queue.popleft()
            request.taken = True
            self._queued_rows -= len(request.rows)
            taken.append(request)
            rows += len(request.rows)
        return taken

    async def _batching(self) -> None:
        assert self._wakeup is not None and self._slots is not None
        loop = asyncio.get_running_loop()
        while self._accepting or self._queue:
            if not self._queue:
                self._wakeup.clear()
                if not self._accepting:
                    break
                await self._wakeup.wait()
                continue
            # Give the first request up to max_wait_seconds to gather company.
            first = self._queue[0].submitted
            # (A queue that holds fewer rows than a batch is full before the batch:
            # no later request can join, so waiting on would only add latency.)
            full = min(self.max_batch_size, self.max_queue_rows)
            while (
                self._accepting
                and self._queued_rows < full
                and time.perf_counter() - first < self.max_wait_seconds
            ):
                self._wakeup.clear()
                remaining = self.max_wait_seconds - (time.perf_counter() - first)
                try:
                    await asyncio.wait_for(self._wakeup.wait(), max(0.0, remaining))
                except TimeoutError:
                    break
            await self._slots.acquire()
            batch = self._take_batch()
            if not batch:
                self._slots.release()
                continue
            task = loop.create_task(self._serve(batch))
            self._running.add(task)
            task.add_done_callback(partial(self._served, batch, self._slots))

    def _served(self, batch: list[_Request], slots: asyncio.Semaphore, task: asyncio.Task) -> None:
        """A batch's task ended: free its slot and answer whoever is still waiting.
        Done here, not in ``_serve``: a task cancelled (by ``stop``) before its first
        step never runs its coroutine's handlers. ``slots``: the semaphore the slot
        was taken from (a restart after a cancelled stop makes a new one, which this
        batch must not release)."""
        self._running.discard(task)
        slots.release()
        error = None if task.cancelled() else task.exception()
        if error is not None:
            # The batch failed (the step raised, a BaseException such as pytest.fail's
            # too, or its output was refused): every caller gets the one error.
            self._failed += 1
            self._failed_requests += _fail(batch, error)
            return
        stopped = "the batcher stopped before this request's batch finished; retry elsewhere."
        _fail(batch, NotServing(stopped))

    async def _serve(self, batch: list[_Request]) -> None:
        # (A failure is its callers', answered by _served.)
        rows = np.concatenate([request.rows for request in batch])
        try:
            outputs = await self._run_batch(rows)
        except BaseException:
            # _served sets the error on the callers' futures; its traceback holds this
            # frame, which must not hold them too (a cycle per failed batch).
            batch = None
            raise
        self._batches += 1
        self._rows += len(rows)
        now = time.perf_counter()
        offset = 0
        for request in batch:
            size = len(request.rows)
            if not request.future.done():
                if type(outputs) is _MixedRows:  # (replicas' outputs of several dtypes)
                    try:
                        mine = outputs.rows(offset, size)
                    except InvalidArgumentError as exc:
                        # (Its batch was served: counted with failed batches' callers.)
                        # Without the traceback of its raise here: it holds this
                        # frame, which holds the future (a cycle per such request).
                        request.future.set_exception(exc.with_traceback(None))
                        self._failed_requests += 1
                        offset += size
                        continue
                else:
                    mine = outputs[offset : offset + size]
                request.future.set_result(mine)
                self._requests += 1
                self._latencies.append(now - request.submitted)
            offset += size

    async def _run_batch(self, rows: np.ndarray) -> np.ndarray | _MixedRows:
        # This process's replicas (under MultiWorkerMirroredStrategy every worker
        # batches its own requests, not a share of a global batch).
        strategy = self.strategy
        slots = strategy._slots
        shards = split_batch(rows, len(slots))
        # Each share on its replica's device, as distributed datasets place batches
        # (on CPU devices, the rows themselves).
        placed = [
            slot.backend.asarray(s, slot.device) for slot, s in zip(slots, shards, strict=True)
        ]
        inputs = regroup(placed, strategy._devices)
        _SERVING.set(self)  # (in the batch's own task: its replicas see it; see stop)
        try:
            result = await self.strategy.run(self.step_fn, args=(inputs,))
        except Exception as exc:
            # (aiodist's own errors are left as they are, but for a collective that
            # failed: a replica given no rows that returned early, skipping a
            # collective the others made, fails the batch only at light traffic.)
            if len(rows) < len(slots) and (
                not isinstance(exc, AiodistError) or isinstance(exc, RendezvousError)
            ):
                _note_empty_shares(exc, len(rows), len(slots), rows.shape[1:])
            raise
        if _nest.is_nested(result):
            # NumPy would stack a tuple of outputs (or a list of them) into one array
            # whose axis 0 is the outputs, not the rows: callers would get each
            # other's rows whenever the counts happened to agree.
            raise InvalidArgumentError(
                f"Batcher: the step returned a {type(result).__name__}; it must return one array "
                "with one output row per input row (np.stack or np.concatenate several "
                "outputs, or a list of rows, into one array)."
            )
        # Each replica's output on the host. On GPUs, copied in stream order after the
        # replicas' work while the loop keeps serving (host_array's CuPy get() waits
        # for the GPU on the loop, and only for the current stream, not the replicas').
        parts = await strategy._host_components(result, "Batcher")
        if len(parts) == 1 and len(shards) > 1:  # the same object from every replica
            parts *= len(shards)
        # Each replica's rows checked against its own share: a surplus on one and a
        # shortfall on another would hand callers each other's rows.
        for replica, (part, shard) in enumerate(zip(parts, shards, strict=True)):
            got = len(part) if getattr(part, "ndim", 0) >= 1 else None
            if got != len(shard):
                if got is not None:
                    shown = f"{got} row{'' if got == 1 else 's'}"
                else:  # what the step gave, not its host copy (np.asarray(None) has ndim 0)
                    given = strategy.experimental_local_results(result)
                    shown = _not_rows(given[replica] if len(given) > 1 else given[0])
                raise InvalidArgumentError(
                    f"Batcher: the step returned {shown} on replica {replica} for its "
                    f"{len(shard)} input rows; it must return one output row per input row."
                )
        # (Replicas given no rows, when the batch has fewer rows than replicas, add
        # none: their empty outputs left out, whatever shape and dtype the step gives
        # them.)
        joined = [p for p, shard in zip(parts, shards, strict=True) if len(shard)]
        shapes: dict[tuple, list[int]]
        if _joins_exactly({part.dtype for part in joined}):  # (the common case)
            try:
                return np.concatenate(joined)
            except ValueError:  # (diagnosed only when joining failed: no cost to the rest)
                shapes = _row_shapes(parts, shards)
                if len(shapes) == 1:  # (not seen: rows of one shape join; NumPy's reason)
                    raise
        else:  # outputs of several dtypes: each caller's rows in their own (_MixedRows)
            shapes = _row_shapes(parts, shards)
            if len(shapes) == 1:
                replicas = [r for r, shard in enumerate(shards) if len(shard)]
                return _MixedRows(joined, replicas)
        # Rows padded to the longest in each replica's share, for example: one caller's
        # rows could not be joined with another's.
        shown = "; ".join(
            f"rows of shape {shape} on replica{'s' if len(rs) > 1 else ''} "
            f"{', '.join(map(str, rs))}"
            for shape, rs in shapes.items()
        )
        raise InvalidArgumentError(
            f"Batcher: the step returned {shown}; every replica must return rows of one shape "
            "(pad outputs to a fixed width, not to the longest in the replica's rows)."
        )


def _row_shapes(parts: list, shards: list) -> dict[tuple, list[int]]:
    """The replicas given rows, by the shape of their output rows."""
    shapes: dict[tuple, list[int]] = {}
    for replica, (part, shard) in enumerate(zip(parts, shards, strict=True)):
        if len(shard):
            shapes.setdefault(part.shape[1:], []).append(replica)
    return shapes
