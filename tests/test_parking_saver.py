"""The park with SGLang's memory saver: the KV pool released before the checkpoint, resumed after.

Decisions against fakes (test_parking's FakeCheckpointer and FakeInventory, a fake `post` that
answers as the real server did on the H100 on 2026-12-07 and gives back the pool's bytes on the
fake GPU): the order of the calls, signals and checkpointer calls; what a failure at each step
undoes; the host-memory check against what is left after the release; the restore's fallback.
"""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from supervisord_gpu.controller.parking import Parker
from supervisord_gpu.engine.states import InstanceState
from supervisord_gpu.errors import ParkRefused
from supervisord_gpu.parking import saver
from supervisord_gpu.parking.checkpointer import CheckpointState
from supervisord_gpu.parking.fake import FakeCheckpointer
from test_parking import GIB, FakeInstance, FakeInventory

POOL_MIB = 18 * 1024  # of the scheduler's 20 GiB: what the release frees


class FakeServer:
    """The server's admin endpoints as the real one answered them (200, body null); `fail` makes
    one path answer something else; a release frees the pool on the fake GPU, a resume takes it."""

    def __init__(self, inventory: FakeInventory, events: list[tuple[object, ...]]) -> None:
        self.inventory, self.events = inventory, events
        self.fail: dict[str, tuple[int | None, bytes]] = {}

    async def post(self, server: str, path: str, body: object) -> tuple[int | None, bytes]:
        self.events.append(("post", server, path))
        if path in self.fail:
            return self.fail[path]
        if path == "/release_memory_occupation":
            self.inventory.holders[0][101] -= POOL_MIB
        elif path == "/resume_memory_occupation":
            self.inventory.holders[0][101] += POOL_MIB
        return 200, b"null"


def saver_setup(mem_available: int = 200 * GIB, argv: tuple[str, ...] = ("python3", "-m", "sglang.launch_server",
                                                                          "--enable-memory-saver")
                ) -> tuple[Parker, FakeCheckpointer, FakeInstance, FakeServer, list[tuple[object, ...]], list[str]]:
    events: list[tuple[object, ...]] = []
    ckpt = FakeCheckpointer({101: 20 * GIB})
    inventory = FakeInventory({0: {101: 20 * 1024}}, ckpt)
    inst = FakeInstance("tp1", {"server": [100, 101]}, [0], [30000])
    inst.processes["server"].launch = SimpleNamespace(argv=argv)
    server = FakeServer(inventory, events)
    said: list[str] = []

    def checkpoint(pid: int) -> None:  # what the checkpoint moves: what the GPU holds then
        ckpt.gpu_bytes[pid] = inventory.holders[0][pid] * 1024 * 1024
        real_checkpoint(pid)

    real_checkpoint = ckpt.checkpoint
    ckpt.checkpoint = checkpoint  # type: ignore[method-assign]
    for op in ("lock", "restore", "unlock"):
        real = getattr(ckpt, op)

        def traced(pid: int, *a: Any, op: str = op, real: Any = real) -> Any:
            events.append((op, pid))
            return real(pid, *a)
        setattr(ckpt, op, traced)
    parker = Parker(ckpt, inventory, lambda m, _p: said.append(m), mem_available=lambda: mem_available,
                    kill=lambda pid, sig: events.append(("signal", pid, signal.Signals(sig).name)),
                    saver_post=lambda _inst: server.post)
    return parker, ckpt, inst, server, events, said


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _serves() -> str:
    return ""


async def _not_cold() -> None:
    raise AssertionError("not a cold start")


def test_the_flag_is_read_off_the_servers_command_line() -> None:
    assert saver.uses_saver(["x", "--enable-memory-saver"])
    assert saver.uses_saver(["x", "--enable-memory-saver=true"])
    assert not saver.uses_saver(["x", "--enable-memory-saver=false"])
    assert not saver.uses_saver(["x", "--enable-memory-saver-extra", "--model", "--enable-memory-saver-x"])


def test_paused_and_released_before_the_hold_resumed_and_continued_after_it() -> None:
    """Pause (retract) and release go through the front end, so before its SIGSTOP; the resume
    and continue after its SIGCONT; the checkpoint moves only what the release left."""
    parker, ckpt, inst, _server, events, said = saver_setup()
    record = run(parker.park(inst))
    assert events == [("post", "server", "/pause_generation"), ("post", "server", "/release_memory_occupation"),
                      ("signal", 100, "SIGSTOP"), ("lock", 101)]
    assert record.released == ["server"] and record.to_json()["released"] == ["server"]
    assert record.host_bytes == 2 * GIB, "the pool's 18 GiB stayed out of the checkpoint"
    assert "KV pool released (server)" in record.describe() and "2.1 GB host" in record.describe()
    del events[:]
    assert run(parker.restore(inst, _not_cold, _serves)).serve
    assert events == [("restore", 101), ("unlock", 101), ("signal", 100, "SIGCONT"),
                      ("post", "server", "/resume_memory_occupation"), ("post", "server", "/continue_generation")]


def test_a_server_without_the_saver_gets_no_call_and_is_checkpointed_whole() -> None:
    parker, _ckpt, inst, _server, events, _ = saver_setup(argv=("python3", "-m", "sglang.launch_server"))
    record = run(parker.park(inst))
    assert not [e for e in events if e[0] == "post"]
    assert record.released == [] and record.host_bytes == 20 * GIB


def test_a_release_refused_is_undone_the_pause_continued_and_nothing_checkpointed() -> None:
    parker, ckpt, inst, server, events, _ = saver_setup()
    server.fail["/release_memory_occupation"] = (401, b'{"error":"Unauthorized"}')
    with pytest.raises(ParkRefused) as refused:
        run(parker.park(inst))
    assert "server: POST /release_memory_occupation answered 401" in str(refused.value)
    assert events == [("post", "server", "/pause_generation"), ("post", "server", "/release_memory_occupation"),
                      ("post", "server", "/continue_generation")], "nothing resumed that was not released"
    assert ckpt.states == {} and inst.state == InstanceState.READY


def test_a_checkpoint_failing_after_the_release_resumes_the_pool_once_the_front_end_runs() -> None:
    parker, ckpt, inst, _server, events, _ = saver_setup()
    ckpt.fail.add(("checkpoint", 101))
    with pytest.raises(ParkRefused):
        run(parker.park(inst))
    assert events[-5:] == [("lock", 101), ("unlock", 101), ("signal", 100, "SIGCONT"),
                           ("post", "server", "/resume_memory_occupation"), ("post", "server", "/continue_generation")]
    assert inst.state == InstanceState.READY


def test_host_memory_is_judged_on_what_the_release_left() -> None:
    """20 GiB on the GPU, 8 GiB of host: the whole server would be refused, the 2 GiB left after
    the release fits (with the margin)."""
    parker, _ckpt, inst, _server, _events, _ = saver_setup(mem_available=8 * GIB)
    assert run(parker.park(inst)).host_bytes == 2 * GIB
    parker, _ckpt, inst, _server, _events, _ = saver_setup(mem_available=8 * GIB,
                                                          argv=("python3", "-m", "sglang.launch_server"))
    with pytest.raises(ParkRefused, match="host memory available"):
        run(parker.park(inst))


def test_too_little_host_memory_even_after_the_release_is_refused_and_undone() -> None:
    """5 GiB: the plan passes (a saver's bytes are judged after its release), the 2 GiB left + the
    margin do not fit: refused after the release, which is undone."""
    parker, ckpt, inst, _server, events, _ = saver_setup(mem_available=5 * GIB)
    with pytest.raises(ParkRefused, match="host memory available 5.4 GB, needed 2.1 GB"):
        run(parker.park(inst))
    assert events == [("post", "server", "/pause_generation"), ("post", "server", "/release_memory_occupation"),
                      ("signal", 100, "SIGSTOP"), ("lock", 101), ("unlock", 101), ("signal", 100, "SIGCONT"),
                      ("post", "server", "/resume_memory_occupation"), ("post", "server", "/continue_generation")]
    assert ("checkpoint", 101) not in ckpt.calls and ckpt.states == {101: CheckpointState.RUNNING}


def test_a_server_that_takes_its_pool_back_after_the_release_is_judged_on_what_it_holds_once_locked() -> None:
    """Model code answers the release 200, frees the pool, and allocates it again before the
    lock: the host memory is judged on NVML's reading once every target is locked (a locked
    process allocates nothing), not on the reading after the release (the hostile read's HIGH)."""
    parker, ckpt, inst, server, events, _ = saver_setup(mem_available=7 * GIB)
    real_post = server.post

    async def regrow(name: str, path: str, body: object) -> tuple[int | None, bytes]:
        answer = await real_post(name, path, body)
        if path == "/release_memory_occupation":
            server.inventory.holders[0][101] += POOL_MIB  # taken back at once
        return answer

    parker.saver_post = lambda _inst: regrow
    with pytest.raises(ParkRefused, match="needed 21.5 GB to park"):
        run(parker.park(inst))
    assert ("checkpoint", 101) not in ckpt.calls and inst.state == InstanceState.READY


def test_a_release_without_an_answer_may_have_happened_so_it_is_resumed_then_continued() -> None:
    parker, _ckpt, inst, server, events, _ = saver_setup()
    server.fail["/release_memory_occupation"] = (None, b"timed out")
    with pytest.raises(ParkRefused, match="no answer: timed out"):
        run(parker.park(inst))
    assert [e[2] for e in events if e[0] == "post"] == ["/pause_generation", "/release_memory_occupation",
                                                        "/resume_memory_occupation", "/continue_generation"]


def test_a_resume_that_fails_in_the_undo_is_not_continued_and_the_server_is_restarted_cold() -> None:
    """Continued with its pool released, a request would crash the scheduler, so it is not
    continued; left paused, it would hold every request for ever (the hang check takes a pause
    for work): once the instance is back, that server is restarted cold, and said so."""
    parker, ckpt, inst, server, events, said = saver_setup()
    ckpt.fail.add(("checkpoint", 101))
    server.fail["/resume_memory_occupation"] = (500, b"boom")
    with pytest.raises(ParkRefused):
        run(parker.park(inst))
    assert ("post", "server", "/continue_generation") not in events
    assert any("POST /resume_memory_occupation answered 500: boom; left paused" in m for m in said)
    assert inst.signals[-1] == ("restart", "server")
    assert any("server is left paused after the failed park (its KV pool released): restarted cold" in m for m in said)


def test_a_failed_park_whose_undo_resumed_the_pool_restarts_nothing() -> None:
    parker, ckpt, inst, _server, _events, _said = saver_setup()
    ckpt.fail.add(("checkpoint", 101))
    with pytest.raises(ParkRefused):
        run(parker.park(inst))
    assert not [s for s in inst.signals if s[0] == "restart"]


def test_a_continue_refused_in_the_undo_leaves_the_server_paused_so_it_is_restarted_cold() -> None:
    parker, ckpt, inst, server, _events, said = saver_setup()
    ckpt.fail.add(("checkpoint", 101))
    server.fail["/continue_generation"] = (401, b"Unauthorized")
    with pytest.raises(ParkRefused):
        run(parker.park(inst))
    assert inst.signals[-1] == ("restart", "server")
    assert any("POST /continue_generation answered 401: Unauthorized; left paused" in m for m in said)
    assert any("left paused after the failed park (generation not continued): restarted cold" in m for m in said)


def test_a_continue_without_an_answer_may_have_continued_so_nothing_is_restarted() -> None:
    """A false kill costs a cold start: a front end that does not answer is the hang check's case."""
    parker, ckpt, inst, server, _events, said = saver_setup()
    ckpt.fail.add(("checkpoint", 101))
    server.fail["/continue_generation"] = (None, b"timed out")
    with pytest.raises(ParkRefused):
        run(parker.park(inst))
    assert not [s for s in inst.signals if s[0] == "restart"]
    assert any("POST /continue_generation no answer: timed out" in m and "left paused" not in m for m in said)


def test_a_park_cancelled_during_the_release_is_undone() -> None:
    """A cancel (the daemon's stop) between the pause and the release's answer: continued, and
    the release, which may have happened, resumed first."""
    parker, _ckpt, inst, server, events, _ = saver_setup()
    started = asyncio.Event()

    async def slow(name: str, path: str, body: object) -> tuple[int | None, bytes]:
        if path == "/release_memory_occupation":
            events.append(("post", name, path))
            started.set()
            await asyncio.sleep(30)
        return await server.post(name, path, body)

    parker.saver_post = lambda _inst: slow

    async def go() -> None:
        task = asyncio.create_task(parker.park(inst))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert [e[2] for e in events if e[0] == "post"] == ["/pause_generation", "/release_memory_occupation",
                                                        "/resume_memory_occupation", "/continue_generation"]
    assert inst.state == InstanceState.READY


def test_a_resume_that_fails_after_the_restore_is_a_failed_restore_started_cold() -> None:
    parker, _ckpt, inst, server, _events, said = saver_setup()
    run(parker.park(inst))
    server.fail["/resume_memory_occupation"] = (None, b"connection refused")
    cold: list[str] = []

    async def cold_start() -> None:
        cold.append("cold")

    verdict = run(parker.restore(inst, cold_start, _serves))
    assert not verdict.serve and cold == ["cold"]
    assert "POST /resume_memory_occupation no answer: connection refused" in verdict.say


def test_an_answer_is_one_line_of_at_most_200_characters_never_obeyed() -> None:
    """The answer is the child's: only its status counts, its text is cut to one line."""
    parker, _ckpt, inst, server, _events, _ = saver_setup()
    server.fail["/pause_generation"] = (500, b"boom\nSTATUS=READY\n" + b"x" * 5000)
    with pytest.raises(ParkRefused) as refused:
        run(parker.park(inst))
    line = str(refused.value)
    assert "\n" not in line and "answered 500: boom" in line and len(line) < 400


def test_a_tp_server_is_judged_on_every_schedulers_bytes_after_the_release() -> None:
    """TP2: two scheduler PIDs under one process name, 20 GiB each, 2 GiB each after the release:
    4 GiB to park, which 7 GiB of host memory does not cover with the margin (the second read of
    the fix: counting only the last PID of a process said 2 GiB and parked)."""
    events: list[tuple[object, ...]] = []
    ckpt = FakeCheckpointer({101: 20 * GIB, 102: 20 * GIB})
    inventory = FakeInventory({0: {101: 20 * 1024}, 1: {102: 20 * 1024}}, ckpt)
    inst = FakeInstance("tp2", {"server": [100, 101, 102]}, [0, 1], [30000])
    inst.processes["server"].launch = SimpleNamespace(argv=("sglang", "--enable-memory-saver"))

    async def post(server: str, path: str, body: object) -> tuple[int | None, bytes]:
        events.append(("post", server, path))
        if path == "/release_memory_occupation":
            for gpu, pid in ((0, 101), (1, 102)):
                inventory.holders[gpu][pid] -= POOL_MIB
        elif path == "/resume_memory_occupation":
            for gpu, pid in ((0, 101), (1, 102)):
                inventory.holders[gpu][pid] += POOL_MIB
        return 200, b"null"

    parker = Parker(ckpt, inventory, lambda m, _p: None, mem_available=lambda: 7 * GIB,
                    kill=lambda pid, sig: None, saver_post=lambda _inst: post)
    with pytest.raises(ParkRefused, match="needed 4.3 GB to park"):
        run(parker.park(inst))
    assert ("checkpoint", 101) not in ckpt.calls and ("checkpoint", 102) not in ckpt.calls


def test_a_park_cancelled_during_a_lock_waits_for_it_and_unlocks() -> None:
    """The lock runs in a thread: a cancel while it runs waits for it, then the undo unlocks (the
    second read: the PID, not yet in the undo's list, stayed locked)."""
    import threading

    parker, ckpt, inst, _server, events, _ = saver_setup(argv=("python3", "-m", "sglang.launch_server"))
    entered, go_on = threading.Event(), threading.Event()
    real_lock = ckpt.lock

    def slow_lock(pid: int, timeout_ms: int) -> None:
        entered.set()
        go_on.wait(10)
        real_lock(pid, timeout_ms)

    ckpt.lock = slow_lock  # type: ignore[method-assign]

    async def go() -> None:
        task = asyncio.create_task(parker.park(inst))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        await asyncio.sleep(0.1)
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert ckpt.states.get(101, CheckpointState.RUNNING) == CheckpointState.RUNNING, ckpt.states
    assert ("signal", 100, "SIGCONT") in events
