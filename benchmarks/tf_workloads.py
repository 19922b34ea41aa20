"""TensorFlow side of the aiodist benchmarks: ``tf.distribute.MirroredStrategy`` on N CPUs.

Run from the repository root with a Python that has TensorFlow (it does not import aiodist)::

    python -m benchmarks.tf_workloads --replicas N [--quick] [--repeats R]

The process splits the physical CPU into N logical devices (fixed for the life of a process,
which is why the runner starts one subprocess per N), builds
``MirroredStrategy(["/cpu:0", ..., "/cpu:N-1"], cross_device_ops=ReductionToOneDevice())`` and
measures the seconds per step of each workload, in eager mode (``strategy.run`` called directly)
and under ``tf.function`` (``strategy.run`` wrapped once and traced before timing):

- ``a_run_constant``: ``fn`` returns ``tf.constant(1.0)``: the pure cost of dispatching a step.
- ``b_all_reduce_scalar``: ``fn`` does one ``all_reduce(SUM, tf.constant(1.0))``.
- ``c_merge_call_reduce``: ``fn`` does one ``merge_call`` whose ``merge_fn`` returns
  ``strategy.reduce(SUM, v, axis=None)``.
- ``d_all_reduce_{1,16,64}MiB``: ``fn`` all-reduces (SUM) one float32 tensor of that size per
  replica, created once on each replica's device and passed to ``run`` as an argument.
- ``e_batched_100x1KiB``: ``fn`` all-reduces (SUM) a list of 100 float32 tensors of 1 KiB (256
  elements) each, in one ``all_reduce`` call; the inputs are likewise created once.

Each measurement warms up, times K steps with ``time.perf_counter`` (K picked from a calibration
run so that one timing takes about 0.3 s, or about 0.05 s with ``--quick``) and ends by reading
one result with ``.numpy()`` so that no TensorFlow work is left in flight. It is repeated R times
(5 by default, 3 with ``--quick``) and the median of the seconds per step is reported.

Exactly one line of JSON goes to stdout; everything else, TensorFlow's logging included, goes to
stderr::

    {"tf_version": "2.21.0", "replicas": 4,
     "results": {"a_run_constant": {"eager": 0.0014, "function": 0.00013}, ...}}

A ``"function"`` figure of a ``d_*`` workload is left out, with the reason on stderr, if the
``tf.function`` version fails (for instance for lack of memory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Must be set before TensorFlow is first imported to silence its C++ INFO/WARNING logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MiB = 1 << 20
FLOAT32_BYTES = 4

# Seconds one timed block of K steps should take, and the bounds on K.
TARGET_S = 0.3
QUICK_TARGET_S = 0.05
MAX_STEPS = 100_000


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tf_workloads",
        description="Time tf.distribute.MirroredStrategy on N logical CPU devices; "
        "print one JSON line.",
    )
    parser.add_argument("--replicas", type=int, required=True, help="number of CPU replicas")
    parser.add_argument("--quick", action="store_true", help="short timings, 3 repeats")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timings per figure (default 5, --quick 3)"
    )
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas {args.replicas}; expected a whole number >= 1")
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}; expected a whole number >= 1")
    return args


def _log(msg: str) -> None:
    print(f"[tf_workloads] {msg}", file=sys.stderr, flush=True)


class Timer:
    """Times a step callable: calibrates K, then returns the median seconds per step."""

    def __init__(self, *, target_s: float, repeats: int) -> None:
        self.target_s = target_s
        self.repeats = repeats

    @staticmethod
    def _block(step: Callable[[], Any], sync: Callable[[Any], None], k: int) -> float:
        """Seconds per step over ``k`` steps, waiting for the last result to be ready."""
        t0 = time.perf_counter()
        for _ in range(k):
            out = step()
        sync(out)
        return (time.perf_counter() - t0) / k

    def measure(self, step: Callable[[], Any], sync: Callable[[Any], None]) -> float:
        # Warm-up: the first call traces a tf.function and allocates; not counted.
        sync(step())
        # Calibration (also warm-up): double k until a block takes a tenth of the target.
        k = 1
        while True:
            per_step = self._block(step, sync, k)
            if per_step * k >= self.target_s / 10 or k >= MAX_STEPS:
                break
            k *= 2
        k = max(1, min(MAX_STEPS, math.ceil(self.target_s / per_step)))
        return statistics.median(self._block(step, sync, k) for _ in range(self.repeats))


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    import tensorflow as tf

    _log(f"TensorFlow {tf.__version__} imported in {time.perf_counter() - t0:.1f} s")

    # Logical devices can only be configured before TensorFlow initialises its runtime.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(args.replicas)]
    )
    tf.get_logger().setLevel("ERROR")

    devices = [f"/cpu:{i}" for i in range(args.replicas)]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    worker_devices = strategy.extended.worker_devices
    SUM = tf.distribute.ReduceOp.SUM

    def per_replica(make: Callable[[], Any]) -> Any:
        """Distributed value holding ``make()`` created on each replica's own device."""

        def value_fn(ctx: tf.distribute.experimental.ValueContext) -> Any:
            with tf.device(worker_devices[ctx.replica_id_in_sync_group]):
                return make()

        return strategy.experimental_distribute_values_from_function(value_fn)

    def sync(out: Any) -> None:
        # Reading a value forces completion of the step that produced it (and, steps on one
        # stream being ordered, of all earlier ones).
        first = tf.nest.flatten(strategy.experimental_local_results(out))[0]
        first.numpy()

    # --- replica functions -------------------------------------------------------------------

    def fn_constant() -> tf.Tensor:
        return tf.constant(1.0)

    def fn_all_reduce_scalar() -> tf.Tensor:
        return tf.distribute.get_replica_context().all_reduce(SUM, tf.constant(1.0))

    def merge_fn(strat: tf.distribute.Strategy, v: Any) -> tf.Tensor:
        return strat.reduce(SUM, v, axis=None)

    def fn_merge_call_reduce() -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        return ctx.merge_call(merge_fn, args=(tf.constant(1.0),))

    def fn_all_reduce(x: Any) -> Any:
        return tf.distribute.get_replica_context().all_reduce(SUM, x)

    # (name, replica fn, per-replica args, whether a failing tf.function version may be omitted)
    workloads: list[tuple[str, Callable[..., Any], tuple[Any, ...], bool]] = [
        ("a_run_constant", fn_constant, (), False),
        ("b_all_reduce_scalar", fn_all_reduce_scalar, (), False),
        ("c_merge_call_reduce", fn_merge_call_reduce, (), False),
    ]
    for mib in (1, 16, 64):
        n = mib * MiB // FLOAT32_BYTES
        x = per_replica(lambda n=n: tf.ones([n], tf.float32))
        workloads.append((f"d_all_reduce_{mib}MiB", fn_all_reduce, (x,), True))
    leaves = per_replica(lambda: [tf.ones([256], tf.float32) for _ in range(100)])
    workloads.append(("e_batched_100x1KiB", fn_all_reduce, (leaves,), False))

    timer = Timer(target_s=QUICK_TARGET_S if args.quick else TARGET_S, repeats=args.repeats)
    results: dict[str, dict[str, float]] = {}
    for name, fn, fn_args, function_optional in workloads:
        figures: dict[str, float] = {}
        t0 = time.perf_counter()

        def eager_step(fn=fn, fn_args=fn_args) -> Any:
            return strategy.run(fn, args=fn_args)

        figures["eager"] = timer.measure(eager_step, sync)

        # Arguments go through the tf.function's signature rather than being captured.
        compiled = tf.function(lambda *a, fn=fn: strategy.run(fn, args=a))

        def function_step(compiled=compiled, fn_args=fn_args) -> Any:
            return compiled(*fn_args)

        try:
            figures["function"] = timer.measure(function_step, sync)
        except Exception:
            if not function_optional:
                raise
            _log(f"{name}: tf.function version failed, left out:\n{traceback.format_exc()}")

        results[name] = figures
        _log(f"{name}: {figures} ({time.perf_counter() - t0:.1f} s)")

    return {"tf_version": tf.__version__, "replicas": args.replicas, "results": results}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # Keep stdout for the one JSON line: anything TensorFlow prints, from Python or C++, is sent
    # to stderr by pointing file descriptor 1 there until the result is written.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t0 = time.perf_counter()
    report = run(args)
    _log(f"total {time.perf_counter() - t0:.1f} s (after argument parsing)")
    json_out.write(json.dumps(report) + "\n")
    json_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
