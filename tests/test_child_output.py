"""Reading what SGLang and the router print: progress bars, level-less errors, colours, exits."""

from __future__ import annotations

import signal

from supervisord_gpu.engine.output import LINE_LIMIT, OutputSplitter
from supervisord_gpu.sglang.exits import describe_exit, with_error
from supervisord_gpu.sglang.logs import phase_of, priority_of, strip_ansi

BAR = "Loading safetensors checkpoint shards:  {p}% Completed | {n}/5 [00:0{n}<00:03,  1.2it/s]"


def test_a_tqdm_bar_is_progress_until_its_newline_then_one_line():
    s = OutputSplitter()
    first = s.feed(b"[2026-12-01 08:00:00] Load weight begin. avail mem=139.2 GB\n\r" + BAR.format(p=20, n=1).encode())
    assert first.lines == ["[2026-12-01 08:00:00] Load weight begin. avail mem=139.2 GB"]
    assert first.progress == BAR.format(p=20, n=1)
    second = s.feed(("\r" + BAR.format(p=40, n=2) + "\r" + BAR.format(p=60, n=3)).encode())
    assert second.lines == [] and second.progress == BAR.format(p=60, n=3)
    last = s.feed(("\r" + BAR.format(p=100, n=5) + "\n").encode())
    assert last.lines == [BAR.format(p=100, n=5)]  # what the terminal shows once the bar is done


def test_a_bar_that_redraws_itself_for_ever_costs_one_bar_of_memory():
    s = OutputSplitter()
    for i in range(20000):
        s.feed(("\r" + BAR.format(p=i % 100, n=i % 5)).encode())
    assert len(s._pending) <= len(BAR) + 10


def test_a_line_longer_than_the_limit_is_forwarded_in_pieces():
    s = OutputSplitter()
    out = s.feed(b"x" * (LINE_LIMIT * 2 + 5))
    assert [len(line) for line in out.lines] == [LINE_LIMIT, LINE_LIMIT]
    assert s.close() == ["xxxxx"]


def test_progress_bars_name_their_phase():
    assert phase_of(BAR.format(p=20, n=1)) == "loading weights"
    assert phase_of("Capturing batches (bs=256 avail_mem=70.12 GB):  30%|███       | 6/20 [00:02<00:04,  3.1it/s]") == \
        "capturing CUDA graphs"
    assert phase_of("[2026-12-01 08:00:00 TP0] Entering DeepGEMM JIT Pre-Compile session. It may take a long time "
                    "(typically 10-20 mins) if you have not run `sglang.compile_deep_gemm`.") == "compiling kernels"


def test_sglang_failure_lines_without_a_level_name_are_errors():
    for line in (
        "[2026-12-01 08:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):",
        "[2026-12-01 08:00:00] Subprocess scheduler_0 (pid=4711) crashed with exit code -9. Triggering SIGQUIT for cleanup...",
        "[2026-12-01 08:00:00] Received sigquit from a child process. It usually means the child failed.",
        "[2026-12-01 08:00:00] Initialization failed. warmup error: ConnectionRefusedError",
        "[2026-12-01 08:00:00] Health check failed. Server couldn't get a response from detokenizer for last 20 seconds.",
        "[2026-12-01 08:00:00] ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        "[2026-12-01 08:00:00] ValueError: --model-path is required",
    ):
        assert priority_of(line) == 3, line
    assert priority_of("[2026-12-01 08:00:00 TP0] Load weight begin. avail mem=139.22 GB") == 6
    assert priority_of("[2026-12-01 08:00:00] server_args=ServerArgs(model_path='/m', enable_error_log=False)") == 6


def test_router_lines_lose_their_colours_and_keep_their_level():
    error = "\x1b[2m2026-12-01 08:47:14\x1b[0m \x1b[31mERROR\x1b[0m \x1b[2msmg::server\x1b[0m\x1b[2m:\x1b[0m worker failed"
    warn = "\x1b[2m2026-12-01 08:47:14\x1b[0m \x1b[33m WARN\x1b[0m \x1b[2msmg::core\x1b[0m: marked unhealthy"
    info = "\x1b[2m2026-12-01 08:47:14\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2msmg::server\x1b[0m: Starting router"
    assert priority_of(error) == 6, "with its escape codes a level match fails: the reason to strip them"
    assert strip_ansi(error) == "2026-12-01 08:47:14 ERROR smg::server: worker failed"
    assert [priority_of(strip_ansi(x)) for x in (error, warn, info)] == [3, 4, 6]


def test_exits_say_what_happened():
    crashed = describe_exit(-signal.SIGKILL, ("Received sigquit from a child process",))
    assert crashed == "crashed: SGLang killed itself after a scheduler failed"  # our words: what STATUS= may show
    assert with_error(crashed, "RuntimeError: boom") == \
        "crashed: SGLang killed itself after a scheduler failed: RuntimeError: boom"  # and the journal's
    assert describe_exit(-signal.SIGKILL, sent={signal.SIGKILL: "still running 60 s after SIGTERM"}) == \
        "killed by SIGKILL (still running 60 s after SIGTERM)"
    # SIGTERMed by us, then SGLang's own crash path: a crash, not our kill
    assert describe_exit(-signal.SIGKILL, ("Scheduler hit an exception",),
                         sent={signal.SIGTERM: "stopped by the supervisor"}).startswith("crashed: SGLang killed itself")
    holder = "port 127.0.0.1:30000 (server) held by pid 4711 (user mallory) nc -l 30000"
    assert describe_exit(3, saw=("error while attempting to bind",), port_holder=holder) == \
        f"exit code 3: its port was taken: {holder}"
    assert describe_exit(1, saw=("Address already in use",)) == "exit code 1: its port was taken by another process"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(2) == "exit code 2: the command line was rejected"
    assert describe_exit(-signal.SIGTERM, sent={signal.SIGTERM: "stopped by the supervisor"}) == \
        "killed by SIGTERM (stopped by the supervisor)"


def test_a_reason_is_quoted_without_its_time_stamp_and_never_as_boilerplate():
    from supervisord_gpu.sglang.logs import is_reason, message_of

    assert message_of("[2026-12-01 08:00:00 TP0] Scheduler hit an exception: RuntimeError: boom") == \
        "Scheduler hit an exception: RuntimeError: boom"
    assert message_of("2026-12-01 08:47:14 ERROR smg::server: worker failed") == "ERROR smg::server: worker failed"
    assert not is_reason("[2026-12-01 08:00:00] Received sigquit from a child process. It usually means the child failed.")


def test_a_status_naming_a_holder_in_utf8_reaches_the_notify_socket(tmp_path, monkeypatch):
    """sdnotify's own notify() encodes Latin-1 and drops the rest silently: a STATUS= quoting
    a shortened command line ("python3 -c …") never reached systemd, which kept "starting"."""
    import socket

    from supervisord_gpu.api.notify import Notifier

    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    Notifier().status("failed: server: port 127.0.0.1:30300 is held by pid 125 (user nobody) python3 -c import … (foreign)")
    assert sock.recv(4096).decode() == (
        "STATUS=failed: server: port 127.0.0.1:30300 is held by pid 125 (user nobody) python3 -c import … (foreign)")


def test_access_log_lines_are_not_start_up_progress():
    from supervisord_gpu.sglang.logs import is_access_log

    assert is_access_log('[2026-12-01 10:00:00] INFO:     127.0.0.1:47052 - "GET /health HTTP/1.1" 503 Service Unavailable')
    assert is_access_log('2026-12-01 09:44:42 ERROR http_request{method=GET uri=/readiness version=HTTP/1.1} request failed')
    assert not is_access_log("[2026-12-01 10:00:00 TP0] Load weight begin. avail mem=139.22 GB")


def test_start_up_progress_is_the_servers_phases_and_bars_never_a_requests_echo():
    """Anyone who connects makes the server print: a method the routes do not know, a path that
    spells a phase, garbage. Were those progress, a stranger would keep a hung start alive."""
    from supervisord_gpu.sglang.logs import is_start_progress

    for own in ("[2026-12-01 10:00:00 TP0] Load weight begin. avail mem=139.22 GB",
                "[2026-12-01 10:00:00] Capture target decode CUDA graph begin. This can take up to several minutes.",
                "[2026-12-01 10:00:00] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
                BAR.format(p=20, n=1),
                "Capturing batches (bs=64 avail_mem=20.1 GB):  30%|███       | 3/10 [00:01<00:02,  3.1it/s]",
                "DeepGEMM warmup: 12it [00:04,  3.00it/s]"):
        assert is_start_progress(own), own
    for theirs in ('[2026-12-01 10:00:00] INFO:     127.0.0.1:47052 - "TRACE /x HTTP/1.1" 405 Method Not Allowed',
                   'INFO:     127.0.0.1:47052 - "GET /DeepGEMM HTTP/1.1" 404 Not Found',
                   'INFO:     127.0.0.1:47052 - "TRACE /max_total_num_tokens=1 HTTP/1.1" 405 Method Not Allowed',
                   'INFO:     127.0.0.1:47052 - "BREW /Load%20weight%20begin HTTP/1.0" 501 Not Implemented',
                   "[2026-12-01 10:00:00] WARNING:  Invalid HTTP request received.",
                   "[2026-12-01 10:00:00] Using default chat template",  # the server's own, but no progress
                   ""):
        assert not is_start_progress(theirs), theirs


# The stranger's side of the port: raw requests with the methods uvicorn answers, sent as nobody.
_STRANGER = """
import socket, sys
for method, path in (("TRACE", "/x"), ("CONNECT", "/x"), ("PROPFIND", "/x"), ("foo", "/x"), ("GET", "/DeepGEMM"),
                     ("GET", "/max_total_num_tokens=")):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.sendall(f"{method} {path} HTTP/1.1\\r\\nHost: a\\r\\n\\r\\n".encode())
    s.settimeout(5)
    s.recv(1000)
    s.close()
"""

_UVICORN = """
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 405, "headers": []})
        await send({"type": "http.response.body", "body": b""})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info")
"""


def test_a_strangers_requests_to_a_starting_server_are_neither_progress_nor_a_phase():
    """Hostile read of #37: a hung start whose HTTP port is up (SGLang's warm-up) must fail at its
    stall bound, whatever a neighbour sends. uvicorn logs every method it answers (TRACE,
    PROPFIND, any token under h11), and the path is the client's: each of its lines is the
    access log (no progress), none names a phase."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import pytest

    from supervisord_gpu.sglang.logs import is_access_log

    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", _UVICORN, str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "uvicorn did not start"
                time.sleep(0.1)
        nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []
        subprocess.run([*nobody, "/usr/bin/python3", "-I", "-c", _STRANGER, str(port)], check=True, timeout=30)
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=20)
    echoed = [line for line in out.splitlines() if "127.0.0.1:" in line and " - " in line]
    assert len(echoed) == 6, out
    assert [line for line in echoed if not is_access_log(line)] == []
    assert [line for line in echoed if phase_of(line) is not None] == []


def test_once_the_http_port_is_up_only_the_servers_own_phase_lines_are_progress():
    """SGLang 0.5.23 prints these for anyone's request (http_server.py:805, :973, :792); before
    uvicorn's start line only the server can write, and every line of it counts."""
    from supervisord_gpu.sglang.logs import is_start_progress, opens_http

    assert opens_http("[2026-12-01 10:00:00] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)")
    anyones = (
        "[2026-12-01 10:00:01] Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
        "Please use '/model_info' instead.",
        "[2026-12-01 10:00:01] Health check failed. Server couldn't get a response from detokenizer for last 20 seconds.",
        "[2026-12-01 10:00:01 TP0] Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0",
    )
    for line in anyones:
        assert is_start_progress(line, http_open=False), line  # loading: the server's own words
        assert not is_start_progress(line, http_open=True), line
    # the rid of a request is the client's, and SGLang echoes it (tokenizer_manager.py:3836) while
    # a hung warm-up holds the first one: neither progress nor a phase, port open or not
    echo = "[2026-12-01 10:00:01] [http_server] Error: Duplicate request ID detected: The server is fired up and ready to roll!"
    logged = "[2026-12-01 10:00:01] Receive: obj=GenerateReqInput(text='Load weight begin', rid='x')"
    bad = "[2026-12-01 10:00:01] [http_server] Error: max_new_tokens must be at least 0"
    zmq = "[2026-12-01 10:00:01 TP0] Malformed ABORT message: invalid room field 'Load weight begin'"
    assert not is_start_progress(zmq, http_open=False), zmq  # a neighbour's words, even while loading
    for line in (echo, logged, bad, zmq):
        assert phase_of(line) is None and not is_start_progress(line, http_open=True), line
    assert is_start_progress("[2026-12-01 10:00:02 TP0] DeepGEMM JIT compiling kernel 3/40", http_open=True)
    assert is_start_progress("[2026-12-01 10:00:03] The server is fired up and ready to roll!", http_open=True)
