"""Files a process leaves behind when it is killed, attributed as exactly as its processes are.

SGLang cleans up its shared-memory segments (`/dev/shm/...`, NCCL's and CUDA's too) and its
`ipc://` socket files only on a graceful exit. A SIGKILL (our cgroup kill at the deadline, its
own crash path, PDEATHSIG) leaks them, and accumulated leaks make later schedulers die of
SIGBUS. Two mechanisms, neither a guess by name:

* a private TMPDIR per process (`PrivateDir`): SGLang names its ipc endpoints with
  `tempfile`, so they land in a directory only that process uses; it is emptied once the
  process's cgroup is empty;
* `ShmTracker`: while the process runs, the segments its cgroup's members have mapped or open
  (/proc/PID/maps and /proc/PID/fd) are recorded by path and inode; once the cgroup is empty,
  each recorded file that is still the same inode and that no live process holds is removed.
  Another server's segments were never mapped by our cgroup and are never looked at.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from ..records import dataclass, field
from pathlib import Path
from collections.abc import Iterable

from .procfs import all_pids, fd_targets

SHM_DIR = "/dev/shm/"


@dataclass
class PrivateDir:
    """A directory owned by the child's user, mode 0700, under a root-owned parent."""

    path: Path
    uid: int
    gid: int
    mode: int = 0o700

    def prepare(self) -> None:
        """Create it (and root-owned parents); re-own it if it exists. Refuses a symlink in its place."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.path, self.mode)
        except FileExistsError:
            pass
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"{self.path} exists and is not a directory")
        if (st.st_uid, st.st_gid) != (self.uid, self.gid) and os.geteuid() == 0:
            os.lchown(self.path, self.uid, self.gid)
        os.chmod(self.path, self.mode, follow_symlinks=False)

    def clear(self) -> list[str]:
        """Remove everything inside (never following links); returns what was removed."""
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return []
        removed = []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except FileNotFoundError:
                continue
        return removed


@dataclass
class ShmTracker:
    """Shared-memory files a process's cgroup has used: {path: (st_dev, st_ino)}."""

    seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def scan(self, pids: Iterable[int]) -> None:
        """Record the /dev/shm files these PIDs have mapped or open (cheap: a few PIDs)."""
        for path in _shm_files_of(pids):
            if path in self.seen:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                self.seen[path] = (st.st_dev, st.st_ino)

    def remove_leftovers(self) -> list[str]:
        """After the cgroup is empty: remove what is still there, the same file, and held by nobody."""
        candidates = {}
        for path, ident in self.seen.items():
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == ident:
                candidates[path] = ident
        self.seen.clear()
        if not candidates:
            return []
        held = _shm_files_held_by_anyone()
        removed = []
        for path in sorted(candidates):
            if path in held:
                continue
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                continue
        return removed


def _shm_files_of(pids: Iterable[int]) -> set[str]:
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM_DIR)
                    if i >= 0 and not line.rstrip().endswith("(deleted)"):
                        found.add(line[i:].rstrip("\n"))
        except OSError:
            pass
        found.update(link for link in fd_targets(pid) if link.startswith(SHM_DIR) and not link.endswith(" (deleted)"))
    return found


def _shm_files_held_by_anyone() -> set[str]:
    """Every /dev/shm file some live process maps or holds open (one walk over /proc)."""
    return _shm_files_of(all_pids())
