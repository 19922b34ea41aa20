"""Replica / cross-replica contexts in contextvars (SPEC §2)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import aiodist
from tests.conftest import cpu_devices, wait_until


def test_outside_any_scope_is_the_default_context():
    default = aiodist.get_strategy()
    assert not aiodist.has_strategy()
    assert not aiodist.in_cross_replica_context()
    # The default replica context, as in TF: exactly one of the two is None.
    assert aiodist.get_cross_replica_context() is None
    ctx = aiodist.get_replica_context()
    assert ctx is not None and ctx.strategy is default
    assert default.num_replicas_in_sync == 1
    assert default.extended.worker_devices == ("/device:CPU:0",)
    with default.scope():  # TF's default scope enters no cross-replica context either
        assert aiodist.get_cross_replica_context() is None
        assert aiodist.get_replica_context() is not None


async def test_the_default_strategys_run_and_merge_fn_are_no_strategy(two):
    default = aiodist.get_strategy()

    def merge_fn(strategy):
        return (aiodist.has_strategy(), aiodist.get_cross_replica_context() is default)

    async def fn():
        seen = {"has_strategy": aiodist.has_strategy(), "strategy": aiodist.get_strategy()}
        with two.scope():  # no other strategy is current here: TF allows it
            seen["scope"] = aiodist.get_strategy()
        seen["merge"] = await aiodist.get_replica_context().merge_call(merge_fn)
        return seen

    seen = await default.run(fn)
    assert seen == {
        "has_strategy": False,
        "strategy": default,
        "scope": two,
        "merge": (False, True),
    }
    assert await aiodist.get_replica_context().merge_call(merge_fn) == (False, True)


async def test_another_strategy_runs_and_reduces_in_the_default_strategys_merge_fn(two):
    """There the default strategy is no strategy (has_strategy() is False, another
    scope may be entered), so another strategy's run and cross-replica methods work
    as outside any scope. They raised "Mixing different aiodist strategies: ... was
    used while <default strategy> is current"."""
    value = aiodist.PerReplica([1.0, 2.0], cpu_devices(2))

    async def replica_id():
        return float(aiodist.get_replica_context().replica_id_in_sync_group)

    async def merge_fn(strategy):
        ids = await two.run(replica_id)
        return (
            two.experimental_local_results(ids),
            float(await two.reduce("sum", value, axis=None)),
            float(np.asarray(await two.extended.reduce_to("sum", value, "cpu:0"))),
        )

    async def step():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    expected = ((0.0, 1.0), 3.0, 3.0)
    assert await aiodist.get_replica_context().merge_call(merge_fn) == expected
    assert await aiodist.get_strategy().run(step) == expected


def test_scope_enters_cross_replica_context(two):
    with two.scope() as entered:
        assert entered is two
        assert aiodist.get_strategy() is two
        assert aiodist.has_strategy()
        assert aiodist.in_cross_replica_context()
        assert aiodist.get_replica_context() is None
        assert aiodist.get_cross_replica_context() is two
        with two.scope():  # re-entering the same strategy is fine
            assert aiodist.get_strategy() is two
        assert aiodist.in_cross_replica_context()
    assert not aiodist.has_strategy()


def test_one_scope_object_entered_inside_itself_and_again(two):
    """As TF's: the object scope() returns may be entered inside its own block."""
    scope = two.scope()
    with scope as entered:
        with scope:
            assert entered is two and aiodist.get_strategy() is two
        assert aiodist.in_cross_replica_context()
    assert not aiodist.has_strategy()
    with scope:
        assert aiodist.get_strategy() is two
    assert not aiodist.has_strategy()


async def test_one_scope_object_shared_by_tasks_leaving_in_any_order(two):
    scope = two.scope()
    first_in, second_out = asyncio.Event(), asyncio.Event()

    async def first():
        with scope:
            first_in.set()
            await second_out.wait()
            assert aiodist.get_strategy() is two
        return aiodist.has_strategy()

    async def second():
        await first_in.wait()
        with scope:
            assert aiodist.get_strategy() is two
        second_out.set()
        return aiodist.has_strategy()

    assert await asyncio.gather(first(), second()) == [False, False]
    assert not aiodist.has_strategy()


def test_one_scope_object_shared_by_threads_leaving_in_any_order(two):
    """Threads have no task: their entries were told apart by task alone (None for
    both), so the first to leave reset the other's token, in a context that did not
    make it (ValueError), and both threads stayed in the scope."""
    scope = two.scope()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with scope:
            first_in.set()
            second_in.wait(5)
        first_out.set()
        seen["first after"] = aiodist.has_strategy()

    def second():
        first_in.wait(5)
        with scope:
            second_in.set()
            first_out.wait(5)
            seen["second inside"] = aiodist.get_strategy() is two
        seen["second after"] = aiodist.has_strategy()

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(first), pool.submit(second)]:
            done.result()
    assert seen == {"first after": False, "second inside": True, "second after": False}


async def test_a_scope_entered_and_left_by_two_tasks_of_one_context(two):
    """pytest-asyncio runs an async generator fixture's code before and after its
    yield as two tasks sharing one context. Leaving the scope in the second task
    raised ContextError ("left by a task or thread that did not enter it") and left
    the scope current in that context: every later test of the session then failed
    with "Mixing different aiodist strategies"."""

    async def fixture():
        with two.scope():
            yield aiodist.get_strategy()

    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    generator = fixture()
    assert await loop.create_task(anext(generator), context=context) is two
    assert context.run(aiodist.get_strategy) is two
    assert await loop.create_task(anext(generator, "done"), context=context) == "done"
    assert not context.run(aiodist.has_strategy)
    # A task of another context still cannot leave an entry it did not make.
    scope = two.scope()
    scope.__enter__()
    try:
        with pytest.raises(aiodist.ContextError, match=r"did not enter it"):
            await asyncio.create_task(asyncio.to_thread(scope.__exit__, None, None, None))
        assert aiodist.get_strategy() is two
    finally:
        scope.__exit__(None, None, None)


async def test_a_fixture_half_leaving_a_scope_skips_a_running_tasks_entry(two):
    """The second half of a fixture holding a shared scope object open left the
    latest entry whose state was current: that of a task started inside the block
    (it inherits that state) and still inside a block of the same scope object. The
    fixture's context kept the strategy current, and the task, leaving its own
    block, got ContextError ("did not enter it")."""
    scope = two.scope()  # one object, shared
    inside, leave = asyncio.Event(), asyncio.Event()

    async def fixture():
        with scope:
            yield

    async def background():
        with scope:  # a re-entry: changes nothing
            inside.set()
            await leave.wait()
        return aiodist.has_strategy()

    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    generator = fixture()
    await loop.create_task(anext(generator), context=context)
    task = context.run(asyncio.create_task, background())  # started inside the block
    await inside.wait()
    await loop.create_task(anext(generator, None), context=context)
    assert not context.run(aiodist.has_strategy)  # the fixture's entry was left
    leave.set()
    assert await task is True  # its own block left by itself: its outer state stays
    assert "entered 0 time(s)" in repr(scope)


def test_mixing_strategies_raises(two, three):
    default = aiodist.get_strategy()
    with two.scope():
        with pytest.raises(RuntimeError, match=r"Mixing different aiodist strategies"):
            with three.scope():
                pass
        with pytest.raises(RuntimeError, match=r"Mixing different aiodist strategies"):
            with default.scope():  # TF: the default strategy's scope nests in no other
                pass
        assert aiodist.get_strategy() is two
    with default.scope():  # on its own it is fine
        assert not aiodist.has_strategy()


async def test_mixing_two_strategies_on_the_same_devices_says_they_are_two_objects():
    """A strategy made twice (in a helper, a fixture) has the same repr as the first:
    "Mixing" named one text twice, "X was used while X is current"."""
    first, second = (aiodist.MirroredStrategy(["cpu:0", "cpu:1"]) for _ in range(2))
    with first.scope():
        v = aiodist.Variable(0.0, aggregation="sum")
    twice = r"These are two MirroredStrategy objects on the same devices \(was the strategy made"
    with second.scope():
        for attempt in (
            lambda: first.scope().__enter__(),
            lambda: first.run(lambda: None),
            lambda: first.reduce("mean", 1.0),
            lambda: v.assign(1.0),
        ):
            with pytest.raises(aiodist.ContextError, match=r"Mixing different .*" + twice):
                result = attempt()
                if inspect.isawaitable(result):
                    await result
    with pytest.raises(aiodist.ContextError, match=r"variable 'Variable' .*" + twice):
        await second.extended.update(v, lambda copy: copy.assign(1.0))
    # Strategies that differ show it, with no such sentence.
    with first.scope(), pytest.raises(aiodist.ContextError) as info:
        await aiodist.OneDeviceStrategy("cpu:0").run(lambda: None)
    assert "two MirroredStrategy objects" not in str(info.value)


async def test_inside_run_replica_context_is_current(two):
    async def fn():
        ctx = aiodist.get_replica_context()
        assert aiodist.get_strategy() is two
        assert aiodist.has_strategy()
        assert not aiodist.in_cross_replica_context()
        assert aiodist.get_cross_replica_context() is None
        with two.scope():  # same strategy inside its replica: stays in replica context
            assert aiodist.get_replica_context() is ctx
        return ctx.strategy is two

    assert await two.run(fn) is True
    with two.scope():
        assert await two.run(fn) is True


async def test_run_of_another_strategy_inside_a_scope_raises(two, three):
    with three.scope(), pytest.raises(aiodist.ContextError, match=r"Mixing different"):
        await two.run(lambda: None)


async def test_cross_replica_methods_in_replica_context_point_to_merge_call(two):
    async def fn():
        value = aiodist.PerReplica([1.0, 2.0])
        with pytest.raises(RuntimeError, match=r"reduce\(\) needs cross-replica.*merge_call"):
            await two.reduce("sum", value, axis=None)
        with pytest.raises(aiodist.ContextError, match=r"gather\(\) needs cross-replica"):
            await two.gather(value, axis=0)
        with pytest.raises(aiodist.ContextError, match=r"reduce_to\(\)"):
            await two.extended.reduce_to("sum", value, "cpu:0")
        with pytest.raises(aiodist.ContextError, match=r"batch_reduce_to\(\)"):
            await two.extended.batch_reduce_to("sum", [(value, "cpu:0")])
        with pytest.raises(aiodist.ContextError, match=r"broadcast_to\(\)"):
            await two.extended.broadcast_to(1.0, "cpu:0")
        return True

    assert await two.run(fn) is True


async def test_concurrent_tasks_never_see_each_others_context(two, three):
    """A scope entered in one task is invisible in another running at the same time."""
    inside = asyncio.Event()
    release = asyncio.Event()

    async def scoped():
        with two.scope():
            inside.set()
            await release.wait()
            return aiodist.get_strategy()

    async def observer():
        await inside.wait()
        seen = (aiodist.has_strategy(), aiodist.get_replica_context())
        with three.scope():  # no mixing error: the other task's scope is not ours
            pass
        release.set()
        return seen

    got_scoped, (has, ctx) = await asyncio.gather(scoped(), observer())
    assert got_scoped is two
    assert has is False
    assert ctx is not None and ctx.strategy is aiodist.get_strategy()


async def test_replicas_each_see_only_their_own_context(num_replicas):
    strategy = aiodist.MirroredStrategy(cpu_devices(num_replicas))
    seen = {}
    arrived = []

    async def fn():
        ctx = aiodist.get_replica_context()
        arrived.append(ctx)
        await wait_until(lambda: len(arrived) == num_replicas, "all replicas started")
        seen[ctx.replica_id_in_sync_group] = aiodist.get_replica_context()
        return None

    await strategy.run(fn)
    assert len({id(c) for c in seen.values()}) == num_replicas
    assert all(c.replica_id_in_sync_group == i for i, c in seen.items())


def test_experimental_set_strategy(two):
    aiodist.experimental_set_strategy(two)
    try:
        assert aiodist.get_strategy() is two
        assert aiodist.in_cross_replica_context()
        with two.scope():
            with pytest.raises(aiodist.ContextError, match=r"inside a strategy scope"):
                aiodist.experimental_set_strategy(None)
    finally:
        aiodist.experimental_set_strategy(None)
    assert not aiodist.has_strategy()


@pytest.mark.parametrize(
    "bad", [5, "cpu:0", aiodist.MirroredStrategy, aiodist.get_replica_context()]
)
def test_experimental_set_strategy_refuses_what_is_not_a_strategy(bad):
    """Anything was taken: get_strategy() then returned it, and the next use failed
    deep inside (Variable(): "AttributeError: 'str' object has no attribute '_world'")."""
    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"strategy=.*expected an aiodist strategy"
    ):
        aiodist.experimental_set_strategy(bad)
    assert not aiodist.has_strategy()
    aiodist.Variable(1.0)  # still the default strategy's


def test_replica_context_repr(two):
    with two.scope():
        assert aiodist.get_replica_context() is None
    ctx = aiodist.get_replica_context()
    assert "replica 0 of 1" in repr(ctx)


@pytest.mark.parametrize("method", ["all_reduce", "all_gather", "merge_call"])
async def test_the_default_contexts_collectives_without_a_running_loop_say_to_await_them(method):
    """Called where no event loop runs (synchronous code, a worker thread), they
    raised asyncio's bare "RuntimeError: no running event loop", naming neither the
    collective nor what to do. Such a call takes no call number: the same call
    awaited afterwards on the loop works."""
    ctx = aiodist.get_replica_context()
    calls = {
        "all_reduce": lambda: ctx.all_reduce("sum", np.ones(2)),
        "all_gather": lambda: ctx.all_gather(np.ones(2), axis=0),
        "merge_call": lambda: ctx.merge_call(lambda strategy: np.ones(2)),
    }
    message = (
        rf"^ReplicaContext\.{method}\(\) of the default replica context was called where no "
        r"event loop is running .*await aiodist\.get_replica_context\(\)\."
    )
    with pytest.raises(aiodist.ContextError, match=message):
        await asyncio.to_thread(calls[method])  # (a thread of the loop's executor)
    with ThreadPoolExecutor(1) as executor:  # (a thread that copies no context)
        with pytest.raises(aiodist.ContextError, match=message):
            executor.submit(calls[method]).result()
    np.testing.assert_array_equal(await calls[method](), np.ones(2))


async def test_tasks_and_threads_started_in_a_replica_see_the_context_concepts_md_gives(two):
    """docs/concepts.md: a task started in a replica function is in its context, and
    its collectives are the replica's; asyncio.to_thread's thread sees that context
    too, an executor's (which copies none) the default one."""
    loop = asyncio.get_running_loop()

    def seen():
        return aiodist.get_replica_context(), aiodist.get_strategy()

    async def step():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group

        async def child():
            assert aiodist.get_replica_context() is ctx
            return await ctx.all_reduce("sum", float(rid))

        async def gather():
            return await ctx.all_gather(np.array([rid]), axis=0)

        async with asyncio.TaskGroup() as group:
            reduced = group.create_task(child())
            gathered = group.create_task(gather())
        assert await asyncio.to_thread(seen) == (ctx, two)
        executor_ctx, executor_strategy = await loop.run_in_executor(None, seen)
        assert executor_ctx is not ctx and executor_strategy is not two
        assert not executor_strategy.extended.worker_devices[1:]  # the default: one device
        return float(reduced.result()), gathered.result().tolist()

    results = two.experimental_local_results(await two.run(step))
    assert results == ((1.0, [0, 1]), (1.0, [0, 1]))
