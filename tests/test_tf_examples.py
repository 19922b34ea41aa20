"""The TensorFlow docstring examples, reproduced with aiodist and the same numbers.

Each test names the TensorFlow document and example it reproduces (the copies are in
``shared/reference/``). TensorFlow's ``MirroredStrategy(["GPU:0", "GPU:1"])`` becomes
``MirroredStrategy(["cpu:0", "cpu:1"])`` (four GPUs become four CPU devices), tensors
become NumPy arrays of the dtype TensorFlow shows, replica functions are ``async def``,
and ``merge_call``/``all_reduce``/``all_gather``/``run``/``reduce``/``gather`` are awaited.
Where a TensorFlow example reads a ``tf.data`` dataset, the dataset becomes a list of
global batches given to ``experimental_distribute_dataset`` (some tests also make the same
per-replica values with ``experimental_distribute_values_from_function``). Examples that
need what aiodist has no counterpart for (TPUs, ``CentralStorageStrategy``, parameter
servers, TF 1 only APIs, ``tf.device``) are left out, or run on a ``MirroredStrategy``
where only the strategy is TPU-specific.
"""

from __future__ import annotations

import numpy as np
import pytest

import aiodist
from aiodist import PerReplica

# -- helpers ---------------------------------------------------------------------------


def assert_tensor(value, expected, dtype) -> None:
    """``value`` equals ``expected`` with the shape and dtype TensorFlow shows."""
    array = np.asarray(value)
    expected = np.asarray(expected, dtype=dtype)
    assert array.shape == expected.shape, f"shape {array.shape} != {expected.shape}"
    assert array.dtype == expected.dtype, f"dtype {array.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(array, expected)


def assert_two_lists(local, first, second, dtype) -> None:
    """``local`` (``experimental_local_results`` on two replicas) holds one
    two-element list per replica: ``[first, second]`` as TensorFlow shows them."""
    assert isinstance(local, tuple)
    assert len(local) == 2, f"expected one list per replica, got {local!r}"
    for per_replica in local:
        assert isinstance(per_replica, list)
        assert len(per_replica) == 2
        assert_tensor(per_replica[0], first, dtype)
        assert_tensor(per_replica[1], second, dtype)


def assert_per_replica(value, expected: list, dtype) -> None:
    """``value`` is a PerReplica whose components equal ``expected`` (one per replica)."""
    assert isinstance(value, PerReplica), f"expected PerReplica, got {type(value).__name__}"
    assert len(value.values) == len(expected)
    for component, want in zip(value.values, expected, strict=True):
        assert_tensor(component, want, dtype)


async def replica_id():
    """The replica function of several TF examples: this replica's id."""
    return aiodist.get_replica_context().replica_id_in_sync_group


# -- tf.distribute.ReplicaContext ------------------------------------------------------


async def test_replica_context_class_example_returns_replica_ids(two):
    """tf.distribute.ReplicaContext (class docstring; also ``ReplicaContextBase`` in
    distribute_lib.py): ``strategy.run(func)`` where ``func`` returns
    ``replica_context.replica_id_in_sync_group`` gives ``PerReplica:{0: 0, 1: 1}``."""

    async def func():
        replica_context = aiodist.get_replica_context()
        return replica_context.replica_id_in_sync_group

    result = await two.run(func)

    assert isinstance(result, PerReplica)
    assert result.values == (0, 1)
    assert result.devices == ("/device:CPU:0", "/device:CPU:1")
    assert two.experimental_local_results(result) == (0, 1)


async def test_replica_context_class_example_any_replica_count(strategy, num_replicas):
    """tf.distribute.ReplicaContext (class docstring), on 1, 2 and 4 replicas: ids are
    0 .. n-1 as a PerReplica; with one replica ``run`` returns the plain value 0."""
    result = await strategy.run(replica_id)

    if num_replicas == 1:
        assert not isinstance(result, aiodist.DistributedValues)
        assert result == 0
    else:
        assert isinstance(result, PerReplica)
        assert result.values == tuple(range(num_replicas))
    assert strategy.experimental_local_results(result) == tuple(range(num_replicas))


async def test_replica_context_all_reduce_sum_of_one(two):
    """tf.distribute.ReplicaContext.all_reduce, example 1: SUM of ``tf.identity(1.)``
    on two replicas; ``experimental_local_results`` gives ``(2.0, 2.0)`` (float32)."""

    async def step_fn():
        ctx = aiodist.get_replica_context()
        value = np.float32(1.0)
        return await ctx.all_reduce(aiodist.ReduceOp.SUM, value)

    result = await two.run(step_fn)
    local = two.experimental_local_results(result)

    assert isinstance(result, PerReplica)  # each replica gets its own result object
    assert isinstance(local, tuple)
    assert len(local) == 2
    for value in local:
        assert_tensor(value, 2.0, np.float32)


async def test_replica_context_all_reduce_batched_list_local_results(two):
    """tf.distribute.ReplicaContext.all_reduce, example 2 (batched): SUM of the list
    ``[tf.identity(1.), tf.identity(2.)]``; TF's ``experimental_local_results`` of the
    run result (a list of PerReplica) is one list per replica: ``([2.0, 4.0], [2.0, 4.0])``."""

    async def step_fn():
        ctx = aiodist.get_replica_context()
        value1 = np.float32(1.0)
        value2 = np.float32(2.0)
        return await ctx.all_reduce(aiodist.ReduceOp.SUM, [value1, value2])

    local = two.experimental_local_results(await two.run(step_fn))

    assert_two_lists(local, 2.0, 4.0, np.float32)


async def test_replica_context_all_reduce_batched_list_run_result(two):
    """tf.distribute.ReplicaContext.all_reduce, example 2 (batched): each replica gets
    ``[2.0, 4.0]``, so ``run`` returns a list of two PerReplica values, as in TF."""

    async def step_fn():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("SUM", [np.float32(1.0), np.float32(2.0)])

    result = await two.run(step_fn)

    assert isinstance(result, list)
    assert len(result) == 2
    assert_per_replica(result[0], [2.0, 2.0], np.float32)
    assert_per_replica(result[1], [4.0, 4.0], np.float32)


# -- ReplicaContext.all_gather (distribute_lib.py) -------------------------------------


async def test_all_gather_single_tensor(two):
    """ReplicaContext.all_gather (distribute_lib.py), single tensor: every replica
    gathers ``tf.constant([1, 2, 3])`` along axis 0 and gets ``[1, 2, 3, 1, 2, 3]``
    (shape (6,), int32), returned as a PerReplica."""

    async def gather_value():
        ctx = aiodist.get_replica_context()
        local_value = np.array([1, 2, 3], dtype=np.int32)
        return await ctx.all_gather(local_value, axis=0)

    result = await two.run(gather_value)

    assert_per_replica(result, [[1, 2, 3, 1, 2, 3]] * 2, np.int32)
    local = two.experimental_local_results(result)
    assert isinstance(local, tuple)
    assert len(local) == 2
    for value in local:
        assert_tensor(value, [1, 2, 3, 1, 2, 3], np.int32)


async def gather_nest():
    """The replica function of the nested all_gather example."""
    ctx = aiodist.get_replica_context()
    value_1 = np.array([1, 2, 3], dtype=np.int32)
    value_2 = np.array([[1, 2], [3, 4]], dtype=np.int32)
    return await ctx.all_gather([value_1, value_2], axis=0)


GATHERED_1 = [1, 2, 3, 1, 2, 3]
GATHERED_2 = [[1, 2], [3, 4], [1, 2], [3, 4]]


async def test_all_gather_nested_list_run_result(two):
    """ReplicaContext.all_gather (distribute_lib.py), nested list ``[value_1, value_2]``:
    ``run`` returns ``[PerReplica(shape (6,)), PerReplica(shape (4, 2))]``."""
    result = await two.run(gather_nest)

    assert isinstance(result, list)
    assert len(result) == 2
    assert_per_replica(result[0], [GATHERED_1] * 2, np.int32)
    assert_per_replica(result[1], [GATHERED_2] * 2, np.int32)
    assert result[1].values[0].shape == (4, 2)


async def test_all_gather_nested_list_local_results(two):
    """ReplicaContext.all_gather (distribute_lib.py), nested list: TF's
    ``experimental_local_results(result)`` is one ``[shape (6,), shape (4, 2)]`` list per
    replica."""
    local = two.experimental_local_results(await two.run(gather_nest))

    assert_two_lists(local, GATHERED_1, GATHERED_2, np.int32)


# -- StrategyExtended.call_for_each_replica (distribute_lib.py) ------------------------


def merge_fn(distribution, three_plus_replica_id):
    """Called once in cross-replica context: sum the values across replicas."""
    merge_fn.calls += 1
    assert aiodist.in_cross_replica_context()
    return sum(distribution.experimental_local_results(three_plus_replica_id))


merge_fn.calls = 0


async def fn(three):
    """Called once per replica: ``v = three + id``; return ``sum(v over replicas) + v``."""
    replica_ctx = aiodist.get_replica_context()
    v = three + replica_ctx.replica_id_in_sync_group
    s = await replica_ctx.merge_call(merge_fn, args=(v,))
    return s + v


async def test_call_for_each_replica_merge_call_example(two):
    """StrategyExtended.call_for_each_replica (distribute_lib.py): with ``args=[3]`` on
    two replicas, v is 3 and 4, merge_fn runs once and returns 7, and each replica
    returns 7 + v, so ``experimental_local_results(merged_results)`` is ``(10, 11)``."""
    merge_fn.calls = 0
    with two.scope():
        merged_results = await two.extended.call_for_each_replica(fn, args=[3])
        local = two.experimental_local_results(merged_results)

    assert merge_fn.calls == 1
    assert isinstance(merged_results, PerReplica)
    assert local == (10, 11)


async def test_call_for_each_replica_example_through_run(two):
    """StrategyExtended.call_for_each_replica (distribute_lib.py), as the docstring
    writes it: ``distribution.run(fn, args=[3])`` inside ``distribution.scope()``
    gives ``(10, 11)`` on two replicas."""
    merge_fn.calls = 0
    with two.scope():
        merged_results = await two.run(fn, args=[3])
        local = two.experimental_local_results(merged_results)

    assert merge_fn.calls == 1
    assert local == (10, 11)


async def test_call_for_each_replica_example_any_replica_count(strategy, num_replicas):
    """StrategyExtended.call_for_each_replica (distribute_lib.py) on 1, 2 and 4
    replicas: replica i returns ``sum(3 + j for all j) + 3 + i`` (1 replica: plain 6;
    4 replicas: 21, 22, 23, 24)."""
    merge_fn.calls = 0
    total = sum(3 + j for j in range(num_replicas))
    expected = tuple(total + 3 + i for i in range(num_replicas))

    with strategy.scope():
        merged_results = await strategy.extended.call_for_each_replica(fn, args=[3])

    assert merge_fn.calls == 1
    if num_replicas == 1:
        assert not isinstance(merged_results, aiodist.DistributedValues)
        assert merged_results == 6
    assert strategy.experimental_local_results(merged_results) == expected


# -- Strategy.run (distribute_lib.py) --------------------------------------------------


async def test_run_example_1_constant_tensor_input(two):
    """Strategy.run, example 1 (constant tensor input): ``tf.constant(3.0)`` passed to
    ``replica_fn(input) = input * 2.0`` on two replicas gives ``PerReplica:{0: 6.0,
    1: 6.0}`` (float32)."""
    tensor_input = np.float32(3.0)

    async def replica_fn(input):
        return input * 2.0

    result = await two.run(replica_fn, args=(tensor_input,))

    assert_per_replica(result, [6.0, 6.0], np.float32)


async def test_run_example_2_distributed_values_input(two):
    """Strategy.run, example 2 (DistributedValues input): ``num_replicas_in_sync`` (2)
    distributed from a function, times 2, gives the single value 4 (not a PerReplica,
    since every replica returns the same value)."""

    def value_fn(value_context):
        return value_context.num_replicas_in_sync

    distributed_values = two.experimental_distribute_values_from_function(value_fn)

    async def replica_fn2(input):
        return input * 2

    result = await two.run(replica_fn2, args=(distributed_values,))

    assert not isinstance(result, aiodist.DistributedValues)
    assert type(result) is int
    assert result == 4


async def test_run_example_3_all_reduce_of_replica_ids(two):
    """Strategy.run, example 3 (ReplicaContext all-reduce): all-reducing
    ``tf.constant(replica_id)`` with "sum" gives ``PerReplica:{0: 1, 1: 1}`` (int32)."""

    def value_fn(value_context):
        return np.int32(value_context.replica_id_in_sync_group)

    distributed_values = two.experimental_distribute_values_from_function(value_fn)

    async def replica_fn(input):
        return await aiodist.get_replica_context().all_reduce("sum", input)

    result = await two.run(replica_fn, args=(distributed_values,))

    assert_per_replica(result, [1, 1], np.int32)


# -- Strategy.reduce (distribute_lib.py) -----------------------------------------------


async def test_reduce_sum_of_replica_ids_axis_none(two):
    """Strategy.reduce, docstring example: ``strategy.reduce("SUM", per_replica_result,
    axis=None)`` of the replica ids (``tf.identity(i)``, int32) is 1 (shape (), int32);
    the per-replica results are on the replicas' devices and the total on the host."""

    async def step_fn():
        i = aiodist.get_replica_context().replica_id_in_sync_group
        return np.int32(i)

    per_replica_result = await two.run(step_fn)
    total = await two.reduce("SUM", per_replica_result, axis=None)

    assert per_replica_result.devices == ("/device:CPU:0", "/device:CPU:1")
    assert isinstance(total, np.ndarray)  # on the host, like TF's CPU:0 result
    assert_tensor(total, 1, np.int32)


def per_example_values(strategy, batches):
    """A PerReplica whose replica i holds ``batches[i]`` (float32)."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.asarray(batches[ctx.replica_id_in_sync_group], dtype=np.float32)
    )


async def test_reduce_axis_none_sums_only_across_replicas(two):
    """Strategy.reduce, "What should axis be?": global batch of 8 on 2 replicas,
    examples ``[0, 1, 2, 3]`` and ``[4, 5, 6, 7]``; ``axis=None`` gives
    ``[0+4, 1+5, 2+6, 3+7]`` = ``[4, 6, 8, 10]``."""
    per_replica_result = per_example_values(two, [[0, 1, 2, 3], [4, 5, 6, 7]])

    reduced = await two.reduce("sum", per_replica_result, axis=None)

    assert_tensor(reduced, [4.0, 6.0, 8.0, 10.0], np.float32)


async def test_reduce_axis_0_sums_across_batch_and_replicas(two):
    """Strategy.reduce, "What should axis be?": the same values with ``axis=0`` give
    the scalar ``0+1+2+3+4+5+6+7`` = 28."""
    per_replica_result = per_example_values(two, [[0, 1, 2, 3], [4, 5, 6, 7]])

    reduced = await two.reduce("sum", per_replica_result, axis=0)

    assert_tensor(reduced, 28.0, np.float32)


async def test_reduce_mean_axis_0_uneven_last_batch(two):
    """Strategy.reduce, "What should axis be?": a last batch of 6 split into
    ``[0, 1, 2, 3]`` and ``[4, 5]``; MEAN with ``axis=0`` uses the denominator 6, giving
    15 / 6 = 2.5 (not the 3.0 that averaging the per-replica means 1.5 and 4.5 gives)."""
    per_replica_result = per_example_values(two, [[0, 1, 2, 3], [4, 5]])

    mean = await two.reduce(aiodist.ReduceOp.MEAN, per_replica_result, axis=0)

    assert_tensor(mean, 2.5, np.float32)

    # The contrast the docstring draws: a mean per replica, then the mean of those.
    per_replica_means = two.experimental_distribute_values_from_function(
        lambda ctx: np.float32(np.mean(per_replica_result.values[ctx.replica_id_in_sync_group]))
    )
    mean_of_means = await two.reduce(aiodist.ReduceOp.MEAN, per_replica_means, axis=None)
    assert_tensor(mean_of_means, 3.0, np.float32)


async def test_reduce_uneven_last_batch_needs_an_axis(two):
    """Strategy.reduce, "What should axis be?": without ``axis`` the uneven split
    ``[0, 1, 2, 3]`` / ``[4, 5]`` is a shape mismatch (TF errors too); aiodist raises
    ``ValueError`` instead of returning a wrong value."""
    per_replica_result = per_example_values(two, [[0, 1, 2, 3], [4, 5]])

    with pytest.raises(ValueError, match="shape"):
        await two.reduce(aiodist.ReduceOp.MEAN, per_replica_result, axis=None)


# -- Strategy.gather (distribute_lib.py) -----------------------------------------------


async def test_gather_shape_2_1_per_replica(two):
    """Strategy.gather, example 1: a DistributedValues with ``[[1], [2]]`` (shape (2, 1),
    int32) on each of two replicas, gathered along axis 0, is
    ``[[1], [2], [1], [2]]`` (shape (4, 1), int32)."""
    distributed_values = two.experimental_distribute_values_from_function(
        lambda _: np.array([[1], [2]], dtype=np.int32)
    )

    gathered = await two.gather(distributed_values, axis=0)

    assert isinstance(gathered, np.ndarray)
    assert_tensor(gathered, [[1], [2], [1], [2]], np.int32)


GATHER_4_REPLICAS = {
    0: [
        [[0, 1, 2], [3, 4, 5]],
        [[0, 1, 2], [3, 4, 5]],
        [[0, 1, 2], [3, 4, 5]],
        [[0, 1, 2], [3, 4, 5]],
    ],
    1: [
        [
            [0, 1, 2],
            [3, 4, 5],
            [0, 1, 2],
            [3, 4, 5],
            [0, 1, 2],
            [3, 4, 5],
            [0, 1, 2],
            [3, 4, 5],
        ]
    ],
    2: [
        [
            [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
            [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5],
        ]
    ],
}


@pytest.mark.parametrize(
    ("axis", "shape"), [(0, (4, 2, 3)), (1, (1, 8, 3)), (2, (1, 2, 12))], ids=str
)
async def test_gather_range_6_on_four_replicas(axis, shape):
    """Strategy.gather, example 2: ``tf.reshape(tf.range(6), (1, 2, 3))`` on each of
    four replicas, gathered along axis 0, 1 and 2, gives shapes (4, 2, 3), (1, 8, 3)
    and (1, 2, 12) with exactly the values TF shows (int32)."""
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    single_tensor = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda _: single_tensor.copy()
    )

    gathered = await strategy.gather(distributed_values, axis=axis)

    assert gathered.shape == shape
    assert_tensor(gathered, GATHER_4_REPLICAS[axis], np.int32)


# -- Strategy.experimental_distribute_values_from_function (distribute_lib.py) ----------


def test_values_from_function_example_1_constant(two):
    """Strategy.experimental_distribute_values_from_function, example 1: a constant
    ``tf.constant(1.)`` per replica; local results are ``(1.0, 1.0)`` (float32)."""

    def value_fn(ctx):
        return np.float32(1.0)

    distributed_values = two.experimental_distribute_values_from_function(value_fn)
    local_result = two.experimental_local_results(distributed_values)

    assert isinstance(distributed_values, PerReplica)
    assert isinstance(local_result, tuple)
    assert len(local_result) == 2
    for value in local_result:
        assert_tensor(value, 1.0, np.float32)


def test_values_from_function_example_2_indexed_by_replica_id(two):
    """Strategy.experimental_distribute_values_from_function, example 2:
    ``array_value = np.array([3., 2., 1.])`` indexed by replica id gives ``(3.0, 2.0)``."""
    array_value = np.array([3.0, 2.0, 1.0])

    def value_fn(ctx):
        return array_value[ctx.replica_id_in_sync_group]

    distributed_values = two.experimental_distribute_values_from_function(value_fn)
    local_result = two.experimental_local_results(distributed_values)

    assert local_result == (3.0, 2.0)
    assert_tensor(local_result[0], 3.0, np.float64)
    assert_tensor(local_result[1], 2.0, np.float64)


def test_values_from_function_example_3_num_replicas_in_sync(two):
    """Strategy.experimental_distribute_values_from_function, example 3: ``value_fn``
    returning ``ctx.num_replicas_in_sync`` gives ``(2, 2)``."""

    def value_fn(ctx):
        return ctx.num_replicas_in_sync

    distributed_values = two.experimental_distribute_values_from_function(value_fn)
    local_result = two.experimental_local_results(distributed_values)

    assert local_result == (2, 2)


async def test_values_from_function_example_4_values_made_per_worker_device(two):
    """Strategy.experimental_distribute_values_from_function, example 4 (TF's is on a
    TPUStrategy, made under ``tf.device(worker_devices[i])``): one value made per
    replica for its worker device, ``value_fn`` picking replica i's. The local
    results are those very values, on the worker devices; here they are 1.0 each
    (float32), so their SUM is 2.0. On CPU devices a NumPy array needs no placing."""
    worker_devices = two.extended.worker_devices
    multiple_values = []
    for i in range(two.num_replicas_in_sync):
        assert worker_devices[i] == f"/device:CPU:{i}"
        multiple_values.append(np.float32(1.0))

    def value_fn(ctx):
        return multiple_values[ctx.replica_id_in_sync_group]

    distributed_values = two.experimental_distribute_values_from_function(value_fn)

    local = two.experimental_local_results(distributed_values)
    assert all(v is m for v, m in zip(local, multiple_values, strict=True))
    assert distributed_values.devices == worker_devices
    assert_tensor(await two.reduce("sum", distributed_values, axis=None), 2.0, np.float32)


# -- tf.distribute.experimental.ValueContext (distribute_lib.py) -----------------------


def test_value_context_example_1_directly_constructed():
    """ValueContext, example 1 (directly constructed): with
    ``replica_id_in_sync_group=2, num_replicas_in_sync=4``,
    ``replica_id / num_replicas`` is 0.5."""

    def value_fn(context):
        return context.replica_id_in_sync_group / context.num_replicas_in_sync

    context = aiodist.ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    per_replica_value = value_fn(context)

    assert context.replica_id_in_sync_group == 2
    assert context.num_replicas_in_sync == 4
    assert per_replica_value == 0.5


def test_value_context_example_2_passed_by_values_from_function(two):
    """ValueContext, example 2 (passed in by experimental_distribute_values_from_function):
    ``value_context.num_replicas_in_sync`` on two replicas gives ``(2, 2)``; each call
    gets a ValueContext with its own replica id."""
    seen = []

    def value_fn(value_context):
        assert isinstance(value_context, aiodist.ValueContext)
        seen.append(value_context.replica_id_in_sync_group)
        return value_context.num_replicas_in_sync

    distributed_values = two.experimental_distribute_values_from_function(value_fn)
    local_result = two.experimental_local_results(distributed_values)

    assert local_result == (2, 2)
    assert seen == [0, 1]


# -- tf.distribute.DistributedValues ---------------------------------------------------


def five_and_six(strategy):
    """The first batch of TF's ``from_tensor_slices([5., 6., 7., 8.]).batch(2)`` split
    over two replicas: ``[5.]`` and ``[6.]`` (shape (1,), float32)."""
    first_batch = np.array([5.0, 6.0], dtype=np.float32)

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return first_batch[i : i + 1].copy()

    return strategy.experimental_distribute_values_from_function(value_fn)


def test_distributed_values_example_1_created_per_replica(two):
    """tf.distribute.DistributedValues, example 1 (created from a dataset; here from a
    function): ``PerReplica:{0: [5.], 1: [6.]}`` (shape (1,), float32) on the replicas'
    devices."""
    distributed_values = five_and_six(two)

    assert_per_replica(distributed_values, [[5.0], [6.0]], np.float32)
    assert distributed_values.devices == ("/device:CPU:0", "/device:CPU:1")


async def test_distributed_values_example_2_returned_by_run(two):
    """tf.distribute.DistributedValues, example 2 (returned by run): the replica ids
    give ``PerReplica:{0: 0, 1: 1}``."""
    distributed_values = await two.run(replica_id)

    assert isinstance(distributed_values, PerReplica)
    assert distributed_values.values == (0, 1)


async def test_distributed_values_example_3_input_into_run(two):
    """tf.distribute.DistributedValues, example 3 (as input into run): ``input + 1.0``
    on ``[5.]`` / ``[6.]`` gives ``PerReplica:{0: [6.], 1: [7.]}`` (float32)."""
    distributed_values = five_and_six(two)

    async def run(input):
        return input + 1.0

    updated_value = await two.run(run, args=(distributed_values,))

    assert_per_replica(updated_value, [[6.0], [7.0]], np.float32)


async def test_distributed_values_example_4_input_into_reduce(two):
    """tf.distribute.DistributedValues, example 4 (as input into reduce): SUM with
    ``axis=0`` of ``[5.]`` and ``[6.]`` is 11.0 (shape (), float32)."""
    distributed_values = five_and_six(two)

    reduced_value = await two.reduce(aiodist.ReduceOp.SUM, distributed_values, axis=0)

    assert_tensor(reduced_value, 11.0, np.float32)


def test_distributed_values_example_5_local_results(two):
    """tf.distribute.DistributedValues, example 5 (inspect per-replica values locally):
    ``experimental_local_results`` gives ``([5.], [6.])`` (shape (1,), float32)."""
    distributed_values = five_and_six(two)

    per_replica_values = two.experimental_local_results(distributed_values)

    assert isinstance(per_replica_values, tuple)
    assert len(per_replica_values) == 2
    assert_tensor(per_replica_values[0], [5.0], np.float32)
    assert_tensor(per_replica_values[1], [6.0], np.float32)


# -- StrategyExtended.colocate_vars_with (distribute_lib.py) ---------------------------


async def test_colocate_vars_with_example_update_gets_each_devices_copies(two):
    """StrategyExtended.colocate_vars_with: var2 and var3 made in the block live where
    var1 does, and ``extended.update(var1, fn, args=(var2, var3))`` calls ``fn`` on
    each of var1's devices with that device's copy of all three (the docstring's
    ``fn(v1, v2, v3)``). Here fn writes ``v1 + v2 * v3`` = 1 + 2 * 3."""
    calls = []

    def fn(v1, v2, v3):
        calls.append((v1.device, v2.device, v3.device))
        return v1.assign(v1 + v2 * v3)

    with two.scope():
        var1 = aiodist.Variable(np.float32(1.0))
        with two.extended.colocate_vars_with(var1):
            var2 = aiodist.Variable(np.float32(2.0))
            var3 = aiodist.Variable(np.float32(3.0))
        await two.extended.update(var1, fn, args=(var2, var3))

    assert var2.devices == var3.devices == var1.devices
    assert calls == [("/device:CPU:0",) * 3, ("/device:CPU:1",) * 3]
    for value in two.experimental_local_results(var1):
        assert_tensor(value, 7.0, np.float32)


def test_colocate_vars_with_checks_as_tf_does(two, three):
    """As in TF, colocate_vars_with is used in its strategy's scope, with one of that
    strategy's variables; the default strategy takes a variable made outside any
    scope. Anything else raises instead of placing nothing."""
    with two.scope():
        mine = aiodist.Variable(1.0, name="mine")
    with three.scope():
        theirs = aiodist.Variable(1.0, name="theirs")
    plain = aiodist.Variable(1.0, name="plain")

    with pytest.raises(aiodist.ContextError, match=r"colocate_vars_with\(\) of .* outside"):
        two.extended.colocate_vars_with(mine)
    with two.scope():
        for other, where in [(theirs, "made by MirroredStrategy"), (plain, "made outside any")]:
            with pytest.raises(aiodist.InvalidArgumentError, match=rf"'{other.name}' \({where}"):
                two.extended.colocate_vars_with(other)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"colocate_vars_with: 3 is"):
            two.extended.colocate_vars_with(3)
    default = aiodist.get_strategy()
    with default.extended.colocate_vars_with(plain):
        assert type(aiodist.Variable(2.0)) is aiodist.Variable


# -- tf.distribute.DistributedValues, from a distributed dataset -----------------------


def five_to_eight():
    """TF's ``from_tensor_slices([5., 6., 7., 8.]).batch(2)``: two global batches."""
    return [np.array([5.0, 6.0], dtype=np.float32), np.array([7.0, 8.0], dtype=np.float32)]


async def test_distributed_values_examples_from_a_distributed_dataset(two):
    """tf.distribute.DistributedValues, examples 1, 3, 4 and 5 as written: the first
    element of ``experimental_distribute_dataset`` over the batches ``[5., 6.]`` and
    ``[7., 8.]`` is ``PerReplica:{0: [5.], 1: [6.]}``; ``input + 1.0`` in ``run`` gives
    ``[6.]`` / ``[7.]``; SUM with ``axis=0`` gives 11.0; the local results are
    ``([5.], [6.])`` (all float32)."""
    dataset_iterator = aiter(two.experimental_distribute_dataset(five_to_eight()))
    distributed_values = await anext(dataset_iterator)

    async def run(input):
        return input + 1.0

    updated_value = await two.run(run, args=(distributed_values,))
    reduced_value = await two.reduce(aiodist.ReduceOp.SUM, distributed_values, axis=0)
    per_replica_values = two.experimental_local_results(distributed_values)

    assert_per_replica(distributed_values, [[5.0], [6.0]], np.float32)
    assert distributed_values.devices == ("/device:CPU:0", "/device:CPU:1")
    assert_per_replica(updated_value, [[6.0], [7.0]], np.float32)
    assert_tensor(reduced_value, 11.0, np.float32)
    assert isinstance(per_replica_values, tuple)
    assert len(per_replica_values) == 2
    assert_tensor(per_replica_values[0], [5.0], np.float32)
    assert_tensor(per_replica_values[1], [6.0], np.float32)


def test_distributed_values_example_1_with_plain_iter_and_next(two):
    """tf.distribute.DistributedValues, example 1 with TF's own ``iter``/``next``: a
    plain iterable of global batches may be iterated without an event loop."""
    distributed_values = next(iter(two.experimental_distribute_dataset(five_to_eight())))

    assert_per_replica(distributed_values, [[5.0], [6.0]], np.float32)


# -- Strategy.experimental_distribute_dataset and the custom loop (distribute_lib.py) --


async def test_experimental_distribute_dataset_example(two):
    """Strategy.experimental_distribute_dataset: ``Dataset.range(4).batch(2)`` on two
    replicas, ``replica_fn(input) = input * 2`` over a Pythonic ``for`` loop gives
    ``[PerReplica:{0: [0], 1: [2]}, PerReplica:{0: [4], 1: [6]}]`` (int64): each global
    batch of 2 is split into per-replica batches of 1."""
    global_batch_size = 2
    values = np.arange(4, dtype=np.int64)
    dataset = [values[i : i + global_batch_size] for i in range(0, 4, global_batch_size)]
    dist_dataset = two.experimental_distribute_dataset(dataset)

    async def replica_fn(input):
        return input * 2

    result = []
    for x in dist_dataset:
        result.append(await two.run(replica_fn, args=(x,)))

    assert len(result) == 2
    assert_per_replica(result[0], [[0], [2]], np.int64)
    assert_per_replica(result[1], [[4], [6]], np.int64)


async def test_strategy_class_custom_training_loop(two):
    """tf.distribute.Strategy (class docstring), "a custom training loop can be as
    simple as": per epoch, ``run`` over the distributed dataset and add up
    ``reduce(SUM, ..., axis=None)``. With batches ``0..3`` and ``4..7`` and a
    replica_fn summing its share, every epoch's total is 0 + 1 + ... + 7 = 28."""
    epochs = 3
    dataset = [np.arange(0, 4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)]

    with two.scope():

        async def distribute_train_epoch(dataset):
            async def replica_fn(input):
                return np.sum(input)

            total_result = 0
            async for x in dataset:
                per_replica_result = await two.run(replica_fn, args=(x,))
                total_result += await two.reduce(
                    aiodist.ReduceOp.SUM, per_replica_result, axis=None
                )
            return total_result

    dist_dataset = two.experimental_distribute_dataset(dataset)
    train_results = [await distribute_train_epoch(dist_dataset) for _ in range(epochs)]

    assert train_results == [28.0] * epochs
    assert all(np.asarray(r).dtype == np.float32 for r in train_results)


async def test_input_options_example_on_mirrored_strategy(two):
    """tf.distribute.InputOptions (docstring; TF's is on a TPUStrategy): ``range(16)``
    distributed with ``PER_WORKER``, not placed on the device, a per-replica buffer of
    1. The options are accepted and the one global batch of 16 is split 8 / 8."""
    options = aiodist.InputOptions(
        experimental_replication_mode=aiodist.InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device=False,
        experimental_per_replica_buffer_size=1,
    )
    distributed_dataset_on_host = two.experimental_distribute_dataset(
        [np.arange(16, dtype=np.int64)], options
    )

    batches = [x async for x in distributed_dataset_on_host]

    assert len(batches) == 1
    assert_per_replica(batches[0], [range(8), range(8, 16)], np.int64)


# -- Strategy.scope and variable_created_in_scope (distribute_lib.py) ------------------


def test_scope_example_mirrored_variable_inside_regular_outside(two):
    """Strategy.scope: ``tf.Variable(1.)`` inside the scope is a MirroredVariable with
    1.0 on each of the two devices (float32); outside it, a regular variable of 1.0."""
    with two.scope():
        mirrored_variable = aiodist.Variable(np.float32(1.0))
    regular_variable = aiodist.Variable(np.float32(1.0))

    assert isinstance(mirrored_variable, aiodist.MirroredVariable)
    assert mirrored_variable.devices == ("/device:CPU:0", "/device:CPU:1")
    local = two.experimental_local_results(mirrored_variable)
    assert len(local) == 2
    for value in local:
        assert_tensor(value, 1.0, np.float32)
    assert type(regular_variable) is aiodist.Variable
    assert_tensor(regular_variable.read_value(), 1.0, np.float32)


def test_variable_created_in_scope_examples():
    """StrategyExtended.variable_created_in_scope: with ``MirroredStrategy()`` (its
    default devices), a variable made in its scope gives True, one made outside
    False."""
    strategy = aiodist.MirroredStrategy()
    with strategy.scope():
        v = aiodist.Variable(1.0)
    assert strategy.extended.variable_created_in_scope(v) is True

    strategy = aiodist.MirroredStrategy()
    v = aiodist.Variable(1.0)
    assert strategy.extended.variable_created_in_scope(v) is False


# -- StrategyExtended.update and ReplicaContext._update (distribute_lib.py) ------------
# (The reduce_to and batch_reduce_to examples, which update through a merge_fn, are
# test_variables.py::test_tf_reduce_to_update_example.)


async def test_extended_update_example(two):
    """StrategyExtended.update: ``tf.Variable(5.0, aggregation=SUM)`` updated with
    ``v.assign(1.0)`` gives ``Mirrored:{0: 1.0, 1: 1.0}`` (float32), and both copies
    read 1.0."""
    with two.scope():
        v = aiodist.Variable(np.float32(5.0), aggregation=aiodist.VariableAggregation.SUM)

        def update_fn(v):
            return v.assign(1.0)

        result = await two.extended.update(v, update_fn)

    assert isinstance(result, aiodist.Mirrored)
    assert len(result.values) == 2
    for component in result.values:
        assert_tensor(component, 1.0, np.float32)
    for value in two.experimental_local_results(v):
        assert_tensor(value, 1.0, np.float32)


async def test_replica_context_update_example_through_merge_call(two):
    """ReplicaContext._update (TF's private replica-context update): a
    MirroredVariable of 5.0 updated from ``replica_fn`` with ``var.assign(1.0)``
    reads 1.0 on both copies. aiodist's ``extended.update`` is cross-replica, so the
    replica function reaches it through ``merge_call``, as TF's ``_update`` does
    internally; each replica gets its own copy back."""
    with two.scope():
        distributed_variable = aiodist.Variable(np.float32(5.0))
    assert [float(c) for c in two.experimental_local_results(distributed_variable)] == [5.0, 5.0]

    async def replica_fn(v):
        value = np.float32(1.0)
        replica_context = aiodist.get_replica_context()

        def update_fn(var, value):
            return var.assign(value)

        def merge_fn(strategy, value):
            return strategy.extended.update(v, update_fn, args=(value,))

        return await replica_context.merge_call(merge_fn, args=(value,))

    returned = await two.run(replica_fn, args=(distributed_variable,))

    assert [c.device for c in returned.values] == ["/device:CPU:0", "/device:CPU:1"]
    for value in two.experimental_local_results(distributed_variable):
        assert_tensor(value, 1.0, np.float32)


async def test_replica_context_update_example_2_computation_after_all_reduce(two):
    """ReplicaContext._update, second example (no numbers in TF's text): a SUM
    variable of 5.0; each replica computes a value from its input, all-reduces it,
    and updates the variable with ``update_fn``, whose computation runs once per
    copy, on the copy's device. With inputs 1.0 and 2.0, ``computation`` doubling
    (2 + 4, all-reduced: 6) and ``post_reduce_pre_update_computation`` adding 1,
    both copies read 7.0 (float32). (TF's snippet assigns ``value`` where it means
    the computed ``updated_value``; aiodist's replica-context update is
    ``extended.update`` through ``merge_call``, as TF's ``_update`` is inside.)"""
    with two.scope():
        v = aiodist.Variable(np.float32(5.0), aggregation=aiodist.VariableAggregation.SUM)
    inputs = two.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1)
    )
    devices_updated = []

    def computation(x):
        return x * 2

    def post_reduce_pre_update_computation(value):
        return value + 1

    async def replica_fn(inputs):
        value = computation(inputs)
        replica_context = aiodist.get_replica_context()
        reduced_value = await replica_context.all_reduce("sum", value)

        def update_fn(var, value):
            devices_updated.append(var.device)
            updated_value = post_reduce_pre_update_computation(value)
            return var.assign(updated_value)

        def merge_fn(strategy, value):
            return strategy.extended.update(v, update_fn, args=(value,))

        await replica_context.merge_call(merge_fn, args=(reduced_value,))

    await two.run(replica_fn, args=(inputs,))

    assert devices_updated == ["/device:CPU:0", "/device:CPU:1"]
    for value in two.experimental_local_results(v):
        assert_tensor(value, 7.0, np.float32)


# -- ReplicaContext.merge_call outside a distributed scope (distribute_lib.py) ---------


async def test_merge_call_outside_any_scope_calls_merge_fn_with_the_default_strategy():
    """ReplicaContext.merge_call: "if not inside a distributed scope" it equals
    ``merge_fn(get_strategy(), *args, **kwargs)`` in cross-replica context."""
    default = aiodist.get_strategy()
    seen = []

    def merge_fn(strategy, a, b):
        seen.append((strategy, aiodist.in_cross_replica_context()))
        return a + b

    result = await aiodist.get_replica_context().merge_call(merge_fn, args=(3,), kwargs={"b": 4})

    assert result == 7
    assert seen == [(default, True)]
    assert not aiodist.in_cross_replica_context()


# -- ReplicaContext.all_gather and Strategy.gather: shapes (distribute_lib.py) ---------


async def test_all_gather_different_shapes_example(two):
    """ReplicaContext.all_gather, "tensors with different shapes": replica 0 holds
    ``{'a': [0], 'b': [[0, 1]]}``, replica 1 ``{'a': [1], 'b': [[2, 3], [4, 5]]}``;
    along axis 0 every replica gets ``'b': [[0, 1], [2, 3], [4, 5]]`` and ``'a'``
    the concatenation ``[0, 1]`` (TF's text shows ``[1, 2]``, which is no
    concatenation of ``[0]`` and ``[1]``: a typo there)."""

    async def gather():
        if aiodist.get_replica_context().replica_id_in_sync_group == 0:
            value = {"a": np.array([0]), "b": np.array([[0, 1]])}
        else:
            value = {"a": np.array([1]), "b": np.array([[2, 3], [4, 5]])}
        return await aiodist.get_replica_context().all_gather(value, axis=0)

    result = await two.run(gather)

    for per_replica in two.experimental_local_results(result):
        assert sorted(per_replica) == ["a", "b"]
        assert_tensor(per_replica["a"], [0, 1], np.int64)
        assert_tensor(per_replica["b"], [[0, 1], [2, 3], [4, 5]], np.int64)


async def test_gather_and_all_gather_shapes_may_differ_only_along_axis(two):
    """Strategy.gather and ReplicaContext.all_gather: components of shapes (1, 2, 3)
    and (1, 3, 3) gather along axis 1 (to (1, 5, 3)) but not along axis 0 or 2,
    where aiodist raises instead of TF's error (or hang)."""
    parts = [np.zeros((1, 2, 3), np.float32), np.ones((1, 3, 3), np.float32)]
    distributed_values = aiodist.PerReplica(parts)

    async def all_gather(axis):
        ctx = aiodist.get_replica_context()
        return await ctx.all_gather(parts[ctx.replica_id_in_sync_group], axis=axis)

    gathered = await two.gather(distributed_values, axis=1)
    all_gathered = await two.run(all_gather, args=(1,))

    expected = np.concatenate(parts, axis=1)
    assert_tensor(gathered, expected, np.float32)
    for value in two.experimental_local_results(all_gathered):
        assert_tensor(value, expected, np.float32)
    for axis in (0, 2):
        with pytest.raises(ValueError, match=rf"shapes may differ only along axis {axis}"):
            await two.gather(distributed_values, axis=axis)
        with pytest.raises(aiodist.CollectiveMismatchError, match=rf"all_gather\(axis={axis}"):
            await two.run(all_gather, args=(axis,))


# -- tf.distribute.ReductionToOneDevice ------------------------------------------------


async def test_reduction_to_one_device_page_example():
    """tf.distribute.ReductionToOneDevice: ``MirroredStrategy(cross_device_ops=
    ReductionToOneDevice())`` (default devices) is a working strategy whose
    collectives reduce on one device: the SUM of 1.0 over its replicas is their count."""
    cross_device_ops = aiodist.ReductionToOneDevice()
    strategy = aiodist.MirroredStrategy(cross_device_ops=cross_device_ops)

    async def step_fn():
        return await aiodist.get_replica_context().all_reduce("sum", np.float32(1.0))

    results = strategy.experimental_local_results(await strategy.run(step_fn))

    assert strategy.extended._cross_device_ops is cross_device_ops
    assert len(results) == strategy.num_replicas_in_sync
    for value in results:
        assert_tensor(value, strategy.num_replicas_in_sync, np.float32)
