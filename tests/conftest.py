"""Every async test runs on asyncio and on uvloop (pytest-asyncio's loop-factory hook)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import aiodist

try:
    import uvloop
except ImportError:  # Windows, or not installed
    uvloop = None


def _uvloop_factory() -> asyncio.AbstractEventLoop:
    if uvloop is None:
        pytest.skip("uvloop is not installed (pip install uvloop; not available on Windows)")
    return uvloop.new_event_loop()


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": _uvloop_factory}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On uvloop, pytest-timeout's default method (a SIGALRM handler raising in the
    main thread) cannot stop a hung test: uvloop runs the handler as a loop callback
    and only logs what it raises, so the test, and CI, hung for ever. Those tests use
    its "thread" method: past the timeout it prints every thread's stack and ends
    the run (exit code 1). Tests on asyncio keep the signal method, which fails the
    one test and goes on. (Each test's own timeout, or the ini's, is kept.)"""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("_asyncio_loop_factory") is not _uvloop_factory:
            continue
        own = item.get_closest_marker("timeout")
        seconds = own.kwargs.get("timeout", own.args[0] if own.args else None) if own else None
        if seconds is None:  # --timeout, else the ini's
            given = config.getoption("timeout", None)
            seconds = float(given if given is not None else config.getini("timeout") or 0) or None
        if seconds is not None:
            item.add_marker(pytest.mark.timeout(seconds, method="thread"), append=False)


ROOT = Path(__file__).resolve().parent.parent


def scalar_cases(dtypes, ops) -> list[tuple]:
    """(dtype, op) pairs for tests comparing scalar reductions with array ones, but
    complex products: NumPy's vector loop multiplies complex numbers otherwise than
    its scalar one."""
    return [(d, op) for d in dtypes for op in ops if not (d == np.complex64 and op == "product")]


def cpu_devices(n: int) -> list[str]:
    return [f"cpu:{i}" for i in range(n)]


def run_demo(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m aiodist *flags`` in this checkout, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "aiodist", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def task_factory(factory):
    """The running loop makes its tasks with ``factory`` inside the block."""
    loop = asyncio.get_running_loop()
    loop.set_task_factory(factory)
    try:
        yield
    finally:
        loop.set_task_factory(None)


def _runqueue_wait() -> float | None:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux's
    /proc/thread-self/schedstat, second field); None where the system has no such
    file."""
    try:
        with open("/proc/thread-self/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@contextlib.asynccontextmanager
async def loop_lag(period: float = 0.005):
    """While the block runs, a task sleeps ``period`` seconds again and again; yields
    the list of how late (seconds) each sleep woke, filled as the block runs.

    Where the system tells it (Linux), the time the loop's thread spent waiting for a
    CPU while other processes held both is not counted: that lateness is the machine's
    load (another test run, a build), not a loop kept busy. Time the thread ran, or
    waited for the GIL, or slept in a blocking call, is counted."""
    lateness: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        while not stop.is_set():
            before, waited = time.perf_counter(), _runqueue_wait()
            await asyncio.sleep(period)
            late = time.perf_counter() - before - period
            if waited is not None:
                late = max(0.0, late - (_runqueue_wait() - waited))
            lateness.append(late)

    tick = asyncio.create_task(ticker())
    try:
        yield lateness
    finally:
        stop.set()
        await tick


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}rep")
def num_replicas(request) -> int:
    """1, 2 and 4 CPU replicas."""
    return request.param


@pytest.fixture
def strategy(num_replicas) -> aiodist.MirroredStrategy:
    """A MirroredStrategy with ``num_replicas`` CPU replicas."""
    return aiodist.MirroredStrategy(cpu_devices(num_replicas))


@pytest.fixture
def two() -> aiodist.MirroredStrategy:
    return aiodist.MirroredStrategy(cpu_devices(2))


@pytest.fixture
def three() -> aiodist.MirroredStrategy:
    return aiodist.MirroredStrategy(cpu_devices(3))


async def wait_until(predicate, what: str, max_iterations: int = 10_000) -> None:
    """Yield to the loop until ``predicate()`` holds (no sleeps); fail if it never does."""
    for _ in range(max_iterations):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never reached: {what}")


async def assert_no_cyclic_garbage(
    case, *, warm_up: int = 5, repeats: int = 20, settled=None, errors: tuple = ()
) -> None:
    """Await ``case()`` ``warm_up`` times (caches, first-use objects), then ``repeats``
    times with the garbage collector off: it must then find nothing to collect, so
    reference counting freed every object those calls made. ``errors``: exceptions
    ``case()`` raises on purpose, suppressed. ``settled``: awaited after the warm-up
    and after the repeats (work the calls leave running, to let end first)."""

    async def once() -> None:
        with contextlib.suppress(*errors):
            await case()

    for _ in range(warm_up):
        await once()
    if settled is not None:
        await settled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            await once()
        if settled is not None:
            await settled()
        name = getattr(case, "__name__", None) or repr(case)
        assert gc.collect() == 0, f"{name} left cyclic garbage"
    finally:
        gc.enable()


def assert_usage_error(main, argv: list[str], shown: str, capsys) -> None:
    """``main(argv)`` (a command line's entry point) ends as argparse ends a bad
    command line: exit code 2, ``shown`` in what it printed to stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert shown in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_leaked_state():
    """Every test starts and ends outside any strategy scope."""
    assert not aiodist.has_strategy()
    yield
    assert not aiodist.has_strategy()
