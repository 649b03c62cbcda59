"""How soon after a holder's SIGKILL does NvmlInventory say "idle", and what does a snapshot cost?

On the device machine (a real GPU, torch, nvidia-ml-py):

    python3 bench/gpu_nvml_idle.py --out $OUT/nvml-idle-h200.json

For each size (default 10 and 100 GiB), `--repeats` times: a child allocates that much with
torch on NVML's GPU 0 and is SIGKILLed; we poll `snapshot([0])` every `--poll-ms` and record
the time from the signal to the reap (wait() returning) and to the idle verdict. Then the same
kill, timed through wait_until_clear (the supervisor's own path, default 5 ms polls). Also the
cost of one snapshot (one GPU, all GPUs; idle and while held) and the GPU's idle baselines
(memory info v1 `used` and v2 used/reserved).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import machine, summary  # noqa: E402

from supervisord_gpu.checks.gpus import MIB, NvmlInventory  # noqa: E402
from supervisord_gpu.checks.preconditions import Requirement, wait_until_clear  # noqa: E402

HOG = """\
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("holding", flush=True)
time.sleep(600)
"""


def start_hog(uuid: str, gib: float) -> subprocess.Popen[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
    proc = subprocess.Popen([sys.executable, "-c", HOG, str(gib)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    if proc.stdout.readline() != "holding\n":
        proc.kill()
        raise SystemExit(f"the torch holder of {gib} GiB did not start (exit {proc.wait()})")
    return proc


def per_call_us(fn: Callable[[], Any], n: int = 2000) -> dict[str, float]:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return summary(samples)


def wait_idle(inv: NvmlInventory, index: int, poll_s: float, limit_s: float = 10.0) -> tuple[float, int]:
    """Poll until idle; (seconds waited, snapshots taken)."""
    began, polls = time.perf_counter(), 0
    while True:
        polls += 1
        if inv.snapshot([index])[0].idle:
            return time.perf_counter() - began, polls
        if time.perf_counter() - began > limit_s:
            raise SystemExit(f"GPU {index} not idle {limit_s} s after the kill")
        time.sleep(poll_s)


def one_kill(inv: NvmlInventory, uuid: str, gib: float, poll_s: float) -> dict[str, Any]:
    proc = start_hog(uuid, gib)
    (held,) = inv.snapshot([0])
    assert not held.idle and proc.pid in [p.pid for p in held.processes], held
    t_kill = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    reaped = None
    began, polls = time.perf_counter(), 0
    while True:  # reap and poll in one loop, so both times come from the same clock
        polls += 1
        if reaped is None and proc.poll() is not None:
            reaped = time.perf_counter() - t_kill
        if inv.snapshot([0])[0].idle:
            idle = time.perf_counter() - t_kill
            break
        if time.perf_counter() - began > 10:
            raise SystemExit("GPU 0 not idle 10 s after the kill")
        time.sleep(poll_s)
    if reaped is None:
        proc.wait()
        reaped = time.perf_counter() - t_kill
    return {"gib": gib, "held_mib": held.in_use_mib, "pid_listed_mib": held.processes[0].used_mib,
            "kill_to_reaped_s": reaped, "kill_to_idle_s": idle, "polls": polls}


def one_wait_until_clear(inv: NvmlInventory, uuid: str, gib: float) -> float:
    proc = start_hog(uuid, gib)

    async def run() -> float:
        waiting = asyncio.create_task(wait_until_clear(Requirement(frozenset({0})), inv, 30))
        await asyncio.sleep(0.05)
        t = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        await waiting
        return time.perf_counter() - t

    took = asyncio.run(run())
    proc.wait()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "nvml-idle-h200.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes-gib", default="10,100")
    ap.add_argument("--poll-ms", type=float, default=2.0)
    args = ap.parse_args()

    import pynvml

    inv = NvmlInventory()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    (idle,) = inv.snapshot([0])
    if not idle.idle:
        raise SystemExit(f"GPU 0 is not idle to begin with: {idle}")
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        v2_info: dict[str, Any] | None = {"used_mib": v2.used // MIB, "reserved_mib": v2.reserved // MIB,
                                          "total_mib": v2.total // MIB}
    except pynvml.NVMLError as e:
        v2_info = {"error": str(e)}
    result: dict[str, Any] = {
        "device": {
            "name": idle.name,
            "uuid": idle.uuid,
            "count": inv.count(),
            "driver": str(pynvml.nvmlSystemGetDriverVersion()),
            "nvml": str(pynvml.nvmlSystemGetNVMLVersion()),
            "memory_v2_supported": inv.memory_v2_supported(0),
            "pids_local": inv.pids_local,
        },
        "idle_baseline": {"v1_used_mib": v1.used // MIB, "v1_total_mib": v1.total // MIB, "v2": v2_info,
                          "inventory_baseline_mib": idle.baseline_mib, "tolerance_mib": inv.tolerance_mib},
        "poll_ms": args.poll_ms,
    }
    cost = {
        "snapshot_gpu0_idle_us": per_call_us(lambda: inv.snapshot([0])),
        "snapshot_all_idle_us": per_call_us(inv.snapshot),
        "nvmlDeviceGetMemoryInfo_v1_us": per_call_us(lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
        "nvmlDeviceGetComputeRunningProcesses_us": per_call_us(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
    }
    hog = start_hog(idle.uuid, 10)
    cost["snapshot_gpu0_held_us"] = per_call_us(lambda: inv.snapshot([0]))
    hog.kill()
    hog.wait()
    wait_idle(inv, 0, 0.002)
    result["snapshot_cost"] = cost

    kills: dict[str, Any] = {}
    for gib in [float(x) for x in args.sizes_gib.split(",")]:
        runs = [one_kill(inv, idle.uuid, gib, args.poll_ms / 1000) for _ in range(args.repeats)]
        kills[f"{gib:g}GiB"] = {
            "runs": runs,
            "kill_to_idle_s": summary([r["kill_to_idle_s"] for r in runs]),
            "kill_to_reaped_s": summary([r["kill_to_reaped_s"] for r in runs]),
        }
        print(f"{gib:g} GiB: kill -> idle median {kills[f'{gib:g}GiB']['kill_to_idle_s']['median'] * 1000:.0f} ms", flush=True)
    result["sigkill_to_idle"] = kills
    waits = [one_wait_until_clear(inv, idle.uuid, 10) for _ in range(args.repeats)]
    result["wait_until_clear_10GiB_s"] = {"poll_ms": 5.0, **summary(waits), "samples": waits}
    inv.close()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), **result}, indent=2, default=str) + "\n")
    print(json.dumps(result["snapshot_cost"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
