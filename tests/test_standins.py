"""Tests of the stand-in SGLang server and router (supervisord_gpu.rehearsal).

They start real processes on free ports and talk to them over HTTP, the way a supervisor
would, checking the dynamics copied from SGLang 0.5.23 (shared/reference/sglang-server.md):
the port closed while loading, "\\r"-only progress, /health costing >= 1 s, the lazy SIGTERM
handler, a drain that keeps serving, children in the launcher's process group, a crash that
ends in a self-SIGKILL, leftover /dev/shm and ipc files, the JIT cache. Router tests run
against the real sglang-router 0.3.2 where it is installed, so the stand-in is held to it.

Every process a test starts carries a unique tag in its environment; the `procs` fixture's
finalizer SIGKILLs every process that carries the tag (the detached schedulers included,
which no process-group kill reaches), so nothing outlives a test, even a failed one, and it
removes the /dev/shm segments those processes had mapped. Each stand-in gets its own TMPDIR
and JIT cache directories under the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.rehearsal import standin_router, standin_server
from supervisord_gpu.rehearsal._http import StandinHTTPServer
from supervisord_gpu.sglang import exits, options, routers
from support import free_ports, stop_process, wait_for

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
SERVER = [PY, "-m", "supervisord_gpu.rehearsal.standin_server"]
STANDIN_ROUTER = [PY, "-m", "supervisord_gpu.rehearsal.standin_router"]
REAL_ROUTER = [PY, "-m", "sglang_router.launch_router"]
TAG = "SUPERVISORD_GPU_TEST_TAG"
S = standin_server

STARTUP_LINES = [
    "Load weight begin. avail mem=",
    "Load weight end. elapsed=",
    "KV Cache is allocated. dtype: torch.bfloat16, #tokens: ",
    "Memory pool end. avail mem=",
    "Capture target decode CUDA graph begin.",
    "Capture target decode CUDA graph end. bs=",
    "max_total_num_tokens=",
    "Uvicorn running on http://127.0.0.1:",
    "The server is fired up and ready to roll!",
]
STAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]"
UVICORN_LINE = re.compile(STAMP + r" (INFO|ERROR):  +")
# the main process's SIGQUIT handler once the lazy handlers are installed (after the warm-up)
RUNNING_SIGQUIT = "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
DIAGNOSTICS = "Sleeping 5 seconds before crash diagnostics to let GPU activity settle."


def have_real_router() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    return free_ports(1)[0]


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


def status(url: str, timeout: float = 3.0) -> int:
    return http("GET", url, timeout=timeout)[0]


def timed(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, float]:
    t0 = time.monotonic()
    code, _ = http(method, url, body, timeout=timeout)
    return code, time.monotonic() - t0


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def not_listening(port: int) -> bool:
    """Refused, or reset by a listener closing under a connection still in its backlog."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except (ConnectionRefusedError, ConnectionResetError):
        return True


def _shm_mapped_by(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return set()
    return {x[5].strip() for x in fields if len(x) == 6 and x[5].startswith("/dev/shm/")}


class Procs:
    """Starts tagged processes and kills every tagged process at the end (and removes its shm)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = uuid.uuid4().hex
        self.popens: list[subprocess.Popen[bytes]] = []
        self.files: set[str] = set()
        self.n = 0
        self.done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        """Every 0.1 s, what the children of our processes have mapped: a SIGKILL leaks it."""
        while not self.done.wait(0.1):
            for p in list(self.popens):
                try:
                    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                        kids = f.read().split()
                except OSError:
                    continue
                for kid in kids:
                    self.files |= _shm_mapped_by(int(kid))

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
                        if proc.status() != psutil.STATUS_ZOMBIE:
                            found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found

    def remember_shm(self) -> set[str]:
        """The /dev/shm files the tagged processes have mapped now: removed at cleanup."""
        seen: set[str] = set()
        for proc in self.tagged():
            seen |= _shm_mapped_by(proc.pid)
        self.files |= seen
        return seen

    def remember(self, paths: list[str]) -> None:
        self.files |= set(paths)

    def cleanup(self) -> None:
        self.done.set()
        self.remember_shm()
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
        for path in self.files:
            if path.startswith("/dev/shm/"):
                try:
                    os.unlink(path)
                except OSError:
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


def start_server(procs: Procs, *args: str, startup_s: float = 0.3, env: dict[str, str] | None = None,
                 sim: SimulatedGpus | None = None, mib: int = 1000,
                 port: int | None = None) -> tuple[subprocess.Popen[bytes], int, Path, Path]:
    port = free_port() if port is None else port
    tmpdir = procs.tmp / f"tmpdir-{procs.n + 1}"
    tmpdir.mkdir()
    e = {S.ENV_STARTUP_S: str(startup_s), S.ENV_MIB: str(mib), "TMPDIR": str(tmpdir),
         "SGLANG_DG_CACHE_DIR": str(procs.tmp / "cache" / "deep_gemm"),
         "TRITON_CACHE_DIR": str(procs.tmp / "cache" / "triton")}
    if sim is not None:
        e[S.ENV_SIMGPU_DIR] = str(sim.directory)
    e.update(env or {})
    argv = [*SERVER, "--model-path", "test/model", "--host", "127.0.0.1", "--port", str(port), *args]
    p, out, err = procs.start(argv, e)
    return p, port, out, err


def wait_ready(port: int, timeout: float = 15.0) -> None:
    """/ready 200: the warm-up is done (the cheap check; /health costs a second)."""
    wait_for(lambda: status(f"http://127.0.0.1:{port}/ready") == 200, timeout, interval=0.05,
             what=f"/ready 200 on {port}")


def server_info(port: int) -> dict[str, Any]:
    code, body = http("GET", f"http://127.0.0.1:{port}/server_info")
    assert code == 200, code
    return json.loads(body)


def children_of(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children() if c.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- command line and settings ----------------------------------------------------------


def test_parser_knows_every_reference_option() -> None:
    parser = options.build_parser()
    known = set(parser._option_string_actions)
    reference = options.reference_options()
    assert len(reference) == 529
    assert set(reference) <= known
    assert "--cuda-graph-max-bs" not in known


def test_parser_value_counts_and_aliases() -> None:
    a = S.parse_args([
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
    assert S.parse_args(["--model-path", "m", "--context-length", "512Ki"]).context_length == 524288


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


def test_missing_model_path_exits_1() -> None:
    r = subprocess.run([*SERVER, "--port", str(free_port())], capture_output=True, text=True, timeout=10,
                       cwd=str(REPO))
    assert r.returncode == 1 and "--model-path is required" in r.stderr


def test_gpus_from_cuda_visible_devices() -> None:
    a = S.parse_args(["--model-path", "m", "--tp-size", "2", "--base-gpu-id", "1"])
    assert S.resolve_gpus(a, {}) == [1, 2]
    assert S.resolve_gpus(a, {"CUDA_VISIBLE_DEVICES": "5,6,7"}) == [6, 7]
    assert S.resolve_gpus(a, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"},
                          {"GPU-a": 3, "GPU-b": 2, "GPU-c": 1}) == [2, 1]
    with pytest.raises(S.StartupError):
        S.resolve_gpus(a, {"CUDA_VISIBLE_DEVICES": "4"})


def test_fault_parsing() -> None:
    assert S.Fault.parse("crash-after-ready:2.5") == S.Fault("crash-after-ready", 2.5)
    assert S.Fault.parse("never-ready") == S.Fault("never-ready")
    assert S.Fault.parse("watchdog-timeout:4") == S.Fault("watchdog-timeout", 4.0)
    for bad in ("explode", "crash-after-ready", "never-ready:3", "watchdog-timeout"):
        with pytest.raises(ValueError):
            S.Fault.parse(bad)


def test_settings_from_environment() -> None:
    s = S.Settings.from_env({S.ENV_HEALTH_STALL: "12:60", S.ENV_SCHEDULERS: "detached", S.ENV_DRAIN_POLL_S: "0.5",
                             "SGLANG_HEALTH_CHECK_TIMEOUT": "7", "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1"})
    assert s.health_stall == (12.0, 60.0) and s.schedulers == "detached" and s.drain_poll_s == 0.5
    assert s.health_timeout_s == 7.0 and s.killpg_on_exception
    d = S.Settings.from_env({})
    assert d.drain_poll_s == 5.0 and d.health_timeout_s == 20.0 and d.schedulers == "children"
    assert not d.killpg_on_exception and d.jit_s == 0.0 and d.silent_s == 0.0
    for bad in ({S.ENV_HEALTH_STALL: "12"}, {S.ENV_SCHEDULERS: "orphans"}, {S.ENV_DRAIN_POLL_S: "0"}):
        with pytest.raises(ValueError):
            S.Settings.from_env(bad)


def test_model_path_is_reported_as_given_only_where_it_is_on_this_machine(tmp_path: Path) -> None:
    """Elsewhere the stand-in's tokenizer directory: the real router would take the path for a hub id."""
    assert S.reported_model_path(str(tmp_path)) == str(tmp_path)
    for absent in (str(tmp_path / "DeepSeek-V4"), "org/model"):
        assert S.reported_model_path(absent) == str(S.STANDIN_MODEL_DIR)
    tokenizer = json.loads((S.STANDIN_MODEL_DIR / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "WordLevel" and "stand-in" in tokenizer["model"]["vocab"]


def test_tqdm_bar_text_is_tqdms() -> None:
    bar = S.Bar.__new__(S.Bar)
    bar.desc, bar.total, bar.style, bar.n, bar.t0, bar.last_len = "Capturing batches (bs=256)", 20, "bar", 6, \
        time.monotonic() - 2.0, 0
    assert re.fullmatch(r"Capturing batches \(bs=256\):  30%\|███       \| 6/20 \[00:02<00:04,  3\.\d\dit/s\]",
                        bar._text()), bar._text()
    bar.desc, bar.style, bar.total, bar.n = "Loading safetensors checkpoint shards", "shards", 5, 3
    assert re.fullmatch(r"Loading safetensors checkpoint shards:  60% Completed \| 3/5 \[00:02<00:01,  1\.\d\dit/s\]",
                        bar._text()), bar._text()
    bar.n = 1  # slower than 1 it/s: tqdm shows seconds per item
    assert bar._text().endswith("s/it]"), bar._text()


# --- start-up: port, output, readiness ---------------------------------------------------


def test_port_is_closed_while_loading_and_opens_before_warmup_ends(procs: Procs, tmp_path: Path) -> None:
    ready_file = tmp_path / "ready.txt"
    t0 = time.time()
    p, port, out, err = start_server(procs, "--enable-metrics", startup_s=1.5,
                                     env={S.ENV_READY_FILE: str(ready_file)})
    base = f"http://127.0.0.1:{port}"
    time.sleep(0.6)
    assert p.poll() is None and refused(port)  # loading: nobody listens, not even a 503
    wait_for(lambda: not refused(port), 10, interval=0.02, what="port open")
    opened = time.time() - t0
    assert opened >= 1.5
    assert status(base + "/v1/models") == 200  # HTTP is up before the warm-up: not a readiness signal
    assert status(base + "/ready") == 503
    assert status(base + "/health") == 503  # at once while starting
    wait_ready(port)
    assert status(base + "/health_generate", timeout=5) == 200
    written = [float(x) for x in ready_file.read_text().split()]
    assert len(written) == 1 and t0 + opened <= written[0] + 0.01
    code, body = http("GET", base + "/metrics")
    assert code == 200 and b"sglang:num_running_reqs" in body
    code, body = http("POST", base + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
    assert code == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 4

    log = err.read_text()
    positions = [log.find(line) for line in STARTUP_LINES]
    assert all(pos >= 0 for pos in positions), log
    assert positions == sorted(positions), log  # max_total_num_tokens after the capture, uvicorn after all
    assert "model_info" in out.read_text() and "Load weight" not in out.read_text()  # stdout: access log only


def test_log_lines_carry_no_level_name_and_a_tp_rank_only_with_tp(procs: Procs) -> None:
    _, p1, _, err1 = start_server(procs)
    _, p2, _, err2 = start_server(procs, "--tp-size", "2")
    wait_ready(p1)
    wait_ready(p2)
    one = [ln for ln in err1.read_text().splitlines() if ln.startswith("[")]
    two = [ln for ln in err2.read_text().splitlines() if ln.startswith("[")]
    level_word = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b")
    assert [ln for ln in one + two if level_word.search(ln) and not UVICORN_LINE.match(ln)] == []
    assert all(re.match(STAMP + " ", ln) for ln in one), one
    assert any(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP1\] Load weight begin", ln) for ln in two), two
    assert any(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] max_total_num_tokens=", ln) for ln in two), two
    assert any(re.match(STAMP + " The server is fired up", ln) for ln in two), two  # the main process: no rank


def test_a_long_load_prints_only_carriage_returns_for_seconds(procs: Procs) -> None:
    p, port, _, err = start_server(procs, startup_s=8.0)
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 7.0 and "Capture target decode CUDA graph end" not in err.read_text():
        samples.append((time.monotonic(), err.stat().st_size))
        time.sleep(0.05)
    data = err.read_bytes()

    def appeared(offset: int) -> float:
        return next((t for t, size in samples if size > offset), samples[-1][0])

    newlines = [appeared(i) for i, b in enumerate(data) if b == 0x0A]
    gaps = [(b - a, a, b) for a, b in zip(newlines, newlines[1:])]
    longest, start, end = max(gaps)
    returns = [appeared(i) for i, b in enumerate(data) if b == 0x0D]
    assert longest >= 3.0, f"longest stretch without a newline: {longest:.1f} s"
    assert sum(start < t < end for t in returns) >= 3 * longest  # several updates a second, all "\r"
    weights = data.split(b"Load weight begin", 1)[1].split(b"Load weight end", 1)[0]
    assert weights.count(b"\n") == 2 and weights.count(b"\r") >= 10  # its own line's, then the bar's one
    assert b"Loading safetensors checkpoint shards: 100% Completed" in weights
    assert refused(port)


def test_silent_phase_prints_nothing_and_keeps_the_port_closed(procs: Procs) -> None:
    p, port, _, err = start_server(procs, env={S.ENV_SILENT_S: "2.5"})
    wait_for(lambda: "DeepGEMM" in err.read_text() and err.read_bytes().endswith(b"\n"), 10, what="JIT done")
    size = err.stat().st_size
    t_quiet = time.monotonic()
    time.sleep(1.8)
    assert err.stat().st_size == size and refused(port) and p.poll() is None
    wait_ready(port)
    assert time.monotonic() - t_quiet >= 2.0


def test_deepgemm_jit_compiles_once_then_uses_its_cache(procs: Procs, tmp_path: Path) -> None:
    env = {S.ENV_JIT_S: "2"}
    first_t0 = time.monotonic()
    p1, port1, _, err1 = start_server(procs, env=env)
    wait_for(lambda: not refused(port1), 15, interval=0.02, what="first port open")
    first = time.monotonic() - first_t0
    assert "DeepGEMM JIT warmup: compiling kernels, which may take a long time (typically 10-20 mins)" in err1.read_text()
    assert "DeepGEMM warmup: 100%" in err1.read_text()
    cached = [d for d in (tmp_path / "cache" / "deep_gemm", tmp_path / "cache" / "triton") if any(d.iterdir())]
    assert len(cached) == 2  # both caches written
    p1.kill()
    p1.wait()
    second_t0 = time.monotonic()
    _, port2, _, err2 = start_server(procs, env=env)
    wait_for(lambda: not refused(port2), 15, interval=0.02, what="second port open")
    second = time.monotonic() - second_t0
    assert "DeepGEMM JIT: using cached kernels (" in err2.read_text() and "compiling kernels" not in err2.read_text()
    assert first - second >= 1.5, f"first {first:.1f} s, second {second:.1f} s"


def test_an_unwritable_jit_cache_is_a_warning_and_compiles_every_time(procs: Procs, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {"SGLANG_DG_CACHE_DIR": str(blocker / "deep_gemm")}
    _, port, _, err = start_server(procs, env=env)
    wait_ready(port)
    _, port2, _, err2 = start_server(procs, env=env)
    wait_ready(port2)
    for e in (err, err2):
        assert "compiling kernels" in e.read_text() and "Failed to write the JIT cache" in e.read_text()


def test_server_and_model_info(procs: Procs) -> None:
    p, port, _, _ = start_server(procs, "--tp-size", "2", "--served-model-name", "served",
                                 "--disaggregation-mode", "decode")
    wait_ready(port)
    for path in ("/server_info", "/get_server_info"):
        code, body = http("GET", f"http://127.0.0.1:{port}{path}")
        info = json.loads(body)
        assert code == 200
        assert info["tp_size"] == 2 and info["dp_size"] == 1 and info["port"] == port
        # "test/model" is not on this machine: the stand-in's tokenizer directory, what the router loads
        assert info["model_path"] == info["tokenizer_path"] == str(S.STANDIN_MODEL_DIR)
        assert info["served_model_name"] == "served" and info["disaggregation_mode"] == "decode"
        assert info["version"] == "0.5.23" and info["max_total_num_tokens"] > 0
        assert sorted(info["scheduler_pids"]) == sorted(c.pid for c in children_of(p.pid))
        assert len(info["scheduler_pids"]) == 3  # two schedulers and the detokenizer
    for path in ("/model_info", "/get_model_info"):
        code, body = http("GET", f"http://127.0.0.1:{port}{path}")
        info = json.loads(body)
        assert code == 200 and info["is_generation"] is True and info["served_model_name"] == "served"
        assert info["model_path"] == info["tokenizer_path"] == str(S.STANDIN_MODEL_DIR)
    assert (S.STANDIN_MODEL_DIR / "tokenizer.json").is_file()


# --- /health, /ready, /metrics -----------------------------------------------------------


def test_health_costs_a_second_even_under_load(procs: Procs) -> None:
    _, port, _, _ = start_server(procs, "--enable-metrics")
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    code, idle = timed("GET", base + "/health")
    assert code == 200 and 1.0 <= idle < 1.6
    t = threading.Thread(target=http, args=("POST", base + "/generate",
                                            {"text": "x", "sampling_params": {"sleep": 2.5}}), kwargs={"timeout": 10})
    t.start()
    time.sleep(0.2)
    code, metrics = http("GET", base + "/metrics")
    assert re.search(rb"sglang:num_running_reqs\{[^}]*\} 1\b", metrics) and b"sglang:num_queue_reqs" in metrics
    code_ready, ready_s = timed("GET", base + "/ready")
    code, busy = timed("GET", base + "/health")
    t.join()
    assert code_ready == 200 and ready_s < 0.3  # no generation behind /ready
    assert code == 200 and 1.0 <= busy < 1.6  # joins the running batch: one step, the first 1-s poll
    code, metrics = http("GET", base + "/metrics")
    assert re.search(rb"sglang:num_running_reqs\{[^}]*\} 0\b", metrics)


def test_health_stall_makes_health_slow_but_not_ready(procs: Procs) -> None:
    _, port, _, _ = start_server(procs, env={S.ENV_HEALTH_STALL: "3:30"})
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    results: dict[str, tuple[int, float]] = {}
    t = threading.Thread(target=lambda: results.setdefault("health", timed("GET", base + "/health")))
    t.start()
    time.sleep(0.3)
    results["ready"] = timed("GET", base + "/ready")
    results["models"] = timed("GET", base + "/v1/models")  # a slow /health blocks nothing else
    t.join()
    assert results["health"][0] == 200 and 2.9 <= results["health"][1] < 4.0
    assert results["ready"][0] == 200 and results["ready"][1] < 0.3
    assert results["models"][0] == 200 and results["models"][1] < 0.3


def test_health_stall_beyond_the_timeout_is_a_503_at_the_timeout(procs: Procs) -> None:
    _, port, _, err = start_server(procs, env={S.ENV_HEALTH_STALL: "8:30", "SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    wait_ready(port)
    code, took = timed("GET", f"http://127.0.0.1:{port}/health")
    assert code == 503 and 1.9 <= took < 3.0
    assert "Health check failed. Server couldn't get a response from detokenizer for last 2 seconds." in err.read_text()
    assert status(f"http://127.0.0.1:{port}/ready") == 503  # latched UnHealthy


def test_a_failed_health_latches_ready_until_a_health_succeeds(procs: Procs) -> None:
    _, port, _, _ = start_server(procs, env={S.ENV_HEALTH_STALL: "3:4", "SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    assert timed("GET", base + "/health")[0] == 503  # the stall outlasts the timeout: UnHealthy
    assert status(base + "/ready") == 503
    time.sleep(2.2)  # the stall is over; nothing clears the latch but a /health
    assert status(base + "/ready") == 503
    code, took = timed("GET", base + "/health")
    assert code == 200 and 0.9 <= took < 1.6
    assert status(base + "/ready") == 200


def test_pause_abort_aborts_in_flight_holds_new_requests_and_latches_ready(procs: Procs) -> None:
    _, port, _, err = start_server(procs, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    results: dict[str, Any] = {}

    def gen(key: str, sleep: float) -> None:
        code, body = http("POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": sleep}}, timeout=30)
        results[key] = (code, json.loads(body), time.monotonic())

    inflight = threading.Thread(target=gen, args=("inflight", 10.0))
    inflight.start()
    time.sleep(0.3)
    code, took = timed("POST", base + "/pause_generation", {})  # default mode "abort"
    assert code == 200 and 0.9 <= took < 1.6  # abort, then checks again after 1 s: nothing left
    inflight.join(2)
    code, body, _ = results["inflight"]
    assert code == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert status(base + "/ready") == 503
    waiting = threading.Thread(target=gen, args=("waiting", 0.0))
    waiting.start()
    time.sleep(0.5)
    assert "waiting" not in results  # generate_request waits on is_pause_cond
    code, took = timed("GET", base + "/server_info")
    assert code == 200 and took < 0.5  # the scheduler still answers control requests
    code, took = timed("GET", base + "/health")
    assert code == 503 and 1.9 <= took < 2.6  # the health generation waits for the pause too
    assert "Health check failed." in err.read_text()
    continued = time.monotonic()
    code, body = http("POST", base + "/continue_generation", {})
    assert code == 200 and json.loads(body) == {"message": "Generation continued successfully.", "status": "ok"}
    waiting.join(5)
    assert results["waiting"][0] == 200 and results["waiting"][1]["meta_info"]["finish_reason"]["type"] == "length"
    assert results["waiting"][2] >= continued
    time.sleep(1.0)
    assert status(base + "/ready") == 503  # latched by the /health that failed during the pause
    assert timed("GET", base + "/health")[0] == 200
    assert status(base + "/ready") == 200


def test_pause_in_place_holds_the_batch_and_continue_resumes_it(procs: Procs) -> None:
    _, port, _, _ = start_server(procs)
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    t0 = time.monotonic()
    done: dict[str, Any] = {}
    t = threading.Thread(target=lambda: done.setdefault("r", http(
        "POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": 1.0}}, timeout=30)))
    t.start()
    time.sleep(0.3)
    code, took = timed("POST", base + "/pause_generation", {"mode": "in_place"})
    assert code == 200 and took < 0.5
    assert timed("POST", base + "/pause_generation", {"mode": "sideways"})[0] == 422
    time.sleep(1.5)
    assert "r" not in done and status(base + "/ready") == 503
    http("POST", base + "/continue_generation", {})
    t.join(5)
    assert done["r"][0] == 200 and json.loads(done["r"][1])["meta_info"]["finish_reason"]["type"] == "length"
    assert time.monotonic() - t0 >= 2.5  # 1 s of work around a 1.5 s hold
    assert status(base + "/ready") == 200  # no /health failed: nothing latched


def test_server_info_waits_for_a_stopped_scheduler_and_a_stall(procs: Procs) -> None:
    p, port, _, _ = start_server(procs)
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    scheduler = server_info(port)["scheduler_pids"][0]
    stop_process(scheduler)
    try:
        got: dict[str, tuple[int, float]] = {}
        t = threading.Thread(target=lambda: got.setdefault("info", timed("GET", base + "/server_info")))
        t.start()
        t.join(1.5)
        assert "info" not in got  # no answer, no timeout
        health = timed("GET", base + "/health", timeout=5)
    finally:
        os.kill(scheduler, signal.SIGCONT)
    t.join(3)
    assert got["info"][0] == 200 and got["info"][1] >= 1.5
    assert health[0] == 503 or health[1] >= 1.9  # a stopped scheduler answers no health either
    _, port2, _, _ = start_server(procs, env={S.ENV_HEALTH_STALL: "2:30"})
    wait_ready(port2)
    code, took = timed("GET", f"http://127.0.0.1:{port2}/server_info")
    assert code == 200 and 1.9 <= took < 2.6


def test_sigint_stops_uvicorn_kills_the_children_and_dies_of_sigint(procs: Procs) -> None:
    p, port, _, err = start_server(procs)
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    kids = children_of(p.pid)
    procs.remember(server_info(port)["stand_in_files"])
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.setdefault("r", http(
        "POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": 2.0}}, timeout=10)))
    t.start()
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGINT)
    wait_for(lambda: not_listening(port), 2, what="the listener closed")
    assert p.poll() is None  # uvicorn waits for the request in flight
    t.join(5)
    assert got["r"][0] == 200
    assert p.wait(timeout=5) == -signal.SIGINT
    log = err.read_text()
    for line in ("INFO:     Shutting down", "Waiting for connections to close. (CTRL+C to force quit)",
                 "Waiting for application shutdown.", "Application shutdown complete.",
                 f"Finished server process [{p.pid}]",
                 f"kill_process_tree called: parent_pid={p.pid}, include_parent=False", "KeyboardInterrupt"):
        assert line in log, line
    assert all(gone(k.pid) for k in kids)


def test_sigint_during_loading_kills_the_children_and_dies_of_sigint(procs: Procs) -> None:
    p, _, _, err = start_server(procs, startup_s=3.0)
    wait_for(lambda: len(children_of(p.pid)) >= 2, 5, what="children")
    kids = children_of(p.pid)
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=5) == -signal.SIGINT
    assert "kill_process_tree called" in err.read_text() and "KeyboardInterrupt" in err.read_text()
    wait_for(lambda: all(gone(k.pid) for k in kids), 3, what="children killed")


def test_multimodal_segments_live_while_a_request_runs_and_a_sigkill_leaves_them(procs: Procs) -> None:
    p, port, _, _ = start_server(procs, env={S.ENV_MM_SHM: "2"})
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    assert server_info(port)["stand_in_mm_segments"] == []  # the warm-up's were unlinked when it completed
    threading.Thread(target=http, args=("POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": 5}}),
                     kwargs={"timeout": 10}, daemon=True).start()
    segments = wait_for(lambda: server_info(port)["stand_in_mm_segments"], 3, what="segments")
    procs.remember(segments)
    assert len(segments) == 2
    for path in segments:
        assert re.fullmatch(rf"/dev/shm/sgl_shm_mm_{p.pid}_[0-9a-f]{{8}}", path), path
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
    assert not any(path in _shm_mapped_by(pr.pid) for pr in procs.tagged() for path in segments)  # nobody maps them
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=5)
    wait_for(lambda: not procs.tagged(), 3, what="children gone")
    assert all(os.path.exists(path) for path in segments)


def test_fault_watchdog_timeout_prints_the_watchdog_and_ends_in_a_self_sigkill(procs: Procs) -> None:
    p, port, out, err = start_server(procs, "--watchdog-timeout", "0.5",
                                     env={S.ENV_FAULT: "watchdog-timeout:1", S.ENV_COREDUMP_WAIT: "0"})
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    kids = children_of(p.pid)
    assert p.wait(timeout=20) == -signal.SIGKILL
    log = err.read_text()
    assert "Scheduler watchdog timeout (self.watchdog_timeout=0.5, self.soft=False)" in log, log
    assert "Scheduler debug info:" in log and "All pyspy dump attempts failed" in log
    assert log.index("Scheduler watchdog timeout") < log.index(RUNNING_SIGQUIT) < log.index(DIAGNOSTICS)
    wait_for(lambda: all(gone(k.pid) for k in kids), 3, what="children killed")
    saw = tuple(m for m in exits.MARKERS if m in log)
    assert exits.describe_exit(-signal.SIGKILL, saw) == \
        "crashed: SGLang's watchdog found a forward pass stuck, and SGLang killed itself"


def _long_generation(port: int, seconds: float) -> None:
    threading.Thread(target=http, args=("POST", f"http://127.0.0.1:{port}/generate",
                                        {"text": "x", "sampling_params": {"sleep": seconds}}),
                     kwargs={"timeout": seconds + 30}, daemon=True).start()


def test_a_pause_in_place_with_a_request_running_is_ended_by_the_schedulers_own_watchdog(procs: Procs) -> None:
    """The real SGLang 0.5.23 (H100, 2026-12-07): paused in place with 2 requests running, its
    scheduler's watchdog ended it 447 s in (--watchdog-timeout 300, looked at every 150 s); the
    front end then answered nothing through its crash diagnostics (5 s, py-spy, CUDA coredump,
    a 60 s wait) and killed itself. Here --watchdog-timeout 1: 1-1.5 s after the last step."""
    p, port, _, err = start_server(procs, "--watchdog-timeout", "1", env={S.ENV_COREDUMP_WAIT: "2"})
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    _long_generation(port, 60)
    time.sleep(0.5)
    paused_at = time.monotonic()
    assert http("POST", base + "/pause_generation", {"mode": "in_place"})[0] == 200
    wait_for(lambda: "Scheduler watchdog timeout (self.watchdog_timeout=1.0, self.soft=False)" in err.read_text(),
             10, what="the scheduler's watchdog")
    fired = time.monotonic() - paused_at
    assert 0.9 <= fired <= 6.0, fired  # (1, 1.5] s after the last step, + a poll, + a loaded machine
    wait_for(lambda: DIAGNOSTICS in err.read_text(), 8, what="the crash diagnostics")
    assert status(base + "/ready", timeout=1.0) == 0  # the event loop is blocked: no answer
    assert p.wait(timeout=15) == -signal.SIGKILL
    log = err.read_text()
    assert "Waiting 2.0 seconds for CUDA coredumps before exiting." in log
    assert log.index("Scheduler watchdog timeout") < log.index(RUNNING_SIGQUIT) < log.index(DIAGNOSTICS)


def test_a_sigterm_during_the_crash_diagnostics_is_not_handled_the_kill_comes_anyway(procs: Procs) -> None:
    """SGLang's SIGTERM handler runs on the event loop the diagnostics block: a stop sent then
    drains nothing and exits nothing; the handler's own SIGKILL ends it."""
    p, port, _, err = start_server(procs, "--watchdog-timeout", "1", env={S.ENV_COREDUMP_WAIT: "3"})
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    _long_generation(port, 60)
    time.sleep(0.5)
    assert http("POST", f"http://127.0.0.1:{port}/pause_generation", {"mode": "in_place"})[0] == 200
    wait_for(lambda: DIAGNOSTICS in err.read_text(), 10, what="the crash diagnostics")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=15) == -signal.SIGKILL
    assert "SIGTERM received" not in err.read_text()


@pytest.mark.parametrize("mode, running", [("retract", True), ("in_place", False)], ids=["retract", "in-place-idle"])
def test_a_pause_that_holds_no_batch_outlives_the_schedulers_watchdog(procs: Procs, mode: str, running: bool) -> None:
    """Retract empties the running batch, and an idle server has none: WatchdogRaw is not active."""
    p, port, _, err = start_server(procs, "--watchdog-timeout", "1")
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    if running:
        _long_generation(port, 2)
        time.sleep(0.5)
    assert http("POST", base + "/pause_generation", {"mode": mode})[0] == 200
    time.sleep(4.0)  # > 1.5 x the timeout, + a poll
    assert p.poll() is None and "Scheduler watchdog timeout" not in err.read_text()
    assert http("POST", base + "/continue_generation", {})[0] == 200
    code, _ = http("POST", base + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert code == 200


def test_a_slowed_scheduler_that_steps_within_the_timeout_is_not_ended(procs: Procs) -> None:
    p, port, _, err = start_server(procs, "--watchdog-timeout", "1")
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    assert http("POST", base + "/slow_down", {"forward_sleep_time": 0.3})[0] == 200
    _long_generation(port, 1)
    time.sleep(4.0)
    assert p.poll() is None and "Scheduler watchdog timeout" not in err.read_text()


def test_describe_exit_names_the_sigquit_and_watchdog_paths() -> None:
    saw = tuple(m for m in exits.MARKERS if m in RUNNING_SIGQUIT)  # what process.py collects from a line
    assert exits.describe_exit(-signal.SIGKILL, saw) == "crashed: SGLang got SIGQUIT and killed itself"
    assert exits.describe_exit(-signal.SIGKILL, ("SIGQUIT received", "crashed with exit code")) == \
        "crashed: SGLang killed itself after a scheduler failed"
    phrase = exits.describe_exit(-signal.SIGKILL, ("Scheduler watchdog timeout", "SIGQUIT received"))
    assert phrase == "crashed: SGLang's watchdog found a forward pass stuck, and SGLang killed itself"
    assert "self.soft" not in phrase and "signum" not in phrase  # our words, never the child's
    assert exits.describe_exit(-signal.SIGQUIT) == "killed by SIGQUIT"


# --- SIGTERM and the drain ----------------------------------------------------------------


def test_sigterm_during_loading_kills_by_signal_15_children_included(procs: Procs) -> None:
    p, port, _, err = start_server(procs, startup_s=3.0)
    wait_for(lambda: "Load weight begin" in err.read_text(), 10, what="loading")
    kids = [c.pid for c in children_of(p.pid)]
    files = procs.remember_shm()
    assert len(kids) == 2 and files
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=2) == -signal.SIGTERM  # no handler yet: the default action
    wait_for(lambda: all(gone(k) for k in kids), 3, what="children dead by PDEATHSIG")
    assert all(os.path.exists(f) for f in files)  # nobody cleaned up
    assert "SIGTERM received" not in err.read_text()


def test_after_sigterm_generate_is_still_served_until_traffic_stops_then_exit_0(procs: Procs) -> None:
    p, port, _, err = start_server(procs, env={S.ENV_DRAIN_POLL_S: "1.0"})
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    stop = threading.Event()
    codes: list[int] = []

    def client() -> None:
        while not stop.is_set():
            codes.append(http("POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": 0.3}})[0])

    clients = [threading.Thread(target=client) for _ in range(2)]
    for c in clients:
        c.start()
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received. signum=None frame=None. Draining requests and shutting down..."
             in err.read_text(), 3, what="SIGTERM line")
    assert status(base + "/health") == 503 and status(base + "/ready") == 503
    served_before = len(codes)
    time.sleep(3.5)  # several drain checks find requests in flight
    assert p.poll() is None and len(codes) >= served_before + 8
    stop.set()
    t_stop = time.monotonic()
    for c in clients:
        c.join()
    assert p.wait(timeout=5) == 0
    took = time.monotonic() - t_stop
    assert took < 1.0 + 0.3 + 0.9, f"exited {took:.1f} s after the traffic stopped"
    assert set(codes) == {200}
    log = err.read_text()
    assert re.search(r"Gracefully exiting\.\.\. Remaining number of requests [1-9]", log)
    assert "Remaining number of requests 0." in log and "Gracefully exiting... all schedulers stopped." in log


def test_idle_drain_takes_up_to_sglangs_5_s_poll_and_waits_for_requests_in_flight(procs: Procs,
                                                                               sim: SimulatedGpus) -> None:
    p, port, _, err = start_server(procs, sim=sim)  # the real 5 s period
    base = f"http://127.0.0.1:{port}"
    wait_ready(port)
    assert len(sim.holders()) == 1
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", http(
        "POST", base + "/generate", {"text": "x", "sampling_params": {"sleep": 1.5}}, timeout=15)))
    t.start()
    time.sleep(0.2)
    t_term = time.monotonic()
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in err.read_text(), 2, what="SIGTERM line")
    code, took_503 = timed("GET", base + "/health")
    assert code == 503 and took_503 < 0.3  # at once while draining, no generation
    assert p.wait(timeout=10) == 0
    took = time.monotonic() - t_term
    t.join(timeout=5)
    assert result["r"][0] == 200
    # the sigterm watchdog's 5 s clock started with the warm-up's /generate, ~0.3 s before SIGTERM
    assert 3.0 <= took <= 6.5, f"drain took {took:.1f} s"
    assert sim.holders() == [] and procs.tagged() == []


# --- processes: children, PDEATHSIG, crash path -------------------------------------------


def test_schedulers_are_children_in_the_same_group_and_die_with_the_main_process(procs: Procs,
                                                                              sim: SimulatedGpus) -> None:
    p, port, _, _ = start_server(procs, "--tp-size", "2", sim=sim, mib=5000)
    wait_ready(port)
    kids = children_of(p.pid)
    assert sorted(k.name() for k in kids) == ["sglang::detoken", "sglang::schedul", "sglang::schedul"]
    for k in kids:
        assert os.getpgid(k.pid) == os.getpgid(p.pid) and os.getsid(k.pid) == os.getsid(p.pid)
    holders = sim.holders()
    assert sorted(h.gpus for h in holders) == [(0,), (1,)] and {h.pid for h in holders} < {k.pid for k in kids}
    os.kill(p.pid, signal.SIGKILL)  # the main process alone
    p.wait(timeout=5)
    wait_for(lambda: all(gone(k.pid) for k in kids), 3, what="children killed by PDEATHSIG")
    assert sim.holders() == []


def test_a_killed_scheduler_makes_the_server_sigkill_itself(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, err = start_server(procs, "--tp-size", "2", sim=sim)
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    victim, other = sorted(h.pid for h in sim.holders())
    os.kill(victim, signal.SIGKILL)
    assert p.wait(timeout=5) == -signal.SIGKILL  # "killed by signal 9", not exit 1
    log = err.read_text()
    assert re.search(rf"Subprocess scheduler_\d \(pid={victim}\) crashed with exit code -9", log), log
    assert log.index("crashed with exit code") < log.index(RUNNING_SIGQUIT)
    wait_for(lambda: gone(other), 3, what="the other scheduler killed")
    assert sim.holders() == []


def test_an_injected_scheduler_exception_ends_in_a_self_sigkill(procs: Procs) -> None:
    p, port, _, err = start_server(procs, env={S.ENV_FAULT: "crash-after-ready:0.5"})
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    kids = children_of(p.pid)
    assert p.wait(timeout=5) == -signal.SIGKILL
    log = err.read_text()
    assert re.search(r"Scheduler hit an exception: Traceback \(most recent call last\):\n", log), log
    assert "RuntimeError: injected fault crash-after-ready:0.5" in log
    assert log.index("Scheduler hit an exception") < log.index(RUNNING_SIGQUIT)
    wait_for(lambda: all(gone(k.pid) for k in kids), 3, what="children killed")


def test_killpg_on_scheduler_exception_kills_the_launchers_whole_group(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    env = {S.ENV_STARTUP_S: "0.3", S.ENV_FAULT: "crash-after-ready:0.5", "TMPDIR": str(tmp_path),
           "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1", "SGLANG_DG_CACHE_DIR": str(tmp_path / "dg"),
           "TRITON_CACHE_DIR": str(tmp_path / "tr")}
    script = (f"sleep 60 & echo $! > {tmp_path}/sleeper; exec {' '.join(SERVER)} --model-path m "
              f"--host 127.0.0.1 --port {port}")
    launcher, _, err = procs.start(["sh", "-c", script], env)  # its own session and group: not ours
    wait_for(lambda: (tmp_path / "sleeper").exists() and (tmp_path / "sleeper").read_text().strip(), 5,
             what="sleeper pid")
    sleeper = int((tmp_path / "sleeper").read_text())
    assert os.getpgid(sleeper) == os.getpgid(launcher.pid) != os.getpgid(0)
    wait_ready(port)
    procs.remember(server_info(port)["stand_in_files"])
    assert launcher.wait(timeout=5) == -signal.SIGKILL
    wait_for(lambda: gone(sleeper), 3, what="the launcher's other process killed with the group")
    assert "Scheduler hit an exception" in err.read_text()


def test_a_busy_http_port_still_warms_up_against_its_holder_then_exits_3(procs: Procs) -> None:
    seen: list[str] = []

    class Holder(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"is_generation": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    holder = StandinHTTPServer("127.0.0.1", 0, Holder)
    threading.Thread(target=holder.serve_forever, daemon=True).start()
    try:
        port = holder.server_address[1]
        p, _, _, err = start_server(procs, port=port)
        assert p.wait(timeout=15) == 3
        log = err.read_text()
        assert f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): " \
               f"address already in use" in log
        assert seen[:2] == ["GET /model_info", "POST /generate"]  # the stranger got the warm-up
        assert "The server is fired up and ready to roll!" in log  # ... and was taken for ourselves
        assert "Uvicorn running on" not in log
        assert [c for c in procs.tagged()] == []  # its children were killed first
    finally:
        holder.shutdown()
        holder.server_close()


def test_a_busy_pd_bootstrap_port_is_only_logged(procs: Procs) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        bootstrap = held.getsockname()[1]
        p, port, _, err = start_server(procs, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                       str(bootstrap), startup_s=1.0)
        wait_for(lambda: "Failed to start the bootstrap server" in err.read_text(), 5, what="bootstrap failure line")
        assert refused(port)  # bound early, before the weights: the failure comes long before the HTTP port
        wait_ready(port)
        assert p.poll() is None and f"127.0.0.1:{bootstrap}: [Errno 98]" in err.read_text()


# --- leftover files ------------------------------------------------------------------------


def test_shm_and_ipc_files_exist_while_running_and_go_on_a_graceful_stop(procs: Procs, tmp_path: Path) -> None:
    p, port, _, _ = start_server(procs, "--tp-size", "2", env={S.ENV_DRAIN_POLL_S: "0.2"})
    wait_ready(port)
    files = server_info(port)["stand_in_files"]
    shm = [f for f in files if f.startswith("/dev/shm/")]
    ipc = [f for f in files if not f.startswith("/dev/shm/")]
    assert len(ipc) == 3 and all(f.startswith(str(tmp_path)) for f in ipc)  # TMPDIR honoured
    assert all(stat.S_ISSOCK(os.stat(f).st_mode) for f in ipc)
    assert sorted(re.sub(r"[0-9a-f]{16}$|[A-Za-z0-9]{6}$|[0-9a-f]{12}_[0-9a-f]{8}\.shm$", "*", f) for f in shm) == \
        ["/dev/shm/nccl-*", "/dev/shm/nccl-*", "/dev/shm/sgl_shm_*", "/dev/shm/sgl_shm_*", "/dev/shm/sglang_loads_*"]
    assert set(shm) <= procs.remember_shm()  # mapped by the schedulers
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0
    # SGLang's load-snapshot segment outlives every exit of the real server (the supervisor removes it)
    assert [f for f in files if os.path.exists(f)] == [f for f in shm if f.startswith(S.LOADS_PREFIX)]


def test_shm_and_ipc_files_are_left_behind_by_a_sigkill(procs: Procs) -> None:
    p, port, _, _ = start_server(procs)
    wait_ready(port)
    files = server_info(port)["stand_in_files"]
    procs.remember(files)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=5)
    wait_for(lambda: not procs.tagged(), 3, what="children gone")
    assert [f for f in files if os.path.exists(f)] == files


# --- detached schedulers (opt-in) and simulated GPU memory ----------------------------------


def test_detached_schedulers_survive_a_sigkill_of_main(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, _ = start_server(procs, "--tp-size", "2", sim=sim, mib=5000, env={S.ENV_SCHEDULERS: "detached"})
    wait_ready(port)
    holders = sim.holders()
    assert sorted(h.gpus for h in holders) == [(0,), (1,)]
    assert all(h.mib == 5000 for h in holders)
    server = psutil.Process(p.pid)
    for h in holders:
        proc = psutil.Process(h.pid)
        assert proc.ppid() != p.pid  # re-parented: not a child of the server
        assert h.pid not in {c.pid for c in server.children(recursive=True)}
        assert os.getsid(h.pid) != os.getsid(p.pid)  # own session: process-group kills miss it
        assert proc.name() == "sglang::schedul"
    procs.remember_shm()
    os.kill(p.pid, signal.SIGKILL)
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


def test_a_killed_detached_scheduler_crashes_the_server_and_the_other_stays(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, err = start_server(procs, "--tp-size", "2", sim=sim, env={S.ENV_SCHEDULERS: "detached"})
    wait_ready(port)
    procs.remember_shm()
    victim, other = sorted(h.pid for h in sim.holders())
    os.kill(victim, signal.SIGKILL)
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert RUNNING_SIGQUIT in err.read_text()
    time.sleep(0.3)
    assert [h.pid for h in sim.holders()] == [other]  # the crash path does not find it


def test_detached_schedulers_are_stopped_by_a_graceful_stop(procs: Procs, sim: SimulatedGpus) -> None:
    p, port, _, _ = start_server(procs, sim=sim, env={S.ENV_SCHEDULERS: "detached", S.ENV_DRAIN_POLL_S: "0.2"})
    wait_ready(port)
    assert len(sim.holders()) == 1
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0
    assert sim.holders() == [] and procs.tagged() == []


def test_out_of_memory_when_gpu_is_busy_exits_1_after_stopping_children(procs: Procs, sim: SimulatedGpus) -> None:
    sim.hold([0], 140000)  # this test process plays a foreign holder on GPU 0
    p, port, _, err = start_server(procs, sim=sim, mib=10000)
    assert p.wait(timeout=10) == 1
    assert "CUDA out of memory" in err.read_text()
    time.sleep(0.2)
    assert [h.pid for h in sim.holders()] == [os.getpid()] and procs.tagged() == []


# --- faults -------------------------------------------------------------------------------


def test_fault_crash_on_start_is_a_self_sigkill_half_way_through_the_weights(procs: Procs) -> None:
    p, port, _, err = start_server(procs, startup_s=2.0, env={S.ENV_FAULT: "crash-on-start"})
    wait_for(lambda: "Load weight begin" in err.read_text(), 10, what="loading")
    procs.remember_shm()
    t0 = time.monotonic()
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert time.monotonic() - t0 < 2.0
    log = err.read_text()
    assert "injected fault crash-on-start" in log and "Load weight end" not in log
    wait_for(lambda: not procs.tagged(), 3, what="children killed")


def test_fault_crash_on_start_with_detached_schedulers_leaves_orphans(procs: Procs) -> None:
    p, port, _, err = start_server(procs, startup_s=0.6,
                                   env={S.ENV_FAULT: "crash-on-start", S.ENV_SCHEDULERS: "detached"})
    assert p.wait(timeout=10) == -signal.SIGKILL
    procs.remember_shm()
    assert [pr.name() for pr in procs.tagged()] == ["sglang::schedul"]


def test_fault_never_ready(procs: Procs) -> None:
    p, port, _, err = start_server(procs, env={S.ENV_FAULT: "never-ready", S.ENV_DRAIN_POLL_S: "0.3"})
    wait_for(lambda: not refused(port), 10, what="port open")
    time.sleep(2.0)
    base = f"http://127.0.0.1:{port}"
    assert status(base + "/health") == 503 and status(base + "/ready") == 503
    assert status(base + "/v1/models") == 200 and "fired up" not in err.read_text()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=5) == 0


def test_fault_hang_on_term(procs: Procs) -> None:
    p, port, _, err = start_server(procs, env={S.ENV_FAULT: "hang-on-term"})
    wait_ready(port)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in err.read_text(), 3, what="SIGTERM log line")
    assert status(f"http://127.0.0.1:{port}/health", timeout=1.5) == 0  # no answer at all
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None


def test_fault_hang_on_term_holds_during_loading_too(procs: Procs) -> None:
    p, port, _, err = start_server(procs, startup_s=3.0, env={S.ENV_FAULT: "hang-on-term"})
    wait_for(lambda: "Load weight begin" in err.read_text(), 10, what="loading")
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in err.read_text(), 3, what="SIGTERM log line")
    time.sleep(1.0)
    assert p.poll() is None


def test_fault_exit_on_term_slow(procs: Procs) -> None:
    p, port, _, _ = start_server(procs, env={S.ENV_FAULT: "exit-on-term-slow:1.5", S.ENV_DRAIN_POLL_S: "0.3"})
    wait_ready(port)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: status(f"http://127.0.0.1:{port}/ready") == 503, 1, what="503 after SIGTERM")
    assert p.wait(timeout=5) == 0
    assert time.monotonic() - t0 >= 1.5
    assert procs.tagged() == []



@pytest.mark.parametrize("fault", ["hang-on-term", "exit-on-term-slow:5"])
def test_a_sigterm_taken_by_another_thread_still_reaches_the_main_one(procs: Procs, fault: str) -> None:
    """kill() of a process lets the kernel pick any thread; Python runs the handler in the main
    one only, which sleeps in select(): without the wakeup fd it never woke (a fault-matrix
    flake: the supervisor's SIGTERM sat unseen until its deadline). SGLang's uvicorn loop has
    the wakeup fd. kill() of a thread's id makes the kernel prefer that thread."""
    p, port, _, err = start_server(procs, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                   str(free_port()), env={S.ENV_FAULT: fault})
    wait_ready(port)
    others = [int(t) for t in os.listdir(f"/proc/{p.pid}/task") if int(t) != p.pid]
    assert others, "the stand-in serves from threads"
    os.kill(others[0], signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in err.read_text(), 3, what="SIGTERM log line")
    assert status(f"http://127.0.0.1:{port}/ready") == 503

# --- routers: the real sglang-router 0.3.2 and the stand-in ----------------------------

ROUTERS = [
    pytest.param(REAL_ROUTER, id="real-router",
                 marks=pytest.mark.skipif(not have_real_router(), reason="sglang-router not installed")),
    pytest.param(STANDIN_ROUTER, id="standin-router"),
]
#: smg 1.13.0, the router people install today (its worker list has labels, not metadata)
ROUTERS_AND_SMG = [*ROUTERS, pytest.param([PY, "-m", "smg.launch_router", "--disable-tokenizer-autoload"], id="real-smg",
                                          marks=pytest.mark.skipif(not routers.SMG.installed(), reason="smg not installed"))]


def start_router(procs: Procs, router: list[str], *args: str, prometheus_port: int | None = None,
                 port: int | None = None) -> tuple[subprocess.Popen[bytes], int, Path, Path]:
    port = free_port() if port is None else port
    prom = free_port() if prometheus_port is None else prometheus_port
    argv = [*router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom), "--policy", "round_robin", *args]
    p, out, err = procs.start(argv)
    return p, port, out, err


def wait_router_ready(port: int, workers: int = 1, timeout: float = 15.0) -> dict[str, Any]:
    """Wait for /readiness 200 with `workers` healthy workers.

    Readiness alone is not enough: both routers report ready as soon as one worker
    (PD: one prefill and one decode) is registered, before the others.
    """
    def ready() -> Any:
        code, body = http("GET", f"http://127.0.0.1:{port}/readiness")
        obj = json.loads(body) if code == 200 else None
        return obj if obj and obj["healthy_workers"] >= workers else None

    return wait_for(ready, timeout, interval=0.2, what=f"router /readiness 200 with {workers} workers")


def workers_of(port: int) -> list[dict[str, Any]]:
    code, body = http("GET", f"http://127.0.0.1:{port}/workers")
    assert code == 200
    return list(json.loads(body)["workers"])


@pytest.mark.parametrize("router", ROUTERS)
def test_router_regular_mode(procs: Procs, router: list[str]) -> None:
    _, w1, _, _ = start_server(procs)
    _, w2, _, _ = start_server(procs)
    wait_ready(w1)
    wait_ready(w2)
    rp, port, _, _ = start_router(procs, router, "--worker-urls", f"http://127.0.0.1:{w1}", f"http://127.0.0.1:{w2}")
    wait_for(lambda: status(f"http://127.0.0.1:{port}/liveness") == 200, 5, what="router port")
    ready = wait_router_ready(port, workers=2)
    assert ready["status"] == "ready" and ready["total_workers"] == 2
    for _ in range(2):
        code, body = http("POST", f"http://127.0.0.1:{port}/generate",
                          {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert code == 200, body
        assert json.loads(body)["meta_info"]["completion_tokens"] == 2
    workers = workers_of(port)
    assert {w["worker_type"] for w in workers} == {"regular"}
    assert all(w["metadata"]["tp_size"] == "1" and w["metadata"]["model_path"] == str(S.STANDIN_MODEL_DIR)
               and w["model_id"] == "test/model" for w in workers)
    rp.send_signal(signal.SIGTERM)
    assert rp.wait(timeout=10) == 0


@pytest.mark.parametrize("router", ROUTERS_AND_SMG)
def test_router_pd_mode(procs: Procs, router: list[str]) -> None:
    bootstrap = free_port()
    _, pre, _, pre_err = start_server(procs, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                      str(bootstrap), "--log-requests")
    _, dec, _, dec_err = start_server(procs, "--disaggregation-mode", "decode", "--log-requests")
    wait_ready(pre)
    wait_ready(dec)
    with socket.create_connection(("127.0.0.1", bootstrap), timeout=2):
        pass  # the prefill's bootstrap port listens
    rp, port, _, _ = start_router(procs, router, "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{pre}",
                                  str(bootstrap), "--decode", f"http://127.0.0.1:{dec}")
    ready = wait_router_ready(port, workers=2)
    assert ready["total_workers"] == 2
    code, body = http("POST", f"http://127.0.0.1:{port}/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert code == 200, body
    assert json.loads(body)["meta_info"]["completion_tokens"] == 3
    for err in (pre_err, dec_err):  # both got the request, with the bootstrap fields added
        lines = wait_for(lambda: [ln for ln in err.read_text().splitlines()
                                  if "Receive: obj=" in ln and '"bootstrap_port": ' in ln and "2.2.2.2" not in ln],
                         3, what="logged request")
        req = json.loads(lines[0].split("GenerateReqInput(", 1)[1].rstrip(")"))
        assert req["bootstrap_port"] == bootstrap and req["bootstrap_host"] == "127.0.0.1"
        assert isinstance(req["bootstrap_room"], int)
    rp.send_signal(signal.SIGTERM)
    assert rp.wait(timeout=10) == 0


@pytest.mark.parametrize("router", ROUTERS)
def test_router_adds_pd_workers_through_post_workers(procs: Procs, router: list[str]) -> None:
    bootstrap = free_port()
    _, pre, _, _ = start_server(procs, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                str(bootstrap))
    _, dec, _, _ = start_server(procs, "--disaggregation-mode", "decode")
    wait_ready(pre)
    wait_ready(dec)
    rp, port, _, _ = start_router(procs, router, "--pd-disaggregation")
    wait_for(lambda: status(f"http://127.0.0.1:{port}/liveness") == 200, 5, what="router port")
    base = f"http://127.0.0.1:{port}"
    code, body = http("POST", base + "/workers", {"url": f"http://127.0.0.1:{pre}", "worker_type": "prefill",
                                                  "bootstrap_port": bootstrap})
    reply = json.loads(body)
    assert code == 202 and reply["status"] == "accepted" and reply["location"] == f"/workers/{reply['worker_id']}"
    assert reply["message"] == "Worker addition queued for background processing"
    assert http("POST", base + "/workers", {"url": f"http://127.0.0.1:{dec}", "worker_type": "decode"})[0] == 202
    wait_router_ready(port, workers=2)
    kinds = {w["worker_type"]: w for w in workers_of(port)}
    assert kinds["prefill"]["bootstrap_port"] == bootstrap and "bootstrap_port" not in kinds["decode"]
    assert http("POST", base + "/workers", {"worker_type": "decode"})[0] == 422  # no url
    code, body = http("GET", f"{base}/workers/{reply['worker_id']}")
    assert code == 200 and json.loads(body)["url"] == f"http://127.0.0.1:{pre}"


@pytest.mark.parametrize("router", ROUTERS)
def test_router_delete_worker_takes_it_out_while_its_request_completes(procs: Procs, router: list[str]) -> None:
    token = {S.ENV_TOKEN_S: "0.1"}
    _, w1, _, _ = start_server(procs, env=token)
    _, w2, _, _ = start_server(procs, env=token)
    wait_ready(w1)
    wait_ready(w2)
    rp, port, _, _ = start_router(procs, router, "--worker-urls", f"http://127.0.0.1:{w1}", f"http://127.0.0.1:{w2}")
    base = f"http://127.0.0.1:{port}"
    wait_router_ready(port, workers=2)
    results: list[tuple[int, bytes]] = []
    threads = [threading.Thread(target=lambda: results.append(http(
        "POST", base + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 20}}, timeout=15)))
        for _ in range(2)]  # round robin: one request (2 s) on each worker
    for t in threads:
        t.start()
    time.sleep(0.5)
    victim = next(w for w in workers_of(port) if w["url"].endswith(f":{w2}"))
    code, body = http("DELETE", f"{base}/workers/{victim['id']}")
    assert code == 202 and json.loads(body) == {"status": "accepted", "worker_id": victim["id"],
                                                "message": "Worker removal queued for background processing"}
    wait_for(lambda: [w["url"] for w in workers_of(port)] == [f"http://127.0.0.1:{w1}"], 1.5, what="worker gone")
    code, body = http("GET", f"{base}/workers/{victim['id']}")
    assert code == 404 and json.loads(body)["code"] == "WORKER_NOT_FOUND"
    assert http("GET", f"{base}/workers/not-a-uuid")[0] == 400
    for t in threads:
        t.join()
    assert [r[0] for r in results] == [200, 200]  # the request already on the removed worker completed
    code, body = http("POST", f"{base}/workers", {"url": f"http://127.0.0.1:{w2}"})
    assert code == 202 and json.loads(body)["message"] == "Worker addition queued for background processing"
    wait_router_ready(port, workers=2)


@pytest.mark.parametrize("router", ROUTERS)
def test_router_metrics_port_busy_is_a_panic_and_exit_1(procs: Procs, router: list[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        rp, _, out, err = start_router(procs, router, prometheus_port=held.getsockname()[1])
        assert rp.wait(timeout=15) == 1
    text = err.read_text()
    assert "panicked at" in text and 'failed to install Prometheus metrics exporter: FailedToCreateHTTPListener(' \
        '"Address already in use (os error 98)")' in text
    assert "pyo3_runtime.PanicException" in text and out.read_text() == ""


@pytest.mark.parametrize("router", ROUTERS)
def test_router_http_port_busy_exits_1(procs: Procs, router: list[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        rp, _, out, err = start_router(procs, router, port=held.getsockname()[1])
        assert rp.wait(timeout=15) == 1
    assert "Error starting router: Address already in use (os error 98)" in err.read_text()
    assert "Starting server on 127.0.0.1:" in out.read_text()


@pytest.mark.parametrize("router", ROUTERS)
def test_router_lines_carry_ansi_colour_codes_into_a_file(procs: Procs, router: list[str]) -> None:
    rp, port, out, _ = start_router(procs, router)
    wait_for(lambda: status(f"http://127.0.0.1:{port}/readiness") == 503, 5, what="router port")
    rp.send_signal(signal.SIGTERM)
    rp.wait(timeout=10)
    text = out.read_text()
    line = re.compile(r"^\x1b\[2m\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\x1b\[0m \x1b\[32m INFO\x1b\[0m \x1b\[2msmg::server"
                      r"\x1b\[0m\x1b\[2m:\x1b\[0m \x1b\[2m[^\x1b]*src/server\.rs\x1b\[0m\x1b\[2m:\x1b\[0m"
                      r"\x1b\[2m\d+:\x1b\[0m Starting server on 127\.0\.0\.1:\d+$", re.M)
    assert line.search(text), text[:2000]
    assert re.search(r"\x1b\[31mERROR\x1b\[0m .*uri\x1b\[0m\x1b\[2m=\x1b\[0m/readiness", text)  # a 503 probe
    assert "Received terminate signal, starting graceful shutdown" in text


def test_standin_router_registers_workers_whose_health_costs_seconds(procs: Procs) -> None:
    stall = {S.ENV_HEALTH_STALL: "3:60"}
    _, w1, _, _ = start_server(procs, env=stall)
    _, w2, _, _ = start_server(procs, env=stall)
    wait_ready(w1)
    wait_ready(w2)
    t0 = time.monotonic()
    _, port, _, _ = start_router(procs, STANDIN_ROUTER, "--worker-urls", f"http://127.0.0.1:{w1}",
                                 f"http://127.0.0.1:{w2}")
    wait_router_ready(port, workers=2)
    # probed side by side (one after the other would be 12 s): each a /health within
    # --health-check-timeout-secs 5, then a /server_info, which the stalled scheduler also answers 3 s late
    assert time.monotonic() - t0 < 8.5


def test_standin_router_readiness_waits_for_a_worker_and_drains(procs: Procs) -> None:
    rp, port, out, _ = start_router(procs, STANDIN_ROUTER, "--worker-urls", "http://127.0.0.1:1")
    wait_for(lambda: status(f"http://127.0.0.1:{port}/health") == 200, 5, what="router port")
    code, body = http("GET", f"http://127.0.0.1:{port}/readiness")
    assert code == 503 and json.loads(body) == {"status": "not ready", "reason": "insufficient healthy workers"}
    code, body = http("POST", f"http://127.0.0.1:{port}/generate", {"text": "x"})
    assert code == 503 and json.loads(body)["error"]["code"] == "no_available_workers"

    _, w, _, _ = start_server(procs)
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


# -- a server spanning nodes (--nnodes / --node-rank / --dist-init-addr) ----------------------


def span(rank: int, store: int, nnodes: int = 2, timeout: int | None = None) -> list[str]:
    extra = ["--dist-timeout", str(timeout)] if timeout is not None else []
    return ["--tp-size", "2", "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--dist-init-addr", f"127.0.0.1:{store}", *extra]


def test_rank_0_waits_for_the_other_node_before_loading_and_its_port_stays_closed(procs):
    store = free_port()
    rank0, port0, _, err0 = start_server(procs, *span(0, store))
    wait_for(lambda: "Init torch distributed begin." in err0.read_text(), 10, what="the rendezvous")
    time.sleep(1.5)  # far past its 0.3 s load: it is waiting for rank 1, not loading
    assert "Load weight begin" not in err0.read_text() and status(f"http://127.0.0.1:{port0}/health") == 0
    rank1, port1, _, err1 = start_server(procs, *span(1, store))
    wait_ready(port0)
    assert "Load weight begin" in err0.read_text()
    wait_for(lambda: status(f"http://127.0.0.1:{port1}/health") == 200, 15, what="rank 1's dummy health")
    assert status(f"http://127.0.0.1:{port1}/ready") == 404  # only /ping, /health, /health_generate
    assert "Dummy health check server started in background thread at 127.0.0.1:" in err1.read_text()
    assert rank0.poll() is None and rank1.poll() is None


def test_a_missing_node_fails_the_start_at_the_dist_timeout_the_way_torch_does(procs):
    rank0, port0, _, err0 = start_server(procs, *span(0, free_port(), timeout=2))
    assert rank0.wait(15) == -signal.SIGKILL  # SGLang's SIGQUIT path: the tree, then itself
    said = err0.read_text()
    assert "Timed out after 2 seconds waiting for clients. 1/2 clients joined." in said, said
    assert "Load weight begin" not in said


def test_rank_1_ignores_sigterm_until_rank_0_goes_and_a_killed_rank_1_takes_rank_0_down(procs):
    store = free_port()
    rank0, port0, _, err0 = start_server(procs, *span(0, store))
    rank1, port1, _, err1 = start_server(procs, *span(1, store))
    wait_ready(port0)
    wait_for(lambda: status(f"http://127.0.0.1:{port1}/health") == 200, 15, what="rank 1's dummy health")
    rank1.send_signal(signal.SIGTERM)
    wait_for(lambda: "waiting for the rank-0 ShutdownReq broadcast" in err1.read_text(), 10, what="rank 1's notice")
    time.sleep(0.5)
    assert rank1.poll() is None and status(f"http://127.0.0.1:{port0}/ready") == 200
    rank0.send_signal(signal.SIGTERM)  # rank 0 drains and exits; rank 1 follows
    assert rank0.wait(30) == 0 and rank1.wait(30) == 0
    # and the other way round: rank 1 killed under a running rank 0
    store = free_port()
    rank0, port0, _, err0 = start_server(procs, *span(0, store))
    rank1, port1, _, _ = start_server(procs, *span(1, store))
    wait_ready(port0)
    rank1.kill()
    assert rank0.wait(15) == -signal.SIGKILL
    assert "Connection closed by peer [node rank 1]" in err0.read_text()


# --- PD beside the real server (issue 36: what the real pair did on the device machine) ----------


def test_a_prefill_refuses_the_fake_transfer_backend_and_exits_1() -> None:
    """`fake` is decode-only: the real prefill's ServerArgs asserts before anything starts."""
    port = free_port()
    r = subprocess.run([*SERVER, "--model-path", "test/model", "--port", str(port), "--disaggregation-mode", "prefill",
                        "--disaggregation-transfer-backend", "fake"], capture_output=True, text=True, timeout=10, cwd=str(REPO))
    assert r.returncode == 1, r.returncode
    assert "AssertionError: Prefill server does not support 'fake' as the transfer backend" in r.stderr, r.stderr
    assert "Load weight begin" not in r.stderr and refused(port)


def test_a_prefill_announces_its_bootstrap_server_early_and_holds_its_port(procs: Procs) -> None:
    """The real prefill logs "CommonKVBootstrapServer started successfully on HOST:PORT" long before
    its HTTP port opens; mooncake is accepted."""
    boot = free_port()
    p, port, _, err = start_server(procs, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                                   "--disaggregation-transfer-backend", "mooncake", startup_s=2.0)
    line = f"CommonKVBootstrapServer started successfully on 127.0.0.1:{boot}"
    wait_for(lambda: line in err.read_text(), 5, what="the bootstrap line")
    assert refused(port) and not refused(boot)
    holders = {c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr and c.laddr.port == boot}
    assert holders == {p.pid}, holders
    wait_ready(port)


def test_a_decode_refuses_a_request_no_router_paired_with_a_prefill(procs: Procs) -> None:
    """A direct /generate to the real decode: 400 "Disaggregated request received without
    bootstrap room id"; with a bootstrap room (what the router adds) it is served."""
    p, port, _, err = start_server(procs, "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake")
    wait_ready(port)
    url = f"http://127.0.0.1:{port}/generate"
    code, body = http("POST", url, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert code == 400 and b"Disaggregated request received without bootstrap room id" in body, (code, body)
    code, body = http("POST", url, {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "bootstrap_room": 7,
                                    "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998})
    assert code == 200, (code, body)
