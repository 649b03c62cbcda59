"""An instance: one profile running. Ordered, parallel-where-possible start; ordered stop; restarts.

The instance lives on one asyncio loop. It owns its own state and orders its processes'
lives; each process owns its state and its restart ledgers (engine/process.py, restarts.py),
and the instance changes them only through the process's methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from .. import records
import os
import time
from ..records import dataclass, field
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from ..config.model import ProcessSpec, Profile
from ..config.render import Launch
from ..config.sharing import sharers, start_waits
from ..errors import PreconditionError, StartError, SupervisorError, one_line
from ..ownership.base import OwnershipDriver
from .events import Event, Listener, LogSink
from .process import START_STALL_S, Again, ManagedProcess, ProcessStatus
from .states import INSTANCE_MOVES, InstanceState, ProcessState, check_move
from .traffic import RouterWorkers, wait_drained

class Gate(Protocol):
    """Order against processes this daemon does not run (cluster/gate.py: the other nodes')."""

    async def before_start(self, spec: ProcessSpec) -> None: ...

    async def before_stop(self, wave: list[ProcessSpec]) -> None: ...

    def close(self) -> None:
        """After the instance's last stop (the daemon's exit)."""


TRAFFIC_API_TIMEOUT_S = 10.0  # the router takes a removal in well under a second
TRAFFIC_RESTORE_TIMEOUT_S = 120.0  # its health check of the new worker costs SGLang's /health (>= 1 s), then retries


@dataclass
class InstanceStatus:
    name: str
    state: str
    reason: str
    since: float
    started_at: float | None
    ready_at: float | None
    driver: str
    processes: list[ProcessStatus] = field(default_factory=list)
    transition: str = ""

    def to_json(self) -> dict[str, object]:
        """The stable shape of `gpusupctl status --json` and of D-Bus GetStatus (see the README)."""
        data = records.asdict(self)
        data["instance"] = data.pop("name")
        data["snapshot_at"] = time.time()
        return data


class Instance:
    def __init__(
        self,
        profile: Profile,
        launches: list[Launch],
        owner: OwnershipDriver,
        sink: LogSink,
        leftovers: str = "clean",
        base_env: Mapping[str, str] | None = None,
        gate: Gate | None = None,
        start_stall_s: float = START_STALL_S,
    ) -> None:
        self.profile = profile
        self.gate = gate
        self.name = profile.name
        self.owner = owner
        self.sink = sink
        self.leftovers = leftovers
        self.listeners: list[Listener] = []
        self.state = InstanceState.STOPPED
        self.reason = ""
        self.since = time.time()
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.transition = ""
        self.last_stop_s: float | None = None
        self.last_start_s: float | None = None
        env = dict(os.environ if base_env is None else base_env)
        self.processes: dict[str, ManagedProcess] = {}
        for launch in launches:
            proc = ManagedProcess(self.name, launch, owner, sink, self._emit, env, start_stall_s)
            proc.on_unexpected_exit = self._on_unexpected_exit
            self.processes[launch.spec.name] = proc
        self._restart_tasks: dict[str, asyncio.Task[None]] = {}
        self._start_abort: asyncio.Event | None = None
        #: why a start was cancelled ("stopped while starting: pd-1p1d is taking over"), set by who cancels it
        self.cancel_reason = ""
        self._start_failure: StartError | None = None
        self._start_began: float | None = None  # set by prepare: the start's time counts its transition
        self._lock = asyncio.Lock()
        #: the servers on a shared GPU restart one at a time, as they start (config/sharing.py)
        self._sharing = {u.name for users in sharers(profile.processes).values() for u in users}
        self._gpu_turn = asyncio.Lock()
        self.failed = asyncio.Event()  # set when the instance gives up (restart limit)
        #: while parked: each server's router API, to route to it again on restore
        self._parked_workers: dict[str, RouterWorkers | None] = {}
        #: while parked: the processes stopped for the next profile (a router in its way), to start again
        self._stopped_while_parked: list[str] = []

    # ------------------------------------------------------------------ events and status

    def _emit(self, event: Event) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception as e:  # a broken listener must not break supervision
                self.sink.event(f"listener failed: {e!r}", 4)

    def _set_state(self, state: InstanceState, reason: str = "") -> None:
        """The one place its state changes: checked against INSTANCE_MOVES (engine/states.py)."""
        check_move(INSTANCE_MOVES, f"instance {self.name}", self.state, state,
                   lambda why: self.sink.event(why, 3, GPUSUP_EVENT="illegal-state-move"))
        self.state, self.reason, self.since = state, reason, time.time()
        self._emit(Event("instance", self.name, reason or state.value, state=state.value))

    def set_transition(self, text: str) -> None:
        """Where a transition is (shown in STATUS= and `gpusupctl status`); "" when none."""
        self.transition = text
        self._emit(Event("transition", self.name, text, state=self.state.value))

    def status(self) -> InstanceStatus:
        return InstanceStatus(
            name=self.name,
            state=self.state.value,
            reason=self.reason,
            since=self.since,
            started_at=self.started_at,
            ready_at=self.ready_at,
            driver=self.owner.name,
            processes=[self.processes[p.name].status() for p in self.profile.processes],
            transition=self.transition,
        )

    # ------------------------------------------------------------------ start

    def fail(self, reason: str) -> None:
        """The instance failed for `reason` (one line, our words): STATUS= and every reader say so."""
        self.transition = ""
        self._set_state(InstanceState.FAILED, reason.splitlines()[0] if reason else "failed")

    async def prepare(self) -> None:
        """A start's first step: leftovers of an earlier run reclaimed, our cgroup guarded; STARTING
        ("checking"). The controller then makes room (its Transition) and calls `start`. Refused, the
        instance is FAILED with the reason, raised; cancelled (told to stop), it is STOPPED."""
        async with self._lock:
            self._start_began = time.monotonic()
            self.started_at = time.time()
            self.cancel_reason = ""
            self._set_state(InstanceState.STARTING, "checking")
            try:
                cleaned = await self.owner.reclaim_leftovers(self.name, self.leftovers, list(self.processes))
                self.owner.guard(self.name)
                for item in cleaned:
                    self.sink.event(f"cleaned leftover cgroup of a previous run: {item}", 4, GPUSUP_EVENT="leftover")
            except SupervisorError as e:
                self.refuse(e)
                raise
            except asyncio.CancelledError:
                self.stopped_while_starting()
                raise

    def refuse(self, error: SupervisorError) -> None:
        """A start refused before anything ran (a leftover, a precondition, a transition): said once, here."""
        self._start_began = None
        self.sink.event(str(error), 3, GPUSUP_EVENT="start-refused")
        self.fail(str(error))

    async def start(self) -> None:
        """After `prepare` (and the controller's transition): bring every process to ready, or leave
        nothing running and raise. Cancelled (told to stop while starting), it stops what it started
        and says so: "stopped while starting". Not prepared (nothing to make room for), it prepares first."""
        if self._start_began is None:
            await self.prepare()
        async with self._lock:
            began = self._start_began if self._start_began is not None else time.monotonic()
            self._start_began = None
            self._set_state(InstanceState.STARTING)
            try:
                await self._start_all()
            except asyncio.CancelledError:
                await self._stop_all()
                self.stopped_while_starting()
                raise
            except BaseException as e:
                e = first_cause(e)
                if isinstance(e, asyncio.CancelledError):
                    await self._stop_all()
                    self.stopped_while_starting()
                    raise
                reason = str(e) if isinstance(e, SupervisorError) else f"start-up interrupted: {e.__class__.__name__}: {e}"
                self.sink.event(f"start failed, stopping what was started: {reason}", 3, GPUSUP_EVENT="start-failed")
                await self._stop_all()
                self.fail(reason)
                if isinstance(e, SupervisorError):
                    raise e from None
                raise StartError(reason) from e
            self.last_start_s = time.monotonic() - began
            self.ready_at = time.time()
            self._set_state(InstanceState.READY)
            self.sink.event(
                f"instance ready in {self.last_start_s:.2f} s",
                6,
                GPUSUP_EVENT="instance-ready",
                GPUSUP_DURATION_S=f"{self.last_start_s:.3f}",
            )

    async def _start_all(self) -> None:
        ready: dict[str, asyncio.Event] = {name: asyncio.Event() for name in self.processes}
        all_up = asyncio.Event()
        self._start_abort = start_abort = asyncio.Event()
        self._start_failure = None
        # its `after`, and the servers before it on a GPU it shares (their pools are taken at start)
        waits = start_waits(self.profile.processes)

        async def bring_up(proc: ManagedProcess) -> None:
            for dep in waits[proc.name]:
                await ready[dep].wait()
            if self.gate is not None:
                await self.gate.before_start(proc.spec)
            await proc.start()
            await proc.wait_ready()
            ready[proc.name].set()
            if all(e.is_set() for e in ready.values()):
                all_up.set()

        async def watch() -> None:
            # A process that dies after its own readiness but before the instance is ready fails
            # the start (naming it); the restart policy only applies to a ready instance.
            done = asyncio.ensure_future(all_up.wait())
            abort = asyncio.ensure_future(start_abort.wait())
            await asyncio.wait({done, abort}, return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
            abort.cancel()
            if self._start_failure is not None:
                raise self._start_failure

        try:
            async with asyncio.TaskGroup() as tg:  # the first failure cancels the siblings
                tg.create_task(watch())
                for spec in self.profile.processes:
                    tg.create_task(bring_up(self.processes[spec.name]))
        finally:
            self._start_abort = None  # fail_start now finds no start under way
        if self._start_failure is not None:  # failed from outside after all were up, before ready
            raise self._start_failure

    def stopped_while_starting(self) -> None:
        self._start_began = None
        why = self.cancel_reason or "stopped while starting"
        self.sink.event(f"{why}; what had started is stopped", 4, GPUSUP_EVENT="stopped-while-starting")
        self.transition = ""
        self._set_state(InstanceState.STOPPED, why)

    # ------------------------------------------------------------------ stop

    async def stop(self, reason: str = "") -> float:
        """Stop every process in the profile's stop order; returns seconds taken. A crash restart
        under way is cancelled and waited for first: the stop must never run beside its start."""
        recovering = [t for t in self._restart_tasks.values() if t is not asyncio.current_task()]
        for task in recovering:
            task.cancel()
        await asyncio.gather(*recovering, return_exceptions=True)
        async with self._lock:
            self._set_state(InstanceState.STOPPING, reason)
            took = await self._stop_all()
            self._set_state(InstanceState.STOPPED, reason)
            return took

    async def _stop_all(self) -> float:
        began = time.monotonic()
        for wave in self.profile.stop_waves:
            if self.gate is not None:
                await self.gate.before_stop([self.processes[name].spec for name in wave])
            await asyncio.gather(*(self.processes[name].stop() for name in wave))
        self.last_stop_s = time.monotonic() - began
        self.ready_at = None
        self.sink.event(
            f"all processes stopped in {self.last_stop_s:.3f} s (order: {self.profile.describe_stop_order()})",
            6,
            GPUSUP_EVENT="instance-stopped",
            GPUSUP_DURATION_S=f"{self.last_stop_s:.3f}",
        )
        return self.last_stop_s

    # ------------------------------------------------------------------ parking

    async def park(self, suspend: Callable[[], Awaitable[str]], stop: Mapping[str, str] | None = None) -> None:
        """Take it out of traffic, stop the processes in `stop` (name -> why: a router whose port
        the next profile needs, controller/parking.py decides which), pause every other
        process's liveness, then `suspend` (the controller's checkpoint and baseline check),
        which returns the reason to show ("parked: 0 MiB on the GPU, 21.7 GB host ...").
        A `suspend` that raises leaves it as it was: liveness back, what was stopped started
        again, traffic back, READY, the error raised on; a router that then does not start
        again gives up on the instance (everything stopped, FAILED), as a failed restart does.

        The engine knows nothing of checkpoints (parking/ is its own package): it only owns
        what parking means to supervision, which is: no requests routed, no liveness, its own."""
        stop = dict(stop or {})
        async with self._lock:
            if self.state != InstanceState.READY:
                raise PreconditionError(f"{self.name} is {self.state.value}, not ready: it is not parked")
            workers: dict[str, RouterWorkers | None] = {}
            for proc in self.processes.values():
                if proc.spec.kind != "router":
                    workers[proc.name] = await self._out_of_traffic(proc)
                    if workers[proc.name] is None and proc.exit_code is None:
                        await wait_drained(proc.spec, proc.spec.stop_timeout_s)
            await self._stop_while_parked(stop)  # drained: nothing in flight goes with them
            for proc in self.processes.values():
                if proc.name not in stop:
                    proc.park("parking")
            try:
                reason = await suspend()
            except BaseException as error:
                try:
                    await self._unpark(workers, "park failed: brought back")
                except StartError as e:
                    why = f"park failed ({one_line(str(error))[:200]}) and {e}"
                    failed = next((n for n in self._stopped_while_parked if self.processes[n].state != ProcessState.READY),
                                  self._stopped_while_parked[0])
                    await self._stop_and_fail(self.processes[failed], why)
                    raise StartError(why) from None
                raise
            self._parked_workers = workers
            self._set_state(InstanceState.PARKED, reason)

    async def _stop_while_parked(self, stop: Mapping[str, str]) -> None:
        """The processes a park stops (a router in the next profile's way), in the profile's stop
        order, each stop as any other (SIGTERM, its deadline, its cgroup emptied), and said why.
        Stopped by us, they are not crashed: no liveness, no restart (`_stopping`), STOPPED."""
        self._stopped_while_parked = [name for wave in self.profile.stop_waves for name in wave if name in stop]
        for wave in self.profile.stop_waves:
            procs = [self.processes[name] for name in wave if name in stop]
            await asyncio.gather(*(proc.stop(why=stop[proc.name]) for proc in procs))
            for proc in procs:
                self.sink.event(f"{proc.name}: {stop[proc.name]}", 6, GPUSUP_PROCESS=proc.name,
                                GPUSUP_EVENT="stopped-while-parked")

    async def _start_stopped_while_parked(self) -> None:
        """Each process the park stopped, started again as a restart starts it (`_start_again`)
        and ready (a router: every worker of the profile healthy in it); in the stop order
        reversed. Raises StartError naming it; what it started stays for the caller's stop."""
        for name in reversed(self._stopped_while_parked):
            try:
                await self._start_again(self.processes[name], None)
            except StartError as e:
                first = str(e).splitlines()[0].removeprefix(f"{name}: ")
                raise StartError(f"{name}, stopped while parked, does not start again: {first}") from None
        self._stopped_while_parked = []

    async def resume(self, restore: Callable[[], Awaitable[None]],
                     prove: Callable[[], Awaitable[None]] | None = None) -> None:
        """`restore` (the controller's restore of each process), then liveness back, the
        processes the park stopped started again (a router needs its servers restored to be
        ready), traffic back, then `prove` (one generation: through the router, where there is
        one, it needs the servers routed to again, so it comes after them), READY. A `restore`,
        a start or a `prove` that raises leaves it PARKED: the caller stops it and starts it
        cold (controller/parking.py says so)."""
        async with self._lock:
            if self.state != InstanceState.PARKED:
                raise PreconditionError(f"{self.name} is {self.state.value}, not parked: nothing to restore")
            await restore()
            await self._unpark(self._parked_workers, "restored")
            self._parked_workers = {}
            if prove is not None:
                await prove()
            self._set_state(InstanceState.READY, "restored")

    async def _unpark(self, workers: Mapping[str, RouterWorkers | None], detail: str) -> None:
        for proc in self.processes.values():
            if proc.state == ProcessState.PARKED:
                proc.unpark(detail)
        await self._start_stopped_while_parked()
        for name, w in workers.items():
            await self._back_in_traffic(self.processes[name], w)

    # ------------------------------------------------------------------ restarts

    def fail_start(self, error: StartError) -> bool:
        """Fail the start under way with `error` (what had started is stopped, as for any failed
        start); False when no start is under way (not yet begun, or over)."""
        if self.state != InstanceState.STARTING or self._start_abort is None:
            return False
        if self._start_failure is None:  # the first cause is the one reported
            self._start_failure = error
        self._start_abort.set()
        return True

    def _on_unexpected_exit(self, proc: ManagedProcess) -> None:
        if self.state == InstanceState.STARTING:  # the start fails naming it (or, failing, stops the rest): no restart
            self.fail_start(StartError(proc._failure(f"exited during start-up ({proc.last_exit})")))
            return
        # PARKED: it died between its restore and the restore's proof of serving, which then
        # fails, and the profile is started cold (controller/parking.py); no restart beside that
        if (self.state in (InstanceState.STOPPING, InstanceState.STOPPED, InstanceState.FAILED, InstanceState.PARKED)
                or proc.name in self._restart_tasks):
            return
        task = self._restart_tasks[proc.name] = asyncio.get_running_loop().create_task(self._recover(proc))
        task.add_done_callback(self._recovery_ended)

    def _recovery_ended(self, task: asyncio.Task[None]) -> None:
        """A crash recovery must not end silently: an error of ours in it (an illegal state move
        under the tests, say) is named, where nobody awaits the task."""
        if not task.cancelled() and task.exception() is not None:
            self.sink.event(f"crash recovery failed: {task.exception()!r}", 2, GPUSUP_EVENT="restart-error")

    async def restart_process(self, name: str) -> None:
        """An operator's restart of one process: stopped in its own time (the drain is whole), started
        at once, and counted toward nothing (engine/restarts.py). A start that fails gives up on the
        instance, as it would at a start: the operator is watching, and the policy is for crashes.

        Refused unless the instance is ready or degraded: a stop may have come between the caller's
        look and this call, and a process started again in a stopped instance would run unsupervised."""
        if name not in self.processes:
            raise KeyError(name)
        if self.state not in (InstanceState.READY, InstanceState.DEGRADED):
            raise PreconditionError(f"{self.name} is {self.state.value}, not ready: {name} is not restarted")
        proc = self.processes[name]
        self._set_state(InstanceState.DEGRADED, f"{proc.name} restarting (requested)")
        try:
            workers = await self._out_of_traffic(proc)
            await proc.stop()
            await self._bring_back(proc, workers, "request")
        except StartError as e:
            await self._give_up(proc, str(e))

    def _router_of(self, proc: ManagedProcess) -> ManagedProcess | None:
        """The router of this instance that sends traffic to `proc`, if any."""
        for other in self.processes.values():
            spec = other.spec
            if spec.kind == "router" and proc.name in (*spec.workers, *spec.prefill, *spec.decode):
                return other
        return None

    async def _out_of_traffic(self, proc: ManagedProcess) -> RouterWorkers | None:
        """Before `proc` stops alone: take it out of its router, then let what it accepted finish.

        SGLang keeps accepting requests after SIGTERM and never drains while traffic reaches
        it; removed from the router, it gets none, and its own drain ends. Returns the router's
        worker API to put it back with, or None when no serving router fronts it.
        """
        router = self._router_of(proc)
        if router is None or router.state != ProcessState.READY:
            return None
        workers = router.router_api()  # the instance's control-plane key, only to the router's own process
        began = time.monotonic()
        why = await workers.withdraw(proc.spec, timeout=TRAFFIC_API_TIMEOUT_S)
        if why:
            self.sink.event(f"{proc.name}: could not take it out of {router.name}: {why}; stopping it anyway", 4,
                            GPUSUP_PROCESS=proc.name, GPUSUP_EVENT="traffic")
            return workers
        left = None if proc.exit_code is not None else await wait_drained(proc.spec, proc.spec.stop_timeout_s)
        drained = "" if left is None else (f"; {left} request(s) still in flight at its deadline" if left
                                            else "; nothing in flight")
        self.sink.event(f"{proc.name}: taken out of {router.name} in {time.monotonic() - began:.2f} s{drained}", 6,
                        GPUSUP_PROCESS=proc.name, GPUSUP_EVENT="traffic")
        return workers

    async def _back_in_traffic(self, proc: ManagedProcess, workers: RouterWorkers | None) -> None:
        if workers is None:
            return
        why = await workers.restore(proc.spec, timeout=TRAFFIC_RESTORE_TIMEOUT_S)
        self.sink.event(f"{proc.name}: " + (f"not back in {workers.router.name}: {why}" if why
                                             else f"back in {workers.router.name}"),
                        4 if why else 6, GPUSUP_PROCESS=proc.name, GPUSUP_EVENT="traffic")

    async def _recover(self, proc: ManagedProcess) -> None:
        """Crash recovery, the restart policy's: `proc` died after ready. Restarted after its backoff
        while the policy's window and limit allow (its crash ledger), else the instance gives up.
        Runs as the process's restart task, which a stop cancels."""
        policy = self.profile.restart
        try:
            verdict = proc.crash_restarts.admit(policy, proc.exit_code, time.monotonic())
            if not verdict.allowed:
                await self._give_up(proc, f"{proc.name} {proc.last_exit}; {verdict.refusal}")
                return
            self._set_state(InstanceState.DEGRADED, f"{proc.name} restarting ({verdict.attempt}/{policy.max_restarts}): "
                                                    f"{proc.last_exit}")
            proc.await_restart(verdict)
            self.sink.event(
                f"{proc.name}: {proc.exit_report}; restart {verdict.attempt}/{policy.max_restarts} in {verdict.delay_s:g} s",
                4,
                GPUSUP_PROCESS=proc.name,
                GPUSUP_EVENT="restart",
            )
            workers = await self._out_of_traffic(proc)  # dead: the router must stop sending to it now
            await proc.stop(timeout=0.0)  # nothing of the dead one may linger (orphaned schedulers)
            await asyncio.sleep(verdict.delay_s)
            await self._bring_back(proc, workers, "crash")
        except StartError as e:
            # it died again before it was ready, or never became ready: one more crash, through the
            # same policy. Why it failed (a stranger on its port, named) is what the journal, STATUS=
            # and the final reason say; not our own SIGTERM of what was left of it.
            why = f"not ready after its restart: {str(e).splitlines()[0].removeprefix(f'{proc.name}: ')}"
            self.sink.event(f"{proc.name}: restart failed: {e}", 3, GPUSUP_PROCESS=proc.name,
                            GPUSUP_EVENT="restart-failed")
            proc.on_unexpected_exit = None
            try:  # still this process's restart task meanwhile: a stop cancels it and waits for it
                await proc.stop(timeout=0.0)
            finally:
                proc.on_unexpected_exit = self._on_unexpected_exit
            proc.note_failed_restart(why)
            self._restart_tasks.pop(proc.name, None)
            self._on_unexpected_exit(proc)
        finally:
            if self._restart_tasks.get(proc.name) is asyncio.current_task():
                self._restart_tasks.pop(proc.name, None)

    async def _bring_back(self, proc: ManagedProcess, workers: RouterWorkers | None, again: Again) -> None:
        """Start `proc` again (stopped now), wait for it, put it back behind its router; the
        instance is READY again once every process is (and nothing gave up meanwhile). A server on a
        shared GPU waits for its turn: two sharers that crashed together must not size their
        memory pools at the same moment."""
        await self._start_again(proc, again)
        await self._back_in_traffic(proc, workers)
        if self.state == InstanceState.DEGRADED and all(p.state == ProcessState.READY for p in self.processes.values()):
            self._set_state(InstanceState.READY)

    async def _start_again(self, proc: ManagedProcess, again: Again | None) -> None:
        """Start `proc` (stopped now) and wait until it is ready: a restart's (`again`), or a
        router's stopped while parked (None: not a restart of any ledger). A server on a shared
        GPU waits for its turn (sharers size their memory pools one at a time)."""
        async with self._gpu_turn if proc.name in self._sharing else contextlib.nullcontext():
            await proc.start(again)
            await proc.wait_ready()

    async def _give_up(self, proc: ManagedProcess, why: str) -> None:
        for task in list(self._restart_tasks.values()):  # another process's backoff must not start it again
            if task is not asyncio.current_task():
                task.cancel()
        async with self._lock:  # never interleaved with a start or a stop
            await self._stop_and_fail(proc, why)

    async def _stop_and_fail(self, proc: ManagedProcess, why: str) -> None:
        """Giving up, with the instance's lock held: every process stopped, `proc` and the
        instance FAILED for `why`, `failed` set (the daemon's life ends on it)."""
        self.sink.event(f"giving up: {why}; stopping the instance", 3, GPUSUP_EVENT="failed", GPUSUP_PROCESS=proc.name)
        self._set_state(InstanceState.STOPPING, why)
        await self._stop_all()
        proc.mark_failed(why)
        self._set_state(InstanceState.FAILED, why)
        self.failed.set()


def first_cause(exc: BaseException) -> BaseException:
    """The error that made a TaskGroup fail, rather than the group that wraps it."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = inner[0] if inner else exc.exceptions[0]
    return exc
