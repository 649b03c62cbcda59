"""From a validated profile to the exact argv and environment of each process.

Never through a shell: each option becomes list elements, so a value holding `;`, `$(...)`,
quotes or a newline reaches SGLang as one literal argument. Full flag names only
(`--tp-size`, never `--tp`), because SGLang's argparse would accept prefixes silently.
"""

from __future__ import annotations

import os
import pwd
from ..records import dataclass
from pathlib import Path
from collections.abc import Mapping

from ..sglang import admin_key, router_key, routers
from ..sglang.routers import RouterKind
from ..errors import ConfigError
from ..sglang.caches import cache_environment
from .model import DaemonConfig, OptionValue, ProcessSpec, Profile

# What a child takes from the daemon's environment; everything else it gets is set here, by
# name: its user's HOME/USER/LOGNAME, TMPDIR, the compile-cache variables, CUDA_VISIBLE_DEVICES
# and CUDA_DEVICE_ORDER, then the profile's env. Never root's HOME, nor what would talk to our
# unit (NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*, INVOCATION_ID).
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ")


@dataclass(frozen=True)
class Programs:
    """What a server and a router run as, and what every child's environment gains on top of its
    own: SGLang and its router from the config, or the rehearsal's stand-ins (rehearsal/setup.py).
    Chosen once, where the daemon is assembled (daemon.py's Backends); render only applies it."""

    server: tuple[str, ...]
    #: () when the config names no router_command and no router is installed (said at render)
    router: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    #: which router `router` runs (sglang/routers.py); None for a command we do not know
    router_kind: RouterKind | None = None
    #: why `router` cannot run here ("" when it can): the config names none and none is installed.
    #: `render` then shows the preferred router's command; a start refuses (controller/preflight.py),
    #: `check` lists it beside the other problems and `switch --dry-run` warns, as for a missing model.
    router_missing: str = ""

    @classmethod
    def of(cls, cfg: DaemonConfig) -> Programs:
        """The real programs: `sglang_command`, and `router_command` or else the installed router."""
        command, kind = routers.resolve(cfg.router_command)
        if not command:
            kind = routers.ROUTERS[0]
            return cls(tuple(cfg.sglang_command), kind.command(), router_kind=kind,
                       router_missing=str(routers.NoRouterInstalled()))
        return cls(tuple(cfg.sglang_command), command, router_kind=kind)


@dataclass(frozen=True)
class Launch:
    """What `gpusupctl render` prints and what the engine runs."""

    spec: ProcessSpec
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # set on top of the daemon's environment
    user: str | None
    #: a TMPDIR only this process uses (SGLang's ipc:// files land there), emptied after every stop
    tmpdir: Path | None = None
    #: the persistent compile cache of the process's user (servers only)
    cache_root: Path | None = None
    #: a router's control-plane key file (sglang/router_key.py): read at spawn, never in `env`,
    #: so `gpusupctl render` never prints it
    router_key: Path | None = None
    #: a router's workers as the profile names them: (url, worker_type); any other is foreign
    router_workers: tuple[tuple[str, str], ...] = ()
    #: a server's admin key file (sglang/admin_key.py): read at spawn, never in `env` either
    admin_key: Path | None = None

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k in PASSED_ENV or k.startswith("LC_")}
        env.update(self.env)
        if self.router_key is not None:
            env[router_key.KEY_ENV] = router_key.ensure_key(self.router_key)
        if self.admin_key is not None:
            env[admin_key.KEY_ENV] = router_key.ensure_key(self.admin_key)
        return env


def render_options(options: tuple[tuple[str, OptionValue], ...]) -> list[str]:
    argv: list[str] = []
    for key, value in options:
        flag = f"--{key}"
        if value is True:
            argv.append(flag)
        elif value is False:
            continue
        elif isinstance(value, tuple):
            argv.append(flag)
            argv.extend(value)
        else:
            argv.extend([flag, str(value)])
    return argv


def server_args(spec: ProcessSpec) -> list[str]:
    managed = ["--model-path", spec.model_path or "", "--host", spec.host, "--port", str(spec.port)]
    if spec.role in ("prefill", "decode"):
        managed += ["--disaggregation-mode", spec.role]
    if spec.nodes:
        host = f"[{spec.dist_init_host}]" if ":" in (spec.dist_init_host or "") else spec.dist_init_host
        managed += ["--nnodes", str(len(spec.nodes)), "--node-rank", str(spec.node_rank),
                    "--dist-init-addr", f"{host}:{spec.dist_init_port}"]
    return checked_once(spec, managed, render_options(spec.options))


def checked_once(spec: ProcessSpec, managed: list[str], rest: list[str]) -> list[str]:
    """The argv as a whole: every flag the profile's own keys set appears exactly once, with our
    value. The loader already refuses managed keys in options and values that start with '--';
    this is the last look before anything runs, at what SGLang's argparse will actually see."""
    flags = managed[0::2]
    for token in rest:
        name = token.split("=", 1)[0]
        if any(f == name or (name.startswith("--") and len(name) > 2 and f.startswith(name)) for f in flags):
            raise ConfigError("", f"{spec.key}.options", f"the rendered command line would set {name} again "
                                                         f"(the profile sets it: {' '.join(managed)})")
    return managed + rest


def router_args(spec: ProcessSpec, profile: Profile, kind: RouterKind | None = None) -> list[str]:
    rest = _router_topology(spec, profile)
    if kind is not None:
        check_router_options(spec, kind)
        if kind.no_tokenizer_fetch and kind.no_tokenizer_fetch not in rest:
            # no hub fetch at start: an offline box would otherwise wait on it (and the servers
            # report their own tokenizer path anyway)
            rest.append(kind.no_tokenizer_fetch)
    if any(t.split("=", 1)[0] == "--control-plane-api-keys" for t in rest):
        raise ConfigError("", f"{spec.key}.options", "control-plane-api-keys is the daemon's own (a key of its "
                          "making, kept off the command line); a key in the options would be readable in ps")
    return checked_once(spec, ["--host", spec.host, "--port", str(spec.port)], rest)


def _router_topology(spec: ProcessSpec, profile: Profile) -> list[str]:
    args: list[str] = []
    if spec.router_mode == "pd":
        args.append("--pd-disaggregation")
        for name in spec.prefill:
            server = profile.process(name)
            args += ["--prefill", server.url, str(server.bootstrap_port)]
        for name in spec.decode:
            args += ["--decode", profile.process(name).url]
    else:
        args += ["--worker-urls", *(profile.process(n).url for n in spec.workers)]
    return args + render_options(spec.options)


def check_router_options(spec: ProcessSpec, kind: RouterKind) -> None:
    """Each [router.options] key against the table of the router that will run (sglang/routers.py):
    `mini-lb` under smg is one line naming the key, before anything starts."""
    for key, _ in spec.options:
        if not routers.has_option(kind, key):
            raise ConfigError("", f"{spec.key}.options.{key}", f"{kind.name} {kind.version} has no option --{key} "
                                                             f"(its table: supervisord_gpu/data/{kind.options_file})")
    # Only a router that holds its port for a fixed window (smg's 5 s) cannot stop sooner; one that
    # exits once drained (sglang-router 0.3.2) may be given any timeout: a short one is SIGKILL sooner.
    least = kind.stop_idle_exit_s + 1.0
    if kind.stop_listen_s > 0 and spec.stop_timeout_s < least:
        raise ConfigError("", f"{spec.key}.stop_timeout", f"{spec.stop_timeout_s:g} s is shorter than {kind.name}'s own "
                          f"stop (it keeps its port {kind.stop_listen_s:g} s after SIGTERM and exits after "
                          f"~{kind.stop_idle_exit_s:g} s when idle): at least {least:g} s")


def check_rl(spec: ProcessSpec, program: tuple[str, ...]) -> None:
    """`enable-rl` (smg) mounts /v1/rl/..., which pauses every worker and loads new weights into
    them, behind the control-plane key only: with none configured smg answers anyone. So it is
    refused unless the router is started through the key shim (sglang/router_key.py)."""
    if dict(spec.options).get("enable-rl") and not router_key.shim_argv(program):
        raise ConfigError("", f"{spec.key}.options.enable-rl", "opens /v1/rl (pause every worker, load weights into "
                          "them) to anyone who reaches the router unless it has the daemon's control-plane key, "
                          "which this router_command cannot carry (not `PYTHON -m MODULE`)")


def router_workers(spec: ProcessSpec, profile: Profile) -> tuple[tuple[str, str], ...]:
    """(url, worker_type) of each worker the profile gives the router, as its GET /workers lists them."""
    if spec.router_mode == "pd":
        return (*((profile.process(n).url, "prefill") for n in spec.prefill),
                *((profile.process(n).url, "decode") for n in spec.decode))
    return tuple((profile.process(n).url, "regular") for n in spec.workers)


def keyed_router(program: tuple[str, ...]) -> tuple[str, ...]:
    """The router program wrapped so its control-plane key comes from the environment, not argv."""
    return _keyed(router_key.shim_argv(program), program, "router_command",
                  "is not `PYTHON -m MODULE`: the router's control-plane key can only reach it off its "
                  "(world-readable) command line through a Python module run with -m")


def keyed_server(program: tuple[str, ...]) -> tuple[str, ...]:
    """The server program wrapped so its admin key comes from the environment, not argv."""
    return _keyed(admin_key.shim_argv(program), program, "server_command",
                  "is neither `PYTHON -m MODULE` nor `PYTHON SCRIPT.py`: the server's admin key can only reach "
                  "it off its (world-readable) command line through Python")


def _keyed(wrapped: tuple[str, ...], program: tuple[str, ...], key: str, why: str) -> tuple[str, ...]:
    """The shim's argv, or the one line saying why a key cannot reach this program."""
    if not wrapped:
        raise ConfigError("", key, f"{' '.join(program)!r} {why}")
    return wrapped


def user_environment(profile: Profile, spec: ProcessSpec) -> tuple[str, list[tuple[str, str]]]:
    """(account name, HOME/USER/LOGNAME) of the user a process runs as; an unknown user is a config error."""
    try:
        pw = pwd.getpwnam(spec.user) if spec.user is not None else pwd.getpwuid(os.geteuid())
    except KeyError:
        raise ConfigError(profile.path, f"{spec.key}.user", f"no such user {spec.user!r} on this machine") from None
    return pw.pw_name, [("HOME", pw.pw_dir), ("USER", pw.pw_name), ("LOGNAME", pw.pw_name)]


def render(profile: Profile, cfg: DaemonConfig, programs: Programs | None = None) -> list[Launch]:
    """Every process of `profile` in start order, run as `programs` (the config's own if not given)."""
    programs = programs if programs is not None else Programs.of(cfg)
    launches = []
    for spec in profile.processes:
        if spec.kind == "router" and not programs.router:  # the daemon's file, not the profile, says which
            raise ConfigError(cfg.path or cfg.config_dir / "supervisord-gpu.toml", "sglang.router_command",
                              str(routers.NoRouterInstalled()))
        account, env = user_environment(profile, spec)
        tmpdir = cfg.runtime_dir / profile.name / "tmp" / spec.name
        env.append(("TMPDIR", str(tmpdir)))
        cache_root = cfg.cache_dir / account if spec.kind == "server" else None
        if cache_root is not None:
            env += cache_environment(cache_root, dict(env).get("HOME"))
        # The programs' defaults next (a rehearsal's), so a profile's own env (a fault to inject, a start-up time) wins.
        env += programs.env
        env += spec.env
        key: Path | None = None
        admin: Path | None = None
        try:
            if spec.kind == "server":
                # GPU indices in a profile are NVML's (nvidia-smi's), which follow the PCI bus; CUDA's
                # default order is "fastest first", so without PCI_BUS_ID index 0 may be another card.
                env[:0] = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in spec.gpus))]
                argv = (*keyed_server(programs.server), *server_args(spec))
                admin = admin_key.key_path(cfg.runtime_dir, profile.name, spec.name)
            else:
                check_rl(spec, programs.router)
                argv = (*keyed_router(programs.router), *router_args(spec, profile, programs.router_kind))
                key = router_key.key_path(cfg.runtime_dir, profile.name)
        except ConfigError as e:
            raise ConfigError(profile.path, e.key, e.problem) from None
        launches.append(Launch(spec, tuple(argv), tuple(env), spec.user, tmpdir, cache_root, key,
                               router_workers(spec, profile) if key is not None else (), admin))
    return launches
