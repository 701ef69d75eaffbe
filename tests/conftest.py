"""Settings and fixtures for every test package.

Child processes (the convoy command, its workers, worlds of ranks) import this checkout's convoy,
whatever directory they start in, and keep the bytecode they compile in a cache outside the
checkout: with PYTHONDONTWRITEBYTECODE set, every one of the suite's hundreds of interpreters
would otherwise compile convoy's modules again.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from tests.helpers import ROOT, digits, importable, running_test

# Property tests draw the same examples on every run (a fixed seed per test, no
# example database): a failure found once is found again, and CI cannot fail on a draw
# that a developer's run never made.
settings.register_profile("convoy", derandomize=True, database=None)
settings.load_profile("convoy")

os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / f"convoy-pycache-{os.getuid()}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    running_test[:] = [item]
    yield
    running_test.clear()


@pytest.fixture(scope="session")
def digits_data():
    """The digits dataset, built once for the session (do not modify it)."""
    return digits()


@pytest.fixture
def user_module(tmp_path):
    """Write a module a child process can import: ``user_module(name, source)`` returns the environment for it."""
    def write(name: str, source: str) -> dict[str, str]:
        (tmp_path / f"{name}.py").write_text(source)
        return importable(tmp_path)
    return write
