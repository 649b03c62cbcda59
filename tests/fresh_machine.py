"""A newcomer's first command on a fresh Debian 12, from /root: `sh make.sh rehearse`.

Boots a clean Debian 12 (the rig's debootstrapped tree: no make, no git, no python3-venv)
with a real systemd, on the host's network (apt needs the mirror; the rehearsal's ports are
the host's then, so nothing else may run on 30000-30001 meanwhile), copies only the source
tree to /root/supervisord-gpu, and runs the README's rehearsal command there as root, as
written. Prints what it printed and the time; writes bench/results/fresh-debian-root.json.
Minutes (it installs the venv from the package index). Not part of `make test`: run by hand,
`python3 tests/fresh_machine.py`, after `make test` has built the rig.
"""

from __future__ import annotations

import io
import json
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


def source_tree() -> bytes:
    """The checkout's files as a tar, without git's or any build's: what a download holds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in filter(None, listed):
            path = REPO / name
            if path.is_file() and not SKIP & set(Path(name).parts):
                tar.add(path, arcname=name)
    return buf.getvalue()


def main() -> int:
    with SystemdContainer(binds=[], host_network=True) as ctr:
        had = {tool: ctr.run(["sh", "-c", f"command -v {tool}"], check=False).returncode == 0
               for tool in ("make", "git", "python3")}
        ctr.run(["mkdir", "-p", TREE])
        ctr.run(["tar", "-x", "-C", TREE], input=source_tree(), timeout=120)
        mode = ctr.run(["stat", "-c", "%a", "/root"]).stdout.strip()
        print(f"fresh Debian 12: make {'present' if had['make'] else 'absent'}, git {'present' if had['git'] else 'absent'}, "
              f"python3 {'present' if had['python3'] else 'absent'}; /root mode {mode}; source in {TREE}", flush=True)
        began = time.monotonic()
        r = ctr.run(["sh", "make.sh", "rehearse"], cwd=TREE, check=False, timeout=1500)
        took = time.monotonic() - began
        print(r.stdout[-6000:], r.stderr[-3000:], sep="\n")
        ok = r.returncode == 0 and "verified after stop" in r.stdout
        result = {
            "what": "sh make.sh rehearse, as root, in /root/supervisord-gpu of a fresh Debian 12 (systemd booted)",
            "date": time.strftime("%Y-%m-%d"),
            "before": had, "root_mode": mode, "exit": r.returncode, "seconds": round(took, 1),
            "verified_after_stop": "verified after stop" in r.stdout,
            "passed_through": "passed through in a mount namespace" in r.stdout,
        }
        out = REPO / "bench" / "results" / "fresh-debian-root.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{'PASS' if ok else 'FAIL'}: exit {r.returncode} after {took:.0f} s ({out})")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
