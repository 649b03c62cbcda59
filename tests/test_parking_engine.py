"""Parking, end to end on CPU (issue 39): stand-in servers on simulated GPUs under cgroups, the
engine's Instance, the controller's Parker with the simulated checkpointer. Not systemd.

The switch a `switch --park` makes: A parked (drained, liveness paused, its scheduler's memory
off the GPU), the GPU verified at its baseline, B started on the same GPU; back: B stopped, the
GPU verified idle, A restored and proven serving by one generation, routed to again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from supervisord_gpu.api.notify import status_text
from supervisord_gpu.checks.gpus import SimulatedInventory
from supervisord_gpu.checks.simgpu import H200_TOTAL_MIB, SimulatedGpus
from supervisord_gpu.controller.parking import Parker
from supervisord_gpu.engine.states import InstanceState, ProcessState
from supervisord_gpu.parking.decisions import GIB
from supervisord_gpu.parking.simulated import SimulatedCheckpointer
from support import free_ports, make_instance, sim_holders, write_config


def server(port: int) -> str:
    return f"""
        [servers.main]
        gpus = [0]
        port = {port}
        model_path = "/m"
        """


def rig(tmp_path, cgroups):  # type: ignore[no-untyped-def]
    pa, pb = free_ports(2)
    cdir = write_config(tmp_path, {"a": server(pa), "b": server(pb)}, cgroups.root, startup=0.3)
    a, cfg = make_instance(cdir, "a")
    b, _ = make_instance(cdir, "b")
    rig.cfg = cfg  # type: ignore[attr-defined]
    sim, parker, said = sim_parker(tmp_path)
    return a, b, sim, parker, said


def sim_parker(tmp_path) -> tuple[SimulatedGpus, Parker, list[str]]:  # type: ignore[no-untyped-def]
    """A Parker on the simulated GPUs under tmp_path (64 GiB of host memory), and what it said."""
    sim = SimulatedGpus(tmp_path / "simgpu")
    said: list[str] = []
    parker = Parker(SimulatedCheckpointer(sim), SimulatedInventory(sim, 0), lambda m, _p: said.append(m),
                    mem_available=lambda: 64 * GIB)
    return sim, parker, said


def send_generate(port: int, box: dict[str, object]) -> None:
    """One /generate straight to the port (a client past any router): its status, or the error's name."""
    import json
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            box["status"] = r.status
    except OSError as e:
        box["error"] = type(e).__name__


def parked_files(sim: SimulatedGpus) -> list[str]:
    return [p.name for p in (sim.directory / "holders").rglob(".parked.*")]


def test_park_switch_and_back_on_one_gpu(tmp_path, cgroups):
    a, b, sim, parker, said = rig(tmp_path, cgroups)
    inventory = parker.inventory

    async def go() -> None:
        await a.start()
        scheduler = sim_holders(tmp_path)
        main_pid = a.processes["main"].pid
        record = await parker.park(a, b.profile)
        assert a.state == InstanceState.PARKED and a.processes["main"].state == ProcessState.PARKED
        assert inventory.snapshot([0])[0].idle, "GPU 0 is at its baseline while A is parked"
        assert record.pids == scheduler and record.host_bytes == 1000 * (1 << 20)
        assert status_text(a.status()).startswith("parked: 0 MiB on the GPU, 1.0 GB host (main pid ")
        assert a.processes["main"]._liveness is None, "liveness is paused while parked"
        await asyncio.sleep(a.profile.processes[0].probe.liveness_interval_s * 2)
        assert a.processes["main"].pid == main_pid, "liveness killed nothing while parked"
        await b.start()
        assert b.state == InstanceState.READY
        await b.stop()
        assert inventory.snapshot([0])[0].idle
        began = time.monotonic()
        verdict = await parker.restore(a, a.start)
        assert verdict.serve, verdict.say
        assert time.monotonic() - began < 5
        assert a.state == InstanceState.READY and a.processes["main"].pid == main_pid
        assert sim_holders(tmp_path) == scheduler, "its memory is back on GPU 0"
        await a.stop()

    asyncio.run(go())
    assert "restored and serving" in said[-1]
    assert sim_holders(tmp_path) == [] and parked_files(sim) == [] and cgroups.all_pids() == []


def test_a_restore_onto_a_filled_gpu_starts_it_cold_and_says_so(tmp_path, cgroups):
    a, b, sim, parker, said = rig(tmp_path, cgroups)
    filler = subprocess.Popen(["sleep", "60"])

    async def go() -> None:
        await a.start()
        old_pid = a.processes["main"].pid
        await parker.park(a)
        sim.hold([0], H200_TOTAL_MIB - 1000, pid=filler.pid)  # someone else took the GPU meanwhile
        ended = {"cold": 0}

        async def cold_start() -> None:
            filler.kill()
            filler.wait()
            ended["cold"] += 1
            await a.start()

        verdict = await parker.restore(a, cold_start, None)
        assert not verdict.serve and ended["cold"] == 1
        assert a.state == InstanceState.READY and a.processes["main"].pid != old_pid
        await a.stop()

    try:
        asyncio.run(go())
    finally:
        filler.kill()
        filler.wait()
    assert "OUT_OF_MEMORY" in said[-1] and "starting it cold instead" in said[-1]
    assert parked_files(sim) == [] and cgroups.all_pids() == []


def test_stop_of_a_parked_profile_leaves_nothing(tmp_path, cgroups):
    a, _, sim, parker, _ = rig(tmp_path, cgroups)

    async def go() -> None:
        await a.start()
        await parker.park(a)
        await parker.stop(a)

    asyncio.run(go())
    assert a.state == InstanceState.STOPPED
    assert sim_holders(tmp_path) == [] and parked_files(sim) == [] and cgroups.all_pids() == []
    assert not os.path.exists(tmp_path / "simgpu" / "holders" / ".parked")


def test_a_park_refused_for_host_memory_leaves_it_serving(tmp_path, cgroups):
    a, _, _, parker, _ = rig(tmp_path, cgroups)
    parker.mem_available = lambda: 2 * GIB

    async def go() -> str:
        await a.start()
        try:
            await parker.park(a)
        except Exception as e:  # noqa: BLE001  (the refusal is what is checked)
            return f"{type(e).__name__}: {e}"
        finally:
            assert a.state == InstanceState.READY
            await a.stop()
        return ""

    said = asyncio.run(go())
    assert said == ("ParkRefused: refusing to park a: host memory available 2.1 GB, needed 1.0 GB to park "
                    "+ 4.3 GB margin")


def test_park_and_restore_through_the_controller(tmp_path, cgroups):
    """The daemon's verbs (what D-Bus Park and Restore run): the parked record written and removed,
    a park for a profile that needs the parked one's port refused, nothing touched."""
    from supervisord_gpu.controller import parked
    from supervisord_gpu.controller.controller import InstanceController
    from supervisord_gpu.controller.lock import TransitionLock
    from supervisord_gpu.controller.registry import Registry
    from supervisord_gpu.controller.transition import LocalTransition
    from supervisord_gpu.daemon import backends_for

    a, b, sim, parker, said = rig(tmp_path, cgroups)
    cfg = rig.cfg  # type: ignore[attr-defined]
    backends = backends_for(cfg)
    transition = LocalTransition(a.profile, cfg, backends, lambda m, _p, _e: said.append(m), None, Registry(cfg.runtime_dir))
    ctl = InstanceController(cfg, a.profile, a, backends, lambda m, _p, _e: said.append(m), transition,
                             TransitionLock(cfg.runtime_dir, "a"))
    ctl.parker = parker

    async def go() -> None:
        assert (await ctl.start()).ok
        out = await ctl.park("a")  # a profile on the parked one's own port
        assert out.state == "refused" and out.exit_code == 3 and "keeps listening on while parked" in out.reason
        assert a.state == InstanceState.READY and parked.parked(cfg.runtime_dir) == {}
        out = await ctl.park("b")
        assert out.ok and out.reason.startswith("parked in "), out.reason
        assert list(parked.parked(cfg.runtime_dir)) == ["a"]
        await b.start()
        await b.stop()
        out = await ctl.restore()
        assert out.ok and "restored and serving" in out.reason, out.reason
        assert parked.parked(cfg.runtime_dir) == {} and a.state == InstanceState.READY
        assert (await ctl.park("b")).ok
        out = await ctl.restart()  # a restart of a parked instance: stopped through the Parker, started cold
        assert out.ok and parked.parked(cfg.runtime_dir) == {} and parked_files(sim) == [], out.reason
        assert (await ctl.park("b")).ok
        await ctl.stop()  # a parked stop, through the Parker: nothing left behind

    asyncio.run(go())
    assert a.state == InstanceState.STOPPED and parked.parked(cfg.runtime_dir) == {}
    assert sim_holders(tmp_path) == [] and parked_files(sim) == [] and cgroups.all_pids() == []


def test_the_kv_pool_released_before_the_park_and_a_request_sent_while_parked_answered(tmp_path, cgroups):
    """A server with --enable-memory-saver (parking/saver.py): paused and its KV pool released
    through its front end (with its admin key), so the checkpoint moves what is left (the stand-in
    holds 0.5 of its memory for the pool, as the tiny model's 22.8 GB came down to 1.7 GB on the
    H100); a request sent straight to its port while parked waits for the continue and is answered,
    where one reaching the released pool would have crashed the scheduler."""
    import threading

    (port,) = free_ports(1)
    text = server(port) + "        [servers.main.options]\n        enable-memory-saver = true\n"
    cdir = write_config(tmp_path, {"s": text}, cgroups.root, startup=0.3)
    inst, _ = make_instance(cdir, "s")
    sim, parker, said = sim_parker(tmp_path)
    answer: dict[str, object] = {}

    async def go() -> None:
        await inst.start()
        main_pid = inst.processes["main"].pid
        record = await parker.park(inst)
        assert record.released == ["main"] and record.host_bytes == 500 * (1 << 20), record.to_json()
        assert "KV pool released (main)" in status_text(inst.status())
        assert parker.inventory.snapshot([0])[0].idle
        sender = threading.Thread(target=send_generate, args=(port, answer))
        sender.start()
        await asyncio.sleep(1.0)
        assert "status" not in answer, "answered while parked"
        verdict = await parker.restore(inst, inst.start)
        assert verdict.serve, verdict.say
        await asyncio.to_thread(sender.join, 30)
        assert answer == {"status": 200}, answer
        assert inst.processes["main"].pid == main_pid, "restored, not restarted"
        assert sim_holders(tmp_path), "its pool is held again"
        await inst.stop()

    asyncio.run(go())
    assert "restored and serving" in said[-1]
    assert parked_files(sim) == [] and cgroups.all_pids() == []


def test_a_request_sent_while_parked_is_answered_and_without_the_hold_it_kills_the_scheduler(tmp_path, cgroups):
    """The real 0.5.23 (an H100, 2026-12-07): a request that reached a checkpointed scheduler
    killed it (SIGSEGV), and the restore fell back cold. The stand-in does the same; the
    Parker's hold (SIGSTOP of the front end) keeps the request in the backlog until the restore."""
    import threading

    a, _b, _sim, parker, said = rig(tmp_path, cgroups)
    port = a.profile.processes[0].port

    async def cycle(hold: bool) -> tuple[dict[str, object], bool]:
        await a.start()
        pid = a.processes["main"].pid
        if not hold:
            parker.kill = lambda _pid, _sig: None  # what the Parker did before the hold
        await parker.park(a)
        box: dict[str, object] = {}
        sender = threading.Thread(target=send_generate, args=(port, box))
        sender.start()
        await asyncio.sleep(4.0)  # long enough for a front end that runs to reach the scheduler
        verdict = await parker.restore(a, a.start)
        await asyncio.to_thread(sender.join, 60)
        same = a.processes["main"].pid == pid
        await a.stop()
        return box, verdict.serve and same

    held, restored = asyncio.run(cycle(hold=True))
    assert held == {"status": 200} and restored, (held, said[-1])
    cut, restored = asyncio.run(cycle(hold=False))
    assert "status" not in cut and not restored, cut
    assert "starting it cold instead" in said[-1], said[-1]
    assert cgroups.all_pids() == []


def test_a_server_left_paused_by_a_failed_parks_undo_is_restarted_cold_and_serves(tmp_path, cgroups):
    """The wiring of the Parker's last resort on a real Instance: a park refused after the KV pool
    was released (too little host memory once locked), whose resume then fails (the server's
    answer, injected in front of its real front end), leaves the server paused with its pool
    released; once the profile is back it is restarted cold (a new PID) and serves, where paused
    it would have held every request for ever."""
    import threading

    from supervisord_gpu.controller.parking import admin_post
    from supervisord_gpu.errors import ParkRefused
    from supervisord_gpu.parking.decisions import HOST_MARGIN_MIN_BYTES

    (port,) = free_ports(1)
    text = server(port) + "        [servers.main.options]\n        enable-memory-saver = true\n"
    cdir = write_config(tmp_path, {"s": text}, cgroups.root, startup=0.3)
    inst, _ = make_instance(cdir, "s")
    _sim, parker, said = sim_parker(tmp_path)
    # the plan leaves the saver's bytes to the check after the lock, which the 500 MiB left fail
    parker.mem_available = lambda: HOST_MARGIN_MIN_BYTES + 100 * (1 << 20)
    real_post = admin_post

    def failing_resume(instance):  # type: ignore[no-untyped-def]
        post = real_post(instance)

        async def answer(name: str, path: str, body: object) -> tuple[int | None, bytes]:
            if path == "/resume_memory_occupation":
                return 500, b"injected"
            return await post(name, path, body)
        return answer

    parker.saver_post = failing_resume
    answer: dict[str, object] = {}

    async def go() -> None:
        await inst.start()
        old_pid = inst.processes["main"].pid
        try:
            await parker.park(inst)
        except ParkRefused as e:
            assert "host memory available" in str(e), e
        else:
            raise AssertionError("parked")
        assert inst.state == InstanceState.READY and inst.processes["main"].pid != old_pid
        assert inst.processes["main"].state == ProcessState.READY
        sender = threading.Thread(target=send_generate, args=(port, answer))
        sender.start()
        await asyncio.to_thread(sender.join, 30)
        await inst.stop()

    asyncio.run(go())
    assert answer == {"status": 200}, answer
    assert any("POST /resume_memory_occupation answered 500: injected; left paused" in m for m in said), said
    assert any("main is left paused after the failed park (its KV pool released): restarted cold" in m
               for m in said), said
    assert cgroups.all_pids() == []
