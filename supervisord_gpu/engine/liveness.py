"""Liveness that only kills the dead: what each answer of SGLang 0.5.23 means, and the verdicts.

A false kill costs a restart of 90 s to 20 min, so a server is killed only on evidence that
it cannot answer at all. Read from SGLang 0.5.23's source (shared/reference/sglang-server.md,
"second round"):

* `GET /ready` is answered by the HTTP front end's own event loop, at once and without the
  scheduler (`http_server.py:714-718`): 200 iff `server_status == Up`, not paused and not
  gracefully exiting (`tokenizer_manager.py:728-734`). A **503** is *not* death: the server is
  paused (`/pause_generation`, e.g. an RL weight sync, for as long as its caller likes), or
  latched UnHealthy because *anyone's* `/health` failed (a >= 20 s scheduler stall during the
  router's check) until a later `/health` succeeds, or draining after SIGTERM. It answered,
  so its front end lives. **No answer** within the timeout (connection refused or reset, or
  nothing read) is what a SIGSTOPped process, a wedged event loop or a dead listener gives.
* `GET /server_info` round-trips to the scheduler (`get_internal_state`). The scheduler
  handles such control requests at every iteration of its loop, also while generation is
  paused (it runs `process_input_requests` before it checks `_engine_paused`), so it answers
  at its next iteration: late under load, never while it is stopped or wedged.

Verdicts:

* the front end gave no answer `failures` probes in a row: killed, within
  `failures x (liveness_interval + liveness_timeout)` (`Probe.liveness_bound_s`);
* the front end answers but for `scheduler_timeout` (default SGLang's own
  `--watchdog-timeout`, 300 s: the time SGLang itself allows a stuck forward pass before it
  kills itself, so we are never stricter than SGLang on itself) the scheduler has neither
  answered nor **run**: the server's other processes (schedulers, detokenizer) used no CPU
  time at all. Both are needed: SGLang answers `/server_info` requests one at a time, in
  order, so anyone who floods it can delay our one probe past any timeout on a busy server
  (and with `--api-key` it answers 401); but a scheduler that works spends CPU, and one that
  is stopped (SIGSTOP) or blocked does not. Killed;
* anything else is alive. A `/ready` 503 is reported ("not serving: paused, latched by a
  failed /health, or draining") and never acted on.

We never send `/health` after ready: it runs a generation, and one that fails during a pause
latches `/ready` itself. The router's own `/health` every 60 s is what clears a latch (and
what the router uses to stop routing to a server that really fails it).

The decisions are a small state machine over observations (`LivenessWatch`), unit-tested with
a clock; `ManagedProcess` does the probing.
"""

from __future__ import annotations

from ..config.model import Probe
from ..records import dataclass
from ..sglang import timing


@dataclass(frozen=True)
class Verdict:
    """What one look concluded: kill (with why), and whether the server is serving."""

    kill: str = ""  # "" = leave it running; else the reason, in our words
    serving: bool = True  # False while /ready answers 503 (paused, latched or draining)


def front_end_alive(path: str, status: int | None) -> bool:
    """An answer that proves the process's HTTP front end runs. On SGLang's /ready a 503 does
    too (paused, latched, draining: see the module docstring); elsewhere only 200 counts."""
    if status == 200:
        return True
    return path == timing.CHEAP_STATUS_PATH and status == 503


class LivenessWatch:
    """The liveness decisions of one ready process, fed with what the probes saw.

    `front(status, now)` after each /ready probe; `scheduler_answered(now)` whenever the
    scheduler answered a round-trip. Pure: no I/O, no clock of its own.
    """

    def __init__(self, probe: Probe, now: float) -> None:
        self.probe = probe
        self.misses = 0
        self.serving = True
        self.scheduler_seen_at = now

    @property
    def asks_scheduler(self) -> bool:
        return self.probe.scheduler_path is not None

    def scheduler_answered(self, now: float) -> None:
        """The scheduler answered a round-trip, or was seen running (its CPU time moved)."""
        self.scheduler_seen_at = max(self.scheduler_seen_at, now)

    def front(self, status: int | None, now: float) -> Verdict:
        p = self.probe
        if front_end_alive(p.liveness_path, status):
            self.misses = 0
            self.serving = status == 200
        else:
            self.misses += 1
            if self.misses >= p.failures:
                got = f"answered {status}" if status is not None else "gave no answer"
                return Verdict(kill=f"{p.liveness_path} {got} {self.misses} times in a row within "
                                    f"{p.liveness_timeout_s:g} s", serving=self.serving)
        if self.asks_scheduler:
            silent = now - self.scheduler_seen_at
            if silent >= p.scheduler_timeout_s:
                return Verdict(kill=f"its scheduler answered nothing ({p.scheduler_path}) and used no CPU for "
                                    f"{silent:.0f} s (scheduler_timeout {p.scheduler_timeout_s:g} s)", serving=self.serving)
        return Verdict(serving=self.serving)
