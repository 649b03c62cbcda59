"""On the GPU machine: PD -> TP transition with torch stand-ins holding real GPU memory (issue 12),
the cgroupfs driver's stop-to-NVML-idle time against a hand kill (issue 3), on real NVML.

No systemd there: the cgroupfs driver, and the daemon of the new profile takes over the old
one through the instance registry. With N GPUs: prefill on the first half, decode on the
second half, then one TP-N server on all of them. Writes JSON (and an NVML trace) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import pynvml  # noqa: E402

MIB = int(os.environ.get("TORCH_MIB", "100000"))


def nvml_snapshot() -> list[dict]:
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        out.append({"index": i, "uuid": pynvml.nvmlDeviceGetUUID(h), "used_mib": mem.used >> 20,
                    "pids": [p.pid for p in procs]})
    return out


class Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.trace: list[tuple[float, list[int]]] = []
        self.marks: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            snap = nvml_snapshot()
            self.trace.append((time.time(), [g["used_mib"] for g in snap]))
            time.sleep(0.02)

    def mark(self, what: str) -> None:
        self.marks.append((time.time(), what))
        print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def write_config(cdir: Path, n: int) -> None:
    half = n // 2
    (cdir / "profiles").mkdir(parents=True, exist_ok=True)
    standin = [sys.executable, "-m", "supervisord_gpu.rehearsal.standin_server"]
    router = [sys.executable, "-m", "supervisord_gpu.rehearsal.standin_router"]
    (cdir / "supervisord-gpu.toml").write_text(f"""
[daemon]
ownership = "cgroupfs"
runtime_dir = "/tmp/gpusup-run"
default_user = "root"
[sglang]
server_command = {json.dumps(standin)}
router_command = {json.dumps(router)}
[gpus]
backend = "nvml"
wait_idle_timeout = 60
""")
    # children get only the environment a profile gives them: the stand-in's module path, and the
    # device machine's rule that NVLink multicast stays off
    common = (f'PYTHONPATH = "{REPO}"\nNCCL_NVLS_ENABLE = "0"\nTORCH_SYMM_MEM_DISABLE_MULTICAST = "1"\n'
              'NVSHMEM_DISABLE_NVLS = "1"\n')
    env = f'SUPERVISORD_GPU_STANDIN_TORCH_MIB = "{MIB}"\nSUPERVISORD_GPU_STANDIN_STARTUP_S = "2"\n' + common
    # decode holds less than prefill, so the NVML trace shows which physical GPU each one landed on
    decode_env = f'SUPERVISORD_GPU_STANDIN_TORCH_MIB = "{MIB * 6 // 10}"\nSUPERVISORD_GPU_STANDIN_STARTUP_S = "2"\n' + common
    prefill = list(range(half)) if half else [0]
    decode = list(range(half, n)) if half else [0]
    (cdir / "profiles" / "pd.toml").write_text(f"""
stop_order = ["router", "decode", "prefill"]
[servers.prefill]
role = "prefill"
gpus = {prefill}
port = 30100
model_path = "/tmp"
[servers.prefill.options]
tp-size = {len(prefill)}
[servers.prefill.env]
{env}
[servers.decode]
role = "decode"
gpus = {decode}
port = 30200
model_path = "/tmp"
[servers.decode.options]
tp-size = {len(decode)}
[servers.decode.env]
{decode_env}
[router]
mode = "pd"
host = "0.0.0.0"
port = 30001
[router.options]
prometheus-host = "127.0.0.1"
prometheus-port = 30091
[router.env]
PYTHONPATH = "{REPO}"
""")
    (cdir / "profiles" / "tp.toml").write_text(f"""
[servers.server]
gpus = {list(range(n))}
host = "0.0.0.0"
port = 30001
model_path = "/tmp"
[servers.server.options]
tp-size = {n}
[servers.server.env]
{env}
""")


def daemon(cdir: Path, name: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", name, "--config-dir", str(cdir), "--stderr"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_log(log: Path, text: str, timeout: float, proc: subprocess.Popen) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in log.read_text():
            return time.time()
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    raise SystemExit(f"timeout waiting for {text!r}:\n{log.read_text()[-3000:]}")


def first_idle_after(trace, t0: float, gpus: list[int], baseline: list[int], tol: int = 256) -> float | None:
    for t, used in trace:
        if t >= t0 and all(used[g] - baseline[g] <= tol for g in gpus):
            return t - t0
    return None


def cgroup_pids(name: str, proc: str) -> list[int]:
    p = Path(f"/sys/fs/cgroup/supervisord-gpu/{name}/{proc}/cgroup.procs")
    try:
        return [int(x) for x in p.read_text().split()]
    except OSError:
        return []


def hand_kill_comparison(n_gpus: int, baseline: list[int]) -> dict:
    """What operators did: kill the server's PID, sleep 3, poll nvidia-smi. The detached scheduler keeps the memory."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "SUPERVISORD_GPU_STANDIN_TORCH_MIB": str(MIB), "SUPERVISORD_GPU_STANDIN_STARTUP_S": "2"}
    cg = Path("/sys/fs/cgroup/gpusup-bench-hand")  # only so the benchmark can clean up after the hand procedure
    cg.mkdir(exist_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "supervisord_gpu.rehearsal.standin_server", "--model-path", "/tmp", "--port", "30900"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         preexec_fn=lambda: (cg / "cgroup.procs").write_text("0"))
    deadline = time.time() + 120
    while time.time() < deadline and nvml_snapshot()[0]["used_mib"] - baseline[0] < MIB // 2:
        time.sleep(0.1)
    holders = nvml_snapshot()[0]["pids"]
    t0 = time.time()
    os.kill(p.pid, signal.SIGKILL)  # kill $PID
    p.wait()
    time.sleep(3)  # sleep 3
    polls = 0
    while nvml_snapshot()[0]["used_mib"] - baseline[0] > 256 and polls < 7:  # poll nvidia-smi for a while
        time.sleep(1)
        polls += 1
    still = nvml_snapshot()[0]
    result = {"holders_before": holders, "after_s": time.time() - t0, "idle": still["used_mib"] - baseline[0] <= 256,
              "still_used_mib": still["used_mib"] - baseline[0], "still_held_by": still["pids"]}
    (cg / "cgroup.kill").write_text("1")  # what the hand procedure left behind
    t1 = time.time()
    while (cg / "cgroup.procs").read_text().strip():
        time.sleep(0.01)
    result["cleanup_cgroup_kill_to_idle_s"] = None
    while time.time() - t1 < 10:
        if nvml_snapshot()[0]["used_mib"] - baseline[0] <= 256:
            result["cleanup_cgroup_kill_to_idle_s"] = time.time() - t1
            break
        time.sleep(0.005)
    for _ in range(200):  # the last exit can lag cgroup.procs a little
        try:
            cg.rmdir()
            break
        except OSError:
            time.sleep(0.01)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    idle = nvml_snapshot()
    baseline = [g["used_mib"] for g in idle]
    result: dict = {"device": pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)),
                    "driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": n, "torch_mib_per_gpu": MIB,
                    "idle": idle, "steps": {}}
    cdir = Path("/tmp/gpusup-cfg")
    write_config(cdir, n)
    result["profiles"] = {p.name: p.read_text() for p in (cdir / "profiles").glob("*.toml")}
    s = Sampler()
    s.start()
    runs = []
    for i in range(int(os.environ.get("RUNS", "3"))):
        logs = out / f"run{i}"
        logs.mkdir(exist_ok=True)
        pd = daemon(cdir, "pd", logs / "pd.log")
        t0 = time.time(); s.mark(f"run {i}: start pd")
        wait_log(logs / "pd.log", "instance ready", 300, pd)
        t_ready = time.time(); s.mark(f"run {i}: pd ready")
        during_pd = nvml_snapshot()
        time.sleep(1)
        tp = daemon(cdir, "tp", logs / "tp.log")
        t_tp0 = time.time(); s.mark(f"run {i}: start tp (takes over pd)")
        wait_log(logs / "tp.log", "instance ready", 300, tp)
        t_tp_ready = time.time(); s.mark(f"run {i}: tp ready")
        during_tp = nvml_snapshot()
        pd.wait(60)
        time.sleep(0.5)
        tp.send_signal(signal.SIGTERM)
        t_stop = time.time(); s.mark(f"run {i}: stop tp")
        tp.wait(120)
        s.mark(f"run {i}: tp stopped")
        time.sleep(0.5)
        pd_log = (logs / "pd.log").read_text()
        tp_log = (logs / "tp.log").read_text()
        runs.append({
            "during_pd_used_mib": [g["used_mib"] for g in during_pd],
            "during_tp_used_mib": [g["used_mib"] for g in during_tp],
            "pd_start_to_ready_s": t_ready - t0,
            "tp_takeover_start_to_ready_s": t_tp_ready - t_tp0,
            "pd_stop_to_nvml_idle_s": first_idle_after(s.trace, t_tp0, list(range(n)), baseline),
            "tp_stop_to_nvml_idle_s": first_idle_after(s.trace, t_stop, list(range(n)), baseline),
            "pd_stop_lines": [l for l in pd_log.splitlines() if "stopped in" in l],
            "tp_transition_lines": [l for l in tp_log.splitlines() if "transition" in l or "verified idle" in l],
        })
    s.stop.set()
    s.join()
    result["runs"] = runs
    import statistics
    result["medians"] = {k: statistics.median(r[k] for r in runs if r[k] is not None)
                         for k in ("pd_start_to_ready_s", "tp_takeover_start_to_ready_s", "pd_stop_to_nvml_idle_s", "tp_stop_to_nvml_idle_s")}
    result["after"] = nvml_snapshot()
    result["hand_kill"] = hand_kill_comparison(n, baseline)
    result["marks"] = s.marks
    (out / "pd-to-tp.json").write_text(json.dumps(result, indent=2, default=str))
    with open(out / "nvml-trace.csv", "w") as f:
        f.write("time," + ",".join(f"gpu{i}_used_mib" for i in range(n)) + "\n")
        for t, used in s.trace:
            f.write(f"{t:.3f}," + ",".join(map(str, used)) + "\n")
    print(json.dumps({"medians": result["medians"], "during_pd_used_mib": runs[0]["during_pd_used_mib"],
                      "during_tp_used_mib": runs[0]["during_tp_used_mib"], "hand_kill": result["hand_kill"]}, indent=2))


if __name__ == "__main__":
    main()
