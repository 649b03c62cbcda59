"""The cluster transition's own overhead, PD across two nodes -> one TP server over both nodes,
against the hand procedure, in the same run, on the test rig's three hosts (real systemd 252 in
containers on a private bridge, etcd on the third; stand-in servers, the real router).

overhead = wall time of the switch - the servers' drain - the new servers' start-up

measured the same way for both:
- drain: the old processes' own stop times, in their order across nodes (router@a, decode@b,
  prefill@a: each one's GPUSUP_EVENT=stopped duration, from our journal);
- start-up: the new server's spawn -> ready (its ranks on both nodes load at once: the longer),
  then the router's spawn -> ready.
The hand procedure's drain is its own (it kills a node's processes at once: router and prefill
drain together, and prefill goes while decode on b still serves, which is what our order
prevents): per node, from the kill to the last of them gone. Its start-up is ours (the very
same stand-ins with the very same command lines, `gpusupctl render --json`).

The hand procedure, per node, as an operator runs it (ssh = a command run on that host): kill
that node's old processes, sleep 3, poll every second until they are gone and its GPUs idle;
then start the new server's ranks on both nodes, poll every second until rank 0 answers, start
the router, poll until it is ready.
"""

from __future__ import annotations

import json
import statistics
import time

from common import summary, table, write

RUNS = 3


def journal(ctr, unit: str, *match: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return [json.loads(x) for x in ctr.journal(unit, *match, "-o", "json").splitlines() if x.strip()]


def last(records: list[dict], process: str) -> dict:
    return [r for r in records if r.get("GPUSUP_PROCESS") == process][-1]


def drain_and_start_up(cl) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    a, b = cl.nodes["a"], cl.nodes["b"]
    stopped_a, stopped_b = journal(a, "dsv4@pd", "GPUSUP_EVENT=stopped"), journal(b, "dsv4@pd", "GPUSUP_EVENT=stopped")
    drain = sum(float(last(recs, p)["GPUSUP_DURATION_S"]) for recs, p in
                ((stopped_a, "router"), (stopped_b, "decode"), (stopped_a, "prefill")))

    def spawn_to_ready(ctr, process: str) -> float:  # type: ignore[no-untyped-def]
        spawned = last(journal(ctr, "dsv4@tp", "GPUSUP_EVENT=spawn"), process)
        ready = last(journal(ctr, "dsv4@tp", "GPUSUP_EVENT=ready"), process)
        return (int(ready["__REALTIME_TIMESTAMP"]) - int(spawned["__REALTIME_TIMESTAMP"])) / 1e6

    start_up = max(spawn_to_ready(a, "big"), spawn_to_ready(b, "big")) + spawn_to_ready(a, "router")
    return drain, start_up


def ours(cl) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    a = cl.nodes["a"]
    a.systemctl("start", "dsv4@pd", timeout=180)
    t0 = time.monotonic()
    if a.systemctl("start", "dsv4@tp", timeout=300, check=False).returncode != 0:
        raise RuntimeError("the switch to tp failed: " + a.systemctl("show", "-P", "StatusText", "dsv4@tp").stdout
                           + cl.journals())
    total = time.monotonic() - t0
    a.systemctl("stop", "dsv4@tp", timeout=180)
    drain, start_up = drain_and_start_up(cl)
    return total, drain, start_up


def rendered(ctr, profile: str) -> list[dict]:  # type: ignore[no-untyped-def]
    from box import REPO

    out = ctr.run([f"{REPO}/.venv/bin/gpusupctl", "render", profile, "--json"]).stdout
    return json.loads(out)["start_order"]


def launch(ctr, tag: str, process: dict) -> None:  # type: ignore[no-untyped-def]
    env = [f"--setenv={k}={v}" for k, v in process["env"].items()]
    # RemainAfterExit: the unit (and its exit timestamp) stays after the process is gone
    ctr.run(["systemd-run", f"--unit=hand-{tag}-{process['process']}", "-p", "RemainAfterExit=yes", *env, "--",
             *process["argv"]])


def poll(ctr, url: str) -> None:  # type: ignore[no-untyped-def]
    while ctr.run(["curl", "-sf", "-o", "/dev/null", url], check=False).returncode != 0:
        time.sleep(1.0)


def hand(cl) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The switch by hand; returns its wall time and its own drain: per node, from the kill to the
    last of that node's processes gone (both of a's drain at once: the hand kills them together)."""
    a, b = cl.nodes["a"], cl.nodes["b"]
    pd = {n: rendered(c, "pd") for n, c in cl.nodes.items()}
    tp = {n: rendered(c, "tp") for n, c in cl.nodes.items()}
    launch(b, "pd", pd["b"][0])
    launch(a, "pd", pd["a"][0])
    poll(a, "http://127.0.0.1:31000/health")
    poll(b, "http://127.0.0.1:31001/health")
    launch(a, "pd", pd["a"][1])
    poll(a, "http://127.0.0.1:30001/readiness")
    t0 = time.monotonic()
    drains = []
    for node in ("a", "b"):  # the router's node first
        ctr = cl.nodes[node]
        killed_us = int(ctr.run(["sh", "-c", "python3 -c 'import time; print(time.monotonic_ns() // 1000)'; "
                                 "systemctl kill --signal=TERM 'hand-pd-*'"]).stdout.split()[0])
        time.sleep(3)
        while any(ctr.systemctl("show", "-P", "MainPID", f"hand-pd-{p['process']}").stdout.strip() != "0"
                  for p in pd[node]) or \
                json.loads(ctr.run([f"{CTL}", "gpus", "--json"]).stdout)["gpus"][0]["used_mib"] > 1024:
            time.sleep(1.0)
        gone_us = max(int(ctr.systemctl("show", "-P", "ExecMainExitTimestampMonotonic", f"hand-pd-{p['process']}")
                          .stdout.strip() or 0) for p in pd[node])
        drains.append((gone_us - killed_us) / 1e6)
    launch(b, "tp", tp["b"][0])
    launch(a, "tp", tp["a"][0])
    poll(a, "http://127.0.0.1:31002/health")
    launch(a, "tp", tp["a"][1])
    poll(a, "http://127.0.0.1:30001/readiness")
    total = time.monotonic() - t0
    for ctr in (a, b):
        ctr.run(["systemctl", "stop", "hand-tp-*", "hand-pd-*"], check=False)
        ctr.run(["systemctl", "reset-failed"], check=False)
    return total, sum(drains)


def main() -> dict[str, object]:
    import test_cluster_systemd as T

    samples: dict[str, list[float]] = {"ours": [], "hand": [], "ours_total": [], "hand_total": [], "drain": [], "hand_drain": [], "start_up": []}
    with T.three_hosts() as cl:
        global CTL
        CTL = cl.ctl
        for _ in range(RUNS):
            total, drain, start_up = ours(cl)
            samples["ours_total"].append(total)
            samples["drain"].append(drain)
            samples["start_up"].append(start_up)
            samples["ours"].append(total - drain - start_up)
            total_hand, drain_hand = hand(cl)
            samples["hand_total"].append(total_hand)
            samples["hand_drain"].append(drain_hand)
            samples["hand"].append(total_hand - drain_hand - start_up)  # the same stand-ins: the same start-up
    result = {
        "what": "PD across 2 nodes -> TP over 2 nodes; 3 hosts (real systemd 252 each, private bridge, etcd on the "
                "third); stand-in servers (1 s start-up), real sglang-router; overhead = total - drain - start-up",
        "overhead_s": {"supervisord_gpu_cluster": summary(samples["ours"]), "hand_ssh_kill_sleep3_poll": summary(samples["hand"])},
        "total_s": {"supervisord_gpu_cluster": summary(samples["ours_total"]), "hand": summary(samples["hand_total"])},
        "drain_s": {"supervisord_gpu_cluster_in_order": summary(samples["drain"]),
                    "hand_router_and_prefill_at_once": summary(samples["hand_drain"])},
        "start_up_s": summary(samples["start_up"]),
    }
    result["ratios"] = {"overhead_hand_over_ours": statistics.median(samples["hand"]) / statistics.median(samples["ours"])}
    path = write("cluster", result)
    print(table([
        ("measure", "supervisord-gpu (median)", "hand procedure (median)", "ratio"),
        ("cluster switch overhead (2 nodes)", f"{statistics.median(samples['ours']):.2f} s",
         f"{statistics.median(samples['hand']):.2f} s", f"{result['ratios']['overhead_hand_over_ours']:.1f}x"),
        ("cluster switch total", f"{statistics.median(samples['ours_total']):.2f} s",
         f"{statistics.median(samples['hand_total']):.2f} s", "-"),
    ]))
    print(f"-> {path}")
    return result


CTL = ""

if __name__ == "__main__":
    main()
