"""Run every benchmark, print a table per benchmark, write bench/results/*.json."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCHMARKS = ["engine_latency", "gpus_latency", "scale", "teardown_vs_supervisord", "stop_under_traffic", "footprint",
              "systemd_bench", "cluster_bench"]

if __name__ == "__main__":
    chosen = sys.argv[1:] or BENCHMARKS
    for name in chosen:
        print(f"== {name}")
        importlib.import_module(name).main()
