"""Which instances are parked on this machine: `<runtime>/parked/<name>.json`, written by the
parked instance's own daemon and removed by it when it is restored, stopped or ends.

A takeover reads it: a parked instance holds no GPU memory, so the next profile's start must
not stop it for its GPUs (only for a port, which parking refuses beforehand). Believed only as
the registry's records are: in a root-owned directory nobody else can write, a regular file of
root's, never through a symlink (config/trust.py), and only for an instance the registry or
systemd says runs. Anything else is ignored: the instance is then stopped as any other.

A record is also only as alive as the daemon that wrote it: it names that daemon (PID, start
time, uid, cgroup: the registry's Record.alive check), and a record whose writer is gone is
stale. A parked daemon SIGKILLed leaves its record (nothing runs its clean-up), and its
processes die with it (BindsTo=); until its next life removes the record at start (or forever,
after a final failure), `gpusupctl switch` to it would have asked a daemon that is not there to
restore what no longer exists, instead of starting it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

from ..checks.holders import read_cgroup
from ..config.trust import read_trusted, secure_directory
from .registry import Record, write_record
from ..parking.decisions import ParkedProfile


def _dir(runtime: Path) -> Path:
    secure_directory(runtime)
    return secure_directory(runtime / "parked")


def write(runtime: Path, record: ParkedProfile) -> None:
    """The record, signed by the daemon writing it (this process): believed while it lives."""
    me = psutil.Process()
    daemon = {"pid": me.pid, "create_time": me.create_time(), "uid": os.geteuid(), "cgroup": read_cgroup(me.pid) or ""}
    write_record(_dir(runtime), record.instance, {**record.to_json(), "daemon": daemon})


def _writer_alive(instance: str, daemon: dict[str, object]) -> bool:
    """Is the daemon that wrote the record still that very process (registry.Record.alive)?"""
    pid, began, uid, cgroup = daemon["pid"], daemon["create_time"], daemon["uid"], daemon["cgroup"]
    if type(pid) is not int or type(uid) is not int or type(began) not in (int, float) or type(cgroup) is not str:
        return False
    return Record(instance, pid, float(began), "", [], [], "", uid, cgroup).alive()  # type: ignore[arg-type]


def remove(runtime: Path, instance: str) -> None:
    try:
        (runtime / "parked" / f"{instance}.json").unlink()
    except FileNotFoundError:
        pass


def parked(runtime: Path) -> dict[str, list[int]]:
    """Parked instance -> the ports it keeps listening on; records that do not parse, and those
    whose daemon is gone, are ignored."""
    try:
        d = _dir(runtime)
    except OSError:
        return {}
    out: dict[str, list[int]] = {}
    for path in sorted(d.glob("*.json")):
        try:
            data = json.loads(read_trusted(path, 1 << 16))
            ports = data["ports"]
            if data["instance"] != path.stem or not all(type(p) is int for p in ports):
                continue
            if not _writer_alive(path.stem, data["daemon"]):
                continue
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
        out[path.stem] = list(ports)
    return out
