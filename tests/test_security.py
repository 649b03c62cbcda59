"""Security: no argv ever goes through a shell; children run as the profile's user."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
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


def test_children_run_as_the_profile_user_not_root(cgroups, monkeypatch):
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
    monkeypatch.setenv("GPUSUP_TEST_DAEMON_ONLY", "root's own")
    instance, cfg = make_instance(cdir, "p")

    async def go() -> tuple[set[int], set[tuple[int, ...]], dict[str, str], int]:
        await instance.start()
        procs = [psutil.Process(pid) for pid in instance.processes["server"].spawned.group.pids()]
        uids = {p.uids().real for p in procs}
        groups = {(p.gids().real, *sorted(_supplementary(p.pid))) for p in procs}
        env = procs[0].environ()
        await instance.stop()
        return uids, groups, env, os.getuid()

    try:
        uids, groups, env, me = asyncio.run(go())
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    nobody = pwd.getpwnam("nobody")
    assert uids == {nobody.pw_uid}, uids
    # its own group and supplementary groups, never root's group 0 or root's groups
    assert groups == {(nobody.pw_gid, *sorted(os.getgrouplist("nobody", nobody.pw_gid)))}, groups
    assert env["HOME"] == nobody.pw_dir and env["USER"] == env["LOGNAME"] == "nobody"
    assert "GPUSUP_TEST_DAEMON_ONLY" not in env and "INVOCATION_ID" not in env  # not the daemon's environment
    assert env["TMPDIR"].endswith("/p/tmp/server") and env["TRITON_CACHE_DIR"].endswith("/cache/nobody/sglang/triton")
    assert me == 0


def _supplementary(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Groups:"):
                return [int(g) for g in line.split()[1:]]
    return []
