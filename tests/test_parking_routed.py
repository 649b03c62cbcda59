"""Parking a profile with a router (issue 39), end to end on CPU: stand-in server and router on
simulated GPUs under cgroups. Not systemd.

A park takes the servers out of the router; the restore's proof of serving is one generation
through the router: it must find them routed to again, or every routed profile comes back cold.
A router on a port the next profile needs (the shipped pd-1p1d and tp4-512k share 30001) is
stopped at the park, after the drain, and started again at the restore, after the servers.
"""

from __future__ import annotations

import asyncio
import socket
import time

from supervisord_gpu.api.notify import status_text
from supervisord_gpu.checks.ports import check_ports
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.controller.parking import one_generation
from supervisord_gpu.engine.states import InstanceState, ProcessState
from supervisord_gpu.errors import ParkRefused
from supervisord_gpu.parking.checkpointer import CheckpointError
from supervisord_gpu.parking.simulated import SimulatedCheckpointer
from test_parking_engine import sim_parker
from support import free_ports, make_instance, sim_holders, write_config


def test_a_routed_profile_is_restored_warm_not_started_cold(tmp_path, cgroups):
    port, router_port, metrics = free_ports(3)
    routed = f"""
        [servers.main]
        gpus = [0]
        port = {port}
        model_path = "/m"
        [router]
        port = {router_port}
        workers = ["main"]
        [router.options]
        prometheus-port = {metrics}
        """
    cdir = write_config(tmp_path, {"a": routed}, cgroups.root, startup=0.3)
    a, _cfg = make_instance(cdir, "a")
    sim, parker, said = sim_parker(tmp_path)

    async def go() -> None:
        await a.start()
        try:
            main_pid = a.processes["main"].pid
            scheduler = sim_holders(tmp_path)
            await parker.park(a)
            assert a.state == InstanceState.PARKED
            verdict = await parker.restore(a, a.start)
            assert verdict.serve, verdict.say
            assert a.state == InstanceState.READY and a.processes["main"].pid == main_pid, "started cold"
            assert sim_holders(tmp_path) == scheduler
            workers = await a.processes["router"].router_api().workers()
            assert [w.get("url") for w in workers or []] == [f"http://127.0.0.1:{port}"], workers
        finally:
            await a.stop()

    asyncio.run(go())


def routed(port: int, router_port: int, metrics: int) -> str:
    return f"""
        [servers.main]
        gpus = [0]
        port = {port}
        model_path = "/m"
        [router]
        host = "127.0.0.1"
        port = {router_port}
        workers = ["main"]
        [router.options]
        prometheus-port = {metrics}
        """


def two_on_one_router_port(tmp_path, cgroups):  # type: ignore[no-untyped-def]
    """Profiles a and b on GPU 0, each a server behind a router, both routers on one port."""
    pa, pb, router_port, ma, mb = free_ports(5)
    cdir = write_config(tmp_path, {"a": routed(pa, router_port, ma), "b": routed(pb, router_port, mb)},
                        cgroups.root, startup=0.3)
    a, _cfg = make_instance(cdir, "a")
    b, _ = make_instance(cdir, "b")
    sim, parker, said = sim_parker(tmp_path)
    return a, b, parker, said, router_port


def test_a_router_on_the_next_profiles_port_is_stopped_while_parked_and_started_again_at_the_restore(tmp_path, cgroups):
    a, b, parker, said, router_port = two_on_one_router_port(tmp_path, cgroups)
    router = a.processes["router"]

    async def go() -> None:
        await a.start()
        try:
            main_pid, router_pid = a.processes["main"].pid, router.pid
            record = await parker.park(a, b.profile)
            assert a.state == InstanceState.PARKED and a.processes["main"].state == ProcessState.PARKED
            assert router.state == ProcessState.STOPPED and router.pid is None
            assert router.history[-1].detail == f"stopped while parked: b needs port {router_port}"
            assert status_text(a.status()).endswith(f"; router stopped while parked (b needs port {router_port})")
            assert router_port not in record.ports and check_ports([("127.0.0.1", router_port, "r")])[0].free
            await asyncio.sleep(router.spec.probe.liveness_interval_s * 3)
            assert router.state == ProcessState.STOPPED and router.pid is None, "nothing restarts it while parked"
            await b.start()
            assert b.state == InstanceState.READY, "b's router took the port a's had"
            await b.stop()
            verdict = await parker.restore(a, a.start)
            assert verdict.serve, verdict.say
            assert a.state == InstanceState.READY and a.processes["main"].pid == main_pid, "started cold"
            assert router.state == ProcessState.READY and router.pid not in (None, router_pid)
            assert router.restarts_total == 0, "a router started again after a park is no restart of any ledger"
            workers = await router.router_api().workers()
            assert [w.get("url") for w in workers or []] == [f"http://127.0.0.1:{a.processes['main'].spec.port}"]
        finally:
            await a.stop()

    asyncio.run(go())
    assert "restored and serving" in said[-1] and cgroups.all_pids() == []


def test_a_router_that_cannot_bind_its_port_again_at_the_restore_means_a_cold_start_said_so(tmp_path, cgroups):
    a, b, parker, said, router_port = two_on_one_router_port(tmp_path, cgroups)
    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    async def go() -> None:
        await a.start()
        try:
            main_pid = a.processes["main"].pid
            await parker.park(a, b.profile)
            stranger.bind(("127.0.0.1", router_port))  # someone took the port while it was parked
            stranger.listen()

            async def cold_start() -> None:
                stranger.close()
                await a.start()

            began = time.monotonic()
            verdict = await parker.restore(a, cold_start)
            assert not verdict.serve and time.monotonic() - began < 60
            assert a.state == InstanceState.READY and a.processes["main"].pid != main_pid
        finally:
            stranger.close()
            await a.stop()

    asyncio.run(go())
    assert "router, stopped while parked, does not start again" in said[-1], said[-1]
    assert said[-1].endswith("; starting it cold instead") and cgroups.all_pids() == []


class FailingCheckpoint(SimulatedCheckpointer):
    def checkpoint(self, pid: int) -> None:
        raise CheckpointError(f"checkpoint of pid {pid} failed (the test's)")


def test_a_park_that_fails_after_the_router_stopped_starts_it_again_and_serves(tmp_path, cgroups):
    a, b, parker, _said, router_port = two_on_one_router_port(tmp_path, cgroups)
    parker.checkpointer = FailingCheckpoint(SimulatedGpus(tmp_path / "simgpu"))
    router = a.processes["router"]

    async def go() -> None:
        await a.start()
        try:
            router_pid = router.pid
            try:
                await parker.park(a, b.profile)
            except ParkRefused as e:
                assert "park of a failed and was undone: checkpoint of pid" in str(e)
            else:
                raise AssertionError("the park did not fail")
            assert a.state == InstanceState.READY and router.state == ProcessState.READY
            assert router.pid not in (None, router_pid), "the router the park stopped is started again"
            assert await one_generation("127.0.0.1", router_port) == "", "serving through its router"
        finally:
            await a.stop()

    asyncio.run(go())
    assert cgroups.all_pids() == []
