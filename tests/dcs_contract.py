"""The DCS contract (supervisord_gpu/cluster/dcs.py): every promise of the cluster's store, as
tests that take a `backend` fixture and hold whichever store it gives to the same behaviour.

Run twice: over the in-memory store in the fast tier (tests/test_dcs_contract_memory.py, no
server, its lease clock moved on by the test) and over a real etcd in the slow tier
(tests/test_dcs_contract_etcd.py, Debian's etcd-server, leases expiring in real time). The
in-memory store is what the fast decision tests run on (tests/test_cluster_decisions.py): this
is what keeps it honest to etcd.

A backend gives: `store(node)`, a new client of one shared store (each with its own `warn`
list, `said[node]`); `forge(store, path, raw, lease)`, a record written under the prefix as
anyone with write access could (garbage included); `pass_time(seconds)`, as the leases see it;
`outlived(ttl, check)`, whether `check()` holds once a lease of `ttl` seconds has gone
unrenewed; `TTL`, the shortest lease it keeps.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import pytest

from supervisord_gpu.cluster.dcs import LeaseNotFound, NodeLost, StepFailed
from supervisord_gpu.cluster.plan import ClusterPlan, NodeWork, Step
from supervisord_gpu.cluster.records import (GpuRecord, LockRecord, NodeRecord, ProcessRecord, StepReport,
                                             TransitionKind)
from supervisord_gpu.cluster.store import ClusterStore


class Backend(Protocol):
    TTL: int
    said: dict[str, list[str]]

    def store(self, node: str = "a") -> ClusterStore: ...
    def forge(self, store: ClusterStore, path: str, raw: bytes | str, lease: int = 0) -> None: ...
    def pass_time(self, seconds: float) -> None: ...
    def outlived(self, ttl: float, check: Callable[[], bool]) -> bool: ...


PLAN = ClusterPlan("tp", ("pd",), (
    Step(1, "stop", (NodeWork("a", "pd", ("prefill", "router")), NodeWork("b", "pd", ("decode",))), "router@a -> decode@b"),
    Step(2, "verify", (NodeWork("a", "tp", ()), NodeWork("b", "tp", ()))),
    Step(3, "start", (NodeWork("a", "tp", ("big", "router")), NodeWork("b", "tp", ("big",)))),
))
ME = LockRecord("a", "tp", TransitionKind.SWITCH, ("tp",), 4242, "t1")


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(call())
        except BaseException as e:  # noqa: BLE001 - handed to the test, which says what it expected
            got.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


# -- leases ----------------------------------------------------------------------------------------


def test_a_lease_renews_while_alive_and_refuses_renewal_and_writes_once_revoked(backend: Backend) -> None:
    s = backend.store()
    lease = s.grant()
    assert s.refresh(lease) is True
    s.announce(NodeRecord("a"), lease)
    s.revoke(lease)
    assert s.refresh(lease) is False  # we were presumed dead: come back with a new lease
    assert s.nodes() == {}  # what was bound to it went with it
    with pytest.raises(LeaseNotFound, match=r"answered with an error \(publishing node a\): .*requested lease not found"):
        s.announce(NodeRecord("a"), lease)


def test_a_node_is_alive_while_its_lease_is_renewed_and_gone_once_it_is_not(backend: Backend) -> None:
    s = backend.store()
    kept, dropped = s.grant(backend.TTL), s.grant(backend.TTL)
    s.announce(NodeRecord("a"), kept)
    s.announce(NodeRecord("b"), dropped)
    assert set(s.nodes()) == {"a", "b"}

    for _ in range(3):  # 1.8 TTLs, a renewed every 0.6 of one, b not at all
        backend.pass_time(backend.TTL * 0.6)
        assert s.refresh(kept) is True
    assert backend.outlived(0, lambda: set(s.nodes()) == {"a"})


# -- the transition lock ---------------------------------------------------------------------------


def test_the_lock_is_exclusive_and_the_loser_is_told_who_holds_it_and_for_what(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    lease = a.grant()
    assert a.acquire(lease, ME) is None
    held = b.acquire(b.grant(), LockRecord("b", "pd", starting=("pd",), pid=7, tid="t2"))
    assert held is not None
    assert (held.node, held.kind, held.target, held.starting, held.pid, held.tid, held.lease) == (
        "a", TransitionKind.SWITCH, "tp", ("tp",), 4242, "t1", lease)
    assert b.holder() == held


def test_of_stores_racing_for_the_lock_exactly_one_wins(backend: Backend) -> None:
    names = ["a", "b", "c", "d"]
    stores = {n: backend.store(n) for n in names}
    leases = {n: stores[n].grant() for n in names}
    barrier = threading.Barrier(len(names))
    threads = {n: in_thread(lambda n=n: (barrier.wait(), stores[n].acquire(leases[n], LockRecord(n, "tp")))[1])  # type: ignore[misc]
               for n in names}
    for thread, _ in threads.values():
        thread.join(10)
    got = {n: box[0] for n, (_, box) in threads.items()}
    winners = [n for n in names if got[n] is None]
    assert len(winners) == 1, got
    assert all(got[n].node == winners[0] for n in names if n not in winners), got


def test_the_lock_is_freed_only_by_its_holder(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    assert a.acquire(a.grant(), ME) is None
    b.release(LockRecord("b", "tp", starting=("tp",), pid=4242, tid="t1"))  # not b's
    b.release(LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1"))  # the same node, another daemon
    assert b.holder() is not None and b.holder().node == "a"  # type: ignore[union-attr]
    a.release(ME)
    assert b.holder() is None
    assert b.acquire(b.grant(), LockRecord("b", "pd")) is None


def test_the_lock_of_a_holder_that_stopped_renewing_expires_with_its_lease(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    assert a.acquire(a.grant(backend.TTL), ME) is None
    assert backend.outlived(backend.TTL, lambda: b.holder() is None)
    assert b.acquire(b.grant(), LockRecord("b", "pd")) is None
    a.release(ME)  # a comes back and frees what it believes is its lock: b's stays
    assert a.holder() is not None and a.holder().node == "b"  # type: ignore[union-attr]


def test_a_rollbacks_lock_says_so_by_its_kind(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    rollback = LockRecord("a", "tp", TransitionKind.ROLLBACK, ("pd",), 1, "t9")
    assert a.acquire(a.grant(), rollback) is None
    held = b.holder()
    assert held is not None and (held.kind, held.target, held.to) == (TransitionKind.ROLLBACK, "tp", "rollback of tp")
    # a profile whose name begins with "rollback" is a switch to it, not a rollback
    a.release(held)
    assert a.acquire(a.grant(), LockRecord("a", "rollback-canary", starting=("rollback-canary",))) is None
    assert b.holder().kind is TransitionKind.SWITCH  # type: ignore[union-attr]


def test_a_value_at_the_lock_that_is_no_genuine_lock_is_named_ignored_and_taken_over(backend: Backend) -> None:
    s = backend.store()
    backend.forge(s, "lock", json.dumps({"node": "z", "to": "x"}))  # bound to no lease: it would never go
    assert s.holder() is None
    assert any("'/" in m and "lock" in m and "bound to no lease" in m for m in backend.said["a"]), backend.said
    assert s.acquire(s.grant(), ME) is None and s.holder() is not None
    s.release(ME)
    backend.forge(s, "lock", b"\xff not json", s.grant())  # garbage with a lease: no lock either
    assert s.holder() is None and s.acquire(s.grant(), ME) is None


def test_a_wait_for_the_lock_wakes_when_it_is_released_and_not_before(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    assert a.acquire(a.grant(), ME) is None
    read = threading.Event()

    def wait() -> float:
        assert b.acquire(b.grant(), LockRecord("b", "pd")) is not None  # the read the watch follows on from
        read.set()
        began = time.monotonic()
        b.watch_lock(5.0)
        return time.monotonic() - began

    thread, took = in_thread(wait)
    assert read.wait(5)
    time.sleep(0.3)
    a.release(ME)
    thread.join(6)
    assert 0.2 <= took[0] < 2.0, took
    began = time.monotonic()
    b.holder()
    b.watch_lock(0.3)  # nothing changes: the timeout ends it
    assert 0.25 <= time.monotonic() - began < 2.0


# -- plans and the transition under way ------------------------------------------------------------


def test_a_plan_reads_back_as_written_and_is_the_transition_under_way(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    assert b.current() is None
    lease = a.grant()
    a.put_plan("t1", PLAN, lease)
    assert b.plan("t1") == (PLAN, lease)
    assert b.current() == ("t1", PLAN)
    assert b.plan("t2") is None


def test_the_transition_under_way_goes_with_its_writers_lease(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    a.put_plan("t1", PLAN, a.grant(backend.TTL))
    assert backend.outlived(backend.TTL, lambda: b.current() is None and b.plan("t1") is None)


def test_a_wait_for_the_transition_wakes_when_a_plan_is_written(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    read = threading.Event()

    def wait() -> Any:
        """As the agent waits: read, watch from that read, read again (a wake may come early:
        etcd's gateway wakes a watch of `current` at the plan's write, just before its own)."""
        deadline = time.monotonic() + 5
        now = b.current()
        read.set()
        while now is None and time.monotonic() < deadline:
            b.watch_current(deadline - time.monotonic())
            now = b.current()
        return now

    thread, got = in_thread(wait)
    assert read.wait(5)
    time.sleep(0.2)
    began = time.monotonic()
    a.put_plan("t1", PLAN, a.grant())
    thread.join(6)
    assert got == [("t1", PLAN)] and time.monotonic() - began < 2.0, got


def test_a_plan_that_does_not_parse_is_named_and_never_obeyed(backend: Backend) -> None:
    s = backend.store()
    lease = s.grant()
    backend.forge(s, "current", "t1", lease)
    bad = PLAN.to_json()
    bad["steps"][0]["action"] = "rm -rf"  # an unknown step kind
    backend.forge(s, "transitions/t1/plan", json.dumps(bad), lease)
    assert s.current() is None and s.plan("t1") is None
    assert any("transitions/t1/plan" in m and "'rm -rf' is not a step kind" in m for m in backend.said["a"]), backend.said
    backend.forge(s, "current", "$(reboot)", lease)  # no transition id
    assert s.current() is None


# -- step reports ----------------------------------------------------------------------------------


def test_reports_read_back_per_node_and_a_report_that_does_not_parse_is_skipped(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    lease = a.grant()
    a.report("t1", 1, "a", StepReport("done", at=1700000000.5), lease)
    b.report("t1", 1, "b", StepReport("failed", "GPU 0 held by pid 4242 (user eve)"), lease)
    backend.forge(a, "transitions/t1/steps/1/c", json.dumps({"state": "maybe"}), lease)
    assert a.reports("t1", 1) == {"a": StepReport("done", at=1700000000.5),
                                  "b": StepReport("failed", "GPU 0 held by pid 4242 (user eve)")}
    assert any("steps/1/c" in m and "neither done nor failed" in m for m in backend.said["a"]), backend.said
    assert a.reports("t1", 2) == {}


def test_a_step_wait_settles_fails_names_the_lost_node_or_times_out_naming_the_late(backend: Backend) -> None:
    s, other = backend.store("a"), backend.store("b")
    alive, dying = s.grant(), s.grant()
    s.announce(NodeRecord("a"), alive)
    s.announce(NodeRecord("b"), dying)
    s.report("t1", 1, "a", StepReport("done"), alive)
    with pytest.raises(TimeoutError, match="waiting for b"):
        s.wait_step("t1", 1, ("a", "b"), time.monotonic() + 0.3)

    thread, got = in_thread(lambda: s.wait_step("t1", 1, ("a", "b"), time.monotonic() + 10))
    time.sleep(0.2)
    other.report("t1", 1, "b", StepReport("done"), dying)  # the wait wakes on the report
    thread.join(5)
    assert set(got[0]) == {"a", "b"}

    other.report("t1", 2, "b", StepReport("failed", "port 30000 held by pid 1 (user root)"), dying)
    with pytest.raises(StepFailed, match="step 2 failed on node 'b': port 30000 held by pid 1"):
        s.wait_step("t1", 2, ("a", "b"), time.monotonic() + 5)

    thread, got = in_thread(lambda: s.wait_step("t1", 3, ("a", "b"), time.monotonic() + 10))
    time.sleep(0.2)
    other.revoke(dying)  # b's agent is gone: its key goes, which wakes the wait
    thread.join(5)
    assert isinstance(got[0], NodeLost) and "node 'b' was lost during step 3" in str(got[0]), got


# -- what the nodes and daemons publish ------------------------------------------------------------


def test_a_nodes_record_reads_back_as_announced(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    record = NodeRecord("a", 1234, (("pd", "active"), ("tp", "inactive")),
                        (GpuRecord(0, 512, 81559, False), GpuRecord(1, 0, 81559, True), GpuRecord(error="NVML: driver not loaded")), 1700000000.25)
    a.announce(record, a.grant())
    assert b.nodes() == {"a": record}


def test_process_states_read_back_per_instance_and_a_bad_one_is_named_and_skipped(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    lease = a.grant()
    a.publish_process(ProcessRecord("pd", "a", "router", "ready", 1700000000.0), lease)
    b.publish_process(ProcessRecord("pd", "b", "decode", "stopped"), lease)
    a.publish_process(ProcessRecord("tp", "a", "big", "starting"), lease)
    backend.forge(a, "parts/pd/b/prefill", json.dumps({"state": "hacked"}), lease)
    assert a.processes("pd") == [ProcessRecord("pd", "a", "router", "ready", 1700000000.0),
                                 ProcessRecord("pd", "b", "decode", "stopped")]
    assert a.process_states("pd") == {"a/router": "ready", "b/decode": "stopped"}
    assert sorted(a.running_instances()) == ["pd", "tp"]
    assert any("parts/pd/b/prefill" in m and "'hacked' is not a process state" in m for m in backend.said["a"])
    said = len(backend.said["a"])
    a.processes("pd")
    assert len(backend.said["a"]) == said  # named once per version of the key, not on every read


def test_a_wait_wakes_on_any_change_and_ends_at_its_deadline(backend: Backend) -> None:
    a, b = backend.store("a"), backend.store("b")
    lease = a.grant()

    def ready() -> Any:
        return a.process_states("pd").get("b/decode") == "ready" or None

    thread, got = in_thread(lambda: a.wait(ready, time.monotonic() + 10))
    time.sleep(0.3)
    began = time.monotonic()
    b.publish_process(ProcessRecord("pd", "b", "decode", "ready"), lease)
    thread.join(5)
    assert got == [True] and time.monotonic() - began < 1.5
    with pytest.raises(TimeoutError, match="timed out waiting for b"):
        a.wait(lambda: None, time.monotonic() + 0.3, late=lambda: ["b"])
    with pytest.raises(TimeoutError, match="abandoned"):
        a.wait(lambda: None, time.monotonic() + 10, aborted=lambda: True)


# -- on the wire -----------------------------------------------------------------------------------


def test_records_are_stored_in_the_shapes_every_version_reads(backend: Backend) -> None:
    """Nodes of the previous version read what this one writes, and the other way round: the
    same keys and JSON as before the records were typed (a rollback's kind is its "to")."""
    s = backend.store()
    lease = s.grant()
    s.acquire(lease, LockRecord("a", "tp", TransitionKind.ROLLBACK, ("pd",), 7, "t1"))
    s.announce(NodeRecord("a", 7, (("pd", "active"),), (GpuRecord(0, 1, 2, True),), 5.0), lease)
    s.publish_process(ProcessRecord("pd", "a", "router", "ready", 5.0), lease)
    s.report("t1", 1, "a", StepReport("done", at=5.0), lease)
    s.report("t1", 2, "a", StepReport("failed", "why"), lease)
    s.put_plan("t1", ClusterPlan("tp", (), (Step(1, "start", (NodeWork("a", "tp", ("big",)),)),)), lease)
    _, found = s.kv.range(s.key(""), prefix=True)
    stored = {e.key[len(s.key("")):]: e.value.decode() for e in found}
    assert stored == {
        "lock": '{"node": "a", "pid": 7, "starting": ["pd"], "tid": "t1", "to": "rollback of tp"}',
        "nodes/a": '{"at": 5.0, "gpus": [{"idle": true, "in_use_mib": 1, "index": 0, "total_mib": 2}], "node": "a", '
                   '"parts": {"pd": "active"}, "pid": 7}',
        "parts/pd/a/router": '{"at": 5.0, "state": "ready"}',
        "transitions/t1/steps/1/a": '{"state": "done", "at": 5.0}',
        "transitions/t1/steps/2/a": '{"state": "failed", "reason": "why"}',
        "transitions/t1/plan": '{"target": "tp", "stopping": [], "steps": [{"number": 1, "action": "start", '
                               '"work": [{"node": "a", "instance": "tp", "processes": ["big"]}], "order": ""}]}',
        "current": "t1",
    }
