"""Distributed inference in an async server (issue 7): the batcher, and the example
server on a real ASGI stack (Starlette under uvicorn) over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import aiodist
from aiodist.serving import Batcher, BatcherStats, NotServing, Overloaded
from examples.client import http
from tests.conftest import (
    assert_no_cyclic_garbage,
    assert_usage_error,
    cpu_devices,
    loop_lag,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent

uvicorn = pytest.importorskip("uvicorn", reason="pip install '.[serve]' for the server tests")
_spec = importlib.util.spec_from_file_location("serve_example", ROOT / "examples" / "serve.py")
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)

W = np.arange(12.0).reshape(4, 3)


async def linear(rows):
    return np.einsum("bi,ih->bh", rows, W, optimize=False)


# -- the batcher --------------------------------------------------------------------------


async def test_batcher_answers_each_caller_its_own_rows(num_replicas):
    batcher = Batcher(aiodist.MirroredStrategy(cpu_devices(num_replicas)), linear)
    await batcher.start(np.zeros((1, 4)))
    requests = [np.full((1 + i % 3, 4), float(i)) for i in range(300)]
    outputs = await asyncio.gather(*(batcher.submit(r) for r in requests))
    for request, output in zip(requests, outputs, strict=True):
        np.testing.assert_array_equal(output, request @ W)
    stats = batcher.stats()
    assert stats.requests == 300 and stats.rows == sum(len(r) for r in requests)
    assert stats.mean_batch_size > 1
    await batcher.stop()


async def test_batches_run_outside_the_scope_that_start_was_called_in(two, three):
    """A task keeps the context it was made in: a batcher started under another
    strategy's scope (a lifespan building another model there) failed every batch,
    long after that scope was left, with "Mixing different aiodist strategies", and
    its warm-up failed at once."""

    async def step(rows):
        return rows * float(aiodist.get_strategy() is two)

    for warmup in (None, np.zeros((1, 4))):
        batcher = Batcher(two, step)
        with three.scope():
            await batcher.start(warmup)
            assert aiodist.get_strategy() is three  # the caller's own scope is kept
        np.testing.assert_array_equal(await batcher.submit(np.ones((2, 4))), np.ones((2, 4)))
        await batcher.stop()


async def test_cancelled_caller_is_dropped_without_disturbing_others(two):
    gate = asyncio.Event()
    seen: list[float] = []

    async def gated(rows):
        seen.extend(rows[:, 0].tolist())
        await gate.wait()
        return rows * 2

    batcher = Batcher(two, gated, max_batch_size=4, max_wait_seconds=0)
    await batcher.start()
    first = asyncio.create_task(batcher.submit(np.full((1, 1), 1.0)))
    await wait_until(lambda: seen, "the first batch runs")
    gone = asyncio.create_task(batcher.submit(np.full((1, 1), 2.0)))
    stays = asyncio.create_task(batcher.submit(np.full((1, 1), 3.0)))
    await wait_until(lambda: batcher.queued_rows == 2, "two requests queued")
    gone.cancel()
    gate.set()
    assert (await first)[0, 0] == 2.0
    assert (await stays)[0, 0] == 6.0
    assert gone.cancelled()
    assert 2.0 not in seen  # dropped before its batch was built
    await batcher.stop()


class _Abort(BaseException):
    """Raised by a step: a BaseException that is no Exception (as pytest.fail's is)."""


@contextlib.contextmanager
def _unhandled_loop_errors():
    """What the running loop's exception handler is given inside the block."""
    unhandled: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        yield unhandled
    finally:
        loop.set_exception_handler(None)


@pytest.mark.parametrize("error", [ArithmeticError, _Abort])
async def test_batch_failure_reaches_every_caller_and_serving_goes_on(two, error):
    # The one exception to every caller of the batch, and serving goes on. With a
    # BaseException that is no Exception (_Abort), its callers got NotServing("the
    # batcher stopped before this request's batch finished") from a batcher that had
    # not stopped, and asyncio logged "Task exception was never retrieved".
    async def picky(rows):
        if (rows < 0).any():
            raise error("negative input")
        return rows

    batcher = Batcher(two, picky, max_batch_size=8, max_wait_seconds=0.05)
    with _unhandled_loop_errors() as unhandled:
        await batcher.start()
        results = await asyncio.gather(
            *(batcher.submit(np.full((1, 1), float(i))) for i in (1, -1, 2)),
            return_exceptions=True,
        )
        kinds = [type(r) for r in results]
        one_object = len({id(r) for r in results}) == 1
        del results
        np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), np.ones((1, 1)))
        await batcher.stop()
        gc.collect()
    assert kinds == [error] * 3 and one_object
    assert batcher.stats().failed == 1 and batcher.stats().failed_requests == 3
    assert not unhandled, unhandled


async def _full_queue(strategy, max_batch_size: int, running_rows: int, queued_rows: list):
    """A started batcher (max_queue_rows=4, one batch in flight) whose first batch
    (``running_rows`` rows) is held at ``gate`` and whose queue is full with
    requests of ``queued_rows`` rows: (batcher, gate, running, queued)."""
    gate = asyncio.Event()
    ran = []

    async def gated(rows):
        ran.append(len(rows))
        await gate.wait()
        return rows

    batcher = Batcher(
        strategy,
        gated,
        max_batch_size=max_batch_size,
        max_queue_rows=4,
        max_wait_seconds=0,
        max_batches_in_flight=1,
    )
    await batcher.start()
    running = asyncio.create_task(batcher.submit(np.ones((running_rows, 1))))
    await wait_until(lambda: ran, "the first batch runs")
    queued = [asyncio.create_task(batcher.submit(np.ones((rows, 1)))) for rows in queued_rows]
    await wait_until(lambda: batcher.queued_rows == 4, "queue full")
    return batcher, gate, running, queued


async def test_overload_is_immediate_and_recovers(two):
    batcher, gate, running, queued = await _full_queue(two, 2, 2, [2, 2])
    started = time.perf_counter()
    with pytest.raises(Overloaded, match=r"4 rows are already queued \(max_queue_rows=4\)"):
        await batcher.submit(np.ones((1, 1)))
    assert time.perf_counter() - started < 0.05  # refused at once, not after a wait
    gate.set()
    await asyncio.gather(running, *queued)
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), np.ones((1, 1)))
    assert batcher.stats().rejected == 1
    await batcher.stop()


async def _one_batch_running_one_queued(strategy, rows: int) -> tuple:
    """A started Batcher (max_queue_rows=4, one batch in flight) whose step waits for
    ``gate``: one request of ``rows`` rows running, one more queued. Returns the
    batcher, the gate, the batch sizes the step ran (``ran``) and the two callers'
    tasks."""
    gate, ran = asyncio.Event(), []

    async def gated(batch):
        ran.append(len(batch))
        await gate.wait()
        return batch

    options = {"max_batch_size": rows, "max_wait_seconds": 0, "max_batches_in_flight": 1}
    batcher = Batcher(strategy, gated, max_queue_rows=4, **options)
    await batcher.start()
    running = asyncio.create_task(batcher.submit(np.ones((rows, 1))))
    await wait_until(lambda: ran, "the first batch runs")
    queued = asyncio.create_task(batcher.submit(np.ones((rows, 1))))
    await wait_until(lambda: batcher.queued_rows == rows, f"{rows} rows queued")
    return batcher, gate, ran, running, queued


async def test_overloaded_names_the_request_that_does_not_fit(two):
    # 3 rows queued of 4 and a request of 2: the message said only "3 rows are already
    # queued (max_queue_rows=4)", which reads as if there were room.
    batcher, gate, _, running, queued = await _one_batch_running_one_queued(two, 3)
    with pytest.raises(
        Overloaded,
        match=r"^3 rows are already queued \(max_queue_rows=4\): no room for this request's "
        r"2 rows; retry later\.",
    ):
        await batcher.submit(np.ones((2, 1)))
    admitted = asyncio.create_task(batcher.submit(np.ones((1, 1))))  # (that one fits)
    gate.set()
    await asyncio.gather(running, queued, admitted)
    await batcher.stop()


async def test_stop_finishes_in_flight_then_refuses(two):
    batcher = Batcher(two, linear, max_wait_seconds=0.2)
    await batcher.start()
    pending = [asyncio.create_task(batcher.submit(np.ones((1, 4)))) for _ in range(10)]
    await wait_until(lambda: batcher.queued_rows == 10, "requests queued")
    await batcher.stop(deadline=5)
    for task in pending:
        np.testing.assert_array_equal(task.result(), np.ones((1, 4)) @ W)
    with pytest.raises(NotServing):
        await batcher.submit(np.ones((1, 4)))


async def _stuck_batch(strategy) -> tuple[Batcher, asyncio.Task]:
    """A started batcher whose one batch (the returned caller's) never finishes."""
    entered = []

    async def never(rows):
        entered.append(True)
        await asyncio.Event().wait()

    batcher = Batcher(strategy, never, max_wait_seconds=0)
    await batcher.start()
    stuck = asyncio.create_task(batcher.submit(np.ones((1, 1))))
    await wait_until(lambda: entered, "batch started")
    return batcher, stuck


async def test_stop_deadline_cancels_what_is_left(two):
    batcher, stuck = await _stuck_batch(two)
    await batcher.stop(deadline=0.05)
    with pytest.raises(NotServing, match=r"stopped before this request's batch finished"):
        await stuck  # its batch was cancelled at the deadline: answered, not left hanging
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("aiodist-")]


async def test_stop_answers_batches_cancelled_before_they_started(two):
    # One batch in flight at a time, one row each: stop(deadline=0) cancels batches
    # whose task never ran a step; their callers are answered all the same.
    async def double(rows):
        return rows * 2

    batcher = Batcher(two, double, max_batch_size=1, max_wait_seconds=0, max_batches_in_flight=1)
    await batcher.start()
    callers = [asyncio.create_task(batcher.submit(np.full((1, 1), i))) for i in range(3)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await batcher.stop(deadline=0)
    done, pending = await asyncio.wait(callers, timeout=5)
    assert not pending, "a caller was left waiting after stop()"
    for caller in done:
        assert caller.exception() is None or isinstance(caller.exception(), NotServing)
    await batcher.start()  # every batch slot was given back
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), [[2.0]])
    await batcher.stop()


async def _warming_up(strategy, **options) -> tuple[Batcher, asyncio.Task, asyncio.Event]:
    """A batcher whose start() is in its warm-up run until the returned event is set
    (its step returns its rows)."""
    warming, release = asyncio.Event(), asyncio.Event()

    async def slow(rows):
        warming.set()
        await release.wait()
        return rows

    batcher = Batcher(strategy, slow, **options)
    starting = asyncio.create_task(batcher.start(np.ones((2, 1))))
    await warming.wait()
    return batcher, starting, release


async def test_stop_during_warm_up_keeps_the_batcher_stopped(two):
    batcher, starting, release = await _warming_up(two)
    stopping = asyncio.create_task(batcher.stop())
    await asyncio.sleep(0.01)
    assert not stopping.done()  # the warm-up still runs: stop() waits for it
    release.set()
    await stopping
    await starting
    with pytest.raises(NotServing):
        await batcher.submit(np.ones((1, 1)))
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("aiodist-batcher")]


async def test_stop_returns_only_once_the_warm_up_has_ended(two):
    """stop() during start()'s warm-up returned at once, the warm-up's run still going
    on the strategy (a caller closing the strategy or the loop next left it running),
    also when the warm-up never ended. Now the warm-up is let finish within stop's
    deadline, then cancelled, and stop() returns once it has ended."""
    # Past the deadline: cancelled, and start() returns without starting.
    batcher, starting, release = await _warming_up(two)
    await asyncio.wait_for(batcher.stop(deadline=0.05), 5)
    assert two.statistics().runs_in_flight == 0
    await asyncio.wait_for(starting, 5)
    with pytest.raises(NotServing):
        await batcher.submit(np.ones((1, 1)))
    release.set()
    await batcher.start(np.ones((2, 1)))  # it serves again
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), [[1.0]])
    await batcher.stop()

    # Within the deadline: stop() waits for the warm-up to finish.
    batcher, starting, release = await _warming_up(two)
    stopping = asyncio.create_task(batcher.stop(deadline=30))
    await asyncio.sleep(0.01)
    assert not stopping.done() and two.statistics().runs_in_flight == 1
    release.set()
    await asyncio.wait_for(stopping, 5)
    assert two.statistics().runs_in_flight == 0
    await asyncio.wait_for(starting, 5)

    # stop() itself cancelled while it waits: the warm-up is cancelled too.
    batcher, starting, release = await _warming_up(two)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await batcher.stop(deadline=30)
    await asyncio.wait_for(starting, 5)
    assert two.statistics().runs_in_flight == 0


async def test_a_start_after_a_stop_during_another_starts_warm_up_serves(two):
    # start A warms up; stop() keeps A from starting; start B, called after that
    # stop, waits for A's warm-up, then starts afresh (it was refused as "did not
    # start"). A start waiting when the stop comes is still refused.
    batcher, first, release = await _warming_up(two, max_wait_seconds=0)
    before = asyncio.create_task(batcher.start())
    await asyncio.sleep(0)
    stopping = asyncio.create_task(batcher.stop())  # (it waits for A's warm-up)
    await asyncio.sleep(0)
    after = asyncio.create_task(batcher.start(np.ones((2, 1))))
    await asyncio.sleep(0.01)
    assert not after.done()
    release.set()
    await stopping
    await first
    with pytest.raises(NotServing, match="did not start"):
        await before
    await asyncio.wait_for(after, 5)
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), [[1.0]])
    await batcher.stop()


async def test_a_second_start_waits_for_the_first(two):
    batcher, first, release = await _warming_up(two, max_wait_seconds=0)
    second = asyncio.create_task(batcher.start())
    await asyncio.sleep(0.01)
    assert not second.done()  # waits for the warm-up instead of returning unready
    release.set()
    await asyncio.gather(first, second)
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), [[1.0]])
    await batcher.stop()


async def test_a_second_start_raises_when_the_first_fails(two):
    warming, release = asyncio.Event(), asyncio.Event()

    async def broken(rows):
        warming.set()
        await release.wait()
        raise RuntimeError("warm-up failed")

    batcher = Batcher(two, broken)
    first = asyncio.create_task(batcher.start(np.ones((2, 1))))
    await warming.wait()
    second = asyncio.create_task(batcher.start())
    release.set()
    with pytest.raises(RuntimeError, match="warm-up failed"):
        await first
    with pytest.raises(NotServing, match=r"did not start .*; call start\(\) again"):
        await second


async def test_a_cancelled_stop_still_stops_and_the_batcher_can_start_again(two):
    batcher, stuck = await _stuck_batch(two)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await batcher.stop(deadline=10)
    with pytest.raises(NotServing):
        await stuck
    batcher.step_fn = linear
    await batcher.start()
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop()


async def test_a_request_larger_than_a_batch_is_refused(two):
    batcher = Batcher(two, linear, max_batch_size=4)
    await batcher.start()
    with pytest.raises(ValueError, match=r"a request of 9 rows is larger than one batch"):
        await batcher.submit(np.ones((9, 4)))
    np.testing.assert_array_equal(await batcher.submit(np.ones((4, 4))), np.ones((4, 4)) @ W)
    await batcher.stop()


async def _every_caller_fails(batcher: Batcher, text: str) -> None:
    """Four one-row requests, batched together: each caller gets the step's
    InvalidArgumentError, whose message holds ``text``."""
    outcomes = await asyncio.gather(
        *(batcher.submit(np.full((1, 1), float(i))) for i in range(4)), return_exceptions=True
    )
    for outcome in outcomes:
        assert isinstance(outcome, aiodist.InvalidArgumentError), outcome
        assert text in str(outcome)


async def test_each_replicas_row_count_is_checked_not_only_the_total(two):
    # Replica 0 returns one row short, replica 1 one extra: the total is right, but
    # callers would get each other's rows.
    async def skewed(rows):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return rows[:-1] if rid == 0 else np.concatenate([rows, rows[:1]])

    batcher = Batcher(two, skewed, max_wait_seconds=0.05)
    await batcher.start()
    await _every_caller_fails(batcher, "returned 1 row on replica 0 for its 2 input rows")

    async def scalar(rows):
        return np.float64(1.0)

    batcher.step_fn = scalar
    with pytest.raises(aiodist.InvalidArgumentError, match=r"a value of shape \(\) on replica 0"):
        await batcher.submit(np.ones((2, 1)))
    await batcher.stop()


async def test_a_step_returning_no_array_is_named_not_shape_0(two):
    # A step whose `return` was missing gave "the step returned a value of shape ()",
    # as did one returning a string or a Python float.
    async def forgot(rows):
        rows * 2

    batcher = Batcher(two, forgot, max_wait_seconds=0.05)
    await batcher.start()
    await _every_caller_fails(batcher, "the step returned None (is its `return` missing?) on")
    for value, shown in (("out", "a str, not an array"), (1.5, "a float, not an array")):

        async def constant(rows, value=value):
            return value

        batcher.step_fn = constant
        with pytest.raises(aiodist.InvalidArgumentError, match=rf"returned {shown} on replica 0"):
            await batcher.submit(np.ones((2, 1)))
    await batcher.stop()


async def test_replicas_returning_rows_of_different_shapes_are_named():
    # Outputs padded to the longest of each replica's share: NumPy's "all the input
    # array dimensions except for the concatenation axis must match exactly" reached
    # every caller, naming neither the step nor a replica.
    async def padded(rows):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return np.zeros((len(rows), 2 + (rid == 1)))

    batcher = Batcher(aiodist.MirroredStrategy(cpu_devices(4)), padded, max_wait_seconds=0.05)
    await batcher.start()
    await _every_caller_fails(
        batcher,
        "the step returned rows of shape (2,) on replicas 0, 2, 3; rows of shape (3,) on "
        "replica 1; every replica must return rows of one shape",
    )
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 1))), np.zeros((1, 2)))
    await batcher.stop()


async def test_a_step_returning_several_outputs_is_refused_not_mixed_up(two):
    # (outputs, scores): NumPy stacked the tuple into an array whose axis 0 was the two
    # outputs; with two rows per replica the row counts agreed, and each caller got
    # another caller's outputs (caller 0 got [[0], [10]], caller 1 got [[-0], [-1]]).
    async def two_outputs(rows):
        return rows * 10, -rows

    batcher = Batcher(two, two_outputs, max_wait_seconds=0.05)
    await batcher.start()
    await _every_caller_fails(batcher, "the step returned a tuple; it must return one array")

    async def named_outputs(rows):
        return {"y": rows}

    batcher.step_fn = named_outputs
    with pytest.raises(aiodist.InvalidArgumentError, match=r"returned a dict; it must return one"):
        await batcher.submit(np.ones((2, 1)))
    await batcher.stop()


async def test_the_steps_output_errors_say_they_come_from_the_batcher(two):
    # "the step returned a tuple; ..." named no API: the step is the batcher's.
    async def several(rows):
        return rows, rows

    async def short(rows):
        return rows[:-1]

    async def padded(rows):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return np.zeros((len(rows), 1 + rid))

    batcher = Batcher(two, several, max_wait_seconds=0)
    await batcher.start()
    for step in (several, short, padded):
        batcher.step_fn = step
        with pytest.raises(aiodist.InvalidArgumentError, match=r"^Batcher: the step returned "):
            await batcher.submit(np.ones((2, 1)))
    await batcher.stop()


def test_batcher_argument_checks(two):
    with pytest.raises(ValueError, match=r"max_batch_size=0; expected an int >= 1"):
        Batcher(two, linear, max_batch_size=0)
    for bad in (-1, True, math.nan, math.inf, "0.1", None):
        expected = rf"max_wait_seconds={bad!r}; expected a finite number of seconds >= 0\."
        with pytest.raises(ValueError, match=expected):
            Batcher(two, linear, max_wait_seconds=bad)
    assert Batcher(two, linear, max_wait_seconds=0).max_wait_seconds == 0.0
    assert Batcher(two, linear, max_wait_seconds=1).max_wait_seconds == 1.0
    with pytest.raises(ValueError, match=r"strategy=None; expected an aiodist strategy"):
        Batcher(None, linear)
    with pytest.raises(ValueError, match=r"step_fn=None is not callable"):
        Batcher(two, None)

    async def streaming(rows):  # (refused when made; it failed only once serving)
        yield rows

    with pytest.raises(ValueError, match=r"step_fn=<function .*streaming.* is an async gen"):
        Batcher(two, streaming)


# -- the example server over real sockets ---------------------------------------------


@contextlib.asynccontextmanager
async def running_server(**options):
    app = serve.create_app(cpu_devices(4), **options)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), "server started", 100_000)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield app, port, server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def body(rows) -> bytes:
    return json.dumps({"inputs": rows}).encode()


async def test_500_concurrent_requests_answered_exactly():
    async with running_server() as (app, port, _):
        model = app.state.model
        rng = np.random.default_rng(7)
        requests = [rng.normal(size=(1 + i % 4, 16)).tolist() for i in range(500)]
        answers = await asyncio.gather(*(http(port, "POST", "/predict", body(r)) for r in requests))
        for rows, (status, document) in zip(requests, answers, strict=True):
            assert status == 200
            np.testing.assert_array_equal(np.array(document["outputs"]), model.reference(rows))
        status, metrics = await http(port, "GET", "/metrics")
        assert status == 200 and metrics["requests"] == 500
        assert metrics["mean_batch_size"] > 1
        assert set(metrics["latency_ms"]) == {"p50", "p90", "p99"}
        status, health = await http(port, "GET", "/healthz")
        assert status == 200 and (health["input_width"], health["output_width"]) == (16, 4)


async def test_same_input_same_output_whatever_else_is_served():
    async with running_server() as (_, port, _):
        probe = body([[0.5] * 16])
        alone = (await http(port, "POST", "/predict", probe))[1]
        noise = [body(np.full((3, 16), i / 7).tolist()) for i in range(100)]
        mixed = await asyncio.gather(
            *(http(port, "POST", "/predict", b) for b in [*noise[:50], probe, *noise[50:]])
        )
        assert mixed[50][1] == alone


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"rows": [[1]]}', 'expected a JSON object {"inputs"'),
        (b'{"inputs": 3}', "must be a non-empty list"),
        (b'{"inputs": []}', "must be a non-empty list"),
        (json.dumps({"inputs": [[1.0] * 15]}).encode(), "row 0 has width 15"),
        (json.dumps({"inputs": [[1.0] * 16, "x"]}).encode(), "row 1 has width str"),
        (json.dumps({"inputs": [[1.0] * 15 + ["a"]]}).encode(), "column 15 is 'a'"),
        (json.dumps({"inputs": [[True] + [1.0] * 15]}).encode(), "column 0 is True"),
        (json.dumps({"inputs": [[None] * 16]}).encode(), "column 0 is None"),
        (b'{"inputs": [[NaN' + b", 1" * 15 + b"]]}", "column 0 is nan; expected a finite"),
        (b'{"inputs": [[1, -Infinity' + b", 1" * 14 + b"]]}", "column 1 is -inf; expected"),
        (json.dumps({"inputs": [[1.0] * 16] * 257}).encode(), "257 rows; at most 256"),
        (b'{"inputs": [[' + b"9" * 400 + b", 1" * 15 + b"]]}", "a number of 400 digits"),
        (json.dumps({"inputs": [[1e308] * 16]}).encode(), "magnitude at most 1e+06"),
        (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        # (These named nothing of what they were given.)
        (b"[1, 2]", 'the body is a list; expected a JSON object {"inputs"'),
        (b'{"rows": [[1]], "x": 2}', 'the body has no "inputs" (its keys: "rows", "x"); expected'),
        (b'{"inputs": 3}', '"inputs" is a number (3); it must be a non-empty list of rows'),
        (b'{"inputs": "' + b"a" * 50 + b'"}', '"inputs" is a string ("' + "a" * 38 + "…); it"),
        (b'{"inputs": []}', '"inputs" is an empty list; it must be a non-empty list'),
    ],
    ids=[
        "json",
        "key",
        "type",
        "empty",
        "width",
        "row-type",
        "string",
        "bool",
        "null",
        "nan",
        "infinity",
        "oversized",
        "huge-int",
        "huge-float",
        "deep",
        "list-body",
        "no-inputs",
        "number-inputs",
        "string-inputs",
        "empty-inputs",
    ],
)
async def test_bad_input_answers_400(payload, message):
    async with running_server() as (_, port, _):
        status, document = await http(port, "POST", "/predict", payload)
        assert status == 400
        assert message in document["error"]


async def test_the_client_returns_a_body_that_is_not_json_as_text():
    async with running_server() as (_, port, _):
        assert await http(port, "GET", "/nowhere") == (404, "Not Found")
        assert await http(port, "GET", "/predict") == (405, "Method Not Allowed")


async def test_the_client_names_a_server_that_hangs_up_or_replies_garbage():
    """A server that closed the connection without a reply (or replied with
    something that is not HTTP) made the client raise a bare IndexError."""

    async def serve_one(reply: bytes):
        async def handler(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    for reply, error, message in (
        (b"", ConnectionError, "the server closed the connection without replying"),
        (b"hello\r\n\r\n", ValueError, "the reply does not start with an HTTP status line"),
    ):
        server, port = await serve_one(reply)
        try:
            with pytest.raises(error, match=rf"GET /healthz to 127.0.0.1:{port}: {message}"):
                await http(port, "GET", "/healthz")
        finally:
            server.close()
            await server.wait_closed()


async def test_the_client_joins_a_chunked_reply():
    """uvicorn's own 500 page (a handler cancelled at shutdown, for one) comes with
    Transfer-Encoding: chunked: the client returned '15\\r\\nInternal Server
    Error\\r\\n0\\r\\n\\r\\n', chunk sizes and all."""

    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        chunks = replies.pop(0)
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
        writer.close()

    replies = [[b"Internal Server Error"], [b'{"error": ', b'"x"}']]
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await http(port, "POST", "/predict", b"{}") == (500, "Internal Server Error")
        assert await http(port, "POST", "/predict", b"{}") == (500, {"error": "x"})
    finally:
        server.close()
        await server.wait_closed()


async def test_overload_answers_503_and_recovers(monkeypatch):
    # The model's step waits for a gate, shut once the server has started (its
    # warm-up passes) and opened again only once some request has been refused:
    # while it is shut no batch ends, so the queue (8 rows) fills whatever the pace at
    # which the 100 requests arrive (on a loaded machine, that pace alone could keep
    # the queue below its bound).
    gate = asyncio.Event()
    gate.set()
    step = serve.MLP.step

    async def gated_step(self, rows):
        await gate.wait()
        return await step(self, rows)

    monkeypatch.setattr(serve.MLP, "step", gated_step)
    options = {"max_queue_rows": 8, "max_rows_per_request": 8, "max_wait_seconds": 0.05}
    async with running_server(**options) as (_, port, _):
        gate.clear()
        requests = [
            asyncio.create_task(http(port, "POST", "/predict", body([[1.0] * 16])))
            for _ in range(100)
        ]
        async with asyncio.timeout(30):
            while not any(r.done() and r.result()[0] == 503 for r in requests):
                await asyncio.sleep(0.01)
        gate.set()
        statuses = [s for s, _ in await asyncio.gather(*requests)]
        assert statuses.count(503) > 0 and statuses.count(200) > 0
        assert set(statuses) == {200, 503}
        status, document = await http(port, "POST", "/predict", body([[1.0] * 16]))
        assert status == 200 and len(document["outputs"]) == 1


async def test_requests_larger_than_a_batch_are_answered_in_full():
    # max_batch_size 64, max_rows_per_request 256: a request of 65 or 256 rows is
    # submitted in batch-sized pieces, and answered whole and exactly.
    async with running_server() as (app, port, _):
        rng = np.random.default_rng(3)
        requests = [rng.normal(size=(rows, 16)).tolist() for rows in (64, 65, 200, 256)]
        answers = await asyncio.gather(*(http(port, "POST", "/predict", body(r)) for r in requests))
        for rows, (status, document) in zip(requests, answers, strict=True):
            assert status == 200, document
            outputs = np.array(document["outputs"])
            np.testing.assert_array_equal(outputs, app.state.model.reference(rows))
        status, _ = await http(port, "POST", "/predict", body([[0.0] * 16] * 257))
        assert status == 400


async def _raw_request(port: int, head: str, payload: bytes = b"") -> tuple[int, dict]:
    """``head`` (request line and headers, no blank line) and ``payload`` on one
    connection; the status and JSON body of the reply, read to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    header, _, document = raw.partition(b"\r\n\r\n")
    return int(header.split(b" ", 2)[1]), json.loads(document)


async def test_a_body_too_large_for_a_request_is_refused_unread():
    # The body was read whole, then parsed, before any bound was checked: one of a
    # million rows (66 MB) held about 1 GB and blocked the event loop for 9 s, only to
    # be answered 400 for its row count; one that declared a gigabyte was waited for.
    # max_rows_per_request=8: at most 64 bytes a number, 8192 bytes.
    async with running_server(max_rows_per_request=8) as (app, port, _):
        post = "POST /predict HTTP/1.1\r\nHost: x"
        status, document = await _raw_request(port, f"{post}\r\nContent-Length: {10**9}")
        assert status == 413  # at once, without waiting for (or reading) the body
        assert "the body has 1000000000 bytes; at most 8192 bytes" in document["error"]

        def padded(spaces: int) -> bytes:  # a good request, in a body of some length
            return b'{"inputs": [' + json.dumps([1.0] * 16).encode() + b"]" + b" " * spaces + b"}"

        status, document = await http(port, "POST", "/predict", padded(8192))
        assert status == 413 and f"{len(padded(8192))} bytes; at most 8192" in document["error"]
        chunked = f"{len(padded(8192)):x}\r\n".encode() + padded(8192) + b"\r\n0\r\n\r\n"
        status, document = await _raw_request(
            port, f"{post}\r\nTransfer-Encoding: chunked", chunked
        )
        assert status == 413 and "more than 8192 bytes" in document["error"]
        status, document = await http(port, "POST", "/predict", padded(8192 - 100))  # (fits)
        assert status == 200
        np.testing.assert_array_equal(
            np.array(document["outputs"]), app.state.model.reference([[1.0] * 16])
        )


def test_server_refuses_requests_its_queue_could_never_admit():
    with pytest.raises(ValueError, match=r"max_rows_per_request=256 is above max_queue_rows=100"):
        serve.create_app(cpu_devices(2), max_queue_rows=100)


async def test_client_disconnect_does_not_disturb_others():
    async with running_server(max_wait_seconds=0.01) as (app, port, _):

        async def vanish(complete: bool) -> None:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = body([[1.0] * 16] * 2)
            head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
            writer.write(head.encode() + (payload if complete else payload[:10]))
            await writer.drain()
            writer.close()  # gone before the answer (or mid-body)

        rows = [[float(i)] * 16 for i in range(40)]
        results = await asyncio.gather(
            *(vanish(i % 2 == 0) for i in range(20)),
            *(http(port, "POST", "/predict", body([r])) for r in rows),
        )
        model = app.state.model
        for row, (status, document) in zip(rows, results[20:], strict=True):
            assert status == 200
            np.testing.assert_array_equal(np.array(document["outputs"]), model.reference([row]))


async def test_a_client_gone_mid_body_logs_no_server_error():
    # Starlette raises ClientDisconnect from request.body(); uncaught, it was logged
    # as "Exception in ASGI application" with a traceback, once per such client.
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logger = logging.getLogger("uvicorn.error")
    try:
        async with running_server() as (app, port, _):
            logger.addHandler(handler)  # (after uvicorn configured its logging)
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = body([[1.0] * 16])
            head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
            writer.write(head.encode() + payload[:10])
            await writer.drain()
            writer.close()
            status, document = await http(port, "POST", "/predict", payload)
            assert status == 200
            np.testing.assert_array_equal(
                np.array(document["outputs"]), app.state.model.reference([[1.0] * 16])
            )
        # The server has waited for every request's task when the block ends.
    finally:
        logger.removeHandler(handler)
    assert not errors, [record.getMessage() for record in errors]


async def test_clients_hanging_up_while_queued_free_the_queue():
    # Starlette does not cancel the handler of a client that went away: its rows
    # stayed queued (using up admission) and were computed for nobody (4 queued
    # rows stayed queued; 6 rows computed for 6 clients that had all hung up).
    async with running_server(max_batch_size=1, max_wait_seconds=0) as (app, port, _):
        batcher, gate, rows_run = app.state.batcher, asyncio.Event(), []
        model_step = batcher.step_fn

        async def gated(rows):
            rows_run.append(len(rows))
            await gate.wait()
            return await model_step(rows)

        batcher.step_fn = gated
        payload = body([[1.0] * 16])
        head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
        writers = []
        for _ in range(6):  # two one-row batches in flight (one row each), four queued
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head.encode() + payload)
            writers.append(writer)
        try:
            await wait_until(
                lambda: sum(rows_run) == 2 and batcher.queued_rows == 4, "6 requests in", 100_000
            )
            for writer in writers:
                writer.close()
            await wait_until(lambda: batcher.queued_rows == 0, "queued rows withdrawn", 100_000)
        finally:  # (so that the server can shut down when this fails)
            gate.set()
        status, document = await http(port, "POST", "/predict", payload)
        assert status == 200
        np.testing.assert_array_equal(
            np.array(document["outputs"]), app.state.model.reference([[1.0] * 16])
        )
        assert sum(rows_run) == 3  # the two batches in flight, then the live request


async def test_graceful_shutdown_completes_in_flight_requests():
    async with running_server(max_wait_seconds=0.3) as (app, port, server):
        rows = [[float(i)] * 16 for i in range(10)]
        requests = [asyncio.create_task(http(port, "POST", "/predict", body([r]))) for r in rows]
        await wait_until(lambda: app.state.batcher.queued_rows == 10, "requests queued", 100_000)
        server.should_exit = True  # shutdown starts while they wait for their batch
        answers = await asyncio.gather(*requests)
    assert [status for status, _ in answers] == [200] * 10


STUCK_SERVER = """
import asyncio, sys
sys.path.insert(0, {examples!r})
import serve
step = serve.MLP.step
async def stuck_on_sevens(self, rows):
    if (rows == 7.0).all():
        print("stuck", file=sys.stderr, flush=True)
        await asyncio.Event().wait()
    return await step(self, rows)
serve.MLP.step = stuck_on_sevens
serve.main(["--port", "0", "--devices", "cpu:0,cpu:1", "--shutdown-deadline", "0.5"])
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM is a POSIX signal")
async def test_the_example_server_exits_on_sigterm_with_a_request_stuck():
    # uvicorn runs the lifespan's shutdown (the batcher's stop(deadline)) only once
    # every handler has ended, and waited for them without a bound: a request whose
    # batch never ended (its step stuck) kept the server running after SIGTERM for
    # as long as it was left (still running 20 s after SIGTERM; shutdown_deadline 10).
    import signal

    script = STUCK_SERVER.format(examples=str(ROOT / "examples"))
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(60):
            while b"Uvicorn running on" not in (line := await server.stderr.readline()):
                assert line, "the server ended before it started"
            port = int(line.split(b"http://127.0.0.1:")[1].split()[0])
            stuck = asyncio.create_task(http(port, "POST", "/predict", body([[7.0] * 16])))
            while b"stuck" not in (line := await server.stderr.readline()):
                assert line, "the server ended before the request was stuck"
            server.send_signal(signal.SIGTERM)
            # Up to 0.5 s for the stuck request, then its handler is cancelled (500);
            # the batcher's stop() cancels the stuck batch 0.5 s later.
            await server.stderr.read()
            await server.wait()
            assert (await stuck)[0] == 500
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()
    assert server.returncode in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal)


LOAD = """
import asyncio, json, sys
sys.path.insert(0, {root!r})
from examples.client import http
async def main():
    gate = asyncio.Semaphore({concurrency})
    payload = json.dumps({{"inputs": [[0.1] * 16] * 4}}).encode()
    async def one():
        async with gate:
            return (await http({port}, "POST", "/predict", payload))[0]
    print(json.dumps(await asyncio.gather(*(one() for _ in range({total})))))
asyncio.run(main())
"""


async def _load(port: int, total: int, concurrency: int) -> list[int]:
    """A client in another process (so the server's loop, whose lag is measured, only
    serves): ``total`` requests, ``concurrency`` at a time."""
    script = LOAD.format(root=str(ROOT), port=port, total=total, concurrency=concurrency)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    assert process.returncode == 0
    return json.loads(out)


async def test_event_loop_stays_responsive_under_load():
    loop = asyncio.get_running_loop()
    debug = loop.get_debug()
    loop.set_debug(False)  # measure the loop as it runs in production, not in debug mode
    try:
        await _measure_lag_under_load()
    finally:
        loop.set_debug(debug)


async def _measure_lag_under_load():
    async with running_server() as (_, port, _):
        async with loop_lag() as lateness:
            statuses = await _load(port, 500, 64)
        assert statuses == [200] * 500
        lateness.sort()
        assert len(lateness) > 5
        p95, p99 = (lateness[int(q * (len(lateness) - 1))] for q in (0.95, 0.99))
        median = statistics.median(lateness)
        seen = f"p95 {p95 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, median {median * 1e3:.1f} ms"
        print(f"event-loop lag: {seen}")
        # The loop serves while it computes: half its ticks wake within 10 ms, 95%
        # within 40 ms. (Not counting the time its thread waited for a CPU: see
        # loop_lag.) On a 2-core machine, quiet or with four other processes keeping
        # both cores busy: median 0.0-1.2 ms, p95 0.2-6.2 ms on 2026-11-25's usual
        # host; on 2026-11-25 evening's, 2.5x slower at everything (the benchmarks'
        # floors too), asyncio's runs gave median 0.9-6.4 ms and p95 13-33 ms on
        # unchanged code, failing the earlier bounds (5 ms, 30 ms) in one full suite
        # run of five. A step that blocks the loop 5 ms per replica (time.sleep in
        # examples/serve.py) still fails: median 18.1 ms and p95 45 ms on asyncio,
        # 17.5 and 19 ms on uvloop (the median); with four other processes busy,
        # asyncio's median fell to 0.2 ms, its p95 stayed 45 ms (the p95). A slower
        # host makes a blocked loop's lag longer still.
        assert median < 0.010 and p95 < 0.040, f"event-loop lag: {seen}"


# -- regressions from review -----------------------------------------------------------


async def test_a_request_of_another_width_fails_alone(two):
    # Five good requests and one of width 3 arrive together: the odd one is batched
    # apart, and only its caller gets the step's error.
    batcher = Batcher(two, linear, max_batch_size=8, max_wait_seconds=0.05)
    await batcher.start()
    requests = [np.full((1, 4), float(i)) for i in range(3)] + [np.ones((1, 3))]
    requests += [np.full((1, 4), float(i)) for i in range(3, 5)]
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit(r) for r in requests), return_exceptions=True), 5
    )
    assert isinstance(results[3], ValueError)
    for request, result in zip(requests[:3] + requests[4:], results[:3] + results[4:], strict=True):
        np.testing.assert_array_equal(result, request @ W)
    await batcher.stop()


async def test_a_requests_dtype_does_not_depend_on_what_it_is_batched_with(two):
    async def double(rows):
        return rows * 2

    batcher = Batcher(two, double, max_batch_size=8, max_wait_seconds=0.05)
    await batcher.start()
    alone = await batcher.submit(np.array([[1, 2]]))
    together = await asyncio.gather(
        batcher.submit(np.array([[1, 2]])),
        batcher.submit(np.array([[0.5, 1.5]])),
        batcher.submit(np.array([["x", "y"]])),
        batcher.submit(np.array([[3, 4]])),
        return_exceptions=True,
    )
    assert alone.dtype == together[0].dtype == together[3].dtype == np.int64
    np.testing.assert_array_equal(together[0], [[2, 4]])
    np.testing.assert_array_equal(together[1], [[1.0, 3.0]])
    assert together[1].dtype == np.float64
    assert isinstance(together[2], TypeError)  # the step fails for strings: theirs only
    np.testing.assert_array_equal(together[3], [[6, 8]])
    await batcher.stop()


async def test_each_request_gets_its_rows_in_the_dtype_the_step_computed_them_in(two):
    # Replicas' outputs of different dtypes were joined by np.concatenate, which
    # promoted every caller's rows: an int64 id above 2**53 came back as a rounded
    # float64 because another request of its batch held a NaN; int32 and uint32
    # outputs both came back as int64.
    big = 2**53 + 1

    async def ids(rows):  # exact int64 ids, or float64 with NaN for an unknown row
        if np.isnan(rows).any():
            return np.where(np.isnan(rows[:, :1]), np.nan, float(big))
        return np.full((len(rows), 1), big, dtype=np.int64)

    batcher = Batcher(two, ids, max_batch_size=8, max_wait_seconds=0.05)
    await batcher.start()
    known, unknown = await asyncio.gather(
        batcher.submit(np.ones((1, 2))), batcher.submit(np.full((1, 2), np.nan))
    )
    assert known.dtype == np.int64 and known.tolist() == [[big]]
    assert unknown.dtype == np.float64 and np.isnan(unknown).all()

    async def by_replica(rows):  # int32 on replica 0's rows, uint32 on replica 1's
        replica = aiodist.get_replica_context().replica_id_in_sync_group
        return (rows * 2).astype(np.int32 if replica == 0 else np.uint32)

    batcher.step_fn = by_replica
    first, second = await asyncio.gather(
        batcher.submit(np.array([[1]])), batcher.submit(np.array([[2]]))
    )
    assert (first.dtype, first.tolist()) == (np.int32, [[2]])
    assert (second.dtype, second.tolist()) == (np.uint32, [[4]])
    # Three rows: two on replica 0, one on replica 1. The second request's rows were
    # computed in two dtypes: it alone is refused, naming them; the first is served.
    first, split = await asyncio.gather(
        batcher.submit(np.array([[1]])),
        batcher.submit(np.array([[2], [3]])),
        return_exceptions=True,
    )
    assert (first.dtype, first.tolist()) == (np.int32, [[2]])
    assert isinstance(split, aiodist.InvalidArgumentError)
    assert "(int32 on replica 0, uint32 on replica 1)" in str(split)
    await batcher.stop()


async def test_a_request_failing_alone_in_a_served_batch_is_counted_as_failed(two):
    # A request whose rows were split across replicas of different dtypes got an
    # error while its batch was served, and no counter of stats() showed it: a
    # dashboard saw requests 1, failed 0 for one answer and one error.
    async def by_replica(rows):  # int32 on replica 0's rows, uint32 on replica 1's
        replica = aiodist.get_replica_context().replica_id_in_sync_group
        return (rows * 2).astype(np.int32 if replica == 0 else np.uint32)

    batcher = Batcher(two, by_replica, max_batch_size=8, max_wait_seconds=0.05)
    await batcher.start()
    served, split = await asyncio.gather(
        batcher.submit(np.array([[1]])),
        batcher.submit(np.array([[2], [3]])),
        return_exceptions=True,
    )
    await batcher.stop()
    assert served.tolist() == [[2]] and isinstance(split, aiodist.InvalidArgumentError)
    stats = batcher.stats()
    assert (stats.requests, stats.batches, stats.failed, stats.failed_requests) == (1, 1, 0, 1)
    assert stats.as_dict()["failed_requests"] == 1


async def test_stop_refuses_a_bad_deadline_and_keeps_serving(two):
    batcher = Batcher(two, linear, max_wait_seconds=0)
    await batcher.start()
    for bad in (None, -5, math.nan, "1"):
        with pytest.raises(aiodist.InvalidArgumentError, match=rf"deadline={bad!r}; expected"):
            await batcher.stop(bad)
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop(0)


async def test_start_during_stop_waits_for_it_then_serves(two):
    batcher, stuck = await _stuck_batch(two)
    stopping = asyncio.create_task(batcher.stop(deadline=0.05))
    await asyncio.sleep(0)  # stop() has begun draining
    assert not stopping.done()
    batcher.step_fn = linear
    await batcher.start()
    assert stopping.done()
    with pytest.raises(NotServing):
        await stuck
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop()


async def test_two_stops_at_once_both_wait_for_the_drain(two):
    batcher, stuck = await _stuck_batch(two)
    stops = [asyncio.create_task(batcher.stop(deadline=0.05)) for _ in range(2)]
    await asyncio.sleep(0)
    assert not any(stop.done() for stop in stops)  # the second waits for the first
    await asyncio.gather(*stops)
    with pytest.raises(NotServing):
        await stuck
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("aiodist-")]
    batcher.step_fn = linear
    await batcher.start()
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop()


async def test_a_restart_after_a_cancelled_stop_keeps_one_batch_in_flight():
    # A batch cancelled by stop() is still cleaning up when stop() is itself cancelled
    # and the batcher restarts; when that batch ends it must free its own slot, not
    # one of the new batcher's.
    cleaning_up, cleaned = asyncio.Event(), asyncio.Event()
    in_flight = [0, 0]  # batches now, most at once

    async def step(rows):  # (one replica: one step per batch)
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        try:
            await asyncio.sleep(0.01 if cleaned.is_set() else 3600)
        except asyncio.CancelledError:
            cleaning_up.set()
            await cleaned.wait()
            raise
        finally:
            in_flight[0] -= 1
        return rows

    one = aiodist.MirroredStrategy(cpu_devices(1))
    batcher = Batcher(one, step, max_batch_size=2, max_wait_seconds=0, max_batches_in_flight=1)
    await batcher.start()
    first = asyncio.create_task(batcher.submit(np.ones((2, 1))))
    await wait_until(lambda: in_flight[0], "first batch running")
    stopping = asyncio.create_task(batcher.stop(deadline=10))
    await asyncio.sleep(0)  # stop() waits for the batch...
    stopping.cancel()  # ...and is cancelled (a shutdown timeout): it cancels the batch
    await asyncio.gather(stopping, return_exceptions=True)
    await cleaning_up.wait()
    await batcher.start()
    cleaned.set()
    with pytest.raises(NotServing):
        await first
    in_flight[1] = 0
    await asyncio.gather(*(batcher.submit(np.ones((2, 1))) for _ in range(6)))
    assert in_flight[1] == 1
    await batcher.stop()


async def test_queued_rows_stay_right_when_stop_and_callers_are_cancelled_together(two):
    batcher, gate, ran, running, queued = await _one_batch_running_one_queued(two, 4)
    stopping = asyncio.create_task(batcher.stop(deadline=10))
    await asyncio.sleep(0)
    for task in (stopping, running, queued):  # a shutdown cancels everything at once
        task.cancel()
    await asyncio.gather(stopping, running, queued, return_exceptions=True)
    assert batcher.queued_rows == 0  # not -4: a stopped request is not uncounted twice
    gate.set()
    await batcher.start()
    gate.clear()
    ran.clear()
    first = asyncio.create_task(batcher.submit(np.ones((4, 1))))
    await wait_until(lambda: ran, "the first batch after the restart runs")
    admitted = [asyncio.create_task(batcher.submit(np.ones((4, 1)))) for _ in range(2)]
    await asyncio.sleep(0)
    assert isinstance(admitted[1].exception(), Overloaded)  # 4 rows wait: no more
    assert batcher.queued_rows == 4
    gate.set()
    await asyncio.gather(first, admitted[0])
    await batcher.stop()


async def test_fewer_rows_than_replicas_with_a_step_that_changes_rank_on_no_rows():
    async def per_row(rows):  # 0 rows give shape (0,), not (0, 3)
        return np.array([row @ W for row in rows])

    batcher = Batcher(aiodist.MirroredStrategy(cpu_devices(4)), per_row, max_wait_seconds=0)
    await batcher.start()
    for size in (1, 3, 4, 5):
        rows = np.arange(size * 4.0).reshape(size, 4)
        np.testing.assert_array_equal(await batcher.submit(rows), rows @ W)
    await batcher.stop()


async def test_a_step_failing_on_no_rows_says_that_replicas_had_none(two):
    # A one-row request on two replicas gives replica 1 no rows; a step that stacks
    # its rows then raised NumPy's bare "need at least one array to stack", only at
    # light traffic, with nothing saying that a replica had been given no rows.
    async def stacked(rows):
        return np.stack([row * 2 for row in rows])

    batcher = Batcher(two, stacked, max_wait_seconds=0)
    await batcher.start()
    np.testing.assert_array_equal(await batcher.submit(np.ones((2, 3))), np.full((2, 3), 2.0))
    with pytest.raises(ValueError, match="need at least one array to stack") as raised:
        await batcher.submit(np.ones((1, 3)))
    assert raised.value.__notes__ == [
        "(raised in replica 1 of 2, on /device:CPU:1, by strategy.run)",
        "aiodist Batcher: this batch had 1 row for 2 replicas, so replica 1 ran the step on "
        "no rows (shape (0, 3)); if it fails there, make it return no rows for them (e.g. "
        "np.empty((0, width))).",
    ]
    await batcher.stop()


async def test_a_step_skipping_a_collective_on_no_rows_says_that_replicas_had_none(two):
    # A replica given no rows (a one-row request on two replicas) whose step returned
    # early, skipping the all_reduce the other made: every caller got the bare
    # "all_reduce #0: replica 1 returned without calling it", only at light traffic,
    # with nothing saying that replica 1 had been given no rows (aiodist's errors
    # were left without the note).
    async def normalised(rows):
        if len(rows) == 0:
            return rows
        total = await aiodist.get_replica_context().all_reduce("sum", rows.sum())
        return rows / total

    batcher = Batcher(two, normalised, max_wait_seconds=0)
    await batcher.start()
    np.testing.assert_array_equal(await batcher.submit(np.ones((2, 3))), np.full((2, 3), 1 / 6))
    with pytest.raises(aiodist.ReplicaExitedError, match="replica 1 returned") as raised:
        await batcher.submit(np.ones((1, 3)))
    assert raised.value.__notes__ == [
        "aiodist Batcher: this batch had 1 row for 2 replicas, so replica 1 ran the step on "
        "no rows (shape (0, 3)); if it fails there, make it return no rows for them (e.g. "
        "np.empty((0, width))), after the same collective calls as the replicas with rows "
        "make.",
    ]
    await batcher.stop()


def _replica_id() -> int:
    return aiodist.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("caller", ["step", "merge_fn", "warm-up"])
async def test_stop_called_inside_a_batch_it_serves_is_refused_not_a_deadlock(two, caller):
    # stop() waits for the batches in flight: called by a step (or by a merge_fn that
    # a step awaits), it waited for its own batch, which waited for it, for ever (past
    # its deadline too: the batch it then cancelled waited for its replicas, this
    # one among them). A task that the step starts and does not await may stop it.
    batcher: Batcher

    async def stop_batcher(strategy=None):
        await batcher.stop(deadline=0.1)

    async def step(rows):  # rows of ones stop the batcher; others are served
        if (rows == 1).all():
            if caller == "merge_fn":
                await aiodist.get_replica_context().merge_call(stop_batcher)
            elif _replica_id() == 0:
                await stop_batcher()
        return rows

    batcher = Batcher(two, step, max_wait_seconds=0)
    where = "a merge_fn the step called" if caller == "merge_fn" else "replica 0's step"
    refused = rf"Batcher.stop\(\) was called from inside a batch it serves \({where}\): .* wait "
    async with asyncio.timeout(10):
        if caller == "warm-up":
            with pytest.raises(aiodist.ContextError, match=refused):
                await batcher.start(warmup_rows=np.ones((2, 3)))
            return
        await batcher.start()
        with pytest.raises(aiodist.ContextError, match=refused):
            await batcher.submit(np.ones((2, 3)))
        # Still serving; a task the step starts (and does not await) stops it.
        served = np.full((2, 3), 2.0)
        np.testing.assert_array_equal(await batcher.submit(served), served)
        await batcher.stop()
        stopping = []

        async def step_that_stops(rows):
            if _replica_id() == 0 and not stopping:
                stopping.append(asyncio.create_task(other.stop()))
            return rows

        other = Batcher(two, step_that_stops, max_wait_seconds=0)
        await other.start()
        np.testing.assert_array_equal(await other.submit(np.ones((2, 3))), np.ones((2, 3)))
        await stopping[0]
        with pytest.raises(NotServing):
            await other.submit(np.ones((1, 3)))


async def test_the_batcher_and_its_stats_show_their_state(two):
    # Both showed only "<aiodist._batcher.BatcherStats object at 0x...>".
    batcher, gate, running, queued = await _full_queue(two, 2, 2, [2, 2])
    assert repr(batcher) == (
        "<Batcher serving: 4 rows queued, 1 batch in flight; step "
        "_full_queue.<locals>.gated, max_batch_size=2>"
    )
    gate.set()
    await asyncio.gather(running, *queued)
    await batcher.stop()
    assert repr(batcher).startswith("<Batcher not serving: 0 rows queued, 0 batches in flight")
    stats = BatcherStats(3, 2, 5, 1, 0, [0.002, 0.004, 0.010], failed_requests=1)
    assert repr(stats) == (
        "BatcherStats(requests=3, batches=2, rows=5, mean_batch_size=2.5, rejected=1, "
        "failed=0, failed_requests=1, latency: p50 4.0 ms, p90 10.0 ms, p99 10.0 ms)"
    )


def test_latency_percentiles_are_nearest_rank():
    stats = BatcherStats(10, 1, 10, 0, 0, [i / 1000 for i in range(10, 0, -1)])
    assert stats.latency_seconds == {"p50": 0.005, "p90": 0.009, "p99": 0.010}
    assert BatcherStats(0, 0, 0, 0, 0, []).latency_seconds["p50"] == 0.0
    assert BatcherStats(1, 1, 1, 0, 0, [0.002]).latency_seconds["p99"] == 0.002


async def test_cancelled_queued_rows_free_admission_at_once(two):
    batcher, gate, running, (queued,) = await _full_queue(two, 4, 1, [4])
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert batcher.queued_rows == 0
    admitted = asyncio.create_task(batcher.submit(np.ones((2, 1))))  # not Overloaded
    gate.set()
    await running
    np.testing.assert_array_equal(await admitted, np.ones((2, 1)))
    await batcher.stop()


async def test_oversized_request_is_invalid_not_overloaded(two):
    batcher = Batcher(two, linear, max_queue_rows=8)
    await batcher.start()
    with pytest.raises(aiodist.InvalidArgumentError, match=r"10 rows can never be admitted"):
        await batcher.submit(np.ones((10, 4)))
    await batcher.stop()


async def test_rows_of_different_lengths_are_invalid_naming_them(two):
    """np.asarray's ValueError ("setting an array element with a sequence. The
    requested array has an inhomogeneous shape ...") reached the caller as it was."""
    batcher = Batcher(two, linear)
    await batcher.start()
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"submit: rows=\[\[1.0, 2.0, 3.0, 4.0\], \[1.0\]\] is not one array "
        r".*every row of one length",
    ):
        await batcher.submit([[1.0, 2.0, 3.0, 4.0], [1.0]])
    assert batcher.queued_rows == 0
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop()


async def test_bad_warm_up_rows_are_invalid_like_a_requests(two):
    """start() ran the warm-up without checking it: no rows failed in NumPy ("need at
    least one array to concatenate"), ragged rows with NumPy's words, and a scalar
    (aiohttp's on_startup passes the app) was blamed on experimental_distribute_dataset."""
    batcher = Batcher(two, linear)
    for bad, message in (
        (np.zeros((0, 4)), r"start: warmup_rows of shape \(0, 4\); expected a 2-D array"),
        (np.zeros(4), r"start: warmup_rows of shape \(4,\); expected a 2-D array"),
        (5, r"start: warmup_rows=5 is not an array of rows; expected a 2-D array"),
        ({"app": 1}, r"start: warmup_rows=\{'app': 1\} is not an array of rows"),
        ([[1.0, 2.0], [3.0]], r"start: warmup_rows=\[\[1.0, 2.0\], \[3.0\]\] is not one array"),
    ):
        with pytest.raises(aiodist.InvalidArgumentError, match=message):
            await batcher.start(bad)
        with pytest.raises(NotServing):  # refused before anything started
            await batcher.submit(np.ones((1, 4)))
    await batcher.start(np.zeros((1, 4)))
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop()


async def test_a_batcher_left_serving_on_a_closed_loop_serves_on_this_one(two):
    # A test that never reached stop(): the next test's loop must not hang in submit.
    batcher = Batcher(two, linear)

    async def on_another_loop():
        await batcher.start(np.zeros((2, 4)))
        return await batcher.submit(np.ones((1, 4)))

    assert (await asyncio.to_thread(asyncio.run, on_another_loop())).shape == (1, 3)
    with pytest.raises(NotServing, match="started on another event loop"):
        await asyncio.wait_for(batcher.submit(np.ones((1, 4))), 5)
    await asyncio.wait_for(batcher.start(np.zeros((2, 4))), 5)
    rows = np.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(await asyncio.wait_for(batcher.submit(rows), 5), rows @ W)
    await batcher.stop()
    with pytest.raises(NotServing, match="not accepting"):
        await batcher.submit(rows)


async def test_a_batching_task_cancelled_without_stop_answers_and_restarts(two):
    # Code that cancels every task (a framework's shutdown, a test's cleanup) cancelled
    # the batching task: the queued caller then waited forever, as did every later
    # submit, and start() returned at once without starting a new task.
    batcher = Batcher(two, linear, max_wait_seconds=3600)
    await batcher.start()
    queued = asyncio.create_task(batcher.submit(np.ones((1, 4))))
    await wait_until(lambda: batcher.queued_rows == 1, "a request queued")
    (batching,) = [t for t in asyncio.all_tasks() if t.get_name() == "aiodist-batcher"]
    batching.cancel()
    with pytest.raises(NotServing, match=r"batching task was cancelled without stop\(\)"):
        await asyncio.wait_for(queued, 5)
    assert batcher.queued_rows == 0
    with pytest.raises(NotServing, match=r"batching task was cancelled without stop\(\); call"):
        await asyncio.wait_for(batcher.submit(np.ones((1, 4))), 5)
    batcher.max_wait_seconds = 0
    await asyncio.wait_for(batcher.start(), 5)
    np.testing.assert_array_equal(await batcher.submit(np.ones((1, 4))), np.ones((1, 4)) @ W)
    await batcher.stop()
    with pytest.raises(NotServing, match="not accepting requests"):
        await batcher.submit(np.ones((1, 4)))


async def test_concurrent_starts_make_one_batching_loop(two):
    batcher = Batcher(two, linear)
    await asyncio.gather(batcher.start(np.zeros((1, 4))), batcher.start(np.zeros((1, 4))))
    loops = [t for t in asyncio.all_tasks() if t.get_name() == "aiodist-batcher"]
    assert len(loops) == 1
    await batcher.stop()


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--max-batch-size", "0"], "--max-batch-size=0; expected at least 1"),
        (["--max-wait-ms", "-1"], "--max-wait-ms=-1.0; expected a finite number >= 0"),
        (["--max-wait-ms", "nan"], "--max-wait-ms=nan"),
        (["--devices", "tpu:0"], "--devices='tpu:0': "),
        (["--shutdown-deadline", "-1"], "--shutdown-deadline=-1.0; expected a finite number"),
    ],
)
def test_the_example_servers_bad_flags_are_usage_errors(flags, text, capsys):
    # They ended in a traceback naming create_app's argument, not the flag.
    assert_usage_error(serve.main, flags, text, capsys)


async def test_a_full_queue_smaller_than_a_batch_runs_without_waiting(two):
    # max_queue_rows < max_batch_size: once the queue is full no request can join,
    # so the batch runs at once; it waited the whole max_wait_seconds.
    batcher = Batcher(two, linear, max_batch_size=8, max_queue_rows=4, max_wait_seconds=30)
    await batcher.start()
    rows = np.ones((4, 4))
    np.testing.assert_array_equal(await asyncio.wait_for(batcher.submit(rows), 5), rows @ W)
    await batcher.stop()


async def test_failed_requests_leave_no_cyclic_garbage(two):
    """A server answering errors (a step that raises, a request refused after its
    batch ran, a batcher stopping) must not make each failed caller a reference
    cycle: the error's traceback holds the frames that raised it, which must not
    hold the futures the error is set on."""

    async def step(rows):
        if (rows < 0).any():
            raise ArithmeticError("negative input")
        replica = aiodist.get_replica_context().replica_id_in_sync_group
        return (rows * 2).astype(np.int32 if replica == 0 else np.uint32)

    batcher = Batcher(two, step, max_batch_size=8, max_wait_seconds=0.001)
    await batcher.start()

    async def step_raises():
        await asyncio.gather(
            *(batcher.submit(np.full((1, 1), -1)) for _ in range(3)), return_exceptions=True
        )

    async def split_over_two_dtypes():  # two rows on replica 0, one on replica 1
        _, split = await asyncio.gather(
            batcher.submit(np.array([[1]])),
            batcher.submit(np.array([[2], [3]])),
            return_exceptions=True,
        )
        assert isinstance(split, aiodist.InvalidArgumentError)

    for case in (step_raises, split_over_two_dtypes):
        await assert_no_cyclic_garbage(case, warm_up=3, repeats=10)
    await batcher.stop()
