"""The cluster's decisions, unit-tested against the in-memory store: who wins the transition
lock, what a waiting step does when a node's lease ends (it names the node), the order of a
plan's steps, what is rolled back when a step fails, what an agent does with a plan that names
its node, another node or a single-machine instance, what the gate lets a daemon do (coordinate,
or only verify, or wait), and what a revoked lease, a repeated plan or an older transition's
records change.

Everything here runs the product's own ClusterStore, NodeAgent, ClusterGate and coordinator
over `MemoryKV` (cluster/kv.py: etcd's semantics in a dict, a key bound to a lease goes with
it), with units that only record what they are told (tests/cluster_fixtures.py): no etcd, no
process, no container, each decision in milliseconds. Lease expiry is driven by a clock the
test moves, not by sleeping. The three-host tests in test_cluster_systemd.py keep one wiring
case per behaviour (a real etcd, systemd and the .deb); the cases of each decision are here."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cluster_fixtures import FakeUnits, NoGpus, memory_store, node_config
from supervisord_gpu.checks.gpus import GpuInventory
from supervisord_gpu.cluster import kv as kv_module
from supervisord_gpu.cluster import coordinator as coordinator_module
from supervisord_gpu.cluster import store as store_module
from supervisord_gpu.cluster.agent import NodeAgent
from supervisord_gpu.cluster.coordinator import (LedTransition, _plan_agrees, peers_started, prepare_cluster_start,
                                                 roll_back, roll_back_failed_start, running_profiles)
from supervisord_gpu.cluster.dcs import StoreUnreachable
from supervisord_gpu.cluster.gate import ClusterGate
from supervisord_gpu.cluster.kv import MemoryKV
from supervisord_gpu.cluster.plan import ClusterPlan, NodeWork, Step, plan_switch
from supervisord_gpu.cluster.records import LockRecord, NodeRecord, ProcessRecord, StepReport, TransitionKind
from supervisord_gpu.cluster.store import ClusterStore, ClusterUnavailable, NodeLost, StepFailed
from supervisord_gpu.config.loader import load_profile
from supervisord_gpu.config.model import DaemonConfig
from supervisord_gpu.errors import PreconditionError, StartError, SupervisorError, TakeoverFailed
from supervisord_gpu.records import replace
from test_cluster_config import PD_ACROSS

# pd with a second decode server on b: the router on a waits for two servers on another node
PD_TWO_DECODES = PD_ACROSS + """
[servers.decode2]
node = "b"
role = "decode"
host = "0.0.0.0"
gpus = [2, 3]
port = 31003
model_path = "/m"
"""


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):  # type: ignore[no-untyped-def]
    """Waits re-check every 50 ms instead of every second: an abandoned wait (an agent told to
    stop, a cancelled coordinator) ends at once. Every change in the store still wakes a wait."""
    monkeypatch.setattr(store_module, "WATCH_SLICE_S", 0.05)


class Clock:
    """The in-memory store's clock: real time plus what the test moved it on by."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock(monkeypatch):  # type: ignore[no-untyped-def]
    moved = Clock()
    monkeypatch.setattr(kv_module, "time", moved)  # MemoryKV's leases only: the waits keep real time
    return moved


def until(condition: Callable[[], Any], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def whole(cfg: DaemonConfig, name: str):  # type: ignore[no-untyped-def]
    return load_profile(cfg, name, True)


def tp_from_pd(cfg: DaemonConfig) -> ClusterPlan:
    """The planner's own plan of a switch from pd to tp: stop pd on a, b; verify on a, b; start tp on a, b."""
    return plan_switch(whole(cfg, "tp"), [whole(cfg, "pd")])


class Units(FakeUnits):
    """FakeUnits that also write one log shared by every node (the cluster-wide order), can be
    told to fail an order, and can run something while an order is under way."""

    def __init__(self, node: str, log: list[tuple[str, str, str]], fail: dict[tuple[str, str], str] | None = None,
                 during: dict[tuple[str, str], Callable[[], Any]] | None = None) -> None:
        super().__init__()
        self.node, self.log, self.fail, self.during = node, log, fail or {}, during or {}

    def _order(self, action: str, instance: str) -> str:
        self.calls.append((action, instance))
        hook = self.during.get((action, instance))
        if hook is not None:
            hook()
        self.log.append((self.node, action, instance))
        return self.fail.get((action, instance), "")

    def stop(self, instance: str) -> str:
        return self._order("stop", instance)

    def start(self, instance: str) -> str:
        return self._order("start", instance)


class Node:
    """One node's agent over the shared in-memory store: its own config, store and units; its
    verification recorded (or replaced), never run against GPUs."""

    def __init__(self, cluster: Cluster, name: str, fail: dict[tuple[str, str], str] | None = None,
                 during: dict[tuple[str, str], Callable[[], Any]] | None = None,
                 verify: Callable[[str], str] | None = None) -> None:
        self.name, self.kv = name, cluster.kv
        self.cfg = node_config(cluster.tmp / name, name)
        self.said: list[str] = []
        self.store = memory_store(self.cfg, cluster.kv)
        self.units = Units(name, cluster.log, fail, during)
        self.agent = NodeAgent(self.cfg, self.store, self.units, NoGpus(), lambda m, _p: self.said.append(m))  # type: ignore[arg-type]
        self.agent.lease = self.store.grant()
        self.agent.announce()
        self._verify = verify
        self._log = cluster.log
        self.agent.verify = self.verify  # type: ignore[method-assign]
        self.thread: threading.Thread | None = None

    def verify(self, instance: str) -> str:
        self._log.append((self.name, "verify", instance))
        return self._verify(instance) if self._verify else ""

    def start(self) -> Node:
        def loop() -> None:
            while not self.agent.stopping.is_set():
                self.agent.once()

        self.thread = threading.Thread(target=loop, name=f"agent-{self.name}", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.agent.stopping.set()
        self.kv.put("/c/wake", "1")  # any change ends the agent's watch
        if self.thread is not None:
            self.thread.join(5)
            assert not self.thread.is_alive(), f"the agent of {self.name} did not stop"


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.kv = tmp, MemoryKV()
        self.log: list[tuple[str, str, str]] = []
        self.nodes: list[Node] = []
        self.cleanups: list[Callable[[], Any]] = []

    def node(self, name: str, **kw: Any) -> Node:
        made = Node(self, name, **kw)
        self.nodes.append(made)
        return made

    def store(self, node: str = "a", said: list[str] | None = None) -> ClusterStore:
        return memory_store(node_config(self.tmp / node, node), self.kv, said)

    def close(self) -> None:
        for cleanup in self.cleanups:
            cleanup()
        for n in self.nodes:
            n.stop()
        assert all(n.agent.internal_errors == 0 for n in self.nodes), [n.said for n in self.nodes]


@pytest.fixture
def cluster(tmp_path):  # type: ignore[no-untyped-def]
    made = Cluster(tmp_path)
    yield made
    made.close()


def one_turn(node: Node, limit: float = 3.0) -> None:
    """One turn of the agent's loop, without its closing watch (which would wait for a change);
    a turn still waiting after `limit` is stopped (its waits abandoned) and fails the test."""
    watch = node.store.watch_once
    node.store.watch_once = lambda *_a, **_k: None  # type: ignore[method-assign]
    turn = threading.Thread(target=node.agent.once, daemon=True)
    try:
        turn.start()
        turn.join(limit)
        if turn.is_alive():
            node.agent.stopping.set()
            turn.join(limit)
            pytest.fail(f"the agent of {node.name} was still waiting after {limit:g} s: {node.said}")
    finally:
        node.store.watch_once = watch  # type: ignore[method-assign]


def keep_alive(*nodes: Node) -> None:
    """What each agent's keep-alive thread does every lease_ttl/3: renew and announce itself
    (a change in the store, which also ends an agent's watch; see the test below of
    a transition written while an agent was carrying out the one before)."""
    for n in nodes:
        n.store.refresh(n.agent.lease)
        n.agent.announce()


def report(store: ClusterStore, tid: str, step: int, node: str, lease: int, reason: str = "") -> None:
    store.report(tid, step, node, StepReport("failed", reason) if reason else StepReport("done"), lease)


def publish_pd_running(store: ClusterStore) -> int:
    """pd's daemons on a and b have published their processes ready (under their own lease)."""
    lease = store.grant()
    for node, process in (("a", "prefill"), ("a", "router"), ("b", "decode")):
        store.publish_process(ProcessRecord("pd", node, process, "ready"), lease)
    return lease


# -- the transition lock -------------------------------------------------------------------


def test_of_nodes_racing_for_the_lock_exactly_one_wins_and_every_other_is_told_who(cluster):
    names = ["a", "b", "c", "d", "e", "f"]
    stores = {n: cluster.store() for n in names}
    leases = {n: stores[n].grant() for n in names}
    barrier = threading.Barrier(len(names))
    got: dict[str, Any] = {}

    def take(n: str) -> None:
        barrier.wait()
        got[n] = stores[n].acquire(leases[n], LockRecord(n, f"to-{n}", pid=1))

    threads = [threading.Thread(target=take, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    winners = [n for n in names if got[n] is None]
    assert len(winners) == 1, got
    winner = winners[0]
    for n in names:
        if n != winner:
            assert (got[n].node, got[n].to, got[n].lease) == (winner, f"to-{winner}", leases[winner]), got[n]
    assert stores["a"].holder().node == winner  # type: ignore[union-attr]


def test_releasing_a_lock_one_does_not_hold_leaves_it_with_its_holder(cluster):
    a, b = cluster.store("a"), cluster.store("b")
    assert a.acquire(a.grant(), LockRecord("a", "tp", pid=1)) is None
    b.release(LockRecord("b", "tp", pid=1))
    b.release(LockRecord("a", "tp", pid=2))  # the same node, another holder (another daemon)
    held = b.holder()
    assert held is not None and (held.node, held.pid) == ("a", 1)


def test_a_holder_whose_lease_ran_out_cannot_release_the_lock_its_successor_took(cluster, clock):
    a, b = cluster.store("a"), cluster.store("b")
    old = LockRecord("a", "tp", pid=1)
    assert a.acquire(a.grant(ttl_s=5), old) is None
    clock.advance(6)  # a was presumed dead: its lease, and the lock, are gone
    assert a.holder() is None
    new = LockRecord("b", "pd", pid=2)
    assert b.acquire(b.grant(ttl_s=30), new) is None
    a.release(old)  # a comes back and releases what it believes is its lock
    assert a.holder() is not None and a.holder().node == "b"  # type: ignore[union-attr]


def test_a_lock_lives_past_its_ttl_while_renewed_and_ends_with_the_first_missed_renewal(cluster, clock):
    a, b = cluster.store("a"), cluster.store("b")
    lease = a.grant(ttl_s=10)
    assert a.acquire(lease, LockRecord("a", "tp")) is None
    for _ in range(5):  # 40 s of the store's time, renewed every 8 s
        clock.advance(8)
        assert a.refresh(lease) is True
    assert b.acquire(b.grant(ttl_s=10), LockRecord("b", "pd")).node == "a"  # type: ignore[union-attr]
    clock.advance(10)  # no renewal this time
    assert a.refresh(lease) is False  # a is told it was presumed dead
    assert b.acquire(b.grant(ttl_s=10), LockRecord("b", "pd")) is None and b.holder().node == "b"  # type: ignore[union-attr]


class Flickering(MemoryKV):
    """A lock whose holder's lease ends every time between our create and our read."""

    def create(self, key: str, value: str, lease: int = 0) -> bool:
        if key.endswith("/lock"):
            self.calls = getattr(self, "calls", 0) + 1
            return False
        return super().create(key, value, lease)


def test_taking_the_lock_gives_up_after_five_tries_when_it_keeps_changing(tmp_path):
    kv = Flickering()
    store = memory_store(node_config(tmp_path), kv)
    with pytest.raises(ClusterUnavailable) as e:
        store.acquire(store.grant(), LockRecord("a", "tp"))
    assert str(e.value) == ("etcd at memory://: the transition lock keeps changing; gave up after 5 tries")
    assert kv.calls == store_module.ACQUIRE_TRIES == 5


def test_a_coordinators_lease_revoked_mid_transition_takes_its_lock_plan_and_current_with_it(cluster):
    a, b = cluster.store("a"), cluster.store("b")
    lease = a.grant()
    assert a.acquire(lease, LockRecord("a", "tp", starting=("tp",), tid="t1")) is None
    a.put_plan("t1", tp_from_pd(node_config(cluster.tmp / "a")), lease)
    assert b.current() is not None and b.current()[0] == "t1"  # type: ignore[index]
    a.revoke(lease)
    assert b.holder() is None and b.current() is None and b.plan("t1") is None
    assert b.acquire(b.grant(), LockRecord("b", "pd", tid="t2")) is None  # a second switch may begin


def test_a_current_naming_a_transition_without_a_plan_is_no_transition(cluster):
    store = cluster.store()
    lease = store.grant()
    store.put_plan("t1", tp_from_pd(node_config(cluster.tmp / "a")), lease)
    store.kv.put("/c/current", "t2", lease)  # points at a transition whose plan is not there
    assert store.current() is None


# -- waiting for a step ----------------------------------------------------------------------


def test_a_step_waiting_on_a_node_whose_lease_expires_fails_naming_that_node(cluster, clock):
    store = cluster.store()
    a, b = store.grant(ttl_s=10), store.grant(ttl_s=10)
    store.announce(NodeRecord("a"), a)
    store.announce(NodeRecord("b"), b)
    report(store, "t1", 2, "a", a)
    with pytest.raises(TimeoutError, match="waiting for b$"):
        store.wait_step("t1", 2, ("a", "b"), time.monotonic() + 0.1)  # b is alive, only late
    clock.advance(8)
    store.refresh(a)  # a renews, b does not
    clock.advance(8)
    t0 = time.monotonic()
    with pytest.raises(NodeLost) as e:
        store.wait_step("t1", 2, ("a", "b"), time.monotonic() + 2)
    assert time.monotonic() - t0 < 1.0  # at once, not at the deadline
    assert e.value.node == "b" and str(e.value) == (
        "node 'b' was lost during step 2 (its agent stopped renewing its etcd lease)")


def test_a_node_that_reported_and_then_lost_its_lease_counts_as_lost_its_report_goes_with_it(cluster):
    store = cluster.store()
    a, b = store.grant(), store.grant()
    store.announce(NodeRecord("a"), a)
    store.announce(NodeRecord("b"), b)
    report(store, "t1", 1, "a", a)
    report(store, "t1", 1, "b", b)
    assert set(store.wait_step("t1", 1, ("a", "b"), time.monotonic() + 1)) == {"a", "b"}
    store.kv.expire(b)
    with pytest.raises(NodeLost, match="node 'b' was lost during step 1"):
        store.wait_step("t1", 1, ("a", "b"), time.monotonic() + 1)


def test_a_failure_reported_by_a_node_outside_the_step_does_not_fail_it(cluster):
    store = cluster.store()
    lease = store.grant()
    store.announce(NodeRecord("a"), lease)
    report(store, "t1", 1, "c", lease, reason="c's own trouble")
    report(store, "t1", 1, "a", lease)
    got = store.wait_step("t1", 1, ("a",), time.monotonic() + 1)
    assert got["a"].state == "done"


def test_a_failed_report_is_named_before_a_lost_node(cluster):
    store = cluster.store()
    lease = store.grant()
    store.announce(NodeRecord("a"), lease)  # b's agent is gone, c's is not even announced
    report(store, "t1", 3, "c", lease, reason="start of dsv4@tp.service: failed")
    with pytest.raises(StepFailed) as e:
        store.wait_step("t1", 3, ("a", "b", "c"), time.monotonic() + 1)
    assert (e.value.node, e.value.step) == ("c", 3)
    assert str(e.value) == "step 3 failed on node 'c': start of dsv4@tp.service: failed"


def test_reports_of_an_older_transition_do_not_settle_the_current_one(cluster):
    store = cluster.store()
    lease = store.grant()
    for node in ("a", "b"):
        store.announce(NodeRecord(node), lease)
        report(store, "t1", 1, node, lease)  # the previous transition's step 1, done everywhere
    report(store, "t2", 1, "a", lease)
    with pytest.raises(TimeoutError, match="waiting for b$"):
        store.wait_step("t2", 1, ("a", "b"), time.monotonic() + 0.1)


def test_a_waiting_step_wakes_on_the_last_report_not_on_its_next_recheck(cluster, monkeypatch):
    monkeypatch.setattr(store_module, "WATCH_SLICE_S", 5.0)  # a re-check would come only after 5 s
    store, other = cluster.store("a"), cluster.store("b")
    lease = store.grant()
    for node in ("a", "b"):
        store.announce(NodeRecord(node), lease)
    report(store, "t1", 1, "a", lease)
    timer = threading.Timer(0.1, lambda: report(other, "t1", 1, "b", lease))
    timer.start()
    t0 = time.monotonic()
    got = store.wait_step("t1", 1, ("a", "b"), time.monotonic() + 10)
    timer.join()
    assert set(got) == {"a", "b"} and time.monotonic() - t0 < 1.0


def test_an_abandoned_wait_ends_at_once_saying_so(cluster):
    store = cluster.store()
    lease = store.grant()
    store.announce(NodeRecord("b"), lease)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="^abandoned$"):
        store.wait_step("t1", 1, ("b",), time.monotonic() + 60, aborted=lambda: True)
    assert time.monotonic() - t0 < 0.5


# -- the plan's order --------------------------------------------------------------------------


def test_a_switch_with_nothing_in_the_way_only_verifies_then_starts(tmp_path):
    cfg = node_config(tmp_path)
    plan = plan_switch(whole(cfg, "pd"), [])
    assert plan.stopping == () and [(s.number, s.action, s.nodes()) for s in plan.steps] == [
        (1, "verify", ("a", "b")), (2, "start", ("a", "b"))]
    assert "(nothing to stop)" in plan.render()


def test_the_profile_being_started_is_never_in_its_own_way(tmp_path):
    cfg = node_config(tmp_path)
    plan = plan_switch(whole(cfg, "tp"), [whole(cfg, "tp")])
    assert plan.stopping == () and [s.action for s in plan.steps] == ["verify", "start"]


def test_a_switch_from_tp_to_pd_stops_router_then_both_ranks_and_starts_servers_then_router(tmp_path):
    cfg = node_config(tmp_path)
    plan = plan_switch(whole(cfg, "pd"), [whole(cfg, "tp")])
    assert plan.stopping == ("tp",)
    assert [(s.action, [(w.node, w.instance, w.processes) for w in s.work]) for s in plan.steps] == [
        ("stop", [("a", "tp", ("big", "router")), ("b", "tp", ("big",))]),
        ("verify", [("a", "pd", ()), ("b", "pd", ())]),
        ("start", [("a", "pd", ("prefill", "router")), ("b", "pd", ("decode",))]),
    ]
    assert plan.steps[0].order == "router@a -> big@a + big@b"
    assert plan.steps[2].order == "prefill@a + decode@b -> router@a"


def test_every_profile_in_the_way_is_stopped_in_a_step_of_its_own_before_the_verification(tmp_path):
    cfg = node_config(tmp_path)
    (tmp_path / "profiles" / "pd2.toml").write_text(PD_TWO_DECODES)
    plan = plan_switch(whole(cfg, "tp"), [whole(cfg, "pd2"), whole(cfg, "pd")])
    assert plan.stopping == ("pd2", "pd")
    assert [(s.number, s.action, s.work[0].instance) for s in plan.steps] == [
        (1, "stop", "pd2"), (2, "stop", "pd"), (3, "verify", "tp"), (4, "start", "tp")]
    waves = [set(w.split(" + ")) for w in plan.steps[0].order.split(" -> ")]
    assert waves == [{"router@a"}, {"decode@b", "decode2@b"}, {"prefill@a"}]  # both decodes at once


# -- the agent -----------------------------------------------------------------------------------


def test_an_agent_does_nothing_for_a_plan_that_names_only_other_nodes(cluster):
    b = cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    plan = ClusterPlan("pd", ("pd",), (Step(1, "stop", (NodeWork("a", "pd", ("prefill", "router")),)),))
    store.put_plan("t1", plan, lease)
    one_turn(b)
    assert b.units.calls == [] and store.reports("t1", 1) == {} and "t1" in b.agent.done


def test_an_agent_stops_its_own_part_only_and_reports_it_done(cluster):
    b = cluster.node("b")
    store = cluster.store()
    store.put_plan("t1", tp_from_pd(b.cfg), store.grant())
    report(store, "t1", 1, "a", b.agent.lease)  # so that b goes on to its verification
    report(store, "t1", 2, "a", b.agent.lease, reason="a's GPUs are busy")  # and stops there
    one_turn(b)
    assert b.units.calls == [("stop", "pd")] and cluster.log[:2] == [("b", "stop", "pd"), ("b", "verify", "tp")]
    assert store.reports("t1", 1)["b"].state == "done" and store.reports("t1", 2)["b"].state == "done"
    assert any("abandoned before step 3: step 2 failed on node 'a': a's GPUs are busy" in m for m in b.said), b.said


def test_an_agent_waiting_for_a_step_it_is_not_in_gives_up_when_that_step_fails_elsewhere(cluster):
    b = cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    plan = ClusterPlan("tp", ("pd",), (Step(1, "stop", (NodeWork("a", "pd", ("prefill", "router")),)),
                                       Step(2, "start", (NodeWork("a", "tp", ("big", "router")), NodeWork("b", "tp", ("big",))))))
    store.put_plan("t1", plan, lease)
    store.announce(NodeRecord("a"), lease)
    report(store, "t1", 1, "a", lease, reason="stop of dsv4@pd.service: timeout")
    one_turn(b)
    assert b.units.calls == [] and "b" not in store.reports("t1", 2)
    assert any(m.startswith("transition t1 to tp abandoned before step 2: step 1 failed on node 'a'") for m in b.said), b.said


def test_an_agent_waiting_for_a_lost_node_starts_nothing_and_names_it(cluster):
    b = cluster.node("b")
    store = cluster.store()
    plan = ClusterPlan("tp", ("pd",), (Step(1, "stop", (NodeWork("a", "pd", ("prefill", "router")),)),
                                       Step(2, "start", (NodeWork("b", "tp", ("big",)),))))
    store.put_plan("t1", plan, store.grant())  # a never announced itself: its agent is gone
    one_turn(b)
    assert b.units.calls == []
    assert any("abandoned before step 2: node 'a' was lost during step 1" in m for m in b.said), b.said


def test_an_agent_whose_own_stop_fails_reports_why_and_goes_no_further(cluster):
    b = cluster.node("b", fail={("stop", "pd"): "stop of dsv4@pd.service: failed"})
    store = cluster.store()
    store.put_plan("t1", tp_from_pd(b.cfg), store.grant())
    report(store, "t1", 1, "a", b.agent.lease)
    one_turn(b)
    assert b.units.calls == [("stop", "pd")] and ("b", "verify", "tp") not in cluster.log
    got = store.reports("t1", 1)["b"]
    assert (got.state, got.reason) == ("failed", "stop of dsv4@pd.service: failed")
    assert store.reports("t1", 2) == {}


class Refusing(FakeUnits):
    def stop(self, instance: str) -> str:
        raise SupervisorError(f"systemd refused to stop dsv4@{instance}.service: access denied\nmore detail")


def test_a_unit_error_becomes_a_failed_report_of_its_first_line(cluster):
    b = cluster.node("b")
    b.agent.units = Refusing()
    store = cluster.store()
    store.put_plan("t1", tp_from_pd(b.cfg), store.grant())
    one_turn(b)
    got = store.reports("t1", 1)["b"]
    assert (got.state, got.reason) == ("failed", "systemd refused to stop dsv4@pd.service: access denied")


def test_a_plan_seen_again_under_the_same_id_is_carried_out_once_and_a_new_id_again(cluster):
    b = cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    stop_b = ClusterPlan("pd", ("pd",), (Step(1, "stop", (NodeWork("b", "pd", ("decode",)),)),))
    store.put_plan("t1", stop_b, lease)
    for _ in range(3):
        one_turn(b)
    store.put_plan("t1", stop_b, lease)  # written again, same id: still the same transition
    one_turn(b)
    assert b.units.calls == [("stop", "pd")]
    store.put_plan("t2", stop_b, lease)  # the same plan as a new transition is a new order
    one_turn(b)
    assert b.units.calls == [("stop", "pd"), ("stop", "pd")]


def test_current_pointing_back_at_an_older_transition_is_not_carried_out_again(cluster):
    b = cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    store.put_plan("t1", ClusterPlan("pd", ("pd",), (Step(1, "stop", (NodeWork("b", "pd", ("decode",)),)),)), lease)
    one_turn(b)
    store.put_plan("t2", ClusterPlan("tp", (), (Step(1, "start", (NodeWork("b", "tp", ("big",)),)),)), lease)
    one_turn(b)
    store.kv.put("/c/current", "t1", lease)  # a stale pointer to the older transition, its plan still there
    one_turn(b)
    assert b.units.calls == [("stop", "pd"), ("start", "tp")]


def test_a_plan_that_names_a_single_machine_instance_in_any_step_is_refused_whole(cluster):
    b = cluster.node("b")
    store = cluster.store()
    plan = ClusterPlan("tp", ("pd",), (Step(1, "stop", (NodeWork("b", "pd", ("decode",)),)),
                                       Step(2, "start", (NodeWork("b", "solo", ()),))))
    store.put_plan("t1", plan, store.grant())
    one_turn(b)
    assert b.units.calls == [] and store.reports("t1", 1) == {}  # not even the admissible first step
    assert any(m.startswith("ignoring transition t1: it names solo, which does not span nodes") for m in b.said), b.said


def test_a_plan_naming_a_node_the_profile_lacks_is_refused(cluster):
    b = cluster.node("b")
    store = cluster.store()
    plan = ClusterPlan("pd", ("pd",), (Step(1, "stop", (NodeWork("b", "pd", ("decode",)), NodeWork("c", "pd", ()))),))
    store.put_plan("t1", plan, store.grant())
    one_turn(b)
    assert b.units.calls == []
    assert any("it names node c for pd, which has no such node" in m for m in b.said), b.said


def test_a_stopping_agent_abandons_a_transition_waiting_on_another_node(cluster):
    b = cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    store.announce(NodeRecord("a"), lease)  # a is alive, and has not reported step 1
    store.put_plan("t1", tp_from_pd(b.cfg), lease)
    b.agent.stopping.set()
    t0 = time.monotonic()
    one_turn(b)
    assert time.monotonic() - t0 < 1.0
    assert b.units.calls == [("stop", "pd")] and ("b", "verify", "tp") not in cluster.log
    assert any("abandoned before step 2: abandoned" in m for m in b.said), b.said


class NoGpusAtAll(GpuInventory):
    kind = "test"

    def count(self) -> int:
        return 0

    def snapshot(self, indices=None):  # type: ignore[no-untyped-def]
        return []


def test_a_verification_on_a_node_without_the_gpus_fails_naming_the_node(cluster):
    b = cluster.node("b")
    b.agent.verify = NodeAgent.verify.__get__(b.agent)  # type: ignore[method-assign]  # the real one
    b.agent.inventory = NoGpusAtAll()
    store = cluster.store()
    plan = ClusterPlan("tp", (), (Step(1, "verify", (NodeWork("b", "tp", ()),)),))
    store.put_plan("t1", plan, store.grant())
    one_turn(b)
    got = store.reports("t1", 1)["b"]
    assert got.state == "failed" and got.reason.startswith("node b: GPU 0 does not exist"), got


def test_two_agents_start_nothing_anywhere_before_every_node_stopped_and_verified(cluster):
    slow = {("stop", "pd"): lambda: time.sleep(0.15)}  # a's stop takes a while: b must wait for it
    a = cluster.node("a", during=slow).start()
    cluster.node("b").start()
    store = cluster.store()
    store.put_plan("t1", tp_from_pd(a.cfg), store.grant())
    assert until(lambda: len(cluster.log) == 6), cluster.log
    assert [what for _, what, _ in cluster.log] == ["stop", "stop", "verify", "verify", "start", "start"], cluster.log
    assert {(n, i) for n, what, i in cluster.log if what == "stop"} == {("a", "pd"), ("b", "pd")}
    assert {(n, i) for n, what, i in cluster.log if what == "start"} == {("a", "tp"), ("b", "tp")}
    assert set(store.reports("t1", 3)) == {"a", "b"}


def test_the_agents_free_a_rollbacks_lock_once_every_node_reported_its_last_step(cluster):
    a, b = cluster.node("a"), cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    rollback = LockRecord("a", "tp", kind=TransitionKind.ROLLBACK, starting=("pd",), pid=1, tid="t1")
    assert store.acquire(lease, rollback) is None
    plan = ClusterPlan("rollback of tp", (), (Step(1, "start", (NodeWork("a", "pd", ("prefill", "router")),
                                                                 NodeWork("b", "pd", ("decode",)))),))
    store.put_plan("t1", plan, lease)
    one_turn(a)
    assert store.holder() is not None  # b has not reported yet
    one_turn(b)
    assert store.holder() is None
    assert any("rollback of tp: done on a, b; cluster lock released" in m for m in b.said), b.said


def test_the_agents_never_free_a_coordinators_lock_when_a_transition_ends(cluster):
    b = cluster.node("b")
    store = cluster.store()
    lease = store.grant()
    assert store.acquire(lease, LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")) is None
    store.put_plan("t1", ClusterPlan("tp", (), (Step(1, "start", (NodeWork("b", "tp", ("big",)),)),)), lease)
    one_turn(b)
    assert b.units.calls == [("start", "tp")]
    assert store.holder() is not None and store.holder().node == "a"  # type: ignore[union-attr]  # the coordinator's to free


def test_an_agent_begins_no_further_step_of_a_transition_whose_coordinator_lease_ended(cluster):
    coordinator = cluster.store("a")
    lease = coordinator.grant()
    assert coordinator.acquire(lease, LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")) is None
    b = cluster.node("b", during={("stop", "pd"): lambda: coordinator.revoke(lease)})  # a's daemon dies meanwhile
    coordinator.put_plan("t1", tp_from_pd(b.cfg), lease)
    for step in (1, 2):
        report(coordinator, "t1", step, "a", b.agent.lease)  # a's agent did its share (it is alive)
    one_turn(b)
    assert coordinator.holder() is None and coordinator.current() is None
    assert ("start", "tp") not in b.units.calls, b.said


def test_an_agent_takes_up_at_once_a_transition_written_while_it_carried_out_the_previous_one(cluster):
    store = cluster.store()
    lease = store.grant()
    second = ClusterPlan("tp", (), (Step(1, "start", (NodeWork("b", "tp", ("big",)),)),))
    b = cluster.node("b", during={("stop", "pd"): lambda: store.put_plan("t2", second, lease)})
    # t1: b stops pd, then waits for a (whose agent is gone) and gives t1 up; t2 came meanwhile
    first = ClusterPlan("pd", ("pd",), (Step(1, "stop", (NodeWork("b", "pd", ("decode",)), NodeWork("a", "pd", ("prefill",)))),
                                        Step(2, "start", (NodeWork("b", "pd", ("decode",)),))))
    store.put_plan("t1", first, lease)
    b.start()
    assert until(lambda: any("abandoned before step 2: node 'a' was lost" in m for m in b.said), 1.0), b.said
    assert until(lambda: ("start", "tp") in b.units.calls, 1.0), b.units.calls


# -- the coordinator: coordinate, or only verify, or wait-----------------------------------------------


def lock_and_plan(store: ClusterStore, plan: ClusterPlan, tid: str = "t1", instance: str = "tp", node: str = "b"):  # type: ignore[no-untyped-def]
    lease = store.grant()
    assert store.acquire(lease, LockRecord(node, instance, starting=(instance,), pid=1, tid=tid)) is None
    store.put_plan(tid, plan, lease)
    return store.holder()


def test_a_lock_proves_a_transition_only_if_its_plan_starts_this_instance_on_this_node(cluster):
    store = cluster.store()
    on_b = lock_and_plan(store, ClusterPlan("tp", (), (Step(1, "start", (NodeWork("b", "tp", ("big",)),)),)))
    assert _plan_agrees(store, on_b, "tp", "b") is True
    assert _plan_agrees(store, on_b, "tp", "a") is False  # it starts tp, but not on a
    assert _plan_agrees(store, on_b, "pd", "b") is False  # it starts something else on b
    stop_only = memory_store(node_config(cluster.tmp / "a"))  # a cluster of its own
    held = lock_and_plan(stop_only, ClusterPlan("tp", (), (Step(1, "stop", (NodeWork("a", "tp", ("big",)),)),)))
    assert _plan_agrees(stop_only, held, "tp", "a") is False  # a plan that only stops it here starts nothing


def coordinate(cluster: Cluster, instance: str = "tp", after: Callable[[ClusterStore], Any] | None = None,
               limit: float = 3.0, progress: list[str] | None = None, watch: bool = False) -> dict[str, Any]:
    """Node a's daemon of `instance` through its cluster pre-flight: what it said, its progress,
    whether it only verified, and how it ended (the gate, or the error); with `watch`, then what
    its watch on the other nodes' parts of the start raised ("watched"), while its gate is open."""
    cfg = node_config(cluster.tmp / "a", "a")
    store = memory_store(cfg, cluster.kv)
    part = load_profile(cfg, instance)
    out: dict[str, Any] = {"said": [], "progress": [] if progress is None else progress, "verified": [], "store": store}

    async def verify() -> None:
        out["verified"].append(True)

    async def go() -> None:
        gate = ClusterGate(store, part, "a", lambda m, _p: out["said"].append(m))
        try:
            out["led"] = await asyncio.wait_for(prepare_cluster_start(part, cfg, NoGpus(), gate,  # type: ignore[arg-type]
                                                                      lambda m, _p: out["said"].append(m),
                                                                      out["progress"].append, verify), limit)
            out["gate"] = gate
            if watch:
                out["watched"] = await peers_watched(store, out["led"], limit, out["said"])
            if after is not None:
                await asyncio.wait_for(after(store), limit)
        except (SupervisorError, TimeoutError) as e:
            out["error"] = e
        finally:
            gate.close()

    asyncio.run(go())
    return out


async def lock_released(store: ClusterStore) -> None:
    while store.holder() is not None:
        await asyncio.sleep(0.02)


def test_a_switch_coordinated_here_stops_the_old_profile_everywhere_and_holds_the_lock_until_all_started(cluster):
    publish_pd_running(cluster.store())
    cluster.node("a").start()
    cluster.node("b").start()
    seen: dict[str, Any] = {}

    async def watch_then_release(store: ClusterStore) -> None:
        seen["holder"], seen["current"] = store.holder(), store.current()
        await lock_released(store)

    out = coordinate(cluster, after=watch_then_release)
    assert "error" not in out, out
    assert out["verified"] == []  # the coordinator's node verified through its agent, in step 2
    holder, (tid, plan) = seen["holder"], seen["current"]
    assert (holder.node, holder.to, holder.tid) == ("a", "tp", tid) and plan.stopping == ("pd",)
    assert [s.number for s in out["led"].done] == [1, 2]  # what a rollback of our own start would undo
    assert [(n, what, i) for n, what, i in cluster.log if what != "verify"][:2] in (
        [("a", "stop", "pd"), ("b", "stop", "pd")], [("b", "stop", "pd"), ("a", "stop", "pd")])
    assert sorted(x for x in cluster.log if x[1] == "start") == [("a", "start", "tp"), ("b", "start", "tp")]
    assert "cluster transition to tp done: every node's part is ready" in out["said"], out["said"]


async def peers_watched(store: ClusterStore, led: LedTransition, limit: float, said: list[str]) -> BaseException | None:
    """The coordinator's watch on the other nodes' parts of the start it led: what it raised."""
    try:
        await asyncio.wait_for(peers_started(store, led, threading.Event(), lambda m, _p: said.append(m)), limit)
    except (SupervisorError, TimeoutError) as e:
        return e
    return None


def test_the_coordinator_hears_at_once_that_another_nodes_part_of_its_start_failed(cluster):
    """Its own part (rank 0 of tp) would wait for b's for ever; the watch names b's failure as
    soon as b's agent reports it, and the controller fails our start with it."""
    publish_pd_running(cluster.store())
    a = cluster.node("a").start()
    b = cluster.node("b", fail={("start", "tp"): "start of dsv4@tp.service: failed"}).start()
    out = coordinate(cluster, watch=True)
    keep_alive(a, b)
    e = out["watched"]
    assert isinstance(e, StepFailed) and str(e) == "step 3 failed on node 'b': start of dsv4@tp.service: failed", out


def test_only_another_node_of_the_start_can_fail_the_coordinators_watch(cluster):
    """As an etcd writer forging reports: one for the coordinator's own node (its start is the
    daemon's own, not a report's) or for a node with no part fails nothing; one for b fails
    our start as b's real failure would (a rollback to what ran: nothing new starts)."""
    store = cluster.store()
    cluster.node("b")  # announced, its lease alive; its agent not running: its part still loads
    led = led_by_a()
    writer, said = store.grant(), []
    report(store, "t9", 1, "a", writer, "forged: a's part failed")
    report(store, "t9", 1, "c", writer, "forged: c's part failed")
    assert isinstance(asyncio.run(peers_watched(store, led, 0.5, said)), TimeoutError)  # still waiting for b
    report(store, "t9", 1, "b", writer, "start of dsv4@tp.service: failed")
    e = asyncio.run(peers_watched(store, led, 3.0, said))
    assert isinstance(e, StepFailed) and str(e) == "step 1 failed on node 'b': start of dsv4@tp.service: failed", e
    assert said == []


def led_by_a() -> LedTransition:
    both = (NodeWork("a", "tp", ("big",)), NodeWork("b", "tp", ("big",)))
    return LedTransition(ClusterPlan("tp", (), (Step(1, "start", both),)), (),
                         LockRecord("a", "tp", starting=("tp",), pid=1, tid="t9"))


def test_etcd_out_of_reach_or_a_peers_agent_gone_fails_nothing_and_a_later_failure_still_does(cluster, monkeypatch):
    """Neither says that b's part failed (b's daemon runs it, not its agent; a restarted agent
    revokes its lease): our part goes on loading, said once each, and b's report still counts."""
    monkeypatch.setattr(store_module, "WATCH_SLICE_S", 0.05)
    monkeypatch.setattr(coordinator_module, "PEERS_RETRY_S", 0.05)
    kv = Unreachable()
    store = memory_store(node_config(cluster.tmp / "a", "a"), kv)
    agent_b = store.grant()
    store.announce(NodeRecord("b", 1, (), (), 0.0), agent_b)
    writer, said = store.grant(), []

    async def go() -> BaseException | None:
        watch = asyncio.ensure_future(peers_watched(store, led_by_a(), 5.0, said))
        await asyncio.sleep(0.2)
        kv.down = True  # etcd away for a moment
        await asyncio.sleep(0.3)
        kv.down = False
        store.revoke(agent_b)  # b's agent restarted: its lease goes, its part loads on
        await asyncio.sleep(0.3)
        assert not watch.done(), watch
        store.announce(NodeRecord("b", 1, (), (), 0.0), store.grant())
        report(store, "t9", 1, "b", writer, "start of dsv4@tp.service: failed")
        return await watch

    e = asyncio.run(go())
    assert isinstance(e, StepFailed) and "node 'b'" in str(e), e
    assert len(said) == 2 and all(m.endswith("this node's part goes on loading (only a part reported failed fails it)")
                                  for m in said), said
    assert "connection refused" in said[0] and "node 'b' was lost" in said[1], said


def test_the_coordinators_watch_ends_quietly_once_the_other_nodes_parts_are_up(cluster):
    publish_pd_running(cluster.store())
    a = cluster.node("a", fail={("start", "tp"): "ours: not the watch's business"}).start()
    b = cluster.node("b").start()
    out = coordinate(cluster, watch=True)
    keep_alive(a, b)
    assert "watched" in out and out["watched"] is None, out  # b's part is up; a's own start is the daemon's


def test_a_verification_failing_after_the_stops_rolls_back_on_every_node_under_a_lock_of_its_own(cluster):
    publish_pd_running(cluster.store())
    a = cluster.node("a").start()
    b = cluster.node("b", verify=lambda _i: "node b: GPU 0 is held by pid 4242 (user eve)").start()
    rollback_holders: list[Any] = []
    a.units.during[("start", "pd")] = lambda: rollback_holders.append(a.store.holder())
    out = coordinate(cluster)
    keep_alive(a, b)
    e = out["error"]
    assert isinstance(e, TakeoverFailed), out
    assert str(e) == ("cluster transition to tp failed: step 2 failed on node 'b': node b: GPU 0 is held by pid 4242 "
                      "(user eve); rolling back: the agents start pd again")
    assert until(lambda: cluster.store().holder() is None), "\n".join(map(str, (  # freed by the agents once both started pd again
        a.said, b.said, cluster.log, cluster.store().holder())))
    assert sorted(x for x in cluster.log if x[1] != "verify") == [
        ("a", "start", "pd"), ("a", "stop", "pd"), ("b", "start", "pd"), ("b", "stop", "pd")]
    assert a.units.calls == [("stop", "pd"), ("start", "pd")] and b.units.calls == [("stop", "pd"), ("start", "pd")]
    held = rollback_holders[0]
    assert (held.to, held.starting, held.node) == ("rollback of tp", ("pd",), "a"), held


def test_a_node_lost_during_the_verification_fails_the_switch_naming_it_and_the_rest_rolls_back(cluster):
    publish_pd_running(cluster.store())
    release = threading.Event()
    cluster.cleanups.append(release.set)
    progress: list[str] = []

    def hang_and_die(_instance: str) -> str:  # once the coordinator waits on the verification, b's agent is gone
        until(lambda: any(p.startswith("cluster step 2/3") for p in progress))
        cluster.kv.expire(b.agent.lease)
        release.wait(5)
        return ""

    a = cluster.node("a").start()
    b = cluster.node("b", verify=hang_and_die).start()
    out = coordinate(cluster, progress=progress)
    keep_alive(a)
    e = out["error"]
    assert isinstance(e, TakeoverFailed) and "node 'b' was lost during step 2" in str(e), out
    assert str(e).endswith("; rolling back: the agents start pd again")
    assert until(lambda: a.units.calls == [("stop", "pd"), ("start", "pd")]), (a.units.calls, a.said)
    assert ("start", "tp") not in b.units.calls
    held = cluster.store().holder()  # b cannot report its share: the rollback keeps the lock (until its TTL)
    assert held is not None and held.to == "rollback of tp"


def test_a_stop_that_failed_everywhere_fails_the_start_touching_nothing_and_frees_the_lock(cluster):
    publish_pd_running(cluster.store())
    refuse = {("stop", "pd"): "stop of dsv4@pd.service: failed"}
    cluster.node("a", fail=refuse).start()
    cluster.node("b", fail=refuse).start()
    out = coordinate(cluster)
    e = out["error"]
    assert isinstance(e, PreconditionError) and not isinstance(e, TakeoverFailed), out
    assert "step 1 failed on node" in str(e) and "stop of dsv4@pd.service: failed" in str(e) and "rolling back" not in str(e)
    assert cluster.store().holder() is None
    assert not any(what == "start" for _, what, _ in cluster.log), cluster.log


def test_a_stop_that_failed_on_one_node_starts_the_old_profile_again_where_it_did_stop(cluster):
    publish_pd_running(cluster.store())
    a = cluster.node("a").start()
    probe = cluster.store()
    # b's stop fails, after a reported its own stop done
    cluster.node("b", fail={("stop", "pd"): "stop of dsv4@pd.service: timeout"},
                 during={("stop", "pd"): lambda: until(lambda: "a" in probe.reports(probe.current()[0], 1))}).start()  # type: ignore[index]
    out = coordinate(cluster)
    assert "step 1 failed on node 'b'" in str(out.get("error")), out
    assert until(lambda: ("start", "pd") in a.units.calls, 0.5), a.units.calls


def test_a_second_switch_waits_for_the_transition_under_way_naming_it_then_coordinates(cluster):
    other = cluster.store("b")
    theirs = LockRecord("b", "pd", starting=("pd",), pid=7, tid="t0")
    assert other.acquire(other.grant(), theirs) is None
    alive = other.grant()
    for node in ("a", "b"):  # both agents are up (they carry out nothing here)
        other.announce(NodeRecord(node), alive)
    cfg = node_config(cluster.tmp / "a", "a")
    store = memory_store(cfg, cluster.kv)
    part = load_profile(cfg, "tp")
    progress: list[str] = []
    while_waiting: list[Any] = []

    def release_once_waiting() -> None:
        until(lambda: progress)
        while_waiting.append((other.holder(), other.current()))
        other.release(theirs)

    async def verify() -> None:
        raise AssertionError("a switch that waited coordinates: it does not only verify")

    async def go() -> Any:
        gate = ClusterGate(store, part, "a", lambda _m, _p: None)
        task = asyncio.ensure_future(prepare_cluster_start(part, cfg, NoGpus(), gate, lambda _m, _p: None,  # type: ignore[arg-type]
                                                           progress.append, verify))
        try:
            while (held := store.holder()) is None or held.node != "a":
                await asyncio.sleep(0.02)
            return held
        finally:
            task.cancel()  # its steps would wait on agents this test has none of
            await asyncio.gather(task, return_exceptions=True)
            gate.close()

    helper = threading.Thread(target=release_once_waiting)
    helper.start()
    held = asyncio.run(asyncio.wait_for(go(), 3.0))
    helper.join(3)
    assert progress[0] == "waiting for the cluster transition to pd (coordinated by node b)", progress
    assert while_waiting[0][0].node == "b" and while_waiting[0][1] is None  # it wrote no plan while waiting
    assert (held.node, held.to) == ("a", "tp")


# -- rolling back --------------------------------------------------------------------------------


def test_a_rollback_after_the_new_profile_started_stops_it_everywhere_then_starts_the_old_one(cluster):
    store = cluster.store()
    plan = tp_from_pd(node_config(cluster.tmp / "a"))
    me = LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")
    lease = store.grant()
    assert store.acquire(lease, me) is None
    roll_back(store, plan, list(plan.steps[:2]), me, True)
    held = store.holder()
    assert held is not None and (held.to, held.starting, held.node) == ("rollback of tp", ("pd",), "a")
    assert held.lease != lease and held.tid != "t1"
    tid, rollback = store.current()  # type: ignore[misc]
    assert tid == held.tid
    assert [(s.number, s.action, [(w.node, w.instance, w.processes) for w in s.work]) for s in rollback.steps] == [
        (1, "stop", [("a", "tp", ("big", "router")), ("b", "tp", ("big",))]),
        (2, "start", [("a", "pd", ("prefill", "router")), ("b", "pd", ("decode",))]),
    ]
    store.revoke(lease)  # the coordinator's daemon exits: the rollback outlives it
    assert store.holder() == held and store.current()[0] == tid  # type: ignore[index]


def test_a_rollback_with_nothing_stopped_only_frees_the_lock(cluster):
    store = cluster.store()
    plan = tp_from_pd(node_config(cluster.tmp / "a"))
    me = LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")
    lease = store.grant()
    assert store.acquire(lease, me) is None
    store.put_plan("t1", plan, lease)
    leases = set(store.kv.leases)
    roll_back(store, plan, [], me, False)
    assert store.holder() is None and store.current()[0] == "t1"  # type: ignore[index]
    assert set(store.kv.leases) == leases  # no lease of a rollback granted


def test_a_rollback_yields_to_a_transition_that_took_the_lock_first(cluster):
    store, other = cluster.store("a"), cluster.store("b")
    plan = tp_from_pd(node_config(cluster.tmp / "a"))
    me = LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")
    theirs = lock_and_plan(other, ClusterPlan("pd", (), (Step(1, "start", (NodeWork("b", "pd", ("decode",)),)),)),
                           tid="t7", instance="pd")
    roll_back(store, plan, [plan.steps[0]], me, False)
    assert store.holder() == theirs and store.current()[0] == "t7"  # type: ignore[index]


def test_a_failed_own_start_rolls_back_only_when_the_transition_had_stopped_something(cluster):
    store = cluster.store()
    plan = tp_from_pd(node_config(cluster.tmp / "a"))
    me = LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")

    assert roll_back_failed_start(store, None) == "" and store.holder() is None  # another node led it
    verified_only = LedTransition(plan, (plan.steps[1],), me)  # verified, stopped nothing
    assert roll_back_failed_start(store, verified_only) == "" and store.holder() is None
    assert store.acquire(store.grant(), me) is None
    said = roll_back_failed_start(store, LedTransition(plan, plan.steps[:2], me))
    assert said == "rolling back: the agents stop tp on every node and start pd again"
    assert store.holder().to == "rollback of tp"  # type: ignore[union-attr]
    assert [s.action for s in store.current()[1].steps] == ["stop", "start"]  # type: ignore[index]


def test_the_cluster_transition_keeps_what_it_led_and_rolls_exactly_that_back_when_its_own_start_fails(cluster):
    """The rollback's state is the controller's ClusterTransition's (not the gate's): what it led
    is kept from `prepare` to `roll_back`, and a failed start of our own part undoes it."""
    from supervisord_gpu.controller.transition import ClusterTransition

    publish_pd_running(cluster.store())
    a, b = cluster.node("a").start(), cluster.node("b").start()
    cfg = node_config(cluster.tmp / "a", "a")
    store = memory_store(cfg, cluster.kv)
    part = load_profile(cfg, "tp")
    said: list[str] = []
    rollback_holders: list[Any] = []
    a.units.during[("start", "pd")] = lambda: rollback_holders.append(a.store.holder())

    async def go() -> tuple[Any, str | None]:
        gate = ClusterGate(store, part, "a", lambda _m, _p: None)
        transition = ClusterTransition(part, cfg, NoGpus(), gate, lambda m, _p, _e: said.append(m))  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(transition.prepare("checked", lambda _m: None), 3.0)
            led = transition.led
            await asyncio.wait_for(lock_released(store), 3.0)  # every node's part reported its start
            return led, await transition.roll_back(StartError("tp: router did not become ready"), "tp failed")
        finally:
            gate.close()

    led, reason = asyncio.run(go())
    assert led is not None and [s.action for s in led.done] == ["stop", "verify"] and led.me.node == "a"
    assert reason == "tp failed (cluster transition; rolling back: the agents stop tp on every node and start pd again)"
    assert until(lambda: ("a", "start", "pd") in cluster.log and ("b", "start", "pd") in cluster.log), cluster.log
    held = rollback_holders[0]
    assert held.kind is TransitionKind.ROLLBACK and (held.target, held.starting) == ("tp", ("pd",)), held
    assert [x for x in cluster.log if x[1] == "stop"][-2:] in ([("a", "stop", "tp"), ("b", "stop", "tp")],
                                                               [("b", "stop", "tp"), ("a", "stop", "tp")])


def test_a_profile_whose_every_process_is_stopped_or_failed_is_not_in_the_way(cluster):
    store = cluster.store()
    cfg = node_config(cluster.tmp / "a")
    lease = store.grant()
    store.publish_process(ProcessRecord("pd", "a", "prefill", "stopped"), lease)
    store.publish_process(ProcessRecord("pd", "b", "decode", "failed"), lease)
    assert running_profiles(store, cfg, "tp", lambda _m, _p: None) == []
    store.publish_process(ProcessRecord("pd", "a", "router", "stopping"), lease)  # still holds its port
    assert [p.name for p in running_profiles(store, cfg, "tp", lambda _m, _p: None)] == ["pd"]
    assert running_profiles(store, cfg, "pd", lambda _m, _p: None) == []  # never in its own way


# -- the gate: one node's processes against the other nodes' -----------------------------------


def gate_for(tmp: Path, kv: MemoryKV, instance: str = "pd", node: str = "a", said: list[str] | None = None):  # type: ignore[no-untyped-def]
    cfg = node_config(tmp / node, node)
    if instance == "pd2":
        (tmp / node / "profiles" / "pd2.toml").write_text(PD_TWO_DECODES)
    store = memory_store(cfg, kv)
    part = load_profile(cfg, instance)
    lines = said if said is not None else []
    return ClusterGate(store, part, node, lambda m, _p: lines.append(m)), part, store


def test_a_router_waits_for_its_server_on_another_node_to_be_ready_before_it_starts(tmp_path):
    kv = MemoryKV()
    gate, part, store = gate_for(tmp_path, kv)
    b = store.grant()

    async def go() -> None:
        store.publish_process(ProcessRecord("pd", "b", "decode", "starting"), b)
        task = asyncio.ensure_future(gate.before_start(part.process("router")))
        await asyncio.sleep(0.15)
        assert not task.done()  # decode is only starting
        store.publish_process(ProcessRecord("pd", "b", "decode", "ready"), b)
        await asyncio.wait_for(task, 1.0)

    try:
        asyncio.run(go())
    finally:
        gate.close()


@pytest.mark.parametrize("published, named", [
    ({"decode": "starting"}, "b/decode (starting)"),
    ({}, "b/decode (no daemon running it)"),
])
def test_a_start_whose_peer_is_not_ready_in_time_fails_naming_the_node_and_its_state(tmp_path, published, named):
    kv = MemoryKV()
    gate, part, store = gate_for(tmp_path, kv)
    lease = store.grant()
    for process, state in published.items():
        store.publish_process(ProcessRecord("pd", "b", process, state), lease)
    router = replace(part.process("router"), start_timeout_s=0.2)
    try:
        with pytest.raises(StartError) as e:
            asyncio.run(gate.before_start(router))
    finally:
        gate.close()
    assert str(e.value) == f"router: not started: on another node, {named} was not ready within its start timeout 0.2 s"


def test_a_prefill_stops_only_after_the_decode_on_the_other_node_stopped(tmp_path):
    kv = MemoryKV()
    said: list[str] = []
    gate, part, store = gate_for(tmp_path, kv, said=said)
    b = store.grant()

    async def go() -> None:
        store.publish_process(ProcessRecord("pd", "b", "decode", "stopping"), b)
        task = asyncio.ensure_future(gate.before_stop([part.process("prefill")]))
        await asyncio.sleep(0.15)
        assert not task.done()
        store.publish_process(ProcessRecord("pd", "b", "decode", "stopped"), b)
        await asyncio.wait_for(task, 1.0)

    try:
        asyncio.run(go())
        asyncio.run(asyncio.wait_for(gate.before_stop([part.process("router")]), 1.0))  # the router waits for nobody
    finally:
        gate.close()
    assert not any("did not report stopped" in m or "without waiting" in m for m in said), said


def test_a_peer_whose_daemon_is_gone_counts_as_stopped(tmp_path):
    kv = MemoryKV()
    said: list[str] = []
    gate, part, store = gate_for(tmp_path, kv, said=said)
    b = store.grant()
    store.publish_process(ProcessRecord("pd", "b", "decode", "ready"), b)
    kv.expire(b)  # b's daemon killed: its records went with its lease
    t0 = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(gate.before_stop([part.process("prefill")]), 1.0))
    finally:
        gate.close()
    assert time.monotonic() - t0 < 0.5 and not any("did not report" in m for m in said), said


def test_a_stop_whose_peer_never_reports_stopped_goes_on_after_its_deadline_saying_so(tmp_path):
    kv = MemoryKV()
    said: list[str] = []
    gate, part, store = gate_for(tmp_path, kv, said=said)
    store.publish_process(ProcessRecord("pd", "b", "decode", "ready"), store.grant())
    store.lease_ttl_s = 0  # the deadline is the stop timeout plus the lease TTL
    prefill = replace(part.process("prefill"), stop_timeout_s=0.2)
    try:
        asyncio.run(asyncio.wait_for(gate.before_stop([prefill]), 2.0))
    finally:
        gate.close()
    assert "stopping prefill although b/decode did not report stopped in time" in said, said


class Unreachable(MemoryKV):
    """A store out of reach, as a backend says it: classified (cluster/dcs.py), never a library's error."""

    down = False

    def range(self, key: str, prefix: bool = False):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnreachable.because("connection refused")
        return super().range(key, prefix)

    def grant(self, ttl_s: int) -> int:
        if self.down:
            raise StoreUnreachable.because("connection refused")
        return super().grant(ttl_s)


def test_a_stop_with_etcd_out_of_reach_goes_on_in_its_own_order_without_waiting(tmp_path):
    kv = Unreachable()
    said: list[str] = []
    gate, part, _ = gate_for(tmp_path, kv, said=said)
    kv.down = True
    try:
        asyncio.run(asyncio.wait_for(gate.before_stop([part.process("prefill")]), 1.0))
    finally:
        gate.close()
    assert ("etcd at memory:// cannot be reached (reading /c/parts/pd/): connection refused; "
            "stopping prefill without waiting for the other nodes") in said, said


def test_a_daemon_with_etcd_out_of_reach_is_refused_its_cluster_start(tmp_path):
    kv = Unreachable()
    kv.down = True
    with pytest.raises(ClusterUnavailable) as e:
        gate_for(tmp_path, kv)
    assert str(e.value) == "etcd at memory:// cannot be reached (granting a lease): connection refused"


def test_a_daemon_publishes_its_processes_stopped_then_their_states_and_takes_them_along_when_it_closes(tmp_path):
    from supervisord_gpu.engine.events import Event

    kv = MemoryKV()
    gate, part, store = gate_for(tmp_path, kv)
    peer = memory_store(node_config(tmp_path / "b", "b"), kv)
    try:
        assert until(lambda: peer.process_states("pd") == {"a/prefill": "stopped", "a/router": "stopped"})
        for state in ("starting", "ready"):
            gate.on_event(Event("process", "pd", "", process="prefill", state=state))
        gate.on_event(Event("info", "pd", "not a process"))
        assert until(lambda: peer.process_states("pd") == {"a/prefill": "ready", "a/router": "stopped"})
    finally:
        gate.close()
    assert peer.process_states("pd") == {}  # at once, not after the TTL


def test_a_start_does_not_count_a_peer_ready_whose_daemon_went_after_it_was_seen_ready(tmp_path):
    kv = MemoryKV()
    gate, part, store = gate_for(tmp_path, kv, instance="pd2")
    decode, decode2 = store.grant(), store.grant()  # b's two servers, each its own daemon's lease here
    store.publish_process(ProcessRecord("pd2", "b", "decode", "ready"), decode)
    store.publish_process(ProcessRecord("pd2", "b", "decode2", "starting"), decode2)
    router = replace(part.process("router"), start_timeout_s=0.3)
    assert router.peers_before_start == ("b/decode", "b/decode2")
    real, reads = store.process_states, []

    def states(instance: str) -> dict[str, str]:
        got = real(instance)
        reads.append(got)
        if len(reads) == 1:  # after the first look: decode's daemon goes, decode2 becomes ready
            kv.expire(decode)
            store.publish_process(ProcessRecord("pd2", "b", "decode2", "ready"), decode2)
        return got

    store.process_states = states  # type: ignore[method-assign]
    try:
        with pytest.raises(StartError, match=r"b/decode \(no daemon running it\)"):
            asyncio.run(gate.before_start(router))
    finally:
        gate.close()
    last = {k: v for k, v in reads[-1].items() if k.startswith("b/")}  # a's own (stopped) aside
    assert last == {"b/decode2": "ready"}, reads


def test_a_start_waiting_for_another_transitions_lock_waits_from_its_own_read_of_the_lock(tmp_path):
    """The wait for a held lock followed on from whatever its watching thread had read last
    (acquire and the watch ran in two asyncio.to_thread calls; the revision is kept per
    thread, and acquire's read of the lock kept none): an old one woke the watch at once, and
    none made it miss a release between the two. Here this thread read long ago, another node
    then took the lock: the wait follows on from acquire's own read, so it waits (no change
    since), and a release right after that read wakes it at once."""
    from supervisord_gpu.cluster.coordinator import _acquire

    def _take_or_wait(store: ClusterStore, lease: int, me: LockRecord) -> Any:
        """As prepare_cluster_start waits: acquire in one worker thread, the watch in another."""
        box: list[Any] = []
        reader = threading.Thread(target=lambda: box.append(_acquire(store, lease, me)))
        reader.start()
        reader.join()
        held, seen = box[0]
        if held is not None:
            store.watch_lock(1.0, seen)
        return held

    cfg = node_config(tmp_path, "a")
    kv = MemoryKV()
    store = memory_store(cfg, kv)
    store.processes()  # this thread's last read: before the lock existed
    other = memory_store(cfg, kv)
    theirs = other.grant()
    holder = LockRecord("b", "tp", starting=("tp",), pid=1, tid="tb0000000001")
    assert other.acquire(theirs, holder) is None
    mine = store.grant()
    me = LockRecord("a", "pd", starting=("pd",), pid=2, tid="ta0000000001")
    began = time.monotonic()
    held = _take_or_wait(store, mine, me)
    assert held is not None and held.node == "b"
    assert time.monotonic() - began >= 0.9, "woken at once by a change older than its read of the lock"
    # released between acquire's read and the watch: seen at once
    real_acquire = store.acquire

    def acquire_then_release(lease: int, who: LockRecord) -> Any:
        record = real_acquire(lease, who)
        other.release(holder)
        return record

    store.acquire = acquire_then_release  # type: ignore[method-assign]
    began = time.monotonic()
    assert _take_or_wait(store, mine, me) is not None
    assert time.monotonic() - began < 0.5, "a release just after the read was missed until the watch timed out"
