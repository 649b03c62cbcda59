"""On the GPU machine: does CUDA work under dsv4@.service's sandbox, started the way the daemon starts it?

The device machine has no systemd, so the unit's sandbox is applied by sandbox_probe (built from
sandbox_probe.c: the unit's mount settings, CapabilityBoundingSet=, NoNewPrivileges=, its
SystemCallFilter= expanded by systemd-analyze 252 into allowed-syscalls.txt, RestrictNamespaces=,
RestrictRealtime=, LockPersonality=) around the real daemon, which then starts a torch stand-in
server as an unprivileged user, as it would under systemd. Three runs, each must succeed:

  1. bare:      torch as that user, no sandbox: CUDA init, 10 GiB allocated, a matmul, one NCCL
                all-reduce (world size 1);
  2. sandboxed: the same torch program under the sandbox;
  3. daemon:    `supervisord-gpu run` under the sandbox (cgroupfs driver: under systemd the
                daemon uses scopes over D-Bus instead, so /sys/fs/cgroup is left writable here),
                one torch stand-in server of 10 GiB as that user: ready, NVML shows the memory,
                SIGTERM, NVML idle again.

Writes $OUT/sandbox-h200.json (or --out). Build the probe here first:
    gcc -O2 -static -o .device/sandbox_probe bench/device/sandbox_probe.c -lseccomp
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / ".device" / "sandbox_probe"
SYSCALLS = REPO / "bench" / "device" / "allowed-syscalls.txt"
UNIT = REPO / "units" / "dsv4@.service"
MIB = 10240
RUNTIME = Path("/tmp/gpusup-sandbox")
# The device machine's rule: NVLink multicast stays off in every program (children get only the
# environment a profile gives them, so it is given here).
DEVICE_ENV = 'NCCL_NVLS_ENABLE = "0"\nTORCH_SYMM_MEM_DISABLE_MULTICAST = "1"\nNVSHMEM_DISABLE_NVLS = "1"'
CACHE = Path("/var/cache/supervisord-gpu")

TORCH = f"""
import json, os, time
t0 = time.time()
import torch, torch.distributed as dist
torch.cuda.init()
x = torch.empty({MIB} << 20, dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, device="cuda")
b = (a @ a).sum().item()
torch.cuda.synchronize()
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29611", rank=0, world_size=1)
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
ok = t[0].item() == 1.0
dist.destroy_process_group()
print(json.dumps({{"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "allocated_mib": x.numel() >> 20,
                   "matmul": b == b, "nccl_all_reduce": ok, "device": torch.cuda.get_device_name(0),
                   "seconds": round(time.time() - t0, 2)}}))
"""


def unit_capabilities() -> str:
    """The unit's CapabilityBoundingSet=, as the probe's ",N,N," list."""
    numbers = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
               "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
               "CAP_IPC_LOCK": 14, "CAP_SYS_PTRACE": 19, "CAP_SYS_RESOURCE": 24}
    for line in UNIT.read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            return "," + ",".join(str(numbers[c]) for c in line.split("=", 1)[1].split()) + ","
    raise SystemExit("the unit sets no CapabilityBoundingSet=")


def sandbox(user: str | None, rw: list[str]) -> list[str]:
    argv = [str(PROBE), "--mounts", "--caps", unit_capabilities(), "--syscalls", str(SYSCALLS)]
    for path in rw:
        argv += ["--rw", path]
    if user:
        argv += ["--user", user]
    return argv + ["--"]


def run(argv: list[str], timeout: float = 300) -> dict[str, object]:
    began = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    out = {"rc": p.returncode, "seconds": round(time.time() - began, 2), "stdout": p.stdout[-3000:], "stderr": p.stderr[-3000:]}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            out["result"] = json.loads(line)
            break
    return out


def write_config(cdir: Path, user: str) -> None:
    (cdir / "profiles").mkdir(parents=True, exist_ok=True)
    standin = [sys.executable, "-m", "supervisord_gpu.rehearsal.standin_server"]
    (cdir / "supervisord-gpu.toml").write_text(f"""
[daemon]
ownership = "cgroupfs"
runtime_dir = "{RUNTIME}"
cache_dir = "{CACHE}"
[sglang]
server_command = {json.dumps(standin)}
[gpus]
backend = "nvml"
wait_idle_timeout = 60
""")
    (cdir / "profiles" / "one.toml").write_text(f"""
[servers.server]
gpus = [0]
port = 30300
model_path = "/tmp"
user = "{user}"
[servers.server.env]
SUPERVISORD_GPU_STANDIN_TORCH_MIB = "{MIB}"
SUPERVISORD_GPU_STANDIN_STARTUP_S = "2"
PYTHONPATH = "{REPO}"
{DEVICE_ENV}
""")


def used_mib() -> int:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used >> 20


def daemon_run(user: str) -> dict[str, object]:
    cdir = REPO / ".device" / "sandbox-config"  # read-only under the sandbox, like /etc
    write_config(cdir, user)
    os.chmod(REPO / ".device", 0o755)
    log = Path("/tmp/gpusup-sandbox-daemon.log")
    # Stands in for systemd's delegated cgroup: this machine has no systemd, and /sys/fs/cgroup
    # is 0555 here; the unit's daemon keeps no CAP_DAC_OVERRIDE, so it cannot make our root itself
    Path("/sys/fs/cgroup/supervisord-gpu").mkdir(mode=0o755, exist_ok=True)
    baseline = used_mib()
    argv = sandbox(None, [str(RUNTIME), str(CACHE), "/sys/fs/cgroup"]) + [
        sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", "one", "--config-dir", str(cdir), "--stderr"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    result: dict[str, object] = {"baseline_mib": baseline}
    deadline = time.time() + 240
    while "instance ready" not in log.read_text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    result["ready"] = "instance ready" in text
    result["held_mib"] = used_mib() - baseline
    uids = []
    for line in text.splitlines():
        if "started pid" in line:
            pid = int(line.split("started pid", 1)[1].split()[0])
            try:
                uids.append(os.stat(f"/proc/{pid}").st_uid)
            except OSError:
                pass
    result["server_uids"] = uids
    proc.send_signal(signal.SIGTERM)
    try:
        result["daemon_exit"] = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        result["daemon_exit"] = "killed after 120 s"
    time.sleep(1)
    result["left_mib"] = used_mib() - baseline
    result["log_tail"] = log.read_text()[-4000:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--user", default="nobody")
    args = ap.parse_args()
    pw = pwd.getpwnam(args.user)
    results: dict[str, object] = {"user": args.user, "uid": pw.pw_uid, "kernel": os.uname().release,
                                  "capabilities": unit_capabilities(), "syscalls": len(SYSCALLS.read_text().split())}
    results["bare"] = run([str(PROBE), "--user", args.user, "--", sys.executable, "-c", TORCH])  # no sandbox
    results["sandboxed"] = run(sandbox(args.user, []) + [sys.executable, "-c", TORCH])
    results["daemon"] = daemon_run(args.user)
    ok = (results["bare"]["rc"] == 0 and results["sandboxed"]["rc"] == 0  # type: ignore[index]
          and results["daemon"]["ready"] and results["daemon"]["held_mib"] >= MIB  # type: ignore[index,operator]
          and results["daemon"]["left_mib"] <= 256)  # type: ignore[index,operator]
    results["ok"] = ok
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sandbox-h200.json").write_text(json.dumps(results, indent=2))
    for key in ("bare", "sandboxed"):
        r = results[key]
        print(key, r["rc"], r.get("result"), r["stderr"][-600:] if r["rc"] else "")  # type: ignore[index,union-attr]
    d = results["daemon"]
    print("daemon", {k: d[k] for k in ("ready", "held_mib", "left_mib", "server_uids", "daemon_exit")})  # type: ignore[index]
    print("probe:", [l for l in results["sandboxed"]["stdout"].splitlines() if l.startswith(("ok:", "skip:"))])  # type: ignore[index]
    print("OK" if ok else "FAILED")


if __name__ == "__main__":
    main()
