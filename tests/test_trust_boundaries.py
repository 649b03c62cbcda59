"""Trust boundaries a hostile local user probes: each attack runs as user nobody, the daemon as root.

1. a profile reached through a symlink into a directory nobody writes, swapped mid-load;
2. a cgroup nobody creates with our names in a subtree delegated to them;
3. forged or deleted simulated-GPU holdings;
4. path arguments no shell would type (long, non-UTF-8, a file for a directory);
5. two spellings of loopback on one port.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.errors import ConfigError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks run as nobody, from a root test process")
NOBODY = pwd.getpwnam("nobody")
AS_NOBODY = ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # nobody may not reach pyenv

PROFILE = """
description = "{who}"
[defaults]
user = "root"
[servers.server]
gpus = [0]
port = 31000
model_path = "/m"
"""


def as_nobody(*argv: str, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*AS_NOBODY, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload]


def run_as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AS_NOBODY, *argv], capture_output=True, text=True, timeout=60)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A root-owned 0755 directory outside pytest's tmp (0700 there: nobody could not reach it)."""
    d = Path(tempfile.mkdtemp(prefix="sgpu-trust-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config_dir(base: Path) -> Path:
    cdir = base / "etc"
    (cdir / "profiles").mkdir(parents=True)
    (cdir / "supervisord-gpu.toml").write_text("[daemon]\n")
    return cdir


def user_dir(base: Path) -> Path:
    d = base / "home"
    d.mkdir()
    os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
    return d


# ----------------------------------------------------------------------------- 1. profile swap race

SWAPPER = textwrap.dedent("""
    import os, sys
    d, good, evil_text = sys.argv[1], sys.argv[2], sys.argv[3]
    link, evil, target = d + "/.link", d + "/.evil", d + "/p.toml"
    while True:
        try:
            os.symlink(good, link)
        except FileExistsError:
            pass
        os.replace(link, target)
        with open(evil, "w") as f:
            f.write(evil_text)
        os.replace(evil, target)
""")


def test_a_profile_swapped_through_a_users_directory_never_loads_their_content(shared: Path) -> None:
    """nobody swaps home/p.toml between a link to root's profile and their own, as fast as
    they can, while root loads the profile 300 times: never theirs (here: always refused,
    the link's target directory is nobody's). Path-based check-then-read loaded theirs."""
    cdir = config_dir(shared)
    home = user_dir(shared)
    good = shared / "good.toml"
    good.write_text(PROFILE.format(who="root"))
    (home / "p.toml").symlink_to(good)
    os.lchown(home / "p.toml", NOBODY.pw_uid, NOBODY.pw_gid)
    (cdir / "profiles" / "p.toml").symlink_to(home / "p.toml")
    swapper = as_nobody(PYTHON, "-I", "-S", "-c", SWAPPER, str(home), str(good), PROFILE.format(who="nobody"))
    try:
        time.sleep(0.2)
        assert swapper.poll() is None, swapper.stderr.read() if swapper.stderr else ""
        cfg = load_daemon_config(cdir)
        seen: dict[str, int] = {}
        for _ in range(300):
            try:
                who = load_profile(cfg, "p").description
            except ConfigError as e:
                who = "refused" if "is writable by non-root users" in str(e) else f"other: {e}"
            seen[who] = seen.get(who, 0) + 1
    finally:
        swapper.kill()
        swapper.wait()
    assert "nobody" not in seen, seen
    assert set(seen) == {"refused"}, seen


def test_a_symlinked_profile_is_followed_only_through_roots_links_and_directories(shared: Path) -> None:
    cdir = config_dir(shared)
    (shared / "kept").mkdir()
    (shared / "kept" / "real.toml").write_text(PROFILE.format(who="root"))
    link = cdir / "profiles" / "p.toml"
    link.symlink_to("../../kept/real.toml")  # relative, with "..": resolved from the verified directory
    cfg = load_daemon_config(cdir)
    assert load_profile(cfg, "p").description == "root"
    os.lchown(link, NOBODY.pw_uid, NOBODY.pw_gid)  # the same link, but nobody's
    with pytest.raises(ConfigError, match=f"p.toml: is writable by non-root users \\(owner uid {NOBODY.pw_uid}"):
        load_profile(cfg, "p")


def test_a_config_dir_linked_from_a_users_home_is_refused(shared: Path) -> None:
    """The config directory itself a link into nobody's home: refused, whatever it points at."""
    home = user_dir(shared)
    cdir = config_dir(shared)
    (cdir / "profiles" / "p.toml").write_text(PROFILE.format(who="root"))
    (home / "etc").symlink_to(cdir)
    with pytest.raises(ConfigError, match=f"{home}: is writable by non-root users"):
        load_profile(load_daemon_config(home / "etc"), "p")


# ----------------------------------------------------------------------------- 2. look-alike cgroup

LOOKALIKE = textwrap.dedent("""
    import os, socket, sys
    sys.stdin.readline()  # root has moved us into the subtree delegated to us
    group = sys.argv[1] + "/supervisord-gpu/pd-1p1d/router"
    os.makedirs(group)
    with open(group + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    sys.stdin.readline()
""")


def delegate(group: Path) -> None:
    """Hand a cgroup to nobody the way systemd's Delegate= does: the directory and its control files."""
    group.mkdir()
    for path in (group, group / "cgroup.procs", group / "cgroup.subtree_control", group / "cgroup.threads"):
        if path.exists():
            os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)


@pytest.fixture
def lookalike(cgroups):  # type: ignore[no-untyped-def]
    """nobody, in a subtree delegated to them, in a cgroup `.../supervisord-gpu/pd-1p1d/router`, listening."""
    deleg = cgroups.top / "deleg"
    delegate(deleg)
    proc = subprocess.Popen([*AS_NOBODY, PYTHON, "-I", "-S", "-c", LOOKALIKE, str(deleg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    (deleg / "cgroup.procs").write_text(str(proc.pid))
    proc.stdin.write("\n")
    proc.stdin.flush()
    port = int(proc.stdout.readline())
    yield proc, port, deleg
    proc.kill()
    proc.wait()


def test_a_users_cgroup_named_like_ours_is_foreign_and_blocks_a_takeover(lookalike) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from supervisord_gpu.checks.holders import describe_pid
    from supervisord_gpu.checks.ports import check_port
    from supervisord_gpu.controller.preflight import blocking_problems

    proc, port, deleg = lookalike
    from supervisord_gpu.names import owner_of_cgroup

    assert owner_of_cgroup(describe_pid(proc.pid).cgroup) is not None  # the name alone says "ours": that was the hole
    assert describe_pid(proc.pid).owner is None  # every holder (ports and GPUs) is checked on disk
    status = check_port("127.0.0.1", port, "router")
    (holder,) = status.holders
    assert holder.pid == proc.pid and holder.cgroup.endswith("/deleg/supervisord-gpu/pd-1p1d/router")  # type: ignore[union-attr]
    assert holder.owner is None and status.problem().endswith("(foreign)"), status.problem()  # type: ignore[union-attr]
    report = SimpleNamespace(gpus=[], gpu_holders={}, ports=[status])
    conflict = SimpleNamespace(instance="pd-1p1d", gpus=[], ports=[port])
    (problem,) = blocking_problems(report, [conflict])  # type: ignore[arg-type]
    assert f"pid {proc.pid}" in problem and "(foreign)" in problem
    assert proc.poll() is None


def test_a_cgroup_root_inside_a_users_delegated_subtree_is_refused(lookalike) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.errors import OwnershipError
    from supervisord_gpu.ownership.cgroupfs import CgroupfsDriver

    proc, _port, deleg = lookalike
    with pytest.raises(OwnershipError, match="is not root's alone"):
        CgroupfsDriver(deleg / "supervisord-gpu")
    assert proc.poll() is None


def test_our_own_cgroupfs_tree_is_still_ours(cgroups) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.ownership.cgroupfs import CgroupfsDriver, root_only, verified_owner
    from supervisord_gpu.names import Owner

    CgroupfsDriver(cgroups.root)
    group = cgroups.root / "pd-1p1d" / "router"
    group.mkdir(parents=True)
    rel = "/" + str(group.relative_to(cgroups.top.parent))
    assert root_only(rel) and verified_owner(rel) == Owner("pd-1p1d", "router")
    assert not root_only(rel + "/../../..") and not root_only("/no-such-cgroup/supervisord-gpu/a/b")


# ----------------------------------------------------------------------------- 3. simulated GPU holdings

VICTIM = textwrap.dedent("""
    import sys
    from supervisord_gpu.checks.simgpu import SimulatedGpus
    SimulatedGpus(sys.argv[1]).hold([0], 1000)
    print("held", flush=True)
    sys.stdin.readline()
""")

ATTACKER = textwrap.dedent("""
    import json, os, sys
    h, pid, create_time = sys.argv[1] + "/holders", int(sys.argv[2]), float(sys.argv[3])
    forged = json.dumps({"pid": pid, "create_time": create_time, "gpus": [1], "mib": 99999})
    done = []

    def attempt(what, fn, *args):
        try:
            fn(*args)
            done.append(what)
        except OSError:
            pass

    def write(path):
        with open(path, "w") as f:
            f.write(forged)

    attempt("squat", os.mkdir, f"{h}/{sys.argv[4]}")  # the victim's name, before the victim
    if sys.argv[5] == "attack":
        attempt("mkdir own", os.makedirs, f"{h}/{os.getuid()}", 0o755, True)
        for path in (f"{h}/{pid}.json", f"{h}/forged.json", f"{h}/{os.getuid()}/{pid}.json",
                     f"{h}/{os.getuid()}/forged.json"):
            attempt("forge " + path, write, path)
        for sub in os.listdir(h):
            if os.stat(f"{h}/{sub}").st_uid != os.getuid():
                attempt("forge in " + sub, write, f"{h}/{sub}/{pid}.json")
        for top, dirs, files in os.walk(h, topdown=False):
            for name in files:
                if os.stat(f"{top}/{name}").st_uid != os.getuid():
                    attempt("delete " + name, os.unlink, f"{top}/{name}")
            for name in dirs:
                if os.stat(f"{top}/{name}").st_uid != os.getuid():
                    attempt("rename " + name, os.rename, f"{top}/{name}", f"{h}/.gone-{name}")
    print(done, flush=True)
""")


def as_user(user: str, *argv: str, **kw: object) -> subprocess.Popen[str]:
    pw = pwd.getpwnam(user)
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{Path.cwd()}:{site}"}
    return subprocess.Popen(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *argv],
                            env=env, text=True, **kw)  # type: ignore[call-overload]


@pytest.mark.parametrize("order", ["attack", "squat first"])
def test_nobody_can_neither_forge_nor_remove_another_users_simulated_gpu_holding(shared: Path, order: str) -> None:
    import psutil

    from supervisord_gpu.checks.simgpu import SimulatedGpus

    sim = SimulatedGpus.create(shared / "sim", 2)
    assert (shared / "sim" / "holders").stat().st_mode & 0o7777 == 0o1777
    victim_uid = pwd.getpwnam("daemon").pw_uid
    squat_first = order == "squat first"

    def attacker(victim_pid: int) -> list[str]:
        create_time = psutil.Process(victim_pid).create_time() if victim_pid else 0.0
        out = subprocess.run([*AS_NOBODY, PYTHON, "-I", "-S", "-c", ATTACKER, str(sim.directory), str(victim_pid),
                              str(create_time), str(victim_uid), "squat" if squat_first else "attack"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return eval(out.stdout)  # noqa: S307  (our own script's repr of a list of str)

    if squat_first:
        assert attacker(0) == ["squat"]
    victim = as_user("daemon", PYTHON, "-c", VICTIM, str(sim.directory), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert victim.stdout is not None and victim.stdout.readline() == "held\n"
        if not squat_first:
            done = attacker(victim.pid)
            assert not [d for d in done if d.startswith(("forge in", "delete", "rename"))], done
        found = [(h.pid, h.gpus, h.mib) for h in sim.holders()]
        assert found == [(victim.pid, (0,), 1000)], found  # the victim's own, and no forged one
    finally:
        victim.kill()
        victim.wait()
    assert sim.holders() == []


# ----------------------------------------------------------------------------- 4. path arguments

def _bad_dirs(base: Path) -> dict[str, tuple[str, str]]:
    """argv can hold anything but NUL: each case, and what the one line must say."""
    (base / "a-file").write_text("")
    return {
        "5000 characters": ("a" * 5000, "… (5000 characters): cannot be used as the config directory (File name too long)"),
        "4200 characters in components": ("/a" * 2100, "(4200 characters): "),
        "not UTF-8": (os.fsdecode(b"/tmp/\xff\xfe-nope"), "/tmp/\\xff\\xfe-nope: config directory does not exist"),
        "a file": (str(base / "a-file"), "a-file: is not a directory"),
        "through a file": (str(base / "a-file" / "x"), "a-file/x: cannot be used as the config directory (Not a directory)"),
    }


@pytest.mark.parametrize("case", ["5000 characters", "4200 characters in components", "not UTF-8", "a file",
                                  "through a file"])
@pytest.mark.parametrize("cli", ["gpusupctl render", "gpusupctl check", "supervisord-gpu run", "environment"])
def test_a_bad_config_dir_is_one_line_naming_it_exit_2(shared: Path, capsys, monkeypatch, case: str, cli: str) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.cli import daemon as daemon_cli
    from supervisord_gpu.cli import gpusupctl

    path, expected = _bad_dirs(shared)[case]
    if cli == "supervisord-gpu run":
        rc = daemon_cli.main(["run", "p", "--config-dir", path])
    elif cli == "environment":
        monkeypatch.setenv("SUPERVISORD_GPU_CONFIG_DIR", path)
        rc = gpusupctl.main(["render", "p"])
    else:
        rc = gpusupctl.main([*cli.split()[1:], "p", "--config-dir", path])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "internal error" not in err and len(err.splitlines()) == 1, err
    assert rc == 2 and expected in err, err
    assert len(err) < 400, err


# ----------------------------------------------------------------------------- 5. loopback spellings

@pytest.mark.parametrize(("a", "b"), [("127.0.0.1", "localhost"), ("localhost", "::1"), ("::1", "ip6-localhost"),
                                      ("127.0.0.2", "LOCALHOST"), ("::ffff:127.0.0.1", "127.0.0.1"), ("*", "::1")])
def test_two_spellings_of_loopback_on_one_port_are_refused(tmp_path: Path, a: str, b: str) -> None:
    cdir = config_dir(tmp_path)
    (cdir / "profiles" / "p.toml").write_text(textwrap.dedent(f"""
        [defaults]
        user = "root"
        [servers.one]
        gpus = [0]
        host = "{a}"
        port = 31000
        model_path = "/m"
        [servers.two]
        gpus = [1]
        host = "{b}"
        port = 31000
        model_path = "/m"
    """))
    with pytest.raises(ConfigError, match="port 31000 .* is also used by"):
        load_profile(load_daemon_config(cdir), "p")


def test_distinct_addresses_on_one_port_are_still_fine() -> None:
    from supervisord_gpu.config.loader import _hosts_overlap

    assert not _hosts_overlap("10.0.0.1", "localhost") and not _hosts_overlap("127.0.0.1", "10.0.0.1")
    assert not _hosts_overlap("localhost-not", "127.0.0.1") and _hosts_overlap("a.localhost", "::1")


LISTENER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET6)
    s.bind(("::1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    sys.stdin.readline()
""")


def test_a_strangers_ipv6_loopback_listener_holds_localhost(shared: Path) -> None:
    from supervisord_gpu.checks.ports import check_port

    try:
        with __import__("socket").socket(__import__("socket").AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([*AS_NOBODY, PYTHON, "-I", "-S", "-c", LISTENER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        status = check_port("localhost", port, "router")
        assert not status.free and status.error is None, status
        assert [h.pid for h in status.holders] == [proc.pid] and "(user nobody)" in (status.problem() or "")
        # a literal 127.0.0.1 is held too: our server could bind it, but a client of
        # `localhost:P` (an operator's curl) tries ::1 first and would reach the stranger
        literal = check_port("127.0.0.1", port, "router")
        assert not literal.free and [h.pid for h in literal.holders] == [proc.pid], literal
    finally:
        proc.kill()
        proc.wait()
