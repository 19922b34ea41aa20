"""Communication options: how collectives are carried out, and how long to wait."""

from __future__ import annotations

import dataclasses
import enum

from ._checks import member, seconds, whole_number
from ._errors import InvalidArgumentError

__all__ = ["CommunicationImplementation", "CommunicationOptions"]


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to prefer (as in TensorFlow)."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """Options for collectives: the strategy's defaults, or one call's overrides.

    Args:
        bytes_per_pack: when a structure of values is all-reduced, pack them into
            chunks of about this many bytes (0: one pack per dtype).
        timeout_seconds: how long a rendezvous may wait for every replica to
            arrive before it fails with ``RendezvousTimeoutError`` in every
            waiting replica (None: no limit).
        implementation: which collective implementation to prefer.
        stall_warning_seconds: after this long waiting for some replicas, log a
            warning (logger ``aiodist``) naming them and where each is waiting
            (or, once every replica has arrived at a merge_call whose async
            merge_fn has not finished, naming it and where it is waiting);
            once per stall, however long it lasts; None disables it.

    Per-call options override the strategy's ``communication_options`` field by
    field: a field left at its default does not override.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    stall_warning_seconds: float | None = 30.0

    def __post_init__(self) -> None:
        packing = whole_number(self.bytes_per_pack, "bytes_per_pack", 0, " (0: one pack per dtype)")
        object.__setattr__(self, "bytes_per_pack", packing)  # (a frozen dataclass)
        for name in ("timeout_seconds", "stall_warning_seconds"):
            if (value := getattr(self, name)) is not None:
                # (Kept as a float: a NumPy number is one.)
                object.__setattr__(self, name, seconds(value, name, hint=", or None"))
        implementation = member(CommunicationImplementation, self.implementation, "implementation")
        object.__setattr__(self, "implementation", implementation)  # a frozen dataclass

    def merge(self, overrides: CommunicationOptions | None) -> CommunicationOptions:
        """These options with every non-default field of ``overrides`` applied."""
        if overrides is None or overrides is self:
            return self
        if not isinstance(overrides, CommunicationOptions):
            raise InvalidArgumentError(
                f"options={overrides!r}; expected aiodist.CommunicationOptions or None."
            )
        changed = {
            f.name: getattr(overrides, f.name)
            for f in dataclasses.fields(self)
            if getattr(overrides, f.name) != f.default
        }
        return dataclasses.replace(self, **changed) if changed else self
