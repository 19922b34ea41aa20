"""The scheduler: one ``RunGroup`` per ``strategy.run``.

A run group owns

- one asyncio task per replica, each running in its own copy of the caller's
  ``contextvars`` context, in which its first step makes that replica's
  ``ReplicaContext`` current (a custom task factory gets that context ready-made),
  and,
  on backends with streams, driven by ``_streams.drive`` so the replica's device
  and stream are current on every step;
- one ``Rendezvous`` engine matching the replicas' collective calls, whose
  ``execute`` callback (``_execute`` here) runs the cross-replica side exactly
  once per call: ``merge_fn`` in cross-replica context, or the cross-device op;
- supervision with ``TaskGroup`` semantics: the first replica to raise cancels
  every other replica (and any running merge_fn), the run waits for all of them,
  then re-raises that same exception object. Cancelling the caller cancels every
  replica the same way. When ``run`` returns or raises, nothing it started is
  still running.

asyncio objects are created here, per run, on the running loop: a strategy
outlives event loops (pytest-asyncio, uvicorn reloads) and holds none.

On backends with streams, cross-replica work is bracketed by the backend hooks
``begin_cross_replica`` / ``end_cross_replica`` (CUDA events), so it is ordered
after every replica's pending work and before every replica's later work
without blocking the loop. The run as a whole is ordered against the caller's
current streams the same way: the replica streams wait for them before any
replica step (``order_replicas_after``), and they wait for the replica streams
when the run ends (``order_after_replicas``).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import sys
import threading
import types
from asyncio import get_running_loop
from collections.abc import Callable, Sequence
from functools import partial
from inspect import CO_ASYNC_GENERATOR, CO_COROUTINE
from operator import attrgetter
from types import CoroutineType, GeneratorType
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _nest, _trace
from ._backends import cpu_backend
from ._checks import async_generator_function
from ._context import _State, set_state
from ._devices import Device
from ._errors import (
    ContextError,
    InvalidArgumentError,
    RendezvousTimeoutError,
    ReplicaExitedError,
)
from ._options import CommunicationOptions
from ._rendezvous import Rendezvous, Signature
from ._replica_context import (
    _EMPTY,
    ARRAYS,
    TEMPLATE,
    Payload,
    ReplicaContext,
)
from ._stall import ensure_for
from ._streams import drive, step_through
from ._trace import Tracer, cross_replica_track, replica_track
from ._values import DistributedValues, _regroup_flat, regroup, select_replica, select_replicas

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = ["ReplicaSlot", "RunGroup", "task_names"]


# Python 3.12+: replica tasks and async merge_fns' tasks start eagerly (see
# RunGroup.run and RunGroup._spawn); on 3.11 an async merge_fn's task does too (see
# RunGroup._merge).
# (Chosen once: a call with **{} costs about 0.1 us more per task on Python 3.11.)
_NATIVE_EAGER = sys.version_info >= (3, 12)
if not _NATIVE_EAGER:  # asyncio's own (private) table of each loop's current task
    from asyncio.tasks import _current_tasks
_eager_task = partial(asyncio.Task, eager_start=True) if _NATIVE_EAGER else asyncio.Task
MERGE_TASK_NAME = "aiodist-merge_fn"  # an async merge_fn's task's
REPLICA_TASK_PREFIX = "aiodist-replica-"  # a replica's task's, before its id
_run_in = contextvars.Context.run
_send = GeneratorType.send
_SUSPENDED = object()  # what _first_then_rest yields when its first step suspended
_AWAITABLE_BY_TYPE: dict[type, bool] = {}


def _awaitable(value: object) -> bool:
    """``inspect.isawaitable``, cached per type (it is called once per replica per run)."""
    kind = type(value)
    known = _AWAITABLE_BY_TYPE.get(kind)
    if known is None:
        known = inspect.isawaitable(value)
        if kind is GeneratorType:  # depends on the generator's code flags, not its type
            return known
        _AWAITABLE_BY_TYPE[kind] = known
    return known


_NBYTES = attrgetter("nbytes")


_NO_MERGE_FN = object()  # (no merge_call yet: a RunGroup's _merge_fn)
_NO_RESULT = object()  # (a replica that has not returned: its entry in _results)


def _nothing(_: object = None) -> None:
    """A callback with nothing to do."""


def _once(fn: Callable, *args: Any) -> Callable[..., None]:
    """A callback calling ``fn(*args)`` the first time it is called, never again."""
    called = []

    def callback(_: object = None) -> None:
        if not called:
            called.append(True)
            fn(*args)

    return callback


def _close_unstarted(coro: Any, own: bool = True) -> None:
    """Close ``coro`` (if ``own``), a replica's or merge_fn's coroutine that never
    started, and the coroutines aiodist's wrappers in it were given to await, down to
    the user function's own (not further: its arguments are the user's)."""
    if type(coro) is not CoroutineType or inspect.getcoroutinestate(coro) != inspect.CORO_CREATED:
        return
    chain = _unstarted_chain(coro)
    _close_chain(chain if own else chain[1:])


def _unstarted_chain(coro: Any) -> list:
    """``coro``, an unstarted coroutine, and beneath it those aiodist's wrappers in it
    were given to await (see _close_unstarted). Also held until they can be closed
    (see RunGroup._replica_task_ended), since a task cancelled before its first step
    drops them unawaited."""
    chain = [coro]
    for each in chain:  # (grows as it goes: each wrapper's own inner coroutines)
        if each.cr_code in _WRAPPER_CODES:
            chain.extend(
                v for v in inspect.getcoroutinelocals(each).values() if type(v) is CoroutineType
            )
    return chain


def _close_chain(chain: list) -> None:
    """Close the coroutines of ``chain`` (see _unstarted_chain) that have not started."""
    for coro in chain:
        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()


class _ReplicaTask(asyncio.Task):
    """A replica's task on Python 3.11 without a task factory.

    Its first step is not eager (only 3.12+ has eager tasks), so other code may
    cancel it before that step: asyncio then throws CancelledError into a coroutine
    that never started, and ``_replica``, which tells the run how its replica ended,
    never runs; the run would wait for that replica for ever. ``cancel`` notices that
    case and has the task's end told to the run (``_replica_task_ended``). Only a
    cancel pays for it, never a run's usual steps (the class is C's Task plus this
    one method, with no instance dict)."""

    __slots__ = ()

    def cancel(self, msg: Any = None) -> bool:
        coro = self.get_coro()
        # (Its coroutine is always a _replica one: the only kind run makes it with.)
        if not self.done() and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            arguments = inspect.getcoroutinelocals(coro)
            group, rid = arguments["group"], arguments["rid"]
            self.add_done_callback(partial(group._replica_task_ended, rid, _unstarted_chain(coro)))
        return super().cancel(msg)


@types.coroutine
def _first_then_rest(coro: Any, group: RunGroup | None = None, number: int = 0) -> Any:
    """The coroutine of an async merge_fn's task on Python 3.11, started eagerly by
    ``RunGroup._merge``: ``coro``'s first step, taken there, then, if it suspended,
    the rest, stepped by the task, awaited
    through ``group._merged(remaining, number, None)`` when ``group`` is given (a
    merge_fn's result for each replica, needed only once it has suspended; a first
    step that ends ``coro`` is answered by the caller). (The group, not its bound
    method and a tuple of arguments for it: a call of fixed arguments is
    specialised, and makes neither; 0.7k instructions of a (c) step.)

    The first step's outcome is yielded back to ``_merge``: ``coro``'s value if it
    ended (the task's own first step then resumes this and ends, with None),
    ``_SUSPENDED`` if not. (Yielded rather than returned: a generator's return is a
    StopIteration that _merge would make and catch; (c), N = 4,
    uvloop: 230.5k -> 227.8k instructions per step.) ``coro`` is stepped through
    ``_value_yielded`` for the same reason: its own return, on ``coro.send()``, was
    a StopIteration made here and caught (0.8k instructions of a (c) step with it).
    """
    first = _value_yielded(coro)
    yielded = first.send(None)  # the first step, inside _merge
    if first.gi_yieldfrom is None:  # coro ended: `yielded` is its value
        yield yielded
        yield from first  # (resumed to its end: not closed, by a throw, when dropped)
        return None
    try:
        yield _SUSPENDED  # back to _merge; the task's first step resumes here
    except GeneratorExit:  # the task was destroyed unstarted
        coro.close()
        raise
    except BaseException as exc:  # cancelled before its first scheduled step
        if (
            isinstance(exc, asyncio.CancelledError)
            and getattr(yielded, "_asyncio_future_blocking", None) is not None
            and yielded.cancel(msg=exc.args[0] if exc.args else None)
        ):
            # What Task.cancel() does with the future a task awaits (the task never
            # saw this one: the first step ran here): cancel it, and let coro learn of
            # it as it resumes from that future, once it is done (a child task may
            # take steps to end). Not the error thrown in at once: the child would
            # run on after its merge_fn, and the run, had ended.
            remaining = step_through(coro, resume=(yielded, None))
        else:  # nothing to cancel (a bare yield; a future already done): into coro
            remaining = step_through(coro, resume=(None, exc))
    else:
        remaining = step_through(coro, resume=(yielded, None))
    if group is None:
        return (yield from remaining)
    return (yield from group._merged(remaining, number, None))


@types.coroutine
def _value_yielded(coro: Any) -> Any:
    """``coro`` awaited, its value yielded rather than returned when it ends (this
    then ends when resumed): stepped by ``send()`` from Python code, a generator's
    return raises a StopIteration. Suspended in ``coro`` (``gi_yieldfrom`` is set)
    while ``coro`` is, at its own yield once ``coro`` has ended."""
    yield (yield from coro)


async def _traced(tracer: Tracer, coro: Any, track: int, run: int) -> Any:
    """A replica's coroutine, recorded as a span on its track (only while tracing)."""
    start = tracer.now()
    outcome = "returned"
    try:
        return await coro
    except BaseException as exc:
        outcome = f"raised {type(exc).__name__}"
        raise
    finally:
        tracer.span(
            f"run {run}",
            "replica",
            track,
            start,
            tracer.now(),
            run=run,
            outcome=outcome,
        )


async def _await(awaitable: Any) -> Any:
    return await awaitable


async def _then(coro: Any, after: Callable[[], None]) -> Any:
    """Await ``coro``, then call ``after()`` however it ends."""
    try:
        return await coro
    finally:
        after()


async def _call(fn: Callable, args: Sequence, kwargs: dict) -> object:
    """A plain replica function, called inside its task; its result awaited if awaitable."""
    result = fn(*args, **kwargs)
    if _awaitable(result):
        result = await result
    return result


async def _replica(
    group: RunGroup, rid: int, state: _State, coro: Any, call: tuple | None = None
) -> Any:
    """Replica ``rid``'s task: it awaits ``coro``, or, given ``call`` = (fn, args,
    kwargs) of a plain function, calls it inside the task and awaits its result if
    that is awaitable (``_call`` in this frame).

    It first makes the replica's state current in the task's own context (a copy of
    the caller's, made by the task): 0.2 us less per replica than setting it in the
    context beforehand with Context.run. It tells its run that the replica returned
    from inside the task's last step, in this frame: no done callback (a loop handle
    and a Python call per replica per run, about 0.7 us each), no method call (0.2
    us). A failure is handed to the run by a callback queued behind what is already
    queued (see RunGroup._replica_raised)."""
    set_state(state)
    try:
        if call is None:
            result = await coro
        else:
            fn, args, kwargs = call
            # (No dict built for empty kwargs: see _coroutines.)
            result = fn(*args, **kwargs) if kwargs else fn(*args)
            if _awaitable(result):
                result = await result
    except BaseException as exc:
        group._replica_raised(rid, exc)
        raise
    rendezvous = group._rendezvous
    if rendezvous is not None:
        if rendezvous._pending:  # calls in flight: those it never joined fail now
            rendezvous.replica_exited(rid, "returned")
        else:  # the usual case: noted, as replica_exited would (see Rendezvous.exited)
            rendezvous.exited[rid] = "returned"
    group._results[rid] = result
    group._remaining -= 1
    if not group._remaining:
        # (No done() test first: a try costs nothing until it catches; nor
        # contextlib.suppress, a context manager per run. 0.3k instructions of a (c)
        # step.)
        try:  # noqa: SIM105
            group._all_done.set_result(None)
        except asyncio.InvalidStateError:  # the run was cancelled meanwhile
            pass
    return result


# The wrappers a replica's (see _coroutines) or a merge_fn's (see _merge) coroutine
# may be made of.
_WRAPPER_CODES = frozenset(f.__code__ for f in (_replica, _traced, drive, _then, _await))

_MAY_HOLD_DISTRIBUTED = (DistributedValues, list, tuple, dict)


def _may_hold_distributed(values: Any) -> bool:
    """False when no element of ``values`` is, or may contain, a distributed value."""
    return any(isinstance(v, _MAY_HOLD_DISTRIBUTED) for v in values)


class ReplicaSlot(NamedTuple):
    """Where one replica runs: its id, device, backend and stream (None on CPU)."""

    replica_id: int
    device: Device
    backend: Any
    stream: Any


def _mark_retrieved(task: asyncio.Task) -> None:
    """Mark ``task``'s exception retrieved: the run reports it (see _replica_raised)."""
    if not task.cancelled():
        task.exception()


def _retrieved_once_done() -> None:
    """Have the current task's exception marked retrieved once it is done. For a
    KeyboardInterrupt or SystemExit leaving the task's coroutine: raised in an eager
    first step (Python 3.12+, or an eager task factory), it comes out of the task's
    creation at once, and through it out of the run, which raises it; nothing else
    reads the task, whose copy asyncio would log as "Task exception was never
    retrieved"."""
    task = asyncio.current_task()
    if task is not None:
        task.add_done_callback(_mark_retrieved)


def task_names(slots: Sequence[ReplicaSlot]) -> tuple[str, ...]:
    """The names of the replicas' tasks, in slot order (a strategy keeps its own)."""
    return tuple(f"{REPLICA_TASK_PREFIX}{slot.replica_id}" for slot in slots)


class RunGroup:
    """The replicas of one ``strategy.run`` and their rendezvous.

    Attributes that most runs never change and rarely read are class-level
    defaults, and the containers only some runs need are made on first use: a run
    is built on every step, and each attribute set costs. Those every run reads
    (``_failure``, ``_cancelling``, ``_aux``, ``_lane_tracer``, ``_rendezvous``) or
    every run with a collective (``_exits``, ``_finished``) are set in ``__init__``:
    on Python 3.11 a class attribute read through an instance is an unspecialised
    lookup, which cost more than the set (1k instructions per run; ``_rendezvous``,
    read by every replica as it returns and by its first collective: 1.1k of an (a)
    step, 0.4k of a (b) or (c) step; ``_exits`` and ``_finished``: 0.3k of a (b) or
    (c) step).
    """

    _base: contextvars.Context | None = None
    _run_id = 0  # this run's number in the trace being recorded, if any
    _remaining = 0  # replicas still running
    _results: list | tuple = ()  # each replica's result, once it returned (see run)
    _all_done: asyncio.Future | None = None  # set when none is
    _loop: asyncio.AbstractEventLoop | None = None  # the run's loop, once it runs
    _lane = 0  # this run's lane of tracks in the trace being recorded (see _trace)
    # What raised the failure a cancelled run does not raise, when no replica did:
    # an async merge_fn (see _merge_fn_raised, _report_unraised).
    _unraised_by: str | None = None
    # While tracing: call number -> [trace, time it completed, waits still to end].
    _completions: dict[int, list] | None = None

    def __init__(self, strategy: Strategy, slots: tuple[ReplicaSlot, ...]):
        self.strategy = strategy
        self.slots = slots
        self.num_replicas = len(slots)
        # numpy_replicas: every replica's arrays are NumPy arrays (the CPU backend).
        # _on_host: host devices, no streams to make current or to order cross-replica
        # work on.
        if slots is strategy._slots:  # every run of the library: computed once
            self.devices, self.streams = strategy._devices, strategy._streams
            self.numpy_replicas = strategy._numpy_replicas
            # (Two unspecialised attribute loads less, a NamedTuple field's and a
            # class attribute's: 0.3k instructions of a (c) step.)
            self._on_host = strategy._on_host
        else:
            self.devices = tuple(slot.device for slot in slots)
            self.streams = tuple(slot.stream for slot in slots)
            self.numpy_replicas = all(slot.backend is cpu_backend for slot in slots)
            self._on_host = not slots[0].backend.needs_activation
        self._tasks: list[asyncio.Task] = []
        # Made at the first collective: a run whose replicas never meet has none.
        self._rendezvous: Rendezvous | None = None
        # Made on first use: replica exits before the rendezvous existed.
        self._exits: tuple | list = ()
        self._finished = False
        self._failure: BaseException | None = None
        self._cancelling = False  # set once this run cancels its replicas
        # Made on first use: task -> coroutines to close if it never starts.
        self._aux: tuple | dict = ()
        # The trace that lent this run its lane, while the run holds it.
        self._lane_tracer: Tracer | None = None
        # The function this run's last merge_call passed, and that call's signature
        # (see ReplicaContext.merge_call): kept by the run while it runs, by nothing
        # once it ends (dropped then: a merge_fn's closure may reach the run).
        self._merge_fn: Any = _NO_MERGE_FN
        self._merge_signature: Any = None

    def __repr__(self) -> str:
        return f"<RunGroup replicas={self.num_replicas} {self._rendezvous!r}>"

    # -- collectives (called by ReplicaContext) -----------------------------------

    @property
    def rendezvous(self) -> Rendezvous:
        """The group's rendezvous engine, made at the first collective call."""
        if self._rendezvous is None:
            loop = self._loop or get_running_loop()
            # (The watchdog finds this run in its strategy's _live_groups: see _stall.)
            ensure = ensure_for(loop)
            # (Positional: keyword arguments to a class cost a dict per call.)
            self._rendezvous = Rendezvous(
                self.num_replicas,
                self._execute,
                ensure,
                self._loop,
                True,  # keeps_failures: run() closes it (see Rendezvous.close)
                self.strategy._counters,  # tally
            )
            # The usual run: no replica has finished yet, and the run has not. (One
            # test, no loop over the empty _exits: 0.3k instructions of a (b) or (c) step.)
            if self._remaining == self.num_replicas and not self._exits and not self._finished:
                return self._rendezvous
            # Replicas that returned before any collective (the failed ones are in
            # _exits): each stored its result in the step that returned, and this
            # runs in a later one.
            if self._remaining < self.num_replicas:  # some replica has returned
                # (Known by the result it stored, not by its task: a task factory's
                # wrapper may still be running after the replica's function returned.)
                # (None for the default group, which runs nothing.)
                for slot, result in zip(self.slots, self._results, strict=False):
                    if result is not _NO_RESULT:
                        self._rendezvous.replica_exited(slot.replica_id, "returned")
            for replica, how in self._exits:
                self._rendezvous.replica_exited(replica, how)
            if self._finished:
                self._rendezvous.close()
        return self._rendezvous

    def _replica_exited(self, replica: int, how: str) -> None:
        if self._rendezvous is None:
            if type(self._exits) is tuple:  # the first exit before a rendezvous
                self._exits = []
            self._exits.append((replica, how))
        else:
            self._rendezvous.replica_exited(replica, how)

    def _has_exited(self, replica: int) -> bool:
        """Whether ``_replica_exited`` has noted ``replica``'s exit."""
        if self._rendezvous is None:
            return any(noted == replica for noted, _ in self._exits)
        return replica in self._rendezvous.exited

    def arrive(
        self, replica_id: int, signature: Signature, payload: Any, options: CommunicationOptions
    ) -> asyncio.Future:
        rendezvous = self._rendezvous or self.rendezvous
        tracer = _trace.active
        if tracer is None:
            return rendezvous.arrive(
                replica_id,
                signature,
                payload,
                options.timeout_seconds,
                options.stall_warning_seconds,
            )
        # Noted before arriving: the last arrival completes the call.
        waited = self._trace_arrival(tracer, replica_id, signature, rendezvous)
        future = rendezvous.arrive(
            replica_id, signature, payload, options.timeout_seconds, options.stall_warning_seconds
        )
        if future.done():  # this arrival completed the call: no wait, and none to hear of
            waited(future)
        else:  # called before the replica's own wake-up, added when it awaits
            future.add_done_callback(waited)
        return future

    def _trace_arrival(
        self, tracer: Tracer, replica_id: int, signature: Signature, rendezvous: Rendezvous
    ) -> Callable[[asyncio.Future], None]:
        """Note a replica's arrival; return the callback that writes its wait span when
        its future is done: completed (the span ends when the collective did), failed
        (a timeout, a mismatch) or cancelled (it ends then)."""
        arrived = tracer.now()
        number = rendezvous._next_number[replica_id]
        label = f"{signature.name} #{number}"
        track = replica_track(replica_id, self._lane_in(tracer))
        tracer.instant(f"arrive {label}", "rendezvous", track, arrived, run=self._run_id)

        def waited(future: asyncio.Future) -> None:
            # The trace recording now (the one it began in may have stopped since),
            # on its own clock.
            target = _trace.active or tracer
            end = target.now()
            completion = self._completions.get(number) if self._completions else None
            if completion is not None:  # one callback per replica: the last drops it
                completion[2] -= 1
                if completion[2] == 0:
                    del self._completions[number]
                if completion[0] is target and not future.cancelled():
                    end = completion[1]
            if target is tracer:
                start, where = arrived, track
            else:  # on the run's tracks in that trace
                start = target.rebased(arrived, tracer)
                where = replica_track(replica_id, self._lane_in(target))
            # Not future.exception(): that would mark a failure retrieved, and hide it
            # from asyncio's "never retrieved" report for a call nobody awaited.
            extra = {"outcome": "cancelled"} if future.cancelled() else {}
            target.span(f"wait {label}", "rendezvous", where, start, end, **extra)

        return waited

    # -- the run ----------------------------------------------------------------------

    async def run(self, fn: Callable, args: Sequence, kwargs: dict) -> object:
        # Kept for the run's other uses: asyncio.get_running_loop() is a system call
        # (getpid) each time.
        self._loop = loop = asyncio.get_running_loop()
        # The caller's context (each replica's task copies it too; merge_fns run in
        # copies of this one).
        self._base = contextvars.copy_context()
        self._all_done = all_done = loop.create_future()
        n = self._remaining = self.num_replicas
        # Each replica's result, stored by its task as it returns (saves a Task.result()
        # call per replica).
        self._results = [_NO_RESULT] * n
        slots = self.slots
        strategy = self.strategy
        code = getattr(fn, "__code__", None)
        is_async = code is not None and code.co_flags & CO_COROUTINE
        # Arguments holding no distributed value (the common case) go to every replica
        # as they are.
        plain_args = (not args or not _may_hold_distributed(args)) and (
            not kwargs or not _may_hold_distributed(kwargs.values())
        )
        if (
            is_async
            and plain_args
            and _trace.active is None
            and self.numpy_replicas
            and slots is strategy._slots
        ):
            # The usual run (an async def on host replicas, arguments for all, not
            # traced): its coroutines made here, not by _coroutines (a call less per
            # run: 0.9k instructions of a (c) step, 0.8k of a (b) one). One frame per
            # replica, no slot fields read (a NamedTuple field costs an unspecialised
            # attribute lookup on Python 3.11). fn(*args) when there are no keyword
            # arguments: fn(*args, **kwargs) builds a dict on every call, even from an
            # empty one (0.2k instructions per replica).
            make = partial(fn, **kwargs) if kwargs else fn
            contexts = strategy._replica_contexts
            coroutines = []
            # (Counted by hand, not enumerate(): no enumerate object and iterator made
            # per run. And coroutines.append called as a method, not a bound one kept:
            # a specialised call, and no method object. 0.6k instructions of a (c)
            # step together.)
            rid = 0
            try:
                while rid < n:
                    state = (strategy, contexts[rid], True, self)
                    # make() without arguments (the usual run) is a specialised call;
                    # make(*args) is not, even with none (0.4k instructions of a (c)
                    # step).
                    coro = make(*args) if args else make()
                    coroutines.append(_replica(self, rid, state, coro))
                    rid += 1
            except BaseException:  # fn's arguments refused: nothing will await these
                for coro in coroutines:
                    _close_unstarted(coro)
                raise
        else:
            # (A plain function, as (a)'s, is told by the code already read: no call
            # for it, 0.8k instructions of an (a) step.)
            if (
                code.co_flags & CO_ASYNC_GENERATOR
                if code is not None
                else async_generator_function(fn)
            ):
                raise InvalidArgumentError(
                    f"run: fn={fn!r} is an async generator function (an async def with "
                    "yield in it); expected an async def function that returns its "
                    "result. Return the values (a list of them) instead of yielding "
                    "them, or run the step once per value."
                )
            coroutines = self._coroutines(fn, args, kwargs, is_async, plain_args)
            if not self._on_host:
                # GPUs: the replicas' work waits for what the caller queued on the
                # devices' current streams (the arguments may be made there); replica
                # streams are non-blocking, so nothing else orders them after it.
                self.slots[0].backend.order_replicas_after(self.slots)
        strategy._live_groups.add(self)
        # Without a custom task factory, building the Task directly is what
        # loop.create_task does, minus uvloop's separate set_name() call per task
        # (about 0.4 us per replica per run). On Python 3.12+ it starts eagerly: its
        # first step runs at once, with its own task current, so replicas that never
        # suspend are done before this loop ends and the run returns without waiting
        # for the loop (3.5 us less per (a) step, 1.5 us per (b) step, N = 4).
        tasks = self._tasks
        names = strategy._task_names if slots is strategy._slots else task_names(slots)
        try:
            # (Equal lengths by construction: zip(strict=True) would parse a keyword
            # argument on every run.)
            if loop.get_task_factory() is None:
                # A loop of its own for this case: no slots zipped, no test per replica
                # (0.8k instructions of a (c) step, N = 4).
                # (Each name by the count of tasks made, not zip(names, coroutines): no
                # zip, iterator and pair made per run: 1.3k instructions of a (c) step.)
                if _NATIVE_EAGER:  # (Python 3.12.1's eager start needs its loop= given)
                    for coro in coroutines:
                        tasks.append(_eager_task(coro, loop=loop, name=names[len(tasks)]))
                else:
                    # No loop=: the task takes the running loop, this one; a keyword
                    # argument less for Task's __init__ to parse, per replica (1.1k
                    # instructions of a (c) step).
                    # (_ReplicaTask: C's Task, which a replica cancelled before its
                    # first step cannot leave waiting; see there.)
                    for coro in coroutines:
                        tasks.append(_ReplicaTask(coro, name=names[len(tasks)]))
                await all_done
            else:
                for slot, name, coro in zip(slots, names, coroutines):  # noqa: B905
                    context = self._base.copy()  # a custom factory sees the replica's state
                    context.run(set_state, self._state(slot.replica_id))
                    try:
                        task = loop.create_task(coro, name=name, context=context)
                        tasks.append(task)
                    except BaseException as exc:
                        # The factory failed: the run fails with its error, as when a
                        # replica raises (the tasks made have not run, unless the factory
                        # is eager). Close what will never start: the coroutines no task
                        # holds, and those beneath what a task holds (gone from reach
                        # once it ends).
                        self._failure = exc
                        self._cancel_all()
                        for i, each in enumerate(coroutines):
                            _close_unstarted(each, own=i >= len(tasks))
                        break
                    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                        # Not started by the factory (an eager one): something may
                        # cancel the task before its first step, which the run then
                        # hears of from here (see _ReplicaTask, and
                        # _replica_task_ended).
                        task.add_done_callback(
                            partial(
                                self._replica_task_ended, slot.replica_id, _unstarted_chain(coro)
                            )
                        )
                else:
                    await all_done
            if self._cancelling or self._aux:  # replicas cancelled after a failure, or
                await self._drain()  # merge_fns still running for collectives nobody awaited
            rendezvous = self._rendezvous
            if rendezvous is not None and rendezvous._failed and self._failure is None:
                # A collective failed, and the run may have to raise it if no replica
                # retrieved its error (see close() below): first a loop turn, so that
                # done callbacks already queued (a replica's reading it) have run. (On
                # Python 3.12+ the replicas may all have returned in their eager first
                # steps, with no turn of the loop since.)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._cancel_all()
            try:
                await self._drain()
            finally:
                if self._failure is not None:  # a failure the run will not raise
                    self._report_unraised()
            raise
        except (KeyboardInterrupt, SystemExit) as exc:
            # Python 3.12+: a replica's first step, which runs as its task is made
            # above, raised one of these two (itself, or through a merge_fn its arrival
            # completed), and asyncio let it through at once, out of the task's
            # creation (a later step's would stop the loop instead). The run fails
            # with it as with any replica's failure: the replicas already started are
            # cancelled and waited for, then it is raised, the same object. (Also one
            # raised by a signal handler while this frame runs.)
            self._failure = exc
            self._cancel_all()
            await self._drain()
        finally:
            self._finished = True
            if not self._on_host:
                # GPUs: the caller's later work on the current streams (reading the
                # results; reusing the memory of arguments it drops) waits for the
                # replicas' work.
                self.slots[0].backend.order_after_replicas(self.slots)
            if len(tasks) < n:  # the task factory failed: a coroutine a task was given
                for coro in coroutines:  # may still be unstarted, if the factory wrapped
                    _close_unstarted(coro)  # it in one of its own
            if self._lane_tracer is not None:  # only while tracing
                self._free_lane()
            strategy._live_groups.discard(self)
            strategy._counters.runs += 1  # (its collectives were counted as they completed)
            if self._rendezvous is not None:
                # Quiet when the run failed or was cancelled (_cancel_all sets
                # _cancelling): run raises that, and the failures of collectives a
                # replica started and never awaited are not logged besides. (The usual
                # run's call without a keyword argument: a specialised call, 0.2k
                # instructions of a (c) step.)
                try:  # (costs nothing until it catches)
                    if self._failure is None and not self._cancelling:
                        # Every replica returned, but a collective one of them started
                        # and none awaited may have failed (a mismatch, a replica that
                        # never joined it, a timeout, its merge_fn): close() returns the
                        # first such error, which the run raises (None, the usual: it
                        # returns).
                        self._failure = self._rendezvous.close()
                    else:
                        self._rendezvous.close(quiet=True)
                except RuntimeError:
                    if not self._loop.is_closed():
                        raise
                    # Its loop was closed with the run in flight, and the garbage
                    # collector closes this coroutine (see _replica_raised): failing a
                    # replica's wait schedules its wake-up, which the closed loop
                    # refuses. Nobody is left to wake.
            # Break group -> task -> context -> state -> group, so a finished run is
            # freed by reference counting instead of becoming cyclic garbage. (The
            # empty tuple, not a new list: 0.3k instructions of an (a), (b) or (c)
            # step.)
            self._tasks = ()
            # And run -> merge_fn -> its closure -> a task -> context -> run (the
            # function the last merge_call passed: see ReplicaContext.merge_call).
            self._merge_fn, self._merge_signature = _NO_MERGE_FN, None
            # And the caller's context, copied (what it holds: a failed run's kept
            # traceback holds this group; multi-worker's run is in it).
            self._base = None
        if self._failure is not None:
            # Its traceback will hold this frame: nothing the frame reaches may hold
            # it, or every failed run is a cycle left to the garbage collector. So the
            # run drops it (taken by a call: no local of this frame holds it), and the
            # list of the replicas' tasks (whose failed one holds it) is dropped too.
            tasks = coroutines = None
            raise self._take_failure()
        results = self._results
        first = results[0]
        # regroup's first case written out: every replica returned the same object
        # (a merge_call's result, a constant). A call less per run: 0.8k instructions
        # of a (c) step. (And a loop here, not _nest.all_are(): a call less again,
        # 0.8k instructions of a (c) step.)
        for result in results:
            if result is not first:
                return regroup(results, self.devices)
        return first

    def _report_unraised(self) -> None:
        """The run was cancelled, and raises CancelledError (as documented), not its
        failure: a replica's error raised meanwhile (often its cleanup failing as it
        is cancelled), or just before. Reported to the loop's exception handler, as
        asyncio reports an error that nobody can receive, instead of dropped without
        a trace (the replicas' tasks are marked retrieved: see _drain)."""
        failure = self._take_failure()
        who = "the run failed with"
        where = "replica function"
        if self._unraised_by is not None:  # an async merge_fn's (see _merge_fn_raised)
            who, where = f"{self._unraised_by} raised", "merge_fn"
        for rid, task in enumerate(self._tasks):
            if task.done() and not task.cancelled() and task.exception() is failure:
                who = f"replica {self.strategy._replica_offset + rid} raised"
                where = "replica function"
                break
        self._loop.call_exception_handler(
            {
                "message": (
                    "strategy.run() was cancelled (its caller was, or an asyncio.timeout() "
                    f"around it expired), so it raises CancelledError; meanwhile {who} "
                    f"{type(failure).__name__}: {failure}, which is reported here instead. "
                    f"Handle errors in the {where}'s cleanup (except "
                    "asyncio.CancelledError:, finally:) if they are expected."
                ),
                "exception": failure,
            }
        )

    def _take_failure(self) -> BaseException:
        """The run's failure, which it no longer holds (see run)."""
        failure, self._failure = self._failure, None
        return failure

    def _replica_raised(self, rid: int, exc: BaseException) -> None:
        """Replica ``rid``'s function raised ``exc`` or was cancelled (called in its
        task's last step). The run learns of it from a callback queued now: it runs
        after the wake-ups already queued, such as those of every replica waiting in a
        collective that just failed, so each of them raises the shared error before
        the others are cancelled. (``exc`` itself, not read from the task: a task
        factory's wrapper may still be running when the callback runs.)"""
        if self._loop.is_closed():
            # Its loop was closed with the run in flight, and the garbage collector
            # closes the coroutine (a GeneratorExit here): nothing to tell, and
            # call_soon would raise. (Not a test of GeneratorExit itself: a replica
            # that raises one fails its run as any other error does.)
            return
        self._loop.call_soon(self._replica_failed, rid, exc)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            # Raised in a task's first step (Python 3.12+), these come out of the
            # task's creation (see run), so the task never joins the run's list, whose
            # failures _drain marks retrieved: this one is, once done, or asyncio logs
            # "Task exception was never retrieved" for what run raised itself.
            _retrieved_once_done()

    def _state(self, rid: int) -> _State:
        """Replica ``rid``'s context state in this run (a merge_fn's has no replica
        and no group: see ``_cross_replica_context``)."""
        return (self.strategy, self.strategy._replica_contexts[rid], True, self)

    def _coroutines(
        self, fn: Callable, args: Sequence, kwargs: dict, is_async: Any, plain_args: bool
    ) -> list:
        """One coroutine per replica (what its task runs), made before any task starts
        (the usual run's are made by ``run`` itself). ``is_async``: ``fn`` is an
        ``async def`` function; ``plain_args``: no argument holds a distributed value
        (as ``run`` found both).

        An ``async def`` function's own coroutine is awaited by ``_replica``; a plain
        function is called inside the task by ``_replica`` (or ``_call``, when
        the replica's coroutine is wrapped further), in the replica's context.
        Arguments holding no distributed value (the common case) go to every replica
        as they are.
        """
        n = self.num_replicas
        tracer = _trace.active
        if tracer is not None:
            self._lane_in(tracer)  # (freed by run())
        coroutines: list = []
        try:
            if not plain_args:  # each replica's, all at once (see select_replicas)
                args_of = select_replicas(tuple(args), n)
                # (No kwargs, the usual: the empty dict as it is, not rebuilt.)
                kwargs_of = select_replicas(kwargs, n) if kwargs else None
            for slot in self.slots:
                rid = slot.replica_id
                state = self._state(rid)
                if plain_args:
                    replica_args, replica_kwargs = args, kwargs
                else:
                    replica_args = args_of[rid]
                    replica_kwargs = kwargs_of[rid] if kwargs_of is not None else kwargs
                backend = slot.backend
                if not is_async and tracer is None and not backend.needs_activation:
                    call = (fn, replica_args, replica_kwargs)
                    coroutines.append(_replica(self, rid, state, None, call))
                    continue
                if is_async:
                    coro = fn(*replica_args, **replica_kwargs)
                else:
                    coro = _call(fn, replica_args, replica_kwargs)
                if backend.needs_activation:
                    coro = drive(
                        coro,
                        partial(backend.activate, slot.device, slot.stream),
                        backend.deactivate,
                    )
                if tracer is not None:
                    coro = _traced(tracer, coro, replica_track(rid, self._lane), self._run_id)
                coroutines.append(_replica(self, rid, state, coro))
        except BaseException:
            for coro in coroutines:
                _close_unstarted(coro)
            self._free_lane()
            raise
        return coroutines

    def _free_lane(self) -> None:
        if self._lane_tracer is not None:
            self._lane_tracer.free_lane(self._lane)
            self._lane_tracer = None

    def _lane_in(self, tracer: Tracer) -> int:
        """This run's lane in ``tracer``'s trace: the one it took as it started, or,
        for a run begun before that trace (untraced, or in one that has stopped since),
        one taken now, with a run number of that trace (freed by run(), as the first):
        its spans never share the tracks of a run that started in the trace. (Not once
        the run has ended: a late span keeps its last lane, which nothing would free.)"""
        if self._lane_tracer is not tracer and not self._finished:
            self._free_lane()  # (the stopped trace's, if any)
            self._run_id = tracer.next_run()
            self._lane, self._lane_tracer = tracer.take_lane(), tracer
        return self._lane

    def _replica_failed(self, rid: int, exc: BaseException) -> None:
        """Replica ``rid``'s function raised ``exc`` or was cancelled: record the run's
        failure, tell the rendezvous, and let the run finish (it waits for every task
        in ``_drain``)."""
        if self._finished:  # the run raised it already (see run's SystemExit case)
            return
        if isinstance(exc, asyncio.CancelledError):
            if not self._cancelling and self._failure is None:
                # Cancelled by something other than this run: it cannot finish.
                self._failure = ReplicaExitedError(
                    f"replica {self.strategy._replica_offset + rid} was cancelled by "
                    "something other than its run (for example "
                    "asyncio.current_task().cancel() in the replica function), so "
                    "the run has no result for it; raise an exception to fail a replica."
                )
                if exc.__traceback__ is not None:  # (one made here has none to show)
                    # Chained: its traceback shows where the replica was, and its
                    # message, if any, who cancelled it (task.cancel(msg)).
                    self._failure.__cause__ = exc
                self._cancel_all()
            self._replica_exited(rid, "was cancelled")
        else:
            if self._failure is None:  # the run re-raises the first failure
                self._failure = exc
                self._note_replica(rid, exc)
                self._cancel_all()
            self._replica_exited(rid, f"raised {type(exc).__name__}")
        # Other replicas may not have reported back yet (one cancelled before its
        # first step does through _replica_task_ended): the run waits for the tasks
        # themselves (_drain).
        if not self._all_done.done():
            self._all_done.set_result(None)

    def _note_replica(self, rid: int, exc: BaseException) -> None:
        """Note on ``exc``, the error the run raises, which replica raised it: its
        traceback shows the replica function's frames, but not which replica ran
        them. Not where there is one replica, nor on what is not an Exception
        (KeyboardInterrupt, SystemExit), nor on a failed collective's error (a
        mismatch, a timeout, a merge_fn's exception): every replica waiting in it
        raised that one alike, and its message names the replicas itself."""
        strategy = self.strategy
        if self.num_replicas == 1 or not isinstance(exc, Exception):
            return
        failed = self._rendezvous._failed if self._rendezvous is not None else None
        if failed and any(call.failure is exc for call in failed):
            return
        note = (
            f"(raised in replica {strategy._replica_offset + rid} of "
            f"{strategy.num_replicas_in_sync}, on {self.devices[rid]}, by strategy.run)"
        )
        notes = getattr(exc, "__notes__", None)
        # Once: a replica may raise one object again and again, run after run. (An
        # exception whose __notes__ is no list refuses notes: it is left as it is.)
        if notes is None or (type(notes) is list and note not in notes):
            exc.add_note(note)

    def _replica_task_ended(self, rid: int, unstarted: list, task: asyncio.Task) -> None:
        """Done callback of replica ``rid``'s task, where it may have been cancelled
        before its first step (with a task factory; on Python 3.11 without one, added
        by ``_ReplicaTask.cancel``). ``unstarted``: its replica coroutine and those
        beneath it (``_unstarted_chain``).

        Cancelled then, the task never ran ``_replica``, which tells the run how a
        replica ended: this tells it instead, as ``_replica`` does for a replica
        cancelled later (``_replica_failed``: ReplicaExitedError unless the run
        cancelled it itself), so the run ends rather than waiting for that replica
        for ever. The coroutines that never started are closed, so Python does not
        warn that they were never awaited."""
        started = inspect.getcoroutinestate(unstarted[0]) != inspect.CORO_CREATED
        _close_chain(unstarted)
        if self._results[rid] is not _NO_RESULT:
            return
        if task.cancelled():
            exc: BaseException = asyncio.CancelledError()
        elif started:  # _replica ran, and told the run how the replica ended
            return
        else:
            # A task factory's own coroutine ended before it started the replica's:
            # it raised (the run fails with that, as with a replica's exception), or
            # returned without awaiting it.
            exc = task.exception() or ReplicaExitedError(
                f"replica {self.strategy._replica_offset + rid}'s task ended without "
                "running the replica function: the task factory's coroutine returned "
                "without awaiting the one it was given; "
                "a task factory must return a task that awaits the coroutine it is given."
            )
        # A replica that ran and raised or was cancelled has told the run already
        # (_replica_failed, queued before this callback): its exit is noted.
        if not self._has_exited(rid):
            self._replica_failed(rid, exc)

    def _cancel_all(self) -> None:
        self._cancelling = True
        current = asyncio.current_task()
        for task in (*self._tasks, *self._aux):
            if task is not current and not task.done():
                task.cancel()
        for task, unstarted in tuple(self._aux.items()) if self._aux else ():
            if (
                unstarted
                and not task.done()  # (get_coro() of an eager task done is None, or
                # crashes Python 3.12.1)
                and inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED
            ):
                # Cancelled before its first step (the run failed as the last replica
                # arrived): merge_fn's coroutine is never awaited; closed, Python does
                # not warn about it.
                for coro in unstarted:
                    _close_unstarted(coro)

    async def _drain(self) -> None:
        """Wait until every replica and merge task has finished, even if cancelled
        meanwhile; then a cancellation that arrived meanwhile is raised (asyncio's
        rule: a caught CancelledError is not swallowed)."""
        cancelled = None
        while pending := [t for t in (*self._tasks, *self._aux) if not t.done()]:
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError as exc:
                cancelled = cancelled or exc
                self._cancel_all()
        if self._aux:
            # Merge tasks that have ended with their done callbacks still queued: the
            # rendezvous' delivery of each call, and its leaving the table (see
            # _untrack). One loop turn runs them, so the run closes its rendezvous
            # with every call it ran delivered.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError as exc:
                cancelled = cancelled or exc
        # The replicas' failures are the run's to report (it raises the first): each
        # marked retrieved, so asyncio does not log them again as never retrieved.
        for task in self._tasks:
            _mark_retrieved(task)
        if cancelled is not None:
            raise cancelled

    # -- cross-replica execution (called once per completed collective) -------------

    def _execute(self, number: int, signature: Signature, payloads: list) -> Any:
        """Run collective ``number`` once (the rendezvous calls this when every replica
        has arrived): the per-replica results, or a future of them."""
        tracer = _trace.active
        if tracer is None:  # not tracing: straight to the work
            if self._on_host:  # _execute_now's first case, one call sooner: with
                # all_reduce's direct arrival, 0.5 us less per (b) step
                if signature.name == "merge_call":
                    return self._merge(number, payloads, None, None)
                return self._collective(number, signature, payloads)
            return self._execute_now(number, signature, payloads)
        return self._execute_traced(tracer, number, signature, payloads)

    def _execute_traced(
        self, tracer: Tracer, number: int, signature: Signature, payloads: list
    ) -> Any:
        start = tracer.now()
        label = f"{signature.name} #{number}"
        self._lane_in(tracer)
        try:
            result = self._execute_now(number, signature, payloads)
        except BaseException as exc:  # (a sync merge_fn that raised: its span all the same)
            self._trace_collective(
                tracer, number, label, start, outcome=f"raised {type(exc).__name__}"
            )
            raise

        def done(finished: object = None) -> None:
            # How an async merge_fn's task ended: one that raised or was cancelled
            # (timeout_seconds) has that outcome, as a sync merge_fn that raised does.
            # (Its exception is the rendezvous' to deliver, which retrieves it too.)
            extra = {}
            if isinstance(finished, asyncio.Future):
                if finished.cancelled():
                    extra["outcome"] = "cancelled"
                elif (exc := finished.exception()) is not None:
                    extra["outcome"] = f"raised {type(exc).__name__}"
            self._trace_collective(tracer, number, label, start, **extra)

        if isinstance(result, asyncio.Future) and not result.done():
            result.add_done_callback(done)
        else:  # (a done future: an eager merge task, delivered at once)
            done(result)
        return result

    def _trace_collective(
        self, tracer: Tracer, number: int, label: str, start: float, **extra: Any
    ) -> None:
        """Write collective ``number``'s cross-replica span, from ``start`` to now."""
        end = tracer.now()
        # Each replica's wait ends here, not when its callback runs (later, if the
        # loop is busy); its wait span is written by that callback (_trace_arrival).
        if self._completions is None:
            self._completions = {}
        self._completions[number] = [tracer, end, self.num_replicas]
        tracer.span(
            label,
            "collective",
            cross_replica_track(self._lane),
            start,
            end,
            run=self._run_id,
            replicas=self.num_replicas,
            **extra,
        )

    def _execute_now(self, number: int, signature: Signature, payloads: list) -> Any:
        if self._on_host:  # no streams to order
            if signature.name == "merge_call":
                return self._merge(number, payloads, None, None)
            return self._collective(number, signature, payloads)
        backend = self.slots[0].backend
        ops = self.strategy.extended._cross_device_ops
        if signature.name != "merge_call" and ops._on_replica_streams:
            return self._collective(number, signature, payloads)  # NCCL: on replica streams
        # Cross streams wait for every replica's queued work, are current while the
        # work is issued, and every replica's later work waits for them.
        order = backend.begin_cross_replica(self.slots, ops._gather_device(self.devices))
        saved = backend.enter_cross_replica(order)
        if signature.name == "merge_call":
            try:
                return self._merge(number, payloads, backend, order)
            finally:
                backend.leave_cross_replica(saved)
        try:
            return self._collective(number, signature, payloads)
        finally:
            backend.leave_cross_replica(saved)
            backend.end_cross_replica(order, self.slots)

    def _count_bytes(self, name: str, payloads: list) -> None:
        """Statistics: the input bytes of an all-reduce or all-gather, added to the
        strategy's totals. Each group's ``_collective`` counts what it is given
        (RunGroup's counts a one-array all-reduce itself, from the arrays it has)."""
        if name == "all_reduce":  # one shape per leaf on every replica
            nbytes = sum(map(_NBYTES, payloads[0][ARRAYS])) * self.num_replicas
        else:  # shapes may differ along the gathered axis
            nbytes = sum(sum(map(_NBYTES, p[ARRAYS])) for p in payloads)
        self.strategy._counters.bytes_reduced += nbytes

    def _collective(self, number: int, signature: Signature, payloads: list) -> Any:
        strategy = self.strategy
        ops = strategy._extended._cross_device_ops  # not the property: per call
        # An all-reduce's payload: (template, arrays, op, options); an all-gather's has
        # the axis for the op.
        template, _, op_or_axis, options = payloads[0]
        devices, streams = self.devices, self.streams
        if template is None and signature.name == "all_reduce":  # one array each
            # (A loop, not a list comprehension: no function object and frame made
            # for it, 1.0k instructions of a (b) step.)
            arrays = []
            for payload in payloads:
                arrays.append(payload[ARRAYS][0])
            # (No call inside the +=: see Rendezvous._complete.)
            nbytes = arrays[0].nbytes * len(arrays)
            strategy._counters.bytes_reduced += nbytes
            return ops._all_reduce_one(op_or_axis, arrays, devices, options, streams)
        self._count_bytes(signature.name, payloads)
        arrays = [payload[ARRAYS] for payload in payloads]
        if signature.name == "all_reduce":
            # The signature's key holds the leaves' dtypes and shapes: (op, skeleton,
            # dtypes, shapes).
            layout = signature.key[2:]
            out = ops._all_reduce_laid_out(op_or_axis, arrays, devices, options, streams, layout)
        else:
            out = ops._all_gather_flat(arrays, op_or_axis, devices, options, streams)
        return self._per_replica(payloads, out, signature.key[1])  # both keys' skeleton

    @staticmethod
    def _per_replica(payloads: list, out: list[list], skeleton: object = None) -> list:
        """Each replica's result: its leaves ``out[r]`` in the structure it passed
        (``skeleton``: that structure's, from the signature, if the caller has it)."""
        template = payloads[0][TEMPLATE]
        if template is None:  # one array each (signatures matched)
            return [leaves[0] for leaves in out]
        if type(template) is list and (
            # a flat list's skeleton is ("list", length); a nested one's holds a tuple
            type(skeleton[1]) is int if skeleton is not None else not _nest.any_nested(template)
        ):
            # A flat list, and the signatures matched, so every replica passed one:
            # its list of leaves is its result (each a new list).
            return out
        return [_nest.pack_as(p[TEMPLATE], leaves) for p, leaves in zip(payloads, out, strict=True)]

    def _spawn(
        self,
        coro: Any,
        context: contextvars.Context | None = None,
        *,
        unstarted: tuple = (),
        eager: bool = False,
        name: str | None = None,
    ) -> asyncio.Task:
        """A task doing cross-replica work for this run: cancelled with the run's
        replicas and waited for by ``_drain``, in whose table it stays until its done
        callbacks run (see ``_untrack``). ``unstarted``: coroutines ``coro`` would
        await, closed by ``_cancel_all`` if the task is cancelled before its first
        step (never awaited otherwise).
        ``name``: the task's (an async merge_fn's is ``MERGE_TASK_NAME``).

        ``eager`` (Python 3.12+, without a custom task factory; on 3.11 ``_merge``
        starts its task eagerly itself instead): the task's first step
        runs now, inside this call, with the task current, as asyncio's eager tasks
        do. A merge_fn that never suspends (one reducing host values) is then done
        before its merge_call returns, and the rendezvous delivers its result at once:
        no loop turn for the task's first step, none for its done callback (about
        2.5 us less per merge_call, a tenth of a (c) step)."""
        loop = self._loop or get_running_loop()
        aux = self._aux_table()
        if loop.get_task_factory() is None:  # as in run(): no separate set_name()
            if eager:
                task = _eager_task(coro, loop=loop, name=name, context=context)
            else:
                task = asyncio.Task(coro, loop=loop, name=name, context=context)
        else:
            try:
                task = loop.create_task(coro, name=name, context=context)
            except BaseException:  # the factory failed: nothing will await them
                for each in (coro, *unstarted):
                    _close_unstarted(each)
                raise
            if unstarted:  # the factory's task may wrap coro: closed with the rest if
                unstarted = (coro, *unstarted)  # the task is cancelled unstarted
        if task.done():  # run to its end eagerly: nothing to wait for
            return task
        aux[task] = unstarted
        task.add_done_callback(self._untrack)
        return task

    def _aux_table(self) -> dict:
        """The run's table of cross-replica tasks, made by the first of them before its
        task exists (an eager one may run to its end, and leave the table, at once)."""
        if type(self._aux) is tuple:
            self._aux = {}
        return self._aux

    def _merge(self, number: int, payloads: list[Payload], backend: Any, order: object) -> Any:
        """Run ``merge_fn`` once. ``backend`` and ``order`` are set on devices with
        streams: the cross-replica work is then finished with ``end_cross_replica``
        once issued, and an async ``merge_fn`` steps with the cross streams current."""

        # On the host: nothing to finish. (No closure here: its variables would be
        # cells, made on every call, as for _for_each_replica below.)
        issued = _nothing
        if backend is not None:
            issued = _once(backend.end_cross_replica, order, self.slots)
        # Each payload is (merge_fn, args, kwargs): the args gathered, and the kwargs
        # tested, in one Python loop; not zip(*payloads) and all(map(...)) of a
        # partial, which made a zip, a map and four tuples and called the partial
        # per replica (3.3k instructions of a (c) step).
        merge_fn = payloads[0][0]
        args = []
        kwargs = _EMPTY  # none passed any, the usual case: 0.3 us less than regroup
        for _, replica_args, replica_kwargs in payloads:
            args.append(replica_args)
            if replica_kwargs is not _EMPTY:  # (identity: a dict subclass may say == {})
                kwargs = None
        what = "passed to merge_call"
        # merge_call made every args a tuple: their flat case first, without regroup's
        # own tests (a call less), nor a test of their type (kind None).
        merged = _regroup_flat(args, None, self.devices)
        args = regroup(args, self.devices, what=what, path="args") if merged is None else merged
        if kwargs is None:  # some replica passed kwargs
            kwargs = [payload[2] for payload in payloads]
            kwargs = regroup(kwargs, self.devices, what=what, path="kwargs")
        # merge_fn's context: a copy of the run's caller's (the default group, which
        # has no run, copies the current one) in cross-replica state.
        base = self._base
        context = base.copy() if base is not None else contextvars.copy_context()
        strategy = self.strategy
        context.run(set_state, (strategy, None, True, None))
        try:
            # (No **kwargs when there are none: it builds a dict on every call. And
            # Context.run itself, not context.run: no bound method made. 0.5k
            # instructions of a (c) step together.)
            if kwargs is _EMPTY:
                # (One argument, the usual: a call of fixed arguments, not *args, which
                # builds a list and a tuple per call: 0.6k instructions of a (c) step.)
                if len(args) == 1:
                    result = _run_in(context, merge_fn, strategy, args[0])
                else:
                    result = _run_in(context, merge_fn, strategy, *args)
            else:
                result = context.run(merge_fn, strategy, *args, **kwargs)
        except BaseException:
            issued()
            raise
        # (One type test for an async def's coroutine, the usual result, not one for
        # each use below; with own/unstarted worked out only where used: 0.7k
        # instructions of a (c) step.)
        if type(result) is CoroutineType:
            coro = result
        elif _awaitable(result):
            coro = _await(result)
        else:
            issued()
            return self._for_each_replica(result)

        # An async merge_fn runs in a task of its own, never as part of the task of
        # the replica that arrived last: asyncio.timeout(), TaskGroup and
        # current_task() inside it must not reach that replica. Without a custom task
        # factory its first step runs eagerly, during that replica's step but with its
        # own task current (_spawn on Python 3.12+, below on 3.11). The task is what
        # the rendezvous waits for: its result is the list of per-replica results (or
        # that list at once, when merge_fn ended in its first step).
        if backend is not None:  # each of its steps on the cross streams
            coro = drive(
                coro, partial(backend.enter_cross_replica, order), backend.leave_cross_replica
            )
            # Ordered as soon as merge_fn's work is issued, while its arguments are
            # still referenced (their memory is not reused before the replicas wait).
            coro = _then(coro, issued)
        loop = self._loop or get_running_loop()
        timeout = strategy._communication_options.timeout_seconds
        if not _NATIVE_EAGER and loop.get_task_factory() is None:
            if timeout is None:
                # merge_fn's own coroutine stepped directly: _merged (each replica's
                # share) wraps only what follows a first step that suspends (a
                # coroutine less to make and step when it does not: 1.2k instructions
                # of a (c) step).
                body = _first_then_rest(coro, self, number)
            else:  # its timeout scope entered in the first step, before merge_fn starts
                body = _first_then_rest(self._merged(coro, number, timeout))
            # Python 3.11's asyncio.Task(body, eager_start=True), which only 3.12+
            # has: the task's first step runs now, here, in `context` and with the
            # task current (asyncio.current_task(), asyncio.timeout() and TaskGroup
            # inside merge_fn see it, never the replica's task). A merge_fn that never
            # suspends (one reducing host values) thus answers the replicas before the
            # last one's merge_call returns, as on Python 3.12+: no loop turn before
            # it runs, none for a done callback, and the last replica need not
            # suspend ((c), N = 4, uvloop: 263.5k -> 260.1k instructions per step,
            # and 35.0 -> 31.8 us; a loop turn costs more than its count). The task is
            # still made, for its identity (without it a merge_fn's asyncio.timeout()
            # would cancel that replica); its scheduled first step finds the work done
            # (see _first_then_rest). (Here, not in a function of its own returning
            # the task and the outcome: 0.6k instructions of a (c) step.)
            # Named: a task without a name has one formatted for it ("Task-<n>") as it
            # is made (1.4k instructions of a (c) step). No loop=: `loop` is the
            # running one, which the task takes (a keyword argument less to parse:
            # 0.3k).
            task = asyncio.Task(body, name=MERGE_TASK_NAME, context=context)
            # The task made current in asyncio's own table, as 3.12's eager start
            # swaps it. (The table itself, not asyncio.current_task() and
            # _leave_task/_enter_task: one Python call and four C calls less, about
            # 1.5k instructions.)
            current = _current_tasks
            outer = current.get(loop)
            current[loop] = task
            try:
                # merge_fn's value or _SUSPENDED, yielded: no StopIteration to make and
                # catch here (see _first_then_rest). (GeneratorType.send, not
                # body.send: no bound method made per call, 0.4k instructions of a (c)
                # step.)
                outcome = _run_in(context, _send, body, None)
            except BaseException:  # merge_fn raised in its first step (the task then
                issued()  # ends at its first step too, reporting nothing)
                raise
            finally:
                if outer is None:
                    del current[loop]
                else:
                    current[loop] = outer
            if outcome is not _SUSPENDED:  # merge_fn ended in its first step
                if backend is not None:  # (on the host, no call of _nothing: 0.3k)
                    issued()
                if timeout is not None:  # each replica's share already: _merged's step
                    return outcome
                # _for_each_replica's first case written out: a call less per merge
                # (0.4k instructions of a (c) step).
                if not isinstance(outcome, _MAY_HOLD_DISTRIBUTED):
                    return [outcome] * self.num_replicas
                return self._for_each_replica(outcome)
            # Tracked from here (the run waits for it, and cancels it with the
            # replicas); a merge_fn ended in its first step needs no table.
            self._aux_table()[task] = ()  # started: nothing to close if cancelled
            task.add_done_callback(self._untrack)
        else:
            # The coroutines to close if the task never starts: the one it awaits, and
            # merge_fn's own beneath the wrappers. (Only here, where they are used.)
            own = type(result) is CoroutineType and result is not coro
            unstarted = (coro, result) if own else (coro,)
            try:
                task = self._spawn(
                    self._merged(coro, number, timeout),
                    context,
                    unstarted=unstarted,
                    eager=True,
                    name=MERGE_TASK_NAME,
                )
            except BaseException:
                issued()
                raise
        if backend is not None:  # also when the task is cancelled before it starts
            task.add_done_callback(issued)
        return task

    async def _merged(self, coro: Any, number: int, timeout: float | None) -> list:
        """An async merge_fn's task (or, without a timeout, what follows its first
        step: see _merge): its result for each replica. Every replica has arrived, so
        the rendezvous' own timeout no longer runs: ``timeout`` (timeout_seconds)
        bounds the merge_fn itself."""
        if timeout is None:
            try:  # (costs nothing until it catches)
                result = await coro
            except (KeyboardInterrupt, SystemExit):
                # Raised in the task's eager first step, it came out of the task's
                # creation, and out of the merge_call of the replica that arrived
                # last, failing its run (see _retrieved_once_done).
                _retrieved_once_done()
                raise
            except Exception as exc:
                self._merge_fn_raised(number, exc)
                raise
        else:
            scope = asyncio.timeout(timeout)
            try:
                async with scope:
                    result = await coro
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt | SystemExit):  # (as above)
                    _retrieved_once_done()
                # expired() tells the scope's own cancellation from any other. The
                # scope is not kept in this frame once merge_fn has failed: it holds
                # this task, which holds the error leaving here, whose traceback
                # holds this frame: a cycle, left for the garbage collector, per
                # merge_fn that failed or timed out.
                expired = isinstance(exc, TimeoutError) and scope.expired()
                scope = None
                if not expired:
                    if isinstance(exc, Exception):
                        self._merge_fn_raised(number, exc)
                    raise
            else:
                return self._for_each_replica(result)
            # Raised outside the handler, so the error does not hold the scope's
            # TimeoutError as its __context__ (its traceback holds the scope too).
            raise self._merge_timed_out(
                number, timeout, "; make it faster, or raise timeout_seconds."
            )
        return self._for_each_replica(result)

    @staticmethod
    def _merge_timed_out(number: int, timeout: float, how: str) -> RendezvousTimeoutError:
        """merge_call #``number``'s error where merge_fn's ``timeout`` cancelled it;
        ``how``: the rest of its message (a multi-worker one: what it waited for)."""
        return RendezvousTimeoutError(
            f"merge_call #{number}: merge_fn did not finish within {timeout:g} s "
            f"(CommunicationOptions.timeout_seconds) and was cancelled{how}"
        )

    def _merge_fn_raised(self, number: int, exc: Exception) -> None:
        """An async merge_fn of call ``number`` raised ``exc`` (its task's last step).
        While the run is cancelled by its caller (cancelling, with no failure of its
        own), no replica waits for the call any more: ``exc`` becomes the failure the
        run does not raise, reported as a replica's is (see _report_unraised)."""
        if self._cancelling and self._failure is None:
            self._failure = exc
            self._unraised_by = f"the merge_fn of merge_call #{number}"

    def _untrack(self, task: asyncio.Task) -> None:
        """Done callback of a tracked cross-replica task (one that suspended): it
        leaves the run's table.

        A done callback, not the task's own last step: the rendezvous hears how the
        task ended from another done callback (Rendezvous._ran), and a task's done
        callbacks run together, with nothing between them. So a run that finds the
        table empty has had every call delivered, and a failure no replica awaited is
        among its failed calls when the run closes it (see run). (A merge task that
        left the table from its own last step let the run return first; the failure
        was then set on the futures afterwards, and only logged as never retrieved.)"""
        self._aux.pop(task, None)

    def _for_each_replica(self, value: object) -> list:
        """``value`` (a merge_fn's result) as each replica receives it."""
        if not isinstance(value, _MAY_HOLD_DISTRIBUTED):  # a plain leaf, as it is
            return [value] * self.num_replicas
        # (A list comprehension here would make its variables cells on every call,
        # about 16 ns each on Python 3.11, for a leaf too: map over a partial.)
        n = self.num_replicas
        return list(map(partial(select_replica, structure=value, num_replicas=n), range(n)))


class DefaultGroup(RunGroup):
    """The one-replica group behind the default replica context (outside any scope).

    Collectives there complete at once; a merge_fn runs in the default strategy's
    cross-replica context, built from the caller's context at each call.
    """

    def __init__(self, strategy: Strategy, slots: tuple[ReplicaSlot, ...]):
        super().__init__(strategy, slots)
        self.context = ReplicaContext(strategy, 0, slots[0].device, default_group=self)
        # An async merge_fn's task, from _merge to the end of the arrive() that made
        # it: per thread, since every thread's calls come here, and between the two
        # another thread's arrive() took the task, leaving the caller's merge_fn
        # running on when the caller stopped waiting. (Within one thread nothing
        # runs between them.)
        self._made = threading.local()
        # Made now, not at the first collective as a run's is (RunGroup.rendezvous),
        # which would hand it the stall watchdog of the loop that happened to call
        # first: this group serves every loop, in every thread, for the life of the
        # process, and a timer armed on another thread's loop is a data race (asyncio's
        # debug mode raises RuntimeError). No watchdog at all: its one replica has
        # always arrived, so none of its calls can stall (nor is it a run that a
        # watchdog looks at).
        self._rendezvous = Rendezvous(
            1,
            self._execute,
            None,  # watch
            None,  # loop: each arrival's running one
            False,  # keeps_failures: it is never closed
            strategy._counters,
        )

    async def run(self, fn: Callable, args: Sequence, kwargs: dict) -> object:
        raise ContextError("the default replica group cannot run functions; use strategy.run.")

    def arrive(
        self, replica_id: int, signature: Signature, payload: Any, options: CommunicationOptions
    ) -> asyncio.Future:
        # One replica: its arrival completes the call, and starts an async merge_fn's
        # task (_merge) before this returns. The caller is the only one waiting for
        # it: if it stops waiting (cancelled, e.g. by asyncio.timeout), the merge_fn
        # is cancelled too, as a run cancels its merge tasks with its replicas.
        # (Held in a list emptied as it returns, not in a local: a merge_fn that raised
        # in this call has a traceback holding this frame, and a local future holding
        # that exception would make a cycle of every such call; see Rendezvous.arrive.)
        made = self._made
        made.task = None
        held = [super().arrive(replica_id, signature, payload, options)]
        task = made.task
        made.task = None
        if task is not None and not held[0].done():
            held[0].add_done_callback(partial(_cancel_with, task))
        return held.pop()

    def _merge(self, number: int, payloads: list[Payload], backend: Any, order: object) -> Any:
        result = super()._merge(number, payloads, backend, order)
        if isinstance(result, asyncio.Task):
            self._made.task = result
        return result


def _cancel_with(task: asyncio.Task, waited: asyncio.Future) -> None:
    """``waited``'s done callback: cancel ``task`` if the wait was cancelled."""
    if waited.cancelled():
        task.cancel()
