"""``await strategy.run``: replicas, unwrapping, regrouping, failures, cancellation (SPEC §3)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import gc
import json
import sys

import numpy as np
import pytest

import aiodist
from tests.conftest import cpu_devices, task_factory, wait_until

Pair = collections.namedtuple("Pair", "a b")


async def _reduce_in_merge_fn(strategy, value):
    return await strategy.reduce("sum", value, axis=None)


async def _merge_replica_ids():
    """A replica function: an async merge_fn's sum of the replica ids."""
    ctx = aiodist.get_replica_context()
    return await ctx.merge_call(_reduce_in_merge_fn, (np.float64(ctx.replica_id_in_sync_group),))


async def _wait_until_cancelled(cancelled: list, rid: int) -> None:
    """Wait forever; once cancelled, note ``rid`` in ``cancelled`` and re-raise."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(rid)
        raise


def _own_tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t.get_name().startswith("aiodist-replica")}


async def test_async_fn_runs_once_per_replica_with_its_context(strategy, num_replicas):
    seen = []

    async def fn():
        ctx = aiodist.get_replica_context()
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.devices))
        await asyncio.sleep(0)
        return ctx.replica_id_in_sync_group

    result = await strategy.run(fn)
    assert sorted(seen) == [(i, num_replicas, (f"/device:CPU:{i}",)) for i in range(num_replicas)]
    assert strategy.experimental_local_results(result) == tuple(range(num_replicas))
    if num_replicas == 1:
        assert result == 0
    else:
        assert isinstance(result, aiodist.PerReplica)


async def test_plain_function_and_awaitable_result(strategy, num_replicas):
    def plain(x):
        return x + aiodist.get_replica_context().replica_id_in_sync_group

    result = await strategy.run(plain, args=(10,))
    assert strategy.experimental_local_results(result) == tuple(10 + i for i in range(num_replicas))

    async def inner():
        return "done"

    def returns_awaitable():
        return inner()

    assert await strategy.run(returns_awaitable) == "done"


async def test_distributed_args_are_unwrapped_in_nested_structures(strategy, num_replicas):
    per = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, ctx.replica_id_in_sync_group)
    )
    shared = object()

    async def fn(nested, *, table, pair, same):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        assert same is shared
        assert pair.b == "b"
        np.testing.assert_array_equal(nested[0][1], [rid, rid])
        np.testing.assert_array_equal(table["x"], [rid, rid])
        np.testing.assert_array_equal(pair.a, [rid, rid])
        return rid

    kwargs = {"table": {"x": per}, "pair": Pair(per, "b"), "same": shared}
    result = await strategy.run(fn, args=([(1, per)],), kwargs=kwargs)
    assert strategy.experimental_local_results(result) == tuple(range(num_replicas))


async def test_a_list_of_distributed_values_reaches_each_replica_as_its_own_list(
    strategy, num_replicas
):
    # What experimental_distribute_values_from_function gives for a list (a list of
    # PerReplica, as TF's), in every form run splits for all replicas at once, and
    # the forms it leaves to the per-replica pick (a plain leaf or a subclass in the
    # list, a list in a dict).
    per = strategy.experimental_distribute_values_from_function(
        lambda ctx: [np.full(2, ctx.replica_id_in_sync_group), ctx.replica_id_in_sync_group]
    )
    if num_replicas > 1:
        assert type(per) is list and all(type(v) is aiodist.PerReplica for v in per)
    mixed = [*per, "plain"] if num_replicas > 1 else per
    seen = []

    async def fn(values, mixed, nested, *, table):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        np.testing.assert_array_equal(values[0], [rid, rid])
        assert values[1] == rid and type(values) is list
        assert mixed[1] == rid and (num_replicas == 1 or mixed[2] == "plain")
        assert nested[0][1] == rid and table["v"][1] == rid
        values.append("mine")  # each replica's list is its own
        seen.append(values)

    await strategy.run(fn, args=(per, mixed, [per]), kwargs={"table": {"v": per}})
    assert [len(values) for values in seen] == [3] * num_replicas
    assert len({id(values) for values in seen}) == num_replicas
    assert len(per) == 2  # the caller's list unchanged


async def test_a_replica_raising_generator_exit_fails_its_run_with_it(two):
    # GeneratorExit raised by replica code is a failure like any other: the run
    # raises that object, and the replica waiting in the all-reduce is cancelled.
    # (A check meant for coroutines closed after their loop closed once took every
    # GeneratorExit for that, and the run waited for ever.)
    mine = GeneratorExit("raised by the replica")

    async def fn():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            await asyncio.sleep(0)
            raise mine
        return await ctx.all_reduce("sum", 1.0)

    async with asyncio.timeout(10):
        with pytest.raises(GeneratorExit) as caught:
            await two.run(fn)
    assert caught.value is mine
    assert two.statistics().runs_in_flight == 0
    assert (await two.run(lambda: 1.0)) == 1.0


async def test_a_list_of_distributed_values_of_another_replica_count_is_refused(two):
    async def fn(values):
        return values

    wrong = [aiodist.PerReplica([1, 2, 3]), aiodist.PerReplica([4, 5, 6])]
    with pytest.raises(ValueError, match=r"with 3 values was used where this process runs 2"):
        await two.run(fn, args=(wrong,))
    uneven = [aiodist.PerReplica([1, 2]), aiodist.PerReplica([4, 5, 6])]
    with pytest.raises(ValueError, match=r"with 3 values was used where this process runs 2"):
        await two.run(fn, args=(uneven,))


@pytest.mark.parametrize("kind", ["async def", "plain def"])
async def test_plain_keyword_arguments_reach_every_replica_in_a_dict_of_its_own(two, kind):
    # Arguments with no distributed value go to every replica as they are; each
    # call still gets a dict of its own, so a replica changing it changes no other's.
    def body(first, *, scale, **extra):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        extra[f"seen by {rid}"] = True
        return first * scale + rid, sorted(extra)

    async def coroutine(first, *, scale, **extra):
        return body(first, scale=scale, **extra)

    fn = coroutine if kind == "async def" else body
    kwargs = {"scale": 10, "other": None}
    result = await two.run(fn, args=(2,), kwargs=kwargs)
    assert two.experimental_local_results(result[0]) == (20, 21)
    assert two.experimental_local_results(result[1]) == (
        ["other", "seen by 0"],
        ["other", "seen by 1"],
    )
    assert kwargs == {"scale": 10, "other": None}
    assert two.experimental_local_results(await two.run(fn, args=(1,), kwargs={"scale": 3})) == (
        (3, ["seen by 0"]),
        (4, ["seen by 1"]),
    )


async def test_results_regroup_identical_objects_stay_single(two):
    shared = np.zeros(3)

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return {"same": shared, "mine": np.full(1, rid), "pair": Pair(None, [rid, shared])}

    result = await two.run(fn)
    assert result["same"] is shared
    assert result["pair"].a is None
    assert isinstance(result["pair"], Pair)
    assert result["pair"].b[1] is shared
    assert isinstance(result["mine"], aiodist.PerReplica)
    assert two.experimental_local_results(result["pair"].b[0]) == (0, 1)
    assert result["mine"].devices == ("/device:CPU:0", "/device:CPU:1")


async def test_dict_results_regroup_by_key_whatever_the_insertion_order(two):
    """Keys that cannot be sorted together (an int and a str) are visited in insertion
    order, which may differ from replica to replica: values still go by key."""

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return (
            {1: f"one@{rid}", "x": f"x@{rid}"} if rid == 0 else {"x": f"x@{rid}", 1: f"one@{rid}"}
        )

    result = await two.run(fn)
    assert list(result) == [1, "x"]  # the first replica's order
    assert two.experimental_local_results(result[1]) == ("one@0", "one@1")
    assert two.experimental_local_results(result["x"]) == ("x@0", "x@1")


async def test_mismatched_result_structures_raise_naming_replicas(two):
    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return [1, 2] if rid == 0 else (1, 2, 3)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"replica 0: list of 2; replica 1"):
        await two.run(fn)


async def test_mismatched_result_dicts_name_each_replicas_keys(two):
    # The keys as a list of their reprs read: dict with keys ["'acc'", "'loss'"].
    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return {"loss": 1.0, "acc": 2.0} if rid == 0 else {}

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"\(replica 0: dict with keys 'acc', 'loss'; replica 1: dict with no keys\)",
    ):
        await two.run(fn)


async def test_namedtuple_classes_made_per_replica_regroup_as_in_tf(two):
    """A namedtuple class made inside the replica function is one class per replica:
    regrouping its results (or merge_call args) refused them as different structures
    whose descriptions read alike ("Out of 2"; "Out of 2"). As TF's nest does,
    namedtuples of one name and fields nest alike; other fields still raise, and say
    which."""

    async def fn():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        Out = collections.namedtuple("Out", "loss acc")
        merged = await ctx.merge_call(
            lambda strategy, out: two.experimental_local_results(out.loss), args=(Out(rid, 1),)
        )
        return Out(np.full(1, rid), merged)

    result = await two.run(fn)
    assert type(result).__name__ == "Out" and result._fields == ("loss", "acc")
    assert [int(v[0]) for v in two.experimental_local_results(result.loss)] == [0, 1]
    assert two.experimental_local_results(result.acc) == ((0, 1), (0, 1))

    async def other_fields():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return collections.namedtuple("Out", "loss acc" if rid == 0 else "loss top1")(1, 2)

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"replica 0: Out\(loss, acc\); replica 1: Out\(loss, top1\)",
    ):
        await two.run(other_fields)


async def test_a_leaf_against_a_container_raises_naming_replicas(two):
    # A leaf on one replica where another has a list, in a result and in merge_call
    # args: the structure error, not a TypeError from comparing the leaf's length.
    async def result():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return [1 if rid == 0 else [1]]

    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"at \[0\] \(replica 0: a leaf \(int\); replica 1: list"
    ):
        await two.run(result)

    async def args():
        ctx = aiodist.get_replica_context()
        leaf = 1 if ctx.replica_id_in_sync_group == 0 else [1]
        return await ctx.merge_call(lambda strategy, value: value, args=(leaf,))

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"passed to merge_call different structures at args\[0\]",
    ):
        await two.run(args)


async def test_args_must_be_list_or_tuple(two):
    async def fn(x):
        return x

    with pytest.raises(ValueError, match=r"args must be a list or tuple, got int"):
        await two.run(fn, args=5)


async def test_run_options_other_than_none_are_refused_saying_where_options_go(two):
    """run(options=...) took anything and ignored it: options=5 ran, and
    CommunicationOptions(timeout_seconds=0.05) bounded nothing (a replica 0.5 s late
    was waited for). TF's RunOptions holds TPU-only fields: only None is taken."""
    late = []

    async def step():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            late.append(1)
            await asyncio.sleep(0.5)
        return await ctx.all_reduce("sum", 1.0)

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"run: options=5 is not accepted: in TF it is a tf\.distribute\.RunOptions",
    ):
        await two.run(step, options=5)
    quick = aiodist.CommunicationOptions(timeout_seconds=0.05)
    with pytest.raises(aiodist.InvalidArgumentError) as caught:
        await two.run(step, options=quick)
    message = str(caught.value)
    assert "does not apply CommunicationOptions to the collectives" in message
    assert "ctx.all_reduce(..., options=...)" in message
    assert "communication_options=" in message
    assert late == []  # refused before any replica started
    assert await two.extended.call_for_each_replica(lambda: 3) == 3  # usable after
    result = await two.run(step, options=None)
    assert two.experimental_local_results(result) == (2.0, 2.0)


async def test_an_async_generator_function_is_refused_naming_it(two):
    """An async def with a yield in it gave each replica's unstarted async generator
    back as its "result"; it is refused, saying what to pass instead. So is a partial
    of one (it was taken as a plain function, and its async generators returned)."""

    async def step(scale=1.0):
        yield scale

    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"fn=<function .*step.* is an async gen"
    ):
        await two.run(step)
    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"fn=functools.partial\(<function .*step.* is an async"
    ):
        await two.run(functools.partial(step, 2.0))
    assert await two.run(lambda: 1.0) == 1.0  # the strategy is usable after


class _Streamer:
    """A callable object whose __call__ is an async generator function."""

    async def __call__(self, scale=1.0):
        yield scale

    def __repr__(self) -> str:
        return "<Streamer>"


async def test_an_object_whose_call_is_an_async_generator_function_is_refused(two):
    """As an async generator function is (above): the object, or a partial of it, gave
    each replica's unstarted async generator back as its "result"."""
    for fn, shown in [
        (_Streamer(), "fn=<Streamer> is an async generator"),
        (functools.partial(_Streamer(), 2.0), r"fn=functools.partial\(<Streamer>, 2.0\) is an"),
    ]:
        with pytest.raises(aiodist.InvalidArgumentError, match=shown):
            await two.run(fn)
    assert await two.run(lambda: 1.0) == 1.0  # the strategy is usable after


async def test_merge_call_refuses_an_async_generator_function_as_merge_fn(two):
    """Every replica received the merge_fn's unstarted async generator as the merged
    value. It is refused as run refuses one, in a run and outside any strategy."""

    async def merge_fn(strategy, value):
        yield value

    shown = r"merge_call: merge_fn=<function .*merge_fn.* is an async generator function"
    for fn in (merge_fn, functools.partial(merge_fn), _Streamer()):

        async def step(fn=fn):
            return await aiodist.get_replica_context().merge_call(fn, args=(1,))

        with pytest.raises(aiodist.InvalidArgumentError, match=r"is an async generator function"):
            await two.run(step)
    with pytest.raises(aiodist.InvalidArgumentError, match=shown):
        await aiodist.get_replica_context().merge_call(merge_fn, args=(1,))  # the default
    assert await two.run(lambda: 1.0) == 1.0  # the strategy is usable after


async def test_per_replica_of_wrong_length_is_rejected(two, three):
    per3 = three.experimental_distribute_values_from_function(lambda ctx: 1)

    async def fn(x):
        return x

    with pytest.raises(aiodist.InvalidArgumentError, match=r"3 values .* runs 2 replica"):
        await two.run(fn, args=(per3,))


async def test_nested_run_raises(two):
    async def inner():
        return 1

    async def outer():
        await two.run(inner)

    with pytest.raises(
        aiodist.ContextError, match=r"^strategy\.run\(\) was called .*runs cannot nest"
    ):
        await two.run(outer)

    # call_for_each_replica is named as called (its message named strategy.run()).
    async def outer_for_each():
        await two.extended.call_for_each_replica(inner)

    with pytest.raises(
        aiodist.ContextError,
        match=r"^strategy\.extended\.call_for_each_replica\(\) was called inside a replica "
        r"function \(replica \d\); runs cannot nest",
    ):
        await two.run(outer_for_each)


async def test_replica_exception_propagates_same_object_and_cancels_others(three):
    boom = KeyError("boom")
    cancelled = []
    started = []

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        started.append(rid)
        if rid == 1:
            await wait_until(lambda: len(started) == 3, "all replicas started")
            raise boom
        await _wait_until_cancelled(cancelled, rid)

    with pytest.raises(KeyError) as info:
        await three.run(fn)
    assert info.value is boom
    assert sorted(cancelled) == [0, 2]
    assert not _own_tasks()


async def test_replica_exception_while_others_wait_in_collective(three):
    boom = ValueError("replica 2 failed")

    async def fn():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 2:
            raise boom
        return await ctx.all_reduce("sum", 1.0)

    with pytest.raises(ValueError) as info:
        await three.run(fn)
    assert info.value is boom
    assert not _own_tasks()
    # The strategy is fully usable afterwards.
    result = await three.run(lambda: aiodist.get_replica_context().all_reduce("sum", 2.0))
    assert [float(v) for v in three.experimental_local_results(result)] == [6.0] * 3


async def test_the_error_a_run_raises_notes_the_replica_that_raised_it(three):
    """A failing assertion in one replica of three raised with nothing to say which
    replica's frames its traceback shows. The run's error now carries a note naming
    the replica and its device, added once however often one object is raised; a
    failed collective's error, which every waiting replica raised alike and whose
    message names the replicas, and the run of one replica, get none."""
    boom = AssertionError("weights diverged")

    async def fn():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 2:
            raise boom
        return await ctx.all_reduce("sum", 1.0)

    for _ in range(2):  # the same object from two runs: one note
        with pytest.raises(AssertionError) as info:
            await three.run(fn)
        assert info.value is boom
        assert boom.__notes__ == ["(raised in replica 2 of 3, on /device:CPU:2, by strategy.run)"]

    merge_error = KeyError("merge_fn's")

    def merge_fn(strategy):
        raise merge_error

    async def merges():
        await aiodist.get_replica_context().merge_call(merge_fn)

    with pytest.raises(KeyError) as info:
        await three.run(merges)
    assert info.value is merge_error
    assert not hasattr(merge_error, "__notes__")

    alone = ValueError("alone")

    async def one_replica_fails():
        raise alone

    with pytest.raises(ValueError):
        await aiodist.MirroredStrategy(["cpu:0"]).run(one_replica_fails)
    assert not hasattr(alone, "__notes__")


async def test_a_custom_task_factory_makes_the_replica_tasks_in_their_own_state(two):
    seen = []

    def factory(loop, coro, *, context=None, **kwargs):
        # What the factory can read in the context it was given, before any step.
        ctx = (context or contextvars.copy_context()).run(aiodist.get_replica_context)
        seen.append(None if ctx is None else ctx.replica_id_in_sync_group)
        return asyncio.Task(coro, loop=loop, context=context, **kwargs)

    with task_factory(factory):
        result = await two.run(_merge_replica_ids)
    assert float(result) == 1.0  # the merge_fn's one result, on both replicas
    assert seen == [0, 1, None]  # the replicas, then the merge_fn (cross-replica)


async def _instrumented(coro):
    return await coro


async def test_replica_tasks_start_eagerly_on_python_312(two):
    """Python 3.12+ (no task factory): each replica's first step runs inside run(),
    with its own task current, so replicas that never suspend finish before run()
    first waits: driven by hand, the run ends at its first step. On 3.11 it waits
    once, for its replicas' tasks."""
    caller = asyncio.current_task()
    seen = {}

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        seen[rid] = asyncio.current_task()
        return rid

    run = two.run(fn)
    waits = 0
    while True:
        try:
            waited = run.send(None)
        except StopIteration as stop:
            result = stop.value
            break
        waits += 1
        await asyncio.wait([waited])
    assert two.experimental_local_results(result) == (0, 1)
    assert waits == (0 if sys.version_info >= (3, 12) else 1)
    assert len({seen[0], seen[1], caller}) == 3  # each replica its own task


@pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="replica tasks start eagerly on Python 3.12+ only; on 3.11 a SystemExit in a "
    "replica's step stops the event loop itself, as asyncio does for any task",
)
@pytest.mark.parametrize("where", ["replica", "merge_fn"])
async def test_a_system_exit_in_a_replicas_first_step_leaves_no_replica_running(three, where):
    """Python 3.12+: a replica's first step runs as its task is made, inside run(), so
    a SystemExit (or KeyboardInterrupt) raised there, by the replica or by a merge_fn
    its arrival completes, comes out of run() itself (asyncio lets these two through
    at once). run() still cancels and waits for the replicas already started, as for
    any failure, and raises the same object."""
    cancelled = []
    stop = SystemExit(3)

    def merge_fn(strategy):
        raise stop

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        if where == "merge_fn":
            return await aiodist.get_replica_context().merge_call(merge_fn)
        if rid == 1:
            raise stop  # in its first step; replica 2's task is never made
        await _wait_until_cancelled(cancelled, rid)

    with pytest.raises(SystemExit) as info:
        await three.run(fn)
    assert info.value is stop
    assert cancelled == ([0] if where == "replica" else [])
    assert not _own_tasks()
    assert three.statistics().runs_in_flight == 0


@pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="replica tasks start eagerly on Python 3.12+ only (on 3.11 a SystemExit in a "
    "replica's step stops the event loop itself, as asyncio does for any task)",
)
@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
async def test_a_system_exit_that_run_raises_is_not_logged_as_never_retrieved(
    three, caplog, exc_type
):
    """The replica whose first step raised it never joins the run's list of tasks
    (its creation raised), whose failures the run marks retrieved: asyncio then
    logged "Task exception was never retrieved" for the exception run had raised."""
    stop = exc_type()

    async def fn():
        if aiodist.get_replica_context().replica_id_in_sync_group == 1:
            raise stop
        await asyncio.Event().wait()

    with pytest.raises(exc_type) as info:
        await three.run(fn)
    assert info.value is stop
    del info
    await asyncio.sleep(0)  # (the task's done callbacks)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# How a task factory makes the tasks it does make: as asyncio does; around a wrapper
# of its own (instrumentation); eagerly (Python 3.12+: the first step runs at once).
_FACTORY_KINDS = {
    "task": lambda loop, coro, **kwargs: asyncio.Task(coro, loop=loop, **kwargs),
    "wrapping": lambda loop, coro, **kwargs: asyncio.Task(_instrumented(coro), loop=loop, **kwargs),
    # (uvloop on Python 3.13 passes eager_start=None, which this factory does not take)
    "eager": hasattr(asyncio, "eager_task_factory")
    and (
        lambda loop, coro, eager_start=None, **kwargs: asyncio.eager_task_factory(
            loop, coro, **kwargs
        )
    ),
}


@pytest.mark.parametrize("kind", list(_FACTORY_KINDS))
@pytest.mark.parametrize("tracing", [False, True], ids=["plain", "traced"])
async def test_a_task_factory_that_raises_leaves_no_replica_behind(tmp_path, caplog, tracing, kind):
    # The factory fails for the third replica: run raises its error, the replica
    # tasks already made end (eager ones after their first step, cancelled in their
    # all-reduce), nothing warns of a coroutine never awaited or reports an error to
    # the loop, no stall report follows, and the strategy (and a trace's lane 0)
    # serves the next run as before.
    if not _FACTORY_KINDS[kind]:
        pytest.skip("eager task factories need Python 3.12")
    options = aiodist.CommunicationOptions(stall_warning_seconds=0.05)
    strategy = aiodist.MirroredStrategy(cpu_devices(4), communication_options=options)
    loop = asyncio.get_running_loop()
    reported, made, started = [], [], []
    loop.set_exception_handler(lambda loop, context: reported.append(context))

    def factory(loop, coro, **kwargs):
        if len(made) == 2:
            raise RuntimeError("no more tasks")
        made.append(_FACTORY_KINDS[kind](loop, coro, **kwargs))
        return made[-1]

    async def fn():
        started.append(aiodist.get_replica_context().replica_id_in_sync_group)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    with aiodist.trace(tmp_path / "t.json") if tracing else contextlib.nullcontext():
        with task_factory(factory), pytest.raises(RuntimeError, match="no more tasks"):
            await strategy.run(fn)
        assert all(task.done() for task in made)
        assert started == ([0, 1] if kind == "eager" else [])
        assert strategy.statistics().runs_in_flight == 0
        assert strategy.statistics().rendezvous_in_flight == ()
        await asyncio.sleep(0.15)  # stall reports would be due
        result = await strategy.run(fn)
    assert [float(v) for v in strategy.experimental_local_results(result)] == [4.0] * 4
    assert reported == []
    assert not [r for r in caplog.records if "has waited" in r.getMessage()]
    if tracing:
        events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
        tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert not any("lane" in track for track in tracks), tracks


async def test_runs_under_an_eager_task_factory(three):
    # Python 3.12+: with asyncio's eager task factory a replica's (or a merge_fn's)
    # first step runs inside create_task, so a replica may arrive, or a merge_fn end,
    # before the run has made the next task. (A merge_fn that ended there used to
    # raise AttributeError, and the failure that followed crashed Python 3.12.1.)
    if not _FACTORY_KINDS["eager"]:
        pytest.skip("eager task factories need Python 3.12")

    async def step(kind):
        ctx = aiodist.get_replica_context()
        r = ctx.replica_id_in_sync_group
        if kind == "merge":
            return await _merge_replica_ids()
        if kind == "raise" and r == 0:
            raise KeyError("replica 0")
        if kind == "skip" and r == 2:
            return None
        if kind == "sleep":
            await asyncio.sleep(0.001)
        return await ctx.all_reduce("sum", np.float32(r + 1))

    with task_factory(_FACTORY_KINDS["eager"]):
        assert float(await three.run(step, ("merge",))) == 3.0
        assert [
            float(v) for v in three.experimental_local_results(await three.run(step, ("sum",)))
        ] == [6.0] * 3
        with pytest.raises(KeyError, match="replica 0"):
            await three.run(step, ("raise",))
        with pytest.raises(aiodist.ReplicaExitedError, match="replica 2 returned without"):
            await three.run(step, ("skip",))
        results = await asyncio.gather(*(three.run(step, ("sleep",)) for _ in range(8)))
        assert {float(v) for r in results for v in three.experimental_local_results(r)} == {6.0}
    assert three.statistics().runs_in_flight == 0 and not _own_tasks()


class _EagerTask311(asyncio.Task):
    """Python 3.11's stand-in for 3.12's ``Task(..., eager_start=True)``, on asyncio's
    own loop: the first step runs inside the constructor, with the task current, and
    a KeyboardInterrupt or SystemExit raised there comes out of it (the task holding
    it too). (3.11's Task schedules its first step with loop.call_soon, which is
    caught here and run at once instead.)"""

    def __init__(self, coro, *, loop, **kwargs):
        first = []
        loop.call_soon = lambda step, *args, context: first.append((step, args, context))
        try:
            super().__init__(coro, loop=loop, **kwargs)
        finally:
            del loop.call_soon
        [(step, args, context)] = first
        current = asyncio.tasks._current_tasks  # (what 3.12 swaps for an eager step)
        outer = current.pop(loop, None)
        try:
            context.run(step, *args)
        finally:
            if outer is not None:
                current[loop] = outer


def _eager_task_factory():
    """asyncio's eager task factory (Python 3.12+), else a 3.11 stand-in for it
    (asyncio's loop only: uvloop's call_soon cannot be caught)."""
    if _FACTORY_KINDS["eager"]:
        return _FACTORY_KINDS["eager"]
    if not isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop):
        pytest.skip("an eager task factory on Python 3.11 is emulated on asyncio's loop only")
    return lambda loop, coro, **kwargs: _EagerTask311(coro, loop=loop, **kwargs)


@pytest.mark.parametrize("factory", ["eager-factory", "no-factory"])
@pytest.mark.parametrize("where", ["run", "run-with-timeout", "default-context"])
@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
async def test_an_async_merge_fns_system_exit_in_its_eager_first_step_is_not_logged(
    caplog, exc_type, where, factory
):
    """An async merge_fn's task starts eagerly (with an eager task factory; without
    one, natively on Python 3.12+, by aiodist's own first step on 3.11). A
    SystemExit or KeyboardInterrupt raised in that first step comes out of the
    task's creation, and out of the merge_call (and the run) at once, which raise
    the same object. The task holds it too, and nothing read it: asyncio logged
    "Task exception was never retrieved" for it (Python 3.12+, or a factory)."""
    # (merge_fn's task runs under asyncio.timeout() with timeout_seconds)
    options = aiodist.CommunicationOptions(timeout_seconds=60 if "timeout" in where else None)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    raised = []

    async def merge_fn(strategy):
        raised.append(exc_type(3))
        raise raised[0]

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    if factory == "no-factory" and where != "default-context" and sys.version_info < (3, 12):
        pytest.skip(
            "replica tasks start eagerly on Python 3.12+ only (on 3.11 a SystemExit in a "
            "replica's step stops the event loop itself, as asyncio does for any task)"
        )
    made_by = _eager_task_factory() if factory == "eager-factory" else None
    with task_factory(made_by), pytest.raises(exc_type) as info:
        if where.startswith("run"):
            await strategy.run(fn)
        else:
            await fn()
    assert info.value is raised.pop()
    del info  # (the error's traceback holds the frames that hold the tasks)
    await asyncio.sleep(0)  # (the tasks' done callbacks)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert strategy.statistics().runs_in_flight == 0 and not _own_tasks()


async def test_a_task_factory_that_raises_for_a_merge_fn_fails_its_merge_call(two):
    def factory(loop, coro, *, context=None, **kwargs):
        if context.run(aiodist.in_cross_replica_context):  # the merge_fn's task
            raise RuntimeError("no task for merge_fn")
        return asyncio.Task(coro, loop=loop, context=context, **kwargs)

    with task_factory(factory), pytest.raises(RuntimeError, match="no task for merge_fn"):
        await two.run(_merge_replica_ids)
    assert float(await two.run(_merge_replica_ids)) == 1.0


async def test_cancelling_the_caller_cancels_every_replica(three):
    waiting = []
    cancelled = []

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        waiting.append(rid)
        await _wait_until_cancelled(cancelled, rid)

    caller = asyncio.create_task(three.run(fn))
    await wait_until(lambda: len(waiting) == 3, "three replicas waiting")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert sorted(cancelled) == [0, 1, 2]
    assert not _own_tasks()


async def test_cancelling_the_caller_during_a_rendezvous(three):
    arrived = []

    async def fn():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            await asyncio.Event().wait()  # never joins
        arrived.append(ctx.replica_id_in_sync_group)
        return await ctx.all_reduce("sum", 1.0)

    caller = asyncio.create_task(three.run(fn))
    await wait_until(lambda: len(arrived) == 2, "replicas 1 and 2 in all_reduce")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not _own_tasks()


async def test_timeout_around_run_leaves_nothing_running(two):
    async def fn():
        await asyncio.Event().wait()

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await two.run(fn)
    assert not _own_tasks()


@pytest.mark.parametrize("how", ["cancel", "asyncio.timeout"])
async def test_a_replica_error_raised_as_the_run_is_cancelled_is_reported_not_lost(two, how):
    """A cancelled run raises CancelledError (TimeoutError under asyncio.timeout), as
    documented, not the error a replica raised meanwhile (here its cleanup fails as
    it is cancelled). That error was dropped without a trace; it is reported to the
    loop's exception handler, naming the replica, as asyncio reports an error nobody
    can receive."""
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    waiting = []
    failures = []

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        waiting.append(rid)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if rid == 1:
                failures.append(OSError("could not close the replica's file"))
                raise failures[0] from None
            raise

    if how == "cancel":
        caller = asyncio.create_task(two.run(fn))
        await wait_until(lambda: len(waiting) == 2, "both replicas waiting")
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    else:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await two.run(fn)
    assert [context.get("exception") for context in reported] == failures
    message = reported[0]["message"]
    assert "strategy.run() was cancelled" in message
    assert "replica 1 raised OSError" in message, message
    assert not _own_tasks()
    # A run cancelled with no replica failing reports nothing.
    reported.clear()
    caller = asyncio.create_task(two.run(_wait_until_cancelled, args=([], 0)))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    loop.set_exception_handler(None)
    assert reported == []


@pytest.mark.parametrize("merge_timeout", [None, 60])
async def test_a_merge_fn_error_raised_as_the_run_is_cancelled_is_reported_not_lost(
    merge_timeout,
):
    """As a replica's (above): an async merge_fn whose cleanup fails as the cancelled
    run cancels it raised an error nothing received (every replica had stopped
    waiting for the call); it is reported to the loop's exception handler, naming the
    merge_call. (With and without timeout_seconds: merge_fn's task differs.)"""
    options = aiodist.CommunicationOptions(timeout_seconds=merge_timeout)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), communication_options=options)
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    started = []
    failures = []

    async def merge_fn(strategy, value):
        started.append(value)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            failures.append(ValueError("could not release the merge_fn's buffer"))
            raise failures[0] from None

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn, args=(1,))

    caller = asyncio.create_task(strategy.run(fn))
    await wait_until(lambda: started, "merge_fn started")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    loop.set_exception_handler(None)
    assert [context.get("exception") for context in reported] == failures
    message = reported[0]["message"]
    assert "strategy.run() was cancelled" in message
    assert "the merge_fn of merge_call #0 raised ValueError" in message, message
    assert "in the merge_fn's cleanup" in message, message
    assert not _own_tasks()


async def test_concurrent_runs_on_one_strategy_never_mix(num_replicas):
    strategy = aiodist.MirroredStrategy(cpu_devices(num_replicas))

    async def fn(scale):
        ctx = aiodist.get_replica_context()
        total = 0.0
        for step in range(5):
            await asyncio.sleep(0)
            total += float(await ctx.all_reduce("sum", scale * (step + 1)))
        return total

    scales = list(range(1, 21))
    results = await asyncio.gather(*(strategy.run(fn, args=(s,)) for s in scales))
    for scale, result in zip(scales, results, strict=True):
        expected = num_replicas * scale * 15
        assert [float(v) for v in strategy.experimental_local_results(result)] == [
            expected
        ] * num_replicas


async def test_run_inside_merge_fn_is_its_own_group(two):
    async def inner():
        return aiodist.get_replica_context().replica_id_in_sync_group

    async def merge_fn(strategy):
        assert aiodist.in_cross_replica_context()
        return strategy.experimental_local_results(await strategy.run(inner))

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    assert await two.run(fn) == (0, 1)


async def test_call_for_each_replica_is_run(two):
    async def fn(x):
        return x * (aiodist.get_replica_context().replica_id_in_sync_group + 1)

    result = await two.extended.call_for_each_replica(fn, args=(3,))
    assert two.experimental_local_results(result) == (3, 6)


async def test_one_device_strategy_returns_plain_value():
    strategy = aiodist.OneDeviceStrategy("cpu:3")

    async def fn():
        ctx = aiodist.get_replica_context()
        return ctx.devices, await ctx.all_reduce("mean", np.array([1.0, 3.0]))

    devices, value = await strategy.run(fn)
    assert devices == ("/device:CPU:3",)
    np.testing.assert_array_equal(value, [1.0, 3.0])


async def test_a_coroutine_object_passed_for_a_function_is_named_and_closed(two):
    # fn() passed where fn was meant: "is not callable" said what, not why, and the
    # coroutine was left for Python to warn about as never awaited.
    async def fn():
        return 1

    async def merge_fn(strategy):
        return 1

    async def dataset_fn(ctx):
        return [1]

    made = []

    def coroutine(function, *args):
        made.append(function(*args))
        return made[-1]

    async def in_replica():
        await aiodist.get_replica_context().merge_call(coroutine(merge_fn, two))

    hint = r"is not callable.*a coroutine object.*pass the function itself \(fn\), not a call"
    with pytest.raises(aiodist.InvalidArgumentError, match=hint):
        await two.run(coroutine(fn))
    with pytest.raises(aiodist.InvalidArgumentError, match=hint):
        await two.run(in_replica)
    with pytest.raises(aiodist.InvalidArgumentError, match=hint):
        two.distribute_datasets_from_function(coroutine(dataset_fn, None))
    with two.scope():
        v = aiodist.Variable(0.0)
        with pytest.raises(aiodist.InvalidArgumentError, match=hint):
            await two.extended.update(v, coroutine(fn))
    from aiodist.serving import Batcher

    with pytest.raises(aiodist.InvalidArgumentError, match=hint):
        Batcher(two, coroutine(fn))
    # Closed (one per replica for merge_call), so none is left to be reported as
    # never awaited.
    assert len(made) == 6
    assert [c.cr_frame for c in made] == [None] * 6


async def test_kwargs_keys_that_are_no_strings_are_refused_naming_the_call(two):
    # Python's bare "TypeError: keywords must be strings" was raised, in every replica
    # for a merge_call.
    async def merge_fn(strategy, **kwargs):
        return 1

    async def step(**kwargs):
        return await aiodist.get_replica_context().merge_call(merge_fn, kwargs={1: 2})

    with pytest.raises(aiodist.InvalidArgumentError, match=r"^run: kwargs has the key 1, which"):
        await two.run(step, kwargs={1: 2})
    with pytest.raises(aiodist.InvalidArgumentError, match=r"^merge_call: kwargs has the key 1"):
        await two.run(step)
