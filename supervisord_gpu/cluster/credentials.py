"""The files that let this node into etcd: checked as the config is, before they are used.

A root daemon that obeys etcd is only as safe as the credentials etcd checks. So, as sshd's
StrictModes for the config (config/trust.py): each file, and every directory above it, must
belong to root (or the daemon's own user) and be writable by nobody else: whoever could
replace the CA file could make us trust their etcd. The client key and the password file are
secrets too: they must not be readable by others (mode 0600 or 0640 root:GROUP); a local user
who could read them could write etcd as this node.

Refusals are ConfigErrors naming the `[cluster]` key and the file, in one line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..config import trust
from ..errors import ConfigError

MAX_PASSWORD_BYTES = 4096


def checked(path: str, key: str, secret: bool) -> str:
    """`path` if it is a regular file only root can have written (and, for a `secret`, that
    others cannot read); else a ConfigError naming the `[cluster]` key."""
    where = f"cluster.{key}"
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(path, where, f"cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(path, where, "is not a regular file")
    if os.geteuid() == 0:
        try:
            _strict_modes(Path(path))
        except ConfigError as e:
            raise ConfigError(e.path, where, e.problem) from None
    if secret and st.st_mode & stat.S_IROTH:
        raise ConfigError(path, where, f"is readable by every user (mode {stat.S_IMODE(st.st_mode):04o}): "
                                       f"it lets whoever reads it write etcd as this node; chmod o-rwx {path}")
    return path


def _strict_modes(path: Path) -> None:
    """config/trust.py's walk over the file and every directory above it (read_verified, by
    descriptor, where this tree has it; the path-based check_modes before it)."""
    verify = getattr(trust, "read_verified", None)
    if verify is not None:
        verify(path)
    else:
        trust.check_modes(path)


def read_password(path: str) -> str:
    """The etcd password: the file's first line (a trailing newline is not part of it)."""
    checked(path, "password_file", secret=True)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PASSWORD_BYTES + 1)
    except OSError as e:
        raise ConfigError(path, "cluster.password_file", f"cannot be read: {e.strerror}") from None
    if len(raw) > MAX_PASSWORD_BYTES:
        raise ConfigError(path, "cluster.password_file", f"is longer than {MAX_PASSWORD_BYTES} bytes")
    text = raw.decode(errors="replace").split("\n", 1)[0].rstrip("\r")
    if not text:
        raise ConfigError(path, "cluster.password_file", "is empty")
    return text
