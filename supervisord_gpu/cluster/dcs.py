"""The cluster's store as the operations a switch across nodes needs: Patroni's AbstractDCS, cut down.

The coordinator, the agents, the gates and `gpusupctl` speak to the store only through `DCS`:
take or free the transition lock, say a node is alive, publish a process's state, write a plan,
read the transition under way, report a step, wait for a change. Every write is a typed record
(cluster/records.py) and every read one, parsed; whatever a backend keeps underneath (keys and
JSON in etcd, a dict in memory, a Kubernetes Lease one day) is its own business.

Its one implementation today is `ClusterStore` (cluster/store.py): our key layout over a
key-value store with leases, etcd's model, with two backends, a real etcd (cluster/etcd.py) and
an in-memory one (cluster/kv.py). tests/test_dcs_contract*.py holds both to the same promises.

The failures are typed here too, so that no caller reads a library's class names or an error's
text: a backend classifies its own failures (the etcd one in cluster/failures.py) into one of
the ClusterUnavailable kinds below, and the store says which endpoint and what it was doing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..errors import EXIT_UNREACHABLE, SupervisorError
from .plan import ClusterPlan
from .records import LockRecord, NodeRecord, ProcessRecord, StepReport

# -- what can go wrong -------------------------------------------------------------------------


class ClusterUnavailable(SupervisorError):
    """The store cannot be used: no cross-node change starts; running parts keep running.

    A backend raises one of the kinds below with `because(reason)` (the reason alone: it does not
    know what its caller was doing); the store turns it into the full sentence with `during`."""

    exit_code = EXIT_UNREACHABLE
    verdict = "cannot be used"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reason = message
        self.placed = True  # said in full (which store, doing what)

    @classmethod
    def because(cls, reason: str) -> ClusterUnavailable:
        """A backend's classified failure: its reason, not yet said where or while doing what."""
        failure = cls(reason)
        failure.placed = False
        return failure

    def during(self, endpoint: str, doing: str) -> ClusterUnavailable:
        """The same kind of failure, said in one line: `etcd at URL VERDICT (DOING): REASON`."""
        return type(self)(f"etcd at {endpoint} {self.verdict} ({doing}): {self.reason}")


class StoreUnreachable(ClusterUnavailable):
    """No connection, no answer in time, the TLS handshake failed, the name does not resolve."""

    verdict = "cannot be reached"


class StoreRefused(ClusterUnavailable):
    """The store answered and said no: a refused login, permission denied, an HTTP error."""

    verdict = "answered with an error"


class LeaseNotFound(StoreRefused):
    """A write bound to a lease the store no longer has (it expired, or was revoked)."""


class NotTheStore(ClusterUnavailable):
    """Something answered, but not as the store does (a web server, a proxy, a stranger)."""

    verdict = "did not answer as etcd"


class NodeLost(SupervisorError):
    """A node's agent lease expired while we waited on it."""

    def __init__(self, node: str, what: str) -> None:
        super().__init__(f"node {node!r} was lost {what} (its agent stopped renewing its etcd lease)")
        self.node = node


class StepFailed(SupervisorError):
    """A node reported its share of a step failed, with the reason."""

    def __init__(self, node: str, step: int, reason: str) -> None:
        super().__init__(f"step {step} failed on node {node!r}: {reason}")
        self.node, self.step = node, step


# -- the operations ----------------------------------------------------------------------------


class DCS(Protocol):
    """What the cluster keeps in its store, as operations. Every read skips (and names once, via
    `warn`) a record that does not parse: such a record is never obeyed. A failure to reach the
    store is a ClusterUnavailable; nothing here raises a backend's own exception types."""

    endpoint: str
    lease_ttl_s: int
    #: where a record that does not parse is named (the agent's and the daemon's journal)
    warn: Callable[[str], None]

    # leases: a node's life and a lock's holder
    def grant(self, ttl_s: int | None = None) -> int:
        """A new lease of `ttl_s` (the configured TTL by default): what is bound to it goes with it."""
        ...

    def refresh(self, lease: int) -> bool:
        """Renew; False when the lease is already gone (we were presumed dead)."""
        ...

    def revoke(self, lease: int) -> None:
        """End the lease now: everything bound to it goes at once."""
        ...

    # nodes and their processes
    def announce(self, record: NodeRecord, lease: int) -> None:
        """This node's agent is alive (for as long as `lease`), with its units and GPUs."""
        ...

    def nodes(self) -> dict[str, NodeRecord]:
        """Every node whose agent is alive."""
        ...

    def publish_process(self, record: ProcessRecord, lease: int) -> None:
        """One process's state, bound to its daemon's lease."""
        ...

    def processes(self, instance: str | None = None) -> list[ProcessRecord]:
        """The process states the live daemons published, of `instance` or of all."""
        ...

    def process_states(self, instance: str) -> dict[str, str]:
        """"NODE/PROCESS" -> state, of every process of `instance` a live daemon published."""
        ...

    def running_instances(self) -> list[str]:
        """Instances with a live daemon whose processes are not all stopped, on any node."""
        ...

    # the transition lock
    def acquire(self, lease: int, me: LockRecord) -> LockRecord | None:
        """Take the lock for `me`, bound to `lease`; None when taken, else who holds it."""
        ...

    def holder(self) -> LockRecord | None:
        """Who genuinely holds the lock (bound to a live lease, well-formed), if anyone."""
        ...

    def release(self, me: LockRecord) -> None:
        """Free the lock if it is still `me`'s, never one that came after."""
        ...

    def watch_lock(self, timeout: float, since: int | None = None) -> None:
        """Return at the lock's first change since the read of version `since` (this thread's
        last read by default), or after `timeout`. A backend may wake early (the in-memory one
        wakes on any change): every caller reads again, and waits again if nothing is new."""
        ...

    # plans and step reports
    def put_plan(self, tid: str, plan: ClusterPlan, lease: int) -> None:
        """Write transition `tid`'s plan and make it the one under way, both bound to `lease`."""
        ...

    def plan(self, tid: str) -> tuple[ClusterPlan, int] | None:
        """Transition `tid`'s plan and the lease it is bound to, if it is there and parses."""
        ...

    def current(self) -> tuple[str, ClusterPlan] | None:
        """The transition under way, with its plan, if any."""
        ...

    def watch_current(self, timeout: float, since: int | None = None) -> None:
        """Return at the first change of the transition under way since the read of version
        `since` (this thread's last read by default), or after `timeout`."""
        ...

    def report(self, tid: str, step: int, node: str, result: StepReport, lease: int) -> None:
        """`node`'s share of step `step` of `tid`: done, or failed with the reason."""
        ...

    def reports(self, tid: str, step: int) -> dict[str, StepReport]:
        """Every node's report of that step so far."""
        ...

    def wait_step(self, tid: str, step: int, nodes: tuple[str, ...], deadline: float,
                  aborted: Callable[[], bool] | None = None) -> dict[str, StepReport]:
        """Until every node in `nodes` reported `step`: StepFailed for a failed report, NodeLost
        for a node whose agent went, TimeoutError at the deadline naming who is late."""
        ...

    # waiting
    def last_read(self) -> int:
        """The version of this thread's last read (0 before any), for a later watch."""
        ...

    def wait(self, settled: Callable[[], Any], deadline: float, late: Callable[[], list[str]] | None = None,
             aborted: Callable[[], bool] | None = None) -> Any:
        """Re-check `settled` on every change, until it returns something or the deadline passes."""
        ...
