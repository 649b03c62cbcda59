"""The router runs as a user of its own, so the servers' model code cannot reach its key.

Why (issue #37): the servers run model code (`trust-remote-code`) as their user. While the
router ran as that same user, such code SIGKILLed the router and read the control-plane key
from the restarted router's /proc/PID/environ in the 0.25-0.85 s before its shim made it
non-dumpable (3 times out of 3); it could also SIGTERM it at will. With a user of its own the
kernel refuses both at every moment of the router's life: kill(2) wants the sender's uid to
match the target's, and /proc/PID/environ (0400, the process's user) another unprivileged uid
never opens.

The accounts: the shipped profiles name `sglang` (servers) and `sglang-router` (router), which
exist only where the package (or `make rehearse`) made them. Here each distinct name a profile
gives is played by a distinct unprivileged uid, the servers' by `nobody`: a profile that gave
the router the servers' user would get one uid for both, as on a real machine, and fail here.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisord_gpu.config.loader import parse_profile, read_toml
from supervisord_gpu.config.model import Profile
from supervisord_gpu.sglang.router_key import KEY_ENV, shim_argv

REPO = Path(__file__).resolve().parent.parent
PROFILES = sorted((REPO / "etc" / "supervisord-gpu" / "profiles").glob("*.toml"))
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv (util-linux)")
KEY = "not-a-real-key-0815"

#: run as the servers' user against the router's PID: what model code would try
ATTACK = r"""
import os, signal, sys
pid, key = int(sys.argv[1]), sys.argv[2].encode()
try:
    with open(f"/proc/{pid}/environ", "rb") as f:
        seen = "environ:KEY" if key in f.read() else "environ:read"
except PermissionError:
    seen = "environ:refused"
result = [seen]
for name in ("SIGTERM", "SIGKILL"):
    try:
        os.kill(pid, getattr(signal, name))
        result.append(f"{name}:sent")
    except PermissionError:
        result.append(f"{name}:refused")
print(" ".join(result))
"""
REFUSED = "environ:refused SIGTERM:refused SIGKILL:refused"


def shipped(path: Path) -> Profile:
    """A shipped profile as the package's daemon loads it (its config names no default user)."""
    return parse_profile(path.stem, path, read_toml(path), None)


def users_of(profile: Profile) -> tuple[set[str], str]:
    """(the servers' users, the router's user) the profile names."""
    router = next(p for p in profile.processes if p.kind == "router")
    assert router.user is not None, f"{profile.path}: the router names no user"
    return {p.user for p in profile.processes if p.kind == "server" and p.user is not None}, router.user


def stand_in_uids(servers: set[str], router: str) -> dict[str, int]:
    """One unprivileged uid per distinct account name: the servers' is nobody, the router's (when
    it is another name) a uid no account and no running process has, so nothing else is at stake."""
    taken = {e.pw_uid for e in pwd.getpwall()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            taken.add(os.stat(f"/proc/{pid}").st_uid)
        except FileNotFoundError:
            pass  # gone meanwhile
    uids = dict.fromkeys(servers, pwd.getpwnam("nobody").pw_uid)
    uids.setdefault(router, next(u for u in range(64000, 65000) if u not in taken))
    return uids


def as_uid(uid: int) -> list[str]:
    assert SETPRIV is not None
    return [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def state(pid: int) -> str:
    """The process's state letter from /proc/PID/stat ('T' stopped, 'S' sleeping, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def sleeper_dir() -> Iterator[Path]:
    """A 0755 directory with `sleeper`, standing in for sglang_router's module (pytest's tmp_path is 0700)."""
    where = Path(tempfile.mkdtemp())
    where.chmod(0o755)
    (where / "sleeper.py").write_text("import time\nprint('running', flush=True)\ntime.sleep(60)\n")
    yield where
    shutil.rmtree(where)


def test_the_shipped_profiles_run_the_router_as_a_user_of_its_own_that_the_package_creates() -> None:
    """Neither root nor a servers' user; and the package, its purge and the rehearsal know that user."""
    postinst = (REPO / "packaging" / "debian" / "supervisord-gpu.postinst").read_text()
    postrm = (REPO / "packaging" / "debian" / "supervisord-gpu.postrm").read_text()
    makefile = (REPO / "Makefile").read_text()
    created = set(re.findall(r"--shell /usr/sbin/nologin (\S+)\n", postinst))
    removed = set(re.search(r"for user in ([^;]+); do", postrm).group(1).split())  # type: ignore[union-attr]
    make_users = dict(re.findall(r"^(SERVER_USER|ROUTER_USER) = (\S+)$", makefile, re.M))
    assert PROFILES
    for path in PROFILES:
        servers, router = users_of(shipped(path))
        assert router not in servers | {"root"}, f"{path.name}: the router runs as {router}, a servers' user"
        assert servers | {router} <= created, f"postinst creates {created}, {path.name} names {servers | {router}}"
        assert servers | {router} <= removed, f"postrm removes {removed} on purge"
        assert make_users == {"SERVER_USER": "sglang", "ROUTER_USER": router}
    assert "for u in $(SERVER_USER) $(ROUTER_USER); do" in makefile  # `make rehearse` makes both
    assert re.search(r"^REACH = .*reach nobody,\$\(SERVER_USER\),\$\(ROUTER_USER\) ", makefile, re.M)


@as_root
@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_model_code_as_the_servers_user_can_neither_signal_the_router_nor_read_its_key_at_any_time(
        path: Path, sleeper_dir: Path) -> None:
    """The router of each shipped profile, started as the daemon starts it (the key in its
    environment, the shim on its command line), is held before its interpreter runs a line:
    the window the key leaked in. As the servers' user, neither its environment nor a signal
    reaches it then, nor once the shim has run."""
    servers, router = users_of(shipped(path))
    uids = stand_in_uids(servers, router)
    attacker = as_uid(uids[next(iter(servers))])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(sleeper_dir), KEY_ENV: KEY}
    held = ["sh", "-c", 'kill -STOP $$; exec "$@"', "sh", *shim_argv((sys.executable, "-m", "sleeper"))]
    proc = subprocess.Popen([*as_uid(uids[router]), *held], env=env, cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline, "the router never reached its start"
            time.sleep(0.01)
        assert KEY.encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()  # the window: the key is there
        for moment in ("before the shim", "after the shim"):
            r = subprocess.run([*attacker, sys.executable, "-I", "-c", ATTACK, str(proc.pid), KEY],
                               capture_output=True, text=True, timeout=30, cwd="/")
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() == REFUSED, f"{path.name}, {moment}: {r.stdout.strip()}"
            assert proc.poll() is None, f"{path.name}, {moment}: the servers' user killed the router"
            if moment == "before the shim":
                os.kill(proc.pid, signal.SIGCONT)
                assert proc.stdout is not None and proc.stdout.readline() == "running\n", "the shim never ran the router"
    finally:
        proc.kill()
        proc.wait()
