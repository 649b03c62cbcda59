"""Issue: teardown to verified idle, against the manual procedure and supervisord 4.x.

From the stop request to every simulated GPU of the profile verified idle (no live holder)
and every port free, with 1, 4 and 16 stand-in servers (one simulated GPU each; each
stand-in's scheduler holds the GPU memory). The supervisor's own share is the total minus
the time the processes took to die (their main process being reaped). The stand-in has
SGLang's drain: after SIGTERM it looks for "no requests left" every 5 s (0-5 s idle).

Three ways to tear down the same stand-ins:
  * supervisord-gpu: the engine (cgroupfs driver, a throw-away cgroup): Instance.stop(), then
    wait_until_clear() with the profile's Requirement (what the daemon does before a start);
  * manual: `kill PIDS; sleep 3;` then poll the GPU memory every second until idle (cap 10 s);
  * supervisord 4.x (PyPI): one [program:sN] per stand-in with stopasgroup/killasgroup,
    `supervisorctl stop all`, then poll the GPUs and ports until idle/free (cap 10 s); what
    it leaves behind is counted, then killed by the PIDs the simulated GPUs list.

Three scenarios:
  * graceful: the stand-ins drain on SIGTERM and stop their schedulers themselves;
  * hard: the main process dies without its graceful path (a hung drain killed at the stop
    deadline: SUPERVISORD_GPU_STANDIN_FAULT=hang-on-term with a 1 s deadline for both
    supervisors; `kill -9 PIDS` for the manual procedure); the schedulers are SGLang's usual
    children with PDEATHSIG, so they die with their parent whoever kills it;
  * hard-orphans: the same with schedulers that escaped (SUPERVISORD_GPU_STANDIN_SCHEDULERS=
    detached: setsid, double fork, re-parented to PID 1, as SGLang's DP workers under Slurm
    do, upstream issue 23627): they survive a process-group kill and keep holding GPU memory,
    unless the whole cgroup is killed.

TEARDOWN_SIZES (default "1,4,16"), TEARDOWN_RUNS (default 3; 16 runs at most 2; the hard
scenario runs once per size).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from common import covered, kill_holders, summary, table, terminate, write

from support import CgroupSandbox, Recorder, free_ports, make_instance, write_config
from supervisord_gpu.checks.ports import check_port
from supervisord_gpu.checks.preconditions import wait_until_clear
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.checks.preconditions import Requirement
from supervisord_gpu.checks.gpus import inventory_for

SIZES = [int(x) for x in os.environ.get("TEARDOWN_SIZES", "1,4,16").split(",")]
RUNS = int(os.environ.get("TEARDOWN_RUNS", "3"))
CAP_S = 10.0
STARTUP_S = 0.5
HARD_DEADLINE_S = 1.0
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def runs_for(n: int) -> int:
    return RUNS if n < 16 else min(RUNS, 2)


# ----------------------------------------------------------------------------- helpers

class ExitWatch:
    """Polls PIDs every ms in a thread; records when each is gone or a zombie (= died)."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = {}
        for pid in pids:
            try:
                self.procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                pass
        self.died: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.died) < len(self.procs):
            for pid, p in self.procs.items():
                if pid in self.died:
                    continue
                try:
                    gone = p.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    gone = True
                if gone:
                    self.died[pid] = time.monotonic()
            time.sleep(0.001)

    def last(self, timeout: float = 15.0) -> float | None:
        self._thread.join(timeout)
        self._stop.set()
        return max(self.died.values()) if len(self.died) == len(self.procs) and self.died else None


def all_healthy(ports: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pending = set(ports)
    while pending:
        for port in list(pending):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        pending.discard(port)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"stand-ins on ports {sorted(pending)} never answered /health 200")
        time.sleep(0.05)


def clear(sim: SimulatedGpus, gpus: set[int], ports: list[int]) -> bool:
    return not any(set(h.gpus) & gpus for h in sim.holders()) and all(check_port("127.0.0.1", p).free for p in ports)


def poll_clear(sim: SimulatedGpus, gpus: set[int], ports: list[int], began: float, every: float) -> float | None:
    """Seconds from `began` until clear, polling every `every` s; None if still not clear after CAP_S."""
    while True:
        if clear(sim, gpus, ports):
            return time.monotonic() - began
        if time.monotonic() - began > CAP_S:
            return None
        time.sleep(every)


SCENARIOS = {"graceful": (False, "children"), "hard": (True, "children"), "hard-orphans": (True, "detached")}


def standin_env(sim: SimulatedGpus, gpu: int, fault: str | None, schedulers: str) -> dict[str, str]:
    env = {"SUPERVISORD_GPU_SIMGPU_DIR": str(sim.directory), "CUDA_VISIBLE_DEVICES": str(gpu),
           "SUPERVISORD_GPU_STANDIN_STARTUP_S": str(STARTUP_S), "SUPERVISORD_GPU_STANDIN_MIB": "1000",
           "SUPERVISORD_GPU_STANDIN_SCHEDULERS": schedulers}
    if fault:
        env["SUPERVISORD_GPU_STANDIN_FAULT"] = fault
    return env


def standin_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "supervisord_gpu.rehearsal.standin_server", "--model-path", "/m", "--port", str(port)]


# ----------------------------------------------------------------------------- supervisord-gpu

def ours(n: int, tmp: Path, sandbox: CgroupSandbox, hard: bool, schedulers: str) -> dict[str, float | int | None]:
    ports = free_ports(n)
    fault = ('\nSUPERVISORD_GPU_STANDIN_FAULT = "hang-on-term"' if hard else "") + (
        f'\nSUPERVISORD_GPU_STANDIN_SCHEDULERS = "{schedulers}"')
    text = "".join(f"""
[servers.s{i}]
gpus = [{i}]
port = {ports[i]}
model_path = "/m"
stop_timeout = {HARD_DEADLINE_S if hard else 10}
[servers.s{i}.env]
SUPERVISORD_GPU_STANDIN_STARTUP_S = "{STARTUP_S}"{fault}
""" for i in range(n))
    cdir = write_config(tmp, {"td": text}, sandbox.root, startup=STARTUP_S, gpu_count=max(n, 8))
    rec = Recorder()
    instance, cfg = make_instance(cdir, "td", rec)
    if hasattr(instance.sink, "quiet_children"):
        instance.sink.quiet_children = True
    inventory = inventory_for(cfg, simulated=True)
    req = Requirement.of(instance.profile)
    sim = SimulatedGpus(tmp / "simgpu")

    async def go() -> dict[str, float | int | None]:
        await instance.start()
        offset = time.time() - time.monotonic()
        t0 = time.monotonic()
        await instance.stop()
        stopped = time.monotonic() - t0
        await wait_until_clear(req, inventory, CAP_S)
        total = time.monotonic() - t0
        spans = []  # per process: SIGTERM sent -> reaped; processes of one stop wave die side by side
        for name, proc in instance.processes.items():
            stopping = [e.at for e in rec.events if e.kind == "process" and e.process == name and e.state == "stopping"]
            spans.append((stopping[-1], proc.exited_at + offset))  # type: ignore[operator]
        dying = covered(spans)
        drained = sum(p.last_exit == "exit code 0" for p in instance.processes.values())
        return {"total_s": total, "stop_returned_s": stopped, "processes_dying_s": dying,
                "supervisor_share_s": total - dying, "drained": drained, "left_behind": kill_holders(sim)}

    try:
        return asyncio.run(go())
    finally:
        kill_holders(sim)


# ----------------------------------------------------------------------------- manual

def manual(n: int, tmp: Path, hard: bool, schedulers: str) -> dict[str, float | int | None]:
    ports = free_ports(n)
    sim = SimulatedGpus.create(tmp / "simgpu", max(n, 8))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(n):
            procs.append(subprocess.Popen(standin_argv(ports[i]), env={**os.environ, **standin_env(sim, i, None, schedulers)},
                                          cwd=REPO,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        all_healthy(ports)
        watch = ExitWatch([p.pid for p in procs])
        t0 = time.monotonic()
        for p in procs:  # kill $PIDS  (or kill -9 $PIDS)
            p.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        codes = [p.wait() for p in procs]
        last = watch.last()
        time.sleep(3)  # sleep 3
        took = poll_clear(sim, set(range(n)), ports, t0, every=1.0)  # poll nvidia-smi every second
        dying = (last - t0) if last else None
        return {"total_s": took, "processes_dying_s": dying,
                "supervisor_share_s": (took - dying) if took is not None and dying is not None else None,
                "drained": sum(c == 0 for c in codes), "left_behind": kill_holders(sim)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        kill_holders(sim)


# ----------------------------------------------------------------------------- supervisord 4.x

def supervisord(n: int, tmp: Path, hard: bool, schedulers: str) -> dict[str, float | int | None]:
    ports = free_ports(n)
    sim = SimulatedGpus.create(tmp / "simgpu", max(n, 8))
    conf = tmp / "supervisord.conf"
    sock = tmp / "supervisor.sock"
    programs = []
    for i in range(n):
        env = ",".join(f'{k}="{v}"' for k, v in standin_env(sim, i, "hang-on-term" if hard else None, schedulers).items())
        programs.append(textwrap.dedent(f"""
            [program:s{i}]
            command = {' '.join(standin_argv(ports[i]))}
            directory = {REPO}
            environment = {env}
            stopasgroup = true
            killasgroup = true
            stopwaitsecs = {int(HARD_DEADLINE_S) if hard else 10}
            startsecs = 0
            autorestart = false
            stdout_logfile = {tmp / f's{i}.log'}
            redirect_stderr = true
            """))
    conf.write_text(textwrap.dedent(f"""
        [unix_http_server]
        file = {sock}
        [supervisord]
        logfile = {tmp / 'supervisord.log'}
        pidfile = {tmp / 'supervisord.pid'}
        nodaemon = true
        [supervisorctl]
        serverurl = unix://{sock}
        [rpcinterface:supervisor]
        supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
        """) + "".join(programs))
    daemon = subprocess.Popen([str(BIN / "supervisord"), "-c", str(conf), "-n"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=tmp)
    ctl = [str(BIN / "supervisorctl"), "-c", str(conf)]
    mains: list[int] = []
    try:
        all_healthy(ports)
        sup = psutil.Process(daemon.pid)
        mains = [c.pid for c in sup.children()]
        watch = ExitWatch(mains)
        t0 = time.monotonic()
        subprocess.run(ctl + ["stop", "all"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctl_s = time.monotonic() - t0
        took = poll_clear(sim, set(range(n)), ports, t0, every=0.005)
        last = watch.last()
        dying = (last - t0) if last else None
        # stopasgroup SIGTERMs the whole group: the schedulers die at once and SGLang takes its crash
        # path instead of draining; its log says which (exit statuses supervisord keeps to itself)
        drained = sum("Gracefully exiting... all schedulers stopped" in (tmp / f"s{i}.log").read_text(errors="replace")
                      for i in range(n))
        return {"total_s": took, "stop_returned_s": ctl_s, "processes_dying_s": dying,
                "supervisor_share_s": (took - dying) if took is not None and dying is not None else None,
                "drained": drained, "left_behind": kill_holders(sim)}
    finally:
        terminate(daemon)
        for pid in mains:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_holders(sim)


# ----------------------------------------------------------------------------- main

def collect(samples: list[dict[str, float | int | None]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        known = [float(v) for v in values if v is not None]
        out[key] = {**summary(known), "not_clear_within_cap": len(values) - len(known)} if known else {
            "median": None, "n": len(values), "not_clear_within_cap": len(values)}
    return out


def main() -> dict[str, object]:
    sandbox = CgroupSandbox()
    results: dict[str, dict[str, dict[str, object]]] = {s: {} for s in SCENARIOS}
    try:
        for scenario, (hard, schedulers) in SCENARIOS.items():
            for n in SIZES:
                runs = 1 if hard else runs_for(n)
                entry: dict[str, object] = {}
                for who, fn in (("supervisord_gpu", lambda t: ours(n, t, sandbox, hard, schedulers)),
                                ("manual", lambda t: manual(n, t, hard, schedulers)),
                                ("supervisord", lambda t: supervisord(n, t, hard, schedulers))):
                    samples = []
                    for _ in range(runs):
                        with tempfile.TemporaryDirectory() as d:
                            samples.append(fn(Path(d)))
                    entry[who] = collect(samples)
                results[scenario][str(n)] = entry
    finally:
        sandbox.destroy()

    def med(s: str, n: str, who: str, key: str) -> float | None:
        return results[s][n][who][key]["median"]  # type: ignore[index, return-value]

    ratios: dict[str, dict[str, float | None]] = {}  # of the supervisor's own share: the drain is SGLang's
    for n in results["graceful"]:
        o = med("graceful", n, "supervisord_gpu", "supervisor_share_s")
        ratios[n] = {
            who: (m / o if m is not None and o else None)
            for who in ("manual", "supervisord")
            for m in [med("graceful", n, who, "supervisor_share_s")]
        }
    result = {
        "what": f"teardown to verified idle (simulated GPUs free of live holders, ports free); N stand-in servers "
                f"({STARTUP_S} s start-up, 1 simulated GPU each, its scheduler holding it); poll cap {CAP_S:g} s. "
                f"graceful: stand-ins drain on SIGTERM (SGLang's 5 s drain poll). hard: hang-on-term killed at a "
                f"{HARD_DEADLINE_S:g} s deadline (supervisord-gpu: cgroup.kill; supervisord: killasgroup SIGKILL); "
                "manual: kill -9; schedulers are children with PDEATHSIG. hard-orphans: the same with detached schedulers",
        "results": results,
        "ratios_supervisor_share_vs_supervisord_gpu_graceful": ratios,
    }
    path = write("teardown-vs-supervisord", result)

    def fmt(v: float | None, scale: float = 1000, unit: str = "ms", digits: int = 1) -> str:
        return "never (>10 s)" if v is None else f"{v * scale:.{digits}f} {unit}"

    rows = [("scenario", "N", "who", "runs", "total to idle", "processes dying", "supervisor share", "drained",
             "left behind", "share ratio")]
    for scenario, by_n in results.items():
        for n, entry in by_n.items():
            for who in ("supervisord_gpu", "manual", "supervisord"):
                e = entry[who]  # type: ignore[index]
                total = e["total_s"]["median"]  # type: ignore[index]
                ratio = ""
                if scenario == "graceful" and who != "supervisord_gpu" and ratios[n][who] is not None:
                    ratio = f"{ratios[n][who]:.0f}x"
                rows.append((scenario, n, who.replace("_", "-"), str(e["total_s"]["n"]),  # type: ignore[index]
                             fmt(total), fmt(e["processes_dying_s"]["median"]),  # type: ignore[index]
                             fmt(e["supervisor_share_s"]["median"]),  # type: ignore[index]
                             f"{e['drained']['median']:.0f}/{n}",  # type: ignore[index]
                             f"{e['left_behind']['median']:.0f} holder(s)", ratio))  # type: ignore[index]
    print(table(rows))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
