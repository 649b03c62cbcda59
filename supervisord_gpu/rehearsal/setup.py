"""Rehearsal: the explicit no-GPU mode. What runs instead of SGLang, and the stand-ins' environment.

The one place that says what a rehearsal swaps; daemon.py's Backends asks it once, at assembly
(with the simulated GPUs of checks/gpus.py's `inventory_for`), and nothing below decides again.
"""

from __future__ import annotations

import importlib.util
import sys

from ..checks.gpus import simgpu_dir
from ..checks.simgpu import ENV_DIR
from ..config.model import DaemonConfig
from ..config.render import Programs

ENV_STARTUP = "SUPERVISORD_GPU_STANDIN_STARTUP_S"
ENV_MIB = "SUPERVISORD_GPU_STANDIN_MIB"

STANDIN_SERVER = ("-m", "supervisord_gpu.rehearsal.standin_server")
STANDIN_ROUTER = ("-m", "supervisord_gpu.rehearsal.standin_router")
REAL_ROUTER = ("-m", "sglang_router.launch_router")


def router_program(cfg: DaemonConfig) -> tuple[str, ...]:
    """In rehearsal: the real sglang-router when installed (it runs on CPU), else the stand-in."""
    choice = cfg.rehearsal.router
    if choice == "real" or (choice == "auto" and importlib.util.find_spec("sglang_router") is not None):
        return (sys.executable, *REAL_ROUTER)
    return (sys.executable, *STANDIN_ROUTER)


def stand_ins(cfg: DaemonConfig) -> Programs:
    """The stand-in server, the router, and their environment: where the simulated GPUs are,
    how long a stand-in loads, how much of each GPU it holds."""
    env = ((ENV_DIR, str(simgpu_dir(cfg))),
           (ENV_STARTUP, str(cfg.rehearsal.server_startup_s)),
           (ENV_MIB, str(cfg.rehearsal.server_mib_per_gpu)))
    return Programs((sys.executable, *STANDIN_SERVER), router_program(cfg), env)
