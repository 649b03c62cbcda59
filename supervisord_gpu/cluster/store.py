"""What the nodes share, in etcd: Patroni's DCS, cut to what a switch across nodes needs.

Keys, all under the configured prefix (one etcd can serve several clusters):
- `nodes/NODE`: a node's agent is alive, with its parts' states and its local verdict. Bound to
  the agent's lease: an agent that stops renewing (killed, partitioned, powered off) disappears
  after the TTL by itself, and whoever waits on it is told which node went.
- `lock`: the cluster-wide transition lock, bound to its holder's lease, so a holder that dies
  frees it after the TTL instead of leaving the cluster locked; created only if absent.
- `transitions/ID/plan` and `transitions/ID/steps/N/NODE`: the step order, and each node's
  report of its share of a step (done, or failed with the reason).

Every etcd failure becomes one ClusterUnavailable naming the endpoint: nothing cross-node starts
while etcd cannot be reached, and nothing that runs is touched because of it.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from ..config.model import ClusterConfig
from ..errors import SupervisorError

ETCD_REQUEST_TIMEOUT_S = 3.0
WATCH_SLICE_S = 1.0  # a watch is re-armed this often, so an event between read and watch costs at most this


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _lock_record(found: list[bytes]) -> dict[str, Any] | None:
    """The lock's holder from a get of its key; None when there is none. A value that is not a
    holder's record (written by something else under our prefix) is named, not a crash."""
    if not found:
        return None
    try:
        record = json.loads(found[0])
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return {"to": "(unreadable lock record)", "node": "?", "value": found[0][:200].decode(errors="replace")}
    return record


class ClusterUnavailable(SupervisorError):
    """etcd cannot be reached: no cross-node change starts; running parts keep running."""

    exit_code = 4  # EXIT_UNREACHABLE, as for the bus


class NodeLost(SupervisorError):
    """A node's agent lease expired while we waited on it."""

    def __init__(self, node: str, what: str) -> None:
        super().__init__(f"node {node!r} was lost {what} (its agent stopped renewing its etcd lease)")
        self.node = node


class StepFailed(SupervisorError):
    def __init__(self, node: str, step: int, reason: str) -> None:
        super().__init__(f"step {step} failed on node {node!r}: {reason}")
        self.node, self.step = node, step


class ClusterStore:
    """One connection to etcd's v3 JSON gateway (python3-etcd3gw), with our key layout."""

    def __init__(self, cfg: ClusterConfig) -> None:
        if not cfg.etcd:
            raise ClusterUnavailable("no etcd is configured ([cluster] etcd in supervisord-gpu.toml): "
                                     "a profile that spans nodes cannot change without it")
        self.cfg = cfg
        self.prefix = cfg.prefix.rstrip("/")
        self.endpoint = cfg.etcd[0]
        self._client = self._connect(self.endpoint)
        self._seen = threading.local()  # the revision of this thread's last read

    @staticmethod
    def _connect(endpoint: str) -> Any:
        try:
            from etcd3gw.client import Etcd3Client  # only cluster work pays for requests and etcd3gw
        except ImportError:
            raise ClusterUnavailable("profiles that span nodes need etcd's client: apt install python3-etcd3gw") from None

        url = urlsplit(endpoint)
        return Etcd3Client(host=url.hostname or "127.0.0.1", port=url.port or 2379, protocol=url.scheme,
                           timeout=ETCD_REQUEST_TIMEOUT_S, api_path="/v3/")

    @contextmanager
    def _talking(self, what: str) -> Iterator[None]:
        try:
            yield
        except SupervisorError:
            raise
        except Exception as e:  # requests' and etcd3gw's errors alike: the store is out of reach
            raise ClusterUnavailable(f"etcd at {self.endpoint} cannot be reached ({what}): "
                                     f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    # -- leases: a node's life and a lock's holder ---------------------------------------

    def grant(self, ttl_s: int | None = None) -> Any:
        with self._talking("granting a lease"):
            return self._client.lease(ttl_s or self.cfg.lease_ttl_s)

    def refresh(self, lease: Any) -> bool:
        """Renew; False when etcd says the lease is already gone (we were presumed dead)."""
        with self._talking("renewing our lease"):
            return int(lease.refresh()) > 0

    def revoke(self, lease: Any) -> None:
        with self._talking("revoking our lease"):
            lease.revoke()

    # -- nodes -----------------------------------------------------------------------------

    def announce(self, node: str, lease: Any, record: dict[str, Any]) -> None:
        with self._talking(f"publishing node {node}"):
            self._client.put(self.key("nodes", node), json.dumps(record, sort_keys=True), lease=lease)

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Every node whose agent is alive, with what it last published."""
        return {k.rsplit("/", 1)[1]: v for k, v in self._prefix(self.key("nodes") + "/").items() if k.count("/") ==
                self.key("nodes", "x").count("/")}

    # -- process states, for the cluster gate ------------------------------------------------

    def publish_process(self, instance: str, node: str, process: str, record: dict[str, Any], lease: Any) -> None:
        with self._talking(f"publishing {node}/{process}"):
            self._client.put(self.key("parts", instance, node, process), json.dumps(record, sort_keys=True), lease=lease)

    def process_states(self, instance: str) -> dict[str, str]:
        """"NODE/PROCESS" -> state of every process a live daemon of `instance` published."""
        base = self.key("parts", instance) + "/"
        return {k[len(base):]: str((v or {}).get("state", "")) for k, v in self._prefix(base).items()}

    def running_instances(self) -> list[str]:
        """Instances with a live daemon whose processes are not all stopped, on any node."""
        base = self.key("parts") + "/"
        out: dict[str, None] = {}
        for k, v in self._prefix(base).items():
            instance = k[len(base):].split("/", 1)[0]
            if str((v or {}).get("state", "")) not in ("stopped", "failed", ""):
                out[instance] = None
        return list(out)

    def watch_once(self, prefix: str, timeout: float) -> None:
        """Return at the first change under `prefix` since this thread's last read (at once if
        there was one meanwhile), or after `timeout`."""
        from etcd3gw.exceptions import WatchTimedOut

        since = getattr(self._seen, "revision", 0)
        self._seen.revision = 0
        with self._talking(f"watching {prefix}"):
            try:
                if since:
                    self._client.watch_prefix_once(prefix, timeout=timeout, start_revision=since + 1)
                else:
                    self._client.watch_prefix_once(prefix, timeout=timeout)
            except WatchTimedOut:
                pass

    # -- the transition lock ---------------------------------------------------------------

    def acquire(self, lease: Any, holder: dict[str, Any]) -> dict[str, Any] | None:
        """Take the lock for `holder`; None when taken, else the record of whoever holds it."""
        with self._talking("taking the transition lock"):
            if self._client.create(self.key("lock"), json.dumps(holder, sort_keys=True), lease=lease):
                return None
            found = self._client.get(self.key("lock"))
        record = _lock_record(found)
        if record is None:  # its holder's lease expired between the two calls: try once more
            return self.acquire(lease, holder)
        return record

    def holder(self) -> dict[str, Any] | None:
        with self._talking("reading the transition lock"):
            found = self._client.get(self.key("lock"))
        return _lock_record(found)

    def release(self, holder: dict[str, Any]) -> None:
        """Drop the lock if it is still `holder`'s (never someone else's that came after): one
        etcd transaction, compare the value and delete, so that no reader ever sees it half-gone."""
        key = _b64(self.key("lock"))
        with self._talking("releasing the transition lock"):
            self._client.transaction({
                "compare": [{"key": key, "result": "EQUAL", "target": "VALUE",
                             "value": _b64(json.dumps(holder, sort_keys=True))}],
                "success": [{"request_delete_range": {"key": key}}],
                "failure": [],
            })

    # -- plans and step reports ------------------------------------------------------------

    def put_plan(self, tid: str, plan: dict[str, Any], lease: Any) -> None:
        with self._talking("writing the plan"):
            self._client.put(self.key("transitions", tid, "plan"), json.dumps(plan), lease=lease)
            self._client.put(self.key("current"), tid, lease=lease)

    def current(self) -> tuple[str, dict[str, Any]] | None:
        """The transition now under way, if any: (id, plan)."""
        tid = self._prefix(self.key("current")).get(self.key("current"))  # a read the next watch follows on from
        if not tid:
            return None
        with self._talking("reading the current transition"):
            plan = self._client.get(self.key("transitions", str(tid), "plan"))
        return (str(tid), json.loads(plan[0])) if plan else None

    def report(self, tid: str, step: int, node: str, result: dict[str, Any], lease: Any) -> None:
        with self._talking(f"reporting step {step}"):
            self._client.put(self.key("transitions", tid, "steps", str(step), node), json.dumps(result), lease=lease)

    def reports(self, tid: str, step: int) -> dict[str, dict[str, Any]]:
        base = self.key("transitions", tid, "steps", str(step)) + "/"
        return {k[len(base):]: v for k, v in self._prefix(base).items()}

    def wait_step(self, tid: str, step: int, nodes: tuple[str, ...], deadline: float,
                  aborted: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
        """Until every node in `nodes` reported `step`: their reports. A failed report raises
        StepFailed, a node whose lease expired NodeLost, the deadline TimeoutError naming who is late."""
        def settled() -> dict[str, dict[str, Any]] | None:
            got = self.reports(tid, step)
            for node, result in got.items():
                if result.get("state") == "failed":
                    raise StepFailed(node, step, str(result.get("reason", "no reason given")))
            alive = self.nodes()
            for node in nodes:
                if node not in got and node not in alive:
                    raise NodeLost(node, f"during step {step}")
            return got if all(n in got for n in nodes) else None

        return self.wait(settled, deadline, late=lambda: [n for n in nodes if n not in self.reports(tid, step)],
                         aborted=aborted)

    # -- reading and waiting ---------------------------------------------------------------

    def _prefix(self, prefix: str) -> dict[str, Any]:
        """Every key under `prefix` with its JSON value; the read's revision is kept (per thread)
        so that the next watch_once starts right after it: no change is missed in between."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        with self._talking(f"reading {prefix}"):
            reply = self._client.post(self._client.get_url("/kv/range"), json={"key": _b64(prefix), "range_end": _b64(end)})
        self._seen.revision = int(reply.get("header", {}).get("revision", 0))
        out: dict[str, Any] = {}
        for kv in reply.get("kvs", []):
            value = base64.b64decode(kv.get("value", "")).decode()
            try:
                out[base64.b64decode(kv["key"]).decode()] = json.loads(value) if value else None
            except ValueError:
                out[base64.b64decode(kv["key"]).decode()] = value  # not JSON: the current transition's id
        return out

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
