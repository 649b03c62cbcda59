"""Test rigs. `rig.systemd_container` boots a real systemd (Debian 12) with systemd-nspawn."""

from rig.systemd_container import (
    Bind,
    ContainerProcess,
    RigUnavailable,
    SystemdContainer,
    ensure_rootfs,
    missing_tools,
)

__all__ = [
    "Bind",
    "ContainerProcess",
    "RigUnavailable",
    "SystemdContainer",
    "ensure_rootfs",
    "missing_tools",
]
