"""The supervisor against the REAL SGLang 0.5.23 and the real sglang-router 0.3.2 (issue 27),
and the same scenarios against the stand-in, side by side.

On the device machine (one H200, no systemd, no D-Bus, no network), after prepare.sh built the
bundles into .sgl/ here (README, "The real SGLang in the loop"), two calls, each with carry [".sgl"]:

    python3 bench/device/real_sglang.py run --mode real --group 1 --code head --out $OUT
    python3 bench/device/real_sglang.py run --mode real --group 2 --also-crash --code head --out $OUT

Here, CPU only, the stand-in (the daemon in rehearsal mode: stand-in servers on simulated GPUs):

    .venv/bin/python bench/device/real_sglang.py run --mode standin --group all --also-crash --code head --out /tmp/rsg-standin

Each run unpacks .sgl/*.tar.xz and writes the tiny model (real mode), a daemon config (cgroupfs
ownership; NVML, or simulated GPUs for the stand-in) and three profiles (solo, routed, single),
then drives the daemon and `gpusupctl` through each scenario and prints PASS/FAIL per check and
per scenario. The daemon runs as the `daemon` subcommand of this file: `daemon.serve()`, the code
path of `supervisord-gpu run NAME --stderr`, with its events also written as time-stamped JSON
lines and a Unix socket standing in for the D-Bus methods the device machine cannot have
(GetStatus; RestartProcess = `controller.submit(... restart_process ...)`, what api/service.py
calls). `--code head` runs the supervisor of .sgl/code-HEAD.tar.xz (`git archive HEAD`), not the
working tree. Results: $OUT/real-sglang-<mode>-g<group>.json, $OUT/logs-<mode>-g<group>.tar.gz.

Group 1 (profile solo): s1_start, s2_holders, s3_pause (120 s), s3_latch (a /health during a
pause), s3_sigstop, s5_crash (kill -9 of sglang::scheduler, then SIGTERM to the restart while it
loads), s2_idle. Group 2: s5_sigterm_loading (first start of routed; the daemon exits 1 and is
started again, as systemd would), s4_router_restart, s5_crash_routed (--also-crash), s6_switch
(routed -> single by the new daemon's takeover), s3_latch_stall (a /health failed during a 6 s
scheduler stall), s2_idle_g2. Each scenario checks the time left first (--budget); what does not
fit is "NOT RUN (budget)". The liveness probe is shortened in the profiles: liveness_interval 2,
liveness_timeout 2, failures 2 (killed within 8 s). REAL_SGLANG_PORTS=SERVER,ROUTER,METRICS
moves the ports (default 30300,30001,30091).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()
SGL = REPO / ".sgl"

# REAL_SGLANG_PORTS=SERVER,ROUTER,METRICS moves them (a shared development machine whose tests use 30001)
SERVER_PORT, ROUTER_PORT, ROUTER_METRICS_PORT = (int(x) for x in os.environ.get("REAL_SGLANG_PORTS", "30300,30001,30091").split(","))
SINGLE_PORT = ROUTER_PORT  # the single server takes the port the router had: clients never change
LIVENESS = {"liveness_interval": 2, "liveness_timeout": 2, "failures": 2}
LIVENESS_BOUND_S = LIVENESS["failures"] * (LIVENESS["liveness_interval"] + LIVENESS["liveness_timeout"])
PAUSE_S = 120.0
HEALTH_CHECK_TIMEOUT = 4
SHM_RE = re.compile(r"^(sglang_loads_|sgl_shm_|nccl-|cuda\.shm)")
IDLE_TOLERANCE_MIB = 256


# ============================================================================ the daemon

def cmd_daemon(args: argparse.Namespace) -> int:
    """`supervisord-gpu run NAME --stderr`, plus a JSON-lines record of its events and a control socket."""
    from supervisord_gpu import daemon as D
    from supervisord_gpu.cli.common import guarded
    from supervisord_gpu.config.loader import effective_config, load_daemon_config, load_profile
    from supervisord_gpu.systemd.journal import StderrSink

    early: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: early.append(signum))
    out = open(args.events, "a", buffering=1)
    lock = threading.Lock()

    def rec(obj: dict[str, Any]) -> None:
        obj.setdefault("t", time.time())
        with lock:
            out.write(json.dumps(obj, default=str) + "\n")

    class Recording:
        """The daemon's stderr sink, each record also time-stamped into the events file."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.roles = inner.roles

        def child_line(self, instance: str, process: str, line: str, stream: str, priority: int, pid: int | None = None) -> None:
            rec({"k": "line", "p": process, "s": stream, "prio": priority, "line": line})
            self.inner.child_line(instance, process, line, stream, priority)

        def event(self, message: str, priority: int = 6, **fields: str) -> None:
            rec({"k": "say", "prio": priority, "msg": message, "f": fields})
            self.inner.event(message, priority, **fields)

    D.open_sink = lambda name, force_stderr=False: Recording(StderrSink(name, colour=False))  # type: ignore[assignment]
    captured: dict[str, Any] = {}
    base = D.InstanceController

    class Captured(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            captured["c"] = self

    D.InstanceController = Captured  # type: ignore[misc]

    def on_event(e: Any) -> None:
        rec({"k": "ev", "kind": e.kind, "p": e.process, "state": e.state, "msg": e.message, "t": e.at})

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = json.loads(await reader.readline())
            c = captured.get("c")
            op = req.get("op")
            if c is None:
                resp: dict[str, Any] = {"error": "no controller yet"}
            elif op == "status":  # what D-Bus GetStatus returns
                resp = c.instance.status().to_json()
            elif op == "restart_process":  # what D-Bus RestartProcess does
                name = req["name"]
                job = c.submit(f"restart {name}", lambda: c.restart_process(name))
                resp = {"job": job.id}
            elif op == "park":  # issue 39 (bench/device/real_park.py): what a D-Bus Park would do
                nxt = str(req["next"])
                resp = {"job": c.submit("park", lambda: c.park(nxt)).id}
            elif op == "restore":
                resp = {"job": c.submit("restore", c.restore).id}
            elif op == "job":
                j = c.jobs.get(int(req["id"]))
                resp = {"state": j.state, "reason": j.reason, "started_at": j.started_at, "ended_at": j.ended_at} if j else {"error": "no job"}
            else:
                resp = {"error": f"unknown op {op!r}"}
        except Exception as e:  # the control socket is the test's, never the daemon's problem
            resp = {"error": repr(e)}
        writer.write(json.dumps(resp, default=str).encode() + b"\n")
        await writer.drain()
        writer.close()

    def go() -> int:
        cfg = effective_config(load_daemon_config(args.config_dir), args.rehearsal)
        profile = load_profile(cfg, args.name)
        opts = D.RunOptions(rehearsal=args.rehearsal, force_stderr=True, listeners=[on_event], bus="off",
                            stopped_early=lambda: bool(early))

        async def main() -> int:
            try:
                os.unlink(args.control)
            except FileNotFoundError:
                pass
            server = await asyncio.start_unix_server(handle, path=args.control)
            try:
                return await D.serve(cfg, profile, opts)
            finally:
                server.close()

        return asyncio.run(main())

    code = guarded("supervisord-gpu", go)
    rec({"k": "exit", "code": code})
    return code


# ============================================================================ small tools

def call(method: str, port: int, path: str, body: Any = None, timeout: float = 30.0, host: str = "127.0.0.1",
         key: str | None = None) -> tuple[int | None, bytes, float]:
    """(status or None, body, seconds). `key`: sent as `Authorization: Bearer` (a server's admin key)."""
    began = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, payload, time.monotonic() - began
    except Exception as e:
        return None, repr(e).encode(), time.monotonic() - began
    finally:
        conn.close()


def admin_key() -> str | None:
    """The admin key the daemon made for the server on SERVER_PORT (every server gets one:
    sglang/admin_key.py), newest first: the pause and continue below are the operator's, who
    reads it as root from RUNTIME_DIR/INSTANCE/server.admin.key."""
    keys = sorted(Path("/tmp").glob("rsg-*/run/*/server.admin.key"), key=lambda p: p.stat().st_mtime, reverse=True)
    return keys[0].read_text().strip() if keys else None


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def is_scheduler(pid: int) -> bool:
    return cmdline(pid).startswith("sglang::scheduler") or comm(pid).startswith("sglang::schedul")


def group_pids(group: str) -> list[int]:
    try:
        return [int(x) for x in Path(group, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def our_processes(work: Path, cgroup_top: Path | None) -> list[dict[str, Any]]:
    """Processes this run started (never anyone else's on a shared machine): those whose
    environment names the run's directory (every child gets its TMPDIR there) or that sit in the
    run's cgroup tree. The daemons of this script are left out (they are waited for)."""
    me = os.getpid()
    marker = str(work).encode()
    top = f"/{cgroup_top.relative_to(_cgroup_mount())}" if cgroup_top is not None and _cgroup_mount() else None
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            env = b""
        try:
            cg = next((x[3:] for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if x.startswith("0::")), "")
        except OSError:
            cg = ""
        line = cmdline(pid)
        ours = marker in env or bool(top and (cg == top or cg.startswith(top + "/")))
        if ours and "real_sglang.py" not in line and alive(pid):
            found.append({"pid": pid, "cmdline": line[:160]})
    return found


def _cgroup_mount() -> Path | None:
    from supervisord_gpu.ownership.cgroupfs import cgroup2_mount

    return cgroup2_mount()


def shm_names() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if SHM_RE.match(n)}
    except OSError:
        return set()


def mapped_shm(pids: list[int]) -> set[str]:
    """The /dev/shm entries these processes map or hold open (/proc/PID/maps and fd): theirs, exactly."""
    found: set[str] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(None, 5)[5] if len(line.split(None, 5)) == 6 else ""
                if path.startswith("/dev/shm/"):
                    found.add(path[len("/dev/shm/"):].replace(" (deleted)", ""))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    found.add(target[len("/dev/shm/"):].replace(" (deleted)", ""))
        except OSError:
            pass
    return {n for n in found if SHM_RE.match(n)}


def listing(d: Path) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return []


class Check:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def __call__(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.items.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"      [{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        return bool(ok)

    @property
    def ok(self) -> bool:
        return all(i["ok"] for i in self.items)


class NotRun(Exception):
    pass


# ============================================================================ GPUs

class Gpu:
    """GPU 0's memory and holders, read independently of the product: NVML (real) or the simulated GPU file."""

    def __init__(self, mode: str, simgpu_dir: Path | None) -> None:
        self.mode = mode
        self.simgpu_dir = simgpu_dir
        self.trace: list[tuple[float, int, int]] = []  # (time, used MiB, holder count)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        if mode == "real":
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def read(self) -> tuple[int, list[int]]:
        if self.mode == "real":
            mem = self.nv.nvmlDeviceGetMemoryInfo(self.handle)
            procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
            return mem.used >> 20, [p.pid for p in procs]
        from supervisord_gpu.checks.simgpu import SimulatedGpus

        sim = SimulatedGpus(self.simgpu_dir)  # type: ignore[arg-type]
        used, pids = 0, []
        for h in sim.holders():  # the stand-ins' live holdings (the file the simulated inventory reads)
            if 0 in h.gpus:
                used += h.mib
                pids.append(h.pid)
        return used, pids

    def info(self) -> dict[str, Any]:
        if self.mode == "real":
            nv = self.nv
            mem = nv.nvmlDeviceGetMemoryInfo(self.handle)
            return {"name": nv.nvmlDeviceGetName(self.handle), "driver": nv.nvmlSystemGetDriverVersion(),
                    "count": nv.nvmlDeviceGetCount(), "total_mib": mem.total >> 20, "used_mib": mem.used >> 20}
        return {"name": "simulated", "count": 1}

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    used, pids = self.read()
                    with self._lock:
                        self.trace.append((time.time(), used, len(pids)))
                except Exception:
                    pass
                time.sleep(0.1)

        threading.Thread(target=loop, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def window(self, t0: float, t1: float) -> list[tuple[float, int, int]]:
        with self._lock:
            return [x for x in self.trace if t0 <= x[0] <= t1]

    def first_idle_after(self, t0: float, baseline: int) -> float | None:
        with self._lock:
            for t, used, n in self.trace:
                if t >= t0 and used - baseline <= IDLE_TOLERANCE_MIB and n == 0:
                    return t - t0
        return None


# ============================================================================ a daemon under test

class Daemon:
    def __init__(self, run: Run, profile: str, tag: str) -> None:
        self.run, self.profile, self.tag = run, profile, tag
        self.events_path = run.logs / f"{tag}.events.jsonl"
        self.log_path = run.logs / f"{tag}.log"
        self.control = str(run.work / f"{tag}.sock")
        self._events: list[dict[str, Any]] = []
        self._pos = 0
        self._partial = b""
        argv = [run.py, str(SCRIPT), "daemon", profile, "--config-dir", str(run.etc), "--events", str(self.events_path),
                "--control", self.control] + (["--rehearsal"] if run.rehearsal else [])
        self.started_at = time.time()
        self.proc = subprocess.Popen(argv, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, cwd=run.work,
                                     env=run.daemon_env())
        print(f"    daemon {tag}: pid {self.proc.pid} for profile {profile}", flush=True)

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return self._events
        self._pos += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            if raw.strip():
                try:
                    self._events.append(json.loads(raw))
                except ValueError:
                    pass
        return self._events

    def find(self, pred: Any, since: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("t", 0) >= since and pred(e)]

    def wait(self, pred: Any, timeout: float, what: str, since: float = 0.0, fail_on_exit: bool = True) -> dict[str, Any]:
        timeout = min(timeout, max(5.0, self.run.left() - 10))  # never past the run's budget: the results must come back
        deadline = time.time() + timeout
        while True:
            hits = self.find(pred, since)
            if hits:
                return hits[0]
            if fail_on_exit and self.proc.poll() is not None:
                self.events()
                raise AssertionError(f"daemon {self.tag} exited {self.proc.returncode} while waiting for {what}")
            if time.time() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.1)

    def says(self, event: str, since: float = 0.0, process: str | None = None) -> list[dict[str, Any]]:
        return self.find(lambda e: e["k"] == "say" and e["f"].get("GPUSUP_EVENT") == event
                         and (process is None or e["f"].get("GPUSUP_PROCESS") == process), since)

    def wait_say(self, event: str, timeout: float, since: float = 0.0, process: str | None = None) -> dict[str, Any]:
        return self.wait(lambda e: e["k"] == "say" and e["f"].get("GPUSUP_EVENT") == event
                         and (process is None or e["f"].get("GPUSUP_PROCESS") == process),
                         timeout, f"{event} ({process or 'any'})", since)

    def wait_instance(self, state: str, timeout: float, since: float = 0.0) -> dict[str, Any]:
        return self.wait(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == state,
                         timeout, f"instance {state}", since)

    def ctl(self, **req: Any) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(15)
                s.connect(self.control)
                s.sendall(json.dumps(req).encode() + b"\n")
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
            return json.loads(buf)
        except (OSError, ValueError) as e:
            return {"error": repr(e)}

    def process(self, name: str) -> dict[str, Any]:
        st = self.ctl(op="status")
        for p in st.get("processes", []):
            if p["name"] == name:
                return p
        return {}

    def stop(self, timeout: float = 120.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def is_phase_change(e: dict[str, Any], process: str) -> bool:
    return e["k"] == "ev" and e["kind"] == "phase" and e["p"] == process


# ============================================================================ the run

class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = args.mode
        self.t0 = time.time()
        self.budget = args.budget
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or f"/tmp/rsg-{self.mode}")
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True, mode=0o755)
        os.chmod(self.work, 0o755)
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.etc = self.work / "etc"
        self.sgl = Path(args.sgl)
        self.py = args.python or sys.executable
        self.results: dict[str, Any] = {"mode": self.mode, "group": args.group, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "scenarios": {}, "setup": {}}
        self.code = REPO
        self.cgroup_top: Path | None = None
        self.seen_shm: set[str] = set()
        #: the daemon in rehearsal mode (real_pd.py runs stand-ins without it, to pick its router)
        self.rehearsal = self.mode == "standin"

    def tag(self) -> str:
        """What the result and log files are named after (real_pd.py names its own)."""
        return f"{self.mode}-g{self.args.group}"

    # ---------------------------------------------------------------- set-up

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env["PYTHONPATH"] = str(self.code)
        env["PYTHONUNBUFFERED"] = "1"
        env["DBUS_SYSTEM_BUS_ADDRESS"] = "unix:path=/nonexistent"
        return env

    def setup(self) -> None:
        s = self.results["setup"]
        began = time.time()
        if self.args.code == "head":
            code = self.sgl_dir() / "code"
            if not (code / "supervisord_gpu").is_dir():
                code.mkdir(parents=True, exist_ok=True)
                with tarfile.open(SGL / "code-HEAD.tar.xz") as tf:
                    tf.extractall(code, filter="data") if sys.version_info >= (3, 12) else tf.extractall(code)
            self.code = code
            s["code"] = {"from": ".sgl/code-HEAD.tar.xz", "commit": (SGL / "code-HEAD.commit").read_text().strip()}
        else:
            s["code"] = {"from": str(REPO), "commit": _git(["rev-parse", "HEAD"]), "dirty": _git(["status", "--short", "supervisord_gpu"])}
        sys.path.insert(0, str(self.code))
        if self.mode == "real":
            for b in ("sglang-site", "router-site"):
                dest = self.sgl_dir() / b
                if not (dest / ".done").exists() and not (SGL / f"{b}.tar.xz").exists():
                    s[f"unpack_{b}_s"] = "absent: not carried in this call (real_pd.py unpack puts it in place)"
                    continue
                if not (dest / ".done").exists():
                    dest.mkdir(parents=True, exist_ok=True)
                    t = time.time()
                    subprocess.run(["tar", "-xJf", str(SGL / f"{b}.tar.xz"), "-C", str(dest)], check=True)
                    (dest / ".done").write_text("")
                    s[f"unpack_{b}_s"] = round(time.time() - t, 1)
            self.model = self.sgl_dir() / "model"
            if not (self.model / "config.json").exists():
                t = time.time()
                subprocess.run([self.py, str(SGL / "make_tiny_model.py"), str(self.model)], check=True,
                               stdout=subprocess.DEVNULL)
                s["make_model_s"] = round(time.time() - t, 1)
            s["versions"] = self.versions()
        else:
            self.model = self.work / "model"
            self.model.mkdir()
            (self.model / "config.json").write_text(json.dumps({"architectures": ["OlmoForCausalLM"], "model_type": "olmo"}))
            s["versions"] = {"standin": "supervisord_gpu/rehearsal/standin_server.py", "router": self.router_choice()}
        self.write_config()
        s["setup_s"] = round(time.time() - began, 1)
        self.gpu = Gpu(self.mode, self.work / "simgpu")
        if self.mode == "standin":
            from supervisord_gpu.checks.gpus import inventory_for
            from supervisord_gpu.config.loader import effective_config, load_daemon_config

            inventory_for(effective_config(load_daemon_config(self.etc), True), simulated=True)  # the simulated GPUs exist before anything reads them
        s["gpu"] = self.gpu.info()
        used, pids = self.gpu.read()
        self.baseline = used
        s["baseline_used_mib"], s["baseline_holders"] = used, pids
        s["shm_before"] = sorted(shm_names())
        self.shm_before = shm_names()
        self.gpu.start()

    def sgl_dir(self) -> Path:
        return Path(self.args.unpack)

    def router_choice(self) -> str:
        if self.args.router != "auto":
            return self.args.router
        try:
            import sglang_router  # noqa: F401
            return "real"
        except ImportError:
            return "standin"

    def versions(self) -> dict[str, Any]:
        from importlib import metadata

        v: dict[str, Any] = {"python": sys.version.split()[0]}
        for site, names in ((self.sgl_dir() / "sglang-site", ("sglang", "sglang-kernel", "torch_memory_saver")), (self.sgl_dir() / "router-site", ("sglang-router",))):
            for d in metadata.distributions(path=[str(site)]):
                if d.metadata["Name"] in names:
                    v[d.metadata["Name"]] = d.version
        for name in ("torch", "triton", "transformers", "nvidia-ml-py"):
            try:
                v[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                v[name] = None
        return v

    def write_config(self) -> None:
        etc = self.etc
        (etc / "profiles").mkdir(parents=True)
        for d in (etc, etc / "profiles"):
            os.chmod(d, 0o755)
        from supervisord_gpu.ownership.cgroupfs import cgroup2_mount

        mount = cgroup2_mount()
        self.cgroup_top = mount / f"rsg-{self.mode}-{os.getpid()}" if mount else None
        root = self.cgroup_top / "supervisord-gpu" if self.cgroup_top else None
        py = json.dumps(self.py)
        daemon = f"""
[daemon]
ownership = "cgroupfs"
{f'cgroup_root = "{root}"' if root else ''}
runtime_dir = "{self.work / 'run'}"
cache_dir = "{self.sgl_dir() / 'cache' if self.mode == 'real' else self.work / 'cache'}"
default_user = "root"
[sglang]
server_command = [{py}, "-m", "sglang.launch_server"]
router_command = [{py}, "-m", "sglang_router.launch_router"]
[gpus]
backend = "{'nvml' if self.mode == 'real' else 'simulated'}"
idle_tolerance_mib = {IDLE_TOLERANCE_MIB}
wait_idle_timeout = 60
"""
        if self.mode == "standin":
            daemon += f"""
[rehearsal]
enabled = true
gpu_count = 1
gpu_memory_mib = 143771
server_startup = {self.args.standin_startup}
server_mib_per_gpu = 38000
router = "{self.router_choice()}"
simgpu_dir = "{self.work / 'simgpu'}"
"""
        (etc / "supervisord-gpu.toml").write_text(daemon)
        if self.mode == "real":
            site, rsite = self.sgl_dir() / "sglang-site", self.sgl_dir() / "router-site"
            server_env = {"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                          "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "CUDA_HOME": "/usr/local/cuda"}
            # the router imports setproctitle, which only the SGLang bundle has (and with SGLang importable,
            # the router also imports SGLang and torch: ~15 s of its start, as in the recipe)
            router_env = {"PYTHONPATH": f"{rsite}:{site}"}
        else:  # a generated token takes 3 ms (the real tiny model: 48 tokens in ~0.15 s)
            server_env = {"PYTHONPATH": str(self.code), "SUPERVISORD_GPU_STANDIN_TOKEN_S": "0.003"}
            router_env = {"PYTHONPATH": str(self.code)}
        common = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        server_env = {**server_env, **common, "SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_CHECK_TIMEOUT)}
        router_env = {**router_env, **common}

        def env_table(key: str, env: dict[str, str]) -> str:
            return f"[{key}.env]\n" + "".join(f'{k} = "{v}"\n' for k, v in env.items())

        def server(name: str, port: int, mem: float) -> str:
            return f"""
[servers.{name}]
gpus = [0]
host = "127.0.0.1"
port = {port}
model_path = "{self.model}"
start_timeout = 600
stop_timeout = 30
[servers.{name}.probe]
liveness_interval = {LIVENESS['liveness_interval']}
liveness_timeout = {LIVENESS['liveness_timeout']}
failures = {LIVENESS['failures']}
[servers.{name}.options]
load-format = "dummy"
attention-backend = "triton"
sampling-backend = "pytorch"
grammar-backend = "none"
mem-fraction-static = {mem}
disable-radix-cache = true
""" + env_table(f"servers.{name}", server_env)

        restart = """
[restart]
mode = "on-failure"
max_restarts = 5
window = 600
backoff_initial = 1
backoff_max = 4
"""
        profiles = {
            "solo": 'description = "one server on GPU 0 (issue 27)"\n' + restart + server("server", SERVER_PORT, 0.25),
            "routed": ('description = "one server behind the real router (issue 27)"\nstop_order = ["router", "server"]\n'
                       + restart + server("server", SERVER_PORT, 0.25) + f"""
[router]
mode = "regular"
host = "127.0.0.1"
port = {ROUTER_PORT}
workers = ["server"]
stop_timeout = 30
[router.options]
prometheus-host = "127.0.0.1"
prometheus-port = {ROUTER_METRICS_PORT}
""" + env_table("router", router_env)),
            "single": 'description = "one larger server on the router\'s port (issue 27)"\ntakeover = true\n' + restart
                      + server("server", SINGLE_PORT, 0.5),
        }
        for name, text in profiles.items():
            (etc / "profiles" / f"{name}.toml").write_text(text)
        self.results["setup"]["config"] = daemon
        self.results["setup"]["profiles"] = profiles

    def gpusupctl(self, *argv: str, timeout: float = 60) -> tuple[int, str, str]:
        done = subprocess.run([self.py, "-m", "supervisord_gpu.cli.gpusupctl", *argv, "--config-dir", str(self.etc)],
                              capture_output=True, text=True, env=self.daemon_env(), cwd=self.work, timeout=timeout)
        return done.returncode, done.stdout, done.stderr

    # ---------------------------------------------------------------- bookkeeping

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        path = self.out / f"real-sglang-{self.tag()}.json"
        path.write_text(json.dumps(self.results, indent=1, default=str))

    def scenario(self, key: str, title: str, estimate_s: float, fn: Any, *a: Any) -> Any:
        print(f"\n=== {key}: {title} (t={self.elapsed():.0f} s, {self.left():.0f} s left, needs ~{estimate_s:.0f} s)", flush=True)
        entry: dict[str, Any] = {"title": title, "started_at_s": round(self.elapsed(), 1)}
        self.results["scenarios"][key] = entry
        check = Check()
        measured: dict[str, Any] = {}
        entry["checks"], entry["measured"] = check.items, measured
        value = None
        try:
            if self.args.only and key not in self.args.only and key != "s1_start":
                raise NotRun("not in --only")
            if self.left() < estimate_s + self.args.reserve:
                raise NotRun(f"budget: {self.left():.0f} s left, needs ~{estimate_s:.0f} s + {self.args.reserve:.0f} s reserve")
            value = fn(check, measured, *a)
            entry["result"] = "PASS" if check.ok and check.items else "FAIL"
        except NotRun as e:
            entry["result"], entry["why"] = "NOT RUN", str(e)
        except Exception as e:
            entry["result"] = "FAIL"
            entry["error"] = f"{e.__class__.__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            print(f"      [FAIL] {entry['error']}", flush=True)
        entry["took_s"] = round(self.elapsed() - entry["started_at_s"], 1)
        print(f"--- {key}: {entry['result']} ({entry['took_s']} s)" + (f": {entry.get('why', '')}" if entry["result"] == "NOT RUN" else ""), flush=True)
        self.save()
        return value

    def finish(self) -> int:
        self.gpu.stop()
        leftover = our_processes(self.work, self.cgroup_top)
        for p in leftover:  # ours only: processes this run started (see our_processes)
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except OSError:
                pass
        self.results["killed_at_end"] = leftover
        if self.cgroup_top is not None and self.cgroup_top.exists():
            for dirpath, _dirs, _files in sorted(os.walk(self.cgroup_top), key=lambda x: -len(x[0])):
                try:
                    Path(dirpath, "cgroup.kill").write_text("1")
                except OSError:
                    pass
            time.sleep(0.5)
            for dirpath, _dirs, _files in sorted(os.walk(self.cgroup_top), key=lambda x: -len(x[0])):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        summary = {k: v["result"] for k, v in self.results["scenarios"].items()}
        self.results["summary"] = summary
        self.save()
        tgz = self.out / f"logs-{self.tag()}.tar.gz"
        with tarfile.open(tgz, "w:gz") as tf:
            tf.add(self.logs, arcname=f"logs-{self.tag()}")
        print("\n== summary (" + self.mode + f", group {self.args.group}, {self.elapsed():.0f} s)")
        for k, v in summary.items():
            print(f"  {v:<8} {k}: {self.results['scenarios'][k]['title']}")
        return 0 if all(v in ("PASS",) for v in summary.values()) else 1

    # ---------------------------------------------------------------- helpers shared by scenarios

    def note_shm(self, pids: list[int]) -> set[str]:
        """Remember the /dev/shm segments our processes map now (checked gone after they end)."""
        names = mapped_shm(pids)
        self.seen_shm |= names
        return names

    def server_pids(self, d: Daemon, name: str = "server") -> tuple[int | None, int | None, list[int], str]:
        """(main pid, scheduler pid, every pid of its cgroup, cgroup path) as the daemon reports and /proc shows."""
        p = d.process(name)
        group = p.get("group", "")
        pids = group_pids(group) if group else []
        sched = next((x for x in pids if is_scheduler(x)), None)
        return p.get("pid"), sched, pids, group

    def start_and_ready(self, d: Daemon, c: Check, m: dict[str, Any], port: int, timeout: float = 400.0) -> None:
        """Wait for the instance to be ready, watching when the server's port opens."""
        port_t = None
        deadline = time.time() + min(timeout, max(5.0, self.left() - 10))
        while True:
            if port_t is None and port_open(port):
                port_t = time.time()
            if d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "ready"):
                break
            if d.proc.poll() is not None or d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "failed"):
                d.events()
                raise AssertionError(f"daemon {d.tag} failed to start: {[e['msg'] for e in d.find(lambda e: e['k'] == 'say' and e['prio'] <= 3)][-3:]}")
            if time.time() > deadline:
                raise AssertionError(f"not ready after {timeout:g} s")
            time.sleep(0.1)
        m["port_open_at"] = port_t

    def idle_after_stop(self, c: Check, m: dict[str, Any], d: Daemon, instance: str, processes: list[str]) -> None:
        """Stop the daemon (SIGTERM, what systemctl stop sends) and verify everything is gone."""
        tmpdirs = {p: self.work / "run" / instance / "tmp" / p for p in processes}
        groups = {p: d.process(p).get("group", "") for p in processes}
        self.note_shm([x for g in groups.values() if g for x in group_pids(g)])
        since = time.time()
        rc = d.stop(120)
        took = time.time() - since
        m["daemon_exit"], m["sigterm_to_daemon_exit_s"] = rc, round(took, 2)
        c("daemon exits 0 after SIGTERM", rc == 0, rc)
        stopped = {p: [e["msg"] for e in d.says("stopped", since, p)] for p in processes}
        m["stopped_lines"] = stopped
        c("each process stopped by the daemon", all(stopped.values()), stopped)
        time.sleep(1.0)
        used, pids = self.gpu.read()
        idle_s = self.gpu.first_idle_after(since, self.baseline)
        m["gpu_after_stop"] = {"used_mib": used, "baseline_mib": self.baseline, "holders": pids}
        m["sigterm_to_gpu_idle_s"] = None if idle_s is None else round(idle_s, 2)
        c("GPU memory back at baseline, no holder (read directly: " + ("NVML" if self.mode == "real" else "simulated GPU") + ")",
          used - self.baseline <= IDLE_TOLERANCE_MIB and not pids, f"{used} MiB (baseline {self.baseline}), holders {pids}")
        rc2, out, err = self.gpusupctl("gpus", "--json")
        try:
            g0 = json.loads(out)["gpus"][0]
            verdict = {"idle": g0.get("idle"), "used_mib": g0.get("used_mib"), "holders": g0.get("holders")}
        except (ValueError, KeyError, IndexError):
            verdict = {"rc": rc2, "out": out[-500:], "err": err[-500:]}
        m["gpusupctl_gpus_after_stop"] = verdict
        c("gpusupctl gpus: GPU 0 idle", verdict.get("idle") is True and not verdict.get("holders"), verdict)
        procs = our_processes(self.work, self.cgroup_top)
        c("no process of this run left (SGLang, its schedulers, the router)", not procs, procs)
        left_groups = {p: group_pids(g) for p, g in groups.items() if g}
        c("their cgroups are empty or gone", not any(left_groups.values()), {p: (g, left_groups.get(p)) for p, g in groups.items()})
        left = sorted(self.seen_shm & shm_names())
        new_shm = sorted(shm_names() - self.shm_before)
        m["shm_seen_mapped_by_our_processes"] = sorted(self.seen_shm)
        m["shm_new_since_run_start"] = new_shm
        c("/dev/shm: none of the segments our processes mapped is left", not left,
          {"left": left, "seen": len(self.seen_shm)})
        if self.mode == "real":  # nothing else runs on the device machine: every new segment is ours
            c("/dev/shm: no sglang_loads_*, sgl_shm_*, nccl-*, cuda.shm.* new since the run began", not new_shm, new_shm)
        tmp_left = {p: listing(t) for p, t in tmpdirs.items()}
        c("each process's private TMPDIR empty", not any(tmp_left.values()), {p: (str(tmpdirs[p]), v) for p, v in tmp_left.items()})
        m["leftover_lines"] = [e["msg"] for e in d.says("leftover", since)]


def _git(argv: list[str]) -> str:
    try:
        return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO).stdout.strip()
    except OSError:
        return ""


# ============================================================================ scenarios

PHASE_LINES = (  # what SGLang 0.5.23 prints at each start-up step (sglang-server.md), in order
    ("load_begin", r"Load weight begin"),
    ("load_end", r"Load weight end"),
    ("kv_allocated", r"KV Cache is allocated"),
    ("memory_pool_end", r"Memory pool end"),
    ("capture_begin", r"Capture .*CUDA graph begin"),
    ("capture_end", r"Capture .*CUDA graph end"),
    ("max_total_num_tokens", r"max_total_num_tokens="),
    ("deepgemm", r"DeepGEMM"),
    ("uvicorn_running", r"Uvicorn running on"),
    ("fired_up", r"The server is fired up and ready to roll"),
)
STAMP_RE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def s1_start(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    """Start to READY through the daemon; the phases it reports against the lines SGLang printed."""
    from supervisord_gpu.sglang import logs as phases

    run.start_and_ready(d, c, m, SERVER_PORT)
    spawn = d.says("spawn", process="server")[0]
    ready = d.says("ready", process="server")[0]
    inst = d.says("instance-ready")[0]
    t_spawn = spawn["t"]
    m["spawn_to_port_open_s"] = round(m["port_open_at"] - t_spawn, 2) if m.get("port_open_at") else None
    m["spawn_to_ready_s"] = round(ready["t"] - t_spawn, 2)
    m["ready_line"] = ready["msg"]
    m["instance_ready_line"] = inst["msg"]
    lines = d.find(lambda e: e["k"] == "line" and e["p"] == "server")
    marks: dict[str, Any] = {}
    for key, pat in PHASE_LINES:
        hit = next((e for e in lines if re.search(pat, e["line"])), None)
        if hit:
            stamp = STAMP_RE.match(hit["line"])
            marks[key] = {"at_s": round(hit["t"] - t_spawn, 2), "line": hit["line"][:160], "stamp": stamp.group(1) if stamp else None}
    m["log_marks"] = marks
    reported = [(e["msg"], round(e["t"] - t_spawn, 2)) for e in d.find(lambda e: is_phase_change(e, "server"))
                if e["t"] <= ready["t"] + 0.5]
    m["phases_reported"] = reported
    from_log: list[tuple[str, float]] = []
    for e in lines:
        ph = phases.phase_of(e["line"])
        if ph and (not from_log or from_log[-1][0] != ph) and e["t"] <= ready["t"] + 0.5:
            from_log.append((ph, round(e["t"] - t_spawn, 2)))
    m["phases_in_log"] = from_log
    c("instance ready", True, f"server ready {m['spawn_to_ready_s']} s after spawn; {inst['msg']}")
    c("the port opens late: only after SGLang printed the end of loading and capture",
      m.get("port_open_at") is not None and "max_total_num_tokens" in marks
      and m["port_open_at"] >= t_spawn + marks["max_total_num_tokens"]["at_s"] - 0.2,
      f"port open {m['spawn_to_port_open_s']} s after spawn; max_total_num_tokens at {marks.get('max_total_num_tokens', {}).get('at_s')} s")
    c("ready only after the port opened (our /health probe answered 200)",
      m.get("port_open_at") is not None and ready["t"] >= m["port_open_at"] - 0.2, f"ready at {m['spawn_to_ready_s']} s")
    names = [p for p, _ in reported if p != phases.LAUNCHED]
    order = [phases.PHASE_ORDER.index(p) for p in names if p in phases.PHASE_ORDER]
    m["info_phases_monotonic_in_PHASE_ORDER"] = order == sorted(order)
    in_log = [p for p, _ in from_log]
    c("the reported phases are those the log's lines announce, in the log's order", names == in_log, {"reported": names, "log": in_log})
    need = [phases.LOADING_WEIGHTS, phases.ALLOCATING_KV, phases.CAPTURING_GRAPHS, phases.WARMING_UP, phases.SERVING]
    c("every start-up phase was reported", all(p in names for p in need), {"reported": names, "needed": need})
    # the k-th phase change reported against the k-th phase change the log's lines announce
    pairs = list(zip([x for x in reported if x[0] != phases.LAUNCHED], from_log, strict=False))
    lag = [(p, round(at - lat, 2)) for (p, at), (_lp, lat) in pairs]
    m["phase_lag_behind_log_s"] = lag
    c("each reported phase matches the line in the real log (reported within 1 s of it)",
      len(pairs) == len(from_log) and all(-0.05 <= v <= 1.0 for p, v in lag if p != phases.SERVING), lag)
    healths = [call("GET", SERVER_PORT, "/health", timeout=30) for _ in range(3)]
    m["health_after_ready"] = [(s, round(t, 3)) for s, _, t in healths]
    c("/health is a generation: 200 and >= 1 s each time", all(s == 200 and t >= 0.95 for s, _, t in healths), m["health_after_ready"])
    rs, _, rt = call("GET", SERVER_PORT, "/ready", timeout=5)
    m["ready_endpoint"] = (rs, round(rt, 4))
    c("/ready 200 at once", rs == 200 and rt < 0.25, m["ready_endpoint"])
    st = d.ctl(op="status")
    proc = next((p for p in st.get("processes", []) if p["name"] == "server"), {})
    m["status"] = {k: proc.get(k) for k in ("state", "phase", "pid", "serving", "restarts", "last_exit", "group")}
    m["status"]["instance_state"] = st.get("state")
    c("status (D-Bus GetStatus): instance ready, server ready, phase serving, serving",
      st.get("state") == "ready" and proc.get("state") == "ready" and proc.get("phase") == phases.SERVING and proc.get("serving") is True,
      m["status"])


def s2_holders(run: Run, c: Check, m: dict[str, Any], d: Daemon, instance: str = "solo") -> None:
    """The real scheduler PID as the GPU's holder, named as ours."""
    main, sched, pids, group = run.server_pids(d)
    m.update(main_pid=main, scheduler_pid=sched, cgroup=group, cgroup_pids={p: cmdline(p)[:80] for p in pids})
    m["shm_mapped"] = sorted(run.note_shm(pids))
    c("a sglang::scheduler process in the server's cgroup", sched is not None, {p: comm(p) for p in pids})
    used, nv = run.gpu.read()
    m["gpu_direct"] = {"used_mib": used, "baseline_mib": run.baseline, "holders": nv}
    c("GPU 0 holds memory (read directly)", used - run.baseline > 1000, f"{used - run.baseline} MiB over baseline")
    c("the GPU's holders are the scheduler (read directly)", sched in nv and set(nv) <= set(pids), {"holders": nv, "scheduler": sched})
    rc, out, err = run.gpusupctl("gpus", "--json")
    try:
        g0 = json.loads(out)["gpus"][0]
        holders = g0.get("holders", [])
        m["gpusupctl_gpus"] = {"idle": g0.get("idle"), "used_mib": g0.get("used_mib"),
                               "holders": holders}
    except (ValueError, KeyError, IndexError):
        holders = []
        m["gpusupctl_gpus"] = {"rc": rc, "out": out[-500:], "err": err[-500:]}
    # `gpus --json` gives each holder as its one-line description: "pid N (user U) CMD [cgroup C] (ours: instance I, P)"
    mine = [h for h in holders if str(h).startswith(f"pid {sched} ")]
    c("gpusupctl gpus: not idle, the scheduler PID named as ours (instance, process)",
      g0.get("idle") is False and len(mine) == 1 and f"(ours: instance {instance}, server)" in str(mine[0]), m["gpusupctl_gpus"])
    rc, out, err = run.gpusupctl("gpus")
    m["gpusupctl_gpus_table"] = out[-1200:]
    # Not a check: `gpusupctl status` reads instance states from systemd over D-Bus, and the device
    # machine has neither (recorded for the report; the daemon's own status is read above).
    rc, out, err = run.gpusupctl("status", "--json")
    try:
        st = json.loads(out)
        owners = [h.get("owner") for g in (st.get("gpus") or []) for h in g.get("holders", [])]
        m["info_gpusupctl_status"] = {"rc": rc, "bus": st.get("bus"), "notes": st.get("notes"), "holder_owners": owners}
    except ValueError:
        m["info_gpusupctl_status"] = {"rc": rc, "out": out[-500:], "err": err[-500:]}


def no_kill_since(d: Daemon, since: float) -> list[str]:
    return [e["msg"] for e in d.find(lambda e: e["k"] == "say" and e["f"].get("GPUSUP_EVENT") in ("unhealthy", "exit", "restart", "kill", "failed"), since)]


def s3_pause(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    try:
        _s3_pause(run, c, m, d)
    finally:  # never leave the server paused for the scenarios after this one
        call("POST", SERVER_PORT, "/continue_generation", {}, timeout=10, key=admin_key())


def _s3_pause(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    """POST /pause_generation held for PAUSE_S: not killed; then continue + one /health: /ready 200."""
    main, sched, _pids, _g = run.server_pids(d)
    restarts0 = d.process("server").get("restarts")
    since = time.time()
    s, body, _ = call("POST", SERVER_PORT, "/pause_generation", {}, timeout=30)
    m["pause_without_key"] = (s, body[:120].decode(errors="replace"))
    c("a pause without the server's admin key is refused (401)", s == 401, m["pause_without_key"])
    s, body, t = call("POST", SERVER_PORT, "/pause_generation", {}, timeout=30, key=admin_key())
    m["pause"] = (s, body[:120].decode(errors="replace"), round(t, 3))
    c("POST /pause_generation answered 200", s == 200, m["pause"])
    samples = []
    info_answers = []
    next_info = 0.0
    while time.time() - since < PAUSE_S:
        rs, _, rt = call("GET", SERVER_PORT, "/ready", timeout=3)
        p = d.process("server")
        at = round(time.time() - since, 1)
        samples.append({"at_s": at, "ready": rs, "ready_s": round(rt, 3), "state": p.get("state"), "serving": p.get("serving")})
        if at >= next_info:
            si, _, st_ = call("GET", SERVER_PORT, "/server_info", timeout=5)
            info_answers.append({"at_s": at, "status": si, "s": round(st_, 3)})
            next_info = at + 20
        time.sleep(max(0.0, 5.0 - (time.time() - since - at)))
    held = time.time() - since
    m["held_s"] = round(held, 1)
    m["samples"] = samples
    m["server_info_while_paused"] = info_answers
    c(f"held paused for {PAUSE_S:g} s", held >= PAUSE_S, m["held_s"])
    c("/ready answered 503 throughout (answered: alive, not serving)", all(x["ready"] == 503 for x in samples), [x["ready"] for x in samples])
    late = [x for x in samples if x["at_s"] >= 2 * LIVENESS["liveness_interval"] + 1.5]
    c("the daemon says 'not serving' (status serving=false) and keeps it ready",
      bool(late) and all(x["serving"] is False and x["state"] == "ready" for x in late),
      [(x["at_s"], x["state"], x["serving"]) for x in samples[:4]])
    ns = d.says("not-serving", since, "server")
    m["not_serving_line"] = ns[0]["msg"] if ns else None
    m["not_serving_after_s"] = round(ns[0]["t"] - since, 2) if ns else None
    c("journal line: not serving, left running", bool(ns), m["not_serving_line"])
    kills = no_kill_since(d, since)
    main2, sched2, _p, _g = run.server_pids(d)
    c("NOT killed: no kill, exit or restart; same main and scheduler PIDs, alive",
      not kills and main2 == main and sched2 == sched and alive(main) and alive(sched) and d.process("server").get("restarts") == restarts0,
      {"events": kills, "main": (main, main2), "scheduler": (sched, sched2)})
    c("the scheduler answers /server_info while paused (the daemon's scheduler check relies on it)",
      bool(info_answers) and all(x["status"] == 200 for x in info_answers), info_answers)
    t_cont = time.time()
    s, body, t = call("POST", SERVER_PORT, "/continue_generation", {}, timeout=30, key=admin_key())
    m["continue"] = (s, body[:120].decode(errors="replace"), round(t, 3))
    c("POST /continue_generation answered 200", s == 200, m["continue"])
    r0, _, _ = call("GET", SERVER_PORT, "/ready", timeout=3)
    m["ready_right_after_continue"] = r0
    hs, _, ht = call("GET", SERVER_PORT, "/health", timeout=30)
    rs, _, _ = call("GET", SERVER_PORT, "/ready", timeout=3)
    m["health_after_continue"] = (hs, round(ht, 3))
    m["ready_after_health"] = rs
    c("then one /health 200 and /ready 200", hs == 200 and rs == 200, {"ready_right_after_continue": r0, "health": m["health_after_continue"], "ready": rs})
    try:
        back = d.wait_say("serving", 3 * (LIVENESS["liveness_interval"] + LIVENESS["liveness_timeout"]), t_cont, "server")
        m["serving_again_after_continue_s"] = round(back["t"] - t_cont, 2)
        c("the daemon says serving again", True, back["msg"])
    except AssertionError as e:
        c("the daemon says serving again", False, str(e))


def s3_latch(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    try:
        _s3_latch(run, c, m, d)
    finally:  # never leave it paused or latched for the scenarios after this one
        call("POST", SERVER_PORT, "/continue_generation", {}, timeout=10, key=admin_key())
        if call("GET", SERVER_PORT, "/ready", timeout=3)[0] == 503:
            call("GET", SERVER_PORT, "/health", timeout=30)


def _s3_latch(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    """A third party's /health during a pause, then continue: whatever /ready says after (latched
    or not), the server is not killed, and one /health leaves /ready 200.

    Whether it latches is recorded, not asserted: the real SGLang's /health passes as soon as the
    scheduler answers anything, and the daemon's own /server_info round trip is answered during a
    pause (H200, 2026-12-03: 200 after 2.0 s, no latch); the stand-in waits for the pause and
    latches. The latch itself is s3_latch_stall (a scheduler stall)."""
    main, sched, _pids, _g = run.server_pids(d)
    restarts0 = d.process("server").get("restarts")
    since = time.time()
    s, _, _ = call("POST", SERVER_PORT, "/pause_generation", {}, timeout=30, key=admin_key())
    c("paused", s == 200, s)
    hs, _, ht = call("GET", SERVER_PORT, "/health", timeout=30)
    m["health_during_pause"] = (hs, round(ht, 2))
    s, _, _ = call("POST", SERVER_PORT, "/continue_generation", {}, timeout=30, key=admin_key())
    t_cont = time.time()
    c("continued", s == 200, s)
    after = []
    for at in (1, 5, 10, 15, 20):
        time.sleep(max(0.0, t_cont + at - time.time()))
        rs, _, _ = call("GET", SERVER_PORT, "/ready", timeout=3)
        after.append({"at_s_after_continue": at, "ready": rs, "serving": d.process("server").get("serving")})
    m["ready_after_continue"] = after
    m["latched"] = all(x["ready"] == 503 for x in after)
    m["info"] = (f"/health during the pause: {hs} after {ht:.1f} s; /ready after continue: "
                 + ("latched 503 until a /health" if m["latched"] else "200 (no latch)"))
    print(f"      [info] {m['info']}", flush=True)
    kills = no_kill_since(d, since)
    main2, sched2, _p, _g = run.server_pids(d)
    c("NOT killed over 20 s after continue (5 liveness bounds)", not kills and main2 == main and sched2 == sched and alive(main)
      and d.process("server").get("restarts") == restarts0, {"events": kills, "main": (main, main2)})
    t_h = time.time()
    hs, _, ht = call("GET", SERVER_PORT, "/health", timeout=30)
    rs, _, _ = call("GET", SERVER_PORT, "/ready", timeout=3)
    m["health_then_ready"] = (hs, round(ht, 2), rs)
    c("one /health 200, then /ready 200", hs == 200 and rs == 200, m["health_then_ready"])
    if m["latched"]:
        try:
            back = d.wait_say("serving", 3 * (LIVENESS["liveness_interval"] + LIVENESS["liveness_timeout"]), t_h, "server")
            m["serving_again_s"] = round(back["t"] - t_h, 2)
            c("the daemon says serving again", True, back["msg"])
        except AssertionError as e:
            c("the daemon says serving again", False, str(e))


def s3_latch_stall(run: Run, c: Check, m: dict[str, Any], d: Daemon, port: int) -> None:
    """A /ready latched 503 by a third party's /health that failed during a scheduler stall
    (SIGSTOP of sglang::scheduler for longer than SGLANG_HEALTH_CHECK_TIMEOUT, then SIGCONT),
    that then answers: not killed; one /health clears it.

    The paused variant (s3_latch) cannot latch while the daemon watches: a /health generation
    passes as soon as the scheduler answers anything, and the daemon's own /server_info round
    trip is answered during a pause."""
    main, sched, _pids, _g = run.server_pids(d)
    restarts0 = d.process("server").get("restarts")
    stall_s = HEALTH_CHECK_TIMEOUT + 2
    since = time.time()
    got: dict[str, Any] = {}

    def health() -> None:
        got["health"] = call("GET", port, "/health", timeout=30)

    th = threading.Thread(target=health, daemon=True)
    os.kill(sched, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        time.sleep(0.3)
        th.start()
        time.sleep(stall_s)
    finally:
        os.kill(sched, signal.SIGCONT)  # type: ignore[arg-type]
    t_cont = time.time()
    th.join(30)
    hs, _, ht = got.get("health", (None, b"", 0.0))
    m["stall_s"] = stall_s
    m["health_during_stall"] = (hs, round(ht, 2))
    c(f"a third party's /health during a {stall_s} s scheduler stall fails (503 after SGLANG_HEALTH_CHECK_TIMEOUT={HEALTH_CHECK_TIMEOUT} s)",
      hs == 503, m["health_during_stall"])
    latched = []
    for at in (1, 5, 10, 15):
        time.sleep(max(0.0, t_cont + at - time.time()))
        rs, _, _ = call("GET", port, "/ready", timeout=3)
        latched.append({"at_s_after_sigcont": at, "ready": rs, "serving": d.process("server").get("serving")})
    m["ready_after_stall"] = latched
    c("/ready stays 503 after the stall (latched UnHealthy), the daemon says not serving",
      all(x["ready"] == 503 for x in latched) and latched[-1]["serving"] is False, latched)
    kills = no_kill_since(d, since)
    main2, sched2, _p, _g = run.server_pids(d)
    c("NOT killed: stalled 6 s, then latched 15 s", not kills and main2 == main and sched2 == sched and alive(main)
      and d.process("server").get("restarts") == restarts0, {"events": kills, "main": (main, main2)})
    t_h = time.time()
    hs, _, ht = call("GET", port, "/health", timeout=30)
    rs, _, _ = call("GET", port, "/ready", timeout=3)
    m["health_clears"] = (hs, round(ht, 2), rs)
    c("one /health 200 clears the latch: /ready 200", hs == 200 and rs == 200, m["health_clears"])
    try:
        back = d.wait_say("serving", 3 * (LIVENESS["liveness_interval"] + LIVENESS["liveness_timeout"]), t_h, "server")
        m["serving_again_s"] = round(back["t"] - t_h, 2)
        c("the daemon says serving again", True, back["msg"])
    except AssertionError as e:
        c("the daemon says serving again", False, str(e))


def leftovers_of(before: set[str]) -> list[str]:
    return sorted(before & shm_names())


def s3_sigstop(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    """A SIGSTOPped server main process: killed within the liveness bound, restarted, ready again."""
    main, sched, pids, group = run.server_pids(d)
    restarts0 = d.process("server").get("restarts")
    shm0 = run.note_shm(pids)
    tmp = run.work / "run" / "solo" / "tmp" / "server"
    tmp0 = set(listing(tmp))
    m["incarnation_files"] = {"shm": sorted(shm0), "tmpdir": sorted(tmp0)}
    since = time.time()
    os.kill(main, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        kill = d.wait_say("unhealthy", 60, since, "server")
    except AssertionError:
        os.kill(main, signal.SIGCONT)  # type: ignore[arg-type]  # not killed: let the next scenarios have a server
        raise
    m["sigstop_to_kill_s"] = round(kill["t"] - since, 2)
    m["kill_line"] = kill["msg"]
    c(f"killed within the liveness bound failures x (interval + timeout) = {LIVENESS_BOUND_S} s",
      kill["t"] - since <= LIVENESS_BOUND_S + 1.0, f"{m['sigstop_to_kill_s']} s: {kill['msg']}")
    restart = d.wait_say("restart", 30, since, "server")
    m["restart_line"] = restart["msg"]
    c("the restart says why: killed by SIGKILL after /ready gave no answer", "SIGKILL" in restart["msg"] and "no answer" in restart["msg"], restart["msg"])
    ready = d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == "server" and e["state"] == "ready", 400,
                   "server ready again", restart["t"])
    m["kill_to_ready_again_s"] = round(ready["t"] - kill["t"], 1)
    run.observed_restart_s = ready["t"] - kill["t"]
    main2, sched2, pids2, _g = run.server_pids(d)
    c("restarted and ready again: a new main PID, the old processes gone", main2 and main2 != main and not any(alive(p) for p in pids),
      {"old": pids, "new_main": main2, "kill_to_ready_s": m["kill_to_ready_again_s"]})
    c("restart counted once", d.process("server").get("restarts") == (restarts0 or 0) + 1, d.process("server").get("restarts"))
    inst = d.wait_instance("ready", 30, ready["t"] - 1)
    c("instance ready again", bool(inst), inst["msg"])
    left = leftovers_of(shm0)
    tmp_left = sorted(tmp0 & set(listing(tmp)))
    m["removed_lines"] = [e["msg"] for e in d.says("leftover", since)]
    c("the killed incarnation's /dev/shm segments and TMPDIR files are gone", not left and not tmp_left,
      {"shm_left": left, "tmp_left": tmp_left, "daemon": m["removed_lines"]})


def s5_crash(run: Run, c: Check, m: dict[str, Any], d: Daemon, instance: str) -> None:
    """kill -9 of the sglang::scheduler process, then SIGTERM to the restarted server while it loads."""
    main, sched, pids, group = run.server_pids(d)
    c("found the scheduler", sched is not None, {p: comm(p) for p in pids})
    restarts0 = d.process("server").get("restarts") or 0
    shm0 = run.note_shm(pids)
    m["incarnation_shm"] = sorted(shm0)
    since = time.time()
    os.kill(sched, signal.SIGKILL)  # type: ignore[arg-type]
    ex = d.wait_say("exit", 60, since, "server")
    m["kill_to_exit_seen_s"] = round(ex["t"] - since, 2)
    m["exit_line"] = ex["msg"]
    c("the daemon names SGLang's own crash path", "crashed" in ex["msg"] and "scheduler" in ex["msg"], ex["msg"])
    crash_lines = [e["line"][:200] for e in d.find(lambda e: e["k"] == "line" and e["p"] == "server" and e["prio"] <= 3, since)][:6]
    m["sglang_error_lines"] = crash_lines
    r1 = d.wait_say("restart", 30, since, "server")
    m["restart1_line"] = r1["msg"]
    c("restart 1 scheduled", "restart" in r1["msg"], r1["msg"])
    sp = d.wait_say("spawn", 60, r1["t"], "server")
    pid1 = int(sp["f"]["GPUSUP_PID"])
    restart_s = getattr(run, "observed_restart_s", run.args.start_estimate)
    m["planned_with_restart_s"] = round(restart_s, 1)
    if run.left() < restart_s * 2 + 30 + run.args.reserve:
        # No time for a SIGTERM in the restart's loading and a second restart: let restart 1 finish.
        m["sigterm_in_restart"] = f"not run (budget: {run.left():.0f} s left)"
        ready = d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == "server" and e["state"] == "ready", 400,
                       "server ready again", r1["t"])
        m["crash_to_ready_s"] = round(ready["t"] - since, 1)
        d.wait_instance("ready", 60, ready["t"] - 1)
        main2, _s2, _p2, _g = run.server_pids(d)
        c("ready again with new processes", main2 not in (main, None) and not any(alive(p) for p in pids),
          {"old": pids, "new": main2, "crash_to_ready_s": m["crash_to_ready_s"]})
        c("restart counted once", (d.process("server").get("restarts") or 0) == restarts0 + 1, d.process("server").get("restarts"))
        c("the crashed incarnation's /dev/shm segments are gone", not leftovers_of(shm0), leftovers_of(shm0))
        return
    load = d.wait(lambda e: is_phase_change(e, "server") and e["msg"] not in ("launched", ""), 240, "a loading phase", sp["t"])
    m["sigterm_in_phase"] = load["msg"]
    m["spawn_to_loading_s"] = round(load["t"] - sp["t"], 2)
    port_was_open = port_open(SERVER_PORT)
    t_term = time.time()
    os.kill(pid1, signal.SIGTERM)
    ex2 = d.wait_say("exit", 60, t_term, "server")
    m["sigterm_exit_line"] = ex2["msg"]
    m["sigterm_to_exit_seen_s"] = round(ex2["t"] - t_term, 2)
    c("SIGTERM while loading: it dies at once, the daemon says killed by SIGTERM", "SIGTERM" in ex2["msg"] and not port_was_open,
      {"line": ex2["msg"], "phase": load["msg"], "after_s": m["sigterm_to_exit_seen_s"]})
    r2 = d.wait_say("restart", 30, t_term, "server")
    m["restart2_line"] = r2["msg"]
    c("restart 2 scheduled (a failed restart goes back through the policy)", "restart" in r2["msg"], r2["msg"])
    ready = d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == "server" and e["state"] == "ready", 400,
                   "server ready again", r2["t"])
    m["crash_to_ready_s"] = round(ready["t"] - since, 1)
    d.wait_instance("ready", 60, ready["t"] - 1)
    main2, sched2, pids2, _g = run.server_pids(d)
    c("ready again with new processes", main2 not in (main, pid1) and not any(alive(p) for p in pids) and not alive(pid1),
      {"old": pids, "sigtermed": pid1, "new": main2, "crash_to_ready_s": m["crash_to_ready_s"]})
    c("restarts counted twice", (d.process("server").get("restarts") or 0) == restarts0 + 2, d.process("server").get("restarts"))
    left = leftovers_of(shm0)
    c("the crashed incarnation's /dev/shm segments are gone", not left, left)
    st = d.process("server")
    m["status_last_exit"] = st.get("last_exit")
    m["history"] = st.get("history", [])[-8:]


def s5_sigterm_first_start(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> Daemon:
    """SIGTERM to the server while the instance's first start loads: the reason, the exit, and
    systemd's restart (Restart=on-failure), played here by starting the daemon again."""
    sp = d.wait_say("spawn", 120, 0, "server")
    pid = int(sp["f"]["GPUSUP_PID"])
    load = d.wait(lambda e: is_phase_change(e, "server") and e["msg"] not in ("launched", ""), 240, "a loading phase", sp["t"])
    m["sigterm_in_phase"] = load["msg"]
    m["spawn_to_loading_s"] = round(load["t"] - sp["t"], 2)
    t_term = time.time()
    os.kill(pid, signal.SIGTERM)
    try:
        rc = d.proc.wait(120)
    except subprocess.TimeoutExpired:
        rc = None
    m["daemon_exit"] = rc
    m["sigterm_to_daemon_exit_s"] = round(time.time() - t_term, 2)
    ex = d.says("exit", t_term, "server")
    failed = d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "failed", t_term)
    m["exit_line"] = ex[0]["msg"] if ex else None
    m["instance_failed_reason"] = failed[-1]["msg"] if failed else None
    c("the daemon says the server was killed by SIGTERM during start-up", bool(failed) and "SIGTERM" in (failed[-1]["msg"] if failed else ""),
      m["instance_failed_reason"])
    c("the daemon exits 1 (systemd's Restart=on-failure restarts it; 2, 3, 5, 6 it would not)", rc == 1, rc)
    time.sleep(1)
    procs = our_processes(run.work, run.cgroup_top)
    used, nv = run.gpu.read()
    c("nothing left running, GPU idle", not procs and used - run.baseline <= IDLE_TOLERANCE_MIB and not nv, {"procs": procs, "used": used, "holders": nv})
    t = time.time()
    d2 = Daemon(run, "routed", "g2-routed")
    run.start_and_ready(d2, c, m, SERVER_PORT)
    m["restart_as_systemd_would_to_ready_s"] = round(time.time() - t, 1)
    c("started again (as systemd would), ready", True, m["restart_as_systemd_would_to_ready_s"])
    return d2


def s4_router(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> None:
    """restart_process(server) behind the real router under a client loop: no accepted request cut."""
    _main, _sched, _pids, _g = run.server_pids(d)
    router_pid = d.process("router").get("pid")
    old_server = d.process("server").get("pid")
    run.note_shm(_pids + group_pids(d.process("router").get("group", "")))
    stop = threading.Event()
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"text": f"client {i} request {n}: the quick brown fox", "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
            t = time.time()
            s, payload, took = call("POST", ROUTER_PORT, "/generate", body, timeout=120)
            ok = False
            if s == 200:
                try:
                    ok = "text" in json.loads(payload)
                except ValueError:
                    ok = False
            with lock:
                results.append({"t": t, "end": t + took, "status": s, "ok": ok, "body": payload[:160].decode(errors="replace")})
            if not ok:
                time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for th in threads:
        th.start()
    time.sleep(5)
    since = time.time()
    job = d.ctl(op="restart_process", name="server")
    m["job"] = job
    c("RestartProcess accepted (a job)", "job" in job, job)
    state: dict[str, Any] = {}
    while "job" in job and time.time() - since < 400:
        state = d.ctl(op="job", id=job["job"])
        if state.get("state") != "running":
            break
        time.sleep(0.5)
    m["job_result"] = state
    m["job_s"] = round(time.time() - since, 1)
    time.sleep(5)
    stop.set()
    for th in threads:
        th.join(130)
    out_ = d.find(lambda e: e["k"] == "say" and e["f"].get("GPUSUP_EVENT") == "traffic", since)
    m["traffic_lines"] = [(round(e["t"] - since, 2), e["msg"]) for e in out_]
    c("job done: server restarted", state.get("state") == "done", state)
    taken = next((e for e in out_ if "taken out" in e["msg"]), None)
    back = next((e for e in out_ if "back in" in e["msg"]), None)
    c("taken out of the router first, back in after", bool(taken) and bool(back), m["traffic_lines"])
    stopped = d.says("stopped", since, "server")
    if taken and stopped:
        c("SIGTERM only after it was out of the router", stopped[0]["t"] >= taken["t"], (taken["t"] - since, stopped[0]["t"] - since))
    ok = [r for r in results if r["ok"]]
    bad = [r for r in results if not r["ok"]]
    kinds: dict[str, int] = {}
    for r in bad:
        key = f"{r['status']}: {r['body'][:70]}"
        kinds[key] = kinds.get(key, 0) + 1
    m["requests"] = {"total": len(results), "ok": len(ok), "not_ok": len(bad), "not_ok_kinds": kinds}
    spanning = [r for r in results if r["t"] < since < r["end"]]
    m["in_flight_when_the_restart_began"] = {"n": len(spanning), "ok": sum(r["ok"] for r in spanning)}
    c("requests in flight when the restart began all completed (200)", all(r["ok"] for r in spanning), m["in_flight_when_the_restart_began"])
    # With the only worker out of the router, the router answers at once 503 no_available_workers:
    # a refusal, never accepted. Anything else that is not a 200 (no answer, a reset, a 502, an
    # error after it was proxied) is a request the router accepted and lost: a cut.
    refused = [r for r in bad if r["status"] == 503 and "no_available_workers" in r["body"]]
    cut = [r for r in bad if r not in refused]
    if stopped:  # requests the server itself had when it got SIGTERM (the router's refusals never reached it)
        t_term = stopped[0]["t"] - float(stopped[0]["f"].get("GPUSUP_DURATION_S", 0))
        at_term = [r for r in results if r["t"] < t_term < r["end"] and r not in refused]
        m["in_flight_at_sigterm"] = {"n": len(at_term), "ok": sum(r["ok"] for r in at_term)}
    m["refused_slowest_s"] = round(max((r["end"] - r["t"] for r in refused), default=0.0), 3)
    m["cut"] = cut[:10]
    c("no accepted request cut", not cut, {"cut": len(cut), "refused (503 no_available_workers)": len(refused), "ok": len(ok)})
    c("the router was not restarted", d.process("router").get("pid") == router_pid and alive(router_pid), router_pid)
    c("the server has a new PID", d.process("server").get("pid") not in (None, old_server), (old_server, d.process("server").get("pid")))


def s6_switch(run: Run, c: Check, m: dict[str, Any], d: Daemon) -> Daemon:
    """routed (router + server at 0.25) -> single (one server at 0.5 on the router's port), ordered, idle between."""
    rc, out, err = run.gpusupctl("switch", "single", "--dry-run")
    # Not a check: `switch` itself needs systemd; without it the new profile's daemon takes over
    # (what follows). The dry run's plan is recorded for the report.
    m["info_switch_dry_run"] = {"rc": rc, "plan": out[-2000:], "err": err[-500:]}
    routed_server_group = d.process("server").get("group", "")
    run.note_shm(group_pids(routed_server_group) + group_pids(d.process("router").get("group", "")))
    since = time.time()
    d2 = Daemon(run, "single", "g2-single")
    run.start_and_ready(d2, c, m, SINGLE_PORT)
    rc_old = d.proc.wait(60)
    m["routed_daemon_exit"] = rc_old
    c("the routed daemon stopped and exited 0", rc_old == 0, rc_old)
    r_stop = d.says("stopped", since, "router")
    s_stop = d.says("stopped", since, "server")
    m["stops"] = [(round(e["t"] - since, 2), e["msg"]) for e in sorted(r_stop + s_stop, key=lambda e: e["t"])]
    c("stopped in order: router, then server", bool(r_stop) and bool(s_stop) and r_stop[0]["t"] <= s_stop[0]["t"], m["stops"])
    trans = d2.find(lambda e: e["k"] == "say" and ("transition" in e["msg"] or "verified idle" in e["msg"]), since)
    m["transition_lines"] = [(round(e["t"] - since, 2), e["msg"][:300]) for e in trans]
    idle = next((e for e in trans if "verified idle" in e["msg"]), None)
    sp = d2.says("spawn", since, "server")
    c("GPUs verified idle and ports free before the new server was spawned", bool(idle) and bool(sp) and idle["t"] <= sp[0]["t"],
      m["transition_lines"][-2:])
    if s_stop and sp:
        # up to 3 s after the spawn: the new server holds nothing before its imports are done (15 s and more)
        win = run.gpu.window(s_stop[0]["t"] - 0.5, sp[0]["t"] + 3.0)
        low = min((u for _, u, _ in win), default=None)
        m["gpu_min_between_mib"] = low
        c("the GPU read idle between the two layouts (direct reading)", low is not None and low - run.baseline <= IDLE_TOLERANCE_MIB,
          {"min_used_mib": low, "baseline": run.baseline, "samples": len(win)})
    reason = d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] in ("stopping", "stopped"), since)
    m["routed_stop_reason"] = reason[-1]["msg"] if reason else None
    c("the old daemon says who took over", bool(reason) and "single" in reason[-1]["msg"], m["routed_stop_reason"])
    c("the old server's cgroup is empty", not group_pids(routed_server_group), routed_server_group)
    m["switch_s"] = round(time.time() - since, 1)
    used, nv = run.gpu.read()
    _main, sched, _pids, _g = run.server_pids(d2)
    m["single_gpu"] = {"used_mib": used, "holders": nv, "scheduler": sched}
    c("the single server holds the GPU (a larger layout)", sched in nv and used - run.baseline > 1000, m["single_gpu"])
    return d2


# ============================================================================ groups

def group1(run: Run) -> None:
    d = Daemon(run, "solo", "g1-solo")
    run.scenario("s1_start", "start to READY on the server through the daemon; phases against its log", run.args.start_estimate,
                 lambda c, m: s1_start(run, c, m, d))
    ready = bool(d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "ready"))
    if ready:
        run.scenario("s2_holders", "the scheduler PID as the GPU's holder, named ours", 15, lambda c, m: s2_holders(run, c, m, d))
        run.scenario("s3_pause", f"POST /pause_generation held {PAUSE_S:g} s: not killed; continue + /health: /ready 200", PAUSE_S + 20,
                     lambda c, m: s3_pause(run, c, m, d))
        run.scenario("s3_latch", "a third party's /health during a pause (latched or not): not killed", 40,
                     lambda c, m: s3_latch(run, c, m, d))
        run.scenario("s3_sigstop", f"SIGSTOPped main process killed within {LIVENESS_BOUND_S} s and restarted", run.args.start_estimate + 15,
                     lambda c, m: s3_sigstop(run, c, m, d))
        run.scenario("s5_crash", "kill -9 of sglang::scheduler; SIGTERM to the restart while it loads; reasons and restarts",
                     run.args.start_estimate + 10,
                     lambda c, m: s5_crash(run, c, m, d, "solo"))
    run.args.reserve = 0
    run.scenario("s2_idle", "stop: NVML idle, no process, /dev/shm and TMPDIR leftovers removed", 20,
                 lambda c, m: run.idle_after_stop(c, m, d, "solo", ["server"]))
    if d.proc.poll() is None:
        d.stop(60)


def group2(run: Run) -> None:
    d = Daemon(run, "routed", "g2-routed-term")
    holder: dict[str, Daemon] = {}

    def s5a(c: Check, m: dict[str, Any]) -> None:
        holder["routed"] = s5_sigterm_first_start(run, c, m, d)

    run.scenario("s5_sigterm_loading", "SIGTERM while the first start loads: reason, exit 1, started again", run.args.start_estimate + 60, s5a)
    routed = holder.get("routed")
    single: dict[str, Daemon] = {}
    if routed is not None:
        run.scenario("s4_router_restart", "restart one server behind the real router under a client loop: nothing cut",
                     run.args.start_estimate + 20,
                     lambda c, m: s4_router(run, c, m, routed))

        if run.args.also_crash:  # when group 1 had no time for it: the crash behind the router
            run.scenario("s5_crash_routed", "kill -9 of sglang::scheduler behind the router; reasons and restarts", run.args.start_estimate + 10,
                         lambda c, m: s5_crash(run, c, m, routed, "routed"))

        def s6(c: Check, m: dict[str, Any]) -> None:
            single["d"] = s6_switch(run, c, m, routed)

        run.scenario("s6_switch", "routed (router + server 0.25) -> single (server 0.5): ordered, idle between", run.args.start_estimate + 15, s6)
    if single.get("d") is not None:  # the latch by a scheduler stall, on a server no router checks
        run.scenario("s3_latch_stall", "/ready latched 503 by a /health failed in a scheduler stall, then answering: not killed", 40,
                     lambda c, m: s3_latch_stall(run, c, m, single["d"], SINGLE_PORT))
    last = single.get("d") or routed
    run.args.reserve = 0
    if last is not None:
        procs = ["server"] if last is single.get("d") else ["router", "server"]
        name = "single" if last is single.get("d") else "routed"
        run.scenario("s2_idle_g2", f"stop {name}: NVML idle, no process, leftovers removed", 20,
                     lambda c, m: run.idle_after_stop(c, m, last, name, procs))
    for x in (d, routed, single.get("d")):
        if x is not None and x.proc.poll() is None:
            x.stop(60)


def cmd_run(args: argparse.Namespace) -> int:
    run = Run(args)
    try:
        run.setup()
    except Exception as e:
        run.results["setup"]["error"] = traceback.format_exc()[-4000:]
        run.save()
        print(f"set-up failed: {e}\n{traceback.format_exc()}", flush=True)
        return 2
    print(f"set-up: {json.dumps({k: v for k, v in run.results['setup'].items() if k not in ('config', 'profiles')}, default=str)}", flush=True)
    try:
        if args.group in ("1", "all"):
            group1(run)
        if args.group in ("2", "all"):
            if args.group == "all":
                run.args.reserve = args.reserve_initial
            group2(run)
    finally:
        code = run.finish()
    return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=("real", "standin"), required=True)
    r.add_argument("--group", choices=("1", "2", "all"), default="all")
    r.add_argument("--out", required=True)
    r.add_argument("--start-estimate", type=float, default=110.0, help="seconds one server start may take (budget planning)")
    r.add_argument("--budget", type=float, default=575.0, help="seconds this run may take (the device allows 600 a command)")
    r.add_argument("--reserve", type=float, default=40.0, help="seconds kept for the final stop")
    r.add_argument("--code", choices=("tree", "head"), default="tree",
                   help="the supervisor to run: this working tree, or .sgl/code-HEAD.tar.xz (git archive HEAD)")
    r.add_argument("--also-crash", action="store_true", help="group 2: also s5_crash (on the routed instance)")
    r.add_argument("--only", type=lambda v: set(v.split(",")), default=set(),
                   help="run only these scenarios (comma-separated keys; s1_start always runs: the rest need its server)")
    r.add_argument("--sgl", default=str(SGL))
    r.add_argument("--unpack", default="/tmp/sgl", help="where the bundles, the model and the code are unpacked")
    r.add_argument("--work", default=None)
    r.add_argument("--python", default=None, help="the python of the daemon and SGLang (default: this one)")
    r.add_argument("--standin-startup", type=float, default=10.0, help="the stand-in's loading time (seconds)")
    r.add_argument("--router", choices=("auto", "real", "standin"), default="auto", help="stand-in mode: which router")
    d = sub.add_parser("daemon")
    d.add_argument("name")
    d.add_argument("--config-dir", required=True)
    d.add_argument("--events", required=True)
    d.add_argument("--control", required=True)
    d.add_argument("--rehearsal", action="store_true")
    args = ap.parse_args()
    if args.command == "daemon":
        return cmd_daemon(args)
    args.reserve_initial = args.reserve
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
