"""The D-Bus API against a real dbus-daemon (a private system-type bus with our shipped policy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from private_bus import PrivateBus
from support import free_ports, pd_profile, write_config
from supervisord_gpu.bus import names

pytestmark = pytest.mark.dbus
REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def connect(address: str):  # type: ignore[no-untyped-def]
    from pydbus import connect as pydbus_connect

    return pydbus_connect(address)


class Daemon:
    def __init__(self, tmp: Path, cgroups, bus: PrivateBus) -> None:  # type: ignore[no-untyped-def]
        cdir = write_config(tmp, {"pd": pd_profile(free_ports(5))}, cgroups.root, startup=0.5)
        self.log = open(tmp / "daemon.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", "pd", "--config-dir", str(cdir), "--rehearsal", "--stderr"],
            env=bus.env(), stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.bus_address = bus.address
        self.bus = connect(bus.address)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.obj = self.bus.get(names.bus_name("pd"), names.OBJECT_PATH)
                if json.loads(self.obj.GetStatus())["state"] == "ready":
                    break
            except Exception:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                text = self.log.read()[-3000:]
                self.close()  # never leave a daemon behind: it would restart what the cgroup sandbox kills
                raise AssertionError("daemon did not become ready:\n" + text)
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture
def bus():  # type: ignore[no-untyped-def]
    b = PrivateBus()
    yield b
    b.close()


@pytest.fixture
def daemon(tmp_path, cgroups, bus):  # type: ignore[no-untyped-def]
    d = Daemon(tmp_path, cgroups, bus)
    yield d
    d.close()


def as_nobody(address: str, method: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\nfrom pydbus import connect\n"
        f"o = connect({address!r}).get({names.bus_name('pd')!r}, {names.OBJECT_PATH!r})\n"
        f"try:\n    print(getattr(o, {method!r})(*{args!r}))\nexcept Exception as e:\n    print('ERROR', e); sys.exit(1)\n"
    )
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=30, cwd="/")


def test_read_methods_and_properties_describe_the_running_instance(daemon):
    status = json.loads(daemon.obj.GetStatus())
    assert status["instance"] == "pd" and status["state"] == "ready" and status["driver"] == "cgroupfs"
    procs = {p["name"]: p for p in status["processes"]}
    assert set(procs) == {"prefill", "decode", "router"}
    assert procs["decode"]["pid"] > 0 and procs["decode"]["gpus"] == [1] and procs["decode"]["state"] == "ready"
    assert procs["decode"]["group"].endswith("/supervisord-gpu/pd/decode")
    assert json.loads(daemon.obj.GetProcess("router"))["role"] == "router"
    assert [h["state"] for h in json.loads(daemon.obj.GetHistory("prefill"))][-1] == "ready"
    assert daemon.obj.Ping() == "pd"
    assert daemon.obj.Name == "pd" and daemon.obj.State == "ready"
    assert daemon.obj.StatusText.startswith("ready: 2 servers behind router")


def test_unknown_process_names_and_wrong_argument_types_are_clean_errors(daemon):
    with pytest.raises(Exception, match="org.supervisordgpu.Error.UnknownProcess"):
        daemon.obj.GetProcess("nope")
    raw = subprocess.run(["dbus-send", "--system", "--print-reply", f"--dest={names.bus_name('pd')}", names.OBJECT_PATH,
                          f"{names.INTERFACE}.GetProcess", "int32:7"], capture_output=True, text=True,
                         env={**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": daemon.bus_address})
    assert raw.returncode != 0 and "InvalidArgs" in raw.stderr
    assert daemon.obj.Ping() == "pd"  # still serving


def test_every_state_change_is_signalled_while_a_process_restarts(daemon):
    from gi.repository import GLib

    # Signals are sent from the daemon's GLib thread after its snapshot is swapped, so the start-up's last
    # ("", "ready") may reach us after GetStatus already said ready: only what follows the restart counts.
    seen: list[tuple[str, str]] = []
    loop = GLib.MainLoop()

    def fired(*a):  # type: ignore[no-untyped-def]
        process, state = a[4][1], a[4][2]
        if not seen and (process, state) not in (("", "degraded"), ("decode", "stopping")):
            return
        seen.append((process, state))
        if (process, state) == ("", "ready"):
            loop.quit()

    sub = daemon.bus.subscribe(iface=names.INTERFACE, signal=names.SIGNAL_STATE_CHANGED, signal_fired=fired)
    GLib.timeout_add_seconds(30, loop.quit)
    assert json.loads(daemon.obj.RestartProcess("decode"))["verb"] == "restart decode"
    loop.run()
    sub.unsubscribe()
    decode_states = [s for p, s in seen if p == "decode"]
    assert decode_states[:2] == ["stopping", "stopped"] and decode_states[-1] == "ready"
    assert ("", "degraded") in seen and seen[-1] == ("", "ready")


def test_a_non_root_caller_can_read_but_every_control_call_is_refused_by_the_bus(daemon, bus):
    assert '"state": "ready"' in as_nobody(bus.address, "GetStatus").stdout
    for method, args in (("Stop", ()), ("Restart", ()), ("RestartProcess", ("decode",))):
        r = as_nobody(bus.address, method, *args)
        assert r.returncode == 1 and "AccessDenied" in r.stdout, (method, r.stdout, r.stderr)
    assert json.loads(daemon.obj.GetStatus())["state"] == "ready"


def test_the_daemon_refuses_control_calls_itself_when_the_bus_policy_lets_them_through(tmp_path, cgroups):
    permissive = PrivateBus(permissive=True)
    d = Daemon(tmp_path, cgroups, permissive)
    try:
        r = as_nobody(permissive.address, "Stop")
        assert r.returncode == 1 and "org.supervisordgpu.Error.AccessDenied" in r.stdout and "caller uid 65534" in r.stdout
        assert d.proc.poll() is None and json.loads(d.obj.GetStatus())["state"] == "ready"
    finally:
        d.close()
        permissive.close()


def test_stop_from_root_stops_in_order_and_the_daemon_exits_cleanly(daemon):
    job = json.loads(daemon.obj.Stop())
    assert job["verb"] == "stop" and job["state"] in ("running", "done") and job["id"] > 0
    assert daemon.proc.wait(30) == 0
    daemon.log.seek(0)
    log = daemon.log.read()
    assert "all processes stopped" in log and "(order: router -> decode -> prefill)" in log


def test_the_policy_file_opens_exactly_the_read_methods():
    from supervisord_gpu.api.exports import exported_methods
    from supervisord_gpu.api.service import InstanceObject

    policy = (REPO / "etc" / "dbus-1" / "system.d" / "org.supervisordgpu.conf").read_text()
    reads = {n for n, (_i, _o, control) in exported_methods(InstanceObject).items() if not control}
    for name in reads:
        assert f'send_member="{name}"' in policy
    for name, (_i, _o, control) in exported_methods(InstanceObject).items():
        if control:
            assert f'send_member="{name}"' not in policy
    assert set(names.READ_METHODS) == reads


def wait_job(daemon, job_id: int, timeout: float = 60.0) -> dict:  # type: ignore[no-untyped-def,type-arg]
    deadline = time.monotonic() + timeout
    while True:
        job = json.loads(daemon.obj.GetJob(job_id))
        if job["state"] != "running" or time.monotonic() > deadline:
            return job  # type: ignore[no-any-return]
        time.sleep(0.1)


def test_a_second_control_call_while_one_runs_is_refused_as_busy(daemon):
    first = json.loads(daemon.obj.RestartProcess("decode"))
    assert first["verb"] == "restart decode" and first["state"] == "running"
    with pytest.raises(Exception, match=f"org.supervisordgpu.Error.Busy.*busy with job {first['id']}"):
        daemon.obj.RestartProcess("prefill")
    assert wait_job(daemon, first["id"]) == {**first, "state": "done", "reason": "decode restarted", "exit_code": 0,
                                             "ended_at": json.loads(daemon.obj.GetJob(first["id"]))["ended_at"]}
    assert json.loads(daemon.obj.GetStatus())["state"] == "ready"
    second = json.loads(daemon.obj.RestartProcess("prefill"))  # free again once it is done
    assert second["id"] > first["id"] and wait_job(daemon, second["id"])["state"] == "done"
    with pytest.raises(Exception, match="org.supervisordgpu.Error.UnknownJob"):
        daemon.obj.GetJob(999_999)


def gio_connect(address: str):  # type: ignore[no-untyped-def]
    from gi.repository import Gio

    flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
    return Gio.DBusConnection.new_for_address_sync(address, flags, None, None)


def test_the_daemons_refusals_reach_the_client_as_their_classes_and_exit_codes(daemon):
    """Errors by name, end to end: the controller's Busy and the service's UnknownProcess leave
    the daemon as org.supervisordgpu.Error.<Name> and arrive in gpusupctl's client as the very
    classes of errors.py, with exit codes 3 and 2; the text decides nothing."""
    from supervisord_gpu.api.client import InstanceClient
    from supervisord_gpu.errors import Busy, UnknownJob, UnknownProcess

    client = InstanceClient(gio_connect(daemon.bus_address), "pd")
    with pytest.raises(UnknownProcess) as unknown:
        client.restart_process("nope")
    assert unknown.value.exit_code == 2 and str(unknown.value) == "instance pd has no process 'nope'"
    first = client.restart_process("decode")
    with pytest.raises(Busy) as busy:
        client.restart_process("prefill")
    assert busy.value.exit_code == 3 and str(busy.value).startswith(f"pd is busy with job {first['id']}")
    assert client.follow_job(first, 60, lambda _line: None)["state"] == "done"
    with pytest.raises(UnknownJob):
        client.job(999_999)


def test_gpusupctl_restart_process_follows_the_daemons_job_end_to_end(daemon, bus):
    ctl = [sys.executable, "-m", "supervisord_gpu.cli.gpusupctl", "restart", "pd"]
    unknown = subprocess.run([*ctl, "--process", "nope"], env=bus.env(), capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and unknown.stderr == "gpusupctl: instance pd has no process 'nope'\n", unknown
    pid = json.loads(daemon.obj.GetProcess("decode"))["pid"]
    done = subprocess.run([*ctl, "--process", "decode", "--wait", "--timeout", "60"], env=bus.env(),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("pd: decode restarted") and "decode: " in done.stdout, done.stdout
    after = json.loads(daemon.obj.GetProcess("decode"))
    assert after["state"] == "ready" and after["pid"] != pid


def test_a_dbus_restart_takes_the_whole_start_path_lock_and_checks_included(daemon, tmp_path):
    """Restart is stop + the daemon's own start: it waits for the transition lock, then the
    preflight refuses a stranger on the router's port, naming it; the daemon exits 3 (final)."""
    import fcntl
    import socket

    router = json.loads(daemon.obj.GetProcess("router"))
    fd = os.open(tmp_path / "run" / "transition.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, b"tester (pid 1)", 0)
    stranger = socket.socket()
    try:
        job = json.loads(daemon.obj.Restart())
        assert job["verb"] == "restart" and job["state"] == "running"
        deadline = time.monotonic() + 30
        while "waiting for the transition of tester (pid 1)" not in daemon.obj.StatusText:
            assert time.monotonic() < deadline, daemon.obj.StatusText
            time.sleep(0.05)
        assert {p["state"] for p in json.loads(daemon.obj.GetStatus())["processes"]} == {"stopped"}  # stopped first
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind((router["host"], router["port"]))
        stranger.listen()
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert daemon.proc.wait(60) == 3
    finally:
        os.close(fd)
        stranger.close()
    daemon.log.seek(0)
    log = daemon.log.read()
    assert f"refusing to start: port {router['host']}:{router['port']} (router) held by pid {os.getpid()}" in log, log[-2000:]
    assert f"job {job['id']} (restart): refused" in log


def test_what_a_caller_sent_is_echoed_back_bounded(daemon):
    with pytest.raises(Exception) as info:
        daemon.obj.GetProcess("x" * 100_000)
    assert "UnknownProcess" in str(info.value) and len(str(info.value)) < 400


def test_only_root_and_the_control_group_read_a_childs_own_error_lines(daemon, bus):
    # The router prints an error line of its own: written into its very stderr, the pipe the daemon
    # reads (its 503 /readiness lines are request echoes now, never a last error: they hold the
    # client's words).
    pid = json.loads(daemon.obj.GetProcess("router"))["pid"]
    with open(f"/proc/{pid}/fd/2", "w") as stderr:
        stderr.write("2026-12-06T10:00:00Z ERROR sgl_model_gateway: worker secret-4711 refused the connection\n")
    deadline = time.monotonic() + 10
    while not json.loads(daemon.obj.GetProcess("router")).get("last_error") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "secret-4711" in json.loads(daemon.obj.GetProcess("router"))["last_error"], "nothing to hide: the test would prove nothing"
    public = json.loads(as_nobody(bus.address, "GetStatus").stdout)
    assert all("last_error" not in p for p in public["processes"]), public
    assert "last_error" not in json.loads(as_nobody(bus.address, "GetProcess", "router").stdout)


def test_a_bus_without_our_policy_refuses_the_name_in_plain_words(monkeypatch):
    """#26: a rehearsal from a checkout (no .deb, so no policy) printed GLib's raw text:
    "g-dbus-error-quark: GDBus.Error:org.freedesktop.DBus.Error.AccessDenied: ... (9)"."""
    from supervisord_gpu.api.service import own_name
    from supervisord_gpu.bus.link import open_connection
    from supervisord_gpu.errors import BusError

    bare = PrivateBus(policy=None)
    ours = PrivateBus()
    try:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bare.address)
        with pytest.raises(BusError) as said:
            own_name(open_connection(), names.bus_name("pd-1p1d"))
        text = str(said.value)
        assert text == ("the system bus's policy does not let this daemon own org.supervisordgpu.instance.pd_2d1p1d "
                        "(the package installs that policy: /usr/share/dbus-1/system.d/org.supervisordgpu.conf)"), text
        if os.geteuid() == 0:  # with our policy root owns it (the policy gives the names to root alone)
            monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", ours.address)
            own_name(open_connection(), names.bus_name("pd-1p1d"))
    finally:
        bare.close()
        ours.close()
