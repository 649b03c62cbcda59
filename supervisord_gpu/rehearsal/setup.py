"""Rehearsal: the explicit no-GPU mode. What runs instead of SGLang, and the stand-ins' environment.

The one place that says what a rehearsal swaps; daemon.py's Backends asks it once, at assembly
(with the simulated GPUs of checks/gpus.py's `inventory_for`), and nothing below decides again.
"""

from __future__ import annotations

import sys

from ..checks.gpus import simgpu_dir
from ..checks.simgpu import ENV_DIR
from ..config.model import DaemonConfig
from ..config.render import Programs
from ..sglang import routers
from ..sglang.routers import RouterKind

ENV_STARTUP = "SUPERVISORD_GPU_STANDIN_STARTUP_S"
ENV_MIB = "SUPERVISORD_GPU_STANDIN_MIB"

STANDIN_SERVER = ("-m", "supervisord_gpu.rehearsal.standin_server")
STANDIN_ROUTER = ("-m", "supervisord_gpu.rehearsal.standin_router")
ENV_ROUTER_KIND = routers.STANDIN_KIND_ENV


def rehearsed_router(cfg: DaemonConfig) -> RouterKind:
    """The router a rehearsal plays: the one production would run (router_command's, else the
    installed one's), or smg, the current one, where neither is installed or the command is unknown."""
    _, kind = routers.resolve(cfg.router_command)
    return kind or routers.SMG


def router_program(cfg: DaemonConfig) -> tuple[str, ...]:
    """In rehearsal: that router itself when installed (both run on CPU), else the stand-in playing it."""
    kind = rehearsed_router(cfg)
    choice = cfg.rehearsal.router
    if choice == "real" or (choice == "auto" and kind.installed()):
        return (sys.executable, "-m", kind.module)
    return (sys.executable, *STANDIN_ROUTER)


def stand_ins(cfg: DaemonConfig) -> Programs:
    """The stand-in server, the router, and their environment: where the simulated GPUs are,
    how long a stand-in loads, how much of each GPU it holds, which router the stand-in plays."""
    kind = rehearsed_router(cfg)
    env = ((ENV_DIR, str(simgpu_dir(cfg))),
           (ENV_STARTUP, str(cfg.rehearsal.server_startup_s)),
           (ENV_MIB, str(cfg.rehearsal.server_mib_per_gpu)),
           (ENV_ROUTER_KIND, kind.name))
    return Programs((sys.executable, *STANDIN_SERVER), router_program(cfg), env, router_kind=kind)
