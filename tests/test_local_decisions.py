"""The single machine's decisions, unit-tested over fakes: whether a start may take over the
instances in its way (takeover = false refuses, nothing touched; without systemd, the registry's
daemons, each signalled only while its record is still believed), what a holder that is not ours
does (it blocks, named, before anything stops), what a failed start rolls back (exactly what was
stopped, also when the wait for idle GPUs fails after some were), what a port taken while the
servers loaded makes of a failed start (a refusal, exit 3, final), the busy job, the loser that
names the winner, and a stop while starting.

Everything here runs the product's own LocalTransition (controller/transition.py, takeover.py)
and InstanceController (controller/controller.py) with the collaborators the daemon hands them
swapped for fakes: systemd's units that only record what they are told, an empty registry, a
transition lock in memory, an instance that runs no process. The GPUs are simulated ones in a
temporary directory, the ports real sockets of this test. No systemd, no server, no container:
each decision in milliseconds. The systemd suites keep one wiring case per behaviour."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import textwrap
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from supervisord_gpu.checks.gpus import NvmlUnavailable, inventory_for
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.model import DaemonConfig
from supervisord_gpu.config.render import Programs
from supervisord_gpu.controller.backends import Backends
from supervisord_gpu.controller.controller import InstanceController
from supervisord_gpu.controller.outcome import Outcome
from supervisord_gpu.controller.registry import Record
from supervisord_gpu.cluster.dcs import StepFailed
from supervisord_gpu.controller.transition import LocalTransition
from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import EXIT_GAVE_UP, EXIT_OK, EXIT_PRECONDITIONS, PreconditionError, StartError, SupervisorError
from supervisord_gpu.sglang.flags import FlagCheck
from support import free_ports

# ----------------------------------------------------------------------------- the machine


class Machine:
    """A config with four single-server profiles on eight simulated GPUs:

        alpha  GPU 0        beta   GPUs 0, 1 (the one being started: alpha and gamma are in its way)
        gamma  GPU 1        delta  GPU 5 (running, in nobody's way)
    """

    def __init__(self, tmp: Path, beta_extra: str = "") -> None:
        self.ports = dict(zip(("alpha", "beta", "gamma", "delta"), free_ports(4), strict=True))
        etc = tmp / "etc"
        (etc / "profiles").mkdir(parents=True)
        (etc / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
            [daemon]
            runtime_dir = "{tmp / 'run'}"
            cache_dir = "{tmp / 'cache'}"
            default_user = "root"
            [gpus]
            backend = "simulated"
            wait_idle_timeout = 0.3
            [rehearsal]
            gpu_count = 8
            simgpu_dir = "{tmp / 'simgpu'}"
            """))
        gpus = {"alpha": [0], "beta": [0, 1], "gamma": [1], "delta": [5]}
        for name, port in self.ports.items():
            top = beta_extra if name == "beta" else ""
            (etc / "profiles" / f"{name}.toml").write_text(
                f"{top}\n[servers.main]\ngpus = {gpus[name]}\nport = {port}\nmodel_path = \"/nowhere\"\n")
        self.cfg: DaemonConfig = load_daemon_config(etc)
        self.inventory = inventory_for(self.cfg, simulated=True)
        self.said: list[str] = []

    def profile(self, name: str = "beta"):  # type: ignore[no-untyped-def]
        return load_profile(self.cfg, name)

    def backends(self) -> Backends:
        """The real programs, these simulated GPUs, every option accepted, no model needed on disk."""
        return Backends(Programs.of(self.cfg), lambda: self.inventory,
                        lambda servers: [FlagCheck(name, True, "a test") for name, _ in servers],
                        model_paths_must_exist=False)

    def transition(self, units: FakeUnits | None, name: str = "beta") -> LocalTransition:
        return LocalTransition(self.profile(name), self.cfg, self.backends(), lambda m, _p, _e: self.said.append(m),
                               units, NoRecords())


class FakeUnits:
    """systemd's dsv4@ units: `active` is what runs; a stop makes it inactive (or ends as `results`
    says, after running `during`); every order recorded, none carried out on a real unit."""

    def __init__(self, *active: str, results: dict[str, str] | None = None,
                 during: dict[str, Callable[[], Any]] | None = None) -> None:
        self.active = {name: "active" for name in active}
        self.results, self.during = results or {}, during or {}
        self.calls: list[tuple[str, str]] = []

    def instances(self) -> list[Any]:
        return [types.SimpleNamespace(instance=n, active=a) for n, a in self.active.items()]

    def stop(self, unit: str, **_kw: Any) -> Any:
        self.calls.append(("stop", unit))
        instance = unit.removeprefix("dsv4@").removesuffix(".service")
        if instance in self.during:
            self.during[instance]()
        result = self.results.get(instance, "done")
        if result == "done":
            self.active[instance] = "inactive"
        return types.SimpleNamespace(result=result, done=result == "done")

    def queue(self, method: str, unit: str) -> str:
        self.calls.append((method, unit))
        return "/org/freedesktop/systemd1/job/1"

    def stopped(self) -> list[str]:
        return [u for verb, u in self.calls if verb == "stop"]

    def started(self) -> list[str]:
        return [u for verb, u in self.calls if verb == "StartUnit"]


class NoRecords:
    """The registry of daemons run without systemd: none here."""

    def running(self) -> list[Any]:
        return []


def listening(port: int) -> socket.socket:
    """A holder that is not ours: this test, listening on the port."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def prepare(transition: LocalTransition) -> list[str]:
    progress: list[str] = []
    asyncio.run(transition.prepare("the option table", progress.append))
    return progress


# ----------------------------------------------------------------------------- takeover


def test_takeover_false_refuses_naming_who_is_running_and_stops_nothing(tmp_path: Path) -> None:
    machine = Machine(tmp_path, beta_extra="takeover = false")
    units = FakeUnits("alpha", "delta")
    with pytest.raises(PreconditionError, match=r"refusing to start: dsv4@alpha \(GPUs 0\) is running "
                                                r"\(takeover = false in the profile\)"):
        prepare(machine.transition(units))
    assert units.calls == []


def test_takeover_allowed_stops_exactly_the_instances_in_the_way(machine: Machine) -> None:
    units = FakeUnits("alpha", "gamma", "delta")
    transition = machine.transition(units)
    progress = prepare(transition)
    assert units.stopped() == ["dsv4@alpha.service", "dsv4@gamma.service"]  # delta holds nothing beta needs
    assert [c.instance for c in transition.stopped] == ["alpha", "gamma"] and transition.took_over()
    assert progress[:2] == ["stopping dsv4@alpha", "stopping dsv4@gamma"]
    assert units.started() == []


def test_nothing_in_the_way_is_nothing_stopped(machine: Machine) -> None:
    units = FakeUnits("delta")
    transition = machine.transition(units)
    prepare(transition)
    assert units.calls == [] and not transition.took_over()
    assert transition.came_from() == "-"


def test_an_instance_systemd_has_stopped_already_is_not_in_the_way(machine: Machine) -> None:
    units = FakeUnits("alpha")
    units.active["alpha"] = "failed"
    prepare(machine.transition(units))
    assert units.calls == []


class Records:
    """The registry, naming the daemons the test says; `calls` counts the readings."""

    def __init__(self, *records: Record) -> None:
        self.records, self.calls = list(records), 0

    def running(self) -> list[Record]:
        self.calls += 1
        return list(self.records)


def a_daemon(instance: str, gpus: list[int]) -> tuple[subprocess.Popen[bytes], Record]:
    child = subprocess.Popen(["sleep", "30"])
    return child, Record(instance, child.pid, 0.0, f"/etc/{instance}.toml", gpus, [], "cgroupfs")


def test_without_systemd_the_registrys_daemon_in_the_way_is_signalled_and_waited_for(machine: Machine) -> None:
    child, record = a_daemon("alpha", [0])
    try:
        transition = machine.transition(None)
        transition.registry = Records(record)  # type: ignore[assignment]
        prepare(transition)
        assert child.wait(2) == -signal.SIGTERM and [c.via for c in transition.stopped] == [f"pid {child.pid}"]
    finally:
        child.kill()
        child.wait()


def test_a_record_no_longer_believed_when_its_daemon_is_signalled_is_left_alone(machine: Machine) -> None:
    child, record = a_daemon("alpha", [0])
    records = Records(record)
    real_running = records.running

    def gone_on_second_look() -> list[Record]:
        found = real_running()
        return found if records.calls == 1 else []  # the PID was reused between the two readings

    records.running = gone_on_second_look  # type: ignore[method-assign]
    try:
        transition = machine.transition(None)
        transition.registry = records  # type: ignore[assignment]
        prepare(transition)
        assert child.poll() is None  # not signalled: not the daemon its record described any more
    finally:
        child.kill()
        child.wait()


# ----------------------------------------------------------------------------- foreign holders


def test_a_foreign_port_holder_blocks_before_anything_is_stopped(machine: Machine) -> None:
    units = FakeUnits("alpha")
    with listening(machine.ports["beta"]):
        with pytest.raises(PreconditionError, match=rf"refusing to start: port 127\.0\.0\.1:{machine.ports['beta']}.*"
                                                    rf"pid {os.getpid()}"):
            prepare(machine.transition(units))
    assert units.calls == []


def test_a_foreign_gpu_holder_blocks_before_anything_is_stopped(machine: Machine) -> None:
    units = FakeUnits("alpha")
    SimulatedGpus(machine.cfg.rehearsal.simgpu_dir or "").hold([1], 5000, pid=os.getpid())
    with pytest.raises(PreconditionError, match=rf"refusing to start: GPU 1 .*pid {os.getpid()}"):
        prepare(machine.transition(units))
    assert units.calls == []


def test_a_port_held_by_no_one_in_the_way_blocks_even_without_a_takeover(machine: Machine) -> None:
    with listening(machine.ports["beta"]):
        with pytest.raises(PreconditionError, match="refusing to start: port"):
            prepare(machine.transition(FakeUnits()))


# ----------------------------------------------------------------------------- rollback


def test_a_failed_start_rolls_back_exactly_what_was_stopped(machine: Machine) -> None:
    units = FakeUnits("alpha", "gamma", "delta")
    transition = machine.transition(units)
    prepare(transition)
    said = asyncio.run(transition.roll_back(StartError("main: exited 1"), "main: exited 1"))
    assert units.started() == ["dsv4@alpha.service", "dsv4@gamma.service"]
    assert said == "main: exited 1 (after taking over dsv4@alpha, dsv4@gamma; rolled back: dsv4@alpha, " \
                   "dsv4@gamma started again)"


def test_a_stop_that_fails_midway_rolls_back_only_what_had_stopped(machine: Machine) -> None:
    units = FakeUnits("alpha", "gamma", results={"gamma": "failed"})
    transition = machine.transition(units)
    with pytest.raises(PreconditionError, match="stopping dsv4@gamma ended 'failed'"):
        prepare(transition)
    error = PreconditionError("stopping dsv4@gamma ended 'failed'")
    asyncio.run(transition.roll_back(error, str(error)))
    assert units.stopped() == ["dsv4@alpha.service", "dsv4@gamma.service"]
    assert units.started() == ["dsv4@alpha.service"]


def test_when_the_wait_for_idle_gpus_fails_after_the_stops_everything_stopped_is_started_again(machine: Machine) -> None:
    squatter: list[socket.socket] = []
    units = FakeUnits("alpha", "gamma", during={"gamma": lambda: squatter.append(listening(machine.ports["beta"]))})
    transition = machine.transition(units)
    try:
        with pytest.raises(PreconditionError) as refused:
            prepare(transition)
        assert str(machine.ports["beta"]) in str(refused.value)
        asyncio.run(transition.roll_back(refused.value, str(refused.value)))
    finally:
        for s in squatter:
            s.close()
    assert units.started() == ["dsv4@alpha.service", "dsv4@gamma.service"]


def test_rollback_false_leaves_what_was_taken_over_stopped_and_says_so(tmp_path: Path) -> None:
    machine = Machine(tmp_path, beta_extra="rollback = false")
    units = FakeUnits("alpha")
    transition = machine.transition(units)
    prepare(transition)
    said = asyncio.run(transition.roll_back(StartError("x"), "x"))
    assert units.started() == [] and said == "x (after taking over dsv4@alpha; rollback = false: they stay stopped)"


def test_a_start_that_took_nothing_over_rolls_nothing_back(machine: Machine) -> None:
    units = FakeUnits("delta")
    transition = machine.transition(units)
    prepare(transition)
    assert asyncio.run(transition.roll_back(StartError("x"), "x")) is None and units.started() == []


def test_without_systemd_nothing_can_be_started_again_and_the_rollback_says_so(machine: Machine) -> None:
    units = FakeUnits("alpha")
    transition = machine.transition(units)
    prepare(transition)
    transition.units = None  # the bus gone between the takeover and the rollback
    said = asyncio.run(transition.roll_back(StartError("x"), "x"))
    assert "rolled back: nothing; rollback failed: dsv4@alpha (cannot restart dsv4@alpha" in (said or "")


# ----------------------------------------------------------------------------- the dry run


def test_the_dry_runs_plan_is_the_daemons_and_touches_nothing(machine: Machine) -> None:
    units = FakeUnits("alpha", "gamma", "delta")
    plan = asyncio.run(machine.transition(units).plan("the option table"))
    assert units.calls == []
    assert [c.instance for c in plan.conflicts] == ["alpha", "gamma"]
    text = plan.render()
    assert text.startswith("plan: switch to beta from alpha, gamma")
    assert "stop dsv4@alpha (systemd)" in text and "start dsv4@alpha, dsv4@gamma again" in text


def test_the_dry_run_refuses_what_the_daemon_refuses(tmp_path: Path) -> None:
    machine = Machine(tmp_path, beta_extra="takeover = false")
    units = FakeUnits("alpha")
    with pytest.raises(PreconditionError, match=r"\(takeover = false in the profile\)"):
        asyncio.run(machine.transition(units).plan("the option table"))
    with listening(machine.ports["beta"]), pytest.raises(PreconditionError, match="refusing to start: port"):
        asyncio.run(machine.transition(FakeUnits()).plan("the option table"))
    assert units.calls == []


def test_the_dry_run_plans_without_gpus_it_cannot_read_and_the_daemon_refuses(machine: Machine) -> None:
    def no_nvml() -> Any:
        raise NvmlUnavailable("cannot check GPUs: libnvidia-ml.so.1 (NVML) not found")

    transition = machine.transition(FakeUnits("alpha"))
    transition.backends = Backends(Programs.of(machine.cfg), no_nvml, lambda _s: [], model_paths_must_exist=True)
    warned: list[str] = []
    plan = asyncio.run(transition.plan("x", warn=warned.append))
    assert [c.instance for c in plan.conflicts] == ["alpha"] and "libnvidia-ml.so.1" in warned[0]
    with pytest.raises(NvmlUnavailable):
        prepare(transition)
    assert transition.units is not None and transition.units.calls == []  # type: ignore[attr-defined]


def test_gpusupctl_switch_dry_run_refuses_a_foreign_holder_as_the_daemon_would(machine: Machine, capsys) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.cli import gpusupctl

    config_dir = str(machine.cfg.config_dir)
    assert gpusupctl.main(["switch", "beta", "--dry-run", "--config-dir", config_dir]) == 0
    assert capsys.readouterr().out.startswith("plan: switch to beta (nothing to stop)")
    with listening(machine.ports["beta"]):
        assert gpusupctl.main(["switch", "beta", "--dry-run", "--config-dir", config_dir]) == 3
    assert f"refusing to start: port 127.0.0.1:{machine.ports['beta']}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the controller


class FakeLock:
    """The machine's transition lock, in memory: `holder` is who holds it now."""

    def __init__(self, holder: str = "") -> None:
        self.holder_now, self.acquired, self.released = holder, 0, 0

    async def acquire(self) -> None:
        self.acquired += 1

    def release(self) -> None:
        self.released += 1

    def holder(self) -> str:
        return self.holder_now


class FakeInstance:
    """An instance that runs nothing: `starting` is what its start does (return: ready)."""

    def __init__(self, starting: Callable[[], Awaitable[None]] | None = None) -> None:
        self.starting = starting
        self.processes: dict[str, Any] = {}
        self.state, self.cancel_reason, self.failed = State.STOPPED, "", asyncio.Event()
        self.abort: asyncio.Event | None = None  # while its start runs
        self.failure = StartError("")
        self.log: list[str] = []

    async def prepare(self) -> None:
        self.log.append("prepare")

    async def start(self) -> None:
        self.log.append("start")
        if self.starting is None:  # ready at once
            self.state = State.READY
            return
        self.abort = asyncio.Event()
        work = asyncio.ensure_future(self.starting())
        aborted = asyncio.ensure_future(self.abort.wait())
        try:
            await asyncio.wait({work, aborted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.log.append("start cancelled")
            raise
        finally:
            self.abort = None
            aborted.cancel()
        if not work.done():  # failed from outside: what had started is stopped
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            self.log.append(f"start failed: {self.failure}")
            raise self.failure
        work.result()
        self.state = State.READY

    def fail_start(self, error: StartError) -> bool:
        if self.abort is None:
            return False
        self.failure = error
        self.abort.set()
        return True

    def set_transition(self, _text: str) -> None:
        pass

    def refuse(self, error: SupervisorError) -> None:
        self.log.append(f"refused: {error}")

    def stopped_while_starting(self) -> None:
        self.log.append("stopped while making room")

    def fail(self, reason: str) -> None:
        self.log.append(f"failed: {reason}")

    async def stop(self, why: str = "") -> float:
        self.log.append(f"stop: {why}")
        return 0.0


class FakeTransition:
    def __init__(self, making_room: Callable[[], Awaitable[None]] | None = None,
                 peer_fails: Callable[[], Awaitable[None]] | None = None) -> None:
        self.making_room, self.peer_fails = making_room, peer_fails
        self.rolled_back: list[SupervisorError] = []

    async def prepare(self, _how: str, _progress: Callable[[str], None]) -> None:
        if self.making_room is not None:
            await self.making_room()

    async def roll_back(self, error: SupervisorError, reason: str) -> str | None:
        self.rolled_back.append(error)
        return None

    async def peers_started(self) -> None:
        if self.peer_fails is not None:
            await self.peer_fails()

    def came_from(self) -> str:
        return "-"

    def took_over(self) -> bool:
        return False


def controller(machine: Machine, instance: FakeInstance, lock: FakeLock | None = None,
               transition: FakeTransition | None = None) -> InstanceController:
    return InstanceController(machine.cfg, machine.profile(), instance, machine.backends(),  # type: ignore[arg-type]
                              lambda m, _p, _e: machine.said.append(m), transition or FakeTransition(),  # type: ignore[arg-type]
                              lock or FakeLock())  # type: ignore[arg-type]


def test_the_start_is_prepare_then_the_transition_then_start(machine: Machine) -> None:
    order: list[str] = []
    instance = FakeInstance()

    async def making_room() -> None:
        order.append(f"transition after {instance.log}")

    lock = FakeLock()
    outcome = asyncio.run(controller(machine, instance, lock, FakeTransition(making_room)).start())
    assert outcome.ok and order == ["transition after ['prepare']"] and instance.log == ["prepare", "start"]
    assert lock.acquired == 1 and lock.released == 1


def test_a_refused_transition_fails_the_instance_and_starts_nothing(machine: Machine) -> None:
    async def refuse() -> None:
        raise PreconditionError("refusing to start: port 1 held")

    instance = FakeInstance()
    lock = FakeLock()
    outcome = asyncio.run(controller(machine, instance, lock, FakeTransition(refuse)).start())
    assert (outcome.state, outcome.exit_code) == ("refused", 3)
    assert instance.log[:2] == ["prepare", "refused: refusing to start: port 1 held"] and "start" not in instance.log
    assert lock.released == 1


def test_a_port_taken_while_loading_is_a_final_refusal_exit_3(machine: Machine) -> None:
    port = machine.ports["beta"]

    async def bind_fails_as_a_stranger_takes_the_port() -> None:
        squatter.append(listening(port))
        raise StartError("main: exited 1 (address already in use)")

    squatter: list[socket.socket] = []
    instance = FakeInstance(bind_fails_as_a_stranger_takes_the_port)
    transition = FakeTransition()
    try:
        outcome = asyncio.run(controller(machine, instance, transition=transition).start())
    finally:
        for s in squatter:
            s.close()
    assert (outcome.state, outcome.exit_code) == ("refused", 3), outcome
    assert f"refusing to start: port 127.0.0.1:{port}" in outcome.reason and "taken while beta was starting" in outcome.reason
    assert isinstance(transition.rolled_back[0], PreconditionError)  # the rollback hears the refusal, not the crash


def test_a_start_that_fails_with_its_ports_free_is_a_failure_exit_1(machine: Machine) -> None:
    async def crash() -> None:
        raise StartError("main: exited 1")

    transition = FakeTransition()
    outcome = asyncio.run(controller(machine, FakeInstance(crash), transition=transition).start())
    assert (outcome.state, outcome.exit_code, outcome.reason) == ("failed", 1, "main: exited 1")
    assert isinstance(transition.rolled_back[0], StartError)


def test_a_part_of_the_same_start_failing_on_another_node_fails_ours_at_once_and_rolls_back(machine: Machine) -> None:
    """Rank 0 of a TP spanning nodes waits for rank 1 for ever: when node b's part fails, our
    start fails then (not at its start_timeout), naming b, and the transition rolls back."""
    async def loads_for_ever() -> None:
        await asyncio.sleep(3600)

    async def b_fails() -> None:
        await asyncio.sleep(0.05)
        raise StepFailed("b", 3, "start of dsv4@tp.service: failed")

    instance, transition = FakeInstance(loads_for_ever), FakeTransition(peer_fails=b_fails)
    outcome = asyncio.run(asyncio.wait_for(controller(machine, instance, transition=transition).start(), 10))
    assert (outcome.state, outcome.exit_code) == ("failed", 1), outcome
    assert outcome.reason == "cluster transition to beta: step 3 failed on node 'b': start of dsv4@tp.service: failed"
    assert instance.log[-1] == f"failed: {outcome.reason}" and f"start failed: {outcome.reason}" in instance.log
    assert isinstance(transition.rolled_back[0], StartError)


def test_peers_that_all_started_leave_our_start_to_finish_by_itself(machine: Machine) -> None:
    async def loads() -> None:
        await asyncio.sleep(0.1)

    async def peers_up() -> None:
        return

    instance = FakeInstance(loads)
    outcome = asyncio.run(controller(machine, instance, transition=FakeTransition(peer_fails=peers_up)).start())
    assert outcome.ok and instance.log == ["prepare", "start"], (outcome, instance.log)


def test_a_second_job_while_one_runs_is_refused_as_busy(machine: Machine) -> None:
    async def scenario() -> tuple[str, str]:
        ctl = controller(machine, FakeInstance())
        release = asyncio.Event()

        async def long_work() -> Outcome:
            await release.wait()
            return Outcome.done()

        first = ctl.submit("restart", long_work)
        with pytest.raises(SupervisorError, match=rf"beta is busy with job {first.id}"):
            ctl.submit("restart", long_work)
        release.set()
        for _ in range(100):
            if first.state != "running":
                break
            await asyncio.sleep(0.001)
        later = ctl.submit("restart", long_work)  # the first is done: a new one is taken
        release.set()
        await asyncio.sleep(0.01)
        return first.state, later.state

    assert asyncio.run(scenario()) == ("done", "done")


def run_until(ctl: InstanceController, instance: FakeInstance, mark: str,
              then: Callable[[], None]) -> int:
    """Run the daemon's life; once `mark` is in the instance's log, do `then` (a stop, usually)."""

    async def scenario() -> int:
        life = asyncio.ensure_future(ctl.run())
        for _ in range(1000):
            if mark in instance.log:
                break
            await asyncio.sleep(0.001)
        assert mark in instance.log, instance.log
        then()
        done, _ = await asyncio.wait({life}, timeout=3)
        if not done:  # never cancel it from here: run() would take our cancellation for its own stop
            pytest.fail(f"the daemon's life did not end after the stop; the instance did: {instance.log}")
        return life.result()

    return asyncio.run(scenario())


def test_the_loser_names_the_winner_when_stopped_by_its_takeover(machine: Machine) -> None:
    instance, lock = FakeInstance(), FakeLock()
    ctl = controller(machine, instance, lock)

    def stopped_by_alpha() -> None:
        lock.holder_now = "alpha (pid 4711)"
        ctl.request_stop()

    assert run_until(ctl, instance, "start", stopped_by_alpha) == EXIT_OK
    assert instance.log[-1] == "stop: stop requested: alpha (pid 4711) is taking over (it holds the transition lock)"


def test_a_stop_while_our_own_transition_holds_the_lock_names_no_winner(machine: Machine) -> None:
    instance, lock = FakeInstance(), FakeLock()
    ctl = controller(machine, instance, lock)

    def stopped() -> None:
        lock.holder_now = "beta (pid 1)"
        ctl.request_stop()

    assert run_until(ctl, instance, "start", stopped) == EXIT_OK
    assert instance.log[-1] == "stop: stop requested"


def test_a_stop_while_starting_cancels_the_start_and_exits_0(machine: Machine) -> None:
    forever = asyncio.Event
    instance, lock = FakeInstance(lambda: forever().wait()), FakeLock()
    ctl = controller(machine, instance, lock)

    def stop_now() -> None:
        lock.holder_now = "alpha (pid 4711)"
        ctl.request_stop()

    assert run_until(ctl, instance, "start", stop_now) == EXIT_OK
    assert instance.log[-1] == "start cancelled" and not any(e.startswith("stop:") for e in instance.log)
    assert instance.cancel_reason == ("stopped while starting: alpha (pid 4711) is taking over "
                                      "(it holds the transition lock)")
    assert lock.released >= 1


def test_a_stop_while_making_room_stops_the_instance_before_anything_started(machine: Machine) -> None:
    waiting = asyncio.Event
    instance = FakeInstance()
    ctl = controller(machine, instance, transition=FakeTransition(lambda: waiting().wait()))
    assert run_until(ctl, instance, "prepare", ctl.request_stop) == EXIT_OK
    assert instance.log == ["prepare", "stopped while making room"]


def test_a_stop_during_a_restart_cancels_its_start_is_answered_at_once_and_exits_0(machine: Machine) -> None:
    """A D-Bus Stop while a Restart job's start waits for the servers to load: the start is
    cancelled (what had started is stopped), the stop's job is done at once, the daemon exits 0.
    It used to wait for the whole restart (14.5 s, or forever for a start that hangs)."""
    starts: list[int] = []

    async def the_restarts_start_hangs() -> None:
        starts.append(1)
        if len(starts) > 1:
            await asyncio.Event().wait()

    instance = FakeInstance(the_restarts_start_hangs)
    ctl = controller(machine, instance)

    async def scenario() -> tuple[int, Any, Any, float]:
        life = asyncio.ensure_future(ctl.run())
        for _ in range(1000):
            if instance.state == State.READY:
                break
            await asyncio.sleep(0.001)
        restart = ctl.submit("restart", ctl.restart)
        for _ in range(1000):
            if len(starts) == 2:
                break
            await asyncio.sleep(0.001)
        assert len(starts) == 2, instance.log
        asked = asyncio.get_running_loop().time()
        stop = ctl.request_stop()
        done, _ = await asyncio.wait({life}, timeout=3)
        if not done:
            pytest.fail(f"the stop waited for the restart; the instance did: {instance.log}")
        for _ in range(100):  # the restart's job ends in the same turn of the loop or the next
            if restart.state != "running":
                break
            await asyncio.sleep(0.001)
        return life.result(), restart, stop, asyncio.get_running_loop().time() - asked

    code, restart, stop, took = asyncio.run(scenario())
    assert code == EXIT_OK and took < 1.0
    assert stop.state == "done"
    assert (restart.state, restart.reason) == ("failed", "cancelled: a stop was requested during the restart")
    assert instance.log[-2:] == ["start cancelled", "stop: stop requested"], instance.log
    assert instance.cancel_reason == "stopped while restarting"


@pytest.mark.parametrize(("error", "code"), [
    (StartError("server: exited during start-up (exit code 1)"), EXIT_GAVE_UP),
    (PreconditionError("refusing to start: port 127.0.0.1:30001 is held by pid 4711"), EXIT_PRECONDITIONS),
], ids=["failed-start-is-6", "refusal-stays-3"])
def test_a_restart_asked_for_over_the_bus_that_fails_ends_the_daemon_with_a_final_code(machine: Machine, error: SupervisorError,
                                                                                       code: int) -> None:
    """A D-Bus Restart whose start fails: the daemon exits with a code systemd does not retry
    (RestartPreventExitStatus=2 3 5 6). A start that failed is 6, the instance gave up; exit 1
    would have had systemd load every server again into the same failure. A refusal keeps its own
    code (3: something holds the GPUs or ports)."""
    starts: list[int] = []

    async def the_restarts_start_fails() -> None:
        starts.append(1)
        if len(starts) > 1:
            raise error

    instance = FakeInstance(the_restarts_start_fails)
    ctl = controller(machine, instance)

    async def scenario() -> tuple[int, Any]:
        life = asyncio.ensure_future(ctl.run())
        for _ in range(1000):
            if instance.state == State.READY:
                break
            await asyncio.sleep(0.001)
        job = ctl.submit("restart", ctl.restart)
        done, _ = await asyncio.wait({life}, timeout=3)
        if not done:
            pytest.fail(f"the daemon went on after a failed restart: {instance.log}")
        return life.result(), job

    exit_code, job = asyncio.run(scenario())
    assert exit_code == code
    assert job.state in ("failed", "refused") and job.reason.startswith(str(error).split(":")[0])
