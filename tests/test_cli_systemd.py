"""gpusupctl against a real systemd: status of ready, failed and stopped instances; start --wait; who may do what."""

from __future__ import annotations

import json

import pytest

from box import REPO, box, server_profile as profile  # noqa: F401  (box is a fixture)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]
CTL = f"{REPO}/.venv/bin/gpusupctl"


@pytest.fixture
def three(box):  # type: ignore[no-untyped-def]
    box.install(startup=1.0, unit_extra="Restart=no\n")
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(0, 31001, start_timeout=3))
    box.write_file("/etc/supervisord-gpu/profiles/beta.toml", profile(1, 31002, start_timeout=3, fault="never-ready"))
    box.write_file("/etc/supervisord-gpu/profiles/gamma.toml", profile(2, 31003, start_timeout=3))
    box.systemctl("start", "dsv4@alpha", timeout=60)
    box.systemctl("start", "dsv4@beta", check=False, timeout=60)
    box.systemctl("start", "dsv4@gamma", timeout=60)
    box.systemctl("stop", "dsv4@gamma", timeout=60)
    return box


def test_status_shows_a_ready_a_failed_and_a_stopped_instance(three):
    out = three.run([CTL, "status"]).stdout
    lines = {l.split()[0]: l for l in out.splitlines() if l.startswith("dsv4@")}
    assert "ready" in lines["dsv4@alpha.service"] and "up " in lines["dsv4@alpha.service"]
    assert "failed" in lines["dsv4@beta.service"]
    assert "inactive" in lines["dsv4@gamma.service"]
    assert "ready: 1 server on 127.0.0.1:31001, GPUs 0" in out
    assert "not ready within its start_timeout" in out or "result: " in out
    assert max(len(l) for l in out.splitlines()) <= 80
    assert "\033[" not in out  # no colours when not on a terminal
    data = json.loads(three.run([CTL, "status", "--json"]).stdout)
    by = {i["instance"]: i for i in data["instances"]}
    assert by["alpha"]["active_state"] == "active" and by["alpha"]["daemon"]["state"] == "ready"
    assert by["alpha"]["daemon"]["processes"][0]["pid"] > 0
    assert by["beta"]["active_state"] == "failed" and by["beta"]["daemon"] is None
    assert by["gamma"]["active_state"] == "inactive"
    held = {g["index"]: g for g in data["gpus"]}
    assert not held[0]["idle"] and held[0]["holders"][0]["owner"] == "alpha/server"
    assert held[2]["idle"]


def test_start_wait_follows_progress_until_ready(three):
    r = three.run([CTL, "start", "gamma", "--wait"], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting:" in r.stdout and r.stdout.strip().endswith("dsv4@gamma.service: active")


def test_an_unprivileged_user_can_read_status_but_not_stop(three):
    r = three.run([CTL, "status"], user="alice")
    assert r.returncode == 0 and "dsv4@alpha.service" in r.stdout
    r = three.run([CTL, "stop", "alpha"], user="alice", check=False)
    assert r.returncode == 1 and r.stderr.startswith("gpusupctl: StopUnit of dsv4@alpha.service refused")
    assert three.is_active("dsv4@alpha") == "active"


def test_start_on_a_machine_without_our_unit_is_one_line_exit_3(box):
    """A checkout's gpusupctl on a machine whose systemd has no dsv4@.service (the package not
    installed; seen on a fresh Debian 12 booted with systemd): systemd answers NoSuchUnit, which
    was "internal error: LookupError: GDBus.Error:...". Now one line naming the unit file."""
    for verb in ("start", "restart"):
        r = box.run([CTL, verb, "alpha"], check=False)
        assert r.returncode == 3, r.stdout + r.stderr
        assert r.stderr.strip() == ("gpusupctl: systemd has no unit dsv4@alpha.service: the unit file dsv4@.service "
                                    "is not installed (it comes with the supervisord-gpu package)"), r.stderr


def test_logs_shows_one_process(three):
    out = three.run([CTL, "logs", "alpha", "server", "--lines", "200"]).stdout
    assert "Load weight begin" in out
    for line in out.splitlines():  # the server's own lines, and the daemon's records about the server
        assert " server[" in line or ("supervisord-gpu[" in line and ": server: " in line), line


# --------------------------------------------------------------------------- polkit


@pytest.fixture
def polkit_box(fresh_systemd_container):  # type: ignore[no-untyped-def]
    """The box with Debian 12's polkitd running and the package's rule installed."""
    from box import install

    ctr = fresh_systemd_container(extra_packages=("polkitd",))
    install(ctr, startup=0.5)
    ctr.write_file("/usr/share/polkit-1/rules.d/50-supervisord-gpu.rules",
                   (REPO / "etc" / "polkit-1" / "rules.d" / "50-supervisord-gpu.rules").read_text())
    ctr.run(["useradd", "--create-home", "bob"])
    ctr.run(["usermod", "-aG", "gpusup", "alice"])
    ctr.systemctl("restart", "polkit")
    return ctr


def test_polkit_lets_gpusup_members_manage_dsv4_units_and_nobody_else(polkit_box):
    c = polkit_box
    gpusupctl = f"{REPO}/.venv/bin/gpusupctl"
    c.run([gpusupctl, "start", "tp4-512k", "--wait"], user="alice", timeout=120)
    assert c.is_active("dsv4@tp4-512k") == "active"
    refused = c.run([gpusupctl, "stop", "tp4-512k"], user="bob", check=False)
    assert refused.returncode != 0 and c.is_active("dsv4@tp4-512k") == "active", refused.stderr
    # a member may do exactly start/stop/restart of dsv4@ services: not other units, not our scopes
    for argv in (["systemctl", "stop", "dbus"], ["systemctl", "stop", "dsv4-tp4-512k-server.scope"],
                 ["systemctl", "disable", "dsv4@tp4-512k"]):
        r = c.run(argv, user="alice", check=False)
        assert r.returncode != 0, (argv, r.stdout, r.stderr)
    assert c.is_active("dbus") == "active" and c.is_active("dsv4-tp4-512k-server.scope") == "active"
    c.run([gpusupctl, "restart", "tp4-512k", "--wait"], user="alice", timeout=120)
    c.run([gpusupctl, "stop", "tp4-512k", "--wait"], user="alice", timeout=120)
    assert c.is_active("dsv4@tp4-512k") == "inactive"
    # a profile that does not exist: polkit itself refuses the start (the daemon would refuse it
    # too, but only once systemd had run it); stopping any dsv4@ name stays allowed
    for verb in ("start", "restart"):
        r = c.run(["systemctl", verb, "dsv4@no-such-profile"], user="alice", check=False)
        assert r.returncode != 0 and ("Access denied" in r.stderr or "authentication" in r.stderr.lower()), r.stderr
    assert c.systemctl("show", "-P", "InvocationID", "dsv4@no-such-profile").stdout.strip() == "", "systemd ran it"
    assert c.run(["systemctl", "stop", "dsv4@no-such-profile"], user="alice", check=False).returncode == 0


FORGE = """
from gi.repository import Gio, GLib
bus = Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
bus.emit_signal(None, "/org/freedesktop/systemd1/unit/dsv4_40tp4_2d512k_2eservice", "org.freedesktop.DBus.Properties",
                "PropertiesChanged", GLib.Variant("(sa{sv}as)", ("org.freedesktop.systemd1.Unit",
                {"ActiveState": GLib.Variant("s", "active")}, [])))
for job in range(1, 400):  # and "your job is done", for every job id it might have
    bus.emit_signal(None, "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "JobRemoved",
                    GLib.Variant("(uoss)", (job, f"/org/freedesktop/systemd1/job/{job}", "dsv4@tp4-512k.service", "done")))
bus.flush_sync(None)
"""


def test_start_wait_believes_systemd_itself_not_a_signal_any_user_can_forge(box):
    box.install(startup=8.0)
    box.run(["systemd-run", "--unit=waiter", "--collect", "--property=RemainAfterExit=yes",
             f"{REPO}/.venv/bin/gpusupctl", "start", "tp4-512k", "--wait"])
    from support import wait_for

    wait_for(lambda: box.is_active("dsv4@tp4-512k") == "activating", 20, "the start to be under way")
    box.run(["python3", "-c", FORGE], user="alice")  # "your unit is active", from a local user
    import time

    time.sleep(1.5)
    assert box.is_active("dsv4@tp4-512k") == "activating"
    assert box.systemctl("show", "-P", "SubState", "waiter").stdout.strip() == "running", "--wait believed the forgery"
    wait_for(lambda: box.systemctl("show", "-P", "SubState", "waiter").stdout.strip() == "exited", 60, "the real ready")
    assert box.systemctl("show", "-P", "ExecMainStatus", "waiter").stdout.strip() == "0"
    assert box.is_active("dsv4@tp4-512k") == "active"
    box.systemctl("stop", "dsv4@tp4-512k", timeout=120)


def test_a_typo_is_named_before_queuing_and_systemds_start_limit_is_named_with_the_way_back(box):
    """The first hour: `gpusupctl start tp4_512k` said "queued" and exited 0; the restart by hand
    that hit systemd's own start limit blamed "stop requested" (the daemon's last STATUS=, from
    the stop half of the restart). Here the limit is 3 starts, not the shipped 20."""
    box.install(startup=0.3, unit_extra="[Unit]\nStartLimitBurst=3\nStartLimitIntervalSec=600\n")
    typo = box.run([CTL, "start", "tp4_512k"], check=False)
    assert typo.returncode == 2 and "unknown profile 'tp4_512k'; did you mean 'tp4-512k'?" in typo.stderr, typo.stderr
    assert box.systemctl("show", "-P", "InvocationID", "dsv4@tp4_512k").stdout.strip() == "", "systemd ran it"
    box.run([CTL, "start", "tp4-512k", "--wait"], timeout=120)
    for _ in range(2):
        box.run([CTL, "restart", "tp4-512k", "--wait"], timeout=120)
    hit = box.run([CTL, "restart", "tp4-512k", "--wait"], check=False, timeout=120)
    assert hit.returncode == 3, hit.stdout + hit.stderr
    assert "its start limit was hit (3 starts within 600 s" in hit.stderr and "stop requested" not in hit.stderr, hit.stderr
    assert "`gpusupctl start tp4-512k` resets the limit" in hit.stderr
    back = box.run([CTL, "start", "tp4-512k", "--wait"], check=False, timeout=120)
    assert back.returncode == 0 and box.is_active("dsv4@tp4-512k") == "active", back.stdout + back.stderr
