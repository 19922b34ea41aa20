"""GPU replicas: streams, event ordering, collectives (ReductionToOneDevice and NCCL).

Every test here is marked ``gpu`` and is skipped, with the reason, where CuPy or
a GPU is missing; run them on a GPU machine with ``python -m pytest -m gpu``.
Several replicas share one GPU (one stream each); NCCL tests use one rank per
GPU (a single GPU gives a one-rank communicator, which still goes through
every NCCL call).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import aiodist
from aiodist._backends import visible_gpu_count
from tests.conftest import loop_lag

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        visible_gpu_count() == 0,
        reason="needs CuPy and a CUDA GPU (pip install 'aiodist[cuda12]' or 'aiodist[cuda13]')",
    ),
]

if visible_gpu_count():
    import cupy
else:  # collected but skipped: keep the module importable
    cupy = None

# Busy-waits `cycles` GPU clock cycles, then writes `value` to x[0]: a slow kernel
# whose result is wrong if anything reads x before it has finished.
_SLOW_SET = r"""
extern "C" __global__ void slow_set(float* x, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    x[0] = value;
}
"""


def _slow_set(x, value: float, cycles: int) -> None:
    # Compiled on its first call in the process (NVRTC, or CuPy's kernel cache on
    # disk), synchronously: a test that measures the loop's lag runs its work once
    # before the measured window, with no wait, so no compile is timed as lag.
    kernel = cupy.RawKernel(_SLOW_SET, "slow_set")
    kernel((1,), (1,), (x, np.float32(value), np.int64(cycles)))


def _cycles(seconds: float) -> int:
    # The attribute, not getDeviceProperties(0)["clockRate"]: that cudaDeviceProp
    # field is deprecated (and, as far as known here, gone in CUDA 13).
    runtime = cupy.cuda.runtime
    rate_khz = runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, 0)
    return int(seconds * rate_khz * 1000)


def _shared(n: int) -> aiodist.MirroredStrategy:
    """``n`` replicas on GPU:0 (ReductionToOneDevice, one stream each)."""
    return aiodist.MirroredStrategy(["GPU:0"] * n)


def _nccl_devices() -> list[str]:
    return [f"GPU:{i}" for i in range(visible_gpu_count())]


# -- streams ---------------------------------------------------------------------------


async def test_each_replica_runs_on_its_own_stream_across_awaits():
    strategy = _shared(4)
    seen: dict[int, set] = {i: set() for i in range(4)}
    outside = cupy.cuda.get_current_stream().ptr

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        for _ in range(5):
            seen[rid].add(cupy.cuda.get_current_stream().ptr)
            await asyncio.sleep(0)
            seen[rid].add(cupy.cuda.get_current_stream().ptr)
        return rid

    await strategy.run(fn)
    streams = [stream for ptrs in seen.values() for stream in ptrs]
    assert all(len(ptrs) == 1 for ptrs in seen.values()), seen
    assert len(set(streams)) == 4  # four distinct streams
    assert outside not in streams and 0 not in streams  # never the null stream
    assert all(slot.stream.is_non_blocking for slot in strategy._slots)
    assert cupy.cuda.get_current_stream().ptr == outside


async def test_other_tasks_never_run_on_a_replica_stream():
    strategy = _shared(2)
    outside = cupy.cuda.get_current_stream().ptr
    bystander_saw: set = set()
    stop = asyncio.Event()

    async def bystander():
        while not stop.is_set():
            bystander_saw.add(cupy.cuda.get_current_stream().ptr)
            await asyncio.sleep(0)

    async def fn():
        ctx = aiodist.get_replica_context()
        for _ in range(10):
            await asyncio.sleep(0)
            await ctx.all_reduce("sum", cupy.ones(3))
        return cupy.cuda.get_current_stream().ptr

    watcher = asyncio.create_task(bystander())
    await asyncio.sleep(0)
    try:
        result = await strategy.run(fn)
    finally:
        stop.set()
        await watcher
    assert bystander_saw == {outside}
    assert outside not in strategy.experimental_local_results(result)


# -- collectives on one shared GPU -----------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "product"])
async def test_all_reduce_with_four_replicas_on_one_gpu(op):
    strategy = _shared(4)
    values = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(4)]

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        x = cupy.asarray(values[rid])
        return await aiodist.get_replica_context().all_reduce(op, x)

    result = await strategy.run(fn)
    expected = {
        "sum": np.sum(values, axis=0),
        "mean": np.mean(values, axis=0),
        "min": np.min(values, axis=0),
        "max": np.max(values, axis=0),
        "product": np.prod(values, axis=0),
    }[op]
    for component in strategy.experimental_local_results(result):
        assert isinstance(component, cupy.ndarray)
        np.testing.assert_allclose(component.get(), expected, rtol=1e-6)


async def test_replicas_sharing_a_gpu_each_get_their_own_result():
    """CuPy arrays cannot be read-only: each replica's result is its own memory,
    so updating it in place (grad *= lr) leaves the others alone."""
    strategy = _shared(3)

    async def fn():
        ctx = aiodist.get_replica_context()
        result = await ctx.all_reduce("sum", cupy.ones(4, dtype=cupy.float32))
        result *= ctx.replica_id_in_sync_group + 1
        await asyncio.sleep(0)  # let the others update theirs too
        return result

    result = await strategy.run(fn)
    for rid, component in enumerate(strategy.experimental_local_results(result)):
        np.testing.assert_array_equal(component.get(), [3.0 * (rid + 1)] * 4)


async def test_replicas_sharing_a_gpu_each_get_their_own_batched_results():
    """The same for a batched all-reduce (a list of leaves, packed): each replica's
    leaves are its own memory, not views of another replica's."""
    strategy = _shared(3)

    async def fn():
        ctx = aiodist.get_replica_context()
        leaves = [cupy.ones(4, dtype=cupy.float32), cupy.ones((2, 2), dtype=cupy.float32)]
        results = await ctx.all_reduce("sum", leaves)
        for result in results:
            result *= ctx.replica_id_in_sync_group + 1
        await asyncio.sleep(0)  # let the others update theirs too
        return results

    results = await strategy.run(fn)
    for leaf, shape in zip(results, [(4,), (2, 2)], strict=True):
        for rid, component in enumerate(strategy.experimental_local_results(leaf)):
            np.testing.assert_array_equal(component.get(), np.full(shape, 3.0 * (rid + 1)))


async def test_all_gather_and_merge_call_on_one_gpu():
    strategy = _shared(4)

    async def fn():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        x = cupy.full((rid + 1, 2), rid, dtype=cupy.int32)  # uneven along axis 0
        gathered = await ctx.all_gather(x, axis=0)

        async def merge_fn(strategy, value):
            return await strategy.reduce("sum", value, axis=None)

        merged = await ctx.merge_call(merge_fn, args=(cupy.asarray(float(rid)),))
        return gathered, merged

    gathered, merged = await strategy.run(fn)
    expected = np.concatenate([np.full((i + 1, 2), i, np.int32) for i in range(4)])
    for component in strategy.experimental_local_results(gathered):
        np.testing.assert_array_equal(component.get(), expected)
    assert float(merged) == 6.0


async def test_reduce_and_gather_come_back_as_host_arrays():
    strategy = _shared(2)

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return cupy.arange(3, dtype=cupy.float64) * (rid + 1)

    values = await strategy.run(fn)
    with strategy.scope():
        total = await strategy.reduce("sum", values, axis=None)
        gathered = await strategy.gather(values, axis=0)
    assert isinstance(total, np.ndarray) and isinstance(gathered, np.ndarray)
    np.testing.assert_array_equal(total, [0.0, 3.0, 6.0])
    np.testing.assert_array_equal(gathered, [0, 1, 2, 0, 2, 4])


async def test_reduce_with_a_gpu_reduce_to_device_comes_back_as_host_arrays():
    """ReductionToOneDevice("GPU:0") reduces strategy.reduce's host copies on the GPU
    again; the result is copied back to the host (it was returned as a CuPy array,
    and MEAN with an axis failed on NumPy's refusal of one)."""
    strategy = aiodist.MirroredStrategy(["GPU:0"] * 2, aiodist.ReductionToOneDevice("GPU:0"))

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return cupy.arange(3, dtype=cupy.float64) * (rid + 1)

    values = await strategy.run(fn)
    with strategy.scope():
        for op, axis, expected in [
            ("sum", None, [0.0, 3.0, 6.0]),
            ("max", None, [0.0, 2.0, 4.0]),
            ("sum", 0, 9.0),
            ("mean", 0, 1.5),
        ]:
            result = await strategy.reduce(op, values, axis=axis)
            assert type(result) is np.ndarray, (op, axis, type(result))
            np.testing.assert_array_equal(result, expected)


async def test_gpu_values_reduced_broadcast_and_gathered_to_a_host_destination():
    """reduce_to / batch_reduce_to / broadcast_to and the ops' gather with a host
    destination ("cpu:0") copy the GPU values to the host first: they were combined
    there as they were, and NumPy refuses a CuPy array (TypeError: implicit
    conversion to a NumPy array is not allowed)."""
    strategies = [
        _shared(2),
        aiodist.MirroredStrategy(_nccl_devices()),  # NcclAllReduce with several GPUs
        aiodist.MirroredStrategy(["GPU:0"] * 2, aiodist.ReductionToOneDevice("GPU:0")),
    ]
    for strategy in strategies:
        n = strategy.num_replicas_in_sync

        async def fn():
            rid = aiodist.get_replica_context().replica_id_in_sync_group
            return cupy.arange(3, dtype=cupy.float64) * (rid + 1)

        values = await strategy.run(fn)
        ops = aiodist.ReductionToOneDevice()
        with strategy.scope():
            reduced = await strategy.extended.reduce_to("sum", values, "cpu:0")
            (mean,) = await strategy.extended.batch_reduce_to("mean", [(values, "cpu:0")])
            copied = await strategy.extended.broadcast_to(cupy.arange(2.0), "cpu:0")
            gathered = await ops.gather(values, "cpu:0", axis=0)
        for result in (reduced, mean, copied, gathered):
            assert type(result) is np.ndarray, (strategy, type(result))
        total = n * (n + 1) / 2
        np.testing.assert_array_equal(reduced, [0.0, total, 2 * total])
        np.testing.assert_array_equal(mean, [0.0, total / n, 2 * total / n])
        np.testing.assert_array_equal(copied, [0.0, 1.0])
        want = np.concatenate([np.arange(3.0) * (i + 1) for i in range(n)])
        np.testing.assert_array_equal(gathered, want)


async def test_a_batcher_hands_gpu_replicas_their_rows_on_the_gpu():
    from aiodist.serving import Batcher

    strategy = _shared(2)
    seen = []

    async def forward(rows):
        seen.append(type(rows))
        return rows * 2

    batcher = Batcher(strategy, forward, max_batch_size=8, max_wait_seconds=0.001)
    await batcher.start(warmup_rows=np.zeros((2, 3)))
    answers = await asyncio.gather(*(batcher.submit(np.full((1, 3), float(i))) for i in range(4)))
    await batcher.stop()
    assert set(seen) == {cupy.ndarray}
    for i, answer in enumerate(answers):
        assert isinstance(answer, np.ndarray)
        np.testing.assert_array_equal(answer, np.full((1, 3), 2.0 * i))


async def test_a_batcher_waits_for_slow_gpu_outputs_without_blocking_the_loop():
    """The step's outputs are computed on each replica's stream behind a ~0.5 s
    kernel: the Batcher copies them to the host in stream order (the rows, not what
    the new buffer held) while the loop keeps running (host_array's get() waited
    for the GPU on the loop, and for the current stream only)."""
    from aiodist.serving import Batcher

    strategy = _shared(2)
    cycles = [0]  # no wait in the warm-up below

    async def forward(rows):
        gate = cupy.zeros(1, cupy.float32)
        _slow_set(gate, 2.0, cycles[0])  # gate is 2 only once the kernel ends
        return rows * gate  # computed after it, on this replica's stream

    batcher = Batcher(strategy, forward, max_batch_size=8, max_wait_seconds=0.01)
    await batcher.start()
    requests = [np.full((1, 3), float(i + 1), np.float32) for i in range(4)]
    # The same requests once, unmeasured: CuPy compiles each kernel on its first use,
    # on the loop's thread (a cold kernel cache: far over 50 ms), which is not the
    # waiting for the GPU that this test measures.
    await asyncio.gather(*(batcher.submit(r) for r in requests))
    cycles[0] = _cycles(0.5)
    async with loop_lag() as lags:
        answers = await asyncio.gather(*(batcher.submit(r) for r in requests))
    await batcher.stop()
    assert max(lags) < 0.05, f"event loop blocked for {max(lags) * 1e3:.1f} ms"
    for request, answer in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(answer, request * 2)


async def test_a_slow_kernel_before_an_all_reduce_still_gives_the_right_result():
    """Replica 0's input is written by a ~200 ms kernel on its stream; without
    event ordering the reduction would read the zeros that were there before."""
    for strategy in (_shared(2), aiodist.MirroredStrategy(_nccl_devices())):
        n = strategy.num_replicas_in_sync

        async def fn():
            rid = aiodist.get_replica_context().replica_id_in_sync_group
            x = cupy.zeros(1, dtype=cupy.float32)
            if rid == 0:
                _slow_set(x, 5.0, _cycles(0.2))
            else:
                x += 1.0
            return await aiodist.get_replica_context().all_reduce("sum", x)

        result = await strategy.run(fn)
        for component in strategy.experimental_local_results(result):
            assert float(component.get()[0]) == 5.0 + (n - 1)


async def test_the_loop_stays_responsive_while_the_gpu_is_busy():
    """A ~0.5 s kernel, then a device-to-host reduce: the loop's lag stays small."""
    strategy = _shared(2)
    cycles = [0]  # no wait in the warm-up below

    async def fn():
        x = cupy.zeros(1, dtype=cupy.float32)
        _slow_set(x, 1.0, cycles[0])
        return x

    # Once unmeasured, so CuPy's first compile of the kernels (on the loop's thread)
    # is not counted as the loop waiting for the GPU.
    with strategy.scope():
        await strategy.reduce("sum", await strategy.run(fn), axis=None)
    cycles[0] = _cycles(0.5)
    async with loop_lag() as lags:
        started = time.perf_counter()
        values = await strategy.run(fn)
        with strategy.scope():
            total = await strategy.reduce("sum", values, axis=None)
        elapsed = time.perf_counter() - started
    assert float(total[0]) == 2.0
    assert elapsed >= 0.4  # the kernel really ran before the reduce returned
    assert max(lags) < 0.05, f"event loop blocked for {max(lags) * 1e3:.1f} ms"
    print(f"\nloop lag while the GPU was busy: max {max(lags) * 1e3:.2f} ms over {len(lags)}")


async def test_ready_waits_for_the_replica_stream_without_blocking():
    strategy = _shared(1)

    async def fn():
        x = cupy.zeros(1, dtype=cupy.float32)
        _slow_set(x, 7.0, _cycles(0.2))
        start = time.perf_counter()
        await aiodist.ready()
        waited = time.perf_counter() - start
        stream = cupy.cuda.get_current_stream()
        return bool(stream.done), waited, float(x.get()[0])

    done, waited, value = await strategy.run(fn)
    assert done and value == 7.0 and waited >= 0.1


def test_ready_waits_for_work_queued_with_cupy_alone():
    """In a process that never made a GPU strategy, ready(x) still waits for the
    kernel writing x (only a strategy loaded the GPU backend: it returned at once).

    Runs in a subprocess: in this one, earlier tests have loaded the backend."""
    script = textwrap.dedent(
        f"""
        import time, aiodist, cupy, numpy as np
        slow_set = cupy.RawKernel({_SLOW_SET!r}, "slow_set")
        async def main():
            x = cupy.zeros(1, dtype=cupy.float32)
            slow_set((1,), (1,), (x, np.float32(7.0), np.int64({_cycles(0.2)})))
            start = time.perf_counter()
            await aiodist.ready(x)
            waited = time.perf_counter() - start
            print("READY", cupy.cuda.get_current_stream().done, waited >= 0.1)
        aiodist.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "READY True True" in done.stdout, done.stdout + done.stderr


def test_a_device_error_is_raised_not_hung():
    """An illegal address in a kernel surfaces from aiodist.ready() as an error.

    Runs in a subprocess: the error poisons the CUDA context of its process."""
    script = textwrap.dedent(
        r"""
        import aiodist, cupy
        bad = cupy.RawKernel(
            'extern "C" __global__ void bad(float* x) { x[1 << 30] = 1.0f; }', "bad")
        async def main():
            x = cupy.zeros(1, dtype=cupy.float32)
            bad((1,), (1,), (x,))
            await aiodist.ready(x)
        try:
            aiodist.run(main())
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc)
        else:
            print("NO ERROR")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "RAISED CUDARuntimeError" in done.stdout, done.stdout + done.stderr
    assert "cudaErrorIllegalAddress" in done.stdout


async def test_a_run_is_ordered_after_its_arguments_and_before_the_callers_later_work():
    """An argument made by a slow kernel on the caller's current stream is read by the
    replicas only once written; a result a replica made with a slow kernel on its
    stream is read by the caller, on its own stream, only once written."""
    strategy = _shared(2)
    cycles = _cycles(0.2)
    x = cupy.zeros(1, cupy.float32)
    _slow_set(x, 7.0, cycles)  # on the caller's current stream

    async def fn(x):
        seen = float(x.get()[0])  # (get: on this replica's stream)
        y = cupy.zeros(1, cupy.float32)
        _slow_set(y, seen + 1.0, cycles)  # on this replica's stream
        return y

    result = await strategy.run(fn, args=(x,))
    # (get: on the caller's current stream)
    assert [float(y.get()[0]) for y in strategy.experimental_local_results(result)] == [8.0, 8.0]


async def test_dataset_batches_made_on_the_current_stream_reach_the_replicas_in_order():
    """A batch the source made with a slow kernel on the thread's current stream: each
    replica's stream waits for it before reading its shard (replica streams are
    non-blocking, so nothing orders them after the default stream by itself)."""
    strategy = _shared(2)
    cycles = _cycles(0.2)

    def batches():
        x = cupy.zeros(4, cupy.float32)
        _slow_set(x, 7.0, cycles)  # x[0] = 7, 0.2 s after it starts
        yield x

    async def fn(shard):
        return float(shard.get().sum())  # (get: on this replica's stream)

    async for batch in strategy.experimental_distribute_dataset(batches()):
        result = await strategy.run(fn, args=(batch,))
        assert strategy.experimental_local_results(result) == (7.0, 0.0)


async def test_a_source_refilling_one_buffer_leaves_prefetched_batches_alone():
    """A source writing every element into one buffer on the thread's current stream
    (as data loaders do): each batch's shards are copied on the replicas' streams,
    queued here behind a slow kernel, and the source's next write must wait for
    those copies (nothing orders the default stream after non-blocking streams)."""
    strategy = _shared(2)
    cycles = _cycles(0.2)

    async def busy():
        _slow_set(cupy.zeros(1, cupy.float32), 1.0, cycles)  # this stream busy 0.2 s

    await strategy.run(busy)

    def batches():
        buffer = cupy.zeros(2, cupy.float32)
        for value in (1.0, 2.0, 3.0):
            buffer.fill(value)  # on the current stream, at once (it is idle)
            yield buffer

    async def fn(shard):
        return shard  # (no get(): nothing here waits for the GPU)

    results = [
        await strategy.run(fn, args=(batch,))
        async for batch in strategy.experimental_distribute_dataset(batches())
    ]
    with strategy.scope():
        gathered = [await strategy.gather(result, axis=0) for result in results]
    for value, got in zip((1.0, 2.0, 3.0), gathered, strict=True):
        np.testing.assert_array_equal(got, [value, value])


async def test_update_waits_for_its_arguments_made_on_the_current_stream():
    """extended.update runs fn on a replica stream (non-blocking): it must first wait
    for the current stream, where fn's argument is still being written."""
    strategy = _shared(2)
    with strategy.scope():
        v = aiodist.Variable(np.zeros(1, np.float32), aggregation="sum")
    value = cupy.zeros(1, cupy.float32)
    _slow_set(value, 7.0, _cycles(0.2))  # on the thread's current stream
    await strategy.extended.update(v, lambda copy, x: copy.assign(x), args=(value,))

    async def read(var):
        return float(var.read_value().get()[0])

    result = await strategy.run(read, args=(v,))
    assert strategy.experimental_local_results(result) == (7.0, 7.0)


async def test_a_mirrored_variable_on_a_shared_gpu_is_one_copy_ordered_for_every_replica():
    """SPEC 9: one copy per device. extended.update writes it on its first replica's
    stream; the other replica, reading it on its own stream, waits for that write."""
    strategy = _shared(2)
    with strategy.scope():
        v = aiodist.Variable(np.zeros(1, np.float32), aggregation="sum")
    assert v.devices == ("/device:GPU:0",)
    cycles = _cycles(0.2)

    def slow_assign(copy):
        x = cupy.zeros(1, cupy.float32)
        _slow_set(x, 7.0, cycles)  # on replica 0's stream, done 0.2 s later
        copy.assign(x)

    await strategy.extended.update(v, slow_assign)

    async def read(var):
        # Before any collective: get() copies on this replica's stream, and waits
        # for that stream only.
        return float(var.read_value().get()[0])

    result = await strategy.run(read, args=(v,))
    assert strategy.experimental_local_results(result) == (7.0, 7.0)


async def test_a_mirrored_variable_over_distinct_gpus_keeps_each_copy_on_its_gpu():
    """Every copy is written with its own GPU current: CuPy computes on, and allocates
    from, the current device, so a copy written from another GPU raised "Peer access
    is unavailable" or, with peer access, moved to that GPU (a PerformanceWarning)."""
    if visible_gpu_count() < 2:
        pytest.skip("needs two GPUs")
    strategy = aiodist.MirroredStrategy(_nccl_devices())
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = aiodist.Variable(np.zeros(3, np.float32), aggregation="sum")

    async def step():
        await v.assign_add(cupy.ones(3, cupy.float32))  # replica context: one merge_fn

    await strategy.run(step)
    with strategy.scope():
        await v.assign_sub(np.ones(3, np.float32))  # cross-replica context
    copies = strategy.experimental_local_results(v)
    assert [copy.device.id for copy in copies] == list(range(n))
    for copy in copies:
        np.testing.assert_array_equal(copy.get(), [n - 1.0] * 3)


async def test_a_one_device_variable_written_in_replica_context_stays_on_its_gpu():
    """A OneDeviceStrategy variable with aggregation=NONE is written in replica
    context (as TF's plain variable there): the value stays on the GPU, and the
    update is issued on the replica's stream after the kernel that makes it, never
    waited for on the loop (here ~0.5 s)."""
    strategy = aiodist.OneDeviceStrategy("GPU:0")
    with strategy.scope():
        v = aiodist.Variable(np.zeros(1, np.float32))

    def make_step(cycles):
        async def step():
            x = cupy.zeros(1, cupy.float32)
            _slow_set(x, 7.0, cycles)  # on the replica's stream: x is 7 only later
            await v.assign_add(x)
            return v.read_value()

        return step

    await strategy.run(make_step(0))  # (compiles the kernel, unmeasured)
    async with loop_lag() as lags:
        result = await strategy.run(make_step(_cycles(0.5)))
    assert max(lags) < 0.05, f"event loop blocked for {max(lags) * 1e3:.1f} ms"
    assert isinstance(result, cupy.ndarray) and result.device.id == 0
    assert float(result.get()[0]) == 14.0 and float(v.read_value().get()[0]) == 14.0


async def test_a_mirrored_variable_update_in_replica_context_never_blocks_the_loop():
    """SPEC 7: the update is a rendezvous, and its aggregate is made on the GPU in
    stream order; it was copied to the host (get()), which waited on the loop for
    the replicas' kernels (here ~0.5 s)."""
    strategy = _shared(2)

    def variables():
        with strategy.scope():
            v = aiodist.Variable(np.zeros(1, np.float32), aggregation="sum")
            w = aiodist.Variable(np.zeros(1, np.int32), aggregation="mean")
        return v, w

    def make_step(v, w, cycles):
        async def step():
            rid = aiodist.get_replica_context().replica_id_in_sync_group
            x = cupy.zeros(1, cupy.float32)
            _slow_set(x, 1.0, cycles)  # x is 1 only `cycles` after this
            await v.assign_add(x)
            await w.assign(cupy.full(1, 3 * rid, cupy.int32))  # MEAN 1.5, rounded to even

        return step

    # The same step once, unmeasured, on variables of its own and with no wait: CuPy
    # compiles each kernel on its first use, on the loop's thread, which is not the
    # waiting for the GPU that this test measures.
    await strategy.run(make_step(*variables(), 0))
    v, w = variables()
    async with loop_lag() as lags:
        await strategy.run(make_step(v, w, _cycles(0.5)))
    assert max(lags) < 0.05, f"event loop blocked for {max(lags) * 1e3:.1f} ms"
    assert float(v.read_value().get()[0]) == 2.0
    assert int(w.read_value().get()[0]) == 2


# -- packing ---------------------------------------------------------------------------

_MIXED = [
    ("float32", (3,)),
    ("float64", (2, 2)),
    ("int32", (5,)),
    ("int64", ()),
    ("int16", (4,)),
    ("float16", (3,)),
    ("complex64", (2,)),
] * 6  # 42 leaves of 7 dtypes, interleaved


def _leaves(rid: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rid)
    out = []
    for dtype, shape in _MIXED:
        if dtype.startswith("complex"):
            value = rng.integers(-5, 5, shape) + 1j * rng.integers(-5, 5, shape)
        else:
            value = rng.integers(-5, 5, shape)
        out.append(np.asarray(value, dtype=dtype))
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: (_shared(3), None),
        lambda: (aiodist.MirroredStrategy(_nccl_devices()), None),
        lambda: (
            aiodist.MirroredStrategy(_nccl_devices(), aiodist.NcclAllReduce(num_packs=3)),
            None,
        ),
        lambda: (
            aiodist.MirroredStrategy(_nccl_devices(), aiodist.NcclAllReduce()),
            aiodist.CommunicationOptions(bytes_per_pack=64),
        ),
    ],
    ids=["one-device", "nccl", "nccl-3-packs", "nccl-64-bytes"],
)
async def test_packing_many_small_leaves_of_mixed_dtypes(make):
    strategy, options = make()
    n = strategy.num_replicas_in_sync

    async def fn():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        leaves = [cupy.asarray(leaf) for leaf in _leaves(rid)]
        return await aiodist.get_replica_context().all_reduce("sum", leaves, options=options)

    result = await strategy.run(fn)
    expected = [sum(parts) for parts in zip(*(_leaves(r) for r in range(n)), strict=True)]
    for component in strategy.experimental_local_results(result):
        assert len(component) == len(expected)
        for got, want in zip(component, expected, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got.get(), want)


# -- NCCL --------------------------------------------------------------------------------


async def test_nccl_is_the_default_for_distinct_gpus_only():
    assert isinstance(_shared(2).extended._cross_device_ops, aiodist.ReductionToOneDevice)
    many = aiodist.MirroredStrategy(_nccl_devices())
    expected = aiodist.NcclAllReduce if len(_nccl_devices()) >= 2 else aiodist.ReductionToOneDevice
    assert isinstance(many.extended._cross_device_ops, expected)
    assert aiodist.MirroredStrategy().extended.worker_devices == tuple(
        f"/device:GPU:{i}" for i in range(visible_gpu_count())
    )


@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "product"])
async def test_nccl_all_reduce_and_all_gather(op):
    strategy = aiodist.MirroredStrategy(_nccl_devices(), aiodist.NcclAllReduce())
    n = strategy.num_replicas_in_sync

    async def fn():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        x = cupy.arange(4, dtype=cupy.float32) + rid + 1
        reduced = await ctx.all_reduce(op, x)
        gathered = await ctx.all_gather(cupy.full((2, rid + 1), rid, cupy.int64), axis=1)
        flags = await ctx.all_reduce("max", cupy.asarray([rid == 0, False]))
        return reduced, gathered, flags

    reduced, gathered, flags = await strategy.run(fn)
    values = [np.arange(4, dtype=np.float32) + r + 1 for r in range(n)]
    numpy_op = {"sum": np.sum, "mean": np.mean, "min": np.min, "max": np.max}.get(op, np.prod)
    expected = numpy_op(values, axis=0)
    want_gather = np.concatenate([np.full((2, r + 1), r, np.int64) for r in range(n)], axis=1)
    local = strategy.experimental_local_results
    for r, g, f in zip(local(reduced), local(gathered), local(flags), strict=True):
        np.testing.assert_allclose(r.get(), expected, rtol=1e-6)
        np.testing.assert_array_equal(g.get(), want_gather)
        np.testing.assert_array_equal(f.get(), [True, False])


async def test_nccl_broadcast_and_reduce_to_in_cross_replica_context():
    strategy = aiodist.MirroredStrategy(_nccl_devices(), aiodist.NcclAllReduce())
    with strategy.scope():
        value = cupy.arange(3, dtype=cupy.float32)
        mirrored = await strategy.extended.broadcast_to(value, strategy.extended.worker_devices)
        for component in strategy.experimental_local_results(mirrored):
            np.testing.assert_array_equal(component.get(), [0, 1, 2])
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: cupy.full(2, ctx.replica_id_in_sync_group + 1.0)
        )
        reduced = await strategy.extended.reduce_to("sum", per_replica, "GPU:0")
    n = strategy.num_replicas_in_sync
    np.testing.assert_array_equal(reduced.get(), [n * (n + 1) / 2] * 2)


def test_nccl_two_ranks_on_one_gpu_when_nccl_allows_it():
    """NCCL >= 2.30 can put two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)."""
    from aiodist._cuda import nccl_version

    version = nccl_version()
    if version is None or version < 23000:
        pytest.skip(f"needs NCCL >= 2.30 (found {version})")
    script = textwrap.dedent(
        """
        import aiodist, cupy
        strategy = aiodist.MirroredStrategy(["GPU:0", "GPU:0"], aiodist.NcclAllReduce())
        async def fn():
            rid = aiodist.get_replica_context().replica_id_in_sync_group
            return await aiodist.get_replica_context().all_reduce("sum", cupy.ones(4) * rid)
        result = aiodist.run(strategy.run(fn))
        print("RESULT", [float(c.get().sum()) for c in strategy.experimental_local_results(result)])
        """
    )
    env = {**os.environ, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert "RESULT [4.0, 4.0]" in done.stdout, done.stdout + done.stderr[-2000:]


def test_a_rank_made_from_a_unique_id():
    """The multi-worker path: a rank made by NcclCommunicator(n, id, rank) from a
    unique id, in the form this CuPy and platform take it. (CuPy 13 copies the id
    into C chars, unsigned on aarch64, where the signed form raised OverflowError.)"""
    from aiodist import _cuda

    if _cuda.nccl_version() is None:
        pytest.skip("NCCL's library is not installed")
    (comm,) = _cuda.world_communicators(_cuda.unique_id(), 1, 0, (0,))
    assert (comm.size(), comm.rank_id(), comm.device_id()) == (1, 0, 0)


def test_a_broadcast_goes_in_parts_of_at_most_part_bytes():
    """NCCL broadcast sends a buffer in parts (1 GiB each by default): CuPy before
    cupy/cupy#8562 declares bcast's count a C int, and refused a buffer over 2 GiB
    with OverflowError. Small parts of an odd size here, so every part boundary
    (and a short last part) is crossed."""
    from aiodist import _cuda
    from aiodist._backends import backend_for
    from aiodist._devices import Device

    if _cuda.nccl_version() is None:
        pytest.skip("NCCL's library is not installed")
    devices = [Device("GPU", i) for i in range(visible_gpu_count())]
    with cupy.cuda.Device(0):
        array = (cupy.arange(10_001) % 251).astype(cupy.uint8)
    copies = _cuda.broadcast(array, devices, backend_for(devices[0]), part_bytes=999)
    for device, copy in zip(devices, copies, strict=True):
        assert copy.device.id == device.index
        with cupy.cuda.Device(device.index):
            np.testing.assert_array_equal(copy.get(), np.arange(10_001) % 251)


# -- no hangs ------------------------------------------------------------------------------


@pytest.mark.timeout(20)
async def test_a_rendezvous_timeout_fires_before_any_nccl_call():
    strategy = aiodist.MirroredStrategy(
        _nccl_devices() if len(_nccl_devices()) > 1 else ["GPU:0", "GPU:0"],
        communication_options=aiodist.CommunicationOptions(timeout_seconds=0.3),
    )

    async def fn():
        ctx = aiodist.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            await asyncio.sleep(5)
        return await ctx.all_reduce("sum", cupy.ones(2))

    with pytest.raises(aiodist.RendezvousTimeoutError, match=r"timed out after 0\.3 s"):
        await strategy.run(fn)


def test_mixing_cpu_and_gpu_devices_is_refused():
    with pytest.raises(aiodist.DeviceError, match="mix CPU and GPU"):
        aiodist.MirroredStrategy(["cpu:0", "GPU:0"])
