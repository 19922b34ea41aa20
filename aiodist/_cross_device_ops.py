"""Cross-device ops: how per-replica values are combined and moved between devices.

The public methods (``reduce``, ``batch_reduce``, ``broadcast``, ``gather``) are
coroutines, as everywhere data moves in cross-replica code. Underneath are
synchronous primitives that only *issue* work (on GPUs it runs later, in stream
order), which the scheduler calls when a collective completes:

- ``_reduce_arrays(op, arrays, target)``: one reduced array on ``target``;
- ``_broadcast_array(array, destinations)``: one handle per destination;
- ``_all_reduce_flat`` / ``_all_gather_flat``: the replica-context collectives,
  on lists of leaves (one list per replica).

On GPUs the scheduler issues these on per-device *cross streams* ordered after
and before the replicas' streams by CUDA events (``_cuda``), except for ops with
``_on_replica_streams`` set (``NcclAllReduce``), which issue each rank's part
on its replica's own stream.

Results on CPU devices: every destination receives its own *read-only view* of
one shared result buffer (logical CPU devices share host memory, so a copy per
replica would only cost bandwidth). Copy a result (``x.copy()``) to modify it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter
from types import CoroutineType
from typing import Any

import numpy as np

from . import _context
from ._arrays import (
    UNAWAITED,
    as_axis,
    check_reducible,
    gather_axis,
    leaf_text,
    mean_of_sum,
    mean_operand,
    unawaited,
)
from ._backends import backend_for, cpu_backend, is_cupy_array, is_cupy_type
from ._checks import options_or_default, refuse_ragged, whole_number
from ._devices import HOST, Device, parse_device
from ._errors import InvalidArgumentError
from ._host_reduce import combine as host_combine
from ._host_reduce import pack as host_pack
from ._host_reduce import scalar_totaller
from ._ops import ReduceOp
from ._options import CommunicationOptions
from ._values import DistributedValues, Mirrored, copies_of, refuse_structure

__all__ = ["CrossDeviceOps", "NcclAllReduce", "ReductionToOneDevice", "resolve_destinations"]


_NUMPY_UFUNCS = {op: getattr(np, op.ufunc) for op in ReduceOp}
# NumPy's module has a __getattr__, so Python 3.11 looks np.generic up unspecialised
# on every use; a global of its own is a specialised load (three per scalar
# all-reduce: 1.0k instructions of a (b) step).
_GENERIC, _NDARRAY = np.generic, np.ndarray
# op -> NumPy scalar type -> scalar_totaller(ufunc, type, divide by count), for the
# all-reduce of one NumPy scalar per host replica (ReductionToOneDevice's) and
# strategy.reduce of a PerReplica of such scalars. (A table per op: no key tuple
# made per call, 0.4k instructions of a (b) step.)
_SCALAR_TOTALS: dict[ReduceOp, dict[type, Callable[[Sequence, Any], Any]]] = {
    op: {} for op in ReduceOp
}


def scalar_totaller_for(op: ReduceOp, kind: type) -> Callable[[Sequence, Any], Any]:
    """The host's reduction by ``op`` of NumPy scalars of type ``kind``, as a callable
    of ``(values[1:], values[0])``: ``scalar_totaller``'s, made once per op and type
    and kept in ``_SCALAR_TOTALS``."""
    totals = _SCALAR_TOTALS[op]
    total = totals.get(kind)
    if total is None:
        if len(totals) >= 64:  # (subclasses of NumPy's scalar types)
            totals.clear()
        total = totals[kind] = scalar_totaller(_NUMPY_UFUNCS[op], kind, op._row.divide_by_count)
    return total


def resolve_destinations(destinations: Any) -> tuple[Device, ...]:
    """The devices named by ``destinations``.

    Accepted: a device string or ``Device``; a list/tuple of them; an array
    (its device: NumPy arrays live on ``/device:CPU:0``); a distributed value or
    variable (its components' devices).
    """
    if isinstance(destinations, str | Device):
        devices: tuple[Device, ...] = (parse_device(destinations),)
    elif isinstance(destinations, DistributedValues):
        if destinations._devices is None:
            raise InvalidArgumentError(
                f"destinations={destinations!r} does not know its devices; pass a value "
                "made by a strategy (run, experimental_distribute_values_from_function) "
                "or a device string."
            )
        devices = destinations._devices
    elif hasattr(destinations, "_aiodist_devices"):  # distributed variables
        devices = tuple(destinations._aiodist_devices)
    elif isinstance(destinations, np.ndarray | np.generic):
        devices = (HOST,)
    elif is_cupy_array(destinations):
        devices = (Device("GPU", int(destinations.device.id)),)
    elif isinstance(destinations, list | tuple) and destinations:
        devices = tuple(parse_device(d) for d in destinations)
    else:
        if isinstance(destinations, UNAWAITED):  # (strategy.run(...) without its await)
            if isinstance(destinations, CoroutineType):
                destinations.close()  # (never awaited: closed, Python does not warn)
            raise InvalidArgumentError(unawaited(destinations, "destinations"))
        raise InvalidArgumentError(
            f"destinations={destinations!r}; expected a device string (e.g. 'cpu:0'), a "
            "list of them, an array, or a distributed value / variable."
        )
    for device in devices:
        backend_for(device).check(device)
    return devices


_KIND = attrgetter("kind")
_VIEW = np.ndarray.view


def _all_cpu(devices: Sequence[Device]) -> bool:
    # C-level iteration, no hashing: Device's dataclass __hash__ is a Python call per
    # device, which made a cache keyed by the devices cost more than this scan.
    return "GPU" not in map(_KIND, devices)


_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


# ``shared`` and count - 1 views of it, written out for the usual replica counts: on
# Python 3.11 a loop or map(ndarray.view, ...) costs 2.5k instructions (0.3 us) more
# than the views themselves for four replicas; each view is about 0.8k.
_SHARED_AND_VIEWS = (
    None,
    lambda a: [a],
    lambda a: [a, a.view()],
    lambda a: [a, a.view(), a.view()],
    lambda a: [a, a.view(), a.view(), a.view()],
    lambda a: [a, a.view(), a.view(), a.view(), a.view()],
    lambda a: [a, a.view(), a.view(), a.view(), a.view(), a.view()],
    lambda a: [a, a.view(), a.view(), a.view(), a.view(), a.view(), a.view()],
    lambda a: [a, a.view(), a.view(), a.view(), a.view(), a.view(), a.view(), a.view()],
)


def _host_views(array: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` read-only views of ``array`` (one per host destination). setflags
    instead of ``.flags``: about 0.3 us less."""
    shared = array.view()
    shared.setflags(write=False)
    if count < len(_SHARED_AND_VIEWS):
        return _SHARED_AND_VIEWS[count](shared)
    return [shared, *map(_VIEW, repeat(shared, count - 1))]


def _aliases(result: Any, inputs: Sequence[Any]) -> bool:
    """Whether ``result`` is one of ``inputs`` or a view of the same memory: whether
    it ends its chain of bases (``_owner``) where one of them does."""
    if result.base is None:
        # The usual case (a new array), kept cheap: it aliases an input that is it or
        # views it directly. One over it through a memoryview or another array's
        # buffer is not looked for: a function would have to reach outside its
        # arguments to hand back the array behind it.
        return any(result is array or result is array.base for array in inputs)
    owner = _owner(result)
    return any(owner is _owner(array) for array in inputs)


def _owner(array: Any) -> Any:
    """What holds ``array``'s memory: the end of its chain of bases. A NumPy or CuPy
    view names the array it views as ``base`` (NumPy skips views of views, but not
    an array over another's buffer: ``np.frombuffer(x)`` of an ``x`` that is itself
    over a buffer, such as scratch memory or a decoded request body, names ``x``),
    and a memoryview names what it views as ``obj``."""
    while True:
        base = array.obj if type(array) is memoryview else getattr(array, "base", None)
        if base is None or base is array:  # (an exporter whose "base" is itself)
            return array
        array = base


def _layout(
    leaves: Sequence[Any], shapes: Sequence[tuple] | None = None
) -> tuple[int, Callable[[Any], list]]:
    """How many elements ``leaves`` hold together, and a function cutting a flat
    array of that many into views shaped like them: worked out once for the flat
    results of every replica. ``shapes``: the leaves' shapes, when the caller has
    them (the signature of an all-reduce does)."""
    if shapes is None:
        shapes = tuple(map(_SHAPE, leaves))
    shape = shapes[0]
    if shape and shapes.count(shape) == len(shapes):
        # Leaves of one shape (not 0-d, which iteration would turn into scalars): the
        # rows of one reshape, made in C instead of a slice per leaf in Python.
        rows = (len(leaves), *shape)
        return math.prod(rows), lambda flat: list(flat.reshape(rows))
    cuts, offset = [], 0
    for leaf in leaves:
        cuts.append((offset, offset + leaf.size, None if leaf.ndim == 1 else leaf.shape))
        offset += leaf.size

    def split(flat: Any) -> list:
        return [
            flat[start:stop] if shape is None else flat[start:stop].reshape(shape)
            for start, stop, shape in cuts
        ]

    return offset, split


def _split(flat: Any, leaves: Sequence[Any]) -> list:
    """``flat`` cut into views shaped like ``leaves`` (whose sizes add up to it)."""
    return _layout(leaves)[1](flat)


def _pack_indices(
    arrays: Sequence[Any], bytes_per_pack: int, dtypes: Sequence[Any] | None = None
) -> list[list[int]]:
    """Group leaf indices into packs of one dtype, each about ``bytes_per_pack`` bytes.
    ``dtypes``: the arrays' dtypes, when the caller has them."""
    if not arrays:
        return []
    if not bytes_per_pack:
        if dtypes is None:
            dtypes = tuple(map(_DTYPE, arrays))
        if dtypes.count(dtypes[0]) == len(dtypes):
            # One dtype and no size limit (the usual case): one pack, without a Python
            # step per leaf (about 0.2 us per leaf saved on a list of small tensors).
            return [list(range(len(arrays)))]
    packs: dict[Any, list[list[int]]] = {}
    sizes: dict[Any, int] = {}
    for index, array in enumerate(arrays):
        groups = packs.setdefault(array.dtype, [[]])
        if bytes_per_pack and groups[-1] and sizes[array.dtype] + array.nbytes > bytes_per_pack:
            groups.append([])
            sizes[array.dtype] = 0
        groups[-1].append(index)
        sizes[array.dtype] = sizes.get(array.dtype, 0) + array.nbytes
    return [group for groups in packs.values() for group in groups]


_NO_REDUCTION = (
    "CrossDeviceOps is the base class, which implements no reduction; expected "
    "aiodist.ReductionToOneDevice() or aiodist.NcclAllReduce() (or a subclass that "
    "implements _reduce_arrays)."
)


class CrossDeviceOps:
    """Base class of the ways to reduce, broadcast and gather across devices.

    Subclasses implement ``_reduce_arrays(op, arrays, target)`` and may override
    the other primitives; the public coroutines are built on them. Every
    reduction goes through it: the replicas' ``all_reduce`` (a list of values
    packed into one flat array per replica), ``strategy.reduce`` and
    ``extended.reduce_to``. ``arrays`` holds one value per replica, all of one
    shape and dtype (NumPy arrays or NumPy scalars on CPU devices, CuPy arrays on
    GPUs, integers as they are for MEAN too); it returns ``op`` (a ``ReduceOp``:
    MEAN divides by ``len(arrays)``) applied across them element-wise, as a new
    array on ``target`` (results are shared: never one of the inputs).

    Examples:
        >>> import numpy as np
        >>> import aiodist
        >>> class Logged(aiodist.CrossDeviceOps):
        ...     def _reduce_arrays(self, op, arrays, target):
        ...         print(op.name, len(arrays), "values on", target)
        ...         total = getattr(np, op.ufunc).reduce(np.stack(arrays))
        ...         return np.asarray(total / len(arrays) if op.name == "MEAN" else total)
        >>> strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=Logged())
        >>> values = aiodist.PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
        >>> aiodist.run(strategy.reduce("mean", values))
        MEAN 2 values on /device:CPU:0
        array([2., 3.])
    """

    # Whether the replica-context collectives issue work on the replicas' own
    # streams (NCCL) rather than on cross streams bracketed by events.
    _on_replica_streams = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _check_devices(self, devices: Sequence[Device]) -> None:
        """Raise ``InvalidArgumentError`` if these ops cannot serve ``devices``."""
        # (Checked when a strategy is made: the base class itself was taken, and its
        # first collective raised a NotImplementedError with no message.)
        if type(self)._reduce_arrays is CrossDeviceOps._reduce_arrays:
            raise InvalidArgumentError(f"cross_device_ops={self!r}; {_NO_REDUCTION}")

    # -- primitives ----------------------------------------------------------------

    def _reduce_arrays(self, op: ReduceOp, arrays: Sequence[Any], target: Device) -> Any:
        # Reached only by calling reduce/batch_reduce on these ops directly (a strategy
        # refuses them, see _check_devices): the same error as a strategy's.
        raise InvalidArgumentError(f"{self!r} cannot reduce: {_NO_REDUCTION}")

    def _gather_device(self, destinations: Sequence[Device]) -> Device:
        return destinations[0]

    def _broadcast_array(self, array: Any, destinations: Sequence[Device]) -> list:
        """One handle on ``array`` per destination (read-only views on CPU devices)."""
        if type(array) is np.ndarray and _all_cpu(destinations):
            # Logical CPU devices share host memory: a read-only view each, no copy.
            return _host_views(array, len(destinations))
        out, given = [], False
        for device in destinations:
            backend = backend_for(device)
            placed = backend.asarray(array, device)
            # On GPUs the first destination on the array's device takes the array
            # itself and every other one gets memory of its own (CuPy arrays cannot
            # be made read-only, and replicas may update results in place); on the
            # host every destination gets a read-only view.
            if placed is array and (given or backend is cpu_backend):
                placed = backend.shared_view(array)
            given = given or placed is array
            out.append(placed)
        return out

    def _all_reduce_one(
        self,
        op: ReduceOp,
        arrays: Sequence[Any],
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any] = (),
    ) -> list:
        """All-reduce one array per replica (``arrays[r]``): each replica's result.

        The most common collective, so it skips the lists of leaves, unless a
        subclass does its own batched all-reduce (NCCL): that serves one array too.
        """
        if self._batches_its_own_way():
            per_replica = [[array] for array in arrays]
            out = self._all_reduce_flat(op, per_replica, devices, options, streams)
            return [leaves[0] for leaves in out]
        return self._reduce_and_broadcast(op, arrays, devices)

    def _reduce_and_broadcast(
        self, op: ReduceOp, arrays: Sequence[Any], devices: Sequence[Device]
    ) -> list:
        reduced = self._reduce_arrays(op, arrays, self._gather_device(devices))
        return self._broadcast_array(reduced, devices)

    def _all_reduce_laid_out(
        self,
        op: ReduceOp,
        per_replica: Sequence[Sequence[Any]],
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any],
        layout: tuple[Sequence[Any], Sequence[tuple]],
    ) -> list[list]:
        """``_all_reduce_flat`` for a caller that has the leaves' dtypes and shapes
        (``layout``): the packing one below uses them; a subclass's own
        ``_all_reduce_flat`` is called as always, without them."""
        if self._batches_its_own_way():
            return self._all_reduce_flat(op, per_replica, devices, options, streams)
        return self._all_reduce_flat(op, per_replica, devices, options, streams, layout)

    # Whether NumPy scalars on the host may be combined by scalar arithmetic
    # (``scalar_total``) instead of through ``_reduce_arrays``: only by
    # ``ReductionToOneDevice`` itself, with its default sum, reducing where the values
    # are (the replicas' all-reduce and ``strategy.reduce`` both read it). A flag kept
    # current by that class's setters, not a method: read on every scalar reduction,
    # a call there cost 1k instructions of a (c) step.
    _scalars_by_arithmetic = False

    def _batches_its_own_way(self) -> bool:
        """Whether a subclass overrides ``_all_reduce_flat`` (NCCL does) instead of
        using the packing one of this class."""
        return type(self)._all_reduce_flat is not CrossDeviceOps._all_reduce_flat

    def _all_reduce_flat(
        self,
        op: ReduceOp,
        per_replica: Sequence[Sequence[Any]],
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any] = (),
        layout: tuple[Sequence[Any], Sequence[tuple]] | None = None,
    ) -> list[list]:
        """All-reduce lists of leaves: ``per_replica[r][i]`` is replica r's leaf i.

        ``streams`` are the replicas' streams (used by ops that issue on them).
        ``layout``: the dtypes and shapes of the leaves, when the caller has them
        (an all-reduce's signature holds both); saves working them out again.
        """
        first = per_replica[0]
        if len(first) == 1:  # one array each: no packing
            arrays = [leaves[0] for leaves in per_replica]
            return [[result] for result in self._reduce_and_broadcast(op, arrays, devices)]
        out: list[list] = [[None] * len(first) for _ in per_replica]
        for pack, split, reduced in self._reduced_packs(op, per_replica, devices, options, layout):
            # Each replica's flat result (read-only views of one buffer on the host)
            # cut into its own views, shaped like the leaves.
            for replica, flat in enumerate(self._broadcast_array(reduced, devices)):
                if len(pack) == len(first):  # the usual case: one dtype, one pack
                    out[replica] = split(flat)
                else:
                    for index, piece in zip(pack, split(flat), strict=True):
                        out[replica][index] = piece
        return out

    def _reduced_packs(
        self,
        op: ReduceOp,
        per_replica: Sequence[Sequence[Any]],
        devices: Sequence[Device],
        options: CommunicationOptions,
        layout: tuple[Sequence[Any], Sequence[tuple]] | None = None,
    ) -> Iterator[tuple[list[int], Callable[[Any], list], Any]]:
        """The leaves packed (one dtype per pack, ``options.bytes_per_pack``) and each
        pack reduced across the replicas, one at a time: ``(pack, split, reduced)``,
        where ``pack`` holds the leaves' indices, ``reduced`` is the flat result on
        the reducing device and ``split(flat)`` cuts it into views shaped like them.
        """
        dtypes, shapes = (None, None) if layout is None else layout
        first = per_replica[0]
        target = self._gather_device(devices)
        backend = backend_for(target)
        xp = backend.xp
        if backend is not cpu_backend:  # packs are built on the device that reduces them
            per_replica = [[backend.asarray(a, target) for a in leaves] for leaves in per_replica]
        for pack in _pack_indices(first, options.bytes_per_pack, dtypes):
            whole = len(pack) == len(first)  # the usual case: one dtype, one pack
            size, split = _layout(first, shapes) if whole else _layout([first[i] for i in pack])
            if backend is cpu_backend:
                # Into this thread's reused scratch memory (see _host_reduce.pack).
                buffers = host_pack(
                    per_replica if whole else [[leaves[i] for i in pack] for leaves in per_replica],
                    size,
                    first[pack[0]].dtype,
                )
                reduced = self._reduce_arrays(op, buffers, target)
                if _aliases(reduced, buffers):  # scratch memory must not escape
                    reduced = reduced.copy()
                buffers = None  # the scratch is free again, for the next pack
            else:
                with backend.on_device(target):
                    buffers = [
                        xp.concatenate(leaves if whole else [leaves[i] for i in pack], axis=None)
                        for leaves in per_replica
                    ]
                reduced = self._reduce_arrays(op, buffers, target)
            yield pack, split, reduced

    def _all_gather_flat(
        self,
        per_replica: Sequence[Sequence[Any]],
        axis: int,
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any] = (),
    ) -> list[list]:
        target = self._gather_device(devices)
        backend = backend_for(target)
        out: list[list] = [[] for _ in per_replica]
        for index in range(len(per_replica[0])):
            parts = [backend.asarray(leaves[index], target) for leaves in per_replica]
            with backend.on_device(target):
                gathered = backend.xp.concatenate(parts, axis=axis)
            for replica, view in enumerate(self._broadcast_array(gathered, devices)):
                out[replica].append(view)
        return out

    # -- public API ------------------------------------------------------------------

    async def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduce ``per_replica_value`` to ``destinations``.

        Returns one array for a single destination, else a ``Mirrored`` with one
        component per destination. A value that is not distributed counts as
        one replica's value.
        """
        _context.require_cross_replica(None, "CrossDeviceOps.reduce")
        op = ReduceOp.of(reduce_op)
        _check_options(options, "reduce")
        devices = resolve_destinations(destinations)
        refuse_structure(per_replica_value, "CrossDeviceOps.reduce")
        arrays = _components(per_replica_value, "reduce")
        check_alike(op, arrays, "reduce")
        check_reducible(op, arrays[0], "reduce")  # one dtype: check_alike said so
        if self._gather_device(devices).kind == "CPU" and _any_on_gpu(arrays):
            arrays = await host_copies(arrays)  # combined on the host
        reduced = self._reduce_arrays(op, arrays, devices[0])
        if devices[0].kind == "CPU" and is_cupy_array(reduced):  # (reduce_to_device a GPU)
            (reduced,) = await host_copies([reduced])
        return self._deliver(reduced, devices)

    async def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None = None,
    ) -> list:
        """``reduce`` for each ``(value, destinations)`` pair; a list of results."""
        _context.require_cross_replica(None, "CrossDeviceOps.batch_reduce")
        _check_options(options, "batch_reduce")
        given = value_destination_pairs
        try:
            # A list first, as TF takes it: a generator checked below would be used up.
            pairs = None if isinstance(given, str | bytes) else list(given)
        except TypeError:  # not iterable
            pairs = None
        if pairs is None or not all(
            isinstance(pair, list | tuple) and len(pair) == 2 for pair in pairs
        ):
            raise InvalidArgumentError(
                f"value_destination_pairs={given!r}; expected a list of "
                "(value, destinations) pairs."
            )
        return [
            await self.reduce(reduce_op, value, destinations, options)
            for value, destinations in pairs
        ]

    async def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copy ``tensor`` to every device of ``destinations``."""
        _context.require_cross_replica(None, "CrossDeviceOps.broadcast")
        devices = resolve_destinations(destinations)
        refuse_structure(tensor, "broadcast")
        if isinstance(tensor, DistributedValues):
            raise InvalidArgumentError(
                f"broadcast: tensor is a {type(tensor).__name__}; expected a single array "
                "(reduce it first, or pick a component with experimental_local_results)."
            )
        copy = True  # the caller's array: its memory is never handed out
        if devices[0].kind == "CPU" and is_cupy_array(tensor):
            (tensor,) = await host_copies([tensor])
            copy = False  # a host copy of its own already
        # _deliver places it, and copies only what it got back as the caller's own.
        try:
            return self._deliver(tensor, devices, copy=copy)
        except ValueError:
            refuse_ragged([tensor], "broadcast")
            raise

    async def gather(
        self,
        per_replica_value: Any,
        destinations: Any,
        axis: int,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Concatenate the components of ``per_replica_value`` along ``axis``."""
        _context.require_cross_replica(None, "CrossDeviceOps.gather")
        _check_options(options, "gather")
        axis = as_axis(axis, "gather")  # (axis=None or "0" failed in a comparison)
        devices = resolve_destinations(destinations)
        refuse_structure(per_replica_value, "CrossDeviceOps.gather")
        arrays = _components(per_replica_value, "gather")
        _check_gatherable(arrays, axis, "gather")
        if devices[0].kind == "CPU" and _any_on_gpu(arrays):
            arrays = await host_copies(arrays)  # concatenated on the host
        backend = backend_for(devices[0])
        parts = [backend.asarray(array, devices[0]) for array in arrays]
        with backend.on_device(devices[0]):
            gathered = backend.xp.concatenate(parts, axis=axis)
        return self._deliver(gathered, devices)

    def _deliver(self, array: Any, devices: Sequence[Device], copy: bool = False) -> Any:
        """``array`` on ``devices``: one array, or a ``Mirrored`` of read-only views.

        ``copy``: ``array`` is the caller's, so never hand out its memory.
        """
        backend = backend_for(devices[0])
        placed = backend.asarray(array, devices[0])
        # Not only the caller's array itself: asarray of an ndarray subclass (np.memmap,
        # a masked array) or of an array-like exposing its buffer is a view of the
        # caller's memory too (its ``base`` is set).
        if copy and (placed is array or placed.base is not None):
            with backend.on_device(devices[0]):
                placed = placed.copy()
        if len(devices) == 1:
            return placed
        return Mirrored(self._broadcast_array(placed, devices), devices)


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every value to one device, combine them there, broadcast the result.

    Args:
        reduce_to_device: where values are combined (default: the first
            destination).
        accumulation_fn: ``fn(list_of_arrays) -> array`` used to add values for
            SUM and MEAN (default: element-wise addition); it must return an
            array of its inputs' shape and dtype (``InvalidArgumentError``
            otherwise, in every replica). MIN, MAX and PRODUCT always use their
            element-wise ufunc. Each input may be one replica's leaves packed into
            one flat array, and integers are passed to it for MEAN as float64.

    Works for any mix of CPU devices, and for several replicas on one device.
    Both settings may be changed later, by assigning the attributes.
    """

    _reduce_to_device: Device | None = None
    _accumulation_fn: Callable[[list], Any] | None = None

    def __init__(
        self,
        reduce_to_device: str | Device | None = None,
        accumulation_fn: Callable[[list], Any] | None = None,
    ):
        self.reduce_to_device = reduce_to_device  # (through the setters below)
        self.accumulation_fn = accumulation_fn

    @property
    def reduce_to_device(self) -> Device | None:
        """Where values are combined (None: the first destination)."""
        return self._reduce_to_device

    @reduce_to_device.setter
    def reduce_to_device(self, device: str | Device | None) -> None:
        self._reduce_to_device = None if device is None else parse_device(device)
        self._settings_changed()

    @property
    def accumulation_fn(self) -> Callable[[list], Any] | None:
        """What adds values for SUM and MEAN (None: element-wise addition)."""
        return self._accumulation_fn

    @accumulation_fn.setter
    def accumulation_fn(self, fn: Callable[[list], Any] | None) -> None:
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(
                f"accumulation_fn={fn!r} is not callable; expected a function "
                "taking a list of arrays and returning their element-wise sum, or None."
            )
        self._accumulation_fn = fn
        self._settings_changed()

    def _settings_changed(self) -> None:
        self._scalars_by_arithmetic = (
            type(self) is ReductionToOneDevice  # a subclass may reduce its own way
            and self._accumulation_fn is None
            and self._reduce_to_device is None
        )

    def __repr__(self) -> str:
        device = None if self._reduce_to_device is None else str(self._reduce_to_device)
        return f"ReductionToOneDevice(reduce_to_device={device!r})"

    def _gather_device(self, destinations: Sequence[Device]) -> Device:
        return self._reduce_to_device or destinations[0]

    # The last device tuple found to be all host devices (runs pass the same tuple).
    _host_devices: Sequence[Device] | None = None

    def _all_reduce_one(
        self,
        op: ReduceOp,
        arrays: Sequence[Any],
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any] = (),
    ) -> list:
        first = arrays[0]
        if (
            self._scalars_by_arithmetic
            and isinstance(first, _GENERIC)
            and (devices is self._host_devices or self._on_host(devices))
        ):
            # NumPy scalars on host replicas (a loss, a count of samples): what
            # _reduce_arrays and _broadcast_array do with them, without their device
            # and backend lookups. With scalar arithmetic (combine_scalars), about
            # 1 us instead of 4 for a float scalar all-reduce over four replicas.
            # scalar_total, prepared once per op and scalar type by scalar_totaller
            # (the builtin sum for a float sum: no call of operator.add per value, and
            # no Python call; (b), N = 4, uvloop: 170.5k -> 168.9k instructions per
            # step).
            # (Looked up here, a call less; made by scalar_totaller_for when new.)
            total = _SCALAR_TOTALS[op].get(type(first)) or scalar_totaller_for(op, type(first))
            total = total(arrays[1:], first)
            # count read-only 0-d views of the total. (Here, not in a function of its
            # own: a call less, 0.4k instructions of a (b) step.)
            count = len(devices)
            if isinstance(total, _GENERIC) and count < len(_SHARED_AND_VIEWS):
                # An array over an immutable scalar's buffer is read-only from the
                # start: about 0.5 us less than np.asarray(total) and _host_views'
                # setflags.
                return _SHARED_AND_VIEWS[count](_NDARRAY((), total.dtype, total))
            return _host_views(np.array(total, copy=True), count)
        return super()._all_reduce_one(op, arrays, devices, options, streams)

    def _on_host(self, devices: Sequence[Device]) -> bool:
        if _all_cpu(devices):
            self._host_devices = devices
            return True
        return False

    def _check_devices(self, devices: Sequence[Device]) -> None:
        target = self._reduce_to_device
        if target is not None and any(d.kind != target.kind for d in devices):
            raise InvalidArgumentError(
                f"ReductionToOneDevice(reduce_to_device={str(target)!r}) cannot serve "
                f"replicas on {[str(d) for d in devices]}: reducing on a {target.kind} "
                f"for replicas on another kind of device would wait for the GPU on the "
                "event loop; choose one of the replicas' devices."
            )

    def _reduce_arrays(self, op: ReduceOp, arrays: Sequence[Any], target: Device) -> Any:
        target = self._reduce_to_device or target
        backend = backend_for(target)
        xp = backend.xp
        if backend is cpu_backend:  # host arrays are already where they need to be
            values = arrays
        else:
            values = [backend.asarray(array, target) for array in arrays]
        if op.divides_by_count and values[0].dtype.kind in "iu":
            with backend.on_device(target):
                values = [mean_operand(value) for value in values]
        if self._accumulation_fn is not None and op in (ReduceOp.SUM, ReduceOp.MEAN):
            with backend.on_device(target):
                total = self._accumulated(self._accumulation_fn(values), values, backend, target)
                if _aliases(total, values):
                    # It handed back an input (or a view of one): MEAN would divide
                    # the replica's own value, and results would share its memory.
                    total = total.copy()
        elif backend is cpu_backend:
            total = host_combine(_NUMPY_UFUNCS[op], values)
        else:
            with backend.on_device(target):  # kernels run on the current device
                total = _combine_on_device(xp, op, values)
        if op.divides_by_count:
            with backend.on_device(target):
                total = mean_of_sum(xp, total, len(values))
        return total

    def _accumulated(self, result: Any, values: Sequence[Any], backend: Any, target: Device) -> Any:
        """``accumulation_fn``'s ``result`` for ``values`` as an array on ``target``;
        ``InvalidArgumentError`` unless it is an array of their shape and dtype.

        Batched leaves would be cut from a result of another shape silently, short
        or misplaced; one of another dtype would change the dtype every replica
        receives (all_reduce promises the values' own), and a packed batch would
        hand every leaf that dtype. A non-array (None, a list) would become an
        object or float64 array, or fail later in a way that names no function."""
        first = values[0]
        expected = f"{len(values)} values of shape {tuple(first.shape)} and dtype {first.dtype}"
        if not (hasattr(result, "dtype") and hasattr(result, "shape")):
            raise InvalidArgumentError(
                f"ReductionToOneDevice: accumulation_fn={self._accumulation_fn!r} returned "
                f"a value that is no array, {type(result).__name__} ({result!r:.80}), for "
                f"{expected}; expected their element-wise sum, an array of that same shape "
                "and dtype (np.add.reduce(values), or sum(values))."
            )
        total = backend.asarray(result, target)
        if total.shape != first.shape or total.dtype != first.dtype:
            raise InvalidArgumentError(
                f"ReductionToOneDevice: accumulation_fn={self._accumulation_fn!r} returned "
                f"a value of shape {tuple(total.shape)} and dtype {total.dtype} for "
                f"{expected}; expected their element-wise sum, an array of that same shape "
                "and dtype (where it computes in another dtype, cast its result back: "
                ".astype(values[0].dtype))."
            )
        return total


class NcclAllReduce(CrossDeviceOps):
    """All-reduce with NCCL across GPUs, each rank on its replica's own stream.

    Args:
        num_packs: how many NCCL calls a batch of values of one dtype is cut
            into (``CommunicationOptions(bytes_per_pack=...)`` takes precedence
            when set). 0 or 1: one call per dtype.

    Communicators are created once per tuple of devices and reused. Every
    multi-rank call is issued between ``groupStart()`` and ``groupEnd()``: one
    thread drives every GPU, and NCCL would otherwise wait forever for ranks
    that thread has not reached yet. ``all_gather`` goes through NCCL too
    (uneven lengths are padded); reductions in cross-replica context
    (``strategy.extended.reduce_to``) reduce on one device, as
    ``ReductionToOneDevice`` does, and broadcast with NCCL.

    Needs distinct GPU devices (one rank per GPU) and NCCL; the default for a
    ``MirroredStrategy`` over two or more distinct GPUs.
    """

    _on_replica_streams = True

    def __init__(self, num_packs: int = 1):
        self.num_packs = whole_number(num_packs, "NcclAllReduce: num_packs", 0)
        self._one_device = ReductionToOneDevice()

    def __repr__(self) -> str:
        return f"NcclAllReduce(num_packs={self.num_packs})"

    def _check_devices(self, devices: Sequence[Device]) -> None:
        if any(d.kind != "GPU" for d in devices):
            raise InvalidArgumentError(
                f"NcclAllReduce needs GPU devices, got {[str(d) for d in devices]}; use "
                "ReductionToOneDevice for CPU devices."
            )
        from . import _cuda

        _cuda.check_nccl_devices(devices)

    def _reduce_arrays(self, op: ReduceOp, arrays: Sequence[Any], target: Device) -> Any:
        return self._one_device._reduce_arrays(op, arrays, target)

    def _broadcast_array(self, array: Any, destinations: Sequence[Device]) -> list:
        if (
            len(destinations) < 2
            or len(set(destinations)) != len(destinations)
            or any(d.kind != "GPU" for d in destinations)
        ):
            return super()._broadcast_array(array, destinations)
        from . import _cuda

        backend = backend_for(destinations[0])
        return _cuda.broadcast(backend.asarray(array, destinations[0]), destinations, backend)

    def _all_reduce_flat(
        self,
        op: ReduceOp,
        per_replica: Sequence[Sequence[Any]],
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any] = (),
    ) -> list[list]:
        from . import _cuda

        return _cuda.all_reduce(
            op,
            per_replica,
            devices,
            streams,
            self.num_packs,
            options.bytes_per_pack,
            backend_for(devices[0]),
        )

    def _all_gather_flat(
        self,
        per_replica: Sequence[Sequence[Any]],
        axis: int,
        devices: Sequence[Device],
        options: CommunicationOptions,
        streams: Sequence[Any] = (),
    ) -> list[list]:
        from . import _cuda

        return _cuda.all_gather(per_replica, axis, devices, streams, backend_for(devices[0]))


def _check_options(options: Any, method: str) -> None:
    """Raise ``InvalidArgumentError`` unless ``options`` is None or a
    ``CommunicationOptions``: the cross-device ops' methods took anything and
    ignored it (a dict of fields, a string), where a strategy's calls refuse it."""
    if options is not None and type(options) is not CommunicationOptions:
        options_or_default(CommunicationOptions, options, f"CrossDeviceOps.{method}: options")


def _combine_on_device(xp: Any, op: ReduceOp, values: Sequence[Any]) -> Any:
    """``op`` across ``values`` with the array module's ufunc, into a new array."""
    if len(values) == 1:
        return values[0].copy()
    combine = getattr(xp, op.ufunc)
    total = xp.asarray(combine(values[0], values[1]))  # ufuncs give scalars for 0-d
    for value in values[2:]:
        combine(total, value, out=total)
    return total


def _any_on_gpu(arrays: Sequence[Any]) -> bool:
    """Whether any of ``arrays`` is a CuPy array (a test per type, not per array)."""
    return any(map(is_cupy_type, set(map(type, arrays))))


async def host_copies(arrays: Sequence[Any]) -> list:
    """``arrays`` with each CuPy array among them replaced by a host copy, for work done
    on a CPU device: NumPy refuses a CuPy array (TypeError: implicit conversion), and
    ``get()`` would wait for the GPU on the event loop. The copies are made in stream
    order on each GPU's current stream, while the loop keeps running."""
    on_gpu = [i for i, array in enumerate(arrays) if is_cupy_array(array)]
    backend = backend_for(Device("GPU", int(arrays[on_gpu[0]].device.id)))
    copies = await backend.to_host_async([arrays[i] for i in on_gpu])
    out = list(arrays)
    for i, copy in zip(on_gpu, copies, strict=True):
        out[i] = copy
    return out


def _components(value: Any, where: str) -> list:
    """The components of ``value`` as arrays on their devices (``where``: the call,
    named if one is no array)."""
    value = copies_of(value)  # (a variable: its copies, as in TF)
    if isinstance(value, DistributedValues):
        parts = list(value._values)
        devices = value._devices or (None,) * len(parts)
    else:
        parts, devices = [value], (None,)
    arrays = []
    try:
        for part, device in zip(parts, devices, strict=True):
            device = device or HOST
            arrays.append(backend_for(device).asarray(part, device))
    except ValueError:
        refuse_ragged(parts, where)
        raise
    return arrays


def _per_replica_text(arrays: Sequence[Any]) -> str:
    """``replica 0: float32[2]; replica 1: int32[2]``, for a message."""
    return "; ".join(f"replica {i}: {leaf_text(a)}" for i, a in enumerate(arrays))


def check_alike(
    op: ReduceOp, arrays: Sequence[Any], where: str, axes: tuple[int, ...] = ()
) -> None:
    """Raise ``InvalidArgumentError`` unless ``arrays`` share one dtype and one shape
    (``axes``, non-negative: shapes may differ along these, which are reduced), and
    ``op`` can reduce that dtype."""
    if axes:
        shapes = {tuple(n for i, n in enumerate(a.shape) if i not in axes) for a in arrays}
    else:  # one C-level pass, no Python step per array
        shapes = set(map(_SHAPE, arrays))
    if len(shapes) > 1 or len(set(map(_DTYPE, arrays))) > 1:
        # A part no dtype of the others' would make reducible (a Python int beyond 64
        # bits, which NumPy holds as dtype object, beside the others' int64) is named
        # for what it is, not as a dtype that differs.
        for replica, array in enumerate(arrays):
            check_reducible(op, array, f"{where} (replica {replica}'s value)")
        seen = _per_replica_text(arrays)
        hint = (
            f"shapes may differ only along the reduced axes {axes}"
            if axes
            else "to combine uneven batches, reduce with axis=0 (strategy.reduce) or gather them"
        )
        raise InvalidArgumentError(
            f"{where}: per-replica values differ in shape or dtype ({seen}); every replica "
            f"must hold the same dtype, and {hint}."
        )


def _check_gatherable(arrays: Sequence[Any], axis: int, where: str) -> None:
    first = arrays[0]
    along = gather_axis(first, axis, where)
    for array in arrays[1:]:
        gather_axis(array, axis, where)

    def others(a: Any) -> tuple:
        return tuple(n for i, n in enumerate(a.shape) if i != along), a.ndim

    # Dtypes apart: values of one shape and two dtypes were said to differ in shape.
    if any(a.dtype != first.dtype for a in arrays):
        seen = _per_replica_text(arrays)
        raise InvalidArgumentError(
            f"{where}: per-replica values differ in dtype ({seen}); every replica must "
            "hold the same dtype: cast them first, e.g. x.astype(np.float32)."
        )
    if any(others(a) != others(first) for a in arrays):
        seen = _per_replica_text(arrays)
        raise InvalidArgumentError(
            f"{where}: shapes may differ only along axis {axis}, but got {seen}."
        )
