"""The crash-loop limit of a dsv4@ instance: automatic restarts count, starts by hand do not.

systemd's own start limit (StartLimitBurst= in StartLimitIntervalSec=) counts every start,
an operator's `gpusupctl restart` as much as systemd's Restart=on-failure; three restarts by
hand in ten minutes used to lock an instance out. So the unit keeps that limit only as a
generous backstop, and the daemon enforces the real one from systemd's `NRestarts` of its own
unit (org.freedesktop.systemd1.Service), which in systemd 252 (src/core/service.c):

- grows by one each time systemd schedules an automatic restart (service_enter_restart);
- is flushed at the next start that is not an automatic restart (service_start: "This is not
  an automatic restart? Flush the restart counter then"), that is a start, restart or
  reset-failed by hand, and by reset-failed (service_reset_failed), even of an active unit;
  reset-failed also resets the start rate limit (unit_reset_failed).

At start-up, before it loads anything, the daemon reads NRestarts; at RESTART_LIMIT or more it
refuses with exit 6 (RestartPreventExitStatus=: not retried), the reason in STATUS=.
NRestarts never decays by itself, so once the instance has been ready for the unit's
StartLimitIntervalSec= (600 s as shipped) without a break, the daemon calls ResetFailedUnit on
its own unit: crashes older than a long healthy stretch stop counting (StartLimitIntervalSec=0:
at once when ready; infinity: never).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from ..errors import EXIT_GAVE_UP, SupervisorError
from ..names import service_name

#: automatic restarts since the last start by hand at which the daemon refuses to start: the
#: start by hand and two automatic restarts ran SGLang; the third automatic one is refused.
RESTART_LIMIT = 3
#: the forgiveness window when the unit does not say (its StartLimitIntervalSec= as shipped)
DEFAULT_WINDOW_S = 600.0
#: StartLimitIntervalUSec= of "infinity"
_USEC_INFINITY = 2**64 - 1

Say = Callable[[str, int], None]


class RestartLimitReached(SupervisorError):
    """NRestarts of our unit at the limit: a crash loop, stopped before it costs another start."""

    exit_code = EXIT_GAVE_UP


def reason(instance: str, n_restarts: int) -> str:
    return (f"restart limit reached: {n_restarts} automatic restarts since the last start by hand "
            f"(why each failed: journalctl -u {service_name(instance)}); gpusupctl start {instance} to try again")


class OwnUnit:
    """The daemon's own dsv4@NAME.service as systemd sees it, or nothing when the daemon does
    not run as that unit (a terminal, a rehearsal, no system bus)."""

    def __init__(self, instance: str, systemd: Any, path: str) -> None:
        self.instance = instance
        self.unit = service_name(instance)
        self.systemd = systemd
        self.path = path
        #: how long ready without a break forgives earlier crashes (read by check_at_start)
        self.window = DEFAULT_WINDOW_S

    @classmethod
    def find(cls, instance: str) -> OwnUnit | None:
        if not os.environ.get("INVOCATION_ID"):  # not started by systemd: no unit to ask
            return None
        try:
            from .manager import Systemd

            systemd = Systemd()
            path = systemd.unit_of_pid(os.getpid())
            if path is None or systemd.unit_id(path) != service_name(instance):
                return None  # another unit (systemd-run, a test's): not ours to count
        except Exception:  # no bus, no PyGObject: run without the limit rather than not at all
            return None
        return cls(instance, systemd, path)

    def n_restarts(self) -> int:
        return self.systemd.n_restarts(self.path)

    def window_s(self) -> float:
        try:
            usec = self.systemd.start_limit_interval_usec(self.path)
        except SupervisorError:
            return DEFAULT_WINDOW_S
        return float("inf") if usec >= _USEC_INFINITY else usec / 1e6

    def forget_restarts(self) -> None:
        self.systemd.reset_failed_unit(self.unit)


def check_at_start(instance: str) -> OwnUnit | None:
    """Refuse (RestartLimitReached, exit 6) when systemd has restarted us RESTART_LIMIT times
    since the last start by hand. Returns our unit, for ForgetWhenHealthy, or None."""
    own = OwnUnit.find(instance)
    if own is None:
        return None
    try:
        n = own.n_restarts()
    except SupervisorError:
        return own  # unreadable: start (a false refusal costs more than one more crash)
    own.window = own.window_s()
    if n >= RESTART_LIMIT:
        raise RestartLimitReached(reason(instance, n))
    return own


class ForgetWhenHealthy:
    """An instance listener: after `window_s` of readiness without a break, reset-failed our own
    unit (NRestarts back to 0) when systemd has restarted us; leaving ready cancels the wait."""

    def __init__(self, own: OwnUnit, loop: asyncio.AbstractEventLoop, say: Say, window_s: float | None = None) -> None:
        self.own = own
        self.loop = loop
        self.say = say
        self.window_s = own.window if window_s is None else window_s
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def on_event(self, event: Any) -> None:
        if event.kind != "instance" or not event.state:
            return
        if event.state == "ready":
            if self._timer is None and self.window_s != float("inf"):
                self._timer = self.loop.call_later(self.window_s, self._due)
        else:
            self.cancel()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        self._task = self.loop.create_task(self._forget())

    async def _forget(self) -> None:
        try:
            n = await asyncio.to_thread(self.own.n_restarts)
            if n == 0:
                return
            await asyncio.to_thread(self.own.forget_restarts)
        except SupervisorError as e:
            self.say(f"could not reset the restart count of {self.own.unit}: {e}", 4)
            return
        self.say(f"ready for {self.window_s:g} s: {n} earlier automatic restart(s) of {self.own.unit} "
                 "no longer count toward its restart limit", 6)
