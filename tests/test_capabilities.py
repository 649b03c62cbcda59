"""The daemon's file clean-ups work without CAP_DAC_OVERRIDE and CAP_FOWNER.

Those two are what let a planted link aim root's removals at other users' files (issue #23),
so the unit no longer keeps them. Each test runs the step in a root process whose bounding
set lacks them (`setpriv --bounding-set`: root's exec gets only what the bounding set holds),
as the daemon runs under `dsv4@.service`, against a directory the server's user (`nobody`
here) filled as it liked: a private TMPDIR is prepared (its parents passable by that user)
and emptied, its planted links followed nowhere, a compile cache shared by two servers of
one user prepared by both at once, and a leftover /dev/shm segment removed.
One test shows that root without them can no longer empty such a directory itself, which is
why the emptying runs as the user. Two show why CAP_DAC_READ_SEARCH stays: without it root
cannot list another user's /proc/PID/fd, so a server's own listener would look like nobody's.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import nobody_user

REPO = Path(__file__).resolve().parent.parent
DROPPED = "-dac_override,-fowner"  # what dsv4@.service's CapabilityBoundingSet leaves out


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    return nobody_user("the daemon's clean-up runs as root, the server as `nobody`")


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 parent, as /run/supervisord-gpu/PROFILE is (RuntimeDirectoryMode=0755)."""
    path = Path(f"/tmp/caps-{uuid.uuid4().hex[:10]}")
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_daemon(code: str, also: str = "") -> dict:
    """Run `code` as root without CAP_DAC_OVERRIDE and CAP_FOWNER (and `also`); it prints JSON."""
    done = subprocess.run(["setpriv", f"--bounding-set={DROPPED}{also}", sys.executable, "-c", code],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def as_nobody(script: str) -> None:
    subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-c", script],
                   check=True, timeout=30)


PREAMBLE = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
os.umask(0o027)  # the unit's UMask
caps = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith("Cap"))
assert not int(caps["CapEff"], 16) & ((1 << 1) | (1 << 3)), caps  # really without them
from supervisord_gpu.ownership.files import PrivateDir, ShmTracker, _clear
"""


def test_a_private_tmpdir_is_prepared_and_emptied_without_dac_override_and_fowner(nobody, base):
    tmpdir = base / "tmp" / "server"  # tmp/ is made by prepare, under the unit's umask
    victim = base / "roots-file"
    victim.write_text("root's\n")
    os.chmod(victim, 0o600)
    code = PREAMBLE + f"""
d = PrivateDir(Path({str(tmpdir)!r}), {nobody.pw_uid}, {nobody.pw_gid})
d.prepare()
st = os.stat(d.path)
print(json.dumps({{"mode": st.st_mode & 0o7777, "uid": st.st_uid}}))
"""
    made = as_daemon(code)
    assert made == {"mode": 0o700, "uid": nobody.pw_uid}
    assert os.stat(tmpdir.parent).st_mode & 0o7777 == 0o711  # its user passes through, nobody lists it
    # the server's user fills it as it likes: nested directories, links out to root's file and to /etc
    as_nobody(f"cd {tmpdir} && mkdir -p a/b && touch a/b/c ipc1 && chmod 000 a/b && ln -s {victim} l && ln -s /etc e")
    as_nobody(f"chmod 0755 {tmpdir}")  # a mode gone wrong while it is the user's: prepare puts it back
    code = PREAMBLE + f"""
d = PrivateDir(Path({str(tmpdir)!r}), {nobody.pw_uid}, {nobody.pw_gid})
d.prepare()
mode = os.stat(d.path).st_mode & 0o7777
removed = d.clear()
print(json.dumps({{"mode": mode, "removed": sorted(removed)}}))
"""
    out = as_daemon(code)
    assert out["mode"] == 0o700
    assert out["removed"] == sorted(str(tmpdir / n) for n in ("a", "e", "ipc1", "l"))
    assert os.listdir(tmpdir) == []
    assert victim.read_text() == "root's\n" and Path("/etc/passwd").exists()  # nothing followed


def test_a_cache_dir_below_a_directory_another_user_can_change_is_refused_with_nothing_made(nobody, base):
    """SECURITY.md, Files: a `cache_dir` an operator put under the server user's own directory.
    Root made <cache_dir>/<user> there and chowned it by path, so that user could swap a
    component for a link between root's check and its chown and be handed another directory.
    The nearest existing directory is now verified (root's alone, from / down) before anything
    is made in it, and what is made is made relative to it."""
    home = base / "home"  # the user's own: it may rename, replace and plant there at will
    home.mkdir(mode=0o755)
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    for target in (home / "cache" / "nobody", home / "nobody"):  # a parent to make, and the user's dir itself
        code = PREAMBLE + f"""
from supervisord_gpu.config.trust import UntrustedPath
try:
    PrivateDir(Path({str(target)!r}), {nobody.pw_uid}, {nobody.pw_gid}).prepare()
    print(json.dumps({{"refused": ""}}))
except UntrustedPath as e:
    print(json.dumps({{"refused": str(e)}}))
"""
        refused = as_daemon(code)["refused"]
        assert refused.startswith(f"refusing to prepare {target}: {home} is writable by non-root users "
                                  f"(owner uid {nobody.pw_uid}"), refused
        assert os.listdir(home) == []  # nothing made there by root


def test_a_cache_dir_that_is_roots_link_is_followed_and_nobodys_link_is_refused(nobody, base):
    """An operator's `cache_dir` may be a link root made (to a bigger disk), followed; one in a
    directory others can write (where another user made it) is refused, naming that directory,
    with nothing made at its end."""
    disk = base / "disk"
    disk.mkdir(mode=0o755)
    (base / "cache").symlink_to(disk)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    sticky = base / "sticky"  # others may add entries, as in /tmp, but not touch root's
    sticky.mkdir()
    sticky.chmod(0o1777)
    as_nobody(f"ln -s {elsewhere} {sticky}/cache")
    code = PREAMBLE + f"""
from supervisord_gpu.config.trust import UntrustedPath
out = {{}}
for name, target in (("root", {str(base / "cache" / "nobody")!r}), ("nobody", {str(sticky / "cache" / "nobody")!r})):
    try:
        PrivateDir(Path(target), {nobody.pw_uid}, {nobody.pw_gid}).prepare()
        out[name] = ""
    except UntrustedPath as e:
        out[name] = str(e)
print(json.dumps(out))
"""
    out = as_daemon(code)
    assert out["root"] == "" and (disk / "nobody").stat().st_uid == nobody.pw_uid
    assert out["nobody"].startswith(f"refusing to prepare {sticky}/cache/nobody: {sticky} is writable by non-root"), out
    assert os.listdir(elsewhere) == []


def test_two_servers_of_one_user_prepare_their_shared_cache_side_by_side_without_fowner(nobody, base):
    """Prefill and decode run as one user and share its compile cache; the daemon prepares both
    in threads at once. Without CAP_FOWNER a chmod landing after the other's last chown failed
    with EPERM (seen in 12 of 32 first starts under systemd), and the whole start with it."""
    code = PREAMBLE + f"""
import threading
errors = []
for round in range(40):
    d = Path({str(base)!r}) / "cache" / f"r{{round}}" / "user"
    gate = threading.Barrier(4)
    def prepare():
        gate.wait()
        try:
            PrivateDir(d, {nobody.pw_uid}, {nobody.pw_gid}).prepare()
        except OSError as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    st = os.stat(d)
    assert (st.st_uid, st.st_mode & 0o7777) == ({nobody.pw_uid}, 0o700), (st.st_uid, oct(st.st_mode))
print(json.dumps({{"errors": errors[:3]}}))
"""
    assert as_daemon(code) == {"errors": []}


def test_root_without_dac_override_cannot_empty_the_users_tmpdir_itself(nobody, base):
    """Why the emptying runs as the user: done by root in-process (before), it now fails."""
    tmpdir = base / "server"
    tmpdir.mkdir(mode=0o700)
    os.chown(tmpdir, nobody.pw_uid, nobody.pw_gid)
    as_nobody(f"touch {tmpdir}/ipc1")
    code = PREAMBLE + f"""
try:
    _clear(Path({str(tmpdir)!r}))
    print(json.dumps({{"refused": False}}))
except PermissionError:
    print(json.dumps({{"refused": True}}))
"""
    assert as_daemon(code) == {"refused": True}
    assert os.listdir(tmpdir) == ["ipc1"]


def test_a_leftover_segment_in_dev_shm_is_removed_without_fowner(nobody):
    """/dev/shm is sticky and root's: its owner may remove any name in it, no CAP_FOWNER needed."""
    name = f"caps-{uuid.uuid4().hex[:10]}"
    seg = Path("/dev/shm") / name
    proc = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c",
         "import mmap, os, sys\n"
         f"fd = os.open('/dev/shm/{name}', os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 4096)\n"
         "m = mmap.mmap(fd, 4096); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        code = PREAMBLE + f"""
t = ShmTracker({nobody.pw_uid})
t.scan([{proc.pid}])
os.kill({proc.pid}, 9)
while not open("/proc/{proc.pid}/stat").read().split(")")[1].split()[0] == "Z":
    pass
removed = t.remove_leftovers()
print(json.dumps({{"removed": removed}}))
"""
        assert as_daemon(code) == {"removed": [str(seg)]}
        assert not seg.exists()
    finally:
        proc.kill()
        proc.wait()
        if os.path.lexists(seg):
            seg.unlink()


@pytest.mark.parametrize("kept", [True, False], ids=["with-dac-read-search", "without-it"])
def test_the_daemon_sees_a_servers_sockets_only_with_dac_read_search(nobody, kept):
    """A server's listener is told from a stranger's by the socket inodes in its /proc/PID/fd;
    listing another user's fd directory needs CAP_DAC_READ_SEARCH (ptrace rights are not
    enough), so without it the daemon waited forever for its own server to answer as itself."""
    proc = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c",
         "import socket, sys\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
         "print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        code = PREAMBLE + f"""
from supervisord_gpu.ownership.procfs import fd_targets
print(json.dumps({{"sockets": sum(t.startswith("socket:[") for t in fd_targets({proc.pid}))}}))
"""
        seen = as_daemon(code, also="" if kept else ",-dac_read_search")["sockets"]
        assert (seen >= 1) if kept else (seen == 0)
    finally:
        proc.kill()
        proc.wait()
