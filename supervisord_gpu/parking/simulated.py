"""The rehearsal's checkpointer: a stand-in's simulated GPU memory moved to "host memory".

A stand-in server holds simulated GPU memory through a holding file per scheduler process
(checks/simgpu.py: holders/<uid>/<pid>.json). Checkpointing a PID renames its holding to
`.parked.<pid>.json` beside it: a name the simulated GPUs skip, so the GPU reads at its
baseline while the process runs on, exactly what NVML shows of a checkpointed CUDA process. A
restore renames it back, after checking the GPUs have the room again (a restore onto GPUs
someone else filled fails, as cudaMalloc would, and the parker then cold-starts the profile).

Nothing is signalled here: the Parker holds the rest of a parked server (SIGSTOP of its front
end and detokenizer, controller/parking.py) whatever the checkpointer, so a request sent while
parked waits in the kernel's backlog and is answered after the restore, on the stand-in as on the
real server (whose checkpointed scheduler crashed on one request when its front end ran on).

The holding lies in its user's own directory (holders/<uid>/, writable by that user alone), so
the renames and the removal run as that user, in a process of its own (`_as_owner`), never as
root: the daemon under its unit has no CAP_DAC_OVERRIDE or CAP_FOWNER (units/dsv4@.service:
root never writes inside a directory of the servers' user), and a park of the shipped profiles
(servers as `sglang`) failed there with "Permission denied" until it did.

The state lives in the files, not in this object: a parked holding says CHECKPOINTED to any
reader (`gpusupctl status`, the daemon after a restart of its own); only LOCKED, which lasts
between two calls of one park, is kept here.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from ..checks.simgpu import SimulatedGpus, _holdings_dir_owner, _parse_holding
from ..ownership.procfs import real_uid
from .checkpointer import CheckpointError, CheckpointState

MIB = 1 << 20
#: coreutils (essential in Debian): every user can run them, wherever our interpreter lives
MV, RM = "/usr/bin/mv", "/usr/bin/rm"
AS_OWNER_TIMEOUT_S = 10.0


def _as_owner(path: Path, argv: list[str]) -> str:
    """Run `argv` (mv or rm on names in `path`'s directory) as that directory's owner; "" when it
    exited 0, else why not. Root's own directory is written directly by the caller."""
    try:
        st = os.lstat(path.parent)
        done = subprocess.run(argv, user=st.st_uid, group=st.st_gid, extra_groups=[], cwd="/",
                              env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=AS_OWNER_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if done.returncode == 0:
        return ""
    return (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[-1][:200]


def _rename(src: Path, dst: Path) -> None:
    """src -> dst in one holders directory, as its owner; CheckpointError naming the files if not."""
    try:
        owner = os.lstat(src.parent).st_uid
        if owner == os.geteuid():
            os.rename(src, dst)
            return
    except OSError as e:
        raise CheckpointError(f"{src} -> {dst.name}: {e.strerror}") from None
    why = _as_owner(src, [MV, "-T", "--", str(src), str(dst)])
    if why or not os.path.lexists(dst):
        raise CheckpointError(f"{src} -> {dst.name} as uid {owner}: {why or 'not moved'}")


class SimulatedCheckpointer:
    name = "simulated"

    def __init__(self, sim: SimulatedGpus) -> None:
        self.sim = sim
        self._locked: set[int] = set()
        #: where each PID's parked holding was put: `forget` comes after its process ended, when
        #: its uid (which names the directory to look in) can no longer be read
        self._parked: dict[int, Path] = {}

    def _holders_dirs(self, pid: int) -> list[Path]:
        """The directories that may speak for `pid` (checks/simgpu.py's rule): holders/ is 1777,
        so only one of the process's own user, or root's, writable by its owner alone."""
        uid = real_uid(pid)
        try:
            entries = list(os.scandir(self.sim.directory / "holders"))
        except OSError:
            return []
        out = []
        for e in entries:
            try:
                owner = _holdings_dir_owner(e.stat(follow_symlinks=False))
            except OSError:
                continue
            if owner is not None and (owner == uid or owner == 0):
                out.append(Path(e.path))
        return out

    def _find(self, pid: int, parked: bool) -> Path | None:
        """Its holding (or parked holding): a regular file, never through a symlink, owned by its
        directory's owner; another user's claim for our PID is nobody's."""
        name = f".parked.{pid}.json" if parked else f"{pid}.json"
        for d in self._holders_dirs(pid):
            try:
                st, dst = os.lstat(d / name), os.lstat(d)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == dst.st_uid:
                return d / name
        return None

    def lock(self, pid: int, timeout_ms: int) -> None:
        if self._find(pid, parked=False) is None:
            raise CheckpointError(f"lock(pid {pid}) failed: it holds no simulated GPU memory")
        self._locked.add(pid)

    def checkpoint(self, pid: int) -> None:
        if pid not in self._locked:
            raise CheckpointError(f"checkpoint(pid {pid}) failed: not locked")
        path = self._find(pid, parked=False)
        if path is None:
            raise CheckpointError(f"checkpoint(pid {pid}) failed: its holding is gone")
        _rename(path, path.with_name(f".parked.{pid}.json"))
        self._parked[pid] = path.with_name(f".parked.{pid}.json")

    def restore(self, pid: int) -> None:
        path = self._find(pid, parked=True)
        if path is None:
            raise CheckpointError(f"restore(pid {pid}) failed: nothing parked for it")
        parsed = _parse_holding(str(path))
        if parsed is None:
            raise CheckpointError(f"restore(pid {pid}) failed: its parked holding does not parse")
        holding = parsed[0]
        devices = {d.index: d for d in self.sim.devices()}
        for g in holding.gpus:
            used = sum(h.mib for h in self.sim.holders() if g in h.gpus)
            d = devices.get(g)
            if d is None or d.total_mib - d.reserved_mib - used < holding.mib:
                raise CheckpointError(f"restore(pid {pid}) failed: CUDA_ERROR_OUT_OF_MEMORY (simulated GPU {g} "
                                      f"has no room for its {holding.mib} MiB)")
        _rename(path, path.with_name(f"{pid}.json"))
        self._parked.pop(pid, None)

    def unlock(self, pid: int) -> None:
        if self._find(pid, parked=True) is not None:
            raise CheckpointError(f"unlock(pid {pid}) failed: it is checkpointed, restore it first")
        self._locked.discard(pid)

    def state(self, pid: int) -> CheckpointState:
        if self._find(pid, parked=True) is not None:
            return CheckpointState.CHECKPOINTED
        return CheckpointState.LOCKED if pid in self._locked else CheckpointState.RUNNING

    def host_bytes(self, pid: int) -> int:
        path = self._find(pid, parked=True)
        parsed = _parse_holding(str(path)) if path is not None else None
        return parsed[0].mib * len(parsed[0].gpus) * MIB if parsed is not None else 0

    def forget(self, pid: int) -> None:
        """A parked process that ended: its parked holding removed (the driver frees a dead
        process's host copy the same way), so a stop leaves nothing behind."""
        path = self._find(pid, parked=True) or self._parked.get(pid)
        self._parked.pop(pid, None)
        if path is None:
            return
        try:
            if os.lstat(path.parent).st_uid == os.geteuid():
                path.unlink()
                return
        except OSError:
            return
        _as_owner(path, [RM, "-f", "--", str(path)])
