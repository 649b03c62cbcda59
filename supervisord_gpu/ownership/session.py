"""The weak fallback: a new session per process, plus a sweep of its descendants.

Only for machines with no writable cgroup v2 at all. A process that calls setsid and is
re-parented to PID 1 — exactly what SGLang's schedulers do — escapes this driver, which is
why choosing it logs a loud warning every time.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncio
import os
import signal
import time

import psutil

from .base import OwnershipDriver, ProcessGroup

WARNING = (
    "WARNING: no writable cgroup v2: falling back to sessions and descendant sweeps; "
    "processes that call setsid and re-parent to PID 1 (SGLang's schedulers) CAN ESCAPE and keep GPU memory"
)


class SessionGroup(ProcessGroup):
    def __init__(self, name: str) -> None:
        self.name = name
        self.cgroup = ""
        self.sid: int | None = None
        self.known: set[int] = set()

    def pids(self) -> list[int]:
        found: set[int] = set()
        for pid in list(self.known):
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                found.add(pid)
                found.update(c.pid for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                self.known.discard(pid)
        if self.sid is not None:
            for proc in psutil.process_iter(["pid"]):
                try:
                    if os.getsid(proc.pid) == self.sid and proc.status() != psutil.STATUS_ZOMBIE:
                        found.add(proc.pid)
                except (ProcessLookupError, PermissionError, psutil.Error):
                    continue
        self.known |= found
        return sorted(found)

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def wait_empty(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pids():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)  # no event source without cgroups: the weakness we warn about
        return True

    async def release(self) -> None:
        self.known.clear()


class SessionDriver(OwnershipDriver):
    name = "session"
    weak = True

    async def reclaim_leftovers(self, instance: str, policy: str, processes: Sequence[str] = ()) -> list[str]:
        return []  # nothing to find: without cgroups a leftover cannot be recognised as ours

    async def _create_group(self, instance: str, process: str) -> ProcessGroup:
        return SessionGroup(f"session of {instance}/{process}")

    async def _adopt(self, group: ProcessGroup, pid: int) -> ProcessGroup:
        assert isinstance(group, SessionGroup)
        group.sid = pid
        group.known.add(pid)
        return group
