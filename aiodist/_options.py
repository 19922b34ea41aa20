"""Communication options: how collectives are carried out, and how long to wait."""

from __future__ import annotations

import dataclasses
import enum
import math

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

    Per-call options override the strategy's ``communication_options`` field by
    field: a field left at its default does not override.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if (
            isinstance(self.bytes_per_pack, bool)
            or not isinstance(self.bytes_per_pack, int)
            or self.bytes_per_pack < 0
        ):
            raise InvalidArgumentError(
                f"bytes_per_pack={self.bytes_per_pack!r}; expected an int >= 0 "
                "(0 packs each dtype into one chunk)."
            )
        if self.timeout_seconds is not None and not (
            isinstance(self.timeout_seconds, int | float)
            and not isinstance(self.timeout_seconds, bool)
            and self.timeout_seconds > 0
            and math.isfinite(self.timeout_seconds)
        ):
            raise InvalidArgumentError(
                f"timeout_seconds={self.timeout_seconds!r}; expected a finite number "
                "of seconds > 0, or None for no limit."
            )
        implementation = self.implementation
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation(implementation.upper())
            except ValueError:
                implementation = None
        if not isinstance(implementation, CommunicationImplementation):
            raise InvalidArgumentError(
                f"implementation={self.implementation!r}; expected one of "
                f"{', '.join(m.name for m in CommunicationImplementation)}."
            )
        object.__setattr__(self, "implementation", implementation)

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
