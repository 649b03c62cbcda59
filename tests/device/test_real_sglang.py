"""The real SGLang 0.5.23 and the real sglang-router in the loop (issue 27): bench/device/real_sglang.py.

Runs on the device machine only, with the bundles prepare.sh staged into .sgl/ carried along
(`pytest -m gpu tests/device`); skipped wherever NVML sees no GPU or .sgl/ is missing. Each
group takes 4-7 minutes (README, "The real SGLang in the loop"); the device machine allows
10 minutes a command, so run one group per call: `pytest -m gpu tests/device -k group1`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device" / "real_sglang.py"
SGL = ROOT / ".sgl"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


@pytest.mark.parametrize("group", ["group1", "group2"])
def test_real_sglang(group: str, tmp_path: Path) -> None:
    if not all((SGL / f).exists() for f in ("sglang-site.tar.xz", "router-site.tar.xz", "make_tiny_model.py")):
        pytest.skip("no SGLang bundles in .sgl/ (shared/real-sglang/prepare.sh --stage .)")
    if not _gpu():
        pytest.skip("needs an NVIDIA GPU and NVML")
    n = group[-1]
    code = ["--code", "head"] if (SGL / "code-HEAD.tar.xz").exists() else []
    argv = [sys.executable, str(SCRIPT), "run", "--mode", "real", "--group", n, "--out", str(tmp_path), *code]
    if n == "2":
        argv.append("--also-crash")
    subprocess.run(argv, cwd=ROOT, timeout=600)
    data = json.loads((tmp_path / f"real-sglang-real-g{n}.json").read_text())
    failed = {k: [c["check"] for c in v["checks"] if not c["ok"]] or v.get("error") or v.get("why")
              for k, v in data["scenarios"].items() if v["result"] != "PASS"}
    assert not failed, failed
