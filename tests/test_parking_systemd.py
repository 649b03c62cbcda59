"""Parking under a real systemd 252 (issue 39, "Under systemd"), with the shipped unit and the
commands a user types: `systemctl start`, `gpusupctl switch --park`, `gpusupctl status`,
`gpusupctl switch` back, a daemon killed with SIGKILL, `systemctl stop`.

One test, one container, one cold start of each profile where it can be helped: every step
below is something only systemd can show (the unit's state and STATUS=, BindsTo= on a crash,
the auto-restart), and each costs seconds. The profiles are the shipped pd-1p1d and tp4-512k,
both fronted on 30001 (clients never change port): the park stops pd-1p1d's router for
tp4-512k's and starts it again at the restore. One change: a small mem-fraction, so the
stand-ins' simulated pools fit this host's memory (the park checks MemAvailable).
"""

from __future__ import annotations

import json
import time

import pytest

from box import REPO, box, ours  # noqa: F401  (box is a fixture)
from support import wait_for

pytestmark = [pytest.mark.systemd, pytest.mark.slow]
CTL = f"{REPO}/.venv/bin/gpusupctl"
PD, TP = "pd-1p1d", "tp4-512k"
PROFILES = "/etc/supervisord-gpu/profiles"
GENERATE = ("import json, sys, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
            "'http://127.0.0.1:30001/generate', data=json.dumps({'text': 'hi', 'sampling_params': "
            "{'max_new_tokens': 2}}).encode(), headers={'Content-Type': 'application/json'}), timeout=20); "
            "print(r.status)")


def show(box, name: str, *props: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    out = box.systemctl("show", f"dsv4@{name}.service", *(f"-p{p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def of(box, name: str) -> list:  # type: ignore[no-untyped-def]
    """Every process of instance `name`: in its service or one of its scopes."""
    return [p for p in box.processes() if f"/dsv4@{name}.service" in p.cgroup or f"/dsv4-{name}-" in p.cgroup]


def gpu_owners(box) -> dict[int, set[str]]:  # type: ignore[no-untyped-def]
    """Simulated GPU -> the instances holding memory on it (`gpusupctl status --json`)."""
    data = json.loads(box.run([CTL, "status", "--json"]).stdout)
    return {g["index"]: {h["owner"].split("/")[0] for h in g["holders"]} for g in data["gpus"]}


def parked_holdings(box) -> str:  # type: ignore[no-untyped-def]
    """The simulated checkpointer's host copies (holders/*/.parked.PID.json), one per line."""
    return box.run(["sh", "-c", "ls -a /run/supervisord-gpu/simgpu/holders/*/ | grep '^.parked' || true"]).stdout


def test_a_parked_unit_stays_active_says_parked_comes_back_and_a_crash_or_stop_leaves_nothing(box):
    box.install(startup=0.5)  # the shipped unit: Restart=on-failure, RestartSec=10
    for name in (PD, TP):
        text = box.read_file(f"{PROFILES}/{name}.toml")
        assert "port = 30001" in text, f"{name} no longer ships its router on 30001: this test proves that pair parks"
        box.write_file(f"{PROFILES}/{name}.toml", text.replace("mem-fraction-static = 0.85", "mem-fraction-static = 0.002"))
    box.systemctl("start", f"dsv4@{PD}", timeout=120)
    servers = {p.pid for p in of(box, PD) if p.comm.startswith("sglang::sched")}  # the CUDA processes a park checkpoints

    # (a) switch --park: the parked unit stays active and says so; the new one is active and READY
    r = box.run([CTL, "switch", TP, "--park", "--wait"], check=False, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    parked = show(box, PD, "ActiveState", "StatusText")
    assert parked["ActiveState"] == "active" and parked["StatusText"].startswith("parked: 0 MiB on the GPU, "), parked
    assert " GB host (" in parked["StatusText"] and "via simulated" in parked["StatusText"], parked
    ready = show(box, TP, "ActiveState", "StatusText")
    assert ready["ActiveState"] == "active" and ready["StatusText"].startswith("ready: "), ready
    status = box.run([CTL, "status"]).stdout
    assert "parked: 0 MiB on the GPU, " in status and " GB host (" in status, status
    owners = gpu_owners(box)
    assert all(PD not in owners[g] for g in range(8)) and all(TP in owners[g] for g in range(4)), owners
    assert servers and servers <= {p.pid for p in of(box, PD)}, "the parked servers must live on"
    # its router stopped for tp4-512k's (the same port): said so, not crashed; the port answers tp4-512k
    assert "; router stopped while parked (tp4-512k needs port 30001)" in parked["StatusText"], parked
    procs = next(i for i in json.loads(box.run([CTL, "status", "--json"]).stdout)["instances"]
                 if i["unit"] == f"dsv4@{PD}.service")["daemon"]["processes"]
    assert [(p["state"], p["pid"]) for p in procs if p["name"] == "router"] == [("stopped", None)], procs
    assert box.run(["python3", "-c", GENERATE]).stdout.strip() == "200"

    # (b) switch back: the replacing unit stopped, the parked one restored warm and serving
    r = box.run([CTL, "switch", PD, "--wait"], check=False, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert box.is_active(f"dsv4@{TP}") == "inactive"
    back = show(box, PD, "ActiveState", "StatusText")
    assert back["ActiveState"] == "active" and back["StatusText"].startswith("ready: "), back
    assert servers <= {p.pid for p in of(box, PD)}, "restored, not started cold"
    assert box.run(["python3", "-c", GENERATE]).stdout.strip() == "200"

    # (c) the parked daemon SIGKILLed: nothing of it survives, and its next life starts cold
    box.run([CTL, "switch", TP, "--park", "--wait"], timeout=180)
    old = {p.pid for p in of(box, PD)}
    box.systemctl("kill", "-s", "KILL", "--kill-whom=main", f"dsv4@{PD}")
    wait_for(lambda: show(box, PD, "SubState")["SubState"] == "auto-restart", 20, "the crashed unit to wait for its restart")
    wait_for(lambda: not of(box, PD), 8, "the parked processes to end with their daemon")
    assert not old & {p.pid for p in box.processes()}, "a parked process outlived its daemon"
    # the dead daemon's parked record stays (nothing ran its clean-up), believed by nobody: a switch to it is a plain start
    box.run(["test", "-f", f"/run/supervisord-gpu/parked/{PD}.json"])
    plan = box.run([CTL, "switch", PD, "--dry-run"]).stdout
    assert "parked" not in plan and f"stop dsv4@{TP}" in plan, plan
    wait_for(lambda: show(box, PD, "SubState")["SubState"] == "running", 60, "systemd's restart of the unit")
    wait_for(lambda: show(box, PD, "StatusText")["StatusText"].startswith("ready: "), 60, "the restarted daemon ready")
    again = show(box, PD, "NRestarts", "StatusText")
    assert again["NRestarts"] == "1" and not again["StatusText"].startswith("parked"), again
    assert box.is_active(f"dsv4@{TP}") == "inactive"  # its cold start took the GPUs back, as a start does
    assert not old & {p.pid for p in of(box, PD)}

    # `systemctl stop` of a parked unit: ended, its host copies with it, the other left serving
    box.run([CTL, "switch", TP, "--park", "--wait"], timeout=180)
    assert show(box, PD, "StatusText")["StatusText"].startswith("parked: ")
    box.systemctl("stop", f"dsv4@{PD}", timeout=120)
    assert box.is_active(f"dsv4@{PD}") == "inactive" and of(box, PD) == []
    assert parked_holdings(box) == ""
    assert box.run(["ls", "/run/supervisord-gpu/parked"]).stdout.strip() == ""
    assert box.is_active(f"dsv4@{TP}") == "active"
    box.systemctl("stop", f"dsv4@{TP}", timeout=120)
    assert ours(box) == []
