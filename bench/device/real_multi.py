"""The real SGLang on several GPUs through the daemon (issue 40): a PD pair of TP2 servers (prefill
on GPUs 0-1, decode on GPUs 2-3) behind a real router, switched to one TP4 server and back, rolled
back, parked instead of stopped, and one scheduler rank of a TP2 server stopped in a collective.

Built on bench/device/real_pd.py (its PdRun: bundles, tiny model, daemon config, the router of
--router, its scenarios made to take the profile names) and real_sglang.py (Run, Daemon, Check,
the control socket standing in for D-Bus), with real_park.py's control jobs (Park, Restore) and
real_hang.py's bound. What is new here: the profiles for N GPUs, a reader of every GPU of the
group (NVML or the simulated GPUs, independent of the product), and the checks per GPU and per rank.

Profiles (written by the run; K = --tp, N = --gpus):
  pd22    prefill TP K on GPUs 0..K-1 (bootstrap 8998) + decode TP K on GPUs K..2K-1, mooncake over
          TCP, the router in PD mode on 30001; stop order router, decode, prefill. With N < 2K (the
          dry run: --gpus 1 --tp 1) both halves on GPUs 0..K-1 with `share_gpus` and
          mem-fraction-static 0.2, as real_pd.py's pd1.
  tp4     one server TP min(2K, N) on GPUs 0..min(2K, N)-1, on the router's port (30001).
  tp4bad  tp4 whose server fails after its spawn (real: a model whose architecture SGLang does not
          know; stand-in: SUPERVISORD_GPU_STANDIN_FAULT=crash-on-start).
  tp4p    tp4 on port 30400: the profile started while pd22 is parked (a parked profile's front
          ends keep their ports, so parking refuses a next profile on the router's port).

Scenarios, each a list of assertions, PASS/FAIL printed and written to
$OUT/real-multi-<mode>-<router>-g<N>tp<K>[-<--only's scenarios>].json (logs: $OUT/logs-multi-...tar.gz):
  m1_start     pd22 READY: the router lists both workers, a first /generate through it is 200; each
               GPU of the layout held by one scheduler per rank (2K processes), nothing else
  m2_generate  /generate through the router; a direct one to the decode refused (no bootstrap room)
  m3_switch    pd22 -> tp4 by the new daemon's takeover with --in-flight long requests through the
               router: completed vs cut; stops router, decode, prefill in order; the daemon's "verified
               idle" before tp4's spawn, and ALL N GPUs read at their baseline together in between
               (direct reading); tp4 serves with one scheduler per rank
  m4_back      tp4 -> pd22, serving again through the same port
  m5_rollback  tp4bad takes pd22 over and fails after its spawn: exit 5 naming the rollback; pd22
               started again (as systemd's rollback would) and serves
  m6_park      pd22 parked (a Park job through its daemon) instead of stopped: every CUDA process of
               pd22 parked (one scheduler per rank: 2K), all N GPUs at their baseline while parked;
               tp4p started by its own daemon (its takeover leaves the parked pd22 alone) and serves;
               a Restore job on pd22 stops tp4p, verifies the GPUs idle, restores; the same greedy
               output through the router as before the park
  m7_hung_collective
               SIGSTOP of ONE scheduler rank of the decode (rank K-1; TP K): the daemon's hang
               verdict kills the whole server within real_hang.py's bound (30 s), its peer ranks
               included, restarts it, READY again; no old process left, none on any GPU; the
               decode's GPUs at their baseline between the kill and the restart (unshared layout);
               the router serves again
  m8_stop      stop of pd22 with --in-flight long requests: router, decode, prefill; every GPU at
               its baseline, no holder; no process of the run left, cgroups empty
Each scenario checks the time left first (--budget); what does not fit is "NOT RUN (budget)".
--only keeps m1_start and m8_stop (the rest needs pd22 started, and the run ends stopped); exit 0
when every scenario that ran passed (one left out by --only is no failure, one left out by the budget is).

On a 4-GPU device machine (no systemd, no D-Bus, no network), the bundles as for real_pd.py
(.sgl/sglang-site.tar.xz, .sgl/mooncake-site.tar.xz, .sgl/make_tiny_model.py; .sglr/router-site.tar.xz,
.sglr/smg-site.tar.xz; built by bench/device/pd_bundles.sh), one command per router:
  call 1, carry [".sgl"]:   python3 bench/device/real_multi.py unpack
  call 2, carry [".sglr"]:  python3 bench/device/real_multi.py unpack && \
                            python3 bench/device/real_multi.py run --mode real --router smg --out $OUT
  call 3 (warm):            python3 bench/device/real_multi.py run --mode real --router sglang-router --out $OUT
The group is seven starts of a TP2 pair or a TP4 server (~50-60 s each on one GPU's tiny model:
~470 s in all); what does not fit the 570 s budget comes back "NOT RUN (budget)" and runs in a
call of its own on the warm machine, e.g. `--only m6_park,m7_hung_collective`.
The dry run on a one-GPU machine (the same group, TP1 halves sharing GPU 0, the single server TP1):
  python3 bench/device/real_multi.py run --mode real --router smg --gpus 1 --tp 1 --out $OUT

Here, CPU only: stand-in servers on simulated GPUs (a scheduler process per rank, each holding
its GPU's memory), the stand-in router or a real one installed in this venv:
  .venv/bin/python bench/device/real_multi.py run --mode standin --router standin --gpus 4 --tp 2 --out /tmp/rmulti
  .venv/bin/python bench/device/real_multi.py run --mode standin --router smg --gpus 4 --tp 2 --out /tmp/rmulti
  .venv/bin/python bench/device/real_multi.py run --mode standin --router smg --gpus 1 --tp 1 --out /tmp/rmulti
REAL_PD_PORTS moves the ports as for real_pd.py; REAL_MULTI_PARK_PORT moves tp4p's (30400).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import real_hang  # noqa: E402  (the hang issue's bound)
import real_park  # noqa: E402  (Park and Restore jobs through the daemon's control socket)
import real_pd as P  # noqa: E402  (the PD run: bundles, config, router, the scenarios taking profile names)
import real_sglang as R  # noqa: E402  (Run, Daemon, Check, the control socket)

PARK_PORT = int(os.environ.get("REAL_MULTI_PARK_PORT", "30400"))
PD, SINGLE, BAD, PARKED_NEXT = "pd22", "tp4", "tp4bad", "tp4p"
PD_MEM = 0.2  # each half's mem-fraction-static (real); what pd1 has on its shared GPU
SINGLE_MEM = 0.5
STANDIN_MEM = 0.02  # the stand-in holds mem-fraction x its card: parked, that must fit this host's memory
GREEDY = {"text": "The capital city of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}


# ============================================================================ every GPU of the group

class Gpus(R.Gpu):
    """GPUs 0..count-1, read independently of the product (NVML, or the simulated GPUs' file):
    read() sums them (what real_sglang.py's checks compare with the summed baseline), per_gpu()
    gives each one's (used MiB, holder PIDs), sampled every 0.1 s into per_trace."""

    def __init__(self, mode: str, simgpu_dir: Path | None, count: int) -> None:
        super().__init__(mode, simgpu_dir)
        self.count = count
        self.per_trace: list[tuple[float, list[tuple[int, list[int]]]]] = []
        self.baselines: list[int] = []
        if mode == "real":
            if count > (present := self.nv.nvmlDeviceGetCount()):
                raise RuntimeError(f"--gpus {count}: NVML sees {present} GPU(s) on this machine")
            self.handles = [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def per_gpu(self) -> list[tuple[int, list[int]]]:
        if self.mode == "real":
            out = []
            for h in self.handles:
                mem = self.nv.nvmlDeviceGetMemoryInfo(h)
                out.append((mem.used >> 20, sorted(p.pid for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h))))
            return out
        from supervisord_gpu.checks.simgpu import SimulatedGpus

        held = SimulatedGpus(self.simgpu_dir).holders()  # type: ignore[arg-type]
        return [(sum(h.mib for h in held if i in h.gpus), sorted(h.pid for h in held if i in h.gpus))
                for i in range(self.count)]

    def read(self) -> tuple[int, list[int]]:
        per = self.per_gpu()
        return sum(u for u, _ in per), sorted({p for _, ps in per for p in ps})

    def info(self) -> dict[str, Any]:
        return {**super().info(), "read": self.count} if self.mode == "real" else {"name": "simulated", "count": self.count}

    def start(self) -> None:
        self.baselines = [u for u, _ in self.per_gpu()]

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    per = self.per_gpu()
                    with self._lock:
                        t = time.time()
                        self.trace.append((t, sum(u for u, _ in per), len({p for _, ps in per for p in ps})))
                        self.per_trace.append((t, per))
                except Exception:
                    pass
                time.sleep(0.1)

        threading.Thread(target=loop, daemon=True).start()

    def idle(self, per: list[tuple[int, list[int]]], gpus: list[int] | None = None) -> bool:
        """Each of `gpus` (all by default) within the tolerance of its baseline, no holder."""
        return all(per[i][0] - self.baselines[i] <= R.IDLE_TOLERANCE_MIB and not per[i][1]
                   for i in (range(self.count) if gpus is None else gpus))

    def all_idle_between(self, t0: float, t1: float, gpus: list[int] | None = None,
                         every: bool = False) -> tuple[bool, dict[str, Any]]:
        """Did one sample between t0 and t1 (`every`: each sample, and at least one) see every GPU
        of `gpus` at its baseline together?"""
        with self._lock:
            window = [(t, per) for t, per in self.per_trace if t0 <= t <= t1]
        idle = [t for t, per in window if self.idle(per, gpus)]
        lowest = [min((per[i][0] for _, per in window), default=None) for i in range(self.count)]
        highest = [max((per[i][0] for _, per in window), default=None) for i in range(self.count)]
        ok = bool(idle) and (len(idle) == len(window) if every else True)
        return ok, {"samples": len(window), "idle_samples": len(idle), "first_idle_at_s": round(idle[0] - t0, 2) if idle else None,
                    "min_used_mib": lowest, "max_used_mib": highest, "baselines": self.baselines}


# ============================================================================ the run

class MultiRun(P.PdRun):
    """real_pd.py's PdRun with the N-GPU profiles and a reader of every GPU."""

    def __init__(self, args: argparse.Namespace) -> None:
        args.work = args.work or f"/tmp/rmulti-{args.mode}-{args.router}-g{args.gpus}tp{args.tp}"
        super().__init__(args)
        self.ngpus, self.k = args.gpus, args.tp
        self.single_tp = min(2 * self.k, self.ngpus)
        self.shared = self.ngpus < 2 * self.k
        self.prefill_gpus = list(range(self.k))
        self.decode_gpus = list(range(self.k)) if self.shared else list(range(self.k, 2 * self.k))
        self.single_gpus = list(range(self.single_tp))
        self.layout = "shared" if self.shared else f"prefill GPUs {self.prefill_gpus}, decode GPUs {self.decode_gpus}"
        args.group = f"multi-{args.router}-g{self.ngpus}tp{self.k}"
        self.results["group"] = args.group
        self.results["setup"]["gpu_layout"] = {"gpus": self.ngpus, "tp_pd_half": self.k, "tp_single": self.single_tp,
                                  "prefill_gpus": self.prefill_gpus, "decode_gpus": self.decode_gpus,
                                  "single_gpus": self.single_gpus, "shared": self.shared,
                                  "dry_run_of_the_4_gpu_group": self.ngpus < 4}

    def tag(self) -> str:
        """multi-MODE-ROUTER-gNtpK, and the scenarios of --only (one device call each) after it."""
        part = "+".join(sorted(self.args.only - {"m1_start", "m8_stop"}))
        return f"multi-{self.mode}-{self.router}-g{self.ngpus}tp{self.k}" + (f"-{part}" if part else "")

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / f"real-{self.tag()}.json").write_text(json.dumps(self.results, indent=1, default=str))

    def make_gpu(self) -> R.Gpu:
        return Gpus(self.mode, self.work / "simgpu", self.ngpus)

    def finish(self) -> int:
        """Exit 0 when every scenario that ran passed: one left out by --only is no failure (the group
        takes two device calls), one left out by the budget is."""
        super().finish()
        return 0 if all(v["result"] == "PASS" or (v["result"] == "NOT RUN" and v.get("why") == "not in --only")
                        for v in self.results["scenarios"].values()) else 1

    @property
    def gpus(self) -> Gpus:
        assert isinstance(self.gpu, Gpus)
        return self.gpu

    def write_profiles(self) -> None:
        profiles = self.multi_profiles()
        self.write_all(profiles, gpu_count=self.ngpus)
        self.check_profiles(profiles, self.refused(PD), PD)

    def mem(self, real: float) -> float:
        return real if self.mode == "real" else STANDIN_MEM

    def multi_profiles(self) -> dict[str, str]:
        def tp(k: int) -> str:
            return f"tp-size = {k}\n" if k > 1 else ""

        k, n = self.k, self.single_tp
        where = "sharing GPUs" if self.shared else "on GPUs"
        pd = self.pd_toml(f"PD, TP{k} prefill {where} {self.prefill_gpus} + TP{k} decode on GPUs {self.decode_gpus}, "
                          "mooncake over TCP, router in PD mode (issue 40)",
                          self.prefill_gpus, self.decode_gpus, self.shared, self.mem(PD_MEM), extra_options=tp(k))

        def single(description: str, port: int, **extra: Any) -> str:
            return (f'description = "{description} (issue 40)"\ntakeover = true\nrollback = true\n'
                    + self.server_toml("server", port, self.mem(SINGLE_MEM), self.single_gpus, extra_options=tp(n), **extra))

        return {PD: pd,
                SINGLE: single(f"one TP{n} server on GPUs {self.single_gpus}, on the router's port", P.ROUTER_PORT),
                BAD: single(f"{SINGLE} whose server fails after its spawn", P.ROUTER_PORT, model=self.bad_model,
                            extra_env=P.BAD_ENV),
                PARKED_NEXT: single(f"{SINGLE} on port {PARK_PORT}: started while {PD} is parked", PARK_PORT)}

    def schedulers(self, d: R.Daemon, names: list[str]) -> dict[str, list[int]]:
        """Per process of the daemon's instance: the scheduler PIDs of its cgroup, rank order
        (their titles end in _TP<r> where TP > 1; PID order otherwise)."""
        out = {}
        for name in names:
            _, _, pids, _ = self.server_pids(d, name)
            scheds = [p for p in pids if R.is_scheduler(p)]
            out[name] = sorted(scheds, key=lambda p: (R.cmdline(p) or R.comm(p), p))
        return out


# ============================================================================ scenario helpers

def greedy(port: int) -> tuple[int | None, str]:
    status, body, _ = R.call("POST", port, "/generate", GREEDY, timeout=60)
    try:
        text = json.loads(body).get("text", "") if status == 200 else body[:200].decode(errors="replace")
    except (ValueError, AttributeError):
        text = body[:200].decode(errors="replace")
    return status, str(text)


def ranks_hold_gpus(run: MultiRun, c: R.Check, m: dict[str, Any], d: R.Daemon, names: list[str], gpus: list[int],
                    label: str) -> None:
    """One scheduler per rank (/proc); GPUs `gpus` hold memory and no other does (the reading); the
    holders NVML lists are exactly those schedulers. NVML in a VM may list no process at all
    (the 2- and 4-GPU H200 machines did not, bench/README.md): then memory alone is the evidence."""
    scheds = run.schedulers(d, names)
    per = run.gpus.per_gpu()
    used = {i: per[i][0] - run.gpus.baselines[i] for i in range(run.ngpus)}
    held = {i: per[i][1] for i in range(run.ngpus)}
    m[f"{label}_schedulers"], m[f"{label}_holders_by_gpu"], m[f"{label}_used_above_baseline_mib"] = scheds, held, used
    ranks = sum(len(v) for v in scheds.values())
    every = {p for v in scheds.values() for p in v}
    listed = {p for ps in held.values() for p in ps}
    c(f"{label}: one scheduler process per rank ({ranks} in all)",
      all(len(v) == (run.k if n != "server" else run.single_tp) for n, v in scheds.items()), scheds)
    c(f"{label}: GPUs {gpus} hold memory, the others none",
      all(used[i] > R.IDLE_TOLERANCE_MIB for i in gpus)
      and all(used[i] <= R.IDLE_TOLERANCE_MIB for i in range(run.ngpus) if i not in gpus), used)
    c(f"{label}: the GPUs' holders are its schedulers, every one of them" + ("" if listed else " (NVML lists none here)"),
      listed == every or (not listed and run.mode == "real"), held)


def m1_start(run: MultiRun, c: R.Check, m: dict[str, Any], d: R.Daemon) -> None:
    P.p1_start(run, c, m, d, PD)
    ranks_hold_gpus(run, c, m, d, ["prefill", "decode"], sorted(set(run.prefill_gpus + run.decode_gpus)), PD)


def m3_switch(run: MultiRun, c: R.Check, m: dict[str, Any], holder: dict[str, R.Daemon], n: int) -> None:
    new = P.takeover(run, c, m, holder["live"], SINGLE, "m3-tp4", P.PD_STOP_ORDER, n)
    holder["live"] = new
    last_stop = max((v["stopped_at_s"] for v in m["stops"].values()), default=None)
    spawn = new.says("spawn")
    if last_stop is not None and spawn:  # the new daemon was made when the switch began
        ok, seen = run.gpus.all_idle_between(new.started_at + last_stop - 0.5, spawn[0]["t"] + 3.0)
        m["all_gpus_between"] = seen
        c(f"all {run.ngpus} GPUs read at their baseline together between the layouts (before {SINGLE}'s spawn)", ok, seen)
    else:
        c(f"all {run.ngpus} GPUs read at their baseline together between the layouts", False,
          {"last_stop_s": last_stop, "spawned": bool(spawn)})
    P.serves(c, m, SINGLE)
    ranks_hold_gpus(run, c, m, new, ["server"], run.single_gpus, SINGLE)


def m6_park(run: MultiRun, c: R.Check, m: dict[str, Any], holder: dict[str, R.Daemon]) -> None:
    d = holder["live"]
    status, before = greedy(P.ROUTER_PORT)
    c(f"{PD} serves a greedy generation before the park", status == 200, before)
    scheds = {p for v in run.schedulers(d, ["prefill", "decode"]).values() for p in v}
    _, cuda_before = run.gpus.read()
    m["cuda_processes_before"], m["schedulers_before"] = cuda_before, sorted(scheds)
    t = time.time()
    parked = real_park.control_job(d, 300, op="park", next=PARKED_NEXT)
    m["park_job"], m["park_job_s"] = parked, round(time.time() - t, 2)
    c("Park job done", parked.get("state") == "done", parked)
    parked_at = time.time()
    try:
        record = json.loads((run.work / "run" / "parked" / f"{PD}.json").read_text())
        pids = sorted(int(x["pid"]) for x in record["pids"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        record, pids = {"error": repr(e)}, []
    m["parked_record"] = record
    c(f"every CUDA process of {PD} parked: {2 * run.k} (one scheduler per rank), the GPUs' holders before",
      pids == sorted(scheds) and len(pids) == 2 * run.k and (sorted(cuda_before) == pids or not cuda_before),
      {"parked": pids, "gpu_holders_before": cuda_before, "schedulers": sorted(scheds)})
    per = run.gpus.per_gpu()
    m["gpus_parked"] = per
    c(f"all {run.ngpus} GPUs at their baseline while {PD} is parked", run.gpus.idle(per), per)
    c(f"{PD}'s daemon says parked", d.ctl(op="status").get("state") == "parked", d.ctl(op="status").get("reason"))
    nxt = R.Daemon(run, PARKED_NEXT, "m6-tp4p")
    try:
        run.start_and_ready(nxt, c, m, PARK_PORT, timeout=300)
        spawn = nxt.says("spawn")
        if spawn:
            ok, seen = run.gpus.all_idle_between(parked_at, spawn[0]["t"], every=True)
            m["while_parked_before_spawn"] = seen
            c(f"all {run.ngpus} GPUs at baseline in every sample from the park to {PARKED_NEXT}'s spawn", ok, seen)
        c(f"{PARKED_NEXT}'s start left the parked {PD} alone", d.proc.poll() is None and
          d.ctl(op="status").get("state") == "parked", d.ctl(op="status").get("state"))
        status, text = greedy(PARK_PORT)
        c(f"{PARKED_NEXT} serves (TP{run.single_tp} on GPUs {run.single_gpus})", status == 200, text)
        t = time.time()
        back = real_park.control_job(d, 400, op="restore")
        m["restore_job"], m["restore_job_s"] = back, round(time.time() - t, 2)
        c(f"Restore job done: {PARKED_NEXT} stopped, GPUs verified idle, {PD} restored and serving",
          back.get("state") == "done" and "restored and serving" in str(back.get("reason")), back)
        rc = nxt.proc.wait(60)
        c(f"{PARKED_NEXT}'s daemon exited 0 (stopped by the switch back)", rc == 0, rc)
    finally:
        nxt.stop(60)
    status, after = greedy(P.ROUTER_PORT)
    m["greedy"] = {"before": before, "after": after}
    c("the same greedy output through the router after the restore", status == 200 and after == before, m["greedy"])
    c("the same scheduler processes serve (restored, not restarted)",
      {p for v in run.schedulers(d, ["prefill", "decode"]).values() for p in v} == scheds, sorted(scheds))


def m7_hung_collective(run: MultiRun, c: R.Check, m: dict[str, Any], d: R.Daemon) -> None:
    name = "decode"
    main, _, pids, _ = run.server_pids(d, name)
    ranks = run.schedulers(d, [name])[name]
    if not ranks:
        raise AssertionError(f"no scheduler in the {name}'s cgroup: {pids}")
    victim = ranks[-1]  # the last rank: not the one the front end talks to
    m["victim"] = {"pid": victim, "title": R.cmdline(victim)[:80], "ranks": ranks, "old_pids": pids}
    restarts0 = d.process(name).get("restarts") or 0
    since = time.time()
    os.kill(victim, signal.SIGSTOP)
    try:
        kill = d.wait_say("unhealthy", 90, since, name)
    except AssertionError:
        real_hang._cont(victim)
        raise
    m["killed_after_s"] = round(kill["t"] - since, 1)
    m["kill_line"] = kill["msg"]
    evidence = d.says("hang", since, name)
    m["evidence_line"] = evidence[0]["msg"] if evidence else None
    c(f"one rank of a TP{run.k} server stopped: killed within {real_hang.TARGET_S:g} s", kill["t"] - since <= real_hang.TARGET_S,
      m["killed_after_s"])
    c("the verdict names the stopped rank", str(victim) in kill["msg"] + (m["evidence_line"] or ""), kill["msg"])
    ready = d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == name and e["state"] == "ready",
                   run.args.start_estimate * 2, f"{name} ready again", kill["t"])
    m["kill_to_ready_s"] = round(ready["t"] - kill["t"], 1)
    new_main, _, new_pids, _ = run.server_pids(d, name)
    left = [p for p in pids if R.alive(p)]
    c(f"the whole server ended: the stopped rank, its peer rank(s), the front end ({len(pids)} processes)", not left,
      {"left": left})
    c("restarted and ready again, new PIDs, counted once",
      new_main not in (None, main) and not set(new_pids) & set(pids) and (d.process(name).get("restarts") or 0) == restarts0 + 1,
      {"kill_to_ready_s": m["kill_to_ready_s"], "restarts": d.process(name).get("restarts")})
    _, holders = run.gpus.read()
    c("none of the old processes holds any GPU", not set(holders) & set(pids), {"holders": holders})
    spawn = d.says("spawn", kill["t"], name)
    if not run.shared and spawn:
        ok, seen = run.gpus.all_idle_between(kill["t"], spawn[0]["t"] + 1.0, run.decode_gpus)
        m["decode_gpus_between"] = seen
        c(f"the decode's GPUs {run.decode_gpus} at their baseline between the kill and the restart", ok, seen)
    deadline = time.time() + 60
    status, text = greedy(P.ROUTER_PORT)
    while status != 200 and time.time() < deadline:
        time.sleep(1)
        status, text = greedy(P.ROUTER_PORT)
    m["router_after"] = {"status": status, "text": text, "waited_s": round(time.time() - ready["t"], 1)}
    c("the router serves again after the restart", status == 200, m["router_after"])


def m8_stop(run: MultiRun, c: R.Check, m: dict[str, Any], d: R.Daemon, n: int) -> None:
    if d.profile == PD:
        P.p6_stop(run, c, m, d, n, PD)
    else:
        run.idle_after_stop(c, m, d, d.profile, ["server"])
    per = run.gpus.per_gpu()
    m["gpus_after"] = per
    c(f"every one of the {run.ngpus} GPUs at its baseline, no holder", run.gpus.idle(per), per)


# ============================================================================ the group

def group(run: MultiRun) -> None:
    est = run.args.start_estimate
    n = run.args.in_flight
    holder = {"live": R.Daemon(run, PD, "m1-pd22")}
    d = holder["live"]
    run.scenario("m1_start", f"{PD} to READY: both workers, a first request, one scheduler per rank", 2 * est,
                 lambda c, m: m1_start(run, c, m, d))
    if d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "ready"):
        run.scenario("m2_generate", "/generate through the router; a direct one to the decode refused", 10,
                     lambda c, m: P.p2_generate(run, c, m))
        run.scenario("m3_switch", f"{PD} -> {SINGLE} with {n} requests in flight: ordered stops, every GPU idle between",
                     est + 30, lambda c, m: m3_switch(run, c, m, holder, n))

        def switch(c: R.Check, m: dict[str, Any], profile: str, tag: str, procs: list[str]) -> None:
            holder["live"] = P.takeover(run, c, m, holder["live"], profile, tag, procs, 0)
            P.serves(c, m, profile)

        if holder["live"].profile == SINGLE:
            run.scenario("m4_back", f"{SINGLE} -> {PD}", 2 * est + 15, lambda c, m: switch(c, m, PD, "m4-pd22", ["server"]))

        def on_pd(key: str, title: str, estimate: float, fn: Any) -> None:
            if holder["live"].profile == PD and holder["live"].proc.poll() is None:
                run.scenario(key, title, estimate, fn)

        def rollback(c: R.Check, m: dict[str, Any]) -> None:
            holder["live"] = P.p5_rollback(run, c, m, holder["live"], BAD, PD, "m5")

        on_pd("m5_rollback", f"{BAD} fails after its spawn: rolled back, {PD} serves again", 3 * est, rollback)
        on_pd("m6_park", f"{PD} parked, {PARKED_NEXT} serves, {PD} restored: same output", 2 * est + 60,
              lambda c, m: m6_park(run, c, m, holder))
        on_pd("m7_hung_collective", f"one scheduler rank of the TP{run.k} decode SIGSTOPped: the whole server restarted",
              real_hang.TARGET_S + est + 30, lambda c, m: m7_hung_collective(run, c, m, holder["live"]))
    run.args.reserve = 0
    live = holder["live"]
    if live.proc.poll() is None:
        run.scenario("m8_stop", f"stop {live.profile} with {n} requests in flight; every GPU at baseline", 40,
                     lambda c, m: m8_stop(run, c, m, live, n if live.profile == PD else 0))


def main() -> int:
    ap, r = P.parsers(__doc__.split("\n\n")[0], 60.0, "m1_start and m8_stop always run")
    r.add_argument("--gpus", type=int, default=4, help="GPUs of the group (1: the dry run on one GPU)")
    r.add_argument("--tp", type=int, default=2, help="TP of each PD half; the single server is TP min(2 x this, --gpus)")
    args = ap.parse_args()
    if args.command == "unpack":
        return P.cmd_unpack(args)
    if not 1 <= args.tp <= args.gpus:
        print(f"--tp {args.tp}: must be between 1 and --gpus ({args.gpus})", file=sys.stderr)
        return 2
    args.code, args.sgl = "tree", str(R.SGL)
    args.only = args.only | {"m1_start", "m8_stop"} if args.only else set()
    return P.cmd_run(args, MultiRun, group)


if __name__ == "__main__":
    sys.exit(main())
