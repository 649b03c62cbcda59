"""What the store says when etcd fails, as the party who answers on etcd's port (cluster/failures.py).

A network neighbour can answer on `[cluster] etcd`'s host and port (without TLS, or before it is
on): a web server, a proxy, a stranger writing anything. Each case below is that party, over a
real socket, against the real client (etcd3gw and requests): the store says one line in our
words, names the endpoint, and a bug of ours is never passed off as etcd being away.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

pytest.importorskip("etcd3gw")

from supervisord_gpu.cluster import etcd as etcd_module  # noqa: E402
from supervisord_gpu.cluster.dcs import LeaseNotFound, NotTheStore, StoreRefused, StoreUnreachable  # noqa: E402
from supervisord_gpu.cluster.failures import classify, clean, failure  # noqa: E402
from supervisord_gpu.cluster.kv import MemoryKV  # noqa: E402
from supervisord_gpu.cluster.records import GpuRecord, NodeRecord  # noqa: E402
from supervisord_gpu.cluster.store import ClusterStore, ClusterUnavailable  # noqa: E402
from supervisord_gpu.config.model import ClusterConfig  # noqa: E402


def store_at(url: str) -> ClusterStore:
    return ClusterStore(ClusterConfig(node="a", etcd=(url,), prefix="/supervisord-gpu"))


def said(url: str) -> str:
    with pytest.raises(ClusterUnavailable) as e:
        store_at(url).holder()
    text = str(e.value)
    assert e.value.exit_code == 4 and "\n" not in text and text.startswith(f"etcd at {url} "), text
    for internals in ("HTTPConnectionPool", "Max retries", "object at 0x", "Traceback", "urllib3"):
        assert internals not in text, text
    return text


from scripted_etcd import etcd  # noqa: E402,F401  (the fixture)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nobody_on_the_port_is_connection_refused_in_our_words() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    assert said(url) == f"etcd at {url} cannot be reached (reading the transition lock): connection refused"


def test_a_listener_that_never_answers_is_no_answer_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_module, "ETCD_REQUEST_TIMEOUT_S", 0.5)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        assert said(url).endswith("cannot be reached (reading the transition lock): no answer in time")


def test_a_web_server_on_etcds_port_did_not_answer_as_etcd(etcd: tuple[str, Any]) -> None:
    url, handler = etcd
    handler.answers["/v3/kv/range"] = (404, None, {"Content-Type": "text/html"}, b"<html><body>Not Found</body></html>")
    assert said(url) == f"etcd at {url} did not answer as etcd (reading the transition lock): an HTTP error that is not etcd's (Not Found)"
    handler.answers["/v3/kv/range"] = (200, None, {"Content-Type": "text/html"}, b"<html>welcome</html>")
    assert "did not answer as etcd" in said(url) and "not JSON" in said(url)
    handler.answers["/v3/kv/range"] = (200, None, {"Content-Type": "application/json"}, b"[1, 2, 3]")
    assert "did not answer as etcd (reading the transition lock): its answer does not fit" in said(url)


def test_an_error_etcd_answers_is_kept_one_clean_line(etcd: tuple[str, Any]) -> None:
    url, handler = etcd
    handler.answers["/v3/kv/range"] = (403, None, {"Content-Type": "application/json"}, b'{"error": "etcdserver: permission denied", "code": 7}')
    assert said(url) == f"etcd at {url} answered with an error (reading the transition lock): etcdserver: permission denied"
    forged = "etcdserver: \x1b[2J\x1b]0;pwned\x07 oops\n" + "A" * 10_000  # escapes, a newline, 10 kB
    handler.answers["/v3/kv/range"] = (500, None, {"Content-Type": "application/json"}, json.dumps({"error": forged}).encode())
    text = said(url)
    assert "\x1b" not in text and "\x07" not in text and len(text) < 300, text


def test_a_bug_of_ours_is_a_bug_and_any_answer_is_etcds() -> None:
    """Our records become JSON before the request: a record of ours that cannot is a TypeError
    (a bug, raised as one), not "etcd cannot be reached", exit 4, retried for ever. Whatever is
    raised once the request is under way is the answer's doing: the etcd backend classifies it
    (one line, exit 4); a KV that let an unclassified exception out would be that KV's bug, and
    the store does not dress it up as the store's fault."""
    s = ClusterStore(ClusterConfig(node="a", prefix="/supervisord-gpu"), kv=MemoryKV())
    lease = s.grant()
    with pytest.raises(TypeError):
        s.announce(NodeRecord("a", gpus=(GpuRecord(index={0, 1}),)), lease)  # type: ignore[arg-type]  # a set: json cannot

    deep = failure(RecursionError("maximum recursion depth exceeded"))  # 100,000 nested brackets
    assert isinstance(deep, NotTheStore) and deep.exit_code == 4
    assert str(deep.during("http://e:2379", "reading the transition lock")) == (
        "etcd at http://e:2379 did not answer as etcd (reading the transition lock): its answer does not fit (RecursionError)")

    class Odd(MemoryKV):
        def range(self, key: str, prefix: bool = False):  # type: ignore[no-untyped-def, override]
            raise RecursionError("maximum recursion depth exceeded")

    with pytest.raises(RecursionError):
        ClusterStore(ClusterConfig(node="a", prefix="/supervisord-gpu"), kv=Odd()).holder()


def test_a_write_bound_to_a_lease_the_store_does_not_know_is_refused_as_lease_not_found() -> None:
    s = ClusterStore(ClusterConfig(node="a", prefix="/supervisord-gpu"), kv=MemoryKV())
    with pytest.raises(LeaseNotFound, match=r"answered with an error \(publishing node a\): etcdserver: requested lease not found"):
        s.announce(NodeRecord("a"), 12345)
    from etcd3gw.exceptions import Etcd3Exception  # what etcd answers, classified alike by the etcd backend

    said = failure(Etcd3Exception('{"error": "etcdserver: requested lease not found", "code": 5}', "Bad Request"))
    assert isinstance(said, LeaseNotFound) and said.reason == "etcdserver: requested lease not found"
    other = failure(Etcd3Exception('{"error": "etcdserver: permission denied", "code": 7}', "Forbidden"))
    assert isinstance(other, StoreRefused) and not isinstance(other, LeaseNotFound)


@pytest.mark.parametrize("text, expected", [
    ("HTTPConnectionPool(host='h', port=1): Max retries exceeded (Caused by NewConnectionError('<x>: "
     "Failed to establish a new connection: [Errno 111] Connection refused'))", "connection refused"),
    ("(Caused by NameResolutionError(\"<x>: Failed to resolve 'etcd.invalid' ([Errno -2] Name or service not known)\"))",
     "its host name does not resolve"),
    ("(Caused by SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed')))",
     "TLS: certificate verify failed"),
    ("('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))",
     "the connection was closed by the other end"),
])
def test_requests_paragraphs_become_a_few_words(text: str, expected: str) -> None:
    from etcd3gw.exceptions import ConnectionFailedError

    assert classify(ConnectionFailedError(text)) == ("cannot be reached", expected)


def test_clean_is_one_printable_line() -> None:
    assert clean("a\nb\x1b[31mc\td", 80) == "a b [31mc d"
    assert len(clean("x" * 500)) == 120




def test_a_watch_ending_on_another_thread_leaves_this_threads_connections_alone(etcd: tuple[str, Any]) -> None:
    """etcd3gw ends a watch by closing the connection adapter it came through, and with it every
    pool of that session: on a session shared by all threads, a read entering the pool just
    then failed with urllib3's "Pool is closed" (the three-host test: a start waiting on its
    peers and the lease keep-alive beside it, "the connection failed"). Seen here as the
    connection a read keeps alive: a watch that starts and ends on another thread must leave
    it open, so the next read comes over the same connection."""
    import threading

    url, handler = etcd
    ports: list[int] = []

    def range_answer(h: Any) -> None:
        ports.append(h.client_address[1])
        body = b'{"header": {"revision": "2"}}'
        h.send_response_only(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def watch_answer(h: Any) -> None:  # created, then nothing until the client ends it
        h.send_response_only(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        line = b'{"result": {"created": true}}\n'
        h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        h.wfile.flush()
        handler.release.wait(5)

    handler.answers = {"/v3/kv/range": range_answer, "/v3/watch": watch_answer}
    store = store_at(url)
    store.processes("pd")
    watcher = threading.Thread(target=store.watch_once, args=(store.key("parts", ""), 0.2))
    watcher.start()
    watcher.join(10)
    store.processes("pd")
    assert len(ports) == 2 and ports[0] == ports[1], f"the read's connection was closed by the watch: ports {ports}"

def _cut_off_then(whole: int) -> tuple[Any, list[str]]:
    """A range answer that breaks off after its first bytes (Content-Length promises more),
    `whole` times whole after that, then cut off again; what was answered, in order."""
    said: list[str] = []

    def answer(h: Any) -> None:
        body = b'{"header": {"revision": "9"}, "kvs": []}'
        cut = not (0 < len(said) <= whole)
        said.append("cut" if cut else "whole")
        h.send_response_only(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body[:7] if cut else body)
        h.wfile.flush()
        if cut:
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)

    return answer, said


def test_a_read_whose_answer_is_cut_off_once_is_read_again(etcd: tuple[str, Any]) -> None:
    """A start waiting on its peers read etcd, the answer broke off (under load, over TLS), and
    the whole start failed with "the connection failed". A read may be repeated: once."""
    url, handler = etcd
    answer, said = _cut_off_then(whole=1)
    handler.answers = {"/v3/kv/range": answer}
    assert store_at(url).processes("pd") == []
    assert said == ["cut", "whole"]


def test_an_answer_cut_off_twice_is_one_line_naming_it(etcd: tuple[str, Any]) -> None:
    url, handler = etcd
    answer, said = _cut_off_then(whole=0)
    handler.answers = {"/v3/kv/range": answer}
    with pytest.raises(ClusterUnavailable) as e:
        store_at(url).processes("pd")
    assert str(e.value).endswith("cannot be reached (reading /supervisord-gpu/parts/pd/): its answer was cut off"), str(e.value)
    assert said == ["cut", "cut"]  # read twice, not more


def test_a_write_whose_answer_is_cut_off_is_not_repeated(etcd: tuple[str, Any]) -> None:
    """A write may have been done by the time its answer broke off (a create that succeeded,
    repeated, would say it lost): it is never sent twice."""
    url, handler = etcd
    answer, said = _cut_off_then(whole=5)
    handler.answers = {"/v3/kv/txn": answer}
    store = store_at(url)
    with pytest.raises(StoreUnreachable, match="its answer was cut off"):  # classified by the etcd backend
        store.kv.delete_if(store.key("lock"), b"x")
    assert said == ["cut"]
