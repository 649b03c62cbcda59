"""Taking one server out of traffic before it is stopped alone, and putting it back after.

After SIGTERM, SGLang keeps accepting and serving new requests and looks for "no requests
left" every 5 s with no upper bound (sglang-server.md): a server that still gets traffic never
drains and is SIGKILLed mid-request at its deadline. Behind a router the remedy is the
router's own worker API (sglang-router 0.3.2): DELETE /workers/{id} stops new requests to it
while those already proxied complete; once the server reports nothing in flight it can be
stopped, and POST /workers puts the restarted server back. With the whole instance stopping,
none of this is needed: the router stops first and closes its listener.

That API is closed to everyone but the daemon (sglang/router_key.py: each call carries the
instance's control-plane key), and RouterWorkers.enforce keeps the list to the workers the
profile names: anyone else's is named in the journal at error priority and removed. The key
is written only into a connection that a process of the router's own cgroup accepted
(engine/probe.py, `who_accepted`): after a SIGTERM the real router closes its port at once and
lives on while requests drain (up to 180 s), a process of its own user (the servers' model
code) can send that signal, and anyone can then bind the port; the key would otherwise be
handed to them at the next call.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..config.model import ProcessSpec
from ..config.render import Launch
from ..errors import one_line
from ..records import dataclass
from .events import LogSink
from .probe import request, who_accepted
from ..sglang.router_key import RouterKeyError, auth_header, read_key

POLL_S = 0.1
API_TIMEOUT_S = 5.0
ACCEPT_WAIT_S = 2.0  # the router accepts at once; one that does not in this long does not answer either
FOREIGN_REMOVAL_TIMEOUT_S = 5.0  # 0.3.2 drops a DELETEd worker from its list in milliseconds, smg in ~1 s
#: PD readiness's first request: one token (the real first generation can be a slow one)
FIRST_REQUEST = {"text": "ready?", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
FIRST_REQUEST_TIMEOUT_S = 60.0

_METRIC = re.compile(r"^sglang:(num_running_reqs|num_queue_reqs)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


@dataclass(frozen=True)
class WorkerCheck:
    """The router's worker list against the profile (RouterWorkers.enforce)."""

    #: workers the profile names that the router lists as healthy
    healthy: int
    #: how many the profile names
    expected: int
    #: each foreign worker found ("URL (type, id ID)"), removed or not
    foreign: tuple[str, ...] = ()
    #: why the list could not be read or a foreign worker is still in it; "" when neither
    problem: str = ""
    #: the worker types among our healthy ones ("decode", "prefill", "regular")
    healthy_types: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        """No worker of anyone else's left in the router (or none we know of: see `problem`)."""
        return not self.problem

    @property
    def ready(self) -> bool:
        """Readiness as the profile means it: every one of its workers healthy, nobody else's."""
        return self.clean and self.healthy >= self.expected


class RouterWorkers:
    """One router's worker list, through its HTTP API, with the instance's control-plane key.

    The key file is read on every call (sglang/router_key.py checks it each time), so a call
    made before the router's first start, or with the file tampered with, fails with a reason
    rather than going out without the header. Each call is written only after the process
    that accepted its connection is found among the router's own (`router_pids`, its cgroup
    now): whoever else holds the other end gets nothing, and is named.
    """

    def __init__(self, router: ProcessSpec, router_pids: Callable[[], Iterable[int]],
                 key_file: Path | None = None, expected: tuple[tuple[str, str], ...] = ()) -> None:
        self.router = router
        self.host = router.probe_host
        self.port = router.port
        self.router_pids = router_pids
        self.key_file = key_file
        #: (url, worker_type) of each worker the profile names: any other listed worker is foreign
        self.expected = expected

    @classmethod
    def of(cls, launch: Launch, router_pids: Callable[[], Iterable[int]]) -> RouterWorkers:
        """The API of the router `launch` starts (render.py sets its key file and workers), whose
        processes now are `router_pids()`."""
        return cls(launch.spec, router_pids, launch.router_key, launch.router_workers)

    async def _call(self, method: str, path: str, body: object = None) -> tuple[int | None, bytes]:
        try:
            headers = auth_header(read_key(self.key_file)) if self.key_file is not None else {}
        except RouterKeyError as e:
            return None, str(e).encode()
        return await request(method, self.host, self.port, path, body, timeout=API_TIMEOUT_S, headers=headers,
                             peer_check=self._accepted_by_the_router)

    async def _accepted_by_the_router(self, ours: tuple[str, int], theirs: tuple[str, int]) -> str:
        """"" when the router's own process accepted this connection, else why nothing is sent on it."""
        accepted = await who_accepted(ours, theirs, self.router_pids, ACCEPT_WAIT_S)
        if accepted.ours:
            return ""
        return (f"not sent, it would carry the control-plane key: on {self.host}:{self.port} "
                f"{accepted.why_not()}, not by {self.router.name}")

    async def workers(self) -> list[dict[str, Any]] | None:
        return (await self._list())[0]

    async def _list(self) -> tuple[list[dict[str, Any]] | None, str]:
        """(the router's workers, "") or (None, why not): a list we cannot read is never "empty"."""
        status, body = await self._call("GET", "/workers")
        why = _failed("the router's worker list could not be read", status, body, 160)
        if status != 200:
            return None, why
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None, why
        workers = data.get("workers") if isinstance(data, dict) else None
        if not isinstance(workers, list):
            return None, why
        return [w for w in workers if isinstance(w, dict)], ""

    async def _find(self, url: str) -> dict[str, Any] | None:
        """The listed worker at `url`, leaving out one smg still lists as "draining" (DELETEd, on
        its way out: it never turns healthy again, a new POST is what brings the URL back)."""
        for w in await self.workers() or []:
            if _url(w) == url and not draining(w):
                return w
        return None

    async def _routed(self, worker_id: str) -> bool:
        """Still listed and not draining: smg keeps a DELETEd worker listed as "draining" (out of
        routing, its requests completing) before it drops it; 0.3.2 drops it at once."""
        return any(str(w.get("id", "")) == worker_id and not draining(w) for w in await self.workers() or [])

    async def _delete(self, worker: dict[str, Any], timeout: float) -> str:
        """DELETE one worker by id and wait until the list shows it gone or draining (a 202 alone is
        not "done"); "" then, else why not."""
        worker_id = str(worker.get("id", ""))
        status, body = await self._call("DELETE", f"/workers/{worker_id}")
        if status not in (200, 202, 204):
            return _failed("the router refused to remove it", status, body, 120)
        deadline = time.monotonic() + timeout
        while await self._routed(worker_id):
            if time.monotonic() > deadline:
                return f"the router still lists it {timeout:g} s after removing it"
            await asyncio.sleep(POLL_S)
        return ""

    async def withdraw(self, server: ProcessSpec, timeout: float) -> str:
        """Remove `server` from the router; returns "" once it is gone from the list, else why not."""
        listed, why = await self._list()
        if listed is None:
            return why  # unknown is not "not registered": traffic may still reach it
        worker = next((w for w in listed if _url(w) == server.url), None)
        if worker is None:
            return ""  # not (or no longer) registered: nothing routes to it
        return await self._delete(worker, timeout)

    async def restore(self, server: ProcessSpec, timeout: float) -> str:
        """Add `server` back and wait until the router calls it healthy; "" on success, else why not.

        smg refuses a POST for a URL it still lists as "draining" (409 "Worker already exists"):
        the draining entry is waited out first, within the same timeout."""
        deadline = time.monotonic() + timeout
        while await self._find(server.url) is None:
            if not await self._draining(server.url):
                body: dict[str, Any] = {"url": server.url}
                if self.router.router_mode == "pd":
                    body["worker_type"] = server.role
                    if server.role == "prefill":
                        body["bootstrap_port"] = server.bootstrap_port
                status, answer = await self._call("POST", "/workers", body)
                if status not in (200, 201, 202):
                    return _failed("the router refused to add it back", status, answer, 120)
                break
            if time.monotonic() > deadline:
                return f"the router still lists it as draining {timeout:g} s later"
            await asyncio.sleep(POLL_S)
        while not ((w := await self._find(server.url)) is not None and serving(w)):
            if time.monotonic() > deadline:
                return f"the router did not take it back within {timeout:g} s"
            await asyncio.sleep(POLL_S)
        return ""

    async def _draining(self, url: str) -> bool:
        return any(_url(w) == url and draining(w) for w in await self.workers() or [])

    def is_ours(self, worker: dict[str, Any]) -> bool:
        """Named by the profile, with the type it gives it (our decode URL listed as a prefill is not ours)."""
        return (_url(worker), str(worker.get("worker_type", "regular"))) in self.expected

    async def foreign_workers(self) -> list[dict[str, Any]] | None:
        """Every listed worker the profile does not name and the router still routes to (one smg lists
        as "draining" is on its way out); None: the list could not be read."""
        listed = await self.workers()
        return None if listed is None else [w for w in listed if not self.is_ours(w) and not draining(w)]

    async def enforce(self, sink: LogSink, process: str) -> WorkerCheck:
        """Read the router's list; name each foreign worker at error priority and remove it at once.

        Why remove rather than fail the instance: a worker someone else added receives users'
        prompts and answers them with whatever it likes, from the moment it is healthy; every
        second it stays is more of them. Without the key it cannot be added again, and our own
        workers keep serving. Returns how many of ours are healthy, for readiness.
        """
        listed, why = await self._list()
        if listed is None:
            return WorkerCheck(0, len(self.expected), problem=why)
        found, left = [], []
        for w in (w for w in listed if not self.is_ours(w) and not draining(w)):
            found.append(what := _describe(w))
            sink.event(f"{process}: foreign worker {what}: the profile does not name it and it would get users' "
                       "requests; removing it from the router", 3, GPUSUP_PROCESS=process,
                       GPUSUP_EVENT="foreign-worker", GPUSUP_WORKER=what)
            if why := await self._delete(w, FOREIGN_REMOVAL_TIMEOUT_S):
                left.append(what)
                sink.event(f"{process}: foreign worker {what} is still in the router: {why}", 3,
                           GPUSUP_PROCESS=process, GPUSUP_EVENT="foreign-worker", GPUSUP_WORKER=what)
            else:
                sink.event(f"{process}: foreign worker {what} removed from the router", 4, GPUSUP_PROCESS=process,
                           GPUSUP_EVENT="foreign-worker-removed", GPUSUP_WORKER=what)
        ours = [w for w in listed if self.is_ours(w) and serving(w)]
        problem = f"foreign worker(s) still in the router: {', '.join(left)}" if left else ""
        return WorkerCheck(len(ours), len(self.expected), tuple(found), problem,
                           tuple(sorted({str(w.get("worker_type", "regular")) for w in ours})))

    async def first_request(self) -> tuple[int | None, bytes]:
        """One small generation through the router (no key: it is the data plane). In PD mode the
        router's /readiness, and even its worker list, can say ready before it can route: the real
        0.3.2 answered the first /generate 503 "No prefill workers available" then."""
        return await request("POST", self.host, self.port, "/generate", FIRST_REQUEST, timeout=FIRST_REQUEST_TIMEOUT_S,
                             peer_check=self._accepted_by_the_router)


def serving(worker: dict[str, Any]) -> bool:
    """Healthy in the router's own words: `is_healthy`, and with smg's lifecycle field also "ready"
    (a worker still registering, or draining after a DELETE answered 202, is not done)."""
    status = worker.get("status")
    return worker.get("is_healthy") is True and (status is None or status == "ready")


def draining(worker: dict[str, Any]) -> bool:
    return worker.get("status") == "draining"


def router_verdict(check: WorkerCheck, pd: bool, first_request: int | None) -> str:
    """Is a router ready? "" when it is, else why not (one line for the journal).

    Every worker the profile names healthy and nobody else's listed (`WorkerCheck.ready`); in PD
    mode also a prefill and a decode among them, and a first request through the router answered
    200: both routers can say 200 on /health and /readiness before they can route a PD request.
    `first_request` is that request's status (None: not made, or no answer).
    """
    if not check.clean:
        return check.problem
    if check.healthy < check.expected:
        return f"{check.healthy} of the profile's {check.expected} workers healthy in the router"
    if not pd:
        return ""
    missing = [t for t in ("prefill", "decode") if t not in check.healthy_types]
    if missing:
        return f"no healthy {' or '.join(missing)} worker in the router's list"
    if first_request != 200:
        return f"a first request through it answered {first_request or 'nothing'}, not 200"
    return ""


def _failed(what: str, status: int | None, body: bytes, limit: int) -> str:
    """Why a call failed: a call never sent (no status; `_call` put its reason in the body) is said
    whole, in our words; a router's answer is cut to `limit` and quoted (it is not ours)."""
    if status is None and body:
        return f"{what} ({body.decode()})"
    return f"{what} ({status or 'no answer'}: {body[:limit]!r})"


def _url(worker: dict[str, Any]) -> str:
    return str(worker.get("url", "")).rstrip("/")


def _describe(worker: dict[str, Any]) -> str:
    """One line, bounded: the URL and type come from whoever added the worker."""
    text = f"{_url(worker)} ({worker.get('worker_type', '?')}, id {worker.get('id', '?')})"
    return one_line(text)[:200]


async def in_flight(server: ProcessSpec) -> int | None:
    """Requests running or waiting on an SGLang server (None when it does not say).

    SGLang 0.5.23's GET /v1/loads answers without --enable-metrics: per DP rank,
    num_running_reqs and num_waiting_reqs (the scheduler's view; published every few decode
    steps). /metrics (sglang:num_running_reqs + num_queue_reqs) is the fallback.
    """
    status, body = await request("GET", server.probe_host, server.port, "/v1/loads", timeout=API_TIMEOUT_S)
    if status == 200:
        try:
            loads = json.loads(body).get("loads")
            return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)
        except (ValueError, AttributeError, TypeError, ArithmeticError, RecursionError):
            pass  # a server's answer, shaped by its model code: never a reason to raise
    status, body = await request("GET", server.probe_host, server.port, "/metrics", timeout=API_TIMEOUT_S)
    if status != 200:
        return None
    values = _METRIC.findall(body.decode("utf-8", "replace"))
    if not values:
        return None
    try:
        return int(sum(float(v) for _, v in values))
    except (ValueError, ArithmeticError):
        return None


async def wait_drained(server: ProcessSpec, timeout: float) -> int | None:
    """Wait until `server` has nothing in flight; returns what is left at the deadline (0: drained,
    None: it does not say)."""
    deadline = time.monotonic() + timeout
    while True:
        left = await in_flight(server)
        if left in (0, None) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(POLL_S)
