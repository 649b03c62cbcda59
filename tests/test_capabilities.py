"""The daemon's file clean-ups work without CAP_DAC_OVERRIDE and CAP_FOWNER.

Those two are what let a planted link aim root at other users' files (issue #23), so the unit
no longer keeps them. Each test runs the step in a root process whose bounding set lacks
them (`setpriv --bounding-set`: root's exec gets only what the bounding set holds), as the
daemon runs under `dsv4@.service`, against a directory the server's user (`nobody` here)
filled as it liked: a private TMPDIR is prepared and emptied, its planted links followed
nowhere, and a leftover /dev/shm segment removed. One test shows that root without them can
no longer read such a directory itself, which is why the emptying runs as the user.
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

REPO = Path(__file__).resolve().parent.parent
DROPPED = "-dac_override,-fowner,-dac_read_search"


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root: the daemon's clean-up runs as root, the server as `nobody`")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("needs the user `nobody`")


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 parent, as /run/supervisord-gpu/PROFILE/tmp is."""
    path = Path(f"/tmp/caps-{uuid.uuid4().hex[:10]}")
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_daemon(code: str) -> dict:
    """Run `code` as root without CAP_DAC_OVERRIDE, CAP_FOWNER (and DAC_READ_SEARCH); it prints JSON."""
    done = subprocess.run(["setpriv", f"--bounding-set={DROPPED}", sys.executable, "-c", code],
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
caps = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith("Cap"))
assert not int(caps["CapEff"], 16) & ((1 << 1) | (1 << 2) | (1 << 3)), caps  # really without them
from supervisord_gpu.ownership.files import PrivateDir, ShmTracker, _clear
"""


def test_a_private_tmpdir_is_prepared_and_emptied_without_dac_override_and_fowner(nobody, base):
    tmpdir = base / "server"
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


def test_root_without_dac_override_cannot_read_the_users_tmpdir_itself(nobody, base):
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
