"""The client side: systemd's view of dsv4@ units, and each running instance's own API.

gpusupctl goes through systemd for start/stop/restart (so the unit's state stays the truth)
and through the instance's bus name for the details only the daemon knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import BusError, OperationFailed, PermissionDenied
from ..ownership.names import SERVICE_TEMPLATE, UNIT_PREFIX, service_name
from . import names


@dataclass
class UnitInfo:
    instance: str
    unit: str
    load: str
    active: str
    sub: str
    since_us: int = 0
    status_text: str = ""
    result: str = ""


def call(bus, dest: str, path: str, iface: str, method: str, signature: str | None = None, args: tuple = (),  # type: ignore[no-untyped-def,type-arg]
         timeout_ms: int = 5000):
    """One method call without a proxy: pydbus proxies introspect first, which doubles every call."""
    from gi.repository import GLib

    params = GLib.Variant(f"({signature})", args) if signature else None
    reply = bus.con.call_sync(dest, path, iface, method, params, None, 0, timeout_ms, None)
    return reply.unpack()


def connect():  # type: ignore[no-untyped-def]
    """The system bus, or BusError saying why not (exit code 4)."""
    try:
        from pydbus import SystemBus

        return SystemBus()
    except Exception as e:
        raise BusError(f"system bus not reachable: {str(e).splitlines()[0] if str(e) else e.__class__.__name__}") from e


class SystemdClient:
    def __init__(self, bus) -> None:  # type: ignore[no-untyped-def]
        self.bus = bus
        self._manager = None

    @property
    def manager(self):  # type: ignore[no-untyped-def]
        """A proxy for the calls that need one (it costs an introspection: the read path avoids it)."""
        if self._manager is None:
            try:
                self._manager = self.bus.get(names.SYSTEMD_BUS, names.SYSTEMD_PATH)
            except Exception as e:
                raise BusError(f"systemd not reachable over D-Bus: {str(e).splitlines()[0]}") from e
        return self._manager

    def units(self) -> list[UnitInfo]:
        """Every loaded dsv4@ instance, running or not."""
        out = []
        try:
            units = call(self.bus, names.SYSTEMD_BUS, names.SYSTEMD_PATH, "org.freedesktop.systemd1.Manager",
                         "ListUnitsByPatterns", "asas", ([], [f"{UNIT_PREFIX}@*.service"]))[0]
        except Exception as e:
            raise BusError(f"systemd not reachable over D-Bus: {str(e).splitlines()[0]}") from e
        for unit in units:
            name, _desc, load, active, sub, _follow, path = unit[:7]
            if name == SERVICE_TEMPLATE:
                continue
            instance = name[len(UNIT_PREFIX) + 1 : -len(".service")]
            info = UnitInfo(instance, name, load, active, sub)
            try:
                stamp = "ActiveEnterTimestamp" if active == "active" else "StateChangeTimestamp"
                info.since_us = int(self._prop(path, "Unit", stamp))
                info.status_text = str(self._prop(path, "Service", "StatusText"))
                info.result = str(self._prop(path, "Service", "Result"))
            except Exception:
                pass
            out.append(info)
        return out

    def _prop(self, path: str, iface: str, prop: str):  # type: ignore[no-untyped-def]
        """One property (Get, not GetAll: a unit's GetAll unpacks hundreds of them, ~5 ms a unit)."""
        return call(self.bus, names.SYSTEMD_BUS, path, "org.freedesktop.DBus.Properties", "Get", "ss",
                    (f"org.freedesktop.systemd1.{iface}", prop))[0]

    def unit(self, instance: str) -> UnitInfo | None:
        for info in self.units():
            if info.instance == instance:
                return info
        return None

    def start(self, instance: str) -> str:
        return self._job("StartUnit", instance)

    def stop(self, instance: str) -> str:
        return self._job("StopUnit", instance)

    def restart(self, instance: str) -> str:
        return self._job("RestartUnit", instance)

    def _job(self, method: str, instance: str) -> str:
        try:
            return str(getattr(self.manager, method)(service_name(instance), "replace"))
        except Exception as e:
            text = str(e).splitlines()[0]
            if "AccessDenied" in text or "Interactive authentication required" in text:
                raise PermissionDenied(f"{method} of {service_name(instance)} refused: {text}") from e
            raise OperationFailed(f"{method} of {service_name(instance)} failed: {text}") from e


class InstanceClient:
    def __init__(self, bus, instance: str) -> None:  # type: ignore[no-untyped-def]
        self.instance = instance
        self.bus = bus
        self._proxy = None

    @property
    def proxy(self):  # type: ignore[no-untyped-def]
        if self._proxy is None:
            try:
                self._proxy = self.bus.get(names.bus_name(self.instance), names.OBJECT_PATH)
            except Exception as e:
                raise BusError(f"daemon of {self.instance} not answering on {names.bus_name(self.instance)}: "
                               f"{str(e).splitlines()[0]}") from e
        return self._proxy

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(call(self.bus, names.bus_name(self.instance), names.OBJECT_PATH, names.INTERFACE, "GetStatus")[0])
        except Exception as e:
            raise BusError(f"daemon of {self.instance} not answering on {names.bus_name(self.instance)}: "
                           f"{str(e).splitlines()[0]}") from e

    def call(self, method: str, *args: str) -> str:
        try:
            return str(getattr(self.proxy, method)(*args))
        except Exception as e:
            text = str(e).splitlines()[0]
            if "AccessDenied" in text:
                raise PermissionDenied(text) from e
            raise OperationFailed(text) from e



def follow(bus, instance: str, action: str, timeout: float, show) -> str:  # type: ignore[no-untyped-def]
    """Start/stop/restart the unit and follow it live by signals until it settles; return its final state.

    systemd's PropertiesChanged on the unit (ActiveState, StatusText) and the daemon's
    StateChanged carry every step, so nothing here polls.
    """
    import time

    from gi.repository import GLib

    sd = SystemdClient(bus)
    unit = service_name(instance)
    path = sd.manager.LoadUnit(unit)
    loop = GLib.MainLoop()
    began = time.monotonic()
    outcome = {"state": "timeout"}
    want = {"start": ("active",), "restart": ("active",), "stop": ("inactive",)}[action]

    def stamp() -> str:
        return f"{time.monotonic() - began:6.1f}s"

    def on_unit(_sender, _obj, _iface, _signal, params) -> None:  # type: ignore[no-untyped-def]
        _iface_name, changed, _invalidated = params
        if "StatusText" in changed and changed["StatusText"]:
            show(f"{stamp()}  {changed['StatusText']}")
        state = changed.get("ActiveState")
        if state is not None:
            show(f"{stamp()}  {unit}: {state}")
            if state in want or state == "failed" or (state == "inactive" and action != "stop" and seen_activating[0]):
                outcome["state"] = state
                loop.quit()
            if state in ("activating", "reloading"):
                seen_activating[0] = True

    def on_instance(_sender, _obj, _iface, _signal, params) -> None:  # type: ignore[no-untyped-def]
        inst, process, state, message = params
        if inst == instance and process:
            show(f"{stamp()}    {process}: {message}")

    seen_activating = [False]
    # Only from their real senders: any local user may emit a PropertiesChanged for our unit's
    # path or a StateChanged; the bus delivers a match on a well-known name only from its owner.
    subs = [
        bus.subscribe(sender=names.SYSTEMD_BUS, object=path, iface="org.freedesktop.DBus.Properties",
                      signal="PropertiesChanged", signal_fired=on_unit),
        bus.subscribe(sender=names.bus_name(instance), object=names.OBJECT_PATH, iface=names.INTERFACE,
                      signal=names.SIGNAL_STATE_CHANGED, signal_fired=on_instance),
    ]
    GLib.timeout_add(int(timeout * 1000), loop.quit)
    getattr(sd, action)(instance)
    current = str(bus.get(names.SYSTEMD_BUS, path).ActiveState)
    if current in want and action == "stop":
        outcome["state"] = current
    else:
        loop.run()
    for sub in subs:
        sub.unsubscribe()
    if outcome["state"] == "timeout":
        outcome["state"] = str(bus.get(names.SYSTEMD_BUS, path).ActiveState)
    return outcome["state"]
