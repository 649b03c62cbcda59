"""Each instance's control-plane key for its sglang-router, and how it reaches the router.

Why: without one, sglang-router 0.3.2 lets anyone who reaches its port `POST /workers` (a fake
worker then gets users' prompts and answers them) and `DELETE /workers/{id}` (the real one is
gone) while `/readiness` still says 200. With `--control-plane-api-keys ID:NAME:admin:KEY` the
real router answers the whole worker API (GET/POST/PUT/DELETE /workers and /workers/{id}, and
/get_loads, /flush_cache) 401 with `WWW-Authenticate: Bearer realm="control-plane"` unless the
request carries `Authorization: Bearer KEY` ("Missing or invalid Authorization header" without
it or with another scheme, "Invalid authentication token" for a wrong key); a key of role
`user` gets 403 "Admin role required for control plane access". /health, /liveness,
/readiness, /generate, /v1/*, /get_model_info and /get_server_info stay open. (`--api-key` is a
different thing: it closes /generate to clients too.)

Where the key lives: one file per instance, `<runtime_dir>/<instance>/router.key`, mode 0600,
owned by the daemon's user (root in production), created with O_EXCL|O_NOFOLLOW and re-read
only after fstat says it is still ours and private. The router runs as an unprivileged user and
cannot read it; it gets the key in its environment instead (/proc/PID/environ is readable by
its own user and root only, and by root alone once the shim has made the process non-dumpable),
and never on its command line: sglang-router reads keys only from
its argv, and /proc/PID/cmdline is world-readable (ProtectProc=invisible hides it only inside
the unit's own mount namespace, not from the host). So the router is started through a few
lines of Python (ROUTER_SHIM) that move the key from the environment into the router's own
in-process argv and then run the router's module as __main__.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..errors import SupervisorError

KEY_ENV = "SUPERVISORD_GPU_ROUTER_KEY"
KEY_FILE = "router.key"
KEY_ID = "supervisord-gpu"  # the router logs this id (never the key) for each authenticated call
KEY_BYTES = 32  # secrets.token_urlsafe(32): 43 characters of [A-Za-z0-9_-]
_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

#: Run as `PYTHON -c ROUTER_SHIM MODULE ARGS...`: the key goes from the environment into the
#: router's argv inside its own process (what `ps` shows stays without it), then MODULE runs as
#: `python -m MODULE ARGS...` would. Without the key it refuses to start rather than run open.
ROUTER_SHIM = (
    # first of all: not dumpable, so /proc/PID/environ and /proc/PID/mem, where the key still is,
    # are root's alone; a server of the same user (model code with trust-remote-code) could read
    # them otherwise. What remains is the interpreter's start-up, before this line runs.
    "import ctypes; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "  # prctl(PR_SET_DUMPABLE, 0)
    f"import os, runpy, sys; key = os.environ.pop({KEY_ENV!r}, ''); "
    f"key or sys.exit('supervisord-gpu: no control-plane key in {KEY_ENV}; refusing to start the router open'); "
    "module = sys.argv.pop(1); "
    f"sys.argv += ['--control-plane-api-keys', {KEY_ID + ':' + KEY_ID + ':admin:'!r} + key]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)  # one line: it shows in ps and in the journal's port-holder messages


class RouterKeyError(SupervisorError):
    """The key file is missing, not ours, or readable by others: the router is not started with it."""


def key_path(runtime_dir: Path, instance: str) -> Path:
    """Where an instance's key lives (RuntimeDirectory=supervisord-gpu/%i: gone when the unit stops)."""
    return runtime_dir / instance / KEY_FILE


def shim_argv(program: tuple[str, ...]) -> tuple[str, ...]:
    """`PYTHON ... -m MODULE` -> `PYTHON ... -c ROUTER_SHIM MODULE`; () when the program is not a
    Python module run with -m (the key could then reach it only on its command line)."""
    if len(program) >= 3 and program[-2] == "-m":
        return (*program[:-2], "-c", ROUTER_SHIM, program[-1])
    return ()


def auth_header(key: str) -> dict[str, str]:
    """The header the router's control plane wants: `Bearer` exactly (it refuses `bearer`)."""
    return {"Authorization": f"Bearer {key}"}


def ensure_key(path: Path) -> str:
    """The instance's key, made on first use: a new file is created exclusively (never through a
    link, never over someone's file); an existing one is used only if it passes `_checked`."""
    _private_parent(path.parent)
    key = secrets.token_urlsafe(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_key(path)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, key.encode())
    finally:
        os.close(fd)
    return key


def read_key(path: Path) -> str:
    """The key in `path`, after fstat on the opened file (not the name) says: a regular file of
    ours, one link, no group or other bits, and a key's characters inside."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise RouterKeyError(f"router key {path}: {e.strerror}") from None
    try:
        _checked(os.fstat(fd), path)
        key = os.read(fd, 4096).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if len(key) < 32 or not set(key) <= _ALPHABET:
        raise RouterKeyError(f"router key {path}: not a key this daemon wrote")
    return key


def _checked(st: os.stat_result, path: Path) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise RouterKeyError(f"router key {path}: not a plain file with one link")
    if st.st_uid != os.geteuid():
        raise RouterKeyError(f"router key {path}: owned by uid {st.st_uid}, not by this daemon (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise RouterKeyError(f"router key {path}: mode {stat.S_IMODE(st.st_mode):04o}, readable by others")


def _private_parent(directory: Path) -> None:
    """The instance's runtime directory: created if missing (0755, like RuntimeDirectoryMode=), and
    refused when someone else owns it or may write to it (they could swap the file under us)."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RouterKeyError(f"{directory}: not a directory of this daemon's that only it may write to; "
                             "the router key is not kept there")
