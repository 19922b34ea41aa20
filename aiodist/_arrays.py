"""Small array helpers shared by the replica context, cross-device ops and strategies.

They work on any array type with NumPy's attributes (``dtype``, ``shape``,
``ndim``): NumPy arrays and CuPy arrays alike.
"""

from __future__ import annotations

import asyncio
import operator
import types
from collections.abc import Callable
from typing import Any

from . import _nest
from ._errors import InvalidArgumentError
from ._ops import ReduceOp

__all__ = [
    "UNAWAITED",
    "as_axis",
    "check_reducible",
    "first_difference",
    "gather_axis",
    "leaf_path",
    "leaf_text",
    "mean_of_sum",
    "mean_operand",
    "structure_text",
    "unawaited",
]

# dtype kinds that can be reduced: signed/unsigned ints, floats, complex; bool for MIN/MAX.
_NUMERIC_KINDS = frozenset("iufc")

_UNKNOWN = object()  # check_reducible's structure when the caller has none (None is one)

# What an async call gives before it is awaited: a coroutine (``strategy.run(fn)``
# without ``await``, TF's spelling) or a future (a collective's). Passed on as a
# value it became a 0-d object array, refused as a dtype ("convert it with
# x.astype") or a rank ("x[None]"), or as a value that is not distributed.
UNAWAITED = (types.CoroutineType, asyncio.Future)


def unawaited(value: Any, where: str) -> str:
    """The message for ``value`` (one of ``UNAWAITED``), given ``where`` its result belongs."""
    if isinstance(value, types.CoroutineType):
        what = f"a coroutine ({value.__qualname__}) that was never awaited"
        example = "`losses = await strategy.run(step)`, then pass `losses`"
    else:
        what = f"{_a(value)} (a call's result to come, such as a collective's)"
        example = "`total = await ctx.all_reduce(...)`, then pass `total`"
    return (
        f"{where}: the value is {what}, not its result. Probably an `await` is "
        f"missing: await the call first, e.g. {example}."
    )


def _held(array: Any) -> object:
    """The object a 0-d object array holds (a value NumPy took whole, such as a
    coroutine passed where its result belongs), else None."""
    return array[()] if array.dtype.kind == "O" and array.ndim == 0 else None


def leaf_text(array: Any) -> str:
    """``float32[2, 3]`` for a 2-by-3 float32 array, ``float64[]`` for a scalar."""
    return f"{array.dtype}[{', '.join(str(n) for n in array.shape)}]"


class _Raw(str):
    """A string whose repr is itself, to print structures of leaf descriptions."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def structure_text(value: object, arrays: list, limit: int = 160) -> str:
    """A short description of ``value``'s nesting with each leaf as ``leaf_text``:
    the same text in every process (``_nest.stable_repr``: a frozenset key's
    members not in hash order), so workers' texts of one call read alike."""
    text = _nest.stable_repr(_nest.pack_as(value, [_Raw(leaf_text(a)) for a in arrays]))
    if len(text) > limit:
        text = f"{text[: limit - 1]}… ({len(arrays)} values)"
    return text


def _step(parent: object, key: object) -> str:
    """One step of a path: ``['name']`` into a dict, ``[3]`` into a list or tuple,
    ``.name`` into a namedtuple."""
    fields = getattr(type(parent), "_fields", None)
    if isinstance(parent, tuple) and fields is not None and type(key) is int:
        return f".{fields[key]}"
    return f"[{key!r}]"


def _entries(node: list | tuple | dict) -> list[tuple[object, object]]:
    """``(key, child)`` pairs of a nested value, in ``_nest``'s visiting order."""
    if isinstance(node, dict):
        return [(key, node[key]) for key in _nest.dict_keys(node)]
    return list(enumerate(node))


def _by_form(mapping: dict) -> dict:
    """``mapping``'s keys by their forms (``_nest.key_forms``)."""
    keys, forms = _nest.key_forms(mapping)
    return dict(zip(forms, keys, strict=True))


def _a(leaf: object) -> str:
    """``a NoneType``, ``a set``: a leaf's type, for a message."""
    name = type(leaf).__name__
    return f"{'an' if name[:1] in 'aeiouAEIOU' else 'a'} {name}"


def leaf_path(value: object, index: int) -> tuple[str, object]:
    """The path (``['a'][1]``) of leaf number ``index`` of ``value``, in flattening
    order, and that leaf. For error messages only: it walks the structure."""
    count = 0

    def visit(node: object, path: str) -> tuple[str, object] | None:
        nonlocal count
        if not _nest.is_nested(node):
            count += 1
            return (path, node) if count - 1 == index else None
        for key, child in _entries(node):
            found = visit(child, path + _step(node, key))
            if found is not None:
                return found
        return None

    return visit(value, "") or ("", value)


def _node_text(node: object) -> str:
    """``a dict of 3``, ``a list of 2``, or ``float32[3]`` for a leaf."""
    if isinstance(node, dict):
        return f"a dict of {len(node)}"
    if isinstance(node, list | tuple):
        return f"a {type(node).__name__} of {len(node)}"
    return leaf_text(node)


def first_difference(
    first: object,
    other: object,
    keys: tuple[Callable[[Any], object], Callable[[Any], object]] = (leaf_text, leaf_text),
) -> tuple[str, str, str] | None:
    """Where two structures of arrays first differ, in ``_nest``'s visiting order:
    ``(path, what first has there, what other has there)``; None where they agree.

    A leaf of ``first`` and one of ``other`` agree when ``keys[0]`` and ``keys[1]``
    give equal values for them (by default their ``leaf_text``, dtype and shape);
    they are shown as ``leaf_text``. A key or item that one structure lacks reads
    ``missing``. For error messages only: it walks both structures.
    """

    def visit(a: object, b: object, path: str) -> tuple[str, str, str] | None:
        nested_a, nested_b = _nest.is_nested(a), _nest.is_nested(b)
        if not nested_a and not nested_b:
            if keys[0](a) == keys[1](b):
                return None
            return (path, leaf_text(a), leaf_text(b))
        if not nested_a or not nested_b or type(a) is not type(b):
            return (path, _node_text(a), _node_text(b))
        if isinstance(a, dict):
            # Over both dicts' key forms (as replicas' keys are compared: a NaN
            # key matches the other's NaN) in visiting order: the first that one
            # of them lacks, or under which they differ.
            keys_a, keys_b = _by_form(a), _by_form(b)
            for form in _nest.dict_keys({**keys_a, **keys_b}):
                if form not in keys_b:
                    key = keys_a[form]
                    return (path + _step(a, key), _node_text(a[key]), "missing")
                if form not in keys_a:
                    key = keys_b[form]
                    return (path + _step(b, key), "missing", _node_text(b[key]))
                key = keys_a[form]
                found = visit(a[key], b[keys_b[form]], path + _step(a, key))
                if found is not None:
                    return found
            return None
        entries_a, entries_b = _entries(a), _entries(b)
        for (key, child_a), (_, child_b) in zip(entries_a, entries_b, strict=False):
            found = visit(child_a, child_b, path + _step(a, key))
            if found is not None:
                return found
        if len(entries_a) != len(entries_b):
            key = min(len(entries_a), len(entries_b))
            text_a = _node_text(a[key]) if key < len(a) else "missing"
            text_b = _node_text(b[key]) if key < len(b) else "missing"
            return (path + _step(a, key), text_a, text_b)
        return None

    return visit(first, other, "")


def check_reducible(
    op: ReduceOp, array: Any, where: str, structure: object = _UNKNOWN, index: int = 0
) -> None:
    """Raise ``InvalidArgumentError`` when ``op`` cannot reduce ``array``'s dtype.

    ``structure``: the nested value ``array`` is leaf number ``index`` of, if any;
    the message then names the leaf's path and type.
    """
    kind = array.dtype.kind
    if kind in _NUMERIC_KINDS or (kind == "b" and op in (ReduceOp.MIN, ReduceOp.MAX)):
        return
    if structure is not _UNKNOWN:
        path, leaf = leaf_path(structure, index)
        at = f" (the leaf at {path}: {_a(leaf)})" if path else f" ({_a(leaf)})"
    else:
        path, leaf, at = "", _held(array), ""
    if isinstance(leaf, UNAWAITED):
        raise InvalidArgumentError(
            unawaited(leaf, f"{where} (the leaf at {path})" if path else where)
        )
    if isinstance(leaf, int) and kind == "O":  # an int NumPy could not make int64/uint64
        raise InvalidArgumentError(_int_too_large(op, leaf, where, path))
    raise InvalidArgumentError(
        f"{where}: cannot reduce values of dtype {array.dtype} with {op.name}{at}; expected "
        "numeric arrays or scalars (integers, floats, complex; bool only with MIN/MAX). "
        "Convert the value first, e.g. x.astype(np.int32)."
    )


def _int_too_large(op: ReduceOp, value: int, where: str, path: str) -> str:
    """Why ``value``, a Python int beyond 64 bits (NumPy holds it as dtype object),
    cannot be reduced: the message said "dtype object ... expected ... integers"."""
    # (Digits only while they are few: str() of an int over 4300 digits raises.)
    shown = str(value) if value.bit_length() <= 256 else f"of {value.bit_length()} bits"
    at = f" (the leaf at {path})" if path else ""
    return (
        f"{where}: cannot reduce the int {shown}{at} with {op.name}: it fits neither "
        "int64 nor uint64, so NumPy holds it as dtype object; expected integers from "
        "-2**63 to 2**64 - 1. Reduce it as a float (float(x)), or in parts that fit."
    )


def mean_operand(array: Any) -> Any:
    """``array`` as MEAN sums it: integers as float64, as NumPy's mean does (an int8
    sum would wrap at 127 before the division); anything else as it is."""
    return array.astype("float64") if array.dtype.kind in "iu" else array


def mean_of_sum(xp: Any, total: Any, count: int) -> Any:
    """``total / count`` as MEAN gives it: in place for floats, a new float array
    for integers (as NumPy and TensorFlow do). ``xp`` is NumPy or CuPy."""
    if total.dtype.kind in "fc":
        total /= count
        return total
    return xp.asarray(xp.true_divide(total, count))


def as_axis(axis: Any, where: str) -> int:
    """``axis`` as an int; raises ``InvalidArgumentError`` for anything else (a bool
    too: ``axis=True`` is a mistake, not axis 1)."""
    if isinstance(axis, bool):
        raise InvalidArgumentError(f"{where}: axis={axis!r}; expected an int.")
    try:
        return operator.index(axis)
    except TypeError:
        raise InvalidArgumentError(f"{where}: axis={axis!r}; expected an int.") from None


def gather_axis(array: Any, axis: int, where: str) -> int:
    """``axis`` as a non-negative index into ``array``'s shape, for concatenation.

    Raises ``InvalidArgumentError`` for rank-0 values (nothing to concatenate
    along) and out-of-range axes.
    """
    if array.ndim == 0:
        if isinstance(held := _held(array), UNAWAITED):
            raise InvalidArgumentError(unawaited(held, where))
        raise InvalidArgumentError(
            f"{where}: a rank-0 value ({leaf_text(array)}) has no axis to concatenate "
            "along; give it one first, e.g. x[None] with axis=0."
        )
    if not -array.ndim <= axis < array.ndim:
        raise InvalidArgumentError(
            f"{where}: axis={axis} is out of range for a value of shape "
            f"{tuple(array.shape)}; expected {-array.ndim} <= axis < {array.ndim}."
        )
    return axis % array.ndim
