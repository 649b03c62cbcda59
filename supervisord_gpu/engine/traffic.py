"""Taking one server out of traffic before it is stopped alone, and putting it back after.

After SIGTERM, SGLang keeps accepting and serving new requests and looks for "no requests
left" every 5 s with no upper bound (sglang-server.md): a server that still gets traffic never
drains and is SIGKILLed mid-request at its deadline. Behind a router the remedy is the
router's own worker API (sglang-router 0.3.2): DELETE /workers/{id} stops new requests to it
while those already proxied complete; once the server reports nothing in flight it can be
stopped, and POST /workers puts the restarted server back. With the whole instance stopping,
none of this is needed: the router stops first and closes its listener.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from ..config.model import ProcessSpec
from .probe import request

POLL_S = 0.1
API_TIMEOUT_S = 5.0

_METRIC = re.compile(r"^sglang:(num_running_reqs|num_queue_reqs)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


class RouterWorkers:
    """One router's worker list, through its HTTP API."""

    def __init__(self, router: ProcessSpec) -> None:
        self.router = router
        self.host = router.probe_host
        self.port = router.port

    async def workers(self) -> list[dict[str, Any]] | None:
        status, body = await request("GET", self.host, self.port, "/workers", timeout=API_TIMEOUT_S)
        if status != 200:
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        workers = data.get("workers") if isinstance(data, dict) else None
        return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else None

    async def _find(self, url: str) -> dict[str, Any] | None:
        for w in await self.workers() or []:
            if str(w.get("url", "")).rstrip("/") == url:
                return w
        return None

    async def withdraw(self, server: ProcessSpec, timeout: float) -> str:
        """Remove `server` from the router; returns "" once it is gone from the list, else why not."""
        worker = await self._find(server.url)
        if worker is None:
            return ""  # not (or no longer) registered: nothing routes to it
        status, body = await request("DELETE", self.host, self.port, f"/workers/{worker.get('id', '')}",
                                     timeout=API_TIMEOUT_S)
        if status not in (200, 202, 204):
            return f"the router refused to remove it ({status or 'no answer'}: {body[:120]!r})"
        deadline = time.monotonic() + timeout
        while await self._find(server.url) is not None:
            if time.monotonic() > deadline:
                return f"the router still lists it {timeout:g} s after removing it"
            await asyncio.sleep(POLL_S)
        return ""

    async def restore(self, server: ProcessSpec, timeout: float) -> str:
        """Add `server` back and wait until the router calls it healthy; "" on success, else why not."""
        if (w := await self._find(server.url)) is None:
            body: dict[str, Any] = {"url": server.url}
            if self.router.router_mode == "pd":
                body["worker_type"] = server.role
                if server.role == "prefill":
                    body["bootstrap_port"] = server.bootstrap_port
            status, answer = await request("POST", self.host, self.port, "/workers", body, timeout=API_TIMEOUT_S)
            if status not in (200, 201, 202):
                return f"the router refused to add it back ({status or 'no answer'}: {answer[:120]!r})"
        deadline = time.monotonic() + timeout
        while not ((w := await self._find(server.url)) is not None and w.get("is_healthy", True)):
            if time.monotonic() > deadline:
                return f"the router did not take it back within {timeout:g} s"
            await asyncio.sleep(POLL_S)
        return ""


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
        except (ValueError, AttributeError, TypeError):
            pass
    status, body = await request("GET", server.probe_host, server.port, "/metrics", timeout=API_TIMEOUT_S)
    if status != 200:
        return None
    values = _METRIC.findall(body.decode("utf-8", "replace"))
    if not values:
        return None
    return int(sum(float(v) for _, v in values))


async def wait_drained(server: ProcessSpec, timeout: float) -> int | None:
    """Wait until `server` has nothing in flight; returns what is left at the deadline (0: drained,
    None: it does not say)."""
    deadline = time.monotonic() + timeout
    while True:
        left = await in_flight(server)
        if left in (0, None) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(POLL_S)
