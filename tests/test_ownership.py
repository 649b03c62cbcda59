"""Ownership by cgroup: what the cgroupfs driver catches, and what a crash leaves for the next start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from supervisord_gpu.errors import OwnershipError
from supervisord_gpu.ownership.base import SpawnRequest
from supervisord_gpu.ownership.cgroupfs import CgroupfsDriver
from support import alive, free_ports, pd_profile, sim_holders, with_env, write_config

# A child that double-forks into a new session (re-parented to PID 1) and reports the grandchild's pid.
ESCAPER = """
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode()); time.sleep(600)
    os._exit(0)
print(os.read(r, 32).decode(), flush=True)
time.sleep(600)
"""


def spawn_escaper(driver: CgroupfsDriver, instance: str = "inst"):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        sp = await driver.spawn(SpawnRequest(instance, "proc", [sys.executable, "-c", ESCAPER], dict(os.environ)))
        grandchild = int((await sp.proc.stdout.readline()).decode())
        return sp, grandchild

    return go


def test_a_double_forked_setsid_grandchild_is_in_the_group_and_dies_with_it(cgroups):
    driver = CgroupfsDriver(cgroups.root)

    async def go() -> int:
        sp, grandchild = await spawn_escaper(driver)()
        assert os.getsid(grandchild) != os.getsid(sp.pid)  # its own session: a process-group kill would miss it
        assert grandchild in sp.group.pids()
        sp.group.kill_all()
        assert await sp.group.wait_empty(5)
        await sp.proc.wait()
        await sp.group.release()
        return grandchild

    assert not alive(asyncio.run(go()))


CRASHER = """
import asyncio, os, sys
from pathlib import Path
from supervisord_gpu.ownership.cgroupfs import CgroupfsDriver
from supervisord_gpu.ownership.base import SpawnRequest
async def main():
    sp = await CgroupfsDriver(Path(sys.argv[1])).spawn(SpawnRequest("inst", "proc", [sys.executable, "-c", sys.argv[2]], dict(os.environ)))
    print((await sp.proc.stdout.readline()).decode().strip(), flush=True)
    os.kill(os.getpid(), 9)  # the daemon dies without a word
asyncio.run(main())
"""


def crashed_daemon_leaves_a_grandchild(root) -> int:  # type: ignore[no-untyped-def]
    out = subprocess.run([sys.executable, "-c", CRASHER, str(root), ESCAPER], capture_output=True, text=True, timeout=30)
    assert out.returncode == -9
    return int(out.stdout.split()[0])


def test_leftovers_of_a_crashed_run_are_cleaned_at_the_next_start(cgroups):
    grandchild = crashed_daemon_leaves_a_grandchild(cgroups.root)
    assert alive(grandchild)
    cleaned = asyncio.run(CgroupfsDriver(cgroups.root).reclaim_leftovers("inst", "clean"))
    assert len(cleaned) == 1 and "killed pids" in cleaned[0]
    assert not alive(grandchild)
    assert not (cgroups.root / "inst").exists()


def test_leftovers_are_refused_with_a_clear_message_when_configured(cgroups):
    grandchild = crashed_daemon_leaves_a_grandchild(cgroups.root)
    with pytest.raises(OwnershipError, match=r"leftover cgroup .*/inst/proc of a previous run still holds pids"):
        asyncio.run(CgroupfsDriver(cgroups.root).reclaim_leftovers("inst", "refuse"))
    assert alive(grandchild)  # refusing touches nothing


def test_kill_9_of_the_daemon_leaves_no_child_running(tmp_path, cgroups, decoy):
    detached = {"SUPERVISORD_GPU_STANDIN_SCHEDULERS": "detached"}  # escaped to PID 1: only the cgroup reaches them
    text = with_env(with_env(pd_profile(free_ports(5)), "prefill", **detached), "decode", **detached)
    cdir = write_config(tmp_path, {"pd": text}, cgroups.root, startup=0.3)
    argv = [sys.executable, "-m", "supervisord_gpu.cli.daemon", "run", "pd", "--config-dir", str(cdir), "--rehearsal", "--stderr"]
    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in first.stdout:  # type: ignore[union-attr]
        if "instance ready" in line:
            break
    orphans = sim_holders(tmp_path)
    assert orphans
    first.kill()
    first.wait()
    deadline = time.monotonic() + 5  # the daemon's guard kills its cgroup when it sees the daemon die
    while any(alive(p) for p in orphans) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(alive(p) for p in orphans)
    while [p for p in cgroups.all_pids() if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.01)  # cgroup.kill is one write; the members' exits follow within milliseconds
    assert [p for p in cgroups.all_pids() if alive(p)] == []
    assert decoy.poll() is None


def test_a_cgroup_removed_between_open_and_read_counts_as_empty(cgroups):
    """systemd removes an empty scope's cgroup at once; reading a file we opened just before
    then fails with ENODEV (found by the systemd fault matrix: the daemon died of it mid-stop)."""
    from supervisord_gpu.ownership.cgroupfs import CgroupDir, cgroup_gone

    path = cgroups.root / "vanishing"
    path.mkdir(parents=True)
    group = CgroupDir(path, cgroups.top.parent)
    with open(path / "cgroup.events") as f:
        path.rmdir()
        with pytest.raises(OSError) as info:
            f.read()
    assert cgroup_gone(info.value)  # the kernel's answer is one we treat as "gone"
    assert group.populated() is False and group.pids() == []
    group.kill_all()  # nothing to kill, no error
    assert asyncio.run(group.wait_empty(1.0)) is True
