"""Which instances are parked on this machine: `<runtime>/parked/<name>.json`, written by the
parked instance's own daemon and removed by it when it is restored, stopped or ends.

A takeover reads it: a parked instance holds no GPU memory, so the next profile's start must
not stop it for its GPUs (only for a port, which parking refuses beforehand). Believed only as
the registry's records are: in a root-owned directory nobody else can write, a regular file of
root's, never through a symlink (config/trust.py), and only for an instance the registry or
systemd says runs. Anything else is ignored: the instance is then stopped as any other.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config.trust import read_trusted, secure_directory
from .registry import write_record
from ..parking.decisions import ParkedProfile


def _dir(runtime: Path) -> Path:
    secure_directory(runtime)
    return secure_directory(runtime / "parked")


def write(runtime: Path, record: ParkedProfile) -> None:
    write_record(_dir(runtime), record.instance, record.to_json())


def remove(runtime: Path, instance: str) -> None:
    try:
        (runtime / "parked" / f"{instance}.json").unlink()
    except FileNotFoundError:
        pass


def parked(runtime: Path) -> dict[str, list[int]]:
    """Parked instance -> the ports it keeps listening on; records that do not parse are ignored."""
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
        except (OSError, ValueError, TypeError, KeyError):
            continue
        out[path.stem] = list(ports)
    return out
