"""The per-node agent (`supervisord-gpu agent`, unit gpusup-agent.service): Patroni's shape.

It keeps this node alive in etcd (a lease it renews; gone with it, the node is gone), watches
for the cluster transition under way, and carries out this node's share of each of its steps on
this node only: `systemctl stop dsv4@OLD` / `start dsv4@NEW` through systemd's D-Bus API, and
the verification that this node's GPUs are idle by its own NVML and its ports free. It reports
each share (done, or failed with the reason and the holders) and never starts a step before
every node has reported the one before. It never touches another machine and never kills
anything itself: the units' own daemons stop their processes in order (cluster/gate.py).
"""

from __future__ import annotations

import asyncio
import os
import traceback
import threading
import time
from collections.abc import Callable
from typing import Any

from ..checks.gpus import GpuInventory
from ..checks.preconditions import Requirement, wait_until_clear
from ..config.cluster import insecure_warning
from ..config.loader import load_profile, profile_path
from ..config.model import DaemonConfig, Profile
from ..errors import SupervisorError
from ..names import service_name
from .dcs import DCS, ClusterUnavailable, NodeLost, StepFailed
from .plan import ClusterPlan, Step, _placed
from .records import GpuRecord, NodeRecord, StepReport, TransitionKind

STEP_WAIT_S = 3600.0  # the previous step's own deadlines (the coordinator's) end it sooner
#: A profile file that is there but does not parse is read again for this long before a plan
#: naming it is ignored: an editor writing it in place leaves it empty or half-written for a
#: moment, and an ignored rollback leaves this node's part stopped and the lock held for its lease
#: (seen in test_cluster_decisions under load). A missing file is not waited for.
PROFILE_SETTLE_S = 3.0
PROFILE_REREAD_S = 0.2


class Units:
    """This node's dsv4@ units, through systemd (the one systemd client)."""

    def __init__(self) -> None:
        from ..systemd.manager import Systemd

        self.systemd = Systemd()

    def stop(self, instance: str) -> str:
        result = self.systemd.stop(service_name(instance), timeout=STEP_WAIT_S)
        return "" if result.result in ("done", "skipped") else f"stop of {result.unit}: {result.result}"

    def start(self, instance: str) -> str:
        """Start (or join the start already under way) and wait until it is ready or failed."""
        unit = service_name(instance)
        result = self.systemd.start(unit, timeout=STEP_WAIT_S)
        if result.done:
            return ""
        info = self.systemd.instance(instance)
        why = info.status_text if info is not None and info.status_text else result.result
        return f"start of {unit}: {why}"

    def states(self) -> dict[str, str]:
        return {u.instance: u.active for u in self.systemd.instances()}


class NodeAgent:
    def __init__(self, cfg: DaemonConfig, store: DCS, units: Any, inventory: GpuInventory,
                 say: Callable[[str, int], None]) -> None:
        self.cfg, self.store, self.units, self.inventory, self.say = cfg, store, units, inventory, say
        self.node = cfg.cluster.node
        self.lease: Any = None
        self.done: set[str] = set()
        self.stopping = threading.Event()
        self.on_joined: Callable[[], Any] = lambda: None  # READY=1, once this node is in etcd
        store.warn = lambda message: say(message, 4)  # a bad record in etcd: one line in our journal
        #: errors of our own the loop survived (a bug, never a record: records are parsed): 0 in every test
        self.internal_errors = 0

    # -- life ------------------------------------------------------------------------------

    def run(self) -> int:
        if warning := insecure_warning(self.cfg.cluster):
            self.say(warning, 4)
        self.lease = self.store.grant()
        self.announce()
        self.say(f"agent of node {self.node}: in etcd at {self.store.endpoint} (lease TTL {self.cfg.cluster.lease_ttl_s} s)", 6)
        threading.Thread(target=self._keep_alive, name="etcd-lease", daemon=True).start()
        self.on_joined()
        while not self.stopping.is_set():
            self.once()
        try:
            self.store.revoke(self.lease)
        except ClusterUnavailable:
            pass
        return 0

    def once(self) -> None:
        """One turn of the loop: the transition under way, if new, carried out; then a watch.
        Survives anything: etcd away is said and waited out, and an error of our own is said
        with its traceback and the loop goes on (a plan is never retried: its id is done)."""
        try:
            current = self.store.current()
            # the watch follows on from this read, not from the last read of carrying it out:
            # a transition written meanwhile is taken up at once, not at the next change
            read = self.store.last_read()
            if current is not None and current[0] not in self.done:
                tid, plan = current
                self.done.add(tid)
                problem = self.inadmissible(plan)
                if problem:
                    self.say(f"ignoring transition {tid}: {problem}", 3)
                else:
                    self.carry_out(tid, plan)
            self.store.watch_current(max(0.5, self.cfg.cluster.lease_ttl_s / 3), since=read)
        except ClusterUnavailable as e:
            self.say(f"{e}; no cross-node change can start, what runs keeps running", 4)
            self.stopping.wait(2.0)
        except Exception as e:  # noqa: BLE001 - the agent must outlive its own bugs
            self.internal_errors += 1
            self.say(f"agent: internal error, going on: {type(e).__name__}: {e}: "
                     + " | ".join(traceback.format_exc().splitlines()[-6:]), 3)
            self.stopping.wait(2.0)

    def inadmissible(self, plan: ClusterPlan) -> str:
        """Why this node must not obey a well-formed plan, or "": every unit it names is a
        profile in this node's profile directory that spans nodes (a single-machine instance is
        never the agent's to touch), on a node of that profile, with processes placed there."""
        profiles: dict[str, Profile] = {}
        for step in plan.steps:
            for work in step.work:
                if work.instance not in profiles:
                    try:
                        profiles[work.instance] = self._load_settled(work.instance)
                    except SupervisorError as e:
                        return f"it names {work.instance}, which is not a profile here: {str(e).splitlines()[0]}"
                profile = profiles[work.instance]
                if not profile.is_cluster:
                    return f"it names {work.instance}, which does not span nodes (the agent never touches it)"
                if work.node not in dict(profile.nodes):
                    return f"it names node {work.node} for {work.instance}, which has no such node"
                here = {spec.name for spec in profile.processes if work.node in _placed(spec)}
                stray = [p for p in work.processes if p not in here]
                if stray:
                    return f"it names {stray[0]} of {work.instance} on node {work.node}, which does not run there"
        return ""

    def _load_settled(self, name: str) -> Profile:
        """The whole profile `name`; one that exists but does not parse is read again every
        PROFILE_REREAD_S until PROFILE_SETTLE_S have passed (a write in place under way), then its
        error is raised, saying how long it was read for."""
        deadline = time.monotonic() + PROFILE_SETTLE_S
        while True:
            try:
                return load_profile(self.cfg, name, True)
            except SupervisorError as e:
                try:
                    there = profile_path(self.cfg, name).is_file()
                except SupervisorError:
                    there = False
                if not there:
                    raise
                if time.monotonic() >= deadline or self.stopping.wait(PROFILE_REREAD_S):
                    raise SupervisorError(f"{str(e).splitlines()[0]} (read for {PROFILE_SETTLE_S:g} s)") from e

    def _keep_alive(self) -> None:
        every = max(0.5, self.cfg.cluster.lease_ttl_s / 3)
        while not self.stopping.wait(every):
            try:
                if not self.store.refresh(self.lease):  # presumed dead meanwhile: come back as new
                    self.lease = self.store.grant()
                self.announce()
            except ClusterUnavailable:
                pass  # said by the main loop

    def announce(self) -> None:
        """This node's record: its dsv4@ units and its GPUs by its own NVML, for `status --cluster`."""
        try:
            parts: dict[str, str] = self.units.states()
        except SupervisorError:
            parts = {}
        gpus: tuple[GpuRecord, ...]
        try:
            gpus = tuple(GpuRecord(g.index, g.in_use_mib, g.total_mib, g.idle) for g in self.inventory.snapshot())
        except SupervisorError as e:
            gpus = (GpuRecord(error=str(e).splitlines()[0]),)
        self.store.announce(NodeRecord(self.node, os.getpid(), tuple(sorted(parts.items())), gpus, time.time()),
                            self.lease)

    # -- a transition ------------------------------------------------------------------------

    def carry_out(self, tid: str, plan: ClusterPlan) -> None:
        previous: Step | None = None
        for step in plan.steps:
            if self.node in step.nodes():
                if previous is not None:
                    try:
                        self.store.wait_step(tid, previous.number, previous.nodes(), time.monotonic() + STEP_WAIT_S,
                                             self.stopping.is_set)
                    except (StepFailed, NodeLost, TimeoutError) as e:
                        self.say(f"transition {tid} to {plan.target} abandoned before step {step.number}: {e}", 4)
                        return
                if not self._under_way(tid):
                    self.say(f"transition {tid} to {plan.target} abandoned before step {step.number}: it is no "
                             "longer under way (its coordinator's lease ended, or another transition replaced it)", 4)
                    return
                self.say(f"transition {tid} to {plan.target}: step {step.number}: {step.describe().splitlines()[0]}", 6)
                result = self.do(step)
                self.store.report(tid, step.number, self.node, result, self.lease)
                if result.state != "done":
                    self.say(f"step {step.number} failed here: {result.reason}", 3)
                    return
            previous = step
        self._release_if_finished(tid, plan)

    def _under_way(self, tid: str) -> bool:
        """`tid` is still the transition under way: `current` goes with its writer's lease, so a
        coordinator that died (or gave up) takes its plan with it, and no later step begins."""
        current = self.store.current()
        return current is not None and current[0] == tid

    def _release_if_finished(self, tid: str, plan: ClusterPlan) -> None:
        """A plan nobody coordinates any more (a rollback) ends with its last step: whoever
        sees every node's report of it frees the lock, if the lock is still that plan's."""
        holder = self.store.holder()
        if not holder or holder.tid != tid or not plan.steps or holder.kind is not TransitionKind.ROLLBACK:
            return
        last = plan.steps[-1]
        if set(self.store.reports(tid, last.number)) >= set(last.nodes()):
            self.store.release(holder)
            self.say(f"{plan.target}: done on {', '.join(last.nodes())}; cluster lock released", 6)

    def do(self, step: Step) -> StepReport:
        mine = [w for w in step.work if w.node == self.node]
        try:
            for work in mine:
                why = ""
                if step.action == "stop":
                    why = self.units.stop(work.instance)
                elif step.action == "start":
                    why = self.units.start(work.instance)
                else:
                    why = self.verify(work.instance)
                if why:
                    return StepReport("failed", why)
        except SupervisorError as e:
            return StepReport("failed", str(e).splitlines()[0])
        return StepReport("done", at=time.time())

    def verify(self, instance: str) -> str:
        """This node's part of `instance`: its GPUs idle by our own NVML, its ports free."""
        part = load_profile(self.cfg, instance)
        try:
            asyncio.run(wait_until_clear(Requirement.of(part), self.inventory, self.cfg.gpus.wait_idle_timeout_s))
        except SupervisorError as e:
            return f"node {self.node}: {str(e).splitlines()[0]}"
        return ""
