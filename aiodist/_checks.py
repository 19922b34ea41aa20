"""Argument checks shared by the public constructors: one wording for each kind of
bad value, naming the value and what was expected."""

from __future__ import annotations

import enum
from typing import Any, TypeVar

from ._errors import InvalidArgumentError

_E = TypeVar("_E", bound=enum.Enum)
_T = TypeVar("_T")


def whole_number(value: Any, name: str, minimum: int, hint: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name}={value!r}; expected an int >= {minimum}{hint}.")
    return value


def member(kind: type[_E], value: Any, name: str) -> _E:
    """``value`` as a member of ``kind``: a member, or its name in any case."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value.upper() in kind.__members__:
        return kind[value.upper()]
    raise InvalidArgumentError(
        f"{name}={value!r}; expected one of {', '.join(kind.__members__)} "
        f"(aiodist.{kind.__name__}, or its name as a string)."
    )


def options_or_default(kind: type[_T], value: Any, name: str = "options") -> _T:
    """``value``, an instance of the options class ``kind``, or its defaults for None."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise InvalidArgumentError(f"{name}={value!r}; expected aiodist.{kind.__name__} or None.")
    return value
