"""Every Python example in docs/ runs and prints exactly the output shown under it.

An example is a ```python block; when a ```text block follows it, that block is
the expected standard output. Examples run as separate programs from the
repository root, so the docs cannot rot.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiodist._backends import visible_gpu_count

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
# Examples that import CuPy or build GPU device names (f"GPU:{...}") run where a GPU
# is (python -m pytest -m gpu).
_GPU_ONLY = (
    pytest.mark.gpu,
    pytest.mark.skipif(visible_gpu_count() == 0, reason="the example needs CuPy and a GPU"),
)


# Multi-worker examples need mpi4py (the test extra installs it on Linux).
_MPI_ONLY = (
    pytest.mark.skipif(
        importlib.util.find_spec("mpi4py") is None,
        reason="the example needs mpi4py (pip install '.[mpi]')",
    ),
)


def _examples():
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        blocks = [
            (m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text)
        ]
        for i, (lang, body, line) in enumerate(blocks):
            if lang != "python":
                continue
            following = blocks[i + 1] if i + 1 < len(blocks) else None
            expected = following[1] if following and following[0] == "text" else None
            marks = _GPU_ONLY if "import cupy" in body or 'f"GPU:{' in body else ()
            if "MultiWorkerMirroredStrategy" in body:
                marks = (*marks, *_MPI_ONLY)
            yield pytest.param(body, expected, id=f"{path.name}:{line}", marks=marks)


EXAMPLES = list(_examples())


def test_docs_have_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize(("code", "expected"), EXAMPLES)
def test_doc_example(code, expected):
    done = subprocess.run(
        [sys.executable, "-"], input=code, capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    if expected is not None:
        assert done.stdout == expected


README_EXAMPLES = [
    pytest.param(m.group(1), id=f"README.md:{n}")
    for n, m in enumerate(
        re.finditer(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    )
]


@pytest.mark.parametrize("code", README_EXAMPLES)
def test_readme_example(code, tmp_path):
    """README examples run (in a scratch directory: they may write files) and print
    the values their comments promise."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-"],
        input=code,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for line in code.splitlines():
        if line.lstrip().startswith("print(") and "  # " in line:
            assert line.split("  # ", 1)[1].strip() in done.stdout
