import numpy as np

import aiodist


async def test_all_reduce_sums_over_replicas(strategy, num_replicas):
    async def step():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", np.float32(ctx.replica_id_in_sync_group + 1))

    result = await strategy.run(step)
    expected = num_replicas * (num_replicas + 1) / 2
    assert [float(v) for v in strategy.experimental_local_results(result)] == [
        expected
    ] * num_replicas
