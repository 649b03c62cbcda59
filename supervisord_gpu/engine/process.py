"""One supervised process: spawn into its own group, read its lines, observe readiness, stop.

All waiting is on events (a probe answer, a log line, the child's exit, `cgroup.events`);
the only timers are deadlines and the probe interval.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..config.render import Launch
from ..errors import StartError
from ..ownership.base import OwnershipDriver, Spawned, SpawnRequest
from . import phases
from .events import Event, LogSink
from .probe import http_status
from .states import State

TAIL_LINES = 20
KILL_GRACE_S = 5.0  # after SIGKILL of the whole cgroup, how long until we call it stuck
LINE_LIMIT = 1 << 20


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


class ManagedProcess:
    def __init__(
        self,
        instance: str,
        launch: Launch,
        owner: OwnershipDriver,
        sink: LogSink,
        emit: Callable[[Event], None],
        base_env: Mapping[str, str],
    ) -> None:
        self.instance = instance
        self.launch = launch
        self.spec = launch.spec
        self.name = launch.spec.name
        self.owner = owner
        self.sink = sink
        self.emit = emit
        self.base_env = base_env
        self.state = State.STOPPED
        self.spawned: Spawned | None = None
        self.phase = ""
        self.phase_since = time.monotonic()
        self.ready_since: float | None = None
        self.restart_times: list[float] = []
        self.restarts_total = 0
        self.last_exit = ""
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.history: collections.deque[Readiness] = collections.deque(maxlen=50)
        self.exit_code: int | None = None
        self.exited_at: float | None = None  # monotonic time the main process was reaped
        self.last_line_at: float | None = None  # monotonic; "making progress" for the start timeout
        self.last_stop_s: float | None = None
        self.phase_durations: dict[str, float] = {}
        self._exited = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._liveness: asyncio.Task[None] | None = None
        self._stopping = False
        #: a router's readiness needs all of its workers healthy, not just one
        self.expected_workers = len(self.spec.workers) + len(self.spec.prefill) + len(self.spec.decode)
        #: called with this process when it exits on its own while ready or restarting
        self.on_unexpected_exit: Callable[["ManagedProcess"], None] | None = None

    # ------------------------------------------------------------------ state

    def _set_state(self, state: State, detail: str = "") -> None:
        if state == self.state and not detail:
            return
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
        )

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Spawn into a fresh group; returns as soon as the child runs (not when it is ready)."""
        self._exited = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopping = False
        self.exit_code = None
        self.tail.clear()
        self.phase_durations = {}
        self._set_state(State.STARTING if not self.restart_times else State.RESTARTING)
        self._set_phase(phases.LAUNCHED)
        req = SpawnRequest(
            instance=self.instance,
            process=self.name,
            argv=self.launch.argv,
            env=self.launch.environment(self.base_env),
            user=self.launch.user,
        )
        self.spawned = await self.owner.spawn(req)
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

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        stream._limit = LINE_LIMIT  # type: ignore[attr-defined]  # SGLang can print long lines
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line longer than the limit: forward it in pieces
                raw = await stream.read(LINE_LIMIT)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.tail.append(line)
            self.last_line_at = time.monotonic()
            self.sink.child_line(self.instance, self.name, line, name, phases.priority_of(line))
            phase = phases.phase_of(line)
            if phase is not None:
                self._set_phase(phase)
                self._wake.set()

    async def _watch_exit(self) -> None:
        assert self.spawned is not None
        code = await self.spawned.proc.wait()
        self.exit_code = code
        self.exited_at = time.monotonic()
        self.last_exit = describe_exit(code)
        self._exited.set()
        self._wake.set()
        if not self._stopping:
            self.sink.event(
                f"{self.name}: exited unexpectedly ({self.last_exit})",
                3,
                GPUSUP_PROCESS=self.name,
                GPUSUP_EVENT="exit",
            )
            if self.state in (State.READY,) and self.on_unexpected_exit is not None:
                self.on_unexpected_exit(self)

    async def wait_ready(self) -> None:
        """Probe until 200, the deadline, or the process's death; raises StartError on the latter two."""
        spec = self.spec
        started = time.monotonic()
        deadline = started + spec.start_timeout_s
        host = spec.probe_host
        while True:
            if self._exited.is_set():
                raise StartError(self._failure(f"exited during start-up ({self.last_exit})"))
            status = await self._probe_unless_exited(host)
            if status == 200 and not self._exited.is_set():
                self.ready_since = time.time()
                self.phase_durations["total"] = time.monotonic() - started
                self._set_phase(phases.SERVING)
                self._set_state(State.READY)
                self._liveness = asyncio.get_running_loop().create_task(self._watch_liveness())
                self.sink.event(
                    f"{self.name}: ready ({spec.probe.path} answered 200 on {host}:{spec.port} after "
                    f"{time.monotonic() - started:.2f} s)",
                    6,
                    GPUSUP_PROCESS=self.name,
                    GPUSUP_EVENT="ready",
                    GPUSUP_DURATION_S=f"{time.monotonic() - started:.3f}",
                )
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartError(
                    self._failure(
                        f"not ready within its start_timeout of {spec.start_timeout_s:g} s "
                        f"(phase: {self.phase}; last probe: {status or 'no answer'})"
                    )
                )
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), min(spec.probe.interval_s, remaining))
            except asyncio.TimeoutError:
                pass

    async def _probe_unless_exited(self, host: str) -> int | None:
        """One readiness probe, abandoned the moment the process exits (a hung listener on a stolen
        port would otherwise hold us for the whole probe timeout)."""
        spec = self.spec
        probe = asyncio.ensure_future(http_status(host, spec.port, spec.probe.path, spec.probe.timeout_s, self.expected_workers))
        exited = asyncio.ensure_future(self._exited.wait())
        await asyncio.wait({probe, exited}, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if not probe.done():
            probe.cancel()
            return None
        return probe.result()

    async def _watch_liveness(self) -> None:
        """After ready: a process that stops answering (hung, SIGSTOPped, deadlocked) is killed with its
        cgroup after `failures` misses in a row; its exit then goes through the restart policy."""
        spec, probe = self.spec, self.spec.probe
        misses = 0
        while True:
            await asyncio.sleep(probe.liveness_interval_s)
            if self.state != State.READY or self._exited.is_set() or self.spawned is None:
                return
            status = await http_status(spec.probe_host, spec.port, probe.liveness_path, probe.timeout_s)
            if status == 200:
                misses = 0
                continue
            misses += 1
            if misses >= probe.failures:
                self.sink.event(
                    f"{self.name}: {probe.liveness_path} failed {misses} times in a row ({status or 'no answer'}); "
                    "killing its cgroup so the restart policy can bring it back",
                    3, GPUSUP_PROCESS=self.name, GPUSUP_EVENT="unhealthy",
                )
                self.spawned.group.kill_all()
                return

    def _failure(self, why: str) -> str:
        tail = "\n".join(f"    {line}" for line in list(self.tail)[-10:])
        return f"{self.name}: {why}" + (f"; last lines:\n{tail}" if tail else "")

    # ------------------------------------------------------------------ stop

    async def stop(self, timeout: float | None = None) -> float:
        """SIGTERM the main process, SIGKILL the whole group at the deadline; returns seconds taken.

        Once the main process has exited, whatever is left in its group (a detached scheduler)
        is an orphan: it is killed at once rather than waited for.
        """
        if self.spawned is None:
            self._set_state(State.STOPPED)
            return 0.0
        timeout = self.spec.stop_timeout_s if timeout is None else timeout
        self._stopping = True
        if self._liveness is not None:
            self._liveness.cancel()
        began = time.monotonic()
        self._set_state(State.STOPPING)
        group = self.spawned.group
        if not self._exited.is_set():
            try:
                os.kill(self.spawned.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(self._exited.wait(), timeout)
            except asyncio.TimeoutError:
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
        await self._exited.wait()
        for task in self._tasks:
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 1.0)
                except (asyncio.TimeoutError, Exception):
                    task.cancel()
        await group.release()
        took = time.monotonic() - began
        self.last_stop_s = took
        # The supervisor's own share: from the main process being reaped to "stopped" declared.
        detect = time.monotonic() - self.exited_at if self.exited_at else 0.0
        self.ready_since = None
        self._set_phase("")
        self._set_state(State.STOPPED)
        self.sink.event(
            f"{self.name}: stopped in {took:.3f} s ({self.last_exit}"
            + (f"; killed {len(leftovers)} leftover process(es) in its group" if leftovers else "")
            + ")",
            6,
            GPUSUP_PROCESS=self.name,
            GPUSUP_EVENT="stopped",
            GPUSUP_DURATION_S=f"{took:.3f}",
            GPUSUP_EXIT_TO_STOPPED_S=f"{detect:.6f}",
        )
        return took

    def mark_failed(self, why: str) -> None:
        self.last_exit = why
        self._set_state(State.FAILED, why)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
