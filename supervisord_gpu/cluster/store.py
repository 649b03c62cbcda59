"""What the nodes share, in etcd: Patroni's DCS, cut to what a switch across nodes needs.

Keys, all under the configured prefix (one etcd can serve several clusters):
- `nodes/NODE`: a node's agent is alive, with its parts' states and its local verdict. Bound to
  the agent's lease: an agent that stops renewing (killed, partitioned, powered off) disappears
  after the TTL by itself, and whoever waits on it is told which node went.
- `lock`: the cluster-wide transition lock, bound to its holder's lease, so a holder that dies
  frees it after the TTL instead of leaving the cluster locked; created only if absent.
- `current` and `transitions/ID/plan`, `transitions/ID/steps/N/NODE`: the transition under way,
  its step order, and each node's report of its share of a step (done, or failed with the reason).
- `parts/INSTANCE/NODE/PROCESS`: each process's state, from the daemon running it (cluster/gate.py).

Every record read is parsed by cluster/records.py into a typed record; one that does not fit is
named in one line (once per version of the key, through `warn`) and skipped: never a crash,
never obeyed. A lock counts only when it is genuine: bound to a lease (etcd deletes a key when
its lease ends, so a key that has one has a live one) and well-formed; any other value at the
lock's key is no lock, and whoever wants the lock deletes it (only that version of it).

Every failure arrives from the KV already classified (cluster/failures.py for etcd: out of
reach, an error etcd answered, or an answer not etcd's), and leaves here as that kind of
ClusterUnavailable naming the endpoint and what was being done; our own records are turned into
JSON before the request, so a bug there stays a bug. Nothing cross-node starts while etcd cannot
be reached, and nothing that runs is touched because of it.

`ClusterStore` is the implementation of cluster/dcs.py's DCS (the cluster's operations, typed
records both ways) over a KV: an etcd (cluster/etcd.py) or an in-memory one (cluster/kv.py, for
tests and fuzzing); tests/test_dcs_contract*.py holds the two to the same promises.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..config.cluster import NODE_NAME_RE
from ..config.model import ClusterConfig
from .dcs import ClusterUnavailable, NodeLost, StepFailed
from .kv import KV, Entry
from .plan import ClusterPlan
from .records import (BadRecord, LockRecord, NodeRecord, ProcessRecord, StepReport, encode_lock, encode_node,
                      encode_plan, encode_process, encode_report, parse_lock, parse_node, parse_plan, parse_process,
                      parse_report, parse_tid)

__all__ = ["ClusterStore", "ClusterUnavailable", "NodeLost", "StepFailed"]  # the errors live in cluster/dcs.py

WATCH_SLICE_S = 1.0  # a watch is re-armed this often, so an event between read and watch costs at most this
WARNED_KEEP = 4096  # bad records already named (key, revision): each is said once, not on every read
ACQUIRE_TRIES = 5


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class ClusterStore:
    """The DCS (cluster/dcs.py) as our key layout over one KV (etcd's JSON gateway unless `kv`
    is given), every record typed both ways (cluster/records.py)."""

    def __init__(self, cfg: ClusterConfig, kv: KV | None = None, warn: Callable[[str], None] | None = None) -> None:
        if not cfg.etcd and kv is None:
            raise ClusterUnavailable("no etcd is configured ([cluster] etcd in supervisord-gpu.toml): "
                                     "a profile that spans nodes cannot change without it")
        self.cfg = cfg
        self.prefix = cfg.prefix.rstrip("/")
        self.lease_ttl_s = cfg.lease_ttl_s
        self.kv: KV = kv if kv is not None else self._connect(cfg)
        self.endpoint = self.kv.endpoint
        #: where a bad record is named (the agent's and the daemon's journal; stderr otherwise)
        self.warn: Callable[[str], None] = warn or _stderr
        self._warned: dict[tuple[str, int], None] = {}
        self._seen = threading.local()  # the revision of this thread's last read

    @staticmethod
    def _connect(cfg: ClusterConfig) -> KV:
        try:
            import etcd3gw  # noqa: F401  only cluster work pays for requests and etcd3gw
        except ImportError:
            raise ClusterUnavailable("profiles that span nodes need etcd's client: apt install python3-etcd3gw") from None
        from .etcd import EtcdKV

        return EtcdKV(cfg)

    @contextmanager
    def _talking(self, what: str) -> Iterator[None]:
        """A failure the KV classified, said in full: this endpoint, doing `what`. Anything else
        a KV raises is a bug of that KV, and is raised as it is."""
        try:
            yield
        except ClusterUnavailable as e:
            if e.placed:
                raise
            raise e.during(self.endpoint, what) from None

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def _bad(self, entry: Entry, e: BadRecord) -> None:
        """Name a bad record once per version of its key."""
        mark = (entry.key, entry.mod_revision)
        if mark in self._warned:
            return
        if len(self._warned) >= WARNED_KEEP:
            self._warned.clear()
        self._warned[mark] = None
        self.warn(str(e))

    # -- leases: a node's life and a lock's holder ---------------------------------------

    def grant(self, ttl_s: int | None = None) -> int:
        with self._talking("granting a lease"):
            return self.kv.grant(ttl_s or self.cfg.lease_ttl_s)

    def refresh(self, lease: int) -> bool:
        """Renew; False when etcd says the lease is already gone (we were presumed dead)."""
        with self._talking("renewing our lease"):
            return self.kv.refresh(lease)

    def revoke(self, lease: int) -> None:
        with self._talking("revoking our lease"):
            self.kv.revoke(lease)

    # -- reading ---------------------------------------------------------------------------

    def _entries(self, prefix: str) -> list[Entry]:
        """Every key under `prefix`; the read's revision is kept (per thread) so that the next
        watch_once starts right after it: no change is missed in between."""
        with self._talking(f"reading {prefix}"):
            revision, found = self.kv.range(prefix, prefix=True)
        self._seen.revision = revision
        return found

    def _entry(self, key: str, what: str = "") -> Entry | None:
        with self._talking(what or f"reading {key}"):
            _, found = self.kv.range(key)
        return found[0] if found else None

    def _parsed(self, prefix: str, parse: Callable[[Entry, str], Any]) -> list[Any]:
        """parse(entry, the key below `prefix`) of every key under it; bad ones named and skipped."""
        out = []
        for entry in self._entries(prefix):
            try:
                out.append(parse(entry, entry.key[len(prefix):]))
            except BadRecord as e:
                self._bad(entry, e)
        return out

    # -- nodes -----------------------------------------------------------------------------

    def announce(self, record: NodeRecord, lease: int) -> None:
        value = encode_node(record)  # ours: a bug here is a bug, not etcd's fault
        with self._talking(f"publishing node {record.node}"):
            self.kv.put(self.key("nodes", record.node), value, lease=lease)

    def nodes(self) -> dict[str, NodeRecord]:
        """Every node whose agent is alive, with what it last published."""
        def node(entry: Entry, name: str) -> NodeRecord:
            if not NODE_NAME_RE.match(name):
                raise BadRecord(entry.key, "not a node name under nodes/")
            return parse_node(entry.key, name, entry.value)

        return {n.node: n for n in self._parsed(self.key("nodes") + "/", node)}

    # -- process states, for the cluster gate ------------------------------------------------

    def publish_process(self, record: ProcessRecord, lease: int) -> None:
        value = encode_process(record)
        with self._talking(f"publishing {record.node}/{record.process}"):
            self.kv.put(self.key("parts", record.instance, record.node, record.process), value, lease=lease)

    def processes(self, instance: str | None = None) -> list[ProcessRecord]:
        """What the live daemons published, of `instance` or of every instance."""
        base = self.key("parts") + "/"
        prefix = base + (instance + "/" if instance else "")
        records = self._parsed(prefix, lambda e, _rest: parse_process(e.key, e.key[len(base):], e.value))
        return [r for r in records if instance is None or r.instance == instance]

    def process_states(self, instance: str) -> dict[str, str]:
        """"NODE/PROCESS" -> state of every process a live daemon of `instance` published."""
        return {f"{r.node}/{r.process}": r.state for r in self.processes(instance)}

    def running_instances(self) -> list[str]:
        """Instances with a live daemon whose processes are not all stopped, on any node."""
        return list(dict.fromkeys(r.instance for r in self.processes() if r.state not in ("stopped", "failed")))

    def last_read(self) -> int:
        """The revision of this thread's last read (0 before any): a later watch can follow on
        from it although other reads came between."""
        return int(getattr(self._seen, "revision", 0))

    def watch_once(self, prefix: str, timeout: float, since: int | None = None) -> None:
        """Return at the first change under `prefix` since this thread's last read, or since
        the read of revision `since` (at once if there was one meanwhile), or after `timeout`."""
        if since is None:
            since = self.last_read()
        self._seen.revision = 0
        with self._talking(f"watching {prefix}"):
            self.kv.watch_once(prefix, timeout, since + 1 if since else 0)

    def watch_lock(self, timeout: float, since: int | None = None) -> None:
        self.watch_once(self.key("lock"), timeout, since)

    def watch_current(self, timeout: float, since: int | None = None) -> None:
        self.watch_once(self.key("current"), timeout, since)

    # -- the transition lock ---------------------------------------------------------------

    def _lock(self) -> tuple[Entry | None, LockRecord | None]:
        """The lock's key and, when it is genuine, its holder. A value without a lease (a lease
        ends with its holder; one without never would) or that is no holder's record is not
        a lock: named, and treated as free."""
        with self._talking("reading the transition lock"):
            revision, found = self.kv.range(self.key("lock"))
        self._seen.revision = revision  # a wait for the lock's release follows on from this read
        entry = found[0] if found else None
        if entry is None:
            return None, None
        try:
            if not entry.lease:
                raise BadRecord(entry.key, "bound to no lease (a genuine lock goes with its holder's lease)")
            return entry, parse_lock(entry.key, entry.value, entry.lease)
        except BadRecord as e:
            self._bad(entry, e)
            return entry, None

    def acquire(self, lease: int, me: LockRecord) -> LockRecord | None:
        """Take the lock for `me`; None when taken, else the record of whoever holds it.
        What is at the key and is no genuine lock is deleted first (that version only)."""
        value = encode_lock(me)
        for _ in range(ACQUIRE_TRIES):
            with self._talking("taking the transition lock"):
                if self.kv.create(self.key("lock"), value, lease=lease):
                    return None
            entry, record = self._lock()
            if record is not None:
                return record
            if entry is not None:  # no genuine lock: free it, unless it changed meanwhile
                with self._talking("clearing a record that is no lock"):
                    self.kv.delete_if(entry.key, mod_revision=entry.mod_revision)
            # else its holder's lease expired between the two calls: try again
        raise ClusterUnavailable(f"etcd at {self.endpoint}: the transition lock keeps changing; "
                                 f"gave up after {ACQUIRE_TRIES} tries")

    def holder(self) -> LockRecord | None:
        """Who holds the lock; None when nobody genuinely does."""
        return self._lock()[1]

    def release(self, me: LockRecord) -> None:
        """Drop the lock if it is still `me`'s (never someone else's that came after): one
        etcd transaction, compare the value and delete, so that no reader ever sees it half-gone."""
        value = encode_lock(me)
        with self._talking("releasing the transition lock"):
            self.kv.delete_if(self.key("lock"), value=value)

    # -- plans and step reports ------------------------------------------------------------

    def put_plan(self, tid: str, plan: ClusterPlan, lease: int) -> None:
        value = encode_plan(plan)
        with self._talking("writing the plan"):
            self.kv.put(self.key("transitions", tid, "plan"), value, lease=lease)
            self.kv.put(self.key("current"), tid, lease=lease)

    def plan(self, tid: str) -> tuple[ClusterPlan, int] | None:
        """Transition `tid`'s plan and the lease it is bound to; None when absent or bad (named)."""
        entry = self._entry(self.key("transitions", tid, "plan"), "reading the current transition")
        if entry is None:
            return None
        try:
            return parse_plan(entry.key, entry.value), entry.lease
        except BadRecord as e:
            self._bad(entry, e)
            return None

    def current(self) -> tuple[str, ClusterPlan] | None:
        """The transition now under way, if any, with a well-formed plan: (id, plan)."""
        found = self._entries(self.key("current"))  # a read the next watch follows on from
        entry = next((e for e in found if e.key == self.key("current")), None)
        if entry is None:
            return None
        try:
            tid = parse_tid(entry.key, entry.value)
        except BadRecord as e:
            self._bad(entry, e)
            return None
        plan = self.plan(tid)
        return (tid, plan[0]) if plan else None

    def report(self, tid: str, step: int, node: str, result: StepReport, lease: int) -> None:
        value = encode_report(result)
        with self._talking(f"reporting step {step}"):
            self.kv.put(self.key("transitions", tid, "steps", str(step), node), value, lease=lease)

    def reports(self, tid: str, step: int) -> dict[str, StepReport]:
        def one(entry: Entry, node: str) -> tuple[str, StepReport]:
            if not NODE_NAME_RE.match(node):
                raise BadRecord(entry.key, "not a node name under steps/N/")
            return node, parse_report(entry.key, entry.value)

        return dict(self._parsed(self.key("transitions", tid, "steps", str(step)) + "/", one))

    def wait_step(self, tid: str, step: int, nodes: tuple[str, ...], deadline: float,
                  aborted: Callable[[], bool] | None = None) -> dict[str, StepReport]:
        """Until every node in `nodes` reported `step`: their reports. A failed report raises
        StepFailed, a node whose lease expired NodeLost, the deadline TimeoutError naming who is late."""
        def settled() -> dict[str, StepReport] | None:
            got = self.reports(tid, step)
            for node, result in got.items():
                if node in nodes and result.state == "failed":
                    raise StepFailed(node, step, result.reason or "no reason given")
            alive = self.nodes()
            for node in nodes:
                if node not in got and node not in alive:
                    raise NodeLost(node, f"during step {step}")
            return got if all(n in got for n in nodes) else None

        return self.wait(settled, deadline, late=lambda: [n for n in nodes if n not in self.reports(tid, step)],
                         aborted=aborted)

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, settled: Callable[[], Any], deadline: float, late: Callable[[], list[str]] | None = None,
             aborted: Callable[[], bool] | None = None) -> Any:
        """Re-check `settled` on every change under our prefix, until it returns something or
        the deadline passes. One watch on everything of ours: a report, a node's lease expiring
        (its key deleted) and a failure all wake it at once; re-armed every WATCH_SLICE_S so
        that a change between the check and the watch costs at most that."""
        while True:
            result = settled()
            if result is not None:
                return result
            remaining = deadline - time.monotonic()
            if aborted is not None and aborted():
                raise TimeoutError("abandoned")
            if remaining <= 0:
                who = late() if late else []
                raise TimeoutError("timed out" + (f" waiting for {', '.join(who)}" if who else ""))
            self.watch_once(self.prefix + "/", min(WATCH_SLICE_S, remaining))
