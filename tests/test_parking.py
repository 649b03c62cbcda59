"""Parking a profile (issue 39): the decisions, the checkpointers and the park/restore sequence,
against the fake checkpointer and a fake instance, in milliseconds (fast tier).

What is specified here: only the profile's own GPU-holding PIDs are parked; a park short of host
memory is refused with its figures and touches nothing; a checkpoint that fails half-way is
undone; the GPU must read at its baseline after it; a restore that fails, or whose generation
fails, stops the profile and starts it cold, and says so; a parked profile's stop leaves nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from supervisord_gpu.checks.gpus import GpuInventory, GpuProcess, GpuState, SimulatedInventory
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.controller.parking import Parker
from supervisord_gpu.engine.states import INSTANCE_MOVES, PROCESS_MOVES, InstanceState, ProcessState
from supervisord_gpu.errors import ERRORS, EXIT_PRECONDITIONS, ParkRefused, error_for_name
from supervisord_gpu.parking.binary import BinaryCheckpointer
from supervisord_gpu.parking.checkpointer import CheckpointError, CheckpointState, CheckpointUnavailable
from supervisord_gpu.parking.decisions import (
    GIB,
    MIB,
    baseline_problems,
    find_targets,
    host_memory_refusal,
    PortHolder,
    PortsVerdict,
    StoppedWhileParked,
    judge_restore,
    port_refusal,
    ports_in_the_way,
)
from supervisord_gpu.parking.driver import DriverCheckpointer
from supervisord_gpu.parking.fake import FakeCheckpointer
from supervisord_gpu.parking.hostmem import parse_mem_available
from supervisord_gpu.parking.simulated import SimulatedCheckpointer


def gpu(index: int, holders: dict[int, int]) -> GpuState:
    procs = tuple(GpuProcess(pid, mib) for pid, mib in sorted(holders.items()))
    used = sum(holders.values())
    return GpuState(index, f"GPU-{index}", "H100", 81559, used, 0, 0, procs, used == 0)


class FakeInventory(GpuInventory):
    """GPUs whose holders the test sets; a checkpoint by the fake checkpointer empties them."""

    kind = "fake"

    def __init__(self, holders: dict[int, dict[int, int]], checkpointer: FakeCheckpointer | None = None) -> None:
        self.holders, self.checkpointer = holders, checkpointer

    def count(self) -> int:
        return len(self.holders)

    def snapshot(self, indices: Any = None) -> list[GpuState]:
        parked = set(self.checkpointer.parked_bytes) if self.checkpointer else set()
        wanted = sorted(self.holders) if indices is None else sorted(indices)
        return [gpu(i, {p: m for p, m in self.holders[i].items() if p not in parked}) for i in wanted]


def fake_profile(name: str, ports: dict[str, tuple[str, list[int]]], gpus: list[int] | None = None) -> Any:
    """A profile as the Parker reads it: process name -> (kind, every port it listens on)."""
    specs = [SimpleNamespace(name=n, kind=kind, listens=lambda ps=ps: [SimpleNamespace(port=p) for p in ps])
             for n, (kind, ps) in ports.items()]
    return SimpleNamespace(name=name, gpus=gpus or [], processes=specs,
                           listens=lambda: [listen for spec in specs for listen in spec.listens()])


class FakeInstance:
    """What the Parker asks of an Instance: its PIDs per process, park/resume/stop, its profile.
    `ports`: each process's kind and ports ({"server": ("server", [30000])} unless given)."""

    def __init__(self, name: str, pids: dict[str, list[int]], gpus: list[int], ports: list[int],
                 kinds: dict[str, tuple[str, list[int]]] | None = None) -> None:
        self.name = name
        #: what the Parker did, in order: (pid, signal) to a PID, ("kill_parked", process, why) to a
        #: process's whole cgroup, ("stop", reason) the instance's stop, ("restart", process) one
        #: process restarted cold (`restart_process`)
        self.signals: list[tuple[object, ...]] = []
        self.processes = {n: SimpleNamespace(spawned=SimpleNamespace(group=SimpleNamespace(pids=lambda p=p: p)),
                                             kill_parked=lambda why, n=n: self.signals.append(("kill_parked", n, why)))
                          for n, p in pids.items()}
        self.profile = fake_profile(name, kinds or {n: ("server", ports) for n in pids}, gpus)
        self.state = InstanceState.READY
        self.stopped = ""
        #: what the park stopped (name -> why) and whether the resume started it again
        self.stopped_while_parked: dict[str, str] = {}
        self.start_again_fails = ""

    async def park(self, suspend: Any, stop: Any = None) -> None:
        self.stopped_while_parked = dict(stop or {})
        await suspend()
        self.state = InstanceState.PARKED

    async def resume(self, restore: Any, prove: Any = None) -> None:
        from supervisord_gpu.errors import StartError

        await restore()
        if self.stopped_while_parked and self.start_again_fails:
            raise StartError(self.start_again_fails)
        self.stopped_while_parked = {}
        if prove is not None:
            await prove()
        self.state = InstanceState.READY

    async def restart_process(self, name: str) -> None:
        if name not in self.processes:
            raise KeyError(name)
        self.signals.append(("restart", name))

    async def stop(self, reason: str = "") -> float:
        self.state, self.stopped = InstanceState.STOPPED, reason
        self.signals.append(("stop", reason))
        return 0.0


def setup(mem_available: int | None = 200 * GIB, **holders: int) -> tuple[Parker, FakeCheckpointer, FakeInstance, list[str]]:
    """A server whose scheduler (pid 101) holds 20 GiB on GPU 0; its tokenizer (pid 100) holds nothing;
    a stranger (pid 999) holds memory on GPU 1."""
    ckpt = FakeCheckpointer({101: 20 * GIB})
    inventory = FakeInventory({0: {101: 20 * 1024}, 1: {999: 1024}}, ckpt)
    said: list[str] = []
    inst = FakeInstance("tp1", {"server": [100, 101]}, [0], [30000])
    parker = Parker(ckpt, inventory, lambda m, _p: said.append(m), mem_available=lambda: mem_available,
                    kill=lambda pid, sig: inst.signals.append((pid, sig)))
    return parker, ckpt, inst, said


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- decisions


def test_only_the_profiles_own_gpu_holders_are_parked() -> None:
    """A stranger on the same GPU is never ours to park; a tokenizer with no CUDA memory is not parked."""
    states = [gpu(0, {101: 2048, 999: 512}), gpu(1, {101: 2048})]
    targets = find_targets({"server": [100, 101], "router": [200]}, states)
    assert [(t.process, t.pid, t.gpu_bytes) for t in targets] == [("server", 101, 4096 * MIB)]


def test_park_short_of_host_memory_is_refused_with_the_figures() -> None:
    why = host_memory_refusal("tp1", 20 * 10**9, 16 * 10**9)
    assert why == "refusing to park tp1: host memory available 16.0 GB, needed 20.0 GB to park + 4.3 GB margin"
    assert host_memory_refusal("tp1", 20 * 10**9, 30 * 10**9) == ""
    assert "needed 20.0 GB to park + 4.3 GB margin" in host_memory_refusal("tp1", 20 * 10**9, 22 * 10**9), \
        "the bytes fit, the margin does not: refused"
    assert "unknown" in host_memory_refusal("tp1", 1, None)


def test_a_port_the_next_profile_needs_refuses_the_park() -> None:
    assert "30000" in port_refusal("tp1", [30000, 30001], "pd", [30000])
    assert port_refusal("tp1", [30000], "pd", [31000]) == ""


#: pd-1p1d's processes and ports as shipped (the prefill's bootstrap, the router's metrics included)
PD = {"prefill": PortHolder("prefill", "server", (30100, 8998)), "decode": PortHolder("decode", "server", (30200,)),
      "router": PortHolder("router", "router", (30001, 30091))}


def test_a_router_on_a_port_the_next_profile_needs_is_stopped_while_parked_not_refused() -> None:
    """The shipped pair: pd-1p1d and tp4-512k both front on 30001 (clients never change port)."""
    verdict = ports_in_the_way("pd-1p1d", PD.values(), "tp4-512k", [30300, 30001, 30092])
    assert verdict.refusal == ""
    assert verdict.stop == (StoppedWhileParked("router", (30001,), "tp4-512k"),)
    assert verdict.kept == (8998, 30100, 30200), "the router's metrics port goes with it; the servers' stay"
    assert verdict.stop[0].why() == "stopped while parked: tp4-512k needs port 30001"
    assert verdict.stop[0].describe() == "router stopped while parked (tp4-512k needs port 30001)"


def test_a_router_in_the_way_by_its_metrics_port_alone_is_stopped_too() -> None:
    verdict = ports_in_the_way("pd-1p1d", PD.values(), "other", [30091])
    assert [s.process for s in verdict.stop] == ["router"] and verdict.stop[0].ports == (30091,)


def test_a_server_on_a_port_the_next_profile_needs_refuses_naming_only_the_servers_ports() -> None:
    verdict = ports_in_the_way("pd-1p1d", PD.values(), "x", [30001, 30200, 8998])
    assert verdict.refusal == ("refusing to park pd-1p1d: x needs port(s) 8998,30200, which pd-1p1d keeps "
                               "listening on while parked; stop it instead")


def test_nothing_in_the_way_stops_nothing_and_keeps_every_port() -> None:
    verdict = ports_in_the_way("pd-1p1d", PD.values(), "", [])
    assert verdict == PortsVerdict((), (8998, 30001, 30091, 30100, 30200), "")


def test_a_gpu_not_at_baseline_after_the_park_is_named_with_its_holders() -> None:
    problems = baseline_problems([gpu(0, {101: 4096}), gpu(1, {})], [101])
    assert problems == ["GPU 0 holds 4096 MiB after the park (pid 101 (parked))"]


def test_a_failed_restore_or_generation_means_a_cold_start_said_so() -> None:
    assert judge_restore("tp1", "", "", 1.5).serve
    failed = judge_restore("tp1", "cuCheckpointProcessRestore(pid 101) failed: CUDA_ERROR_OUT_OF_MEMORY", "", 1.0)
    assert not failed.serve and "starting it cold" in failed.say and "OUT_OF_MEMORY" in failed.say
    assert not judge_restore("tp1", "", "/generate answered 503", 1.0).serve
    router = judge_restore("tp1", "", "", 1.0, "router, stopped while parked, does not start again: exited")
    assert not router.serve and router.say == ("tp1 restored but router, stopped while parked, does not start "
                                               "again: exited; starting it cold instead")


@pytest.mark.parametrize("text, expected", [
    ("MemTotal: 100 kB\nMemAvailable:   2048 kB\n", 2048 * 1024),
    ("MemAvailable: 12 MB\n", None),  # a unit the kernel never writes: no figure, never a guess
    ("MemAvailable: -5 kB\n", None),
    ("MemFree: 10 kB\n", None),
    ("MemAvailable: 1e9 kB\n", None),
])
def test_mem_available_is_read_or_refused(text: str, expected: int | None) -> None:
    assert parse_mem_available(text) == expected


def test_parked_is_a_state_with_its_moves() -> None:
    assert InstanceState.PARKED in INSTANCE_MOVES[InstanceState.READY]
    assert INSTANCE_MOVES[InstanceState.PARKED] == {InstanceState.READY, InstanceState.STOPPING}
    assert PROCESS_MOVES[ProcessState.PARKED] == {ProcessState.READY, ProcessState.STOPPING}


def test_park_refused_is_an_error_of_the_table_exit_3() -> None:
    assert ParkRefused in ERRORS and ParkRefused.exit_code == EXIT_PRECONDITIONS
    assert error_for_name("org.supervisordgpu.Error.ParkRefused") is ParkRefused


# ----------------------------------------------------------------------------- the sequence


def test_park_checkpoints_the_cuda_process_and_verifies_the_baseline() -> None:
    parker, ckpt, inst, said = setup()
    record = run(parker.park(inst))
    assert ckpt.calls[:2] == [("lock", 101), ("checkpoint", 101)]
    assert ckpt.states[101] == CheckpointState.CHECKPOINTED and inst.state == InstanceState.PARKED
    assert record.host_bytes == 20 * GIB and record.pids == [101]
    assert "0 MiB on the GPU, 21.5 GB host (server pid 101)" in record.describe()
    assert "verified at their baseline" in said[-1]


def test_park_without_host_memory_touches_nothing() -> None:
    parker, ckpt, inst, _ = setup(mem_available=8 * GIB)
    with pytest.raises(ParkRefused, match=r"host memory available 8.6 GB, needed 21.5 GB"):
        run(parker.park(inst))
    assert ckpt.calls == [] and inst.state == InstanceState.READY


def test_a_checkpoint_failing_half_way_is_undone() -> None:
    parker, ckpt, inst, _ = setup()
    ckpt.gpu_bytes[102] = GIB
    parker.inventory.holders[0][102] = 1024  # type: ignore[attr-defined]
    inst.processes["server"].spawned.group.pids = lambda: [100, 101, 102]
    ckpt.fail.add(("checkpoint", 102))
    with pytest.raises(ParkRefused, match="park of tp1 failed and was undone"):
        run(parker.park(inst))
    assert ckpt.states[101] == CheckpointState.RUNNING and ckpt.states[102] == CheckpointState.RUNNING
    assert ("restore", 101) in ckpt.calls and ("unlock", 102) in ckpt.calls


def test_a_gpu_still_held_after_the_checkpoint_undoes_the_park() -> None:
    parker, ckpt, inst, _ = setup()
    parker.inventory.checkpointer = None  # type: ignore[attr-defined]  # the GPU keeps listing pid 101
    with pytest.raises(ParkRefused, match="GPU 0 holds 20480 MiB after the park"):
        run(parker.park(inst))
    assert ckpt.states[101] == CheckpointState.RUNNING


def test_restore_brings_it_back_serving() -> None:
    parker, ckpt, inst, said = setup()
    run(parker.park(inst))
    cold: list[str] = []

    async def serves() -> str:
        return ""

    async def cold_start() -> None:
        cold.append("cold")

    verdict = run(parker.restore(inst, cold_start, serves))
    assert verdict.serve and cold == [] and ckpt.states[101] == CheckpointState.RUNNING
    assert inst.state == InstanceState.READY and "restored and serving" in said[-1]


@pytest.mark.parametrize("failing", ["restore", "generation"])
def test_a_failed_restore_falls_back_to_a_cold_start(failing: str) -> None:
    parker, ckpt, inst, said = setup()
    run(parker.park(inst))
    if failing == "restore":
        ckpt.fail.add(("restore", 101))
    cold: list[str] = []

    async def serves() -> str:
        return "/generate answered 503" if failing == "generation" else ""

    async def cold_start() -> None:
        cold.append(inst.state.value)

    verdict = run(parker.restore(inst, cold_start, serves))
    assert not verdict.serve and cold == ["stopped"]
    assert "starting it cold instead" in said[-1] and inst.stopped.startswith("restore failed")


def routed_setup() -> tuple[Parker, FakeCheckpointer, FakeInstance, list[str]]:
    """setup()'s server behind a router (pid 200, no GPU memory) on 30001, its metrics on 30091."""
    parker, ckpt, _, said = setup()
    inst = FakeInstance("pd", {"server": [100, 101], "router": [200]}, [0], [],
                        {"server": ("server", [30000]), "router": ("router", [30001, 30091])})
    parker.kill = lambda pid, sig: inst.signals.append((pid, sig))
    return parker, ckpt, inst, said


def test_park_stops_the_router_the_next_profile_needs_and_records_it_stopped_while_parked() -> None:
    parker, ckpt, inst, said = routed_setup()
    record = run(parker.park(inst, fake_profile("tp4", {"server": ("server", [30300]), "router": ("router", [30001])})))
    assert inst.stopped_while_parked == {"router": "stopped while parked: tp4 needs port 30001"}
    assert record.pids == [101] and ckpt.calls[:2] == [("lock", 101), ("checkpoint", 101)], "the router holds no GPU"
    assert record.ports == [30000], "the ports it keeps listening on: what the next profile's takeover reads"
    assert record.describe().endswith("; router stopped while parked (tp4 needs port 30001)")
    assert record.to_json()["stopped"] == [{"process": "router", "ports": [30001], "needed_by": "tp4"}]
    assert "router stopped while parked" in said[-1]


def test_park_for_a_profile_on_other_ports_stops_nothing() -> None:
    parker, _, inst, _ = routed_setup()
    record = run(parker.park(inst, fake_profile("b", {"server": ("server", [31000])})))
    assert inst.stopped_while_parked == {} and record.ports == [30000, 30001, 30091] and record.stopped == []


def test_park_for_a_profile_on_a_servers_port_is_refused_touching_nothing() -> None:
    parker, ckpt, inst, _ = routed_setup()
    with pytest.raises(ParkRefused, match=r"tp4 needs port\(s\) 30000, which pd keeps listening on while parked"):
        run(parker.park(inst, fake_profile("tp4", {"server": ("server", [30000]), "router": ("router", [30001])})))
    assert ckpt.calls == [] and inst.state == InstanceState.READY and inst.stopped_while_parked == {}


def test_a_router_that_does_not_start_again_at_the_restore_means_a_cold_start_said_so() -> None:
    parker, ckpt, inst, said = routed_setup()
    run(parker.park(inst, fake_profile("tp4", {"router": ("router", [30001])})))
    inst.start_again_fails = "router, stopped while parked, does not start again: exited during start-up (exit code 1)"
    cold: list[str] = []

    async def cold_start() -> None:
        cold.append(inst.state.value)

    async def serves() -> str:
        return ""

    verdict = run(parker.restore(inst, cold_start, serves))
    assert not verdict.serve and cold == ["stopped"] and ckpt.states[101] == CheckpointState.RUNNING
    assert said[-1] == ("pd restored but router, stopped while parked, does not start again: exited during "
                        "start-up (exit code 1); starting it cold instead")


def test_stop_of_a_parked_profile_leaves_nothing() -> None:
    parker, _, inst, _ = setup()
    run(parker.park(inst))
    run(parker.stop(inst))
    assert inst.state == InstanceState.STOPPED and parker.parked == {}


# ----------------------------------------------------------------------------- held while parked
# On the real SGLang 0.5.23 (H100, driver 580, the driver API, 2026-12-07) a request sent to a
# parked server's front end crashed its checkpointed scheduler (SIGSEGV in cudaEventQuery): the
# rest of each parked server is held with SIGSTOP from before the lock until after the restore.


def timeline(parker: Parker, ckpt: FakeCheckpointer, inst: FakeInstance) -> list[tuple[object, ...]]:
    """The checkpointer's calls and the Parker's signals, in the order they happened."""
    events: list[tuple[object, ...]] = []
    for op in ("lock", "checkpoint", "restore", "unlock"):
        real = getattr(ckpt, op)

        def traced(pid: int, *a: Any, op: str = op, real: Any = real) -> Any:
            events.append((op, pid))
            return real(pid, *a)
        setattr(ckpt, op, traced)
    parker.kill = lambda pid, sig: events.append(("signal", pid, signal.Signals(sig).name))
    return events


def test_the_front_end_is_held_from_before_the_lock_until_after_the_restore() -> None:
    parker, ckpt, inst, _ = setup()
    events = timeline(parker, ckpt, inst)
    record = run(parker.park(inst))
    assert events == [("signal", 100, "SIGSTOP"), ("lock", 101), ("checkpoint", 101)]
    assert record.to_json()["held"] == [{"process": "server", "pid": 100}]

    async def serves() -> str:
        return ""

    async def cold_start() -> None:
        raise AssertionError("not a cold start")

    assert run(parker.restore(inst, cold_start, serves)).serve
    assert events[3:] == [("restore", 101), ("unlock", 101), ("signal", 100, "SIGCONT")]


def test_a_router_is_never_held() -> None:
    parker, ckpt, inst, _ = routed_setup()
    record = run(parker.park(inst))
    assert [(h.process, h.pid) for h in record.held] == [("server", 100)]
    assert inst.signals == [(100, signal.SIGSTOP)], "pid 200, the router, holds no GPU and is not held"


def test_a_failed_park_releases_what_it_held() -> None:
    parker, ckpt, inst, _ = setup()
    events = timeline(parker, ckpt, inst)
    ckpt.fail.add(("checkpoint", 101))
    with pytest.raises(ParkRefused, match="park of tp1 failed and was undone"):
        run(parker.park(inst))
    assert events[0] == ("signal", 100, "SIGSTOP") and events[-1] == ("signal", 100, "SIGCONT")
    assert inst.state == InstanceState.READY


def test_a_held_pid_that_left_the_cgroup_is_never_signalled_again() -> None:
    parker, ckpt, inst, _ = setup()
    run(parker.park(inst))
    inst.processes["server"].spawned.group.pids = lambda: [101, 555]  # 100 ended; 555 is new to it

    async def serves() -> str:
        return ""

    async def cold_start() -> None:
        raise AssertionError("not a cold start")

    run(parker.restore(inst, cold_start, serves))
    assert inst.signals == [(100, signal.SIGSTOP)], "no SIGCONT to a PID that is no longer ours, none to 555"


def test_stop_of_a_parked_profile_kills_its_parked_servers_cgroups_then_stops_it() -> None:
    parker, ckpt, inst, _ = routed_setup()
    run(parker.park(inst))
    run(parker.stop(inst, "stopped by the operator"))
    assert inst.signals[1:] == [("kill_parked", "server", "stopped by the operator: parked, nothing to drain"),
                                ("stop", "stopped by the operator")], "the server's cgroup killed, then the stop; never the router's"
    assert inst.state == InstanceState.STOPPED and parker.parked == {}


@pytest.mark.parametrize("failure", ["nvml", "cancelled"])
def test_a_park_failing_otherwise_than_a_checkpoint_error_is_undone_and_releases_the_hold(failure: str) -> None:
    parker, ckpt, inst, _ = setup()
    events = timeline(parker, ckpt, inst)
    from supervisord_gpu.checks.gpus import NvmlUnavailable

    def broken(indices: Any = None) -> Any:
        if ("checkpoint", 101) in events:  # the baseline read after the checkpoint
            raise NvmlUnavailable("NVML: driver/library version mismatch") if failure == "nvml" else asyncio.CancelledError()
        return FakeInventory.snapshot(parker.inventory, indices)  # type: ignore[arg-type]

    parker.inventory.snapshot = broken  # type: ignore[method-assign]
    with pytest.raises((NvmlUnavailable, asyncio.CancelledError)):
        run(parker.park(inst))
    assert events[-3:] == [("restore", 101), ("unlock", 101), ("signal", 100, "SIGCONT")]
    assert ckpt.states[101] == CheckpointState.RUNNING and "tp1" not in parker.parked


def test_a_failed_park_that_cannot_bring_the_scheduler_back_keeps_its_front_end_held() -> None:
    parker, ckpt, inst, said = setup()
    events = timeline(parker, ckpt, inst)
    ckpt.fail |= {("restore", 101)}
    parker.inventory.checkpointer = None  # type: ignore[attr-defined]  # the GPU still lists 101: the park fails
    with pytest.raises(ParkRefused):
        run(parker.park(inst))
    assert ("signal", 100, "SIGCONT") not in events, "a request would crash the scheduler still checkpointed"
    assert "could not be brought back" in said[-1]


# ----------------------------------------------------------------------------- the mechanisms


def test_fake_keeps_the_drivers_state_rules() -> None:
    ckpt = FakeCheckpointer()
    with pytest.raises(CheckpointError, match="ILLEGAL_STATE"):
        ckpt.checkpoint(5)  # never locked


def test_driver_api_absent_is_said_in_one_line() -> None:
    with pytest.raises(CheckpointUnavailable, match="no CUDA driver library"):
        DriverCheckpointer.open("/nonexistent/libcuda.so.1")


class OldLibcuda:
    """A libcuda of driver 550 (CUDA 12.4): it answers its version and has no checkpoint calls."""

    def cuDriverGetVersion(self, out: Any) -> int:  # noqa: N802  (the driver's name)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 12040
        return 0


def test_a_driver_older_than_570_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes, "CDLL", lambda path: OldLibcuda())
    with pytest.raises(CheckpointUnavailable, match="the CUDA driver is 12.4; checkpoints need 12.8"):
        DriverCheckpointer.open()


def test_cuda_checkpoint_binary_states_are_parsed_and_strange_words_refused() -> None:
    answers = iter(["checkpointed\n", "Running\n", "pwned; rm -rf\n"])

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, next(answers), "")

    b = BinaryCheckpointer("/usr/bin/cuda-checkpoint", fake_run)
    assert b.state(7) == CheckpointState.CHECKPOINTED
    assert b.state(7) == CheckpointState.RUNNING
    with pytest.raises(CheckpointError, match="not a state"):
        b.state(7)


def test_simulated_checkpoint_moves_the_memory_off_the_gpu_and_back(tmp_path: Any) -> None:
    sim = SimulatedGpus.create(tmp_path / "simgpu", 2, total_mib=1000, reserved_mib=0)
    sim.hold([0], 600)
    inventory = SimulatedInventory(sim)
    ckpt = SimulatedCheckpointer(sim)
    me = os.getpid()
    ckpt.lock(me, 1000)
    ckpt.checkpoint(me)
    assert inventory.snapshot([0])[0].idle and ckpt.state(me) == CheckpointState.CHECKPOINTED
    assert ckpt.host_bytes(me) == 600 * MIB
    ckpt.restore(me)
    ckpt.unlock(me)
    assert inventory.snapshot([0])[0].used_mib == 600 and ckpt.state(me) == CheckpointState.RUNNING


def test_simulated_restore_onto_a_gpu_someone_filled_fails(tmp_path: Any) -> None:
    sim = SimulatedGpus.create(tmp_path / "simgpu", 1, total_mib=1000, reserved_mib=0)
    sim.hold([0], 600)
    ckpt = SimulatedCheckpointer(sim)
    me = os.getpid()
    ckpt.lock(me, 1000)
    ckpt.checkpoint(me)
    other = subprocess.Popen(["sleep", "30"])
    try:
        sim.hold([0], 500, pid=other.pid)
        with pytest.raises(CheckpointError, match="OUT_OF_MEMORY"):
            ckpt.restore(me)
    finally:
        other.kill()
        other.wait()


#: what dsv4@.service's CapabilityBoundingSet leaves out of the daemon's root (setpriv drops them
#: for the exec, as systemd does): without them root cannot write in another user's directory
UNIT_SANDBOX = ["setpriv", "--bounding-set=-dac_override,-fowner"]
PARK_AS_THE_UNIT = """
import json, os, signal, subprocess, sys
from pathlib import Path
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.parking.simulated import SimulatedCheckpointer

sim, nobody = SimulatedGpus(sys.argv[1]), 65534
server = subprocess.Popen(["sleep", "60"], user=nobody, group=nobody, extra_groups=[])
mine = sim.directory / "holders" / str(nobody)
mine.mkdir(mode=0o755)
held = mine / f"{server.pid}.json"
held.write_text(json.dumps({"pid": server.pid, "create_time": __import__("psutil").Process(server.pid).create_time(),
                            "gpus": [0], "mib": 600}))
os.chown(held, nobody, nobody)
os.chown(mine, nobody, nobody)
ckpt, seen = SimulatedCheckpointer(sim), {}
try:
    ckpt.lock(server.pid, 1000)
    ckpt.checkpoint(server.pid)
    seen["parked"] = sorted(os.listdir(mine))
    ckpt.restore(server.pid)
    ckpt.unlock(server.pid)
    seen["restored"] = sorted(os.listdir(mine))
    ckpt.lock(server.pid, 1000)
    ckpt.checkpoint(server.pid)
finally:
    server.kill()
    server.wait()
ckpt.forget(server.pid)  # a parked profile's stop: after its processes ended
seen["stopped"] = sorted(os.listdir(mine))
seen["pid"] = server.pid
print(json.dumps(seen))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="plays the unit's root, which runs the servers as another user")
def test_simulated_park_works_for_a_servers_user_as_the_units_root_without_dac_override(tmp_path: Any) -> None:
    """Under dsv4@.service the daemon's root has no CAP_DAC_OVERRIDE/CAP_FOWNER, and the shipped
    profiles run their servers as `sglang`: the park of pd-1p1d failed there with "Permission
    denied" renaming holders/<uid>/PID.json. The renames and the stop's removal run as the
    directory's owner, and the stop finds the parked holding of a process already gone."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    top = Path(tempfile.mkdtemp(prefix="park-sandbox-"))  # tmp_path's parents are 0700: nobody could enter
    try:
        os.chmod(top, 0o755)
        SimulatedGpus.create(top / "simgpu", 1, total_mib=1000, reserved_mib=0)
        done = subprocess.run([*UNIT_SANDBOX, sys.executable, "-c", PARK_AS_THE_UNIT, str(top / "simgpu")],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout)
        pid = seen["pid"]
        assert seen["parked"] == [f".parked.{pid}.json"] and seen["restored"] == [f"{pid}.json"], seen
        assert seen["stopped"] == [], "a stop of a parked profile left its host copy behind"
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def test_the_parked_holding_of_a_process_that_died_is_dropped_by_the_next_reader(tmp_path: Any) -> None:
    """A parked daemon SIGKILLed under systemd: its processes die with it (BindsTo=), nothing
    forgets their host copies, and 8 `.parked.PID.json` of the dead were left for good (seen in
    tests/test_parking_systemd.py). The driver frees a dead process's; the simulated GPUs' next
    reader (a stand-in starting, `gpusupctl gpus`) drops them as it drops dead holdings."""
    sim = SimulatedGpus.create(tmp_path / "simgpu", 1, total_mib=1000, reserved_mib=0)
    server = subprocess.Popen(["sleep", "30"])
    try:
        sim.hold([0], 600, pid=server.pid)
        ckpt = SimulatedCheckpointer(sim)
        ckpt.lock(server.pid, 1000)
        ckpt.checkpoint(server.pid)
        sim.holders()
        parked = list((sim.directory / "holders").rglob(".parked.*"))
        assert [p.name for p in parked] == [f".parked.{server.pid}.json"], "alive and parked: kept"
    finally:
        server.kill()
        server.wait()
    assert sim.holders() == [] and not parked[0].exists(), "its process is gone: so is its host copy"


def test_without_driver_api_or_utility_parking_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisord_gpu.parking import open_checkpointer

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CheckpointUnavailable) as info:
        open_checkpointer(libcuda="/nonexistent/libcuda.so.1")
    assert str(info.value) == ("no way to park on this machine: no CUDA driver library (/nonexistent/libcuda.so.1: "
                               "/nonexistent/libcuda.so.1: cannot open shared object file: No such file or directory); "
                               "no cuda-checkpoint on PATH")


# ----------------------------------------------------------------------------- the next profile's takeover


def two_profiles(tmp_path: Any) -> tuple[Any, Any, int, int]:
    import textwrap

    from supervisord_gpu.config.loader import load_daemon_config, load_profile
    from support import free_ports

    pa, pb = free_ports(2)
    etc = tmp_path / "etc"
    (etc / "profiles").mkdir(parents=True)
    (etc / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        runtime_dir = "{tmp_path / 'run'}"
        cache_dir = "{tmp_path / 'cache'}"
        default_user = "root"
        [gpus]
        backend = "simulated"
        """))
    for name, port in (("alpha", pa), ("beta", pb)):
        (etc / "profiles" / f"{name}.toml").write_text(f'[servers.main]\ngpus = [0]\nport = {port}\nmodel_path = "/m"\n')
    cfg = load_daemon_config(etc)
    return cfg, load_profile(cfg, "beta"), pa, pb


@pytest.mark.skipif(os.geteuid() != 0, reason="the runtime directory must be root's (config/trust.py)")
def test_the_next_profiles_takeover_leaves_a_parked_instance_alone_unless_it_holds_a_port(tmp_path: Any) -> None:
    from supervisord_gpu.controller import parked
    from supervisord_gpu.controller.takeover import find_conflicts
    from supervisord_gpu.parking.decisions import ParkedProfile

    cfg, beta, pa, pb = two_profiles(tmp_path)
    units = SimpleNamespace(instances=lambda: [SimpleNamespace(instance="alpha", active="active")])
    nobody = SimpleNamespace(running=lambda: [])

    def in_the_way() -> list[str]:
        return [c.instance for c in find_conflicts(beta, cfg, units, nobody)]  # type: ignore[arg-type]

    assert in_the_way() == ["alpha"], "running, on GPU 0: stopped by beta's start"
    parked.write(cfg.runtime_dir, ParkedProfile("alpha", "fake", [], 0, 0.0, ports=[pa]))
    assert in_the_way() == [], "parked: it holds nothing beta needs"
    os.chmod(cfg.runtime_dir / "parked" / "alpha.json", 0o666)
    assert in_the_way() == ["alpha"], "a record anyone may write is no record"
    parked.write(cfg.runtime_dir, ParkedProfile("alpha", "fake", [], 0, 0.0, ports=[pb]))
    assert in_the_way() == ["alpha"], "parked on a port beta needs: still in the way"
    parked.remove(cfg.runtime_dir, "alpha")
    assert in_the_way() == ["alpha"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the runtime directory must be root's (config/trust.py)")
def test_a_parked_record_whose_daemon_died_is_believed_by_nobody(tmp_path: Any) -> None:
    """Under systemd a parked daemon SIGKILLed leaves its record (no clean-up runs) while its
    processes die with it (BindsTo=). Believed, `gpusupctl switch` to it asked the dead daemon
    to restore (seen in tests/test_parking_systemd.py) instead of starting it, and a takeover
    passed it by. A record is believed only while the daemon that wrote it lives."""
    import json

    from supervisord_gpu.controller import parked
    from supervisord_gpu.controller.registry import write_record
    from supervisord_gpu.parking.decisions import ParkedProfile

    cfg, _beta, pa, _pb = two_profiles(tmp_path)
    parked.write(cfg.runtime_dir, ParkedProfile("alpha", "fake", [], 0, 0.0, ports=[pa]))
    assert parked.parked(cfg.runtime_dir) == {"alpha": [pa]}, "written by a daemon alive: parked"
    gone = subprocess.Popen(["true"])
    gone.wait()
    data = json.loads((cfg.runtime_dir / "parked" / "alpha.json").read_text())
    write_record(cfg.runtime_dir / "parked", "alpha", {**data, "daemon": {**data["daemon"], "pid": gone.pid}})
    assert parked.parked(cfg.runtime_dir) == {}, "its daemon is gone: nothing is parked"
    del data["daemon"]
    write_record(cfg.runtime_dir / "parked", "alpha", data)
    assert parked.parked(cfg.runtime_dir) == {}, "a record naming no daemon is nobody's"


class FakeLibcuda:
    """libcuda of driver 580 as ctypes sees it: each call records its arguments; the states follow
    the driver's rules; an error answers CUDA_ERROR_OUT_OF_MEMORY (2) by name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, Any]] = []
        self.state = 0
        self.fail = ""
        for name in [n for n in dir(type(self)) if n.startswith("cu")]:  # plain functions: ctypes sets restype on them
            bound = getattr(self, name)
            setattr(self, name, lambda *a, _m=bound: _m(*a))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    def cuDriverGetVersion(self, out: Any) -> int:  # noqa: N802
        out._obj.value = 13000
        return 0

    def cuInit(self, flags: int) -> int:  # noqa: N802
        self.calls.append(("cuInit", flags, None))
        return 0

    def cuGetErrorName(self, rc: int, out: Any) -> int:  # noqa: N802
        out._obj.value = b"CUDA_ERROR_OUT_OF_MEMORY" if rc == 2 else b"CUDA_ERROR_UNKNOWN"
        return 0

    def _op(self, name: str, pid: int, args: Any, then: int) -> int:
        self.calls.append((name, pid, args))
        if self.fail == name:
            return 2
        self.state = then
        return 0

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> int:  # noqa: N802
        return self._op("lock", pid, args._obj.timeoutMs, 1)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> int:  # noqa: N802
        return self._op("checkpoint", pid, args, 2)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:  # noqa: N802
        return self._op("restore", pid, args, 1)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> int:  # noqa: N802
        return self._op("unlock", pid, args, 0)

    def cuCheckpointProcessGetState(self, pid: int, out: Any) -> int:  # noqa: N802
        out._obj.value = self.state
        return 0


def test_driver_api_calls_in_the_drivers_order_with_null_args_and_names_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeLibcuda()
    monkeypatch.setattr(ctypes, "CDLL", lambda path: lib)
    d = DriverCheckpointer.open()
    d.lock(42, 30_000)
    d.checkpoint(42)
    assert d.state(42) == CheckpointState.CHECKPOINTED
    d.restore(42)
    d.unlock(42)
    assert [c[:2] for c in lib.calls] == [("cuInit", 0), ("lock", 42), ("checkpoint", 42), ("restore", 42), ("unlock", 42)]
    assert lib.calls[1][2] == 30_000 and lib.calls[2][2] is None, "the lock's timeout sent; the other args NULL"
    lib.fail = "restore"
    with pytest.raises(CheckpointError, match=r"cuCheckpointProcessRestore\(pid 42\) failed: CUDA_ERROR_OUT_OF_MEMORY"):
        d.restore(42)
    lib.state = 7
    with pytest.raises(CheckpointError, match="answered 7, a state this supervisor does not know"):
        d.state(42)


def test_a_daemon_on_simulated_gpus_parks_them_with_the_simulated_checkpointer_outside_a_rehearsal(tmp_path: Any) -> None:
    """`gpus.backend = "simulated"` without rehearsal (the device scripts' stand-in runs, which keep the
    profile's own router): the inventory reads the simulated GPUs, so the park must move their memory,
    not call a CUDA driver that holds none of it."""
    from supervisord_gpu import daemon as D
    from supervisord_gpu.checks.gpus import inventory_for

    cfg, _, _, _ = two_profiles(tmp_path)
    backends = D.backends_for(cfg)
    assert not backends.rehearsal
    parker, why = D.parker_for(cfg, backends, inventory_for(cfg, simulated=False), lambda *a: None)
    assert why == "" and parker is not None and parker.checkpointer.name == "simulated"
