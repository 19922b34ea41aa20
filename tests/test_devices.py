"""Device strings and strategy construction (SPEC §1)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import numpy as np
import pytest

import aiodist
import aiodist._backends

HAS_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("GPU:0", "/device:GPU:0"),
        ("gpu:0", "/device:GPU:0"),
        ("/gpu:0", "/device:GPU:0"),
        ("/device:GPU:0", "/device:GPU:0"),
        ("device:gpu:3", "/device:GPU:3"),
        ("/job:localhost/replica:0/task:0/device:GPU:1", "/device:GPU:1"),
        ("CPU:0", "/device:CPU:0"),
        ("cpu:12", "/device:CPU:12"),
        ("/cpu:1", "/device:CPU:1"),
        ("/device:CPU:2", "/device:CPU:2"),
        ("/job:localhost/replica:0/task:0/device:CPU:7", "/device:CPU:7"),
        (aiodist.Device("CPU", 4), "/device:CPU:4"),
    ],
)
def test_canonical_device_names(spec, canonical):
    assert aiodist.canonical_device(spec) == canonical
    assert str(aiodist._devices.parse_device(spec)) == canonical


@pytest.mark.parametrize(
    "bad",
    [
        "tpu:0",
        "cpu",
        "cpu:-1",
        "GPU:x",
        "",
        "/job:worker/task:1/device:CPU:0",
        "cpu:0:1",
        "cpu:\u0661",
        # The local-job prefix and the device must be joined by '/': these were
        # taken as CPU:0, CPU:1 and GPU:0.
        "/job:localhostcpu:0",
        "/job:localhost/replica:0device:CPU:1",
        "/job:localhost/task:0gpu:0",
    ],
)
def test_bad_device_strings_name_the_string_and_the_forms(bad):
    with pytest.raises(ValueError) as info:
        aiodist.MirroredStrategy([bad])
    assert isinstance(info.value, aiodist.DeviceError)
    assert repr(bad) in str(info.value)
    assert "expected 'CPU:<i>' or 'GPU:<i>'" in str(info.value)


def test_device_objects_are_checked_and_spelled_canonically():
    # Built directly, as parse_device builds them: the same rules as for strings.
    assert aiodist.Device("cpu", 1) == aiodist.Device("CPU", 1)
    assert str(aiodist.Device("gpu", 2)) == "/device:GPU:2"
    assert aiodist.MirroredStrategy([aiodist.Device("cpu", 1)]).extended.worker_devices == (
        "/device:CPU:1",
    )
    for kind, index, complaint in [
        ("TPU", 1, r"kind must be 'CPU' or 'GPU'"),
        (0, 0, r"kind must be 'CPU' or 'GPU'"),
        ("CPU", -1, r"index must be a whole number from 0"),
        ("CPU", 1.0, r"index must be a whole number from 0"),
        ("CPU", True, r"index must be a whole number from 0"),
        ("GPU", "0", r"index must be a whole number from 0"),
        ("GPU", np.array([1]), r"index must be a whole number from 0"),
    ]:
        with pytest.raises(
            aiodist.DeviceError,
            match=re.escape(f"Device(kind={kind!r}, index={index!r}): ") + complaint,
        ):
            aiodist.Device(kind, index)


def test_other_jobs_are_called_out():
    message = r"other jobs or tasks .*MultiWorkerMirroredStrategy"
    with pytest.raises(aiodist.DeviceError, match=message):
        aiodist.canonical_device("/job:worker/replica:0/task:1/device:GPU:0")


def test_non_string_device():
    with pytest.raises(aiodist.DeviceError, match=r"device 3 is of type int"):
        aiodist.MirroredStrategy([3])


def test_empty_device_list():
    with pytest.raises(ValueError, match=r"devices=\[\] names no device"):
        aiodist.MirroredStrategy([])


def test_single_string_instead_of_list():
    with pytest.raises(
        aiodist.DeviceError, match=r"expected a list of device strings, e\.g\. \['cpu:1'\]"
    ):
        aiodist.MirroredStrategy("cpu:1")
    with pytest.raises(
        aiodist.DeviceError,
        match=r"devices='cpu:0, cpu:1' is one string; .* e\.g\. \['cpu:0', 'cpu:1'\]\.",
    ):
        aiodist.MirroredStrategy("cpu:0, cpu:1")


@pytest.mark.parametrize(
    "devices", [b"cpu:0", bytearray(b"cpu:0"), {"cpu:0", "cpu:1"}, {"cpu:0": 1}, frozenset()]
)
def test_device_collections_without_an_order_are_refused(devices):
    """bytes were iterated as ints ("device 99 is a int"); a set or a dict was taken,
    its replicas in an order the caller never gave (a set's: another each run)."""
    with pytest.raises(
        aiodist.DeviceError,
        match=r"devices=.* is a (bytes|bytearray|set|dict|frozenset); expected a list of "
        r"device strings, in replica order",
    ):
        aiodist.MirroredStrategy(devices)
    generated = aiodist.MirroredStrategy(f"cpu:{i}" for i in (1, 0))  # an order: taken
    assert generated.extended.worker_devices == ("/device:CPU:1", "/device:CPU:0")


@pytest.mark.skipif(HAS_CUPY, reason="checks the message given when CuPy is not installed")
def test_gpu_without_cupy_says_how_to_install():
    with pytest.raises(aiodist.DeviceError) as info:
        aiodist.MirroredStrategy(["cpu:0", "gpu:1"])
    message = str(info.value)
    assert "'/device:GPU:1' is a GPU, but CuPy is not installed" in message
    assert "pip install 'aiodist[cuda12]'" in message and "aiodist[cuda13]" in message
    assert "CPU devices" in message


def test_default_devices_without_gpus_is_cpu0():
    strategy = aiodist.MirroredStrategy()
    if not HAS_CUPY:
        assert strategy.extended.worker_devices == ("/device:CPU:0",)
    assert strategy.num_replicas_in_sync == len(strategy.extended.worker_devices) >= 1


def test_worker_and_parameter_devices_with_repeats():
    strategy = aiodist.MirroredStrategy(["cpu:1", "/cpu:0", "CPU:1"])
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended.worker_devices == ("/device:CPU:1", "/device:CPU:0", "/device:CPU:1")
    assert strategy.extended.parameter_devices == ("/device:CPU:1", "/device:CPU:0")
    assert repr(strategy) == (
        "MirroredStrategy(devices=['/device:CPU:1', '/device:CPU:0', '/device:CPU:1'])"
    )


def test_any_number_of_cpu_replicas():
    strategy = aiodist.MirroredStrategy([f"cpu:{i}" for i in range(64)])
    assert strategy.num_replicas_in_sync == 64


def test_one_device_strategy():
    strategy = aiodist.OneDeviceStrategy("/cpu:2")
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices == ("/device:CPU:2",)
    assert strategy.extended.parameter_devices == ("/device:CPU:2",)
    with pytest.raises(aiodist.DeviceError, match=r"expected one device string"):
        aiodist.OneDeviceStrategy(["cpu:0"])


def test_bad_constructor_arguments():
    with pytest.raises(
        ValueError, match=r"cross_device_ops='nccl'; expected an aiodist.CrossDeviceOps"
    ):
        aiodist.MirroredStrategy(["cpu:0"], cross_device_ops="nccl")
    with pytest.raises(ValueError, match=r"communication_options=5"):
        aiodist.MirroredStrategy(["cpu:0"], communication_options=5)


def test_communication_options_validation_and_merge():
    for bad in (-1, 0, True, float("nan"), float("inf"), "5"):
        for name in ("timeout_seconds", "stall_warning_seconds"):
            expected = rf"{name}={bad!r}; expected a finite number of seconds > 0, or None\."
            with pytest.raises(ValueError, match=expected):
                aiodist.CommunicationOptions(**{name: bad})
    with pytest.raises(ValueError, match=r"bytes_per_pack=1.5"):
        aiodist.CommunicationOptions(bytes_per_pack=1.5)
    with pytest.raises(
        ValueError, match=r"implementation='fast'; expected one of AUTO, RING, NCCL"
    ):
        aiodist.CommunicationOptions(implementation="fast")
    base = aiodist.CommunicationOptions(bytes_per_pack=1024, timeout_seconds=30)
    merged = base.merge(aiodist.CommunicationOptions(timeout_seconds=2))
    assert merged == aiodist.CommunicationOptions(bytes_per_pack=1024, timeout_seconds=2)
    assert base.merge(None) is base
    assert aiodist.CommunicationOptions(implementation="nccl").implementation is (
        aiodist.CommunicationImplementation.NCCL
    )


def _cupy_without_a_gpu() -> bool:
    return HAS_CUPY and aiodist._backends.visible_gpu_count() == 0


@pytest.mark.skipif(
    not _cupy_without_a_gpu(),
    reason="checks the message given when CuPy is installed but no GPU/driver is usable "
    "(tox -e nodriver installs CuPy on a machine without a GPU)",
)
def test_gpu_with_cupy_but_no_usable_driver_says_what_is_missing():
    with pytest.raises(aiodist.DeviceError) as info:
        aiodist.MirroredStrategy(["GPU:0"])
    message = str(info.value)
    assert "'/device:GPU:0' is a GPU" in message
    assert "CUDA is not usable here" in message or "CuPy sees no GPU" in message
    assert "driver" in message and "CPU devices" in message
    # ... and with no devices named, the strategy falls back to the host.
    assert aiodist.MirroredStrategy().extended.worker_devices == ("/device:CPU:0",)
    assert aiodist._backends.loaded_gpu_backend() is None


_COUNT_RUNTIME_QUERIES = """
import sys
import cupy
import aiodist
from aiodist import _backends

queries = []

def profile(frame, event, arg):
    if event == "c_call" and getattr(arg, "__name__", "") == "getDeviceCount":
        queries.append(arg)

async def ready_often():
    for _ in range(3):
        await aiodist.ready()

sys.setprofile(profile)
for _ in range(3):
    _backends.visible_gpu_count()
    aiodist.MirroredStrategy()
aiodist.run(ready_often())
sys.setprofile(None)
print(len(queries))
"""


@pytest.mark.skipif(not HAS_CUPY, reason="counts CuPy's CUDA runtime queries: needs CuPy")
def test_the_cuda_runtime_is_asked_for_the_gpu_count_once_per_process():
    # Every visible_gpu_count() asked cupy.cuda.runtime.getDeviceCount() again: each
    # strategy made with the default devices, and each aiodist.ready() of a program
    # that imported CuPy without making a GPU strategy (no GPU: every time).
    # (A fresh process, which nothing has asked yet; CuPy's function is watched, not
    # replaced.)
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_RUNTIME_QUERIES],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "1"


def test_whole_number_arguments_take_numpy_integers():
    # As seconds take NumPy numbers: np.int64(8) (from np.arange, a config array)
    # was refused as "expected an int >= 1". Each is kept as a Python int.
    from aiodist.serving import Batcher
    from aiodist.testing import cpu_strategy

    two = cpu_strategy(np.int64(2))
    assert two.num_replicas_in_sync == 2
    options = aiodist.CommunicationOptions(bytes_per_pack=np.int32(1024))
    inputs = aiodist.InputOptions(experimental_per_replica_buffer_size=np.uint8(3))
    batcher = Batcher(
        two,
        lambda rows: rows,
        max_batch_size=np.int64(8),
        max_queue_rows=np.int16(64),
        max_batches_in_flight=np.int64(1),
    )
    kept = [
        aiodist.NcclAllReduce(num_packs=np.int64(2)).num_packs,
        options.bytes_per_pack,
        inputs.experimental_per_replica_buffer_size,
        batcher.max_batch_size,
        batcher.max_queue_rows,
        batcher.max_batches_in_flight,
    ]
    assert kept == [2, 1024, 3, 8, 64, 1] and {type(n) for n in kept} == {int}
    assert aiodist.CommunicationOptions(
        bytes_per_pack=np.int32(1024)
    ) == aiodist.CommunicationOptions(bytes_per_pack=1024)
    for bad in (np.bool_(True), np.int64(-1), np.float64(2.0)):
        with pytest.raises(aiodist.InvalidArgumentError, match=r"num_packs=.*expected an int >= 0"):
            aiodist.NcclAllReduce(num_packs=bad)
        with pytest.raises(aiodist.InvalidArgumentError, match=r"max_batch_size=.*expected an int"):
            Batcher(two, lambda rows: rows, max_batch_size=bad)


def test_nccl_all_reduce_refuses_cpu_devices_before_touching_cupy():
    with pytest.raises(aiodist.InvalidArgumentError, match=r"NcclAllReduce needs GPU devices"):
        aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=aiodist.NcclAllReduce())


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_nccl_num_packs_is_checked(bad):
    with pytest.raises(aiodist.InvalidArgumentError, match=r"num_packs=.*expected an int >= 0"):
        aiodist.NcclAllReduce(num_packs=bad)
    assert repr(aiodist.NcclAllReduce(num_packs=3)) == "NcclAllReduce(num_packs=3)"


def test_reduction_device_of_another_kind_is_refused():
    ops = aiodist.ReductionToOneDevice(reduce_to_device="GPU:0")
    with pytest.raises(aiodist.InvalidArgumentError, match=r"reduce_to_device='/device:GPU:0'"):
        aiodist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)


def test_default_cross_device_ops_on_cpu_is_reduction_to_one_device():
    strategy = aiodist.MirroredStrategy(["cpu:0", "cpu:1"])
    assert type(strategy.extended._cross_device_ops) is aiodist.ReductionToOneDevice


def test_the_documented_default_cross_device_ops_names_nccl_for_distinct_gpus():
    # MirroredStrategy's docstring (docs/api.md) gave ReductionToOneDevice as the
    # default, while distinct GPUs get NcclAllReduce (_default_cross_device_ops,
    # SPEC §6, docs/gpu.md); this machine may have no GPU to show it on.
    doc = " ".join(aiodist.MirroredStrategy.__doc__.split())
    entry = doc.split("cross_device_ops:", 1)[1].split("communication_options:", 1)[0]
    assert "``NcclAllReduce`` for two or more GPUs, none listed twice," in entry
    assert "else ``ReductionToOneDevice``" in entry
