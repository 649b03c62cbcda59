"""What a control call came to: done, refused (nothing was touched) or failed, and why.

Every verb of the controller returns one of these (or a Job that ends in one), so that no
caller has to guess from an exception, a log line or the absence of news. The exit code
travels with it: the daemon's exit status is the outcome of its start and of its life.
"""

from __future__ import annotations

import itertools
import time
from ..records import dataclass, field
from typing import Literal

from ..errors import EXIT_FAILED, EXIT_OK, PreconditionError, SupervisorError

State = Literal["done", "refused", "failed"]


@dataclass(frozen=True)
class Outcome:
    state: State
    reason: str = ""
    exit_code: int = EXIT_OK

    @classmethod
    def done(cls, reason: str = "") -> Outcome:
        return cls("done", reason, EXIT_OK)

    @classmethod
    def of(cls, error: SupervisorError, reason: str | None = None) -> Outcome:
        """A refusal for what someone else holds or a bad profile (nothing touched), else a failure."""
        refused = isinstance(error, PreconditionError) or error.exit_code == 2
        return cls("refused" if refused else "failed", reason or str(error).splitlines()[0], error.exit_code)

    @classmethod
    def failed(cls, reason: str, exit_code: int = EXIT_FAILED) -> Outcome:
        return cls("failed", reason, exit_code)

    @property
    def ok(self) -> bool:
        return self.state == "done"


_ids = itertools.count(1)


@dataclass
class Job:
    """A control call that takes longer than a D-Bus call may: its caller follows it by id."""

    verb: str
    id: int = field(default_factory=lambda: next(_ids))
    state: str = "running"  # running, then an Outcome state
    reason: str = ""
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    exit_code: int | None = None  # the Outcome's, once ended: what `gpusupctl restart --wait` exits with

    def finish(self, outcome: Outcome) -> None:
        self.state, self.reason, self.ended_at = outcome.state, outcome.reason, time.time()
        self.exit_code = outcome.exit_code

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "verb": self.verb, "state": self.state, "reason": self.reason,
                "started_at": self.started_at, "ended_at": self.ended_at, "exit_code": self.exit_code}
