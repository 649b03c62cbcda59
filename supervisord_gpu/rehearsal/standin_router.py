"""Stand-in for `python -m sglang_router.launch_router` (sglang-router 0.3.2).

Used only where the real router is not installed (it is a 31 MB wheel that does run on
CPU machines, and tests prefer it). It copies what a supervisor sees of the real one,
as observed running 0.3.2 against stand-in servers:

* the command line: the 0.3.2 option names and value counts; unknown options exit 2.
  Stricter than the real parser on one point: abbreviations are rejected;
* `/health` and `/liveness` answer 200 "OK" as soon as the port listens (not readiness);
* workers are registered once they first answer GET /health 200 (polled every 0.5 s;
  one not healthy within --worker-startup-timeout-secs is dropped for good); after that
  they are checked every --health-check-interval-secs with the failure/success
  thresholds;
* `/readiness` is 503 {"status":"not ready","reason":"insufficient healthy workers"} until
  at least one registered worker is healthy (PD: one prefill and one decode), then 200
  {"status":"ready","healthy_workers":N,"total_workers":N}. Like the real router, a
  configured worker that has not come up yet is not counted at all: readiness does
  not mean every worker is up;
* `/workers` (GET lists, POST {"url":...} adds, 202), POST `/generate` (and the OpenAI
  routes) forwarded round-robin; in PD mode sent to a prefill and a decode with
  bootstrap_host/bootstrap_port/bootstrap_room added, answering with the decode reply;
* SIGTERM: "Received terminate signal, starting graceful shutdown", the listener closes at
  once, in-flight requests drain for at most --shutdown-grace-period-secs, exit 0.
  SIGINT kills it by signal 2, as with the real one. One process, no children.

Standard library only, so it starts in tens of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence
from urllib.parse import urlsplit

from supervisord_gpu.rehearsal._http import (
    JSONHandler,
    SignalLatch,
    StandinHTTPServer,
    bind_or_exit,
    fetch,
    serve_in_thread,
    set_process_name,
)

ROUTER_VERSION = "0.3.2"
POLICIES = ["random", "round_robin", "cache_aware", "power_of_two", "manual"]
STARTUP_POLL_S = 0.5

# sglang-router 0.3.2's options (read from its RouterArgs.add_cli_args): name -> kind.
# Kinds: "str"/"int"/"float" one value, "flag" no value, "*"/"+" lists of strings.
_OPTIONS: dict[str, str] = {
    "--host": "str", "--port": "int", "--worker-urls": "*", "--policy": "str",
    "--prefill-policy": "str", "--decode-policy": "str", "--cache-threshold": "float",
    "--balance-abs-threshold": "int", "--balance-rel-threshold": "float",
    "--bucket-adjust-interval-secs": "int", "--eviction-interval-secs": "int",
    "--max-tree-size": "int", "--max-idle-secs": "int", "--assignment-mode": "str",
    "--max-payload-size": "int", "--dp-aware": "flag", "--enable-igw": "flag", "--mini-lb": "flag",
    "--pd-disaggregation": "flag", "--worker-startup-timeout-secs": "int",
    "--worker-startup-check-interval": "int", "--log-dir": "str", "--log-level": "str",
    "--service-discovery": "flag", "--selector": "+", "--service-discovery-port": "int",
    "--service-discovery-namespace": "str", "--prefill-selector": "+", "--decode-selector": "+",
    "--prometheus-port": "int", "--prometheus-host": "str", "--prometheus-duration-buckets": "+",
    "--request-id-headers": "*", "--request-timeout-secs": "int", "--shutdown-grace-period-secs": "int",
    "--cors-allowed-origins": "*", "--max-concurrent-requests": "int", "--queue-size": "int",
    "--queue-timeout-secs": "int", "--rate-limit-tokens-per-second": "int", "--retry-max-retries": "int",
    "--retry-initial-backoff-ms": "int", "--retry-max-backoff-ms": "int",
    "--retry-backoff-multiplier": "float", "--retry-jitter-factor": "float", "--disable-retries": "flag",
    "--cb-failure-threshold": "int", "--cb-success-threshold": "int", "--cb-timeout-duration-secs": "int",
    "--cb-window-duration-secs": "int", "--disable-circuit-breaker": "flag",
    "--health-failure-threshold": "int", "--health-success-threshold": "int",
    "--health-check-timeout-secs": "int", "--health-check-interval-secs": "int",
    "--health-check-endpoint": "str", "--disable-health-check": "flag", "--model-path": "str",
    "--tokenizer-path": "str", "--chat-template": "str", "--tokenizer-cache-enable-l0": "flag",
    "--tokenizer-cache-l0-max-entries": "int", "--tokenizer-cache-enable-l1": "flag",
    "--tokenizer-cache-l1-max-memory": "int", "--reasoning-parser": "str", "--tool-call-parser": "str",
    "--mcp-config-path": "str", "--backend": "str", "--history-backend": "str",
    "--oracle-wallet-path": "str", "--oracle-tns-alias": "str", "--oracle-connect-descriptor": "str",
    "--oracle-username": "str", "--oracle-password": "str", "--oracle-pool-min": "int",
    "--oracle-pool-max": "int", "--oracle-pool-timeout-secs": "int", "--postgres-db-url": "str",
    "--postgres-pool-max": "int", "--redis-url": "str", "--redis-pool-max": "int",
    "--redis-retention-days": "int", "--client-cert-path": "str", "--client-key-path": "str",
    "--ca-cert-paths": "*", "--tls-cert-path": "str", "--tls-key-path": "str", "--enable-trace": "flag",
    "--otlp-traces-endpoint": "str", "--api-key": "str", "--control-plane-api-keys": "*",
    "--control-plane-audit-enabled": "flag", "--jwt-issuer": "str", "--jwt-audience": "str",
    "--jwt-jwks-uri": "str", "--jwt-role-mapping": "*",
}
_DEFAULTS: dict[str, Any] = {
    "--host": "0.0.0.0", "--port": 30000, "--worker-urls": [], "--policy": "cache_aware",
    "--worker-startup-timeout-secs": 1800, "--worker-startup-check-interval": 30, "--log-level": "info",
    "--prometheus-port": 29000, "--prometheus-host": "0.0.0.0", "--request-timeout-secs": 1800,
    "--shutdown-grace-period-secs": 180, "--health-failure-threshold": 3, "--health-success-threshold": 2,
    "--health-check-timeout-secs": 5, "--health-check-interval-secs": 60, "--health-check-endpoint": "/health",
    "--max-concurrent-requests": -1, "--backend": "sglang", "--history-backend": "memory",
}
_CHOICES: dict[str, list[str]] = {
    "--policy": POLICIES, "--prefill-policy": POLICIES + ["bucket"], "--decode-policy": POLICIES,
    "--log-level": ["debug", "info", "warn", "error"], "--assignment-mode": ["random", "min_load", "min_group"],
    "--backend": ["sglang", "openai"], "--history-backend": ["memory", "none", "oracle", "postgres", "redis"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch_router.py", allow_abbrev=False,
        description="Stand-in for `python -m sglang_router.launch_router` 0.3.2 (supervisord-gpu rehearsal).",
    )
    types = {"int": int, "float": float, "str": str}
    for name, kind in _OPTIONS.items():
        dest = name[2:].replace("-", "_")
        if kind == "flag":
            parser.add_argument(name, dest=dest, action="store_true", default=False)
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": _DEFAULTS.get(name)}
        if kind in ("*", "+"):
            kwargs["nargs"] = kind
            kwargs["type"] = float if name == "--prometheus-duration-buckets" else str
        else:
            kwargs["type"] = types[kind]
        if name in _CHOICES:
            kwargs["choices"] = _CHOICES[name]
        parser.add_argument(name, **kwargs)
    # --prefill URL [BOOTSTRAP_PORT|none] and --decode URL, each repeatable.
    parser.add_argument("--prefill", dest="prefill", nargs="+", action="append", default=None)
    parser.add_argument("--decode", dest="decode", nargs=1, action="append", default=None)
    return parser


@dataclass
class Worker:
    """A worker as the router sees it: registered once healthy, then health-checked."""

    url: str
    worker_type: str  # regular, prefill, decode
    bootstrap_port: int | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    registered: bool = False
    dropped: bool = False
    healthy: bool = False
    fails: int = 0
    successes: int = 0
    added_at: float = field(default_factory=time.monotonic)
    next_check: float = 0.0
    model_id: str = "unknown"
    metadata: dict[str, str] = field(default_factory=dict)
    load: int = 0

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id, "url": self.url, "model_id": self.model_id, "priority": 50, "cost": 1.0,
            "worker_type": self.worker_type, "is_healthy": self.healthy, "load": self.load,
            "connection_mode": "HTTP",
        }
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


def log(level: str, target: str, message: str) -> None:
    """A line shaped like the real router's (without its ANSI colours)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        sys.stdout.write(f"{stamp} {level:>5} {target}: {message}\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


class StandinRouter:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
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
        set_process_name("sglang::router")
        mode = (f"PrefillDecode {{ prefill_urls: {[(w.url, w.bootstrap_port) for w in self.workers if w.worker_type == 'prefill']}, "
                f"decode_urls: {[w.url for w in self.workers if w.worker_type == 'decode']} }}"
                if self.pd else f"Regular {{ worker_urls: {[w.url for w in self.workers]} }}")
        log("INFO", "smg::server", f"Starting router on {a.host}:{a.port} | mode: {mode} | policy: {a.policy} "
            f"| stand-in sglang-router {ROUTER_VERSION}")
        self.http = bind_or_exit(a.host, a.port, _make_handler(self), "router")
        try:
            self.prom = StandinHTTPServer(a.prometheus_host, a.prometheus_port, _make_prom_handler(self))
        except OSError as e:
            log("ERROR", "smg::metrics", f"Failed to start Prometheus exporter on "
                f"{a.prometheus_host}:{a.prometheus_port}: {e.strerror or e}")
        term = SignalLatch(signal.SIGTERM)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # like the real one: SIGINT ends it by signal 2
        serve_in_thread(self.http, "router-http")
        if self.prom is not None:
            serve_in_thread(self.prom, "router-prometheus")
        threading.Thread(target=self._health_loop, name="health", daemon=True).start()
        log("INFO", "smg::server", f"Starting server on {a.host}:{a.port}")
        term.wait()
        self.stopping.set()
        return self._shutdown()

    def _shutdown(self) -> int:
        log("INFO", "smg::server", "Received terminate signal, starting graceful shutdown")
        assert self.http is not None
        self.http.shutdown()  # stop accepting...
        self.http.server_close()  # ...and close the listener: new connections are refused
        if not self.http.inflight.wait_idle(self.args.shutdown_grace_period_secs):
            log("WARN", "smg::server", "Graceful shutdown period elapsed; dropping in-flight requests")
        if self.prom is not None:
            self.prom.shutdown()
            self.prom.server_close()
        log("INFO", "smg::server", "Server shutdown complete")
        return 0

    # -- workers ------------------------------------------------------------------------

    def add_worker(self, url: str, worker_type: str = "regular", bootstrap_port: int | None = None) -> Worker:
        w = Worker(url, worker_type, bootstrap_port)
        with self.lock:
            self.workers.append(w)
        return w

    def _health_loop(self) -> None:
        a = self.args
        while not self.stopping.is_set():
            now = time.monotonic()
            with self.lock:
                due = [w for w in self.workers if not w.dropped and w.next_check <= now]
            for w in due:
                ok = self._probe(w)
                self._record(w, ok, time.monotonic())
            self.stopping.wait(min(STARTUP_POLL_S, max(0.05, a.health_check_interval_secs)))

    def _probe(self, w: Worker) -> bool:
        try:
            status, _, _ = fetch("GET", w.url.rstrip("/") + self.args.health_check_endpoint,
                                 timeout=float(self.args.health_check_timeout_secs))
            return status == 200
        except OSError:
            return False

    def _record(self, w: Worker, ok: bool, now: float) -> None:
        a = self.args
        if not w.registered:
            if ok:
                self._register(w)
                w.next_check = now + a.health_check_interval_secs
            elif now - w.added_at > a.worker_startup_timeout_secs:
                w.dropped = True
                log("ERROR", "smg::core::worker_manager",
                    f"Worker {w.url} did not become healthy within {a.worker_startup_timeout_secs}s; dropped")
            else:
                w.next_check = now + STARTUP_POLL_S
            return
        w.next_check = now + a.health_check_interval_secs
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
                    log("WARN", "smg::core::worker", f"Worker {w.url} marked unhealthy")

    def _register(self, w: Worker) -> None:
        try:
            status, _, body = fetch("GET", w.url.rstrip("/") + "/model_info", timeout=5.0)
            info = json.loads(body) if status == 200 else {}
        except (OSError, ValueError):
            info = {}
        with self.lock:
            w.model_id = str(info.get("served_model_name") or info.get("model_path") or "unknown")
            w.metadata = {k: str(v) for k, v in info.items()
                          if k in ("model_path", "served_model_name", "model_type", "disaggregation_mode")}
            w.registered = True
            w.healthy = True
            w.fails = w.successes = 0
        log("INFO", "smg::core::steps::worker::shared::activate", f"Activated 1 worker(s) (marked as healthy): {w.url}")

    def healthy(self, worker_type: str) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.registered and w.healthy and not w.dropped
                    and w.worker_type == worker_type]

    def registered(self) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.registered and not w.dropped]

    def readiness(self) -> tuple[int, dict[str, Any]]:
        regs = self.registered()
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


def _make_handler(app: StandinRouter) -> type[JSONHandler]:
    class Handler(JSONHandler):
        def _workers_get(self) -> None:
            regs = app.registered()
            self.send_json(200, {"workers": [w.describe() for w in regs], "total": len(regs), "stats": {
                "prefill_count": sum(w.worker_type == "prefill" for w in regs),
                "decode_count": sum(w.worker_type == "decode" for w in regs),
                "regular_count": sum(w.worker_type == "regular" for w in regs)}})

        def _workers_post(self) -> None:
            try:
                body = self.read_json()
                url = body["url"]
            except (ValueError, KeyError, TypeError):
                self.send_json(400, {"error": {"message": "expected a JSON body with 'url'"}})
                return
            kind = body.get("worker_type") or ("decode" if app.pd else "regular")
            w = app.add_worker(url, kind, body.get("bootstrap_port"))
            self.send_json(202, {"status": "accepted", "worker_id": w.id, "url": url,
                                 "location": f"/workers/{w.id}", "message": "Worker addition queued"})

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

        def do_GET(self) -> None:
            self.dispatch({
                "/health": lambda: self.send_text(200, "OK"),
                "/liveness": lambda: self.send_text(200, "OK"),
                "/readiness": self._readiness,
                "/workers": self._workers_get,
                "/v1/models": self._models,
                "/health_generate": lambda: self._proxy("/health_generate"),
                "/get_model_info": lambda: self._proxy("/model_info"),
                "/get_server_info": lambda: self.send_json(200, {
                    "router_manager": True, "routers_count": 1, "workers_count": len(app.registered())}),
            })

        def do_POST(self) -> None:
            self.dispatch({
                "/generate": self._forward,
                "/v1/completions": self._forward,
                "/v1/chat/completions": self._forward,
                "/workers": self._workers_post,
            })

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
        router = StandinRouter(args)
    except ValueError as e:
        log("ERROR", "router", f"Error starting router: {e}")
        return 1
    return router.run()


if __name__ == "__main__":
    sys.exit(main())
