"""What a root daemon may believe on disk: files and directories only root can have written.

The root daemon reads commands it will run (supervisord-gpu.toml names them), profiles
(environment, users), records of other instances (whose PIDs it signals) and locks. Anything
a local user can write or swap is an order from that user: a world-writable config directory,
a symlink planted where a lock or a record will be created. So, like sshd's StrictModes:

* `check_modes`: a file and every directory above it must belong to root (or the daemon's
  own user) and not be writable by group or others; checked before it is read;
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

    Directories are checked up to `stop_at` (inclusive) or the root. A sticky, world-writable
    directory such as /tmp is refused too: anyone may create the file we would read.
    Only applies when the daemon runs as root.
    """
    if os.geteuid() != 0:
        return
    targets = [path, *path.absolute().parents]
    if stop_at is not None:
        stop = stop_at.absolute()
        targets = [t for t in targets if t == path or t == stop or stop in t.parents]
    for target in targets:
        try:
            st = os.lstat(target)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            try:
                st = os.stat(target)
            except OSError:
                continue
        if target != path and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            continue  # /tmp: others may add entries, but not replace or rename root's
        if not _trusted_owner(st.st_uid) or st.st_mode & WRITE_BITS:
            raise ConfigError(
                target, "",
                f"is writable by non-root users (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
                f"refusing to run it as root: chown root {target} && chmod go-w {target}",
            )


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
