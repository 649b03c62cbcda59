"""The liveness verdicts and the start deadline as pure rules, against a clock (no processes).

What each SGLang answer means is in supervisord_gpu/engine/liveness.py; these tests pin the
decisions: a 503 from /ready (paused, latched, draining) is never a kill, silence is; a
scheduler silent for scheduler_timeout is; progress moves the start deadline, up to the cap.
"""

from __future__ import annotations

from supervisord_gpu.config.loader import SERVER_PROBE, ROUTER_PROBE
from supervisord_gpu.engine.deadline import StartDeadline
from supervisord_gpu.engine.liveness import LivenessWatch, front_end_alive


def test_a_paused_or_latched_server_answering_503_for_hours_is_never_killed():
    watch = LivenessWatch(SERVER_PROBE, now=0.0)
    t = 0.0
    for _ in range(3 * 3600 // 10):  # three hours of /ready 503, the scheduler answering
        t += 10
        watch.scheduler_answered(t - 1)
        verdict = watch.front(503, t)
        assert verdict.kill == "" and verdict.serving is False
    assert watch.front(200, t + 10).serving is True


def test_a_silent_front_end_is_killed_after_failures_misses_in_a_row_and_a_single_answer_resets_the_count():
    watch = LivenessWatch(SERVER_PROBE, now=0.0)
    assert watch.front(None, 10).kill == ""
    assert watch.front(None, 20).kill == ""
    assert watch.front(503, 30).kill == ""  # it answered: the count starts again
    watch.scheduler_answered(30)
    assert watch.front(None, 40).kill == "" and watch.front(None, 50).kill == ""
    verdict = watch.front(None, 60)
    assert "/ready gave no answer 3 times in a row" in verdict.kill


def test_a_scheduler_that_answers_nothing_for_its_timeout_is_killed_while_the_front_end_answers_200():
    watch = LivenessWatch(SERVER_PROBE, now=0.0)
    timeout = SERVER_PROBE.scheduler_timeout_s
    t = 0.0
    while t + 10 < timeout:
        t += 10
        assert watch.front(200, t).kill == ""
    verdict = watch.front(200, timeout + 1)
    assert "its scheduler answered nothing (/server_info)" in verdict.kill


def test_a_slow_scheduler_that_answers_within_its_timeout_is_left_alone():
    watch = LivenessWatch(SERVER_PROBE, now=0.0)
    for t in range(10, 3000, 10):
        if t % 250 == 0:  # one answer every 250 s, within the 300 s of SGLang's watchdog
            watch.scheduler_answered(t)
        assert watch.front(200, t).kill == "", t


def test_the_router_is_judged_on_liveness_alone_and_only_200_counts_there():
    watch = LivenessWatch(ROUTER_PROBE, now=0.0)
    assert not watch.asks_scheduler
    assert watch.front(200, 1e6).kill == ""  # no scheduler to wait for
    assert not front_end_alive("/liveness", 503)
    assert front_end_alive("/ready", 503) and not front_end_alive("/ready", 500) and not front_end_alive("/ready", None)
    for t in (10, 20):
        watch.front(503, t)
    assert watch.front(503, 30).kill.startswith("/liveness answered 503 3 times")


def test_without_progress_a_start_fails_at_start_timeout():
    rule = StartDeadline(started=100.0, timeout_s=10, stall_s=120, cap_s=14400)
    assert rule.at(None) == 110
    assert rule.why(110, None) == "not ready within its start_timeout of 10 s"


def test_progress_extends_a_start_to_stall_timeout_after_it_up_to_the_cap():
    rule = StartDeadline(started=0.0, timeout_s=10, stall_s=5, cap_s=60)
    assert rule.at(2.0) == 10  # early progress does not shorten start_timeout
    assert rule.at(30.0) == 35  # a bar still moving at 30 s: 5 s more after it
    assert rule.why(35, 30.0) == ("not ready within its start_timeout of 10 s, and no progress for 5 s since "
                                  "(start_stall_timeout 5 s; 35 s in all)")
    assert rule.at(59.0) == 60  # the cap holds, however busy
    assert rule.why(60, 59.0) == "not ready within its start_timeout_max of 60 s"
    assert rule.at(-5.0) == 10  # progress from before this start does not count


def test_a_short_start_timeout_is_also_the_quiet_limit_after_progress():
    rule = StartDeadline(started=0.0, timeout_s=3, stall_s=120, cap_s=14400)  # "fail fast" profiles
    assert rule.at(1.0) == 4 and rule.at(None) == 3
    assert rule.why(4, 1.0).startswith("not ready within its start_timeout of 3 s, and no progress for 3 s")
    assert rule.at(10.0) == 13  # still drawing progress at 10 s: 3 s more
    assert rule.why(13, 10.0).endswith("no progress for 3 s since (start_timeout 3 s; 13 s in all)")


def test_a_scheduler_is_seen_running_by_its_cpu_time_and_a_stopped_one_is_not():
    """Why CPU time: SGLang answers /server_info one at a time, so a flood of them (or a 401 under
    --api-key) can delay our probe on a healthy busy server; a working scheduler always spends CPU."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from supervisord_gpu.engine.process import RanSince

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        ran = RanSince(main_pid=os.getpid())
        assert not ran.since_last([busy.pid])  # the first look only takes note
        time.sleep(0.3)
        assert ran.since_last([os.getpid(), busy.pid])
        os.kill(busy.pid, signal.SIGSTOP)
        time.sleep(0.05)
        ran.since_last([busy.pid])
        time.sleep(0.3)
        assert not ran.since_last([busy.pid]), "a SIGSTOPped process used CPU"
    finally:
        busy.kill()
        busy.wait()


def test_a_strangers_absurd_answers_never_raise_in_the_probes():
    import asyncio
    import socket
    import threading

    from supervisord_gpu.engine.probe import probe, request

    answers = [b"HTTP/1.1 " + b"2" * 5000 + b" OK\r\n\r\n",
               b"HTTP/1.1 200 OK\r\n\r\n" + b'{"healthy_workers": 1e999}',
               b"HTTP/1.1 200 OK\r\n\r\n" + b"[" * 100000,
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 5000 + b"\r\nx\r\n0\r\n\r\n"]
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        for answer in answers * 2:
            conn, _ = srv.accept()
            conn.recv(65536)
            conn.sendall(answer)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()

    async def go() -> list[object]:
        out: list[object] = []
        for _ in answers:
            out.append((await probe("127.0.0.1", port, "/readiness", 5, min_workers=1)).status)
        for _ in answers:
            out.append((await request("GET", "127.0.0.1", port, "/workers"))[0])
        return out

    statuses = asyncio.run(go())
    srv.close()
    assert statuses[0] is None and statuses[1] == 503 and statuses[4] is None, statuses
