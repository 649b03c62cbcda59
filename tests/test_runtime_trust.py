"""What the root daemon believes on disk: only what root alone could have written.

A hostile local user who can write into the runtime directory (or plant a link there before the
daemon creates it) must not be able to make root signal a process, or write a file, of their
choosing. These run as root, with the hostile parts done as user nobody.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisord_gpu.controller import registry
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.config.trust import UntrustedPath, secure_directory
from supervisord_gpu.errors import PreconditionError
from supervisord_gpu.controller.lock import TransitionLock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon's trust rules are for a daemon running as root")
NOBODY = pwd.getpwnam("nobody")


def as_nobody(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def forge(runtime: Path, instance: str, pid: int, **fields: object) -> None:
    proc = psutil.Process(pid)
    record = {"instance": instance, "pid": pid, "create_time": proc.create_time(), "profile": "/x", "gpus": [0],
              "ports": [30001], "driver": "cgroupfs", "uid": 0, "cgroup": "/", **fields}
    (runtime / "instances" / f"{instance}.json").write_text(json.dumps(record))


def test_a_forged_record_naming_a_live_process_is_not_believed(tmp_path):
    runtime = secure_directory(tmp_path / "run")
    secure_directory(runtime / "instances")
    victim = as_nobody("sleep", "60")  # a process of someone else's: its PID and start time anyone can read
    try:
        time.sleep(0.1)
        forge(runtime, "pd", victim.pid)  # claims root and the wrong cgroup
        forge(runtime, "tp4", victim.pid, uid=NOBODY.pw_uid, cgroup="/somewhere/else")
        assert registry.running(runtime) == []
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_records_in_a_directory_others_can_write_are_ignored(tmp_path):
    runtime = secure_directory(tmp_path / "run")
    instances = secure_directory(runtime / "instances")
    forge(runtime, "me", os.getpid(), cgroup=registry.read_cgroup(os.getpid()) or "")
    assert [r.instance for r in registry.running(runtime)] == ["me"]  # believed while root's alone
    os.chmod(instances, 0o777)
    assert registry.running(runtime) == []
    os.chmod(instances, 0o755)
    os.chown(runtime / "instances" / "me.json", NOBODY.pw_uid, NOBODY.pw_gid)  # a record written by someone else
    assert registry.running(runtime) == []


def test_a_symlink_planted_where_a_record_or_the_lock_will_be_is_never_followed(tmp_path):
    runtime = secure_directory(tmp_path / "run")
    target = tmp_path / "precious"
    target.write_text("root's file")
    os.symlink(target, runtime / "transition.lock")
    with pytest.raises(PreconditionError, match="transition lock .* not a link"):
        import asyncio

        asyncio.run(TransitionLock(runtime, "x").acquire(wait_s=0.1))
    secure_directory(runtime / "instances")

    class P:  # what register() reads of a profile
        name, path, gpus = "pd", Path("/x"), frozenset({0})

        @staticmethod
        def listens():  # type: ignore[no-untyped-def]
            return ()

    os.symlink(target, runtime / "instances" / "pd.json")
    registry.register(runtime, P, "cgroupfs")  # type: ignore[arg-type]
    assert target.read_text() == "root's file"  # the link was replaced, not written through
    assert not (runtime / "instances" / "pd.json").is_symlink()


def test_a_runtime_directory_that_is_a_link_or_someone_elses_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "run")
    with pytest.raises(UntrustedPath, match="not a directory"):
        secure_directory(tmp_path / "run")
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(UntrustedPath, match=f"owned by uid {NOBODY.pw_uid}"):
        secure_directory(tmp_path / "theirs")


def test_a_fifo_or_garbage_among_simulated_gpu_holders_neither_hangs_nor_crashes_the_checks(tmp_path):
    sim = SimulatedGpus.create(tmp_path / "sim", 2)
    holders = tmp_path / "sim" / "holders"
    os.mkfifo(holders / "666.json")
    (holders / "667.json").write_text('{"pid": "x", "create_time": [], "gpus": "all", "mib": -1}')
    (holders / "668.json").write_bytes(b"\xff" * 100)
    sim.hold([1], 500)
    began = time.monotonic()
    found = sim.holders()
    assert time.monotonic() - began < 1.0
    assert [(h.pid, h.gpus, h.mib) for h in found] == [(os.getpid(), (1,), 500)]
