"""Which instances run on this machine, as their daemons record it under the runtime directory.

Each daemon writes `<runtime>/instances/<name>.json` (its PID, start time, cgroup, profile,
GPUs, ports) while it runs and removes it when it ends. systemd's unit list is the truth under
systemd; this record is what a transition reads where there is no systemd (the device machine,
rehearsal), and a takeover SIGTERMs the PID it names. So a record is believed only if

* it sits in a root-owned directory nobody else can write, and is itself a regular file of
  root's (never followed through a symlink: see config/trust.py), and
* the PID is alive, started when the record says, runs as the record's writer did (root), and
  is in the cgroup the record names: a PID number and a start time anyone can read from
  /proc, a cgroup a reused PID does not share.

Anything else is stale or forged, and ignored.
"""

from __future__ import annotations

import json
import os
from ..records import asdict, dataclass
from pathlib import Path

import psutil

from ..checks.holders import read_cgroup
from ..config.model import Profile
from ..config.trust import open_nofollow, read_trusted, secure_directory


@dataclass
class Record:
    instance: str
    pid: int
    create_time: float
    profile: str
    gpus: list[int]
    ports: list[int]
    driver: str
    uid: int = 0
    cgroup: str = ""

    def alive(self) -> bool:
        """Is this exactly the daemon that wrote the record (not a process that reused its PID)?"""
        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.create_time) < 0.01 and proc.uids().real == self.uid
        except psutil.Error:
            return False
        return same and read_cgroup(self.pid) == self.cgroup


def _dir(runtime: Path) -> Path:
    return runtime / "instances"


def _secure_dir(runtime: Path) -> Path:
    """The records' directory, and the runtime directory above it, root's and 0755 (or refused)."""
    secure_directory(runtime)
    return secure_directory(_dir(runtime))


def register(runtime: Path, profile: Profile, driver: str) -> Path:
    d = _secure_dir(runtime)
    me = psutil.Process()
    rec = Record(profile.name, me.pid, me.create_time(), str(profile.path), sorted(profile.gpus),
                 sorted({listen.port for listen in profile.listens()}), driver, os.geteuid(), read_cgroup(me.pid) or "")
    return write_record(d, profile.name, asdict(rec))


def write_record(directory: Path, name: str, record: dict[str, object]) -> Path:
    """`directory/NAME.json`, whole or not at all: written to a fresh temporary file opened
    without following links, then renamed over the old one (a rename replaces a planted symlink
    at the path itself, never follows it). `directory` is root's (secure_directory)."""
    path = directory / f"{name}.json"
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps(record).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def unregister(runtime: Path, instance: str) -> None:
    try:
        (_dir(runtime) / f"{instance}.json").unlink()
    except FileNotFoundError:
        pass


def running(runtime: Path) -> list[Record]:
    """The records of live daemons, each checked as the module docstring says."""
    try:
        d = _secure_dir(runtime)
    except OSError:
        return []  # a directory we cannot trust records nothing we would act on
    out = []
    for path in sorted(d.glob("*.json")):
        try:
            rec = Record(**json.loads(read_trusted(path, 1 << 16)))
        except (OSError, ValueError, TypeError):
            continue
        if rec.instance == path.stem and rec.alive():
            out.append(rec)
    return out


class Registry:
    """The records under one runtime directory: what a takeover reads and signals where there is
    no systemd. Made once by the daemon and handed down (the fast tests hand a fake)."""

    def __init__(self, runtime: Path) -> None:
        self.runtime = runtime

    def running(self) -> list[Record]:
        return running(self.runtime)

    def register(self, profile: Profile, driver: str) -> Path:
        return register(self.runtime, profile, driver)

    def unregister(self, instance: str) -> None:
        unregister(self.runtime, instance)
