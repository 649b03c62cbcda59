"""The controller: one object per instance that implements every verb, on one path.

    start            prepare the instance (engine: leftovers reclaimed, cgroup guarded) -> take
                     the transition lock -> validate (preflight.py, against the Backends chosen at
                     assembly) -> make room: the Transition chosen at assembly (transition.py: a
                     takeover on this machine, or the cluster's transition) -> start every process
                     in order (engine) -> on failure, the Transition rolls back what it stopped
    stop             every process in stop order
    restart          stop, then the very same start path (validation, lock, takeover, rollback)
    restart_process  one process alone, taken out of its router first (engine)
    run              the daemon's life: start, serve until told to stop or until the instance
                     gives up, stop; the exit status says which

The daemon (systemd's ExecStart), the D-Bus object and `gpusupctl rehearse` are thin callers:
they translate signals, method calls and command lines into these methods and report the
Outcome. D-Bus calls that take longer than a bus call may become Jobs their caller follows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..config.model import DaemonConfig, Profile
from ..engine.instance import Instance
from ..engine.states import State
from ..errors import (EXIT_GAVE_UP, EXIT_OK, EXIT_PRECONDITIONS, EXIT_TAKEOVER_FAILED, EXIT_USAGE, Busy, PreconditionError,
                      StartError, SupervisorError, TakeoverFailed)
from ..checks.preconditions import Requirement
from .backends import Backends
from . import parked
from .lock import TransitionLock
from .outcome import Job, Outcome
from .parking import Parker
from .preflight import validate
from .transition import LocalTransition, Transition

#: exit codes the unit tells systemd not to retry (a bad profile, a refusal, a failed takeover):
#: a restart that ends so keeps its code; any other failure of a restart asked for over D-Bus is
#: EXIT_GAVE_UP, final too, never 1, which systemd would retry by loading every server again
FINAL_EXITS = frozenset({EXIT_USAGE, EXIT_PRECONDITIONS, EXIT_TAKEOVER_FAILED})

#: (message, syslog priority, GPUSUP_EVENT=) to the journal: "transition", "rollback", "job"
Say = Callable[[str, int, str], None]
#: what runs between the instance's prepare and its start: the lock, the validation, the Transition
Preflight = Callable[[], Awaitable[None]]


class InstanceController:
    """Owns one instance's lifecycle; see the module docstring for the verbs."""

    def __init__(self, cfg: DaemonConfig, profile: Profile, instance: Instance, backends: Backends,
                 say: Say, transition: Transition, lock: TransitionLock,
                 on_transition: Callable[[float, str, str, str], None] | None = None,
                 wrap_preflight: Callable[[Preflight], Preflight] | None = None) -> None:
        self.cfg = cfg
        self.profile = profile
        self.instance = instance
        self.backends = backends
        self.say = say
        self.transition = transition
        self.on_transition = on_transition or (lambda _s, _f, _t, _o: None)
        self.wrap_preflight = wrap_preflight or (lambda preflight: preflight)  # metrics count refusals
        #: the machine's one transition at a time; the assembly owns it (and releases it at the end)
        self.lock = lock
        self.stop_requested = asyncio.Event()
        self.jobs: dict[int, Job] = {}
        self._stop_job: Job | None = None  # D-Bus Stop's job: one per life, done once stopped
        self._verb = asyncio.Lock()  # one verb at a time: a D-Bus Restart never interleaves with a stop
        #: a restart's start, while it runs: a stop cancels it rather than wait for the servers to load
        self._restarting: asyncio.Future[Outcome] | None = None
        self._ended: asyncio.Future[int] | None = None  # the exit code, once the instance's life is over

    # ------------------------------------------------------------------ start

    async def start(self) -> Outcome:
        """Bring the instance up on the one start path; the Outcome says what happened and why."""
        async with self._verb:
            return await self._start()

    async def _start(self) -> Outcome:
        began = time.monotonic()
        try:
            await self.instance.prepare()
            await self._make_room()
            await self._start_beside_peers()
        except SupervisorError as e:
            outcome = await self._after_failed_start(e)
            took_over = self.transition.took_over()
            self.on_transition(time.monotonic() - began, self.transition.came_from(), self.profile.name,
                               "rolled_back" if took_over and self.profile.rollback else outcome.state)
            return outcome
        finally:
            self.lock.release()
        if self.transition.took_over():
            self.on_transition(time.monotonic() - began, self.transition.came_from(), self.profile.name, "ok")
        return Outcome.done(f"ready in {time.monotonic() - began:.1f} s")

    async def _make_room(self) -> None:
        """Between the instance's prepare and its start: the lock, the validation, the Transition.
        Refused, the instance says so (FAILED); told to stop meanwhile, it is STOPPED."""

        async def checked() -> None:
            await self._acquire_lock()
            how = await asyncio.to_thread(validate, self.profile, self.cfg, self.backends)
            await self.transition.prepare(how, self.instance.set_transition)
            self.instance.set_transition("")

        try:
            await self.wrap_preflight(checked)()
        except SupervisorError as e:
            self.instance.refuse(e)
            raise
        except asyncio.CancelledError:
            self.instance.stopped_while_starting()
            raise

    async def _start_beside_peers(self) -> None:
        """The instance's start, failed at once when a part of the same start on another node
        fails (a profile spanning nodes whose transition we lead): ours may wait for theirs for
        ever, as rank 0 of a TP waits for rank 1, and would otherwise load on until its own
        start_timeout before the rollback began."""

        async def fail_when_a_peer_fails() -> None:
            try:
                await self.transition.peers_started()
            except SupervisorError as e:
                error = StartError(f"cluster transition to {self.profile.name}: {str(e).splitlines()[0]}")
                while not self.instance.fail_start(error):  # not yet begun: it begins at once
                    await asyncio.sleep(0.05)

        watching = asyncio.ensure_future(fail_when_a_peer_fails())
        try:
            await self.instance.start()
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)

    async def _acquire_lock(self) -> None:
        holder = self.lock.holder()
        if holder:
            self.instance.set_transition(f"waiting for the transition of {holder}")
        await self.lock.acquire()

    async def _ports_taken(self) -> list[str]:
        """After a failed start (everything of ours stopped): the profile's ports someone holds now."""
        from ..checks.ports import check_ports

        statuses = await asyncio.to_thread(check_ports, Requirement.of(self.profile).ports)
        return [p.problem() or f"port {p.address} not free" for p in statuses if not p.free and not p.error]

    async def _after_failed_start(self, error: SupervisorError) -> Outcome:
        """The reason, and what the Transition rolled back: in STATUS= and the journal.

        A start that failed after the preflight, once everything of ours is stopped, is checked
        against the profile's ports once more: one held now was taken while the servers loaded
        (the router's bind failed, or a stranger answered on its address), and that is the
        preflight's refusal come late, exit 3, final; not exit 1, which systemd retries by
        loading every server again into the same taken port."""
        reason = str(error).splitlines()[0]  # the instance has logged the whole error already
        if isinstance(error, StartError):
            taken = await self._ports_taken()
            if taken:
                error = PreconditionError(f"refusing to start: {'; '.join(taken)} (taken while {self.profile.name} "
                                          "was starting; what had started is stopped)")
                reason = str(error)
                self.say(reason, 3, "transition")
        rolled = await self.transition.roll_back(error, reason)
        if rolled is None:
            self.instance.fail(reason)
            return Outcome.of(error, reason)
        self.instance.fail(rolled)
        return Outcome.of(TakeoverFailed(rolled), rolled)

    # ------------------------------------------------------------------ stop, restart

    async def stop(self, why: str = "stop requested") -> Outcome:
        async with self._verb:
            took = await self._stop_instance(why)
        outcome = Outcome.done(f"stopped in {took:.1f} s")
        if self._stop_job is not None:
            self._stop_job.finish(outcome)
        return outcome

    async def _stop_instance(self, why: str) -> float:
        """The instance's stop; a parked one's through its Parker, and its parked record removed
        (a stop leaves nothing behind, and no record that would make a takeover pass it by)."""
        if self.parker is None or self.profile.name not in self.parker.parked:
            return await self.instance.stop(why)
        began = time.monotonic()
        await self.parker.stop(self.instance, why)
        parked.remove(self.cfg.runtime_dir, self.profile.name)
        return time.monotonic() - began

    async def restart(self) -> Outcome:
        """Stop every process, then the whole start path again (not a shortcut around it).

        A stop asked for meanwhile (SIGTERM, D-Bus Stop) wins: during the restart's own stop it
        waits for that stop (a stop is what it asks for), and the start is not begun; during the
        start, the start is cancelled as a stop while starting cancels it (what had started is
        stopped), so the stop is answered in its stop budget, not after the servers loaded."""
        async with self._verb:
            await self._stop_instance("restart requested")
            if self.stop_requested.is_set():
                return Outcome.failed("not started again: a stop was requested during the restart")
            starting = self._restarting = asyncio.ensure_future(self._start())
            try:
                outcome = await starting
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this restart itself is cancelled, not by a stop
                return Outcome.failed("cancelled: a stop was requested during the restart")
            finally:
                self._restarting = None
        if not outcome.ok:  # final either way: the unit's RestartPreventExitStatus=2 3 5 6
            self._end(outcome.exit_code if outcome.exit_code in FINAL_EXITS else EXIT_GAVE_UP)
        return outcome

    async def restart_process(self, name: str) -> Outcome:
        if name not in self.instance.processes:
            return Outcome("refused", f"no process {name!r} in {self.profile.name}", 2)
        if self.instance.state not in (State.READY, State.DEGRADED):
            return Outcome("refused", f"{self.profile.name} is {self.instance.state.value}, not ready", 3)
        async with self._verb:
            try:
                await self.instance.restart_process(name)
            except SupervisorError as e:
                return Outcome.of(e)
        proc = self.instance.processes[name]
        if proc.state != State.READY:
            return Outcome.failed(f"{name} is {proc.state.value}: {proc.last_exit}")
        return Outcome.done(f"{name} restarted")

    # ------------------------------------------------------------------ park, restore (issue 39)

    #: set by the assembly (daemon.py) where a checkpointer exists; else why parking is refused
    parker: Parker | None = None
    no_parking = "parking is not available in this daemon"

    async def park(self, next_name: str) -> Outcome:
        """Park this instance for `next_name` (controller/parking.py): drained, liveness paused,
        its CUDA processes in host memory, the GPUs verified at their baseline; recorded so that
        the next profile's takeover leaves it (controller/parked.py). Refused, nothing touched."""
        if self.parker is None:
            return Outcome("refused", f"refusing to park {self.profile.name}: {self.no_parking}", 3)
        async with self._verb:
            try:
                from ..config.loader import load_profile

                next_profile = await asyncio.to_thread(load_profile, self.cfg, next_name)
                record = await self.parker.park(self.instance, next_profile)
            except SupervisorError as e:
                return Outcome.of(e)
            parked.write(self.cfg.runtime_dir, record)
        return Outcome.done(f"parked in {record.took_s:.1f} s: {record.describe()}")

    async def restore(self) -> Outcome:
        """The switch back: the transition lock; our instances on this profile's GPUs or ports
        stopped and the GPUs verified idle (LocalTransition.clear_gpus_for_restore); then restored
        and one generation answered, or stopped and started cold, said so."""
        if self.parker is None or self.profile.name not in self.parker.parked:
            return Outcome("refused", f"{self.profile.name} is {self.instance.state.value}, not parked", 3)
        parker = self.parker
        async with self._verb:
            try:
                if not isinstance(self.transition, LocalTransition):
                    raise PreconditionError(f"{self.profile.name} spans nodes: parking is one machine's")
                await self._acquire_lock()
                await self.transition.clear_gpus_for_restore(self.instance.set_transition)
                self.instance.set_transition("")
                verdict = await parker.restore(self.instance, self.instance.start)
            except SupervisorError as e:
                self.instance.set_transition("")
                return Outcome.of(e)
            finally:
                self.lock.release()
                if self.profile.name not in parker.parked:
                    parked.remove(self.cfg.runtime_dir, self.profile.name)
        return Outcome.done(verdict.say)

    def request_stop(self) -> Job:
        """SIGTERM, D-Bus Stop: the life loop stops the instance (in order) and the daemon exits 0.
        Returns the stop's job (asked twice, the same one), done once every process has stopped."""
        if self._stop_job is None:
            self._stop_job = self._keep(Job("stop"))
        self.stop_requested.set()
        if self._restarting is not None and not self._restarting.done():
            self.instance.cancel_reason = "stopped while restarting" + self._taken_over_by()
            self._restarting.cancel()
        return self._stop_job

    # ------------------------------------------------------------------ jobs (the D-Bus verbs)

    def submit(self, verb: str, work: Callable[[], Awaitable[Outcome]]) -> Job:
        """Run a verb in the background and return its Job at once; a second one while a job runs
        is refused: the caller gets 'busy' rather than a pile of restarts on one instance."""
        running = next((j for j in self.jobs.values() if j.state == "running"), None)
        if running is not None:
            raise Busy(f"{self.profile.name} is busy with job {running.id} ({running.verb}); try again when it is done")
        job = self._keep(Job(verb))

        async def runner() -> None:
            try:
                outcome = await work()
            except SupervisorError as e:
                outcome = Outcome.of(e)
            except Exception as e:  # a bug of ours: still an outcome, and in the journal
                self.say(f"job {job.id} ({verb}) failed: {e!r}", 3, "job")
                outcome = Outcome.failed(f"internal error: {e.__class__.__name__}: {e}")
            job.finish(outcome)
            self.say(f"job {job.id} ({verb}): {outcome.state}" + (f": {outcome.reason}" if outcome.reason else ""),
                     6 if outcome.ok else 4, "job")

        asyncio.get_running_loop().create_task(runner())
        return job

    def _keep(self, job: Job) -> Job:
        """Keep `job` for GetJob: the last 32."""
        self.jobs[job.id] = job
        while len(self.jobs) > 32:
            del self.jobs[min(self.jobs)]
        return job

    # ------------------------------------------------------------------ the daemon's life

    def _end(self, code: int) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(code)

    async def run(self, on_ready: Callable[[], None] | None = None, stop_after_ready: bool = False) -> int:
        """Start; serve until a stop is asked for or the instance gives up; stop. Returns the exit
        status: 0 stopped (also when stopped while starting), 2 bad profile, 3 refused (GPUs or
        ports held by someone else, nothing touched), 5 a takeover failed (rolled back), 6 the
        restart limit reached (final: the unit does not retry it), 1 any other failure."""
        loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        starting = asyncio.ensure_future(self.start())
        told = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait({starting, told}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # told to stop while starting: the start is abandoned, what started stops
            self.instance.cancel_reason = "stopped while starting" + self._taken_over_by()
            starting.cancel()
            try:
                await starting
            except asyncio.CancelledError:
                pass
            if self._stop_job is not None:
                self._stop_job.finish(Outcome.done("stopped while starting"))
            return EXIT_OK
        told.cancel()
        outcome = starting.result()
        if not outcome.ok:
            return outcome.exit_code
        if on_ready is not None:
            on_ready()
        if not stop_after_ready:
            failed = asyncio.ensure_future(self.instance.failed.wait())
            told = asyncio.ensure_future(self.stop_requested.wait())
            waits: set[asyncio.Future[Any]] = {failed, told, self._ended}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            told.cancel()
            if self._ended.done():
                return self._ended.result()
            if self.instance.failed.is_set():
                return EXIT_GAVE_UP
        await self.stop("stop requested" + self._taken_over_by())
        return EXIT_OK

    def _taken_over_by(self) -> str:
        """": tp4-512k (pid 4711) is taking over" when another instance's transition holds the lock
        as we are told to stop (it is the one stopping us), else "": the loser says who won."""
        winner = self.lock.holder()
        if winner and not winner.startswith(f"{self.profile.name} "):
            return f": {winner} is taking over (it holds the transition lock)"
        return ""

