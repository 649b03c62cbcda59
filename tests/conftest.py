"""Fixtures shared by the suites. Each test gets its own cgroup root, ports and config dir."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import CgroupSandbox, MatrixTables, start_decoy


class GroupsHold:
    """Refuses a worker's collection where `--dist loadgroup` would not keep a group together.

    xdist carries a test's group to its scheduler as a suffix of the node id; pytest 9.2 made
    node ids structured and the suffix silently stopped taking effect (pytest-xdist#1386), so
    a module's shared container and the host-network tests were spread over workers, out of
    order. One line naming the versions instead of tests that fail by chance.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items) -> None:  # type: ignore[no-untyped-def]
        if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
            return
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            why = (f"--dist loadgroup does not group here (pytest {pytest.__version__}): {lost[0]} "
                   f"and {len(lost) - 1} more carry an xdist_group mark but no group; pin pytest as pyproject.toml does")
            print(why, file=sys.stderr)  # a worker's error reaches the terminal as an INTERNALERROR without it
            raise pytest.UsageError(why)


def pytest_configure(config):  # type: ignore[no-untyped-def]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("SUPERVISORD_GPU_STRICT_STATES", "1")  # an illegal state move raises (engine/states.py)
    config.pluginmanager.register(MatrixTables(), "fault-matrix-tables")
    config.pluginmanager.register(GroupsHold(), "xdist-groups-hold")


# The fast tier, `make check` (first in `make test`): modules whose tests start no server and
# boot nothing (a few start a short-lived helper: a listener, a child as nobody); about 30 s
# on the 2-core CI machine. The rest runs after it, in parallel workers.
FAST_MODULES = frozenset({
    "test_records", "test_config", "test_fuzz", "test_status_view", "test_child_output",
    "test_liveness_rules", "test_checks_gpus", "test_checks_ports", "test_preconditions",
    "test_units_offline", "test_shm_cleanup", "test_shm_watch", "test_trust_boundaries", "test_runtime_trust",
    "test_cluster_config", "test_cluster_plan", "test_cluster_records", "test_cluster_fuzz",
    "test_cluster_failures", "test_bus_errors", "test_version", "test_cluster_decisions", "test_layers",
    "test_capabilities", "test_install_quietly",
    "test_docs",
    "test_dcs_contract_memory",
    "test_error_table",
    "test_cli_check",
    "test_make_sh",
    "test_man_pages",
    "test_cli_defaults",
    "test_state_tables",
    "test_local_decisions",
    "test_router_user",
    "test_cluster_consent",
    "test_cluster_credentials",
    "test_cli_logs",
    "test_admin_key_rules",
    "test_gpu_sharing",
    "test_parking", "test_parking_saver",
    "test_routers",
    "test_hang_rules",
    "test_hostile_today",
    "test_longrun",
    "test_real_hang_beside",
})


# Modules whose tests share a module-scoped fixture (one booted container, one etcd, one
# rehearsal that the tests walk through in order): under pytest-xdist each is one group, run
# by one worker in file order, instead of a copy of the fixture per worker and tests out of order.
SHARED_FIXTURE_MODULES = frozenset({"test_metrics", "test_cluster_tls", "test_restart_limit_systemd", "test_gpu_nvml",
                                    "test_dcs_contract_etcd",
                                    })


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads xdist_group marks into node ids
def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    for item in items:
        if item.path.stem in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
        if item.path.stem in SHARED_FIXTURE_MODULES and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        elif item.path.stem not in FAST_MODULES:
            shared = _module_scoped_fixtures(item)
            if shared:
                raise pytest.UsageError(f"{item.nodeid} uses the module-scoped fixture(s) {', '.join(shared)}: "
                                        "add its module to SHARED_FIXTURE_MODULES in tests/conftest.py")


def _module_scoped_fixtures(item) -> list[str]:  # type: ignore[no-untyped-def]
    """Fixtures of `item` shared wider than one test but narrower than the session."""
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) or {}
    return sorted(name for name, chain in defs.items() if chain and chain[-1].scope in ("module", "class", "package"))


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


# --------------------------------------------------------------------------- the .deb
REPO = Path(__file__).resolve().parents[1]
DEB_VERSION = re.match(r"\S+ \(([^)]+)\)", (REPO / "packaging/debian/changelog").read_text()).group(1)  # type: ignore[union-attr]
DEB_NAME = f"supervisord-gpu_{DEB_VERSION}_all.deb"
DEB_BUILD_TOOLS = ("dpkg-buildpackage", "dh", "dh_python3", "lintian")


def unavailable(reason: str) -> None:
    """Skip here; under CI=true fail, since the CI set-up must provide what is missing."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the CI set-up must provide it)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package, built once per session by `make deb` into a private directory (test_deb.py
    tests it; the cluster tests install it on their hosts)."""
    missing = [t for t in DEB_BUILD_TOOLS if shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]
    if missing and os.geteuid() != 0:  # as root, `make deb` installs its own build tools
        unavailable(f"building the .deb needs {', '.join(missing)} (apt-get install -y "
                    "debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools lintian)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # parallel workers: the first to ask builds it, under a lock, in the run's shared temp
        # root; the others wait for it and take the same file
        shared = tmp_path_factory.getbasetemp().parent / "deb-out"
        shared.mkdir(exist_ok=True)
        with open(shared.parent / "deb-out.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (shared / DEB_NAME).is_file():
                _make_deb(shared)
        return shared / DEB_NAME
    return _make_deb(tmp_path_factory.mktemp("deb-out"))


def _make_deb(out: Path) -> Path:
    r = subprocess.run(["make", "--no-print-directory", "deb", f"DEB_OUT={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"make deb failed:\n{r.stdout}\n{r.stderr}"
    path = out / DEB_NAME
    assert path.is_file(), f"make deb did not produce {path}:\n{r.stdout}"
    assert r.stdout.strip().splitlines()[-1] == str(path), "make deb should print the .deb path last"
    return path
