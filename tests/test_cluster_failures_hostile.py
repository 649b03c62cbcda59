"""Hostile read of cluster/failures.py (#23/#25): the party who answers on etcd's host and port.

Without TLS that is any network neighbour, with TLS etcd itself; it picks the HTTP status, the
reason phrase, headers, body, timing, resets. Each test is that party over a real socket against
the real client (etcd3gw, requests, cluster/etcd.py). The promise (SECURITY.md): one line in our
words, exit 4 (ClusterUnavailable), never a crash, a bug of ours stays a bug, nothing slow.

The F-tests were the read's findings (F1 answers of the wrong type escaping as raw exceptions, F2 what
that did to the agent and a stop, F3 our JSON inside the request, F4 no deadline or size cap, F5 a
503 body taken as our words, redirects followed); each now asserts the fix. The others held from the start.
"""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("etcd3gw")

from supervisord_gpu.cluster import etcd as etcd_module  # noqa: E402
from supervisord_gpu.cluster.failures import classify  # noqa: E402
from supervisord_gpu.cluster.kv import MemoryKV  # noqa: E402
from supervisord_gpu.cluster.records import GpuRecord, NodeRecord  # noqa: E402
from supervisord_gpu.cluster.store import ClusterStore, ClusterUnavailable  # noqa: E402
from supervisord_gpu.config.model import ClusterConfig  # noqa: E402
from supervisord_gpu.rehearsal._http import StandinHTTPServer  # noqa: E402

from scripted_etcd import FRIENDLY, PREFIX, Etcd, etcd, store_at  # noqa: E402,F401  (etcd: the fixture)


def one_line(e: BaseException, url: str) -> str:
    text = str(e)
    assert isinstance(e, ClusterUnavailable) and e.exit_code == 4, repr(e)
    assert text.startswith(f"etcd at {url} ") and "\n" not in text and len(text) < 300, text
    assert all(ch.isprintable() for ch in text), ascii(text)
    return text


def fails_cleanly(url: str, call: Callable[[ClusterStore], Any]) -> str:
    """What `call` on a store at `url` raises: must be one ClusterUnavailable line."""
    try:
        call(store_at(url))
    except ClusterUnavailable as e:
        return one_line(e, url)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"the store raised {type(e).__name__}: {e} (not ClusterUnavailable)")
    pytest.fail("the store call did not fail at all")


READS: dict[str, Callable[[ClusterStore], Any]] = {
    "holder": lambda s: s.holder(),
    "nodes": lambda s: s.nodes(),
    "process_states": lambda s: s.process_states("pd"),
    "current": lambda s: s.current(),
}

# =========================================================================== FINDINGS (fail now)

# F1. Answer-shaped TypeError / OverflowError / binascii.Error / RecursionError: classify() says
#     "a bug of ours" (None), so the raw exception escapes the store.


@pytest.mark.parametrize("body", [
    b'{"ID": null}',  # int(None): "int() argument must be ...": the "argument" rule calls it ours
    b'{"ID": {}}',
    b'{"ID": 1e999}',  # json gives inf; int(inf) is OverflowError, not in classify's list
], ids=["null", "object", "inf"])
def test_F1_a_lease_grant_answer_of_the_wrong_type(etcd, body: bytes) -> None:
    url, h = etcd
    h.answers["/v3/lease/grant"] = (200, body)
    assert "did not answer as etcd" in fails_cleanly(url, lambda s: s.grant())


@pytest.mark.parametrize("body", [
    b'{"result": {"TTL": null}}',
    b'{"result": {"TTL": [1]}}',
    b'{"result": {"TTL": 1e999}}',
], ids=["null", "list", "inf"])
def test_F1_a_keepalive_answer_of_the_wrong_type(etcd, body: bytes) -> None:
    url, h = etcd
    h.answers["/v3/lease/keepalive"] = (200, body)
    assert "did not answer as etcd" in fails_cleanly(url, lambda s: s.refresh(7))


@pytest.mark.parametrize("body", [
    b'{"kvs": [{"key": "abc", "value": "eA=="}]}',  # base64 "Incorrect padding": raised in base64.py
    b'{"kvs": [{"key": "eA==", "value": "a"}]}',
    b'{"kvs": [{"key": "eA==", "lease": {"x": 1}}]}',  # int(dict) in cluster/etcd.py, but "argument" in its text
    b'{"kvs": [{"key": "eA==", "mod_revision": 1e999}]}',
    b'{"header": {"revision": null}}',
], ids=["key-padding", "value-padding", "lease-object", "revision-inf", "header-revision-null"])
@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_F1_a_range_answer_of_the_wrong_type(etcd, body: bytes, read: str) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (200, body)
    assert "did not answer as etcd" in fails_cleanly(url, READS[read])


def test_F1_deep_nesting_that_makes_requests_raise_recursionerror_is_one_line(etcd) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (200, b"[" * 100_000)  # 100 kB
    fails_cleanly(url, lambda s: s.holder())


def test_F1_deep_nesting_in_an_error_body_never_crashes_classify(etcd) -> None:
    """A 500 whose body is 5,000 '[': _etcd_error's json.loads raises RecursionError inside the
    except block of _talking; only ValueError is caught there."""
    url, h = etcd
    h.answers["/v3/kv/range"] = (500, b"[" * 5_000)
    fails_cleanly(url, lambda s: s.holder())
    from etcd3gw.exceptions import InternalServerError

    classify(InternalServerError("[" * 5_000, "Internal Server Error"))  # must not raise


def test_F1_a_login_token_that_is_not_ascii_is_refused_once(etcd, monkeypatch) -> None:
    """With `[cluster] user`: the token from /auth/authenticate goes into the Authorization header;
    http.client encodes it latin-1 -> UnicodeEncodeError (a ValueError raised in http/client.py),
    classified as a bug, re-raised, and the token stays until a 401."""
    url, h = etcd
    monkeypatch.setattr(etcd_module, "read_password", lambda _path: "pw")
    h.answers["/v3/auth/authenticate"] = (200, '{"token": "\u2603"}'.encode())
    s = store_at(url, user="gpusup", password_file="/nonexistent")
    with pytest.raises(ClusterUnavailable):
        s.holder()


# F2. What those escapes do to the callers that expect ClusterUnavailable.


def _node_cfg(tmp: Path, url: str) -> Any:
    from cluster_fixtures import node_config
    from supervisord_gpu.config.loader import load_daemon_config

    node_config(tmp, "a", url)
    toml = tmp / "supervisord-gpu.toml"
    toml.write_text(toml.read_text().replace("lease_ttl = 30", "lease_ttl = 2"))
    return load_daemon_config(tmp)


def test_F2_a_null_lease_id_is_exit_4_for_the_agent_not_a_crash(etcd, tmp_path) -> None:
    from cluster_fixtures import FakeUnits, NoGpus
    from supervisord_gpu.cluster.agent import NodeAgent

    url, h = etcd
    h.answers["/v3/lease/grant"] = (200, b'{"ID": null}')
    cfg = _node_cfg(tmp_path, url)
    said: list[str] = []
    agent = NodeAgent(cfg, ClusterStore(cfg.cluster), FakeUnits(), NoGpus(), lambda m, _p: said.append(m))
    agent.stopping.set()
    try:
        agent.run()  # expected: ClusterUnavailable (exit 4, retried), not TypeError (exit 1)
    except ClusterUnavailable:
        pass


def test_F2_one_bad_keepalive_answer_leaves_the_agents_keepalive_thread_alive(etcd, tmp_path) -> None:
    from cluster_fixtures import FakeUnits, NoGpus
    from supervisord_gpu.cluster.agent import NodeAgent

    url, h = etcd
    h.answers["/v3/lease/keepalive"] = (200, b'{"result": {"TTL": null}}')
    cfg = _node_cfg(tmp_path, url)
    agent = NodeAgent(cfg, ClusterStore(cfg.cluster), FakeUnits(), NoGpus(), lambda m, _p: None)
    agent.lease = 7
    keeper = threading.Thread(target=agent._keep_alive, daemon=True)
    keeper.start()
    time.sleep(2.0)  # every = 0.67 s: two or three renewals
    alive = keeper.is_alive()
    agent.stopping.set()
    keeper.join(3)
    assert alive, "the keep-alive thread died: the node's lease lapses while the agent runs on"


def test_F2_a_bad_range_answer_during_a_stop_lets_the_stop_finish(etcd, tmp_path) -> None:
    """gate.before_stop catches ClusterUnavailable ("stopping without waiting") and TimeoutError
    only: anything else leaves Instance._stop_all mid-way, the wave's processes not stopped."""
    from supervisord_gpu.cluster.gate import ClusterGate
    from supervisord_gpu.config.loader import load_profile

    url, h = etcd
    cfg = _node_cfg(tmp_path, url)
    part = load_profile(cfg, "pd")
    said: list[str] = []
    gate = ClusterGate(ClusterStore(cfg.cluster), part, "a", lambda m, _p: said.append(m))
    h.answers["/v3/kv/range"] = (200, b'{"kvs": [{"key": "abc"}]}')
    try:
        asyncio.run(gate.before_stop([part.process("prefill")]))  # must return: a stop always finishes
    finally:
        gate.close()
    assert any("without waiting for the other nodes" in m for m in said), said


# F3. A bug of ours inside a store call, reported as etcd's fault.


def test_F3_a_record_we_cannot_serialise_is_our_bug_not_etcds() -> None:
    """json.dumps sits inside _talking in announce/publish_process/put_plan/report; its TypeError is
    raised in json/encoder.py, and "/json/" in the innermost frame makes it "did not answer as etcd"."""
    s = ClusterStore(ClusterConfig(node="a", prefix=PREFIX), kv=MemoryKV())
    lease = s.grant()
    with pytest.raises(TypeError):
        s.announce(NodeRecord("a", gpus=(GpuRecord(index={0, 1}),)), lease)  # type: ignore[arg-type]  # a set: ours, no etcd involved


# F4. Slow: no deadline for a whole call, no bound on what is read.


def test_F4_a_watch_whose_answer_never_starts_ends_within_the_request_timeout(etcd) -> None:
    """The watch is a stream, so cluster/etcd.py sets read timeout None: a server that accepts the
    watch POST and never sends a status line holds watch_once (the agent's loop, a gate's stop) for ever."""
    url, h = etcd
    h.answers["/v3/watch"] = lambda handler: handler.release.wait(30)
    s = store_at(url)
    done = threading.Event()

    def watch() -> None:
        try:
            s.watch_once(PREFIX + "/", 0.3)
        except ClusterUnavailable:
            pass
        finally:
            done.set()

    threading.Thread(target=watch, daemon=True).start()
    assert done.wait(5.0), "watch_once(timeout=0.3) still running after 5 s"


def _dripped(status: int, body: bytes, every: float) -> Callable[[Etcd], None]:
    """An answer whose headers come at once and whose body comes a byte every `every` seconds."""

    def drip(handler: Etcd) -> None:
        handler.send_response_only(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.flush()
        for i in range(len(body)):
            if handler.release.wait(every):
                return
            handler.wfile.write(body[i:i + 1])
            handler.wfile.flush()

    return drip


def test_F4_an_answer_dripped_byte_by_byte_ends_at_its_deadline(etcd, monkeypatch) -> None:
    """requests' timeout is per socket read: one byte every 0.15 s against a 0.3 s timeout goes on."""
    monkeypatch.setattr(etcd_module, "ETCD_REQUEST_TIMEOUT_S", 0.3)
    url, h = etcd
    body = b'{"header": {"revision": "2"}}' + b" " * 11  # 40 bytes: 6 s at 0.15 s each
    h.answers["/v3/kv/range"] = _dripped(200, body, 0.15)
    began = time.monotonic()
    try:
        store_at(url).holder()
    except ClusterUnavailable:
        pass
    took = time.monotonic() - began
    assert took < 2.0, f"one read took {took:.1f} s against a 0.3 s timeout"


def test_F4_a_small_gzip_answer_is_not_inflated_past_the_cap(etcd) -> None:
    """64 kB on the wire, 64 MB in memory (and as much again decoded): no cap on an answer."""
    url, h = etcd
    bomb = gzip.compress(b'{"header": {"revision": "2"}}' + b" " * (64 << 20), compresslevel=9)
    h.answers["/v3/kv/range"] = (200, None, {"Content-Type": "application/json", "Content-Encoding": "gzip"}, bomb)
    tracemalloc.start()
    try:
        try:
            store_at(url).holder()
        except ClusterUnavailable:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(bomb) < 200_000 and peak < 16 << 20, f"{len(bomb)} bytes sent, peak {peak >> 20} MiB"


def _watch_in_thread(s: ClusterStore, timeout: float) -> tuple[threading.Event, list[str]]:
    done, said = threading.Event(), []

    def watch() -> None:
        try:
            s.watch_once(PREFIX + "/", timeout)
        except ClusterUnavailable as e:
            said.append(str(e))
        finally:
            done.set()

    threading.Thread(target=watch, daemon=True).start()
    return done, said


def test_F6_an_error_answer_dripped_to_a_watch_with_a_login_ends_at_its_deadline(etcd, monkeypatch) -> None:
    """With `[cluster] user`, a non-200 answer was searched for "invalid auth token" by reading
    its whole body, before any cap or deadline: a 500 dripped a byte every 0.3 s held a
    watch_once(timeout=0.5) for 8.7 s (hostile read of #23), and a huge one took its memory."""
    monkeypatch.setattr(etcd_module, "ETCD_REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(etcd_module, "read_password", lambda _path: "pw")
    url, h = etcd
    h.answers["/v3/watch"] = _dripped(500, b'{"error": "' + b"x" * 200 + b'"}', 0.3)
    began = time.monotonic()
    done, said = _watch_in_thread(store_at(url, user="gpusup", password_file="/nonexistent"), 0.5)
    assert done.wait(10), "the watch still runs after 10 s"
    assert time.monotonic() - began < 3.0, f"the watch took {time.monotonic() - began:.1f} s; {said}"


@pytest.mark.parametrize("encoding", ["gzip", "gzip, gzip", "deflate", "br"])
def test_F6_a_compressed_watch_answer_is_refused_before_it_is_inflated(etcd, encoding: str) -> None:
    """A watch's stream is read by etcd3gw whole per read: 300 kB of gzip on /v3/watch was a 300 MiB
    peak, and a 590-byte "gzip, gzip" answer 261 MiB on urllib3 1.26. We ask for no compression
    (etcd's gateway then sends none), and refuse a compressed answer before reading it."""
    url, h = etcd
    bomb = gzip.compress(b'{"result": {"created": true}}\n' + b" " * (300 << 20), compresslevel=9)
    h.answers["/v3/watch"] = (200, None, {"Content-Type": "application/json", "Content-Encoding": encoding}, bomb)
    tracemalloc.start()
    try:
        done, said = _watch_in_thread(store_at(url), 0.5)
        assert done.wait(10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak >> 20} MiB"
    assert said and said[0].endswith("its answer is compressed, though none was asked for"), said
    assert "identity" in h.encodings[-1], h.encodings


def test_F6_one_login_serves_the_requests_and_every_threads_watches(etcd, monkeypatch) -> None:
    """Each thread watches on a session of its own (etcd3gw's watch closes its session's pools);
    they share one token: a login per thread would be one more bcrypt on etcd per thread, and
    a login during etcd's shutdown (three-host test) read as a refusal."""
    monkeypatch.setattr(etcd_module, "read_password", lambda _path: "pw")
    url, h = etcd
    s = store_at(url, user="gpusup", password_file="/nonexistent")
    s.holder()
    for _ in range(3):
        done, said = _watch_in_thread(s, 0.2)
        assert done.wait(10) and said == [], said
    assert h.asked.count("/v3/auth/authenticate") == 1, h.asked


@pytest.mark.parametrize("status", [500, 503])
def test_F6_a_login_etcd_cannot_serve_is_etcd_away_not_a_refusal(etcd, monkeypatch, status: int) -> None:
    """etcd going down answers a login 503 ("transport: missing content-type field"): that is
    etcd out of reach (exit 4, retried), not "etcd refused user" (a wrong password)."""
    monkeypatch.setattr(etcd_module, "read_password", lambda _path: "pw")
    url, h = etcd
    h.answers["/v3/auth/authenticate"] = (status, b'{"error": "OK: HTTP status code 200; transport: missing content-type field", "code": 14}')
    with pytest.raises(ClusterUnavailable) as e:
        store_at(url, user="gpusup", password_file="/nonexistent").holder()
    text = one_line(e.value, url)
    assert f"cannot be reached (reading the transition lock): its login answered http {status}" in text, text


# F5. The neighbour's words as ours, and an answer called "cannot be reached".


@pytest.mark.parametrize("body", [
    b"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed",
    b"[Errno 1] etcd moved see the operator wiki now",
], ids=["tls", "errno"])
def test_F5_a_503_body_never_chooses_our_reason(etcd, body: bytes) -> None:
    """etcd3gw turns a 503 into ConnectionFailedError(body): _connection() reads the body as a
    requests paragraph: a plain-HTTP answer says "TLS: certificate verify failed", or any
    letters-and-spaces sentence of the neighbour's is printed as our "cannot be reached" reason."""
    url, h = etcd
    h.answers["/v3/kv/range"] = (503, None, {"Content-Type": "text/plain"}, body)
    text = fails_cleanly(url, lambda s: s.holder())
    assert "TLS" not in text and "moved" not in text, text


def test_F5_a_redirect_is_not_followed(etcd) -> None:
    """requests follows 307/308 for a POST, body and client certificate included, to any host and
    port (up to 30 hops): the neighbour makes root POST etcd3gw's JSON to, e.g., a loopback-only
    service it cannot reach itself."""
    url, h = etcd
    hits: list[str] = []

    class Victim(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    victim = StandinHTTPServer("127.0.0.1", 0, Victim)
    threading.Thread(target=victim.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        where = f"http://127.0.0.1:{victim.server_address[1]}/pause_generation"
        h.answers["/v3/kv/range"] = (307, None, {"Location": where}, b"")
        try:
            store_at(url).holder()
        except ClusterUnavailable:
            pass
    finally:
        victim.shutdown()
        victim.server_close()
    assert hits == [], f"the store followed the redirect: {hits}"


# =========================================================================== DEFENCES (hold)


@pytest.mark.parametrize("reason", [
    "\x1b[2J\x1b]0;pwned\x07",
    "a\x85b\xa0c\x00d\x7f",  # NEL, NBSP, NUL, DEL (latin-1 status line)
    "X" * 60_000,
])
def test_held_a_hostile_reason_phrase_is_one_clean_short_line(etcd, reason: str) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (418, reason, {}, b"")
    fails_cleanly(url, lambda s: s.holder())


@pytest.mark.parametrize("error", [
    "etcdserver: \u2028\u2029\u202e\u200b\ufeff",  # line/paragraph separators, bidi, zero-width
    "etcdserver: \ud800 lone surrogate",
    "etcdserver: " + "\u0301" * 5000,  # combining marks
    "etcdserver: " + "\u001b" * 5000,
])
@pytest.mark.parametrize("status", [400, 403, 500])
def test_held_etcds_error_text_is_cleaned(etcd, error: str, status: int) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (status, json.dumps({"error": error, "code": 7}).encode())
    text = fails_cleanly(url, lambda s: s.holder())
    text.encode("utf-8")  # no lone surrogate: the journal can write it
    assert "\u202e" not in text and "\u2028" not in text


@pytest.mark.parametrize("status", [401, 408, 412, 429, 500, 502, 503, 504, 599])
def test_held_any_status_with_an_empty_body_is_one_line(etcd, status: int) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (status, b"")
    fails_cleanly(url, lambda s: s.holder())


def test_held_a_huge_regex_hostile_503_body_is_quick(etcd) -> None:
    url, h = etcd
    body = (b"[Errno " + b"1" * 2_000_000 + b" [SSL: " + b"A" * 2_000_000 + b" [Errno -" + b"9" * 2_000_000
            + b"] " + b"a," * 1_000_000)
    h.answers["/v3/kv/range"] = (503, None, {"Content-Type": "text/plain"}, body)
    began = time.monotonic()
    fails_cleanly(url, lambda s: s.holder())
    assert time.monotonic() - began < 5.0


def test_held_a_huge_json_error_is_cut(etcd) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (500, json.dumps({"error": "etcdserver: " + "x" * 1_000_000}).encode())
    fails_cleanly(url, lambda s: s.holder())


@pytest.mark.parametrize("body", [
    b"[1]", b'"x"', b"null", b"1e999", b'{"kvs": 5}', b'{"kvs": [{"key": 5}]}', b'{"header": []}',
    b'{"kvs": [{"key": "eA==", "lease": "abc"}]}', b'{"kvs": [{"key": "eA==", "lease": "' + b"9" * 5000 + b'"}]}',
    b"\xff\xfe\x00garbage", b"",
])
def test_held_answers_that_do_not_fit_are_not_etcd(etcd, body: bytes) -> None:
    url, h = etcd
    h.answers["/v3/kv/range"] = (200, body)
    try:
        store_at(url).holder()
    except ClusterUnavailable as e:
        assert "did not answer as etcd" in one_line(e, url)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__}: {e}")


def _raw(reply: Callable[[socket.socket], None]) -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2)
                    conn.recv(65536)
                    reply(conn)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def _rst(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


RAW: dict[str, Callable[[socket.socket], None]] = {
    "reset": _rst,
    "close-silently": lambda c: None,
    "banner": lambda c: c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n"),
    "tls-alert": lambda c: c.sendall(b"\x15\x03\x01\x00\x02\x02\x28"),
    "status-999999": lambda c: c.sendall(b"HTTP/1.1 999999 X\r\n\r\n"),
    "short-body": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"kvs\""),
    "short-body-then-reset": lambda c: (c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"), _rst(c)),
    "bad-chunked": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    "bad-gzip": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nnope"),
    "gzip-chain": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: " + b"gzip," * 50
                                      + b"gzip\r\nContent-Length: 2\r\n\r\n{}"),
    "long-header": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n"),
    "many-headers": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\n" + b"X: a\r\n" * 200 + b"\r\n"),
    "bad-content-length": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}"),
    "nul-in-header": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nX\x00: \x1b\r\nContent-Length: 2\r\n\r\n{}"),
}


@pytest.mark.parametrize("name", list(RAW))
def test_held_raw_socket_answers_are_one_line(name: str) -> None:
    for url in _raw(RAW[name]):
        try:
            store_at(url).holder()
        except ClusterUnavailable as e:
            one_line(e, url)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{type(e).__name__}: {e}")


def test_held_https_to_a_plain_http_listener_is_a_tls_failure(etcd) -> None:
    url, _h = etcd
    url = url.replace("http://", "https://")
    assert "cannot be reached" in fails_cleanly(url, lambda s: s.holder())


def test_held_a_refused_login_with_a_hostile_body_is_one_line(etcd, monkeypatch) -> None:
    url, h = etcd
    monkeypatch.setattr(etcd_module, "read_password", lambda _path: "pw")
    for body in (b'{"error": "\x1b[31mno\\nway"}', b"[1]", b"<html>" + b"x" * 100_000):
        h.answers["/v3/auth/authenticate"] = (401, body)
        try:
            store_at(url, user="gpusup", password_file="/nonexistent").holder()
        except ClusterUnavailable as e:
            one_line(e, url)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{type(e).__name__}: {e}")
