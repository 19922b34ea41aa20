"""Regressions from review: consumers of a distributed dataset never wait forever."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import warnings
import weakref

import numpy as np
import pytest

import aiodist
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(10)


async def test_next_after_aclose_ends_instead_of_hanging(two):
    iterator = aiter(two.experimental_distribute_dataset(np.arange(2) for _ in range(100)))
    await anext(iterator)
    await iterator.aclose()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(iterator), 2)


async def test_aclose_ends_a_plain_iteration_and_closes_its_source(two):
    closed = []

    def source():
        try:
            for i in range(100):
                yield np.full(2, i)
        finally:
            closed.append(True)

    iterator = iter(two.experimental_distribute_dataset(source()))
    next(iterator)
    await iterator.aclose()
    assert closed == [True]
    with pytest.raises(StopIteration):
        next(iterator)


async def test_source_raising_cancelled_error_reaches_the_consumer(two):
    def source():
        yield np.arange(2)
        raise asyncio.CancelledError()  # a source bug, not a cancellation of ours

    iterator = aiter(two.experimental_distribute_dataset(source()))
    await anext(iterator)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(anext(iterator), 2)


async def test_concurrent_consumers_of_one_iterator_all_finish(two):
    async def source():
        for i in range(6):
            await asyncio.sleep(0)
            yield np.full(2, i)

    iterator = aiter(two.experimental_distribute_dataset(source()))
    counts = {"a": 0, "b": 0}

    async def consume(name):
        async for _ in iterator:
            counts[name] += 1

    await asyncio.wait_for(asyncio.gather(consume("a"), consume("b")), 5)
    assert counts["a"] + counts["b"] == 6


def test_from_function_checks_options(two):
    with pytest.raises(ValueError, match=r"options=\{\}; expected aiodist.InputOptions"):
        two.distribute_datasets_from_function(lambda ctx: [], options={})


class _CountsOpens:
    """An iterable (like a data loader) that counts how often it is opened."""

    def __init__(self):
        self.opened = 0

    def __iter__(self):
        self.opened += 1
        return iter([np.arange(4.0), np.arange(4.0, 8.0)])


@pytest.mark.parametrize("how", ["dataset", "from_function", "from_function_per_replica"])
async def test_distributing_a_dataset_opens_it_only_when_iterated(two, how):
    import aiodist

    sources = []

    def dataset_fn(context):
        sources.append(_CountsOpens())
        return sources[-1]

    if how == "dataset":
        sources.append(_CountsOpens())
        dataset = two.experimental_distribute_dataset(sources[0])
    else:
        mode = aiodist.InputReplicationMode.PER_REPLICA if how.endswith("replica") else None
        options = None if mode is None else aiodist.InputOptions(experimental_replication_mode=mode)
        dataset = two.distribute_datasets_from_function(dataset_fn, options)
    assert [source.opened for source in sources] == [0] * len(sources)
    batches = [batch async for batch in dataset]
    # PER_WORKER (from_function) gives each replica an element of its own.
    assert len(batches) == (1 if how == "from_function" else 2)
    assert [source.opened for source in sources] == [1] * len(sources)


def _producers() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_Pipeline._produce"]


async def test_aclose_before_the_producer_first_runs_ends_a_waiting_consumer(two):
    """aclose() in the loop step in which a consumer opened the pipeline: the
    producer, cancelled before its first step, never ran its ``finally``, so the
    consumer waited forever."""
    source = (np.full(2, i) for i in range(100))
    iterator = aiter(two.experimental_distribute_dataset(source))
    consumer = asyncio.create_task(anext(iterator))
    await asyncio.sleep(0)  # the consumer opens the pipeline and waits for a batch
    await iterator.aclose()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(consumer, 2)
    assert not _producers()
    assert source.gi_frame is None  # closed


@pytest.mark.parametrize("first", [True, False], ids=["after-first", "before-first"])
async def test_aclose_is_final_and_drops_batches_fetched_ahead(two, first):
    options = aiodist.InputOptions(experimental_per_replica_buffer_size=3)
    batches = [np.full(2, i) for i in range(10)]
    iterator = aiter(two.experimental_distribute_dataset(batches, options))
    if first:
        await anext(iterator)
        for _ in range(10):  # the producer fetches ahead
            await asyncio.sleep(0)
    await iterator.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(iterator)
    assert not _producers()


@pytest.mark.parametrize("how", ["for", "async for"])
async def test_shards_every_source_shares_are_still_per_replica(two, how):
    """PER_REPLICA sources yielding the same objects (one batch repeated): a plain
    ``for`` gave the bare array (one local result, not reducible with SUM)."""
    batch, weights = np.ones((2, 3)), np.arange(2.0)
    options = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")

    def dataset_fn(context):
        own = np.full(2, float(context.input_pipeline_id))
        return [(batch, {"own": own, "weights": weights})] * 2

    dataset = two.distribute_datasets_from_function(dataset_fn, options)
    elements = [e for e in dataset] if how == "for" else [e async for e in dataset]
    assert len(elements) == 2
    x, extra = elements[0]
    for value, expected in ((x, batch), (extra["weights"], weights)):
        assert isinstance(value, aiodist.PerReplica)
        for got in two.experimental_local_results(value):
            np.testing.assert_array_equal(got, expected)
    own = two.experimental_local_results(extra["own"])
    assert [float(o[0]) for o in own] == [0.0, 1.0]
    np.testing.assert_array_equal(await two.reduce("sum", x, axis=None), 2 * batch)


def test_an_async_value_fn_is_refused_at_the_call(two):
    """An ``async def value_fn`` gave a PerReplica of never-awaited coroutines,
    failing later, somewhere else (and warning "never awaited")."""

    async def value_fn(context):
        return np.full(2, context.replica_id_in_sync_group)

    with pytest.raises(aiodist.InvalidArgumentError, match=r"value_fn=.* returned an awaitable"):
        two.experimental_distribute_values_from_function(value_fn)


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
def test_an_async_dataset_fn_is_refused_naming_the_remedy(two, mode):
    async def dataset_fn(context):
        return [np.arange(4.0)]

    options = aiodist.InputOptions(experimental_replication_mode=mode)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"returned an awaitable.*not async def"):
        two.distribute_datasets_from_function(dataset_fn, options)


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
async def test_from_function_elements_need_no_batch_axis_unless_one_is_padded(two, mode):
    """distribute_datasets_from_function batches and splits nothing (as TF), so an
    element may hold rank-0 values; only an empty batch for a replica whose source
    ran out needs axis 0. Every such element was refused as a "global batch"."""
    options = aiodist.InputOptions(experimental_replication_mode=mode)

    def dataset_fn(context):
        return [{"x": np.ones((2, 1)), "step": np.int64(i)} for i in range(4)]

    dataset = two.distribute_datasets_from_function(dataset_fn, options)
    steps = [[int(s) for s in two.experimental_local_results(e["step"])] async for e in dataset]
    assert steps == ([[0, 1], [2, 3]] if mode == "PER_WORKER" else [[i, i] for i in range(4)])

    def uneven(context):
        return [np.float32(i) for i in range(3 if context.input_pipeline_id == 0 else 1)]

    dataset = two.distribute_datasets_from_function(uneven, options)
    with pytest.raises(aiodist.InvalidArgumentError, match=r"rank-0 .* gets an empty batch"):
        [e async for e in dataset]


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
@pytest.mark.parametrize("how", ["async for", "for"])
async def test_from_function_refuses_an_element_that_is_none(two, mode, how):
    """None also meant "this replica's source ran out": an element that was None
    raised "RuntimeError: coroutine raised StopIteration" (PER_WORKER), or became an
    empty batch, or ended the iteration when every replica's was None (PER_REPLICA)."""
    options = aiodist.InputOptions(experimental_replication_mode=mode)

    def dataset_fn(context):
        if mode == "PER_WORKER":  # the second step's element for replica 0
            return [np.ones(2), np.ones(2), None, np.ones(2)]
        if context.input_pipeline_id == 1:  # replica 1's second element
            return [np.ones(2), None, np.ones(2)]
        return [np.ones(2)] * 3

    dataset = two.distribute_datasets_from_function(dataset_fn, options)
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"yielded None \(the element for local replica \d\); expected an element",
    ):
        if how == "for":
            list(dataset)
        else:
            [batch async for batch in dataset]
    for everyones_none in ([None, None], [None]):
        dataset = two.distribute_datasets_from_function(lambda c, e=everyones_none: e, options)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"yielded None"):
            [batch async for batch in dataset]


async def test_aclose_raises_what_closing_the_source_raised(two):
    """aclose() waited for the producer with gather(return_exceptions=True) and
    dropped the error of the source's own cleanup."""
    failure = OSError("could not release the reader")

    async def source():
        try:
            for i in range(10):
                yield np.full(2, i)
        finally:
            raise failure

    with pytest.raises(OSError) as info:
        async with aiter(two.experimental_distribute_dataset(source())) as iterator:
            await anext(iterator)
    assert info.value is failure
    await iterator.aclose()  # once: a second aclose() has nothing more to report
    assert not _producers()


async def test_aclose_raises_what_the_source_raised_when_stopped_while_fetching(two):
    """aclose() while the producer waits inside the source for the next batch (a
    slow loader): the source's cleanup raised from that fetch, and the error was
    queued behind the end that aclose() had pushed, where no consumer reads it."""
    failure = OSError("could not release the reader")
    fetching = asyncio.Event()

    async def source():
        try:
            yield np.zeros(2)
            fetching.set()
            await asyncio.Event().wait()  # the next batch never comes
            yield np.ones(2)
        finally:
            raise failure

    iterator = aiter(two.experimental_distribute_dataset(source()))
    await anext(iterator)
    await fetching.wait()
    with pytest.raises(OSError) as info:
        await iterator.aclose()
    assert info.value is failure
    await iterator.aclose()
    assert not _producers()


def test_distribute_dataset_refuses_per_replica_mode_as_tf_does(two):
    """PER_REPLICA (and place_dataset_on_device, which needs it) was silently
    ignored: each global batch was still split across the replicas."""
    per_replica = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")
    on_device = aiodist.InputOptions(
        experimental_replication_mode="PER_REPLICA",
        experimental_place_dataset_on_device=True,
        experimental_fetch_to_device=False,
    )
    for options in (per_replica, on_device):
        with pytest.raises(
            aiodist.InvalidArgumentError, match=r"PER_REPLICA is only for distribute_datasets_from"
        ):
            two.experimental_distribute_dataset([np.arange(4.0)], options)
    two.distribute_datasets_from_function(lambda context: [np.arange(2.0)], per_replica)


@pytest.mark.parametrize("how", ["async for", "for"])
async def test_aclose_closes_every_replicas_source_when_one_fails_to_close(three, how):
    """PER_REPLICA: closing replica 0's source raised, and the sources after it
    were left open (replicas 1 and 2's readers never released)."""
    failure = OSError("could not release reader 0")
    closed = []

    def dataset_fn(context):
        def source():
            try:
                for i in range(10):
                    yield np.full(2, i)
            finally:
                closed.append(context.input_pipeline_id)
                if context.input_pipeline_id == 0:
                    raise failure

        return source()

    options = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")
    dataset = three.distribute_datasets_from_function(dataset_fn, options)
    iterator = aiter(dataset) if how == "async for" else iter(dataset)
    if how == "async for":
        await anext(iterator)
    else:
        next(iterator)
    with pytest.raises(OSError) as info:
        await iterator.aclose()
    assert info.value is failure
    assert sorted(closed) == [0, 1, 2]
    assert not _producers()


def test_an_iterator_dropped_after_its_loop_closed_raises_nothing(two, monkeypatch):
    """A loop closed without cancelling its tasks (run_until_complete, then close),
    the iterator dropped later: its __del__ cancelled the producer on the closed
    loop, and Python printed "Exception ignored ... RuntimeError: Event loop is
    closed"."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    kept = []

    async def main():
        iterator = aiter(two.experimental_distribute_dataset(np.full(2, i) for i in range(100)))
        await anext(iterator)
        kept.append(iterator)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()  # the producer is left pending (asyncio reports that itself)
    kept.clear()
    gc.collect()
    assert [u.exc_value for u in unraisable if u.exc_type is RuntimeError] == []


@pytest.mark.parametrize("where", ["outside the loop", "inside the loop"])
def test_an_iterator_dropped_on_a_loop_never_closed_lets_the_loop_be_freed(two, where, monkeypatch):
    """A loop stopped and never closed (run_until_complete, no close), with the
    producer of a dropped iterator still pending on it: a module-level set of
    running producers held that task, and through it the loop (and the source),
    for ever; asyncio itself lets such a loop go with its pending tasks. (asyncio
    only: a uvloop loop never closed is never freed, producers or not.)"""
    kept, reported, unraisable = [], [], []
    # (asyncio warns of the loop and its sockets left unclosed as they are freed)
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    async def main():
        iterator = aiter(two.experimental_distribute_dataset(np.full(2, i) for i in range(100)))
        await anext(iterator)
        if where == "outside the loop":
            kept.append(iterator)
        # else dropped here: cancelled, but the loop stops before that runs

    loop = asyncio.new_event_loop()
    # (where asyncio reports the producer freed pending, as it reports any task)
    loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))
    loop.run_until_complete(main())
    freed = weakref.ref(loop)
    del loop
    kept.clear()
    gc.collect()
    assert freed() is None
    assert [u.exc_type for u in unraisable if u.exc_type is not ResourceWarning] == []


class _Reader:
    """An iterator holding a resource until closed (an open file, a loader's
    worker), sync or async; ``log`` records its opening and closing."""

    def __init__(self, replica, log):
        self.replica, self.log = replica, log
        log.append(("open", replica))

    def __iter__(self):
        return self

    def __next__(self):
        return np.full(2, float(self.replica))

    def close(self):
        self.log.append(("close", self.replica))


class _AsyncReader(_Reader):
    def __aiter__(self):
        return self

    async def __anext__(self):
        return np.full(2, float(self.replica))

    async def aclose(self):
        await asyncio.sleep(0)  # releasing it takes a loop step (a connection, ...)
        self.log.append(("close", self.replica))

    __iter__ = __next__ = close = None  # async only


class _Opens:
    """An iterable whose ``iter()`` opens a reader (replica 2's raises)."""

    reader = _Reader

    def __init__(self, replica, log):
        self.replica, self.log = replica, log

    def __iter__(self):
        if self.replica == 2:
            raise OSError("cannot open shard 2")
        return self.reader(self.replica, self.log)


class _AsyncOpens(_Opens):
    reader = _AsyncReader
    __aiter__ = _Opens.__iter__
    __iter__ = None


@pytest.mark.parametrize(
    "how", ["dataset_fn raises", "not iterable", "iter raises", "aiter raises", "for, iter raises"]
)
async def test_sources_opened_for_replicas_are_closed_when_another_cannot_open(three, how):
    """PER_REPLICA: when calling dataset_fn for replica 2 (or opening its source,
    iter()) raised, the readers already opened for replicas 0 and 1 were left
    open, by nobody's hand."""
    log = []
    options = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")

    def dataset_fn(context):
        replica = context.input_pipeline_id
        if how == "dataset_fn raises":
            if replica == 2:
                raise OSError("cannot open shard 2")
            return _Reader(replica, log)
        if how == "not iterable":
            return 42 if replica == 2 else _Reader(replica, log)
        return (_AsyncOpens if how == "aiter raises" else _Opens)(replica, log)

    if how in ("dataset_fn raises", "not iterable"):
        with pytest.raises(OSError if how == "dataset_fn raises" else aiodist.InvalidArgumentError):
            three.distribute_datasets_from_function(dataset_fn, options)
    else:
        dataset = three.distribute_datasets_from_function(dataset_fn, options)
        with pytest.raises(OSError, match="cannot open shard 2"):
            if how == "for, iter raises":
                next(iter(dataset))
            else:
                await anext(aiter(dataset))
        await wait_until(lambda: len(log) == 4, "the readers closed")
    assert sorted(log) == [("close", 0), ("close", 1), ("open", 0), ("open", 1)]
    assert not _producers()


class _ShortReader(_Reader):
    """A ``_Reader`` of ``1 + replica`` batches."""

    def __init__(self, replica, log):
        super().__init__(replica, log)
        self.left = 1 + replica

    def __next__(self):
        if not self.left:
            raise StopIteration
        self.left -= 1
        return super().__next__()


@pytest.mark.parametrize("mode", [None, "PER_WORKER", "PER_REPLICA"])
def test_a_plain_for_closes_its_sources_once_they_have_run_out(two, mode):
    """An ``async for`` closes its sources when they run out; a plain ``for`` left
    them open (a reader holding a file or a loader's workers), and the iterator
    then stayed open, asking the spent sources again on every ``next``."""
    log = []
    if mode is None:
        dataset = two.experimental_distribute_dataset(_ShortReader(0, log))
    else:
        options = aiodist.InputOptions(experimental_replication_mode=mode)
        dataset = two.distribute_datasets_from_function(
            lambda context: _ShortReader(context.input_pipeline_id, log), options
        )
    iterator = iter(dataset)
    batches = list(iterator)
    assert len(batches) == {None: 1, "PER_WORKER": 1, "PER_REPLICA": 2}[mode]
    opened = [entry for entry in log if entry[0] == "open"]
    assert sorted(log) == sorted(opened + [("close", r) for _, r in opened])
    with pytest.raises(StopIteration):
        next(iterator)
    assert len(log) == 2 * len(opened)  # closed once


class _FailsToCloseReader(_Reader):
    def close(self):
        super().close()
        raise RuntimeError("cannot release the reader")


class _OpensFailsToClose(_Opens):
    reader = _FailsToCloseReader


@pytest.mark.parametrize("how", ["dataset_fn raises", "iter raises"])
async def test_the_cause_is_raised_when_closing_the_other_sources_fails_too(three, how):
    """Closing the readers opened for replicas 0 and 1 failed while replica 2's
    error was handled: the close error was raised in its place, the cause left
    only as its __context__. The cause is raised, the close error noted on it."""
    log = []
    options = aiodist.InputOptions(experimental_replication_mode="PER_REPLICA")

    def dataset_fn(context):
        replica = context.input_pipeline_id
        if how == "iter raises":
            return _OpensFailsToClose(replica, log)
        if replica == 2:
            raise OSError("cannot open shard 2")
        return _FailsToCloseReader(replica, log)

    with pytest.raises(OSError, match="cannot open shard 2") as info:
        dataset = three.distribute_datasets_from_function(dataset_fn, options)
        await anext(aiter(dataset))
    assert any("cannot release the reader" in note for note in info.value.__notes__)
    assert sorted(log) == [("close", 0), ("close", 1), ("open", 0), ("open", 1)]
    assert not _producers()


class _FailsToClose:
    """A reader of three batches whose closing fails (sync ``close()``, or async
    ``aclose()`` that first waits for ``release``)."""

    def __init__(self, failure, release=None):
        self.failure, self.release, self.read, self.closing = failure, release, 0, False

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.step()
        if batch is None:
            raise StopIteration
        return batch

    def step(self):
        self.read += 1
        return np.full(2, float(self.read)) if self.read <= 3 else None

    def close(self):
        self.closing = True
        raise self.failure


class _FailsToAclose(_FailsToClose):
    def __aiter__(self):
        return self

    async def __anext__(self):
        batch = self.step()
        if batch is None:
            raise StopAsyncIteration
        return batch

    async def aclose(self):
        self.closing = True
        await self.release.wait()
        raise self.failure

    __iter__ = __next__ = close = None  # async only


@pytest.mark.parametrize("how", ["async for", "aclose", "dropped", "dropped while closing"])
async def test_an_error_closing_the_source_at_its_end_is_raised_once(two, how):
    """The source ran out and closing it raised: the `async for` ended normally
    and the error was only in the producer task, so asyncio logged "Task exception
    was never retrieved" (unless aclose() was called). Now it ends the consumer's
    loop, as an error in an async generator's `finally` does; aclose() raises it
    when no consumer saw it, and a dropped iterator has it reported to the loop's
    exception handler, once in every case."""
    failure = OSError("could not release the reader")
    reported = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: reported.append(context.get("exception")))
    release = asyncio.Event()
    if how == "dropped while closing":
        reader = _FailsToAclose(failure, release)
    else:
        release.set()
        reader = _FailsToAclose(failure, release) if how == "aclose" else _FailsToClose(failure)
    iterator = aiter(two.experimental_distribute_dataset(reader))
    try:
        if how == "async for":
            with pytest.raises(OSError) as info:
                async for _ in iterator:
                    pass
            assert info.value is failure
            await iterator.aclose()  # seen by the consumer: not raised again
        else:
            for _ in range(3):  # every batch, but not the end
                await anext(iterator)
            await wait_until(lambda: reader.closing, "the source closing")
            if how == "aclose":
                with pytest.raises(OSError) as info:
                    await iterator.aclose()
                assert info.value is failure
                await iterator.aclose()
            else:
                del iterator
                gc.collect()
                release.set()
                await wait_until(lambda: reported, "the error reported")
        await wait_until(lambda: not _producers(), "the producer finished")
        gc.collect()
        for _ in range(3):
            await asyncio.sleep(0)
        assert reported == ([failure] if how.startswith("dropped") else [])
    finally:
        loop.set_exception_handler(None)


class _ReadAndCloseFail:
    """An async reader (a connection, say) that gives one batch, then fails to read
    (``fails_to_read``; else it reads on for ever), and fails to close. Its errors
    are made as raised: an error held keeps its traceback's frames alive, and so
    (through the iterator's __anext__ frame) the iterator the test drops."""

    def __init__(self, fails_to_read: bool):
        self.fails_to_read, self.reads = fails_to_read, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.reads += 1
        if self.reads > 1 and self.fails_to_read:
            raise ConnectionError("read failed")
        await asyncio.sleep(0)
        return np.zeros(2)

    async def aclose(self):
        raise ConnectionError("close failed")


@pytest.mark.parametrize("how", ["failed, dropped", "left early", "failed, aclose"])
async def test_an_error_closing_the_source_after_a_failure_or_a_break_is_reported(two, how):
    """Closing the source raised after the pass had failed, or had been left with
    `break`: the error was raised out of the producer task, which no one awaited,
    so asyncio logged only "Task exception was never retrieved" (once the task was
    freed). As at the source's end, the dropped iterator's error now reaches the
    loop's exception handler, saying what failed, and aclose() raises it, once."""
    reported = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    try:
        reader = _ReadAndCloseFail(fails_to_read=how.startswith("failed"))
        iterator = aiter(two.experimental_distribute_dataset(reader))
        if how == "left early":
            async for _ in iterator:
                break
        else:
            with pytest.raises(ConnectionError, match=r"^read failed$"):
                async for _ in iterator:
                    pass
        if how == "failed, aclose":
            with pytest.raises(ConnectionError, match=r"^close failed$"):
                await iterator.aclose()
            await iterator.aclose()  # raised once
        del iterator
        gc.collect()
        await wait_until(lambda: not _producers(), "the producer finished")
        gc.collect()
        for _ in range(3):
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    if how == "failed, aclose":
        assert reported == []
    else:
        [context] = reported
        assert repr(context["exception"]) == "ConnectionError('close failed')"
        assert "closing the source of a distributed dataset raised" in context["message"]


class _Holder:
    """Something holding an iterator in a reference cycle: only the cyclic GC frees it."""

    def __init__(self, iterator):
        self.iterator, self.me = iterator, self


async def _endless(yielded: list, cleaned: asyncio.Event, cleanup_awaits: bool = False):
    """An endless async source noting each element it yields in ``yielded``;
    ``cleaned`` is set once its cleanup has run (an await first, with
    ``cleanup_awaits``: an async cleanup, such as closing a connection)."""
    try:
        while True:
            yielded.append(True)
            yield np.zeros(2)
    finally:
        if cleanup_awaits:
            await asyncio.sleep(0)
        cleaned.set()


async def test_an_iterator_freed_by_the_cyclic_gc_closes_its_source_on_the_loop(two):
    """The producer, waiting for room in its buffer, was garbage together with an
    iterator in a reference cycle: asyncio logged "Task was destroyed but it is
    pending!", and the source's async cleanup was cut short at its first await
    ("coroutine ignored GeneratorExit", the cleanup never finished)."""
    reported, unraisable, cleaned, yielded = [], [], asyncio.Event(), []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append

    try:
        source = _endless(yielded, cleaned, cleanup_awaits=True)
        holder = _Holder(aiter(two.experimental_distribute_dataset(source)))
        await anext(holder.iterator)
        # The next batch fetched ahead: the producer waits for room in the buffer.
        await wait_until(lambda: len(yielded) == 2, "the producer waiting")
        del holder
        gc.collect()
        await asyncio.wait_for(cleaned.wait(), 2)
        await wait_until(lambda: not _producers(), "the producer finished")
        gc.collect()
    finally:
        loop.set_exception_handler(None)
        sys.unraisablehook = hook
    assert reported == [] and unraisable == []


async def test_an_iterator_freed_in_another_thread_stops_its_producer_on_the_loop(two):
    """The cyclic GC runs __del__ in whichever thread collects: it cancelled the
    producer from that thread, which asyncio in debug mode refuses ("Non-thread-
    safe operation ..."; the producer then never stopped), and which otherwise
    did not wake a sleeping loop (uvloop never ran the cancellation at all)."""
    unraisable, cleaned, yielded = [], asyncio.Event(), []
    loop = asyncio.get_running_loop()
    debug, hook = loop.get_debug(), sys.unraisablehook
    loop.set_debug(True)  # (asyncio checks the thread of loop calls in debug mode)
    sys.unraisablehook = unraisable.append

    gc.disable()  # collected by the other thread only
    try:
        holder = _Holder(aiter(two.experimental_distribute_dataset(_endless(yielded, cleaned))))
        await anext(holder.iterator)
        await wait_until(lambda: len(yielded) == 2, "the producer waiting")
        del holder
        collector = threading.Thread(target=gc.collect)
        collector.start()
        await asyncio.wait_for(cleaned.wait(), 2)  # the loop sleeps meanwhile
        await wait_until(lambda: not _producers(), "the producer finished")
        collector.join()
    finally:
        gc.enable()
        loop.set_debug(debug)
        sys.unraisablehook = hook
    assert [u.exc_value for u in unraisable] == []


async def test_an_iterator_read_one_way_refuses_the_other(two):
    # Each way opened the source for itself: anext() after next() gave the first
    # batch again, and the plain reads went on from the second.
    def rows(batch):
        return [part.tolist() for part in two.experimental_local_results(batch)]

    dataset = two.experimental_distribute_dataset([np.full(2, i) for i in range(4)])
    plain = iter(dataset)
    assert rows(next(plain)) == [[0], [0]]
    with pytest.raises(aiodist.ContextError, match=r"await anext\(\) on an iterator read so far"):
        await anext(plain)
    assert rows(next(plain)) == [[1], [1]]  # still read from where it was

    prefetched = aiter(dataset)
    assert rows(await anext(prefetched)) == [[0], [0]]
    with pytest.raises(aiodist.ContextError, match=r"next\(\) on an iterator read so far"):
        next(prefetched)
    assert rows(await anext(prefetched)) == [[1], [1]]
    await prefetched.aclose()


@pytest.mark.parametrize("how", ["dataset", "from_function"])
async def test_an_async_def_aiter_is_refused_and_its_coroutine_closed(two, how):
    # It raised AttributeError ('coroutine' object has no attribute '__anext__'),
    # and Python warned that the coroutine from __aiter__ was never awaited.
    class Reader:
        async def __aiter__(self):  # the mistake: __aiter__ must be a plain def
            return self

        async def __anext__(self):
            raise StopAsyncIteration

    if how == "dataset":
        dataset = two.experimental_distribute_dataset(Reader())
    else:
        dataset = two.distribute_datasets_from_function(lambda context: Reader())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "never awaited" RuntimeWarning fails the test
        with pytest.raises(
            aiodist.InvalidArgumentError,
            match=r"Reader.__aiter__\(\) returned <coroutine .*not an async iterator.*"
            r"a plain method \(def, not async def\)",
        ):
            async for _ in dataset:
                pass
        gc.collect()


class Epochs:
    """A re-iterable dataset made from a generator: each pass calls it again."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return (np.full(2, i) for i in range(self.n))


@pytest.mark.parametrize("how", ["async for", "for", "from_function", "async generator"])
async def test_a_second_pass_over_a_one_shot_source_is_refused_not_empty(two, how):
    # An epoch loop over a generator trained one epoch: every later pass gave no
    # batch at all, silently.
    def source():
        yield from (np.full(2, i) for i in range(3))

    async def async_source():
        for i in range(3):
            yield np.full(2, i)

    async def one_pass(dataset) -> int:
        if how == "for":
            return sum(1 for _ in dataset)
        return len([batch async for batch in dataset])

    if how == "from_function":
        dataset = two.distribute_datasets_from_function(lambda context: source())
        kind, remedy = "dataset_fn returned a generator", "call distribute_datasets_from_function"
    else:
        made = async_source() if how == "async generator" else source()
        dataset = two.experimental_distribute_dataset(made)
        kind = f"the dataset is a {type(made).__name__}"
        remedy = "call experimental_distribute_dataset again"
    assert await one_pass(dataset) == (2 if how == "from_function" else 3)
    for _ in range(2):  # every later pass, not just the first
        with pytest.raises(aiodist.InvalidArgumentError) as caught:
            await one_pass(dataset)
        message = str(caught.value)
        assert f"but {kind}, a one-shot iterator" in message, message
        assert "a re-iterable" in message and remedy in message, message
    # Re-iterables give every pass: a list, and an object whose __iter__ makes a
    # new iterator (an iterable by index too).
    for data in ([np.full(2, i) for i in range(3)], Epochs(3)):
        dataset = two.experimental_distribute_dataset(data)
        assert [await one_pass(dataset) for _ in range(3)] == [3, 3, 3]
    dataset = two.distribute_datasets_from_function(lambda context: Epochs(4))
    assert [await one_pass(dataset) for _ in range(3)] == [2, 2, 2]


async def test_a_pass_left_early_over_a_one_shot_source_drops_its_prefetched_batches(two):
    """What a break does to a one-shot source, as documented: the batches fetched
    ahead are dropped with the pass and the generator is closed, so a new pass
    is refused rather than starting after a gap."""
    read = []

    def source():
        for i in range(8):
            read.append(i)
            yield np.full(2, i)

    made = source()
    options = aiodist.InputOptions(experimental_per_replica_buffer_size=3)
    dataset = two.experimental_distribute_dataset(made, options)
    async for _ in dataset:
        await wait_until(lambda: len(read) == 4, "three batches fetched ahead")
        break
    await wait_until(lambda: made.gi_frame is None, "the generator closed")
    assert read == [0, 1, 2, 3] and list(made) == []
    with pytest.raises(aiodist.InvalidArgumentError, match=r"one-shot iterator"):
        async for _ in dataset:
            pass


@pytest.mark.parametrize("while_", ["waiting for room", "fetching"])
async def test_a_producer_cancelled_by_other_code_fails_the_pass_instead_of_ending_it(two, while_):
    """The task prefetching a pass, cancelled by code other than aiodist's (a
    shutdown helper cancelling every task): the consumer saw the end of the
    dataset, the batches not yet read silently dropped (2 of 100 read, taken for a
    whole epoch)."""
    gate = asyncio.Event()

    async def source():
        for i in range(100):
            if while_ == "fetching" and i == 2:
                await gate.wait()  # the producer waits here, in the fetch
            yield np.full(2, i)

    iterator = aiter(two.experimental_distribute_dataset(source()))
    assert (await anext(iterator)).values[0][0] == 0
    await wait_until(lambda: len(_producers()) == 1, "the producer running")
    if while_ == "fetching":
        assert (await anext(iterator)).values[0][0] == 1
    await asyncio.sleep(0)  # (the producer waits for room, or in the fetch)
    for task in _producers():
        task.cancel()
    await wait_until(lambda: not _producers(), "the producer cancelled")
    if while_ == "waiting for room":  # the batch fetched ahead is whole
        assert (await anext(iterator)).values[0][0] == 1
    for _ in range(2):  # and every later read, as after a source's error
        with pytest.raises(aiodist.ContextError, match=r"cancelled by other code"):
            await asyncio.wait_for(anext(iterator), 2)
    await iterator.aclose()


@pytest.mark.parametrize("factory", ["asyncio", "uvloop"])
@pytest.mark.parametrize("closed", ["as asyncio.run does", "without cancelling"])
def test_an_iterator_read_on_another_loop_raises_instead_of_hanging(two, factory, closed):
    """A pass begun on a loop now closed (a fixture or module-level iterator read by
    the next test), read on a new loop: with its tasks cancelled first, the batch
    fetched ahead came out and then the end (3 of 5 batches dropped, silently);
    closed without that, "Event loop is closed", then every read waited for ever."""
    if factory == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        new_loop = uvloop.new_event_loop
    else:
        new_loop = asyncio.new_event_loop
    iterator = aiter(two.experimental_distribute_dataset([np.full(2, i) for i in range(5)]))
    first = new_loop()
    try:
        assert first.run_until_complete(anext(iterator)).values[0][0] == 0
        if closed == "as asyncio.run does":
            for task in asyncio.all_tasks(first):
                task.cancel()
            first.run_until_complete(asyncio.sleep(0))
    finally:
        first.close()

    async def read_on():
        for _ in range(2):
            with pytest.raises(aiodist.ContextError, match=r"began on another event loop"):
                await asyncio.wait_for(anext(iterator), 2)
        await iterator.aclose()  # (nothing left to stop: the loop is closed)
        with pytest.raises(StopAsyncIteration):
            await anext(iterator)

    second = new_loop()
    try:
        second.run_until_complete(read_on())
    finally:
        second.close()


async def test_a_buffer_size_of_zero_fetches_each_batch_when_asked_as_in_tf(two):
    """TF: ``experimental_per_replica_buffer_size=0`` disables prefetching. aiodist
    refused 0 ("expected an int >= 1"), so TF code setting it failed at the call.
    Each batch is now fetched when a consumer asks for it, one per consumer
    waiting, and the end is seen as with prefetching."""
    made = []

    def source():
        for i in range(3):
            made.append(i)
            yield np.full(2, i)

    options = aiodist.InputOptions(experimental_per_replica_buffer_size=0)
    assert options.experimental_per_replica_buffer_size == 0
    iterator = aiter(two.experimental_distribute_dataset(source(), options))
    first = await anext(iterator)
    for _ in range(20):  # every chance for a producer to run ahead
        await asyncio.sleep(0)
    assert made == [0]
    # Two consumers waiting at once each get a batch of their own; a third, the end.
    results = await asyncio.wait_for(
        asyncio.gather(*(anext(iterator) for _ in range(3)), return_exceptions=True), 2
    )
    assert [b.values[0][0] for b in [first, *results[:2]]] == [0, 1, 2]
    assert isinstance(results[2], StopAsyncIteration)
    assert made == [0, 1, 2]


@pytest.mark.parametrize("how", ["dataset", "from_function", "from_function_per_replica"])
async def test_a_dataset_is_never_printed_unless_it_is_refused(two, how):
    """Checking that the dataset is iterable built its repr for the message first,
    refused or not, at the call and at every pass: 25 s per `async for` epoch for a
    list of 5000 batches of 64 x 3 x 32 x 32 (NumPy prints each), and twice that at
    distribute_datasets_from_function."""
    printed = []

    class Batches(list):
        def __repr__(self):
            printed.append(True)
            return "Batches(...)"

    batches = Batches([np.zeros((2, 3))] * 3)
    if how == "dataset":
        dataset = two.experimental_distribute_dataset(batches)
    else:
        mode = "PER_REPLICA" if how.endswith("per_replica") else "PER_WORKER"
        options = aiodist.InputOptions(experimental_replication_mode=mode)
        dataset = two.distribute_datasets_from_function(lambda context: batches, options)
    for _ in range(2):
        assert len([batch async for batch in dataset]) == (2 if how == "from_function" else 3)
        assert len(list(dataset)) == (2 if how == "from_function" else 3)
    assert printed == []


async def test_reprs_are_short_and_show_the_state_of_a_pass(two):
    """repr() of a distributed dataset printed its whole source: 1.5 MB for a list
    of 1000 batches of 32 x 10 (a debugger's variables pane, a log line); an
    iterator's was ``<aiodist._input.DistributedIterator object at 0x...>``."""
    batches = [np.zeros((32, 10))] * 1000
    dataset = two.experimental_distribute_dataset(batches)
    text = repr(dataset)
    assert len(text) < 300, text
    assert text.startswith(
        "<DistributedDataset experimental_distribute_dataset over a list of 1000 items, "
        "the first array([[0., 0.,"
    )
    assert text.endswith(", split over 2 replicas>")
    from_function = two.distribute_datasets_from_function(lambda context: batches)
    assert len(repr(from_function)) < 300
    assert "distribute_datasets_from_function" in repr(from_function)

    iterator = aiter(dataset)
    assert repr(iterator).endswith(": not started>")
    await anext(iterator)
    await wait_until(lambda: "1 batch fetched ahead" in repr(iterator), "one batch ahead")
    assert len(repr(iterator)) < 400
    await iterator.aclose()
    assert repr(iterator).endswith(": closed>")

    def failing():
        yield np.zeros(2)
        raise KeyError("disk")

    iterator = aiter(two.experimental_distribute_dataset(failing()))
    await anext(iterator)
    with pytest.raises(KeyError):
        await anext(iterator)
    assert repr(iterator).endswith(": failed: KeyError('disk')>"), repr(iterator)
    iterator = iter(two.experimental_distribute_dataset([np.zeros(2)]))
    next(iterator)
    assert repr(iterator).endswith(": read by a plain `for`>")
    with pytest.raises(StopIteration):
        next(iterator)
    assert repr(iterator).endswith(": closed>")


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
def test_a_dataset_fn_is_never_printed_unless_what_it_returned_is_refused(two, mode):
    """Each call of dataset_fn was described for the "is not iterable" message
    before its result was checked: a dataset_fn that is a functools.partial holding
    the data printed all of it (4 s for 1000 batches of 64 x 3 x 32 x 32)."""
    printed = []

    class DatasetFn:
        def __init__(self, result):
            self.result = result

        def __call__(self, context):
            return self.result

        def __repr__(self):
            printed.append(True)
            return "DatasetFn(...)"

    options = aiodist.InputOptions(experimental_replication_mode=mode)
    two.distribute_datasets_from_function(DatasetFn([np.zeros((2, 3))]), options)
    assert printed == []
    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"dataset_fn=DatasetFn\(\.\.\.\), called"
    ):
        two.distribute_datasets_from_function(DatasetFn(42), options)
