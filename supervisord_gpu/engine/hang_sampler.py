"""The looks the hang verdict (engine/hang.py) is fed, and the stacks written before its kill.

Each look: /proc/PID/stat of every process of the server's cgroup (role, state, CPU time; the
main thread's CPU time from /proc/PID/task/PID/stat),
the state of our two requests kept in flight (a `/server_info` the scheduler answers, a
`/metrics` the front end answers, with SGLang's counters when `--enable-metrics` is on),
and NVML utilization of its GPUs where NVML loads. Nothing here decides.

Inputs and their owners: /proc is the kernel's (a comm is the child's choice, so it only
names a role, never an identity: the cgroup is the identity); the HTTP answers are the
child's or, when it is down, the port's holder's (the same peer check as liveness: a
stranger's answer is no answer); the stacks come from py-spy reading the child's memory:
its function and file names are the model code's words, so they are cut to printable text
and bounded in size before the journal gets them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..config.trust import untrusted_program
from ..ownership.procfs import main_thread_reads, main_thread_ticks, read_text, run_state
from ..sglang import server_metrics
from ..sglang.server_metrics import MetricsError, ServerMetrics
from .hang import Observation, ProcSample

Answer = tuple[int | None, bytes]
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: of a process's cmdline, the hang watch reads this much (the title's first 15 bytes name a role)
TITLE_READ_BYTES = 256
#: the stacks in the journal: at most this much of py-spy's output
STACKS_MAX_BYTES = 32 << 10


class KeptInFlight:
    """One request of ours kept in flight: `look()` says since when no answer came (None when
    the last one was answered), and starts the next one when the last has ended."""

    def __init__(self, send: Callable[[], Awaitable[Answer]]) -> None:
        self.send = send
        self.task: asyncio.Future[Answer] | None = None
        self.waiting_since: float | None = None
        self.answer: Answer | None = None  # the latest answer (status not None)

    def look(self, now: float) -> float | None:
        if self.task is not None and self.task.done():
            try:
                status, body = self.task.result()
            except Exception:  # noqa: BLE001  (ours to survive: no answer is what it means)
                status, body = None, b""
            self.task = None
            if status is not None:
                self.waiting_since, self.answer = None, (status, body)
        if self.task is None:
            self.task = asyncio.ensure_future(self.send())
            if self.waiting_since is None:
                self.waiting_since = now
        return self.waiting_since

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class GpuUtilization:
    """NVML utilization (percent) of some GPUs, the highest of them; None where NVML does not
    load or answer (CPU machines, simulated GPUs): then GPU work is simply not evidence."""

    def __init__(self, indices: Iterable[int]) -> None:
        self.indices = list(indices)
        self._nvml: Any = None
        self._handles: list[Any] | None = None if self.indices else []

    def read(self) -> float | None:
        """Blocking (NVML): call it from a thread."""
        if self._handles is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            except Exception:  # noqa: BLE001  (no NVML, no library, no such GPU: no evidence)
                self._handles = []
        if not self._handles:
            return None
        try:
            return float(max(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles))
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        """Blocking (NVML): its nvmlInit is counted, so each one is matched."""
        if self._handles:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []


class HangSampler:
    """Builds one Observation per look for one ready server."""

    def __init__(self, main_pid: int, pids: Callable[[], list[int]], ask_scheduler: Callable[[], Awaitable[Answer]],
                 ask_metrics: Callable[[], Awaitable[Answer]], gpus: GpuUtilization) -> None:
        self.main_pid = main_pid
        self.pids = pids
        self.scheduler = KeptInFlight(ask_scheduler)
        self.front = KeptInFlight(ask_metrics)
        self.gpus = gpus

    def processes(self) -> tuple[ProcSample, ...]:
        out = []
        for pid in self.pids():
            seen = run_state(pid)
            if seen is None:
                continue
            comm, state, ticks = seen
            role = server_metrics.role_of(comm, pid == self.main_pid)
            if not role:  # setproctitle rewrites argv; whether comm follows depends on its version
                # the first bytes only: a child's argv may be megabytes, read every look
                title = (read_text(pid, "cmdline", TITLE_READ_BYTES) or "").split("\0")[0].strip()
                role = server_metrics.role_of(title[:15], False)
            out.append(ProcSample(pid, role, state, ticks, main_thread_ticks(pid), main_thread_reads(pid)))
        return tuple(out)

    async def look(self, serving: bool | None) -> Observation:
        now = time.monotonic()
        procs = await asyncio.to_thread(self.processes)
        util = await asyncio.to_thread(self.gpus.read)
        scheduler_since = self.scheduler.look(now)
        front_since = self.front.look(now)
        metrics, error = self._metrics()
        refused = self.scheduler.answer is not None and self.scheduler.answer[0] in (401, 403)
        return Observation(at=now, processes=procs, metrics=metrics, metrics_error=error, gpu_util=util,
                           scheduler_waiting_since=scheduler_since, scheduler_refused=refused,
                           front_waiting_since=front_since, serving=serving)

    def _metrics(self) -> tuple[ServerMetrics | None, str]:
        """The latest /metrics answer, parsed; (None, "") when there is none (404 without
        --enable-metrics), (None, why) when its body is no evidence."""
        if self.front.answer is None or self.front.answer[0] != 200:
            return None, ""
        try:
            return server_metrics.parse(self.front.answer[1]), ""
        except MetricsError as e:
            return None, str(e)

    def close(self) -> None:
        self.scheduler.cancel()
        self.front.cancel()
        self.gpus.close()


def printable(text: str, limit: int = STACKS_MAX_BYTES) -> str:
    """A child's words for the journal: no control characters but newlines, at most `limit`."""
    clean = "".join(c if c.isprintable() or c == "\n" else "?" for c in text[:limit])
    return clean + ("\n... (cut)" if len(text) > limit else "")


def quoted_lines(text: str) -> str:
    """The stacks as lines of their own, each marked `  | `: a function named with a newline and
    `supervisord-gpu: ...` in it must not read as a line of ours where the output is text
    (the stderr sink of `supervisord-gpu run`), as it does not in the journal."""
    return "\n".join(f"  | {line}" for line in text.split("\n"))


async def dump_stacks(pid: int, timeout: float, py_spy: str | None = None) -> str:
    """`py-spy dump --pid PID`: the stack of every thread, or why there is none. Never longer
    than `timeout`: a py-spy that does not end by then is killed (it may wait on a stopped
    process) and what it printed is dropped. Never more than STACKS_MAX_BYTES read: past it
    py-spy is killed and what it printed is cut."""
    tool = py_spy or shutil.which("py-spy")
    if tool is None:
        return "py-spy not installed"
    if py_spy is None and (why := untrusted_program(tool)):  # root runs it with ptrace on the child
        return f"py-spy not run: {why}"
    try:
        proc = await asyncio.create_subprocess_exec(tool, "dump", "--pid", str(pid), stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
    except OSError as e:
        return f"py-spy did not start ({e.strerror})"
    out = bytearray()
    cut = False
    try:
        async with asyncio.timeout(timeout):
            assert proc.stdout is not None
            # read no further than the journal gets: the stacks are the child's words, and a
            # child can make them as long as it likes (deep recursion, long names, many threads)
            while len(out) <= STACKS_MAX_BYTES and (chunk := await proc.stdout.read(1 << 16)):
                out += chunk
            if len(out) > STACKS_MAX_BYTES:
                cut = True
                _end_py_spy(proc.pid)
            await proc.wait()
    except TimeoutError:
        _end_py_spy(proc.pid)
        await _reap(proc)
        return f"py-spy gave no stacks within {timeout:g} s"
    await _reap(proc)
    text = printable(out.decode(errors="replace"))
    return text if proc.returncode == 0 or cut else f"py-spy failed (exit {proc.returncode}): {text.strip()[:500]}"


def _end_py_spy(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # its own session and group: whatever it started goes too
    except ProcessLookupError:
        pass


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Reaped, its pipe read to the end (at most what the pipe held: its writers are dead) and closed."""
    try:
        await asyncio.wait_for(proc.communicate(), 1.0)
    except TimeoutError:
        pass
