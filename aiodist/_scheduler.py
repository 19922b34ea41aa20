"""The scheduler: one ``RunGroup`` per ``strategy.run``.

A run group owns

- one asyncio task per replica, each created in its own copy of the caller's
  ``contextvars`` context with that replica's ``ReplicaContext`` current, and,
  on backends with streams, driven by ``_streams.drive`` so the replica's device
  and stream are current on every step;
- one ``Rendezvous`` engine matching the replicas' collective calls, whose
  ``execute`` callback (``_execute`` here) runs the cross-replica side exactly
  once per call: ``merge_fn`` in cross-replica context, or the cross-device op;
- supervision with ``TaskGroup`` semantics: the first replica to raise cancels
  every other replica (and any running merge_fn), the run waits for all of them,
  then re-raises that same exception object. Cancelling the caller cancels every
  replica the same way. When ``run`` returns or raises, nothing it started is
  still running.

asyncio objects are created here, per run, on the running loop: a strategy
outlives event loops (pytest-asyncio, uvicorn reloads) and holds none.

Cross-replica work is bracketed by the backend hooks ``begin_cross_replica`` /
``end_cross_replica`` (CUDA events on GPUs, nothing on CPUs), so it is ordered
after every replica's pending work and before every replica's later work
without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Callable, Sequence
from types import CoroutineType, GeneratorType
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _context, _nest
from ._devices import Device
from ._errors import ContextError, ReplicaExitedError
from ._options import CommunicationOptions
from ._rendezvous import Rendezvous, Signature
from ._replica_context import MergePayload, ReplicaContext
from ._streams import drive
from ._values import DistributedValues, regroup, select_replica

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = ["ReplicaSlot", "RunGroup"]


_TASK_NAMES = tuple(f"aiodist-replica-{i}" for i in range(64))
_AWAITABLE_BY_TYPE: dict[type, bool] = {}


def _awaitable(value: object) -> bool:
    """``inspect.isawaitable``, cached per type (it is called once per replica per run)."""
    kind = type(value)
    known = _AWAITABLE_BY_TYPE.get(kind)
    if known is None:
        known = inspect.isawaitable(value)
        if kind is GeneratorType:  # depends on the generator's code flags, not its type
            return known
        _AWAITABLE_BY_TYPE[kind] = known
    return known


def _may_hold_distributed(values: Any) -> bool:
    """False when no element of ``values`` is, or may contain, a distributed value."""
    return any(isinstance(v, DistributedValues | list | tuple | dict) for v in values)


class ReplicaSlot(NamedTuple):
    """Where one replica runs: its id, device, backend and stream (None on CPU)."""

    replica_id: int
    device: Device
    backend: Any
    stream: Any


class RunGroup:
    """The replicas of one ``strategy.run`` and their rendezvous."""

    def __init__(self, strategy: Strategy, slots: tuple[ReplicaSlot, ...]):
        self.strategy = strategy
        self.slots = slots
        self.num_replicas = len(slots)
        self.devices = tuple(slot.device for slot in slots)
        # Created by run(); a run whose replicas never meet creates no rendezvous.
        self.contexts: tuple[ReplicaContext, ...] = ()
        self._rendezvous: Rendezvous | None = None
        self._exits: list[tuple[int, str]] = []  # replica exits before the rendezvous existed
        self._finished = False
        self._aux: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._cancelling = False  # set once this run cancels its replicas
        self._base: contextvars.Context | None = None

    def __repr__(self) -> str:
        return f"<RunGroup replicas={self.num_replicas} {self._rendezvous!r}>"

    # -- collectives (called by ReplicaContext) -----------------------------------

    @property
    def rendezvous(self) -> Rendezvous:
        """The group's rendezvous engine, made at the first collective call."""
        if self._rendezvous is None:
            self._rendezvous = Rendezvous(self.num_replicas, self._execute)
            for replica, how in self._exits:
                self._rendezvous.replica_exited(replica, how)
            if self._finished:
                self._rendezvous.close()
        return self._rendezvous

    def _replica_exited(self, replica: int, how: str) -> None:
        if self._rendezvous is None:
            self._exits.append((replica, how))
        else:
            self._rendezvous.replica_exited(replica, how)

    def arrive(
        self, replica_id: int, signature: Signature, payload: Any, options: CommunicationOptions
    ) -> asyncio.Future:
        return self.rendezvous.arrive(replica_id, signature, payload, options.timeout_seconds)

    # -- the run ----------------------------------------------------------------------

    async def run(self, fn: Callable, args: Sequence, kwargs: dict) -> object:
        loop = asyncio.get_running_loop()
        base = contextvars.copy_context()
        set_state = _context.set_state
        base.run(set_state, _context.replica_state(self.strategy, None))
        self._base = base
        all_done = loop.create_future()
        remaining = self.num_replicas

        def on_done(task: asyncio.Task) -> None:
            nonlocal remaining
            remaining -= 1
            if not task.cancelled():
                task.exception()  # retrieved here; the run re-raises the first failure
            if remaining == 0 and not all_done.done():
                all_done.set_result(None)

        # Arguments holding no distributed value (the common case) go to every
        # replica as they are: no per-replica walk of the structure.
        plain = not _may_hold_distributed(args) and not _may_hold_distributed(kwargs.values())
        n = self.num_replicas
        strategy = self.strategy
        self.contexts = contexts = tuple(
            ReplicaContext(strategy, slot.replica_id, self, slot) for slot in self.slots
        )
        for slot, replica_ctx in zip(self.slots, contexts, strict=True):
            rid = slot.replica_id
            if plain:
                replica_args, replica_kwargs = args, kwargs
            else:
                replica_args = select_replica(rid, tuple(args), n)
                replica_kwargs = select_replica(rid, kwargs, n)
            context = base.copy()
            context.run(set_state, _context.replica_state(self.strategy, replica_ctx))
            task = loop.create_task(
                self._replica_main(slot, fn, replica_args, replica_kwargs),
                name=_TASK_NAMES[rid] if rid < len(_TASK_NAMES) else f"aiodist-replica-{rid}",
                context=context,
            )
            task.add_done_callback(on_done)
            self._tasks.append(task)

        try:
            await all_done
            if self._aux:  # merge_fns still running for collectives nobody awaited
                await self._drain()
        except asyncio.CancelledError:
            self._cancel_all()
            await self._drain()
            raise
        finally:
            self._finished = True
            if self._rendezvous is not None:
                self._rendezvous.close()
            tasks, self._tasks = self._tasks, []
            # Break group -> task -> context -> ReplicaContext -> group, so a finished
            # run is freed by reference counting instead of becoming cyclic garbage.
            self.contexts = ()
        if self._failure is not None:
            raise self._failure
        results = [task.result() for task in tasks]
        if self.num_replicas == 1:
            return results[0]
        return regroup(results, self.devices)

    async def _replica_main(
        self, slot: ReplicaSlot, fn: Callable, args: tuple, kwargs: dict
    ) -> object:
        rid = slot.replica_id
        try:
            if slot.backend.needs_activation:
                token = slot.backend.activate(slot.device, slot.stream)
                try:
                    result = fn(*args, **kwargs)
                finally:
                    slot.backend.deactivate(token)
                if type(result) is CoroutineType:
                    result = await drive(
                        result,
                        lambda: slot.backend.activate(slot.device, slot.stream),
                        slot.backend.deactivate,
                    )
                elif _awaitable(result):
                    result = await result
            else:
                result = fn(*args, **kwargs)
                if type(result) is CoroutineType or _awaitable(result):
                    result = await result
        except asyncio.CancelledError:
            if not self._cancelling and self._failure is None:
                # Cancelled by something other than this run: it cannot finish.
                self._failure = ReplicaExitedError(
                    f"replica {rid} was cancelled by something other than its run (for "
                    "example asyncio.current_task().cancel() in the replica function), so "
                    "the run has no result for it; raise an exception to fail a replica."
                )
                self._cancel_all()
            self._replica_exited(rid, "was cancelled")
            raise
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
                if self._rendezvous is not None and self._rendezvous.delivered(exc):
                    # A failed collective (mismatch, exit, timeout, merge_fn error):
                    # every replica waiting in it has its wake-up queued already; let
                    # each raise the error before the rest are cancelled.
                    asyncio.get_running_loop().call_soon(self._cancel_all)
                else:
                    self._cancel_all()
            self._replica_exited(rid, f"raised {type(exc).__name__}")
            raise
        self._replica_exited(rid, "returned")
        return result

    def _cancel_all(self) -> None:
        self._cancelling = True
        current = asyncio.current_task()
        for task in (*self._tasks, *self._aux):
            if task is not current and not task.done():
                task.cancel()

    async def _drain(self) -> None:
        """Wait until every replica and merge task has finished, even if cancelled again."""
        while pending := [t for t in (*self._tasks, *self._aux) if not t.done()]:
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError:
                self._cancel_all()

    # -- cross-replica execution (called once per completed collective) -------------

    def _cross_replica_context(self) -> contextvars.Context:
        assert self._base is not None
        return self._base.copy()

    def _spawn(self, coro: Any, context: contextvars.Context) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, context=context)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)
        return task

    def _execute(self, number: int, signature: Signature, payloads: list) -> Any:
        backend = self.slots[0].backend
        token = backend.begin_cross_replica(self.slots)
        if signature.name == "merge_call":
            return self._merge(payloads, backend, token)
        try:
            ops = self.strategy.extended._cross_device_ops
            first = payloads[0]
            arrays = [payload.arrays for payload in payloads]
            if signature.name == "all_reduce":
                out = ops._all_reduce_flat(first.op, arrays, self.devices, first.options)
            else:
                out = ops._all_gather_flat(arrays, first.axis, self.devices, first.options)
        finally:
            backend.end_cross_replica(token, self.slots)
        if payloads[0].template is None:  # one array each (signatures matched)
            return [leaves[0] for leaves in out]
        return [_nest.pack_as(p.template, leaves) for p, leaves in zip(payloads, out, strict=True)]

    def _merge(self, payloads: list[MergePayload], backend: Any, token: object) -> Any:
        merge_fn = payloads[0].merge_fn
        what = "passed to merge_call"
        args = regroup([p.args for p in payloads], self.devices, what=what, path="args")
        kwargs = regroup([p.kwargs for p in payloads], self.devices, what=what, path="kwargs")
        context = self._cross_replica_context()
        try:
            result = context.run(merge_fn, self.strategy, *args, **kwargs)
        except BaseException:
            backend.end_cross_replica(token, self.slots)
            raise
        if not inspect.isawaitable(result):
            backend.end_cross_replica(token, self.slots)
            return self._for_each_replica(result)

        async def finish() -> list:
            try:
                value = await result
            finally:
                backend.end_cross_replica(token, self.slots)
            return self._for_each_replica(value)

        return self._spawn(finish(), context)

    def _for_each_replica(self, value: object) -> list:
        return [select_replica(i, value, self.num_replicas) for i in range(self.num_replicas)]


class DefaultGroup(RunGroup):
    """The one-replica group behind the default replica context (outside any scope).

    Collectives there complete at once; a merge_fn runs in the default strategy's
    cross-replica context, built from the caller's context at each call.
    """

    def __init__(self, strategy: Strategy, slots: tuple[ReplicaSlot, ...]):
        super().__init__(strategy, slots)
        self.contexts = (ReplicaContext(strategy, 0, self, slots[0]),)

    def _cross_replica_context(self) -> contextvars.Context:
        context = contextvars.copy_context()
        context.run(_context.set_state, _context.replica_state(self.strategy, None))
        return context

    async def run(self, fn: Callable, args: Sequence, kwargs: dict) -> object:
        raise ContextError("the default replica group cannot run functions; use strategy.run.")
