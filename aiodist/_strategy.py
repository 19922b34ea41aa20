"""Strategies: which devices replicas run on, and the cross-replica API.

``Strategy`` holds devices, the cross-device ops and the default communication
options; everything that moves data is a coroutine. A strategy holds no asyncio
object: each ``run`` builds its own ``RunGroup`` on the running loop, so one
strategy serves any number of concurrent runs and outlives event loops.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from functools import partial
from typing import Any

import numpy as np

from . import _context, _nest, _stall, _variables
from ._arrays import as_axis, check_reducible, leaf_path, leaf_text, mean_of_sum
from ._backends import backend_for, cpu_backend, is_cupy_array, is_cupy_type, visible_gpu_count
from ._checks import (
    not_callable,
    options_or_default,
    refuse_awaitables,
    refuse_ragged,
    short_repr,
)
from ._cross_device_ops import (
    CrossDeviceOps,
    NcclAllReduce,
    ReductionToOneDevice,
    check_alike,
    host_copies,
    scalar_totaller_for,
)
from ._devices import HOST as _HOST
from ._devices import Device, parse_device
from ._errors import ContextError, DeviceError, InvalidArgumentError
from ._input import DistributedDataset, InputContext, InputOptions, from_function
from ._ops import ReduceOp
from ._options import CommunicationOptions
from ._replica_context import (
    _EMPTY,
    _NUMERIC_SCALARS,
    _ONE_ARRAY_LIMIT,
    _REDUCIBLE,
    ReplicaContext,
    _keywords,
    _positional,
)
from ._scheduler import DefaultGroup, ReplicaSlot, RunGroup, task_names
from ._stats import Counters, Statistics, snapshot
from ._values import (
    DistributedValues,
    PerReplica,
    copies_of,
    refuse_structure,
    regroup_wrapping_every_leaf,
    select_replica,
)

__all__ = [
    "MirroredStrategy",
    "OneDeviceStrategy",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "ready",
]

_HOST_KINDS = frozenset({np.ndarray, *np.sctypeDict.values()})  # NumPy arrays and scalars
# (reduce_op as passed, NumPy scalar type) -> scalar_totaller_for(op, type), for
# strategy.reduce of a PerReplica of such scalars (filled in by _reduce_scalars, once
# it has checked the dtype reducible by that op).
# NumPy's module has a __getattr__, so Python 3.11 looks np.asarray up unspecialised
# on every use; a global of its own is a specialised load (0.3k of a (c) step).
_asarray = np.asarray
_SCALAR_REDUCTIONS: dict[tuple, Callable[[Sequence, Any], Any]] = {}


class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``."""

    __slots__ = ("_num_replicas_in_sync", "_replica_id_in_sync_group")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


def _parse_devices(devices: Any, name: str = "devices") -> tuple[Device, ...]:
    """``devices`` (the argument called ``name``) parsed: a list of device strings."""
    if isinstance(devices, str) and "," in devices:  # "cpu:0,cpu:1": several, as one
        listed = [part.strip() for part in devices.split(",") if part.strip()]
        raise DeviceError(
            f"{name}={devices!r} is one string; expected a list of device strings, e.g. {listed!r}."
        )
    if isinstance(devices, str | Device):
        raise DeviceError(
            f"{name}={devices!r} is a single device; expected a list of device strings, "
            f"e.g. [{str(devices)!r}] (or use OneDeviceStrategy)."
        )
    if isinstance(devices, bytes | bytearray | Set | Mapping):
        # Iterated, bytes gave ints ("device 99 is a int"), and a set or a dict's keys
        # an order that is not the caller's (a set of strings: another each run), so
        # replicas landed on devices in no given order.
        raise DeviceError(
            f"{name}={devices!r} is a {type(devices).__name__}; expected a list of device "
            "strings, in replica order, such as ['cpu:0', 'cpu:1'] or ['GPU:0', 'GPU:1']."
        )
    try:
        parsed = tuple(parse_device(d) for d in devices)
    except TypeError:
        raise DeviceError(
            f"{name}={devices!r}; expected a list of device strings such as "
            "['cpu:0', 'cpu:1'] or ['GPU:0', 'GPU:1']."
        ) from None
    if not parsed:
        raise DeviceError(
            f"{name}=[] names no device; expected at least one, e.g. ['cpu:0'] or, on a "
            f"GPU machine, ['GPU:0']. Visible GPUs here: {visible_gpu_count()}."
        )
    for device in parsed:
        backend_for(device).check(device)
    kinds = {device.kind for device in parsed}
    if len(kinds) > 1:
        raise DeviceError(
            f"devices={[str(d) for d in parsed]} mix CPU and GPU devices; expected "
            "replicas all on GPUs or all on CPU devices."
        )
    return parsed


def _default_cross_device_ops(devices: tuple[Device, ...]) -> CrossDeviceOps:
    """NCCL for two or more distinct GPUs when NCCL loads, else ReductionToOneDevice."""
    distinct = len(set(devices)) == len(devices)
    if len(devices) >= 2 and distinct and all(d.kind == "GPU" for d in devices):
        from . import _cuda

        if _cuda.nccl_version() is not None:
            return NcclAllReduce()
    return ReductionToOneDevice()


def _default_devices() -> tuple[Device, ...]:
    count = visible_gpu_count()
    if count:
        gpus = tuple(Device("GPU", i) for i in range(count))
        try:
            for device in gpus:
                backend_for(device)
        except DeviceError:
            pass  # GPUs seen but not usable by this version: fall back to the host
        else:
            return gpus
    return (_HOST,)


class StrategyExtended:
    """The advanced, device-level API of a strategy (``strategy.extended``)."""

    def __init__(self, strategy: Strategy, cross_device_ops: CrossDeviceOps):
        self._strategy = strategy
        self._cross_device_ops = cross_device_ops

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` is a variable created in this strategy's scope (for the
        default strategy: one created outside any scope)."""
        if not isinstance(v, _variables.Variable):
            return False
        if self._strategy is _context._default.get("strategy"):
            return v._strategy is None
        return v._strategy is self._strategy

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.nullcontext:
        """A ``with`` block whose new variables share ``colocate_with_variable``'s devices.

        Used as in TF, inside this strategy's scope with one of its variables:
        ``with strategy.extended.colocate_vars_with(v1): v2 = aiodist.Variable(...)``,
        then ``extended.update(v1, fn, args=(v2,))`` gives ``fn`` each device's copy
        of both. Every variable of a strategy already has its copies on the
        strategy's devices (a mirrored one once per device, a sync-on-read one once
        per replica), so the block only checks, as TF does, where it is used and
        with what: outside this strategy's scope it raises ``ContextError``, with
        anything but a variable made in this scope ``InvalidArgumentError``.
        """
        method = "colocate_vars_with"
        _context.require_cross_replica(self._strategy, method)
        # (Past require_cross_replica, the current strategy is none, the default one,
        # or this one.)
        if not _context.has_strategy() and _context.non_default(self._strategy) is not None:
            raise ContextError(
                f"{method}() of {self._strategy!r} was called outside its scope; use it "
                "inside `with strategy.scope():`, where the variables it places are made."
            )
        v = colocate_with_variable
        if not self.variable_created_in_scope(v):
            if isinstance(v, _variables.Variable):  # (its repr spans lines)
                where = "outside any scope" if v._strategy is None else f"by {v._strategy!r}"
                what = f"variable {v.name!r} (made {where})"
            else:
                what = short_repr(v)
            raise InvalidArgumentError(
                f"{method}: {what} is not a variable of {self._strategy!r}; pass one "
                "created under `with strategy.scope():` of this strategy."
            )
        return contextlib.nullcontext()

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Canonical names of the replicas' devices, in replica order."""
        return tuple(str(d) for d in self._strategy._devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Canonical names of the devices holding variables (each distinct device once)."""
        return tuple(str(d) for d in dict.fromkeys(self._strategy._devices))

    async def reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Combine ``value`` across replicas onto ``destinations`` (cross-replica context)."""
        _context.require_cross_replica(self._strategy, "reduce_to")
        op = ReduceOp.of(reduce_op)
        refuse_structure(value, "reduce_to")
        options = self._strategy._communication_options.merge(options)
        with self._strategy._cross_replica_order():
            return await self._cross_device_ops.reduce(
                op, self._distributed(op, value), destinations, options
            )

    async def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None = None,
    ) -> list:
        """``reduce_to`` for several ``(value, destinations)`` pairs at once."""
        _context.require_cross_replica(self._strategy, "batch_reduce_to")
        op = ReduceOp.of(reduce_op)
        options = self._strategy._communication_options.merge(options)
        pairs = self._pairs(op, value_destination_pairs)
        with self._strategy._cross_replica_order():
            return await self._cross_device_ops.batch_reduce(op, pairs, options)

    async def broadcast_to(self, value: Any, destinations: Any) -> Any:
        """Copy ``value`` to every device of ``destinations``."""
        _context.require_cross_replica(self._strategy, "broadcast_to")
        with self._strategy._cross_replica_order():
            return await self._cross_device_ops.broadcast(value, destinations)

    async def update(
        self,
        var: Any,
        fn: Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        group: bool = True,
    ) -> Any:
        """Call ``fn(copy, *args, **kwargs)`` once per copy of ``var``, on its device.

        ``Mirrored`` arguments are unwrapped per copy, and so are this strategy's
        variables: ``fn`` gets their copy on the device it runs for, as TF unwraps
        them. Returns a ``Mirrored`` of the results (a tuple with ``group=False``),
        one per replica: replicas sharing a device share its copy's result. ``var``
        is a variable of this strategy (or one made outside any scope); another
        strategy's raises ``ContextError``, as writing it here would. If ``fn``
        raises for any copy, no copy of ``var`` (or of the variables unwrapped for
        ``fn``) is changed: the error propagates with every copy as before.
        """
        _context.require_cross_replica(self._strategy, "update")
        owner = var._strategy if isinstance(var, _variables.Variable) else None
        mine = _context.non_default(self._strategy)
        if owner is not None and mine is not None and owner is not mine:
            # TF's rule, as for the variable's own writes: one strategy at a time.
            raise ContextError(
                f"Mixing different aiodist strategies: update() of {owner!r}'s variable "
                f"{var.name!r} was called on {mine!r}.{_context.twin_note(owner, mine)} "
                "Update a variable through the strategy whose scope made it (its "
                "extended.update)."
            )
        return await _variables.update(var, fn, args, kwargs, group)

    async def call_for_each_replica(
        self, fn: Callable, args: Sequence = (), kwargs: dict | None = None
    ) -> Any:
        """Run ``fn`` once per replica: the same as ``strategy.run``."""
        replica = _context._STATE.get()[_context.REPLICA]
        if replica is not None:  # (named as called: run's own message names run())
            raise _nested_run(replica, "strategy.extended.call_for_each_replica()")
        return await self._strategy.run(fn, args=args, kwargs=kwargs)

    def _pairs(self, op: ReduceOp, value_destination_pairs: Any) -> list:
        """``batch_reduce_to``'s pairs, checked, each value through ``_distributed``."""
        try:
            pairs = [(v, d) for v, d in value_destination_pairs]
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"batch_reduce_to: value_destination_pairs={value_destination_pairs!r}; "
                "expected a list of (value, destinations) pairs."
            ) from None
        for value, _ in pairs:
            refuse_structure(value, "batch_reduce_to")
        return [(self._distributed(op, v), d) for v, d in pairs]

    def _distributed(self, op: ReduceOp, value: Any) -> Any:
        """TF's rule for a value that is not distributed: with several replicas it is
        everyone's value, so MEAN (and MIN, MAX) give it back; SUM and PRODUCT would
        be ambiguous and raise."""
        n = self._strategy.num_replicas_in_sync
        ambiguous = op in (ReduceOp.SUM, ReduceOp.PRODUCT)
        given = value
        value = copies_of(value)  # (a variable: its copies, as in TF; a plain one: its value)
        if isinstance(value, DistributedValues) or n == 1 or not ambiguous:
            return value
        raise InvalidArgumentError(
            ambiguous_reduction(op, type(given).__name__, f"across {n} replicas")
        )


def ambiguous_reduction(op: ReduceOp, what: str, where: str) -> str:
    """Why SUM or PRODUCT of a value that is not distributed (``what``: its type, or
    each worker's) is refused ``where`` (across several replicas): TF's rule, also
    that of ``MultiWorkerMirroredStrategy``, where a worker holds several."""
    return (
        f"a value that is not distributed ({what}) cannot be reduced with {op.name} "
        f"{where} (is it one replica's value, or every replica's?); pass the "
        "PerReplica value from strategy.run, or use MEAN."
    )


def run_options_refused(options: Any) -> InvalidArgumentError:
    """``run(options=...)`` given anything but None. TF's ``RunOptions`` holds
    TPU-only fields; taking any value quietly (a ``CommunicationOptions`` whose
    timeout then bounded nothing) would let a user believe it applies."""
    if isinstance(options, CommunicationOptions):
        what = "run() does not apply CommunicationOptions to the collectives of its replicas"
    else:
        what = (
            "in TF it is a tf.distribute.RunOptions, whose fields are all TPU-only, "
            "and aiodist has none to take"
        )
    return InvalidArgumentError(
        f"run: options={options!r} is not accepted: {what}. Leave options=None; pass "
        "CommunicationOptions to each collective (ctx.all_reduce(..., options=...), "
        "ctx.all_gather(..., options=...), strategy.extended.reduce_to(..., options=...)), "
        "or to the strategy as its defaults (communication_options=...)."
    )


class Strategy:
    """Base class of strategies. Use ``MirroredStrategy`` or ``OneDeviceStrategy``."""

    _group_class = RunGroup  # what runs replicas (multi-worker: one that spans workers)
    _world: Any = None  # the workers of a multi-worker strategy (None: one process)
    _replica_offset = 0  # global id of this process's first replica
    _one_device = False  # OneDeviceStrategy: its variables are written as plain ones

    def __init__(
        self,
        devices: Sequence[Device],
        cross_device_ops: CrossDeviceOps | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise InvalidArgumentError(
                f"cross_device_ops={cross_device_ops!r}; expected an aiodist.CrossDeviceOps "
                "such as aiodist.ReductionToOneDevice(), or None for the default."
            )
        communication_options = options_or_default(
            CommunicationOptions, communication_options, "communication_options"
        )
        self._devices = tuple(devices)
        self._communication_options = communication_options
        cross_device_ops = cross_device_ops or _default_cross_device_ops(self._devices)
        cross_device_ops._check_devices(self._devices)
        self._slots = tuple(
            ReplicaSlot(i, device, backend_for(device), backend_for(device).new_stream(device))
            for i, device in enumerate(self._devices)
        )
        self._streams = tuple(slot.stream for slot in self._slots)  # read by every run
        self._task_names = task_names(self._slots)
        self._numpy_replicas = all(slot.backend is cpu_backend for slot in self._slots)
        self._on_host = not self._slots[0].backend.needs_activation  # (RunGroup's)
        self._extended = StrategyExtended(self, cross_device_ops)
        self._live_groups: set = set()  # runs in flight (statistics, stall reports)
        _stall.register(self)  # (whose watchdog looks at _live_groups)
        self._counters = Counters()
        # One handle per replica, shared by every run (the run is in the context state).
        self._replica_contexts = tuple(
            ReplicaContext(self, slot.replica_id, slot.device) for slot in self._slots
        )

    def __repr__(self) -> str:
        devices = ", ".join(repr(str(d)) for d in self._devices)
        return f"{type(self).__name__}(devices=[{devices}])"

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each function passed to ``run``."""
        return len(self._devices)

    def statistics(self) -> Statistics:
        """An immutable snapshot: runs and rendezvous in flight, and totals.

        ``repr()`` of the snapshot shows every rendezvous in flight with the
        replicas that arrived and the ones still missing.
        """
        live = self._live_groups
        for group in tuple(live):  # (a copy made in C: safe against other threads' runs)
            if group._loop.is_closed():
                # Its loop was closed with it in flight (loop.close() without
                # cancelling its tasks): it will never finish, nor leave the set
                # itself. Dropped here, not counted in flight for ever (and not
                # holding its replicas' tasks and arguments as long as the strategy).
                live.discard(group)
        return snapshot(self._counters, live, time.perf_counter())

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this strategy current and enter cross-replica context (``with``).

        Where this strategy is already current (its scope, its ``run``), entering
        changes nothing; one scope object may be entered again inside its own block.
        """
        return _context.scope_of(self)

    # -- running replicas --------------------------------------------------------------

    async def run(
        self,
        fn: Callable,
        args: Sequence = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once per replica and return the regrouped results.

        ``fn`` is an ``async def`` function or a plain one (an async generator
        function is refused with ``InvalidArgumentError``). Distributed values in
        ``args``/``kwargs`` are unwrapped to each replica's component. A result
        that is the same object on every replica stays one object; otherwise it
        becomes ``PerReplica``. If a replica raises, the others are cancelled and
        that exception propagates.

        ``options`` is kept for TF's signature and must be None: TF's is a
        ``tf.distribute.RunOptions`` of TPU-only fields, which aiodist has no use
        for, and anything else (a ``CommunicationOptions`` included) is refused
        with ``InvalidArgumentError``. Communication options go to each collective
        (``ctx.all_reduce(..., options=...)``) or to the strategy
        (``communication_options=``).

        Examples:
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step(x):
            ...     return await aiodist.get_replica_context().all_reduce("sum", x)
            >>> result = aiodist.run(strategy.run(step, args=(1.0,)))
            >>> strategy.experimental_local_results(result)
            (array(2.), array(2.))
        """
        state = _context._STATE.get()  # (not current_state(): a call less per run)
        replica, current = state[_context.REPLICA], state[_context.STRATEGY]
        if replica is not None:
            raise _nested_run(replica, "strategy.run()")
        # (The default strategy current, in its merge_fn, is no strategy: as outside
        # any scope. Tested last: the usual run has current None or self.)
        if current is not None and current is not self and _context.non_default(current):
            raise _context._mixing(current, self)
        if options is not None:  # (the one test the usual run pays for it)
            raise run_options_refused(options)
        if not callable(fn):
            raise not_callable(fn, f"run: fn={fn!r} is not callable.")
        if type(args) is not tuple:  # the usual tuple needs no check (once per step)
            args = _positional(args, "run")
        kwargs = _EMPTY if kwargs is None else _keywords(kwargs, "run")
        return await self._group_class(self, self._slots).run(fn, args, kwargs)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """A ``PerReplica`` of ``value_fn(ValueContext(i, n))`` for each replica i.

        When ``value_fn`` returns a nested structure (lists, tuples, namedtuples,
        dicts), the result is that structure with a ``PerReplica`` at each leaf, as
        TF's is and as a distributed dataset's batches are; the replicas' structures
        must nest alike. ``value_fn`` is a plain function: an ``async def`` one is
        refused with ``InvalidArgumentError`` (nothing would await it).

        Examples:
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> values = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync)
            >>> strategy.experimental_local_results(values)
            (0.0, 0.5)
        """
        if not callable(value_fn):
            raise InvalidArgumentError(
                f"experimental_distribute_values_from_function: value_fn={value_fn!r} is "
                "not callable; expected a function taking a ValueContext."
            )
        n = self.num_replicas_in_sync
        values = []
        for slot in self._slots:
            token = slot.backend.activate(slot.device, slot.stream)
            try:
                replica_id = self._replica_offset + slot.replica_id
                value = value_fn(ValueContext(replica_id, n))
            finally:
                slot.backend.deactivate(token)
            refuse_awaitables(
                (value,),
                lambda: (
                    f"experimental_distribute_values_from_function: value_fn={value_fn!r} "
                    "returned an awaitable; it is called once per replica, not awaited, so "
                    "it must be a plain function (def, not async def) returning the value."
                ),
            )
            for index, leaf in enumerate(_nest.flatten(value)):
                if isinstance(leaf, DistributedValues):
                    path, _ = leaf_path(value, index)
                    at = f" (at {path})" if path else ""
                    raise InvalidArgumentError(
                        f"experimental_distribute_values_from_function: value_fn={value_fn!r} "
                        f"returned a {type(leaf).__name__}{at} for replica {replica_id}; it "
                        "is called once per replica and returns that replica's own value "
                        "(a PerReplica in a PerReplica has no meaning). Return the value for "
                        "replica ctx.replica_id_in_sync_group itself instead."
                    )
            values.append(value)
        # (One replica: its value as it is.)
        return regroup_wrapping_every_leaf(values, self._devices, what="received from value_fn")

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> DistributedDataset:
        """Split each global batch of ``dataset`` across the replicas (see ``_input``).

        ``dataset`` is any iterable or async iterable of arrays or nested
        structures of arrays sharing a leading batch axis. Iterate the result
        with ``async for`` (prefetched) or, for sync sources, ``for``; a nested
        batch comes out with a ``PerReplica`` at every leaf. As in TF,
        ``options.experimental_replication_mode=PER_REPLICA`` is refused here.

        Each ``async for`` or ``for`` is a pass from the first batch, as over a
        ``tf.data.Dataset``, where ``dataset`` is re-iterable (a list, an object
        whose ``__iter__`` makes a new iterator). A one-shot ``dataset`` (a
        generator, any iterator: ``iter(x) is x``) gives one pass: a second one
        raises ``InvalidArgumentError``; call this again for each pass.
        """
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Per-replica batches built by ``dataset_fn(InputContext)``.

        ``PER_WORKER`` (default): called once, replicas take consecutive elements.
        ``PER_REPLICA``: called once per replica. When a source runs out first, the
        replicas it feeds get empty batches until every source is exhausted.
        ``dataset_fn`` is a plain function (it may return an async iterable); an
        ``async def`` one is refused with ``InvalidArgumentError``. It is called
        here, once: where it returns a one-shot iterator (a generator), the
        result gives one pass, and a second raises ``InvalidArgumentError``.
        """
        return from_function(self, dataset_fn, options)

    def experimental_local_results(self, value: Any) -> tuple:
        """The components of ``value``, one per local replica.

        A distributed value gives its components; a distributed variable, each
        replica's copy (replicas sharing a mirrored copy show it once each); a
        nested structure gives one structure per replica with each distributed
        value or variable in it replaced by that replica's component or copy; any
        other value gives ``(value,)``.
        """
        if isinstance(value, DistributedValues):
            return value.values
        if hasattr(value, "_aiodist_local_results"):  # distributed variables
            return tuple(value._aiodist_local_results())
        if _nest.is_nested(value):
            n = len(self._slots)  # this process's replicas
            return tuple(
                _nest.map_structure(partial(_local_component, i, n), value) for i in range(n)
            )
        return (value,)

    # -- cross-replica API --------------------------------------------------------------

    async def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Any = None) -> Any:
        """Reduce ``value`` across replicas to a NumPy array on the host.

        ``value`` is one value: a ``PerReplica`` (from ``run``), a ``Mirrored``, a
        variable of this strategy (its copies), or a plain array or a variable made
        outside any scope (every replica's: with several replicas, SUM and PRODUCT
        of it raise as ambiguous). For a dict or list of them, reduce each (a
        structure of distributed values raises, naming how).

        With ``axis``, each replica's value is first reduced along that axis too;
        MEAN then divides by the true number of elements over all replicas (so an
        uneven last batch is weighted correctly).

        Examples:
            >>> import numpy as np
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> value = aiodist.PerReplica([np.array([0.0, 1.0, 2.0]), np.array([3.0])])
            >>> aiodist.run(strategy.reduce("mean", value, axis=0))
            array(1.5)
            >>> aiodist.run(strategy.reduce("max", value, axis=0))
            array(3.)
        """
        # require_cross_replica's tests written out, so the usual call makes no call
        # for them (it raises, naming the context, when one fails).
        state = _context._STATE.get()
        current = state[_context.STRATEGY]
        if state[_context.REPLICA] is not None or (current is not None and current is not self):
            _context.require_cross_replica(self, "reduce")
        if axis is None and type(value) is PerReplica:  # a loss or a count from run()
            # NumPy scalars of a type already reduced with this reduce_op (as passed):
            # their reduction, prepared by scalar_totaller, in one lookup, with no op
            # parsing and none of the checks the first call made (the lookup took a
            # call from 16.6k to 14.2k instructions, N = 4; the prepared reduction
            # 1.6k more off a (c) step).
            parts = value._values
            kind = type(parts[0])
            try:
                total = _SCALAR_REDUCTIONS.get((reduce_op, kind))
            except TypeError:  # an unhashable reduce_op: refused below
                total = None
            # _reduces_scalars(parts) written out, with its loop of all_of_type: two
            # calls less per reduction (1.1k instructions of a (c) step).
            if (
                total is not None
                and 1 < len(parts) == len(self._slots)
                and self._extended._cross_device_ops._scalars_by_arithmetic
            ):
                for part in parts:
                    if type(part) is not kind:
                        break
                else:  # combine_scalars, less its one-value case (there are several).
                    return _asarray(total(parts[1:], parts[0]))
        op = ReduceOp.of(reduce_op)
        if axis is None and type(value) is PerReplica:
            total = self._reduce_scalars(op, value._values, reduce_op)
            if total is not None:
                return total
        refuse_structure(value, "strategy.reduce")
        parts = await self._host_components(value, "strategy.reduce")
        if len(parts) == 1:
            self.extended._distributed(op, value)  # raises for SUM/PRODUCT of a plain value
        parts, count = _local_parts(op, parts, axis)
        if axis is not None and op is ReduceOp.MEAN:
            # The replicas' sums added by the cross-device ops, as TF adds its
            # numerator, and as SUM with axis and MEAN without are (a subclass's
            # reduction, an accumulation_fn); then divided by the element count.
            total = self.extended._cross_device_ops._reduce_arrays(ReduceOp.SUM, parts, _HOST)
            if type(total) is not np.ndarray:
                total = await _on_host(total)
            return np.asarray(np.true_divide(total, count))
        if len(parts) == 1 and op is ReduceOp.MEAN:  # integers: a float mean, as always
            return mean_of_sum(np, np.array(parts[0], copy=True), 1)
        # Straight to the reduction primitive: the parts are host arrays already.
        total = self.extended._cross_device_ops._reduce_arrays(op, parts, _HOST)
        if type(total) is not np.ndarray:
            total = await _on_host(total)
        return total

    def _reduces_scalars(self, parts: tuple) -> bool:
        """Whether ``reduce(op, PerReplica(parts), axis=None)`` may combine ``parts``
        by scalar arithmetic: NumPy scalars all of one type (the first's, whose
        type the caller has checked), one per local replica, reduced by the default
        host reduction."""
        return (
            1 < len(parts) == len(self._slots)
            and self._extended._cross_device_ops._scalars_by_arithmetic
            and _nest.all_of_type(parts, type(parts[0]))
        )

    def _reduce_scalars(self, op: ReduceOp, parts: tuple, reduce_op: Any) -> np.ndarray | None:
        """``reduce(op, PerReplica(parts), axis=None)`` when ``parts`` are NumPy scalars
        of one type reduced by the default host reduction (a per-replica loss or
        count): scalar arithmetic at once, as the replicas' own all-reduce of a
        scalar does. About 3 us of 4.4 less than the general path (its component,
        shape and device checks and lookups). None when it does not apply.
        ``reduce_op`` (as the caller passed it) and the scalars' type are then
        remembered in ``_SCALAR_REDUCTIONS``, for ``reduce``'s next calls."""
        kind = type(parts[0])
        if kind not in _NUMERIC_SCALARS or not self._reduces_scalars(parts):
            return None
        reducible, dtype = _REDUCIBLE[op], parts[0].dtype
        if dtype not in reducible:  # checked once per op and dtype, as all_reduce does
            check_reducible(op, parts[0], "reduce")
            reducible.add(dtype)
        total = scalar_totaller_for(op, kind)  # (the scalar all-reduce's too)
        if len(_SCALAR_REDUCTIONS) >= _ONE_ARRAY_LIMIT:
            _SCALAR_REDUCTIONS.clear()
        _SCALAR_REDUCTIONS[reduce_op, kind] = total
        return np.asarray(total(parts[1:], parts[0]))  # combine_scalars, less its one-value case

    async def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the components of ``value`` (one value, as for ``reduce``)
        along ``axis`` into a host array.

        Examples:
            >>> import numpy as np
            >>> import aiodist
            >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> value = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: np.array([[ctx.replica_id_in_sync_group]]))
            >>> aiodist.run(strategy.gather(value, axis=1))
            array([[0, 1]])
        """
        _context.require_cross_replica(self, "gather")
        axis = as_axis(axis, "gather")
        refuse_structure(value, "strategy.gather")
        parts = await self._host_components(value, "strategy.gather")
        components = PerReplica(parts, (_HOST,) * len(parts)) if len(parts) > 1 else parts[0]
        return await self.extended._cross_device_ops.gather(components, _HOST, axis)

    async def _host_components(self, value: Any, where: str) -> list:
        """The components of ``value`` as host arrays; GPU components are copied in
        stream order while the loop keeps running. ``where``: the call, named if a
        component is no array (a ragged list)."""
        given = value
        value = copies_of(value)  # (a variable: its copies, as in TF; a plain one: its value)
        if isinstance(value, DistributedValues):
            parts = list(value._values)
            if len(parts) != len(self._slots):
                raise self._wrong_count(given, len(parts), where)
        else:
            parts = [value]
        # Tests per type of part (usually one type), not per part.
        kinds = set(map(type, parts))
        if any(map(is_cupy_type, kinds)):
            with self._cross_replica_order():
                parts = await host_copies(parts)
        elif kinds <= _HOST_KINDS:
            # NumPy arrays and scalars, as they are: scalars have a shape and a
            # dtype, and the host reductions return arrays.
            return parts
        try:
            return [p if type(p) is np.ndarray else np.asarray(p) for p in parts]
        except ValueError:
            refuse_ragged(parts, where)
            raise

    def _wrong_count(self, value: Any, count: int, where: str) -> InvalidArgumentError:
        """The error for ``value`` (a distributed value or a variable), which has
        ``count`` components where this strategy has another number of replicas."""
        n = len(self._slots)
        if hasattr(value, "_aiodist_local_results"):  # a variable: name it and its maker
            # (It read "a PerReplica with 2 values was passed", for a variable.)
            return InvalidArgumentError(
                f"{where}: variable {value.name!r} was made in the scope of "
                f"{value._strategy!r}, which has {count} replicas, not {n} as {self!r}; "
                "pass a variable to the strategy whose scope made it."
            )
        return InvalidArgumentError(
            f"{where}: a {type(value).__name__} with {count} values was passed to a "
            f"strategy with {n} local replicas; expected one value per replica, as this "
            "strategy's run returns."
        )

    # -- ordering cross-replica work on GPUs ----------------------------------------------

    @contextlib.contextmanager
    def _cross_replica_order(self) -> Iterator[None]:
        """On GPUs, order the cross-replica work issued inside the block: the current
        streams first wait for the work queued on every replica stream (so it sees
        the replicas' results), and every replica stream's later work then waits for
        it. Holds no stream state, so the block may await. Nothing on the host."""
        backend = self._slots[0].backend
        if not backend.needs_activation:
            yield
            return
        backend.order_after_replicas(self._slots)
        try:
            yield
        finally:
            backend.order_replicas_after(self._slots)


def _nested_run(replica: Any, called: str) -> ContextError:
    """The error for ``called`` (a run) inside ``replica``'s function."""
    return ContextError(
        f"{called} was called inside a replica function (replica "
        f"{replica.replica_id_in_sync_group}); runs cannot nest. Call the "
        "inner function directly, or use get_replica_context().merge_call() to "
        "reach cross-replica context."
    )


async def _on_host(total: Any) -> np.ndarray:
    """``strategy.reduce``'s result as a host array, where the cross-device ops' reduction
    (which may combine host parts elsewhere) gave something else: the copy, made in
    stream order, of a CuPy array (a ReductionToOneDevice whose reduce_to_device is a
    GPU reduces there), else a NumPy scalar (a subclass's np.sum of 0-d arrays) as a
    0-d array. Either came back as it was, instead of the NumPy array promised."""
    if is_cupy_array(total):
        (total,) = await host_copies([total])
        return total
    return np.asarray(total)


def _local_component(replica_id: int, num_replicas: int, leaf: Any) -> Any:
    """``experimental_local_results``' pick from one leaf of a structure: replica
    ``replica_id``'s component of a distributed value, its copy of a distributed
    variable (one entry per replica: TF's variables are distributed values), else
    the leaf itself (a plain variable too, where several replicas run)."""
    if hasattr(leaf, "_aiodist_local_results"):
        copies = leaf._aiodist_local_results()
        return copies[replica_id] if len(copies) == num_replicas else leaf
    return select_replica(replica_id, leaf, num_replicas)


def _local_parts(op: ReduceOp, parts: list, axis: Any) -> tuple[list, int]:
    """``strategy.reduce``'s per-replica host ``parts``, checked for ``op`` and, with
    ``axis``, each reduced along it (MEAN: summed); and how many elements a MEAN
    divides by."""
    if axis is None:
        check_alike(op, parts, "reduce")
        check_reducible(op, parts[0], "reduce")  # one dtype: check_alike said so
        return parts, len(parts)
    axes = _normalise_axis(axis, parts)
    check_alike(op, parts, "reduce", axes)
    check_reducible(op, parts[0], "reduce")
    count = sum(int(np.prod([p.shape[a] for a in axes])) for p in parts)
    ufunc = getattr(np, op.ufunc)  # MEAN's is add
    # MIN, MAX: an empty share (an uneven last batch) reduces to the identity TF uses,
    # the dtype's extreme (-inf for a MAX of floats), so it changes nothing.
    extra = {"initial": _extreme(op, parts[0].dtype)} if ufunc.identity is None else {}
    # Sums and products keep the values' dtype, as without axis; MEAN sums integers
    # as float64, as NumPy's mean does (their default accumulator, int64 or uint64,
    # would wrap).
    if op is ReduceOp.MEAN:
        dtype = np.float64 if parts[0].dtype.kind in "iub" else None
    else:
        dtype = parts[0].dtype
    return [np.asarray(ufunc.reduce(p, axis=axes, dtype=dtype, **extra)) for p in parts], count


def _extreme(op: ReduceOp, dtype: np.dtype) -> Any:
    """The identity of MAX (``op`` MAX) or MIN over ``dtype``: its lowest or highest value."""
    highest = op is ReduceOp.MIN
    if dtype.kind == "b":
        return highest
    if dtype.kind in "iu":
        limits = np.iinfo(dtype)
        return limits.max if highest else limits.min
    return np.inf if highest else -np.inf


def _normalise_axis(axis: Any, parts: list) -> tuple[int, ...]:
    """``axis`` as non-negative axes of every part, which must have one rank."""
    axes = axis if isinstance(axis, list | tuple) else (axis,)
    if len({p.ndim for p in parts}) > 1:
        shapes = "; ".join(f"replica {i}: shape {p.shape}" for i, p in enumerate(parts))
        raise InvalidArgumentError(
            f"reduce: axis={axis!r} over values of different ranks ({shapes}); every "
            "replica must hold a value of the same rank."
        )
    out = []
    for a in axes:
        try:
            if isinstance(a, bool):  # axis=True is a mistake, not axis 1
                raise TypeError
            a = operator.index(a)
        except TypeError:
            raise InvalidArgumentError(
                f"reduce: axis={axis!r}; expected an int, a tuple of ints, or None."
            ) from None
        if parts[0].ndim == 0:  # (all of one rank; the range below would read "0 <= axis < 0")
            raise InvalidArgumentError(
                f"reduce: axis={axis!r} for rank-0 values ({leaf_text(parts[0])}), which "
                "have no axis to reduce along; reduce them with axis=None."
            )
        for p in parts:
            if not -p.ndim <= a < p.ndim:
                raise InvalidArgumentError(
                    f"reduce: axis={a} is out of range for a value of shape {p.shape}; "
                    f"expected {-p.ndim} <= axis < {p.ndim}."
                )
        out.append(a % parts[0].ndim)
    if len(set(out)) != len(out):
        raise InvalidArgumentError(
            f"reduce: axis={axis!r} names an axis twice; expected distinct axes."
        )
    return tuple(out)


async def ready(value: Any = None) -> Any:
    """Wait until the GPU work queued so far is done, without blocking the event loop.

    Inside a replica function this waits for the replica's own stream; in
    cross-replica context, for the current streams of the devices involved,
    after ordering them behind the current strategy's replica streams (so a
    ``PerReplica`` from ``run`` is covered inside ``strategy.scope()``). The
    devices are those holding ``value``'s CuPy arrays (distributed values and
    nested structures included), or the current device when there are none;
    work queued with CuPy alone, before any GPU strategy was made, is waited
    for too. Returns ``value``. Without GPUs it returns at once.

    A device error (say, an illegal address in a kernel) is raised here as
    CuPy's ``CUDARuntimeError`` rather than hanging.

    Examples:
        >>> import numpy as np
        >>> import aiodist
        >>> aiodist.run(aiodist.ready(np.ones(2)))
        array([1., 1.])
    """
    from . import _backends

    backend = _backends.loaded_gpu_backend()
    if backend is None and "cupy" not in sys.modules:
        return value  # CuPy never imported: no GPU work can have been queued
    leaves = []
    for leaf in _nest.flatten(value):
        leaves.extend(leaf._values if isinstance(leaf, DistributedValues) else (leaf,))
    indices = {leaf.device.id for leaf in leaves if is_cupy_array(leaf)}
    if backend is None:
        # No GPU strategy made yet, but CuPy is imported: work may have been queued
        # with CuPy alone (value's arrays, or on the current device). The GPU
        # backend is loaded for it here; it returned at once, hiding a device error.
        if not indices and visible_gpu_count() == 0:
            return value
        backend = backend_for(Device("GPU", min(indices, default=0)))
    if _context.current_replica() is None:
        strategy = _context.get_strategy()
        if strategy._slots[0].backend is backend:
            backend.order_after_replicas(strategy._slots)
            indices.update(slot.device.index for slot in strategy._slots)
    await backend.streams_ready(indices)
    return value


class MirroredStrategy(Strategy):
    """Synchronous data parallelism: one replica per listed device, in one process.

    Args:
        devices: device strings, e.g. ``["cpu:0", "cpu:1"]`` or ``["GPU:0", "GPU:1"]``;
            a device may be listed more than once. Default: every visible GPU,
            else ``["cpu:0"]``.
        cross_device_ops: how values are combined across devices (default:
            ``NcclAllReduce`` for two or more GPUs, none listed twice, when CuPy
            has NCCL, else ``ReductionToOneDevice``).
        communication_options: defaults for every collective (per-call
            ``options`` override them field by field).

    Examples:
        >>> import aiodist
        >>> strategy = aiodist.MirroredStrategy(["cpu:0", "/cpu:1"])
        >>> strategy.num_replicas_in_sync, strategy.extended.worker_devices
        (2, ('/device:CPU:0', '/device:CPU:1'))
        >>> async def step():
        ...     return aiodist.get_replica_context().replica_id_in_sync_group
        >>> aiodist.run(strategy.run(step))
        PerReplica:{
          0: 0,
          1: 1
        }
    """

    def __init__(
        self,
        devices: Sequence[str | Device] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        parsed = _default_devices() if devices is None else _parse_devices(devices)
        super().__init__(parsed, cross_device_ops, communication_options)


class OneDeviceStrategy(Strategy):
    """One replica on one device: the same code path as several replicas.

    Its variables have one copy, as TF's plain variables there: a variable made with
    the default ``aggregation=NONE`` may be written in replica context too (the
    write goes to that copy), where a ``MirroredStrategy``'s, even of one device,
    raises (SPEC 9).
    """

    _one_device = True

    def __init__(self, device: str | Device):
        if not isinstance(device, str | Device):
            raise DeviceError(
                f"OneDeviceStrategy(device={device!r}); expected one device string, "
                "e.g. 'cpu:0' or 'GPU:0'."
            )
        super().__init__(_parse_devices([device]))


class _DefaultStrategy(Strategy):
    """The strategy in force outside any scope: one replica on the host."""

    def __init__(self) -> None:
        super().__init__((_HOST,))

    def __repr__(self) -> str:
        return "<default strategy (one replica on /device:CPU:0)>"


def _make_default() -> tuple[Strategy, ReplicaContext]:
    strategy = _DefaultStrategy()
    group = DefaultGroup(strategy, strategy._slots)
    return strategy, group.context


_context.register_default_strategy(*_make_default())
