"""Run a command where the package's /etc/supervisord-gpu is a test's own directory, without
writing a byte into this machine's /etc.

How: a private mount namespace (unshare --mount, propagation private) in which /etc is an
overlay whose lower layer is the real /etc and whose upper layer is a directory of the test
holding only `supervisord-gpu/`. Inside, /etc/supervisord-gpu is the test's config, and every
other file of /etc (passwd, hosts, ...) is the machine's own; the overlay vanishes with the
namespace, and the real /etc never sees it. So `gpusupctl VERB` is called exactly as an admin
calls it after installing the package: no --config-dir, no environment variable, the code's own
default. Needs root and overlayfs; `available()` says why not where either is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIR = "/etc/supervisord-gpu"
GPUSUPCTL = [sys.executable, "-m", "supervisord_gpu.cli.gpusupctl"]


def available() -> str | None:
    """None when a command can be run under an overlaid /etc here; else why not."""
    if os.geteuid() != 0:
        return "needs root (a mount namespace and an overlay on /etc)"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    if Path(PACKAGE_DIR).exists():
        return f"{PACKAGE_DIR} exists on this machine: its own config would be the lower layer's"
    return None


def run_as_installed(config: Path, argv: Sequence[str], env: Mapping[str, str] | None = None,
                     timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    """`argv` with /etc/supervisord-gpu showing `config` (copied once into the overlay's upper
    layer, beside `config`). The environment is this one without SUPERVISORD_GPU_CONFIG_DIR,
    plus `env`."""
    layer = config.parent / f".{config.name}-etc-overlay"
    upper, work = layer / "upper", layer / "work"
    if not upper.exists():
        work.mkdir(parents=True)
        upper.mkdir(mode=0o755)
        upper.chmod(0o755)  # the overlay's root, /etc itself, takes this mode: root's, 0755, as the walk wants
        shutil.copytree(config, upper / "supervisord-gpu", symlinks=True)
    script = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc || exit 97\n"
              'exec "$@"')
    clean = {k: v for k, v in os.environ.items() if k != "SUPERVISORD_GPU_CONFIG_DIR"}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          env={**clean, **(env or {})}, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          **kw)  # type: ignore[call-overload]
