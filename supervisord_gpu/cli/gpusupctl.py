"""`gpusupctl`: the operator's tool. One command tree; read commands take --json.

Exit codes: 0 ok, 1 operation failed, 2 bad usage or profile, 3 preconditions not met,
4 daemon or bus not reachable. Imports are deferred to the command that needs them, so
`gpusupctl gpus` does not pay for D-Bus and `status` does not pay for NVML.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from .common import guarded

PROG = "gpusupctl"


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-dir", help="configuration directory (default: $SUPERVISORD_GPU_CONFIG_DIR or /etc/supervisord-gpu)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and control supervisord-gpu instances (dsv4@NAME.service).",
        epilog="exit codes: 0 ok, 1 operation failed, 2 bad usage or profile, 3 preconditions not met, 4 daemon or bus unreachable",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("render", help="print each process's argv and environment in start order")
    r.add_argument("name", metavar="NAME")
    r.add_argument("--rehearsal", action="store_true", help="render what rehearsal would run (stand-ins)")
    r.add_argument("--json", action="store_true")
    _config_arg(r)

    h = sub.add_parser("rehearse", help="run a profile end to end with stand-in servers on simulated GPUs")
    h.add_argument("name", metavar="NAME")
    h.add_argument("--hold", action="store_true", help="stay up after ready until Ctrl-C")
    h.add_argument("--startup", type=float, metavar="SECONDS", help="stand-in start-up time (default from config: 3 s)")
    h.add_argument("--verbose", "-v", action="store_true", help="also show every line the processes print")
    _config_arg(h)

    c = sub.add_parser("check", help="validate a profile and check its GPUs and ports, starting nothing")
    c.add_argument("name", metavar="NAME")
    c.add_argument("--rehearsal", action="store_true", help="check against the simulated GPUs")
    c.add_argument("--json", action="store_true")
    _config_arg(c)

    st = sub.add_parser("status", help="every dsv4@ instance, its processes, and a GPU summary")
    st.add_argument("name", metavar="NAME", nargs="?")
    st.add_argument("--json", action="store_true")
    st.add_argument("--cluster", action="store_true", help="every node of the cluster (etcd): its agent, parts and processes")
    _config_arg(st)

    for verb, text in (("start", "start dsv4@NAME through systemd"), ("stop", "stop dsv4@NAME through systemd"),
                       ("restart", "restart dsv4@NAME through systemd")):
        v = sub.add_parser(verb, help=text)
        v.add_argument("name", metavar="NAME")
        v.add_argument("--wait", action="store_true", help="follow progress live until ready, stopped or failed")
        v.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS", help="give up waiting after this long")

    lg = sub.add_parser("logs", help="the journal of dsv4@NAME, optionally of one process")
    lg.add_argument("name", metavar="NAME")
    lg.add_argument("process", metavar="PROCESS", nargs="?")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("-n", "--lines", type=int, metavar="N")

    sw = sub.add_parser("switch", help="ordered transition to TO: stop what holds its GPUs/ports, verify idle, start")
    sw.add_argument("to", metavar="TO")
    sw.add_argument("--from", dest="from_", metavar="FROM", help="the instance expected to be replaced (checked)")
    sw.add_argument("--dry-run", action="store_true", help="print the ordered plan (steps, deadlines, checks) and do nothing")
    sw.add_argument("--wait", action="store_true", help="follow progress live until TO is ready or failed")
    sw.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS")
    _config_arg(sw)

    g = sub.add_parser("gpus", help="GPU memory, idle or not, and who holds each GPU")
    g.add_argument("--rehearsal", action="store_true", help="show the simulated GPUs")
    g.add_argument("--json", action="store_true")
    _config_arg(g)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handler = {
        "render": cmd_render, "rehearse": cmd_rehearse, "check": cmd_check, "gpus": cmd_gpus, "status": cmd_status,
        "start": cmd_unit, "stop": cmd_unit, "restart": cmd_unit, "logs": cmd_logs, "switch": cmd_switch,
    }[args.command]
    return guarded(PROG, lambda: handler(args))


# ----------------------------------------------------------------------------- render


def cmd_render(args: argparse.Namespace) -> int:
    from ..config.loader import load_daemon_config, load_profile
    from ..config.render import render
    from ..config.loader import effective_config
    from ..daemon import programs_for

    cfg = effective_config(load_daemon_config(args.config_dir), args.rehearsal)
    profile = load_profile(cfg, args.name)
    launches = render(profile, cfg, programs_for(cfg))  # what the daemon will run, real or stand-ins
    if args.json:
        out = [
            {"process": launch.spec.name, "role": launch.spec.role, "user": launch.user, "argv": list(launch.argv),
             "env": dict(launch.env), "after": list(launch.spec.after)}
            for launch in launches
        ]
        print(json.dumps({"profile": profile.name, "start_order": out, "stop_order": list(profile.stop_order),
                          "stop_waves": [list(w) for w in profile.stop_waves]}, indent=2))
        return 0
    import shlex

    print(f"# {profile.name}: {profile.description}" if profile.description else f"# {profile.name}")
    for i, launch in enumerate(launches, 1):
        after = f" (after {', '.join(launch.spec.after)})" if launch.spec.after else ""
        print(f"\n[{i}] {launch.spec.name} ({launch.spec.role}){after}" + (f" as user {launch.user}" if launch.user else ""))
        for k, v in launch.env:
            print(f"    env {k}={shlex.quote(v)}")
        print("    argv " + " ".join(shlex.quote(a) for a in launch.argv))
    print(f"\nstop order: {profile.describe_stop_order()}  (+ stops together)")
    return 0


# ----------------------------------------------------------------------------- rehearse


def cmd_rehearse(args: argparse.Namespace) -> int:
    import asyncio
    from .. import records
    import time

    from ..config.loader import load_daemon_config, load_profile
    from ..config.loader import effective_config
    from ..daemon import RunOptions, serve
    from ..ownership.cgroupfs import cgroup2_mount
    from ..api.notify import status_text

    from ..config.trust import secure_directory

    cfg = effective_config(load_daemon_config(args.config_dir), True)
    # A directory of its own that every other `gpusupctl --rehearsal` finds (config/loader.py),
    # root's and 0755 like /run/supervisord-gpu: the stand-ins' user reaches its TMPDIR there.
    runtime = secure_directory(cfg.runtime_dir)
    rehearsal = cfg.rehearsal
    if args.startup is not None:
        rehearsal = records.replace(rehearsal, server_startup_s=max(0.0, args.startup))
    mount = cgroup2_mount()
    cgroup_root = cfg.cgroup_root
    if cgroup_root is None and mount is not None:
        cgroup_root = str(mount / "supervisord-gpu-rehearsal" / "supervisord-gpu")
    ownership = cfg.ownership if cfg.ownership != "systemd" else "auto"
    cfg = records.replace(cfg, cache_dir=runtime / "cache", rehearsal=rehearsal,
                              cgroup_root=cgroup_root, ownership=ownership)
    profile = load_profile(cfg, args.name)
    _reach_from_servers(cfg, profile, args.config_dir)
    t0 = time.monotonic()
    out = sys.stdout

    def show(event) -> None:  # type: ignore[no-untyped-def]
        stamp = f"{time.monotonic() - t0:7.2f}s"
        if event.kind == "process" and event.state:
            out.write(f"{stamp}  {event.process:<10} {event.message}\n")
        elif event.kind == "phase" and event.message:
            out.write(f"{stamp}  {event.process:<10}   phase: {event.message}\n")
        elif event.kind == "instance":
            out.write(f"{stamp}  == instance {event.state}" + (f": {event.message}" if event.message != event.state else "") + "\n")
        out.flush()

    def on_ready(instance) -> None:  # type: ignore[no-untyped-def]
        out.write(f"\n{status_text(instance.status())}\n")
        for p in instance.status().processes:
            out.write(f"  {p.name:<8} {p.role:<8} pid {p.pid:<7} {p.host}:{p.port:<5} GPUs {p.gpus or '-'}  cgroup {p.group}\n")
        front = next((p for p in instance.profile.processes if p.kind == "router"), instance.profile.processes[0])
        out.write(f"\nPOST {front.url}/generate -> {_demo_generate(front.url)}\n\n")
        out.flush()

    opts = RunOptions(rehearsal=True, force_stderr=True, on_ready=on_ready, stop_after_ready=not args.hold,
                      listeners=[show], quiet_children=not args.verbose)
    try:
        code = asyncio.run(serve(cfg, profile, opts))
        if code == 0:
            code = _verify_clear(cfg, profile)
    finally:
        _forget_rehearsal(runtime)
    return code


def _reach_from_servers(cfg, profile, config_dir: str) -> None:  # type: ignore[no-untyped-def]
    """The servers' users reach the code they run and the rehearsal's directories, wherever
    the checkout lies (/root included): rehearsal/reach.py says how."""
    from pathlib import Path

    import supervisord_gpu
    from ..rehearsal.reach import make_reachable
    from ..errors import UsageError

    needed = [Path(sys.prefix), Path(sys.base_prefix), Path(supervisord_gpu.__file__).parent.parent,
              cfg.runtime_dir, Path(config_dir)]
    try:
        covered = make_reachable(needed, {p.user for p in profile.processes if p.user})
    except OSError as e:  # a mount refused (no CAP_SYS_ADMIN in a container): one line, nothing started
        raise UsageError(f"rehearsal: cannot make the checkout reachable for the servers' user: {e.strerror}") from None
    if covered:
        print(f"rehearsal: {', '.join(map(str, covered))} closed to the servers' user: passed through in a mount "
              "namespace of the rehearsal's own (only the checkout and the rehearsal's directories are visible there)")


def _forget_rehearsal(runtime) -> None:  # type: ignore[no-untyped-def]
    """The last rehearsal to end removes its state (simulated GPUs, private TMPDIRs): nothing of
    a rehearsal stays behind, even a failed one. The compile cache stays: it is a cache."""
    import shutil

    from ..controller import registry

    if registry.running(runtime):
        return  # another rehearsal still runs on these simulated GPUs
    for entry in runtime.iterdir():
        if entry.name == "cache":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _demo_generate(url: str) -> str:
    import urllib.request

    body = json.dumps({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, body = resp.status, resp.read(DEMO_ANSWER_MAX)
    except Exception as e:  # a demo request: report, never fail the rehearsal on it
        return f"failed: {e}"
    try:  # the whole answer, on one line: never cut in the middle of a number
        return f"{status} {json.dumps(json.loads(body), ensure_ascii=False)}"
    except ValueError:
        return f"{status} {body.decode(errors='replace')!r}"


DEMO_ANSWER_MAX = 65536  # a generation of 8 tokens answers in well under 1 KiB


def _verify_clear(cfg, profile) -> int:  # type: ignore[no-untyped-def]
    from ..checks.gpus import inventory_for
    from ..checks.preconditions import Requirement, check

    report = check(Requirement.of(profile), inventory_for(cfg, simulated=True))
    if report.ok:
        print(f"verified after stop: GPUs {sorted(profile.gpus)} idle, ports {sorted({listen.port for listen in profile.listens()})} free")
        return 0
    print("after stop, still held:\n  " + "\n  ".join(report.problems()))
    return 1


# ----------------------------------------------------------------------------- check and gpus


def cmd_check(args: argparse.Namespace) -> int:
    from ..checks.preconditions import Requirement, check
    from ..config.loader import load_daemon_config, load_profile
    from ..config.loader import effective_config
    from ..errors import EXIT_PRECONDITIONS
    from ..controller.preflight import raise_for_missing, validate
    from ..daemon import backends_for

    cfg = effective_config(load_daemon_config(args.config_dir), args.rehearsal)
    profile = load_profile(cfg, args.name)
    backends = backends_for(cfg)
    validate(profile, cfg, backends)  # exactly what the daemon validates before it touches anything
    report = check(Requirement.of(profile), backends.inventory)
    raise_for_missing(profile, report)
    if args.json:
        print(json.dumps({"profile": profile.name, "ok": report.ok, **report.to_json()}, indent=2))
    elif report.ok:
        print(f"{profile.name}: profile valid; GPUs {sorted(profile.gpus)} idle; ports {', '.join(str(listen.port) for listen in profile.listens())} free")
    else:
        print(f"{profile.name}: profile valid, but preconditions are not met:")
        for line in report.problems():
            print(f"  {line}")
    return 0 if report.ok else EXIT_PRECONDITIONS


def cmd_gpus(args: argparse.Namespace) -> int:
    from ..checks.holders import describe_gpu_pid
    from ..checks.preconditions import render_gpu_table
    from ..config.loader import load_daemon_config
    from ..config.loader import effective_config
    from ..checks.gpus import inventory_for

    cfg = effective_config(load_daemon_config(args.config_dir), args.rehearsal)
    inventory = inventory_for(cfg, simulated=cfg.rehearsal.enabled)
    states = inventory.snapshot()
    holders = {s.index: [describe_gpu_pid(p.pid, inventory.pids_local) for p in s.processes] for s in states}
    if args.json:
        from ..records import asdict

        print(json.dumps({"backend": inventory.kind, "gpus": [
            {**asdict(s), "holders": [h.describe() for h in holders[s.index]]} for s in states]}, indent=2, default=str))
    else:
        print(render_gpu_table(states, holders))
    return 0


# ----------------------------------------------------------------------------- status, start/stop, logs


def cmd_status(args: argparse.Namespace) -> int:
    from ..errors import EXIT_UNREACHABLE
    from .status_view import collect, render

    if args.cluster:
        return cluster_status(args)
    data = collect(args.config_dir, args.name)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(render(data))
    if args.name and not data["instances"]:
        return 2
    return 0 if data["bus"] else EXIT_UNREACHABLE


def cluster_status(args: argparse.Namespace) -> int:
    """`status --cluster`: what etcd knows: each node's agent, its units, every process's state
    and the transition under way. etcd out of reach is said, exit 4 (the parts keep running).
    Every record is typed (cluster/records.py): a bad one is named on stderr and left out."""
    from ..cluster.store import ClusterStore
    from ..config.loader import load_daemon_config
    from ..records import asdict

    cfg = load_daemon_config(args.config_dir)
    store = ClusterStore(cfg.cluster)
    nodes, holder, current = store.nodes(), store.holder(), store.current()
    by_instance: dict[str, dict[str, str]] = {}
    for r in store.processes():
        by_instance.setdefault(r.instance, {})[f"{r.node}/{r.process}"] = r.state
    shown = {i for n in nodes.values() for i, _ in n.parts}
    parts = {name: states for name, states in by_instance.items() if name in shown}
    if args.json:
        print(json.dumps({"etcd": store.endpoint, "nodes": {n: asdict(r) for n, r in nodes.items()}, "processes": parts,
                          "lock": holder.to_json() if holder else None,
                          "transition": current[1].to_json() if current else None}, indent=2, default=str))
        return 0
    print(f"cluster in etcd at {store.endpoint} ({cfg.cluster.prefix}); this node: {cfg.cluster.node}")
    print(f"transition: {holder.to} (coordinated by node {holder.node})" if holder else "transition: none")
    for node in sorted(nodes):
        record = nodes[node]
        print(f"node {node}: agent pid {record.pid}; units: "
              + (", ".join(f"dsv4@{i} {s}" for i, s in record.parts) or "none"))
        for instance, states in sorted(parts.items()):
            mine = {k.split("/", 1)[1]: s for k, s in states.items() if k.startswith(f"{node}/")}
            if mine:
                print(f"  {instance}: " + ", ".join(f"{p} {s}" for p, s in sorted(mine.items())))
        if record.gpus:
            print("  GPUs: " + ", ".join(g.error if g.error else f"{g.index} {'idle' if g.idle else str(g.in_use_mib) + ' MiB'}"
                                         for g in record.gpus))
    return 0


def cmd_unit(args: argparse.Namespace) -> int:
    from ..config.loader import INSTANCE_NAME_RE
    from ..errors import UsageError

    if not INSTANCE_NAME_RE.match(args.name):
        raise UsageError(f"{args.name!r} is not a valid instance name")
    try:
        return _run_unit_job(args.command, args.name, args.wait, args.timeout)
    except LookupError:  # systemd's NoSuchUnit: no dsv4@.service on this machine (seen on a fresh one)
        from ..errors import PreconditionError
        from ..names import service_name

        raise PreconditionError(f"systemd has no unit {service_name(args.name)}: the unit file dsv4@.service is not "
                                "installed (it comes with the supervisord-gpu package)") from None


def _run_unit_job(verb: str, name: str, wait: bool, timeout: float) -> int:
    """Queue systemd's job for dsv4@NAME, or (--wait) follow it to its end: for start and restart
    that is the new daemon's READY=1 (or its failure), for stop the unit inactive."""
    from ..api.client import follow
    from ..names import service_name
    from ..systemd.manager import Systemd

    unit = service_name(name)
    method = {"start": "StartUnit", "stop": "StopUnit", "restart": "RestartUnit"}[verb]
    if verb in ("start", "restart"):
        _clear_failed(unit)
    if not wait:
        Systemd().queue(method, unit)
        print(f"{verb} of {unit} queued; follow it with: gpusupctl status {name}")
        return 0
    result, active = follow(name, verb, timeout, print)
    want = "inactive" if verb == "stop" else "active"
    if result == "done" and active == want:
        print(f"{unit}: {active}")
        return 0
    why = _final_status(unit)
    waited = f"gave up waiting after {timeout:g} s" if result == "timeout-waiting" else f"job {result}"
    print(f"{unit}: {active} ({waited})" + (f": {why}" if why else ""))
    return 1


def _clear_failed(unit: str) -> None:
    """A start by hand begins afresh: reset-failed a failed unit first (NRestarts, systemd's
    start rate limit: a unit stopped by either starts again). polkit lets gpusup members do it
    on dsv4@ units; refused, the start still goes ahead (it may well succeed) and says so."""
    from ..errors import PermissionDenied
    from ..systemd.manager import Systemd

    systemd = Systemd()
    if systemd.active_state(unit) != "failed":
        return
    try:
        systemd.reset_failed_unit(unit)
    except PermissionDenied as e:
        print(f"{PROG}: {unit} stays failed ({e}); starting anyway", file=sys.stderr)
    except LookupError:
        pass  # collected meanwhile: nothing left to reset


def _final_status(unit: str) -> str:
    """The unit's last STATUS= (the daemon's reason: the holder, the rollback, who took over)."""
    from ..errors import SupervisorError
    from ..systemd.manager import SERVICE, Systemd

    try:
        systemd = Systemd()
        path = systemd.unit_path(unit)
        return str(systemd.get(path, SERVICE, "StatusText")) if path else ""
    except (SupervisorError, LookupError):
        return ""


def cmd_switch(args: argparse.Namespace) -> int:
    """The same transition `systemctl start dsv4@TO` performs; the daemon of TO does the work.
    The plan and the refusal come from the very object that daemon uses (LocalTransition.plan),
    assembled the same way: what the dry run says is what the daemon will do."""
    import asyncio

    from ..config.loader import load_daemon_config, load_profile
    from ..controller.preflight import validate
    from ..controller.registry import Registry
    from ..controller.transition import LocalTransition
    from ..daemon import backends_for
    from ..errors import BusError, UsageError
    from ..systemd.manager import Systemd

    cfg = load_daemon_config(args.config_dir)
    profile = load_profile(cfg, args.to)
    backends = backends_for(cfg)
    # A profile that would fail stops here, before anything is touched; a dry run still shows
    # the plan on a machine without the model (a missing path is then a warning).
    how = validate(profile, cfg, backends, warn=(lambda m: print(m, file=sys.stderr)) if args.dry_run else None)
    if profile.is_cluster:
        return _switch_cluster(args)
    try:
        units: Systemd | None = Systemd()
    except BusError:
        units = None
    transition = LocalTransition(profile, cfg, backends, lambda _m, _p, _e: None, units, Registry(cfg.runtime_dir))
    plan = asyncio.run(transition.plan(how, warn=(lambda m: print(m, file=sys.stderr)) if args.dry_run else None))
    if args.from_ and args.from_ not in {c.instance for c in plan.conflicts}:
        raise UsageError(f"dsv4@{args.from_} is not running or holds none of the GPUs and ports {args.to} needs")
    if args.dry_run:
        print(plan.render())
        return 0
    if units is None:
        raise BusError("switch needs systemd over D-Bus; without systemd, run `supervisord-gpu run "
                       f"{args.to}`: it takes over instances registered in {cfg.runtime_dir}")
    print(plan.render())
    return _run_unit_job("start", args.to, args.wait, args.timeout)


def _switch_cluster(args: argparse.Namespace) -> int:
    """A profile that spans nodes: the plan from what runs on the cluster now (etcd); then this
    node's `systemctl start dsv4@TO`, whose daemon coordinates the switch through the agents."""
    from ..cluster.plan import plan_switch
    from ..cluster.store import ClusterStore
    from ..config.loader import load_daemon_config, load_profile

    cfg = load_daemon_config(args.config_dir)
    store = ClusterStore(cfg.cluster)
    whole = load_profile(cfg, args.to, whole=True)
    running = [load_profile(cfg, name, whole=True) for name in store.running_instances() if name != args.to]
    print(plan_switch(whole, running).render())
    if args.dry_run:
        return 0
    return _run_unit_job("start", args.to, args.wait, args.timeout)


def cmd_logs(args: argparse.Namespace) -> int:
    import os

    argv = ["journalctl", "-u", f"dsv4@{args.name}.service", "--no-hostname"]
    if args.process:
        argv.append(f"GPUSUP_PROCESS={args.process}")
    if args.follow:
        argv.append("-f")
    if args.lines is not None:
        argv += ["-n", str(args.lines)]
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        from ..errors import OperationFailed

        raise OperationFailed(f"cannot run journalctl: {e.strerror}") from None
    return 1


if __name__ == "__main__":
    sys.exit(main())
