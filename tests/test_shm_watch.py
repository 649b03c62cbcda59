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
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from support import nobody_user
from supervisord_gpu.ownership.files import ShmTracker
from supervisord_gpu.ownership.shm_watch import (
    _EVENT,
    IN_CREATE,
    IN_IGNORED,
    IN_Q_OVERFLOW,
    MIN_GAP_S,
    ShmCreations,
    parse_events,
)

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
    return nobody_user("the clean-up runs as root and the server user as `nobody`")


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
        assert watch.watch(proc, tracker.uid, lambda: tracker.scan([proc.pid])), watch.unavailable
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


def _flood(made: list[str], as_nobody: bool, n: int) -> tuple[ShmCreations, list[float], ShmTracker, float]:
    """n files created in /dev/shm as fast as possible, by the server's user or by root (a
    stranger to it), while one process of the server's user is registered."""
    tracker = ShmTracker(pwd.getpwnam("nobody").pw_uid)
    idle = _as_nobody(CRASHER, _loads_name(), "30")  # registered, holds nothing (waits on stdin)
    base = f"/dev/shm/flood-{uuid.uuid4().hex[:8]}"
    watch = ShmCreations()
    scans: list[float] = []

    def scan() -> None:
        scans.append(time.monotonic())
        tracker.scan([idle.pid])

    try:
        assert watch.watch("idle", tracker.uid, scan), watch.unavailable
        began = time.monotonic()
        if as_nobody:
            assert _as_nobody(FLOOD, base, str(n)).wait(60) == 0
        else:
            assert subprocess.run([PYTHON, "-c", FLOOD, base, str(n)], timeout=60).returncode == 0
        time.sleep(0.3)
        took = time.monotonic() - began
    finally:
        watch.unwatch("idle")
        idle.kill()
        idle.wait()
        made.extend(f"{base}-{i}" for i in range(n))
    return watch, scans, tracker, took


def test_a_strangers_flood_of_creations_scans_nothing(nobody, made):
    """Another user's files (root's here) in /dev/shm: read and looked up, never a scan of ours."""
    watch, scans, tracker, _ = _flood(made, as_nobody=False, n=3000)
    assert watch.events >= 1, "the flood was not seen"
    assert scans == []
    assert tracker.remove_leftovers() == []


def test_the_server_users_own_flood_buys_bounded_scans_and_no_removal(nobody, made):
    """The servers' user (its model code) floods: each registered process is scanned at most once
    per MIN_GAP_S (more when its scans are slow), and nothing the flood made is ours to remove."""
    watch, scans, tracker, took = _flood(made, as_nobody=True, n=3000)
    assert watch.events >= 1 and scans, "the flood was not seen"
    assert len(scans) <= took / MIN_GAP_S + 3, (len(scans), took)
    assert tracker.remove_leftovers() == []
    assert all(os.path.exists(f) for f in made[-3000::1500])


def test_events_are_names_without_a_slash_and_an_overflow_says_scan_everyone():
    def event(mask: int, name: bytes, pad: int = 4) -> bytes:
        raw = name + b"\0" * pad
        return _EVENT.pack(1, mask, 0, len(raw)) + raw

    data = event(IN_CREATE, b"sglang_loads_x.shm") + event(IN_CREATE, b"a/b") + event(IN_CREATE, b"..") \
        + event(IN_Q_OVERFLOW, b"", 0) + event(IN_CREATE, b"cut")[:-3]
    assert parse_events(data) == ([b"sglang_loads_x.shm"], 1, False)
    assert parse_events(event(IN_IGNORED, b"", 0))[2] is True


def test_a_watch_that_ends_says_why_and_the_next_registration_opens_a_new_one(nobody):
    watch = ShmCreations()
    assert watch.watch("a", 0, lambda: None)
    fd = watch._fd
    assert fd is not None
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, fd)  # what a watch gone bad looks like to its thread: it reads end-of-file
    os.close(null)
    deadline = time.monotonic() + 5
    while not watch.unavailable and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.unavailable.startswith("the watch ended: "), watch.unavailable
    assert watch.watch("b", 0, lambda: None) and watch._fd is not None and watch.unavailable == ""
    assert watch.take_ended().startswith("the watch ended: "), "a reopened watch still says the end, once"
    assert watch.take_ended() == ""


def test_without_a_directory_to_watch_it_says_why_and_watches_nothing(tmp_path):
    watch = ShmCreations(str(tmp_path / "no-such-dir"))
    assert watch.watch("x", 0, lambda: None) is False
    assert "x" in watch._scans, "registered anyway: a watch opened later covers it"
    said = watch.news(False)
    assert len(said) == 1 and said[0].startswith("no /dev/shm watch (") and "no-such-dir" in said[0]
    assert watch.news(False) == [], "once per daemon"
    assert "no-such-dir" in watch.unavailable and "No such file" in watch.unavailable
