"""A finished run leaves no cyclic garbage (group -> task -> context -> group cycles).

Cycles would make every run wait for the garbage collector, which costs time on
every step (issue 6); reference counting must free a run as soon as it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial

import numpy as np

import aiodist
from tests.conftest import assert_no_cyclic_garbage, wait_until


async def test_runs_leave_no_cyclic_garbage(strategy):
    one = np.float32(1.0)

    async def constant():
        return 1.0

    async def reduce():
        return await aiodist.get_replica_context().all_reduce("sum", one)

    async def merge():
        ctx = aiodist.get_replica_context()

        async def merge_fn(s, v):
            return await s.reduce("sum", v, axis=None)

        return await ctx.merge_call(merge_fn, args=(one + ctx.replica_id_in_sync_group,))

    async def nested():  # structures: packed and unpacked per call (_nest.pack_as)
        ctx = aiodist.get_replica_context()
        total = await ctx.all_reduce("sum", {"a": np.ones(3), "b": [np.ones(2), one]})
        gathered = await ctx.all_gather({"x": [np.ones((1, 2))]}, axis=0)
        return total, gathered

    async def merge_reaching_its_run():  # (the run keeps its last merge_fn while it runs)
        me = asyncio.current_task()  # the closure reaches the task, its context, the run

        def merge_fn(s, v):
            return me is not None

        return await aiodist.get_replica_context().merge_call(merge_fn, args=(one,))

    for fn in (constant, reduce, merge, nested, merge_reaching_its_run):
        await assert_no_cyclic_garbage(partial(strategy.run, fn), warm_up=20, repeats=200)


async def test_failed_runs_leave_no_cyclic_garbage(two):
    """A failure's traceback holds the frames it passed through: none of them may hold
    the failure itself (the run's frame, holding its failure and its tasks; the last
    arrival's frame, holding the future that a merge_fn's exception failed), or every
    failed run or call is a cycle."""
    one = np.float32(1.0)

    def merge_raises(strategy):
        raise KeyError("from merge_fn")

    async def replica_raises():
        if aiodist.get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("replica 1")
        await asyncio.sleep(3600)

    async def replica_exits():
        if aiodist.get_replica_context().replica_id_in_sync_group == 1:
            return None
        return await aiodist.get_replica_context().all_reduce("sum", one)

    async def mismatch():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("max" if ctx.replica_id_in_sync_group else "sum", one)

    async def merge_fn_raises():
        return await aiodist.get_replica_context().merge_call(merge_raises)

    async def merge_fn_raises_caught():
        try:
            await aiodist.get_replica_context().merge_call(merge_raises)
        except KeyError:
            return None

    async def never_awaited_fails():  # run raises the errors no replica retrieved
        ctx = aiodist.get_replica_context()
        ctx.all_reduce("max" if ctx.replica_id_in_sync_group else "sum", one)
        ctx.merge_call(merge_raises)

    async def merge_fn_raises_never_awaited():  # (raised with merge_fn's traceback)
        aiodist.get_replica_context().merge_call(merge_raises)

    async def async_merge_raises(strategy):  # raises in a later step of its task
        await asyncio.sleep(0)
        raise KeyError("from an async merge_fn")

    async def async_merge_fn_raises():
        return await aiodist.get_replica_context().merge_call(async_merge_raises)

    async def async_merge_fn_raises_never_awaited():
        await asyncio.sleep(0)
        aiodist.get_replica_context().merge_call(async_merge_raises)

    async def replica_cancelled_by_other_code():  # (its error chained to the cancel)
        if aiodist.get_replica_context().replica_id_in_sync_group == 1:
            asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)
        await asyncio.sleep(3600)

    async def run(fn):
        with contextlib.suppress(ValueError, KeyError, aiodist.RendezvousError):
            await two.run(fn)

    async def default_context():  # the default replica context, outside any run
        with contextlib.suppress(KeyError):
            await aiodist.get_replica_context().merge_call(merge_raises)

    cases = [
        partial(run, fn)
        for fn in (
            replica_raises,
            replica_exits,
            mismatch,
            merge_fn_raises,
            merge_fn_raises_caught,
            never_awaited_fails,
            merge_fn_raises_never_awaited,
            async_merge_fn_raises,
            async_merge_fn_raises_never_awaited,
            replica_cancelled_by_other_code,
        )
    ]
    for case in (*cases, default_context):
        await assert_no_cyclic_garbage(case)


def test_per_step_functions_make_no_closure_cells():
    """Python 3.11 makes a cell for each variable that an inner function or
    comprehension uses, on every call of the function holding it, whether or not
    that call builds the closure (about 16 ns each). The functions every run or
    collective calls hold none (docs/design.md, cost model)."""
    from aiodist import _rendezvous, _replica_context, _scheduler, _strategy, _values

    per_step = [
        _strategy.Strategy.run,
        _strategy.Strategy.reduce,
        _scheduler.RunGroup.__init__,
        _scheduler.RunGroup.run,
        _scheduler.RunGroup._coroutines,
        _scheduler.RunGroup.arrive,
        _scheduler.RunGroup._execute,
        _scheduler.RunGroup._collective,
        _scheduler.RunGroup._merge,
        _scheduler.RunGroup._merged,
        _scheduler.RunGroup._for_each_replica,
        _scheduler._replica,
        _scheduler._first_then_rest,
        _rendezvous.Rendezvous.arrive,
        _rendezvous.Rendezvous._complete,
        _rendezvous.Rendezvous._deliver,
        _rendezvous.Rendezvous.replica_exited,
        _replica_context.ReplicaContext.all_reduce,
        _replica_context.ReplicaContext.merge_call,
        _replica_context._merge_signature,
        _values.regroup,
        _values._regroup_flat,
    ]
    with_cells = {
        f.__qualname__: f.__code__.co_cellvars for f in per_step if f.__code__.co_cellvars
    }
    assert with_cells == {}


async def test_cancelled_stepped_coroutines_leave_no_cyclic_garbage(two):
    """A cancellation thrown into a coroutine that aiodist steps by hand (_streams:
    every replica on a GPU, an async merge_fn that suspended on Python 3.11) and let
    through must not stay in the stepping frame, which its own traceback holds."""
    from aiodist._streams import drive

    async def slow_merge_fn(strategy):
        await asyncio.sleep(3600)

    async def merge_fn_suspended():
        return await aiodist.get_replica_context().merge_call(slow_merge_fn)

    async def cancelled_in_merge_fn():
        task = asyncio.ensure_future(two.run(merge_fn_suspended))
        await wait_until(lambda: two.statistics().rendezvous_in_flight, "merge_fn running")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def cancelled_in_drive():  # with toy hooks, as a replica on a GPU
        task = asyncio.ensure_future(drive(asyncio.sleep(3600), lambda: None, lambda _: None))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for case in (cancelled_in_merge_fn, cancelled_in_drive):
        await assert_no_cyclic_garbage(case)


async def test_async_merge_fn_failing_under_a_timeout_leaves_no_cyclic_garbage():
    """With CommunicationOptions.timeout_seconds, an async merge_fn runs inside an
    asyncio.timeout scope, which holds the merge_fn's task: neither the scope nor its
    TimeoutError may stay reachable from the error the task ends with."""
    timed = aiodist.MirroredStrategy(
        ["cpu:0", "cpu:1"],
        communication_options=aiodist.CommunicationOptions(timeout_seconds=0.001),
    )

    async def too_slow(strategy):
        await asyncio.sleep(3600)

    async def raises(strategy):
        await asyncio.sleep(0)
        raise KeyError("from an async merge_fn")

    async def merge_fn_times_out():
        return await aiodist.get_replica_context().merge_call(too_slow)

    async def merge_fn_raises():
        return await aiodist.get_replica_context().merge_call(raises)

    for fn in (merge_fn_times_out, merge_fn_raises):
        await assert_no_cyclic_garbage(
            partial(timed.run, fn),
            warm_up=3,
            repeats=10,
            errors=(KeyError, aiodist.RendezvousTimeoutError),
        )


async def test_passes_stopped_early_leave_no_cyclic_garbage(two):
    """A pass over a distributed dataset ended early (a `break`, an iterator dropped,
    aclose()) cancels its producer task; the pipeline must not keep that task, whose
    CancelledError's traceback holds the pipeline."""
    batches = [np.full((4, 2), float(i)) for i in range(10)]

    def producers() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if "_Pipeline._produce" in repr(t.get_coro())]

    async def broken_out_of():
        async for _ in two.experimental_distribute_dataset(batches):
            break

    async def dropped():
        iterator = aiter(two.experimental_distribute_dataset(batches))
        await anext(iterator)
        del iterator

    async def closed():
        iterator = aiter(two.experimental_distribute_dataset(batches))
        await anext(iterator)
        await iterator.aclose()

    async def from_function():
        dataset = two.distribute_datasets_from_function(lambda context: batches)
        async for _ in dataset:
            break

    async def producers_ended():
        await wait_until(lambda: not producers(), "the producers ended")

    for case in (broken_out_of, dropped, closed, from_function):
        await assert_no_cyclic_garbage(case, settled=producers_ended)
