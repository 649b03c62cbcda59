"""D-Bus errors read by their names, not by their text.

GLib hands a remote error over as a GLib.Error whose message reads
"GDBus.Error:org.freedesktop.systemd1.NoSuchUnit: Unit x.service not loaded.". The name is the
contract; the text is for people and may say anything (a unit's description, a polkit
message). Matching substrings of the text took "AccessDenied" anywhere in a message for a
refusal; here each kind is a set of names, and both clients (systemd/manager.py,
api/client.py) ask this module what an error is.
"""

from __future__ import annotations

import re
from typing import Any

DBUS = "org.freedesktop.DBus.Error."
SYSTEMD = "org.freedesktop.systemd1."
OURS = "org.supervisordgpu.Error."

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


def first_line(e: BaseException) -> str:
    """The first line of an error's text in plain words. A local GLib error reads
    "g-io-error-quark: Could not connect: No such file or directory (1)": the domain and the
    code are for programs, the words between them are what an operator reads."""
    text = str(e)
    line = text.splitlines()[0] if text else e.__class__.__name__
    return _GERROR.sub(r"\1", line)


_GERROR = re.compile(r"^[a-z0-9-]+-quark: (.*?)(?: \(\d+\))?$")
