"""Stall reports, traces and statistics (SPEC §11)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import aiodist
from tests.conftest import ROOT, cpu_devices, wait_until

pytestmark = pytest.mark.timeout(20)


def rid() -> int:
    return aiodist.get_replica_context().replica_id_in_sync_group


async def stuck_in_io(event: asyncio.Event) -> None:
    await event.wait()  # the line a stall report must point at


async def helper(event: asyncio.Event) -> None:
    await stuck_in_io(event)


async def wait_for_records(caplog, count: int) -> list[logging.LogRecord]:
    return await wait_for_records_of(caplog, None, count)


async def wait_for_records_of(caplog, thread: int | None, count: int) -> list[logging.LogRecord]:
    """The aiodist warnings logged (by ``thread``, if given), once there are ``count``."""
    for _ in range(400):
        records = [
            r
            for r in caplog.records
            if r.name == "aiodist" and (thread is None or r.thread == thread)
        ]
        if len(records) >= count:
            return records
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} aiodist warnings, got {len(records)}")


# -- stall reports -------------------------------------------------------------------


async def test_stall_report_names_missing_replica_and_where_it_waits(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.05)
    strategy = aiodist.MirroredStrategy(cpu_devices(3), communication_options=options)
    release = asyncio.Event()

    async def fn():
        if rid() == 1:
            await helper(release)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    run = asyncio.create_task(strategy.run(fn))
    [record] = await wait_for_records(caplog, 1)
    release.set()
    await run
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert message.startswith("all_reduce #0 has waited 0.")
    assert "replicas 0, 2 arrived, replica 1 missing" in message
    lines = message.splitlines()
    where = lines.index("  replica 1:")
    chain = [line.strip() for line in lines[where + 1 : where + 4]]
    assert chain[0].startswith("test_stall_report_names_missing_replica_and_where_it_waits.")
    assert chain[0].endswith(")") and "tests/test_observability.py:" in chain[0]
    assert chain[1].startswith("helper (tests/test_observability.py:")
    assert chain[2].startswith("stuck_in_io (tests/test_observability.py:")


async def test_stall_report_with_a_timeout_says_when_the_call_fails(caplog):
    # The report told a user who had set timeout_seconds to "set
    # CommunicationOptions(timeout_seconds=...) to fail instead", as if none were set.
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    release = asyncio.Event()

    async def fn():
        if rid() == 1:
            await release.wait()
        per_call = aiodist.CommunicationOptions(timeout_seconds=600)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0, options=per_call)

    run = asyncio.create_task(strategy.run(fn))
    [record] = await wait_for_records(caplog, 1)
    release.set()
    assert strategy.experimental_local_results(await run) == (2.0, 2.0)
    last = record.getMessage().splitlines()[-1]
    assert "set CommunicationOptions(timeout_seconds=...)" not in last
    assert re.search(r"timeout_seconds=600 fails the call in (599\.\d|600\.0) s unless", last), last


async def test_a_plain_replica_function_awaiting_its_future_is_not_reported_as_unstarted(caplog):
    # A plain replica function's returned future is awaited by the scheduler's frame,
    # which reports do not show: a bare future has no chain. The report said "(not
    # started yet)" of a replica that had long started.
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    stuck = asyncio.get_running_loop().create_future()

    def fn():  # a plain function returning an awaitable
        if rid() == 1:
            return stuck  # a bare future: no coroutine behind it
        return aiodist.get_replica_context().all_reduce("sum", 1.0)

    run = asyncio.create_task(strategy.run(fn))
    [record, *_] = await wait_for_records(caplog, 1)
    stuck.set_result(1.0)  # replica 1 returns without joining the all-reduce
    with pytest.raises(aiodist.ReplicaExitedError):
        await run
    message = record.getMessage()
    assert "replica 0 arrived, replica 1 missing" in message
    assert "  replica 1:\n    (awaiting an awaitable with no coroutine frame" in message
    assert "not started" not in message


async def test_a_stall_report_follows_the_child_tasks_a_replica_waits_for(caplog):
    # A replica waiting at the end of a TaskGroup's block, or for asyncio.gather's
    # children (here a plain replica function's returned future), was reported down
    # to TaskGroup.__aexit__, or not at all: never where its child tasks were stuck.
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    release = asyncio.Event()

    async def fetch(shard):
        await release.wait()
        return shard

    async def grouped():
        if rid() == 1:
            async with asyncio.TaskGroup() as group:
                for shard in (1, 0):
                    group.create_task(fetch(shard), name=f"fetch-{shard}")
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    def gathered():
        if rid() == 1:
            return asyncio.gather(fetch(0))
        return aiodist.get_replica_context().all_reduce("sum", 1.0)

    run = asyncio.create_task(strategy.run(grouped))
    [record] = await wait_for_records(caplog, 1)
    release.set()
    assert strategy.experimental_local_results(await run) == (2.0, 2.0)
    lines = record.getMessage().splitlines()
    at = lines.index("  replica 1:")
    assert lines[at + 1].startswith("    test_a_stall_report_follows_the_child_tasks")
    assert re.match(r"    TaskGroup\.(__aexit__|_aexit) \(", lines[at + 2])
    tasks = [i for i, line in enumerate(lines) if line.startswith("    task ")]
    assert [lines[i] for i in tasks] == ["    task 'fetch-0':", "    task 'fetch-1':"]
    for i in tasks:  # each child's own chain, indented below it
        assert lines[i + 1].startswith("      test_a_stall_report_follows_the_child_tasks")
        assert ".<locals>.fetch (" in lines[i + 1]
        assert lines[i + 2].startswith("      Event.wait (")

    caplog.clear()
    release.clear()
    run = asyncio.create_task(strategy.run(gathered))
    [record] = await wait_for_records(caplog, 1)
    release.set()
    with pytest.raises(aiodist.ReplicaExitedError):  # replica 1 never joined it
        await run
    lines = record.getMessage().splitlines()
    at = lines.index("  replica 1:")
    assert re.match(r"    task 'Task-\d+':$", lines[at + 1])
    assert ".<locals>.fetch (" in lines[at + 2] and lines[at + 2].startswith("      ")


async def test_a_stall_is_reported_once_and_never_fails(caplog):
    # SPEC 11: one warning. Reports repeated at doubling intervals (0.03, 0.06,
    # 0.12 s, ...) before.
    caplog.set_level(logging.WARNING, logger="aiodist")
    strategy = aiodist.MirroredStrategy(cpu_devices(2))
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)  # per call
    release = asyncio.Event()

    async def fn():
        if rid() == 0:
            await release.wait()
        return (
            await aiodist.get_replica_context().merge_call(lambda s: "ok")
            if rid() == 0
            else (await aiodist.get_replica_context().all_reduce("sum", 1.0, options=options))
        )

    run = asyncio.create_task(strategy.run(fn))
    [record] = await wait_for_records(caplog, 1)
    assert record.getMessage().startswith("all_reduce #0 has waited 0.0")
    await asyncio.sleep(0.2)  # past 2, 4 and 6 times the threshold: no second report
    assert [r.getMessage() for r in caplog.records if r.name == "aiodist"] == [record.getMessage()]
    assert not run.done()
    release.set()
    with pytest.raises(aiodist.CollectiveMismatchError):  # the stall itself never failed it
        await run


async def test_a_later_arrivals_sooner_stall_warning_is_reported(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    strategy = aiodist.MirroredStrategy(cpu_devices(3))  # the default: 30 s
    soon = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    release, arrived = asyncio.Event(), asyncio.Event()

    async def fn():
        ctx = aiodist.get_replica_context()
        if rid() == 1:
            await release.wait()
        if rid() == 0:
            pending = ctx.all_reduce("sum", 1.0)  # first, with the default
            arrived.set()
            return await pending
        if rid() == 2:
            await arrived.wait()
        return await ctx.all_reduce("sum", 1.0, options=soon if rid() == 2 else None)

    run = asyncio.create_task(strategy.run(fn))
    [record] = await wait_for_records(caplog, 1)
    release.set()
    await run
    assert "replicas 0, 2 arrived, replica 1 missing" in record.getMessage()


async def test_no_report_when_nothing_stalls(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    strategy = aiodist.MirroredStrategy(cpu_devices(4), communication_options=options)

    async def fn():
        for _ in range(20):
            await aiodist.get_replica_context().all_reduce("sum", 1.0)

    for _ in range(5):
        await strategy.run(fn)
    await asyncio.sleep(0.1)  # past the threshold: the watchdog looks and finds nothing
    assert [r for r in caplog.records if r.name == "aiodist"] == []


async def test_stall_report_names_a_merge_fn_still_running_and_where_it_waits(caplog):
    # Every replica arrived at the merge_call, but its async merge_fn waits on
    # something that does not come: no replica is missing, and no report was made.
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.05)
    strategy = aiodist.MirroredStrategy(cpu_devices(3), communication_options=options)
    release = asyncio.Event()

    async def merge_fn(strategy, value):
        await helper(release)
        return sum(strategy.experimental_local_results(value))

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn, args=(rid(),))

    run = asyncio.create_task(strategy.run(fn))
    [record] = await wait_for_records(caplog, 1)  # after 0.05 s
    await asyncio.sleep(0.2)  # once: not again at 0.1 or 0.2 s
    assert len([r for r in caplog.records if r.name == "aiodist"]) == 1
    release.set()
    assert await run == 3  # never failed by the report
    message = record.getMessage()
    name = "test_stall_report_names_a_merge_fn_still_running_and_where_it_waits.<locals>"
    assert message.startswith("merge_call #0 has waited 0.")
    assert "every replica arrived (replicas 0, 1, 2), and merge_fn " in message
    assert f"merge_fn {name}.merge_fn (test_observability.py:" in message
    assert "is still running (for 0." in message
    lines = message.splitlines()
    where = lines.index("  merge_fn:")
    chain = [line.strip() for line in lines[where + 1 : where + 4]]
    assert chain[0].startswith(f"{name}.merge_fn (tests/test_observability.py:")
    assert chain[1].startswith("helper (tests/test_observability.py:")
    assert chain[2].startswith("stuck_in_io (tests/test_observability.py:")
    assert "set CommunicationOptions(timeout_seconds=...) on the strategy" in lines[-1]


async def test_stall_reports_of_a_merge_fn_end_with_its_timeout(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.02, timeout_seconds=0.2)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)

    async def merge_fn(strategy):
        await stuck_in_io(asyncio.Event())  # never set

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    with pytest.raises(aiodist.RendezvousTimeoutError, match=r"merge_fn did not finish within"):
        await strategy.run(fn)
    [report] = [r.getMessage() for r in caplog.records if r.name == "aiodist"]  # at 0.02 s
    assert "timeout_seconds=0.2 cancels merge_fn" in report
    assert strategy.statistics().rendezvous_in_flight == ()


async def test_stall_reports_of_concurrent_runs_a_merge_fn_and_a_missing_replica(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    release = asyncio.Event()

    async def merge_fn(strategy):
        await release.wait()
        return "merged"

    async def merging():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    async def one_late():
        if rid() == 1:
            await helper(release)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    runs = [asyncio.create_task(strategy.run(f)) for f in (merging, one_late, merging)]
    records = await wait_for_records(caplog, 3)
    stats = strategy.statistics()
    release.set()
    results = [await run for run in runs]
    assert (results[0], results[1].values, results[2]) == ("merged", (2.0, 2.0), "merged")
    first = sorted(r.getMessage().splitlines()[0] for r in records[:3])
    assert [line.split(": ", 1)[1].split(",")[0] for line in first] == [
        "replica 0 arrived",
        "every replica arrived (replicas 0",
        "every replica arrived (replicas 0",
    ]
    assert sorted((c.collective, c.state) for c in stats.rendezvous_in_flight) == [
        ("all_reduce", "waiting"),
        ("merge_call", "running"),
        ("merge_call", "running"),
    ]


async def test_a_merge_call_reported_while_waiting_is_reported_again_if_its_merge_fn_stalls(
    caplog,
):
    # Two stalls of one call, each reported once: replica 1 late (missing), then
    # the merge_fn stuck (running), counted from the merge_fn's start.
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.06)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    late, stuck = asyncio.Event(), asyncio.Event()

    async def merge_fn(strategy):
        await stuck.wait()
        return "merged"

    async def fn():
        if rid() == 1:
            await late.wait()
        return await aiodist.get_replica_context().merge_call(merge_fn)

    run = asyncio.create_task(strategy.run(fn))
    [waiting] = await wait_for_records(caplog, 1)
    late.set()
    _, running = await wait_for_records(caplog, 2)
    await asyncio.sleep(0.25)  # no third report
    stuck.set()
    assert await run == "merged"
    assert len([r for r in caplog.records if r.name == "aiodist"]) == 2
    assert "replica 0 arrived, replica 1 missing" in waiting.getMessage()
    assert "every replica arrived (replicas 0, 1), and merge_fn " in running.getMessage()
    still_running = float(running.getMessage().split("(for ")[1].split(" s)")[0])
    assert still_running >= 0.05  # from the merge_fn's start (0.0 s if from the call's)


async def test_a_merge_fn_awaiting_a_bare_future_and_one_that_finishes_in_time(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    future = asyncio.get_running_loop().create_future()

    def returns_a_future(strategy):  # a plain function returning an awaitable
        return future

    async def quick(strategy):
        await asyncio.sleep(0)  # suspends, finishes long before the threshold
        return 1

    async def fn(merge_fn):
        return await aiodist.get_replica_context().merge_call(merge_fn)

    for _ in range(10):
        assert await strategy.run(fn, args=(quick,)) == 1
    await asyncio.sleep(0.06)  # past the threshold: nothing to report
    assert [r for r in caplog.records if r.name == "aiodist"] == []

    run = asyncio.create_task(strategy.run(fn, args=(returns_a_future,)))
    [record] = await wait_for_records(caplog, 1)
    future.set_result("done")
    assert await run == "done"
    message = record.getMessage()
    assert "merge_fn test_a_merge_fn_awaiting_a_bare_future_and_one_that_finishes" in message
    assert "  merge_fn:\n    (awaiting an awaitable with no coroutine frame" in message


class _SameDevicesAreEqual(aiodist.MirroredStrategy):
    """A user's subclass that compares strategies by their devices."""

    def __eq__(self, other):
        return isinstance(other, type(self)) and (
            self.extended.worker_devices == other.extended.worker_devices
        )

    def __hash__(self):
        return hash(self.extended.worker_devices)


class _EqualityWithoutHash(aiodist.MirroredStrategy):
    def __eq__(self, other):  # (which makes the class unhashable)
        return self is other


async def test_strategies_that_compare_equal_each_get_their_stall_reports(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.03)
    first = _SameDevicesAreEqual(cpu_devices(2), communication_options=options)
    second = _SameDevicesAreEqual(cpu_devices(2), communication_options=options)
    unhashable = _EqualityWithoutHash(cpu_devices(2), communication_options=options)
    assert first == second and first is not second
    release = asyncio.Event()

    async def fn():
        if rid() == 1:
            await release.wait()
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    for strategy in (second, unhashable):  # the watchdog tells strategies apart by identity
        caplog.clear()
        release.clear()
        run = asyncio.create_task(strategy.run(fn))
        await wait_for_records(caplog, 1)
        release.set()
        assert (await run).values == (2.0, 2.0)
    assert first.extended.worker_devices  # (alive throughout)


async def test_stall_reports_go_on_while_another_thread_makes_strategies(caplog):
    caplog.set_level(logging.WARNING, logger="aiodist")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.02)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    release = asyncio.Event()
    stop = threading.Event()

    def make_strategies():
        kept = []
        while not stop.is_set():
            kept.append(aiodist.MirroredStrategy(cpu_devices(2)))
            del kept[:-20]  # some die while the watchdog looks

    async def fn():
        if rid() == 1:
            await release.wait()
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside the watchdog's look, not between
    maker = threading.Thread(target=make_strategies)
    maker.start()
    try:
        for stalls in range(1, 6):  # five stalls, each reported once
            release.clear()
            run = asyncio.create_task(strategy.run(fn))
            records = await wait_for_records(caplog, stalls)
            release.set()
            assert (await run).values == (2.0, 2.0)
    finally:
        stop.set()
        maker.join()
        sys.setswitchinterval(interval)
        release.set()
    assert len(records) == 5
    assert all(r.getMessage().startswith("all_reduce #0 has waited") for r in records)


async def test_stall_reports_go_on_while_another_threads_watchdog_reports(caplog):
    """Each loop's watchdog runs in a context of its own. While another thread's
    watchdog is inside its report (here a slow logging handler), this loop's reports
    are made, the one due then and later ones: a context shared by every watchdog
    could not be entered by a second thread at once, which failed that timer and
    left its watchdog waiting for it for ever. (Here the other thread is in its
    report, in the timer's callback, while this loop's timer fires.)"""
    caplog.set_level(logging.WARNING)
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.02)
    in_report, leave_report = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: asyncio.run(stall(leave_report)))

    def slow_in_the_other_thread(record: logging.LogRecord) -> bool:
        # (A filter: a handler would hold its lock meanwhile, and block this thread.)
        if threading.current_thread() is other and not in_report.is_set():
            in_report.set()
            leave_report.wait(10)
        return True

    async def stall(released: threading.Event) -> object:
        strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)

        async def fn():
            if rid() == 1:
                await asyncio.to_thread(released.wait, 10)
            return await aiodist.get_replica_context().all_reduce("sum", 1.0)

        return await strategy.run(fn)

    async def stall_reported_here() -> None:
        """A run here stalls until this thread has logged one stall report more."""
        mine = threading.get_ident()
        before = len([r for r in caplog.records if r.name == "aiodist" and r.thread == mine])
        released = threading.Event()
        run = asyncio.create_task(stall(released))
        await wait_for_records_of(caplog, mine, before + 1)
        released.set()
        assert (await run).values == (2.0, 2.0)

    logging.getLogger("aiodist").addFilter(slow_in_the_other_thread)
    try:
        other.start()
        await asyncio.to_thread(in_report.wait, 10)  # its watchdog is inside its report
        await stall_reported_here()
        leave_report.set()
        await asyncio.to_thread(other.join, 10)
        await stall_reported_here()  # this loop's watchdog still works
    finally:
        leave_report.set()
        logging.getLogger("aiodist").removeFilter(slow_in_the_other_thread)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


_DEFAULT_CONTEXT_IN_TWO_LOOPS = """
import asyncio, sys
import aiodist

options = aiodist.CommunicationOptions(stall_warning_seconds=0.01)

async def default_all_reduce():
    return float(await aiodist.get_replica_context().all_reduce("sum", 1.0, options=options))

def in_thread():
    if sys.argv[1] == "uvloop":
        import uvloop
        return uvloop.run(default_all_reduce())
    return asyncio.run(default_all_reduce())

async def main():
    first = await default_all_reduce()
    await asyncio.sleep(0.05)  # a stall timer armed by that call would have fired
    print(first, await asyncio.to_thread(in_thread))

asyncio.run(main(), debug=True)  # debug: a call from another thread raises RuntimeError
"""


@pytest.mark.parametrize("thread_loop", ["asyncio", "uvloop"])
def test_the_default_context_on_another_threads_loop_arms_no_timer_on_the_first(thread_loop):
    """The default replica context is one for the whole process, used from any loop in
    any thread: its collectives must not arm the stall watchdog of the loop that used
    it first (a timer scheduled on a loop from another thread)."""
    if thread_loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed")
    # (A process of its own: the default context has been used by other tests here.)
    done = subprocess.run(
        [sys.executable, "-c", _DEFAULT_CONTEXT_IN_TWO_LOOPS, thread_loop],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "1.0"]


def test_stall_option_validation():
    with pytest.raises(ValueError, match=r"stall_warning_seconds=0; expected a finite number"):
        aiodist.CommunicationOptions(stall_warning_seconds=0)
    assert aiodist.CommunicationOptions().stall_warning_seconds == 30.0
    assert aiodist.CommunicationOptions(stall_warning_seconds=None).stall_warning_seconds is None
    for bad in (-1, 0.0, float("nan"), float("inf"), "5", True, np.bool_(True), [1.0]):
        for name in ("stall_warning_seconds", "timeout_seconds"):
            with pytest.raises(
                ValueError, match=rf"{name}={re.escape(repr(bad))}; expected a finite number"
            ):
                aiodist.CommunicationOptions(**{name: bad})
    # NumPy's numbers are numbers (read from a config array, say): np.int64(3) and
    # np.float32(0.5) were refused as not "a finite number of seconds > 0".
    for good in (np.int64(3), np.float32(0.5), np.float64(2.0), 3):
        options = aiodist.CommunicationOptions(stall_warning_seconds=good, timeout_seconds=good)
        assert options.stall_warning_seconds == options.timeout_seconds == float(good)
        assert type(options.stall_warning_seconds) is type(options.timeout_seconds) is float


# -- statistics ----------------------------------------------------------------------


async def test_statistics_of_a_run_blocked_mid_rendezvous():
    strategy = aiodist.MirroredStrategy(cpu_devices(3))
    release = asyncio.Event()
    arrived = []

    async def fn():
        if rid() == 2:
            await release.wait()
        arrived.append(rid())
        return await aiodist.get_replica_context().all_reduce("sum", np.ones(2))

    empty = strategy.statistics()
    assert (empty.runs_in_flight, empty.runs, empty.rendezvous_in_flight) == (0, 0, ())

    run = asyncio.create_task(strategy.run(fn))
    await wait_until(lambda: len(arrived) == 2, "replicas 0 and 1 in all_reduce")
    blocked = strategy.statistics()
    assert blocked.runs_in_flight == 1
    [call] = blocked.rendezvous_in_flight
    assert (call.collective, call.call_number, call.arrived, call.missing) == (
        "all_reduce",
        0,
        (0, 1),
        (2,),
    )
    assert "all_reduce #0 arrived=[0, 1] missing=[2]" in repr(blocked)
    release.set()
    await run

    done = strategy.statistics()
    assert (done.runs_in_flight, done.runs, done.rendezvous_in_flight) == (0, 1, ())
    assert dict(done.collectives) == {"all_reduce": 1}
    assert done.bytes_reduced == 3 * 16
    assert done.seconds_waiting > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.runs = 5
    with pytest.raises(TypeError):
        done.collectives["all_reduce"] = 0


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_run_whose_loop_was_closed_is_not_in_flight_for_ever(kind, caplog):
    """A loop closed with a run in flight (run_until_complete, then close() without
    cancelling the tasks left) never finishes that run: statistics() counted it in
    runs_in_flight for ever, and the strategy held its replicas' tasks. It is dropped;
    freed, its replicas' coroutines closed raised "Event loop is closed" (shown as an
    exception ignored, an error here) instead of ending quietly."""
    new_loop = pytest.importorskip("uvloop").new_event_loop if kind == "uvloop" else None
    strategy = aiodist.MirroredStrategy(cpu_devices(2))
    waiting = []

    async def fn():
        waiting.append(rid())
        await asyncio.Event().wait()

    async def start():
        task = asyncio.ensure_future(strategy.run(fn))
        await wait_until(lambda: len(waiting) == 2, "both replicas waiting")
        return task

    loop = new_loop() if new_loop else asyncio.new_event_loop()
    task = loop.run_until_complete(start())
    assert strategy.statistics().runs_in_flight == 1
    loop.close()
    assert strategy.statistics().runs_in_flight == 0
    del task
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()  # (asyncio logs the pending tasks destroyed: the caller's error)
    assert asyncio.run(strategy.run(lambda: 3)) == 3
    assert strategy.statistics().runs_in_flight == 0


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_run_whose_loop_was_closed_in_a_collective_is_freed_quietly(kind, caplog):
    """As above, with a replica waiting in a collective: freed, the run's coroutine
    closed its rendezvous, which failed that replica's wait with a call_soon on the
    closed loop, and the run ended in "Exception ignored in: <coroutine object
    Strategy.run>" with RuntimeError('Event loop is closed') (an error here)."""
    new_loop = pytest.importorskip("uvloop").new_event_loop if kind == "uvloop" else None
    strategy = aiodist.MirroredStrategy(cpu_devices(2))
    waiting = []

    async def fn():
        waiting.append(rid())
        if rid() == 1:
            await asyncio.Event().wait()
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    async def start():
        task = asyncio.ensure_future(strategy.run(fn))
        await wait_until(lambda: len(waiting) == 2, "both replicas waiting")
        await asyncio.sleep(0)  # replica 0 in its all_reduce
        return task

    loop = new_loop() if new_loop else asyncio.new_event_loop()
    task = loop.run_until_complete(start())
    assert strategy.statistics().rendezvous_in_flight
    loop.close()
    assert strategy.statistics().runs_in_flight == 0
    del task
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()  # (asyncio logs the pending tasks destroyed: the caller's error)
    assert asyncio.run(strategy.run(lambda: 3)) == 3


async def test_statistics_can_be_exported_copied_and_pickled(two):
    # A snapshot is data to export: its counts were a types.MappingProxyType, so
    # dataclasses.asdict, copy.deepcopy and pickle (a monitoring process's queue)
    # all raised "cannot pickle 'mappingproxy' object".
    async def fn():
        ctx = aiodist.get_replica_context()
        await ctx.merge_call(lambda strategy: None)
        return await ctx.all_reduce("sum", np.ones(2))

    await two.run(fn)
    stats = two.statistics()
    exported = dataclasses.asdict(stats)
    assert exported["collectives"] == {"all_reduce": 1, "merge_call": 1}
    assert json.loads(json.dumps(exported))["runs"] == 1
    for copied in (copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):
        assert repr(copied) == repr(stats)
        with pytest.raises(TypeError, match=r"snapshot and cannot be changed"):
            copied.collectives["all_reduce"] = 0
    # Still read-only, every way a dict may be changed.
    counts = stats.collectives
    changes = [
        lambda: counts.__setitem__("all_reduce", 0),
        lambda: counts.__delitem__("all_reduce"),
        lambda: counts.update(all_reduce=0),
        lambda: counts.setdefault("all_gather", 0),
        lambda: counts.pop("all_reduce"),
        counts.popitem,
        counts.clear,
    ]
    for change in changes:
        with pytest.raises(TypeError):
            change()
    with pytest.raises(TypeError):
        counts |= {"all_reduce": 0}
    assert counts == {"all_reduce": 1, "merge_call": 1}


async def test_statistics_of_a_run_whose_merge_fn_has_not_finished():
    # Every replica arrived and the async merge_fn still runs: the snapshot showed no
    # rendezvous in flight at all, and the merge_call among the completed ones.
    strategy = aiodist.MirroredStrategy(cpu_devices(3))
    release = asyncio.Event()
    started = []

    async def merge_fn(strategy):
        started.append(True)
        await release.wait()
        return "merged"

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    run = asyncio.create_task(strategy.run(fn))
    await wait_until(lambda: started, "merge_fn started")
    await asyncio.sleep(0.01)
    [call] = strategy.statistics().rendezvous_in_flight
    assert (call.collective, call.call_number, call.arrived, call.missing, call.state) == (
        "merge_call",
        0,
        (0, 1, 2),
        (),
        "running",
    )
    assert call.waiting_seconds >= call.running_seconds >= 0.005
    name = "test_statistics_of_a_run_whose_merge_fn_has_not_finished.<locals>.merge_fn"
    assert call.merge_fn.startswith(f"{name} (test_observability.py:")
    assert f"<merge_call #0 arrived=[0, 1, 2] running: merge_fn {name} (" in repr(call)
    release.set()
    assert await run == "merged"
    assert strategy.statistics().rendezvous_in_flight == ()


async def test_statistics_include_what_runs_in_flight_have_done(two):
    release = asyncio.Event()
    gathered = []

    async def fn():
        ctx = aiodist.get_replica_context()
        await ctx.all_gather(np.ones(2), axis=0)
        gathered.append(rid())
        if rid() == 1:
            await release.wait()
        return await ctx.all_reduce("sum", np.ones(3))

    run = asyncio.create_task(two.run(fn))
    await wait_until(lambda: len(gathered) == 2, "both replicas past the all-gather")
    blocked = two.statistics()
    assert (blocked.runs_in_flight, blocked.runs) == (1, 0)
    assert dict(blocked.collectives) == {"all_gather": 1}
    assert blocked.bytes_reduced == 2 * 16
    release.set()
    await run
    done = two.statistics()
    assert dict(done.collectives) == {"all_gather": 1, "all_reduce": 1}
    assert done.bytes_reduced == 2 * 16 + 2 * 24


async def test_statistics_count_every_kind(two):
    async def fn():
        ctx = aiodist.get_replica_context()
        await ctx.all_reduce("sum", [1.0, 2.0])
        await ctx.all_gather(np.ones(3 + ctx.replica_id_in_sync_group), axis=0)  # 3 and 4
        await ctx.merge_call(lambda s: None)

    await two.run(fn)
    first = two.statistics()
    await two.run(fn)
    stats = two.statistics()
    assert stats.runs == 2
    assert dict(stats.collectives) == {"all_reduce": 2, "all_gather": 2, "merge_call": 2}
    assert stats.bytes_reduced == 2 * (2 * 2 * 8 + (3 + 4) * 8)
    # A snapshot keeps its figures while the strategy goes on counting.
    assert (first.runs, first.collectives["all_reduce"], first.bytes_reduced) == (1, 1, 88)


async def test_statistics_from_another_thread_while_runs_come_and_go():
    # A monitor thread (or another loop's) taking snapshots while this loop's runs
    # add and remove rendezvous calls: statistics() iterated a run's dict of calls in
    # Python and raised "dictionary changed size during iteration" (a few times in a
    # thousand snapshots here). Every snapshot must be whole: each replica either
    # arrived or missing.
    strategy = aiodist.MirroredStrategy(cpu_devices(4))
    stop, errors, snapshots = threading.Event(), [], []

    def monitor():
        while not stop.is_set() or not snapshots:
            try:
                stats = strategy.statistics()
                for call in stats.rendezvous_in_flight:
                    assert sorted(call.arrived + call.missing) == [0, 1, 2, 3], call
            except Exception as exc:
                errors.append(exc)
            snapshots.append(None)

    async def step():
        ctx = aiodist.get_replica_context()
        for i in range(10):
            await ctx.all_reduce("sum", float(i))
            await asyncio.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        for _ in range(4):
            await asyncio.gather(*(strategy.run(step) for _ in range(8)))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, f"{len(errors)} of {len(snapshots)} snapshots failed: {errors[0]!r}"


async def test_statistics_of_the_default_strategy_count_its_collectives():
    # Outside any scope, the default replica context's collectives complete at once;
    # the default strategy counts them as a strategy counts its runs' collectives.
    default = aiodist.get_strategy()
    before = default.statistics()
    ctx = aiodist.get_replica_context()
    assert await ctx.all_reduce("sum", np.ones(4, dtype=np.float32)) is not None
    await ctx.merge_call(lambda strategy: None)
    after = default.statistics()
    for name in ("all_reduce", "merge_call"):
        assert after.collectives.get(name, 0) == before.collectives.get(name, 0) + 1
    assert after.bytes_reduced == before.bytes_reduced + 16
    assert after.runs == before.runs  # no run: collectives of the default context


# -- traces --------------------------------------------------------------------------


# A span is written as its start and its duration, and start + (end - start) is not
# always end in floating point (about one time in a thousand for a short start and a
# long end): ends computed from ts + dur agree to far better than this (microseconds).
_ULPS = 1e-3


def _nested_per_track(events: list[dict]) -> None:
    """Complete events on one track must nest (Perfetto drops ones that overlap), up
    to the last bit of ts + dur (see _ULPS)."""
    by_track: dict[int, list] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in by_track.items():
        open_spans: list = []
        for start, end, name in sorted(spans):
            while open_spans and open_spans[-1][1] <= start + _ULPS:
                open_spans.pop()
            assert not open_spans or end <= open_spans[-1][1] + _ULPS, (
                track,
                open_spans[-1],
                name,
            )
            open_spans.append((start, end, name))


def _validate(document: dict) -> list[dict]:
    """Checks the Chrome trace event format rules that viewers rely on."""
    assert set(document) >= {"traceEvents"}
    events = document["traceEvents"]
    for event in events:
        assert event["ph"] in {"X", "i", "M"}
        assert isinstance(event["pid"], int) and isinstance(event["name"], str)
        if event["ph"] != "M" or event["name"] != "process_name":
            assert isinstance(event["tid"], int)
        if event["ph"] in {"X", "i"}:
            assert isinstance(event["ts"], int | float) and event["ts"] >= 0
        if event["ph"] == "X":
            assert event["dur"] >= 0
    _nested_per_track(events)
    return events


@pytest.mark.parametrize("before", ["another trace", "no trace"])
async def test_a_run_begun_before_the_trace_gets_tracks_of_its_own(tmp_path, two, before):
    # Run X starts (in an earlier trace, or untraced) and waits; trace B starts, and
    # run Y starts in it; X's collective completes while Y runs. X must not write on
    # Y's tracks (lane 0 of B): spans on one track must nest.
    go, y_arrived = asyncio.Event(), asyncio.Event()

    async def slow_step():
        ctx = aiodist.get_replica_context()
        if rid() == 1:
            await go.wait()
        return await ctx.all_reduce("sum", 1.0)

    async def fast_step():
        ctx = aiodist.get_replica_context()
        pending = ctx.all_reduce("sum", 1.0)
        y_arrived.set()
        await asyncio.sleep(0.01)
        return await pending

    if before == "another trace":
        with aiodist.trace(tmp_path / "a.json"):
            x = asyncio.create_task(two.run(slow_step))
            await asyncio.sleep(0.005)
    else:
        x = asyncio.create_task(two.run(slow_step))
        await asyncio.sleep(0.005)
    with aiodist.trace(tmp_path / "b.json"):
        y = asyncio.create_task(two.run(fast_step))
        await y_arrived.wait()
        go.set()  # X's all-reduce completes while Y is in flight
        await asyncio.gather(x, y)
    events = _validate(json.loads((tmp_path / "b.json").read_text()))
    collectives = [e for e in events if e["ph"] == "X" and e["cat"] == "collective"]
    assert len(collectives) == 2 and len({e["tid"] for e in collectives}) == 2
    assert len({e["args"]["run"] for e in collectives}) == 2
    assert not two.statistics().runs_in_flight
    # Lanes were given back: a later run takes lane 0 again.
    with aiodist.trace(tmp_path / "c.json"):
        await two.run(fast_step)
    later = _validate(json.loads((tmp_path / "c.json").read_text()))
    assert {e["tid"] for e in later if e["ph"] == "X" and e["cat"] == "collective"} == {100_000}


async def test_datasets_prefetching_at_once_get_input_tracks_of_their_own(tmp_path, two):
    async def source(delay):
        for _ in range(3):
            await asyncio.sleep(delay)
            yield np.ones(4)

    async def consume(dataset):
        return [batch async for batch in dataset]

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        await asyncio.gather(
            consume(two.experimental_distribute_dataset(source(0.010))),
            consume(two.experimental_distribute_dataset(source(0.015))),
        )
    events = _validate(json.loads(path.read_text()))  # no overlap on one track
    prefetches = [e for e in events if e["ph"] == "X" and e["name"] == "prefetch"]
    assert len(prefetches) == 8  # 3 elements and the end, per dataset
    assert {e["tid"] for e in prefetches} == {100_001, 1_100_001}
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[100_001] == "input" and names[1_100_001] == "input (lane 1)"


async def test_a_prefetch_that_fails_has_its_span_and_outcome(tmp_path, two):
    # A fetch that raised (the source's read failed) or was stopped (the dataset
    # closed during a slow read) wrote no span: the trace showed nothing of the read
    # the input pipeline failed or waited in.
    stop_reading = asyncio.Event()

    async def failing():
        yield np.ones(4)
        await asyncio.sleep(0.01)  # a slow read, that then fails
        raise OSError("disk gone")

    async def stuck():
        yield np.ones(4)
        await stop_reading.wait()
        yield np.ones(4)

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        with pytest.raises(OSError, match="disk gone"):
            async for _ in two.experimental_distribute_dataset(failing()):
                pass
        dataset = aiter(two.experimental_distribute_dataset(stuck()))
        await anext(dataset)
        await asyncio.sleep(0.01)  # the next read is under way, and never returns
        await dataset.aclose()
    events = _validate(json.loads(path.read_text()))
    outcomes = [e["args"].get("outcome") for e in events if e["name"] == "prefetch"]
    assert outcomes.count(None) == 2  # the first element of each
    assert sorted(o for o in outcomes if o) == ["cancelled", "raised OSError"]
    (failed,) = [e for e in events if e["args"].get("outcome") == "raised OSError"]
    assert failed["dur"] >= 10_000  # its slow read, 10 ms


async def test_a_sync_merge_fn_that_raises_has_its_cross_replica_span(tmp_path, two):
    def bad_merge(strategy):
        raise LookupError("boom")

    async def step():
        return await aiodist.get_replica_context().merge_call(bad_merge)

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        with pytest.raises(LookupError, match="boom"):
            await two.run(step)
    events = _validate(json.loads(path.read_text()))
    [span] = [e for e in events if e["ph"] == "X" and e["name"] == "merge_call #0"]
    assert span["args"]["outcome"] == "raised LookupError"
    waits = [e for e in events if e["ph"] == "X" and e["name"] == "wait merge_call #0"]
    assert len(waits) == 2


async def test_an_async_merge_fn_that_fails_has_its_outcome_in_the_trace(tmp_path):
    # A sync merge_fn that raised had its outcome on its span; an async one that
    # raised after suspending, or was cancelled by timeout_seconds, had none.
    options = aiodist.CommunicationOptions(timeout_seconds=0.05)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)

    async def raises(strategy):
        await asyncio.sleep(0)
        raise LookupError("boom")

    async def hangs(strategy):
        await asyncio.Event().wait()

    async def step(merge_fn):
        return await aiodist.get_replica_context().merge_call(merge_fn)

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        with pytest.raises(LookupError, match="boom"):
            await strategy.run(step, args=(raises,))
        with pytest.raises(aiodist.RendezvousTimeoutError):
            await strategy.run(step, args=(hangs,))
    events = _validate(json.loads(path.read_text()))
    spans = [e for e in events if e["ph"] == "X" and e["name"] == "merge_call #0"]
    assert [e["args"].get("outcome") for e in spans] == [
        "raised LookupError",
        "raised RendezvousTimeoutError",
    ]
    assert spans[1]["dur"] >= 0.04e6


async def test_trace_file_has_tracks_and_events_per_replica(tmp_path):
    strategy = aiodist.MirroredStrategy(cpu_devices(3))

    async def fn(x):
        ctx = aiodist.get_replica_context()
        total = await ctx.all_reduce("sum", x)
        await ctx.merge_call(lambda s: None)
        return total

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        async for batch in strategy.experimental_distribute_dataset([np.arange(6.0)] * 2):
            await strategy.run(fn, args=(batch,))
    events = _validate(json.loads(path.read_text()))

    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(tracks) == {"replica 0", "replica 1", "replica 2", "cross-replica", "input"}
    spans = [e for e in events if e["ph"] == "X"]

    def on(track: str, name: str) -> list[dict]:
        return [e for e in spans if e["tid"] == tracks[track] and e["name"] == name]

    for replica in range(3):
        track = f"replica {replica}"
        assert len(on(track, "run 1")) == 1 and len(on(track, "run 2")) == 1
        assert len(on(track, "wait all_reduce #0")) == 2
        assert len(on(track, "wait merge_call #1")) == 2
        arrivals = [e for e in events if e["ph"] == "i" and e["tid"] == tracks[track]]
        assert {e["name"] for e in arrivals} == {"arrive all_reduce #0", "arrive merge_call #1"}
    assert len(on("cross-replica", "all_reduce #0")) == 2
    assert len(on("cross-replica", "merge_call #1")) == 2
    assert len(on("input", "prefetch")) >= 2
    run = on("replica 0", "run 1")[0]
    wait = on("replica 0", "wait all_reduce #0")[0]
    assert run["ts"] <= wait["ts"] <= wait["ts"] + wait["dur"] <= run["ts"] + run["dur"] + 1


async def test_concurrent_runs_are_traced_on_tracks_of_their_own(tmp_path, two):
    # Two runs in flight at once (a server's requests) shared "replica 0", where their
    # spans overlapped without nesting (viewers drop such spans). Each takes the lowest
    # free lane; a later run, alone, goes back to lane 0.
    async def step(delay):
        await asyncio.sleep(delay)
        total = await aiodist.get_replica_context().all_reduce("sum", 1.0)
        await asyncio.sleep(delay)
        return total

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        first = asyncio.create_task(two.run(step, args=(0.02,)))
        await asyncio.sleep(0.01)
        await asyncio.gather(first, two.run(step, args=(0.02,)))
        await two.run(step, args=(0,))
    events = _validate(json.loads(path.read_text()))  # spans nest on every track
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(tracks) == {
        "replica 0",
        "replica 1",
        "cross-replica",
        "replica 0 (lane 1)",
        "replica 1 (lane 1)",
        "cross-replica (lane 1)",
    }
    runs = {
        name: sorted(e["name"] for e in events if e["ph"] == "X" and e["tid"] == tid)
        for name, tid in tracks.items()
        if name.startswith("replica 0")
    }
    assert runs == {
        "replica 0": ["run 1", "run 3", "wait all_reduce #0", "wait all_reduce #0"],
        "replica 0 (lane 1)": ["run 2", "wait all_reduce #0"],
    }


async def test_waits_of_collectives_in_flight_at_once_go_on_a_track_below(tmp_path, two):
    # Replica 0 has both all-reduces in flight at once; replica 1 joins #0, then #1
    # later. Replica 0's waits overlapped on its track without nesting (#1 began
    # inside #0 and ended after it), which Perfetto drops; the later one now goes
    # on "replica 0 (overlap 1)", just below.
    async def step():
        ctx = aiodist.get_replica_context()
        if rid() == 0:
            return await asyncio.gather(ctx.all_reduce("sum", 1.0), ctx.all_reduce("sum", 2.0))
        await asyncio.sleep(0.01)
        first = await ctx.all_reduce("sum", 1.0)
        await asyncio.sleep(0.01)
        return [first, await ctx.all_reduce("sum", 2.0)]

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        await two.run(step)
    events = _validate(json.loads(path.read_text()))  # spans nest on every track
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    waits = sorted(
        (names[e["tid"]], e["name"]) for e in events if e["name"].startswith("wait all_reduce")
    )
    assert waits == [
        ("replica 0", "wait all_reduce #0"),
        ("replica 0 (overlap 1)", "wait all_reduce #1"),
        ("replica 1", "wait all_reduce #0"),
        ("replica 1", "wait all_reduce #1"),
    ]
    tracks = [names[tid] for tid in sorted(names, key=order.__getitem__)]
    assert tracks == ["cross-replica", "replica 0", "replica 0 (overlap 1)", "replica 1"]


async def test_a_failed_collective_has_its_wait_span(tmp_path, two):
    # Waits were written when a call completed, so the one that timed out (the one
    # that failed the run) had no span.
    async def step():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            await asyncio.sleep(1)
        options = aiodist.CommunicationOptions(timeout_seconds=0.05)
        return await ctx.all_reduce("sum", 1.0, options=options)

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        with pytest.raises(aiodist.RendezvousTimeoutError):
            await two.run(step)
    events = _validate(json.loads(path.read_text()))
    (wait,) = [e for e in events if e["name"] == "wait all_reduce #0"]
    assert wait["tid"] == 1 and wait["dur"] >= 0.04e6  # replica 0 waited the timeout
    assert not any(e["name"] == "all_reduce #0" for e in events)  # it never ran


async def test_a_wait_across_two_traces_goes_to_the_second_on_its_clock(tmp_path, two):
    # A trace that stops while a replica waits, and another that starts before the
    # call completes: the wait is in the second, from its start (it began before),
    # not with a start from the first one's clock (0.3 s ahead).
    go = asyncio.Event()

    async def step():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            await go.wait()
        return await ctx.all_reduce("sum", 1.0)

    with aiodist.trace(tmp_path / "a.json"):
        await asyncio.sleep(0.3)  # A's clock runs 0.3 s ahead of B's
        run = asyncio.create_task(two.run(step))
        await asyncio.sleep(0.01)  # replica 0 arrives and waits
    with aiodist.trace(tmp_path / "b.json"):
        await asyncio.sleep(0.02)
        go.set()
        await run
    events = _validate(json.loads((tmp_path / "b.json").read_text()))
    waits = {e["tid"]: e for e in events if e["name"] == "wait all_reduce #0"}
    (arrival,) = [e for e in events if e["name"] == "arrive all_reduce #0"]  # replica 1's
    (collective,) = [e for e in events if e["name"] == "all_reduce #0"]
    # (On A's clock the arrival would be at 0.33 s or later: 0.2 s leaves a loaded
    # machine room, where 0.05 s failed at 0.055 s.)
    assert waits[1]["ts"] == 0 and waits[2]["ts"] == arrival["ts"] < 0.2e6
    for wait in waits.values():  # both end as the collective did
        end = collective["ts"] + collective["dur"]
        assert wait["ts"] + wait["dur"] == pytest.approx(end, abs=_ULPS)


async def test_a_wait_ends_when_its_collective_completes_not_when_the_loop_gets_to_it(
    tmp_path, two
):
    # The replica completing the call keeps the loop busy before it awaits: the other
    # replica's wait still ends when the collective did.
    async def step():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            await asyncio.sleep(0.01)
            pending = ctx.all_reduce("sum", 1.0)
            time.sleep(0.05)  # the point: the loop is busy
            return await pending
        return await ctx.all_reduce("sum", 1.0)

    path = tmp_path / "trace.json"
    with aiodist.trace(path):
        await two.run(step)
    events = _validate(json.loads(path.read_text()))
    (collective,) = [e for e in events if e["name"] == "all_reduce #0"]
    ends = [e["ts"] + e["dur"] for e in events if e["name"] == "wait all_reduce #0"]
    # The loop was busy for 50 ms (50,000 us) after the collective completed.
    assert ends == [pytest.approx(collective["ts"] + collective["dur"], abs=_ULPS)] * 2


async def test_async_trace_and_one_trace_at_a_time(tmp_path, two):
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    async with aiodist.trace(tmp_path / "a.json"):
        await two.run(fn)
        with pytest.raises(aiodist.ContextError, match=r"already being recorded"):
            with aiodist.trace(tmp_path / "b.json"):
                pass
    events = _validate(json.loads((tmp_path / "a.json").read_text()))
    assert any(e["name"] == "all_reduce #0" for e in events)
    await two.run(fn)  # not recording any more
    assert not (tmp_path / "b.json").exists()


async def test_trace_path_is_checked_first_and_never_hides_the_blocks_error(tmp_path, two, caplog):
    with pytest.raises(aiodist.InvalidArgumentError, match=r"folder '.*missing' does not exist"):
        with aiodist.trace(tmp_path / "missing" / "t.json"):
            pytest.fail("the block must not run")
    folder = tmp_path / "gone"
    folder.mkdir()
    with pytest.raises(KeyError, match="the block's own"):
        with aiodist.trace(folder / "t.json"):
            folder.rmdir()  # the file cannot be written at the end
            raise KeyError("the block's own")
    assert "could not write" in caplog.text


async def test_a_trace_path_naming_a_folder_is_refused_before_the_block_runs(tmp_path, two):
    # It was found only when the file was written, after the block (a whole training
    # loop) had run, and the trace was lost with an IsADirectoryError.
    for folder in (tmp_path, str(tmp_path)):
        with pytest.raises(aiodist.InvalidArgumentError, match=r"it is a folder; name a file"):
            with aiodist.trace(folder):
                pytest.fail("the block must not run")
        with pytest.raises(aiodist.InvalidArgumentError, match=r"it is a folder"):
            async with aiodist.trace(folder):
                pytest.fail("the block must not run")
    with aiodist.trace(tmp_path / "t.json"):  # no trace was left recording
        await two.run(rid)
    assert (tmp_path / "t.json").is_file()


async def test_a_trace_path_that_cannot_be_written_is_refused_before_the_block_runs(tmp_path, two):
    # The folder exists, but the file cannot be made there (a read-only folder, a
    # link into a folder that is gone, a file taken for a folder): found only when
    # the file was written, after the block (a whole training loop) had run, whose
    # trace was then lost; a file taken for a folder was said not to exist.
    steps = []

    async def refused(path, match):
        with pytest.raises(aiodist.InvalidArgumentError, match=match):
            with aiodist.trace(path):
                steps.append(await two.run(rid))
        with pytest.raises(aiodist.InvalidArgumentError, match=match):
            async with aiodist.trace(path):
                steps.append(await two.run(rid))

    link = tmp_path / "link.json"
    try:
        link.symlink_to(tmp_path / "gone" / "t.json")
    except OSError:  # (Windows, without the privilege to make links)
        pass
    else:
        await refused(link, r"cannot write '.*link.json': No such file or directory")
    (tmp_path / "notes.txt").write_text("")
    await refused(tmp_path / "notes.txt" / "t.json", r"'.*notes.txt' is a file, not a folder")
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # (root may write anywhere)
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
        await refused(read_only / "t.json", r"cannot write '.*t.json': Permission denied")
    assert steps == []
    # The check leaves an existing file as it is, and makes no new one, until the
    # trace is written.
    (tmp_path / "old.json").write_text("old")
    with aiodist.trace(tmp_path / "old.json"):
        assert (tmp_path / "old.json").read_text() == "old"
        await two.run(rid)
    with aiodist.trace(tmp_path / "new.json"):
        assert not (tmp_path / "new.json").exists()
        await two.run(rid)
    for name in ("old.json", "new.json"):
        assert any(
            e["name"] == "run 1" for e in _validate(json.loads((tmp_path / name).read_text()))
        )


async def test_a_relative_trace_path_names_a_file_in_the_folder_current_at_entry(
    tmp_path, two, monkeypatch
):
    # The path was checked in the folder current as the block started and written
    # in the one current as it ended: a block that changed folder (a tool, a library
    # call) had its trace written elsewhere, or lost where that folder was gone.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for form in ("with", "async with"):
        monkeypatch.chdir(tmp_path / "a")
        recording = aiodist.trace("t.json")
        if form == "with":
            with recording:
                await two.run(rid)
                monkeypatch.chdir(tmp_path / "b")
        else:
            async with recording:
                await two.run(rid)
                monkeypatch.chdir(tmp_path / "b")
        assert [p.name for p in (tmp_path / "b").iterdir()] == []
        _validate(json.loads((tmp_path / "a" / "t.json").read_text()))
        (tmp_path / "a" / "t.json").unlink()


async def test_await_chain_shows_no_scheduler_frames_while_tracing(two, tmp_path):
    # While tracing, a plain replica function returning a coroutine runs inside two
    # scheduler wrappers (_traced, _call); the chain starts at the user's frames.
    from aiodist._stall import await_chain

    event = asyncio.Event()

    def replica_fn():
        return helper(event)

    with aiodist.trace(tmp_path / "t.json"):
        run = asyncio.create_task(two.run(replica_fn))
        await asyncio.sleep(0.01)
        group = next(iter(two._live_groups))
        names = [entry.split(" (")[0] for entry in await_chain(group._tasks[0].get_coro())]
        event.set()
        await run
    assert names[:2] == ["helper", "stuck_in_io"]


async def test_await_chain_follows_the_stream_driver():
    """GPU replicas are driven by _streams.drive; stall reports must still show user frames."""
    from aiodist._stall import await_chain
    from aiodist._streams import drive

    event = asyncio.Event()

    async def replica_fn():
        await helper(event)

    task = asyncio.create_task(drive(replica_fn(), lambda: None, lambda token: None))
    await asyncio.sleep(0)
    names = [entry.split(" (")[0] for entry in await_chain(task.get_coro())]
    event.set()
    await task
    assert names[:3] == [
        "test_await_chain_follows_the_stream_driver.<locals>.replica_fn",
        "helper",
        "stuck_in_io",
    ]


async def test_await_chain_goes_through_async_generators_custom_awaitables_and_tasks():
    # Each suspends in a C object with no public link onward (an asend(), a custom
    # __await__ iterator, a future's iterator): the chain stopped at the replica's
    # own frame, so a stall report did not say where the replica was.
    from aiodist._stall import await_chain

    event = asyncio.Event()

    async def rows():
        await helper(event)
        yield 1

    class Awaitable:
        def __await__(self):
            return helper(event).__await__()

    async def through_async_for():
        async for _ in rows():
            pass

    async def through_custom_awaitable():
        await Awaitable()

    async def through_a_task():
        await asyncio.create_task(helper(event))

    chains = {}
    for fn in (through_async_for, through_custom_awaitable, through_a_task):
        task = asyncio.create_task(fn())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        chains[fn.__name__] = [
            e.split(" (")[0].rsplit(".", 1)[-1] for e in await_chain(task.get_coro())
        ]
    event.set()
    await asyncio.sleep(0.01)
    assert chains == {
        "through_async_for": ["through_async_for", "rows", "helper", "stuck_in_io", "wait"],
        "through_custom_awaitable": ["through_custom_awaitable", "helper", "stuck_in_io", "wait"],
        "through_a_task": ["through_a_task", "helper", "stuck_in_io", "wait"],
    }


async def test_await_chain_ignores_look_alikes():
    # An awaitable holding an object that answers every attribute (a mock) is not a
    # coroutine: the chain used to take it for one, and the stall report crashed.
    from unittest import mock

    from aiodist._stall import await_chain

    future = asyncio.get_running_loop().create_future()

    class Ticket:  # a hand-written awaitable: its own iterator, holding a mock
        def __init__(self):
            self.on_done = mock.Mock()

        def __await__(self):
            return self

        def __next__(self):
            if not future.done():
                return next(future.__await__())
            raise StopIteration(future.result())

    async def holder():
        return await Ticket()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    names = [entry.split(" (")[0] for entry in await_chain(task.get_coro())]
    future.set_result(1)
    assert await task == 1
    assert names == ["test_await_chain_ignores_look_alikes.<locals>.holder"]
