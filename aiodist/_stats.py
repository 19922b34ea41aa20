"""``strategy.statistics()``: an immutable snapshot of what a strategy is doing.

Counters are plain integers and floats updated where the work happens anyway
(a collective's completion, a run's end), so keeping them costs next to nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ._rendezvous import Tally
from ._replica_context import merge_fn_text

__all__ = ["Counters", "FrozenCounts", "RendezvousInFlight", "Statistics", "snapshot"]


class FrozenCounts(dict):
    """A snapshot's counts by collective: a dict that cannot be changed.

    A dict, not a ``types.MappingProxyType``: a snapshot is data to export, and a
    mapping proxy cannot be copied or pickled, so ``dataclasses.asdict(stats)``,
    ``copy.deepcopy(stats)`` and ``pickle.dumps(stats)`` (a monitoring process's
    queue) raised "cannot pickle 'mappingproxy' object". Every method that would
    change it raises TypeError, as the proxy's did.
    """

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "statistics() counts are a snapshot and cannot be changed; copy them "
            "(dict(stats.collectives)) to change the copy."
        )

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple:
        # (A dict subclass is otherwise rebuilt item by item, through __setitem__.)
        return type(self), (dict(self),)


@dataclasses.dataclass(frozen=True)
class RendezvousInFlight:
    """One collective call of a run in flight, in one of two states:

    - ``"waiting"``: some replicas arrived, those in ``missing`` have not;
    - ``"running"``: every replica arrived (``missing`` is empty) at a merge_call
      whose async merge_fn has not finished: it has run for ``running_seconds``.
      (Only a merge_call is ever running: the other collectives' work is done when
      the last replica arrives, and a multi-worker exchange is not tracked here.)

    ``waiting_seconds`` counts from the first arrival in both. ``merge_fn`` names a
    merge_call's function (``name (file:line)``); None for other collectives.
    """

    collective: str
    call_number: int
    arrived: tuple[int, ...]
    missing: tuple[int, ...]
    waiting_seconds: float
    state: str = "waiting"
    running_seconds: float = 0.0
    merge_fn: str | None = None

    def __repr__(self) -> str:
        head = f"<{self.collective} #{self.call_number}"
        if self.state == "running":  # (a merge_call's: merge_fn is set, see above)
            return (
                f"{head} arrived={list(self.arrived)} running: merge_fn {self.merge_fn} for "
                f"{self.running_seconds:.3f} s, waiting {self.waiting_seconds:.3f} s>"
            )
        return (
            f"{head} arrived={list(self.arrived)} missing={list(self.missing)} "
            f"waiting {self.waiting_seconds:.3f} s>"
        )


@dataclasses.dataclass(frozen=True, eq=False)  # snapshots compare by identity (hashable)
class Statistics:
    """A strategy's activity: what is in flight now, and totals since it was made.

    ``runs``: finished runs; ``collectives``: completed calls by collective (a
    ``FrozenCounts``, a dict that cannot be changed);
    ``bytes_reduced``: input bytes of all-reduces and all-gathers, over all
    replicas; ``seconds_waiting``: time collective calls spent waiting for their
    last replica (from the first arrival to the last), summed over calls.
    """

    runs_in_flight: int
    rendezvous_in_flight: tuple[RendezvousInFlight, ...]
    runs: int
    collectives: Mapping[str, int]
    bytes_reduced: int
    seconds_waiting: float

    def __repr__(self) -> str:
        calls = ", ".join(repr(r) for r in self.rendezvous_in_flight) or "none"
        return (
            f"Statistics(runs_in_flight={self.runs_in_flight}, rendezvous_in_flight=[{calls}], "
            f"runs={self.runs}, collectives={dict(self.collectives)}, "
            f"bytes_reduced={self.bytes_reduced}, seconds_waiting={self.seconds_waiting:.3f})"
        )


class Counters(Tally):
    """A strategy's totals: finished runs, and what every run has done so far. Its
    runs' rendezvous count completed calls here as they complete (see ``Tally``),
    and their input bytes are added here as they are reduced."""

    __slots__ = ("bytes_reduced", "runs")

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0
        self.bytes_reduced = 0


def snapshot(counters: Counters, live_groups: Iterable[Any], now: float) -> Statistics:
    """The totals so far, and what the runs in flight are waiting in."""
    in_flight = []
    groups = list(live_groups)
    for group in groups:
        rendezvous = group._rendezvous
        if rendezvous is None:
            continue
        first = group.strategy._replica_offset  # (replicas by their global ids)
        for row in rendezvous.pending():
            merge_fn = None
            if row.name == "merge_call" and row.payload is not None:
                merge_fn = merge_fn_text(row.payload)
            running = row.running_since is not None
            in_flight.append(
                RendezvousInFlight(
                    row.name,
                    row.number,
                    tuple(first + r for r in row.arrived),
                    tuple(first + r for r in row.missing),
                    max(0.0, now - row.started),
                    "running" if running else "waiting",
                    max(0.0, now - row.running_since) if running else 0.0,
                    merge_fn,
                )
            )
    return Statistics(
        runs_in_flight=len(groups),
        rendezvous_in_flight=tuple(in_flight),
        runs=counters.runs,
        collectives=FrozenCounts(counters.collectives),
        bytes_reduced=counters.bytes_reduced,
        seconds_waiting=counters.seconds_waiting,
    )
