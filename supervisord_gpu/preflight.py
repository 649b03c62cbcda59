"""Before every start: the profile is valid in full, its GPUs exist and are idle, its ports free.

Everything that can fail is checked before anything running is touched. A GPU index the
machine lacks is a configuration error pointing at the profile key; a foreign holder stops
the start with its PID and command line; instances of ours in the way are taken over (when
the profile allows) by transition.py, then the GPUs and ports are verified clear.
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable

from .checks.gpus import GpuInventory, open_inventory
from .checks.preconditions import PreconditionReport, Requirement, check, wait_until_clear
from .config.model import DaemonConfig, Profile
from .errors import ConfigError, PreconditionError


def requirement_for(profile: Profile) -> Requirement:
    return Requirement(
        gpus=profile.gpus,
        ports=tuple((listen.host, listen.port, listen.label) for listen in profile.listens()),
    )


def inventory_for(cfg: DaemonConfig, rehearsal: bool) -> GpuInventory:
    if rehearsal or cfg.gpus.backend == "simulated":
        from .rehearsal.setup import prepare

        sim, _ = prepare(cfg)
        return open_inventory("simulated", simgpu_dir=str(sim.directory), tolerance_mib=cfg.gpus.idle_tolerance_mib)
    return open_inventory(
        "nvml", tolerance_mib=cfg.gpus.idle_tolerance_mib, baseline_mib=dict(cfg.gpus.baseline_mib) or None
    )


def raise_for_missing(profile: Profile, report: PreconditionReport) -> None:
    if not report.missing_gpus:
        return
    total = len(report.gpus)
    for spec in profile.processes:
        for i, g in enumerate(spec.gpus):
            if g in report.missing_gpus:
                raise ConfigError(
                    profile.path, f"servers.{spec.name}.gpus[{i}]", f"GPU {g} does not exist (this machine has {total} visible GPU(s))"
                )


def validate_in_full(profile: Profile, cfg: DaemonConfig) -> str:
    """Flags against the SGLang that will run, model paths; returns how the flags were checked."""
    from .sglang_flags import check_profile_flags

    checks = check_profile_flags(profile, use_real=False if cfg.rehearsal.enabled else None)
    for c in checks:
        if not c.ok:
            raise ConfigError(profile.path, f"servers.{c.process}.options", f"rejected by {c.how}: {c.error}")
    if not cfg.rehearsal.enabled:
        for spec in profile.processes:
            if spec.model_path and not os.path.exists(spec.model_path):
                raise ConfigError(profile.path, f"servers.{spec.name}.model_path", f"{spec.model_path} does not exist")
    return checks[0].how if checks else "no servers"


def foreign_problems(report: PreconditionReport, ours: set[str]) -> list[str]:
    """Problems not caused by one of our instances (which a takeover can clear)."""
    problems = []
    for gpu in report.gpus:
        if gpu.idle:
            continue
        holders = report.gpu_holders.get(gpu.index, [])
        if not holders or any(h.owner is None or h.owner.instance not in ours for h in holders):
            problems.append(next((p for p in report.problems() if p.startswith(f"GPU {gpu.index} ")), f"GPU {gpu.index} not idle"))
    for port in report.ports:
        if port.free:
            continue
        if not port.holders or any(h.owner is None or h.owner.instance not in ours for h in port.holders):
            problems.append(next((p for p in report.problems() if f":{port.port} " in p or f":{port.port}" in p.split(" held")[0]),
                                 f"port {port.port} not free"))
    return problems


async def check_profile(profile: Profile, inventory: GpuInventory) -> PreconditionReport:
    """Run the checks off the loop (NVML and socket tables may block) and return the report."""
    report = await asyncio.to_thread(check, requirement_for(profile), inventory)
    raise_for_missing(profile, report)
    return report


async def prepare_start(profile: Profile, cfg: DaemonConfig, inventory: GpuInventory, say: Callable[[str, int], None],
                        progress: Callable[[str], None] = lambda _m: None) -> list:  # type: ignore[type-arg]
    """Validate, take over what is in the way, verify clear. Returns the instances stopped (for rollback)."""
    from . import transition

    how = await asyncio.to_thread(validate_in_full, profile, cfg)
    report = await check_profile(profile, inventory)
    conflicts = await asyncio.to_thread(transition.find_conflicts, profile, cfg)
    ours = {c.instance for c in conflicts}
    foreign = foreign_problems(report, ours)
    if foreign:
        raise PreconditionError("refusing to start: " + "; ".join(foreign))
    if conflicts and not profile.takeover:
        raise PreconditionError("refusing to start: " + "; ".join(f"{c.describe()} is running" for c in conflicts)
                                + " (takeover = false in the profile)")
    stopped = []
    if conflicts:
        plan = transition.make_plan(profile, cfg, conflicts, how)
        say(plan.render(), 6)
        for c in conflicts:
            progress(f"stopping dsv4@{c.instance}")
            took = await transition.stop_instance(c, cfg, c.stop_deadline_s)
            stopped.append(c)
            say(f"transition: dsv4@{c.instance} stopped in {took:.2f} s", 6)
    if conflicts or not report.ok:
        progress("waiting for GPUs idle and ports free")
        loop = asyncio.get_running_loop()
        began = loop.time()
        await wait_until_clear(requirement_for(profile), inventory, cfg.gpus.wait_idle_timeout_s,
                               on_progress=lambda r: progress("still held: " + "; ".join(r.problems())[:200]))
        say(f"GPUs {sorted(profile.gpus)} verified idle and ports free in {loop.time() - began:.3f} s", 6)
    return stopped


async def refuse_unless_clear(profile: Profile, inventory: GpuInventory) -> None:
    report = await check_profile(profile, inventory)
    if not report.ok:
        raise PreconditionError("refusing to start: " + "; ".join(report.problems()))
