"""Distributed variables: mirrored and sync-on-read, with awaitable aggregated updates.

``aiodist.Variable(initial_value, ...)`` gives

- outside any scope: a plain variable with one copy on ``/device:CPU:0``;
- in ``strategy.scope()``: a ``MirroredVariable`` with one copy per device, all
  initialised identically (replicas sharing a device, such as several on one
  GPU, share its copy), or with ``synchronization=ON_READ`` a
  ``SyncOnReadVariable`` with one copy per replica (each replica updates its own
  copy; reading in cross-replica context aggregates them).

Reading resolves by context: inside a replica function of the variable's
strategy, the replica's own copy; elsewhere (cross-replica context) the primary
copy of a mirrored variable, or the aggregate of a sync-on-read variable.

Writing is a coroutine. In a replica function, ``await v.assign_add(x)`` on a
mirrored variable is a rendezvous (a ``merge_call``): every replica's ``x`` is
aggregated by ``v.aggregation`` and the same update is applied to every copy,
so the copies never drift; ``aggregation=NONE`` there raises ``ValueError``, as
TensorFlow documents (not under ``OneDeviceStrategy``, whose variables have one
copy, as TF's plain variables there: the write goes to it, no rendezvous made).
In cross-replica context the one value given is written
to every copy, or each copy gets its own component of a ``Mirrored`` value (such
as ``extended.reduce_to(..., destinations=v)`` returns); a ``PerReplica`` value
is refused there, since the copies must stay equal (``extended.update`` writes
each copy its own component).

A write keeps the variable's dtype: a value of another dtype is cast to it where
NumPy's "same_kind" casting allows (float64 or integers onto a float32 variable)
and refused otherwise (a float onto an integer variable: cast it first). A Python
int written to an integer variable is taken in the variable's dtype, as TF takes
it, so ``await steps.assign_add(1)`` counts on a uint32 variable; one that does
not fit the dtype (300 for an int8 variable) is refused with
``InvalidArgumentError`` rather than wrapped. Integers of a wider dtype (a list
of Python ints, int64 to NumPy) are taken alike, and an initial value that the
``dtype=`` given cannot hold is refused. The result of
``assign_add``/``assign_sub`` wraps as NumPy's integer arithmetic does.

Operators (``v + 1``, ``v < x``, ``v == x``, ``v & m``, ``~v``, ...) act on the
value read, element-wise, as TF's do (``&``, ``|``, ``^``, ``~``: logical for
bools, bitwise for integers); so variables are unhashable, and ``v.ref()`` is what
to use as a dict key. Iteration and ``x in v`` go over one read of the value,
as over that array (a 0-d value cannot be iterated).

Copies are immutable arrays: an update replaces them, so a value read earlier
never changes under the reader, and an update is applied between two awaits,
never half-way (concurrent runs do not lose updates). Each update's read of the
old copies and write of the new ones hold one lock, so runs on event loops in
other threads (a strategy may serve several) do not lose updates either.
"""

from __future__ import annotations

import enum
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from typing import Any

import numpy as np

from . import _context, _nest
from ._arrays import mean_of_sum, mean_operand
from ._backends import backend_for, host_array, is_cupy_array
from ._checks import member, not_callable, refuse_awaitables, short_repr
from ._devices import HOST as _HOST
from ._devices import Device
from ._errors import AiodistError, ContextError, InvalidArgumentError
from ._ops import ReduceOp
from ._replica_context import _keywords, _positional
from ._values import DistributedValues, Mirrored, PerReplica, _component, select_replica

__all__ = [
    "MirroredVariable",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableCopy",
    "VariableSynchronization",
]


class VariableAggregation(enum.Enum):
    """How per-replica updates (or sync-on-read copies) are combined."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


class VariableSynchronization(enum.Enum):
    """When copies are synchronised: on write (mirrored) or on read."""

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


# Held by every update from reading a variable's old copies to writing its new ones:
# a strategy may run on event loops in several threads, and two threads' assign_add
# of one variable, each adding to the copies it had read, lost an update and left
# the mirrors unequal. One lock for all variables (held for microseconds, and
# contended only across threads) keeps variables picklable and deep-copyable.
_WRITE_LOCK = threading.Lock()


def _frozen(array: Any) -> Any:
    if isinstance(array, np.ndarray):
        array.flags.writeable = False
    return array


def _fitting_int(value: Any, variable: Variable, kind: str) -> Any:
    """``value``, or, when it is a Python int (not a bool) written to an integer
    ``variable`` (by its ``kind`` of write), that int as a 0-d array of the
    variable's dtype, refused when it does not fit.

    As TF converts a Python number to the variable's dtype: left to NumPy, a Python
    int became an int64 array, which an unsigned variable refused ("a value of dtype
    int64 cannot be written to a variable of dtype uint32"), so a counter could not
    be incremented by 1, and which a narrower signed one took wrapped (300 written
    to an int8 variable read 44; NumPy itself refuses np.asarray(300, np.int8)).
    Only the value given must fit: the sum of an ``assign_add`` wraps as NumPy's
    (and TF's) integer arithmetic does."""
    dtype = variable.dtype
    if isinstance(value, bool) or dtype.kind not in "iu":
        return value
    low, high = _int_range(dtype)
    if not low <= value <= high:  # (the write's name made only for the error)
        _refuse_outside(variable._write_name(kind), value, value, dtype)
    return np.asarray(value, dtype)


@functools.cache
def _int_range(dtype: np.dtype) -> tuple[int, int]:
    """The least and greatest values of the integer ``dtype`` (np.iinfo, kept: it
    took 0.6 us a call, on every write of a Python int)."""
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _refuse_outside(where: str, low: Any, high: Any, dtype: np.dtype) -> None:
    """Refuse integers from ``low`` to ``high`` that the integer ``dtype`` (the
    variable's) cannot hold, naming the first out of its range: NumPy's cast would
    wrap them."""
    least, greatest = _int_range(dtype)
    if low < least or high > greatest:
        raise InvalidArgumentError(
            f"{where}: {low if low < least else high} does not fit {dtype} "
            f"({least}..{greatest}), the variable's dtype; an integer is written in "
            "that dtype, never wrapped. Give values in that range."
        )


def _refuse_lossy_initial_value(name: str, given: np.ndarray, dtype: np.dtype) -> None:
    """Refuse an initial value that ``dtype`` (the one asked for) cannot hold: as TF
    refuses ``tf.Variable(300, dtype=tf.int8)`` and ``tf.Variable(1.7,
    dtype=tf.int32)``, where NumPy's cast read 44 and 1. Integers are checked
    against the dtype's range; fractions, imaginary parts and numbers as bools are
    refused by kind."""
    if given.dtype == dtype or given.dtype.kind not in "biufc" or dtype.kind not in "biufc":
        return
    to, of = dtype.kind, given.dtype.kind
    # A cast down the kinds (complex, float, integer, bool) loses; one between
    # integers is checked against the range below.
    if not np.can_cast(given.dtype, dtype, "same_kind") and not (to in "iu" and of in "iu"):
        raise InvalidArgumentError(
            f"{name}: an initial value of dtype {given.dtype} cannot become dtype "
            f"{dtype} without loss; expected a value of that dtype (where the loss is "
            f"meant, cast it first: value.astype(np.{dtype}))."
        )
    if to in "iu" and of in "iu" and given.size:
        _refuse_outside(f"{name}: initial value", given.min(), given.max(), dtype)


def _update_value(kind: str, old: Any, value: Any, where: str) -> Any:
    """The new copy for ``assign``/``assign_add``/``assign_sub`` of ``value`` onto ``old``."""
    if is_cupy_array(old):
        # CuPy runs kernels on, and allocates from, the *current* device. Copies are
        # written in a loop with one device current (a merge_fn's: the first one's),
        # so for a copy on another GPU ``old + value`` raised "Peer access is
        # unavailable", or, with peer access, the new copy landed on the current
        # device. Its own device is made current (with that device's current stream).
        with old.device:
            return _new_value(__import__("cupy"), kind, old, value, where)
    return _new_value(np, kind, old, value, where)


def _new_value(xp: Any, kind: str, old: Any, value: Any, where: str) -> Any:
    value = xp.asarray(value)
    # The shape first, for every kind: old + value of shapes that do not broadcast
    # raised NumPy's "operands could not be broadcast together", naming neither the
    # variable nor the write.
    if value.shape != old.shape:
        try:
            value = xp.broadcast_to(value, old.shape)
        except ValueError:
            raise InvalidArgumentError(
                f"{where}: a value of shape {tuple(value.shape)} cannot be written to a "
                f"variable of shape {tuple(old.shape)}; expected that shape or one that "
                "broadcasts to it."
            ) from None
    if (
        xp is np  # (on GPUs min/max would wait for the device, in a merge: SPEC 7)
        and value.dtype != old.dtype
        and value.dtype.kind in "iu"
        and old.dtype.kind in "iu"
        and not np.can_cast(value.dtype, old.dtype, casting="safe")
    ):
        # Integers of a wider (or other-signed) dtype, such as a list of Python ints,
        # int64: taken in the variable's dtype when they fit it, as a Python int is
        # (_fitting_int), so the arithmetic below wraps alike. A uint8 variable
        # refused [1, 2]; an int8 one took np.int64(300) as 44. (GPU copies cast by
        # the rule below, as before.)
        if value.size:
            _refuse_outside(where, value.min(), value.max(), old.dtype)
        value = value.astype(old.dtype)
    if kind == "assign_add":
        value = xp.asarray(old + value)  # ufuncs give scalars for 0-d arrays
    elif kind == "assign_sub":
        value = xp.asarray(old - value)
    if not np.can_cast(value.dtype, old.dtype, casting="same_kind"):
        raise InvalidArgumentError(
            f"{where}: a value of dtype {value.dtype} cannot be written to a variable of "
            f"dtype {old.dtype}; cast it first."
        )
    return _frozen(value.astype(old.dtype, copy=True))


def _not_numbers(value: Any) -> str | None:
    """Why ``value`` is not a number or an array of numbers (None, a string, a ragged
    list, ...), or None when it is one. Asked only once a write has failed, so the
    usual write tests nothing; a failure with values of numbers is someone else's
    (an ``accumulation_fn``, say) and is raised as it is."""
    values = value._values if isinstance(value, DistributedValues) else (value,)
    for part in values:
        try:
            dtype = host_array(part).dtype
        except (TypeError, ValueError):  # a ragged list: no one array
            return "its lists nest unevenly"
        if dtype.kind not in "biufc":
            return f"dtype {dtype}"
    return None


def _refuse_non_numbers(where: str, value: Any, dtype: Any, error: Exception) -> None:
    """Raise ``InvalidArgumentError`` naming ``value`` when a write of it failed with
    ``error`` (NumPy's or Python's own words) because it is not numbers; return (the
    caller re-raises ``error``) for any other failure."""
    if isinstance(error, AiodistError):
        return
    why = _not_numbers(value)
    if why is not None:
        raise InvalidArgumentError(
            f"{where}: value={short_repr(value)} is not a number or an array of numbers "
            f"({why}); expected numbers that cast to the variable's dtype {dtype}."
        ) from None


def _integer_sums(arrays: Sequence[Any], n: int, xp: Any = np) -> tuple[Any, Any]:
    """Integer ``arrays`` summed for an exact MEAN over ``n`` values, in 64 bits that
    cannot overflow: ``(q, r)`` with ``sum(arrays) == q * n + r`` and ``|r| < n * n``
    (each array divided by ``n`` toward zero first, so ``|q|`` stays within the
    largest ``|array|``). Signed 64 bits, or unsigned where every array is unsigned.
    Across workers, ``q`` and ``r`` are summed over every worker's arrays too. ``xp``:
    NumPy (the arrays copied to the host), or CuPy for arrays on one GPU (computed
    there, in stream order)."""
    unsigned = all(np.dtype(a.dtype).kind == "u" for a in arrays)
    wide = np.dtype(np.uint64 if unsigned else np.int64)
    count = wide.type(n)
    q_total = r_total = wide.type(0)
    for array in arrays:
        a = (np.asarray(host_array(array)) if xp is np else array).astype(wide)
        q = a // count  # floor; toward zero for the negative ones just below
        if not unsigned:
            q = q + ((a < 0) & (a % count != 0))
        q_total = q_total + q
        r_total = r_total + (a - q * count)  # each in (-n, n); |q * n| <= |a|
    return xp.asarray(q_total), xp.asarray(r_total)


def _mean_of_sums(q: Any, r: Any, n: int, dtype: np.dtype, xp: Any = np) -> Any:
    """The MEAN ``(q * n + r) / n`` (see ``_integer_sums``) in ``dtype``, rounded half
    to even, computed without ever forming the sum (which may not fit in 64 bits)."""
    count = q.dtype.type(n)
    carry, remainder = xp.divmod(r, count)  # floor: remainder in [0, n)
    low = q + carry  # the floor of the mean: between the values, so it fits
    up = (2 * remainder > count) | ((2 * remainder == count) & (low % 2 == 1))
    return xp.asarray(low + up).astype(dtype)


def _unary(op: Callable[[Any], Any]) -> Callable[[Variable], Any]:
    def method(self: Variable) -> Any:
        return op(self.read_value())

    return method


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable, Callable]:
    """``op`` with the variable's value on the left, and with it on the right."""

    def method(self: Variable, other: Any) -> Any:
        return op(self.read_value(), other)

    def reflected(self: Variable, other: Any) -> Any:
        return op(other, self.read_value())

    return method, reflected


class _ReadsAsValue:
    """What a variable and a ``VariableCopy`` share: they read as their value
    (``read_value()``), and their arithmetic and comparisons act on it,
    element-wise, as TF's do (an update's fn gets a copy that computes: without
    these, ``copy * 2`` raised TypeError and ``copy == 5`` compared identities)."""

    __slots__ = ()

    def numpy(self) -> np.ndarray:
        """A host (NumPy) copy of ``read_value()``."""
        return np.array(host_array(self.read_value()), copy=True)

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())

    def __len__(self) -> int:
        return len(self.read_value())

    def __getitem__(self, index: Any) -> Any:
        return self.read_value()[index]

    # Iteration and ``in`` over one read, as for the array read. Without them Python
    # fell back to __getitem__(0), (1), ... until IndexError: a 0-d variable iterated
    # as empty (``list(v)`` was [], ``x in v`` False) where NumPy and TF raise
    # TypeError, and a sync-on-read one aggregated its copies once per element.
    def __iter__(self) -> Iterator[Any]:
        return iter(self.read_value())

    def __contains__(self, item: Any) -> bool:
        return item in self.read_value()

    def __bool__(self) -> bool:
        return bool(self.read_value())  # NumPy's rule: only a one-element value has a truth

    __neg__ = _unary(operator.neg)
    __abs__ = _unary(operator.abs)
    __invert__ = _unary(operator.invert)  # logical not of bools, bitwise of integers
    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __matmul__, __rmatmul__ = _binary(operator.matmul)
    __and__, __rand__ = _binary(operator.and_)  # (TF's too: logical for bools)
    __or__, __ror__ = _binary(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor)
    __lt__, __gt__ = _binary(operator.lt)  # 1 < v is v > 1
    __le__, __ge__ = _binary(operator.le)
    __eq__ = _binary(operator.eq)[0]
    __ne__ = _binary(operator.ne)[0]
    __hash__ = None  # type: ignore[assignment]

    __array_priority__ = 100  # ndarray op variable defers to the reflected methods


class VariableRef:
    """What ``Variable.ref()`` returns: hashable and equal by the variable's identity."""

    __slots__ = ("_variable",)

    def __init__(self, variable: Variable):
        self._variable = variable

    def deref(self) -> Variable:
        """The variable referred to."""
        return self._variable

    def __hash__(self) -> int:
        return id(self._variable)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableRef) and other._variable is self._variable

    def __repr__(self) -> str:
        return f"<VariableRef to {self._variable._name!r}>"


class VariableCopy(_ReadsAsValue):
    """One copy of a distributed variable, as ``extended.update`` hands it to ``fn``.

    Reads as its array (``np.asarray(copy)``, ``copy.value()``, ``read_value()``,
    ``numpy()``), and like a variable: arithmetic and comparisons act on that
    array, element-wise (``copy.assign(copy * 2)``), as on TF's component variable.
    Its ``assign``, ``assign_add`` and ``assign_sub`` change this copy only, right away.
    """

    __slots__ = ("_index", "_variable")

    def __init__(self, variable: Variable, index: int):
        self._variable = variable
        self._index = index

    @property
    def device(self) -> str:
        return str(self._variable._devices[self._index])

    @property
    def name(self) -> str:
        return self._variable._name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value().shape)

    @property
    def dtype(self) -> np.dtype:
        return self.value().dtype

    def value(self) -> Any:
        return self._variable._values[self._index]

    read_value = value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array(host_array(self.value()), dtype=dtype, copy=True)

    def _write(self, kind: str, value: Any) -> VariableCopy:
        variable = self._variable
        device = variable._devices[self._index]
        where = f"{variable._name}.{kind} (copy on {device})"
        try:  # (a Python int is checked against the dtype in _new_value, as int64)
            placed = backend_for(device).asarray(value, device)
            with _WRITE_LOCK:
                variable._values[self._index] = _update_value(kind, self.value(), placed, where)
        except (TypeError, ValueError) as error:
            _refuse_non_numbers(where, value, variable.dtype, error)
            raise
        return self

    def assign(self, value: Any) -> VariableCopy:
        return self._write("assign", value)

    def assign_add(self, value: Any) -> VariableCopy:
        return self._write("assign_add", value)

    def assign_sub(self, value: Any) -> VariableCopy:
        return self._write("assign_sub", value)

    def __repr__(self) -> str:
        return f"<VariableCopy {self._variable._name!r} on {self.device}: {self.value()!r}>"


def _initial_host(
    name: str, initial_value: Any, dtype: Any, aggregation: VariableAggregation
) -> np.ndarray:
    """A variable's initial value, checked, as a host array of ``dtype``."""
    given_value = initial_value
    if callable(initial_value):
        initial_value = initial_value()
    # (An async function's coroutine read as "initial_value has dtype object", and
    # Python warned that it was never awaited.)
    refuse_awaitables(
        (initial_value,),
        lambda: (
            f"{name}: initial_value={given_value!r} is or returned an awaitable; "
            "a variable's initial value is taken when it is made, not awaited: pass "
            "the value (await it first) or a plain function (def, not async def) "
            "returning it."
        ),
    )
    if isinstance(initial_value, DistributedValues | Variable):
        raise InvalidArgumentError(
            f"{name}: initial_value is a {type(initial_value).__name__}; expected "
            "one array or scalar (read a component first)."
        )
    try:
        given = np.asarray(host_array(initial_value))
        wanted = given.dtype if dtype is None else np.dtype(dtype)
        _refuse_lossy_initial_value(name, given, wanted)  # (before a cast warns)
        host = np.array(given, dtype=wanted)
    except InvalidArgumentError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{name}: initial_value={initial_value!r} is not an array of numbers ({exc})."
        ) from None
    if host.dtype.kind not in "biufc":
        raise InvalidArgumentError(
            f"{name}: initial_value has dtype {host.dtype}; expected numbers."
        )
    summed = (VariableAggregation.SUM, VariableAggregation.MEAN)
    if host.dtype.kind == "b" and aggregation in summed:
        raise InvalidArgumentError(
            f"{name}: a bool variable cannot have aggregation="
            f"{aggregation.name} (a sum of bools is not a bool); use NONE or "
            "ONLY_FIRST_REPLICA, or an integer dtype."
        )
    return host


def _tell_refusal(strategy: Any, name: Any, exc: Exception) -> None:
    """A variable of ``strategy``'s (its ``name``, as given) was refused on this
    worker before it was exchanged: a multi-worker strategy still takes its place
    in the order, so the other workers raise at once instead of pairing their
    creation of it with this worker's next cross-worker call."""
    if strategy is not None and strategy._world is not None:
        strategy._tell_refusal_now(f"Variable {'Variable' if name is None else str(name)!r}", exc)


class Variable(_ReadsAsValue):
    """A variable: plain outside any scope, distributed inside ``strategy.scope()``.

    The default strategy counts as no strategy: in its ``run`` and ``merge_fn`` (a
    ``merge_call`` of the default replica context) the variable is plain too.

    Args:
        initial_value: an array, scalar or nested list of numbers (or a
            zero-argument plain function returning one: an awaitable, or an
            ``async def`` function, is refused).
        aggregation: how replicas' updates combine (``VariableAggregation``).
        synchronization: ``ON_READ`` makes a ``SyncOnReadVariable``; anything
            else a ``MirroredVariable`` (inside a scope).
        name: used in messages and as the checkpoint key (default ``"Variable"``).
        dtype: the dtype to store (default: that of ``initial_value``).

    Examples:
        >>> import aiodist
        >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     v = aiodist.Variable(0.0, aggregation="sum")
        >>> async def step():
        ...     await v.assign_add(1.0)  # aggregated over the replicas, applied to every copy
        >>> aiodist.run(strategy.run(step))
        >>> strategy.experimental_local_results(v)
        (array(2.), array(2.))
    """

    _copy_per_device = False  # one copy per replica (a mirrored one: per device)

    def __new__(cls, *args: Any, **kwargs: Any) -> Variable:
        if cls is Variable:
            # The default strategy current (in its own run or merge_fn, such as a
            # merge_call of the default replica context outside any scope) is no
            # strategy, as in TF: a plain variable, as outside any scope.
            state = _context.current_state()
            if _context.non_default(state[_context.STRATEGY]) is not None:
                if state[_context.REPLICA] is not None:
                    raise ContextError(
                        "aiodist.Variable() was called inside a replica function; create "
                        "variables in cross-replica context, under `with strategy.scope():`, "
                        "and pass them to strategy.run."
                    )
                try:
                    sync = member(
                        VariableSynchronization,
                        kwargs.get("synchronization", VariableSynchronization.AUTO),
                        "synchronization",
                    )
                except Exception as exc:
                    _tell_refusal(state[_context.STRATEGY], kwargs.get("name"), exc)
                    raise
                cls = (
                    SyncOnReadVariable
                    if sync is VariableSynchronization.ON_READ
                    else MirroredVariable
                )
        return super().__new__(cls)

    def __init__(
        self,
        initial_value: Any,
        *,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
        name: str | None = None,
        dtype: Any = None,
    ):
        self._name = "Variable" if name is None else str(name)
        try:
            self._aggregation = member(VariableAggregation, aggregation, "aggregation")
            self._synchronization = member(
                VariableSynchronization, synchronization, "synchronization"
            )
            host = _initial_host(self._name, initial_value, dtype, self._aggregation)
        except Exception as exc:  # refused here: in a scope, the other workers are told
            if type(self) is not Variable:
                _tell_refusal(_context.current_strategy(), self._name, exc)
            raise
        strategy = None if type(self) is Variable else _context.current_strategy()
        if type(self) is not Variable and strategy is None:
            raise ContextError(
                f"{type(self).__name__} {self._name!r} was created outside any strategy "
                "scope; create it as aiodist.Variable(...) under `with strategy.scope():`."
            )
        self._strategy = strategy
        if strategy is not None and strategy._world is not None:
            # Every worker's copies start from worker 0's value (a synchronous
            # rendezvous of the workers, at the same point of the program). The name
            # must agree too: two variables of one shape created in another order on
            # one worker would otherwise take each other's values, silently.
            timeout = strategy._communication_options.timeout_seconds
            what = f"Variable {self._name!r}"
            host = strategy._world.broadcast_now(host, what, timeout, self._name)
        # Each local replica's device, and the index of the copy it reads and writes:
        # one copy per replica, or, for a mirrored variable, one per distinct device
        # (SPEC 9), shared by the replicas on it.
        self._replica_devices: tuple[Device, ...] = (
            (_HOST,) if strategy is None else tuple(s.device for s in strategy._slots)
        )
        if self._copy_per_device:
            first: dict[Device, int] = {}
            for device in self._replica_devices:
                first.setdefault(device, len(first))
            self._copy_of = tuple(first[d] for d in self._replica_devices)
            self._devices: tuple[Device, ...] = tuple(first)
        else:
            self._copy_of = tuple(range(len(self._replica_devices)))
            self._devices = self._replica_devices
        # The replica whose component of a Mirrored value each copy takes (its first).
        self._replica_of_copy = tuple(self._copy_of.index(c) for c in range(len(self._devices)))
        self._values = [_frozen(backend_for(d).asarray(host.copy(), d)) for d in self._devices]
        # Whether writes of the copies are ordered with the replicas' streams (GPUs).
        self._on_streams = strategy is not None and strategy._slots[0].backend.needs_activation

    # -- identity -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._values[0].shape)

    @property
    def dtype(self) -> np.dtype:
        return self._values[0].dtype

    @property
    def device(self) -> str:
        """The canonical name of the device of the copy read here: in a replica
        function, the replica's copy's; elsewhere the primary (first) copy's, as
        TF's ``device`` of a distributed variable (a plain one's: ``/device:CPU:0``)."""
        index = self._replica_index()
        return str(self._devices[0 if index is None else index])

    @property
    def devices(self) -> tuple[str, ...]:
        """Canonical names of the copies' devices, in replica order (a mirrored
        variable's once per device: replicas sharing a device share its copy)."""
        return tuple(str(d) for d in self._devices)

    def __repr__(self) -> str:
        if len(self._values) == 1:
            return f"<{type(self).__name__} {self._name!r} {self._values[0]!r}>"
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__} {self._name!r}:{{\n{body}\n}}"

    # hooks used by strategies (experimental_local_results, destinations): one entry
    # per local replica, as for any distributed value (replicas sharing a copy show it
    # once each)
    @property
    def _aiodist_devices(self) -> tuple[Device, ...]:
        return self._replica_devices

    def _aiodist_local_results(self) -> tuple:
        values = self._values
        return tuple(values[c] for c in self._copy_of)

    @property
    def _aiodist_distributed(self) -> bool:
        """Whether this variable belongs to a strategy (made in its scope); a plain
        one is reduced as the one value it holds, as TF reduces it."""
        return self._strategy is not None

    # -- reading ----------------------------------------------------------------------

    def _replica_index(self) -> int | None:
        """The index of this replica's copy inside a replica function of our strategy,
        else None."""
        replica = _context.current_replica()
        if replica is None or self._strategy is None or replica.strategy is not self._strategy:
            return None
        return self._copy_of[replica._replica_id]  # (local ids: global ones span workers)

    def read_value(self) -> Any:
        """The value in this context: the replica's copy, or (cross-replica) the
        primary copy / the aggregate. Arrays are read-only snapshots."""
        index = self._replica_index()
        return self._values[0 if index is None else index]

    value = read_value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = host_array(self.read_value())
        return np.array(value, dtype=dtype, copy=True) if copy else np.asarray(value, dtype=dtype)

    def __deepcopy__(self, memo: dict) -> Variable:
        """A new variable of the same strategy, on the same devices, with copies of
        the values, as TF deep-copies a distributed variable. (Python's default
        also copied the strategy, whose scope and run then refused the copy as
        "Mixing different aiodist strategies", and left the copies' arrays
        writeable, so a read could change the variable in place.)"""
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)  # the strategy, name and devices: shared
        new._values = [_frozen(deepcopy(value, memo)) for value in self._values]
        return new

    def ref(self) -> VariableRef:
        """A hashable reference to this variable, for dict keys and sets: variables
        compare element-wise (``v == x`` is an array), so they are unhashable, as in TF."""
        return VariableRef(self)

    # -- writing ----------------------------------------------------------------------

    async def assign(self, value: Any) -> Variable:
        """Set the value (see the module docs for how replicas combine)."""
        return await self._checked_write("assign", value)

    async def assign_add(self, value: Any) -> Variable:
        """Add to the value (see the module docs for how replicas combine)."""
        return await self._checked_write("assign_add", value)

    async def assign_sub(self, value: Any) -> Variable:
        """Subtract from the value (see the module docs for how replicas combine)."""
        return await self._checked_write("assign_sub", value)

    async def _checked_write(self, kind: str, value: Any) -> Variable:
        """``_write``, under this variable's own strategy, with a value that is not
        numbers named (not NumPy's or Python's own error)."""
        self._require_own_strategy()
        if isinstance(value, int):  # (one test on the usual write, of an array)
            # In replica context each replica's own, before a mirrored variable's
            # rendezvous: its aggregate is then made in the variable's dtype.
            value = _fitting_int(value, self, kind)
        try:
            return await self._write(kind, value)
        except (TypeError, ValueError) as error:
            _refuse_non_numbers(f"{self._name}.{kind}", value, self.dtype, error)
            raise

    def _write_name(self, kind: str) -> str:
        """``name.kind`` for errors, with the replica's id in a replica function."""
        name = f"{self._name}.{kind}"
        if self._replica_index() is None:
            return name
        return f"{name} (replica {_context.current_replica().replica_id_in_sync_group})"

    def _require_own_strategy(self) -> None:
        """TF's rule: a strategy's variable is written under that strategy (its scope,
        its run, its merge_fn) or under none; under another one, its replicas could
        not be combined, and it raises "Mixing different ... strategies"."""
        if self._strategy is None:
            return
        current = _context.current_strategy()
        if current is not None and current is not self._strategy:
            raise _context._mixing(current, self._strategy)

    async def _write(self, kind: str, value: Any) -> Variable:
        self._write_every_copy(kind, value)
        return self

    def _write_every_copy(self, kind: str, value: Any) -> None:
        self._write_copies(kind, self._per_copy(kind, value))

    def _write_copies(self, kind: str, parts: list, where: str | None = None) -> None:
        """Each copy updated (``kind``) with its part; ``where`` names the write in
        errors (``name.kind`` by default)."""
        if not self._on_streams:
            # Nothing to order (a plain variable, CPU devices): no context manager
            # made per write (about 1 us, on every aggregated update).
            self._replace_copies(kind, parts, where)
            return
        # GPUs: the current streams first wait for the replicas' queued work (which may
        # still read the old copies, whose memory is freed here), and the replicas'
        # later work waits for the write.
        with self._strategy._cross_replica_order():
            self._replace_copies(kind, parts, where)

    def _replace_copies(self, kind: str, parts: list, where: str | None = None) -> None:
        placed = [backend_for(d).asarray(p, d) for d, p in zip(self._devices, parts, strict=True)]
        where = where or f"{self._name}.{kind}"
        with _WRITE_LOCK:  # no other thread's update between our read and our write
            new = [
                _update_value(kind, old, part, where)
                for old, part in zip(self._values, placed, strict=True)
            ]
            self._values[:] = new  # all copies change together, or none does

    def _per_copy(self, kind: str, value: Any) -> list:
        """What a cross-replica write gives each copy: a ``Mirrored`` value's own
        component (as TF allows), otherwise the one value, copied to the host once."""
        if isinstance(value, Mirrored):  # one component per replica: each copy's first
            n = len(self._copy_of)
            return [host_array(_component(value, r, n)) for r in self._replica_of_copy]
        if isinstance(value, DistributedValues):
            raise InvalidArgumentError(
                f"{self._name}.{kind}() in cross-replica context got a "
                f"{type(value).__name__}; expected one value or a Mirrored one (the "
                "copies must stay equal). To give each copy its own component, use "
                "strategy.extended.update(variable, fn, args=(value,)), or write in "
                "replica context."
            )
        return [host_array(value)] * len(self._values)

    def _saved_value(self) -> np.ndarray:
        """What a checkpoint stores: the value read in cross-replica context."""
        return host_array(self._values[0])

    def _restore(self, value: np.ndarray) -> None:
        self._write_every_copy("assign", value)

    def _copies(self) -> list[VariableCopy]:
        return [VariableCopy(self, i) for i in range(len(self._values))]


class MirroredVariable(Variable):
    """One copy per device, kept equal: updates in replica context aggregate."""

    _copy_per_device = True

    async def _write(self, kind: str, value: Any) -> Variable:
        index = self._replica_index()
        if index is None:
            self._write_every_copy(kind, value)
            return self
        if self._aggregation is VariableAggregation.NONE:
            if self._strategy._one_device:
                self._write_only_copy(kind, value)
                return self
            raise InvalidArgumentError(
                f"{self._name}.{kind}() in replica context needs an aggregation: this "
                "mirrored variable was created with aggregation=NONE, so replicas' values "
                "cannot be combined and its copies would drift apart. Create it with "
                "aggregation='SUM', 'MEAN' or 'ONLY_FIRST_REPLICA'."
            )

        def merge_fn(strategy: Any, per_replica: Any) -> None:
            parts = _replica_values(strategy, per_replica)
            try:
                # The one value every copy takes (not through _per_copy, which copies
                # it to the host: on GPUs the aggregate stays on the device).
                self._write_copies(kind, [self._aggregate(kind, parts)] * len(self._values))
            except (TypeError, ValueError) as error:
                self._refuse_non_numbers(kind, parts, error)
                raise

        if self._strategy._world is not None:  # across workers: aggregate globally

            async def merge_fn(strategy: Any, per_replica: Any) -> None:
                self._write_every_copy(kind, await self._aggregate_across(kind, per_replica))

        merge_fn.__qualname__ = f"{self._name}.{kind}"
        merge_fn._aiodist_key = (id(self), kind)  # type: ignore[attr-defined]
        await _context.get_replica_context().merge_call(merge_fn, args=(value,))
        return self

    def _write_only_copy(self, kind: str, value: Any) -> None:
        """A write in replica context of a ``OneDeviceStrategy``'s variable with
        ``aggregation=NONE``: one replica, one copy, nothing to combine, so as TF
        writes its plain variable there, the value is written to that copy, with
        the checks of every write (``_replace_copies``). No rendezvous, and nothing
        through the host: on a GPU the value is placed on the copy's device and the
        update issued on the replica's stream (current here), before the replica's
        later work, as a sync-on-read copy's update is."""
        (part,) = _replica_values(self._strategy, value)  # (a distributed value's component)
        self._replace_copies(kind, [part], self._write_name(kind))

    def _refuse_non_numbers(self, kind: str, parts: list, error: Exception) -> None:
        """``_refuse_non_numbers`` for a write in replica context, whose values
        (``parts``, one per local replica) were aggregated in a merge_fn: the
        message, raised in every replica, names the replicas whose values are not
        numbers."""
        if isinstance(error, AiodistError):
            return
        first = self._strategy._replica_offset
        bad = [(first + i, part, _not_numbers(part)) for i, part in enumerate(parts)]
        bad = [(i, part, why) for i, part, why in bad if why is not None]
        if bad:
            seen = "; ".join(f"replica {i}: {short_repr(part)} ({why})" for i, part, why in bad)
            raise InvalidArgumentError(
                f"{self._name}.{kind}() in replica context: not a number or an array of "
                f"numbers ({seen}); every replica must give numbers that cast to the "
                f"variable's dtype {self.dtype}."
            ) from None

    async def _aggregate_across(self, kind: str, per_replica: Any) -> Any:
        """The aggregate of every worker's replicas' values (multi-worker strategies)."""
        strategy = self._strategy
        # On the host, for the exchange between workers: GPU values copied in stream
        # order while the loop keeps running (host_array's get() would wait on it).
        local = PerReplica(tuple(_replica_values(strategy, per_replica)))
        # The variable and the write are in the exchange's key, as a variable's name
        # is when it is created: two workers updating two variables of one shape (or
        # one with assign, another with assign_add) would otherwise pair silently, and
        # the mirrored copies of each differ between workers.
        method = f"{self._name}.{kind}"
        parts = await strategy._host_components(local, f"{method}()")
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            # Global replica 0 is worker 0's first: its value, sent to every worker.
            timeout = strategy._communication_options.timeout_seconds
            what = f"{self._name}: the first replica's value (ONLY_FIRST_REPLICA)"
            return await strategy._world.broadcast(parts[0], what, timeout, strategy, method)
        parts = self._shaped(kind, parts, strategy._replica_offset)
        if self._exact_mean_of(parts):
            n = strategy.num_replicas_in_sync  # every worker's replicas
            sums = [_integer_sums([part], n) for part in parts]  # one (q, r) per replica
            q, r = await strategy._reduce_across(
                ReduceOp.SUM,
                [PerReplica([s[0] for s in sums]), PerReplica([s[1] for s in sums])],
                None,
                None,
                method,
            )
            return _mean_of_sums(q, r, n, self.dtype)
        op = ReduceOp.SUM if self._aggregation is VariableAggregation.SUM else ReduceOp.MEAN
        (total,) = await strategy._reduce_across(op, [PerReplica(parts)], None, None, method)
        return total

    def _shaped(self, kind: str, parts: list, first_id: int = 0, xp: Any = np) -> list:
        """The replicas' values (arrays of ``xp``; the first is replica ``first_id``'s) each
        with the variable's shape, broadcast as a write would (a scalar is added to
        every element), so that a replica's value of another shape is named here
        rather than failing inside the reduction with NumPy's words only.

        A value of a narrower dtype, one that casts to the variable's without loss
        (int8 or bool for an int64 variable, float16 for a float32 one), is widened
        to the variable's dtype first: aggregated in its own, two replicas' int8 100
        summed to -56 and float16 60000 to inf, where a write of the same values in
        cross-replica context adds them in (at least) the variable's dtype. Values of
        wider dtypes are aggregated as they are, and their write casts the result."""
        shape, dtype = self.shape, self.dtype
        if all(part.shape == shape and part.dtype == dtype for part in parts):
            return parts  # the usual case: no copy
        shaped = []
        for part in parts:
            if part.dtype != dtype and np.can_cast(part.dtype, dtype, "safe"):
                part = part.astype(dtype)
            if part.shape == shape:
                shaped.append(part)
                continue
            try:
                shaped.append(xp.broadcast_to(part, shape))
            except ValueError:
                seen = ", ".join(
                    f"replica {first_id + i}: {tuple(p.shape)}" for i, p in enumerate(parts)
                )
                raise InvalidArgumentError(
                    f"{self._name}.{kind}() in replica context: the replicas' values ({seen}) "
                    f"cannot all be written to a variable of shape {shape}; every replica "
                    "must give a value of that shape or one that broadcasts to it."
                ) from None
        return shaped

    def _exact_mean_of(self, parts: Sequence[Any]) -> bool:
        """Whether the aggregate is a MEAN of integers written to an integer variable:
        computed exactly and rounded half to even (a float64 mean loses integers above
        2**53). Anything else is aggregated as it is (floats written to an integer
        variable are refused, as everywhere)."""
        return (
            self._aggregation is VariableAggregation.MEAN
            and self.dtype.kind in "iu"
            and all(p.dtype.kind in "iu" for p in parts)
        )

    def _aggregate(self, kind: str, parts: Sequence[Any]) -> Any:
        """The replicas' values (``parts``) combined by the variable's aggregation: on
        CPU devices, a host array; on GPUs, on the first copy's device, issued on the
        current streams (a merge_fn's cross streams, ordered after the replicas' work)
        and never through the host: a copy to it waits for the GPU on the event loop,
        which a rendezvous must not do (SPEC 7, docs/gpu.md)."""
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            # (On GPUs, _replace_copies places it on every copy's device.)
            return parts[0] if self._on_streams else host_array(parts[0])
        if self._on_streams:
            target = self._devices[0]
            backend = backend_for(target)
            arrays = [backend.asarray(p, target) for p in parts]
        else:
            target, backend = _HOST, backend_for(_HOST)
            arrays = [np.asarray(host_array(p)) for p in parts]
        # (CuPy computes on the current device: a widening astype, an exact mean.)
        with backend.on_device(target):
            arrays = self._shaped(kind, arrays, xp=backend.xp)
            if self._exact_mean_of(arrays):
                n = len(arrays)
                sums = _integer_sums(arrays, n, backend.xp)
                return _mean_of_sums(*sums, n, self.dtype, backend.xp)
        op = ReduceOp.SUM if self._aggregation is VariableAggregation.SUM else ReduceOp.MEAN
        return self._strategy.extended._cross_device_ops._reduce_arrays(op, arrays, target)


def _replica_values(strategy: Any, per_replica: Any) -> list:
    """Each local replica's value in a merge_fn's regrouped argument (a list value
    arrives as a list of PerReplica leaves; one object stands for every replica)."""
    parts = list(strategy.experimental_local_results(per_replica))
    if len(parts) == 1:
        parts *= len(strategy._slots)
    return parts


class SyncOnReadVariable(Variable):
    """One copy per replica, each updated locally; reads in cross-replica context
    aggregate them (SUM, MEAN or ONLY_FIRST_REPLICA)."""

    def read_value(self) -> Any:
        index = self._replica_index()
        if index is not None:
            return self._values[index]
        if self._aggregation is VariableAggregation.NONE:
            raise InvalidArgumentError(
                f"{self._name}: a sync-on-read variable with aggregation=NONE cannot be "
                "read in cross-replica context (its copies differ and there is no rule to "
                "combine them); read it inside a replica function, or create it with an "
                "aggregation."
            )
        return self._aggregate_copies()

    def _aggregate_copies(self) -> Any:
        if self._strategy._world is not None:
            return self._aggregate_across_workers()
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._values[0]
        op = ReduceOp.SUM if self._aggregation is VariableAggregation.SUM else ReduceOp.MEAN
        ops = self._strategy.extended._cross_device_ops
        # A read-only *view*: the reduction's result buffer may come from a pool and
        # must stay writeable for its next use once this view is gone.
        return _frozen(ops._reduce_arrays(op, self._values, self._devices[0]).view())

    value = read_value

    def _aggregate_across_workers(self) -> np.ndarray:
        """The aggregate over every worker's copies: a synchronous exchange with the
        other workers (like TF's, a read is a collective), which every worker must
        make at the same point in its sequence of cross-worker operations."""
        strategy = self._strategy
        world = strategy._world
        timeout = strategy._communication_options.timeout_seconds
        # (``what`` is in the exchange's key too: two workers reading two variables of
        # one shape at one place, in another order, would otherwise swap their values.)
        what = f"reading sync-on-read variable {self._name!r} ({self._aggregation.name})"
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            # Global replica 0 is worker 0's first.
            total = world.broadcast_now(host_array(self._values[0]), what, timeout, what)
        else:
            ops = strategy.extended._cross_device_ops
            copies = [np.asarray(host_array(v)) for v in self._values]
            if self._aggregation is VariableAggregation.MEAN:
                copies = [mean_operand(copy) for copy in copies]  # integers as float64
            local = np.asarray(ops._reduce_arrays(ReduceOp.SUM, copies, _HOST))
            total = world.all_reduce_now(ReduceOp.SUM, local, what, timeout, what)
            if self._aggregation is VariableAggregation.MEAN:
                total = mean_of_sum(np, total, world.total)
        return _frozen(total)

    def _saved_value(self) -> np.ndarray:
        if self._aggregation is VariableAggregation.NONE:
            # TF's rule: the first copy, global replica 0's (worker 0's first).
            first = host_array(self._values[0])
            world = self._strategy._world
            if world is None:
                return first
            what = f"saving sync-on-read variable {self._name!r} (its first copy)"
            return world.broadcast_now(
                first, what, self._strategy._communication_options.timeout_seconds, what
            )
        if self._aggregation is VariableAggregation.MEAN and self.dtype.kind in "iu":
            return self._integer_mean()
        return np.asarray(host_array(self._aggregate_copies()))

    def _integer_mean(self) -> np.ndarray:
        """The MEAN of integer copies as a checkpoint stores it, in their dtype: exact
        (neither wrapping in 64 bits nor rounded off as the float64 mean that a read
        gives is above 2**53), rounded half to even."""
        strategy = self._strategy
        n = strategy.num_replicas_in_sync  # every worker's copies
        q, r = _integer_sums(self._values, n)
        if strategy._world is not None:
            what = f"saving sync-on-read variable {self._name!r} (MEAN)"
            timeout = strategy._communication_options.timeout_seconds
            both = np.stack([q, r])  # one exchange for both
            q, r = strategy._world.all_reduce_now(ReduceOp.SUM, both, what, timeout, what)
        return _mean_of_sums(q, r, n, self.dtype)

    def _restore(self, value: np.ndarray) -> None:
        if self._aggregation is not VariableAggregation.SUM:
            self._write_every_copy("assign", value)
            return
        self._assign_to_first_copy(value, f"{self._name}.restore")

    def _assign_to_first_copy(self, value: Any, where: str) -> None:
        """Exact for every dtype: the first copy (global replica 0's) holds the value,
        the others zero, so the SUM read gives back exactly ``value``. ``where``
        names the write in errors (a restore, or the user's assign)."""
        value = np.asarray(host_array(value))
        world = self._strategy._world
        first = 0 if world is None or world.rank == 0 else None  # this worker's index of it
        parts = [value if i == first else np.zeros_like(value) for i in range(len(self._devices))]
        self._write_copies("assign", parts, where)

    async def _write(self, kind: str, value: Any) -> Variable:
        index = self._replica_index()
        if index is not None:
            VariableCopy(self, index)._write(kind, value)
            return self
        parts = self._per_copy(kind, value)
        if self._aggregation is VariableAggregation.SUM:
            if kind != "assign":
                raise InvalidArgumentError(
                    f"{self._name}.{kind}() in cross-replica context is not supported for a "
                    "sync-on-read variable with aggregation=SUM (which copy would it "
                    "change?); use assign(), or update copies in replica context."
                )
            if self.dtype.kind not in "fc":
                # TF divides by the replica count, which integers cannot hold exactly:
                # put the whole value on the first copy instead (the SUM is the same).
                self._assign_to_first_copy(parts[0], f"{self._name}.assign")
                return self
            n = self._strategy.num_replicas_in_sync  # every worker's copies
            parts = [np.asarray(part) / n for part in parts]  # TF's rule: the SUM read gives it
        self._write_copies(kind, parts)
        return self


async def update(
    variable: Variable,
    fn: Callable[..., Any],
    args: Sequence = (),
    kwargs: dict | None = None,
    group: bool = True,
) -> Any:
    """``strategy.extended.update``: ``fn(copy, *args, **kwargs)`` once per copy.

    ``Mirrored`` arguments are unwrapped to the component of each copy's
    replica, and variables of the strategy to their copy that replica reads
    (a ``VariableCopy``). Runs each call with the copy's device (and stream) current.
    Returns a ``Mirrored`` of the results, or a tuple with ``group=False``: one
    entry per replica either way (replicas sharing a copy share its result). If
    ``fn`` raises for any copy, every copy of ``var`` and of the variables
    unwrapped for ``fn`` is left as before (the copies never drift apart).
    """
    if not isinstance(variable, Variable):
        raise InvalidArgumentError(
            f"update: var={variable!r}; expected an aiodist.Variable made in this strategy's scope."
        )
    if not callable(fn):
        raise not_callable(fn, f"update: fn={fn!r} is not callable.")
    args = _positional(args, "update")
    kwargs = _keywords(kwargs, "update")
    strategy = variable._strategy
    slots = strategy._slots if strategy is not None else None
    n = len(variable._copy_of)  # replicas: a Mirrored argument has a component for each
    backend = slots[0].backend if slots else None
    ordered = variable._on_streams  # (GPUs: a backend that needs activation)
    if ordered:
        # GPUs: fn runs on replica streams, which are non-blocking. They first wait for
        # the current streams (where fn's arguments may have been made) and, through
        # them, for every replica's queued work (which may still read the copies fn
        # replaces, whose memory the pool may hand to fn's stream).
        backend.order_after_replicas(slots)
        backend.order_replicas_after(slots)
    try:
        results = _update_copies(variable, fn, args, kwargs, slots, n)
    finally:
        if ordered:
            # The current streams' later work (which may reuse the arguments' memory,
            # or read the copies) waits for what fn issued, and through them every
            # replica's later work does too: those sharing a copy (on one GPU) read
            # it on streams of their own, not the one fn wrote it on.
            backend.order_after_replicas(slots)
            backend.order_replicas_after(slots)
    # Per replica, as every distributed value and as TF's group=False ("an element per
    # replica"): replicas sharing a copy share its result.
    per_replica = [results[c] for c in variable._copy_of]
    if not group:
        return tuple(per_replica)
    if n == 1:
        return per_replica[0]
    return Mirrored(per_replica, variable._replica_devices)


def _variable_copies(strategy: Any, rid: int, structure: Any) -> Any:
    """``structure`` with each variable of ``strategy`` replaced by its copy that
    replica ``rid`` reads, as TF's ``update`` unwraps distributed variables in its
    arguments. (fn got the whole variable: an ``assign`` there returned a coroutine
    nobody awaited, the write lost, and a sync-on-read one read as the aggregate.)"""

    def pick(leaf: object) -> object:
        if isinstance(leaf, Variable) and leaf._strategy is strategy:
            return VariableCopy(leaf, leaf._copy_of[rid])
        return leaf

    return _nest.map_structure(pick, structure)


def _update_copies(
    variable: Variable, fn: Callable[..., Any], args: Any, kwargs: Any, slots: Any, n: int
) -> list:
    """``update``'s calls of ``fn``, one per copy, each on its first replica's stream."""
    # Variables of the strategy among the arguments (TF's colocated ones) are
    # distributed values there: each call gets their copy on its device.
    own = variable._strategy
    unwrapped = []
    if own is not None:  # (a plain variable's update has none to unwrap)
        for leaf in _nest.flatten((args, kwargs) if kwargs else args):
            if isinstance(leaf, Variable) and leaf._strategy is own:
                unwrapped.append(leaf)
    # What fn may write: the variable, and those unwrapped (by identity: == of
    # variables is element-wise).
    written = list({id(v): v for v in [variable, *unwrapped]}.values())
    # All copies change, or none does: fn failing for a later copy (a Mirrored
    # component of another shape, a value that is not numbers) left the copies it
    # had written changed and the others not, mirrors that stayed apart from then on.
    before = [list(v._values) for v in written]
    try:
        return _call_per_copy(variable, fn, args, kwargs, slots, n, own, bool(unwrapped))
    except BaseException:
        with _WRITE_LOCK:
            for v, values in zip(written, before, strict=True):
                v._values[:] = values
        raise


def _call_per_copy(
    variable: Variable,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    slots: Any,
    n: int,
    own: Any,
    unwrap: bool,
) -> list:
    """``_update_copies``' calls of ``fn``; ``unwrap``: whether ``own``'s variables
    among the arguments are handed over as their copies."""
    results = []
    for copy, rid in zip(variable._copies(), variable._replica_of_copy, strict=True):
        # Each copy with the component, device and stream of its first replica.
        copy_args = select_replica(rid, args, n)
        copy_kwargs = select_replica(rid, kwargs, n)
        if unwrap:
            copy_args, copy_kwargs = _variable_copies(own, rid, (copy_args, copy_kwargs))
        slot = slots[rid] if slots else None
        token = slot.backend.activate(slot.device, slot.stream) if slot else None
        try:
            result = fn(copy, *copy_args, **copy_kwargs)
        finally:
            if slot:
                slot.backend.deactivate(token)
        refuse_awaitables(
            (result,),
            lambda: (
                f"update: fn={fn!r} returned an awaitable; fn runs once per copy and must "
                "be a plain function (for example lambda copy, value: copy.assign(value))."
            ),
        )
        results.append(result)
    return results
