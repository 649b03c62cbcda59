"""The DCS contract (tests/dcs_contract.py) over the in-memory store: fast, no server; a lease
expires when the test moves the store's clock on, not after waiting for it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from dcs_contract import *  # noqa: F403  the contract's tests, collected here
from supervisord_gpu.cluster import kv as kv_module
from supervisord_gpu.cluster.kv import MemoryKV
from supervisord_gpu.cluster.store import ClusterStore
from supervisord_gpu.config.model import ClusterConfig


class MovedClock:
    """The in-memory store's lease clock: real time plus what the test moved it on by."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


class Memory:
    TTL = 2

    def __init__(self, clock: MovedClock) -> None:
        self.kv, self.clock = MemoryKV(), clock
        self.said: dict[str, list[str]] = {}

    def store(self, node: str = "a") -> ClusterStore:
        said = self.said.setdefault(node, [])
        return ClusterStore(ClusterConfig(node=node, prefix="/contract", lease_ttl_s=30), self.kv, warn=said.append)

    def forge(self, store: ClusterStore, path: str, raw: bytes | str, lease: int = 0) -> None:
        store.kv.put(store.key(*path.split("/")), raw, lease=lease)

    def pass_time(self, seconds: float) -> None:
        self.clock.offset += seconds

    def outlived(self, ttl: float, check: Callable[[], bool]) -> bool:
        self.pass_time(ttl + 0.5)
        return check()


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[Memory]:
    clock = MovedClock()
    monkeypatch.setattr(kv_module, "time", clock)  # the leases' clock only: waits keep real time
    yield Memory(clock)
