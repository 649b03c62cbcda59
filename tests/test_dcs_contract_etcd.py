"""The DCS contract (tests/dcs_contract.py) over a real etcd (Debian's etcd-server): slow tier,
one server for the module, a prefix of its own per test; leases expire in etcd's own time."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("etcd3gw")

from dcs_contract import *  # noqa: E402,F403  the contract's tests, collected here
from etcd_server import EtcdServer  # noqa: E402
from supervisord_gpu.cluster.store import ClusterStore  # noqa: E402
from supervisord_gpu.config.model import ClusterConfig  # noqa: E402


class Etcd:
    TTL = 2  # about etcd's shortest (1.5 s with its default election timeout, rounded up)

    def __init__(self, server: EtcdServer) -> None:
        self.server = server
        self.prefix = f"/contract/{uuid.uuid4().hex[:12]}"
        self.said: dict[str, list[str]] = {}

    def store(self, node: str = "a") -> ClusterStore:
        said = self.said.setdefault(node, [])
        return ClusterStore(ClusterConfig(node=node, etcd=(self.server.url,), prefix=self.prefix, lease_ttl_s=30),
                            warn=said.append)

    def forge(self, store: ClusterStore, path: str, raw: bytes | str, lease: int = 0) -> None:
        store.kv.put(store.key(*path.split("/")), raw, lease=lease)

    def pass_time(self, seconds: float) -> None:
        time.sleep(seconds)

    def outlived(self, ttl: float, check: Callable[[], bool]) -> bool:
        """etcd ends a lease on its own timer, checked every half second: up to a few seconds late."""
        self.pass_time(ttl)
        deadline = time.monotonic() + 6
        while not check():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(Path(tmp_path_factory.mktemp("etcd")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def backend(etcd_server: EtcdServer) -> Etcd:
    return Etcd(etcd_server)
