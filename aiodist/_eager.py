"""Eager coroutines: run the first step now, make a task only if it suspends.

Cross-replica code is often ``async`` without ever waiting on anything (a
``merge_fn`` awaiting ``strategy.reduce`` on CPU devices completes in one
step). Creating a task for it would cost a task and a loop iteration per
collective. ``start_eagerly`` steps the coroutine once, in the given context:
if it finishes, its result is returned at once; if it suspends, the rest runs
in a task that first hands the already-yielded future to the event loop, then
resumes the coroutine exactly where it stopped (what Python 3.12's eager task
factory does for a whole loop, for one coroutine here).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any

from ._streams import step_through

__all__ = ["Pending", "start_eagerly"]


class Pending:
    """The coroutine suspended: ``task`` finishes it."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task):
        self.task = task


async def _finish(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await step_through(coro, yielded=yielded)


def start_eagerly(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> Any:
    """Step ``coro`` once in ``context``: its result, or ``Pending`` with the task
    (running in ``context``) that completes it. Exceptions of the first step
    propagate."""
    try:
        yielded = context.run(coro.send, None)
    except StopIteration as stop:
        return stop.value
    task = asyncio.get_running_loop().create_task(_finish(coro, yielded), context=context)
    return Pending(task)
