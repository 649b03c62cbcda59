"""`gpusupctl gpus` and `gpusupctl check` wall time on 8 simulated GPUs, 4 of them held (issue 4's target: < 150 ms).

Against the floor any Python CLI pays here: the interpreter starting and exiting.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import summary, table, write

from supervisord_gpu.checks.simgpu import SimulatedGpus

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-m", "supervisord_gpu.cli.gpusupctl"]
RUNS = 15


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0


def main() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        cdir = Path(d) / "etc"
        (cdir / "profiles").mkdir(parents=True)
        (cdir / "supervisord-gpu.toml").write_text(f'[daemon]\ndefault_user = "root"\n[rehearsal]\nsimgpu_dir = "{d}/sim"\n')
        (cdir / "profiles" / "tp4-512k.toml").write_text((REPO / "etc/supervisord-gpu/profiles/tp4-512k.toml").read_text())
        sim = SimulatedGpus.create(Path(d) / "sim", 8)
        holders = [subprocess.Popen([sys.executable, "-c", f"import sys,time; sys.path.insert(0,{str(REPO)!r}); "
                                     f"from supervisord_gpu.checks.simgpu import SimulatedGpus; SimulatedGpus({str(sim.directory)!r}).hold([{g}], 1000); time.sleep(120)"])
                   for g in range(4)]
        time.sleep(1.0)
        env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}
        try:
            gpus = [timed([*CTL, "gpus", "--rehearsal", "--config-dir", str(cdir)], env) for _ in range(RUNS)]
            check = [timed([*CTL, "check", "tp4-512k", "--rehearsal", "--config-dir", str(cdir)], env) for _ in range(RUNS)]
            floor = [timed([sys.executable, "-c", "pass"], env) for _ in range(RUNS)]
        finally:
            for h in holders:
                h.kill()
                h.wait()
    result = {"what": "8 simulated GPUs, 4 held by live processes", "gpusupctl_gpus_s": summary(gpus),
              "gpusupctl_check_s": summary(check), "python_startup_s": summary(floor)}
    path = write("gpus-latency", result)
    print(table([("command", "median", "python -c pass"),
                 ("gpusupctl gpus", f"{statistics.median(gpus) * 1000:.0f} ms", f"{statistics.median(floor) * 1000:.0f} ms"),
                 ("gpusupctl check tp4-512k", f"{statistics.median(check) * 1000:.0f} ms", "")]))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
