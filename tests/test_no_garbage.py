"""A finished run leaves no cyclic garbage (group -> task -> context -> group cycles).

Cycles would make every run wait for the garbage collector, which costs time on
every step (issue 6); reference counting must free a run as soon as it ends.
"""

from __future__ import annotations

import gc

import numpy as np

import aiodist


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

    for fn in (constant, reduce, merge):
        for _ in range(20):  # warm-up: caches, first-use objects
            await strategy.run(fn)
        gc.collect()
        gc.disable()
        try:
            for _ in range(200):
                await strategy.run(fn)
            assert gc.collect() == 0, f"{fn.__name__} runs left cyclic garbage"
        finally:
            gc.enable()
