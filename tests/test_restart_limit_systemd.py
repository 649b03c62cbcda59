"""The crash-loop limit under the real systemd 252, with the shipped unit and polkit rule.

Restarts by hand never count (five `gpusupctl restart --wait` in a row by a gpusup member all
end active: systemd's StartLimitBurst=3 used to fail the third); only systemd's automatic
restarts do (NRestarts): a server that crashes at every start ends, at the third automatic
restart, with the daemon refusing (exit 6, not retried, the whole reason in `gpusupctl
status`), and a gpusup member brings it back with `gpusupctl start --wait` (reset-failed
allowed by polkit). Ready for StartLimitIntervalSec without a break, the daemon forgets earlier
automatic restarts. One boot; RestartSec=1 in a drop-in for speed, and StartLimitIntervalSec=4
once the restarts by hand are done (under a 4 s interval systemd's old limit would not bite).
"""

from __future__ import annotations

import re
import time

import pytest

from box import REPO, install, server_profile
from support import free_ports, wait_for

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

CTL = f"{REPO}/.venv/bin/gpusupctl"
PROFILES = "/etc/supervisord-gpu/profiles"
WINDOW_S = 4  # the drop-in's StartLimitIntervalSec: the daemon's forgiveness window


@pytest.fixture(scope="module")
def ctr():  # type: ignore[no-untyped-def]
    """One container for the module: Debian's polkitd, our unit (RestartSec=1, a 4 s window),
    the package's rule, alice in gpusup, bob in nothing."""
    from rig.systemd_container import SystemdContainer, repo_binds, require_rig

    require_rig()
    with SystemdContainer(binds=repo_binds(), extra_packages=("polkitd",)) as c:
        install(c, startup=0.5, unit_extra="RestartSec=1\n")
        c.write_file("/usr/share/polkit-1/rules.d/50-supervisord-gpu.rules",
                     (REPO / "etc" / "polkit-1" / "rules.d" / "50-supervisord-gpu.rules").read_text())
        c.run(["usermod", "-aG", "gpusup", "alice"])
        c.run(["useradd", "--create-home", "bob"])
        c.systemctl("restart", "polkit")
        c.daemon_reload()
        yield c


def show(c, name: str, prop: str) -> str:  # type: ignore[no-untyped-def]
    return c.systemctl("show", "-P", prop, f"dsv4@{name}.service").stdout.strip()


def restarts_scheduled(c, name: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(n) for n in re.findall(r"restart counter is at (\d+)", c.journal(f"dsv4@{name}.service"))]


def test_restarts_by_hand_never_count(ctr):  # type: ignore[no-untyped-def]
    (port,) = free_ports(1)
    ctr.write_file(f"{PROFILES}/alpha.toml", server_profile(0, port, start_timeout=10))
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
    ctr.write_file(f"{PROFILES}/crashy.toml", server_profile(1, port, start_timeout=10, fault="crash-on-start"))
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
    ctr.write_file(f"{PROFILES}/crashy.toml", server_profile(1, port, start_timeout=10))
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
    ctr.write_file(f"{PROFILES}/broken.toml", server_profile(2, port, start_timeout=10, fault="crash-on-start"))
    ctr.systemctl("start", "dsv4@broken", check=False, timeout=60)
    wait_for(lambda: ctr.is_active("dsv4@broken") == "failed", 60, "dsv4@broken failed", interval=0.3)
    r = ctr.run(["systemctl", "reset-failed", "dsv4@broken.service"], user="bob", check=False)
    assert r.returncode != 0 and ctr.is_active("dsv4@broken") == "failed", r.stderr
    ctr.run(["systemctl", "reset-failed", "dsv4@broken.service"], user="alice")
    assert ctr.is_active("dsv4@broken") == "inactive" and show(ctr, "broken", "NRestarts") == "0"
