"""A rehearsal from any checkout: the servers' user reaches the code it runs.

Why: the shipped profiles run their servers as ``sglang``, and a rehearsal runs them from the
checkout (``.venv/bin/python3 -m supervisord_gpu.rehearsal.standin_server``). A checkout in
``/root`` (0700) or in a 0700 home cannot be entered by ``sglang``, so the first stand-in died
with ``PermissionError: '/root/supervisord-gpu/.venv/bin/python3'``. The router runs as a user of
its own (``sglang-router``) and runs the checkout's code too: every user a profile names is covered.

What we do instead of asking the operator to move the checkout or to open ``/root``: a
rehearsal run as root enters a mount namespace of its own (nothing outside it sees a change)
and, over each closed ancestor, mounts an empty tmpfs of mode 0711 into which only the paths
the rehearsal needs are moved back, at their own paths. Every path stays what it was (the
venv's scripts, the editable install's finder, the config and runtime directories); the
servers' user can pass through the ancestor but not list it, and sees nothing else of it —
not root's other files, not the other entries of ``/root``. The paths themselves keep their
own modes: a checkout that is itself closed to that user is refused in one line.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import UsageError

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 2, 4, 4096, 8192, 16384, 1 << 18


class Account:
    """Who must reach the paths: a uid and its groups, as the exec gate will set them."""

    def __init__(self, name: str) -> None:
        entry = pwd.getpwnam(name)
        self.name, self.uid = name, entry.pw_uid
        self.gids = frozenset(os.getgrouplist(name, entry.pw_gid))

    def may(self, path: Path, bits: int) -> bool:
        """Whether this account has `bits` (of S_IXOTH, S_IROTH: 1, 4) on path by its mode.
        ACLs are not read: a path an ACL opens is reached anyway, one it closes fails as before."""
        st = path.stat()
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return (st.st_mode >> 6) & bits == bits
        if st.st_gid in self.gids:
            return (st.st_mode >> 3) & bits == bits
        return st.st_mode & bits == bits


def closed_ancestors(path: Path, accounts: Sequence[Account]) -> list[Path]:
    """The ancestors of `path` (not itself) that one of `accounts` cannot pass, outermost first."""
    return [a for a in reversed(path.parents) if any(not acct.may(a, stat.S_IXOTH) for acct in accounts)]


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """Drop each path that lies inside another of them."""
    unique = sorted(set(paths), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in unique:
        if not any(p.is_relative_to(k) for k in kept):
            kept.append(p)
    return kept


def plan(needed: Iterable[Path], users: Iterable[str]) -> dict[Path, list[Path]]:
    """{closed ancestor: the needed paths to move back into it}; empty when all are reachable.

    Raises UsageError when a needed path is itself closed to a user (the tmpfs cannot help:
    the path keeps its own mode)."""
    # a user that does not exist is not ours to name here: the profile's render refuses it,
    # one line naming the key (config/render.py)
    accounts = [Account(u) for u in sorted(set(users)) if u != "root" and _exists(u)]
    if not accounts:
        return {}
    tops: dict[Path, list[Path]] = {}
    # the real path: what a bind mounts (mount(2) follows links), and where its ancestors are
    for p in _outermost(Path(os.path.realpath(n)) for n in needed):
        if not p.is_dir():
            raise UsageError(f"rehearsal: {p} is not a directory")
        for acct in accounts:
            if not acct.may(p, stat.S_IXOTH | stat.S_IROTH):
                raise UsageError(f"rehearsal: {p} is not readable by {acct.name}, who runs a process of the profile; "
                                  f"chmod o+rx {p} (or run the rehearsal from a checkout {acct.name} can read)")
        closed = closed_ancestors(p, accounts)
        if closed:
            tops.setdefault(closed[0], []).append(p)
    for top in list(tops):  # a top inside another top's tmpfs: that one's paths move with it
        outer = next((t for t in tops if t != top and top.is_relative_to(t)), None)
        if outer is not None:
            tops[outer] += tops.pop(top)
    return tops


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _call(what: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"rehearsal: {what}: {os.strerror(err)}")


def make_reachable(needed: Iterable[Path], users: Iterable[str]) -> list[Path]:
    """Enter a private mount namespace in which `users` reach every directory in `needed`; return
    the ancestors covered (none: nothing was done, the namespace is the host's).

    Must run as root before any thread starts: a thread already running keeps the host's
    view (unshare applies to the calling thread), so what it started could not reach."""
    tops = plan(needed, users)
    if not tops:
        return []
    if os.geteuid() != 0:
        some = next(iter(tops.values()))[0]
        raise UsageError(f"rehearsal: {some} lies under {next(iter(tops))}, which the servers' user cannot enter; "
                          "run the rehearsal as root (it then makes the path reachable in its own mount namespace)")
    if len(os.listdir("/proc/self/task")) != 1:  # every thread, not only Python's
        raise UsageError("rehearsal: cannot enter a mount namespace of its own once threads run (a bug: say so)")
    base = "/run" if os.path.isdir("/run") else tempfile.gettempdir()
    if any(Path(base).is_relative_to(top) for top in tops):
        raise UsageError(f"rehearsal: {base} itself is closed to the servers' user; nothing to stand on")
    libc = _libc()
    _call("unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
    _call("make / private", libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None))
    cwd = os.getcwd()
    stash = Path(tempfile.mkdtemp(prefix="supervisord-gpu-reach-", dir=base))
    try:
        for top, paths in sorted(tops.items()):
            _cover(libc, stash, top, paths)
    finally:  # on the host's filesystem: never left behind, even when a mount failed
        for leftover in sorted(stash.iterdir(), reverse=True):
            libc.umount2(bytes(leftover), 2)  # MNT_DETACH: only this namespace has it
            leftover.rmdir()
        stash.rmdir()
    try:
        os.chdir(cwd)  # the namespace's view of where we were
    except OSError:
        os.chdir("/")
    return sorted(tops)


def _cover(libc: ctypes.CDLL, stash: Path, top: Path, paths: list[Path]) -> None:
    """Each of `paths` held aside on a bind of its own, `top` covered by an empty tmpfs that
    anyone may pass but not list, and each path moved back to where it was."""
    held = []
    for i, p in enumerate(paths):
        aside = stash / str(i)
        aside.mkdir()
        _call(f"bind {p}", libc.mount(bytes(p), bytes(aside), None, MS_BIND | MS_REC, None))
        held.append((aside, p))
    _call(f"tmpfs over {top}", libc.mount(b"tmpfs", bytes(top), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0711,size=1m"))
    for aside, p in held:
        for d in reversed(p.relative_to(top).parents[:-1] if p != top else []):
            _mkdir_0711(top / d)  # the empty dirs on the way: passable, not listable, whatever the umask
        _mkdir_0711(p)  # the mount point
        _call(f"move {p} back", libc.mount(bytes(aside), bytes(p), None, MS_MOVE, None))
        aside.rmdir()


def _mkdir_0711(d: Path) -> None:
    if not d.exists():
        d.mkdir()
        os.chmod(d, 0o711)


def main(argv: Sequence[str]) -> int:
    """python -m supervisord_gpu.rehearsal.reach USER[,USER...] DIR... -- COMMAND [ARG...]

    COMMAND run where each USER reaches each DIR (the test suite from a checkout in /root:
    its tests run servers and attackers as nobody from this checkout's .venv)."""
    import sys

    if "--" not in argv or argv.index("--") < 2 or argv.index("--") == len(argv) - 1:
        print("usage: python -m supervisord_gpu.rehearsal.reach USER[,USER...] DIR... -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    users = [u for u in argv[0].split(",") if u]
    command = list(argv[split + 1:])
    if shutil.which(command[0]) is None:
        print(f"reach: {command[0]}: command not found", file=sys.stderr)
        return 2
    if os.geteuid() != 0:  # only root can: anyone else runs COMMAND as it is (their tests skip the rest)
        os.execvp(command[0], command)
    known = [u for u in users if _exists(u)]
    if len(known) < len(users):
        print(f"reach: no such user: {', '.join(u for u in users if u not in known)} (skipped)", file=sys.stderr)
    try:
        covered = make_reachable([Path(d) for d in argv[1:split]], known)
    except (UsageError, OSError) as e:
        print(f"reach: {e}", file=sys.stderr)
        return 2
    if covered:
        print(f"reach: {', '.join(map(str, covered))} passed through for {', '.join(known)} in a mount namespace of its own",
              file=sys.stderr)
    os.execvp(command[0], command)
    return 127  # not reached


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
