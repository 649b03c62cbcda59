"""The system-bus connection of this process: one that outlives a restart of the bus.

GLib's shared system-bus connection (Gio.bus_get_sync, pydbus's SystemBus) has exit-on-close
on: when dbus-daemon goes away (restarted, or dbus-broker reloaded) GLib raises SIGTERM in the
process, and the daemon then stopped every server and exited 0, which Restart=on-failure never
restarts. And once closed, GLib keeps handing out that same dead connection. So the link holds
a private connection of its own with exit-on-close off, and replaces it when it closes:

- lazily: `con` opens a new one when the current one is closed (any thread, no main loop);
- actively, once `watch()`ed: on the connection's "closed" signal it retries with a backoff
  (0.5 s doubling to 5 s) and hands the new connection to every watcher, which re-owns its
  name, re-registers its objects, re-subscribes its signals. That runs in GLib's default main
  context: the daemon's D-Bus thread (api/service.py) runs it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import BusError
from .errors import first_line as _first_line

Say = Callable[[str, int], None]
BACKOFF_S = (0.5, 5.0)




def open_connection() -> Any:
    """A new private connection to the system bus with exit-on-close off, or BusError.

    Made in a thread of its own when the caller has pushed a main context (a wait in
    systemd/manager.py does): a connection emits "closed" in the context current at its
    making, and that must be the default one, which outlives the wait.
    """
    try:
        from gi.repository import GLib
    except ImportError as e:  # a bare GPU box without PyGObject: no bus, said as such (exit 4)
        raise BusError(f"system bus not reachable: the D-Bus bindings are not installed "
                       f"(apt install python3-gi): {_first_line(e)}") from None

    if GLib.MainContext.get_thread_default() is None:
        return _open_here()
    made: dict[str, Any] = {}

    def open_there() -> None:
        try:
            made["con"] = _open_here()
        except BusError as e:
            made["error"] = e

    helper = threading.Thread(target=open_there, name="dbus-connect")
    helper.start()
    helper.join()
    if "error" in made:
        raise made["error"]
    return made["con"]


def _open_here() -> Any:
    from gi.repository import Gio

    flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
    try:
        address = Gio.dbus_address_get_for_bus_sync(Gio.BusType.SYSTEM, None)
        con = Gio.DBusConnection.new_for_address_sync(address, flags, None, None)
    except Exception as e:
        raise BusError(f"system bus not reachable: {_first_line(e)}") from e
    con.set_exit_on_close(False)
    return con


class BusLink:
    """The current system-bus connection, replaced whenever the bus daemon goes away."""

    def __init__(self, say: Say | None = None, backoff: tuple[float, float] = BACKOFF_S) -> None:
        self._lock = threading.Lock()
        self._con: Any = None
        self._say = say
        self._backoff = backoff
        self._watchers: list[Callable[[Any], None]] = []
        self._retrying = False
        self._closed = False

    @property
    def con(self) -> Any:
        """The open connection; a new one if the last has closed (BusError if the bus is down)."""
        with self._lock:
            if self._con is None or self._con.is_closed():
                self._con = open_connection()
                self._con.connect("closed", self._on_closed)
            return self._con

    def set_say(self, say: Say) -> None:
        """Where "lost" and "back" are told (the daemon's journal), once the daemon has one."""
        self._say = say

    def watch(self, back: Callable[[Any], None]) -> None:
        """Reconnect actively from now on, and call `back(connection)` in the GLib thread each
        time a new connection is up after a loss (to re-own names, re-register, re-subscribe)."""
        self._watchers.append(back)

    def close_watch(self, back: Callable[[Any], None]) -> None:
        """No more `back` calls (its owner is closing); with no watcher left, no more retrying."""
        if back in self._watchers:
            self._watchers.remove(back)

    def close(self) -> None:
        """Stop reconnecting and close the connection (the daemon is exiting)."""
        self._closed = True
        self._watchers.clear()
        with self._lock:
            con, self._con = self._con, None
        if con is not None and not con.is_closed():
            con.close_sync(None)

    # ------------------------------------------------------------------ losing and finding the bus

    def _tell(self, message: str, priority: int) -> None:
        if self._say is not None:
            self._say(message, priority)

    def _on_closed(self, con: Any, _remote_vanished: bool, error: Any) -> None:
        """The connection's "closed" (default main context): start retrying, once per loss."""
        if self._closed or not self._watchers or self._retrying:
            return
        why = error.message if error is not None else "closed"
        self._tell(f"system bus lost ({why}); servers keep running, reconnecting", 4)
        self._retrying = True
        self._retry_in(self._backoff[0])

    def _retry_in(self, delay: float) -> None:
        from gi.repository import GLib

        GLib.timeout_add(int(delay * 1000), self._retry, delay)

    def _retry(self, delay: float) -> bool:
        if self._closed:
            self._retrying = False
            return False
        try:
            con = self.con
            for back in list(self._watchers):
                back(con)
        except Exception as e:  # the bus still down, or gone again while we re-registered
            if not isinstance(e, BusError):
                self._tell(f"system bus: reconnecting failed ({_first_line(e)}); retrying", 4)
            self._retry_in(min(delay * 2, self._backoff[1]))
            return False
        self._retrying = False
        self._tell(f"system bus back (as {con.get_unique_name()}); D-Bus API served again", 5)
        return False


_shared: BusLink | None = None
_shared_lock = threading.Lock()


def system_bus() -> BusLink:
    """This process's one link (the daemon's bus service and its systemd client share it)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BusLink()
        return _shared
