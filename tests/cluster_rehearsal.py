"""`make rehearse-cluster`: a whole cluster on one machine, for a newcomer to watch.

Three hosts, each a real systemd in a container with a network namespace of its own on a
private bridge (nothing leaves the machine): etcd on c, our units, config and agent on a and b
(see tests/test_cluster_systemd.py, whose rig this is). Stand-in servers on simulated GPUs,
the real router. It starts PD across a and b from node a, shows `gpusupctl status --cluster`,
prints the plan of a switch to one TP server spanning both nodes, switches, shows the
processes' order across nodes from etcd's history, switches back, and tears everything down.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_cluster_systemd as T  # noqa: E402


def say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def main() -> int:
    say("booting hosts a, b (our units and agent) and c (etcd) on a private bridge")
    with T.three_hosts() as cl:
        a = cl.nodes["a"]
        print(f"a={cl.addr['a']}  b={cl.addr['b']}  c={cl.addr['c']} (etcd {cl.etcd_url})")
        for profile in ("pd", "tp"):
            say(f"node a: gpusupctl switch {profile}  (PD across a and b; then one TP server over both)")
            t0 = time.monotonic()
            r = a.run([cl.ctl, "switch", profile, "--wait"], check=False, timeout=300)
            print(r.stdout + r.stderr, f"[{time.monotonic() - t0:.1f} s]")
            say("node a: gpusupctl status --cluster")
            print(a.run([cl.ctl, "status", "--cluster"], check=False).stdout)
        say("the order across nodes, from etcd's history (its revisions are the one shared clock)")
        for key, state in cl.history():
            if key.startswith("parts/pd/") and state in ("stopping", "stopped") or "/steps/" in key:
                print(f"  {key:40} {state or '(gone)'}")
        say("node a: gpusupctl switch pd  (and back)")
        print(a.run([cl.ctl, "switch", "pd", "--wait"], check=False, timeout=300).stdout)
        say("tearing down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
