"""Nested structures: lists, tuples, namedtuples and dicts of leaves.

Everything else is a leaf (arrays, scalars, None, DistributedValues, ...). Dict
entries are visited in sorted key order, so two dicts with the same keys flatten
alike whatever order they were built in. Keys that do not sort together (an int
and a str; TF's nest refuses them), or whose ``<`` is no total order (frozensets
order by subset, a NaN by nothing), are ordered by their type's name, then by
value (numbers of any type first, by value; a frozenset by its members, sorted;
a NaN after the numbers), or by ``repr`` where even that fails: an order that
still does not depend on the insertion order, so replicas that build one dict in
different orders agree on its leaves (their all_reduce matches).

Replicas' keys are compared by their *form* (``key_forms``): the key itself, but
a NaN, which equals no other NaN (each replica makes its own), as one marker, in
tuples and frozensets too; so ``{float("nan"): x}`` on every replica is one
structure.

Workers (``MultiWorkerMirroredStrategy``) compare structures as text, made by
``stable_repr``: ``repr`` lists a frozenset's members in hash order, which for
str and bytes differs between processes (``PYTHONHASHSEED``), so
``{frozenset({"a", "b"}): x}`` would read differently on two workers. The
structures that messages show are written by it too, so that two workers'
lines of one mismatch can be compared.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from numbers import Real
from typing import Any

__all__ = [
    "all_are",
    "all_of_type",
    "any_nested",
    "children",
    "dict_keys",
    "flatten",
    "flatten_with_skeleton",
    "is_nested",
    "key_forms",
    "map_structure",
    "pack_as",
    "rebuild",
    "skeleton",
    "stable_repr",
]


def is_nested(value: object) -> bool:
    return isinstance(value, list | tuple | dict)


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def dict_keys(mapping: dict) -> list:
    """A dict's keys in visiting order (also for error messages' paths)."""
    return key_forms(mapping)[0]


def key_forms(mapping: dict) -> tuple[list, list]:
    """``(dict_keys(mapping), their forms)``: what replicas' dicts are compared by
    (see the module docstring); the forms are the keys themselves, the same list,
    where no key needs another."""
    try:
        keys = sorted(mapping)
    except TypeError:  # keys of several types: see the module docstring
        return _canonical(mapping)
    # str keys, the common case: sorted() compared every key with another, and a
    # str compares with no other built-in type, so all are str, in their one order.
    if not keys or type(keys[0]) is str or _totally_ordered(keys):
        return keys, keys
    return _canonical(mapping)


def _totally_ordered(keys: list) -> bool:
    """Whether sorted ``keys`` are all ints, bytes or non-NaN floats (bools): keys
    whose ``<`` is a total order and that equal themselves, so their sorted order
    is their only one and each is its own form."""
    for key in keys:
        kind = type(key)
        if kind is int or kind is bytes or kind is bool or (kind is float and key == key):
            continue
        return False
    return True


class _NaN:
    """The form of every NaN key (see the module docstring)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "nan"


_NAN = _NaN()


def _form(key: object) -> object:
    """``key`` as replicas' dicts are compared by: a NaN as ``_NAN``, in tuples and
    frozensets too (a namedtuple becomes a tuple); any other key as itself."""
    kind = type(key)
    if kind is str or kind is int:
        return key
    if isinstance(key, tuple):
        return tuple(map(_form, key))
    if isinstance(key, frozenset):
        return frozenset(map(_form, key))
    try:
        if key != key:  # a NaN: float, NumPy or Decimal
            return _NAN
    except Exception:  # a key whose comparison fails: as it is
        pass
    return key


def _canonical(mapping: dict) -> tuple[list, list]:
    """``key_forms`` of keys that do not sort by ``<`` alone: ordered by their forms'
    ``_sort_key``, by value where those compare, else by ``repr``. (Equal forms,
    such as two NaNs of one dict, keep their insertion order.)"""
    pairs = [(_form(key), key) for key in mapping]
    try:
        pairs.sort(key=_by_value)
    except TypeError:
        pairs.sort(key=_by_repr)
    return [key for _, key in pairs], [form for form, _ in pairs]


def _sort_key(form: object, by_repr: bool) -> tuple:
    """A form's place: its type's name, then its value (``repr`` when ``by_repr``),
    a tuple's items and a frozenset's members (sorted) each placed so too; real
    numbers first, by value."""
    kind = type(form)
    if kind is frozenset:
        value: object = tuple(sorted(_sort_key(member, by_repr) for member in form))
    elif kind is tuple:
        value = tuple(_sort_key(item, by_repr) for item in form)
    elif form is _NAN:
        value = ""  # compares with nothing but itself: one NaN key's place
    elif isinstance(form, Real):
        # Real numbers by value, whatever their type (an int, a NumPy float), as
        # sorted() orders them: a dict of such keys is ordered so whether its keys
        # came here or sorted alone (dict_keys) on another replica.
        return ("", "", form)
    else:
        value = repr(form) if by_repr else form
    return (kind.__module__, kind.__qualname__, value)


def _by_value(pair: tuple) -> tuple:
    return _sort_key(pair[0], False)


def _by_repr(pair: tuple) -> tuple:
    return _sort_key(pair[0], True)


def children(value: list | tuple | dict) -> list:
    """The direct children of a nested value, in visiting order."""
    if isinstance(value, dict):
        return [value[key] for key in dict_keys(value)]
    return list(value)


def rebuild(template: list | tuple | dict, new_children: list) -> Any:
    """A container of ``template``'s type and keys holding ``new_children``."""
    if isinstance(template, dict):
        items = dict(zip(dict_keys(template), new_children, strict=True))
        # Keep the template's own key order in the result.
        ordered = {key: items[key] for key in template}
        return ordered if type(template) is dict else _dict_like(template, ordered)
    if _is_namedtuple(template):
        return type(template)(*new_children)
    if isinstance(template, tuple):
        return tuple(new_children) if type(template) is tuple else type(template)(new_children)
    return list(new_children) if type(template) is list else type(template)(new_children)


def _dict_like(template: dict, items: dict) -> dict:
    """A new dict of ``template``'s own type holding ``items``: a defaultdict keeps
    its default factory; other subclasses are made empty and filled item by item
    (a Counter built from pairs would count them; a defaultdict takes its factory
    first). One whose constructor needs arguments is given the items instead."""
    kind = type(template)
    if isinstance(template, defaultdict):
        result = kind(template.default_factory)
    else:
        try:
            result = kind()
        except TypeError:
            return kind(items)
    for key, item in items.items():
        result[key] = item
    return result


def _iter_leaves(value: object) -> Iterator[object]:
    if is_nested(value):
        for child in children(value):
            yield from _iter_leaves(child)
    else:
        yield value


_NESTED = (list, tuple, dict)


def any_nested(values: Any) -> bool:
    """Whether any of ``values`` is a container: one type test per distinct type,
    so a list of a hundred arrays costs one ``issubclass``. (A loop, not any() over
    a generator: 0.2 us less per call, several per merge_call.)"""
    for kind in set(map(type, values)):  # noqa: SIM110 (see above)
        if issubclass(kind, _NESTED):
            return True
    return False


# all_are and all_of_type: loops, not all() over a generator, which on Python 3.11
# costs about 1k instructions to make (0.15 us) besides its steps: they run on every
# run's results and every merge_call's arguments.


def all_are(values: Iterable[object], first: object) -> bool:
    """Whether every one of ``values`` is ``first`` (the same object)."""
    for value in values:  # noqa: SIM110 (see above)
        if value is not first:
            return False
    return True


def all_of_type(values: Iterable[object], kind: type) -> bool:
    """Whether every one of ``values`` is exactly a ``kind`` (not a subclass)."""
    for value in values:  # noqa: SIM110 (see above)
        if type(value) is not kind:
            return False
    return True


def flatten(value: object) -> list:
    """The leaves of ``value``, depth first."""
    if not isinstance(value, _NESTED):
        return [value]
    if not isinstance(value, dict) and not any_nested(value):
        return list(value)  # a flat list or tuple: the common case, without recursion
    return list(_iter_leaves(value))


def pack_as(template: object, leaves: list) -> Any:
    """The structure of ``template`` filled with ``leaves`` (inverse of ``flatten``)."""
    if type(template) is list and not any_nested(template):
        return list(leaves)  # a flat list: the common case, without recursion
    return _build(template, iter(leaves))


def _build(node: object, leaves: Iterator[object]) -> Any:
    """``pack_as``'s walk: ``node`` filled from ``leaves``. (A module function, not a
    closure calling itself: that closure would reach itself through its own cell, a
    cycle left for the garbage collector on every call.)"""
    if is_nested(node):
        return rebuild(node, [_build(child, leaves) for child in children(node)])
    return next(leaves)


def map_structure(fn: Callable[[object], object], value: object) -> Any:
    """``value`` with ``fn`` applied to every leaf."""
    if is_nested(value):
        return rebuild(value, [map_structure(fn, child) for child in children(value)])
    return fn(value)


def skeleton(value: object) -> object:
    """A hashable summary of ``value``'s nesting (leaves become None)."""
    if isinstance(value, dict):
        keys, forms = key_forms(value)
        if forms is keys:  # (the usual case: str keys)
            return ("dict", tuple((key, skeleton(value[key])) for key in keys))
        return ("dict", tuple(zip(forms, [skeleton(value[key]) for key in keys], strict=True)))
    if isinstance(value, list | tuple):
        if not any_nested(value):
            return (type(value).__name__, len(value))  # flat: no per-leaf work
        return (type(value).__name__, tuple(skeleton(child) for child in value))
    return None


def stable_repr(value: object) -> str:
    """``repr(value)`` of a skeleton (or a key holding one), or of a structure
    (``_arrays.structure_text``'s, in messages), the same text in every process:
    a frozenset's or set's members are listed in the order of their own texts,
    not in their hash order, which for str and bytes members depends on the
    process's hash seed. Tuples, lists, dicts (keys and values, in the dict's
    order) and namedtuples are walked to reach them; any other value is its
    ``repr``. (Workers compare these texts, and show them side by side when they
    differ; see the module docstring.)"""
    kind = type(value)
    if kind is tuple:
        if len(value) == 1:
            return f"({stable_repr(value[0])},)"
        return f"({', '.join(map(stable_repr, value))})"
    if kind is list:
        return f"[{', '.join(map(stable_repr, value))}]"
    if (kind is frozenset or kind is set) and value:
        return f"{kind.__name__}({{{', '.join(sorted(map(stable_repr, value)))}}})"
    if kind is dict:
        items = (f"{stable_repr(k)}: {stable_repr(v)}" for k, v in value.items())
        return f"{{{', '.join(items)}}}"
    if _is_namedtuple(value):
        fields = (f"{f}={stable_repr(v)}" for f, v in zip(kind._fields, value, strict=True))
        return f"{kind.__name__}({', '.join(fields)})"
    return repr(value)


def flatten_with_skeleton(value: object) -> tuple[list, object, set | None]:
    """``(flatten(value), skeleton(value), kinds)``, testing a flat list or tuple (the
    common case, often of a hundred tensors) for nesting once instead of twice.
    ``kinds``: the set of its leaves' types, for a flat list or tuple; else None."""
    if isinstance(value, list | tuple):
        kinds = set(map(type, value))
        if not any(issubclass(kind, _NESTED) for kind in kinds):
            return list(value), (type(value).__name__, len(value)), kinds
    return flatten(value), skeleton(value), None
