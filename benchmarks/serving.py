"""Serving benchmark: the example server (Starlette, uvicorn) batched against unbatched.

The server runs in this process on the event loop under test; the load comes
from another process (so the two do not share a GIL), at a fixed concurrency.
Reports requests per second and the p50/p99 latency seen by the client.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CLIENT = """
import asyncio, json, sys, time
sys.path.insert(0, {root!r})
from examples.client import http
async def main():
    gate = asyncio.Semaphore({concurrency})
    payload = json.dumps({{"inputs": [[0.25] * 16]}}).encode()
    latencies = []
    async def one():
        async with gate:
            start = time.perf_counter()
            status, _ = await http({port}, "POST", "/predict", payload)
            assert status == 200, status
            latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range({total})))
    print(json.dumps({{"seconds": time.perf_counter() - start, "latencies": latencies}}))
asyncio.run(main())
"""


def available() -> bool:
    return all(importlib.util.find_spec(name) for name in ("starlette", "uvicorn"))


def _serve_module():
    spec = importlib.util.spec_from_file_location("serve_example", ROOT / "examples" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _load(port: int, total: int, concurrency: int, limit: float = 600.0) -> dict:
    """Run the load client against ``port``; past ``limit`` seconds (a server that
    stopped answering), kill it and raise ``RuntimeError`` rather than wait on."""
    script = CLIENT.format(root=str(ROOT), port=port, total=total, concurrency=concurrency)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(limit):
            out, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise RuntimeError(
            f"the load client ({total} requests at concurrency {concurrency}) had no "
            f"answers after {limit:g} s; the server stopped answering"
        ) from None
    if process.returncode != 0:
        raise RuntimeError(f"the load client failed (exit status {process.returncode})")
    return json.loads(out)


async def _serve(server: Any) -> None:
    try:
        await server.serve()
    except SystemExit as exc:
        # Recent uvicorn ends a failed startup with sys.exit(3): in a task, asyncio
        # lets that out of the loop, ending the whole benchmark run (every figure
        # lost) where a failed serving benchmark should be reported.
        raise RuntimeError(
            f"the example server did not start (uvicorn exited with status {exc.code}; "
            "see its log above)"
        ) from None


async def _serving(server: Any) -> tuple[asyncio.Task, int]:
    """Start uvicorn's ``server`` on this loop; its task and port once it serves.
    ``RuntimeError`` if it ends without serving (older uvicorn returns quietly when
    the app's startup fails: waiting for ``started`` alone would wait for ever)."""
    task = asyncio.create_task(_serve(server))
    while not server.started:
        if task.done():
            task.result()  # (its own error, if it raised one)
            raise RuntimeError("the example server did not start (see uvicorn's log above)")
        await asyncio.sleep(0.01)
    return task, server.servers[0].sockets[0].getsockname()[1]


async def measure(devices: list[str], levels: list[int], total: int) -> list[dict]:
    """One row per (mode, concurrency): requests/s, p50 and p99 latency in seconds."""
    import uvicorn

    serve = _serve_module()
    rows = []
    for mode, batch_size in (("batched", 64), ("unbatched", 1)):
        app = serve.create_app(
            devices, max_batch_size=batch_size, max_wait_seconds=0.002 if batch_size > 1 else 0.0
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="error")
        server = uvicorn.Server(config)
        task, port = await _serving(server)
        try:
            for concurrency in levels:
                before = app.state.batcher.stats()  # the batcher serves every level
                result = await _load(port, total, concurrency)
                after = app.state.batcher.stats()
                batches = after.batches - before.batches
                latencies = sorted(result["latencies"])
                rows.append(
                    {
                        "mode": mode,
                        "concurrency": concurrency,
                        "requests_per_second": total / result["seconds"],
                        "p50": statistics.median(latencies),
                        "p99": latencies[int(0.99 * (len(latencies) - 1))],
                        "mean_batch_size": (after.rows - before.rows) / batches if batches else 0.0,
                    }
                )
        finally:
            server.should_exit = True
            await task
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{'serving (examples/serve.py)':30} {'concurrency':>11} {'requests/s':>11} "
        f"{'p50':>9} {'p99':>9}",
    ]
    for row in rows:
        lines.append(
            f"{row['mode']:30} {row['concurrency']:>11} {row['requests_per_second']:>11.0f} "
            f"{row['p50'] * 1e3:>6.2f} ms {row['p99'] * 1e3:>6.2f} ms"
        )
    return "\n".join(lines)
