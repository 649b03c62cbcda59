"""Every D-Bus name of supervisord-gpu, in one place (firewalld's lesson).

One daemon per instance, so one well-known name per instance:
    bus name   org.supervisordgpu.instance.<escaped instance>
    object     /org/supervisordgpu/Instance
    interface  org.supervisordgpu.Instance1
The instance name is escaped the way systemd escapes unit names into object paths:
every byte outside [A-Za-z0-9] becomes _XX (hex), and a leading digit is escaped too,
so "tp4-512k" is "tp4_2d512k" and the mapping is reversible.
Errors answer as ERROR_PREFIX + a name of errors.py's table (org.supervisordgpu.Error.Busy, ...).
"""

from __future__ import annotations

import re

from ..errors import ERROR_PREFIX as ERROR_PREFIX  # re-exported: every name of ours, here

BUS_PREFIX = "org.supervisordgpu.instance"
OBJECT_PATH = "/org/supervisordgpu/Instance"
INTERFACE = "org.supervisordgpu.Instance1"
SIGNAL_STATE_CHANGED = "StateChanged"

READ_METHODS = ("GetStatus", "GetProcess", "GetHistory", "GetJob", "Ping")
CONTROL_METHODS = ("Stop", "Restart", "RestartProcess", "Park", "Restore")


def escape(instance: str) -> str:
    out = []
    for i, ch in enumerate(instance):
        if ch.isascii() and ch.isalnum() and not (i == 0 and ch.isdigit()):
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    return "".join(out)


def unescape(escaped: str) -> str:
    return re.sub(rb"_([0-9a-f]{2})", lambda m: bytes([int(m[1], 16)]), escaped.encode()).decode()


def bus_name(instance: str) -> str:
    return f"{BUS_PREFIX}.{escape(instance)}"
