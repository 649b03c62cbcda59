"""The systemd driver: each child in a transient scope, bound to the instance's service.

Why scopes rather than sub-cgroups under Delegate=yes: a scope is a real unit, so
`systemctl list-units 'dsv4-*'`, `systemctl status dsv4-pd-1p1d-router.scope` and
`systemd-cgls` name each child by instance and role, systemd kills it with KillUnit, and
`BindsTo=dsv4@NAME.service` makes systemd stop every scope when the service goes away —
including when this daemon is SIGKILLed. Delegation would hide the children inside the
service's cgroup as anonymous directories.

No `After=` on the scope: while the service is still starting, an After= ordering would
hold the scope's start job until READY=1 and leave the child in the service's cgroup
(shared/reference/systemd-test-rig.md). `Before=` instead: ordering is reversed on stop, so
`systemctl stop` lets our daemon stop router, decode and prefill in order before systemd
stops the (by then empty) scopes; without it systemd SIGTERMs every scope at once. The
child waits at the gate until it is in its scope.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence

from ..errors import BusError, OperationFailed, OwnershipError, PermissionDenied, UnitNotFound
from ..systemd.manager import UNIT, Systemd
from .base import OwnershipDriver, ProcessGroup
from .cgroupfs import CgroupDir, cgroup2_mount
from ..names import scope_name, service_name

ADOPT_TIMEOUT_S = 10.0


def _pid_cgroup(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        return None
    return None


def _own_service_and_slice() -> tuple[str | None, str | None]:
    path = _pid_cgroup(os.getpid()) or ""
    parts = [p for p in path.split("/") if p]
    service = next((p for p in reversed(parts) if p.endswith(".service")), None)
    slice_ = next((p for p in reversed(parts) if p.endswith(".slice")), None)
    return service, slice_


class ScopeGroup(ProcessGroup):
    """A transient scope: killed through its cgroup (or systemd), watched through its cgroup.events."""

    def __init__(self, driver: SystemdDriver, unit: str, process: str) -> None:
        self.driver = driver
        self.unit = unit
        self.process = process
        self.name = unit
        self.cgroup = ""
        self._dir: CgroupDir | None = None

    def bind(self, cgroup: str) -> None:
        self.cgroup = cgroup
        self._dir = CgroupDir(self.driver.mount / cgroup.lstrip("/"), self.driver.mount)

    def pids(self) -> list[int]:
        return self._dir.pids() if self._dir else []

    def populated(self) -> bool:
        return self._dir.populated() if self._dir else False

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Through systemd's KillUnit, sent from a worker thread so that the event loop never waits
        on a D-Bus round trip. (Not the scope's cgroup.kill: under the unit's sandbox the cgroup
        tree outside our own service is read-only, ProtectSystem=strict.) Callers then wait for
        the cgroup to empty, which is the only proof that counts."""
        try:
            asyncio.get_running_loop().run_in_executor(None, self._kill_unit, sig)
        except RuntimeError:  # no loop (a test, a teardown): directly
            self._kill_unit(sig)

    def _kill_unit(self, sig: int) -> None:
        try:
            self.driver.systemd.kill(self.unit, sig)
        except (OperationFailed, PermissionDenied, UnitNotFound):
            if self._dir is not None:  # the unit is already gone: its cgroup, if any and if we may
                try:
                    self._dir.kill_all(sig)
                except OSError:
                    pass

    async def wait_empty(self, timeout: float | None) -> bool:
        if self._dir is None:
            return True
        return await self._dir.wait_empty(timeout)

    async def release(self) -> None:
        # An empty scope stops by itself; reset a failed one so the name can be reused.
        await asyncio.to_thread(self.driver.systemd.reset_failed, self.unit)


class SystemdDriver(OwnershipDriver):
    name = "systemd"

    def __init__(self, instance: str, systemd: Systemd | None = None) -> None:
        mount = cgroup2_mount()
        if mount is None:
            raise OwnershipError("no cgroup v2 hierarchy is mounted")
        self.mount = mount
        self.instance = instance
        try:
            self.systemd = systemd if systemd is not None else Systemd()
        except BusError as e:
            raise OwnershipError(f"cannot reach systemd over D-Bus: {e}") from e
        own_service, own_slice = _own_service_and_slice()
        self.service = own_service or service_name(instance)
        self.slice = own_slice

    def _scopes_of(self, instance: str, processes: Sequence[str]) -> list[tuple[str, str]]:
        """(name, active state) of the scopes we would create for `processes`, by exact name, and
        only those bound to our service: never a pattern (dsv4-tp4-*.scope also matches tp4-512k's)."""
        names = [scope_name(instance, p) for p in processes]
        out = []
        for name, load, active, path in self.systemd.units_named(names):
            if name not in names or load == "not-found":
                continue
            try:
                binds = list(self.systemd.get(path, UNIT, "BindsTo"))
            except (OperationFailed, UnitNotFound):
                continue  # gone meanwhile
            if self.service in binds:
                out.append((name, active))
        return out

    async def reclaim_leftovers(self, instance: str, policy: str, processes: Sequence[str] = ()) -> list[str]:
        cleaned = []
        for unit, active in await asyncio.to_thread(self._scopes_of, instance, processes):
            if active not in ("active", "activating", "deactivating"):
                await asyncio.to_thread(self.systemd.reset_failed, unit)
                continue
            if policy == "refuse":
                raise OwnershipError(f"scope {unit} of a previous run is still {active}; stop it (systemctl stop {unit}) or set leftovers = \"clean\"")
            await asyncio.to_thread(self._kill_and_forget, unit)
            cleaned.append(unit)
        return cleaned

    def _kill_and_forget(self, unit: str) -> None:
        """SIGKILL a scope of ours, wait for systemd's JobRemoved of its stop, clear a failed state."""
        try:
            self.systemd.kill(unit, signal.SIGKILL)
        except (OperationFailed, UnitNotFound):
            pass
        try:
            self.systemd.stop_and_forget(unit, timeout=10.0)
        except (OperationFailed, UnitNotFound):
            pass

    async def _create_group(self, instance: str, process: str) -> ProcessGroup:
        unit = scope_name(instance, process)
        await asyncio.to_thread(self._clear_name, unit)
        return ScopeGroup(self, unit, process)

    def _clear_name(self, unit: str) -> None:
        """A scope of that name from an earlier start must be gone before we reuse the name."""
        if self.systemd.unit_path(unit) is None:
            return
        self._kill_and_forget(unit)

    async def _adopt(self, group: ProcessGroup, pid: int) -> ProcessGroup:
        assert isinstance(group, ScopeGroup)
        from gi.repository import GLib

        props = [
            ("PIDs", GLib.Variant("au", [pid])),
            ("Description", GLib.Variant("s", f"supervisord-gpu {self.instance}: {group.process}")),
            ("BindsTo", GLib.Variant("as", [self.service])),
            # Stop order: systemd propagates a stop of the service to bound units *at once*, which
            # would SIGTERM every server while the router still drains. Before= reverses on stop:
            # the service (our ordered stop) finishes first, then the already-empty scopes.
            ("Before", GLib.Variant("as", [self.service])),
            ("KillMode", GLib.Variant("s", "control-group")),
            ("SendSIGKILL", GLib.Variant("b", True)),
            ("CollectMode", GLib.Variant("s", "inactive-or-failed")),
        ]
        if self.slice:
            props.append(("Slice", GLib.Variant("s", self.slice)))
        try:
            job = await asyncio.to_thread(self.systemd.start_transient, group.unit, props, ADOPT_TIMEOUT_S)
        except (OperationFailed, PermissionDenied) as e:
            raise OwnershipError(f"systemd refused scope {group.unit}: {e}") from e
        if not job.done:
            raise OwnershipError(f"systemd's start of scope {group.unit} ended {job.result!r}")
        # The job is done, so systemd has moved the PID (the child waits at the gate meanwhile).
        # The short re-read covers a cgroup write that lags the job on a loaded machine.
        suffix = "/" + group.unit
        deadline = time.monotonic() + 1.0
        while True:
            cg = _pid_cgroup(pid)
            if cg and cg.endswith(suffix):
                group.bind(cg)
                return group
            if time.monotonic() > deadline:
                raise OwnershipError(f"pid {pid} did not move into {group.unit} (still in {cg})")
            await asyncio.sleep(0.005)
