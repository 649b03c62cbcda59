"""Boot a real systemd 252 (Debian 12 "bookworm") in a systemd-nspawn container, for tests.

Host set-up is the caller's job (the Makefile's ``test-setup`` / ``.ci/run`` do it); a fresh
machine needs, as root::

    apt-get update && apt-get install -y systemd-container debootstrap

This module checks for those tools (and for root) with :func:`missing_tools`;
:func:`require_rig` turns a missing piece into a pytest skip with the reason, except under
CI (``CI=true``), where it fails loudly instead.

Root filesystem
    Built once with ``debootstrap --variant=minbase --include=<BASE_PACKAGES> bookworm``
    from the Debian mirror this machine's apt sources already use (``/etc/apt/sources.list``,
    ``/etc/apt/sources.list.d/*.list`` and ``*.sources``; override with
    ``SUPERVISORD_GPU_TEST_MIRROR``), into ``$SUPERVISORD_GPU_TEST_CACHE/rootfs-<key>``
    (default cache ``/var/cache/supervisord-gpu-tests``). ``<key>`` hashes the suite, the
    package lists (base and extra) and :data:`RECIPE_VERSION`. The tree is built in a
    ``.tmp-*`` directory and renamed into place, under a file lock, so a crash never leaves a
    half-built rootfs that looks finished. It has an unprivileged user ``alice`` (uid 1500)
    and apt sources pointing at the same mirror. Extra packages give a second tree, copied
    from the base one and completed with ``apt-get install`` in ``systemd-nspawn --pipe``
    (seconds, once per distinct list).

Boot
    ``systemd-nspawn -b --volatile=overlay`` with ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1`` (a
    pure cgroup2 tree inside), ``--register=no --keep-unit`` (no systemd on the host), the
    console in a log file. Every boot starts from the clean tree; writes go to a tmpfs and
    vanish at stop. Several containers may run from one tree at once. The container has a
    network of its own, loopback only (``--private-network``), so containers booted at once
    by parallel tests each have their own ports; ``host_network=True`` shares the host's
    (to reach the container's ports from the host, or the Debian mirror from inside), and
    ``network_namespace`` joins one made by tests/rig/network.py.

Commands inside go through ``nsenter -t <container PID 1> -a``; host-side D-Bus clients can
use :attr:`SystemdContainer.bus_address`. A container is always stopped: by ``stop()``, the
context manager, an ``atexit`` hook, and - if the test process dies hard - by
``PR_SET_PDEATHSIG`` (SIGTERM) on the nspawn process, which halts the container cleanly.

API (all of it typed; see the docstrings)::

    SystemdContainer(*, binds=(), extra_packages=(), rootfs=None, name=None, boot_timeout=60.0,
                     network_namespace=None, host_network=False)
        .boot() -> self / .stop(timeout=10.0) / with SystemdContainer(...) as c: ...
        .run(argv, check=True, timeout=60.0, input=None, user=None, env=None, cwd=None)
            -> subprocess.CompletedProcess[str]        (ContainerCommandError if check fails)
        .systemctl(*args, check=True, timeout=60.0) / .daemon_reload() / .is_active(unit)
        .journal(unit_glob, *extra) -> str             (journalctl -b -u GLOB EXTRA...)
        .write_file(ctr_path, text|bytes, mode=0o644, owner=None) / .install_file(src, dst)
        .read_file(ctr_path) / .host_path(ctr_path)
        .processes(cgroup_prefix=None) -> list[ContainerProcess]   (pid, ppid, uid, comm,
            cmdline, cgroup as seen inside; "/.." for commands entered with run())
        .unit_cgroup(unit) -> "/sys/fs/cgroup/system.slice/UNIT" / .failed_units()
        .leader_pid / .nspawn_pid / .bus_address / .state / .boot_seconds / .stop_seconds
    Bind(host, container=None, readonly=True); repo_binds(): the repo read-only at its path
    ensure_rootfs(extra_packages=()) -> Path; rootfs_path(); missing_tools(); require_rig()

Each container gets a cgroup of its own under the host's cgroup2 mount
(``supervisord-gpu-rig/ctr-PID-NAME``): systemd-nspawn puts the container's tree in ``payload``
under its own cgroup, so two containers started from one cgroup would share one tree and
see each other's units. Stopping kills whatever is left in that cgroup and removes it.

Usage as a script (pre-build the rootfs, or smoke-test a boot)::

    python tests/rig/systemd_container.py build [EXTRA_PACKAGE ...]
    python tests/rig/systemd_container.py boot
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SUITE = "bookworm"
VARIANT = "minbase"
BASE_PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-gi",
    "python3-pydbus",
    "python3-psutil",
    "python3-sdnotify",
    "python3-tomli",
    "procps",
    "curl",
    "iproute2",
)
# Bump when the steps that shape the tree change (user, config files...): it changes the key.
RECIPE_VERSION = 1

TEST_USER = "alice"
TEST_UID = 1500

DEFAULT_CACHE = "/var/cache/supervisord-gpu-tests"
CACHE_ENV = "SUPERVISORD_GPU_TEST_CACHE"
MIRROR_ENV = "SUPERVISORD_GPU_TEST_MIRROR"
KEEP_LOGS_ENV = "SUPERVISORD_GPU_TEST_KEEP_LOGS"
RIG_CGROUP = "supervisord-gpu-rig"  # under the host's cgroup2 mount: one child per container

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED_TOOLS = ("systemd-nspawn", "debootstrap", "nsenter", "setpriv")

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}


class RigUnavailable(RuntimeError):
    """The host lacks what the rig needs (tools, root, an apt mirror)."""


class ContainerError(RuntimeError):
    """The container failed to boot, or died."""


class ContainerCommandError(subprocess.CalledProcessError):
    """A command inside the container exited non-zero; str() shows its output."""

    def __str__(self) -> str:
        text = super().__str__()
        for name, data in (("stdout", self.stdout), ("stderr", self.stderr)):
            if data:
                text += f"\n--- {name} ---\n{_tail(data, 40)}"
        return text


@dataclass(frozen=True)
class Bind:
    """A host path mounted into the container (at the same path when ``container`` is None)."""

    host: str
    container: str | None = None
    readonly: bool = True

    def nspawn_arg(self) -> str:
        ctr = self.container or self.host
        for p in (self.host, ctr):
            if ":" in p or not os.path.isabs(p):
                raise ValueError(f"bind paths must be absolute and without ':': {p!r}")
        return f"--bind-ro={self.host}:{ctr}" if self.readonly else f"--bind={self.host}:{ctr}"


BindSpec = Bind | tuple[str, str] | tuple[str, str, bool]


@dataclass(frozen=True)
class ContainerProcess:
    """One process seen inside the container (pids are the container's own)."""

    pid: int
    ppid: int
    uid: int
    comm: str
    cmdline: tuple[str, ...]
    cgroup: str  # cgroup2 path as seen inside, e.g. /system.slice/foo.service


# --------------------------------------------------------------------------- host checks


CAP_NET_ADMIN = 12


def _has_capability(cap: int) -> bool:
    """Whether this process has `cap` in its effective set (/proc/self/status, CapEff)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def missing_tools() -> list[str]:
    """What the host lacks for the rig; empty when all is there."""
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root")
    absent = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if absent:
        problems.append(
            f"missing {', '.join(absent)} (run: apt-get install -y systemd-container debootstrap)"
        )
    if os.geteuid() == 0 and cgroup2_mount() is None:
        problems.append("no writable cgroup2 mount (the container's systemd needs one)")
    if os.geteuid() == 0 and not _has_capability(CAP_NET_ADMIN):
        problems.append("root here lacks CAP_NET_ADMIN (a container's own loopback would stay down, and "
                        "nothing in it could reach 127.0.0.1); run where root has every capability")
    return problems


def require_rig() -> None:
    """Skip the calling test if the host cannot run the rig; under CI=true fail instead."""
    import pytest

    problems = missing_tools()
    if not problems:
        return
    reason = "systemd container rig unavailable: " + "; ".join(problems)
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " (CI=true: the CI set-up must provide these)", pytrace=False)
    pytest.skip(reason)


# --------------------------------------------------------------------------- apt mirror


def _one_line_sources(text: str) -> Iterator[tuple[list[str], str, list[str], list[str]]]:
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        line = re.sub(r"\[[^\]]*\]", " ", line)  # drop [arch=... signed-by=...]
        parts = line.split()
        if len(parts) >= 3:
            yield [parts[0]], parts[1], [parts[2]], parts[3:]


def _deb822_sources(text: str) -> Iterator[tuple[list[str], str, list[str], list[str]]]:
    paragraphs: list[dict[str, str]] = [{}]
    key = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if paragraphs[-1]:
                paragraphs.append({})
            key = None
            continue
        if raw[0] in " \t" and key is not None:
            paragraphs[-1][key] += " " + raw.strip()
            continue
        if ":" in raw:
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            paragraphs[-1][key] = value.strip()
    for p in paragraphs:
        if p.get("enabled", "yes").lower() == "no":
            continue
        for uri in p.get("uris", "").split():
            yield p.get("types", "").split(), uri, p.get("suites", "").split(), p.get(
                "components", ""
            ).split()


def debian_mirror(suite: str = SUITE, root: str = "/") -> str:
    """The URI of the Debian archive that this machine's apt sources use for ``suite`` main."""
    if os.environ.get(MIRROR_ENV):
        return os.environ[MIRROR_ENV]
    apt = Path(root, "etc/apt")
    files = [apt / "sources.list"]
    d = apt / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.suffix in (".list", ".sources"))
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        entries = _deb822_sources(text) if f.suffix == ".sources" else _one_line_sources(text)
        for types, uri, suites, comps in entries:
            if "deb" in types and suite in suites and "main" in comps:
                if uri.split(":", 1)[0] in ("http", "https", "file"):
                    return uri.rstrip("/")
    raise RigUnavailable(
        f"no 'deb URI {suite} main' entry in {apt}/sources.list or sources.list.d/ "
        f"(set {MIRROR_ENV} to choose a mirror)"
    )


# --------------------------------------------------------------------------- rootfs cache


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _normalize_extras(extra_packages: Iterable[str]) -> list[str]:
    return sorted(set(extra_packages) - set(BASE_PACKAGES))


def rootfs_key(extra_packages: Iterable[str] = ()) -> str:
    spec = {
        "suite": SUITE,
        "variant": VARIANT,
        "packages": sorted(BASE_PACKAGES),
        "extra": _normalize_extras(extra_packages),
        "recipe": RECIPE_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def rootfs_path(extra_packages: Iterable[str] = ()) -> Path:
    return cache_dir() / f"rootfs-{rootfs_key(extra_packages)}"


def _log(msg: str) -> None:
    print(f"[systemd-rig] {msg}", file=sys.stderr, flush=True)


def _tail(text: str | bytes, n: int) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.splitlines()[-n:])


def _unescape_mount(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _remove_tree(path: Path) -> None:
    """Remove a (possibly half-built) tree: unmount anything left mounted under it first."""
    if not path.exists():
        return
    prefix = str(path.resolve())
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = _unescape_mount(line.split()[4])
            if mp == prefix or mp.startswith(prefix + "/"):
                mounts.append(mp)
    for mp in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], check=False)
    subprocess.run(["rm", "-rf", "--one-file-system", prefix], check=True)


def _joining_preexec(cgroup: Path | None) -> Callable[[], None]:
    """For Popen: the child dies with us (PR_SET_PDEATHSIG, SIGTERM) and joins ``cgroup``."""

    def preexec() -> None:  # runs in the child between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if cgroup is not None:
            os.makedirs(cgroup, exist_ok=True)  # a concurrent sweep may have removed it
            with open(cgroup / "cgroup.procs", "w") as f:
                f.write("0\n")

    return preexec


def _rig_cgroup(name: str) -> Path | None:
    mount = cgroup2_mount()
    return None if mount is None else mount / RIG_CGROUP / name


def _build_step(cmd: list[str], log: Path, cgroup: Path | None, what: str) -> None:
    """One build command, output to ``log``, in the build's cgroup (so a later build can
    kill what a crashed one left running before it removes its half-built tree)."""
    with open(log, "ab") as out:
        r = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **_NSPAWN_ENV, "DEBIAN_FRONTEND": "noninteractive"},
            preexec_fn=_joining_preexec(cgroup),
        )  # fmt: skip
    if r.returncode != 0:
        raise ContainerError(f"{what} exited {r.returncode}; log {log}:\n{_tail(log.read_bytes(), 30)}")


def _nspawn_pipe(rootfs: Path, script: str, log: Path, cgroup: Path | None) -> None:
    """Run a shell script in the (not booted) tree with systemd-nspawn --pipe."""
    cmd = [
        "systemd-nspawn", "-q", "-D", str(rootfs), "-M", f"rigbuild-{uuid.uuid4().hex[:8]}",
        "--register=no", "--keep-unit", "--pipe",
        "sh", "-c", script,
    ]  # fmt: skip
    _build_step(cmd, log, cgroup, f"in {rootfs}: `{script}`")


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_builds(cache: Path, key: str) -> None:
    """Under the key's lock, any .tmp-rootfs-KEY-PID is from a build that died."""
    for stale in sorted(cache.glob(f".tmp-rootfs-{key}-*")):
        pid = stale.name.removeprefix(f".tmp-rootfs-{key}-").removesuffix(".log")
        cg = _rig_cgroup(f"build-{key}-{pid}")
        if cg is not None:
            _remove_cgroup(cg, kill=True)  # its debootstrap / nspawn, if still running
        _log(f"removing {stale} (left by a build that died)")
        if stale.is_dir():
            _remove_tree(stale)
        else:
            stale.unlink(missing_ok=True)
    for lck in cache.glob(f".#.tmp-rootfs-{key}-*.lck"):  # systemd-nspawn's image locks
        lck.unlink(missing_ok=True)


def ensure_rootfs(extra_packages: Iterable[str] = ()) -> Path:
    """The cached root filesystem for BASE_PACKAGES + ``extra_packages``; built if absent.

    Safe against concurrent callers (file lock per key) and crashes (built under a
    temporary name, renamed when complete; a later call removes what a dead build left).
    """
    extras = _normalize_extras(extra_packages)
    key = rootfs_key(extras)
    cache = cache_dir()
    final = cache / f"rootfs-{key}"
    if final.is_dir():
        return final
    problems = missing_tools()
    if problems:
        raise RigUnavailable("; ".join(problems))
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".rootfs-{key}.lock"):
        if final.is_dir():  # someone else built it while we waited
            return final
        _remove_stale_builds(cache, key)
        tmp = cache / f".tmp-rootfs-{key}-{os.getpid()}"
        log = cache / f".tmp-rootfs-{key}-{os.getpid()}.log"
        cg = _rig_cgroup(f"build-{key}-{os.getpid()}")
        t0 = time.monotonic()
        try:
            mirror = debian_mirror()
            if extras:
                base = ensure_rootfs(())
                _log(f"building {final.name}: {base.name} + {' '.join(extras)}")
                _build_step(["cp", "-a", "--reflink=auto", str(base), str(tmp)], log, cg, "cp")
                _nspawn_pipe(
                    tmp,
                    "set -e; apt-get update -q; "
                    f"apt-get install -y -q --no-install-recommends {' '.join(extras)}; "
                    "apt-get clean",
                    log,
                    cg,
                )
            else:
                _log(f"building {final.name} with debootstrap from {mirror} (about a minute)")
                cmd = [
                    "debootstrap", f"--variant={VARIANT}", f"--include={','.join(BASE_PACKAGES)}",
                    SUITE, str(tmp), mirror,
                ]  # fmt: skip
                _build_step(cmd, log, cg, "debootstrap")
                _nspawn_pipe(
                    tmp,
                    "set -e; "
                    f"useradd --uid {TEST_UID} --user-group --create-home --shell /bin/bash {TEST_USER}; "
                    "apt-get clean",
                    log,
                    cg,
                )
            record = {
                "key": key,
                "suite": SUITE,
                "mirror": mirror,
                "packages": list(BASE_PACKAGES),
                "extra_packages": extras,
                "recipe": RECIPE_VERSION,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "build_seconds": round(time.monotonic() - t0, 1),
            }
            meta = tmp / "var/lib/supervisord-gpu-rig"
            meta.mkdir(parents=True, exist_ok=True)
            (meta / "rootfs.json").write_text(json.dumps(record, indent=2) + "\n")
            os.rename(tmp, final)
            log.unlink(missing_ok=True)
            _log(f"built {final} in {time.monotonic() - t0:.1f} s")
        except BaseException:
            if cg is not None:
                _remove_cgroup(cg, kill=True)
            _remove_tree(tmp)
            raise
        finally:
            if cg is not None:
                _remove_cgroup(cg, kill=True)
    return final


# --------------------------------------------------------------------------- containers

_LIVE: set[SystemdContainer] = set()


@atexit.register
def _stop_all() -> None:
    for c in list(_LIVE):
        with contextlib.suppress(Exception):
            c.stop()


def cgroup2_mount() -> Path | None:
    """Where the host's cgroup2 hierarchy is mounted (/sys/fs/cgroup/unified on a hybrid host)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                found.append(Path(_unescape_mount(left.split()[4])))
    for p in found:
        if os.access(p, os.W_OK):
            return p
    return None


def _cgroup_procs(cg: Path) -> list[int]:
    pids: list[int] = []
    for dirpath, _dirs, files in os.walk(cg):
        if "cgroup.procs" in files:
            pids += [int(x) for x in (_read(os.path.join(dirpath, "cgroup.procs")) or "").split()]
    return pids


def _remove_cgroup(cg: Path, kill: bool) -> bool:
    """rmdir a cgroup subtree bottom-up; with ``kill`` first kill what is left in it."""
    if not cg.is_dir():
        return True
    if kill and _cgroup_procs(cg):
        with contextlib.suppress(OSError):
            (cg / "cgroup.kill").write_text("1\n")
        deadline = time.monotonic() + 5
        while _cgroup_procs(cg) and time.monotonic() < deadline:
            time.sleep(0.01)
    ok = True
    for dirpath, _dirs, _files in sorted(os.walk(cg), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            ok = False
    return ok


def _sweep_rig_cgroups(top: Path) -> None:
    """Remove empty cgroups left by containers of a test process that died hard.

    Each is named ctr-<creator pid>-<container>: one whose creator lives may be empty only
    because its container is being started (mkdir, then nspawn joins it), so a sweep by a
    parallel test worker must leave it alone."""
    if top.is_dir():
        for cg in top.glob("ctr-*"):
            creator = cg.name.split("-")[1]
            if creator.isdigit() and _alive(int(creator)):
                continue
            if cg.is_dir() and not _cgroup_procs(cg):
                _remove_cgroup(cg, kill=False)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
    return kids


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for the host's init to reap it is not)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


_PS_SCRIPT = r"""
import json, os
me = os.getpid()
out = []
for d in os.listdir("/proc"):
    if not d.isdigit() or int(d) == me:
        continue
    try:
        stat = open(f"/proc/{d}/stat").read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        raw = open(f"/proc/{d}/cmdline", "rb").read()
        cmd = [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]
        cg = [l[3:] for l in open(f"/proc/{d}/cgroup").read().splitlines() if l.startswith("0::")]
        uid = [int(l.split()[1]) for l in open(f"/proc/{d}/status") if l.startswith("Uid:")][0]
    except (OSError, IndexError, ValueError):
        continue
    out.append([int(d), ppid, uid, comm, cmd, cg[0] if cg else ""])
print(json.dumps(out))
"""


class SystemdContainer:
    """A booted systemd in a systemd-nspawn container.

    ``binds`` are (host_path, container_path[, readonly=True]) tuples or :class:`Bind`.
    ``rootfs`` defaults to the cached tree for ``extra_packages`` (built on first use).
    """

    def __init__(
        self,
        *,
        binds: Sequence[BindSpec] = (),
        extra_packages: Sequence[str] = (),
        rootfs: str | os.PathLike[str] | None = None,
        name: str | None = None,
        boot_timeout: float = 60.0,
        network_namespace: str | None = None,
        host_network: bool = False,
        capabilities: Sequence[str] = (),
    ) -> None:
        self.binds = [b if isinstance(b, Bind) else Bind(*b) for b in binds]
        #: an `ip netns` name: the container gets that network namespace (tests/rig/network.py)
        #: instead of a private one
        self.network_namespace = network_namespace
        #: the host's network instead of a private loopback: only for a test that must reach
        #: the container's ports from the host or the Debian mirror from the container. Two such
        #: containers share the host's ports (30001 of the shipped profiles), so their tests
        #: run one at a time (conftest.py: the xdist group "host-network").
        self.host_network = host_network
        #: capabilities kept beyond nspawn's default set ("all": root's whole set, as on a real
        #: machine; nspawn keeps CAP_NET_ADMIN only with a private network, and without it a
        #: container booted inside this one cannot bring its own loopback up)
        self.capabilities = list(capabilities)
        self.extra_packages = list(extra_packages)
        self.rootfs = Path(rootfs) if rootfs is not None else None
        self.name = name or f"sgt-{uuid.uuid4().hex[:10]}"
        self.boot_timeout = boot_timeout
        self.state: str | None = None  # "running" or "degraded" once booted
        self.failed_at_boot: list[str] = []
        self.boot_seconds: float | None = None
        self.stop_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._leader: int | None = None
        self._workdir: Path | None = None
        self._cgroup: Path | None = None
        self._keep_logs = False  # keep the console log (a failed boot)
        self._passwd_cache: dict[str, tuple[int, int, str, str]] = {}

    # ---- lifecycle

    def boot(self) -> SystemdContainer:
        if self._proc is not None:
            raise ContainerError(f"{self.name} is already booted")
        problems = missing_tools()
        if problems:
            raise RigUnavailable("; ".join(problems))
        if self.rootfs is None:
            self.rootfs = ensure_rootfs(self.extra_packages)
        self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        # Each container in a cgroup of its own: nspawn puts the container's tree in
        # "payload" under its OWN cgroup, so two containers started from one cgroup would
        # share one tree (and see each other's units).
        self._cgroup = None
        mount = cgroup2_mount()
        if mount is not None:
            _sweep_rig_cgroups(mount / RIG_CGROUP)
            self._cgroup = mount / RIG_CGROUP / f"ctr-{os.getpid()}-{self.name}"
            self._cgroup.mkdir(parents=True, exist_ok=True)
        else:
            _log("no writable cgroup2 mount: containers started together will share a cgroup")
        cmd = [
            "systemd-nspawn", "-b", "-D", str(self.rootfs), "-M", self.name,
            "--register=no", "--keep-unit", "--console=pipe", "--volatile=overlay",
            *(b.nspawn_arg() for b in self.binds),
            *self._network_args(),
            *([f"--capability={','.join(self.capabilities)}"] if self.capabilities else []),
        ]  # fmt: skip
        t0 = time.monotonic()
        with open(self.console_log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **_NSPAWN_ENV},
                start_new_session=True,  # no Ctrl-C straight to nspawn: we stop it ourselves
                preexec_fn=_joining_preexec(self._cgroup),
            )
        _LIVE.add(self)
        try:
            deadline = t0 + self.boot_timeout
            self._leader = self._find_leader(deadline)
            self._wait_running(deadline)
        except BaseException as e:
            # the console (--console=pipe) shows little; the journal says why, if it is up
            with contextlib.suppress(Exception):
                if self._leader is not None:
                    j = self.run(["journalctl", "-b", "--no-pager", "-n", "60"], timeout=5)
                    e.add_note(f"journal of {self.name}:\n{j.stdout}")
            self._keep_logs = True
            with contextlib.suppress(Exception):
                self.stop()
            raise
        self.boot_seconds = time.monotonic() - t0
        self._make_binds_reachable()
        return self

    def _make_binds_reachable(self) -> None:
        """Let every user of the container pass the directories above a bind (a checkout in
        /root: nspawn makes its mount point under the image's 0700 /root, and a test that runs
        the checkout's gpusupctl as a gpusup member got "Permission denied"). It is the
        container's own /root, on its volatile overlay: the host's stays as it is."""
        mounted = [Path(b.container or b.host) for b in self.binds]
        above = sorted({str(p) for m in mounted for p in m.parents
                        if str(p) != "/" and not any(p.is_relative_to(n) for n in mounted)})  # never the host's
        if above:
            self.run(["chmod", "go+x", *above])

    def _network_args(self) -> list[str]:
        """A private loopback by default: tests running in parallel each get their own 30001."""
        if self.network_namespace:
            return [f"--network-namespace-path=/run/netns/{self.network_namespace}"]
        return [] if self.host_network else ["--private-network"]

    def stop(self, timeout: float = 10.0) -> None:
        """Halt the container: SIGTERM to nspawn (clean halt), then SIGKILL after ``timeout``."""
        proc = self._proc
        if proc is None:
            return
        t0 = time.monotonic()
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    _log(f"{self.name}: no halt within {timeout:.0f} s, killing it")
                    if self._cgroup is not None:  # nspawn and every process of the container
                        _remove_cgroup(self._cgroup, kill=True)
                    leader = self._leader
                    if leader is not None and self._is_leader(leader):
                        os.kill(leader, signal.SIGKILL)  # kills its whole pid namespace
                    proc.kill()
                    proc.wait(10)
                    while leader is not None and _alive(leader):
                        if time.monotonic() - t0 > timeout + 10:
                            break
                        time.sleep(0.01)
        finally:
            self.stop_seconds = time.monotonic() - t0
            self._proc = None
            self._leader = None
            _LIVE.discard(self)
            self._cleanup_host_leftovers()

    def __enter__(self) -> SystemdContainer:
        return self.boot() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<SystemdContainer {self.name} leader={self._leader} state={self.state}>"

    @property
    def booted(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def nspawn_pid(self) -> int:
        if self._proc is None:
            raise ContainerError("not booted")
        return self._proc.pid

    @property
    def leader_pid(self) -> int:
        """Host pid of the container's PID 1 (systemd)."""
        if self._leader is None:
            raise ContainerError(f"{self.name} is not booted")
        return self._leader

    @property
    def bus_address(self) -> str:
        """The container's system bus, usable from the host (DBUS_SYSTEM_BUS_ADDRESS)."""
        return f"unix:path=/proc/{self.leader_pid}/root/run/dbus/system_bus_socket"

    @property
    def console_log_path(self) -> Path:
        assert self._workdir is not None
        return self._workdir / "console.log"

    def console_log(self) -> str:
        """What the container printed on its console so far (systemd's boot messages...)."""
        if self._workdir is None:
            return ""
        return (_read(str(self.console_log_path)) or "")

    # ---- commands

    def run(
        self,
        argv: Sequence[str],
        check: bool = True,
        timeout: float | None = 60.0,
        input: str | bytes | None = None,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (as root, or as ``user``); text output captured.

        The environment is clean (PATH, LANG=C.UTF-8, HOME...) plus ``env``. On timeout
        the command's process group is killed and TimeoutExpired raised.
        """
        self._check_alive()
        full_env = {
            "PATH": CONTAINER_PATH,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "HOME": "/root",
            "USER": "root",
            "LOGNAME": "root",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
        }
        inner: list[str] = []
        if user is not None and user != "root":
            uid, gid, home, shell = self._passwd(user)
            inner = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]
            full_env.update(HOME=home, USER=user, LOGNAME=user, SHELL=shell)
        full_env.update(env or {})
        cmd = ["nsenter", "-t", str(self._leader), "-a", "-r"]
        cmd += [f"--wdns={cwd}"] if cwd else ["-w"]
        cmd += [*inner, *argv]
        data = input.encode() if isinstance(input, str) else input
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        try:
            out, err = p.communicate(data, timeout=timeout)
        except subprocess.TimeoutExpired:
            # nsenter forks the command: kill the whole group, not only nsenter
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(list(argv), timeout or 0, out, err) from None
        cp = subprocess.CompletedProcess(
            list(argv), p.returncode, out.decode(errors="replace"), err.decode(errors="replace")
        )
        if check and cp.returncode != 0:
            raise ContainerCommandError(cp.returncode, list(argv), cp.stdout, cp.stderr)
        return cp

    def systemctl(
        self, *args: str, check: bool = True, timeout: float | None = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--no-pager", *args], check=check, timeout=timeout)

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def journal(self, unit_glob: str, *extra: str, timeout: float | None = 60.0) -> str:
        """``journalctl -b -u UNIT_GLOB EXTRA...`` (after flushing what journald holds)."""
        self.run(["journalctl", "--sync"], check=False, timeout=timeout)
        return self.run(
            ["journalctl", "--no-pager", "-q", "-b", "-u", unit_glob, *extra], timeout=timeout
        ).stdout

    def is_active(self, unit: str) -> str:
        """``systemctl is-active UNIT`` (active, activating, inactive, failed...)."""
        return self.systemctl("is-active", unit, check=False).stdout.strip()

    def unit_cgroup(self, unit: str) -> str:
        """The unit's cgroup path inside the container, e.g. /sys/fs/cgroup/system.slice/x.service."""
        cg = self.systemctl("show", "-P", "ControlGroup", unit).stdout.strip()
        return f"/sys/fs/cgroup{cg}" if cg else ""

    def failed_units(self) -> list[str]:
        out = self.systemctl("list-units", "--failed", "--no-legend", "--plain", check=False)
        return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]

    def processes(self, cgroup_prefix: str | None = None) -> list[ContainerProcess]:
        """Every process in the container with its cgroup (optionally only those under a
        cgroup path such as ``/system.slice/foo.service``), less the one that looks."""
        out = self.run(["python3", "-c", _PS_SCRIPT]).stdout
        procs = [
            ContainerProcess(pid, ppid, uid, comm, tuple(cmd), cg)
            for pid, ppid, uid, comm, cmd, cg in json.loads(out)
        ]
        if cgroup_prefix is not None:
            pre = cgroup_prefix.rstrip("/")
            procs = [p for p in procs if p.cgroup == pre or p.cgroup.startswith(pre + "/")]
        return sorted(procs, key=lambda p: p.pid)

    # ---- files

    def host_path(self, ctr_path: str) -> Path:
        """The host's view of a container path (through /proc/LEADER/root). Absolute
        symlinks inside the container resolve against the HOST root on this path: prefer
        run()/write_file() for anything that may be a symlink."""
        return Path(f"/proc/{self.leader_pid}/root") / ctr_path.lstrip("/")

    def write_file(
        self, ctr_path: str, text: str | bytes, mode: int = 0o644, owner: str | None = None
    ) -> None:
        """Write a file inside the container (atomically; parents created), e.g. a unit file."""
        if not ctr_path.startswith("/"):
            raise ValueError(f"container path must be absolute: {ctr_path!r}")
        script = (
            'set -e; mkdir -p "$(dirname "$1")"; t="$1.rig-tmp.$$"; cat > "$t"; '
            'chmod "$2" "$t"; if [ -n "$3" ]; then chown "$3:" "$t"; fi; mv -f "$t" "$1"'
        )
        self.run(
            ["sh", "-c", script, "sh", ctr_path, f"{mode:o}", owner or ""],
            input=text.encode() if isinstance(text, str) else text,
        )

    def install_file(
        self, host_src: str | os.PathLike[str], ctr_dst: str, mode: int | None = None,
        owner: str | None = None,
    ) -> None:  # fmt: skip
        """Copy a host file into the container (mode defaults to the source's)."""
        src = Path(host_src)
        self.write_file(
            ctr_dst, src.read_bytes(), mode if mode is not None else src.stat().st_mode & 0o7777,
            owner,
        )  # fmt: skip

    def read_file(self, ctr_path: str) -> str:
        return self.run(["cat", ctr_path]).stdout

    # ---- internals

    def _is_leader(self, pid: int) -> bool:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/pid")
            comm = (_read(f"/proc/{pid}/comm") or "").strip()
        except OSError:
            return False
        return ns != os.readlink("/proc/self/ns/pid") and comm == "systemd"

    def _find_leader(self, deadline: float) -> int:
        # The container's PID 1 is a child of nspawn in another pid namespace, comm
        # "systemd". The first child can be a short-lived helper: look again until it holds.
        assert self._proc is not None
        while True:
            for kid in _children(self._proc.pid):
                if self._is_leader(kid):
                    return kid
            self._check_alive()
            if time.monotonic() > deadline:
                raise ContainerError(self._why("no systemd PID 1 appeared"))
            time.sleep(0.01)

    def _wait_running(self, deadline: float) -> None:
        state = ""
        while time.monotonic() < deadline:
            r = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                self.state = state
                if state == "degraded":
                    self.failed_at_boot = self.failed_units()
                    _log(f"{self.name} booted degraded; failed units: {self.failed_at_boot}")
                return
            if state in ("maintenance", "stopping"):
                break
            time.sleep(0.02)
        raise ContainerError(self._why(f"system state {state!r}, not running"))

    def _check_alive(self) -> None:
        if self._proc is None:
            raise ContainerError(f"{self.name} is not booted")
        if self._proc.poll() is not None:
            raise ContainerError(self._why(f"systemd-nspawn exited {self._proc.returncode}"))

    def _why(self, what: str) -> str:
        return f"container {self.name}: {what}; console:\n{_tail(self.console_log(), 40)}"

    def _passwd(self, user: str) -> tuple[int, int, str, str]:
        if user not in self._passwd_cache:
            for line in self.read_file("/etc/passwd").splitlines():
                f = line.split(":")
                if len(f) >= 7:
                    self._passwd_cache[f[0]] = (int(f[2]), int(f[3]), f[5], f[6])
        if user not in self._passwd_cache:
            raise KeyError(f"no user {user!r} in the container")
        return self._passwd_cache[user]

    def _cleanup_host_leftovers(self) -> None:
        if self._cgroup is not None:
            if not _remove_cgroup(self._cgroup, kill=True):
                _log(f"{self.name}: could not remove cgroup {self._cgroup}")
            with contextlib.suppress(OSError):
                self._cgroup.parent.rmdir()  # only when no other container is running
            self._cgroup = None
        # nspawn leaves /run/systemd/nspawn/propagate/NAME behind when /run is not a tmpfs
        prop = Path("/run/systemd/nspawn/propagate", self.name)
        if prop.is_dir() and not os.path.ismount(prop):
            subprocess.run(["rm", "-rf", "--one-file-system", str(prop)], check=False)
        if self._workdir is not None:
            if self._keep_logs or os.environ.get(KEEP_LOGS_ENV):
                _log(f"{self.name}: console log kept at {self.console_log_path}")
            else:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None


def repo_binds() -> list[Bind]:
    """The repository, read-only at its own path (so ``REPO/.venv/bin/python`` works inside)."""
    return [Bind(str(REPO_ROOT), str(REPO_ROOT), True)]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("build", "boot"):
        print(__doc__)
        return 2
    problems = missing_tools()
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 1
    if argv[0] == "build":
        t0 = time.monotonic()
        path = ensure_rootfs(argv[1:])
        print(f"{path} ({time.monotonic() - t0:.1f} s)")
        return 0
    with SystemdContainer(binds=repo_binds()) as c:
        print(f"booted {c.name} in {c.boot_seconds:.2f} s: {c.state}, leader {c.leader_pid}")
        print(c.run(["uname", "-a"]).stdout.strip())
    print(f"stopped in {c.stop_seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
