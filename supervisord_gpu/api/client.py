"""The client side of each running instance's own API, and following a unit's job live.

gpusupctl goes through systemd for start/stop/restart (so the unit's state stays the truth;
systemd/manager.py is the one systemd client) and through the instance's bus name for the
details only the daemon knows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..errors import BusError, OperationFailed, PermissionDenied
from ..names import service_name
from ..bus import names
from ..bus.errors import DENIED, NOT_ANSWERING, error_name, first_line


class InstanceClient:
    """One instance's daemon, by its bus name; calls go straight through the connection."""

    def __init__(self, connection: Any, instance: str) -> None:
        self.con = connection
        self.instance = instance

    def call(self, method: str, signature: str | None = None, args: tuple[Any, ...] = (), timeout_ms: int = 5000) -> Any:
        from gi.repository import GLib

        params = GLib.Variant(f"({signature})", args) if signature else None
        try:
            reply = self.con.call_sync(names.bus_name(self.instance), names.OBJECT_PATH, names.INTERFACE, method,
                                       params, None, 0, timeout_ms, None)
        except GLib.Error as e:
            text, name = first_line(e), error_name(e)
            if name in DENIED:
                raise PermissionDenied(text) from None
            if name in NOT_ANSWERING:
                raise BusError(f"daemon of {self.instance} not answering on {names.bus_name(self.instance)}: {text}") from None
            raise OperationFailed(text, name) from None
        return reply.unpack()[0]

    def status(self) -> dict[str, Any]:
        return json.loads(self.call("GetStatus"))  # type: ignore[no-any-return]


def follow(instance: str, action: str, timeout: float, show: Callable[[str], None]) -> tuple[str, str]:
    """Start, stop or restart dsv4@NAME and follow it live until systemd's job for it ends.

    The wait is systemd's own JobRemoved for that job (systemd/manager.py): for a start or a
    restart it comes once the new daemon has sent READY=1 (servers healthy) or has failed,
    never while the old one is still deactivating. On the way, the unit's StatusText and the
    daemon's StateChanged (each accepted only from its real sender) are shown as they come.
    Returns (job result, ActiveState after it).
    """
    import time

    from gi.repository import Gio

    from ..systemd.manager import UNIT, Systemd

    systemd = Systemd()
    unit = service_name(instance)
    began = time.monotonic()

    def stamp() -> str:
        return f"{time.monotonic() - began:6.1f}s"

    def on_instance(_con, _sender, _path, _iface, _signal, params) -> None:  # type: ignore[no-untyped-def]
        inst, process, _state, message = params.unpack()
        if inst == instance and process:
            show(f"{stamp()}    {process}: {message}")

    def extra(con) -> list[int]:  # type: ignore[no-untyped-def]
        # A match on a well-known name: the bus delivers it only from that name's owner.
        return [con.signal_subscribe(names.bus_name(instance), names.INTERFACE, names.SIGNAL_STATE_CHANGED,
                                     names.OBJECT_PATH, None, Gio.DBusSignalFlags.NONE, on_instance)]

    method = {"start": "StartUnit", "stop": "StopUnit", "restart": "RestartUnit"}[action]
    job = systemd.run_job(method, unit, timeout=timeout, on_status=lambda text: show(f"{stamp()}  {text}"), extra=extra)
    path = systemd.unit_path(unit)
    active = str(systemd.get(path, UNIT, "ActiveState")) if path else "inactive"
    return job.result, active
