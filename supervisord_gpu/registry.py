"""Which instances run on this machine, as their daemons record it under the runtime directory.

Each daemon writes `<runtime>/instances/<name>.json` (its PID, profile, GPUs, ports) while it
runs and removes it when it ends. systemd's unit list is the truth under systemd; this record
is what a transition reads where there is no systemd (the device machine, rehearsal), and a
record whose PID is gone or no longer our daemon is stale and ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from .config.model import Profile


@dataclass
class Record:
    instance: str
    pid: int
    create_time: float
    profile: str
    gpus: list[int]
    ports: list[int]
    driver: str

    def alive(self) -> bool:
        try:
            return abs(psutil.Process(self.pid).create_time() - self.create_time) < 0.01
        except psutil.Error:
            return False


def _dir(runtime: Path) -> Path:
    return runtime / "instances"


def register(runtime: Path, profile: Profile, driver: str) -> Path:
    d = _dir(runtime)
    d.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    rec = Record(profile.name, me.pid, me.create_time(), str(profile.path), sorted(profile.gpus),
                 sorted({l.port for l in profile.listens()}), driver)
    path = d / f"{profile.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rec)))
    os.replace(tmp, path)
    return path


def unregister(runtime: Path, instance: str) -> None:
    try:
        (_dir(runtime) / f"{instance}.json").unlink()
    except FileNotFoundError:
        pass


def running(runtime: Path) -> list[Record]:
    out = []
    for path in sorted(_dir(runtime).glob("*.json")):
        try:
            rec = Record(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if rec.alive():
            out.append(rec)
    return out
