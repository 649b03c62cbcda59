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


# --------------------------------------------------------------------------- real systemd
# A Debian 12 systemd booted with systemd-nspawn (tests/rig/systemd_container.py). Needs root,
# systemd-container and debootstrap (the Makefile's test-setup installs them); without them
# the tests skip, except under CI=true where they fail. The first use builds the cached
# rootfs (about a minute); later boots take well under a second.


@pytest.fixture(scope="session")
def systemd_container():  # type: ignore[no-untyped-def]
    """One systemd container for the whole session, the repo read-only at its own path
    (so REPO/.venv/bin/python runs inside). Shared by every test that asks for it: leave it
    as you found it (stop your units), or use ``fresh_systemd_container`` for a clean system."""
    from rig.systemd_container import SystemdContainer, repo_binds, require_rig

    require_rig()
    with SystemdContainer(binds=repo_binds()) as ctr:
        yield ctr


@pytest.fixture
def fresh_systemd_container():  # type: ignore[no-untyped-def]
    """A factory: ``fresh_systemd_container(binds=None, extra_packages=(), **kw)`` boots a new,
    clean container (repo bound like ``systemd_container`` when ``binds`` is None), stopped
    at the end of the test."""
    from rig.systemd_container import SystemdContainer, repo_binds, require_rig

    require_rig()
    made: list[SystemdContainer] = []

    def make(*, binds=None, extra_packages=(), **kw):  # type: ignore[no-untyped-def]
        ctr = SystemdContainer(
            binds=repo_binds() if binds is None else binds, extra_packages=extra_packages, **kw
        )
        made.append(ctr)
        return ctr.boot()

    yield make
    for ctr in made:
        ctr.stop()
