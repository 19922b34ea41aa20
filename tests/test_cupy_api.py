"""The CuPy and NCCL names the GPU backend calls exist in the installed CuPy.

The GPU backend only runs where a GPU is; this check runs wherever CuPy is
installed (no GPU or driver needed: nothing here calls the driver), so a
renamed or misspelt CuPy API is caught on any machine. Skipped without CuPy
(``tox -e nodriver`` installs it).
"""

from __future__ import annotations

import inspect

import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (tox -e nodriver installs it)")


def test_runtime_stream_and_event_apis_exist():
    import cupyx
    from cupy.cuda import runtime

    import aiodist._cuda as cuda

    for name in ("getDevice", "setDevice", "getDeviceCount", "eventQuery", "check_status"):
        assert callable(getattr(runtime, name)), name
    for name in ("use", "wait_event", "record", "is_non_blocking"):
        assert hasattr(cupy.cuda.Stream, name), name
    assert "non_blocking" in (cupy.cuda.Stream.__doc__ or "")
    assert "disable_timing" in inspect.signature(cupy.cuda.Event).parameters
    assert "device_id" in (cupy.cuda.get_current_stream.__doc__ or "")
    assert "blocking" in (cupy.ndarray.get.__doc__ or "")
    assert callable(cupyx.empty_pinned)
    assert cuda.GpuBackend.xp is cupy


def test_nccl_apis_exist():
    from cupy.cuda import nccl

    import aiodist._cuda as cuda

    if not nccl.available:
        pytest.skip("NCCL's library is not installed (pip install nvidia-nccl-cu12)")
    ops = (op.nccl_op for op in cuda.ReduceOp)
    for name in (*cuda._NCCL_NAMES.values(), *ops, "NCCL_UINT8"):
        assert isinstance(getattr(nccl, name), int), name
    communicator = nccl.NcclCommunicator
    for name in ("initAll", "allReduce", "allGather", "bcast"):
        assert hasattr(communicator, name), name
    assert (
        "(self, intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, int op, "
        "intptr_t stream)" in communicator.allReduce.__doc__
    )
    assert "intptr_t recvbuf, size_t count, int datatype, intptr_t stream)" in (
        communicator.allGather.__doc__
    )
    # bcast's count is a size_t since cupy/cupy#8562 (August 2024), a C int before (CuPy
    # 13.0 among them): broadcast() gives each call at most _BCAST_MAX_BYTES, under 2 GiB.
    assert any(
        f"(self, intptr_t buff, {count} count, int datatype, int root, intptr_t stream)"
        in communicator.bcast.__doc__
        for count in ("size_t", "int")
    )
    assert cuda._BCAST_MAX_BYTES <= 2**31 - 1
    assert callable(nccl.groupStart) and callable(nccl.groupEnd)
    assert cuda.nccl_version() == nccl.get_version()
    # The multi-worker communicator: a unique id of 128 bytes (what worker 0 sends
    # the others over MPI) and the one-rank constructor taking it.
    uid = cuda.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    taken = "bytes" if int(cupy.__version__.split(".")[0]) >= 14 else "tuple"
    assert type(cuda._comm_id(uid)).__name__ == taken
    assert "ndev (int)" in communicator.__doc__ and f"commId ({taken})" in communicator.__doc__
    assert "rank (int)" in communicator.__doc__
    assert hasattr(cupy.cuda.Device, "pci_bus_id")  # gpu_identities: one GPU, one name


def test_the_unique_id_in_both_char_signednesses():
    """CuPy 13 takes the id as a tuple of C chars, signed on x86-64 and unsigned on
    aarch64 (Cython refuses the other range); CuPy 14 takes the bytes."""
    import aiodist._cuda as cuda

    uid = bytes(range(128, 256))
    if int(cupy.__version__.split(".")[0]) >= 14:
        assert cuda._comm_id(uid) == cuda._comm_id(uid, signed=False) == uid
    else:
        assert cuda._comm_id(uid) == tuple(range(-128, 0))
        assert cuda._comm_id(uid, signed=False) == tuple(range(128, 256))


def test_nccl_version_under_warnings_as_errors():
    """Without NCCL's library CuPy warns on importing cupy.cuda.nccl; under warnings
    as errors (this project's pytest settings) nccl_version must still say None
    rather than raise. (Where NCCL is installed this only checks the version.)"""
    import subprocess
    import sys

    script = "import aiodist._cuda as c; print('VERSION', c.nccl_version())"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "VERSION " in done.stdout, done.stdout + done.stderr
