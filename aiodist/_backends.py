"""Array backends: what a kind of device holds, and how code is placed on it.

A backend is chosen once per device (``backend_for``), never by ``if cupy:`` at
call sites. The scheduler and the cross-device ops talk to it through a small
surface:

- ``check(device)`` raises ``DeviceError`` when the device does not exist here;
- ``new_stream(device)`` gives a replica its own stream (``None`` where there are
  no streams), and ``activate(device, stream)`` / ``deactivate(token)`` make that
  device and stream current around every step of the replica's coroutine
  (``needs_activation`` is False where this is a no-op, so the scheduler skips it);
- where ``needs_activation`` is True (streams), also
  ``begin_cross_replica(slots, first)`` / ``end_cross_replica(token, slots)``,
  which bracket cross-replica work (collectives, ``merge_fn``) so it is ordered
  after each replica's pending work and each replica's later work after it
  (CUDA events), and ``enter_cross_replica(token)`` /
  ``leave_cross_replica(saved)``, which make the streams that work is issued on
  current around each synchronous stretch of it, and
  ``order_replicas_after(slots)`` / ``order_after_replicas(slots)``, which order
  the replica streams after the devices' current streams, or those after the
  replica streams (a run's start and end, input placement, cross-replica calls
  outside a run). The host needs none of these: its work is done when issued,
  and nothing calls them there;
- ``on_device(device)`` is a context manager making ``device`` current (where
  kernels and copies go), ``asarray(value, device)`` places a value on a
  device, ``host_array(value)`` copies one back, and ``xp`` is the array namespace
  (``numpy`` or ``cupy``).

``import aiodist`` imports NumPy only; CuPy is imported the first time a GPU
device is asked for.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import numpy as np

from ._devices import Device
from ._errors import DeviceError

__all__ = [
    "CpuBackend",
    "backend_for",
    "cpu_backend",
    "host_array",
    "is_cupy_array",
    "loaded_gpu_backend",
    "visible_gpu_count",
]

_CUPY_REMEDY = (
    "install CuPy for your CUDA version: pip install 'aiodist[cuda12]' (CUDA 12.x) "
    "or pip install 'aiodist[cuda13]' (CUDA 13.x)"
)


_NOTHING = contextlib.nullcontext()


class CpuBackend:
    """Logical CPU devices holding NumPy arrays; all in one process, no streams.

    Any number of CPU devices exist (``cpu:0`` … ``cpu:N-1``); they share host
    memory, so moving an array between them never copies.
    """

    kind = "CPU"
    xp = np
    array_type = np.ndarray  # values of this type need no conversion (asarray)
    needs_activation = False

    def check(self, device: Device) -> None:
        """CPU devices are logical: every index is available."""

    def new_stream(self, device: Device) -> None:
        return None

    def activate(self, device: Device, stream: object) -> None:
        return None

    def deactivate(self, token: object) -> None:
        return None

    def on_device(self, device: Device) -> contextlib.nullcontext:
        """A context manager making ``device`` current: nothing to do on the host."""
        return _NOTHING

    def asarray(self, value: object, device: Device) -> np.ndarray:
        return value if type(value) is np.ndarray else np.asarray(value)

    def shared_view(self, array: np.ndarray) -> np.ndarray:
        """A new read-only array object over ``array``'s memory.

        All-reduce and all-gather results on CPU replicas are such views of one
        shared buffer: each replica gets its own object, nobody pays for a copy,
        and nobody can write into another replica's result.
        """
        view = array.view()
        view.flags.writeable = False
        return view


cpu_backend = CpuBackend()


def is_cupy_array(value: object) -> bool:
    """Whether ``value`` is a CuPy array (without importing CuPy)."""
    return type(value).__module__.startswith("cupy")


def is_cupy_type(kind: type) -> bool:
    """Whether values of type ``kind`` are CuPy arrays (``is_cupy_array`` per type)."""
    return kind.__module__.startswith("cupy")


def host_array(value: object) -> np.ndarray:
    """``value`` as a NumPy array on the host (copied from the GPU for a CuPy array)."""
    return value.get() if is_cupy_array(value) else np.asarray(value)  # type: ignore[attr-defined]


def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


def visible_gpu_count() -> int:
    """How many GPUs CuPy sees here; 0 without CuPy or a working driver.

    Asked of the CUDA runtime once per process: the answer cannot change (CUDA
    reads ``CUDA_VISIBLE_DEVICES`` when it starts, and a missing or too old driver
    stays missing), and it is asked often: by every strategy made with the
    default devices, and by every ``aiodist.ready()`` of a program that imported
    CuPy but made no GPU strategy."""
    global _visible_gpus
    if _visible_gpus is None:
        _visible_gpus = _count_visible_gpus()
    return _visible_gpus


_visible_gpus: int | None = None  # visible_gpu_count's answer, once asked


def _count_visible_gpus() -> int:
    if not _cupy_installed():
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _gpu_backend(device: Device) -> Any:
    global _gpu
    if _gpu is not None:  # checked once already: only the index remains to check
        _gpu.check(device)
        return _gpu
    if not _cupy_installed():
        raise DeviceError(
            f"device {str(device)!r} is a GPU, but CuPy is not installed; {_CUPY_REMEDY}. "
            "Available here: CPU devices (e.g. 'cpu:0', 'cpu:1')."
        )
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        raise DeviceError(
            f"device {str(device)!r} is a GPU, but CUDA is not usable here ({exc}); "
            "check the NVIDIA driver (nvidia-smi) and that CuPy matches its CUDA "
            f"version: {_CUPY_REMEDY}. Available here: CPU devices (e.g. 'cpu:0', 'cpu:1')."
        ) from exc
    if count == 0:
        raise DeviceError(
            f"device {str(device)!r} is a GPU, but CuPy sees no GPU here; check "
            "CUDA_VISIBLE_DEVICES and the NVIDIA driver. Available here: CPU devices "
            "(e.g. 'cpu:0', 'cpu:1')."
        )
    from ._cuda import GpuBackend  # imports CuPy: only once a GPU is asked for

    _gpu = GpuBackend()
    _gpu.check(device)
    return _gpu


_gpu: Any = None  # the GPU backend, made on first use


def loaded_gpu_backend() -> Any:
    """The GPU backend if a GPU device was ever asked for, else None (no CuPy import)."""
    return _gpu


def backend_for(device: Device) -> Any:
    """The backend that holds arrays for ``device``; raises ``DeviceError`` if unusable."""
    if device.kind == "CPU":
        return cpu_backend
    return _gpu_backend(device)
