"""One exception type per failure a person must act on, and the table that names them.

Each is caught at the edge (CLI, daemon start-up, D-Bus method) and printed as one line:
what went wrong, where, and what to do. The exit code travels with the exception so the
edge never has to guess it.

The same classes cross the bus (firewalld's lesson): the daemon answers a method with the
error's D-Bus name, org.supervisordgpu.Error.<class name> (`dbus_name`), and gpusupctl maps
that name back to the class (`error_for_name`), so it exits with the daemon's own code. The
name is the contract; the text is for people, and nothing decides on it.
"""

from __future__ import annotations

import os
from typing import ClassVar

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PRECONDITIONS = 3
EXIT_UNREACHABLE = 4
EXIT_TAKEOVER_FAILED = 5  # the unit lists it in RestartPreventExitStatus: see TakeoverFailed
#: the instance gave up: a process reached its restart limit, or a restart asked for over
#: D-Bus failed. Final like 2, 3 and 5 (RestartPreventExitStatus): systemd retrying would
#: only repeat a start that costs minutes and has just failed the same way.
EXIT_GAVE_UP = 6


#: every D-Bus error name of ours starts so (bus/errors.py's OURS says the same)
ERROR_PREFIX = "org.supervisordgpu.Error."


class SupervisorError(Exception):
    """Base of every error meant for a person; never shown with a traceback.

    `dbus_name` is ERROR_PREFIX + the class's name unless the class says otherwise;
    `from_message` rebuilds one from a remote error's text (a client has no constructor
    arguments, only the daemon's words)."""

    exit_code = EXIT_FAILED
    dbus_name: ClassVar[str] = ERROR_PREFIX + "SupervisorError"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "dbus_name" not in cls.__dict__:
            cls.dbus_name = ERROR_PREFIX + cls.__name__

    @classmethod
    def from_message(cls, message: str) -> SupervisorError:
        """The error as a client receives it: the class from its name, the daemon's text."""
        error = cls.__new__(cls)
        Exception.__init__(error, message)
        return error


class ConfigError(SupervisorError):
    """A daemon config or profile is wrong: names the file, the key and what is wrong."""

    exit_code = EXIT_USAGE

    def __init__(self, path: str | os.PathLike[str], key: str, problem: str) -> None:
        self.path = str(path)
        self.key = key
        self.problem = problem
        where = f"{one_line(self.path)}: {one_line(key)}: " if key else f"{one_line(self.path)}: "
        super().__init__(where + one_line(problem))

    @classmethod
    def from_message(cls, message: str) -> SupervisorError:
        error = super().from_message(message)
        assert isinstance(error, ConfigError)
        error.path, error.key, error.problem = "", "", message
        return error


def one_line(text: str) -> str:
    """Control characters escaped (a quoted TOML key may hold a newline): a message stays one line."""
    if all(ch >= " " and ch != "\x7f" for ch in text):
        return text
    return "".join(ch if ch >= " " and ch != "\x7f" else ch.encode("unicode_escape").decode() for ch in text)


class UsageError(SupervisorError):
    """A command line that cannot be acted on."""

    exit_code = EXIT_USAGE


class PreconditionError(SupervisorError):
    """GPUs not idle or ports not free; the message names every holder."""

    exit_code = EXIT_PRECONDITIONS


class StartError(SupervisorError):
    """A process did not become ready; says which, why, and its last lines."""

    exit_code = EXIT_FAILED


class TakeoverFailed(SupervisorError):
    """We stopped other instances to start, then failed (after rolling them back, if allowed).

    Its own exit code so the unit can tell systemd not to retry: an automatic retry would tear
    down again whatever the rollback brought back, and every round costs a full SGLang start.
    """

    exit_code = EXIT_TAKEOVER_FAILED


class OwnershipError(SupervisorError):
    """The cgroup machinery refused us (no writable cgroup v2, leftover cgroups, ...)."""

    exit_code = EXIT_FAILED


class BusError(SupervisorError):
    """The daemon or the bus cannot be reached."""

    exit_code = EXIT_UNREACHABLE


class OperationFailed(SupervisorError):
    """A start, stop or call that was accepted but did not succeed. `name`: the D-Bus error
    name when a bus call failed (bus/errors.py), what callers decide on, never the text."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str = "", name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    @classmethod
    def from_message(cls, message: str) -> SupervisorError:
        return cls(message, cls.dbus_name)


class PermissionDenied(SupervisorError):
    """A control call refused for the caller (not root, not in the control group). On the bus
    it is AccessDenied, the name the daemon has always answered with (bus/errors.py's DENIED)."""

    exit_code = EXIT_FAILED
    dbus_name = ERROR_PREFIX + "AccessDenied"


#: the bus's own word for it, as the daemon's D-Bus methods raise it
AccessDenied = PermissionDenied


class GaveUp(SupervisorError):
    """The instance gave up: a process reached its restart limit, or a restart asked for over
    D-Bus failed (EXIT_GAVE_UP: final, systemd does not retry it)."""

    exit_code = EXIT_GAVE_UP


class Busy(PreconditionError):
    """A control call while another job of the instance runs: refused, nothing touched; the
    message names the running job. Exit 3, as every refusal for what is held elsewhere."""


class UnknownProcess(UsageError):
    """A process name the instance does not have (or one too long to be one): exit 2."""


class UnknownJob(UsageError):
    """A job id the instance does not keep (never given, or older than the last 32)."""


class ArgumentTooLong(UsageError):
    """A D-Bus string argument over the limit (api/exports.py): said how long, never echoed."""


class UnitNotFound(SupervisorError):
    """systemd has no such unit (its org.freedesktop.systemd1.NoSuchUnit): not loaded now, or
    no unit file for it. A caller decides what that means: "nothing to reset" after a stop,
    "the package is not installed" for a start. Exit 3 where nobody decided otherwise."""

    exit_code = EXIT_PRECONDITIONS


class StartLimitHit(PreconditionError):
    """systemd itself refused the start: its start rate limit (StartLimitBurst= starts within
    StartLimitIntervalSec=) counts every start, those by hand included (unit Result
    "start-limit-hit"). Nothing of ours ran; the message says the way back."""


class ParkRefused(PreconditionError):
    """Parking a profile refused before anything was touched (host memory short, with the
    figures; nothing of it on the GPU; a port the next profile needs), or a park that failed
    and was undone (the profile serves again). Exit 3, as every refusal."""


#: Every error of ours, one row each: its D-Bus name (`dbus_name`) and its exit code
#: (`exit_code`). A D-Bus method raises these; `error_for_name` maps a remote name back.
#:
#:     ConfigError, UsageError, UnknownProcess, UnknownJob, ArgumentTooLong   2
#:     PreconditionError, Busy, StartLimitHit, UnitNotFound, ParkRefused      3
#:     BusError                                                               4
#:     TakeoverFailed                                                         5
#:     GaveUp                                                                 6
#:     StartError, OwnershipError, OperationFailed, PermissionDenied          1
ERRORS: tuple[type[SupervisorError], ...] = (
    ConfigError, UsageError, UnknownProcess, UnknownJob, ArgumentTooLong,
    PreconditionError, Busy, StartLimitHit, UnitNotFound, ParkRefused,
    BusError,
    TakeoverFailed,
    GaveUp,
    StartError, OwnershipError, OperationFailed, PermissionDenied,
)

_BY_NAME: dict[str, type[SupervisorError]] = {cls.dbus_name: cls for cls in ERRORS}


def error_for_name(name: str | None) -> type[SupervisorError] | None:
    """The class of a D-Bus error name from the table; None for any name not ours."""
    return _BY_NAME.get(name) if name else None
