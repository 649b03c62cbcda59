"""A checkpointer in memory, for the parking decisions' tests: every call recorded, any call
made to fail for any PID, the driver's state rules kept (a lock only of a running process, a
checkpoint only of a locked one, a restore only of a checkpointed one, an unlock of a locked one)."""

from __future__ import annotations

from .checkpointer import CheckpointError, CheckpointState


class FakeCheckpointer:
    name = "fake"

    def __init__(self, gpu_bytes: dict[int, int] | None = None) -> None:
        #: what each PID holds on its GPU; what a checkpoint moves to host memory
        self.gpu_bytes = dict(gpu_bytes or {})
        self.states: dict[int, CheckpointState] = {}
        self.parked_bytes: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        #: (call, pid) pairs that fail, e.g. {("restore", 42)}
        self.fail: set[tuple[str, int]] = set()

    def _enter(self, call: str, pid: int, need: CheckpointState) -> None:
        self.calls.append((call, pid))
        if (call, pid) in self.fail:
            raise CheckpointError(f"{call}(pid {pid}) failed: CUDA_ERROR_NOT_SUPPORTED (fake)")
        now = self.states.get(pid, CheckpointState.RUNNING)
        if now != need:
            raise CheckpointError(f"{call}(pid {pid}) failed: CUDA_ERROR_ILLEGAL_STATE (it is {now}, not {need})")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._enter("lock", pid, CheckpointState.RUNNING)
        self.states[pid] = CheckpointState.LOCKED

    def checkpoint(self, pid: int) -> None:
        self._enter("checkpoint", pid, CheckpointState.LOCKED)
        self.states[pid] = CheckpointState.CHECKPOINTED
        self.parked_bytes[pid] = self.gpu_bytes.pop(pid, 0)

    def restore(self, pid: int) -> None:
        self._enter("restore", pid, CheckpointState.CHECKPOINTED)
        self.states[pid] = CheckpointState.LOCKED
        self.gpu_bytes[pid] = self.parked_bytes.pop(pid, 0)

    def unlock(self, pid: int) -> None:
        self._enter("unlock", pid, CheckpointState.LOCKED)
        self.states[pid] = CheckpointState.RUNNING

    def state(self, pid: int) -> CheckpointState:
        self.calls.append(("state", pid))
        return self.states.get(pid, CheckpointState.RUNNING)

    def host_bytes(self, pid: int) -> int:
        return self.parked_bytes.get(pid, 0)
