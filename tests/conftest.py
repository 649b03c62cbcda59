"""Fixtures shared by the suites. Each test gets its own cgroup root, ports and config dir."""

from __future__ import annotations

import os

import pytest

from support import CgroupSandbox, start_decoy


def pytest_configure(config):  # type: ignore[no-untyped-def]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture
def cgroups():  # type: ignore[no-untyped-def]
    try:
        sandbox = CgroupSandbox()
    except RuntimeError as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"needs a writable cgroup v2 (root): {e}")
    yield sandbox
    sandbox.destroy()


@pytest.fixture
def decoy():  # type: ignore[no-untyped-def]
    proc = start_decoy()
    yield proc
    proc.kill()
    proc.wait()
