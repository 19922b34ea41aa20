"""Distributed input: global batches split across replicas, placed, prefetched.

``strategy.experimental_distribute_dataset(dataset)`` takes any iterable or
async iterable of *global batches* (an array, or a nested structure of arrays
sharing a leading batch axis) and yields ``PerReplica`` batches: rows split
along axis 0, as evenly as possible, earlier replicas taking the extra rows. A
nested batch comes out as that structure with a ``PerReplica`` at every leaf
(one the shards share included, as TF's ``always_wrap``). ``PER_REPLICA`` is
refused here, as in TF: it is for ``distribute_datasets_from_function``.

``strategy.distribute_datasets_from_function(dataset_fn)`` lets the user build
the per-replica batches: ``dataset_fn(InputContext)`` is called once
(``PER_WORKER``: replicas take consecutive elements) or once per replica
(``PER_REPLICA``). ``dataset_fn`` is a plain function; an ``async def`` one is
refused at the call (an async generator function is fine: calling it gives the
async iterable). The replicas' sources are opened (``iter``) together at the
first read; when calling ``dataset_fn``, or opening what it returned, raises
for one replica, what was opened for the others is closed before the error is
raised.

Passes: each ``async for`` (or ``for``) is a new pass that opens the source
again (``iter``), from its first element, as a ``tf.data.Dataset`` is iterated
once per epoch. A one-shot source, one that is its own iterator (``iter(x) is
x``: a generator, a file, an async generator, any iterator; for
``distribute_datasets_from_function``, what ``dataset_fn``, called once,
returned), gives one pass: a second one raises ``InvalidArgumentError`` (it
would get nothing, silently, or only what the first left), saying to pass a
re-iterable (a list, an object whose ``__iter__`` makes a new iterator) or to
distribute it again for each pass.

Prefetching: ``async for`` starts one producer task per iteration that keeps at
most ``InputOptions.experimental_per_replica_buffer_size`` elements fetched
ahead of the consumer (a semaphore bounds it, so memory stays bounded); with 0
(as in TF, no prefetching) it fetches an element only when a consumer asks for
one, one per consumer waiting. The
producer holds no reference to the iterator, so leaving an ``async for`` early
(``break``) drops the iterator, which cancels the producer and closes the
source; ``aclose()`` or ``async with`` do the same explicitly. The elements
fetched ahead are then dropped: with a re-iterable source nothing is lost (the
next pass starts afresh), but a one-shot source has given them up for good, and
is closed if it has ``close()`` (a generator; an iterator without it keeps only
the elements nobody fetched). After
``aclose()`` the iteration is over, as an async generator's: batches fetched
ahead are dropped, and every ``anext`` (one already waiting included) raises
``StopAsyncIteration``; an error the source raises while it is closed is raised
by ``aclose()``, once. A source that runs out is closed before the consumer is
told, so an error closing it ends the ``async for`` (as one raised in an async
generator's ``finally`` does); if no consumer was given it, ``aclose()`` raises
it, or, the iterator dropped, the loop's exception handler reports it; so is an
error closing the source after the iteration failed, or was left early.

Errors: exceptions from the user's dataset reach the ``async for`` unchanged,
and end the iteration as failed, not as exhausted: every later ``anext`` (in
any consumer of the iterator) raises the same exception object again, where an
async generator that raised would raise ``StopAsyncIteration``. So a consumer
that catches the error and reads on, or a second consumer of the iterator,
cannot take a failed input for a complete one. (TF's ``DistributedIterator``
documents nothing after an error.) A plain ``for`` reads the source on demand:
after an error it gets whatever the source gives next (a generator that raised
has ended: ``StopIteration``); once the source has run out, it is closed too.
The producer task cancelled by other code (a shutdown cancelling every task, the
end of ``asyncio.run()``) fails the pass the same way, with ``ContextError``,
after the batches it had fetched. An ``async for`` pass is read on the event
loop it began on: ``anext`` on another raises ``ContextError`` (its producer,
there, would never answer), and ``aclose()`` there raises it too, unless that
loop is closed (then nothing is left to stop).

On GPUs each shard is copied on its replica's stream, after that stream waits
for the device's current stream (where the source may make its arrays), and the
current streams then wait for the copies (see docs/gpu.md).

A batch handed out never changes under its user, even when the source refills
one buffer for every element (as data loaders do): while prefetching, or when
replicas take consecutive elements of one source, shards that would still share
the source's memory are copied (as tf.data copies elements into new tensors).
A plain ``for`` over ``experimental_distribute_dataset`` fetches nothing ahead,
so its CPU shards are views of the source's batch, copied by nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import operator
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _nest, _trace
from ._arrays import leaf_path
from ._backends import is_cupy_array
from ._checks import (
    member,
    not_callable,
    options_or_default,
    refuse_awaitables,
    short_repr,
    whole_number,
)
from ._errors import ContextError, InvalidArgumentError
from ._values import regroup_wrapping_every_leaf

if TYPE_CHECKING:
    from ._scheduler import ReplicaSlot
    from ._strategy import Strategy

__all__ = [
    "DistributedDataset",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "split_batch",
]


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` calls ``dataset_fn``
    (``experimental_distribute_dataset`` takes only ``PER_WORKER``, as in TF)."""

    PER_WORKER = "PER_WORKER"  # once; replicas take consecutive elements
    PER_REPLICA = "PER_REPLICA"  # once per replica; each iterates its own


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed datasets.

    Args:
        experimental_fetch_to_device: place each replica's shard on its device
            (True), or keep it on the host as NumPy (False). None (the default)
            means True, as in TF.
        experimental_replication_mode: see ``InputReplicationMode``.
        experimental_place_dataset_on_device: the dataset function itself makes
            its elements on the replica's device, and aiodist transfers none (as
            in TF: only with ``PER_REPLICA`` and ``experimental_fetch_to_device=False``).
        experimental_per_replica_buffer_size: how many elements to fetch ahead
            of the consumer; 0 fetches each one when the ``async for`` asks for
            it (no prefetching, as in TF).
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        name = "experimental_per_replica_buffer_size"
        object.__setattr__(self, name, whole_number(getattr(self, name), name, 0))  # (frozen)
        name = "experimental_replication_mode"
        mode = member(InputReplicationMode, getattr(self, name), name)
        object.__setattr__(self, name, mode)  # a frozen dataclass
        if self.experimental_fetch_to_device is None:  # TF's default
            object.__setattr__(self, "experimental_fetch_to_device", True)
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"InputOptions: {name}={value!r}; expected a bool.")
        if self.experimental_place_dataset_on_device and (
            self.experimental_fetch_to_device or mode is not InputReplicationMode.PER_REPLICA
        ):
            raise InvalidArgumentError(
                "InputOptions: experimental_place_dataset_on_device=True needs "
                "experimental_replication_mode=PER_REPLICA and experimental_fetch_to_device="
                f"False (got {mode.name} and {self.experimental_fetch_to_device}), as in TF."
            )


class InputContext:
    """What ``dataset_fn`` is told about the input pipeline it builds."""

    __slots__ = ("_input_pipeline_id", "_num_input_pipelines", "_num_replicas_in_sync")

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` divided by the replica count; ``ValueError`` if uneven."""
        try:
            size = operator.index(global_batch_size)
        except TypeError:
            raise InvalidArgumentError(
                f"global_batch_size={global_batch_size!r}; expected an int."
            ) from None
        if size % self._num_replicas_in_sync:
            raise InvalidArgumentError(
                f"global_batch_size={size} is not divisible by num_replicas_in_sync="
                f"{self._num_replicas_in_sync}; pick a multiple of "
                f"{self._num_replicas_in_sync}."
            )
        return size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


# -- splitting -----------------------------------------------------------------------


def _leaf_arrays(
    element: object,
    where: str,
    needs: str = "every leaf of a global batch must be an array whose axis 0 is the batch",
) -> list:
    arrays = []
    for index, leaf in enumerate(_nest.flatten(element)):
        array = leaf if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else np.asarray(leaf)
        if array.ndim == 0:
            # Rows written as Python lists ([[1.0, 2.0], ...], or {"x": [1, 2, 3]} as
            # JSON gives) nest: each number is a leaf of its own, and the message
            # named the first one only.
            rows = (
                " (a list or tuple is a structure here, each item a leaf of its own, not "
                "rows of an array: make each leaf an array first, with np.asarray)"
                if _in_a_list_of_scalars(element, index)
                else ""
            )
            path = leaf_path(element, index)[0]
            at = f" at {path}" if path else ""
            raise InvalidArgumentError(
                f"{where}: a rank-0 value{at} ({leaf!r}) has no batch axis{rows}; {needs}."
            )
        arrays.append(array)
    return arrays


def _in_a_list_of_scalars(element: object, index: int) -> bool:
    """Whether leaf ``index`` (in ``flatten`` order) of ``element`` is an item of a
    list or tuple holding only leaves without a shape (numbers): a row or a batch
    written as a Python list, rather than one bad leaf beside arrays."""
    if not _nest.is_nested(element):
        return False
    _, container = next(itertools.islice(_leaves_with_containers(element), index, None))
    return isinstance(container, list | tuple) and not any(
        _nest.is_nested(item) or hasattr(item, "shape") for item in container
    )


def _leaves_with_containers(node: list | tuple | dict) -> Iterator[tuple[object, object]]:
    """(leaf, the list, tuple or dict holding it) for each leaf of ``node``, in
    ``flatten`` order."""
    for child in _nest.children(node):
        if _nest.is_nested(child):
            yield from _leaves_with_containers(child)
        else:
            yield child, node


def _local_shards(strategy: Any, element: object) -> list:
    """This process's shards of a global batch: all of them in one process; with
    several workers, the batch is split over every replica of every worker and
    this worker keeps its own replicas' rows."""
    local = len(strategy._slots)
    if strategy._world is None:
        return split_batch(element, local)
    first = strategy._replica_offset
    return split_batch(element, strategy.num_replicas_in_sync)[first : first + local]


def split_batch(
    element: object, num_replicas: int, where: str = "experimental_distribute_dataset"
) -> list:
    """One structure per replica, each leaf's rows split as evenly as possible.

    Earlier replicas take the extra rows; a replica gets zero rows when the
    batch has fewer rows than there are replicas. ``where`` names the caller in
    messages (the API the user called).
    """
    arrays = _leaf_arrays(element, where)
    if not arrays:
        raise InvalidArgumentError(f"{where}: element {element!r} holds no arrays.")
    sizes = [a.shape[0] for a in arrays]
    if len(set(sizes)) > 1:
        raise InvalidArgumentError(
            f"{where}: the leaves of one element have different batch sizes "
            f"({_batch_sizes_text(element, sizes)}); every leaf's axis 0 must be the "
            "same global batch."
        )
    base, extra = divmod(sizes[0], num_replicas)
    bounds = [0]
    for replica in range(num_replicas):
        bounds.append(bounds[-1] + base + (1 if replica < extra else 0))
    return [
        _nest.pack_as(element, [a[bounds[r] : bounds[r + 1]] for a in arrays])
        for r in range(num_replicas)
    ]


def _batch_sizes_text(element: object, sizes: list[int], most: int = 4) -> str:
    """``['x']: 4 rows, but ['y']: 3``: the first leaf's path and size, then those
    of (at most ``most``) leaves whose size differs from it, so that the leaves to
    mend are named even in a large structure (the sizes alone named none)."""
    differ = [index for index, size in enumerate(sizes) if size != sizes[0]]
    shown = [f"{leaf_path(element, i)[0]}: {sizes[i]}" for i in differ[:most]]
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return f"{leaf_path(element, 0)[0]}: {sizes[0]} rows, but {', '.join(shown)}{more}"


def _empty_like(structure: object) -> object:
    return _nest.map_structure(lambda a: a[:0], structure)


# -- sources -------------------------------------------------------------------------


def _check_iterable(iterable: Any, where: str, made_by: Callable[[], str] | None = None) -> None:
    """Refuse what cannot be iterated, without opening it: iterating a data loader
    can start its workers. The methods are looked up on the type, as ``iter()``
    does (a class has ``__iter__`` as an attribute, yet is not iterable), and a
    ``__getitem__`` alone makes an iterable, as for ``iter()`` (the sequence
    protocol: items 0, 1, ... until ``IndexError``). A mapping is refused too: it
    iterates its keys, so it is a batch passed where a dataset of batches belongs.
    ``made_by()`` names, for the message, the call that returned ``iterable``
    (``dataset_fn``'s, with its ``InputContext``), if it is not the user's own."""
    kind = type(iterable)
    iterable_kind = any(
        getattr(kind, method, None) is not None
        for method in ("__aiter__", "__iter__", "__getitem__")
    )
    # A 0-d array has __iter__ and raises when called; strings iterate characters.
    zero_d = getattr(iterable, "ndim", None) == 0
    if isinstance(iterable, Mapping):
        # Iterated, a mapping gives its keys, never batches: one global batch given
        # as it is ({"x": ..., "y": ...}) was refused only at the first read, as "a
        # rank-0 value ('x') has no batch axis".
        shown = list(itertools.islice(iterable, 4))  # (not a copy of every key)
        # (made_by is called only to refuse: a dataset_fn that is a functools.partial
        # holding the data printed all of it, 4 s for 1000 batches, for no message.)
        the_dataset = f"{made_by()} returned" if made_by else "the dataset is"
        keys = ", ".join(map(repr, shown[:3])) + (", ..." if len(shown) > 3 else "")
        raise InvalidArgumentError(
            f"{where}: {the_dataset} a mapping ({type(iterable).__name__}, "
            f"{f'keys {keys}' if keys else 'empty'}), whose "
            "iteration gives its keys, not batches; expected an iterable of batches: for "
            "one global batch that is a dict, pass a list of it ([batch])."
        )
    if iterable_kind and not isinstance(iterable, str | bytes) and not zero_d:
        return
    # "dataset_fn=f returned None, which ...", or "None ...": the bad value alone
    # did not say it came from dataset_fn, nor from which replica's call. (Printed
    # only here, cut short: NumPy took 25 s to print a list of 5000 batches, for a
    # message not raised, at the call and at every pass.)
    shown = short_repr(iterable)
    subject = f"{made_by()} returned {shown}, which" if made_by else shown
    raise InvalidArgumentError(
        f"{where}: {subject} is not iterable; expected an iterable or async "
        "iterable of batches (a list, a generator, an async generator, ...)."
    )


def _reads_async(iterable: Any, sync: bool) -> bool:
    """Whether ``iterable`` is read asynchronously: an async iterable is, but one
    that is both (``__aiter__`` and ``__iter__``) is read synchronously for a
    plain ``for`` (``sync``)."""
    has_iter = getattr(type(iterable), "__iter__", None) is not None
    return hasattr(iterable, "__aiter__") and not (sync and has_iter)


def _is_one_shot(iterable: Any, sync: bool) -> bool:
    """Whether reading ``iterable`` (synchronously for a plain ``for``: ``sync``)
    uses it up: it is its own iterator (``iter(x) is x``: a generator, a file, an
    async generator), as the iterator protocol's ``__next__`` (``__anext__``)
    says, looked up on the type, without opening it."""
    method = "__anext__" if _reads_async(iterable, sync) else "__next__"
    return getattr(type(iterable), method, None) is not None


class _Source:
    """A sync or async iterable, opened (``iter``, ``__aiter__``) when made and
    read one element at a time from the loop (see ``_reads_async``)."""

    def __init__(self, iterable: Any, where: str, sync: bool = False):
        _check_iterable(iterable, where)
        if _reads_async(iterable, sync):
            self._async: AsyncIterator | None = _async_iterator(iterable, where)
            self._sync: Iterator | None = None
        else:
            self._async, self._sync = None, iter(iterable)

    @property
    def is_async(self) -> bool:
        return self._async is not None

    def sync_iterators(self) -> list[Iterator]:
        """The sync iterator read (a plain ``for`` reads no other), to close."""
        return [] if self._sync is None else [self._sync]

    async def next(self) -> tuple[bool, Any]:
        """(True, element), or (False, None) when exhausted."""
        try:
            if self._async is not None:
                return True, await self._async.__anext__()
            assert self._sync is not None
            return True, next(self._sync)
        except (StopIteration, StopAsyncIteration):
            return False, None

    async def aclose(self) -> None:
        closer = getattr(self._async if self._async is not None else self._sync, "aclose", None)
        if closer is not None:
            await closer()
        elif self._sync is not None and hasattr(self._sync, "close"):
            self._sync.close()


def _async_iterator(iterable: Any, where: str) -> AsyncIterator:
    """``iterable.__aiter__()``, refused unless it is an async iterator, as ``async
    for`` refuses it: an ``async def __aiter__`` gave a coroutine, never awaited
    (Python warned so), then an AttributeError ('coroutine' object has no attribute
    '__anext__') at the first read."""
    iterator = iterable.__aiter__()

    def message() -> str:
        return (
            f"{where}: {type(iterable).__name__}.__aiter__() returned "
            f"{short_repr(iterator)}, which is not an async iterator (no __anext__); "
            "expected __aiter__ to be a plain method (def, not async def) returning an "
            "async iterator (often self), as `async for` requires."
        )

    refuse_awaitables([iterator], message)  # (closed first: no "never awaited")
    if getattr(type(iterator), "__anext__", None) is None:
        raise InvalidArgumentError(message())
    return iterator


# -- the pipeline --------------------------------------------------------------------

# The producer tasks not yet done, held by their loop. A loop holds its tasks
# weakly, and a producer waiting for room in its buffer is held only through its
# pipeline, which only its iterator holds: an iterator freed by the cyclic GC (one
# in a reference cycle) would take its producer with it, pending ("Task was
# destroyed but it is pending!"), the source's async cleanup cut short, instead of
# having it cancelled. A set on the loop itself (every AbstractEventLoop has an
# instance dict), not one of this module's, which would keep a loop stopped but
# never closed alive for ever through its pending producers (and what they hold):
# a loop nothing else holds is freed with them (asyncio reports those still
# pending, as it does any task).
_PRODUCERS = "_aiodist_producers"


def _producers_of(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task]:
    producers = getattr(loop, _PRODUCERS, None)
    if producers is None:
        producers = set()
        setattr(loop, _PRODUCERS, producers)
    return producers


class _Pipeline:
    """The producer side of one iteration: fetch, split, place, bounded prefetch.

    Holds no reference to the iterator that consumes it, so dropping the
    iterator can cancel this pipeline.
    """

    def __init__(self, fetch: Callable[[], Any], close: Callable[[], Any], depth: int, where: str):
        self._fetch = fetch  # async () -> (more, element)
        self._close = close  # async () -> None
        self._where = where  # the API the user called, for messages
        # Room for elements fetched ahead; with depth 0 (no prefetching), each
        # consumer that finds nothing ready makes room for one (get).
        self._free = asyncio.Semaphore(depth)
        self._on_demand = depth == 0
        self._ready: deque = deque()
        self._finished = False  # an "end" or "error" entry was pushed
        self._started = False
        self._closing = False  # the source ran out and is being closed (_close_at_end)
        self._abandoned = False  # the iterator was dropped: no consumer is left
        # An error closing the source (at its end, or after a failure or a stop:
        # see _produce) that no consumer has been given yet: aclose() raises it, or
        # abandon() reports it (see take_close_error).
        self._close_error: Exception | None = None
        self._waiters: list[asyncio.Future] = []
        self.loop = loop = asyncio.get_running_loop()
        # The producer, until it ends (see _produce).
        self.task: asyncio.Task | None = loop.create_task(self._produce())
        producers = _producers_of(loop)
        producers.add(self.task)
        self.task.add_done_callback(producers.discard)

    async def _produce(self) -> None:
        """``_produce_batches``, keeping an error it raises for ``aclose()`` to
        raise, or for ``abandon()`` to report: closing the source raised, after the
        pass failed or was stopped (or the source's cleanup raised, stopped while
        fetching). No consumer is given it (they saw the failure, or the end), and
        raised out of the task it was reported, if ever, only as "Task exception
        was never retrieved" when the task was freed."""
        try:
            await self._produce_batches()
        except Exception as exc:
            self._close_error = exc
            if self._abandoned:
                self._report_close_error()
        finally:
            # Forgotten as it ends: a task ended by its cancellation (a pass stopped
            # early) keeps that CancelledError, whose traceback holds this frame and
            # so this pipeline; holding the task, it would make a cycle, left for the
            # garbage collector, of every `break` out of an `async for`.
            self.task = None

    async def _produce_batches(self) -> None:
        self._started = True
        try:
            while not self._finished:  # (cancel() before the first step finishes it)
                await self._free.acquire()
                tracer = _trace.active
                start, lane = (tracer.now(), tracer.take_input_lane()) if tracer else (0.0, 0)
                outcome = None  # how a fetch that did not return ended, for its span
                try:
                    more, element = await self._fetch()
                except Exception as exc:
                    outcome = f"raised {type(exc).__name__}"
                    if self._finished:
                        # Stopped (aclose) while fetching: the source's cleanup
                        # raised. No consumer will see an entry now; aclose() raises
                        # it (see _produce).
                        raise
                    self._fail(exc)
                    return
                except BaseException as exc:  # e.g. the source raised CancelledError itself
                    cancelled = isinstance(exc, asyncio.CancelledError)
                    outcome = "cancelled" if cancelled else f"raised {type(exc).__name__}"
                    if not cancelled or not asyncio.current_task().cancelling():
                        self._fail(exc)
                    raise
                finally:
                    if tracer is not None:
                        # Every fetch has its span: one that failed (the source raised,
                        # or a slow read was stopped) with its outcome, as a collective's.
                        end = tracer.now()  # (taken before the lane is free)
                        tracer.free_input_lane(lane)
                        extra = {} if outcome is None else {"outcome": outcome}
                        tracer.span(
                            "prefetch", "input", _trace.input_track(lane), start, end, **extra
                        )
                if not more:
                    await self._close_at_end()
                    return
                self._push(("item", element))
        except asyncio.CancelledError:
            if not (self._finished or self._closing):
                # Cancelled by other code, not by cancel() (which ends the pass
                # first): a shutdown cancelling every task, asyncio.run() ending its
                # loop. The pass is incomplete: ending it would pass the batches
                # never fetched off as the end of the dataset.
                self._fail(self._cancelled_by_others())
            raise
        finally:
            if not self._finished:  # stopped early (aclose, break): consumers see the end
                self._push(("end", None))
            if not self._closing:
                await self._close()

    async def _close_at_end(self) -> None:
        """The source ran out: close it before the consumers see the end, so that
        an error closing it ends their loop (as an error in an async generator's
        ``finally`` ends the loop over it), instead of reaching aclose() only."""
        self._closing = True  # cancel() lets the closing finish
        try:
            await self._close()
        except Exception as exc:
            self._close_error = exc
            self._fail(exc)  # (behind the end, unread, if stopped meanwhile)
            if self._abandoned:
                self._report_close_error()
        else:
            self._push(("end", None))

    def _push(self, entry: tuple) -> None:
        self._ready.append(entry)
        if entry[0] != "item":
            self._finished = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # every waiting consumer, not just the last one
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        """End the iteration as failed with ``exc``, kept with the traceback it has
        now: ``get`` raises it with that one every time (as asyncio.Future.result()
        does), not with each raise's frames added to every earlier one's, which grew
        without end for a consumer that reads on after the error (3 frames an anext)."""
        self._push(("error", (exc, exc.__traceback__)))

    def _cancelled_by_others(self) -> ContextError:
        return ContextError(
            f"{self._where}: the task prefetching this pass's batches was cancelled by "
            "other code, not by aclose() or by leaving the `async for` (for example a "
            "shutdown that cancelled every task, or asyncio.run() ending the loop the "
            "pass began on); the pass is incomplete, so it does not end as if the "
            "dataset had run out. Leave that task to aiodist (aclose() the iterator to "
            "stop it), and start a new pass over the dataset."
        )

    def describe(self) -> str:
        """The state of the pass, for the iterator's repr."""
        ahead = sum(kind == "item" for kind, _ in self._ready)
        text = f"read by `async for`, {ahead} batch{'es' if ahead != 1 else ''} fetched ahead"
        end = next((entry for entry in self._ready if entry[0] != "item"), None)
        if end is None:
            return text
        if end[0] == "error":
            failed = f"failed: {short_repr(end[1][0])}"
            return f"{text}, then {failed}" if ahead else failed
        return f"{text}, then the end" if ahead else "ended"

    def on_another_loop(self, called: str) -> ContextError:
        closed = ", now closed" if self.loop.is_closed() else ""
        return ContextError(
            f"{self._where}: {called} on an iterator whose pass began on another event "
            f"loop{closed}, where its batches are prefetched; an iterator is read on "
            "the loop that began its pass (each asyncio.run(), each test of "
            "pytest-asyncio, has a loop of its own). Start a new pass over the "
            "dataset (`async for`, or aiter()) on this loop."
        )

    async def get(self) -> Any:
        if asyncio.get_running_loop() is not self.loop:
            # Its producer, semaphore and waiters belong to the loop the pass began
            # on: waiting for them here, the read never ended (that loop closed).
            raise self.on_another_loop("anext()")
        if self._on_demand and not self._ready:
            self._free.release()  # ask for one element (one per waiting consumer)
        while not self._ready:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        kind, value = self._ready.popleft()
        if kind == "item":
            if not self._on_demand:
                self._free.release()
            return value
        self._ready.appendleft((kind, value))  # stay exhausted / failed
        if kind == "error":
            error, traceback = value
            if error is self._close_error:
                self._close_error = None  # given to a consumer: reported
            raise error.with_traceback(traceback)
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop: batches fetched ahead are dropped and every consumer sees the end
        now. The producer closes the source; one cancelled before its first step
        would never run its ``finally``, so that one is left to start, see the
        end and only close the source."""
        # Else it ended, failed or was stopped, and closes the source (or has).
        producing = not (self._finished or self._closing)
        self._ready.clear()
        self._push(("end", None))
        if producing and self._started and self.task is not None:
            self.task.cancel()

    def abandon(self) -> None:
        """Its iterator was dropped: stop, and report an error closing the source
        that no consumer was given to the loop's exception handler, as asyncio
        reports one raised closing an async generator that nobody closed."""
        self._abandoned = True
        self.cancel()
        self._report_close_error()

    def take_close_error(self) -> Exception | None:
        """The error closing the source that no consumer was given, if any, for the
        caller to report: from now on it is not reported again."""
        error, self._close_error = self._close_error, None
        return error

    def _report_close_error(self) -> None:
        error = self.take_close_error()
        if error is not None:
            self.loop.call_exception_handler(
                {
                    "message": "closing the source of a distributed dataset raised, after "
                    "the iteration over it had been dropped",
                    "exception": error,
                }
            )


class DistributedIterator:
    """One pass over a distributed dataset (``async for`` or ``for``), read one
    way only: ``anext()`` after ``next()``, or the reverse, raises ``ContextError``."""

    def __init__(self, dataset: DistributedDataset):
        self._dataset = dataset
        self._pipeline: _Pipeline | None = None
        self._sync_source: _Source | None = None
        self._closed = False  # aclose() was called: the iteration is over

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self._sync_source is not None:
            state = "read by a plain `for`"
        elif self._pipeline is not None:
            state = self._pipeline.describe()
        else:
            state = "not started"
        return f"<DistributedIterator of {self._dataset._describe()}: {state}>"

    # async iteration, prefetched
    def __aiter__(self) -> DistributedIterator:
        return self

    async def __anext__(self) -> Any:
        if self._closed:  # as an async generator after aclose()
            raise StopAsyncIteration
        if self._sync_source is not None:
            raise self._mixed("await anext()", "next() (a plain `for`)")
        if self._pipeline is None:
            dataset = self._dataset  # the pipeline must not reference this iterator
            source = dataset._open()
            self._pipeline = _Pipeline(
                lambda: dataset._next(source, prefetching=True),
                source.aclose,
                dataset._options.experimental_per_replica_buffer_size,
                dataset._where,
            )
        return await self._pipeline.get()

    async def aclose(self) -> None:
        """Stop prefetching and close the source; waits until the producer is done.
        The iteration is over: batches fetched ahead are dropped, and ``anext``
        raises ``StopAsyncIteration`` (in a consumer waiting for one, too). An
        error raised while closing the source is raised here (once), as an async
        generator's ``aclose()`` raises it (unless ``anext`` raised it already:
        the source ran out, and closing it failed)."""
        first = not self._closed
        self._closed = True
        if first and self._sync_source is not None:  # read by a plain `for` so far
            source, self._sync_source = self._sync_source, None
            await source.aclose()
        if self._pipeline is not None:
            if self._pipeline.loop is not asyncio.get_running_loop():
                if self._pipeline.loop.is_closed():
                    return  # nothing runs there any more (asyncio reports its tasks)
                raise self._pipeline.on_another_loop("aclose()")
            self._pipeline.cancel()
            if self._pipeline.task is not None:  # (None: it has ended)
                await asyncio.gather(self._pipeline.task, return_exceptions=True)
            # Closing the source failed (now, or at its end or after an error), and
            # no consumer was given that error.
            error = self._pipeline.take_close_error()
            if first and error is not None:
                raise error

    async def __aenter__(self) -> DistributedIterator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        pipeline = self._pipeline
        if pipeline is None:
            return
        loop = pipeline.loop
        if loop.is_closed():
            # A loop closed with the producer still pending (loop.close() without
            # cancelling its tasks) can schedule nothing more: asyncio itself reports
            # the pending task once it is freed; cancelling it here would raise
            # "Event loop is closed".
            if pipeline.task is not None:
                _producers_of(loop).discard(pipeline.task)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            pipeline.abandon()
        else:
            # The cyclic GC runs __del__ in whichever thread it collects in, and a
            # loop may be driven only from its own thread: cancelling the producer
            # from another one could leave the loop asleep, never running it.
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(pipeline.abandon)

    def _mixed(self, called: str, read_by: str) -> ContextError:
        """Reading one iterator both ways: each way opens the source for itself, so
        the other would start the pass again from the first batch (wrong data)."""
        return ContextError(
            f"{self._dataset._where}: {called} on an iterator read so far with "
            f"{read_by}; one iterator is read one way only, each opening the source "
            "for itself (the other would start again from the first batch). Keep "
            "reading it as before, or start a new pass over the dataset."
        )

    # plain iteration, on demand
    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:  # after aclose(), as for `async for`
            raise StopIteration
        if self._pipeline is not None:
            raise self._mixed("next()", "await anext() (an `async for`)")
        if self._sync_source is None:
            self._sync_source = self._dataset._open(sync=True)
        try:
            return self._dataset._next_sync(self._sync_source)
        except StopIteration:
            # Run out: the pass is over, and its sources are closed, as at the end of
            # an `async for` (a reader holding a file or a loader's workers was left
            # open until collected, if it ever was).
            self._closed = True
            source, self._sync_source = self._sync_source, None
            _close_iterators(source.sync_iterators())
            raise


def _describe_source(source: Any) -> str:
    """A source for a repr: a list or tuple by its length and first item, anything
    else by its repr, cut short, on one line."""
    if isinstance(source, list | tuple):
        first = f", the first {short_repr(source[0])}" if source else ""
        text = f"a {type(source).__name__} of {len(source)} items{first}"
    else:
        text = short_repr(source)
    return " ".join(text.split())


class DistributedDataset:
    """What ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``
    return: iterate it with ``async for`` (prefetched) or ``for`` (sync sources).

    Each ``async for`` (each ``aiter()``) is a new pass that opens the source
    again; over a one-shot source (a generator) only the first: a second raises
    ``InvalidArgumentError`` (see the module docs, also for what ``break`` does
    to the batches fetched ahead). An exception the source raises (or raises
    while being closed at its end) reaches the ``async for`` as the same object;
    the pass has then failed,
    and every later ``anext`` on that iterator raises that object again rather
    than ``StopAsyncIteration``, so a failed input is never taken for a complete
    one. ``aclose()`` (or ``async with``) ends a pass early and closes the source.

    A batch from ``async for`` never changes under its user, even where the
    source refills one buffer for every element. A plain ``for`` fetches nothing
    ahead and copies nothing: on CPU devices its shards are views of the source's
    batch, which such a source changes when it makes the next one.
    """

    def __init__(
        self,
        strategy: Strategy,
        source_iterable: Any,
        options: InputOptions | None,
        *,
        per_replica_sources: bool = False,
        where: str = "experimental_distribute_dataset",
    ):
        self._strategy = strategy
        self._options = options_or_default(InputOptions, options)
        self._where = where
        self._source_iterable = source_iterable
        self._per_replica_sources = per_replica_sources  # from_function: see _open
        # The one-shot source (an iterator) that a pass has opened: no pass follows.
        self._one_shot: Any = None
        self._slots: Sequence[ReplicaSlot] = strategy._slots
        mode = self._options.experimental_replication_mode
        if not per_replica_sources and mode is InputReplicationMode.PER_REPLICA:
            raise InvalidArgumentError(
                f"{where}: options.experimental_replication_mode=PER_REPLICA is only for "
                "distribute_datasets_from_function, which calls dataset_fn once per replica "
                "(as in TF); experimental_distribute_dataset splits each global batch."
            )
        # Validated now, to fail at the call rather than at the first batch.
        for iterable in source_iterable if per_replica_sources else [source_iterable]:
            _check_iterable(iterable, where)

    def __repr__(self) -> str:
        return f"<DistributedDataset {self._describe()}>"

    def _describe(self) -> str:
        """Where it comes from, briefly: a list of batches is not printed whole (a
        list of 1000 batches made a repr of megabytes, slowly)."""
        sources = self._source_iterable if self._per_replica_sources else [self._source_iterable]
        n = len(self._slots)
        if not self._per_replica_sources:
            n = self._strategy.num_replicas_in_sync  # (every worker's)
            how = f"split over {n} replica{'s' if n != 1 else ''}"
        elif len(sources) == 1:
            how = f"its elements taken in turn by {n} replica{'s' if n != 1 else ''}"
        else:
            how = f"one per replica ({n}), the first shown"
        read = "; a one-shot source, read by a pass" if self._one_shot is not None else ""
        return f"{self._where} over {_describe_source(sources[0])}, {how}{read}"

    def __aiter__(self) -> DistributedIterator:
        return DistributedIterator(self)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self)

    # -- reading ---------------------------------------------------------------------

    def _open(self, sync: bool = False) -> Any:
        """The source(s) of a new pass; ``sync`` for a plain ``for``. One source is
        opened now; ``dataset_fn``'s are opened at the first read (``_Sources``).
        A one-shot source gives one pass: a second one is refused (``_read_once``)."""
        if self._one_shot is not None:
            raise self._read_once()
        iterables = self._source_iterable if self._per_replica_sources else [self._source_iterable]
        if self._per_replica_sources:
            first = self._strategy._replica_offset
            source: Any = _Sources(iterables, self._where, sync, first)
        else:
            source = _Source(self._source_iterable, self._where, sync)
        if sync and source.is_async:  # (before the pass counts: `async for` may follow)
            raise InvalidArgumentError(
                f"{self._where}: the dataset is an async iterable, so iterate it "
                "with `async for`, not a plain `for`."
            )
        self._one_shot = next((i for i in iterables if _is_one_shot(i, sync)), None)
        return source

    def _read_once(self) -> InvalidArgumentError:
        """A new pass over a one-shot source that an earlier pass read. It would
        silently get nothing (an epoch loop trained one epoch), or, where the
        earlier pass ended early, only the batches nobody had fetched yet."""
        kind = type(self._one_shot).__name__
        if self._per_replica_sources:
            made, remedy = (
                f"dataset_fn returned a {kind}",
                "Make dataset_fn return a re-iterable (a list, or an object whose "
                "__iter__ makes a new iterator), or call distribute_datasets_from_function "
                "again for each pass",
            )
        else:
            made, remedy = (
                f"the dataset is a {kind}",
                "Pass a re-iterable dataset (a list, or an object whose __iter__ makes a "
                "new iterator, such as a class whose __iter__ is your generator), or call "
                "experimental_distribute_dataset again for each pass",
            )
        return InvalidArgumentError(
            f"{self._where}: a new pass over this distributed dataset, but {made}, a "
            "one-shot iterator (iter() of it is itself) that an earlier pass already "
            "read: this pass would get nothing, or only what the earlier one left "
            "(one left early with break dropped what it had fetched ahead, and closed "
            f"a generator). {remedy} (for example, once per epoch)."
        )

    async def _next(self, source: Any, prefetching: bool = False) -> tuple[bool, Any]:
        """The next ``PerReplica`` batch. While a batch is in use the source may make
        its next element (``prefetching``, or replicas taking consecutive elements of
        one source), and a source may refill one buffer for every element, as data
        loaders do: then the shards are detached from the source's memory."""
        if isinstance(source, _Sources):
            more, shards = await source.next_shards(len(self._slots))
            detach = prefetching and not source.consecutive  # those are copies already
            what: Any = source.structures_differ  # (elements, not replicas' results)
        else:
            more, element = await source.next()
            shards = _local_shards(self._strategy, element) if more else None
            detach, what = prefetching, "yielded"
        return (True, self._place(shards, detach, what)) if more else (False, None)

    def _next_sync(self, source: Any) -> Any:
        coro = self._next(source)
        try:
            coro.send(None)
        except StopIteration as done:
            more, value = done.value
        else:  # only async sources suspend, and those were refused above
            coro.close()
            raise InvalidArgumentError(f"{self._where}: this dataset needs `async for`.")
        if not more:
            raise StopIteration
        return value

    def _place(self, shards: list, detach: bool, what: Any) -> Any:
        to_device = self._options.experimental_fetch_to_device
        if to_device or detach:
            if self._slots[0].backend.needs_activation:
                # GPUs: each replica's stream first waits for the work queued on its
                # device's current stream (where the source's arrays may have been
                # made); _placed_shard then issues the shard's copies on it.
                self._slots[0].backend.order_replicas_after(self._slots)
            shards = [
                _placed_shard(shard, slot, to_device, detach)
                for slot, shard in zip(self._slots, shards, strict=True)
            ]
            if self._slots[0].backend.needs_activation:
                # ... and the current streams' later work (the source's next element,
                # perhaps written into the same buffer, or into memory CuPy's pool
                # reuses once the source lets go of this one) waits for those copies.
                # A shard on the source's own device is copied on the replica's
                # stream only: nothing else orders the source's stream after it.
                self._slots[0].backend.order_after_replicas(self._slots)
        # One shard is returned as it is. An object every shard shares (sources
        # yielding one batch, read by a plain `for`) is a PerReplica too, as in TF.
        devices = tuple(slot.device for slot in self._slots)
        return regroup_wrapping_every_leaf(shards, devices, what=what)


def _placed_shard(shard: Any, slot: ReplicaSlot, to_device: bool, detach: bool) -> Any:
    """A replica's shard, each leaf placed (``_placed``) with the replica's device
    and stream current: on a GPU, the copies are ordered before the replica's later
    work, and their memory comes from the pool of the stream that uses and frees it
    (CuPy reuses freed memory only on the stream it was allocated on)."""
    token = slot.backend.activate(slot.device, slot.stream)
    try:
        return _nest.map_structure(lambda a: _placed(a, slot, to_device, detach), shard)
    finally:
        slot.backend.deactivate(token)


def _placed(array: Any, slot: ReplicaSlot, to_device: bool, detach: bool) -> Any:
    """One leaf of a shard, on the slot's device if ``to_device``; with ``detach``,
    a copy where it would still share the source's memory (the same object, or a
    view of it: a slice of the global batch). A transfer to a GPU is a copy
    already. tf.data, too, copies every element into new tensors."""
    placed = slot.backend.asarray(array, slot.device) if to_device else array
    if detach and (placed is array or getattr(placed, "base", None) is not None):
        return _copy_of_array(placed)
    return placed


def _copy_of_array(leaf: Any) -> Any:
    """A copy of a NumPy or CuPy array (on its own device); any other leaf as it is."""
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    if is_cupy_array(leaf):
        with leaf.device:  # CuPy copies onto the current device otherwise
            return leaf.copy()
    return leaf


class _Sources:
    """Input from ``dataset_fn``: one shared source (PER_WORKER) or one per replica.

    The replicas' sources are opened together, at the first read: when opening
    one raises, those opened before it are closed (nothing was read from them)
    and the error is raised, as a source's own error is.
    """

    def __init__(self, iterables: Sequence[Any], where: str, sync: bool, first_replica: int = 0):
        self._iterables, self._where, self._sync = iterables, where, sync
        self._sources: list[_Source] | None = None  # opened by the first next_shards
        self.is_async = any(_reads_async(iterable, sync) for iterable in iterables)
        # PER_WORKER: the replicas' shards are consecutive elements of one source,
        # copied as they are fetched (next_shards).
        self.consecutive = len(iterables) == 1
        # The last step's elements, for structures_differ: the index (in its
        # dataset) of the first, and how many each dataset gave (PER_WORKER: those
        # the replicas took; PER_REPLICA: one), and which replicas' datasets had
        # run out (PER_REPLICA).
        self._start = self._count = 0
        self._ran_out: list[int] = []
        self._first_replica = first_replica  # (global ids name the replicas)

    def structures_differ(self, path: str, described: list[str]) -> str:
        """The message for one step's shards whose structures differ (at ``path``;
        ``described``: each shard's, ``_describe``'s), through ``regroup``'s
        ``what``: the shards are a dataset's elements, not what replicas returned."""
        where = f" at {path}" if path else ""
        first, api = self._first_replica, "distribute_datasets_from_function"
        if self.consecutive:
            start, count = self._start, self._count
            seen = "; ".join(
                f"element {start + i}: {text}"
                if i < count
                else f"replica {first + i}: an empty batch (the dataset ran out)"
                for i, text in enumerate(described)
            )
            return (
                f"{api}: dataset_fn's dataset yielded elements of different structures"
                f"{where} ({seen}); with InputReplicationMode.PER_WORKER the local replicas "
                "take consecutive elements of the one dataset as one step's batches, so "
                "every element must have the same nesting of lists, tuples and dicts."
            )
        seen = "; ".join(
            f"replica {first + i}'s: "
            + ("an empty batch (its dataset ran out)" if i in self._ran_out else text)
            for i, text in enumerate(described)
        )
        return (
            f"{api}: the replicas' datasets yielded elements of different structures{where} "
            f"at their element {self._start} ({seen}); with InputReplicationMode.PER_REPLICA "
            "each replica takes one element of its own dataset (dataset_fn's, called with "
            "its InputContext) per step, so every dataset's elements must have the same "
            "nesting of lists, tuples and dicts."
        )

    async def _open(self) -> list[_Source]:
        self._sources = []
        try:
            for iterable in self._iterables:
                self._sources.append(_Source(iterable, self._where, self._sync))
        except BaseException as exc:
            try:
                await self.aclose()
            except Exception as close_error:  # the cause stays what is raised
                _note_close_error(exc, close_error)
            raise
        return self._sources

    async def next_shards(self, num_replicas: int) -> tuple[bool, list | None]:
        sources = self._sources if self._sources is not None else await self._open()
        # None below stands for "this replica's source has run out", so an element
        # that is None is refused as it comes: it was taken for the end of a
        # PER_REPLICA source (an empty batch in its place, or the end of the
        # iteration), and PER_WORKER raised "coroutine raised StopIteration".
        if len(sources) == 1:  # PER_WORKER: replicas take consecutive elements
            shards = []
            self._start += self._count
            for replica in range(num_replicas):
                more, element = await sources[0].next()
                if not more:
                    break
                if element is None:
                    raise _none_element(replica)
                # Copied before the next element is made: the source may refill one buffer.
                shards.append(_nest.map_structure(_copy_of_array, element))
            self._count = len(shards)
        else:  # PER_REPLICA: one element from each replica's own source
            shards = []
            self._start, self._count = self._start + self._count, 1
            for replica, source in enumerate(sources):
                more, element = await source.next()
                if more and element is None:
                    raise _none_element(replica)
                shards.append(element if more else None)
            if all(shard is None for shard in shards):
                shards = []
            self._ran_out = [i for i, shard in enumerate(shards) if shard is None]
        if not shards:
            return False, None
        if len(shards) == num_replicas and all(s is not None for s in shards):
            return True, shards  # elements as dataset_fn made them, batched or not (as TF)
        template = next(s for s in shards if s is not None)
        _leaf_arrays(
            template,
            "distribute_datasets_from_function",
            "a replica whose source has run out gets an empty batch (axis 0 of length 0) "
            "while another replica still gets an element, so every leaf of an element "
            "must then have a batch axis",
        )
        shards = [s if s is not None else _empty_like(template) for s in shards]
        shards += [_empty_like(template)] * (num_replicas - len(shards))
        return True, shards

    def sync_iterators(self) -> list[Iterator]:
        """The sync iterators of the replicas' sources opened so far, to close."""
        return [iterator for source in self._sources or [] for iterator in source.sync_iterators()]

    async def aclose(self) -> None:
        """Close every replica's source opened so far (each once), also when
        closing one raises: the first error is raised once all of them are closed."""
        sources, self._sources = self._sources or [], []
        error: Exception | None = None
        for source in sources:
            try:
                await source.aclose()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error


def _none_element(replica: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        "distribute_datasets_from_function: the dataset from dataset_fn yielded None "
        f"(the element for local replica {replica}); expected an element: an array, or "
        "a nested structure (list, tuple, dict) of them."
    )


def from_function(
    strategy: Strategy, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None
) -> DistributedDataset:
    """``strategy.distribute_datasets_from_function``."""
    if not callable(dataset_fn):
        raise not_callable(
            dataset_fn,
            f"distribute_datasets_from_function: dataset_fn={dataset_fn!r} is not callable; "
            "expected a function taking an InputContext and returning an iterable.",
        )
    options = options_or_default(InputOptions, options)
    n = strategy.num_replicas_in_sync  # every worker's replicas
    first, local = strategy._replica_offset, len(strategy._slots)
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        contexts = [InputContext(n, first + r, n) for r in range(local)]
    else:  # one pipeline per worker
        world = strategy._world
        workers, rank = (1, 0) if world is None else (world.size, world.rank)
        contexts = [InputContext(workers, rank, n)]
    iterables: list = []
    try:
        for context in contexts:
            iterables.append(dataset_fn(context))
        refuse_awaitables(
            iterables,
            lambda: (
                f"distribute_datasets_from_function: dataset_fn={dataset_fn!r} returned an "
                "awaitable; it is called, not awaited, so it must be a plain function "
                "(def, not async def) returning an iterable or async iterable of batches "
                "(an async generator is one)."
            ),
        )
        for context, iterable in zip(contexts, iterables, strict=True):

            def made_by(context: InputContext = context) -> str:
                return f"dataset_fn={dataset_fn!r}, called with {context!r},"

            _check_iterable(iterable, "distribute_datasets_from_function", made_by)
        return DistributedDataset(
            strategy,
            iterables,
            options,
            per_replica_sources=True,
            where="distribute_datasets_from_function",
        )
    except BaseException as exc:
        # A call of dataset_fn raised, or returned what cannot be read: nobody will
        # read what the others returned, so close it, as reading it would have.
        try:
            _close_iterators(iterables)
        except Exception as close_error:  # the cause stays what is raised
            _note_close_error(exc, close_error)
        raise


def _note_close_error(exc: BaseException, close_error: Exception) -> None:
    """Tell, on ``exc`` (what is raised), that closing the sources opened before it
    failed too: ``close_error`` would otherwise replace it, the cause left only as
    its ``__context__``."""
    exc.add_note(f"(closing the sources opened for other replicas also failed: {close_error!r})")


def _close_iterators(objects: list) -> None:
    """Close the sync iterators among ``objects`` (generators, open files, readers
    with ``close()``: one-shot sources, which aiodist closes once it has read them),
    all of them, also when closing one raises: then the first error is raised. An
    iterable that is not its own iterator is not closed (reading opens a new
    iterator of it: its ``iter()``), nor an async iterator (its ``aclose()`` would
    need a loop; an async generator not yet started holds nothing to release)."""
    error: Exception | None = None
    for obj in objects:
        close = getattr(obj, "close", None)
        if getattr(type(obj), "__next__", None) is not None and callable(close):
            try:
                close()
            except Exception as exc:
                error = error or exc
    if error is not None:
        raise error
