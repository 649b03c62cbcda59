"""Every record read from etcd, parsed in one place into a frozen typed record, or refused; and
every record written, encoded here from the same typed record (`encode_*`), in the JSON every
version of the agent reads (the keys and shapes are the wire: nodes of two versions interoperate).

Whoever can write our prefix in etcd writes these, and a root agent acts on them: a plan names
units it stops and starts. So nothing read from etcd is used as the JSON it arrived as: each
reader gets one of the records below or a BadRecord naming the key and what is wrong, in one
line, and skips it. A record is refused whole (never half obeyed) when a field is missing, of the
wrong type, out of range or too long, when a name does not fit its pattern (instance, process,
node, transition id) or a step is of an unknown kind. Fields a newer version may add are ignored
in the informational records (nodes, process states) and refused in the orders (plan, lock,
report), where an unknown field could change what is meant.

What is checked here is the record's shape. Whether a well-formed plan may be obeyed on this
node (its profiles present here and spanning nodes) is the agent's check (cluster/agent.py);
whether a lock is genuine (bound to a live lease) the store's (cluster/store.py).
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from typing import Any

from ..config.cluster import NODE_NAME_RE
from ..engine.states import State
from ..names import INSTANCE_NAME_RE, PROCESS_NAME_RE
from ..records import dataclass
from .plan import ClusterPlan, NodeWork, Step

MAX_RECORD_BYTES = 64 * 1024
MAX_STEPS = 64
MAX_WORK = 64  # nodes in a step
MAX_ITEMS = 256  # processes, units, GPUs, instance lists
MAX_TEXT = 1000  # a reason, a lock's "to"
MAX_ORDER = 8192
MAX_PID = 1 << 22  # Linux's pid_max limit
TID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
UNIT_STATE_RE = re.compile(r"^[a-z-]{1,32}\Z")  # systemd's ActiveState words
PROCESS_STATES = frozenset(s.value for s in State)
ACTIONS = ("stop", "verify", "start")


class BadRecord(ValueError):
    """A record that does not fit: skipped, and named in one line."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"ignoring etcd record {key[:200]!r}: {problem}")
        self.key, self.problem = key, problem


# -- the field checks ---------------------------------------------------------------------


class _Fields:
    """One record's JSON object, taken apart field by field; every problem is a BadRecord."""

    def __init__(self, key: str, data: Any, known: tuple[str, ...] | None, where: str = "") -> None:
        self.key, self.where = key, where
        if not isinstance(data, dict):
            raise BadRecord(key, f"{where or 'the record'}: not a JSON object but {_kind(data)}")
        if known is not None:
            extra = sorted(str(k)[:40] for k in data if k not in known)
            if extra:
                raise BadRecord(key, f"{where or 'the record'}: unknown field {extra[0]!r}")
        self.data = data

    def bad(self, field: str, problem: str) -> BadRecord:
        return BadRecord(self.key, f"{self.where}{field}: {problem}")

    def has(self, field: str) -> bool:
        return field in self.data

    def text(self, field: str, limit: int = MAX_TEXT, pattern: re.Pattern[str] | None = None,
             default: str | None = None) -> str:
        if field not in self.data and default is not None:
            return default
        value = self.data.get(field)
        return _text(self, field, value, limit, pattern)

    def integer(self, field: str, lo: int, hi: int, default: int | None = None) -> int:
        if field not in self.data and default is not None:
            return default
        value = self.data.get(field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(field, f"must be an integer, not {_kind(value)}")
        if not lo <= value <= hi:
            raise self.bad(field, f"must be in {lo}..{hi}, not {value}")
        return value

    def number(self, field: str, default: float = 0.0) -> float:
        if field not in self.data:
            return default
        value = self.data[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.bad(field, f"must be a finite number, not {_kind(value)}")
        if not 0 <= value < 1e11:
            raise self.bad(field, "is out of range")
        return float(value)

    def flag(self, field: str, default: bool = False) -> bool:
        value = self.data.get(field, default)
        if not isinstance(value, bool):
            raise self.bad(field, f"must be true or false, not {_kind(value)}")
        return value

    def items(self, field: str, limit: int = MAX_ITEMS, required: bool = True) -> list[Any]:
        if field not in self.data and not required:
            return []
        value = self.data.get(field)
        if not isinstance(value, list):
            raise self.bad(field, f"must be a list, not {_kind(value)}")
        if len(value) > limit:
            raise self.bad(field, f"has {len(value)} entries, more than {limit}")
        return value

    def names(self, field: str, pattern: re.Pattern[str], required: bool = True) -> tuple[str, ...]:
        return tuple(_text(self, f"{field}[{i}]", v, 64, pattern) for i, v in enumerate(self.items(field, required=required)))


def _text(f: _Fields, field: str, value: Any, limit: int, pattern: re.Pattern[str] | None) -> str:
    if not isinstance(value, str):
        raise f.bad(field, f"must be a string, not {_kind(value)}")
    if len(value) > limit:
        raise f.bad(field, f"is longer than {limit} characters")
    if pattern is not None and not pattern.match(value):
        raise f.bad(field, f"{value[:64]!r} is not a valid name")
    if any(ord(c) < 32 and c not in "\t" for c in value):
        raise f.bad(field, "contains control characters")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def decode(key: str, raw: bytes | str) -> Any:
    """The JSON value of one etcd record; a BadRecord for what is too large or not JSON."""
    if len(raw) > MAX_RECORD_BYTES:
        raise BadRecord(key, f"{len(raw)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise BadRecord(key, "not JSON") from None


# -- the records --------------------------------------------------------------------------


def parse_plan(key: str, raw: bytes | str) -> ClusterPlan:
    """`transitions/ID/plan`: the step order the agents carry out. Steps are numbered 1, 2, ...
    in order, each of a known kind and with at least one node's work."""
    f = _Fields(key, decode(key, raw), ("target", "stopping", "steps"))
    target = f.text("target", 200)
    stopping = f.names("stopping", INSTANCE_NAME_RE, required=False)
    steps: list[Step] = []
    for i, s in enumerate(f.items("steps", MAX_STEPS)):
        where = f"steps[{i}]"
        sf = _Fields(key, s, ("number", "action", "work", "order"), where + ".")
        number = sf.integer("number", 1, MAX_STEPS) if sf.has("number") else 0
        if number != i + 1:
            raise f.bad(f"{where}.number", f"must be {i + 1} (steps are numbered in order)")
        action = sf.text("action", 16)
        if action not in ACTIONS:
            raise f.bad(f"{where}.action", f"{action[:20]!r} is not a step kind ({', '.join(ACTIONS)})")
        work: list[NodeWork] = []
        for j, w in enumerate(sf.items("work", MAX_WORK)):
            wf = _Fields(key, w, ("node", "instance", "processes"), f"{where}.work[{j}].")
            work.append(NodeWork(wf.text("node", 63, NODE_NAME_RE), wf.text("instance", 64, INSTANCE_NAME_RE),
                                 wf.names("processes", PROCESS_NAME_RE)))
        if not work:
            raise f.bad(f"{where}.work", "names no node")
        if len({w.node for w in work}) != len(work):
            raise f.bad(f"{where}.work", "names a node twice")
        steps.append(Step(number, action, tuple(work), sf.text("order", MAX_ORDER, default="")))  # type: ignore[arg-type]
    return ClusterPlan(target, stopping, tuple(steps))


def encode_plan(plan: ClusterPlan) -> str:
    return json.dumps(plan.to_json())


@dataclass(frozen=True)
class StepReport:
    """`transitions/ID/steps/N/NODE`: one node's share of a step, done or failed."""

    state: str  # "done" | "failed"
    reason: str = ""
    at: float = 0.0


def parse_report(key: str, raw: bytes | str) -> StepReport:
    f = _Fields(key, decode(key, raw), ("state", "reason", "at"))
    state = f.text("state", 16)
    if state not in ("done", "failed"):
        raise f.bad("state", f"{state[:20]!r} is neither done nor failed")
    return StepReport(state, f.text("reason", MAX_TEXT, default=""), f.number("at"))


def encode_report(report: StepReport) -> str:
    """A step report as stored: {"state", "reason" when failed, "at" when known}."""
    data: dict[str, Any] = {"state": report.state}
    if report.reason:
        data["reason"] = report.reason
    if report.at:
        data["at"] = report.at
    return json.dumps(data)


class TransitionKind(StrEnum):
    """What a lock's transition is: a switch to a profile, or the rollback of one that failed.
    On the wire it is the lock's "to" (a rollback's reads "rollback of TARGET"), as every version
    of the agent writes and reads it; only this module knows those words."""

    SWITCH = "switch"
    ROLLBACK = "rollback"


ROLLBACK_OF = "rollback of "  # a rollback's "to": no instance name holds a space


@dataclass(frozen=True)
class LockRecord:
    """`lock`: who coordinates the transition under way. `target` is the profile it starts (or
    whose failed start it undoes, for a rollback). `lease` is the store's lease the key is bound
    to (0: none), `raw` the value as stored (the release compares it)."""

    node: str
    target: str = ""
    kind: TransitionKind = TransitionKind.SWITCH
    starting: tuple[str, ...] = ()
    pid: int = 0
    tid: str = ""
    lease: int = 0
    raw: bytes = b""

    @property
    def to(self) -> str:
        """Where the transition goes, in the words people and the wire read."""
        return ROLLBACK_OF + self.target if self.kind is TransitionKind.ROLLBACK else self.target

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "to": self.to, "starting": list(self.starting), "pid": self.pid, "tid": self.tid}


def encode_lock(record: LockRecord) -> bytes:
    """The lock's value as stored: its `raw` if it was read, else its fields (an empty tid left
    out: a tid that is present must be a valid one, and "" is not)."""
    if record.raw:
        return record.raw
    data = record.to_json()
    if not record.tid:
        del data["tid"]
    return json.dumps(data, sort_keys=True).encode()


def parse_lock(key: str, raw: bytes, lease: int) -> LockRecord:
    f = _Fields(key, decode(key, raw), ("node", "to", "starting", "pid", "tid"))
    to = f.text("to", 200, default="")
    kind = TransitionKind.ROLLBACK if to.startswith(ROLLBACK_OF) else TransitionKind.SWITCH
    return LockRecord(node=f.text("node", 63, NODE_NAME_RE), target=to.removeprefix(ROLLBACK_OF), kind=kind,
                      starting=f.names("starting", INSTANCE_NAME_RE, required=False),
                      pid=f.integer("pid", 0, MAX_PID, default=0),
                      tid=f.text("tid", 64, TID_RE) if f.has("tid") else "", lease=lease, raw=bytes(raw))


@dataclass(frozen=True)
class GpuRecord:
    index: int = -1
    in_use_mib: int = 0
    total_mib: int = 0
    idle: bool = False
    error: str = ""


@dataclass(frozen=True)
class NodeRecord:
    """`nodes/NODE`: a node's agent is alive; its units' states and GPUs, for `status --cluster`."""

    node: str
    pid: int = 0
    parts: tuple[tuple[str, str], ...] = ()  # (instance, systemd ActiveState)
    gpus: tuple[GpuRecord, ...] = ()
    at: float = 0.0


def parse_node(key: str, node: str, raw: bytes | str) -> NodeRecord:
    f = _Fields(key, decode(key, raw), None)
    parts: list[tuple[str, str]] = []
    if f.has("parts"):
        units = f.data["parts"]
        if not isinstance(units, dict) or len(units) > MAX_ITEMS:
            raise f.bad("parts", "must be an object of at most 256 units")
        for instance, active in units.items():
            parts.append((_text(f, "parts", instance, 64, INSTANCE_NAME_RE), _text(f, f"parts.{instance}", active, 32, UNIT_STATE_RE)))
    gpus: list[GpuRecord] = []
    for j, g in enumerate(f.items("gpus", required=False)):
        gf = _Fields(key, g, None, f"gpus[{j}].")
        if gf.has("error"):
            gpus.append(GpuRecord(error=gf.text("error", MAX_TEXT)))
        else:
            gpus.append(GpuRecord(gf.integer("index", 0, 1023), gf.integer("in_use_mib", 0, 1 << 40),
                                  gf.integer("total_mib", 0, 1 << 40), gf.flag("idle")))
    if f.has("node") and f.data["node"] != node:
        raise f.bad("node", "does not match its key")
    return NodeRecord(node, f.integer("pid", 0, MAX_PID, default=0), tuple(sorted(parts)), tuple(gpus), f.number("at"))


def encode_node(record: NodeRecord) -> str:
    """A node's record as stored: its units as {instance: ActiveState}, each GPU or its error."""
    gpus = [{"error": g.error} if g.error else {"index": g.index, "in_use_mib": g.in_use_mib,
                                                   "total_mib": g.total_mib, "idle": g.idle} for g in record.gpus]
    return json.dumps({"node": record.node, "pid": record.pid, "parts": dict(record.parts), "gpus": gpus,
                       "at": record.at}, sort_keys=True)


@dataclass(frozen=True)
class ProcessRecord:
    """`parts/INSTANCE/NODE/PROCESS`: one process's state, published by the daemon running it."""

    instance: str
    node: str
    process: str
    state: str
    at: float = 0.0


def parse_process(key: str, path: str, raw: bytes | str) -> ProcessRecord:
    """`path` is the key below `parts/`: INSTANCE/NODE/PROCESS, each a valid name."""
    pieces = path.split("/")
    if len(pieces) != 3:
        raise BadRecord(key, "not INSTANCE/NODE/PROCESS under parts/")
    instance, node, process = pieces
    for name, pattern, what in ((instance, INSTANCE_NAME_RE, "instance"), (node, NODE_NAME_RE, "node"),
                                (process, PROCESS_NAME_RE, "process")):
        if not pattern.match(name):
            raise BadRecord(key, f"{name[:64]!r} is not a valid {what} name")
    f = _Fields(key, decode(key, raw), None)
    state = f.text("state", 16)
    if state not in PROCESS_STATES:
        raise f.bad("state", f"{state[:20]!r} is not a process state")
    return ProcessRecord(instance, node, process, state, f.number("at"))


def encode_process(record: ProcessRecord) -> str:
    """A process's state as stored; its instance, node and name are its key."""
    return json.dumps({"state": record.state, "at": record.at}, sort_keys=True)


def parse_tid(key: str, raw: bytes | str) -> str:
    """`current`: the id of the transition under way (plain text, not JSON)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if not TID_RE.match(text):
        raise BadRecord(key, f"{text[:64]!r} is not a transition id")
    return text
