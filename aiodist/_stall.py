"""Stall reports: which replica a rendezvous is waiting for, and where it is.

When a collective has waited ``CommunicationOptions.stall_warning_seconds`` for
its last replicas, one warning goes to the ``aiodist`` logger naming the
collective and its call number, the replicas that arrived, the replicas still
missing, and, for each missing replica, its await chain: from the replica
function down to the innermost suspended frame, each as ``function (file:line)``.
A ``merge_call`` every replica has arrived at, whose async merge_fn has not
finished (it awaits something that never comes, or comes slowly), is reported
the same way: the merge_fn, and its task's await chain. Each stall is reported
once, however long it lasts. Reports never fail the run: ``timeout_seconds`` does
that.

Cost when nothing stalls: one watchdog per event loop. A new collective call
only compares its report time with the watchdog's next wake-up (scheduling one
timer when the watchdog is idle); the watchdog wakes up once per threshold,
finds nothing due, and goes idle again when no run has a call in flight.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import inspect
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from types import AsyncGeneratorType, CoroutineType, GeneratorType
from typing import TYPE_CHECKING, Any

from ._rendezvous import InFlight, _replicas
from ._replica_context import merge_fn_text
from ._streams import drive, step_through

if TYPE_CHECKING:
    from ._scheduler import RunGroup

__all__ = ["await_chain", "ensure_for", "watchdog_for"]

logger = logging.getLogger("aiodist")


_SCHEDULER_FILE = os.path.join(os.path.dirname(__file__), "_scheduler.py")


def _is_wrapper(code: Any) -> bool:
    """aiodist's own coroutine wrappers: followed through, not shown (the user's
    frames are what a stall report is about). Every coroutine of the scheduler is
    one (_replica, _call, _traced, ...): no user code lives there."""
    return code in (step_through.__code__, drive.__code__) or code.co_filename == _SCHEDULER_FILE


_SUSPENDING = (CoroutineType, GeneratorType, AsyncGeneratorType)


def _frame_of(coro: Any) -> Any:
    """The frame of a coroutine, generator or async generator (None once finished)."""
    if isinstance(coro, CoroutineType):
        return coro.cr_frame
    if isinstance(coro, GeneratorType):
        return coro.gi_frame
    return coro.ag_frame


def _suspends(value: Any) -> bool:
    """Whether ``value`` is a coroutine, generator or async generator: the types
    themselves, so an object that answers any attribute (a mock) is not taken for one."""
    return isinstance(value, _SUSPENDING)


def _awaited(coro: Any) -> Any:
    """The coroutine, generator or async generator ``coro`` is suspended in, if any."""
    inner = None
    for attribute in ("cr_await", "gi_yieldfrom", "ag_await"):
        inner = getattr(coro, attribute, None)
        if inner is not None:
            break
    if inner is None or _suspends(inner):
        return inner
    # C objects with no public link to what they drive: an async generator's asend()
    # (``async for``), a custom awaitable's __await__ iterator, a future's iterator
    # (``await task``). gc knows what each one holds; this is a diagnostic.
    for candidate in (inner, *gc.get_referents(inner)):
        if _suspends(candidate):
            return candidate
        if isinstance(candidate, asyncio.Task):  # awaiting a task: where that one is
            return candidate.get_coro()
    return None


def await_chain(coro: Any, depth: int = 0) -> list[str]:
    """``function (file:line)`` for each suspended frame, outermost first; where the
    innermost waits for child tasks (a TaskGroup's, asyncio.gather's), each one's
    chain follows, indented under ``task 'name':``. ``depth``: how many such levels
    are above this chain (see ``_CHILD_LEVELS``)."""
    chain = []
    seen: set[int] = set()  # tasks awaiting each other (a deadlock) form a cycle
    last = None  # the innermost suspended coroutine (or generator) reached
    while _suspends(coro) and id(coro) not in seen and len(seen) < 100:
        seen.add(id(coro))
        frame = _frame_of(coro)
        code = frame.f_code if frame is not None else None
        if code is step_through.__code__:
            # The stream driver steps its coroutine by hand (send/throw), so there is
            # no yield-from link to follow: take the coroutine it drives.
            coro = frame.f_locals.get("coro")
            continue
        if frame is not None and not _is_wrapper(code):
            name = getattr(code, "co_qualname", code.co_name)
            chain.append(f"{name} ({_short(code.co_filename)}:{frame.f_lineno})")
        last, coro = coro, _awaited(coro)
    if last is not None and depth < _CHILD_LEVELS:
        children = _child_tasks(last)
        for child in children[:_CHILDREN_SHOWN]:
            chain.append(f"task {child.get_name()!r}:")
            inner = await_chain(child.get_coro(), depth + 1) or [_NO_FRAME]
            chain.extend(f"  {entry}" for entry in inner)
        if len(children) > _CHILDREN_SHOWN:
            chain.append(f"(and {len(children) - _CHILDREN_SHOWN} more tasks)")
    return chain


# Child tasks followed below a chain: this many levels of them at most, and this many
# of each one's (a report is read by a person; a fan-out of thousands is not).
_CHILD_LEVELS = 4
_CHILDREN_SHOWN = 8


def _child_tasks(coro: Any) -> list[asyncio.Task]:
    """The unfinished tasks ``coro`` (the innermost suspended coroutine of a chain)
    waits for, by name: a TaskGroup's, where it is a method of that group (its
    ``__aexit__``, at the end of the ``async with`` block), or those of an
    ``asyncio.gather`` future it awaits. (Private attributes of asyncio, read for a
    diagnostic as gc is above: where they are missing, nothing is followed.)"""
    frame = _frame_of(coro)
    group = frame.f_locals.get("self") if frame is not None else None
    if isinstance(group, asyncio.TaskGroup):
        tasks = list(getattr(group, "_tasks", ()))
    else:
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if inner is None:
            return []
        tasks = []
        for candidate in (inner, *gc.get_referents(inner)):
            children = getattr(candidate, "_children", None)
            if isinstance(candidate, asyncio.Future) and isinstance(children, list):
                tasks = [child for child in children if isinstance(child, asyncio.Task)]
                break
    return sorted((t for t in tasks if not t.done()), key=lambda t: t.get_name())


def _short(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith("..") else relative


# Every strategy (weakly), registered as it is made: a watchdog finds the runs of
# its loop among their runs in flight (each strategy's _live_groups), so a run is
# registered nowhere else. A set of runs per watchdog, added to and discarded from
# by every run with a collective, cost 0.7k instructions of a (c) step (N = 4).
_strategies: dict[int, weakref.ref] = {}  # id(strategy) -> weak reference to it


def register(strategy: Any) -> None:
    """Note ``strategy`` (weakly; by identity, never by its hash or ==)."""
    key = id(strategy)

    def forget(ref: weakref.ref, key: int = key) -> None:
        # (called as the strategy dies, before its id can be reused)
        if _strategies.get(key) is ref:
            _strategies.pop(key, None)

    _strategies[key] = weakref.ref(strategy, forget)


def _runs_on(loop: asyncio.AbstractEventLoop) -> list[RunGroup]:
    """The runs in flight on ``loop`` that have a rendezvous."""
    runs = []
    for ref in list(_strategies.values()):  # a snapshot taken in C: safe across threads
        strategy = ref()
        if strategy is None:
            continue
        for group in list(strategy._live_groups):
            if group._loop is loop and group._rendezvous is not None:
                runs.append(group)
    return runs


class Watchdog:
    """Looks at the runs of one event loop when a stall report may be due."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)
        self._due = math.inf  # when the armed timer fires (inf: none is armed)
        # The empty context its timers run in: its own, not one shared by every
        # watchdog, since a context cannot be entered by two threads at once. Two
        # loops in two threads firing their timers together then failed one of them
        # ("cannot enter context"), which also left its watchdog waiting for that
        # timer, reporting nothing on its loop ever after. (A loop runs one callback
        # at a time, so its watchdog's context is never entered twice.)
        self._context = contextvars.Context()

    def ensure(self, when: float) -> None:
        """Wake up no later than ``when`` (a ``time.perf_counter()`` value)."""
        if when >= self._due:
            return
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        self._due = when
        # No handle is kept (an earlier timer, superseded, finds _due changed and does
        # nothing): this watchdog is the value of a weak-keyed dict whose key is the
        # loop, and a handle holds its loop, so keeping one would keep both forever.
        # In an empty context: the caller's (a replica's, holding its run) would stay
        # alive with the timer, and the run with it, until the timer fired.
        delay = max(0.0, when - time.perf_counter())
        loop.call_later(delay, self._tick, when, context=self._context)

    def _tick(self, armed_for: float) -> None:
        if armed_for != self._due:  # superseded by an earlier timer
            return
        self._due = math.inf
        loop = self._loop()
        if loop is None:
            return
        # Timers may fire a little early (uvloop's clock ticks in milliseconds): count
        # what is due within a millisecond as due, instead of re-arming for it.
        now = time.perf_counter() + 0.001
        next_due = math.inf
        for group in _runs_on(loop):
            due, group_next = group._rendezvous.due_stalls(now)
            for row in due:
                if row.running_since is None:
                    logger.warning(_report(group, row, now))
                else:  # a merge_call's merge_fn, still running (see Rendezvous._run_on)
                    logger.warning(_running_report(group, row, now))
            next_due = min(next_due, group_next)
        if next_due < math.inf:
            self.ensure(next_due)


# What a report shows for a task suspended with no frame of the user's to show.
_NO_FRAME = "(awaiting an awaitable with no coroutine frame behind it, such as a future)"


def _started(task: Any) -> bool:
    """Whether ``task``'s coroutine has taken its first step (what is not a
    coroutine or generator, say a custom task factory's own awaitable, counts as
    started: no stall report claims a replica has not started unless it knows)."""
    coro = task.get_coro()
    if isinstance(coro, CoroutineType):
        return inspect.getcoroutinestate(coro) != inspect.CORO_CREATED
    if isinstance(coro, GeneratorType):
        return inspect.getgeneratorstate(coro) != inspect.GEN_CREATED
    return True


def _chain_of(task: Any) -> list[str]:
    """``await_chain`` of a task's coroutine; never raises (a diagnostic: a report,
    and the later ones, must not be lost)."""
    try:
        return await_chain(task.get_coro())
    except Exception as exc:
        return [f"(could not follow its await chain: {exc!r})"]


def _report(group: RunGroup, row: InFlight, now: float) -> str:
    """The report of a call some replicas are missing from: where each one is."""
    first = group.strategy._replica_offset  # (replicas by their global ids)
    lines = [
        f"{row.name} #{row.number} has waited {now - row.started:.1f} s: "
        f"{_replicas(row.arrived, first)} arrived, {_replicas(row.missing, first)} missing. "
        "Where the missing replicas are now:"
    ]
    for replica in row.missing:
        task = group._tasks[replica] if replica < len(group._tasks) else None
        if task is None or task.done():
            lines.append(f"  replica {first + replica}: finished")
            continue
        lines.append(f"  replica {first + replica}:")
        # No frame of the user's: a task not started yet, or (the usual case) a plain
        # replica function whose returned future (run_in_executor's, a bare one) is
        # awaited by the scheduler's frame, which is not shown.
        chain = _chain_of(task) or [_NO_FRAME if _started(task) else "(not started yet)"]
        lines.extend(f"    {entry}" for entry in chain)
    if row.deadline is None:
        fail = "set CommunicationOptions(timeout_seconds=...) to fail instead, or"
    else:  # (a timeout set already: when it fails the call, not advice to set one)
        fail = (
            f"timeout_seconds={row.timeout:g} fails the call in "
            f"{max(0.0, row.deadline - now):.1f} s unless they arrive; set"
        )
    lines.append(
        f"This is a warning, not an error; {fail} stall_warning_seconds=None to silence it."
    )
    return "\n".join(lines)


def _running_report(group: RunGroup, row: InFlight, now: float) -> str:
    """The report of a merge_call every replica has arrived at, whose merge_fn has
    not finished: which merge_fn, and where its task is."""
    merge_fn = merge_fn_text(row.payload)
    arrived = _replicas(row.arrived, group.strategy._replica_offset)  # (global ids)
    lines = [
        f"{row.name} #{row.number} has waited {now - row.started:.1f} s: every replica "
        f"arrived ({arrived}), and merge_fn {merge_fn} is still running "
        f"(for {now - row.running_since:.1f} s). Where it is now:"
    ]
    work = row.work
    if isinstance(work, asyncio.Task) and not work.done():
        chain = _chain_of(work) or [_NO_FRAME]
    else:  # (it ended as this report was made)
        chain = ["(finished)"]
    lines.append("  merge_fn:")
    lines.extend(f"    {entry}" for entry in chain)
    timeout = group.strategy._communication_options.timeout_seconds
    if timeout is None:
        fail = (
            "set CommunicationOptions(timeout_seconds=...) on the strategy to cancel a "
            "merge_fn that runs that long and fail the merge_call"
        )
    else:
        fail = (
            f"timeout_seconds={timeout:g} cancels merge_fn and fails the merge_call once it "
            "has run that long"
        )
    lines.append(
        f"This is a warning, not an error; {fail}, or set stall_warning_seconds=None to silence it."
    )
    return "\n".join(lines)


_watchdogs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (weakref to loop, its watchdog, the watchdog's bound ensure)
_last: tuple[Any, Watchdog | None, Any] = (None, None, None)


def watchdog_for(loop: asyncio.AbstractEventLoop) -> Watchdog:
    """The loop's watchdog (one per loop). The last one is cached: a run asks for it
    once, and a WeakKeyDictionary lookup costs more than the rest of this."""
    global _last
    loop_ref, watchdog, _ = _last
    if loop_ref is not None and loop_ref() is loop and watchdog is not None:
        return watchdog
    watchdog = _watchdogs.get(loop)
    if watchdog is None:
        watchdog = _watchdogs[loop] = Watchdog(loop)
    _last = (weakref.ref(loop), watchdog, watchdog.ensure)
    return watchdog


def ensure_for(loop: asyncio.AbstractEventLoop) -> Callable[[float], None]:
    """``watchdog_for(loop).ensure``, the bound method cached with the last watchdog:
    each run's rendezvous is given it (no method object made per run: 0.3k instructions of a
    (c) step)."""
    loop_ref, watchdog, ensure = _last
    if loop_ref is not None and loop_ref() is loop and watchdog is not None:
        return ensure
    return watchdog_for(loop).ensure
