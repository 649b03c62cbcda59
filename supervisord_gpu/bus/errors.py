"""D-Bus errors read by their names, not by their text.

GLib hands a remote error over as a GLib.Error whose message reads
"GDBus.Error:org.freedesktop.systemd1.NoSuchUnit: Unit x.service not loaded.". The name is the
contract; the text is for people and may say anything (a unit's description, a polkit
message). Matching substrings of the text took "AccessDenied" anywhere in a message for a
refusal; here each kind is a set of names, and both clients (systemd/manager.py,
api/client.py) ask this module what an error is. Our own daemon's names are the table of
errors.py: `ours` turns one back into its class, with the daemon's first line as its text.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from ..errors import ERROR_PREFIX, SupervisorError, error_for_name

DBUS = "org.freedesktop.DBus.Error."
SYSTEMD = "org.freedesktop.systemd1."
OURS = ERROR_PREFIX

#: refused: by the bus policy, by systemd or polkit, or by our own daemon's check
DENIED = frozenset({
    DBUS + "AccessDenied", DBUS + "InteractiveAuthorizationRequired", DBUS + "AuthFailed",
    "org.freedesktop.PolicyKit1.Error.NotAuthorized", OURS + "AccessDenied",
})
#: nobody answered: no such name on the bus, or no reply in time
NOT_ANSWERING = frozenset({
    DBUS + "ServiceUnknown", DBUS + "NameHasNoOwner", DBUS + "NoReply", DBUS + "Timeout", DBUS + "TimedOut",
    DBUS + "Disconnected",
})
NO_SUCH_UNIT = SYSTEMD + "NoSuchUnit"
NO_UNIT_FOR_PID = SYSTEMD + "NoUnitForPID"
#: a second Subscribe from one connection (older systemd said FileExists)
ALREADY_SUBSCRIBED = frozenset({SYSTEMD + "AlreadySubscribed", DBUS + "FileExists"})


def error_name(e: BaseException) -> str | None:
    """The D-Bus error name of a GLib.Error from a call; a local timeout or a closed
    connection as the bus's own names; None for anything else."""
    try:
        from gi.repository import Gio, GLib
    except ImportError:
        return None
    if not isinstance(e, GLib.Error):
        return None
    remote: Any = Gio.DBusError.get_remote_error(e)
    if remote:
        return str(remote)
    if e.matches(Gio.io_error_quark(), Gio.IOErrorEnum.TIMED_OUT):
        return DBUS + "Timeout"
    if e.matches(Gio.io_error_quark(), Gio.IOErrorEnum.CLOSED):
        return DBUS + "Disconnected"
    return None


_WIRE: dict[type[SupervisorError], type[SupervisorError]] = {}


def on_the_wire(error: SupervisorError) -> SupervisorError:
    """The same error, for pydbus to answer with: pydbus takes the exception class's __name__
    as the D-Bus error name, so this is `error` re-classed to a subclass of its own class whose
    __name__ is its `dbus_name` (made once per class). Its text and attributes stay."""
    cls = type(error)
    if cls.__name__ == cls.dbus_name:
        return error
    twin = _WIRE.get(cls)
    if twin is None:
        twin = _WIRE[cls] = type(cls.dbus_name, (cls,), {"dbus_name": cls.dbus_name, "__module__": cls.__module__})
    wire = copy.copy(error)
    wire.__class__ = twin
    return wire


def ours(e: BaseException) -> SupervisorError | None:
    """A remote error our daemon answered with, as the class of its name (errors.py's table),
    its text the daemon's first line; None for any other error (systemd's, the bus's, a name
    from a newer daemon this client does not know)."""
    cls = error_for_name(error_name(e))
    return cls.from_message(remote_text(e)) if cls is not None else None


def remote_text(e: BaseException) -> str:
    """The first line of what the remote side said, without GLib's "GDBus.Error:NAME: " before it."""
    text, name = first_line(e), error_name(e)
    prefix = f"GDBus.Error:{name}: "
    return text[len(prefix):] if name and text.startswith(prefix) else text


def first_line(e: BaseException) -> str:
    """The first line of an error's text in plain words. A local GLib error reads
    "g-io-error-quark: Could not connect: No such file or directory (1)": the domain and the
    code are for programs, the words between them are what an operator reads."""
    text = str(e)
    line = text.splitlines()[0] if text else e.__class__.__name__
    return _GERROR.sub(r"\1", line)


_GERROR = re.compile(r"^[a-z0-9-]+-quark: (.*?)(?: \(\d+\))?$")
