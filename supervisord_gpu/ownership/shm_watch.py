"""A scan of our cgroups' /dev/shm files the moment their user creates a file there.

`ShmTracker` records a segment only when a scan sees a PID of our cgroup map or hold it, and the
daemon scans at its phase changes. On the real SGLang 0.5.23 (an H100, 2026-12-07) a server whose
model SGLang could not load crashed one second after its scheduler created its load-snapshot
segment (`/dev/shm/sglang_loads_<instance>_<digest>.shm`, made early in `Scheduler.__init__`),
between two scans: the segment was never recorded, and leaked. Such leaks add up until schedulers
die of SIGBUS.

An inotify watch on /dev/shm (no privilege beyond reading the directory; fanotify, which names
the creator, needs CAP_SYS_ADMIN, which the unit does not grant) wakes one thread on each file
created or moved in. The event proves nothing: it is a trigger. Its name is looked up once
(`lstat` relative to a descriptor of /dev/shm) only to learn the file's owner, and only the
processes registered under that uid are scanned; ownership stays what `ShmTracker` proves (held
or mapped by a PID of our cgroup, the same inode). A file gone by the look-up cannot leak. So a
local user flooding /dev/shm with files of their own costs a read and an `lstat` per event and no
scan; a flood by the servers' own user (its model code) costs at most one scan per registered
process per max(MIN_GAP_S, GAP_FACTOR x that process's last scan), capped at MAX_GAP_S, counted
from the scan's end. A queue overflow (a flood fast enough) scans every registered process once,
at most once per OVERFLOW_GAP_S.

Without inotify (no /dev/shm, the instance limit reached) or once the thread ends on an error,
`watch` answers False with `unavailable` saying why, and the caller says so once; the phase
scans remain, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
IN_IGNORED = 0x8000  # the watch was removed (the directory unmounted or gone): the end of it
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name, NUL-padded)
#: the shortest gap between two scans of one registered process, from the end of the first
MIN_GAP_S = 0.05
#: and at least this many times that process's last scan (a scan may take 50-150 ms on a big
#: server), but never more than MAX_GAP_S: the leak this exists for came 1 s after the creation
GAP_FACTOR = 10.0
MAX_GAP_S = 0.25
#: an overflowed queue (a flood) scans every registration, at most once per this
OVERFLOW_GAP_S = 2.0
#: the longest the thread sleeps without looking again (a descriptor gone bad is seen within this)
POLL_S = 1.0

Scan = Callable[[], None]


class ShmCreations:
    """One inotify watch on /dev/shm for the daemon; a creation by uid U scans U's registrations."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self._scans: dict[object, tuple[int, Scan]] = {}
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dirfd: int | None = None
        self._thread: threading.Thread | None = None
        self.unavailable = ""  # why there is no watch (empty while there is one or none was tried)
        self.said = False  # the caller said `unavailable` once (one line per daemon, not per process)
        self.ended = ""  # why a watch that ran ended, until `take_ended`
        self.events = 0  # events read (tests and status)
        self.scans = 0  # scans run

    def watch(self, key: object, uid: int, scan: Scan) -> bool:
        """Run `scan` when a file owned by `uid` appears in /dev/shm, until `unwatch(key)`; False
        where no watch can be had (`unavailable` says why). The registration stays either way, so
        a watch opened later (by the next registration) covers it too."""
        with self._lock:
            self._scans[key] = (uid, scan)
            return self._fd is not None or self._open()

    def take_ended(self) -> str:
        """Why the last watch ended, once (a reopened watch does not erase it): "" if none did."""
        with self._lock:
            ended, self.ended = self.ended, ""
            return ended

    def news(self, watched: bool) -> list[str]:
        """What a registration that got `watched` from `watch` has to say (at priority 4): that a
        watch had ended, and, once per daemon until a watch runs again, that there is none."""
        lines = []
        if ended := self.take_ended():
            lines.append(f"the /dev/shm watch had ended ({ended}); {'reopened' if watched else 'none now'}")
        with self._lock:
            if not watched and not self.said:
                self.said = True
                lines.append(f"no /dev/shm watch ({self.unavailable}): a segment made and leaked between two "
                             "phase scans can stay behind")
        return lines

    def unwatch(self, key: object) -> None:
        with self._lock:
            self._scans.pop(key, None)

    def _open(self) -> bool:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fd = libc.inotify_init1(IN_CLOEXEC | IN_NONBLOCK)
        if fd < 0:
            self.unavailable = f"inotify_init1: {os.strerror(ctypes.get_errno())}"
            return False
        try:
            dirfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            os.close(fd)
            self.unavailable = f"open {self.directory}: {e.strerror}"
            return False
        if libc.inotify_add_watch(fd, os.fsencode(self.directory), IN_CREATE | IN_MOVED_TO) < 0:
            self.unavailable = f"inotify_add_watch {self.directory}: {os.strerror(ctypes.get_errno())}"
            os.close(fd)
            os.close(dirfd)
            return False
        self._fd, self._dirfd, self.unavailable = fd, dirfd, ""
        self._thread = threading.Thread(target=self._run, args=(fd, dirfd), name="shm-creations", daemon=True)
        self._thread.start()
        return True

    def _run(self, fd: int, dirfd: int) -> None:
        try:
            self._loop(fd, dirfd)
        except BaseException as e:  # noqa: BLE001  (whatever ends the thread is said, never raised)
            with self._lock:
                self.unavailable = self.ended = f"the watch ended: {type(e).__name__}: {e}"
                self._fd = self._dirfd = None
                self.said = False
            for d in (fd, dirfd):
                try:
                    os.close(d)
                except OSError:
                    pass

    def _loop(self, fd: int, dirfd: int) -> None:
        poller = select.poll()  # not select(): a descriptor above 1023 must not end the watch
        poller.register(fd, select.POLLIN)
        next_at: dict[object, float] = {}  # a registration's earliest next scan
        pending: set[object] = set()  # owed a scan that came too soon after its last
        overflow_at = 0.0  # the earliest next scan-everyone an overflow may cause
        while True:
            now = time.monotonic()
            due = [next_at.get(k, 0.0) - now for k in pending]
            ready = poller.poll(min(max(0.0, min(due)) if due else POLL_S, POLL_S) * 1000)
            if ready:
                if ready[0][1] & (select.POLLNVAL | select.POLLERR):
                    raise OSError(f"its descriptor reads {ready[0][1]:#x} (not valid)")
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except InterruptedError:
                    continue
                if not data:  # an inotify descriptor never reads end-of-file
                    raise OSError("its descriptor read end-of-file")
                names, overflow, ignored = parse_events(data)
                if ignored:
                    raise OSError(f"{self.directory} is no longer watched (IN_IGNORED: unmounted or gone)")
                self.events += len(names) + overflow
                with self._lock:
                    scans = dict(self._scans)
                if overflow:  # a flood: everyone once, but no more often than OVERFLOW_GAP_S
                    at = max(time.monotonic(), overflow_at)
                    overflow_at = at + OVERFLOW_GAP_S
                    for k in scans:
                        pending.add(k)
                        next_at[k] = max(next_at.get(k, 0.0), at)
                else:
                    uids = {uid for uid in (_owner(dirfd, n) for n in names) if uid is not None}
                    pending |= {k for k, (uid, _) in scans.items() if uid in uids}
            with self._lock:
                scans = dict(self._scans)
            pending &= set(scans)
            for key in list(pending):
                if time.monotonic() < next_at.get(key, 0.0):
                    continue  # owed: the poll's timeout brings it back when due
                pending.discard(key)
                began = time.monotonic()
                try:
                    scans[key][1]()
                except Exception:  # noqa: BLE001  (a scan's failure, a PID gone, ends no watch)
                    pass
                self.scans += 1
                ended = time.monotonic()
                next_at[key] = ended + min(MAX_GAP_S, max(MIN_GAP_S, GAP_FACTOR * (ended - began)))
            for key in [k for k in next_at if k not in scans]:
                del next_at[key]


def parse_events(data: bytes) -> tuple[list[bytes], int, bool]:
    """The names in one read of inotify events, 1 if the queue overflowed (else 0), and whether
    the watch was removed (IN_IGNORED). A truncated tail is dropped; a name is the bytes up to its
    first NUL, never containing '/'."""
    names: list[bytes] = []
    overflow, off, ignored = 0, 0, False
    while off + _EVENT.size <= len(data):
        _wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
        if off + _EVENT.size + length > len(data):
            break  # a truncated event: dropped
        raw = data[off + _EVENT.size: off + _EVENT.size + length]
        off += _EVENT.size + length
        if mask & IN_Q_OVERFLOW:
            overflow = 1
            continue
        if mask & IN_IGNORED:
            ignored = True
            continue
        name = raw.split(b"\0", 1)[0]
        if name and b"/" not in name and name not in (b".", b".."):
            names.append(name)
    return names, overflow, ignored


def _owner(dirfd: int, name: bytes) -> int | None:
    """The uid of /dev/shm/NAME now (the entry itself, never followed), None if it is gone."""
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid
    except OSError:  # gone already (cannot leak), or unreadable: no trigger
        return None


#: the daemon's one watch (inotify instances are a per-user limit: one, however many processes)
SHM_CREATIONS = ShmCreations()
