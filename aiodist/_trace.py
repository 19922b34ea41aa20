"""``aiodist.trace(path)``: a timeline of runs, as a Chrome trace event file.

While a trace is recorded, aiodist notes each replica's span, every rendezvous
(each replica's arrival and how long it waited), the cross-replica work of each
collective or merge_fn, and input prefetching. The file is the Chrome trace
event JSON format, which Perfetto (ui.perfetto.dev) and chrome://tracing open
directly; each replica is a track ("replica 0", "replica 1", ...), beside a
"cross-replica" and an "input" track. Runs in flight at the same time get tracks
of their own ("replica 0 (lane 1)", ...), so their spans never overlap on one; a
span that still overlaps one on its track without nesting in it (a replica with
several collectives in flight at once) goes on a track just below
("replica 0 (overlap 1)"), as the file is written.

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

from ._checks import file_to_write
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
        # Under the lock, as the lanes are: runs on loops in other threads number
        # themselves here too, and += is a read and a write a thread switch may split.
        with self._lock:
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

    def span(
        self, name: str, category: str, track: int, start: float, end: float, **args: Any
    ) -> None:
        """A complete event ("X") from ``start`` to ``end`` (microseconds)."""
        with self._lock:
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
            events = list(self._events)
        tracks = {event["tid"] for event in events}
        # In time order, the outer of two spans that start together first, and an
        # instant before a zero-length span at its time: the file's order, and the
        # order _untangle places the spans in.
        events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0), e["ph"] == "X"))
        events, overlaps = _untangle(events, tracks)
        document = {
            "traceEvents": [
                {"ph": "M", "name": "process_name", "pid": self.pid, "args": {"name": "aiodist"}},
                *_track_names(self.pid, tracks, overlaps),
                *events,
            ],
            "displayTimeUnit": "ms",
        }
        self.path.write_text(json.dumps(document))
        return self.path


# Complete events on one track must nest: trace viewers cannot draw two that overlap
# otherwise (Perfetto drops the later one). Ends that agree to a nanosecond (the last
# bits of ts + dur) count as equal.
_NANOSECOND = 1e-3


def _untangle(events: list[dict], tracks: set[int]) -> tuple[list[dict], dict[int, tuple]]:
    """``events`` (sorted by start, the longer of two that start together first)
    with every span (complete event) that cannot nest on its track moved to a track
    beside it: a replica's waits overlap without nesting when it has several
    collectives in flight at once (started now and awaited later, or awaited
    together with asyncio.gather), as do async merge_fns whose replicas did not
    await the one before. Returns the events, in the same order, and, for each new
    track id, (its track, overlap number): the first track where the span nests, 1,
    2, ..."""
    layers: dict[int, list[list[float]]] = {}  # track -> per overlap, the open spans' ends
    tids: dict[tuple[int, int], int] = {}  # (track, overlap) -> the new track's id
    # New ids past every lane's (slot 0 of the lane after the last: no other track's)
    next_tid = (max(tracks, default=0) // LANE_STRIDE + 1) * LANE_STRIDE
    placed = []
    for span in events:
        if span["ph"] != "X":  # an instant event: nothing to nest
            placed.append(span)
            continue
        start, end = span["ts"], span["ts"] + span["dur"]
        track = span["tid"]
        stacks = layers.setdefault(track, [])
        overlap = _first_nesting(stacks, start, end)
        stacks[overlap].append(end)
        if overlap:
            if (track, overlap) not in tids:
                tids[track, overlap] = next_tid
                next_tid += 1
            span = {**span, "tid": tids[track, overlap]}
        placed.append(span)
    return placed, {tid: key for key, tid in tids.items()}


def _first_nesting(stacks: list[list[float]], start: float, end: float) -> int:
    """The first of a track's overlap levels (each the ends of its open spans,
    innermost last) where a span from ``start`` to ``end`` nests: inside the
    innermost span still open there at ``start``, or where none is; a new level
    when there is no such one."""
    for overlap, ends in enumerate(stacks):
        while ends and ends[-1] <= start + _NANOSECOND:
            ends.pop()
        if not ends or end <= ends[-1] + _NANOSECOND:
            return overlap
    stacks.append([])
    return len(stacks) - 1


def _track_names(pid: int, tracks: set[int], overlaps: dict[int, tuple]) -> list[dict]:
    """The metadata events naming each track and setting its place: by lane, each
    lane's cross-replica track first, the replicas in order, then the input tracks;
    a track's overlap tracks just below it."""
    order = []
    for tid in tracks | set(overlaps):
        track, overlap = overlaps.get(tid, (tid, 0))
        lane, slot = divmod(track, LANE_STRIDE)
        if slot == INPUT_TRACK:
            name, sort = "input", (1, lane, 0)
        elif slot == CROSS_REPLICA_TRACK:
            name, sort = "cross-replica", (0, lane, -1)
        else:
            name, sort = f"replica {slot - 1}", (0, lane, slot)
        notes = ([f"lane {lane}"] if lane else []) + ([f"overlap {overlap}"] if overlap else [])
        if notes:
            name += f" ({', '.join(notes)})"
        order.append(((*sort, overlap), tid, name))
    events = []
    for index, (_, tid, name) in enumerate(sorted(order)):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": index},
            }
        )
    return events


class trace:
    """Record a timeline of every run while the block runs; write it to ``path``.

    ``with aiodist.trace("trace.json"): ...`` or ``async with``: the async form
    writes the file in a thread, so the event loop is not held. A path the file
    cannot be written to (its folder missing or read-only, a folder) raises
    ``InvalidArgumentError`` as the block starts, before any work is done. A
    relative path is taken in the folder current as the block starts.
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
        # Where the block starts: a relative path names a file in the folder current
        # now, wherever the block leaves the current folder (as logging.FileHandler).
        path = self.path.absolute()
        _check_writable(path)
        self.tracer = active = Tracer(path)
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


def _check_writable(path: Path) -> None:
    """Raise ``InvalidArgumentError`` unless ``path`` can be written: checked as the
    trace starts, not after the block has run (a training loop, say), whose whole
    trace would then be lost to a write that cannot succeed."""
    where = f"aiodist.trace: cannot write {str(path)!r}"
    try:
        file_to_write(path, where, "trace.json")
        # The folder exists, but the file may still not be writable there (a folder
        # without write permission, a file system that takes no new files, a link to
        # a missing folder): open it as the write will, in append mode so that an
        # existing file is left as it is, and remove it again if it was not there.
        existed = os.path.lexists(path)
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:  # (also a name too long for the file system, from is_dir)
        raise InvalidArgumentError(
            f"{where}: {exc.strerror or exc}; name a file in a folder you can write to."
        ) from exc


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
