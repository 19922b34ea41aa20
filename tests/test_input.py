"""Distributed input (SPEC §8): splitting, placement, prefetch, cleanup, errors."""

from __future__ import annotations

import asyncio
import collections
import traceback

import numpy as np
import pytest

import aiodist
from tests.conftest import cpu_devices, wait_until

Batch = collections.namedtuple("Batch", "x y")


def shards(strategy, value) -> list:
    return list(strategy.experimental_local_results(value))


def producer_tasks() -> list[asyncio.Task]:
    return [
        t
        for t in asyncio.all_tasks()
        if t is not asyncio.current_task() and "_produce" in repr(t.get_coro())
    ]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (8, {1: [8], 2: [4, 4], 4: [2, 2, 2, 2]}),
        (7, {1: [7], 2: [4, 3], 4: [2, 2, 2, 1]}),
        (3, {1: [3], 2: [2, 1], 4: [1, 1, 1, 0]}),
        (1, {1: [1], 2: [1, 0], 4: [1, 0, 0, 0]}),
    ],
    ids=["divisible", "uneven", "fewer-than-replicas", "one-row"],
)
async def test_split_rules(strategy, num_replicas, rows, expected):
    batch = np.arange(rows * 2).reshape(rows, 2)
    seen = [b async for b in strategy.experimental_distribute_dataset([batch])]
    assert len(seen) == 1
    parts = shards(strategy, seen[0])
    assert [len(p) for p in parts] == expected[num_replicas]
    np.testing.assert_array_equal(np.concatenate(parts), batch)  # nothing lost, in order
    if num_replicas > 1:
        assert isinstance(seen[0], aiodist.PerReplica)
        assert seen[0].devices == tuple(f"/device:CPU:{i}" for i in range(num_replicas))


async def test_nested_structures_keep_their_shape(two):
    def source():
        for i in range(2):
            yield {"img": np.full((4, 3), i), "pair": Batch(np.arange(4), [np.ones((4, 1))])}

    batches = [b async for b in two.experimental_distribute_dataset(source())]
    assert len(batches) == 2
    first = batches[0]
    assert isinstance(first["pair"], Batch) and isinstance(first["pair"].y, list)
    np.testing.assert_array_equal(shards(two, first["pair"].x)[1], [2, 3])
    assert [s.shape for s in shards(two, first["img"])] == [(2, 3), (2, 3)]
    np.testing.assert_array_equal(shards(two, batches[1]["img"])[0], np.ones((2, 3)))


async def test_sync_iteration_and_list_sources(strategy, num_replicas):
    data = [np.arange(4) + 10 * i for i in range(3)]
    dataset = strategy.experimental_distribute_dataset(data)
    sync = [np.concatenate(shards(strategy, b)) for b in dataset]
    again = [np.concatenate(shards(strategy, b)) async for b in dataset]  # a list re-iterates
    for got in (sync, again):
        assert len(got) == 3
        for g, d in zip(got, data, strict=True):
            np.testing.assert_array_equal(g, d)


async def test_async_generator_source_and_plain_for_refused(two):
    async def source():
        for i in range(3):
            await asyncio.sleep(0)
            yield np.full(2, i)

    dataset = two.experimental_distribute_dataset(source())
    with pytest.raises(aiodist.InvalidArgumentError, match=r"async iterable.*`async for`"):
        iter(dataset).__next__()
    values = [tuple(int(s[0]) for s in shards(two, b)) async for b in dataset]
    assert values == [(0, 0), (1, 1), (2, 2)]


class BothWays:
    """A loader iterable with ``for`` and with ``async for``."""

    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    async def __aiter__(self):
        for batch in self.batches:
            await asyncio.sleep(0)
            yield batch


async def test_a_dataset_iterable_both_ways_works_with_a_plain_for(two):
    # A plain `for` was refused: "the dataset is an async iterable, so iterate it
    # with `async for`", though the dataset is a plain iterable too.
    batches = [np.arange(4.0), np.arange(4.0, 8.0)]
    dataset = two.experimental_distribute_dataset(BothWays(batches))
    for got in (list(dataset), [b async for b in dataset]):
        assert [np.concatenate(shards(two, b)).tolist() for b in got] == [
            b.tolist() for b in batches
        ]
    per_replica = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")
    dataset = two.distribute_datasets_from_function(lambda context: BothWays(batches), per_replica)
    assert len(list(dataset)) == 2


async def test_dataset_feeds_run_and_reduce(strategy, num_replicas):
    """The training-loop shape: async for batch -> run -> reduce."""
    data = [np.arange(6, dtype=np.float64) + 6 * i for i in range(4)]

    async def step(x):
        return await aiodist.get_replica_context().all_reduce("sum", np.sum(x))

    total = 0.0
    async for batch in strategy.experimental_distribute_dataset(data):
        result = await strategy.run(step, args=(batch,))
        total += float(await strategy.reduce("mean", result, axis=None))
    assert total == float(np.sum(data))


@pytest.mark.parametrize("depth", [0, 1, 3])
async def test_prefetch_depth_is_honoured(two, depth):
    consumed = []

    def source():
        for i in range(10):
            consumed.append(i)
            yield np.full(2, i)

    options = aiodist.InputOptions(experimental_per_replica_buffer_size=depth)
    iterator = aiter(two.experimental_distribute_dataset(source(), options=options))
    for received in range(1, 5):
        await anext(iterator)
        # give the producer every chance to run ahead
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(consumed) == min(10, received + depth)
    await iterator.aclose()


async def test_break_stops_prefetching_and_closes_the_source(two):
    closed = []

    async def source():
        try:
            for i in range(1000):
                yield np.full(2, i)
        finally:
            closed.append(True)

    async for _ in two.experimental_distribute_dataset(source()):
        break
    await wait_until(lambda: not producer_tasks() and closed, "producer gone, source closed")


async def test_aclose_and_context_manager(two):
    def source():
        yield from (np.full(2, i) for i in range(100))

    async with aiter(two.experimental_distribute_dataset(source())) as iterator:
        await anext(iterator)
        assert producer_tasks()
    assert not producer_tasks()


async def test_dataset_exception_propagates_unchanged(two):
    boom = OSError("disk gone")

    def source():
        yield np.arange(2)
        raise boom

    received = []
    with pytest.raises(OSError) as info:
        async for batch in two.experimental_distribute_dataset(source()):
            received.append(batch)
    assert info.value is boom
    assert len(received) == 1
    await wait_until(lambda: not producer_tasks(), "producer finished")


async def test_after_a_source_error_every_anext_raises_it_again(two):
    """As documented (DistributedDataset): a failed pass stays failed, in every
    consumer, where an async generator would end; a plain ``for`` asks the source."""
    boom = OSError("disk gone")

    def source():
        yield np.arange(2)
        raise boom

    iterator = aiter(two.experimental_distribute_dataset(source()))
    await anext(iterator)
    for _ in range(3):
        with pytest.raises(OSError) as info:
            await anext(iterator)
        assert info.value is boom
    iterator = iter(two.experimental_distribute_dataset(source()))
    next(iterator)
    with pytest.raises(OSError):
        next(iterator)
    with pytest.raises(StopIteration):  # the generator has ended
        next(iterator)


async def test_an_error_raised_again_keeps_one_traceback(two):
    """Each anext that raised the source's error again added its frames to the error's
    traceback (3 more each time), so a consumer reading on after the error (a server
    retrying) held an ever longer one. As asyncio.Future.result() does, each raise
    starts again from the traceback the error had when the source raised it."""

    def source():
        yield np.arange(2)
        raise OSError("disk gone")

    iterator = aiter(two.experimental_distribute_dataset(source()))
    await anext(iterator)
    lengths = []
    for _ in range(5):
        with pytest.raises(OSError) as info:
            await anext(iterator)
        lengths.append(len(traceback.extract_tb(info.value.__traceback__)))
        assert traceback.extract_tb(info.value.__traceback__)[-1].name == "source"
    assert len(set(lengths)) == 1, lengths


@pytest.mark.parametrize(
    ("element", "message"),
    [
        (np.float32(1.0), r"rank-0 value \(np.float32\(1.0\)\) has no batch axis; every"),
        # Leaves of different sizes are named, not only their sizes ([3, 4]).
        ({"a": np.ones(3), "b": np.ones(4)}, r"batch sizes \(\['a'\]: 3 rows, but \['b'\]: 4\)"),
        (
            Batch(np.ones((4, 2)), [np.ones(4), np.ones(3)]),
            r"\(\.x: 4 rows, but \.y\[1\]: 3\); every",
        ),
        ([], r"holds no arrays"),
        # Rows as Python lists nest, a leaf per number: the message named 1.0 only.
        ([[1.0, 2.0], [3.0, 4.0]], r"\(1.0\) has no batch axis \(a list or tuple is a struc.*"),
        ((np.ones((2, 2)), 1.0), r"value at \[1\] \(1.0\) has no batch axis; every leaf"),
        # ... in a dict (as JSON gives), beside an array too: the hint was left out.
        ({"x": [1, 2, 3]}, r"\(1\) has no batch axis \(a list or tuple is a structure"),
        ({"x": np.ones(3), "y": [1, 2, 3]}, r"\(1\) has no batch axis \(a list or tuple is a"),
        ({"w": 0.5, "x": np.ones(2)}, r"value at \['w'\] \(0.5\) has no batch axis; every"),
    ],
)
async def test_bad_elements(two, element, message):
    with pytest.raises(ValueError, match=message):
        async for _ in two.experimental_distribute_dataset([element]):
            pass


def test_non_iterables_and_bad_options(two):
    with pytest.raises(aiodist.InvalidArgumentError, match=r"42 is not iterable"):
        two.experimental_distribute_dataset(42)

    class NotIterable:
        __iter__ = None  # how a class says "not iterable"

    # Each has an __iter__ attribute, and iter() refuses each.
    for bad in (np.array(3.0), list, NotIterable(), "abc"):
        with pytest.raises(aiodist.InvalidArgumentError, match=r"is not iterable"):
            two.experimental_distribute_dataset(bad)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"is not iterable"):
            two.distribute_datasets_from_function(lambda context, bad=bad: bad)
    with pytest.raises(ValueError, match=r"options=3"):
        two.experimental_distribute_dataset([], options=3)
    with pytest.raises(ValueError, match=r"experimental_per_replica_buffer_size=-1"):
        aiodist.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(
        ValueError, match=r"experimental_replication_mode='each'; expected one of PER_WORKER"
    ):
        aiodist.InputOptions(experimental_replication_mode="each")


def test_a_dict_given_as_the_dataset_is_refused_at_the_call(two):
    """A dict iterates its keys: one global batch passed as it is was refused only at
    the first read, as "a rank-0 value ('x') has no batch axis", naming neither the
    dataset nor the remedy."""
    batch = {"x": np.ones((4, 2)), "y": np.arange(4)}
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"experimental_distribute_dataset: the dataset is a mapping \(dict, keys 'x', 'y'\)"
        r", whose iteration gives its keys, not batches.*pass a list of it \(\[batch\]\)",
    ):
        two.experimental_distribute_dataset(batch)
    for mode in ("per_worker", "per_replica"):
        options = aiodist.InputOptions(experimental_replication_mode=mode)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"returned a mapping \(dict"):
            two.distribute_datasets_from_function(lambda context: batch, options)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"\(OrderedDict, empty\)"):
        two.experimental_distribute_dataset(collections.OrderedDict())


def test_replication_mode_may_be_named_like_every_other_enum_option():
    options = aiodist.InputOptions(experimental_replication_mode="per_replica")
    assert options.experimental_replication_mode is aiodist.InputReplicationMode.PER_REPLICA


class Indexed:
    """Batches read by index until ``IndexError``: the sequence protocol, which
    ``iter()`` and ``for`` accept from a class with ``__getitem__`` alone."""

    def __init__(self, batches: list):
        self.batches = batches

    def __getitem__(self, index: int):
        return self.batches[index]


async def test_a_dataset_iterable_by_index_only_is_accepted(two):
    # It was refused at the call: "<Indexed object> is not iterable".
    batches = [np.arange(4.0), np.arange(4.0, 8.0)]
    dataset = two.experimental_distribute_dataset(Indexed(batches))
    for got in ([b async for b in dataset], list(dataset)):
        assert [np.concatenate(shards(two, b)).tolist() for b in got] == [
            b.tolist() for b in batches
        ]
    per_replica = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")
    dataset = two.distribute_datasets_from_function(lambda context: Indexed(batches), per_replica)
    assert len([b async for b in dataset]) == 2


async def test_fetch_to_device_false_keeps_host_arrays(two):
    options = aiodist.InputOptions(experimental_fetch_to_device=False)
    batch = np.arange(4)
    async for b in two.experimental_distribute_dataset([batch], options=options):
        assert all(isinstance(s, np.ndarray) for s in shards(two, b))


class Refilled:
    """A loader that refills one buffer for every element, as data loaders often do."""

    def __init__(self, count: int, rows: int):
        self.count, self.rows = count, rows

    def __iter__(self):
        buffer = np.zeros((self.rows, 1))
        for i in range(self.count):
            buffer[:] = i
            yield buffer


@pytest.mark.parametrize("to_device", [True, False], ids=["fetch_to_device", "host"])
async def test_prefetched_batches_survive_a_source_refilling_its_buffer(
    strategy, num_replicas, to_device
):
    """Prefetching fetches the next element while the consumer still uses this one."""
    options = aiodist.InputOptions(experimental_fetch_to_device=to_device)
    dataset = strategy.experimental_distribute_dataset(Refilled(4, 2 * num_replicas), options)
    seen = []
    async for batch in dataset:
        await strategy.run(lambda x: x, args=(batch,))  # the producer runs meanwhile
        seen.append([float(s[0, 0]) for s in shards(strategy, batch)])
    assert seen == [[float(i)] * num_replicas for i in range(4)]


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
async def test_from_function_shards_survive_a_source_refilling_its_buffer(three, mode):
    """PER_WORKER replicas take consecutive elements of one source, so even a plain
    ``for`` holds one element while the next is made; PER_REPLICA prefetches."""
    options = aiodist.InputOptions(experimental_replication_mode=mode)
    dataset = three.distribute_datasets_from_function(lambda ctx: Refilled(6, 2), options)
    if mode == "PER_WORKER":
        expected = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert [[float(s[0, 0]) for s in shards(three, b)] for b in dataset] == expected
    else:
        expected = [[float(i)] * 3 for i in range(6)]
    seen = []
    async for batch in dataset:
        await three.run(lambda x: x, args=(batch,))
        seen.append([float(s[0, 0]) for s in shards(three, batch)])
    assert seen == expected


# -- distribute_datasets_from_function ------------------------------------------------


async def test_from_function_per_worker_takes_consecutive_elements(num_replicas):
    strategy = aiodist.MirroredStrategy(cpu_devices(num_replicas))
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [np.full(2, i) for i in range(2 * num_replicas + 1)]

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    batches = [[int(s[0]) if s.size else None for s in shards(strategy, b)] async for b in dataset]
    assert len(contexts) == 1
    assert (contexts[0].num_input_pipelines, contexts[0].input_pipeline_id) == (1, 0)
    assert contexts[0].num_replicas_in_sync == num_replicas
    n = num_replicas
    assert batches[0] == list(range(n)) and batches[1] == list(range(n, 2 * n))
    # The last element alone: the other replicas get empty batches, nothing is dropped.
    assert batches[2] == [2 * n] + [None] * (n - 1)


async def test_from_function_per_replica(three):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        rid = ctx.input_pipeline_id
        return (
            np.full((ctx.get_per_replica_batch_size(6), 1), rid * 10 + i) for i in range(rid + 1)
        )

    options = aiodist.InputOptions(
        experimental_replication_mode=aiodist.InputReplicationMode.PER_REPLICA
    )
    dataset = three.distribute_datasets_from_function(dataset_fn, options)
    seen = [[s.shape[0] for s in shards(three, b)] for b in dataset]
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [
        (3, 0),
        (3, 1),
        (3, 2),
    ]
    assert seen == [[2, 2, 2], [0, 2, 2], [0, 0, 2]]


async def test_from_function_elements_of_different_structures_are_named_as_elements(three):
    """The message read "replicas yielded different structures (replica 0: ...)",
    naming no API, and under PER_WORKER its "replicas" were consecutive elements
    of the one dataset."""
    x = np.ones((1, 2))

    def per_worker(context):  # elements 3, 4, 5 make the second step; 4 is odd
        return [{"x": x}] * 4 + [{"y": x}, {"x": x}, {"x": x}]

    dataset = three.distribute_datasets_from_function(per_worker)
    with pytest.raises(aiodist.InvalidArgumentError) as caught:
        async for _ in dataset:
            pass
    assert str(caught.value).startswith(
        "distribute_datasets_from_function: dataset_fn's dataset yielded elements of "
        "different structures (element 3: dict with keys 'x'; element 4: dict with keys "
        "'y'; element 5: dict with keys 'x'); with InputReplicationMode.PER_WORKER the "
        "local replicas take consecutive elements of the one dataset"
    ), caught.value

    def runs_out(context):  # the last step: two elements (odd), and an empty batch
        return [(x, [x])] * 4 + [(x, (x,))]

    with pytest.raises(aiodist.InvalidArgumentError) as caught:
        list(three.distribute_datasets_from_function(runs_out))
    message = str(caught.value)
    assert (
        " at [1] (element 3: list of 1; element 4: tuple of 1; replica 2: an empty batch "
        "(the dataset ran out)); " in message
    ), message

    def per_replica(context):  # replica 2's dataset runs out first; 1's second is odd
        rid = context.input_pipeline_id
        return [[x], [x] if rid != 1 else {"x": x}][: 2 - (rid == 2)]

    options = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")
    with pytest.raises(aiodist.InvalidArgumentError) as caught:
        list(three.distribute_datasets_from_function(per_replica, options))
    assert str(caught.value).startswith(
        "distribute_datasets_from_function: the replicas' datasets yielded elements of "
        "different structures at their element 1 (replica 0's: list of 1; replica 1's: "
        "dict with keys 'x'; replica 2's: an empty batch (its dataset ran out)); with "
        "InputReplicationMode.PER_REPLICA each replica takes one element of its own dataset"
    ), caught.value


def test_input_context_batch_size():
    ctx = aiodist.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by .*=4"):
        ctx.get_per_replica_batch_size(10)
    assert "num_replicas_in_sync=4" in repr(ctx)


def test_from_function_bad_arguments(two):
    with pytest.raises(ValueError, match=r"dataset_fn=3 is not callable"):
        two.distribute_datasets_from_function(3)
    with pytest.raises(ValueError, match=r"is not iterable"):
        two.distribute_datasets_from_function(lambda ctx: 5)


def test_a_dataset_fn_result_that_is_no_dataset_is_named_with_its_call(two):
    """The message named the bad value only ("None is not iterable"): not that
    dataset_fn returned it, nor for which replica's InputContext."""

    def dataset_fn(context):
        return [np.ones(2)] if context.input_pipeline_id == 0 else None

    options = aiodist.InputOptions(experimental_replication_mode="per_replica")
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"^distribute_datasets_from_function: dataset_fn=<function .*dataset_fn at .*>, "
        r"called with InputContext\(num_input_pipelines=2, input_pipeline_id=1, "
        r"num_replicas_in_sync=2\), returned None, which is not iterable; expected an "
        r"iterable or async iterable of batches",
    ):
        two.distribute_datasets_from_function(dataset_fn, options)


def test_input_options_fields_as_in_tf():
    default = aiodist.InputOptions()
    assert default.experimental_fetch_to_device is True
    assert default.experimental_place_dataset_on_device is False
    assert aiodist.InputOptions(experimental_fetch_to_device=None).experimental_fetch_to_device
    placed = aiodist.InputOptions(
        experimental_place_dataset_on_device=True,
        experimental_fetch_to_device=False,
        experimental_replication_mode="PER_REPLICA",
    )
    assert placed.experimental_place_dataset_on_device
    for wrong in ({}, {"experimental_replication_mode": "PER_REPLICA"}):
        with pytest.raises(ValueError, match=r"place_dataset_on_device=True needs"):
            aiodist.InputOptions(experimental_place_dataset_on_device=True, **wrong)
    with pytest.raises(ValueError, match=r"experimental_fetch_to_device='yes'; expected a bool"):
        aiodist.InputOptions(experimental_fetch_to_device="yes")


async def test_a_dataset_placed_on_device_by_its_function_is_used_as_it_is(two):
    options = aiodist.InputOptions(
        experimental_place_dataset_on_device=True,
        experimental_fetch_to_device=False,
        experimental_replication_mode="PER_REPLICA",
    )
    made = []

    def dataset_fn(context):
        batch = np.full((2, 1), float(context.input_pipeline_id))
        made.append(batch)
        return [batch]

    dataset = two.distribute_datasets_from_function(dataset_fn, options)
    [element] = [e async for e in dataset]
    for got, batch in zip(two.experimental_local_results(element), made, strict=True):
        assert type(got) is np.ndarray  # as the function made it: no transfer
        np.testing.assert_array_equal(got, batch)
