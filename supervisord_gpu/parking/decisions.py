"""The parking decisions, as pure functions of what was read: tested in milliseconds (fast tier).

Which processes to park: those of the profile's own cgroups that the GPUs list as holding
memory (NVML per process, or the simulated GPUs). SGLang's tokenizer, detokenizer and router
hold no CUDA context; its schedulers do. A PID the GPU lists that is not in our cgroups is
never ours to park, whatever its name.

Whether the host can take it: MemAvailable against the bytes to park plus a margin, refused
with one line naming the three figures. The bytes to park are what the GPUs say the processes
hold (cuda-checkpoint copies all of it, the KV pool included).

Which of its processes are held while it is parked: every other process of a server whose
scheduler is checkpointed (its front end, its detokenizer) is stopped with SIGSTOP before the
lock and continued after the restore. On the real SGLang 0.5.23 (an H100, driver 580, the
driver API, 2026-12-07) one request sent to a parked server's front end crashed its
checkpointed scheduler a second later (SIGSEGV in cudaEventQuery, from the pinned host
allocator preparing the batch): the driver's lock does not hold every CUDA call. Held, the front
end takes no request (the kernel keeps the connection in its backlog) until the restore.

Which of its processes stop while it is parked: a parked profile's processes all keep running
(only the CUDA ones are checkpointed), so their ports stay taken. A router holds no CUDA memory
and takes the profile out of traffic anyway: one whose port the next profile needs (pd-1p1d's
and tp4-512k's share 30001: clients never change port) is stopped after the drain and started
again at the restore. A server's front end cannot be stopped apart from its scheduler: a server
in the way refuses the park.

What a restore's outcome means: serving again, or a cold start of the profile, said so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..checks.gpus import GpuState
from ..records import dataclass, field

MIB = 1 << 20
GIB = 1 << 30
#: host memory kept free beyond the bytes parked: the kernel, the daemon, page cache under pressure
HOST_MARGIN_MIN_BYTES = 4 * GIB
HOST_MARGIN_FRACTION = 0.05


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


@dataclass(frozen=True)
class ParkTarget:
    """One CUDA process of the profile: which of its processes, the PID, what it holds on GPUs."""

    process: str
    pid: int
    gpu_bytes: int


@dataclass(frozen=True)
class Held:
    """A process of a parked server that holds no GPU memory (a front end, a detokenizer), held
    with SIGSTOP while its scheduler is checkpointed, so no request reaches the scheduler."""

    process: str
    pid: int


def held_while_parked(pids_by_process: Mapping[str, Iterable[int]], targets: Iterable[ParkTarget]) -> list[Held]:
    """Every PID of a process that has a checkpointed PID, other than those: the rest of each
    parked server. A process with nothing checkpointed (a router) is not held."""
    targets = list(targets)
    parked = {t.pid for t in targets}
    holding = {t.process for t in targets}
    return [Held(name, pid) for name, pids in pids_by_process.items() if name in holding
            for pid in sorted(set(pids)) if pid not in parked]


@dataclass(frozen=True)
class StoppedWhileParked:
    """A process of a parked profile stopped for the next one (a router in its way), to be
    started again at the restore; not crashed, and nothing restarts it meanwhile."""

    process: str
    #: its ports the next profile needs
    ports: tuple[int, ...]
    #: the profile that needs them
    needed_by: str

    def why(self) -> str:
        """"stopped while parked: tp4-512k needs port 30001": its stop's reason (its last_exit)."""
        return (f"stopped while parked: {self.needed_by} needs port{'s' if len(self.ports) > 1 else ''} "
                f"{','.join(map(str, self.ports))}")

    def describe(self) -> str:
        """"router stopped while parked (tp4-512k needs port 30001)": in the parked reason."""
        return f"{self.process} {self.why().replace(': ', ' (', 1)})"


@dataclass
class ParkedProfile:
    """A parked profile as the supervisor owns it: shown by `status`, exempt from liveness,
    never a foreign holder, ended by `stop`."""

    instance: str
    mechanism: str
    targets: list[ParkTarget]
    host_bytes: int
    since: float
    took_s: float = 0.0
    #: the ports it keeps listening on while parked (controller/parked.py: a takeover reads them)
    ports: list[int] = field(default_factory=list)
    stopped: list[StoppedWhileParked] = field(default_factory=list)
    #: the rest of each parked server, held with SIGSTOP until the restore
    held: list[Held] = field(default_factory=list)
    #: servers whose KV pool SGLang's memory saver released before the checkpoint (parking/saver.py)
    released: list[str] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [t.pid for t in self.targets]

    def describe(self) -> str:
        """"0 MiB on the GPU, 21.7 GB host (server pid 123), via driver-api": the instance's reason
        while parked, so STATUS= and `gpusupctl status` read "parked: 0 MiB on the GPU, ..."."""
        who = ", ".join(f"{t.process} pid {t.pid}" for t in self.targets)
        stopped = "".join(f"; {s.describe()}" for s in self.stopped)
        kv = f", KV pool released ({', '.join(self.released)})" if self.released else ""
        return f"0 MiB on the GPU, {gb(self.host_bytes)} host ({who}), via {self.mechanism}{kv}{stopped}"

    def to_json(self) -> dict[str, object]:
        return {"instance": self.instance, "mechanism": self.mechanism, "host_bytes": self.host_bytes,
                "since": self.since, "took_s": round(self.took_s, 3), "ports": list(self.ports),
                "pids": [{"process": t.process, "pid": t.pid, "gpu_bytes": t.gpu_bytes} for t in self.targets],
                "stopped": [{"process": s.process, "ports": list(s.ports), "needed_by": s.needed_by} for s in self.stopped],
                "held": [{"process": h.process, "pid": h.pid} for h in self.held],
                "released": list(self.released)}


def find_targets(pids_by_process: Mapping[str, Iterable[int]], gpus: Iterable[GpuState]) -> list[ParkTarget]:
    """The profile's processes the GPUs list as holders, each PID once, its bytes summed over GPUs.

    A holder whose memory the driver does not report (None: MIG, no permission) counts as 0
    bytes but is still parked: leaving it would leave the GPU held."""
    held: dict[int, int] = {}
    for g in gpus:
        for p in g.processes:
            held[p.pid] = held.get(p.pid, 0) + (p.used_mib or 0) * MIB
    out = []
    for process, pids in pids_by_process.items():
        for pid in sorted(set(pids)):
            if pid in held:
                out.append(ParkTarget(process, pid, held[pid]))
    return out


def host_margin(need_bytes: int) -> int:
    return max(HOST_MARGIN_MIN_BYTES, int(need_bytes * HOST_MARGIN_FRACTION))


def host_memory_refusal(instance: str, need_bytes: int, available_bytes: int | None) -> str:
    """"" when MemAvailable covers the bytes to park plus the margin; else the one line that says why not."""
    margin = host_margin(need_bytes)
    if available_bytes is None:
        return f"refusing to park {instance}: host memory available is unknown (/proc/meminfo has no MemAvailable)"
    if available_bytes < need_bytes + margin:
        return (f"refusing to park {instance}: host memory available {gb(available_bytes)}, needed "
                f"{gb(need_bytes)} to park + {gb(margin)} margin")
    return ""


def nothing_to_park_refusal(instance: str, targets: list[ParkTarget]) -> str:
    if targets:
        return ""
    return f"refusing to park {instance}: none of its processes holds GPU memory (nothing to park; stop it instead)"


def port_refusal(parked: str, parked_ports: Iterable[int], wanted: str, wanted_ports: Iterable[int]) -> str:
    """A parked profile's servers keep listening (only their GPU memory leaves): a profile that
    needs one of their ports cannot start beside it. `parked_ports` are its servers' only: a
    router in the way is stopped instead (`ports_in_the_way`)."""
    both = sorted(set(parked_ports) & set(wanted_ports))
    if not both:
        return ""
    return (f"refusing to park {parked}: {wanted} needs port(s) {','.join(map(str, both))}, which {parked} "
            "keeps listening on while parked; stop it instead")


@dataclass(frozen=True)
class PortHolder:
    """One process of the profile to park and every port it listens on (config/model.py's
    listens(): a router's metrics port, a prefill's bootstrap port included)."""

    process: str
    kind: str  # "server" | "router" (ProcessSpec.kind)
    ports: tuple[int, ...]


@dataclass(frozen=True)
class PortsVerdict:
    """What the next profile's ports mean for a park: the routers to stop while parked, the
    ports it keeps listening on, or why the park is refused (a server in the way)."""

    stop: tuple[StoppedWhileParked, ...] = ()
    kept: tuple[int, ...] = ()
    refusal: str = ""


def ports_in_the_way(parked: str, holders: Iterable[PortHolder], wanted: str, wanted_ports: Iterable[int]) -> PortsVerdict:
    """A router of `parked` on a port `wanted` needs is stopped at the park and started at the
    restore: it holds no CUDA memory, and it is what takes the profile out of traffic anyway. A
    server on such a port refuses the park (port_refusal), naming only the servers' ports: its
    front end cannot be stopped apart from its scheduler. Either way its other ports go with it."""
    want = set(wanted_ports)
    holders = list(holders)
    stop = tuple(StoppedWhileParked(h.process, tuple(sorted(set(h.ports) & want)), wanted)
                 for h in holders if h.kind == "router" and set(h.ports) & want)
    stopped = {s.process for s in stop}
    servers = [port for h in holders if h.kind != "router" for port in h.ports]
    kept = tuple(sorted({port for h in holders if h.process not in stopped for port in h.ports}))
    return PortsVerdict(stop, kept, port_refusal(parked, servers, wanted, want))


def baseline_problems(states: Iterable[GpuState], parked_pids: Iterable[int]) -> list[str]:
    """After the checkpoint: each GPU of the profile must be idle. A GPU that is not is named
    with what still holds it (a parked PID listed means the checkpoint left memory behind)."""
    parked = set(parked_pids)
    out = []
    for g in states:
        if g.idle:
            continue
        holders = ", ".join(f"pid {p.pid}" + (" (parked)" if p.pid in parked else "") for p in g.processes) or "no process listed"
        out.append(f"GPU {g.index} holds {g.in_use_mib} MiB after the park ({holders})")
    return out


@dataclass(frozen=True)
class RestoreVerdict:
    """What to do after a restore: `serve` (route to it again) or `cold_start`, with the line to say."""

    serve: bool
    say: str


def judge_restore(instance: str, restore_error: str, serving_error: str, took_s: float,
                  start_error: str = "") -> RestoreVerdict:
    """A restore that failed (a call, a process stopped while parked that does not start again,
    or the one generation after it) falls back to a cold start of the profile, and says so; the
    parked processes are then stopped, never half-used."""
    if restore_error:
        return RestoreVerdict(False, f"restore of {instance} failed ({restore_error}); starting it cold instead")
    if start_error:
        return RestoreVerdict(False, f"{instance} restored but {start_error}; starting it cold instead")
    if serving_error:
        return RestoreVerdict(False, f"{instance} restored but does not serve ({serving_error}); starting it cold instead")
    return RestoreVerdict(True, f"{instance} restored and serving in {took_s:.2f} s")
