"""Stand-in for `python -m sglang_router.launch_router` (sglang-router 0.3.2) or
`python -m smg.launch_router` (smg 1.13.0), whichever SUPERVISORD_GPU_STANDIN_ROUTER names.

Its command line is the played router's own option table (sglang/routers.py, read from that
router's parser: the table the loader checks profiles against, no second copy). Playing smg it
also does what smg does differently: process title `smg::router`; after SIGTERM the listener
stays open (and /readiness says 503 "draining") for its 5 s propagation window, then an idle
exit ~6.5 s after the signal; a DELETEd worker stays listed as "status": "draining" for about a
second, or until its requests in flight are done (no new ones reach it; a 202 is not "done";
a POST for its URL meanwhile is 409 "Worker already exists"); with --enable-rl, /v1/rl/...
(workers, engine calls fanned out to every worker) behind the control-plane key when one is
set, open to anyone when none is; a user key may read the worker list ("bearer" in any case).

Used only where the real router is not installed (it is a 31 MB wheel that does run on
CPU machines, and tests prefer it). It copies what a supervisor sees of the real one,
as observed running 0.3.2 against stand-in servers (shared/reference/sglang-router.md, and
re-checked 2026-12-01 for the points below):

* the command line: the played router's option names and value counts; unknown options exit 2.
  Stricter than the real parser on one point: abbreviations are rejected;
* its log: tracing's format with ANSI colours on stdout, even into a pipe or file:
  "\x1b[2m2026-12-01 08:47:14\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2msmg::server\x1b[0m\x1b[2m:\x1b[0m
  \x1b[2m/home/runner/work/sglang/sglang/src/server.rs\x1b[0m\x1b[2m:\x1b[0m\x1b[2m794:\x1b[0m message"
  (WARN in \x1b[33m, ERROR in \x1b[31m); every request it serves is logged ("started
  processing request", then "finished processing request" at INFO, a 4xx at WARN, a 5xx at
  ERROR);
* the Prometheus port is bound before anything is printed; busy: a Rust panic on stderr
  ("thread '<unnamed>' (TID) panicked at .../src/observability/metrics.rs:360:10:" /
  "failed to install Prometheus metrics exporter: FailedToCreateHTTPListener("Address already
  in use (os error 98)")", then pyo3's PanicException traceback), exit 1, and nothing on stdout.
  The HTTP port busy (after its start-up lines): "Error starting router: Address already in
  use (os error 98)" and a RuntimeError traceback on stderr, exit 1;
* `/health` and `/liveness` answer 200 "OK" as soon as the port listens (not readiness);
* workers: each is registered once its GET /health (timeout --health-check-timeout-secs)
  answers 200, retried with a linear backoff (1 s, 2 s, ... capped at 5 s); one not healthy
  within --worker-startup-timeout-secs is dropped for good. Registration reads /server_info
  and /model_info (falling back to the get_ forms) into the worker's metadata. After that
  they are checked every --health-check-interval-secs with the failure/success thresholds.
  Each worker is probed in its own thread: a /health costing seconds delays no other worker;
* `/readiness` is 503 {"status":"not ready","reason":"insufficient healthy workers"} until
  at least one registered worker is healthy (PD: one prefill and one decode), then 200
  {"status":"ready","healthy_workers":N,"total_workers":N}. Like the real router, a
  configured worker that has not come up yet is not counted at all: readiness does
  not mean every worker is up;
* `/workers`: GET lists registered workers; GET /workers/{id} one of them (400 for an id that
  is not a UUID, 404 {"error":"Worker <id> not found","code":"WORKER_NOT_FOUND"}); POST
  {"url":..., "worker_type": "prefill"|"decode" (anything else: regular, also in PD mode),
  "bootstrap_port": N} answers 202 {"status":"accepted","worker_id":...,"url":...,"location":
  "/workers/ID","message":"Worker addition queued for background processing"} (the same id for
  a URL it already has; 422 without "url", 400 for a body that is not JSON) and activates the
  worker once its /health answers 200; DELETE /workers/{id} answers 202 {"status":"accepted",
  "worker_id":ID,"message":"Worker removal queued for background processing"} and the worker is
  gone from routing and from GET /workers at once, while requests already sent to it complete;
* `--control-plane-api-keys ID:NAME:ROLE:KEY ...` (ROLE admin or user; anything else, or not
  four fields, is a ValueError traceback and exit 1): the worker API (every method on /workers
  and /workers/{id}) and /get_loads, /flush_cache then want `Authorization: Bearer KEY` of an
  admin key: without it, or with another scheme ("bearer" too), 401 "Missing or invalid
  Authorization header"; with a key it does not know, 401 "Invalid authentication token"
  (both text/plain with `WWW-Authenticate: Bearer realm="control-plane"`); with a user key, 403
  "Admin role required for control plane access". /health, /liveness, /readiness, /generate,
  /v1/*, /get_model_info and /get_server_info stay open;
* POST `/generate` (and the OpenAI routes) forwarded round-robin; in PD mode sent to a
  prefill and a decode with bootstrap_host/bootstrap_port/bootstrap_room added, answering
  with the decode reply;
* SIGTERM: "Received terminate signal, starting graceful shutdown", the listener closes at
  once, in-flight requests drain for at most --shutdown-grace-period-secs, exit 0.
  SIGINT kills it by signal 2, as with the real one. One process, no children.

Standard library only, so it starts in tens of milliseconds.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from ..records import dataclass, field
from typing import Any
from collections.abc import Sequence
from urllib.parse import urlsplit

from supervisord_gpu.sglang import routers
from supervisord_gpu.sglang.routers import RouterKind
from supervisord_gpu.rehearsal._http import (
    JSONHandler,
    SignalLatch,
    StandinHTTPServer,
    fetch,
    serve_in_thread,
    set_process_name,
)

REGISTRATION_BACKOFF_CAP_S = 5.0  # registration retries: 1 s, 2 s, 3 s, ... capped at 5 s
SRC = "/home/runner/work/sglang/sglang/src"  # where the wheel was built: its log lines name it
#: smg lists a DELETEd worker as "draining" (is_healthy false, no new requests) until the
#: requests it has complete, then drops it (observed: ~1 s with nothing in flight; 0.1 s after
#: the last of them with a 6 s request in flight)
SMG_DRAINING_S = 1.0


def played() -> RouterKind:
    """The router this stand-in plays: SUPERVISORD_GPU_STANDIN_ROUTER (a RouterKind name, which the
    rehearsal sets to the router production would run), sglang-router 0.3.2 when unset."""
    name = os.environ.get(routers.STANDIN_KIND_ENV, "")
    return routers.BY_NAME.get(name, routers.SGLANG_ROUTER)


def build_parser(kind: RouterKind | None = None) -> argparse.ArgumentParser:
    """The played router's command line, from its option table (sglang/routers.py: the same table
    the loader checks [router.options] against)."""
    return routers.build_parser(kind or played())


@dataclass
class Worker:
    """A worker as the router sees it: registered once healthy, then health-checked."""

    url: str
    worker_type: str  # regular, prefill, decode
    bootstrap_port: int | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    registered: bool = False
    dropped: bool = False
    removed: bool = False
    healthy: bool = False
    fails: int = 0
    successes: int = 0
    added_at: float = field(default_factory=time.monotonic)
    model_id: str = "unknown"
    metadata: dict[str, str] = field(default_factory=dict)
    load: int = 0
    #: smg: DELETEd, out of routing, still listed (status "draining") until it is gone
    draining: bool = False

    def describe(self, with_status: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id, "url": self.url, "model_id": self.model_id, "priority": 50, "cost": 1.0,
            "worker_type": self.worker_type, "is_healthy": self.healthy and not self.draining, "load": self.load,
            "connection_mode": "HTTP",
        }
        if with_status:  # smg's lifecycle field
            d["status"] = "draining" if self.draining else ("ready" if self.healthy else "pending")
        if self.worker_type == "prefill":
            d["bootstrap_port"] = self.bootstrap_port
        d["metadata"] = self.metadata
        d["disable_health_check"] = False
        return d


def _parse_prefill(values: list[str]) -> tuple[str, int | None]:
    url = values[0]
    if len(values) < 2 or values[1].lower() == "none":
        return url, None
    try:
        return url, int(values[1])
    except ValueError:
        raise ValueError(f"Invalid bootstrap port: {values[1]}. Must be a number or 'none'") from None


# --- output, as tracing-subscriber prints it (colours even into a pipe) -----------------

_DIM, _RESET = "\x1b[2m", "\x1b[0m"
_LEVELS = {"DEBUG": "\x1b[34mDEBUG", "INFO": "\x1b[32m INFO", "WARN": "\x1b[33m WARN", "ERROR": "\x1b[31mERROR"}
_print_lock = threading.Lock()


def _source(target: str) -> str:
    """The source file tracing names for a target: smg::core::worker_manager -> src/core/worker_manager.rs."""
    parts = target.split("::")[1:] or ["lib"]
    return f"{SRC}/{'/'.join(parts)}.rs"


def _emit(text: str) -> None:
    with _print_lock:
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


def log(level: str, target: str, message: str, line: int = 1) -> None:
    """A line shaped like the real router's, ANSI colours included."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    _emit(f"{_DIM}{stamp}{_RESET} {_LEVELS.get(level, _LEVELS['INFO'])}{_RESET} {_DIM}{target}{_RESET}{_DIM}:{_RESET} "
          f"{_DIM}{_source(target)}{_RESET}{_DIM}:{_RESET}{_DIM}{line}:{_RESET} {message}")


def _field(name: str, value: str) -> str:
    return f"\x1b[3m{name}{_RESET}{_DIM}={_RESET}{value}"


def log_request(method: str, uri: str, request_id: str, status: int | None = None, latency_us: int = 0) -> None:
    """The middleware's two lines per request: started, then finished (or failed)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    fields = [_field("method", method), _field("uri", uri), _field("version", "HTTP/1.1"),
              _field("module", '"smg"'), _field("request_id", f'"{request_id}"')]
    if status is None:
        level, target, line, message = "INFO", "smg::request", 310, "started processing request"
    else:
        fields += [_field("status_code", str(status)), _field("latency", str(latency_us))]
        if status >= 500:
            level, line, message = "ERROR", 349, "request failed with server error"
        elif status >= 400:
            level, line, message = "WARN", 354, "request failed with client error"
        else:
            level, line, message = "INFO", 359, "finished processing request"
        target = "smg::response"
    span = f"\x1b[1mhttp_request{_RESET}\x1b[1m{{{_RESET}{' '.join(fields)}\x1b[1m}}{_RESET}"
    _emit(f"{_DIM}{stamp}{_RESET} {_LEVELS[level]}{_RESET} {span}{_DIM}:{_RESET} {_DIM}{target}{_RESET}{_DIM}:{_RESET} "
          f"{_DIM}{SRC}/middleware.rs{_RESET}{_DIM}:{_RESET}{_DIM}{line}:{_RESET} {message}")


def _stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


_PY_FRAMES = (
    'Traceback (most recent call last):\n'
    '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '  File "<frozen runpy>", line 88, in _run_code\n'
    '  File "{pkg}/launch_router.py", line 109, in <module>\n'
    '    main()\n'
    '  File "{pkg}/launch_router.py", line 105, in main\n'
    '    launch_router(router_args)\n'
)


def _io_error(e: OSError) -> str:
    """How Rust's std::io::Error displays: "Address already in use (os error 98)"."""
    return f"{e.strerror or e} (os error {e.errno})" if e.errno else str(e)


def panic_prometheus(e: OSError) -> None:
    """The real router's panic when its Prometheus listener cannot be created (exit 1 follows)."""
    message = f'failed to install Prometheus metrics exporter: FailedToCreateHTTPListener("{_io_error(e)}")'
    text = (f"\nthread '<unnamed>' ({threading.get_native_id()}) panicked at {SRC}/observability/metrics.rs:360:10:\n"
            f"{message}\n")
    if os.environ.get("RUST_BACKTRACE", "0") not in ("", "0"):
        text += ("stack backtrace:\n   0: __rustc::rust_begin_unwind\n   1: core::panicking::panic_fmt\n"
                 "   2: core::result::unwrap_failed\n   3: smg::observability::metrics::start_prometheus\n"
                 "note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.\n")
    else:
        text += "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n"
    pkg = "sglang_router"
    text += (_PY_FRAMES.format(pkg=pkg)
             + f'  File "{pkg}/launch_router.py", line 48, in launch_router\n    router.start()\n'
             + f'  File "{pkg}/router.py", line 319, in start\n    self._router.start()\n'
             + f"pyo3_runtime.PanicException: {message}\n")
    _stderr(text)


def error_starting_router(e: OSError) -> None:
    """launch_router's `logger.error(f"Error starting router: {e}")` and the re-raised RuntimeError."""
    pkg = "sglang_router"
    _stderr(f"Error starting router: {_io_error(e)}\n"
            + _PY_FRAMES.format(pkg=pkg)
            + f'  File "{pkg}/launch_router.py", line 52, in launch_router\n    raise e\n'
            + f'  File "{pkg}/launch_router.py", line 48, in launch_router\n    router.start()\n'
            + f'  File "{pkg}/router.py", line 319, in start\n    self._router.start()\n'
            + f"RuntimeError: {_io_error(e)}\n")


def _policy_text(policy: str) -> str:
    return {"round_robin": "RoundRobin", "random": "Random", "manual": "Manual",
            "power_of_two": "PowerOfTwo { load_check_interval_secs: 5 }",
            "cache_aware": "CacheAware { cache_threshold: 0.3, balance_abs_threshold: 64, balance_rel_threshold: 1.5, "
                           "eviction_interval_secs: 120, max_tree_size: 67108864 }"}.get(policy, policy)


#: what the real router's auth middleware guards when control-plane keys are set (0.3.2, observed)
CONTROL_PLANE_PATHS = ("/workers", "/get_loads", "/flush_cache")
_MISSING_AUTH = "Missing or invalid Authorization header"
_BAD_TOKEN = "Invalid authentication token"
_NOT_ADMIN = "Admin role required for control plane access"
_SMG_NOT_ADMIN = "Admin role required for this control plane operation"


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    role: str  # admin or user
    key: str


def parse_control_plane_keys(entries: list[str] | None) -> list[ApiKey]:
    """RouterArgs._parse_control_plane_api_keys: 'id:name:role:key', split at the first three colons."""
    keys = []
    for entry in entries or []:
        parts = entry.split(":", 3)
        if len(parts) != 4:
            raise ValueError(f"Invalid API key format: '{entry}'. Expected 'id:name:role:key'")
        key_id, name, role, key = parts
        if role.lower() not in ("admin", "user"):
            raise ValueError(f"Invalid role: '{role}'. Must be 'admin' or 'user'")
        keys.append(ApiKey(key_id, name, role.lower(), key))
    return keys


#: smg --enable-rl: the RL control plane (worker discovery, pause, weight updates fanned out)
RL_PREFIX = "/v1/rl/"


def is_control_plane(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in CONTROL_PLANE_PATHS)


def authorize(keys: list[ApiKey], header: str | None, method: str = "POST",
              smg: bool = False) -> tuple[int, str, ApiKey | None]:
    """(0, "", key) when `header` carries a key allowed to do this; else the real router's status
    and text. smg 1.13.0 (observed): the scheme in any case ("bearer KEY" too), and a user key
    may read (GET /workers, /get_loads) while changes want an admin key, with another 403 text."""
    scheme = header[:7] if header is not None else ""
    if header is None or not (scheme.lower() == "bearer " if smg else scheme == "Bearer "):
        return 401, _MISSING_AUTH, None
    token = header[len("Bearer "):].encode()
    found = next((k for k in keys if hmac.compare_digest(k.key.encode(), token)), None)
    if found is None:
        return 401, _BAD_TOKEN, None
    if found.role != "admin" and not (smg and method == "GET"):
        return 403, _SMG_NOT_ADMIN if smg else _NOT_ADMIN, found
    return 0, "", found


class StandinRouter:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kind = played()
        self.keys = parse_control_plane_keys(args.control_plane_api_keys)
        #: smg's /v1/rl control plane (--enable-rl): behind the control-plane key only when one is set
        self.rl = bool(getattr(args, "enable_rl", False))
        self.draining = False  # smg, after SIGTERM: the propagation window
        self.pd = bool(args.pd_disaggregation)
        self.lock = threading.Lock()
        self.workers: list[Worker] = []
        self.rr: dict[str, int] = {"regular": 0, "prefill": 0, "decode": 0}
        self.stopping = threading.Event()
        self.requests_total = 0
        self.http: StandinHTTPServer | None = None
        self.prom: StandinHTTPServer | None = None
        if self.pd:
            for values in args.prefill or []:
                url, port = _parse_prefill(values)
                self.workers.append(Worker(url, "prefill", port))
            for (url,) in args.decode or []:
                self.workers.append(Worker(url, "decode"))
        else:
            for url in args.worker_urls or []:
                self.workers.append(Worker(url, "regular"))

    # -- lifecycle ----------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        set_process_name(self.kind.title)
        try:  # the metrics exporter is installed before the logger: a panic, nothing on stdout
            self.prom = StandinHTTPServer(a.prometheus_host, a.prometheus_port, _make_prom_handler(self))
        except OSError as e:
            panic_prometheus(e)
            return 1
        if self.pd:
            mode = (f"PrefillDecode {{ prefill_urls: {[(w.url, w.bootstrap_port) for w in self.workers if w.worker_type == 'prefill']}, "
                    f"decode_urls: {json.dumps([w.url for w in self.workers if w.worker_type == 'decode'])} }}")
        else:
            mode = f"Regular {{ worker_urls: {json.dumps([w.url for w in self.workers])} }}"
        log("INFO", "smg::server", f"Starting router on {a.host}:{a.port} | mode: {mode} | policy: "
            f"{_policy_text(a.policy)} | max_payload: 512MB | stand-in {self.kind.name} {self.kind.version}", 794)
        log("INFO", "smg::server", f"Initializing workers for routing mode: {mode}", 833)
        log("INFO", "smg::server", "Worker initialization job submitted (will complete in background)", 851)
        log("INFO", "smg::server", "Workers initialized: 0 total, 0 healthy", 875)
        log("INFO", "smg::server", f"Rate limiting is disabled (max_concurrent_requests = {a.max_concurrent_requests})", 907)
        log("INFO", "smg::server", "Router ready | workers: []", 985)
        if self.keys:
            log("INFO", "smg::auth::middleware", "Initializing control plane authentication...", 115)
            log("INFO", "smg::auth::middleware", f"Control plane API key authentication enabled ({len(self.keys)} keys)", 122)
        log("INFO", "smg::server", f"Starting server on {a.host}:{a.port}", 1018)
        try:
            self.http = StandinHTTPServer(a.host, a.port, _make_handler(self))
        except OSError as e:
            error_starting_router(e)
            return 1
        term = SignalLatch(signal.SIGTERM)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # like the real one: SIGINT ends it by signal 2
        serve_in_thread(self.http, "router-http")
        serve_in_thread(self.prom, "router-prometheus")
        for w in list(self.workers):
            self._start_worker_thread(w)
        term.wait()
        self.stopping.set()
        return self._shutdown()

    def _shutdown(self) -> int:
        log("INFO", "smg::server", "Received terminate signal, starting graceful shutdown", 1088)
        assert self.http is not None
        window = self.kind.stop_listen_s
        if window:  # smg: the port stays open (and served) while load balancers notice, then closes
            self.draining = True
            log("INFO", "smg::server", f"Beginning graceful shutdown: readiness draining in_flight="
                f"{self.http.inflight.count}", 2039)
            log("INFO", "smg::server", f"Keeping listener open during load-balancer propagation window "
                f"settle_secs={window:g}", 2045)
            time.sleep(window)
        self.http.shutdown()  # stop accepting...
        self.http.server_close()  # ...and close the listener: new connections are refused
        if not self.http.inflight.wait_idle(self.args.shutdown_grace_period_secs):
            log("WARN", "smg::server", "Graceful shutdown period elapsed; dropping in-flight requests", 1101)
        if self.prom is not None:
            self.prom.shutdown()
            self.prom.server_close()
        if window:  # smg's component clean-up: an idle one exits ~6.5 s after SIGTERM in all
            log("INFO", "smg::server", "HTTP server stopped. Starting component cleanup...", 2102)
            time.sleep(max(0.0, self.kind.stop_idle_exit_s - window))
            log("INFO", "smg::server", "Cleanup complete. Process exiting.", 2111)
            return 0
        log("INFO", "smg::server", "Server shutdown complete", 1110)
        return 0

    # -- workers ------------------------------------------------------------------------

    def add_worker(self, url: str, worker_type: str = "regular", bootstrap_port: int | None = None) -> Worker:
        """POST /workers: the worker it already has under that URL, or a new one being registered."""
        with self.lock:
            for w in self.workers:
                if w.url == url and not w.removed and not w.dropped:
                    return w
            w = Worker(url, worker_type, bootstrap_port)
            self.workers.append(w)
        self._start_worker_thread(w)
        return w

    def remove_worker(self, worker_id: str) -> Worker | None:
        """DELETE /workers/{id}: out of routing at once; in-flight requests finish. 0.3.2 drops it from
        the listing at once too; smg lists it as "draining" for a while (a 202 is not "done")."""
        with self.lock:
            w = next((x for x in self.workers if x.id == worker_id and x.registered and not x.dropped), None)
            if w is None:
                return None
            if self.kind.workers_async:
                if not w.draining:
                    w.draining = True
                    threading.Thread(target=self._drain, args=(w,), daemon=True).start()
                return w
            w.removed = True
            self.workers.remove(w)
        log("INFO", "smg::core::steps::worker::local::update_remaining_policies", f"Removed worker {w.url}", 56)
        return w

    def draining_at(self, url: str) -> Worker | None:
        with self.lock:
            return next((w for w in self.workers if w.url == url and w.draining and not w.removed), None)

    def _drain(self, w: Worker) -> None:
        """smg: out of routing now; dropped from the list once its requests are done (and ~1 s passed)."""
        began = time.monotonic()
        while w.load > 0 or time.monotonic() - began < SMG_DRAINING_S:
            if self.stopping.wait(0.05):
                return
        self._forget(w)

    def _forget(self, w: Worker) -> None:
        with self.lock:
            w.removed = True
            if w in self.workers:
                self.workers.remove(w)
        log("INFO", "smg::core::steps::worker::local::update_remaining_policies", f"Removed worker {w.url}", 56)

    def find(self, worker_id: str) -> Worker | None:
        with self.lock:
            return next((w for w in self.workers if w.id == worker_id and w.registered and not w.dropped), None)

    def _start_worker_thread(self, w: Worker) -> None:
        threading.Thread(target=self._worker_loop, args=(w,), name=f"worker-{w.id[:8]}", daemon=True).start()

    def _worker_loop(self, w: Worker) -> None:
        """Register one worker (linear backoff), then health-check it every interval."""
        a = self.args
        attempt = 0
        while not self.stopping.is_set() and not w.removed:
            attempt += 1
            ok, why = self._probe(w)
            if ok:
                self._register(w)
                break
            if time.monotonic() - w.added_at > a.worker_startup_timeout_secs:
                with self.lock:
                    w.dropped = True
                log("ERROR", "smg::core::worker_manager",
                    f"Worker {w.url} did not become healthy within {a.worker_startup_timeout_secs}s; dropped", 412)
                return
            delay = min(float(attempt), REGISTRATION_BACKOFF_CAP_S)
            log("WARN", "smg::workflow::event", f'Step failed step_id=detect_connection_mode error="Step failed: '
                f'detect_connection_mode - HTTP health check failed for {w.url}: {why}" will_retry=true', 233)
            log("INFO", "smg::workflow::event", f"Step retrying step_id=detect_connection_mode attempt={attempt + 1} "
                f"delay_ms={int(delay * 1000)}", 247)
            if self.stopping.wait(delay):
                return
        while not self.stopping.wait(max(0.05, float(a.health_check_interval_secs))):
            if w.removed:
                return
            ok, _ = self._probe(w)
            self._record(w, ok)

    def _probe(self, w: Worker) -> tuple[bool, str]:
        try:
            status, _, _ = fetch("GET", w.url.rstrip("/") + self.args.health_check_endpoint,
                                 timeout=float(self.args.health_check_timeout_secs))
            return status == 200, f"Health check failed: status {status}"
        except OSError as e:
            return False, f"Health check failed: error sending request for url ({w.url}{self.args.health_check_endpoint}): {e}"

    def _record(self, w: Worker, ok: bool) -> None:
        a = self.args
        became_unhealthy = False
        with self.lock:
            if ok:
                w.fails = 0
                w.successes += 1
                if not w.healthy and w.successes >= a.health_success_threshold:
                    w.healthy = True
            else:
                w.successes = 0
                w.fails += 1
                if w.healthy and w.fails >= a.health_failure_threshold:
                    w.healthy = False
                    became_unhealthy = True
        if became_unhealthy:
            log("WARN", "smg::core::worker", f"Worker {w.url} marked unhealthy", 321)

    def _get_json(self, url: str, *paths: str) -> dict[str, Any]:
        for path in paths:
            try:
                status, _, body = fetch("GET", url.rstrip("/") + path, timeout=float(self.args.health_check_timeout_secs))
                if status == 200:
                    info = json.loads(body)
                    return info if isinstance(info, dict) else {}
                if status != 404:
                    return {}
            except (OSError, ValueError):
                return {}
        return {}

    def _register(self, w: Worker) -> None:
        server = self._get_json(w.url, "/server_info", "/get_server_info")
        model = self._get_json(w.url, "/model_info", "/get_model_info")
        meta: dict[str, str] = {}
        for k in ("tp_size", "dp_size", "load_balance_method", "disaggregation_mode"):
            if server.get(k) is not None:
                meta[k] = str(server[k])
        for k in ("model_path", "served_model_name", "model_type"):
            if model.get(k) is not None:
                meta[k] = str(model[k])
        if model.get("architectures") is not None:
            meta["architectures"] = json.dumps(model["architectures"], separators=(",", ":"))
        with self.lock:
            if w.removed:
                return
            w.model_id = str(model.get("served_model_name") or model.get("model_path") or "unknown")
            w.metadata = meta
            w.registered = True
            w.healthy = True
            w.fails = w.successes = 0
        log("INFO", "smg::core::steps::worker::shared::activate", f"Activated 1 worker(s) (marked as healthy): {w.url}", 48)

    def healthy(self, worker_type: str) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.registered and w.healthy and not w.dropped and not w.draining
                    and w.worker_type == worker_type]

    def registered(self) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.registered and not w.dropped]

    def readiness(self) -> tuple[int, dict[str, Any]]:
        regs = self.registered()
        if self.draining:
            return 503, {"status": "not ready", "reason": "draining"}  # smg 1.13.0's words
        if self.pd:
            ok = bool(self.healthy("prefill")) and bool(self.healthy("decode"))
        else:
            ok = bool(self.healthy("regular"))
        if not ok:
            return 503, {"status": "not ready", "reason": "insufficient healthy workers"}
        n_healthy = sum(1 for w in regs if w.healthy)
        return 200, {"status": "ready", "healthy_workers": n_healthy, "total_workers": len(regs)}

    def pick(self, worker_type: str) -> Worker | None:
        pool = self.healthy(worker_type)
        if not pool:
            return None
        with self.lock:
            if self.args.policy == "random":
                return random.choice(pool)
            i = self.rr[worker_type] % len(pool)
            self.rr[worker_type] += 1
            return pool[i]

    # -- forwarding ---------------------------------------------------------------------

    def forward(self, path: str, raw: bytes) -> tuple[int, str, bytes]:
        """Send a POST to one worker (regular) or a prefill/decode pair (PD)."""
        with self.lock:
            self.requests_total += 1
        timeout = float(self.args.request_timeout_secs)
        no_workers = (503, "application/json", json.dumps({"error": {
            "type": "Service Unavailable", "code": "no_available_workers",
            "message": "No available workers (all circuits open or unhealthy)"}}).encode())
        if not self.pd:
            w = self.pick("regular")
            if w is None:
                return no_workers
            return self._send(w, path, raw, timeout)
        p, d = self.pick("prefill"), self.pick("decode")
        if p is None or d is None:
            return no_workers
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return 400, "application/json", b'{"error":{"message":"invalid JSON body"}}'
        host = urlsplit(p.url).hostname or "127.0.0.1"
        batch = isinstance(body.get("text"), list)
        n = len(body["text"]) if batch else 1
        rooms = [random.getrandbits(63) for _ in range(n)]
        body["bootstrap_host"] = [host] * n if batch else host
        body["bootstrap_port"] = [p.bootstrap_port] * n if batch else p.bootstrap_port
        body["bootstrap_room"] = rooms if batch else rooms[0]
        data = json.dumps(body).encode()
        prefill_result: list[tuple[int, str, bytes]] = []
        t = threading.Thread(target=lambda: prefill_result.append(self._send(p, path, data, timeout)), daemon=True)
        t.start()
        decode_result = self._send(d, path, data, timeout)
        t.join()
        if prefill_result and prefill_result[0][0] >= 400:
            return prefill_result[0]
        return decode_result

    def _send(self, w: Worker, path: str, data: bytes, timeout: float) -> tuple[int, str, bytes]:
        with self.lock:
            w.load += 1
        try:
            status, headers, body = fetch("POST", w.url.rstrip("/") + path, data, timeout=timeout)
            return status, headers.get("content-type", "application/json"), body
        except OSError as e:
            return 502, "application/json", json.dumps({"error": {
                "type": "Bad Gateway", "code": "worker_request_failed", "message": f"{w.url}: {e}"}}).encode()
        finally:
            with self.lock:
                w.load -= 1

    def proxy_get(self, path: str) -> tuple[int, str, bytes]:
        for kind in (("prefill", "decode") if self.pd else ("regular",)):
            pool = self.healthy(kind)
            if pool:
                try:
                    status, headers, body = fetch("GET", pool[0].url.rstrip("/") + path, timeout=5.0)
                    return status, headers.get("content-type", "application/json"), body
                except OSError:
                    break
        return 503, "application/json", json.dumps({"error": {
            "type": "Service Unavailable", "code": "no_workers", "message": "No workers are available"}}).encode()


def _request_id() -> str:
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "req-" + "".join(random.choice(chars) for _ in range(24))


def _make_handler(app: StandinRouter) -> type[JSONHandler]:
    class Handler(JSONHandler):
        status_sent = 0

        def send_response(self, code: int, message: str | None = None) -> None:
            self.status_sent = int(code)
            super().send_response(code, message)
            self.send_header("x-request-id", self.request_id)

        def _logged(self, handle: Any) -> None:
            self.request_id = _request_id()
            uri = self.path.split("?", 1)[0]
            log_request(self.command, uri, self.request_id)
            t0 = time.monotonic()
            try:
                guarded = is_control_plane(uri) or (app.rl and uri.startswith(RL_PREFIX))
                if not (app.keys and guarded and self._refused()):
                    handle()
            finally:
                log_request(self.command, uri, self.request_id, self.status_sent or 500,
                            int((time.monotonic() - t0) * 1e6))

        def _refused(self) -> bool:
            """The control plane's auth middleware: True after answering 401/403."""
            status, text, key = authorize(app.keys, self.headers.get("Authorization"), self.command,
                                          smg=app.kind is routers.SMG)
            if not status:
                return False
            if key is not None:
                log("WARN", "smg::auth::middleware", f"api_key {key.id} has role User but admin is required for "
                    "control plane access", 163)
            self.send_bytes(status, text.encode(), "text/plain; charset=utf-8",
                            headers={} if status == 403 else {"www-authenticate": 'Bearer realm="control-plane"'})
            return True

        def _worker_id(self, path: str) -> str | None:
            """The {id} of /workers/{id}, or None after answering 400 for one that is not a UUID."""
            worker_id = path[len("/workers/"):]
            try:
                uuid.UUID(worker_id)
            except ValueError:
                self.send_json(400, {"error": f"Invalid worker_id '{worker_id}' (expected UUID). Error: invalid "
                                              f"character: expected an optional prefix of `urn:uuid:` followed by "
                                              f"[0-9a-fA-F-]", "code": "BAD_REQUEST"})
                return None
            return worker_id

        def _not_found(self, worker_id: str) -> None:
            self.send_json(404, {"error": f"Worker {worker_id} not found", "code": "WORKER_NOT_FOUND"})

        def _workers_get(self) -> None:
            regs = app.registered()
            self.send_json(200, {"workers": [w.describe(app.kind.workers_async) for w in regs], "total": len(regs), "stats": {
                "prefill_count": sum(w.worker_type == "prefill" for w in regs),
                "decode_count": sum(w.worker_type == "decode" for w in regs),
                "regular_count": sum(w.worker_type == "regular" for w in regs)}})

        def _worker_get(self, path: str) -> None:
            worker_id = self._worker_id(path)
            if worker_id is None:
                return
            w = app.find(worker_id)
            if w is None:
                self._not_found(worker_id)
            else:
                self.send_json(200, w.describe(app.kind.workers_async))

        def _worker_delete(self, path: str) -> None:
            worker_id = self._worker_id(path)
            if worker_id is None:
                return
            if app.remove_worker(worker_id) is None:
                self._not_found(worker_id)
            else:
                self.send_json(202, {"status": "accepted", "worker_id": worker_id,
                                     "message": "Worker removal queued for background processing"})

        def _workers_post(self) -> None:
            raw = self.read_body()
            try:
                body = json.loads(raw or b"")
            except ValueError as e:
                self.send_text(400, f"Failed to parse the request body as JSON: {e}")
                return
            url = body.get("url") if isinstance(body, dict) else None
            if not isinstance(url, str):
                self.send_text(422, "Failed to deserialize the JSON body into the target type: missing field `url`")
                return
            kind = body.get("worker_type")
            kind = kind if kind in ("prefill", "decode") else "regular"
            port = body.get("bootstrap_port")
            leaving = app.draining_at(url)
            if leaving is not None:  # smg: a URL still draining is refused, not revived
                self.send_json(409, {"error": f"Worker already exists at URL '{url}' with ID {leaving.id}. Use PUT "
                                              f"/workers/{leaving.id} to update an existing worker.",
                                     "code": "WORKER_ALREADY_EXISTS"})
                return
            w = app.add_worker(url, kind, port if isinstance(port, int) else None)
            self.send_bytes(202, json.dumps({"status": "accepted", "worker_id": w.id, "url": url,
                                             "location": f"/workers/{w.id}",
                                             "message": "Worker addition queued for background processing"}).encode(),
                            headers={"location": f"/workers/{w.id}"})

        def _readiness(self) -> None:
            status, obj = app.readiness()
            self.send_json(status, obj)

        def _models(self) -> None:
            status, ctype, body = app.proxy_get("/v1/models")
            if status == 503:
                self.send_text(503, "No models available")
            else:
                self.send_bytes(status, body, ctype)

        def _proxy(self, path: str) -> None:
            status, ctype, body = app.proxy_get(path)
            self.send_bytes(status, body, ctype)

        def _forward(self) -> None:
            with self.server.inflight:
                raw = self.read_body()
                status, ctype, body = app.forward(self.path.split("?", 1)[0], raw)
                self.send_bytes(status, body, ctype)

        def _rl(self, path: str) -> None:
            """smg's /v1/rl: GET workers; POST engine/{call}?selector=... fanned out to every worker."""
            if self.command == "GET" and path == RL_PREFIX + "workers":
                regs = app.registered()
                self.send_json(200, {"protocol_version": 1, "workers": [
                    {"id": w.id, "url": w.url, "base_url": w.url, "engine": "sglang"} for w in regs]})
                return
            if self.command == "POST" and path.startswith(RL_PREFIX + "engine/"):
                if "selector=" not in self.path:
                    self.send_json(400, {"error": "selector_required",
                                         "message": "a non-empty `selector` query parameter is required"})
                    return
                raw = self.read_body()
                call = "/" + path[len(RL_PREFIX + "engine/"):]
                results: list[tuple[str, int]] = []
                for w in app.registered():
                    try:
                        status, _, _ = fetch("POST", w.url.rstrip("/") + call, raw, timeout=30.0)
                    except OSError:
                        status = 502
                    results.append((w.url, status))
                self.send_json(200, {"results": [{"url": u, "status": c} for u, c in results],
                                     "failed": [{"url": u, "status": c} for u, c in results if c >= 400]})
                return
            self.send_json(404, {"error": "not_found"})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if app.rl and path.startswith(RL_PREFIX):
                self._logged(lambda: self._rl(path))
                return
            if path.startswith("/workers/"):
                self._logged(lambda: self._worker_get(path))
                return
            self._logged(lambda: self.dispatch({
                "/health": lambda: self.send_text(200, "OK"),
                "/liveness": lambda: self.send_text(200, "OK"),
                "/readiness": self._readiness,
                "/workers": self._workers_get,
                "/v1/models": self._models,
                "/health_generate": lambda: self._proxy("/health_generate"),
                "/get_model_info": lambda: self._proxy("/model_info"),
                "/get_server_info": lambda: self.send_json(200, {
                    "router_manager": True, "routers_count": 1, "workers_count": len(app.registered())}),
            }))

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if app.rl and path.startswith(RL_PREFIX):
                self._logged(lambda: self._rl(path))
                return
            self._logged(lambda: self.dispatch({
                "/generate": self._forward,
                "/v1/completions": self._forward,
                "/v1/chat/completions": self._forward,
                "/workers": self._workers_post,
            }))

        def do_DELETE(self) -> None:
            path = self.path.split("?", 1)[0]
            if path.startswith("/workers/"):
                self._logged(lambda: self._worker_delete(path))
            else:
                self._logged(lambda: self.send_json(404, {"detail": "Not Found"}))

    return Handler


def _make_prom_handler(app: StandinRouter) -> type[JSONHandler]:
    class Handler(JSONHandler):
        def do_GET(self) -> None:
            regs = app.registered()
            text = (
                "# TYPE smg_router_requests_total counter\n"
                f'smg_router_requests_total{{router_type="http"}} {app.requests_total}\n'
                "# TYPE smg_worker_healthy gauge\n"
                + "".join(f'smg_worker_healthy{{url="{w.url}"}} {int(w.healthy)}\n' for w in regs)
            )
            self.send_text(200, text, "text/plain; version=0.0.4")

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        parse_control_plane_keys(args.control_plane_api_keys)
    except ValueError as e:  # raised in RouterArgs.from_cli_args, before launch_router's try: no "Error starting"
        _stderr('Traceback (most recent call last):\n  File "sglang_router/router_args.py", line 1041, in '
                f"_parse_control_plane_api_keys\nValueError: {e}\n")
        return 1
    try:
        router = StandinRouter(args)
    except ValueError as e:
        _stderr(f"Error starting router: {e}\n")
        return 1
    return router.run()


if __name__ == "__main__":
    sys.exit(main())
