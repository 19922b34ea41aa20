"""Driving a replica coroutine with its device and stream current.

CuPy's current device and stream are per *thread*, and every coroutine on an
event loop shares one thread. So a replica coroutine is not awaited directly:
``drive`` steps it by hand, making the replica's device and stream current just
before each step (its start and every resume) and restoring the previous ones
as soon as the step yields back to the loop. Other tasks on the loop therefore
never run on a replica's stream, and a replica never runs on another's.

The rule this gives user code: never hold ``with stream:`` or ``with device:``
across an ``await`` (the block would span other tasks' steps).

On backends without streams (CPU) ``needs_activation`` is False and the
scheduler awaits the coroutine directly: this costs nothing there.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

__all__ = ["drive"]


@types.coroutine
def _stepper(
    coro: Coroutine[Any, Any, Any],
    activate: Callable[[], object],
    deactivate: Callable[[object], None],
) -> Generator[Any, Any, Any]:
    send: Any = None
    throw: BaseException | None = None
    while True:
        token = activate()
        try:
            if throw is None:
                yielded = coro.send(send)
            else:
                yielded, throw = coro.throw(throw), None
        except StopIteration as stop:
            return stop.value
        finally:
            deactivate(token)
        try:
            send = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # CancelledError included: forwarded into coro
            send, throw = None, exc


async def drive(
    coro: Coroutine[Any, Any, Any],
    activate: Callable[[], object],
    deactivate: Callable[[object], None],
) -> Any:
    """Await ``coro`` with ``activate()`` before and ``deactivate(token)`` after each step."""
    return await _stepper(coro, activate, deactivate)
