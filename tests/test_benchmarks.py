"""The benchmark suite's command line refuses bad arguments by name; its
workloads measure real runs (the figures themselves are not asserted here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from benchmarks import instructions, workloads
from benchmarks.__main__ import (
    FLOORED,
    IN_FLIGHT,
    ROWS,
    _floored_round,
    _scaling,
    _scaling_table,
    _table,
    _x_floor,
    main,
)
from tests.conftest import assert_usage_error


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--replicas", "2,x"], "argument --replicas: '2,x'; expected distinct comma-separated"),
        (["--replicas", "0,2"], "argument --replicas: '0,2'; expected distinct comma-separated"),
        (["--replicas", ""], "argument --replicas: ''; expected distinct comma-separated"),
        (["--replicas", "2,2"], "argument --replicas: '2,2'; expected distinct comma-separated"),
        (["--json", "/no/such/folder/out.json"], "the folder '/no/such/folder' does not exist"),
        (["--json", "."], "--json '.' is a folder; expected a file to write the figures to"),
        (["--gpu", "--json", "/"], "--json '/' is a folder; expected a file"),
        (["--tf-python", "/no/such/python"], "--tf-python '/no/such/python': no such executable"),
        (["--repeats", "0"], "argument --repeats: '0'; expected a whole number >= 1"),
        (["--repeats", "two"], "argument --repeats: 'two'; expected a whole number >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, shown, capsys):
    assert_usage_error(main, argv, shown, capsys)


def test_help_shows_the_example_command_lines_one_per_line(capsys):
    # The default formatter reflowed the description, examples included, into
    # "... how many times faster aiodist is. python -m benchmarks --quick # under a
    # minute on 2 cores python -m benchmarks --json out.json # full run, ...".
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    for command in ("--quick ", "--json out.json ", "--gpu "):
        assert any(line.startswith(f"python -m benchmarks {command}") for line in lines), lines
    assert not any("``" in line for line in lines), lines  # (the docstring's reST quotes)


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--replicas", "0"], "--replicas 0; expected a whole number >= 1"),
        (["--replicas", "-2"], "--replicas -2; expected a whole number >= 1"),
        (["--replicas", "2", "--repeats", "0"], "--repeats 0; expected a whole number >= 1"),
        (["--replicas", "a"], "argument --replicas: invalid int value: 'a'"),
    ],
)
def test_the_tensorflow_side_refuses_bad_arguments_by_name(argv, shown, capsys):
    # Parsed before TensorFlow is imported: checkable without it.
    from benchmarks import tf_workloads

    assert_usage_error(tf_workloads.main, argv, shown, capsys)


def test_the_tensorflow_side_gets_the_same_repeats(tmp_path):
    from benchmarks.__main__ import _tensorflow

    seen = tmp_path / "argv"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {seen}\necho "{{}}"\n')
    fake.chmod(0o755)
    assert _tensorflow(str(fake), 2, True, 7) == {}
    assert seen.read_text().split() == [
        "-m",
        "benchmarks.tf_workloads",
        "--replicas",
        "2",
        "--repeats",
        "7",
        "--quick",
    ]


def _fake_python(tmp_path, script: str) -> str:
    """An executable standing in for the TensorFlow Python: ``script`` is its shell body."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize(
    ("script", "shown"),
    [
        ("exit 0", "exited 0 having printed nothing; expected one line of JSON"),
        ("echo 'not json'", "exited 0 having printed a last line 'not json'; expected one"),
        ("echo '[1, 2]'", "exited 0 having printed a last line '[1, 2]'; expected one"),
        ("echo boom >&2; exit 3", "exited 3; its stderr ended:\nboom"),
    ],
)
def test_a_tensorflow_side_without_figures_is_reported_not_a_crash(tmp_path, script, shown, capsys):
    # A crash here would lose every aiodist figure measured before it.
    from benchmarks.__main__ import _tensorflow

    assert _tensorflow(_fake_python(tmp_path, script), 2, True, 1) is None
    assert f"TensorFlow benchmark failed for N=2: {tmp_path / 'python'} {shown}" in (
        capsys.readouterr().err
    )


def test_a_relative_tf_python_is_the_one_it_names_from_where_the_suite_started(
    tmp_path, monkeypatch
):
    # The TensorFlow side runs in the repository root: 'venv/python' given from
    # elsewhere must still name the file under the folder the user was in.
    from benchmarks.__main__ import _checked_tf_python, _tensorflow

    (tmp_path / "venv").mkdir()
    # Answers the up-front check as a Python with TensorFlow would, then the run.
    probe_answer = 'if [ "$1" = -c ]; then echo tensorflow True; exit; fi'
    _fake_python(tmp_path / "venv", f'{probe_answer}\necho "{{\\"replicas\\": 2}}"')
    monkeypatch.chdir(tmp_path)
    python = _checked_tf_python("venv/python")
    assert python == str(tmp_path / "venv" / "python")
    assert _tensorflow(python, 2, True, 1) == {"replicas": 2}


@pytest.mark.parametrize(
    ("script", "shown"),
    [
        # A real Python, isolated from site-packages: no tensorflow to find.
        (
            f'exec {sys.executable} -I -S "$@"',
            "that Python cannot import tensorflow; expected a Python with TensorFlow",
        ),
        (
            "exit 0",
            "is not a Python that can run this check: '{path} -c ...' exited 0 having "
            "printed ''; expected a Python with TensorFlow installed",
        ),
        (
            "echo nope >&2; exit 1",
            "exited 1 having printed ''; expected a Python with "
            "TensorFlow installed; its stderr ended:\nnope",
        ),
        (None, "it cannot be run ([Errno 8] Exec format error"),
    ],
)
def test_a_tf_python_without_tensorflow_is_refused_before_measuring(
    tmp_path, script, shown, capsys
):
    if script is None:  # executable, but not a program the system can start
        python = tmp_path / "python"
        python.write_bytes(b"\0\1\2")
        python.chmod(0o755)
    else:
        python = _fake_python(tmp_path, script)
    with pytest.raises(SystemExit) as exited:
        main(["--tf-python", str(python), "--replicas", "2"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --tf-python '{python}'" in err
    assert shown.format(path=python) in err


def test_a_tensorflow_side_that_hangs_is_stopped_and_reported(tmp_path, capsys):
    # A wrapper script whose Python hangs: both are stopped, not only the wrapper.
    from benchmarks.__main__ import _tensorflow

    pid_file = tmp_path / "pid"
    script = f"echo started >&2; sleep 300 & echo $! > {pid_file}; wait"
    started = time.perf_counter()
    assert _tensorflow(_fake_python(tmp_path, script), 2, True, 1, timeout=1.0) is None
    assert time.perf_counter() - started < 30
    err = capsys.readouterr().err
    assert f"N=2: {tmp_path / 'python'} was still running after 1 s and was stopped" in err
    assert "its stderr ended:\nstarted" in err
    sleeper = int(pid_file.read_text())
    for _ in range(100):  # killed at once; reaped by init a moment later
        if not Path(f"/proc/{sleeper}").exists() or "Z" in _proc_state(sleeper):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the hung child {sleeper} is still running")


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "Z"


async def test_workloads_and_floors_measure_positive_seconds_per_step():
    for measure in (
        workloads.measure_a,
        workloads.floor_a,
        workloads.measure_b,
        workloads.measure_c,
        workloads.floor_bc,
        workloads.measure_e,
    ):
        seconds = await measure(2, 20)
        assert 0 < seconds < 1, measure.__name__
    for measure in (workloads.measure_f, workloads.floor_f):  # runs in flight at once
        seconds = await measure(2, 24, concurrent=8)
        assert 0 < seconds < 1, measure.__name__


async def test_floored_workloads_are_judged_by_the_ratios_of_their_rounds():
    rounds = [await _floored_round(2, 10) for _ in range(3)]
    assert all(set(r) == {*FLOORED, *FLOORED.values()} for r in rounds)
    assert all(0 < t < 1 for r in rounds for t in r.values())
    ratios = _x_floor(rounds)
    for key, floor in FLOORED.items():  # each ratio from one round's own floor
        assert ratios[key] == sorted(r[key] / r[floor] for r in rounds)[1]


def test_the_table_shows_the_paired_ratio_not_the_ratio_of_medians():
    # Medians of 30 us over 10 us would read 3.00x; the rounds said 2.25x.
    times = {key: 30e-6 for key, _, _ in ROWS} | dict.fromkeys(FLOORED.values(), 10e-6)
    per_loop = {**times, "x_floor": dict.fromkeys(FLOORED, 2.25)}
    numpy = {f"numpy_{mib}MiB": 10e-6 for mib in (1, 16, 64)}
    report = {
        "loops": ["uvloop"],
        "results": {"4": {"uvloop": per_loop, "numpy": numpy}},
        "tensorflow": {},
    }
    ratios = {line[:3]: line.split()[-1] for line in _table(report).splitlines()[2:] if line}
    assert ratios["(a)"] == ratios["(b)"] == ratios["(c)"] == "2.25x"
    assert ratios["(g)"] == "1.00x"  # (g) against (b): no rounds, the ratio of medians


def test_the_json_holds_every_figure_the_table_shows():
    # Ratios and GB/s as well as times: the JSON is what runs are compared by.
    from benchmarks.__main__ import _table_figures

    times = {key: 20e-6 for key, _, _ in ROWS} | dict.fromkeys(FLOORED.values(), 10e-6)
    per_loop = {**times, "x_floor": dict.fromkeys(FLOORED, 1.75), "d_all_reduce_64MiB": 0.01}
    numpy = {f"numpy_{mib}MiB": 0.025 for mib in (1, 16, 64)}
    tf = {
        "a_run_constant": {"eager": 2e-3, "function": 3e-4},
        "d_all_reduce_64MiB": {"eager": 0.02},
    }
    report = {
        "loops": ["asyncio", "uvloop"],
        "results": {"4": {"asyncio": per_loop, "uvloop": per_loop, "numpy": numpy}},
        "tensorflow": {"4": {"results": tf}},
    }
    report["table"] = _table_figures(report)
    saved = json.loads(json.dumps(report, allow_nan=False))  # valid JSON: no NaN, no Infinity
    assert saved["table"]["loop"] == "uvloop"
    rows = saved["table"]["rows"]["4"]
    table = _table(report).splitlines()[2:11]  # the rows of N = 4
    shown = {line[:26].strip(): " ".join(line[29:].split()[6:]) for line in table}

    a = rows["a_run_constant"]
    assert a["x_baseline"] == 1.75  # the paired ratio
    assert (a["vs_tf_eager"], a["vs_tf_function"]) == (2e-3 / 20e-6, 3e-4 / 20e-6)  # TF / ours
    assert shown["(a) run, constant"] == "1.75x 2.00 ms 300.0 us 100.0x 15.0x"
    d = rows["d_all_reduce_64MiB"]
    assert (d["baseline"], d["x_baseline"], d["vs_tf_eager"]) == (0.025, 0.01 / 0.025, 2.0)
    assert d["tf_function"] is None and d["vs_tf_function"] is None  # not measured: null
    assert d["gb_per_s"] == 4 * 64 * (1 << 20) / 0.01 / 1e9
    assert shown["(d) all_reduce 64 MiB"] == "0.40x 20.00 ms 2.0x 26.8 GB/s in"
    e = rows["e_batched_100x1KiB"]
    assert set(e.values()) == {20e-6, None}  # the table shows only its times
    assert shown["(e) 100 x 1 KiB batched"] == ""


def test_the_scaling_table_has_a_row_per_count_in_flight():
    scaling = _scaling(asyncio.new_event_loop, 2, 8, 1)
    assert scaling["in_flight"] == list(IN_FLIGHT)
    assert all(0 < t < 1 for t in scaling["aiodist"] + scaling["floor"])
    rows = _scaling_table(scaling).splitlines()[2:]
    assert [int(row.split()[0]) for row in rows] == list(IN_FLIGHT)
    assert rows[0].endswith("1.00x")  # per-run cost relative to one run in flight
    # The table's ratios are in the JSON too.
    assert [f"{x:7.2f}x".strip() for x in scaling["x_floor"]] == [row.split()[5] for row in rows]
    assert [f"{x:.2f}x" for x in scaling["aiodist_vs_one"]] == [row.split()[6] for row in rows]


def test_instruction_counting_runs_a_workload_in_its_child_mode():
    # What valgrind runs: one workload, for a number of steps, on the named loop.
    assert instructions.main(["--child", "b", "--replicas", "2", "--steps", "3"]) == 0
    assert instructions.main(["--child", "c", "--loop", "asyncio", "--steps", "3"]) == 0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
@pytest.mark.timeout(120)
def test_instruction_counts_repeat_exactly():
    # The point of counting instructions: the same process counts the same, run
    # after run (hash and address randomisation off), unlike seconds.
    command = [sys.executable, "-S", "-c", "sum(range(1000))"]
    first = instructions.instructions(command)
    assert first > 100_000
    assert instructions.instructions(command) == first
    longer = instructions.instructions([sys.executable, "-S", "-c", "sum(range(100000))"])
    assert longer > first


def test_instruction_counting_refuses_bad_replica_counts(capsys):
    with pytest.raises(SystemExit) as exited:
        instructions.main(["--replicas", "0"])
    assert exited.value.code == 2
    assert "argument --replicas: '0'; expected distinct comma-separated" in capsys.readouterr().err


async def test_a_serving_load_against_a_server_that_never_answers_is_stopped_and_reported():
    # A server that accepts and then says nothing: the load client waited on it for
    # ever, and so did the whole benchmark run.
    from benchmarks import serving

    held = []

    async def accept(reader, writer):
        held.append(writer)  # never answered, never closed until the end

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        started = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"had no answers after 1 s"):
            await serving._load(port, total=2, concurrency=2, limit=1.0)
        assert time.perf_counter() - started < 20
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_serving_benchmark_whose_server_fails_to_start_says_so():
    # uvicorn 0.54 ends a failed startup with sys.exit(3), which asyncio let out of
    # the loop, ending the whole benchmark run; older ones return quietly, and
    # waiting for `started` alone polled for ever.
    pytest.importorskip("uvicorn")
    import uvicorn
    from starlette.applications import Starlette

    from benchmarks import serving

    @contextlib.asynccontextmanager
    async def failing(app):
        raise ValueError("no model")
        yield

    config = uvicorn.Config(
        Starlette(lifespan=failing), host="127.0.0.1", port=0, lifespan="on", log_level="critical"
    )
    with pytest.raises(RuntimeError, match="the example server did not start"):
        async with asyncio.timeout(30):
            await serving._serving(uvicorn.Server(config))
