"""Preconditions before a start: GPUs idle and ports free, every holder named; waiting until clear."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisord_gpu.checks.gpus import SimulatedInventory
from supervisord_gpu.checks.holders import describe_pid
from supervisord_gpu.checks.preconditions import (
    PreconditionReport,
    Requirement,
    check,
    render_gpu_table,
    wait_until_clear,
)
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.errors import EXIT_PRECONDITIONS, PreconditionError

from support import free_ports

REPO = Path(__file__).resolve().parent.parent

# Holds simulated GPUs (when given any) and optionally listens on a port; prints its port.
HOG = """\
import socket, sys, time
from supervisord_gpu.checks.simgpu import SimulatedGpus
gpus, mib, port = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = None
if port >= 0:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
if gpus:
    SimulatedGpus(sys.argv[1]).hold([int(g) for g in gpus.split(",")], mib)
print(s.getsockname()[1] if s else 0, flush=True)
time.sleep(600)
"""


@pytest.fixture
def sim(tmp_path: Path) -> SimulatedGpus:
    return SimulatedGpus.create(tmp_path / "simgpu", 8)


@pytest.fixture
def inventory(sim: SimulatedGpus) -> SimulatedInventory:
    return SimulatedInventory(sim)


@pytest.fixture
def hog(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """start(gpus, mib, port=-1) -> (process, port): a foreign holder, killed at the end."""
    (tmp_path / "sglang_hog.py").write_text(HOG)

    def start(gpus: list[int], mib: int = 50000, port: int = -1) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [sys.executable, "sglang_hog.py", "simgpu", ",".join(map(str, gpus)), str(mib), str(port)],
            cwd=tmp_path, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        request.addfinalizer(lambda: (proc.kill(), proc.wait()))
        assert proc.stdout is not None
        return proc, int(proc.stdout.readline())

    return start


def free_port() -> int:
    return free_ports(1)[0]


def req(gpus: set[int], *ports: tuple[str, int, str]) -> Requirement:
    return Requirement(frozenset(gpus), tuple(ports))


def test_idle_gpus_and_free_ports_pass(inventory: SimulatedInventory) -> None:
    port = free_port()
    report = check(req({0, 1, 2, 3}, ("0.0.0.0", port, "router")), inventory)
    assert report.ok and report.problems() == [] and report.missing_gpus == []
    assert [g.index for g in report.gpus] == [0, 1, 2, 3]
    assert report.summary() == f"GPUs 0,1,2,3 idle; ports {port} free"


def test_a_foreign_gpu_holder_fails_with_its_pid_and_command_line(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    proc, _ = hog([2], 50000)
    report = check(req({0, 1, 2, 3}), inventory)
    assert not report.ok
    (line,) = report.problems()
    assert line.startswith(f"GPU 2 not idle: 50000 MiB used; held by pid {proc.pid} (user ")
    assert "sglang_hog.py simgpu 2 50000" in line and line.endswith("(foreign)")
    assert [h.pid for h in report.gpu_holders[2]] == [proc.pid]


def test_a_port_held_by_a_foreign_listener_fails_with_its_pid(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    proc, port = hog([], port=0)
    report = check(req({0}, ("0.0.0.0", port, "router")), inventory)
    (line,) = report.problems()
    assert line.startswith(f"port 0.0.0.0:{port} (router) held by pid {proc.pid} ")
    assert line.endswith("(foreign)")
    assert report.summary() == f"not clear: port {port} held by pid {proc.pid} (foreign)"


def test_gpus_and_port_held_by_one_of_our_instances_are_attributed_to_it(inventory: SimulatedInventory, hog, cgroups) -> None:  # type: ignore[no-untyped-def]
    proc, port = hog([4, 5], 90000, port=0)
    group = cgroups.root / "pd-1p1d" / "router"
    group.mkdir(parents=True)
    (group / "cgroup.procs").write_text(str(proc.pid))
    report = check(req({4, 5}, ("0.0.0.0", port, "router")), inventory)
    problems = report.problems()
    assert len(problems) == 3
    assert all(p.endswith("(ours: instance pd-1p1d, router)") for p in problems)
    assert all(f"pid {proc.pid} " in p for p in problems)
    assert report.summary().startswith(f"not clear: GPU 4 held by pid {proc.pid} (pd-1p1d/router)")


def test_a_gpu_index_the_machine_lacks_is_reported_missing(inventory: SimulatedInventory) -> None:
    report = check(req({1, 8, 12}), inventory)
    assert report.missing_gpus == [8, 12] and not report.ok
    assert [g.index for g in report.gpus] == [1]
    assert report.problems() == [
        "GPU 8 does not exist (this machine has 8 GPUs: indices 0-7)",
        "GPU 12 does not exist (this machine has 8 GPUs: indices 0-7)",
    ]


def test_the_json_report_has_stable_keys(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    proc, port = hog([3], 1000, port=0)
    data = check(req({3}, ("0.0.0.0", port, "router")), inventory).to_json()
    assert set(data) == {"ok", "backend", "gpu_count", "missing_gpus", "gpus", "ports", "problems"}
    (gpu,) = data["gpus"]
    assert set(gpu) == {"index", "uuid", "name", "total_mib", "used_mib", "reserved_mib", "baseline_mib",
                        "in_use_mib", "idle", "processes", "holders"}
    assert gpu["holders"][0]["pid"] == proc.pid and gpu["holders"][0]["owner"] is None
    assert set(gpu["holders"][0]) == {"pid", "known", "user", "cmdline", "cgroup", "unit", "owner", "description"}
    (p,) = data["ports"]
    assert set(p) == {"host", "port", "label", "free", "error", "holders"}
    assert data["ok"] is False and data["backend"] == "simulated" and data["gpu_count"] == 8


def test_the_gpu_table_fits_80_columns_and_names_holders(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    a, _ = hog([1], 50000)
    b, _ = hog([1, 2], 20000)
    states = inventory.snapshot()
    table = render_gpu_table(states, {s.index: [describe_pid(p.pid) for p in s.processes] for s in states})
    lines = table.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[0] == "8 × Simulated NVIDIA H200"
    assert any(line.split()[:4] == ["1", "70000/143771", "in", "use"] for line in lines)
    assert sum(f"pid {a.pid} foreign" in line for line in lines) == 1
    assert sum(f"pid {b.pid} foreign" in line for line in lines) == 2
    assert any(line.split()[:3] == ["0", "0/143771", "idle"] for line in lines)


# ----------------------------------------------------------------------------- waiting until clear


def test_wait_until_clear_returns_as_soon_as_the_last_holder_dies(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    first, _ = hog([0], 50000)
    last, port = hog([1], 50000, port=0)

    async def scenario() -> tuple[PreconditionReport, float]:
        waiting = asyncio.create_task(wait_until_clear(req({0, 1}, ("0.0.0.0", port, "router")), inventory, 10))
        await asyncio.sleep(0.2)
        first.kill()
        await asyncio.sleep(0.2)
        assert not waiting.done()
        last.kill()
        killed = time.monotonic()
        report = await waiting
        return report, time.monotonic() - killed

    report, after_kill = asyncio.run(scenario())
    assert report.ok
    assert after_kill < 0.5


def test_wait_until_clear_fails_at_its_deadline_naming_every_holder(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    gpu_holder, _ = hog([6], 50000)
    port_holder, port = hog([], port=0)
    began = time.monotonic()
    with pytest.raises(PreconditionError) as e:
        asyncio.run(wait_until_clear(req({6, 7}, ("0.0.0.0", port, "router")), inventory, 0.3))
    took = time.monotonic() - began
    assert e.value.exit_code == EXIT_PRECONDITIONS
    message = str(e.value)
    assert message.startswith("still not clear after 0.3 s: GPU 6 not idle")
    assert f"pid {gpu_holder.pid} " in message and f"port 0.0.0.0:{port} (router) held by pid {port_holder.pid} " in message
    assert 0.3 <= took < 2


def test_wait_until_clear_refuses_a_missing_gpu_at_once(inventory: SimulatedInventory) -> None:
    began = time.monotonic()
    with pytest.raises(PreconditionError, match="GPU 9 does not exist"):
        asyncio.run(wait_until_clear(req({0, 9}), inventory, 30))
    assert time.monotonic() - began < 1


def test_wait_until_clear_reports_progress_with_holders_named(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    proc, _ = hog([3], 50000)
    seen: list[PreconditionReport] = []
    with pytest.raises(PreconditionError):
        asyncio.run(wait_until_clear(req({3}), inventory, 0.35, on_progress=seen.append, progress_every_s=0.1))
    assert 2 <= len(seen) <= 4
    assert all(r.attributed and [h.pid for h in r.gpu_holders[3]] == [proc.pid] for r in seen)


def test_wait_until_clear_keeps_the_event_loop_responsive(inventory: SimulatedInventory, hog) -> None:  # type: ignore[no-untyped-def]
    for g in range(8):
        hog([g], 10000)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.002)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def scenario() -> None:
        tick = asyncio.create_task(ticker())
        with pytest.raises(PreconditionError):
            await wait_until_clear(req(set(range(8))), inventory, 0.5, progress_every_s=0.1, on_progress=lambda r: None)
        tick.cancel()

    asyncio.run(scenario())
    assert max(gaps) < 0.05
