"""A scripted etcd for the tests of what the store says when etcd fails: whoever answers on
etcd's host and port (a network neighbour without TLS), over a real socket, answering each
gateway path as the test says."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from supervisord_gpu.cluster.store import ClusterStore
from supervisord_gpu.config.model import ClusterConfig
from supervisord_gpu.rehearsal._http import StandinHTTPServer

PREFIX = "/supervisord-gpu"

Answer = Any  # (status, body) | (status, reason, headers, body) | callable(handler)

FRIENDLY: dict[str, Answer] = {
    "/v3/lease/grant": (200, b'{"ID": "7", "TTL": "2"}'),
    "/v3/lease/keepalive": (200, b'{"result": {"ID": "7", "TTL": "2"}}'),
    "/v3/kv/lease/revoke": (200, b"{}"),
    "/v3/kv/put": (200, b'{"header": {"revision": "2"}}'),
    "/v3/kv/range": (200, b'{"header": {"revision": "2"}}'),
    "/v3/kv/txn": (200, b'{"succeeded": true}'),
    "/v3/auth/authenticate": (200, b'{"token": "tok"}'),
}


class Etcd(http.server.BaseHTTPRequestHandler):
    """Answers each path as `answers` says; FRIENDLY for the rest. Records what it was asked."""

    answers: dict[str, Answer] = {}
    asked: list[str] = []
    encodings: list[str] = []  # the Accept-Encoding of each request
    release: threading.Event

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.asked.append(self.path)
        self.encodings.append(str(self.headers.get("Accept-Encoding")))
        answer = self.answers.get(self.path, FRIENDLY.get(self.path, (404, b"")))
        if callable(answer):
            answer(self)
            return
        if len(answer) == 2:
            status, body = answer
            reason, headers = None, {"Content-Type": "application/json"}
        else:
            status, reason, headers, body = answer
        self.send_response_only(status, reason)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def etcd() -> Iterator[tuple[str, type[Etcd]]]:
    handler = type("Handler", (Etcd,), {"answers": {}, "asked": [], "encodings": [], "release": threading.Event()})
    server = StandinHTTPServer("127.0.0.1", 0, handler)  # quiet about clients that hang up
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


def store_at(url: str, **more: Any) -> ClusterStore:
    return ClusterStore(ClusterConfig(node="a", etcd=(url,), prefix=PREFIX, **more))


