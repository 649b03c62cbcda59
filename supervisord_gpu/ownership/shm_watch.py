"""A scan of our cgroups' /dev/shm files the moment any file is created there.

`ShmTracker` records a segment only when a scan sees a PID of our cgroup map or hold it, and the
daemon scans at its phase changes. On the real SGLang 0.5.23 (an H100, 2026-12-07) a server whose
model SGLang could not load crashed one second after its scheduler created its load-snapshot
segment (`/dev/shm/sglang_loads_<instance>_<digest>.shm`, made early in `Scheduler.__init__`),
between two scans: the segment was never recorded, and leaked. Such leaks add up until schedulers
die of SIGBUS.

An inotify watch on /dev/shm (no privilege beyond reading the directory; fanotify, which names
the creator, needs CAP_SYS_ADMIN, which the unit does not grant) wakes one thread on each file
created or moved in. The event names no creator, so it proves nothing: it only triggers the
registered scans, and ownership stays what `ShmTracker` proves (held or mapped by a PID of our
cgroup, the same inode). Anyone can create files in /dev/shm, so an event costs at most one scan
per registered process per `MIN_GAP_S`: a local user flooding the directory buys a few /proc reads
a second, never a removal.

Without inotify (no /dev/shm, the instance limit reached) `watch` says so and the phase scans
remain, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
import time
from collections.abc import Callable

SHM_DIR = "/dev/shm"
IN_CLOEXEC = 0o2000000
IN_NONBLOCK = 0o4000
IN_CREATE = 0x100
IN_MOVED_TO = 0x80
IN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
#: at most one scan per registered process in this window, whatever the event rate
MIN_GAP_S = 0.05

Scan = Callable[[], None]


class ShmCreations:
    """One inotify watch on /dev/shm for the daemon; each creation runs every registered scan."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self._scans: dict[object, Scan] = {}
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._thread: threading.Thread | None = None
        self.unavailable = ""  # why there is no watch (empty while there is one or none was tried)
        self.events = 0  # creations seen (tests and status)

    def watch(self, key: object, scan: Scan) -> bool:
        """Run `scan` on each creation in /dev/shm until `unwatch(key)`; False where no watch can be had."""
        with self._lock:
            if self._fd is None and not self._open():
                return False
            self._scans[key] = scan
            return True

    def unwatch(self, key: object) -> None:
        with self._lock:
            self._scans.pop(key, None)

    def _open(self) -> bool:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fd = libc.inotify_init1(IN_CLOEXEC | IN_NONBLOCK)
        if fd < 0:
            self.unavailable = f"inotify_init1: {os.strerror(ctypes.get_errno())}"
            return False
        if libc.inotify_add_watch(fd, os.fsencode(self.directory), IN_CREATE | IN_MOVED_TO) < 0:
            self.unavailable = f"inotify_add_watch {self.directory}: {os.strerror(ctypes.get_errno())}"
            os.close(fd)
            return False
        self._fd = fd
        self._thread = threading.Thread(target=self._run, name="shm-creations", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        fd = self._fd
        assert fd is not None
        last: dict[object, float] = {}
        pending: set[object] = set()  # registered processes owed a scan (one came too soon after the last)
        while True:
            now = time.monotonic()
            due = [last.get(k, 0.0) + MIN_GAP_S - now for k in pending]
            try:
                ready, _, _ = select.select([fd], [], [], max(0.0, min(due)) if due else None)
                if ready:
                    data = os.read(fd, 65536)
                    self.events += _count(data)
                    time.sleep(0.005)  # a burst (NCCL makes several) drains into one round of scans
                    with self._lock:
                        pending |= set(self._scans)
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                self.unavailable = f"reading the watch: {e}"
                return
            with self._lock:
                scans = dict(self._scans)
            pending &= set(scans)
            now = time.monotonic()
            for key in list(pending):
                if now - last.get(key, 0.0) < MIN_GAP_S:
                    continue  # owed: the select's timeout brings it back when due
                last[key] = now
                pending.discard(key)
                try:
                    scans[key]()
                except Exception:  # a scan's failure (a PID gone, /proc unreadable) ends no watch
                    pass
            for key in [k for k in last if k not in scans]:
                del last[key]


def _count(data: bytes) -> int:
    """The number of events in one read (an overflow counts as one: every scan runs anyway)."""
    n, off = 0, 0
    while off + _EVENT.size <= len(data):
        _, _mask, _, length = _EVENT.unpack_from(data, off)
        off += _EVENT.size + length
        n += 1
    return n


#: the daemon's one watch (inotify instances are a per-user limit: one, however many processes)
SHM_CREATIONS = ShmCreations()
