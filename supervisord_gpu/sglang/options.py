"""SGLang 0.5.23's command line: every option name, how many values it takes, its type.

The option names come from data/sglang-0.5.23-flags.txt (a copy of the reference list read
from SGLang's own parser). A name list alone cannot say which options take no value, so the
tables below were read from SGLang 0.5.23's parser (its arg_groups field declarations, built
with argparse). Production validates profiles against this table when SGLang is not installed
(`supervisord_gpu.sglang.flags`); the rehearsal stand-in parses its command line with it, so
both reject exactly what the real parser rejects.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from collections.abc import Sequence

SGLANG_VERSION = "0.5.23"
FLAGS_FILE = "sglang-0.5.23-flags.txt"

# Everything not listed below takes exactly one value.

# store_true (and the deprecated store-true spellings): no value.
_ZERO_ARG = frozenset("--" + n for n in """
abort-on-priority-when-disabled allow-auto-truncate checkpoint-engine-wait-weights-before-ready
constrained-json-disable-any-whitespace debug-cuda-graph delete-ckpt-after-loading
disable-aiter-allreduce-fusion-in-decode disable-aiter-allreduce-fusion-in-prefill
disable-attn-tp-gather disable-chunked-prefix-cache disable-cuda-graph disable-cuda-graph-padding
disable-custom-all-reduce disable-decode-cuda-graph disable-fast-image-processor
disable-flashinfer-autotune disable-flashinfer-cutlass-moe-fp4-allgather disable-hybrid-swa-memory
disable-outlines-disk-cache disable-overlap-schedule disable-prefill-cuda-graph
disable-priority-preemption disable-radix-cache disable-shared-experts-fusion
disable-tokenizer-batch-decode disaggregation-decode-enable-offload-kvcache
disaggregation-decode-enable-radix-cache disaggregation-enable-kv-checksum
enable-adaptive-dispatch-to-encoder enable-aiter-allreduce-fusion enable-amd-monokernel
enable-attn-tp-input-scattered enable-broadcast-mm-inputs-process enable-cache-report
enable-cp-decode-attn-tp enable-cudagraph-gc enable-custom-logit-processor
enable-deepseek-v4-fp4-indexer enable-dense-mlp-attn-tp enable-deterministic-inference
enable-dp-attention enable-dp-attention-local-control-broadcast enable-dp-lm-head
enable-draft-weights-cpu-backup enable-dsa-cache-layer-split enable-dynamic-batch-tokenizer
enable-dynamic-chunking enable-elastic-expert-backup enable-encoder-swa-bounded-replay enable-eplb
enable-flashinfer-allreduce-fusion enable-flexkv enable-forward-pass-metrics enable-fp32-lm-head
enable-fused-moe-sum-all-reduce enable-hierarchical-cache enable-hisparse
enable-http-worker-reuseport enable-http2 enable-int8-mamba-checkpoint enable-kv-cache-sharding
enable-layernorm-sp enable-layerwise-nvtx-marker enable-lean-attention enable-linear-replayssm
enable-linear-replayssm-spec enable-linker-mla-dedup enable-lmcache enable-lora
enable-lora-overlap-loading enable-mamba-cache-stochastic-rounding enable-megamoe-for-layernorm-sp
enable-memory-saver enable-metrics enable-metrics-for-all-schedulers enable-mfu-metrics enable-mis
enable-mixed-chunk enable-mm-global-cache enable-mscclpp enable-multi-layer-eagle enable-multimodal
enable-nccl-nvls enable-nvidia-megakernel enable-p2p-check enable-page-major-kv-layout
enable-paged-experts enable-pd-role-switch enable-pdmux enable-precise-embedding-interpolation
enable-prefill-cp enable-prefill-delayer enable-prefix-mm-cache enable-priority-scheduling
enable-profile-cuda-graph enable-quant-communications enable-request-time-stats-logging
enable-response-store enable-return-aux-hidden-states enable-return-hidden-states
enable-return-indexer-topk enable-return-routed-experts enable-scattered-sconv
enable-session-radix-cache enable-shared-experts-attn-tp enable-single-batch-overlap
enable-ssl-refresh enable-streaming-session enable-strict-thinking enable-symm-mem
enable-tokenizer-batch-encode enable-torch-compile enable-torch-compile-debug-mode
enable-torch-symm-mem enable-trace enable-two-batch-overlap enable-unified-cache-external-linker
enable-unified-memory enable-w4a4-mxfp4-megamoe enable-waterfill enable-watermark
enable-weights-cpu-backup encoder-only enforce-disable-flashinfer-allreduce-fusion
enforce-shared-experts-fusion export-metrics-to-file flashinfer-mla-disable-ragged grpc-mode
incremental-streaming-output is-embedding language-model-only language-only log-requests
lora-use-virtual-experts mlx-enable-sampling pre-warm-nccl prefill-only-disable-kv-cache
quantize-and-serve remote-instance-weight-loader-start-seed-via-transfer-engine return-input-ids
return-output-ids schedule-low-priority-values-first show-time-cost skip-server-warmup
skip-tokenizer-init sleep-on-idle smg-grpc-mode speculative-adaptive
speculative-dspark-align-verify-tokens-to-graph-tier speculative-use-block-verification
speculative-use-rejection-sampling stream-response-default-include-usage strip-thinking-cache
triton-attention-reduce-in-fp32 trust-mm-content-hashes trust-remote-code
trust-request-chat-template use-ray weight-loader-disable-mmap weight-loader-drop-cache-after-load
weight-loader-prefetch-checkpoints
""".split())

# argparse.BooleanOptionalAction: --X and --no-X, no value.
_NEGATABLE = frozenset("--" + n for n in """
dcp-replicate-q-proj dllm-fdfo enable-decoder-swa-bounded-replay enable-dsa-fused-indexer
enable-fused-qk-norm-rope enable-tf32-matmul enable-tp-lm-head-all-to-all experts-shared-outer-loras
lora-strict-loading mm-enable-dp-encoder ple-offload-embedding speculative-enable-w4a4-mxfp4-megamoe
""".split())

# List-valued options.
_MULTI_ARG: dict[str, str] = {
    "--allowed-media-domains": "+", "--bucket-e2e-request-latency": "+",
    "--bucket-inter-token-latency": "+", "--bucket-time-to-first-token": "+",
    "--cuda-graph-bs-decode": "+", "--cuda-graph-bs-prefill": "+", "--custom-weight-loader": "*",
    "--debug-tensor-dump-layers": "+", "--encoder-register-urls": "+", "--encoder-urls": "+",
    "--flashinfer-autotune-skip-ops": "+", "--gc-threshold": "+", "--generation-tokens-buckets": "+",
    "--log-requests-target": "+", "--lora-paths": "*", "--lora-target-modules": "*",
    "--model-checksum": "?", "--numa-node": "+", "--prefill-delayer-forward-passes-buckets": "+",
    "--prefill-delayer-wait-seconds-buckets": "+", "--prompt-tokens-buckets": "+",
    "--return-aux-hidden-state-layer-ids": "+", "--tokenizer-metrics-allowed-custom-labels": "+",
    "--uvicorn-access-log-exclude-prefixes": "*",
}

# Second spellings of the same option (not in the reference list, accepted by SGLang).
_ALIASES: dict[str, tuple[str, ...]] = {
    "--model-path": ("--model",),
    "--tp-size": ("--tensor-parallel-size",),
    "--dp-size": ("--data-parallel-size",),
    "--pp-size": ("--pipeline-parallel-size",),
    "--ep-size": ("--expert-parallel-size", "--ep"),
    "--dcp-size": ("--decode-context-parallel-size",),
    "--attn-dp-size": ("--attention-data-parallel-size",),
    "--attn-cp-size": ("--attention-context-parallel-size",),
    "--moe-dp-size": ("--moe-data-parallel-size",),
    "--dist-init-addr": ("--nccl-init-addr",),
    "--enable-hierarchical-cache": ("--enable-hicache",),
    "--hisparse-config": ("--hierarchical-sparse-attention-extra-config",),
    "--cuda-graph-prefill-max-context": ("--context-bucket",),
    "--smg-http-sidecar-port": ("--grpc-http-sidecar-port",),
    "--speculative-draft-model-path": ("--speculative-draft-model",),
}

# Real 0.5.23 options missing from the reference list (hidden from --help there).
_EXTRA_OPTIONS = ("--forward-pass-metrics-ipc-name", "--forward-pass-metrics-worker-id")


def human_readable_int(value: str) -> int:
    """SGLang's integer parser: SI suffixes (512k = 512000), IEC suffixes (512Ki = 524288)."""
    import re
    from decimal import Decimal

    value = value.strip()
    si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if m:
        number, suffix = m.groups()
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError(f"Decimals are not allowed with IEC suffixes like '{suffix}'.")
            return int(number) * iec[suffix]
        return int(Decimal(number) * si[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. Use a plain integer, SI suffixes (1k, 1M), "
            "or IEC suffixes (1Ki, 1Mi). Suffixes are case-sensitive."
        ) from None


# Types, choices and defaults of the options the stand-in reads; the rest stay strings
# (default None, or False for the no-value ones), which is all a stand-in needs.
_TYPES: dict[str, Any] = {
    "--port": int, "--tp-size": int, "--dp-size": int, "--pp-size": int, "--ep-size": int,
    "--base-gpu-id": int, "--gpu-id-step": int, "--disaggregation-bootstrap-port": int,
    "--nnodes": int, "--node-rank": int, "--nccl-port": int, "--random-seed": int,
    "--context-length": human_readable_int, "--max-prefill-tokens": human_readable_int,
    "--chunked-prefill-size": human_readable_int, "--max-total-tokens": human_readable_int,
    "--max-running-requests": int, "--mem-fraction-static": float, "--watchdog-timeout": float,
    "--attn-dp-size": int, "--page-size": int, "--cuda-graph-max-bs-decode": int,
    "--cuda-graph-max-bs-prefill": int, "--dist-timeout": int,
}
_CHOICES: dict[str, list[str]] = {
    "--disaggregation-mode": ["null", "prefill", "decode"],
    "--disaggregation-transfer-backend": ["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"],
    "--dtype": ["auto", "half", "float16", "bfloat16", "float", "float32"],
    "--kv-cache-dtype": ["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"],
    "--monokernel-backend": ["amd"],
}
_DEFAULTS: dict[str, Any] = {
    "--host": "127.0.0.1", "--port": 30000, "--tp-size": 1, "--dp-size": 1, "--pp-size": 1,
    "--ep-size": 1, "--attn-dp-size": 1, "--base-gpu-id": 0, "--gpu-id-step": 1, "--nnodes": 1,
    "--node-rank": 0, "--disaggregation-mode": "null", "--disaggregation-bootstrap-port": 8998,
    "--disaggregation-transfer-backend": "mooncake", "--log-level": "info", "--watchdog-timeout": 300,
    "--dtype": "auto", "--kv-cache-dtype": "auto", "--load-format": "auto",
    "--max-prefill-tokens": 16384, "--load-balance-method": "auto", "--schedule-policy": "fcfs",
    "--weight-version": "default", "--tokenizer-mode": "auto", "--encoder-bootstrap-port": 8997,
    "--engine-info-bootstrap-port": 6789,
}


def reference_options() -> list[str]:
    """SGLang 0.5.23's option names, from the packaged copy of the reference list.

    A path relative to the package (installed as package data) rather than
    importlib.resources, which alone costs ~10 ms of start-up.
    """
    text = (Path(__file__).resolve().parent.parent / "data" / FLAGS_FILE).read_text()
    return [line.strip() for line in text.splitlines() if line.strip().startswith("--")]


class _Parser(argparse.ArgumentParser):
    """argparse with full names only, plus SGLang's "ambiguous option" message.

    allow_abbrev=False rejects `--tp 4` (real 0.5.23 would take it as --tp-size 4: a
    profile must spell options in full). A prefix of several options, such as the removed
    `--cuda-graph-max-bs`, gets the message the real parser prints for it.
    """

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        known = self._option_string_actions
        for token in argv:
            if token == "--":
                break
            if not token.startswith("--"):
                continue
            name = token.split("=", 1)[0]
            if name in known:
                continue
            matches = sorted(o for o in known if o.startswith(name))
            if len(matches) > 1:
                self.error(f"ambiguous option: {name} could match {', '.join(matches)}")
        return super().parse_known_args(argv, namespace)


def build_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.23's command line, as far as names and value counts go."""
    parser = _Parser(
        prog="launch_server.py",
        usage="%(prog)s [-h] --model-path MODEL_PATH [options]  (SGLang 0.5.23 stand-in)",
        allow_abbrev=False,
        description="Stand-in for `python -m sglang.launch_server` (supervisord-gpu rehearsal).",
    )
    names = reference_options()
    for extra in _EXTRA_OPTIONS:
        if extra not in names:
            names.append(extra)
    for name in names:
        spellings = [name, *_ALIASES.get(name, ())]
        dest = name[2:].replace("-", "_")
        if name in _NEGATABLE:
            parser.add_argument(*spellings, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        elif name in _ZERO_ARG:
            parser.add_argument(*spellings, dest=dest, action="store_true", default=False)
        else:
            kwargs: dict[str, Any] = {"dest": dest, "default": _DEFAULTS.get(name)}
            if name in _MULTI_ARG:
                kwargs["nargs"] = _MULTI_ARG[name]
            if name in _TYPES:
                kwargs["type"] = _TYPES[name]
            if name in _CHOICES:
                kwargs["choices"] = _CHOICES[name]
            parser.add_argument(*spellings, **kwargs)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like SGLang: exits 2 with argparse's message on a bad command line."""
    return build_parser().parse_args(list(argv))
