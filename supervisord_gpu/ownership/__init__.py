"""Process ownership by cgroup: one interface (base.py), drivers chosen once at start-up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OwnershipError

if TYPE_CHECKING:  # asyncio and the drivers load only when a daemon picks one: the CLI stays fast
    from .base import OwnershipDriver


def under_systemd_service() -> bool:
    """True when systemd started us as a service (our cgroup is a .service of the system manager)."""
    if not os.environ.get("INVOCATION_ID"):
        return False
    try:
        with open("/proc/self/cgroup") as f:
            return any(line.startswith("0::") and ".service" in line for line in f)
    except OSError:
        return False


def choose_driver(mode: str, cgroup_root: str | None, instance: str, warn=print) -> OwnershipDriver:
    """auto: systemd under systemd, else cgroupfs, else the weak session fallback (loudly)."""
    if mode == "systemd" or (mode == "auto" and under_systemd_service()):
        from .systemd import SystemdDriver

        try:
            return SystemdDriver(instance)
        except OwnershipError:
            if mode == "systemd":
                raise
    if mode in ("auto", "cgroupfs"):
        from .cgroupfs import CgroupfsDriver, default_root

        root = Path(cgroup_root) if cgroup_root else default_root()
        if root is not None:
            try:
                return CgroupfsDriver(root)
            except OwnershipError:
                if mode == "cgroupfs":
                    raise
        elif mode == "cgroupfs":
            raise OwnershipError("no cgroup v2 hierarchy is mounted; cannot use the cgroupfs driver")
    from .session import WARNING, SessionDriver

    warn(WARNING)
    return SessionDriver()
