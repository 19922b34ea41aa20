"""Argument checks shared by the public constructors: one wording for each kind of
bad value, naming the value and what was expected."""

from __future__ import annotations

import enum
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ._errors import InvalidArgumentError

_E = TypeVar("_E", bound=enum.Enum)
_T = TypeVar("_T")


def refuse_awaitables(values: Iterable[Any], message: Callable[[], str]) -> None:
    """Raise ``InvalidArgumentError(message())`` when any of ``values`` is awaitable:
    what an ``async def`` function gives where a plain one is called and never
    awaited. Each is closed first, so Python does not warn that it was never awaited."""
    awaitables = [value for value in values if inspect.isawaitable(value)]
    if awaitables:
        for awaitable in awaitables:
            if hasattr(awaitable, "close"):
                awaitable.close()
        raise InvalidArgumentError(message())


def short_repr(value: Any) -> str:
    """``repr(value)``, cut short for a message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:79]}…"


def refuse_ragged(parts: Sequence[Any], where: str) -> None:
    """Raise ``InvalidArgumentError`` naming the first of ``parts`` (one value per
    replica, or one value) that is no array because its lists nest unevenly
    (``[[1, 2], [3]]``), which NumPy refuses with "setting an array element with a
    sequence ... inhomogeneous shape". Asked only once converting ``parts`` has
    raised a ValueError; returns where none is such a value (the caller re-raises)."""
    for replica, part in enumerate(parts):
        try:
            np.asarray(part)
            continue
        except ValueError:
            pass
        except Exception:  # (a GPU array: np.asarray refuses it, and it is one array)
            continue
        try:
            np.asarray(part, dtype=object)  # items NumPy takes, only not as one shape
        except Exception:
            continue
        whose = f"replica {replica}'s value " if len(parts) > 1 else ""
        raise InvalidArgumentError(
            f"{where}: {whose}{short_repr(part)} is not one array: its lists nest "
            "unevenly (rows of different lengths or shapes); expected an array, a number, "
            "or lists nested evenly (every row of one length), as np.asarray takes them: "
            "pad the rows to one length, or pass them as separate values."
        ) from None


def not_callable(value: Any, message: str) -> InvalidArgumentError:
    """``InvalidArgumentError(message)`` for ``value``, which is not callable. A
    coroutine object (``fn()`` passed where ``fn`` was meant) is closed, so Python
    does not warn that it was never awaited, and the message says what to pass."""
    if inspect.iscoroutine(value):
        value.close()
        message += (
            " It is a coroutine object, what calling an async function gives: pass the "
            "function itself (fn), not a call of it (fn())."
        )
    return InvalidArgumentError(message)


def async_generator_function(fn: Callable) -> bool:
    """Whether calling ``fn`` gives an async generator, which nothing would iterate
    where a result is expected (run's fn, a merge_fn): ``fn`` is an async generator
    function, a partial of one (or a partialmethod, which inspect sees through), or
    an object (a partial of one) whose class's ``__call__`` is one."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        return bool(code.co_flags & inspect.CO_ASYNC_GENERATOR)
    while isinstance(fn, partial):  # (what inspect sees through, for __call__ too)
        fn = fn.func
    call = getattr(type(fn), "__call__", None)  # noqa: B004 (the function, not callable())
    return inspect.isasyncgenfunction(fn) or inspect.isasyncgenfunction(call)


def whole_number(value: Any, name: str, minimum: int, hint: str = "") -> int:
    """``value`` as an int: a whole number (not a bool) of at least ``minimum``.
    NumPy's integers count (``np.int64(8)``: from ``np.arange`` or a config array),
    as ``seconds`` takes NumPy's numbers; callers keep the int returned."""
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise InvalidArgumentError(f"{name}={value!r}; expected an int >= {minimum}{hint}.")
    return int(value)


def seconds(value: Any, name: str, *, zero: bool = False, hint: str = "") -> float:
    """``value`` as a float: a finite real number (not a bool) above 0, or at least 0
    with ``zero``. NaN and infinity are refused: a wait of either never ends. NumPy's
    numbers count (``np.int64(5)``, ``np.float32(0.5)``: read from a config array),
    as numbers.Real has them."""
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        bound = ">= 0" if zero else "> 0"
        raise InvalidArgumentError(
            f"{name}={value!r}; expected a finite number of seconds {bound}{hint}."
        )
    return float(value)


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


def file_to_write(path: Path, where: str, example: str) -> None:
    """Raise ``InvalidArgumentError``, its message starting with ``where`` (e.g.
    "save_variables: cannot write 'x.npz'"), unless ``path`` names a file in an
    existing folder: checked before the work whose result would be written (a
    training run's checkpoint, a trace), which a write that cannot succeed would
    lose. ``example``: a file name to suggest inside ``path`` when it is a folder."""
    if not path.parent.is_dir():
        if path.parent.exists():
            raise InvalidArgumentError(
                f"{where}: {str(path.parent)!r} is a file, not a folder; name a file in a folder."
            )
        raise InvalidArgumentError(
            f"{where}: the folder {str(path.parent)!r} does not exist; create it first."
        )
    if path.is_dir():  # (a folder, or "": the current one)
        raise InvalidArgumentError(
            f"{where}: it is a folder; name a file to write, e.g. {str(path / example)!r}."
        )
