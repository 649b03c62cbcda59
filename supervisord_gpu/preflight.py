"""Before every start: the GPUs the profile needs exist and are idle, its ports are free.

A failure names every holder and starts nothing; a GPU index the machine lacks is a
configuration error pointing at the profile key.
"""

from __future__ import annotations

import asyncio

from .checks.gpus import GpuInventory, open_inventory
from .checks.preconditions import PreconditionReport, Requirement, check
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


async def check_profile(profile: Profile, inventory: GpuInventory) -> PreconditionReport:
    """Run the checks off the loop (NVML and socket tables may block) and return the report."""
    report = await asyncio.to_thread(check, requirement_for(profile), inventory)
    raise_for_missing(profile, report)
    return report


async def refuse_unless_clear(profile: Profile, inventory: GpuInventory) -> None:
    report = await check_profile(profile, inventory)
    if not report.ok:
        raise PreconditionError("refusing to start: " + "; ".join(report.problems()))
