"""Records in etcd are input from whoever can write it: each attack of the security review, as a
test against the in-memory store (the same ClusterStore code as over etcd, no server). A bad
record is named in one line and skipped, never a crash and never obeyed; a plan touches only
profiles here that span nodes; a lock counts only when bound to a lease; a stray process record
cannot fail another profile's start; a forged lock does not let a daemon skip coordinating."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from cluster_fixtures import FakeUnits, NoGpus, memory_store, node_config
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.cluster import agent as agent_module
from supervisord_gpu.cluster.agent import NodeAgent
from supervisord_gpu.cluster.coordinator import prepare_cluster_start, running_profiles
from supervisord_gpu.cluster.gate import ClusterGate
from supervisord_gpu.cluster.kv import MemoryKV
from supervisord_gpu.cluster.plan import ClusterPlan, NodeWork, Step
from supervisord_gpu.cluster.records import BadRecord, LockRecord, NodeRecord, parse_plan
from supervisord_gpu.cluster.store import ClusterStore
from supervisord_gpu.config.loader import load_profile


def stop_plan(instance: str, node: str = "a") -> ClusterPlan:
    return ClusterPlan(instance, (instance,), (Step(1, "stop", (NodeWork(node, instance, ()),)),))


def agent_for(tmp_path, said: list[str]):  # type: ignore[no-untyped-def]
    cfg = node_config(tmp_path)
    store = memory_store(cfg, said=said)
    store.watch_once = lambda *_a, **_k: None  # type: ignore[method-assign]  # one turn, no waiting
    agent = NodeAgent(cfg, store, FakeUnits(), NoGpus(), lambda m, _p: said.append(m))  # type: ignore[arg-type]
    agent.lease = store.grant()
    return agent, store, store.kv


def test_a_plan_that_is_not_json_is_named_once_and_the_agent_goes_on(tmp_path):
    said: list[str] = []
    agent, store, kv = agent_for(tmp_path, said)
    kv.put("/c/current", "t1")
    kv.put("/c/transitions/t1/plan", "{not json")
    for _ in range(3):
        agent.once()
    assert agent.internal_errors == 0 and agent.units.calls == []
    assert said == ["ignoring etcd record '/c/transitions/t1/plan': not JSON"], said
    kv.put("/c/current", "t2")  # the next genuine transition is carried out as ever
    kv.put("/c/transitions/t2/plan", json.dumps(stop_plan("pd").to_json()))
    agent.once()
    assert agent.units.calls == [("stop", "pd")] and store.reports("t2", 1)["a"].state == "done"


@pytest.mark.parametrize("instance, why", [
    ("solo", "it names solo, which does not span nodes (the agent never touches it)"),
    ("ghost", "it names ghost, which is not a profile here"),
])
def test_a_plan_naming_what_is_not_a_profile_spanning_nodes_here_is_never_obeyed(tmp_path, instance, why):
    said: list[str] = []
    agent, _, kv = agent_for(tmp_path, said)
    kv.put("/c/current", "t1")
    kv.put("/c/transitions/t1/plan", json.dumps(stop_plan(instance).to_json()))
    agent.once()
    assert agent.units.calls == [] and agent.internal_errors == 0
    assert any(m.startswith("ignoring transition t1: " + why) for m in said), said


def test_a_profile_written_in_place_as_the_plan_arrives_is_read_again_and_the_plan_obeyed(tmp_path):
    """An editor (the operator, root) truncating pd.toml and writing it again as a rollback
    arrives: the agent reads it again until it parses, instead of ignoring the rollback and
    leaving this node's part stopped behind a held lock."""
    said: list[str] = []
    agent, store, kv = agent_for(tmp_path, said)
    path = tmp_path / "profiles" / "pd.toml"
    whole = path.read_text()
    path.write_text("")  # the moment after the truncate
    threading.Timer(0.5, lambda: path.write_text(whole)).start()
    kv.put("/c/current", "t1")
    kv.put("/c/transitions/t1/plan", json.dumps(stop_plan("pd").to_json()))
    began = time.monotonic()
    agent.once()
    assert agent.units.calls == [("stop", "pd")] and store.reports("t1", 1)["a"].state == "done", said
    assert 0.4 < time.monotonic() - began < agent_module.PROFILE_SETTLE_S, "read again, not waited out"
    assert not any(m.startswith("ignoring transition") for m in said), said


def test_a_profile_that_stays_broken_is_ignored_after_the_settle_naming_the_error(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_module, "PROFILE_SETTLE_S", 0.6)
    said: list[str] = []
    agent, _, kv = agent_for(tmp_path, said)
    (tmp_path / "profiles" / "pd.toml").write_text("[servers\n")
    kv.put("/c/current", "t1")
    kv.put("/c/transitions/t1/plan", json.dumps(stop_plan("pd").to_json()))
    began = time.monotonic()
    agent.once()
    assert agent.units.calls == [] and agent.internal_errors == 0
    assert time.monotonic() - began >= 0.6
    line = next(m for m in said if m.startswith("ignoring transition t1: it names pd, which is not a profile here: "))
    assert "pd.toml" in line and line.endswith("(read for 0.6 s)") and "\n" not in line, line


def test_a_missing_profile_is_not_waited_for(tmp_path):
    said: list[str] = []
    agent, _, kv = agent_for(tmp_path, said)
    kv.put("/c/current", "t1")
    kv.put("/c/transitions/t1/plan", json.dumps(stop_plan("ghost").to_json()))
    began = time.monotonic()
    agent.once()
    assert time.monotonic() - began < 0.5 and agent.units.calls == []
    assert any("unknown profile 'ghost'" in m for m in said), said


@pytest.mark.parametrize("mutate, words", [
    (lambda p: p["steps"][0].update(action="exec"), "steps[0].action: 'exec' is not a step kind"),
    (lambda p: p["steps"][0]["work"][0].update(instance="../../etc/x"), "steps[0].work[0].instance: '../../etc/x' is not a valid name"),
    (lambda p: p["steps"][0]["work"][0].update(node="A B"), "is not a valid name"),
    (lambda p: p["steps"][0].update(number=7), "steps[0].number: must be 1"),
    (lambda p: p.update(target="x" * 5000), "target: is longer than 200"),
    (lambda p: p["steps"][0].update(work=[]), "steps[0].work: names no node"),
    (lambda p: p.update(run="rm -rf /"), "unknown field 'run'"),
    (lambda p: p["steps"][0]["work"][0].update(processes=[1]), "processes[0]: must be a string"),
])
def test_a_plan_that_does_not_fit_is_refused_whole_naming_what(mutate, words):
    plan = stop_plan("pd").to_json()
    mutate(plan)
    with pytest.raises(BadRecord) as e:
        parse_plan("/c/transitions/t1/plan", json.dumps(plan))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_plan_naming_a_process_or_node_the_profile_lacks_is_not_obeyed(tmp_path):
    said: list[str] = []
    agent, _, kv = agent_for(tmp_path, said)
    plan = ClusterPlan("pd", (), (Step(1, "stop", (NodeWork("a", "pd", ("decode",)),)),)).to_json()  # decode is on b
    kv.put("/c/current", "t1")
    kv.put("/c/transitions/t1/plan", json.dumps(plan))
    agent.once()
    assert agent.units.calls == [] and any("decode of pd on node a, which does not run there" in m for m in said), said


def test_a_lock_bound_to_no_lease_is_no_lock_and_is_taken_over(tmp_path):
    said: list[str] = []
    store = memory_store(node_config(tmp_path), said=said)
    store.kv.put("/c/lock", json.dumps({"node": "z", "to": "x", "starting": ["tp"]}))  # no lease: would never go
    assert store.holder() is None
    me = LockRecord("a", "tp", pid=1, tid="t1")
    assert store.acquire(store.grant(), me) is None  # taken, not waited on forever
    held = store.holder()
    assert held is not None and held.node == "a" and held.lease
    assert said == ["ignoring etcd record '/c/lock': bound to no lease (a genuine lock goes with its holder's lease)"], said
    store.kv.put("/c/lock", b"\xff not json", lease=store.grant())  # garbage with a lease: no lock either
    assert store.holder() is None and store.acquire(store.grant(), me) is None


def test_a_lock_whose_holders_lease_is_gone_is_free(tmp_path):
    kv = MemoryKV()
    store = memory_store(node_config(tmp_path), kv)
    lease = store.grant()
    assert store.acquire(lease, LockRecord("b")) is None
    kv.expire(lease)
    assert store.holder() is None and store.acquire(store.grant(), LockRecord("a")) is None


def test_stray_process_records_never_fail_another_profiles_start(tmp_path):
    said: list[str] = []
    cfg = node_config(tmp_path)
    store = memory_store(cfg, said=said)
    lease = store.grant()
    store.kv.put("/c/parts/ghost/a/router", json.dumps({"state": "ready"}), lease=lease)  # no such profile here
    store.kv.put("/c/parts/solo/a/main", json.dumps({"state": "ready"}), lease=lease)  # not a cluster profile
    store.kv.put("/c/parts/tp/a", "not json at all", lease=lease)
    store.kv.put("/c/parts/pd/b/decode", json.dumps({"state": "ready"}), lease=lease)  # really running
    assert [p.name for p in running_profiles(store, cfg, "tp", lambda m, _p: said.append(m))] == ["pd"]
    assert any("ignoring the process records of ghost" in m for m in said), said
    assert any("ignoring the process records of solo in etcd: it does not span nodes" in m for m in said), said


def start_part(tmp_path, store: ClusterStore, name: str = "tp", run_for: float = 1.5):  # type: ignore[no-untyped-def]
    """This node's daemon of `name` through its cluster pre-flight for `run_for` seconds:
    whether it only verified locally (a participant) or coordinated (took the lock, wrote a plan)."""
    cfg = node_config(tmp_path)
    part = load_profile(cfg, name)
    said: list[str] = []
    verified: list[bool] = []

    async def verify() -> None:
        verified.append(True)

    alive = store.grant()
    for node in ("a", "b"):  # both nodes' agents are up (they carry out no step here)
        store.announce(NodeRecord(node), alive)

    async def go() -> None:
        gate = ClusterGate(store, part, "a", lambda m, _p: said.append(m))
        try:
            await asyncio.wait_for(prepare_cluster_start(part, cfg, NoGpus(), gate, lambda m, _p: said.append(m),  # type: ignore[arg-type]
                                                         said.append, verify), run_for)
        except TimeoutError:
            pass
        finally:
            gate.close()

    asyncio.run(go())
    return verified, said


def test_a_start_with_a_stray_process_record_coordinates_instead_of_failing(tmp_path):
    store = memory_store(node_config(tmp_path))
    store.kv.put("/c/parts/ghost/b/router", json.dumps({"state": "ready"}), lease=store.grant())
    verified, said = start_part(tmp_path, store)
    assert any(m.startswith("plan: switch the cluster to tp") for m in said), said  # the plan was written: the start goes on
    assert any("ignoring the process records of ghost" in m for m in said), said


def test_a_forged_lock_without_a_lease_does_not_make_a_daemon_skip_coordination(tmp_path):
    store = memory_store(node_config(tmp_path))
    store.kv.put("/c/lock", json.dumps({"node": "b", "to": "tp", "starting": ["tp"], "tid": "t1"}))
    verified, said = start_part(tmp_path, store)
    assert verified == [] and any(m.startswith("plan: switch the cluster to tp") for m in said), said  # it took the lock
    assert not any("waiting for the cluster transition" in m for m in said), said


def test_a_forged_lock_beside_a_real_transitions_plan_is_not_believed(tmp_path):
    store = memory_store(node_config(tmp_path))
    real = store.grant()
    store.put_plan("t9", stop_plan("pd", "b"), real)  # a real transition's plan (to pd), under its lease
    store.kv.put("/c/lock", json.dumps({"node": "b", "to": "tp", "starting": ["tp"], "tid": "t9"}), lease=store.grant())
    verified, said = start_part(tmp_path, store, run_for=1.0)
    assert verified == [] and any("waiting for the cluster transition to tp" in m for m in said), said


def test_a_genuine_transition_still_lets_its_participants_only_verify(tmp_path):
    store = memory_store(node_config(tmp_path))
    lease = store.grant()
    plan = ClusterPlan("tp", (), (Step(1, "start", (NodeWork("a", "tp", ("big", "router")), NodeWork("b", "tp", ("big",)))),))
    assert store.acquire(lease, LockRecord("b", "tp", starting=("tp",), tid="t3")) is None
    store.put_plan("t3", plan, lease)
    verified, said = start_part(tmp_path, store)
    assert verified == [True], said
    # a live lock whose transition has no plan is forged (a coordinator writes the plan before any
    # daemon it starts looks): it is not believed; the daemon waits for it like any other transition
    bare = memory_store(node_config(tmp_path))
    assert bare.acquire(bare.grant(), LockRecord("t", "tp", starting=("tp",), tid="t1")) is None
    verified, said = start_part(tmp_path, bare, run_for=1.0)
    assert verified == [] and any("waiting for the cluster transition to tp" in m for m in said), said


def test_status_cluster_names_bad_records_and_shows_the_rest(tmp_path, capsys, monkeypatch):
    cfg = node_config(tmp_path)
    kv = MemoryKV()
    lease = kv.grant(30)
    kv.put("/c/nodes/a", json.dumps({"node": "a", "pid": 7, "parts": {"pd": "active"},
                                     "gpus": [{"index": 0, "in_use_mib": 0, "total_mib": 80, "idle": True}]}), lease)
    kv.put("/c/nodes/b", json.dumps({"gpus": [{"index": "zero"}], "parts": {"pd": 3}}), lease)
    kv.put("/c/nodes/c", "not json", lease)
    kv.put("/c/nodes/d", json.dumps([1, 2]), lease)
    kv.put("/c/parts/pd/a/router", json.dumps({"state": "ready"}), lease)
    kv.put("/c/parts/pd/a/prefill", json.dumps({"state": {"x": 1}}), lease)
    kv.put("/c/lock", json.dumps({"to": ["x"]}), lease)
    kv.put("/c/current", "t1", lease)
    kv.put("/c/transitions/t1/plan", json.dumps({"target": "tp", "steps": "all"}), lease)
    monkeypatch.setattr(ClusterStore, "_connect", staticmethod(lambda _cfg: kv))
    for as_json in ([], ["--json"]):
        assert gpusupctl.main(["status", "--cluster", "--config-dir", str(tmp_path), *as_json]) == 0
        out, err = capsys.readouterr()
        if not as_json:
            assert "node a: agent pid 7; units: dsv4@pd active" in out and "pd: router ready" in out, out
            assert "GPUs: 0 idle" in out and "node b" not in out and "transition: none" in out, out
        bad = err.strip().splitlines()
        assert len(bad) == 6 and all(line.startswith("ignoring etcd record '/c/") for line in bad), err
    del cfg
