"""The client side of each running instance's own API, and following a unit's job live.

gpusupctl goes through systemd for start/stop/restart (so the unit's state stays the truth;
systemd/manager.py is the one systemd client) and through the instance's bus name for the
details only the daemon knows.

A refusal of the daemon arrives by its D-Bus name and leaves `call` as its class from the
table of errors.py (Busy, UnknownProcess, ...): gpusupctl then exits with the daemon's own
code, its first line as the message; nothing here reads the text to decide.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ..errors import BusError, OperationFailed, PermissionDenied
from ..names import service_name
from ..bus import names
from ..bus.errors import DENIED, NOT_ANSWERING, error_name, first_line, ours, remote_text

#: how often `InstanceClient.follow_job` asks GetJob
JOB_POLL_S = 0.2


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
            raise self.error_of(e) from None
        return reply.unpack()[0]

    def error_of(self, e: Exception) -> Exception:
        """What a failed call raises: our daemon's error as its class, a refusal by the bus or
        polkit as PermissionDenied, nobody answering as BusError (4), anything else failed (1)."""
        mine = ours(e)
        if mine is not None:
            return mine
        name = error_name(e)
        if name in DENIED:
            return PermissionDenied(remote_text(e))
        if name in NOT_ANSWERING:
            return BusError(f"daemon of {self.instance} not answering on {names.bus_name(self.instance)}: {first_line(e)}")
        return OperationFailed(remote_text(e), name)

    def status(self) -> dict[str, Any]:
        return json.loads(self.call("GetStatus"))

    def restart_process(self, process: str) -> dict[str, Any]:
        """RestartProcess: its job as JSON, or the refusal as its class (UnknownProcess, Busy, ...)."""
        return json.loads(self.call("RestartProcess", "s", (process,)))

    def park(self, next_profile: str) -> dict[str, Any]:
        """Park (issue 39): its job as JSON, or the refusal as its class."""
        return json.loads(self.call("Park", "s", (next_profile,)))

    def restore(self) -> dict[str, Any]:
        """Restore (the switch back to a parked instance): its job as JSON."""
        return json.loads(self.call("Restore"))

    def job(self, job_id: int) -> dict[str, Any]:
        return json.loads(self.call("GetJob", "u", (int(job_id),)))

    def follow_job(self, job: dict[str, Any], timeout: float, show: Callable[[str], None],
                   every_s: float = JOB_POLL_S) -> dict[str, Any]:
        """Follow a job of the daemon until it is no longer "running", or `timeout` passes (the
        job then as last seen). The processes' StateChanged signals are shown as they come;
        GetJob is asked every `every_s` (the daemon sends no signal when a job ends)."""
        from gi.repository import Gio, GLib

        ctx = GLib.MainContext.new()
        ctx.push_thread_default()
        loop = GLib.MainLoop(ctx)
        seen: dict[str, Any] = {"job": job, "error": None}
        began = time.monotonic()

        def on_state(_con, _sender, _path, _iface, _signal, params) -> None:
            inst, process, _state, message = params.unpack()
            if inst == self.instance and process:
                show(f"{time.monotonic() - began:6.1f}s    {process}: {message}")

        def ask() -> bool:
            try:
                seen["job"] = self.job(int(job["id"]))
            except Exception as e:  # raised below, not into GLib's callback machinery
                seen["error"] = e
            if seen["error"] or seen["job"].get("state") != "running" or time.monotonic() - began > timeout:
                loop.quit()
                return False
            return True

        # a match on the well-known name: the bus delivers it only from that name's owner
        sub = self.con.signal_subscribe(names.bus_name(self.instance), names.INTERFACE, names.SIGNAL_STATE_CHANGED,
                                        names.OBJECT_PATH, None, Gio.DBusSignalFlags.NONE, on_state)
        try:
            if ask():
                timer = GLib.timeout_source_new(max(1, int(every_s * 1000)))
                timer.set_callback(lambda *_a: ask())
                timer.attach(ctx)
                loop.run()
                timer.destroy()
        finally:
            self.con.signal_unsubscribe(sub)
            ctx.pop_thread_default()
        if seen["error"] is not None:
            raise seen["error"]
        return seen["job"]


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

    def on_instance(_con, _sender, _path, _iface, _signal, params) -> None:
        inst, process, _state, message = params.unpack()
        if inst == instance and process:
            show(f"{stamp()}    {process}: {message}")

    def extra(con) -> list[int]:
        # A match on a well-known name: the bus delivers it only from that name's owner.
        return [con.signal_subscribe(names.bus_name(instance), names.INTERFACE, names.SIGNAL_STATE_CHANGED,
                                     names.OBJECT_PATH, None, Gio.DBusSignalFlags.NONE, on_instance)]

    method = {"start": "StartUnit", "stop": "StopUnit", "restart": "RestartUnit"}[action]
    job = systemd.run_job(method, unit, timeout=timeout, on_status=lambda text: show(f"{stamp()}  {text}"), extra=extra)
    path = systemd.unit_path(unit)
    active = str(systemd.get(path, UNIT, "ActiveState")) if path else "inactive"
    return job.result, active
