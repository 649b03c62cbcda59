"""Hung or busy, against SGLang's own states (the stand-in copies them): each hang case is
killed within the hang bound and restarted, each busy case is left alone.

Times are scaled by the profile, not mocked: hang_window 4 s (the shipped 15 s), looks every
0.25 s; the old liveness keeps its shipped 90 s and 300 s, so any kill within these tests is
the hang verdict's. The busy cases run under a 2 s window (shorter is harsher for them) and
are scaled with it: a 6 s stall becomes 1.2 s, a 10-minute pause 10 windows, 2 s per step 0.5 s.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest

from supervisord_gpu.engine.states import State
from supervisord_gpu.sglang.router_key import read_key
from support import free_ports, make_instance, stop_process, write_config
from test_liveness_sglang import _hold_up, _until, http, server_info

pytestmark = pytest.mark.slow

WINDOW = 4.0  # the hang cases' window; the busy cases run under a 2 s one (the harsher case for them)
BUSY_WINDOW = 2.0


def profile(port: int, env: dict[str, str] | None = None, window: float = WINDOW, options: str = "") -> str:
    lines = "\n".join(f'{k} = "{v}"' for k, v in (env or {}).items())
    return f"""
        [servers.server]
        gpus = [0]
        port = {port}
        model_path = "/models/test"
        probe = {{ hang_window = {window:g}, hang_interval = 0.25 }}
        [servers.server.options]
        enable-metrics = true
        {options}
        [servers.server.env]
        {lines}
        """


class Journal:
    """The sink the process writes to, recorded (what `journalctl` would show)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.events = inner, []

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        self.events.append((message, priority, fields))
        self.inner.event(message, priority, **fields)

    def child_line(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        self.inner.child_line(*args, **kw)

    def of(self, kind: str) -> list[tuple[str, int]]:
        return [(m, p) for m, p, f in self.events if f.get("GPUSUP_EVENT") == kind]


def in_flight(port: int, seconds: float = 600) -> threading.Thread:
    """A /generate that stays in flight `seconds` of scheduler time (or until the server dies)."""
    t = threading.Thread(target=lambda: _quiet(http, "POST", port, "/generate",
                                              {"text": "hi", "sampling_params": {"sleep": seconds}}, 120), daemon=True)
    t.start()
    return t


def _quiet(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except OSError:
        return None


def setup(tmp_path, cgroups, env: dict[str, str] | None = None, startup: float = 0.3,  # type: ignore[no-untyped-def]
          window: float = WINDOW, options: str = ""):
    (port,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": profile(port, env, window, options)}, cgroups.root, startup=startup)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]
    proc.sink = journal = Journal(proc.sink)
    return port, instance, proc, journal


def killed_after(tmp_path, cgroups, hang) -> tuple[float, str, float, Journal, object]:  # type: ignore[no-untyped-def]
    """Start, call `hang(port, info)` (it hangs the server), and time the kill; then the restart."""
    port, instance, proc, journal = setup(tmp_path, cgroups)

    async def go() -> tuple[float, str, object]:
        await instance.start()
        pid = proc.pid
        info = await asyncio.to_thread(server_info, port)
        info["admin_key"] = read_key(proc.launch.admin_key)  # the admin endpoints are the key holder's alone
        seen = await asyncio.to_thread(hang, port, info)
        began = time.monotonic()
        await _until(lambda: proc.pid != pid or proc.exit_code is not None, 60)
        took = time.monotonic() - began
        await _until(lambda: proc.state == State.READY, 60)
        why = proc.last_exit
        await instance.stop()
        return took, why, seen

    took, why, seen = asyncio.run(go())
    return took, why, proc.spec.probe.hang_bound_s, journal, seen


def test_a_sigstopped_detokenizer_is_killed_within_the_hang_bound_with_its_evidence_and_stacks(tmp_path, cgroups):
    def hang(port: int, info: dict) -> tuple[int, int, bool]:  # type: ignore[type-arg]
        stop_process(info["detokenizer_pid"])
        request = in_flight(port, 0.1)  # a short one: its output never comes back through the detokenizer
        time.sleep(1.0)
        return http("GET", port, "/ready", None, 5), http("GET", port, "/server_info", None, 5), request.is_alive()

    took, why, bound, journal, seen = killed_after(tmp_path, cgroups, hang)
    assert seen == (200, 200, True), "the stand-in did not hang requests with /ready and /server_info up (the real one does)"
    assert took <= bound, f"killed {took:.1f} s after the stop; bound {bound:g} s"
    assert "hung: its detokenizer" in why and "stopped (state T)" in why, why
    (line, priority), = journal.of("hang")
    assert priority == 4 and "Evidence: over" in line and "detokenizer" in line and "state T" in line, line
    (stacks, priority), = journal.of("hang-stacks")
    assert priority == 4 and ("py-spy not installed" in stacks or "Thread" in stacks), stacks


def test_a_sigstopped_scheduler_is_killed_within_the_hang_bound(tmp_path, cgroups):
    took, why, bound, _, _ = killed_after(tmp_path, cgroups, lambda port, info: stop_process(info["scheduler_pids"][0]))
    assert took <= bound and "hung: its scheduler" in why and "stopped" in why, (took, why)


def test_a_sigstopped_front_end_is_killed_within_the_hang_bound_not_the_old_90_s(tmp_path, cgroups):
    took, why, bound, _, _ = killed_after(tmp_path, cgroups, lambda port, info: stop_process(_main_pid(port)))
    assert took <= bound and "hung: its front end" in why, (took, why)


def _main_pid(port: int) -> int:
    """The stand-in's main process: the parent of its scheduler."""
    pid = server_info(port)["scheduler_pids"][0]
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def test_a_scheduler_blocked_with_requests_in_flight_is_killed_within_the_hang_bound(tmp_path, cgroups):
    def hang(port: int, info: dict) -> None:  # type: ignore[type-arg]
        in_flight(port)
        time.sleep(0.3)
        assert http("POST", port, "/slow_down", {"forward_sleep_time": 1e9}, 10, info["admin_key"]) == 200  # the sleep starts now

    took, why, bound, journal, _ = killed_after(tmp_path, cgroups, hang)
    assert took <= bound and "its scheduler neither answered nor worked" in why, (took, why)
    (line, _), = journal.of("hang")
    assert "/server_info: unanswered for" in line and "1 in flight" in line, line
    # its main thread's CPU and reads were read from /proc and were nil: the sleep makes none
    assert re.search(r"scheduler \d+ state S [\d.]+ s CPU \(0\.0\d s its main thread, 0 reads\)", line), line


def test_a_pause_in_place_past_sglangs_own_watchdog_ends_in_sglangs_crash_and_is_restarted(tmp_path, cgroups):
    """The real SGLang (H100, 2026-12-07): paused in place with requests running, its scheduler's
    watchdog ended it 447 s in, and its front end answered nothing through 65 s of crash
    diagnostics; our verdict killed it and it was restarted. Here --watchdog-timeout 2."""
    port, instance, proc, journal = setup(tmp_path, cgroups, {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "60"},
                                          options="watchdog-timeout = 2")

    async def go() -> None:
        await instance.start()
        pid = proc.pid
        key = read_key(proc.launch.admin_key)
        in_flight(port)
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(http, "POST", port, "/pause_generation", {"mode": "in_place"}, key=key) == 200
        await _until(lambda: proc.pid != pid and proc.state == State.READY, 60)
        await instance.stop()

    began = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - began < 60, "killed while SGLang's diagnostics held it, not after its 60 s wait"
    assert proc.restarts_total == 1
    ends = [m for m, _ in journal.of("exit")]
    assert len(ends) == 1 and "Scheduler watchdog timeout" in ends[0], ends


def test_busy_servers_are_left_alone_paused_slowed_long_requests_and_a_stall_that_latches_ready(tmp_path, cgroups):
    window = BUSY_WINDOW
    port, instance, proc, journal = setup(tmp_path, cgroups, {"SGLANG_HEALTH_CHECK_TIMEOUT": "1"},
                                          startup=2 * window, window=window)  # a start longer than the window

    async def go() -> dict[str, object]:
        await instance.start()
        pid = proc.pid
        key = read_key(proc.launch.admin_key)
        seen: dict[str, object] = {}
        # 1. a pause (10 min on the real server: 10 windows here) with requests held in flight
        in_flight(port, 1.0)
        assert await asyncio.to_thread(http, "POST", port, "/pause_generation", {"mode": "in_place"}, key=key) == 200
        seen["paused"] = await asyncio.to_thread(http, "GET", port, "/ready")
        await _hold_up(proc, 10 * window, pid)
        assert await asyncio.to_thread(http, "POST", port, "/continue_generation", {}, key=key) == 200
        # 2. slowed down, 0.5 s per step (2 s against the 15 s window), under load
        assert await asyncio.to_thread(http, "POST", port, "/slow_down", {"forward_sleep_time": 0.5}, key=key) == 200
        load = [in_flight(port, 0.2) for _ in range(4)]
        await _hold_up(proc, 3 * window, pid)
        assert await asyncio.to_thread(http, "POST", port, "/slow_down", {"forward_sleep_time": None}, 30, key) == 200
        for t in load:
            await asyncio.to_thread(t.join, 10)
        seen["slow_load_done"] = not any(t.is_alive() for t in load) or "some still running"
        # 3. a long prefill: one request of 3 windows
        long = in_flight(port, 3 * window)
        await _hold_up(proc, 3 * window + 1, pid)
        long.join(10)
        seen["long_done"] = not long.is_alive()
        # 4. a 6 s stall (1.2 s here) during someone's /health: /ready latched 503, then cleared
        scheduler = (await asyncio.to_thread(server_info, port))["scheduler_pids"][0]
        stop_process(scheduler)
        seen["health_in_stall"] = await asyncio.to_thread(http, "GET", port, "/health")
        await asyncio.sleep(0.2)
        os.kill(scheduler, signal.SIGCONT)
        seen["latched"] = await asyncio.to_thread(http, "GET", port, "/ready")
        await _hold_up(proc, 3 * window, pid)
        await instance.stop()
        return seen

    seen = asyncio.run(go())
    assert seen == {"paused": 503, "slow_load_done": True, "long_done": True, "health_in_stall": 503, "latched": 503}, seen
    assert proc.restarts_total == 0 and not journal.of("hang"), journal.of("hang")


def test_one_scheduler_rank_of_a_tp2_server_stopped_kills_the_whole_server_its_peer_rank_included(tmp_path, cgroups):
    """Issue 40's hung collective: rank 1 of a TP2 server SIGSTOPped while rank 0 waits for it in a
    collective. Every process still looks alive, and the peer's state says nothing (on a GPU it
    spins in NCCL); the stopped rank alone is the evidence, and the kill takes the whole server:
    both ranks, the front end, the detokenizer, and what they held on both GPUs."""
    from support import alive, sim_holders

    (port,) = free_ports(1)
    tp2 = profile(port).replace("gpus = [0]", "gpus = [0, 1]").replace(
        "enable-metrics = true", "enable-metrics = true\n        tp-size = 2")
    cdir = write_config(tmp_path, {"p": tp2}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> tuple[float, str, list[int], list[int], list[int]]:
        await instance.start()
        pid = proc.pid
        ranks = (await asyncio.to_thread(server_info, port))["scheduler_pids"][:2]
        old = proc.spawned.group.pids()
        stop_process(ranks[1])
        began = time.monotonic()
        await _until(lambda: proc.pid != pid or proc.exit_code is not None, 60)
        took = time.monotonic() - began
        await _until(lambda: proc.state == State.READY, 60)
        new = proc.spawned.group.pids()
        why = proc.last_exit
        await instance.stop()
        return took, why, ranks, old, new

    took, why, ranks, old, new = asyncio.run(go())
    assert took <= proc.spec.probe.hang_bound_s, f"killed {took:.1f} s after the stop"
    assert "hung: its scheduler" in why and f"pid {ranks[1]}" in why, why
    assert len(old) == 4 and not [p for p in old if alive(p)], "both ranks, the front end and the detokenizer end"
    assert len(new) == 4 and not set(new) & set(old), "restarted whole: two new ranks"
    assert not set(sim_holders(tmp_path)) & set(old)
