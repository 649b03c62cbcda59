"""What parking needs of a mechanism: five calls per PID, the driver's own vocabulary.

The driver API (driver.py) and NVIDIA's utility (binary.py) do the same thing under the same
names; the simulated one (simulated.py) and the fake (fake.py) play it without a GPU. The
parking decisions and the switch never know which one they hold (runc's cgroup manager is the
model: one narrow interface, chosen once where the daemon is assembled).

The states are the driver's CUprocessState (cuda.h): RUNNING 0, LOCKED 1, CHECKPOINTED 2,
FAILED 3. A process is parked when it is CHECKPOINTED: its device memory copied to host memory
and its device allocations and handles released, so NVML shows the GPU at its baseline.
"""

from __future__ import annotations

import enum
from typing import Protocol

from ..errors import SupervisorError


class CheckpointState(enum.IntEnum):
    """CUprocessState, value for value (cuda.h); unknown values from a newer driver are refused."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3

    def __str__(self) -> str:
        return self.name.lower()


class CheckpointError(SupervisorError):
    """One call of a mechanism failed: says which call, which PID, and the driver's words.

    Never shown to a user as such: the parker turns it into a refusal (a park that failed,
    the process brought back) or a cold start (a restore that failed)."""


class CheckpointUnavailable(CheckpointError):
    """No mechanism on this machine: no libcuda with cuCheckpointProcess*, no cuda-checkpoint."""


class Checkpointer(Protocol):
    """Lock, checkpoint, restore, unlock and read the state of one process, by PID.

    Each call blocks (the driver's do: a checkpoint of 70 GB takes tens of seconds); callers
    run them in a thread. `host_bytes` says what a parked PID holds in host memory, where the
    mechanism knows it (0 where it does not)."""

    name: str

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def state(self, pid: int) -> CheckpointState: ...

    def host_bytes(self, pid: int) -> int: ...
