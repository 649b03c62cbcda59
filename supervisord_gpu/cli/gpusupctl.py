"""`gpusupctl`: the operator's tool. One command tree; read commands take --json.

Exit codes (errors.py's table): 0 ok, 1 operation failed, 2 bad usage or profile,
3 preconditions not met, 4 daemon, bus or etcd not reachable, 5 a takeover failed (rolled
back), 6 the instance gave up; a refusal of the daemon exits with the daemon's code. Imports are deferred to the command that needs them, so
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
        epilog="exit codes: 0 ok, 1 operation failed, 2 bad usage or profile, 3 preconditions not met, 4 daemon, bus or etcd "
               "unreachable, 5 takeover failed (rolled back), 6 the instance gave up",
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
        if verb != "stop":  # an unknown profile is named before anything is queued; a stop needs none
            _config_arg(v)
        if verb == "restart":
            v.add_argument("--process", metavar="PROCESS",
                           help="restart only this process of the running instance (its daemon's RestartProcess job)")

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
    sw.add_argument("--park", action="store_true",
                    help="park the instances in TO's way in host memory instead of stopping them; `switch` back restores")
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
    programs = programs_for(cfg)
    launches = render(profile, cfg, programs)  # what the daemon will run, real or stand-ins
    if programs.router_missing and any(launch.spec.kind == "router" for launch in launches):
        print(f"gpusupctl: warning: {cfg.path or cfg.config_dir / 'supervisord-gpu.toml'}: sglang.router_command: "
              f"{programs.router_missing} (shown: {' '.join(programs.router)})", file=sys.stderr)
    if args.json:
        out = [
            {"process": launch.spec.name, "role": launch.spec.role, "user": launch.user, "argv": list(launch.argv),
             "env": dict(launch.env), "after": list(launch.spec.after)}
            | ({"admin_key": f"<admin key: {launch.admin_key}>"} if launch.admin_key else {})
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
        if launch.admin_key is not None:  # made at spawn, passed in the environment: never printed
            print(f"    env SUPERVISORD_GPU_ADMIN_KEY=<admin key: {launch.admin_key}>")
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
    _reach_from_servers(cfg, profile)
    t0 = time.monotonic()
    out = sys.stdout

    def show(event) -> None:
        stamp = f"{time.monotonic() - t0:7.2f}s"
        if event.kind == "process" and event.state:
            out.write(f"{stamp}  {event.process:<10} {event.message}\n")
        elif event.kind == "phase" and event.message:
            out.write(f"{stamp}  {event.process:<10}   phase: {event.message}\n")
        elif event.kind == "instance":
            out.write(f"{stamp}  == instance {event.state}" + (f": {event.message}" if event.message != event.state else "") + "\n")
        out.flush()

    def on_ready(instance) -> None:
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


def _reach_from_servers(cfg, profile) -> None:
    """The servers' users reach the code they run and the rehearsal's directories, wherever
    the checkout lies (/root included): rehearsal/reach.py says how. The config directory is
    the one the loader resolved (--config-dir, $SUPERVISORD_GPU_CONFIG_DIR or the package's
    /etc/supervisord-gpu), never the raw option: without it that was Path(None)."""
    from pathlib import Path

    import supervisord_gpu
    from ..rehearsal.reach import make_reachable
    from ..errors import UsageError

    needed = [Path(sys.prefix), Path(sys.base_prefix), Path(supervisord_gpu.__file__).parent.parent,
              cfg.runtime_dir, Path(cfg.config_dir)]
    try:
        covered = make_reachable(needed, {p.user for p in profile.processes if p.user})
    except OSError as e:  # a mount refused (no CAP_SYS_ADMIN in a container): one line, nothing started
        raise UsageError(f"rehearsal: cannot make the checkout reachable for the servers' user: {e.strerror}") from None
    if covered:
        print(f"rehearsal: {', '.join(map(str, covered))} closed to the servers' user: passed through in a mount "
              "namespace of the rehearsal's own (only the checkout and the rehearsal's directories are visible there)")


def _forget_rehearsal(runtime) -> None:
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


def _verify_clear(cfg, profile) -> int:
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
    """Everything that stands in the profile's way, all at once: the profile's own problems
    (what the daemon validates before it touches anything, every missing model path and GPU),
    then every GPU not idle and port not free with its holders. A profile that cannot be loaded
    at all is the one problem (exit 2). Profile problems go to stderr, one line each as for any
    bad input; the GPU and port report to stdout. Exit: the most severe (_most_severe)."""
    from ..checks.preconditions import Requirement, missing_gpu_errors, survey
    from ..config.loader import effective_config, load_daemon_config, load_profile
    from ..controller.preflight import validate
    from ..daemon import backends_for
    from ..errors import EXIT_OK, EXIT_PRECONDITIONS, EXIT_USAGE, SupervisorError

    cfg = effective_config(load_daemon_config(args.config_dir), args.rehearsal)
    profile = load_profile(cfg, args.name)
    backends = backends_for(cfg)
    found: list[tuple[int, str]] = []  # (exit code, line) of each profile problem
    try:  # a missing model path comes as a warning: every one is named, and validation goes on
        validate(profile, cfg, backends, warn=lambda line: found.append((EXIT_USAGE, line.removeprefix("warning: "))))
    except SupervisorError as e:  # validation stopped before its last step, the model paths: those still count
        found.insert(0, (e.exit_code, str(e)))
        found += [(EXIT_USAGE, line) for line in _missing_model_paths(profile, backends)]
    report = survey(Requirement.of(profile), lambda: backends.inventory)
    found += [(e.exit_code, str(e)) for e in missing_gpu_errors(profile, report)]
    held = report.problems(missing=False)
    code = _most_severe([c for c, _ in found] + ([EXIT_PRECONDITIONS] if held else []))
    if args.json:
        print(json.dumps({**report.to_json(), "profile": profile.name, "ok": code == EXIT_OK, "exit_code": code,
                          "gpu_error": report.gpu_error, "profile_problems": [line for _, line in found],
                          "problems": [line for _, line in found] + held}, indent=2))
        return code
    for _, line in found:
        print(f"{PROG}: {line}", file=sys.stderr)
    sys.stderr.flush()
    if code == EXIT_OK:
        print(f"{profile.name}: profile valid; GPUs {sorted(profile.gpus)} idle; ports {', '.join(str(listen.port) for listen in profile.listens())} free")
    elif held:
        print(f"{profile.name}: " + ("profile valid, but preconditions are not met:" if not found
                                     else "preconditions are not met either:"))
        for line in held:
            print(f"  {line}")
    else:
        ports = ", ".join(str(listen.port) for listen in profile.listens())
        print(f"{profile.name}: GPUs {sorted(g.index for g in report.gpus)} idle; ports {ports} free; "
              "the profile's problems above come first")
    return code


def _missing_model_paths(profile, backends) -> list[str]:
    """Each server whose model path is not on this machine, as validate's last step says it
    (the Backends say whether they must exist: a rehearsal's stand-ins need none)."""
    import os

    from ..errors import ConfigError

    if not backends.model_paths_must_exist:
        return []
    return [str(ConfigError(profile.path, f"servers.{spec.name}.model_path", f"{spec.model_path} does not exist"))
            for spec in profile.processes if spec.model_path and not os.path.exists(spec.model_path)]


def _most_severe(codes: list[int]) -> int:
    """The exit code `check` ends with when several apply: a profile to fix first (2), then
    what holds the GPUs and ports (3), then the rest as they come."""
    from ..errors import EXIT_FAILED, EXIT_OK, EXIT_PRECONDITIONS, EXIT_UNREACHABLE, EXIT_USAGE

    severity = (EXIT_USAGE, EXIT_PRECONDITIONS, EXIT_UNREACHABLE, EXIT_FAILED)
    if not codes:
        return EXIT_OK
    return min(codes, key=lambda c: severity.index(c) if c in severity else len(severity))


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
    from ..config.cluster import insecure_warning
    from ..config.loader import load_daemon_config
    from ..records import asdict

    cfg = load_daemon_config(args.config_dir)
    insecure = insecure_warning(cfg.cluster)
    if insecure and not args.json:
        print(f"WARNING: {insecure}")
    store = ClusterStore(cfg.cluster)
    nodes, holder, current = store.nodes(), store.holder(), store.current()
    by_instance: dict[str, dict[str, str]] = {}
    for r in store.processes():
        by_instance.setdefault(r.instance, {})[f"{r.node}/{r.process}"] = r.state
    shown = {i for n in nodes.values() for i, _ in n.parts}
    parts = {name: states for name, states in by_instance.items() if name in shown}
    if args.json:
        print(json.dumps({"etcd": store.endpoint, "insecure": insecure, "nodes": {n: asdict(r) for n, r in nodes.items()}, "processes": parts,
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
    from ..errors import UnitNotFound, UsageError

    if not INSTANCE_NAME_RE.match(args.name):
        raise UsageError(f"{args.name!r} is not a valid instance name")
    if getattr(args, "process", None) is not None:
        return _restart_process(args.name, args.process, args.wait, args.timeout)
    if args.command != "stop":
        _check_profile_known(args.config_dir, args.name)
    try:
        return _run_unit_job(args.command, args.name, args.wait, args.timeout)
    except UnitNotFound:  # systemd's NoSuchUnit: no dsv4@.service on this machine (seen on a fresh one)
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

    from ..errors import OperationFailed

    unit = service_name(name)
    method = {"start": "StartUnit", "stop": "StopUnit", "restart": "RestartUnit"}[verb]
    if verb in ("start", "restart"):
        _clear_failed(unit)
    try:
        if not wait:
            Systemd().queue(method, unit)
            print(f"{verb} of {unit} queued; follow it with: gpusupctl status {name}")
            return 0
        result, active = follow(name, verb, timeout, print)
    except OperationFailed:
        if verb != "stop":
            _raise_if_start_limit_hit(unit, name)  # systemd's own refusal, whatever its text
        raise
    want = "inactive" if verb == "stop" else "active"
    if result == "done" and active == want:
        print(f"{unit}: {active}")
        return 0
    if verb != "stop" and result != "timeout-waiting":
        # The unit's last STATUS= would be the stop before it ("stop requested"): the cause is systemd's
        _raise_if_start_limit_hit(unit, name)
    why = _final_status(unit)
    waited = f"gave up waiting after {timeout:g} s" if result == "timeout-waiting" else f"job {result}"
    print(f"{unit}: {active} ({waited})" + (f": {why}" if why else ""))
    return 1


def _clear_failed(unit: str) -> None:
    """A start by hand begins afresh: reset-failed a failed unit first (NRestarts, systemd's
    start rate limit: a unit stopped by either starts again). polkit lets gpusup members do it
    on dsv4@ units; refused, the start still goes ahead (it may well succeed) and says so."""
    from ..errors import PermissionDenied, UnitNotFound
    from ..systemd.manager import Systemd

    systemd = Systemd()
    if systemd.active_state(unit) != "failed":
        return
    try:
        systemd.reset_failed_unit(unit)
    except PermissionDenied as e:
        from ..systemd.manager import instance_of_unit

        name = instance_of_unit(unit) or unit
        # systemd's start limit stays: the start cannot succeed, and says so before it is queued
        _raise_if_start_limit_hit(unit, name, refused=str(e))
        print(f"{PROG}: {unit} stays failed ({e}); starting anyway", file=sys.stderr)
    except UnitNotFound:
        pass  # collected meanwhile: nothing left to reset


def _final_status(unit: str) -> str:
    """The unit's last STATUS= (the daemon's reason: the holder, the rollback, who took over)."""
    from ..errors import SupervisorError
    from ..systemd.manager import SERVICE, Systemd

    try:
        systemd = Systemd()
        path = systemd.unit_path(unit)
        return str(systemd.get(path, SERVICE, "StatusText")) if path else ""
    except SupervisorError:
        return ""


def _check_profile_known(config_dir: str | None, name: str) -> None:
    """`start`/`restart` of a profile that does not exist: named (exit 2, with the closest names
    in the profiles directory) before anything is queued. A typo used to be "queued", exit 0.

    Only names are looked at, never a profile's content: a gpusup member may start a profile it
    cannot read. Where the caller cannot look (a directory closed to it) nothing is decided here:
    systemd, polkit and the daemon still are. The package's default directory missing means the
    package is not installed: systemd then says there is no unit (cmd_unit)."""
    import difflib
    import os

    from ..config.loader import CONFIG_DIR_ENV, display_path, resolve_config_dir
    from ..errors import ConfigError

    cdir = resolve_config_dir(config_dir)
    profiles = cdir / "profiles"
    try:
        os.stat(profiles / f"{name}.toml")
        return
    except FileNotFoundError:
        pass
    except OSError:
        return  # not ours to see: the daemon will say
    try:
        known = sorted(entry[: -len(".toml")] for entry in os.listdir(profiles) if entry.endswith(".toml"))
    except FileNotFoundError:
        if not (config_dir or os.environ.get(CONFIG_DIR_ENV)):
            return
        raise ConfigError(display_path(profiles), "", "no such profiles directory (use --config-dir or "
                          f"{CONFIG_DIR_ENV}); nothing was started") from None
    except OSError:
        return
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(display_path(profiles / f"{name}.toml"), "",
                      f"unknown profile {name!r}{hint} (profiles in {display_path(profiles)}: "
                      f"{', '.join(known) or 'none'}); nothing was started")


def _raise_if_start_limit_hit(unit: str, name: str, refused: str = "") -> None:
    """StartLimitHit (exit 3) when systemd's own start rate limit refused the unit (its Result
    "start-limit-hit"): the unit's last STATUS= then still reads what the daemon said as it
    stopped ("stop requested"), which is not why it is down. Says the way back."""
    from ..errors import StartLimitHit, SupervisorError
    from ..systemd.manager import SERVICE, UNIT, Systemd

    try:
        systemd = Systemd()
        path = systemd.unit_path(unit)
        if path is None or str(systemd.get(path, SERVICE, "Result")) != "start-limit-hit":
            return
        burst = int(systemd.get(path, UNIT, "StartLimitBurst"))
        window = int(systemd.get(path, UNIT, "StartLimitIntervalUSec")) / 1e6
    except SupervisorError:
        return
    hit = (f"systemd refused to start {unit}: its start limit was hit ({burst} starts within {window:g} s, "
           "StartLimitBurst=/StartLimitIntervalSec= of the unit; starts and restarts by hand count too)")
    if refused:
        raise StartLimitHit(f"{hit}; resetting it was refused ({refused}): as root, `systemctl reset-failed "
                            f"{unit}`, or start it again once {window:g} s have passed since the first of those starts")
    raise StartLimitHit(f"{hit}; `gpusupctl start {name}` resets the limit (reset-failed) and starts it again")


def _restart_process(name: str, process: str, wait: bool, timeout: float) -> int:
    """`restart NAME --process P`: the running daemon's RestartProcess (P out of its router
    first, back in once ready), a job of the daemon, not systemd's. A refusal comes back by
    its name (UnknownProcess exit 2, Busy exit 3, AccessDenied 1, no daemon 4); without --wait
    the accepted job is said and the exit is 0; with --wait the job is followed (GetJob) to its
    end and its outcome's exit code is the exit code."""
    from ..api.client import InstanceClient
    from ..systemd.manager import connect

    client = InstanceClient(connect(), name)
    job = client.restart_process(process)
    if not wait:
        print(f"restart of {process} in {name} accepted as job {job['id']}; follow it with: gpusupctl status {name}")
        return 0
    end = client.follow_job(job, timeout, print)
    if end.get("state") == "running":
        print(f"{name}: job {job['id']} (restart {process}) still running: gave up waiting after {timeout:g} s")
        return 1
    if end.get("state") == "done":
        print(f"{name}: {end.get('reason') or process + ' restarted'}")
        return 0
    print(f"{PROG}: {name}: restart of {process} {end.get('state')}: {end.get('reason')}", file=sys.stderr)
    code = end.get("exit_code")
    return code if isinstance(code, int) and code else 1


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
    from ..controller import parked

    if args.to in parked.parked(cfg.runtime_dir):
        return _switch_back(args)
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
    if args.park:
        code = _park_in_the_way([c.instance for c in plan.conflicts], args.to, args.timeout)
        if code:
            return code
    return _run_unit_job("start", args.to, args.wait, args.timeout)


def _follow(client: object, job: dict[str, object], what: str, timeout: float) -> int:
    """A daemon's job (Park, Restore) followed to its end: 0 done, else its own exit code."""
    end = client.follow_job(job, timeout, print)  # type: ignore[attr-defined]
    if end.get("state") == "done":
        print(f"{what}: {end.get('reason')}")
        return 0
    print(f"{PROG}: {what}: {end.get('state')}: {end.get('reason')}", file=sys.stderr)
    code = end.get("exit_code")
    return code if isinstance(code, int) and code else 1


def _park_in_the_way(instances: list[str], to: str, timeout: float) -> int:
    """`switch TO --park`: each instance in TO's way parked by its own daemon (D-Bus Park, a job
    followed to its end) before TO starts; TO's takeover then leaves them (controller/parked.py)."""
    from ..api.client import InstanceClient
    from ..systemd.manager import connect

    for name in instances:
        client = InstanceClient(connect(), name)
        code = _follow(client, client.park(to), f"park dsv4@{name}", timeout)
        if code:
            return code
    return 0


def _switch_back(args: argparse.Namespace) -> int:
    """`switch TO` where TO is parked: its daemon's Restore (what is on its GPUs stopped, the GPUs
    verified idle, restored, one generation; or started cold, said so)."""
    from ..api.client import InstanceClient
    from ..systemd.manager import connect

    if args.dry_run:
        print(f"plan: switch back to the parked {args.to}: stop our instances on its GPUs, verify them idle, "
              "restore its CUDA processes from host memory, one generation, route to it again")
        return 0
    client = InstanceClient(connect(), args.to)
    return _follow(client, client.restore(), f"restore dsv4@{args.to}", args.timeout)


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
    """journalctl -u takes a pattern: `logs 'x*'` showed every dsv4@x… unit. Names are exact
    (the daemon's own rules: no `*?[]\\` can pass them), so -u matches one unit and still
    brings systemd's own lines about it (started, stopped, failed), which `_SYSTEMD_UNIT=` would not."""
    import os

    from ..errors import UsageError
    from ..names import INSTANCE_NAME_RE, PROCESS_NAME_RE

    if not INSTANCE_NAME_RE.match(args.name):
        raise UsageError(f"{args.name!r} is not a valid instance name (logs takes one exact name, no patterns)")
    if args.process is not None and not PROCESS_NAME_RE.match(args.process):
        raise UsageError(f"{args.process!r} is not a valid process name")
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
