"""Hung or busy: a verdict that fuses what a server's processes do with what it answers.

Why: LivenessWatch (engine/liveness.py) kills only on silence, so a SIGSTOPped front end lives
90 s (failures x (interval + timeout)), a blocked scheduler 300 s (SGLang's own watchdog), and
a stopped detokenizer forever: every /generate hangs while /ready stays 200 and /server_info
answers (seen on the real SGLang 0.5.23, shared/reference/real-sglang-on-h200.md). A false
kill costs a cold start (90 s to 20 min), so "hung" needs evidence that the pipeline cannot
move, not merely that it is slow. What each signal means on SGLang 0.5.23:

* A process's state in /proc (`T`/`t`: stopped by a signal or a tracer). A stopped stage
  stops the pipeline whatever the rest does: requests wait on it. SGLang never stops its
  own processes; a stop of `window` seconds is someone's SIGSTOP (or a debugger left attached).
* CPU time per process, by role (sglang/server_metrics.role_of). A real scheduler polls its
  sockets without sleeping (100 % of a core) when idle, while paused and while it works; it
  spends none only when stopped or blocked (a `/slow_down` sleep, a lock, a syscall). The
  detokenizer and an idle front end sleep in recv, so their CPU says little by itself.
  A process in `R` or `D` (running, or in I/O) at a sample is working, and so is one whose
  main thread made a read call over the window (syscr of /proc/PID/task/PID/io): a scheduler
  loop that waits on a slow download (TLS reads through read(2)) sleeps in `S` between reads,
  with next to no CPU, while a blocked or stopped loop reads nothing. Writes do not count: a
  loop stuck retrying still logs. Nor do recv(2) calls, which the kernel does not count.
* NVML utilization of its GPUs, where there is NVML: a forward pass (a long prefill, a slow
  collective) keeps it up while the scheduler's CPU may look quiet.
* Our own requests that wait: a `/server_info` (the scheduler answers it between two batches,
  also while generation is paused) or a `/metrics` (the front end answers it) sent and not
  answered. Work waits on the stage that does not answer, and it is our own work: no user
  request needs to be in flight, and an idle server answers at once.
* `/metrics` (with `--enable-metrics`): progress is its token and request counters moving;
  requests in flight are its running and queued gauges. A body that does not parse is no
  evidence (one line in the verdict's evidence), and metrics never kill by themselves.

Verdicts (each condition must hold at every sample for `window` seconds):

* **stopped**: a front end, scheduler, detokenizer or dp controller in state T: hung;
* **scheduler blocked**: work waits on the scheduler (our /server_info unanswered since the
  window began; where the scheduler refuses us, 401 under `--api-key`, the metrics' requests
  in flight while /ready said 200), no progress, no scheduler or detokenizer that worked (CPU
  under `cpu_floor`, its main thread under `main_cpu_floor` and without a read call),
  none of them running, and no GPU utilization above `gpu_floor`: hung;
* **front end wedged**: our request to the front end unanswered since the window began, the
  front end did not work (the same floors), not running, no progress: hung;
* anything else is busy or idle, and left alone.

Never hung by construction: a pause (/ready 503; the scheduler answers /server_info and
spins), a scheduler slowed to seconds per step (it answers between steps), a long prefill
(GPU busy, or answers between chunks), a short stall (shorter than the window), a start
(the watch runs only after ready). A flood of /server_info from anyone delays our answer but
makes the scheduler work: busy. We send no /health.

Pure: observations in, verdicts out; the clock is the observations'. engine/process.py samples.
"""

from __future__ import annotations

import collections

from ..records import dataclass
from ..sglang.server_metrics import ServerMetrics

#: roles whose stop stops the pipeline (sglang/server_metrics.role_of)
JUDGED_ROLES = ("front end", "scheduler", "detokenizer", "dp controller")
#: roles whose CPU time is the server's work (the front end's also pays for our own probes).
#: Not the dp controller (dp_size > 1): 0.5.23's polls the tokenizer's socket with zmq.NOBLOCK
#: in a loop without a sleep (data_parallel_controller.py, event_loop), a full core whatever
#: its schedulers do; counted, it would spare every blocked scheduler behind it.
WORKERS = ("scheduler", "detokenizer")
STOPPED_STATES = "Tt"
WORKING_STATES = "RD"
#: A process did work over the window when it spent this share of one core or more: a real
#: scheduler spins at ~100 %, while a blocked one spends what its helper threads' wake-ups cost.
#: On the real SGLang 0.5.23 (H100) that was 0.75 % and 0.94 % of a core (0.12 s and 0.15 s over
#: 16 s), and once enough over 1 % (the only floor until 2026-12-07) to be called working for 2
#: minutes: this floor sits between the two by a factor of ten each way ...
CPU_FLOOR = 0.10
#: ... or when its main thread alone spent this share: SGLang's scheduler runs its loop there, and
#: work the loop does slowly (a LoRA adapter or weights downloaded on that thread: a few per cent
#: of a core, the GPU idle) shows there, while a blocked main thread spends nothing. Where the
#: main thread cannot be read, this floor applies to the whole process (the rule until 2026-12-07).
MAIN_CPU_FLOOR = 0.01
#: NVML utilization (percent of time a kernel ran) at or above this at any sample: the GPU works
GPU_FLOOR = 5.0
#: A scheduler that neither answers nor works but for its main thread's reads is left running
#: (a slow download); after this many windows of it, one line says so (`hang-spared`): a peer
#: that trickles bytes into such a download could otherwise hold requests for ever unseen.
READS_NOTE_WINDOWS = 4


@dataclass(frozen=True)
class ProcSample:
    """One process of the server's cgroup at one look (/proc/PID/stat)."""

    pid: int
    role: str  # sglang/server_metrics.role_of; "" for a process not judged
    state: str  # the state letter ("R", "S", "D", "T", ...); "" when unreadable
    cpu_ticks: int | None  # utime + stime in clock ticks; None when unreadable
    main_ticks: int | None = None  # the same of its main thread alone; None when unreadable
    main_reads: int | None = None  # read calls its main thread made (syscr); None when unreadable


@dataclass(frozen=True)
class Observation:
    """What one look saw. `*_waiting_since`: when our request still unanswered was sent (None:
    nothing of ours is waiting there)."""

    at: float
    processes: tuple[ProcSample, ...]
    metrics: ServerMetrics | None = None
    metrics_error: str = ""  # why this look's /metrics is no evidence ("" when fine or absent)
    gpu_util: float | None = None  # the highest utilization of its GPUs, None without NVML
    scheduler_waiting_since: float | None = None
    scheduler_refused: bool = False  # /server_info answered 401/403: the scheduler cannot be asked
    front_waiting_since: float | None = None
    serving: bool | None = None  # the last /ready: True 200, False 503, None not known


@dataclass(frozen=True)
class HangVerdict:
    kill: str = ""  # "" = leave it running; else why, in our words
    evidence: str = ""  # one line: what the window saw (for the journal, kill or not)
    pids: tuple[int, ...] = ()  # the hung processes (whose stacks are dumped before the kill)
    note: str = ""  # not hung, but worth one line: what alone keeps it from the verdict


class HangWatch:
    """The hang decisions of one ready server, fed one Observation per look."""

    def __init__(self, window_s: float, clk_tck: int = 100, cpu_floor: float = CPU_FLOOR,
                 gpu_floor: float = GPU_FLOOR, main_cpu_floor: float = MAIN_CPU_FLOOR) -> None:
        self.window_s = window_s
        self.clk_tck = clk_tck
        self.cpu_floor = cpu_floor
        self.main_cpu_floor = main_cpu_floor
        self.gpu_floor = gpu_floor
        self.stopped_since: dict[int, float] = {}
        self.history: collections.deque[Observation] = collections.deque()
        self.reading_since: float | None = None  # since when only its main thread's reads spare it
        self.reading_noted = False  # the line of this episode is written

    def observe(self, obs: Observation) -> HangVerdict:
        self._remember(obs)
        first = self._window_start(obs.at)
        for p in obs.processes:
            if p.role in JUDGED_ROLES and p.state and p.state in STOPPED_STATES:
                since = self.stopped_since.setdefault(p.pid, obs.at)
                if obs.at - since >= self.window_s:
                    return HangVerdict(
                        kill=f"its {p.role} (pid {p.pid}) has been stopped (state {p.state}) for "
                             f"{obs.at - since:.0f} s (hang_window {self.window_s:g} s)",
                        evidence=self.evidence(first or obs, obs), pids=(p.pid,))
            else:
                self.stopped_since.pop(p.pid, None)
        if first is None:
            return HangVerdict()
        window = [o for o in self.history if o.at >= first.at]
        scheduler = self._scheduler_judgement(first, obs, window)
        if scheduler == "hung":
            schedulers = tuple(p.pid for p in obs.processes if p.role == "scheduler")
            return HangVerdict(kill=f"its scheduler neither answered nor worked for {obs.at - first.at:.0f} s "
                                    f"(hang_window {self.window_s:g} s)",
                               evidence=self.evidence(first, obs), pids=schedulers)
        if self._front_wedged(first, obs, window):
            front = tuple(p.pid for p in obs.processes if p.role == "front end")
            return HangVerdict(kill=f"its front end neither answered nor worked for {obs.at - first.at:.0f} s "
                                    f"(hang_window {self.window_s:g} s)",
                               evidence=self.evidence(first, obs), pids=front)
        note = self._reading_note(scheduler == "reading", first, obs)
        return HangVerdict(note=note, evidence=self.evidence(first, obs)) if note else HangVerdict()

    # ------------------------------------------------------------------ the rules

    def _scheduler_judgement(self, first: Observation, now: Observation, window: list[Observation]) -> str:
        """"hung"; "reading" (it would be, but for its main thread's reads); "" (it answers or works)."""
        if not any(p.role == "scheduler" for p in now.processes):
            return ""
        asked = now.scheduler_waiting_since is not None and now.scheduler_waiting_since <= first.at
        # the metrics' requests in flight count only where the scheduler cannot be asked, and
        # only while /ready said 200: a paused server holds its requests by design
        held = now.scheduler_refused and all(
            o.serving is True and o.metrics is not None and (o.metrics.in_flight or 0) > 0 for o in window)
        if not (asked or held) or self._progressed(first, now):
            return ""
        work = self._work(first, now, window, WORKERS, gpu=True)
        return {"": "hung", "reads": "reading"}.get(work, "")

    def _reading_note(self, reading: bool, first: Observation, now: Observation) -> str:
        """One line per episode, once only its main thread's reads have kept a scheduler that
        neither answers nor works from the verdict for READS_NOTE_WINDOWS windows."""
        if not reading:
            self.reading_since, self.reading_noted = None, False
            return ""
        if self.reading_since is None:
            self.reading_since = first.at  # the condition held over the whole window
        if self.reading_noted or now.at - self.reading_since < READS_NOTE_WINDOWS * self.window_s:
            return ""
        self.reading_noted = True
        return (f"its scheduler has neither answered nor worked for {now.at - self.reading_since:.0f} s but for its "
                f"main thread's reads (a slow download, or a peer that trickles bytes into one): left running; "
                f"it is hung once they stop for hang_window {self.window_s:g} s")

    def _front_wedged(self, first: Observation, now: Observation, window: list[Observation]) -> bool:
        if now.front_waiting_since is None or now.front_waiting_since > first.at:
            return False
        return not self._progressed(first, now) and not self._work(first, now, window, ("front end",), gpu=False)

    def _progressed(self, first: Observation, now: Observation) -> bool:
        """Tokens out or requests completed between the two looks (unknown counts as none:
        progress can only spare a server, never condemn one)."""
        if first.metrics is None or now.metrics is None:
            return False
        return any(b is not None and a is not None and b != a
                   for a, b in zip(first.metrics.progress, now.metrics.progress, strict=True))

    def _work(self, first: Observation, now: Observation, window: list[Observation], roles: tuple[str, ...],
              gpu: bool) -> str:
        """Did any process of these roles (or, with `gpu`, its GPUs) do work over the window?
        "work"; "reads" when nothing but a main thread's reads did; "" for none. A process we
        cannot compare (new, gone, unreadable) counts as working: no evidence."""
        before = {p.pid: p for p in first.processes if p.role in roles}
        after = [p for p in now.processes if p.role in roles]
        read = False
        span = max(now.at - first.at, 1e-9)
        for p in after:
            old = before.get(p.pid)
            if old is None or old.cpu_ticks is None or p.cpu_ticks is None:
                return "work"
            share = (p.cpu_ticks - old.cpu_ticks) / self.clk_tck / span
            if share >= self.cpu_floor:
                return "work"
            if old.main_ticks is None or p.main_ticks is None:
                if share >= self.main_cpu_floor:  # where its work ran is not known: any of it counts
                    return "work"
            elif (p.main_ticks - old.main_ticks) / self.clk_tck / span >= self.main_cpu_floor:
                return "work"
            if old.main_reads is not None and p.main_reads is not None and p.main_reads > old.main_reads:
                read = True  # its loop reads (a slow download): waiting on I/O, not blocked
        if any(p.role in roles and p.state and p.state in WORKING_STATES for o in window for p in o.processes):
            return "work"
        if gpu and any(o.gpu_util is not None and o.gpu_util >= self.gpu_floor for o in window):
            return "work"
        return "reads" if read else ""

    # ------------------------------------------------------------------ bookkeeping

    def _remember(self, obs: Observation) -> None:
        """Keep the looks of the last window, and the latest one before it (its start)."""
        self.history.append(obs)
        while len(self.history) >= 2 and self.history[1].at <= obs.at - self.window_s:
            self.history.popleft()
        alive = {p.pid for p in obs.processes}
        for pid in [pid for pid in self.stopped_since if pid not in alive]:
            del self.stopped_since[pid]

    def _window_start(self, now: float) -> Observation | None:
        """The latest look at least `window` ago; None while the watch is younger than that."""
        first = self.history[0]
        return first if first.at <= now - self.window_s else None

    def evidence(self, first: Observation, now: Observation) -> str:
        """One line: each process (role, pid, state, CPU over the window), metrics, GPU, waits."""
        span = max(now.at - first.at, 1e-9)
        before = {p.pid: p for p in first.processes}
        procs = []
        for p in now.processes:
            if not p.role:
                continue
            was = before.get(p.pid)
            old = was.cpu_ticks if was is not None else None
            cpu = (f"{(p.cpu_ticks - old) / self.clk_tck:.2f} s CPU" if old is not None and p.cpu_ticks is not None
                   else "CPU unknown")
            if was is not None and was.main_ticks is not None and p.main_ticks is not None:
                calls = ("" if was.main_reads is None or p.main_reads is None
                         else f", {p.main_reads - was.main_reads} reads" if p.main_reads >= was.main_reads
                         else ", its read count reset")
                cpu += f" ({(p.main_ticks - was.main_ticks) / self.clk_tck:.2f} s its main thread{calls})"
            procs.append(f"{p.role} {p.pid} state {p.state or '?'} {cpu}")
        parts = [f"over {span:.0f} s: " + ", ".join(procs)]
        m = now.metrics
        if now.metrics_error:
            parts.append(f"metrics: no evidence ({now.metrics_error})")
        elif m is not None:
            moved = "moved" if self._progressed(first, now) else "flat"
            parts.append(f"metrics: {_n(m.in_flight)} in flight, tokens {_n(m.generation_tokens)} "
                         f"and requests {_n(m.requests)} {moved}")
        else:
            parts.append("metrics: none")
        utils = [o.gpu_util for o in self.history if o.at >= first.at and o.gpu_util is not None]
        parts.append(f"GPU: max {max(utils):.0f} %" if utils else "GPU: not read")
        for what, since in (("/server_info", now.scheduler_waiting_since), ("front end", now.front_waiting_since)):
            parts.append(f"{what}: unanswered for {now.at - since:.0f} s" if since is not None else f"{what}: answered")
        if now.scheduler_refused:
            parts.append("/server_info refused (API key)")
        parts.append({True: "/ready 200", False: "/ready 503", None: "/ready not known"}[now.serving])
        return "; ".join(parts)


def _n(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"
