"""Who holds a GPU or a port: a PID turned into a line a person can act on.

A refusal is only useful if it names the holder: its PID, user, command line, cgroup, and
whether it is one of our instances (attributed from the cgroup path by names.py,
the same scheme the drivers use to create them) or something foreign. Never guess: a PID
that cannot be looked up in this PID namespace is reported as unknown, not matched to
whatever process happens to carry that number here.
"""

from __future__ import annotations

import os
import pwd
from ..records import dataclass
from typing import Any

from ..names import Owner, owner_of_cgroup, unit_of_cgroup
from ..ownership.procfs import fd_targets, is_zombie, read_text, real_uid

CMDLINE_WIDTH = 100  # characters of command line in a one-line description
UNKNOWN_REASON = "outside this PID namespace"


@dataclass(frozen=True)
class Holder:
    """A process holding a GPU or a port. cmdline is in full; describe() shortens it."""

    pid: int
    user: str | None
    cmdline: str | None
    cgroup: str | None
    unit: str | None
    owner: Owner | None
    known: bool

    @classmethod
    def unknown(cls, pid: int) -> Holder:
        return cls(pid, None, None, None, None, None, False)

    @property
    def ours(self) -> bool:
        return self.owner is not None

    def verdict(self) -> str:
        """"(ours: instance pd-1p1d, router)" or "(foreign)"."""
        return f"(ours: {self.owner.describe()})" if self.owner else "(foreign)"

    def describe(self, width: int = CMDLINE_WIDTH) -> str:
        """One line: pid, user, command line (shortened), cgroup, ours or foreign."""
        if not self.known:
            return f"pid {self.pid}: unknown ({UNKNOWN_REASON})"
        parts = [f"pid {self.pid}"]
        if self.user:
            parts.append(f"(user {self.user})")
        parts.append(shorten_cmdline(self.cmdline, width) if self.cmdline else "[command line not readable]")
        if self.cgroup:
            parts.append(f"[cgroup {self.cgroup}]")
        parts.append(self.verdict())
        return " ".join(parts)

    def short(self, width: int = 50) -> str:
        """For tables: "pid 4711 pd-1p1d/router" or "pid 4711 foreign: python -m sglang…"."""
        if not self.known:
            return f"pid {self.pid} unknown"
        if self.owner:
            return f"pid {self.pid} {self.owner.instance}/{self.owner.process}"
        head = f"pid {self.pid} foreign: "
        return head + shorten_cmdline(self.cmdline or "?", max(8, width - len(head)))

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "known": self.known,
            "user": self.user,
            "cmdline": self.cmdline,
            "cgroup": self.cgroup,
            "unit": self.unit,
            "owner": None if self.owner is None else {"instance": self.owner.instance, "process": self.owner.process},
            "description": self.describe(),
        }


def shorten_cmdline(cmdline: str, width: int = CMDLINE_WIDTH) -> str:
    """The program's base name and as many arguments as fit, cut at a word, ending in "…"."""
    words = cmdline.split()  # also folds the newlines of a `python -c` program onto one line
    if words and "/" in words[0]:
        words[0] = words[0].rsplit("/", 1)[1] or words[0]
    text = " ".join(words)
    if len(text) <= width:
        return text
    cut = text[: width - 2]
    if " " in cut[width // 2 :]:
        cut = cut[: cut.rindex(" ")]
    return cut + " …"


def read_cgroup(pid: int) -> str | None:
    """The cgroup path of a process (see parse_cgroup); None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return parse_cgroup(f.read())
    except OSError:
        return None


def parse_cgroup(text: str) -> str | None:
    """The path from /proc/PID/cgroup text: the cgroup v2 ("0::") line, which is where our
    drivers put processes; on a hybrid host where that line says only "/", the name=systemd
    line if it says more; on a pure v1 host, name=systemd, else the first line."""
    unified = systemd = first = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hid, controllers, path = fields
        path = path.removesuffix(" (deleted)")
        first = first or path
        if hid == "0" and controllers == "":
            unified = path
        elif controllers == "name=systemd":
            systemd = path
    if unified is not None and (unified != "/" or systemd in (None, "/")):
        return unified
    return systemd or unified or first


def describe_pid(pid: int) -> Holder:
    """Look a PID up in this PID namespace; unknown (known=False) when it is not there.

    Straight from /proc (no psutil: `gpusupctl gpus` and `status` pay for every import)."""
    if pid <= 0 or not os.path.isdir(f"/proc/{pid}"):
        return Holder.unknown(pid)
    cgroup = read_cgroup(pid)
    uid = real_uid(pid)
    if uid is None:
        return Holder.unknown(pid)  # exited meanwhile
    try:
        user: str | None = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid with no passwd entry
        user = str(uid)
    raw = read_text(pid, "cmdline")
    if raw is None:
        return Holder.unknown(pid)
    comm = (read_text(pid, "comm") or "?").strip() or "?"
    cmdline: str | None
    if raw:
        cmdline = " ".join(raw.rstrip("\0").split("\0"))
    elif is_zombie(pid):
        cmdline = f"[{comm}] <defunct>"
    else:
        cmdline = f"[{comm}]"  # a kernel thread, or a cmdline we may not read (hidepid): its name
    # named like ours is not enough: a cgroupfs path must be root's alone (ownership/cgroupfs.py),
    # or a user's look-alike cgroup in a subtree delegated to them would pass for our instance
    owner = _verified_owner(cgroup) if cgroup and owner_of_cgroup(cgroup) else None
    unit = unit_of_cgroup(cgroup) if cgroup else None
    return Holder(pid, user, cmdline, cgroup, unit, owner, True)


def _verified_owner(cgroup: str) -> Owner | None:
    from ..ownership.cgroupfs import verified_owner  # only for holders the name calls ours

    return verified_owner(cgroup)


def describe_gpu_pid(pid: int, pids_local: bool) -> Holder:
    """A PID that a GPU inventory listed.

    NVML reports PIDs of the initial PID namespace. Outside it (a container with its own PID
    namespace) the same number may name an unrelated process here, so the PID is accepted
    only if that process has an NVIDIA device open; otherwise it is reported as unknown.
    """
    if pids_local:
        return describe_pid(pid)
    if not _has_nvidia_device_open(pid):
        return Holder.unknown(pid)
    return describe_pid(pid)


def _has_nvidia_device_open(pid: int) -> bool:
    return any(target.startswith("/dev/nvidia") for target in fd_targets(pid))
