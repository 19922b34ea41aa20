"""``ReplicaContext``: what a replica function can do, as that replica.

The three collectives are *sync-coloured functions that return an awaitable*:
calling one registers this replica's arrival at its next call number right
away, and the returned ``asyncio.Future`` completes when every replica of the
run has arrived and the cross-replica side has run. So ::

    pending = ctx.all_reduce("sum", grads)   # registered now
    loss = compute_loss()                    # overlap
    grads = await pending                    # the reduced value

is valid, and ``await ctx.all_reduce(...)`` is the common form.
"""

from __future__ import annotations

import asyncio
import operator
import os
from collections.abc import Callable
from functools import partial
from types import BuiltinFunctionType, CodeType, FunctionType
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _context, _nest, _trace
from ._arrays import (
    as_axis,
    check_reducible,
    first_difference,
    gather_axis,
    leaf_text,
    structure_text,
)
from ._backends import cpu_backend
from ._checks import async_generator_function, not_callable, refuse_ragged
from ._errors import ContextError, InvalidArgumentError
from ._ops import _BY_KEY, ReduceOp
from ._options import CommunicationOptions
from ._rendezvous import Signature
from ._values import DistributedValues

if TYPE_CHECKING:
    from ._scheduler import RunGroup
    from ._strategy import Strategy

__all__ = [
    "ARGS",
    "ARRAYS",
    "AXIS",
    "KWARGS",
    "MERGE_FN",
    "OP",
    "OPTIONS",
    "TEMPLATE",
    "Payload",
    "ReplicaContext",
    "merge_fn_text",
]


_STATE = _context._STATE
_REPLICA, _GROUP = _context.REPLICA, _context.GROUP
_NESTED = (list, tuple, dict)
_new = tuple.__new__  # builds a NamedTuple in C, without its Python-level __new__
_SHAPE = operator.attrgetter("shape")
_EMPTY: dict = {}  # the kwargs of a merge_call without any (never modified)
_DTYPE = operator.attrgetter("dtype")

# dtypes already checked reducible, per op (a set lookup instead of a check per call)
_REDUCIBLE: dict[ReduceOp, set] = {op: set() for op in ReduceOp}
# The signatures of one-array all-reduces, by (op, dtype, shape).
_ONE_ARRAY: dict[tuple, Signature] = {}
_ONE_ARRAY_LIMIT = 1024
# NumPy's numeric scalar types, each of one dtype and shape (), so the type alone
# gives a scalar's signature.
_NUMERIC_SCALARS = frozenset(
    np.dtype(code).type for code in np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"
)
# reduce_op as passed -> scalar type -> (ReduceOp, signature), for all-reduces of
# NumPy scalars on host replicas with the strategy's options (filled in by the
# general path, after it has checked the dtype reducible). Nested dicts, not one
# keyed by (reduce_op, type): no tuple built, hashed and compared per call (172.7k
# -> 172.0k instructions per (b) step, N = 4). An inner dict holds at most one entry
# per type of _NUMERIC_SCALARS.
_HOST_SCALARS: dict[Any, dict[type, tuple[ReduceOp, Signature]]] = {}


# What a replica's arrival carries (the rendezvous' payload): a plain tuple, read by
# unpacking or by the indexes below. Not NamedTuples, for the reasons the context
# state is not one (see _context): 6.7k instructions (about 0.9 us) less per (b)
# step at four replicas.
# - all_reduce: (template, arrays, op, options): ``template`` is the replica's nested
#   value, for its nesting (None for a single array); ``arrays`` its leaves, placed
#   on the replica's device (a list; a one-tuple for a NumPy scalar on the host,
#   see all_reduce); ``op`` the ReduceOp; ``options`` CommunicationOptions.
# - all_gather: (template, arrays, axis, options), the same with the gathered axis.
# - merge_call: (merge_fn, args, kwargs).
TEMPLATE, ARRAYS, OP, OPTIONS = range(4)
AXIS = OP
MERGE_FN, ARGS, KWARGS = range(3)
Payload = tuple  # for annotations


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (or the default one).

    Get it with ``aiodist.get_replica_context()`` inside a replica function. It
    stands for "replica *i* of this strategy": a strategy makes one per replica,
    and its collectives go to the run whose replica function is calling them
    (the run is part of the context state, so concurrent runs never mix).
    """

    __slots__ = ("_default_group", "_device", "_replica_id", "_strategy")

    def __init__(
        self,
        strategy: Strategy,
        replica_id: int,
        device: Any,
        default_group: RunGroup | None = None,
    ):
        self._strategy = strategy
        self._replica_id = replica_id
        self._device = device
        # Only the default replica context (outside any scope) has a group of its own.
        self._default_group = default_group

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run this function together."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, from 0 to ``num_replicas_in_sync - 1`` (global: across
        workers in a multi-worker strategy)."""
        return self._strategy._replica_offset + self._replica_id

    @property
    def devices(self) -> tuple[str, ...]:
        """The device this replica runs on, as a one-element tuple of canonical names."""
        return (str(self._device),)

    def __repr__(self) -> str:
        return (
            f"<ReplicaContext replica {self.replica_id_in_sync_group} of "
            f"{self._strategy.num_replicas_in_sync} on {self._device}>"
        )

    # -- collectives -------------------------------------------------------------

    def merge_call(
        self, merge_fn: Callable, args: tuple | list = (), kwargs: dict | None = None
    ) -> asyncio.Future:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Arguments that differ across replicas reach ``merge_fn`` as ``PerReplica``
        values (identical objects stay as they are). Await the result: each
        replica receives ``merge_fn``'s return value with every distributed value
        in it replaced by this replica's component. ``merge_fn`` may be ``async``.

        Examples:
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def merge_fn(strategy, value):
            ...     return sum(strategy.experimental_local_results(value))
            >>> async def step():
            ...     ctx = aiodist.get_replica_context()
            ...     v = 3 + ctx.replica_id_in_sync_group
            ...     return v + await ctx.merge_call(merge_fn, args=(v,))
            >>> strategy.experimental_local_results(aiodist.run(strategy.run(step)))
            (10, 11)
        """
        # A per-step hot path too, written like all_reduce's.
        state = _STATE.get()
        # The usual call first: a replica of a run, not traced, passing a tuple of
        # args, no kwargs, and the function this run's last merge_call passed (every
        # replica's, usually) or one of the last merge_call's (see _last_merge).
        # Straight to the rendezvous with what the general path below would pass: no
        # test made twice, no locals kept for it (219.4k -> 218.4k instructions per
        # (c) step, N = 4). Anything else takes the general path, from the start.
        if (
            state[_REPLICA] is self
            and type(args) is tuple
            and kwargs is None
            and _trace.active is None
        ):
            group = state[_GROUP]
            # The very function the run's last merge_call passed, which the run keeps
            # (and frees with it), has that call's signature: one identity test, not
            # the reads of __code__ and __qualname__ below, each an audited generic
            # lookup (1.6k instructions of a (c) step, N = 4).
            if merge_fn is group._merge_fn:
                signature = group._merge_signature
            else:
                code, name, signature = _last_merge
                if (
                    type(merge_fn) is FunctionType
                    and merge_fn.__code__ is code
                    and merge_fn.__qualname__ is name
                ):
                    group._merge_fn, group._merge_signature = merge_fn, signature
                else:
                    signature = None
            if signature is not None:
                options = self._strategy._communication_options
                return (group._rendezvous or group.rendezvous).arrive(
                    self._replica_id,
                    signature,
                    (merge_fn, args, _EMPTY),
                    options.timeout_seconds,
                    options.stall_warning_seconds,
                )
        code, name, signature = _last_merge
        group = state[_GROUP] if state[_REPLICA] is self else self._group("merge_call")
        # A function of the last merge_call's (every replica's, usually): its
        # signature, with no checks and no lookups (see _last_merge).
        if (
            type(merge_fn) is not FunctionType
            or merge_fn.__code__ is not code
            or merge_fn.__qualname__ is not name
        ):
            if not callable(merge_fn):
                raise not_callable(
                    merge_fn,
                    f"merge_call: merge_fn={merge_fn!r} is not callable; expected a "
                    "function taking (strategy, *args, **kwargs).",
                )
            if async_generator_function(merge_fn):  # (every replica got its generator)
                raise InvalidArgumentError(
                    f"merge_call: merge_fn={merge_fn!r} is an async generator function "
                    "(an async def with yield in it); expected a function or async def "
                    "function that returns the merged value."
                )
            signature = _merge_signature(merge_fn)
        if type(args) is not tuple:
            args = _positional(args, "merge_call")
        kwargs = _EMPTY if kwargs is None else _keywords(kwargs, "merge_call")
        payload = (merge_fn, args, kwargs)
        options = self._strategy._communication_options
        if _trace.active is not None or state[_REPLICA] is not self:
            # Traced, or the default context (whose group's arrive() watches an async
            # merge_fn's task): through the group.
            return group.arrive(self._replica_id, signature, payload, options)
        # A replica of a run, not traced: straight to the rendezvous, as all_reduce.
        return (group._rendezvous or group.rendezvous).arrive(
            self._replica_id,
            signature,
            payload,
            options.timeout_seconds,
            options.stall_warning_seconds,
        )

    def all_reduce(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        options: CommunicationOptions | None = None,
    ) -> asyncio.Future:
        """All-reduce ``value`` (an array, scalar, or nested structure of them).

        Await the result: the same structure, reduced across every replica, on
        this replica's device. Lists of values are packed into few reductions.
        On CPU devices each replica gets its own read-only view of one shared
        result buffer.

        Examples:
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aiodist.get_replica_context()
            ...     return await ctx.all_reduce("sum", [1.0, 2.0])
            >>> strategy.experimental_local_results(aiodist.run(strategy.run(step)))
            ([array(2.), array(4.)], [array(2.), array(4.)])
        """
        # This is the per-step hot path: plain attribute and dict work, C-level
        # tuple construction, and no structure walk for a single array.
        state = _STATE.get()
        group = state[_GROUP] if state[_REPLICA] is self else self._group("all_reduce")
        if options is None and group.numpy_replicas:
            # A NumPy scalar (a loss, a count) seen before with this reduce_op: its op
            # and signature in two dict lookups, about 0.5 us less per call than below.
            try:
                by_type = _HOST_SCALARS.get(reduce_op)
            except TypeError:  # an unhashable reduce_op: refused below
                by_type = None
            if by_type is not None and (known := by_type.get(type(value))) is not None:
                op, signature = known
                options = self._strategy._communication_options
                # (Its arrays a one-tuple, not a list: one allocation less per
                # replica, 172.0k -> 171.7k instructions per (b) step, N = 4.)
                payload = (None, (value,), op, options)
                if _trace.active is not None:  # what group.arrive() does
                    return group.arrive(self._replica_id, signature, payload, options)
                rendezvous = group._rendezvous or group.rendezvous  # (made at the first)
                # Straight to the rendezvous: one Python call less per replica.
                return rendezvous.arrive(
                    self._replica_id,
                    signature,
                    payload,
                    options.timeout_seconds,
                    options.stall_warning_seconds,
                )
        op = _BY_KEY.get(reduce_op) if type(reduce_op) is str else None
        if op is None:
            op = ReduceOp.of(reduce_op)
        if options is None:
            options = self._strategy._communication_options
        else:
            options = self._options(options)
        nested = isinstance(value, _NESTED)
        if nested:
            leaves, skeleton, kinds = _nest.flatten_with_skeleton(value)
            arrays = self._arrays(group, leaves, "all_reduce", kinds)
        elif isinstance(value, DistributedValues):
            arrays = self._arrays(group, [value], "all_reduce")  # raises
        else:  # one array or scalar, the common case
            slot = group.slots[self._replica_id]
            try:  # (costs nothing unless it raises)
                if slot.backend is not cpu_backend:
                    arrays = [slot.backend.asarray(value, slot.device)]
                elif isinstance(value, np.generic):
                    # A NumPy scalar reduces as it is (it has a dtype and a shape); the
                    # host reduction returns an array. Saves an asarray per replica.
                    arrays = [value]
                elif type(value) is float:
                    # A Python float as the float64 scalar it stands for (np.asarray
                    # would make a 0-d float64 array): host reductions of float scalars
                    # take the scalar arithmetic path (ReductionToOneDevice._all_reduce_one).
                    arrays = [np.float64(value)]
                else:
                    arrays = [slot.backend.asarray(value, slot.device)]
            except ValueError:  # a ragged sequence that does not nest (a deque)
                refuse_ragged([value], self._where("all_reduce"))
                raise
        if nested:  # map with attrgetter: C-speed per leaf, for long lists of tensors
            reducible = _REDUCIBLE[op]
            dtypes = tuple(map(_DTYPE, arrays))
            # Usually one dtype object throughout: count() compares by identity first.
            if not dtypes:  # an empty structure: nothing to check
                distinct = ()
            elif dtypes.count(dtypes[0]) == len(dtypes):
                distinct = {dtypes[0]} if dtypes[0] not in reducible else ()
            else:
                distinct = set(dtypes) - reducible
            for dtype in distinct:  # (a dtype not seen before: not every step)
                index = dtypes.index(dtype)  # its first leaf, named if it is refused
                check_reducible(op, arrays[index], self._where("all_reduce"), value, index)
                reducible.add(dtype)
            key = (op, skeleton, dtypes, tuple(map(_SHAPE, arrays)))
            value = _as_passed(value, skeleton, arrays)
            describe = partial(_all_reduce_text, op, value, arrays)
            signature = _new(Signature, ("all_reduce", key, describe))
        else:
            # One array: its signature depends on (op, dtype, shape) only, so one
            # object per key serves every call, and the rendezvous matches the
            # replicas' signatures by identity.
            array = arrays[0]
            key = (op, array.dtype, array.shape)
            signature = _ONE_ARRAY.get(key)
            if signature is None:
                signature = self._one_array_signature(key, array, value)
            if array is value and type(value) in _NUMERIC_SCALARS:  # on the host, as is
                by_type = _HOST_SCALARS.get(reduce_op)
                if by_type is None:
                    if len(_HOST_SCALARS) >= _ONE_ARRAY_LIMIT:
                        _HOST_SCALARS.clear()
                    by_type = _HOST_SCALARS[reduce_op] = {}
                by_type[type(value)] = (op, signature)
        payload = (value if nested else None, arrays, op, options)
        return group.arrive(self._replica_id, signature, payload, options)

    def all_gather(
        self, value: Any, axis: int, options: CommunicationOptions | None = None
    ) -> asyncio.Future:
        """All-gather ``value`` along ``axis``: every replica's values concatenated.

        Shapes may differ only along ``axis``; values of rank 0 cannot be
        gathered (add an axis first, e.g. ``x[None]``).

        Examples:
            >>> import numpy as np
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aiodist.get_replica_context()
            ...     return await ctx.all_gather(np.array([1, 2, 3]), axis=0)
            >>> strategy.experimental_local_results(aiodist.run(strategy.run(step)))[0]
            array([1, 2, 3, 1, 2, 3])
        """
        group = self._group("all_gather")
        axis = as_axis(axis, "all_gather")
        options = self._options(options)
        nested = _nest.is_nested(value)
        leaves, skeleton, kinds = _nest.flatten_with_skeleton(value)
        arrays = self._arrays(group, leaves, "all_gather", kinds)
        shapes = []
        where = self._where("all_gather")
        for array in arrays:
            along = gather_axis(array, axis, where)
            shapes.append(tuple(-1 if i == along else n for i, n in enumerate(array.shape)))
        dtypes = [a.dtype for a in arrays]
        # The gathered axis is in the shapes (as -1), so axis=-1 and axis=1 of a rank-2
        # value match; for an empty structure the axis changes nothing. The skeleton
        # is at index 1, as in all_reduce's key (RunGroup._collective reads it there).
        key = (None, skeleton, tuple(zip(dtypes, shapes, strict=True)))
        if nested:
            value = _as_passed(value, skeleton, arrays)
        signature = Signature(
            "all_gather", key, partial(_all_gather_text, axis, value, arrays)
        )  # not a hot path: the readable constructor
        payload = (value if nested else None, arrays, axis, options)
        return group.arrive(self._replica_id, signature, payload, options)

    # -- helpers ---------------------------------------------------------------------

    def _group(self, method: str) -> RunGroup:
        """The run whose replica function is calling ``method``; raises elsewhere."""
        _strategy, replica, _, group = _context.current_state()
        if replica is self:
            return group
        if self._default_group is not None and replica is None and _strategy is None:
            try:  # (its rendezvous arrives on the running loop: asyncio's bare error else)
                asyncio.get_running_loop()
            except RuntimeError:
                raise ContextError(
                    f"ReplicaContext.{method}() of the default replica context was called "
                    "where no event loop is running (synchronous code, or a worker thread "
                    f"such as asyncio.to_thread's); {method}() returns an awaitable, so call "
                    "it from async code running on the event loop and await it: "
                    f"`await aiodist.get_replica_context().{method}(...)` inside an async "
                    "def function run by aiodist.run(main()) (or awaited by your own async "
                    "code), not inside a thread's function."
                ) from None
            return self._default_group
        raise ContextError(
            f"ReplicaContext.{method}() of replica {self.replica_id_in_sync_group} was "
            "called outside that replica's function (for example from a merge_fn, another "
            f"task, or cross-replica code). Call {method}() from the replica function itself; in "
            "cross-replica context use strategy.reduce() or strategy.extended.reduce_to()."
        )

    def _one_array_signature(self, key: tuple, array: Any, value: Any) -> Signature:
        """The signature of all-reducing one array (``key``: op, dtype, shape; ``value``:
        as passed, named if refused), checked reducible once and kept in ``_ONE_ARRAY``."""
        op = key[0]
        check_reducible(op, array, self._where("all_reduce"), value)
        if len(_ONE_ARRAY) >= _ONE_ARRAY_LIMIT:  # many shapes: start afresh
            _ONE_ARRAY.clear()
        signature = _ONE_ARRAY[key] = Signature(
            "all_reduce", key, f"all_reduce({op.name}, {leaf_text(array)})"
        )
        return signature

    def _where(self, method: str) -> str:
        return f"{method} on replica {self.replica_id_in_sync_group}"  # (its global id)

    def _options(self, options: CommunicationOptions | None) -> CommunicationOptions:
        default = self._strategy._communication_options
        return default if options is None else default.merge(options)

    def _arrays(self, group: RunGroup, leaves: list, method: str, kinds: set | None = None) -> list:
        """``leaves`` (a new list) as arrays on this replica's device. ``kinds``: the
        set of their types, when the caller has it (then no test per leaf)."""
        slot = group.slots[self._replica_id]
        native = slot.backend.array_type
        if native is not None and (
            (len(kinds) == 1 and native in kinds)
            if kinds is not None
            else all(map(native.__instancecheck__, leaves))
        ):
            return leaves  # already arrays of this device's kind: nothing to convert
        arrays = []
        for leaf in leaves:
            if isinstance(leaf, DistributedValues):
                raise InvalidArgumentError(
                    f"{self._where(method)} got a {type(leaf).__name__}; "
                    "inside a replica function pass this replica's own value (strategy.run "
                    "already unwrapped its arguments)."
                )
            try:
                arrays.append(slot.backend.asarray(leaf, slot.device))
            except ValueError:  # a ragged sequence that does not nest (a deque)
                refuse_ragged([leaf], self._where(method))
                raise
        return arrays


def _as_passed(value: Any, skeleton: Any, arrays: list) -> Any:
    """``value``'s structure as it is now, holding ``arrays``: the result is built in
    it when the call completes, and the caller may change a dict or list of its own
    before then (a flat list or tuple needs no copy: its result is the list of
    leaves, or a tuple, which cannot change)."""
    if type(skeleton[1]) is int and (type(value) is list or isinstance(value, tuple)):
        return value  # flat (its skeleton is (type name, length)): no copy needed
    return _nest.pack_as(value, arrays)


def _function_text(function: Callable) -> str:
    """A function's name and where it is defined: ``step.<locals>.<lambda> (train.py:12)``."""
    if isinstance(function, partial):
        return f"partial({_function_text(function.func)})"
    name = getattr(function, "__qualname__", type(function).__name__)
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None or hasattr(function, "_aiodist_key"):  # aiodist's own: the name says it
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


# The merge_call signatures of plain functions, by id() of their code object (a code
# object's own hash is computed from its contents at every lookup): (code, qualified
# name, signature). Every function made from one definition (each replica's closure)
# shares the entry, so replicas calling it pass one signature object, which the
# rendezvous matches by identity. Saves building a key, a signature and a closure
# per call: 2.5k instructions (0.3 us) per replica per merge_call.
_MERGE_SIGNATURES: dict[int, tuple[CodeType, str, Signature]] = {}


# The code, qualified name and signature of the plain function the last merge_call
# passed, as _MERGE_SIGNATURES has them: any plain function with that very code and
# name object has that signature (one renamed or given new code since is looked up
# afresh, except by the run that last passed it: within a run the function object
# itself is matched, so one renamed or given new code mid-run keeps the signature it
# had there; see merge_call). Replicas mostly pass one function object, or closures
# of one definition, so all but the first find it here: identity tests instead of
# the callable() check and the attribute and table lookups below: 243.3k -> 235.4k
# instructions per (c) step (four replicas). A type test, not the weak reference to
# the last function this held (calling it cost 0.7k instructions of a (c) step more,
# N = 4); and so nothing of a closure, which may hold large values, is kept here.
# (aiodist's own merge functions, which set _aiodist_key before their first call,
# are named afresh each: none has a cached name object.)
_last_merge: tuple[CodeType | None, str | None, Signature | None] = (None, None, None)


def _merge_signature(merge_fn: Callable) -> Signature:
    """The signature of a merge_call of ``merge_fn``."""
    global _last_merge
    if type(merge_fn) is FunctionType and "_aiodist_key" not in merge_fn.__dict__:
        code, name = merge_fn.__code__, merge_fn.__qualname__
        entry = _MERGE_SIGNATURES.get(id(code))
        if entry is None or entry[0] is not code or entry[1] != name:
            signature = Signature("merge_call", _merge_key(merge_fn), _merge_text(merge_fn))
            if len(_MERGE_SIGNATURES) >= _ONE_ARRAY_LIMIT:  # many definitions: afresh
                _MERGE_SIGNATURES.clear()
            entry = _MERGE_SIGNATURES[id(code)] = (code, name, signature)
        _last_merge = (code, name, entry[2])
        return entry[2]

    describe = partial(_merge_text, merge_fn)
    return _new(Signature, ("merge_call", _merge_key(merge_fn), describe))


# Signature texts, built only when one is shown. Module functions given their values
# by functools.partial, not closures: a closure's variables become cells, which
# Python 3.11 makes on every call of the function defining it (about 16 ns each),
# whether or not that call builds the closure.


def _all_reduce_text(op: ReduceOp, value: Any, arrays: list) -> str:
    return f"all_reduce({op.name}, {structure_text(value, arrays)})"


def _all_gather_text(axis: int, value: Any, arrays: list) -> str:
    return f"all_gather(axis={axis}, {structure_text(value, arrays)})"


def _all_reduce_difference(first: tuple, other: tuple) -> tuple[str, str, str] | None:
    """Where two replicas' all_reduce arguments (``_all_reduce_text``'s) first differ,
    for the rendezvous's mismatch message (see ``Signature.difference``)."""
    (_, value, arrays), (_, other_value, other_arrays) = first, other
    return first_difference(_nest.pack_as(value, arrays), _nest.pack_as(other_value, other_arrays))


def _all_gather_difference(first: tuple, other: tuple) -> tuple[str, str, str] | None:
    """As ``_all_reduce_difference``, for all_gather: shapes may differ along the axis."""
    (axis, value, arrays), (other_axis, other_value, other_arrays) = first, other

    def along(axis: int) -> Callable[[Any], object]:
        def key(array: Any) -> object:  # dtype and shape, the gathered axis left out
            along = axis % array.ndim if -array.ndim <= axis < array.ndim else None
            return array.dtype, tuple(-1 if i == along else n for i, n in enumerate(array.shape))

        return key

    return first_difference(
        _nest.pack_as(value, arrays),
        _nest.pack_as(other_value, other_arrays),
        (along(axis), along(other_axis)),
    )


# (Error paths only: Signature.difference reads them when replicas' calls differ.)
_all_reduce_text.difference = _all_reduce_difference  # type: ignore[attr-defined]
_all_gather_text.difference = _all_gather_difference  # type: ignore[attr-defined]


def _merge_text(merge_fn: Callable) -> str:
    return f"merge_call({_function_text(merge_fn)})"


def merge_fn_text(payload: Payload) -> str:
    """The merge_fn of a merge_call's payload as ``name (file:line)``, for statistics
    and stall reports; never raises (it goes into diagnostics)."""
    try:
        return _function_text(payload[MERGE_FN])
    except Exception:  # a callable whose name cannot be read
        return object.__repr__(payload[MERGE_FN])


def _merge_key(merge_fn: Callable) -> object:
    """What must match for two replicas' merge_fns to count as the same call.

    Closures made afresh by each replica share their code, so the code object
    (and qualified name) is compared, not the function object. aiodist's own
    merge functions set ``_aiodist_key`` to say exactly what they update.
    """
    key = getattr(merge_fn, "_aiodist_key", None)
    if key is not None:
        return key
    if isinstance(merge_fn, partial):  # whatever it wraps must match (not its arguments)
        return ("partial", _merge_key(merge_fn.func))
    function = getattr(merge_fn, "__func__", merge_fn)
    code = getattr(function, "__code__", None)
    if code is not None:
        return (code, getattr(function, "__qualname__", ""))
    if isinstance(merge_fn, BuiltinFunctionType):  # a builtin, or a C method: its name
        # and (for a method) its object's type, so one method of every replica's own
        # object matches, as closures do
        return (merge_fn.__qualname__, type(merge_fn.__self__))
    if isinstance(merge_fn, type):  # a class: itself
        return merge_fn
    return type(merge_fn)  # a callable object: its class (instances match, as closures)


def _positional(args: Any, where: str) -> tuple:
    if not isinstance(args, list | tuple):
        raise InvalidArgumentError(
            f"{where}: args must be a list or tuple, got {type(args).__name__} ({args!r}); "
            f"wrap a single argument as args=(value,)."
        )
    return tuple(args)


def _keywords(kwargs: Any, where: str) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidArgumentError(
            f"{where}: kwargs must be a dict or None, got {type(kwargs).__name__} ({kwargs!r})."
        )
    for key in kwargs:  # (or Python's bare "keywords must be strings", in every replica)
        if not isinstance(key, str):
            raise InvalidArgumentError(
                f"{where}: kwargs has the key {key!r}, which is no str; expected keyword "
                "argument names, as for fn(**kwargs)."
            )
    return kwargs
