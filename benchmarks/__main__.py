"""``python -m benchmarks``: aiodist against its floors, NumPy and TensorFlow, in one run.

Prints one table (medians of several repeats) for N = 2, 4, 8 CPU replicas on
the asyncio and uvloop loops, and writes the figures as JSON (``--json``): the
times measured and, under ``"table"``, the ratios and GB/s the table shows
(``null`` where it shows none). When TensorFlow is
importable (``pip install 'aiodist[bench-tf]'``, or ``--tf-python`` naming an
interpreter that has it), the same workloads run on ``tf.distribute`` in one
subprocess per N (logical devices are fixed per process) and the table shows
how many times faster aiodist is.

    python -m benchmarks --quick          # under a minute on 2 cores
    python -m benchmarks --json out.json  # full run, figures saved
    python -m benchmarks --gpu            # GPU dispatch overhead and bandwidth (CuPy)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import serving
from benchmarks import workloads as w

ROOT = Path(__file__).resolve().parent.parent

# (key, label, unit) — key matches benchmarks/tf_workloads.py
ROWS = [
    ("a_run_constant", "(a) run, constant", "step"),
    ("b_all_reduce_scalar", "(b) all_reduce scalar", "step"),
    ("c_merge_call_reduce", "(c) merge_call+reduce", "step"),
    ("d_all_reduce_1MiB", "(d) all_reduce 1 MiB", "step"),
    ("d_all_reduce_16MiB", "(d) all_reduce 16 MiB", "step"),
    ("d_all_reduce_64MiB", "(d) all_reduce 64 MiB", "step"),
    ("e_batched_100x1KiB", "(e) 100 x 1 KiB batched", "step"),
    ("f_concurrent_64", "(f) 64 concurrent (b)", "run"),
    ("g_b_while_tracing", "(g) (b) while tracing", "step"),
]


def _loops() -> dict:
    loops = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:
        print("uvloop is not installed: measuring asyncio only", file=sys.stderr)
    else:
        loops["uvloop"] = uvloop.new_event_loop
    return loops


def _steps(quick: bool) -> dict:
    scale = 0.15 if quick else 1.0

    def s(n: int) -> int:
        return max(2, int(n * scale))

    return {"abc": s(3000), "d": {1: s(60), 16: s(12), 64: s(6)}, "e": s(600), "f": s(1280)}


# Workloads judged against a floor: measured in alternating rounds with it, and
# the ratio taken round by round. Noise on this 2-core machine comes in bursts (a
# slow moment of the host) that can hit one workload's block of steps and not the
# next: one run of the suite had the (b)/(c) floor at 16.2 us where every other
# run before and after had 12.3-12.8 us, and (c) at 1.82x its floor instead of
# about 2.3x. A workload and its floor measured in turn share their conditions,
# and the median over all rounds (3 per repeat: 15 in a full run) is moved less
# by a burst than the ratio of two medians of one block per repeat each.
FLOORED = {
    "a_run_constant": "floor_a",
    "b_all_reduce_scalar": "floor_bc",
    "c_merge_call_reduce": "floor_bc",
}
ROUNDS = 3  # rounds per repeat: each measures every floored workload and floor


async def _floored_round(n: int, steps: int) -> dict:
    """One round: seconds per step of each floored workload and of its floor."""
    return {
        "a_run_constant": await w.measure_a(n, steps),
        "floor_a": await w.floor_a(n, steps),
        "b_all_reduce_scalar": await w.measure_b(n, steps),
        "c_merge_call_reduce": await w.measure_c(n, steps),
        "floor_bc": await w.floor_bc(n, steps),
    }


def _x_floor(rounds: list[dict]) -> dict:
    """Each floored workload's time over its floor's, median over ``rounds``."""
    return {
        key: statistics.median(r[key] / r[floor] for r in rounds) for key, floor in FLOORED.items()
    }


async def _measure_all(n: int, steps: dict) -> dict:
    """One repeat: seconds per step of every workload, and the rounds that measured
    the floored ones beside their floors (``"rounds"``)."""
    per_round = max(2, steps["abc"] // ROUNDS)
    rounds = [await _floored_round(n, per_round) for _ in range(ROUNDS)]
    d = steps["d"]
    return {
        **{key: statistics.fmean(r[key] for r in rounds) for key in rounds[0]},
        "d_all_reduce_1MiB": await w.measure_d(n, 1, d[1]),
        "d_all_reduce_16MiB": await w.measure_d(n, 16, d[16]),
        "d_all_reduce_64MiB": await w.measure_d(n, 64, d[64]),
        "e_batched_100x1KiB": await w.measure_e(n, steps["e"]),
        "f_concurrent_64": await w.measure_f(n, steps["f"]),
        "g_b_while_tracing": await w.measure_b_traced(n, steps["abc"]),
        "rounds": rounds,
    }


def _median_runs(loop_factory, n: int, steps: dict, repeats: int) -> dict:
    """Medians over ``repeats`` of each workload's seconds per step, and under
    ``"x_floor"`` the floored workloads' ratios over every round (``_x_floor``)."""
    runs = []
    for _ in range(repeats):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runs.append(runner.run(_measure_all(n, steps)))
    rounds = [r for run in runs for r in run.pop("rounds")]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    medians["x_floor"] = _x_floor(rounds)
    return medians


IN_FLIGHT = (1, 16, 64, 256)  # (f) scaling: runs in flight at once


def _scaling(loop_factory, n: int, steps: int, repeats: int) -> dict:
    """Seconds per run of (b) with 1 to 256 runs in flight, beside the floor's
    steps in flight: per-run cost should grow no faster than the floor's."""
    out: dict = {"replicas": n, "in_flight": list(IN_FLIGHT), "aiodist": [], "floor": []}
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        for concurrent in IN_FLIGHT:
            runs = max(steps, 4 * concurrent)  # at least 4 rounds each
            for key, measure in (("aiodist", w.measure_f), ("floor", w.floor_f)):
                times = [runner.run(measure(n, runs, concurrent)) for _ in range(repeats)]
                out[key].append(statistics.median(times))
    # The table's ratios, kept in the JSON beside the times they come from.
    out["x_floor"] = [
        ours / floor for ours, floor in zip(out["aiodist"], out["floor"], strict=True)
    ]
    out["aiodist_vs_one"] = [ours / out["aiodist"][0] for ours in out["aiodist"]]
    return out


def _scaling_table(scaling: dict) -> str:
    lines = [
        f"(f) scaling, N={scaling['replicas']}: seconds per run of (b) with runs in flight",
        f"{'in flight':>9} {'aiodist':>11} {'floor':>11} {'x floor':>8} {'aiodist vs 1':>12}",
    ]
    columns = ("in_flight", "aiodist", "floor", "x_floor", "aiodist_vs_one")
    for count, ours, floor, x_floor, vs_one in zip(
        *(scaling[column] for column in columns), strict=True
    ):
        lines.append(
            f"{count:>9} {_fmt_time(ours):>11} {_fmt_time(floor):>11} "
            f"{x_floor:7.2f}x {vs_one:11.2f}x"
        )
    return "\n".join(lines)


def _numpy_baselines(n: int, steps: dict, repeats: int) -> dict:
    return {
        f"numpy_{mib}MiB": statistics.median(
            w.numpy_reduce_d(n, mib, steps["d"][mib]) for _ in range(repeats)
        )
        for mib in (1, 16, 64)
    }


# Seconds the TensorFlow side may take for one N (a full run took 28 s at N = 8
# here, a quick one under 10 s, TF's import included) before it is stopped and
# reported as failed: a child that hangs must not hang the suite.
TF_TIMEOUT_S = {False: 600.0, True: 120.0}  # keyed by --quick


def _tensorflow(
    python: str | None, n: int, quick: bool, repeats: int, timeout: float | None = None
) -> dict | None:
    if python is None:
        return None
    command = [python, "-m", "benchmarks.tf_workloads", "--replicas", str(n)]
    command += ["--repeats", str(repeats)]  # the same median as aiodist's figures
    if quick:
        command.append("--quick")
    timeout = TF_TIMEOUT_S[quick] if timeout is None else timeout
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        done = _run_child(command, env, timeout)
    except OSError as exc:  # (checked at the start; gone since)
        print(f"TensorFlow benchmark failed for N={n}: {exc}", file=sys.stderr)
        return None
    except subprocess.TimeoutExpired as exc:
        print(
            f"TensorFlow benchmark failed for N={n}: {command[0]} was still running after "
            f"{timeout:g} s and was stopped{_stderr_tail(exc.stderr)}",
            file=sys.stderr,
        )
        return None
    if done.returncode != 0:
        print(
            f"TensorFlow benchmark failed for N={n}: {command[0]} exited {done.returncode}"
            f"{_stderr_tail(done.stderr)}",
            file=sys.stderr,
        )
        return None
    # The child's last line of stdout is its figures (benchmarks/tf_workloads.py).
    # Anything else is reported like a failure: a crash here would lose every
    # figure measured so far, the JSON file included.
    lines = done.stdout.strip().splitlines()
    try:
        figures = json.loads(lines[-1]) if lines else None
    except ValueError:
        figures = None
    if not isinstance(figures, dict):
        printed = f"a last line {lines[-1][:200]!r}" if lines else "nothing"
        print(
            f"TensorFlow benchmark failed for N={n}: {command[0]} exited 0 having printed "
            f"{printed}; expected one line of JSON from benchmarks.tf_workloads"
            f"{_stderr_tail(done.stderr)}",
            file=sys.stderr,
        )
        return None
    return figures


def _run_child(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``command`` in ROOT, its output captured; past ``timeout`` seconds (or on any
    exception, Ctrl-C included) kill it and everything it started, and re-raise.

    The child leads a process group of its own so that a wrapper script's children
    (``conda run``, a shell script around Python) are stopped with it: killing only
    the wrapper would leave a hung TensorFlow process holding the cores.
    """
    with subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            _, stderr = process.communicate()  # what it wrote before it was stopped
            raise subprocess.TimeoutExpired(command, timeout, stderr=stderr) from None
        except BaseException:
            _kill_group(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # every process of it gone already
        os.killpg(process.pid, signal.SIGKILL)


def _stderr_tail(stderr: str) -> str:
    """The end of a child's stderr, to append to a report of its failure."""
    return f"; its stderr ended:\n{stderr[-2000:]}" if stderr.strip() else ""


# Run by the --tf-python to check it before anything is measured: finding the
# module is enough (importing TensorFlow takes seconds).
TF_PROBE = (
    "import importlib.util; print('tensorflow', importlib.util.find_spec('tensorflow') is not None)"
)
TF_PROBE_TIMEOUT_S = 60.0


def _checked_tf_python(option: str) -> str:
    """``--tf-python``: the executable it names, as an absolute path (the TensorFlow
    side runs in the repository root, where a relative path means something else),
    once it has shown that it is a Python that can import TensorFlow. Raises
    ``ValueError`` saying what it is instead."""
    found = shutil.which(option)
    if found is None:
        raise ValueError(f"--tf-python {option!r}: no such executable")
    python = os.path.abspath(found)
    expected = "expected a Python with TensorFlow installed"
    try:
        done = _run_child([python, "-c", TF_PROBE], dict(os.environ), TF_PROBE_TIMEOUT_S)
    except OSError as exc:
        raise ValueError(f"--tf-python {option!r}: it cannot be run ({exc}); {expected}") from None
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"--tf-python {option!r}: '{python} -c ...' did not finish in "
            f"{TF_PROBE_TIMEOUT_S:g} s; {expected}"
        ) from None
    answer = done.stdout.strip()
    if done.returncode == 0 and answer == "tensorflow True":
        return python
    if done.returncode == 0 and answer == "tensorflow False":
        raise ValueError(
            f"--tf-python {option!r}: that Python cannot import tensorflow; {expected} "
            "(pip install tensorflow-cpu with it, or name another)"
        )
    raise ValueError(
        f"--tf-python {option!r} is not a Python that can run this check: '{python} -c "
        f"...' exited {done.returncode} having printed {answer[-200:]!r}; {expected}"
        f"{_stderr_tail(done.stderr)}"
    )


def _tf_python(option: str | None) -> str | None:
    if option:
        return option
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    return None


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:8.2f} ms"
    return f"{seconds * 1e6:8.1f} us"


def _table_figures(report: dict) -> dict:
    """What the table shows beyond the measured times, as the JSON's ``"table"``: per
    N and workload, the baseline and 'x baseline', TensorFlow's times and the 'vs TF'
    ratios and (d)'s GB/s, all taken from the ``"loop"`` column (uvloop where it is
    measured); ``None`` (JSON null) where the table shows nothing."""
    best = "uvloop" if "uvloop" in report["loops"] else "asyncio"
    rows: dict = {}
    for n_key, per_n in report["results"].items():
        tf = (report["tensorflow"].get(n_key) or {}).get("results", {})
        rows[n_key] = {}
        for key, _label, _unit in ROWS:
            ours = per_n[best][key]
            mib = int(key.split("_")[-1].removesuffix("MiB")) if key.startswith("d_") else 0
            if key in FLOORED:
                base = per_n[best][FLOORED[key]]
            elif key.startswith("g_"):
                base = per_n[best]["b_all_reduce_scalar"]
            elif mib:
                base = per_n["numpy"][f"numpy_{mib}MiB"]
            else:
                base = None
            if key in FLOORED:  # paired round by round (see FLOORED)
                x_base = per_n[best]["x_floor"][key]
            else:
                x_base = ours / base if base is not None else None
            eager = tf.get(key, {}).get("eager")
            function = tf.get(key, {}).get("function")
            rows[n_key][key] = {
                "aiodist": ours,
                "baseline": base,
                "x_baseline": x_base,
                "tf_eager": eager,
                "tf_function": function,
                "vs_tf_eager": eager / ours if eager else None,  # TF time / aiodist time
                "vs_tf_function": function / ours if function else None,
                "gb_per_s": int(n_key) * mib * w.MIB / ours / 1e9 if mib else None,
            }
    return {"loop": best, "rows": rows}


def _table(report: dict) -> str:
    loops = report["loops"]
    figures = report.get("table") or _table_figures(report)  # (main() made it already)
    header = (
        f"{'workload':26} {'N':>2} "
        + " ".join(f"{'aiodist ' + name:>16}" for name in loops)
        + f" {'baseline':>12} {'x baseline':>10} {'TF eager':>11} {'TF function':>11}"
        + f" {'vs TF eager':>11} {'vs TF fn':>9}"
    )

    def cell(value: float | None, form: str) -> str:
        return "" if value is None else form.format(value)

    def time_cell(seconds: float | None) -> str:
        return "" if seconds is None else _fmt_time(seconds)

    lines = [header, "-" * len(header)]
    for n_key, per_n in report["results"].items():
        for key, label, _unit in ROWS:
            row = figures["rows"][n_key][key]
            lines.append(
                f"{label:26} {n_key:>2} "
                + " ".join(f"{_fmt_time(per_n[name][key]):>16}" for name in loops)
                + f" {time_cell(row['baseline']):>12}"
                + f" {cell(row['x_baseline'], '{:9.2f}x'):>10}"
                + f" {time_cell(row['tf_eager']):>11}"
                + f" {time_cell(row['tf_function']):>11}"
                + f" {cell(row['vs_tf_eager'], '{:10.1f}x'):>11}"
                + f" {cell(row['vs_tf_function'], '{:8.1f}x'):>9}"
                + cell(row["gb_per_s"], "   {:5.1f} GB/s in")
            )
        lines.append("")
    lines.append(
        "baseline: (a) N bare tasks; (b)(c) N bare tasks meeting at one future; "
        "(d) single-threaded np.add.reduce over the N arrays (a new result each call); "
        "(g) (b) not tracing. "
        "'x baseline' = aiodist time / baseline time ((a)-(c): the median of "
        "the ratios of rounds that measured both in turn); "
        "'vs TF ...' = TF time / aiodist time (above 1x, aiodist "
        f"is faster); both use the {figures['loop']} column."
    )
    return "\n".join(lines)


def _replica_counts(text: str) -> list[int]:
    """``--replicas``: comma-separated replica counts, each at least 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"{text!r}; expected distinct comma-separated replica counts >= 1, such as 2,4,8"
        )
    return counts


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}; expected a whole number >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.replace("``", ""),  # (reST quoting: for readers of the source)
        # (the default formatter ran the example command lines together into prose)
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps; under a minute")
    parser.add_argument(
        "--replicas",
        type=_replica_counts,
        default=[2, 4, 8],
        help="comma-separated N (default 2,4,8)",
    )
    parser.add_argument(
        "--repeats", type=_at_least_one, default=None, help="repeats (median; default 5/3)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--tf-python", default=None, help="a Python with TensorFlow installed")
    parser.add_argument("--no-tf", action="store_true", help="skip the TensorFlow comparison")
    parser.add_argument("--no-serving", action="store_true", help="skip the serving benchmark")
    parser.add_argument(
        "--gpu", action="store_true", help="GPU replicas: dispatch overhead and bandwidth"
    )
    args = parser.parse_args(argv)
    # Paths checked before minutes of measuring, not after.
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(
            f"--json {str(args.json)!r}: the folder {str(args.json.parent)!r} does not exist"
        )
    if args.json is not None and args.json.is_dir():
        parser.error(
            f"--json {str(args.json)!r} is a folder; expected a file to write the figures "
            f"to, such as {str(args.json / 'benchmarks.json')!r}"
        )
    if args.tf_python is not None and not args.no_tf:
        try:
            args.tf_python = _checked_tf_python(args.tf_python)
        except ValueError as exc:
            parser.error(str(exc))
    if args.gpu:
        return _gpu_main(args)

    replicas = args.replicas
    repeats = args.repeats or (3 if args.quick else 5)  # None: not given
    steps = _steps(args.quick)
    loops = _loops()
    tf_python = None if args.no_tf else _tf_python(args.tf_python)
    if tf_python is None and not args.no_tf:
        print(
            "TensorFlow is not installed: no TF comparison "
            "(pip install 'aiodist[bench-tf]' or pass --tf-python)",
            file=sys.stderr,
        )

    started = time.perf_counter()
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "aiodist": __import__("aiodist").__version__,
        "quick": args.quick,
        "repeats": repeats,
        "loops": list(loops),
        "results": {},
        "tensorflow": {},
    }
    for n in replicas:
        per_n = {name: _median_runs(factory, n, steps, repeats) for name, factory in loops.items()}
        per_n["numpy"] = _numpy_baselines(n, steps, repeats)
        report["results"][str(n)] = per_n
        report["tensorflow"][str(n)] = _tensorflow(tf_python, n, args.quick, repeats)
    best_name = "uvloop" if "uvloop" in loops else "asyncio"
    best_loop = loops[best_name]
    scaling_n = 4 if 4 in replicas else replicas[0]
    report["scaling"] = _scaling(best_loop, scaling_n, steps["f"], repeats)
    if not args.no_serving and serving.available():
        total = 300 if args.quick else 2000
        devices = [f"cpu:{i}" for i in range(4)]
        try:
            with asyncio.Runner(loop_factory=best_loop) as runner:
                report["serving"] = runner.run(serving.measure(devices, [1, 16, 128], total))
        except (RuntimeError, OSError) as exc:  # reported; the figures measured are kept
            print(f"serving benchmark failed: {exc}", file=sys.stderr)
    elif not args.no_serving:
        print(
            "starlette/uvicorn not installed: no serving benchmark (pip install '.[serve]')",
            file=sys.stderr,
        )
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["table"] = _table_figures(report)  # the table's derived figures, for the JSON

    print(f"aiodist {report['aiodist']} benchmarks, {report['date']}, {report['machine']}")
    print(f"Python {report['python']}; median of {repeats} repeats; {report['seconds']} s\n")
    print(_table(report))
    print("\n" + _scaling_table(report["scaling"]))
    if report.get("serving"):
        print("\n" + serving.table(report["serving"]))
        print(
            f"4 CPU replicas, {best_name}; one row per mode and concurrency; the load comes "
            "from another process."
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nfigures written to {args.json}")
    return 0


def _gpu_main(args: argparse.Namespace) -> int:
    from aiodist._backends import visible_gpu_count

    if visible_gpu_count() == 0:
        print(
            "--gpu needs CuPy and a GPU (pip install '.[cuda12]' or '.[cuda13]')",
            file=sys.stderr,
        )
        return 2
    from benchmarks import gpu

    replicas = args.replicas
    repeats = args.repeats or 3  # None: not given
    loops = _loops()
    factory = loops.get("uvloop", asyncio.new_event_loop)
    started = time.perf_counter()
    report = gpu.measure(replicas, args.quick, repeats, factory)
    report["seconds"] = round(time.perf_counter() - started, 1)
    seconds = report["seconds"]
    print(f"aiodist GPU benchmarks, {platform.machine()}, {seconds} s, median of {repeats}\n")
    print(gpu.table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
