"""Programs that tests/test_multi_worker.py starts under ``mpiexec``.

``python tests/mpi_programs.py MODE [replicas per worker, comma-separated]``:
every worker writes its result as JSON to ``$AIODIST_TEST_RESULTS/result-<rank>.json``.
``compute`` is also run in one process on a ``MirroredStrategy`` with as many
replicas, to compare.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import time
import types
import weakref

import numpy as np

import aiodist


def _plain(value):
    if hasattr(value, "__cuda_array_interface__"):  # a CuPy array: its host copy
        value = value.get()
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


async def _outcome(strategy, awaitable):
    """What awaiting a run gives, as JSON: each local result, or [error type, message]."""
    try:
        return _plain(strategy.experimental_local_results(await awaitable))
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


def _half(ctx: aiodist.ValueContext) -> np.float32:
    return np.float32(ctx.replica_id_in_sync_group / 2)


async def compute(strategy: aiodist.Strategy) -> dict:
    """TF-style examples whose numbers must not depend on how replicas are spread
    over processes. Returns per-replica results keyed by global replica id, and
    the cross-replica results."""

    async def step():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        # ReplicaContext.all_reduce's TF example: each replica holds 1.0.
        ones = await ctx.all_reduce("sum", 1.0)
        total = await ctx.all_reduce("sum", np.float64(rid + 1))
        mean = await ctx.all_reduce("mean", [np.arange(3.0) * rid, np.int64(rid)])
        largest = await ctx.all_reduce("max", np.array([rid, -rid]))
        # Packs of at most 16 bytes: several MPI calls, two dtypes interleaved.
        small_packs = aiodist.CommunicationOptions(bytes_per_pack=16)
        leaves = [np.arange(3.0) + rid, np.int32(rid), np.full(2, rid, np.int32), np.float64(rid)]
        packed = await ctx.all_reduce("sum", leaves, options=small_packs)
        # all_gather's TF example shape, with uneven lengths along axis 0.
        gathered = await ctx.all_gather(np.full((rid % 2 + 1, 2), rid), axis=0)

        async def merge_fn(strategy, value):
            return await strategy.reduce("sum", value, axis=None)

        merged = await ctx.merge_call(merge_fn, args=(np.float64(rid),))
        return rid, {
            "ones": ones,
            "total": total,
            "mean": mean,
            "max": largest,
            "packed": packed,
            "gathered": gathered,
            "merged": merged,
            "num_replicas": ctx.num_replicas_in_sync,
        }

    results = strategy.experimental_local_results(await strategy.run(step))
    per_replica = {str(rid): _plain(values) for rid, values in results}

    with strategy.scope():
        ids = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.array([ctx.replica_id_in_sync_group, 1.0])
        )
        int_ids = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.array([ctx.replica_id_in_sync_group, 2], np.int32)
        )
        uneven = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.arange(ctx.replica_id_in_sync_group + 1.0)
        )
        cross = {
            "reduce_sum": await strategy.reduce("sum", ids, axis=None),
            "reduce_mean_axis": await strategy.reduce("mean", uneven, axis=0),
            "reduce_max_axis": await strategy.reduce("max", uneven, axis=0),
            "gather": await strategy.gather(uneven, axis=0),
            "reduce_to": await strategy.extended.reduce_to("sum", ids, "cpu:0"),
            "batch_reduce_to": await strategy.extended.batch_reduce_to(
                "mean", [(ids, "cpu:0"), (ids, "cpu:0")]
            ),
            # Three dtypes and a 0-d value in one batch (one MPI call per dtype).
            "batch_reduce_to_mixed": await strategy.extended.batch_reduce_to(
                "sum",
                [
                    (ids, "cpu:0"),
                    (int_ids, "cpu:0"),
                    (strategy.experimental_distribute_values_from_function(_half), "cpu:0"),
                    (ids, "cpu:0"),
                ],
            ),
            "batch_reduce_to_empty": await strategy.extended.batch_reduce_to("sum", []),
        }
        flags = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.array([ctx.replica_id_in_sync_group % 2 == 0])
        )
        try:  # refused on every layout, as in one process
            cross["reduce_bools"] = await strategy.reduce("sum", flags, axis=None)
        except aiodist.InvalidArgumentError as exc:
            cross["reduce_bools"] = str(exc)
        weights = aiodist.Variable(np.zeros(2), aggregation="mean", name="weights")
        counter = aiodist.Variable(np.zeros(()), aggregation="sum", name="counter")
        # Global replica 0's value: counted once however many replicas a worker has.
        first = aiodist.Variable(np.zeros(2), aggregation="only_first_replica", name="first")
        flag = aiodist.Variable(False, aggregation="only_first_replica", name="flag")  # a bool
        listed = aiodist.Variable(np.zeros(2), aggregation="sum", name="listed")
        # Python ints, taken in an unsigned variable's dtype (not refused as int64).
        steps = aiodist.Variable(np.uint32(0), aggregation="sum", name="steps")
        middle = aiodist.Variable(np.uint8(0), aggregation="mean", name="middle")

    async def update():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        await weights.assign_add(np.array([rid, 1.0]))
        await counter.assign_add(1.0)
        await first.assign_add(np.array([rid + 1.0, 10.0]))
        await flag.assign(rid == 0)
        await listed.assign_add([rid + 1.0, 10.0])  # a list: regrouped leaf by leaf
        await steps.assign_add(1)
        await middle.assign(200 + rid)  # an exact MEAN across workers, in uint8

    await strategy.run(update)
    await strategy.run(update)
    cross["weights"] = weights.numpy()
    cross["counter"] = counter.numpy()
    cross["first"] = first.numpy()
    cross["flag"] = flag.numpy()
    cross["listed"] = listed.numpy()
    cross["steps"] = steps.numpy()
    cross["middle"] = middle.numpy()
    cross["on_read"] = await _on_read(strategy)
    cross["int_means"] = await _int_means(strategy)

    # Global batches of 7 rows (uneven over the replicas): each replica's rows,
    # gathered back, give every batch whole and in order.
    batches = [np.arange(14.0).reshape(7, 2) + 100 * i for i in range(3)]
    seen = []
    async for batch in strategy.experimental_distribute_dataset(batches):

        async def back(rows):
            return await aiodist.get_replica_context().all_gather(rows, axis=0)

        seen.append(strategy.experimental_local_results(await strategy.run(back, args=(batch,)))[0])
    cross["batches"] = seen
    loop = type(asyncio.get_running_loop()).__module__  # "asyncio..." or "uvloop"
    return {"per_replica": per_replica, "cross": _plain(cross), "loop": loop}


def int_mean_value(replica_id: int) -> np.ndarray:
    """What replica ``replica_id`` writes in ``_int_means``: 2**53 + 1 is not a
    float64, and a 64-bit sum of values near 2**62 wraps."""
    return np.array([2**53 + 1 + 2 * replica_id, 2**62 + replica_id], np.int64)


async def _int_means(strategy: aiodist.Strategy) -> dict:
    """MEANs of int64 values (a mirrored update, a sync-on-read checkpoint): exact,
    rounded half to even, however the replicas are spread over workers."""
    with strategy.scope():
        mirrored = aiodist.Variable(np.zeros(2, np.int64), aggregation="mean", name="mirrored")
        on_read = aiodist.Variable(
            np.zeros(2, np.int64), synchronization="on_read", aggregation="mean", name="on_read"
        )

    async def step():
        value = int_mean_value(aiodist.get_replica_context().replica_id_in_sync_group)
        await mirrored.assign(value)
        await on_read.assign(value)

    await strategy.run(step)
    with tempfile.TemporaryDirectory() as folder:  # each worker saves (a collective)
        path = await aiodist.save_variables(os.path.join(folder, "i.npz"), [on_read])
        with np.load(path) as saved:
            return {"mirrored": mirrored.numpy(), "saved": saved["on_read"]}


async def _on_read(strategy: aiodist.Strategy) -> dict:
    """Sync-on-read variables: local updates, aggregated reads (outside runs and
    inside merge_fn), cross-replica assigns, and a checkpoint round trip."""
    kinds = {"sum": 1.5, "mean": 1.5, "only_first_replica": 1.5, "int_sum": 3}
    with strategy.scope():
        metrics = {
            kind: aiodist.Variable(
                np.full(2, start),
                synchronization="on_read",
                name=kind,
                aggregation=kind.removeprefix("int_"),
            )
            for kind, start in kinds.items()
        }

    async def step():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        for variable in metrics.values():
            await variable.assign_add(np.array([rid, 2 * rid + 1], variable.dtype))

        def merge_fn(strategy):  # a read in merge_fn: once per worker, in step
            return {kind: v.numpy() for kind, v in metrics.items()}

        return await aiodist.get_replica_context().merge_call(merge_fn)

    in_merge = strategy.experimental_local_results(await strategy.run(step))[0]
    out = {"read": {k: v.numpy() for k, v in metrics.items()}, "in_merge": in_merge}
    with tempfile.TemporaryDirectory() as folder:  # each worker saves (a collective)
        path = await aiodist.save_variables(os.path.join(folder, "m.npz"), metrics)
        with np.load(path) as saved:
            out["saved"] = {k: saved[k] for k in metrics}
        for variable in metrics.values():
            await variable.assign(np.array([7, 9], variable.dtype))
        out["assigned"] = {k: v.numpy() for k, v in metrics.items()}
        await aiodist.restore_variables(path, metrics)
        out["restored"] = {k: v.numpy() for k, v in metrics.items()}
    # aggregation=NONE: a checkpoint holds global replica 0's copy, on every worker.
    with strategy.scope():
        unaggregated = aiodist.Variable(np.zeros(2), synchronization="on_read", name="none")

    async def mark():
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        await unaggregated.assign(np.array([rid + 1.0, 1.0]))

    await strategy.run(mark)
    with tempfile.TemporaryDirectory() as folder:
        path = await aiodist.save_variables(os.path.join(folder, "n.npz"), {"none": unaggregated})
        with np.load(path) as saved:
            out["saved_none"] = saved["none"]
    return out


async def _read_while_busy(strategy: aiodist.Strategy) -> dict:
    """A synchronous read while an asynchronous cross-worker call is in flight is
    refused at once (waiting would block the step that call needs); the call then
    completes, and reads between calls work. ``strategy.reduce`` of the variable
    reduces its copies without reading it whole."""
    with strategy.scope():
        metric = aiodist.Variable(1.0, synchronization="on_read", aggregation="sum")
    pending = asyncio.create_task(strategy.reduce("sum", metric, axis=None))
    await asyncio.sleep(0)  # it has sent its header and waits for the other workers
    refused = _refusal(metric.numpy)
    return _plain({"refused": refused, "reduced": await pending, "read": metric.numpy()})


def _refusal(call) -> str | None:
    """The message of the InvalidArgumentError ``call()`` raises; None if it returns."""
    try:
        call()
    except aiodist.InvalidArgumentError as exc:
        return str(exc)
    return None


def _strategy(counts: list[int], timeout: float | None = None) -> aiodist.Strategy:
    """``counts[rank]`` CPU replicas; with AIODIST_TEST_GPUS=1, as many GPUs, each
    worker its own (GPU ids numbered across workers: one NCCL rank per GPU)."""
    rank = int(os.environ.get("PMI_RANK", "0"))
    options = None if timeout is None else aiodist.CommunicationOptions(timeout_seconds=timeout)
    devices = counts[rank]
    if os.environ.get("AIODIST_TEST_GPUS") == "1":
        first = sum(counts[:rank])
        devices = [f"GPU:{first + i}" for i in range(counts[rank])]
    return aiodist.MultiWorkerMirroredStrategy(devices, communication_options=options)


def _report(strategy: aiodist.Strategy, value: object) -> None:
    """Each worker writes its own file: lines printed by several workers through
    mpiexec can interleave."""
    folder = os.environ["AIODIST_TEST_RESULTS"]
    path = os.path.join(folder, f"result-{strategy.worker_index}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(value, out)
    os.replace(path + ".tmp", path)


async def _failing(mode: str, strategy: aiodist.Strategy) -> None:
    started = time.monotonic()

    async def step():
        ctx = aiodist.get_replica_context()
        await ctx.all_reduce("sum", 1.0)
        if strategy.worker_index == 1:
            if mode == "mismatch":
                return await ctx.all_reduce("max", 1.0)
            if mode == "stop":  # alive but unresponsive: a hung or frozen worker
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return await ctx.all_reduce("sum", 1.0)

    try:
        await strategy.run(step)
    except aiodist.AiodistError as exc:
        _report(
            strategy,
            {"error": type(exc).__name__, "message": str(exc), "after": time.monotonic() - started},
        )
    else:
        _report(strategy, {"error": None})


async def _stuck_in_update(strategy: aiodist.Strategy) -> dict:
    """Worker 1 stops (SIGSTOP) before a variable's aggregated update, whose
    merge_fn reduces across workers; both are bounded by the 1.5 s timeout, and
    merge_fn's expired first. Before, worker 0's run raised only that merge_fn
    had not finished in time ("make it faster"), naming no worker."""
    with strategy.scope():
        counter = aiodist.Variable(0.0, aggregation="sum", name="counter")
    started = time.monotonic()

    async def step():
        if strategy.worker_index == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        await counter.assign_add(1.0)

    outcome = await _outcome(strategy, strategy.run(step))
    return {"outcome": outcome, "after": time.monotonic() - started}


async def min_max(strategy: aiodist.Strategy) -> dict:
    """MIN and MAX of floats holding NaN, -0.0 and 0.0 (a diverged loss, signed
    zeros), in replicas and across them; as text, so the sign of a zero and a
    NaN compare exactly. Run in one process too, to compare."""

    def value(rid: int, dtype: type) -> np.ndarray:
        return np.array([np.nan if rid == 0 else 1.0, -0.0 if rid % 2 else 0.0, rid], dtype)

    async def step():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        out = {}
        for dtype in (np.float64, np.float32, np.float16):
            for op in ("min", "max"):
                out[f"{op} {dtype.__name__}"] = await ctx.all_reduce(op, value(rid, dtype))
        out["max without nan"] = await ctx.all_reduce("max", value(rid, np.float64)[1:])
        return {k: repr(v.tolist()) for k, v in out.items()}

    results = strategy.experimental_local_results(await strategy.run(step))
    with strategy.scope():
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: value(ctx.replica_id_in_sync_group, np.float64)
        )
        reduced = {op: await strategy.reduce(op, values, axis=None) for op in ("min", "max")}
    return {
        "in_replicas": results[0],
        "reduce": {k: repr(v.tolist()) for k, v in reduced.items()},
    }


async def complex_min_max(strategy: aiodist.Strategy) -> dict:
    """MIN and MAX of complex values (NumPy orders them lexicographically, as one
    process reduces them), in replicas and across them; as text. Run in one
    process too, to compare."""

    def value(rid: int, dtype: type) -> np.ndarray:
        return np.array([rid + 1j, 2 - rid * 1j, 1 + (rid % 2) * 1j], dtype)

    async def step():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        out = {}
        for dtype in (np.complex128, np.complex64):
            for op in ("min", "max"):
                out[f"{op} {dtype.__name__}"] = await ctx.all_reduce(op, value(rid, dtype))
        return {k: repr(v.tolist()) for k, v in out.items()}

    results = strategy.experimental_local_results(await strategy.run(step))
    with strategy.scope():
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: value(ctx.replica_id_in_sync_group, np.complex128)
        )
        reduced = {op: await strategy.reduce(op, values, axis=None) for op in ("min", "max")}
    return {
        "in_replicas": results[0],
        "reduce": {k: repr(v.tolist()) for k, v in reduced.items()},
    }


async def big_endian(strategy: aiodist.Strategy) -> dict:
    """Reductions of big-endian values ('>f4', '>f8': read from a file written on
    such a machine): in replicas, by strategy.reduce, and a sync-on-read variable's
    read; each result as its dtype and values, to compare with one process. Run in
    one process too."""

    def value(rid: int, dtype: str) -> np.ndarray:
        return np.array([rid + 0.5, 2.0 * rid], dtype)

    def shown(array: np.ndarray) -> list:
        return [np.dtype(array.dtype).isnative, np.dtype(array.dtype).name, array.tolist()]

    async def step():
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        ops = ("sum", "mean", "max", "min")
        return {op: shown(await ctx.all_reduce(op, value(rid, ">f4"))) for op in ops}

    results = strategy.experimental_local_results(await strategy.run(step))

    async def local():
        return value(aiodist.get_replica_context().replica_id_in_sync_group, ">f8")

    values = await strategy.run(local)
    with strategy.scope():
        on_read = aiodist.Variable(
            np.ones(2, ">f4"), synchronization="on_read", aggregation="sum", name="n"
        )
        reduced = {op: shown(await strategy.reduce(op, values, axis=None)) for op in ("sum", "max")}
        read = shown(np.asarray(on_read.read_value()))
    return {"in_replicas": results[0], "reduce": reduced, "on_read": read}


async def _long_headers(strategy: aiodist.Strategy) -> list:
    """An all_gather of 800 leaves whose lengths differ between workers (9 rows
    on worker 0, 10 on the others): its header is longer on some workers."""

    async def step():
        rows = 9 if strategy.worker_index == 0 else 10
        leaves = [np.full((rows,), strategy.worker_index, np.int8)] * 800
        gathered = await aiodist.get_replica_context().all_gather(leaves, axis=0)
        return [leaf.tolist() for leaf in gathered[::100]]

    return strategy.experimental_local_results(await strategy.run(step))[0]


def _threads() -> int:
    import threading

    return sum(thread.name == "aiodist-mpi" for thread in threading.enumerate())


async def _closing(strategy: aiodist.Strategy) -> dict:
    """Strategies dropped (garbage) or closed end their communication thread; a
    closed one refuses cross-worker calls."""
    import gc

    async def step():
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    before = _threads()
    for _ in range(5):
        dropped = aiodist.MultiWorkerMirroredStrategy(1)
        with dropped.scope():
            await dropped.reduce("sum", np.ones(2), axis=None)  # a cross-worker call
        # (Not a run: on asyncio, the local rendezvous's timeout timer keeps a run's
        # strategy alive until that timeout, 300 s.)
        del dropped
    gc.collect()
    after_dropping = _threads()
    strategy.close()
    strategy.close()  # twice is fine
    try:
        await strategy.run(step)
    except aiodist.InvalidArgumentError as exc:
        refused = str(exc)
    else:
        refused = None
    return {
        "before": before,
        "after_dropping": after_dropping,
        "after_closing": _threads(),
        "refused": refused,
    }


async def _finalizer_on_thread(strategy: aiodist.Strategy) -> dict:
    """A dropped strategy collected by the garbage collector on its own communication
    thread (any allocation there may trigger a collection): its close must not join
    that thread (before: RuntimeError: cannot join current thread)."""
    import gc
    import threading

    dropped = aiodist.MultiWorkerMirroredStrategy(1)
    progress = dropped._world._progress
    errors = []
    hook = threading.excepthook, sys.unraisablehook
    sys.unraisablehook = lambda args: errors.append(repr(args.exc_value))
    gc.disable()  # (the collection happens where this test chooses)
    try:
        del dropped
        ran_on = []

        def start():
            ran_on.append(threading.current_thread().name)
            gc.collect()
            return []

        future, _ = progress.submit(start)
        future.result(10)
        progress._thread.join(10)
    finally:
        gc.enable()
        threading.excepthook, sys.unraisablehook = hook
    strategy.close()
    return {"ran_on": ran_on, "errors": errors, "alive": progress._thread.is_alive()}


async def _stall(strategy: aiodist.Strategy) -> list:
    """Worker 1 arrives 1.6 s late at an all_reduce; stall_warning_seconds=0.5.
    The warnings the aiodist logger gave on this worker."""
    import logging

    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("aiodist").addHandler(Keep())

    async def step():
        if strategy.worker_index == 1:
            await asyncio.sleep(1.6)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    await strategy.run(step)
    return warnings


async def _overlapped(strategy: aiodist.Strategy) -> dict:
    """Collectives in flight together, each of two dtypes (two MPI calls): two
    all_reduces started before either is awaited, in a run; two batch_reduce_to
    gathered in cross-replica context. Whether every result is right."""
    n = strategy.num_replicas_in_sync
    w = strategy.worker_index

    async def step():
        ctx = aiodist.get_replica_context()
        first = ctx.all_reduce("sum", [np.full(1000, 1.0), np.full(3, 1, np.int32)])
        second = ctx.all_reduce("sum", [np.full(7, 2.0), np.full(5, 2, np.int64)])
        return await first, await second

    in_run = True
    for _ in range(20):
        first, second = strategy.experimental_local_results(await strategy.run(step))[0]
        expected = [n * 1.0, n * 1, n * 2.0, n * 2]
        in_run &= all(bool(np.all(x == v)) for x, v in zip(first + second, expected, strict=True))
    cross = True
    workers = strategy.num_workers
    with strategy.scope():
        for _ in range(50):
            a = [(np.full(1000, 1.0 + w), "cpu:0"), (np.full(3, 1 + w, np.int32), "cpu:0")]
            b = [(np.full(7, 10.0 + w), "cpu:0"), (np.full(5, 10 + w, np.int64), "cpu:0")]
            ra, rb = await asyncio.gather(
                strategy.extended.batch_reduce_to("sum", a),
                strategy.extended.batch_reduce_to("sum", b),
            )
            # Each worker's value counts once per local replica (one here).
            expected = [sum(1.0 + i for i in range(workers)), sum(10.0 + i for i in range(workers))]
            cross &= bool(np.all(ra[0] == expected[0]) and np.all(ra[1] == expected[0]))
            cross &= bool(np.all(rb[0] == expected[1]) and np.all(rb[1] == expected[1]))
    return {"in_run": in_run, "cross": cross}


async def _fail_then_go_on(strategy: aiodist.Strategy) -> dict:
    """Run 1 fails on worker 1 before its all_reduce (a replica raises; the program
    catches it and goes on); run 2 is the same on every worker. Every worker's run
    1 raises at once, naming worker 1, and run 2 pairs with run 2 everywhere."""
    out = {}

    async def step(k):
        ctx = aiodist.get_replica_context()
        if k == 1 and strategy.worker_index == 1 and ctx.replica_id_in_sync_group == 2:
            raise ValueError("bad batch on worker 1")
        return await ctx.all_reduce("sum", np.float64(100 * k + ctx.replica_id_in_sync_group))

    for k in (1, 2):
        started = time.monotonic()
        try:
            result = strategy.experimental_local_results(await strategy.run(step, args=(k,)))
        except Exception as exc:
            out[f"run{k}"] = {"error": type(exc).__name__, "message": str(exc)}
        else:
            out[f"run{k}"] = {"result": _plain(result)}
        out[f"run{k}"]["after"] = time.monotonic() - started
    return out


async def _failures_keep_the_order(strategy: aiodist.Strategy) -> dict:
    """Runs failing on one worker in different places; the program catches each
    error and goes on. Run 1 fails on worker 0 after its last collective; run 2 on
    worker 1 before any, while the others have two collectives in flight; run 4
    on worker 2 before its collective. Every other run, and a strategy.reduce
    after them, must pair on every worker. Before, run 1's failure header was
    taken by the others' run 2 and the run numbers drifted for good; run 2's
    second collective, cancelled, lost the whole order."""
    w = strategy.worker_index
    out = {}

    async def step(k):
        ctx = aiodist.get_replica_context()
        if (k, w) in ((2, 1), (4, 2)):
            raise ValueError(f"bad batch {k} on worker {w}")
        first = ctx.all_reduce("sum", np.float64(k))
        second = ctx.all_reduce("sum", np.float64(10 * k))
        total = await first + await second
        if (k, w) == (1, 0):
            raise ValueError("bad result on worker 0")
        return total

    for k in range(1, 6):
        started = time.monotonic()
        try:
            result = strategy.experimental_local_results(await strategy.run(step, args=(k,)))
        except Exception as exc:
            out[f"run{k}"] = [type(exc).__name__, str(exc)]
        else:
            out[f"run{k}"] = _plain(result)
        out[f"after{k}"] = time.monotonic() - started
    out["reduce"] = float(await strategy.reduce("sum", np.float64(w), axis=None))
    out["runs"] = strategy._world.runs
    return out


async def _failures_in_a_row(strategy: aiodist.Strategy) -> dict:
    """Worker 1's runs 1 to 4 fail before any collective while worker 0's start two
    collectives before awaiting either; run 5 succeeds everywhere. Worker 1 does not
    wait for anyone, so its failure headers are out before worker 0 posts: worker
    0's second exchange of run k meets worker 1's failure header of run k + 1.
    Before, worker 0 then counted run k + 1 as one of its own already made (where
    that exchange completed before the run gave it up): its next run was numbered
    k + 2, and its runs paired for good with worker 1's next ones (run 5 met
    worker 1's strategy.reduce)."""
    w = strategy.worker_index
    out = {}

    async def step(k):
        ctx = aiodist.get_replica_context()
        if w == 1 and k < 5:
            raise ValueError(f"bad batch {k} on worker 1")
        first = ctx.all_reduce("sum", np.float64(k))
        second = ctx.all_reduce("sum", np.float64(10 * k))
        return await first + await second

    if w == 0:
        await asyncio.sleep(0.5)  # (worker 1's failure headers go out first)
    for k in range(1, 6):
        out[f"run{k}"] = await _outcome(strategy, strategy.run(step, args=(k,)))
    with strategy.scope():
        out["reduce"] = float(await strategy.reduce("sum", np.float64(w + 1), axis=None))
    out["runs"] = strategy._world.runs
    return out


async def _many_failures(strategy: aiodist.Strategy) -> dict:
    """300 runs, each failing somewhere: worker 0's after its last collective, or
    worker 1's before any while worker 0 starts two (one given up), in turns, then
    150 failing on worker 1 only; then a run and a reduce that must pair. Before,
    the world kept an entry (and a failure's text) per failed run for good. A run
    is forgotten once it, and every operation it started, has ended on every
    worker; worker 0 keeps its first error (a server's "last error"), whose
    traceback holds that run's frames: before, that kept every later failed run
    on both workers too."""
    w = strategy.worker_index
    world = strategy._world

    async def step(k):
        ctx = aiodist.get_replica_context()
        if w == 1 and k % 2 == 1:
            raise ValueError(f"bad batch {k} on worker 1")
        first = ctx.all_reduce("sum", np.float64(k))
        second = ctx.all_reduce("sum", np.float64(10 * k))
        total = await first + await second
        if w == 0 and k % 2 == 0 and k < 300:
            raise ValueError(f"bad result {k} on worker 0")
        return total

    kept = []
    for k in [*range(300), *range(301, 601, 2)]:
        try:
            await strategy.run(step, args=(k,))
        except (ValueError, aiodist.ReplicaExitedError) as exc:
            if w == 0 and not kept:
                kept.append(exc)
    last = strategy.experimental_local_results(await strategy.run(step, args=(1000,)))
    with strategy.scope():
        reduce = float(await strategy.reduce("sum", np.float64(w + 1), axis=None))
    return {
        "last": _plain(last),
        "reduce": reduce,
        "runs": world.runs,
        "failed_runs": len(world.failed_runs),
        "failures": len(world._failures),
        "pending": len(world._pending) + len(world._read),
    }


async def _many_successes(strategy: aiodist.Strategy) -> dict:
    """400 runs that all succeed. Before, each peer's header of each run (its low
    rose with every run) left an entry in World._peer_lows for good: forgetting
    was done only once a run had failed."""
    world = strategy._world

    async def step(k):
        return await aiodist.get_replica_context().all_reduce("sum", np.float64(k))

    for k in range(400):
        await strategy.run(step, args=(k,))
    with strategy.scope():
        reduce = float(
            await strategy.reduce("sum", np.float64(strategy.worker_index + 1), axis=None)
        )
    return {
        "reduce": reduce,
        "lows": max(len(lows) for lows in world._peer_lows.values()),
        "failed_runs": len(world.failed_runs),
    }


async def _runs_without_calls(strategy: aiodist.Strategy) -> dict:
    """A run making no cross-worker call fails on worker 0 only; then runs ``a``
    and ``b`` of one all_reduce each. Before, worker 0 alone numbered the failed
    run: worker 1's ``a`` raised, and worker 0's ``a`` paired with worker 1's
    ``b`` (1 + 10 = 11 on both, no error). Then worker 0 makes one more run (no
    call) than worker 1, and the next run's collective is a mismatch naming the
    runs; a strategy.reduce still pairs."""
    w = strategy.worker_index
    out = {}

    async def nothing():
        if w == 0:
            raise ValueError("bad on worker 0")
        return 1.0

    async def one(k):
        return await aiodist.get_replica_context().all_reduce("sum", np.float64(k))

    async def outcome(name, call):
        out[name] = await _outcome(strategy, call)

    await outcome("failed", strategy.run(nothing))
    await outcome("a", strategy.run(one, args=(1,)))
    await outcome("b", strategy.run(one, args=(10,)))
    if w == 0:
        await outcome("extra", strategy.run(lambda: 0.0))
    await outcome("c", strategy.run(one, args=(100,)))
    with strategy.scope():
        out["reduce"] = float(await strategy.reduce("sum", np.float64(w + 1), axis=None))
    return out


async def _stray_call(strategy: aiodist.Strategy) -> dict:
    """A task that run A's merge_fn started calls strategy.reduce after 0.3 s: on
    worker 0 while A is still in flight, on worker 1 after A has ended, as A fails
    there (it makes no cross-worker call). The call is of run A on both, so it
    raises on both; the next reduce pairs. (While a call made once its run had
    ended belonged to no run, worker 1's paired with worker 0's next reduce:
    1 + 200 = 201, silently; then a timeout and MPI_Abort.)"""
    w = strategy.worker_index
    tasks = []

    async def late():
        await asyncio.sleep(0.3)
        return float(await strategy.reduce("sum", np.float64(100 * (w + 1)), axis=None))

    def merge_fn(_):
        tasks.append(asyncio.ensure_future(late()))

    async def step():
        aiodist.get_replica_context().merge_call(merge_fn)
        if w == 1:
            raise ValueError("bad on worker 1")
        await asyncio.sleep(1.0)
        return 1.0

    out = {"run": await _outcome(strategy, strategy.run(step))}
    try:
        out["late"] = await tasks[0]
    except aiodist.AiodistError as exc:
        out["late"] = [type(exc).__name__, str(exc)]
    with strategy.scope():
        out["next"] = float(await strategy.reduce("sum", np.float64(w + 1), axis=None))
    return out


async def _different_calls(strategy: aiodist.Strategy) -> dict:
    """Worker 1 calls another cross-replica API than worker 0 at the same place,
    with values of one shape: each outcome, then a reduce that must pair."""
    w = strategy.worker_index
    value = np.array([1.0, 2.0]) * (w + 1)
    rows = np.arange(4.0).reshape(2, 2)

    async def outcome(call):
        try:
            return _plain(await call)
        except aiodist.AiodistError as exc:
            return [type(exc).__name__, str(exc)]

    with strategy.scope():
        return {
            "reduce_to": await outcome(
                strategy.reduce("sum", value, axis=None)
                if w == 0
                else strategy.extended.reduce_to("sum", value, "cpu:0")
            ),
            "batch": await outcome(
                strategy.extended.reduce_to("sum", value, "cpu:0")
                if w == 0
                else strategy.extended.batch_reduce_to("sum", [(value, "cpu:0")])
            ),
            "axis": await outcome(
                strategy.reduce("sum", rows, axis=0)
                if w == 0
                else strategy.reduce("sum", value, axis=None)
            ),
            "after": await outcome(strategy.reduce("sum", value, axis=None)),
        }


async def _cancelled_in_turn(strategy: aiodist.Strategy) -> dict:
    """Runs A and B submitted together (B waits for A's end); worker 1 gives B up
    while it waits, then every worker runs C. Before, worker 1's B left no trace,
    so worker 0's B paired with worker 1's C (B's sum was 110.0 there) and worker
    0's C waited for worker 1 until the timeout."""
    started = time.monotonic()

    async def step(value, pause):
        await asyncio.sleep(pause)
        return await aiodist.get_replica_context().all_reduce("sum", value)

    async def attempt(run):
        try:
            return float(await run)
        except (aiodist.AiodistError, TimeoutError) as exc:
            return [type(exc).__name__, str(exc)]

    second = strategy.run(step, args=(10.0, 0.0))
    if strategy.worker_index == 1:
        second = asyncio.wait_for(second, 0.2)  # (run A sleeps 0.5 s first)
    a, b = await asyncio.gather(attempt(strategy.run(step, args=(1.0, 0.5))), attempt(second))
    c = await attempt(strategy.run(step, args=(100.0, 0.0)))
    return {"a": a, "b": b, "c": c, "after": time.monotonic() - started}


async def _run_in_merge_fn(strategy: aiodist.Strategy) -> dict:
    """A merge_fn calls strategy.run (bounded here by wait_for: it waited forever for
    the end of the run waiting for it), then a plain run follows."""

    async def inner():
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    async def step():
        async def merge_fn(strategy):
            return await strategy.run(inner)

        return await aiodist.get_replica_context().merge_call(merge_fn)

    started = time.monotonic()
    try:
        await asyncio.wait_for(strategy.run(step), 5.0)
    except (aiodist.AiodistError, TimeoutError) as exc:
        nested = [type(exc).__name__, str(exc)]
    after = time.monotonic() - started
    # run(options=...) is refused before the run is numbered: the next run pairs.
    try:
        quick = aiodist.CommunicationOptions(timeout_seconds=0.05)
        await strategy.run(inner, options=quick)
        options = [None, ""]
    except aiodist.AiodistError as exc:
        options = [type(exc).__name__, str(exc)]
    return {
        "nested": nested,
        "after": after,
        "options": options,
        "next": float(await strategy.run(inner)),
    }


async def _overlapped_mismatch(strategy: aiodist.Strategy) -> list:
    """Two all_reduces started before either is awaited; the first's shapes differ
    between the workers. The mismatch error's message, on each worker."""

    async def step():
        ctx = aiodist.get_replica_context()
        first = ctx.all_reduce("sum", np.ones(3 if strategy.worker_index == 1 else 2))
        second = ctx.all_reduce("sum", 5.0)
        return await first, await second

    try:
        await strategy.run(step)
    except aiodist.AiodistError as exc:
        return [type(exc).__name__, str(exc)]
    return [None, ""]


async def _overlapped_after_a_failure(strategy: aiodist.Strategy) -> dict:
    """Runs 1 and 3 fail on worker 1 after their last collective (worker 0's succeed);
    run 2 starts two collectives before awaiting either, and after run 3 two
    strategy.reduce of one shape are gathered. Before, worker 0's first exchange
    after run 1 (or 3) met worker 1's failure header, stale there, while its next
    one was already posted at the following place: run 2 failed with a mismatch on
    both workers, and the two reduces paired the wrong values."""
    w = strategy.worker_index
    out = {}

    async def step(k):
        ctx = aiodist.get_replica_context()
        if k in (1, 3):
            total = await ctx.all_reduce("sum", np.float64(k))
            if w == 1:
                raise ValueError(f"bad result {k} on worker 1")
            return total
        first = ctx.all_reduce("sum", np.float64(k))
        second = ctx.all_gather(np.full((1,), 10.0 * k), axis=0)
        return await first, await second

    for k in (1, 2, 3):
        out[f"run{k}"] = await _outcome(strategy, strategy.run(step, args=(k,)))
    with strategy.scope():
        reduces = await asyncio.gather(
            strategy.reduce("sum", np.float64(1.0), axis=None),
            strategy.reduce("sum", np.float64(10.0), axis=None),
        )
    out["reduces"] = [float(r) for r in reduces]
    return out


async def _give_up_mid_operation(strategy: aiodist.Strategy) -> dict:
    """Worker 1 cancels its run while its all_reduce waits for worker 0 (slow to
    arrive): the all_reduce, whose header was sent, finishes first, so worker 0 gets
    its result instead of waiting in the data step for the timeout (30 s), and a
    strategy.reduce after it pairs on both workers."""
    started = time.monotonic()

    async def step():
        if strategy.worker_index == 0:
            await asyncio.sleep(1.0)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    try:
        if strategy.worker_index == 1:
            await asyncio.wait_for(strategy.run(step), 0.3)
        else:
            await strategy.run(step)
    except (aiodist.AiodistError, TimeoutError) as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    else:
        out = {"error": None}
    out["after"] = time.monotonic() - started
    out["reduce"] = float(await strategy.reduce("sum", np.float64(1.0), axis=None))
    return out


def _loop_ends_while_finishing(strategy: aiodist.Strategy) -> dict:
    """Worker 1's replica raises while its all_reduce's header exchange waits for
    worker 0 (1 s late): its run waits for the all_reduce to finish, and worker 1's
    program returns meanwhile, without awaiting the run: the loop's shutdown cancels
    the run and the all_reduce. Worker 0 has matched its header and would wait in
    the data step for the timeout (30 s): it must fail at once. Then, on a second
    loop, worker 1 makes a strategy.reduce, and waits for worker 0's report (the
    MPI_Abort at its exit would end the job before it)."""
    started = time.monotonic()
    w = strategy.worker_index
    raised = []

    async def step():
        pending = aiodist.get_replica_context().all_reduce("sum", 1.0)
        if w == 1:
            await asyncio.sleep(0.3)
            raised.append("ValueError")
            raise ValueError("bad batch on worker 1")
        return await pending

    async def first():
        if w == 1:  # (its loop ends with the run, and the all_reduce, in flight)
            running = asyncio.ensure_future(strategy.run(step))
            await asyncio.sleep(0.6)
            return {"error": raised[0], "running": not running.done()}
        await asyncio.sleep(1.0)
        try:
            await strategy.run(step)
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"error": None}

    out = _run(first())
    out["after"] = time.monotonic() - started

    async def second():
        try:
            return float(await strategy.reduce("sum", np.float64(1.0), axis=None))
        except Exception as exc:
            return [type(exc).__name__, str(exc)]

    if w == 1:
        out["reduce"] = _run(second())
        theirs = os.path.join(os.environ["AIODIST_TEST_RESULTS"], "result-0.json")
        while not os.path.exists(theirs) and time.monotonic() - started < 40:
            time.sleep(0.05)
    return out


async def _reduce_then_drop(held: list) -> dict:
    """Worker 1 cancels its strategy.reduce twice (worker 0 arrives 1 s late), then
    drops the strategy (``held``'s only item: garbage collected at once): the
    reduce, whose header was sent, finishes in the background, so worker 0 gets its
    result, not a timeout (30 s)."""
    started = time.monotonic()
    strategy = held.pop()
    w = strategy.worker_index
    if w == 1:
        reducing = asyncio.ensure_future(strategy.reduce("sum", np.float64(2.0), axis=None))
        await asyncio.sleep(0.3)
        reducing.cancel()  # it waits for the reduce to finish (its header was sent)
        await asyncio.sleep(0)
        reducing.cancel()  # cancelled again: the reduce finishes in the background
        with contextlib.suppress(asyncio.CancelledError):
            await reducing
        reducing = None
        dropped = weakref.ref(strategy)
        del strategy
        gc.collect()
        if dropped() is not None:  # (kept alive: the reduce still finishes)
            await asyncio.sleep(2.0)
            gc.collect()
        return {"after": time.monotonic() - started, "collected": dropped() is None}
    await asyncio.sleep(1.0)
    try:
        out = {"reduce": float(await strategy.reduce("sum", np.float64(1.0), axis=None))}
    except Exception as exc:
        out = {"reduce": [type(exc).__name__, str(exc)]}
    out["after"] = time.monotonic() - started
    return out


async def _queued_after_a_timeout(strategy: aiodist.Strategy) -> list:
    """Four overlapped strategy.reduce; worker 1 sends its headers, then its loop is
    blocked (6 s) before any data step. Worker 0's first data step times out (1.5 s)
    and the order is lost: the three queued for their turn fail at once, not one
    timeout after another."""
    started = time.monotonic()

    async def one(i):
        try:
            await strategy.reduce("sum", np.float64(i), axis=None)
        except aiodist.AiodistError as exc:
            return [type(exc).__name__, time.monotonic() - started]
        return [None, time.monotonic() - started]

    if strategy.worker_index == 0:
        await asyncio.sleep(0.5)  # worker 1's headers wait for it
        started = time.monotonic()
        return list(await asyncio.gather(*(one(i) for i in range(4))))
    tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
    await asyncio.sleep(0.1)  # every header sent
    time.sleep(6)  # stuck before its data steps
    return list(await asyncio.gather(*tasks))


async def _close_in_flight(strategy: aiodist.Strategy) -> dict:
    """Worker 0 calls close() while its strategy.reduce waits for worker 1 (1 s
    late): refused at once, naming the reduce, which then completes; closing after
    it works. Before, close() went ahead and the reduce waited until its timeout."""
    started = time.monotonic()
    if strategy.worker_index == 1:
        await asyncio.sleep(1.0)
        total = await strategy.reduce("sum", np.float64(1.0), axis=None)
        strategy.close()
        return {"result": float(total), "after": time.monotonic() - started}
    task = asyncio.ensure_future(strategy.reduce("sum", np.float64(1.0), axis=None))
    await asyncio.sleep(0.3)
    refused = _refusal(strategy.close)
    total = await task
    strategy.close()
    return {"refused": refused, "result": float(total), "after": time.monotonic() - started}


async def _inputs(strategy: aiodist.Strategy) -> dict:
    contexts = []

    def dataset_fn(context):
        contexts.append(
            [context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync]
        )
        return [np.full((2,), context.input_pipeline_id)]

    strategy.distribute_datasets_from_function(dataset_fn)
    per_replica = aiodist.InputOptions(
        experimental_replication_mode=aiodist.InputReplicationMode.PER_REPLICA
    )
    strategy.distribute_datasets_from_function(dataset_fn, per_replica)
    return {"contexts": contexts}


async def _concurrent(strategy: aiodist.Strategy) -> list:
    async def step(k):
        ctx = aiodist.get_replica_context()
        first = await ctx.all_reduce("sum", float(k))
        await asyncio.sleep(0.001 * k)
        return await ctx.all_reduce("sum", first)

    results = await asyncio.gather(*(strategy.run(step, args=(k,)) for k in range(4)))
    return [strategy.experimental_local_results(r)[0].tolist() for r in results]


async def _batcher(strategy: aiodist.Strategy) -> dict:
    """Each worker serves its own requests on its own replicas."""
    from aiodist.serving import Batcher

    seen = []

    async def forward(rows):
        seen.append([aiodist.get_replica_context().replica_id_in_sync_group, len(rows)])
        return rows * 2

    offset = 100 * strategy.worker_index
    batcher = Batcher(strategy, forward, max_batch_size=6, max_wait_seconds=0.05)
    async with batcher.lifespan():
        requests = [np.arange(6.0).reshape(3, 2) + offset + 10 * k for k in range(4)]
        answers = await asyncio.gather(*(batcher.submit(rows) for rows in requests))
    return {
        "right": all(np.array_equal(a, r * 2) for a, r in zip(answers, requests, strict=True)),
        "replicas": sorted({replica for replica, _ in seen}),
        "rows": sum(rows for _, rows in seen),
    }


async def _statistics(strategy: aiodist.Strategy) -> dict:
    async def step():
        ctx = aiodist.get_replica_context()
        await ctx.all_reduce("sum", np.ones(3))  # 24 bytes per replica
        await ctx.all_gather(np.ones(2), axis=0)  # 16 bytes per replica

    await strategy.run(step)
    return {"bytes_reduced": strategy.statistics().bytes_reduced}


async def _structures(strategy: aiodist.Strategy) -> list:
    """A dict or list of distributed values is refused by every cross-worker
    reduction and gather, each naming the structure (before any worker waits)."""
    loss = strategy.experimental_distribute_values_from_function(_half)
    refused = []
    with strategy.scope():
        for call in (
            strategy.reduce("mean", {"loss": loss}, axis=None),
            strategy.gather([loss], axis=0),
            strategy.extended.reduce_to("sum", [loss], "cpu:0"),
            strategy.extended.batch_reduce_to("sum", [({"loss": loss}, "cpu:0")]),
        ):
            try:
                await call
            except aiodist.InvalidArgumentError as exc:
                refused.append(str(exc).split(";")[0])
    return refused


async def _hash_seeds(strategy: aiodist.Strategy) -> dict:
    """Structures keyed by frozensets of str (and tuples holding them) reduced and
    gathered by workers started with different PYTHONHASHSEEDs."""

    def named(out: dict) -> list:
        rows = [[",".join(sorted(key)), _plain(v)] for key, v in out.items()]
        return sorted(rows)

    async def step():
        ctx = aiodist.get_replica_context()
        words = frozenset({"alpha", "beta", "gamma", "delta"})
        value = {words: np.ones(2), frozenset({"x"}): np.ones(1)}
        reduced = await ctx.all_reduce("sum", value)
        nested = {(frozenset("abc"), 1): np.ones(1), (frozenset("d"), 2): np.full(1, 1.5)}
        nested = await ctx.all_reduce("sum", nested)
        gathered = await ctx.all_gather(value, axis=0)
        pairs = [[[",".join(sorted(k[0])), k[1]], _plain(v)] for k, v in nested.items()]
        return {
            "reduced": named(reduced),
            "nested": sorted(pairs),
            "gathered": named({k: v[-2:] for k, v in gathered.items()}),
        }

    result = strategy.experimental_local_results(await strategy.run(step))[0]

    async def mismatch():  # the same structure, of another shape on worker 1
        words = frozenset({"alpha", "beta", "gamma", "delta"})
        value = {words: np.ones(2 + strategy.worker_index)}
        return await aiodist.get_replica_context().all_reduce("sum", value)

    try:
        await strategy.run(mismatch)
        refused = ""
    except aiodist.CollectiveMismatchError as exc:
        refused = str(exc)
    return {"seed": os.environ.get("PYTHONHASHSEED"), **result, "mismatch": refused}


async def _plain_variable(strategy: aiodist.Strategy) -> dict:
    """A variable made outside any scope is reduced as its value (one copy, whatever
    the number of local replicas), as MirroredStrategy reduces it."""
    plain = aiodist.Variable(np.array([1.0, 2.0]))
    with strategy.scope():
        return {
            "mean": _plain(await strategy.reduce("mean", plain, axis=None)),
            "max": _plain(await strategy.reduce("max", plain, axis=None)),
            "reduce_to": _plain(await strategy.extended.reduce_to("mean", plain, "cpu:0")),
        }


async def _after_agreed(strategy: aiodist.Strategy) -> dict:
    """Run 1 fails on worker 1 after its all_reduce's headers agreed, while the data
    step waits for worker 0 (whose loop is blocked 1 s before it issues its own):
    AIODIST_TEST_HOW is "raise" (a replica raises) or "cancel" (the run is
    cancelled); with AIODIST_TEST_NEXT=1 run 1 makes a second all_reduce after
    the first. Then run 2 and a strategy.reduce on every worker."""
    how = os.environ.get("AIODIST_TEST_HOW", "raise")
    second = os.environ.get("AIODIST_TEST_NEXT") == "1"
    w = strategy.worker_index
    out = {}

    async def step(k):
        ctx = aiodist.get_replica_context()
        pending = ctx.all_reduce("sum", np.float64(10 * k + w))
        if k == 1 and w == 0:
            for _ in range(3):  # its collective's task posts its header
                await asyncio.sleep(0)
            time.sleep(1.0)  # its loop is blocked: its data step is issued 1 s late
        if k == 1 and w == 1:
            await asyncio.sleep(0.6)  # the headers agreed; the data step waits
            if how == "raise":
                raise ValueError("bad batch on worker 1")
        total = await pending
        if k == 1 and second:
            total += await ctx.all_reduce("sum", np.float64(100.0))
        return total

    for k in (1, 2):
        started = time.monotonic()
        try:
            if k == 1 and w == 1 and how == "cancel":
                result = await asyncio.wait_for(strategy.run(step, args=(k,)), 0.6)
            else:
                result = await strategy.run(step, args=(k,))
            out[f"run{k}"] = _plain(strategy.experimental_local_results(result))
        except Exception as exc:
            out[f"run{k}"] = [type(exc).__name__, str(exc)]
        out[f"after{k}"] = round(time.monotonic() - started, 2)
    try:
        out["reduce"] = float(await strategy.reduce("sum", np.float64(w), axis=None))
    except Exception as exc:
        out["reduce"] = [type(exc).__name__, str(exc)]
    return out


async def _exit_in_replica(strategy: aiodist.Strategy) -> dict:
    """Worker 1's replica calls sys.exit(3) before its all_reduce (the process
    ends); worker 0's run must name the SystemExit, not a cancellation."""

    async def step():
        if strategy.worker_index == 1:
            await asyncio.sleep(0.2)
            sys.exit(3)
        return await aiodist.get_replica_context().all_reduce("sum", 1.0)

    try:
        await strategy.run(step)
    except aiodist.AiodistError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


async def _background_fails(strategy: aiodist.Strategy) -> dict:
    """Worker 1's replica raises after its all_reduce posted its header; worker 0
    never joins (it only waits), so that all_reduce, which the run lets finish,
    times out (1.5 s) on worker 1: its failure must be logged there, not dropped."""
    w = strategy.worker_index
    if w == 0:
        await asyncio.sleep(4.0)
        return {"error": None}

    async def step():
        pending = aiodist.get_replica_context().all_reduce("sum", 1.0)
        await asyncio.sleep(0.3)  # its header posted
        raise ValueError("bad batch on worker 1")
        await pending  # (never reached)

    try:
        await strategy.run(step)
    except ValueError as exc:
        error = type(exc).__name__
    await asyncio.sleep(3.0)  # the background all_reduce times out meanwhile
    return {"error": error}


async def _sync_after_a_failed_run(strategy: aiodist.Strategy) -> dict:
    """Run 1 fails on worker 1, then every worker creates a variable (a synchronous
    cross-worker call) and makes a strategy.reduce. AIODIST_TEST_HOW: "agreed",
    worker 1's replica raises while its all_reduce, agreed, waits in its data step
    for worker 0; "overlapped", it raises before any collective while worker 0 has
    two in flight (worker 1 then comes to the variable 0.5 s late); "last", the same,
    and the program ends there. Before, the worker left with a collective of run 1
    in flight refused the variable while the other made it: a mismatch, then a
    timeout and MPI_Abort."""
    how = os.environ["AIODIST_TEST_HOW"]
    w = strategy.worker_index

    async def step():
        ctx = aiodist.get_replica_context()
        if how == "agreed":
            pending = ctx.all_reduce("sum", np.float64(1 + w))
            if w == 0:
                for _ in range(3):  # its collective's task posts its header
                    await asyncio.sleep(0)
                time.sleep(1.0)  # its loop is blocked: its data step is issued 1 s late
            else:
                await asyncio.sleep(0.6)  # the headers agreed; the data step waits
                raise ValueError("bad batch on worker 1")
            return await pending
        if w == 1:
            raise ValueError("bad batch on worker 1")
        first = ctx.all_reduce("sum", 1.0)
        second = ctx.all_reduce("sum", 10.0)
        return await first + await second

    started = time.monotonic()
    try:
        out = {"run": float(await strategy.run(step))}
    except Exception as exc:
        out = {"run": type(exc).__name__}
    out["after"] = round(time.monotonic() - started, 2)
    if how == "last":
        return out
    if how == "overlapped" and w == 1:
        await asyncio.sleep(0.5)
    try:
        with strategy.scope():
            out["variable"] = _plain(aiodist.Variable(np.full(2, float(w))).numpy())
    except Exception as exc:
        out["variable"] = [type(exc).__name__, str(exc)]
    try:
        out["reduce"] = float(await strategy.reduce("sum", np.float64(1.0), axis=None))
    except Exception as exc:
        out["reduce"] = [type(exc).__name__, str(exc)]
    return out


async def _failed_run_frees(strategy: aiodist.Strategy) -> dict:
    """A replica raises holding a large array; once the program has dropped the
    run's error, nothing may keep the array (before, the strategy kept the
    replica's exception, its traceback and frames, until the next run)."""
    held = []

    async def step():
        rows = np.zeros(1_000_000)
        held.append(weakref.ref(rows))
        raise ValueError("bad batch")

    with contextlib.suppress(ValueError):
        await strategy.run(step)
    gc.collect()
    return {"alive": sum(ref() is not None for ref in held), "replicas": len(held)}


async def _global_ids(strategy: aiodist.Strategy) -> dict:
    """Worker 1 (global replicas 2 and 3) fails runs 1 and 2 in its own rendezvous:
    replica 3 returns without the all_reduce replica 2 waits in, then calls MAX
    where replica 2 calls SUM. Run 3 reads statistics() while replica 2 waits for
    replica 3 (which waits to be seen missing); then each replica's context."""

    async def step(kind):
        ctx = aiodist.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        if rid == 3 and kind == "exit":
            return 0.0
        if rid == 3 and kind == "mismatch":
            return await ctx.all_reduce("max", 1.0)
        seen = ""  # (text: every replica returns the same structure)
        if rid == 3 and kind == "statistics":
            for _ in range(1000):  # until replica 2's arrival shows (a few steps)
                rows = strategy.statistics().rendezvous_in_flight
                if rows:
                    break
                await asyncio.sleep(0)
            seen = repr([(r.arrived, r.missing) for r in rows])
        return [float(await ctx.all_reduce("sum", 1.0)), seen]

    async def outcome(kind):
        try:
            return _plain(strategy.experimental_local_results(await strategy.run(step, (kind,))))
        except aiodist.AiodistError as exc:
            return [type(exc).__name__, str(exc)]

    return {
        "exit": await outcome("exit"),
        "mismatch": await outcome("mismatch"),
        "statistics": await outcome("statistics"),
        "contexts": list(
            strategy.experimental_local_results(
                await strategy.run(lambda: repr(aiodist.get_replica_context()))
            )
        ),
    }


async def _variable_order(strategy: aiodist.Strategy) -> dict:
    """Worker 1 creates variables ``b`` and ``a`` (one shape) in the other order than
    worker 0; then every worker creates ``c`` alike and reduces. Before, ``a`` took
    ``b``'s initial value on worker 1 and ``b`` took ``a``'s, silently."""
    out = {}
    with strategy.scope():
        try:
            for name in ("a", "b") if strategy.worker_index == 0 else ("b", "a"):
                aiodist.Variable(np.full(2, ord(name)), name=name)
        except aiodist.CollectiveMismatchError as exc:
            out["created"] = str(exc)
        c = aiodist.Variable(np.full(2, strategy.worker_index + 1.0), name="c")
        out["c"] = _plain(c.numpy())
        out["reduce"] = _plain(await strategy.reduce("sum", np.float64(1), axis=None))
    return out


async def _alike_mismatch(strategy: aiodist.Strategy) -> dict:
    """Worker 1 creates a variable of another shape, then one of another dtype, then
    calls an all_reduce with another bytes_per_pack: calls that read alike on every
    worker. Before, the mismatch showed the same text for both workers, and not
    what differed."""
    out = {}
    other = strategy.worker_index == 1
    with strategy.scope():
        for case, value in (
            ("shape", np.zeros(3 if other else 2)),
            ("dtype", np.zeros(2, np.float32 if other else np.float64)),
        ):
            try:
                aiodist.Variable(value, name="v")
            except aiodist.CollectiveMismatchError as exc:
                out[case] = str(exc)

    async def step():
        packs = aiodist.CommunicationOptions(bytes_per_pack=16 if other else 0)
        return await aiodist.get_replica_context().all_reduce("sum", [1.0, 2.0], options=packs)

    out["packs"] = (await _outcome(strategy, strategy.run(step)))[1]
    out["reduce"] = _plain(await strategy.reduce("sum", np.float64(1), axis=None))
    return out


async def _run_on_one_worker(strategy: aiodist.Strategy) -> dict:
    """Worker 0 makes a run whose merge_fn calls strategy.reduce (a chief-only step);
    worker 1 calls strategy.reduce of the same shape outside any run. Then every
    worker reduces alike. Before, the two first reductions paired silently: 15.0
    on both workers, each with the other's value."""

    async def step():
        async def merge_fn(strategy):
            return await strategy.reduce("sum", np.float64(10), axis=None)

        return await aiodist.get_replica_context().merge_call(merge_fn)

    if strategy.worker_index == 0:
        first = await _outcome(strategy, strategy.run(step))
    else:
        first = await _outcome(strategy, strategy.reduce("sum", np.float64(5), axis=None))
    after = await strategy.reduce("sum", np.float64(1), axis=None)
    return {"first": first, "after": _plain(after)}


async def _refused_on_one_worker(strategy: aiodist.Strategy) -> dict:
    """strategy.reduce (axis=0) and strategy.gather of values that worker 1 refuses
    on its own (rank-0 values; shapes differing off the gathered axis) while worker
    0 accepts its own; then every worker reduces alike. Before, worker 1 raised
    without sending a header, and worker 0 waited for it until the timeout (30 s
    here, 300 s by default), after which the order was lost for good."""
    started = time.monotonic()
    other = strategy.worker_index == 1

    def rows(ctx: aiodist.ValueContext) -> np.ndarray:
        return np.ones(()) if other else np.ones(2)

    def blocks(ctx: aiodist.ValueContext) -> np.ndarray:
        return np.ones((2, 1 + ctx.replica_id_in_sync_group if other else 2))

    out = {}
    with strategy.scope():
        values = strategy.experimental_distribute_values_from_function(rows)
        out["reduce"] = await _outcome(strategy, strategy.reduce("sum", values, axis=0))
        values = strategy.experimental_distribute_values_from_function(blocks)
        out["gather"] = await _outcome(strategy, strategy.gather(values, axis=0))
        ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(1))
        out["after"] = _plain(await strategy.reduce("sum", ones, axis=None))
    out["seconds"] = time.monotonic() - started
    return out


async def _variable_refused_on_one_worker(strategy: aiodist.Strategy) -> dict:
    """Variable 'v' in the scope: refused on worker 1 (strings, not numbers) and
    on worker 2 (a function that raises), made of zeros on worker 0; then 'w',
    refused on worker 2 only (its synchronization); then every worker reduces
    alike. Before, worker 1 raised without sending a header: worker 0's
    creation paired with worker 1's next call (a mismatch naming a call worker
    0 never made), a later call waited until the timeout, and the job ended
    with MPI_Abort."""
    started = time.monotonic()

    def broken():
        raise RuntimeError("no value here")

    initial = [np.zeros(1), np.array(["x"]), broken][strategy.worker_index]
    sync = "bogus" if strategy.worker_index == 2 else "auto"
    out = {}
    with strategy.scope():
        for name, make in [
            ("v", lambda: aiodist.Variable(initial, name="v")),
            ("w", lambda: aiodist.Variable(1.0, name="w", synchronization=sync)),
        ]:
            try:
                out[name] = _plain(make().numpy())
            except Exception as exc:
                out[name] = [type(exc).__name__, str(exc)]
        ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(1))
        out["after"] = _plain(await strategy.reduce("sum", ones, axis=None))
    out["seconds"] = time.monotonic() - started
    return out


async def _updates_differ(strategy: aiodist.Strategy) -> dict:
    """In one run, worker 0 writes v with assign and worker 1 with assign_add;
    then worker 0 assigns f and worker 1 g (ONLY_FIRST_REPLICA, one shape). Before,
    each pair of updates exchanged as one: v became 2 on worker 0 and 7 on worker
    1, and f 1 on worker 0 while it stayed 0 on worker 1, silently."""
    other = strategy.worker_index == 1
    with strategy.scope():
        v = aiodist.Variable(np.full(2, 5.0), aggregation="sum", name="v")
        f = aiodist.Variable(np.zeros(2), aggregation="only_first_replica", name="f")
        g = aiodist.Variable(np.zeros(2), aggregation="only_first_replica", name="g")

    async def write_v():
        await (v.assign_add if other else v.assign)(np.ones(2))

    async def write_f_or_g():
        await (g if other else f).assign(np.ones(2))

    return {
        "v": await _outcome(strategy, strategy.run(write_v)),
        "f": await _outcome(strategy, strategy.run(write_f_or_g)),
        "values": _plain([v.numpy(), f.numpy(), g.numpy()]),
    }


async def _reads_in_another_order(strategy: aiodist.Strategy) -> dict:
    """Sync-on-read variables a and b (SUM, one shape), read in cross-replica
    context in another order on worker 1; then read alike. Before, the reads
    paired by place: worker 0's a met worker 1's b, and each read returned a sum
    of one variable's copies and the other's (11, 11 on every read), silently."""
    with strategy.scope():
        a = aiodist.Variable(np.zeros(2), synchronization="on_read", aggregation="sum", name="a")
        b = aiodist.Variable(np.zeros(2), synchronization="on_read", aggregation="sum", name="b")

    async def step():
        await a.assign(np.ones(2))
        await b.assign(np.full(2, 10.0))

    await strategy.run(step)
    order = (b, a) if strategy.worker_index == 1 else (a, b)
    swapped = []
    for variable in order:
        try:
            swapped.append(_plain(variable.numpy()))
        except aiodist.CollectiveMismatchError as exc:
            swapped.append(str(exc))
    return {"swapped": swapped, "alike": _plain([a.numpy(), b.numpy()])}


async def plain_values(strategy: aiodist.Strategy) -> dict:
    """strategy.reduce and reduce_to of a value that is not distributed: each
    outcome (the result, or the error's class and message), then a reduce that
    must still pair on every worker. Also run on one process's MirroredStrategy."""

    async def outcome(call):
        try:
            return _plain(await call)
        except aiodist.AiodistError as exc:
            return [type(exc).__name__, str(exc)]

    plain = np.array([1.0, 2.0])
    with strategy.scope():
        return {
            "sum": await outcome(strategy.reduce("sum", plain, axis=None)),
            "product": await outcome(strategy.reduce("product", plain, axis=None)),
            "mean": await outcome(strategy.reduce("mean", plain, axis=None)),
            "max": await outcome(strategy.reduce("max", plain, axis=None)),
            "reduce_to": await outcome(strategy.extended.reduce_to("sum", plain, "cpu:0")),
            "batch": await outcome(
                strategy.extended.batch_reduce_to("sum", [(plain, "cpu:0"), (plain, "cpu:0")])
            ),
            "after": await outcome(strategy.reduce("mean", plain, axis=None)),
        }


def _run(coro):
    """On the loop named by AIODIST_TEST_LOOP: uvloop (aiodist.run's) or asyncio."""
    if os.environ.get("AIODIST_TEST_LOOP") == "asyncio":
        return asyncio.run(coro)
    return aiodist.run(coro)


_BOUNDED = (
    "failures_keep_the_order",
    "failures_in_a_row",
    "different_calls",
    "close_in_flight",
    "fail_then_go_on",
    "give_up",
    "long_headers",
    "overlapped",
    "after_agreed",
    "exit_in_replica",
    "overlapped_after_a_failure",
    "overlapped_mismatch",
    "cancelled_in_turn",
    "run_in_merge_fn",
    "plain_variable",
    "hash_seeds",
    "sync_after_a_failed_run",
    "plain_values",
    "runs_without_calls",
    "stray_call",
    "global_ids",
    "variable_order",
    "alike_mismatch",
    "run_on_one_worker",
    "refused_on_one_worker",
    "variable_refused_on_one_worker",
    "updates_differ",
    "reads_in_another_order",
    "big_endian",
)  # a 30 s timeout: failing at once shows


def main() -> None:
    mode = sys.argv[1]
    counts = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1] * 8
    if mode == "queued_after_a_timeout":
        strategy = _strategy(counts, timeout=1.5)
        _report(strategy, _run(_queued_after_a_timeout(strategy)))
        return
    if mode == "many_failures":
        strategy = _strategy(counts, timeout=5.0)
        _report(strategy, _run(_many_failures(strategy)))
        return
    if mode == "background_fails":
        strategy = _strategy(counts, timeout=1.5)
        _report(strategy, _run(_background_fails(strategy)))
        return
    if mode == "stuck_in_update":
        strategy = _strategy(counts, timeout=1.5)
        _report(strategy, _run(_stuck_in_update(strategy)))
        return
    if mode in ("mismatch", "stop", "kill"):
        strategy = _strategy(counts, timeout=1.5)
        _run(_failing(mode, strategy))
        return
    if mode == "loop_ends_while_finishing":
        strategy = _strategy(counts, timeout=30.0)
        _report(strategy, _loop_ends_while_finishing(strategy))
        return
    if mode == "reduce_then_drop":  # (the program drops the strategy)
        held = [_strategy(counts, timeout=30.0)]
        rank = types.SimpleNamespace(worker_index=held[0].worker_index)
        _report(rank, _run(_reduce_then_drop(held)))
        return
    if mode == "stall":
        options = aiodist.CommunicationOptions(timeout_seconds=30, stall_warning_seconds=0.5)
        strategy = aiodist.MultiWorkerMirroredStrategy(1, communication_options=options)
        _report(strategy, _run(_stall(strategy)))
        return
    strategy = _strategy(counts, timeout=30.0 if mode in _BOUNDED else None)
    work = {
        "fail_then_go_on": _fail_then_go_on,
        "failures_keep_the_order": _failures_keep_the_order,
        "failures_in_a_row": _failures_in_a_row,
        "different_calls": _different_calls,
        "overlapped": _overlapped,
        "overlapped_after_a_failure": _overlapped_after_a_failure,
        "overlapped_mismatch": _overlapped_mismatch,
        "cancelled_in_turn": _cancelled_in_turn,
        "run_in_merge_fn": _run_in_merge_fn,
        "after_agreed": _after_agreed,
        "exit_in_replica": _exit_in_replica,
        "stall": _stall,
        "closing": _closing,
        "close_in_flight": _close_in_flight,
        "queued_after_a_timeout": _queued_after_a_timeout,
        "finalizer_on_thread": _finalizer_on_thread,
        "long_headers": _long_headers,
        "min_max": min_max,
        "complex_min_max": complex_min_max,
        "big_endian": big_endian,
        "give_up": _give_up_mid_operation,
        "compute": compute,
        "inputs": _inputs,
        "concurrent": _concurrent,
        "busy": _read_while_busy,
        "batcher": _batcher,
        "statistics": _statistics,
        "structures": _structures,
        "plain_variable": _plain_variable,
        "hash_seeds": _hash_seeds,
        "sync_after_a_failed_run": _sync_after_a_failed_run,
        "failed_run_frees": _failed_run_frees,
        "many_successes": _many_successes,
        "runs_without_calls": _runs_without_calls,
        "stray_call": _stray_call,
        "plain_values": plain_values,
        "global_ids": _global_ids,
        "variable_order": _variable_order,
        "alike_mismatch": _alike_mismatch,
        "run_on_one_worker": _run_on_one_worker,
        "refused_on_one_worker": _refused_on_one_worker,
        "variable_refused_on_one_worker": _variable_refused_on_one_worker,
        "updates_differ": _updates_differ,
        "reads_in_another_order": _reads_in_another_order,
    }[mode]
    _report(strategy, _run(work(strategy)))


if __name__ == "__main__":
    main()
