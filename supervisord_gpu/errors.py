"""One exception type per failure a person must act on.

Each is caught at the edge (CLI, daemon start-up, D-Bus method) and printed as one line:
what went wrong, where, and what to do. The exit code travels with the exception so the
edge never has to guess it.
"""

from __future__ import annotations

import os

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


class SupervisorError(Exception):
    """Base of every error meant for a person; never shown with a traceback."""

    exit_code = EXIT_FAILED


class ConfigError(SupervisorError):
    """A daemon config or profile is wrong: names the file, the key and what is wrong."""

    exit_code = EXIT_USAGE

    def __init__(self, path: str | os.PathLike[str], key: str, problem: str) -> None:
        self.path = str(path)
        self.key = key
        self.problem = problem
        where = f"{one_line(self.path)}: {one_line(key)}: " if key else f"{one_line(self.path)}: "
        super().__init__(where + one_line(problem))


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


class PermissionDenied(SupervisorError):
    """A control call refused for the caller (not root, not in the control group)."""

    exit_code = EXIT_FAILED
