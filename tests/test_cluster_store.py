"""The cluster's store against a real etcd (Debian's etcd-server): the lock as a lease, nodes
that vanish when their lease expires, step reports, and a clear error when etcd is away."""

from __future__ import annotations

import time

import pytest

from etcd_server import EtcdServer
from supervisord_gpu.cluster.plan import ClusterPlan
from supervisord_gpu.cluster.records import LockRecord, NodeRecord, StepReport
from supervisord_gpu.cluster.store import ClusterStore, ClusterUnavailable, NodeLost, StepFailed
from supervisord_gpu.config.model import ClusterConfig


@pytest.fixture
def etcd(tmp_path):  # type: ignore[no-untyped-def]
    server = EtcdServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def store(etcd, ttl: int = 2) -> ClusterStore:  # type: ignore[no-untyped-def]
    return ClusterStore(ClusterConfig(node="a", etcd=(etcd.url,), prefix="/test-cluster", lease_ttl_s=ttl))


def test_the_lock_names_its_holder_and_frees_itself_when_the_holder_dies(etcd):
    a, b = store(etcd), store(etcd)
    lease_a, lease_b = a.grant(), b.grant()
    me = LockRecord("a", "tp", pid=1)
    assert a.acquire(lease_a, me) is None
    held = b.acquire(lease_b, LockRecord("b", "pd", pid=2))  # the loser is told who won
    assert held is not None and (held.node, held.to, held.pid, held.lease) == ("a", "tp", 1, lease_a)
    b.release(LockRecord("b", "pd", pid=2))  # not its lock: nothing happens
    assert a.holder() == held
    time.sleep(3.5)  # a stops renewing (dead): its lease, and the lock with it, expire
    assert b.holder() is None and b.acquire(lease_b := b.grant(), LockRecord("b")) is None
    b.release(LockRecord("b"))
    assert b.holder() is None


def test_releasing_the_lock_is_one_delete_that_no_reader_sees_half_done(etcd):
    import queue
    import threading

    from etcd3gw.client import Etcd3Client

    a, reader = store(etcd), store(etcd)
    lease = a.grant()
    seen: list[Exception] = []
    done = threading.Event()

    def read() -> None:  # another node reading the lock all along must never choke on it
        while not done.is_set():
            try:
                reader.holder()
            except Exception as e:  # noqa: BLE001 - any error is the failure this test looks for
                seen.append(e)
                return

    t = threading.Thread(target=read)
    t.start()
    for i in range(30):
        assert a.acquire(lease, LockRecord("a", "tp", pid=i)) is None
        a.release(LockRecord("a", "tp", pid=i))
    done.set()
    t.join()
    assert not seen, seen
    # etcd's own history of the key: each cycle is a put of the holder's record and one delete
    client = Etcd3Client(host="127.0.0.1", port=int(etcd.url.rsplit(":", 1)[1]), api_path="/v3/")
    events, cancel = client.watch(a.key("lock"), start_revision=1)
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [got.put(e) for e in events], daemon=True).start()
    kinds = []
    try:
        while len(kinds) < 60:
            e = got.get(timeout=5)
            kinds.append("DELETE" if e.get("type") == "DELETE" else ("PUT" if e["kv"].get("value") else "PUT empty"))
    finally:
        cancel()
    assert kinds == ["PUT", "DELETE"] * 30, kinds


def test_a_node_whose_agent_stops_renewing_is_gone_and_a_waiting_step_names_it(etcd):
    s = store(etcd)
    alive, dying = s.grant(), s.grant()
    s.announce(NodeRecord("a"), alive)
    s.announce(NodeRecord("b"), dying)
    assert set(s.nodes()) == {"a", "b"}
    s.report("t1", 1, "a", StepReport("done"), alive)
    t0 = time.monotonic()
    with pytest.raises(NodeLost, match="node 'b' was lost during step 1"):
        for _ in range(20):  # a keeps renewing, b does not; 10 s at most
            s.refresh(alive)
            try:
                s.wait_step("t1", 1, ("a", "b"), time.monotonic() + 0.5)
            except TimeoutError:
                continue
    assert time.monotonic() - t0 < 2 + 3  # within the TTL and one watch slice
    assert set(s.nodes()) == {"a"}


def test_a_step_settles_when_every_node_reported_and_a_failure_names_node_and_reason(etcd):
    s = store(etcd, ttl=30)
    lease = s.grant()
    for node in ("a", "b"):
        s.announce(NodeRecord(node), lease)
    s.report("t2", 1, "a", StepReport("done"), lease)
    with pytest.raises(TimeoutError, match="waiting for b"):
        s.wait_step("t2", 1, ("a", "b"), time.monotonic() + 0.3)
    s.report("t2", 1, "b", StepReport("done"), lease)
    assert set(s.wait_step("t2", 1, ("a", "b"), time.monotonic() + 5)) == {"a", "b"}
    s.report("t2", 2, "b", StepReport("failed", "GPU 0 held by pid 4242 (user eve)"), lease)
    with pytest.raises(StepFailed, match="step 2 failed on node 'b': GPU 0 held by pid 4242"):
        s.wait_step("t2", 2, ("a", "b"), time.monotonic() + 5)
    s.put_plan("t2", ClusterPlan("tp", (), ()), lease)
    assert s.current() == ("t2", ClusterPlan("tp", (), ()))


def test_etcd_out_of_reach_is_one_clear_error_naming_it(etcd):
    s = store(etcd)
    etcd.pause()
    try:
        with pytest.raises(ClusterUnavailable) as e:
            s.holder()
    finally:
        etcd.resume()
    said = str(e.value)
    assert said.startswith(f"etcd at {etcd.url} cannot be reached (reading the transition lock): ") and "\n" not in said
    with pytest.raises(ClusterUnavailable, match="no etcd is configured"):
        ClusterStore(ClusterConfig(node="a"))
