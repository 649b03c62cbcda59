"""Plain data for configuration: frozen dataclasses, built only by the loader after validation."""

from __future__ import annotations

from ..records import dataclass, field
from pathlib import Path
from typing import Literal

OptionValue = str | int | float | bool | tuple[str, ...]

Role = Literal["regular", "prefill", "decode", "router"]

#: SGLang 0.5.23 with dp-attention across nodes binds these offsets of --dist-init-addr's port
#: on every node (sglang-server.md, second round)
DP_ATTENTION_DIST_INIT_OFFSETS = (1, 2, 3, 4, 5, 6, 13)
#: before a hang kill, how long the stacks of the hung process may take (py-spy; engine/process.py)
STACK_DUMP_S = 5.0


@dataclass(frozen=True)
class Probe:
    """How readiness is observed (an HTTP GET that must answer 200), and liveness after it.

    Servers: readiness is SGLang's deep check (/health runs a one-token generation, >= 1 s,
    up to SGLang's own 20 s verdict), liveness its front end (/ready answered at all: a 503
    there means paused, latched or draining, not dead) and its scheduler (/server_info
    answered within scheduler_timeout): see engine/liveness.py. Routers: /readiness (all
    workers healthy) and /liveness.
    """

    path: str
    interval_s: float
    timeout_s: float
    #: after ready: probed every liveness_interval_s; `failures` misses in a row kill the cgroup (then restart).
    #: A hung or SIGSTOPped process is killed within failures x (liveness_interval_s + liveness_timeout_s).
    liveness_path: str = "/ready"
    liveness_interval_s: float = 10.0
    liveness_timeout_s: float = 20.0
    failures: int = 3
    #: servers: a request the scheduler itself answers (SGLang's /server_info), None for none;
    #: a scheduler that answers nothing for scheduler_timeout_s is hung (engine/liveness.py)
    scheduler_path: str | None = None
    scheduler_timeout_s: float = 300.0
    #: servers: the hang verdict (engine/hang.py): a stage stopped, or a scheduler (front end) that
    #: neither answers nor works, for hang_window_s is hung; looked at every hang_interval_s; 0 = off
    hang_window_s: float = 0.0
    hang_interval_s: float = 2.0

    @property
    def liveness_bound_s(self) -> float:
        """The longest a process that stopped answering stays up before it is killed."""
        return self.failures * (self.liveness_interval_s + self.liveness_timeout_s)

    @property
    def hang_bound_s(self) -> float:
        """The longest a hung server (engine/hang.py) stays up: the window, two looks (the first
        after the hang, and the one that closes the window) and the bounded stack dump."""
        return self.hang_window_s + 2 * self.hang_interval_s + STACK_DUMP_S


RestartMode = Literal["never", "on-failure", "always"]
RESTART_MODES: tuple[RestartMode, ...] = ("never", "on-failure", "always")


@dataclass(frozen=True)
class RestartPolicy:
    """A profile's [restart] table; these defaults are the loader's too (config/loader.py)."""

    mode: RestartMode = "on-failure"
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def backoff(self, attempt: int) -> float:
        """Delay before the `attempt`-th restart (1-based): doubling, capped."""
        return min(self.backoff_max_s, self.backoff_initial_s * (2 ** max(0, attempt - 1)))


@dataclass(frozen=True)
class Listen:
    """One address a process will listen on, checked free before start."""

    host: str
    port: int
    label: str
    #: the profile key that sets it ("servers.prefill.port"), for error messages
    key: str = ""


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    kind: Literal["server", "router"]
    role: Role
    host: str
    port: int
    gpus: tuple[int, ...]
    model_path: str | None
    options: tuple[tuple[str, OptionValue], ...]
    env: tuple[tuple[str, str], ...]
    user: str | None
    after: tuple[str, ...]
    probe: Probe
    #: a start with no progress fails after start_timeout_s; each progress (a phase line, a
    #: progress-bar update) extends it to start_stall_timeout after that progress, up to
    #: start_timeout_max_s (the loader passes it: once forgotten, every process had the 4 h default)
    start_timeout_s: float
    stop_timeout_s: float
    start_timeout_max_s: float = 14400.0
    #: servers: not serving (/ready 503: paused, latched or draining) for longer than this is a warning
    paused_warn_s: float = 300.0
    #: servers: `share_gpus = true`, this server may share its GPUs with others that say so (config/sharing.py)
    share_gpus: bool = False
    # router only
    router_mode: Literal["regular", "pd"] | None = None
    workers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    # cluster profiles only (see config/cluster.py); a single-node profile leaves them unset
    #: the node this process (or this rank of a server spanning nodes) runs on
    node: str | None = None
    #: a server spanning nodes: every node it runs on, in rank order; () for one node
    nodes: tuple[str, ...] = ()
    node_rank: int = 0
    #: the address the other nodes reach this process at (its node's, from [nodes])
    address: str | None = None
    #: a server spanning nodes: rank 0's torch.distributed rendezvous port (--dist-init-addr ADDRESS:PORT)
    dist_init_port: int | None = None
    dist_init_host: str | None = None
    #: a node's part only: "NODE/PROCESS" on other nodes that must be ready before this one starts
    #: (the router's servers there), and those that must have stopped before this one stops
    #: (what comes earlier in the profile's stop order); the cluster gate waits on them in etcd
    peers_before_start: tuple[str, ...] = ()
    peers_before_stop: tuple[str, ...] = ()

    @property
    def serves_http(self) -> bool:
        """Only rank 0 of a server spanning nodes serves SGLang's HTTP API. The other ranks run
        schedulers only, and SGLang gives them a dummy health server on the same --host:--port
        (/ping, /health, /health_generate, all 200 once their schedulers are ready)."""
        return self.node_rank == 0

    def option(self, key: str, default: OptionValue | None = None) -> OptionValue | None:
        for k, v in self.options:
            if k == key:
                return v
        return default

    @property
    def probe_host(self) -> str:
        """Where to reach a server that listens on a wildcard address."""
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host

    @property
    def url(self) -> str:
        """Where the router reaches it: on a wildcard address in a cluster, its node's address."""
        host = self.address if self.address and self.host in ("0.0.0.0", "", "::") else self.probe_host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def bootstrap_port(self) -> int | None:
        if self.role != "prefill":
            return None
        return int(self.option("disaggregation-bootstrap-port", 8998))  # type: ignore[arg-type]

    @property
    def key(self) -> str:
        """Where this process is in its profile: "router" or "servers.NAME"."""
        return "router" if self.kind == "router" else f"servers.{self.name}"

    def listens(self) -> tuple[Listen, ...]:
        out = [Listen(self.host, self.port, self.name, f"{self.key}.port")]
        if self.dist_init_port is not None and self.node_rank == 0:
            # torch.distributed's TCPStore on rank 0, on every address (the other ranks dial in)
            out.append(Listen("0.0.0.0", self.dist_init_port, f"{self.name} dist-init", f"{self.key}.dist_init_port"))
        nccl = self.option("nccl-port")
        if self.kind == "server" and isinstance(nccl, int) and not isinstance(nccl, bool):
            # torch.distributed's store for the TP group on --nccl-port (every address)
            out.append(Listen("0.0.0.0", nccl, f"{self.name} nccl", f"{self.key}.options.nccl-port"))
        if self.dist_init_port is not None and self.nodes and self.option("enable-dp-attention") is True:
            # with dp-attention across nodes SGLang also binds dist-init +1..+6 and +13 on each node
            out += [Listen("0.0.0.0", self.dist_init_port + off, f"{self.name} dp-attention dist-init+{off}",
                           f"{self.key}.dist_init_port") for off in DP_ATTENTION_DIST_INIT_OFFSETS]
        if self.role == "prefill":
            out.append(Listen(self.host, self.bootstrap_port or 8998, f"{self.name} bootstrap",
                              f"{self.key}.options.disaggregation-bootstrap-port"))
        if self.kind == "router":
            out.append(
                Listen(
                    str(self.option("prometheus-host", "0.0.0.0")),
                    int(self.option("prometheus-port", 29000)),  # type: ignore[arg-type]
                    f"{self.name} metrics",
                    f"{self.key}.options.prometheus-port",
                )
            )
        return tuple(out)


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path
    description: str
    processes: tuple[ProcessSpec, ...]  # in a valid start order
    stop_order: tuple[str, ...]
    restart: RestartPolicy
    takeover: bool
    rollback: bool
    # cluster profiles only: every node by name with its address; which node's part this is
    # (None: the whole profile); and the processes of the other nodes, which only the router's
    # command line and the cluster's step order look at.
    nodes: tuple[tuple[str, str], ...] = ()
    node: str | None = None
    remote: tuple[ProcessSpec, ...] = ()

    @property
    def is_cluster(self) -> bool:
        return bool(self.nodes)

    def process(self, name: str) -> ProcessSpec:
        for p in self.processes + self.remote:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def stop_waves(self) -> tuple[tuple[str, ...], ...]:
        """The stop order cut into waves that stop at the same time.

        Neighbours in the stop order with the same role and no `after` between them (two decode
        servers, sixteen TP replicas) have no reason to wait for each other: stopping them one
        after the other makes N drains (or N stop deadlines, for hung ones) cost N times as much.
        Anything that differs in role, or depends on the other, keeps the strict order.
        """
        waves: list[list[str]] = []
        for name in self.stop_order:
            spec = self.process(name)
            wave = waves[-1] if waves else None
            if wave is not None and all(
                self.process(w).role == spec.role and w not in spec.after and name not in self.process(w).after
                for w in wave
            ):
                wave.append(name)
            else:
                waves.append([name])
        return tuple(tuple(w) for w in waves)

    def describe_stop_order(self) -> str:
        """`router -> decode0 + decode1 -> prefill`: `+` joins what stops together."""
        return " -> ".join(" + ".join(w) for w in self.stop_waves)

    @property
    def gpus(self) -> frozenset[int]:
        return frozenset(g for p in self.processes for g in p.gpus)

    def listens(self) -> tuple[Listen, ...]:
        return tuple(listen for p in self.processes for listen in p.listens())


@dataclass(frozen=True)
class RehearsalConfig:
    """The explicit no-GPU mode: stand-in servers, simulated GPUs."""

    enabled: bool = False
    gpu_count: int = 8
    gpu_memory_mib: int = 143771
    server_startup_s: float = 3.0
    server_mib_per_gpu: int = 100000
    router: Literal["auto", "real", "standin"] = "auto"
    simgpu_dir: str | None = None


@dataclass(frozen=True)
class GpuConfig:
    backend: Literal["auto", "nvml", "simulated"] = "auto"
    idle_tolerance_mib: int = 256
    baseline_mib: tuple[tuple[int, int], ...] = ()
    wait_idle_timeout_s: float = 60.0


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9464


@dataclass(frozen=True)
class ClusterConfig:
    """This node's name, and where the cluster's etcd is (none: profiles that span nodes cannot
    change, since nothing could order their steps; single-machine profiles never need it)."""

    node: str = ""
    #: etcd's v3 JSON gateway, e.g. "http://10.0.0.1:2379"; tried in order
    etcd: tuple[str, ...] = ()
    #: every key we write lives under it (one etcd can hold several clusters)
    prefix: str = "/supervisord-gpu"
    #: a node whose agent stops renewing its lease for this long is gone, and so are its claims
    lease_ttl_s: int = 10
    #: TLS, as Patroni's etcd3 settings: the CA that signed etcd's certificate, and this node's
    #: client certificate and key (etcd's --client-cert-auth); files root's alone (cluster/credentials.py)
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    #: etcd authentication: the user nodes write as (a role with read/write under `prefix` only,
    #: cluster/etcd.py), its password in a file (first line) that others cannot read
    user: str | None = None
    password_file: str | None = None
    #: `insecure = true`: the operator's consent to etcd without TLS or login (config/cluster.py)
    insecure: bool = False


@dataclass(frozen=True)
class DaemonConfig:
    path: Path | None
    config_dir: Path
    ownership: Literal["auto", "systemd", "cgroupfs", "session"] = "auto"
    cgroup_root: str | None = None
    leftovers: Literal["clean", "refuse"] = "clean"
    runtime_dir: Path = Path("/run/supervisord-gpu")
    #: persistent compile caches (Triton, torch inductor, FlashInfer, DeepGEMM, CUDA), one per user
    cache_dir: Path = Path("/var/cache/supervisord-gpu")
    default_user: str | None = None
    control_group: str = "gpusup"
    #: while starting, no new log line or phase for this long means stuck: stop extending systemd's timeout
    start_stall_timeout_s: float = 120.0
    sglang_command: tuple[str, ...] = ("python3", "-m", "sglang.launch_server")
    #: as [sglang] router_command names it; () when it names none: the installed router runs
    #: (sglang/routers.py's `pick`: smg, else sglang-router), resolved in render.Programs.of
    router_command: tuple[str, ...] = ()
    gpus: GpuConfig = field(default_factory=GpuConfig)
    rehearsal: RehearsalConfig = field(default_factory=RehearsalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def profiles_dir(self) -> Path:
        return self.config_dir / "profiles"


def gpu_ranges(gpus: list[int]) -> str:
    """[0,1,2,3,6] -> "0-3,6"."""
    out: list[str] = []
    for g in sorted(gpus):
        if out and out[-1].split("-")[-1] == str(g - 1):
            out[-1] = out[-1].split("-")[0] + f"-{g}"
        else:
            out.append(str(g))
    return ",".join(out)
