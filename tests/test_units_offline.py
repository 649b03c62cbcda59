"""The shipped units' sandboxes, scored by systemd itself without running them.

`systemd-analyze security --offline=true` (systemd >= 250) reads a unit file and scores its
exposure the way `systemd-analyze security UNIT` does for a loaded one. The scores are kept
from rising: a hardening line lost in an edit fails here, in a second, instead of being noticed
in a review. The loaded dsv4@ unit is scored under a real systemd in test_unit_sandbox.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[1] / "units"

#: the exposure measured when each line of hardening was last changed (README, "Security")
CEILING = {"gpusup-agent.service": 2.8, "dsv4@.service": 3.4}


def exposure(unit: str, threshold: int = 100) -> tuple[int, float]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", f"--threshold={threshold}", "--no-pager",
                        str(UNITS / unit)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", r.stdout)
    if m is None and "offline" in r.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert m is not None, r.stdout[-2000:] + r.stderr[-2000:]
    return r.returncode, float(m.group(1))


@pytest.mark.parametrize("unit", sorted(CEILING))
def test_a_units_exposure_does_not_rise(unit: str) -> None:
    rc, score = exposure(unit)
    assert rc == 0 and score <= CEILING[unit], f"{unit}: exposure {score} (ceiling {CEILING[unit]})"
    # and the check can fail: below the score, systemd-analyze itself says no
    rc_below, _ = exposure(unit, threshold=int(score * 10) - 1)
    assert rc_below != 0
