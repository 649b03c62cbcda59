"""The systemd container rig itself: boot, commands, units, journal, cgroups, users, clean-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rig import systemd_container as rig
from rig.systemd_container import SystemdContainer
from support import wait_for

REPO = Path(__file__).resolve().parent.parent
VENV_PY = REPO / ".venv" / "bin" / "python"

NOTIFY_SCRIPT = """\
import pathlib, sys, time
import sdnotify

gate = pathlib.Path("/run/rig-notify") / (sys.argv[1] + ".go")
n = sdnotify.SystemdNotifier()
n.notify("STATUS=waiting for the gate")
print("rig-notify waiting", sys.argv[1], flush=True)
while not gate.exists():
    time.sleep(0.02)
n.notify("READY=1\\nSTATUS=past the gate")
print("rig-notify ready", sys.argv[1], flush=True)
while True:
    time.sleep(60)
"""

NOTIFY_UNIT = """\
[Unit]
Description=rig notify test %i

[Service]
Type=notify
NotifyAccess=main
ExecStart=/usr/bin/python3 /usr/local/lib/rig-notify.py %i
TimeoutStartSec=30
"""


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _install_notify_unit(c: SystemdContainer) -> None:
    c.write_file("/usr/local/lib/rig-notify.py", NOTIFY_SCRIPT)
    c.write_file("/etc/systemd/system/rig-notify@.service", NOTIFY_UNIT)
    c.run(["mkdir", "-p", "/run/rig-notify"])
    c.daemon_reload()


# --------------------------------------------------------------------------- host side only


def test_mirror_read_from_apt_sources(tmp_path: Path) -> None:
    apt = tmp_path / "etc/apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list").write_text("# deb http://wrong.example/debian bookworm main\n")
    (apt / "sources.list.d/other.list").write_text(
        "deb [signed-by=/k.gpg] https://packages.example.com/apt cloud-sdk main\n"
    )
    (apt / "sources.list.d/debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb deb-src\nURIs: http://mirror.example/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
    )
    (apt / "sources.list.d/off.sources.disabled").write_text(
        "Types: deb\nURIs: http://nope.example/debian\nSuites: bookworm\nComponents: main\n"
    )
    os.environ.pop(rig.MIRROR_ENV, None)
    assert rig.debian_mirror(root=str(tmp_path)) == "http://mirror.example/debian"
    (apt / "sources.list").write_text("deb [arch=amd64] http://first.example/debian bookworm main\n")
    assert rig.debian_mirror(root=str(tmp_path)) == "http://first.example/debian"


def test_this_machine_has_a_mirror() -> None:
    assert rig.debian_mirror().startswith(("http://", "https://", "file:"))


def test_cache_key_covers_extra_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(rig.CACHE_ENV, str(tmp_path))
    base = rig.rootfs_path()
    assert base.parent == tmp_path and base.name.startswith("rootfs-")
    assert rig.rootfs_path(["jq"]) != base
    assert rig.rootfs_path(["jq", "tree"]) == rig.rootfs_path(["tree", "jq", "jq"])
    assert rig.rootfs_path(["python3"]) == base  # already in the base list


def test_missing_tools_skip_locally_fail_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rig.shutil, "which", lambda name: None)
    assert any("systemd-nspawn" in p for p in rig.missing_tools())
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install"):
        rig.require_rig()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        rig.require_rig()


@pytest.mark.skipif(os.geteuid() != 0, reason="drops a capability from root's set")
def test_a_root_without_net_admin_is_told_why() -> None:
    """Inside a container on the host's network (nspawn's default set), root has no CAP_NET_ADMIN
    and a container booted there has its loopback down: every start then hung waiting for a
    server that could not reach itself. The rig names the cause instead."""
    probe = "import sys; sys.path.insert(0, 'tests'); from rig.systemd_container import missing_tools; print(missing_tools())"
    full = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert "CAP_NET_ADMIN" not in full.stdout, full.stdout
    dropped = subprocess.run(["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin", "--",
                              sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert "lacks CAP_NET_ADMIN (a container's own loopback would stay down" in dropped.stdout, dropped.stdout


# --------------------------------------------------------------------------- in the container

systemd = pytest.mark.systemd


@systemd
def test_boots_to_running(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    assert c.state == "running", c.failed_at_boot
    assert c.boot_seconds is not None and c.boot_seconds < 30
    state = c.run(["systemctl", "is-system-running"], check=False).stdout.strip()
    assert state in ("running", "degraded")  # degraded only if an earlier test left a failed unit
    assert Path(f"/proc/{c.leader_pid}/comm").read_text().strip() == "systemd"
    assert c.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert "systemd 252" in c.systemctl("--version").stdout


@systemd
def test_transient_service(systemd_container: SystemdContainer) -> None:
    unit = _name("rig-x")
    r = systemd_container.run(["systemd-run", f"--unit={unit}", "--wait", "true"])
    assert "Finished with result: success" in r.stderr
    r = systemd_container.run(["systemd-run", f"--unit={unit}-f", "--wait", "false"], check=False)
    assert r.returncode != 0
    systemd_container.systemctl("reset-failed", f"{unit}-f.service", check=False)


@systemd
def test_notify_unit_is_active_only_after_ready(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    _install_notify_unit(c)
    inst = _name("a")
    unit = f"rig-notify@{inst}.service"
    try:
        c.systemctl("start", "--no-block", unit)
        wait_for(lambda: c.is_active(unit) == "activating", what="activating")
        time.sleep(0.5)  # plenty of time to go active, were READY=1 not awaited
        assert c.is_active(unit) == "activating"
        assert "waiting for the gate" in c.systemctl("show", "-P", "StatusText", unit).stdout
        c.run(["touch", f"/run/rig-notify/{inst}.go"])
        wait_for(lambda: c.is_active(unit) == "active", what="active")
        assert c.systemctl("show", "-P", "StatusText", unit).stdout.strip() == "past the gate"
        # a blocking start returns once READY=1 is sent
        inst2 = _name("b")
        c.run(["touch", f"/run/rig-notify/{inst2}.go"])
        c.systemctl("start", f"rig-notify@{inst2}.service", timeout=30)
        assert c.is_active(f"rig-notify@{inst2}.service") == "active"
        c.systemctl("stop", f"rig-notify@{inst2}.service")
    finally:
        c.systemctl("stop", unit, check=False)


@systemd
def test_journal_shows_unit_output(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    _install_notify_unit(c)
    inst = _name("j")
    c.run(["touch", f"/run/rig-notify/{inst}.go"])
    c.systemctl("start", f"rig-notify@{inst}.service", timeout=30)
    try:
        out = wait_for(
            lambda: (j := c.journal("rig-notify@*", "-o", "cat")) and f"ready {inst}" in j and j,
            what="journal lines",
        )
        assert f"rig-notify waiting {inst}" in out
        assert f"rig-notify ready {inst}" in c.journal(f"rig-notify@{inst}.service")
    finally:
        c.systemctl("stop", f"rig-notify@{inst}.service", check=False)


@systemd
def test_repo_venv_python_runs_inside(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    r = c.run([str(VENV_PY), "-c", "import sys, psutil, pydbus, sdnotify, sglang_router, "
               "supervisord_gpu; print(sys.prefix, sys.version.split()[0])"])  # fmt: skip
    prefix, version = r.stdout.split()
    assert prefix == str(REPO / ".venv")
    assert version == ".".join(map(str, sys.version_info[:3]))
    assert c.run(["touch", str(REPO / "rig-write-probe")], check=False).returncode != 0  # read-only


@systemd
def test_unprivileged_user(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    assert c.run(["id", "-u", rig.TEST_USER]).stdout.strip() == str(rig.TEST_UID)
    r = c.run(["sh", "-c", 'id -u; echo "$HOME $USER"; pwd'], user=rig.TEST_USER, cwd="/tmp")
    assert r.stdout.split() == [str(rig.TEST_UID), f"/home/{rig.TEST_USER}", rig.TEST_USER, "/tmp"]
    assert c.run(["touch", "/etc/rig-probe"], user=rig.TEST_USER, check=False).returncode != 0


@systemd
def test_unit_cgroup_and_processes(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    unit = _name("rig-cg") + ".service"
    c.run(["systemd-run", f"--unit={unit}", "sleep", "300"])
    try:
        cg = c.unit_cgroup(unit)
        assert cg == f"/sys/fs/cgroup/system.slice/{unit}"
        # systemd's forked child is in the cgroup a moment before it execs sleep (comm "(sleep)",
        # its argv area blank): wait for the exec, not just for a process
        procs = wait_for(lambda: [p for p in c.processes(f"/system.slice/{unit}") if p.comm == "sleep"] or None,
                         what="the sleep")
        assert [p.cmdline[1:] for p in procs] == [("300",)] and procs[0].comm == "sleep"
        assert c.read_file(f"{cg}/cgroup.procs").split() == [str(procs[0].pid)]
        everything = c.processes()
        assert any(p.pid == 1 and p.cgroup == "/init.scope" for p in everything)
    finally:
        c.systemctl("stop", unit)
    assert c.processes(f"/system.slice/{unit}") == []


@systemd
def test_files_in_and_out(systemd_container: SystemdContainer, tmp_path: Path) -> None:
    c = systemd_container
    d = "/etc/" + _name("rig-files")
    c.write_file(f"{d}/a/b.conf", "x = 1\n", mode=0o640, owner=rig.TEST_USER)
    assert c.run(["stat", "-c", "%a %U %s", f"{d}/a/b.conf"]).stdout.split() == ["640", "alice", "6"]
    src = tmp_path / "tool.sh"
    src.write_text("#!/bin/sh\necho tool-ran\n")
    src.chmod(0o755)
    c.install_file(src, f"{d}/tool.sh")
    assert c.run([f"{d}/tool.sh"]).stdout == "tool-ran\n"
    assert c.host_path(f"{d}/a/b.conf").read_text() == "x = 1\n"
    assert not Path(rig.rootfs_path(), d.lstrip("/")).exists()  # the overlay took the writes
    c.run(["rm", "-r", d])


@systemd
def test_run_timeout_kills_the_command(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    marker = f"{300 + uuid.uuid4().int % 1000}.25"  # a sleep argument no one else uses
    with pytest.raises(subprocess.TimeoutExpired):
        c.run(["sh", "-c", f"sleep {marker}; echo {marker}"], timeout=0.5)
    time.sleep(0.1)
    assert not [p for p in c.processes() if any(marker in a for a in p.cmdline)]


@systemd
def test_failed_command_shows_its_output(systemd_container: SystemdContainer) -> None:
    with pytest.raises(subprocess.CalledProcessError) as e:
        systemd_container.run(["sh", "-c", "echo to-stderr >&2; exit 3"])
    assert e.value.returncode == 3 and "to-stderr" in str(e.value)


@systemd
def test_host_side_dbus(systemd_container: SystemdContainer) -> None:
    busctl = shutil.which("busctl")
    if busctl is None:
        pytest.skip("no busctl on the host")
    r = subprocess.run(
        [busctl, f"--address={systemd_container.bus_address}", "get-property",
         "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
         "org.freedesktop.systemd1.Manager", "Version"],
        capture_output=True, text=True, timeout=10, check=True,
    )  # fmt: skip
    assert r.stdout.startswith('s "252')


@systemd
def test_fresh_container_is_clean_and_separate(
    systemd_container: SystemdContainer, fresh_systemd_container
) -> None:  # type: ignore[no-untyped-def]
    marker = _name("rig-marker")
    systemd_container.write_file(f"/etc/{marker}", "x")
    systemd_container.run(["systemd-run", f"--unit={marker}", "sleep", "300"])
    try:
        fresh = fresh_systemd_container()
        assert fresh.state == "running"
        assert fresh.leader_pid != systemd_container.leader_pid
        assert fresh.run(["test", "-e", f"/etc/{marker}"], check=False).returncode == 1
        # each container has its own cgroup tree: no sight of the other's units
        assert fresh.run(["test", "-e", f"/sys/fs/cgroup/system.slice/{marker}.service"],
                         check=False).returncode == 1  # fmt: skip
        assert fresh.is_active(f"{marker}.service") == "inactive"
    finally:
        systemd_container.systemctl("stop", f"{marker}.service", check=False)
        systemd_container.run(["rm", "-f", f"/etc/{marker}"])


@systemd
def test_stop_leaves_nothing_behind(fresh_systemd_container) -> None:  # type: ignore[no-untyped-def]
    c = fresh_systemd_container(binds=[])
    c.run(["systemd-run", "--unit=rig-lingers", "sleep", "300"])
    leader, nspawn, cgroup = c.leader_pid, c.nspawn_pid, c._cgroup
    c.stop()
    assert c.stop_seconds is not None and c.stop_seconds < 10
    assert not rig._alive(nspawn)
    assert not rig._alive(leader)
    assert cgroup is None or not cgroup.exists()
    assert not Path("/run/systemd/nspawn/propagate", c.name).exists()
    c.stop()  # twice is fine
    with pytest.raises(rig.ContainerError):
        c.run(["true"])


@systemd
def test_kill_fallback_when_halt_hangs(fresh_systemd_container) -> None:  # type: ignore[no-untyped-def]
    c = fresh_systemd_container(binds=[])
    c.run(["systemd-run", "--unit=rig-lingers", "sleep", "300"])
    leader = c.leader_pid
    c.stop(timeout=0)  # no time to halt: straight to SIGKILL
    assert not rig._alive(leader)  # (the host's init may take a moment to reap it)


@systemd
def test_extra_packages_are_cached(fresh_systemd_container) -> None:  # type: ignore[no-untyped-def]
    c = fresh_systemd_container(binds=[], extra_packages=["jq"])
    assert c.rootfs == rig.rootfs_path(["jq"])
    assert c.run(["jq", "-n", "1+1"]).stdout.strip() == "2"
    rec = c.read_file("/var/lib/supervisord-gpu-rig/rootfs.json")
    assert '"jq"' in rec
