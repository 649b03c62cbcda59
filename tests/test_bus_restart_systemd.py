"""A restart of the system bus must not tear down a healthy instance.

GLib's shared bus connection raises SIGTERM in its process when the bus goes away; the daemon
then stopped its servers and exited 0, which Restart=on-failure never restarts. The daemon now
holds its connections with exit-on-close off and reconnects: the unit, the daemon and every
server keep their PIDs, and its API answers again once the bus is back.

Two tests: one boot of a real systemd (dbus restarted under a running instance), and a fast
one of the reconnecting connection against a private dbus-daemon killed and started again.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from box import REPO, box, server_profile as profile  # noqa: F401  (box is a fixture)
from private_bus import PrivateBus
from supervisord_gpu.bus import names
from support import wait_for

CTL = f"{REPO}/.venv/bin/gpusupctl"
BACK_WITHIN_S = 30.0


def pids(ctr) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The unit's main PID, and every server's PID (from the daemon, over the bus)."""
    unit = ctr.systemctl("show", "-P", "MainPID", "dsv4@alpha").stdout.strip()
    status = json.loads(ctr.run([CTL, "status", "alpha", "--json"]).stdout)["instances"][0]
    return {"main": unit, **{p["name"]: str(p["pid"]) for p in status["daemon"]["processes"]}}


def restart_system_bus(ctr) -> None:  # type: ignore[no-untyped-def]
    """dbus-daemon gone and back, as an upgrade of dbus does. Debian 12's dbus.service allows
    `systemctl restart dbus`; should a dbus unit refuse it, kill it outright and start it again."""
    r = ctr.systemctl("restart", "dbus", check=False)
    if r.returncode == 0:
        return
    print(f"systemctl restart dbus refused ({r.stderr.strip()}): killing it instead")
    ctr.systemctl("kill", "--signal=SIGKILL", "dbus", check=False)
    wait_for(lambda: ctr.is_active("dbus") != "active", 10, "dbus to die")
    ctr.systemctl("start", "dbus.socket", "dbus", check=False)


@pytest.mark.systemd
def test_a_system_bus_restart_leaves_the_instance_and_its_servers_running(box):
    box.install(startup=0.5)
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(0, 31001))
    box.systemctl("start", "dsv4@alpha", timeout=60)
    before = pids(box)
    old_bus = box.systemctl("show", "-P", "MainPID", "dbus").stdout.strip()

    restart_system_bus(box)
    wait_for(lambda: box.is_active("dbus") == "active"
             and box.systemctl("show", "-P", "MainPID", "dbus").stdout.strip() not in ("0", old_bus), 20,
             "a new dbus-daemon")
    began = time.monotonic()

    def answers() -> bool:
        r = box.run([CTL, "status", "alpha", "--json"], check=False, timeout=20)
        return r.returncode == 0 and (json.loads(r.stdout)["instances"][0].get("daemon") or {}).get("state") == "ready"

    wait_for(answers, BACK_WITHIN_S, "the daemon's API back on the new bus")
    took = time.monotonic() - began
    journal = box.journal("dsv4@alpha")
    assert box.is_active("dsv4@alpha") == "active", journal[-3000:]
    assert pids(box) == before, journal[-3000:]
    health = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:31001/health', timeout=5).status)"
    assert box.run(["python3", "-c", health]).stdout.strip() == "200"  # inside: the box has its own network
    assert "system bus lost" in journal and "system bus back" in journal, journal[-3000:]
    assert "stopping" not in box.systemctl("show", "-P", "StatusText", "dsv4@alpha").stdout
    # systemd calls go through the new connection too: a restart of one server (a new scope) works
    r = box.run([CTL, "restart", "alpha", "--wait"], timeout=120)
    assert r.stdout.strip().endswith("dsv4@alpha.service: active"), r.stdout + r.stderr
    print(f"API back {took:.1f} s after the new dbus-daemon was up;", *(line for line in journal.splitlines() if "system bus" in line))


# --------------------------------------------------------------------------- no systemd needed


def restart(bus: PrivateBus) -> None:
    """Kill the private bus outright and start a new one on the same socket."""
    bus.proc.kill()
    bus.proc.wait(5)
    bus.socket.unlink(missing_ok=True)
    config = bus.dir / "bus.conf"
    bus.proc = subprocess.Popen(["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(bus.socket.exists, 5, "the new dbus-daemon")


@pytest.mark.dbus
def test_the_link_survives_the_bus_and_says_so(monkeypatch):
    from gi.repository import GLib

    from supervisord_gpu.bus.link import BusLink

    bus = PrivateBus(permissive=True)
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus.address)
    said: list[str] = []
    back: list[str] = []
    link = BusLink(say=lambda message, _priority: said.append(message), backoff=(0.05, 0.2))
    loop = GLib.MainLoop()
    import threading

    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        first = link.con
        assert not first.get_exit_on_close()
        link.watch(lambda con: back.append(con.get_unique_name()))
        restart(bus)
        wait_for(lambda: len(back) == 1, 10, "the link back on the new bus")
        assert link.con is not first and not link.con.is_closed() and not link.con.get_exit_on_close()
        assert said[0].startswith("system bus lost") and said[-1].startswith("system bus back"), said
        assert os.getpid() > 0  # still here: no SIGTERM came
        restart(bus)  # and again: the new connection is watched too
        wait_for(lambda: len(back) == 2, 10, "the link back a second time")
    finally:
        link.close()
        loop.quit()
        thread.join(2)
        bus.close()


@pytest.mark.dbus
def test_the_daemon_serves_again_on_a_restarted_bus_and_keeps_its_servers(tmp_path, cgroups):
    from test_dbus import Daemon, connect

    bus = PrivateBus()
    daemon = Daemon(tmp_path, cgroups, bus)
    try:
        before = {p["name"]: p["pid"] for p in json.loads(daemon.obj.GetStatus())["processes"]}
        restart(bus)

        def status() -> dict | None:  # type: ignore[type-arg]
            try:
                return json.loads(connect(bus.address).get(names.bus_name("pd"), names.OBJECT_PATH).GetStatus())  # type: ignore[no-any-return]
            except Exception:
                return None

        now = wait_for(status, 15, "the daemon's API on the new bus", interval=0.2)
        assert daemon.proc.poll() is None
        assert now["state"] == "ready" and {p["name"]: p["pid"] for p in now["processes"]} == before
        daemon.log.seek(0)
        log = daemon.log.read()
        assert "system bus lost" in log and "system bus back" in log and "stopping" not in log, log[-2000:]
    finally:
        daemon.close()
        bus.close()


def test_no_bus_reads_in_words_not_glibs_domain_and_code(monkeypatch, tmp_path):
    """#26: a rehearsal without a system bus said "BusError: system bus not reachable:
    g-io-error-quark: Could not connect: No such file or directory (1)"."""
    from supervisord_gpu.bus.link import open_connection
    from supervisord_gpu.errors import BusError

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus-here")
    with pytest.raises(BusError) as said:
        open_connection()
    assert str(said.value) == "system bus not reachable: Could not connect: No such file or directory", str(said.value)
