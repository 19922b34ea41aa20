"""Large host reductions: parallel blocked path, and result buffers never reused while held."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

import aiodist
from aiodist._host_reduce import (
    BLOCK_BYTES,
    PARALLEL_MIN_BYTES,
    POOL_MIN_BYTES,
    RESULTS_MAX_BYTES,
    SCRATCH_MAX_BYTES,
    combine,
    pack,
)
from tests.conftest import cpu_devices

BLOCK = BLOCK_BYTES // 4  # float32 elements per block
LARGE = PARALLEL_MIN_BYTES // 4 + 12345  # float32 elements: not a multiple of BLOCK
POOLED = 3 * BLOCK + 777  # pooled, several blocks, one thread


@pytest.mark.parametrize("size", [POOLED, LARGE], ids=["blocked", "parallel"])
@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("ufunc", [np.add, np.minimum, np.maximum, np.multiply])
def test_blocked_and_parallel_paths_match_numpy(size, count, ufunc):
    rng = np.random.default_rng(count)
    arrays = [rng.uniform(0.5, 1.5, size=size).astype(np.float32) for _ in range(count)]
    assert arrays[0].nbytes >= POOL_MIN_BYTES and size % BLOCK
    assert (size > BLOCK) and (size * 4 < PARALLEL_MIN_BYTES) == (size == POOLED)
    expected = arrays[0].copy()
    for array in arrays[1:]:
        expected = ufunc(expected, array)
    np.testing.assert_array_equal(combine(ufunc, arrays), expected)


@pytest.mark.parametrize("size", [3, POOLED, LARGE], ids=["plain", "blocked", "parallel"])
def test_big_endian_inputs_give_a_native_result_at_every_size(size):
    # The plain path's ufunc gives native byte order; the pooled one gave '>f4'
    # from 64 KiB on (found by the reductions review).
    arrays = [(np.arange(size) + i).astype(">f4") for i in range(3)]
    assert not arrays[0].dtype.isnative
    total = combine(np.add, arrays)
    assert total.dtype == np.dtype("float32") and total.dtype.isnative
    np.testing.assert_array_equal(total, 3 * np.arange(size, dtype=np.float32) + 3)


def test_non_contiguous_and_small_inputs_take_the_plain_path():
    big = np.arange(2 * LARGE, dtype=np.float64)[::2]  # strided
    np.testing.assert_array_equal(combine(np.add, [big, big]), 2 * big)
    np.testing.assert_array_equal(combine(np.add, [np.float32(1), np.float32(2)]), 3)


def test_buffer_reused_only_when_no_result_is_held():
    arrays = [np.ones(LARGE, dtype=np.float32)] * 2
    first = combine(np.add, arrays)
    second = combine(np.add, arrays)
    assert second is not first  # `first` is still held
    first_id = id(first)
    del first
    third = combine(np.add, arrays)
    assert id(third) == first_id  # reused once released
    view = third.view()
    del third
    fourth = combine(np.add, arrays)
    assert fourth is not view.base and fourth is not second  # live results pin their buffers
    fourth[:] = 0
    np.testing.assert_array_equal(view, 2)


def test_result_buffers_of_ever_new_shapes_are_not_all_kept():
    # Variable-length batches: a new shape at every step. The pool used to keep a
    # buffer for each shape forever (1.1 GiB after 300 steps of about 4 MiB each).
    size = PARALLEL_MIN_BYTES // 4  # float32 elements, 4 MiB
    steps = 2 * RESULTS_MAX_BYTES // PARALLEL_MIN_BYTES
    source = np.ones(size + steps, dtype=np.float32)
    alive = []
    for step in range(steps):
        part = source[: size + step]
        alive.append(weakref.ref(combine(np.add, [part, part])))  # result dropped at once
    kept = sum(ref() is not None for ref in alive)
    assert kept <= RESULTS_MAX_BYTES // PARALLEL_MIN_BYTES + 1 < steps


async def test_held_all_reduce_results_never_change(num_replicas):
    strategy = aiodist.MirroredStrategy(cpu_devices(num_replicas))

    async def step(k):
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", np.full(LARGE, k, dtype=np.float32))

    kept = [await strategy.run(step, args=(k,)) for k in range(4)]
    for k, result in enumerate(kept):
        for value in strategy.experimental_local_results(result):
            assert value[0] == value[-1] == k * num_replicas


@pytest.mark.parametrize(
    "ops",
    [
        aiodist.ReductionToOneDevice(),
        # hands back its first input: a pack scratch array, which must not escape
        aiodist.ReductionToOneDevice(accumulation_fn=lambda arrays: arrays[0]),
    ],
    ids=["default", "accumulation_fn"],
)
@pytest.mark.parametrize(
    "shapes", [[(2, 3), (POOLED,), ()], [(2, 3)] * 3], ids=["mixed", "one shape"]
)
async def test_held_batched_results_never_change(ops, shapes):
    # Lists of leaves are packed into scratch arrays reused at every step; results
    # (pooled or not, split per leaf by slices or by one reshape) must not share
    # memory with them.
    strategy = aiodist.MirroredStrategy(cpu_devices(2), cross_device_ops=ops)

    async def step(k):
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", [np.full(shape, k, np.float32) for shape in shapes])

    kept = [await strategy.run(step, args=(k,)) for k in range(1, 4)]
    per_replica = 1 if ops.accumulation_fn is not None else 2
    for k, result in enumerate(kept, start=1):
        for leaf, shape in zip(result, shapes, strict=True):
            for value in strategy.experimental_local_results(leaf):
                assert value.shape == shape
                np.testing.assert_array_equal(value, k * per_replica)


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_pack_copies_each_list_of_leaves_in_order_into_one_flat_array():
    leaves = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.float32(7.5),
        np.array(-1, np.float32),
    ]
    strided = np.arange(10, dtype=np.float32)[::2]  # no contiguous buffer: np.concatenate
    packed = pack(
        [leaves, [strided, np.float32(0), np.array([1, 2], np.float32)]], 8, np.dtype(np.float32)
    )
    assert [p.dtype for p in packed] == [np.float32] * 2 and [p.shape for p in packed] == [(8,)] * 2
    np.testing.assert_array_equal(packed[0], [0, 1, 2, 3, 4, 5, 7.5, -1])
    np.testing.assert_array_equal(packed[1], [0, 2, 4, 6, 8, 0, 1, 2])
    big_endian = [np.arange(3, dtype=">i4"), np.array([9], dtype=">i4")]
    np.testing.assert_array_equal(pack([big_endian], 4, np.dtype(">i4"))[0], [0, 1, 2, 9])


def test_pack_reuses_its_memory_but_never_overwrites_an_array_still_alive():
    ones = [np.ones(100, np.float64)] * 3
    first = pack([ones, ones], 300, np.dtype(np.float64))
    where = _address(first[0])
    del first
    second = pack([[np.full(300, 2.0)], ones], 300, np.dtype(np.float64))
    assert _address(second[0]) == where  # the same scratch memory, reused
    third = pack([[np.full(300, 3.0)], ones], 300, np.dtype(np.float64))  # second is alive
    assert (second[0] == 2.0).all() and (third[0] == 3.0).all()
    strided = np.arange(600.0)[::2]  # while third is alive: a new writer, then concatenate
    np.testing.assert_array_equal(pack([[strided]], 300, np.float64)[0], strided)
    huge = SCRATCH_MAX_BYTES // 2 + 1  # two of these are over the limit: never kept
    zeros = [[np.zeros(huge, np.uint8)], [np.zeros(huge, np.uint8)]]
    assert not np.shares_memory(
        pack(zeros, huge, np.dtype(np.uint8))[0], pack(zeros, huge, np.dtype(np.uint8))[0]
    )


def test_pack_of_leaves_unlike_what_was_said_lets_numpy_cast_them():
    ints = [np.arange(3, dtype=np.int16), np.array([7], np.int16)]  # 8 bytes, not 16
    packed = pack([ints], 4, np.float32)
    assert packed[0].dtype == np.float32
    np.testing.assert_array_equal(packed[0], [0, 1, 2, 7])


def test_pack_keeps_one_writer_per_replica_of_the_last_call_only():
    from aiodist._host_reduce import _local

    leaves = [np.ones(1000, np.float32)]
    pack([leaves] * 8, 1000, np.float32)
    pack([leaves] * 2, 1000, np.float32)
    assert len(_local.writers) == 2


async def test_batched_all_reduce_reuses_its_scratch_across_packs_and_after_a_strided_leaf(
    two,
):
    from aiodist._host_reduce import _local

    strided = np.arange(8.0)[::2]  # no contiguous buffer: packed by np.concatenate

    async def fn(options):
        values = [np.ones(4, np.float32), np.full(2, 2.0, np.float64), np.ones(4), strided]
        return await aiodist.get_replica_context().all_reduce("sum", values, options)

    small_packs = aiodist.CommunicationOptions(bytes_per_pack=32)
    for options in (None, small_packs):
        await two.run(fn, (options,))  # the writers exist from here on
        writers = list(_local.writers)
        result = await two.run(fn, (options,))
        assert all(a is b for a, b in zip(_local.writers, writers, strict=True))
        expected = [[2.0] * 4, [4.0] * 2, [2.0] * 4, [0.0, 4.0, 8.0, 12.0]]
        for leaf, values in zip(result, expected, strict=True):
            for value in two.experimental_local_results(leaf):
                np.testing.assert_array_equal(value, values)


# -- regressions from review -----------------------------------------------------------


async def test_reading_a_sync_on_read_variable_never_freezes_a_pooled_buffer(two):
    with two.scope():
        v = aiodist.Variable(
            np.ones(POOLED, dtype=np.float32), synchronization="ON_READ", aggregation="sum"
        )
    for _ in range(3):
        assert float(v.read_value()[0]) == 2.0  # the read result is dropped each time
        parts = aiodist.PerReplica([np.ones(POOLED, dtype=np.float32)] * 2)
        total = await two.reduce("sum", parts, axis=None)
        np.testing.assert_array_equal(total[:3], [2, 2, 2])


def test_a_frozen_released_buffer_is_not_reused():
    arrays = [np.ones(POOLED, dtype=np.float32)] * 2
    first = combine(np.add, arrays)
    first.flags.writeable = False
    del first
    second = combine(np.add, arrays)
    assert second.flags.writeable
    np.testing.assert_array_equal(second[:2], [2, 2])


def test_errstate_applies_to_every_slice():
    big = np.full(LARGE, 3e38, dtype=np.float32)
    with np.errstate(over="raise"):
        with pytest.raises(FloatingPointError):
            combine(np.add, [big, big])  # overflows in every slice, the last one too


def test_forked_child_reduces_large_arrays():
    import os
    import sys

    if not hasattr(os, "fork"):
        pytest.skip("no os.fork on this platform")
    combine(np.add, [np.ones(LARGE, dtype=np.float32)] * 2)  # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not hang on the parent's dead threads
        try:
            ok = combine(np.add, [np.ones(LARGE, dtype=np.float32)] * 2)[-1] == 2
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        import select

        ready, _, _ = select.select([read], [], [], 20)
        assert ready, "the forked child hung in combine()"
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
        sys.stdout.flush()


async def test_large_reductions_go_on_once_python_has_stopped_the_pool(two, monkeypatch):
    # When the main thread ends, Python shuts every thread pool down while an event
    # loop in another (non-daemon) thread may run on; every large reduction there
    # raised "cannot schedule new futures after shutdown". This shuts down a pool of
    # the test's own, as Python does then (monkeypatch gives the real one back).
    from concurrent.futures import ThreadPoolExecutor

    from aiodist import _host_reduce

    stopped = ThreadPoolExecutor(max_workers=2)
    monkeypatch.setattr(_host_reduce, "_pool", stopped)
    monkeypatch.setattr(_host_reduce, "_WORKERS", max(2, _host_reduce._WORKERS))
    stopped.shutdown()

    async def step():
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", np.full(LARGE, ctx.replica_id_in_sync_group + 1.0))

    for result in two.experimental_local_results(await two.run(step)):
        assert result.shape == (LARGE,) and (result == 3).all()
