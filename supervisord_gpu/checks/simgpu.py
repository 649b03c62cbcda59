"""Simulated GPUs for rehearsal and tests.

The rule we imitate is the driver's: device memory belongs to a live process and comes
back the moment that process dies. A stand-in "allocates" by writing a holding file that
names its PID and start time; a holding counts only while that exact process is alive and
not a zombie. So a foreign holder is simulated simply by running a stand-in outside the
daemon, and a detached grandchild keeps its memory until it, not its parent, is dead.

Layout of the directory:
    devices.json               {"gpus": [{"index", "uuid", "name", "total_mib", "reserved_mib"}]}
    holders/                   the creator's, 1777: anyone adds a directory, nobody removes another's
    holders/<uid>/             one user's holdings: owned by that user, 0755, created by its first hold()
    holders/<uid>/<pid>.json   {"pid", "create_time", "gpus": [...], "mib": N}

Who may claim what: the stand-ins run as the profiles' users (sglang, nobody), so each must
write its own holdings, and no user may forge or remove another's. A holding counts only
in a directory that is not writable by group or others, in a file owned by that directory's
owner, for a process whose real uid is that owner (root's directory may name any process).
So a user can claim memory only for processes of their own, which is what a real process of
theirs could do on a real GPU, and can delete only their own. Directories are recognised by
their owner, not their name: one squatting `holders/<your uid>` only makes hold() pick a
fresh directory of yours beside it. No root helper is needed, which is why this, rather
than files written by the daemon on a child's behalf: the stand-ins outside any daemon (a
foreign holder played by hand) work the same way.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from ..records import dataclass
from pathlib import Path

from ..ownership.procfs import real_uid

ENV_DIR = "SUPERVISORD_GPU_SIMGPU_DIR"
H200_TOTAL_MIB = 143771
H200_RESERVED_MIB = 615
_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH


class UntrustedSimGpus(OSError):
    """The simulated GPUs' directory is not its creator's alone: holdings there prove nothing."""


@dataclass(frozen=True)
class SimDevice:
    index: int
    uuid: str
    name: str
    total_mib: int
    reserved_mib: int


@dataclass(frozen=True)
class SimHolding:
    pid: int
    gpus: tuple[int, ...]
    mib: int


class SimulatedGpus:
    """A directory that stands for the GPUs of a machine; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        count: int,
        total_mib: int = H200_TOTAL_MIB,
        reserved_mib: int = H200_RESERVED_MIB,
        name: str = "Simulated NVIDIA H200",
    ) -> SimulatedGpus:
        sim = cls(directory)
        sim._make_directories()
        gpus = [
            {
                "index": i,
                "uuid": f"GPU-5157a000-0000-4000-8000-{i:012x}",
                "name": name,
                "total_mib": total_mib,
                "reserved_mib": reserved_mib,
            }
            for i in range(count)
        ]
        _atomic_write(sim.directory / "devices.json", json.dumps({"gpus": gpus}, indent=1))
        return sim

    def _make_directories(self) -> None:
        """The directory ours and 0755, holders/ ours and 1777 (see the module docstring).

        An existing one of another user's is refused, not repaired: they could have planted
        anything there, and could remove everyone's holdings from it."""
        holders = self.directory / "holders"
        holders.mkdir(parents=True, exist_ok=True)
        for path, mode in ((self.directory, 0o755), (holders, 0o1777)):
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
                raise UntrustedSimGpus(f"refusing simulated GPUs in {path}: it is owned by uid {st.st_uid} "
                                       f"(or a symlink), not by uid {os.geteuid()} who creates them")
            os.chmod(path, mode)

    def _own_holders_dir(self) -> Path:
        """A directory of holdings owned by this user alone: `holders/<uid>`, or a fresh one
        beside it when someone else squats that name (directories count by owner, not name)."""
        holders = self.directory / "holders"
        uid = os.geteuid()
        mine = holders / str(uid)
        try:
            os.mkdir(mine, 0o755)
            os.chmod(mine, 0o755)  # the umask (the unit's is 0027) would keep other readers out
        except FileExistsError:
            pass
        candidates = [mine, *sorted(holders.glob(f"{uid}.*"))]
        for d in candidates:
            if _holdings_dir_owner(os.lstat(d)) == uid:
                return d
        fresh = Path(tempfile.mkdtemp(prefix=f"{uid}.", dir=holders))
        os.chmod(fresh, 0o755)
        return fresh

    def exists(self) -> bool:
        return (self.directory / "devices.json").is_file()

    def devices(self) -> list[SimDevice]:
        data = json.loads((self.directory / "devices.json").read_text())
        return [SimDevice(**g) for g in data["gpus"]]

    def hold(self, gpus: list[int] | tuple[int, ...], mib: int, pid: int | None = None) -> Path:
        """Record that process `pid` (default: this one) holds `mib` MiB on each of `gpus`."""
        pid = os.getpid() if pid is None else pid
        import psutil  # only to hold (tests, stand-ins): a reader never pays for the import

        create_time = psutil.Process(pid).create_time()
        path = self._own_holders_dir() / f"{pid}.json"
        record = {"pid": pid, "create_time": create_time, "gpus": list(gpus), "mib": int(mib)}
        _atomic_write(path, json.dumps(record))
        return path

    def holders(self) -> list[SimHolding]:
        """Holdings of processes that are alive right now; dead ones hold nothing.

        Only holdings a user made for their own processes count (see the module docstring)."""
        found: list[SimHolding] = []
        try:
            dirs = list(os.scandir(self.directory / "holders"))
        except FileNotFoundError:
            return found
        boot = _boot_time()
        for d in dirs:
            try:
                owner = _holdings_dir_owner(d.stat(follow_symlinks=False))
            except OSError:
                continue
            if owner is not None:
                found += _holdings_in(d.path, owner, boot)
        return found


def _holdings_dir_owner(st: os.stat_result) -> int | None:
    """The uid a directory of holdings speaks for: a real directory only its owner can write."""
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & _WRITE_BITS:
        return None
    return st.st_uid


def _holdings_in(directory: str, owner: int, boot: float | None) -> list[SimHolding]:
    """The live holdings in one user's directory; the dead ones removed (where we may).

    Everything below goes through one descriptor of the directory, opened without following a
    link and checked to be the directory `owner` was read from: its owner may rename it away and
    put a symlink in its place at any moment (holders/ is 1777), and a removal by path would then
    remove the victim's file of that name, as root where root reads (a rehearsal's daemon,
    `sudo gpusupctl status`)."""
    found: list[SimHolding] = []
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return found
    try:
        if _holdings_dir_owner(os.fstat(dfd)) != owner:
            return found  # not the directory its owner was read from
        entries = list(os.scandir(dfd))
        for entry in entries:
            if entry.name.startswith("."):
                _drop_if_dead_parked(entry.name, dfd, owner, boot)
                continue  # a holding being written (_atomic_write's temporary), not a holding yet; or parked
            parsed = _parse_holding(entry.name, owner, dir_fd=dfd)
            if parsed is None or entry.name != f"{parsed[0].pid}.json":
                continue  # not a holding: a FIFO, a directory, garbage, someone else's file
            holding, create_time = parsed
            if _alive(holding.pid, create_time, boot):
                if _speaks_for(owner, holding.pid):
                    found.append(holding)
            else:
                try:
                    os.unlink(entry.name, dir_fd=dfd)
                except OSError:
                    pass
    except OSError:
        pass
    finally:
        os.close(dfd)
    return found


def _drop_if_dead_parked(name: str, dfd: int, owner: int, boot: float | None) -> None:
    """A parked holding (parking/simulated.py: the simulated host copy) of a process that is gone
    is removed, where we may, as a dead holding is: the driver frees a dead process's host copy.
    A parked daemon SIGKILLed under systemd takes its processes with it and forgets nothing.
    `name` in the directory open as `dfd` (_holdings_in: never by a path its owner can re-aim)."""
    if not name.startswith(".parked."):
        return
    parsed = _parse_holding(name, owner, dir_fd=dfd)
    if parsed is None or name != f".parked.{parsed[0].pid}.json" or _alive(parsed[0].pid, parsed[1], boot):
        return
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def _speaks_for(owner: int, pid: int) -> bool:
    """A user vouches for their own processes only; root for any."""
    return owner == 0 or real_uid(pid) == owner


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _boot_time() -> float | None:
    """btime from /proc/stat, read once per holders() call (psutil reads it once per process)."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _alive(pid: int, create_time: float, boot: float | None = None) -> bool:
    """That exact process is alive and not a zombie.

    Reads /proc/PID/stat directly (~12 µs) instead of through psutil (~45 µs): the GPU idle
    poll calls this for every holding every few milliseconds. The start time is computed the
    way psutil computes the create_time stored by hold(): starttime / CLK_TCK + btime.
    """
    if boot is not None:
        try:
            data = _read_small(f"/proc/{pid}/stat")
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:
            pass  # fall back to psutil
        else:
            try:
                fields = data[data.rindex(b")") + 2 :].split()
                state, start_ticks = fields[0], int(fields[19])
            except (ValueError, IndexError):
                pass  # not the Linux layout: fall back to psutil
            else:
                if state in (b"Z", b"X", b"x"):
                    return False
                return abs(start_ticks / _CLOCK_TICKS + boot - create_time) < 0.01
    try:
        import psutil  # the rare fallback: not the Linux /proc layout

        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _parse_holding(path: str, owner: int | None = None, dir_fd: int | None = None) -> tuple[SimHolding, float] | None:
    """A holding file read defensively: a regular file (never a FIFO that would block the
    read, never through a symlink), owned by `owner` if given, small, with the fields and
    types hold() writes. `path` relative to `dir_fd` where given."""
    try:
        record = json.loads(_read_small(path, regular_only=True, owner=owner, dir_fd=dir_fd))
        pid, create_time, gpus, mib = record["pid"], record["create_time"], record["gpus"], record["mib"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (type(pid) is int and pid > 0 and isinstance(create_time, (int, float)) and isinstance(gpus, list)
            and all(type(g) is int and g >= 0 for g in gpus) and type(mib) is int and mib >= 0):
        return None
    return SimHolding(pid, tuple(gpus), mib), float(create_time)


def _read_small(path: str, regular_only: bool = False, owner: int | None = None, dir_fd: int | None = None) -> bytes:
    """One read(2) of a small file: half the cost of open()/json.load on this hot path."""
    flags = os.O_RDONLY | (os.O_NONBLOCK | os.O_NOFOLLOW if regular_only else 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        if regular_only or owner is not None:
            st = os.fstat(fd)
            if regular_only and not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")
            if owner is not None and st.st_uid != owner:
                raise OSError(f"{path} is owned by uid {st.st_uid}, not by its directory's owner {owner}")
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)  # readable by every gpusupctl, whatever the writer's umask (the unit's is 0027)
    os.replace(tmp, path)
