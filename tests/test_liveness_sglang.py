"""Liveness and start deadlines against SGLang's own states (the stand-in copies them).

Each test is a case the earlier liveness got wrong on the real SGLang: it SIGKILLed a server
30 s after `POST /pause_generation` (seen on the H200), and would have killed one whose
`/ready` was latched 503 by somebody else's failed `/health`; a fixed start deadline failed a
start that was still compiling. Liveness is tuned tight here (a dead server is killed within
a few seconds), so a wrong verdict would show many times over within each test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import StartError
from supervisord_gpu.sglang.router_key import read_key
from support import free_ports, make_instance, stop_process, write_config

pytestmark = pytest.mark.slow

TIGHT = "probe = { liveness_interval = 0.5, liveness_timeout = 1, failures = 2 }"  # dead: killed within 3 s


def one_server(port: int, env: dict[str, str] | None = None, extra: str = TIGHT, name: str = "server",
               gpu: int = 0) -> str:
    lines = "\n".join(f'{k} = "{v}"' for k, v in (env or {}).items())
    return f"""
        [servers.{name}]
        gpus = [{gpu}]
        port = {port}
        model_path = "/models/test"
        {extra}
        [servers.{name}.env]
        {lines}
        """


def http(method: str, port: int, path: str, body: object = None, timeout: float = 60, key: str = "") -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def server_info(port: int) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
        return json.loads(r.read())


async def _until(pred, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _hold_up(proc, seconds: float, pid: int) -> list[bool]:  # type: ignore[no-untyped-def]
    """Watch for `seconds` that it stays the same ready process; the serving flags seen."""
    seen = []
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        await asyncio.sleep(0.5)
        assert proc.state == State.READY and proc.pid == pid, f"{proc.state} {proc.last_exit}"
        seen.append(proc.status().serving)
    return seen


def test_a_server_paused_for_a_minute_is_not_killed_and_serves_again_after_continue(tmp_path, cgroups):
    """65 s: 20x the bound a dead server gets, over 4 hang windows, and past the 60 s after which
    the hang watch sends a request of ours that still waits again (2 minutes until 2026-12-07; the
    longer pauses are the device's, 460 s in run 5, and test_hang_sglang's with requests held)."""
    (port,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": one_server(port, {"SGLANG_HEALTH_CHECK_TIMEOUT": "3"})}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]
    bound = proc.spec.probe.liveness_bound_s

    async def go() -> tuple[list[bool], int, int, int]:
        await instance.start()
        pid = proc.pid
        key = read_key(proc.launch.admin_key)  # the admin endpoints are the key holder's alone
        assert await asyncio.to_thread(http, "POST", port, "/pause_generation", {"mode": "in_place"}, key=key) == 200
        ready_while_paused = await asyncio.to_thread(http, "GET", port, "/ready")
        seen = await _hold_up(proc, 65, pid)
        assert await asyncio.to_thread(http, "POST", port, "/continue_generation", {}, key=key) == 200
        health = await asyncio.to_thread(http, "GET", port, "/health")  # what the router's next check does
        await _until(lambda: proc.status().serving)
        generate = await asyncio.to_thread(http, "POST", port, "/generate", {"text": "hi"})
        await instance.stop()
        return seen, ready_while_paused, health, generate

    seen, ready_while_paused, health, generate = asyncio.run(go())
    assert bound <= 3 and ready_while_paused == 503, "the stand-in did not pause: the test would prove nothing"
    assert proc.restarts_total == 0 and not seen[-1], "not reported as not serving while paused"
    assert (health, generate) == (200, 200)


def test_a_ready_latched_by_someone_elses_failed_health_is_not_killed_and_clears_when_health_answers(tmp_path, cgroups):
    (port,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": one_server(port, {"SGLANG_HEALTH_CHECK_TIMEOUT": "2"})}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> tuple[int, int, list[bool], int]:
        await instance.start()
        pid = proc.pid
        scheduler = (await asyncio.to_thread(server_info, port))["scheduler_pids"][0]
        stop_process(scheduler)  # a scheduler stall of 3 s (a long prompt) ...
        failed = await asyncio.to_thread(http, "GET", port, "/health")  # ... during a third party's check
        await asyncio.sleep(1)
        os.kill(scheduler, signal.SIGCONT)  # the stall is over; the latch stays
        latched = await asyncio.to_thread(http, "GET", port, "/ready")
        seen = await _hold_up(proc, 15, pid)  # 5x the bound a dead server gets
        ok = await asyncio.to_thread(http, "GET", port, "/health")  # the router's next check
        await _until(lambda: proc.status().serving)
        await instance.stop()
        return failed, latched, seen, ok

    failed, latched, seen, ok = asyncio.run(go())
    assert (failed, latched) == (503, 503), "the stand-in did not latch: the test would prove nothing"
    assert proc.restarts_total == 0 and seen[-1] is False and ok == 200


#: run as nobody: listen on [::1]:PORT (the other family's loopback, which a bind of 127.0.0.1 leaves
#: free) and answer 200 to whoever comes: clients of `localhost` may come, our probes of 127.0.0.1 never do
OTHER_FAMILY = r"""
import socket, sys
s = socket.socket(socket.AF_INET6)
s.bind(("::1", int(sys.argv[1])))
s.listen(8)
print("bound", flush=True)
while True:
    conn, _ = s.accept()
    with conn:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_stranger_on_the_other_familys_loopback_after_ready_kills_nothing(tmp_path, cgroups):
    """Only who accepted each probe's own connection counts, not who else listens on the port
    number: a local user on [::1]:P while the server serves 127.0.0.1:P answers none of our
    probes, so the server is neither killed nor taken for someone else's (counting every
    listener on the port, a first version of the after-ready check killed it within its bound)."""
    (port,) = free_ports(1)
    try:
        with socket.socket(socket.AF_INET6) as probe6:
            probe6.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    cdir = write_config(tmp_path, {"p": one_server(port)}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> list[bool]:
        await instance.start()
        pid = proc.pid
        stranger = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
                                     "-I", "-c", OTHER_FAMILY, str(port)], stdout=subprocess.PIPE, text=True, cwd="/")
        try:
            assert stranger.stdout is not None and stranger.stdout.readline() == "bound\n"
            return await _hold_up(proc, 6, pid)  # twice the bound a dead server gets
        finally:
            stranger.kill()
            stranger.wait()
            await instance.stop()

    seen = asyncio.run(go())
    assert proc.spec.probe.liveness_bound_s <= 3 and proc.restarts_total == 0 and all(seen), seen


def test_a_sigstopped_scheduler_is_killed_after_scheduler_timeout_and_the_server_restarted(tmp_path, cgroups):
    (port,) = free_ports(1)
    probe = "probe = { liveness_interval = 0.5, liveness_timeout = 1, failures = 2, scheduler_timeout = 4 }"
    cdir = write_config(tmp_path, {"p": one_server(port, extra=probe)}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> tuple[float, int, str]:
        await instance.start()
        pid = proc.pid
        scheduler = (await asyncio.to_thread(server_info, port))["scheduler_pids"][0]
        stop_process(scheduler)  # its front end still answers /ready 200
        began = time.monotonic()
        ready = await asyncio.to_thread(http, "GET", port, "/ready", None, 5)
        await _until(lambda: proc.pid != pid or proc.exit_code is not None)
        took = time.monotonic() - began
        await _until(lambda: proc.state == State.READY)
        why = proc.last_exit  # how the first one ended
        await instance.stop()
        return took, ready, why

    took, ready, why = asyncio.run(go())
    assert ready == 200, "the front end did not answer: this would test the other verdict"
    assert 3.0 <= took <= 4 + 0.5 + 1 + 1.5, f"killed {took:.1f} s after the scheduler stopped (scheduler_timeout 4 s)"
    assert proc.restarts_total == 1 and "its scheduler answered nothing" in why, why


def test_a_start_past_its_start_timeout_that_keeps_drawing_progress_becomes_ready(tmp_path, cgroups):
    (port,) = free_ports(1)
    text = one_server(port, extra="start_timeout = 10")
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=30, daemon_extra="start_stall_timeout = 5")
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> float:
        began = time.monotonic()
        await instance.start()  # 30 s of "\r" progress bars and no "\n" for long stretches
        took = time.monotonic() - began
        await instance.stop()
        return took

    took = asyncio.run(go())
    assert took >= 30 and proc.restarts_total == 0


def test_a_start_silent_for_start_stall_timeout_fails_naming_it(tmp_path, cgroups):
    (port,) = free_ports(1)
    # 8 s of "\r" progress (past its start_timeout of 4 s), then silence
    text = one_server(port, {"SUPERVISORD_GPU_STANDIN_SILENT_S": "60"}, extra="start_timeout = 4")
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=8, daemon_extra="start_stall_timeout = 3")
    instance, _ = make_instance(cdir, "p")

    async def go() -> tuple[float, str]:
        began = time.monotonic()
        with pytest.raises(StartError) as e:
            await instance.start()
        took = time.monotonic() - began
        await instance.stop()
        return took, str(e.value)

    took, why = asyncio.run(go())
    assert 10 <= took <= 16, f"failed after {took:.1f} s"
    assert "server: not ready within its start_timeout of 4 s, and no progress for 3 s since (start_stall_timeout 3 s" in why, why
