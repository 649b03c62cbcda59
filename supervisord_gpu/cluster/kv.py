"""The key-value store under the cluster's records: etcd's few primitives we use, and a fake.

ClusterStore (cluster/store.py) holds our key layout and parses every record (cluster/records.py);
what it needs from a store is this much: leases (grant, renew, revoke), put bound to a lease,
create-if-absent, a range read that gives each key's value, lease and revision, a conditional
delete, and a watch from a revision on. `EtcdKV` (cluster/etcd.py) is etcd's; `MemoryKV` here
is an in-memory one with the same semantics (a key bound to a lease goes with the lease), so
that the readers can be fuzzed with any record content fast, without a server.

A backend classifies its own failures: every one leaves it as one of cluster/dcs.py's
ClusterUnavailable kinds, made with `because(reason)`, never as a library's exception.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Protocol

from ..records import dataclass
from .dcs import LeaseNotFound


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    lease: int  # 0: bound to no lease
    mod_revision: int


class KV(Protocol):
    endpoint: str

    def grant(self, ttl_s: int) -> int: ...
    def refresh(self, lease: int) -> bool: ...
    def revoke(self, lease: int) -> None: ...
    def put(self, key: str, value: str | bytes, lease: int = 0) -> None: ...
    def create(self, key: str, value: str | bytes, lease: int = 0) -> bool: ...
    def range(self, key: str, prefix: bool = False) -> tuple[int, list[Entry]]: ...
    def delete_if(self, key: str, value: bytes | None = None, mod_revision: int | None = None) -> bool: ...
    def watch_once(self, prefix: str, timeout: float, start_revision: int = 0) -> None: ...


class MemoryKV:
    """etcd in a dict: revisions, leases with TTLs (expired when next looked at), and a watch
    that wakes on any change. Thread-safe; `expire(lease)` ends a lease at once (a node lost)."""

    endpoint = "memory://"

    def __init__(self) -> None:
        self.revision = 1
        self.data: dict[str, Entry] = {}
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, deadline)
        self._ids = itertools.count(1000)
        self._changed = threading.Condition()

    # leases

    def _sweep(self) -> None:
        now = time.monotonic()
        for lease in [lease for lease, (_, deadline) in self.leases.items() if deadline <= now]:
            self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        self.leases.pop(lease, None)
        for key in [k for k, e in self.data.items() if e.lease == lease]:
            self._delete(key)

    def grant(self, ttl_s: int) -> int:
        with self._changed:
            lease = next(self._ids)
            self.leases[lease] = (ttl_s, time.monotonic() + ttl_s)
            return lease

    def refresh(self, lease: int) -> bool:
        with self._changed:
            self._sweep()
            if lease not in self.leases:
                return False
            ttl = self.leases[lease][0]
            self.leases[lease] = (ttl, time.monotonic() + ttl)
            return True

    def revoke(self, lease: int) -> None:
        with self._changed:
            self._drop_lease(lease)

    def expire(self, lease: int) -> None:
        self.revoke(lease)

    # keys

    def _bump(self) -> int:
        self.revision += 1
        self._changed.notify_all()
        return self.revision

    def _delete(self, key: str) -> None:
        if self.data.pop(key, None) is not None:
            self._bump()

    def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        with self._changed:
            self._sweep()
            if lease and lease not in self.leases:
                raise LeaseNotFound.because("etcdserver: requested lease not found")  # etcd's words
            raw = value.encode() if isinstance(value, str) else bytes(value)
            self.data[key] = Entry(key, raw, lease, self.revision + 1)
            self._bump()

    def create(self, key: str, value: str | bytes, lease: int = 0) -> bool:
        with self._changed:
            self._sweep()
            if key in self.data:
                return False
            self.put(key, value, lease)
            return True

    def range(self, key: str, prefix: bool = False) -> tuple[int, list[Entry]]:
        with self._changed:
            self._sweep()
            found = [e for k, e in sorted(self.data.items()) if (k.startswith(key) if prefix else k == key)]
            return self.revision, found

    def delete_if(self, key: str, value: bytes | None = None, mod_revision: int | None = None) -> bool:
        with self._changed:
            self._sweep()
            entry = self.data.get(key)
            if entry is None or (value is not None and entry.value != value) or (
                    mod_revision is not None and entry.mod_revision != mod_revision):
                return False
            self._delete(key)
            return True

    def watch_once(self, prefix: str, timeout: float, start_revision: int = 0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            since = start_revision - 1 if start_revision else self.revision
            while self.revision <= since:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(min(left, 0.2))
                self._sweep()
