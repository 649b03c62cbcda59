"""What the engine tells the outside world: state changes and log lines, as plain records.

The notifier, the D-Bus skin, the metrics endpoint and the CLI's rehearsal view subscribe;
the engine never imports any of them.
"""

from __future__ import annotations

import time
from ..records import dataclass, field
from typing import Protocol
from collections.abc import Callable


@dataclass(frozen=True)
class Event:
    kind: str  # "instance", "process", "phase", "stop", "restart", "info", "error"
    instance: str
    message: str
    process: str | None = None
    state: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    at: float = field(default_factory=time.time)


Listener = Callable[[Event], None]


class LogSink(Protocol):
    """Where child output and the daemon's own events go (journal or stderr)."""

    def child_line(self, instance: str, process: str, line: str, stream: str, priority: int) -> None: ...

    def event(self, message: str, priority: int = 6, **fields: str) -> None: ...
