"""Parking the REAL SGLang 0.5.23 in host memory, switching, and bringing it back (issue 39),
measured on one GPU in one device command; the same cycle against the stand-in on CPU.

On the device machine, after prepare.sh built the bundles into .sgl/ (README, "The real SGLang in
the loop"), one call with carry [".sgl"]:

    python3 bench/device/real_park.py --mode real --out $OUT

Here, CPU only (stand-in servers on simulated GPUs, the simulated checkpointer):

    .venv/bin/python bench/device/real_park.py --mode standin --out /tmp/park-standin

It reuses real_sglang.py's machinery (its Run: bundles unpacked, tiny model, daemon config,
cgroups; its Gpu: NVML or the simulated GPU sampled every 0.1 s, read independently of the
product) and drives the daemon's own objects in this process: the engine's Instance (what
`supervisord-gpu run` builds) and the controller's Parker with the checkpointer the machine has
(parking/driver.py, the CUDA driver API through ctypes; the simulated one for the stand-in).

Scenarios, each skipped with "NOT RUN (budget)" when the time left cannot hold it:

  p0_bandwidth   pinned host<->device copy rate (torch, 2 GiB), for the target's floor (real only)
  p1_start       a cold start of `solo` (mem-fraction 0.25): the time to READY a park saves
  p2_park        greedy output for a prompt; park through the Parker: bytes on the GPU before,
                 checkpoint time, host RSS of the parked PID, NVML at baseline while parked
  p3_switch      `other` (a second server on the same GPU, another port) started while `solo` is
                 parked, one generation, stopped, GPU verified idle; a request sent to `solo`
                 while parked, answered after the restore (0 cut)
  p4_restore     restore through the Parker: from parked to a generation answered; the same greedy
                 output; the in-flight request's answer; every NVML sample at baseline while parked
  p6_daemon      the same cycle through two daemons (real_sglang.py's daemon subcommand, its
                 control socket standing in for D-Bus): Park job on solo, other started by its own
                 daemon (its takeover leaves the parked solo alone), Restore job on solo (other
                 stopped by the transition, GPU verified idle, restored, one generation), same output
  p5_saver       SGLang's own memory saver (`--enable-memory-saver`): release/resume with tags
                 (kv_cache, then all), NVML after each, time, and the greedy output after
  p7_mix         the product's mix (parking/saver.py) on a server with --enable-memory-saver: paused
                 (retract) and its KV pool released, the rest checkpointed through the Parker; back:
                 restore, the pool resumed, continue, one generation; times split, bytes moved, NVML
                 while parked, a request sent while parked answered after the continue, the target

Results: $OUT/real-sglang-<mode>-gpark.json and $OUT/logs-<mode>-gpark.tar.gz (real_sglang.py's names). Exit 0 when every scenario
that ran passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import real_sglang as R  # noqa: E402  (the sibling script's machinery, imported by path)

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 16, "temperature": 0}
OTHER_PORT = R.SERVER_PORT + 7
SAVER_PORT = R.SERVER_PORT + 9
GIB = 1 << 30

BANDWIDTH = r"""
import json, time, torch
n = 2 << 30
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
out = {}
for name, dst, src in (("h2d", d, h), ("d2h", h, d)):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter(); dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    out[name + "_gb_s"] = round(n / (time.perf_counter() - t) / 1e9, 1)
print(json.dumps(out))
"""


def generate(port: int, timeout: float = 60.0) -> tuple[int | None, str, float]:
    status, body, took = R.call("POST", port, "/generate", {"text": PROMPT, "sampling_params": GREEDY}, timeout=timeout)
    try:
        text = json.loads(body).get("text", "") if status == 200 else body.decode(errors="replace")[:200]
    except ValueError:
        text = body.decode(errors="replace")[:200]
    return status, text, took


def rss(pid: int) -> int:
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def control_job(d: R.Daemon, timeout: float, **req: Any) -> dict[str, Any]:
    """A control job through the daemon's socket (what D-Bus Park/Restore + GetJob would be), to its end."""
    started = d.ctl(**req)
    if "job" not in started:
        return {"state": "not accepted", "reason": started}
    deadline = time.time() + timeout
    while time.time() < deadline:
        j = d.ctl(op="job", id=started["job"])
        if j.get("state") != "running":
            return j
        time.sleep(0.2)
    return {"state": "timed out", "reason": f"{timeout:g} s"}


class Park:
    """One run: the Run of real_sglang.py, the instances built here, one Parker."""

    def __init__(self, args: argparse.Namespace) -> None:
        ns = argparse.Namespace(mode=args.mode, group="park", out=args.out, budget=args.budget, reserve=args.reserve,
                                code="tree", only=set(filter(None, args.only.split(","))), sgl=args.sgl, unpack=args.unpack, work=args.work or f"/tmp/park-work-{args.mode}",
                                python=args.python, standin_startup=args.standin_startup, router="standin",
                                start_estimate=args.start_estimate)
        self.run = R.Run(ns)
        self.args = args
        self.loop = asyncio.new_event_loop()
        self.instances: dict[str, Any] = {}
        self.said: list[dict[str, Any]] = []
        self.parker: Any = None
        self.greedy_before = ""
        #: when solo's GPU must read at its baseline: parked, before other starts and after it stops
        self.marks: dict[str, float] = {}
        self.in_flight: dict[str, Any] = {}
        self.daemons: list[R.Daemon] = []  # stopped at the end whatever happened (their restarts would outlive the run)

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        run = self.run
        run.setup()
        solo = run.results["setup"]["profiles"]["solo"]
        other = solo.replace(f"port = {R.SERVER_PORT}", f"port = {OTHER_PORT}").replace("(issue 27)", "(issue 39: the switch's other)")
        saver = (solo.replace(f"port = {R.SERVER_PORT}", f"port = {SAVER_PORT}")
                 .replace("disable-radix-cache = true\n", "disable-radix-cache = true\nenable-memory-saver = true\n"))
        if self.args.mode == "standin":
            # the stand-in holds mem-fraction x its simulated card (143771 MiB): 0.25 of it is 35 GB, which
            # the park's host-memory check would rightly refuse on a small host; 0.02 is 2.8 GB
            solo, other, saver = (t.replace("mem-fraction-static = 0.25", "mem-fraction-static = 0.02")
                                  for t in (solo, other, saver))
            (run.etc / "profiles" / "solo.toml").write_text(solo)
            run.results["setup"]["profiles"]["solo"] = solo
        for name, text in (("other", other), ("saver", saver)):
            (run.etc / "profiles" / f"{name}.toml").write_text(text)
            run.results["setup"]["profiles"][name] = text
        from supervisord_gpu.checks.gpus import inventory_for
        from supervisord_gpu.config.loader import effective_config, load_daemon_config
        from supervisord_gpu.controller.parking import Parker

        self.cfg = effective_config(load_daemon_config(run.etc), self.args.mode == "standin")
        inventory = inventory_for(self.cfg, simulated=self.args.mode == "standin")
        if self.args.mode == "real":
            from supervisord_gpu.parking.driver import DriverCheckpointer

            checkpointer: Any = DriverCheckpointer.open()
        else:
            from supervisord_gpu.checks.gpus import simgpu_dir
            from supervisord_gpu.checks.simgpu import SimulatedGpus
            from supervisord_gpu.parking.simulated import SimulatedCheckpointer

            checkpointer = SimulatedCheckpointer(SimulatedGpus(simgpu_dir(self.cfg)))
        self.parker = Parker(checkpointer, inventory, lambda m, p: self.say(m, p))
        run.results["setup"]["checkpointer"] = checkpointer.name

    def say(self, message: str, priority: int) -> None:
        self.said.append({"t": time.time(), "prio": priority, "msg": message})
        print(f"      parker: {message}", flush=True)

    def instance(self, name: str) -> Any:
        if name not in self.instances:
            from supervisord_gpu import daemon as D
            from supervisord_gpu.config.loader import load_profile

            profile = load_profile(self.cfg, name)
            opts = D.RunOptions(rehearsal=self.args.mode == "standin", force_stderr=True, bus="off")
            sink_log = open(self.run.logs / f"{name}.log", "a")
            import contextlib

            with contextlib.redirect_stderr(sink_log):
                inst, _ = D.build_instance(self.cfg, profile, opts)
            self.instances[name] = inst
        return self.instances[name]

    def do(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def start(self, name: str, m: dict[str, Any]) -> Any:
        inst = self.instance(name)
        t = time.time()
        self.do(inst.start())
        m[f"{name}_start_to_ready_s"] = round(time.time() - t, 1)
        return inst

    def restore(self, inst: Any, m: dict[str, Any]) -> tuple[Any, list[str], float]:
        """The Parker's restore, timed into m["restore_to_serving_s"]: its verdict, ["cold"] when it
        fell back, and when it began (the end of the parked window)."""
        cold: list[str] = []

        async def cold_start() -> None:
            cold.append("cold")
            await inst.start()

        t = time.time()
        verdict = self.do(self.parker.restore(inst, cold_start))
        m["restore_to_serving_s"] = round(time.time() - t, 2)
        return verdict, cold, t

    def key(self, instance: str) -> str | None:
        """The admin key the daemon made for INSTANCE's server (the operator reads it as root)."""
        path = self.run.work / "run" / instance / "server.admin.key"
        return path.read_text().strip() if path.exists() else None

    def scheduler_pids(self, inst: Any) -> list[int]:
        return [pid for p in inst.processes.values() if p.spawned is not None for pid in p.spawned.group.pids()
                if R.is_scheduler(pid) or self.args.mode == "standin"]

    # ------------------------------------------------------------------ scenarios

    def p0_bandwidth(self, c: R.Check, m: dict[str, Any]) -> None:
        if self.args.mode != "real":
            raise R.NotRun("real mode only (no GPU here)")
        done = subprocess.run([self.run.py, "-c", BANDWIDTH], capture_output=True, text=True, timeout=120)
        m.update(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-800:]})
        c("pinned copy rates measured", "h2d_gb_s" in m, m)

    def p1_start(self, c: R.Check, m: dict[str, Any]) -> None:
        inst = self.start("solo", m)
        c("solo ready", inst.state.value == "ready", inst.state.value)
        status, text, took = generate(R.SERVER_PORT)
        self.greedy_before = text
        m["greedy_before"], m["generate_s"] = text, round(took, 3)
        c("one greedy generation", status == 200, (status, text))

    def p2_park(self, c: R.Check, m: dict[str, Any]) -> None:
        inst = self.instance("solo")
        used_before, holders = self.run.gpu.read()
        pids = self.scheduler_pids(inst)
        rss_before = {p: rss(p) for p in pids}
        m["gpu_before"] = {"used_mib": used_before, "holders": holders, "baseline_mib": self.run.baseline}
        t = time.time()
        record = self.do(self.parker.park(inst, self.instance("other").profile))
        took = time.time() - t
        self.marks["parked"] = time.time()
        used, holders_after = self.run.gpu.read()
        m.update({"park_s": round(took, 2), "record": record.to_json(), "bytes_moved": record.host_bytes,
                  "gpu_parked": {"used_mib": used, "holders": holders_after},
                  "host_rss_growth_bytes": {p: rss(p) - rss_before.get(p, 0) for p in record.pids}})
        c("parked (instance state)", inst.state.value == "parked", inst.reason)
        c("GPU at baseline while parked (read directly)", used - self.run.baseline <= R.IDLE_TOLERANCE_MIB
          and not holders_after, (used, holders_after))
        box: dict[str, Any] = {}

        def in_flight() -> None:
            box["sent"] = time.time()
            box["answer"] = generate(R.SERVER_PORT, timeout=300)
            box["answered"] = time.time()

        threading.Thread(target=in_flight, daemon=True).start()
        self.in_flight = box

    def p3_switch(self, c: R.Check, m: dict[str, Any]) -> None:
        time.sleep(self.args.hold)  # parked alone: the GPU sampled at its baseline meanwhile
        self.marks["other_starts"] = time.time()
        other = self.start("other", m)
        c("other ready while solo is parked", other.state.value == "ready", other.state.value)
        status, text, _ = generate(OTHER_PORT)
        c("other serves", status == 200, (status, text))
        t = time.time()
        self.do(other.stop("switch back"))
        m["other_stop_s"] = round(time.time() - t, 2)
        self.marks["other_stopped"] = time.time()
        time.sleep(self.args.hold)
        used, holders = self.run.gpu.read()
        c("GPU idle after other's stop", used - self.run.baseline <= R.IDLE_TOLERANCE_MIB and not holders, (used, holders))

    def p4_restore(self, c: R.Check, m: dict[str, Any]) -> None:
        inst = self.instance("solo")
        if "other_starts" not in self.marks:  # p3 left out (--only): parked alone a while, sampled
            time.sleep(max(1.0, self.args.hold))
        verdict, cold, t = self.restore(inst, m)
        mk = self.marks
        window = (self.run.gpu.window(mk["parked"], mk.get("other_starts", t))
                  + (self.run.gpu.window(mk["other_stopped"], t) if "other_stopped" in mk else []))
        m["nvml_samples_while_parked"] = len(window)
        m["max_used_while_parked_mib"] = max((u for _, u, _ in window), default=None)
        c("restored, not cold-started", verdict.serve and not cold, verdict.say)
        at_baseline = bool(window) and all(u - self.run.baseline <= R.IDLE_TOLERANCE_MIB for _, u, _ in window)
        c("every GPU sample at baseline while parked (other's run aside)", at_baseline,
          m["max_used_while_parked_mib"])
        status, text, took = generate(R.SERVER_PORT)
        m["greedy_after"], m["generate_after_s"] = text, round(took, 3)
        c("same greedy output after the restore", status == 200 and text == self.greedy_before, (self.greedy_before, text))
        deadline = time.time() + 60
        while "answer" not in self.in_flight and time.time() < deadline:
            time.sleep(0.1)
        answer = self.in_flight.get("answer")
        m["request_while_parked"] = {"answer": answer, "waited_s": round(self.in_flight.get("answered", 0) - self.in_flight.get("sent", 0), 2)}
        c("the request sent while parked is answered 200 (none cut)", answer is not None and answer[0] == 200, answer)
        bandwidth = self.run.results["scenarios"].get("p0_bandwidth", {}).get("measured", {}).get("h2d_gb_s")
        record_bytes = self.run.results["scenarios"]["p2_park"]["measured"].get("bytes_moved", 0)
        if bandwidth:
            target = 2 + 1.5 * record_bytes / (bandwidth * 1e9)
            m["target_s_if_all_bytes_must_return"] = round(target, 2)
        t = time.time()
        self.do(inst.stop("end of the park cycle"))
        m["solo_stop_s"] = round(time.time() - t, 2)

    def job(self, d: R.Daemon, timeout: float, **req: Any) -> dict[str, Any]:
        return control_job(d, timeout, **req)

    def p6_daemon(self, c: R.Check, m: dict[str, Any]) -> None:
        """The cycle through two daemons (the device machine has no D-Bus: the control socket
        of real_sglang.py's daemon stands in for Park and Restore)."""
        run = self.run
        solo = R.Daemon(run, "solo", "park-solo")
        self.daemons.append(solo)
        run.start_and_ready(solo, c, m, R.SERVER_PORT)
        status, before, _ = generate(R.SERVER_PORT)
        c("solo serves under its daemon", status == 200, before)
        t = time.time()
        parked = self.job(solo, 300, op="park", next="other")
        m["park_job"], m["park_job_s"] = parked, round(time.time() - t, 2)
        c("Park job done", parked.get("state") == "done", parked)
        c("solo's daemon says parked", solo.ctl(op="status").get("state") == "parked", solo.ctl(op="status").get("reason"))
        used, holders = run.gpu.read()
        c("GPU at baseline, solo parked", used - run.baseline <= R.IDLE_TOLERANCE_MIB and not holders, (used, holders))
        other = R.Daemon(run, "other", "park-other")
        self.daemons.append(other)
        run.start_and_ready(other, c, m, OTHER_PORT)
        c("other's start left the parked solo alone", solo.proc.poll() is None and
          solo.ctl(op="status").get("state") == "parked", solo.ctl(op="status").get("state"))
        status, text, _ = generate(OTHER_PORT)
        c("other serves", status == 200, text)
        t = time.time()
        back = self.job(solo, 400, op="restore")
        m["restore_job"], m["restore_job_s"] = back, round(time.time() - t, 2)
        c("Restore job done: other stopped, GPU verified idle, solo restored and serving",
          back.get("state") == "done" and "restored and serving" in str(back.get("reason")), back)
        c("other's daemon exited (stopped by the switch back)", other.proc.poll() is not None, other.proc.poll())
        status, after, _ = generate(R.SERVER_PORT)
        c("the same greedy output under the daemon", status == 200 and after == before, (before, after))
        run.idle_after_stop(c, m, solo, "solo", ["server"])

    def p5_saver(self, c: R.Check, m: dict[str, Any]) -> None:
        inst = self.start("saver", m)
        c("saver ready (--enable-memory-saver)", inst.state.value == "ready", inst.state.value)
        status, before, _ = generate(SAVER_PORT)
        base_used, _ = self.run.gpu.read()
        m["used_ready_mib"], m["greedy_before"] = base_used, before
        for tags in (["kv_cache"], None):
            key = ",".join(tags) if tags else "all"
            body = {"tags": tags} if tags else {}
            s, b, took = R.call("POST", SAVER_PORT, "/release_memory_occupation", body, timeout=120, key=self.key("saver"))
            used, _ = self.run.gpu.read()
            # no request while released: on 0.5.23 one crashes the scheduler (a prefill writes to the
            # released req_to_token pool: "Pointer argument (at 0) cannot be accessed from Triton"),
            # seen on an H100 on 2026-12-07; SGLang does not block requests while released
            q = (None, "not sent: it crashes the scheduler", 0.0)
            s2, b2, took2 = R.call("POST", SAVER_PORT, "/resume_memory_occupation", body, timeout=300, key=self.key("saver"))
            status, after, _ = generate(SAVER_PORT)
            m[key] = {"release": [s, round(took, 2), b[:200].decode(errors="replace")], "used_released_mib": used,
                      "request_while_released": [q[0], round(q[2], 2)],
                      "resume": [s2, round(took2, 2), b2[:200].decode(errors="replace")], "greedy_after": after,
                      "same_output": after == before}
            c(f"release/resume {key} answered 200", s == 200 and s2 == 200 and status == 200, m[key])
        self.do(inst.stop("end of the saver measure"))  # p7 starts its own: a clean pool

    def p7_mix(self, c: R.Check, m: dict[str, Any]) -> None:
        """The mix, as the product does it (parking/saver.py) for a server started with
        --enable-memory-saver: the Parker pauses it (retract) and releases its KV pool through its
        front end, then checkpoints what is left; back: restore, unlock, continue the held
        processes, resume the pool, continue generation, one generation. Times split (driver
        restore + unlock), bytes moved, NVML while parked, a request sent straight to its port
        while parked (answered after the continue, none cut), the issue's target."""
        inst = self.start("saver", m)
        c("saver ready (--enable-memory-saver)", inst.state.value == "ready", inst.state.value)
        status, before, _ = generate(SAVER_PORT)
        m["greedy_before"] = before
        m["used_ready_mib"], _ = self.run.gpu.read()
        split: dict[str, float] = {"restore_s": 0.0, "unlock_s": 0.0}
        ckpt = self.parker.checkpointer
        for op in ("restore", "unlock"):
            def timed(pid: int, _f: Any = getattr(ckpt, op), _op: str = op) -> Any:
                t0 = time.monotonic()
                try:
                    return _f(pid)
                finally:
                    split[f"{_op}_s"] += time.monotonic() - t0
            setattr(ckpt, op, timed)
        box: dict[str, Any] = {}
        try:
            t = time.time()
            record = self.do(self.parker.park(inst))
            m.update({"park_s": round(time.time() - t, 2), "bytes_moved": record.host_bytes, "record": record.to_json()})
            parked_at = time.time()
            c("parked with the KV pool released (instance state)", inst.state.value == "parked"
              and record.released == ["server"], inst.reason)

            def in_flight() -> None:
                box["sent"] = time.time()
                box["answer"] = generate(SAVER_PORT, timeout=300)
                box["answered"] = time.time()

            threading.Thread(target=in_flight, daemon=True).start()
            time.sleep(max(1.0, self.args.hold))
            window = self.run.gpu.window(parked_at, time.time())
            m["nvml_samples_while_parked"] = len(window)
            m["max_used_while_parked_mib"] = max((u for _, u, _ in window), default=None)
            c("every GPU sample at baseline while parked", bool(window) and all(
                u - self.run.baseline <= R.IDLE_TOLERANCE_MIB for _, u, _ in window), m["max_used_while_parked_mib"])
            verdict, cold, _ = self.restore(inst, m)
        finally:
            for op in ("restore", "unlock"):
                with contextlib.suppress(AttributeError):
                    delattr(ckpt, op)
        m["driver_restore_s"], m["driver_unlock_s"] = round(split["restore_s"], 3), round(split["unlock_s"], 3)
        c("restored, not cold-started", verdict.serve and not cold, verdict.say)
        status, after, took = generate(SAVER_PORT)
        m["greedy_after"], m["generate_after_s"] = after, round(took, 3)
        c("same greedy output after the restore", status == 200 and after == before, (before, after))
        deadline = time.time() + 60
        while "answer" not in box and time.time() < deadline:
            time.sleep(0.1)
        answer = box.get("answer")
        m["request_while_parked"] = {"answer": answer, "waited_s": round(box.get("answered", 0) - box.get("sent", 0), 2)}
        c("the request sent while parked is answered 200 (none cut, no crash)", answer is not None and answer[0] == 200,
          answer)
        bandwidth = self.run.results["scenarios"].get("p0_bandwidth", {}).get("measured", {}).get("h2d_gb_s")
        if bandwidth:
            target = 2 + 1.5 * record.host_bytes / (bandwidth * 1e9)
            m["target_s"] = round(target, 2)
            c("from parked to serving within 2 s + 1.5 x bytes back / pinned H2D", m["restore_to_serving_s"] <= target,
              (m["restore_to_serving_s"], m["target_s"]))
        self.do(inst.stop("end of the mix measure"))

    # ------------------------------------------------------------------ the run

    def go(self) -> int:
        run = self.run
        try:
            self.setup()
        except Exception as e:
            run.results["setup"]["error"] = repr(e)
            run.save()
            print(f"set-up failed: {e!r}", flush=True)
            return 2
        start = self.args.start_estimate
        try:
            run.scenario("p0_bandwidth", "pinned copy rates (torch)", 30, self.p0_bandwidth)
            run.scenario("p1_start", "cold start of solo, one greedy generation", start, self.p1_start)
            if run.results["scenarios"]["p1_start"]["result"] == "PASS":
                run.scenario("p2_park", "park solo: drain, liveness paused, checkpoint, baseline", 60, self.p2_park)
                if run.results["scenarios"]["p2_park"]["result"] == "PASS":
                    run.scenario("p3_switch", "start other on the same GPU, serve, stop, idle", start, self.p3_switch)
                    run.scenario("p4_restore", "restore solo: serving, same output, the waiting request", 60, self.p4_restore)
            run.scenario("p6_daemon", "park, switch and restore through two daemons", 2 * start + 60, self.p6_daemon)
            run.scenario("p5_saver", "SGLang's memory saver: release/resume by tags", start + 60, self.p5_saver)
            run.scenario("p7_mix", "the mix: KV pool released, the rest checkpointed; restore, resume", 90, self.p7_mix)
        finally:
            for d in self.daemons:
                d.stop(60)
            for inst in self.instances.values():
                if inst.state.value not in ("stopped", "failed"):
                    try:
                        self.do(self.parker.stop(inst, "end of the run"))
                    except Exception as e:  # the run's end must still come back
                        print(f"stop of {inst.name} failed: {e!r}", flush=True)
            run.results["parker_said"] = self.said
            run.results["mode"] = f"park-{self.args.mode}"
            run.finish()
        # NOT RUN for what this mode cannot measure (no GPU) is no failure; for the budget it is
        results = run.results["scenarios"].values()
        return 0 if all(v["result"] == "PASS" or (v["result"] == "NOT RUN" and "budget" not in v.get("why", ""))
                        for v in results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("real", "standin"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=570.0, help="seconds this run may take (600 a device command)")
    ap.add_argument("--reserve", type=float, default=30.0)
    ap.add_argument("--start-estimate", type=float, default=110.0)
    ap.add_argument("--sgl", default=str(R.SGL))
    ap.add_argument("--unpack", default="/tmp/sgl")
    ap.add_argument("--work", default=None)
    ap.add_argument("--python", default=None)
    ap.add_argument("--standin-startup", type=float, default=3.0)
    ap.add_argument("--only", default="", help="scenarios to run, comma-separated (p1_start always runs): a short call")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds parked alone before the switch and after it")
    return Park(ap.parse_args()).go()


if __name__ == "__main__":
    sys.exit(main())
