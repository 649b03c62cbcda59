"""How a start makes room, and how a failed one undoes it: decided once, when the daemon is assembled.

A start is the same everywhere (validate, take the machine's transition lock, make room, start
every process in order); what "make room" means is the one variation, and it is chosen once in
daemon.py from the profile, not branched on in the middle of the start:

    LocalTransition     one machine: stop our instances that hold the profile's GPUs or ports
                        (takeover.py), verify them clear; on failure start them again
    ClusterTransition   a profile that spans nodes: the cluster lock, the plan and the agents
                        through etcd (cluster/coordinator.py); on failure the agents roll back

The controller calls `prepare` between the instance's own prepare and its start, and
`roll_back` when the start failed; each returns what the controller reports. A switch
(`gpusupctl switch`, or starting a profile while another runs) is `prepare`: the takeover, or
the cluster transition. `LocalTransition.plan` is `prepare` deciding without doing: `gpusupctl
switch --dry-run` asks it, so the dry run refuses and plans exactly as the daemon will.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..checks.gpus import GpuInventory, NvmlUnavailable
from ..checks.preconditions import PreconditionReport, Requirement, wait_until_clear
from ..config.model import DaemonConfig, Profile
from ..errors import PreconditionError, SupervisorError, TakeoverFailed
from . import takeover
from .backends import Backends
from .preflight import blocking_problems, check_profile
from .registry import Registry
from .units import Units

if TYPE_CHECKING:  # the cluster's modules are loaded only for a profile that spans nodes
    from ..cluster.coordinator import LedTransition
    from ..cluster.gate import ClusterGate

#: (message, syslog priority, GPUSUP_EVENT=): "transition" or "rollback"
Say = Callable[[str, int, str], None]
Progress = Callable[[str], None]


class Transition(Protocol):
    async def prepare(self, how: str, progress: Progress) -> None:
        """Make room for the profile (GPUs idle, ports free), or raise without touching anything
        when that is not ours to do. `how` says how the profile's flags were checked."""

    async def roll_back(self, error: SupervisorError, reason: str) -> str | None:
        """After a failed start: undo what `prepare` stopped. The reason to report (it then is a
        TakeoverFailed, exit 5), or None when nothing had been stopped."""

    async def peers_started(self) -> None:
        """While our own start runs: returns once the parts of the same start on other nodes
        are up (at once where there are none); raises the failure of the first that failed."""

    def came_from(self) -> str:
        """What the last `prepare` stopped, for the transition metric ("-" for nothing)."""

    def took_over(self) -> bool:
        """Whether the last `prepare` stopped anything."""


class LocalTransition:
    """One machine: our instances in the way are stopped (the profile allows it: takeover = true),
    then GPUs and ports verified clear; a failed start starts them again (rollback = true).

    Its collaborators come in from the assembly (daemon.py): systemd's units (None where the
    daemon does not run under systemd: then only the registry's daemons are ours to stop) and
    the registry of this machine's daemons. `gpusupctl switch --dry-run` asks `plan` of the same
    object, so the dry run refuses and plans exactly as the daemon will."""

    def __init__(self, profile: Profile, cfg: DaemonConfig, backends: Backends, say: Say,
                 units: Units | None, registry: Registry) -> None:
        self.profile, self.cfg, self.backends, self.say = profile, cfg, backends, say
        self.units, self.registry = units, registry
        #: filled as each is stopped, so that a failure later on (the wait for idle GPUs times
        #: out: something foreign grabbed a port mid-transition) still knows what to start again
        self.stopped: list[takeover.Conflict] = []

    async def plan(self, how: str, warn: Callable[[str], None] | None = None) -> takeover.Plan:
        """What `prepare` would do now, touching nothing; raises the refusal it would raise (a
        holder that is not ours, or ours in the way with takeover = false), exit 3.

        With `warn` (a dry run), GPUs that cannot be read here (no NVML on this machine) are a
        warning, and the plan is made without their holders: it is still worth seeing."""
        plan, _ = await self._decide(how, warn)
        return plan

    async def _decide(self, how: str, warn: Callable[[str], None] | None = None
                      ) -> tuple[takeover.Plan, PreconditionReport | None]:
        profile = self.profile
        report: PreconditionReport | None = None
        try:
            report = await check_profile(profile, self.backends.inventory)
        except NvmlUnavailable as e:
            if warn is None:
                raise
            warn(f"warning: {e} (the plan below does not check the GPUs' holders)")
        conflicts = await asyncio.to_thread(takeover.find_conflicts, profile, self.cfg, self.units, self.registry)
        foreign = blocking_problems(report, conflicts) if report is not None else []
        if foreign:
            raise PreconditionError("refusing to start: " + "; ".join(foreign))
        if conflicts and not profile.takeover:
            raise PreconditionError("refusing to start: " + "; ".join(f"{c.describe()} is running" for c in conflicts)
                                    + " (takeover = false in the profile)")
        return takeover.make_plan(profile, self.cfg, conflicts, how), report

    async def prepare(self, how: str, progress: Progress) -> None:
        self.stopped = []
        profile, cfg = self.profile, self.cfg
        plan, report = await self._decide(how)
        conflicts = plan.conflicts
        if conflicts:
            self.say(plan.render(), 6, "transition")
            for c in conflicts:
                progress(f"stopping dsv4@{c.instance}")
                took = await takeover.stop_instance(c, c.stop_deadline_s, self.units, self.registry)
                self.stopped.append(c)
                self.say(f"transition: dsv4@{c.instance} stopped in {took:.2f} s", 6, "transition")
        if conflicts or report is None or not report.ok:
            progress("waiting for GPUs idle and ports free")
            loop = asyncio.get_running_loop()
            began = loop.time()
            await wait_until_clear(Requirement.of(profile), self.backends.inventory, cfg.gpus.wait_idle_timeout_s,
                                   on_progress=lambda r: progress("still held: " + "; ".join(r.problems())[:200]))
            self.say(f"GPUs {sorted(profile.gpus)} verified idle and ports free in {loop.time() - began:.3f} s", 6,
                     "transition")

    async def clear_gpus_for_restore(self, progress: Progress) -> None:
        """The switch back to a parked profile (controller/parking.py): our instances on its GPUs
        or ports stopped, as a switch stops them, then its GPUs verified idle. Its ports are not
        waited for: its own front ends hold them, parked, and parking refused any profile that
        needed them (a router it stopped instead binds its port again at the restore, and names
        whoever holds it). A holder not ours is never stopped: the wait then times out and says who."""
        self.stopped = []
        conflicts = await asyncio.to_thread(takeover.find_conflicts, self.profile, self.cfg, self.units, self.registry)
        for c in conflicts:
            progress(f"stopping dsv4@{c.instance}")
            took = await takeover.stop_instance(c, c.stop_deadline_s, self.units, self.registry)
            self.stopped.append(c)
            self.say(f"transition: dsv4@{c.instance} stopped in {took:.2f} s (switching back to the parked "
                     f"{self.profile.name})", 6, "transition")
        progress("waiting for GPUs idle")
        await wait_until_clear(Requirement(gpus=frozenset(self.profile.gpus)), self.backends.inventory,
                               self.cfg.gpus.wait_idle_timeout_s)
        self.stopped = []  # nothing to roll back: a restore that fails starts this profile cold

    async def roll_back(self, error: SupervisorError, reason: str) -> str | None:
        if not self.stopped:
            return None
        names = ", ".join(f"dsv4@{c.instance}" for c in self.stopped)
        if not self.profile.rollback:
            return f"{reason} (after taking over {names}; rollback = false: they stay stopped)"
        rolled, failed = [], []
        for c in self.stopped:
            try:
                await asyncio.to_thread(takeover.start_instance, c, self.units)
                rolled.append(f"dsv4@{c.instance}")
            except SupervisorError as e:
                failed.append(f"dsv4@{c.instance} ({e})")
        self.say(f"rollback: {self.profile.name} failed to start; " + (", ".join(rolled) or "none") + " started again",
                 4 if not failed else 3, "rollback")
        return (f"{reason} (after taking over {names}; rolled back: "
                + (", ".join(rolled) + " started again" if rolled else "nothing")
                + (f"; rollback failed: {'; '.join(failed)}" if failed else "") + ")")

    async def peers_started(self) -> None:
        return  # one machine: no part of this start runs elsewhere

    def came_from(self) -> str:
        return ",".join(c.instance for c in self.stopped) or "-"

    def took_over(self) -> bool:
        return bool(self.stopped)


class ClusterTransition:
    """A node's part of a profile that spans nodes: the cluster's transition through etcd (the
    coordinator when this node leads it, a verify of this node when another node does).

    It owns what a rollback needs: the transition this daemon led (its plan, the steps done and
    its lock), set by `prepare` and read by `roll_back`; None when another node led it."""

    def __init__(self, profile: Profile, cfg: DaemonConfig, inventory: GpuInventory, gate: ClusterGate, say: Say) -> None:
        self.profile, self.cfg, self.inventory, self.gate, self.say = profile, cfg, inventory, gate, say
        self.led: LedTransition | None = None

    async def prepare(self, how: str, progress: Progress) -> None:
        from ..cluster.coordinator import prepare_cluster_start

        self.led = None
        profile, inventory = self.profile, self.inventory

        async def verify_here() -> None:
            await check_profile(profile, inventory)
            await wait_until_clear(Requirement.of(profile), inventory, self.cfg.gpus.wait_idle_timeout_s)

        self.led = await prepare_cluster_start(profile, self.cfg, inventory, self.gate,
                                               lambda message, priority: self.say(message, priority, "transition"),
                                               progress, verify_here)

    async def roll_back(self, error: SupervisorError, reason: str) -> str | None:
        if isinstance(error, TakeoverFailed):  # the coordinator has rolled back already
            return None
        from ..cluster.coordinator import roll_back_failed_start

        said = await asyncio.to_thread(roll_back_failed_start, self.gate.store, self.led)
        if not said:
            return None
        self.say(f"rollback: {said}", 4, "rollback")
        return f"{reason} (cluster transition; {said})"

    async def peers_started(self) -> None:
        if self.led is None:
            return  # another node leads: its coordinator watches every part, ours included
        from ..cluster.coordinator import peers_started

        await peers_started(self.gate.store, self.led, self.gate.closing,
                            lambda message, priority: self.say(message, priority, "transition"))

    def came_from(self) -> str:
        return "-"

    def took_over(self) -> bool:
        return False
