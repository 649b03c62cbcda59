"""Tiny standard-library HTTP helpers shared by the stand-in server and router.

Why not aiohttp or FastAPI: the stand-ins run by the dozen (up to 64 servers on a
2-core machine) and must start in a few tens of milliseconds with a small memory
footprint, so they use only `http.server`, `http.client` and `socket`.

Everything here is plumbing: a threading HTTP server that binds exactly the port asked
for (a bind failure is the caller's to report, each stand-in the way its original does), a
request handler with JSON helpers and an in-flight counter (what the router's graceful
shutdown waits on), a one-shot HTTP client, the SGLang-style log line and raw writes under
one lock (tqdm updates), and a way to set the process name the way `setproctitle` would.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from collections.abc import Callable
from urllib.parse import urlsplit

_print_lock = threading.RLock()  # re-entrant: a signal handler may log while the main thread is printing


def log(message: str, tag: str | None = None, stream: Any = None) -> None:
    """Print one SGLang-style log line, "[YYYY-MM-DD HH:MM:SS] message" (or "[... TP1] ..."), flushed.

    SGLang's format has no level name, and its lines go to stderr (the default here).
    Flushing each line matters: a supervisor reads the log through a pipe or the journal and
    reacts to start-up phases as they happen.
    """
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    prefix = f"[{stamp} {tag}] " if tag else f"[{stamp}] "
    write_raw(prefix + message + "\n", stream)


def write_raw(text: str, stream: Any = None) -> None:
    """Write text as it is (a tqdm update, a log line) under the print lock, flushed."""
    out = stream if stream is not None else sys.stderr
    with _print_lock:
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass  # the reader is gone: a log line is not worth dying for


def set_process_name(name: str) -> None:
    """Set /proc/self/comm (15 bytes at most), like setproctitle does for `comm`.

    Cheap and dependency-free; what `ps -o comm` and psutil's name() show.
    """
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


class SignalLatch:
    """Remembers that a signal came, and lets the main thread sleep until it does.

    Why not threading.Event: a Python signal handler runs in the main thread between
    bytecodes, possibly while that thread holds the Event's internal lock (inside
    Event.wait), and Event.set() would then deadlock on it. Here the handler only sets a
    boolean and the main thread sleeps in select() on signal.set_wakeup_fd's pipe.
    Call from the main thread.
    """

    def __init__(self, *signums: int) -> None:
        import os
        import signal

        self.fired = False
        self.count = 0
        self._r, w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.fired = True
        self.count += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to `timeout` seconds (None: forever) or until the signal; True if it came."""
        import os
        import select

        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while not self.fired:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            ready, _, _ = select.select([self._r], [], [], remaining)
            if ready:
                try:
                    os.read(self._r, 512)
                except BlockingIOError:
                    pass
        return self.fired


class InFlight:
    """Counts requests being served, so a graceful stop can wait for them."""

    def __init__(self) -> None:
        self._count = 0
        self._cond = threading.Condition()

    def __enter__(self) -> InFlight:
        with self._cond:
            self._count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    @property
    def count(self) -> int:
        with self._cond:
            return self._count

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight; False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._count > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
            return True


class StandinHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that binds exactly the port asked for.

    Daemon threads: a request that sleeps must never keep a stopping process alive
    (draining is done explicitly with `InFlight`, not by joining threads).
    """

    daemon_threads = True
    allow_reuse_address = True  # TIME_WAIT only; a live listener still makes bind fail
    request_queue_size = 128

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), handler)
        self.inflight = InFlight()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-response (probes with short timeouts) are normal.
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def serve_in_thread(server: StandinHTTPServer, name: str) -> threading.Thread:
    """Run serve_forever in a daemon thread; a short poll so shutdown() is prompt."""
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True)
    t.start()
    return t


class JSONHandler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler with JSON helpers and no access log on stderr.

    HTTP/1.0 (one request per connection) keeps thread and drain bookkeeping trivial;
    hyper/reqwest in the real router and urllib in tests handle it fine.
    """

    server: StandinHTTPServer
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        return

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def read_json(self) -> Any:
        raw = self.read_body()
        if not raw:
            return {}
        return json.loads(raw)

    def send_bytes(self, status: int, body: bytes, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def send_json(self, status: int, obj: Any) -> None:
        self.send_bytes(status, json.dumps(obj).encode())

    def send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_bytes(status, text.encode(), content_type)

    def send_empty(self, status: int) -> None:
        self.send_bytes(status, b"", "text/plain; charset=utf-8")

    def dispatch(self, routes: dict[str, Callable[[], None]]) -> None:
        """Call the route for the path (query string ignored), or answer 404 like FastAPI."""
        path = urlsplit(self.path).path
        route = routes.get(path)
        if route is None:
            self.send_json(404, {"detail": "Not Found"})
        else:
            route()


def fetch(method: str, url: str, body: bytes | None = None, timeout: float = 5.0,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with no connection reuse; returns (status, headers, body).

    Raises OSError (connection refused, timeout, ...) like http.client does.
    """
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if body is not None:
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()
