"""Files a process leaves behind when it is killed, attributed as exactly as its processes are.

SGLang cleans up its shared-memory segments (`/dev/shm/...`, NCCL's and CUDA's too) and its
`ipc://` socket files only on a graceful exit. A SIGKILL (our cgroup kill at the deadline, its
own crash path, PDEATHSIG) leaks them, and accumulated leaks make later schedulers die of
SIGBUS. Two mechanisms, neither a guess by name:

* a private TMPDIR per process (`PrivateDir`): SGLang names its ipc endpoints with
  `tempfile`, so they land in a directory only that process uses; it is emptied once the
  process's cgroup is empty;
* `ShmTracker`: while the process runs, the segments its cgroup's members have mapped or open
  (/proc/PID/maps and /proc/PID/fd) are recorded by name and inode; once the cgroup is empty,
  each recorded file that is still the same inode, still the process's user's and held by no
  live process is removed. SGLang's multimodal segments (`sgl_shm_mm_<pid>_<hex8>`) are
  created and closed at once, so nobody maps them after a crash; their name carries the
  creator's PID, and those of a PID seen in our cgroup are removed too. Another server's
  segments were never mapped by our cgroup, nor named by one of its PIDs, and are never looked at.

The clean-up runs as root on names the process's user controls, so it touches only entries
directly in /dev/shm, through a descriptor of that directory, never following a symlink
(see `ShmTracker`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import subprocess
import threading
import time
from ..records import dataclass, field
from pathlib import Path
from collections.abc import Collection, Iterable, Iterator

from ..config.trust import UntrustedPath, open_verified_dir
from ..errors import ConfigError
from .procfs import all_pids, is_zombie, open_files, read_text

SHM_DIR = "/dev/shm"
#: SGLang's `make_shm_name("mm")`: f"sgl_shm_mm_{os.getpid()}_{uuid.uuid4().hex[:8]}"
MM_PREFIX = "sgl_shm_mm_"
MM_SUFFIX_LEN = 8
#: a multimodal segment older than its creator PID's process (minus this) is a previous
#: holder's of that PID, not ours
START_SLACK_S = 1.0
#: emptying a TMPDIR as its user: SGLang leaves a handful of ipc files; a wedged file system is not our wait
CLEAR_TIMEOUT_S = 30.0

Ident = tuple[int, int]  # (st_dev, st_ino)

_PREPARING = threading.Lock()  # one re-owning at a time in this daemon (PrivateDir.prepare)


@dataclass
class PrivateDir:
    """A directory owned by the child's user, mode 0700, under a root-owned parent.

    Root never writes inside it: the daemon keeps no CAP_DAC_OVERRIDE or CAP_FOWNER (they
    are what let a planted link aim root's clean-up at other users' files),
    so the mode is set while the directory is still root's, and emptying it is done by a
    short-lived process running as its user (`clear`): it can remove only what that user
    could remove anyway, whatever the user planted inside.

    Its parent is opened once by descriptor, each directory from / down checked as
    root's alone (config/trust.py, `open_verified_dir`), and the directory is made, checked and
    re-owned relative to that descriptor, never followed: a parent another user can write (a
    `cache_dir` under their home) is refused, so nobody can swap a component for a link between
    our check and our chown and have root hand another directory to the server's user.
    """

    path: Path
    uid: int
    gid: int
    mode: int = 0o700

    def prepare(self) -> None:
        """Create it (and root-owned parents); re-own it if it exists. Refuses a symlink in its place.

        Two servers of one user share a compile cache and are started side by side (threads
        here, or another instance's daemon): without CAP_FOWNER the chown-chmod-chown below
        fails with EPERM if the other one's last chown lands between ours, so it is done under
        a lock and, should another daemon win that race, re-checked: its result is ours."""
        with _PREPARING:
            parent = _open_passable(self.path.parent, self.path)
            try:
                for attempt in range(3):
                    try:
                        self._own(parent, self.path.name)
                        return
                    except PermissionError:
                        if attempt == 2:
                            raise
            finally:
                os.close(parent)

    def _own(self, parent: int, name: str) -> None:
        """Make, check and re-own `name` in the verified directory `parent`, never following a link."""
        try:
            os.mkdir(name, self.mode, dir_fd=parent)
        except FileExistsError:
            pass
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"{self.path} exists and is not a directory")
        ours = (st.st_uid, st.st_gid) == (self.uid, self.gid)
        if ours and stat.S_IMODE(st.st_mode) == self.mode:
            return
        as_root = os.geteuid() == 0
        if as_root and st.st_uid != 0:  # CAP_CHOWN; a mode change of another user's needs CAP_FOWNER
            os.chown(name, 0, 0, dir_fd=parent, follow_symlinks=False)
        os.chmod(name, self.mode, dir_fd=parent, follow_symlinks=False)
        if as_root:
            os.chown(name, self.uid, self.gid, dir_fd=parent, follow_symlinks=False)

    def clear(self) -> list[str]:
        """Remove everything inside (never following links); returns what was removed."""
        if os.geteuid() == 0 and self.uid != 0:
            return _clear_as(self.uid, self.gid, self.path)
        return _clear(self.path)


def _open_passable(parent: Path, wanted: Path) -> int:
    """A verified descriptor of `parent` (config/trust.py), after creating what is missing of it as 0711.

    Its user must pass through them to reach its directory (the unit's UMask=0027 would make
    them 0750, root's alone: the server then had no usable TMPDIR, and emptying it as its user
    could not reach it), and nobody may list them; an existing `parent` of ours that others
    cannot pass is made passable. The nearest existing directory is verified before anything is
    made in it, and each new one is made relative to the one above, never through a link: a
    `cache_dir` under a directory another user can write is refused with nothing made there.
    """
    names = [parent.name]
    here = parent.parent
    while not os.path.lexists(here):
        names.append(here.name)
        here = here.parent
    fd = _open_verified(here, wanted)
    try:
        for i, name in enumerate(reversed(names)):
            made = False
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o711, dir_fd=fd)
                made = True
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) and i == len(names) - 1:
                break  # an existing link (cache_dir -> /srv/cache): the walk below follows it only if root's
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, f"{parent} exists and is not a directory")
            if made:  # the umask took bits away
                os.chmod(name, 0o711, dir_fd=fd, follow_symlinks=False)
            elif i == len(names) - 1 and st.st_uid == os.geteuid() and st.st_mode & 0o011 != 0o011:
                os.chmod(name, stat.S_IMODE(st.st_mode) | 0o011, dir_fd=fd, follow_symlinks=False)
            below = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)
    return _open_verified(parent, wanted)  # the whole walk again, now that every part exists


def _open_verified(directory: Path, wanted: Path) -> int:
    try:
        return open_verified_dir(directory)
    except ConfigError as e:
        why = e.problem.split(";")[0]  # "is writable by non-root users (owner uid U, mode M)"
        raise UntrustedPath(f"refusing to prepare {wanted}: {e.path} {why}; root makes nothing below a directory "
                            "another user can change (put it under one root alone can write)") from None


def _clear(path: Path) -> list[str]:
    """Empty `path` as whoever we are (`shutil.rmtree` works through descriptors and follows no link)."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.path)
        except FileNotFoundError:
            continue
    return removed


#: emptying a directory as its user: find(1) is essential in Debian, so every user can run it
#: wherever our interpreter lives (a venv under /root is out of their reach); -P (the default)
#: follows no link, -xdev stays on the directory's file system, -delete removes depth first
FIND = "/usr/bin/find"


def _clear_as(uid: int, gid: int, path: Path) -> list[str]:
    """Empty another user's directory as that user, in processes of its own: first every
    directory inside made searchable (pre-order, so a `chmod 000` one is opened after), then
    everything removed depth first.

    Raises OSError naming the directory (and find's last line) when it could not."""
    passes = (["-type", "d", "!", "-perm", "-u=rwx", "-exec", "chmod", "u+rwx", "{}", ";"], ["-print0", "-delete"])
    done = None
    for actions in passes:
        try:
            done = subprocess.run([FIND, "-P", str(path), "-xdev", "-mindepth", "1", *actions],
                                  user=uid, group=gid, extra_groups=[], env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
                                  cwd="/", stdin=subprocess.DEVNULL, capture_output=True, timeout=CLEAR_TIMEOUT_S,
                                  check=False)
        except (OSError, subprocess.SubprocessError) as e:
            raise OSError(errno.EIO, f"could not empty {path} as uid {uid}: {e}") from None
    assert done is not None
    last = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
    if done.returncode != 0 and "No such file or directory" not in last:
        raise OSError(errno.EIO, f"could not empty {path} as uid {uid}: {last or f'find exited {done.returncode}'}")
    prefix = str(path).rstrip("/") + "/"
    return [name for name in done.stdout.decode(errors="replace").split("\0")
            if name.startswith(prefix) and "/" not in name[len(prefix):]]


@dataclass
class ShmTracker:
    """The /dev/shm files of one process's cgroup, removed once the cgroup is empty.

    Root removes files whose names the process's user (`uid`) chose, so every step refuses
    what that user could aim elsewhere:

    * only entries directly in /dev/shm: a recorded path is exactly "/dev/shm/NAME", NAME one
      component (no "/", ".", "..", NUL or newline); a maps path is the whole rest of the line,
      so "/tmp/x/dev/shm/victim" or "/dev/shm/L/victim" (L a planted symlink) are never ours;
    * every look-up and the unlink go through a descriptor of /dev/shm itself (opened
      O_NOFOLLOW|O_DIRECTORY, root-owned and sticky or not world-writable), never a path, and
      never follow a symlink: NAME must be a regular file owned by `uid`, the same inode the
      process mapped or held (maps' inode field, fdinfo's "ino:"), held by no live process;
    * multimodal segments `sgl_shm_mm_<pid>_<hex8>`: only for a PID `scan` saw in our cgroup
      (and in our PID namespace, where the number in the name is the same PID), that is not
      alive now (our cgroup is empty, so a live holder of that PID is someone else's), and
      whose ctime is not before that process started (a PID is reused: an older segment is a
      previous holder's). ctime, not mtime: the owner may set mtime to anything.

    Residual race: between the last stat and the unlink the name can be replaced. In a sticky
    /dev/shm only the owner of the entry (our `uid`, which we just checked) or root may unlink
    or rename over it, and the unlink removes one name in /dev/shm, never a file elsewhere nor
    another name of the same file. So the swap can only make us remove a name `uid` put there:
    its own file, or (fs.protected_hardlinks=1) a hard link to a file it may read and write,
    whose other names stay. Another user's file is out of reach, and nothing is followed. A
    process of `uid` that opens a name after the held check loses only that name (its open
    file lives on). And a PID of ours reused by a process of `uid` elsewhere that also died
    before the clean-up can have its `sgl_shm_mm_` segments taken for ours.
    """

    uid: int
    seen: dict[str, Ident] = field(default_factory=dict)  # NAME -> (st_dev, st_ino)
    started: dict[int, float] = field(default_factory=dict)  # pid in our cgroup -> its start (wall clock)
    #: scans come from the event loop and from the /dev/shm watch's thread (ownership/shm_watch)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def scan(self, pids: Iterable[int]) -> None:
        """Record the /dev/shm files these PIDs (our cgroup's) map or hold, and the PIDs themselves."""
        with self.lock:
            self._scan(list(pids))

    def _scan(self, pids: list[int]) -> None:
        for pid in pids:
            if pid not in self.started:
                began = _start_time(pid)
                if began is not None:
                    self.started[pid] = began
        with _ShmDir.open() as shm:
            if shm is None:
                return
            for name, idents in _shm_names_of(shm, pids).items():
                st = shm.own_file(name, self.uid) if name not in self.seen else None
                if st is not None and shm.ident(st) in idents:
                    self.seen[name] = shm.ident(st)

    def remove_leftovers(self) -> list[str]:
        """After the cgroup is empty: remove what is still there, ours, the same file, and held by nobody."""
        with self.lock:
            return self._remove_leftovers()

    def _remove_leftovers(self) -> list[str]:
        seen, started = self.seen, self.started
        self.seen, self.started = {}, {}
        with _ShmDir.open() as shm:
            if shm is None:
                return []
            candidates = {**self._recorded(shm, seen), **self._multimodal(shm, started)}
            if not candidates:
                return []
            held = _held(candidates)
            removed = []
            for name in sorted(candidates):
                if candidates[name] not in held and shm.unlink_if(name, self.uid, candidates[name]):
                    removed.append(f"{SHM_DIR}/{name}")
            return removed

    def _recorded(self, shm: _ShmDir, seen: dict[str, Ident]) -> dict[str, Ident]:
        """The recorded files still there as the same inode and ours."""
        out = {}
        for name, ident in seen.items():
            st = shm.own_file(name, self.uid)
            if st is not None and shm.ident(st) == ident:
                out[name] = ident
        return out

    def _multimodal(self, shm: _ShmDir, started: dict[int, float]) -> dict[str, Ident]:
        """SGLang's create-and-close segments whose creator was a (now dead) process of our cgroup."""
        out: dict[str, Ident] = {}
        if not started:
            return out
        for name in shm.names():
            pid = mm_creator(name)
            if pid is None or pid not in started or _alive(pid):
                continue
            st = shm.own_file(name, self.uid)
            if st is not None and st.st_ctime >= started[pid] - START_SLACK_S:
                out[name] = shm.ident(st)
        return out


class _ShmDir:
    """/dev/shm as a directory descriptor: every look-up is relative to it, none follows a link."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.dev = st.st_dev
        info = read_text(os.getpid(), f"fdinfo/{fd}") or ""
        mnt = [line.split(":", 1)[1] for line in info.splitlines() if line.startswith("mnt_id:")]
        self.mnt_id = int(mnt[0]) if mnt else -1

    @classmethod
    @contextlib.contextmanager
    def open(cls) -> Iterator[_ShmDir | None]:
        """The directory, or None when it is missing, a symlink, or writable by others without the sticky bit."""
        try:
            fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            yield None
            return
        try:
            st = os.fstat(fd)
            safe = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and (st.st_mode & stat.S_ISVTX or not st.st_mode & 0o022)
            yield cls(fd) if safe else None
        finally:
            os.close(fd)

    def ident(self, st: os.stat_result) -> Ident:
        return (st.st_dev, st.st_ino)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError:
            return []

    def own_file(self, name: str, uid: int) -> os.stat_result | None:
        """NAME's stat when it is a regular file (not a symlink) owned by `uid`, else None."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return None
        return st if stat.S_ISREG(st.st_mode) and st.st_uid == uid else None

    def unlink_if(self, name: str, uid: int, ident: Ident) -> bool:
        """Unlink NAME if it is still `ident` and `uid`'s (checked right before: the window is the docstring's race)."""
        st = self.own_file(name, uid)
        if st is None or self.ident(st) != ident:
            return False
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            return False
        return True


def shm_name(path: str) -> str | None:
    """NAME when PATH is exactly "/dev/shm/NAME" with NAME a single component, else None."""
    if not path.startswith(SHM_DIR + "/"):
        return None
    name = path[len(SHM_DIR) + 1 :]
    if name in ("", ".", "..") or "/" in name or "\0" in name or "\n" in name:
        return None
    return name


def mm_creator(name: str) -> int | None:
    """The creator PID of an SGLang multimodal segment named exactly sgl_shm_mm_<pid>_<8 hex>."""
    if not name.startswith(MM_PREFIX):
        return None
    pid, sep, suffix = name[len(MM_PREFIX) :].partition("_")
    if not sep or len(suffix) != MM_SUFFIX_LEN or any(c not in "0123456789abcdef" for c in suffix):
        return None
    if not pid.isascii() or not pid.isdigit() or pid.startswith("0") or len(pid) > 10:
        return None
    return int(pid)


def _start_time(pid: int) -> float | None:
    """When PID's process started (wall clock); None when it is gone or in another PID namespace.

    In another PID namespace the PID SGLang writes into a name is not this one.
    """
    try:
        theirs, ours = os.stat(f"/proc/{pid}/ns/pid"), os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
        return None
    text = read_text(pid, "stat") or ""
    try:
        ticks = int(text[text.rfind(")") + 2 :].split()[19])
    except (IndexError, ValueError):
        return None
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    return read_text(pid, "stat") is not None and not is_zombie(pid)


def _maps_entry(line: str) -> tuple[str, Ident] | None:
    """(path, (st_dev, st_ino)) of the file a /proc/PID/maps line maps; None for anonymous memory.

    The path is the whole rest of the line from the first "/" after the inode field: a name
    may hold spaces or "/dev/shm/" anywhere, so no substring search. A deleted file's path ends
    in " (deleted)"; it is kept as is, and its inode no longer matches any name.
    """
    fields = line.rstrip("\n").split(None, 5)
    if len(fields) < 6 or not fields[5].startswith("/"):
        return None
    try:
        major, minor = (int(x, 16) for x in fields[3].split(":"))
        ino = int(fields[4])
    except ValueError:
        return None
    return (fields[5], (os.makedev(major, minor), ino)) if ino else None


def _mapped(pid: int) -> Iterator[tuple[str, Ident]]:
    try:
        with open(f"/proc/{pid}/maps", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return
    for line in lines:
        entry = _maps_entry(line)
        if entry is not None:
            yield entry


def _shm_names_of(shm: _ShmDir, pids: Iterable[int]) -> dict[str, set[Ident]]:
    """NAME -> the inodes under which these PIDs map "/dev/shm/NAME" or hold it open on our /dev/shm mount."""
    found: dict[str, set[Ident]] = {}
    for pid in pids:
        for path, ident in _mapped(pid):
            name = shm_name(path)
            if name is not None:
                found.setdefault(name, set()).add(ident)
        for target, mnt, ino in open_files(pid, lambda t: shm_name(t) is not None):
            name = shm_name(target)
            if name is not None and mnt == shm.mnt_id:
                found.setdefault(name, set()).add((shm.dev, ino))
    return found


def _held(candidates: dict[str, Ident]) -> set[Ident]:
    """The candidates some live process maps (any path) or holds open (one walk over /proc).

    Open files are matched by name first (reading every fd's fdinfo would be slow), then by
    inode on any mount (a bind of /dev/shm elsewhere is the same file): keeping too much is safe.
    """
    names: Collection[str] = set(candidates)
    inos = {ident[1]: ident for ident in candidates.values()}
    wanted = set(candidates.values())

    def named_like(target: str) -> bool:
        base = target.rsplit("/", 1)[-1]
        return base in names or base.removesuffix(" (deleted)") in names

    held: set[Ident] = set()
    for pid in all_pids():
        held.update(ident for _, ident in _mapped(pid) if ident in wanted)
        held.update(inos[ino] for _, _, ino in open_files(pid, named_like) if ino in inos)
    return held
