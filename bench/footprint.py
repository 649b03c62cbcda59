"""The daemon's own footprint: RSS and CPU while idle and ready, and under a log flood.

Idle: the real daemon (`python -m supervisord_gpu.cli.daemon run NAME --rehearsal --stderr`,
no D-Bus, cgroupfs driver in a throw-away cgroup) runs a profile of 8 stand-in servers (one
simulated GPU each) and the real sglang-router in regular mode: 9 processes. Once it says
"instance ready", the daemon process alone (not its children) is sampled every second for
FOOTPRINT_IDLE_S seconds (default 60; the issue asks for 600 — set FOOTPRINT_IDLE_S=600):
RSS and CPU% (from its CPU times over the window, in % of one core).

Flood: a non-rehearsal daemon config (`[gpus] backend = "simulated"`, `[sglang]
server_command` = tests/flood_child.py) runs one "server" that answers /health 200 at once
and then prints FLOOD_RATE (default 50,000) numbered lines per second ("seq=N") for FLOOD_S
seconds (default 10). The daemon forwards each line to its stderr as "server| seq=N"; the
captured stderr is checked for every number (lines lost must be 0). Reported: lines/s the
child achieved (it blocks when the daemon does not read: back-pressure, not loss), the
daemon's CPU% and RSS during the flood, how long after the child's last line the daemon had
forwarded it (catch-up lag), and SIGTERM -> daemon exit after the flood (responsive: < 2 s).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from common import table, terminate, write

from support import CgroupSandbox, flood_config, free_ports, write_config

IDLE_S = float(os.environ.get("FOOTPRINT_IDLE_S", "60"))
FLOOD_S = float(os.environ.get("FLOOD_S", "10"))
FLOOD_RATE = int(os.environ.get("FLOOD_RATE", "50000"))
DAEMON_ENV = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent", "PYTHONUNBUFFERED": "1"}
MIB = 1024 * 1024


class Daemon:
    def __init__(self, name: str, cdir: Path, log: Path, rehearsal: bool, env: dict[str, str]) -> None:
        self.log_path = log
        self.log = open(log, "wb")
        argv = [sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", name, "--config-dir", str(cdir), "--stderr"]
        if rehearsal:
            argv.append("--rehearsal")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=str(Path(__file__).resolve().parent.parent))
        self.ps = psutil.Process(self.proc.pid)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return time.monotonic()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not log {needle!r} (rc={self.proc.poll()}):\n{self.text()[-3000:]}")

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / MIB

    def stop(self, timeout: float = 30) -> float:
        """SIGTERM -> exit, seconds."""
        began = time.monotonic()
        terminate(self.proc, timeout)
        took = time.monotonic() - began
        self.log.close()
        return took


def sample(d: Daemon, seconds: float, every: float = 1.0, until=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Sample for `seconds`, or until until() is true (checked every 50 ms), whichever first."""
    rss: list[float] = []
    c0, t0 = d.cpu_s(), time.monotonic()
    next_rss = t0
    while time.monotonic() - t0 < seconds:
        if time.monotonic() >= next_rss:
            rss.append(d.rss_mib())
            next_rss += every
        if until is not None and until():
            break
        time.sleep(0.05 if until is not None else every)
    c1, t1 = d.cpu_s(), time.monotonic()
    rss.append(d.rss_mib())
    return {
        "seconds": t1 - t0,
        "cpu_percent_of_one_core": 100 * (c1 - c0) / (t1 - t0),
        "cpu_seconds": c1 - c0,
        "rss_mib_median": statistics.median(rss),
        "rss_mib_max": max(rss),
        "rss_mib_first": rss[0],
        "rss_mib_last": rss[-1],
        "threads": d.ps.num_threads(),
    }


def idle_case(tmp: Path, sandbox: CgroupSandbox) -> dict[str, object]:
    ports = free_ports(10)
    servers = "".join(f"""
[servers.s{i}]
gpus = [{i}]
port = {ports[i]}
model_path = "/m"
""" for i in range(8))
    text = servers + f"""
[router]
mode = "regular"
port = {ports[8]}
[router.options]
prometheus-host = "127.0.0.1"
prometheus-port = {ports[9]}
"""
    cdir = write_config(tmp, {"footprint": text}, sandbox.root, startup=0.5)
    d = Daemon("footprint", cdir, tmp / "daemon.log", rehearsal=True, env=DAEMON_ENV)
    try:
        t0 = time.monotonic()
        ready = d.wait_for("instance ready in", 60)
        children = len(d.ps.children(recursive=True))
        stats = sample(d, IDLE_S)
        log_lines = d.text().count("\n")
    finally:
        stop_s = d.stop()
    return {"processes": 9, "gpus": 8, "ready_after_s": ready - t0, "descendants_at_ready": children,
            "idle": stats, "daemon_log_lines_total": log_lines, "sigterm_to_exit_s": stop_s}


def flood_case(tmp: Path, sandbox: CgroupSandbox) -> dict[str, object]:
    cdir = flood_config(tmp, sandbox.root, free_ports(1)[0], FLOOD_S, FLOOD_RATE)
    d = Daemon("flood", cdir, tmp / "daemon.log", rehearsal=False, env=DAEMON_ENV)
    try:
        d.wait_for("instance ready in", 60)
        found: list[tuple[re.Match[str], float]] = []
        reader = open(d.log_path, "rb")
        tail = [b""]

        def done() -> bool:  # reads only what is new, so watching costs little CPU next to the daemon
            chunk = tail[0] + reader.read()
            m = re.search(rb"flood done total=(\d+) seconds=([\d.]+) at=([\d.]+)", chunk)
            if m:
                found.append((m, time.time()))
            tail[0] = chunk[-200:]
            return bool(m) or d.proc.poll() is not None

        stats = sample(d, FLOOD_S + 120, every=0.5, until=done)
        if not found:
            raise RuntimeError(f"the flood's last line never reached the daemon's log:\n{d.text()[-3000:]}")
        m, seen_at = found[0]
        reader.close()
    finally:
        stop_s = d.stop()
    text = d.text()
    total, child_seconds = int(m.group(1)), float(m.group(2))
    lag = seen_at - float(m.group(3))
    seen = {int(x) for x in re.findall(r"^server\| seq=(\d+)$", text, re.M)}
    lost = len(set(range(total)) - seen)
    return {
        "rate_asked_lines_per_s": FLOOD_RATE,
        "flood_s_asked": FLOOD_S,
        "lines_written": total,
        "child_write_seconds": child_seconds,
        "lines_per_s_achieved": total / child_seconds,
        "lines_forwarded": len(seen),
        "lines_lost": lost,
        "forwarding_lag_at_end_s": lag,
        "during_flood": stats,
        "sigterm_to_exit_after_flood_s": stop_s,
        "responsive": stop_s < 2.0,
    }


def main() -> dict[str, object]:
    sandbox = CgroupSandbox()
    try:
        with tempfile.TemporaryDirectory() as d:
            idle = idle_case(Path(d), sandbox)
        with tempfile.TemporaryDirectory() as d:
            flood = flood_case(Path(d), sandbox)
    finally:
        sandbox.destroy()
    result = {
        "what": "the real daemon (rehearsal: 8 stand-in servers + the real sglang-router, regular mode; cgroupfs driver, "
                "no D-Bus); the daemon process alone. Flood: one flood_child.py server, non-rehearsal config, "
                "simulated GPUs",
        "idle_window_note": f"sampled {IDLE_S:g} s after ready (the issue asks 600 s: FOOTPRINT_IDLE_S=600)",
        "idle": idle,
        "flood": flood,
    }
    path = write("footprint", result)
    i, f = idle["idle"], flood["during_flood"]  # type: ignore[index]
    rows = [("case", "window", "RSS median (max)", "CPU % of a core", "other")]
    rows.append(("idle, ready, 9 processes / 8 GPUs", f"{i['seconds']:.0f} s",  # type: ignore[index]
                 f"{i['rss_mib_median']:.1f} ({i['rss_mib_max']:.1f}) MiB", f"{i['cpu_percent_of_one_core']:.2f} %",  # type: ignore[index]
                 f"{i['threads']} threads; SIGTERM->exit {idle['sigterm_to_exit_s']:.2f} s"))  # type: ignore[index]
    rows.append((f"log flood {FLOOD_RATE}/s asked", f"{f['seconds']:.0f} s",  # type: ignore[index]
                 f"{f['rss_mib_median']:.1f} ({f['rss_mib_max']:.1f}) MiB", f"{f['cpu_percent_of_one_core']:.1f} %",  # type: ignore[index]
                 f"{flood['lines_per_s_achieved']:.0f} lines/s, {flood['lines_written']} written, "
                 f"{flood['lines_lost']} lost; lag at end {flood['forwarding_lag_at_end_s']:.2f} s; SIGTERM->exit {flood['sigterm_to_exit_after_flood_s']:.2f} s"))
    print(table(rows))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
