"""NVIDIA's CUDA driver API for checkpoints, through ctypes on libcuda: no binary to ship.

The signatures, from cuda.h (CUDA 12.8, driver 570 and later; NVIDIA's CUDA Driver API
reference, "CUDA Checkpointing", and the structs' pages):

    CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
    CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
    CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
    CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
    CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);

    struct CUcheckpointLockArgs { unsigned int timeoutMs; unsigned int reserved0;
                                  cuuint64_t reserved1[7]; };   /* 0: no timeout */

Every args pointer is "optional" in the reference: the checkpoint, restore and unlock ones are
passed as NULL here, so a later header that grows their structs (the restore args gained GPU
pairs for migration) cannot be mislaid by us. Only the lock's is built, for its timeout.

A lock blocks every further CUDA call of that process (a request waits, it is not failed); a
checkpoint copies device memory to host memory and releases the device allocations; a restore
copies it back; an unlock lets the process run on. GetState answers CUprocessState (0 running,
1 locked, 2 checkpointed, 3 failed). The driver must be at least 570 (cuDriverGetVersion
12080): older libcuda lacks the symbols, which is the "absent" this module detects.
"""

from __future__ import annotations

import ctypes
import threading

from .checkpointer import CheckpointError, CheckpointState, CheckpointUnavailable

#: the first CUDA version whose driver API has the five calls (driver 570)
MIN_DRIVER_VERSION = 12080
LIBCUDA = "libcuda.so.1"
_SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
            "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")


class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


def version_text(version: int) -> str:
    """12080 -> "12.8" (cuDriverGetVersion's encoding: 1000 * major + 10 * minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"


class DriverCheckpointer:
    """The five calls on a loaded libcuda; `open` refuses, with one line, where they are absent."""

    name = "driver-api"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._init_lock = threading.Lock()
        self._initialised = False
        for symbol in _SYMBOLS:
            getattr(lib, symbol).restype = ctypes.c_int
        lib.cuCheckpointProcessLock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)]
        for symbol in ("cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"):
            getattr(lib, symbol).argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.cuCheckpointProcessGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]

    @classmethod
    def open(cls, path: str = LIBCUDA) -> DriverCheckpointer:
        """libcuda loaded and checked: its version, then each symbol; CheckpointUnavailable names what lacks."""
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise CheckpointUnavailable(f"no CUDA driver library ({path}: {e})") from None
        version = ctypes.c_int(0)
        try:
            rc = lib.cuDriverGetVersion(ctypes.byref(version))
        except AttributeError:
            raise CheckpointUnavailable(f"{path} has no cuDriverGetVersion: not NVIDIA's driver library") from None
        if rc != 0 or version.value < MIN_DRIVER_VERSION:
            raise CheckpointUnavailable(f"the CUDA driver is {version_text(version.value)}; checkpoints need "
                                        f"{version_text(MIN_DRIVER_VERSION)} (driver 570) or later")
        missing = [s for s in _SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise CheckpointUnavailable(f"{path} lacks {', '.join(missing)}")
        return cls(lib)

    def _ensure_init(self) -> None:
        """cuInit(0) once: every driver API call but the version needs it. It creates no context
        (no GPU memory, nothing NVML lists): the daemon never becomes a CUDA process itself."""
        with self._init_lock:
            if not self._initialised:
                self._check(self.lib.cuInit(0), "cuInit", 0)
                self._initialised = True

    def _error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        try:
            if self.lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
                return name.value.decode(errors="replace")
        except AttributeError:
            pass
        return f"CUresult {rc}"

    def _check(self, rc: int, call: str, pid: int) -> None:
        if rc != 0:
            raise CheckpointError(f"{call}(pid {pid}) failed: {self._error_name(rc)}")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._ensure_init()
        args = CUcheckpointLockArgs(timeoutMs=max(0, int(timeout_ms)))
        self._check(self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)), "cuCheckpointProcessLock", pid)

    def checkpoint(self, pid: int) -> None:
        self._ensure_init()
        self._check(self.lib.cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int) -> None:
        self._ensure_init()
        self._check(self.lib.cuCheckpointProcessRestore(pid, None), "cuCheckpointProcessRestore", pid)

    def unlock(self, pid: int) -> None:
        self._ensure_init()
        self._check(self.lib.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock", pid)

    def state(self, pid: int) -> CheckpointState:
        self._ensure_init()
        value = ctypes.c_int(-1)
        self._check(self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(value)), "cuCheckpointProcessGetState", pid)
        try:
            return CheckpointState(value.value)
        except ValueError:
            raise CheckpointError(f"cuCheckpointProcessGetState(pid {pid}) answered {value.value}, "
                                  "a state this supervisor does not know") from None

    def host_bytes(self, pid: int) -> int:
        """The driver does not say: the Parker then counts the bytes the GPU listed for the PID
        (cuda-checkpoint copies all of them), and the device script measures the RSS growth."""
        return 0
