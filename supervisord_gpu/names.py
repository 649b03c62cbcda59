"""How our cgroups and units are named, and how to tell from a cgroup path that it is ours.

One place for the naming scheme so that the drivers that create cgroups and the checks that
attribute holders can never disagree. Process names have no '-', so a scope name
`dsv4-<instance>-<process>.scope` splits unambiguously at its last '-'.
"""

from __future__ import annotations

import re
from .records import dataclass

UNIT_PREFIX = "dsv4"
CGROUPFS_ROOT_NAME = "supervisord-gpu"

INSTANCE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
PROCESS_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}\Z")

_SCOPE_RE = re.compile(rf"^{UNIT_PREFIX}-(?P<instance>.+)-(?P<process>[a-z][a-z0-9_]*)\.scope\Z")
_SERVICE_RE = re.compile(rf"^{UNIT_PREFIX}@(?P<instance>.+)\.service\Z")


@dataclass(frozen=True)
class Owner:
    """Who a cgroup belongs to: one of our instances, and which of its processes."""

    instance: str
    process: str  # "daemon" for the supervisor itself
    unit: str | None = None

    def describe(self) -> str:
        return f"instance {self.instance}, {self.process}"


def service_name(instance: str) -> str:
    return f"{UNIT_PREFIX}@{instance}.service"


def scope_name(instance: str, process: str) -> str:
    return f"{UNIT_PREFIX}-{instance}-{process}.scope"


def owner_of_cgroup(path: str) -> Owner | None:
    """Attribute a cgroup path (as in /proc/PID/cgroup) to one of our instances, or None.

    A name alone proves nothing: any local user can create `dsv4-pd-1p1d-router.scope` or
    `supervisord-gpu/pd-1p1d/router` inside the subtree their user manager delegates to
    them. What they cannot do is place one where only root can: a unit of the system
    manager sits under slices alone (a user's units sit under `user@UID.service`), and our
    cgroupfs tree sits outside every systemd unit. So a path counts as ours only when every
    cgroup above our name is a slice (systemd) or none is a unit at all (cgroupfs).
    """
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        above = parts[:i]
        m = _SCOPE_RE.match(part)
        if m and all(a.endswith(".slice") for a in above):
            return Owner(m["instance"], m["process"], part)
        m = _SERVICE_RE.match(part)
        if m and all(a.endswith(".slice") for a in above):
            return Owner(m["instance"], "daemon", part)
        if part == CGROUPFS_ROOT_NAME and len(parts) > i + 2 and not any(_is_unit(a) for a in above):
            return Owner(parts[i + 1], parts[i + 2])
    return None


def _is_unit(part: str) -> bool:
    return part.endswith((".slice", ".service", ".scope"))


def unit_of_cgroup(path: str) -> str | None:
    """The innermost systemd unit (service or scope) named in a cgroup path, if any."""
    for part in reversed([p for p in path.split("/") if p]):
        if part.endswith((".service", ".scope")):
            return part
    return None
