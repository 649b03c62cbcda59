"""Why a request to etcd failed, in our words: what the store says instead of a library's text.

Before, every exception from a store call became "etcd ... cannot be reached: <the library's
text>". Two things were wrong with that (the hostile read of #23): requests' text is a
paragraph of connection-pool internals (and etcd's own error text is written by whoever answers
on that port), and a bug of ours inside a store call (a TypeError in our own code) was reported
as etcd being away, exit 4, retried for ever.

So a failure is classified by its type:

* out of reach (exit 4, retried): no connection, no answer in time, the TLS handshake failed,
  the name does not resolve. Said as "cannot be reached: connection refused" and the like.
* answered with an error (exit 4 too: an operator fixes a password or a role, and the next
  retry works): etcd answered, and said no (a refused login, permission denied, an HTTP error).
* not etcd (exit 4): something answered on the port, but not as etcd's JSON gateway does.
* anything else is a bug and stays one: `classify` returns None and the caller re-raises it.

Every text that reaches a message is cut to one printable line; etcd's own error text is kept
(it is what says "permission denied"), cleaned that way.
"""

from __future__ import annotations

import json
import re

#: the errno texts worth naming as they are (socket errors under requests' wrapping)
_ERRNO = re.compile(r"\[Errno -?\d+\] ([A-Za-z][A-Za-z ,-]{2,60})")
_SSL = re.compile(r"\[SSL: ([A-Z0-9_]{3,60})\]")
_NAME = ("Name or service not known", "Temporary failure in name resolution", "No address associated")

UNREACHABLE = "cannot be reached"
ANSWERED = "answered with an error"
NOT_ETCD = "did not answer as etcd"


def clean(text: object, limit: int = 120) -> str:
    """One printable line of at most `limit` characters, from anyone's text."""
    line = "".join(ch if ch.isprintable() else " " for ch in str(text).replace("\n", " "))
    line = " ".join(line.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _etcd_error(detail: object) -> str:
    """The "error" of etcd's JSON error body ({"error": "etcdserver: permission denied", ...})."""
    try:
        body = json.loads(str(detail)[:4096])
    except ValueError:
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
    if "RemoteDisconnected" in text or "Connection aborted" in text or "reset" in text.lower():
        return "the connection was closed by the other end"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "no answer in time"
    return "the connection failed"


def classify(e: BaseException) -> tuple[str, str] | None:
    """(verdict, reason) for a failure of a request to etcd, or None for one that is a bug."""
    name = type(e).__name__
    module = type(e).__module__ or ""
    if isinstance(e, PermissionError):  # our own login refusal (cluster/etcd.py)
        return ANSWERED, clean(e)
    if module.startswith("etcd3gw"):
        if name == "ConnectionTimeoutError":
            return UNREACHABLE, "no answer in time"
        if name == "ConnectionFailedError":
            return UNREACHABLE, _connection(str(getattr(e, "detail_text", "") or e))
        detail = str(getattr(e, "detail_text", "") or "")
        said = _etcd_error(detail)
        if said:
            return ANSWERED, said
        status = clean(" ".join(str(a) for a in e.args), 60) or name
        if detail.strip():  # a body, but not etcd's JSON: a web server, a proxy, a stranger
            return NOT_ETCD, f"an HTTP error that is not etcd's ({status})"
        return ANSWERED, status
    if module.startswith(("requests", "urllib3")):
        if "Timeout" in name:
            return UNREACHABLE, "no answer in time"
        if "JSON" in name:
            return NOT_ETCD, "its answer is not JSON"
        return UNREACHABLE, _connection(str(e))
    if isinstance(e, TimeoutError):
        return UNREACHABLE, "no answer in time"
    if isinstance(e, ConnectionError):
        return UNREACHABLE, clean(e.strerror or e, 60).lower() if isinstance(e, OSError) else "the connection failed"
    if isinstance(e, LookupError) and "etcdserver:" in str(e):  # the in-memory KV speaks etcd's words
        return ANSWERED, clean(e)
    if isinstance(e, (ValueError, KeyError, TypeError, IndexError, AttributeError)) and _from_the_answer(e):
        return NOT_ETCD, f"its answer does not fit ({name})"
    return None


def _from_the_answer(e: BaseException) -> bool:
    """Raised while reading an answer: json's decoder, or our parse of the gateway's reply in
    cluster/etcd.py, or etcd3gw's own. A TypeError raised anywhere else is ours: a bug."""
    tb = e.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    innermost = frames[-1] if frames else ""
    if isinstance(e, TypeError) and "argument" in str(e):  # a call that does not fit its API: ours
        return False
    return any(part in innermost for part in ("/json/", "/etcd3gw/", "/cluster/etcd.py", "/requests/models.py"))
