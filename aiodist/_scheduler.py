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
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _context, _nest
from ._devices import Device
from ._errors import ContextError, ReplicaExitedError
from ._options import CommunicationOptions
from ._rendezvous import Rendezvous, Signature
from ._replica_context import MergePayload, ReplicaContext
from ._streams import drive
from ._values import regroup, select_replica

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = ["ReplicaSlot", "RunGroup"]


class ReplicaSlot(NamedTuple):
    """Where one replica runs: its id, device, backend and stream (None on CPU)."""

    replica_id: int
    device: Device
    backend: Any
    stream: Any


class RunGroup:
    """The replicas of one ``strategy.run`` and their rendezvous."""

    def __init__(self, strategy: Strategy, slots: Sequence[ReplicaSlot]):
        self.strategy = strategy
        self.slots = tuple(slots)
        self.num_replicas = len(self.slots)
        self.devices = tuple(slot.device for slot in self.slots)
        self.rendezvous = Rendezvous(self.num_replicas, self._execute)
        self.contexts = tuple(
            ReplicaContext(strategy, slot.replica_id, self, slot) for slot in self.slots
        )
        self._aux: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._cancelling = False  # set once this run cancels its replicas
        self._base: contextvars.Context | None = None

    def __repr__(self) -> str:
        return f"<RunGroup replicas={self.num_replicas} {self.rendezvous!r}>"

    # -- collectives (called by ReplicaContext) -----------------------------------

    def arrive(
        self, replica_id: int, signature: Signature, payload: Any, options: CommunicationOptions
    ) -> asyncio.Future:
        return self.rendezvous.arrive(replica_id, signature, payload, options.timeout_seconds)

    # -- the run ----------------------------------------------------------------------

    async def run(self, fn: Callable, args: Sequence, kwargs: dict) -> object:
        loop = asyncio.get_running_loop()
        base = contextvars.copy_context()
        base.run(_context.set_state, _context.replica_state(self.strategy, None))
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

        for slot, replica_ctx in zip(self.slots, self.contexts, strict=True):
            rid = slot.replica_id
            replica_args = select_replica(rid, tuple(args), self.num_replicas)
            replica_kwargs = select_replica(rid, kwargs, self.num_replicas)
            context = base.copy()
            context.run(_context.set_state, _context.replica_state(self.strategy, replica_ctx))
            task = loop.create_task(
                self._replica_main(slot, fn, replica_args, replica_kwargs),
                name=f"aiodist-replica-{rid}",
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
            self.rendezvous.close()
        if self._failure is not None:
            raise self._failure
        results = [task.result() for task in self._tasks]
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
                if inspect.iscoroutine(result):
                    result = await drive(
                        result,
                        lambda: slot.backend.activate(slot.device, slot.stream),
                        slot.backend.deactivate,
                    )
                elif inspect.isawaitable(result):
                    result = await result
            else:
                result = fn(*args, **kwargs)
                if inspect.isawaitable(result):
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
            self.rendezvous.replica_exited(rid, "was cancelled")
            raise
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
                if self.rendezvous.delivered(exc):
                    # A failed collective (mismatch, exit, timeout, merge_fn error):
                    # every replica waiting in it has its wake-up queued already; let
                    # each raise the error before the rest are cancelled.
                    asyncio.get_running_loop().call_soon(self._cancel_all)
                else:
                    self._cancel_all()
            self.rendezvous.replica_exited(rid, f"raised {type(exc).__name__}")
            raise
        self.rendezvous.replica_exited(rid, "returned")
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

    def _cross_replica_context(self) -> contextvars.Context:
        context = contextvars.copy_context()
        context.run(_context.set_state, _context.replica_state(self.strategy, None))
        return context

    async def run(self, fn: Callable, args: Sequence, kwargs: dict) -> object:
        raise ContextError("the default replica group cannot run functions; use strategy.run.")
