"""The rendezvous engine: matching collective calls across the replicas of one group.

This module knows nothing about arrays, devices or strategies. It only matches
*arrivals* and guarantees that nobody waits forever.

Protocol
--------
A group has ``N`` replicas. Each replica numbers its own collective calls
0, 1, 2, ... in the order it makes them (``merge_call``, ``all_reduce`` and
``all_gather`` share one counter). ``arrive(replica, signature, payload)``
registers replica ``r``'s next call *immediately* and returns an
``asyncio.Future`` for its result, so a replica may start a collective, keep
computing, and await the result later.

Call number ``k`` completes when all ``N`` replicas have arrived at ``k`` with
equal signatures. Then the group's ``execute(k, signature, payloads)`` runs
exactly once, with the payloads in replica order. It returns either the list of
per-replica results, or an ``asyncio.Future`` of that list (cross-replica work
that must await, such as an ``async`` merge_fn; one already done is delivered at
once). Each replica's future receives its own element. If ``execute`` raises,
every replica's future raises that exception. A merge_call whose future is not
done yet is *running* until it is: ``pending()`` lists it, and its stall reports
go on (a merge_fn that never finishes is no less a hang than a missing replica).

Never hang
----------
TensorFlow hangs when replicas disagree. Here each disagreement fails the call,
in every replica already waiting in it and in every replica that arrives later:

- *mismatch*: a replica arrives at ``k`` with a signature different from the
  first arrival's (``CollectiveMismatchError``, listing what each replica called);
- *exit*: a replica that made ``m`` calls returns or raises; every call
  ``k >= m`` can never complete (``ReplicaExitedError``, naming the replica, the
  collective and ``k``);
- *timeout*: ``timeout`` seconds after an arrival at ``k`` that asked for one (each
  arrival's counts from itself; the earliest deadline wins), some replica has
  still not arrived (``RendezvousTimeoutError``, naming the missing ones);
- *close*: the group is torn down while calls are pending;
- *unmatchable*: comparing an arrival's signature with the first's raises (user
  code: a dict key's ``==``), failing the call with a ``RendezvousError`` whose
  cause is that error, rather than the arrival that compared alone.

Nor is a failure lost: a call that failed where no replica retrieved its error
(each started it and never awaited it) is returned by ``close`` for the owner to
raise (a run raises it once every replica has returned).

Futures are created on the running loop at arrival, so an engine is not tied to
a loop before it is used; the scheduler still makes one engine per run.
"""

from __future__ import annotations

import asyncio
import math
from asyncio import get_running_loop
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from time import perf_counter
from typing import Any, NamedTuple

from ._errors import (
    CollectiveMismatchError,
    RendezvousError,
    RendezvousTimeoutError,
    ReplicaExitedError,
)

__all__ = ["InFlight", "Rendezvous", "Signature", "Tally"]

_Future = asyncio.Future
_set_result = _Future.set_result  # (see Rendezvous._complete)
_blank = object.__new__  # (see Rendezvous.arrive)

_ORDER_HINT = (
    "every replica must make the same collective calls (merge_call, all_reduce, "
    "all_gather) in the same order"
)


class Signature(NamedTuple):
    """What one replica called: compared across replicas, shown in error messages.

    ``name`` is the collective (``"all_reduce"``), ``key`` is what must be equal
    on every replica (op, structure, shapes, dtypes), and ``describe`` says it
    for a person (``"all_reduce(SUM, float32[3])"``): a string, or a callable
    that builds one, since the text is only needed when something goes wrong.
    Two signatures match when their names and keys are equal.
    """

    name: str
    key: Hashable
    describe: str | Callable[[], str]

    @property
    def text(self) -> str:
        return self.describe if isinstance(self.describe, str) else self.describe()

    def difference(self, other: Signature) -> tuple[str, str, str] | None:
        """Where ``other``'s arguments first differ from this one's, for a mismatch
        message: ``(where, what this one has there, what other has)``; None when
        that cannot be said. The describers say it (this module knows nothing of
        arrays): when both are partials of one function with a ``difference``
        attribute, that is called with the two partials' arguments."""
        mine, theirs = self.describe, other.describe
        if not (
            isinstance(mine, partial) and isinstance(theirs, partial) and mine.func is theirs.func
        ):
            return None
        difference = getattr(mine.func, "difference", None)
        if difference is None:
            return None
        try:
            return difference(mine.args, theirs.args)
        except Exception:  # a hint: it must not hide the mismatch itself
            return None

    def __repr__(self) -> str:
        return f"Signature({self.text})"


def _ids(replicas: Sequence[int], first: int = 0) -> str:
    """``replicas`` (an engine's ids, 0 to N-1) as a person reads them: shifted by
    ``first``, the id of the group's replica 0 where it is not 0 (a worker of a
    multi-worker strategy holds global replicas ``first`` to ``first + N - 1``)."""
    return ", ".join(str(first + r) for r in sorted(replicas)) or "none"


def _replicas(replicas: Sequence[int], first: int = 0) -> str:
    word = "replica" if len(replicas) == 1 else "replicas"
    return f"{word} {_ids(replicas, first)}"


class _Call:
    """One call number in flight: who arrived with what, and their futures.

    Per-replica lists (``None`` where a replica has not arrived) rather than dicts:
    one of these is built for every collective call, on the hot path, by the first
    arrival (see ``Rendezvous.arrive``).
    """

    __slots__ = (
        "deadline",
        "failure",
        "first",
        "futures",
        "missing",
        "name",
        "next_warning",
        "number",
        "payloads",
        "running_since",
        "stall_after",
        "started",
        "timeout",
        "timer",
        "work",
    )

    @property
    def label(self) -> str:
        return f"{self.name} #{self.number}"

    def arrivals(self) -> list[int]:
        """The replicas that have arrived, in replica order."""
        return [r for r, future in enumerate(self.futures) if future is not None]


Execute = Callable[[int, Signature, list], "list | asyncio.Future"]


class InFlight(NamedTuple):
    """A call in flight, as ``pending()`` and ``due_stalls()`` show it: *waiting*
    for replicas still missing, or *running*: every replica arrived and its
    cross-replica work (an async merge_fn's task) has not finished."""

    name: str
    number: int
    arrived: list[int]
    missing: list[int]
    started: float  # perf_counter() of the first arrival
    # The first arrived replica's payload (a merge_call's: (merge_fn, args, kwargs)).
    payload: Any
    # perf_counter() when every replica had arrived and the work began; None while
    # replicas are missing.
    running_since: float | None = None
    work: asyncio.Future | None = None  # that work, while it runs
    # A waiting call's timeout_seconds, and perf_counter() when it fails; None if none.
    timeout: float | None = None
    deadline: float | None = None


class Tally:
    """Counts of completed calls: by collective name, and the seconds they waited
    (from their first arrival to their last), summed. Updated with no call between
    a read and its write, so runs on other threads' loops lose none (see _complete)."""

    __slots__ = ("collectives", "seconds_waiting")

    def __init__(self) -> None:
        self.collectives: dict[str, int] = {}
        self.seconds_waiting = 0.0


def _retrieved(call: _Call) -> None:
    """Mark the failure held by each of ``call``'s futures retrieved."""
    for future in call.futures:
        if future is not None and future.done() and not future.cancelled():
            future.exception()


def _unretrieved(call: _Call) -> bool:
    """No replica has retrieved the failure of ``call``, a failed call: it was set on
    at least one replica's future, and none of those was awaited (or had its
    exception read). (Futures that a replica cancelled never held it.) A future
    without asyncio's ``_log_traceback`` flag, a loop's own kind, counts as
    retrieved: nothing is raised that may have been seen."""
    holders = [
        future
        for future in call.futures
        if future is not None and future.done() and not future.cancelled()
    ]
    return bool(holders) and all(getattr(f, "_log_traceback", False) for f in holders)


def _closed(number: int, signature: Signature, payloads: list) -> list:
    raise RendezvousError(f"{signature.name} #{number}: the replica group is closed.")


class Rendezvous:
    """Matches the collective calls of ``num_replicas`` replicas by call number."""

    # Slots, not an instance dict: one engine is made per run that meets (0.3k
    # instructions of a (c) step, N = 4).
    __slots__ = (
        "_closed",
        "_execute",
        "_failed",
        "_loop",
        "_next_number",
        "_pending",
        "_plain_futures",
        "_quiet",
        "_running",
        "_watch",
        "exited",
        "first_id",
        "num_replicas",
        "tally",
    )

    def __init__(
        self,
        num_replicas: int,
        execute: Execute,
        watch: Callable[[float], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        keeps_failures: bool = True,
        tally: Tally | None = None,
    ):
        self.num_replicas = num_replicas
        # The loop every arrival will run on, when the owner knows it (a run does):
        # get_running_loop() costs a getpid() system call per arrival otherwise.
        self._loop = loop
        self._execute = execute
        # Whether every future made so far is a plain asyncio.Future (see _complete).
        self._plain_futures = True
        # watch(when): a new call may stall; look at it again at perf_counter() `when`.
        self._watch = watch
        self._next_number = [0] * num_replicas
        self._pending: dict[int, _Call] = {}
        # Replica -> how it finished ("returned", "raised ValueError", ...), in the
        # order they finished. The calls it made are _next_number's count, which no
        # longer moves (see _exited_before). An owner may note a return here itself
        # while nothing is pending, which is all replica_exited does then: a method
        # call per replica per run less (RunGroup's replicas: 2.9k instructions of a
        # (c) step, N = 4, with the (calls made, how) tuple this held before).
        self.exited: dict[int, str] = {}
        # Failed calls (rare), for close(): the first whose error no replica retrieved
        # is returned, and the others are marked retrieved. Not kept by an owner that
        # never closes (the default group), where they would pile up for ever.
        self._failed: list[_Call] | None = [] if keeps_failures else None
        # Set by close(): its reason, then the error built from it.
        self._closed: str | RendezvousError | None = None
        # Where completed calls are counted: the owner's (a strategy's, shared by its
        # runs, so a run's counts need no adding up when it ends), or its own.
        self.tally = Tally() if tally is None else tally
        # Set by close() with quiet=True (the owner raises an error of its own), or
        # when it found failed calls (the owner raises the one returned, or a replica
        # saw each): calls that fail even after that (an async merge_fn cancelled with
        # its run, whose result is delivered by a callback that may run after close)
        # are not logged either.
        self._quiet = False
        # _running (call number -> _Call): calls every replica has arrived at whose
        # cross-replica work still runs (an async merge_fn that suspended), for
        # pending() and stall reports. Not set here: made by the first such call
        # (_run_on), and read with getattr() elsewhere, so the runs that have none
        # (most) pay nothing for it.
        # first_id: the id that messages give replica 0 (the ids here are always 0
        # to N-1). Not set here either: an owner whose replicas have other ids (a
        # worker of a multi-worker strategy, holding global replicas from its
        # offset on) sets it, and messages read it with getattr() (see _first).

    @property
    def _first(self) -> int:
        """The id messages give replica 0 (see ``first_id`` in ``__init__``)."""
        return getattr(self, "first_id", 0)

    def __repr__(self) -> str:
        first = self._first
        pending = ", ".join(
            f"{call.label} (arrived {_ids(call.arrivals(), first)})"
            for call in list(self._pending.values())  # (a copy: see pending())
        )
        running = getattr(self, "_running", None)  # (see __init__)
        running = ", ".join(call.label for call in list(running.values())) if running else ""
        running = f" running=[{running}]" if running else ""
        return f"<Rendezvous replicas={self.num_replicas} pending=[{pending}]{running}>"

    # -- arrivals ----------------------------------------------------------------

    def arrive(
        self,
        replica: int,
        signature: Signature,
        payload: Any,
        timeout: float | None = None,
        stall_after: float | None = None,
    ) -> asyncio.Future:
        """Register ``replica``'s next collective call; return the future of its result.

        ``timeout``: fail the call that many seconds after its first arrival.
        ``stall_after``: report it as stalled (``due_stalls``) after that long.
        """
        loop = self._loop or get_running_loop()
        future = loop.create_future()
        if type(future) is not _Future:  # a loop's own kind (see _complete)
            self._plain_futures = False
        number = self._next_number[replica]
        self._next_number[replica] = number + 1
        if self._closed is not None:
            future.set_exception(self._closed_error())
            return future

        call = self._pending.get(number)
        if call is None:
            now = perf_counter()  # not loop.time(): uvloop's clock ticks in milliseconds
            # A new _Call, made here: not by a _Call.__init__, since calling a class
            # whose __init__ is Python code runs it in a C-level frame of its own
            # (slot_tp_init): 218.9k -> 218.4k instructions per (c) step, N = 4; nor
            # by a function of its own: a Python call less, 0.4k more off a (c) step.
            call = self._pending[number] = _blank(_Call)
            num_replicas = self.num_replicas
            call.number = number
            call.name = signature.name
            call.first = signature  # the first arrival's, which the others must match
            call.started = now
            # How many replicas have not arrived: counted down to 0, so no arrival
            # compares a count with num_replicas (with the first-arrival return
            # below: 206.1k -> 205.6k instructions per (c) step, 180.3k -> 179.9k per
            # (b) step, N = 4).
            call.missing = num_replicas
            # No list of signatures: each arrival is compared with the first one as
            # it comes, and the first mismatch fails the call (see _mismatch_message).
            call.payloads = [None] * num_replicas
            call.futures = [None] * num_replicas
            call.stall_after = None
            call.timer = None
            call.failure = None
            if timeout is not None:
                call.timeout = timeout
                call.deadline = now + timeout
                call.timer = loop.call_later(timeout, self._time_out, call)
            if stall_after is not None:
                call.stall_after = call.next_warning = stall_after
                # (Read as an attribute, then called: a bound method held by the
                # instance defeats the LOAD_METHOD specialisation of self._watch(...).)
                watch = self._watch
                if watch is not None:
                    watch(now + stall_after)
            if num_replicas > 1 and not self.exited:
                # The first arrival at a call, of two or more replicas, none finished:
                # nothing to compare it with and nothing to complete, so none of the
                # tests below (see `missing` above for what it buys).
                call.payloads[replica] = payload
                call.futures[replica] = future
                call.missing -= 1
                return future
        call.payloads[replica] = payload
        call.futures[replica] = future
        call.missing -= 1
        if timeout is not None or stall_after is not call.stall_after:
            # A limit of this arrival's own (the first's were set above): it holds too.
            self._tighten(call, timeout, stall_after, loop)

        first = call.first
        try:  # (costs nothing until it catches: see _unmatchable)
            if call.failure is not None:
                future.set_exception(call.failure)
            elif signature is not first and (
                # The same object (shared one-array signatures), or equal name and key.
                signature.key != first.key or signature.name != first.name
            ):
                message = self._mismatch_message(call, replica, signature)
                self._fail(call, CollectiveMismatchError(message))
            elif self.exited and (gone := self._exited_before(number, replica)) is not None:
                self._fail(call, ReplicaExitedError(self._exit_message(call, *gone)))
            elif not call.missing and self._complete(call):
                # The cross-replica code raised (a merge_fn): the failure's traceback
                # holds this frame (its merge_fn's frame links back to it), so no local
                # here may keep the failure, or every such call would leave a cycle for
                # the garbage collector. (Not on the usual path: _complete returns None.)
                held, future, call = [future], None, None
                return held.pop()
        except Exception as exc:
            if call.failure is not None or self._pending.get(number) is not call:
                raise  # the call was decided (failed, or completed) before this
            self._unmatchable(call, replica, exc)
            held, future, call = [future], None, None  # (as above)
            return held.pop()
        return future

    def _unmatchable(self, call: _Call, replica: int, exc: Exception) -> None:
        """Matching replica ``replica``'s arrival at ``call`` with the first arrival's
        raised ``exc``: user code did, a dict key's ``==`` (comparing the signatures'
        structures) or ``repr`` (in the mismatch message). The call fails with a
        ``RendezvousError`` in every replica, as for a mismatch. (Raised out of this
        arrival alone, it left the call with that replica counted and nothing to
        complete or fail it: a replica that caught the error and returned left the
        others waiting in it for ever.)"""
        first = self._first
        others = [r for r in call.arrivals() if r != replica]
        failure = RendezvousError(
            f"{call.label}: replica {first + replica}'s call could not be matched with "
            f"{_replicas(others, first)}'s: comparing them raised {type(exc).__name__}: "
            f"{exc}. The structures passed to a collective are compared across replicas, "
            "dict keys by == and shown by repr(): use keys that compare and print without "
            "raising (str or int keys)."
        )
        failure.__cause__ = exc
        self._fail(call, failure)

    def _tighten(
        self,
        call: _Call,
        timeout: float | None,
        stall_after: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """A later arrival's ``timeout`` and ``stall_after``, counted from now, where
        they end before the call's own (those of the arrivals before it): every
        replica's wait is bounded by the limits it asked for."""
        now = perf_counter()
        if (
            timeout is not None
            and call.missing
            and call.failure is None
            and (call.timer is None or now + timeout < call.deadline)
        ):
            if call.timer is not None:
                call.timer.cancel()
            call.timeout, call.deadline = timeout, now + timeout
            call.timer = loop.call_later(timeout, self._time_out, call)
        if stall_after is not None:
            due = now - call.started + stall_after  # as next_warning counts: from the start
            # (next_warning is inf once the call was reported: never reported twice.)
            if call.stall_after is None or due < call.next_warning < math.inf:
                call.stall_after, call.next_warning = stall_after, due
                watch = self._watch
                if watch is not None:
                    watch(now + stall_after)

    def replica_exited(self, replica: int, how: str) -> None:
        """``replica`` finished (``how``: "returned", "raised ValueError", ...).

        Every call it never joined fails now, and so will every later arrival
        at those call numbers.
        """
        self.exited[replica] = how
        if not self._pending:
            return
        made = self._next_number[replica]
        for number, call in list(self._pending.items()):
            if number >= made and call.failure is None:
                self._fail(call, ReplicaExitedError(self._exit_message(call, replica, how)))

    def close(self, reason: str = "the run finished", quiet: bool = False) -> BaseException | None:
        """Fail every pending call and every later arrival; cancel timers.

        Returns the failure of the first call that failed with no replica having
        retrieved it (every replica that made the call started it and never awaited
        it), for the owner to raise: an error nobody saw must not be lost. None when
        there is none, or when ``quiet``.

        ``quiet``: the owner raises an error of its own (its run failed), so the
        failures of collectives a replica started and never awaited are not logged
        as "Future exception was never retrieved" as well (nor when one is returned:
        the owner raises that; nor when every failure reached some replica).
        """
        self._execute = _closed  # drops the owner's bound method: no reference cycle
        if self._closed is None:
            self._closed = reason  # the error is built when someone needs it (rarely)
        if self._pending:
            for call in list(self._pending.values()):
                if call.failure is None:  # a failed call's timer was cancelled then
                    self._fail(call, self._closed_error())
            self._pending.clear()
        failed, self._failed = self._failed, None
        unseen = None
        if not quiet:
            if not failed:  # the usual close: no call failed
                return None
            # (None when each failure reached some replica: nothing lost. Its other
            # replicas' futures are then marked retrieved below too: asyncio would log
            # as "never retrieved" an error that a replica has handled.)
            unseen = next((call.failure for call in failed if _unretrieved(call)), None)
        self._quiet = True
        for call in failed or ():
            _retrieved(call)
        return unseen

    def _closed_error(self) -> RendezvousError:
        """The one error every call failed by ``close`` raises."""
        if not isinstance(self._closed, RendezvousError):
            self._closed = RendezvousError(
                f"the replica group is closed: {self._closed}. A collective belongs to the "
                "run that started it: do not keep a ReplicaContext, or start a collective, "
                "after that run has returned."
            )
        return self._closed

    def pending(self) -> list[InFlight]:
        """Every call in flight: those some replica is missing from (waiting), then
        those whose cross-replica work still runs (running).

        Safe from another thread (``strategy.statistics()`` from a monitor, or from
        another loop's thread): the calls are copied in C, where no other thread
        can add or remove one (iterating the dict itself in Python raised
        "dictionary changed size during iteration")."""
        rows = [self._row(call) for call in list(self._pending.values()) if call.failure is None]
        running = getattr(self, "_running", None)  # (see __init__)
        if running:
            rows.extend(self._row(call, True) for call in list(running.values()))
        return rows

    @staticmethod
    def _missing(call: _Call) -> list[int]:
        return [r for r, future in enumerate(call.futures) if future is None]

    @staticmethod
    def _row(call: _Call, running: bool = False) -> InFlight:
        # Arrived and missing from one copy of the futures (made in C): a replica
        # arriving meanwhile, on another thread, is in exactly one of them.
        futures = list(call.futures)
        arrived = [r for r, future in enumerate(futures) if future is not None]
        missing = [r for r, future in enumerate(futures) if future is None]
        payload = call.payloads[arrived[0]] if arrived else None
        extra: tuple = ()
        if running:
            extra = (call.running_since, call.work)
        elif call.timer is not None:  # timeout_seconds set (call.timeout is unset if not)
            extra = (None, None, call.timeout, call.deadline)
        return InFlight(call.name, call.number, arrived, missing, call.started, payload, *extra)

    def due_stalls(self, now: float) -> tuple[list[InFlight], float]:
        """Calls in flight whose next stall report is due at ``now`` (perf_counter), as
        ``pending()`` rows, and the time of the next report after those.

        Each stall is reported once (SPEC 11: one warning), ``stall_after`` seconds
        after the call's first arrival: a call some replicas are missing from, and a
        merge_call whose cross-replica work (an async merge_fn) does not finish. A
        call reported while replicas were missing is reported once more if its
        merge_fn then runs ``stall_after`` seconds without finishing (see _run_on):
        that is a second stall, with another cause.
        """
        due, next_due = [], math.inf
        running = getattr(self, "_running", None)  # (see __init__)
        for calls, is_running in ((self._pending, False), (running or {}, True)):
            for call in calls.values():
                if call.stall_after is None or call.failure is not None:
                    continue
                if now >= call.started + call.next_warning:
                    due.append(self._row(call, is_running))
                    call.next_warning = math.inf  # reported (see _tighten, _run_on)
                next_due = min(next_due, call.started + call.next_warning)
        return due, next_due

    # -- completion and failure ---------------------------------------------------

    def _complete(self, call: _Call) -> bool | None:
        """Run the call's cross-replica code and deliver its results; True if that
        code raised (the call failed with its exception)."""
        del self._pending[call.number]
        if call.timer is not None:
            call.timer.cancel()
        name = call.name
        tally = self.tally
        # Runs on event loops in other threads count here too. No call between a
        # count's read and its write (CPython switches threads only at calls and
        # backward jumps), so none of theirs is lost: not completed.get(name, 0) + 1,
        # nor perf_counter() inside the +=.
        completed = tally.collectives
        try:
            completed[name] += 1
        except KeyError:  # the first call of its kind (setdefault: one C call)
            completed.setdefault(name, 0)
            completed[name] += 1
        waited = perf_counter() - call.started
        tally.seconds_waiting += waited
        try:
            execute = self._execute  # (as self._watch in arrive: with it, 0.3k a (c) step)
            results = execute(call.number, call.first, call.payloads)
        except BaseException as exc:
            self._execute_failed(call, exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                # Raised at once, as asyncio lets them through: out of the arrival that
                # completed the call, whose own future (which nothing will await) holds
                # it too, as every waiting replica's does; marked retrieved, or asyncio
                # logs "Future exception was never retrieved" for what the caller got
                # (the default replica context's engine is never closed, which would
                # mark them).
                _retrieved(call)
                del call  # (see below)
                raise
            # The failure's traceback holds this frame, and the call holds the failure:
            # without this, every call failed by its cross-replica code (a merge_fn that
            # raised) would leave a cycle for the garbage collector.
            del call
            return True
        if type(results) is list:  # the usual case, tested first: one type check
            futures = call.futures
            if len(results) == len(futures) and self._plain_futures:
                # _deliver's usual case, here: every future is a plain asyncio.Future
                # (which has no instance dict), so Future.set_result is what each
                # future.set_result(result) would call. All set in C, in replica
                # order, with no Python loop, no method lookup per replica (a C
                # Future's set_result is not specialised on 3.11) and no call of
                # _deliver: 219.6k -> 218.4k instructions per (c) step, N = 4, with the
                # type test per arrival that _plain_futures needs (0.8k of it).
                try:
                    any(map(_set_result, futures, results))
                    return
                except asyncio.InvalidStateError:  # a replica cancelled its wait:
                    pass  # _deliver sets the others (skipping those already set)
            self._deliver(call, results)
        elif isinstance(results, asyncio.Future):
            if results.done():  # already (an eager task that never suspended)
                self._deliver_later(call, results)
            elif name == "merge_call":  # an async merge_fn that suspended
                self._run_on(call, results)
            else:
                # A multi-worker collective's exchange with the other workers, on every
                # step: not tracked (it has stall reports of its own), so it costs
                # nothing more. (A partial, not a lambda: its variables would be cells,
                # made on every call of this method.)
                results.add_done_callback(partial(self._deliver_later, call))
        else:
            self._deliver(call, results)

    def _execute_failed(self, call: _Call, exc: BaseException) -> None:
        """The cross-replica code of ``call`` raised ``exc``: fail the call with it."""
        if isinstance(exc, asyncio.CancelledError):
            # Nothing was cancelled: the cross-replica code raised CancelledError itself.
            failure = RendezvousError(
                f"{call.label}: the cross-replica code raised CancelledError; raise another "
                "exception to fail a merge_fn."
            )
            failure.__cause__ = exc
        elif isinstance(exc, StopIteration):  # (a future cannot hold one: PEP 479's answer)
            failure = RendezvousError(
                f"{call.label}: the cross-replica code raised StopIteration (e.g. next() "
                "of an exhausted iterator), which no replica's await can receive; catch "
                "it in the merge_fn, or raise another exception to fail the call."
            )
            failure.__cause__ = exc
        else:  # BaseExceptions too (e.g. pytest.fail()): every replica raises it
            failure = exc
        self._fail(call, failure)

    def _deliver(self, call: _Call, results: Sequence[Any]) -> None:
        futures = call.futures
        # Checked here, not by zip(strict=True), whose keyword parsing costs 1.7k
        # instructions a call (0.2 us).
        if len(results) != len(futures):
            self._fail(
                call,
                RendezvousError(
                    f"{call.label}: the cross-replica side returned {len(results)} results "
                    f"for {len(futures)} replicas (a bug in it: one result per replica)."
                ),
            )
            return
        for future, result in zip(futures, results):  # noqa: B905 (lengths checked)
            # No done() test first: a try costs nothing until it catches (and
            # contextlib.suppress would cost a context manager per replica).
            try:
                future.set_result(result)
            except asyncio.InvalidStateError:  # the replica cancelled its wait
                continue

    def _run_on(self, call: _Call, work: asyncio.Future) -> None:
        """Every replica has arrived at merge_call ``call``, and its cross-replica
        work ``work`` (an async merge_fn's task that suspended) goes on: the call is
        *running*, shown by ``pending()`` and reported by ``due_stalls()`` until
        ``work`` ends, then delivered. (Only merge_fns that suspend come here: the
        usual call's work is done before ``_complete`` returns.)"""
        call.running_since = now = perf_counter()
        call.work = work
        if call.stall_after is not None and call.next_warning == math.inf:
            # Reported while replicas were missing: the merge_fn's own stall, if it
            # has one, is another, reported once stall_after after it started.
            call.next_warning = now - call.started + call.stall_after
            watch = self._watch
            if watch is not None:
                watch(now + call.stall_after)
        try:
            running = self._running
        except AttributeError:  # the first (see __init__)
            running = self._running = {}
        running[call.number] = call
        # (A partial, not a lambda: its variables would be cells, made on every call.)
        work.add_done_callback(partial(self._ran, call))

    def _ran(self, call: _Call, done: asyncio.Future) -> None:
        """``call``'s cross-replica work is done: no longer running; deliver it."""
        self._running.pop(call.number, None)
        call.work = None  # (the task: with its result or failure, not kept by the call)
        self._deliver_later(call, done)

    def _deliver_later(self, call: _Call, done: asyncio.Future) -> None:
        if done.cancelled():
            self._fail(call, RendezvousError(f"{call.label} was cancelled while it ran."))
        elif (exc := done.exception()) is not None:
            self._fail(call, exc)
        else:
            self._deliver(call, done.result())

    def _fail(self, call: _Call, exc: BaseException) -> None:
        call.failure = exc
        if self._failed is not None:
            self._failed.append(call)
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        for future in call.futures:
            if future is not None and not future.done():
                future.set_exception(exc)
                if self._quiet:  # failed after a quiet close (see _quiet)
                    future.exception()  # marks it retrieved

    def _time_out(self, call: _Call) -> None:
        call.timer = None
        if call.failure is not None or self._pending.get(call.number) is not call:
            return
        missing = self._missing(call)
        first = self._first
        self._fail(
            call,
            RendezvousTimeoutError(
                f"{call.label}: timed out after {call.timeout:g} s waiting for "
                f"{_replicas(missing, first)}; {_replicas(call.arrivals(), first)} arrived. "
                f"Check that every missing replica reaches this call ({_ORDER_HINT}), or "
                "raise CommunicationOptions(timeout_seconds=...) if they are just slow."
            ),
        )

    # -- messages -------------------------------------------------------------------

    def _exited_before(self, number: int, arriving: int) -> tuple[int, str] | None:
        """The first replica to have finished without making call ``number``, which
        replica ``arriving`` has just arrived at (and counted), with how it finished."""
        made = self._next_number
        for replica, how in self.exited.items():
            # A finished replica's count moves only if a task it left behind, in its
            # context, arrives after all: that arrival fails here, at the count it
            # had (this one not counted), as every later call does.
            if made[replica] - (replica == arriving) <= number:
                return replica, how
        return None

    def _exit_message(self, call: _Call, replica: int, how: str) -> str:
        # Those that arrived may have finished since (a collective started and never
        # awaited), and a task that ``replica`` left running may have called it late:
        # neither waits in it.
        arrived = call.arrivals()
        waiting = [r for r in arrived if r not in self.exited]
        finished = [r for r in arrived if r in self.exited and r != replica]
        first = self._first
        clauses = []
        if waiting:
            verb = "waits" if len(waiting) == 1 else "wait"
            clauses.append(f"{_replicas(waiting, first)} {verb} in it")
        if finished:
            have = "has" if len(finished) == 1 else "have"
            clauses.append(f"{_replicas(finished, first)} called it and {have} finished since")
        if replica in arrived:
            clauses.append(
                f"a task that replica {first + replica} left running called it after that"
            )
        return (
            f"{call.label}: replica {first + replica} {how} without calling it, while "
            f"{' and '.join(clauses)}; {_ORDER_HINT}. "
            "Probably a replica skipped a collective on some condition."
        )

    def _mismatch_message(self, call: _Call, odd: int, signature: Signature) -> str:
        """Replica ``odd`` arrived with ``signature``, the first not to match: every
        replica that arrived before it matched the first arrival's."""
        matched = [replica for replica in call.arrivals() if replica != odd]
        base = self._first
        first, other = call.first.text, signature.text
        # Different calls can read the same (two functions of one name).
        other = f"a different {other}" if other == first else other
        calls = f"{_replicas(matched, base)} called {first}; replica {base + odd} called {other}"
        missing = self._missing(call)
        not_yet = f" ({_replicas(missing, base)} not arrived yet)" if missing else ""
        # Long structures' texts are cut short, and may read alike where they differ:
        # name the first place where they do.
        difference = call.first.difference(signature)
        if difference is not None:
            where, theirs, its = difference
            where = f"at {where}" if where else "at the top level"
            calls += (
                f"; they first differ {where}: {theirs} on {_replicas(matched, base)}, "
                f"{its} on replica {base + odd}"
            )
        return (
            f"collective #{call.number} does not match across replicas: {calls}{not_yet}; "
            f"{_ORDER_HINT}, with the same reduce op, structure, shapes and dtypes."
        )
