"""Where TensorFlow hangs, aiodist raises (SPEC §4, "never hang").

Each test here would hang without the guarantee it checks; the pytest timeout
turns such a regression into a failure instead of a stuck CI run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import inspect
import re
import sys
import time
import traceback
import weakref
from functools import partial

import numpy as np
import pytest

import aiodist
from tests.conftest import cpu_devices, task_factory, wait_until

pytestmark = pytest.mark.timeout(10)


def rid() -> int:
    return aiodist.get_replica_context().replica_id_in_sync_group


async def run_collecting(strategy, fn):
    """Run ``fn`` per replica; return ({replica: exception it raised}, the run's exception)."""
    errors: dict[int, BaseException] = {}

    async def wrapper():
        try:
            return await fn()
        except aiodist.RendezvousError as exc:
            errors[rid()] = exc
            raise

    with pytest.raises(aiodist.RendezvousError) as info:
        await strategy.run(wrapper)
    return errors, info.value


# -- a replica leaves ---------------------------------------------------------------


@pytest.mark.parametrize("num_replicas", [1, 2, 4], ids=lambda n: f"{n}waiting")
async def test_replica_returns_while_others_wait(num_replicas):
    strategy = aiodist.MirroredStrategy(cpu_devices(num_replicas + 1))
    last = num_replicas  # the replica that skips the collective

    async def fn():
        ctx = aiodist.get_replica_context()
        await ctx.all_reduce("sum", 1.0)  # call #0: everybody
        if rid() == last:
            return "skipped"
        return await ctx.all_reduce("sum", 2.0)  # call #1: replica `last` never comes

    errors, raised = await run_collecting(strategy, fn)
    assert isinstance(raised, aiodist.ReplicaExitedError)
    assert isinstance(raised, RuntimeError)
    assert sorted(errors) == list(range(num_replicas))
    message = str(raised)
    assert f"all_reduce #1: replica {last} returned without calling it" in message
    assert "same collective calls" in message


async def test_replica_returns_before_others_arrive(two):
    """The waiting replica arrives after the other one already returned."""
    returned = asyncio.Event()

    async def fn():
        if rid() == 0:
            returned.set()
            return None
        await returned.wait()
        await asyncio.sleep(0)
        return await aiodist.get_replica_context().merge_call(lambda s: None)

    errors, raised = await run_collecting(two, fn)
    assert isinstance(raised, aiodist.ReplicaExitedError)
    assert list(errors) == [1]
    assert "merge_call #0: replica 0 returned without calling it" in str(raised)


async def test_the_exit_message_says_who_waits_and_who_finished(two):
    """A replica that started the collective and returned without awaiting it does not
    wait in it, nor does a replica whose left-behind task called it late."""
    started = []

    async def never_awaits():
        if rid() == 0:
            started.append(aiodist.get_replica_context().all_reduce("sum", 1.0))
        return rid()

    # (No replica awaited the failed call: the run raises its error.)
    with pytest.raises(aiodist.ReplicaExitedError) as info:
        await two.run(never_awaits)
    assert started[0].exception() is info.value
    assert (
        "all_reduce #0: replica 1 returned without calling it, while replica 0 called it "
        "and has finished since; every replica"
    ) in str(info.value)

    left_behind = []

    async def late(ctx):
        await asyncio.sleep(0)
        return await ctx.all_reduce("sum", 1.0)

    async def leaves_a_task():
        ctx = aiodist.get_replica_context()
        if rid() == 0:
            left_behind.append(asyncio.create_task(late(ctx)))
            return None
        await wait_until(lambda: left_behind[0].done(), "the late call failed")
        return await ctx.all_reduce("sum", 1.0)

    errors, raised = await run_collecting(two, leaves_a_task)
    assert errors == {1: raised}
    assert str(raised).startswith(
        "all_reduce #0: replica 0 returned without calling it, while a task that replica 0 "
        "left running called it after that; every replica"
    )
    assert left_behind[0].exception() is raised


async def test_replica_that_made_fewer_calls(three):
    async def fn():
        ctx = aiodist.get_replica_context()
        calls = 2 if rid() == 2 else 3
        for i in range(calls):
            await ctx.all_gather(np.array([i]), axis=0)
        return calls

    errors, raised = await run_collecting(three, fn)
    assert sorted(errors) == [0, 1]
    assert "all_gather #2: replica 2 returned without calling it" in str(raised)
    assert "wait in it" in str(raised) or "waits in it" in str(raised)


# -- replicas disagree ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("odd_call", "shown"),
    [
        (lambda ctx: ctx.all_gather(np.ones(2), axis=0), "called all_gather(axis=0, float64[2])"),
        (lambda ctx: ctx.all_reduce("max", np.ones(2)), "called all_reduce(MAX, float64[2])"),
        (lambda ctx: ctx.all_reduce("sum", np.ones(3)), "called all_reduce(SUM, float64[3])"),
        (
            lambda ctx: ctx.all_reduce("sum", np.ones(2, dtype=np.float32)),
            "called all_reduce(SUM, float32[2])",
        ),
        (
            lambda ctx: ctx.all_reduce("sum", (np.ones(2),)),
            "called all_reduce(SUM, (float64[2],))",
        ),
        (lambda ctx: ctx.merge_call(lambda s: None), "called merge_call("),
    ],
    ids=["other-collective", "other-op", "other-shape", "other-dtype", "other-structure", "merge"],
)
async def test_mismatch_names_what_each_replica_called(three, odd_call, shown):
    async def fn():
        ctx = aiodist.get_replica_context()
        await ctx.all_reduce("sum", 1.0)  # #0 agrees
        if rid() == 1:
            return await odd_call(ctx)
        return await ctx.all_reduce("sum", np.ones(2))  # #1

    errors, raised = await run_collecting(three, fn)
    assert isinstance(raised, aiodist.CollectiveMismatchError)
    assert isinstance(raised, ValueError)
    assert errors  # raised in the replicas that were waiting, not only in run
    message = str(raised)
    assert message.startswith("collective #1 does not match across replicas")
    assert f"replica 1 {shown}" in message
    assert "called all_reduce(SUM, float64[2])" in message


async def test_mismatch_of_two_functions_with_one_name_shows_where_each_is_defined(three):
    first = lambda s: None  # noqa: E731
    second = lambda s: None  # noqa: E731
    line = first.__code__.co_firstlineno

    async def fn():
        return await aiodist.get_replica_context().merge_call(second if rid() == 2 else first)

    _, raised = await run_collecting(three, fn)
    assert isinstance(raised, aiodist.CollectiveMismatchError)
    name = first.__qualname__
    assert f"replicas 0, 1 called merge_call({name} (test_no_hang.py:{line}))" in str(raised)
    assert f"replica 2 called merge_call({name} (test_no_hang.py:{line + 1}))" in str(raised)


class _KeyEqualOnlyToItself:
    """A dict key whose == with any other object raises (each replica makes its own)."""

    def __init__(self, name: str):
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __lt__(self, other: _KeyEqualOnlyToItself) -> bool:
        return self.name < other.name

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        raise RuntimeError("these keys cannot be compared")

    def __repr__(self) -> str:
        return f"Key({self.name!r})"


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
async def test_a_dict_key_whose_comparison_raises_fails_the_call_in_every_replica(two, collective):
    # The rendezvous compares each arrival's structure with the first's, dict keys by
    # ==. A key whose == raised: the error came out of the last arrival's call alone,
    # and left the call with every replica counted and nothing to complete or fail it,
    # so the replica that caught it and returned left the other waiting for ever.
    caught = {}

    async def fn():
        ctx = aiodist.get_replica_context()
        value = {_KeyEqualOnlyToItself("w"): np.ones(2)}
        try:
            if collective == "all_reduce":
                return await ctx.all_reduce("sum", value)
            return await ctx.all_gather(value, axis=0)
        except RuntimeError as exc:
            caught[rid()] = exc
            return None

    assert await two.run(fn) is None  # (the same object from both replicas)
    assert caught.keys() == {0, 1}
    assert caught[0] is caught[1]  # one error, in every replica
    error = caught[0]
    assert isinstance(error, aiodist.RendezvousError)
    assert isinstance(error.__cause__, RuntimeError)
    assert re.search(
        rf"{collective} #0: replica (\d)'s call could not be matched with replica (?!\1)\d's: "
        r"comparing them raised RuntimeError: these keys cannot be compared\. .*dict keys "
        r"by == and shown by repr\(\): use keys that compare and print without raising",
        str(error),
    )


async def test_all_gather_shapes_may_differ_only_along_axis(two):
    async def fn():
        return await aiodist.get_replica_context().all_gather(np.ones((2, rid() + 1)), axis=0)

    errors, raised = await run_collecting(two, fn)
    assert isinstance(raised, aiodist.CollectiveMismatchError)
    assert sorted(errors) == [0, 1]
    assert "float64[2, 1]" in str(raised) and "float64[2, 2]" in str(raised)


# -- timeouts -------------------------------------------------------------------------


async def test_per_call_timeout_names_missing_replicas(three):
    options = aiodist.CommunicationOptions(timeout_seconds=0.05)

    async def fn():
        if rid() == 2:
            await asyncio.Event().wait()  # stuck elsewhere, never arrives
        return await aiodist.get_replica_context().all_reduce("sum", 1.0, options=options)

    errors, raised = await run_collecting(three, fn)
    assert isinstance(raised, aiodist.RendezvousTimeoutError)
    assert isinstance(raised, TimeoutError)
    assert sorted(errors) == [0, 1]
    message = str(raised)
    assert "all_reduce #0: timed out after 0.05 s waiting for replica 2" in message
    assert "replicas 0, 1 arrived" in message


@pytest.mark.parametrize("first_options", [None, 2.0])
async def test_a_later_arrivals_timeout_bounds_its_wait_too(three, first_options):
    # Replica 0 arrives first, with no timeout or a long one; replica 2 then asks for
    # 0.05 s: its wait ends then, naming the replica still missing.
    first = aiodist.CommunicationOptions(timeout_seconds=first_options)
    later = aiodist.CommunicationOptions(timeout_seconds=0.05)
    arrived = asyncio.Event()

    async def fn():
        ctx = aiodist.get_replica_context()
        if rid() == 1:
            await asyncio.Event().wait()  # never arrives
        if rid() == 0:
            pending = ctx.all_reduce("sum", 1.0, options=first)
            arrived.set()
            return await pending
        await arrived.wait()
        return await ctx.all_reduce("sum", 1.0, options=later)

    errors, raised = await asyncio.wait_for(run_collecting(three, fn), 1.5)
    assert isinstance(raised, aiodist.RendezvousTimeoutError)
    assert sorted(errors) == [0, 2]
    assert "all_reduce #0: timed out after 0.05 s waiting for replica 1" in str(raised)


async def test_strategy_default_timeout_applies_to_merge_call():
    strategy = aiodist.MirroredStrategy(
        cpu_devices(2),
        communication_options=aiodist.CommunicationOptions(timeout_seconds=0.05),
    )

    async def fn():
        if rid() == 0:
            await asyncio.Event().wait()
        return await aiodist.get_replica_context().merge_call(lambda s: 1)

    errors, raised = await run_collecting(strategy, fn)
    assert isinstance(raised, aiodist.RendezvousTimeoutError)
    assert list(errors) == [1]
    assert "merge_call #0: timed out after 0.05 s waiting for replica 0" in str(raised)


async def test_timeout_does_not_fire_when_everyone_arrives(two):
    options = aiodist.CommunicationOptions(timeout_seconds=0.05)

    async def fn():
        ctx = aiodist.get_replica_context()
        total = 0.0
        for _ in range(3):
            total += float(await ctx.all_reduce("sum", 1.0, options=options))
        await asyncio.sleep(0.1)  # longer than the timeout, after the calls completed
        return total

    result = await two.run(fn)
    assert two.experimental_local_results(result) == (6.0, 6.0)


def test_every_rendezvous_error_shares_one_base():
    for cls in (
        aiodist.ReplicaExitedError,
        aiodist.CollectiveMismatchError,
        aiodist.RendezvousTimeoutError,
    ):
        assert issubclass(cls, aiodist.RendezvousError)
        assert issubclass(cls, aiodist.AiodistError)


# -- regressions: failures that once hung or reached only one replica -----------------


async def test_sync_merge_fn_raising_cancelled_error_fails_the_run(two):
    def merge_fn(strategy):
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        return future.result()  # raises CancelledError inside merge_fn

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    errors, raised = await run_collecting(two, fn)
    assert "the cross-replica code raised CancelledError" in str(raised)
    assert sorted(errors) == [0, 1]


@pytest.mark.parametrize("raised", ["CancelledError", "StopIteration", "async StopIteration"])
async def test_merge_fn_raising_what_no_await_can_receive_is_as_documented(two, raised):
    """docs/errors.md#rendezvouserror: a merge_fn raising CancelledError or
    StopIteration fails every replica's merge_call with a RendezvousError caused by
    it; in an async merge_fn Python turns StopIteration into a RuntimeError, which
    every replica raises as merge_fn's exception."""
    original = asyncio.CancelledError() if raised == "CancelledError" else StopIteration()

    def merge_fn(strategy):
        raise original

    async def async_merge_fn(strategy):
        raise original

    seen = []

    async def fn():
        try:
            merge = async_merge_fn if raised.startswith("async") else merge_fn
            await aiodist.get_replica_context().merge_call(merge)
        except Exception as exc:
            seen.append(exc)
            raise

    if raised.startswith("async"):
        with pytest.raises(RuntimeError, match="coroutine raised StopIteration") as info:
            await two.run(fn)
        assert not isinstance(info.value, aiodist.AiodistError)
    else:
        errors, failure = await run_collecting(two, fn)
        assert sorted(errors) == [0, 1]
        assert type(failure) is aiodist.RendezvousError
        assert f"the cross-replica code raised {raised}" in str(failure)
        assert failure.__cause__ is original
    assert len(seen) == 2 and seen[0] is seen[1]


async def test_a_replica_cancelled_by_another_task_fails_the_run_as_documented(three):
    """docs/errors.md#replicaexitederror: a replica's task cancelled by something
    other than its run (here another task, while the others wait in a collective)
    fails the run with ReplicaExitedError, the other replicas cancelled."""
    tasks, cancelled = {}, []

    async def fn():
        ctx = aiodist.get_replica_context()
        tasks[rid()] = asyncio.current_task()
        try:
            return await ctx.all_reduce("sum", 1.0) if rid() != 1 else await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(rid())
            raise

    async def watchdog():
        await wait_until(lambda: len(tasks) == 3, "every replica started")
        tasks[1].cancel()

    watching = asyncio.create_task(watchdog())
    with pytest.raises(aiodist.ReplicaExitedError, match="replica 1 was cancelled by something"):
        await three.run(fn)
    await watching
    assert sorted(cancelled) == [0, 1, 2]


async def test_a_replica_cancelled_by_other_code_is_the_cause_of_the_runs_error(two):
    """The ReplicaExitedError of a replica cancelled by other code is chained to that
    replica's CancelledError: without it, the traceback showed only run's frame, not
    where the replica was, and the message given to cancel() was lost."""

    async def stuck_in_the_replica():
        await asyncio.Event().wait()

    async def fn():
        if rid() == 1:
            task = asyncio.current_task()
            asyncio.get_running_loop().call_soon(task.cancel, "stopped by the watchdog")
        await stuck_in_the_replica()

    with pytest.raises(aiodist.ReplicaExitedError, match="replica 1 was cancelled by some") as info:
        await two.run(fn)
    cause = info.value.__cause__
    assert isinstance(cause, asyncio.CancelledError), repr(cause)
    assert cause.args == ("stopped by the watchdog",)
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(cause.__traceback__)]
    assert "stuck_in_the_replica" in frames, frames


async def _instrumented(coro):
    return await coro


# Ways replica tasks are made that leave a window before their first step: asyncio's
# own tasks on Python 3.11 (3.12+ starts them eagerly), and task factories that are
# not eager (one that wraps the coroutine never starts the replica's own).
_NOT_EAGER = {
    "no factory": None,
    "factory": lambda loop, coro, **kwargs: asyncio.Task(coro, loop=loop, **kwargs),
    "wrapping factory": lambda loop, coro, **kwargs: asyncio.Task(
        _instrumented(coro), loop=loop, **kwargs
    ),
}


@pytest.mark.parametrize("others", ["wait", "return"])
@pytest.mark.parametrize("factory", list(_NOT_EAGER))
async def test_a_replica_cancelled_before_its_first_step_fails_the_run(three, factory, others):
    """A replica's task cancelled by other code before its first step never runs its
    coroutine, so the scheduler's wrapper never told the run: it waited for that
    replica for ever (the others waiting in a collective, or returned). It fails as
    one cancelled later does (ReplicaExitedError), nothing warns of a coroutine never
    awaited, and the strategy serves the next run."""
    if _NOT_EAGER[factory] is None and sys.version_info >= (3, 12):
        pytest.skip("Python 3.12+ starts replica tasks eagerly: no window before a first step")
    started, cancelled = [], []

    async def fn():
        ctx = aiodist.get_replica_context()
        started.append(rid())
        if rid() == 0:
            for task in asyncio.all_tasks():  # code that got hold of a sibling's task
                if task.get_name() == "aiodist-replica-2" and 2 not in started:
                    cancelled.append(task.cancel())
        if others == "wait":
            return await ctx.all_reduce("sum", 1.0)
        return rid()

    with task_factory(_NOT_EAGER[factory]) if _NOT_EAGER[factory] else contextlib.nullcontext():
        with pytest.raises(aiodist.ReplicaExitedError, match="replica 2 was cancelled by some"):
            await three.run(fn)
        gc.collect()  # (a coroutine dropped unawaited would warn here: an error)
        assert cancelled == [True] and sorted(started) == [0, 1]
        assert three.statistics().runs_in_flight == 0
        started.clear()
        assert await three.run(lambda: 7) == 7


async def _raises_first(coro):
    await asyncio.sleep(0)
    raise LookupError("the factory's coroutine failed")


async def _returns_first(coro):
    await asyncio.sleep(0)
    return None


@pytest.mark.parametrize("wrapper", [_raises_first, _returns_first])
async def test_a_factorys_task_ending_before_it_starts_the_replica_fails_the_run(two, wrapper):
    """A task factory whose own coroutine ends before it awaits the replica's (it
    raised, or returned) left the run waiting for that replica for ever. The run
    fails: with that coroutine's exception, or a ReplicaExitedError naming the
    replica; nothing warns of a coroutine never awaited."""

    def factory(loop, coro, **kwargs):
        if inspect.getcoroutinelocals(coro).get("rid") == 1:  # replica 1's task
            coro = wrapper(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    expected = (
        (LookupError, "the factory's coroutine failed")
        if wrapper is _raises_first
        else (aiodist.ReplicaExitedError, r"replica 1's task ended without running")
    )
    with task_factory(factory):
        with pytest.raises(expected[0], match=expected[1]):
            await asyncio.wait_for(two.run(fn), 10)
    gc.collect()  # (a coroutine dropped unawaited would warn here: an error)
    assert two.statistics().runs_in_flight == 0
    assert await two.run(lambda: 7) == 7


async def test_merge_fn_exception_reaches_every_replica_uncaught(three):
    boom = LookupError("merge_fn failed")
    seen = []

    def merge_fn(strategy):
        raise boom

    async def fn():
        try:
            await aiodist.get_replica_context().merge_call(merge_fn)
        except LookupError:
            seen.append(rid())
            raise

    with pytest.raises(LookupError) as info:
        await three.run(fn)
    assert info.value is boom
    assert sorted(seen) == [0, 1, 2]


async def test_different_merge_fns_are_a_mismatch(two):
    def merge_a(strategy):
        return "a"

    def merge_b(strategy):
        return "b"

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_a if rid() == 0 else merge_b)

    errors, raised = await run_collecting(two, fn)
    assert isinstance(raised, aiodist.CollectiveMismatchError)
    assert sorted(errors) == [0, 1]
    assert "merge_a" in str(raised) and "merge_b" in str(raised)


def _apply_update(strategy, lr):
    return f"update {lr}"


def _log_metrics(strategy, tag):
    return f"log {tag}"


class _Merger:
    def __call__(self, strategy):
        return "merged"


@pytest.mark.parametrize(
    ("first", "second", "shown"),
    [
        (partial(_apply_update, lr=0.1), partial(_log_metrics, tag="t"), "partial(_apply_update"),
        (str, int, "merge_call(str)"),
        (len, abs, "merge_call(len)"),
        (_Merger(), partial(_log_metrics, tag="t"), "merge_call(_Merger)"),
    ],
)
async def test_merge_fns_without_code_of_their_own_are_told_apart(two, first, second, shown):
    async def fn():
        return await aiodist.get_replica_context().merge_call(first if rid() == 0 else second)

    errors, raised = await run_collecting(two, fn)
    assert isinstance(raised, aiodist.CollectiveMismatchError)
    assert sorted(errors) == [0, 1]
    assert shown in str(raised)


async def test_partials_of_one_function_and_instances_of_one_class_match(two):
    async def fn():
        ctx = aiodist.get_replica_context()
        update = await ctx.merge_call(partial(_apply_update, lr=rid()))  # replica 0's runs
        merged = await ctx.merge_call(_Merger())
        return update, merged

    assert await two.run(fn) == ("update 0", "merged")


async def test_per_replica_closures_of_one_merge_fn_match(three):
    async def fn():
        offset = rid()

        def merge_fn(strategy, values):  # a new closure object on every replica
            return sum(strategy.experimental_local_results(values)) + 0 * offset

        return await aiodist.get_replica_context().merge_call(merge_fn, args=(rid() + 10,))

    assert await three.run(fn) == 33


async def test_merge_fns_of_one_definition_under_different_names_are_a_mismatch(two):
    # Signatures are kept per code object: a name given to one function of that code
    # must not be served another's signature (the key is the code and the name).
    def named(name):
        def merge_fn(strategy):
            return name

        merge_fn.__qualname__ = name
        return merge_fn

    async def fn(names):
        ctx = aiodist.get_replica_context()
        return await ctx.merge_call(named(names[rid()]))

    assert await two.run(fn, args=(("first", "first"),)) == "first"
    errors, raised = await run_collecting(two, lambda: fn(("first", "second")))
    assert isinstance(raised, aiodist.CollectiveMismatchError)
    assert sorted(errors) == [0, 1]
    assert "replica 0 called merge_call(first (" in str(raised)
    assert "replica 1 called merge_call(second (" in str(raised)
    assert await two.run(fn, args=(("second", "second"),)) == "second"


async def test_replica_cancelling_itself_fails_the_run_and_cancels_the_others(three):
    cancelled = []

    async def fn():
        if rid() == 1:
            asyncio.current_task().cancel()
            await asyncio.sleep(0)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(rid())
            raise

    with pytest.raises(aiodist.ReplicaExitedError, match=r"replica 1 was cancelled by something"):
        await three.run(fn)
    assert sorted(cancelled) == [0, 2]
    assert asyncio.current_task().cancelling() == 0


def _timing_out(seconds: float) -> aiodist.MirroredStrategy:
    """Two replicas whose collectives (and merge_fns) time out after ``seconds``."""
    return aiodist.MirroredStrategy(
        cpu_devices(2), communication_options=aiodist.CommunicationOptions(timeout_seconds=seconds)
    )


def _merging(merge_fn):
    """A replica function making one merge_call of ``merge_fn``."""

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    return fn


async def _never_finishing(s):
    await asyncio.Event().wait()


async def _blocking_then_suspending(s):
    # Its timeout counts from its start, not from its first suspension.
    time.sleep(0.04)  # a first step that blocks the loop most of the 0.05 s
    await asyncio.sleep(0.03)  # within 0.05 s of the suspension, not of the start
    return "finished"


@pytest.mark.parametrize("merge_fn", [_never_finishing, _blocking_then_suspending])
async def test_timeout_bounds_a_slow_async_merge_fn(merge_fn):
    errors, raised = await run_collecting(_timing_out(0.05), _merging(merge_fn))
    assert isinstance(raised, aiodist.RendezvousTimeoutError)
    assert "merge_call #0: merge_fn did not finish within 0.05 s" in str(raised)
    assert sorted(errors) == [0, 1]


async def test_a_merge_fns_timeout_starts_with_its_task_under_a_task_factory():
    # A factory's task starts a loop turn after the last arrival: what keeps the loop
    # busy before then is not merge_fn's time.
    strategy = _timing_out(0.05)
    loop = asyncio.get_running_loop()

    async def merge_fn(s):
        await asyncio.sleep(0.03)
        return "finished"

    async def fn():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:  # the last to arrive
            loop.call_soon(time.sleep, 0.04)  # runs before merge_fn's task starts
        return await ctx.merge_call(merge_fn)

    with task_factory(_plain_tasks):
        assert await strategy.run(fn) == "finished"


async def test_a_merge_fn_cancelled_in_its_first_step_is_cancelled_not_timed_out():
    # Cancelled before its task's first scheduled step, and still cleaning up when
    # timeout_seconds passes: the cancellation is the failure, not the timeout.
    strategy = _timing_out(0.05)

    async def merge_fn(s):
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # past the 0.05 s
            raise

    with pytest.raises(aiodist.RendezvousError, match=r"merge_call #0 was cancelled") as raised:
        await strategy.run(_merging(merge_fn))
    assert not isinstance(raised.value, aiodist.RendezvousTimeoutError)


async def test_a_cancellation_inside_an_async_merge_fn_is_not_reported_as_its_timeout():
    strategy = _timing_out(30)
    waited = asyncio.get_running_loop().create_future()

    async def merge_fn(s):
        await waited  # cancelled below, long before the 30 s

    running = asyncio.ensure_future(strategy.run(_merging(merge_fn)))
    await asyncio.sleep(0.01)
    waited.cancel()
    with pytest.raises(aiodist.RendezvousError, match=r"merge_call #0 was cancelled") as raised:
        await running
    assert not isinstance(raised.value, aiodist.RendezvousTimeoutError)


async def test_a_timeout_raised_inside_an_async_merge_fn_is_its_own():
    strategy = _timing_out(30)

    async def merge_fn(s):
        async with asyncio.timeout(0.01):
            await asyncio.Event().wait()

    with pytest.raises(TimeoutError) as raised:
        await strategy.run(_merging(merge_fn))
    assert not isinstance(raised.value, aiodist.RendezvousTimeoutError)


# -- cancellation while a run winds down ---------------------------------------------


async def test_a_cancel_while_a_failed_run_drains_its_replicas_is_not_lost(two):
    """The caller is cancelled while replica 0 cleans up after replica 1 failed: the
    caller sees CancelledError (asyncio's rule), not the replica's error."""
    cleaning = asyncio.Event()

    async def step():
        if rid() == 1:
            await asyncio.sleep(0)
            raise ValueError("bad batch")
        try:
            await aiodist.get_replica_context().all_reduce("sum", 1.0)
        except asyncio.CancelledError:
            cleaning.set()
            await asyncio.sleep(0.05)  # cleanup that awaits
            raise

    async def serve():
        for _ in range(20):  # a request loop that survives failed steps (bounded: a
            with contextlib.suppress(ValueError):  # lost cancel ends it, not a hang)
                await two.run(step)

    task = asyncio.create_task(serve())
    await cleaning.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_while_a_run_waits_for_its_merge_fn_is_not_lost(two):
    started = asyncio.Event()

    async def slow_merge(strategy):
        started.set()
        await asyncio.sleep(10)

    async def step():
        aiodist.get_replica_context().merge_call(slow_merge)  # started, never awaited
        return rid()

    task = asyncio.create_task(two.run(step))
    await started.wait()  # every replica has returned; the run waits for the merge_fn
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class Outcome(BaseException):
    """Like pytest.fail()'s exception: a BaseException that is not an Exception."""


async def test_a_merge_fn_raising_a_base_exception_reaches_every_replica(three):
    seen = {}

    def merge_fn(strategy):
        raise Outcome("from merge_fn")

    async def step():
        try:
            await aiodist.get_replica_context().merge_call(merge_fn)
        except Outcome as exc:  # handled: the other replicas must not wait forever
            seen[rid()] = exc
        return rid()

    await three.run(step)
    assert sorted(seen) == [0, 1, 2] and len({id(e) for e in seen.values()}) == 1


@pytest.mark.parametrize("factory", ["none", "task"])
async def test_no_never_awaited_warnings_when_a_run_is_cancelled_as_the_last_replica_arrives(
    two, factory
):
    """The run is cancelled in the same loop iteration as the last arrival, before the
    async merge_fn's task has started: its coroutine is closed, not left unawaited.
    (Without a task factory the merge task starts eagerly: merge_fn has run by then.
    A factory making plain tasks keeps the case.)"""
    ran = []

    async def merge_fn(strategy):
        ran.append(True)

    async def step():
        if rid() == 1:  # the last to arrive
            await asyncio.sleep(0)
        return await aiodist.get_replica_context().merge_call(merge_fn)

    plain = factory == "task"
    with task_factory(_plain_tasks if plain else None):
        for _ in range(3):  # a warning would fail the test (filterwarnings = error)
            task = asyncio.create_task(two.run(step))
            await asyncio.sleep(0)  # replica 0 arrives
            await asyncio.sleep(0)  # replica 1 arrives: the merge task is made
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    gc.collect()
    assert ran == ([] if plain else [True] * 3)


def _wrapped_tasks(epilogue: str):
    """A task factory wrapping each coroutine, as instrumentation does, with a step
    of async work after it: on return ("after return") or however it ends ("finally")."""

    async def instrumented(coro):
        if epilogue == "finally":
            try:
                return await coro
            finally:
                await asyncio.sleep(0.02)  # e.g. flushing a span
        result = await coro
        await asyncio.sleep(0.02)
        return result

    def factory(loop, coro, **kwargs):
        kwargs.pop("eager_start", None)
        return asyncio.Task(instrumented(coro), loop=loop, **kwargs)

    return factory


@pytest.mark.parametrize("epilogue", ["after return", "finally"])
async def test_a_replica_that_returns_before_a_collective_is_seen_under_a_wrapping_factory(
    two, epilogue
):
    async def step():
        if rid() == 0:
            return "done"  # never joins the merge_call
        await asyncio.sleep(0.01)
        return await aiodist.get_replica_context().merge_call(lambda s: 1)

    with task_factory(_wrapped_tasks(epilogue)):
        with pytest.raises(aiodist.ReplicaExitedError, match="replica 0 returned without"):
            await asyncio.wait_for(two.run(step), 2)


@pytest.mark.parametrize("epilogue", ["after return", "finally"])
async def test_a_replica_that_raises_fails_the_run_under_a_wrapping_factory(two, epilogue):
    boom = KeyError("replica 0 failed")
    cancelled = []

    async def step():
        if rid() == 0:
            raise boom
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(rid())
            raise

    loop = asyncio.get_running_loop()
    errors = []
    loop.set_exception_handler(lambda loop, context: errors.append(context))
    try:
        with task_factory(_wrapped_tasks(epilogue)):
            with pytest.raises(KeyError) as info:
                await asyncio.wait_for(two.run(step), 2)
    finally:
        loop.set_exception_handler(None)
    assert info.value is boom and cancelled == [1]
    gc.collect()
    await asyncio.sleep(0)
    assert errors == []  # nothing logged: no callback failed, no exception unretrieved


async def test_a_wrapping_factory_leaves_no_merge_coroutine_unawaited(two):
    # The run fails in the loop turn where the last replica arrives, before the async
    # merge_fn's task (made by the factory, wrapped) has started.
    async def merge_fn(strategy):
        await asyncio.sleep(0.01)

    async def step():
        ctx = aiodist.get_replica_context()
        if rid() == 0:
            ctx.merge_call(merge_fn).cancel()  # arrives, will not wait
            await asyncio.sleep(0)
            raise ValueError("replica 0 fails")
        await asyncio.sleep(0)
        return await ctx.merge_call(merge_fn)

    with task_factory(_wrapped_tasks("after return")):
        for _ in range(3):  # a warning would fail the test (filterwarnings = error)
            with pytest.raises(ValueError, match="replica 0 fails"):
                await two.run(step)
    gc.collect()


async def test_a_merge_fn_cancelled_before_its_tasks_step_cancels_what_it_awaits(two):
    # merge_fn awaits a child task in its (eager) first step; the run fails, and
    # cancels the merge task, before that task's first scheduled step: the child is
    # cancelled too, as asyncio cancels what a task awaits, and nothing is left.
    log = []

    async def child():
        try:
            await asyncio.sleep(0.2)
            log.append("child ran on")
        except asyncio.CancelledError:
            log.append("child cancelled")
            raise

    async def merge_fn(strategy):
        task = asyncio.create_task(child())
        try:
            await task
        except asyncio.CancelledError:
            log.append(f"merge_fn cancelled, child done: {task.done()}")
            raise

    async def step():
        ctx = aiodist.get_replica_context()
        if rid() == 0:
            ctx.merge_call(merge_fn).cancel()
            await asyncio.sleep(0)
            raise ValueError("replica 0 fails")
        await asyncio.sleep(0)
        return await ctx.merge_call(merge_fn)

    before = asyncio.all_tasks()
    with pytest.raises(ValueError, match="replica 0 fails"):
        await two.run(step)
    assert asyncio.all_tasks() == before
    await asyncio.sleep(0.25)
    assert log == ["merge_fn cancelled, child done: True"]  # (cancelled before it started)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_merge_fn_raising_stopiteration_fails_every_replica(two, kind):
    def sync_merge(strategy):
        return next(iter(()))

    async def async_merge(strategy):
        return next(iter(()))

    seen = {}

    async def step():
        try:
            return await aiodist.get_replica_context().merge_call(
                sync_merge if kind == "sync" else async_merge
            )
        except RuntimeError as exc:
            seen[rid()] = exc
            raise

    with pytest.raises(RuntimeError, match="StopIteration") as info:
        await two.run(step)
    assert sorted(seen) == [0, 1] and all(e is info.value for e in seen.values())
    assert isinstance(info.value.__cause__, StopIteration)
    if kind == "sync":  # (an async one's is Python's own, PEP 479's RuntimeError)
        assert isinstance(info.value, aiodist.RendezvousError)
        assert "catch it in the merge_fn, or raise another exception" in str(info.value)


def _plain_tasks(loop, coro, **kwargs):
    """A task factory making the tasks asyncio makes by default (never eager)."""
    kwargs.pop("eager_start", None)  # uvloop on Python 3.13 passes eager_start=None
    return asyncio.Task(coro, loop=loop, **kwargs)


async def test_collectives_started_and_never_awaited_log_nothing_when_the_run_fails(two, caplog):
    async def step():
        ctx = aiodist.get_replica_context()
        if rid() == 1:
            await asyncio.sleep(0)
            raise ValueError("boom")
        pending = ctx.all_reduce("sum", 1.0)  # started; awaited later
        await asyncio.sleep(0.01)
        return await pending

    for _ in range(2):  # (before the watchdog fix, the first run on a loop was never freed)
        with pytest.raises(ValueError, match="boom"):
            await two.run(step)
        gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_merge_call_never_awaited_logs_nothing_when_its_run_fails_meanwhile(two, caplog):
    # Replica 0 starts a merge_call and raises before awaiting it, while the async
    # merge_fn waits: the run fails with that error, merge_fn is cancelled, and the
    # call fails only after the run has closed its rendezvous (its result comes by a
    # callback that runs later). That failure is not logged as never retrieved.
    started = asyncio.Event()

    async def merge_fn(strategy):
        started.set()
        await asyncio.Event().wait()

    async def step():
        pending = aiodist.get_replica_context().merge_call(merge_fn)
        if rid() == 0:
            await started.wait()
            raise ValueError("boom")
        return await pending

    for _ in range(2):
        with pytest.raises(ValueError, match="boom"):
            await two.run(step)
        started.clear()
        await asyncio.sleep(0)  # the callback that fails the call
        gc.collect()
    assert "never retrieved" not in caplog.text


class _Lost(Exception):
    """A merge_fn's error that no replica awaits."""


@pytest.mark.parametrize(
    "failure", ["mismatch", "replica exit", "timeout", "merge_fn", "async merge_fn"]
)
async def test_a_collective_that_failed_unawaited_fails_the_run(failure, caplog):
    """SPEC §4: a collective is registered at the call and may be awaited later. When
    no replica ever awaits one that fails, run used to return normally and the error
    was lost (at most asyncio's "Future exception was never retrieved" in the log):
    run raises it, the first such one, and nothing is logged besides."""
    timeout = 0.02 if failure == "timeout" else None
    strategy = aiodist.MirroredStrategy(
        cpu_devices(2), communication_options=aiodist.CommunicationOptions(timeout_seconds=timeout)
    )
    raised = _Lost("from merge_fn")
    timed_out = asyncio.Event()

    def merge_fn(strategy):
        raise raised

    async def async_merge_fn(strategy):
        await asyncio.sleep(0)
        raise raised

    async def step():
        ctx = aiodist.get_replica_context()
        if failure == "mismatch":  # two failed calls: the first one's error is raised
            ctx.all_reduce("sum", np.ones(2 + rid()))
            ctx.all_reduce("max", np.ones(3 + rid()))
        elif failure == "replica exit" and rid() == 0:
            ctx.all_reduce("sum", 1.0)  # replica 1 returns without calling it
        elif failure == "timeout":
            if rid() == 0:
                pending = ctx.all_reduce("sum", 1.0)
                await wait_until(pending.done, "the call timed out")  # (not retrieved)
                timed_out.set()
            await timed_out.wait()  # replica 1 never calls it
        elif failure.endswith("merge_fn"):
            ctx.merge_call(merge_fn if failure == "merge_fn" else async_merge_fn)
        return rid()

    expected = {
        "mismatch": (aiodist.CollectiveMismatchError, r"collective #0 does not match"),
        "replica exit": (aiodist.ReplicaExitedError, r"all_reduce #0: replica 1 returned"),
        "timeout": (aiodist.RendezvousTimeoutError, r"all_reduce #0: timed out"),
        "merge_fn": (_Lost, "from merge_fn"),
        "async merge_fn": (_Lost, "from merge_fn"),
    }[failure]
    with pytest.raises(expected[0], match=expected[1]) as info:
        await strategy.run(step)
    if failure.endswith("merge_fn"):
        assert info.value is raised
    del info
    assert strategy.statistics().runs_in_flight == 0
    result = await strategy.run(lambda: aiodist.get_replica_context().all_reduce("sum", 1.0))
    assert [float(v) for v in strategy.experimental_local_results(result)] == [2.0, 2.0]
    gc.collect()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("then", ["returns after a loop turn", "awaits a later collective"])
async def test_an_async_merge_fn_failing_unawaited_after_the_replicas_meet_again(
    strategy, then, caplog
):
    """An async merge_fn that suspends, then raises, in a merge_call no replica
    awaits: its task could end before the run looked, with the call's delivery (a
    done callback) still queued. The run found no merge task left, closed its
    rendezvous, returned normally, and the error was only logged as "never
    retrieved" (on Python 3.11 when the replicas then awaited another collective; on
    3.12+ when they had suspended before the merge_call). It raises that error."""
    raised = _Lost("from merge_fn")

    async def async_merge_fn(strategy):
        await asyncio.sleep(0)
        raise raised

    async def step():
        ctx = aiodist.get_replica_context()
        if then == "returns after a loop turn":
            await asyncio.sleep(0)
            ctx.merge_call(async_merge_fn)  # never awaited
        else:
            ctx.merge_call(async_merge_fn)  # never awaited
            await ctx.all_gather(np.ones((1, 2)), axis=0)
        return rid()

    for _ in range(2):
        with pytest.raises(_Lost) as info:
            await strategy.run(step)
        assert info.value is raised
        del info
        assert strategy.statistics().runs_in_flight == 0
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_collective_failure_some_replica_saw_does_not_fail_the_run(two, caplog):
    """A failed collective that a replica awaited (and handled) is not lost: only
    errors no replica retrieved fail a run that every replica returned from. Nor does
    a collective that succeeded unawaited."""
    seen = []

    async def step():
        ctx = aiodist.get_replica_context()
        ctx.all_reduce("sum", 1.0)  # never awaited, succeeds
        pending = ctx.all_reduce("sum", np.ones(2 + rid()))  # a mismatch
        if rid() == 0:
            with contextlib.suppress(aiodist.CollectiveMismatchError):
                await pending
            seen.append(rid())
        return rid()

    assert two.experimental_local_results(await two.run(step)) == (0, 1)
    assert seen == [0]
    gc.collect()  # replica 1's future of that failure: handled, so not logged
    assert "never retrieved" not in caplog.text


async def test_a_failure_read_by_a_done_callback_does_not_fail_the_run(two, caplog):
    """A failed collective whose error a done callback reads was retrieved: the run
    returns. On Python 3.12+ the replicas return in their eager first steps, before
    any loop turn, so run must let the queued callbacks run before it decides (it
    raised the error there, and returned on 3.11)."""
    handled = []

    async def step():
        pending = aiodist.get_replica_context().all_reduce("sum", np.ones(2 + rid()))
        pending.add_done_callback(lambda future: handled.append(type(future.exception())))
        return rid()

    assert two.experimental_local_results(await two.run(step)) == (0, 1)
    assert handled == [aiodist.CollectiveMismatchError] * 2
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_failed_run_is_freed_at_once_while_stall_reports_are_armed(two):
    """The stall watchdog's timer is armed from the first replica's collective; it must
    not keep that replica's context, and with it the run, its failure's traceback and
    the replicas' arrays, alive until it fires."""
    alive = []

    async def step():
        local = np.ones(4)
        alive.append(weakref.ref(local))
        if rid() == 1:
            await asyncio.sleep(0)
            raise ValueError("boom")
        await aiodist.get_replica_context().all_reduce("sum", 1.0)

    # Not pytest.raises: its ExceptionInfo would keep the traceback's frames.
    with contextlib.suppress(ValueError):
        await two.run(step)
    for _ in range(3):  # the run's last callbacks (its replicas' exits) run
        await asyncio.sleep(0)
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True]


async def test_failed_merge_calls_in_the_default_context_are_not_kept():
    """The default replica context's group lives as long as the process: a failed call
    there must not be remembered (its arguments, its error) once it has been raised."""

    def merge_fn(strategy, value):
        raise ValueError("refused")

    ctx = aiodist.get_replica_context()
    refs = []
    for _ in range(3):
        value = np.ones(4)
        refs.append(weakref.ref(value))
        with pytest.raises(ValueError, match="refused"):
            await ctx.merge_call(merge_fn, args=(value,))
        del value
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True, True]


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
async def test_a_merge_fn_raising_system_exit_in_the_default_context_is_not_logged(
    caplog, exc_type
):
    """Outside any strategy, a merge_fn raising SystemExit (or KeyboardInterrupt)
    makes merge_call raise it at once, the same object, as asyncio lets these
    through. The call's future holds it too, and nothing reads that future, nor
    ever closes the default context's group: asyncio logged "Future exception was
    never retrieved" for what the caller had already got."""
    raised = []

    def merge_fn(strategy):
        raised.append(exc_type(3))
        raise raised[0]

    with pytest.raises(exc_type) as info:
        await aiodist.get_replica_context().merge_call(merge_fn)
    assert info.value is raised.pop()
    del info  # (the error's traceback holds the frame that made the future)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_an_async_merge_fn_in_the_default_context_stops_when_its_caller_does():
    """Outside any strategy the caller is the merge_fn's only waiter: when it stops
    waiting (here asyncio.timeout), the merge_fn is cancelled instead of running on
    in the background; a caller that waits gets the result as before."""
    events = []

    async def slow_merge(strategy):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("finished")

    ctx = aiodist.get_replica_context()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await ctx.merge_call(slow_merge)
    for _ in range(3):
        await asyncio.sleep(0)
    assert events == ["cancelled"]
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    async def quick_merge(strategy, x):
        await asyncio.sleep(0)
        return x + 1

    assert await ctx.merge_call(quick_merge, args=(1,)) == 2


async def test_a_default_context_merge_fn_is_cancelled_with_its_caller_whatever_other_threads_do():
    """The default replica context serves every thread. Between the making of an
    async merge_fn's task and its caller's future being tied to it, another
    thread's merge_call there took the task (it was kept on the one default group,
    shared by every thread) and the caller found none: when the caller stopped
    waiting, its merge_fn ran on. Here the other thread's call is made at that point
    for certain: from the merge task's add_done_callback (a task factory's Task),
    which the main thread calls while it makes the call, and waits in."""
    ctx = aiodist.get_replica_context()

    async def other_threads_call():
        return await ctx.merge_call(lambda strategy: "other")

    calling = []  # while merge_call is called

    class CallingOtherThread(asyncio.Task):
        def add_done_callback(self, fn, *, context=None):
            if calling:
                other = calling[0].submit(asyncio.run, other_threads_call())
                assert other.result(10) == "other"
            super().add_done_callback(fn, context=context)

    def factory(loop, coro, **kwargs):
        return CallingOtherThread(coro, loop=loop, **kwargs)

    events = []

    async def slow_merge(strategy):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    with concurrent.futures.ThreadPoolExecutor(1) as other_thread, task_factory(factory):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                calling.append(other_thread)
                pending = ctx.merge_call(slow_merge)
                calling.clear()
                await pending
    await wait_until(lambda: events, "merge_fn cancelled", max_iterations=10)
    assert events == ["cancelled"]
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_an_async_merge_fn_suspended_in_its_first_step_is_cancelled_with_its_run(two):
    """The run is cancelled in the loop iteration of the last arrival: the async
    merge_fn's first step has run (eagerly) and suspended, and its task has not
    stepped again. CancelledError reaches merge_fn where it waits, in its own task,
    so its cleanup runs, as a replica's does."""
    cleaned = []

    async def merge_fn(strategy):
        first = asyncio.current_task()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cleaned.append(asyncio.current_task() is first)
            raise

    async def step():
        if rid() == 1:  # the last to arrive
            await asyncio.sleep(0)
        return await aiodist.get_replica_context().merge_call(merge_fn)

    for _ in range(3):  # a warning would fail the test (filterwarnings = error)
        task = asyncio.create_task(two.run(step))
        await asyncio.sleep(0)  # replica 0 arrives
        await asyncio.sleep(0)  # replica 1 arrives: merge_fn's first step runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    gc.collect()
    assert cleaned == [True] * 3
