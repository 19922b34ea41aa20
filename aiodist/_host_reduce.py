"""Element-wise reduction of large host arrays: all cores, cache blocks, reused buffers.

``combine(ufunc, arrays)`` is what ``ReductionToOneDevice`` uses on CPU devices.
Small inputs take the plain path (one ufunc call per input). Larger ones
(``POOL_MIN_BYTES`` and up, C-contiguous, one dtype) are reduced block by block
(``BLOCK`` elements), so the partial result stays in cache while the N inputs
stream through it. From ``PARALLEL_MIN_BYTES`` on, the work is split into one
slice per core: NumPy releases the GIL inside each ufunc call, so the slices
run in parallel; the caller's thread takes the first slice, a process-wide
thread pool the rest.

The result of a large reduction goes into a buffer taken from a small pool.
Collective results are read-only views of that buffer; a buffer is reused only
when no view of it is alive any more (CPython's reference count says so), so a
result a user still holds never changes. This saves the page faults of a fresh
multi-megabyte allocation on every step.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["BLOCK", "PARALLEL_MIN_BYTES", "POOL_MIN_BYTES", "combine"]

POOL_MIN_BYTES = 1 << 18  # from here, results go to pooled buffers, reduced in blocks
PARALLEL_MIN_BYTES = 1 << 22  # from here, several cores (below, threads cost more)
BLOCK = 1 << 15  # elements per block: 128 KiB of float32, cache-resident
_WORKERS = max(1, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="aiodist-reduce")
    return _pool


class _Buffers:
    """Result buffers by (shape, dtype), reused once nothing refers to them."""

    def __init__(self, per_key: int = 2):
        self._per_key = per_key
        self._free: dict[tuple, list[np.ndarray]] = {}

    def take(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        bucket = self._free.setdefault((shape, dtype.str), [])
        for buffer in bucket:
            # References: the bucket, this loop variable, getrefcount's argument.
            # Anything more is a result view someone still holds.
            if sys.getrefcount(buffer) == 3:
                return buffer
        buffer = np.empty(shape, dtype)
        if len(bucket) < self._per_key:
            bucket.append(buffer)
        return buffer


_buffers = _Buffers()


def _reduce_slice(ufunc: Any, flats: list, out: np.ndarray, start: int, stop: int) -> None:
    first, second, rest = flats[0], flats[1], flats[2:]
    for lo in range(start, stop, BLOCK):
        hi = min(lo + BLOCK, stop)
        block = out[lo:hi]
        ufunc(first[lo:hi], second[lo:hi], out=block)
        for flat in rest:
            ufunc(block, flat[lo:hi], out=block)


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
        total = np.asarray(ufunc(arrays[0], arrays[1]))  # ufuncs give scalars for 0-d
        for array in arrays[2:]:
            ufunc(total, array, out=total)
        return total
    out = _buffers.take(first.shape, first.dtype)
    flats = [a.reshape(-1) for a in arrays]
    flat_out = out.reshape(-1)
    size = flat_out.size
    if first.nbytes < PARALLEL_MIN_BYTES or _WORKERS == 1:
        _reduce_slice(ufunc, flats, flat_out, 0, size)
        return out
    per_worker = -(-size // _WORKERS)
    per_worker = -(-per_worker // BLOCK) * BLOCK  # whole blocks per worker
    bounds = [(lo, min(lo + per_worker, size)) for lo in range(0, size, per_worker)]
    pending = [
        _executor().submit(_reduce_slice, ufunc, flats, flat_out, lo, hi) for lo, hi in bounds[1:]
    ]
    _reduce_slice(ufunc, flats, flat_out, *bounds[0])
    for future in pending:
        future.result()
    return out
