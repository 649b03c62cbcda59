"""The /dev/shm watch: a segment made and leaked between two phase scans is still recorded.

Seen on the real SGLang 0.5.23 (an H100, 2026-12-07): a server whose model SGLang could not
load crashed one second after its scheduler made /dev/shm/sglang_loads_<id>_<digest>.shm, with
no scan between, and the segment leaked (bench/results/real-pd-h100-*.json, p6). Here a
process as `nobody` (the server's user) makes and maps such a segment and dies without
unlinking it, with no scan of ours between: with the watch it is recorded and removed, without
it it stays. Anyone may create files in /dev/shm: a flood buys a bounded number of scans, and
the watch never makes anything removable that the tracker's own proof would not.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisord_gpu.ownership.files import ShmTracker
from supervisord_gpu.ownership.shm_watch import MIN_GAP_S, ShmCreations

PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)

#: waits for a line, makes and maps its segment, lives a little, dies without unlinking (a crash)
CRASHER = r"""
import mmap, os, sys, time
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
time.sleep(float(sys.argv[2]))
os._exit(1)
"""

#: creates N files in /dev/shm as fast as it can, then exits
FLOOD = r"""
import os, sys
for i in range(int(sys.argv[2])):
    fd = os.open(f"{sys.argv[1]}-{i}", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
"""


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root: the clean-up runs as root and the server user as `nobody`")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("needs the user `nobody`")


@pytest.fixture
def made() -> Iterator[list[str]]:
    paths: list[str] = []
    yield paths
    for p in paths:
        if os.path.lexists(p):
            os.unlink(p)


def _as_nobody(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", PYTHON, "-c", script,
                             *args], stdin=subprocess.PIPE, text=True)


def _loads_name() -> str:
    return f"/dev/shm/sglang_loads_{uuid.uuid4().hex[:12]}_0badf00d.shm"


def _crash_between_scans(tracker: ShmTracker, watch: ShmCreations | None, path: str) -> list[str]:
    """The crasher's life with no phase scan of ours; only the watch (if any) can scan it."""
    proc = _as_nobody(CRASHER, path, "0.3")
    if watch is not None:
        assert watch.watch(proc, lambda: tracker.scan([proc.pid])), watch.unavailable
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.wait(10) == 1
    if watch is not None:
        watch.unwatch(proc)
    return tracker.remove_leftovers()


def test_a_segment_made_and_leaked_between_scans_is_recorded_and_removed(nobody, made):
    path = _loads_name()
    made.append(path)
    removed = _crash_between_scans(ShmTracker(nobody.pw_uid), ShmCreations(), path)
    assert removed == [path]
    assert not os.path.lexists(path)


def test_without_the_watch_the_same_leak_stays(nobody, made):
    """The control: what the phase scans alone did on the real server."""
    path = _loads_name()
    made.append(path)
    removed = _crash_between_scans(ShmTracker(nobody.pw_uid), None, path)
    assert removed == []
    assert os.path.exists(path)


def test_a_flood_of_creations_buys_bounded_scans_and_no_removal(nobody, made):
    """A local user creates thousands of files in /dev/shm: each registered process is scanned at
    most once per MIN_GAP_S, and nothing the flood made is ours to remove."""
    tracker = ShmTracker(nobody.pw_uid)
    idle = _as_nobody(CRASHER, _loads_name(), "30")  # registered, holds nothing yet (waits on stdin)
    made.append(f"/dev/shm/flood-{uuid.uuid4().hex[:8]}")
    base = made[-1]
    watch = ShmCreations()
    scans: list[float] = []

    def scan() -> None:
        scans.append(time.monotonic())
        tracker.scan([idle.pid])

    try:
        assert watch.watch("idle", scan), watch.unavailable
        began = time.monotonic()
        flood = _as_nobody(FLOOD, base, "3000")
        assert flood.wait(60) == 0
        time.sleep(0.3)
        took = time.monotonic() - began
    finally:
        watch.unwatch("idle")
        idle.kill()
        idle.wait()
        made.extend(f"{base}-{i}" for i in range(3000))
    assert watch.events >= 1 and scans, "the flood was not seen"
    assert len(scans) <= took / MIN_GAP_S + 3, (len(scans), took)
    assert tracker.remove_leftovers() == []
    assert all(os.path.exists(f"{base}-{i}") for i in (0, 1500, 2999))


def test_without_a_directory_to_watch_it_says_why_and_watches_nothing(tmp_path):
    watch = ShmCreations(str(tmp_path / "no-such-dir"))
    assert watch.watch("x", lambda: None) is False
    assert "no-such-dir" in watch.unavailable and "No such file" in watch.unavailable
