"""The rendezvous engine on its own: no arrays, no strategies (STYLE: testable alone)."""

from __future__ import annotations

import asyncio
import time

import pytest

from aiodist import (
    CollectiveMismatchError,
    RendezvousError,
    RendezvousTimeoutError,
    ReplicaExitedError,
)
from aiodist._rendezvous import Rendezvous, Signature

pytestmark = pytest.mark.timeout(10)

SUM = Signature("sum", "int", "sum(int)")


class Recorder:
    """An execute callback that sums payloads and records each execution."""

    def __init__(self):
        self.executions = []

    def __call__(self, number, signature, payloads):
        self.executions.append((number, signature.name, list(payloads)))
        total = sum(payloads)
        return [total + replica for replica in range(len(payloads))]


async def test_completes_once_when_all_arrive_with_per_replica_results():
    execute = Recorder()
    rv = Rendezvous(3, execute)
    futures = [rv.arrive(r, SUM, 10 * r) for r in (2, 0)]
    assert not any(f.done() for f in futures)
    [row] = rv.pending()
    assert (row.name, row.number, row.arrived, row.missing) == ("sum", 0, [0, 2], [1])
    assert row.started <= time.perf_counter() and row.running_since is None
    last = rv.arrive(1, SUM, 10)
    assert [await f for f in futures] == [32, 30]
    assert await last == 31
    assert execute.executions == [(0, "sum", [0, 10, 20])]
    assert rv.pending() == []


async def test_a_wait_its_replica_cancelled_is_skipped_when_the_call_completes():
    rv = Rendezvous(3, Recorder())
    first = rv.arrive(0, SUM, 1)
    first.cancel()  # the replica gave up waiting; its arrival still counts
    second, last = rv.arrive(1, SUM, 2), rv.arrive(2, SUM, 3)
    assert first.cancelled()
    assert (await second, await last) == (7, 8)


async def test_a_future_of_a_loops_own_kind_is_set_by_its_own_set_result():
    # Delivery sets plain asyncio futures through asyncio.Future.set_result; any other
    # kind a loop makes, even one among plain ones, through its own.
    running = asyncio.get_running_loop()
    delivered = []

    class OwnFuture(asyncio.Future):
        def set_result(self, result):
            delivered.append(result)
            super().set_result(result)

    class Loop:  # makes a plain future, then one of its own kind, and so on
        made = 0

        def create_future(self):
            self.made += 1
            return OwnFuture(loop=running) if self.made % 2 == 0 else running.create_future()

    rv = Rendezvous(2, Recorder(), loop=Loop())
    first, second = rv.arrive(0, SUM, 1), rv.arrive(1, SUM, 2)
    assert (await first, await second) == (3, 4)
    assert type(second) is OwnFuture and delivered == [4]


@pytest.mark.parametrize("count", [2, 4])
async def test_execute_returning_a_result_per_replica_too_few_or_many_fails_every_replica(count):
    # A bug on the cross-replica side must not leave a replica waiting for ever (or
    # deliver to some replicas and raise out of the last arrival).
    rv = Rendezvous(3, lambda number, signature, payloads: list(range(count)))
    futures = [rv.arrive(r, SUM, r) for r in range(3)]
    for future in futures:
        with pytest.raises(RendezvousError, match=rf"sum #0: .*returned {count} results for 3"):
            await future


async def test_calls_are_matched_by_call_number_not_time():
    execute = Recorder()
    rv = Rendezvous(2, execute)
    a0 = rv.arrive(0, SUM, 1)
    a1 = rv.arrive(0, SUM, 100)  # replica 0 is already at call #1
    b0 = rv.arrive(1, SUM, 2)
    b1 = rv.arrive(1, SUM, 200)
    assert (await a0, await b0, await a1, await b1) == (3, 4, 300, 301)
    assert [number for number, _, _ in execute.executions] == [0, 1]


async def test_mismatch_fails_arrived_and_later_arrivals():
    rv = Rendezvous(3, Recorder())
    first = rv.arrive(0, SUM, 1)
    odd = rv.arrive(1, Signature("gather", 0, "gather(axis=0)"), 1)
    late = rv.arrive(2, SUM, 1)
    for future in (first, odd, late):
        with pytest.raises(CollectiveMismatchError) as info:
            await future
    message = str(info.value)
    assert "replica 0 called sum(int)" in message
    assert "replica 1 called gather(axis=0)" in message
    assert "replica 2 not arrived yet" in message


async def test_mismatch_of_calls_that_read_the_same_says_they_differ():
    rv = Rendezvous(3, Recorder())
    futures = [rv.arrive(r, SUM, 1) for r in (0, 2)]
    futures.append(rv.arrive(1, Signature("sum", "float", "sum(int)"), 1))
    for future in futures:
        with pytest.raises(CollectiveMismatchError) as info:
            await future
    assert "replicas 0, 2 called sum(int); replica 1 called a different sum(int)" in str(info.value)


async def test_exit_fails_calls_the_replica_never_joined():
    rv = Rendezvous(3, Recorder())
    done = [rv.arrive(r, SUM, 1) for r in range(3)]  # call #0 completes
    waiting = rv.arrive(0, SUM, 1)  # call #1
    rv.replica_exited(2, "returned")
    with pytest.raises(ReplicaExitedError, match=r"sum #1: replica 2 returned without calling"):
        await waiting
    later = rv.arrive(1, SUM, 1)
    with pytest.raises(ReplicaExitedError):
        await later
    assert [await f for f in done] == [3, 4, 5]


async def test_exit_after_joining_everything_is_harmless():
    rv = Rendezvous(2, Recorder())
    a = rv.arrive(0, SUM, 1)
    rv.replica_exited(0, "returned")  # it did join call #0
    b = rv.arrive(1, SUM, 2)
    assert (await a, await b) == (3, 4)


async def test_an_arrival_after_the_replica_exited_fails_and_so_do_later_calls():
    # A task a replica left behind (in its context) may still call a collective
    # after the replica returned: that call, and the others' at that number and
    # after it, fail as calls the replica never made, instead of waiting.
    rv = Rendezvous(3, Recorder())
    done = [rv.arrive(r, SUM, 1) for r in range(3)]  # call #0 completes
    rv.replica_exited(0, "returned")
    late = rv.arrive(0, SUM, 1)  # call #1, from replica 0 after it returned
    with pytest.raises(ReplicaExitedError, match=r"sum #1: replica 0 returned without call"):
        await late
    others = [rv.arrive(r, SUM, 1) for r in (1, 2)]  # call #1 (failed) and ...
    others.append(rv.arrive(1, SUM, 1))  # ... call #2, which replica 0 never made
    for future in others:
        with pytest.raises(ReplicaExitedError, match="replica 0 returned without calling"):
            await future
    assert [await f for f in done] == [3, 4, 5]


async def test_timeout_names_missing_replicas():
    rv = Rendezvous(4, Recorder())
    futures = [rv.arrive(r, SUM, 1, timeout=0.02) for r in (0, 3)]
    for future in futures:
        with pytest.raises(RendezvousTimeoutError) as info:
            await future
    assert "timed out after 0.02 s waiting for replicas 1, 2; replicas 0, 3 arrived" in str(
        info.value
    )


async def test_completion_cancels_the_timer():
    rv = Rendezvous(2, Recorder())
    a = rv.arrive(0, SUM, 1, timeout=0.01)
    b = rv.arrive(1, SUM, 1)
    await asyncio.sleep(0.03)
    assert (a.result(), b.result()) == (2, 3)


async def test_execute_exception_reaches_every_replica():
    boom = ArithmeticError("boom")

    def execute(number, signature, payloads):
        raise boom

    rv = Rendezvous(2, execute)
    futures = [rv.arrive(r, SUM, 1) for r in range(2)]
    for future in futures:
        with pytest.raises(ArithmeticError) as info:
            await future
        assert info.value is boom


async def test_async_execution_delivers_later():
    loop = asyncio.get_running_loop()
    gate = loop.create_future()

    def execute(number, signature, payloads):
        async def later():
            await gate
            return ["a", "b"]

        return loop.create_task(later())

    rv = Rendezvous(2, execute)
    futures = [rv.arrive(r, SUM, 0) for r in range(2)]
    await asyncio.sleep(0)
    assert not any(f.done() for f in futures)
    gate.set_result(None)
    assert [await f for f in futures] == ["a", "b"]


async def test_close_fails_pending_and_later_calls():
    rv = Rendezvous(2, Recorder())
    pending = rv.arrive(0, SUM, 1, timeout=5)
    rv.close("test over")
    with pytest.raises(RendezvousError, match="closed: test over"):
        await pending
    with pytest.raises(RendezvousError, match="closed"):
        await rv.arrive(1, SUM, 1)


def test_engine_does_not_import_arrays():
    import pathlib

    import aiodist._rendezvous as module

    source = pathlib.Path(module.__file__).read_text()
    assert "numpy" not in source and "cupy" not in source


async def test_counters_and_stall_schedule():
    watched = []
    rv = Rendezvous(2, Recorder(), watch=watched.append)
    first = rv.arrive(0, SUM, 1, stall_after=0.01)
    assert len(watched) == 1 and watched[0] >= time.perf_counter() - 1
    started = rv.pending()[0][4]
    assert rv.due_stalls(started)[0] == []  # not yet
    due, next_due = rv.due_stalls(started + 0.011)
    assert [(row.name, row.number, row.arrived, row.missing) for row in due] == [
        ("sum", 0, [0], [1])
    ]
    assert next_due == float("inf")  # reported once (SPEC 11: one warning)
    assert rv.due_stalls(started + 0.021) == ([], float("inf"))
    assert rv.due_stalls(started + 100) == ([], float("inf"))
    second = rv.arrive(1, SUM, 2)
    assert (await first, await second) == (3, 4)
    assert rv.tally.collectives == {"sum": 1}
    assert rv.tally.seconds_waiting > 0  # replica 1 arrived after the checks above
    assert rv.due_stalls(time.perf_counter() + 100) == ([], float("inf"))


async def test_a_reported_call_is_not_rearmed_by_a_later_arrivals_threshold():
    # A later arrival's sooner stall_warning_seconds tightens an unreported call's
    # schedule; once the call was reported it must not make a second report.
    watched = []
    rv = Rendezvous(3, Recorder(), watch=watched.append)
    first = rv.arrive(0, SUM, 1, stall_after=0.01)
    started = rv.pending()[0][4]
    assert len(rv.due_stalls(started + 0.011)[0]) == 1
    second = rv.arrive(1, SUM, 2, stall_after=0.005)
    assert rv.due_stalls(time.perf_counter() + 100) == ([], float("inf"))
    assert len(watched) == 1  # nothing new to watch
    third = rv.arrive(2, SUM, 3)
    assert (await first, await second, await third) == (6, 7, 8)
