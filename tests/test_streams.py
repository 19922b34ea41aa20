"""The device/stream seam: activation on every step, cross-replica bracketing.

CuPy's current stream is thread-local; here a plain module-level "current
stream" plays that role, so the hooks are checked on CPU-only machines. The
tracking backend below is a real backend (it subclasses the CPU one and only
adds stream bookkeeping), driven by the real scheduler.
"""

from __future__ import annotations

import asyncio
import gc
import sys

import numpy as np
import pytest

import aiodist
from aiodist._backends import CpuBackend
from aiodist._devices import Device
from aiodist._scheduler import ReplicaSlot, RunGroup
from aiodist._streams import drive
from tests.conftest import task_factory


class TrackingBackend(CpuBackend):
    """CPU arrays, plus a thread-local-like 'current stream' switched on every step."""

    needs_activation = True

    def __init__(self):
        self.current = "default"
        self.activations = 0
        self.cross_replica = []
        self.run_order = []  # (which, activations so far) for a run's own ordering

    def new_stream(self, device):
        return f"stream-{device.index}"

    def activate(self, device, stream):
        previous, self.current = self.current, stream
        self.activations += 1
        return previous

    def deactivate(self, token):
        self.current = token

    def begin_cross_replica(self, slots, first=None):
        self.cross_replica.append(("begin", self.current))
        return len(self.cross_replica)

    def enter_cross_replica(self, token):
        previous, self.current = self.current, "cross"
        return previous

    def leave_cross_replica(self, saved):
        self.current = saved

    def end_cross_replica(self, token, slots):
        self.cross_replica.append(("end", token))

    def order_replicas_after(self, slots):
        self.run_order.append(("replicas after current", self.activations))

    def order_after_replicas(self, slots):
        self.run_order.append(("current after replicas", self.activations))


async def test_drive_activates_around_every_step_only():
    backend = TrackingBackend()
    seen_inside, seen_outside = [], []

    async def replica():
        for _ in range(5):
            seen_inside.append(backend.current)
            await asyncio.sleep(0)
        return "result"

    async def bystander():
        for _ in range(10):
            seen_outside.append(backend.current)
            await asyncio.sleep(0)

    device = Device("CPU", 0)
    result, _ = await asyncio.gather(
        drive(replica(), lambda: backend.activate(device, "s0"), backend.deactivate),
        bystander(),
    )
    assert result == "result"
    assert seen_inside == ["s0"] * 5
    assert set(seen_outside) == {"default"}
    assert backend.current == "default"
    assert backend.activations == 6  # the start and 5 resumes


async def test_drive_forwards_exceptions_and_cancellation_under_activation():
    backend = TrackingBackend()
    device = Device("CPU", 0)
    in_handler = []

    async def replica():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            in_handler.append(backend.current)
            raise

    task = asyncio.ensure_future(
        drive(replica(), lambda: backend.activate(device, "s1"), backend.deactivate)
    )
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert in_handler == ["s1"]
    assert backend.current == "default"

    async def failing():
        await asyncio.sleep(0)
        raise KeyError("x")

    with pytest.raises(KeyError):
        await drive(failing(), lambda: backend.activate(device, "s2"), backend.deactivate)
    assert backend.current == "default"


async def test_drive_closes_the_coroutine_when_activation_fails():
    """activate() raising (say, setting the device fails) ends the replica's
    coroutine at once: unstarted, it was left "never awaited" (a RuntimeWarning at
    garbage collection); suspended, its finally blocks ran only whenever it was
    collected, not as the failure propagated."""
    backend = TrackingBackend()
    device = Device("CPU", 0)
    events = []

    async def replica():
        try:
            await asyncio.sleep(0)
            events.append("resumed")
        finally:
            events.append("finally")

    def failing(after: int):
        calls = [0]

        def activate():
            calls[0] += 1
            if calls[0] > after:
                raise RuntimeError("cannot make the device current")
            return backend.activate(device, "s3")

        return activate

    unraisable = []  # (a "never awaited" warning is raised where it cannot propagate)
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        for after, expected in ((0, []), (1, ["finally"])):  # its first step; its resume
            events.clear()
            coro = replica()
            with pytest.raises(RuntimeError, match="cannot make the device current"):
                await drive(coro, failing(after), backend.deactivate)
            assert coro.cr_frame is None, "the coroutine was left open"
            assert events == expected
            assert backend.current == "default"
        del coro
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []


def _tracked_group(backend: TrackingBackend) -> RunGroup:
    """A run of two CPU replicas whose slots use ``backend`` (its streams)."""
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
    slots = tuple(
        ReplicaSlot(i, Device("CPU", i), backend, backend.new_stream(Device("CPU", i)))
        for i in range(2)
    )
    return RunGroup(strategy, slots)


async def test_scheduler_runs_each_replica_on_its_stream_and_brackets_collectives():
    backend = TrackingBackend()
    group = _tracked_group(backend)
    observed = {0: [], 1: []}

    async def fn():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        for _ in range(3):
            observed[rid].append(backend.current)
            await asyncio.sleep(0)
            observed[rid].append(backend.current)
            await ctx.all_reduce("sum", np.ones(2))
        await ctx.merge_call(lambda s: None)
        observed[rid].append(backend.current)
        return rid

    assert await group.run(fn, (), {}) is not None
    assert set(observed[0]) == {"stream-0"}
    assert set(observed[1]) == {"stream-1"}
    assert backend.current == "default"
    # 3 all_reduces and one merge_call, each bracketed once.
    assert [kind for kind, _ in backend.cross_replica] == ["begin", "end"] * 4
    # The run itself: after the caller's queued work (before any replica step), and
    # the caller's later work after the replicas' (once every step is done).
    assert backend.run_order == [
        ("replicas after current", 0),
        ("current after replicas", backend.activations),
    ]


@pytest.mark.parametrize("kind", ["coroutine", "future"])
async def test_a_task_factory_failing_for_a_merge_fn_ends_its_cross_replica_work(kind):
    # The merge_fn's coroutine (or the future it returned) runs under wrappers that
    # put it on the cross streams; with no task for it, all are closed unawaited and
    # the cross-replica work begun for it is ended, as when merge_fn itself raises.
    backend = TrackingBackend()
    group = _tracked_group(backend)
    loop = asyncio.get_running_loop()

    def factory(loop, coro, *, context=None, **kwargs):
        if context.run(aiodist.in_cross_replica_context):
            raise RuntimeError("no task for merge_fn")
        return asyncio.Task(coro, loop=loop, context=context, **kwargs)

    async def merge_coroutine(strategy):
        return 1

    def merge_future(strategy):
        future = loop.create_future()
        future.set_result(1)
        return future

    merge_fn = merge_coroutine if kind == "coroutine" else merge_future

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    with task_factory(factory), pytest.raises(RuntimeError, match="no task for merge_fn"):
        await group.run(fn, (), {})
    assert [kind for kind, _ in backend.cross_replica] == ["begin", "end"]


async def test_replicas_of_another_backend_place_numpy_scalars_with_it():
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", np.float32(1))

    # An ordinary run first: its host replicas remember how float32 scalars reduce.
    await aiodist.MirroredStrategy(["cpu:0", "cpu:1"]).run(fn)

    class Placing(TrackingBackend):
        def asarray(self, value, device):
            self.placed.append(device.index)
            return super().asarray(value, device)

    backend = Placing()
    backend.placed = []
    result = await _tracked_group(backend).run(fn, (), {})
    assert sorted(backend.placed) == [0, 1]  # each replica's scalar, through its backend
    assert [float(v) for v in result.values] == [2.0, 2.0]


async def test_async_merge_fn_steps_on_the_cross_streams_and_only_there():
    backend = TrackingBackend()
    in_merge, bystander, after = [], [], []
    stop = asyncio.Event()

    async def merge_fn(strategy):
        for _ in range(3):
            in_merge.append(backend.current)
            await asyncio.sleep(0)
        in_merge.append(backend.current)
        return "merged"

    async def fn():
        result = await aiodist.get_replica_context().merge_call(merge_fn)
        after.append(backend.current)
        return result

    async def watch():
        while not stop.is_set():
            bystander.append(backend.current)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        assert await _tracked_group(backend).run(fn, (), {}) == "merged"
    finally:
        stop.set()
        await watcher
    assert in_merge == ["cross"] * 4
    assert set(bystander) == {"default"}
    assert sorted(after) == ["stream-0", "stream-1"]
    assert backend.current == "default"
    # Ordered once: begun when the last replica arrived, ended when merge_fn finished.
    assert [kind for kind, _ in backend.cross_replica] == ["begin", "end"]


async def test_ready_returns_its_value_at_once_without_gpus():
    value = {"x": np.ones(2)}
    assert await aiodist.ready(value) is value
    assert await aiodist.ready() is None
