"""The Debian package: `make deb` builds it lintian-clean, and it installs, keeps an edited
conffile over a reinstall, leaves running instances alone on removal, and purges clean in a
real systemd (Debian 12 in a systemd-nspawn container).

The .deb is built once per test session with `make deb DEB_OUT=<tmp>` (what a user runs,
into a private directory: the `deb` fixture in conftest.py, which the cluster tests share) and
bound read-only into each container at /debs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from box import rehearse_in_package_config

# The containers here install from the Debian mirror, so they share the host's network, and
# with it the shipped profiles' ports: one test at a time (conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.systemd, pytest.mark.xdist_group("host-network")]

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "supervisord-gpu"

UNIT = "/lib/systemd/system/dsv4@.service"
POLICY = "/usr/share/dbus-1/system.d/org.supervisordgpu.conf"
CONFFILES = (
    "/etc/supervisord-gpu/supervisord-gpu.toml",
    "/etc/supervisord-gpu/profiles/pd-1p1d.toml",
    "/etc/supervisord-gpu/profiles/tp4-512k.toml",
)
INSTALLED = (
    "/usr/bin/gpusupctl",
    "/usr/bin/supervisord-gpu",
    UNIT,
    "/lib/systemd/system/gpusup-agent.service",
    POLICY,
    *CONFFILES,
    "/usr/share/man/man1/gpusupctl.1.gz",
    "/usr/share/man/man8/supervisord-gpu.8.gz",
    "/usr/share/bash-completion/completions/gpusupctl",
    "/usr/share/polkit-1/rules.d/50-supervisord-gpu.rules",
    "/usr/lib/python3/dist-packages/supervisord_gpu/data/sglang-0.5.23-flags.txt",
    "/usr/lib/python3/dist-packages/supervisord_gpu/data/standin-model/tokenizer.json",  # a rehearsal's router loads it
)
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def _dpkg_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], check=True, capture_output=True,
                          text=True).stdout.strip()


# --------------------------------------------------------------------------- the artifact


def test_deb_holds_the_programs_unit_policy_conffiles_docs_and_data_file(deb: Path) -> None:
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], check=True, capture_output=True, text=True).stdout
    paths = {line.split()[-1].removeprefix(".") for line in listing.splitlines()}
    assert set(INSTALLED) <= paths, f"missing from the .deb: {sorted(set(INSTALLED) - paths)}"
    conffiles = subprocess.run(["dpkg-deb", "-I", str(deb), "conffiles"], check=True, capture_output=True,
                               text=True).stdout.split()
    assert sorted(conffiles) == sorted(CONFFILES)
    assert _dpkg_field(deb, "Architecture") == "all"


def test_deb_depends_only_on_packages_debian_has(deb: Path) -> None:
    depends = {d.strip().split()[0] for d in _dpkg_field(deb, "Depends").split(",")}
    assert {"python3", "python3-psutil", "python3-pydbus", "python3-gi", "python3-sdnotify", "adduser"} <= depends
    assert not any("nvidia" in d or "pynvml" in d or "tomli" in d for d in depends), depends
    assert _dpkg_field(deb, "Recommends") == "python3-pynvml, polkitd"  # polkitd: the rule for group gpusup
    assert _dpkg_field(deb, "Suggests") == "python3-prometheus-client, python3-etcd3gw"  # etcd: cluster profiles only


def test_lintian_reports_no_errors_or_warnings(deb: Path) -> None:
    r = subprocess.run(["lintian", str(deb)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    bad = [line for line in r.stdout.splitlines() if line.startswith(("E:", "W:"))]
    assert not bad, "\n".join(bad)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- in a real systemd


@pytest.fixture
def container(deb: Path, fresh_systemd_container):  # type: ignore[no-untyped-def]
    """A freshly booted Debian 12 with only the build directory bound in (at /debs), so
    nothing of ours is there but what the package installs; thrown away afterwards."""
    c = fresh_systemd_container(binds=[(str(deb.parent), "/debs", True)], host_network=True)
    c.run(["apt-get", "-q", "update"], env=APT_ENV, timeout=300)
    return c


def _apt(c, *args: str):  # type: ignore[no-untyped-def]
    return c.run(["apt-get", "-y", "-q", *args], env=APT_ENV, timeout=300)


def _exists(c, path: str) -> bool:  # type: ignore[no-untyped-def]
    return c.run(["test", "-e", path], check=False).returncode == 0


def test_installs_keeps_edited_conffile_on_reinstall_and_purges_clean(container, deb: Path) -> None:  # type: ignore[no-untyped-def]
    c = container
    # man-db too, so systemd-analyze verify also checks the unit's Documentation= man pages.
    _apt(c, "install", "--no-install-recommends", f"/debs/{deb.name}", "man-db")

    assert [p for p in INSTALLED if not _exists(c, p)] == []
    c.run(["systemd-analyze", "verify", "dsv4@tp4-512k.service"])
    assert "ExecStart=/usr/bin/supervisord-gpu run %i" in c.systemctl("cat", "dsv4@tp4-512k.service").stdout
    assert c.is_active("dsv4@tp4-512k.service") == "inactive"  # installing starts nothing
    assert c.systemctl("is-enabled", "dsv4@tp4-512k.service", check=False).stdout.strip() == "disabled"
    c.run(["systemd-analyze", "verify", "gpusup-agent.service"])  # the cluster agent: shipped, neither enabled nor started
    assert c.systemctl("is-enabled", "gpusup-agent.service", check=False).stdout.strip() == "disabled"
    assert c.is_active("gpusup-agent.service") == "inactive"
    gid = int(c.run(["getent", "group", "gpusup"]).stdout.split(":")[2])
    assert gid < 1000, "gpusup should be a system group"
    for user in ("sglang", "sglang-router"):  # the shipped profiles' servers' user and the router's own
        _name, _pw, uid, _gid, _gecos, home, shell = c.run(["getent", "passwd", user]).stdout.strip().split(":")
        assert int(uid) < 1000 and shell == "/usr/sbin/nologin", f"{user}: should be a system user, no shell"

    assert "render" in c.run(["gpusupctl", "--help"]).stdout
    rendered = c.run(["gpusupctl", "render", "tp4-512k"]).stdout
    assert "sglang.launch_server" in rendered and "--tp-size 4" in rendered
    completion = c.run(["bash", "-c", "source /usr/share/bash-completion/completions/gpusupctl; "
                        'COMP_WORDS=(gpusupctl render ""); COMP_CWORD=2; _gpusupctl; echo "${COMPREPLY[*]}"'])
    assert completion.stdout.split() == ["pd-1p1d", "tp4-512k"]

    conf = CONFFILES[0]
    c.run(["sh", "-c", f"echo '# edited by test_deb' >> {conf}"])
    _apt(c, "install", "--reinstall", f"/debs/{deb.name}")
    assert c.read_file(conf).endswith("# edited by test_deb\n"), "reinstall overwrote an edited conffile"

    c.run(["mkdir", "-p", "/run/supervisord-gpu/instances", "/var/cache/supervisord-gpu/sglang"])  # what a daemon leaves
    _apt(c, "purge", PACKAGE)
    leftovers = [p for p in (*INSTALLED, "/etc/supervisord-gpu", "/run/supervisord-gpu", "/var/cache/supervisord-gpu")
                 if _exists(c, p)]
    assert leftovers == []
    assert c.run(["getent", "group", "gpusup"], check=False).returncode == 2, "purge should remove group gpusup"
    for user in ("sglang", "sglang-router"):
        assert c.run(["getent", "passwd", user], check=False).returncode == 2, f"purge should remove user {user}"
        assert c.run(["getent", "group", user], check=False).returncode == 2, f"purge should remove group {user}"
    assert c.systemctl("list-unit-files", "--no-legend", "dsv4@*", check=False).stdout.strip() == ""


def test_remove_leaves_running_instances_alone_and_says_how_to_stop_them(container, deb: Path) -> None:  # type: ignore[no-untyped-def]
    c = container
    _apt(c, "install", "--no-install-recommends", f"/debs/{deb.name}")
    # An instance of the packaged unit, its daemon swapped for a sleeper (no SGLang here).
    c.write_file("/run/systemd/system/dsv4@stub.service.d/stub.conf",
                 "[Service]\nType=simple\nExecStart=\nExecStart=/bin/sleep infinity\nWatchdogSec=0\n")
    c.daemon_reload()
    c.systemctl("start", "dsv4@stub.service")

    removed = _apt(c, "remove", PACKAGE).stdout
    assert "running instances were left alone: dsv4@stub.service" in removed
    assert "systemctl stop 'dsv4@*'" in removed
    assert c.is_active("dsv4@stub.service") == "active"

    purged = _apt(c, "purge", PACKAGE).stdout
    assert c.is_active("dsv4@stub.service") == "active"
    assert _exists(c, "/run/supervisord-gpu/stub"), "purge removed the runtime dir of a running instance"
    assert "kept /run/supervisord-gpu" in purged

    c.systemctl("stop", "dsv4@*")
    assert c.is_active("dsv4@stub.service") == "inactive"


def test_installed_package_runs_an_instance_that_root_and_users_can_see_but_only_root_stops(container, deb: Path) -> None:  # type: ignore[no-untyped-def]
    c = container
    _apt(c, "install", "--no-install-recommends", f"/debs/{deb.name}")
    rehearse_in_package_config(c, server_startup=1.0)  # no GPU here: stand-ins
    c.systemctl("start", "dsv4@tp4-512k", timeout=120)
    assert c.is_active("dsv4@tp4-512k") == "active"
    sglang, router = (int(c.run(["id", "-u", user]).stdout) for user in ("sglang", "sglang-router"))
    uids = {p.uid for p in c.processes() if "/dsv4-" in p.cgroup and not p.cgroup.endswith("-router.scope")}
    assert uids == {sglang}  # the server, not root
    assert {p.uid for p in c.processes() if p.cgroup.endswith("dsv4-tp4-512k-router.scope")} == {router}  # its own user
    for user in (None, "alice"):
        out = c.run(["gpusupctl", "status"], user=user).stdout
        assert "dsv4@tp4-512k.service" in out and "ready: 1 server behind router on 0.0.0.0:30001, GPUs 0-3" in out, out
    refused = c.run(["gpusupctl", "stop", "tp4-512k"], user="alice", check=False)
    assert refused.returncode == 1 and "refused" in refused.stderr
    assert c.is_active("dsv4@tp4-512k") == "active"
    journal = c.journal("dsv4@*")
    assert "Load weight begin" in journal and "The server is fired up and ready to roll!" in journal
    c.run(["gpusupctl", "stop", "tp4-512k", "--wait"], timeout=120)
    assert c.is_active("dsv4@tp4-512k") == "inactive"


STRANGER = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('0.0.0.0', 30001)); s.listen(); time.sleep(600)")  # REUSEADDR: the rehearsal's connections linger


def test_every_verb_works_as_an_admin_calls_it_after_installing(container, deb: Path) -> None:  # type: ignore[no-untyped-def]
    """The README's and the man page's commands, exactly: no --config-dir (the package's
    /etc/supervisord-gpu), then $SUPERVISORD_GPU_CONFIG_DIR. `rehearse tp4-512k` was "internal
    error: TypeError: expected str, bytes or os.PathLike object, not NoneType"; `check` stopped
    at the missing model path and never named the stranger on the router's port."""
    c = container
    _apt(c, "install", "--no-install-recommends", f"/debs/{deb.name}")

    rehearsed = c.run(["gpusupctl", "rehearse", "tp4-512k", "--startup", "0.5"], check=False, timeout=180)
    out = rehearsed.stdout + rehearsed.stderr
    assert rehearsed.returncode == 0 and "verified after stop: GPUs [0, 1, 2, 3] idle" in out, out
    assert "internal error" not in out, out

    c.run(["systemd-run", "--unit=stranger", "/usr/bin/python3", "-c", STRANGER])
    from support import wait_for

    wait_for(lambda: ":30001" in c.run(["ss", "-Hltn"]).stdout, 10, "the stranger listening", interval=0.2)
    stranger = int(c.systemctl("show", "-P", "MainPID", "stranger.service").stdout)
    checked = c.run(["gpusupctl", "check", "tp4-512k", "--rehearsal"], check=False)
    assert checked.returncode == 3 and f"port 0.0.0.0:30001 (router) held by pid {stranger}" in checked.stdout, \
        checked.stdout + checked.stderr
    checked = c.run(["gpusupctl", "check", "tp4-512k"], check=False)  # production: no model here, no NVML
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "tp4-512k.toml: servers.server.model_path: " in checked.stderr, checked.stderr
    assert f"port 0.0.0.0:30001 (router) held by pid {stranger}" in checked.stdout, checked.stdout
    assert "GPUs not checked: " in checked.stdout, checked.stdout
    c.systemctl("stop", "stranger.service")

    assert json.loads(c.run(["gpusupctl", "gpus", "--rehearsal", "--json"]).stdout)["backend"] == "simulated"
    assert "standin_server" in c.run(["gpusupctl", "render", "tp4-512k", "--rehearsal"]).stdout
    dry = c.run(["gpusupctl", "switch", "tp4-512k", "--dry-run"])
    assert dry.stdout.startswith("plan: switch to tp4-512k") and "servers.server.model_path" in dry.stderr, dry.stdout
    status = c.run(["gpusupctl", "status"], check=False)
    assert status.returncode == 0 and "dsv4@tp4-512k.service" in status.stdout, status.stdout + status.stderr

    # the environment variable: a config directory of the admin's own
    c.run(["cp", "-a", "/etc/supervisord-gpu", "/srv/gpusup"])
    c.run(["mv", "/srv/gpusup/profiles/tp4-512k.toml", "/srv/gpusup/profiles/mine.toml"])
    env = {"SUPERVISORD_GPU_CONFIG_DIR": "/srv/gpusup"}
    assert "--tp-size 4" in c.run(["gpusupctl", "render", "mine"], env=env).stdout
    mine = c.run(["gpusupctl", "check", "mine", "--rehearsal"], env=env, check=False)
    assert mine.returncode == 0 and mine.stdout.startswith("mine: profile valid"), mine.stdout + mine.stderr
    assert c.run(["gpusupctl", "render", "mine"], check=False).returncode == 2  # not in /etc/supervisord-gpu

    # the systemd verbs, on stand-ins (no GPU here)
    rehearse_in_package_config(c, server_startup=0.5)
    c.run(["gpusupctl", "start", "tp4-512k", "--wait"], timeout=120)
    assert c.is_active("dsv4@tp4-512k") == "active"
    c.run(["gpusupctl", "restart", "tp4-512k", "--wait"], timeout=120)
    assert "Load weight begin" in c.run(["gpusupctl", "logs", "tp4-512k", "server", "-n", "200"]).stdout
    c.run(["gpusupctl", "stop", "tp4-512k", "--wait"], timeout=120)
    assert c.is_active("dsv4@tp4-512k") == "inactive"
