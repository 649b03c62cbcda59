"""The /dev/shm clean-up runs as root on names an unprivileged server user controls.

Each attack test has the attacker (a process as `nobody`, standing in for the `sglang` user
whose model code we do not trust) map or plant something, scans that process as if it were
our cgroup's, kills it and runs `remove_leftovers()`: what is not the attacker's own leftover
in /dev/shm itself must survive. Against the substring / lstat-by-path clean-up these fail:
root deleted the victim. The rest show the real leftovers still go, SGLang's create-and-close
multimodal segments (`sgl_shm_mm_<pid>_<hex8>`) included.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisord_gpu.ownership.files import ShmTracker, _maps_entry, mm_creator, shm_name

SHM = Path("/dev/shm")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)

#: the attacker: maps, creates or holds files, says "ready", waits for stdin to close
CHILD = r"""
import mmap, os, sys
keep = []
for op in sys.argv[1:]:
    verb, path = op.split("=", 1)
    path = path.replace("{pid}", str(os.getpid()))
    if verb == "map":          # create (or open) and map it shared, as a segment is
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        keep.append(mmap.mmap(fd, 4096))
        os.close(fd)
    elif verb == "mapro":      # map someone else's readable file
        fd = os.open(path, os.O_RDONLY)
        keep.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        os.close(fd)
    elif verb == "create":     # SGLang's multimodal pattern: create, fill, close at once
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"x" * 64)
        os.close(fd)
    elif verb == "hold":       # keep it open, not mapped
        keep.append(os.open(path, os.O_RDONLY))
    elif verb == "symlink":    # symlink=LINK>TARGET
        link, target = path.split(">", 1)
        os.symlink(target, link)
print("ready", flush=True)
sys.stdin.read()
"""


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root: the clean-up runs as root and the attacker as `nobody`")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("needs the user `nobody` (and group `nogroup`) to run the attacker unprivileged")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run the attacker as `nobody`")


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    return _nobody()


class Attacker:
    """A process as `nobody` doing CHILD's ops; killed (not stopped) as a crashed server is."""

    live: list[Attacker] = []

    def __init__(self, *ops: str) -> None:
        self.proc = subprocess.Popen(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", PYTHON, "-c", CHILD, *ops],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        Attacker.live.append(self)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"attacker failed: {line!r} (rc {self.proc.poll()})"
        self.pid = self.proc.pid

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def made() -> Iterator[list[Path]]:
    """Everything a test creates, removed at the end whatever happened (never following links)."""
    paths: list[Path] = []
    yield paths
    while Attacker.live:
        Attacker.live.pop().kill()
    for p in reversed(paths):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            p.unlink()


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _crash_and_clean(tracker: ShmTracker, attacker: Attacker) -> list[str]:
    tracker.scan([attacker.pid])
    attacker.kill()
    return tracker.remove_leftovers()


def _root_file(path: Path, mode: int = 0o600) -> Path:
    path.write_bytes(b"root's secret\n")
    os.chmod(path, mode)
    return path


def _nobody_dir(made: list[Path], nobody: pwd.struct_passwd, *parts: str) -> Path:
    """A directory tree under /tmp the attacker owns at its leaf (a normal /tmp work dir of its)."""
    base = Path(f"/tmp/shm-attack-{_tag()}")
    made.append(base)
    leaf = base.joinpath(*parts)
    leaf.mkdir(parents=True)
    for p in [base, *leaf.relative_to(base).parents, leaf.relative_to(base)]:
        os.chown(base / p, nobody.pw_uid, nobody.pw_gid)
    return leaf


# --------------------------------------------------------------------------- attacks


def test_a_planted_dev_shm_symlink_does_not_get_roots_file_deleted(made, nobody):
    """/dev/shm/L -> a dir with root's 0600 file; the attacker maps .../dev/shm/L/victim of its own."""
    tag = _tag()
    target = Path(f"/tmp/shm-target-{tag}")
    target.mkdir()
    made.append(target)
    victim = _root_file(target / "victim")
    link = SHM / f"L-{tag}"
    made.append(link)
    own = _nobody_dir(made, nobody, "dev", "shm", link.name) / "victim"
    attacker = Attacker(f"symlink={link}>{target}", f"map={own}")
    assert os.path.islink(link) and os.lstat(link).st_uid == nobody.pw_uid

    removed = _crash_and_clean(ShmTracker(nobody.pw_uid), attacker)

    assert victim.read_bytes() == b"root's secret\n", "root deleted a file through a planted symlink"
    assert removed == [] and os.path.islink(link) and own.exists()


def test_a_mapped_path_merely_containing_dev_shm_is_not_taken_for_a_segment(made, nobody):
    """The attacker maps /tmp/X/dev/shm/NAME; root's /dev/shm/NAME is another file and stays."""
    name = f"victim-{_tag()}"
    victim = _root_file(SHM / name)
    made.append(victim)
    own = _nobody_dir(made, nobody, "dev", "shm") / name
    attacker = Attacker(f"map={own}")

    removed = _crash_and_clean(ShmTracker(nobody.pw_uid), attacker)

    assert victim.exists(), "root deleted /dev/shm/NAME because a mapped path contained it"
    assert removed == []


def test_another_users_segment_mapped_by_our_process_stays(made, nobody):
    """A root-owned (another user's) segment directly in /dev/shm, readable, mapped by our process."""
    theirs = _root_file(SHM / f"sgl_other_{_tag()}", 0o644)
    made.append(theirs)
    attacker = Attacker(f"mapro={theirs}")

    removed = _crash_and_clean(ShmTracker(nobody.pw_uid), attacker)

    assert theirs.exists(), "root deleted another user's segment"
    assert removed == []


def test_a_symlink_directly_in_dev_shm_is_neither_followed_nor_removed(made, nobody):
    """The attacker maps its own segment, then replaces its name by a symlink to root's file."""
    tag = _tag()
    victim = _root_file(SHM / f"victim-{tag}")
    made.append(victim)
    seg = SHM / f"sgl_shm_swap_{tag}"
    made.append(seg)
    attacker = Attacker(f"map={seg}")
    tracker = ShmTracker(nobody.pw_uid)
    tracker.scan([attacker.pid])
    attacker.kill()
    seg.unlink()
    swap = Attacker(f"symlink={seg}>{victim}")
    swap.kill()

    assert tracker.remove_leftovers() == []
    assert victim.exists() and seg.is_symlink()


# --------------------------------------------------------------------------- real leftovers


def test_our_own_leftover_segment_is_removed(made, nobody):
    seg = SHM / f"sgl_shm_test_{_tag()} with space"
    made.append(seg)
    attacker = Attacker(f"map={seg}")

    removed = _crash_and_clean(ShmTracker(nobody.pw_uid), attacker)

    assert removed == [str(seg)] and not os.path.lexists(seg)


def test_create_and_close_multimodal_segments_of_our_pids_go_others_stay(made, nobody):
    """sgl_shm_mm_<our pid>_<hex8> goes; another live process's, a symlink and a foreign-owned one stay."""
    other = Attacker(f"create={SHM}/sgl_shm_mm_{{pid}}_{_tag()[:8]}")
    ours_name = f"sgl_shm_mm_{{pid}}_{_tag()[:8]}"
    decoy = SHM / f"decoy-{_tag()}"
    made.append(decoy)
    decoy.write_bytes(b"nobody's\n")
    os.chown(decoy, nobody.pw_uid, nobody.pw_gid)
    link_name = f"sgl_shm_mm_{{pid}}_{_tag()[:8]}"
    ours_proc = Attacker(f"create={SHM}/{ours_name}", f"symlink={SHM}/{link_name}>{decoy}")
    pid = ours_proc.pid
    ours, link = SHM / ours_name.format(pid=pid), SHM / link_name.format(pid=pid)
    foreign_owned = _root_file(SHM / f"sgl_shm_mm_{pid}_{_tag()[:8]}")
    theirs = [p for p in SHM.glob(f"sgl_shm_mm_{other.pid}_*")]
    made.extend([ours, link, foreign_owned, *theirs])
    assert ours.exists() and link.is_symlink() and len(theirs) == 1
    tracker = ShmTracker(nobody.pw_uid)
    tracker.scan([pid])

    ours_proc.kill()
    removed = tracker.remove_leftovers()
    other.kill()

    assert removed == [str(ours)] and not ours.exists()
    assert theirs[0].exists(), "another server's (a PID never in our cgroup) segment was removed"
    assert link.is_symlink() and decoy.exists() and foreign_owned.exists()


def test_a_multimodal_segment_older_than_our_process_of_that_pid_stays(made, nobody):
    """PIDs are reused: a segment made before our process with that PID started is a previous holder's."""
    attacker = Attacker(f"create={SHM}/sgl_shm_mm_{{pid}}_{_tag()[:8]}")
    (seg,) = SHM.glob(f"sgl_shm_mm_{attacker.pid}_*")
    made.append(seg)
    tracker = ShmTracker(nobody.pw_uid)
    tracker.scan([attacker.pid])
    assert abs(tracker.started[attacker.pid] - time.time()) < 30
    tracker.started[attacker.pid] = os.stat(seg).st_ctime + 5  # as if our process started later
    attacker.kill()

    assert tracker.remove_leftovers() == [] and seg.exists()


@pytest.mark.parametrize("how", ["hold", "mapro"])
def test_a_segment_another_live_process_still_holds_stays(made, nobody, how):
    seg = SHM / f"sgl_shm_keep_{_tag()}"
    made.append(seg)
    attacker = Attacker(f"map={seg}")
    holder = Attacker(f"{how}={seg}")
    try:
        removed = _crash_and_clean(ShmTracker(nobody.pw_uid), attacker)
        assert removed == [] and seg.exists()
    finally:
        holder.kill()


# --------------------------------------------------------------------------- parsing


def test_only_a_single_component_directly_in_dev_shm_is_a_name():
    assert shm_name("/dev/shm/nccl-abc") == "nccl-abc"
    assert shm_name("/dev/shm/a b (deleted)") == "a b (deleted)"
    for bad in ["/dev/shm/", "/dev/shm/.", "/dev/shm/..", "/dev/shm/L/x", "/tmp/dev/shm/x", "/dev/shmx", "/dev/shm/a\nb", "/dev/shm/a\0"]:
        assert shm_name(bad) is None, bad


def test_a_maps_path_is_the_whole_rest_of_the_line():
    line = "7f46224f1000-7f46224f2000 rw-s 00000000 00:1b 42                  /tmp/x/dev/shm/a b\n"
    assert _maps_entry(line) == ("/tmp/x/dev/shm/a b", (os.makedev(0, 0x1B), 42))
    assert _maps_entry("7ffd1000-7ffd2000 rw-p 00000000 00:00 0                  [stack]\n") is None
    assert _maps_entry("7ffd1000-7ffd2000 rw-p 00000000 00:00 0\n") is None


def test_only_sglangs_exact_multimodal_name_carries_a_creator_pid():
    assert mm_creator("sgl_shm_mm_4711_0123abcd") == 4711
    for bad in ["sgl_shm_mm_0_0123abcd", "sgl_shm_mm_-1_0123abcd", "sgl_shm_mm_4711_0123ABCD", "sgl_shm_mm_4711_0123abc",
                "sgl_shm_mm_4711_0123abcd0", "sgl_shm_mm_4711_01_3abcd", "sgl_shm_mq_4711_0123abcd", "sgl_shm_mm_04711_0123abcd",
                "sgl_shm_mm_４７_0123abcd", "sgl_shm_mm__0123abcd"]:
        assert mm_creator(bad) is None, bad
