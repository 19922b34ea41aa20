"""Cross-replica API and cross-device ops on CPU devices (SPEC §5, §6)."""

from __future__ import annotations

import gc
import re
import warnings

import numpy as np
import pytest

import aiodist
from tests.conftest import cpu_devices, scalar_cases


def per_replica(strategy, fn):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: fn(ctx.replica_id_in_sync_group)
    )


async def test_reduce_without_axis(strategy, num_replicas):
    value = per_replica(strategy, lambda r: np.array([r, 2 * r], dtype=np.float32))
    total = await strategy.reduce("sum", value, axis=None)
    s = sum(range(num_replicas))
    np.testing.assert_array_equal(total, [s, 2 * s])
    assert isinstance(total, np.ndarray) and total.dtype == np.float32
    mean = await strategy.reduce(aiodist.ReduceOp.MEAN, value, axis=None)
    np.testing.assert_allclose(mean, [s / num_replicas, 2 * s / num_replicas])
    biggest = await strategy.reduce("max", value, axis=None)
    np.testing.assert_array_equal(biggest, [num_replicas - 1, 2 * (num_replicas - 1)])


@pytest.mark.parametrize(
    ("dtype", "op"),
    [
        *scalar_cases(
            (np.float16, np.float32, np.complex64, np.int8, np.uint64),
            ("sum", "mean", "product", "max"),
        ),
        (np.bool_, "min"),
    ],
)
@pytest.mark.parametrize("num_replicas", [2, 3, 9])
async def test_reduce_of_numpy_scalars_matches_0d_arrays(num_replicas, dtype, op):
    # NumPy scalars of one type (a per-replica loss) take a path of their own; the
    # result must have the bytes and dtype of the general path's (0-d arrays), int8
    # sums wrapping and int means in float64, and be a new writable array.
    strategy = aiodist.MirroredStrategy(cpu_devices(num_replicas))
    if dtype in (np.int8, np.uint64):  # sums and products wrap around
        values = [np.iinfo(dtype).max - dtype(r) for r in range(num_replicas)]
    else:
        values = [dtype(1e4 if r == 0 else 0.3 + r / 7) for r in range(num_replicas)]
    if dtype == np.complex64:
        values = [v + dtype(0.001j * r) for r, v in enumerate(values)]
    scalars, arrays = aiodist.PerReplica(values), aiodist.PerReplica(list(map(np.asarray, values)))
    result = await strategy.reduce(op, scalars, axis=None)
    expected = await strategy.reduce(op, arrays, axis=None)
    assert type(result) is np.ndarray and result.shape == () and result.dtype == expected.dtype
    assert result.tobytes() == expected.tobytes()
    assert result.flags.writeable and not any(result is v or result.base is v for v in values)


async def test_reduce_of_numpy_scalars_checks_them_and_uses_the_strategys_ops(two):
    # float32 sums remembered first: every check below applies to a remembered pair too
    pair = aiodist.PerReplica([np.float32(1), np.float32(2)])
    assert float(await two.reduce("sum", pair, axis=None)) == 3.0
    bools = aiodist.PerReplica([np.bool_(True), np.bool_(False)])
    for _ in range(2):  # refused, so never remembered
        with pytest.raises(ValueError, match="cannot reduce values of dtype bool with SUM"):
            await two.reduce("sum", bools, axis=None)
    mixed = aiodist.PerReplica([np.float32(1), np.float64(2)])
    with pytest.raises(ValueError, match=r"differ in shape or dtype \(replica 0: float32"):
        await two.reduce("sum", mixed, axis=None)

    class Halving(aiodist.ReductionToOneDevice):  # reduces its own way
        def _reduce_arrays(self, op, arrays, target):
            return np.asarray(super()._reduce_arrays(op, arrays, target) / 2)

    ones = aiodist.PerReplica([np.float32(1), np.float32(1)])
    for ops in Halving(), aiodist.ReductionToOneDevice(accumulation_fn=lambda xs: sum(xs) / 2):
        strategy = aiodist.MirroredStrategy(cpu_devices(2), cross_device_ops=ops)
        assert float(await strategy.reduce("sum", ones, axis=None)) == 1.0
    with pytest.raises(ValueError, match="3 values was passed to a strategy with 2"):
        await two.reduce("sum", aiodist.PerReplica([np.float32(1)] * 3), axis=None)


async def test_reduce_with_axis_uses_true_element_count(three):
    """Uneven per-replica batches: MEAN over axis=0 divides by all 6 elements."""
    parts = [np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0]), np.array([6.0])]
    value = aiodist.PerReplica(parts)
    assert float(await three.reduce("mean", value, axis=0)) == 3.5
    assert float(await three.reduce("sum", value, axis=0)) == 21.0
    assert float(await three.reduce("min", value, axis=0)) == 1.0
    assert float(await three.reduce("product", value, axis=[0])) == 720.0


async def test_reduce_mean_with_axis_sums_across_replicas_with_the_strategys_ops():
    """MEAN with axis adds the replicas' sums with the strategy's cross-device ops (TF
    sums its numerator with them), as SUM with axis and MEAN without do: a subclass's
    reduction and an accumulation_fn apply to it too. (It added them with Python's
    sum, so a Halving subclass halved SUM with axis and MEAN without, not this.)"""

    class Halving(aiodist.ReductionToOneDevice):  # reduces its own way
        def _reduce_arrays(self, op, arrays, target):
            return np.asarray(super()._reduce_arrays(op, arrays, target) / 2)

    calls = []

    def add_n(values):
        calls.append(len(values))
        return np.add.reduce(values)

    value = aiodist.PerReplica([np.array([1.0, 2.0]), np.array([3.0])])
    halving = aiodist.MirroredStrategy(cpu_devices(2), cross_device_ops=Halving())
    assert float(await halving.reduce("sum", value, axis=0)) == 3.0  # (1 + 2 + 3) / 2
    assert float(await halving.reduce("mean", value, axis=0)) == 1.0  # (1 + 2 + 3) / 2 / 3
    ops = aiodist.ReductionToOneDevice(accumulation_fn=add_n)
    strategy = aiodist.MirroredStrategy(cpu_devices(2), cross_device_ops=ops)
    assert float(await strategy.reduce("mean", value, axis=0)) == 2.0
    assert calls == [2]


async def test_reduce_gives_an_array_where_a_subclass_reduces_to_a_numpy_scalar():
    """A CrossDeviceOps subclass's _reduce_arrays may give a NumPy scalar (np.sum of
    0-d arrays); strategy.reduce still returns a NumPy array, as reduce_to and the
    replicas' all_reduce do. (It returned the np.float32 itself.)"""

    class Stacking(aiodist.CrossDeviceOps):
        def _reduce_arrays(self, op, arrays, target):
            return getattr(np, op.ufunc).reduce(np.stack(arrays))  # 0-d inputs: a scalar

    strategy = aiodist.MirroredStrategy(cpu_devices(2), cross_device_ops=Stacking())
    scalars = aiodist.PerReplica([np.float32(1), np.float32(2)])
    rows = aiodist.PerReplica([np.array([1.0, 2.0], np.float32), np.array([3.0], np.float32)])
    for op, value, axis, expected in [
        ("sum", scalars, None, 3.0),
        ("max", rows, 0, 3.0),
        ("mean", rows, 0, 2.0),
    ]:
        result = await strategy.reduce(op, value, axis=axis)
        assert type(result) is np.ndarray, (op, axis, type(result))
        assert result.dtype == np.float32 and result.shape == () and float(result) == expected
        assert result.flags.writeable


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
async def test_reduce_mean_with_axis_sums_large_integers_without_wrapping(two, dtype):
    big = np.iinfo(dtype).max // 2  # two of them overflow the dtype
    value = aiodist.PerReplica([np.array([big, big], dtype), np.array([big], dtype)])
    expected = np.mean(np.array([big] * 3, dtype))
    assert float(await two.reduce("mean", value, axis=0)) == expected


async def test_reduce_with_axis_over_an_empty_share(three):
    """Two rows over three replicas (as experimental_distribute_dataset splits them):
    MIN and MAX skip the empty share, as TF does (its identity is the dtype's extreme)."""
    value = aiodist.PerReplica([np.array([[5.0]]), np.array([[1.0]]), np.zeros((0, 1))])
    np.testing.assert_array_equal(await three.reduce("max", value, axis=0), [5.0])
    np.testing.assert_array_equal(await three.reduce("min", value, axis=0), [1.0])
    np.testing.assert_array_equal(await three.reduce("sum", value, axis=0), [6.0])
    empty = aiodist.PerReplica([np.zeros((0,), np.int16)] * 3)
    assert int(await three.reduce("max", empty, axis=0)) == np.iinfo(np.int16).min
    assert float(await three.reduce("min", aiodist.PerReplica([np.zeros(0)] * 3), axis=0)) == np.inf


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.float32])
@pytest.mark.parametrize("op", ["sum", "product", "max"])
async def test_reduce_with_axis_keeps_the_dtype_as_without_it(two, dtype, op):
    value = aiodist.PerReplica([np.array([1, 2], dtype), np.array([3], dtype)])
    with_axis = await two.reduce(op, value, axis=0)
    without = await two.reduce(op, aiodist.PerReplica([np.array(1, dtype), np.array(3, dtype)]))
    assert with_axis.dtype == without.dtype == np.dtype(dtype)
    assert with_axis == {"sum": 6, "product": 6, "max": 3}[op]


async def test_reduce_with_axis_on_matrices(two):
    value = aiodist.PerReplica([np.ones((2, 3)), 2 * np.ones((4, 3))])
    np.testing.assert_allclose(await two.reduce("sum", value, axis=0), [10.0, 10.0, 10.0])
    np.testing.assert_allclose(await two.reduce("mean", value, axis=0), [10 / 6] * 3)
    assert float(await two.reduce("mean", value, axis=(0, 1))) == pytest.approx(30 / 18)


@pytest.mark.parametrize("kind", ["one_device", "default"])
async def test_every_cross_replica_call_on_a_one_replica_strategy(kind):
    """SPEC 1, 3, 5: OneDeviceStrategy and the default strategy (get_strategy() outside
    any scope) serve the whole API as one replica: run and the values it makes are
    plain, reductions give the value itself (MEAN with axis over its own elements),
    and variables made in the scope are updated in replica context."""
    strategy = aiodist.OneDeviceStrategy("/cpu:3") if kind == "one_device" else None
    strategy = strategy or aiodist.get_strategy()
    device = "/device:CPU:3" if kind == "one_device" else "/device:CPU:0"
    batch = np.arange(6.0).reshape(3, 2)

    async def step(x, scale=1.0):
        ctx = aiodist.get_replica_context()
        total = await ctx.all_reduce("sum", x)
        return total * scale, ctx.replica_id_in_sync_group, ctx.devices

    result, replica_id, devices = await strategy.run(step, args=(batch,), kwargs={"scale": 2.0})
    np.testing.assert_array_equal(result, 2 * batch)
    assert (replica_id, devices) == (0, (device,))
    again = await strategy.extended.call_for_each_replica(step, args=(batch,))
    np.testing.assert_array_equal(again[0], batch)
    np.testing.assert_array_equal(await strategy.reduce("sum", batch, axis=0), [6.0, 9.0])
    np.testing.assert_array_equal(await strategy.reduce("mean", batch, axis=0), [2.0, 3.0])
    assert float(await strategy.reduce("mean", batch, axis=(0, 1))) == 2.5
    np.testing.assert_array_equal(await strategy.reduce("max", batch, axis=None), batch)
    np.testing.assert_array_equal(await strategy.gather(batch, axis=1), batch)
    assert strategy.experimental_local_results(batch) == (batch,)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert value == (0, 1)  # one replica: the value itself
    extended = strategy.extended
    for destinations in (device, batch, "cpu:0"):
        np.testing.assert_array_equal(await extended.reduce_to("sum", batch, destinations), batch)
    pairs = [(batch, device), (batch[0], batch)]
    reduced = await extended.batch_reduce_to("mean", pairs)
    np.testing.assert_array_equal(reduced[0], batch)
    np.testing.assert_array_equal(reduced[1], batch[0])
    np.testing.assert_array_equal(await extended.broadcast_to(batch, device), batch)
    with strategy.scope():
        v = aiodist.Variable(np.zeros(2), aggregation="sum")
    assert v.devices == (device,)
    updated = await extended.update(v, lambda copy, x: copy.assign_add(x), args=(np.ones(2),))
    np.testing.assert_array_equal(np.asarray(updated), [1.0, 1.0])
    np.testing.assert_array_equal(await extended.reduce_to("sum", batch[0], v), batch[0])

    async def add(x):
        await v.assign_add(x)
        return v.read_value()

    np.testing.assert_array_equal(await strategy.run(add, args=(np.ones(2),)), [2.0, 2.0])
    assert strategy.experimental_local_results(v)[0].tolist() == [2.0, 2.0]


async def test_reduce_plain_values(two):
    one = aiodist.OneDeviceStrategy("cpu:0")
    assert float(await one.reduce("sum", 4.0, axis=None)) == 4.0
    assert float(await two.reduce("mean", 4.0, axis=None)) == 4.0
    # MEAN of integers is a float whatever the replica count.
    for strategy in (one, two, aiodist.get_strategy()):
        mean = await strategy.reduce("mean", np.array([1, 2]), axis=None)
        assert mean.dtype == np.float64 and mean.tolist() == [1.0, 2.0]
    with pytest.raises(aiodist.InvalidArgumentError, match=r"cannot be reduced with SUM across 2"):
        await two.reduce("sum", 4.0, axis=None)


async def test_reduce_errors(two):
    uneven = aiodist.PerReplica([np.ones(2), np.ones(3)])
    with pytest.raises(ValueError, match=r"differ in shape or dtype \(replica 0: float64\[2\]"):
        await two.reduce("sum", uneven, axis=None)
    with pytest.raises(ValueError, match=r"axis=1 is out of range"):
        await two.reduce("sum", uneven, axis=1)
    with pytest.raises(ValueError, match=r"is not a reduce op"):
        await two.reduce("avg", uneven, axis=0)
    with pytest.raises(ValueError, match=r"axis=True; expected an int"):  # not axis 1
        await two.reduce("sum", uneven, axis=True)
    with pytest.raises(ValueError, match=r"value_fn=5 is not callable"):
        two.experimental_distribute_values_from_function(5)


@pytest.mark.parametrize("axis", [0, -1, (0,)])
async def test_reduce_with_axis_of_rank0_values_says_they_have_none(two, axis):
    # A per-replica loss with axis=0 was refused as "axis=0 is out of range for a
    # value of shape (); expected 0 <= axis < 0", a range no axis is in.
    losses = aiodist.PerReplica([np.float32(1), np.float32(2)])
    with pytest.raises(aiodist.InvalidArgumentError) as raised:
        await two.reduce("sum", losses, axis=axis)
    message = str(raised.value)
    assert "rank-0 values (float32[])" in message and "with axis=None" in message
    assert "0 <= axis < 0" not in message
    assert float(await two.reduce("sum", losses, axis=None)) == 3.0


async def test_components_whose_lists_nest_unevenly_are_refused_naming_the_replica(two):
    """A PerReplica component that is a ragged list reached NumPy as it was: strategy.
    reduce and gather, reduce_to, batch_reduce_to, broadcast_to and the cross-device
    ops raised NumPy's bare ValueError ("setting an array element with a sequence
    ... inhomogeneous shape"), naming neither the replica nor what was expected."""
    ragged = aiodist.PerReplica([[[1, 2], [3, 4]], [[1, 2], [3]]])  # replica 1's is ragged
    not_one = r"is not one array: its lists nest unevenly.*expected an array, a number"
    whose = r"replica 1's value \[\[1, 2\], \[3\]\] " + not_one
    ops = aiodist.ReductionToOneDevice()
    calls = [
        ("strategy.reduce", lambda: two.reduce("sum", ragged, axis=None)),
        ("strategy.reduce", lambda: two.reduce("mean", ragged, axis=0)),
        ("strategy.gather", lambda: two.gather(ragged, axis=0)),
        ("reduce", lambda: two.extended.reduce_to("sum", ragged, "cpu:0")),
        ("reduce", lambda: two.extended.batch_reduce_to("sum", [(ragged, "cpu:0")])),
        ("reduce", lambda: ops.reduce("sum", ragged, "cpu:0")),
        ("gather", lambda: ops.gather(ragged, "cpu:0", axis=0)),
    ]
    for where, call in calls:
        with pytest.raises(aiodist.InvalidArgumentError, match=f"^{where}: {whose}"):
            await call()
    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"^broadcast: \[\[1, 2\], \[3\]\] " + not_one
    ):
        await two.extended.broadcast_to([[1, 2], [3]], ["cpu:0", "cpu:1"])
    even = aiodist.PerReplica([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])  # lists of one shape
    np.testing.assert_array_equal(await two.reduce("sum", even, axis=None), [[6, 8], [10, 12]])


async def test_structures_of_distributed_values_are_refused_with_the_way_out(two):
    # TF's Strategy.reduce/gather and reduce_to take one value; a dict or list of
    # PerReplica used to become an object array ("dtype object") or a "rank-0" error.
    loss, acc = per_replica(two, np.float32), per_replica(two, lambda i: np.float32(i / 2))
    for value, shown, example in [
        (
            {"loss": loss, "acc": acc},
            r"a dict \(keys 'loss', 'acc'\)",
            r"\{k: await .* for k, v in",
        ),
        ([loss], r"a list of 1", r"\[await .* for v in value\]"),
        ((1.0, [loss]), r"a tuple of 2", r"\[await .* for v in value\]"),
    ]:
        for call, where in [
            (lambda v: two.reduce("mean", v, axis=None), r"strategy\.reduce"),
            (lambda v: two.reduce("sum", v, axis=0), r"strategy\.reduce"),
            (lambda v: two.gather(v, axis=0), r"strategy\.gather"),
            (lambda v: two.extended.reduce_to("sum", v, "cpu:0"), "reduce_to"),
            (lambda v: two.extended.broadcast_to(v, "cpu:0"), "broadcast"),
        ]:
            with pytest.raises(aiodist.InvalidArgumentError) as caught:
                with two.scope():
                    await call(value)
            message = str(caught.value)
            assert re.search(rf"^{where}: value is {shown} holding distributed values", message)
            assert re.search(example, message), message
        with pytest.raises(aiodist.InvalidArgumentError, match=rf"a pair's value is {shown}"):
            await two.extended.batch_reduce_to("sum", [(loss, "cpu:0"), (value, "cpu:0")])
    with two.scope():
        weights = aiodist.Variable(np.ones(2, np.float32))
        with pytest.raises(aiodist.InvalidArgumentError, match=r"value is a list of 1 holding"):
            await two.reduce("mean", [weights], axis=None)
    # One value at a time works; a structure without distributed values is a plain value.
    assert float(await two.reduce("sum", loss, axis=None)) == 1.0
    np.testing.assert_array_equal(await two.reduce("mean", [1.0, 2.0], axis=None), [1, 2])
    # A dict is never an array, distributed or not.
    for call in (
        two.extended.broadcast_to({"w": np.ones(2)}, "cpu:0"),
        two.reduce("mean", {"w": np.ones(2)}, axis=None),
    ):
        with pytest.raises(aiodist.InvalidArgumentError, match=r"value is a dict \(keys 'w'\);"):
            await call


async def test_broadcast_of_a_structure_offers_only_what_broadcast_takes(two):
    # broadcast_to([loss]) said broadcast "takes one value (one PerReplica from
    # strategy.run, a Mirrored, or an array)" and showed [await ...broadcast_to(v,
    # destinations) for v in value]: both refused next ("broadcast: tensor is a
    # PerReplica; expected a single array").
    loss = per_replica(two, np.float32)
    with two.scope():
        for value, example in [
            ([loss], "[await strategy.extended.reduce_to(op, v, destinations) for v in value]"),
            (
                {"loss": loss},
                "{k: await strategy.extended.reduce_to(op, v, destinations) for k, v in "
                "value.items()}",
            ),
        ]:
            with pytest.raises(aiodist.InvalidArgumentError) as caught:
                await two.extended.broadcast_to(value, "cpu:0")
            message = str(caught.value)
            assert "broadcast takes one value (one array). To put distributed values" in message
            assert example in message and "PerReplica" not in message, message
        # What it shows works.
        assert [float(await two.extended.reduce_to("sum", v, "cpu:0")) for v in [loss]] == [1.0]
        # A dict of arrays: broadcast each, as before.
        shown = re.escape(
            "broadcast takes one value (one array). Call it once per value, e.g. "
            "{k: await strategy.extended.broadcast_to(v, destinations) for k, v in"
        )
        with pytest.raises(aiodist.InvalidArgumentError, match=shown):
            await two.extended.broadcast_to({"w": np.ones(2)}, "cpu:0")


async def test_a_run_not_awaited_is_refused_saying_await_is_missing(two):
    # TF's habit, `losses = strategy.run(step)`, passed the coroutine on as a value:
    # SUM called it "not distributed" (use MEAN), MEAN "dtype object" (x.astype),
    # gather "a rank-0 value" (x[None]), none of which helps.
    async def step():
        return np.float64(aiodist.get_replica_context().replica_id_in_sync_group)

    losses = two.run(step)
    for call, where in [
        (lambda: two.reduce("sum", losses, axis=None), r"strategy\.reduce"),
        (lambda: two.reduce("mean", losses, axis=0), r"strategy\.reduce"),
        (lambda: two.gather(losses, axis=0), r"strategy\.gather"),
        (lambda: two.extended.reduce_to("mean", losses, "cpu:0"), "reduce_to"),
        (lambda: two.extended.batch_reduce_to("sum", [(losses, "cpu:0")]), "batch_reduce_to"),
        (lambda: two.extended.broadcast_to(losses, "cpu:0"), "broadcast"),
    ]:
        with pytest.raises(aiodist.InvalidArgumentError) as caught:
            await call()
        assert re.match(
            rf"{where}: the value is a coroutine \(Strategy\.run\) that was never awaited, "
            r"not its result\. Probably an `await` is missing: .*`losses = await strategy\.run",
            str(caught.value),
        ), caught.value
    assert float(await two.reduce("sum", await losses, axis=None)) == 1.0


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
async def test_reduce_with_axis_checks_what_it_reduces(two, op):
    async def reduce(*parts, axis=0):
        return await two.reduce(op, aiodist.PerReplica(list(parts)), axis=axis)

    # Shapes may differ along the reduced axes only.
    with pytest.raises(aiodist.InvalidArgumentError, match=r"only along the reduced axes \(1,\)"):
        await reduce(np.ones((2, 3)), np.ones((3, 3)), axis=1)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"differ in shape or dtype"):
        await reduce(np.ones((2, 3)), np.ones((2, 4)), axis=0)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"differ in shape or dtype"):
        await reduce(np.ones(3, np.float32), np.ones(3, np.float64))
    with pytest.raises(aiodist.InvalidArgumentError, match=r"different ranks .*shape \(1, 3\)"):
        await reduce(np.ones(3), np.ones((1, 3)), axis=-1)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"names an axis twice"):
        await reduce(np.ones((2, 2)), np.ones((2, 2)), axis=(0, -2))
    with pytest.raises(aiodist.InvalidArgumentError, match=r"cannot reduce values of dtype <U1"):
        await reduce(np.array(["a"]), np.array(["b"]))
    # Uneven along the reduced axis is what axis= is for.
    assert (await reduce(np.ones((1, 2)), np.ones((3, 2)), axis=0)).shape == (2,)


async def test_reduce_inside_scope_and_from_merge_fn(two):
    value = per_replica(two, lambda r: float(r + 1))
    with two.scope():
        assert float(await two.reduce("sum", value, axis=None)) == 3.0

    async def merge_fn(strategy, v):
        return await strategy.reduce("sum", v, axis=None)

    async def fn():
        ctx = aiodist.get_replica_context()
        return await ctx.merge_call(merge_fn, args=(float(ctx.replica_id_in_sync_group + 1),))

    assert float(await two.run(fn)) == 3.0


async def test_gather(three):
    value = aiodist.PerReplica([np.arange(2), np.arange(3), np.arange(1)])
    np.testing.assert_array_equal(await three.gather(value, axis=0), [0, 1, 0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"rank-0 value"):
        await three.gather(aiodist.PerReplica([1.0, 2.0, 3.0]), axis=0)
    with pytest.raises(ValueError, match=r"shapes may differ only along axis 1"):
        await three.gather(aiodist.PerReplica([np.ones((1, 2))] * 2 + [np.ones((2, 2))]), axis=1)


async def test_gather_of_values_differing_in_dtype_says_so(two):
    # Values of one shape and two dtypes were refused as differing in shape
    # ("shapes may differ only along axis 0, but got ... float32[2]; ... int32[2]").
    value = aiodist.PerReplica([np.ones(2, np.float32), np.ones(2, np.int32)])
    expected = r"differ in dtype \(replica 0: float32\[2\]; replica 1: int32\[2\]\)"
    with pytest.raises(aiodist.InvalidArgumentError, match=expected) as raised:
        await two.gather(value, axis=0)
    assert "shapes may differ" not in str(raised.value)
    with two.scope(), pytest.raises(aiodist.InvalidArgumentError, match=expected):
        await two.extended._cross_device_ops.gather(value, "cpu:0", 0)


async def test_reduce_to_destinations(two):
    value = per_replica(two, lambda r: np.array([r + 1.0]))
    single = await two.extended.reduce_to("sum", value, destinations="cpu:1")
    np.testing.assert_array_equal(single, [3.0])
    assert single.flags.writeable

    mirrored = await two.extended.reduce_to("mean", value, destinations=value)
    assert isinstance(mirrored, aiodist.Mirrored)
    assert mirrored.devices == ("/device:CPU:0", "/device:CPU:1")
    for v in two.experimental_local_results(mirrored):
        np.testing.assert_array_equal(v, [1.5])
        assert not v.flags.writeable

    on_array = await two.extended.reduce_to("sum", value, destinations=np.zeros(1))
    np.testing.assert_array_equal(on_array, [3.0])

    to_list = await two.extended.reduce_to("max", value, destinations=["cpu:0", "cpu:5"])
    assert to_list.devices == ("/device:CPU:0", "/device:CPU:5")

    with pytest.raises(ValueError, match=r"destinations=3\.5; expected a device string"):
        await two.extended.reduce_to("sum", value, destinations=3.5)


async def test_an_unawaited_run_as_destinations_says_an_await_is_missing(two):
    # It said only "destinations=<coroutine object Strategy.run ...>; expected a device
    # string ...", and Python later warned that the coroutine was never awaited.
    value = per_replica(two, lambda r: np.array([r + 1.0]))

    async def step():
        return np.zeros(1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "never awaited" warning either)
        for reduce in (
            lambda d: two.extended.reduce_to("sum", value, d),
            lambda d: two.extended._cross_device_ops.reduce("sum", value, d),
        ):
            with pytest.raises(
                aiodist.InvalidArgumentError,
                match=r"^destinations: the value is a coroutine \(Strategy\.run\) that was never "
                r"awaited, not its result\. Probably an `await` is missing",
            ):
                await reduce(two.run(step))
            gc.collect()


async def test_batch_reduce_to_and_broadcast_to(two):
    a = per_replica(two, lambda r: np.float64(r))
    b = per_replica(two, lambda r: np.array([r, r + 1]))
    out = await two.extended.batch_reduce_to("sum", [(a, "cpu:0"), (b, b)])
    assert float(out[0]) == 1.0
    for v in two.experimental_local_results(out[1]):
        np.testing.assert_array_equal(v, [1, 3])
    with pytest.raises(ValueError, match=r"expected a list of \(value, destinations\) pairs"):
        await two.extended.batch_reduce_to("sum", [a])

    source = np.array([1, 2])
    copies = await two.extended.broadcast_to(source, b)
    assert isinstance(copies, aiodist.Mirrored)
    for v in two.experimental_local_results(copies):
        np.testing.assert_array_equal(v, [1, 2])
    single = await two.extended.broadcast_to(source, "cpu:1")
    assert single is not source
    np.testing.assert_array_equal(single, source)


async def test_reduction_to_one_device_options():
    calls = []

    def add_n(values):
        calls.append(len(values))
        return np.sum(np.stack(values), axis=0)

    ops = aiodist.ReductionToOneDevice(reduce_to_device="cpu:3", accumulation_fn=add_n)
    strategy = aiodist.MirroredStrategy(cpu_devices(3), cross_device_ops=ops)
    assert repr(ops) == "ReductionToOneDevice(reduce_to_device='/device:CPU:3')"

    async def fn():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", np.full(2, ctx.replica_id_in_sync_group))

    result = await strategy.run(fn)
    for v in strategy.experimental_local_results(result):
        np.testing.assert_array_equal(v, [3, 3])
    assert calls == [3]
    with pytest.raises(ValueError, match=r"accumulation_fn=1 is not callable"):
        aiodist.ReductionToOneDevice(accumulation_fn=1)


async def test_reduction_settings_assigned_later_apply_to_scalars_too():
    """NumPy scalars take a shortcut only the default settings allow: assigning
    accumulation_fn or reduce_to_device after construction turns it off (and back)."""
    ops = aiodist.ReductionToOneDevice()
    strategy = aiodist.MirroredStrategy(cpu_devices(2), cross_device_ops=ops)
    ones = aiodist.PerReplica([np.float32(1), np.float32(1)])

    async def fn():
        return await aiodist.get_replica_context().all_reduce("sum", np.float32(1))

    async def sums():
        reduced = await strategy.reduce("sum", ones, axis=None)
        replicas = strategy.experimental_local_results(await strategy.run(fn))
        return [float(reduced), *map(float, replicas)]

    assert await sums() == [2.0, 2.0, 2.0]
    ops.accumulation_fn = lambda xs: sum(xs) / 2
    assert await sums() == [1.0, 1.0, 1.0]
    ops.accumulation_fn = None
    assert await sums() == [2.0, 2.0, 2.0]
    ops.reduce_to_device = "cpu:1"
    assert ops.reduce_to_device == aiodist.Device("CPU", 1)
    assert repr(ops) == "ReductionToOneDevice(reduce_to_device='/device:CPU:1')"
    assert await sums() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match=r"accumulation_fn=1 is not callable"):
        ops.accumulation_fn = 1
    assert ops.accumulation_fn is None


async def test_cross_device_ops_directly():
    ops = aiodist.ReductionToOneDevice()
    value = aiodist.PerReplica([np.array([1, 2]), np.array([3, 4])], devices=None)
    reduced = await ops.reduce("sum", value, "cpu:0")
    np.testing.assert_array_equal(reduced, [4, 6])
    batch = await ops.batch_reduce("max", [(value, "cpu:0"), (value, ["cpu:0", "cpu:1"])])
    np.testing.assert_array_equal(batch[0], [3, 4])
    assert isinstance(batch[1], aiodist.Mirrored)
    broadcast = await ops.broadcast(np.array([7]), ["cpu:0", "cpu:1"])
    assert [int(v[0]) for v in broadcast.values] == [7, 7]
    gathered = await ops.gather(value, "cpu:0", axis=0)
    np.testing.assert_array_equal(gathered, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"broadcast: tensor is a PerReplica"):
        await ops.broadcast(value, "cpu:0")


async def test_cross_device_ops_refuse_structures_of_distributed_values():
    # As reduce_to does: a dict or list of PerReplica used to become an object array,
    # refused as "dtype object" (reduce) or "a rank-0 value (object[])" (gather).
    ops = aiodist.ReductionToOneDevice()
    value = aiodist.PerReplica([np.array([1, 2]), np.array([3, 4])], devices=None)
    for structure, shown in [({"a": value}, r"a dict \(keys 'a'\)"), ([value, value], "a list")]:
        for call, where in [
            (lambda v: ops.reduce("sum", v, "cpu:0"), "reduce"),
            (lambda v: ops.gather(v, "cpu:0", axis=0), "gather"),
        ]:
            with pytest.raises(aiodist.InvalidArgumentError) as caught:
                await call(structure)
            message = str(caught.value)
            assert message.startswith(f"CrossDeviceOps.{where}: value is "), message
            assert re.search(rf"{shown}.* holding distributed values", message), message
            assert f"await ops.{where}(" in message, message


async def test_cross_device_ops_batch_reduce_takes_any_iterable_of_pairs():
    # TF takes list(value_destination_pairs); checking a generator used to use it up,
    # so every pair was dropped and the result was [].
    ops = aiodist.ReductionToOneDevice()
    value = aiodist.PerReplica([np.array([1, 2]), np.array([3, 4])], devices=None)
    out = await ops.batch_reduce("sum", ((value, d) for d in ("cpu:0", "cpu:1")))
    assert [v.tolist() for v in out] == [[4, 6], [4, 6]]
    for bad in (5, "ab", [(value, "cpu:0", 1)]):
        with pytest.raises(aiodist.InvalidArgumentError, match=r"expected a list of \(value"):
            await ops.batch_reduce("sum", bad)


@pytest.mark.parametrize("options", ["fast", {"bytes_per_pack": 1024}, 5])
async def test_cross_device_ops_refuse_options_that_are_not_communication_options(options):
    """CrossDeviceOps.reduce, batch_reduce and gather took any options and ignored them
    (a dict of fields looked accepted), where the strategy's reduce_to refuses them."""
    ops = aiodist.ReductionToOneDevice()
    value = aiodist.PerReplica([np.array([1, 2]), np.array([3, 4])])
    for method, call in [
        ("reduce", lambda: ops.reduce("sum", value, "cpu:0", options=options)),
        ("batch_reduce", lambda: ops.batch_reduce("sum", [(value, "cpu:0")], options=options)),
        ("gather", lambda: ops.gather(value, "cpu:0", 0, options=options)),
    ]:
        expected = rf"^CrossDeviceOps.{method}: options=.*; expected aiodist.CommunicationOptions"
        with pytest.raises(aiodist.InvalidArgumentError, match=expected):
            await call()
    given = aiodist.CommunicationOptions(bytes_per_pack=1024)
    np.testing.assert_array_equal(await ops.reduce("sum", value, "cpu:0", given), [4, 6])
    (reduced,) = await ops.batch_reduce("sum", [(value, "cpu:0")], given)
    np.testing.assert_array_equal(reduced, [4, 6])
    gathered = await ops.gather(value, "cpu:0", 0, options=given)
    np.testing.assert_array_equal(gathered, [1, 2, 3, 4])


@pytest.mark.parametrize("axis", [None, "0", 1.0, True])
async def test_cross_device_ops_gather_refuses_an_axis_that_is_not_an_int(axis):
    """CrossDeviceOps.gather took its axis unchecked (strategy.gather checks it): None
    or "0" failed in a comparison ("TypeError: '<=' not supported between instances of
    'int' and 'NoneType'"), and 1.0 or True were "out of range" for a rank-1 value."""
    ops = aiodist.ReductionToOneDevice()
    value = aiodist.PerReplica([np.arange(2), np.arange(3)])
    with pytest.raises(aiodist.InvalidArgumentError, match=r"gather: axis=.*; expected an int"):
        await ops.gather(value, "cpu:0", axis)
    np.testing.assert_array_equal(await ops.gather(value, "cpu:0", np.int64(0)), [0, 1, 0, 1, 2])


async def test_the_cross_device_ops_base_class_is_refused_when_the_strategy_is_made():
    """MirroredStrategy(cross_device_ops=aiodist.CrossDeviceOps()) was taken, and the
    first collective raised a NotImplementedError without a message."""
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"cross_device_ops=CrossDeviceOps\(\); CrossDeviceOps is the base class.*"
        r"expected aiodist.ReductionToOneDevice\(\)",
    ):
        aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=aiodist.CrossDeviceOps())


async def test_the_cross_device_ops_base_class_asked_to_reduce_raises_an_aiodist_error():
    """Its reduce and batch_reduce, called directly, raised NotImplementedError: not
    an AiodistError, as docs/errors.md says every error aiodist raises on purpose is,
    and not the InvalidArgumentError a strategy given the base class raises."""
    ops = aiodist.CrossDeviceOps()
    value = aiodist.PerReplica([np.ones(2), np.ones(2)])
    for call in (
        lambda: ops.reduce("sum", value, "cpu:0"),
        lambda: ops.batch_reduce("sum", [(value, "cpu:0")]),
    ):
        with pytest.raises(
            aiodist.InvalidArgumentError,
            match=r"CrossDeviceOps\(\) cannot reduce: CrossDeviceOps is the base class, "
            r"which implements no reduction; expected aiodist.ReductionToOneDevice\(\) or "
            r"aiodist.NcclAllReduce\(\)",
        ):
            await call()


async def test_cross_device_ops_broadcast_never_shares_the_callers_array():
    ops = aiodist.ReductionToOneDevice()
    for destinations in ("cpu:0", ["cpu:0", "cpu:1"]):
        source = np.array([7])
        result = await ops.broadcast(source, destinations)
        source[0] = 8
        values = result.values if isinstance(result, aiodist.Mirrored) else (result,)
        assert [int(v[0]) for v in values] == [7] * len(values)
    from_list = await ops.broadcast([1.5, 2.5], ["cpu:0", "cpu:1"])
    assert [v.tolist() for v in from_list.values] == [[1.5, 2.5], [1.5, 2.5]]


def test_distribute_values_from_function(strategy, num_replicas):
    seen = []

    def value_fn(ctx):
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return ctx.replica_id_in_sync_group * 10

    values = strategy.experimental_distribute_values_from_function(value_fn)
    assert seen == [(i, num_replicas) for i in range(num_replicas)]
    assert strategy.experimental_local_results(values) == tuple(10 * i for i in range(num_replicas))
    if num_replicas > 1:
        assert isinstance(values, aiodist.PerReplica)
        assert "PerReplica:{" in repr(values) and "1: 10" in repr(values)


@pytest.mark.parametrize(
    ("returned", "at"),
    [
        (lambda: aiodist.PerReplica([1, 2]), ""),
        (lambda: {"a": [1, aiodist.Mirrored([3, 3])]}, r" \(at \['a'\]\[1\]\)"),
    ],
    ids=["top", "nested"],
)
def test_a_value_fn_returning_a_distributed_value_is_refused(two, returned, at):
    # A PerReplica of PerReplicas came back (TF refuses it): each replica's component
    # was the whole distributed value, which nothing downstream unwraps.
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=rf"^experimental_distribute_values_from_function: value_fn=.* returned a "
        rf"(PerReplica|Mirrored){at} for replica 0; it is called once per replica",
    ):
        two.experimental_distribute_values_from_function(lambda ctx: returned())


async def test_distribute_values_from_function_of_structures(two):
    """A value_fn returning a structure gives that structure of PerReplica leaves, as
    TF's (regroup with always_wrap) and as distributed datasets' batches: each leaf
    reduces on its own, a shared leaf is wrapped too, and it unwraps in run."""
    shared = np.ones(2)
    values = two.experimental_distribute_values_from_function(
        lambda ctx: {"x": np.arange(2.0) + 2 * ctx.replica_id_in_sync_group, "c": [shared]}
    )
    assert isinstance(values, dict) and isinstance(values["c"], list)
    assert isinstance(values["x"], aiodist.PerReplica)
    assert values["x"].devices == ("/device:CPU:0", "/device:CPU:1")
    assert isinstance(values["c"][0], aiodist.PerReplica)
    assert values["c"][0].values == (shared, shared)
    assert float(await two.reduce("sum", values["x"], axis=0)) == 6.0
    local = two.experimental_local_results(values)
    np.testing.assert_array_equal(local[1]["x"], [2.0, 3.0])
    assert local[0]["c"][0] is shared

    pairs = two.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, 10)
    )
    assert isinstance(pairs, tuple)

    async def add(a, b):
        return a + b

    assert two.experimental_local_results(await two.run(add, args=pairs)) == (10, 11)
    with pytest.raises(ValueError, match=r"replicas received from value_fn different structures"):
        two.experimental_distribute_values_from_function(
            lambda ctx: [1] * (ctx.replica_id_in_sync_group + 1)
        )


def test_local_results_of_plain_and_nested_values(two):
    assert two.experimental_local_results(5) == (5,)
    nested = {"a": aiodist.PerReplica([1, 2]), "b": "same"}
    assert two.experimental_local_results(nested) == ({"a": 1, "b": "same"}, {"a": 2, "b": "same"})


def test_local_results_of_a_structure_holding_variables(two):
    """As in TF (whose variables are distributed values), each replica's structure
    holds that replica's copy of a variable, as for the variable on its own."""
    with two.scope():
        v = aiodist.Variable(np.arange(2.0))
    plain = aiodist.Variable(np.float32(5.0))  # outside any scope: not distributed
    alone = two.experimental_local_results(v)
    local = two.experimental_local_results({"v": v, "p": aiodist.PerReplica([1, 2]), "w": plain})
    assert [part["p"] for part in local] == [1, 2]
    for part, copy in zip(local, alone, strict=True):
        assert part["v"] is copy
        assert part["w"] is plain


def test_distributed_values_construction_errors():
    with pytest.raises(TypeError, match=r"abstract"):
        aiodist.DistributedValues([1])
    with pytest.raises(ValueError, match=r"non-empty list or tuple"):
        aiodist.PerReplica([])
    with pytest.raises(ValueError, match=r"2 values but 1 devices"):
        aiodist.Mirrored([1, 2], devices=[aiodist.Device("CPU", 0)])
    with pytest.raises(aiodist.DeviceError, match=r"'tpu:1' is not understood"):
        aiodist.PerReplica([1, 2], devices=["cpu:0", "tpu:1"])


@pytest.mark.parametrize("device", ["cpu:0", aiodist.Device("CPU", 0)])
@pytest.mark.parametrize("count", [1, 5])
def test_distributed_values_refuse_one_device_given_alone(device, count):
    """A device string given alone was iterated for its characters: "1 values but
    5 devices" for one value, "device string 'c' is not understood" for five (and a
    Device alone, "'Device' object is not iterable")."""
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"PerReplica: devices='(cpu:0|/device:CPU:0)' is a single device; expected a "
        r"list of one device per value, e.g. \['(cpu:0|/device:CPU:0)'\]",
    ):
        aiodist.PerReplica([np.ones(1)] * count, device)


async def test_distributed_values_made_with_device_strings(two):
    """PerReplica/Mirrored given device strings hold them canonically (SPEC §1), and
    serve as values and destinations of reduce_to like a strategy's own."""
    value = aiodist.PerReplica([np.array(1.0), np.array(2.0)], ["cpu:0", "/cpu:1"])
    assert value.devices == ("/device:CPU:0", "/device:CPU:1")
    assert aiodist.Mirrored([1, 1], ("/device:CPU:0", "CPU:1")).devices == value.devices
    reduced = await two.extended.reduce_to("sum", value, destinations=value)
    assert reduced.devices == value.devices
    assert [float(v) for v in two.experimental_local_results(reduced)] == [3.0, 3.0]
    assert float(await two.extended.reduce_to("sum", value, destinations="cpu:0")) == 3.0


async def test_broadcast_never_shares_the_callers_memory(two):
    source = np.zeros(2)
    mirrored = await two.extended.broadcast_to(source, ["cpu:0", "cpu:1"])
    source[:] = 7
    for v in two.experimental_local_results(mirrored):
        np.testing.assert_array_equal(v, [0, 0])


@pytest.mark.parametrize("kind", ["memmap", "masked", "view"])
async def test_broadcast_of_an_array_subclass_never_shares_the_callers_memory(two, tmp_path, kind):
    # np.asarray of a memmap or a masked array is a view of the caller's memory, which
    # broadcast_to used to hand out: a write to the result wrote the caller's file.
    if kind == "memmap":
        source = np.memmap(tmp_path / "w.bin", np.float32, "w+", shape=(2,))
    elif kind == "masked":
        source = np.ma.masked_array(np.zeros(2, np.float32))
    else:
        source = np.zeros(4, np.float32)[::2]
    source[:] = 0
    one = await two.extended.broadcast_to(source, "cpu:0")
    mirrored = await two.extended.broadcast_to(source, ["cpu:0", "cpu:1"])
    one[:] = 5
    source[:] = 7
    np.testing.assert_array_equal(one, [5, 5])
    for v in two.experimental_local_results(mirrored):
        np.testing.assert_array_equal(v, [0, 0])


async def test_product_of_a_plain_value_is_ambiguous(two):
    with pytest.raises(ValueError, match=r"cannot be reduced with PRODUCT across 2"):
        await two.reduce("product", np.array(3.0), axis=None)
    assert float(await two.reduce("max", np.array(3.0), axis=None)) == 3.0


async def test_cross_device_ops_refuse_replica_context(two):
    ops = aiodist.ReductionToOneDevice()

    async def fn():
        with pytest.raises(aiodist.ContextError, match=r"CrossDeviceOps.reduce\(\) needs"):
            await ops.reduce("sum", np.ones(1), "cpu:0")
        with pytest.raises(aiodist.ContextError, match=r"CrossDeviceOps.broadcast\(\)"):
            await ops.broadcast(np.ones(1), "cpu:0")
        with pytest.raises(aiodist.ContextError, match=r"CrossDeviceOps.gather\(\)"):
            await ops.gather(np.ones(1), "cpu:0", axis=0)
        with pytest.raises(aiodist.ContextError, match=r"CrossDeviceOps.batch_reduce\(\)"):
            await ops.batch_reduce("sum", [(np.ones(1), "cpu:0")])
        return True

    assert await two.run(fn) is True
