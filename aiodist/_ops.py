"""Reduce operations: one table row per op.

A row says how an op combines values, in terms every array backend understands:
the name of the element-wise ufunc (``numpy.add``, ``cupy.add``, ...), whether the
result is divided by the number of replicas afterwards (MEAN), and the NCCL op
that does the same on GPUs.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from ._errors import InvalidArgumentError

__all__ = ["ReduceOp"]


class _Row(NamedTuple):
    ufunc: str  # element-wise binary ufunc name, the same in NumPy and CuPy
    divide_by_count: bool  # MEAN: SUM, then divide by the number of values
    nccl: str  # cupy.cuda.nccl op name


_ROWS = {
    "SUM": _Row("add", False, "NCCL_SUM"),
    "MEAN": _Row("add", True, "NCCL_SUM"),
    "MIN": _Row("minimum", False, "NCCL_MIN"),
    "MAX": _Row("maximum", False, "NCCL_MAX"),
    "PRODUCT": _Row("multiply", False, "NCCL_PROD"),
}


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    ``SUM`` and ``MEAN`` are TensorFlow's; ``MIN``, ``MAX`` and ``PRODUCT`` are
    extras. Everywhere a ``ReduceOp`` is accepted, its name as a string in any
    case is too: ``ReduceOp("sum") is ReduceOp.SUM``.

    Examples:
        >>> from aiodist import ReduceOp
        >>> ReduceOp("mean"), ReduceOp.of("Max")
        (ReduceOp.MEAN, ReduceOp.MAX)
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"
    PRODUCT = "PRODUCT"

    # Members are singletons compared by identity, so they hash by identity too:
    # Enum's own __hash__ is a Python call, and ops key dicts on every collective.
    __hash__ = object.__hash__

    @classmethod
    def _missing_(cls, value: object) -> ReduceOp:
        if isinstance(value, str) and value.upper() in _ROWS:
            return cls[value.upper()]
        raise InvalidArgumentError(
            f"{value!r} is not a reduce op; expected a ReduceOp or one of the strings "
            f"{', '.join(repr(name) for name in _ROWS)} (any case)."
        )

    @classmethod
    def of(cls, value: ReduceOp | str) -> ReduceOp:
        """``value`` as a ReduceOp; raises ``InvalidArgumentError`` for anything else."""
        try:  # hot path: a member, or its name in upper or lower case (one dict lookup)
            return _BY_KEY[value]
        except (KeyError, TypeError):  # every member is a key: anything else is refused
            pass
        return cls(value)

    @property
    def ufunc(self) -> str:
        """Name of the element-wise ufunc that combines two values."""
        return self._row.ufunc

    @property
    def divides_by_count(self) -> bool:
        """True for MEAN: the combined value is divided by the number of values."""
        return self._row.divide_by_count

    @property
    def nccl_op(self) -> str:
        """Name of the matching ``cupy.cuda.nccl`` constant."""
        return self._row.nccl

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


_BY_KEY: dict = {}
for _member in ReduceOp:
    # Each member's row as a plain attribute: Enum's ``value`` is a descriptor, and
    # ``divides_by_count`` is read on every reduction.
    _member._row = _ROWS[_member.name]
    _BY_KEY.update({_member: _member, _member.name: _member, _member.name.lower(): _member})
