"""The named states, and the moves allowed between them, as data (Supervisor's states.py is the model).

An instance and each of its processes have their own words: an instance is DEGRADED while one
of its processes is RESTARTING. Each object changes its state in one method, which checks the
move against its table here: a move the table does not hold is a bookkeeping bug of ours.

Under the tests (SUPERVISORD_GPU_STRICT_STATES=1, set by tests/conftest.py) an illegal move raises
IllegalTransition. In production it is logged at priority 3 and the move is made anyway: the
state words are bookkeeping, and a supervisor that died of its own bookkeeping bug would take
down servers that cost twenty minutes to load, which the bug itself never would.

The words are on the bus, in the journal, in the metrics and in `status --json`: they never change.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import TypeVar


class InstanceState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"  # ready once; a process is restarting
    STOPPING = "stopping"
    FAILED = "failed"  # gave up (a failed start, the restart limit); started again only by a start
    PARKED = "parked"  # its CUDA processes checkpointed into host memory: 0 MiB on the GPU (parking/)

    def __str__(self) -> str:
        return self.value


class ProcessState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # died after ready (or asked to restart): waiting for its backoff or readiness
    STOPPING = "stopping"
    FAILED = "failed"  # the instance gave up on it; `last_exit` says how it ended
    PARKED = "parked"  # its instance is parked: alive, no liveness, its GPU memory in host memory

    def __str__(self) -> str:
        return self.value


class State(enum.StrEnum):
    """Every word of both tables, for readers that compare words (STATUS=, the cluster's records).

    Members compare equal to the InstanceState and ProcessState members of the same word, so
    `instance.state == State.READY` holds; new code names the enum of the object it reads."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    FAILED = "failed"
    PARKED = "parked"

    def __str__(self) -> str:
        return self.value


_I = InstanceState
_P = ProcessState

#: An instance's allowed moves. A move to its own state says a new reason (where listed).
INSTANCE_MOVES: Mapping[InstanceState, frozenset[InstanceState]] = {
    # STOPPING: a stop of a stopped instance (it stops nothing, in order);
    # FAILED: fail() before any start (a daemon that cannot read its GPUs says so)
    _I.STOPPED: frozenset({_I.STARTING, _I.STOPPING, _I.FAILED}),
    # STARTING again: the preflight passed ("checking" is over); STOPPED: stopped while starting
    _I.STARTING: frozenset({_I.STARTING, _I.READY, _I.FAILED, _I.STOPPED}),
    # DEGRADED: a process restarts; STOPPING: a stop, or giving up on a crash the policy refuses
    # PARKED: drained and checkpointed into host memory (parking/, controller/parking.py)
    _I.READY: frozenset({_I.DEGRADED, _I.STOPPING, _I.PARKED}),
    # DEGRADED again: another process restarts too; READY: every process is ready again
    _I.DEGRADED: frozenset({_I.DEGRADED, _I.READY, _I.STOPPING}),
    # FAILED: the last step of giving up (everything is stopped first)
    _I.STOPPING: frozenset({_I.STOPPED, _I.FAILED}),
    # FAILED again: the controller's words for a failed start (what was rolled back);
    # STARTING: started again; STOPPING: the stop after giving up
    _I.FAILED: frozenset({_I.FAILED, _I.STARTING, _I.STOPPING}),
    # READY: restored and serving (or a park that failed, brought back); STOPPING: a stop of the
    # parked profile, or the stop before a cold start when its restore failed
    _I.PARKED: frozenset({_I.READY, _I.STOPPING}),
}

#: A process's allowed moves. Set to its own state with nothing new to say, it does not move.
PROCESS_MOVES: Mapping[ProcessState, frozenset[ProcessState]] = {
    # RESTARTING: started again by a restart (a crash's or an operator's); STOPPING: a stop of a
    # run that already ended (its group is emptied and released all the same); FAILED: given up
    # on, once stopped
    _P.STOPPED: frozenset({_P.STARTING, _P.RESTARTING, _P.STOPPING, _P.FAILED}),
    # STOPPED: the spawn itself failed (nothing ran, nothing to stop)
    _P.STARTING: frozenset({_P.READY, _P.STOPPING, _P.STOPPED}),
    # RESTARTING: it died and the policy restarts it; STOPPING: a stop, or an operator's restart
    # PARKED: its instance parks (liveness paused)
    _P.READY: frozenset({_P.RESTARTING, _P.STOPPING, _P.PARKED}),
    # STOPPING: what is left of the dead run is killed before the backoff, or a stop
    _P.RESTARTING: frozenset({_P.READY, _P.STOPPING}),
    _P.STOPPING: frozenset({_P.STOPPED}),
    # STARTING: its instance is started again; STOPPING: the instance's stop
    _P.FAILED: frozenset({_P.STARTING, _P.STOPPING}),
    # READY: restored (liveness resumes); STOPPING: a stop of the parked instance
    _P.PARKED: frozenset({_P.READY, _P.STOPPING}),
}

INSTANCE_START = InstanceState.STOPPED
PROCESS_START = ProcessState.STOPPED


class IllegalTransition(Exception):
    """A state move its table does not allow: a bug of the supervisor's, never the user's."""


def strict() -> bool:
    """Whether an illegal move raises (the tests) rather than being logged (production)."""
    return os.environ.get("SUPERVISORD_GPU_STRICT_STATES", "") == "1"


S = TypeVar("S", InstanceState, ProcessState)


def illegal_move(moves: Mapping[S, frozenset[S]], who: str, old: S, new: S) -> str:
    """"" when `old` -> `new` is in `moves`; else the one line that names the bug."""
    if new in moves[old]:
        return ""
    allowed = ", ".join(sorted(s.value for s in moves[old])) or "nothing"
    return f"illegal state move of {who}: {old.value} -> {new.value} (allowed from {old.value}: {allowed})"


def check_move(moves: Mapping[S, frozenset[S]], who: str, old: S, new: S, complain: Callable[[str], None]) -> None:
    """Assert `old` -> `new` against its table: raise under the tests, else `complain` and go on."""
    why = illegal_move(moves, who, old, new)
    if not why:
        return
    if strict():
        raise IllegalTransition(why)
    complain(why)
