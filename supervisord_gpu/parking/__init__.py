"""Parking a profile: its CUDA processes suspended into host memory, and brought back.

checkpointer.py  the protocol (lock, checkpoint, restore, unlock, state per PID) and its states
driver.py        NVIDIA's driver API (cuCheckpointProcess*, driver >= 570) through ctypes on libcuda
binary.py        NVIDIA's `cuda-checkpoint` utility where it is installed
simulated.py     the rehearsal's: a stand-in's simulated GPU memory moved aside, as if to host
fake.py          an in-memory one for the decisions' tests
decisions.py     the pure decisions: which PIDs, enough host memory, what a restore's outcome means
hostmem.py       MemAvailable, read from /proc/meminfo into a typed figure
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpointer import Checkpointer


def open_checkpointer(simgpu_dir: str | None = None, libcuda: str | None = None,
                      binary: str | None = None) -> Checkpointer:
    """The machine's mechanism, chosen once where the daemon is assembled: the simulated GPUs'
    for a rehearsal (`simgpu_dir`); else the driver API (no binary to ship), else NVIDIA's
    utility; else CheckpointUnavailable naming why each is missing, in one line."""
    from .checkpointer import CheckpointUnavailable

    if simgpu_dir:
        from ..checks.simgpu import SimulatedGpus
        from .simulated import SimulatedCheckpointer

        return SimulatedCheckpointer(SimulatedGpus(simgpu_dir))
    from .binary import BinaryCheckpointer
    from .driver import LIBCUDA, DriverCheckpointer

    reasons = []
    try:
        return DriverCheckpointer.open(libcuda or LIBCUDA)
    except CheckpointUnavailable as e:
        reasons.append(str(e))
    try:
        return BinaryCheckpointer.open(binary)
    except CheckpointUnavailable as e:
        reasons.append(str(e))
    raise CheckpointUnavailable("no way to park on this machine: " + "; ".join(reasons))
