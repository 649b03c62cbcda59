"""What a root daemon may believe on disk: files and directories only root can have written.

The root daemon reads commands it will run (supervisord-gpu.toml names them), profiles
(environment, users), records of other instances (whose PIDs it signals) and locks. Anything
a local user can write or swap is an order from that user: a world-writable config directory,
a symlink planted where a lock or a record will be created. So, like sshd's StrictModes:

* `read_verified`: a file and every directory above it must belong to root (or the daemon's
  own user) and not be writable by group or others, checked on the descriptors that the read
  then uses (never stat-then-open by name: a swapped symlink would win that race);
  `check_modes` is the same walk for a directory;
* `secure_directory`: a directory the daemon writes (the runtime directory) is created root-
  owned 0755, or verified to be so, and never followed through a symlink;
* `open_nofollow`: files in it are opened without following a final symlink.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import ConfigError, PreconditionError

WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def check_modes(path: Path, stop_at: Path | None = None) -> None:
    """Refuse `path` if it, or a directory above it, could have been written by another user.

    The same walk as `read_verified` (by descriptor, see `_Walk`), for a directory whose
    contents are read later by name: the config directory. `stop_at` is accepted for the
    callers of the old path-based check and ignored: every directory up to / counts, since
    whoever can write any of them can swap everything below. Only applies as root.
    """
    if os.geteuid() != 0:
        return
    try:
        fd, _shown = _Walk().open(Path(path), want_dir=True)
    except (FileNotFoundError, NotADirectoryError):
        return  # the caller says "does not exist" / "is not a directory" in its own words
    os.close(fd)


def open_verified_dir(path: Path) -> int:
    """An O_PATH descriptor of the directory `path`, for *at() calls relative to it.

    As root, the same walk as `check_modes`: it and every directory above it are root's (or
    ours) and writable by nobody else, checked on the descriptors the walk opens, so no entry
    in it can be swapped by another user after it is returned. Not root: a plain open (nothing
    runs as root on it). Raises ConfigError naming the untrusted component, OSError otherwise.
    """
    if os.geteuid() != 0:
        return os.open(path, _DIR_FLAGS)
    return _Walk().open(Path(path), want_dir=True)[0]


def read_verified(path: Path) -> bytes:
    """The content of `path`, read from the very descriptor whose owner and mode were checked.

    As root, every directory from / down and the file itself must pass `_check` (StrictModes);
    the file is opened by descriptor, one component at a time relative to its verified parent,
    so nothing can be swapped between the check and the read (a path-based stat-then-open let
    a user who could write any directory on a symlink's way substitute their own profile).
    A symlink is followed only if it is itself root's, in a verified directory, and its target
    passes the same walk; otherwise it is refused. Not root: a plain read (nothing runs as
    root on what we read). Raises ConfigError for an untrusted component, OSError otherwise
    (IsADirectoryError, FileNotFoundError, ...), each naming the path.
    """
    if os.geteuid() != 0:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    else:
        fd, _shown = _Walk().open(Path(path), want_dir=False)
    try:
        return _read_all(fd)
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


#: how many symlinks one walk follows before it gives up, as the kernel's path walk (ELOOP)
MAX_SYMLINKS = 40
_DIR_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _untrusted(shown: str, st: os.stat_result) -> ConfigError:
    return ConfigError(
        Path(shown), "",
        f"is writable by non-root users (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
        f"refusing to run it as root: chown root {shown} && chmod go-w {shown}",
    )


def _check(shown: str, st: os.stat_result, last: bool) -> None:
    """StrictModes for one component: root's (or ours), not writable by group or others.

    A directory on the way (not the last component) may be world-writable if it is sticky
    and root's, as /tmp: others may add entries there but not rename or remove root's, and
    every entry we go through is checked in turn. The component asked for never may.
    """
    if not _trusted_owner(st.st_uid):
        raise _untrusted(shown, st)
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & WRITE_BITS and (last or not sticky_dir):
        raise _untrusted(shown, st)


class _Walk:
    """Open a path the way the kernel walks it, checking each component by its descriptor.

    Each directory is opened O_PATH|O_NOFOLLOW|O_DIRECTORY relative to its parent's
    descriptor and fstat'ed: what is checked is what the next step opens from, so renaming
    or replacing a directory on the way after its check changes nothing for us. `..` goes
    back to the verified parent (never a lookup); a symlink restarts the walk at its target.
    """

    def __init__(self) -> None:
        self.stack: list[tuple[int, str]] = []
        self.links = 0

    def open(self, path: Path, want_dir: bool) -> tuple[int, str]:
        """(descriptor, path as walked): O_PATH for a directory, O_RDONLY for a file."""
        try:
            self._push_root()
            pending = list(reversed(_components(str(path.absolute()))))
            while pending:
                name = pending.pop()
                fd = self._step(name, pending, want_dir)
                if fd is not None:
                    return fd, self._shown(name)
            fd, shown = self.stack.pop()
            return fd, shown
        finally:
            for fd, _ in self.stack:
                os.close(fd)
            self.stack = []

    def _push_root(self) -> None:
        fd = os.open("/", _DIR_FLAGS)
        self.stack.append((fd, "/"))
        _check("/", os.fstat(fd), last=False)

    def _shown(self, name: str) -> str:
        parent = self.stack[-1][1]
        return parent.rstrip("/") + "/" + name

    def _step(self, name: str, pending: list[str], want_dir: bool) -> int | None:
        """Go through one component; return the file's descriptor when it was the last one."""
        if name == "..":
            if len(self.stack) > 1:
                os.close(self.stack.pop()[0])
            return None
        parent_fd = self.stack[-1][0]
        shown = self._shown(name)
        last = not pending
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            self._follow(name, shown, st, pending)
            return None
        if last and not want_dir:
            return self._open_file(name, shown)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, shown) from None
        self.stack.append((fd, shown))
        _check(shown, os.fstat(fd), last)
        return None

    def _follow(self, name: str, shown: str, st: os.stat_result, pending: list[str]) -> None:
        """A symlink counts only if root made it (its directory was verified already; a
        link's own mode is always 0777 and means nothing)."""
        if not _trusted_owner(st.st_uid):
            raise _untrusted(shown, st)
        self.links += 1
        if self.links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), shown)
        target = os.readlink(name, dir_fd=self.stack[-1][0])
        if target.startswith("/"):
            while len(self.stack) > 1:
                os.close(self.stack.pop()[0])
        pending.extend(reversed(_components(target)))

    def _open_file(self, name: str, shown: str) -> int:
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.stack[-1][0])
        except OSError as e:
            raise OSError(e.errno, e.strerror, shown) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", shown)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(Path(shown), "", "is not a regular file")
            _check(shown, st, last=True)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _components(path: str) -> list[str]:
    return [c for c in path.split("/") if c not in ("", ".")]


def secure_directory(path: Path, mode: int = 0o755) -> Path:
    """Create `path` (and missing parents) root-owned `mode`, or verify an existing one is.

    A symlink, a directory owned by another user, or one writable by group or others is
    refused with an OSError naming it: nothing the daemon writes there would be its own.
    """
    path = Path(path)
    if not path.parent.exists():
        secure_directory(path.parent, 0o755)
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode, follow_symlinks=False)  # the umask may have taken bits away
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(f"refusing to use {path}: it is not a directory (a symlink or a file is in its place)")
    if not _trusted_owner(st.st_uid) or st.st_mode & WRITE_BITS:
        raise UntrustedPath(f"refusing to use {path}: it is owned by uid {st.st_uid} with mode "
                            f"{stat.S_IMODE(st.st_mode):04o}; it must belong to root and be writable only by it "
                            f"(chown root {path}; chmod 0755 {path})")
    return path


class UntrustedPath(PreconditionError, OSError):
    """A path the daemon would write or believe is not root's alone: nothing is touched (exit 3)."""


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open that refuses a symlink at `path` (ELOOP) and never blocks on a FIFO planted there."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)


def read_trusted(path: Path, limit: int = 1 << 20) -> bytes:
    """The content of a regular file owned by root (or us) and writable only by its owner."""
    fd = open_nofollow(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if not _trusted_owner(st.st_uid) or st.st_mode & WRITE_BITS:
            raise OSError(errno.EPERM, f"{path} could have been written by uid {st.st_uid}")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def untrusted_program(path: str) -> str:
    """Why root must not run the program at `path` (found on PATH: cuda-checkpoint, py-spy), or "".

    As root, the same walk as `read_verified`: the file and every directory above it root's (or
    ours) and writable by nobody else, so a PATH that names a directory a user can write (their
    venv, a build tree, /tmp) never makes root run that user's file. Not root: "" (nothing runs
    as root)."""
    if os.geteuid() != 0:
        return ""
    try:
        fd, _shown = _Walk().open(Path(path), want_dir=False)
    except ConfigError as e:
        return str(e)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    os.close(fd)
    return ""
