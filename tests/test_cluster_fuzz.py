"""Fuzz every reader of etcd's records -- the agent, the gate, the coordinator, `status --cluster`
-- with generated records over the in-memory store (the same ClusterStore code as over etcd):
well-formed ones, and ones with a field of the wrong type, out of range, too long, missing or
unknown, names that are not names, values that are not JSON or not UTF-8, nesting past the
parser's limit. What may happen: a record named and skipped, a transition refused or failed
with a reason. What must not: an uncaught exception (an internal error), or a unit touched that
is not a profile spanning nodes here.

CLUSTER_FUZZ_CASES (default 500 per reader, a few seconds; the review's run: 10000) and
CLUSTER_FUZZ_SEED choose the run; a failure names the case's seed and record."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
from typing import Any

import pytest

from cluster_fixtures import CLUSTER_PROFILES, FakeUnits, NoGpus, memory_store, node_config
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.cluster.agent import NodeAgent
from supervisord_gpu.cluster.coordinator import _plan_agrees, running_profiles
from supervisord_gpu.cluster.gate import ClusterGate
from supervisord_gpu.cluster.kv import MemoryKV
from supervisord_gpu.cluster.plan import plan_switch
from supervisord_gpu.cluster.records import LockRecord, NodeRecord
from supervisord_gpu.cluster.store import ClusterStore, NodeLost, StepFailed
from supervisord_gpu.config.loader import load_profile
from supervisord_gpu.errors import StartError

CASES = int(os.environ.get("CLUSTER_FUZZ_CASES", "500"))
SEED = int(os.environ.get("CLUSTER_FUZZ_SEED", "20250101"))
P = "/c"

NAMES = ["a", "b", "c", "pd", "tp", "solo", "ghost", "router", "big", "prefill", "decode", "t1", "", "A", "..", "a/b",
         "x" * 70, "é", "\x00", "a b", "-a", "1", "dsv4@pd", "../../etc/passwd", "\n"]


def scalar(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -1, 1, 2, 7, 1 << 40, -(1 << 70), 10 ** 30, 0.5, -3.25, 1e308,
        rng.choice(NAMES), "x" * rng.choice([0, 1, 64, 65, 201, 1001, 5000]), "done", "failed", "ready", "stopped",
        "stop", "start", "verify", "exec", "active", "\u202e\u0000", "".join(chr(rng.randrange(0, 0x3000)) for _ in range(8)),
    ])


def value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.6:
        return scalar(rng)
    if r < 0.8:
        return [value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {str(scalar(rng))[:20]: value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def mutate(rng: random.Random, record: Any) -> Any:
    """`record` with one to three changes at random places: a field replaced, dropped or added."""
    record = copy.deepcopy(record)
    for _ in range(rng.randrange(1, 4)):
        path: list[Any] = []
        node = record
        while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            path.append(key)
            node = node[key]
        if not path:
            if isinstance(record, dict):
                record[str(scalar(rng))[:20]] = value(rng)
            else:
                record = value(rng)
            continue
        parent = record
        for key in path[:-1]:
            parent = parent[key]
        what = rng.random()
        if what < 0.6:
            parent[path[-1]] = value(rng)
        elif what < 0.8:
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[str(scalar(rng))[:20]] = value(rng)
        else:
            parent.append(value(rng))
    return record


def encode(rng: random.Random, record: Any) -> bytes:
    r = rng.random()
    text = json.dumps(record)
    if r < 0.80:
        return text.encode()
    if r < 0.84:
        return text[: rng.randrange(0, len(text) + 1)].encode()  # cut short
    if r < 0.87:
        return b"\xff\xfe" + text.encode()  # not UTF-8
    if r < 0.90:
        return b"[" * 100000 + b"]" * 100000  # past the parser's recursion limit
    if r < 0.92:
        return b'{"state": NaN, "number": Infinity, "pid": -Infinity}'
    if r < 0.94:
        return b""
    if r < 0.96:
        return ("x" * 70000).encode()
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))


class Templates:
    """Well-formed records, to mutate: the plans the coordinator writes, a lock, the rest."""

    def __init__(self, cfg: Any) -> None:
        whole = {n: load_profile(cfg, n, True) for n in CLUSTER_PROFILES}
        self.plans = [plan_switch(whole["tp"], [whole["pd"]]).to_json(), plan_switch(whole["pd"], [whole["tp"]]).to_json(),
                      plan_switch(whole["pd"], []).to_json()]
        self.lock = {"node": "b", "to": "tp", "starting": ["tp"], "pid": 42, "tid": "t1"}
        self.node = {"node": "b", "pid": 9, "parts": {"pd": "active", "tp": "inactive"}, "at": 1.5,
                     "gpus": [{"index": 0, "in_use_mib": 1000, "total_mib": 80000, "idle": False}, {"error": "NVML: gone"}]}
        self.process = {"state": "ready", "at": 2.0}
        self.report = {"state": "done", "at": 3.0}
        self.failed = {"state": "failed", "reason": "GPU 0 held by pid 4242"}


def record(rng: random.Random, template: Any) -> bytes:
    return encode(rng, template if rng.random() < 0.25 else mutate(rng, template))


def part_key(rng: random.Random) -> str:
    pieces = [rng.choice(["tp", "pd", "ghost", "solo"] + NAMES), rng.choice(["a", "b"] + NAMES),
              rng.choice(["router", "big", "decode", "prefill"] + NAMES)]
    if rng.random() < 0.1:
        pieces = pieces[: rng.randrange(0, 3)] + ([rng.choice(NAMES)] if rng.random() < 0.5 else [])
    return f"{P}/parts/" + "/".join(pieces)


def fill(rng: random.Random, kv: MemoryKV, t: Templates, lease: int) -> str:
    """A random set of records in every place we read; returns the transition id used."""
    tid = rng.choice(["t1", "t1", "t2", "", "t 1", "x" * 80, "../t1"])
    bound = lambda: lease if rng.random() < 0.8 else 0  # noqa: E731
    if rng.random() < 0.9:
        kv.put(f"{P}/current", tid if rng.random() < 0.9 else encode(rng, value(rng)), bound())
    if rng.random() < 0.9:
        kv.put(f"{P}/transitions/{tid}/plan", record(rng, rng.choice(t.plans)), bound())
    if rng.random() < 0.7:
        kv.put(f"{P}/lock", record(rng, t.lock), bound())
    for _ in range(rng.randrange(0, 4)):
        kv.put(f"{P}/nodes/{rng.choice(['a', 'b'] + NAMES)}", record(rng, t.node), lease)
    for _ in range(rng.randrange(0, 6)):
        kv.put(part_key(rng), record(rng, t.process), lease)
    for _ in range(rng.randrange(0, 4)):
        kv.put(f"{P}/transitions/{tid}/steps/{rng.randrange(1, 4)}/{rng.choice(['a', 'b'] + NAMES)}",
               record(rng, rng.choice([t.report, t.failed])), lease)
    return tid


class Agent(NodeAgent):
    def verify(self, instance: str) -> str:  # this node's NVML and sockets are not what is fuzzed
        return ""


def cases(name: str):  # type: ignore[no-untyped-def]
    for i in range(CASES):
        yield i, random.Random(f"{SEED}-{name}-{i}")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):  # type: ignore[no-untyped-def]
    return node_config(tmp_path_factory.mktemp("fuzz"))


def test_fuzz_the_agent(cfg):
    t = Templates(cfg)
    touched: dict[str, int] = {}
    refused = 0
    for i, rng in cases("agent"):
        said: list[str] = []
        kv = MemoryKV()
        store = memory_store(cfg, kv, said)
        store.watch_once = lambda *_a, **_k: None  # type: ignore[method-assign]
        units = FakeUnits()
        agent = Agent(cfg, store, units, NoGpus(), lambda m, _p, said=said: said.append(m))  # type: ignore[arg-type]
        agent.lease = store.grant()
        agent.stopping.set()  # a wait for another node's report gives up at once: one turn
        for node in ("a", "b"):
            store.announce(NodeRecord(node), agent.lease)
        fill(rng, kv, t, kv.grant(30))
        agent.once()
        assert agent.internal_errors == 0, (i, said)
        for _, instance in units.calls:
            assert instance in CLUSTER_PROFILES, (i, units.calls)
            touched[instance] = touched.get(instance, 0) + 1
        refused += any(m.startswith(("ignoring transition", "ignoring etcd record")) for m in said)
    print(f"agent: {CASES} cases, 0 internal errors, units touched {touched}, {refused} with a record refused")


def test_fuzz_the_gate(cfg):
    t = Templates(cfg)
    kv = MemoryKV()
    said: list[str] = []
    store = memory_store(cfg, kv, said)
    part = load_profile(cfg, "tp")
    gate = ClusterGate(store, part, "a", lambda m, _p: said.append(m))

    def once(settled, deadline, late=None, aborted=None):  # type: ignore[no-untyped-def]
        result = settled()
        if result is None:
            raise TimeoutError("timed out")
        return result

    store.wait = once  # type: ignore[method-assign]
    import asyncio

    async def both() -> None:
        for spec in part.processes:
            try:
                await gate.before_start(spec)
            except StartError:
                pass
        for wave in part.stop_waves:
            await gate.before_stop([part.process(n) for n in wave])

    try:
        for _, rng in cases("gate"):
            kv.data.clear()
            fill(rng, kv, t, gate.lease)
            store.running_instances()
            asyncio.run(both())
    finally:
        gate.close()
    print(f"gate: {CASES} cases, 0 internal errors, {len(said)} lines said")


def test_fuzz_the_coordinator(cfg):
    t = Templates(cfg)
    taken = 0
    for i, rng in cases("coordinator"):
        kv = MemoryKV()
        store = memory_store(cfg, kv)
        lease = store.grant()
        tid = fill(rng, kv, t, kv.grant(30))
        holder = store.holder()
        if holder is not None:
            _plan_agrees(store, holder, "tp", "a")
        running_profiles(store, cfg, "tp", lambda _m, _p: None)
        me = LockRecord("a", "tp", starting=("tp",), pid=1, tid="t9")
        if store.acquire(lease, me) is None:
            taken += 1
            store.release(me)
        for step in (1, 2, 3):
            try:
                store.wait_step(tid or "t1", step, ("a", "b"), 0.0)
            except (TimeoutError, StepFailed, NodeLost):
                pass
        del i
    print(f"coordinator: {CASES} cases, 0 internal errors, lock taken in {taken}")


def test_fuzz_status_cluster(cfg, monkeypatch):
    t = Templates(cfg)
    kv = MemoryKV()
    monkeypatch.setattr(ClusterStore, "_connect", staticmethod(lambda _cfg: kv))
    for i, rng in cases("status"):
        kv.data.clear()
        fill(rng, kv, t, kv.grant(30))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = gpusupctl.cluster_status(argparse.Namespace(config_dir=str(cfg.config_dir), json=rng.random() < 0.3))
        assert rc == 0, (i, err.getvalue())
        assert all(line.startswith("ignoring etcd record") for line in err.getvalue().splitlines()), (i, err.getvalue())
    print(f"status --cluster: {CASES} cases, 0 internal errors")
