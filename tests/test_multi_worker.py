"""MultiWorkerMirroredStrategy: real worker processes started with ``mpiexec``.

Each test runs ``tests/mpi_programs.py`` under MPICH's ``mpiexec`` (installed
with the test extra: mpi4py and the ``mpich`` wheel) and reads the result file
each worker writes. Every run is bounded in time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import aiodist
from aiodist._backends import visible_gpu_count
from tests.conftest import run_demo
from tests.mpi_programs import int_mean_value

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "mpi_programs.py"


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or _mpiexec() is None,
    reason="needs mpiexec and mpi4py (pip install '.[test]' installs MPICH's on Linux)",
)


def _launch(
    workers: int,
    *args: str,
    timeout: float = 60,
    loop: str = "uvloop",
    gpus: bool = False,
    env: dict | None = None,
    hash_seeds: list[int] | None = None,
) -> tuple:
    """Run ``mpiexec -n workers`` on the program; (rc, {rank: result}, output, seconds).
    ``gpus``: every worker's replicas on GPUs of its own; ``env``: more variables;
    ``hash_seeds``: each worker's PYTHONHASHSEED (one per worker)."""
    command = [_mpiexec(), "-n", str(workers), sys.executable, *args]
    if hash_seeds is not None:  # one program per worker, each with its own seed
        command = [_mpiexec()]
        for seed in hash_seeds:
            command += [":"] if len(command) > 1 else []
            command += ["-n", "1", "-env", "PYTHONHASHSEED", str(seed), sys.executable, *args]
    with tempfile.TemporaryDirectory() as folder:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "AIODIST_TEST_RESULTS": folder,
            "AIODIST_TEST_LOOP": loop,  # for tests/mpi_programs.py
            "AIODIST_TEST_GPUS": "1" if gpus else "0",
            **(env or {}),
        }
        started = time.monotonic()
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        seconds = time.monotonic() - started
        results = {
            int(path.stem.split("-")[1]): json.loads(path.read_text())
            for path in Path(folder).glob("result-*.json")
        }
    return done.returncode, results, done.stdout + done.stderr, seconds


def _program(workers: int, mode: str, counts: list[int], **kwargs) -> tuple:
    return _launch(workers, str(PROGRAM), mode, ",".join(map(str, counts)), **kwargs)


def _one_process(total: int, kind: str = "cpu") -> dict:
    from tests.mpi_programs import compute

    strategy = aiodist.MirroredStrategy([f"{kind}:{i}" for i in range(total)])
    return json.loads(json.dumps(aiodist.run(compute(strategy))))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("counts", [[1, 1], [2, 2], [1, 2, 1]], ids=["2x1", "2x2", "3-uneven"])
def test_results_equal_one_process_with_as_many_replicas(counts, loop):
    rc, results, output, _ = _program(len(counts), "compute", counts, loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == list(range(len(counts)))
    expected = _one_process(sum(counts))
    per_replica = {}
    for rank, result in results.items():
        assert result["loop"].split(".")[0] == loop
        per_replica.update(result["per_replica"])
        assert _close(result["cross"], expected["cross"]), (rank, result, expected["cross"])
    # Global replica ids: each worker holds its own, together all of them.
    assert sorted(per_replica, key=int) == [str(i) for i in range(sum(counts))]
    assert _close(per_replica, expected["per_replica"])
    # Integer MEANs exactly (_close allows for summation order), on every worker.
    n = sum(counts)
    values = [int_mean_value(r).tolist() for r in range(n)]
    exact = [round(Fraction(sum(v[i] for v in values), n)) for i in range(2)]
    for result in results.values():
        assert result["cross"]["int_means"] == {"mirrored": exact, "saved": exact}
        # Python ints written to unsigned variables: each replica's 1, twice; a MEAN.
        assert result["cross"]["steps"] == 2 * n
        assert result["cross"]["middle"] == round(Fraction(sum(200 + r for r in range(n)), n))


def _close(got, want) -> bool:
    """Equal structures with numbers equal to 1e-12 (summation order differs)."""
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_close(got[k], want[k]) for k in want)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_close(g, w) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, float | int):
        return isinstance(got, float | int) and abs(got - want) <= 1e-12 * max(1, abs(want))
    return got == want


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("counts", [[1, 1], [2, 1, 1]], ids=["2x1", "3-uneven"])
def test_min_and_max_of_nan_and_signed_zeros_equal_one_process_on_every_worker(counts, loop):
    """MPI's MIN/MAX kept a NaN on one worker and dropped it on another; now every
    worker's result is one process's np.minimum/np.maximum over the replicas."""
    rc, results, output, _ = _program(len(counts), "min_max", counts, loop=loop)
    assert rc == 0, output[-3000:]
    from tests.mpi_programs import min_max

    strategy = aiodist.MirroredStrategy([f"cpu:{i}" for i in range(sum(counts))])
    expected = aiodist.run(min_max(strategy))
    assert "nan" in expected["in_replicas"]["max float64"]
    assert sorted(results) == list(range(len(counts)))
    for result in results.values():
        assert result == expected


@pytest.mark.parametrize("counts", [[1, 1], [2, 1, 1]], ids=["2x1", "3-uneven"])
def test_min_and_max_of_complex_values_equal_one_process_on_every_worker(counts):
    """One process reduces complex MIN/MAX (NumPy's lexicographic order); across
    workers every one of them raised InvalidArgumentError ('cannot MAX complex
    values across workers (they have no order)')."""
    rc, results, output, _ = _program(len(counts), "complex_min_max", counts)
    assert rc == 0, output[-3000:]
    from tests.mpi_programs import complex_min_max

    strategy = aiodist.MirroredStrategy([f"cpu:{i}" for i in range(sum(counts))])
    expected = aiodist.run(complex_min_max(strategy))
    last = sum(counts) - 1  # (lexicographic: the real parts first)
    assert expected["reduce"]["max"] == repr([complex(last, 1), (2 + 0j), (1 + 1j)])
    assert expected["reduce"]["min"] == repr([1j, complex(2, -last), (1 + 0j)])
    assert sorted(results) == list(range(len(counts))), output[-3000:]
    for result in results.values():
        assert result == expected


@pytest.mark.parametrize("counts", [[1, 1], [1, 2]], ids=["2x1", "uneven"])
def test_big_endian_values_reduce_as_in_one_process_on_every_worker(counts):
    """One process reduces '>f4' values of several replicas into native float32
    (test_host_reduce). Across workers, a worker of one replica handed its share
    to MPI as it was: SUM, MEAN and a sync-on-read read raised mpi4py's BufferError
    ("format string '>f' with non-native byte order"), MAX gave '>f4'; with
    another worker of two replicas (native after its local sum) that worker
    waited in the data step until the timeout, and the job was aborted."""
    rc, results, output, _ = _program(len(counts), "big_endian", counts)
    assert rc == 0, output[-3000:]
    from tests.mpi_programs import big_endian

    strategy = aiodist.MirroredStrategy([f"cpu:{i}" for i in range(sum(counts))])
    expected = aiodist.run(big_endian(strategy))
    assert expected["on_read"] == [True, "float32", [sum(counts)] * 2]
    assert sorted(results) == list(range(len(counts))), output[-3000:]
    for result in results.values():
        assert result == expected


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_headers_of_different_lengths_on_each_worker_are_exchanged(loop):
    """Before, a 4 KiB header limit refused the call on the workers whose shapes
    took more digits, and the others waited for them until the timeout."""
    rc, results, output, _ = _program(3, "long_headers", [1, 1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1, 2], output[-3000:]
    for result in results.values():
        assert result == [[0] * 9 + [1] * 10 + [2] * 10] * 8


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_overlapped_collectives_move_their_data_in_the_order_of_their_headers(loop):
    """Before, each worker issued the MPI calls of overlapped collectives in the
    order their headers happened to complete there: the calls of one met the
    other's on another worker (wrong sums, or MPICH aborting the job)."""
    rc, results, output, _ = _program(3, "overlapped", [1, 1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert results == {rank: {"in_run": True, "cross": True} for rank in range(3)}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_mismatch_between_workers_is_named_on_every_worker(loop):
    _, results, output, _ = _program(3, "mismatch", [1, 1, 1], loop=loop)
    assert sorted(results) == [0, 1, 2], output[-3000:]
    for result in results.values():
        assert result["error"] == "CollectiveMismatchError"
        message = result["message"]
        assert "worker 1 (replica 1): all_reduce(MAX, float64[])" in message
        assert "worker 0 (replica 0): all_reduce(SUM, float64[])" in message
        assert "call #1" in message


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_different_cross_replica_calls_at_one_place_are_a_mismatch_naming_both(loop):
    """Before, only the op and the result shapes were compared: strategy.reduce on
    worker 0 and extended.reduce_to on worker 1 (or reduce_to and batch_reduce_to,
    or a reduce along axis 0 and one of a value already of that shape) paired as one
    operation and returned without an error."""
    rc, results, output, _ = _program(2, "different_calls", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    calls = {
        "reduce_to": ("strategy.reduce(SUM, float64[2])", "reduce_to(SUM, float64[2])"),
        "batch": ("reduce_to(SUM, float64[2])", "batch_reduce_to(SUM, float64[2])"),
        "axis": ("strategy.reduce(SUM, float64[2], axis=0)", "strategy.reduce(SUM, float64[2])"),
    }
    for result in results.values():
        for case, (first, second) in calls.items():
            name, message = result[case]
            assert name == "CollectiveMismatchError", (case, message)
            assert f"worker 0 (replica 0): {first} (cross-worker" in message, message
            assert f"worker 1 (replica 1): {second} (cross-worker" in message, message
        assert result["after"] == [3.0, 6.0], result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_mismatch_of_overlapped_collectives_names_its_own_operation_number(loop):
    """Before, the message named the latest operation this worker had posted (#3,
    the second all_reduce's) while every header it listed said #2."""
    _, results, output, _ = _program(2, "overlapped_mismatch", [1, 1], loop=loop)
    assert sorted(results) == [0, 1], output[-3000:]
    for name, message in results.values():
        assert name == "CollectiveMismatchError", message
        assert message.startswith("workers disagree on cross-worker operation #2: "), message
        assert "all_reduce(SUM, float64[3]), call #0 of run 1 (cross-worker operation #2)" in (
            message
        )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_unresponsive_worker_makes_the_others_fail_within_the_timeout(loop):
    """Worker 1 stops (SIGSTOP: alive, never answering); the others report it
    within the 1.5 s timeout, naming it, and the job then ends (MPI_Abort)."""
    rc, results, output, seconds = _program(3, "stop", [1, 2, 1], timeout=60, loop=loop)
    assert sorted(results) == [0, 2], output[-3000:]
    for rank in (0, 2):
        result = results[rank]
        assert result["error"] == "RendezvousTimeoutError"
        assert "waiting for worker 1 (replicas 1-2)" in result["message"]
        assert 1.4 <= result["after"] < 5.0
    assert rc != 0 and seconds < 30


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_missing_from_a_variable_update_is_named_not_merge_fn(loop):
    """A variable's aggregated update reduces across workers in its merge_fn, and
    merge_fn's timeout, started first, always expired first: worker 0's run raised
    'merge_fn did not finish within 1.5 s ... make it faster', naming no worker."""
    rc, results, output, seconds = _program(2, "stuck_in_update", [1, 1], loop=loop)
    assert sorted(results) == [0], output[-3000:]
    error, message = results[0]["outcome"]
    assert error == "RendezvousTimeoutError", message
    assert "merge_fn did not finish within 1.5 s" in message, message
    assert "waiting for worker 1 (replica 1); worker 0 (replica 0) arrived" in message, message
    assert 1.4 <= results[0]["after"] < 5.0
    assert rc != 0 and seconds < 30  # the order is lost: the job ends with MPI_Abort


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_run_failing_on_one_worker_fails_on_every_worker_and_the_next_run_pairs(loop):
    """Worker 1's replica 2 raises before the all_reduce of run 1. Before, worker
    0's run 1 paired with worker 1's run 2 (wrong sums, then a timeout); now every
    worker's run 1 raises at once, naming worker 1 and its error, and run 2 is
    right everywhere."""
    rc, results, output, _ = _program(3, "fail_then_go_on", [2, 1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1, 2], output[-3000:]
    for rank, result in results.items():
        first, second = result["run1"], result["run2"]
        if rank == 1:
            assert first["error"] == "ValueError"
        else:
            assert first["error"] == "ReplicaExitedError", first
            assert "call #0 of run 1" in first["message"]
            assert "worker 1 (replica 2) will not join it" in first["message"]
            assert "replica 2 raised ValueError: bad batch on worker 1" in first["message"]
        assert first["after"] < 10  # not the 30 s timeout
        expected = sum(200.0 + r for r in range(4))
        assert second["result"] == [expected] * [2, 1, 1][rank], (rank, result)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_sys_exit_in_a_replica_is_named_to_the_other_workers(loop):
    """Before, the others were told "its run 1 was cancelled": SystemExit leaves
    the event loop at once, and the loop's shutdown cancels the run."""
    rc, results, output, _ = _program(2, "exit_in_replica", [1, 1], loop=loop)
    assert rc != 0  # worker 1's process exits with status 3
    assert 0 in results, output[-3000:]
    message = results[0]["message"]
    assert results[0]["error"] == "ReplicaExitedError", results[0]
    assert "worker 1 (replica 1) will not join it: its run 1 failed: replica 1 raised " in message
    assert "SystemExit: 3" in message and "cancelled" not in message


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_failed_runs_never_make_the_workers_order_drift(loop):
    """Before, a run failing on worker 0 after its last collective made the others'
    next run raise and every later run mismatch (run numbers drifted); and a failure
    while the others had two collectives in flight lost the order of the whole job."""
    rc, results, output, _ = _program(3, "failures_keep_the_order", [1, 1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1, 2], output[-3000:]
    for rank, result in results.items():
        assert result["run1"] == (["ValueError", "bad result on worker 0"] if rank == 0 else [33.0])
        for k, failer in ((2, 1), (4, 2)):
            name, message = result[f"run{k}"]
            if rank == failer:
                assert name == "ValueError", result
            else:
                # (For worker 0's run 2: its failure header for run 1 took the place
                # where the others learned of run 2's failure. Before, it never read
                # that place back, and its run 2 met their run 3: a mismatch.)
                assert name == "ReplicaExitedError", result
                assert f"worker {failer} (replica {failer}) will not join it" in message
        assert result["run3"] == [99.0] and result["run5"] == [165.0], result
        assert result["reduce"] == 3.0 and result["runs"] == 5, result
        assert max(result[f"after{k}"] for k in range(1, 6)) < 10, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_run_without_cross_worker_calls_failing_on_one_worker_keeps_the_runs_paired(loop):
    """Before, only runs making a cross-worker call were numbered, and a failed run
    was numbered for its failure header: worker 0 counted its failed run without a
    call, worker 1 did not, and from then on every run paired with the other
    worker's next one (worker 1's a raised; worker 0's a and worker 1's b gave
    1 + 10 = 11 on both, silently; then a mismatch, a timeout and MPI_Abort). Now
    every run is numbered: the failure header is stale for worker 1, whose run
    had ended, and a and b pair. Runs that differ between workers are a mismatch
    naming the runs."""
    rc, results, output, _ = _program(2, "runs_without_calls", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[0]["failed"] == ["ValueError", "bad on worker 0"], results[0]
    assert results[1]["failed"] == [1.0], results[1]
    assert results[0]["extra"] == [0.0], results[0]
    for result in results.values():
        assert result["a"] == [2.0] and result["b"] == [20.0], result
        name, message = result["c"]
        assert name == "CollectiveMismatchError", result
        assert (
            "The workers are at different runs (worker 0 (replica 0): run 5, "
            "worker 1 (replica 1): run 4)"
        ) in message
        assert "every worker must make the same strategy.run calls" in message
        assert result["reduce"] == 3.0, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_call_from_a_task_that_outlives_its_failed_run_is_of_that_run_on_every_worker(loop):
    """A task run A started calls strategy.reduce while A is still in flight on one
    worker and after it ended (failing) on the other. Which run the call belongs
    to must not depend on that timing: it is A's on both, so it raises on both and
    the next reduce pairs (before: worker 1's call belonged to no run and paired
    with worker 0's next reduce, 201 on worker 0, a timeout and MPI_Abort)."""
    rc, results, output, _ = _program(2, "stray_call", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[0]["run"] == [1.0] and results[1]["run"][0] == "ValueError", results
    for result in results.values():
        assert result["late"][0] == "ReplicaExitedError", result
        assert result["next"] == 3.0, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_failures_in_a_row_on_one_worker_keep_the_runs_paired(loop):
    """Worker 1's runs 1-4 fail before any collective, while worker 0's start two
    collectives each. Before, worker 0's second exchange of run k met worker 1's
    failure header of run k + 1 and counted that run as made: worker 0's runs were
    numbered one further for good, its run 5 met worker 1's strategy.reduce (a
    mismatch), and the job ended at the timeout with MPI_Abort."""
    rc, results, output, _ = _program(2, "failures_in_a_row", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for k in range(1, 5):
        assert results[1][f"run{k}"] == ["ValueError", f"bad batch {k} on worker 1"]
        name, message = results[0][f"run{k}"]
        assert name == "ReplicaExitedError", message
        assert f"call #0 of run {k}: worker 1 (replica 1) will not join it: its run {k} " in (
            message
        )
    for result in results.values():
        assert result["run5"] == [110.0] and result["reduce"] == 3.0, result
        assert result["runs"] == 5, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_failed_runs_are_forgotten_once_no_header_of_them_can_come(loop):
    """Before, every failed run stayed in World.failed_runs (and the peers' failure
    texts in World._failures, and exchanges given up in World._pending) for good:
    a server whose requests fail now and then grew without bound (450 entries
    here). Now a run is forgotten once no worker can still post a header of it.
    Worker 0 keeps its first error: before, its traceback kept that run alive
    (forgetting went by whether a run was still referenced), and every later
    failed run stayed on both workers (450 entries)."""
    rc, results, output, _ = _program(2, "many_failures", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["last"] == [22000.0] and result["reduce"] == 3.0, result
        assert result["runs"] == 451, result
        assert result["failed_runs"] <= 10 and result["failures"] <= 10, result
        assert result["pending"] == 0, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_runs_that_all_succeed_keep_a_few_of_the_peers_lows(loop):
    """Before, World._peer_lows kept one entry per run per peer for good when no
    run failed (400 here): it was trimmed only where a failed run was forgotten."""
    rc, results, output, _ = _program(2, "many_successes", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["reduce"] == 3.0 and result["failed_runs"] == 0, result
        assert result["lows"] <= 2, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_overlapped_calls_after_a_run_failed_elsewhere_pair_right(loop):
    """Worker 1's runs 1 and 3 fail after their last collective. Before, worker 0's
    next exchange met the stale failure header while its following one was already
    posted: run 2's two overlapped collectives failed with CollectiveMismatchError on
    both workers, and two gathered strategy.reduce gave [11.0, 11.0], not [2.0, 20.0]."""
    rc, results, output, _ = _program(2, "overlapped_after_a_failure", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for rank, result in results.items():
        for k in (1, 3):
            want = [["ValueError", f"bad result {k} on worker 1"], [2.0 * k]][rank == 0]
            assert result[f"run{k}"] == want, result
        assert result["run2"] == [[4.0, [20.0, 20.0]]], result
        assert result["reduces"] == [2.0, 20.0], result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_that_gives_up_mid_operation_keeps_the_order(loop):
    """Worker 1's run is cancelled while its all_reduce's header exchange waits for
    worker 0. Before, that lost the order: worker 0's call failed ("worker 1 lost
    the workers' order of operations"), and the job ended with MPI_Abort. Now the
    all_reduce finishes first (the cancelled run waits for it): worker 0 gets its
    result, and the next cross-worker call pairs on both workers."""
    rc, results, output, _ = _program(2, "give_up", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[1]["error"] == "TimeoutError"  # asyncio.wait_for's
    assert results[0]["error"] is None, results[0]
    assert all(r["reduce"] == 2.0 and r["after"] < 10 for r in results.values()), results


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_loop_ending_while_a_collective_finishes_tells_the_others_at_once(loop):
    """Worker 1's replica raises while its all_reduce's header exchange waits for
    worker 0; its run waits for the all_reduce, and worker 1's loop ends meanwhile,
    cancelling the run and the all_reduce. Worker 0 matched its header: it must fail
    at once (the order is lost), not wait in the data step for the 30 s timeout
    (before the fix: the cancelled exchange was taken as stale, since its run had
    failed since)."""
    rc, results, output, _ = _program(2, "loop_ends_while_finishing", [1, 1], loop=loop)
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[1]["error"] == "ValueError" and results[1]["running"], results[1]
    assert results[0]["error"] == "RendezvousError", results[0]
    assert "worker 1 lost the workers' order of operations" in results[0]["message"]
    assert "was cancelled while waiting for the other workers" in results[0]["message"]
    assert results[0]["after"] < 10, results[0]
    assert results[1]["reduce"][0] == "RendezvousError", results[1]
    assert rc != 0  # the order is lost: the job ends with MPI_Abort


def test_a_background_collective_that_fails_is_logged_on_its_worker():
    """Worker 1's replica raised after its all_reduce posted its header; the
    all_reduce, which the run lets finish, times out (worker 0 never joins): the run
    raises the replica's error, and worker 1 says so on the aiodist logger (its
    error was dropped before)."""
    _rc, results, output, _ = _launch(2, str(PROGRAM), "background_fails", "1,1", timeout=40)
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[1]["error"] == "ValueError", results[1]
    assert (
        "call #0 of run 1, finished after its run failed (or it was cancelled), failed on "
        "worker 1: RendezvousTimeoutError"
    ) in output, output[-3000:]


def test_a_dropped_strategy_still_finishes_its_cancelled_reduce():
    """Worker 1 cancels its strategy.reduce, whose header was sent, twice (the
    second time while the reduce finishes), and drops the strategy: the reduce
    finishes in the background (the strategy is kept alive until then), so worker
    0 gets its result at once, not a 30 s timeout (before the fix: the collected
    strategy closed its world under the reduce)."""
    rc, results, output, _ = _launch(2, str(PROGRAM), "reduce_then_drop", "1,1")
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[0]["reduce"] == 3.0 and results[0]["after"] < 10, results[0]
    assert results[1]["collected"], results[1]  # (once the reduce finished)
    assert rc == 0, output[-3000:]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(
    ("how", "second"),
    [("raise", False), ("cancel", False), ("raise", True), ("cancel", True)],
    ids=["raise", "cancel", "raise-then-call", "cancel-then-call"],
)
def test_a_run_failing_after_its_collective_agreed_keeps_the_order(how, second, loop):
    """Worker 1's run 1 fails (a replica raises, or the run is cancelled) while its
    all_reduce, agreed on both workers, waits in its data step for worker 0. Before,
    worker 1 gave the collective up: every later cross-worker call on both workers
    raised ("lost the workers' order of operations") and the job ended with
    MPI_Abort. Now its data step is made before the run ends: worker 0 gets that
    all_reduce's right result (and, where run 1 calls again, ReplicaExitedError
    naming worker 1), and run 2 and a strategy.reduce pair on both workers."""
    env = {"AIODIST_TEST_HOW": how, "AIODIST_TEST_NEXT": "1" if second else "0"}
    rc, results, output, _ = _program(2, "after_agreed", [1, 1], loop=loop, env=env)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    mine = ["ValueError", "bad batch on worker 1"] if how == "raise" else ["TimeoutError", ""]
    assert results[1]["run1"] == mine, results[1]
    if second:
        name, message = results[0]["run1"]
        assert name == "ReplicaExitedError", results[0]
        assert "call #1 of run 1" in message, message
        assert "worker 1 (replica 1) will not join it: its run 1 " in message, message
    else:
        assert results[0]["run1"] == [21.0], results[0]
    for result in results.values():
        assert result["run2"] == [41.0] and result["reduce"] == 1.0, result
        assert result["after1"] < 10 and result["after2"] < 10, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("how", ["agreed", "overlapped", "last"])
def test_a_synchronous_call_right_after_a_failed_run_is_made_on_every_worker(how, loop):
    """Run 1 fails on worker 1; then every worker creates a variable. Before, the
    worker whose collective of run 1 was still finishing (worker 1's, agreed and in
    its data step; or worker 0's second one, overlapped, whose run had failed
    everywhere) refused it ("while 1 asynchronous one(s) of this worker are in
    flight") while the other made it: a mismatch, then a timeout and MPI_Abort.
    Now a failed run ends once such a collective has finished (one of a run known
    failed everywhere, which nobody waits for, is given up at once: "last", where
    the program ends after the run, shows it is not waited for)."""
    env = {"AIODIST_TEST_HOW": how}
    rc, results, output, _ = _program(2, "sync_after_a_failed_run", [1, 1], loop=loop, env=env)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[1]["run"] == "ValueError", results[1]
    assert results[0]["run"] == (3.0 if how == "agreed" else "ReplicaExitedError"), results[0]
    for result in results.values():
        assert result["after"] < 5, result
        if how != "last":
            assert result["variable"] == [0.0, 0.0] and result["reduce"] == 2.0, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_operations_queued_for_their_turn_fail_at_once_when_the_order_is_lost(loop):
    """Before, each of the operations queued behind one that timed out waited for
    its own timeout in turn (1.5, 3.0, 4.5, 6.0 s)."""
    rc, results, output, _ = _program(2, "queued_after_a_timeout", [1, 1], loop=loop)
    assert 0 in results, output[-3000:]
    errors = results[0]
    assert [error for error, _ in errors] == ["RendezvousTimeoutError"] * 4, errors
    assert max(after for _, after in errors) < 3.0, errors
    assert rc != 0  # the order is lost: the job ends with MPI_Abort


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_closing_while_an_operation_is_in_flight_is_refused_naming_it(loop):
    """Before, close() went ahead: the reduce in flight waited until its timeout
    (30 s here), and the job ended with MPI_Abort."""
    rc, results, output, _ = _program(2, "close_in_flight", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    refused = results[0]["refused"]
    assert refused.startswith(
        "strategy.close() was called while 1 cross-worker operation(s) of this worker "
        "are in flight (strategy.reduce(SUM, float64[]));"
    ), refused
    for result in results.values():
        assert result["result"] == 2.0 and result["after"] < 10, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_dropped_or_closed_strategy_ends_its_communication_thread(loop):
    """Before, every strategy left a thread and a communicator behind for good."""
    rc, results, output, _ = _program(2, "closing", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["before"] == result["after_dropping"] == 1, result
        assert result["after_closing"] == 0
        assert "was closed (strategy.close())" in result["refused"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_strategy_collected_on_its_own_communication_thread_closes_it(loop):
    """Before, the finalizer joined the thread it ran on: RuntimeError."""
    rc, results, output, _ = _program(2, "finalizer_on_thread", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert "cannot join current thread" not in output
    for result in results.values():
        assert result == {"ran_on": ["aiodist-mpi"], "errors": [], "alive": False}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_waiting_for_the_others_reports_the_stall(loop):
    """SPEC 11 across workers: the waiting worker warns once, at
    stall_warning_seconds (0.5 s; the other worker is 1.6 s late), naming the
    collective, its call number and the missing worker and replicas."""
    rc, results, output, _ = _program(2, "stall", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert results[1] == []
    [warning] = results[0]  # one warning: not one more at 1.0 s
    assert warning.startswith(
        "all_reduce(SUM, float64[]), call #0 of run 1 has waited 0.5 s for the other "
        "workers: worker 0 (replica 0) arrived, worker 1 (replica 1) missing."
    ), warning


def test_a_killed_worker_ends_the_job_instead_of_hanging():
    """mpiexec ends every worker as soon as one dies (SIGKILL mid-run)."""
    rc, results, output, seconds = _program(3, "kill", [1, 1, 1], timeout=60)
    assert rc != 0
    assert seconds < 30, output[-3000:]
    assert 1 not in results


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_messages_name_a_workers_replicas_by_their_global_ids(loop):
    """Worker 1 holds global replicas 2 and 3. Before, its own rendezvous errors,
    statistics and contexts named them 0 and 1, and its failure header carried
    that to worker 0: "worker 1 (replicas 2-3) will not join it: ... replica 1
    returned without calling it, while replica 0 waits in it" (worker 0's ids)."""
    rc, results, output, _ = _program(2, "global_ids", [2, 2], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    exited = "all_reduce #0: replica 3 returned without calling it, while replica 2 waits in it"
    mismatch = (
        "collective #0 does not match across replicas: replica 2 called "
        "all_reduce(SUM, float64[]); replica 3 called all_reduce(MAX, float64[])"
    )
    for rank, result in results.items():
        for kind, text in (("exit", exited), ("mismatch", mismatch)):
            name, message = result[kind]
            mine = "ReplicaExitedError" if kind == "exit" else "CollectiveMismatchError"
            assert name == ("ReplicaExitedError" if rank == 0 else mine), result
            assert text in message, message
            if rank == 0:
                assert "worker 1 (replicas 2-3) will not join it" in message, message
    assert results[0]["statistics"] == [[4.0, ""], [4.0, ""]], results
    assert results[1]["statistics"] == [[4.0, ""], [4.0, "[((2,), (3,))]"]], results
    assert results[0]["contexts"] == [
        f"<ReplicaContext replica {r} of 4 on /device:CPU:{r}>" for r in (0, 1)
    ]
    assert results[1]["contexts"] == [
        f"<ReplicaContext replica {r} of 4 on /device:CPU:{r - 2}>" for r in (2, 3)
    ]


def test_variables_created_in_another_order_on_one_worker_are_a_mismatch():
    """Worker 1 creates variables b and a (of one shape) where worker 0 creates a
    and b. Before, each took the other's initial value from worker 0, silently
    (a = [98, 98] on worker 1, [97, 97] on worker 0)."""
    rc, results, output, _ = _program(2, "variable_order", [1, 1])
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert (
            "worker 0 (replica 0): Variable 'a' (cross-worker operation #2); "
            "worker 1 (replica 1): Variable 'b' (cross-worker operation #2)"
        ) in result["created"], result
        assert result["c"] == [1.0, 1.0] and result["reduce"] == 2.0, result


def test_a_mismatch_of_calls_that_read_alike_names_what_differs():
    """Variables of one name but another shape or dtype, and all_reduces of one
    value with another bytes_per_pack: before, the message showed the same text
    for both workers, and nothing of what differed."""
    rc, results, output, _ = _program(2, "alike_mismatch", [1, 1])
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        differs = "what each must agree on differs (worker 0 (replica 0): "
        assert differs + "broadcast <f8(2,) of 'v'; " in result["shape"], result
        assert "worker 1 (replica 1): broadcast <f8(3,) of 'v')" in result["shape"], result
        assert differs + "broadcast <f8(2,) of 'v'; " in result["dtype"], result
        assert "worker 1 (replica 1): broadcast <f4(2,) of 'v')" in result["dtype"], result
        assert "bytes_per_pack=0; worker 1 (replica 1): " in result["packs"], result
        assert result["packs"].count("bytes_per_pack=16)") == 1, result
        assert result["reduce"] == 2.0, result


def test_a_merge_fn_reduce_never_pairs_with_a_reduce_outside_any_run():
    """A run made on worker 0 only, whose merge_fn reduces, met worker 1's
    strategy.reduce of one shape outside any run: the headers' run numbers were
    not compared for cross-replica calls, so both returned 15.0, silently."""
    rc, results, output, _ = _program(2, "run_on_one_worker", [1, 1])
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["first"][0] == "CollectiveMismatchError", result
        assert (
            "The workers are at different runs (worker 0 (replica 0): run 1, "
            "worker 1 (replica 1): outside any run)"
        ) in result["first"][1], result
        assert result["after"] == 2.0, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_cross_replica_call_refused_on_one_worker_fails_at_once_on_every_worker(loop):
    """Before, the worker that refused its values raised without sending a header:
    the others waited for it until their timeout, and the order was lost."""
    rc, results, output, _ = _program(2, "refused_on_one_worker", [1, 2], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    ours, theirs = results[1], results[0]
    assert ours["reduce"][0] == "InvalidArgumentError", ours
    assert "axis=0 for rank-0 values" in ours["reduce"][1], ours
    assert ours["gather"][0] == "InvalidArgumentError", ours
    assert "shapes may differ only along axis 0" in ours["gather"][1], ours
    assert theirs["reduce"][0] == "CollectiveMismatchError", theirs
    assert (
        "worker 1 (replicas 1-2): strategy.reduce(SUM, axis=0), which it refused: "
        "InvalidArgumentError: reduce: axis=0 for rank-0 values"
    ) in theirs["reduce"][1], theirs
    assert theirs["gather"][0] == "CollectiveMismatchError", theirs
    assert (
        "worker 1 (replicas 1-2): strategy.gather(axis=0), which it refused: "
        "InvalidArgumentError: gather: shapes may differ only along axis 0"
    ) in theirs["gather"][1], theirs
    for result in results.values():
        assert result["after"] == [3.0] and result["seconds"] < 10, result


def test_workers_updating_different_variables_at_one_place_is_a_mismatch():
    """Before, a variable's aggregated update exchanged a header without its name
    or write: v.assign on one worker and v.assign_add on the other (or f and g)
    paired, and the mirrored copies differed between workers, silently."""
    rc, results, output, _ = _program(2, "updates_differ", [1, 1])
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["v"][0] == "CollectiveMismatchError", result
        assert (
            "worker 0 (replica 0): v.assign(SUM, float64[2]) (cross-worker operation #5); "
            "worker 1 (replica 1): v.assign_add(SUM, float64[2])"
        ) in result["v"][1], result
        assert result["f"][0] == "CollectiveMismatchError", result
        assert "worker 0 (replica 0): f: the first replica's value" in result["f"][1], result
        assert "worker 1 (replica 1): g: the first replica's value" in result["f"][1], result
        assert result["values"] == [[5.0, 5.0], [0.0, 0.0], [0.0, 0.0]], result


def test_sync_on_read_variables_read_in_another_order_are_a_mismatch():
    """Before, a read's exchange did not name its variable: a and b (one shape)
    read in another order on one worker swapped values between them, silently."""
    rc, results, output, _ = _program(2, "reads_in_another_order", [1, 1])
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        for message in result["swapped"]:
            assert "workers disagree" in message, result
            assert "reading sync-on-read variable 'a' (SUM)" in message, result
            assert "reading sync-on-read variable 'b' (SUM)" in message, result
        assert result["alike"] == [[2.0, 2.0], [20.0, 20.0]], result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_variable_refused_on_one_worker_fails_at_once_on_every_worker(loop):
    """Before, the worker that refused a variable's initial value raised without
    sending a header: the others' creation paired with its next call, and a later
    call waited until the timeout, which lost the order for good."""
    rc, results, output, _ = _program(3, "variable_refused_on_one_worker", [1, 2, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1, 2], output[-3000:]
    assert results[1]["v"][0] == "InvalidArgumentError", results[1]
    assert "v: initial_value has dtype <U1; expected numbers" in results[1]["v"][1]
    assert results[2]["v"] == ["RuntimeError", "no value here"], results[2]
    assert results[2]["w"][0] == "InvalidArgumentError", results[2]
    assert "synchronization='bogus'" in results[2]["w"][1], results[2]
    assert results[0]["v"][0] == "CollectiveMismatchError", results[0]
    for told in (
        "worker 1 (replicas 1-2): Variable 'v', which it refused: InvalidArgumentError: "
        "v: initial_value has dtype <U1; expected numbers",
        "worker 2 (replica 3): Variable 'v', which it refused: RuntimeError: no value here",
    ):
        assert told in results[0]["v"][1], results[0]
    for rank in (0, 1):
        assert results[rank]["w"][0] == "CollectiveMismatchError", results[rank]
        assert (
            "worker 2 (replica 3): Variable 'w', which it refused: InvalidArgumentError: "
            "synchronization='bogus'"
        ) in results[rank]["w"][1], results[rank]
    for result in results.values():
        assert result["after"] == [4.0] and result["seconds"] < 10, result


def test_input_contexts_name_workers_and_global_replicas():
    rc, results, output, _ = _program(2, "inputs", [2, 1])
    assert rc == 0, output[-3000:]
    # PER_WORKER: one pipeline per worker; PER_REPLICA: one per global replica.
    assert results[0]["contexts"] == [[2, 0, 3], [3, 0, 3], [3, 1, 3]]
    assert results[1]["contexts"] == [[2, 1, 3], [3, 2, 3]]


def test_a_batcher_on_each_worker_splits_its_batches_over_its_own_replicas():
    rc, results, output, _ = _program(2, "batcher", [2, 1])
    assert rc == 0, output[-3000:]
    # Worker 0 holds global replicas 0 and 1, worker 1 replica 2; each ran all
    # of its own 12 rows.
    assert results[0] == {"right": True, "replicas": [0, 1], "rows": 12}
    assert results[1] == {"right": True, "replicas": [2], "rows": 12}


def test_statistics_count_each_workers_collective_bytes():
    rc, results, output, _ = _program(2, "statistics", [2, 1])
    assert rc == 0, output[-3000:]
    # Each worker counts its own replicas' inputs: 24 + 16 bytes each.
    assert results[0] == {"bytes_reduced": 2 * 40}
    assert results[1] == {"bytes_reduced": 1 * 40}


def test_structures_of_distributed_values_are_refused_across_workers():
    rc, results, output, _ = _program(2, "structures", [2, 2])
    assert rc == 0, output[-3000:]
    for result in results.values():
        assert result == [
            f"{where} is a {what} holding distributed values"
            for where, what in [
                ("strategy.reduce: value", "dict (keys 'loss')"),
                ("strategy.gather: value", "list of 1"),
                ("reduce_to: value", "list of 1"),
                ("batch_reduce_to: a pair's value", "dict (keys 'loss')"),
            ]
        ]
    # A dict is refused even where it holds no distributed value (one replica each).
    rc, results, output, _ = _program(2, "structures", [1, 1])
    assert rc == 0, output[-3000:]
    for result in results.values():
        assert result[0] == "strategy.reduce: value is a dict (keys 'loss')"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_structures_keyed_by_frozensets_of_str_agree_across_hash_seeds(loop):
    """Workers compare a collective's structure as text: a frozenset's repr lists
    str members in hash order, which differs between processes, and raised a
    false CollectiveMismatchError for one structure. A real mismatch's message
    showed each worker's structure in its own hash order (the same frozenset read
    differently on the two lines): the lines use the stable text too."""
    seeds = [1, 2]  # (these two order frozenset({"alpha", ..., "delta"}) differently)
    rc, results, output, _ = _program(2, "hash_seeds", [1, 1], loop=loop, hash_seeds=seeds)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["seed"] in ("1", "2")
        assert result["reduced"] == [["alpha,beta,delta,gamma", [2.0, 2.0]], ["x", [2.0]]]
        assert result["nested"] == [[["a,b,c", 1], [2.0]], [["d", 2], [3.0]]]
        assert result["gathered"] == [["alpha,beta,delta,gamma", [1.0, 1.0]], ["x", [1.0, 1.0]]]
        mismatch = result["mismatch"]
        for worker, shape in ((0, 2), (1, 3)):
            line = (
                f"worker {worker} (replica {worker}): all_reduce(SUM, "
                f"{{frozenset({{'alpha', 'beta', 'delta', 'gamma'}}): float64[{shape}]}})"
            )
            assert line in mismatch, mismatch
    assert results[0]["mismatch"] == results[1]["mismatch"]


def test_a_variable_made_outside_any_scope_is_reduced_as_its_value():
    """Worker 0 has two replicas: its one copy was taken for one value per local
    replica ("PerReplica: 1 values but 2 devices"), where MirroredStrategy reduces
    such a variable as its value."""
    rc, results, output, _ = _program(2, "plain_variable", [2, 1])
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result == {"mean": [1.0, 2.0], "max": [1.0, 2.0], "reduce_to": [1.0, 2.0]}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_failed_run_keeps_no_replica_frame_alive(loop):
    """Before, the strategy kept the failing replica's exception (its traceback, so
    the replica's frames and their arrays) until the next run, or for good after
    the last: one process's MirroredStrategy keeps nothing."""
    rc, results, output, _ = _program(2, "failed_run_frees", [2, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert results == {0: {"alive": 0, "replicas": 2}, 1: {"alive": 0, "replicas": 1}}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("counts", [[2, 1], [2, 2]], ids=["uneven", "2x2"])
def test_sum_of_a_plain_value_with_several_replicas_on_a_worker_is_refused_as_on_one_machine(
    counts, loop
):
    """Before, each worker summed one copy per local replica (SUM of [1, 2] gave
    [4, 8] on 2x2, [3, 6] on 2+1), where one process with as many replicas refuses
    it as ambiguous (TF too). Now every worker refuses it (on 2+1 worker 1, with one
    replica, would otherwise have waited for worker 0 until the timeout), and the
    order is kept."""
    rc, results, output, _ = _program(len(counts), "plain_values", counts, loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == list(range(len(counts))), output[-3000:]
    from tests.mpi_programs import plain_values

    alone = aiodist.run(plain_values(aiodist.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])))
    for result in results.values():
        for key in ("sum", "product", "reduce_to", "batch"):
            assert result[key][0] == alone[key][0] == "InvalidArgumentError", (key, result)
            assert "worker 0 (replicas 0-1): ndarray for its 2 replicas" in result[key][1]
            assert ("worker 1 (replicas 2-3)" in result[key][1]) == (counts == [2, 2])
        assert result["mean"] == result["max"] == result["after"] == [1.0, 2.0], result
        assert alone["mean"] == alone["max"] == [1.0, 2.0], alone


def test_sum_of_a_plain_value_with_one_replica_per_worker_sums_the_workers_values():
    """One replica per worker: the value is that worker's replica's (as a merge_fn
    receives it), so SUM adds one per worker."""
    rc, results, output, _ = _program(2, "plain_values", [1, 1])
    assert rc == 0, output[-3000:]
    for result in results.values():
        assert result["sum"] == result["reduce_to"] == [2.0, 4.0], result
        assert result["product"] == [1.0, 4.0] and result["mean"] == [1.0, 2.0], result


@pytest.mark.parametrize("bad", [0, -1])
def test_a_replica_count_below_one_is_refused(bad):
    with pytest.raises(aiodist.InvalidArgumentError, match=rf"devices_per_worker={bad}; expected"):
        aiodist.MultiWorkerMirroredStrategy(bad)


@pytest.mark.parametrize("bad", [2.5, np.float64(2.0), True, np.bool_(True), "cpu:0", "cpux"])
def test_a_devices_per_worker_of_another_kind_is_refused_naming_every_accepted_form(bad):
    """Before, these got one machine's device-list message: "expected a list of
    device strings" (not the count that devices_per_worker also takes), and for a
    string, "e.g. ['cpux'] (or use OneDeviceStrategy)", even where it is no device."""
    with pytest.raises(aiodist.DeviceError) as caught:
        aiodist.MultiWorkerMirroredStrategy(bad)
    message = str(caught.value)
    assert message.startswith(f"devices_per_worker={bad!r} (of type {type(bad).__name__}); ")
    assert "an int k >= 1 (CPU devices cpu:0 ... cpu:k-1)" in message
    assert "a list of device strings such as ['cpu:0', 'cpu:1']" in message
    assert "OneDeviceStrategy" not in message


def test_a_numpy_integer_count_of_devices_per_worker_is_taken():
    # As every count argument takes NumPy's integers (whole_number); it was refused
    # as "expected ... a Python int k >= 1".
    program = (
        "import numpy as np, aiodist\n"
        "s = aiodist.MultiWorkerMirroredStrategy(np.int64(2))\n"
        "print(s.extended.worker_devices, type(s.num_replicas_in_sync).__name__)\n"
    )
    rc, _, output, _ = _launch(1, "-c", program)
    assert rc == 0, output[-3000:]
    assert "('/device:CPU:0', '/device:CPU:1') int" in output, output[-3000:]


def test_concurrent_runs_are_serialised_and_all_correct():
    rc, results, output, _ = _program(2, "concurrent", [2, 2])
    assert rc == 0, output[-3000:]
    for result in results.values():
        assert result == [4.0 * 4 * k for k in range(4)]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_run_cancelled_while_waiting_for_its_turn_keeps_its_place(loop):
    """Worker 1 gives up run B while B waits for run A. Before, worker 0's B paired
    with worker 1's next run C (110.0, the sum of B's and C's values), and worker
    0's C waited until the timeout (the job then ended with MPI_Abort). Now worker
    0's B raises naming worker 1, and C pairs."""
    rc, results, output, _ = _program(2, "cancelled_in_turn", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    assert results[1]["b"] == ["TimeoutError", ""], results[1]
    name, message = results[0]["b"]
    assert name == "ReplicaExitedError", results[0]
    assert "worker 1 (replica 1) will not join it: its run 2 was cancelled before it started" in (
        message
    )
    for result in results.values():
        assert result["a"] == 2.0 and result["c"] == 200.0, result
        assert result["after"] < 10, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_run_inside_a_runs_merge_fn_is_refused_not_deadlocked(loop):
    """Before, the inner run waited forever for the end of the outer run, which
    waited for it (runs are serialised). run(options=...) is refused there too
    (it was taken and ignored), and the next run still pairs."""
    rc, results, output, _ = _program(2, "run_in_merge_fn", [1, 1], loop=loop)
    assert rc == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        name, message = result["nested"]
        assert name == "ContextError", result
        assert message.startswith("strategy.run() was called inside a run of this "), message
        name, message = result["options"]
        assert name == "InvalidArgumentError", result
        assert message.startswith("run: options=CommunicationOptions("), message
        assert result["after"] < 3 and result["next"] == 2.0, result


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_synchronous_read_during_a_cross_worker_call_is_refused_not_deadlocked(loop):
    rc, results, output, _ = _program(2, "busy", [2, 1], loop=loop)
    assert rc == 0, output[-3000:]
    for result in results.values():
        assert "while 1 asynchronous one(s) of this worker are in flight" in result["refused"]
        assert "sync-on-read variable 'Variable' (SUM)" in result["refused"]
        assert result["reduced"] == result["read"] == 3.0  # a copy of 1.0 per replica


def test_the_demo_gives_the_weights_of_one_process():
    args = ["-m", "aiodist", "--devices", "cpu:0,cpu:1", "--steps", "20"]
    rc, _, output, _ = _launch(2, *args)
    assert rc == 0, output[-3000:]
    alone = run_demo("--devices", "cpu:0,cpu:1,cpu:2,cpu:3", "--steps", "20")
    assert alone.returncode == 0, alone.stderr

    def weights(text: str) -> np.ndarray:
        lines = [line for line in text.splitlines() if line.startswith("final weights:")]
        assert len(lines) == 1, text[-2000:]  # only worker 0 prints
        return np.array(lines[0].split(":")[1].split(), dtype=float)

    np.testing.assert_allclose(weights(output), weights(alone.stdout), rtol=0, atol=1e-12)
    assert "2 workers, 4 replicas in all" in output


def test_import_never_imports_mpi4py():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, aiodist; print('mpi4py' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["False"]


@pytest.mark.skipif(visible_gpu_count() > 0, reason="here GPU devices work")
def test_gpu_devices_without_cupy_or_a_gpu_are_refused_clearly():
    rc, _, output, _ = _launch(
        1, "-c", "import aiodist; aiodist.MultiWorkerMirroredStrategy(['GPU:0'])"
    )
    assert rc != 0
    assert "DeviceError" in output and "GPU:0" in output and "CuPy" in output


# -- GPU replicas across workers: NCCL over every worker's GPUs -------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    visible_gpu_count() == 0,
    reason="needs CuPy and a CUDA GPU (pip install 'aiodist[cuda12]' or 'aiodist[cuda13]')",
)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("per_worker", [1, 2], ids=["1gpu-per-worker", "2gpus-per-worker"])
def test_gpu_replicas_across_workers_equal_one_process(per_worker, loop):
    """One worker per GPU (or per pair of GPUs): one NCCL rank per GPU, as NCCL
    needs; with a single GPU that is one worker whose communicator is still made
    from a unique id sent over MPI, with the header exchange and the same code."""
    gpus = visible_gpu_count()
    if gpus < per_worker:
        pytest.skip(f"needs {per_worker} GPUs per worker, {gpus} visible")
    workers = gpus // per_worker
    counts = [per_worker] * workers
    rc, results, output, _ = _program(workers, "compute", counts, loop=loop, gpus=True)
    assert rc == 0, output[-3000:]
    expected = _one_process(sum(counts), "gpu")
    per_replica = {}
    for rank, result in results.items():
        per_replica.update(result["per_replica"])
        assert _close(result["cross"], expected["cross"]), (rank, result, expected["cross"])
    assert _close(per_replica, expected["per_replica"])


@pytest.mark.gpu
@pytest.mark.skipif(
    visible_gpu_count() == 0,
    reason="needs CuPy and a CUDA GPU (pip install 'aiodist[cuda12]' or 'aiodist[cuda13]')",
)
def test_workers_sharing_a_gpu_are_refused_on_every_worker():
    """NCCL serves one rank per GPU: two workers on GPU:0 would fail or wait
    inside NCCL, so both refuse at start-up, naming the GPU."""
    program = "import aiodist\naiodist.MultiWorkerMirroredStrategy(['GPU:0'])\n"
    rc, _, output, seconds = _launch(2, "-c", program)
    assert rc != 0 and seconds < 30, output[-3000:]
    assert output.count("workers share GPUs") == 2, output[-3000:]


def test_a_worker_that_cannot_build_its_strategy_stops_every_worker():
    """Worker 1 asks for a GPU: without CuPy it cannot build its strategy, and
    says so to the others, which raise naming it instead of waiting for it. (On a
    GPU machine both build, and both refuse the mix of CPU and GPU workers: NCCL
    and MPI collectives could never meet.)"""
    program = (
        "import os, aiodist\n"
        "rank = int(os.environ['PMI_RANK'])\n"
        "aiodist.MultiWorkerMirroredStrategy(['cpu:0'] if rank == 0 else ['GPU:0'])\n"
    )
    rc, _, output, seconds = _launch(2, "-c", program)
    assert rc != 0 and seconds < 30, output[-3000:]
    if visible_gpu_count():
        assert output.count("worker 0: CPU, worker 1: GPU") == 2, output[-3000:]
    else:
        assert "could not start: worker 1 failed with DeviceError" in output, output[-3000:]
        assert "CuPy is not installed" in output


def test_a_strategy_that_fails_to_start_leaves_no_communication_thread():
    """Worker 1 cannot build its strategy (a GPU without CuPy, or, on a GPU machine,
    a mix of kinds): both raise, and neither keeps the strategy's thread."""
    program = (
        "import os, threading, aiodist\n"
        "rank = int(os.environ['PMI_RANK'])\n"
        "outcome = 'built'\n"
        "try:\n"
        "    aiodist.MultiWorkerMirroredStrategy(['cpu:0'] if rank == 0 else ['GPU:0'])\n"
        "except Exception as exc:\n"
        "    outcome = type(exc).__name__\n"
        "alive = [t for t in threading.enumerate() if t.name == 'aiodist-mpi']\n"
        "# one write per worker: a line the other worker's output cannot split\n"
        "os.write(1, f'<{outcome} threads={len(alive)}>'.encode())\n"
    )
    rc, _, output, seconds = _launch(2, "-c", program)
    assert rc == 0 and seconds < 30, output[-3000:]
    assert output.count("<DeviceError threads=0>") == 2, output[-3000:]


def test_a_worker_that_never_builds_its_strategy_is_named_at_start_up():
    program = (
        "import os, time, aiodist\n"
        "from mpi4py import MPI\n"
        "if int(os.environ['PMI_RANK']) == 1:\n"
        "    time.sleep(60)  # busy elsewhere: never builds the strategy\n"
        "options = aiodist.CommunicationOptions(timeout_seconds=1.5)\n"
        "aiodist.MultiWorkerMirroredStrategy(1, communication_options=options)\n"
    )
    rc, _, output, seconds = _launch(2, "-c", program)
    assert rc != 0 and seconds < 30, output[-3000:]
    assert "starting MultiWorkerMirroredStrategy: timed out after 1.5 s" in output
    assert "waiting for the other workers (2 in this job)" in output
