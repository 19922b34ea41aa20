"""Distributed variables (SPEC §9, and extended.update of §5)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
import sys
import threading
import warnings
import zipfile
from copy import deepcopy
from fractions import Fraction

import numpy as np
import pytest

import aiodist
from tests.conftest import cpu_devices, uvloop, wait_until

pytestmark = pytest.mark.timeout(20)


def rid() -> int:
    return aiodist.get_replica_context().replica_id_in_sync_group


def copies(strategy, variable) -> list:
    return [np.asarray(c) for c in strategy.experimental_local_results(variable)]


def test_kinds_by_context(strategy, num_replicas):
    plain = aiodist.Variable([1.0, 2.0])
    assert type(plain) is aiodist.Variable
    assert plain.devices == ("/device:CPU:0",)
    with strategy.scope():
        mirrored = aiodist.Variable(np.arange(3, dtype=np.float32), name="w")
        on_read = aiodist.Variable(
            0, synchronization="ON_READ", aggregation=aiodist.VariableAggregation.SUM
        )
    assert isinstance(mirrored, aiodist.MirroredVariable) and isinstance(mirrored, aiodist.Variable)
    assert isinstance(on_read, aiodist.SyncOnReadVariable)
    assert mirrored.shape == (3,) and mirrored.dtype == np.float32 and mirrored.name == "w"
    assert mirrored.devices == tuple(f"/device:CPU:{i}" for i in range(num_replicas))
    for copy in copies(strategy, mirrored):
        np.testing.assert_array_equal(copy, [0, 1, 2])
    np.testing.assert_array_equal(np.asarray(mirrored), [0, 1, 2])
    np.testing.assert_array_equal(mirrored.numpy(), [0, 1, 2])
    assert mirrored.aggregation is aiodist.VariableAggregation.NONE


async def test_device_is_that_of_the_copy_read_as_in_tf():
    """TF's variables have ``device``; here ``v.device`` raised AttributeError
    ("'MirroredVariable' object has no attribute 'device'")."""
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:0", "cpu:1"])
    with strategy.scope():
        mirrored = aiodist.Variable(0.0)
        on_read = aiodist.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert aiodist.Variable(0.0).device == "/device:CPU:0"
    assert mirrored.device == on_read.device == "/device:CPU:0"  # the primary copy's

    async def fn():
        return mirrored.device, on_read.device

    seen = strategy.experimental_local_results(await strategy.run(fn))
    assert [d for d, _ in seen] == ["/device:CPU:0", "/device:CPU:0", "/device:CPU:1"]
    assert [d for _, d in seen] == ["/device:CPU:0", "/device:CPU:0", "/device:CPU:1"]


async def test_creating_in_replica_context_raises(two):
    async def fn():
        aiodist.Variable(1.0)

    with pytest.raises(aiodist.ContextError, match=r"inside a replica function"):
        await two.run(fn)


async def test_the_default_strategys_run_and_merge_fn_make_plain_variables():
    """The default strategy counts as no strategy there (as in TF). A merge_fn of the
    default replica context (merge_call outside any scope) made a MirroredVariable of
    the default strategy: variable_created_in_scope() said False, and its
    assign_add in the default strategy's run raised "needs an aggregation", where
    one made outside any scope is plain and counts. Its run refused Variable()."""
    default = aiodist.get_strategy()
    made = []

    def merge_fn(strategy):
        made.append(aiodist.Variable(1.0, name="in_merge_fn"))

    async def step():
        await aiodist.get_replica_context().merge_call(merge_fn)
        made.append(aiodist.Variable(1.0, name="in_run"))
        for v in made:
            await v.assign_add(1.0)

    await aiodist.get_replica_context().merge_call(merge_fn)
    await default.run(step)
    assert [type(v) for v in made] == [aiodist.Variable] * 3
    assert [float(v) for v in made] == [2.0, 2.0, 2.0]
    assert all(default.extended.variable_created_in_scope(v) for v in made)
    with pytest.raises(aiodist.ContextError, match=r"outside any strategy scope"):
        await aiodist.get_replica_context().merge_call(lambda s: aiodist.MirroredVariable(1.0))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"aggregation='median'; expected one of NONE, SUM"):
        aiodist.Variable(1.0, aggregation="median")
    with pytest.raises(ValueError, match=r"expected numbers"):
        aiodist.Variable("text")
    with pytest.raises(aiodist.ContextError, match=r"outside any strategy scope"):
        aiodist.MirroredVariable(1.0)


def test_an_async_initial_value_is_refused_by_name(two):
    """An async function (or its coroutine) as initial_value read as "initial_value
    has dtype object; expected numbers", and Python warned "coroutine ... was never
    awaited" (the coroutine is now closed)."""

    async def initial():
        return 1.0

    coroutine = initial()
    for given in (initial, coroutine):
        for scope in (two.scope(), contextlib.nullcontext()):
            with (
                scope,
                pytest.raises(
                    aiodist.InvalidArgumentError,
                    match=r"w: initial_value=<(function|coroutine object) .*initial.*> is or "
                    r"returned an awaitable; .* pass the value \(await it first\)",
                ),
            ):
                aiodist.Variable(given, name="w")
    assert coroutine.cr_frame is None  # closed: nothing warns that it was never awaited


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("SUM", lambda n: -sum(range(1, n + 1))),
        ("MEAN", lambda n: -(n + 1) / 2),
        ("ONLY_FIRST_REPLICA", lambda n: -1),
    ],
)
async def test_mirrored_updates_in_replica_context_aggregate(
    strategy, num_replicas, aggregation, expected
):
    with strategy.scope():
        v = aiodist.Variable(np.zeros(2), aggregation=aggregation)

    async def step(var):
        assert np.asarray(var).shape == (2,)  # reads the local copy
        await var.assign_sub(np.full(2, rid() + 1.0))
        return var.read_value()

    result = await strategy.run(step, args=(v,))
    for copy in copies(strategy, v):
        np.testing.assert_allclose(copy, [expected(num_replicas)] * 2)
    for read in strategy.experimental_local_results(result):
        np.testing.assert_allclose(read, [expected(num_replicas)] * 2)


async def test_assign_and_assign_add_in_replica_context(three):
    with three.scope():
        v = aiodist.Variable(10.0, aggregation="mean")

    async def step(var):
        await var.assign(float(rid()))  # mean of 0, 1, 2
        await var.assign_add(3.0)  # the same object on every replica: mean is 3
        return float(var.read_value())

    assert three.experimental_local_results(await three.run(step, args=(v,))) == (4.0, 4.0, 4.0)


async def test_aggregation_none_in_replica_context_raises(two):
    with two.scope():
        v = aiodist.Variable(1.0)

    async def step(var):
        await var.assign(2.0)

    with pytest.raises(ValueError, match=r"needs an aggregation.*aggregation='SUM'"):
        await two.run(step, args=(v,))
    assert copies(two, v) == [1.0, 1.0]


async def test_a_one_device_mirrored_strategys_none_variable_still_refuses_replica_writes():
    """SPEC 9 holds for MirroredStrategy of any device count, one included."""
    one = aiodist.MirroredStrategy(["cpu:0"])
    with one.scope():
        v = aiodist.Variable(1.0)

    async def step():
        await v.assign_add(1.0)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"needs an aggregation"):
        await one.run(step)
    assert float(v.read_value()) == 1.0


@pytest.mark.parametrize("aggregation", ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"])
async def test_one_device_strategy_variables_are_written_in_replica_context(aggregation):
    """A OneDeviceStrategy variable has one copy, as TF's plain variable there; one
    made with the default aggregation=NONE raised "copies would drift apart" at
    assign_add in replica context, where TF's works. Every aggregation writes."""
    strategy = aiodist.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        v = aiodist.Variable(np.float32(1.0), aggregation=aggregation)
        steps = aiodist.Variable(np.int8(0), aggregation=aggregation)

    async def step(x):
        await v.assign_add(x)  # 1 + 3
        await v.assign_sub(np.float64(0.5))  # (cast to the variable's dtype)
        read = v.read_value()
        await v.assign(read * 2)  # 7
        await steps.assign_add(1)  # a Python int, in the variable's dtype
        return v.read_value()

    result = await strategy.run(step, args=(np.float32(3.0),))
    assert result == 7.0 and result.dtype == np.float32
    assert v.dtype == np.float32 and float(v.read_value()) == 7.0
    assert steps.dtype == np.int8 and int(steps.read_value()) == 1
    # The checks of every write still hold.
    for value, refused in [
        (np.ones(2, np.float32), r"\(2,\)\)? cannot (all )?be written to a variable of shape \(\)"),
        ("x", r"<U1.*float32"),  # (worded by the aggregation's path)
    ]:

        async def bad(value=value):
            await v.assign(value)

        with pytest.raises(aiodist.InvalidArgumentError, match=refused):
            await strategy.run(bad)

    async def too_big():
        await steps.assign_add(300)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"300 does not fit int8"):
        await strategy.run(too_big)

    async def a_float():
        await steps.assign(1.5)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"float64 cannot be written.*int8"):
        await strategy.run(a_float)
    assert float(v.read_value()) == 7.0 and int(steps.read_value()) == 1


async def test_cross_replica_writes_every_copy(strategy):
    with strategy.scope():
        v = aiodist.Variable(np.ones(2, dtype=np.float32))
        await v.assign([5, 6])
    await v.assign_add(1.0)
    await v.assign_sub(np.array([2.0, 2.0]))
    for copy in copies(strategy, v):
        np.testing.assert_array_equal(copy, [4, 5])
        assert copy.dtype == np.float32
    with pytest.raises(
        ValueError, match=r"shape \(3,\) cannot be written to a variable of shape \(2,\)"
    ):
        await v.assign(np.ones(3))
    with pytest.raises(ValueError, match=r"dtype complex128 cannot be written"):
        await v.assign(np.ones(2) * 1j)
    for copy in copies(strategy, v):
        np.testing.assert_array_equal(copy, [4, 5])  # failed writes change nothing


@pytest.mark.parametrize("kind", ["assign", "assign_add", "assign_sub"])
async def test_writes_of_values_of_another_shape_name_the_variable(two, kind):
    # assign_add and assign_sub too: they raised NumPy's "operands could not be
    # broadcast together", naming neither the variable nor the write.
    with two.scope():
        mirrored = aiodist.Variable(np.zeros(2), name="weights")
        on_read = aiodist.Variable(np.zeros(2), synchronization="on_read", name="counts")
    shape = r"a value of shape \(3,\) cannot be written to a variable of shape \(2,\)"
    with pytest.raises(aiodist.InvalidArgumentError, match=rf"weights\.{kind}: {shape}"):
        await getattr(mirrored, kind)(np.ones(3))
    with pytest.raises(
        aiodist.InvalidArgumentError, match=rf"counts\.{kind} \(copy on .*\): {shape}"
    ):
        await two.run(lambda: getattr(on_read, kind)(np.ones(3)))
    with pytest.raises(
        aiodist.InvalidArgumentError, match=rf"weights\.{kind} \(copy on .*\): {shape}"
    ):
        await two.extended.update(mirrored, lambda copy: getattr(copy, kind)(np.ones(3)))
    for variable in (mirrored, on_read):
        np.testing.assert_array_equal(copies(two, variable), np.zeros((2, 2)))  # unchanged
    await mirrored.assign_add(np.ones((1,)))  # shapes that broadcast still write
    np.testing.assert_array_equal(copies(two, mirrored), np.ones((2, 2)))


@pytest.mark.parametrize("value", [None, "text", [1.0, [2.0]]], ids=["None", "str", "ragged"])
async def test_writes_of_values_that_are_not_numbers_name_them(two, value):
    """A write of None, a string or a ragged list raised NumPy's or Python's own words
    ("unsupported operand type(s) for +", "ufunc 'add' did not contain a loop",
    "inhomogeneous shape"), in every context; now an InvalidArgumentError naming the
    value (in replica context: the replicas whose values are not numbers)."""
    with two.scope():
        mirrored = aiodist.Variable(np.zeros(2), aggregation="mean")
        on_read = aiodist.Variable(np.zeros(2), aggregation="sum", synchronization="ON_READ")
    plain = aiodist.Variable(np.zeros(2))
    not_numbers = r"is not a number or an array of numbers.*expected numbers that cast to"
    for variable in (mirrored, plain):
        # (assign of None or a string already said "a value of dtype ... cannot be written")
        for write in (variable.assign_add, variable.assign_sub):
            with pytest.raises(aiodist.InvalidArgumentError, match=r"value=.*" + not_numbers):
                await write(value)
    with pytest.raises(aiodist.InvalidArgumentError, match=not_numbers):
        await two.extended.update(mirrored, lambda copy: copy.assign_add(value))

    async def step(variable):
        # Replica 1's value is the bad one (a list on both: merge_call wants one nesting).
        mine = 1.0 if rid() == 0 and not isinstance(value, list) else value
        await variable.assign_add(mine)

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"assign_add\(\) in replica context: not a number or an array of numbers "
        r"\(.*replica 1: .*\); every replica must give numbers",
    ):
        await two.run(step, args=(mirrored,))
    with pytest.raises(aiodist.InvalidArgumentError, match=r"\(copy on .*" + not_numbers):
        await two.run(step, args=(on_read,))
    for variable in (mirrored, plain):  # failed writes change nothing
        for copy in copies(two, variable):
            np.testing.assert_array_equal(copy, [0.0, 0.0])
    np.testing.assert_array_equal(copies(two, on_read)[1], [0.0, 0.0])  # (replica 0's: +1)


async def test_cross_replica_writes_take_a_mirrored_value_per_copy(strategy, num_replicas):
    """TF's rule: in cross-replica context a variable takes one value or a Mirrored one
    (reduce_to(..., destinations=v) gives exactly that); a PerReplica one is refused."""
    with strategy.scope():
        v = aiodist.Variable(np.zeros(2), aggregation="sum")
        total = aiodist.Variable(np.zeros(2), aggregation="sum", synchronization="on_read")
        count = aiodist.Variable(0, aggregation="sum", synchronization="on_read")
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group + 1.0, 1.0])
    )
    reduced = await strategy.extended.reduce_to("sum", per_replica, v)
    expected = [num_replicas * (num_replicas + 1) / 2, num_replicas]
    await v.assign(reduced)
    await v.assign_add(reduced)
    for copy in copies(strategy, v):
        np.testing.assert_array_equal(copy, np.multiply(expected, 2))
    await total.assign(reduced)  # SUM: each copy gets its component / n
    np.testing.assert_allclose(np.asarray(total), expected)
    await count.assign(
        await strategy.extended.reduce_to("sum", aiodist.PerReplica([3] * num_replicas), v)
    )
    assert int(np.asarray(count)) == 3 * num_replicas

    if num_replicas > 1:  # with one replica a PerReplica is a plain value
        for variable in (v, total):
            with pytest.raises(
                ValueError,
                match=r"assign\(\) in cross-replica context got a PerReplica.*extended\.update",
            ):
                await variable.assign(per_replica)
        for copy in copies(strategy, v):
            np.testing.assert_array_equal(copy, np.multiply(expected, 2))  # unchanged


async def test_operators_act_element_wise_on_the_value_as_in_tf(two):
    with two.scope():
        v = aiodist.Variable(0.0)
        w = aiodist.Variable([1.0, 4.0])
    assert not v and (v == 0) and (v < 1) and (v <= 0) and (v >= 0)
    assert [v != 0, 1 > v, -1 < v] == [False, True, True]  # noqa: SIM300 (the reflected forms)
    np.testing.assert_array_equal(w == 4, [False, True])
    np.testing.assert_array_equal(np.ones(2) == w, [True, False])
    np.testing.assert_array_equal(w > 2, [False, True])
    np.testing.assert_array_equal(w**2, [1, 16])
    np.testing.assert_array_equal(2**w, [2, 16])
    np.testing.assert_array_equal(abs(w - 3), [2, 1])
    np.testing.assert_array_equal(w // 3, [0, 1])
    np.testing.assert_array_equal(9 % w, [0, 1])
    with pytest.raises(ValueError, match="ambiguous"):
        bool(w)  # NumPy's (and TF's) rule for a value of several elements
    with pytest.raises(TypeError, match="unhashable"):
        {w}  # noqa: B018
    refs = {v.ref(): "v", w.ref(): "w"}
    assert refs[w.ref()] == "w" and w.ref().deref() is w and v.ref() != w.ref()

    async def fn(var):  # in a replica: the replica's own copy
        return np.asarray(var < rid())

    assert [bool(r) for r in two.experimental_local_results(await two.run(fn, args=(v,)))] == [
        False,
        True,
    ]


async def test_logical_and_bitwise_operators_act_element_wise_as_in_tf(two):
    """TF's variables have &, |, ^ and ~ (logical for bools, bitwise for integers);
    here ``mask & other``, ``~done`` and ``flags | 4`` raised TypeError ("unsupported
    operand type(s) for &: 'MirroredVariable' and 'bool'"), on bool variables too."""
    with two.scope():
        mask = aiodist.Variable([True, False], name="mask")
        flags = aiodist.Variable(np.uint8([1, 6]), name="flags")
    np.testing.assert_array_equal(mask & [True, True], [True, False])
    np.testing.assert_array_equal(np.array([False, True]) | mask, [True, True])
    np.testing.assert_array_equal(mask ^ True, [False, True])
    np.testing.assert_array_equal(~mask, [False, True])
    np.testing.assert_array_equal(flags | 4, np.uint8([5, 6]))
    np.testing.assert_array_equal(3 & flags, np.uint8([1, 2]))
    np.testing.assert_array_equal(~flags, np.uint8([254, 249]))

    async def fn(var):  # in a replica: the replica's own copy (a VariableCopy in update)
        return var ^ (rid() == 1)

    results = two.experimental_local_results(await two.run(fn, args=(mask,)))
    np.testing.assert_array_equal(np.stack(results), [[True, False], [False, True]])
    inverted = await two.extended.update(mask, lambda copy: ~copy, group=False)
    np.testing.assert_array_equal(np.stack(inverted), [[False, True]] * 2)


async def test_iteration_and_in_act_on_one_read_as_for_the_array(two):
    with two.scope():
        scalar = aiodist.Variable(3.0)
        vector = aiodist.Variable([1.0, 1.0])
        on_read = aiodist.Variable(np.ones(1000), synchronization="on_read", aggregation="sum")
    # A 0-d value cannot be iterated (NumPy's and TF's rule); it iterated as empty.
    with pytest.raises(TypeError, match="0-d"):
        list(scalar)
    assert 3.0 in scalar and 4.0 not in scalar  # (was False: the empty iteration)
    assert list(vector) == [1.0, 1.0] and 1.0 in vector and 3.0 not in vector
    # One read for the whole iteration (a sync-on-read variable's: one aggregation
    # of its copies, not one per element), so a write meanwhile changes nothing.
    for variable in (vector, on_read):
        elements = iter(variable)
        first = next(elements)
        await variable.assign(np.zeros(variable.shape))
        assert [first, *elements] == [first] * variable.shape[0] and first != 0


async def test_reads_are_snapshots(two):
    with two.scope():
        v = aiodist.Variable([1.0])
    before = v.read_value()
    await v.assign([2.0])
    np.testing.assert_array_equal(before, [1.0])
    np.testing.assert_array_equal(v.read_value(), [2.0])
    with pytest.raises(ValueError, match="read-only"):
        v.read_value()[0] = 3.0


async def test_sync_on_read(strategy, num_replicas):
    with strategy.scope():
        total = aiodist.Variable(0.0, synchronization="on_read", aggregation="sum")
        mean = aiodist.Variable(0.0, synchronization="ON_READ", aggregation="mean")
        first = aiodist.Variable(0.0, synchronization="ON_READ", aggregation="only_first_replica")
        nothing = aiodist.Variable(0.0, synchronization="ON_READ")

    async def step(a, b, c, d):
        r = rid() + 1.0
        for var in (a, b, c, d):
            await var.assign_add(r)  # local, no rendezvous
        return float(a.read_value())

    local = await strategy.run(step, args=(total, mean, first, nothing))
    assert strategy.experimental_local_results(local) == tuple(
        float(i + 1) for i in range(num_replicas)
    )
    s = num_replicas * (num_replicas + 1) / 2
    assert float(total.read_value()) == s
    assert float(mean.read_value()) == s / num_replicas
    assert float(first.read_value()) == 1.0
    with pytest.raises(ValueError, match=r"aggregation=NONE cannot be read in cross-replica"):
        nothing.read_value()

    await total.assign(12.0)  # cross-replica, SUM: each copy gets 12 / n
    assert copies(strategy, total) == [12.0 / num_replicas] * num_replicas
    assert float(total.read_value()) == 12.0
    with pytest.raises(ValueError, match=r"assign_add\(\) in cross-replica context"):
        await total.assign_add(1.0)
    await mean.assign_add(1.0)
    assert float(mean.read_value()) == s / num_replicas + 1


async def test_concurrent_runs_do_not_lose_updates(strategy, num_replicas):
    with strategy.scope():
        counter = aiodist.Variable(0, aggregation="sum")

    async def step(var):
        for _ in range(5):
            await asyncio.sleep(0)
            await var.assign_add(1)

    await asyncio.gather(*(strategy.run(step, args=(counter,)) for _ in range(10)))
    assert copies(strategy, counter) == [10 * 5 * num_replicas] * num_replicas


def test_runs_on_event_loops_in_two_threads_do_not_lose_updates():
    """A strategy may run on event loops in several threads. Each update read the
    old copies and wrote new ones with nothing in between held, so two threads'
    assign_add of one variable could each add to the same old value: one update was
    lost (about 1 in 100 here, with the thread switch interval made short)."""
    strategy = aiodist.MirroredStrategy(cpu_devices(2))
    with strategy.scope():
        mirrored = aiodist.Variable(0, aggregation="sum")
        on_read = aiodist.Variable(0, synchronization="on_read", aggregation="sum")
    runs = 1500

    async def step():
        await mirrored.assign_add(1)  # a merge_call: every copy rewritten
        await on_read.assign_add(1)  # the replica's own copy, in replica context

    async def serve():
        for _ in range(runs):
            await strategy.run(step)

    errors = []

    def thread(loop_factory):
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(serve())
        except BaseException as exc:  # shown by the assert below
            errors.append(exc)

    factories = [
        asyncio.new_event_loop,
        uvloop.new_event_loop if uvloop else asyncio.new_event_loop,
    ]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside updates too
    try:
        threads = [threading.Thread(target=thread, args=(f,)) for f in factories]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(switch_interval)
    assert not errors and not any(t.is_alive() for t in threads)
    assert copies(strategy, mirrored) == [2 * runs * 2] * 2
    assert int(on_read.read_value()) == 2 * runs * 2
    assert copies(strategy, deepcopy(mirrored)) == [2 * runs * 2] * 2  # (no lock in it)


async def test_a_deep_copy_is_a_variable_of_the_same_strategy(two):
    """As TF's deep copy of a distributed variable: same strategy and devices, its
    own values. Python's default copied the strategy too, so the copy's
    assign_add in the strategy's run raised "Mixing different aiodist
    strategies", and its arrays came back writeable (a read could change it)."""
    with two.scope():
        v = aiodist.Variable(np.zeros(2), aggregation="sum", name="v")
        on_read = aiodist.Variable(0.0, synchronization="on_read", aggregation="sum")
    w, r = deepcopy([v, on_read])
    assert w._strategy is two and type(w) is aiodist.MirroredVariable and w.name == "v"
    assert two.extended.variable_created_in_scope(r) and w.devices == v.devices

    async def step():
        await w.assign_add(np.ones(2))
        await r.assign_add(1.0)

    await two.run(step)
    np.testing.assert_array_equal(np.stack(copies(two, w)), np.full((2, 2), 2.0))
    np.testing.assert_array_equal(np.stack(copies(two, v)), np.zeros((2, 2)))
    assert float(r) == 2.0 and float(on_read) == 0.0
    assert not any(c.flags.writeable for c in two.experimental_local_results(deepcopy(v)))


async def test_replica_skipping_an_aggregated_assign_fails_clearly(three):
    with three.scope():
        v = aiodist.Variable(0.0, aggregation="sum", name="weights")

    async def step(var):
        if rid() == 2:
            return None
        await var.assign_add(1.0)

    with pytest.raises(aiodist.ReplicaExitedError, match=r"merge_call #0: replica 2 returned"):
        await three.run(step, args=(v,))
    assert copies(three, v) == [0.0, 0.0, 0.0]


async def test_mismatch_names_the_variable_update(two):
    with two.scope():
        v = aiodist.Variable(0.0, aggregation="sum", name="bias")

    async def step(var):
        if rid() == 0:
            await var.assign_add(1.0)
        else:
            await aiodist.get_replica_context().all_reduce("sum", 1.0)

    with pytest.raises(aiodist.CollectiveMismatchError, match=r"merge_call\(bias.assign_add\)"):
        await two.run(step, args=(v,))


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
async def test_replica_values_of_other_shapes_are_named(three, aggregation):
    with three.scope():
        v = aiodist.Variable(np.zeros(2), aggregation=aggregation, name="bias")

    async def step(value):
        await v.assign_add(value)

    # A replica's value that does not fit the variable: named, with every replica's.
    uneven = aiodist.PerReplica([np.ones(2), np.ones(3), np.ones(2)])
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"bias.assign_add\(\) in replica context: the replicas' values \(replica 0: "
        r"\(2,\), replica 1: \(3,\), replica 2: \(2,\)\) cannot all be written to a "
        r"variable of shape \(2,\)",
    ):
        await three.run(step, args=(uneven,))
    np.testing.assert_array_equal(copies(three, v), np.zeros((3, 2)))
    # Values that broadcast to its shape (a scalar: every element) still combine.
    await three.run(step, args=(aiodist.PerReplica([np.float64(3.0), np.ones(2), np.ones(2)]),))
    expected = 5.0 if aggregation == "sum" else 5.0 / 3
    np.testing.assert_array_equal(copies(three, v), [[expected, expected]] * 3)


@pytest.mark.parametrize(
    ("dtype", "value", "aggregation", "expected"),
    [
        (np.int64, np.int8(100), "sum", 200),  # int8: 100 + 100 wrapped to -56
        (np.int32, np.uint8(200), "sum", 400),  # uint8: 144
        (np.int32, np.True_, "sum", 2),  # bool: True + True is True, 1
        (np.float32, np.float16(60000), "sum", 120000),  # float16: inf
        (np.float32, np.float16(60000), "mean", 60000),  # float16: inf / 2
        (np.int16, np.int8(-100), "mean", -100),
    ],
)
async def test_replica_values_of_narrower_dtypes_aggregate_in_the_variables(
    two, dtype, value, aggregation, expected
):
    # As a write of the same values in cross-replica context adds them: in the
    # variable's dtype, not in the values' own, where they wrapped or overflowed.
    with two.scope():
        v = aiodist.Variable(dtype(0), aggregation=aggregation)

    async def step():
        await v.assign_add(value)

    await two.run(step)
    for copy in copies(two, v):
        assert copy.dtype == dtype and copy == expected


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.int8])
async def test_python_ints_are_written_in_an_integer_variables_dtype(two, dtype):
    # As TF converts a Python number to the variable's dtype. NumPy made an int64
    # array of it, which an unsigned variable refused: a counter could not count by 1.
    plain = aiodist.Variable(dtype(0), name="plain")
    await plain.assign(7)
    await plain.assign_add(3)
    await plain.assign_sub(1)
    assert plain.dtype == dtype and plain.numpy() == 9
    with two.scope():
        summed = aiodist.Variable(dtype(0), aggregation="sum", name="steps")
        mean = aiodist.Variable(dtype(0), aggregation="mean", name="mean")
        first = aiodist.Variable(dtype(0), aggregation="only_first_replica", name="first")
        on_read = aiodist.Variable(
            dtype(0), synchronization="on_read", aggregation="sum", name="seen"
        )
        await summed.assign(10)  # cross-replica: every copy
        await on_read.assign(4)  # cross-replica, SUM: the first copy holds it

    async def step():
        await summed.assign_add(1)  # each replica's 1, summed: + 2
        await summed.assign_sub(rid())  # - (0 + 1)
        await mean.assign(3 + rid())  # the mean of 3 and 4, rounded half to even
        await first.assign_add(5 + rid())  # replica 0's
        await on_read.assign_add(1 + rid())  # each replica's own copy

    await two.run(step)
    for variable, expected in [(summed, 11), (mean, 4), (first, 5)]:
        for copy in copies(two, variable):
            assert copy.dtype == dtype and copy == expected, variable.name
    assert [c.dtype for c in copies(two, on_read)] == [dtype, dtype]
    assert copies(two, on_read) == [5, 2] and on_read.numpy() == 7
    with two.scope():
        await two.extended.update(summed, lambda copy: copy.assign_add(2))
        await summed.assign_add(aiodist.Mirrored([1, 1]))
    for copy in copies(two, summed):
        assert copy.dtype == dtype and copy == 14
    # Only the value given must fit: the sum wraps, as NumPy's (and TF's) does.
    top = int(np.iinfo(dtype).max)
    await plain.assign(top)
    await plain.assign_add(1)
    assert plain.numpy() == np.iinfo(dtype).min


async def test_python_ints_that_do_not_fit_an_integer_variable_are_refused(two):
    # NumPy made int64 of them, and the write cast that, wrapping: 300 read 44.
    plain = aiodist.Variable(np.int8(0), name="steps")
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"steps.assign: 300 does not fit int8 \(-128..127\), the variable's dtype",
    ):
        await plain.assign(300)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"assign_sub: 18446744073709551616 "):
        await plain.assign_sub(2**64)
    assert plain.numpy() == 0
    big = aiodist.Variable(np.int64(0), name="big")  # 2**63: NumPy's uint64, cast to -2**63
    with pytest.raises(aiodist.InvalidArgumentError, match=r"big.assign: 9223372036854775808 "):
        await big.assign(2**63)
    with two.scope():
        mirrored = aiodist.Variable(np.int8(0), aggregation="sum", name="m")
        on_read = aiodist.Variable(np.uint8(0), synchronization="on_read", aggregation="sum")
        with pytest.raises(aiodist.InvalidArgumentError, match=r"m.assign: 128 does not fit"):
            await mirrored.assign(128)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"does not fit uint8 \(0..255\)"):
            await on_read.assign(-1)
        # The copies got 1 and 0 (the second wrapped) and were no longer mirrored.
        with pytest.raises(aiodist.InvalidArgumentError, match=r"m.assign: 256 does not fit"):
            await mirrored.assign(aiodist.Mirrored([1, 256]))
        with pytest.raises(
            aiodist.InvalidArgumentError, match=r"m.assign_add \(copy on /device:CPU:0\): 500"
        ):
            await two.extended.update(mirrored, lambda copy: copy.assign_add(500))

    async def step():
        await mirrored.assign_add(1 if rid() == 0 else 300)  # aggregated: 301 read 45

    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"m.assign_add \(replica 1\): 300 does not fit int8"
    ):
        await two.run(step)

    async def local_step():
        await on_read.assign_add(-1)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"Variable.assign_add \(replica "):
        await two.run(local_step)
    assert copies(two, mirrored) == [0, 0] and copies(two, on_read) == [0, 0]
    # A float is refused by an integer variable, as before.
    with pytest.raises(aiodist.InvalidArgumentError, match=r"dtype float64 cannot be written"):
        await plain.assign(1.5)


# -- extended.update and the TF docstring examples -------------------------------------


async def test_update_per_copy_with_mirrored_args(two):
    with two.scope():
        v = aiodist.Variable(np.zeros(2))
        deltas = aiodist.Mirrored([np.ones(2), np.ones(2)])
        grouped = await two.extended.update(v, lambda copy, d: copy.assign_add(d), args=(deltas,))
        plain = await two.extended.update(v, lambda copy: copy.device, group=False)
    assert isinstance(grouped, aiodist.Mirrored)
    assert plain == ("/device:CPU:0", "/device:CPU:1")
    for copy in copies(two, v):
        np.testing.assert_array_equal(copy, [1, 1])
    with pytest.raises(ValueError, match=r"update: var=3"):
        await two.extended.update(3, print)


async def test_update_fn_gets_a_copy_that_computes_like_a_variable(two):
    """TF's update hands fn a variable, so ``var.assign(var * 2)`` works there; the
    copy fn got here had no arithmetic (TypeError), no read_value/numpy/dtype, and
    ``copy == 5`` compared identities (False)."""
    with two.scope():
        v = aiodist.Variable(np.float32([5.0, 6.0]), name="v")
        doubled = await two.extended.update(v, lambda var: var.assign(var * 2), group=False)
        await two.extended.update(v, lambda var: var.assign_sub(1 - -var / 2))
        seen = await two.extended.update(
            v,
            lambda var: (
                var.name,
                var.dtype,
                var.shape,
                var.read_value().tolist(),
                var.numpy().tolist(),
                (var == 4).tolist(),
                (var < 7).tolist(),
                float(var[1]),
                len(var),
                list(var),
                var @ var,
            ),
            group=False,
        )

    assert [c.device for c in doubled] == ["/device:CPU:0", "/device:CPU:1"]
    for copy in copies(two, v):
        np.testing.assert_array_equal(copy, np.float32([4.0, 5.0]))
        assert copy.dtype == np.float32
    for name, dtype, shape, read, host, equal, greater, second, n, items, dot in seen:
        assert (name, dtype, shape, read, host) == ("v", np.float32, (2,), [4, 5], [4, 5])
        assert equal == [True, False] and greater == [True, True]
        assert (second, n, items, float(dot)) == (5.0, 2, [4.0, 5.0], 41.0)
    with pytest.raises(TypeError, match="unhashable"):
        {doubled[0]}


async def test_update_unwraps_the_strategys_variables_in_args():
    """TF's update unwraps distributed variables among args and kwargs (its
    colocate_vars_with example: ``fn(v1, v2, v3)`` operates on each variable's
    component): fn got the whole variable instead, whose ``assign`` returned a
    coroutine nobody awaited (the write lost), and a sync-on-read one read as the
    sum of its copies. Replicas sharing a device: their first replica's copy."""
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:0", "cpu:1"])
    other = aiodist.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        var1 = aiodist.Variable(np.float32(1.0), name="var1")
        var2 = aiodist.Variable(np.float32(10.0), name="var2")
        var3 = aiodist.Variable(np.float32(0.0), name="var3")
        counts = aiodist.Variable(np.float32(0.0), synchronization="ON_READ", aggregation="sum")
    with other.scope():
        foreign = aiodist.Variable(np.float32(7.0), name="foreign")
    plain = aiodist.Variable(np.float32(3.0), name="plain")

    async def count(c):
        await c.assign_add(rid() + 1.0)

    await strategy.run(count, args=(counts,))  # copies 1, 2, 3

    seen = []

    def fn(v1, v2, v3, *, c, kept):
        seen.append((v1.device, v2.device, v3.device, c.device, float(c)))
        assert kept[0] is foreign and kept[1] is plain  # only this strategy's
        v3.assign(v1 + v2)
        return v1.assign(c)

    with strategy.scope():
        await strategy.extended.update(
            var1, fn, args=(var2, var3), kwargs={"c": counts, "kept": [foreign, plain]}
        )

    assert seen == [
        ("/device:CPU:0", "/device:CPU:0", "/device:CPU:0", "/device:CPU:0", 1.0),
        ("/device:CPU:1", "/device:CPU:1", "/device:CPU:1", "/device:CPU:1", 3.0),
    ]
    assert copies(strategy, var3) == [11.0, 11.0, 11.0]
    assert copies(strategy, var1) == [1.0, 1.0, 3.0]  # each copy its replica's count


async def test_an_update_failing_for_one_copy_changes_no_copy(two):
    """fn raising for the second copy (here its Mirrored component of another shape)
    left the first copy written and the second not: mirrors apart for good, and an
    unwrapped variable fn had written changed half-way too. Every copy is as
    before, as after a failed assign."""
    with two.scope():
        v = aiodist.Variable(np.zeros(3), name="v")
        w = aiodist.Variable(np.zeros(3), name="w")
        values = aiodist.Mirrored([np.ones(3), np.ones(4)])

        def fn(copy, value, other):
            other.assign_add(1.0)
            return copy.assign(value)

        with pytest.raises(aiodist.InvalidArgumentError, match=r"v.assign \(copy on .*CPU:1\)"):
            await two.extended.update(v, fn, args=(values, w))
    np.testing.assert_array_equal(np.stack(copies(two, v) + copies(two, w)), np.zeros((4, 3)))


async def _tf_reduce_to_update_example(strategy, batch: bool):
    """TF's reduce_to / batch_reduce_to docstring: merge_fn reduces, then updates."""

    async def step_fn(var):
        async def merge_fn(strategy, value, var):
            if batch:
                reduced = (await strategy.extended.batch_reduce_to("sum", [(value, var)]))[0]
            else:
                reduced = await strategy.extended.reduce_to("sum", value, destinations=var)
            await strategy.extended.update(
                var, lambda var, value: var.assign(value), args=(reduced,)
            )

        value = np.float32(1.0)  # a new object per replica, like tf.identity(1.)
        await aiodist.get_replica_context().merge_call(merge_fn, args=(value, var))

    with strategy.scope():
        v = aiodist.Variable(np.float32(0.0))
    await strategy.run(step_fn, args=(v,))
    return v


@pytest.mark.parametrize("batch", [False, True], ids=["reduce_to", "batch_reduce_to"])
async def test_tf_reduce_to_update_example(batch):
    mirrored = await _tf_reduce_to_update_example(
        aiodist.MirroredStrategy(["cpu:0", "cpu:1"]), batch
    )
    assert isinstance(mirrored, aiodist.MirroredVariable)
    assert copies(aiodist.MirroredStrategy(["cpu:0", "cpu:1"]), mirrored) == [2.0, 2.0]
    one = await _tf_reduce_to_update_example(aiodist.OneDeviceStrategy("cpu:0"), batch)
    assert float(one.read_value()) == 1.0


async def test_variables_as_run_args_and_destinations(two):
    with two.scope():
        v = aiodist.Variable(np.arange(2.0))

    async def fn(var):
        return var * (rid() + 1)

    result = await two.run(fn, args=(v,))
    np.testing.assert_array_equal(two.experimental_local_results(result)[1], [0.0, 2.0])
    value = aiodist.PerReplica([np.ones(2), np.ones(2)])
    mirrored = await two.extended.reduce_to("sum", value, destinations=v)
    assert mirrored.devices == v.devices


async def test_replicas_sharing_a_device_share_a_mirrored_copy(tmp_path):
    """SPEC 9: a mirrored variable has one copy per device (several replicas on one
    device, as on a shared GPU, read and update one copy); a sync-on-read variable
    keeps one per replica, as each replica updates its own."""
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:0", "cpu:1"])
    with strategy.scope():
        w = aiodist.Variable(np.zeros(2), aggregation="sum", name="w")
        seen = aiodist.Variable(0, synchronization="ON_READ", aggregation="sum", name="seen")
    assert w.devices == ("/device:CPU:0", "/device:CPU:1")
    assert len(w._values) == 2
    assert seen.devices == ("/device:CPU:0", "/device:CPU:0", "/device:CPU:1")

    async def step(w, seen):
        await w.assign_add(np.full(2, rid() + 1.0))  # 1 + 2 + 3 on every copy
        await seen.assign_add(rid() + 1)  # each replica's own copy
        return w.read_value(), seen.read_value()

    values, counts = await strategy.run(step, args=(w, seen))
    local = strategy.experimental_local_results(values)
    assert local[0] is local[1]  # replicas 0 and 1 read the copy of cpu:0
    for value in local:
        np.testing.assert_array_equal(value, [6.0, 6.0])
    assert [int(c) for c in strategy.experimental_local_results(counts)] == [1, 2, 3]
    assert int(np.asarray(seen)) == 6
    assert len(strategy.experimental_local_results(w)) == 3  # one per replica, as TF's

    # extended.update: fn once per copy, with the component of the copy's first
    # replica; the result is per replica.
    mirrored = await strategy.extended.reduce_to("sum", w, destinations=w)  # 3 x 6
    assert mirrored.devices == ("/device:CPU:0", "/device:CPU:0", "/device:CPU:1")
    calls = []

    def assign(copy, value):
        calls.append(copy.device)
        return copy.assign(value)

    result = await strategy.extended.update(w, assign, args=(mirrored,))
    assert calls == ["/device:CPU:0", "/device:CPU:1"]
    assert len(result.values) == 3 and result.values[0] is result.values[1]
    # group=False: the same per-replica results, unwrapped (as TF: "an element per
    # replica"); it gave one per copy.
    plain = await strategy.extended.update(w, lambda copy: copy.device, group=False)
    assert plain == ("/device:CPU:0", "/device:CPU:0", "/device:CPU:1")
    for value in strategy.experimental_local_results(w):
        np.testing.assert_array_equal(value, [18.0, 18.0])
    np.testing.assert_array_equal(await strategy.reduce("sum", w, axis=None), [54.0, 54.0])

    # A cross-replica write of a Mirrored value: each copy its first replica's part.
    await w.assign(aiodist.Mirrored([np.ones(2), np.ones(2), np.ones(2)]))
    for value in strategy.experimental_local_results(w):
        np.testing.assert_array_equal(value, [1.0, 1.0])

    # Checkpoints carry the value across to a strategy of distinct devices.
    path = await aiodist.save_variables(tmp_path / "shared.npz", [w, seen])
    other = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
    with other.scope():
        w2 = aiodist.Variable(np.zeros(2), aggregation="sum", name="w")
        seen2 = aiodist.Variable(0, synchronization="ON_READ", aggregation="sum", name="seen")
    await aiodist.restore_variables(path, [w2, seen2])
    for value in copies(other, w2):
        np.testing.assert_array_equal(value, [1.0, 1.0])
    assert int(np.asarray(seen2)) == 6


# -- checkpoints ---------------------------------------------------------------------


async def test_checkpoint_round_trip_across_replica_counts(tmp_path):
    four = aiodist.MirroredStrategy(cpu_devices(4))
    with four.scope():
        w = aiodist.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
        steps = aiodist.Variable(np.int64(7), name="steps")
        seen = aiodist.Variable(0, synchronization="ON_READ", aggregation="sum", name="seen")
        await w.assign(w.read_value() * 1.5)

    async def count(var):
        await var.assign_add(rid() + 1)

    await four.run(count, args=(seen,))  # 1+2+3+4 = 10 over 4 copies
    path = await aiodist.save_variables(tmp_path / "ckpt.npz", [w, steps, seen])
    assert path.exists()

    two = aiodist.MirroredStrategy(cpu_devices(2))
    with two.scope():
        w2 = aiodist.Variable(np.zeros((2, 3), dtype=np.float32), name="w")
        steps2 = aiodist.Variable(np.int64(0), name="steps")
        seen2 = aiodist.Variable(0, synchronization="ON_READ", aggregation="sum", name="seen")
    await aiodist.restore_variables(path, {"w": w2, "steps": steps2, "seen": seen2})
    for copy in copies(two, w2):
        np.testing.assert_array_equal(copy, np.arange(6).reshape(2, 3) * 1.5)
    assert copies(two, steps2) == [7, 7]
    assert int(seen2.read_value()) == 10  # exact, even for an int SUM over 2 copies

    plain = aiodist.Variable(np.zeros((2, 3), dtype=np.float32), name="w")
    await aiodist.restore_variables(path, [plain])
    np.testing.assert_array_equal(plain.numpy(), np.arange(6).reshape(2, 3) * 1.5)


async def test_restore_reads_only_the_arrays_asked_for(tmp_path):
    import io
    import zipfile

    w = aiodist.Variable(np.arange(3.0), name="w")
    path = await aiodist.save_variables(tmp_path / "c.npz", [w])
    truncated = io.BytesIO()
    np.save(truncated, np.zeros(1000))
    with zipfile.ZipFile(path, "a") as archive:  # another array, unreadable (cut short)
        archive.writestr("other.npy", truncated.getvalue()[:200])
    target = aiodist.Variable(np.zeros(3), name="w")
    await aiodist.restore_variables(path, [target])
    np.testing.assert_array_equal(target.numpy(), [0.0, 1.0, 2.0])
    missing = aiodist.Variable(np.zeros(3), name="v")
    with pytest.raises(ValueError, match=r"The checkpoint holds: other, w\."):
        await aiodist.restore_variables(path, [missing])


async def test_restore_reads_a_checkpoint_of_the_other_byte_order(tmp_path):
    # As written on a big-endian machine: the same values, refused before as
    # "'w' is >f4[3] in the checkpoint but float32[3] here".
    path = tmp_path / "big_endian.npz"
    np.savez(path, w=np.arange(3, dtype=">f4"), n=np.array([7, 8], dtype=">i8"))
    w = aiodist.Variable(np.zeros(3, dtype=np.float32), name="w")
    n = aiodist.Variable(np.zeros(2, dtype=np.int64), name="n")
    await aiodist.restore_variables(path, [w, n])
    assert w.numpy().dtype == np.float32 and w.numpy().dtype.isnative
    np.testing.assert_array_equal(w.numpy(), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(n.numpy(), [7, 8])
    other_kind = aiodist.Variable(np.zeros(3, dtype=np.float64), name="w")
    with pytest.raises(
        ValueError, match=r"'w' is >f4\[3\] in the checkpoint but float64\[3\] here"
    ):
        await aiodist.restore_variables(path, [other_kind])  # a byte order, not a cast


async def test_a_variable_of_the_other_byte_order_restores_what_it_saved(tmp_path):
    # A variable made from a big-endian array (a FITS file's, say) keeps '>f4'; its
    # own checkpoint was refused as "'w' is >f4[3] in the checkpoint but >f4[3]
    # here" once restoring compared the file's dtype in native order with the
    # variable's as it is. Either byte order of the file restores into it.
    w = aiodist.Variable(np.arange(3, dtype=">f4"), name="w")
    saved = await aiodist.save_variables(tmp_path / "w.npz", [w])
    native = tmp_path / "native.npz"
    np.savez(native, w=np.array([5, 6, 7], dtype="<f4"))
    for path, expected in [(native, [5.0, 6.0, 7.0]), (saved, [0.0, 1.0, 2.0])]:
        await aiodist.restore_variables(path, [w])
        assert w.dtype == np.dtype(">f4")
        np.testing.assert_array_equal(w.numpy(), expected)


async def test_restore_mismatch_changes_nothing(tmp_path):
    a = aiodist.Variable(np.ones(3), name="a")
    b = aiodist.Variable(np.ones(2), name="b")
    path = await aiodist.save_variables(tmp_path / "c.npz", {"a": a, "b": b})
    target_a = aiodist.Variable(np.zeros(3), name="a")
    wrong_shape = aiodist.Variable(np.zeros(4), name="b")
    with pytest.raises(
        ValueError, match=r"'b' is float64\[2\] in the checkpoint but float64\[4\] here"
    ):
        await aiodist.restore_variables(path, [target_a, wrong_shape])
    np.testing.assert_array_equal(target_a.numpy(), [0, 0, 0])  # nothing restored
    wrong_dtype = aiodist.Variable(np.zeros(2, dtype=np.float32), name="b")
    with pytest.raises(ValueError, match=r"float32\[2\] here"):
        await aiodist.restore_variables(path, [wrong_dtype])
    missing = aiodist.Variable(np.zeros(3), name="c")
    with pytest.raises(ValueError, match=r"'c' is not in the checkpoint.*holds: a, b"):
        await aiodist.restore_variables(path, [missing])
    with pytest.raises(ValueError, match=r"no checkpoint at"):
        await aiodist.restore_variables(tmp_path / "none.npz", [missing])
    with pytest.raises(ValueError, match=r"two variables are named 'a'"):
        await aiodist.save_variables(tmp_path / "d.npz", [a, aiodist.Variable(1.0, name="a")])


async def test_save_is_atomic_under_a_killed_writer(tmp_path):
    """A writer killed mid-save leaves the previous checkpoint intact at the path."""
    import subprocess
    import sys

    path = tmp_path / "model.npz"
    await aiodist.save_variables(path, [aiodist.Variable(np.arange(4.0), name="w")])
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, numpy as np, aiodist;"
            "v = aiodist.Variable(np.ones(60_000_000), name='w');"
            "print('ready', flush=True);"
            f"aiodist.run(aiodist.save_variables({str(path)!r}, [v]))",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        for _ in range(2000):  # until the temporary file exists and is growing
            temporary = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            if temporary and temporary[0].stat().st_size > 1_000_000:
                break
            await asyncio.sleep(0.005)
        else:
            pytest.fail("the writer never started writing its temporary file")
        writer.kill()
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
    restored = aiodist.Variable(np.zeros(4), name="w")
    await aiodist.restore_variables(path, [restored])
    np.testing.assert_array_equal(restored.numpy(), [0, 1, 2, 3])


async def test_a_cancelled_save_leaves_the_file_as_it_was(tmp_path):
    """A thread is not cancelled with the task awaiting it: a save cancelled (by
    wait_for's timeout, a shutdown) went on writing and renamed its file over the
    checkpoint afterwards (over one saved after the cancellation, too)."""
    path = tmp_path / "model.npz"
    w = aiodist.Variable(np.zeros(20_000_000, np.float32), name="w")
    await aiodist.save_variables(path, [w])
    await w.assign(np.ones(w.shape, np.float32))

    def temporary_files():
        return [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    save = asyncio.create_task(aiodist.save_variables(path, [w]))
    await wait_until(temporary_files, "the save writes its temporary file")
    save.cancel()  # while its thread writes 80 MB
    with pytest.raises(asyncio.CancelledError):
        await save
    for _ in range(4000):  # until the thread has given up (or, before, renamed)
        if not temporary_files():
            break
        await asyncio.sleep(0.005)
    else:
        pytest.fail("the cancelled save's temporary file stayed")
    restored = aiodist.Variable(np.ones(w.shape, np.float32), name="w")
    await aiodist.restore_variables(path, [restored])
    assert not restored.numpy().any()  # the first save's zeros


async def test_checkpoints_refused_inside_replicas(two, tmp_path):
    v = aiodist.Variable(1.0)

    async def fn():
        await aiodist.save_variables(tmp_path / "x.npz", [v])

    with pytest.raises(aiodist.ContextError, match=r"inside a replica function"):
        await two.run(fn)


async def test_updating_different_variables_is_a_mismatch(two):
    with two.scope():
        v = aiodist.Variable(0.0, aggregation="sum", name="x")
        w = aiodist.Variable(0.0, aggregation="sum", name="x")  # same name, other variable

    async def step():
        await (v if rid() == 0 else w).assign_add(1.0)

    with pytest.raises(aiodist.CollectiveMismatchError):
        await two.run(step)
    assert copies(two, v) == [0.0, 0.0] and copies(two, w) == [0.0, 0.0]


# -- regressions from review -----------------------------------------------------------


async def test_checkpoint_names_are_kept_whatever_they_are(tmp_path):
    odd = [
        aiodist.Variable(np.arange(2.0) + i, name=n)
        # ("a" and "a.npy": NumPy's own lookup of "a.npy" finds a's array.)
        for i, n in enumerate(["file", "allow_pickle", "a/b", "a", "a.npy", "a.npy.npy"])
    ]
    path = await aiodist.save_variables(tmp_path / "c.npz", odd)
    held = ["a", "a.npy", "a.npy.npy", "a/b", "allow_pickle", "file"]
    assert sorted(np.load(path).files) == held
    fresh = [aiodist.Variable(np.zeros(2), name=v.name) for v in odd]
    await aiodist.restore_variables(path, fresh)
    for before, after in zip(odd, fresh, strict=True):
        np.testing.assert_array_equal(after.numpy(), before.numpy())
    with pytest.raises(ValueError, match=r"'b' in the list is not an aiodist.Variable"):
        await aiodist.save_variables(tmp_path / "d.npz", [odd[0], "b"])


async def test_int_sync_on_read_variables_round_trip_and_assign(strategy, num_replicas, tmp_path):
    with strategy.scope():
        hits = aiodist.Variable(
            np.zeros(3, dtype=np.int64), synchronization="ON_READ", aggregation="mean", name="hits"
        )
        count = aiodist.Variable(
            np.int64(0), synchronization="ON_READ", aggregation="sum", name="count"
        )
    await count.assign(7)  # cross-replica, SUM, integers: exact
    assert int(count.read_value()) == 7
    # A value it refuses is named as the assign it is (it said "count.restore").
    with pytest.raises(aiodist.InvalidArgumentError, match=r"^count\.assign: a value of dtype"):
        await count.assign(1.5)
    assert int(count.read_value()) == 7
    await hits.assign(np.array([2, 4, 6]))
    path = await aiodist.save_variables(tmp_path / "h.npz", [hits, count])
    await hits.assign(np.zeros(3, dtype=np.int64))
    await aiodist.restore_variables(path, [hits, count])
    np.testing.assert_array_equal(hits.read_value(), [2, 4, 6])
    assert int(count.read_value()) == 7


async def test_integer_mean_variables_neither_wrap_nor_round_off(strategy, num_replicas, tmp_path):
    big = 2**53 + 1  # not a float64
    with strategy.scope():
        small = aiodist.Variable(np.int8(0), synchronization="ON_READ", aggregation="mean")
        large = aiodist.Variable(np.int64(0), synchronization="ON_READ", aggregation="mean")
        mirrored = aiodist.Variable(np.int8(0), aggregation="mean", name="mirrored")

    async def fn():
        await small.assign(np.int8(100))
        await large.assign(np.int64(big))
        await mirrored.assign(np.int8(100 + rid()))  # aggregated: the mean, rounded

    await strategy.run(fn)
    assert float(small.read_value()) == 100.0  # 100 + 100 would wrap in int8
    expected = round(100 + (num_replicas - 1) / 2)  # half to even: 100.5 -> 100
    assert copies(strategy, mirrored) == [expected] * num_replicas
    path = await aiodist.save_variables(tmp_path / "m.npz", {"small": small, "large": large})
    with np.load(path) as saved:
        assert saved["small"] == 100 and saved["small"].dtype == np.int8
        assert int(saved["large"]) == big and saved["large"].dtype == np.int64


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
async def test_integer_means_of_64_bit_values_are_exact(strategy, num_replicas, dtype, tmp_path):
    # 2**53 + 1 is not a float64 (a float mean rounds it off), and a 64-bit sum of
    # values near 2**62 (2**63 unsigned) wraps: the MEAN is neither.
    top = 2**62 if dtype is np.int64 else 2**63

    def value(r: int) -> np.ndarray:
        return np.array([2**53 + 1 + 2 * r, top + r, top + 2 * r + 1], dtype)

    # The exact means of value(0) .. value(n - 1), rounded half to even (Python's
    # round of a Fraction): top + (n - 1) / 2 is a half for an even n.
    n = num_replicas
    exact = [round(Fraction(sum(int(value(r)[i]) for r in range(n)), n)) for i in range(3)]
    assert exact[0] == 2**53 + n and exact[2] == top + n
    with strategy.scope():
        mirrored = aiodist.Variable(np.zeros(3, dtype), aggregation="mean", name="mirrored")
        on_read = aiodist.Variable(
            np.zeros(3, dtype), synchronization="ON_READ", aggregation="mean", name="on_read"
        )

    async def fn():
        await mirrored.assign(value(rid()))  # aggregated: the MEAN
        await on_read.assign(value(rid()))  # this replica's copy

    await strategy.run(fn)
    assert [int(x) for x in mirrored.numpy()] == exact
    assert all(c.dtype == dtype for c in copies(strategy, mirrored))
    path = await aiodist.save_variables(tmp_path / "m.npz", [on_read])
    with np.load(path) as saved:
        assert saved["on_read"].dtype == dtype
        assert [int(x) for x in saved["on_read"]] == exact


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_bool_variables_refuse_summing_aggregations(two, aggregation):
    with two.scope():
        aiodist.Variable(True, synchronization="ON_READ", aggregation="only_first_replica")
        with pytest.raises(
            ValueError, match=rf"bool variable cannot have aggregation={aggregation.upper()}"
        ):
            aiodist.Variable(True, synchronization="ON_READ", aggregation=aggregation)


async def test_update_refuses_an_async_fn(two):
    with two.scope():
        v = aiodist.Variable(0.0)

    async def bump(copy):
        copy.assign_add(1.0)

    with two.scope():
        with pytest.raises(ValueError, match=r"returned an awaitable; fn runs once per copy"):
            await two.extended.update(v, bump)
    assert copies(two, v) == [0.0, 0.0]


async def test_update_checks_its_args_and_kwargs(two):
    with two.scope():
        v = aiodist.Variable(0.0)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"update: args must be a list"):
            await two.extended.update(v, lambda copy, a, b: None, args=np.array([1.0, 2.0]))
        with pytest.raises(aiodist.InvalidArgumentError, match=r"update: kwargs must be a dict"):
            await two.extended.update(v, lambda copy, a: None, kwargs=[("a", 1)])
        await two.extended.update(v, lambda copy, a, b: copy.assign(a + b), args=[1.0, 2.0])
    assert copies(two, v) == [3.0, 3.0]


async def test_checkpoint_paths_that_cannot_be_used_are_named(two, tmp_path):
    with two.scope():
        w = aiodist.Variable(np.zeros(2), name="w")
    with pytest.raises(ValueError, match=r"folder '.*missing' does not exist"):
        await aiodist.save_variables(tmp_path / "missing" / "c.npz", [w])
    # A folder: the rename over it failed once the file was written, naming the
    # temporary file (IsADirectoryError: '.folder.1f2e....tmp' -> 'folder').
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match=r"cannot write '.*folder': it is a folder"):
        await aiodist.save_variables(tmp_path / "folder", [w])
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "text.npz").write_text("not a checkpoint")
    np.save(tmp_path / "one.npy", np.zeros(2))
    for name in ("empty.npz", "text.npz", "one.npy", "folder"):
        with pytest.raises(
            ValueError, match=rf"'.*{name}' is not a checkpoint that save_variables"
        ):
            await aiodist.restore_variables(tmp_path / name, [w])
    with pytest.raises(ValueError, match=r"holds a NUL character"):
        await aiodist.save_variables(tmp_path / "n.npz", {"x\0y": w})


async def test_damaged_checkpoints_are_named_and_their_arrays_checked_first(tmp_path):
    """A checkpoint damaged in its zip directory raised zipfile's own
    NotImplementedError (a compression method byte changed) or RuntimeError (an
    encryption flag set), naming neither the file nor restore_variables; a damaged
    .npy header declaring a huge shape made NumPy try to allocate it (MemoryError,
    "Unable to allocate 1.00 TiB") before the shape was compared."""
    w = aiodist.Variable(np.zeros(3, np.float32), name="w")
    path = await aiodist.save_variables(tmp_path / "c.npz", [w])
    good = path.read_bytes()
    directory = good.index(b"PK\x01\x02")  # the central directory's entry for w.npy
    for offset, value, text in [(10, 99, "NotImplementedError"), (8, 1, "RuntimeError")]:
        damaged = bytearray(good)
        struct.pack_into("<H", damaged, directory + offset, value)
        (tmp_path / "bad.npz").write_bytes(damaged)
        with pytest.raises(
            aiodist.InvalidArgumentError,
            match=rf"restore_variables: '.*bad.npz' is not a checkpoint .*: {text}",
        ):
            await aiodist.restore_variables(tmp_path / "bad.npz", [w])
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as archive:
        with archive.open("w.npy", "w") as member:
            header = {"descr": "<f4", "fortran_order": False, "shape": (2**40,)}
            np.lib.format.write_array_header_1_0(member, header)
            member.write(bytes(12))
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"'w' is float32\[1099511627776\] in the checkpoint but float32\[3\] here",
    ):
        await aiodist.restore_variables(tmp_path / "huge.npz", [w])
    np.testing.assert_array_equal(w.numpy(), [0, 0, 0])


async def test_checkpoint_dicts_need_str_names_and_variables(tmp_path):
    v = aiodist.Variable(1.0)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"the entry 1: .* not a str name"):
        await aiodist.save_variables(tmp_path / "c.npz", {1: v})
    with pytest.raises(aiodist.InvalidArgumentError, match=r"the entry 'w': 2.0 is not"):
        await aiodist.save_variables(tmp_path / "c.npz", {"v": v, "w": 2.0})
    assert not (tmp_path / "c.npz").exists()


async def test_checkpoint_files_follow_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        path = await aiodist.save_variables(tmp_path / "p.npz", [aiodist.Variable(1.0)])
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


async def test_reduce_of_a_variable_reduces_its_copies_as_tf_does(two):
    with two.scope():
        seen = aiodist.Variable(0.0, synchronization="ON_READ", aggregation="sum")
        w = aiodist.Variable(2.0)

    async def count():
        await seen.assign_add(float(rid() + 1))  # copies 1 and 2

    await two.run(count)
    assert float(seen.read_value()) == 3.0  # the aggregated read
    assert float(await two.reduce("mean", seen, axis=None)) == 1.5  # its copies' mean
    assert float(await two.reduce("sum", seen, axis=None)) == 3.0
    assert float(await two.extended.reduce_to("mean", seen, "cpu:0")) == 1.5
    ops = two.extended._cross_device_ops  # the cross-device ops' own reduce too
    assert float(await ops.reduce("mean", seen, "cpu:0")) == 1.5
    assert float(await two.reduce("sum", w, axis=None)) == 4.0  # two copies of 2.0


async def test_a_plain_variable_is_reduced_as_its_value_as_tf_does(two):
    # Made outside any scope, it is not distributed: as for a plain array, its MEAN
    # is itself and its SUM over several replicas is ambiguous (TF's rule).
    plain = aiodist.Variable(np.array([1.0, 3.0]), name="plain")
    ops = two.extended._cross_device_ops
    with two.scope():
        for mean in (
            two.reduce("mean", plain, axis=None),
            two.extended.reduce_to("mean", plain, "cpu:1"),
            ops.reduce("mean", plain, "cpu:0"),
        ):
            np.testing.assert_array_equal(await mean, [1.0, 3.0])
        assert float(await two.reduce("mean", plain, axis=0)) == 2.0
        np.testing.assert_array_equal(await two.gather(plain, axis=0), [1.0, 3.0])
        for total in (
            two.reduce("sum", plain, axis=None),
            two.extended.reduce_to("sum", plain, "cpu:0"),
            two.extended.batch_reduce_to("sum", [(plain, "cpu:0")]),
        ):
            with pytest.raises(
                aiodist.InvalidArgumentError,
                match=r"not distributed \(Variable\) cannot be reduced with SUM across 2",
            ):
                await total


async def test_writing_a_variable_under_another_strategy_raises(two, three):
    with two.scope():
        v = aiodist.Variable(1.0, aggregation="mean")

    async def fn():
        await v.assign_add(1.0)

    with pytest.raises(RuntimeError, match=r"Mixing different aiodist strategies"):
        await three.run(fn)
    with three.scope(), pytest.raises(RuntimeError, match=r"Mixing different aiodist"):
        await v.assign(7.0)
    assert copies(two, v) == [1.0, 1.0]  # nothing was written
    await v.assign(3.0)  # outside any scope: fine, as under its own
    with two.scope():
        await v.assign_add(1.0)
    assert copies(two, v) == [4.0, 4.0]


async def test_updating_a_variable_through_another_strategy_raises(two, three):
    with two.scope():
        v = aiodist.Variable(1.0, name="w")
    # As its own writes do (TF's rule): in the other strategy's scope and outside any.
    with three.scope(), pytest.raises(RuntimeError, match=r"Mixing different aiodist strategies"):
        await three.extended.update(v, lambda copy: copy.assign(5.0))
    with pytest.raises(aiodist.ContextError, match=r"variable 'w' was called on MirroredStrategy"):
        await three.extended.update(v, lambda copy: copy.assign(5.0))
    assert copies(two, v) == [1.0, 1.0]  # nothing was written
    await aiodist.get_strategy().extended.update(v, lambda copy: copy.assign(2.0))  # no scope
    with two.scope():
        await two.extended.update(v, lambda copy: copy.assign_add(1.0))
    assert copies(two, v) == [3.0, 3.0]


async def test_reducing_another_strategys_variable_names_the_variable(two, three):
    """It said "a PerReplica with 2 values was passed to a strategy with 3 local
    replicas", for a variable, naming neither it, the call nor a remedy."""
    with two.scope():
        v = aiodist.Variable(1.0, name="w")
    for call in (three.reduce("sum", v), three.gather(v, axis=0)):
        with pytest.raises(
            aiodist.InvalidArgumentError,
            match=r"strategy\.(reduce|gather): variable 'w' was made in the scope of "
            r"MirroredStrategy\(.*\), which has 2 replicas, not 3 as MirroredStrategy.*; "
            "pass a variable to the strategy whose scope made it",
        ):
            await call
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"strategy\.reduce: a PerReplica with 2 values .* 3 local replicas; expected",
    ):
        await three.reduce("sum", aiodist.PerReplica([1.0, 2.0]))


def test_variable_created_in_scope(two, three):
    with two.scope():
        v = aiodist.Variable(1.0)
    plain = aiodist.Variable(1.0)
    default = aiodist.get_strategy()
    assert two.extended.variable_created_in_scope(v)
    assert not three.extended.variable_created_in_scope(v)
    assert not two.extended.variable_created_in_scope(plain)
    assert default.extended.variable_created_in_scope(plain)
    assert not default.extended.variable_created_in_scope(v)
    assert not two.extended.variable_created_in_scope(1.0)


@pytest.mark.parametrize(
    ("value", "dtype", "text"),
    [
        (300, np.int8, "initial value: 300 does not fit int8 (-128..127)"),
        ([1, -1], np.uint8, "initial value: -1 does not fit uint8 (0..255)"),
        (1.7, np.int32, "dtype float64 cannot become dtype int32 without loss"),
        (1 + 2j, np.float32, "dtype complex128 cannot become dtype float32 without loss"),
        (2, bool, "dtype int64 cannot become dtype bool without loss"),
    ],
)
def test_an_initial_value_its_dtype_cannot_hold_is_refused(value, dtype, text):
    # NumPy's cast read 44, 255, 1, 1.0 and True; TF refuses these too.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no ComplexWarning from a cast made first)
        with pytest.raises(aiodist.InvalidArgumentError, match=re.escape(text)):
            aiodist.Variable(value, dtype=dtype, name="v")


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [([1, 2], np.uint8, [1, 2]), (127, np.int8, 127), (5, np.float16, 5.0), (True, np.int8, 1)],
)
def test_an_initial_value_its_dtype_holds_is_taken_in_it(value, dtype, expected):
    v = aiodist.Variable(value, dtype=dtype)
    assert v.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(v.numpy(), expected)


async def test_integers_of_a_wider_dtype_are_written_when_they_fit():
    # A list of Python ints (int64) onto a uint8 variable was refused as "dtype
    # int64"; np.int64(300) onto an int8 one read 44. Now both are taken in the
    # variable's dtype when they fit (the sum wrapping as for a Python int), and
    # refused, naming the value, when they do not.
    counts = aiodist.Variable(np.array([254, 0], np.uint8), name="counts")
    await counts.assign_add([1, 2])
    np.testing.assert_array_equal(counts.numpy(), [255, 2])
    await counts.assign_add(np.array([1, 1], np.int64))
    np.testing.assert_array_equal(counts.numpy(), [0, 3])  # 255 + 1 wraps in uint8
    assert counts.dtype == np.uint8
    small = aiodist.Variable(np.int8(0), name="small")
    with pytest.raises(aiodist.InvalidArgumentError, match=r"small.assign: 300 does not fit int8"):
        await small.assign(np.int64(300))
    with pytest.raises(aiodist.InvalidArgumentError, match=r"counts.assign: -1 does not fit uint8"):
        await counts.assign([5, -1])
    assert small.numpy() == 0
    np.testing.assert_array_equal(counts.numpy(), [0, 3])
