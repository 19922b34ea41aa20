"""Distributed values, and how they are unwrapped and regrouped.

A *distributed value* holds one component per replica:

- ``PerReplica``: components may differ (a per-replica batch, a per-replica loss);
  what ``strategy.run`` returns when replicas return different objects.
- ``Mirrored``: components are known to be equal (model weights, a broadcast
  result); safe to read in cross-replica context through any component.

*Unwrapping* (``select_replica``) replaces every distributed value inside a
nested structure by replica *i*'s component: that is how ``strategy.run`` hands
arguments to replica *i*, and how a ``merge_fn`` result reaches each replica.

*Regrouping* (``regroup``) is the inverse: N per-replica structures of the same
nesting become one structure whose leaves are ``PerReplica`` values, except
leaves that are the very same object on every replica, which stay as they are.
Distributed datasets and ``experimental_distribute_values_from_function`` wrap
those too (``regroup_wrapping_every_leaf``, TF's ``always_wrap``).

Devices given as strings (``PerReplica(values, ["cpu:0", "cpu:1"])``) are held as
``Device`` objects; ``devices`` shows their canonical names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

from . import _nest
from ._arrays import UNAWAITED, unawaited
from ._devices import Device, parse_device
from ._errors import InvalidArgumentError

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "refuse_structure",
    "regroup",
    "select_replica",
]


class DistributedValues:
    """One value per replica. Not built directly: use ``PerReplica`` or ``Mirrored``.

    ``devices``, if given, names one device per value, in any spelling
    (``"cpu:1"``, ``"/device:CPU:1"``, a ``Device``).
    ``strategy.experimental_local_results(v)`` gives the components as a tuple.
    """

    __slots__ = ("_devices", "_values")

    def __init__(self, values: Sequence[object], devices: Sequence[str | Device] | None = None):
        if type(self) is DistributedValues:
            raise TypeError("DistributedValues is abstract; use PerReplica or Mirrored.")
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise InvalidArgumentError(
                f"{type(self).__name__} needs a non-empty list or tuple of per-replica "
                f"values, got {values!r}."
            )
        self._values = tuple(values)
        if isinstance(devices, str | Device):
            # Iterated, a string gave its characters: "1 values but 5 devices", or
            # "device string 'c' is not understood".
            raise InvalidArgumentError(
                f"{type(self).__name__}: devices={str(devices)!r} is a single device; "
                f"expected a list of one device per value, e.g. {[str(devices)]!r}."
            )
        if devices is not None:
            devices = tuple(devices)
            if len(devices) != len(self._values):
                raise InvalidArgumentError(
                    f"{type(self).__name__}: {len(self._values)} values but "
                    f"{len(devices)} devices; expected one device per value."
                )
            # Device strings ("cpu:1", "/gpu:0") as Device objects: what the devices
            # property shows canonically and destinations resolve. (Strategies pass
            # Device objects: one type test each.)
            if not _nest.all_of_type(devices, Device):
                devices = tuple(map(parse_device, devices))
        self._devices = devices

    @classmethod
    def _make(cls, values: tuple, devices: tuple | None) -> DistributedValues:
        """Internal constructor for already-checked values (skips validation)."""
        self = object.__new__(cls)
        self._values = values
        self._devices = devices
        return self

    @property
    def values(self) -> tuple:
        """The components, one per replica, in replica order."""
        return self._values

    @property
    def devices(self) -> tuple[str, ...] | None:
        """Canonical device names of the components, when known."""
        return None if self._devices is None else tuple(str(d) for d in self._devices)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {value!r}" for i, value in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """A value that may differ from replica to replica."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """A value that is the same on every replica (kept in sync by the strategy)."""

    __slots__ = ()


_DISTRIBUTED_TYPES = frozenset((PerReplica, Mirrored))


def _component(value: DistributedValues, replica_id: int, num_replicas: int) -> object:
    if len(value._values) != num_replicas:
        raise InvalidArgumentError(
            f"a {type(value).__name__} with {len(value._values)} values was used where "
            f"this process runs {num_replicas} replica(s); pass values made by this strategy "
            "(its run, experimental_distribute_values_from_function, or datasets)."
        )
    return value._values[replica_id]


def copies_of(value: object) -> object:
    """``value`` with a variable as its copies: a ``PerReplica`` on the variable's
    devices (TF's distributed variables are distributed values, reduced component
    by component); a plain variable (made outside any scope) as its value, which is
    not distributed (so, as in TF, its SUM across several replicas is ambiguous and
    its MEAN is itself); anything else as it is."""
    if hasattr(value, "_aiodist_local_results"):
        if not value._aiodist_distributed:
            return value.read_value()
        return PerReplica(value._aiodist_local_results(), value._aiodist_devices)
    return value


def select_replicas(structure: object, num_replicas: int) -> list:
    """``[select_replica(i, structure, num_replicas) for i in range(num_replicas)]``,
    with each plain list of distributed values in a plain tuple or list (run's args
    holding a list of per-replica values, as experimental_distribute_values_from_function
    gives for a list) split for every replica at once: its components transposed by
    zip, in C, instead of picked replica by replica ((e), N = 4, uvloop: 256 -> 230 us
    per step)."""
    kind = type(structure)
    if (kind is tuple or kind is list) and structure:
        columns = []
        for item in structure:
            split = _split_list(item, num_replicas) if type(item) is list else None
            if split is None:
                split = [select_replica(i, item, num_replicas) for i in range(num_replicas)]
            columns.append(split)
        if kind is tuple:
            return [tuple(row) for row in zip(*columns)]  # noqa: B905 (n each)
        return [list(row) for row in zip(*columns)]  # noqa: B905 (n each)
    return [select_replica(i, structure, num_replicas) for i in range(num_replicas)]


def _split_list(values: list, num_replicas: int) -> list | None:
    """Each replica's list, for a nonempty plain list of distributed values of
    ``num_replicas`` components each; None for any other list (``select_replica``
    then picks, and raises for a wrong count)."""
    # (A set, maps and zip, in C: no Python step per value.)
    if not values or not set(map(type, values)) <= _DISTRIBUTED_TYPES:
        return None  # (a subclass of them too: select_replica picks it)
    try:
        rows = list(map(list, zip(*map(_VALUES_OF, values), strict=True)))
    except ValueError:  # components of unequal counts
        return None
    return rows if len(rows) == num_replicas else None


_VALUES_OF = attrgetter("_values")


def select_replica(replica_id: int, structure: object, num_replicas: int) -> object:
    """``structure`` with each distributed value replaced by replica ``replica_id``'s component."""
    if isinstance(structure, DistributedValues):
        return _component(structure, replica_id, num_replicas)
    kind = type(structure)
    if kind is tuple or kind is list:
        # Plain tuples and lists (run's args; a list of per-replica values, as
        # experimental_distribute_values_from_function gives for a list): one pass per
        # level, no closure and no generic walk ((e), N = 4, uvloop: 222 us per step
        # for a PerReplica of lists, 390 us for a list of PerReplica through
        # map_structure, 256 us this way). Other containers inside: the general path.
        picked = [
            _component(leaf, replica_id, num_replicas)
            if isinstance(leaf, DistributedValues)
            else select_replica(replica_id, leaf, num_replicas)
            if isinstance(leaf, _NESTED)
            else leaf
            for leaf in structure
        ]
        return tuple(picked) if kind is tuple else picked
    if not _nest.is_nested(structure):
        return structure

    def pick(leaf: object) -> object:
        if isinstance(leaf, DistributedValues):
            return _component(leaf, replica_id, num_replicas)
        return leaf

    return _nest.map_structure(pick, structure)


_NESTED = (list, tuple, dict)


def _describe(value: object) -> str:
    if isinstance(value, dict):
        # The keys' reprs joined (a list of them read ["'acc'", "'loss'"]), sorted so
        # two replicas' dicts built in different orders read alike.
        keys = ", ".join(sorted(map(repr, value)))
        return f"dict with keys {keys}" if value else "dict with no keys"
    if _nest._is_namedtuple(value):  # its fields: two classes may share a name
        return f"{type(value).__name__}({', '.join(map(str, type(value)._fields))})"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)}"
    return f"a leaf ({type(value).__name__})"


_ONE_AT_A_TIME = {
    "strategy.reduce": "strategy.reduce(op, v, axis=None)",
    "strategy.gather": "strategy.gather(v, axis=0)",
    "reduce_to": "strategy.extended.reduce_to(op, v, destinations)",
    "broadcast": "strategy.extended.broadcast_to(v, destinations)",
    "CrossDeviceOps.reduce": "ops.reduce(op, v, destinations)",
    "CrossDeviceOps.gather": "ops.gather(v, destinations, axis)",
}


def refuse_structure(value: object, where: str) -> None:
    """Raise ``InvalidArgumentError`` when ``value`` is a dict, or a list or tuple
    holding distributed values: ``where`` (a key of ``_ONE_AT_A_TIME``, or
    "batch_reduce_to") takes one value, as TF's do, and would otherwise see such a
    structure as one object array. A coroutine or future (an ``await`` missing) is
    refused too, by what it is, before it is taken for a value."""
    if not isinstance(value, _NESTED):
        if isinstance(value, UNAWAITED):
            raise InvalidArgumentError(unawaited(value, where))
        return
    distributed = any(
        # a variable (``_aiodist_local_results``) is distributed too
        isinstance(leaf, DistributedValues) or hasattr(leaf, "_aiodist_local_results")
        for leaf in _nest.flatten(value)
    )
    if isinstance(value, dict):  # never an array, distributed or not
        what = f"a dict (keys {', '.join(map(repr, value))})" if value else "an empty dict"
    elif distributed:  # a list of plain arrays is an array-like, as for NumPy
        what = f"a {_describe(value)}"
    else:
        return
    if distributed:
        what += " holding distributed values"
    one = "(one PerReplica from strategy.run, a Mirrored, or an array)"
    if where == "batch_reduce_to":
        values = "value.values()" if isinstance(value, dict) else "value"
        raise InvalidArgumentError(
            f"batch_reduce_to: a pair's value is {what}; each "
            f"pair holds one value {one}. Make a pair per value, e.g. "
            f"[(v, destinations) for v in {values}]."
        )
    call, advice = _ONE_AT_A_TIME[where], "Call it once per value"
    if where == "broadcast":
        # It takes one array: a PerReplica or Mirrored is refused too (the message
        # offered them, and its example broadcast each distributed value, refused next).
        one = "(one array)"
        if distributed:
            call = _ONE_AT_A_TIME["reduce_to"]
            advice = "To put distributed values on the destinations, reduce each instead"
    if isinstance(value, dict):
        example = f"{{k: await {call} for k, v in value.items()}}"
    else:
        example = f"[await {call} for v in value]"
    raise InvalidArgumentError(
        f"{where}: value is {what}; {where} takes one value {one}. {advice}, e.g. {example}."
    )


_new_object = object.__new__


def _regroup_flat(values: Sequence[object], kind: type | None, devices: Any) -> object:
    """``regroup`` of ``values`` that are all ``kind`` (list or tuple; None: tuples,
    as the caller knows, such as a merge_call's args, regrouped as a list) of one length
    with no container in them: one value per position, a ``PerReplica`` where the
    replicas' values differ. None when they are not all such (regroup then walks
    them as nested structures).

    One pass per column, each leaf's type tested only when it differs from the
    column's first: for a merge_call's one-scalar args of four replicas, regroup
    took 1.1 us instead of 1.65 us with a test of every row and a scan of every leaf
    before building anything.
    """
    size = len(values[0])
    # One element each (a merge_call's usual one argument), tuples of a few replicas:
    # their one column by concatenation, not zip(), which makes an iterator per
    # replica (0.3k instructions of a (c) step; quadratic in the replicas, cheaper
    # than zip's iterators only up to about a dozen).
    one_column = size == 1 and kind is not list and len(values) <= 8
    if kind is not None or not one_column:  # (kind None: only their lengths to test)
        for value in values:
            if (kind is not None and type(value) is not kind) or len(value) != size:
                return None
    if one_column:
        column = sum(values, ())
        # One each: the column holds one element per replica and none is empty. (For
        # a merge_call's args, all tuples, the lengths tested in C so, not one by one
        # above: (c), N = 4, uvloop: 191.9k -> 191.5k instructions per step.)
        if len(column) != len(values) or () in values:
            return None
        columns: Any = (column,)
        alike = False
    else:
        columns = zip(*values)  # noqa: B905 (lengths checked equal: strict= parses a keyword)
        # Every leaf of one type that is no container (a run's list of a hundred arrays
        # per replica): known from one set, made in C, so no column is scanned leaf by
        # leaf below ((e), N = 4, uvloop: 248 -> 242 us per step).
        kinds = set(map(type, chain.from_iterable(values)))
        alike = len(kinds) == 1 and not issubclass(next(iter(kinds)), _NESTED)
    devices = None if devices is None else tuple(devices)
    new = _new_object
    # merged.append called as a method, not bound once to a local: Python 3.11
    # specialises the call and makes no bound method object (1.0k instructions of
    # a (c) step).
    merged = []
    for column in columns:
        leaf = column[0]
        if not alike:
            leaf_type = type(leaf)
            if issubclass(leaf_type, _NESTED):
                return None
        # `leaf is column[-1]` settles the usual case (distinct per-replica values)
        # without scanning the column.
        if leaf is column[-1] and _nest.all_are(column, leaf):
            merged.append(leaf)
            continue
        if not alike:
            for other in column:
                if type(other) is not leaf_type and isinstance(other, _NESTED):
                    return None
        item = new(PerReplica)  # PerReplica._make, inlined: once per leaf of a result
        item._values, item._devices = column, devices
        merged.append(item)
    # (kind None: the caller takes the list as it is, 0.3k instructions of a (c) step.)
    return tuple(merged) if kind is tuple else merged


def _same_container(a: object, b: object) -> bool:
    if isinstance(a, dict):
        # Equal keys, or keys of equal forms in one order (a NaN key of each
        # replica's own: see _nest's docstring).
        return isinstance(b, dict) and (
            set(a) == set(b) or _nest.key_forms(a)[1] == _nest.key_forms(b)[1]
        )
    if type(a) is not type(b):
        # As in TF's nest: namedtuples of one name and fields nest alike, so a class
        # made inside the replica function (one per replica) regroups.
        return (
            _nest._is_namedtuple(a)
            and _nest._is_namedtuple(b)
            and type(a).__name__ == type(b).__name__
            and type(a)._fields == type(b)._fields
        )
    return len(a) == len(b)


# How a caller words "the values' structures differ", given the path where they
# do and each value's structure described (_describe): for values that are not
# plainly "replica i"'s, such as a dataset's consecutive elements (see _input).
StructuresDiffer = Callable[[str, list[str]], str]


def regroup(
    values: Sequence[object],
    devices: Sequence[Device] | None = None,
    *,
    what: str | StructuresDiffer = "returned",
    path: str = "",
) -> object:
    """Merge one structure per replica into one structure of ``PerReplica`` leaves.

    Raises ``InvalidArgumentError`` naming the replicas when nestings differ
    ("replicas {what} different structures"; or, where ``what`` is a function,
    the message it makes).
    """
    first = values[0]
    # `first is values[-1]` settles the usual case (distinct per-replica results)
    # without a loop.
    if first is values[-1] and _nest.all_are(values, first):
        return first
    kind = type(first)
    if not issubclass(kind, _NESTED):
        # The usual case, once per run: leaves of one type (arrays), so none is a
        # container. That test (_nest.all_of_type) and PerReplica._make written out
        # here: about 0.8 us less than any_nested() and the calls (4 replicas).
        for value in values:
            if type(value) is not kind:
                break
        else:
            item = _new_object(PerReplica)
            item._values, item._devices = tuple(values), None if devices is None else tuple(devices)
            return item
        if not _nest.any_nested(values):
            return PerReplica._make(tuple(values), None if devices is None else tuple(devices))
    if type(first) is dict and not first and all(type(v) is dict and not v for v in values):
        return {}  # empty kwargs, as merge_call usually gets
    kind = type(first)
    if kind is list or kind is tuple:
        # Flat lists of leaves (e.g. all-reduced gradients) or tuples of them (a
        # merge_call's args): one pass per column, None when something is nested.
        merged = _regroup_flat(values, kind, devices)
        if merged is not None:
            return merged
    return _regroup_nested(values, devices, what, path)


def regroup_wrapping_every_leaf(
    values: Sequence[object], devices: Sequence[Device], *, what: str | StructuresDiffer
) -> object:
    """``regroup``, with a ``PerReplica`` at every leaf, a leaf that is one object on
    every replica included (TF's ``always_wrap``): what a distributed dataset's
    elements and ``experimental_distribute_values_from_function``'s structures are,
    so each leaf reduces and has one local result per replica."""
    merged = regroup(values, devices, what=what)
    if len(values) == 1 or type(merged) is PerReplica:
        return merged
    n, devices = len(values), tuple(devices)

    def wrap(leaf: object) -> object:
        return leaf if isinstance(leaf, PerReplica) else PerReplica._make((leaf,) * n, devices)

    return _nest.map_structure(wrap, merged)


def _children_by_keys(mapping: dict, keys: list) -> list:
    """``mapping``'s values under ``keys``, or (a key missing) its children."""
    try:
        return [mapping[key] for key in keys]
    except KeyError:
        return _nest.children(mapping)


def _regroup_nested(
    values: Sequence[object], devices: Any, what: str | StructuresDiffer, path: str
) -> object:
    """``regroup`` of values some of which nest containers: all must nest alike.

    (Apart from regroup, whose flat cases run on every step: the comprehensions
    here make cells of the variables they use, on every call of the function that
    holds them, about 16 ns each on Python 3.11.)
    """
    first = values[0]
    nested = all(_nest.is_nested(value) for value in values)
    # (Containers compared only when all are: a leaf has no length to compare.)
    odd = nested and [i for i, value in enumerate(values) if not _same_container(first, value)]
    if not nested or odd:
        if callable(what):
            raise InvalidArgumentError(what(path, [_describe(v) for v in values]))
        shapes = "; ".join(f"replica {i}: {_describe(v)}" for i, v in enumerate(values))
        where = f" at {path}" if path else ""
        raise InvalidArgumentError(
            f"replicas {what} different structures{where} ({shapes}); every replica "
            "must produce the same nesting of lists, tuples and dicts."
        )
    if isinstance(first, dict):
        # Every replica's children in the order of the first's keys (by key: a
        # replica's dict may have been built in another order), or in visiting
        # order where a key of the first's is not its own (a NaN: its forms match).
        keys = _nest.dict_keys(first)
        per_child = [_children_by_keys(value, keys) for value in values]
    else:
        keys = None
        per_child = [_nest.children(value) for value in values]
    merged = [
        regroup(
            [kids[i] for kids in per_child],
            devices,
            what=what,
            path=f"{path}[{keys[i]!r}]" if keys is not None else f"{path}[{i}]",
        )
        for i in range(len(per_child[0]))
    ]
    return _nest.rebuild(first, merged)
