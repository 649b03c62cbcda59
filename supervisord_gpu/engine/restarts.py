"""A process's restart bookkeeping: what the restart policy counts, and what it does not.

Two kinds of restart, two ledgers. A crash is restarted by the policy, which counts crashes in
its window against its limit. An operator's restart (`gpusupctl restart NAME --process P`) is a
decision of someone watching: it counts toward nothing, or a few restarts by hand would use up
the budget the policy keeps for crashes at night. Both are in the process's `restarts` total.
"""

from __future__ import annotations

from ..config.model import RestartPolicy
from ..records import dataclass


@dataclass(frozen=True)
class Verdict:
    """The policy's answer to one crash: the attempt and its delay, or why not."""

    attempt: int = 0  # 1-based, within the policy's window
    delay_s: float = 0.0
    refusal: str = ""

    @property
    def allowed(self) -> bool:
        return not self.refusal


class CrashRestarts:
    """The crashes the policy restarted: their times (the window's count) and how many ran."""

    def __init__(self) -> None:
        self.times: list[float] = []  # monotonic, of the restarts admitted within the window
        self.started = 0

    def admit(self, policy: RestartPolicy, exit_code: int | None, now: float) -> Verdict:
        """Whether a crash (ended with `exit_code`) at `now` is restarted; an admitted one is counted."""
        self.times = [t for t in self.times if now - t < policy.window_s]
        if policy.mode == "never" or (policy.mode == "on-failure" and exit_code == 0):
            return Verdict(refusal=f"restart policy {policy.mode!r}")
        if len(self.times) >= policy.max_restarts:
            return Verdict(refusal=f"restart limit reached ({len(self.times)}/{policy.max_restarts} "
                                   f"in {policy.window_s:g} s)")
        self.times.append(now)
        attempt = len(self.times)
        return Verdict(attempt=attempt, delay_s=policy.backoff(attempt))


class RequestedRestarts:
    """The restarts an operator asked for: counted for status and the metrics, limited by nothing."""

    def __init__(self) -> None:
        self.started = 0
