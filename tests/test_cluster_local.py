"""The cluster gate: two nodes' daemons on one machine, ordered through a real etcd. PD across
nodes with the real sglang-router starts servers -> router and stops router -> decode ->
prefill although no daemon runs all three. Each "node" has its own config, cgroup root,
runtime dir, simulated GPUs and loopback address; the order is read back from etcd's own
history (its revisions are the one clock both daemons share). The test holds the cluster lock
for pd as a coordinator would (no agents here: tests/test_cluster_systemd.py has them), so
both daemons start as participants of that transition."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from etcd_server import EtcdServer, history
from supervisord_gpu.cluster.plan import ClusterPlan, NodeWork, Step
from supervisord_gpu.cluster.records import LockRecord
from supervisord_gpu.cluster.store import ClusterStore
from supervisord_gpu.config.model import ClusterConfig
from support import CgroupSandbox, free_ports, wait_for, write_config

REPO = Path(__file__).resolve().parent.parent
ADDRESS = {"a": "127.0.0.2", "b": "127.0.0.3"}


def pd_across(ports: list[int]) -> str:
    p, d, r, boot, metrics = ports
    return f"""
        [nodes.a]
        address = "{ADDRESS['a']}"
        [nodes.b]
        address = "{ADDRESS['b']}"
        [servers.prefill]
        node = "a"
        role = "prefill"
        host = "0.0.0.0"
        gpus = [0]
        port = {p}
        model_path = "/models/test"
        [servers.prefill.options]
        disaggregation-bootstrap-port = {boot}
        [servers.decode]
        node = "b"
        role = "decode"
        host = "0.0.0.0"
        gpus = [0]
        port = {d}
        model_path = "/models/test"
        [router]
        node = "a"
        mode = "pd"
        port = {r}
        [router.options]
        prometheus-port = {metrics}
        """


@pytest.fixture
def etcd(tmp_path):  # type: ignore[no-untyped-def]
    server = EtcdServer(tmp_path)
    yield server
    server.stop()


class NodeDaemon:
    def __init__(self, tmp: Path, node: str, profile: str, etcd: EtcdServer, cgroup_root: Path) -> None:
        extra = f'[cluster]\nnode = "{node}"\netcd = ["{etcd.url}"]\nprefix = "/t"\nlease_ttl = 3\n'
        extra += "insecure = true\n"  # the test's own etcd on loopback, without TLS or login
        self.cdir = write_config(tmp / node, {"pd": profile}, cgroup_root, startup=1.0, extra=extra, router="real")
        self.log_path = tmp / f"{node}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", "pd", "--config-dir", str(self.cdir), "--stderr"],
            cwd=REPO, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(90)


def ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_pd_across_two_nodes_starts_and_stops_in_one_order_through_etcd(tmp_path, cgroups, etcd):
    ports = free_ports(5)
    store = ClusterStore(ClusterConfig(node="t", etcd=(etcd.url,), prefix="/t", lease_ttl_s=30))
    lease = store.grant()
    assert store.acquire(lease, LockRecord("t", "pd", starting=("pd",), tid="t1")) is None
    # the lock's transition and its plan, under the lock's lease, as a coordinator writes them
    start = Step(1, "start", (NodeWork("a", "pd", ()), NodeWork("b", "pd", ())))
    store.put_plan("t1", ClusterPlan("pd", (), (start,)), lease)
    other = CgroupSandbox()
    a = b = None
    try:
        a = NodeDaemon(tmp_path, "a", pd_across(ports), etcd, cgroups.root)  # a first: its router must wait for b
        wait_for(lambda: "router: waiting for b/decode to be ready" in a.log(), 30, "a's router to wait for b")
        time.sleep(1.0)
        assert not ok(f"http://127.0.0.1:{ports[2]}/readiness")
        b = NodeDaemon(tmp_path, "b", pd_across(ports), etcd, other.root)
        wait_for(lambda: "instance ready" in a.log() and "instance ready" in b.log(), 90, "both parts ready")
        assert ok(f"http://127.0.0.1:{ports[2]}/readiness")
        assert "etcd is insecure by consent" in a.log(), a.log()[-2000:]  # said at every start (#37)
        a.proc.send_signal(signal.SIGTERM)  # both told to stop at once: the order comes from etcd
        b.proc.send_signal(signal.SIGTERM)
        assert a.stop() == 0 and b.stop() == 0, a.log()[-2000:] + b.log()[-2000:]
        seen = history(etcd.url, "/t/parts/pd/")

        def at(key: str, state: str, after: int = -1) -> int:
            return next(i for i, e in enumerate(seen) if e == (key, state) and i > after)

        assert at("b/decode", "ready") < at("a/router", "starting"), seen
        began = at("a/router", "stopping")
        assert at("a/router", "stopped", began) < at("b/decode", "stopping", began), seen  # decode on b waited for a's router
        assert at("b/decode", "stopped", began) < at("a/prefill", "stopping", began), seen  # prefill on a waited for b's decode
        assert any(s == "" for _, s in seen[-3:]), seen  # the daemons' keys went with their leases
    finally:
        for d in (a, b):
            if d is not None and d.proc.poll() is None:
                d.proc.kill()
        other.destroy()
