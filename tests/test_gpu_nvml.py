"""NVML on a real GPU: an idle GPU reads idle, a torch process holding memory is named, its death is seen at once.

Runs on the device machine only (`pytest -m gpu`); skipped wherever NVML cannot start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Iterator

import pytest

from supervisord_gpu.checks.gpus import NvmlInventory, NvmlUnavailable
from supervisord_gpu.checks.preconditions import Requirement, check

pytestmark = pytest.mark.gpu

# Allocates N GiB on the (only) visible GPU, says so, and waits to be killed.
TORCH_HOG = """\
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def nvml() -> Iterator[NvmlInventory]:
    pytest.importorskip("pynvml")
    try:
        inv = NvmlInventory()
    except NvmlUnavailable as e:
        pytest.skip(f"NVML cannot start here: {e}")
    if inv.count() == 0:
        inv.close()
        pytest.skip("NVML sees no GPU")
    yield inv
    inv.close()


def start_torch_hog(inv: NvmlInventory, gib: float) -> subprocess.Popen[str]:
    (state,) = inv.snapshot([0])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": state.uuid}  # NVML's GPU 0, whatever CUDA's order
    proc = subprocess.Popen([sys.executable, "-c", TORCH_HOG, str(gib)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n", "the torch holder did not start"
    return proc


def test_an_idle_gpu_reads_idle(nvml: NvmlInventory) -> None:
    report = check(Requirement(frozenset({0})), nvml)
    assert report.ok, report.problems()
    (gpu,) = report.gpus
    assert gpu.processes == () and gpu.in_use_mib <= nvml.tolerance_mib


def test_a_torch_process_holding_10_gib_is_named_and_its_death_is_seen_within_0_3_s(nvml: NvmlInventory) -> None:
    pytest.importorskip("torch")
    proc = start_torch_hog(nvml, 10)
    try:
        report = check(Requirement(frozenset({0})), nvml)
        (gpu,) = report.gpus
        assert not gpu.idle and gpu.in_use_mib >= 10 * 1024
        assert proc.pid in [p.pid for p in gpu.processes]
        (line,) = report.problems()
        assert line.startswith("GPU 0 not idle: ") and f"pid {proc.pid} " in line and line.endswith("(foreign)")
    finally:
        proc.kill()
        killed = time.monotonic()
    while not nvml.snapshot([0])[0].idle and time.monotonic() - killed < 5:
        time.sleep(0.002)
    took = time.monotonic() - killed
    proc.wait()
    print(f"\nkill -> NVML idle verdict: {took * 1000:.0f} ms")
    assert took < 0.3, f"GPU 0 idle only {took:.3f} s after SIGKILL"
