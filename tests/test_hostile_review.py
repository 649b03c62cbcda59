"""Three findings of a hostile review, each reproduced by its attack (the attacker runs as nobody).

1. A failed RestartProcess put the child's last lines (SGLang logs api_key) into a StateChanged
   signal and into the public GetStatus: every local user could read the key.
2. 1 MiB string arguments: every method that takes a string refuses oversize input at once.
3. A stranger on [::]:PORT (IPV6_V6ONLY=1, or dual stack), or on the other family's loopback:
   the port is held for a server of ours on 0.0.0.0 / 127.0.0.1, in `check` and in the
   daemon's preflight (exit 3 before anything loads); a port taken during the load is exit 3 too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from private_bus import PrivateBus
from support import free_ports, pd_profile, write_config
from supervisord_gpu.bus import names

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
NOBODY = 65534
SECRET = "sk-secret"


def as_nobody(code: str, *args: str, **kw) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.update(kw.pop("env", {}))
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                             sys.executable, "-c", code, *args], cwd="/", env=env, text=True, **kw)


def ipv6_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this machine")

# ----------------------------------------------------------------------------------- helpers

STRANGER = """\
import socket, sys, time
host, port, v6only, retry = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "retry"
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
while True:
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if fam == socket.AF_INET6 and v6only != "-":
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    try:
        s.bind((host, port))
        break
    except OSError:
        s.close()
        if not retry:
            raise
        time.sleep(0.002)
s.listen()
print("up", flush=True)
time.sleep(600)
"""


class Stranger:
    """A listener of nobody's on host:port (v6only "0"/"1" for AF_INET6, "-" to leave the default)."""

    def __init__(self, host: str, port: int, v6only: str = "-", retry: bool = False) -> None:
        self.proc = as_nobody(STRANGER, host, str(port), v6only, "retry" if retry else "once", stdout=subprocess.PIPE)

    def wait_up(self, timeout: float = 30) -> None:
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip() == "up":
                return
            assert self.proc.poll() is None, "the stranger could not bind"
            time.sleep(0.01)
        raise AssertionError("the stranger never bound its port")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def strangers():  # type: ignore[no-untyped-def]
    made: list[Stranger] = []

    def make(host: str, port: int, v6only: str = "-", retry: bool = False, wait: bool = True) -> Stranger:
        s = Stranger(host, port, v6only, retry)
        made.append(s)
        if wait:
            s.wait_up()
        return s

    yield make
    for s in made:
        s.close()


class Daemon:
    """`supervisord-gpu run NAME` as a subprocess (on the private bus when one is given)."""

    def __init__(self, name: str, cdir: Path, tmp: Path, bus: PrivateBus | None, rehearsal: bool) -> None:
        self.name = name
        self.log_path = tmp / f"daemon-{name}.log"
        self.log = open(self.log_path, "w+")
        env = bus.env() if bus else {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={tmp}/no-bus"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", name, "--config-dir", str(cdir), "--stderr"]
            + (["--rehearsal"] if rehearsal else []), env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, needle: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text()[-3000:]
            time.sleep(0.005)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def gio_connect(address: str):  # type: ignore[no-untyped-def]
    from gi.repository import Gio

    flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
    return Gio.DBusConnection.new_for_address_sync(address, flags, None, None)


def call(conn, instance: str, method: str, args=None, timeout_ms: int = 10000):  # type: ignore[no-untyped-def]
    from gi.repository import GLib

    reply = conn.call_sync(names.bus_name(instance), names.OBJECT_PATH, names.INTERFACE, method, args,
                           GLib.VariantType("(s)"), 0, timeout_ms, None)
    return reply.unpack()[0]


def wait_ready(conn, daemon: Daemon, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        try:
            if json.loads(call(conn, daemon.name, "GetStatus"))["state"] == "ready":
                return
        except Exception:
            pass
        assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.text()[-3000:]
        time.sleep(0.05)


@pytest.fixture
def bus():  # type: ignore[no-untyped-def]
    b = PrivateBus()
    yield b
    b.close()


def leaky_config(tmp: Path, cgroup_root: Path, fail_file: Path) -> Path:
    """Two servers of tests/leaky_child.py (it logs api_key like SGLang) on simulated GPUs: `server`
    fails its next start once fail_file exists; `other` takes 1.5 s to stop (the window in which
    the daemon, giving up, still answers on the bus)."""
    cdir = tmp / "etc"
    (cdir / "profiles").mkdir(parents=True)
    p1, p2 = free_ports(2)
    (cdir / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        ownership = "cgroupfs"
        cgroup_root = "{cgroup_root}"
        runtime_dir = "{tmp / 'run'}"
        cache_dir = "{tmp / 'cache'}"
        default_user = "root"
        [sglang]
        server_command = ["{sys.executable}", "{HERE / 'leaky_child.py'}"]
        [gpus]
        backend = "simulated"
        wait_idle_timeout = 5
        [rehearsal]
        simgpu_dir = "{tmp / 'simgpu'}"
        """))
    (cdir / "profiles" / "leaky.toml").write_text(textwrap.dedent(f"""
        [servers.server]
        gpus = [0]
        port = {p1}
        model_path = "/tmp"
        stop_timeout = 5
        [servers.server.env]
        LEAKY_SECRET = "{SECRET}"
        LEAKY_FAIL_FILE = "{fail_file}"
        [servers.other]
        gpus = [1]
        port = {p2}
        model_path = "/tmp"
        stop_timeout = 5
        [servers.other.env]
        LEAKY_SECRET = "{SECRET}"
        LEAKY_STOP_S = "1.5"
        """))
    return cdir


# ------------------------------------------------------------------ 1. the secret of a failed restart

WATCHER = """\
import json, sys, time
from gi.repository import Gio, GLib
addr, bus_name, path, iface = sys.argv[1:5]
flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
con = Gio.DBusConnection.new_for_address_sync(addr, flags, None, None)
seen = {"signals": [], "replies": [], "errors": 0}
def fired(_c, sender, _p, _i, member, params, *_):
    seen["signals"].append([member] + list(params.unpack()))
con.signal_subscribe(None, iface, None, path, None, Gio.DBusSignalFlags.NONE, fired)
def poll():
    for method, args in (("GetStatus", None), ("GetProcess", GLib.Variant("(s)", ("server",))),
                         ("GetHistory", GLib.Variant("(s)", ("server",))), ("GetJob", GLib.Variant("(u)", (1,)))):
        try:
            r = con.call_sync(bus_name, path, iface, method, args, GLib.VariantType("(s)"), 0, 2000, None)
            seen["replies"].append([method, r.unpack()[0]])
        except GLib.Error as e:
            seen["replies"].append([method, "ERROR " + e.message])
    for prop in ("StatusText", "State"):
        try:
            r = con.call_sync(bus_name, path, "org.freedesktop.DBus.Properties", "Get", GLib.Variant("(ss)", (iface, prop)),
                              GLib.VariantType("(v)"), 0, 2000, None)
            seen["replies"].append([prop, r.unpack()[0]])
        except GLib.Error as e:
            seen["replies"].append([prop, "ERROR " + e.message])
    return True
GLib.timeout_add(20, poll)
loop = GLib.MainLoop()
GLib.timeout_add(60000, loop.quit)
def done(*_):
    loop.quit()
import signal
GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGTERM, done)
con.flush_sync(None)
print("subscribed", flush=True)
loop.run()
print(json.dumps(seen), flush=True)
"""


def test_a_failed_restart_never_hands_the_childs_secret_to_every_local_user(tmp_path, cgroups, bus):
    fail = tmp_path / "fail-next-start"
    daemon = Daemon("leaky", leaky_config(tmp_path, cgroups.root, fail), tmp_path, bus, rehearsal=False)
    watcher = None
    try:
        root = gio_connect(bus.address)
        wait_ready(root, daemon)
        watcher = as_nobody(WATCHER, bus.address, names.bus_name("leaky"), names.OBJECT_PATH, names.INTERFACE,
                            stdout=subprocess.PIPE)
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "subscribed"
        fail.write_text("")
        from gi.repository import GLib

        job = json.loads(call(root, "leaky", "RestartProcess", GLib.Variant("(s)", ("server",))))
        assert job["id"] == 1  # what the watcher polls
        assert daemon.proc.wait(60) == 6  # a restart asked for that failed: the instance gave up
        time.sleep(0.3)
        watcher.send_signal(signal.SIGTERM)
        seen = json.loads(watcher.communicate(timeout=20)[0])
    finally:
        daemon.close()
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    log = daemon.text()
    assert SECRET in log, "the child never printed its secret: the test would prove nothing"
    assert "giving up" in log, log[-3000:]
    states = [s for s in seen["signals"] if s[0] == "StateChanged"]
    assert any(s[3] in ("stopping", "failed") for s in states), seen["signals"]  # the watcher heard the failure
    assert any(r[0] == "GetStatus" and ('"failed"' in r[1] or '"stopping"' in r[1]) for r in seen["replies"]), \
        "the watcher never read the instance while it gave up"
    leaked = [s for s in seen["signals"] if SECRET in json.dumps(s)]
    assert not leaked, leaked
    leaked = [r for r in seen["replies"] if SECRET in json.dumps(r)]
    assert not leaked, leaked[:3]


def test_signals_and_unprivileged_replies_carry_the_first_line_privileged_ones_the_rest():
    """The bus object fed what the engine says when a restart fails (api/service.py only)."""
    from supervisord_gpu.api.service import InstanceObject, public_snapshot, public_text

    why = (f"server: exited during start-up (exit code 1)\n  last error: api_key='{SECRET}' rejected\n"
           f"  last lines:\n    server_args=ServerArgs(api_key='{SECRET}')")
    snapshot = {"instance": "leaky", "state": "failed", "reason": why, "transition": "",
                "processes": [{"name": "server", "last_error": f"api_key='{SECRET}'", "last_exit": "exit code 1",
                               "history": [{"at": 1.0, "state": "failed", "detail": why}]}]}
    assert public_text(why) == "server: exited during start-up (exit code 1)"
    assert SECRET not in json.dumps(public_snapshot(snapshot))

    class Ctx:
        def __init__(self, sender: str) -> None:
            self.sender = sender

    uids = {":1.1": 0, ":1.2": NOBODY}
    obj = InstanceObject("leaky", None, None, "gpusup-nonexistent-group", uids.__getitem__)  # type: ignore[arg-type]
    obj.snapshot, obj.public_snapshot = json.dumps(snapshot), json.dumps(public_snapshot(snapshot))
    assert SECRET in obj.GetStatus(dbus_context=Ctx(":1.1"))  # root reads everything (pydbus passes the context by keyword)
    for reply in (obj.GetStatus(dbus_context=Ctx(":1.2")), obj.GetProcess("server", dbus_context=Ctx(":1.2")),
                  obj.GetHistory("server", dbus_context=Ctx(":1.2"))):
        assert SECRET not in reply and "exited during start-up" in reply


# --------------------------------------------------------------------------- 2. oversize arguments

FLOOD = """\
import json, statistics, sys, time
from gi.repository import Gio, GLib
addr, bus_name, path, iface = sys.argv[1:5]
flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
def connect():
    return Gio.DBusConnection.new_for_address_sync(addr, flags, None, None)
attacker, victim = connect(), connect()
def status():
    began = time.perf_counter()
    victim.call_sync(bus_name, path, iface, "GetStatus", None, GLib.VariantType("(s)"), 0, 30000, None)
    return time.perf_counter() - began
status()
idle = statistics.median(status() for _ in range(21))
big = "x" * (1 << 20)
errors = []
def flood_once():  # 20 calls of 1 MiB in flight at once, then the victim's call behind them
    loop = GLib.MainLoop()
    want = len(errors) + 20
    def answered(con, result, _data):
        try:
            con.call_finish(result)
            errors.append("no error")
        except GLib.Error as e:
            errors.append(e.message)
        if len(errors) == want:
            loop.quit()
    began = time.perf_counter()
    for i in range(20):
        attacker.call(bus_name, path, iface, ("GetProcess", "GetHistory")[i % 2], GLib.Variant("(s)", (big,)),
                      None, 0, 30000, None, answered, None)
    attacker.flush_sync(None)
    during = status()
    GLib.timeout_add(60000, loop.quit)
    loop.run()
    return during, time.perf_counter() - began
# three floods: one victim call behind each is one sample, and a 2-core machine running other tests
# can stall any one sample (12x idle seen once); the daemon's own work for the big calls is in all three
rounds = [flood_once() for _ in range(3)]
during, flood = min(d for d, _ in rounds), max(f for _, f in rounds)
after = statistics.median(status() for _ in range(21))
print(json.dumps({"idle": idle, "during": during, "after": after, "flood_s": flood, "errors": errors}))
"""


def test_oversize_string_arguments_are_refused_at_once_and_slow_nobody_down(tmp_path, cgroups, bus):
    fail = tmp_path / "never"
    daemon = Daemon("leaky", leaky_config(tmp_path, cgroups.root, fail), tmp_path, bus, rehearsal=False)
    try:
        root = gio_connect(bus.address)
        wait_ready(root, daemon)
        flood = as_nobody(FLOOD, bus.address, names.bus_name("leaky"), names.OBJECT_PATH, names.INTERFACE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = flood.communicate(timeout=120)
        assert flood.returncode == 0, stderr
        result = json.loads(stdout)
        # root's control method too (the policy keeps nobody out of it)
        from gi.repository import GLib

        with pytest.raises(GLib.Error) as info:
            call(root, "leaky", "RestartProcess", GLib.Variant("(s)", ("x" * (1 << 20),)))
        assert daemon.proc.poll() is None
    finally:
        daemon.close()
    for message in result["errors"]:
        # a process name: the error its callers already handle, saying the limit, not echoing the name
        assert "Error.UnknownProcess" in message and "limit is 256 bytes" in message and len(message) < 400, message
    assert "Error.UnknownProcess" in info.value.message and "limit is 256 bytes" in info.value.message
    assert len(info.value.message) < 400
    # behind 20 MiB in flight: the bus daemon itself still carries them (1-3 ms here, no code of ours
    # can avoid it); before the fix the daemon's own work for each made it 25-40 times an idle call,
    # in every flood (`during` is the least of three: one sample was once 12x under a loaded CI)
    # `after` (every big call answered) is held to the same bound: it and `idle` are medians taken
    # seconds apart while other tests load the machine, and 5x was seen in a clean-clone CI run with
    # nothing of ours busy (0.73 ms, then 3.6 ms); 3x failed it, not the daemon
    timings = {k: v for k, v in result.items() if k != "errors"}
    assert result["during"] < 10 * result["idle"], timings
    assert result["after"] < 10 * result["idle"], timings
    assert "Exception while handling" not in daemon.text()  # answers, not tracebacks in the journal


def test_every_string_argument_of_every_method_is_bounded():
    """No exported method takes a string that reaches its body unchecked (exports.py does it)."""
    from supervisord_gpu.api.exports import MAX_STRING_BYTES, exported_methods
    from supervisord_gpu.api.service import InstanceObject

    obj = InstanceObject("x", None, None, "gpusup-nonexistent-group", lambda _s: 0)  # type: ignore[arg-type]
    with_strings = [n for n, (insig, _o, _c) in exported_methods(InstanceObject).items() if "s" in insig]
    assert set(with_strings) >= {"GetProcess", "GetHistory", "RestartProcess"}
    for name in with_strings:
        with pytest.raises(Exception, match=f"limit is {MAX_STRING_BYTES} bytes") as info:
            getattr(obj, name)("é" * (MAX_STRING_BYTES // 2 + 1))  # few characters, too many bytes
        assert type(info.value).__name__.startswith("org.supervisordgpu.Error.")
        with pytest.raises(Exception, match=f"limit is {MAX_STRING_BYTES} bytes") as info:
            getattr(obj, name)("y" * (1 << 20))
        assert "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy" not in str(info.value)


# ------------------------------------------------------------------------ 3. IPv6 strangers, races


@needs_ipv6
@pytest.mark.parametrize("v6only", ["1", "0"])
@pytest.mark.parametrize("ours", ["0.0.0.0", "127.0.0.1"])
def test_a_stranger_on_the_ipv6_wildcard_holds_the_port_for_an_ipv4_server(strangers, v6only, ours) -> None:
    from supervisord_gpu.checks.ports import bind_test, check_port

    port = free_ports(1)[0]
    stranger = strangers("::", port, v6only)
    status = check_port(ours, port, "router")
    assert not status.free, status
    assert [h.pid for h in status.holders] == [stranger.proc.pid] or status.holder_uids == (NOBODY,), status
    assert "router" in (status.problem() or "")
    assert bind_test(ours, port) == (False, None)  # the cheap poll of wait_until_clear agrees


@needs_ipv6
def test_loopback_of_either_family_holds_the_other(strangers) -> None:
    from supervisord_gpu.checks.ports import check_port

    a, b, c = free_ports(3)
    strangers("::1", a)
    assert not check_port("127.0.0.1", a).free  # `localhost` clients may reach [::1] first
    assert not check_port("0.0.0.0", a).free
    strangers("127.0.0.1", b)
    assert not check_port("::1", b).free
    strangers("::1", c)
    # any loopback address counts, as readiness (listener_ownership) counts it after the load
    assert not check_port("127.0.0.2", c).free


def router_ports_profile(ports: list[int], router_host: str) -> str:
    return pd_profile(ports, router_extra=f'host = "{router_host}"')


@needs_ipv6
@pytest.mark.parametrize("which, v6only", [("router", "1"), ("router", "0"), ("metrics", "1")])
def test_the_preflight_refuses_a_stranger_on_any_port_in_either_family_before_anything_loads(
        tmp_path, cgroups, strangers, which, v6only) -> None:  # type: ignore[no-untyped-def]
    ports = free_ports(5)
    port = ports[2] if which == "router" else ports[4]
    strangers("::", port, v6only)
    cdir = write_config(tmp_path, {"pd": router_ports_profile(ports, "0.0.0.0")}, cgroups.root, startup=0.5)
    daemon = Daemon("pd", cdir, tmp_path, None, rehearsal=True)
    try:
        code = daemon.proc.wait(60)
    finally:
        daemon.close()
    log = daemon.text()
    assert code == 3, log[-3000:]
    assert "refusing to start" in log and f"{port}" in log, log[-3000:]
    assert "started pid" not in log, log[-3000:]  # nothing was loaded


@pytest.mark.parametrize("stranger_host, v6only", [("127.0.0.1", "-"), ("::", "1")])
def test_a_port_taken_while_the_servers_load_is_a_precondition_failure_not_a_retry(
        tmp_path, cgroups, strangers, stranger_host, v6only) -> None:  # type: ignore[no-untyped-def]
    if ":" in stranger_host and not ipv6_available():
        pytest.skip("no IPv6 on this machine")
    ports = free_ports(5)
    router_port = ports[2]
    cdir = write_config(tmp_path, {"pd": router_ports_profile(ports, "127.0.0.1")}, cgroups.root, startup=2.0)
    daemon = Daemon("pd", cdir, tmp_path, None, rehearsal=True)
    try:
        daemon.wait_log("decode: started pid")  # the preflight is over: the servers load
        strangers(stranger_host, router_port, v6only, retry=True)
        code = daemon.proc.wait(60)
    finally:
        daemon.close()
    log = daemon.text()
    assert "router: started pid" in log, log[-3000:]  # the stranger came after the preflight
    assert code == 3, log[-3000:]
    assert f"{router_port}" in log and "held by" in log, log[-3000:]


def test_a_string_argument_of_any_future_method_is_bounded_by_the_decorator_alone():
    from supervisord_gpu.api.exports import ArgumentTooLong, export

    class Obj:
        ran = 0

        @export("su", "s")
        def Echo(self, text: str, n: int, dbus_context=None) -> str:  # type: ignore[no-untyped-def]
            Obj.ran += 1
            return text

    assert Obj().Echo("short", 1) == "short"
    with pytest.raises(ArgumentTooLong, match="Echo: argument 'text' is 1048576 characters long; the limit is 256 bytes"):
        Obj().Echo("z" * (1 << 20), 1)
    assert Obj.ran == 1  # refused before the method ran


def test_the_status_before_the_first_publish_has_every_key_a_later_one_has():
    """A reader that calls GetStatus between the daemon's name appearing on the bus and its first
    snapshot got a stub without `transition` (CI, test_load's 200 clients: KeyError)."""
    from supervisord_gpu.api.service import InstanceObject
    from supervisord_gpu.engine.instance import InstanceStatus

    obj = InstanceObject("x", None, None, "gpusup-nonexistent-group", lambda _s: 0)  # type: ignore[arg-type]
    first = json.loads(obj.GetStatus())
    later = InstanceStatus("x", "ready", "", 0.0, None, None, "cgroupfs").to_json()
    assert set(first) == set(later), set(later) ^ set(first)
    assert first["state"] == "starting" and first["transition"] == ""
