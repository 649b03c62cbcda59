"""`gpusupctl gpus` against nvidia-smi on a real GPU: what an operator runs to ask "is it free?".

On the device machine (a real GPU, nvidia-ml-py, nvidia-smi):

    python3 bench/device/gpus_vs_nvidia_smi.py --out $OUT/gpus-vs-nvidia-smi-h200.json

With a torch process holding --hold-gib on GPU 0 (so both tools have a holder to report), each
command runs --runs times, interleaved, timed wall-clock from exec to exit:
  * `gpusupctl gpus` and `gpusupctl gpus --json` (NVML: memory, idle verdict, holders with
    user/cgroup/unit);
  * `nvidia-smi` (the default table, what people type);
  * `nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader` and
    `--query-compute-apps=pid,used_memory` (the scripted "nvidia-smi-style query");
  * `python3 -c pass` (interpreter start-up with this image's site: the floor any Python CLI pays),
    the same without site (-I -S), and `import argparse, tomllib, pynvml` (what gpusupctl cannot avoid);
  * `gpusupctl gpus` and those imports again without the image's site (-S, the package and its
    dependencies on PYTHONPATH): what the command costs where site is cheap, as on Debian.
gpusupctl runs byte-compiled, as it is once installed (the .deb byte-compiles on install, pip
does too): the device image sets PYTHONDONTWRITEBYTECODE=1 and ships pynvml and psutil without
bytecode, so the benchmark gives gpusupctl a private PYTHONPYCACHEPREFIX and warms it once.
The same command without bytecode is reported too ("as this image runs it").
Reported: medians and the ratio of each to `gpusupctl gpus`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from common import machine, summary  # noqa: E402
from gpu_nvml_idle import start_hog  # noqa: E402  (a torch process holding GiB on one GPU)

def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str, int]:
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - began, done.stdout, done.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--hold-gib", type=float, default=10.0)
    args = ap.parse_args()

    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    base.update(PYTHONPATH=str(ROOT), DBUS_SYSTEM_BUS_ADDRESS="unix:path=/nonexistent")
    compiled = {**base, "PYTHONPYCACHEPREFIX": tempfile.mkdtemp(prefix="gpusup-pycache-")}
    as_image = {**base, "PYTHONDONTWRITEBYTECODE": "1"}
    ctl = [sys.executable, "-m", "supervisord_gpu.cli.gpusupctl"]
    # Without this image's site (-S): its site-packages hold torch's stack and cost ~60 ms at every
    # start (see "python3 -c pass" against "-I -S"); a Debian host's /usr/bin/python3 has a small
    # one. Our package, pynvml and psutil are then on PYTHONPATH only (no .pth is read).
    import sysconfig

    paths = sysconfig.get_paths()
    lean = {**compiled, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(ROOT), paths["purelib"], paths["platlib"]]))}
    ctl_lean = [sys.executable, "-S", "-m", "supervisord_gpu.cli.gpusupctl"]
    cfg = ["--config-dir", str(ROOT / "etc" / "supervisord-gpu")]
    smi = shutil.which("nvidia-smi") or "nvidia-smi"
    commands: dict[str, tuple[list[str], dict[str, str]]] = {
        "gpusupctl gpus": (ctl + ["gpus"] + cfg, compiled),
        "gpusupctl gpus --json": (ctl + ["gpus", "--json"] + cfg, compiled),
        "gpusupctl gpus, no bytecode (as this image runs it)": (ctl + ["gpus"] + cfg, as_image),
        "nvidia-smi": ([smi], base),
        "nvidia-smi --query-gpu": ([smi, "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader"], base),
        "nvidia-smi --query-compute-apps": ([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                                            base),
        "python3 -c pass": ([sys.executable, "-c", "pass"], compiled),
        # what `gpusupctl gpus` cannot avoid importing, alone: the standard library's argument
        # parser and TOML reader, and NVML's bindings (the owner's fixed dependencies)
        "python3 -c 'import argparse, tomllib, pynvml'": ([sys.executable, "-c", "import argparse, tomllib, pynvml"], compiled),
        "python3 -I -S -c pass (no site)": ([sys.executable, "-I", "-S", "-c", "pass"], compiled),
        "gpusupctl gpus, no site (-S)": (ctl_lean + ["gpus"] + cfg, lean),
        # NVML's bindings alone (the owner's fixed pynvml): no Python CLI reading NVML through them is quicker
        "python3 -S -c 'import pynvml'": ([sys.executable, "-S", "-c", "import pynvml"], lean),
        "python3 -S -c 'import argparse, tomllib, pynvml, psutil'": (
            [sys.executable, "-S", "-c", "import argparse, tomllib, pynvml, psutil"], lean),
    }
    hog = start_hog("0", args.hold_gib)
    samples: dict[str, list[float]] = {k: [] for k in commands}
    outputs: dict[str, str] = {}
    codes: dict[str, int] = {}
    try:
        for name, (argv, env) in commands.items():  # one warm-up each (bytecode, page cache)
            _, outputs[name], codes[name] = timed(argv, env)
        for _ in range(args.runs):
            for name, (argv, env) in commands.items():
                took, _, _ = timed(argv, env)
                samples[name].append(took)
    finally:
        hog.kill()
        hog.wait()
    ours = summary(samples["gpusupctl gpus"])["median"]
    verdict = json.loads(outputs["gpusupctl gpus --json"]) if codes["gpusupctl gpus --json"] in (0, 3) else None
    result = {
        "machine": {**machine(), "device": os.environ.get("DEVICE_NAME", "NVIDIA H200")},
        "what": f"wall time exec -> exit, {args.runs} interleaved runs each, a torch process holding "
                f"{args.hold_gib:g} GiB on GPU 0",
        "seconds": {k: summary(v) for k, v in samples.items()},
        "ratio_to_gpusupctl_gpus": {k: summary(v)["median"] / ours for k, v in samples.items()},
        "exit_codes": codes,
        "gpusupctl_gpus_output": outputs["gpusupctl gpus"],
        "gpusupctl_gpus_json": verdict,
        "nvidia_smi_output": outputs["nvidia-smi"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    width = max(map(len, commands))
    for k, v in samples.items():
        m = summary(v)["median"]
        print(f"{k.ljust(width)}  {m * 1000:7.1f} ms  {m / ours:5.2f}x of gpusupctl gpus")
    print(outputs["gpusupctl gpus"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
