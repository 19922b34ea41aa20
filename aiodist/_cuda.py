"""GPU devices through CuPy: a stream per replica, event ordering, awaiting the GPU.

This module imports CuPy, so nothing imports it until a GPU device is asked for
(``_backends.backend_for``). Three rules hold everything here together:

1. **Current device and stream are per thread in CuPy**, and every replica
   coroutine shares the loop's thread. ``activate`` / ``deactivate`` make a
   replica's device and stream current around each step of its coroutine
   (``_streams.step_through``) and restore what was current before, so no other
   task ever runs on a replica's stream.
2. **Ordering is expressed with CUDA events, never with host synchronisation.**
   Cross-replica work runs on one *cross stream* per device. Before it starts,
   every cross stream waits on an event recorded on every replica stream
   (``begin_cross_replica``); after it is issued, every replica stream waits on
   an event recorded on every cross stream (``end_cross_replica``). Work that
   passes between the devices' current streams and the replica streams (a run's
   start and end, input shards, cross-replica calls outside a run, variable
   writes, ``extended.update``) is ordered the same way, by
   ``order_replicas_after`` / ``order_after_replicas``: replica streams are
   non-blocking, so nothing else orders them against the default stream.
   Nothing here blocks the event loop: the host only *issues* work.
3. **Waiting for the GPU from async code polls an event from the loop**
   (``wait_event``): ``cudaEventQuery`` with a growing pause (``_poll``), never a host
   callback on the driver's thread, and never ``Event.done``, which reports a
   device error as "not done" forever. An error status raises.

CuPy's memory pool keeps one arena per stream: memory freed by a replica is
reused only by later work on that replica's stream, which the events above
order after any cross-replica work still reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import cupy
import cupyx
import numpy as np
from cupy.cuda import runtime

from . import _poll
from ._devices import Device
from ._errors import DeviceError, InvalidArgumentError
from ._ops import ReduceOp

__all__ = ["GpuBackend", "nccl_version", "wait_event"]

# cudaEventQuery's "not ready" status (cudaErrorNotReady; HIP uses the same value).
_NOT_READY = 600


def _event_on(stream: Any, index: int) -> Any:
    """A timing-free event recorded on ``stream`` (of device ``index``).

    An event must be created on its stream's device; the current device is
    switched only when it differs, and restored.
    """
    current = runtime.getDevice()
    if current != index:
        runtime.setDevice(index)
    try:
        event = cupy.cuda.Event(disable_timing=True)
        event.record(stream)
    finally:
        if current != index:
            runtime.setDevice(current)
    return event


def _wait_on(stream: Any, index: int, events: Sequence[Any]) -> None:
    """Make ``stream`` (of device ``index``) wait for ``events``.

    The device is made current first: the null stream's handle (0) means the
    default stream of whichever device is current.
    """
    current = runtime.getDevice()
    if current != index:
        runtime.setDevice(index)
    try:
        for event in events:
            stream.wait_event(event)
    finally:
        if current != index:
            runtime.setDevice(current)


async def wait_event(event: Any) -> None:
    """Return once ``event`` has completed, without blocking the event loop.

    Raises the CUDA error (``CUDARuntimeError``) if the device reports one.
    """

    def done() -> bool:
        status = runtime.eventQuery(event.ptr)
        if status not in (0, _NOT_READY):
            runtime.check_status(status)  # raises CUDARuntimeError naming the error
        return status == 0

    await _poll.until(done)


class GpuBackend:
    """GPU devices holding CuPy arrays; one non-blocking stream per replica."""

    kind = "GPU"
    xp = cupy
    # None: CuPy arrays may live on another GPU, so every value a replica passes to
    # a collective goes through asarray (which returns it when already in place).
    array_type = None
    needs_activation = True

    def __init__(self) -> None:
        self.count = int(runtime.getDeviceCount())
        # Cross streams per group of replica streams (one strategy's replicas) and
        # device: a cross stream only ever waits for its own replicas, so memory one
        # strategy's replicas may still be reading is never reused by another's work.
        self._cross_streams: dict[tuple, Any] = {}
        # Host copies whose awaiting was cancelled: kept alive until their copy is done.
        self._orphans: list[tuple[Any, Any]] = []

    def check(self, device: Device) -> None:
        if device.index >= self.count:
            gpus = ", ".join(f"'GPU:{i}'" for i in range(self.count)) or "none"
            raise DeviceError(
                f"device {str(device)!r} does not exist: CuPy sees {self.count} GPU(s) "
                f"({gpus}). Available here: those GPUs and CPU devices (e.g. 'cpu:0')."
            )

    def new_stream(self, device: Device) -> Any:
        with cupy.cuda.Device(device.index):
            return cupy.cuda.Stream(non_blocking=True)

    # -- a replica's step ------------------------------------------------------------

    def activate(self, device: Device, stream: Any) -> tuple:
        """Make ``device`` and ``stream`` current; the token restores what was."""
        index = device.index
        previous_device = runtime.getDevice()
        if previous_device != index:
            runtime.setDevice(index)
        previous_stream = cupy.cuda.get_current_stream(index)
        stream.use()
        return previous_device, index, previous_stream

    @contextlib.contextmanager
    def on_stream(self, device: Device, stream: Any) -> Iterator[None]:
        """``activate``/``deactivate`` around one synchronous stretch of work."""
        token = self.activate(device, stream)
        try:
            yield
        finally:
            self.deactivate(token)

    def deactivate(self, token: tuple) -> None:
        previous_device, index, previous_stream = token
        # Stream.use() needs its own device current; the step may have left
        # another one current (against the documented rule), so set it again.
        if runtime.getDevice() != index:
            runtime.setDevice(index)
        previous_stream.use()
        if previous_device != index:
            runtime.setDevice(previous_device)

    # -- cross-replica work ----------------------------------------------------------

    def cross_stream(self, slots: Sequence[Any], index: int) -> Any:
        """The stream cross-replica work of ``slots``' replicas uses on device ``index``."""
        key = (*(id(slot.stream) for slot in slots), index)
        entry = self._cross_streams.get(key)
        if entry is None:
            with cupy.cuda.Device(index):
                stream = cupy.cuda.Stream(non_blocking=True)
            # The replica streams are kept with it, so their ids stay theirs.
            entry = self._cross_streams[key] = (stream, [slot.stream for slot in slots])
        return entry[0]

    def begin_cross_replica(self, slots: Sequence[Any], first: Device | None = None) -> tuple:
        """Order every device's cross stream after the work queued on every replica
        stream. Returns the token for the other hooks: the cross streams by device
        (``first``, the device that will do the work, leads)."""
        indices = dict.fromkeys(
            ([first.index] if first is not None and first.kind == "GPU" else [])
            + [slot.device.index for slot in slots]
        )
        events = [_event_on(slot.stream, slot.device.index) for slot in slots]
        order = tuple((index, self.cross_stream(slots, index)) for index in indices)
        for index, stream in order:
            _wait_on(stream, index, events)
        return order

    def enter_cross_replica(self, order: tuple) -> tuple:
        """Make each device's cross stream current, and the first one's device the
        current device; the token restores what was current."""
        previous_device = runtime.getDevice()
        saved = []
        for index, stream in order:
            runtime.setDevice(index)
            saved.append((index, cupy.cuda.get_current_stream(index)))
            stream.use()
        runtime.setDevice(order[0][0])
        return previous_device, saved

    def leave_cross_replica(self, token: tuple) -> None:
        previous_device, saved = token
        for index, stream in saved:
            runtime.setDevice(index)
            stream.use()
        runtime.setDevice(previous_device)

    def end_cross_replica(self, order: tuple, slots: Sequence[Any]) -> None:
        """Order every replica stream's later work after the cross-replica work
        issued on the cross streams."""
        events = [_event_on(stream, index) for index, stream in order]
        for slot in slots:
            _wait_on(slot.stream, slot.device.index, events)

    def on_device(self, device: Device) -> Any:
        """A context manager making ``device`` current (for one synchronous stretch)."""
        return cupy.cuda.Device(device.index)

    # -- placing arrays ----------------------------------------------------------------

    def asarray(self, value: object, device: Device) -> Any:
        """``value`` on ``device``: itself when already there, else a copy issued on
        the destination's current stream, ordered after the source's."""
        index = device.index
        if isinstance(value, cupy.ndarray):
            source = value.device.id
            if source == index:
                return value
            return self._copy_between(value, source, index)
        with cupy.cuda.Device(index):
            return cupy.asarray(value)

    def _copy_between(self, array: Any, source: int, target: int) -> Any:
        # The copy waits for the work queued on the source device's current
        # stream (which produced `array`), and that stream waits for the copy
        # before it may reuse `array`'s memory. A non-contiguous array is made
        # contiguous on the source first, before the event, so the copy sees it.
        source_stream = cupy.cuda.get_current_stream(source)
        with cupy.cuda.Device(source):
            array = cupy.ascontiguousarray(array)
        produced = _event_on(source_stream, source)
        with cupy.cuda.Device(target):
            target_stream = cupy.cuda.get_current_stream(target)
            target_stream.wait_event(produced)
            copy = array.copy()
        _wait_on(source_stream, source, [_event_on(target_stream, target)])
        return copy

    async def to_host_async(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """``arrays`` copied to pinned host memory, each on its device's current
        stream; the loop keeps running while the copies are in flight."""
        copies, events = [], []
        previous = runtime.getDevice()
        try:
            for array in arrays:
                index = array.device.id
                runtime.setDevice(index)
                stream = cupy.cuda.get_current_stream(index)
                array = cupy.ascontiguousarray(array)
                copy = cupyx.empty_pinned(array.shape, array.dtype)
                array.get(stream=stream, out=copy, blocking=False)
                copies.append(copy)
                events.append(_event_on(stream, index))
        finally:
            runtime.setDevice(previous)
        self._orphans = [o for o in self._orphans if runtime.eventQuery(o[1].ptr) == _NOT_READY]
        try:
            for event in events:
                await wait_event(event)
        except asyncio.CancelledError:
            # The copies may still be writing into the pinned buffers: keep them.
            self._orphans.extend(zip(copies, events, strict=True))
            raise
        return copies

    async def streams_ready(self, indices: Any) -> None:
        """Wait for the work queued so far on the current stream of each device in
        ``indices`` (the current device when empty)."""
        events = [
            _event_on(cupy.cuda.get_current_stream(index), index)
            for index in (indices or (runtime.getDevice(),))
        ]
        for event in events:
            await wait_event(event)

    def order_after_replicas(self, slots: Sequence[Any]) -> None:
        """Make the current stream of every replica device wait for the work queued
        so far on every replica stream (cross-replica code outside a collective)."""
        events = [_event_on(slot.stream, slot.device.index) for slot in slots]
        for index in dict.fromkeys(slot.device.index for slot in slots):
            _wait_on(cupy.cuda.get_current_stream(index), index, events)

    def order_replicas_after(self, slots: Sequence[Any]) -> None:
        """Make every replica stream's later work wait for the work queued so far on
        the current streams of the replica devices."""
        events = [
            _event_on(cupy.cuda.get_current_stream(index), index)
            for index in dict.fromkeys(slot.device.index for slot in slots)
        ]
        for slot in slots:
            _wait_on(slot.stream, slot.device.index, events)

    def shared_view(self, array: Any) -> Any:
        """Another replica's handle on a result: a copy on GPUs, issued on the current
        stream. CuPy has no read-only flag, so a shared buffer could be changed by
        one replica under another (on another stream: a race as well)."""
        with cupy.cuda.Device(array.device.id):  # copy() copies to the current device
            return array.copy()


# -- NCCL ------------------------------------------------------------------------------


def nccl_version() -> int | None:
    """NCCL's version as an int (2.30.3 → 23003), or None when NCCL cannot be loaded."""
    try:
        # CuPy warns (UserWarning) when NCCL's library is missing; under warnings as
        # errors (pytest's filterwarnings = error) that warning would escape this
        # function instead of giving None. None says the same thing here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except ImportError:
        return None
    if not nccl.available:
        return None
    return int(nccl.get_version())


def _nccl() -> Any:
    from cupy.cuda import nccl

    return nccl


_communicators: dict[tuple, list] = {}  # by devices, or by (uid, ranks, first, devices)


def communicators(indices: tuple[int, ...]) -> list:
    """One NCCL communicator per rank over devices ``indices``, created once
    (``NcclCommunicator.initAll``) and reused for every later call."""
    comms = _communicators.get(indices)
    if comms is None:
        comms = _communicators[indices] = _nccl().NcclCommunicator.initAll(list(indices))
    return comms


def unique_id() -> bytes:
    """A new NCCL unique id (``NCCL_UNIQUE_ID_BYTES`` = 128 bytes), made by the
    process that will send it to the others. CuPy 14 gives bytes; CuPy 13 a
    tuple of signed chars."""
    made = _nccl().get_unique_id()
    if isinstance(made, bytes):
        return made
    return bytes(b & 0xFF for b in made)


def _comm_id(uid: bytes, signed: bool = True) -> Any:
    """``uid`` as this CuPy's ``NcclCommunicator`` takes it: bytes from CuPy 14 on,
    before that a tuple of C ``char`` values: ``signed`` (-128..127, as on x86-64)
    or not (0..255, as on aarch64, where ``char`` is unsigned)."""
    if int(cupy.__version__.split(".")[0]) >= 14:
        return uid
    if not signed:
        return tuple(uid)
    return tuple(b - 256 if b > 127 else b for b in uid)


def _new_rank(nccl: Any, total: int, uid: bytes, rank: int) -> Any:
    """``NcclCommunicator(total, uid, rank)``, with ``uid`` in the form this CuPy takes.

    CuPy 13 copies the id into a C ``char`` array, whose signedness is the
    platform's: Cython refuses -128..-1 where ``char`` is unsigned (aarch64, Grace
    Hopper) with ``OverflowError``, before NCCL is called, so the unsigned form is
    tried then (values above 127 are refused the same way on x86-64)."""
    try:
        return nccl.NcclCommunicator(total, _comm_id(uid), rank)
    except OverflowError:
        return nccl.NcclCommunicator(total, _comm_id(uid, signed=False), rank)


def gpu_identities(indices: tuple[int, ...]) -> list[str]:
    """``host/PCI bus id`` of each GPU: the same GPU gives the same string in every
    process of one host, whatever ``CUDA_VISIBLE_DEVICES`` numbers it."""
    host = socket.gethostname()
    return [f"{host}/{cupy.cuda.Device(index).pci_bus_id}" for index in indices]


def world_communicators(uid: bytes, total: int, first_rank: int, indices: tuple[int, ...]) -> list:
    """This process's ranks of one NCCL communicator spanning several processes:
    rank ``first_rank + i`` on GPU ``indices[i]``, ``total`` ranks in all.

    Every process calls this with the same ``uid`` at the same point. The ranks
    are created between ``groupStart()`` and ``groupEnd()``: one thread creates
    several, and each creation waits for every other rank until the group ends.
    """
    key = (uid, total, first_rank, indices)
    comms = _communicators.get(key)
    if comms is None:
        nccl = _nccl()
        comms = []
        nccl.groupStart()
        try:
            for i, index in enumerate(indices):
                with cupy.cuda.Device(index):  # a rank belongs to the current device
                    comms.append(_new_rank(nccl, total, uid, first_rank + i))
        finally:
            nccl.groupEnd()
        _communicators[key] = comms
    return comms


def check_nccl_devices(devices: Sequence[Device]) -> None:
    """Raise ``InvalidArgumentError`` when NCCL cannot serve ``devices`` (GPUs)."""
    names = [str(d) for d in devices]
    version = nccl_version()
    if version is None:
        raise InvalidArgumentError(
            "NcclAllReduce: NCCL cannot be loaded here; install it (pip install "
            "'nvidia-nccl-cu12' or 'nvidia-nccl-cu13', matching CuPy) or use "
            "ReductionToOneDevice."
        )
    if len(set(devices)) != len(devices) and not multi_rank_per_gpu(version):
        raise InvalidArgumentError(
            f"NcclAllReduce: devices {names} list a GPU more than once, and NCCL "
            "serves one rank per GPU; use ReductionToOneDevice for several replicas "
            "on one GPU (or, with NCCL >= 2.30, set NCCL_MULTI_RANK_GPU_ENABLE=1)."
        )


def multi_rank_per_gpu(version: int | None) -> bool:
    """Whether NCCL may put several ranks on one GPU (NCCL >= 2.30, opted in)."""
    return (
        version is not None
        and version >= 23000
        and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
    )


# NumPy dtype → NCCL datatype, and the dtype a value travels as when NCCL has no
# type of its own for it (bool as uint8: MIN/MAX of 0/1 are AND/OR; 16-bit
# integers widened and narrowed back, which wraps the same way; complex as
# pairs of floats, exact for SUM and MEAN).
_NCCL_NAMES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_WIDENED = {"bool": "uint8", "int16": "int32", "uint16": "uint32"}
_COMPLEX_AS = {"complex64": "float32", "complex128": "float64"}


def travel_dtype(op: ReduceOp, dtype: np.dtype) -> np.dtype:
    """The dtype a leaf of ``dtype`` is all-reduced as by NCCL."""
    name = dtype.name
    if op is ReduceOp.MEAN and dtype.kind in "iu":
        return np.dtype("float64")  # summed as float64, as NumPy's mean (and the CPU path)
    if name in _NCCL_NAMES:
        return dtype
    if name in _WIDENED:
        return np.dtype(_WIDENED[name])
    if name in _COMPLEX_AS:
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            return np.dtype(_COMPLEX_AS[name])
        raise InvalidArgumentError(
            f"NcclAllReduce cannot {op.name} complex values ({name}): NCCL has no "
            "complex type; use SUM or MEAN, or ReductionToOneDevice."
        )
    raise InvalidArgumentError(
        f"NcclAllReduce cannot reduce values of dtype {name}; expected one of "
        f"{', '.join(sorted({*_NCCL_NAMES, *_WIDENED, *_COMPLEX_AS}))}, or use "
        "ReductionToOneDevice."
    )


def _as_travel(leaf: Any, travel: np.dtype) -> Any:
    """``leaf`` flattened, as ``travel`` values (a view when only reinterpreted)."""
    flat = cupy.ascontiguousarray(leaf).reshape(-1)
    if flat.dtype == travel:
        return flat
    if flat.dtype.kind == "c":
        return flat.view(travel)  # (re, im) pairs
    return flat.astype(travel)


def _pack_spans(sizes: Sequence[int], num_packs: int, bytes_per_pack: int, itemsize: int) -> list:
    """``(start, stop)`` element ranges cutting a buffer of ``sum(sizes)`` elements
    into packs: ``bytes_per_pack`` bytes each when set, else ``num_packs`` equal
    parts (at least one element each)."""
    total = sum(sizes)
    if total == 0:
        return []
    if bytes_per_pack > 0:
        per = max(1, bytes_per_pack // itemsize)
    else:
        per = -(-total // max(1, num_packs))
    return [(lo, min(lo + per, total)) for lo in range(0, total, per)]


def all_reduce(
    op: ReduceOp,
    per_replica: Sequence[Sequence[Any]],
    devices: Sequence[Device],
    streams: Sequence[Any],
    num_packs: int,
    bytes_per_pack: int,
    backend: GpuBackend,
    comms: list | None = None,
    count: int | None = None,
) -> list[list]:
    """All-reduce lists of leaves with NCCL, each rank on its replica's stream.

    Leaves are grouped by the dtype they travel as; each group is packed into
    one buffer per replica (no copy for a single contiguous leaf), cut into
    packs, and each pack is one ``groupStart()/groupEnd()`` call over every
    rank of this process. Results are views into each replica's reduced buffer.

    ``comms`` (this process's ranks) and ``count`` (every process's replicas,
    for MEAN) are given when the communicator spans several processes; by
    default it is this process's devices alone.
    """
    nccl = _nccl()
    n = len(per_replica)
    if comms is None:
        comms = communicators(tuple(d.index for d in devices))
    first = per_replica[0]
    # Complex leaves get packs of their own: a complex value viewed in a float
    # buffer must start on a whole complex element (CuPy's kernels assume it).
    groups: dict[tuple, list[int]] = {}
    for index, leaf in enumerate(first):
        key = (travel_dtype(op, leaf.dtype), leaf.dtype.kind == "c")
        groups.setdefault(key, []).append(index)
    out: list[list] = [[None] * len(first) for _ in range(n)]
    nccl_op = getattr(nccl, op.nccl_op)  # MEAN: NCCL_SUM, then divided on each stream
    for (travel, _), members in groups.items():
        datatype = getattr(nccl, _NCCL_NAMES[travel.name])
        sends, buffers = [], []
        for rank in range(n):
            with backend.on_stream(devices[rank], streams[rank]):
                flats = [_as_travel(per_replica[rank][i], travel) for i in members]
                if len(flats) > 1:  # packed into a fresh buffer, reduced in place
                    send = buffer = cupy.concatenate(flats)
                else:  # a lone leaf may be the caller's own memory: reduce into a new one
                    send, buffer = flats[0], cupy.empty_like(flats[0])
                sends.append(send)
                buffers.append(buffer)
        sizes = [_travel_size(first[i], travel) for i in members]
        step = travel.itemsize
        for lo, hi in _pack_spans(sizes, num_packs, bytes_per_pack, step):
            nccl.groupStart()
            try:
                for rank in range(n):
                    comms[rank].allReduce(
                        sends[rank].data.ptr + lo * step,
                        buffers[rank].data.ptr + lo * step,
                        hi - lo,
                        datatype,
                        nccl_op,
                        streams[rank].ptr,
                    )
            finally:
                nccl.groupEnd()
        for rank in range(n):
            with backend.on_stream(devices[rank], streams[rank]):
                leaves = [first[i] for i in members]
                _unpack(op, count or n, buffers[rank], leaves, travel, members, out[rank])
    return out


def _travel_size(leaf: Any, travel: np.dtype) -> int:
    return leaf.size * (2 if leaf.dtype.kind == "c" else 1)


def _unpack(
    op: ReduceOp,
    n: int,
    buffer: Any,
    leaves: Sequence[Any],
    travel: np.dtype,
    members: Sequence[int],
    out: list,
) -> None:
    """Split a reduced buffer back into leaves of the original shapes and dtypes."""
    if op is ReduceOp.MEAN and travel.kind in "fc":
        buffer /= n
    offset = 0
    for index, leaf in zip(members, leaves, strict=True):
        size = _travel_size(leaf, travel)
        piece = buffer[offset : offset + size]
        offset += size
        if leaf.dtype.kind == "c":
            piece = piece.view(leaf.dtype)
        elif piece.dtype != leaf.dtype and not (op is ReduceOp.MEAN and leaf.dtype.kind in "iu"):
            piece = piece.astype(leaf.dtype)  # (the MEAN of integers stays float64)
        out[index] = piece.reshape(leaf.shape)


def all_gather(
    per_replica: Sequence[Sequence[Any]],
    axis: int,
    devices: Sequence[Device],
    streams: Sequence[Any],
    backend: GpuBackend,
    comms: list | None = None,
    lengths_by_leaf: Sequence[Sequence[int]] | None = None,
) -> list[list]:
    """Concatenate each leaf across replicas along ``axis`` with NCCL ``allGather``.

    Every dtype travels as bytes. Leaves whose lengths along ``axis`` differ are
    padded to the longest first, and the padding is cut away after.

    ``comms`` (this process's ranks) and ``lengths_by_leaf[i]`` (leaf ``i``'s
    length along ``axis`` on every rank of every process) are given when the
    communicator spans several processes.
    """
    nccl = _nccl()
    n = len(per_replica)
    if comms is None:
        comms = communicators(tuple(d.index for d in devices))
    out: list[list] = [[] for _ in range(n)]
    for index in range(len(per_replica[0])):
        leaves = [per_replica[rank][index] for rank in range(n)]
        local = [leaf.shape[axis] for leaf in leaves]
        lengths = local if lengths_by_leaf is None else list(lengths_by_leaf[index])
        longest = max(lengths)
        shape = list(leaves[0].shape)
        shape[axis] = longest
        sends, receives = [], []
        for rank in range(n):
            with backend.on_stream(devices[rank], streams[rank]):
                leaf = leaves[rank]
                if local[rank] != longest:
                    padded = cupy.zeros(shape, leaf.dtype)
                    where = [slice(None)] * leaf.ndim
                    where[axis] = slice(0, local[rank])
                    padded[tuple(where)] = leaf
                    leaf = padded
                sends.append(cupy.ascontiguousarray(leaf))
                receives.append(cupy.empty((len(lengths), *shape), leaf.dtype))
        nbytes = sends[0].nbytes
        if nbytes:  # (nothing to move for empty values: NCCL rejects null buffers)
            _all_gather_call(nccl, comms, sends, receives, nbytes, streams)
        for rank in range(n):
            with backend.on_stream(devices[rank], streams[rank]):
                out[rank].append(_gathered(receives[rank], lengths, axis, shape))
    return out


def _all_gather_call(
    nccl: Any, comms: list, sends: list, receives: list, nbytes: int, streams: Sequence[Any]
) -> None:
    """One grouped NCCL allGather of ``nbytes`` bytes per rank."""
    nccl.groupStart()
    try:
        for rank, comm in enumerate(comms):
            comm.allGather(
                sends[rank].data.ptr,
                receives[rank].data.ptr,
                nbytes,
                nccl.NCCL_UINT8,
                streams[rank].ptr,
            )
    finally:
        nccl.groupEnd()


def _gathered(stacked: Any, lengths: Sequence[int], axis: int, shape: Sequence[int]) -> Any:
    """The concatenation along ``axis`` of the ``n`` padded parts in ``stacked``."""
    n = len(lengths)
    if axis == 0 and len(set(lengths)) == 1:  # allGather's layout already is the result
        return stacked.reshape((n * shape[0], *shape[1:]))
    parts = []
    for source in range(n):
        where = [slice(None)] * len(shape)
        where[axis] = slice(0, lengths[source])
        parts.append(stacked[source][tuple(where)])
    return cupy.concatenate(parts, axis=axis)


# The most bytes one ``bcast`` call is given. CuPy releases before cupy/cupy#8562
# (August 2024; 13.0 among them, which the cuda12 extra allows) declare its count a C
# ``int`` (``bcast(self, intptr_t buff, int count, ...)``), so a buffer over 2 GiB
# raised OverflowError there; later ones take a ``size_t``. Larger buffers are sent
# in parts of this size (a power of two, so every part starts aligned).
_BCAST_MAX_BYTES = 1 << 30


def broadcast(
    array: Any, devices: Sequence[Device], backend: GpuBackend, part_bytes: int = _BCAST_MAX_BYTES
) -> list:
    """``array`` (on ``devices[0]``) copied to every device of ``devices`` with one
    NCCL group of broadcasts (one per ``part_bytes`` bytes), each rank on its
    device's current stream."""
    nccl = _nccl()
    comms = communicators(tuple(d.index for d in devices))
    with cupy.cuda.Device(devices[0].index):  # rank 0's buffer on rank 0's device
        buffers = [cupy.ascontiguousarray(array).copy()]
    for device in devices[1:]:
        with cupy.cuda.Device(device.index):
            buffers.append(cupy.empty(array.shape, array.dtype))
    if buffers[0].nbytes == 0:  # NCCL rejects null buffers; nothing to send
        return buffers
    nbytes = buffers[0].nbytes
    nccl.groupStart()
    try:
        for rank, (comm, buffer) in enumerate(zip(comms, buffers, strict=True)):
            stream = cupy.cuda.get_current_stream(devices[rank].index)
            for lo in range(0, nbytes, part_bytes):
                count = min(part_bytes, nbytes - lo)
                comm.bcast(buffer.data.ptr + lo, count, nccl.NCCL_UINT8, 0, stream.ptr)
    finally:
        nccl.groupEnd()
    return buffers
