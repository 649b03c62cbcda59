"""One transition at a time on this machine, and who holds it.

An flock on `<runtime>/transition.lock`: a second start that would take GPUs or ports over
waits for the first (up to LOCK_WAIT_S), then is refused naming it. The holder writes its
name into the file, so that whoever waits, or whoever the holder is stopping, can say who
won. The file lives in the root-owned runtime directory and is never opened through a link.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path

from ..config.trust import open_nofollow, secure_directory
from ..errors import PreconditionError

LOCK_WAIT_S = 30.0


class TransitionLock:
    """One transition at a time on this machine: an flock in the runtime directory."""

    def __init__(self, runtime: Path, owner: str) -> None:
        self.runtime = runtime
        self.path = runtime / "transition.lock"
        self.owner = owner
        self.fd: int | None = None

    async def acquire(self, wait_s: float = LOCK_WAIT_S) -> None:
        # In a root-owned 0755 directory, never through a planted symlink (config/trust.py).
        secure_directory(self.runtime)
        try:
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PreconditionError(f"refusing to start: cannot open the transition lock {self.path} ({e.strerror}): "
                                    "it must be a regular file of root's, not a link") from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another instance"
                    os.close(fd)
                    raise PreconditionError(
                        f"refusing to start: a transition by {holder} is in progress (waited {wait_s:g} s)") from None
                await asyncio.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.owner} (pid {os.getpid()})".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def holder(self) -> str:
        """Who holds the lock now ("tp4-512k (pid 4711)"), "" when nobody does (or it cannot be read)."""
        try:
            fd = open_nofollow(self.path, os.O_RDONLY)
        except OSError:
            return ""
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held exclusively: the holder wrote its name
                return os.pread(fd, 256, 0).decode(errors="replace").strip()
            fcntl.flock(fd, fcntl.LOCK_UN)
            return ""
        finally:
            os.close(fd)
