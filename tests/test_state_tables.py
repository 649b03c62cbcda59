"""The state machines as data (engine/states.py): the tables, and the real engine held to them.

The engine runs here for real (Instance and ManagedProcess, their start, stop, crash recovery and
operator restart), with only what lies below it faked: the ownership driver spawns a sleeping shell
instead of a server, and the readiness probe answers 200. No server starts, nothing boots: the
fast tier. Every state move the engine makes is checked against its table as it is made
(SUPERVISORD_GPU_STRICT_STATES=1, set by conftest.py), so a move the code makes and the table forgot fails
these tests, and the moves seen are collected to be compared with the table.
"""

from __future__ import annotations

import ast
import asyncio
import signal
from pathlib import Path

import pytest

from support import free_ports, write_config
from supervisord_gpu.checks.ports import ListenerOwnership
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.model import RestartPolicy
from supervisord_gpu.config.render import render
from supervisord_gpu.rehearsal.setup import stand_ins
from supervisord_gpu.engine import process as process_module
from supervisord_gpu.engine import states
from supervisord_gpu.engine.events import Event
from supervisord_gpu.engine.instance import Instance
from supervisord_gpu.engine.probe import ProbeResult
from supervisord_gpu.engine.restarts import CrashRestarts
from supervisord_gpu.errors import PreconditionError
from supervisord_gpu.engine.states import (
    INSTANCE_MOVES,
    PROCESS_MOVES,
    IllegalTransition,
    InstanceState,
    ProcessState,
    State,
)
from supervisord_gpu.ownership.base import ProcessGroup, Spawned, SpawnRequest


# ---------------------------------------------------------------------- the tables alone


def reachable(moves, start):  # type: ignore[no-untyped-def]
    seen, todo = {start}, [start]
    while todo:
        for nxt in moves[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("moves, start, enum", [(INSTANCE_MOVES, states.INSTANCE_START, InstanceState),
                                                (PROCESS_MOVES, states.PROCESS_START, ProcessState)],
                         ids=["instance", "process"])
def test_every_state_is_reachable_from_the_start_state_and_has_a_way_out(moves, start, enum):
    assert set(moves) == set(enum), "every state has its row"
    assert reachable(moves, start) == set(enum)
    for state in enum:
        assert start in reachable(moves, state), f"{state} can never be stopped again"


def test_the_words_on_the_bus_are_those_of_both_tables_and_never_change():
    assert [s.value for s in InstanceState] == ["stopped", "starting", "ready", "degraded", "stopping", "failed",
                                                "parked"]
    assert [s.value for s in ProcessState] == ["stopped", "starting", "ready", "restarting", "stopping", "failed",
                                               "parked"]
    assert {s.value for s in State} == {s.value for s in InstanceState} | {s.value for s in ProcessState}
    assert InstanceState.READY == State.READY == ProcessState.READY  # old readers compare words


def test_the_metrics_label_sets_are_the_enums():
    from supervisord_gpu import metrics

    assert metrics.INSTANCE_STATES == tuple(s.value for s in InstanceState)
    assert metrics.PROCESS_STATES == tuple(s.value for s in ProcessState)


def test_an_illegal_move_raises_under_the_tests_and_is_logged_and_made_in_production(monkeypatch, tmp_path):
    sink = RecordingSink()
    instance = idle_instance(sink, tmp=tmp_path)
    with pytest.raises(IllegalTransition, match="instance p: stopped -> ready"):
        instance._set_state(InstanceState.READY)
    assert instance.state == InstanceState.STOPPED
    proc = instance.processes["alpha"]
    with pytest.raises(IllegalTransition, match="process p/alpha: stopped -> ready"):
        proc._set_state(ProcessState.READY)
    assert proc.state == ProcessState.STOPPED

    monkeypatch.setenv("SUPERVISORD_GPU_STRICT_STATES", "0")  # production: a bookkeeping bug must not kill the servers
    instance._set_state(InstanceState.READY)
    assert instance.state == InstanceState.READY
    assert [(p, m) for m, p, _ in sink.events if "illegal" in m] == [(3, "illegal state move of instance p: stopped -> "
                                                                        "ready (allowed from stopped: failed, starting, stopping)")]


# ---------------------------------------------------------------------- crash ledger alone


def test_a_crash_ledger_counts_admitted_crashes_in_its_window_and_refuses_past_the_limit():
    policy = RestartPolicy(max_restarts=2, window_s=10.0, backoff_initial_s=1.0, backoff_max_s=30.0)
    ledger = CrashRestarts()
    first, second, third = (ledger.admit(policy, 1, t) for t in (0.0, 1.0, 2.0))
    assert (first.attempt, first.delay_s, second.attempt, second.delay_s) == (1, 1.0, 2, 2.0)
    assert third.refusal == "restart limit reached (2/2 in 10 s)"
    later = ledger.admit(policy, 1, 10.5)  # the first has left the window
    assert later.allowed and later.attempt == 2
    assert ledger.admit(RestartPolicy(mode="on-failure"), 0, 0.0).refusal == "restart policy 'on-failure'"
    assert ledger.admit(RestartPolicy(mode="always"), 0, 100.0).allowed


def test_a_profile_without_a_restart_table_gets_the_policy_records_own_defaults(tmp_path):
    (a,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": f'[servers.a]\ngpus = [0]\nport = {a}\nmodel_path = "/m"\n'}, tmp_path / "cg")
    assert load_profile(load_daemon_config(cdir), "p").restart == RestartPolicy()


# ---------------------------------------------------------------------- the real engine over fakes


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict[str, str]]] = []

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        self.events.append((message, priority, fields))

    def child_line(self, *args: object) -> None:
        pass


class SleepGroup(ProcessGroup):
    """A group of one real child (a shell looping on `sleep`): its pid while it lives."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc, self.name, self.cgroup = proc, f"fake-{proc.pid}", ""

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc.returncode is None else []

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def wait_empty(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def release(self) -> None:
        pass


class SleepDriver:
    """The ownership driver's interface, spawning a sleeping shell for every process."""

    name = "fake"
    weak = False

    #: a child that exits 0 on SIGUSR1 (a clean exit, which the on-failure policy does not restart)
    ARGV = ("sh", "-c", "trap 'exit 0' USR1; while :; do sleep 0.05; done")

    def __init__(self) -> None:
        self.spawned: list[int] = []

    async def reclaim_leftovers(self, instance: str, policy: str, names: list[str]) -> list[str]:
        return []

    def guard(self, instance: str) -> None:
        pass

    async def spawn(self, req: SpawnRequest) -> Spawned:
        proc = await asyncio.create_subprocess_exec(*self.ARGV, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        self.spawned.append(proc.pid)
        return Spawned(proc, SleepGroup(proc))


PROFILE = """
    [restart]
    max_restarts = {max_restarts}
    backoff_initial = {backoff}
    backoff_max = {backoff}
    [servers.alpha]
    gpus = [0]
    port = {a}
    model_path = "/m"
    [servers.beta]
    gpus = [1]
    port = {b}
    model_path = "/m"
    """


def idle_instance(sink: RecordingSink, tmp: Path, max_restarts: int = 5, backoff: float = 0.01) -> Instance:
    root = tmp
    a, b = free_ports(2)
    cdir = write_config(root, {"p": PROFILE.format(a=a, b=b, max_restarts=max_restarts, backoff=backoff)}, root / "cgroup")
    cfg = load_daemon_config(cdir)
    profile = load_profile(cfg, "p")
    instance = Instance(profile, render(profile, cfg, stand_ins(cfg)), SleepDriver(), sink)  # type: ignore[arg-type]
    return instance


class Moves:
    """Every state move seen on the instance's events: (kind, old, new)."""

    def __init__(self, instance: Instance) -> None:
        self.last: dict[str, str] = {"instance": "stopped", **{name: "stopped" for name in instance.processes}}
        self.seen: set[tuple[str, str, str]] = set()
        instance.listeners.append(self)

    def __call__(self, event: Event) -> None:
        if event.kind not in ("instance", "process") or not event.state:
            return
        who = "instance" if event.kind == "instance" else str(event.process)
        kind = "instance" if event.kind == "instance" else "process"
        self.seen.add((kind, self.last[who], event.state))
        self.last[who] = event.state


@pytest.fixture
def engine_with(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """Builds an Instance of two servers over the fakes, with the given restart backoff."""
    async def answer(*args: object, **kwargs: object) -> ProbeResult:
        return ProbeResult(200, True)

    async def ours(self: object) -> ListenerOwnership:
        return ListenerOwnership(True)

    monkeypatch.setattr(process_module, "probe", answer)
    monkeypatch.setattr(process_module.ManagedProcess, "_listeners", ours)
    monkeypatch.setattr(process_module.ManagedProcess, "_start_liveness", lambda self: None)
    monkeypatch.setattr(process_module.ManagedProcess, "_prepare_dirs", lambda self: None)

    def build(backoff: float = 0.01) -> tuple[Instance, RecordingSink, Moves]:
        sink = RecordingSink()
        instance = idle_instance(sink, tmp_path, max_restarts=2, backoff=backoff)
        return instance, sink, Moves(instance)

    return build


@pytest.fixture
def engine(engine_with) -> tuple[Instance, RecordingSink, Moves]:  # type: ignore[no-untyped-def]
    return engine_with()  # type: ignore[no-any-return]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 20))


async def until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(400):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def crash(proc) -> None:  # type: ignore[no-untyped-def]
    proc.spawned.proc.send_signal(signal.SIGKILL)


def test_start_crash_recovery_operator_restart_and_stop_make_only_moves_of_the_tables(engine):
    instance, sink, moves = engine
    alpha = instance.processes["alpha"]

    async def go() -> None:
        await instance.start()
        assert instance.state == InstanceState.READY
        crash(alpha)
        await until(lambda: alpha.restarts_total == 1 and instance.state == InstanceState.READY, "alpha recovered")
        await instance.restart_process("beta")
        assert instance.state == InstanceState.READY
        await instance.stop()
        await instance.start()  # a second run starts its processes as STARTING, not RESTARTING
        await instance.stop()

    run(go())
    table = {("instance", a.value, b.value) for a, bs in INSTANCE_MOVES.items() for b in bs} | \
            {("process", a.value, b.value) for a, bs in PROCESS_MOVES.items() for b in bs}
    assert moves.seen <= table
    assert ("process", "ready", "restarting") in moves.seen and ("process", "stopped", "restarting") in moves.seen
    assert ("instance", "degraded", "ready") in moves.seen
    assert ("process", "stopped", "starting") in moves.seen
    assert not [m for m, priority, _ in sink.events if priority <= 2 or "illegal" in m], "an error of ours was logged"


def test_crash_recovery_and_an_operator_restart_keep_separate_ledgers(engine):
    instance, _, _ = engine
    alpha = instance.processes["alpha"]

    async def go() -> None:
        await instance.start()
        for _ in range(3):  # three by hand: the policy's limit is 2, and these count toward nothing
            await instance.restart_process("alpha")
        assert instance.state == InstanceState.READY
        assert (alpha.requested_restarts.started, alpha.crash_restarts.started) == (3, 0)
        crash(alpha)
        await until(lambda: alpha.crash_restarts.started == 1 and instance.state == InstanceState.READY, "recovered")
        assert alpha.requested_restarts.started == 3 and alpha.restarts_total == 4
        await instance.stop()

    run(go())


def test_an_operators_restart_of_an_instance_that_is_not_ready_is_refused_and_starts_nothing(engine):
    instance, _, _ = engine

    async def go() -> None:
        await instance.start()
        await instance.stop()
        with pytest.raises(PreconditionError, match="p is stopped, not ready: alpha is not restarted"):
            await instance.restart_process("alpha")

    run(go())
    assert instance.state == InstanceState.STOPPED and instance.processes["alpha"].state == ProcessState.STOPPED
    assert len(instance.owner.spawned) == 2


def test_past_the_limit_the_instance_gives_up_through_its_table(engine):
    instance, sink, moves = engine
    alpha = instance.processes["alpha"]

    async def go() -> None:
        await instance.start()
        for n in (1, 2):
            crash(alpha)
            await until(lambda n=n: alpha.crash_restarts.started == n and alpha.state == ProcessState.READY, f"restart {n}")
        crash(alpha)
        await asyncio.wait_for(instance.failed.wait(), 10)

    run(go())
    assert instance.state == InstanceState.FAILED and "restart limit reached (2/2" in instance.reason
    assert alpha.state == ProcessState.FAILED and instance.processes["beta"].state == ProcessState.STOPPED
    assert ("instance", "stopping", "failed") in moves.seen and ("process", "stopped", "failed") in moves.seen
    assert not [m for m, _, _ in sink.events if "illegal" in m]


def test_a_restart_waiting_out_its_backoff_when_the_instance_gives_up_never_starts_its_process(engine_with, tmp_path):
    instance, _, _ = engine_with(backoff=0.5)
    alpha, beta = instance.processes["alpha"], instance.processes["beta"]

    async def go() -> int:
        await instance.start()
        crash(beta)  # restarted after 0.5 s
        await until(lambda: beta.state == ProcessState.STOPPED, "beta waiting out its backoff")
        alpha.spawned.proc.send_signal(signal.SIGUSR1)  # exit 0: the on-failure policy gives up
        await asyncio.wait_for(instance.failed.wait(), 10)
        spawned = len(instance.owner.spawned)
        await asyncio.sleep(0.8)
        return len(instance.owner.spawned) - spawned

    assert run(go()) == 0, "beta was started again in a failed instance"
    assert instance.state == InstanceState.FAILED and beta.state == ProcessState.STOPPED


def test_the_instance_writes_nothing_of_a_process_but_its_exit_callback():
    """A process's state and restart ledgers are written by the process only: the instance asks
    (start, stop, await_restart, mark_failed), it never sets them."""
    tree = ast.parse((Path(process_module.__file__).parent / "instance.py").read_text())
    written = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                written.add(ast.unparse(node))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_set_state":
            if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                written.add(ast.unparse(node.func))
    assert written == {"proc.on_unexpected_exit"}



def test_a_phase_scan_runs_off_the_event_loop_and_its_failure_is_one_line(engine, monkeypatch):
    """A new phase in a server's output scans its cgroup's /proc maps and fds (a loaded server's
    run to thousands of lines): on a worker thread, so the loop that probes and judges every
    other process is not held up; a scan that fails is said at priority 4, nothing else."""
    import threading
    import time

    from supervisord_gpu.ownership.files import ShmTracker

    instance, sink, _ = engine
    alpha = instance.processes["alpha"]
    on: list[str] = []

    def slow_scan(self: ShmTracker, pids: object) -> None:
        on.append(threading.current_thread().name)
        time.sleep(0.5)
        if len(on) == 2:
            raise OSError("maps unreadable")

    async def go() -> None:
        await instance.start()
        monkeypatch.setattr(ShmTracker, "scan", slow_scan)
        began = time.monotonic()
        alpha._on_line("[2026-12-07 10:00:00] Load weight begin. avail mem=70.00 GB", "stderr")
        assert time.monotonic() - began < 0.2, "the reader waited for the scan"
        await until(lambda: len(on) == 1 and not alpha._scans, "the first scan done")
        alpha._on_line("[2026-12-07 10:00:01] Capture CUDA graph begin.", "stderr")
        await until(lambda: len(on) == 2 and not alpha._scans, "the second scan done")
        await instance.stop()

    run(go())
    assert on and threading.main_thread().name not in on, on
    failed = [(m, p) for m, p, _ in sink.events if "scan of its shared-memory files failed" in m]
    assert failed == [("alpha: scan of its shared-memory files failed: OSError: maps unreadable", 4)], failed


def test_a_server_that_dies_during_the_scan_at_ready_fails_its_start_and_is_not_left_ready(engine, monkeypatch):
    """The scan at ready runs on a worker thread: an exit while it runs must still be seen (the
    hostile review's repro: the process died mid-scan, the engine declared it READY, dead, and
    nothing ever restarted it)."""
    import time

    from supervisord_gpu.errors import SupervisorError
    from supervisord_gpu.ownership.files import ShmTracker

    instance, _, _ = engine
    alpha = instance.processes["alpha"]
    killed: list[int] = []

    def dying_scan(self: ShmTracker, pids: object) -> None:
        if not killed and alpha.spawned is not None:  # the first scan: the one at ready
            killed.append(alpha.spawned.pid)
            alpha.spawned.proc.send_signal(signal.SIGKILL)
            time.sleep(0.5)  # its exit is seen meanwhile

    monkeypatch.setattr(ShmTracker, "scan", dying_scan)

    async def go() -> str:
        try:
            await instance.start()
            return f"started: alpha {alpha.state.value}, exited {alpha._exited.is_set()}"
        except SupervisorError as e:
            return str(e)
        finally:
            await instance.stop()

    said = run(go())
    assert killed and "alpha: exited during start-up (killed by SIGKILL)" in said, said


def test_phases_that_come_while_a_scan_runs_make_one_more_scan_not_a_queue(engine, monkeypatch):
    """A child that prints phase lines as fast as it can (model code may) costs at most one scan
    running and one after it, never a queue of scans holding the shared worker threads."""
    import threading
    import time

    from supervisord_gpu.ownership.files import ShmTracker

    instance, _, _ = engine
    alpha = instance.processes["alpha"]
    scans: list[float] = []
    at_once = [0, 0]  # now, most
    lock = threading.Lock()

    def slow_scan(self: ShmTracker, pids: object) -> None:
        with lock:
            at_once[0] += 1
            at_once[1] = max(at_once)
        scans.append(time.monotonic())
        time.sleep(0.3)
        with lock:
            at_once[0] -= 1

    async def go() -> None:
        await instance.start()
        monkeypatch.setattr(ShmTracker, "scan", slow_scan)
        for i in range(200):
            alpha._on_line("[x] Load weight begin." if i % 2 else "[x] Capture CUDA graph begin.", "stderr")
        await until(lambda: len(scans) >= 2 and not alpha._scans, "the scans done")
        await asyncio.sleep(0.5)
        seen.extend([len(scans), at_once[1]])
        await instance.stop()

    seen: list[int] = []
    run(go())
    assert seen == [2, 1], seen  # (scans, most at once) before the stop's own
