"""Issue: 1, 8, 32, 64 processes in one profile — start and stop overhead per process; must stay linear.

For N stand-in servers (regular role, one simulated GPU each, 0.5 s start-up, no router) in one
profile, started and stopped by the engine (cgroupfs driver, a throw-away cgroup):
  * start overhead: "instance ready" minus the moment the last stand-in became able to answer
    /health 200 (each writes that time itself, SUPERVISORD_GPU_STANDIN_READY_AT_FILE): what the
    supervisor adds after the servers' own start-up;
  * stop overhead: the instance stop total minus the time the processes themselves took to
    die (for each process, from its "stopping" event to its main process being reaped,
    ManagedProcess.exited_at); stops run one after another in the stop order, so the dying
    times add up.
Both are also divided by N. "Linear" means the per-process figures stay flat as N grows.

SCALE_SIZES (default "1,8,32,64") and SCALE_RUNS (default 3; 64 runs at most 2) lengthen it.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from common import covered, summary, table, write

from support import CgroupSandbox, Recorder, free_ports, make_instance, write_config

SIZES = [int(x) for x in os.environ.get("SCALE_SIZES", "1,8,32,64").split(",")]
RUNS = int(os.environ.get("SCALE_RUNS", "3"))
STARTUP_S = 0.5


def runs_for(n: int) -> int:
    return RUNS if n < 64 else min(RUNS, 2)


def profile_text(n: int, ports: list[int], tmp: Path) -> str:
    parts = []
    for i in range(n):
        parts.append(f"""
[servers.s{i}]
gpus = [{i}]
port = {ports[i]}
model_path = "/m"
stop_timeout = 10
[servers.s{i}.env]
SUPERVISORD_GPU_STANDIN_READY_AT_FILE = "{tmp / f'ready-at-{i}'}"
""")
    return "\n".join(parts)


def one_run(n: int, tmp: Path, sandbox: CgroupSandbox) -> dict[str, float]:
    ports = free_ports(n)
    cdir = write_config(tmp, {"scale": profile_text(n, ports, tmp)}, sandbox.root, startup=STARTUP_S, gpu_count=max(n, 8))
    rec = Recorder()
    instance, _ = make_instance(cdir, "scale", rec)
    if hasattr(instance.sink, "quiet_children"):
        instance.sink.quiet_children = True  # 64 stand-ins' logs on our terminal would only slow the run

    async def go() -> dict[str, float]:
        offset = time.time() - time.monotonic()  # monotonic -> wall
        t0 = time.time()
        await instance.start()
        ready_wall = next(e.at for e in rec.events if e.kind == "instance" and e.state == "ready")
        ready_ats = [float((tmp / f"ready-at-{i}").read_text().split()[0]) for i in range(n)]
        last_ready = max(ready_ats)
        s0 = time.time()
        took = await instance.stop()
        stop_total = time.time() - s0
        spans = []  # one stop wave: the N servers die side by side, so their dying times overlap
        per_proc_overhead = []
        for name, proc in instance.processes.items():
            stopping = [e.at for e in rec.events if e.kind == "process" and e.process == name and e.state == "stopping"]
            assert stopping and proc.exited_at is not None and proc.last_stop_s is not None, name
            spans.append((stopping[-1], proc.exited_at + offset))
            per_proc_overhead.append(proc.last_stop_s - (proc.exited_at + offset - stopping[-1]))
        dying = covered(spans)
        return {
            "start_total_s": ready_wall - t0,
            "last_standin_ready_after_s": last_ready - t0,
            "start_overhead_s": ready_wall - last_ready,
            "stop_total_s": stop_total,
            "stop_engine_reported_s": took,
            "stop_processes_dying_s": dying,
            "stop_overhead_s": stop_total - dying,
            "stop_overhead_max_single_process_s": max(per_proc_overhead),
        }

    return asyncio.run(go())


def main() -> dict[str, object]:
    sandbox = CgroupSandbox()
    results: dict[str, object] = {}
    try:
        for n in SIZES:
            samples: dict[str, list[float]] = {}
            for _ in range(runs_for(n)):
                with tempfile.TemporaryDirectory() as d:
                    for k, v in one_run(n, Path(d), sandbox).items():
                        samples.setdefault(k, []).append(v)
            entry = {k: summary(v) for k, v in samples.items()}
            entry["start_overhead_per_process_s"] = entry["start_overhead_s"]["median"] / n  # type: ignore[assignment]
            entry["stop_overhead_per_process_s"] = entry["stop_overhead_s"]["median"] / n  # type: ignore[assignment]
            entry["stop_total_per_process_s"] = entry["stop_total_s"]["median"] / n  # type: ignore[assignment]
            results[str(n)] = entry
    finally:
        sandbox.destroy()
    base_n = str(SIZES[0])
    result = {
        "what": f"rehearsal, N stand-in servers (regular, 1 simulated GPU each, {STARTUP_S} s start-up, no router), "
                "engine with the cgroupfs driver; medians",
        "sizes": results,
        "linearity": {
            n: {
                "stop_overhead_per_process_vs_smallest": results[n]["stop_overhead_per_process_s"]  # type: ignore[index]
                / max(1e-9, results[base_n]["stop_overhead_per_process_s"]),  # type: ignore[index]
            }
            for n in results
        },
    }
    path = write("scale", result)
    rows = [("N", "runs", "start total", "start overhead (min-max)", "  /process", "stop total", "stop overhead",
             "  /process", "processes dying")]
    for n, e in results.items():
        e = dict(e)  # type: ignore[arg-type]
        rows.append((
            n, str(e["start_total_s"]["n"]),
            f"{e['start_total_s']['median']:.2f} s",
            f"{e['start_overhead_s']['median'] * 1000:.1f} ms ({e['start_overhead_s']['min'] * 1000:.1f}-"
            f"{e['start_overhead_s']['max'] * 1000:.1f})",
            f"{e['start_overhead_per_process_s'] * 1000:.2f} ms",
            f"{e['stop_total_s']['median']:.3f} s",
            f"{e['stop_overhead_s']['median'] * 1000:.1f} ms",
            f"{e['stop_overhead_per_process_s'] * 1000:.2f} ms",
            f"{e['stop_processes_dying_s']['median']:.3f} s",
        ))
    print(table(rows))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
