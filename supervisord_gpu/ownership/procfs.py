"""What a process has open, read from /proc: the one walk the checks and the clean-up share.

Naming a port's holder, telling our listener from a stranger's and finding the shared-memory
files a killed server left all come down to the same question: which files and sockets does
this PID hold. A PID that is gone or hidden (another PID namespace, a permission we lack)
simply holds nothing here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator


def fd_targets(pid: int | str) -> Iterator[str]:
    """The targets of /proc/PID/fd/* ("socket:[4711]", "/dev/shm/nccl-abc", ...)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue


def open_files(pid: int | str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, int, int]]:
    """(target, mnt_id, ino) of each fd of PID whose target `wanted` accepts.

    Read from /proc/PID/fdinfo (Linux 5.14+ has "ino:"), never by a stat of the fd: a stat
    asks the file's file system, and a FUSE file the process made itself could hang us there.
    An fd without an "ino:" line (older kernels) is left out.
    """
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if not wanted(target):
            continue
        info = read_text(int(pid), f"fdinfo/{fd}") or ""
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        try:
            yield target, int(fields["mnt_id"]), int(fields["ino"])
        except (KeyError, ValueError):
            continue


def all_pids() -> Iterator[int]:
    """Every PID this process can see in /proc."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def read_text(pid: int, name: str, limit: int = -1) -> str | None:
    """/proc/PID/<name> (at most `limit` bytes of it, when given), or None when the process is
    gone ("" when we may not read it)."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read(limit).decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ""


def real_uid(pid: int) -> int | None:
    """The real uid from /proc/PID/status (readable for any PID this process can see)."""
    status = read_text(pid, "status")
    for line in (status or "").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def is_zombie(pid: int) -> bool:
    stat = read_text(pid, "stat") or ""
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "Z" if ")" in stat else False


def _ticks(stat: str | None) -> int | None:
    """utime + stime in clock ticks (fields 14 and 15) of a `stat` text, None when there is none.
    The comm field may hold spaces and parentheses: fields are counted after its last ')'."""
    if not stat:
        return None
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of PID in clock ticks (/proc/PID/stat), None when gone."""
    return _ticks(read_text(pid, "stat"))


def main_thread_ticks(pid: int) -> int | None:
    """utime + stime in ticks of the process's main thread alone (/proc/PID/task/PID/stat), None
    when gone or unreadable: where SGLang's scheduler runs its loop, apart from helper threads."""
    return _ticks(read_text(pid, f"task/{pid}/stat"))


def main_thread_reads(pid: int) -> int | None:
    """Read calls the process's main thread has made (syscr of /proc/PID/task/PID/io), None when
    gone or unreadable (the file needs ptrace access: the daemon's root with CAP_SYS_PTRACE).
    Where SGLang's scheduler loop runs: one that waits on a slow download reads now and then
    while it spends next to no CPU; a blocked or stopped one reads nothing.

    The kernel counts read(2) and its vector forms, on any file: a file, a pipe, an eventfd (a
    ZMQ receive that wakes), a socket read that way (TLS through OpenSSL, libuv's TCP, so
    uvloop's front end); it does not count recv(2)/recvfrom(2) (Python's socket.recv), measured
    here on Linux 6.1. Writes are left out on purpose: a loop stuck retrying would still log."""
    return _reads(read_text(pid, f"task/{pid}/io"))


def _reads(io: str | None) -> int | None:
    """syscr of an `io` text, None when there is none or it lacks it."""
    for line in (io or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "syscr":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def run_state(pid: int) -> tuple[str, str, int | None] | None:
    """(comm, state letter, utime + stime in ticks) from /proc/PID/stat, None when gone.
    One read for the three, so they describe the same moment (engine/hang.py)."""
    text = read_text(pid, "stat")
    if not text or ")" not in text:
        return None
    comm = text[text.find("(") + 1 : text.rfind(")")]
    fields = text.rpartition(")")[2].split()
    try:
        return comm, fields[0], int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return comm, fields[0] if fields else "", None
