"""``python -m aiodist``: data-parallel linear regression (4 CPU replicas, or --devices).

Global batches come from a generator through
``strategy.experimental_distribute_dataset``; each replica computes the gradient
of the squared error on its shard and calls ``await weights.assign_sub(...)`` on
a mirrored variable, which averages the replicas' gradients (a rendezvous) and
applies the same update to every copy; ``strategy.reduce`` averages the
replicas' losses for printing. Prints the devices, the loss
per step, and the final error against the true weights.

Under MPI (``mpiexec -n 2 python -m aiodist --devices cpu:0,cpu:1``) the same
program runs as a ``MultiWorkerMirroredStrategy``: every worker holds the
listed replicas, takes its replicas' rows of each global batch, and the final
weights equal a one-process run with as many replicas in all. Only worker 0
prints.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys

import numpy as np

import aiodist
from aiodist._backends import visible_gpu_count

FEATURES = 8
BATCH = 256


def _parse(argv: list[str] | None) -> argparse.Namespace:
    # Named as it was started: the console script, or the module. (The docstring's
    # reST quoting is for the API page, not a terminal.)
    script = os.path.basename(sys.argv[0]) == "aiodist-demo"
    parser = argparse.ArgumentParser(
        prog="aiodist-demo" if script else "python -m aiodist",
        description=__doc__.split("\n")[0].replace("``", ""),
    )
    parser.add_argument(
        "--devices",
        default="cpu:0,cpu:1,cpu:2,cpu:3",
        help="comma-separated device strings (default: 4 CPU replicas)",
    )
    parser.add_argument("--steps", type=int, default=50, help="training steps (default: 50)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default: 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps}; expected at least 1")
    # (nan and inf trained to nan weights without a word; a negative seed failed
    # deep in NumPy's seeding, with a traceback.)
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr={args.lr}; expected a finite number > 0")
    if args.seed < 0:
        parser.error(f"--seed={args.seed}; expected a whole number >= 0")
    return args


def _mpi_workers() -> int:
    """How many processes mpiexec started (1 when not launched by MPI)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


async def train(devices: list[str], steps: int, lr: float, seed: int) -> float:
    if _mpi_workers() > 1:
        strategy: aiodist.Strategy = aiodist.MultiWorkerMirroredStrategy(devices)
        chief = strategy.worker_index == 0
    else:
        strategy, chief = aiodist.MirroredStrategy(devices), True
    say = print if chief else (lambda *args, **kwargs: None)
    n = strategy.num_replicas_in_sync
    loop = type(asyncio.get_running_loop())
    say(f"aiodist {aiodist.__version__} on {loop.__module__}.{loop.__qualname__}")
    say(f"GPUs visible to CuPy: {visible_gpu_count()}")
    if _mpi_workers() > 1:
        say(f"{_mpi_workers()} workers, {n} replicas in all")
    say(f"{n} replica(s) on: {', '.join(strategy.extended.worker_devices)}")

    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=FEATURES)
    with strategy.scope():  # one copy per device, kept equal by aggregated updates
        weights = aiodist.Variable(np.zeros(FEATURES), aggregation="mean", name="weights")

    def batches():
        for _ in range(steps):
            x = rng.normal(size=(BATCH, FEATURES))
            yield x, x @ true_w + 0.01 * rng.normal(size=BATCH)

    async def step(x: np.ndarray, y: np.ndarray) -> float:
        err = x @ weights.read_value() - y  # this replica's copy
        grad = 2.0 * x.T @ err / max(len(x), 1)
        await weights.assign_sub(lr * grad)  # all-reduced (MEAN), applied to every copy
        return float(np.mean(err**2)) if len(x) else 0.0

    i = 0
    async for x, y in strategy.experimental_distribute_dataset(batches()):
        local_loss = await strategy.run(step, args=(x, y))
        loss = await strategy.reduce("mean", local_loss, axis=None)
        i += 1
        say(f"step {i:3d}  loss {float(loss):.6f}")

    final = weights.numpy()
    error = float(np.max(np.abs(final - true_w)))
    say(f"final weights: {' '.join(f'{w:.12f}' for w in final)}")
    say(f"final max |w - w_true| = {error:.6f}")
    return error


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    try:
        aiodist.run(train(devices, args.steps, args.lr, args.seed))
    except aiodist.DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
