"""Where lines go: the journal's native protocol under systemd, stderr in a terminal.

Native datagrams (not stderr) so each child line carries fields an operator can filter on:
    GPUSUP_INSTANCE  the profile name (also in the unit name dsv4@NAME)
    GPUSUP_PROCESS   the process name in the profile (prefill, decode, router, server, ...)
    GPUSUP_ROLE      regular / prefill / decode / router
    GPUSUP_STREAM    stdout or stderr
    GPUSUP_EVENT     for the daemon's own records: spawn, ready, stopped, kill, restart, ...
    GPUSUP_DURATION_S  how long the step took, where it has a duration
e.g. `journalctl -u dsv4@pd-1p1d GPUSUP_PROCESS=router`.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

JOURNAL_SOCKET = "/run/systemd/journal/socket"
MAX_FIELD = 48 * 1024
_COLOURS = ("\033[36m", "\033[35m", "\033[33m", "\033[32m", "\033[34m", "\033[31m")


def _field(key: str, value: str) -> bytes:
    data = value.encode("utf-8", "replace")[:MAX_FIELD]
    if b"\n" in data:
        return key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key.encode() + b"=" + data + b"\n"


class JournalSink:
    """Sends records to journald; they are attributed to our unit by journald itself."""

    def __init__(self, instance: str, path: str = JOURNAL_SOCKET) -> None:
        self.instance = instance
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.roles: dict[str, str] = {}

    @staticmethod
    def available() -> bool:
        return bool(os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID")) and os.path.exists(JOURNAL_SOCKET)

    def _send(self, fields: dict[str, str]) -> None:
        payload = b"".join(_field(k, v) for k, v in fields.items())
        try:
            # A blocking socket on purpose: when journald falls behind we wait rather than lose a line.
            self.sock.sendto(payload, self.path)
        except OSError as e:
            sys.stderr.write(f"journal unavailable ({e.strerror}): {fields.get('MESSAGE', '')}\n")

    def child_line(self, instance: str, process: str, line: str, stream: str, priority: int, pid: int | None = None) -> None:
        fields = {
            "MESSAGE": line,
            "PRIORITY": str(priority),
            "SYSLOG_IDENTIFIER": process,
            "GPUSUP_INSTANCE": instance,
            "GPUSUP_PROCESS": process,
            "GPUSUP_STREAM": stream,
        }
        if process in self.roles:
            fields["GPUSUP_ROLE"] = self.roles[process]
        self._send(fields)

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        record = {
            "MESSAGE": message,
            "PRIORITY": str(priority),
            "SYSLOG_IDENTIFIER": "supervisord-gpu",
            "GPUSUP_INSTANCE": self.instance,
        }
        record.update(fields)
        self._send(record)


class StderrSink:
    """Terminal output: child lines prefixed by their process, the daemon's own by the program."""

    def __init__(self, instance: str, stream=None, colour: bool | None = None, quiet_children: bool = False) -> None:
        self.instance = instance
        self.stream = stream or sys.stderr
        self.colour = self.stream.isatty() if colour is None else colour
        self.quiet_children = quiet_children
        self.roles: dict[str, str] = {}
        self._lock = threading.Lock()
        self._palette: dict[str, str] = {}

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()

    def child_line(self, instance: str, process: str, line: str, stream: str, priority: int, pid: int | None = None) -> None:
        if self.quiet_children:
            return
        prefix = f"{process}|"
        if self.colour:
            colour = self._palette.setdefault(process, _COLOURS[len(self._palette) % len(_COLOURS)])
            prefix = f"{colour}{prefix}\033[0m"
        self._write(f"{prefix} {line}")

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        tag = "supervisord-gpu:"
        if self.colour:
            tag = ("\033[1;31m" if priority <= 3 else "\033[1;33m" if priority == 4 else "\033[1m") + tag + "\033[0m"
        self._write(f"{tag} {message}")


def open_sink(instance: str, force_stderr: bool = False):
    if not force_stderr and JournalSink.available():
        return JournalSink(instance)
    return StderrSink(instance)
