"""Issue 2's benchmark: how much time the supervisor itself adds at the two ends of a run.

For a rehearsal of a PD profile (stand-ins, the real sglang-router, cgroupfs driver):
  * ready detection: from the moment the server could first answer /health 200 (the
    stand-in writes that time itself) to "instance ready";
  * stop detection: from the moment the last process was reaped to "instance stopped".
Against the procedure operators ran by hand, scripted faithfully: wait with
`until curl -sf URL/health; do sleep 5; done`, and stop with `kill PIDS; sleep 3;` then poll
the GPU memory every second until idle.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import summary, table, write

from support import CgroupSandbox, Recorder, free_ports, make_instance, pd_profile, write_config
from supervisord_gpu.checks.simgpu import SimulatedGpus

RUNS = int(os.environ.get("BENCH_RUNS", "5"))


def supervisor_run(tmp: Path, sandbox: CgroupSandbox) -> tuple[float, float]:
    ready_file = tmp / "ready-times"
    ports = free_ports(1)
    # a single server profile isolates detection from the router's own start-up
    text = f"""
        [servers.server]
        gpus = [0]
        port = {ports[0]}
        model_path = "/m"
        [servers.server.probe]
        interval = 0.5
        [servers.server.env]
        SUPERVISORD_GPU_STANDIN_READY_AT_FILE = "{ready_file}"
        """
    cdir = write_config(tmp, {"one": text}, sandbox.root, startup=1.0)
    rec = Recorder()
    instance, _ = make_instance(cdir, "one", rec)

    async def go() -> tuple[float, float]:
        await instance.start()
        ready_wall = next(e.at for e in rec.events if e.kind == "instance" and e.state == "ready")
        first_200 = max(float(x) for x in ready_file.read_text().split())
        await instance.stop()
        exited = max(p.exited_at for p in instance.processes.values() if p.exited_at)
        stopped = time.monotonic()
        return ready_wall - first_200, stopped - exited

    return asyncio.run(go())


def manual_run(tmp: Path) -> tuple[float, float]:
    """The hand procedure on the same stand-in: start it, curl-loop, kill, sleep 3, poll memory."""
    port = free_ports(1)[0]
    sim = SimulatedGpus.create(tmp / "simgpu-manual", 8)
    ready_file = tmp / "manual-ready"
    env = {**os.environ, "SUPERVISORD_GPU_SIMGPU_DIR": str(sim.directory), "SUPERVISORD_GPU_STANDIN_STARTUP_S": "1.0",
           "SUPERVISORD_GPU_STANDIN_READY_AT_FILE": str(ready_file), "CUDA_VISIBLE_DEVICES": "0",
           "SUPERVISORD_GPU_STANDIN_MIB": "1000"}
    proc = subprocess.Popen([sys.executable, "-m", "supervisord_gpu.rehearsal.standin_server", "--model-path", "/m",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:  # until curl -sf http://127.0.0.1:PORT/health; do sleep 5; done
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(5)
    detected = time.time()
    ready_delay = detected - float(ready_file.read_text().split()[0])
    os.kill(proc.pid, signal.SIGTERM)  # kill $PID
    proc.wait()
    exited = time.monotonic()
    time.sleep(3)  # sleep 3
    while any(0 in h.gpus for h in sim.holders()):  # poll nvidia-smi every second until idle
        time.sleep(1)
    return ready_delay, time.monotonic() - exited


def main() -> dict[str, object]:
    sandbox = CgroupSandbox()
    sup_ready, sup_stop, man_ready, man_stop = [], [], [], []
    try:
        for _ in range(RUNS):
            with tempfile.TemporaryDirectory() as d:
                r, s = supervisor_run(Path(d), sandbox)
                sup_ready.append(r)
                sup_stop.append(s)
        for _ in range(max(2, RUNS // 2)):
            with tempfile.TemporaryDirectory() as d:
                r, s = manual_run(Path(d))
                man_ready.append(r)
                man_stop.append(s)
    finally:
        sandbox.destroy()
    result = {
        "what": "rehearsal, one stand-in server (1 s start-up), cgroupfs driver",
        "ready_detection_s": {"supervisord_gpu": summary(sup_ready), "manual_curl_loop_sleep_5": summary(man_ready)},
        "stop_detection_s": {"supervisord_gpu": summary(sup_stop), "manual_kill_sleep_3_poll": summary(man_stop)},
    }
    result["ratios"] = {
        "ready": result["ready_detection_s"]["manual_curl_loop_sleep_5"]["median"] / max(1e-6, result["ready_detection_s"]["supervisord_gpu"]["median"]),
        "stop": result["stop_detection_s"]["manual_kill_sleep_3_poll"]["median"] / max(1e-6, result["stop_detection_s"]["supervisord_gpu"]["median"]),
    }
    path = write("engine-latency", result)
    rows = [("measure", "supervisord-gpu (median)", "manual (median)", "ratio")]
    for key, sup, man, ratio in (
        ("last /health 200 -> ready", "ready_detection_s", "ready_detection_s", "ready"),
        ("last exit -> stopped", "stop_detection_s", "stop_detection_s", "stop"),
    ):
        s = result[sup]["supervisord_gpu"]["median"]  # type: ignore[index]
        m = list(result[man].values())[1]["median"]  # type: ignore[union-attr]
        rows.append((key, f"{s * 1000:.1f} ms", f"{m * 1000:.0f} ms", f"{result['ratios'][ratio]:.0f}x"))  # type: ignore[index]
    print(table(rows))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
