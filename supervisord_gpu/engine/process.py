"""One supervised process: spawn into its own group, read its lines, observe readiness, stop.

All waiting is on events (a probe answer, a log line, the child's exit, `cgroup.events`);
the only timers are deadlines and the probe interval.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pwd
import signal
import time
from ..records import dataclass, field
from collections.abc import Callable, Mapping
from typing import Literal

from ..checks.ports import ListenerOwnership, check_ports, listener_ownership
from ..config.model import STACK_DUMP_S
from ..config.render import Launch
from ..errors import StartError
from ..ownership.base import OwnershipDriver, Spawned, SpawnRequest
from ..ownership.files import PrivateDir, ShmTracker
from ..ownership.procfs import cpu_ticks
from ..ownership.shm_watch import SHM_CREATIONS
from ..sglang import exits
from ..sglang import logs as phases
from ..sglang.server_metrics import MAX_BODY as METRICS_MAX_BODY
from ..sglang.timing import watchdog_s
from .deadline import StartDeadline
from .hang import HangVerdict, HangWatch
from .hang_sampler import CLK_TCK, GpuUtilization, HangSampler, dump_stacks, quoted_lines
from .events import Event, LogSink
from .liveness import LivenessWatch
from .output import OutputSplitter
from .probe import ProbeResult, probe, request, who_accepted
from .restarts import CrashRestarts, RequestedRestarts, Verdict
from .states import PROCESS_MOVES, ProcessState, check_move
from .traffic import RouterWorkers, router_verdict

#: why a process is started again: a crash the policy restarts, or an operator's request
Again = Literal["crash", "request"]

TAIL_LINES = 20
KILL_GRACE_S = 5.0  # after SIGKILL of the whole cgroup, how long until we call it stuck
READ_CHUNK = 1 << 16
PROGRESS_LOG_S = 10.0  # a progress bar's state goes to the journal at most this often
PIPE_DRAIN_S = 0.5  # after the exit: how long to read what it printed last
#: no progress for this long after the last one fails a start (the daemon's start_stall_timeout)
START_STALL_S = 120.0


@dataclass
class Readiness:
    at: float
    state: str
    detail: str


@dataclass
class ProcessStatus:
    """A snapshot for status readers (D-Bus, CLI, STATUS=); plain data, safe to hand across threads."""

    name: str
    role: str
    state: str
    pid: int | None
    group: str
    host: str
    port: int
    gpus: list[int]
    phase: str
    phase_elapsed_s: float
    restarts: int
    last_exit: str
    ready_since: float | None
    history: list[dict[str, object]] = field(default_factory=list)
    #: the progress bar it is drawing now ("Capturing batches (bs=64): 30%|...|"), "" when none
    progress: str = ""
    #: the last error line it printed: the child's words, for privileged readers only (see the bus)
    last_error: str = ""
    #: ready, but SGLang's /ready says 503: paused, latched by a failed /health, or draining
    serving: bool = True
    #: since when (time.time()) it has not been serving; None while it serves
    not_serving_since: float | None = None


class ManagedProcess:
    def __init__(
        self,
        instance: str,
        launch: Launch,
        owner: OwnershipDriver,
        sink: LogSink,
        emit: Callable[[Event], None],
        base_env: Mapping[str, str],
        start_stall_s: float = START_STALL_S,
    ) -> None:
        self.instance = instance
        self.launch = launch
        self.spec = launch.spec
        self.name = launch.spec.name
        self.owner = owner
        self.sink = sink
        self.emit = emit
        self.base_env = base_env
        self.start_stall_s = start_stall_s
        #: while waiting for readiness: the rule its deadline follows (None otherwise)
        self.start_deadline: StartDeadline | None = None
        #: after ready: False while SGLang's /ready says 503 (paused, latched or draining)
        self.serving = True
        #: when it stopped serving (time.time(), for status) and whether that was called too long
        self.not_serving_since: float | None = None
        self._not_serving_warned = False
        self.state = ProcessState.STOPPED
        self.spawned: Spawned | None = None
        self.phase = ""
        self.phase_since = time.monotonic()
        self.ready_since: float | None = None
        #: its two restart ledgers, written only here: the policy's (crashes) and the operator's
        self.crash_restarts = CrashRestarts()
        self.requested_restarts = RequestedRestarts()
        self.last_exit = ""
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.history: collections.deque[Readiness] = collections.deque(maxlen=50)
        self.exit_code: int | None = None
        self.exited_at: float | None = None  # monotonic time the main process was reaped
        #: monotonic time of its last start-up progress (any line of its own while loading, a phase
        #: line or a bar once its HTTP port is up; never a request's echo: sglang/logs.is_start_progress)
        self.last_output_at: float | None = None
        self.progress_text = ""
        self._progress_stream = ""
        self._progress_logged_at = 0.0
        self.last_error = ""  # the last error-looking line it printed
        self._http_open = False  # its HTTP port is up: anyone's requests can make it print
        self.markers_seen: set[str] = set()  # exits.SELF_KILL_MARKERS / BIND_FAILED_MARKER it printed
        self.signals_sent: dict[int, str] = {}  # the signals we sent it, and why
        uid, gid = _ids_of(launch.user)
        self.tmpdir = PrivateDir(launch.tmpdir, uid, gid) if launch.tmpdir else None
        self.cache = PrivateDir(launch.cache_root, uid, gid) if launch.cache_root else None
        self.shm = ShmTracker(uid)
        self.last_stop_s: float | None = None
        self.phase_durations: dict[str, float] = {}
        self._exited = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        #: the phase scans under way on worker threads (kept so none is collected mid-run)
        self._scans: set[asyncio.Future[None]] = set()
        self._scan_again = False  # a phase came while one ran: scan once more when it ends
        self._liveness: asyncio.Task[None] | None = None
        self._hang: asyncio.Task[None] | None = None  # the hang verdict's watch (engine/hang.py)
        self._stopping = False
        #: a router's readiness needs all of its workers healthy, not just one
        self.expected_workers = len(self.spec.workers) + len(self.spec.prefill) + len(self.spec.decode)
        #: called with this process when it exits on its own while ready or restarting
        self.on_unexpected_exit: Callable[[ManagedProcess], None] | None = None
        #: after ready: who accepted our last liveness connection instead of us ("" when we did)
        self._stranger = ""

    # ------------------------------------------------------------------ state

    def _set_state(self, state: ProcessState, detail: str = "") -> None:
        """The one place its state changes: checked against PROCESS_MOVES (engine/states.py)."""
        if state == self.state and not detail:
            return
        check_move(PROCESS_MOVES, f"process {self.instance}/{self.name}", self.state, state,
                   lambda why: self.sink.event(why, 3, GPUSUP_PROCESS=self.name, GPUSUP_EVENT="illegal-state-move"))
        self.state = state
        self.history.append(Readiness(time.time(), state.value, detail))
        self.emit(Event("process", self.instance, detail or state.value, process=self.name, state=state.value))

    def _set_phase(self, phase: str) -> None:
        if phase == self.phase:
            return
        now = time.monotonic()
        if self.phase:
            self.phase_durations[self.phase] = self.phase_durations.get(self.phase, 0.0) + now - self.phase_since
        self.phase, self.phase_since = phase, now
        self.emit(Event("phase", self.instance, phase, process=self.name, state=self.state.value))

    @property
    def restarts_total(self) -> int:
        """How many times it was started again, for whatever reason (status's `restarts`, the metric)."""
        return self.crash_restarts.started + self.requested_restarts.started

    def await_restart(self, verdict: Verdict) -> None:
        """It died after ready and the policy restarts it: RESTARTING until its backoff ends."""
        self._set_state(ProcessState.RESTARTING, f"{self.last_exit}; restart {verdict.attempt} in {verdict.delay_s:g} s")

    @property
    def pid(self) -> int | None:
        return self.spawned.pid if self.spawned and self.exit_code is None else None

    def status(self) -> ProcessStatus:
        return ProcessStatus(
            name=self.name,
            role=self.spec.role,
            state=self.state.value,
            pid=self.pid,
            group=self.spawned.group.name if self.spawned else "",
            host=self.spec.host,
            port=self.spec.port,
            gpus=list(self.spec.gpus),
            phase=self.phase,
            phase_elapsed_s=round(time.monotonic() - self.phase_since, 3),
            restarts=self.restarts_total,
            last_exit=self.last_exit,
            ready_since=self.ready_since,
            history=[{"at": h.at, "state": h.state, "detail": h.detail} for h in self.history],
            progress=self.progress_text,
            last_error=self.last_error,
            serving=self.serving,
            not_serving_since=self.not_serving_since,
        )

    # ------------------------------------------------------------------ start

    async def start(self, again: Again | None = None) -> None:
        """Spawn into a fresh group; returns as soon as the child runs (not when it is ready).

        `again` says why it is started once more (a restart): RESTARTING rather than STARTING,
        counted in the ledger of that kind of restart."""
        self._exited = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopping = False
        self.exit_code = None
        self.tail.clear()
        self.phase_durations = {}
        self.progress_text = self.last_error = ""
        self.markers_seen = set()
        self._http_open = False  # until uvicorn says so, only the server itself writes
        self.signals_sent = {}
        if again == "crash":
            self.crash_restarts.started += 1
        elif again == "request":
            self.requested_restarts.started += 1
        self._set_state(ProcessState.STARTING if again is None else ProcessState.RESTARTING)
        self._set_phase(phases.LAUNCHED)
        await asyncio.to_thread(self._prepare_dirs)
        req = SpawnRequest(
            instance=self.instance,
            process=self.name,
            argv=self.launch.argv,
            env=self.launch.environment(self.base_env),
            user=self.launch.user,
        )
        self.spawned = await self.owner.spawn(req)
        group = self.spawned.group
        # a segment made and leaked between two phase scans (the real server's crash a second
        # after its scheduler made one) is still recorded: ownership/shm_watch
        watched = SHM_CREATIONS.watch(self, self.shm.uid, lambda: self.shm.scan(group.pids()))
        for line in SHM_CREATIONS.news(watched):
            self.sink.event(line, 4, GPUSUP_EVENT="shm-watch")
        self.sink.event(
            f"{self.name}: started pid {self.spawned.pid} in {self.spawned.group.name}",
            6,
            GPUSUP_PROCESS=self.name,
            GPUSUP_EVENT="spawn",
            GPUSUP_PID=str(self.spawned.pid),
        )
        proc = self.spawned.proc
        assert proc.stdout is not None and proc.stderr is not None
        self._tasks = [
            asyncio.create_task(self._pump(proc.stdout, "stdout")),
            asyncio.create_task(self._pump(proc.stderr, "stderr")),
            asyncio.create_task(self._watch_exit()),
        ]

    def _prepare_dirs(self) -> None:
        """Its private TMPDIR (emptied: a crashed run's ipc files) and its persistent compile cache."""
        for d in (self.tmpdir, self.cache):
            if d is not None:
                d.prepare()
        if self.tmpdir is not None:
            self.tmpdir.clear()

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        """Forward what the child prints; its phase lines and progress bars are start-up progress
        (never a request's echo: anyone who connects makes it print those)."""
        splitter = OutputSplitter()
        while True:
            raw = await stream.read(READ_CHUNK)
            if not raw:
                for line in splitter.close():
                    self._on_line(line, name)
                return
            split = splitter.feed(raw)
            for line in split.lines:
                self._on_line(line, name)
            if split.progress is not None:
                self._on_progress(split.progress, name)

    def _on_line(self, raw: str, stream: str) -> None:
        line = phases.strip_ansi(raw)
        priority = phases.priority_of(line)
        self._http_open = self._http_open or phases.opens_http(line)
        if phases.is_start_progress(line, self._http_open):  # never a request's echo (anyone's)
            self.last_output_at = time.monotonic()
        self.tail.append(line)
        if stream == self._progress_stream:
            self.progress_text = ""  # the bar finished (or a line ended it)
        if priority <= 3 and not phases.is_access_log(line):  # a request's echo holds the client's words
            if phases.is_reason(line):
                self.last_error = phases.message_of(line)[:300]
            self.markers_seen.update(m for m in exits.MARKERS if m in line)
        self.sink.child_line(self.instance, self.name, line, stream, priority)
        self._note_phase(line)

    def _on_progress(self, raw: str, stream: str) -> None:
        """A redrawn progress bar: shown in status at once, in the journal every PROGRESS_LOG_S."""
        text = phases.strip_ansi(raw).strip()
        self.progress_text, self._progress_stream = text[:200], stream
        if phases.is_start_progress(text, self._http_open):
            self.last_output_at = time.monotonic()
        now = time.monotonic()
        if now - self._progress_logged_at >= PROGRESS_LOG_S:
            self._progress_logged_at = now
            self.sink.child_line(self.instance, self.name, text, stream, 6)
        self._note_phase(text)

    def _note_phase(self, text: str) -> None:
        phase = phases.phase_of(text)
        if phase is not None and phase != self.phase:
            self._set_phase(phase)
            self._wake.set()
            self._scan_files_soon()

    async def _watch_exit(self) -> None:
        assert self.spawned is not None
        code = await self.spawned.proc.wait()
        self.exited_at = time.monotonic()
        # Its last words explain the exit (SGLang prints why, then SIGKILLs itself): read what is
        # still in the pipes first, briefly, since an orphan may hold them open forever.
        pumps = [task for task in self._tasks if task is not asyncio.current_task() and not task.done()]
        if pumps:
            await asyncio.wait(pumps, timeout=PIPE_DRAIN_S)
        self.exit_code = code
        holder = ""
        if code > 0 and self.markers_seen & set(exits.BIND_FAILED_MARKERS):
            holder = await asyncio.to_thread(self._port_holders)
        self.last_exit = exits.describe_exit(code, tuple(self.markers_seen), self.signals_sent, holder)
        self._exited.set()
        self._wake.set()
        if not self._stopping:
            self.sink.event(
                f"{self.name}: exited unexpectedly ({self.exit_report})",
                3,
                GPUSUP_PROCESS=self.name,
                GPUSUP_EVENT="exit",
            )
            if self.state in (ProcessState.READY,) and self.on_unexpected_exit is not None:
                self.on_unexpected_exit(self)

    def _port_holders(self) -> str:
        """Who holds its ports now: "127.0.0.1:30001 (router) held by pid 4711 (user ...) ..."."""
        held = [s.problem() for s in check_ports((listen.host, listen.port, listen.label) for listen in self.spec.listens()) if not s.free]
        return "; ".join(p for p in held if p)

    def _scan_files(self) -> None:
        """Note the shared-memory files its cgroup uses now (cleaned after a kill; see ownership/files)."""
        if self.spawned is not None:
            self.shm.scan(self.spawned.group.pids())

    def _scan_files_soon(self) -> None:
        """`_scan_files` on a worker thread, from the output reader (a new phase): reading the
        /proc/PID/maps and fds of a loaded server's processes must not hold up the event loop,
        which probes and judges every other process meanwhile. The tracker's lock orders it
        with the /dev/shm watch's scans and the clean-up after a kill."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the reader by hand): as before
            self._scan_files()
            return
        if self._scans:  # one at a time: phases that come meanwhile make one more scan, not a queue
            self._scan_again = True
            return
        self._start_scan(loop)

    def _start_scan(self, loop: asyncio.AbstractEventLoop) -> None:
        scan = loop.run_in_executor(None, self._scan_files)
        self._scans.add(scan)
        scan.add_done_callback(self._scan_done)

    def _scan_done(self, scan: asyncio.Future[None]) -> None:
        self._scans.discard(scan)
        if not scan.cancelled() and (error := scan.exception()) is not None:
            self.sink.event(f"{self.name}: scan of its shared-memory files failed: {type(error).__name__}: {error}", 4,
                            GPUSUP_PROCESS=self.name)
        if self._scan_again:
            self._scan_again = False
            self._start_scan(scan.get_loop())

    async def _check_listener(self) -> bool:
        """Is whoever listens on our port one of ours? Raises StartError naming a stranger.

        SGLang opens its port only after minutes of loading; meanwhile anyone can bind it and
        answer our probe 200. Only a listener held by a process in this process's own cgroup
        counts; a foreign one fails the start (never READY=1), named by PID, user and command line.
        """
        spec = self.spec
        own = await self._listeners()
        if own.strangers:
            raise StartError(self._failure(
                f"port {spec.host}:{spec.port} is held by {own.describe_foreign()} while {self.name} is starting; "
                "refusing to report ready (it would send our traffic to them)"))
        return own.ours

    async def _check_bootstrap_listener(self) -> bool:
        """A prefill's bootstrap port held by its own cgroup? Raises StartError naming a stranger.

        SGLang binds the PD bootstrap port early, in a thread, and only logs a failure; the server
        then answers /health 200 all the same. Whoever took the port meanwhile would be the
        bootstrap server the decode and the router ask where each request's KV cache goes. So a
        prefill is ready only once its bootstrap port is held from its own cgroup."""
        spec = self.spec
        assert spec.bootstrap_port is not None
        own = await asyncio.to_thread(listener_ownership, spec.host, spec.bootstrap_port, self._pids())
        if own.strangers:
            raise StartError(self._failure(
                f"bootstrap port {spec.host}:{spec.bootstrap_port} is held by {own.describe_foreign()} while {self.name} "
                "is starting; refusing to report ready (the decode would ask them where to send its KV cache)"))
        return own.ours

    async def _listeners(self) -> ListenerOwnership:
        """Who listens on its port now, against the processes in its own cgroup."""
        return await asyncio.to_thread(listener_ownership, self.spec.host, self.spec.port, self._pids())

    def _pids(self) -> list[int]:
        """Its cgroup's processes now (none before the spawn)."""
        return self.spawned.group.pids() if self.spawned is not None else []

    def router_api(self) -> RouterWorkers:
        """This router's worker API, with the instance's key, sent only on connections this
        process accepted (engine/traffic.py)."""
        return RouterWorkers.of(self.launch, self._pids)

    async def _accepted_by_us(self, ours: tuple[str, int], theirs: tuple[str, int]) -> str:
        """After ready, before each liveness probe is sent: "" when a process of its own cgroup
        accepted the probe's connection, else why it is no answer.

        The real router closes its port at once on SIGTERM and drains for up to 180 s; a server
        whose front end stopped listening lives on too. Whoever binds the port then (a process
        of the same user can send that SIGTERM) would answer 200 for a process that serves
        nobody. A stranger's answer is no answer (`failures` of them kill the cgroup, and the
        restart names the holder), said once in the journal. Only this connection's other end
        counts: a stranger on [::1] while we serve 127.0.0.1 answers none of our probes and
        changes nothing."""
        accepted = await who_accepted(ours, theirs, self._pids, self.spec.probe.liveness_timeout_s)
        if accepted.stranger and accepted.stranger != self._stranger:
            self.sink.event(f"{self.name}: port {self.spec.host}:{self.spec.port} answers from {accepted.stranger}, "
                            f"not from {self.name}; its answers do not count", 3,
                            GPUSUP_PROCESS=self.name, GPUSUP_EVENT="port-stranger")
        self._stranger = accepted.stranger
        return accepted.why_not()

    async def wait_ready(self) -> None:
        """Probe until 200 from our own listener, the deadline, or the process's death; raises StartError
        on the latter two and on a stranger listening on our port."""
        spec = self.spec
        started = time.monotonic()
        rule = self.start_deadline = StartDeadline(started, spec.start_timeout_s, self.start_stall_s,
                                                  max(spec.start_timeout_max_s, spec.start_timeout_s))
        try:
            await self._probe_until_ready(started, rule)
        finally:
            self.start_deadline = None

    def deadline_at(self) -> float | None:
        """While waiting for readiness: the monotonic time this start fails at, if nothing moves."""
        rule = self.start_deadline
        return rule.at(self.last_output_at) if rule is not None else None

    async def _probe_until_ready(self, started: float, rule: StartDeadline) -> None:
        spec = self.spec
        host = spec.probe_host
        while True:
            if self._exited.is_set():
                raise StartError(self._failure(f"exited during start-up ({self.last_exit})"))
            result = await self._probe_unless_exited(host)
            status = result.status if result else None
            ours = await self._check_listener() if result and result.connected else False
            if status == 200 and ours and spec.bootstrap_port is not None:
                ours = await self._check_bootstrap_listener()
            if status == 200 and ours and spec.kind == "router" and await self._router_not_ready():
                status = 503
            if status == 200 and ours:
                # the files it uses, noted on a worker thread before the exit check below: nothing
                # may be awaited between that check and READY (an exit meanwhile would be missed,
                # its restart with it, and a dead server left READY)
                await asyncio.to_thread(self._scan_files)
            if status == 200 and ours and not self._exited.is_set():
                self.ready_since = time.time()
                self.phase_durations["total"] = time.monotonic() - started
                self._set_phase(phases.SERVING)
                self.progress_text = ""
                self._set_state(ProcessState.READY)
                self._start_liveness()
                self.sink.event(
                    f"{self.name}: ready ({spec.probe.path} answered 200 on {host}:{spec.port} after "
                    f"{time.monotonic() - started:.2f} s)",
                    6,
                    GPUSUP_PROCESS=self.name,
                    GPUSUP_EVENT="ready",
                    GPUSUP_DURATION_S=f"{time.monotonic() - started:.3f}",
                )
                return
            now = time.monotonic()
            remaining = rule.at(self.last_output_at) - now
            if remaining <= 0:
                raise StartError(
                    self._failure(
                        f"{rule.why(now, self.last_output_at)} "
                        f"(phase: {self.phase}; last probe: {status or 'no answer'})"
                    )
                )
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), min(spec.probe.interval_s, remaining))
            except TimeoutError:
                pass

    async def _router_not_ready(self) -> str:
        """Why the router is not ready yet ("" when it is): engine/traffic.py's `router_verdict`.

        The router's own /readiness counts any healthy worker; ours counts the profile's, and
        removes anyone else's first (RouterWorkers.enforce); in PD mode a prefill and a decode
        must be listed healthy and a first request through the router must answer 200."""
        api = self.router_api()
        check = await api.enforce(self.sink, self.name)
        pd = self.spec.router_mode == "pd"
        first = None
        if pd and check.ready and {"prefill", "decode"} <= set(check.healthy_types):
            first = (await api.first_request())[0]
        return router_verdict(check, pd, first)

    async def _probe_unless_exited(self, host: str) -> ProbeResult | None:
        """One readiness probe, abandoned the moment the process exits (a hung listener on a stolen
        port would otherwise hold us for the whole probe timeout)."""
        spec = self.spec
        answer = asyncio.ensure_future(probe(host, spec.port, spec.probe.path, spec.probe.timeout_s, self.expected_workers))
        exited = asyncio.ensure_future(self._exited.wait())
        await asyncio.wait({answer, exited}, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if not answer.done():
            answer.cancel()
            return None
        return answer.result()

    def _start_liveness(self) -> None:
        self._liveness = asyncio.get_running_loop().create_task(self._watch_liveness())
        self._liveness.add_done_callback(self._liveness_ended)
        cfg = self.spec.probe
        if cfg.scheduler_path is not None and cfg.hang_window_s > 0 and (self._hang is None or self._hang.done()):
            self._hang = asyncio.get_running_loop().create_task(self._watch_hang())
            self._hang.add_done_callback(self._hang_ended)

    def _hang_ended(self, task: asyncio.Task[None]) -> None:
        """Like liveness: an error of ours in the hang watch is named and the watch goes on."""
        if task.cancelled() or task.exception() is None:
            return
        self.sink.event(f"{self.name}: hang check failed ({task.exception()!r}); it goes on", 3,
                        GPUSUP_PROCESS=self.name, GPUSUP_EVENT="liveness-error")
        if self.state == ProcessState.READY and not self._stopping and not self._exited.is_set():
            self._hang = asyncio.get_running_loop().create_task(self._watch_hang())
            self._hang.add_done_callback(self._hang_ended)

    async def _watch_hang(self) -> None:
        """After ready, every hang_interval: one look for the hang verdict (engine/hang.py has what
        each signal means); a hung server's evidence and stacks go to the journal, then its cgroup
        is killed and the exit goes through the restart policy. Ends when it is no longer READY
        (stopping, parked, exited)."""
        spec, cfg = self.spec, self.spec.probe
        assert self.spawned is not None and cfg.scheduler_path is not None
        spawned, scheduler_path = self.spawned, cfg.scheduler_path
        wait = max(60.0, 4 * cfg.hang_window_s)  # a request of ours that waits longer is sent again

        async def ask(path: str) -> tuple[int | None, bytes]:
            return await request("GET", spec.probe_host, spec.port, path, timeout=wait,
                                 peer_check=self._accepted_by_us, max_bytes=METRICS_MAX_BODY)

        sampler = HangSampler(spawned.pid, spawned.group.pids, lambda: ask(scheduler_path), lambda: ask("/metrics"),
                              GpuUtilization(spec.gpus))
        watch = HangWatch(cfg.hang_window_s, CLK_TCK)
        try:
            while True:
                await asyncio.sleep(cfg.hang_interval_s)
                if self.state != ProcessState.READY or self._exited.is_set() or self._stopping:
                    return
                verdict = watch.observe(await sampler.look(self.serving))
                if verdict.kill:
                    await self._kill_hung(verdict)
                    return
                if verdict.note:
                    self.sink.event(f"{self.name}: {verdict.note}. Evidence: {verdict.evidence}", 4,
                                    GPUSUP_PROCESS=self.name, GPUSUP_EVENT="hang-spared")
        finally:
            sampler.close()

    async def _kill_hung(self, verdict: HangVerdict) -> None:
        """The evidence in one line, the stacks of the hung processes (py-spy, at most
        STACK_DUMP_S in all, never longer), then SIGKILL of its cgroup."""
        self.sink.event(f"{self.name}: hung: {verdict.kill}. Evidence: {verdict.evidence}", 4,
                        GPUSUP_PROCESS=self.name, GPUSUP_EVENT="hang")
        stacks = await asyncio.gather(*(dump_stacks(pid, STACK_DUMP_S) for pid in verdict.pids))
        for pid, text in zip(verdict.pids, stacks, strict=True):
            self.sink.event(f"{self.name}: stacks of pid {pid} before the kill:\n{quoted_lines(text)}", 4,
                            GPUSUP_PROCESS=self.name, GPUSUP_EVENT="hang-stacks", GPUSUP_PID=str(pid))
        if (self.state != ProcessState.READY or self._stopping or self._exited.is_set() or self.spawned is None
                or signal.SIGKILL in self.signals_sent):
            return  # stopped, parked, dead or killed by liveness meanwhile: nothing more to do
        self.signals_sent[signal.SIGKILL] = f"hung: {verdict.kill}"
        self.sink.event(f"{self.name}: {verdict.kill}; killing its cgroup so the restart policy can bring it back", 3,
                        GPUSUP_PROCESS=self.name, GPUSUP_EVENT="unhealthy")
        self.spawned.group.kill_all()

    def _liveness_ended(self, task: asyncio.Task[None]) -> None:
        """Liveness must not end silently: an error of ours in it is named and the watch goes on."""
        if task.cancelled() or task.exception() is None:
            return
        self.sink.event(f"{self.name}: liveness check failed ({task.exception()!r}); it goes on", 3,
                        GPUSUP_PROCESS=self.name, GPUSUP_EVENT="liveness-error")
        if self.state == ProcessState.READY and not self._stopping and not self._exited.is_set():
            self._start_liveness()

    async def _watch_liveness(self) -> None:
        """After ready: kill only the dead (engine/liveness.py has what each answer means).

        Every liveness_interval: SGLang's /ready, from its front end (a 503 there is paused,
        latched or draining, never death), and, for servers, one scheduler round-trip kept in
        flight (/server_info). The cgroup is killed when the front end gave no answer
        `failures` times in a row, or the scheduler answered nothing for scheduler_timeout;
        the exit then goes through the restart policy.
        """
        spec, cfg = self.spec, self.spec.probe
        watch = LivenessWatch(cfg, time.monotonic())
        asking: asyncio.Task[None] | None = None

        async def ask_scheduler() -> None:
            assert cfg.scheduler_path is not None
            status, _ = await request("GET", spec.probe_host, spec.port, cfg.scheduler_path,
                                      timeout=cfg.scheduler_timeout_s, peer_check=self._accepted_by_us)
            # 401/403: the server wants an API key (--api-key); the scheduler cannot be asked,
            # and only its CPU time speaks for it
            if status == 200:
                watch.scheduler_answered(time.monotonic())

        ran = RanSince(self.spawned.pid if self.spawned else 0)
        self._stranger = ""

        try:
            while True:
                await asyncio.sleep(cfg.liveness_interval_s)
                if self.state != ProcessState.READY or self._exited.is_set() or self.spawned is None:
                    return
                await asyncio.to_thread(self._scan_files)
                if watch.asks_scheduler:
                    if ran.since_last(self.spawned.group.pids()):
                        watch.scheduler_answered(time.monotonic())
                    if asking is None or asking.done():
                        asking = asyncio.ensure_future(ask_scheduler())
                status = (await probe(spec.probe_host, spec.port, cfg.liveness_path, cfg.liveness_timeout_s,
                                      peer_check=self._accepted_by_us)).status
                verdict = watch.front(status, time.monotonic())
                if spec.kind == "router" and status == 200:
                    # a worker nobody in the profile named gets users' prompts: named and removed
                    await self.router_api().enforce(self.sink, self.name)
                self._note_serving(verdict.serving, status)
                self._warn_if_not_serving_too_long()
                if verdict.kill:
                    self.signals_sent[signal.SIGKILL] = verdict.kill
                    self.sink.event(f"{self.name}: {verdict.kill}; killing its cgroup so the restart policy can "
                                    "bring it back", 3, GPUSUP_PROCESS=self.name, GPUSUP_EVENT="unhealthy")
                    self.spawned.group.kill_all()
                    return
        finally:
            if asking is not None:
                asking.cancel()
            self.serving = True
            self.not_serving_since = None

    def _note_serving(self, serving: bool, status: int | None) -> None:
        """SGLang says it is up but not serving (/ready 503), or serves again: one journal line each."""
        if serving == self.serving:
            return
        self.serving = serving
        self.not_serving_since, self._not_serving_warned = (None if serving else time.time()), False
        if not serving:
            self.sink.event(f"{self.name}: {self.spec.probe.liveness_path} answered {status}: not serving (paused, "
                            "latched by a failed /health, or draining); it answers, so it is left running",
                            4, GPUSUP_PROCESS=self.name, GPUSUP_EVENT="not-serving")
        else:
            self.sink.event(f"{self.name}: serving again ({self.spec.probe.liveness_path} answered 200)", 6,
                            GPUSUP_PROCESS=self.name, GPUSUP_EVENT="serving")

    def _warn_if_not_serving_too_long(self) -> None:
        """Paused (or latched) for longer than the profile's paused_warn: anyone who reaches an admin
        endpoint with the key, or an RL loop that died between pause and continue, left it so.
        Nothing resumes it on our side (a weight sync may be under way); one warning says so."""
        since = self.not_serving_since
        if since is None or self._not_serving_warned or time.time() - since < self.spec.paused_warn_s:
            return
        self._not_serving_warned = True
        at = time.strftime("%H:%M:%S", time.localtime(since))
        self.sink.event(f"{self.name}: not serving since {at} ({time.time() - since:.0f} s, more than paused_warn "
                        f"{self.spec.paused_warn_s:g} s): paused, latched by a failed /health, or draining; "
                        "nothing resumes it but its own admin (POST /continue_generation with its admin key)"
                        + self._watchdog_note(),
                        4, GPUSUP_PROCESS=self.name, GPUSUP_EVENT="not-serving-too-long")

    def _watchdog_note(self) -> str:
        """For a server: that SGLang ends a pause in place with requests running on its own. Its
        scheduler's watchdog counts a held batch as a stuck forward pass, and a pause in place
        keeps the running batch: the real server, paused so with 2 requests running, was ended
        447 s in (H100, 2026-12-07; --watchdog-timeout 300, looked at every 150 s)."""
        if self.spec.kind != "server" or self.spec.probe.scheduler_path is None:
            return ""
        timeout = watchdog_s(self.spec.options)  # SGLang's, whatever our probe's scheduler_timeout says
        return (f"; a pause in place (mode in_place) with requests running is ended by SGLang's own watchdog "
                f"{timeout:g}-{1.5 * timeout:g} s after its last step (--watchdog-timeout), then restarted as its "
                "restart policy allows: pause with mode retract to hold requests longer")

    @property
    def exit_report(self) -> str:
        """How it ended, with its own last error line: for the journal, never for STATUS=. A clean
        end of a stop we asked for (exit 0 or SIGTERM after our SIGTERM) carries no error line:
        what it last complained about (a 503 to our own readiness probe, say) is not why it ended.
        An exit nobody asked for keeps it, whatever the code."""
        if signal.SIGTERM in self.signals_sent and self.exit_code in (0, -signal.SIGTERM):
            return self.last_exit
        return exits.with_error(self.last_exit, self.last_error)

    def _failure(self, why: str) -> str:
        """A start failure: the first line in our words (it becomes the instance's reason, shown to
        everyone); its last error and last lines below it, for the journal."""
        tail = "\n".join(f"    {line}" for line in list(self.tail)[-10:])
        return (f"{self.name}: {why}" + (f"\n  last error: {self.last_error}" if self.last_error else "")
                + (f"\n  last lines:\n{tail}" if tail else ""))

    # ------------------------------------------------------------------ stop

    async def stop(self, timeout: float | None = None, why: str = "") -> float:
        """SIGTERM the main process, SIGKILL the whole group at the deadline; returns seconds taken.

        Once the main process has exited, whatever is left in its group (a detached scheduler)
        is an orphan: it is killed at once rather than waited for. `why`, when the stop is not
        the plain one ("stopped while parked: ..."), is its state's detail and its last_exit's.
        """
        if self.spawned is None:
            self._set_state(ProcessState.STOPPED)
            return 0.0
        timeout = self.spec.stop_timeout_s if timeout is None else timeout
        self._stopping = True
        if self._liveness is not None:
            self._liveness.cancel()
        if self._hang is not None:
            self._hang.cancel()
        began = time.monotonic()
        self._set_state(ProcessState.STOPPING, why)
        group = self.spawned.group
        if not self._exited.is_set():
            await asyncio.to_thread(self._scan_files)
            self.signals_sent.setdefault(signal.SIGTERM, why or "stopped by the supervisor")
            try:
                os.kill(self.spawned.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not self.spec.serves_http:
                # SGLang's rank > 0 only logs SIGTERM and exits with rank 0's ShutdownReq
                # (engine.py:1264-1273): in a cluster stop, when rank 0's drain ends; stopped
                # alone, at the deadline, and rank 0 then fails. Waiting is what keeps rank 0's
                # drain whole, so the deadline stays; this line says why it takes that long.
                self.sink.event(f"{self.name}: rank {self.spec.node_rank} exits when rank 0 does (SGLang waits for "
                                f"its ShutdownReq); killed at {timeout:g} s if rank 0 runs on", 5,
                                GPUSUP_PROCESS=self.name, GPUSUP_EVENT="follower-stop")
            try:
                await asyncio.wait_for(self._exited.wait(), timeout)
            except TimeoutError:
                self.signals_sent[signal.SIGKILL] = f"still running {timeout:g} s after SIGTERM"
                self.sink.event(
                    f"{self.name}: still running {timeout:g} s after SIGTERM; killing its cgroup",
                    4,
                    GPUSUP_PROCESS=self.name,
                    GPUSUP_EVENT="kill",
                )
        leftovers = group.pids()
        if leftovers:
            group.kill_all(signal.SIGKILL)
        if not await group.wait_empty(KILL_GRACE_S):
            self.sink.event(f"{self.name}: group {group.name} still populated after SIGKILL: {group.pids()}", 2)
        try:
            await asyncio.wait_for(self._exited.wait(), KILL_GRACE_S)
        except TimeoutError:
            # its group is empty and nobody reaped it for us: a start cancelled between its spawn and
            # its reaper (a stop during a crash restart) leaves no one to; never wait for that forever
            self.sink.event(f"{self.name}: its group is empty but its exit was never seen; taken as exited", 3,
                            GPUSUP_PROCESS=self.name)
            self._exited.set()
        for task in self._tasks:
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 1.0)
                except (TimeoutError, Exception):
                    task.cancel()
        await group.release()
        self._scan_again = False  # no follow-up scan of a group that is gone
        if self._scans:  # a phase scan still under way ends first (what it noted is removed below)
            await asyncio.wait(set(self._scans), timeout=KILL_GRACE_S)
        removed = await asyncio.to_thread(self._remove_leftover_files)
        if removed:
            self.sink.event(f"{self.name}: removed {len(removed)} file(s) it left behind: {', '.join(removed[:8])}"
                            + (" ..." if len(removed) > 8 else ""), 4, GPUSUP_PROCESS=self.name, GPUSUP_EVENT="leftover")
        took = time.monotonic() - began
        self.last_stop_s = took
        # The supervisor's own share: from the main process being reaped to "stopped" declared.
        detect = time.monotonic() - self.exited_at if self.exited_at else 0.0
        self.ready_since = None
        self._set_phase("")
        self._set_state(ProcessState.STOPPED, why)
        self.sink.event(
            f"{self.name}: stopped in {took:.3f} s ({self.exit_report}"
            + (f"; killed {len(leftovers)} leftover process(es) in its group" if leftovers else "")
            + ")",
            6,
            GPUSUP_PROCESS=self.name,
            GPUSUP_EVENT="stopped",
            GPUSUP_DURATION_S=f"{took:.3f}",
            GPUSUP_EXIT_TO_STOPPED_S=f"{detect:.6f}",
        )
        return took

    def _remove_leftover_files(self) -> list[str]:
        """Once its cgroup is empty: what it could not clean up itself (killed, or crashed)."""
        SHM_CREATIONS.unwatch(self)
        removed = self.shm.remove_leftovers()
        if self.tmpdir is not None:
            removed += self.tmpdir.clear()
        return removed

    def note_failed_restart(self, why: str) -> None:
        """A restart that never became ready, now stopped: `last_exit` says why it failed (the
        holder of its port, its deadline), not how we then stopped what was left of it; "killed
        by SIGTERM (stopped by the supervisor)" would blame us for what a stranger did."""
        self.last_exit = why

    def mark_failed(self, why: str) -> None:
        """The instance gave up on it; `last_exit` keeps saying how it ended."""
        self._set_state(ProcessState.FAILED, why)

    def park(self, detail: str) -> None:
        """Its instance parks (controller/parking.py): liveness paused before any CUDA call of
        it is locked, so a scheduler that cannot answer while parked is never taken for dead."""
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None
        self._set_state(ProcessState.PARKED, detail)

    def kill_parked(self, why: str) -> None:
        """A parked process's end (controller/parking.py, before its instance's stop): its cgroup
        killed at once, where the stop's SIGTERM would wait out its deadline (a checkpointed
        scheduler has nothing to drain; a held front end does not act on SIGTERM). Recorded as
        ours, so its exit is not taken for an unexpected one."""
        if self.spawned is None or self._exited.is_set():
            return
        self._stopping = True
        self.signals_sent[signal.SIGKILL] = why
        self.spawned.group.kill_all(signal.SIGKILL)

    def unpark(self, detail: str) -> None:
        """Restored (or a park that failed, brought back): ready again, liveness resumed."""
        self._set_state(ProcessState.READY, detail)
        if self.spawned is not None and not self._exited.is_set():
            self._start_liveness()


class RanSince:
    """Whether the processes of a cgroup other than its main one (SGLang's schedulers and
    detokenizer) used CPU time since the last look: a working scheduler always does."""

    def __init__(self, main_pid: int) -> None:
        self.main_pid = main_pid
        self.last: dict[int, int] = {}

    def since_last(self, pids: list[int]) -> bool:
        now = {pid: t for pid in pids if pid != self.main_pid and (t := cpu_ticks(pid)) is not None}
        moved = bool(self.last) and any(t > self.last.get(pid, -1) for pid, t in now.items())
        self.last = now
        return moved


def _ids_of(user: str | None) -> tuple[int, int]:
    """(uid, gid) a child of this user runs with; the daemon's own without a user."""
    if user is None:
        return os.geteuid(), os.getegid()
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return os.geteuid(), os.getegid()  # render() refuses unknown users before we get here
    return pw.pw_uid, pw.pw_gid
