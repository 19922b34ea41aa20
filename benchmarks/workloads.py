"""aiodist workloads and the same-run baselines they are judged against.

Each ``measure_*`` coroutine runs one workload for ``steps`` steps on the running
loop and returns seconds per step. Workloads (issue 6):

(a) ``strategy.run`` of a function returning a constant: scheduling cost;
(b) one ``all_reduce(SUM, scalar)`` per step;
(c) one ``merge_call`` whose merge_fn awaits ``strategy.reduce(SUM, v, axis=None)``;
(d) ``all_reduce(SUM, x)`` of 1/16/64 MiB float32 per replica;
(e) one batched ``all_reduce`` of 100 float32 tensors of 1 KiB;
(f) 64 concurrent ``strategy.run`` calls each doing (b): seconds per run (and, for
    the scaling table, 1 to 256 in flight beside the floor's steps in flight);
(g) (b) while a trace is recorded: the cost of tracing (with tracing off, (b)
    itself carries every hook, so (b) is also the "tracing off" figure).

Baselines measured in the same process:

- floor (a): N bare tasks created and awaited, nothing else;
- floor (b)/(c): N bare tasks meeting at one plain future, the last arrival
  adding the N NumPy scalars;
- NumPy (d): ``np.add.reduce`` over the N stacked arrays (one thread), as issue 6
  defines it: a new result array per call, its page faults included (reusing one
  with ``out=`` makes it about a third faster at 64 MiB; aiodist reuses its result
  buffers, one of the things the (d) target asks for).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

import aiodist

MIB = 1 << 20


def strategy_for(n: int) -> aiodist.MirroredStrategy:
    return aiodist.MirroredStrategy([f"cpu:{i}" for i in range(n)])


async def _timed(step, steps: int) -> float:
    for _ in range(max(1, steps // 10)):  # warm-up
        await step()
    start = time.perf_counter()
    for _ in range(steps):
        await step()
    return (time.perf_counter() - start) / steps


# -- (a) ---------------------------------------------------------------------------


async def measure_a(n: int, steps: int) -> float:
    strategy = strategy_for(n)

    def constant():
        return 1.0

    return await _timed(lambda: strategy.run(constant), steps)


async def floor_a(n: int, steps: int) -> float:
    loop = asyncio.get_running_loop()

    async def constant():
        return 1.0

    async def step():
        tasks = [loop.create_task(constant()) for _ in range(n)]
        for task in tasks:
            await task

    return await _timed(step, steps)


# -- (b), (c) ------------------------------------------------------------------------


async def measure_b(n: int, steps: int) -> float:
    strategy = strategy_for(n)
    one = np.float32(1.0)

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", one)

    return await _timed(lambda: strategy.run(fn), steps)


async def measure_b_traced(n: int, steps: int) -> float:
    """(b) while ``aiodist.trace`` records (the file goes to a temporary directory)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        with aiodist.trace(Path(folder) / "trace.json"):
            return await measure_b(n, steps)


async def measure_c(n: int, steps: int) -> float:
    strategy = strategy_for(n)
    one = np.float32(1.0)

    async def merge_fn(strategy, value):
        return await strategy.reduce("sum", value, axis=None)

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn, args=(one + 0,))

    return await _timed(lambda: strategy.run(fn), steps)


async def floor_bc(n: int, steps: int) -> float:
    """N bare tasks meet at one future; the last arrival reduces the N scalars."""
    loop = asyncio.get_running_loop()
    return await _timed(lambda: _floor_meeting(loop, n), steps)


async def _floor_meeting(loop: asyncio.AbstractEventLoop, n: int) -> None:
    """One step of the (b)/(c) floor: N bare tasks meeting at one plain future."""
    one = np.float32(1.0)
    arrived: list = []
    meeting = loop.create_future()

    async def replica():
        arrived.append(one)
        if len(arrived) == n:
            meeting.set_result(np.add.reduce(arrived))
        return await meeting

    tasks = [loop.create_task(replica()) for _ in range(n)]
    for task in tasks:
        await task


# -- (d) -----------------------------------------------------------------------------


async def measure_d(n: int, mib: int, steps: int) -> float:
    strategy = strategy_for(n)
    count = mib * MIB // 4
    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(count, ctx.replica_id_in_sync_group, dtype=np.float32)
    )

    async def fn(x):
        return await aiodist.get_replica_context().all_reduce("sum", x)

    return await _timed(lambda: strategy.run(fn, args=(inputs,)), steps)


def numpy_reduce_d(n: int, mib: int, steps: int) -> float:
    count = mib * MIB // 4
    stacked = np.stack([np.full(count, i, dtype=np.float32) for i in range(n)])
    np.add.reduce(stacked, axis=0)
    start = time.perf_counter()
    for _ in range(steps):
        np.add.reduce(stacked, axis=0)
    return (time.perf_counter() - start) / steps


# -- (e), (f) ------------------------------------------------------------------------


async def measure_e(n: int, steps: int) -> float:
    strategy = strategy_for(n)
    # Each replica its own 100 arrays, as TF's per-device tensors (one list shared by
    # every replica would stay in cache: about 12% faster than the fair figure).
    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: [np.ones(256, dtype=np.float32) for _ in range(100)]
    )

    async def fn(values):
        return await aiodist.get_replica_context().all_reduce("sum", values)

    return await _timed(lambda: strategy.run(fn, args=(inputs,)), steps)


async def measure_f(n: int, steps: int, concurrent: int = 64) -> float:
    """Seconds per run while ``concurrent`` runs of (b) are in flight."""
    strategy = strategy_for(n)
    one = np.float32(1.0)

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", one)

    return await _in_flight(lambda: strategy.run(fn), steps, concurrent)


async def floor_f(n: int, steps: int, concurrent: int = 64) -> float:
    """(f)'s floor: seconds per (b)-floor step while ``concurrent`` are in flight."""
    loop = asyncio.get_running_loop()
    return await _in_flight(lambda: _floor_meeting(loop, n), steps, concurrent)


async def _in_flight(start, steps: int, concurrent: int) -> float:
    """Seconds per ``start()`` awaitable while ``concurrent`` of them are in flight."""

    async def batch():
        await asyncio.gather(*(start() for _ in range(concurrent)))

    rounds = max(1, steps // concurrent)
    return await _timed(batch, rounds) / concurrent
