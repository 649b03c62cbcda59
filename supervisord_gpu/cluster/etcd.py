"""etcd's v3 JSON gateway (python3-etcd3gw) as the cluster's KV (cluster/kv.py), as Patroni uses it:
TLS with the cluster's CA, a client certificate, and etcd's own authentication.

Why all three: etcd is where orders for root come from (a plan makes each node's root agent stop
and start units). Without TLS client certificates (`--client-cert-auth` on etcd) anyone who
reaches the client port writes plans; without etcd authentication every holder of any
certificate the CA signed may write anything. With both, only a node, authenticated as the etcd
user of `[cluster] user` (its password in `password_file`), writes, and only under our prefix.

The etcd role the nodes need (one user, e.g. `gpusup`, with one role):

    etcdctl role add gpusup
    etcdctl role grant-permission gpusup --prefix=true readwrite /supervisord-gpu/
    etcdctl user add gpusup            # the password goes to password_file on every node
    etcdctl user grant-role gpusup gpusup
    etcdctl user add root && etcdctl auth enable   # root: for the operator, never on a node

Read and write under `PREFIX/` only: nodes, lock, current, transitions, parts; leases need no
key permission. Revoking a lease needs write permission on the keys bound to it, which are ours.

Certificates: each node's client certificate (signed by the cluster's CA, extended key usage
clientAuth) must have no CommonName (put the node in O/OU and a SAN): with authentication on,
etcd's JSON gateway refuses a client certificate with a CN ("CommonName of client sending a
request against gateway will be ignored"), since it cannot pass it on as the user. The user is
always the token's. A certificate without a token can still grant a lease (etcd checks no
permission for that), and reads and writes nothing.

The token from /v3/auth/authenticate goes in the Authorization header of every request; a token
etcd no longer knows (its TTL passed, etcd restarted) is renewed once, and the request repeated.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from ..config.model import ClusterConfig
from ..errors import SupervisorError
from .credentials import checked, read_password
from .failures import AnswerCutOff, AnswerEncoded, AnswerTooLarge, failure
from .kv import Entry


ETCD_REQUEST_TIMEOUT_S = 3.0
#: the most an answer may hold, decompressed (etcd's own default request limit is 1.5 MiB)
ANSWER_MAX = 4 << 20


#: etcd's tokens are short ASCII (simple or JWT); anything else is not etcd's login answer
_TOKEN_MAX = 8192


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: Any) -> bytes:
    return base64.b64decode(text) if isinstance(text, str) else b""


class _Token:
    """etcd's token, shared by every session of one client (the requests' and each thread's
    watches): one login, not one per thread, and one renewal when etcd drops it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value = ""


def _session(base: str, tls: tuple[str | None, str | None, str | None], login: tuple[str, str] | None,
             timeout: float, token: _Token | None = None) -> Any:
    """A requests session for etcd: our CA and client certificate on every request (passed per
    request: requests lets REQUESTS_CA_BUNDLE in the environment override a session's own CA),
    and, with a `login` (user, password), etcd's token in the Authorization header."""
    import requests

    ca, cert, key = tls

    class EtcdSession(requests.Session):
        def __init__(self) -> None:
            super().__init__()
            self._shared = token or _Token()

        def _tls(self, kwargs: dict[str, Any]) -> dict[str, Any]:
            if ca:
                kwargs["verify"] = ca
            if cert and key:
                kwargs["cert"] = (cert, key)
            return kwargs

        def authenticate(self, stale: str) -> None:
            assert login is not None
            with self._shared.lock:
                if self._shared.value != stale:
                    return  # another thread renewed it meanwhile
                r = _read_bounded(self._answer("POST", base + "auth/authenticate", **self._tls(
                    {"json": {"name": login[0], "password": login[1]}, "timeout": timeout,
                     "allow_redirects": False, "stream": True})), time.monotonic() + 2 * timeout)
                if r.status_code >= 500:  # etcd going down or not up: away, not a refusal
                    raise ConnectionError(f"its login answered HTTP {r.status_code}")
                if r.status_code != 200:
                    raise PermissionError(f"etcd refused user {login[0]!r}: {_message(r)}")
                token = r.json().get("token", "")
                if not (isinstance(token, str) and 0 < len(token) <= _TOKEN_MAX and token.isascii() and token.isprintable()):
                    raise PermissionError(f"etcd's answer to the login of user {login[0]!r} holds no token")
                self._shared.value = token

        def request(self, method: Any, url: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            kwargs = self._tls(kwargs)
            # Debian 12's etcd3gw (2.0.0) sends no timeout at all: an etcd out of reach would hang
            # every call. A watch (a stream) waits as long for its answer and for each event;
            # our watches last a second or a third of the lease TTL, and one whose stream read
            # times out ends as if no event came (the callers read again).
            kwargs.setdefault("timeout", timeout)
            # a redirect would make root send our request (our token with it) wherever the
            # answerer points, loopback services included: etcd never redirects its gateway
            kwargs["allow_redirects"] = False
            if kwargs.get("stream"):
                return self._send(method, url, kwargs)
            kwargs["stream"] = True  # read below, against a size cap and a deadline for the whole
            return _read_bounded(self._send(method, url, kwargs), time.monotonic() + 2 * timeout)

        def _answer(self, method: Any, url: Any, **kwargs: Any) -> Any:
            """One request, its answer refused before any of its body is read if it is
            compressed or says it is larger than ANSWER_MAX (a watch's stream is read by
            etcd3gw as it comes, whole per read: only this check stands before it). No
            compression is asked for, and etcd's gateway then sends none: an answer inflated
            from a few bytes is impossible on any urllib3 (1.26 inflates a whole read at once,
            and a stacked "gzip, gzip" over and over)."""
            kwargs["headers"] = {**dict(kwargs.get("headers") or {}), "Accept-Encoding": "identity"}
            r = super().request(method, url, **kwargs)
            encoding = str(r.headers.get("Content-Encoding", "identity")).strip().lower()
            promised = str(r.headers.get("Content-Length", "")).strip()
            if encoding not in ("", "identity"):
                r.close()
                raise AnswerEncoded(f"Content-Encoding {encoding[:40]!r}")
            if promised.isdigit() and int(promised) > ANSWER_MAX:
                r.close()
                raise AnswerTooLarge(f"over {ANSWER_MAX >> 20} MiB")
            return r

        def _send(self, method: Any, url: Any, kwargs: dict[str, Any]) -> Any:
            if login is None:
                return self._answer(method, url, **kwargs)
            if not self._shared.value:
                self.authenticate("")
            headers = dict(kwargs.pop("headers", None) or {})
            headers["Authorization"] = sent = self._shared.value
            r = self._answer(method, url, headers=headers, **kwargs)
            if r.status_code != 200 and r.status_code != 401:
                # read within the cap and the deadline before looking into it (unbounded, an
                # error answer dripped or huge held a watch for as long as its sender liked)
                r = _read_bounded(r, time.monotonic() + 2 * timeout)
            if r.status_code == 401 or (r.status_code != 200 and b"invalid auth token" in r.content[:1000]):
                self.authenticate(sent)
                headers["Authorization"] = self._shared.value
                r = self._answer(method, url, headers=headers, **kwargs)
            return r

    return EtcdSession()


def _read_bounded(r: Any, deadline: float) -> Any:
    """Read a streamed answer whole, or refuse it: over ANSWER_MAX decompressed (a 64 kB gzip
    answer inflates to 64 MiB), or still arriving at `deadline` (requests' timeout bounds each
    read, not the whole: one byte every timeout/2 goes on for ever). A blocking read cannot see
    the clock, so a timer closes the answer at the deadline and the read fails."""
    late = threading.Event()

    def expire() -> None:
        late.set()
        sock = getattr(getattr(r.raw, "connection", None), "sock", None)  # urllib3's connection
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read (a close would not)
        except OSError:
            pass
        r.close()

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), expire)
    timer.daemon = True
    timer.start()
    chunks, size = [], 0
    try:
        # 1 kB off the wire at a time: Debian 12's urllib3 (1.26) inflates each raw read whole,
        # so 64 kB of gzip became one 64 MiB chunk before the cap could look (141 MiB peak);
        # deflate inflates at most ~1,032:1, so a chunk is at most ~1 MiB here
        for chunk in r.iter_content(1024):
            size += len(chunk)
            if size > ANSWER_MAX:
                raise AnswerTooLarge(f"over {ANSWER_MAX >> 20} MiB")
            chunks.append(chunk)
    except Exception:
        r.close()
        if not late.is_set():
            raise
    finally:
        timer.cancel()
    if late.is_set():  # the read failed because the timer closed it, or ended just as it fired
        raise TimeoutError("the answer was still arriving at its deadline")
    promised = str(r.headers.get("Content-Length", "")).strip()
    if promised.isdigit() and r.raw.tell() < int(promised):  # bytes off the wire, before any decoding
        raise AnswerCutOff(f"{r.raw.tell()} of {promised} bytes")
    r._content = b"".join(chunks)
    r._content_consumed = True
    return r


def _message(r: Any) -> str:
    """etcd's reason for a refused login, cut (cluster/failures.py cleans it to one line)."""
    try:
        body = r.json()
        return str(body.get("error") or body.get("message") or r.text)[:200] if isinstance(body, dict) else r.text[:200]
    except Exception:  # noqa: BLE001 - not JSON, or JSON nested past the recursion limit
        return str(r.text)[:200]


@contextmanager
def _classified() -> Iterator[None]:
    """Whatever a request raised, as our typed error (cluster/failures.py): whoever answers on
    etcd's port chooses the exception, and none may leave the backend as it came."""
    try:
        yield
    except SupervisorError:
        raise  # ours already (a password file that cannot be read)
    except Exception as e:  # noqa: BLE001 - classified by type in cluster/failures.py
        raise failure(e) from None


class EtcdKV:
    """One etcd endpoint through its JSON gateway. Every failure leaves it classified, as one of
    cluster/dcs.py's ClusterUnavailable kinds (StoreUnreachable, StoreRefused, LeaseNotFound,
    NotTheStore), with the reason in our words; the store says where and while doing what."""

    def __init__(self, cfg: ClusterConfig) -> None:
        from etcd3gw.client import Etcd3Client  # only cluster work pays for requests and etcd3gw

        self.endpoint = cfg.etcd[0]
        url = urlsplit(self.endpoint)
        ca = checked(cfg.cacert, "cacert", secret=False) if cfg.cacert else None
        cert = checked(cfg.cert, "cert", secret=False) if cfg.cert else None
        key = checked(cfg.key, "key", secret=True) if cfg.key else None
        host = url.hostname or "127.0.0.1"
        base = f"{url.scheme}://{'[' + host + ']' if ':' in host else host}:{url.port or 2379}/v3/"
        login = (cfg.user, read_password(cfg.password_file or "")) if cfg.user else None
        token = _Token()

        def client() -> Any:
            made = Etcd3Client(host=host, port=url.port or 2379, protocol=url.scheme, timeout=ETCD_REQUEST_TIMEOUT_S,
                               api_path="/v3/")
            # every request and watch goes through client.session: set after construction, since
            # Debian 12's python3-etcd3gw (2.0.0) takes no session argument (2.7.0 does)
            made.session = _session(base, (ca, cert, key), login, ETCD_REQUEST_TIMEOUT_S, token)
            return made

        self._new_client = client
        self.client = client()
        self._watching = threading.local()

    def _lease(self, lease: int) -> Any:
        from etcd3gw.lease import Lease

        return Lease(lease, client=self.client) if lease else None

    def grant(self, ttl_s: int) -> int:
        with _classified():
            return int(self.client.lease(ttl_s).id)

    def refresh(self, lease: int) -> bool:
        with _classified():
            return int(self._lease(lease).refresh()) > 0

    def revoke(self, lease: int) -> None:
        with _classified():
            self._lease(lease).revoke()

    def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        with _classified():
            self.client.put(key, value, lease=self._lease(lease))

    def create(self, key: str, value: str | bytes, lease: int = 0) -> bool:
        with _classified():
            return bool(self.client.create(key, value, lease=self._lease(lease)))

    def range(self, key: str, prefix: bool = False) -> tuple[int, list[Entry]]:
        with _classified():
            return self._range(key, prefix)

    def _range(self, key: str, prefix: bool) -> tuple[int, list[Entry]]:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(key[:-1] + chr(ord(key[-1]) + 1))
        url = self.client.get_url("/kv/range")
        try:
            reply = self.client.post(url, json=body)
        except Exception as e:
            if not _broke_off(e):
                raise
            # a read may be repeated: one answer cut off in transit (seen under load over TLS)
            # must not fail a start that waits on its peers; a second failure is the answer
            reply = self.client.post(url, json=body)
        out = [Entry(_unb64(kv.get("key")).decode(errors="replace"), _unb64(kv.get("value", "")),
                     int(kv.get("lease", 0) or 0), int(kv.get("mod_revision", 0) or 0))
               for kv in reply.get("kvs", []) if isinstance(kv, dict)]
        return int(reply.get("header", {}).get("revision", 0)), out

    def delete_if(self, key: str, value: bytes | None = None, mod_revision: int | None = None) -> bool:
        with _classified():
            return self._delete_if(key, value, mod_revision)

    def _delete_if(self, key: str, value: bytes | None, mod_revision: int | None) -> bool:
        compare: list[dict[str, Any]] = []
        if value is not None:
            compare.append({"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)})
        if mod_revision is not None:
            compare.append({"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision})
        reply = self.client.transaction({"compare": compare, "success": [{"request_delete_range": {"key": _b64(key)}}],
                                         "failure": []})
        return bool(reply.get("succeeded", False))

    def watch_once(self, prefix: str, timeout: float, start_revision: int = 0) -> None:
        from etcd3gw.exceptions import WatchTimedOut

        with _classified():
            watcher = self._watch_client()
            try:
                if start_revision:
                    watcher.watch_prefix_once(prefix, timeout=timeout, start_revision=start_revision)
                else:
                    watcher.watch_prefix_once(prefix, timeout=timeout)
            except WatchTimedOut:
                pass

    def _watch_client(self) -> Any:
        """This thread's own client for watches. etcd3gw ends a watch by closing the connection
        adapter of the session it came through, which closes that session's connection pools:
        on the session the other threads use, a request entering a pool just then failed with
        urllib3's "Pool is closed" (a start waiting on its peers, and the lease keep-alive
        beside it, failed with "the connection failed" in the three-host test). A watch's
        session is used by no other thread, and only for watches."""
        made = getattr(self._watching, "client", None)
        if made is None:
            made = self._watching.client = self._new_client()
        return made


def _broke_off(e: BaseException) -> bool:
    """A request that failed in transit (refused, reset, its answer cut off), not one etcd
    or anyone answered: etcd3gw wraps requests' connection errors with no HTTP reason."""
    import requests
    from etcd3gw.exceptions import ConnectionFailedError

    if isinstance(e, AnswerCutOff):
        return True
    if "timed out" in str(getattr(e, "detail_text", "") or e):
        return False  # a silent etcd is waited for once: the caller's deadline is counted on that
    if isinstance(e, ConnectionFailedError):
        return not e.args  # with args, it is an answer: an HTTP 503 and its reason
    return isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError))
