"""``aiodist.run``: run a coroutine on uvloop when it is installed, else on asyncio."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ._errors import ContextError, InvalidArgumentError

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's ``new_event_loop`` when uvloop imports, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T] | Awaitable[T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a new event loop (uvloop when installed).

    ``main`` is a coroutine, ``main()``; as with ``asyncio.run`` on Python 3.14
    and later, any other awaitable is accepted too (on every Python aiodist
    supports), but a ``Future`` or ``Task`` belongs to the loop it was made on,
    which is not this new one. Anything else (the coroutine function ``main``
    itself, ``42``) raises ``InvalidArgumentError`` (a ``ValueError``, as
    ``asyncio.run`` raises) saying so, before any loop is made.

    Like ``asyncio.run``, it cannot be called where an event loop is already
    running (inside async code, or a Jupyter notebook's cell): there, ``await
    main`` instead; ``ContextError`` says so."""
    if not asyncio.iscoroutine(main):
        if not inspect.isawaitable(main):
            raise InvalidArgumentError(_not_awaitable(main))
        main = _awaiting(main)  # (asyncio.Runner takes coroutines only before 3.14)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        if asyncio.iscoroutine(main):
            main.close()  # (refused: not left to warn "never awaited" on top of this)
        # Checked before the Runner exists: its own check fired inside the `with`
        # block, and closing the Runner then tried to run the new loop too, which
        # raised "Cannot run the event loop while another loop is running" over the
        # real reason and left a `shutdown_asyncgens` coroutine never awaited.
        raise ContextError(
            "aiodist.run() was called while an event loop is already running in this "
            "thread (inside async code, or in a Jupyter/IPython notebook, which runs "
            "one); there, await the coroutine instead: `await main()` in place of "
            "`aiodist.run(main())`."
        )
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def _awaiting(awaitable: Awaitable[T]) -> T:
    """``awaitable`` (not a coroutine) as a coroutine, for ``asyncio.Runner.run``."""
    return await awaitable


def _not_awaitable(main: object) -> str:
    """``run``'s message for a ``main`` that cannot be awaited."""
    if callable(main):
        name = getattr(main, "__qualname__", None) or repr(main)
        what = "coroutine function" if inspect.iscoroutinefunction(main) else "function"
        return (
            f"aiodist.run() takes a coroutine, but got the {what} {name} itself; call it: "
            f"pass {name}() - the coroutine - not {name}, as in aiodist.run({name}())."
        )
    return (
        f"aiodist.run() takes a coroutine (or another awaitable), but got "
        f"{type(main).__name__} ({main!r:.80}); pass main() - the coroutine of your "
        "async def main() - as in aiodist.run(main())."
    )
