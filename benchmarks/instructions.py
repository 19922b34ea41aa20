"""``python -m benchmarks.instructions``: instructions per step, counted by callgrind.

Seconds per step on a shared 2-core machine move by 5-10% from run to run, more
than most single changes to the hot path are worth. Instructions executed do not:
under ``valgrind --tool=callgrind``, with hash randomisation and address-space
randomisation off and OpenBLAS on one thread, the same code counts the same
instructions to the last one. This counts (a), (b), (c) and their floors
(``benchmarks.workloads``) that way: each workload runs twice in a child process,
for two step counts, and the difference divided by the difference in steps is
its cost per step, free of start-up and import costs.

Instructions are not seconds (a cache miss costs more than an add), but on this
code the two agree closely: (b)'s ratio to its floor was 2.30 in instructions and
2.31 in seconds. Use it to decide whether a change to the hot path pays; take the
figures for the README from ``python -m benchmarks``.

    python -m benchmarks.instructions                 # N = 4, uvloop
    python -m benchmarks.instructions --replicas 2,4,8 --loop asyncio

Needs valgrind (Debian: ``apt install valgrind``); ``setarch -R`` (util-linux)
turns address-space randomisation off where it is available.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.__main__ import _loops, _replica_counts

ROOT = Path(__file__).resolve().parent.parent

# (key, label, its floor's key); floors have None.
WORKLOADS = [
    ("a", "(a) run, constant", "floor_a"),
    ("floor_a", "    floor: N bare tasks", None),
    ("b", "(b) all_reduce scalar", "floor_bc"),
    ("c", "(c) merge_call+reduce", "floor_bc"),
    ("floor_bc", "    floor: N tasks meet at a future", None),
]
STEPS = (100, 600)  # the two runs of each workload: their difference is what counts
# Deterministic counts: no hash randomisation, OpenBLAS's spinning worker threads
# off (they count instructions while idle).
ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _measure(key: str):
    from benchmarks import workloads as w

    return {
        "a": w.measure_a,
        "floor_a": w.floor_a,
        "b": w.measure_b,
        "c": w.measure_c,
        "floor_bc": w.floor_bc,
    }[key]


def _steps_run(steps: int) -> int:
    """Steps a ``workloads.measure_*`` call runs for ``steps``: its warm-up too."""
    return steps + max(1, steps // 10)


def _child(key: str, replicas: int, steps: int, loop: str) -> None:
    """Run one workload (inside valgrind)."""
    with asyncio.Runner(loop_factory=_loops()[loop]) as runner:
        runner.run(_measure(key)(replicas, steps))


def instructions(command: list[str]) -> int:
    """Instructions callgrind counted for ``command`` (the whole process)."""
    prefix = ["setarch", "-R"] if shutil.which("setarch") else []
    done = subprocess.run(
        [*prefix, "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(
            f"valgrind failed on {' '.join(command)} (exit {done.returncode}):\n"
            f"{done.stderr[-2000:]}"
        )
    return int(found.group(1))


def per_step(key: str, replicas: int, loop: str) -> float:
    """Instructions per step of workload ``key``."""
    child = [sys.executable, "-m", "benchmarks.instructions", "--child", key]
    options = ["--replicas", str(replicas), "--loop", loop]
    counts = [instructions([*child, *options, "--steps", str(steps)]) for steps in STEPS]
    return (counts[1] - counts[0]) / (_steps_run(STEPS[1]) - _steps_run(STEPS[0]))


def _table(figures: dict, loop: str) -> str:
    lines = [
        f"instructions per step (callgrind), Python {sys.version.split()[0]}, {loop}",
        f"{'workload':36} {'N':>2} {'instructions':>13} {'x floor':>8}",
    ]
    for replicas, per_key in figures.items():
        for key, label, floor in WORKLOADS:
            ratio = f"{per_key[key] / per_key[floor]:7.2f}x" if floor else ""
            lines.append(f"{label:36} {replicas:>2} {per_key[key] / 1e3:12.1f}k {ratio:>8}")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.instructions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--replicas", type=_replica_counts, default=[4], help="e.g. 2,4,8")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--child", choices=[key for key, _, _ in WORKLOADS], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS[0], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.replicas[0], args.steps, args.loop)
        return 0
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind on the PATH (Debian: apt install valgrind)")
    if args.loop not in _loops():
        parser.error(f"--loop {args.loop}: it is not installed; pip install {args.loop}")
    jobs = [(n, key) for n in args.replicas for key, _, _ in WORKLOADS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counted = pool.map(lambda job: per_step(job[1], job[0], args.loop), jobs)
        figures: dict[int, dict[str, float]] = {}
        for (n, key), count in zip(jobs, counted, strict=True):
            figures.setdefault(n, {})[key] = count
    print(_table(figures, args.loop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
