"""Stand-in for `python -m sglang.launch_server` (SGLang 0.5.23), for tests and rehearsal.

SGLang cannot run without GPUs, so the supervisor is tested (and rehearsed, in the
product's no-GPU mode) against this imitation. It copies what a supervisor can see and
must cope with, and nothing else:

* the command line: SGLang's exact option names (the 529 of 0.5.23 plus their aliases),
  parsed with full names only; unknown options and the removed `--cuda-graph-max-bs`
  exit 2 with argparse's "unrecognized arguments" / "ambiguous option" errors;
* the HTTP port opens at once, /health and /ready answer 503 while "loading" and after
  SIGTERM, 200 once loaded; /v1/models answers 200 before that (not a readiness signal);
* the start-up log phases of sglang-server.md, each line "[YYYY-MM-DD HH:MM:SS TP0] ...";
* detached scheduler processes: one per rank (at most 8), each double-forked into its
  own session so it is re-parented to PID 1 (or the nearest subreaper). Those detached
  grandchildren hold the simulated GPU memory. A graceful SIGTERM stops them; any other
  death of the main process (SIGKILL, crash faults) leaves them alive, holding memory,
  which is the upstream bug (SGLang issue 23627) a supervisor must survive: only killing
  the whole cgroup frees the GPUs. A scheduler killed from outside makes the main process
  exit 1 (SGLang's SIGQUIT path), leaving the other schedulers where they are.

Command line: exactly SGLang's. Stand-in-only settings come from the environment:

    SUPERVISORD_GPU_STANDIN_STARTUP_S   seconds of "loading" before ready (float, default 3.0)
    SUPERVISORD_GPU_STANDIN_MIB         MiB held per GPU once loaded (default 100000)
    SUPERVISORD_GPU_SIMGPU_DIR          simulated GPU directory (checks/simgpu.py); unset:
                                        hold no GPU memory and check nothing
    SUPERVISORD_GPU_STANDIN_FAULT       one fault to inject (see `Fault`):
        crash-on-start                  exit 1 half-way through start-up
        never-ready                     /health 503 forever
        crash-after-ready:SECONDS       exit 1 that long after becoming ready
        hang-on-term                    log SIGTERM, then ignore it; /health stops answering
        exit-on-term-slow:SECONDS       graceful SIGTERM path that takes SECONDS to exit
    SUPERVISORD_GPU_STANDIN_READY_FILE  append time.time() when /health first answers 200
    SUPERVISORD_GPU_STANDIN_READY_AT_FILE  append time.time() when it becomes able to answer 200
    SUPERVISORD_GPU_STANDIN_TOKEN_S     seconds per generated token in /generate (default 0)
    SUPERVISORD_GPU_STANDIN_TORCH_MIB   on a real GPU: each scheduler also allocates this many
                                        MiB with torch on its GPU (device machine only)

GPUs used: CUDA_VISIBLE_DEVICES (physical indices or simulated UUIDs, as the supervisor
sets it) indexed from --base-gpu-id, else range(base_gpu_id, base_gpu_id + tp*dp*pp).
With a simulated GPU directory the stand-in also fails like SGLang would: a GPU index that
does not exist is "invalid device ordinal", and too little free memory on a GPU (others'
live holdings) is a CUDA out-of-memory crash at "Load weight". Those genuine failures stop
the schedulers before exiting 1; injected crash faults do not (see above).

Everything is standard library plus psutil (through simgpu), so a start costs tens of
milliseconds and ~20 MB: tests run up to 64 of these on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Sequence

from supervisord_gpu.rehearsal._http import (
    JSONHandler,
    SignalLatch,
    StandinHTTPServer,
    bind_or_exit,
    log,
    serve_in_thread,
    set_process_name,
)

SGLANG_VERSION = "0.5.23"

ENV_STARTUP_S = "SUPERVISORD_GPU_STANDIN_STARTUP_S"
ENV_MIB = "SUPERVISORD_GPU_STANDIN_MIB"
ENV_SIMGPU_DIR = "SUPERVISORD_GPU_SIMGPU_DIR"  # same name as checks.simgpu.ENV_DIR
ENV_FAULT = "SUPERVISORD_GPU_STANDIN_FAULT"
ENV_READY_FILE = "SUPERVISORD_GPU_STANDIN_READY_FILE"
ENV_READY_AT_FILE = "SUPERVISORD_GPU_STANDIN_READY_AT_FILE"
ENV_TOKEN_S = "SUPERVISORD_GPU_STANDIN_TOKEN_S"
ENV_TORCH_MIB = "SUPERVISORD_GPU_STANDIN_TORCH_MIB"

DEFAULT_STARTUP_S = 3.0
DEFAULT_MIB = 100000
FAULT_KINDS = ("crash-on-start", "hang-on-term", "never-ready", "crash-after-ready", "exit-on-term-slow")
MAX_SCHEDULERS = 8
SCHEDULER_STOP_WAIT_S = 15.0  # like SGLang: tell schedulers to exit, wait 15 s, SIGKILL stragglers
FLAGS_FILE = "sglang-0.5.23-flags.txt"

# --- How each option parses -------------------------------------------------------------
# The option names come from data/sglang-0.5.23-flags.txt (a copy of the reference list).
# A name list alone cannot say which options take no value, so these tables were read from
# SGLang 0.5.23's own parser (its arg_groups field declarations, built with argparse).
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
    "--cuda-graph-max-bs-prefill": int,
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

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
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


# --- Stand-in settings (environment) ----------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """An injected failure: `kind` is one of FAULT_KINDS, `seconds` its parameter."""

    kind: str
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> "Fault | None":
        if not text:
            return None
        kind, _, arg = text.strip().partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        needs_seconds = kind in ("crash-after-ready", "exit-on-term-slow")
        if needs_seconds != bool(arg):
            raise ValueError(f"fault {kind!r} {'needs' if needs_seconds else 'takes no'} ':SECONDS'")
        return cls(kind, float(arg) if arg else 0.0)


@dataclass(frozen=True)
class Settings:
    """What the environment tells the stand-in (the command line stays SGLang's)."""

    startup_s: float = DEFAULT_STARTUP_S
    mib: int = DEFAULT_MIB
    simgpu_dir: str | None = None
    fault: Fault | None = None
    ready_file: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str]) -> "Settings":
        return cls(
            startup_s=float(env.get(ENV_STARTUP_S) or DEFAULT_STARTUP_S),
            mib=int(float(env.get(ENV_MIB) or DEFAULT_MIB)),
            simgpu_dir=env.get(ENV_SIMGPU_DIR) or None,
            fault=Fault.parse(env.get(ENV_FAULT)),
            ready_file=env.get(ENV_READY_FILE) or None,
        )


class StartupError(Exception):
    """A failure SGLang would also hit (bad device, out of memory): exit 1, schedulers stopped."""


def resolve_gpus(args: argparse.Namespace, env: dict[str, str] | os._Environ[str],
                 uuids: dict[str, int] | None = None) -> list[int]:
    """Physical GPU indices this server uses.

    SGLang uses devices base_gpu_id .. base_gpu_id + world - 1 (step --gpu-id-step) of
    the visible ones; CUDA_VISIBLE_DEVICES maps those to physical devices.
    """
    world = max(1, args.tp_size * args.dp_size * (args.pp_size or 1))
    step = args.gpu_id_step or 1
    logical = [args.base_gpu_id + i * step for i in range(world)]
    visible_text = env.get("CUDA_VISIBLE_DEVICES")
    if visible_text is None:
        return logical
    visible: list[int] = []
    for token in (t.strip() for t in visible_text.split(",")):
        if not token:
            continue
        if token.lstrip("-").isdigit():
            index = int(token)
            if index < 0:
                break  # CUDA stops at the first invalid entry
            visible.append(index)
        elif uuids is not None and token in uuids:
            visible.append(uuids[token])
        else:
            break
    if not visible:
        raise StartupError("RuntimeError: No CUDA GPUs are available")
    if max(logical) >= len(visible):
        raise StartupError(
            f"torch.AcceleratorError: CUDA error: invalid device ordinal "
            f"(needs visible device {max(logical)}, CUDA_VISIBLE_DEVICES={visible_text!r})"
        )
    return [visible[i] for i in logical]


# --- Detached schedulers ----------------------------------------------------------------


@dataclass
class Scheduler:
    """A detached scheduler: its pid (not our child), our end of its pipe, its GPUs."""

    rank: int
    pid: int
    wfd: int
    gpus: list[int] = field(default_factory=list)
    ack_fd: int = -1  # readable once its real GPU memory (torch mode) is allocated


def _hold_real_gpu_memory(rank: int) -> object | None:
    """On a real GPU (the device machine only): allocate SUPERVISORD_GPU_STANDIN_TORCH_MIB with torch.

    Rank r uses the r-th GPU of CUDA_VISIBLE_DEVICES, as SGLang's TP rank r does. The
    memory is freed by the driver when this process dies, and only then.
    """
    mib = int(os.environ.get(ENV_TORCH_MIB) or 0)
    if mib <= 0:
        return None
    import torch  # the parent never imports it: CUDA must not be initialised before a fork

    torch.cuda.set_device(rank)
    buf = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    return buf


def _scheduler_process(rfd: int, name: str, rank: int = 0, ack_w: int = -1) -> NoReturn:
    """Body of a detached stand-in scheduler: sleep until told to exit.

    It stands in for `sglang::scheduler_TP<n>` and is deliberately cheap: a forked copy
    of the parent (no exec, no new imports) that blocks on a pipe. A b"q" on the pipe is
    the graceful stop; end-of-file without it means the main process died abruptly, and
    then it stays alive on purpose, like the schedulers that escape upstream.
    """
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    set_process_name(name)
    try:
        import gc

        gc.disable()  # touch as few copy-on-write pages as possible
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # never keep the log pipe open: a reader would never see EOF
        held = _hold_real_gpu_memory(rank)  # noqa: F841  (kept alive until this process dies)
        if ack_w >= 0:
            os.write(ack_w, b"1")  # "weights loaded": the main process may go on
        os.closerange(3, rfd)
        os.closerange(rfd + 1, 65536)
        while True:
            try:
                data = os.read(rfd, 1)
            except InterruptedError:
                continue
            if data == b"q":
                os._exit(0)
            if data == b"":
                break
        while True:
            signal.pause()
    finally:
        os._exit(0)


def spawn_scheduler(rank: int, gpus: list[int], name: str) -> Scheduler:
    """Double-fork a detached scheduler in its own session; return its pid.

    The middle child calls setsid() and forks again, then exits, so the scheduler is
    re-parented to PID 1 (or the nearest subreaper): tree walks, parent-PID kills and
    process-group kills of the server do not reach it, only its cgroup does.
    """
    rfd, wfd = os.pipe()
    report_r, report_w = os.pipe()
    ack_r, ack_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:  # middle child
        try:
            os.close(wfd)
            os.close(report_r)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                os.close(report_w)
                os.close(ack_r)
                _scheduler_process(rfd, name, rank, ack_w)
            os.write(report_w, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(rfd)
    os.close(report_w)
    os.close(ack_w)
    chunks = []
    while True:
        chunk = os.read(report_r, 32)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(report_r)
    os.waitpid(middle, 0)
    os.set_inheritable(wfd, False)
    os.set_inheritable(ack_r, False)
    return Scheduler(rank=rank, pid=int(b"".join(chunks)), wfd=wfd, gpus=gpus, ack_fd=ack_r)


def _pid_gone(pid: int) -> bool:
    """True when pid is dead or a zombie (a zombie holds no GPU memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


# --- The server -------------------------------------------------------------------------


class StandinServer:
    """One stand-in SGLang server: HTTP front, start-up script, schedulers, shutdown."""

    def __init__(self, args: argparse.Namespace, settings: Settings, argv: Sequence[str]) -> None:
        self.args = args
        self.settings = settings
        self.argv = list(argv)
        self.served_model_name = args.served_model_name or args.model_path
        self.context_len = args.context_length or 131072
        self.is_generation = not args.is_embedding
        self.pd_mode = args.disaggregation_mode
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.draining = False
        self.hung = False
        self.term: SignalLatch | None = None
        self.first_health_200 = False
        self.token_s = float(os.environ.get(ENV_TOKEN_S) or 0.0)
        self.schedulers: list[Scheduler] = []
        self.gpus: list[int] = []
        self.http: StandinHTTPServer | None = None
        self.bootstrap: StandinHTTPServer | None = None
        self.startup_time: float | None = None
        self.max_total_num_tokens: int | None = None
        self.stats = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.sim: Any = None
        self.total_mib = 143771
        self.reserved_mib = 615

    # -- lifecycle ----------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        self.http = bind_or_exit(a.host, a.port, _make_handler(self), "HTTP server")
        if a.model_path is None:
            log("ValueError: --model-path is required", tag=None, stream=sys.stderr)
            return 1
        try:
            self._prepare_gpus()
        except StartupError as e:
            log(str(e), stream=sys.stderr)
            return 1
        # Handlers first: a SIGTERM during the forks takes the graceful path too (the
        # schedulers reset them to the default).
        self.term = SignalLatch(signal.SIGTERM, signal.SIGINT)
        n = max(1, min(MAX_SCHEDULERS, len(self.gpus)))
        per = -(-len(self.gpus) // n)  # contiguous chunks when more GPUs than schedulers
        for rank in range(n):
            title = f"sglang::scheduler_TP{rank}"
            self.schedulers.append(spawn_scheduler(rank, self.gpus[rank * per:(rank + 1) * per], title))
        # Threads start only after the forks: forking a threaded process is unsafe.
        serve_in_thread(self.http, "http")
        log(f"Uvicorn running on http://{a.host}:{a.port} (Press CTRL+C to quit)", tag=None)
        try:
            code = self._start_up()
            if code is not None:
                return code
            return self._serve_until_stopped()
        except StartupError as e:
            log(str(e), stream=sys.stderr)
            self._stop_schedulers()
            return 1

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless SIGTERM comes first; True when it did."""
        assert self.term is not None
        return self.term.wait(max(0.0, seconds))

    def _prepare_gpus(self) -> None:
        uuids = None
        if self.settings.simgpu_dir:
            from supervisord_gpu.checks.simgpu import SimulatedGpus

            self.sim = SimulatedGpus(self.settings.simgpu_dir)
            if not self.sim.exists():
                raise StartupError(f"RuntimeError: No CUDA GPUs are available "
                                   f"(no simulated GPUs in {self.settings.simgpu_dir})")
            devices = self.sim.devices()
            uuids = {d.uuid: d.index for d in devices}
            by_index = {d.index: d for d in devices}
            self.gpus = resolve_gpus(self.args, os.environ, uuids)
            for g in self.gpus:
                if g not in by_index:
                    raise StartupError(f"torch.AcceleratorError: CUDA error: invalid device ordinal (GPU {g})")
            first = by_index[self.gpus[0]]
            self.total_mib, self.reserved_mib = first.total_mib, first.reserved_mib
        else:
            self.gpus = resolve_gpus(self.args, os.environ)

    def _free_mib(self, gpu: int) -> int:
        """Free MiB on `gpu` counting everyone's live holdings but our schedulers'."""
        ours = {s.pid for s in self.schedulers}
        used = sum(h.mib for h in self.sim.holders() if gpu in h.gpus and h.pid not in ours)
        return self.total_mib - self.reserved_mib - used

    def _wait_real_allocations(self) -> None:
        """Torch mode: like SGLang, weights are in GPU memory before "Load weight end"."""
        wait = bool(int(os.environ.get(ENV_TORCH_MIB) or 0))
        for sched in self.schedulers:
            if sched.ack_fd >= 0:
                if wait:
                    os.read(sched.ack_fd, 1)  # b"" if it died: then it holds nothing either
                os.close(sched.ack_fd)
                sched.ack_fd = -1

    def _hold(self, fraction: float) -> None:
        """Make each scheduler hold `fraction` of the configured MiB on its GPUs."""
        if self.sim is None:
            return
        mib = int(self.settings.mib * fraction)
        for s in self.schedulers:
            try:
                self.sim.hold(s.gpus, mib, pid=s.pid)
            except Exception:  # scheduler already gone (killed from outside)
                pass

    def _avail_gb(self, held_fraction: float) -> float:
        if self.sim is None:
            return (self.total_mib - self.reserved_mib - self.settings.mib * held_fraction) / 1024
        return (self._free_mib(self.gpus[0]) - self.settings.mib * held_fraction) / 1024

    def _start_up(self) -> int | None:
        """The loading script; returns an exit code when start-up ends the process."""
        a, s = self.args, self.settings
        total = s.startup_s
        fault = s.fault
        t0 = time.monotonic()

        def until(fraction: float) -> bool:
            return self._sleep(t0 + total * fraction - time.monotonic())

        log(f"server_args=ServerArgs(model_path={a.model_path!r}, tp_size={a.tp_size}, dp_size={a.dp_size}, "
            f"host={a.host!r}, port={a.port}, disaggregation_mode={a.disaggregation_mode!r}, "
            f"base_gpu_id={a.base_gpu_id}, ...)  [stand-in, GPUs {self.gpus}]", tag=None)
        log("Init torch distributed begin.")
        if until(0.05):
            return self._graceful_stop()
        log("Init torch distributed ends. elapsed=0.05 s, mem usage=0.00 GB")
        if self.sim is not None:
            for g in self.gpus:
                free = self._free_mib(g)
                if free < s.mib:
                    raise StartupError(
                        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {s.mib / 1024:.2f} GiB. "
                        f"GPU {g} has a total capacity of {self.total_mib / 1024:.2f} GiB of which "
                        f"{max(free, 0) / 1024:.2f} GiB is free. (stand-in: other processes hold the rest)")
        avail0 = self._avail_gb(0.0)
        log(f"Load weight begin. avail mem={avail0:.2f} GB")
        if fault and fault.kind == "crash-on-start":
            if until(0.5):
                return self._graceful_stop()
            log("Scheduler hit an exception: RuntimeError: injected fault crash-on-start", stream=sys.stderr)
            return self._sigquit_exit()  # a crash frees nothing: schedulers left running
        if until(0.45):
            return self._graceful_stop()
        self._hold(0.45)
        self._wait_real_allocations()
        avail1 = self._avail_gb(0.45)
        log(f"Load weight end. elapsed={total * 0.40:.2f} s, type=LlamaForCausalLM, dtype=torch.bfloat16, "
            f"avail mem={avail1:.2f} GB, mem usage={avail0 - avail1:.2f} GB.")
        if until(0.6):
            return self._graceful_stop()
        self._hold(0.95)
        kv_gb = s.mib * 0.50 / 1024
        tokens = int(kv_gb * 1024**3 / (160 * 1024))
        self.max_total_num_tokens = tokens
        log(f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, "
            f"K size: {kv_gb / 2:.2f} GB, V size: {kv_gb / 2:.2f} GB")
        avail2 = self._avail_gb(0.95)
        log(f"Memory pool end. avail mem={avail2:.2f} GB")
        log(f"max_total_num_tokens={tokens}, chunked_prefill_size={a.chunked_prefill_size or 8192}, "
            f"max_prefill_tokens={a.max_prefill_tokens}, max_running_requests={a.max_running_requests or 2048}, "
            f"context_len={self.context_len}, available_gpu_mem={avail2:.2f} GB")
        if until(0.7):
            return self._graceful_stop()
        log(f"Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem={avail2:.2f} GB")
        if until(0.95):
            return self._graceful_stop()
        self._hold(1.0)
        avail3 = self._avail_gb(1.0)
        bs = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256]
        log(f"Capture target decode CUDA graph end. bs={bs}, elapsed={total * 0.25:.2f} s, "
            f"mem usage={avail2 - avail3:.2f} GB, avail mem={avail3:.2f} GB.")
        if self.pd_mode == "prefill":
            try:
                self.bootstrap = StandinHTTPServer(a.host, a.disaggregation_bootstrap_port, _BootstrapHandler)
            except OSError as e:
                raise StartupError(f"OSError: bootstrap server cannot bind "
                                   f"{a.host}:{a.disaggregation_bootstrap_port}: {e.strerror or e}") from None
            serve_in_thread(self.bootstrap, "bootstrap")
            log(f"Bootstrap server started on {a.host}:{a.disaggregation_bootstrap_port}", tag=None)
        if until(1.0):
            return self._graceful_stop()
        if fault and fault.kind == "never-ready":
            return None
        self.startup_time = time.time()
        self.ready.set()
        became_ready_file = os.environ.get(ENV_READY_AT_FILE)
        if became_ready_file:  # when it *could* first answer 200: what a polling loop's delay is measured from
            with open(became_ready_file, "a") as f:
                f.write(f"{self.startup_time!r}\n")
        log("The server is fired up and ready to roll!", tag=None)
        return None

    def _serve_until_stopped(self) -> int:
        """Serve until SIGTERM, an injected crash, or a scheduler dying under us.

        A scheduler that dies (killed from outside) makes SGLang's main process exit 1
        through its SIGQUIT path; the other detached schedulers are not found and stay.
        """
        fault = self.settings.fault
        crash_at = None
        crash_s = 0.0
        if fault and fault.kind == "crash-after-ready" and self.ready.is_set():
            crash_s = fault.seconds
            crash_at = time.monotonic() + crash_s
        while not self._sleep(0.25 if crash_at is None else min(0.25, crash_at - time.monotonic())):
            if crash_at is not None and time.monotonic() >= crash_at:
                log(f"Scheduler hit an exception: RuntimeError: injected fault crash-after-ready:{crash_s:g}",
                    stream=sys.stderr)
                return self._sigquit_exit()
            dead = [s for s in self.schedulers if _pid_gone(s.pid)]
            if dead:
                log(f"Scheduler TP{dead[0].rank} (pid {dead[0].pid}) died unexpectedly.", stream=sys.stderr)
                return self._sigquit_exit()
        return self._graceful_stop()

    def _sigquit_exit(self) -> int:
        log("Received sigquit from a child process. It usually means the child failed.", tag=None,
            stream=sys.stderr)
        return 1  # the detached schedulers are deliberately left running

    def _graceful_stop(self) -> int:
        """SGLang's SIGTERM path: 503 on /health, drain with no bound, stop schedulers, exit 0."""
        fault = self.settings.fault
        t_term = time.monotonic()
        log(f"SIGTERM received. signum={int(signal.SIGTERM)} frame=None. Draining requests and shutting down...",
            tag=None)
        if fault and fault.kind == "hang-on-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.hung = True
            while True:
                time.sleep(3600)
        with self.lock:
            self.draining = True
        assert self.http is not None
        self.http.inflight.wait_idle()
        if fault and fault.kind == "exit-on-term-slow":
            time.sleep(max(0.0, t_term + fault.seconds - time.monotonic()))
        self._stop_schedulers()
        for srv in (self.bootstrap, self.http):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        log("Gracefully exiting... all schedulers stopped.", tag=None)
        return 0

    def _stop_schedulers(self) -> None:
        """Tell every scheduler to exit, wait up to 15 s, then SIGKILL stragglers."""
        for s in self.schedulers:
            try:
                os.write(s.wfd, b"q")
            except OSError:
                pass
        deadline = time.monotonic() + SCHEDULER_STOP_WAIT_S
        pending = [s.pid for s in self.schedulers]
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if not _pid_gone(p)]
            if pending:
                time.sleep(0.01)
        for pid in pending:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    # -- request handling (called from handler threads) --------------------------------

    def health_status(self) -> int:
        with self.lock:
            draining = self.draining
        if draining or not self.ready.is_set():
            return 503
        return 200

    def note_health_200(self) -> None:
        with self.lock:
            first = not self.first_health_200
            self.first_health_200 = True
        if first and self.settings.ready_file:
            with open(self.settings.ready_file, "a") as f:
                f.write(f"{time.time()!r}\n")

    def model_info(self) -> dict[str, Any]:
        a = self.args
        return {
            "model_path": a.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "is_generation": self.is_generation,
            "preferred_sampling_params": a.preferred_sampling_params,
            "weight_version": a.weight_version,
            "load_format": a.load_format,
            "reasoning_parser": a.reasoning_parser,
            "tool_call_parser": a.tool_call_parser,
            "disaggregation_mode": a.disaggregation_mode,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = dict(vars(self.args))
        info.update({
            "served_model_name": self.served_model_name,
            "context_length": self.args.context_length,
            "launch_command": " ".join([sys.executable, "-m", "sglang.launch_server", *self.argv]),
            "status": "ready" if self.ready.is_set() else "starting",
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.context_len - 1,
            "startup_time": self.startup_time,
            "kv_events": None,
            "internal_states": [{
                "last_gen_throughput": 0.0,
                "max_total_num_tokens": self.max_total_num_tokens,
                "memory_usage": {"weight": round(self.settings.mib * 0.45 / 1024, 2),
                                 "kvcache": round(self.settings.mib * 0.5 / 1024, 2),
                                 "graph": round(self.settings.mib * 0.05 / 1024, 2)},
            }],
            "version": SGLANG_VERSION,
            "frontend": "python",
            "stand_in": True,
            "gpu_ids": self.gpus,
            "scheduler_pids": [s.pid for s in self.schedulers],
        })
        return info

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        """Answer a /generate body like SGLang; honours a simulated duration.

        The duration comes from sampling_params.sleep or a top-level stub_sleep_s, so
        tests can keep a request in flight while they stop the server; the router drops
        both, so behind it max_new_tokens x SUPERVISORD_GPU_STANDIN_TOKEN_S is used.
        """
        assert self.http is not None
        with self.http.inflight:
            with self.lock:
                draining = self.draining
            if draining or not self.ready.is_set():
                return 503, {"error": {"message": "The server is not ready or is shutting down.", "code": 503}}
            if self.args.log_requests:
                log(f"Receive: obj=GenerateReqInput({json.dumps(body, sort_keys=True)})", tag=None)
            sp = body.get("sampling_params") or {}
            if isinstance(sp, list):
                sp = sp[0] if sp else {}
            delay = float(sp.get("sleep") or body.get("stub_sleep_s") or 0.0)
            if not delay and self.token_s:  # what survives a router: time grows with the tokens asked for
                delay = self.token_s * float(sp.get("max_new_tokens") or 16)
            started = time.monotonic()
            if delay > 0:
                time.sleep(delay)
            batch = isinstance(body.get("text"), list) or (
                isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list))
            n = len(body.get("text") or body.get("input_ids") or []) if batch else 1
            max_new = int(sp.get("max_new_tokens") or 16)
            out_tokens = max(0, min(max_new, 16))
            results = []
            for i in range(n):
                prompt = body["text"][i] if batch and body.get("text") else body.get("text")
                prompt_tokens = len(str(prompt or "").split()) or len(body.get("input_ids") or []) or 1
                rid = body.get("rid") or f"{random.getrandbits(64):016x}"
                results.append({
                    "text": " stand-in" * out_tokens,
                    "output_ids": list(range(1000, 1000 + out_tokens)),
                    "meta_info": {
                        "id": rid if isinstance(rid, str) else str(rid),
                        "finish_reason": {"type": "length", "length": out_tokens},
                        "prompt_tokens": prompt_tokens,
                        "weight_version": self.args.weight_version,
                        "completion_tokens": out_tokens,
                        "cached_tokens": 0,
                        "e2e_latency": round(time.monotonic() - started, 4),
                    },
                })
                with self.lock:
                    self.stats["requests"] += 1
                    self.stats["prompt_tokens"] += prompt_tokens
                    self.stats["generation_tokens"] += out_tokens
            return 200, (results if batch else results[0])

    def metrics_text(self) -> str:
        label = f'model_name="{self.served_model_name}"'
        assert self.http is not None
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{label}}} {self.http.inflight.count}",
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{label}}} 0",
            "# HELP sglang:token_usage The token usage.",
            "# TYPE sglang:token_usage gauge",
            f"sglang:token_usage{{{label}}} 0.0",
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{label}}} {self.stats['prompt_tokens']}",
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{label}}} {self.stats['generation_tokens']}",
            "# HELP sglang:num_requests_total Number of requests processed.",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{{{label}}} {self.stats['requests']}",
        ]
        return "\n".join(lines) + "\n"


class _BootstrapHandler(JSONHandler):
    """The prefill's KV bootstrap port: only has to accept connections and answer."""

    def do_GET(self) -> None:
        self.send_json(200, {"status": "ok"})

    do_PUT = do_POST = do_GET


def _make_handler(app: StandinServer) -> type[JSONHandler]:
    class Handler(JSONHandler):
        def _health(self) -> None:
            if app.hung:
                while True:  # after SIGTERM with hang-on-term: never answer
                    time.sleep(3600)
            status = app.health_status()
            if status == 200:
                app.note_health_200()
            self.send_empty(status)

        def _models(self) -> None:
            self.send_json(200, {"object": "list", "data": [{
                "id": app.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "sglang", "root": app.served_model_name, "parent": None,
                "max_model_len": app.context_len}]})

        def _loads(self) -> None:
            self.send_json(200, {"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
                "dp_rank": 0, "num_running_reqs": app.http.inflight.count if app.http else 0,
                "num_waiting_reqs": 0, "num_total_reqs": app.http.inflight.count if app.http else 0,
                "num_used_tokens": 0, "max_total_num_tokens": app.max_total_num_tokens or 0,
                "token_usage": 0.0}]})

        def _metrics(self) -> None:
            if not app.args.enable_metrics:
                self.send_json(404, {"detail": "Not Found"})
            else:
                self.send_text(200, app.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")

        def _generate(self) -> None:
            try:
                body = self.read_json()
            except ValueError:
                self.send_json(400, {"error": {"message": "invalid JSON body"}})
                return
            status, result = app.generate(body if isinstance(body, dict) else {})
            if status == 200 and body.get("stream"):
                self._stream(result)
            else:
                self.send_json(status, result)

        def _stream(self, result: Any) -> None:
            chunks = result if isinstance(result, list) else [result]
            payload = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            self.send_bytes(200, payload, "text/event-stream")

        def do_GET(self) -> None:
            self.dispatch({
                "/health": self._health, "/health_generate": self._health, "/ready": self._health,
                "/v1/models": self._models,
                "/model_info": lambda: self.send_json(200, app.model_info()),
                "/get_model_info": lambda: self.send_json(200, app.model_info()),
                "/server_info": lambda: self.send_json(200, app.server_info()),
                "/get_server_info": lambda: self.send_json(200, app.server_info()),
                "/v1/loads": self._loads, "/metrics": self._metrics,
                "/flush_cache": lambda: self.send_text(200, "Cache flushed.\n"),
            })

        def do_POST(self) -> None:
            self.dispatch({
                "/generate": self._generate,
                "/flush_cache": lambda: self.send_text(200, "Cache flushed.\n"),
            })

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        settings = Settings.from_env(os.environ)
    except ValueError as e:
        print(f"launch_server.py (stand-in): bad environment: {e}", file=sys.stderr)
        return 2
    code = StandinServer(args, settings, argv).run()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    code = main()
    os._exit(code)  # no waiting on handler threads still sleeping in a request
