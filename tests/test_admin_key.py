"""SGLang's admin endpoints are the daemon's alone: every server runs with an admin key.

Before, no `--admin-api-key` was rendered and SGLang 0.5.23 answers its ADMIN_OPTIONAL routes
to anyone: one local user's POST /pause_generation stopped all generation behind the router.
Each attack here is made as `nobody` (setpriv) against the stand-in started by the daemon, which
applies SGLang's key rules (rehearsal/standin_redaction.py); one family of endpoints per case.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support import free_ports, make_instance, wait_for, write_config
from supervisord_gpu.sglang import admin_key, router_key

PY = sys.executable
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv (util-linux)")

ATTACKER = r"""
import socket, sys
port, method, path, body = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].encode()
head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n\r\n")
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(head.encode() + body)
raw = b""
while chunk := s.recv(65536):
    raw += chunk
head, _, rest = raw.partition(b"\r\n\r\n")
sys.stdout.write(head.split(b"\r\n", 1)[0].split()[1].decode() + "\n" + rest.decode("latin-1"))
"""

#: one request per endpoint family, as a local user would send it
FAMILIES = {
    "pause": ("POST", "/pause_generation", {"mode": "abort"}),
    "continue": ("POST", "/continue_generation", {}),
    "release-memory": ("POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
    "resume-memory": ("POST", "/resume_memory_occupation", {}),
    "weight-update": ("POST", "/update_weights_from_disk", {"model_path": "/tmp/evil"}),
    "slow-down": ("POST", "/slow_down", {"forward_sleep_time": 60}),
    "pd-role-switch": ("POST", "/pd_role_switch", {"target_role": "decode"}),
}


def as_nobody(argv: list[str]) -> subprocess.CompletedProcess[str]:
    assert SETPRIV is not None
    return subprocess.run([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30, cwd="/")


def attack_as_nobody(port: int, method: str, path: str, body: Any = None) -> tuple[int, str]:
    r = as_nobody([PY, "-I", "-c", ATTACKER, str(port), method, path, json.dumps(body) if body is not None else ""])
    assert r.returncode == 0, r.stderr
    status, _, rest = r.stdout.partition("\n")
    return int(status), rest


def call(port: int, method: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, bytes]:
    from supervisord_gpu.rehearsal._http import fetch

    headers = {"Content-Type": "application/json", **(admin_key.auth_header(key) if key else {})}
    status, _, data = fetch(method, f"http://127.0.0.1:{port}{path}",
                            json.dumps(body).encode() if body is not None else None, headers=headers)
    return status, data


def profile(port: int, paused_warn: float = 300, liveness_s: float = 3600) -> str:
    return f"""
        [servers.alpha]
        gpus = [0]
        port = {port}
        model_path = "/m"
        paused_warn = {paused_warn}
        [servers.alpha.probe]
        liveness_interval = {liveness_s}
        """


class Tap:
    """The process's log sink, with its events kept: (message, priority) by GPUSUP_EVENT."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.events: list[tuple[str, int, dict[str, str]]] = []
        self.lines: list[str] = []  # what the server printed, as the journal gets it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)

    def child_line(self, *args: Any, **kwargs: Any) -> None:
        self.lines.append(str(args[2]) if len(args) > 2 else str(kwargs.get("line")))
        self.sink.child_line(*args, **kwargs)

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        self.events.append((message, priority, fields))
        self.sink.event(message, priority, **fields)

    def named(self, event: str) -> list[tuple[str, int]]:
        return [(m, p) for m, p, f in self.events if f.get("GPUSUP_EVENT") == event]


def _key(instance: Any) -> str:
    return router_key.read_key(instance.processes["alpha"].launch.admin_key)


@as_root
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_local_user_is_refused_every_admin_endpoint_family(tmp_path: Path, cgroups: Any, family: str) -> None:
    (port,) = free_ports(1)
    instance, _ = make_instance(write_config(tmp_path, {"p": profile(port)}, cgroups.root, startup=0.2), "p")
    method, path, body = FAMILIES[family]

    async def go() -> None:
        await instance.start()
        try:
            status, text = await asyncio.to_thread(attack_as_nobody, port, method, path, body)
            assert (status, json.loads(text)) == (401, {"error": "Unauthorized"}), (status, text)
            # refused, not merely unknown: it is still serving, nothing was paused or slowed
            assert (await asyncio.to_thread(call, port, "GET", "/ready"))[0] == 200
            code, data = await asyncio.to_thread(call, port, "POST", "/generate",
                                                 {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
            assert code == 200 and b"stand-in" in data
        finally:
            await instance.stop()

    asyncio.run(go())


@as_root
def test_the_key_is_nowhere_a_local_user_can_read_it(tmp_path: Path, cgroups: Any) -> None:
    """Not its file, not the server's command line or environment, not SGLang's /server_info."""
    (port,) = free_ports(1)
    instance, _ = make_instance(write_config(tmp_path, {"p": profile(port)}, cgroups.root, startup=0.2), "p")
    tap = instance.processes["alpha"].sink = Tap(instance.processes["alpha"].sink)

    async def go() -> None:
        await instance.start()
        try:
            await asyncio.to_thread(look)
        finally:
            await instance.stop()

    def look() -> None:
        launch = instance.processes["alpha"].launch
        key = _key(instance)
        st = os.lstat(launch.admin_key)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        r = as_nobody(["cat", str(launch.admin_key)])
        assert r.returncode != 0 and key not in r.stdout
        pid = instance.processes["alpha"].pid
        assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode("latin-1")
        r = as_nobody(["cat", f"/proc/{pid}/environ"])
        assert r.returncode != 0 and key not in r.stdout
        status, text = attack_as_nobody(port, "GET", "/server_info")
        info = json.loads(text)
        assert status == 200 and info["admin_api_key"] == admin_key.REDACTED, info.get("admin_api_key")
        assert "--admin-api-key=<redacted>" in info["launch_command"] and key not in text
        journal = "".join(tap.lines)
        assert "'admin_api_key': '<redacted>'" in journal and key not in journal  # the server_args= line

    asyncio.run(go())


@as_root
def test_the_daemons_key_opens_the_admin_endpoints_and_a_long_pause_is_a_warning(tmp_path: Path,
                                                                                 cgroups: Any) -> None:
    """What the daemon holds works (pause, then continue, with its key); a pause that outlives
    paused_warn is a warning in the journal, and status says since when."""
    (port,) = free_ports(1)
    text = profile(port, paused_warn=1, liveness_s=0.2)
    instance, _ = make_instance(write_config(tmp_path, {"p": text}, cgroups.root, startup=0.2), "p")
    proc = instance.processes["alpha"]
    proc.sink = tap = Tap(proc.sink)

    async def go() -> None:
        await instance.start()
        try:
            key = _key(instance)
            assert (await asyncio.to_thread(call, port, "POST", "/pause_generation", {"mode": "in_place"}))[0] == 401
            paused_at = time.time()
            code, data = await asyncio.to_thread(call, port, "POST", "/pause_generation", {"mode": "in_place"}, key)
            assert code == 200 and b"paused" in data, data
            await asyncio.to_thread(wait_for, lambda: proc.status().not_serving_since is not None, 10, "not serving")
            assert paused_at - 1 <= (proc.status().not_serving_since or 0) <= time.time()
            await asyncio.to_thread(wait_for, lambda: tap.named("not-serving-too-long"), 10, "the warning")
            (message, priority), = tap.named("not-serving-too-long")
            assert priority == 4 and "not serving since " in message and "paused_warn 1 s" in message, message
            assert message.endswith("is ended by SGLang's own watchdog 300-450 s after its last step "
                                    "(--watchdog-timeout), then restarted as its restart policy allows: pause "
                                    "with mode retract to hold requests longer"), message
            code, _ = await asyncio.to_thread(call, port, "POST", "/continue_generation", {}, key)
            assert code == 200
            await asyncio.to_thread(wait_for, lambda: proc.status().serving, 10, "serving again")
            assert proc.status().not_serving_since is None
        finally:
            await instance.stop()

    asyncio.run(go())
