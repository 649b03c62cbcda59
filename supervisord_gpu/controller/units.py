"""What a takeover asks of systemd: the dsv4@ units, stop one and wait, queue a start.

systemd/manager.py's `Systemd` is the one implementation; the daemon makes it once (under
systemd only) and hands it to the LocalTransition, and the fast tests hand a fake that records
what it was told. Nothing in controller/ connects to the bus on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class UnitState(Protocol):
    @property
    def instance(self) -> str: ...

    @property
    def active(self) -> str: ...


class StopResult(Protocol):
    @property
    def result(self) -> str: ...

    @property
    def done(self) -> bool: ...


class Units(Protocol):
    def instances(self) -> Sequence[UnitState]:
        """Every loaded dsv4@ instance and its ActiveState."""

    def stop(self, unit: str, **kw: Any) -> StopResult:
        """StopUnit, waited for (keyword `timeout`) until systemd's JobRemoved or the timeout
        ("timeout-waiting")."""

    def queue(self, method: str, unit: str) -> str:
        """Queue a job ("StartUnit") and return at once."""
