"""NVIDIA's `cuda-checkpoint` utility, where it is installed (github.com/NVIDIA/cuda-checkpoint).

Its interface: `cuda-checkpoint --get-state --pid PID` prints the state word (running, locked,
checkpointed, failed); `--toggle --pid PID` checkpoints a running process (lock + checkpoint) or
restores a checkpointed one (restore + unlock). It has no separate lock, so `lock` here only
checks that the process is running, and `checkpoint` is the toggle; `restore` is the toggle
back and `unlock` checks the result. This is what was measured on the real SGLang (an H100,
driver 580.159): 21.7 GB parked in 12.0 s and back in 4.1 s.

Its output is the utility's, a binary of root's found on PATH (believed root's only where it and
every directory above it are writable by root alone, config/trust.py): parsed into CheckpointState, any
other word refused.
"""

from __future__ import annotations

import shutil
import subprocess

from ..config.trust import untrusted_program
from .checkpointer import CheckpointError, CheckpointState, CheckpointUnavailable

BINARY = "cuda-checkpoint"
_WORDS = {s.name.lower(): s for s in CheckpointState}
TOGGLE_TIMEOUT_S = 600.0


class BinaryCheckpointer:
    name = "cuda-checkpoint"

    def __init__(self, path: str, run: object = subprocess.run) -> None:
        self.path = path
        self._run = run

    @classmethod
    def open(cls, path: str | None = None) -> BinaryCheckpointer:
        found = path or shutil.which(BINARY)
        if not found:
            raise CheckpointUnavailable(f"no {BINARY} on PATH")
        if why := untrusted_program(found):  # root runs it: never a file another user could have put there
            raise CheckpointUnavailable(f"{BINARY} on PATH is not root's alone: {why}")
        return cls(found)

    def _call(self, *argv: str, timeout: float = 30.0) -> str:
        try:
            done = self._run([self.path, *argv], capture_output=True, text=True, timeout=timeout)  # type: ignore[operator]
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CheckpointError(f"{BINARY} {' '.join(argv)}: {e}") from None
        if done.returncode != 0:
            why = (done.stderr or done.stdout or "").strip().splitlines()
            raise CheckpointError(f"{BINARY} {' '.join(argv)} exited {done.returncode}: {why[-1] if why else 'no output'}")
        return str(done.stdout)

    def state(self, pid: int) -> CheckpointState:
        word = self._call("--get-state", "--pid", str(pid)).strip().lower()
        if word not in _WORDS:
            raise CheckpointError(f"{BINARY} --get-state --pid {pid} answered {word[:40]!r}, not a state")
        return _WORDS[word]

    def _expect(self, pid: int, want: CheckpointState, after: str) -> None:
        now = self.state(pid)
        if now != want:
            raise CheckpointError(f"pid {pid} is {now} after {after}, not {want}")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._expect(pid, CheckpointState.RUNNING, "nothing (the utility locks as it checkpoints)")

    def checkpoint(self, pid: int) -> None:
        self._call("--toggle", "--pid", str(pid), timeout=TOGGLE_TIMEOUT_S)
        self._expect(pid, CheckpointState.CHECKPOINTED, "--toggle")

    def restore(self, pid: int) -> None:
        # --toggle checkpoints a running process: only one that is checkpointed is toggled back
        self._expect(pid, CheckpointState.CHECKPOINTED, "nothing (before the toggle back)")
        self._call("--toggle", "--pid", str(pid), timeout=TOGGLE_TIMEOUT_S)

    def unlock(self, pid: int) -> None:
        self._expect(pid, CheckpointState.RUNNING, "--toggle back")

    def host_bytes(self, pid: int) -> int:
        return 0
