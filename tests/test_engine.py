"""The engine, end to end with real processes: stand-in servers, the real sglang-router, cgroups."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import StartError
from support import Recorder, alive, free_ports, make_instance, pd_profile, sim_holders, with_env, write_config


def two_servers_and_router(ports: list[int], a_extra: str = "", b_extra: str = "") -> str:
    a, b, r, m = ports
    return f"""
        [servers.alpha]
        gpus = [0]
        port = {a}
        model_path = "/m"
        {a_extra}
        [servers.beta]
        gpus = [1]
        port = {b}
        model_path = "/m"
        {b_extra}
        [router]
        port = {r}
        [router.options]
        prometheus-host = "127.0.0.1"
        prometheus-port = {m}
        """


def test_independent_servers_start_in_parallel_and_the_router_waits_for_both(tmp_path, cgroups):
    cdir = write_config(tmp_path, {"p": two_servers_and_router(free_ports(4))}, cgroups.root, startup=1.0)
    rec = Recorder()
    instance, _ = make_instance(cdir, "p", rec)

    async def go() -> None:
        await instance.start()
        assert instance.state == State.READY
        await instance.stop()

    asyncio.run(go())
    alpha_start, beta_start = rec.first("alpha", "starting"), rec.first("beta", "starting")
    alpha_ready, beta_ready = rec.first("alpha", "ready"), rec.first("beta", "ready")
    assert max(alpha_start, beta_start) < min(alpha_ready, beta_ready), "servers were not started in parallel"
    assert rec.first("router", "starting") >= max(alpha_ready, beta_ready)


def test_a_server_answering_503_for_5s_delays_its_dependants(tmp_path, cgroups):
    ports = free_ports(4)
    slow = '[servers.alpha.env]\nSUPERVISORD_GPU_STANDIN_STARTUP_S = "5"'
    cdir = write_config(tmp_path, {"p": two_servers_and_router(ports, a_extra=slow)}, cgroups.root, startup=0.3)
    rec = Recorder()
    instance, _ = make_instance(cdir, "p", rec)

    async def go() -> None:
        await instance.start()
        await instance.stop()

    asyncio.run(go())
    assert rec.first("alpha", "ready") - rec.first("alpha", "starting") >= 5.0
    assert rec.first("router", "starting") >= rec.first("alpha", "ready")
    assert rec.first("beta", "ready") < rec.first("alpha", "ready")


@pytest.mark.parametrize("who", ["alpha", "beta"])
def test_start_failure_of_one_process_stops_all_others_and_names_it(tmp_path, cgroups, who):
    ports = free_ports(4)
    fault = f'[servers.{who}.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "crash-on-start"'
    other = "beta" if who == "alpha" else "alpha"
    text = two_servers_and_router(ports, **{("a_extra" if who == "alpha" else "b_extra"): fault})
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=1.0)
    instance, _ = make_instance(cdir, "p")

    async def go() -> str:
        with pytest.raises(StartError) as info:
            await instance.start()
        return str(info.value)

    message = asyncio.run(go())
    assert message.startswith(f"{who}: exited during start-up (crashed: SGLang killed itself after a scheduler failed)\n"
                              "  last error: RuntimeError: injected fault crash-on-start"), message
    assert "last lines" in message
    assert instance.state == State.FAILED
    assert instance.processes[other].state == State.STOPPED
    assert cgroups.all_pids() == []
    assert sim_holders(tmp_path) == []


def test_a_start_failed_from_outside_stops_what_started_and_names_why_and_only_while_it_runs(tmp_path, cgroups):
    """What the controller does when another node's part of the same start failed: the start
    under way fails with that reason, whatever had started is stopped; with no start under
    way (before it, after it) there is nothing to fail."""
    ports = free_ports(4)
    cdir = write_config(tmp_path, {"p": two_servers_and_router(ports)}, cgroups.root, startup=1.0)
    instance, _ = make_instance(cdir, "p")
    why = StartError("cluster transition to p: step 3 failed on node 'b': start of dsv4@p.service: failed")

    async def go() -> tuple[bool, bool, str]:
        before = instance.fail_start(why)
        starting = asyncio.ensure_future(instance.start())
        while not any(p.pid for p in instance.processes.values()):
            await asyncio.sleep(0.05)
        during = instance.fail_start(why)
        with pytest.raises(StartError) as info:
            await starting
        return before, during, str(info.value)

    before, during, message = asyncio.run(go())
    assert (before, during, message) == (False, True, str(why))
    assert instance.state == State.FAILED and cgroups.all_pids() == [] and sim_holders(tmp_path) == []

    async def again() -> bool:
        await instance.start()
        after = instance.fail_start(why)
        await instance.stop()
        return after

    assert asyncio.run(again()) is False and instance.state == State.STOPPED  # ready: not a start any more


def test_stop_order_is_router_then_decode_then_prefill(tmp_path, cgroups):
    cdir = write_config(tmp_path, {"pd": pd_profile(free_ports(5))}, cgroups.root)
    rec = Recorder()
    instance, _ = make_instance(cdir, "pd", rec)

    async def go() -> None:
        await instance.start()
        await instance.stop()

    asyncio.run(go())
    assert rec.order("stopping") == ["router", "decode", "prefill"]
    stopped = {p: rec.first(p, "stopped") for p in ("router", "decode", "prefill")}
    assert rec.first("decode", "stopping") >= stopped["router"]
    assert rec.first("prefill", "stopping") >= stopped["decode"]
    assert cgroups.all_pids() == []


def test_same_role_servers_stop_together_so_two_hung_drains_cost_one_deadline(tmp_path, cgroups):
    hung = 'stop_timeout = 1.0\n[servers.{0}.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "hang-on-term"'
    text = two_servers_and_router(free_ports(4), a_extra=hung.format("alpha"), b_extra=hung.format("beta"))
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3)
    rec = Recorder()
    instance, _ = make_instance(cdir, "p", rec)

    async def go() -> float:
        await instance.start()
        return await instance.stop()

    took = asyncio.run(go())
    router_stopped = rec.first("router", "stopped")
    assert min(rec.first("alpha", "stopping"), rec.first("beta", "stopping")) >= router_stopped
    assert max(rec.first("alpha", "stopping"), rec.first("beta", "stopping")) < min(
        rec.first("alpha", "stopped"), rec.first("beta", "stopped")), "the two servers were stopped one after the other"
    assert 1.0 <= took < 2.0  # one deadline, not two
    assert cgroups.all_pids() == []
    assert sim_holders(tmp_path) == []


def test_a_process_that_ignores_sigterm_is_killed_at_its_stop_deadline(tmp_path, cgroups):
    ports = free_ports(1)
    text = f"""
        [servers.stubborn]
        gpus = [0]
        port = {ports[0]}
        model_path = "/m"
        stop_timeout = 1.0
        [servers.stubborn.env]
        SUPERVISORD_GPU_STANDIN_FAULT = "hang-on-term"
        """
    cdir = write_config(tmp_path, {"p": text}, cgroups.root)
    instance, _ = make_instance(cdir, "p")

    async def go() -> float:
        await instance.start()
        began = time.monotonic()
        await instance.processes["stubborn"].stop()
        return time.monotonic() - began

    took = asyncio.run(go())
    assert 1.0 <= took < 1.0 + 0.1 + 0.4  # deadline, the kill, and reaping on a loaded 2-core box
    assert cgroups.all_pids() == []
    assert sim_holders(tmp_path) == []


DETACHED = {"SUPERVISORD_GPU_STANDIN_SCHEDULERS": "detached"}  # schedulers that escaped to PID 1: the orphan case


def test_the_detached_grandchild_of_a_stand_in_does_not_survive_a_stop(tmp_path, cgroups):
    text = with_env(with_env(pd_profile(free_ports(5)), "prefill", **DETACHED), "decode", **DETACHED)
    cdir = write_config(tmp_path, {"pd": text}, cgroups.root)
    instance, _ = make_instance(cdir, "pd")

    async def go() -> list[int]:
        await instance.start()
        grandchildren = sim_holders(tmp_path)
        main_pids = {p.pid for p in instance.processes.values()}
        assert grandchildren and not set(grandchildren) & main_pids
        for pid in grandchildren:
            assert os.getppid() != pid
        await instance.stop()
        return grandchildren

    for pid in asyncio.run(go()):
        assert not alive(pid)
    assert sim_holders(tmp_path) == []


def test_killing_the_main_process_restarts_it_and_frees_its_orphans(tmp_path, cgroups):
    cdir = write_config(tmp_path, {"pd": with_env(pd_profile(free_ports(5)), "decode", **DETACHED)}, cgroups.root)
    rec = Recorder()
    instance, _ = make_instance(cdir, "pd", rec)

    async def go() -> None:
        await instance.start()
        decode = instance.processes["decode"]
        old_pid = decode.pid
        orphans_before = set(sim_holders(tmp_path))
        os.kill(old_pid, signal.SIGKILL)  # the main only: its detached scheduler keeps "GPU memory"
        for _ in range(400):
            await asyncio.sleep(0.05)
            if instance.state == State.READY and decode.pid != old_pid:  # ready, and back in the router
                break
        assert decode.state == State.READY and decode.pid != old_pid
        assert decode.restarts_total == 1
        assert instance.state == State.READY
        leftover = orphans_before - set(sim_holders(tmp_path))
        assert leftover, "the killed server's detached scheduler should have been killed with its cgroup"
        await instance.stop()

    asyncio.run(go())
    assert [e.state for e in rec.events if e.kind == "instance"][-4:] == ["degraded", "ready", "stopping", "stopped"]


def test_restarts_back_off_and_the_instance_fails_past_the_limit(tmp_path, cgroups):
    ports = free_ports(1)
    text = f"""
        [restart]
        max_restarts = 2
        backoff_initial = 0.3
        backoff_max = 5
        [servers.flaky]
        gpus = [0]
        port = {ports[0]}
        model_path = "/m"
        [servers.flaky.env]
        SUPERVISORD_GPU_STANDIN_FAULT = "crash-after-ready:0.2"
        """
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.2)
    rec = Recorder()
    instance, _ = make_instance(cdir, "p", rec)

    async def go() -> None:
        await instance.start()
        await asyncio.wait_for(instance.failed.wait(), 30)

    asyncio.run(go())
    assert instance.state == State.FAILED
    assert "restart limit reached (2/2" in instance.reason
    restarting = [e for e in rec.events if e.kind == "process" and e.state == "restarting" and "; restart" in e.message]
    assert [e.message.split("; ")[1] for e in restarting] == ["restart 1 in 0.3 s", "restart 2 in 0.6 s"]
    assert cgroups.all_pids() == []


def test_a_decoy_with_a_matching_command_line_survives_start_stop_and_restart(tmp_path, cgroups, decoy):
    cdir = write_config(tmp_path, {"pd": pd_profile(free_ports(5))}, cgroups.root)
    instance, _ = make_instance(cdir, "pd")

    async def go() -> None:
        await instance.start()
        await instance.restart_process("decode")
        await instance.stop()

    asyncio.run(go())
    assert decoy.poll() is None and alive(decoy.pid)


def test_a_stop_we_asked_for_is_not_reported_with_the_processes_last_complaint(tmp_path, cgroups):
    """The real router logs an ERROR for each 503 our readiness probe got while it started; its
    clean exit after our SIGTERM must not be reported with that line. A kill nobody asked for
    keeps the last error line: there it may be the why."""
    cdir = write_config(tmp_path, {"p": two_servers_and_router(free_ports(4))}, cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "p", Recorder())

    async def go() -> None:
        await instance.start()
        alpha = instance.processes["alpha"]
        alpha.last_error = "RuntimeError: something alpha said earlier"
        os.kill(alpha.pid, signal.SIGKILL)
        for _ in range(400):  # read before the restart's backoff ends (a new run forgets the line)
            await asyncio.sleep(0.02)
            if alpha.exit_code is not None:
                break
        assert alpha.exit_report == "killed by SIGKILL: RuntimeError: something alpha said earlier"
        router = instance.processes["router"]
        router.last_error = "ERROR http_request{uri=/readiness status_code=503}"
        await instance.stop()
        assert router.exit_code == 0 and router.exit_report == "exit code 0", router.exit_report

    asyncio.run(go())
