"""The one narrow interface through which the engine owns processes (runc's cgroup manager is the model).

A driver puts every supervised process into a group of its own — a cgroup — *before* the
process can run a single instruction of its program: the child is born held at a gate
(a blocking read in the forked child, before exec), the driver moves it into its cgroup,
and only then opens the gate. Whatever the child forks later, setsid or re-parented to
PID 1 included, is born inside that cgroup and is killed with it. Ownership is membership,
never a command line.
"""

from __future__ import annotations

import abc
import asyncio
import os
import signal
import sys
from ..records import dataclass, field
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


@dataclass
class SpawnRequest:
    instance: str
    process: str
    argv: Sequence[str]
    env: Mapping[str, str]
    user: str | None = None
    cwd: str | None = None


class ProcessGroup(abc.ABC):
    """Everything one supervised process is and has spawned: one cgroup (or, weakly, one session)."""

    #: what a person sees: a cgroup path or a unit name
    name: str
    #: the cgroup path as /proc/PID/cgroup shows it ("" for the session fallback)
    cgroup: str

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """Every live process in the group."""

    def populated(self) -> bool:
        return bool(self.pids())

    @abc.abstractmethod
    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process in the group, however it got there."""

    @abc.abstractmethod
    async def wait_empty(self, timeout: float | None) -> bool:
        """Return True as soon as the group is empty, False at the timeout."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Remove the (empty) group; harmless when it is already gone."""


@dataclass
class Spawned:
    """A started process: its asyncio handle and the group that owns it and its descendants."""

    proc: asyncio.subprocess.Process
    group: ProcessGroup
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid


class OwnershipDriver(abc.ABC):
    """Chosen once at start-up; the engine never knows which one it holds."""

    name: str = "abstract"
    #: True when re-parented processes can escape (the session fallback)
    weak: bool = False

    @abc.abstractmethod
    async def reclaim_leftovers(self, instance: str, policy: str, processes: Sequence[str] = ()) -> list[str]:
        """Deal with groups a previous run of `instance` left behind (policy "clean" or "refuse").

        `processes`: the process names of the profile; the groups looked at are exactly the
        ones this driver creates for them. Returns a description of each group cleaned;
        raises OwnershipError when refusing.
        """

    @abc.abstractmethod
    async def _create_group(self, instance: str, process: str) -> ProcessGroup:
        """Make an empty group for a process that is about to be born."""

    @abc.abstractmethod
    async def _adopt(self, group: ProcessGroup, pid: int) -> ProcessGroup:
        """Move the gated child into its group; return the group (drivers may replace it)."""

    def guard(self, instance: str) -> None:  # noqa: B027  (a hook: a no-op where systemd does it)
        """Make sure the instance's processes die if this daemon dies (a no-op where systemd does it)."""

    def _popen_extra(self) -> dict[str, Any]:
        """Extra Popen arguments a driver needs."""
        return {}

    async def spawn(self, req: SpawnRequest) -> Spawned:
        """Start `req.argv` (never through a shell) inside a fresh group, with no gap."""
        group = await self._create_group(req.instance, req.process)
        gate_r, gate_w = os.pipe()
        try:
            program, *args = gate_argv(gate_r, req.argv)
            proc = await asyncio.create_subprocess_exec(
                program, *args,
                env=dict(req.env),
                cwd=req.cwd if req.cwd is not None else child_cwd(),
                **credentials(req.user),
                pass_fds=(gate_r,),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # Its own session and process group, whatever the driver: SGLang's children stay in
                # its group, and a group kill (SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1, a terminal's
                # Ctrl-C) must reach that server alone, never the daemon or its other servers.
                start_new_session=True,
                **self._popen_extra(),
            )
        except BaseException:
            os.close(gate_w)
            await group.release()
            raise
        finally:
            os.close(gate_r)
        try:
            group = await self._adopt(group, proc.pid)
            os.write(gate_w, b"g")
        except BaseException:
            proc.kill()
            await proc.wait()
            await group.release()
            raise
        finally:
            os.close(gate_w)
        return Spawned(proc, group)


def credentials(user: str | None) -> dict[str, Any]:
    """Popen arguments that make a child `user` entirely: uid, primary gid and the user's
    supplementary groups (initgroups), never root's group 0 or root's other groups."""
    if user is None:
        return {}
    import pwd

    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid)}


# The gate: a minimal interpreter (no site, isolated) that blocks on a pipe until the driver
# has moved it into its cgroup, then becomes the real program by exec (same PID). A preexec_fn
# cannot do this: Popen waits for the exec before it returns the PID we need to adopt.
_GATE = (
    "import os,sys\n"
    "fd=int(sys.argv[1])\n"
    "ok=os.read(fd,1)==b'g'\n"
    "os.close(fd)\n"
    "if not ok: os._exit(127)\n"
    "try: os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:\n"
    " sys.stderr.write('supervisord-gpu: cannot execute %s: %s\\n'%(sys.argv[2],e.strerror)); os._exit(127)\n"
)


def child_cwd() -> str | None:
    """Where a child starts when its request names no directory: the daemon's own (None), unless
    another user could write that one, then "/". `python3 -m MODULE` (the router the daemon picks,
    the servers) and the key shims' `python3 -c` put the working directory first on sys.path: a
    module planted there by a local user (root ran `supervisord-gpu run` from /tmp, say) would
    run as the child, with its admin or control-plane key. Only as root: otherwise the children
    run as the daemon's own user, who could run that file anyway."""
    if os.geteuid() != 0:
        return None
    from ..config.trust import check_modes
    from ..errors import SupervisorError

    try:
        check_modes(Path(os.getcwd()))
    except (OSError, SupervisorError):
        return "/"
    return None


def gate_argv(fd: int, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _GATE, str(fd), *argv]
