"""Element-wise reduction of large host arrays: all cores, cache blocks, reused buffers.

``combine(ufunc, arrays)`` is what ``ReductionToOneDevice`` uses on CPU devices.
Small inputs take the plain path (one ufunc call per input). Larger ones
(``POOL_MIN_BYTES`` and up, C-contiguous, one dtype) are reduced block by block
(``BLOCK_BYTES`` each), so the partial result stays in cache while the N inputs
stream through it. From ``PARALLEL_MIN_BYTES`` on, the work is split into one
slice per core: NumPy releases the GIL inside each ufunc call, so the slices
run in parallel; the caller's thread takes the first slice, a process-wide
thread pool the rest (the caller all of them once Python, shutting down, has
stopped the pool: an event loop in another thread may outlive the main thread).

The result of a large reduction goes into a buffer taken from a small pool.
Collective results are read-only views of that buffer; a buffer is reused only
when no view of it is alive any more (CPython's reference count says so), so a
result a user still holds never changes. This saves the page faults of a fresh
allocation on every step: the C allocator gives large freed blocks back to the
system and faults them in again (measured here: a 100 x 1 KiB batched
all-reduce took 300 or 460 us per step depending on where the heap happened to
end, before its buffers were reused). The pool keeps about ``RESULTS_MAX_BYTES``
per thread, forgetting the shapes used least recently first, so a stream of new
shapes (variable-length batches) does not keep a buffer for each of them.

``pack`` packs lists of leaves into scratch memory before they are reduced; the
packed arrays never leave the reduction, so that memory is reused from call to
call (never while an array made from it is still alive).

Pools are per thread: a strategy may run on event loops in several threads.
"""

from __future__ import annotations

import contextvars
import io
import operator
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial, reduce
from typing import Any

import numpy as np

__all__ = [
    "BLOCK_BYTES",
    "PARALLEL_MIN_BYTES",
    "POOL_MIN_BYTES",
    "RESULTS_MAX_BYTES",
    "combine",
    "combine_scalars",
    "pack",
    "scalar_total",
]

POOL_MIN_BYTES = 1 << 16  # from here, results go to pooled buffers, reduced in blocks
SCRATCH_MAX_BYTES = 1 << 26  # pack buffers kept per thread, at most
# Result buffers kept per thread, at most (beyond the shape just used): without a
# bound, every new shape (a variable-length batch) added buffers kept forever.
RESULTS_MAX_BYTES = 1 << 28
PARALLEL_MIN_BYTES = 1 << 22  # from here, several cores (below, threads cost more)
# Bytes per block: the size of one core's L2 cache on the 2-core machine of the
# benchmarks (AMD EPYC, 1 MiB each, with 32 MiB of L3 behind them). Measured there,
# combine() of four replicas' 64 MiB of float32: 11.0-11.4 ms with 1 MiB blocks,
# 11.5-12.6 ms with the 128 KiB blocks used before (more ufunc calls), 17.5 ms
# without blocks (the partial result read and written from memory per input);
# blocks of 512 KiB to 2 MiB were within noise of each other (median of 5 rounds).
# On the parallel path a block is at most one worker's share (see combine).
BLOCK_BYTES = 1 << 20
_WORKERS = max(1, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None


_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="aiodist-reduce")
        return _pool


def _forget_pool_after_fork() -> None:
    """A forked child has the pool object but none of its threads: start afresh."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _unreferenced_count() -> int:
    """What ``sys.getrefcount`` gives, in ``_Buffers.take``'s loop, for a buffer that
    only its bucket holds: measured with the same pattern, not assumed (3 through
    Python 3.13: the bucket, the loop variable, the call's argument; later versions
    may not count a local variable's reference, gh-130704)."""
    bucket = [np.empty(0)]
    for buffer in bucket:
        return sys.getrefcount(buffer)
    raise AssertionError("unreachable")


_UNREFERENCED = _unreferenced_count()


class _Buffers:
    """Result buffers by (shape, dtype), reused once nothing refers to them.

    At most ``per_key`` buffers per key, and about ``max_bytes`` in all: past that,
    the keys used least recently are forgotten (their buffers live on only in the
    results that still hold them), except the one just used.
    """

    def __init__(self, per_key: int = 2, max_bytes: int = RESULTS_MAX_BYTES):
        self._per_key = per_key
        self._max_bytes = max_bytes
        self._bytes = 0  # held by the buckets
        # Buckets from the least to the most recently used (dicts keep insertion order).
        self._free: dict[tuple, list[np.ndarray]] = {}

    def take(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        key = (shape, dtype.str)
        bucket = self._free.pop(key, None)
        if bucket is None:
            bucket = []
        self._free[key] = bucket  # now the most recently used
        for buffer in bucket:
            # References: the bucket's, and what this loop and the call add (see
            # _unreferenced_count). Anything more is a result view someone still holds.
            if sys.getrefcount(buffer) == _UNREFERENCED:
                if buffer.flags.writeable:
                    return buffer
                bucket.remove(buffer)  # someone froze it: never hand it out again
                self._bytes -= buffer.nbytes
                break
        buffer = np.empty(shape, dtype)
        if len(bucket) < self._per_key:
            bucket.append(buffer)
            self._bytes += buffer.nbytes
            self._forget_least_recent()
        return buffer

    def _forget_least_recent(self) -> None:
        while self._bytes > self._max_bytes and len(self._free) > 1:
            oldest = next(iter(self._free))
            self._bytes -= sum(buffer.nbytes for buffer in self._free.pop(oldest))


_local = threading.local()


def _results() -> _Buffers:
    """This thread's result buffers."""
    try:
        return _local.buffers
    except AttributeError:
        _local.buffers = _Buffers()
        return _local.buffers


def pack(leaf_lists: Sequence[Sequence[Any]], size: int, dtype: Any) -> list[np.ndarray]:
    """Each list of leaves (one per replica, all of ``dtype``, ``size`` elements in
    all) copied in order into one flat array: this thread's scratch memory, reused by
    the next call in this thread once these arrays are gone (while one is alive, its
    memory is never written: that call takes new memory, at the cost of allocating
    it), so the caller should drop them when it is done and must not let them, or
    views of them, escape.

    The copies go through ``io.BytesIO.writelines``: a C loop doing one memcpy per
    leaf, about 45 ns per leaf where ``np.concatenate`` spends 120 on converting each
    input (a list of 100 tensors of 1 KiB packs in 4.4 us instead of 12). A leaf
    without a C-contiguous buffer (a strided view) cannot be written: that list is
    packed by ``np.concatenate`` instead.
    """
    dtype = np.dtype(dtype)
    nbytes = size * dtype.itemsize
    count = len(leaf_lists)
    if count * nbytes > SCRATCH_MAX_BYTES:  # never kept: fresh arrays
        return [_concatenated(leaves, dtype) for leaves in leaf_lists]
    writers = getattr(_local, "writers", None)
    if writers is None:
        writers = _local.writers = []
    # One writer per replica of this call, none kept beyond: bounded memory.
    if len(writers) < count:
        writers.extend(io.BytesIO() for _ in range(count - len(writers)))
    elif len(writers) > count:
        del writers[count:]
    packed = []
    for index, leaves in enumerate(leaf_lists):
        try:
            writer = _write(writers, index, leaves, SCRATCH_MAX_BYTES // count)
        except ValueError:  # a leaf without a C-contiguous buffer (NumPy refuses it)
            packed.append(_concatenated(leaves, dtype))
            continue
        if writer.tell() != nbytes:  # not what the caller said: let NumPy cast or refuse
            packed.append(_concatenated(leaves, dtype))
            continue
        packed.append(np.frombuffer(writer.getbuffer(), dtype, count=size))
    return packed


def _write(writers: list[io.BytesIO], index: int, leaves: Sequence[Any], cap: int) -> io.BytesIO:
    """``leaves`` written from the start of ``writers[index]``, replaced by a new
    writer when it holds more than ``cap`` bytes or when an array made from it is
    still alive (then BytesIO refuses to write: BufferError)."""
    writer = writers[index]
    # Its size is the largest pack it has held (seek returns the end offset).
    if writer.seek(0, io.SEEK_END) > cap:
        writer = writers[index] = io.BytesIO()
    try:
        writer.seek(0)
        writer.writelines(leaves)
    except BufferError:
        writer = writers[index] = io.BytesIO()
        writer.writelines(leaves)
    return writer


def _concatenated(leaves: Sequence[Any], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(leaves, axis=None).astype(dtype, copy=False)


def _reduce_slice(
    ufunc: Any, flats: list, out: np.ndarray, start: int, stop: int, step: int
) -> None:
    """Reduce ``flats[:, start:stop]`` into ``out``, ``step`` elements at a time."""
    first, second, rest = flats[0], flats[1], flats[2:]
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        block = out[lo:hi]
        ufunc(first[lo:hi], second[lo:hi], out=block)
        for flat in rest:
            ufunc(block, flat[lo:hi], out=block)


# Python's operators on NumPy float and complex scalars run NumPy's scalar
# arithmetic, which rounds each step exactly as the ufunc does, for a fraction of a
# ufunc call (four float32 scalars: 0.2 us, against 1.1 us for one ufunc.reduce).
# Not for integers: their scalar arithmetic warns on overflow, where ufuncs wrap.
_SCALAR_OPERATORS = {np.add: operator.add, np.multiply: operator.mul}


def scalar_total(ufunc: Any, values: Any, mean: bool = False) -> Any:
    """``ufunc`` across 0-d ``values`` (NumPy scalars or 0-d arrays of one dtype),
    value by value in order; ``mean``: then divided by their count (integers are
    summed and divided as float64, as NumPy's mean does). A NumPy scalar, or
    ``values[0]`` itself when it is the only value and no mean is taken.

    Value by value, not one ``ufunc.reduce`` over the list: from 8 values on that
    adds in partial sums, so a scalar would not reduce as the one-element array of
    it does (any other shape is reduced one input at a time).
    """
    inexact = isinstance(values[0], np.inexact)
    if mean and not inexact:  # summed as float64, as NumPy's mean: int8 100 + 100 is 200
        values = [np.float64(v) for v in values]
        inexact = True
    # (functools.reduce: the loop in C.) A ufunc returns a new scalar for 0-d inputs,
    # so no out=; one value comes back as it is.
    total = reduce((inexact and _SCALAR_OPERATORS.get(ufunc)) or ufunc, values)
    if mean:  # on the scalar: about 1 us less than dividing the 0-d array in place
        # The count in the sum's own dtype: the quotient keeps that dtype (as the
        # in-place division of an array does) under any promotion rules.
        count = len(values)
        total = total / total.dtype.type(count) if inexact else np.true_divide(total, count)
    return total


def scalar_totaller(ufunc: Any, kind: type, mean: bool = False) -> Any:
    """``scalar_total(ufunc, values, mean)`` for two or more ``values`` of NumPy
    scalar type ``kind``, as one callable of ``(values[1:], values[0])``. Without a
    mean, no Python call per use (1.6k instructions less per (c) step, four float32
    scalars): ``functools.reduce`` of the operator ``scalar_total`` would pick,
    bound to it, the first value its initial one; for a sum of float or complex
    scalars, the builtin ``sum`` from the first value: the same additions in the
    same order, each NumPy's own, without a call of ``operator.add`` for each
    (0.4k instructions of a (c) step)."""
    if mean:
        return partial(_scalar_mean, ufunc)
    scalar_operator = (issubclass(kind, np.inexact) and _SCALAR_OPERATORS.get(ufunc)) or ufunc
    if scalar_operator is operator.add:
        return sum
    return partial(reduce, scalar_operator)


def _scalar_mean(ufunc: Any, rest: Sequence, first: Any) -> Any:
    """``scalar_total(ufunc, (first, *rest), mean=True)``: see ``scalar_totaller``."""
    return scalar_total(ufunc, (first, *rest), mean=True)


def combine_scalars(ufunc: Any, values: Any, mean: bool = False) -> np.ndarray:
    """``scalar_total`` as a new 0-d array."""
    total = scalar_total(ufunc, values, mean)
    if total is values[0]:  # one value, maybe the caller's own 0-d array: a copy
        return np.array(total, copy=True)
    return np.asarray(total)


def combine(ufunc: Any, arrays: list) -> np.ndarray:
    """``ufunc`` applied across ``arrays`` (at least one); a new or pooled array."""
    first = arrays[0]
    if len(arrays) == 1:
        return np.array(first, copy=True)
    large = (
        first.nbytes >= POOL_MIN_BYTES
        and all(a.dtype == first.dtype and a.shape == first.shape for a in arrays)
        and all(a.flags.c_contiguous for a in arrays)
    )
    if not large:
        if first.ndim == 0:
            return combine_scalars(ufunc, arrays)
        total = ufunc(first, arrays[1])
        for array in arrays[2:]:
            ufunc(total, array, out=total)
        return total
    dtype = first.dtype
    if not dtype.isnative:  # in native order, as the plain path's ufunc gives it
        dtype = dtype.newbyteorder("=")
    out = _results().take(first.shape, dtype)
    flats = [a.reshape(-1) for a in arrays]
    flat_out = out.reshape(-1)
    size = flat_out.size
    block = max(1, BLOCK_BYTES // first.itemsize)  # elements
    if first.nbytes < PARALLEL_MIN_BYTES or _WORKERS == 1:
        _reduce_slice(ufunc, flats, flat_out, 0, size, block)
        return out
    per_worker = -(-size // _WORKERS)
    # Whole blocks per worker, a block no larger than a worker's share: with many
    # cores, blocks rounded up past it would leave workers without a slice.
    block = min(block, per_worker)
    per_worker = -(-per_worker // block) * block
    bounds = [(lo, min(lo + per_worker, size)) for lo in range(0, size, per_worker)]
    # Each slice runs in a copy of the caller's context, so NumPy's errstate (a
    # context variable) applies to every slice, not only the caller's.
    submit, pending = _executor().submit, []
    try:
        for lo, hi in bounds[1:]:
            run = contextvars.copy_context().run
            pending.append(submit(run, _reduce_slice, ufunc, flats, flat_out, lo, hi, block))
    except RuntimeError:
        # The pool takes no more work once Python has begun to shut down: when the
        # main thread ends, the pool's threads are stopped, while an event loop in
        # another thread may go on reducing. (Every large reduction there raised
        # "cannot schedule new futures after shutdown".) The slices not handed
        # out are reduced in this thread, after its own.
        pass
    try:
        for lo, hi in [bounds[0], *bounds[1 + len(pending) :]]:
            _reduce_slice(ufunc, flats, flat_out, lo, hi, block)
    finally:
        wait(pending)  # never leave a slice writing into `out` behind us
    for future in pending:
        future.result()  # re-raises a slice's error
    return out
