"""The named states every component agrees on (s6's lesson: readiness is a fact, not a guess)."""

from __future__ import annotations

import enum


class State(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"  # instance: ready once, a process is restarting
    RESTARTING = "restarting"  # process: died after ready, waiting for its backoff or readiness
    STOPPING = "stopping"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value
