"""The start of a profile that spans nodes, on the node where it was asked for.

`systemctl start dsv4@TO` (or `gpusupctl switch TO`) on any node starts that node's daemon; for
a cluster profile its pre-flight is this instead of the single-machine takeover:

1. if a cluster transition to TO is already under way (another node coordinates it, and our
   agent started us as its step), only verify this node's GPUs and ports, then start;
2. otherwise coordinate one: take the cluster-wide lock (a lease: it goes with us if we die;
   a second switch waits for it, saying whose it is), compute the plan from the profiles that
   run on the cluster now, write it, and follow it step by step as the nodes' agents carry it
   out -- stop what is in the way, verify on every node -- then start our own part while the
   agents start theirs. A step that fails, or a node lost on the way, fails the start naming
   the node; what was stopped is started again (rollback), by the agents, under a lock of its
   own so that nothing else starts in between.

What the coordinator must remember for a later rollback (its plan, the steps done, its lock) is
returned as a `LedTransition`, kept by the controller's ClusterTransition (controller/transition.py)
until the start succeeded or failed; nothing of it is left on the gate.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ..checks.gpus import GpuInventory
from ..config.loader import load_profile
from ..config.model import DaemonConfig, Profile
from ..errors import PreconditionError, StartError, SupervisorError, TakeoverFailed
from ..records import dataclass
from .dcs import DCS, NodeLost, StepFailed
from .gate import ClusterGate, in_worker
from .plan import ClusterPlan, NodeWork, Step, plan_switch
from .records import LockRecord, TransitionKind

STOP_STEP_DEADLINE_S = 900.0
VERIFY_SLACK_S = 30.0
ROLLBACK_LOCK_TTL_S = 300


@dataclass(frozen=True)
class LedTransition:
    """What the coordinating daemon remembers of the transition it led, for a rollback."""

    plan: ClusterPlan
    done: tuple[Step, ...]
    me: LockRecord


def _acquire(store: DCS, lease: int, me: LockRecord) -> tuple[LockRecord | None, int]:
    """Take the lock, or say who holds it, with the revision of acquire's own read of it: the
    wait for its release follows on from that read. Without it the wait followed on from
    whatever its (other) worker thread had read last: an old revision woke it at once, none
    missed a release in between."""
    held = store.acquire(lease, me)
    return held, store.last_read()


async def prepare_cluster_start(part: Profile, cfg: DaemonConfig, inventory: GpuInventory, gate: ClusterGate,
                                say: Callable[[str, int], None], progress: Callable[[str], None],
                                verify_locally: Callable[[], Awaitable[Any]]) -> LedTransition | None:
    """Make room for `part` across the cluster; what was led (for a rollback of our own failed
    start), or None when another node coordinates and this one only verified."""
    store = gate.store
    holder = await asyncio.to_thread(store.holder)  # a genuine lock only: bound to a live lease, well-formed
    if holder and part.name in holder.starting and await asyncio.to_thread(_plan_agrees, store, holder, part.name,
                                                                           cfg.cluster.node):
        progress(f"cluster transition to {part.name} (coordinated by node {holder.node}): verifying this node")
        await verify_locally()
        return None
    whole = await asyncio.to_thread(load_profile, cfg, part.name, True)
    tid = "t" + uuid.uuid4().hex[:12]  # never a JSON number
    me = LockRecord(cfg.cluster.node, part.name, TransitionKind.SWITCH, (part.name,), os.getpid(), tid)
    while True:
        held, seen = await asyncio.to_thread(_acquire, store, gate.lease, me)
        if held is None:
            break
        progress(f"waiting for the cluster transition to {held.to} (coordinated by node {held.node})")
        await asyncio.to_thread(store.watch_lock, 1.0, seen)
    try:
        running = await asyncio.to_thread(running_profiles, store, cfg, part.name, say)
    except SupervisorError:
        await asyncio.to_thread(store.release, me)
        raise
    plan = plan_switch(whole, running)
    say(plan.render(), 6)
    await asyncio.to_thread(store.put_plan, tid, plan, gate.lease)
    done: list[Step] = []
    step: Step | None = None
    try:
        for step in plan.steps:
            if step.action == "start":
                break  # ours is this daemon's own start; the agents start the other nodes' parts
            progress(f"cluster step {step.number}/{len(plan.steps)}: {step.describe().splitlines()[0]}")
            deadline = time.monotonic() + (STOP_STEP_DEADLINE_S if step.action == "stop"
                                           else cfg.gpus.wait_idle_timeout_s + VERIFY_SLACK_S)
            try:
                await waited(store, tid, step, deadline, gate.closing)
            except TimeoutError as e:
                raise StartError(f"cluster step {step.number} ({step.action}) {e}") from None
            done.append(step)
            say(f"cluster step {step.number} done on {', '.join(step.nodes())}", 6)
    except (StepFailed, NodeLost, StartError) as e:
        if step is not None and step.action == "stop":  # where it did stop, it starts again
            partly = await asyncio.to_thread(stopped_where_it_could, store, tid, step)
            done += [partly] if partly is not None else []
        await asyncio.to_thread(roll_back, store, plan, done, me, False)
        stopped = any(s.action == "stop" for s in done)
        reason = (f"cluster transition to {part.name} failed: {e}"
                  + (f"; rolling back: the agents start {', '.join(plan.stopping)} again" if stopped else ""))
        raise (TakeoverFailed(reason) if stopped else PreconditionError(reason)) from None
    asyncio.get_running_loop().create_task(_release_when_started(store, plan, tid, me, say, gate.closing))
    return LedTransition(plan, tuple(done), me)


def stopped_where_it_could(store: DCS, tid: str, step: Step) -> Step | None:
    """The part of a stop step that failed which is to start again: the nodes that reported
    it done (their part is stopped). Not the node whose stop failed: whether its unit still
    runs is unknown (a refused stop left it running; the failure names the node and the
    reason), and a start there is no rollback of anything we did. Nor a node lost on the way:
    no agent there would carry its share out. None when no node reported it done."""
    stopped = {n for n, r in store.reports(tid, step.number).items() if r.state == "done"}
    work = tuple(w for w in step.work if w.node in stopped)
    return Step(step.number, step.action, work) if work else None


def _plan_agrees(store: DCS, holder: LockRecord, instance: str, node: str) -> bool:
    """A lock that names a transition with a plan proves it only if that plan is bound to the
    lock's own lease and starts `instance` on this node; a plan of another lease, or a bad one,
    means the lock is not what it says (someone wrote it beside a real transition)."""
    if not holder.tid:
        return True
    found = store.plan(holder.tid)
    if found is None:
        # a coordinator writes its plan before any daemon it starts can look: a lock naming a
        # transition with no plan (or a bad one) is not a transition this daemon is part of
        return False
    plan, lease = found
    return lease == holder.lease and any(s.action == "start" and any(w.node == node and w.instance == instance
                                                                     for w in s.work) for s in plan.steps)


def running_profiles(store: DCS, cfg: DaemonConfig, starting: str, say: Callable[[str, int], None]) -> list[Profile]:
    """The whole profiles that run on the cluster now (but `starting`), by their daemons' records.
    A record of an instance that is no profile spanning nodes here (a stray record, a single-machine
    name) is named and left out: it can never fail another profile's start. Left out, what really
    holds GPUs still fails the verify step, naming the holder."""
    out: list[Profile] = []
    for name in store.running_instances():
        if name == starting:
            continue
        try:
            profile = load_profile(cfg, name, True)
        except SupervisorError as e:
            say(f"ignoring the process records of {name} in etcd: {str(e).splitlines()[0]}", 4)
            continue
        if not profile.is_cluster:
            say(f"ignoring the process records of {name} in etcd: it does not span nodes", 4)
            continue
        out.append(profile)
    return out


def roll_back_failed_start(store: DCS, t: LedTransition | None) -> str:
    """Our own start failed after the transition `t` had stopped what was in the way: the agents
    stop the new profile's parts everywhere, then start the old ones again. Returns what is said."""
    if t is None or not any(s.action == "stop" for s in t.done):
        return ""
    roll_back(store, t.plan, list(t.done), t.me, True)
    return f"rolling back: the agents stop {t.plan.target} on every node and start {', '.join(t.plan.stopping)} again"


async def waited(store: DCS, tid: str, step: Step, deadline: float, closing: threading.Event) -> Any:
    """store.wait_step in a worker thread that ends when we are cancelled or the daemon exits."""
    return await in_worker(lambda aborted: store.wait_step(tid, step.number, step.nodes(), deadline, aborted), closing)


#: while our part loads: how long to wait before reading the other nodes' reports again, after
#: etcd did not answer or a node's agent was gone (neither says that its part failed)
PEERS_RETRY_S = 2.0


async def peers_started(store: DCS, t: LedTransition, closing: threading.Event,
                        say: Callable[[str, int], None]) -> None:
    """Until every other node's part of the start we led reported: returns once all are up (or
    after an hour, no verdict); raises StepFailed as soon as one reported its part failed.

    Why: our own part may wait for theirs (rank 0 of a TP spanning nodes waits for rank 1 for
    ever), so a peer that failed at once left us loading until our own start_timeout (minutes
    for a big model) before anything was rolled back. Only a failed report fails us: etcd out
    of reach for a moment, or a node's agent gone (restarted, partitioned; its part is run by
    its daemon, not by the agent), says nothing about that part, and our start goes on, bounded
    by its own start_timeout; each is said once."""
    start = t.plan.steps[-1]
    others = tuple(w for w in start.work if w.node != t.me.node)
    if start.action != "start" or not others:
        return
    deadline = time.monotonic() + 3600
    said: set[str] = set()
    while True:
        try:
            await waited(store, t.me.tid, Step(start.number, start.action, others), deadline, closing)
            return
        except StepFailed:
            raise
        except TimeoutError:
            return
        except SupervisorError as e:  # NodeLost, ClusterUnavailable: no verdict on that part
            kind = type(e).__name__
            if kind not in said:
                said.add(kind)
                say(f"cluster transition to {t.plan.target}: {str(e).splitlines()[0]}; this node's part goes on "
                    "loading (only a part reported failed fails it)", 4)
        await asyncio.sleep(PEERS_RETRY_S)


async def _release_when_started(store: DCS, plan: ClusterPlan, tid: str, me: LockRecord,
                                say: Callable[[str, int], None], closing: threading.Event) -> None:
    """The lock is held until every node's part reported its start (ready or failed)."""
    start = plan.steps[-1]
    try:
        await waited(store, tid, start, time.monotonic() + 3600, closing)
        say(f"cluster transition to {plan.target} done: every node's part is ready", 6)
    except SupervisorError as e:
        say(f"cluster transition to {plan.target}: {e}", 3)
    except TimeoutError:
        pass
    finally:
        try:
            await asyncio.to_thread(store.release, me)
        except SupervisorError:
            pass


def roll_back(store: DCS, plan: ClusterPlan, done: list[Step], me: LockRecord, stop_target: bool) -> None:
    """Start again what the failed transition stopped, on every node, by the agents (after
    stopping the new profile's parts, when they had started); under a lock of its own (a lease
    that outlives us), so that nothing else starts in between."""
    stopped = [s for s in done if s.action == "stop"]
    store.release(me)
    if not stopped:
        return
    lease = store.grant(ROLLBACK_LOCK_TTL_S)
    tid = "t" + uuid.uuid4().hex[:12]  # never a JSON number
    rollback = LockRecord(me.node, plan.target, TransitionKind.ROLLBACK, tuple(s.work[0].instance for s in stopped),
                          me.pid, tid)
    if store.acquire(lease, rollback) is not None:
        return  # someone else's transition came first: it decides what runs now
    steps: list[Step] = []
    if stop_target:
        steps.append(Step(1, "stop", plan.steps[-1].work))
    for s in stopped:
        steps.append(Step(len(steps) + 1, "start", tuple(NodeWork(w.node, w.instance, w.processes) for w in s.work)))
    store.put_plan(tid, ClusterPlan(rollback.to, (), tuple(steps)), lease)
