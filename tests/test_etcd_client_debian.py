"""The etcd client's defences on the libraries the .deb runs with: Debian 12's python3-etcd3gw
(2.0.0), python3-requests (2.28) and python3-urllib3 (1.26), not the newer ones of the virtual
environment. They differ where it matters: urllib3 1.26 inflates a whole raw read of gzip at
once (a 64 kB answer was a 141 MiB peak before the read went to 1 kB at a time) and hands over
an answer cut short of its Content-Length as if whole. So the two modules of tests against a
scripted etcd over a real socket run again under /usr/bin/python3 with Debian's packages first
on the path: fetched with `apt-get download` and unpacked into a temporary directory, never
installed (installed, they would satisfy the virtual environment's own requirements, which
`--system-site-packages` then leaves out, and the containers that run the checkout lack them).
pytest and psutil come from the virtual environment, behind Debian's libraries.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
#: the client's libraries as the .deb gets them; what they need comes along (debian_packages)
ROOTS = ("python3-etcd3gw", "python3-requests", "python3-urllib3")


def debian_packages() -> list[str]:
    """ROOTS and every python3-* package they depend on, as apt resolves it (urllib3 1.26 needs
    six, pbr needs pkg-resources: a fresh machine has neither, while this host's own Python
    happened to have six, and a hand-kept list passed here and failed there)."""
    listed = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                             "--no-breaks", "--no-replaces", "--no-enhances", "--no-pre-depends", *ROOTS],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    return sorted({line for line in listed.splitlines() if line.startswith("python3-")})


def debian_libraries(into: Path) -> Path:
    """Debian's own packages unpacked under `into`; their dist-packages directory."""
    got = subprocess.run(["apt-get", "download", *debian_packages()], cwd=into, capture_output=True, text=True,
                         timeout=300, check=False)
    assert got.returncode == 0, f"apt-get download failed (run `apt-get update`?): {got.stderr[-1500:]}"
    for deb in sorted(into.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(into / "root")], check=True, timeout=60)
    return into / "root" / "usr" / "lib" / "python3" / "dist-packages"


def test_the_etcd_client_tests_pass_on_debians_own_libraries(tmp_path: Path) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None or not Path(SYSTEM_PYTHON).exists():
        pytest.skip("needs Debian's apt-get, dpkg-deb and /usr/bin/python3")
    debian = debian_libraries(tmp_path)
    venv = sysconfig.get_paths()["purelib"]  # pytest, psutil: behind Debian's libraries on the path
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(tmp_path),
           "PYTHONPATH": ":".join((str(debian), str(REPO), venv))}
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import urllib3, requests, etcd3gw, os; "
                            "print(urllib3.__version__, requests.__version__, os.path.dirname(etcd3gw.__file__))"],
                           env=env, capture_output=True, text=True, check=False)
    assert probe.returncode == 0, f"Debian's libraries do not import: {probe.stderr[-1500:]}"
    versions = probe.stdout.split()
    assert versions[0].startswith("1.26.") and versions[2].startswith(str(debian)), versions  # Debian's, not the venv's
    done = subprocess.run([SYSTEM_PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_cluster_failures.py", "tests/test_cluster_failures_hostile.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    summary = (done.stdout.strip().splitlines() or [done.stderr[-300:]])[-1]
    print(f"Debian's urllib3 {versions[0]}, requests {versions[1]}: {summary}", file=sys.stderr)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
