"""``strategy.statistics()``: an immutable snapshot of what a strategy is doing.

Counters are plain integers and floats updated where the work happens anyway
(a collective's completion, a run's end), so keeping them costs next to nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["Counters", "RendezvousInFlight", "Statistics", "snapshot"]


@dataclasses.dataclass(frozen=True)
class RendezvousInFlight:
    """One collective call that some replicas of a run are waiting in."""

    collective: str
    call_number: int
    arrived: tuple[int, ...]
    missing: tuple[int, ...]
    waiting_seconds: float

    def __repr__(self) -> str:
        return (
            f"<{self.collective} #{self.call_number} arrived={list(self.arrived)} "
            f"missing={list(self.missing)} waiting {self.waiting_seconds:.3f} s>"
        )


@dataclasses.dataclass(frozen=True, eq=False)  # snapshots compare by identity (hashable)
class Statistics:
    """A strategy's activity: what is in flight now, and totals since it was made.

    ``runs``: finished runs; ``collectives``: completed calls by collective;
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


class Counters:
    """The totals of a strategy's finished runs."""

    __slots__ = ("bytes_reduced", "collectives", "runs", "seconds_waiting")

    def __init__(self) -> None:
        self.runs = 0
        self.collectives: dict[str, int] = {}
        self.bytes_reduced = 0
        self.seconds_waiting = 0.0

    def add_run(self, group: Any) -> None:
        self.runs += 1
        self.add_totals(group)

    def add_totals(self, group: Any) -> None:
        """Add what ``group`` (a run, finished or not) has done so far."""
        rendezvous = group._rendezvous
        if rendezvous is not None:
            for name, count in rendezvous.completed.items():
                self.collectives[name] = self.collectives.get(name, 0) + count
            self.seconds_waiting += rendezvous.wait_seconds
        self.bytes_reduced += group.bytes_reduced


def snapshot(counters: Counters, live_groups: Iterable[Any], now: float) -> Statistics:
    """Totals of finished runs plus what the runs still in flight have done so far."""
    totals = Counters()  # the finished runs' totals, then each live run's added
    totals.collectives.update(counters.collectives)
    totals.bytes_reduced, totals.seconds_waiting = counters.bytes_reduced, counters.seconds_waiting
    in_flight = []
    groups = list(live_groups)
    for group in groups:
        totals.add_totals(group)
        rendezvous = group._rendezvous
        if rendezvous is None:
            continue
        for name, number, arrived, missing, started in rendezvous.pending():
            waited = max(0.0, now - started)
            in_flight.append(
                RendezvousInFlight(name, number, tuple(arrived), tuple(missing), waited)
            )
    return Statistics(
        runs_in_flight=len(groups),
        rendezvous_in_flight=tuple(in_flight),
        runs=counters.runs,
        collectives=MappingProxyType(totals.collectives),
        bytes_reduced=totals.bytes_reduced,
        seconds_waiting=totals.seconds_waiting,
    )
