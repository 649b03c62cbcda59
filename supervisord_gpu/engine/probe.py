"""A readiness probe: one HTTP GET on the loop, answered by a status code or nothing.

Written on asyncio streams rather than a client library: it must never block the loop, costs
one connection per probe, and needs nothing beyond the status line. It also says whether
anything accepted the connection at all: SGLang's port is closed while it loads, so a
connection during the load means someone else is listening there (see listener ownership in
ManagedProcess.wait_ready). After ready, a `peer_check` decides before a byte is sent whether
the process that accepted this very connection is ours (`who_accepted`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from ..checks.ports import Acceptance, accepted_by
from ..records import dataclass

#: the first look at the socket tables after connecting, and the longest pause between looks
#: while the connection waits in an accept queue (a live server accepts within a millisecond;
#: a hung one is looked at some tens of times over its whole timeout, not thousands)
ACCEPT_FIRST_S, ACCEPT_MAX_S = 0.001, 0.1

#: (our socket's address, its peer's) -> "" when whoever accepted the connection is ours, else who did
PeerCheck = Callable[[tuple[str, int], tuple[str, int]], Awaitable[str]]


@dataclass(frozen=True)
class ProbeResult:
    status: int | None  # the HTTP status, or None when there was no HTTP answer
    connected: bool  # something accepted the TCP connection
    #: the peer check's verdict when it was not ours (nothing was sent, and status is None)
    stranger: str = ""


async def who_accepted(ours: tuple[str, int], theirs: tuple[str, int], our_pids: Callable[[], Iterable[int]],
                       wait_s: float) -> Acceptance:
    """checks/ports.py's `accepted_by`, asked again (backing off, on the loop: no executor thread
    waits) until the connection is accepted or `wait_s` passes: a process that never accepts
    it never answers on it either."""
    deadline = time.monotonic() + wait_s
    pause = ACCEPT_FIRST_S
    while True:
        found = await asyncio.to_thread(lambda: accepted_by(ours, theirs, list(our_pids())))
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            return Acceptance(False)
        await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, ACCEPT_MAX_S)


async def _stranger(writer: asyncio.StreamWriter, peer_check: PeerCheck | None) -> str:
    """"" when there is no check or the connection's other end is ours; else who holds it."""
    if peer_check is None:
        return ""
    ours, theirs = writer.get_extra_info("sockname"), writer.get_extra_info("peername")
    return await peer_check((ours[0], ours[1]), (theirs[0], theirs[1]))


async def probe(host: str, port: int, path: str, timeout: float, min_workers: int = 0,
                peer_check: PeerCheck | None = None) -> ProbeResult:
    """GET http://host:port/path.

    With `min_workers`, a 200 counts only if the JSON body says at least that many healthy
    workers: sglang-router 0.3.2 answers /readiness 200 as soon as *one* worker is healthy.
    With `peer_check`, nothing is sent unless it says the connection is ours.
    """
    writer = None
    connected = False
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            connected = True
            if why := await _stranger(writer, peer_check):
                return ProbeResult(None, connected, why)
            hostname = f"[{host}]" if ":" in host else host
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {hostname}:{port}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()
            parts = status_line.split()
            if not (len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() and len(parts[1]) == 3):
                return ProbeResult(None, connected)
            status = int(parts[1])
            if status == 200 and min_workers:
                body = (await reader.read(1 << 16)).split(b"\r\n\r\n", 1)[-1]
                if _healthy_workers(body) < min_workers:
                    status = 503
            return ProbeResult(status, connected)
    except (TimeoutError, OSError, ValueError):
        return ProbeResult(None, connected)
    finally:
        if writer is not None:
            writer.close()


async def http_status(host: str, port: int, path: str, timeout: float, min_workers: int = 0) -> int | None:
    """The status code of GET http://host:port/path, or None if there was no HTTP answer."""
    return (await probe(host, port, path, timeout, min_workers)).status


def _healthy_workers(body: bytes) -> int:
    start = body.find(b"{")
    try:
        return int(json.loads(body[start:]).get("healthy_workers", 0)) if start >= 0 else 0
    except (ValueError, AttributeError, TypeError, ArithmeticError, RecursionError):
        return 0  # whatever a stranger on the port answers: its shape never raises here


#: the most of an answer `request` reads: the engine's calls get a few KiB back (a worker list,
#: loads, one generated token; /metrics is read up to its own 1 MiB bound)
MAX_ANSWER_BYTES = 4 << 20


async def request(method: str, host: str, port: int, path: str, body: object = None,
                  timeout: float = 5.0, headers: Mapping[str, str] | None = None,
                  peer_check: PeerCheck | None = None, max_bytes: int = MAX_ANSWER_BYTES) -> tuple[int | None, bytes]:
    """One HTTP/1.1 request with an optional JSON body; (status, body), status None without an answer.

    For the few control calls the engine makes (the router's /workers API, a server's load):
    small bodies, one connection each, never blocking the loop. `headers` (the router's
    `Authorization: Bearer KEY`) must not hold CR or LF: a value that could add a header of its
    own is refused (ValueError), never sent. With `peer_check`, nothing is sent unless it says
    the process that accepted the connection is ours; otherwise (None, its reason). Reading
    stops past `max_bytes` (MAX_ANSWER_BYTES unless told): the answer is written by a child's
    model code (directly, or through its router) or by a neighbour on the port, and an endless
    body must cost the daemon no more memory than that.
    """
    extra = "".join(f"{name}: {value}\r\n" for name, value in _safe(headers or {}))
    writer = None
    payload = b"" if body is None else json.dumps(body).encode()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            if why := await _stranger(writer, peer_check):
                return None, why.encode()
            hostname = f"[{host}]" if ":" in host else host
            head = (f"{method} {path} HTTP/1.1\r\nHost: {hostname}:{port}\r\nConnection: close\r\n"
                    f"Content-Length: {len(payload)}\r\n" + ("Content-Type: application/json\r\n" if body is not None else "")
                    + extra + "\r\n")
            writer.write(head.encode() + payload)
            await writer.drain()
            got = bytearray()
            while len(got) <= max_bytes and (chunk := await reader.read(1 << 16)):
                got += chunk
            raw = bytes(got)
    except (TimeoutError, OSError, ValueError):
        return None, b""
    finally:
        if writer is not None:
            writer.close()
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    parts = head_bytes.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[1].isdigit() or len(parts[1]) != 3:
        return None, b""
    if b"transfer-encoding: chunked" in head_bytes.lower():
        rest = _unchunk(rest)
    return int(parts[1]), rest


def _safe(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    for name, value in headers.items():
        if any(c in name + value for c in "\r\n\0") or not name or ":" in name:
            raise ValueError(f"header {name!r} would not be one header line")
    return list(headers.items())


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0][:16], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)
