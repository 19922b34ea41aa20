"""Every example in the public docstrings runs and prints what it shows (doctest)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import aiodist

MODULES = sorted(
    name
    for info in pkgutil.iter_modules(aiodist.__path__, prefix="aiodist.")
    # _cuda imports CuPy (and holds no examples): it is loaded only with a GPU.
    if (name := info.name) not in {"aiodist.__main__", "aiodist._cuda"}
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_the_public_api_has_examples():
    finder = doctest.DocTestFinder()
    examples = sum(
        len(test.examples)
        for name in MODULES
        for test in finder.find(importlib.import_module(name))
    )
    assert examples >= 30
