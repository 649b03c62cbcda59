"""Tests of the stand-in SGLang server and router (supervisord_gpu.rehearsal).

They start real processes on free ports. Every process a test starts carries a unique
tag in its environment; the `procs` fixture's finalizer SIGKILLs every process that
carries the tag (the detached schedulers included, which no process-group kill reaches),
so nothing outlives a test, even a failed one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.rehearsal import standin_router, standin_server
from support import wait_for

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
SERVER = [PY, "-m", "supervisord_gpu.rehearsal.standin_server"]
STANDIN_ROUTER = [PY, "-m", "supervisord_gpu.rehearsal.standin_router"]
REAL_ROUTER = [PY, "-m", "sglang_router.launch_router"]
TAG = "SUPERVISORD_GPU_TEST_TAG"

STARTUP_LINES = [
    "Load weight begin. avail mem=",
    "Load weight end. elapsed=",
    "KV Cache is allocated. dtype: torch.bfloat16, #tokens: ",
    "Memory pool end. avail mem=",
    "Capture target decode CUDA graph begin.",
    "Capture target decode CUDA graph end. bs=",
    "The server is fired up and ready to roll!",
]


def have_real_router() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); (0, b"") when nothing answers (refused, reset, timeout)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def status(url: str, timeout: float = 2.0) -> int:
    return http("GET", url, timeout=timeout)[0]


class Procs:
    """Starts tagged processes and kills every tagged process at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = uuid.uuid4().hex
        self.popens: list[subprocess.Popen[bytes]] = []
        self.n = 0

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path, Path]:
        self.n += 1
        out = self.tmp / f"p{self.n}.out"
        err = self.tmp / f"p{self.n}.err"
        full_env = {**os.environ, **(env or {}), TAG: self.tag}
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        with open(out, "wb") as o, open(err, "wb") as e:
            p = subprocess.Popen(argv, env=full_env, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                 cwd=str(REPO), start_new_session=True)
        self.popens.append(p)
        return p, out, err

    def tagged(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid == os.getpid():
                    continue
                with open(f"/proc/{proc.pid}/environ", "rb") as f:
                    if f"{TAG}={self.tag}".encode() in f.read().split(b"\0"):
                        found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found

    def cleanup(self) -> None:
        for p in self.popens:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in self.tagged():
            try:
                proc.kill()
            except psutil.Error:
                pass
        for p in self.popens:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    registry = Procs(tmp_path)
    try:
        yield registry
    finally:
        registry.cleanup()


@pytest.fixture
def sim(tmp_path: Path) -> SimulatedGpus:
    return SimulatedGpus.create(tmp_path / "simgpu", 4)


def start_server(procs: Procs, *args: str, startup_s: float = 0.5, env: dict[str, str] | None = None,
                 sim: SimulatedGpus | None = None, mib: int = 1000) -> tuple[subprocess.Popen[bytes], int, Path, Path]:
    port = free_port()
    e = {standin_server.ENV_STARTUP_S: str(startup_s), standin_server.ENV_MIB: str(mib)}
    if sim is not None:
        e[standin_server.ENV_SIMGPU_DIR] = str(sim.directory)
    e.update(env or {})
    argv = [*SERVER, "--model-path", "test/model", "--host", "127.0.0.1", "--port", str(port), *args]
    p, out, err = procs.start(argv, e)
    return p, port, out, err


def wait_healthy(port: int, timeout: float = 10.0) -> None:
    wait_for(lambda: status(f"http://127.0.0.1:{port}/health") == 200, timeout, what=f"/health 200 on {port}")


# --- command line -----------------------------------------------------------------------


def test_parser_knows_every_reference_option() -> None:
    parser = standin_server.build_parser()
    known = set(parser._option_string_actions)
    reference = standin_server.reference_options()
    assert len(reference) == 529
    assert set(reference) <= known
    assert "--cuda-graph-max-bs" not in known


def test_parser_value_counts_and_aliases() -> None:
    a = standin_server.parse_args([
        "--model", "m", "--tensor-parallel-size", "2", "--enable-metrics", "--skip-server-warmup",
        "--trust-remote-code", "--cuda-graph-bs-decode", "1", "2", "4", "--context-length", "512k",
        "--no-enable-tf32-matmul", "--port=31000", "--disaggregation-mode", "prefill", "--ep", "2",
        "--mem-fraction-static", "0.85", "--log-level", "debug",
    ])
    assert a.model_path == "m" and a.tp_size == 2 and a.ep_size == 2 and a.port == 31000
    assert a.enable_metrics and a.skip_server_warmup and a.trust_remote_code
    assert a.cuda_graph_bs_decode == ["1", "2", "4"]
    assert a.context_length == 512000
    assert a.enable_tf32_matmul is False
    assert a.disaggregation_mode == "prefill" and a.disaggregation_bootstrap_port == 8998
    assert a.host == "127.0.0.1" and a.dp_size == 1 and a.base_gpu_id == 0
    assert standin_server.parse_args(["--model-path", "m", "--context-length", "512Ki"]).context_length == 524288


@pytest.mark.parametrize("argv, message", [
    (["--unknown-flag", "1"], "unrecognized arguments: --unknown-flag"),
    (["--cuda-graph-max-bs", "8"],
     "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"),
    (["--tp", "4"], "unrecognized arguments: --tp 4"),
    (["--disaggregation-mode", "both"], "invalid choice"),
])
def test_bad_command_line_exits_2(argv: list[str], message: str) -> None:
    r = subprocess.run([*SERVER, "--model-path", "m", *argv], capture_output=True, text=True, timeout=10,
                       cwd=str(REPO))
    assert r.returncode == 2
    assert message in r.stderr


def test_gpus_from_cuda_visible_devices() -> None:
    a = standin_server.parse_args(["--model-path", "m", "--tp-size", "2", "--base-gpu-id", "1"])
    assert standin_server.resolve_gpus(a, {}) == [1, 2]
    assert standin_server.resolve_gpus(a, {"CUDA_VISIBLE_DEVICES": "5,6,7"}) == [6, 7]
    assert standin_server.resolve_gpus(a, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"},
                                       {"GPU-a": 3, "GPU-b": 2, "GPU-c": 1}) == [2, 1]
    with pytest.raises(standin_server.StartupError):
        standin_server.resolve_gpus(a, {"CUDA_VISIBLE_DEVICES": "4"})


def test_fault_parsing() -> None:
    assert standin_server.Fault.parse("crash-after-ready:2.5") == standin_server.Fault("crash-after-ready", 2.5)
    assert standin_server.Fault.parse("never-ready") == standin_server.Fault("never-ready")
    for bad in ("explode", "crash-after-ready", "never-ready:3"):
        with pytest.raises(ValueError):
            standin_server.Fault.parse(bad)


# --- start-up, readiness, logs ----------------------------------------------------------


def test_health_503_while_loading_then_200_and_log_order(procs: Procs, tmp_path: Path) -> None:
    ready_file = tmp_path / "ready.txt"
    t0 = time.time()
    p, port, out, _ = start_server(procs, "--enable-metrics", startup_s=1.0,
                                   env={standin_server.ENV_READY_FILE: str(ready_file)})
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: status(base + "/health") != 0, 5, what="port open")
    assert status(base + "/health") == 503
    assert status(base + "/ready") == 503
    assert status(base + "/v1/models") == 200  # answers before warm-up: not a readiness signal
    wait_healthy(port, timeout=5)
    assert time.time() - t0 >= 1.0
    assert status(base + "/health_generate") == 200 and status(base + "/ready") == 200
    written = [float(x) for x in ready_file.read_text().split()]
    assert len(written) == 1 and t0 < written[0] <= time.time()
    status(base + "/health")
    assert len(ready_file.read_text().split()) == 1  # only the first 200 is recorded

    log = out.read_text()
    positions = [log.find(line) for line in STARTUP_LINES]
    assert all(pos >= 0 for pos in positions), log
    assert positions == sorted(positions), log
    import re
    for line in log.splitlines():
        if any(s in line for s in STARTUP_LINES[:-1]):
            assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] ", line), line

    code, body = http("GET", base + "/metrics")
    assert code == 200 and b"sglang:num_running_reqs" in body
    code, body = http("POST", base + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
    assert code == 200
    reply = json.loads(body)
    assert reply["meta_info"]["completion_tokens"] == 4 and isinstance(reply["text"], str)


def test_server_and_model_info(procs: Procs) -> None:
    p, port, _, _ = start_server(procs, "--tp-size", "2", "--served-model-name", "served",
                                 "--disaggregation-mode", "decode")
    wait_healthy(port)
    for path in ("/server_info", "/get_server_info"):
        code, body = http("GET", f"http://127.0.0.1:{port}{path}")
        info = json.loads(body)
        assert code == 200
        assert info["tp_size"] == 2 and info["dp_size"] == 1 and info["port"] == port
        assert info["model_path"] == "test/model" and info["disaggregation_mode"] == "decode"
        assert info["version"] == "0.5.23" and info["max_total_num_tokens"] > 0
    for path in ("/model_info", "/get_model_info"):
        code, body = http("GET", f"http://127.0.0.1:{port}{path}")
        info = json.loads(body)
        assert code == 200 and info["is_generation"] is True and info["served_model_name"] == "served"


def test_port_taken_exits_1(procs: Procs) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p, _, err = procs.start([*SERVER, "--model-path", "m", "--port", str(port)],
                                {standin_server.ENV_STARTUP_S: "0.5"})
        assert p.wait(timeout=10) == 1
        assert f"127.0.0.1:{port}" in err.read_text()


# --- detached schedulers and simulated GPU memory -------------------------------------


def test_scheduler_is_detached_and_survives_sigkill_of_main(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, _ = start_server(procs, "--tp-size", "2", sim=sim, mib=5000)
    wait_healthy(port)
    holders = sim.holders()
    assert sorted(h.gpus for h in holders) == [(0,), (1,)]
    assert all(h.mib == 5000 for h in holders)
    server = psutil.Process(p.pid)
    for h in holders:
        proc = psutil.Process(h.pid)
        assert h.pid != p.pid
        assert proc.ppid() != p.pid  # re-parented: not a child of the server
        assert h.pid not in {c.pid for c in server.children(recursive=True)}
        assert os.getsid(h.pid) != os.getsid(p.pid)  # own session: process-group kills miss it
        assert proc.name() == "sglang::schedul"

    os.kill(p.pid, signal.SIGKILL)  # the main process alone
    p.wait(timeout=5)
    time.sleep(0.3)
    survivors = sim.holders()
    assert sorted(h.pid for h in survivors) == sorted(h.pid for h in holders)
    with socket.socket() as s:  # the orphans do not keep the HTTP port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))

    for h in survivors:  # what only a cgroup-wide kill would do for a supervisor
        os.killpg(os.getsid(h.pid), signal.SIGKILL)
    wait_for(lambda: not sim.holders(), 5, what="holdings to vanish")


def test_sigterm_drains_then_frees_everything(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, out, _ = start_server(procs, sim=sim)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(port)
    assert len(sim.holders()) == 1
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["reply"] = http("POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": 1.5}},
                               timeout=10)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    t_term = time.monotonic()
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: status(base + "/health") == 503, 2, what="/health 503 while draining")
    assert p.poll() is None  # still draining the request
    assert p.wait(timeout=10) == 0
    t.join(timeout=5)
    assert result["reply"][0] == 200
    assert time.monotonic() - t_term >= 1.0
    assert "SIGTERM received" in out.read_text() and "Draining requests and shutting down..." in out.read_text()
    assert sim.holders() == []
    assert procs.tagged() == []


def test_killed_scheduler_makes_server_exit_1(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, err = start_server(procs, "--tp-size", "2", sim=sim)
    wait_healthy(port)
    victim, other = sorted(h.pid for h in sim.holders())
    os.kill(victim, signal.SIGKILL)
    assert p.wait(timeout=5) == 1
    assert "Received sigquit from a child process" in err.read_text()
    assert [h.pid for h in sim.holders()] == [other]  # the other detached scheduler stays


def test_out_of_memory_when_gpu_is_busy(procs: Procs, sim: SimulatedGpus) -> None:
    sim.hold([0], 140000)  # this test process plays a foreign holder on GPU 0
    p, port, _, err = start_server(procs, sim=sim, mib=10000)
    assert p.wait(timeout=10) == 1
    assert "CUDA out of memory" in err.read_text()
    time.sleep(0.2)
    assert [h.pid for h in sim.holders()] == [os.getpid()]  # it stopped its schedulers


# --- faults -----------------------------------------------------------------------------


def test_fault_crash_on_start_leaves_orphans(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, _ = start_server(procs, sim=sim, startup_s=0.6, env={standin_server.ENV_FAULT: "crash-on-start"})
    t0 = time.monotonic()
    assert p.wait(timeout=10) == 1
    assert time.monotonic() - t0 < 3
    assert [pr.name() for pr in procs.tagged()] == ["sglang::schedul"]


def test_fault_never_ready(procs: Procs) -> None:
    p, port, _, _ = start_server(procs, startup_s=0.3, env={standin_server.ENV_FAULT: "never-ready"})
    wait_for(lambda: status(f"http://127.0.0.1:{port}/health") != 0, 5, what="port open")
    time.sleep(0.8)
    assert status(f"http://127.0.0.1:{port}/health") == 503
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=5) == 0


def test_fault_crash_after_ready(procs: Procs) -> None:
    p, port, _, err = start_server(procs, startup_s=0.3, env={standin_server.ENV_FAULT: "crash-after-ready:0.5"})
    wait_healthy(port)
    assert p.wait(timeout=5) == 1
    assert "crash-after-ready" in err.read_text()


def test_fault_hang_on_term(procs: Procs) -> None:
    p, port, out, _ = start_server(procs, startup_s=0.3, env={standin_server.ENV_FAULT: "hang-on-term"})
    wait_healthy(port)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in out.read_text(), 3, what="SIGTERM log line")
    assert status(f"http://127.0.0.1:{port}/health", timeout=0.5) == 0  # no answer at all
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None


def test_fault_exit_on_term_slow(procs: Procs) -> None:
    p, port, _, _ = start_server(procs, startup_s=0.3, env={standin_server.ENV_FAULT: "exit-on-term-slow:1.2"})
    wait_healthy(port)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: status(f"http://127.0.0.1:{port}/health") == 503, 1, what="503 after SIGTERM")
    assert p.wait(timeout=5) == 0
    assert time.monotonic() - t0 >= 1.2
    assert procs.tagged() == []


# --- routers: the real sglang-router 0.3.2 and the stand-in ----------------------------

ROUTERS = [
    pytest.param(REAL_ROUTER, id="real-router",
                 marks=pytest.mark.skipif(not have_real_router(), reason="sglang-router not installed")),
    pytest.param(STANDIN_ROUTER, id="standin-router"),
]


def start_router(procs: Procs, router: list[str], *args: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    argv = [*router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--policy", "round_robin", *args]
    p, out, _ = procs.start(argv)
    return p, port, out


def wait_router_ready(port: int, workers: int = 1, timeout: float = 10.0) -> dict[str, Any]:
    """Wait for /readiness 200 with `workers` healthy workers.

    Readiness alone is not enough: both routers report ready as soon as one worker
    (PD: one prefill and one decode) is registered, before the others.
    """
    def ready() -> Any:
        code, body = http("GET", f"http://127.0.0.1:{port}/readiness")
        obj = json.loads(body) if code == 200 else None
        return obj if obj and obj["healthy_workers"] >= workers else None

    return wait_for(ready, timeout, interval=0.2, what=f"router /readiness 200 with {workers} workers")


@pytest.mark.parametrize("router", ROUTERS)
def test_router_regular_mode(procs: Procs, router: list[str]) -> None:
    _, w1, _, _ = start_server(procs, startup_s=0.3)
    _, w2, _, _ = start_server(procs, startup_s=0.3)
    wait_healthy(w1)
    wait_healthy(w2)
    rp, port, _ = start_router(procs, router, "--worker-urls", f"http://127.0.0.1:{w1}", f"http://127.0.0.1:{w2}")
    wait_for(lambda: status(f"http://127.0.0.1:{port}/liveness") == 200, 5, what="router port")
    ready = wait_router_ready(port, workers=2)
    assert ready["status"] == "ready" and ready["total_workers"] == 2
    for _ in range(2):
        code, body = http("POST", f"http://127.0.0.1:{port}/generate",
                          {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert code == 200, body
        assert json.loads(body)["meta_info"]["completion_tokens"] == 2
    code, body = http("GET", f"http://127.0.0.1:{port}/workers")
    assert code == 200 and {w["worker_type"] for w in json.loads(body)["workers"]} == {"regular"}
    rp.send_signal(signal.SIGTERM)
    assert rp.wait(timeout=10) == 0


@pytest.mark.parametrize("router", ROUTERS)
def test_router_pd_mode(procs: Procs, router: list[str]) -> None:
    bootstrap = free_port()
    _, pre, pre_out, _ = start_server(procs, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                      str(bootstrap), "--log-requests", startup_s=0.3)
    _, dec, dec_out, _ = start_server(procs, "--disaggregation-mode", "decode", "--log-requests", startup_s=0.3)
    wait_healthy(pre)
    wait_healthy(dec)
    with socket.create_connection(("127.0.0.1", bootstrap), timeout=2):
        pass  # the prefill's bootstrap port listens once loaded
    rp, port, _ = start_router(procs, router, "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{pre}",
                               str(bootstrap), "--decode", f"http://127.0.0.1:{dec}")
    ready = wait_router_ready(port, workers=2)
    assert ready["total_workers"] == 2
    code, body = http("POST", f"http://127.0.0.1:{port}/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert code == 200, body
    assert json.loads(body)["meta_info"]["completion_tokens"] == 3
    for out in (pre_out, dec_out):  # both got the request, with the bootstrap fields added
        line = wait_for(lambda: [ln for ln in out.read_text().splitlines() if "Receive: obj=" in ln], 3,
                        what="logged request")[0]
        req = json.loads(line.split("GenerateReqInput(", 1)[1].rstrip(")"))
        assert req["bootstrap_port"] == bootstrap and req["bootstrap_host"] == "127.0.0.1"
        assert isinstance(req["bootstrap_room"], int)
    rp.send_signal(signal.SIGTERM)
    assert rp.wait(timeout=10) == 0


def test_standin_router_readiness_waits_for_a_worker_and_drains(procs: Procs) -> None:
    rp, port, out = start_router(procs, STANDIN_ROUTER, "--worker-urls", "http://127.0.0.1:1")
    wait_for(lambda: status(f"http://127.0.0.1:{port}/health") == 200, 5, what="router port")
    code, body = http("GET", f"http://127.0.0.1:{port}/readiness")
    assert code == 503 and json.loads(body) == {"status": "not ready", "reason": "insufficient healthy workers"}
    code, body = http("POST", f"http://127.0.0.1:{port}/generate", {"text": "x"})
    assert code == 503 and json.loads(body)["error"]["code"] == "no_available_workers"

    _, w, _, _ = start_server(procs, startup_s=0.3)
    code, _ = http("POST", f"http://127.0.0.1:{port}/workers", {"url": f"http://127.0.0.1:{w}"})
    assert code == 202
    assert wait_router_ready(port)["healthy_workers"] == 1
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", http(
        "POST", f"http://127.0.0.1:{port}/generate", {"text": "x", "stub_sleep_s": 1.0}, timeout=10)))
    t.start()
    time.sleep(0.3)
    rp.send_signal(signal.SIGTERM)
    wait_for(lambda: "graceful shutdown" in out.read_text(), 2, what="shutdown log")
    time.sleep(0.1)
    assert status(f"http://127.0.0.1:{port}/health") == 0  # listener closed at once
    assert rp.wait(timeout=10) == 0
    t.join(timeout=5)
    assert result["r"][0] == 200  # the in-flight request was drained


def test_standin_router_rejects_unknown_flags() -> None:
    r = subprocess.run([*STANDIN_ROUTER, "--worker-urls", "http://x:1", "--bogus"], capture_output=True,
                       text=True, timeout=10, cwd=str(REPO))
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr
    args = standin_router.build_parser().parse_args(
        ["--pd-disaggregation", "--prefill", "http://a:1", "8998", "--prefill", "http://b:1", "--decode", "http://c:1"])
    assert args.prefill == [["http://a:1", "8998"], ["http://b:1"]] and args.decode == [["http://c:1"]]
    assert standin_router.build_parser().parse_args([]).host == "0.0.0.0"
