"""A PD rehearsal behind each real router (sglang-router 0.3.2 and smg 1.13.0), in front of stand-in
servers, driven by the daemon's engine: the real binaries, not mocks. And smg's /v1/rl, played by
a local user against a router without a key (the reason `enable-rl` needs one) and against ours.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from supervisord_gpu.config.model import ProcessSpec
from supervisord_gpu.sglang import routers
from support import free_ports, make_instance, pd_profile, wait_for, write_config
from test_router_admin import PY, as_root, attack_as_nobody, http

KINDS = [
    pytest.param(("real", "sglang-router"), id="real-sglang-router", marks=pytest.mark.skipif(
        not routers.SGLANG_ROUTER.installed(), reason="sglang-router not installed")),
    pytest.param(("real", "smg"), id="real-smg", marks=pytest.mark.skipif(
        not routers.SMG.installed(), reason="smg not installed")),
    pytest.param(("standin", "smg"), id="standin-smg"),
]


@as_root
@pytest.mark.parametrize("how", KINDS)
def test_a_pd_profile_behind_each_router_starts_serves_withdraws_restores_and_stops(
        tmp_path: Path, cgroups: Any, how: tuple[str, str]) -> None:
    """Ready only once both workers are listed and a first request went through; the daemon's
    withdraw/restore of the decode waits for the change itself, not for a 202; the router's stop
    takes what that router takes (smg keeps its port 5 s after SIGTERM)."""
    kind = how[1]
    table = routers.BY_NAME[kind]
    ports = free_ports(5)
    rl = "enable-rl = true\n" if kind == "smg" else ""
    cdir = write_config(tmp_path, {"p": pd_profile(ports) + rl}, cgroups.root, startup=0.3, router=how[0],
                        router_kind=kind)
    instance, _ = make_instance(cdir, "p")
    rport = ports[2]
    router = instance.processes["router"]
    assert any(routers.SMG.module in a if kind == "smg" else routers.SGLANG_ROUTER.module in a
               for a in router.launch.argv) == (how[0] == "real")

    async def go() -> float:
        await instance.start()
        try:
            code, _, body = await asyncio.to_thread(http, "POST", rport, "/generate",
                                                    {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
            assert code == 200, body
            title = Path(f"/proc/{router.pid}/comm").read_text().strip()
            assert title == table.title[:15], title
            if kind == "smg":  # /v1/rl is behind the daemon's key: a local user gets 401
                assert await asyncio.to_thread(attack_as_nobody, rport, "GET", "/v1/rl/workers") == 401
                assert await asyncio.to_thread(attack_as_nobody, rport, "POST",
                                               "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", {}) == 401
            api = router.router_api()
            decode: ProcessSpec = instance.processes["decode"].spec
            assert await api.withdraw(decode, 10) == ""
            # out of routing: gone (0.3.2), or listed as "draining" (smg) until its requests are done
            assert all(w.get("url", "").rstrip("/") != decode.url or w.get("status") == "draining"
                       for w in await api.workers() or [])
            assert await api.restore(decode, 20) == ""
            listed = await api.workers() or []
            assert {(w["url"].rstrip("/"), w["worker_type"]) for w in listed if w.get("is_healthy")} == set(
                api.expected), listed
        finally:
            t0 = time.monotonic()
            await instance.stop()
        return time.monotonic() - t0

    took = asyncio.run(go())
    if kind == "smg":
        assert router.last_stop_s is not None and router.last_stop_s >= table.stop_listen_s, router.last_stop_s
    assert took < 60, took


@as_root
@pytest.mark.parametrize("how", [p for p in KINDS if "smg" in str(p.id)])
def test_a_local_user_pauses_every_worker_through_an_unkeyed_smg_with_enable_rl(tmp_path: Path,
                                                                               how: tuple[str, str]) -> None:
    """Why the loader refuses `enable-rl` without the key: a router started by hand with it and no
    --control-plane-api-keys hands /v1/rl (discovery, engine calls fanned out to every worker) to
    any local user. With a key, the same calls are 401."""
    port, prom = free_ports(2)
    module = routers.SMG.module if how[0] == "real" else "supervisord_gpu.rehearsal.standin_router"
    env = {**os.environ, routers.STANDIN_KIND_ENV: "smg"}
    base = [PY, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom), "--enable-rl", "--disable-tokenizer-autoload"]
    for keyed in (False, True):
        keys = ["--control-plane-api-keys", "d:daemon:admin:" + "K" * 43] if keyed else []
        p = subprocess.Popen([*base, *keys], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            wait_for(lambda: _answers(port), 20, "the router's port")
            assert attack_as_nobody(port, "GET", "/v1/rl/workers") == (401 if keyed else 200)
            # the fan-out itself (no workers here: nothing is paused, but the call is accepted)
            code = attack_as_nobody(port, "POST", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", {})
            assert (code == 401) if keyed else code not in (401, 403, 404), code
        finally:
            p.kill()
            p.wait(30)


def _answers(port: int) -> bool:
    try:
        return http("GET", port, "/liveness")[0] == 200
    except OSError:
        return False


@as_root
def test_a_pd_router_is_not_ready_while_its_first_request_answers_503(tmp_path: Path, cgroups: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The real 0.3.2 said 200 on /health and /readiness before it had its prefill worker; the first
    /generate got 503 "No prefill workers available". The daemon calls it ready only after a first
    request through it answered 200 (engine/traffic.py, router_verdict)."""
    from supervisord_gpu.engine.traffic import RouterWorkers

    answers = [(503, b'{"error":"No prefill workers available"}')] * 3
    asked: list[float] = []
    real = RouterWorkers.first_request

    async def first_request(self: RouterWorkers) -> tuple[int | None, bytes]:
        asked.append(time.monotonic())
        return answers.pop(0) if answers else await real(self)

    monkeypatch.setattr(RouterWorkers, "first_request", first_request)
    ports = free_ports(5)
    cdir = write_config(tmp_path, {"p": pd_profile(ports)}, cgroups.root, startup=0.3, router="standin")
    instance, _ = make_instance(cdir, "p")

    async def go() -> float | None:
        await instance.start()
        ready = instance.processes["router"].ready_since
        await instance.stop()
        return ready

    assert asyncio.run(go()) is not None
    assert len(asked) == 4 and not answers, asked  # three 503s, then the 200 that made it ready


@pytest.mark.parametrize("kind", [pytest.param(k, id=k.name, marks=pytest.mark.skipif(
    not k.installed(), reason=f"{k.name} not installed")) for k in routers.ROUTERS])
def test_gpusupctl_rehearse_runs_a_pd_profile_with_the_router_the_config_names(tmp_path: Path, cgroups: Any,
                                                                               kind: routers.RouterKind) -> None:
    """`router_command` as a device script sets it (python3 -m MODULE): the rehearsal runs that
    router, the real one."""
    from test_cli_local import REPO, rehearse_config_dir

    cdir = rehearse_config_dir(tmp_path, cgroups, pd_profile(free_ports(5)), "server_startup = 0.3")
    toml = cdir / "supervisord-gpu.toml"
    toml.write_text(f'[sglang]\nrouter_command = ["python3", "-m", "{kind.module}"]\n' + toml.read_text())
    r = subprocess.run([PY, "-m", "supervisord_gpu.cli.gpusupctl", "rehearse", "pd", "--config-dir", str(cdir)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "verified after stop: GPUs [0, 1] idle" in out, out
    # which router ran shows in its stop: smg keeps its port for its 5 s window, 0.3.2 exits at once
    stopped = float(re.search(r"router: stopped in ([0-9.]+) s", out).group(1))  # type: ignore[union-attr]
    assert (stopped >= kind.stop_listen_s) if kind.stop_listen_s else stopped < 2.0, out
