"""Reading and validating the daemon config and profiles.

Nothing here starts or touches anything: a bad file becomes one ConfigError naming the file,
the key and what is wrong, and the caller exits 2 before any side effect.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import tomllib  # Python 3.11+ (Debian 12); older Pythons would use the tomli package

from ..addresses import is_loopback
from ..errors import ConfigError
from ..records import replace as _replace
from ..names import INSTANCE_NAME_RE, PROCESS_NAME_RE
from .model import (
    ClusterConfig,
    DaemonConfig,
    GpuConfig,
    MetricsConfig,
    OptionValue,
    Probe,
    ProcessSpec,
    Profile,
    RehearsalConfig,
    RESTART_MODES,
    RestartPolicy,
)
from ..sglang import timing
from . import cluster
from . import sharing
from .tables import MAX_PORT, Table, type_name
from .trust import check_modes, read_verified

DEFAULT_CONFIG_DIR = Path("/etc/supervisord-gpu")
CONFIG_DIR_ENV = "SUPERVISORD_GPU_CONFIG_DIR"
DAEMON_FILE = "supervisord-gpu.toml"
MAX_GPU_INDEX = 1023
MAX_PROCESSES = 256
PACKAGE_USER = "sglang"  # the unprivileged system user the package creates (postinst)
ROUTER = "router"

#: readiness: SGLang's deep /health (>= 1 s, SGLang itself gives up at 20 s); liveness: its front end
#: (/ready answered at all) and its scheduler (/server_info), see engine/liveness.py. A server whose
#: front end is hung is killed within 3 x (10 + 20) = 90 s; one whose scheduler answers nothing,
#: after SGLang's own watchdog time (300 s, or the profile's watchdog-timeout).
SERVER_PROBE = Probe(path="/health", interval_s=0.5, timeout_s=timing.HEALTH_VERDICT_S + 5,
                     liveness_path=timing.CHEAP_STATUS_PATH, liveness_interval_s=10.0,
                     liveness_timeout_s=timing.HEALTH_VERDICT_S, failures=3,
                     scheduler_path=timing.SCHEDULER_ROUND_TRIP_PATH, scheduler_timeout_s=timing.WATCHDOG_S,
                     hang_window_s=timing.HANG_WINDOW_S, hang_interval_s=timing.HANG_INTERVAL_S)
#: a hard cap on a start that keeps making progress (engine/deadline.py)
START_TIMEOUT_MAX_S = 14400.0
#: the router: /readiness (all workers healthy) and /liveness, both instant
ROUTER_PROBE = Probe(path="/readiness", interval_s=0.2, timeout_s=5.0, liveness_path="/liveness",
                     liveness_interval_s=10.0, liveness_timeout_s=10.0, failures=3)

OPTION_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9-]*\Z")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
HUMAN_INT_RE = re.compile(r"^\s*(\d+)\s*(k|K|m|M|g|G|Ki|Mi|Gi)?\s*\Z")
_SI = {"": 1, "k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}

# Flags the structured keys own: setting them in options would silently fight the profile.
SERVER_MANAGED = {
    "model-path": "model_path",
    "model": "model_path",
    "host": "host",
    "port": "port",
    "disaggregation-mode": "role",
    "base-gpu-id": "gpus",
    "nnodes": "nodes",
    "node-rank": "nodes",
    "dist-init-addr": "dist_init_port",
    "nccl-init-addr": "dist_init_port",  # SGLang's alias of --dist-init-addr
}
ROUTER_MANAGED = {
    "host": "host",
    "port": "port",
    "worker-urls": "workers",
    "pd-disaggregation": "mode",
    "prefill": "prefill",
    "decode": "decode",
}


def resolve_config_dir(cli_value: str | None = None) -> Path:
    if cli_value:
        return Path(cli_value)
    env = os.environ.get(CONFIG_DIR_ENV)
    return Path(env) if env else DEFAULT_CONFIG_DIR


def read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file; every way it can be unreadable becomes a ConfigError.

    As root, a file another user could have written is refused (see config/trust.py): its
    commands, users and environment would run as root. The check and the read use one
    descriptor, so a symlink swapped in between cannot substitute another file.
    """
    try:
        data = read_verified(path)
    except ConfigError:
        raise
    except IsADirectoryError:
        raise ConfigError(path, "", "is a directory, not a file") from None
    except FileNotFoundError:
        raise ConfigError(path, "", "does not exist") from None
    except PermissionError:
        raise ConfigError(path, "", "cannot be read (permission denied)") from None
    except OSError as e:
        raise ConfigError(path, "", f"cannot be read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(path, "", f"is not valid UTF-8 (line {line}, byte {e.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, "", f"is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(path, "", "is not valid TOML: nested too deeply") from None


# ----------------------------------------------------------------------------- daemon config


def load_daemon_config(config_dir: Path | str | None = None) -> DaemonConfig:
    cdir = resolve_config_dir(str(config_dir) if config_dir else None)
    path = cdir / DAEMON_FILE
    _check_config_dir(cdir)
    if not path.exists():
        return DaemonConfig(path=None, config_dir=cdir, cluster=_cluster_config(Table(cdir, "cluster", {})))
    top = Table(path, "", read_toml(path))

    d = top.table("daemon")
    ownership = d.str("ownership", "auto", choices=("auto", "systemd", "cgroupfs", "session"))
    cgroup_root = d.str("cgroup_root", None)
    leftovers = d.str("leftovers", "clean", choices=("clean", "refuse"))
    runtime_dir = Path(d.str("runtime_dir", "/run/supervisord-gpu"))
    cache_dir = Path(d.str("cache_dir", "/var/cache/supervisord-gpu"))
    default_user = d.str("default_user", None)
    if d.bool("strict_modes", True) is False:
        raise d.error("strict_modes", "can no longer be turned off: every file and directory the daemon reads must "
                                      "be root's and writable only by root (remove the key)")
    control_group = d.str("control_group", "gpusup")
    stall = d.number("start_stall_timeout", 120.0, lo=1.0, hi=86400)
    d.finish()

    s = top.table("sglang")
    server_command = s.list("server_command", _nonempty_str(path), ("python3", "-m", "sglang.launch_server"))
    # not set: the router installed here (sglang/routers.py), resolved where it is rendered
    router_command = s.list("router_command", _nonempty_str(path), ())
    for name, cmd in (("server_command", server_command), ("router_command", router_command)):
        if not cmd and s.has(name):
            raise s.error(name, "must not be empty")
    s.finish()

    g = top.table("gpus")
    backend = g.str("backend", "auto", choices=("auto", "nvml", "simulated"))
    tolerance = g.int("idle_tolerance_mib", 256, lo=0, hi=1 << 20)
    wait_idle = g.number("wait_idle_timeout", 60.0, lo=0.1, hi=86400)
    base = g.table("baseline_mib")
    baselines = []
    for key, value in base.items():
        if not key.isdigit() or int(key) > MAX_GPU_INDEX:
            raise base.error(key, "must be a GPU index (\"0\", \"1\", ...)")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 20:
            raise base.error(key, f"must be an integer number of MiB, not {value!r}")
        baselines.append((int(key), value))
    g.finish()

    r = top.table("rehearsal")
    rehearsal = RehearsalConfig(
        enabled=r.bool("enabled", False),
        gpu_count=r.int("gpu_count", 8, lo=1, hi=64),
        gpu_memory_mib=r.int("gpu_memory_mib", 143771, lo=1024, hi=1 << 24),
        server_startup_s=r.number("server_startup", 3.0, lo=0.0, hi=3600),
        server_mib_per_gpu=r.int("server_mib_per_gpu", 100000, lo=0, hi=1 << 24),
        router=r.str("router", "auto", choices=("auto", "real", "standin")),
        simgpu_dir=r.str("simgpu_dir", None),
    )
    r.finish()

    m = top.table("metrics")
    metrics = MetricsConfig(m.bool("enabled", False), m.str("host", "127.0.0.1"), m.port("port", 9464))
    m.finish()
    cluster_cfg = _cluster_config(top.table("cluster"))
    top.finish()
    return DaemonConfig(
        path=path,
        config_dir=cdir,
        ownership=ownership,
        cgroup_root=cgroup_root,
        leftovers=leftovers,
        runtime_dir=runtime_dir,
        cache_dir=cache_dir,
        default_user=default_user,
        control_group=control_group,
        start_stall_timeout_s=stall,
        sglang_command=server_command,
        router_command=router_command,
        gpus=GpuConfig(backend, tolerance, tuple(baselines), wait_idle),
        rehearsal=rehearsal,
        metrics=metrics,
        cluster=cluster_cfg,
    )


def _check_config_dir(cdir: Path) -> None:
    """The config directory must be one (and, as root, root's alone: config/trust.py).

    It comes from the command line or the environment, so anything can be in it: a path
    too long for the kernel, bytes that are not UTF-8, a file. Each is one line naming the
    path (exit 2), never a traceback."""
    shown = display_path(cdir)
    try:
        check_modes(cdir)
        st = os.stat(cdir)
    except FileNotFoundError:
        raise ConfigError(shown, "", "config directory does not exist (use --config-dir or SUPERVISORD_GPU_CONFIG_DIR)") from None
    except OSError as e:
        raise ConfigError(shown, "", f"cannot be used as the config directory ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(shown, "", "is not a directory (--config-dir names the directory holding supervisord-gpu.toml)")


#: how much of a path an error shows: enough to recognise it, one readable line
DISPLAY_PATH_CHARS = 120


def display_path(path: Path | str) -> str:
    """A path for a message: bytes that are not UTF-8 as \\xNN, a very long one cut and its length said."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    if len(text) <= DISPLAY_PATH_CHARS:
        return text
    return f"{text[:DISPLAY_PATH_CHARS]}… ({len(text)} characters)"


def _cluster_config(c: Table) -> ClusterConfig:
    """[cluster]: node defaults to this machine's host name (its first label, as `hostname -s`)."""
    node = c.str("node", None)
    if node is None:
        node = os.uname().nodename.split(".")[0].lower()
    elif not cluster.NODE_NAME_RE.match(node):
        raise c.error("node", f"must be a host name label (lower-case letters, digits and '-'), not {node!r}")

    def endpoint(value: Any, key: str) -> str:
        if not isinstance(value, str) or not re.match(r"^https?://[^\s/\x00-\x1f\x7f]+\Z", value):
            raise ConfigError(c.path, key, f"must be an etcd URL like \"https://10.0.0.1:2379\", not {value!r}")
        return value

    etcd = c.list("etcd", endpoint, ())
    prefix = c.str("prefix", "/supervisord-gpu")
    if not re.match(r"^(/[A-Za-z0-9_.-]+)+\Z", prefix):
        raise c.error("prefix", f"must be a key path like \"/supervisord-gpu\", not {prefix!r}")
    ttl = c.int("lease_ttl", 10, lo=2, hi=3600)
    files: dict[str, str | None] = {}
    for key in ("cacert", "cert", "key", "password_file"):
        path = c.str(key, None)
        if path is not None and not path.startswith("/"):
            raise c.error(key, f"must be an absolute path, not {path!r}")
        files[key] = path
    user = c.str("user", None)
    if user is not None and not re.match(r"^[A-Za-z0-9_.@-]{1,64}\Z", user):
        raise c.error("user", f"must be an etcd user name (letters, digits, '_.@-'), not {user!r}")
    if (files["cert"] is None) != (files["key"] is None):
        raise c.error("cert" if files["cert"] is None else "key", "cert and key go together (etcd's client certificate and its key)")
    if (user is None) != (files["password_file"] is None):
        raise c.error("user" if user is None else "password_file", "user and password_file go together (etcd's authentication)")
    if (files["cacert"] or files["cert"]) and any(not e.startswith("https://") for e in etcd):
        raise c.error("etcd", "must be https:// URLs when cacert or cert is set")
    insecure = c.bool("insecure", False)
    c.finish()
    out = ClusterConfig(node=node, etcd=tuple(etcd), prefix=prefix, lease_ttl_s=ttl, cacert=files["cacert"],
                        cert=files["cert"], key=files["key"], user=user, password_file=files["password_file"],
                        insecure=insecure)
    exposed = cluster.etcd_exposures(out)
    if exposed and not insecure:
        raise c.error("etcd", f"{'; '.join(exposed)}: whoever reaches etcd could order this node's root agent; "
                              f"set up TLS and a login (docs/cluster.md), or consent with insecure = true in [cluster]")
    return out


def _nonempty_str(path: Path):
    def item(value: Any, key: str) -> str:
        if not isinstance(value, str) or not value or "\x00" in value:
            raise ConfigError(path, key, f"must be a non-empty string, not {type_name(value)}")
        return value

    return item


def effective_config(cfg: DaemonConfig, rehearsal: bool) -> DaemonConfig:
    """The config with rehearsal switched on when a command asks for it (`--rehearsal`, `rehearse`).

    A rehearsal switched on that way keeps its state (simulated GPUs, instance records, the
    transition lock) in a directory of its own, `rehearsal_runtime_dir`: every `gpusupctl
    ... --rehearsal` in another shell sees the same simulated GPUs, and a rehearsal never
    finds, let alone takes over, the production instances recorded in the runtime directory.
    """
    from .. import records

    if rehearsal and not cfg.rehearsal.enabled:
        return records.replace(cfg, rehearsal=records.replace(cfg.rehearsal, enabled=True),
                                   runtime_dir=rehearsal_runtime_dir(cfg))
    return cfg


def rehearsal_runtime_dir(cfg: DaemonConfig) -> Path:
    """`<runtime_dir>/rehearsal` for root; for anyone else their own `$XDG_RUNTIME_DIR`
    (/run/user/UID), else `/tmp/supervisord-gpu-rehearsal-UID` (refused if someone else made it)."""
    if os.geteuid() == 0:
        return cfg.runtime_dir / "rehearsal"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "supervisord-gpu-rehearsal"
    return Path(f"/tmp/supervisord-gpu-rehearsal-{os.geteuid()}")


# ----------------------------------------------------------------------------- profiles


def list_profiles(cfg: DaemonConfig) -> list[str]:
    try:
        return sorted(p.stem for p in cfg.profiles_dir.glob("*.toml") if INSTANCE_NAME_RE.match(p.stem))
    except OSError:
        return []


def profile_path(cfg: DaemonConfig, name: str) -> Path:
    if not INSTANCE_NAME_RE.match(name or ""):
        raise ConfigError(cfg.profiles_dir, "", f"{name!r} is not a valid profile name (letters, digits, '.', '_', '-')")
    path = cfg.profiles_dir / f"{name}.toml"
    if not path.exists():
        known = ", ".join(list_profiles(cfg)) or "none"
        raise ConfigError(path, "", f"unknown profile {name!r} (profiles in {cfg.profiles_dir}: {known})")
    return path


def load_profile(cfg: DaemonConfig, name: str, whole: bool = False) -> Profile:
    """The profile as this node runs it: a cluster profile's part for `cfg.cluster.node`, unless `whole`."""
    path = profile_path(cfg, name)
    profile = parse_profile(name, path, read_toml(path), cfg.default_user)
    if profile.is_cluster and not whole:
        return cluster.part(profile, cfg.cluster.node)
    return profile


def parse_profile(name: str, path: Path, data: dict[str, Any], default_user: str | None = None) -> Profile:
    top = Table(path, "", data)
    description = top.str("description", "")
    takeover = top.bool("takeover", True)
    rollback = top.bool("rollback", True)
    stop_order_raw = top.list("stop_order", _process_name(path), None)

    rt = top.table("restart")
    unset = RestartPolicy()  # the defaults are written once, on the record
    restart = RestartPolicy(
        mode=rt.str("mode", unset.mode, choices=RESTART_MODES),
        max_restarts=rt.int("max_restarts", unset.max_restarts, lo=0, hi=1000),
        window_s=rt.number("window", unset.window_s, lo=1.0, hi=7 * 86400),
        backoff_initial_s=rt.number("backoff_initial", unset.backoff_initial_s, lo=0.0, hi=3600),
        backoff_max_s=rt.number("backoff_max", unset.backoff_max_s, lo=0.0, hi=3600),
    )
    rt.finish()

    df = top.table("defaults")
    defaults = {
        "user": df.str("user", default_user),
        "start_timeout": df.number("start_timeout", None, lo=0.1, hi=86400),
        "stop_timeout": df.number("stop_timeout", None, lo=0.1, hi=86400),
        "start_timeout_max": df.number("start_timeout_max", None, lo=0.1, hi=7 * 86400),
    }
    default_env = _env(df.table("env"))
    df.finish()
    nodes = cluster.parse_nodes(top)

    servers_t = top.table("servers", required=True)
    specs: list[ProcessSpec] = []
    for sname, sdata in servers_t.items():
        specs.append(_server(path, sname, sdata, defaults, default_env, nodes))
    if not specs:
        raise ConfigError(path, "servers", "must define at least one server")
    if top.has(ROUTER):
        specs.append(_router(path, top.raw(ROUTER), specs, defaults, default_env, nodes))
    top.finish()
    if len(specs) > MAX_PROCESSES:
        raise ConfigError(path, "servers", f"too many processes ({len(specs)}; at most {MAX_PROCESSES})")

    specs = _own_nccl_ports(specs)
    _check_gpus(path, specs)
    for node in dict.fromkeys(s.node for s in specs):  # ports collide only on the same machine
        _check_ports(path, [s for s in specs if s.node == node])
    if nodes:
        cluster.check_reachable(path, specs)
    ordered = _start_order(path, specs)
    stop_order = _stop_order(path, ordered, stop_order_raw)
    return Profile(
        name=name,
        path=path,
        description=description,
        processes=tuple(ordered),
        stop_order=stop_order,
        restart=restart,
        takeover=takeover,
        rollback=rollback,
        nodes=nodes,
    )


def _process_name(path: Path):
    def item(value: Any, key: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(path, key, f"must be a process name, not {type_name(value)}")
        return value

    return item


def _gpu_index(path: Path):
    def item(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, key, f"must be a GPU index (an integer), not {type_name(value)}")
        if not 0 <= value <= MAX_GPU_INDEX:
            raise ConfigError(path, key, f"must be a GPU index between 0 and {MAX_GPU_INDEX}, not {value}")
        return value

    return item


def _common(t: Table, defaults: dict[str, Any], start_default: float, stop_default: float) -> dict[str, Any]:
    host = t.str("host", "127.0.0.1")
    if not host or any(c.isspace() for c in host):
        raise t.error("host", f"must be an address, not {host!r}")
    after = t.list("after", _process_name(Path(t.path)), None)
    start_timeout = t.number("start_timeout", defaults["start_timeout"] or start_default, lo=0.1, hi=86400)
    stop_timeout = t.number("stop_timeout", defaults["stop_timeout"] or stop_default, lo=0.1, hi=86400)
    start_max = t.number("start_timeout_max", defaults["start_timeout_max"] or max(START_TIMEOUT_MAX_S, start_timeout),
                         lo=0.1, hi=7 * 86400)
    if start_max < start_timeout:
        raise t.error("start_timeout_max", f"{start_max:g} s is shorter than start_timeout ({start_timeout:g} s)")
    user = t.str("user", defaults["user"])
    if user is None:
        raise t.error("user", "is not set, so it would run as the daemon's user (root); set user = "
                              f"\"{PACKAGE_USER}\" (the package's unprivileged user), [defaults] user, or "
                              "user = \"root\" to run it as root on purpose")
    return {
        "host": host,
        "after": after,
        "start_timeout_s": float(start_timeout),
        "stop_timeout_s": float(stop_timeout),
        "start_timeout_max_s": float(start_max),
        "user": user,
    }


def _probe(t: Table, defaults: Probe, server: bool) -> Probe:
    p = t.table("probe")
    probe = Probe(
        path=p.str("path", defaults.path),
        interval_s=p.number("interval", defaults.interval_s, lo=0.01, hi=600),
        timeout_s=p.number("timeout", defaults.timeout_s, lo=0.05, hi=600),
        liveness_path=p.str("liveness_path", defaults.liveness_path),
        liveness_interval_s=p.number("liveness_interval", defaults.liveness_interval_s, lo=0.05, hi=86400),
        liveness_timeout_s=p.number("liveness_timeout", defaults.liveness_timeout_s, lo=0.05, hi=600),
        failures=p.int("failures", defaults.failures, lo=1, hi=1000),
        scheduler_path=defaults.scheduler_path,
        scheduler_timeout_s=p.number("scheduler_timeout", defaults.scheduler_timeout_s, lo=0.05, hi=86400)
        if defaults.scheduler_path else defaults.scheduler_timeout_s,
        hang_window_s=p.number("hang_window", defaults.hang_window_s, lo=0, hi=86400)
        if defaults.scheduler_path else defaults.hang_window_s,
        hang_interval_s=p.number("hang_interval", defaults.hang_interval_s, lo=0.05, hi=600)
        if defaults.scheduler_path else defaults.hang_interval_s,
    )
    for key, value in (("path", probe.path), ("liveness_path", probe.liveness_path)):
        if not value.startswith("/"):
            raise p.error(key, f"must start with '/', not {value!r}")
    if server:
        _never_stricter_than_sglang(p, probe)
    p.finish()
    return probe


def _never_stricter_than_sglang(p: Table, probe: Probe) -> None:
    """A probe SGLang cannot pass while healthy is a configuration error, not a restart loop."""
    if probe.path in timing.DEEP_HEALTH_PATHS and probe.timeout_s <= timing.HEALTH_MIN_S:
        raise p.error("timeout", f"{probe.timeout_s:g} s is too short for {probe.path}: SGLang answers it with a "
                                 f"one-token generation that takes at least {timing.HEALTH_MIN_S:g} s "
                                 f"(default {SERVER_PROBE.timeout_s:g} s)")
    if probe.liveness_path in timing.DEEP_HEALTH_PATHS and probe.liveness_timeout_s < timing.HEALTH_VERDICT_S:
        raise p.error("liveness_timeout", f"{probe.liveness_timeout_s:g} s would kill a busy healthy server: "
                                          f"SGLang's own {probe.liveness_path} verdict allows {timing.HEALTH_VERDICT_S:g} s; "
                                          f"use liveness_path = \"{timing.CHEAP_STATUS_PATH}\" (the default) or a "
                                          f"liveness_timeout of at least {timing.HEALTH_VERDICT_S:g}")


def _server_probe_defaults(options: tuple[tuple[str, Any], ...]) -> Probe:
    """A scheduler that answers nothing is hung after SGLang's own --watchdog-timeout: with the
    profile's value when it sets one (we are never stricter than SGLang on itself)."""
    return _replace(SERVER_PROBE, scheduler_timeout_s=timing.watchdog_s(options))


def _server(path: Path, name: str, data: Any, defaults: dict[str, Any], default_env: tuple,
            nodes: tuple[tuple[str, str], ...] = ()) -> ProcessSpec:
    key = f"servers.{name}"
    if not PROCESS_NAME_RE.match(name) or name in (ROUTER, "daemon"):
        raise ConfigError(path, key, "a server name must be lower-case letters, digits and '_' (not 'router' or 'daemon')")
    t = Table(path, key, data)
    role = t.str("role", "regular", choices=("regular", "prefill", "decode"))
    gpus = t.list("gpus", _gpu_index(path))
    if not gpus:
        raise t.error("gpus", "must list at least one GPU")
    seen: set[int] = set()
    for g in gpus:
        if g in seen:
            raise t.error("gpus", f"GPU {g} is listed twice")
        seen.add(g)
    port = t.port("port")
    model_path = t.str("model_path")
    if not model_path.strip():
        raise t.error("model_path", "must not be empty")
    common = _common(t, defaults, 900.0, 60.0)
    options = _options(t.table("options"), SERVER_MANAGED)
    paused_warn = t.number("paused_warn", 300.0, lo=1.0, hi=7 * 86400)
    share_gpus = t.bool("share_gpus", False)
    probe = _probe(t, _server_probe_defaults(options), server=True)
    env = default_env + _env(t.table("env"))
    _check_admin_key_holds(path, key, options, env)
    where = cluster.placement(t, nodes, server=True)
    t.finish()
    spec = ProcessSpec(
        name=name,
        kind="server",
        role=role,
        host=common["host"],
        port=port,
        gpus=gpus,
        model_path=model_path,
        options=options,
        env=env,
        user=common["user"],
        after=common["after"] or (),
        probe=probe,
        start_timeout_s=common["start_timeout_s"],
        start_timeout_max_s=common["start_timeout_max_s"],
        stop_timeout_s=common["stop_timeout_s"],
        paused_warn_s=paused_warn,
        share_gpus=share_gpus,
        **where,
    )
    _check_parallelism(path, key, spec)
    return spec


def _check_admin_key_holds(path: Path, key: str, options: tuple[tuple[str, OptionValue], ...],
                           env: tuple[tuple[str, str], ...]) -> None:
    """Every server runs with an admin key of the daemon's making (sglang/admin_key.py): a profile
    may not set its own, nor an option under which SGLang 0.5.23 would not check it or would
    show it (its HTTP server is the only one that checks; the server shim hides the key there)."""
    opts = dict(options)
    if "admin-api-key" in opts:
        raise ConfigError(path, f"{key}.options.admin-api-key", "is the daemon's own (a key per server, kept off "
                          "the command line, where ps would show it); remove it from options")
    workers = opts.get("tokenizer-worker-num")
    if workers is not None and str(workers).strip() not in ("1", "1.0"):
        raise ConfigError(path, f"{key}.options.tokenizer-worker-num", "SGLang 0.5.23 checks no API key with more "
                          "than one tokenizer worker: its admin endpoints (/pause_generation, ...) would be open")
    for grpc in ("grpc-port", "smg-grpc-mode", "grpc-mode"):
        if grpc in opts:
            raise ConfigError(path, f"{key}.options.{grpc}", "SGLang 0.5.23's gRPC servers do not check the admin "
                              "key (it refuses --grpc-port with one); only its HTTP server does")
    for name, value in env:
        if name in ("SGLANG_RUST_SERVER", "SGLANG_GRPC_PORT") and value.strip().lower() not in ("", "0", "false"):
            raise ConfigError(path, f"{key}.env.{name}", "replaces or bypasses SGLang's HTTP server, the only one "
                              "that checks the admin key (and the Rust one shows it in /server_info)")


def _check_parallelism(path: Path, key: str, spec: ProcessSpec) -> None:
    needed = 1
    for opt in ("tp-size", "tensor-parallel-size", "pp-size", "pipeline-parallel-size"):
        value = spec.option(opt)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(path, f"{key}.options.{opt}", f"must be a positive integer, not {value!r}")
            needed *= value
    if spec.nodes:
        cluster.check_parallelism_per_node(path, spec, needed)
    elif needed > len(spec.gpus):
        raise ConfigError(path, f"{key}.gpus", f"lists {len(spec.gpus)} GPU(s) but the parallelism options need {needed}")


def _router(path: Path, data: Any, servers: list[ProcessSpec], defaults: dict[str, Any], default_env: tuple,
            nodes: tuple[tuple[str, str], ...] = ()) -> ProcessSpec:
    t = Table(path, ROUTER, data)
    mode = t.str("mode", "regular", choices=("regular", "pd"))
    port = t.port("port")
    by_name = {s.name: s for s in servers}

    def refs(field: str, role: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
        names = t.list(field, _process_name(path), default)
        for i, n in enumerate(names):
            if n not in by_name:
                raise ConfigError(path, f"router.{field}[{i}]", f"no server named {n!r} (servers: {', '.join(by_name)})")
            if role and by_name[n].role != role:
                raise ConfigError(path, f"router.{field}[{i}]", f"server {n!r} has role {by_name[n].role!r}, not {role!r}")
        if len(set(names)) != len(names):
            raise t.error(field, "lists a server twice")
        return names

    workers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    if mode == "pd":
        prefill = refs("prefill", "prefill", tuple(s.name for s in servers if s.role == "prefill"))
        decode = refs("decode", "decode", tuple(s.name for s in servers if s.role == "decode"))
        if not prefill or not decode:
            raise t.error("mode", "\"pd\" needs at least one prefill and one decode server")
        if t.has("workers"):
            raise t.error("workers", "is for mode \"regular\"; in \"pd\" mode use prefill and decode")
    else:
        workers = refs("workers", "regular", tuple(s.name for s in servers if s.role == "regular"))
        if not workers:
            raise t.error("workers", "the router fronts no server")
        for f in ("prefill", "decode"):
            if t.has(f):
                raise t.error(f, "is for mode \"pd\"")
    common = _common(t, defaults, 120.0, 200.0)
    fronted = workers + prefill + decode
    # Liveness on /liveness, not /readiness: a restarting worker must not get the router restarted too.
    probe = _probe(t, ROUTER_PROBE, server=False)
    options = _options(t.table("options"), ROUTER_MANAGED)
    env = default_env + _env(t.table("env"))
    where = cluster.placement(t, nodes, server=False)
    t.finish()
    return ProcessSpec(
        name=ROUTER,
        kind="router",
        role="router",
        host=common["host"],
        port=port,
        gpus=(),
        model_path=None,
        options=options,
        env=env,
        user=common["user"],
        after=common["after"] if common["after"] is not None else fronted,
        probe=probe,
        start_timeout_s=common["start_timeout_s"],
        start_timeout_max_s=common["start_timeout_max_s"],
        stop_timeout_s=common["stop_timeout_s"],
        router_mode=mode,
        workers=workers,
        prefill=prefill,
        decode=decode,
        **where,
    )


def _options(t: Table, managed: dict[str, str]) -> tuple[tuple[str, OptionValue], ...]:
    out: list[tuple[str, OptionValue]] = []
    for k, v in t.items():
        key = t.key(k)
        if not OPTION_KEY_RE.match(k):
            hint = f" (write {k.replace('_', '-').lower()!r})" if "_" in k else ""
            raise ConfigError(t.path, key, "must be a full long option name without '--', like 'tp-size'" + hint)
        if k in managed:
            raise ConfigError(t.path, key, f"is set by the profile key {managed[k]!r}; remove it from options")
        if k == "context-length":
            v = parse_context_length(t.path, key, v)
        elif k.endswith("-port"):  # prometheus-port, disaggregation-bootstrap-port, nccl-port, ...
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PORT:
                raise ConfigError(t.path, key, f"must be a port number between 1 and {MAX_PORT}, not {v!r}")
        elif isinstance(v, list):
            if not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v):
                raise ConfigError(t.path, key, "a list option may hold only strings and numbers")
            _check_list_items(t.path, key, v)
            v = tuple(str(x) for x in v)
        elif isinstance(v, float) and v != v:
            raise ConfigError(t.path, key, "must be a number, not NaN")
        elif not isinstance(v, (str, int, float, bool)):
            raise ConfigError(t.path, key, f"must be a string, number, boolean or list, not {type_name(v)}")
        if isinstance(v, str) and ("\x00" in v):
            raise ConfigError(t.path, key, "must not contain NUL characters")
        for item in (v if isinstance(v, tuple) else (v,)):
            if isinstance(item, str) and item.startswith("--"):
                # ["1", "--host", "0.0.0.0"] would render as a second --host that argparse takes last
                raise ConfigError(t.path, key, f"value {item!r} would be read as another flag; "
                                               "a value may not start with '--'")
        out.append((k, v))
    return tuple(out)


def _check_list_items(path: str, key: str, items: list[Any]) -> None:
    """A list option renders as `--name a b c` (nargs='+'): SGLang's argparse takes a string
    item starting with '-' as a flag of its own (["a", "-h"] made the server print its help
    and exit), and a NUL cannot be passed to exec at all (an internal error at spawn)."""
    for i, x in enumerate(items):
        if isinstance(x, str) and "\x00" in x:
            raise ConfigError(path, f"{key}[{i}]", "must not contain NUL characters")
        if isinstance(x, str) and x.startswith("-"):
            raise ConfigError(path, f"{key}[{i}]", f"value {x!r} would be read as a flag; "
                                                  "an item of a list option may not start with '-'")


def parse_context_length(path: str, key: str, value: Any) -> int:
    """SGLang's human-readable ints: 512k = 512000 (SI), 512Ki = 524288 (IEC)."""
    if isinstance(value, bool):
        raise ConfigError(path, key, "must be a number of tokens, not a boolean")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := HUMAN_INT_RE.match(value)):
        suffix = m[2] or ""
        n = int(m[1]) * (_IEC.get(suffix) or _SI[suffix])
    else:
        raise ConfigError(path, key, f"must be a number of tokens (e.g. 524288, \"512k\" or \"512Ki\"), not {value!r}")
    if not 1 <= n <= 1 << 40:
        raise ConfigError(path, key, f"must be a positive number of tokens, not {n}")
    return n


def _env(t: Table) -> tuple[tuple[str, str], ...]:
    out = []
    for k, v in t.items():
        if not ENV_KEY_RE.match(k):
            raise ConfigError(t.path, t.key(k), "is not a valid environment variable name")
        if k == "CUDA_VISIBLE_DEVICES":
            raise ConfigError(t.path, t.key(k), "is set from the process's gpus; list them there")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(t.path, t.key(k), f"must be a string, not {type_name(v)}")
        v = str(v)
        if "\x00" in v:
            raise ConfigError(t.path, t.key(k), "must not contain NUL characters")
        out.append((k, v))
    return tuple(out)


def _check_gpus(path: Path, specs: list[ProcessSpec]) -> None:
    """One GPU per server, unless every server on it says share_gpus (config/sharing.py)."""
    sharing.check_shared_gpus(path, specs)


def _hosts_overlap(a: str, b: str) -> bool:
    """Whether two listen addresses of one port may collide: equal, a wildcard, or both
    loopback (`localhost` is 127.0.0.1 or ::1 as /etc/hosts says; any two spellings of
    loopback on one port are refused rather than left to that)."""

    wild = ("0.0.0.0", "::", "", "*")  # "*" binds 0.0.0.0, as checks/ports.py resolves it
    return a == b or a in wild or b in wild or (is_loopback(a) and is_loopback(b))


def _check_ports(path: Path, specs: list[ProcessSpec]) -> None:
    seen: list[tuple[str, int, str, str]] = []
    for s in specs:
        for listen in s.listens():
            for host, port, label, other_where in seen:
                if port == listen.port and _hosts_overlap(host, listen.host):
                    raise ConfigError(path, f"{s.key}.port", f"port {port} ({listen.label}) is also used by {label} ({other_where})")
            seen.append((listen.host, listen.port, listen.label, s.key))
    _check_sglang_ports(path, specs)


#: a server without --nccl-port that shares its machine with another server gets port + this
NCCL_PORT_OFFSET = 50


def _own_nccl_ports(specs: list[ProcessSpec]) -> list[ProcessSpec]:
    """Give each server of a machine with several its own --nccl-port (its port + 50).

    Without one SGLang draws it at random in 22000-29999, checks it free, and binds it only
    later: two servers of one profile starting side by side can draw the same port, and the
    second dies minutes into its start. A fixed port outside that range is checked free
    before anything starts, like every other port of the profile (a collision is a config
    error naming the key: set options.nccl-port). A server spanning nodes uses its
    dist-init address instead and is left alone."""
    per_node: dict[str | None, int] = {}
    for s in specs:
        if s.kind == "server" and not s.nodes:
            per_node[s.node] = per_node.get(s.node, 0) + 1
    out = []
    for s in specs:
        if (s.kind == "server" and not s.nodes and per_node.get(s.node, 0) > 1 and s.option("nccl-port") is None
                and s.port + NCCL_PORT_OFFSET <= MAX_PORT):
            s = _replace(s, options=(*s.options, ("nccl-port", s.port + NCCL_PORT_OFFSET)))
        out.append(s)
    return out


def _check_sglang_ports(path: Path, specs: list[ProcessSpec]) -> None:
    """Refuse ports SGLang may take by itself: a collision would surface minutes into a start.

    Every server without --nccl-port picks its NCCL port at random in 22000-29999 (the router's
    default metrics port 29000 is in it), and a dp-attention server also binds its port + 13
    and + 233..239. We refuse rather than pin: a pinned --nccl-port is a port of its own that could
    collide with a server of another profile, while a port outside SGLang's ranges cannot.
    """
    reserved = {s.port + off: s for s in specs if s.kind == "server" and s.option("enable-dp-attention") is True
                for off in timing.DP_ATTENTION_PORT_OFFSETS}
    nccl = timing.NCCL_RANDOM_PORTS
    for s in specs:
        for listen in s.listens():
            if listen.port in nccl:
                unset = listen.label.endswith("metrics") and s.option("prometheus-port") is None
                what = f"not set, and the router's default {listen.port}" if unset else f"port {listen.port}"
                raise ConfigError(path, listen.key, f"{what} is in SGLang's random NCCL port range "
                                                    f"{nccl.start}-{nccl.stop - 1}: a server may take it first; "
                                                    "set a port outside that range")
            other = reserved.get(listen.port)
            if other is not None and other is not s:
                offsets = ", ".join(f"+{o}" for o in timing.DP_ATTENTION_PORT_OFFSETS)
                raise ConfigError(path, listen.key, f"port {listen.port} is one of the ports {other.key} binds with "
                                                    f"enable-dp-attention (its port {offsets})")


_START_RANK = {"prefill": 0, "regular": 1, "decode": 2, "router": 3}
_STOP_RANK = {"router": 0, "decode": 1, "regular": 2, "prefill": 3}


def _start_order(path: Path, specs: list[ProcessSpec]) -> list[ProcessSpec]:
    by_name = {s.name: s for s in specs}
    for s in specs:
        where = ROUTER if s.kind == "router" else f"servers.{s.name}"
        for i, dep in enumerate(s.after):
            if dep not in by_name:
                raise ConfigError(path, f"{where}.after[{i}]", f"no process named {dep!r}")
            if dep == s.name:
                raise ConfigError(path, f"{where}.after[{i}]", "a process cannot wait for itself")
    order: list[ProcessSpec] = []
    done: set[str] = set()
    remaining = list(specs)
    while remaining:
        ready = [s for s in remaining if all(d in done for d in s.after)]
        if not ready:
            raise ConfigError(path, "after", "dependency cycle: " + _describe_cycle(remaining))
        ready.sort(key=lambda s: _START_RANK[s.role])
        for s in ready:
            order.append(s)
            done.add(s.name)
            remaining.remove(s)
    return order


def _describe_cycle(remaining: list[ProcessSpec]) -> str:
    by_name = {s.name: s for s in remaining}
    node = remaining[0].name
    path: list[str] = []
    while node not in path:
        path.append(node)
        node = next(d for d in by_name[node].after if d in by_name)
    cycle = path[path.index(node):] + [node]
    return " -> ".join(cycle)


def _stop_order(path: Path, ordered: list[ProcessSpec], explicit: tuple[str, ...] | None) -> tuple[str, ...]:
    names = [s.name for s in ordered]
    if explicit is not None:
        if sorted(explicit) != sorted(names):
            raise ConfigError(path, "stop_order", f"must list every process exactly once ({', '.join(names)})")
        return tuple(explicit)
    dependants = {s.name: {o.name for o in ordered if s.name in o.after} for s in ordered}
    out: list[str] = []
    left = {s.name: s for s in ordered}
    while left:
        free = [s for s in left.values() if not (dependants[s.name] & left.keys())]
        free.sort(key=lambda s: (_STOP_RANK[s.role], -names.index(s.name)))
        out.append(free[0].name)
        del left[free[0].name]
    return tuple(out)
