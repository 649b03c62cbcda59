"""GPU inventory: simulated GPUs held by real processes, and the NVML rules against a stand-in pynvml."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from supervisord_gpu.checks.gpus import (
    DEFAULT_TOLERANCE_MIB,
    MIB,
    NvmlInventory,
    NvmlUnavailable,
    SimulatedInventory,
    open_inventory,
)
from supervisord_gpu.checks.simgpu import H200_RESERVED_MIB, H200_TOTAL_MIB, SimulatedGpus
from supervisord_gpu.errors import EXIT_PRECONDITIONS, UsageError

REPO = Path(__file__).resolve().parent.parent

HOG = """\
import sys, time
from supervisord_gpu.checks.simgpu import SimulatedGpus
SimulatedGpus(sys.argv[1]).hold([int(g) for g in sys.argv[2].split(",")], int(sys.argv[3]))
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def sim(tmp_path: Path) -> SimulatedGpus:
    return SimulatedGpus.create(tmp_path / "simgpu", 8)


@pytest.fixture
def hog(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Start gpu_hog.py holding simulated GPUs; killed at the end of the test."""
    (tmp_path / "gpu_hog.py").write_text(HOG)

    def start(gpus: list[int], mib: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "gpu_hog.py", "simgpu", ",".join(map(str, gpus)), str(mib)],
            cwd=tmp_path, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        request.addfinalizer(lambda: (proc.kill(), proc.wait()))
        assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
        return proc

    return start


def test_fresh_simulated_gpus_are_idle_with_the_h200_reservation_apart(sim: SimulatedGpus) -> None:
    inv = SimulatedInventory(sim)
    states = inv.snapshot()
    assert inv.kind == "simulated" and inv.count() == 8
    assert [s.index for s in states] == list(range(8))
    assert all(s.idle and s.used_mib == 0 and s.processes == () for s in states)
    assert states[0].total_mib == H200_TOTAL_MIB and states[0].reserved_mib == H200_RESERVED_MIB


def test_a_process_holding_a_gpu_makes_it_busy_and_is_listed_with_its_memory(sim: SimulatedGpus, hog) -> None:  # type: ignore[no-untyped-def]
    proc = hog([2, 3], 50000)
    states = {s.index: s for s in SimulatedInventory(sim).snapshot()}
    assert not states[2].idle and not states[3].idle
    assert states[2].used_mib == 50000
    assert [(p.pid, p.used_mib) for p in states[2].processes] == [(proc.pid, 50000)]
    assert all(states[i].idle for i in (0, 1, 4, 5, 6, 7))


def test_two_holders_on_one_gpu_add_up(sim: SimulatedGpus, hog) -> None:  # type: ignore[no-untyped-def]
    a, b = hog([1], 1000), hog([1], 2000)
    (state,) = SimulatedInventory(sim).snapshot([1])
    assert state.used_mib == 3000
    assert sorted(p.pid for p in state.processes) == sorted([a.pid, b.pid])


def test_a_gpu_is_idle_again_once_its_holder_is_dead(sim: SimulatedGpus, hog) -> None:  # type: ignore[no-untyped-def]
    proc = hog([5], 80000)
    inv = SimulatedInventory(sim)
    assert not inv.snapshot([5])[0].idle
    proc.kill()
    proc.wait()
    assert inv.snapshot([5])[0].idle


def test_a_killed_but_unreaped_holder_no_longer_holds(sim: SimulatedGpus, hog) -> None:  # type: ignore[no-untyped-def]
    proc = hog([5], 80000)
    inv = SimulatedInventory(sim)
    proc.kill()  # a zombie from here on: nobody reaps it until the finalizer
    deadline = time.monotonic() + 2
    while not inv.snapshot([5])[0].idle and time.monotonic() < deadline:
        time.sleep(0.001)
    assert inv.snapshot([5])[0].idle
    assert proc.returncode is None  # never reaped, yet its memory counts as gone


def test_snapshot_of_some_indices_leaves_out_those_that_do_not_exist(sim: SimulatedGpus) -> None:
    inv = SimulatedInventory(sim)
    assert [s.index for s in inv.snapshot([7, 1, 9, -1])] == [1, 7]
    assert inv.snapshot([]) == []


def test_auto_backend_with_a_simulated_directory_is_simulated(sim: SimulatedGpus) -> None:
    inv = open_inventory("auto", simgpu_dir=str(sim.directory), tolerance_mib=100)
    assert isinstance(inv, SimulatedInventory) and inv.tolerance_mib == 100


def test_simulated_backend_without_gpus_created_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no simulated GPUs"):
        open_inventory("simulated", simgpu_dir=str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match="unknown gpus backend"):
        open_inventory("cuda")


def test_importing_the_checks_does_not_import_pynvml() -> None:
    code = ("import sys, supervisord_gpu.checks.preconditions, supervisord_gpu.checks.gpus;"
            "assert 'pynvml' not in sys.modules, 'pynvml imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ----------------------------------------------------------------------------- NVML rules, stand-in pynvml


class FakeNvml(types.ModuleType):
    """Just enough of pynvml: per GPU a v1 `used`, a reservation, a process list; v2 on or off."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass

    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: int, v2: bool, reserved_mib: int = 615) -> None:
        super().__init__("pynvml")
        self.v2, self.reserved = v2, reserved_mib
        self.used = {i: reserved_mib for i in range(gpus)}  # v1 used, reservation included
        self.procs: dict[int, list[int]] = {i: [] for i in range(gpus)}
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.used)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> types.SimpleNamespace:
        total = 143771 * MIB
        if version:
            if not self.v2:
                raise self.NVMLError_FunctionNotFound("Function Not Found")
            used = (self.used[h] - self.reserved) * MIB
            return types.SimpleNamespace(total=total, reserved=self.reserved * MIB, used=used, free=total - used)
        return types.SimpleNamespace(total=total, used=self.used[h] * MIB, free=total - self.used[h] * MIB)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[types.SimpleNamespace]:
        return [types.SimpleNamespace(pid=p, usedGpuMemory=1000 * MIB) for p in self.procs[h]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[types.SimpleNamespace]:
        raise self.NVMLError_NotSupported("Not Supported")


def fake(monkeypatch: pytest.MonkeyPatch, **kw) -> FakeNvml:  # type: ignore[no-untyped-def]
    nvml = FakeNvml(**kw)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_with_memory_info_v2_the_driver_reservation_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=2, v2=True)
    inv = NvmlInventory()
    (s,) = inv.snapshot([0])
    assert (s.used_mib, s.reserved_mib, s.baseline_mib, s.idle) == (0, 615, 0, True)
    nvml.used[0] += 40000
    nvml.procs[0] = [4711]
    (s,) = inv.snapshot([0])
    assert not s.idle and s.used_mib == 40000 and [p.pid for p in s.processes] == [4711]
    assert s.processes[0].used_mib == 1000


def test_with_v1_only_the_baseline_is_learned_from_the_gpu_seen_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=1, v2=False)
    inv = NvmlInventory()
    assert not inv.memory_v2_supported(0)
    (s,) = inv.snapshot()
    assert (s.used_mib, s.baseline_mib, s.idle) == (615, 615, True)
    nvml.used[0] = 615 + DEFAULT_TOLERANCE_MIB  # within tolerance: driver noise
    assert inv.snapshot()[0].idle
    nvml.used[0] = 615 + 2000  # memory held by something NVML does not list
    (s,) = inv.snapshot()
    assert not s.idle and s.in_use_mib == 2000 and s.baseline_mib == 615


def test_with_v1_a_gpu_first_seen_busy_is_not_idle_until_seen_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=1, v2=False)
    nvml.used[0], nvml.procs[0] = 50000, [99]
    inv = NvmlInventory()
    assert inv.snapshot()[0].baseline_mib == 0 and not inv.snapshot()[0].idle
    nvml.used[0], nvml.procs[0] = 615, []
    assert inv.snapshot()[0].idle and inv.snapshot()[0].baseline_mib == 615


def test_with_v1_a_large_unlisted_usage_is_never_learned_as_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=1, v2=False)
    nvml.used[0] = 60000  # held by a process we cannot see listed
    inv = NvmlInventory()
    (s,) = inv.snapshot()
    assert not s.idle and s.baseline_mib == 0


def test_a_configured_baseline_wins_over_learning(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=2, v2=False)
    nvml.used[1] = 900
    inv = NvmlInventory(tolerance_mib=100, baseline_mib={1: 500})
    states = inv.snapshot()
    assert states[0].baseline_mib == 615 and states[0].idle
    assert states[1].baseline_mib == 500 and not states[1].idle  # 400 MiB above 500, tolerance 100


def test_close_shuts_nvml_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=1, v2=True)
    inv = NvmlInventory()
    inv.close()
    inv.close()
    assert nvml.shutdowns == 1


def test_without_the_nvml_library_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake(monkeypatch, gpus=1, v2=True)

    def missing() -> None:
        raise nvml.NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml, "nvmlInit", missing)
    with pytest.raises(NvmlUnavailable) as e:
        open_inventory("auto")
    assert e.value.exit_code == EXIT_PRECONDITIONS
    assert "python3-pynvml" in str(e.value) and "libnvidia-ml1" in str(e.value) and "simulated" in str(e.value)


def test_without_the_nvml_bindings_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match="python3-pynvml"):
        NvmlInventory()
