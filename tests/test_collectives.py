"""merge_call, all_reduce, all_gather and ReduceOp (SPEC §4)."""

from __future__ import annotations

import asyncio
import collections
import gc
import re
import weakref

import numpy as np
import pytest

import aiodist
from tests.conftest import scalar_cases, wait_until


def rid() -> int:
    return aiodist.get_replica_context().replica_id_in_sync_group


def local(strategy, value) -> list:
    return list(strategy.experimental_local_results(value))


# -- all_reduce ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("sum", lambda xs: sum(xs)),
        ("MEAN", lambda xs: sum(xs) / len(xs)),
        ("Min", min),
        ("max", max),
        (aiodist.ReduceOp.PRODUCT, lambda xs: float(np.prod(xs))),
    ],
)
async def test_all_reduce_ops(strategy, num_replicas, op, expected):
    async def fn():
        return await aiodist.get_replica_context().all_reduce(op, np.float64(rid() + 2))

    values = [float(v) for v in local(strategy, await strategy.run(fn))]
    assert values == [expected([i + 2 for i in range(num_replicas)])] * num_replicas


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
async def test_all_reduce_of_numpy_scalars_gives_each_replica_a_read_only_array(
    strategy, num_replicas, op
):
    # NumPy scalars take a path of their own (no asarray); even replicas pass a
    # scalar, odd ones a 0-d array of the same dtype.
    async def fn():
        r = rid()
        value = np.int32(r + 1) if r % 2 == 0 else np.asarray(np.int32(r + 1))
        return await aiodist.get_replica_context().all_reduce(op, value)

    results = local(strategy, await strategy.run(fn))
    numbers = list(range(1, num_replicas + 1))
    expected = {"sum": sum(numbers), "mean": sum(numbers) / num_replicas, "max": num_replicas}
    for result in results:
        assert type(result) is np.ndarray and result.shape == ()
        assert result.dtype == (np.float64 if op == "mean" else np.int32)
        assert result == expected[op]
        assert not result.flags.writeable
    assert len({id(result) for result in results}) == num_replicas


async def test_a_replica_may_cancel_its_wait_and_the_others_still_get_the_result(three):
    async def fn():
        pending = aiodist.get_replica_context().all_reduce("sum", np.float64(1))
        if rid() == 0:
            pending.cancel()  # registered all the same: the call completes without it
            return None
        return float(await pending)

    assert local(three, await three.run(fn)) == [None, 3.0, 3.0]


async def test_a_numpy_scalar_type_seen_before_is_checked_as_a_new_one_is(two):
    # A NumPy scalar type all-reduced before with the same op takes a shortcut to its
    # signature: matching, refusals and options must work as on the first call.
    async def step(op, kind, options=None):
        return await aiodist.get_replica_context().all_reduce(op, kind(rid() + 1), options)

    for _ in range(3):  # the first run fills the shortcut, the others take it
        assert [float(v) for v in local(two, await two.run(step, ("sum", np.float32)))] == [3, 3]
    options = aiodist.CommunicationOptions(timeout_seconds=5)
    assert [float(v) for v in local(two, await two.run(step, ("max", np.float32, options)))] == [
        2,
        2,
    ]

    async def mixed():
        kind = np.float32 if rid() == 0 else np.float64
        return await aiodist.get_replica_context().all_reduce("sum", kind(1))

    with pytest.raises(aiodist.CollectiveMismatchError, match="float64"):
        await two.run(mixed)
    for _ in range(2):  # refused, so never remembered
        with pytest.raises(aiodist.InvalidArgumentError, match="dtype bool"):
            await two.run(step, ("sum", np.bool_))
    with pytest.raises(aiodist.InvalidArgumentError, match="not a reduce op"):
        await two.run(step, (["sum"], np.float32))


@pytest.mark.parametrize(
    ("dtype", "op"),
    scalar_cases(
        (np.float16, np.float32, np.float64, np.complex64, np.int8),
        ("sum", "mean", "product", "min"),
    ),
)
@pytest.mark.parametrize("num_replicas", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("arrays_on", [1, 0], ids=["odd-0d", "even-0d"])
async def test_scalars_reduce_exactly_as_one_element_arrays(num_replicas, dtype, op, arrays_on):
    # Scalars take paths of their own (float ones add in NumPy's scalar arithmetic);
    # each must round exactly as the replica-by-replica reduction of one-element
    # arrays does, also from 8 replicas on (where np.add.reduce would add in partial
    # sums), with odd (or even) replicas passing 0-d arrays, and int8 sums wrapping.
    strategy = aiodist.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])
    imag = 0.001j if dtype == np.complex64 else 0
    big = 100 if dtype == np.int8 else 1e4  # one large value, in which 0.3s get lost
    values = [dtype(big if r == 0 else 0.3 + r / 7 + imag * r) for r in range(num_replicas)]

    async def fn():
        r = rid()
        scalar = np.asarray(values[r]) if r % 2 == arrays_on else values[r]
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce(op, scalar), await ctx.all_reduce(op, values[r][None])

    scalars, vectors = await strategy.run(fn)
    results = local(strategy, scalars)
    expected = local(strategy, vectors)[0]
    for result in results:
        assert type(result) is np.ndarray and result.shape == () and result.dtype == expected.dtype
        assert result.tobytes() == expected.tobytes()
        assert not result.flags.writeable
    assert len({id(result) for result in results}) == num_replicas


async def test_all_reduce_of_python_floats_gives_float64_arrays(two):
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", 0.1 * (rid() + 1))

    results = local(two, await two.run(fn))
    for result in results:
        assert type(result) is np.ndarray and result.dtype == np.float64 and result.shape == ()
        assert float(result) == 0.1 + 0.2 and not result.flags.writeable


class _HalvingOps(aiodist.ReductionToOneDevice):
    """Ops that reduce their own way (a user subclass): half the usual result."""

    def _reduce_arrays(self, op, arrays, target):
        return np.asarray(super()._reduce_arrays(op, arrays, target) / 2)


@pytest.mark.parametrize(
    "ops",
    [_HalvingOps(), aiodist.ReductionToOneDevice(accumulation_fn=lambda xs: sum(xs) / 2)],
    ids=["subclass", "accumulation_fn"],
)
async def test_float_scalars_reach_ops_that_reduce_their_own_way(ops):
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", np.float32(rid() + 1))

    assert [float(v) for v in local(strategy, await strategy.run(fn))] == [1.5, 1.5]


@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_an_accumulation_fn_returning_an_input_changes_no_replica_value(op):
    ops = aiodist.ReductionToOneDevice(accumulation_fn=lambda values: values[0][:])
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    inputs = [np.full(3, 2.0), np.full(3, 4.0)]

    async def fn():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce(op, inputs[rid()]), await ctx.all_reduce(op, [inputs[rid()]])

    single, batched = await strategy.run(fn)
    expected = 2.0 if op == "sum" else 1.0  # replica 0's value, as the function says
    for result in [*local(strategy, single), *local(strategy, batched[0])]:
        np.testing.assert_array_equal(result, [expected] * 3)
        assert not np.shares_memory(result, inputs[0])
    np.testing.assert_array_equal(inputs[0], [2.0] * 3)
    total = await strategy.reduce(op, aiodist.PerReplica(inputs), axis=None)
    np.testing.assert_array_equal(total, [expected] * 3)
    np.testing.assert_array_equal(inputs[0], [2.0] * 3)


def _decoded(values):
    """An array over a bytearray, as one decoded from a request body (its base is
    the bytearray, not an array)."""
    return np.frombuffer(bytearray(np.asarray(values, dtype=np.float64).tobytes()))


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize(
    ("make", "view"),
    [
        (np.array, lambda x: np.frombuffer(x.data, x.dtype)),
        (_decoded, lambda x: np.frombuffer(x, x.dtype)),
        (_decoded, lambda x: x.reshape(x.shape)),
    ],
    ids=[
        "frombuffer-of-its-memoryview",
        "frombuffer-of-a-decoded-input",
        "view-of-a-decoded-input",
    ],
)
async def test_an_accumulation_fn_returning_a_view_of_an_input_changes_no_replica_value(
    op, make, view
):
    """A view of an input whose base is not the input's base (one over a memoryview,
    or over an input that is itself over a buffer) was not seen as the input: MEAN
    divided the caller's array in place, and the results shared its memory."""
    ops = aiodist.ReductionToOneDevice(accumulation_fn=lambda values: view(values[0]))
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    inputs = [make([2.0, 2.0, 2.0]), make([4.0, 4.0, 4.0])]

    async def fn():
        return await aiodist.get_replica_context().all_reduce(op, inputs[rid()])

    expected = 2.0 if op == "sum" else 1.0  # replica 0's value, as the function says
    results = [*local(strategy, await strategy.run(fn))]
    results.append(await strategy.reduce(op, aiodist.PerReplica(inputs), axis=None))
    for result in results:
        np.testing.assert_array_equal(result, [expected] * 3)
        assert not np.shares_memory(result, inputs[0])
    np.testing.assert_array_equal(inputs[0], [2.0] * 3)


@pytest.mark.parametrize(
    "value", [np.ones(5), [np.ones(2), np.ones(3)], [np.ones((2, 2)), np.ones(3)]]
)
async def test_an_accumulation_fn_returning_another_shape_is_refused(value):
    # Batched leaves used to be cut silently from its result (short, or a confusing
    # reshape error), and a single array's result came back in its shape.
    ops = aiodist.ReductionToOneDevice(accumulation_fn=lambda values: values[0][:3] * 2)
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", value)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"accumulation_fn=.* returned a value"):
        await strategy.run(fn)
    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"of shape \(3,\) and dtype float64 for 2 values"
    ):
        await strategy.reduce("sum", aiodist.PerReplica([np.ones(5), np.ones(5)]), axis=None)


def _as_float64(values):
    return np.add.reduce([value.astype(np.float64) for value in values])


@pytest.mark.parametrize(
    ("accumulate", "value", "returned"),
    [
        (_as_float64, np.ones(3, np.float32), "of shape \\(3,\\) and dtype float64"),
        (_as_float64, [np.ones(3, np.float32), np.ones(2, np.float32)], "dtype float64"),
        (lambda values: sum(values) * 1.0, np.ones(3, np.int32), "dtype float64"),
        (lambda values: sum(values).tolist(), np.ones(3, np.float32), "list \\(\\[3.0, "),
        (lambda values: None, np.float32(1), "NoneType \\(None\\)"),
        (lambda values: None, np.array(1.0), "NoneType \\(None\\)"),
    ],
    ids=["dtype", "batched-dtype", "int-to-float", "list", "none-for-a-scalar", "none-for-0-d"],
)
async def test_an_accumulation_fn_returning_another_dtype_or_no_array_is_refused_everywhere(
    accumulate, value, returned
):
    # Its result's dtype became every replica's (float64 for float32 or int32
    # values, in a packed batch for every leaf); a list became a float64 array, and
    # None for scalars an object array, each handed back as the reduced value.
    ops = aiodist.ReductionToOneDevice(accumulation_fn=accumulate)
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=ops)
    pattern = rf"accumulation_fn=<function .*> returned a value.*{returned}.* for 3 values "
    pattern += r".*expected their element-wise sum, an array"

    async def caught():
        with pytest.raises(aiodist.InvalidArgumentError, match=pattern) as error:
            await aiodist.get_replica_context().all_reduce("sum", value)
        return error.value

    errors = local(strategy, await strategy.run(caught))
    assert len({id(error) for error in errors}) == 1  # every replica got the one error

    async def uncaught():
        return await aiodist.get_replica_context().all_reduce("sum", value)

    with pytest.raises(aiodist.InvalidArgumentError, match=pattern):
        await strategy.run(uncaught)
    if not isinstance(value, list):
        with pytest.raises(aiodist.InvalidArgumentError, match=pattern):
            await strategy.reduce("sum", aiodist.PerReplica([value] * 3), axis=None)


class _CountingOps(aiodist.ReductionToOneDevice):
    """Cross-device ops with their own batched all-reduce (as NcclAllReduce has),
    delegating to the inherited one."""

    def __init__(self):
        super().__init__()
        self.batched_calls = 0

    def _all_reduce_flat(self, op, per_replica, devices, options, streams=()):
        self.batched_calls += 1
        return super()._all_reduce_flat(op, per_replica, devices, options, streams)


async def test_ops_with_their_own_batched_all_reduce_serve_single_arrays_too():
    ops = _CountingOps()
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)

    async def fn():
        ctx = aiodist.get_replica_context()
        single = await ctx.all_reduce("sum", np.float64(rid() + 1))
        batched = await ctx.all_reduce("sum", [np.ones(2), np.float64(rid())])
        return single, batched

    single, batched = await strategy.run(fn)
    assert [float(v) for v in local(strategy, single)] == [3.0, 3.0]
    assert [float(v) for v in local(strategy, batched[1])] == [1.0, 1.0]
    assert ops.batched_calls == 2  # the single array went through it as well


async def test_all_reduce_nested_structure_keeps_structure_and_dtypes(strategy, num_replicas):
    async def fn():
        r = rid()
        value = {
            "w": np.full((2, 3), r, dtype=np.float32),
            "b": [np.arange(4, dtype=np.int64) * r, np.float32(1.0)],
            "t": (np.ones(1, dtype=np.float64),),
        }
        return await aiodist.get_replica_context().all_reduce("sum", value)

    total = sum(range(num_replicas))
    result = await strategy.run(fn)
    assert isinstance(result["t"], tuple) and isinstance(result["b"], list)
    w = local(strategy, result["w"])
    b0 = local(strategy, result["b"][0])
    b1 = local(strategy, result["b"][1])
    t0 = local(strategy, result["t"][0])
    for i in range(num_replicas):
        assert w[i].dtype == np.float32 and w[i].shape == (2, 3)
        np.testing.assert_array_equal(w[i], np.full((2, 3), total))
        assert b0[i].dtype == np.int64
        np.testing.assert_array_equal(b0[i], np.arange(4) * total)
        assert b1[i].dtype == np.float32 and float(b1[i]) == num_replicas
        np.testing.assert_array_equal(t0[i], [num_replicas])


async def test_collectives_of_dicts_whose_keys_do_not_sort_built_in_any_order(two):
    """Keys that do not sort together (an int and a str) flattened in insertion order,
    so replicas building one dict in different orders had different structures: a
    CollectiveMismatchError showing two equal dicts. They now flatten alike."""

    async def fn():
        r = rid()
        one, x = np.full(1, r + 1.0), np.full(2, 10.0 * r)
        value = {1: one, "x": x} if r == 0 else {"x": x, 1: one}
        ctx = aiodist.get_replica_context()
        reduced = await ctx.all_reduce("sum", value)
        assert list(reduced) == list(value)  # each replica's dict in its own order
        return reduced, await ctx.all_gather(value, axis=0)

    reduced, gathered = await two.run(fn)
    for part in local(two, reduced):
        np.testing.assert_array_equal(part[1], [3.0])
        np.testing.assert_array_equal(part["x"], [10.0, 10.0])
    for part in local(two, gathered):
        np.testing.assert_array_equal(part[1], [1.0, 2.0])
        np.testing.assert_array_equal(part["x"], [0.0, 0.0, 10.0, 10.0])


async def test_collectives_of_dicts_whose_keys_sort_partly_or_are_nan(two):
    """Frozenset keys (``<`` is a subset test) sorted in insertion order, so replicas
    building one dict in different orders differed; a NaN key (each replica's own
    float("nan"), equal to no other) was missing on the other replica: all_reduce
    and all_gather raised CollectiveMismatchError, merge_call InvalidArgumentError,
    for equal structures. Such keys now match, and real differences still show."""
    a, b = frozenset({1}), frozenset({2})

    def make(r: int, kind: str) -> dict:
        mine, shared = np.full(1, r + 1.0), np.full(1, 10.0)
        if kind == "frozenset":
            return {a: mine, b: shared} if r == 0 else {b: shared, a: mine}
        nan = {"nan": float("nan"), "nan in a tuple": (1, float("nan"))}[kind]
        return {nan: mine, 2.0: shared} if r == 0 else {2.0: shared, nan: mine}

    def replica_1s_values(strategy, value: dict) -> list:
        return sorted(float(strategy.experimental_local_results(x)[1][0]) for x in value.values())

    for kind in ("frozenset", "nan", "nan in a tuple"):

        async def fn(kind=kind):
            value, ctx = make(rid(), kind), aiodist.get_replica_context()
            reduced = await ctx.all_reduce("sum", value)
            assert list(reduced) == list(value)  # each replica's own keys, in its order
            gathered = await ctx.all_gather(value, axis=0)
            merged = await ctx.merge_call(replica_1s_values, args=(value,))
            return [reduced[key] for key in value], [gathered[key] for key in value], merged

        reduced, gathered, merged = await two.run(fn)
        for r, (sums, gathers, seen) in enumerate(
            zip(local(two, reduced), local(two, gathered), local(two, merged), strict=True)
        ):
            mine, shared = (0, 1) if r == 0 else (1, 0)  # each replica's insertion order
            np.testing.assert_array_equal(sums[mine], [3.0])
            np.testing.assert_array_equal(sums[shared], [20.0])
            np.testing.assert_array_equal(gathers[mine], [1.0, 2.0])
            np.testing.assert_array_equal(gathers[shared], [10.0, 10.0])
            assert seen == [2.0, 10.0]

    async def differs():  # a NaN key on both, another key's shape differing
        value = {float("nan"): np.zeros(1), "x": np.zeros(1 + rid())}
        return await aiodist.get_replica_context().all_reduce("sum", value)

    with pytest.raises(
        aiodist.CollectiveMismatchError,
        match=re.escape("they first differ at ['x']: float64[1] on replica 0, float64[2]"),
    ):
        await two.run(differs)


async def test_all_reduce_python_scalars_and_mean_of_ints(two):
    async def fn():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", rid() + 1), await ctx.all_reduce("mean", rid())

    total, mean = await two.run(fn)
    assert [int(v) for v in local(two, total)] == [3, 3]
    assert [float(v) for v in local(two, mean)] == [0.5, 0.5]
    assert local(two, mean)[0].dtype.kind == "f"


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16])
async def test_mean_of_small_integers_does_not_wrap(three, dtype):
    """MEAN sums integers as float64, as NumPy's mean does: 100 + 101 + 102 fits no int8."""
    base = 100 if dtype is np.int8 else 200 if dtype is np.uint8 else 30_000

    async def fn():
        ctx = aiodist.get_replica_context()
        value = dtype(base + rid())
        return (
            await ctx.all_reduce("mean", value),  # one scalar
            await ctx.all_reduce("mean", np.array([value, value])),  # one array
            await ctx.all_reduce("mean", [np.array([value]), np.array([1], dtype)]),  # packed
        )

    scalar, array, packed = await three.run(fn)
    expected = float(base + 1)
    for s, a, p in zip(
        local(three, scalar), local(three, array), local(three, packed[0]), strict=True
    ):
        assert float(s) == expected and s.dtype == np.float64
        np.testing.assert_array_equal(a, [expected, expected])
        np.testing.assert_array_equal(p, [expected])
    values = aiodist.PerReplica([np.array([base + i], dtype) for i in range(3)])
    with three.scope():
        np.testing.assert_array_equal(await three.reduce("mean", values, axis=None), [expected])
        np.testing.assert_array_equal(await three.reduce("mean", values, axis=0), expected)
        reduced = await three.extended.reduce_to("mean", values, "cpu:0")
        np.testing.assert_array_equal(reduced, [expected])


@pytest.mark.parametrize("kind", ["defaultdict", "Counter", "OrderedDict"])
async def test_dict_subclasses_keep_their_type_through_collectives_and_runs(two, kind):
    make = {
        "defaultdict": lambda items: collections.defaultdict(list, items),
        "Counter": collections.Counter,
        "OrderedDict": collections.OrderedDict,
    }[kind]

    async def fn(arg):
        ctx = aiodist.get_replica_context()
        reduced = await ctx.all_reduce("sum", make({"hits": np.int64(rid() + 1)}))
        gathered = await ctx.all_gather(make({"rows": np.array([rid()])}), axis=0)
        return reduced, gathered, make({"own": rid(), "arg": arg["x"]})

    arg = make({"x": aiodist.PerReplica([10, 11])})
    reduced, gathered, returned = await two.run(fn, args=(arg,))
    for value in (reduced, gathered, returned):
        assert type(value) is type(arg)
    if kind == "defaultdict":
        assert reduced.default_factory is list
    assert [int(v) for v in local(two, reduced["hits"])] == [3, 3]
    assert [v.tolist() for v in local(two, gathered["rows"])] == [[0, 1], [0, 1]]
    assert local(two, returned["own"]) == [0, 1] and local(two, returned["arg"]) == [10, 11]


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
async def test_a_structure_changed_after_the_call_gets_the_result_as_passed(two, collective):
    # A replica starts the collective, then changes its dict and list before awaiting.
    async def fn():
        ctx = aiodist.get_replica_context()
        value = {"acc": np.array([1.0]), "loss": [np.array([2.0])]}
        if collective == "all_reduce":
            pending = ctx.all_reduce("sum", value)
        else:
            pending = ctx.all_gather(value, axis=0)
        if rid() == 0:
            del value["acc"]
            value["lr"] = np.array([9.0])
            value["loss"].append(np.array([7.0]))
        return await pending

    result = await two.run(fn)
    expected = [2.0, 4.0] if collective == "all_reduce" else [[1.0, 1.0], [2.0, 2.0]]
    for replica in range(2):
        assert sorted(result) == ["acc", "loss"] and len(result["loss"]) == 1
        got = [local(two, result["acc"])[replica], local(two, result["loss"][0])[replica]]
        assert [np.ravel(g).tolist() for g in got] == [
            np.ravel(e).tolist() for e in np.array(expected)
        ]


@pytest.mark.parametrize("empty", [[], (), {}], ids=["list", "tuple", "dict"])
async def test_all_reduce_of_an_empty_structure_gives_it_back(two, empty):
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", empty)

    assert await two.run(fn) == empty


@pytest.mark.parametrize("bytes_per_pack", [0, 64, 10_000])
async def test_all_reduce_many_tensors_packed(three, bytes_per_pack):
    options = aiodist.CommunicationOptions(bytes_per_pack=bytes_per_pack)

    async def fn():
        r = rid()
        values = [np.full(k + 1, r + k, dtype=np.float32) for k in range(30)]
        values.append(np.full((2, 2), r, dtype=np.int32))
        return await aiodist.get_replica_context().all_reduce("sum", values, options=options)

    result = await three.run(fn)
    for k in range(30):
        for v in local(three, result[k]):
            np.testing.assert_array_equal(v, np.full(k + 1, 3 * k + 3, dtype=np.float32))
    for v in local(three, result[30]):
        assert v.dtype == np.int32
        np.testing.assert_array_equal(v, np.full((2, 2), 3))


@pytest.mark.parametrize("shape", [(2, 3), (4,), ()], ids=["2-d", "1-d", "0-d"])
async def test_all_reduce_of_leaves_of_one_shape_gives_each_replica_its_own_views(three, shape):
    async def fn():
        values = [np.full(shape, rid() + k, dtype=np.float32) for k in range(5)]
        return await aiodist.get_replica_context().all_reduce("sum", values)

    result = await three.run(fn)
    for k, leaf in enumerate(result):
        values = local(three, leaf)
        assert len({id(value) for value in values}) == 3
        for value in values:
            assert type(value) is np.ndarray and value.shape == shape
            assert value.dtype == np.float32 and not value.flags.writeable
            np.testing.assert_array_equal(value, np.full(shape, 3 + 3 * k))


async def test_all_reduce_results_are_per_replica_read_only_views(two):
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", np.ones(3))

    result = await two.run(fn)
    assert isinstance(result, aiodist.PerReplica)
    a, b = local(two, result)
    assert a is not b
    assert not a.flags.writeable and not b.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a += 1
    copy = a.copy()
    copy += 1
    np.testing.assert_array_equal(b, [2, 2, 2])


async def test_all_reduce_input_is_not_modified(two):
    inputs = [np.array([1.0, 2.0]), np.array([3.0, 4.0])]

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", inputs[rid()])

    await two.run(fn)
    np.testing.assert_array_equal(inputs[0], [1.0, 2.0])
    np.testing.assert_array_equal(inputs[1], [3.0, 4.0])


async def test_start_collective_then_await_later(three):
    """Registration happens at call time: replicas can overlap work with a pending reduce."""
    order = []

    async def fn():
        ctx = aiodist.get_replica_context()
        pending = ctx.all_reduce("sum", np.float64(rid()))
        order.append(("registered", rid()))
        second = ctx.all_reduce("max", np.float64(rid()))
        await asyncio.sleep(0)
        return float(await second), float(await pending)

    result = await three.run(fn)
    assert [tuple(pair) for pair in zip(*(local(three, r) for r in result), strict=True)] == [
        (2.0, 3.0)
    ] * 3
    assert len(order) == 3


async def test_bad_reduce_op_and_dtype(two):
    async def bad_op():
        return await aiodist.get_replica_context().all_reduce("median", 1.0)

    with pytest.raises(ValueError, match=r"'median' is not a reduce op.*'SUM', 'MEAN'"):
        await two.run(bad_op)

    async def bad_dtype():
        return await aiodist.get_replica_context().all_reduce("sum", np.array(["a"]))

    with pytest.raises(aiodist.InvalidArgumentError, match=r"dtype <U1 with SUM"):
        await two.run(bad_dtype)


async def test_a_leaf_whose_lists_nest_unevenly_is_refused_naming_the_replica(two):
    """A leaf that is no list or tuple (a deque) but holds ragged lists reached NumPy
    as it was: all_reduce and all_gather raised its bare ValueError ("setting an
    array element with a sequence ... inhomogeneous shape")."""
    ragged = collections.deque([[1.0, 2.0], [3.0]])
    not_one = r"deque\(\[\[1.0, 2.0\], \[3.0\]\]\) is not one array: its lists nest unevenly"

    async def reduce_one():
        return await aiodist.get_replica_context().all_reduce("sum", ragged)

    async def gather_a_leaf():
        return await aiodist.get_replica_context().all_gather({"x": ragged}, axis=0)

    for fn, where in ((reduce_one, "all_reduce"), (gather_a_leaf, "all_gather")):
        with pytest.raises(
            aiodist.InvalidArgumentError, match=rf"{where} on replica \d: {not_one}"
        ):
            await two.run(fn)


class _Point:
    """A leaf all_reduce cannot reduce (NumPy makes it a dtype-object array)."""


@pytest.mark.parametrize(
    ("leaf", "type_name"),
    [(None, "a NoneType"), ({1, 2}, "a set"), (_Point(), "a _Point"), ("abc", "a str")],
    ids=["None", "set", "object", "str"],
)
async def test_an_unreducible_leaf_is_named_by_its_path_and_type(two, leaf, type_name):
    # The message said only "cannot reduce values of dtype object": nothing told the
    # user which of a structure's leaves it was.
    async def fn():
        value = {"a": [np.ones(2), {"b": leaf}], "c": np.zeros(3)}
        return await aiodist.get_replica_context().all_reduce("sum", value)

    path = re.escape("['a'][1]['b']")
    expected = rf"cannot reduce values of dtype \S+ with SUM \(the leaf at {path}: {type_name}\)"
    with pytest.raises(aiodist.InvalidArgumentError, match=expected):
        await two.run(fn)

    async def top_level():
        return await aiodist.get_replica_context().all_reduce("sum", leaf)

    with pytest.raises(aiodist.InvalidArgumentError, match=rf"with SUM \({type_name}\)"):
        await two.run(top_level)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (2**70, r"the int 1180591620717411303424 with SUM"),
        ([1, 2**64], r"the int 18446744073709551616 \(the leaf at \[1\]\) with SUM"),
        ({"a": -(2**63) - 1}, r"the int -9223372036854775809 \(the leaf at \['a'\]\) with SUM"),
        (10**5000, r"the int of 16610 bits with SUM"),  # (str() of it would raise)
    ],
    ids=["int", "in-list", "in-dict", "huge"],
)
async def test_an_int_beyond_64_bits_is_named_with_what_fits(two, value, shown):
    # NumPy holds such an int as dtype object, and the message read "cannot reduce
    # values of dtype object with SUM (an int); expected ... (integers, ...) ... e.g.
    # x.astype(np.int32)": it refused an int saying it expected integers.
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", value)

    expected = rf"^all_reduce on replica 0: cannot reduce {shown}: it fits neither int64 nor "
    expected += r"uint64, .*expected integers from -2\*\*63 to 2\*\*64 - 1\. .*float\(x\)"
    with pytest.raises(aiodist.InvalidArgumentError, match=expected):
        await two.run(fn)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"^reduce: cannot reduce the int 1180"):
        await two.reduce("max", aiodist.PerReplica([2**70, 2**70]), axis=None)


@pytest.mark.parametrize("values", [[2**70, 1], [1, 2**70]], ids=["first", "second"])
async def test_an_int_beyond_64_bits_beside_a_small_one_is_named_by_reduce(two, values):
    # One replica's int beyond 64 bits (dtype object) and the other's int64 were
    # refused as "per-replica values differ in shape or dtype (replica 0: object[];
    # replica 1: int64[])": a dtype the caller never chose, and no word of the int.
    big = values.index(2**70)
    expected = rf"^reduce \(replica {big}'s value\): cannot reduce the int 1180591620717411303424"
    with pytest.raises(aiodist.InvalidArgumentError, match=expected):
        await two.reduce("sum", aiodist.PerReplica(values), axis=None)
    with pytest.raises(aiodist.InvalidArgumentError, match=expected):
        await aiodist.ReductionToOneDevice().reduce("sum", aiodist.PerReplica(values), "cpu:0")


def _layers(change: str) -> dict:
    """300 float32 arrays by name; on replica 1, ``change`` applied to 'layer150'."""
    value = {f"layer{i}": np.zeros((2, 3), np.float32) for i in range(300)}
    if rid() == 1:
        if change == "shape":
            value["layer150"] = np.zeros((2, 4), np.float32)
        elif change == "dtype":
            value["layer150"] = np.zeros((2, 3), np.float64)
        else:
            del value["layer150"]
    return value


@pytest.mark.parametrize(
    ("change", "theirs"),
    [("shape", "float32[2, 4]"), ("dtype", "float64[2, 3]"), ("missing", "missing")],
)
async def test_a_mismatch_of_long_structures_names_where_they_first_differ(two, change, theirs):
    # Each replica's call is shown cut at 160 characters: for 300 arrays both read
    # "{'layer0': float32[2, 3], ... 'lay…", and the message did not say where they differ.
    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", _layers(change))

    with pytest.raises(aiodist.CollectiveMismatchError) as info:
        await two.run(fn)
    message = str(info.value)
    assert "replica 0 called all_reduce(SUM, {'layer0': float32[2, 3]" in message  # as before
    expected = (
        f"they first differ at ['layer150']: float32[2, 3] on replica 0, {theirs} on replica 1"
    )
    assert expected in message

    async def gather():  # the same for all_gather, where the gathered axis may differ
        value = _layers(change)
        value["layer7"] = np.zeros((2 + rid(), 3), np.float32)
        return await aiodist.get_replica_context().all_gather(value, axis=0)

    with pytest.raises(aiodist.CollectiveMismatchError) as info:
        await two.run(gather)
    assert expected in str(info.value)


async def test_a_mismatch_of_nested_lists_names_the_path_of_the_difference(two):
    def leaf_differs():
        value = [[np.zeros(2), np.zeros(2)] for _ in range(40)]
        if rid() == 1:
            value[3][1] = np.zeros(2, np.int64)
            value[30].append(np.zeros(2))  # a later difference: not the first
        return value

    cases = [
        (leaf_differs, "[3][1]: float64[2] on replica 0, int64[2] on replica 1"),
        (
            lambda: {"a": [np.zeros(2)] * (3 + rid()), "b": ()},
            "['a'][3]: missing on replica 0, float64[2] on replica 1",
        ),
        (
            lambda: {"a": [np.zeros(2)], "b": {"c": np.zeros(2)} if rid() else [np.zeros(2)]},
            "['b']: a list of 1 on replica 0, a dict of 1 on replica 1",
        ),
    ]
    for make, where in cases:

        async def fn(make=make):
            return await aiodist.get_replica_context().all_reduce("max", make())

        with pytest.raises(
            aiodist.CollectiveMismatchError, match=re.escape(f"they first differ at {where}")
        ):
            await two.run(fn)


def test_reduce_op_strings_any_case():
    assert aiodist.ReduceOp("sum") is aiodist.ReduceOp.SUM
    assert aiodist.ReduceOp("Product") is aiodist.ReduceOp.PRODUCT
    assert aiodist.ReduceOp.of(aiodist.ReduceOp.MIN) is aiodist.ReduceOp.MIN
    with pytest.raises(ValueError, match=r"expected a ReduceOp or one of the strings"):
        aiodist.ReduceOp.of(3)


# -- all_gather -----------------------------------------------------------------------


async def test_all_gather_uneven_along_axis(three):
    async def fn():
        r = rid()
        value = np.full((2, r + 1), r, dtype=np.int32)
        return await aiodist.get_replica_context().all_gather(value, axis=1)

    expected = np.array([[0, 1, 1, 2, 2, 2]] * 2, dtype=np.int32)
    for v in local(three, await three.run(fn)):
        np.testing.assert_array_equal(v, expected)
        assert v.dtype == np.int32


async def test_all_gather_negative_axis_and_nested(two):
    async def fn():
        r = rid()
        value = {"a": np.full((1, 2), r), "b": [np.arange(3) + 10 * r]}
        return await aiodist.get_replica_context().all_gather(value, axis=-1)

    result = await two.run(fn)
    for a in local(two, result["a"]):
        np.testing.assert_array_equal(a, [[0, 0, 1, 1]])
    for b in local(two, result["b"][0]):
        np.testing.assert_array_equal(b, [0, 1, 2, 10, 11, 12])


@pytest.mark.parametrize("make", [list, tuple], ids=["list", "tuple"])
@pytest.mark.parametrize("count", [0, 1, 2])
async def test_all_gather_of_short_flat_sequences(two, make, count):
    async def fn():
        values = make(np.full(2, rid() * 10 + i) for i in range(count))
        return await aiodist.get_replica_context().all_gather(values, axis=0)

    result = await two.run(fn)
    assert type(result) is make and len(result) == count
    for i, leaf in enumerate(result):
        for v in local(two, leaf):
            np.testing.assert_array_equal(v, [i, i, 10 + i, 10 + i])


async def test_all_gather_axis_may_be_named_from_either_end(three):
    """axis=-1 and axis=1 are the same axis of a rank-2 value: replicas may differ."""

    async def fn():
        r = rid()
        axis = [-1, 1, -1][r]
        return await aiodist.get_replica_context().all_gather(np.full((2, r + 1), r), axis)

    for v in local(three, await three.run(fn)):
        np.testing.assert_array_equal(v, [[0, 1, 1, 2, 2, 2]] * 2)

    async def different_axes():
        return await aiodist.get_replica_context().all_gather(np.ones((2, 2)), axis=rid() % 2)

    with pytest.raises(aiodist.CollectiveMismatchError, match=r"all_gather\(axis=1"):
        await three.run(different_axes)


async def test_all_gather_rejects_rank0_and_bad_axis(two):
    async def rank0():
        return await aiodist.get_replica_context().all_gather(np.float32(1), axis=0)

    with pytest.raises(ValueError, match=r"rank-0 value \(float32\[\]\).*x\[None\]"):
        await two.run(rank0)

    async def bad_axis():
        return await aiodist.get_replica_context().all_gather(np.ones((2, 2)), axis=2)

    with pytest.raises(ValueError, match=r"axis=2 is out of range for a value of shape \(2, 2\)"):
        await two.run(bad_axis)

    async def bool_axis():
        return await aiodist.get_replica_context().all_gather(np.ones((2, 2)), axis=True)

    with pytest.raises(ValueError, match=r"axis=True; expected an int"):
        await two.run(bool_axis)


async def test_a_collectives_future_passed_on_unawaited_is_refused_saying_so(two):
    # A collective's future given to the next one was a 0-d object array: "cannot
    # reduce values of dtype object ... convert it with x.astype(np.int32)" (or
    # "rank-0 value ... x[None]" for all_gather), which hides the missing await.
    async def all_reduce_of_a_future():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", {"g": [1.0, ctx.all_reduce("sum", 1.0)]})

    async def all_gather_of_a_future():
        ctx = aiodist.get_replica_context()
        return await ctx.all_gather(ctx.all_reduce("sum", 1.0), axis=0)

    for fn, where in [
        (all_reduce_of_a_future, r"all_reduce on replica \d \(the leaf at \['g'\]\[1\]\)"),
        (all_gather_of_a_future, r"all_gather on replica \d"),
    ]:
        with pytest.raises(aiodist.InvalidArgumentError) as caught:
            await two.run(fn)
        assert re.match(
            rf"{where}: the value is a Future \(.*\), not its result\. Probably an `await` "
            r"is missing: .*`total = await ctx\.all_reduce\(\.\.\.\)`",
            str(caught.value),
        ), caught.value


# -- merge_call --------------------------------------------------------------------------


async def test_merge_fn_runs_once_in_cross_replica_context(strategy, num_replicas):
    calls = []

    def merge_fn(dist, value, *, scale, mine):
        calls.append(dist)
        assert aiodist.in_cross_replica_context()
        assert aiodist.get_replica_context() is None
        assert aiodist.get_strategy() is dist
        assert dist.experimental_local_results(mine) == tuple(range(num_replicas))
        parts = dist.experimental_local_results(value)
        return sum(parts) * scale

    async def fn():
        return await aiodist.get_replica_context().merge_call(
            merge_fn, args=(rid() + 1,), kwargs={"scale": 10, "mine": rid()}
        )

    result = await strategy.run(fn)
    assert calls == [strategy]
    assert result == 10 * num_replicas * (num_replicas + 1) // 2


async def test_merge_call_passes_keywords_of_a_dict_that_claims_to_equal_any(two):
    class AlwaysEqual(dict):  # a dict subclass with an __eq__ of its own
        def __eq__(self, other):
            return True

        __hash__ = None

    async def fn():
        keywords = AlwaysEqual(scale=rid() + 1)
        return await aiodist.get_replica_context().merge_call(
            lambda strategy, **kw: sorted(kw), kwargs=keywords
        )

    assert await two.run(fn) == ["scale"]


async def test_merge_call_identical_args_stay_single(two):
    seen = {}
    shared = object()

    def merge_fn(dist, same, differs):
        seen["same"] = same
        seen["differs"] = differs

    async def fn():
        await aiodist.get_replica_context().merge_call(merge_fn, args=(shared, [rid()]))

    await two.run(fn)
    assert seen["same"] is shared
    assert isinstance(seen["differs"][0], aiodist.PerReplica)


async def test_a_merge_fn_is_not_kept_alive_after_its_run(two):
    # merge_call remembers the last function passed (its signature, for the next
    # replicas): the run keeps the function itself and frees it as it ends (no
    # garbage collection needed); past the run only its code and name are kept.
    class Big:
        pass

    def make_merge_fn():
        big = Big()

        def merge_fn(strategy):
            return big is not None

        return merge_fn, weakref.ref(big)

    merge_fn, big = make_merge_fn()

    async def fn(merge_fn):
        return await aiodist.get_replica_context().merge_call(merge_fn)

    assert await two.run(fn, args=(merge_fn,)) is True
    del merge_fn
    assert big() is None


async def test_functions_a_run_passes_in_turn_are_each_matched(two):
    def merge_a(strategy):
        return "a"

    def merge_b(strategy):
        return "b"

    async def in_turn():
        ctx = aiodist.get_replica_context()
        return [await ctx.merge_call(f) for f in (merge_a, merge_a, merge_b, merge_a)]

    assert await two.run(in_turn) == ["a", "a", "b", "a"]

    async def then_differ():  # the run has just seen merge_a from both replicas
        ctx = aiodist.get_replica_context()
        first = await ctx.merge_call(merge_a)
        return first, await ctx.merge_call(merge_b if rid() else merge_a)

    with pytest.raises(aiodist.CollectiveMismatchError, match=r"collective #1 does not match"):
        await two.run(then_differ)


async def test_the_last_merge_fn_against_another_is_still_a_mismatch(two):
    def merge_a(strategy):
        return "a"

    def merge_b(strategy):
        return "b"

    async def same():
        return await aiodist.get_replica_context().merge_call(merge_a)

    async def differ():
        return await aiodist.get_replica_context().merge_call(merge_a if rid() else merge_b)

    assert await two.run(same) == "a"  # merge_a is now the function merge_call knows
    with pytest.raises(aiodist.CollectiveMismatchError) as info:
        await two.run(differ)
    message = str(info.value)
    assert re.search(r"replica 0 called merge_call\([\w.<>]*\.merge_b \(", message)
    assert re.search(r"replica 1 called merge_call\([\w.<>]*\.merge_a \(", message)
    assert await two.run(same) == "a"


async def test_merge_call_of_none_is_refused_when_the_last_function_has_died(two):
    # The remembered function's weak reference answers None once it is gone, as
    # before any merge_call: None must not pass for it.
    def make():
        def merge_fn(strategy):
            return 1

        return merge_fn

    merge_fn = make()

    async def remembered(merge_fn):
        return await aiodist.get_replica_context().merge_call(merge_fn)

    assert await two.run(remembered, args=(merge_fn,)) == 1
    del merge_fn
    gc.collect()

    async def none():
        return await aiodist.get_replica_context().merge_call(None)

    with pytest.raises(aiodist.InvalidArgumentError, match="merge_fn=None is not callable"):
        await two.run(none)
    with pytest.raises(aiodist.InvalidArgumentError, match="merge_fn=None is not callable"):
        await aiodist.get_replica_context().merge_call(None)


async def test_a_remembered_function_renamed_matches_its_new_name(two):
    def merge_fn(strategy):
        return "a"

    async def step(fn):
        return await aiodist.get_replica_context().merge_call(fn)

    assert await two.run(step, args=(merge_fn,)) == "a"
    merge_fn.__qualname__ = "renamed"

    def other(strategy):
        return "b"

    # Another function of the same code under the new name: the same merge_call.
    other.__code__, other.__qualname__ = merge_fn.__code__, "renamed"
    assert await two.run(step, args=(aiodist.PerReplica([merge_fn, other]),)) == "a"


async def test_async_merge_fn_and_per_replica_results_unwrapped(strategy, num_replicas):
    async def merge_fn(dist, value):
        await asyncio.sleep(0)
        total = await dist.reduce("sum", value, axis=None)
        doubled = aiodist.PerReplica([2 * v for v in dist.experimental_local_results(value)])
        return {"total": total, "mine": doubled}

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn, args=(rid(),))

    result = await strategy.run(fn)
    expected_total = sum(range(num_replicas))
    if num_replicas == 1:
        assert int(result["total"]) == 0 and result["mine"] == 0
        return
    # The same host array reached every replica, so it regroups to that one object.
    assert isinstance(result["total"], np.ndarray) and int(result["total"]) == expected_total
    assert local(strategy, result["mine"]) == [2 * i for i in range(num_replicas)]


async def test_merge_fn_exception_reaches_every_replica(three):
    boom = RuntimeError("merge failed")
    caught = []

    def merge_fn(dist):
        raise boom

    async def fn():
        try:
            await aiodist.get_replica_context().merge_call(merge_fn)
        except RuntimeError as exc:
            caught.append(exc)
        return "recovered"

    assert await three.run(fn) == "recovered"
    assert caught == [boom, boom, boom]
    assert all(exc is boom for exc in caught)


async def test_merge_call_bad_arguments(two):
    async def not_callable():
        await aiodist.get_replica_context().merge_call(42)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"merge_fn=42 is not callable"):
        await two.run(not_callable)

    async def bad_args():
        await aiodist.get_replica_context().merge_call(print, args=7)

    with pytest.raises(ValueError, match=r"args must be a list or tuple, got int"):
        await two.run(bad_args)


async def test_collective_outside_its_replica_function_raises(two):
    async def merge_fn(dist, ctxs):
        ctx = dist.experimental_local_results(ctxs)[0]
        ctx.all_reduce("sum", 1.0)

    async def fn():
        ctx = aiodist.get_replica_context()
        await ctx.merge_call(merge_fn, args=(ctx,))

    with pytest.raises(aiodist.ContextError, match=r"outside that replica's function"):
        await two.run(fn)


async def test_default_replica_context_collectives():
    """Outside any scope there is one replica: collectives are identities, merge runs inline."""
    ctx = aiodist.get_replica_context()
    assert ctx.num_replicas_in_sync == 1 and ctx.replica_id_in_sync_group == 0
    np.testing.assert_array_equal(await ctx.all_reduce("sum", np.array([1.0, 2.0])), [1.0, 2.0])
    np.testing.assert_array_equal(await ctx.all_gather(np.array([1, 2]), axis=0), [1, 2])

    def merge_fn(strategy, x):
        assert aiodist.in_cross_replica_context()
        return (strategy, x + 1)

    strategy, value = await ctx.merge_call(merge_fn, args=(1,))
    assert strategy is aiodist.get_strategy() and value == 2

    async def async_merge(strategy):
        await asyncio.sleep(0)
        return aiodist.in_cross_replica_context()

    assert await ctx.merge_call(async_merge) is True
    assert not aiodist.in_cross_replica_context()


async def test_collectives_in_a_helper_coroutine(two):
    """Collectives called from helpers awaited by the replica function count for it."""
    reached = []

    async def helper(x):
        reached.append(rid())
        return await aiodist.get_replica_context().all_reduce("sum", x)

    async def fn():
        return float(await helper(1.0)) + float(await helper(2.0))

    result = await two.run(fn)
    await wait_until(lambda: len(reached) == 4, "4 helper calls")
    assert local(two, result) == [6.0, 6.0]


async def test_async_merge_fn_runs_in_its_own_task(two):
    """A timeout inside merge_fn cancels merge_fn, never the replica that arrived last."""
    tasks = []

    async def merge_fn(strategy):
        tasks.append(asyncio.current_task())
        try:
            async with asyncio.timeout(0.01):
                await asyncio.Event().wait()
        except TimeoutError:
            return "timed out inside merge_fn"

    async def fn():
        return await aiodist.get_replica_context().merge_call(merge_fn)

    assert await two.run(fn) == "timed out inside merge_fn"
    assert tasks[0].get_name() == "aiodist-merge_fn"


async def test_async_merge_fn_that_never_suspends(two):
    """Its task starts eagerly, with that task current (asyncio's eager_start on
    Python 3.12+, aiodist's own on 3.11), so the replicas are answered before the
    last one's merge_call returns."""
    merge_tasks, seen = [], {}

    async def merge_fn(strategy, value):
        merge_tasks.append(asyncio.current_task())
        return await strategy.reduce("sum", value, axis=None)

    async def fn():
        pending = aiodist.get_replica_context().merge_call(merge_fn, args=(rid() + 1.0,))
        seen[rid()] = (pending.done(), asyncio.current_task())
        return await pending

    assert await two.run(fn) == 3.0  # one result, the same for both
    assert [seen[r][0] for r in (0, 1)] == [False, True]  # replica 1 arrived last
    [task] = merge_tasks
    assert task not in (seen[0][1], seen[1][1]) and task.done()
