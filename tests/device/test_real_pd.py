"""A real prefill-decode pair on one GPU behind each real router (issue 36): bench/device/real_pd.py.

Runs on the device machine only, after `python3 bench/device/real_pd.py unpack` put the bundles
of .sgl/ and .sglr/ under /tmp/sgl (`pytest -m gpu tests/device -k real_pd`); skipped wherever
NVML sees no GPU or the bundles are not unpacked. One router per call: each run takes up to
9.5 minutes and the device machine allows 10 a command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device" / "real_pd.py"
UNPACKED = Path("/tmp/sgl")
SITES = {"sglang-router": "router-site", "smg": "smg-site"}

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


@pytest.mark.parametrize("router", sorted(SITES))
def test_real_pd(router: str, tmp_path: Path) -> None:
    if not all((UNPACKED / n / ".done").exists() for n in ("sglang-site", "mooncake-site", SITES[router])):
        pytest.skip("bundles not unpacked under /tmp/sgl (bench/device/real_pd.py unpack)")
    if not _gpu():
        pytest.skip("needs an NVIDIA GPU and NVML")
    subprocess.run([sys.executable, str(SCRIPT), "run", "--mode", "real", "--router", router, "--out", str(tmp_path)],
                   cwd=ROOT, timeout=600)
    data = json.loads((tmp_path / f"real-pd-real-{router}.json").read_text())
    failed = {k: [c["check"] for c in v["checks"] if not c["ok"]] or v.get("error") or v.get("why")
              for k, v in data["scenarios"].items() if v["result"] != "PASS"}
    assert not failed, failed
