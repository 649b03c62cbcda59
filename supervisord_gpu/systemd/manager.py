"""The one client of systemd's D-Bus API: calls, and waits that are events, never polls.

Every part that talks to systemd (gpusupctl's start/stop/restart/switch and status, the
daemon's takeover and rollback, the systemd ownership driver's scopes) goes through here.
runc's systemd manager is the model: start a job, then wait for systemd's own `JobRemoved`
for that job (its result says done, failed, canceled, ...) rather than polling unit state.

Calls go straight through the connection (no proxies: a pydbus proxy introspects first,
which doubles every call). A wait runs a GLib main context of its own in the calling thread,
so it works from gpusupctl's main thread and from the daemon's worker threads alike (the
daemon's event loop calls these through asyncio.to_thread and is never blocked). Signals
are accepted only from systemd's own bus name: any local user may emit a PropertiesChanged
or a JobRemoved for our unit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from ..records import dataclass
from typing import Any

from ..bus.errors import ALREADY_SUBSCRIBED, DENIED, NO_SUCH_UNIT, NO_UNIT_FOR_PID, error_name, remote_text
from ..errors import BusError, OperationFailed, PermissionDenied, UnitNotFound
from ..names import INSTANCE_NAME_RE, UNIT_PREFIX

BUS = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
JOB = "org.freedesktop.systemd1.Job"
CALL_TIMEOUT_MS = 25_000
#: how often a wait checks that its own connection is still open (a restart of the bus)
LOSS_CHECK_MS = 500

_INSTANCE_UNIT = re.compile(rf"^{UNIT_PREFIX}@(?P<instance>[^/]+)\.service\Z")


@dataclass
class UnitInfo:
    """One dsv4@ instance as systemd sees it."""

    instance: str
    unit: str
    load: str
    active: str
    sub: str
    since_us: int = 0
    status_text: str = ""
    result: str = ""
    main_pid: int = 0


@dataclass(frozen=True)
class JobResult:
    """How a job ended: systemd's result ("done", "failed", "canceled", "timeout", "dependency",
    "skipped"), or "timeout-waiting" when we stopped waiting first."""

    unit: str
    job: str
    result: str

    @property
    def done(self) -> bool:
        return self.result == "done"


def instance_of_unit(name: str) -> str | None:
    """The instance of a dsv4@NAME.service unit name, exactly (the template itself is not one)."""
    m = _INSTANCE_UNIT.match(name)
    return m["instance"] if m and INSTANCE_NAME_RE.match(m["instance"]) else None


def connect() -> Any:
    """The system bus connection, or BusError saying why not (exit code 4).

    The process's BusLink (bus/link.py), not GLib's shared connection: that one raises SIGTERM
    in the daemon when the bus restarts, and stays closed for good afterwards.
    """
    from ..bus.link import system_bus

    return system_bus().con


class Systemd:
    """systemd's manager over the system bus. Thread-safe (GDBus connections are).

    Without a connection given, `con` is always the process's current one: after a restart of
    the bus, the next call goes through the new connection.
    """

    def __init__(self, connection: Any | None = None) -> None:
        self._fixed = connection
        if connection is None:
            connect()  # BusError now, not at the first call

    @property
    def con(self) -> Any:
        return self._fixed if self._fixed is not None else connect()

    # ------------------------------------------------------------------ calls

    def call(self, path: str, iface: str, method: str, signature: str | None = None, args: tuple = (),
             timeout_ms: int = CALL_TIMEOUT_MS) -> tuple:
        from gi.repository import GLib

        params = GLib.Variant(f"({signature})", args) if signature else None
        try:
            reply = self.con.call_sync(BUS, path, iface, method, params, None, 0, timeout_ms, None)
        except GLib.Error as e:
            text, name = remote_text(e), error_name(e)  # systemd's words, without GLib's "GDBus.Error:NAME: "
            what = f"{method} of {args[0]}" if args and isinstance(args[0], str) and iface == MANAGER else method
            if name in DENIED:
                raise PermissionDenied(f"{what} refused: {text}") from None
            if name == NO_SUCH_UNIT:
                raise UnitNotFound(text) from None
            raise OperationFailed(f"{what} failed: {text}", name) from None
        return tuple(reply.unpack()) if reply is not None else ()

    def manager(self, method: str, signature: str | None = None, args: tuple = ()) -> tuple:
        return self.call(PATH, MANAGER, method, signature, args)

    def get(self, path: str, iface: str, prop: str) -> Any:
        """One property (Get, not GetAll: a unit's GetAll unpacks hundreds of them, ~5 ms a unit)."""
        return self.call(path, PROPERTIES, "Get", "ss", (iface, prop))[0]

    def unit_path(self, unit: str) -> str | None:
        """The object path of a loaded unit, None if systemd does not know it now."""
        try:
            return str(self.manager("GetUnit", "s", (unit,))[0])
        except UnitNotFound:
            return None

    def load_unit(self, unit: str) -> str:
        return str(self.manager("LoadUnit", "s", (unit,))[0])

    def kill(self, unit: str, signal: int, whom: str = "all") -> None:
        self.manager("KillUnit", "ssi", (unit, whom, int(signal)))

    def reset_failed(self, unit: str) -> None:
        try:
            self.manager("ResetFailedUnit", "s", (unit,))
        except (UnitNotFound, OperationFailed):
            pass  # not failed, or already collected

    def reset_failed_unit(self, unit: str) -> None:
        """ResetFailedUnit, its refusal said (PermissionDenied, OperationFailed): polkit's verb
        "reset-failed". Also on an active service: NRestarts and the start rate limit go to 0."""
        self.manager("ResetFailedUnit", "s", (unit,))

    def unit_of_pid(self, pid: int) -> str | None:
        """The object path of the unit `pid` belongs to, None if systemd knows no unit for it."""
        try:
            return str(self.manager("GetUnitByPID", "u", (pid,))[0])
        except UnitNotFound:
            return None
        except OperationFailed as e:
            if e.name == NO_UNIT_FOR_PID:
                return None
            raise

    def unit_id(self, path: str) -> str:
        return str(self.get(path, UNIT, "Id"))

    def active_state(self, unit: str) -> str | None:
        """ActiveState of a loaded unit, None if systemd does not know it now."""
        path = self.unit_path(unit)
        return str(self.get(path, UNIT, "ActiveState")) if path else None

    def n_restarts(self, path: str) -> int:
        """A service's automatic restarts since its last start by hand or reset-failed."""
        return int(self.get(path, SERVICE, "NRestarts"))

    def start_limit_interval_usec(self, path: str) -> int:
        return int(self.get(path, UNIT, "StartLimitIntervalUSec"))

    def units_named(self, names: Iterable[str]) -> list[tuple[str, str, str, str]]:
        """(name, load state, active state, object path) of exactly these units."""
        rows = self.manager("ListUnitsByNames", "as", (list(names),))[0]
        return [(r[0], r[2], r[3], r[6]) for r in rows]

    def instances(self) -> list[UnitInfo]:
        """Every loaded dsv4@ instance, running or not (by exact unit name, not a pattern)."""
        out = []
        for row in self.manager("ListUnits")[0]:
            name, _desc, load, active, sub, _follow, path = row[:7]
            instance = instance_of_unit(name)
            if instance is None:
                continue
            info = UnitInfo(instance, name, load, active, sub)
            try:
                stamp = "ActiveEnterTimestamp" if active == "active" else "StateChangeTimestamp"
                info.since_us = int(self.get(path, UNIT, stamp))
                info.status_text = str(self.get(path, SERVICE, "StatusText"))
                info.result = str(self.get(path, SERVICE, "Result"))
                info.main_pid = int(self.get(path, SERVICE, "MainPID"))
            except (OperationFailed, UnitNotFound):
                pass
            out.append(info)
        return out

    def instance(self, instance: str) -> UnitInfo | None:
        return next((u for u in self.instances() if u.instance == instance), None)

    # ------------------------------------------------------------------ jobs, waited for by event

    def subscribe(self) -> None:
        """Ask systemd for its job and unit signals (it sends them only while someone asked)."""
        try:
            self.manager("Subscribe")
        except OperationFailed as e:
            if e.name not in ALREADY_SUBSCRIBED:
                raise

    def run_job(self, method: str, unit: str, args: tuple = ("replace",), signature: str = "ss", timeout: float = 900.0,
                on_status: Callable[[str], None] | None = None,
                extra: Callable[[Any], list[int]] | None = None) -> JobResult:
        """Call a job-returning Manager method (StartUnit, StopUnit, RestartUnit, StartTransientUnit)
        and wait for systemd's JobRemoved of that very job.

        The subscription is made before the call, so a job that ends at once is not missed.
        `on_status` hears the unit's StatusText as it changes; `extra(connection)` may add
        subscriptions of its own (their ids are returned and removed afterwards).
        """
        from gi.repository import Gio, GLib

        ctx = GLib.MainContext.new()
        ctx.push_thread_default()
        loop = GLib.MainLoop(ctx)
        ended: dict[str, str] = {}
        wanted: dict[str, str] = {}

        def job_removed(_con, _sender, _path, _iface, _signal, params) -> None:
            _id, job, _unit, result = params.unpack()
            ended[job] = result
            if wanted.get("job") == job:
                loop.quit()

        def changed(_con, _sender, _path, _iface, _signal, params) -> None:
            iface, props, _invalidated = params.unpack()
            if on_status is not None and iface == SERVICE and props.get("StatusText"):
                on_status(str(props["StatusText"]))

        def subscribe_on(con: Any) -> list[tuple[Any, int]]:
            subs = [(con, con.signal_subscribe(BUS, MANAGER, "JobRemoved", PATH, None, Gio.DBusSignalFlags.NONE, job_removed))]
            if unit_path is not None:
                subs.append((con, con.signal_subscribe(BUS, PROPERTIES, "PropertiesChanged", unit_path, None,
                                                       Gio.DBusSignalFlags.NONE, changed)))
            if extra is not None:
                subs += [(con, sub) for sub in extra(con)]
            return subs

        subs: list[tuple[Any, int]] = []
        try:
            unit_path = self.load_unit(unit) if on_status is not None else None
            subs += subscribe_on(self.con)
            self.subscribe()
            job = str(self.manager(method, signature, (unit, *args))[0])
            if job not in ended:
                wanted["job"] = job
                timer = GLib.timeout_source_new(int(timeout * 1000))
                timer.set_callback(lambda *_a: (loop.quit(), False)[1])
                timer.attach(ctx)
                watch = GLib.timeout_source_new(LOSS_CHECK_MS)
                watch.set_callback(lambda *_a: self._through_a_loss(subs, subscribe_on, job, method, unit, ended, loop))
                watch.attach(ctx)
                loop.run()
                timer.destroy()
                watch.destroy()
            return JobResult(unit, job, ended.get(job, "timeout-waiting"))
        finally:
            for con, sub in subs:
                con.signal_unsubscribe(sub)
            ctx.pop_thread_default()

    def _through_a_loss(self, subs: list[tuple[Any, int]], subscribe_on: Callable[[Any], list[tuple[Any, int]]],
                        job: str, method: str, unit: str, ended: dict[str, str], loop: Any) -> bool:
        """A wait's check that its connection is still open (a flag of our own, not a poll of
        systemd). The bus restarted: the job's JobRemoved would go to the dead connection, so
        subscribe again on the new one, then ask whether the job ended while we were away."""
        if not subs or not subs[0][0].is_closed():
            return True
        try:
            fresh = subscribe_on(self.con)
        except (BusError, OperationFailed):
            return True  # the bus still down: look again at the next tick
        subs[:0] = fresh
        try:
            self.subscribe()
            outcome = self._outcome_if_gone(job, method, unit)
        except (BusError, OperationFailed, UnitNotFound):
            return True
        if outcome is not None:
            ended[job] = outcome
            loop.quit()
        return True

    def _outcome_if_gone(self, job: str, method: str, unit: str) -> str | None:
        """None while the job is still queued or running; once it is gone, what its unit's state
        says of it (systemd's own result went to a connection that no longer exists)."""
        try:
            self.get(job, JOB, "State")
            return None
        except (OperationFailed, UnitNotFound):
            pass
        state = str(self.get(self.load_unit(unit), UNIT, "ActiveState"))
        wanted = ("inactive", "failed") if method == "StopUnit" else ("active", "reloading")
        return "done" if state in wanted else "failed"

    def start(self, unit: str, **kw: Any) -> JobResult:
        return self.run_job("StartUnit", unit, **kw)

    def stop(self, unit: str, **kw: Any) -> JobResult:
        return self.run_job("StopUnit", unit, **kw)

    def restart(self, unit: str, **kw: Any) -> JobResult:
        return self.run_job("RestartUnit", unit, **kw)

    def queue(self, method: str, unit: str) -> str:
        """Queue a job and return at once (`gpusupctl start` without --wait)."""
        return str(self.manager(method, "ss", (unit, "replace"))[0])

    def start_transient(self, unit: str, properties: list[tuple[str, Any]], timeout: float = 30.0) -> JobResult:
        """StartTransientUnit(name, "fail", properties, []) and wait for its job."""
        return self.run_job("StartTransientUnit", unit, ("fail", properties, []), signature="ssa(sv)a(sa(sv))",
                            timeout=timeout)

    def stop_and_forget(self, unit: str, timeout: float = 30.0) -> None:
        """Stop a unit if systemd knows it, wait for the stop, reset a failed state."""
        if self.unit_path(unit) is None:
            return
        self.stop(unit, timeout=timeout)
        self.reset_failed(unit)
