"""Benchmarks that need a real systemd (the test rig's container): the systemd driver's stop
detection, PD -> TP4 orchestration overhead against the scripted hand procedure, and
`gpusupctl status` latency against `systemctl status`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from common import summary, table, write

import box as B
from rig.systemd_container import SystemdContainer, repo_binds

RUNS = 5
CTL = f"{B.REPO}/.venv/bin/gpusupctl"


def journal_json(ctr: SystemdContainer, unit: str, *match: str) -> list[dict]:
    out = ctr.journal(unit, *match, "-o", "json")
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def transition_overhead(ctr: SystemdContainer) -> tuple[list[float], list[float], list[float]]:
    ours, manual, detect = [], [], []
    for _ in range(RUNS):
        ctr.systemctl("start", "dsv4@pd-1p1d", timeout=120)
        t0 = time.monotonic()
        ctr.systemctl("start", "dsv4@tp4-512k", timeout=180)
        total = time.monotonic() - t0
        stopped = journal_json(ctr, "dsv4@pd-1p1d", "GPUSUP_EVENT=instance-stopped")
        drain = float(stopped[-1]["GPUSUP_DURATION_S"])
        ours.append(total - drain - start_up(ctr))
        ctr.systemctl("stop", "dsv4@tp4-512k", timeout=120)
        # the hand procedure, scripted: stop, sleep 3, poll until clear, start
        ctr.systemctl("start", "dsv4@pd-1p1d", timeout=120)
        t0 = time.monotonic()
        ctr.run(["sh", "-c", "systemctl stop dsv4@pd-1p1d; sleep 3; "
                 f"until {CTL} check tp4-512k >/dev/null 2>&1; do sleep 1; done; systemctl start dsv4@tp4-512k"], timeout=240)
        total = time.monotonic() - t0
        stopped = journal_json(ctr, "dsv4@pd-1p1d", "GPUSUP_EVENT=instance-stopped")
        manual.append(total - float(stopped[-1]["GPUSUP_DURATION_S"]) - start_up(ctr))
        ctr.systemctl("stop", "dsv4@tp4-512k", timeout=120)
    for unit in ("dsv4@pd-1p1d", "dsv4@tp4-512k"):
        detect += [float(r["GPUSUP_EXIT_TO_STOPPED_S"]) for r in journal_json(ctr, unit, "GPUSUP_EVENT=stopped")]
    return ours, manual, detect


def start_up(ctr: SystemdContainer) -> float:
    """TP4's own start-up in its latest start: its first process spawned -> the instance ready
    (the server loads, then its router starts and registers it): the part that is SGLang's."""
    spawned = journal_json(ctr, "dsv4@tp4-512k", "GPUSUP_EVENT=spawn")
    ready = journal_json(ctr, "dsv4@tp4-512k", "GPUSUP_EVENT=instance-ready")
    last_ready = int(ready[-1]["__REALTIME_TIMESTAMP"])
    first_spawn = max(int(s["__REALTIME_TIMESTAMP"]) for s in spawned if int(s["__REALTIME_TIMESTAMP"]) <= last_ready
                      and s.get("GPUSUP_PROCESS") == "server")
    return (last_ready - first_spawn) / 1e6


def status_latency(ctr: SystemdContainer) -> tuple[list[float], list[float]]:
    for name, (gpu0, base) in {"a": (0, 32000), "b": (2, 32100), "c": (4, 32200)}.items():
        ctr.write_file(f"/etc/supervisord-gpu/profiles/{name}.toml", f"""
[defaults]
user = "sglang"
[servers.prefill]
role = "prefill"
gpus = [{gpu0}]
port = {base}
model_path = "/m"
[servers.prefill.options]
disaggregation-bootstrap-port = {base + 50}
[servers.decode]
role = "decode"
gpus = [{gpu0 + 1}]
port = {base + 1}
model_path = "/m"
[router]
mode = "pd"
port = {base + 2}
[router.options]
prometheus-port = {base + 3}
""")
        ctr.systemctl("start", f"dsv4@{name}", timeout=120)
    ours, systemctl = [], []
    for _ in range(10):
        t0 = time.monotonic()
        ctr.run([CTL, "status"])
        ours.append(time.monotonic() - t0)
        t0 = time.monotonic()
        ctr.run(["systemctl", "--no-pager", "status", "dsv4@*"], check=False)
        systemctl.append(time.monotonic() - t0)
    for name in "abc":
        ctr.systemctl("stop", f"dsv4@{name}", timeout=120)
    return ours, systemctl


def main() -> dict[str, object]:
    with SystemdContainer(binds=repo_binds()) as ctr:
        B.install(ctr)
        ours, manual, detect = transition_overhead(ctr)
        st_ours, st_systemctl = status_latency(ctr)
    result = {
        "what": "real systemd 252 in a container; stand-in servers (1 s start-up), real sglang-router",
        "transition_overhead_s": {"supervisord_gpu": summary(ours), "manual_stop_sleep3_poll_start": summary(manual)},
        "systemd_driver_exit_to_stopped_s": summary(detect),
        "status_wall_s": {"gpusupctl_status_3_instances_9_processes": summary(st_ours), "systemctl_status": summary(st_systemctl)},
    }
    result["ratios"] = {"transition": statistics.median(manual) / statistics.median(ours)}
    path = write("systemd", result)
    print(table([
        ("measure", "supervisord-gpu (median)", "alternative (median)", "ratio"),
        ("PD->TP4 orchestration overhead", f"{statistics.median(ours):.3f} s", f"{statistics.median(manual):.3f} s (manual)",
         f"{result['ratios']['transition']:.1f}x"),
        ("last exit -> stopped (systemd driver)", f"{statistics.median(detect) * 1000:.1f} ms", "-", "-"),
        ("status, 3 instances / 9 processes", f"{statistics.median(st_ours) * 1000:.0f} ms",
         f"{statistics.median(st_systemctl) * 1000:.0f} ms (systemctl status)", "-"),
    ]))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
