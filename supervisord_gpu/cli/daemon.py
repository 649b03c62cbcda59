"""`supervisord-gpu run NAME`: the daemon for one instance, as started by dsv4@NAME.service."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from .. import __version__
from .common import guarded

PROG = "supervisord-gpu"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Supervise one SGLang deployment (a profile) through cgroups.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run the instance NAME until stopped (what dsv4@NAME.service runs)")
    run.add_argument("name", metavar="NAME", help="profile name: profiles/NAME.toml in the config directory")
    run.add_argument("--config-dir", help="configuration directory (default: $SUPERVISORD_GPU_CONFIG_DIR or /etc/supervisord-gpu)")
    run.add_argument("--rehearsal", action="store_true", help="stand-in servers on simulated GPUs (no GPU, no SGLang)")
    run.add_argument("--stderr", action="store_true", help="log to stderr even under systemd")
    agent = sub.add_parser("agent", help="this node's cluster agent (what gpusup-agent.service runs)")
    agent.add_argument("--config-dir", help="configuration directory (default: $SUPERVISORD_GPU_CONFIG_DIR or /etc/supervisord-gpu)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def go() -> int:
        if args.command == "agent":
            return run_agent(args.config_dir)
        import signal

        # A SIGTERM before the daemon's own handlers exist (a takeover stopping us while we import)
        # is kept, not fatal: the daemon then stops at once and says who took over.
        early: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: early.append(signum))
        from ..daemon import RunOptions, run

        return run(args.name, args.config_dir, RunOptions(rehearsal=args.rehearsal, force_stderr=args.stderr,
                                                          stopped_early=lambda: bool(early)))

    return guarded(PROG, go)


def run_agent(config_dir: str | None) -> int:
    """Until SIGTERM: this node in etcd, and its share of every cluster transition."""
    import signal

    from ..cluster.agent import NodeAgent, Units
    from ..cluster.store import ClusterStore
    from ..config.loader import load_daemon_config
    from ..checks.gpus import inventory_for
    from ..systemd.journal import open_sink
    from ..api.notify import Notifier

    cfg = load_daemon_config(config_dir)
    sink = open_sink("agent")
    agent = NodeAgent(cfg, ClusterStore(cfg.cluster), Units(), inventory_for(cfg, simulated=cfg.rehearsal.enabled),
                      lambda message, priority: sink.event(message, priority))
    set_on_signal(agent.stopping, signal.SIGTERM)
    notifier = Notifier()

    def joined() -> None:
        notifier.status(f"node {cfg.cluster.node} in etcd at {agent.store.endpoint}")
        notifier.send("READY=1")

    agent.on_joined = joined
    return agent.run()


def set_on_signal(event: threading.Event, signum: int) -> None:
    """Set `event` when `signum` comes: from a relay thread, never inside the handler.

    Why: Python runs a handler in the main thread between two bytecodes, possibly inside
    event.wait() while that thread holds the event's (non-reentrant) lock; event.set() there
    would wait on it for ever, and systemd would SIGKILL the agent at TimeoutStopSec instead of
    it revoking its lease. The handler only writes a byte to a pipe, which takes no lock.
    Call from the main thread."""
    import signal

    r, w = os.pipe()

    def relay() -> None:
        os.read(r, 1)
        event.set()

    threading.Thread(target=relay, name=f"signal-{signum}", daemon=True).start()
    signal.signal(signum, lambda *_: os.write(w, b"s"))


if __name__ == "__main__":
    sys.exit(main())
