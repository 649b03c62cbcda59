"""The fault matrix under a real systemd: the shipped unit and profiles, the systemd driver.

test_fault_matrix.py runs every fault in every phase against the engine in-process (cgroupfs
driver). Here the same faults hit the real thing: `dsv4@pd-1p1d` (and `dsv4@tp4-512k` for
transitions) started by systemd 252 in the test rig's container, each process in its own
transient scope, the daemon talking sd_notify and D-Bus. Faults:

    crash        the stand-in crashes (crash-on-start; crash-after-ready, on every start): SIGKILLs itself
    sigkill      `kill -9` of a process's main PID, or of the daemon
    hang         the process stops answering and ignores SIGTERM (never-ready, hang-on-term,
                 or SIGSTOP for the real router)
    grandchild   `kill -9` of a server's detached scheduler (the one holding the GPU memory)
    port-stolen  a foreign unit binds the router's port after the preflight check

in four phases: starting, ready, stopping, and mid-transition (PD -> TP4: faults in the old
instance while it drains, in the new one while it starts, and a foreign process grabbing port
30001 the moment the old router lets go of it).

Every case must end in a defined state — the unit active with every process ready, or
inactive/failed with the culprit named in STATUS= or the journal — and, once stopped, nothing
of ours left in any dsv4 unit or scope, every simulated GPU idle, and the decoy (a foreign
unit whose command line contains `sglang.launch_server --port 30001`) still running. Units run
with Restart=no unless the case is about systemd's restart (then the shipped Restart= with a
short RestartSec). The table is printed in the terminal summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest

from box import REPO, box, ours, stand_ins  # noqa: F401  (box is a fixture)
from support import matrix_rows, tune, wait_for, with_env

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

PD, TP = "pd-1p1d", "tp4-512k"
PROFILES = "/etc/supervisord-gpu/profiles"
CTL = f"{REPO}/.venv/bin/gpusupctl"
DECOY = ["systemd-run", "--unit=decoy", "--collect", "python3", "-c", "import time; time.sleep(3600)",
         "-m", "sglang.launch_server", "--port", "30001"]
# a foreign process that takes port 30001 as soon as it is free, and keeps it
THIEF = ["systemd-run", "--unit=thief", "--collect", "python3", "-c",
         "import socket, time\n"
         "while True:\n"
         "    s = socket.socket()\n"
         "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"  # past the router's TIME_WAITs
         "    try:\n"
         "        s.bind(('0.0.0.0', 30001)); s.listen(); break\n"
         "    except OSError:\n"
         "        s.close(); time.sleep(0.005)\n"
         "time.sleep(3600)\n"]
PROBE = {"timeout": 3, "liveness_timeout": 0.5, "liveness_interval": 0.3, "failures": 2}


@dataclass(frozen=True)
class Case:
    target: str  # prefill | decode | router | daemon; in transitions old-* / new-* / foreign
    fault: str
    phase: str  # starting | ready | stopping | transition
    expect: str  # ready | failed | stopped | rolled-back | refused

    @property
    def id(self) -> str:
        return f"{self.target}-{self.fault}-{self.phase}"


def generate() -> list[Case]:
    cases: list[Case] = []
    for t in ("prefill", "decode"):
        cases += [Case(t, f, "starting", "failed") for f in ("crash", "sigkill", "hang", "grandchild")]
        cases += [Case(t, f, "ready", "ready") for f in ("sigkill", "hang", "grandchild")]
        cases += [Case(t, "crash", "ready", "failed")]  # crashes after every start: the restart limit
        cases += [Case(t, f, "stopping", "stopped") for f in ("sigkill", "hang")]
    cases += [Case("router", f, "starting", "failed") for f in ("sigkill", "hang", "port-stolen")]
    cases += [Case("router", f, "ready", "ready") for f in ("sigkill", "hang")]
    cases += [Case("router", f, "stopping", "stopped") for f in ("sigkill", "hang")]
    cases += [Case("daemon", "sigkill", p, "killed") for p in ("starting", "ready", "stopping")]
    cases += [
        Case("old-decode", "hang", "transition", "ready"),  # killed at its deadline; TP4 starts
        Case("old-prefill", "sigkill", "transition", "ready"),  # killed mid-drain; TP4 starts
        Case("old-daemon", "sigkill", "transition", "ready"),  # its scopes go with it; TP4 starts
        Case("new-server", "crash", "transition", "rolled-back"),  # PD back; TP4 failed, not retried
        Case("new-daemon", "sigkill", "transition", "ready"),  # systemd restarts it; nothing of the old one left
        Case("foreign", "port-stolen", "transition", "refused"),  # both refuse, naming the thief
    ]
    return cases


CASES = generate()
RESULTS: list[tuple[str, str, str, float]] = []


@pytest.fixture(autouse=True)
def matrix_report(request):  # type: ignore[no-untyped-def]
    yield from matrix_rows(request, RESULTS, "fault matrix under systemd", len(CASES))


# --------------------------------------------------------------------------- helpers


def unit(name: str) -> str:
    return f"dsv4@{name}.service"


def show(box, name: str, prop: str) -> str:  # type: ignore[no-untyped-def]
    return box.systemctl("show", "-P", prop, unit(name)).stdout.strip()


def scope_procs(box, instance: str, process: str) -> list:  # type: ignore[no-untyped-def]
    return [p for p in box.processes() if p.cgroup.endswith(f"/dsv4-{instance}-{process}.scope")]


def main_pid(box, instance: str, process: str) -> int | None:  # type: ignore[no-untyped-def]
    mains = [p.pid for p in scope_procs(box, instance, process) if not p.comm.startswith("sglang::sched")]
    return min(mains) if mains else None


def schedulers(box, instance: str, process: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [p.pid for p in scope_procs(box, instance, process) if p.comm.startswith("sglang::sched")]


def kill(box, pid: int, sig: str = "KILL") -> None:  # type: ignore[no-untyped-def]
    box.run(["kill", f"-{sig}", str(pid)], check=False)


def said(box, name: str, process: str, text: str) -> bool:  # type: ignore[no-untyped-def]
    return text in box.journal(unit(name), f"GPUSUP_PROCESS={process}")


def wait_said(box, name: str, process: str, text: str, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    try:
        wait_for(lambda: said(box, name, process, text), timeout, f"{process} to say {text!r}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{box.journal(unit(name))[-4000:]}") from None


def ready_and_healthy(box, name: str) -> bool:  # type: ignore[no-untyped-def]
    """The unit active, STATUS "ready: ...", every process ready according to the daemon, and port 30001 serving."""
    if box.is_active(unit(name)) != "active" or not show(box, name, "StatusText").startswith("ready:"):
        return False
    out = box.run([CTL, "status", name, "--json"], check=False).stdout
    try:
        data = json.loads(out)
    except ValueError:
        return False
    procs = [p for inst in data.get("instances", []) if inst["instance"] == name
             for p in (inst.get("daemon") or {}).get("processes", [])]
    if not procs or any(p["state"] != "ready" for p in procs):
        return False
    # and what a client sees on port 30001: the PD router ready with all its workers, or the TP4 server healthy
    path = "/readiness" if name == PD else "/health"
    probe = ("import sys, urllib.request\n"
             f"sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:30001{path}', timeout=2).status == 200 else 1)")
    return box.run(["python3", "-c", probe], check=False).returncode == 0


def gpus_idle(box) -> bool:  # type: ignore[no-untyped-def]
    out = box.run([CTL, "gpus", "--rehearsal", "--json"], check=False).stdout
    gpus = json.loads(out)["gpus"]
    return bool(gpus) and all(g["idle"] for g in gpus)


def tuned_profiles(box, case: Case) -> None:  # type: ignore[no-untyped-def]
    """Short deadlines and fast probes on the shipped profiles, then the case's own fault."""
    pd = box.read_file(f"{PROFILES}/{PD}.toml")
    for s in ("servers.prefill", "servers.decode"):
        pd = tune(pd, s, start_timeout=10, stop_timeout=3, probe=PROBE)
    pd = tune(pd, "router", start_timeout=10, stop_timeout=5, probe=PROBE)
    pd = tune(pd, "restart", max_restarts=2, backoff_initial=0.2)
    tp = tune(box.read_file(f"{PROFILES}/{TP}.toml"), "servers.server", start_timeout=10, stop_timeout=3, probe=PROBE)
    t, f, p = case.target, case.fault, case.phase
    sec = "router" if t == "router" else f"servers.{t}"
    fault = "SUPERVISORD_GPU_STANDIN_FAULT"
    if p == "starting":
        if f == "crash":
            pd = with_env(pd, t, **{fault: "crash-on-start"})
        elif f == "hang" and t != "router":
            pd = tune(with_env(pd, t, **{fault: "never-ready"}), sec, start_timeout=2)
        elif f == "hang":
            pd = tune(pd, sec, start_timeout=2)
        else:  # sigkill, grandchild, port-stolen: servers that load for 2 s, a wide window to hit
            for s in ("prefill", "decode"):
                pd = with_env(pd, s, SUPERVISORD_GPU_STANDIN_STARTUP_S="2")
    elif p == "ready" and f == "crash":
        pd = with_env(pd, t, **{fault: "crash-after-ready:6"})  # past the rest of the start, on a loaded machine
    elif p == "stopping":
        if t == "daemon":
            pd = with_env(pd, "prefill", **{fault: "exit-on-term-slow:3"})
        elif f == "hang" and t != "router":
            pd = tune(with_env(pd, t, **{fault: "hang-on-term"}), sec, stop_timeout=2)
        elif f == "hang":
            pd = tune(pd, sec, stop_timeout=2)
        elif f == "sigkill" and t != "router":
            pd = tune(with_env(pd, t, **{fault: "hang-on-term"}), sec, stop_timeout=20)
        elif f == "sigkill":
            pd = tune(pd, sec, stop_timeout=20)
    elif case.id == "old-decode-hang-transition":
        pd = tune(with_env(pd, "decode", **{fault: "hang-on-term"}), "servers.decode", stop_timeout=2)
    elif case.id == "old-prefill-sigkill-transition":
        pd = tune(with_env(pd, "prefill", **{fault: "hang-on-term"}), "servers.prefill", stop_timeout=20)
    elif case.id == "old-daemon-sigkill-transition":
        pd = with_env(pd, "prefill", **{fault: "exit-on-term-slow:3"})
    elif case.id == "new-server-crash-transition":
        tp = with_env(tp, "server", **{fault: "crash-on-start"})
    elif case.id == "new-daemon-sigkill-transition":
        tp = with_env(tp, "server", SUPERVISORD_GPU_STANDIN_STARTUP_S="2")
    box.write_file(f"{PROFILES}/{PD}.toml", pd)
    box.write_file(f"{PROFILES}/{TP}.toml", tp)


def unit_extra(case: Case) -> str:
    if case.id == "new-server-crash-transition":
        return ""  # the shipped Restart=on-failure: exit 5 must not be retried
    if case.id == "new-daemon-sigkill-transition":
        return "RestartSec=1\n"  # the shipped Restart=on-failure brings the killed daemon back
    return "Restart=no\n"


def journal_names(box, name: str, *needles: str) -> bool:  # type: ignore[no-untyped-def]
    text = box.journal(unit(name)) + show(box, name, "StatusText")
    return all(n in text for n in needles)


# --------------------------------------------------------------------------- the phases


def inject_starting(box, case: Case) -> str:  # type: ignore[no-untyped-def]
    t, f = case.target, case.fault
    box.systemctl("start", "--no-block", unit(PD))
    if f == "sigkill" and t == "daemon":
        wait_for(lambda: main_pid(box, PD, "prefill"), 20, "prefill spawned")
        kill(box, int(show(box, PD, "MainPID")))
    elif f == "sigkill" and t == "router":
        kill(box, wait_for(lambda: main_pid(box, PD, "router"), 20, "router spawned", interval=0.02))  # type: ignore[arg-type]
    elif f == "sigkill":
        wait_for(lambda: schedulers(box, PD, t), 20, f"{t}'s scheduler")  # its memory taken, still loading
        kill(box, main_pid(box, PD, t))  # type: ignore[arg-type]
    elif f == "grandchild":
        kill(box, wait_for(lambda: schedulers(box, PD, t), 20, f"{t}'s scheduler")[0])  # type: ignore[index]
    elif f == "hang" and t == "router":
        kill(box, wait_for(lambda: main_pid(box, PD, "router"), 20, "router spawned", interval=0.02), "STOP")  # type: ignore[arg-type]
    elif f == "port-stolen":
        wait_for(lambda: main_pid(box, PD, "prefill"), 20, "prefill spawned (the preflight done)")
        box.run(THIEF)
    wait_for(lambda: box.is_active(unit(PD)) in ("failed", "inactive"), 60, "the start to fail")
    state = box.is_active(unit(PD))
    assert state == "failed", state
    if t == "daemon":
        assert show(box, PD, "Result") == "signal"
        return "killed while starting: unit failed (Result=signal)"
    # the culprit is named in STATUS=, whose last update reached systemd before the exit (BARRIER=1)
    status = show(box, PD, "StatusText")
    if f == "port-stolen":  # the preflight's refusal come late: exit 3, final, the thief named
        assert "refusing to start: port" in status and "taken while pd-1p1d was starting" in status, status
        assert show(box, PD, "ExecMainStatus") == "3"
        return status
    assert status.startswith(f"failed: {t}: "), status
    assert ("start_timeout" if f == "hang" else "start-up") in status, status
    assert f"{t}: " in box.journal(unit(PD))
    return status


def inject_ready(box, case: Case) -> str:  # type: ignore[no-untyped-def]
    t, f = case.target, case.fault
    box.systemctl("start", unit(PD), timeout=120)
    assert ready_and_healthy(box, PD)
    if t == "daemon":
        kill(box, int(show(box, PD, "MainPID")))
        wait_for(lambda: box.is_active(unit(PD)) in ("failed", "inactive"), 30, "the unit to go down")
        assert show(box, PD, "Result") == "signal"
        return f"killed: unit {box.is_active(unit(PD))} (Result=signal)"
    old_main, old_sched = main_pid(box, PD, t), schedulers(box, PD, t)
    if f == "crash":
        wait_for(lambda: box.is_active(unit(PD)) == "failed", 90, "the restart limit")
        status = show(box, PD, "StatusText")
        assert status.startswith(f"failed: {t} crashed: SGLang killed itself after a scheduler failed"), status
        assert "restart limit reached (2/2" in status, status
        return show(box, PD, "StatusText")
    if f == "sigkill":
        kill(box, old_main)  # type: ignore[arg-type]
    elif f == "hang":
        kill(box, old_main, "STOP")  # type: ignore[arg-type]
    elif f == "grandchild":
        kill(box, old_sched[0])
    wait_for(lambda: main_pid(box, PD, t) != old_main or f == "grandchild" and set(schedulers(box, PD, t)) - set(old_sched),
          30, f"{t} replaced")
    wait_for(lambda: ready_and_healthy(box, PD), 30, "every process ready again")
    assert not set(old_sched) & set(schedulers(box, PD, t)), "the old scheduler survived"
    return f"ready again ({t} restarted)"


def inject_stopping(box, case: Case) -> str:  # type: ignore[no-untyped-def]
    t, f = case.target, case.fault
    box.systemctl("start", unit(PD), timeout=120)
    victim = main_pid(box, PD, t) if t != "daemon" else int(show(box, PD, "MainPID"))
    if t == "router":
        kill(box, victim, "STOP")  # type: ignore[arg-type]  # it cannot drain: we hit it mid-stop
    began = time.monotonic()
    box.systemctl("stop", "--no-block", unit(PD))
    if t == "daemon":
        wait_for(lambda: box.is_active(unit(PD)) == "deactivating", 10, "deactivating")
        wait_said(box, PD, "prefill", "SIGTERM received")
        kill(box, victim)  # type: ignore[arg-type]
    elif f == "sigkill":
        if t == "router":
            time.sleep(1.0)  # the router is first in the stop order: SIGTERMed at once
        else:
            wait_said(box, PD, t, "SIGTERM received")
        kill(box, victim)  # type: ignore[arg-type]
    wait_for(lambda: box.is_active(unit(PD)) in ("inactive", "failed"), 60, "the stop to finish")
    took = time.monotonic() - began
    if t == "daemon":
        assert show(box, PD, "Result") == "signal"
        return f"killed while stopping: unit {box.is_active(unit(PD))}"
    assert box.is_active(unit(PD)) == "inactive", show(box, PD, "Result")
    if f == "hang":
        assert journal_names(box, PD, f"{t}: still running 2 s after SIGTERM; killing its cgroup")
    else:
        assert took < 20, f"waited for the deadline ({took:.1f} s) although {t} was killed"
    order = [json.loads(l)["GPUSUP_PROCESS"] for l in
             box.journal(unit(PD), "GPUSUP_EVENT=stopped", "-o", "json").splitlines() if l.strip()]
    assert order == ["router", "decode", "prefill"], order
    return f"stopped in {took:.1f} s"


def inject_transition(box, case: Case) -> str:  # type: ignore[no-untyped-def]
    box.systemctl("start", unit(PD), timeout=120)
    if case.id == "foreign-port-stolen-transition":
        box.write_file("/etc/supervisord-gpu/supervisord-gpu.toml",
                       box.read_file("/etc/supervisord-gpu/supervisord-gpu.toml") + "[gpus]\nwait_idle_timeout = 3\n")
        box.run(THIEF)
        assert box.systemctl("start", unit(TP), check=False, timeout=120).returncode != 0
        assert show(box, TP, "ExecMainStatus") == "5"  # a failed takeover
        assert journal_names(box, TP, "thief.service", "(foreign)", "rollback")
        wait_for(lambda: box.is_active(unit(PD)) == "failed", 60, "the rollback to be refused")
        assert show(box, PD, "ExecMainStatus") == "3"  # refused, naming the thief
        assert journal_names(box, PD, "refusing to start", "thief.service")
        box.systemctl("stop", "thief.service")
        return "TP4 failed (exit 5), rollback refused (exit 3): thief named"
    if case.id == "new-server-crash-transition":
        assert box.systemctl("start", unit(TP), check=False, timeout=120).returncode != 0
        wait_for(lambda: box.is_active(unit(PD)) == "active", 60, "the rollback")
        wait_for(lambda: ready_and_healthy(box, PD), 30, "PD ready again")
        assert show(box, TP, "ExecMainStatus") == "5"
        time.sleep(1.5)
        assert box.is_active(unit(TP)) == "failed" and show(box, TP, "NRestarts") == "0", "a failed takeover was retried"
        return "rolled back: PD ready, TP4 failed (exit 5, not retried)"
    if case.id == "new-daemon-sigkill-transition":
        box.systemctl("start", "--no-block", unit(TP))
        wait_for(lambda: main_pid(box, TP, "server"), 60, "TP4's server spawned (PD stopped)")
        first = show(box, TP, "MainPID")
        kill(box, int(first))
        wait_for(lambda: show(box, TP, "NRestarts") == "1", 30, "systemd to restart the daemon")
        wait_for(lambda: ready_and_healthy(box, TP), 60, "TP4 ready after the restart")
        assert box.is_active(unit(PD)) == "inactive"
        return "TP4 ready after systemd restarted its killed daemon"
    box.systemctl("start", "--no-block", unit(TP))
    if case.id == "old-prefill-sigkill-transition":
        wait_said(box, PD, "prefill", "SIGTERM received", 30)
        kill(box, main_pid(box, PD, "prefill"))  # type: ignore[arg-type]
    elif case.id == "old-daemon-sigkill-transition":
        wait_said(box, PD, "prefill", "SIGTERM received", 30)
        kill(box, int(show(box, PD, "MainPID")))
    wait_for(lambda: box.is_active(unit(TP)) in ("active", "failed", "inactive"), 120, "the switch to end")
    assert ready_and_healthy(box, TP), box.journal(unit(TP))[-3000:]
    assert box.is_active(unit(PD)) in ("inactive", "failed")
    if case.id == "old-decode-hang-transition":
        assert journal_names(box, PD, "decode: still running 2 s after SIGTERM; killing its cgroup")
    return "TP4 ready; PD down"


PHASES = {"starting": inject_starting, "ready": inject_ready, "stopping": inject_stopping,
          "transition": inject_transition}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault_under_systemd_ends_in_a_defined_state_with_nothing_left(box, case):  # type: ignore[no-untyped-def]
    began = time.monotonic()
    box.install(startup=0.5, unit_extra=unit_extra(case))
    tuned_profiles(box, case)
    box.run(DECOY)
    final = "?"
    try:
        final = PHASES[case.phase](box, case)
    finally:
        for name in (TP, PD):
            box.systemctl("stop", unit(name), check=False, timeout=120)
        deadline = time.monotonic() + 30
        while (ours(box) or stand_ins(box)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted({p.pid for p in ours(box) + stand_ins(box)})
        RESULTS.append((case.id, final, f"pids {left}" if left else "none", time.monotonic() - began))
    assert left == [], [(p.pid, p.comm, p.cgroup) for p in ours(box) + stand_ins(box)]
    wait_for(lambda: gpus_idle(box), 10, "every GPU idle")
    assert box.is_active("decoy.service") == "active", "the decoy was touched"
