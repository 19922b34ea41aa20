"""``aiodist.run``: run a coroutine on uvloop when it is installed, else on asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ._errors import ContextError

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's ``new_event_loop`` when uvloop imports, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a new event loop (uvloop when installed).

    Like ``asyncio.run``, it cannot be called where an event loop is already
    running (inside async code, or a Jupyter notebook's cell): there, ``await
    main`` instead; ``ContextError`` says so."""
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
