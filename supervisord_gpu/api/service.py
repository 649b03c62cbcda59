"""The daemon's D-Bus object: reads from a snapshot, controls through the engine's loop.

pydbus serves from a GLib main loop, which runs in its own thread; the engine stays on its
asyncio loop. The bus thread never touches engine objects: it reads the latest status
snapshot (a JSON string the loop publishes on every event) and hands control calls to the
loop with run_coroutine_threadsafe. Control methods are checked by the @export decorator
itself (root or the control group, by the caller's uid from the bus daemon), so a permissive
bus policy does not open them and no method can forget the check.

What every local user receives (signals, properties, the replies to callers outside the control
group) carries our own words only: the first line of a reason (`public_text`), never a child's
output. A start failure's first line is ours (engine/process.py's `_failure`); the lines below
it quote the child (its last error, its last lines; SGLang logs its server_args, api_key
included), for the journal and for privileged readers.
"""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import pwd
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydbus.generic import signal as dbus_signal

from ..bus import names
from ..controller.outcome import Job
from ..bus.errors import DENIED, OURS, error_name, first_line
from ..errors import AccessDenied, BusError, UnknownJob, UnknownProcess
from .exports import export, exported_methods, introspection_xml
from ..bus.link import BusLink, system_bus

if TYPE_CHECKING:
    from ..controller.controller import InstanceController


class _Refusals(logging.Filter):
    """pydbus logs a traceback for every exception a method raises; ours are answers (an unknown
    name, access denied, an argument too long), not bugs: one unprivileged caller's flood of them
    would fill the journal, and journald's rate limit would then drop the daemon's own lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not type(exc).__name__.startswith(OURS)  # errors.py's table, on the wire


_REFUSALS = _Refusals()


def quiet_refusals() -> None:
    logger = logging.getLogger("pydbus.registration")
    if _REFUSALS not in logger.filters:
        logger.addFilter(_REFUSALS)


class Controls:
    """What the bus may ask of the instance's controller, called from the bus thread.

    Each call crosses to the daemon's event loop and comes back with an answer at once: a job
    id to follow (Stop, Restart, RestartProcess), or a refusal as the controller raised it
    (Busy, from errors.py's table), which the caller receives by its name. The work itself
    runs on the loop, in the controller, on the same path as the daemon's own start.
    """

    def __init__(self, controller: InstanceController, loop: asyncio.AbstractEventLoop) -> None:
        self.controller = controller
        self.loop = loop

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=10)

    def process_names(self) -> list[str]:
        return list(self.controller.instance.processes)

    def stop(self) -> Job:
        return self._on_loop(self.controller.request_stop)

    def submit(self, verb: str, work: Callable[[], Any]) -> Job:
        return self._on_loop(lambda: self.controller.submit(verb, work))

    def job(self, job_id: int) -> Job | None:
        return self._on_loop(lambda: self.controller.jobs.get(job_id))


#: the longest reason a signal or an unprivileged reply carries (a holder's command line is long)
PUBLIC_TEXT_LIMIT = 500


def public_text(text: str) -> str:
    """What every local user may read of a reason: its first line (our words), bounded."""
    if not text:
        return ""
    lines = text.splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= PUBLIC_TEXT_LIMIT else first[: PUBLIC_TEXT_LIMIT - 1] + "…"


def public_snapshot(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The status for readers outside the control group: no process's last error line (its own
    words), and every reason, history detail and transition cut to its first line."""
    processes = []
    for p in snapshot.get("processes", []):
        proc = {k: v for k, v in p.items() if k != "last_error"}
        if isinstance(proc.get("last_exit"), str):
            proc["last_exit"] = public_text(proc["last_exit"])
        if isinstance(proc.get("history"), list):
            proc["history"] = [dict(h, detail=public_text(h.get("detail") or "")) if isinstance(h, dict) else h
                               for h in proc["history"]]
        processes.append(proc)
    public = dict(snapshot, processes=processes)
    for key in ("reason", "transition"):
        if isinstance(public.get(key), str):
            public[key] = public_text(public[key])
    return public


def starting_snapshot(instance: str) -> dict[str, Any]:
    """What GetStatus answers before the loop's first publish: the shape of every later answer
    (InstanceStatus.to_json, the README's `status --json`), so no reader meets a missing key in
    the moment between the name on the bus and the first snapshot (a 200-client load test did)."""
    now = time.time()
    return {"instance": instance, "state": "starting", "reason": "", "since": now, "started_at": None,
            "ready_at": None, "driver": "", "processes": [], "transition": "", "snapshot_at": now}


def bounded(text: str, limit: int = 64) -> str:
    """What a caller sent, echoed back at most `limit` characters long (a 1 MiB name slowed every reader)."""
    return repr(text[:limit]) + (f" (and {len(text) - limit} more characters)" if len(text) > limit else "")


def uid_may_control(uid: int, group: str) -> bool:
    if uid == 0:
        return True
    try:
        user = pwd.getpwuid(uid)
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return False
    return gid in os.getgrouplist(user.pw_name, user.pw_gid)


class InstanceObject:
    """Published at names.OBJECT_PATH under names.bus_name(instance)."""

    StateChanged = dbus_signal()  # (instance, process, state, message); process "" for the instance

    def __init__(self, instance: str, loop: asyncio.AbstractEventLoop, controls: Controls, control_group: str,
                 caller_uid: Callable[[str], int]) -> None:
        self._instance = instance
        self._loop = loop
        self._controls = controls
        self._group = control_group
        self._caller_uid = caller_uid
        self.snapshot = json.dumps(starting_snapshot(instance))
        self.public_snapshot = self.snapshot  # the same without the children's own words
        self.status_text = "starting"
        self.state = "starting"

    # ---------------------------------------------------------------- authorization

    def _privileged(self, dbus_context: Any) -> tuple[bool, int]:
        sender = dbus_context.sender if dbus_context is not None else None
        uid = self._caller_uid(sender) if sender else 0
        return uid_may_control(uid, self._group), uid

    def authorize(self, dbus_context: Any, method: str) -> None:
        """Called by @export(control=True) before every control method (exports.py)."""
        allowed, uid = self._privileged(dbus_context)
        if not allowed:
            raise AccessDenied(f"{method} needs root or membership of group {self._group!r} (caller uid {uid})")

    # ---------------------------------------------------------------- reads

    @export("", "s")
    def GetStatus(self, dbus_context: Any = None) -> str:
        """The whole instance as JSON (documented in the README: `status --json`). The processes'
        last error lines (their own output) only for root and the control group."""
        return self.snapshot if self._privileged(dbus_context)[0] else self.public_snapshot

    @export("s", "s", too_long=UnknownProcess)
    def GetProcess(self, name: str, dbus_context: Any = None) -> str:
        for proc in json.loads(self.GetStatus(dbus_context=dbus_context)).get("processes", []):
            if proc["name"] == name:
                return json.dumps(proc)
        raise UnknownProcess(f"instance {self._instance} has no process {bounded(name)}")

    @export("s", "s", too_long=UnknownProcess)
    def GetHistory(self, name: str, dbus_context: Any = None) -> str:
        return json.dumps(json.loads(self.GetProcess(name, dbus_context=dbus_context)).get("history", []))

    @export("", "s")
    def Ping(self) -> str:
        return self._instance

    # ---------------------------------------------------------------- controls

    @export("", "s", control=True)
    def Stop(self, dbus_context: Any = None) -> str:
        """Stop every process in order; the daemon then exits 0 (its unit goes inactive). Returns
        the stop's job as JSON (a second Stop gets the same job); GetJob says "done" once every
        process has stopped, and the name leaves the bus as the daemon exits right after."""
        return json.dumps(self._controls.stop().to_json())

    @export("", "s", control=True)
    def Restart(self, dbus_context: Any = None) -> str:
        """Stop, then the whole start path (validation, lock, takeover, rollback). Returns a job
        as JSON; follow it with GetJob until its state is no longer "running"."""
        job = self._controls.submit("restart", self._controls.controller.restart)
        return json.dumps(job.to_json())

    @export("s", "s", control=True, too_long=UnknownProcess)
    def RestartProcess(self, name: str, dbus_context: Any = None) -> str:
        """Restart one process (out of its router first, back in once ready). Returns a job as JSON."""
        if name not in self._controls.process_names():
            raise UnknownProcess(f"instance {self._instance} has no process {bounded(name)}")
        job = self._controls.submit(f"restart {name}", lambda: self._controls.controller.restart_process(name))
        return json.dumps(job.to_json())

    @export("s", "s", control=True)
    def Park(self, next_profile: str, dbus_context: Any = None) -> str:
        """Park this instance for the profile NEXT (issue 39): drained, liveness paused, its CUDA
        processes in host memory, its GPUs verified at their baseline. Returns a job as JSON; it
        ends `refused` (ParkRefused, exit 3) with the figures when it cannot be done."""
        job = self._controls.submit("park", lambda: self._controls.controller.park(next_profile))
        return json.dumps(job.to_json())

    @export("", "s", control=True)
    def Restore(self, dbus_context: Any = None) -> str:
        """The switch back to this parked instance: our instances on its GPUs stopped, the GPUs
        verified idle, restored and one generation answered (or started cold, said so). A job."""
        job = self._controls.submit("restore", self._controls.controller.restore)
        return json.dumps(job.to_json())

    @export("u", "s")
    def GetJob(self, job_id: int, dbus_context: Any = None) -> str:
        """A job's state ("running", "done", "refused", "failed") and reason, as JSON."""
        job = self._controls.job(int(job_id))
        if job is None:
            raise UnknownJob(f"instance {self._instance} has no job {int(job_id)} (the last 32 are kept)")
        data = job.to_json()
        if not self._privileged(dbus_context)[0]:
            data["reason"] = public_text(str(data.get("reason") or ""))
        return json.dumps(data)

    # ---------------------------------------------------------------- properties

    @property
    def Name(self) -> str:
        return self._instance

    @property
    def State(self) -> str:
        return self.state

    @property
    def StatusText(self) -> str:
        return self.status_text


SIGNALS = {names.SIGNAL_STATE_CHANGED: [("instance", "s"), ("process", "s"), ("state", "s"), ("message", "s")]}
PROPERTIES = {"Name": "s", "State": "s", "StatusText": "s"}
InstanceObject.dbus = introspection_xml(InstanceObject, names.INTERFACE, SIGNALS, PROPERTIES)  # type: ignore[attr-defined]
CONTROL_METHODS = tuple(n for n, (_i, _o, control) in exported_methods(InstanceObject).items() if control)


class BusService:
    """Owns the GLib thread, the bus name and signal emission for one instance.

    The connection is the process's BusLink (bus/link.py): when the bus goes away the servers
    run on, and once a new bus is up the object is registered and the name owned again there.
    """

    def __init__(self, instance: str, loop: asyncio.AbstractEventLoop, controls: Controls, control_group: str,
                 say: Callable[[str, int], None] | None = None, link: BusLink | None = None) -> None:
        from gi.repository import GLib

        self._GLib = GLib
        quiet_refusals()
        self.link = link if link is not None else system_bus()
        if say is not None:
            self.link.set_say(say)
        self.obj = InstanceObject(instance, loop, controls, control_group, self._caller_uid)
        self._registration: Any = None
        self._serve_on(self.link.con)  # the name taken or no bus: raised here, for start_bus to tell
        self.link.watch(self._serve_on)
        self._glib_loop = GLib.MainLoop()
        self._thread = threading.Thread(target=self._glib_loop.run, name="dbus", daemon=True)
        self._thread.start()
        self._on_close: list[Callable[[], Any]] = []

    @property
    def bus(self) -> Any:
        """The pydbus view of the current connection (what the object is registered on)."""
        return self._registration[0] if self._registration else None

    def _serve_on(self, con: Any) -> None:
        """Register the object, then own the name, on `con` (first start, and after each loss).
        The registration on a closed connection is dropped first: its signal hook would else
        try the dead connection on every emit."""
        from pydbus.bus import Bus

        self._drop_registration()
        bus = Bus(con)
        registration = bus.register_object(names.OBJECT_PATH, self.obj, None)
        try:
            self._request_name(con)
        except Exception:
            registration.unregister()
            raise
        self._registration = (bus, registration)

    def _drop_registration(self) -> None:
        if self._registration is None:
            return
        _bus, registration = self._registration
        self._registration = None
        try:
            registration.unregister()
        except Exception:
            pass  # the connection is gone, and the object with it

    def _request_name(self, con: Any) -> None:
        own_name(con, names.bus_name(self.obj.Name))

    def _dbus_call(self, con: Any, method: str, signature: str, args: tuple[Any, ...]) -> Any:
        GLib = self._GLib
        reply = con.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", method,
                              GLib.Variant(signature, args), None, 0, 5000, None)
        return reply.unpack()[0]

    def on_close(self, fn: Callable[[], Any]) -> None:
        self._on_close.append(fn)

    def _caller_uid(self, sender: str) -> int:
        return int(self._dbus_call(self.link.con, "GetConnectionUnixUser", "(s)", (sender,)))

    def publish(self, snapshot: dict[str, Any], status_text: str) -> None:
        """Called on the engine's loop: swap in the new snapshots (atomic reference swaps)."""
        self.obj.snapshot = json.dumps(snapshot)
        self.obj.public_snapshot = json.dumps(public_snapshot(snapshot))
        self.obj.status_text = public_text(status_text)  # a property: every local user reads it
        self.obj.state = snapshot.get("state", "")

    def emit(self, process: str, state: str, message: str) -> None:
        """A StateChanged signal: every local user may receive it, so the message is its first line."""
        instance = self.obj.Name
        message = public_text(message)

        def send() -> bool:
            try:
                self.obj.StateChanged(instance, process, state, message)
            except Exception:
                pass  # no bus just now: the snapshot still says it once the bus is back
            return False

        self._GLib.idle_add(send)

    def close(self) -> None:
        for fn in self._on_close:
            fn()
        self.link.close_watch(self._serve_on)
        con = self._registration[0].con if self._registration else None
        try:  # the name first, synchronously: callers then get ServiceUnknown, not a half-gone object
            if con is not None:
                self._dbus_call(con, "ReleaseName", "(s)", (names.bus_name(self.obj.Name),))
        except Exception:
            pass
        self._drop_registration()
        self._glib_loop.quit()
        self._thread.join(timeout=2)


def own_name(con: Any, name: str) -> None:
    """RequestName with DO_NOT_QUEUE (4): the name now or a BusError in plain words, as pydbus's
    publish() asked it. A refusal by the bus's policy is what a checkout without the .deb sees."""
    from gi.repository import GLib

    try:
        reply = con.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "RequestName",
                              GLib.Variant("(su)", (name, 4)), None, 0, 5000, None).unpack()[0]
    except Exception as e:
        if error_name(e) in DENIED:
            raise BusError(f"the system bus's policy does not let this daemon own {name} (the package "
                           "installs that policy: /usr/share/dbus-1/system.d/org.supervisordgpu.conf)") from None
        raise BusError(f"could not own {name}: {first_line(e)}") from None
    if reply != 1:
        raise BusError(f"bus name {name} is taken (RequestName answered {reply}: another daemon runs this instance)")
