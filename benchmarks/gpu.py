"""``python -m benchmarks --gpu``: dispatch overhead and all-reduce bandwidth on GPUs.

Measured in one run, each beside its same-run baseline:

- **stream switching**: one ``activate``/``deactivate`` pair, the work done
  around every step of a GPU replica's coroutine (the per-step cost of keeping
  each replica on its own stream);
- **dispatch**: ``await strategy.run(fn)`` with ``fn`` returning a constant, on N
  GPU replicas against the same on N CPU replicas (the difference is what the
  GPU path adds per step: stream switching on every step of every replica);
- **all-reduce bandwidth**: ``all_reduce(SUM, x)`` of 1/16/64 MiB float32 per
  replica, with ``ReductionToOneDevice`` (N replicas sharing GPU:0) and with
  ``NcclAllReduce`` (one rank per visible GPU), against a device-to-device copy
  of the same bytes on one GPU (``cupy.ndarray.copy``). Time runs until the GPU
  has finished (``aiodist.ready``), so it is GPU time, not issue time.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiodist
from aiodist._backends import visible_gpu_count
from benchmarks import workloads

MIB = 1 << 20


def _cupy():
    import cupy

    return cupy


def stream_switch_ns(pairs: int = 200_000) -> float:
    """Nanoseconds for one activate + deactivate of a replica's stream."""
    strategy = aiodist.MirroredStrategy(["GPU:0"])
    slot = strategy._slots[0]
    activate, deactivate = slot.backend.activate, slot.backend.deactivate
    device, stream = slot.device, slot.stream
    start = time.perf_counter()
    for _ in range(pairs):
        deactivate(activate(device, stream))
    return (time.perf_counter() - start) / pairs * 1e9


async def _per_step(strategy: aiodist.MirroredStrategy, fn, steps: int) -> float:
    return await workloads._timed(lambda: strategy.run(fn), steps)


async def dispatch(n: int, steps: int) -> dict:
    """Seconds per ``run`` of a constant function on N GPU and N CPU replicas."""

    async def constant():
        await asyncio.sleep(0)  # one suspension: a step more to switch streams around
        return 1

    gpu = aiodist.MirroredStrategy(["GPU:0"] * n)
    cpu = workloads.strategy_for(n)
    return {
        "gpu": await _per_step(gpu, constant, steps),
        "cpu": await _per_step(cpu, constant, steps),
    }


async def _all_reduce_seconds(strategy: aiodist.MirroredStrategy, mib: int, steps: int) -> float:
    cupy = _cupy()
    count = mib * MIB // 4

    async def fn():
        x = cupy.ones(count, dtype=cupy.float32)
        ctx = aiodist.get_replica_context()
        for _ in range(steps):
            # The same input every step: its values stay finite, and the step times
            # the all-reduce alone (no extra pass over x to scale it back).
            await ctx.all_reduce("sum", x)
        await aiodist.ready()

    await strategy.run(fn)  # warm-up: communicators, memory pools
    start = time.perf_counter()
    await strategy.run(fn)
    return (time.perf_counter() - start) / steps


async def _copy_seconds(mib: int, steps: int) -> float:
    cupy = _cupy()
    x = cupy.ones(mib * MIB // 4, dtype=cupy.float32)
    x.copy()
    await aiodist.ready(x)
    start = time.perf_counter()
    for _ in range(steps):
        x = x.copy()
    await aiodist.ready(x)
    return (time.perf_counter() - start) / steps


async def bandwidth(n: int, sizes: list[int], steps: int) -> list[dict]:
    shared = aiodist.MirroredStrategy(["GPU:0"] * n)
    gpus = [f"GPU:{i}" for i in range(visible_gpu_count())]
    nccl = aiodist.MirroredStrategy(gpus, cross_device_ops=aiodist.NcclAllReduce())
    rows = []
    for mib in sizes:
        rows.append(
            {
                "mib": mib,
                "one_device": await _all_reduce_seconds(shared, mib, steps),
                "nccl": await _all_reduce_seconds(nccl, mib, steps),
                "nccl_ranks": len(gpus),
                "copy": await _copy_seconds(mib, steps),
            }
        )
    return rows


def measure(replicas: list[int], quick: bool, repeats: int, loop_factory) -> dict:
    """Every GPU figure, medians of ``repeats``."""
    steps = 200 if quick else 1000
    bw_steps = 10 if quick else 50
    sizes = [1, 16, 64]
    out: dict = {"switch_ns": statistics.median(stream_switch_ns() for _ in range(repeats))}
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        out["dispatch"] = {}
        for n in replicas:
            runs = [runner.run(dispatch(n, steps)) for _ in range(repeats)]
            out["dispatch"][str(n)] = {
                key: statistics.median(run[key] for run in runs) for key in ("gpu", "cpu")
            }
        n = max(replicas)
        runs = [runner.run(bandwidth(n, sizes, bw_steps)) for _ in range(repeats)]
        out["bandwidth"] = {"replicas": n, "rows": []}
        for i, mib in enumerate(sizes):
            row = {"mib": mib, "nccl_ranks": runs[0][i]["nccl_ranks"]}
            for key in ("one_device", "nccl", "copy"):
                row[key] = statistics.median(run[i][key] for run in runs)
            out["bandwidth"]["rows"].append(row)
    return out


def table(report: dict) -> str:
    lines = [
        f"stream switch (activate + deactivate): {report['switch_ns']:.0f} ns per step",
        "",
        "dispatch: run(constant fn with one await), per step",
        f"{'N':>3} {'GPU replicas':>14} {'CPU replicas':>14} {'GPU extra':>12}",
    ]
    for n, row in report["dispatch"].items():
        extra = row["gpu"] - row["cpu"]
        lines.append(
            f"{n:>3} {row['gpu'] * 1e6:>11.1f} µs {row['cpu'] * 1e6:>11.1f} µs "
            f"{extra * 1e6:>9.1f} µs"
        )
    bw = report["bandwidth"]
    lines += [
        "",
        f"all_reduce(SUM) of float32 per replica; {bw['replicas']} replicas sharing GPU:0 "
        f"(ReductionToOneDevice), NCCL over {bw['rows'][0]['nccl_ranks']} GPU(s); "
        "GB/s = bytes per replica / time",
        f"{'size':>7} {'one device':>18} {'NCCL':>18} {'d2d copy':>18} {'NCCL/copy':>10}",
    ]
    for row in bw["rows"]:
        size = row["mib"] * MIB

        def cell(seconds: float, size: int = size) -> str:
            return f"{seconds * 1e3:7.3f} ms {size / seconds / 1e9:5.0f} GB/s"

        lines.append(
            f"{row['mib']:>4} MiB {cell(row['one_device'])} {cell(row['nccl'])} "
            f"{cell(row['copy'])} {row['nccl'] / row['copy']:>9.2f}x"
        )
    return "\n".join(lines)
