"""Import SGLang's server path from an unpacked bundle and say what loaded: a trimmed bundle
(onecall_bundle.sh) must behave like the full one without spending a device call to find out.

    PYTHONPATH=SITE python3 bench/device/sglang_import_trace.py > trace.json

Needs a Python 3.12 with torch 2.11 (CUDA build; no GPU needed) and the packages the device
machine has. It imports the modules a PD prefill/decode and a plain server load at start-up,
builds SGLang's model registry (which imports every model file and logs each that fails), and
prints one JSON record: each module "ok" or its error, the registry's size, and any module of
the left-out parts (sglang.multimodal_gen, rust_extensions._bench) that got loaded. Compare the
records (and the registry's "Ignore import error" lines on stderr) of the full and the trimmed
bundle: they must be the same.
"""

from __future__ import annotations

import importlib
import json
import sys

SERVER_PATH = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.models.registry",
)
LEFT_OUT = ("sglang.multimodal_gen", "sglang.srt.rust_extensions._bench")


def main() -> int:
    record: dict[str, object] = {}
    for name in SERVER_PATH:
        try:
            importlib.import_module(name)
            record[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - any failure is the finding
            record[name] = f"{type(e).__name__}: {str(e)[:160]}"
    try:
        from sglang.srt.models.registry import ModelRegistry

        record["registry_models"] = len(ModelRegistry.models)
    except BaseException as e:  # noqa: BLE001
        record["registry_models"] = f"{type(e).__name__}: {str(e)[:160]}"
    record["left_out_loaded"] = sorted(k for k in sys.modules if k.startswith(LEFT_OUT))
    print(json.dumps(record, indent=1))
    return 0 if all(v == "ok" for k, v in record.items() if k in SERVER_PATH) and not record["left_out_loaded"] else 1


if __name__ == "__main__":
    sys.exit(main())
