"""From a validated profile to the exact argv and environment of each process.

Never through a shell: each option becomes list elements, so a value holding `;`, `$(...)`,
quotes or a newline reaches SGLang as one literal argument. Full flag names only
(`--tp-size`, never `--tp`), because SGLang's argparse would accept prefixes silently.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Mapping

from .model import DaemonConfig, OptionValue, ProcessSpec, Profile

STANDIN_SERVER = ("-m", "supervisord_gpu.rehearsal.standin_server")
STANDIN_ROUTER = ("-m", "supervisord_gpu.rehearsal.standin_router")
REAL_ROUTER = ("-m", "sglang_router.launch_router")

# Variables of ours that must not leak into children (they would talk to our unit).
_PRIVATE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


@dataclass(frozen=True)
class Launch:
    """What `gpusupctl render` prints and what the engine runs."""

    spec: ProcessSpec
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # set on top of the daemon's environment
    user: str | None

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in _PRIVATE_ENV}
        env.update(self.env)
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
    args = ["--model-path", spec.model_path or "", "--host", spec.host, "--port", str(spec.port)]
    if spec.role in ("prefill", "decode"):
        args += ["--disaggregation-mode", spec.role]
    return args + render_options(spec.options)


def router_args(spec: ProcessSpec, profile: Profile) -> list[str]:
    args = ["--host", spec.host, "--port", str(spec.port)]
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


def router_program(cfg: DaemonConfig) -> tuple[str, ...]:
    """In rehearsal: the real sglang-router when installed (it runs on CPU), else the stand-in."""
    choice = cfg.rehearsal.router
    if choice == "real" or (choice == "auto" and importlib.util.find_spec("sglang_router") is not None):
        return (sys.executable, *REAL_ROUTER)
    return (sys.executable, *STANDIN_ROUTER)


def render(profile: Profile, cfg: DaemonConfig, rehearsal_env: Mapping[str, str] | None = None) -> list[Launch]:
    """Every process of `profile` in start order; `rehearsal_env` set means: stand-ins."""
    launches = []
    for spec in profile.processes:
        # Rehearsal defaults first, so a profile's own env (a fault to inject, a start-up time) wins.
        env = list(rehearsal_env.items()) if rehearsal_env is not None else []
        env += spec.env
        if spec.kind == "server":
            # GPU indices in a profile are NVML's (nvidia-smi's), which follow the PCI bus; CUDA's
            # default order is "fastest first", so without PCI_BUS_ID index 0 may be another card.
            env[:0] = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in spec.gpus))]
            program = (sys.executable, *STANDIN_SERVER) if rehearsal_env is not None else cfg.sglang_command
            argv = (*program, *server_args(spec))
        else:
            program = router_program(cfg) if rehearsal_env is not None else cfg.router_command
            argv = (*program, *router_args(spec, profile))
        launches.append(Launch(spec, tuple(argv), tuple(env), spec.user))
    return launches
