"""Hung or busy, against the REAL SGLang 0.5.23 with the shipped defaults (issue 38), and the
same cases against the stand-in.

Each hang case must be killed and restarted within 30 s (hang_window 15 s + 2 looks of 2 s +
the 5 s stack dump = 24 s by construction); each busy case must be left alone. The machinery
(bundles, tiny model, the daemon as a subprocess with its events recorded, budget, checks,
logs) is bench/device/real_sglang.py's, imported. On the device machine, one call, carry [".sgl"]:

    python3 bench/device/real_hang.py --mode real --out $OUT

Here, CPU only (the daemon in rehearsal mode, stand-in servers on simulated GPUs):

    .venv/bin/python bench/device/real_hang.py --mode standin --out /tmp/rh-standin --today-s 40

The profile `hang` is the shipped server defaults (liveness 3 x (10 + 20) s, scheduler_timeout
300 s, hang_window 15 s, hang_interval 2 s) plus `--enable-metrics`. Cases, in order:

    busy  first_start   the first start (weights, KV cache, CUDA-graph capture): not killed
    busy  pause         POST /pause_generation (--pause-mode, in_place by default) with requests
                        held, --pause-s (the issue's 10 min is --pause-s 600: alone it fills a
                        device call). SGLang's own scheduler watchdog ends a pause in place with
                        requests running --watchdog-timeout to 1.5 x that after the last step (the
                        H100, 2026-12-07, run 4: 447 s), so a pause longer than 300 s is run with
                        --pause-mode retract (the requests are held queued; nothing watches them)
    busy  slow          POST /slow_down 2 s per step under 4 clients, --slow-s
    busy  long_prefill  one prompt of the longest input the server takes (max_req_input_len)
    busy  stall_latch   a 6 s scheduler stall (SIGSTOP) during a /health: /ready latched 503
    hang  sigstop_detokenizer, sigstop_scheduler, sigstop_front_end, blocked_scheduler
          (/slow_down 1e9 with requests in flight): each killed (the kill line, the evidence
          line and the stacks at priority 4), restarted and ready again

The busy cases repeat --busy-runs times (the issue asks >= 20 runs; one round takes about
--pause-s + --slow-s + 30 s, so a 10-minute call holds 1 round with --pause-s 60 next to the
four hang cases; 20 rounds need their own calls). "today" is the old verdict: by construction
from the shipped settings (90 s, 300 s, never), and measured where cheap with --today-s N: each
hang case first under a profile with hang_window = 0 (today's daemon), "not killed within N s"
or the time it was killed (a stand-in run affords it; a real run does not, with its restarts).
Results: $OUT/real-hang-<mode>.json (with "table") and the table on stdout.
REAL_SGLANG_PORTS=SERVER,ROUTER,METRICS moves the ports (real_sglang's; a shared machine).

--beside N puts N more servers on GPU 0 (`paused1`.. on ports SERVER_PORT+11.., mem-fraction 0.1,
every server `share_gpus`): each is paused for --pause-s with requests held while every other case
runs on `server` (its own pause case is left out), and its checks (paused, not killed, same PID,
continued, serves again) are its scenario `busy_pause_beside_K`, judged once it ends. The hang
cases then also show that killing and restarting `server` leaves its paused neighbours alone.
N pause runs cost one pause plus N more starts, not N pauses.

A run longer than one device call (bench/device/longrun.py): `detach` starts it in its own
session (it outlives the call; /tmp survives on the warm machine) and returns; each `collect`
waits up to --wait s, copies the results so far (saved after each case), run.log and the logs so
far into $OUT, and exits 3 while it runs (call it again within 30 s: the machine goes back after
30 s idle), 0 when it finished with every case PASS, 1 on a failure or a run that died, 2 when
--out-dir holds no run. --pause-runs N holds the pause in the first N rounds only. The issue's
table, on the device machine:

    call 1, carry [".sgl"]:
      python3 bench/device/real_pd.py unpack && python3 bench/device/real_hang.py detach \
        --out-dir /tmp/rh-long --mode real --beside 1 --pause-s 600 --pause-mode retract --busy-runs 8 \
        --slow-s 10 --budget 950
    calls 2..n, back to back, each within 30 s of the last, until the exit code is not 3:
      python3 bench/device/real_hang.py collect --out-dir /tmp/rh-long --out $OUT --wait 540

That is about 15 device minutes (run 4, 2026-12-07, H100, with --pause-mode in_place: detach
496 s after the call began, the whole run 756 s; its first start 123 s for both servers on a cold
machine; 8 rounds of slow (10 s) + long_prefill + stall_latch in 424 s and the 4 hang cases
inside the pause): 1 pause run of 10 minutes, the first start and 24 other busy runs, 26 in all
(--beside 2 adds a pause and ~35 s of starts). Without --beside (--pause-runs 1 --busy-runs 12):
~26 minutes for 1 pause; the issue's literal 20 rounds each with a 10-minute pause, one after
another, ~3.8 hours; --today-s 320 adds ~20 minutes.
On CPU: `.venv/bin/python bench/device/real_hang.py detach --out-dir /tmp/rh-long --mode standin
--pause-s 20 --busy-runs 2 --pause-runs 1 --slow-s 10 --standin-startup 3 --budget 880`, then
`collect --out-dir /tmp/rh-long --out /tmp/rh-out --wait 30` until it exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_sglang as R  # noqa: E402  (the device bench's machinery: bundles, daemon, checks)
import longrun  # noqa: E402  (detach / collect: one run across several device calls)

PROFILE = "hang"
OLD_PROFILE = "hang-old"
TARGET_S = 30.0
STALL_S = 6.0
BESIDE_MEM = 0.1  # mem-fraction-static of each server beside `server` (0.25): at most 6 fit the 0.9 a card allows


class HangRun(R.Run):
    """real_sglang's Run, with two more profiles: the shipped defaults (+ metrics), and today's."""

    def write_config(self) -> None:
        super().write_config()
        solo = self.results["setup"]["profiles"]["solo"]
        shipped = re.sub(r"\[servers\.server\.probe\]\n(?:[a-z_]+ = [^\n]*\n)*", "", solo)  # the shipped probe
        shipped = shipped.replace("[servers.server.options]\n", "[servers.server.options]\nenable-metrics = true\n")
        old = shipped.replace("[servers.server.options]\n", "[servers.server.probe]\nhang_window = 0\n\n"
                                                            "[servers.server.options]\n", 1)
        if self.args.beside:  # servers beside `server` on GPU 0, each sharing it (issue 36's share_gpus)
            block = shipped[shipped.index("[servers.server]"):]
            extra = "".join(block.replace("[servers.server", f"[servers.paused{k}")
                            .replace(f"port = {R.SERVER_PORT}\n", f"port = {beside_port(k)}\n")
                            .replace("mem-fraction-static = 0.25", f"mem-fraction-static = {BESIDE_MEM}")
                            for k in range(1, self.args.beside + 1))
            shipped = (shipped + extra).replace("gpus = [0]\n", "gpus = [0]\nshare_gpus = true\n")
        for name, text in ((PROFILE, shipped), (OLD_PROFILE, old)):
            (self.etc / "profiles" / f"{name}.toml").write_text(text.replace('"one server on GPU 0 (issue 27)"',
                                                                             f'"{name}: issue 38"'))
            self.results["setup"]["profiles"][name] = text

    def save(self) -> None:
        """After each case (Run.scenario): a detached run's partial results survive, and a
        `collect` reading them meanwhile never sees a half-written file (write, then rename)."""
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        path = self.out / f"real-hang-{self.mode}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, path)


def admin_key(server: str = "server") -> str | None:
    """The admin key the daemon made for this run's `server` (real_sglang's admin_key() takes the
    newest of any run on the machine: another run's, on a shared one)."""
    keys = sorted(Path(RUN_WORK[0]).glob(f"run/*/{server}.admin.key"), key=lambda p: p.stat().st_mtime, reverse=True)
    return keys[0].read_text().strip() if keys else None


RUN_WORK: list[str] = [""]


def detokenizer_of(pids: list[int]) -> int | None:
    return next((p for p in pids if R.comm(p) == "sglang::detoken"), None)


def clients(port: int, seconds: float, n: int, body: dict[str, Any]) -> list[threading.Thread]:
    """n clients sending /generate back to back for `seconds` (their answers are not judged)."""
    end = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < end:
            R.call("POST", port, "/generate", body, timeout=max(5.0, end - time.monotonic() + 30))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def long_body(run: HangRun) -> dict[str, Any]:
    """A generation that stays in flight a while: many tokens on the real server (a stand-in
    token is 3 ms: the same count takes as long there)."""
    return {"text": "hello", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}


def no_kill(d: R.Daemon, since: float, process: str | None = None) -> list[str]:
    """The daemon's hang and kill lines since `since`: of `process` only, where named (a server
    beside ones being killed on purpose)."""
    return [e["msg"] for e in d.find(lambda e: e["k"] == "say" and e["f"].get("GPUSUP_EVENT") in ("hang", "unhealthy")
                                     and (process is None or e["f"].get("GPUSUP_PROCESS") == process), since)]


# ============================================================================ busy cases

def busy_first_start(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon) -> None:
    run.start_and_ready(d, c, m, R.SERVER_PORT, timeout=run.args.start_estimate * 3)
    ready = d.find(lambda e: e["k"] == "ev" and e["kind"] == "instance" and e["state"] == "ready")[0]
    m["spawn_to_ready_s"] = round(ready["t"] - d.started_at, 1)
    c("ready, not killed while loading and capturing", not no_kill(d, 0) and not d.says("restart"), no_kill(d, 0))


def busy_pause(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon,
               server: str = "server", port: int = R.SERVER_PORT) -> None:
    key = admin_key(server)
    main, *_ = run.server_pids(d, server)
    since = time.time()
    load = clients(port, 2.0, 2, long_body(run))
    time.sleep(1.0)
    status, body, _ = R.call("POST", port, "/pause_generation", {"mode": run.args.pause_mode}, key=key)
    m["mode"] = run.args.pause_mode
    c("paused", status == 200, (status, body[:200]))
    m["ready_while_paused"] = R.call("GET", port, "/ready", timeout=5)[0]
    time.sleep(run.args.pause_s)
    m["killed"] = no_kill(d, since, server if server != "server" else None)
    m["paused_s"] = round(time.time() - since - 1.0, 1)
    status, _, _ = R.call("POST", port, "/continue_generation", {}, key=key)
    c("continued", status == 200, status)
    for t in load:
        t.join(120)
    c(f"paused {run.args.pause_s:g} s with requests held: not killed, same PID",
      not m["killed"] and run.server_pids(d, server)[0] == main, m["killed"])
    status, _, _ = R.call("POST", port, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    c("serves after the continue", status == 200, status)


def beside_port(k: int) -> int:
    """The port of the k-th server beside `server` (1-based): the ten above SERVER_PORT."""
    return R.SERVER_PORT + 10 + k


class PauseBeside(threading.Thread):
    """The pause case on a server beside `server` (--beside), run while the other cases run on
    `server`: the 10-minute pause costs its ten minutes once, not on top of everything else.
    Its checks are recorded here and replayed by a scenario once it ends (a scenario's results
    are written by the main thread only)."""

    def __init__(self, run: HangRun, d: R.Daemon, k: int) -> None:
        super().__init__(daemon=True, name=f"paused{k}")
        self.run_, self.d, self.k = run, d, k
        self.check, self.measured, self.error = R.Check(), {"server": f"paused{k}", "port": beside_port(k)}, ""
        self.began = 0.0

    def run(self) -> None:
        self.began = time.time()
        try:
            busy_pause(self.run_, self.check, self.measured, self.d, f"paused{self.k}", beside_port(self.k))
        except Exception as e:  # replayed as the scenario's failure
            self.error = f"{e.__class__.__name__}: {e}"

    def replay(self, c: R.Check, m: dict[str, Any]) -> None:
        if not self.began:
            raise R.NotRun("not started: the first start failed, or too little budget was left for the pause")
        self.join(max(1.0, self.run_.left() - 15))
        m.update(self.measured)
        for item in self.check.items:
            c(item["check"], item["ok"], item["detail"])
        c("the pause case ended", not self.is_alive() and not self.error, self.error or ("still running" if self.is_alive() else ""))


def busy_slow(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon) -> None:
    key = admin_key()
    main, *_ = run.server_pids(d)
    since = time.time()
    status, _, _ = R.call("POST", R.SERVER_PORT, "/slow_down", {"forward_sleep_time": 2.0}, timeout=30, key=key)
    c("slowed to 2 s per step", status == 200, status)
    load = clients(R.SERVER_PORT, run.args.slow_s, 4, {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    for t in load:
        t.join(run.args.slow_s + 60)
    status, _, _ = R.call("POST", R.SERVER_PORT, "/slow_down", {"forward_sleep_time": None}, timeout=30, key=key)
    m["killed"] = no_kill(d, since)
    c(f"{run.args.slow_s:g} s at 2 s per step under 4 clients: not killed, same PID",
      status == 200 and not m["killed"] and run.server_pids(d)[0] == main, (status, m["killed"]))


def busy_long_prefill(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon) -> None:
    main, *_ = run.server_pids(d)
    since = time.time()
    status, raw, _ = R.call("GET", R.SERVER_PORT, "/server_info", timeout=30)
    try:
        longest = int(json.loads(raw).get("max_req_input_len") or 4000)
    except (ValueError, AttributeError):
        longest = 4000
    longest = min(longest, 1 << 17)
    # ids inside the tiny vocabulary (512): up to 1099 crashed the real server (an embedding gather out of bounds)
    body: dict[str, Any] = {"input_ids": [10 + i % 400 for i in range(longest - 8)],
                            "sampling_params": {"max_new_tokens": 4}}
    if run.mode == "standin":  # the stand-in has no prefill cost: it stands in for a big model's (3 windows)
        body["sampling_params"]["sleep"] = 45.0
    status, raw, took = R.call("POST", R.SERVER_PORT, "/generate", body, timeout=300)
    m["prompt_tokens"], m["generate_s"], m["status"] = longest - 8, round(took, 2), status
    m["killed"] = no_kill(d, since)
    c("the longest prompt it takes: answered, not killed, same PID",
      status == 200 and not m["killed"] and run.server_pids(d)[0] == main, (status, raw[:200], m["killed"]))


def busy_stall_latch(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon) -> None:
    main, sched, _, _ = run.server_pids(d)
    since = time.time()
    os.kill(sched, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        m["health_in_stall"] = R.call("GET", R.SERVER_PORT, "/health", timeout=30)[0]  # SGLANG_HEALTH_CHECK_TIMEOUT 4
        time.sleep(max(0.0, STALL_S - (time.time() - since)))
    finally:
        os.kill(sched, signal.SIGCONT)  # type: ignore[arg-type]
    m["ready_after"] = R.call("GET", R.SERVER_PORT, "/ready", timeout=5)[0]
    time.sleep(20)
    m["health_after"] = R.call("GET", R.SERVER_PORT, "/health", timeout=30)[0]  # what the router's next check does
    m["killed"] = no_kill(d, since)
    c(f"a {STALL_S:g} s stall that latched /ready: not killed, same PID",
      not m["killed"] and run.server_pids(d)[0] == main and m["ready_after"] == 503, m)


# ============================================================================ hang cases

def hang_cases() -> dict[str, Any]:
    """name -> (how to hang it: fn(run, d) -> an undo or None, today's verdict by construction)."""

    def stop(which: str) -> Any:
        def go(run: HangRun, d: R.Daemon) -> Any:
            main, sched, pids, _ = run.server_pids(d)
            pid = {"scheduler": sched, "front end": main, "detokenizer": detokenizer_of(pids)}[which]
            if which == "detokenizer":
                clients(R.SERVER_PORT, 1.0, 2, {"text": "hi", "sampling_params": {"max_new_tokens": 64}})
                time.sleep(0.3)
            os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
            return lambda: _cont(pid)
        return go

    def blocked(run: HangRun, d: R.Daemon) -> Any:
        clients(R.SERVER_PORT, 1.0, 2, long_body(run))
        time.sleep(0.5)
        threading.Thread(target=R.call, args=("POST", R.SERVER_PORT, "/slow_down", {"forward_sleep_time": 1e9}),
                         kwargs={"timeout": 30, "key": admin_key()}, daemon=True).start()
        return None  # nothing wakes it: the /slow_down that would undo it waits on it

    return {"sigstop_detokenizer": (stop("detokenizer"), "never (2026-12-06: 240 s, nothing written)"),
            "sigstop_scheduler": (stop("scheduler"), "300 s (scheduler_timeout)"),
            "sigstop_front_end": (stop("front end"), "90 s (3 x (10 + 20))"),
            "blocked_scheduler": (blocked, "300 s (scheduler_timeout)")}


class SchedulerCpu(threading.Thread):
    """The scheduler's CPU during a hang case, every 2 s: the share of a core over the last 16 s
    (what the verdict compares with its floor) and the busiest threads' ticks (which helper
    threads wake while the scheduler is blocked)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(daemon=True, name="scheduler-cpu")
        self.pid, self.stop, self.samples = pid, threading.Event(), []  # type: ignore[var-annotated]

    @staticmethod
    def _ticks(path: str) -> int | None:
        try:
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            return None

    def run(self) -> None:
        if not self.pid:
            return
        tck = os.sysconf("SC_CLK_TCK")
        history: list[tuple[float, int]] = []
        began = time.monotonic()
        while not self.stop.wait(2.0):
            total = self._ticks(f"/proc/{self.pid}/stat")
            if total is None:
                return
            now = time.monotonic()
            history.append((now, total))
            old = next((h for h in reversed(history) if h[0] <= now - 16), history[0])
            threads = {}
            for task in Path(f"/proc/{self.pid}/task").glob("*"):
                t = self._ticks(str(task / "stat"))
                try:
                    name = (task / "comm").read_text().strip()
                except OSError:
                    name = "?"
                if t:
                    threads[f"{task.name}:{name}"] = t
            top = sorted(threads.items(), key=lambda kv: -kv[1])[:4]
            self.samples.append({"t": round(now - began, 1), "ticks": total,
                                 "share_16s": round((total - old[1]) / tck / max(now - old[0], 1e-9), 4),
                                 "threads": top, "main_io": self._io(f"/proc/{self.pid}/task/{self.pid}/io")})

    @staticmethod
    def _io(path: str) -> dict[str, int] | None:
        """The main thread's I/O counters (rchar, wchar, syscr, syscw): whether a blocked scheduler's
        loop still reads or writes anything (a rule for slow I/O on that thread would rest on it)."""
        try:
            pairs = (line.split(":", 1) for line in Path(path).read_text().splitlines())
            return {k: int(v) for k, v in pairs if k in ("rchar", "wchar", "syscr", "syscw")}
        except (OSError, ValueError):
            return None


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def hang_case(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon, hang: Any) -> None:
    restarts0 = d.process("server").get("restarts") or 0
    main, sched, *_ = run.server_pids(d)
    since = time.time()
    undo = hang(run, d)
    m["ready_after_hang"] = R.call("GET", R.SERVER_PORT, "/ready", timeout=3)[0]
    sampler = SchedulerCpu(sched)
    sampler.start()
    try:
        kill = d.wait_say("unhealthy", 90, since, "server")
    except AssertionError:
        if undo:
            undo()
        raise
    finally:
        sampler.stop.set()
        m["scheduler_cpu"] = sampler.samples
    m["now_s"] = round(kill["t"] - since, 1)
    m["kill_line"] = kill["msg"]
    evidence = d.says("hang", since, "server")
    stacks = d.says("hang-stacks", since, "server")
    m["evidence_line"] = evidence[0]["msg"] if evidence else None
    m["stacks"] = [s["msg"][:4000] for s in stacks]
    c(f"killed within {TARGET_S:g} s", kill["t"] - since <= TARGET_S, m["now_s"])
    c("the evidence line and the stacks at priority 4, before the kill",
      bool(evidence) and bool(stacks) and all(e["prio"] == 4 for e in evidence + stacks)
      and evidence[0]["t"] <= kill["t"] and "Evidence: " in evidence[0]["msg"], m["evidence_line"])
    ready = d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == "server" and e["state"] == "ready",
                   run.args.start_estimate * 2, "server ready again", kill["t"])
    m["kill_to_ready_s"] = round(ready["t"] - kill["t"], 1)
    c("restarted and ready again, a new PID, counted once",
      run.server_pids(d)[0] not in (None, main) and (d.process("server").get("restarts") or 0) == restarts0 + 1,
      m["kill_to_ready_s"])


def today_case(run: HangRun, c: R.Check, m: dict[str, Any], d: R.Daemon, hang: Any) -> None:
    """Today's daemon (hang_window = 0): killed when, or not within --today-s."""
    d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == "server" and e["state"] == "ready",
           run.args.start_estimate * 2, "server ready", 0)
    since = time.time()
    undo = hang(run, d)
    try:
        kill = d.wait_say("unhealthy", run.args.today_s, since, "server")
        m["today"] = f"{kill['t'] - since:.0f} s"
        d.wait(lambda e: e["k"] == "ev" and e["kind"] == "process" and e["p"] == "server" and e["state"] == "ready",
               run.args.start_estimate * 2, "server ready again", kill["t"])
    except AssertionError:
        m["today"] = f"not killed within {run.args.today_s:g} s"
        if undo is not None:
            undo()  # else (the blocked scheduler: nothing wakes it) the daemon's stop ends it: the last case
    c("observed", True, m["today"])


# ============================================================================ the run

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("real", "standin"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=570.0, help="seconds this run may take (the device allows 600)")
    ap.add_argument("--reserve", type=float, default=30.0)
    ap.add_argument("--start-estimate", type=float, default=90.0, help="seconds one server start may take")
    ap.add_argument("--pause-s", type=float, default=60.0, help="the pause case's length (the issue's: 600)")
    ap.add_argument("--slow-s", type=float, default=30.0, help="the slowed case's length under load")
    ap.add_argument("--busy-runs", type=int, default=1, help="rounds of the busy cases (the issue's: 20)")
    ap.add_argument("--today-s", type=float, default=0.0, help="also measure today's daemon, up to this long a case")
    ap.add_argument("--sgl", default=str(R.SGL))
    ap.add_argument("--unpack", default="/tmp/sgl")
    ap.add_argument("--work", default=None)
    ap.add_argument("--python", default=None)
    ap.add_argument("--standin-startup", type=float, default=10.0)
    ap.add_argument("--skip", default="", help="busy cases to leave out, comma-separated (pause,slow,long_prefill,stall_latch)")
    ap.add_argument("--hangs", default="", help="the hang cases to run, comma-separated (default: all four)")
    ap.add_argument("--pause-mode", default="in_place", choices=("in_place", "retract"),
                    help="the pause case's /pause_generation mode: in_place keeps the running batch, which SGLang's "
                         "own watchdog ends after --watchdog-timeout (300-450 s); retract holds the requests queued")
    ap.add_argument("--beside", type=int, default=0, choices=range(0, 7), metavar="N",
                    help="N more servers on GPU 0 (share_gpus), each paused for --pause-s while every other case runs "
                         "on `server`: the pause beside the rest instead of before it (N pause runs; none on `server`)")
    ap.add_argument("--pause-runs", type=int, default=None,
                    help="rounds that hold the pause case (the first N; default: every round): a 10-minute pause once, the short busy cases --busy-runs times")
    return ap


def work_dir(args: argparse.Namespace) -> str:
    """The run's work directory: --work, else one per mode (a detached run's logs are read there too)."""
    return str(args.work or f"/tmp/rsg-hang-{args.mode}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.group, args.code, args.router, args.only = "hang", "tree", "standin", set()
    args.work = work_dir(args)
    run = HangRun(args)
    RUN_WORK[0] = str(run.work)
    try:
        run.setup()
    except Exception as e:
        run.results["setup"]["error"] = traceback.format_exc()[-4000:]
        run.save()
        print(f"set-up failed: {e}", flush=True)
        return 2
    cases = hang_cases()
    table: list[dict[str, Any]] = []
    today: dict[str, str] = {}
    try:
        if args.today_s > 0:
            old = R.Daemon(run, OLD_PROFILE, "today")
            for name, (hang, _) in cases.items():
                m = run.scenario(f"today_{name}", f"today's daemon: {name}", args.today_s + 15,
                                 lambda c, m, h=hang: (today_case(run, c, m, old, h), m)[1])
                if m and m.get("today"):
                    today[name] = m["today"]
            old.stop(60)
        d = R.Daemon(run, PROFILE, "hang")

        def serving_again(within: float) -> None:
            """Each case starts from a serving server: one that crashed in the case before (a crash
            restart by the daemon) is waited for, so its failure does not become the next case's.
            A /ready latched 503 by a /health that failed in the case before (during the pause) is
            cleared only by a /health that succeeds, which a router's next check would send: one is
            sent here (without it the next case waited `within` s, 180 s, for nothing)."""
            until = time.time() + within
            while time.time() < until and R.call("GET", R.SERVER_PORT, "/ready", timeout=5)[0] != 200:
                R.call("GET", R.SERVER_PORT, "/health", timeout=30)
                time.sleep(1)
        run.scenario("busy_first_start", "first start with CUDA-graph capture", args.start_estimate * (3 + args.beside),
                     lambda c, m: busy_first_start(run, c, m, d))
        beside = [PauseBeside(run, d, k) for k in range(1, args.beside + 1)]
        if beside and run.results["scenarios"]["busy_first_start"]["result"] == "PASS":
            if run.left() < args.pause_s + 60 + args.reserve:
                beside = []  # their scenarios below say NOT RUN (budget)
            for t in beside:
                t.start()
            time.sleep(3.0)  # each has paused before `server`'s first case (their load and pause take ~1 s)
        for i in range(args.busy_runs):
            for key, fn, est in (("pause", busy_pause, args.pause_s + 10), ("slow", busy_slow, args.slow_s + 30),
                                 ("long_prefill", busy_long_prefill, 60), ("stall_latch", busy_stall_latch, 35)):
                if key in args.skip.split(","):
                    continue
                if key == "pause" and (args.beside or args.pause_runs is not None and i >= args.pause_runs):
                    continue
                serving_again(args.start_estimate * 2)
                run.scenario(f"busy_{key}_{i + 1}", f"busy: {key} (round {i + 1})", est,
                             lambda c, m, fn=fn: fn(run, c, m, d))
        for name, (hang, _) in cases.items():
            if args.hangs and name not in args.hangs.split(","):
                continue
            serving_again(args.start_estimate * 2)
            run.scenario(f"hang_{name}", f"hang: {name}", TARGET_S + args.start_estimate,
                         lambda c, m, h=hang: hang_case(run, c, m, d, h))
        for t in beside or [PauseBeside(run, d, k) for k in range(1, args.beside + 1)]:
            left = max(0.0, t.began + args.pause_s - time.time()) if t.began else args.pause_s
            run.scenario(f"busy_pause_beside_{t.k}", f"busy: pause of paused{t.k} (port {beside_port(t.k)}) beside the cases above",
                         left + 30, lambda c, m, t=t: t.replay(c, m))
        run.args.reserve = 0
        d.stop(60)
    finally:
        scen = run.results["scenarios"]
        for name, (_, by_construction) in cases.items():
            got = scen.get(f"hang_{name}", {})
            now = got.get("measured", {}).get("now_s")
            measured = f"{today[name]}; " if name in today else ""
            table.append({"case": name, "today": f"{measured}{by_construction} by construction",
                          "now": f"{now:g} s" if now is not None else got.get("result", "NOT RUN"),
                          "bound": f"{TARGET_S:g} s", "result": got.get("result", "NOT RUN")})
        busy = {k: v.get("result", "NOT RUN") for k, v in scen.items() if k.startswith("busy_")}
        for key in ("first_start", "pause", "slow", "long_prefill", "stall_latch"):
            runs = [r for k, r in busy.items() if k == f"busy_{key}" or k.startswith(f"busy_{key}_")]
            table.append({"case": f"busy: {key}", "today": "not killed", "bound": "0 kills",
                          "now": f"{runs.count('PASS')}/{len(runs)} runs not killed" if runs else "NOT RUN",
                          "result": "PASS" if runs and all(r == "PASS" for r in runs) else "FAIL" if runs else "NOT RUN"})
        run.results["table"] = table
        code = run.finish()
    print("\n| case | today | now | bound |\n|---|---|---|---|")
    for row in table:
        print(f"| {row['case']} | {row['today']} | {row['now']} | {row['bound']} |")
    return code


if __name__ == "__main__":
    sys.exit(longrun.dispatch(sys.argv[1:], main, parser, work_dir))
