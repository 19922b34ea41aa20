"""Waiting for work outside Python (a GPU, MPI) from the event loop, without blocking it.

``until(done)`` calls ``done()`` at once, then again after pauses that grow
from 50 µs to 2 ms: a short wait costs little latency, a long one little CPU,
and the loop serves other tasks in between. Nothing runs on another thread and
no future is resolved from a foreign callback (CUDA host callbacks that resolve
futures have deadlocked other libraries, numba-cuda#317).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["next_pause", "until"]

FIRST_PAUSE = 50e-6
LONGEST_PAUSE = 2e-3


def next_pause(pause: float) -> float:
    """The pause after one of ``pause`` seconds: 0, 50 µs, 100 µs, ... 2 ms."""
    return min(max(pause * 2, FIRST_PAUSE), LONGEST_PAUSE)


async def until(done: Callable[[], bool]) -> None:
    """Return once ``done()`` is true (bound it with ``asyncio.timeout()``).
    Exceptions from ``done()`` propagate."""
    pause = 0.0
    while not done():
        await asyncio.sleep(pause)
        pause = next_pause(pause)
