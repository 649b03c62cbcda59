"""The cgroupfs driver: a cgroup v2 directory per process under a root the daemon is given.

Used where systemd is not our parent (the device machine, rehearsal in a terminal, tests).
`cgroup.kill` (Linux 5.14+) kills everything in a cgroup in one write, and `cgroup.events`
says `populated 0` the moment the last member is gone, so neither kill nor wait needs a
process walk or a sleep.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncio
import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from ..errors import OwnershipError
from .base import OwnershipDriver, ProcessGroup
from .inotify import Inotify
from ..names import CGROUPFS_ROOT_NAME, Owner, owner_of_cgroup, unit_of_cgroup


def cgroup2_mount() -> Path | None:
    """Where cgroup v2 is mounted: /sys/fs/cgroup on unified hosts, .../unified on hybrid ones."""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == "cgroup2":
                    return Path(fields[1])
    except OSError:
        return None
    return None


def default_root() -> Path | None:
    mount = cgroup2_mount()
    return None if mount is None else mount / CGROUPFS_ROOT_NAME


_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH
_DIR_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
#: the files a delegation (systemd's Delegate=, a `chown` of a cgroup) hands to its user
_DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")


def _root_only_dir(fd: int) -> bool:
    """A cgroup directory only root could have created, or moved processes into, or below."""
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & _WRITE_BITS:
        return False
    for name in _DELEGATED_FILES:
        try:
            f = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # cgroup.threads is absent on old kernels
        if f.st_uid != 0 or f.st_mode & _WRITE_BITS:
            return False
    return True


def root_only(cgroup: str, mount: Path | None = None) -> bool:
    """Whether only root could have put a process in `cgroup` (a path as /proc/PID/cgroup shows it).

    A name proves nothing: inside a subtree delegated to a user (a cgroup chowned to them,
    or systemd's Delegate=) they can create `supervisord-gpu/pd-1p1d/router` and join it.
    So every cgroup from the mount's root down to this one must be root's, writable only by
    root, and not delegated (its cgroup.procs root's): then a user could neither have made it
    nor moved a process into it. Checked by descriptor, one component at a time, never through
    a symlink. False when it cannot be verified (gone, another hierarchy, no cgroup2 mount).
    """
    mount = mount or cgroup2_mount()
    parts = [p for p in cgroup.split("/") if p]
    if mount is None or any(p in (".", "..") for p in parts):
        return False
    fds: list[int] = []
    try:
        fds.append(os.open(mount, _DIR_FLAGS))
        if not _root_only_dir(fds[-1]):
            return False
        for part in parts:
            fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
            if not _root_only_dir(fds[-1]):
                return False
        return True
    except OSError:
        return False
    finally:
        for fd in fds:
            os.close(fd)


def verified_owner(cgroup: str | None, mount: Path | None = None) -> Owner | None:
    """The instance a cgroup belongs to (names.py), confirmed on disk for cgroupfs paths.

    A systemd path is ours by its place in the system manager's tree (names.py: slices only
    above it); a cgroupfs path has no unit above it to tell, so only `root_only` decides.
    """
    owner = owner_of_cgroup(cgroup) if cgroup else None
    if owner is None or cgroup is None:
        return None
    if unit_of_cgroup(cgroup) is None and not root_only(cgroup, mount):
        return None
    return owner


def writable(root: Path) -> bool:
    """Whether we can create cgroups under `root` (creating it if needed)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.mkdir()
        ok = (probe / "cgroup.procs").exists()
        probe.rmdir()
        return ok
    except OSError:
        return False


def cgroup_gone(e: OSError) -> bool:
    """A cgroup removed under us (systemd removes an empty scope's at once): ENOENT when the
    path is gone, ENODEV when it goes between open() and read() — both mean "empty"."""
    return e.errno in (errno.ENOENT, errno.ENODEV)


class CgroupDir(ProcessGroup):
    """One cgroup v2 directory."""

    def __init__(self, path: Path, mount: Path) -> None:
        self.path = path
        self.name = str(path)
        self.cgroup = "/" + str(path.relative_to(mount))

    def pids(self) -> list[int]:
        pids: set[int] = set()
        for dirpath, _dirs, files in os.walk(self.path):
            if "cgroup.procs" in files:
                try:
                    with open(os.path.join(dirpath, "cgroup.procs")) as f:
                        pids.update(int(x) for x in f.read().split())
                except OSError as e:
                    if not cgroup_gone(e):
                        raise
        return sorted(pids)

    def populated(self) -> bool:
        try:
            with open(self.path / "cgroup.events") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "populated":
                        return value.strip() == "1"
        except OSError as e:
            if cgroup_gone(e):
                return False
            raise
        return bool(self.pids())

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        if sig == signal.SIGKILL and (self.path / "cgroup.kill").exists():
            try:
                (self.path / "cgroup.kill").write_text("1")
                return
            except OSError as e:
                if cgroup_gone(e):
                    return
                raise
        for pid in self.pids():  # older kernels, or another signal: every member by PID
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def wait_empty(self, timeout: float | None) -> bool:
        if not self.populated():
            return True
        loop = asyncio.get_running_loop()
        ino = Inotify()
        changed = asyncio.Event()
        try:
            try:
                ino.watch(str(self.path / "cgroup.events"))
            except OSError as e:
                if cgroup_gone(e):
                    return True
                raise
            def on_event() -> None:
                ino.drain()
                changed.set()

            loop.add_reader(ino.fd, on_event)
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.populated():
                changed.clear()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    return not self.populated()
            return True
        finally:
            loop.remove_reader(ino.fd)
            ino.close()

    async def release(self) -> None:
        remove_tree(self.path)


def remove_tree(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (cgroupfs allows only rmdir)."""
    if not path.exists():
        return
    for dirpath, dirs, _files in os.walk(path, topdown=False):
        for d in dirs:
            _rmdir(Path(dirpath) / d)
    _rmdir(path)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise


_GUARD = (
    "import os,select,sys\n"
    "fd=os.pidfd_open(int(sys.argv[1]))\n"
    "select.select([fd],[],[])\n"
    "try:\n"
    " f=open(sys.argv[2],'w'); f.write('1'); f.close()\n"
    "except OSError: pass\n"
)


class CgroupfsDriver(OwnershipDriver):
    """Sub-cgroups `<root>/<instance>/<process>` that we create, own and remove."""

    name = "cgroupfs"
    _guard: subprocess.Popen[bytes] | None = None

    def __init__(self, root: Path, mount: Path | None = None) -> None:
        self.mount = mount or cgroup2_mount()
        if self.mount is None:
            raise OwnershipError("no cgroup v2 hierarchy is mounted (looked in /proc/self/mounts)")
        self.root = Path(root)
        if not writable(self.root):
            raise OwnershipError(f"cannot create cgroups under {self.root} (need root and a writable cgroup v2)")
        self._refuse_delegated_root()

    def _refuse_delegated_root(self) -> None:
        """As root, a cgroup root inside a user's delegated subtree is refused: whatever we would
        find there (leftovers to kill, groups to reuse) that user could have planted."""
        if os.geteuid() != 0:
            return
        try:
            rel = "/" + str(self.root.resolve().relative_to(self.mount.resolve()))  # type: ignore[union-attr]
        except ValueError:
            raise OwnershipError(f"cgroup root {self.root} is not under the cgroup2 mount {self.mount}") from None
        if not root_only(rel, self.mount):
            raise OwnershipError(f"cgroup root {self.root}, or a cgroup above it, is not root's alone (owned by, "
                                 "writable by or delegated to another user): refusing to create, kill or adopt "
                                 "processes there")

    def _instance_dir(self, instance: str) -> Path:
        return self.root / instance

    async def reclaim_leftovers(self, instance: str, policy: str, processes: Sequence[str] = ()) -> list[str]:
        inst_dir = self._instance_dir(instance)
        if not inst_dir.exists():
            return []
        cleaned: list[str] = []
        for child in sorted(p for p in inst_dir.iterdir() if p.is_dir()):
            group = CgroupDir(child, self.mount)  # type: ignore[arg-type]
            pids = group.pids()
            if pids and policy == "refuse":
                raise OwnershipError(
                    f"leftover cgroup {child} of a previous run still holds pids {pids}; "
                    f"stop them (echo 1 > {child}/cgroup.kill) or set leftovers = \"clean\""
                )
            if pids:
                group.kill_all()
                if not await group.wait_empty(10.0):
                    raise OwnershipError(f"leftover cgroup {child} did not empty after cgroup.kill")
                cleaned.append(f"{child} (killed pids {pids})")
            await group.release()
        remove_tree(inst_dir)
        return cleaned

    def guard(self, instance: str) -> None:
        """A guardian outside the instance's cgroup: when this daemon dies, however it dies
        (SIGKILL included), it writes `cgroup.kill` on the instance's cgroup, which kills
        every process below it. Without systemd nothing else would notice; with a normal
        stop the cgroup is empty by then and the write does nothing."""
        if self._guard is not None and self._guard.poll() is None:
            return
        inst_dir = self._instance_dir(instance)
        inst_dir.mkdir(parents=True, exist_ok=True)
        self._guard = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), str(inst_dir / "cgroup.kill")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the daemon's terminal must not take the guard first
        )

    async def _create_group(self, instance: str, process: str) -> ProcessGroup:
        path = self._instance_dir(instance) / process
        if path.exists():
            group = CgroupDir(path, self.mount)  # type: ignore[arg-type]
            if group.populated():
                raise OwnershipError(f"cgroup {path} is still populated (pids {group.pids()})")
            remove_tree(path)
        path.mkdir(parents=True)
        return CgroupDir(path, self.mount)  # type: ignore[arg-type]

    async def _adopt(self, group: ProcessGroup, pid: int) -> ProcessGroup:
        assert isinstance(group, CgroupDir)
        (group.path / "cgroup.procs").write_text(str(pid))
        return group
