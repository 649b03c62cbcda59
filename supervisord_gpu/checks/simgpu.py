"""Simulated GPUs for rehearsal and tests.

The rule we imitate is the driver's: device memory belongs to a live process and comes
back the moment that process dies. A stand-in "allocates" by writing a holding file that
names its PID and start time; a holding counts only while that exact process is alive and
not a zombie. So a foreign holder is simulated simply by running a stand-in outside the
daemon, and a detached grandchild keeps its memory until it, not its parent, is dead.

Layout of the directory:
    devices.json          {"gpus": [{"index", "uuid", "name", "total_mib", "reserved_mib"}]}
    holders/<pid>.json    {"pid", "create_time", "gpus": [...], "mib": N}
"""

from __future__ import annotations

import json
import os
import stat
from ..records import dataclass
from pathlib import Path

ENV_DIR = "SUPERVISORD_GPU_SIMGPU_DIR"
H200_TOTAL_MIB = 143771
H200_RESERVED_MIB = 615


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
        (sim.directory / "holders").mkdir(parents=True, exist_ok=True)
        # stand-ins run as the profiles' users: like /tmp, anyone adds, nobody replaces another's
        os.chmod(sim.directory, 0o755)
        os.chmod(sim.directory / "holders", 0o1777)
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
        path = self.directory / "holders" / f"{pid}.json"
        record = {"pid": pid, "create_time": create_time, "gpus": list(gpus), "mib": int(mib)}
        _atomic_write(path, json.dumps(record))
        return path

    def holders(self) -> list[SimHolding]:
        """Holdings of processes that are alive right now; dead ones hold nothing."""
        found: list[SimHolding] = []
        holders_dir = self.directory / "holders"
        try:
            entries = list(os.scandir(holders_dir))
        except FileNotFoundError:
            return found
        boot = _boot_time()
        for entry in entries:
            if entry.name.startswith("."):
                continue  # a holding being written (_atomic_write's temporary), not a holding yet
            parsed = _parse_holding(entry.path)
            if parsed is None:
                continue  # not a holding: a FIFO, a directory, garbage (anyone may have written it)
            holding, create_time = parsed
            if _alive(holding.pid, create_time, boot):
                found.append(holding)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
        return found


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


def _parse_holding(path: str) -> tuple[SimHolding, float] | None:
    """A holding file read defensively: a regular file (never a FIFO that would block the
    read, never through a symlink), small, with the fields and types hold() writes."""
    try:
        record = json.loads(_read_small(path, regular_only=True))
        pid, create_time, gpus, mib = record["pid"], record["create_time"], record["gpus"], record["mib"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (type(pid) is int and pid > 0 and isinstance(create_time, (int, float)) and isinstance(gpus, list)
            and all(type(g) is int and g >= 0 for g in gpus) and type(mib) is int and mib >= 0):
        return None
    return SimHolding(pid, tuple(gpus), mib), float(create_time)


def _read_small(path: str, regular_only: bool = False) -> bytes:
    """One read(2) of a small file: half the cost of open()/json.load on this hot path."""
    flags = os.O_RDONLY | (os.O_NONBLOCK | os.O_NOFOLLOW if regular_only else 0)
    fd = os.open(path, flags)
    try:
        if regular_only and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)  # readable by every gpusupctl, whatever the writer's umask (the unit's is 0027)
    os.replace(tmp, path)
