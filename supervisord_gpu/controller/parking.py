"""Park a profile in host memory, switch, and bring it back: the sequence, its refusals and its
fallback, on whichever checkpointer the assembly chose (parking/: the driver API, NVIDIA's
utility, the rehearsal's simulated one, or a fake).

    park      decide first, touching nothing: the CUDA processes of its cgroups (those the GPUs
              list), the host memory (MemAvailable vs the bytes + a margin), the ports the next
              profile needs (a server on one refuses; a router on one is to be stopped); then
              take it out of traffic and drain as a stop does, stop the routers in the next
              profile's way, pause its liveness, hold the rest of each parked server (SIGSTOP:
              its front end and detokenizer, so no request reaches a checkpointed scheduler;
              parking/decisions.py says what one did on the real server), lock and checkpoint
              each PID, verify every GPU of the profile at its baseline. Any failure brings it
              back (restore, unlock, continue, liveness, the routers started again, traffic)
              and refuses.
    restore   restore and unlock each PID, continue the held ones, liveness back, the routers
              stopped at the park started again, traffic back, one generation answered. A
              restore that fails (a call, a router that does not start, or the generation)
              stops the profile and starts it cold, and says so.
    stop      a parked profile's stop kills its parked servers' cgroups (a checkpointed
              scheduler has nothing to drain, and a held front end would not act on SIGTERM),
              then stops it; the host copy goes with them (the driver frees a dead process's),
              and the simulated one's file is removed.

The engine owns what parking means to supervision (Instance.park/resume: no traffic, no
liveness); this module owns the checkpoint and the GPU's word on it. Each decision it takes is
a pure function of parking/decisions.py, tested in the fast tier against parking/fake.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

from ..checks.gpus import GpuInventory
from ..config.model import ProcessSpec, Profile
from ..engine.instance import Instance
from ..engine.probe import PeerCheck, request, who_accepted
from ..engine.traffic import ACCEPT_WAIT_S
from ..errors import ParkRefused, PreconditionError, StartError, one_line
from ..parking import hostmem, saver
from ..parking.checkpointer import Checkpointer, CheckpointError, CheckpointState
from ..parking.decisions import (
    Held,
    ParkedProfile,
    ParkTarget,
    PortHolder,
    PortsVerdict,
    RestoreVerdict,
    baseline_problems,
    find_targets,
    held_while_parked,
    host_memory_refusal,
    judge_restore,
    nothing_to_park_refusal,
    ports_in_the_way,
)
from ..sglang import admin_key, router_key

#: (message, syslog priority)
Say = Callable[[str, int], None]
#: how long a lock may wait for the process's CUDA calls in flight (the driver's timeoutMs)
LOCK_TIMEOUT_MS = 30_000
GENERATION_TIMEOUT_S = 30.0


async def one_generation(host: str, port: int, timeout: float = GENERATION_TIMEOUT_S,
                         peer_check: PeerCheck | None = None) -> str:
    """"" when POST /generate answers 200 (one token, greedy); else why not. The proof of
    serving after a restore: /health would not do, it is answered by the front end alone.
    With `peer_check`, only an answer from the process it names counts (a stranger who holds
    the port of a front end that died while parked would otherwise prove it serving)."""
    body = {"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    status, answer = await request("POST", host, port, "/generate", body, timeout=timeout, peer_check=peer_check)
    if status == 200:
        return ""
    if status is None and answer:
        return f"/generate {one_line(answer.decode(errors='replace'))[:200]}"
    return f"/generate answered {status if status is not None else 'nothing'}"


def serving_entry(profile: Profile) -> tuple[str, int]:
    """Where one generation proves the profile serves: its router, else its first server."""
    first = _entry_spec(profile)
    return first.probe_host, first.port


def _entry_spec(profile: Profile) -> ProcessSpec:
    specs = [p for p in profile.processes if p.serves_http]
    routers = [p for p in specs if p.kind == "router"]
    return (routers or specs)[0]


def accepted_by(instance: Instance, name: str) -> PeerCheck:
    """The peer check of a call to process `name` of `instance`: "" when a process of its own
    cgroup accepted the connection, else why nothing is sent."""

    def pids() -> list[int]:
        proc = instance.processes.get(name)
        return proc.spawned.group.pids() if proc is not None and proc.spawned is not None else []

    async def check(ours: tuple[str, int], theirs: tuple[str, int]) -> str:
        found = await who_accepted(ours, theirs, pids, ACCEPT_WAIT_S)
        return "" if found.ours else f"not sent: on port {theirs[1]} {found.why_not()}, not by {name}"

    return check


class Parker:
    """Parks and restores instances on one checkpointer; `mem_available` and `kill` (how a held
    process is signalled) are injectable (tests)."""

    def __init__(self, checkpointer: Checkpointer, inventory: GpuInventory, say: Say,
                 mem_available: Callable[[], int | None] = hostmem.mem_available,
                 lock_timeout_ms: int = LOCK_TIMEOUT_MS, kill: Callable[[int, int], None] = os.kill,
                 saver_post: Callable[[Instance], saver.Post] | None = None) -> None:
        self.checkpointer, self.inventory, self.say = checkpointer, inventory, say
        self.mem_available, self.lock_timeout_ms, self.kill = mem_available, lock_timeout_ms, kill
        #: how the memory saver's calls reach an instance's servers (parking/saver.py; tests: a fake)
        self.saver_post = saver_post or admin_post
        self.parked: dict[str, ParkedProfile] = {}

    # ------------------------------------------------------------------ deciding

    async def plan(self, instance: Instance, next_profile: Profile | None = None) -> tuple[list[ParkTarget], PortsVerdict]:
        """The PIDs to park and the routers to stop while parked, or ParkRefused with the one
        line; touches nothing."""
        profile = instance.profile
        pids = pids_by_process(instance)
        states = await asyncio.to_thread(self.inventory.snapshot, sorted(profile.gpus))
        targets = find_targets(pids, states)
        holders = [PortHolder(p.name, p.kind, tuple(listen.port for listen in p.listens())) for p in profile.processes]
        ports = ports_in_the_way(instance.name, holders, next_profile.name if next_profile else "",
                                 _ports(next_profile) if next_profile else ())
        why = nothing_to_park_refusal(instance.name, targets) or ports.refusal
        if not why:  # a memory saver's server: checked again once its KV pool is released (`park`)
            savers = savers_of(instance, targets)
            why = host_memory_refusal(instance.name, sum(t.gpu_bytes for t in targets if t.process not in savers),
                                      self.mem_available())
        if why:
            raise ParkRefused(why)
        return targets, ports

    # ------------------------------------------------------------------ doing

    async def park(self, instance: Instance, next_profile: Profile | None = None) -> ParkedProfile:
        targets, ports = await self.plan(instance, next_profile)
        began = time.monotonic()
        record = ParkedProfile(instance.name, self.checkpointer.name, targets, 0, time.time(),
                               ports=list(ports.kept), stopped=list(ports.stop))

        post = self.saver_post(instance)
        left_paused: dict[str, str] = {}

        async def suspend() -> str:
            done: list[int] = []
            steps = saver.SaverSteps([], [])
            try:
                if savers := savers_of(instance, targets):  # drained: pause, release the KV pool
                    await saver.release_kv(savers, post, steps)
                    record.released = list(steps.released)
                record.held = self._to_hold(instance, targets)  # recorded first: a failure below releases all
                self._signal_ours(instance, record.held, signal.SIGSTOP)
                for t in targets:
                    done.append(t.pid)  # before the call: a cancel mid-lock still brings it back
                    await _to_the_end(self.checkpointer.lock, t.pid, self.lock_timeout_ms)
                # locked, nothing of theirs allocates: what the checkpoint moves is what the GPUs
                # list now (a server that took its pool back after the release, or grew since the plan)
                record.targets = await self._remeasured(instance, record.targets)
                why = host_memory_refusal(instance.name, sum(t.gpu_bytes for t in record.targets), self.mem_available())
                if why:
                    raise CheckpointError(why)
                for t in targets:
                    await _to_the_end(self.checkpointer.checkpoint, t.pid)
                states = await asyncio.to_thread(self.inventory.snapshot, sorted(instance.profile.gpus))
                problems = baseline_problems(states, [t.pid for t in targets])
                if problems:
                    raise CheckpointError("; ".join(problems))
            except BaseException as e:  # any failure (an NVML read, a signal refused, a cancel): undone
                if await self._bring_back(done):
                    self._release(instance, record.held)
                    undone = await saver.undo(steps, post)  # its front end runs again: resumed, continued
                    for line in undone.lines:
                        self.say(f"{instance.name}: after a failed park, {line}", 3)
                    left_paused.update(undone.left_paused)
                # else a scheduler still checkpointed: its front end stays held, so no request crashes
                # it; back in supervision, the hang check finds it stopped and restarts it cold
                if isinstance(e, CheckpointError):
                    raise ParkRefused(f"park of {instance.name} failed and was undone: {e}") from None
                raise
            host = sum(self.checkpointer.host_bytes(t.pid) for t in targets)
            record.host_bytes = host or sum(t.gpu_bytes for t in record.targets)
            record.took_s = time.monotonic() - began
            return record.describe()

        try:
            await instance.park(suspend, {s.process: s.why() for s in ports.stop})
        except Exception:  # not a cancel: the daemon is stopping then, and the instance with it
            await self._restart_left_paused(instance, left_paused)
            raise
        self.parked[instance.name] = record
        self.say(f"{instance.name} parked in {record.took_s:.2f} s: {record.describe()}; GPUs "
                 f"{sorted(instance.profile.gpus)} verified at their baseline", 6)
        return record

    async def _restart_left_paused(self, instance: Instance, servers: dict[str, str]) -> None:
        """Each server a failed park's undo left paused (server -> why), restarted cold once the
        instance is back: paused it would hold every request for ever, and the hang check takes a
        pause for work (engine/hang.py), so nothing else would end it."""
        for server, why in servers.items():
            self.say(f"{instance.name}: {server} is left paused after the failed park ({why}): restarted cold", 3)
            try:
                await instance.restart_process(server)
            except (PreconditionError, KeyError) as e:
                self.say(f"{instance.name}: {server} not restarted: {one_line(str(e))[:200]}", 3)

    def _signal_ours(self, instance: Instance, held: list[Held], sig: int) -> None:
        """`sig` to each held PID that is still in its process's cgroup at this moment (one that
        ended meanwhile may be anyone's PID now); a PID gone between the read and the signal is
        skipped."""
        for h in held:
            proc = instance.processes.get(h.process)
            group = proc.spawned.group if proc is not None and proc.spawned is not None else None
            if group is None or h.pid not in group.pids():
                continue
            try:
                self.kill(h.pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _to_hold(instance: Instance, targets: list[ParkTarget]) -> list[Held]:
        """The rest of each parked server, SIGSTOPped before its scheduler is locked: from then
        on no request reaches it until `_release`. (A request sent straight to its port between
        the drain and this hold can still be in flight at the lock: docs/operations.md.)"""
        pids = pids_by_process(instance)
        return held_while_parked(pids, targets)

    def _release(self, instance: Instance, held: list[Held]) -> None:
        self._signal_ours(instance, held, signal.SIGCONT)

    async def _remeasured(self, instance: Instance, targets: list[ParkTarget]) -> list[ParkTarget]:
        """The same PIDs with what they hold now (after a KV pool's release); a PID the GPUs no
        longer list keeps 0 bytes but is still parked (its CUDA context is there)."""
        states = await asyncio.to_thread(self.inventory.snapshot, sorted(instance.profile.gpus))
        by_process: dict[str, list[int]] = {}
        for t in targets:  # a TP server: several scheduler PIDs under one process name
            by_process.setdefault(t.process, []).append(t.pid)
        now = {t.pid: t.gpu_bytes for t in find_targets(by_process, states)}
        return [ParkTarget(t.process, t.pid, now.get(t.pid, 0)) for t in targets]

    async def _bring_back(self, pids: list[int]) -> bool:
        """Undo a park half done: each PID restored where checkpointed, unlocked where locked;
        False when one could not be."""
        ok = True
        for pid in pids:
            try:
                state = await asyncio.to_thread(self.checkpointer.state, pid)
                if state == CheckpointState.CHECKPOINTED:
                    await asyncio.to_thread(self.checkpointer.restore, pid)
                    state = CheckpointState.LOCKED
                if state == CheckpointState.LOCKED:
                    await asyncio.to_thread(self.checkpointer.unlock, pid)
            except CheckpointError as e:
                ok = False
                self.say(f"pid {pid}: could not be brought back after a failed park: {e}", 3)
        return ok

    async def restore(self, instance: Instance, cold_start: Callable[[], Awaitable[None]],
                      serves: Callable[[], Awaitable[str]] | None = None) -> RestoreVerdict:
        """Restore and prove it serves; on failure stop it and `cold_start` it, and say which."""
        record = self.parked.get(instance.name)
        if record is None:
            raise PreconditionError(f"{instance.name} is not parked: nothing to restore")
        if serves is None:
            host, port = serving_entry(instance.profile)
            check = accepted_by(instance, _entry_spec(instance.profile).name)

            async def serves() -> str:
                return await one_generation(host, port, peer_check=check)

        assert serves is not None
        began = time.monotonic()
        failure = {"restore": "", "serving": "", "start": ""}

        async def bring_back() -> None:
            try:
                # a PID that ended while parked may be anyone's now: restoring (NVIDIA's utility
                # toggles: checkpoints a running one) only what is still in the profile's cgroups
                owned = {pid for p in instance.processes.values() if p.spawned is not None
                         for pid in p.spawned.group.pids()}
                if gone := [pid for pid in record.pids if pid not in owned]:
                    raise CheckpointError(f"pid {', '.join(map(str, gone))} is no longer {instance.name}'s "
                                          "(it ended while parked): nothing restored")
                for pid in record.pids:
                    await asyncio.to_thread(self.checkpointer.restore, pid)
                    await asyncio.to_thread(self.checkpointer.unlock, pid)
                self._release(instance, record.held)  # its CUDA back: requests may reach it again
                # (paused: a request that came while parked waits at the front end for the continue)
                await saver.resume_kv(record.released, self.saver_post(instance))
            except CheckpointError as e:
                failure["restore"] = str(e)
                raise

        async def prove() -> None:  # after its servers are routed to again: a router without them answers 503
            failure["serving"] = await serves()
            if failure["serving"]:
                raise CheckpointError(failure["serving"])

        try:
            await instance.resume(bring_back, prove)
        except CheckpointError:
            pass
        except StartError as e:  # a router stopped at the park that does not start again
            failure["start"] = one_line(str(e).splitlines()[0])
        verdict = judge_restore(instance.name, failure["restore"], failure["serving"], time.monotonic() - began,
                                failure["start"])
        del self.parked[instance.name]
        if verdict.serve:
            self.say(verdict.say, 6)
            return verdict
        self.say(verdict.say, 4)
        await self._end(instance, record, "restore failed: starting it cold")
        await cold_start()
        return verdict

    async def stop(self, instance: Instance, reason: str = "stopped while parked") -> None:
        """`stop` of a parked profile: its processes ended, nothing left behind."""
        record = self.parked.pop(instance.name, None)
        if record is None:
            await instance.stop(reason)
            return
        await self._end(instance, record, reason)

    async def _end(self, instance: Instance, record: ParkedProfile, reason: str) -> None:
        """Its parked servers' cgroups killed (exact: the cgroups we made), then the instance's
        stop: a checkpointed scheduler has nothing to drain, and a held front end would sit on
        SIGTERM until the stop's deadline."""
        for name in sorted({t.process for t in record.targets}):
            proc = instance.processes.get(name)
            if proc is not None:
                proc.kill_parked(f"{reason}: parked, nothing to drain")
        await instance.stop(reason)
        forget = getattr(self.checkpointer, "forget", None)
        for pid in record.pids:
            if forget is not None:  # off the loop: the simulated one runs `rm` as the holding's user
                await asyncio.to_thread(forget, pid)


def _ports(profile: Profile) -> set[int]:
    return {listen.port for listen in profile.listens()}


async def _to_the_end(call: Callable[..., object], *args: object) -> None:
    """`call(*args)` in a thread; a cancel waits for the thread to finish before it goes on, so
    the undo that follows never races a lock or a checkpoint still in flight."""
    work = asyncio.ensure_future(asyncio.to_thread(call, *args))
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


def pids_by_process(instance: Instance) -> dict[str, list[int]]:
    """Each process of `instance` and the PIDs of its cgroup now (none for one not spawned)."""
    return {name: (p.spawned.group.pids() if p.spawned is not None else []) for name, p in instance.processes.items()}


def savers_of(instance: Instance, targets: list[ParkTarget]) -> list[str]:
    """The parked servers started with SGLang's memory saver, whose KV pool is released first."""
    names = sorted({t.process for t in targets})
    argv = {n: getattr(getattr(instance.processes.get(n), "launch", None), "argv", ()) for n in names}
    return [n for n in names if saver.uses_saver(argv[n])]


def admin_post(instance: Instance) -> saver.Post:
    """The memory saver's calls to a server of `instance`: its admin key (the endpoints are
    ADMIN_OPTIONAL, sglang/admin_key.py), accepted by a process of its own cgroup only."""

    async def post(server: str, path: str, body: object) -> tuple[int | None, bytes]:
        proc = instance.processes[server]
        headers = None
        if proc.launch.admin_key is not None:
            try:
                headers = admin_key.auth_header(router_key.read_key(proc.launch.admin_key))
            except (OSError, router_key.RouterKeyError) as e:
                return None, f"its admin key cannot be read: {one_line(str(e))}".encode()
        return await request("POST", proc.spec.probe_host, proc.spec.port, path, body, timeout=saver.CALL_TIMEOUT_S,
                             headers=headers, peer_check=accepted_by(instance, server))

    return post
