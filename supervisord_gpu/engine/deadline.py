"""When a start that is still loading has taken too long: a deadline that follows progress.

A first start of a large model can take far more than 15 minutes and still be healthy:
DeepGEMM's JIT announces "typically 10-20 mins" and runs during graph capture or the warm-up
request, and its sweep repeats even with a warm cache (sglang-server.md, second round). A
fixed deadline fails exactly those starts, and every failed start is loaded again from the
beginning. A start that prints nothing, though, is stuck whatever the clock says.

So (the rule systemd's window follows too, api/notify.py):

* `start_timeout` bounds a start that shows no progress at all;
* each progress (a phase line, a progress-bar update; never a request's echo, which anyone
  who connects can cause: sglang/logs.is_start_progress) moves the deadline to
  `start_stall_timeout` after it, if that is later; a profile whose `start_timeout` is
  shorter than that asks for a quick verdict, so then the shorter one counts after each
  progress too (`min(start_timeout, start_stall_timeout)`);
* `start_timeout_max` is the hard cap, whatever the progress.
"""

from __future__ import annotations

from ..records import dataclass


@dataclass(frozen=True)
class StartDeadline:
    started: float  # monotonic
    timeout_s: float  # start_timeout: no progress at all
    stall_s: float  # start_stall_timeout: after the last progress
    cap_s: float  # start_timeout_max

    def at(self, last_progress: float | None) -> float:
        """The monotonic time the start fails at, given its last progress."""
        soft = self.started + self.timeout_s
        if last_progress is not None and last_progress >= self.started:
            soft = max(soft, last_progress + self.quiet_s)
        return min(self.started + self.cap_s, soft)

    @property
    def quiet_s(self) -> float:
        """How long after its last progress a start that is past start_timeout fails."""
        return min(self.stall_s, self.timeout_s)

    def why(self, now: float, last_progress: float | None) -> str:
        """Why a start that reached its deadline failed, in the words of the profile's keys."""
        took = now - self.started
        if took >= self.cap_s - 1e-6:
            return f"not ready within its start_timeout_max of {self.cap_s:g} s"
        if last_progress is None or last_progress < self.started or last_progress + self.quiet_s <= self.started + self.timeout_s:
            return f"not ready within its start_timeout of {self.timeout_s:g} s"
        limit = f"start_stall_timeout {self.stall_s:g} s" if self.stall_s <= self.timeout_s else f"start_timeout {self.timeout_s:g} s"
        return (f"not ready within its start_timeout of {self.timeout_s:g} s, and no progress for "
                f"{now - last_progress:.0f} s since ({limit}; {took:.0f} s in all)")
