"""Security: no argv ever goes through a shell; children run as the profile's user."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

import psutil

from support import free_ports, make_instance, write_config

HOSTILE = "x; touch /tmp/gpusup-pwned-1 $(touch /tmp/gpusup-pwned-2) `touch /tmp/gpusup-pwned-3` 'single' \"double\"\nline two"


def test_hostile_option_values_reach_sglang_as_one_literal_argument(tmp_path, cgroups):
    port = free_ports(1)[0]
    value = json.dumps(HOSTILE)  # a TOML basic string is JSON-compatible here
    cdir = write_config(tmp_path, {"p": f"""
        [servers.server]
        gpus = [0]
        port = {port}
        model_path = "/m"
        [servers.server.options]
        served-model-name = {value}
        """}, cgroups.root, startup=0.2)
    instance, _ = make_instance(cdir, "p")
    assert HOSTILE in instance.processes["server"].launch.argv

    async def go() -> dict:
        await instance.start()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=5) as r:
            info = json.loads(r.read())
        await instance.stop()
        return info

    info = asyncio.run(go())
    assert info["served_model_name"] == HOSTILE
    assert not any(os.path.exists(f"/tmp/gpusup-pwned-{i}") for i in (1, 2, 3))


def test_children_run_as_the_profile_user_not_root(cgroups):
    import shutil
    import tempfile
    from pathlib import Path

    tmp_path = Path(tempfile.mkdtemp(prefix="gpusup-user-"))  # pytest's own tmp is 0700: nobody could not reach it
    os.chmod(tmp_path, 0o755)
    port = free_ports(1)[0]
    cdir = write_config(tmp_path, {"p": f"""
        [servers.server]
        gpus = [0]
        port = {port}
        model_path = "/m"
        user = "nobody"
        """}, cgroups.root, startup=0.2)
    instance, cfg = make_instance(cdir, "p")
    for d in (tmp_path / "simgpu", tmp_path / "simgpu" / "holders"):
        os.chmod(d, 0o1777)  # the stand-in (as nobody) records its simulated GPU memory there

    async def go() -> tuple[set[int], int]:
        await instance.start()
        main = psutil.Process(instance.processes["server"].pid)
        uids = {p.uids().real for p in [main, *main.children(recursive=True)]}
        uids |= {psutil.Process(pid).uids().real for pid in instance.processes["server"].spawned.group.pids()}
        await instance.stop()
        return uids, os.getuid()

    try:
        uids, me = asyncio.run(go())
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert uids == {65534}, uids
    assert me == 0
