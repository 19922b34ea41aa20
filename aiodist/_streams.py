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

__all__ = ["drive", "step_through"]


@types.coroutine
def step_through(
    coro: Coroutine[Any, Any, Any],
    activate: Callable[[], object] | None = None,
    deactivate: Callable[[object], None] | None = None,
    *,
    resume: tuple[Any, BaseException | None] | None = None,
) -> Generator[Any, Any, Any]:
    """Drive ``coro`` step by step, forwarding every value and exception;
    ``activate()`` / ``deactivate(token)`` bracket each step (device and stream
    current, see above).

    ``resume``: ``coro`` has already taken its first step elsewhere (an eagerly
    started task's, see ``RunGroup._merge``), which yielded ``resume[0]``;
    that value is yielded first, unless ``resume[1]`` is an exception to throw into
    ``coro`` at once."""
    send: Any = None
    throw: BaseException | None = None
    yielded: Any = None
    started = True
    if resume is not None:
        yielded, throw = resume
        started = throw is not None
    while True:
        if not started:
            try:
                send, throw = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # CancelledError included: forwarded into coro
                send, throw = None, exc
        started = False
        try:
            token = activate() if activate is not None else None
        except BaseException:
            # The step never ran (no device or stream to run it on): close coro now,
            # or it would be left unstarted ("coroutine ... was never awaited") or
            # suspended, its finally blocks run whenever it is garbage collected.
            coro.close()
            raise
        try:
            yielded = coro.send(send) if throw is None else coro.throw(throw)
        except StopIteration as stop:
            return stop.value
        except BaseException:
            # Not kept in this frame, which the traceback of what leaves it holds: an
            # exception thrown in (a cancellation) that coro lets through would hold
            # itself, a cycle left for the garbage collector per cancelled coroutine.
            send = throw = yielded = None
            raise
        finally:
            if deactivate is not None:
                deactivate(token)


async def drive(
    coro: Coroutine[Any, Any, Any],
    activate: Callable[[], object],
    deactivate: Callable[[object], None],
) -> Any:
    """Await ``coro`` with ``activate()`` before and ``deactivate(token)`` after each step."""
    return await step_through(coro, activate, deactivate)
