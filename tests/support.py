"""Shared test machinery: throw-away cgroup roots, free ports, config dirs, decoys.

Everything a test starts is owned by a cgroup under a root made for that test, so cleanup
can never miss a re-parented process and never touches anything else on the machine.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.sglang import routers
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.daemon import RunOptions, build_instance
from supervisord_gpu.engine.events import Event
from supervisord_gpu.ownership.cgroupfs import cgroup2_mount, remove_tree, writable


def wait_for(pred, timeout: float = 10.0, what: str = "condition", interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll `pred` until it returns something true, and return that; fail naming `what` at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_ports(n: int) -> list[int]:
    """n free ports whose +50 are free too and none another's: a server of a profile with
    several gets --nccl-port = its port + 50 (config/loader.py), and a random router port equal
    to a server's +50 made the profile invalid (one run in thousands failed on it)."""
    from supervisord_gpu.config.loader import NCCL_PORT_OFFSET

    socks, ports, taken = [], [], set(_RECENT)
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        port = s.getsockname()[1]
        twin = port + NCCL_PORT_OFFSET
        if twin > 65535 or {port, twin} & taken or not _this_workers(port):
            continue
        try:
            t = socket.socket()
            t.bind(("127.0.0.1", twin))
        except OSError:
            t.close()
            continue
        socks.append(t)
        ports.append(port)
        taken |= {port, twin}
    for s in socks:
        s.close()
    _RECENT.extend(taken - set(_RECENT))  # each port and its +50
    return ports


#: the ports this process handed out last, never handed out again soon: a test that draws twice
#: (a fixture's server, then a profile's ports) got the fixture's port again before the fixture's
#: server had bound it (one clean-clone run: "port 127.0.0.1:46337 is held by ... /evil"). A
#: worker draws from ~3,500 ports of its own; 256 kept aside leave plenty.
_RECENT: collections.deque[int] = collections.deque(maxlen=256)


def _this_workers(port: int) -> bool:
    """Under pytest-xdist, each worker hands out ports from blocks of 100 of its own: port P in
    the lower half of a block whose number is the worker's modulo the worker count, so its
    +50 lies in the same block. Two workers then never pick the same port between choosing
    it and binding it (free_ports closes its probe sockets before the test binds)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or int(count) < 2:
        return True
    from supervisord_gpu.config.loader import NCCL_PORT_OFFSET

    block, offset = divmod(port, 2 * NCCL_PORT_OFFSET)
    return offset < NCCL_PORT_OFFSET and block % int(count) == int(worker[2:])


class CgroupSandbox:
    """A cgroup subtree of our own under the cgroup2 mount, killed and removed at the end."""

    def __init__(self) -> None:
        mount = cgroup2_mount()
        if mount is None:
            raise RuntimeError("no cgroup2 mount")
        self.top = mount / f"supervisord-gpu-test-{uuid.uuid4().hex[:8]}"
        self.root = self.top / "supervisord-gpu"
        if not writable(self.root):
            raise RuntimeError(f"cannot create cgroups under {self.root}")

    def all_pids(self) -> list[int]:
        pids: list[int] = []
        for dirpath, _dirs, files in os.walk(self.top):
            if "cgroup.procs" in files:
                with open(os.path.join(dirpath, "cgroup.procs")) as f:
                    pids += [int(x) for x in f.read().split()]
        return pids

    def destroy(self) -> None:
        for dirpath, _dirs, files in os.walk(self.top):
            if "cgroup.kill" in files:
                try:
                    Path(dirpath, "cgroup.kill").write_text("1")
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        while self.all_pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        remove_tree(self.top)


def write_config(
    tmp: Path,
    profiles: dict[str, str],
    cgroup_root: Path,
    startup: float = 0.5,
    extra: str = "",
    router: str = "auto",
    gpu_count: int = 8,
    daemon_extra: str = "",
    router_kind: str = "sglang-router",
) -> Path:
    cdir = tmp / "etc"
    (cdir / "profiles").mkdir(parents=True, exist_ok=True)
    (cdir / "supervisord-gpu.toml").write_text(
        textwrap.dedent(
            f"""
            [daemon]
            ownership = "cgroupfs"
            cgroup_root = "{cgroup_root}"
            runtime_dir = "{tmp / 'run'}"
            cache_dir = "{tmp / 'cache'}"
            default_user = "root"
            {daemon_extra}
            [sglang]
            router_command = ["python3", "-m", "{routers.BY_NAME[router_kind].module}"]
            [gpus]
            backend = "simulated"
            wait_idle_timeout = 5
            [rehearsal]
            enabled = true
            gpu_count = {gpu_count}
            server_startup = {startup}
            server_mib_per_gpu = 1000
            router = "{router}"
            simgpu_dir = "{tmp / 'simgpu'}"
            """
        )
        + extra
    )
    for name, text in profiles.items():
        (cdir / "profiles" / f"{name}.toml").write_text(textwrap.dedent(text))
    return cdir


def flood_config(tmp: Path, cgroup_root: Path, port: int, seconds: float, rate: int) -> Path:
    """A real (not rehearsal) config whose SGLang command is tests/flood_child.py (`rate` numbered
    lines a second for `seconds`), on simulated GPUs: the log-forwarding test and benchmark."""
    cdir = tmp / "etc"
    (cdir / "profiles").mkdir(parents=True)
    (cdir / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        ownership = "cgroupfs"
        cgroup_root = "{cgroup_root}"
        runtime_dir = "{tmp / 'run'}"
        cache_dir = "{tmp / 'cache'}"
        default_user = "root"
        [sglang]
        server_command = ["{sys.executable}", "{Path(__file__).resolve().parent / 'flood_child.py'}"]
        [gpus]
        backend = "simulated"
        wait_idle_timeout = 5
        [rehearsal]
        simgpu_dir = "{tmp / 'simgpu'}"
        """))
    (cdir / "profiles" / "flood.toml").write_text(textwrap.dedent(f"""
        [servers.server]
        gpus = [0]
        port = {port}
        model_path = "/tmp"
        [servers.server.env]
        FLOOD_S = "{seconds}"
        FLOOD_RATE = "{rate}"
        """))
    return cdir


def pd_profile(ports: list[int], router_extra: str = "", prefill_extra: str = "", decode_extra: str = "") -> str:
    """A scaled-down pd-1p1d: TP1 prefill on GPU 0, TP1 decode on GPU 1, the router in PD mode."""
    p_port, d_port, r_port, boot, metrics = ports
    return f"""
        description = "test pd"
        [restart]
        max_restarts = 2
        backoff_initial = 0.2
        [servers.prefill]
        role = "prefill"
        gpus = [0]
        port = {p_port}
        model_path = "/models/test"
        stop_timeout = 8
        probe = {{ timeout = 3, liveness_timeout = 0.5, liveness_interval = 0.3, failures = 2 }}
        {prefill_extra}
        [servers.prefill.options]
        disaggregation-bootstrap-port = {boot}
        [servers.decode]
        role = "decode"
        gpus = [1]
        port = {d_port}
        model_path = "/models/test"
        stop_timeout = 8
        probe = {{ timeout = 3, liveness_timeout = 0.5, liveness_interval = 0.3, failures = 2 }}
        {decode_extra}
        [router]
        mode = "pd"
        port = {r_port}
        stop_timeout = 10
        probe = {{ timeout = 3, liveness_timeout = 0.5, liveness_interval = 0.3, failures = 2 }}
        {router_extra}
        [router.options]
        prometheus-host = "127.0.0.1"
        prometheus-port = {metrics}
        policy = "round_robin"
        """


class Recorder:
    """Collects engine events with their times, for assertions about order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def times(self, process: str, state: str) -> list[float]:
        return [e.at for e in self.events if e.kind == "process" and e.process == process and e.state == state]

    def first(self, process: str, state: str) -> float:
        found = self.times(process, state)
        assert found, f"no {state!r} event for {process}: {[(e.process, e.state) for e in self.events]}"
        return found[0]

    def order(self, state: str) -> list[str]:
        return [e.process for e in self.events if e.kind == "process" and e.state == state]  # type: ignore[misc]


def make_instance(cdir: Path, name: str, recorder: Recorder | None = None):  # type: ignore[no-untyped-def]
    cfg = load_daemon_config(cdir)
    profile = load_profile(cfg, name)
    instance, sink = build_instance(cfg, profile, RunOptions(rehearsal=True, force_stderr=True))
    if recorder is not None:
        instance.listeners.append(recorder)
    return instance, cfg


def sim_holders(tmp: Path) -> list[int]:
    return [h.pid for h in SimulatedGpus(tmp / "simgpu").holders()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP pid and return once it is stopped (/proc state T).

    kill() only queues the stop: the target stops when it is next scheduled, which on a
    loaded 2-core CI machine can be after the test's next request has been answered.
    """
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except FileNotFoundError:
            return False

    wait_for(stopped, timeout=timeout, what=f"pid {pid} stopped", interval=0.005)


def start_decoy(port: int = 30001) -> subprocess.Popen[bytes]:
    """A process outside the daemon whose command line looks exactly like what pkill -f would hit."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "-m", "sglang.launch_server", "--port", str(port)],
        start_new_session=True,
    )


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


# --------------------------------------------------------------------------- profile edits


def tune(text: str, section: str, **keys: object) -> str:
    """Set keys of one [section] of a profile (replacing those already there)."""
    lines = text.splitlines()
    out: list[str] = []
    inside = False
    pending = dict(keys)
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            if inside and pending:
                out += [f"{k} = {fmt(v)}" for k, v in pending.items()]
                pending = {}
            inside = stripped == f"[{section}]"
        elif inside and "=" in stripped and stripped.split("=")[0].strip() in pending:
            key = stripped.split("=")[0].strip()
            out.append(f"{key} = {fmt(pending.pop(key))}")
            continue
        out.append(line)
    if inside and pending:
        out += [f"{k} = {fmt(v)}" for k, v in pending.items()]
    assert not pending, f"no section [{section}]"
    return "\n".join(out) + "\n"


def fmt(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {fmt(v)}" for k, v in value.items()) + " }"
    return str(value)


def with_env(text: str, process: str, **env: str) -> str:
    body = "\n".join(f'{k} = "{v}"' for k, v in env.items())
    return text + f"\n[servers.{process}.env]\n{body}\n"


# --------------------------------------------------------------------------- matrix reports


MATRIX_ROW = "matrix-row"  # a user_properties key: one row of a fault matrix, shown at the end


def matrix_rows(request, results: list[tuple[str, str, str, float]], title: str, cases: int):  # type: ignore[no-untyped-def]
    """Around one test: the rows it appended to `results` go on its report, as ("matrix-row",
    (title, cases, row)). Reports travel from pytest-xdist's workers to the main process, so
    MatrixTables (conftest.py) prints the whole matrix at the end however the tests ran."""
    before = len(results)
    yield
    for row in results[before:]:
        request.node.user_properties.append((MATRIX_ROW, (title, cases, tuple(row))))


class MatrixTables:
    """Prints each fault matrix (case, final state, leftovers, time) in pytest's terminal summary."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, list[tuple[str, str, str, float]]]] = {}

    def pytest_runtest_logreport(self, report) -> None:  # type: ignore[no-untyped-def]
        if report.when != "teardown":  # every phase's report carries them; count one
            return
        for key, value in report.user_properties:
            if key == MATRIX_ROW:
                title, cases, row = value
                self.tables.setdefault(title, (cases, []))[1].append(tuple(row))

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        tr = terminalreporter
        for title, (cases, rows) in self.tables.items():
            tr.section(f"{title}: {len(rows)} of {cases} cases run")
            width = max(len(c) for c, *_ in rows)
            tr.write_line(f"{'case':<{width}}  {'final state':<60}  {'leftovers':<10}  time")
            for case, final, leftovers, took in rows:
                tr.write_line(f"{case:<{width}}  {final[:60]:<60}  {leftovers:<10}  {took:5.1f} s")
            tr.write_line(f"total {sum(r[3] for r in rows):.1f} s")


# --------------------------------------------------------------------------- traffic


class RequestLoop:
    """Clients sending POST /generate to `url` all along, in threads; what happened to each request.

    A request the server or router never accepted is not lost: a refused connection, or a 503
    ("not ready", "no available workers"), which a client knows at once and may retry. A
    request that was accepted and then failed (a reset, a 5xx other than 503, a timeout) is lost.
    """

    def __init__(self, url: str, clients: int = 2, tokens: int = 30) -> None:
        import threading

        self.url = url.rstrip("/") + "/generate"
        self.tokens = tokens
        self.ok = self.refused = self.unavailable = 0
        self.lost: list[str] = []
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def _count(self, what: str, detail: str = "") -> None:
        with self._lock:
            if what == "lost":
                self.lost.append(f"{time.time():.3f} {detail}")
            else:
                setattr(self, what, getattr(self, what) + 1)

    def run(self) -> None:
        import json
        import urllib.error
        import urllib.request

        body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": self.tokens}}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                    self._count("ok")
            except urllib.error.HTTPError as e:
                text = e.read(300).decode(errors="replace")
                if e.code == 503:
                    self._count("unavailable")
                    time.sleep(0.05)
                else:
                    self._count("lost", f"{e.code} {text}")
            except urllib.error.URLError as e:
                if isinstance(e.reason, ConnectionRefusedError):
                    self._count("refused")
                    time.sleep(0.05)
                else:
                    self._count("lost", repr(e))
            except (ConnectionResetError, TimeoutError, OSError) as e:
                self._count("lost", repr(e))

    def __enter__(self) -> RequestLoop:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def summary(self) -> str:
        return f"ok {self.ok}, refused {self.refused}, 503 {self.unavailable}, lost {len(self.lost)}: {self.lost[:5]}"


def nobody_user(why: str) -> pwd.struct_passwd:
    """The user `nobody` for a test run as root whose other party runs as nobody (through setpriv);
    skips naming `why` where that cannot be had. (pytest is imported here, not at the top: this
    module is also imported inside the test containers, which have no pytest.)"""
    import pytest

    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("needs the user `nobody`")

