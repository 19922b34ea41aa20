"""``aiodist.trace(path)``: a timeline of runs, as a Chrome trace event file.

While a trace is recorded, aiodist notes each replica's span, every rendezvous
(each replica's arrival and how long it waited), the cross-replica work of each
collective or merge_fn, and input prefetching. The file is the Chrome trace
event JSON format, which Perfetto (ui.perfetto.dev) and chrome://tracing open
directly; each replica is a track ("replica 0", "replica 1", ...), beside a
"cross-replica" and an "input" track. Runs in flight at the same time get tracks
of their own ("replica 0 (lane 1)", ...), so their spans never overlap on one.

Recording is process-wide (one trace at a time). When no trace is recorded the
hooks cost one module-attribute read each, at run start, arrival and completion.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ._errors import ContextError, InvalidArgumentError

__all__ = [
    "CROSS_REPLICA_TRACK",
    "INPUT_TRACK",
    "Tracer",
    "cross_replica_track",
    "input_track",
    "replica_track",
    "trace",
]

# Track (thread) ids: replica i is i + 1; tid 0 would be shown as a "main thread".
# Runs in flight at the same time (a server's requests) each take a lane, the
# lowest free one, so their spans do not overlap on one track: lane L's tracks are
# lane 0's plus L * LANE_STRIDE, named "replica i (lane L)", "cross-replica (lane L)".
CROSS_REPLICA_TRACK = 100_000
INPUT_TRACK = 100_001
LANE_STRIDE = 1_000_000
_INPUT_SORT = 1 << 62  # the input track last; a lane's cross-replica track first

active: Tracer | None = None  # the trace being recorded, if any


def replica_track(replica: int, lane: int = 0) -> int:
    return lane * LANE_STRIDE + replica + 1


def cross_replica_track(lane: int = 0) -> int:
    return lane * LANE_STRIDE + CROSS_REPLICA_TRACK


def input_track(lane: int = 0) -> int:
    """The track of input prefetches in lane ``lane`` (datasets prefetching at once
    each hold a lane of their own while they fetch: see Tracer.take_input_lane)."""
    return lane * LANE_STRIDE + INPUT_TRACK


class Tracer:
    """Collects trace events in memory; ``write`` saves them."""

    def __init__(self, path: Path):
        self.path = path
        self.pid = os.getpid()
        self._start = time.perf_counter_ns()
        self._events: list[dict] = []
        self._tracks: set[int] = set()
        self._lock = threading.Lock()  # prefetch threads may record too
        self._runs = 0
        self._lanes: set[int] = set()  # held by runs in flight
        self._input_lanes: set[int] = set()  # held by prefetches in flight

    def now(self) -> float:
        """Microseconds since the trace started."""
        return (time.perf_counter_ns() - self._start) / 1000

    def rebased(self, at: float, clock: Tracer) -> float:
        """``at`` on ``clock``'s timeline (another trace's), on this one's; 0 for a
        time before this trace began."""
        return max(0.0, at + (clock._start - self._start) / 1000)

    def next_run(self) -> int:
        self._runs += 1
        return self._runs

    def take_lane(self) -> int:
        """The lowest lane no run in flight holds (0 when runs do not overlap)."""
        return self._take(self._lanes)

    def free_lane(self, lane: int) -> None:
        with self._lock:
            self._lanes.discard(lane)

    def take_input_lane(self) -> int:
        """The lowest input lane no prefetch in flight holds: prefetches overlapping in
        time (several datasets) get tracks of their own, so their spans never overlap
        on one."""
        return self._take(self._input_lanes)

    def _take(self, held: set[int]) -> int:
        """The lowest lane not in ``held``, added to it. (Under the lock: runs and
        prefetches on several loops' threads may record into one trace.)"""
        with self._lock:
            lane = 0
            while lane in held:
                lane += 1
            held.add(lane)
            return lane

    def free_input_lane(self, lane: int) -> None:
        with self._lock:
            self._input_lanes.discard(lane)

    def _track(self, track: int) -> None:
        if track in self._tracks:
            return
        self._tracks.add(track)
        lane, slot = divmod(track, LANE_STRIDE)
        sort = track
        if slot == INPUT_TRACK:
            name, sort = "input", _INPUT_SORT + lane
        elif slot == CROSS_REPLICA_TRACK:
            name, sort = "cross-replica", lane * LANE_STRIDE
        else:
            name = f"replica {slot - 1}"
        if lane:
            name += f" (lane {lane})"
        self._events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": self.pid,
                "tid": track,
                "args": {"name": name},
            }
        )
        self._events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": self.pid,
                "tid": track,
                "args": {"sort_index": sort},
            }
        )

    def span(
        self, name: str, category: str, track: int, start: float, end: float, **args: Any
    ) -> None:
        """A complete event ("X") from ``start`` to ``end`` (microseconds)."""
        with self._lock:
            self._track(track)
            self._events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": category,
                    "pid": self.pid,
                    "tid": track,
                    "ts": start,
                    "dur": max(0.0, end - start),
                    "args": args,
                }
            )

    def instant(self, name: str, category: str, track: int, at: float, **args: Any) -> None:
        """An instant event ("i") on one track."""
        with self._lock:
            self._track(track)
            self._events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": name,
                    "cat": category,
                    "pid": self.pid,
                    "tid": track,
                    "ts": at,
                    "args": args,
                }
            )

    def write(self) -> Path:
        with self._lock:
            document = {
                "traceEvents": [
                    {
                        "ph": "M",
                        "name": "process_name",
                        "pid": self.pid,
                        "args": {"name": "aiodist"},
                    },
                    *self._events,
                ],
                "displayTimeUnit": "ms",
            }
        self.path.write_text(json.dumps(document))
        return self.path


class trace:
    """Record a timeline of every run while the block runs; write it to ``path``.

    ``with aiodist.trace("trace.json"): ...`` or ``async with``: the async form
    writes the file in a thread, so the event loop is not held.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tracer: Tracer | None = None

    def _start(self) -> Tracer:
        global active
        if active is not None:
            raise ContextError(
                f"a trace is already being recorded (to {str(active.path)!r}); traces are "
                "process-wide: finish that one first."
            )
        if not self.path.parent.is_dir():  # now, not after the block has run
            raise InvalidArgumentError(
                f"aiodist.trace: cannot write {str(self.path)!r}: the folder "
                f"{str(self.path.parent)!r} does not exist; create it first."
            )
        self.tracer = active = Tracer(self.path)
        return self.tracer

    def _stop(self) -> Tracer:
        global active
        tracer, active = self.tracer, None
        assert tracer is not None
        return tracer

    def __enter__(self) -> Tracer:
        return self._start()

    def __exit__(self, *exc_info: object) -> None:
        _write(self._stop(), exc_info[1])

    async def __aenter__(self) -> Tracer:
        return self._start()

    async def __aexit__(self, *exc_info: object) -> None:
        import asyncio

        await asyncio.to_thread(_write, self._stop(), exc_info[1])


def _write(tracer: Tracer, raised: object) -> None:
    """Write the trace file. When the block raised, a failure to write is logged
    instead: the block's own exception is the one to see."""
    if raised is None:
        tracer.write()
        return
    try:
        tracer.write()
    except OSError as exc:
        logging.getLogger("aiodist").warning(
            "aiodist.trace: could not write %s (%s); the block raised %r.",
            tracer.path,
            exc,
            raised,
        )
