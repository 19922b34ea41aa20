"""Device names: parsing, canonical form, and the device objects replicas run on.

Accepted spellings (any case): ``"GPU:0"``, ``"/gpu:0"``, ``"device:GPU:0"``,
``"/device:GPU:0"`` and ``"/job:localhost/replica:0/task:0/device:GPU:1"``, and the
same for ``CPU``. The canonical form is ``"/device:GPU:0"``. Devices of other jobs
or tasks are refused: several workers run as ``MultiWorkerMirroredStrategy``,
each listing its own devices.
"""

from __future__ import annotations

import dataclasses
import operator
import re

from ._errors import DeviceError

__all__ = ["HOST", "Device", "canonical_device", "parse_device"]

_DEVICE_RE = re.compile(
    r"""^
    (?:
      (?:/job:localhost(?:/replica:0)?(?:/task:0)?)?  # optional local-job prefix,
      /(?:device:)?                                 # then '/device:' or '/'
    | device:                                       # or 'device:' alone
    )?
    (?P<kind>cpu|gpu):(?P<index>[0-9]+)           # ASCII digits only
    $""",
    re.IGNORECASE | re.VERBOSE,
)

_EXPECTED = (
    "expected 'CPU:<i>' or 'GPU:<i>', optionally as '/cpu:0', '/device:GPU:1' "
    "or '/job:localhost/replica:0/task:0/device:GPU:1'"
)


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Device:
    """One logical device: ``kind`` is ``"CPU"`` or ``"GPU"``, ``index`` counts from 0.

    ``str(device)`` is the canonical name, e.g. ``"/device:GPU:0"``. CPU devices
    are logical: any number of them share the host and hold NumPy arrays.
    """

    kind: str
    index: int

    def __post_init__(self) -> None:
        kind = self.kind.upper() if isinstance(self.kind, str) else None
        if kind not in ("CPU", "GPU"):
            raise DeviceError(
                f"Device(kind={self.kind!r}, index={self.index!r}): kind must be 'CPU' or "
                "'GPU' (in any case)."
            )
        try:  # an int, a NumPy integer; not a bool, a float or an array
            index = None if isinstance(self.index, bool) else operator.index(self.index)
        except TypeError:
            index = None
        if index is None or index < 0:
            raise DeviceError(
                f"Device(kind={self.kind!r}, index={self.index!r}): index must be a whole "
                "number from 0."
            )
        # Frozen: the canonical spelling is set through object.__setattr__.
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "index", index)

    def __str__(self) -> str:
        return f"/device:{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    @property
    def name(self) -> str:
        """The canonical name, ``"/device:KIND:i"``."""
        return str(self)


# Where host (NumPy) values live and cross-replica results on the host are made.
HOST = Device("CPU", 0)


def parse_device(spec: str | Device) -> Device:
    """The :class:`Device` named by ``spec``; raises ``DeviceError`` if malformed.

    Availability (is there such a GPU?) is checked by the backends, not here.
    """
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise DeviceError(f"device {spec!r} is of type {type(spec).__name__}; {_EXPECTED}.")
    match = _DEVICE_RE.match(spec.strip())
    if match is None:
        hint = ""
        if spec.strip().lower().startswith("/job:") and "localhost" not in spec.lower():
            hint = (
                " Devices of other jobs or tasks are not named in a device list: for "
                "several workers, use aiodist.MultiWorkerMirroredStrategy, whose "
                "devices are each worker's own (see docs/multi-worker.md)."
            )
        raise DeviceError(f"device string {spec!r} is not understood; {_EXPECTED}.{hint}")
    return Device(match["kind"].upper(), int(match["index"]))


def canonical_device(spec: str | Device) -> str:
    """The canonical name of a device string.

    Examples:
        >>> from aiodist import canonical_device
        >>> canonical_device("gpu:1"), canonical_device("/job:localhost/task:0/device:CPU:0")
        ('/device:GPU:1', '/device:CPU:0')
    """
    return str(parse_device(spec))
