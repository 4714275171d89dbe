"""The examples in the docstrings of streams/, schemas/, producers/guards/, the run page and
trainguard.terminal are run, so they stay true."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import trainguard.producers.guards
import trainguard.schemas
import trainguard.streams
import trainguard.ui


def _modules():
    for package in (trainguard.streams, trainguard.schemas, trainguard.ui, trainguard.producers.guards):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            yield info.name
    yield "trainguard.terminal"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
