"""The cluster gate: a node's daemon orders its processes against the other nodes' through etcd.

A profile spread over nodes keeps one order, router -> decode -> prefill to stop and servers ->
router to start, although no daemon sees the whole of it. Each daemon publishes the state of its
own processes under `parts/INSTANCE/NODE/PROCESS`, bound to its lease; before starting a process
it waits until what that process needs on other nodes is ready (a router waits for its decode
server on node b), and before stopping one until what comes earlier in the stop order has
stopped there (a prefill on node a waits for the decode on node b).

Defined ends, never a hang: a start whose peer is not ready by the process's start timeout
fails, naming the node; a stop whose peer does not report stopped in time, or whose daemon's
lease expired (killed, partitioned), goes on after its deadline and says so, because a stop must
always finish. etcd out of reach at start refuses the start; while running, it only costs the
published states (said once), and the servers keep serving.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config.model import ProcessSpec, Profile
from ..engine.events import Event
from ..errors import StartError
from .dcs import DCS, ClusterUnavailable
from .records import ProcessRecord

STOPPED = ("stopped", "failed", "")
PUBLISH_FLUSH_S = 5.0


class ClusterGate:
    def __init__(self, store: DCS, profile: Profile, node: str, say: Callable[[str, int], None]) -> None:
        self.store, self.profile, self.node, self.say = store, profile, node, say
        store.warn = lambda message: say(message, 4)  # a bad record in etcd: one line in the journal
        self.lease = store.grant()  # refuses the start when etcd is out of reach: ClusterUnavailable
        self._stop = threading.Event()
        self.closing = self._stop  # set once the daemon is done: waits in worker threads give up
        self._outage_said = False
        self._renewer = threading.Thread(target=self._renew, name="etcd-lease", daemon=True)
        self._renewer.start()
        self._queue: list[ProcessRecord] = []
        self._queued = threading.Condition()
        self._publishing = threading.Thread(target=self._publisher, name="etcd-publish", daemon=True)
        self._publishing.start()
        for spec in profile.processes:
            self._publish(spec.name, "stopped")

    # -- our side: publishing ---------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """An instance listener: every process state change goes to etcd, in order, off the loop."""
        if event.kind == "process" and event.process and event.state:
            self._publish(event.process, event.state)

    def _publish(self, process: str, state: str) -> None:
        with self._queued:
            self._queue.append(ProcessRecord(self.profile.name, self.node, process, state, time.time()))
            self._queued.notify()

    def _publisher(self) -> None:
        while True:
            with self._queued:
                while not self._queue and not self._stop.is_set():
                    self._queued.wait(1.0)
                if not self._queue and self._stop.is_set():
                    return  # everything queued before close() is out
                batch, self._queue = self._queue, []
            for record in batch:
                self._guarded(lambda r=record: self.store.publish_process(r, self.lease))  # type: ignore[misc]

    def _renew(self) -> None:
        every = max(0.5, self.store.lease_ttl_s / 3)
        while not self._stop.wait(every):
            self._guarded(lambda: self.store.refresh(self.lease))

    def _guarded(self, call: Callable[[], Any]) -> None:
        try:
            call()
            if self._outage_said:
                self._outage_said = False
                self.say(f"etcd at {self.store.endpoint} is reachable again", 5)
        except ClusterUnavailable as e:
            if not self._outage_said:  # said once per outage; the servers keep serving
                self._outage_said = True
                self.say(f"{e}; the processes keep running, the cluster cannot see their state", 4)

    def close(self) -> None:
        """After the last stop: our keys go with our lease, at once rather than after the TTL."""
        self._stop.set()
        with self._queued:
            self._queued.notify()
        self._publishing.join(PUBLISH_FLUSH_S)  # the last states ("stopped") first, for whoever waits on them
        try:
            self.store.revoke(self.lease)
        except ClusterUnavailable:
            pass

    # -- their side: waiting ----------------------------------------------------------------

    async def before_start(self, spec: ProcessSpec) -> None:
        if not spec.peers_before_start:
            return
        self.say(f"{spec.name}: waiting for {', '.join(spec.peers_before_start)} to be ready", 6)
        seen: dict[str, str] = {}

        def settled() -> dict[str, str] | None:
            seen.clear()  # the latest read alone: a peer ready once whose daemon went is not ready
            seen.update(self.store.process_states(self.profile.name))
            return seen if all(seen.get(p) == "ready" for p in spec.peers_before_start) else None

        try:
            await self._in_thread(settled, time.monotonic() + spec.start_timeout_s)
        except TimeoutError:
            late = [p for p in spec.peers_before_start if seen.get(p) != "ready"]
            said = ", ".join(f"{p} ({seen.get(p) or 'no daemon running it'})" for p in late)
            raise StartError(f"{spec.name}: not started: on another node, {said} was not ready "
                             f"within its start timeout {spec.start_timeout_s:g} s") from None

    async def before_stop(self, wave: list[ProcessSpec]) -> None:
        wanted = tuple(dict.fromkeys(p for spec in wave for p in spec.peers_before_stop))
        if not wanted:
            return
        names = "+".join(s.name for s in wave)
        seen: dict[str, str] = {}

        def settled() -> dict[str, str] | None:
            seen.clear()
            seen.update(self.store.process_states(self.profile.name))
            return seen if all(seen.get(p, "") in STOPPED for p in wanted) else None

        try:
            await self._in_thread(settled, time.monotonic() + max(s.stop_timeout_s for s in wave)
                                  + self.store.lease_ttl_s)
        except ClusterUnavailable as e:  # a stop always finishes: without etcd, in our own order only
            self.say(f"{e}; stopping {names} without waiting for the other nodes", 4)
        except TimeoutError:
            late = [p for p in wanted if seen.get(p, "") not in STOPPED]
            self.say(f"stopping {names} although {', '.join(late)} did not report stopped in time", 4)

    async def _in_thread(self, settled: Callable[[], Any], deadline: float) -> Any:
        """store.wait in one worker thread (its reads and watches must share the thread: the
        watch starts right after the read's revision)."""
        return await in_worker(lambda aborted: self.store.wait(settled, deadline, None, aborted), self.closing)


async def in_worker(wait: Callable[[Callable[[], bool]], Any], closing: threading.Event) -> Any:
    """Run a blocking store wait, `wait(aborted)`, in a worker thread that gives up when we are
    cancelled or the daemon is closing: the thread would otherwise hold the interpreter's exit
    until the wait's deadline."""
    abort = threading.Event()
    try:
        return await asyncio.to_thread(wait, lambda: abort.is_set() or closing.is_set())
    except asyncio.CancelledError:
        abort.set()
        raise
