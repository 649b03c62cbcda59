"""Rehearsal: the explicit no-GPU mode. Simulated GPUs and the stand-ins' environment."""

from __future__ import annotations

from pathlib import Path

from ..checks.simgpu import ENV_DIR, SimulatedGpus
from ..config.model import DaemonConfig

ENV_STARTUP = "SUPERVISORD_GPU_STANDIN_STARTUP_S"
ENV_MIB = "SUPERVISORD_GPU_STANDIN_MIB"


def simgpu_dir(cfg: DaemonConfig) -> Path:
    return Path(cfg.rehearsal.simgpu_dir) if cfg.rehearsal.simgpu_dir else cfg.runtime_dir / "simgpu"


def prepare(cfg: DaemonConfig) -> tuple[SimulatedGpus, dict[str, str]]:
    """Make sure the simulated GPUs exist; return them and the environment for stand-ins."""
    directory = simgpu_dir(cfg)
    sim = SimulatedGpus(directory)
    if not sim.exists():
        sim = SimulatedGpus.create(directory, cfg.rehearsal.gpu_count, cfg.rehearsal.gpu_memory_mib)
    env = {
        ENV_DIR: str(directory),
        ENV_STARTUP: str(cfg.rehearsal.server_startup_s),
        ENV_MIB: str(cfg.rehearsal.server_mib_per_gpu),
    }
    return sim, env
