"""Ordered transitions: stop the instances that hold what a profile needs, verify, then start.

systemd cannot say "conflicts with any other dsv4@ instance", so the daemon of the instance
being started does it: it validates the new profile in full *before* touching anything,
finds the instances whose GPUs or ports overlap, stops them through systemd (each one's own
daemon drains the router and stops decode, then prefill, each verified gone), waits until
the GPUs are verified idle and the ports free, and only then starts. One transition at a
time per machine (a lock in the runtime directory); a failed start brings the old ones back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from ..records import dataclass, field

from ..config.loader import load_profile
from ..config.model import DaemonConfig, Profile
from ..errors import ConfigError, PreconditionError, SupervisorError
from ..names import service_name
from . import parked
from .registry import Registry
from .units import Units


@dataclass
class Conflict:
    instance: str
    gpus: list[int]
    ports: list[int]
    stop_deadline_s: float
    via: str  # "systemd" or "pid <n>"

    def describe(self) -> str:
        held = []
        if self.gpus:
            held.append(f"GPUs {','.join(map(str, self.gpus))}")
        if self.ports:
            held.append(f"ports {','.join(map(str, self.ports))}")
        return f"dsv4@{self.instance} ({' and '.join(held)})"


@dataclass
class Step:
    what: str
    deadline_s: float | None
    verifies: str


@dataclass
class Plan:
    target: str
    conflicts: list[Conflict]
    steps: list[Step] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"plan: switch to {self.target}" + (f" from {', '.join(c.instance for c in self.conflicts)}" if self.conflicts else " (nothing to stop)")]
        for i, s in enumerate(self.steps, 1):
            deadline = f"deadline {s.deadline_s:g} s" if s.deadline_s is not None else "no deadline"
            lines.append(f"  {i}. {s.what}")
            lines.append(f"     {deadline}; verifies: {s.verifies}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- who is in the way


def _active_units(units: Units | None) -> dict[str, str]:
    """Active dsv4@ instances according to systemd, or {} without it (or with the bus away)."""
    if units is None:
        return {}
    try:
        return {u.instance: u.active for u in units.instances() if u.active in ("active", "activating", "reloading")}
    except SupervisorError:
        return {}


def find_conflicts(profile: Profile, cfg: DaemonConfig, units: Units | None, registry: Registry) -> list[Conflict]:
    """Our instances that hold a GPU or a port `profile` needs: systemd's active dsv4@ units (when
    `units` is given: the daemon runs under systemd), then the registry's live daemons."""
    candidates: dict[str, str] = {name: "systemd" for name in _active_units(units)}
    records = registry.running()
    for rec in records:
        candidates.setdefault(rec.instance, f"pid {rec.pid}")
    wanted_gpus = set(profile.gpus)
    wanted_ports = {listen.port for listen in profile.listens()}
    parked_now = parked.parked(cfg.runtime_dir)
    out = []
    for name, via in sorted(candidates.items()):
        if name == profile.name:
            continue
        if name in parked_now and not set(parked_now[name]) & wanted_ports:
            continue  # parked (controller/parked.py): it holds none of the GPUs, and none of the ports
        try:
            other = load_profile(cfg, name)
            gpus, ports = set(other.gpus), {listen.port for listen in other.listens()}
            deadline = sum(p.stop_timeout_s for p in other.processes) + 10
        except ConfigError:
            found = next((r for r in records if r.instance == name), None)
            if found is None:
                continue
            gpus, ports, deadline = set(found.gpus), set(found.ports), 600.0
        overlap_g, overlap_p = sorted(gpus & wanted_gpus), sorted(ports & wanted_ports)
        if overlap_g or overlap_p:
            out.append(Conflict(name, overlap_g, overlap_p, deadline, via))
    return out


def make_plan(profile: Profile, cfg: DaemonConfig, conflicts: list[Conflict], flags_how: str) -> Plan:
    plan = Plan(profile.name, conflicts)
    plan.steps.append(Step(
        f"preflight {profile.name}: config, SGLang options ({flags_how}), model paths, GPUs "
        f"{','.join(map(str, sorted(profile.gpus)))} present, no foreign holder", None,
        "nothing running is touched if any check fails"))
    for c in conflicts:
        other = None
        try:
            other = load_profile(cfg, c.instance)
        except ConfigError:
            pass
        order = other.describe_stop_order() if other else "its own order"
        plan.steps.append(Step(f"stop dsv4@{c.instance} ({'systemd' if c.via == 'systemd' else c.via}): {order}, "
                               "each wave verified gone (cgroup empty) before the next", c.stop_deadline_s,
                               f"dsv4@{c.instance} inactive"))
    listens = ", ".join(f"{listen.host}:{listen.port}" for listen in profile.listens())
    plan.steps.append(Step(f"wait until GPUs {','.join(map(str, sorted(profile.gpus)))} are idle and {listens} free",
                           cfg.gpus.wait_idle_timeout_s, "NVML (or simulated) memory at baseline, no compute processes; bind test"))
    for spec in profile.processes:
        plan.steps.append(Step(f"start {spec.name} ({spec.role}) and wait for {spec.probe.path} 200 on {spec.probe_host}:{spec.port}",
                               spec.start_timeout_s, f"{spec.probe.path} answers 200"))
    if conflicts and profile.rollback:
        plan.steps.append(Step(f"if {profile.name} fails to become ready: stop what started, start "
                               f"{', '.join('dsv4@' + c.instance for c in conflicts)} again", None, "rollback ready"))
    return plan


# ----------------------------------------------------------------------------- doing it


async def stop_instance(conflict: Conflict, timeout: float, units: Units | None, registry: Registry) -> float:
    """Stop one instance and wait until it is gone; returns seconds taken."""
    began = time.monotonic()
    if conflict.via == "systemd":
        if units is None:
            raise PreconditionError(f"refusing to start: dsv4@{conflict.instance} runs under systemd, and this daemon "
                                    "has no connection to it")
        await asyncio.to_thread(_systemd_stop_and_wait, units, conflict.instance, timeout)
    else:
        await _signal_recorded_daemon(conflict, registry, timeout)
    return time.monotonic() - began


async def _signal_recorded_daemon(conflict: Conflict, registry: Registry, timeout: float) -> None:
    """SIGTERM the daemon a registry record names (it stops its own processes in order).

    The PID is pinned with a pidfd first and the record checked again through it, so the
    signal reaches exactly the process that was verified, not one that reused its number.
    """
    pid = int(conflict.via.split()[1])
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        rec = next((r for r in registry.running() if r.instance == conflict.instance and r.pid == pid), None)
        if rec is None:
            return  # gone, or no longer the daemon its record describes: nothing of ours to stop
        signal.pidfd_send_signal(fd, signal.SIGTERM)
    finally:
        os.close(fd)
    await _wait_pid_exit(pid, timeout)


def _systemd_stop_and_wait(units: Units, instance: str, timeout: float) -> None:
    """StopUnit, then systemd's own JobRemoved for that job: the unit is inactive when it comes."""
    job = units.stop(service_name(instance), timeout=timeout)
    if job.result == "timeout-waiting":
        raise PreconditionError(f"refusing to start: dsv4@{instance} did not stop within {timeout:g} s")
    if not job.done:
        raise PreconditionError(f"refusing to start: stopping dsv4@{instance} ended {job.result!r}")


async def _wait_pid_exit(pid: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    gone = asyncio.Event()
    loop.add_reader(fd, gone.set)
    try:
        await asyncio.wait_for(gone.wait(), timeout)
    except TimeoutError:
        raise PreconditionError(f"refusing to start: daemon pid {pid} did not exit within {timeout:g} s") from None
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def start_instance(conflict: Conflict, units: Units | None) -> None:
    """Rollback: bring an instance we stopped back (only possible through systemd). Queued, not
    waited for: its start takes the transition lock we hold, so it runs once we have let go."""
    if conflict.via != "systemd" or units is None:
        raise SupervisorError(f"cannot restart dsv4@{conflict.instance}: it was not run by systemd")
    units.queue("StartUnit", service_name(conflict.instance))
