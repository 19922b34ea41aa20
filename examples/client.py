"""A minimal HTTP/1.1 client over asyncio streams (real sockets, no dependency).

Used to talk to ``examples/serve.py`` by the serving tests and the serving
benchmark, and handy for trying the server by hand:

    python -c "import asyncio, json; from examples.client import http; \
        print(asyncio.run(http(8000, 'GET', '/healthz')))"
"""

from __future__ import annotations

import asyncio
import contextlib
import json


async def http(port: int, method: str, path: str, body: bytes | None = None):
    """One HTTP/1.1 request on a fresh connection; (status, parsed JSON body), or
    (status, body text) when the body is not JSON (a 404 or 405 from the framework,
    a 500 page). Raises ``ConnectionError`` when the server closes the connection
    without a reply, and ``ValueError`` when its reply is not HTTP."""
    where = f"{method} {path} to 127.0.0.1:{port}"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    if not raw:
        raise ConnectionError(f"{where}: the server closed the connection without replying")
    header, _, payload = raw.partition(b"\r\n\r\n")
    status_line = header.split(b"\r\n", 1)[0]
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError(
            f"{where}: the reply does not start with an HTTP status line: {raw[:80]!r}"
        )
    status = int(parts[1])
    if any(
        line.lower().replace(b" ", b"") == b"transfer-encoding:chunked"
        for line in header.split(b"\r\n")[1:]
    ):  # (uvicorn's own 500 page, for one, comes in chunks)
        payload = _unchunk(payload, where)
    try:
        return status, json.loads(payload)
    except ValueError:  # (UnicodeDecodeError included)
        return status, payload.decode(errors="replace")


def _unchunk(payload: bytes, where: str) -> bytes:
    """A body sent with ``Transfer-Encoding: chunked``, its chunks joined."""
    chunks = []
    while True:
        size_line, _, payload = payload.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            shown = size_line[:80]
            raise ValueError(f"{where}: a chunk of the reply has no size: {shown!r}") from None
        if size == 0:
            return b"".join(chunks)
        chunks.append(payload[:size])
        payload = payload[size + 2 :]  # (the chunk, then its CRLF)
