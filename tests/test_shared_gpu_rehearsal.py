"""Servers that share a GPU, on the stand-ins and simulated GPUs: the one-GPU PD example starts its
servers one after the other, both serve behind the router, and the card is verified idle only once
both have stopped; a stand-in takes its mem-fraction-static of the card, so two fit and a third not."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from supervisord_gpu.checks.gpus import SimulatedInventory
from supervisord_gpu.checks.preconditions import Requirement, wait_until_clear
from supervisord_gpu.checks.simgpu import H200_TOTAL_MIB, SimulatedGpus
from supervisord_gpu.engine.states import State
from supervisord_gpu.errors import PreconditionError
from support import Recorder, free_ports, make_instance, wait_for, write_config
from test_standins import Procs, start_server, wait_ready

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "pd-one-gpu.toml"


def example_on_free_ports() -> str:
    """The example as shipped in docs/examples, on free ports and as the test's user."""
    text = EXAMPLE.read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("user = "))
    for old, new in zip(("30100", "30200", "30001", "30091", "8998"), free_ports(5), strict=True):
        text = re.sub(rf"\b{old}\b", str(new), text)
    return text


def generate(port: int) -> int:
    body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 4}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_the_one_gpu_pd_example_starts_its_servers_in_turn_and_both_serve(tmp_path, cgroups):
    text = example_on_free_ports()
    cdir = write_config(tmp_path, {"pd1": text}, cgroups.root, startup=1.0)
    rec = Recorder()
    instance, cfg = make_instance(cdir, "pd1", rec)
    router_port = instance.profile.process("router").port
    inventory = SimulatedInventory(SimulatedGpus(tmp_path / "simgpu"))
    gpu0 = Requirement(gpus=frozenset({0}))

    async def go() -> None:
        await instance.start()
        assert instance.state == State.READY
        try:
            # both serve: a request through the PD router goes prefill -> decode
            await asyncio.to_thread(wait_for, lambda: generate(router_port) == 200, 15.0, "/generate 200 through the router")
            holdings = [h for h in SimulatedGpus(tmp_path / "simgpu").holders() if 0 in h.gpus]
            assert sorted(h.mib for h in holdings) == [int(0.2 * H200_TOTAL_MIB)] * 2  # a fifth of the card each
            with pytest.raises(PreconditionError, match="GPU 0 not idle"):  # held by both: not idle
                await wait_until_clear(gpu0, inventory, 0.2)
        finally:
            await instance.stop()
        report = await wait_until_clear(gpu0, inventory, 5.0)  # the idle check after the stop: back to baseline
        assert report.ok and report.gpus[0].used_mib == 0

    asyncio.run(go())
    assert rec.first("decode", "starting") >= rec.first("prefill", "ready"), "the decode started before the prefill was ready"
    assert rec.first("router", "starting") >= rec.first("decode", "ready")
    assert cgroups.all_pids() == []


def test_two_sharers_that_crash_together_restart_one_after_the_other(tmp_path, cgroups):
    text = example_on_free_ports() + "\n[restart]\nbackoff_initial = 0.2\n"
    cdir = write_config(tmp_path, {"pd1": text}, cgroups.root, startup=1.0)
    rec = Recorder()
    instance, _ = make_instance(cdir, "pd1", rec)
    servers = [instance.processes["prefill"], instance.processes["decode"]]

    async def go() -> None:
        await instance.start()
        try:
            old = [p.pid for p in servers]
            for pid in old:
                os.kill(pid, signal.SIGKILL)  # a GPU fault takes both
            for _ in range(600):
                await asyncio.sleep(0.05)
                if instance.state == State.READY and all(p.pid not in old for p in servers):
                    break
            assert instance.state == State.READY and all(p.restarts_total == 1 for p in servers)
        finally:
            await instance.stop()

    asyncio.run(go())
    def at(name: str, state: str, message: str) -> float:  # a restart's spawn is its plain "restarting" event
        return [e.at for e in rec.events if e.kind == "process" and e.process == name
                and e.state == state and e.message == message][-1]

    again = {name: (at(name, "restarting", "restarting"), at(name, "ready", "ready")) for name in ("prefill", "decode")}
    first, second = sorted(again.values())
    assert second[0] >= first[1], f"both sharers restarted at once: {again}"


@pytest.fixture
def procs(tmp_path: Path):  # type: ignore[no-untyped-def]
    registry = Procs(tmp_path)
    try:
        yield registry
    finally:
        registry.cleanup()


def test_a_standin_takes_its_fraction_of_the_card_so_two_fit_and_a_third_does_not(procs: Procs, tmp_path: Path) -> None:
    sim = SimulatedGpus.create(tmp_path / "simgpu", 1)
    share = int(0.45 * H200_TOTAL_MIB)
    for n in (1, 2):
        _, port, _, _ = start_server(procs, "--mem-fraction-static", "0.45", sim=sim, mib=1000)
        wait_ready(port)
        assert sorted(h.mib for h in sim.holders()) == [share] * n
    third, _, _, err = start_server(procs, "--mem-fraction-static", "0.45", sim=sim, mib=1000)
    assert third.wait(timeout=15) == 1
    assert "CUDA out of memory. Tried to allocate 63.18 GiB" in err.read_text()
    assert sorted(h.mib for h in sim.holders()) == [share] * 2
