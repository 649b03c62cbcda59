"""The router's worker API is the daemon's alone: a control-plane key per instance.

Without a key, sglang-router 0.3.2 lets anyone who reaches its port add a worker (users'
prompts then go to it) or remove ours, while /readiness says 200. Each attack below is made
the way an attacker would: as `nobody` (setpriv), and from another source address (127.0.0.2
on the loopback: the router does not look at addresses, so this is a neighbour's request as
the router sees it). Against the real router where installed, and the stand-in always, with
the same expectations: the stand-in must answer as the real one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.render import render
from supervisord_gpu.sglang import router_key, routers
from supervisord_gpu.rehearsal import standin_router, standin_server
from supervisord_gpu.rehearsal.setup import stand_ins
from support import free_ports, make_instance, pd_profile, wait_for, with_env, write_config

PY = sys.executable
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv (util-linux)")


def have_real_router() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


ROUTERS = [
    pytest.param("real", id="real-router",
                 marks=pytest.mark.skipif(not have_real_router(), reason="sglang-router not installed")),
    pytest.param("standin", id="standin-router"),
]
#: the same tests against smg 1.13.0, the router people install today (sglang/routers.py)
ROUTERS_AND_SMG = [*ROUTERS, pytest.param("real-smg", id="real-smg", marks=pytest.mark.skipif(
    not routers.SMG.installed(), reason="smg not installed"))]


def mode(router: str) -> dict[str, str]:
    """write_config's arguments for a ROUTERS value: real or stand-in, and which router."""
    return {"router": "real", "router_kind": "smg"} if router == "real-smg" else {"router": router}


def profile_text(ports: list[int], liveness_s: float = 3600) -> str:
    """Two servers behind a router; the router's liveness tick is an hour away unless asked, so a
    test that calls RouterWorkers.enforce itself does not race the daemon's own (once wired)."""
    a, b, r, m = ports
    return f"""
        [servers.alpha]
        gpus = [0]
        port = {a}
        model_path = "/m"
        [servers.beta]
        gpus = [1]
        port = {b}
        model_path = "/m"
        [router]
        port = {r}
        [router.probe]
        liveness_interval = {liveness_s}
        [router.options]
        policy = "round_robin"
        prometheus-host = "127.0.0.1"
        prometheus-port = {m}
        """


def http(method: str, port: int, path: str, body: Any = None, headers: dict[str, str] | None = None,
         source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request to 127.0.0.1:port, optionally from another source address."""
    payload = b"" if body is None else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close",
             f"Content-Length: {len(payload)}"] + (["Content-Type: application/json"] if body is not None else [])
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), hdrs, rest


ATTACKER = r"""
import json, socket, sys
port, method, path, body = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
payload = body.encode()
head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Length: {len(payload)}\r\nContent-Type: application/json\r\n\r\n")
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(head.encode() + payload)
raw = b""
while chunk := s.recv(65536):
    raw += chunk
print(raw.split(b"\r\n", 1)[0].split()[1].decode())
"""


def as_nobody(argv: list[str]) -> subprocess.CompletedProcess[str]:
    assert SETPRIV is not None
    return subprocess.run([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30, cwd="/")


def attack_as_nobody(port: int, method: str, path: str, body: Any = None) -> int:
    r = as_nobody([PY, "-I", "-c", ATTACKER, str(port), method, path, json.dumps(body) if body is not None else ""])
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


class Recording:
    """A LogSink that keeps the daemon's events (message, priority)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict[str, str]]] = []

    def child_line(self, instance: str, process: str, line: str, stream: str, priority: int) -> None:
        pass

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        self.events.append((message, priority, fields))


@pytest.fixture
def extra_server(tmp_path: Path) -> Iterator[int]:
    """One more stand-in SGLang server, outside the profile: the worker someone adds behind our back."""
    (port,) = free_ports(1)
    env = {**os.environ, standin_server.ENV_STARTUP_S: "0.2", standin_server.ENV_MIB: "1000",
           "TMPDIR": str(tmp_path), "SUPERVISORD_GPU_STANDIN_TOKEN_S": "0.01"}
    p = subprocess.Popen([PY, "-m", "supervisord_gpu.rehearsal.standin_server", "--model-path", "/evil",
                          "--host", "127.0.0.1", "--port", str(port)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # up before the test adds it: its start under a loaded CI (4 workers, 2 cores) once took
        # most of the 20 s the test gives the router to list it (the router retries 1, 2, ... 5 s apart)
        wait_for(lambda: _ready(port), 60, "the extra server ready")
        yield port
    finally:
        os.killpg(p.pid, 9)
        p.wait()


# --------------------------------------------------------------------------- the key file


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A 0755 directory nobody can traverse (pytest's tmp_path is 0700: nobody would fail for that reason)."""
    d = Path(tempfile.mkdtemp(prefix="router-key-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@as_root
def test_key_file_is_0600_root_and_nobody_can_read_it(open_dir: Path) -> None:
    path = router_key.key_path(open_dir / "run", "tp")
    key = router_key.ensure_key(path)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0, oct(st.st_mode)
    assert len(key) >= 43 and router_key.ensure_key(path) == key == router_key.read_key(path)
    r = as_nobody(["cat", str(path)])
    assert r.returncode != 0 and "Permission denied" in r.stderr, (r.returncode, r.stderr)
    assert key not in r.stdout


def test_a_planted_symlink_or_a_file_others_can_read_is_refused(open_dir: Path) -> None:
    path = router_key.key_path(open_dir / "run", "tp")
    path.parent.mkdir(parents=True)
    target = open_dir / "elsewhere"
    target.write_text("x" * 43)
    target.chmod(0o600)
    path.symlink_to(target)
    with pytest.raises(router_key.RouterKeyError):
        router_key.ensure_key(path)  # O_NOFOLLOW: never through the link, never its content
    path.unlink()
    path.write_text("A" * 43)
    path.chmod(0o644)
    with pytest.raises(router_key.RouterKeyError, match="readable by others"):
        router_key.read_key(path)
    path.chmod(0o600)
    os.link(path, open_dir / "hardlink")
    with pytest.raises(router_key.RouterKeyError, match="one link"):
        router_key.read_key(path)


def test_a_runtime_dir_others_may_write_is_refused(open_dir: Path) -> None:
    shared = open_dir / "run" / "tp"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(router_key.RouterKeyError, match="only it may write"):
        router_key.ensure_key(shared / router_key.KEY_FILE)


# --------------------------------------------------------------------------- render


@pytest.mark.parametrize("router", ROUTERS_AND_SMG)
def test_render_keeps_the_key_off_argv_and_out_of_the_printed_env(tmp_path: Path, router: str) -> None:
    cdir = write_config(tmp_path, {"p": profile_text(free_ports(4))}, tmp_path / "cg", **mode(router))
    cfg = load_daemon_config(cdir)
    launch = next(x for x in render(load_profile(cfg, "p"), cfg, stand_ins(cfg)) if x.spec.kind == "router")
    assert launch.router_key == router_key.key_path(cfg.runtime_dir, "p")
    assert not launch.router_key.exists()  # rendering (`gpusupctl render`) makes no key
    assert "-c" in launch.argv and router_key.ROUTER_SHIM in launch.argv
    assert all(k != router_key.KEY_ENV for k, _ in launch.env)
    env = launch.environment({})
    key = router_key.read_key(launch.router_key)
    assert env[router_key.KEY_ENV] == key and not any(key in a for a in launch.argv)
    assert set(launch.router_workers) == {(f"http://127.0.0.1:{p}", "regular") for p in
                                          (cfg_port(launch, "alpha"), cfg_port(launch, "beta"))}


def cfg_port(launch: Any, name: str) -> int:
    i = launch.argv.index("--worker-urls")
    urls = launch.argv[i + 1:i + 3]
    return int(urls[0 if name == "alpha" else 1].rsplit(":", 1)[1])


def test_a_key_in_the_router_options_is_refused(tmp_path: Path) -> None:
    from supervisord_gpu.errors import ConfigError

    text = profile_text(free_ports(4)) + '        control-plane-api-keys = ["a:b:admin:visible-in-ps"]\n'
    cdir = write_config(tmp_path, {"p": text}, tmp_path / "cg")
    cfg = load_daemon_config(cdir)
    with pytest.raises(ConfigError, match="control-plane-api-keys"):
        render(load_profile(cfg, "p"), cfg, stand_ins(cfg))


# --------------------------------------------------------------------------- the stand-in's parser


@pytest.mark.parametrize("entry, message", [("bad:format", "Invalid API key format: 'bad:format'"),
                                            ("a:b:root:k", "Invalid role: 'root'")])
def test_standin_refuses_malformed_keys_like_the_real_one(entry: str, message: str, capsys: Any) -> None:
    assert standin_router.main(["--control-plane-api-keys", entry]) == 1
    assert f"ValueError: {message}" in capsys.readouterr().err


def test_standin_authorize_matches_the_real_middleware() -> None:
    keys = standin_router.parse_control_plane_keys(["d:daemon:admin:K1:with:colons", "r:reader:user:K2"])
    assert keys[0].key == "K1:with:colons"
    assert standin_router.authorize(keys, None)[:2] == (401, "Missing or invalid Authorization header")
    assert standin_router.authorize(keys, "bearer K1:with:colons")[:2] == (401, "Missing or invalid Authorization header")
    assert standin_router.authorize(keys, "Bearer nope")[:2] == (401, "Invalid authentication token")
    assert standin_router.authorize(keys, "Bearer  K1:with:colons")[:2] == (401, "Invalid authentication token")
    assert standin_router.authorize(keys, "Bearer K2")[:2] == (403, "Admin role required for control plane access")
    assert standin_router.authorize(keys, "Bearer K1:with:colons")[0] == 0


# --------------------------------------------------------------------------- the instance, attacked


def _start(tmp_path: Path, cgroups: Any, router: str) -> tuple[Any, list[int]]:
    ports = free_ports(4)
    cdir = write_config(tmp_path, {"p": profile_text(ports)}, cgroups.root, startup=0.3, **mode(router))
    instance, _ = make_instance(cdir, "p")
    return instance, ports


def _key(instance: Any) -> str:
    return router_key.read_key(instance.processes["router"].launch.router_key)


def _workers(port: int, key: str) -> list[dict[str, Any]]:
    code, _, body = http("GET", port, "/workers", headers=router_key.auth_header(key))
    assert code == 200, body
    return list(json.loads(body)["workers"])


@as_root
@pytest.mark.parametrize("router", ROUTERS_AND_SMG)
def test_nobody_and_a_neighbour_can_neither_add_nor_remove_workers(tmp_path: Path, cgroups: Any, router: str) -> None:
    instance, ports = _start(tmp_path, cgroups, router)
    rport, fake = ports[2], "http://127.0.0.1:9/evil"

    async def go() -> None:
        await instance.start()
        try:
            await asyncio.to_thread(attacks)
        finally:
            await instance.stop()

    def attacks() -> None:
        key = _key(instance)
        victim = next(w for w in _workers(rport, key) if w["url"].endswith(f":{ports[0]}"))
        # a local user
        assert attack_as_nobody(rport, "POST", "/workers", {"url": fake}) == 401
        assert attack_as_nobody(rport, "DELETE", f"/workers/{victim['id']}") == 401
        assert attack_as_nobody(rport, "GET", "/workers") == 401
        # a neighbour (another source address), with no key, a guessed one, and the wrong scheme
        cases = [({}, b"Missing or invalid Authorization header"),
                 ({"Authorization": "Bearer guess"}, b"Invalid authentication token")]
        if router != "real-smg":  # smg takes the scheme in any case (it still needs the key)
            cases.append(({"Authorization": f"bearer {key}"}, b"Missing or invalid Authorization header"))
        for headers, text in cases:
            code, hdrs, body = http("POST", rport, "/workers", {"url": fake}, headers, source="127.0.0.2")
            assert (code, body) == (401, text) and hdrs["www-authenticate"] == 'Bearer realm="control-plane"', body
            code, _, _ = http("DELETE", rport, f"/workers/{victim['id']}", headers=headers, source="127.0.0.2")
            assert code == 401
        # nothing changed, and the data plane is as open as before
        assert {w["url"] for w in _workers(rport, key)} == {f"http://127.0.0.1:{p}" for p in ports[:2]}
        assert http("GET", rport, "/readiness", source="127.0.0.2")[0] == 200
        code, _, body = http("POST", rport, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                             source="127.0.0.2")
        assert code == 200 and b"stand-in" in body, body
        # and the key is nowhere nobody can read it: not the router's command line, not its environment
        pid = instance.processes["router"].pid
        assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode("latin-1")
        r = as_nobody(["cat", f"/proc/{pid}/environ"])
        assert r.returncode != 0 and key not in r.stdout

    asyncio.run(go())


@as_root
@pytest.mark.parametrize("router", ROUTERS_AND_SMG)
def test_a_worker_added_behind_our_back_with_the_key_is_named_and_removed(tmp_path: Path, cgroups: Any,
                                                                           extra_server: int, router: str) -> None:
    instance, ports = _start(tmp_path, cgroups, router)
    rport, evil = ports[2], f"http://127.0.0.1:{extra_server}"
    sink = Recording()

    async def go() -> None:
        await instance.start()
        try:
            workers = instance.processes["router"].router_api()
            assert (await workers.enforce(sink, "router")).ready and sink.events == []
            key = _key(instance)
            code, _, body = await asyncio.to_thread(http, "POST", rport, "/workers", {"url": evil},
                                                    router_key.auth_header(key))
            assert code == 202, body
            await asyncio.to_thread(wait_for, lambda: any(w["url"] == evil and w["is_healthy"]
                                                          for w in _workers(rport, key)), 20, "the foreign worker")
            assert [w["url"] for w in await workers.foreign_workers() or []] == [evil]
            check = await workers.enforce(sink, "router")
            assert check.ready and len(check.foreign) == 1 and evil in check.foreign[0], check
            # gone (0.3.2), or on its way out: smg lists it as "draining" for a while, out of routing
            assert evil not in {w["url"] for w in _workers(rport, key) if w.get("status") != "draining"}
            assert (await workers.foreign_workers()) == []
        finally:
            await instance.stop()

    asyncio.run(go())
    errors = [m for m, prio, _ in sink.events if prio == 3]
    assert errors and evil in errors[0] and "foreign worker" in errors[0], sink.events
    assert any(prio == 4 and "removed" in m for m, prio, _ in sink.events), sink.events


@as_root
def test_without_the_key_the_daemon_cannot_touch_the_router_and_says_why(tmp_path: Path, cgroups: Any) -> None:
    """A key file someone replaced (another owner) is refused: the call goes out with no header and fails."""
    instance, ports = _start(tmp_path, cgroups, "standin")

    async def go() -> str:
        await instance.start()
        try:
            launch = instance.processes["router"].launch
            os.chown(launch.router_key, 65534, 65534)
            workers = instance.processes["router"].router_api()
            check = await workers.enforce(Recording(), "router")
            assert not check.ready and "could not be read" in check.problem and "owned by uid 65534" in check.problem
            return await workers.withdraw(instance.processes["alpha"].spec, 1.0)
        finally:
            os.chown(instance.processes["router"].launch.router_key, 0, 0)
            await instance.stop()

    # a list it cannot read is not "not registered": the restart path is told why, never "gone"
    why = asyncio.run(go())
    assert "could not be read" in why and "owned by uid 65534" in why, why


@pytest.mark.parametrize("router", [*ROUTERS_AND_SMG, pytest.param("standin-smg", id="standin-smg")])
def test_a_user_key_gets_403_and_the_data_plane_needs_no_key(tmp_path: Path, router: str) -> None:
    """The router itself, started directly: what the stand-in copies of the real one's auth."""
    port, prom = free_ports(2)
    module = {"real": "sglang_router.launch_router", "real-smg": "smg.launch_router"}.get(
        router, "supervisord_gpu.rehearsal.standin_router")
    env = {**os.environ, routers.STANDIN_KIND_ENV: "smg" if router.endswith("smg") else "sglang-router"}
    p = subprocess.Popen([PY, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
                          "127.0.0.1", "--prometheus-port", str(prom), "--control-plane-api-keys",
                          "d:daemon:admin:ADMINKEY", "r:reader:user:USERKEY"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: _answers(port), 15, "the router's port")
        if router.endswith("smg"):  # a user key may read the worker list there, not change it
            assert http("GET", port, "/workers", headers={"Authorization": "Bearer USERKEY"})[0] == 200
            assert http("POST", port, "/workers", {"url": "http://127.0.0.1:9"},
                        headers={"Authorization": "Bearer USERKEY"})[::2] == (
                403, b"Admin role required for this control plane operation")
        else:
            assert http("GET", port, "/workers", headers={"Authorization": "Bearer USERKEY"})[::2] == (
                403, b"Admin role required for control plane access")
            assert http("POST", port, "/workers", {"url": "http://127.0.0.1:9"},
                        headers={"Authorization": "Bearer USERKEY"})[0] == 403
        code, hdrs, _ = http("GET", port, "/get_loads")
        assert code == 401 and hdrs["www-authenticate"] == 'Bearer realm="control-plane"'
        assert http("GET", port, "/workers", headers={"authorization": "Bearer ADMINKEY"})[0] == 200
        assert http("GET", port, "/health")[0] == 200 and http("GET", port, "/liveness")[0] == 200
        assert http("GET", port, "/readiness")[0] == 503  # no workers: not ready, but not 401
        assert http("POST", port, "/generate", {"text": "x"})[0] != 401
    finally:
        p.terminate()
        p.wait(30)


def _ready(port: int) -> bool:
    try:
        return http("GET", port, "/ready")[0] == 200
    except OSError:
        return False


def _answers(port: int) -> bool:
    try:
        return http("GET", port, "/liveness")[0] == 200
    except OSError:
        return False


@as_root
def test_a_foreign_worker_added_after_ready_is_removed_by_the_next_liveness_tick(tmp_path: Path, cgroups: Any,
                                                                                 extra_server: int, capsys: Any) -> None:
    ports = free_ports(4)
    cdir = write_config(tmp_path, {"p": profile_text(ports, liveness_s=0.3)}, cgroups.root, startup=0.3,
                        router="standin")
    instance, _ = make_instance(cdir, "p")
    evil = f"http://127.0.0.1:{extra_server}"

    async def go() -> bool:
        await instance.start()
        try:
            key = _key(instance)
            assert (await asyncio.to_thread(http, "POST", ports[2], "/workers", {"url": evil},
                                            router_key.auth_header(key)))[0] == 202
            await asyncio.to_thread(wait_for, lambda: any(w["url"] == evil for w in _workers(ports[2], key)), 20,
                                    "the foreign worker listed")
            deadline = asyncio.get_running_loop().time() + 10
            while asyncio.get_running_loop().time() < deadline:
                if evil not in {w["url"] for w in await asyncio.to_thread(_workers, ports[2], key)}:
                    return True
                await asyncio.sleep(0.2)
            return False
        finally:
            await instance.stop()

    assert asyncio.run(go()), "the foreign worker is still in the router"
    assert f"foreign worker {evil}" in capsys.readouterr().err


@as_root
def test_a_process_of_the_routers_own_user_cannot_read_the_key_from_its_environment() -> None:
    """The servers run as the router's user (model code, trust-remote-code): /proc/PID/environ
    must be root's alone once the shim runs."""
    import subprocess
    import sys
    import time

    from supervisord_gpu.sglang.router_key import KEY_ENV, ROUTER_SHIM

    import shutil
    import tempfile

    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    where = tempfile.mkdtemp()
    os.chmod(where, 0o755)
    Path(where, "sleeper.py").write_text("import time\ntime.sleep(30)\n")  # stands in for sglang_router
    env = dict(os.environ, PYTHONPATH=where, **{KEY_ENV: "not-a-real-key-4711"})
    proc = subprocess.Popen([*nobody, sys.executable, "-c", ROUTER_SHIM, "sleeper"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        assert proc.poll() is None
        peek = subprocess.run([*nobody, "cat", f"/proc/{proc.pid}/environ"], capture_output=True)
        assert b"not-a-real-key-4711" not in peek.stdout and peek.returncode != 0, peek
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(where)


# --------------------------------------------------------------------------- a stranger on the router's port


#: run as nobody: bind the router's port as soon as it is free (the router closed its listener on
#: SIGTERM and drains), answer 200 to everything, and print each request's method, path and
#: whether it carried an Authorization header (and the header itself: what an attacker keeps)
STRANGER = r"""
import socket, sys, time
port = int(sys.argv[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
deadline = time.monotonic() + 20
while True:
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.005)
s.listen(64)
print("bound", flush=True)
while True:
    conn, _ = s.accept()
    with conn:
        conn.settimeout(2)
        try:
            head = conn.recv(65536).split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        except OSError:
            continue
        auth = [h for h in head[1:] if h.lower().startswith("authorization:")]
        print(head[0] or "(connected, nothing sent)", "|", *auth, flush=True)
        body = b'{"status":"ready","workers":[]}'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
"""


@as_root
@pytest.mark.parametrize("router", ROUTERS)
def test_a_stranger_on_the_routers_port_after_its_sigterm_never_gets_the_key(tmp_path: Path, cgroups: Any,
                                                                             router: str, capsys: Any) -> None:
    """The real router closes its listener at once on SIGTERM and lives on while a request drains
    (up to 180 s); a process of its user (the servers' model code) can send that SIGTERM, and then
    any local user can bind the port. Its answers must not keep the router "alive", and neither the
    liveness tick's worker check nor a restart's withdraw may hand it the control-plane key: before
    anything is written, the process that accepted the connection must be the router's."""
    ports = free_ports(4)
    text = with_env(profile_text(ports, liveness_s=0.3), "alpha", SUPERVISORD_GPU_STANDIN_TOKEN_S="0.25")
    text = with_env(text, "beta", SUPERVISORD_GPU_STANDIN_TOKEN_S="0.25")
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3, router=router)
    instance, _ = make_instance(cdir, "p")
    rport = ports[2]
    seen: list[str] = []

    def in_flight() -> None:
        """A request the router drains after its SIGTERM (40 tokens at 0.25 s: 10 s)."""
        with contextlib.suppress(OSError, IndexError):  # cut when the router goes: no answer at all
            http("POST", rport, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 40}})

    async def go() -> str:
        await instance.start()
        router_proc = instance.processes["router"]
        stranger = None
        try:
            threading.Thread(target=in_flight, daemon=True).start()
            await asyncio.sleep(1.0)
            os.kill(router_proc.pid, signal.SIGTERM)
            stranger = subprocess.Popen([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                         PY, "-I", "-c", STRANGER, str(rport)],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd="/")
            threading.Thread(target=lambda: seen.extend(stranger.stdout), daemon=True).start()
            await asyncio.to_thread(wait_for, lambda: "bound\n" in seen, 20, "the stranger on the router's port")
            # the daemon's liveness ticks every 0.3 s: give it a dozen to be fooled
            await asyncio.to_thread(wait_for, lambda: len(seen) > 3, 10, "the daemon's probes reaching the stranger")
            await asyncio.sleep(3.0)
            return await router_proc.router_api().withdraw(instance.processes["alpha"].spec, 1.0)
        finally:
            if stranger is not None:
                stranger.kill()
                stranger.wait()
            await instance.stop()

    why = asyncio.run(go())
    requests = [line for line in seen if line != "bound\n"]
    assert requests, "the stranger was never asked anything: the attack did not happen"
    assert not any("authorization" in line.lower() for line in requests), requests
    assert not any("/workers" in line for line in requests), requests
    assert "not sent, it would carry the control-plane key" in why and "(user nobody)" in why, why
    err = capsys.readouterr().err
    assert re.search(rf"router: port [^ ]+:{rport} answers from pid \d+ \(user nobody", err), err[-3000:]


# --------------------------------------------------------------------------- nothing beyond loopback


class ProxyListener:
    """What HTTPS_PROXY and HTTP_PROXY point at: the first line of every request a client sends
    through them (a `CONNECT host:443` for https), answered by a closed connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace"))
                except OSError as e:
                    self.seen.append(repr(e))

    def close(self) -> None:
        self.sock.close()


ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.skipif(not have_real_router(), reason="sglang-router not installed")
def test_the_real_router_in_a_rehearsal_reaches_nothing_beyond_loopback(tmp_path: Path, cgroups: Any,
                                                                          capsys: Any) -> None:
    """Issue #26. sglang-router 0.3.2 loads a tokenizer for each worker it registers, from the
    model_path in the worker's /server_info: a path that does not exist on its host is taken for a
    Hugging Face id and fetched from the hub (a `CONNECT huggingface.co:443` per worker). The
    profile's model (here the shipped pd-1p1d's) is not on a rehearsal's machine; the stand-in
    reports a local directory holding a stand-in tokenizer instead, and the router loads that."""
    proxy = ProxyListener()
    loopback = "127.0.0.1,localhost,::1"
    env = "".join(f'{k} = "{proxy.url}"\n' for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                                     "ALL_PROXY", "all_proxy"))
    env += f'NO_PROXY = "{loopback}"\nno_proxy = "{loopback}"\n'
    quick = {f"{r}_extra": f'[servers.{r}.env]\n{standin_server.ENV_DRAIN_POLL_S} = "0.2"' for r in ("prefill", "decode")}
    text = pd_profile(free_ports(5), router_extra="[router.env]\n" + env, **quick)
    text = text.replace('"/models/test"', '"/models/DeepSeek-V4"')  # the shipped pd-1p1d's, not on this machine
    cdir = write_config(tmp_path, {"p": text}, cgroups.root, startup=0.3, router="real")
    instance, _ = make_instance(cdir, "p")
    lines: list[str] = []

    def router_lines() -> list[str]:
        lines.extend(ANSI.sub("", x) for x in capsys.readouterr().err.splitlines() if x.startswith("router|"))
        return lines

    async def go() -> None:
        await instance.start()
        try:  # both workers' registrations have run their tokenizer step (where the fetch was)
            await asyncio.to_thread(wait_for, lambda: sum("step_id=register_tokenizer duration_ms" in x
                                                          for x in router_lines()) >= 2, 15, "register_tokenizer x2")
        finally:
            await instance.stop()

    try:
        asyncio.run(go())
    finally:
        proxy.close()
    assert proxy.seen == [], proxy.seen
    tokenizer = [x for x in lines if "okenizer" in x and "workflow::event" not in x]
    assert any("Successfully registered tokenizer" in x for x in tokenizer), tokenizer
    assert not any("Failed" in x or "HuggingFace" in x for x in tokenizer), tokenizer
