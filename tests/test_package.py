"""The package surface: exports, lazy CuPy, aiodist.run, the demo."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import aiodist
import aiodist.serving
from tests.conftest import run_demo

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_sorted_and_complete():
    assert aiodist.__all__ == sorted(aiodist.__all__)
    public = {
        name
        for name in vars(aiodist)
        if not name.startswith("_")
        and name not in {"annotations"}
        and not isinstance(getattr(aiodist, name), type(aiodist))
    }
    assert public == set(aiodist.__all__)
    for name in aiodist.__all__:
        assert getattr(aiodist, name) is not None


def test_errors_subclass_the_builtins_the_spec_names():
    assert issubclass(aiodist.InvalidArgumentError, ValueError)
    assert issubclass(aiodist.DeviceError, ValueError)
    assert issubclass(aiodist.ContextError, RuntimeError)
    assert issubclass(aiodist.RendezvousError, RuntimeError)
    assert issubclass(aiodist.CollectiveMismatchError, ValueError)
    assert issubclass(aiodist.RendezvousTimeoutError, TimeoutError)
    for name in aiodist.__all__:
        obj = getattr(aiodist, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, aiodist.AiodistError)


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_never_imports_cupy():
    out = _python(
        "import sys, aiodist; s = aiodist.MirroredStrategy(['cpu:0', 'cpu:1']);"
        "print('cupy' in sys.modules, 'uvloop' in sys.modules)"
    )
    assert out.split() == ["False", "False"]


def test_cpu_work_with_the_gpu_api_never_imports_cupy():
    out = _python(
        "import sys, asyncio, aiodist; s = aiodist.MirroredStrategy(['cpu:0', 'cpu:1']);"
        "ops = aiodist.NcclAllReduce(num_packs=2); asyncio.run(aiodist.ready());"
        "print('cupy' in sys.modules)"
    )
    assert out.split() == ["False"]


def test_aiodist_run_uses_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")

    async def which():
        return type(__import__("asyncio").get_running_loop())

    assert aiodist.run(which()) is uvloop.Loop


def test_aiodist_run_of_a_coroutine_function_or_a_non_awaitable_says_what_to_pass():
    # It raised asyncio's "a coroutine was expected, got <function main at 0x...>",
    # which says nothing of the missing call.
    async def main():
        return 1

    with pytest.raises(aiodist.InvalidArgumentError) as caught:
        aiodist.run(main)
    message = str(caught.value)
    assert "got the coroutine function " in message
    assert ".main() - the coroutine - not " in message
    assert isinstance(caught.value, ValueError)  # as asyncio.run raises
    with pytest.raises(aiodist.InvalidArgumentError, match=r"got int \(42\); pass main\(\)"):
        aiodist.run(42)
    assert aiodist.run(main()) == 1  # nothing was left half-made


def test_aiodist_run_takes_any_awaitable_as_asyncio_run_does_on_python_314():
    class Answer:
        def __await__(self):
            return (yield from asyncio.sleep(0, result=42).__await__())

    assert aiodist.run(Answer()) == 42


async def test_aiodist_run_inside_a_running_loop_says_to_await():
    # In async code (or a notebook, which runs a loop) aiodist.run raised "Cannot run
    # the event loop while another loop is running", from closing the loop it had just
    # made, over asyncio's own reason, and left a `shutdown_asyncgens` coroutine never
    # awaited.
    async def main():
        return 1

    coroutine = main()
    with pytest.raises(aiodist.ContextError, match=r"`await main\(\)` in place of") as caught:
        aiodist.run(coroutine)
    assert caught.value.__context__ is None
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning either
    assert await main() == 1  # the running loop is untouched


def test_demo_trains_to_the_true_weights():
    done = run_demo("--steps", "60", "--devices", "cpu:0,cpu:1,cpu:2", timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "3 replica(s) on: /device:CPU:0, /device:CPU:1, /device:CPU:2" in lines
    assert any("uvloop" in line for line in lines[:2])
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step")]
    assert len(losses) == 60 and losses[-1] < losses[0] / 100
    error = float(lines[-1].rsplit("=", 1)[1])
    assert error < 0.01


@pytest.mark.parametrize(
    ("argv0", "usage"),
    [("/venv/bin/aiodist-demo", "usage: aiodist-demo "), ("-m", "usage: python -m aiodist ")],
)
def test_demo_help_names_the_command_it_was_started_by(monkeypatch, capsys, argv0, usage):
    # The console script's --help said "usage: python -m aiodist", and both showed
    # the docstring's reST quotes (``python -m aiodist``).
    from aiodist.__main__ import main

    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(usage) and "``" not in out


def test_demo_reports_bad_devices():
    done = run_demo("--devices", "tpu:0")
    assert done.returncode == 2
    assert "device string 'tpu:0' is not understood" in done.stderr


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--lr", "nan", "--lr=nan; expected a finite number > 0"),
        ("--lr", "inf", "--lr=inf; expected a finite number > 0"),
        ("--lr", "-0.1", "--lr=-0.1; expected a finite number > 0"),
        ("--seed", "-1", "--seed=-1; expected a whole number >= 0"),
    ],
)
def test_demo_refuses_bad_flag_values_with_a_usage_error(flag, value, expected):
    # nan and inf trained to nan weights, exit status 0; a negative seed failed in
    # NumPy's seeding with a traceback.
    done = run_demo(flag, value, "--steps", "1")
    assert done.returncode == 2, done.stdout
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert "step" not in done.stdout  # refused before training


def test_error_messages_link_to_their_docs_section():
    headings = {
        line[3:].strip().lower()
        for line in (ROOT / "docs" / "errors.md").read_text().splitlines()
        if line.startswith("## ")
    }
    for name in aiodist.__all__:
        cls = getattr(aiodist, name)
        if isinstance(cls, type) and issubclass(cls, aiodist.AiodistError):
            message = str(cls("something went wrong"))
            assert message.startswith("something went wrong [docs/errors.md#")
            anchor = message.rsplit("#", 1)[1].rstrip("]")
            assert anchor in headings, (name, anchor)
    for cls in (aiodist.serving.Overloaded, aiodist.serving.NotServing):
        anchor = str(cls("full")).rsplit("#", 1)[1].rstrip("]")
        assert anchor == cls.__name__.lower() and anchor in headings, anchor
