"""The fault matrix: every fault, in every phase, for prefill, decode, the router and the daemon.

For each target and each phase (starting, ready, stopping) we inject each fault that can
happen there:

    crash        the process exits 1 (stand-in faults crash-on-start / crash-after-ready; at
                 stopping: while a server stopped before it takes its time to exit)
    crash-after-own-ready
                 a server crashes once ready itself, while the router waiting for it still starts
    sigkill      SIGKILL of the main process (its detached scheduler survives it: the orphan case)
    hang         the process stops answering and ignores SIGTERM (SIGSTOP, or hang-on-term)
    slow         start-up past its start_timeout (never-ready) / a SIGTERM exit past stop_timeout
    grandchild   SIGKILL of the detached scheduler that holds the (simulated) GPU memory
    port-stolen  a foreign process binds the port between the check and the start

The router is the real sglang-router: only signals reach it (SIGKILL, SIGSTOP as a hang). The
daemon itself is SIGKILLed while starting, ready and stopping. Combinations that cannot happen
(a slow start once ready, a port stolen from a running server, ...) are left out: 40 cases of
the 84 combinations. Two known product gaps are expected failures: no health probing after
ready (a hung process stays "ready", strict), and restarts racing a start still in progress
(racy, so not strict).

Every case must end in a defined state: ready with every process healthy, or stopped /
failed with a reason naming the culprit. Whatever the outcome, once the instance is stopped
nothing of ours is left in its cgroups, the GPUs are verified idle, and a decoy whose command
line contains `sglang.launch_server --port 30001` is untouched.

The engine runs in-process (cgroupfs driver) on the scaled-down PD profile of
support.pd_profile; the daemon cases run the daemon as a subprocess and SIGKILL it, leaving the
clean-up to the cgroupfs driver's guardian. The matrix, with each case's final state,
leftovers and time, is printed in the terminal summary.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.engine.probe import http_status
from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import StartError
from support import alive, free_ports, make_instance, matrix_rows, pd_profile, sim_holders, tune, with_env, write_config

SERVERS = ("prefill", "decode")
GPU_OF = {"prefill": 0, "decode": 1}
TARGETS = ("prefill", "decode", "router", "daemon")
FAULTS = ("crash", "crash-after-own-ready", "sigkill", "hang", "slow", "grandchild", "port-stolen")
PHASES = ("starting", "ready", "stopping")
STARTUP_S = 0.3  # the stand-ins' "loading" time


# --------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Case:
    target: str
    fault: str
    phase: str
    expect: str  # the defined final state(s): ready | failed | stopped | killed (the daemon's processes)
    xfail: str = ""

    @property
    def id(self) -> str:
        return f"{self.target}-{self.fault}-{self.phase}"


def expected(target: str, fault: str, phase: str) -> tuple[str, str] | None:
    """The defined outcome of a fault, or None where it cannot happen or cannot be injected."""
    if target == "daemon":  # the daemon itself: SIGKILL in each phase; the guardian kills the rest
        return ("killed", "") if fault == "sigkill" else None
    table: dict[tuple[str, str], str] = {
        ("crash", "starting"): "failed",
        ("crash", "ready"): "failed",  # crashes on every start: restarted twice, then the limit
        # ready itself, crashing while the router (which waits for it) is still starting
        ("crash-after-own-ready", "starting"): "failed",  # fails the start, naming it
        ("crash", "stopping"): "stopped",
        ("sigkill", "starting"): "failed",
        ("sigkill", "ready"): "ready",  # restarted; the orphaned scheduler killed with the cgroup
        ("sigkill", "stopping"): "stopped",
        ("hang", "starting"): "failed",
        ("hang", "ready"): "ready",  # should be noticed, killed with its cgroup and restarted
        ("hang", "stopping"): "stopped",
        ("slow", "starting"): "failed",
        ("slow", "stopping"): "stopped",
        ("grandchild", "starting"): "failed",  # the main exits 1 (SIGQUIT path) while the instance starts
        ("grandchild", "ready"): "ready",
        ("port-stolen", "starting"): "failed",
    }
    if target == "router" and fault in ("crash", "crash-after-own-ready", "slow", "grandchild"):
        return None  # the real sglang-router: no fault injection, no detached children
    outcome = table.get((fault, phase))
    if outcome is None:
        return None
    return outcome, ""


def generate() -> list[Case]:
    cases = []
    for target in TARGETS:
        for fault in FAULTS:
            for phase in PHASES:
                found = expected(target, fault, phase)
                if found is not None:
                    cases.append(Case(target, fault, phase, found[0], found[1]))
    return cases


CASES = generate()
NOT_APPLICABLE = [f"{t}-{f}-{p}" for t in TARGETS for f in FAULTS for p in PHASES if expected(t, f, p) is None]
RESULTS: list[tuple[str, str, str, float]] = []


@pytest.fixture(autouse=True)
def matrix_report(request):  # type: ignore[no-untyped-def]
    yield from matrix_rows(request, RESULTS, f"fault matrix ({len(NOT_APPLICABLE)} combinations not applicable)", len(CASES))


# --------------------------------------------------------------------------- helpers


def section(target: str) -> str:
    return "router" if target == "router" else f"servers.{target}"


def steal(port: int) -> socket.socket:
    """A foreign listener on the port, as if something grabbed it after the check."""
    s = socket.socket()
    s.bind(("0.0.0.0", port))
    s.listen()
    return s


def holder_of(tmp: Path, gpu: int) -> list[int]:
    return [h.pid for h in SimulatedGpus(tmp / "simgpu").holders() if gpu in h.gpus]


async def until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def wait_empty(cgroups, tmp: Path, timeout: float) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        pids, held = cgroups.all_pids(), sim_holders(tmp)
        if (not pids and not held) or time.monotonic() > deadline:
            return pids, held
        time.sleep(0.02)


def leftovers_text(pids: list[int], held: list[int]) -> str:
    return "none" if not pids and not held else f"pids {pids} gpu-holders {held}"


# --------------------------------------------------------------------------- engine cases


async def all_healthy(instance) -> bool:  # type: ignore[no-untyped-def]
    for proc in instance.processes.values():
        spec = proc.spec
        if proc.state != State.READY or proc.pid is None or not alive(proc.pid):
            return False
        # SGLang's /health runs a generation: >= 1 s
        if await http_status(spec.probe_host, spec.port, spec.probe.path, 5.0, proc.expected_workers) != 200:
            return False
    return True


async def healthy_within(instance, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    """all_healthy, retried for a while: a restarted server answers /health (a generation, up to
    5 s on 2 busy cores) and is listed by the router again a moment after the engine calls it ready.
    A process that never becomes healthy still fails the case."""
    deadline = time.monotonic() + seconds
    while True:
        if await all_healthy(instance):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.5)


def profile_for(case: Case, ports: list[int]) -> str:
    t, f, p = case.target, case.fault, case.phase
    text = pd_profile(ports)
    sec = section(t)
    if f == "crash" and p == "starting":
        text = with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="crash-on-start")
    elif f == "crash" and p == "ready":  # after the router is up and the test saw all healthy (/health: >= 1 s each)
        text = with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="crash-after-ready:8")
    elif f == "crash-after-own-ready":  # before the router is up
        text = with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="crash-after-ready:0.3")
    elif f == "crash" and p == "stopping":
        # the victim crashes while the instance is stopping: the server stopped before it
        # takes its time to exit (a slow graceful SIGTERM path)
        other = "decode" if t == "prefill" else "prefill"
        text = f'stop_order = ["router", "{other}", "{t}"]\n' + text
        text = with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="crash-after-ready:7")
        text = with_env(text, other, SUPERVISORD_GPU_STANDIN_FAULT="exit-on-term-slow:9")
    elif f in ("sigkill", "grandchild") and t != "router":
        # the orphan cases: schedulers that escaped into their own session (SGLang's usual ones
        # are children with PDEATHSIG), so only the cgroup can still reach them
        env = {"SUPERVISORD_GPU_STANDIN_SCHEDULERS": "detached"}
        if p == "starting":
            env["SUPERVISORD_GPU_STANDIN_STARTUP_S"] = "2"
        if f == "sigkill" and p == "stopping":
            env["SUPERVISORD_GPU_STANDIN_FAULT"] = "hang-on-term"
        text = with_env(text, t, **env)
    elif f == "hang":
        if p == "starting":
            text = tune(text, sec, start_timeout=2)
        if t != "router" and p == "stopping":
            text = with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="hang-on-term")
        text = tune(text, sec, stop_timeout=1)
    elif f == "slow" and p == "starting":
        text = tune(with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="never-ready"), sec, start_timeout=2)
    elif f == "slow" and p == "stopping":
        text = tune(with_env(text, t, SUPERVISORD_GPU_STANDIN_FAULT="exit-on-term-slow:3"), sec, stop_timeout=1)
    return text


async def run_engine_case(case: Case, tmp: Path, cgroups, made: list) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """Inject the fault; return (final state, reason). Asserts the case's own expectations."""
    ports = free_ports(5)
    # the slow and hang cases set start_timeout = 2: with no progress for 2 s after that, the start fails
    cdir = write_config(tmp, {"pd": profile_for(case, ports)}, cgroups.root, startup=STARTUP_S,
                        daemon_extra="start_stall_timeout = 2")
    instance, _ = make_instance(cdir, "pd")
    made.append(instance)
    t, f, p = case.target, case.fault, case.phase
    victim = instance.processes[t]
    port = {"prefill": ports[0], "decode": ports[1], "router": ports[2]}[t]

    async def spawned() -> int:
        await until(lambda: victim.pid is not None and victim.state == State.STARTING, 20, f"{t} spawned")
        assert victim.pid is not None
        return victim.pid

    async def start_expecting_failure(inject) -> str:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(instance.start())
        await inject()
        with pytest.raises(StartError) as info:
            await asyncio.wait_for(task, 60)
        return str(info.value)

    # ---------------------------------------------------------------- starting
    if p == "starting":
        if f == "port-stolen":
            with steal(port):
                with pytest.raises(StartError) as info:
                    await asyncio.wait_for(instance.start(), 60)  # no preflight: it was "free" when checked
            message = str(info.value)  # a stranger on the port: never reported ready, and named
            if t == "router":  # it binds at once and exits 1; we name who holds the port
                assert message.startswith(f"{t}: exited during start-up (exit code 1: its port was taken: "), message
            else:  # SGLang's port opens only after the load; the stranger is found listening first
                assert message.startswith(f"{t}: port 127.0.0.1:{port} is held by pid {os.getpid()}"), message
            assert f"pid {os.getpid()}" in message and "(foreign)" in message, message
        elif f == "crash-after-own-ready":
            # hold the router (which waits for the servers) until the victim has crashed twice, so the
            # crashes surely come while the instance is starting, whatever the router's start-up time
            start = asyncio.create_task(instance.start())
            router = instance.processes["router"]
            await until(lambda: router.pid is not None, 20, "the router spawned")
            os.kill(router.pid, signal.SIGSTOP)
            try:
                await until(lambda: victim.restarts_total >= 2 or start.done(), 20, f"{t} crashing twice")
            finally:
                if router.pid is not None:
                    os.kill(router.pid, signal.SIGCONT)
            try:
                await asyncio.wait_for(start, 60)
            except StartError:
                pass
            if instance.state == State.READY:
                healthy = await all_healthy(instance)
                return ("ready" if healthy else f"ready, but {t} {victim.state.value} (not healthy)"), instance.reason
        elif f in ("crash", "slow"):
            with pytest.raises(StartError) as info:
                await asyncio.wait_for(instance.start(), 60)
            message = str(info.value)
            why = ("exited during start-up (crashed: SGLang killed itself after a scheduler failed)\n  last error: "
                   "RuntimeError: injected fault crash-on-start" if f == "crash" else "not ready within its start_timeout of 2 s")
            assert message.startswith(f"{t}: {why}"), message
        elif f == "sigkill":
            async def inject() -> None:
                pid = await spawned()
                if t != "router":  # let its scheduler detach and take its GPU memory first
                    await until(lambda: holder_of(tmp, GPU_OF[t]), 10, f"{t}'s scheduler")
                os.kill(pid, signal.SIGKILL)

            message = await start_expecting_failure(inject)
            assert message.startswith(f"{t}: exited during start-up (killed by SIGKILL)"), message
        elif f == "hang":
            async def inject() -> None:
                os.kill(await spawned(), signal.SIGSTOP)

            message = await start_expecting_failure(inject)
            assert message.startswith(f"{t}: not ready within its start_timeout of 2 s"), message
        elif f == "grandchild":
            start = asyncio.create_task(instance.start())
            await spawned()
            await until(lambda: holder_of(tmp, GPU_OF[t]), 10, f"{t}'s scheduler")
            (scheduler,) = holder_of(tmp, GPU_OF[t])
            assert victim.state == State.STARTING
            os.kill(scheduler, signal.SIGKILL)
            try:
                await asyncio.wait_for(start, 60)
            except StartError as e:
                return instance.state.value, str(e)
            await until(lambda: victim.restarts_total == 1 and instance.state == State.READY, 30, f"{t} restarted")
        assert instance.state.value in case.expect.split(" or "), (instance.state, instance.reason)
        if instance.state == State.FAILED:  # the reason names the culprit
            assert instance.reason.startswith((f"{t}: ", f"{t} exit code")), instance.reason
            assert all(proc.state in (State.STOPPED, State.FAILED) for proc in instance.processes.values())
        return instance.state.value, instance.reason

    await asyncio.wait_for(instance.start(), 60)
    assert instance.state == State.READY and await all_healthy(instance)

    # ---------------------------------------------------------------- ready
    if p == "ready":
        old_pid = victim.pid
        assert old_pid is not None
        if f == "crash":
            await asyncio.wait_for(instance.failed.wait(), 60)
            assert instance.state == State.FAILED
            assert instance.reason.startswith(f"{t} crashed: SGLang killed itself after a scheduler failed"), instance.reason
            assert "restart limit reached (2/2" in instance.reason, instance.reason
            return instance.state.value, instance.reason
        if f == "sigkill":
            orphans = holder_of(tmp, GPU_OF[t]) if t != "router" else []
            os.kill(old_pid, signal.SIGKILL)
        elif f == "grandchild":
            orphans = holder_of(tmp, GPU_OF[t])
            assert len(orphans) == 1
            os.kill(orphans[0], signal.SIGKILL)
        elif f == "hang":
            os.kill(old_pid, signal.SIGSTOP)
            # a hung process must be noticed (liveness probing after ready) and dealt with
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and instance.state == State.READY and victim.pid == old_pid:
                await asyncio.sleep(0.1)
            state = instance.state.value
            healthy = await all_healthy(instance)
            if state == "ready" and victim.pid == old_pid:
                return "ready (hung, undetected for 10 s)", f"healthy={healthy}"
            await until(lambda: instance.state in (State.READY, State.FAILED), 30, "an outcome")
            if instance.state == State.READY and not await healthy_within(instance, 20):
                return "ready, but not every process healthy", instance.reason
            return instance.state.value, instance.reason
        await until(lambda: victim.pid not in (None, old_pid) and instance.state == State.READY, 30, f"{t} restarted")
        assert victim.restarts_total == 1
        assert await healthy_within(instance, 20), instance.status()
        for pid in orphans:
            assert not alive(pid), "the dead server's scheduler should have been killed with its cgroup"
        return "ready", f"{t} restarted ({victim.history[-3].detail if len(victim.history) > 2 else ''})"

    # ---------------------------------------------------------------- stopping
    if f == "crash":
        took = await instance.stop()
        assert victim.last_exit.startswith("crashed: SGLang killed itself after a scheduler failed"), victim.last_exit
        assert victim.restarts_total == 0 and instance.state == State.STOPPED
        return "stopped", f"{t} crashed while stopping; stopped in {took:.1f} s"
    if f == "sigkill":
        if t == "router":
            os.kill(victim.pid, signal.SIGSTOP)  # keep it in its stop long enough to kill it there
        stop = asyncio.create_task(instance.stop())
        await until(lambda: victim.state == State.STOPPING, 20, f"{t} stopping")
        await asyncio.sleep(0.3)
        assert victim.pid is not None and victim.state == State.STOPPING
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.wait_for(stop, 60)
        assert victim.last_stop_s is not None and victim.last_stop_s < victim.spec.stop_timeout_s
        assert victim.last_exit == "killed by SIGKILL"
        return "stopped", f"{t} killed in its stop after {victim.last_stop_s:.1f} s"
    if f == "hang":
        if t == "router":
            os.kill(victim.pid, signal.SIGSTOP)
        await instance.stop()
        assert victim.last_stop_s is not None and 1.0 <= victim.last_stop_s < 2.0, victim.last_stop_s
        return "stopped", f"{t} killed at its stop_timeout ({victim.last_stop_s:.1f} s)"
    if f == "slow":
        await instance.stop()
        assert victim.last_stop_s is not None and 1.0 <= victim.last_stop_s < 2.0, victim.last_stop_s
        return "stopped", f"{t} killed at its stop_timeout ({victim.last_stop_s:.1f} s)"
    raise AssertionError(f"no injection for {case.id}")


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail, strict=c.fault == "hang")] if c.xfail else [])
     for c in CASES if c.target != "daemon"],
)
def test_fault_ends_in_a_defined_state_with_nothing_left(case, tmp_path, cgroups, decoy):  # type: ignore[no-untyped-def]
    began = time.monotonic()
    final, reason = "error", ""
    pids: list[int] = []
    held: list[int] = []
    try:
        final, reason = asyncio.run(engine_case_with_cleanup(case, tmp_path, cgroups))
    except Exception as e:
        notes = [n for n in getattr(e, "__notes__", []) if n.startswith("UNEXPECTED::")]
        final = "unexpected: " + (notes[0].split("::", 1)[1] if notes else repr(e)[:60])
        raise
    finally:
        pids, held = wait_empty(cgroups, tmp_path, 2.0)
        RESULTS.append((case.id, final, leftovers_text(pids, held), time.monotonic() - began))
    assert final in case.expect.split(" or "), f"{case.id}: ended {final!r} ({reason}), expected {case.expect!r}"
    assert pids == [], f"processes of ours left running: {pids}"
    assert held == [], f"GPUs not idle after the stop: held by {held}"
    assert decoy.poll() is None and alive(decoy.pid)


async def engine_case_with_cleanup(case: Case, tmp: Path, cgroups) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """Run the case, then stop the instance if it still runs (hung processes have short stop_timeouts)."""
    made: list = []
    try:
        return await run_engine_case(case, tmp, cgroups, made)
    except Exception as e:
        if made:  # what it really ended in, for the table
            inst = made[0]
            e.add_note(f"UNEXPECTED::{inst.state.value} ({inst.reason.splitlines()[0][:60] if inst.reason else ''})")
        raise
    finally:
        for instance in made:
            if instance.state not in (State.STOPPED, State.FAILED):
                await asyncio.wait_for(instance.stop("end of case"), 60)
            assert instance.state in (State.STOPPED, State.FAILED)


# --------------------------------------------------------------------------- the daemon itself


def daemon_profile(ports: list[int], phase: str) -> str:
    text = pd_profile(ports)
    if phase == "starting":
        text = with_env(text, "decode", SUPERVISORD_GPU_STANDIN_STARTUP_S="5")
    if phase == "stopping":
        text = with_env(text, "decode", SUPERVISORD_GPU_STANDIN_FAULT="hang-on-term")
    return text


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES if c.target == "daemon"])
def test_a_killed_daemon_leaves_nothing_behind(case, tmp_path, cgroups, decoy):  # type: ignore[no-untyped-def]
    began = time.monotonic()
    final, pids, held = "error", [], []
    cdir = write_config(tmp_path, {"pd": daemon_profile(free_ports(5), case.phase)}, cgroups.root, startup=STARTUP_S)
    log_path = tmp_path / "daemon.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", "pd", "--config-dir", str(cdir), "--rehearsal", "--stderr"],
        env={**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}, stdout=log, stderr=subprocess.STDOUT,
    )

    def wait_for(pattern: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, log_path.read_text()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"no {pattern!r} in the daemon's log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.02)

    try:
        if case.phase == "starting":
            wait_for(r"prefill: ready")  # decode is still loading (5 s): the instance is starting
            assert "instance ready" not in log_path.read_text()
        elif case.phase == "ready":
            wait_for(r"instance ready")
        else:
            wait_for(r"instance ready")
            proc.send_signal(signal.SIGTERM)
            wait_for(r"router: stopped")  # decode ignores its SIGTERM: the daemon is stopping it
        before = cgroups.all_pids()
        assert before and sim_holders(tmp_path), "nothing running to leave behind"
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        pids, held = wait_empty(cgroups, tmp_path, 5.0)
        final = "killed" if not pids else "processes left running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        RESULTS.append((case.id, f"daemon SIGKILLed; guardian: {final}", leftovers_text(pids, held),
                        time.monotonic() - began))
    assert pids == [], f"the guardian left processes of ours running: {pids}"
    assert held == [], f"GPUs still held: {held}"
    assert decoy.poll() is None and alive(decoy.pid)
