"""Distributed inference behind HTTP: Starlette under uvicorn, batched across replicas.

    pip install '.[serve]'
    python examples/serve.py --port 8000 --devices cpu:0,cpu:1,cpu:2,cpu:3

    curl -s localhost:8000/predict -d '{"inputs": [[0.1, 0.2, ...16 numbers...]]}'

Endpoints:

- ``POST /predict`` with ``{"inputs": [[float, ...], ...]}`` (rows of ``INPUT_WIDTH``
  numbers) answers ``{"outputs": [[float, ...], ...]}``, one row per input row;
  bad input answers 400 with ``{"error": ...}``, a body too large to hold a request
  413 (unread and unparsed), overload 503.
- ``GET /healthz``: status, model widths, replicas.
- ``GET /metrics``: requests, batches, mean batch size, latency percentiles.

The model is a small MLP whose weights are mirrored variables (one copy per
replica), seeded, so the same input always gives the same output, whatever
else is being served: each output row depends on its input row only (the
products are computed row by row, never by a BLAS kernel whose summation order
could change with the batch size).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import aiodist
from aiodist.serving import Batcher, NotServing, Overloaded

INPUT_WIDTH = 16
MAX_ABS_INPUT = 1e6  # beyond this the model's outputs could overflow to inf
HIDDEN_WIDTH = 32
BYTES_PER_NUMBER = 64  # a JSON number with its separator and indentation, generously
OUTPUT_WIDTH = 4


class MLP:
    """relu(x W1 + b1) W2 + b2, with mirrored weights."""

    def __init__(self, strategy: aiodist.Strategy, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.host = {
            "w1": rng.normal(scale=0.5, size=(INPUT_WIDTH, HIDDEN_WIDTH)),
            "b1": rng.normal(scale=0.1, size=HIDDEN_WIDTH),
            "w2": rng.normal(scale=0.5, size=(HIDDEN_WIDTH, OUTPUT_WIDTH)),
            "b2": rng.normal(scale=0.1, size=OUTPUT_WIDTH),
        }
        with strategy.scope():
            self.weights = {k: aiodist.Variable(v, name=k) for k, v in self.host.items()}

    @staticmethod
    def forward(x: np.ndarray, w1: Any, b1: Any, w2: Any, b2: Any) -> np.ndarray:
        hidden = np.maximum(np.einsum("bi,ih->bh", x, w1, optimize=False) + b1, 0.0)
        return np.einsum("bh,ho->bo", hidden, w2, optimize=False) + b2

    async def step(self, rows: np.ndarray) -> np.ndarray:
        """One replica's share of a batch, on its own copies of the weights."""
        w = {k: v.read_value() for k, v in self.weights.items()}
        return self.forward(np.asarray(rows, dtype=np.float64), **w)

    def reference(self, rows: Any) -> np.ndarray:
        """The same model in plain NumPy, for checking answers."""
        return self.forward(np.asarray(rows, dtype=np.float64), **self.host)


class BadInput(ValueError):
    pass


class TooLarge(ValueError):
    pass


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused (``TooLarge``) once it is longer than ``max_bytes``:
    before reading it when its Content-Length says so, else as soon as that many bytes
    have come. (Read whole, a body of a million rows held about 1 GB and parsing it
    blocked the event loop for seconds, only to be refused for its row count.)"""
    declared = request.headers.get("content-length", "")
    too_large = f"at most {max_bytes} bytes per request (max_body_bytes); split the request"
    if declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"the body has {int(declared)} bytes; {too_large}")
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(f"the body has more than {max_bytes} bytes; {too_large}")
            chunks.append(chunk)
    return b"".join(chunks)


def parse_inputs(body: bytes, max_rows: int) -> np.ndarray:
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"the body is not valid JSON ({exc})") from None
    except RecursionError:  # (valid JSON, nested deeper than the parser goes)
        raise BadInput("the body's JSON is nested too deeply") from None
    expected = 'expected a JSON object {"inputs": [[number, ...], ...]}'
    if not isinstance(document, dict):
        raise BadInput(f"the body is {_json_kind(document)}; {expected}")
    if "inputs" not in document:
        keys = ", ".join(_cut(json.dumps(key)) for key in list(document)[:5])
        more = ", ..." if len(document) > 5 else ""
        raise BadInput(f'the body has no "inputs" (its keys: {keys or "none"}{more}); {expected}')
    rows = document["inputs"]
    if not isinstance(rows, list) or not rows:
        kind = "an empty list" if rows == [] else _json_kind(rows)
        raise BadInput(f'"inputs" is {kind}; it must be a non-empty list of rows')
    if len(rows) > max_rows:
        raise BadInput(f'"inputs" has {len(rows)} rows; at most {max_rows} per request')
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != INPUT_WIDTH:
            width = len(row) if isinstance(row, list) else type(row).__name__
            raise BadInput(f"row {i} has width {width}; every row needs {INPUT_WIDTH} numbers")
        for j, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadInput(f"row {i}, column {j} is {value!r}; expected a number")
            try:
                number = float(value)  # a huge JSON integer does not fit a float
            except OverflowError:
                number = math.inf
            if not math.isfinite(number) or abs(number) > MAX_ABS_INPUT:
                huge = isinstance(value, int) and abs(number) >= 1e300  # (NaN compares False)
                shown = f"a number of {len(str(value))} digits" if huge else value
                raise BadInput(
                    f"row {i}, column {j} is {shown}; expected a finite number of magnitude "
                    f"at most {MAX_ABS_INPUT:g}"
                )
    return np.asarray(rows, dtype=np.float64)


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in words (with its value when it is short)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    kind = {bool: "a boolean", str: "a string", type(None): "null"}.get(type(value), "a number")
    return kind if kind == "null" else f"{kind} ({_cut(json.dumps(value))})"


def _cut(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:39]}…"


async def submit_in_batches(batcher: Batcher, rows: np.ndarray) -> np.ndarray:
    """``rows``' outputs, submitted in pieces of at most ``max_batch_size`` rows (a
    request may hold more rows than one batch). If one piece is refused, the others
    are withdrawn (cancelled) and the refusal is raised."""
    size = batcher.max_batch_size
    if len(rows) <= size:
        return await batcher.submit(rows)
    pieces = [
        asyncio.ensure_future(batcher.submit(rows[i : i + size])) for i in range(0, len(rows), size)
    ]
    try:
        outputs = await asyncio.gather(*pieces)
    except BaseException:
        for piece in pieces:
            piece.cancel()
        await asyncio.gather(*pieces, return_exceptions=True)
        raise
    return np.concatenate(outputs)


async def unless_hung_up(request: Request, work: Any) -> Any:
    """The result of ``work`` (a coroutine), or None if the client hangs up first:
    then ``work`` is cancelled. Starlette does not cancel a handler whose client
    went away, so without this the batcher would keep its rows queued (using up
    admission) and compute them for nobody. (A watcher task cancels this
    handler's task: half the cost of running ``work`` as a task of its own.)"""
    handler = asyncio.current_task()
    assert handler is not None
    hung_up = False

    async def watch() -> None:
        nonlocal hung_up
        await _hang_up(request)
        hung_up = True
        handler.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if hung_up and handler.uncancel() == 0:  # ours alone, not a server's shutdown
            return None
        raise
    finally:
        watcher.cancel()


async def _hang_up(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the server's
    next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    devices: list[str],
    *,
    seed: int = 0,
    max_batch_size: int = 64,
    max_wait_seconds: float = 0.002,
    max_queue_rows: int = 4096,
    max_rows_per_request: int = 256,
    max_body_bytes: int | None = None,
    shutdown_deadline: float = 10.0,
) -> Starlette:
    """The app. ``max_body_bytes``: the longest body read (413 beyond); by default
    ``BYTES_PER_NUMBER`` for each number of a request of ``max_rows_per_request`` rows."""
    if max_rows_per_request > max_queue_rows:  # such a request could never be admitted
        raise ValueError(
            f"max_rows_per_request={max_rows_per_request} is above max_queue_rows="
            f"{max_queue_rows}; expected at most max_queue_rows."
        )
    if max_body_bytes is None:
        max_body_bytes = BYTES_PER_NUMBER * INPUT_WIDTH * max_rows_per_request
    strategy = aiodist.MirroredStrategy(devices)
    model = MLP(strategy, seed)
    batcher = Batcher(
        strategy,
        model.step,
        max_batch_size=max_batch_size,
        max_wait_seconds=max_wait_seconds,
        max_queue_rows=max_queue_rows,
    )

    async def predict(request: Request) -> Response:
        try:
            payload = await read_body(request, max_body_bytes)
        except ClientDisconnect:  # gone before sending its whole body: nobody to answer
            return Response(status_code=499)  # (never sent; nginx's "client closed request")
        except TooLarge as exc:  # (the rest of the body unread: this connection ends)
            closing = {"Connection": "close"}
            return JSONResponse({"error": str(exc)}, status_code=413, headers=closing)
        try:
            rows = parse_inputs(payload, max_rows_per_request)
        except BadInput as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            outputs = await unless_hung_up(request, submit_in_batches(batcher, rows))
        except (Overloaded, NotServing) as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        if outputs is None:  # the client hung up: its rows were withdrawn
            return Response(status_code=499)
        return JSONResponse({"outputs": outputs.tolist()})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "input_width": INPUT_WIDTH,
                "output_width": OUTPUT_WIDTH,
                "replicas": strategy.num_replicas_in_sync,
                "devices": list(strategy.extended.worker_devices),
            }
        )

    async def metrics(request: Request) -> JSONResponse:
        return JSONResponse(batcher.stats().as_dict())

    app = Starlette(
        routes=[
            Route("/predict", predict, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=functools.partial(
            batcher.lifespan,
            warmup_rows=np.zeros((strategy.num_replicas_in_sync, INPUT_WIDTH)),
            deadline=shutdown_deadline,
        ),
    )
    app.state.model = model
    app.state.batcher = batcher
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--devices", default="cpu:0,cpu:1,cpu:2,cpu:3")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument(
        "--shutdown-deadline",
        type=float,
        default=10.0,
        help="seconds that requests in flight may take once shutdown begins (SIGTERM, "
        "Ctrl+C); then they are cancelled, and the batcher's stop() cancels its batches "
        "after as long again (default 10)",
    )
    args = parser.parse_args(argv)
    # Bad values as usage errors that name the flag, not a traceback naming
    # create_app's argument.
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size={args.max_batch_size}; expected at least 1")
    if not (math.isfinite(args.max_wait_ms) and args.max_wait_ms >= 0):
        parser.error(f"--max-wait-ms={args.max_wait_ms}; expected a finite number >= 0")
    deadline = args.shutdown_deadline
    if not (math.isfinite(deadline) and deadline >= 0):
        parser.error(f"--shutdown-deadline={deadline}; expected a finite number of seconds >= 0")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    try:
        app = create_app(
            devices,
            max_batch_size=args.max_batch_size,
            max_wait_seconds=args.max_wait_ms / 1e3,
            shutdown_deadline=deadline,
        )
    except ValueError as exc:  # a bad --devices (aiodist's errors are ValueErrors)
        parser.error(f"--devices={args.devices!r}: {exc}")
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    # uvicorn runs the lifespan's shutdown (the batcher's stop(deadline)) only once
    # every request's handler has ended: without a bound of its own, one request
    # whose batch never ends (a step stuck in I/O) kept the server from exiting.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop=loop,
        lifespan="on",
        timeout_graceful_shutdown=deadline,
    )


if __name__ == "__main__":
    main()
