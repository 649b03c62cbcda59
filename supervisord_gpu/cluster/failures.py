"""Why a request to etcd failed, in our words: the etcd backend's own classification of its failures.

cluster/etcd.py calls `failure(e)` on whatever a request raised, and raises the typed error it
gets (cluster/dcs.py: StoreUnreachable, StoreRefused, LeaseNotFound, NotTheStore); nothing
outside the backend reads a library's exception types or an error's text. The types are told
apart with isinstance against the libraries' own classes (etcd3gw, requests, urllib3) and ours.

Before, every exception from a store call became "etcd ... cannot be reached: <the library's
text>". requests' text is a paragraph of connection-pool internals, and etcd's own error text
is written by whoever answers on that port (the hostile read of #23).

So a failure is classified by its type:

* out of reach (exit 4, retried): no connection, no answer in time, the TLS handshake failed,
  the name does not resolve. Said as "cannot be reached: connection refused" and the like.
* answered with an error (exit 4 too: an operator fixes a password or a role, and the next
  retry works): etcd answered, and said no (a refused login, permission denied, an HTTP error).
* not etcd (exit 4): something answered on the port, but not as etcd's JSON gateway does;
  also any other exception raised while a request is under way. The answer is parsed by etcd3gw
  and by cluster/etcd.py, so a null where a number belongs is a TypeError, bad base64 a
  binascii.Error, 100,000 nested brackets a RecursionError: whoever answers chooses the type,
  and none of them may crash an agent or leave a stop half done. What is ours alone (turning
  our records into JSON) is done before the request, outside the classification, so a bug
  there stays a bug.

Every text that reaches a message is cut to one printable line; etcd's own error text is kept
(it is what says "permission denied"), cleaned that way.
"""

from __future__ import annotations

import json
import re

from .dcs import ClusterUnavailable, LeaseNotFound, NotTheStore, StoreRefused, StoreUnreachable

#: the errno texts worth naming as they are (socket errors under requests' wrapping)
_ERRNO = re.compile(r"\[Errno -?\d+\] ([A-Za-z][A-Za-z ,-]{2,60})")
_SSL = re.compile(r"\[SSL: ([A-Z0-9_]{3,60})\]")
_KIND = re.compile(r"\b([A-Z][A-Za-z]{2,40}(?:Error|Exception))\b")
_CUT = ("IncompleteRead", "Connection broken", "ended prematurely")  # an answer begun, then gone
_NAME = ("Name or service not known", "Temporary failure in name resolution", "No address associated")
#: etcd's own words for a write bound to a lease it does not know (expired or revoked)
_NO_LEASE = "requested lease not found"

UNREACHABLE = StoreUnreachable.verdict
ANSWERED = StoreRefused.verdict
NOT_ETCD = NotTheStore.verdict
_KINDS: dict[str, type[ClusterUnavailable]] = {UNREACHABLE: StoreUnreachable, ANSWERED: StoreRefused,
                                               NOT_ETCD: NotTheStore}


class AnswerTooLarge(Exception):
    """An answer over cluster/etcd.py's ANSWER_MAX: not etcd's."""


class AnswerEncoded(Exception):
    """A compressed answer, though we ask for none: not etcd's."""


class AnswerCutOff(Exception):
    """An answer that ended before its Content-Length: the connection went in mid-answer.
    urllib3 2 says so itself; Debian 12's urllib3 1.26 hands over the short body as if whole."""


def clean(text: object, limit: int = 120) -> str:
    """One printable line of at most `limit` characters, from anyone's text."""
    line = "".join(ch if ch.isprintable() else " " for ch in str(text).replace("\n", " "))
    line = " ".join(line.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _etcd_error(detail: object) -> str:
    """The "error" of etcd's JSON error body ({"error": "etcdserver: permission denied", ...})."""
    try:
        body = json.loads(str(detail)[:4096])
    except Exception:  # noqa: BLE001 - ValueError, RecursionError: whoever answered wrote it
        return ""
    if isinstance(body, dict):
        for field in ("error", "message"):
            if isinstance(body.get(field), str):
                return clean(body[field])
    return ""


def _connection(text: str) -> str:
    ssl = _SSL.search(text)
    if ssl:
        return "TLS: " + ssl.group(1).lower().replace("_", " ")
    if "certificate" in text.lower() or "ssl" in text.lower():
        return "TLS handshake failed"
    if any(n in text for n in _NAME):
        return "its host name does not resolve"
    m = _ERRNO.search(text)
    if m:
        return m.group(1).strip().lower()
    if any(n in text for n in _CUT):
        return "its answer was cut off"
    if "RemoteDisconnected" in text or "Connection aborted" in text or "reset" in text.lower():
        return "the connection was closed by the other end"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "no answer in time"
    kinds = _KIND.findall(text)  # the library's own error class names, the innermost last
    return f"the connection failed ({kinds[-1]})" if kinds else "the connection failed"


def failure(e: BaseException) -> ClusterUnavailable:
    """The typed error for a failed request to etcd, its reason said, not yet where (the store
    adds which endpoint and what it was doing)."""
    verdict, reason = classify(e)
    kind = _KINDS[verdict]
    if kind is StoreRefused and _NO_LEASE in reason:
        kind = LeaseNotFound
    return kind.because(reason)


def classify(e: BaseException) -> tuple[str, str]:
    """(verdict, reason) for a failure of a request to etcd (see the module docstring)."""
    import requests
    import urllib3
    from etcd3gw import exceptions as gateway

    name = type(e).__name__
    if isinstance(e, PermissionError):  # our own login refusal (cluster/etcd.py)
        return ANSWERED, clean(e)
    if isinstance(e, gateway.Etcd3Exception):
        status = clean(" ".join(str(a) for a in e.args), 60)
        detail = str(getattr(e, "detail_text", "") or "")
        timeout = isinstance(e, gateway.ConnectionTimeoutError)
        if isinstance(e, (gateway.ConnectionTimeoutError, gateway.ConnectionFailedError)):
            if status:
                # etcd3gw raises these for an HTTP 408/503/504 too (the reason phrase in args): an
                # answer, whose body is the answerer's text, never read as requests' own words
                return ANSWERED, _etcd_error(detail) or f"HTTP {status}"
            return UNREACHABLE, "no answer in time" if timeout else _connection(detail or str(e))
        said = _etcd_error(detail)
        if said:
            return ANSWERED, said
        if detail.strip():  # a body, but not etcd's JSON: a web server, a proxy, a stranger
            return NOT_ETCD, f"an HTTP error that is not etcd's ({status or name})"
        return ANSWERED, status or name
    if isinstance(e, (requests.exceptions.RequestException, urllib3.exceptions.HTTPError)):
        if isinstance(e, (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError)):
            return UNREACHABLE, "no answer in time"
        if isinstance(e, requests.exceptions.InvalidJSONError):
            return NOT_ETCD, "its answer is not JSON"
        return UNREACHABLE, _connection(str(e))
    if isinstance(e, AnswerCutOff):  # cluster/etcd.py's length check
        return UNREACHABLE, "its answer was cut off"
    if isinstance(e, AnswerEncoded):  # cluster/etcd.py: we ask for no compression
        return NOT_ETCD, "its answer is compressed, though none was asked for"
    if isinstance(e, AnswerTooLarge):  # cluster/etcd.py's size cap
        return NOT_ETCD, f"its answer is {clean(e, 40)}"
    if isinstance(e, TimeoutError):
        return UNREACHABLE, "no answer in time"
    if isinstance(e, ConnectionError):
        return UNREACHABLE, clean(e.strerror or e, 60).lower()
    return NOT_ETCD, f"its answer does not fit ({name})"
