"""D-Bus errors are read by name (bus/errors.py): a refusal is a refusal because systemd, polkit,
the bus or our daemon named it so, never because its text contains a word. The clients' use
of it runs against a real dbus-daemon in test_dbus.py and a real systemd in the systemd tests."""

from __future__ import annotations

import pytest

gi = pytest.importorskip("gi")
from gi.repository import Gio, GLib  # noqa: E402

from supervisord_gpu.bus import errors  # noqa: E402
from supervisord_gpu.errors import OperationFailed, PermissionDenied, UnitNotFound  # noqa: E402
from supervisord_gpu.systemd.manager import Systemd  # noqa: E402


def remote(name: str, text: str) -> GLib.Error:
    return Gio.DBusError.new_for_dbus_error(name, text)


def test_a_remote_error_is_known_by_its_name_whatever_its_text_says():
    e = remote("org.freedesktop.systemd1.NoSuchUnit", "Unit AccessDenied.service not loaded.")
    assert errors.error_name(e) == errors.NO_SUCH_UNIT
    assert errors.error_name(e) not in errors.DENIED  # the word in the text does not make it a refusal
    assert errors.first_line(e).endswith("Unit AccessDenied.service not loaded.")


def test_local_glib_errors_get_the_bus_names_of_what_they_mean():
    timeout = GLib.Error.new_literal(Gio.io_error_quark(), "Timeout was reached", Gio.IOErrorEnum.TIMED_OUT)
    closed = GLib.Error.new_literal(Gio.io_error_quark(), "The connection is closed", Gio.IOErrorEnum.CLOSED)
    other = GLib.Error.new_literal(Gio.io_error_quark(), "No such file", Gio.IOErrorEnum.NOT_FOUND)
    assert errors.error_name(timeout) in errors.NOT_ANSWERING and errors.error_name(closed) in errors.NOT_ANSWERING
    assert errors.error_name(other) is None and errors.error_name(ValueError("x")) is None
    assert errors.first_line(other) == "No such file"  # GLib's domain and code gone


class Refusing:
    """A connection whose every call fails with one GLib.Error (what systemd answered)."""

    def __init__(self, error: GLib.Error) -> None:
        self.error = error

    def call_sync(self, *_args):  # type: ignore[no-untyped-def]
        raise self.error


@pytest.mark.parametrize("name", sorted(errors.DENIED))
def test_systemd_refusals_by_any_denying_name_are_permission_denied(name):
    with pytest.raises(PermissionDenied, match="StartUnit of dsv4@x.service refused"):
        Systemd(Refusing(remote(name, "whatever the text"))).manager("StartUnit", "ss", ("dsv4@x.service", "replace"))


def test_a_systemd_failure_keeps_its_name_for_the_caller_and_a_missing_unit_is_unit_not_found():
    failing = Systemd(Refusing(remote("org.freedesktop.systemd1.UnitMasked", "Unit dsv4@x.service is masked.")))
    with pytest.raises(OperationFailed) as e:
        failing.manager("StartUnit", "ss", ("dsv4@x.service", "replace"))
    assert e.value.name == "org.freedesktop.systemd1.UnitMasked" and "is masked" in str(e.value)
    missing = Systemd(Refusing(remote(errors.NO_SUCH_UNIT, "Unit dsv4@x.service not loaded.")))
    with pytest.raises(UnitNotFound, match="^Unit dsv4@x.service not loaded.$") as gone:
        missing.manager("StartUnit", "ss", ("dsv4@x.service", "replace"))
    assert not isinstance(gone.value, LookupError)  # ours, by name: never the built-in that leaked into the CLI
    assert missing.unit_path("dsv4@x.service") is None
    assert Systemd(Refusing(remote(errors.NO_UNIT_FOR_PID, "PID 1 does not belong to any loaded unit."))).unit_of_pid(1) is None
    for name in sorted(errors.ALREADY_SUBSCRIBED):
        Systemd(Refusing(remote(name, "Client is already subscribed."))).subscribe()  # not an error
    with pytest.raises(OperationFailed):
        Systemd(Refusing(remote("org.freedesktop.DBus.Error.Failed", "already subscribed, says the text"))).subscribe()
