"""The crash-loop limit under the real systemd 252, with the built .deb installed as an operator
installs it (`dpkg -i`: its unit, polkit rule, D-Bus policy, group, the `sglang` user and
`/usr/bin/gpusupctl`), Debian's polkitd, and rehearsal switched on in the package's config.

Restarts by hand never count (five `gpusupctl restart --wait` in a row by a gpusup member all
end active: systemd's StartLimitBurst=3 used to fail the third); only systemd's automatic
restarts do (NRestarts): a server that crashes at every start ends, at the third automatic
restart, with the daemon refusing (exit 6, not retried, the whole reason in `gpusupctl
status`), and a gpusup member brings it back with `gpusupctl start --wait` (reset-failed
allowed by polkit). Ready for StartLimitIntervalSec without a break, the daemon forgets earlier
automatic restarts. A stranger on [::]:30001 (the IPv6 wildcard) makes the shipped tp4-512k
refuse with exit 3 before any server loads, and systemd does not retry it. One boot; RestartSec=1
in a drop-in for speed, and StartLimitIntervalSec=4 once the restarts by hand are done (under a
4 s interval systemd's old limit would not bite).
"""

from __future__ import annotations

import re
import time

import pytest

from box import install_package, rehearse_in_package_config
from box import server_profile as checkout_profile
from support import free_ports, wait_for

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

CTL = "/usr/bin/gpusupctl"  # the package's
PROFILES = "/etc/supervisord-gpu/profiles"
WINDOW_S = 4  # the drop-in's StartLimitIntervalSec: the daemon's forgiveness window


@pytest.fixture(scope="module")
def ctr(deb):  # type: ignore[no-untyped-def]
    """One container for the module: the .deb and Debian's polkitd, rehearsal on in the package's
    config, RestartSec=1 in a drop-in, alice in gpusup, bob in nothing."""
    from rig.systemd_container import Bind, SystemdContainer, repo_binds, require_rig

    require_rig()
    with SystemdContainer(binds=[*repo_binds(), Bind(str(deb.parent), "/debs", True)], extra_packages=("polkitd",)) as c:
        install_package(c, deb)
        rehearse_in_package_config(c, server_startup=0.5)
        c.write_file("/etc/systemd/system/dsv4@.service.d/test.conf", "[Service]\nRestartSec=1\n")
        c.run(["usermod", "-aG", "gpusup", "alice"])
        c.run(["useradd", "--create-home", "bob"])
        c.systemctl("restart", "polkit")
        c.daemon_reload()
        yield c


def profile(*args, **kw) -> str:  # type: ignore[no-untyped-def]
    """box's one-server profile, run as the package's `sglang` (the .deb's config names no default user)."""
    return '[defaults]\nuser = "sglang"\n' + checkout_profile(*args, **kw)


def show(c, name: str, prop: str) -> str:  # type: ignore[no-untyped-def]
    return c.systemctl("show", "-P", prop, f"dsv4@{name}.service").stdout.strip()


def restarts_scheduled(c, name: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(n) for n in re.findall(r"restart counter is at (\d+)", c.journal(f"dsv4@{name}.service"))]


def test_restarts_by_hand_never_count(ctr):  # type: ignore[no-untyped-def]
    (port,) = free_ports(1)
    ctr.write_file(f"{PROFILES}/alpha.toml", profile(0, port, start_timeout=10))
    r = ctr.run([CTL, "start", "alpha", "--wait"], user="alice", timeout=60, check=False)
    assert r.stdout.strip().endswith("dsv4@alpha.service: active"), r.stdout + r.stderr + ctr.run(
        ["journalctl", "-b", "--no-pager", "-n", "80"]).stdout
    for i in range(5):  # systemd's StartLimitBurst=3 in 600 s failed the third
        r = ctr.run([CTL, "restart", "alpha", "--wait"], user="alice", timeout=60, check=False)
        assert r.returncode == 0 and r.stdout.strip().endswith("dsv4@alpha.service: active"), (i, r.stdout, r.stderr)
        assert show(ctr, "alpha", "NRestarts") == "0"
    assert ctr.is_active("dsv4@alpha") == "active"


def test_ready_for_the_window_forgets_earlier_crashes(ctr):  # type: ignore[no-untyped-def]
    # a short window from here on (the restarts above ran under the shipped 600 s, where
    # systemd's old StartLimitBurst=3 bites); the daemon reads it at its next start
    ctr.write_file("/etc/systemd/system/dsv4@.service.d/window.conf", f"[Unit]\nStartLimitIntervalSec={WINDOW_S}\n")
    ctr.daemon_reload()
    if ctr.is_active("dsv4@alpha") != "active":
        ctr.run([CTL, "start", "alpha", "--wait"], timeout=60)
    first = int(show(ctr, "alpha", "MainPID"))
    ctr.run(["kill", "-KILL", str(first)])  # a daemon that died: systemd restarts it, and counts it
    wait_for(lambda: show(ctr, "alpha", "NRestarts") == "1", 20, "systemd's automatic restart", interval=0.2)
    wait_for(lambda: ctr.is_active("dsv4@alpha") == "active", 30, "the restarted daemon ready", interval=0.2)
    assert int(show(ctr, "alpha", "MainPID")) != first
    # ready for StartLimitIntervalSec without a break: the daemon reset-fails its own active unit
    wait_for(lambda: show(ctr, "alpha", "NRestarts") == "0", WINDOW_S + 15, "the restart to be forgotten", interval=0.3)
    assert ctr.is_active("dsv4@alpha") == "active"
    assert "no longer count toward its restart limit" in ctr.journal("dsv4@alpha.service")
    ctr.run([CTL, "stop", "alpha", "--wait"], timeout=60)


def test_a_crash_loop_stops_at_the_limit_and_a_member_recovers_it(ctr):  # type: ignore[no-untyped-def]
    (port,) = free_ports(1)
    ctr.write_file(f"{PROFILES}/crashy.toml", profile(1, port, start_timeout=10, fault="crash-on-start"))
    t0 = time.monotonic()
    ctr.run([CTL, "start", "crashy"], user="alice")  # queued: it fails, and systemd retries it
    wait_for(lambda: show(ctr, "crashy", "ExecMainStatus") == "6" and ctr.is_active("dsv4@crashy") == "failed", 60,
             "the daemon to refuse the third automatic restart", interval=0.3)
    took = time.monotonic() - t0
    assert show(ctr, "crashy", "NRestarts") == "3" and show(ctr, "crashy", "Result") == "exit-code"
    time.sleep(2.5)  # past RestartSec=1, twice: not retried
    assert ctr.is_active("dsv4@crashy") == "failed" and show(ctr, "crashy", "NRestarts") == "3"
    assert max(restarts_scheduled(ctr, "crashy")) == 3
    whole = ("restart limit reached: 3 automatic restarts since the last start by hand "
             "(why each failed: journalctl -u dsv4@crashy.service); gpusupctl start crashy to try again")
    assert whole in show(ctr, "crashy", "StatusText")
    out = ctr.run([CTL, "status", "crashy"]).stdout
    assert whole in " ".join(out.split()), out  # wrapped to 80 columns, but all of it
    assert whole in ctr.journal("dsv4@crashy.service")
    # the operator fixes the cause; a gpusup member starts it again (reset-failed first, by polkit)
    ctr.write_file(f"{PROFILES}/crashy.toml", profile(1, port, start_timeout=10))
    r = ctr.run([CTL, "start", "crashy", "--wait"], user="alice", timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("dsv4@crashy.service: active"), r.stdout + r.stderr
    assert "stays failed" not in r.stderr, r.stderr  # the reset-failed went through
    assert show(ctr, "crashy", "NRestarts") == "0"
    ctr.run([CTL, "stop", "crashy", "--wait"], user="alice", timeout=60)
    print(f"crash loop to exit 6 in {took:.1f} s")


def test_reset_failed_is_for_members_and_dsv4_units_only(ctr):  # type: ignore[no-untyped-def]
    ctr.run(["systemd-run", "--unit=other.service", "false"], check=False)
    wait_for(lambda: ctr.is_active("other.service") == "failed", 10, "other.service failed", interval=0.2)
    r = ctr.run(["systemctl", "reset-failed", "other.service"], user="alice", check=False)
    assert r.returncode != 0 and ctr.is_active("other.service") == "failed", r.stderr
    (port,) = free_ports(1)
    ctr.write_file(f"{PROFILES}/broken.toml", profile(2, port, start_timeout=10, fault="crash-on-start"))
    ctr.systemctl("start", "dsv4@broken", check=False, timeout=60)
    wait_for(lambda: ctr.is_active("dsv4@broken") == "failed", 60, "dsv4@broken failed", interval=0.3)
    r = ctr.run(["systemctl", "reset-failed", "dsv4@broken.service"], user="bob", check=False)
    assert r.returncode != 0 and ctr.is_active("dsv4@broken") == "failed", r.stderr
    ctr.run(["systemctl", "reset-failed", "dsv4@broken.service"], user="alice")
    assert ctr.is_active("dsv4@broken") == "inactive" and show(ctr, "broken", "NRestarts") == "0"


STRANGER = """
import socket, time
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind(("::", 30001))
s.listen()
time.sleep(600)
"""


def test_a_stranger_on_the_ipv6_wildcard_is_exit_3_before_any_server_loads(ctr):  # type: ignore[no-untyped-def]
    """The shipped tp4-512k's router is 0.0.0.0:30001; nobody holds [::]:30001, IPv6 only. `check`
    used to call the port free, and the start loaded its server (minutes on a real model), then
    found the port taken and exited 1, which systemd retries."""
    ctr.run(["systemd-run", "--unit=stranger-v6", "-p", "User=nobody", "/usr/bin/python3", "-c", STRANGER])
    wait_for(lambda: "[::]:30001" in ctr.run(["ss", "-Hltn"]).stdout, 10, "the stranger listening", interval=0.2)
    stranger = int(ctr.systemctl("show", "-P", "MainPID", "stranger-v6.service").stdout)
    checked = ctr.run([CTL, "check", "tp4-512k"], check=False)  # root, who can name the holder
    assert checked.returncode != 0 and f"port 0.0.0.0:30001 (router) held by pid {stranger}" in checked.stdout + checked.stderr, \
        checked.stdout + checked.stderr
    r = ctr.run([CTL, "start", "tp4-512k", "--wait"], user="alice", timeout=60, check=False)
    assert r.returncode == 1 and f"held by pid {stranger}" in r.stdout, r.stdout + r.stderr
    assert show(ctr, "tp4-512k", "ExecMainStatus") == "3" and ctr.is_active("dsv4@tp4-512k") == "failed"
    time.sleep(2.5)  # past RestartSec=1, twice: exit 3 is not retried
    assert ctr.is_active("dsv4@tp4-512k") == "failed" and show(ctr, "tp4-512k", "NRestarts") == "0"
    journal = ctr.journal("dsv4@tp4-512k.service")
    assert "refusing to start" in journal and f"held by pid {stranger}" in journal, journal[-3000:]
    assert "started pid" not in journal and "Load weight begin" not in journal, journal[-3000:]  # nothing loaded
    ctr.systemctl("stop", "stranger-v6.service")
    ctr.systemctl("reset-failed", "dsv4@tp4-512k.service")
