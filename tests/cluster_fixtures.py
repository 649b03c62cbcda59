"""What the cluster's record tests share: a node's config with profiles (two spanning nodes a and
b, one single-machine), an in-memory store, and units that only record what they were told."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from supervisord_gpu.cluster.kv import MemoryKV
from supervisord_gpu.cluster.store import ClusterStore
from supervisord_gpu.config.loader import load_daemon_config
from supervisord_gpu.config.model import DaemonConfig
from test_cluster_config import PD_ACROSS, TP_SPANNING

# the same two cluster profiles test_cluster_config.py checks, and one for a single machine
PROFILES = {
    "pd": PD_ACROSS,
    "tp": TP_SPANNING,
    "solo": """
[servers.main]
gpus = [0]
port = 32000
model_path = "/m"
""",
}
CLUSTER_PROFILES = ("pd", "tp")


def node_config(tmp: Path, node: str = "a", etcd: str = "http://127.0.0.1:9") -> DaemonConfig:
    """Node `node`'s config under `tmp`, written once: called again (a test's store, read while
    that node's agent runs in a thread), it leaves the files alone. Rewriting them in place had the
    agent now and then read a profile truncated mid-write ("servers: is required") and ignore a
    rollback (test_cluster_decisions, about 1 run in 60 under load)."""
    (tmp / "profiles").mkdir(parents=True, exist_ok=True)
    _write_once(tmp / "supervisord-gpu.toml",
                f'[daemon]\ndefault_user = "root"\n[gpus]\nbackend = "simulated"\nwait_idle_timeout = 1\n'
                f'[cluster]\nnode = "{node}"\netcd = ["{etcd}"]\nprefix = "/c"\nlease_ttl = 30\n'
                'insecure = true\n')  # a local etcd of the tests' own, without TLS or login
    for name, text in PROFILES.items():
        _write_once(tmp / "profiles" / f"{name}.toml", textwrap.dedent(text))
    return load_daemon_config(tmp)


def _write_once(path: Path, text: str) -> None:
    """`text` into `path` unless it holds it already; a new text replaces the file whole (a
    reader sees the old file or the new one, never half of it)."""
    if path.exists() and path.read_text() == text:
        return
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def memory_store(cfg: DaemonConfig, kv: MemoryKV | None = None, said: list[str] | None = None) -> ClusterStore:
    return ClusterStore(cfg.cluster, kv or MemoryKV(), warn=(said.append if said is not None else lambda _m: None))


class FakeUnits:
    """This node's dsv4@ units as the agent sees them: every order recorded, none carried out."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def stop(self, instance: str) -> str:
        self.calls.append(("stop", instance))
        return ""

    def start(self, instance: str) -> str:
        self.calls.append(("start", instance))
        return ""

    def states(self) -> dict[str, str]:
        return {}


class NoGpus:
    def snapshot(self) -> list[Any]:
        return []
