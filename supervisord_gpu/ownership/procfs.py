"""What a process has open, read from /proc: the one walk the checks and the clean-up share.

Naming a port's holder, telling our listener from a stranger's and finding the shared-memory
files a killed server left all come down to the same question: which files and sockets does
this PID hold. A PID that is gone or hidden (another PID namespace, a permission we lack)
simply holds nothing here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator


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


def all_pids() -> Iterator[int]:
    """Every PID this process can see in /proc."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)
