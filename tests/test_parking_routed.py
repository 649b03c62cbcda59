"""Parking a profile with a router (issue 39), end to end on CPU: stand-in server and router on
simulated GPUs under cgroups. Not systemd.

A park takes the servers out of the router; the restore's proof of serving is one generation
through the router: it must find them routed to again, or every routed profile comes back cold.
"""

from __future__ import annotations

import asyncio

from supervisord_gpu.checks.gpus import SimulatedInventory
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.controller.parking import Parker
from supervisord_gpu.engine.states import InstanceState
from supervisord_gpu.parking.decisions import GIB
from supervisord_gpu.parking.simulated import SimulatedCheckpointer
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
    sim = SimulatedGpus(tmp_path / "simgpu")
    said: list[str] = []
    parker = Parker(SimulatedCheckpointer(sim), SimulatedInventory(sim, 0), lambda m, _p: said.append(m),
                    mem_available=lambda: 64 * GIB)

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
