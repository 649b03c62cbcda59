"""The etcd client's defences on the libraries the .deb runs with: Debian 12's python3-etcd3gw
(2.0.0), python3-requests and python3-urllib3 (1.26), not the newer ones of the virtual
environment. They differ where it matters: urllib3 1.26 inflates a whole raw read of gzip at
once (a 64 kB answer was a 141 MiB peak before the read went to 1 kB at a time) and hands over
an answer cut short of its Content-Length as if whole. So the two modules of tests against a
scripted etcd over a real socket run again under /usr/bin/python3 with only Debian's packages.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"


def debian_has(module: str) -> bool:
    return subprocess.run([SYSTEM_PYTHON, "-c", f"import {module}"], capture_output=True, check=False).returncode == 0


def test_the_etcd_client_tests_pass_on_debians_own_libraries() -> None:
    for module in ("etcd3gw", "requests", "urllib3", "psutil", "pytest"):
        if not debian_has(module):
            pytest.skip(f"Debian's python3 lacks {module} (make test-setup installs python3-etcd3gw, python3-psutil, python3-pytest)")
    versions = subprocess.run([SYSTEM_PYTHON, "-c", "import urllib3, requests; print(urllib3.__version__, requests.__version__)"],
                              capture_output=True, text=True, check=True).stdout.split()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([SYSTEM_PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "tests/test_cluster_failures.py", "tests/test_cluster_failures_hostile.py"],
                          cwd=REPO, env={**env, "HOME": os.environ.get("HOME", "/root")},
                          capture_output=True, text=True, timeout=300, check=False)
    summary = done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]
    print(f"Debian's urllib3 {versions[0]}, requests {versions[1]}: {summary[0]}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
