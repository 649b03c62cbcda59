"""How much time the supervisor itself adds at the two ends of a run.

Ready detection, on one stand-in server (STARTUP_S start-up; it writes the moment it could
first answer /health 200 itself):
  * supervisord-gpu: the real daemon (`supervisord-gpu run --rehearsal`, cgroupfs driver) with
    NOTIFY_SOCKET pointing at a datagram socket this benchmark listens on: first 200 -> READY=1;
  * the systemd-style `until curl -sf URL/health; do sleep 5; done` loop (ExecStartPost);
  * supervisord 4.x `startsecs`: it calls a program RUNNING once it has stayed up that long,
    whatever the server says. With the default (1 s) that is *before* the server can answer
    (a negative delay: a false "ready"); tuned to start-up x 1.5 (what an operator who measured
    the start would set; SGLang's 90 s becomes 135 s) it is late by the margin.
Stop detection (engine in-process, same stand-in): last process reaped -> "instance stopped",
against `kill PIDS; sleep 3;` then polling the GPU memory every second until idle.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

from common import kill_holders, summary, table, terminate, write

from support import CgroupSandbox, Recorder, free_ports, make_instance, write_config
from supervisord_gpu.checks.simgpu import SimulatedGpus

RUNS = int(os.environ.get("BENCH_RUNS", "5"))
STARTUP_S = 3.0
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def one_server(port: int, ready_file: Path) -> str:
    return f"""
        [servers.server]
        gpus = [0]
        port = {port}
        model_path = "/m"
        [servers.server.probe]
        interval = 0.5
        [servers.server.env]
        SUPERVISORD_GPU_STANDIN_READY_AT_FILE = "{ready_file}"
        """


def first_200(ready_file: Path) -> float:
    return min(float(x) for x in ready_file.read_text().split())


class NotifyListener:
    """A NOTIFY_SOCKET of our own: records the wall time each READY=1 datagram arrives."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.ready_at: float | None = None
        self.messages: list[str] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096).decode(errors="replace")
            except OSError:
                return
            now = time.time()
            self.messages.append(data)
            if "READY=1" in data.split("\n") and self.ready_at is None:
                self.ready_at = now

    def close(self) -> None:
        self.sock.close()


def daemon_ready_run(tmp: Path, sandbox: CgroupSandbox) -> float:
    """The real daemon: stand-in's first 200 -> READY=1 on our NOTIFY_SOCKET."""
    ready_file = tmp / "ready-times"
    cdir = write_config(tmp, {"one": one_server(free_ports(1)[0], ready_file)}, sandbox.root, startup=STARTUP_S)
    listener = NotifyListener(tmp / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": listener.path, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}
    log = open(tmp / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", "one", "--config-dir",
                               str(cdir), "--rehearsal", "--stderr"], env=env, stdout=log, stderr=subprocess.STDOUT,
                              cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while listener.ready_at is None:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no READY=1 (rc={daemon.poll()}):\n{(tmp / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.01)
        return listener.ready_at - first_200(ready_file)
    finally:
        terminate(daemon)
        log.close()
        listener.close()


def engine_stop_run(tmp: Path, sandbox: CgroupSandbox) -> float:
    """The engine in-process: last process reaped -> instance stopped."""
    cdir = write_config(tmp, {"one": one_server(free_ports(1)[0], tmp / "ready-times")}, sandbox.root, startup=0.5)
    instance, _ = make_instance(cdir, "one", Recorder())

    async def go() -> float:
        await instance.start()
        await instance.stop()
        stopped = time.monotonic()
        exited = max(p.exited_at for p in instance.processes.values() if p.exited_at)
        return stopped - exited

    return asyncio.run(go())


def standin_env(sim: SimulatedGpus, ready_file: Path, startup: float) -> dict[str, str]:
    return {"SUPERVISORD_GPU_SIMGPU_DIR": str(sim.directory), "SUPERVISORD_GPU_STANDIN_STARTUP_S": str(startup),
            "SUPERVISORD_GPU_STANDIN_READY_AT_FILE": str(ready_file), "CUDA_VISIBLE_DEVICES": "0",
            "SUPERVISORD_GPU_STANDIN_MIB": "1000"}


STANDIN = [sys.executable, "-m", "supervisord_gpu.rehearsal.standin_server", "--model-path", "/m", "--port"]


def manual_run(tmp: Path) -> tuple[float, float]:
    """The hand procedure on the same stand-in: start it, curl-loop, kill, sleep 3, poll memory."""
    port = free_ports(1)[0]
    sim = SimulatedGpus.create(tmp / "simgpu-manual", 8)
    ready_file = tmp / "manual-ready"
    env = {**os.environ, **standin_env(sim, ready_file, STARTUP_S)}
    proc = subprocess.Popen(STANDIN + [str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:  # until curl -sf http://127.0.0.1:PORT/health; do sleep 5; done
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(5)
    detected = time.time()
    ready_delay = detected - first_200(ready_file)
    os.kill(proc.pid, signal.SIGTERM)  # kill $PID
    proc.wait()
    exited = time.monotonic()
    time.sleep(3)  # sleep 3
    while any(0 in h.gpus for h in sim.holders()):  # poll nvidia-smi every second until idle
        time.sleep(1)
    return ready_delay, time.monotonic() - exited


def supervisord_run(tmp: Path, startsecs: int) -> float:
    """supervisord 4.x with `startsecs`: the stand-in's first 200 -> the RUNNING line in its log."""
    port = free_ports(1)[0]
    sim = SimulatedGpus.create(tmp / "simgpu-supervisord", 8)
    ready_file = tmp / "supervisord-ready"
    sock, logfile = tmp / "supervisor.sock", tmp / "supervisord.log"
    env = ",".join(f'{k}="{v}"' for k, v in standin_env(sim, ready_file, STARTUP_S).items())
    (tmp / "supervisord.conf").write_text(textwrap.dedent(f"""
        [unix_http_server]
        file = {sock}
        [supervisord]
        logfile = {logfile}
        pidfile = {tmp / 'supervisord.pid'}
        nodaemon = true
        [program:server]
        command = {' '.join(STANDIN)} {port}
        directory = {REPO}
        environment = {env}
        startsecs = {startsecs}
        autorestart = false
        stopasgroup = true
        killasgroup = true
        stdout_logfile = {tmp / 'server.log'}
        redirect_stderr = true
        """))
    daemon = subprocess.Popen([str(BIN / "supervisord"), "-c", str(tmp / "supervisord.conf"), "-n"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
    try:
        deadline = time.monotonic() + 60
        running_at = None
        while running_at is None or not ready_file.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"supervisord never said RUNNING:\n{logfile.read_text()[-2000:]}")
            if running_at is None and logfile.exists():
                running_at = running_time(logfile.read_text())
            time.sleep(0.01)
        return running_at - first_200(ready_file)
    finally:
        terminate(daemon)
        kill_holders(sim)


def running_time(log: str) -> float | None:
    """`2026-11-30 21:10:01,234 INFO success: server entered RUNNING state` -> wall time (local, ms)."""
    for line in log.splitlines():
        if "entered RUNNING state" in line:
            stamp, ms = line[:23].split(",")
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    return None


def main() -> dict[str, object]:
    sandbox = CgroupSandbox()
    tuned = math.ceil(STARTUP_S * 1.5)
    ready: dict[str, list[float]] = {"supervisord_gpu_ready_1": [], "curl_loop_sleep_5": [],
                                     "supervisord_startsecs_1_default": [], f"supervisord_startsecs_{tuned}": []}
    sup_stop: list[float] = []
    man_stop: list[float] = []
    try:
        for _ in range(RUNS):
            with tempfile.TemporaryDirectory() as d:
                ready["supervisord_gpu_ready_1"].append(daemon_ready_run(Path(d), sandbox))
            with tempfile.TemporaryDirectory() as d:
                sup_stop.append(engine_stop_run(Path(d), sandbox))
        for _ in range(max(2, RUNS // 2)):
            with tempfile.TemporaryDirectory() as d:
                r, s = manual_run(Path(d))
                ready["curl_loop_sleep_5"].append(r)
                man_stop.append(s)
            with tempfile.TemporaryDirectory() as d:
                ready["supervisord_startsecs_1_default"].append(supervisord_run(Path(d), 1))
            with tempfile.TemporaryDirectory() as d:
                ready[f"supervisord_startsecs_{tuned}"].append(supervisord_run(Path(d), tuned))
    finally:
        sandbox.destroy()
    ours = summary(ready["supervisord_gpu_ready_1"])["median"]
    result: dict[str, object] = {
        "what": f"one stand-in server ({STARTUP_S:g} s start-up); the daemon in rehearsal, cgroupfs driver",
        "ready_detection_s": {k: summary(v) for k, v in ready.items()},
        "ready_detection_note": "first /health 200 -> the supervisor says ready (READY=1 on NOTIFY_SOCKET; curl "
                                "loop exits; supervisord logs RUNNING). Negative: said ready before the server "
                                "could answer a request.",
        "stop_detection_s": {"supervisord_gpu": summary(sup_stop), "manual_kill_sleep_3_poll": summary(man_stop)},
    }
    ratios = {f"ready_vs_{k}": summary(v)["median"] / max(1e-6, ours) for k, v in ready.items()
              if k != "supervisord_gpu_ready_1" and summary(v)["median"] > 0}
    ratios["stop"] = summary(man_stop)["median"] / max(1e-6, summary(sup_stop)["median"])
    result["ratios"] = ratios
    path = write("engine-latency", result)
    rows = [("measure", "median", "ratio to supervisord-gpu")]
    for k, v in ready.items():
        m = summary(v)["median"]
        verdict = (f"{m / ours:.0f}x" if m > 0 and k != "supervisord_gpu_ready_1" else
                   "-" if k == "supervisord_gpu_ready_1" else "said ready before the server could answer")
        rows.append((f"first 200 -> ready: {k}", f"{m * 1000:+.1f} ms", verdict))
    rows.append(("last exit -> stopped: supervisord-gpu", f"{summary(sup_stop)['median'] * 1000:.1f} ms", "-"))
    rows.append(("last exit -> idle: kill; sleep 3; poll", f"{summary(man_stop)['median'] * 1000:.0f} ms",
                 f"{ratios['stop']:.0f}x"))
    print(table(rows))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
