"""Prometheus metrics for one instance: its states, durations, restarts, refusals, and the GPUs.

The engine knows nothing of this module. The exporter is one more listener on the instance's
events: it runs on the loop, reads what the engine has just recorded (a stop's duration, the
start-up phases of a process that became ready) and updates thread-safe metric objects. The
HTTP endpoint runs on its own thread, and GPU memory is read there, at scrape time, so an NVML
call never stalls the loop that reaps children.

prometheus_client is imported only when an exporter is built: a daemon with metrics off pays
nothing for it.

Metrics that describe the instance carry a `profile` label, not `instance`: Prometheus attaches
its own `instance` (the scraped host:port) to every series, and a clash would rename ours to
`exported_instance`.
"""

from __future__ import annotations

import asyncio
import errno
import re
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from collections.abc import Awaitable, Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from . import __version__
from .config.model import MetricsConfig
from .sglang import logs as phases
from .engine.events import Event
from .engine.states import InstanceState, ProcessState
from .errors import SupervisorError

if TYPE_CHECKING:
    from .checks.gpus import GpuInventory
    from .engine.instance import Instance
    from .engine.process import ManagedProcess

PREFIX = "supervisord_gpu"

#: the `state` label sets: every word of the engine's tables, in their order (engine/states.py)
INSTANCE_STATES = tuple(s.value for s in InstanceState)
PROCESS_STATES = tuple(s.value for s in ProcessState)

#: engine phase -> the `phase` label of the start-up histogram ("total": launch to ready)
PHASE_LABELS = {
    phases.LOADING_WEIGHTS: "weights",
    phases.ALLOCATING_KV: "kv_cache",
    phases.CAPTURING_GRAPHS: "cuda_graphs",
    "total": "total",
}

#: start-ups and transitions: a second (a stand-in) to half an hour (a large model's weights)
STARTUP_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 300, 450, 600, 900, 1200, 1800)
#: stops: tens of milliseconds (a dead process) to the router's drain deadline and beyond
STOP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 180, 240, 300)

REASON_CODES = ("gpu_busy", "port_busy", "gpu_missing", "other")

LOOP_LAG_INTERVAL_S = 1.0
BIND_RETRY_S = 1.0
MIB = 1024 * 1024


class MetricsUnavailable(SupervisorError):
    """Metrics are enabled but cannot be served (prometheus-client missing, a bad address)."""


Preflight = Callable[[], Awaitable[None]]


class MetricsExporter:
    """Serves one instance's metrics on `cfg.host:cfg.port`; see the module docstring.

    Wiring: build it, `start()`, append `on_event` to the instance's listeners, `watch_loop(loop)`,
    and `stop()` at the end. `on_event`, `watch_loop` and `stop` belong on the instance's loop.
    """

    def __init__(self, cfg: MetricsConfig, instance: Instance, inventory: GpuInventory | None = None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError:
            raise MetricsUnavailable(
                "metrics are enabled but prometheus-client is not installed: "
                "install supervisord-gpu[metrics], or set [metrics] enabled = false"
            ) from None
        self.cfg = cfg
        self.instance = instance
        self.profile = instance.name
        self.registry = CollectorRegistry()
        r = self.registry
        g = f"{PREFIX}_"

        Gauge(g + "up", "1 while the supervisor serves metrics", registry=r).set(1)
        Gauge(g + "build_info", "The supervisor's version, as a label; always 1", ["version"], registry=r).labels(
            __version__
        ).set(1)
        self.loop_lag = Gauge(
            g + "event_loop_lag_seconds",
            f"How late the daemon's event loop woke from a {LOOP_LAG_INTERVAL_S:g} s sleep, last measured",
            registry=r,
        )
        self.last_event = Gauge(
            g + "last_event_timestamp_seconds",
            "Unix time of the instance's last event (a state, phase or transition step)",
            ["profile"], registry=r,
        )
        self.instance_state = Gauge(
            g + "instance_state", "1 for the instance's current state, 0 for the others", ["profile", "state"], registry=r
        )
        self.process_state = Gauge(
            g + "process_state", "1 for the process's current state, 0 for the others",
            ["profile", "process", "role", "state"], registry=r,
        )
        self.process_ready = Gauge(
            g + "process_ready", "1 while the process answers its readiness probe, else 0",
            ["profile", "process", "role"], registry=r,
        )
        self.restarts = Counter(
            g + "process_restarts", "Restarts of the process (after a crash or on request)",
            ["profile", "process", "role"], registry=r,
        )
        self.startup_phase = Histogram(
            g + "startup_phase_seconds",
            "Time a server spent in a start-up phase (weights, kv_cache, cuda_graphs); total: launch to ready",
            ["profile", "process", "phase"], buckets=STARTUP_BUCKETS, registry=r,
        )
        self.stop_seconds = Histogram(
            g + "stop_seconds", "Time to stop a process, SIGTERM to its cgroup empty",
            ["profile", "process"], buckets=STOP_BUCKETS, registry=r,
        )
        self.instance_start = Histogram(
            g + "instance_start_seconds", "Time to bring every process of the instance to ready",
            ["profile"], buckets=STARTUP_BUCKETS, registry=r,
        )
        self.instance_stop = Histogram(
            g + "instance_stop_seconds", "Time to stop every process of the instance, in stop order",
            ["profile"], buckets=STOP_BUCKETS, registry=r,
        )
        self.transition = Histogram(
            g + "transition_seconds", "Time to move the machine from one profile to another",
            ["from", "to", "outcome"], buckets=STARTUP_BUCKETS, registry=r,
        )
        self.precondition_failures = Counter(
            g + "precondition_failures",
            "Starts refused before anything ran, by reason (gpu_busy, port_busy, gpu_missing, other); "
            "a refusal naming several problems counts once under each",
            ["profile", "reason"], registry=r,
        )
        if inventory is not None:
            r.register(_GpuCollector(inventory))

        # Durations the engine recorded that are already observed, by identity: each stop or start
        # stores a fresh float, so `is not` tells a new measurement from one seen before.
        self._seen: dict[tuple[str, str], object] = {}
        self._counted_restarts: dict[str, int] = {}
        self._lag_task: asyncio.Task[None] | None = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._initial_values()

    # ------------------------------------------------------------------ what the engine tells us

    def _initial_values(self) -> None:
        """Every series a profile will have exists from the first scrape, so increase() sees the first event."""
        inst = self.instance
        for code in REASON_CODES:
            self.precondition_failures.labels(self.profile, code)
        self.last_event.labels(self.profile).set(inst.since)
        self._instance_changed()
        self.instance_start.labels(self.profile)
        self.instance_stop.labels(self.profile)
        for proc in inst.processes.values():
            self._counted_restarts[proc.name] = 0
            self.restarts.labels(self.profile, proc.name, proc.spec.role)
            self.stop_seconds.labels(self.profile, proc.name)
            for phase in PHASE_LABELS.values() if proc.spec.kind == "server" else ("total",):
                self.startup_phase.labels(self.profile, proc.name, phase)
            self._process_changed(proc)

    def on_event(self, event: Event) -> None:
        """The instance's listener (runs on its loop)."""
        self.last_event.labels(self.profile).set(event.at)
        if event.kind == "instance":
            self._instance_changed()
        elif event.process in self.instance.processes:
            self._process_changed(self.instance.processes[event.process])

    def _instance_changed(self) -> None:
        inst = self.instance
        _one_hot(self.instance_state, (self.profile,), INSTANCE_STATES, inst.state.value)
        if inst.state == InstanceState.READY and self._fresh(("instance", "start"), inst.last_start_s):
            self.instance_start.labels(self.profile).observe(inst.last_start_s)  # type: ignore[arg-type]
        if inst.state in (InstanceState.STOPPED, InstanceState.FAILED) and self._fresh(("instance", "stop"), inst.last_stop_s):
            self.instance_stop.labels(self.profile).observe(inst.last_stop_s)  # type: ignore[arg-type]

    def _process_changed(self, proc: ManagedProcess) -> None:
        labels = (self.profile, proc.name, proc.spec.role)
        _one_hot(self.process_state, labels, PROCESS_STATES, proc.state.value)
        self.process_ready.labels(*labels).set(1 if proc.state == ProcessState.READY else 0)
        new_restarts = proc.restarts_total - self._counted_restarts.get(proc.name, 0)
        if new_restarts > 0:
            self.restarts.labels(*labels).inc(new_restarts)
            self._counted_restarts[proc.name] = proc.restarts_total
        if proc.state == ProcessState.READY and self._fresh(("ready", proc.name), proc.phase_durations.get("total")):
            for phase, label in PHASE_LABELS.items():
                if phase in proc.phase_durations:
                    self.startup_phase.labels(self.profile, proc.name, label).observe(proc.phase_durations[phase])
        if proc.state == ProcessState.STOPPED and self._fresh(("stop", proc.name), proc.last_stop_s):
            self.stop_seconds.labels(self.profile, proc.name).observe(proc.last_stop_s)  # type: ignore[arg-type]

    def _fresh(self, key: tuple[str, str], value: float | None) -> bool:
        if value is None or self._seen.get(key) is value:
            return False
        self._seen[key] = value
        return True

    # ------------------------------------------------------------------ what the daemon tells us

    def precondition_failed(self, reason: str) -> None:
        """A start refused by the checks; counted once under each distinct reason code it names."""
        for code in reason_codes(reason):
            self.precondition_failures.labels(self.profile, code).inc()

    def counting_preflight(self, preflight: Preflight) -> Preflight:
        """`preflight`, with its refusals counted by `precondition_failed`."""

        async def checked() -> None:
            try:
                await preflight()
            except SupervisorError as e:
                self.precondition_failed(str(e))
                raise

        return checked

    def transition_observed(self, seconds: float, from_profile: str, to_profile: str, outcome: str) -> None:
        """A transition between profiles took `seconds`; outcome e.g. "ok", "failed", "rolled_back"."""
        self.transition.labels(from_profile, to_profile, outcome).observe(seconds)

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Measure, once a second, how late `loop` wakes up (call on that loop)."""
        if self._lag_task is None or self._lag_task.done():
            self._lag_task = loop.create_task(self._measure_lag())

    async def _measure_lag(self) -> None:
        self.loop_lag.set(0.0)
        while True:
            began = time.monotonic()
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            self.loop_lag.set(max(0.0, time.monotonic() - began - LOOP_LAG_INTERVAL_S))

    # ------------------------------------------------------------------ the endpoint

    @property
    def address(self) -> str:
        host = self.cfg.host
        return f"[{host}]:{self.cfg.port}" if ":" in host else f"{host}:{self.cfg.port}"

    @property
    def serving(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Serve /metrics on a thread of its own.

        A port another daemon still holds (the one a takeover is stopping) is retried every
        second until it is free, with a warning; any other bind failure raises MetricsUnavailable.
        """
        try:
            self._serve()
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise MetricsUnavailable(
                    f"cannot serve metrics on {self.address}: {e.strerror or e}; "
                    "fix [metrics] host/port in supervisord-gpu.toml"
                ) from None
            self._say(f"metrics port {self.address} is in use; serving metrics once it is free", 4)
            threading.Thread(target=self._serve_when_free, name="metrics-bind", daemon=True).start()
            return
        self._say(f"serving Prometheus metrics on http://{self.address}/metrics", 6)

    def _serve(self) -> None:
        from prometheus_client import make_wsgi_app

        host, port = self.cfg.host, self.cfg.port
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        server: Any = make_server(host, port, make_wsgi_app(self.registry), server_class, _QuietHandler)
        with self._lock:
            if self._closing.is_set():
                server.server_close()
                return
            self._server = server
            self._thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
            self._thread.start()

    def _serve_when_free(self) -> None:
        while not self._closing.wait(BIND_RETRY_S):
            try:
                self._serve()
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    continue
                self._say(f"cannot serve metrics on {self.address}: {e.strerror or e}; giving up", 3)
                return
            if self.serving:
                self._say(f"serving Prometheus metrics on http://{self.address}/metrics", 6)
            return

    def stop(self) -> None:
        """Stop serving and measuring; safe to call twice, or after a start that never bound."""
        if self._lag_task is not None:
            self._lag_task.cancel()
        with self._lock:
            self._closing.set()
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def _say(self, message: str, priority: int) -> None:
        self.instance.sink.event(message, priority, GPUSUP_EVENT="metrics")


def reason_codes(reason: str) -> list[str]:
    """Short codes for a refusal's text: gpu_busy, port_busy, gpu_missing, else other.

    A refusal lists its problems separated by "; "; each is classified by its subject (the first
    GPU or port it mentions) and what it says about it.
    """
    codes: list[str] = []
    for part in re.split(r";\s*", reason.removeprefix("refusing to start:")):
        code = _classify(part)
        if code is not None and code not in codes:
            codes.append(code)
    return codes or ["other"]


_SUBJECT = re.compile(
    r"(?<![-\w])(?P<gpu>GPUs?)\b"  # not the "gpu" of "supervisord-gpu" in a path
    r"|\b(?P<port>ports?|address(?:es)?)\b|(?P<hostport>[\w\].]:\d{1,5}\b)",
    re.IGNORECASE,
)
_MISSING = re.compile(r"does not exist|doesn't exist|not found|missing|no such|only has|has \d+ visible", re.IGNORECASE)
_BUSY = re.compile(r"not idle|busy|in use|used|held|holds?\b|holder|occupied|taken|not free|listen|bound|MiB", re.IGNORECASE)


def _classify(problem: str) -> str | None:
    subject = _SUBJECT.search(problem)
    if subject is None:
        return None
    if subject.group("gpu") is not None:
        if _MISSING.search(problem):
            return "gpu_missing"
        return "gpu_busy" if _BUSY.search(problem) else None
    return "port_busy" if _BUSY.search(problem) else None


def _one_hot(gauge: Any, labels: tuple[str, ...], states: Sequence[str], current: str) -> None:
    for state in states:
        gauge.labels(*labels, state).set(1 if state == current else 0)


class _GpuCollector:
    """GPU memory and idleness, read from the inventory at scrape time (on the HTTP thread)."""

    def __init__(self, inventory: GpuInventory) -> None:
        self.inventory = inventory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        g = f"{PREFIX}_gpu_"
        up = GaugeMetricFamily(g + "inventory_up", "1 when the GPU inventory could be read for this scrape, else 0")
        used = GaugeMetricFamily(g + "memory_used_bytes", "GPU memory in use, all processes", labels=["gpu", "uuid"])
        total = GaugeMetricFamily(g + "memory_total_bytes", "GPU memory in all", labels=["gpu", "uuid"])
        idle = GaugeMetricFamily(
            g + "idle", "1 when the GPU counts as idle (no compute process, memory at its baseline)", labels=["gpu"]
        )
        try:
            gpus = list(self.inventory.snapshot())
        except Exception:  # NVML gone away, a simulated store mid-rewrite: say so, keep the scrape's shape
            gpus = None
        up.add_metric([], 0 if gpus is None else 1)
        for gpu in gpus or ():
            labels = [str(gpu.index), str(gpu.uuid)]
            used.add_metric(labels, float(gpu.used_mib) * MIB)
            total.add_metric(labels, float(gpu.total_mib) * MIB)
            idle.add_metric([str(gpu.index)], 1.0 if gpu.idle else 0.0)
        yield from (up, used, total, idle)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every 15 s are not news
        pass
