"""The read commands' wall time, as installed, against the floor any Python CLI pays here.

`gpusupctl gpus`, `check` and `status` on 8 simulated GPUs, 4 of them held, each against
`python3 -c pass` in the same run (issue 17's target: within 3x). "As installed": the package
is installed into a directory of its own (not the editable checkout, whose import hook costs
every command ~10 ms) and byte-compiled, as the .deb's py3compile does; its dependencies come
from the project's virtual environment. `status` runs without a system bus (its answer then
says instance states are unknown): what it costs to start, load config and read the GPUs.
"""

from __future__ import annotations

import compileall
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import summary, table, write

from supervisord_gpu.checks.simgpu import SimulatedGpus

REPO = Path(__file__).resolve().parent.parent
RUNS = 21
#: What the commands cannot avoid importing, timed alone: the argument parser and the TOML reader
#: of the standard library (tomllib brings typing, datetime and re), and for `status` the D-Bus
#: bindings (pydbus's gi) and NVML's (pynvml). These are the floors the owner's fixed
#: dependencies set; the ratios to them show what our own code adds.
FLOORS = {
    "import argparse, tomllib": "import argparse, tomllib",
    "import argparse, tomllib, gi.repository.Gio, pynvml": "import argparse, tomllib, gi.repository.Gio, pynvml",
}
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0


def install_copy(into: Path) -> None:
    """`pip install --no-deps` of this checkout into `into`, byte-compiled."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(into), str(REPO)], check=True, stdout=subprocess.DEVNULL)
    compileall.compile_dir(str(into / "supervisord_gpu"), quiet=1)


def main() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        install_copy(root / "installed")
        cdir = root / "etc"
        (cdir / "profiles").mkdir(parents=True)
        (cdir / "supervisord-gpu.toml").write_text(f'[daemon]\ndefault_user = "root"\n[rehearsal]\nsimgpu_dir = "{d}/sim"\n')
        (cdir / "profiles" / "tp4-512k.toml").write_text(
            (REPO / "etc/supervisord-gpu/profiles/tp4-512k.toml").read_text().replace('user = "sglang"', 'user = "root"'))
        sim = SimulatedGpus.create(root / "sim", 8)
        holders = [subprocess.Popen([sys.executable, "-c", f"import sys,time; sys.path.insert(0,{str(REPO)!r}); "
                                     f"from supervisord_gpu.checks.simgpu import SimulatedGpus; SimulatedGpus({str(sim.directory)!r}).hold([{g}], 1000); time.sleep(300)"])
                   for g in range(4)]
        time.sleep(1.0)
        # the installed copy first, the venv's site-packages (psutil, gi, ...) after it; no .pth, no editable hook
        deps = sysconfig.get_paths()["purelib"]
        env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent",
               "PYTHONPATH": f"{root / 'installed'}:{deps}"}
        # Debian's own interpreter, as /usr/bin/gpusupctl runs it (the venv's would also read the
        # editable install's .pth); the floor is the same interpreter doing nothing
        ctl = [PYTHON, "-m", "supervisord_gpu.cli.gpusupctl"]
        commands = {
            "gpus": [*ctl, "gpus", "--rehearsal", "--config-dir", str(cdir)],
            "check": [*ctl, "check", "tp4-512k", "--rehearsal", "--config-dir", str(cdir)],
            "status": [*ctl, "status", "--config-dir", str(cdir)],
        }
        try:
            samples: dict[str, list[float]] = {name: [] for name in [*commands, "python -c pass", *FLOORS]}
            for _ in range(RUNS):  # interleaved, so that a busy moment of the machine hits all alike
                for name, argv in commands.items():
                    samples[name].append(timed(argv, env))
                samples["python -c pass"].append(timed([PYTHON, "-c", "pass"], env))
                for name, code in FLOORS.items():
                    samples[name].append(timed([PYTHON, "-c", code], env))
        finally:
            for h in holders:
                h.kill()
                h.wait()
    floor = statistics.median(samples["python -c pass"])
    result: dict[str, object] = {
        "what": "8 simulated GPUs, 4 held by live processes; installed copy, byte-compiled; no system bus",
        **{f"gpusupctl_{name}_s": summary(s) for name, s in samples.items() if name in commands},
        "python_startup_s": summary(samples["python -c pass"]),
        "ratio_to_python": {name: statistics.median(samples[name]) / floor for name in commands},
        "dependency_floors_s": {name: summary(samples[name]) for name in FLOORS},
        "dependency_floors_ratio_to_python": {name: statistics.median(samples[name]) / floor for name in FLOORS},
        "target_ratio": 3.0,
    }
    path = write("gpus-latency", result)
    rows = [("command", "median", "x python -c pass")]
    rows += [(f"gpusupctl {n}", f"{statistics.median(samples[n]) * 1000:.0f} ms",
              f"{statistics.median(samples[n]) / floor:.1f}x") for n in commands]
    rows.append(("python3 -c pass", f"{floor * 1000:.0f} ms", "1.0x"))
    rows += [(f"python3 -c '{n}'", f"{statistics.median(samples[n]) * 1000:.0f} ms",
              f"{statistics.median(samples[n]) / floor:.1f}x") for n in FLOORS]
    print(table(rows))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
