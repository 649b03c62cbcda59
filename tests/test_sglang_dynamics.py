"""The supervisor against SGLang's real dynamics (the stand-in copies its timing and failure modes).

Late HTTP port, `\\r`-only progress bars, a /health that costs a generation, a drain that keeps
serving, children in the launcher's process group, a crash that ends in SGLang SIGKILLing
itself, leaked /dev/shm and ipc files: each test shows the supervisor doing the right thing
where the earlier one would have failed a healthy start, killed a busy server, reported a
stranger ready, or cut requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import StartError
from supervisord_gpu.api.notify import Notifier
from support import Recorder, RequestLoop, alive, free_ports, make_instance, pd_profile, wait_for, write_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def one_server(port: int, env: dict[str, str] | None = None, extra: str = "", name: str = "server") -> str:
    lines = "\n".join(f'{k} = "{v}"' for k, v in (env or {}).items())
    return f"""
        [servers.{name}]
        gpus = [0]
        port = {port}
        model_path = "/models/test"
        {extra}
        [servers.{name}.env]
        {lines}
        """


def server_info(port: int) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- progress


def test_carriage_return_progress_bars_count_as_output_and_name_the_phase(tmp_path, cgroups):
    (port,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": one_server(port)}, cgroups.root, startup=6.0)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> tuple[float, set[str], set[str]]:
        start = asyncio.ensure_future(instance.start())
        quiet, phases, bars = 0.0, set(), set()
        while not start.done():
            await asyncio.sleep(0.2)
            if proc.last_output_at is not None and proc.phase in ("loading weights", "capturing CUDA graphs"):
                quiet = max(quiet, time.monotonic() - proc.last_output_at)
            phases.add(proc.phase)
            if proc.progress_text:
                bars.add(proc.progress_text.split(":")[0])
        await start
        await instance.stop()
        return quiet, phases, bars

    quiet, phases, bars = asyncio.run(go())
    # the stand-in prints no "\n" for seconds while a bar redraws itself: output was seen all along
    assert quiet < 1.5, f"no output counted for {quiet:.1f} s during a progress bar"
    assert {"loading weights", "capturing CUDA graphs"} <= phases
    assert "Loading safetensors checkpoint shards" in bars


# --------------------------------------------------------------------------- liveness


def test_a_busy_server_whose_health_takes_12_s_for_a_minute_stays_up(tmp_path, cgroups):
    """SGLang's /health runs a generation and takes long on a busy healthy server; liveness asks
    its cheap /ready instead, with the shipped tolerances (only probed more often here)."""
    (port,) = free_ports(1)
    env = {"SUPERVISORD_GPU_STANDIN_HEALTH_STALL": "12:60", "SUPERVISORD_GPU_STANDIN_TOKEN_S": "0.05"}
    text = one_server(port, env, extra="probe = { liveness_interval = 1 }")
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]

    async def go() -> tuple[float, list[str]]:
        await instance.start()
        pid = proc.pid
        with RequestLoop(f"http://127.0.0.1:{port}", clients=2, tokens=40) as loop:  # ~2 s per request
            began = time.monotonic()
            slow = await asyncio.to_thread(_timed_get, f"http://127.0.0.1:{port}/health")
            while time.monotonic() - began < 62:
                await asyncio.sleep(1)
                assert proc.state == State.READY and proc.pid == pid, f"{proc.state} {proc.last_exit}"
        await instance.stop()
        return slow, loop.lost

    slow, lost = asyncio.run(go())
    assert slow >= 12, "the stand-in's /health was not stalled: the test would prove nothing"
    assert proc.restarts_total == 0 and lost == []


def _timed_get(url: str) -> float:
    began = time.monotonic()
    with urllib.request.urlopen(url, timeout=60) as r:
        r.read()
    return time.monotonic() - began


def test_a_sigstopped_server_is_killed_within_its_liveness_bound_and_restarted(tmp_path, cgroups):
    (port,) = free_ports(1)
    probe = "probe = { liveness_interval = 0.5, liveness_timeout = 1, failures = 2 }"
    cdir = write_config(tmp_path, {"p": one_server(port, extra=probe)}, cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "p")
    proc = instance.processes["server"]
    bound = proc.spec.probe.liveness_bound_s

    async def go() -> float:
        await instance.start()
        pid = proc.pid
        os.kill(pid, signal.SIGSTOP)
        began = time.monotonic()
        while proc.pid == pid and proc.exit_code is None:
            await asyncio.sleep(0.05)
        took = time.monotonic() - began
        await asyncio.wait_for(_until(lambda: proc.state == State.READY), 30)
        await instance.stop()
        return took

    took = asyncio.run(go())
    assert took <= bound + 1.0, f"killed {took:.1f} s after SIGSTOP; bound {bound:g} s"
    assert proc.restarts_total == 1


async def _until(pred) -> None:  # type: ignore[no-untyped-def]
    while not pred():
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- readiness


FOREIGN_HTTP = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
        do_POST = do_GET
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """)


def _as_nobody() -> list[str]:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return []
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []


def test_a_stranger_grabbing_the_port_while_the_server_loads_fails_the_start_naming_it(tmp_path, cgroups):
    (port,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": one_server(port)}, cgroups.root, startup=4.0)
    instance, _ = make_instance(cdir, "p")
    sent: list[str] = []
    Notifier(send=sent.append).attach(instance)
    proc = instance.processes["server"]

    async def go() -> tuple[str, int]:
        start = asyncio.ensure_future(instance.start())
        await _until(lambda: proc.phase == "loading weights")
        stranger = subprocess.Popen([*_as_nobody(), sys.executable, "-c", FOREIGN_HTTP, str(port)])
        try:
            with pytest.raises(StartError) as info:
                await start
        finally:
            stranger.kill()
            stranger.wait()
        return str(info.value), stranger.pid

    message, pid = asyncio.run(go())
    assert f"is held by pid {pid}" in message and "(foreign)" in message, message
    if _as_nobody():
        assert "(user nobody)" in message
    assert "READY=1" not in sent
    assert instance.state == State.FAILED and cgroups.all_pids() == []


# --------------------------------------------------------------------------- traffic


def two_workers_behind_a_router(ports: list[int], token_s: str = "0.01") -> str:
    a, b, r, m = ports
    env = f'[servers.{{0}}.env]\nSUPERVISORD_GPU_STANDIN_TOKEN_S = "{token_s}"'
    return f"""
        [servers.alpha]
        gpus = [0]
        port = {a}
        model_path = "/m"
        {env.format("alpha")}
        [servers.beta]
        gpus = [1]
        port = {b}
        model_path = "/m"
        {env.format("beta")}
        [router]
        port = {r}
        [router.options]
        policy = "round_robin"
        prometheus-host = "127.0.0.1"
        prometheus-port = {m}
        """


def test_restarting_one_of_two_servers_behind_a_live_router_fails_no_request(tmp_path, cgroups, capsys):
    ports = free_ports(4)
    cdir = write_config(tmp_path, {"p": two_workers_behind_a_router(ports)}, cgroups.root, startup=0.5)
    rec = Recorder()
    instance, _ = make_instance(cdir, "p", rec)

    async def go() -> RequestLoop:
        await instance.start()
        with RequestLoop(f"http://127.0.0.1:{ports[2]}", clients=3) as loop:  # 0.3 s per request
            await asyncio.sleep(1.0)
            before = loop.ok
            await instance.restart_process("alpha")
            await asyncio.sleep(1.0)
        assert loop.ok > before
        await instance.stop()
        return loop

    loop = asyncio.run(go())
    assert loop.lost == [] and loop.unavailable == 0 and loop.refused == 0, loop.summary()
    log = capsys.readouterr().err
    assert "alpha: taken out of router" in log and "alpha: back in router" in log, log[-2000:]
    assert instance.processes["alpha"].restarts_total == 1


def test_restarting_decode_behind_the_pd_router_cuts_no_request_it_had_accepted(tmp_path, cgroups):
    ports = free_ports(5)
    token = 'SUPERVISORD_GPU_STANDIN_TOKEN_S = "0.01"'
    text = pd_profile(ports, prefill_extra="", decode_extra="") + (
        f"\n[servers.prefill.env]\n{token}\n[servers.decode.env]\n{token}\n")
    cdir = write_config(tmp_path, {"pd": text}, cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "pd")

    async def go() -> RequestLoop:
        await instance.start()
        with RequestLoop(f"http://127.0.0.1:{ports[2]}", clients=3) as loop:
            await asyncio.sleep(1.0)
            await instance.restart_process("decode")
            await asyncio.sleep(1.5)
        await instance.stop()
        return loop

    loop = asyncio.run(go())
    # with its only decode server out of the router, new requests are refused (503), never cut
    assert loop.lost == [] and loop.ok > 5, loop.summary()


# --------------------------------------------------------------------------- process groups


def test_a_server_that_sigkills_its_own_process_group_is_restarted_and_the_daemon_lives(tmp_path, cgroups):
    """SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1: a failing scheduler SIGKILLs its process group. Every
    child has a session and group of its own, so that is the server alone, not the daemon."""
    (port,) = free_ports(1)
    env = {"SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1", "SUPERVISORD_GPU_STANDIN_FAULT": "crash-after-ready:1"}
    text = "[restart]\nmax_restarts = 1\nbackoff_initial = 0.2\n" + one_server(port, env)
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    daemon = subprocess.run([str(REPO / ".venv/bin/supervisord-gpu"), "run", "p", "--config-dir", str(cdir), "--stderr"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "NOTIFY_SOCKET": ""})
    out = daemon.stderr
    assert daemon.returncode == 6, out[-3000:]  # its own verdict (restart limit: final, EXIT_GAVE_UP), not a signal
    assert "restart 1/1" in out and "restart limit reached (1/1" in out, out[-3000:]
    assert out.count("server: ready") == 2
    assert cgroups.all_pids() == []


def test_ctrl_c_of_rehearse_hold_stops_router_then_decode_then_prefill(tmp_path, cgroups):
    """A terminal's Ctrl-C is SIGINT to the foreground process group: only gpusupctl is in it."""
    ports = free_ports(5)
    cdir = write_config(tmp_path, {"pd": pd_profile(ports)}, cgroups.root, startup=0.5)
    proc = subprocess.Popen([str(REPO / ".venv/bin/gpusupctl"), "rehearse", "pd", "--hold", "--config-dir", str(cdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("POST "):  # ready, and the demo request answered
            break
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out[-3000:]
    stopped = [l.split()[1] for l in out.splitlines() if l.strip().endswith(" stopped") and "==" not in l]
    assert stopped == ["router", "decode", "prefill"], out[-3000:]
    assert "verified after stop" in out
    assert cgroups.all_pids() == []


# --------------------------------------------------------------------------- exits and leftovers


def test_a_crash_is_reported_as_sglang_killing_itself_with_its_last_error(tmp_path, cgroups):
    (port,) = free_ports(1)
    text = "[restart]\nmode = \"never\"\n" + one_server(port, {"SUPERVISORD_GPU_STANDIN_FAULT": "crash-after-ready:0.5"})
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")

    async def go() -> None:
        await instance.start()
        await asyncio.wait_for(instance.failed.wait(), 30)

    asyncio.run(go())
    server = instance.processes["server"]
    assert server.last_exit == "crashed: SGLang killed itself after a scheduler failed", server.last_exit
    assert server.last_error.startswith("RuntimeError: injected fault crash-after-ready"), server.last_error
    assert "injected fault" not in instance.reason  # the child's words stay out of STATUS= and the bus


def test_no_shared_memory_or_ipc_file_of_a_killed_server_remains_and_the_other_servers_stay(tmp_path, cgroups):
    ports = free_ports(2)
    text = one_server(ports[0], name="alpha") + one_server(ports[1], name="beta").replace("gpus = [0]", "gpus = [1]")
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")

    async def go() -> tuple[list[str], list[str]]:
        await instance.start()
        alpha_files = (await asyncio.to_thread(server_info, ports[0]))["stand_in_files"]
        beta_files = (await asyncio.to_thread(server_info, ports[1]))["stand_in_files"]
        alpha = instance.processes["alpha"]
        pid = alpha.pid
        os.kill(pid, signal.SIGKILL)  # no clean-up of its own: its children die by PDEATHSIG
        await asyncio.wait_for(_until(lambda: alpha.state == State.READY and alpha.pid != pid), 30)
        left_alpha = [f for f in alpha_files if os.path.exists(f)]
        kept_beta = [f for f in beta_files if os.path.exists(f)]
        assert kept_beta == beta_files, "another server's files were touched"
        await instance.stop()
        return left_alpha, alpha_files

    left, files = asyncio.run(go())
    assert any(f.startswith("/dev/shm/") for f in files) and any(not f.startswith("/dev/shm/") for f in files)
    assert left == [], f"left behind by the killed server: {left}"


def test_the_load_snapshot_segment_of_a_server_that_crashes_at_init_does_not_leak(tmp_path, cgroups):
    """The real tp1bad (an architecture SGLang does not know) crashed a second after its scheduler
    made /dev/shm/sglang_loads_*.shm, between two of our phase scans, and it leaked (the H100 PD
    run of 2026-12-07). The stand-in's crash-at-init does the same; the /dev/shm watch records it."""
    from supervisord_gpu.rehearsal.standin_server import loads_path

    (port,) = free_ports(1)
    loads_id = os.urandom(6).hex()
    path = loads_path(loads_id)
    env = {"SUPERVISORD_GPU_STANDIN_FAULT": "crash-at-init", "SUPERVISORD_GPU_STANDIN_LOADS_ID": loads_id}
    text = "[restart]\nmode = \"never\"\n" + one_server(port, env)
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=2.0)
    instance, _ = make_instance(cdir, "p")

    async def go() -> str:
        try:
            await instance.start()
        except StartError as e:
            return str(e)
        return "started"

    try:
        said = asyncio.run(go())
        assert said.startswith("server: exited during start-up"), said
        assert "crash-at-init" in instance.processes["server"].last_error
        assert not os.path.exists(path), f"{path} leaked"
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_sglangs_create_and_close_multimodal_segments_of_a_killed_server_go_and_another_servers_stay(tmp_path, cgroups):
    """sgl_shm_mm_<creator pid>_<hex>: created and closed at once, mapped by nobody after a crash,
    so only the creator PID in the name ties them to a server (upstream issue 40723)."""
    ports = free_ports(2)
    env = {"SUPERVISORD_GPU_STANDIN_MM_SHM": "2"}
    text = one_server(ports[0], env, name="alpha") + one_server(ports[1], env, name="beta").replace("gpus = [0]", "gpus = [1]")
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    instance, _ = make_instance(cdir, "p")
    body = json.dumps({"text": "an image", "sampling_params": {"sleep": 12}}).encode()

    def in_flight(port: int) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:
            pass

    async def go() -> tuple[list[str], list[str], list[str]]:
        await instance.start()
        for port in ports:
            asyncio.get_running_loop().run_in_executor(None, in_flight, port)
        await asyncio.to_thread(wait_for, lambda: all(server_info(p)["stand_in_mm_segments"] for p in ports), 10)
        alpha_mm = server_info(ports[0])["stand_in_mm_segments"]
        beta_mm = server_info(ports[1])["stand_in_mm_segments"]
        alpha = instance.processes["alpha"]
        pid = alpha.pid
        alpha.spawned.group.kill_all()  # SIGKILL to its whole cgroup: nobody unlinks them
        await asyncio.wait_for(_until(lambda: alpha.state == State.READY and alpha.pid != pid), 30)
        left = [f for f in alpha_mm if os.path.exists(f)]
        kept = [f for f in beta_mm if os.path.exists(f)]
        await instance.stop()
        return alpha_mm, left, kept

    alpha_mm, left, kept = asyncio.run(go())
    assert alpha_mm and all(os.path.basename(f).startswith("sgl_shm_mm_") for f in alpha_mm)
    assert left == [], f"left behind by the killed server: {left}"
    assert kept, "another server's segments were removed"


def test_a_restart_does_not_recompile_its_kernels(tmp_path, cgroups):
    (port,) = free_ports(1)
    cdir = write_config(tmp_path, {"p": one_server(port, {"SUPERVISORD_GPU_STANDIN_JIT_S": "3"})}, cgroups.root,
                        startup=0.3)
    rec = Recorder()
    instance, cfg = make_instance(cdir, "p", rec)

    proc = instance.processes["server"]

    async def go() -> tuple[float, float]:
        await instance.start()
        first = proc.phase_durations["total"]  # launch to ready
        await instance.restart_process("server")
        second = proc.phase_durations["total"]
        await instance.stop()
        return first, second

    first, second = asyncio.run(go())
    assert first - second >= 2.0, f"first start {first:.1f} s to ready, restart {second:.1f} s: it compiled again"
    root = cfg.cache_dir / pwd.getpwuid(os.geteuid()).pw_name
    assert (os.stat(root).st_mode & 0o777) == 0o700
    assert any((root / "sglang" / "deep_gemm").iterdir()), "nothing cached where SGLANG_DG_CACHE_DIR points"
