"""The hang verdict as a pure rule, against a clock (no processes): every hang case is called
hung within its window, every busy case never (engine/hang.py says what each signal means).

The looks come every 2 s with a 15 s window, the shipped defaults. A real scheduler spins
(100 % of a core: 200 ticks per 2 s), a blocked or stopped one spends nothing.
"""

from __future__ import annotations

import re
from supervisord_gpu.engine.hang import HangWatch, Observation, ProcSample
from supervisord_gpu.sglang import server_metrics
from supervisord_gpu.sglang.server_metrics import MetricsError, ServerMetrics

WINDOW, STEP = 15.0, 2.0
FRONT, SCHED, DETOK, DP = 100, 101, 102, 103
ROLES = {FRONT: "front end", SCHED: "scheduler", DETOK: "detokenizer", DP: "dp controller"}


class Server:
    """A fake server's processes, advanced look by look; with `dp`, a dp controller too (SGLang
    starts one for dp_size > 1), spinning as 0.5.23's does."""

    def __init__(self, dp: bool = False) -> None:
        pids = (FRONT, SCHED, DETOK) + ((DP,) if dp else ())
        self.ticks = dict.fromkeys(pids, 0)
        self.state = {FRONT: "S", SCHED: "R", DETOK: "S", DP: "R"}
        self.rate = {FRONT: 1, SCHED: 200, DETOK: 0, DP: 200}  # ticks per look
        self.rate = {pid: self.rate[pid] for pid in pids}
        #: of those, its main thread's per look (None: the main thread is not read)
        self.main_rate: dict[int, int | None] = dict.fromkeys(pids)
        self.main_ticks = dict.fromkeys(pids, 0)
        #: read calls of its main thread per look (None: /proc/PID/task/PID/io not read)
        self.read_rate: dict[int, int | None] = dict.fromkeys(pids)
        self.reads = dict.fromkeys(pids, 0)
        self.tokens = 0.0

    def look(self, at: float, **kw) -> Observation:  # type: ignore[no-untyped-def]
        for pid, rate in self.rate.items():
            if self.state[pid] not in "Tt":
                self.ticks[pid] += rate
                self.main_ticks[pid] += self.main_rate[pid] or 0
                self.reads[pid] += self.read_rate[pid] or 0
        roles = {pid: ROLES[pid] for pid in self.rate}
        procs = tuple(ProcSample(pid, roles[pid], self.state[pid], self.ticks[pid],
                                 None if self.main_rate[pid] is None else self.main_ticks[pid],
                                 None if self.read_rate[pid] is None else self.reads[pid]) for pid in roles)
        kw.setdefault("metrics", ServerMetrics(running=0, queued=0, generation_tokens=self.tokens, requests=0))
        kw.setdefault("serving", True)
        return Observation(at=at, processes=procs, **kw)


def run(server: Server, seconds: float, watch: HangWatch | None = None, start: float = 0.0, **kw):  # type: ignore[no-untyped-def]
    """Looks every STEP for `seconds`; (the time of the first kill or None, the verdict)."""
    watch = watch or HangWatch(WINDOW)
    t = start
    while t < start + seconds:
        t += STEP
        extra = {k: (v(t) if callable(v) else v) for k, v in kw.items()}
        verdict = watch.observe(server.look(t, **extra))
        if verdict.kill:
            return t, verdict
    return None, None


def test_a_sigstopped_detokenizer_is_hung_within_the_window_while_the_rest_answers_and_works():
    s = Server()
    s.state[DETOK] = "T"
    at, verdict = run(s, 60)
    assert at is not None and at <= WINDOW + 2 * STEP, at
    assert verdict.pids == (DETOK,) and "its detokenizer (pid 102) has been stopped (state T)" in verdict.kill
    assert "detokenizer 102 state T 0.00 s CPU" in verdict.evidence and "\n" not in verdict.evidence


def test_a_sigstopped_scheduler_or_front_end_is_hung_even_while_ready_says_503():
    for pid in (SCHED, FRONT):
        s = Server()
        s.state[pid] = "T"
        at, verdict = run(s, 60, serving=False)  # behind a router, its failed /health latches /ready
        assert at is not None and at <= WINDOW + 2 * STEP and verdict.pids == (pid,)


def test_a_stop_shorter_than_the_window_is_not_a_hang():
    s, watch = Server(), HangWatch(WINDOW)
    s.state[SCHED] = "T"
    assert run(s, 12, watch)[0] is None  # a 12 s stall (a debugger, a 6 s latch) ...
    s.state[SCHED] = "R"
    assert run(s, 600, watch, start=12)[0] is None  # ... then it runs again


def test_a_scheduler_blocked_with_our_request_waiting_is_hung_within_the_window():
    s = Server()
    s.rate[SCHED], s.state[SCHED] = 0, "S"  # /slow_down with an unbounded sleep
    at, verdict = run(s, 60, scheduler_waiting_since=0.5)
    assert at is not None and at <= WINDOW + 2 * STEP, at
    assert "its scheduler neither answered nor worked" in verdict.kill and verdict.pids == (SCHED,)
    assert "/server_info: unanswered for" in verdict.evidence


def test_a_blocked_scheduler_is_hung_while_the_dp_controller_spins_and_a_stopped_one_is_hung_too():
    """SGLang 0.5.23's dp controller (dp_size > 1) polls the tokenizer's socket with
    zmq.NOBLOCK in a loop without a sleep (data_parallel_controller.py, event_loop): a full core
    whatever its schedulers do, so its CPU is no sign that they work."""
    s = Server(dp=True)
    s.rate[SCHED], s.state[SCHED] = 0, "S"
    s.main_rate[DP], s.read_rate[DP] = 200, 0  # all of it on its main thread, recv(2) uncounted
    at, verdict = run(s, 60, scheduler_waiting_since=0.5)
    assert at is not None and at <= WINDOW + 2 * STEP, at
    assert "its scheduler neither answered nor worked" in verdict.kill and verdict.pids == (SCHED,)
    assert "dp controller 103 state R" in verdict.evidence, verdict.evidence
    s = Server(dp=True)
    s.state[DP] = "T"
    at, verdict = run(s, 60)
    assert at is not None and at <= WINDOW + 2 * STEP and verdict.pids == (DP,), (at, verdict)
    s = Server(dp=True)  # one that spins beside a scheduler that spins and answers: left alone
    assert run(s, 120) == (None, None)


def test_a_blocked_scheduler_whose_helper_threads_wake_is_still_hung():
    """The real blocked scheduler spent 0.75-0.94 % of a core in its helper threads (runs 2-3),
    and once over 1 %, which the old floor called work: it lived on, hung, for 2 minutes
    (2026-12-07, H100). Up to a few per cent it is no work."""
    for ticks_per_look in (2, 3, 6, 18):  # 1 %, 1.5 %, 3 %, 9 % of a core at 100 ticks a second
        s = Server()
        s.rate[SCHED], s.main_rate[SCHED], s.state[SCHED] = ticks_per_look, 0, "S"  # its main thread sleeps
        at, verdict = run(s, 60, scheduler_waiting_since=0.5)
        assert at is not None and at <= WINDOW + 2 * STEP, (ticks_per_look, at)
        assert "its scheduler neither answered nor worked" in verdict.kill
        assert "(0.00 s its main thread)" in verdict.evidence, verdict.evidence


def test_a_scheduler_that_works_a_tenth_of_a_core_without_answering_is_busy():
    s = Server()
    s.rate[SCHED], s.main_rate[SCHED], s.state[SCHED] = 20, 0, "S"  # 10 % of a core: work, however slow
    assert run(s, 120, scheduler_waiting_since=0.5)[0] is None


def test_a_main_thread_that_works_slowly_without_answering_is_busy():
    """SGLang loads a LoRA adapter (or weights by model id) on the scheduler's main thread,
    downloading: a few per cent of a core, the GPU idle, /server_info unanswered. Its main
    thread's work spares it; so does any work where the main thread cannot be read."""
    for main_rate in (3, None):  # 1.5 % of a core, on the main thread / not read
        s = Server()
        s.rate[SCHED], s.main_rate[SCHED], s.state[SCHED] = 3, main_rate, "S"
        assert run(s, 120, scheduler_waiting_since=0.5)[0] is None, main_rate


def test_a_main_thread_that_waits_on_a_slow_download_is_busy():
    """A LoRA adapter fetched over a slow link on the scheduler's main thread: it sleeps in recv
    between reads, next to no CPU (under both floors), the GPU idle, /server_info unanswered.
    Its read calls spare it, one every look is enough."""
    s = Server()
    s.rate[SCHED], s.main_rate[SCHED], s.read_rate[SCHED], s.state[SCHED] = 1, 0, 1, "S"
    assert run(s, 120, scheduler_waiting_since=0.5)[0] is None


def test_a_blocked_main_thread_that_reads_nothing_is_hung_and_the_evidence_counts_its_reads():
    """A blocked loop (a sleep, a lock, a stopped thread) makes no read call; helper threads'
    calls are not the main thread's (the counters are per thread)."""
    s = Server()
    s.rate[SCHED], s.main_rate[SCHED], s.read_rate[SCHED], s.state[SCHED] = 2, 0, 0, "S"
    at, verdict = run(s, 60, scheduler_waiting_since=0.5)
    assert at is not None and at <= WINDOW + 2 * STEP, at
    assert "(0.00 s its main thread, 0 reads)" in verdict.evidence, verdict.evidence


def test_a_scheduler_kept_only_by_its_reads_gets_one_line_per_episode():
    """Reads spare it without a time limit (a slow download may take minutes), so a peer that
    trickles bytes into one could hold its requests for ever: after READS_NOTE_WINDOWS windows
    of that, one line (hang-spared) says so, with the evidence; again after it answered between."""
    from supervisord_gpu.engine.hang import READS_NOTE_WINDOWS

    s, watch = Server(), HangWatch(WINDOW)
    s.rate[SCHED], s.main_rate[SCHED], s.read_rate[SCHED], s.state[SCHED] = 1, 0, 1, "S"
    notes = []
    t = 0.0
    while t < 400:
        t += STEP
        answering = 200 <= t < 240  # it answers for a while: the episode ends
        verdict = watch.observe(s.look(t, scheduler_waiting_since=None if answering else 0.5 if t < 200 else 240.5))
        assert not verdict.kill, (t, verdict.kill)
        if verdict.note:
            notes.append((t, verdict.note, verdict.evidence))
    assert len(notes) == 2, [n[0] for n in notes]
    (t1, note, evidence), (t2, _, _) = notes
    lower = READS_NOTE_WINDOWS * WINDOW
    assert lower <= t1 <= lower + WINDOW + 2 * STEP, t1
    assert 240 + lower <= t2 <= 240 + lower + 2 * WINDOW + 2 * STEP, t2
    assert "but for its main thread's reads" in note and "left running" in note, note
    assert re.search(r"scheduler 101 state S [\d.]+ s CPU \(0\.00 s its main thread, [1-9]\d* reads\)", evidence), evidence


def test_a_scheduler_that_spins_and_reads_gets_no_line():
    """Reads are only the last reason: a scheduler that works by CPU is busy, nothing to say."""
    s = Server()
    s.read_rate[SCHED] = 1
    watch = HangWatch(WINDOW)
    t = 0.0
    while t < 300:
        t += STEP
        verdict = watch.observe(s.look(t, scheduler_waiting_since=0.5))
        assert not verdict.kill and not verdict.note, (t, verdict)


def test_reads_that_stop_are_no_work_once_the_window_has_passed_them():
    """A download that stalls for good (the peer went silent, no timeout): its last read ages out
    of the window, and the scheduler is hung one window later."""
    s, watch = Server(), HangWatch(WINDOW)
    s.rate[SCHED], s.main_rate[SCHED], s.read_rate[SCHED], s.state[SCHED] = 1, 0, 1, "S"
    assert run(s, 40, watch, scheduler_waiting_since=0.5)[0] is None
    s.read_rate[SCHED] = 0
    at, _ = run(s, 60, watch, start=40, scheduler_waiting_since=0.5)
    assert at is not None and 40 + WINDOW <= at <= 40 + WINDOW + 2 * STEP, at


def test_main_thread_reads_are_the_main_thread_s_own_reads_and_a_bad_text_is_none():
    """Per thread, and reads only: a helper thread's reads are not the main thread's, and the
    main thread's writes (a loop stuck retrying still logs) do not count."""
    import os
    import threading

    from supervisord_gpu.ownership import procfs

    assert procfs._reads("rchar: 10\nwchar: 2\nsyscr: 7\nsyscw: 3\nread_bytes: 0\n") == 7
    for bad in (None, "", "syscw: 7\n", "syscr: x\nsyscw: 1\n", "garbage", "syscr:\n"):
        assert procfs._reads(bad) is None, bad
    assert procfs.main_thread_reads(2**22 + 12345) is None  # no such process
    me = os.getpid()

    def look() -> int | None:
        """Read from another thread: reading /proc is itself a read call of the reading thread."""
        seen: list[int | None] = []
        reader = threading.Thread(target=lambda: seen.append(procfs.main_thread_reads(me)))
        reader.start()
        reader.join()
        return seen[0]

    r, w = os.pipe()
    try:
        before = look()
        assert isinstance(before, int)
        helper = threading.Thread(target=lambda: [os.read(r, 1) for _ in range(os.write(w, b"x" * 50))])
        helper.start()
        helper.join()
        assert look() == before  # a helper thread's reads are not counted
        for _ in range(20):
            os.write(w, b"log line\n")  # the main thread writes: not counted
        assert look() == before
        os.read(r, 500)
        assert look() == before + 1  # the main thread's read is
    finally:
        os.close(r)
        os.close(w)


def test_a_read_count_that_drops_is_no_work_and_the_evidence_says_it_reset():
    """Only the child can make it drop (an exec from a helper thread, which takes the PID with
    its own counters): no evidence of work, as a CPU count that drops is none."""
    s, watch = Server(), HangWatch(WINDOW)
    s.rate[SCHED], s.main_rate[SCHED], s.read_rate[SCHED], s.state[SCHED] = 2, 0, 0, "S"
    s.reads[SCHED] = 10_000
    t = 0.0
    verdict = None
    while t < 60:
        t += STEP
        if t == 6.0:
            s.reads[SCHED] = 10
        verdict = watch.observe(s.look(t, scheduler_waiting_since=0.5))
        if verdict.kill:
            break
    # killed across the drop (a window that began before it), not only once it aged out
    assert verdict is not None and verdict.kill and t <= WINDOW + 2 * STEP, t
    assert "(0.00 s its main thread, its read count reset)" in verdict.evidence, verdict.evidence


def test_a_spinning_scheduler_that_does_not_answer_us_is_busy_not_hung():
    """A flood of /server_info from anyone delays ours for as long as they like; the scheduler works."""
    assert run(Server(), 600, scheduler_waiting_since=0.5)[0] is None


def test_a_quiet_scheduler_that_answers_between_slow_steps_is_busy():
    s = Server()
    s.rate[SCHED], s.state[SCHED] = 0, "S"  # /slow_down 2 s per step: asleep at every look
    assert run(s, 600, scheduler_waiting_since=lambda t: t - 1.0)[0] is None  # answered within 2 s


def test_gpu_work_or_progress_spares_a_quiet_scheduler():
    s = Server()
    s.rate[SCHED], s.state[SCHED] = 0, "S"
    assert run(s, 600, scheduler_waiting_since=0.5, gpu_util=97.0)[0] is None  # a long forward pass
    s2 = Server()
    s2.rate[SCHED], s2.state[SCHED] = 0, "S"

    def moving(t: float) -> ServerMetrics:
        s2.tokens += 1
        return ServerMetrics(running=1, queued=0, generation_tokens=s2.tokens, requests=0)

    assert run(s2, 600, scheduler_waiting_since=0.5, metrics=moving)[0] is None


def test_a_paused_server_holding_requests_is_never_hung():
    """/pause_generation in place: requests in flight, none progressing, /ready 503 for 10 min;
    the scheduler answers /server_info (and spins on a real server; here it is quiet, the
    harsher case: only the answers speak for it)."""
    s = Server()
    s.rate[SCHED], s.state[SCHED] = 0, "S"
    held = ServerMetrics(running=4, queued=2, generation_tokens=0, requests=0)
    assert run(s, 600, metrics=held, serving=False, scheduler_refused=True)[0] is None
    assert run(s, 600, metrics=held, serving=False, scheduler_waiting_since=lambda t: t - 0.1)[0] is None


def test_under_an_api_key_requests_in_flight_without_progress_stand_for_our_question():
    s = Server()
    s.rate[SCHED], s.state[SCHED] = 0, "S"
    held = ServerMetrics(running=3, queued=0, generation_tokens=7, requests=1)
    at, verdict = run(s, 60, metrics=held, scheduler_refused=True)
    assert at is not None and at <= WINDOW + 2 * STEP and verdict.pids == (SCHED,)


def test_a_wedged_front_end_is_hung_and_a_busy_one_is_not():
    s = Server()
    s.rate[FRONT] = 0
    at, verdict = run(s, 60, front_waiting_since=0.5)
    assert at is not None and at <= WINDOW + 2 * STEP and verdict.pids == (FRONT,)
    busy = Server()
    busy.rate[FRONT] = 200  # tokenizing a huge batch: its CPU moves
    assert run(busy, 600, front_waiting_since=0.5)[0] is None


def test_a_hostile_metrics_body_is_no_evidence_and_kills_nothing():
    bodies = [b"\xff\xfe", b"sglang:num_running_reqs NaN", b"sglang:num_requests_total -4",
              b"sglang:num_queue_reqs{a=\"}\"}", b"x" * (server_metrics.MAX_BODY + 1),
              b"sglang:generation_tokens_total \x1b[2J"]
    for body in bodies:
        try:
            server_metrics.parse(body)
        except MetricsError as e:
            assert "\n" not in str(e) and "\x1b" not in str(e), str(e)
        else:
            raise AssertionError(f"{body[:40]!r} parsed")
    s = Server()  # a server that works, whose /metrics is garbage: left alone
    assert run(s, 600, metrics=None, metrics_error="/metrics line 1: x", scheduler_waiting_since=0.5)[0] is None


def test_the_metrics_of_sglang_are_read_summed_over_labels_with_quotes_and_braces():
    body = (b'# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\n'
            b'sglang:num_running_reqs{model_name="a b}",dp="0"} 3\n'
            b'sglang:num_running_reqs{model_name="a\\"q",dp="1"} 2.0\n'
            b'sglang:generation_tokens_total{model_name="m"} 1234 1700000000\n'
            b'sglang:num_requests_total 7\nother_metric{x="y"} nan\n')
    m = server_metrics.parse(body)
    assert (m.running, m.queued, m.generation_tokens, m.requests) == (5.0, None, 1234.0, 7.0)
    assert m.in_flight == 5.0


def test_sglang_process_titles_name_the_roles():
    assert server_metrics.role_of("sglang::schedul", False) == "scheduler"
    assert server_metrics.role_of("sglang::detoken", False) == "detokenizer"
    assert server_metrics.role_of("anything", True) == "front end"
    assert server_metrics.role_of("python3", False) == ""


def test_a_py_spy_that_hangs_is_killed_at_its_bound_and_the_kill_goes_on(tmp_path):
    """py-spy may wait on a stopped process for ever; the stacks never delay the kill past their bound."""
    import asyncio
    import time

    from supervisord_gpu.engine.hang_sampler import dump_stacks

    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nsleep 60\n")
    fake.chmod(0o755)
    began = time.monotonic()
    text = asyncio.run(dump_stacks(1, 0.5, str(fake)))
    assert time.monotonic() - began < 2.0 and text == "py-spy gave no stacks within 0.5 s", text
    assert asyncio.run(dump_stacks(1, 0.5, str(tmp_path / "none"))).startswith("py-spy did not start")


def test_stacks_from_the_childs_memory_reach_the_journal_printable_and_bounded(tmp_path):
    """The model code names its functions: escape sequences and megabytes of them are cut."""
    import asyncio

    from supervisord_gpu.engine.hang_sampler import STACKS_MAX_BYTES, dump_stacks

    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nprintf 'Thread 7 (idle): \"MainThread\"\\n    evil\\033[2J\\007 (model.py:1)\\n'\n"
                    "head -c 100000 /dev/zero | tr '\\0' x\n")
    fake.chmod(0o755)
    text = asyncio.run(dump_stacks(1, 5.0, str(fake)))
    assert text.startswith('Thread 7 (idle): "MainThread"\n    evil?[2J? (model.py:1)\n'), text[:80]
    assert len(text) <= STACKS_MAX_BYTES + 20 and text.endswith("... (cut)")


def test_an_endless_metrics_body_is_read_no_further_than_its_bound_and_is_no_evidence():
    """The server's /metrics is the child's (and, while it is down, its port holder's) to write."""
    import asyncio

    from supervisord_gpu.engine.probe import request

    async def go() -> tuple[int | None, int, str]:
        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            try:
                for _ in range(4096):  # 256 MiB if read to the end
                    writer.write(b"sglang:num_running_reqs 1\n" * 2520)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            writer.close()

        server = await asyncio.start_server(endless, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            status, body = await request("GET", "127.0.0.1", port, "/metrics", timeout=20,
                                         max_bytes=server_metrics.MAX_BODY)
        try:
            server_metrics.parse(body)
            why = ""
        except MetricsError as e:
            why = str(e)
        return status, len(body), why

    status, size, why = asyncio.run(go())
    assert status == 200 and size <= server_metrics.MAX_BODY + (1 << 16) + 64, size
    assert why == f"/metrics body of more than {server_metrics.MAX_BODY} bytes"
