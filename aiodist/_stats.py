"""``strategy.statistics()``: an immutable snapshot of what a strategy is doing.

Counters are plain integers and floats updated where the work happens anyway
(a collective's completion, a run's end), so keeping them costs next to nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from ._rendezvous import Tally

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
        for name, number, arrived, missing, started in rendezvous.pending():
            waited = max(0.0, now - started)
            in_flight.append(
                RendezvousInFlight(name, number, tuple(arrived), tuple(missing), waited)
            )
    return Statistics(
        runs_in_flight=len(groups),
        rendezvous_in_flight=tuple(in_flight),
        runs=counters.runs,
        collectives=MappingProxyType(dict(counters.collectives)),
        bytes_reduced=counters.bytes_reduced,
        seconds_waiting=counters.seconds_waiting,
    )
