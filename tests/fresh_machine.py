"""A newcomer's first commands on a fresh Debian 12, from /root: `sh make.sh rehearse`, and
with the argument `test`, `sh make.sh test` (the whole suite, its containers nested in this one).

Boots a clean Debian 12 (the rig's debootstrapped tree: no make, no git, no python3-venv)
with a real systemd, on the host's network (apt needs the mirror; the rehearsal's ports are
the host's then, so nothing else may run on 30000-30001 meanwhile) and given that network's
TLS trust anchors as this host has them (give_network_trust: pip's index is reached through a
network whose certificates only its machines trust), unpacks only the source tree to
/root/supervisord-gpu as root from a tar with `git archive`'s modes (0664/0775: group-writable,
as a download is; `sh make.sh` must fix that first, and the result says whether it did), and
runs the README's rehearsal command there as root, as written. Prints what it printed and the time; writes bench/results/fresh-debian-root.json.
With `test`, it then checks what the done-when of "first hour" asks of that machine: no unit
enabled or running afterwards that was not before (the installed packages' own, and those their
Recommends brought: etcd, prometheus, its node exporter and collectors' timers, smartd, ...),
nothing listening on etcd's and prometheus' ports; bench/results/fresh-debian-root-test.json.
With `test-setup`, only the test set-up (`sh make.sh test-setup`: the packages and the virtual
environment) and the same check, in a few minutes; bench/results/fresh-debian-root-test-setup.json.
The container is given root's whole capability set, as a real machine's root has (nspawn's
default drops CAP_NET_ADMIN on the host's network, and the suite's own containers could then not
bring their loopback up).
Minutes (it installs the venv from the package index). Not part of `make test`: run by hand,
`python3 tests/fresh_machine.py`, after `make test` has built the rig.
"""

from __future__ import annotations

import io
import json
import os
import re
import ssl
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rig.systemd_container import SystemdContainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TREE = "/root/supervisord-gpu"
SKIP = {".git", ".venv", "build", "dist", ".pytest_cache", ".mypy_cache", ".hypothesis", ".sgl", "__pycache__"}


def as_git_archive_writes_it(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """An entry as `git archive` writes it (its tar.umask is 002): root's, files 0664 (0775 if
    executable), directories 0775. Unpacked as root, tar keeps those modes: the tree is
    group-writable, which the daemon refuses as root, and which `sh make.sh` must fix first."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = 0o775 if info.isdir() or info.mode & 0o100 else 0o664
    return info


def source_tree() -> bytes:
    """The checkout's files as a tar, without git's or any build's: what a download holds, with
    the modes `git archive` gives them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs: set[str] = set()
        for name in filter(None, listed):
            path = REPO / name
            if path.is_file() and not SKIP & set(Path(name).parts):
                for parent in reversed(Path(name).parents[:-1]):  # each directory once, before its files
                    if str(parent) not in dirs:
                        dirs.add(str(parent))
                        tar.add(REPO / parent, arcname=str(parent), recursive=False, filter=as_git_archive_writes_it)
                tar.add(path, arcname=name, filter=as_git_archive_writes_it)
    return buf.getvalue()


NETWORK_TRUST = "/usr/local/share/ca-certificates/network-trust.crt"
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def host_ca_bundle() -> Path:
    """The CA bundle this host verifies TLS with: $SSL_CERT_FILE, else OpenSSL's default file."""
    paths = ssl.get_default_verify_paths()
    for candidate in (os.environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise SystemExit("fresh_machine: the host has no CA bundle to give the container (set SSL_CERT_FILE)")


def give_network_trust(ctr: SystemdContainer) -> Path:
    """Give the container the trust anchors of the network it is on, as this host has them.

    This is about the network, not the project: the sandbox's network presents TLS
    certificates signed by an authority that only its machines trust (the host's CA bundle
    holds it, and the host points pip at that bundle). A fresh machine installed on this
    network would be handed the same anchor, so the container gets the host's bundle as its
    system bundle and pip is pointed at it in /etc/pip.conf (pip otherwise verifies with the
    certifi bundle it vendors, which lacks the network's anchor). Nothing else of the host's
    pip set-up (local wheel folders, file:// indexes) comes along: the container installs from
    the network like a newcomer. The bundle is also kept in /usr/local/share/ca-certificates,
    so that if apt installs ca-certificates meanwhile, its update-ca-certificates keeps it in
    the system bundle, and pip's path to it never changes.
    """
    bundle = host_ca_bundle()
    data = bundle.read_bytes()
    ctr.write_file(NETWORK_TRUST, data)
    ctr.write_file(SYSTEM_BUNDLE, data)
    ctr.write_file("/etc/pip.conf", f"[global]\ncert = {NETWORK_TRUST}\n")
    return bundle


SERVICE_PORTS = (2379, 2380, 9090, 9100)  # etcd's client and peer ports, prometheus, node-exporter


def units_now(ctr: SystemdContainer) -> dict[str, set[str]]:
    """The machine's enabled unit files, and its running services, sockets and timers."""
    enabled = ctr.run(["systemctl", "list-unit-files", "--state=enabled,enabled-runtime", "--no-legend", "--plain"],
                      check=False).stdout
    active = ctr.run(["systemctl", "list-units", "--state=active", "--type=service,socket,timer", "--no-legend",
                      "--plain"], check=False).stdout
    return {"enabled": {line.split()[0] for line in enabled.splitlines() if line.strip()},
            "active": {line.split()[0] for line in active.splitlines() if line.strip()}}


def units_left(ctr: SystemdContainer, before: dict[str, set[str]]) -> dict[str, object]:
    """What the run left on the machine that it did not have before: units enabled, units running
    (services, sockets, timers), and listeners on etcd's and prometheus' ports."""
    now = units_now(ctr)
    enabled = sorted(now["enabled"] - before["enabled"])
    active = sorted(now["active"] - before["active"])
    listening = [line.split()[3] for line in ctr.run(["ss", "-Hltn"]).stdout.splitlines()
                 if line.split()[3].rsplit(":", 1)[-1] in {str(p) for p in SERVICE_PORTS}]
    return {"enabled_since": enabled, "running_since": active, "listening": listening,
            "clean": not enabled and not active and not listening}


def pytest_summaries(out: str) -> list[str]:
    """pytest's closing lines ("353 passed in 19.71s"; the fast tier's, then the rest's)."""
    return re.findall(r"^(?:=+ )?(\d+ (?:passed|failed|error).* in [\d.]+s.*?)(?: =+)?$", out, re.M)


def main() -> int:
    """`sh make.sh rehearse` (the default) or, with the argument `test`, `sh make.sh test`."""
    command = sys.argv[1] if len(sys.argv) > 1 else "rehearse"
    if command not in ("rehearse", "test", "test-setup"):
        raise SystemExit("usage: python3 tests/fresh_machine.py [rehearse|test|test-setup]")
    # root's whole capability set, as on a real machine (nspawn's default drops CAP_NET_ADMIN
    # on the host's network, and the suite's own containers then had their loopback down)
    with SystemdContainer(binds=[], host_network=True, capabilities=["all"]) as ctr:
        had = {tool: ctr.run(["sh", "-c", f"command -v {tool}"], check=False).returncode == 0
               for tool in ("make", "git", "python3")}
        bundle = give_network_trust(ctr)
        ctr.run(["mkdir", "-p", TREE])
        ctr.run(["tar", "-x", "-C", TREE], input=source_tree(), timeout=120)
        mode = ctr.run(["stat", "-c", "%a", "/root"]).stdout.strip()
        print(f"fresh Debian 12: make {'present' if had['make'] else 'absent'}, git {'present' if had['git'] else 'absent'}, "
              f"python3 {'present' if had['python3'] else 'absent'}; /root mode {mode}; source in {TREE}; "
              f"the network's trust from the host's {bundle} (pip: /etc/pip.conf)", flush=True)
        units_before = units_now(ctr)
        began = time.monotonic()
        argv = ["sh", "make.sh", command]
        if command == "test":
            # as a shell on that machine runs it: inside its own cgroup tree (a command entered
            # from outside stays in the host's cgroup, and the suite's own containers could not
            # be moved into cgroups of this machine's tree), with a delegated subtree
            argv = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", "-p", "Delegate=yes",
                    f"--working-directory={TREE}", *argv]
        r = ctr.run(argv, cwd=TREE, check=False, timeout=3600)
        took = time.monotonic() - began
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"fresh-machine-{command}.log"
        log.write_text(r.stdout + "\n--- stderr\n" + r.stderr)
        print(r.stdout[-6000:], r.stderr[-3000:], f"(the whole output: {log})", sep="\n")
        done = {"rehearse": "verified after stop" in r.stdout, "test": " passed" in r.stdout}.get(command, True)
        ok = r.returncode == 0 and done
        left = units_left(ctr, units_before) if command != "rehearse" else None
        if left is not None:
            print(f"after the run: {json.dumps(left)}")
            ok = ok and bool(left["clean"])
        result = {
            "what": f"sh make.sh {command}, as root, in /root/supervisord-gpu of a fresh Debian 12 (systemd booted)",
            "date": time.strftime("%Y-%m-%d"),
            "before": had, "root_mode": mode, "exit": r.returncode, "seconds": round(took, 1),
            **({"verified_after_stop": "verified after stop" in r.stdout} if command == "rehearse" else {}),
            **({"summary": pytest_summaries(r.stdout)} if command == "test" else {}),
            **({"not_passed": re.findall(r"^(?:FAILED|ERROR) (\S+)", r.stdout, re.M)} if command == "test" else {}),
            "modes_fixed": "took group and other write permission off" in r.stdout,
            "passed_through": re.search(r"passed through (?:for .* )?in a mount namespace", r.stdout + r.stderr) is not None,
            **({"left_on_the_machine": left} if left is not None else {}),
        }
        out = REPO / "bench" / "results" / ("fresh-debian-root.json" if command == "rehearse"
                                             else f"fresh-debian-root-{command}.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{'PASS' if ok else 'FAIL'}: exit {r.returncode} after {took:.0f} s ({out})")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
