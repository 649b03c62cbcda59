"""The files that let this node into etcd: checked as the config is, before they are used.

A root daemon that obeys etcd is only as safe as the credentials etcd checks. So, as sshd's
StrictModes for the config (config/trust.py): each file, and every directory above it, must
belong to root (or the daemon's own user) and be writable by nobody else: whoever could
replace the CA file could make us trust their etcd. The client key and the password file are
secrets too: a local user who could read them could write etcd as this node. So they must be
readable by root alone: not by others, not by a group other than root's (0640 root:users let
every member read the key), and not through a POSIX ACL naming a user or group (a 0600 key
with `setfacl -m u:alice:r` shows as 0640 root:root: the group bits are the ACL's mask).

Refusals are ConfigErrors naming the `[cluster]` key and the file, in one line.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import struct
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
    if secret and (who := _acl_readers(path, where)):
        raise ConfigError(path, where, f"has an ACL letting {who} read it: it lets them write etcd as this node; "
                                       f"setfacl -b {path}")
    if secret and st.st_mode & stat.S_IRGRP and not _trusted_group(st.st_gid):
        raise ConfigError(path, where, f"is readable by group {_group_name(st.st_gid)} (mode "
                                       f"{stat.S_IMODE(st.st_mode):04o}): it lets every member write etcd as this "
                                       f"node; chmod g-rwx {path} (or chgrp root)")
    return path


ACL_XATTR = "system.posix_acl_access"
_ACL_HEADER = struct.Struct("<I")  # the version, 2
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permissions, id (the kernel's posix_acl_xattr_entry)
_ACL_USER, _ACL_GROUP, _ACL_READ = 0x02, 0x08, 0x04


def _acl_readers(path: str, where: str) -> str:
    """Who besides root an access ACL names with read permission ("user 65534 (nobody), ..."),
    or "" (no ACL, or a file system without them). Any named entry with read counts, whatever
    the mask says now: one chmod g+r would make it effective."""
    try:
        raw = os.getxattr(path, ACL_XATTR)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return ""
        raise ConfigError(path, where, f"its ACL cannot be read: {e.strerror}") from None
    readers: list[str] = []
    for offset in range(_ACL_HEADER.size, len(raw) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size):
        tag, perm, ident = _ACL_ENTRY.unpack_from(raw, offset)
        if not perm & _ACL_READ:
            continue
        if tag == _ACL_USER and ident not in (0, os.geteuid()):
            readers.append(f"user {ident} ({_user_name(ident)})")
        elif tag == _ACL_GROUP and not _trusted_group(ident):
            readers.append(f"group {ident} ({_group_name(ident)})")
    return ", ".join(readers)


def _trusted_group(gid: int) -> bool:
    return gid in (0, os.getegid())


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no name"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


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
