"""A neighbour's requests neither keep a hung start alive nor put words in a server's mouth
(hostile read of issue #37).

SGLang opens its HTTP port before its warm-up, and from then on anyone who reaches the port
makes it print: uvicorn's access line for any method, and SGLang's own lines for some routes
(`GET /get_model_info` logs a deprecation warning, http_server.py:805). Counted as start-up
progress, a request every few seconds kept a warm-up that never ends "starting" until
start_timeout_max (hours by default). Here the stranger is `nobody`, the server the stand-in
(which logs that warning as SGLang does), the warm-up hung (fault never-ready). And SGLang
echoes a client's rid in an error line: that line is no reason and no marker of how it ended.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisord_gpu.errors import StartError
from support import free_ports, make_instance, write_config

SETPRIV = shutil.which("setpriv")

#: every 0.3 s until killed: one request SGLang logs itself, one uvicorn logs as TRACE
STRANGER = r"""
import socket, sys, time
port = int(sys.argv[1])
while True:
    for line in (b"GET /get_model_info HTTP/1.1", b"TRACE /x HTTP/1.1"):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(line + b"\r\nHost: a\r\nConnection: close\r\n\r\n")
            s.recv(4096)
            s.close()
        except OSError:
            pass
    time.sleep(0.3)
"""


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv (util-linux)")
def test_a_hung_warm_up_fails_at_its_stall_bound_whatever_a_stranger_requests(tmp_path: Path, cgroups: Any) -> None:
    (port,) = free_ports(1)
    text = f"""
        [servers.alpha]
        gpus = [0]
        port = {port}
        model_path = "/m"
        start_timeout = 2
        start_timeout_max = 120
        [servers.alpha.env]
        SUPERVISORD_GPU_STANDIN_FAULT = "never-ready"
        """
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.2, daemon_extra="start_stall_timeout = 2")
    instance, _ = make_instance(cdir, "p")
    assert SETPRIV is not None
    stranger = subprocess.Popen([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-I",
                                 "-c", STRANGER, str(port)], cwd="/")
    lines: list[str] = []
    proc = instance.processes["alpha"]
    sink = proc.sink

    class Tap:
        def __getattr__(self, name: str) -> Any:
            return getattr(sink, name)

        def child_line(self, *args: Any, **kwargs: Any) -> None:
            lines.append(str(args[2]))
            sink.child_line(*args, **kwargs)

    proc.sink = Tap()

    async def go() -> float:
        began = time.monotonic()
        with pytest.raises(StartError):
            await asyncio.wait_for(instance.start(), 90)
        return time.monotonic() - began

    try:
        took = asyncio.run(go())
    finally:
        stranger.kill()
        stranger.wait()
        asyncio.run(instance.stop())
    # the stranger was heard, by both ways, while it started
    assert any("'/get_model_info' is deprecated" in line for line in lines), lines[-20:]
    assert any('"TRACE /x HTTP/1.1"' in line for line in lines), lines[-20:]
    # start_timeout 2 s, then 2 s of stall after the server's own last line: far below 120
    assert took < 20, f"a stranger kept the hung start alive for {took:.1f} s"


#: SGLang's batch /generate with a repeated rid: the rid comes back in its error line
DUPLICATE_RID = r"""
import json, socket, sys
body = json.dumps({"text": ["a", "b"], "rid": [sys.argv[2], sys.argv[2]]}).encode()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(b"POST /generate HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Type: application/json\r\n"
          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
print(s.recv(65536).split(b" ", 2)[1].decode())
"""


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv (util-linux)")
def test_a_strangers_words_in_a_servers_error_line_are_not_why_it_exited(tmp_path: Path, cgroups: Any) -> None:
    """A rid is the client's, and SGLang prints it at error priority. A SIGKILL from outside
    (the OOM killer, say) after nobody's rid "Scheduler watchdog timeout" must read as what it
    was, not as SGLang's watchdog crash; nor is nobody's line the server's last error."""
    import signal

    (port,) = free_ports(1)
    text = f"""
        [servers.alpha]
        gpus = [0]
        port = {port}
        model_path = "/m"
        """
    instance, _ = make_instance(write_config(tmp_path, {"p": text}, cgroups.root, startup=0.2), "p")
    proc = instance.processes["alpha"]
    assert SETPRIV is not None

    async def go() -> str:
        await instance.start()
        try:
            r = await asyncio.to_thread(subprocess.run, [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                                        sys.executable, "-I", "-c", DUPLICATE_RID, str(port),
                                                        "Scheduler watchdog timeout"],
                                        capture_output=True, text=True, timeout=30, cwd="/")
            assert r.stdout.strip() == "400", (r.stdout, r.stderr)
            await asyncio.sleep(0.5)  # its error line reaches the daemon
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while proc.exit_code is None:
                assert time.monotonic() < deadline, "the killed server was not reaped"
                await asyncio.sleep(0.05)
            return proc.exit_report
        finally:
            await instance.stop()

    report = asyncio.run(go())
    assert report == "killed by SIGKILL", report
