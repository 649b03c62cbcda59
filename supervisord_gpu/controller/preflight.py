"""Before every start: the profile is valid in full, its GPUs exist and are idle, its ports free.

Everything that can fail is checked before anything running is touched. A GPU index the
machine lacks is a configuration error pointing at the profile key; a foreign holder stops
the start with its PID and command line. What is ours and in the way is the Transition's
(transition.py): a takeover on one machine, the cluster's transition across nodes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..checks.gpus import GpuInventory
from ..checks.gpu_room import room_problems
from ..checks.preconditions import PreconditionReport, Requirement, check
from ..config.model import DaemonConfig, Profile
from ..errors import ConfigError, PreconditionError
from .backends import Backends


def raise_for_missing(profile: Profile, report: PreconditionReport) -> None:
    if not report.missing_gpus:
        return
    total = report.gpu_count if report.gpu_count is not None else len(report.gpus)
    for spec in profile.processes:
        for i, g in enumerate(spec.gpus):
            if g in report.missing_gpus:
                raise ConfigError(
                    profile.path, f"servers.{spec.name}.gpus[{i}]", f"GPU {g} does not exist (this machine has {total} visible GPU(s))"
                )


def validate(profile: Profile, cfg: DaemonConfig, backends: Backends, warn: Callable[[str], None] | None = None) -> str:
    """Everything about a profile that can be known before anything runs, exactly as the daemon
    checks it before a start (so `gpusupctl check` and `switch --dry-run` say what it will say):
    its rendered command lines and users, every SGLang option against the SGLang that will run,
    the model paths (`backends` says against what: SGLang or its table, paths or not). Returns how
    the options were checked.

    With `warn` (a dry run), a model path that does not exist here is a warning, not an error:
    the plan is still worth seeing on a machine without the model.
    """
    from ..config.render import render, server_args

    render(profile, cfg, backends.programs)  # users exist; each flag the profile manages appears once
    if backends.programs.router_missing and any(spec.kind == "router" for spec in profile.processes):
        error = ConfigError(cfg.path or cfg.config_dir / "supervisord-gpu.toml", "sglang.router_command",
                            backends.programs.router_missing)
        if warn is None:
            raise error
        warn(f"warning: {error}")
    if profile.is_cluster and not cfg.cluster.etcd:
        raise ConfigError(cfg.path or cfg.config_dir, "cluster.etcd", f"is required: profile {profile.name} spans nodes "
                          "(it has [nodes]), and only etcd can order its steps across them")
    servers = [(spec.name, server_args(spec)) for spec in profile.processes if spec.kind == "server"]
    checks = backends.check_flags(servers)
    for c in checks:
        if not c.ok:
            raise ConfigError(profile.path, f"servers.{c.process}.options", f"rejected by {c.how}: {c.error}")
    if backends.model_paths_must_exist:
        for spec in profile.processes:
            if spec.model_path and not os.path.exists(spec.model_path):
                error = ConfigError(profile.path, f"servers.{spec.name}.model_path", f"{spec.model_path} does not exist")
                if warn is None:
                    raise error
                warn(f"warning: {error}")
    return checks[0].how if checks else "no servers"


def blocking_problems(report: PreconditionReport, conflicts: list) -> list[str]:
    """What a takeover cannot clear: holders that are not ours, or unattributed use outside our instances.

    A holder whose cgroup names one of the conflicting instances will go with it. Memory in
    use with no process listed (NVML does not always show one, e.g. in a VM or another PID
    namespace) on a GPU a conflicting instance uses is expected to clear with it; the wait
    after the takeover verifies that, and names the holders if it does not happen.
    """
    from ..checks.preconditions import _gpu_problem

    ours = {c.instance for c in conflicts}
    their_gpus = {g for c in conflicts for g in c.gpus}
    their_ports = {p for c in conflicts for p in c.ports}

    def blocking(holders: list, covered: bool) -> bool:
        if not holders:
            return not covered
        return any(h.owner is None or h.owner.instance not in ours for h in holders)

    lines = []
    for g in report.gpus:
        holders = report.gpu_holders.get(g.index, [])
        if not g.idle and blocking(holders, g.index in their_gpus):
            lines.append(_gpu_problem(g, holders))
    for p in report.ports:
        if not p.free and blocking(list(p.holders), p.port in their_ports):
            lines.append(p.problem() or f"port {p.port} not free")
    return lines


async def check_profile(profile: Profile, inventory: GpuInventory) -> PreconditionReport:
    """Run the checks off the loop (NVML and socket tables may block) and return the report."""
    import asyncio

    report = await asyncio.to_thread(check, Requirement.of(profile), inventory)
    raise_for_missing(profile, report)
    short = room_problems(profile, report.gpus, inventory.tolerance_mib)  # shared GPUs (checks/gpu_room.py)
    if short:
        raise PreconditionError("refusing to start: " + "; ".join(short))
    return report
