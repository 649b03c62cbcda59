"""GPU inventory: which GPUs exist, how much memory is in use, which processes hold them, idle or not.

Two backends behind one small interface, chosen once: NVML for real GPUs, and the simulated
store (checks/simgpu.py) for rehearsal and tests. Callers never know which one they hold.

"Idle" is a fact we observe, never a hard-coded number: no process is listed on the GPU and
the memory in use is at the GPU's idle baseline, within a small tolerance. The baseline
differs per GPU model and driver (615 MiB of v1 `used` on an H200 with driver 580, 4 MiB on
other cards), so it is either excluded by the driver itself (memory info v2 reports
driver-reserved memory apart from `used`), configured per GPU, or learned.

pynvml is imported only when an NVML inventory is opened: `gpusupctl` commands that never
touch a GPU must not pay its import (~30 ms).
"""

from __future__ import annotations

import os
from pathlib import Path
from abc import ABC, abstractmethod
from ..records import dataclass
from typing import Any
from collections.abc import Iterable

from ..config.model import DaemonConfig
from ..errors import EXIT_PRECONDITIONS, SupervisorError, UsageError
from .simgpu import SimulatedGpus

# Memory in use (above the baseline) still counted as idle. Big enough to absorb what the
# driver and a persistence daemon take or give back between samples (a few MiB to ~100 MiB
# of context and page-table memory, which also varies by driver), small enough that no real
# workload fits: a CUDA context alone costs ~300-500 MiB on Hopper, and a server that
# loaded anything holds gigabytes. Configurable as gpus.idle_tolerance_mib.
DEFAULT_TOLERANCE_MIB = 256

# A baseline learned from a GPU with no process listed is trusted only below this: more than
# that with nothing listed means a holder NVML does not show us (another container without
# permission, say), and learning it would make a busy GPU look idle forever.
MAX_LEARNED_BASELINE_MIB = 4096

MIB = 1024 * 1024

# The inode of the initial PID namespace (PROC_PID_INIT_INO in the kernel); NVML reports PIDs
# of that namespace, so in any other one its PIDs cannot be taken at face value.
_INIT_PID_NS_INO = 0xEFFFFFFC

NVML_INSTALL_HINT = (
    "install the NVML bindings and library: on Debian `apt install python3-pynvml` (contrib) and "
    "the NVIDIA driver's libnvidia-ml1 (non-free), or `pip install nvidia-ml-py` in a venv; "
    'or set backend = "simulated" under [gpus] to rehearse without GPUs'
)


class NvmlUnavailable(SupervisorError):
    """NVML cannot be used here (bindings or library missing, driver not loaded, GPU lost)."""

    exit_code = EXIT_PRECONDITIONS


@dataclass(frozen=True)
class GpuProcess:
    """A process the GPU lists; used_mib is None where the driver does not say (MIG, no permission)."""

    pid: int
    used_mib: int | None


@dataclass(frozen=True)
class GpuState:
    """One GPU at one instant.

    used_mib: memory in use as the backend reports it (v2 `used`, or v1 `used` which includes
    the driver's reservation); baseline_mib: the part of used_mib that is there when the GPU is
    idle (0 with v2); reserved_mib: driver-reserved memory, for display.
    """

    index: int
    uuid: str
    name: str
    total_mib: int
    used_mib: int
    reserved_mib: int
    baseline_mib: int
    processes: tuple[GpuProcess, ...]
    idle: bool

    @property
    def in_use_mib(self) -> int:
        """Memory in use above the idle baseline: what a workload holds."""
        return max(0, self.used_mib - self.baseline_mib)


def judge_idle(used_mib: int, baseline_mib: int, processes: tuple[GpuProcess, ...], tolerance_mib: int) -> bool:
    """The one rule both backends apply: nothing listed, and memory at the baseline within tolerance."""
    return not processes and used_mib - baseline_mib <= tolerance_mib


class GpuInventory(ABC):
    """The GPUs of this machine, read on demand. Implementations are cheap to poll (µs per GPU)."""

    kind: str = ""
    tolerance_mib: int = DEFAULT_TOLERANCE_MIB

    @abstractmethod
    def count(self) -> int:
        """How many GPUs there are; valid indices are 0 .. count()-1."""

    @abstractmethod
    def snapshot(self, indices: Iterable[int] | None = None) -> list[GpuState]:
        """The state of the given GPUs (default: all), in index order; indices that do not exist are left out."""

    def close(self) -> None:  # noqa: B027  (a hook: most backends hold nothing to release)
        """Release the backend; the inventory is not used afterwards."""

    @property
    def pids_local(self) -> bool:
        """Whether the PIDs in GpuState.processes are PIDs of this PID namespace.

        When False, a PID must be verified before it is attributed (see holders.describe_gpu_pid).
        """
        return True

    def _wanted(self, indices: Iterable[int] | None) -> list[int]:
        n = self.count()
        if indices is None:
            return list(range(n))
        return sorted({i for i in indices if 0 <= i < n})


# ----------------------------------------------------------------------------- NVML


class NvmlInventory(GpuInventory):
    """Real GPUs through NVML.

    Memory: memory info v2 where the driver has it; its `used` excludes driver-reserved memory,
    so the idle baseline is 0. Where only v1 exists, `used` includes the reservation, and the
    baseline is, per GPU: the configured `baseline_mib[index]`, else learned — the lowest v1
    `used` seen on that GPU while it listed no process at all (compute, graphics or MPS), kept
    for the life of this object and trusted only up to MAX_LEARNED_BASELINE_MIB. Until a GPU
    has been seen empty once, its baseline is 0, which errs towards "not idle". A configured
    baseline applies to v1 only: it is a v1 `used` figure.

    Processes: compute, graphics and MPS lists merged by PID. NVML reports PIDs of the initial
    PID namespace (NVIDIA does not support PID namespaces), so `pids_local` says whether they
    can be looked up here at all.
    """

    kind = "nvml"

    def __init__(self, tolerance_mib: int = DEFAULT_TOLERANCE_MIB, baseline_mib: dict[int, int] | None = None) -> None:
        self.tolerance_mib = tolerance_mib
        self.configured_baseline: dict[int, int] = dict(baseline_mib or {})
        self.learned_baseline: dict[int, int] = {}
        try:
            import pynvml
        except ImportError as e:
            raise NvmlUnavailable(f"cannot check GPUs: the NVML Python bindings are missing ({e}); {NVML_INSTALL_HINT}") from None
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise NvmlUnavailable(f"cannot check GPUs: libnvidia-ml.so.1 (NVML) not found; {NVML_INSTALL_HINT}") from None
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(
                f"cannot check GPUs: NVML failed to start ({e}); is the NVIDIA driver loaded (nvidia-smi)?"
            ) from None
        self._open = True
        try:
            self._count = int(pynvml.nvmlDeviceGetCount())
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self._count)]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except pynvml.NVMLError as e:
            self.close()
            raise NvmlUnavailable(f"cannot list GPUs through NVML: {e}") from None
        self._v2: list[bool] = [self._probe_v2(h) for h in self._handles]
        self._pids_local = _in_initial_pid_namespace()

    @property
    def pids_local(self) -> bool:
        return self._pids_local

    def count(self) -> int:
        return self._count

    def memory_v2_supported(self, index: int) -> bool:
        return self._v2[index]

    def snapshot(self, indices: Iterable[int] | None = None) -> list[GpuState]:
        return [self._read(i) for i in self._wanted(indices)]

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def _probe_v2(self, handle: Any) -> bool:
        nvml = self._nvml
        try:
            nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            return True
        except (AttributeError, TypeError, nvml.NVMLError):  # old bindings, or a driver without _v2
            return False

    def _read(self, index: int) -> GpuState:
        nvml = self._nvml
        handle = self._handles[index]
        try:
            if self._v2[index]:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                reserved = int(mem.reserved) // MIB
            else:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                reserved = 0
            processes = self._processes(handle)
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"cannot read GPU {index} ({self._uuids[index]}) through NVML: {e}") from None
        used = int(mem.used) // MIB
        if self._v2[index]:
            baseline = 0
        elif index in self.configured_baseline:
            baseline = self.configured_baseline[index]
        else:
            if not processes and used <= MAX_LEARNED_BASELINE_MIB:
                self.learned_baseline[index] = min(used, self.learned_baseline.get(index, used))
            baseline = self.learned_baseline.get(index, 0)
        return GpuState(
            index=index,
            uuid=self._uuids[index],
            name=self._names[index],
            total_mib=int(mem.total) // MIB,
            used_mib=used,
            reserved_mib=reserved,
            baseline_mib=baseline,
            processes=processes,
            idle=judge_idle(used, baseline, processes, self.tolerance_mib),
        )

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        nvml = self._nvml
        found: dict[int, int | None] = {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                       "nvmlDeviceGetMPSComputeRunningProcesses"):
            fn = getattr(nvml, getter, None)
            if fn is None:
                continue
            try:
                listed = fn(handle)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
                continue  # graphics or MPS lists on a GPU or driver without them
            for p in listed:
                used = getattr(p, "usedGpuMemory", None)
                mib = None if used is None or used < 0 or used >= 2**63 else int(used) // MIB
                if p.pid not in found or found[p.pid] is None:
                    found[int(p.pid)] = mib
        return tuple(GpuProcess(pid, mib) for pid, mib in sorted(found.items()))


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _in_initial_pid_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INIT_PID_NS_INO
    except OSError:
        return False


# ----------------------------------------------------------------------------- simulated


class SimulatedInventory(GpuInventory):
    """The simulated store as an inventory: used = the live holdings on a GPU, baseline 0.

    Reserved memory is reported like NVML's v2 does (apart from `used`), so the same idle rule
    applies unchanged. devices.json is re-read only when it changes (one stat per snapshot).
    """

    kind = "simulated"

    def __init__(self, sim: SimulatedGpus, tolerance_mib: int = DEFAULT_TOLERANCE_MIB) -> None:
        if not sim.exists():
            raise UsageError(f"no simulated GPUs in {sim.directory} (devices.json missing); run a rehearsal to create them")
        self.sim = sim
        self.tolerance_mib = tolerance_mib
        self._devices_key: tuple[int, int] | None = None
        self._devices: list[Any] = []

    def count(self) -> int:
        return len(self._current_devices())

    def snapshot(self, indices: Iterable[int] | None = None) -> list[GpuState]:
        devices = self._current_devices()
        wanted = set(range(len(devices))) if indices is None else set(indices)
        wanted = {i for i in wanted if 0 <= i < len(devices)}
        if not wanted:
            return []
        used: dict[int, int] = {}
        procs: dict[int, list[GpuProcess]] = {}
        for h in self.sim.holders():
            for g in h.gpus:
                if g in wanted:
                    used[g] = used.get(g, 0) + h.mib
                    procs.setdefault(g, []).append(GpuProcess(h.pid, h.mib))
        states = []
        for d in devices:
            if d.index not in wanted:
                continue
            p = tuple(sorted(procs.get(d.index, ()), key=lambda x: x.pid))
            u = used.get(d.index, 0)
            states.append(GpuState(d.index, d.uuid, d.name, d.total_mib, u, d.reserved_mib, 0, p,
                                   judge_idle(u, 0, p, self.tolerance_mib)))
        return states

    def _current_devices(self) -> list[Any]:
        st = os.stat(self.sim.directory / "devices.json")
        key = (st.st_mtime_ns, st.st_ino)
        if key != self._devices_key:
            self._devices = sorted(self.sim.devices(), key=lambda d: d.index)
            self._devices_key = key
        return self._devices


# ----------------------------------------------------------------------------- choosing one


def open_inventory(
    backend: str = "auto",
    simgpu_dir: str | None = None,
    tolerance_mib: int = DEFAULT_TOLERANCE_MIB,
    baseline_mib: dict[int, int] | None = None,
) -> GpuInventory:
    """The inventory for a backend name: "nvml", "simulated", or "auto" (simulated if a directory is given)."""
    if backend == "auto":
        backend = "simulated" if simgpu_dir else "nvml"
    if backend == "simulated":
        if not simgpu_dir:
            raise UsageError('gpus backend "simulated" needs a simulated GPU directory')
        return SimulatedInventory(SimulatedGpus(simgpu_dir), tolerance_mib)
    if backend == "nvml":
        return NvmlInventory(tolerance_mib=tolerance_mib, baseline_mib=baseline_mib)
    raise UsageError(f'unknown gpus backend {backend!r} (expected "auto", "nvml" or "simulated")')


def simgpu_dir(cfg: DaemonConfig) -> Path:
    """Where the simulated GPUs live: the config's `rehearsal.simgpu_dir`, else under the runtime directory."""
    return Path(cfg.rehearsal.simgpu_dir) if cfg.rehearsal.simgpu_dir else cfg.runtime_dir / "simgpu"


def _check_simgpu_dir(directory: Path) -> None:
    """As root, simulated GPUs found made are read only if they are root's as `create` leaves
    them: the directory and every one above it root's and writable by nobody else
    (config/trust.check_modes), holders/ and devices.json root's, neither a symlink. A user who
    made them first (a `simgpu_dir` under /tmp) would write the GPUs root decides by, and own
    the holders/ above root's holdings, which root's parker renames by path. Not root: a
    user's reader trusts what it likes (it writes nothing of anyone else's)."""
    if os.geteuid() != 0:
        return
    from ..config.trust import check_modes

    check_modes(directory)
    for path in (directory / "holders", directory / "devices.json"):
        try:
            st = os.lstat(path)
        except OSError as e:
            raise UsageError(f"simulated GPUs in {directory}: {path.name}: {e.strerror}") from None
        if os.path.islink(path) or st.st_uid != 0 or (path.name == "devices.json" and st.st_mode & 0o022):
            raise UsageError(f"refusing simulated GPUs in {directory}: {path.name} is owned by uid {st.st_uid} "
                             f"(mode {st.st_mode & 0o7777:04o}), not root's as they are made")


def inventory_for(cfg: DaemonConfig, simulated: bool) -> GpuInventory:
    """The machine's GPUs as the config says to read them: NVML, or the simulated GPUs (created
    on first use, with the rehearsal's count and memory) when `simulated` or `gpus.backend =
    "simulated"`. Built once per process by the assembly (daemon.py's Backends) and handed down."""
    if simulated or cfg.gpus.backend == "simulated":
        directory = simgpu_dir(cfg)
        if not SimulatedGpus(directory).exists():
            SimulatedGpus.create(directory, cfg.rehearsal.gpu_count, cfg.rehearsal.gpu_memory_mib)
        else:
            _check_simgpu_dir(directory)
        return open_inventory("simulated", simgpu_dir=str(directory), tolerance_mib=cfg.gpus.idle_tolerance_mib)
    return open_inventory("nvml", tolerance_mib=cfg.gpus.idle_tolerance_mib, baseline_mib=dict(cfg.gpus.baseline_mib) or None)
