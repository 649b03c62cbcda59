"""What a local user (nobody) can do to a start and to a restart, from outside the daemon.

1. A server's HTTP port answers anyone. Each request makes it print a line (uvicorn's access
   log: `"TRACE /x HTTP/1.1" 405`); were that start-up progress, a stranger's requests would
   keep a hung start alive. Only phase lines and progress bars count.
2. `start_timeout_max` is the hard cap on a start that keeps making progress.
3. A restart after a crash that fails (a stranger took the port meanwhile) names the holder in
   the journal, in STATUS= and in the final reason, never "stopped by the supervisor".

The daemon's engine runs as root (the test process), with stand-in servers in cgroups; the
strangers run as nobody.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from supervisord_gpu.api.notify import status_text
from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import StartError
from support import Recorder, free_ports, make_instance, write_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the strangers run as nobody, from a root test process")
NOBODY = pwd.getpwnam("nobody")
AS_NOBODY = ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # nobody may not reach pyenv

# a request the server's routes do not know, over and over: each one is echoed in its access log
TRACER = """
import socket, sys, time
port = int(sys.argv[1])
while True:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"TRACE /x HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            s.recv(4096)
    except OSError:
        pass
    time.sleep(0.05)
"""

# takes the port the moment it is free, and answers nothing
SQUATTER = """
import socket, sys, time
port = int(sys.argv[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
while True:
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.005)
s.listen(16)
print("bound", flush=True)
while True:
    c, _ = s.accept()
    c.close()
"""


def as_nobody(script: str, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([*AS_NOBODY, PYTHON, "-I", "-S", "-c", script, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


@pytest.fixture
def strangers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def one_server(port: int, keys: str, env: str = "", restart: str = "") -> str:
    return f"""
        {restart}
        [servers.alpha]
        gpus = [0]
        port = {port}
        model_path = "/m"
        {keys}
        [servers.alpha.env]
        {env}
        """


def start_within(instance, seconds: float) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    """Start; the StartError's text and when it came. A start still running at `seconds` fails
    the test (the instance is stopped first)."""

    async def go() -> tuple[str, float]:
        began = time.monotonic()
        try:
            await asyncio.wait_for(instance.start(), seconds)
        except StartError as e:
            return str(e), time.monotonic() - began
        except TimeoutError:
            await instance.stop()
            pytest.fail(f"the start was still going after {seconds:g} s (state {instance.state.value})")
        await instance.stop()
        pytest.fail("a hung server became ready")

    return asyncio.run(go())


def test_a_strangers_requests_do_not_keep_a_hung_start_alive(tmp_path, cgroups, strangers) -> None:
    """never-ready: the port is open, the warm-up never ends. nobody sends TRACE /x twenty times a
    second; the start fails at its start_timeout all the same (the cap, 30 s, is never reached)."""
    port = free_ports(1)[0]
    text = one_server(port, "start_timeout = 3\nstart_timeout_max = 30", 'SUPERVISORD_GPU_STANDIN_FAULT = "never-ready"')
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    strangers.append(as_nobody(TRACER, port))
    message, took = start_within(instance, 25)
    first = message.splitlines()[0]
    assert first.startswith("alpha: not ready within its start_timeout of 3 s"), first
    assert "start_timeout_max" not in first
    assert took < 12, took
    # the stranger's requests were echoed as the real server's are, up to the very end
    assert '"TRACE /x HTTP/1.1"' in message.split("last lines:")[1], message
    assert instance.state == State.FAILED and cgroups.all_pids() == []


def test_start_timeout_max_ends_a_start_that_keeps_making_progress(tmp_path, cgroups) -> None:
    """A DeepGEMM JIT bar that moves for a minute: progress all along, so only the cap ends it."""
    port = free_ports(1)[0]
    text = one_server(port, "start_timeout = 2\nstart_timeout_max = 5", 'SUPERVISORD_GPU_STANDIN_JIT_S = "60"')
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    message, took = start_within(instance, 25)
    first = message.splitlines()[0]
    assert first.startswith("alpha: not ready within its start_timeout_max of 5 s (phase: compiling kernels"), first
    assert 5 <= took < 10, took
    assert instance.state == State.FAILED and cgroups.all_pids() == []


def test_a_failed_restart_names_the_stranger_who_took_the_port(tmp_path, cgroups, strangers) -> None:
    """After ready the server dies; nobody binds its port before the restart. Each restart fails on
    that holder: the journal, STATUS= and the final reason name its pid, not our own SIGTERM."""
    port = free_ports(1)[0]
    restart = "[restart]\nmax_restarts = 2\nbackoff_initial = 0.3\nbackoff_max = 1"
    cdir = write_config(tmp_path, {"p": one_server(port, "", restart=restart)}, cgroups.root, startup=0.5)
    rec = Recorder()
    instance, _ = make_instance(cdir, "p", rec)
    journal: list[tuple[str, dict[str, str]]] = []
    event = instance.sink.event

    def recorded(message: str, priority: int = 6, **fields: str) -> None:
        journal.append((message, fields))
        event(message, priority, **fields)

    instance.sink.event = recorded
    statuses: list[str] = []
    instance.listeners.append(lambda _e: statuses.append(status_text(instance.status())))

    async def go() -> None:
        await instance.start()
        squatter = as_nobody(SQUATTER, port)
        strangers.append(squatter)
        os.kill(instance.processes["alpha"].pid, signal.SIGKILL)
        assert squatter.stdout is not None
        assert await asyncio.wait_for(asyncio.to_thread(squatter.stdout.readline), 10) == "bound\n"
        await asyncio.wait_for(instance.failed.wait(), 30)

    asyncio.run(go())
    holder = f"pid {strangers[0].pid} (user nobody"
    assert instance.state == State.FAILED
    assert "stopped by the supervisor" not in instance.reason
    assert holder in instance.reason and "restart limit reached (2/2" in instance.reason, instance.reason
    assert status_text(instance.status()).startswith("failed: alpha not ready after its restart: port ")
    assert any(holder in s and s.startswith("degraded: alpha restarting (2/2)") for s in statuses), statuses
    failed = [m for m, f in journal if f.get("GPUSUP_EVENT") == "restart-failed"]
    assert len(failed) == 2 and all(holder in m for m in failed), journal
    assert cgroups.all_pids() == []


def test_a_stranger_on_a_prefills_bootstrap_port_fails_its_start_named(tmp_path, cgroups, strangers) -> None:
    """SGLang binds the PD bootstrap port in a thread and only logs a failure: with nobody on that
    port, the prefill still answers /health 200, and the decode would ask nobody where its KV cache
    goes. The start fails instead, naming nobody's pid; the prefill is never ready."""
    port, boot = free_ports(2)
    text = one_server(port, f'role = "prefill"\n        [servers.alpha.options]\n        disaggregation-bootstrap-port = {boot}\n'
                            '        disaggregation-transfer-backend = "mooncake"')
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "p")
    squatter = as_nobody(SQUATTER, boot)
    strangers.append(squatter)
    assert squatter.stdout is not None and squatter.stdout.readline() == "bound\n"
    message, _took = start_within(instance, 25)
    first = message.splitlines()[0]
    assert f"bootstrap port 127.0.0.1:{boot} is held by pid {squatter.pid}" in first, first
    assert instance.state == State.FAILED and cgroups.all_pids() == []


def test_a_stranger_who_takes_the_bootstrap_port_after_the_preflight_makes_the_daemon_exit_3_naming_them(
        tmp_path, cgroups, strangers, monkeypatch) -> None:
    """Issue 36: the preflight found the prefill's bootstrap port free; a local user binds it before
    the prefill does (SGLang would only log its failed bind and answer /health 200). Through the
    daemon's own start path: not READY, exit 3 (the preflight's refusal come late: final, no
    systemd retry into the same taken port), the reason naming nobody's pid, nothing left."""
    from supervisord_gpu import daemon as D
    from supervisord_gpu.config.loader import load_daemon_config, load_profile

    port, boot = free_ports(2)
    text = one_server(port, f'role = "prefill"\n        [servers.alpha.options]\n        disaggregation-bootstrap-port = {boot}\n'
                            '        disaggregation-transfer-backend = "mooncake"')
    cfg = load_daemon_config(write_config(tmp_path, {"p": text}, cgroups.root, startup=0.5))
    built = D.build_instance

    def squatted_after_the_preflight(*a, **k):  # type: ignore[no-untyped-def]
        instance, sink = built(*a, **k)
        start = instance.start

        async def stranger_then_start() -> None:  # the controller calls this after its preflight
            squatter = as_nobody(SQUATTER, boot)
            strangers.append(squatter)
            assert squatter.stdout is not None
            assert await asyncio.wait_for(asyncio.to_thread(squatter.stdout.readline), 10) == "bound\n"
            await start()

        instance.start = stranger_then_start
        return instance, sink

    monkeypatch.setattr(D, "build_instance", squatted_after_the_preflight)
    events: list = []
    opts = D.RunOptions(rehearsal=True, force_stderr=True, bus="off", stop_after_ready=True, listeners=[events.append])
    code = asyncio.run(asyncio.wait_for(D.serve(cfg, load_profile(cfg, "p"), opts), 60))
    failed = [e.message for e in events if e.kind == "instance" and e.state == "failed"]
    assert code == 3, (code, failed)
    holder = f"port 127.0.0.1:{boot} (alpha bootstrap) held by pid {strangers[0].pid} (user nobody"
    assert failed and holder in failed[-1] and "taken while p was starting" in failed[-1], failed
    assert cgroups.all_pids() == []
