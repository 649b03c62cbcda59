"""Stand-in for `python -m sglang.launch_server` (SGLang 0.5.23), for tests and rehearsal.

SGLang cannot run without GPUs, so the supervisor is tested (and rehearsed, in the
product's no-GPU mode) against this imitation. It copies what a supervisor can see and must
cope with -- the surface *and* the timing and failure modes of shared/reference/
sglang-server.md -- and nothing else.

Command line: exactly SGLang's (supervisord_gpu.sglang.options.parse_args): unknown options and
the removed `--cuda-graph-max-bs` exit 2 like the real parser. No --model-path: exit 1.

Output. Every log line goes to stderr as "[YYYY-MM-DD HH:MM:SS] msg", with " TP<rank>" inside
the brackets only when --tp-size > 1 (lines of the scheduler processes), and no level name;
--log-level filters them like SGLang's logging (at "warning", even "fired up" is not printed).
uvicorn's lines carry uvicorn's level prefix ("[...] INFO:     Uvicorn running on ...", "[...]
ERROR:    [Errno 98] ..."), its access log ("INFO:     127.0.0.1:PORT - "GET /health HTTP/1.1"
200 OK") goes to stdout, like uvicorn's. Progress bars are tqdm's: "\\r" + bar for every
update (several a second), one "\\n" when the bar completes, nothing else in between.

Start-up, in order (the port is closed, connection refused, until step 6):
 1. ipc endpoints: three names from tempfile.NamedTemporaryFile(delete=False) (TMPDIR is
    honoured), each replaced by a bound AF_UNIX socket at that path, as zmq's ipc:// bind does.
 2. Children, forked (no exec) from the main thread: one scheduler per TP rank (at most 8) and
    one detokenizer, in the stand-in's session and process group. Each calls
    prctl(PR_SET_PDEATHSIG, SIGKILL) right after the fork and exits if its parent is already
    gone; comm `sglang::scheduler` (TP1) or `sglang::scheduler_TP<r>`, `sglang::detokenizer`
    (15 bytes of it). Each scheduler creates and maps /dev/shm/sgl_shm_<16 hex> and, with
    TP > 1, /dev/shm/nccl-<6 alnum>, and holds the simulated GPU memory (checks/simgpu.py).
    A watchdog thread (SGLang's SubprocessWatchdog) polls the children every 1 s.
    PD prefill: the bootstrap port is bound now, in a thread ("CommonKVBootstrapServer started
    successfully on HOST:PORT"); a failure is only logged. A prefill with
    --disaggregation-transfer-backend fake exits 1 before all this (ServerArgs' assertion "Prefill
    server does not support 'fake' as the transfer backend"). A decode refuses a /generate
    without bootstrap_room (one no router paired with a prefill) with 400 "Invalid request:
    Disaggregated request received without bootstrap room id." (not with `fake`).
 3. Loading, SUPERVISORD_GPU_STANDIN_STARTUP_S seconds: "Load weight begin" and a
    "Loading safetensors checkpoint shards" bar (52 %), "Load weight end", "KV Cache is
    allocated", "Memory pool end" (5 %), "Capture target decode CUDA graph begin", a
    "Capturing batches (bs=... avail_mem=... GB)" bar (37 %), "Capture ... end", then
    "max_total_num_tokens=..." (after capture, TP0 only). With STARTUP_S=600 that is minutes
    of "\\r" updates and no "\\n".
 4. DeepGEMM JIT: a cache key of (model path, tp size, SGLang version); the kernels are cached
    if `standin-<key>` exists in both the DeepGEMM cache ($SGLANG_DG_CACHE_DIR, else
    $SGLANG_CACHE_DIR/deep_gemm, else ~/.cache/deep_gemm) and the Triton cache
    ($TRITON_CACHE_DIR, else ~/.triton/cache). Hit: "DeepGEMM JIT: using cached kernels
    (<path>)". Miss: "DeepGEMM JIT warmup: compiling kernels, which may take a long time
    (typically 10-20 mins)", a "DeepGEMM warmup" bar for SUPERVISORD_GPU_STANDIN_JIT_S
    seconds, then both markers are written (an unwritable cache: a warning line, and it
    compiles again next time).
 5. SUPERVISORD_GPU_STANDIN_SILENT_S seconds of no output at all (a JIT that looks hung).
 6. The HTTP port is bound. Busy (EADDRINUSE): uvicorn's "ERROR:    [Errno 98] error while
    attempting to bind on address ('HOST', PORT): address already in use"; the warm-up still
    runs against whoever holds host:port (short timeouts) and prints "The server is fired up
    and ready to roll!" if that answered 200; then the children are SIGKILLed and it exits 3
    (its files left behind). It never moves to another port.
 7. Warm-up (thread), unless --skip-server-warmup: 1 s, then GET /model_info (every 1 s, up to
    120 tries), then one POST /generate (8 tokens); failure: "Initialization failed. warmup
    error: ..." and the crash path's self-SIGKILL. Then "The server is fired up and ready to
    roll!" (PD: also after a failed warm-up).

Endpoints (0.5.23's srt/entrypoints/http_server.py and srt/managers/tokenizer_manager.py, read
from the wheel; file:line below is inside sglang/srt/). /v1/models, /model_info answer 200 as
soon as HTTP is up; /generate is served from then on, also while draining. A "scheduler step"
(one batch, prefill or decode) takes SUPERVISORD_GPU_STANDIN_TOKEN_S, else 0.02 s.
 model_path in /server_info and /model_info (and tokenizer_path, unless --tokenizer-path): the
    --model-path where it exists on this machine, as SGLang reports it; where it does not (a
    rehearsal's /models/..., a test's "test/model"), STANDIN_MODEL_DIR, a directory of the
    package holding a stand-in tokenizer.json. sglang-router 0.3.2 loads a tokenizer for every
    worker it registers from the model_path in /server_info, and takes a path missing on its
    host for a Hugging Face id, fetched from the hub over the network (issue #26): the real
    model directory is what it finds in production (the daemon refuses a model_path that is not
    there), the stand-in's is what it finds in a rehearsal. served_model_name (the router's
    model id, /v1/models) stays the --model-path.
 /server_info = /get_server_info (+ "stand_in_files": its ipc and shm paths, "scheduler_pids":
    every child's pid, "stand_in_mm_segments": see MM_SHM) asks the scheduler (get_internal_state,
    managers/tokenizer_control_mixin.py:967, which also installs the lazy handlers like a
    /generate): answered while generation is paused (the scheduler takes control requests before
    it looks at _engine_paused, scheduler.py:2033-2036), but not while a scheduler is stopped (SIGSTOP: /proc state
    T or t) or stuck (watchdog-timeout fault), and only SECONDS after it came during a
    HEALTH_STALL. No timeout (managers/communicator.py): it waits, looking again every 50 ms.
 /health = /health_generate (http_server.py:721-799): 503 at once while starting (warm-up not
    done) or draining; else a one-token generation, which first waits for a pause to end
    (tokenizer_manager.py:938-939), then joins the running batch and comes back after one
    scheduler step, busy or idle; SGLang sleeps 1 s before each look, so the answer comes at a
    whole number of seconds, >= 1 (1 s on a healthy server, under load too). A stopped or stuck
    scheduler gives no answer. After SGLANG_HEALTH_CHECK_TIMEOUT (default 20) s: 503, "Health
    check failed. ...", status UnHealthy (:798); a later 200 sets it back to Up (:784).
    SUPERVISORD_GPU_STANDIN_HEALTH_STALL=SECONDS:DURATION: for DURATION s after becoming ready,
    the scheduler answers a probe only after SECONDS (200 at the first whole second >= SECONDS,
    or 503 at the timeout when SECONDS >= it). SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0: /health
    (not /health_generate) is 200 unless starting or draining, at once (:731-748; a pause or
    UnHealthy does not matter there).
 /ready (tokenizer_manager.py:728-734, http_server.py:714-718): 200 iff warm-up done, not paused,
    not draining and not UnHealthy; instant. One /health that timed out (a stall, a pause)
    latches /ready at 503 until a later /health succeeds.
 POST /pause_generation {"mode": "abort" (default) | "retract" | "in_place"}
    (tokenizer_manager.py:2267-2280, http_server.py:1831-1841): paused at once (/ready 503; a new
    /generate, and /health's generation, wait for continue). "abort": every admitted request is
    aborted at its next step (answered 200 with finish_reason {"type": "abort", "message":
    "Aborted", ...}); the answer comes when none is left, checked again every 1 s (~1 s with
    requests in flight, at once without). "retract"/"in_place": answered at once; the running
    requests are held and resume after continue. Answer {"message": "Generation paused
    successfully.", "status": "ok"}; an unknown mode 422.
 POST /continue_generation (tokenizer_manager.py:2282-2286): {"message": "Generation continued
    successfully.", "status": "ok"}; waiting requests go on. An UnHealthy latch from a /health
    that failed during the pause stays until a /health succeeds (the real server on the H200:
    /ready 503 1 s and 5 s after continue, 200 after one /health).
 /metrics with --enable-metrics (sglang:num_running_reqs = requests in flight, num_queue_reqs 0).
 GET|POST /slow_down {"forward_sleep_time": SECONDS | null} (an admin endpoint): the scheduler
    sleeps SECONDS before each batch (run_batch), so a generation takes (step + SECONDS) per step
    and a control request (/server_info, /slow_down itself) waits for the end of the step; with
    an unbounded sleep (1e9) and requests in flight nothing answers again: a blocked scheduler.
 A SIGSTOPped detokenizer: the scheduler runs on and answers /server_info, /ready stays 200, but
    no output reaches the front end: every /generate and /health waits (a /health then fails and
    latches /ready), and the metrics' counters stand still; after SIGCONT all of it goes on (the
    real SGLang 0.5.23 on an H100, real-sglang-on-h200.md).
 A request that reaches a checkpointed scheduler (its simulated holding parked by
    parking/simulated.py): the scheduler dies of SIGSEGV and the watchdog takes the server down
    (the real 0.5.23 on an H100, 2026-12-07, the driver API). With --enable-memory-saver,
    POST /release_memory_occupation and /resume_memory_occupation {"tags": [...]}: each tag's
    share of the held memory goes and comes back; a generation that reaches a released KV pool
    crashes the scheduler (the real one: "Pointer argument (at 0) cannot be accessed from
    Triton"); the release with a request running and generation not paused (retract) is the
    scheduler's AssertionError, its crash path.
 Keys (srt/utils/auth.py, see standin_redaction.py): with --admin-api-key, every route SGLang marks
    ADMIN_OPTIONAL (/pause_generation, /continue_generation, /flush_cache, /release_memory_occupation,
    /slow_down, /update_weights_from_disk, ...) answers 401 {"error": "Unauthorized"} unless the
    request carries `Authorization: Bearer KEY`; with --api-key alone they want that key; /health*,
    /ready* and /metrics* are always open. Routes the stand-in does not imitate still answer 404
    once the key is right. /server_info shows admin_api_key and the launch command as SGLang does
    (only watermark secrets redacted), through standin_redaction's copies of SGLang's functions.

Signals and the drain. SIGTERM's handler is installed lazily, by the first /generate (normally
the warm-up's); before that SIGTERM has its default action: dead at once by signal 15, the
children by PDEATHSIG, files left behind. The children keep SIGTERM's default action: a
SIGTERM to the whole process group kills the schedulers at once, and the watchdog then takes
the main process down its crash path.
SIGINT (SGLang installs no handler of its own): while loading, Python's KeyboardInterrupt; once
uvicorn runs, uvicorn's handler (Server.capture_signals, uvicorn/server.py): "INFO:     Shutting
down", the listener closed at once, "Waiting for connections to close. (CTRL+C to force quit)"
while requests are in flight (no time limit; they complete), "Waiting for application
shutdown." (SGLang's lifespan joins the warm-up thread, http_server.py:458-468), "Application
shutdown complete.", "Finished server process [PID]"; then uvicorn re-raises the SIGINT as a
KeyboardInterrupt (a second SIGINT skips the waits). Either way launch_server.py:83-86's
`finally: kill_process_tree(os.getpid(), include_parent=False)` logs "kill_process_tree called:
parent_pid=N, include_parent=False, pid=N" and SIGKILLs the children it finds (not detached
ones), Python prints the KeyboardInterrupt traceback and exits by SIGINT: "killed by signal 2",
its files left behind. (uvicorn also holds SIGTERM from its start until the first /generate
installs SGLang's handler; not imitated: SIGTERM keeps its default action there.)
After SIGTERM: "SIGTERM received. signum=None frame=None. Draining requests and shutting down...",
/health and /ready 503, /generate still accepted and served, the listener open. SGLang's
sigterm watchdog wakes every SUPERVISORD_GPU_STANDIN_DRAIN_POLL_S (default 5.0) s on a clock
started when the handler was installed (see DRAIN_CLOCK), and at each wake-up after SIGTERM
logs "Gracefully exiting... Remaining number of requests N. ..." and goes on only when N is 0:
under steady traffic, never. SGL_FORCE_SHUTDOWN=1 or status UnHealthy: it goes on at the first
wake-up regardless. Then: schedulers told to exit, up to 15 s, SIGKILL for stragglers,
"Gracefully exiting... all schedulers stopped.", its /dev/shm and ipc files removed, exit 0.

Crash path: a child found dead by the watchdog ("Subprocess scheduler_0 (pid=N) crashed with exit
code -9. Triggering SIGQUIT for cleanup...") or an injected scheduler exception ("Scheduler hit
an exception: Traceback ..."), then the main process's SIGQUIT handler: before the lazy handlers
are installed "Received sigquit from a child process. It usually means the child failed."
(entrypoints/engine.py:1976-1982), after them "SIGQUIT received. signum=None, frame=None. It
usually means one child failed." (tokenizer_manager.py:2457, :4072-4083); SIGKILL to every child,
SIGKILL to itself (kill_process_tree): it ends "killed by signal 9", leaving its files.
watchdog-timeout fault: the scheduler's WatchdogRaw (utils/watchdog.py:133-161) on a forward pass
stuck for --watchdog-timeout (default 300) prints, per scheduler, "Scheduler debug info:" (batch
size and reqs), py-spy's failures ("Pyspy failed (py-spy dump --native --pid N). Error: ...",
"All pyspy dump attempts failed for PID N."), "Scheduler watchdog timeout
(self.watchdog_timeout=300, self.soft=False)", an empty line on stderr and stdout, sleeps 5 s and
SIGQUITs the main process: the crash path above, with its diagnostics (below).
The same watchdog without a fault: every --watchdog-timeout / 2 it reads forward_ct (one more per
step of a batch) while a batch is held or running; unchanged for longer than --watchdog-timeout, it
ends the server the same way. A pause in place keeps the running batch, so a pause of 300-450 s
with requests running ends the real server (the H100, 2026-12-07: 447 s); retract and abort
pauses, an idle server and a stopped scheduler are not watched; a /slow_down sleep longer than the
timeout is.
Crash diagnostics: with live schedulers (the watchdog's SIGQUIT), the running-phase handler first
logs "Sleeping 5 seconds before crash diagnostics to let GPU activity settle.", sleeps 5 s, runs
py-spy on the schedulers ("Pyspy failed (...)"), asks for CUDA coredumps and logs "Waiting 60.0
seconds for CUDA coredumps before exiting.", sleeping SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS
(60 s) before the kill (tokenizer_manager.py:3394-3506; SGLANG_PYSPY_DUMP_BEFORE_CRASH and
SGLANG_CUDA_COREDUMP_BEFORE_CRASH both false skip it). Its event loop is blocked meanwhile: the
front end answers nothing.
With SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1, a scheduler exception SIGKILLs the whole process
group instead (os.killpg(0)): whatever group the stand-in was started in. Genuine start-up
failures it imitates (missing --model-path, invalid device ordinal, CUDA out of memory on the
simulated GPUs) stop the children gracefully, remove the files and exit 1.

Stand-in-only settings (environment):

    SUPERVISORD_GPU_STANDIN_STARTUP_S   seconds of loading, port closed (float, default 3.0)
    SUPERVISORD_GPU_STANDIN_MIB         MiB held per GPU once loaded (default 100000); on simulated
                                        GPUs, --mem-fraction-static F holds F x the card's total instead
    SUPERVISORD_GPU_SIMGPU_DIR          simulated GPU directory (checks/simgpu.py); unset:
                                        hold no GPU memory and check nothing
    SUPERVISORD_GPU_STANDIN_FAULT       one fault to inject (see `Fault`):
        crash-on-start                  scheduler exception half-way through the weights: crash path
        crash-at-init                   scheduler exception 0.5 s after the schedulers start, before
                                        any loading line (the real server's unknown architecture,
                                        "Cannot find model module", raised in init_model_worker):
                                        crash path; the load-snapshot segment is left
        never-ready                     the warm-up never completes: /health and /ready 503 forever
                                        (its /generate was answered: SIGTERM drains and exits 0)
        crash-after-ready:SECONDS       scheduler exception SECONDS after the first 200 answered on
                                        /health or /ready (what a prober sees as ready; if none
                                        comes, SECONDS + SGLANG_HEALTH_CHECK_TIMEOUT after the
                                        warm-up, so that a /health in flight is answered first)
        hang-on-term                    from the start, SIGTERM is logged and then ignored; the
                                        process never exits and /health stops answering
        exit-on-term-slow:SECONDS       from the start, SIGTERM takes the graceful path, exiting 0
                                        no earlier than SECONDS after it
        watchdog-timeout:SECONDS        a forward pass sticks (from max(0, SECONDS -
                                        --watchdog-timeout) after ready: no batch advances,
                                        /health and /server_info get no answer); SECONDS after
                                        ready the watchdog's lines, 5 s later the crash path
    SUPERVISORD_GPU_STANDIN_READY_FILE  append time.time() when /health first answers 200
    SUPERVISORD_GPU_STANDIN_READY_AT_FILE  append time.time() when the warm-up is done
    SUPERVISORD_GPU_STANDIN_TOKEN_S     seconds per generated token in /generate (default 0)
    SUPERVISORD_GPU_STANDIN_TORCH_MIB   on a real GPU: each scheduler also allocates this many
                                        MiB with torch on its GPU (device machine only)
    SUPERVISORD_GPU_STANDIN_SILENT_S    seconds of no output before the port opens (default 0)
    SUPERVISORD_GPU_STANDIN_JIT_S       seconds of DeepGEMM JIT on a cache miss (default 0)
    SUPERVISORD_GPU_STANDIN_HEALTH_STALL  SECONDS:DURATION, see /health above
    SUPERVISORD_GPU_STANDIN_DRAIN_POLL_S  the drain watchdog's period (default 5.0, SGLang's)
    SUPERVISORD_GPU_STANDIN_MM_SHM      N: each /generate is a multimodal request whose main process
                                        (the tokenizer, their creator) creates N segments
                                        /dev/shm/sgl_shm_mm_<its pid>_<8 hex> (make_shm_name,
                                        utils/stale_shm_cleanup.py:31-33), 4096 bytes, mode 0600,
                                        and closes them at once (mm_utils.py:1377-1394): nobody maps
                                        or holds them. They are unlinked when the request completes;
                                        a SIGKILL or a crash before that leaves them. (0.5.23's
                                        scheduler unlinks them earlier, when it materializes the
                                        request's features: close_and_unlink, mm_utils.py:1434-1457;
                                        the stand-in keeps them for the whole request, so that a
                                        test can catch them.)
    SUPERVISORD_GPU_STANDIN_SCHEDULERS  children (default) | detached: schedulers double-fork
                                        into their own session and are re-parented to PID 1
                                        (or the nearest subreaper), no PDEATHSIG: the crash path
                                        and a SIGKILL of the main process leave them alive,
                                        holding memory (upstream issue 23627); a graceful stop
                                        still stops them. Their output goes to /dev/null.

GPUs used: CUDA_VISIBLE_DEVICES (physical indices or simulated UUIDs, as the supervisor sets
it) indexed from --base-gpu-id, else range(base_gpu_id, base_gpu_id + tp*dp*pp). With a
simulated GPU directory a GPU index that does not exist is "invalid device ordinal", and too
little free memory on a GPU (others' live holdings) is a CUDA out-of-memory failure at
"Load weight begin".

Not imitated: the random NCCL port (22000-29999), dp-attention's extra ports, SIGBUS from
accumulated /dev/shm leftovers. The rank-0 scheduler makes and maps SGLang's load-snapshot
segment /dev/shm/sglang_loads_<12 hex>_<blake2s-4 of them>.shm (SUPERVISORD_GPU_STANDIN_LOADS_ID
fixes the 12 hex) as it starts and, like the real server, never removes it, on any exit.

Everything is standard library plus psutil (through simgpu), so a start costs tens of
milliseconds and ~20 MB per process: tests run dozens of these on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid
from ..records import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

from supervisord_gpu.rehearsal._http import (
    JSONHandler,
    StandinHTTPServer,
    fetch,
    log as _log_line,
    serve_in_thread,
    set_process_name,
    write_raw,
)
from supervisord_gpu.sglang.options import SGLANG_VERSION, parse_args
from supervisord_gpu.rehearsal import standin_redaction as redaction
from supervisord_gpu.rehearsal.rendezvous import Rendezvous, RendezvousError

#: what /server_info reports as model_path when --model-path is not on this machine (see above)
STANDIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "standin-model"

ENV_STARTUP_S = "SUPERVISORD_GPU_STANDIN_STARTUP_S"
ENV_MIB = "SUPERVISORD_GPU_STANDIN_MIB"
ENV_SIMGPU_DIR = "SUPERVISORD_GPU_SIMGPU_DIR"  # same name as checks.simgpu.ENV_DIR
ENV_FAULT = "SUPERVISORD_GPU_STANDIN_FAULT"
ENV_READY_FILE = "SUPERVISORD_GPU_STANDIN_READY_FILE"
ENV_READY_AT_FILE = "SUPERVISORD_GPU_STANDIN_READY_AT_FILE"
ENV_TOKEN_S = "SUPERVISORD_GPU_STANDIN_TOKEN_S"
ENV_TORCH_MIB = "SUPERVISORD_GPU_STANDIN_TORCH_MIB"
ENV_SILENT_S = "SUPERVISORD_GPU_STANDIN_SILENT_S"
ENV_JIT_S = "SUPERVISORD_GPU_STANDIN_JIT_S"
ENV_HEALTH_STALL = "SUPERVISORD_GPU_STANDIN_HEALTH_STALL"
ENV_DRAIN_POLL_S = "SUPERVISORD_GPU_STANDIN_DRAIN_POLL_S"
ENV_SCHEDULERS = "SUPERVISORD_GPU_STANDIN_SCHEDULERS"
ENV_MM_SHM = "SUPERVISORD_GPU_STANDIN_MM_SHM"
ENV_LOADS_ID = "SUPERVISORD_GPU_STANDIN_LOADS_ID"
#: SGLang's load-snapshot segment (managers/load_snapshot.py shm_path_for): made by the rank-0
#: scheduler in Scheduler.__init__, before the model loads; no exit path of the real server unlinks it
LOADS_PREFIX = "/dev/shm/sglang_loads_"
# SGLang's own variables that the stand-in honours
ENV_HEALTH_TIMEOUT = "SGLANG_HEALTH_CHECK_TIMEOUT"
ENV_KILLPG = "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION"
ENV_FORCE_SHUTDOWN = "SGL_FORCE_SHUTDOWN"
ENV_HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"

DEFAULT_STARTUP_S = 3.0
DEFAULT_MIB = 100000
FAULT_KINDS = ("crash-on-start", "crash-at-init", "hang-on-term", "never-ready", "crash-after-ready", "exit-on-term-slow",
               "watchdog-timeout")
SECONDS_FAULTS = ("crash-after-ready", "exit-on-term-slow", "watchdog-timeout")
PAUSE_MODES = ("abort", "retract", "in_place")  # PauseGenerationReqInput.mode; "abort" is the default
SCHEDULER_MODES = ("children", "detached")
MAX_SCHEDULERS = 8

# SGLang's clocks (sglang-server.md; supervisord_gpu/sglang/timing.py has the same numbers)
SCHEDULER_STOP_WAIT_S = 15.0  # graceful stop: tell schedulers to exit, wait this long, SIGKILL stragglers
DEFAULT_DRAIN_POLL_S = 5.0  # tokenizer_manager.sigterm_watchdog: `await asyncio.sleep(5)`
DEFAULT_HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
HEALTH_POLL_S = 1.0  # /health sleeps this long before each look
WATCHDOG_POLL_S = 1.0  # SubprocessWatchdog
DEFAULT_STEP_S = 0.02  # one scheduler step (prefill or decode of the running batch) without TOKEN_S
SCHEDULER_ASK_POLL_S = 0.05  # how often a /server_info waiting on the scheduler looks again
PAUSE_ABORT_RECHECK_S = 1.0  # pause_generation(abort): `await asyncio.sleep(1.0)` between abort rounds
WATCHDOG_SIGQUIT_DELAY_S = 5.0  # WatchdogRaw: `time.sleep(5)` after its lines, then SIGQUIT to the parent
WATCHDOG_COUNT_POLL_S = 0.5  # how often the stand-in's forward_ct follows the batch (SGLang counts each step)
CRASH_DIAGNOSTICS_SLEEP_S = 5.0  # dump_requests_before_crash: "Sleeping 5 seconds before crash diagnostics"
ENV_PYSPY_BEFORE_CRASH = "SGLANG_PYSPY_DUMP_BEFORE_CRASH"  # environ.py:401, default true
ENV_COREDUMP_BEFORE_CRASH = "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"  # environ.py:402, default true
ENV_COREDUMP_WAIT = "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS"  # environ.py:403, default 60.0
MM_SEGMENT_BYTES = 4096
WARMUP_FIRST_SLEEP_S = 1.0  # _execute_server_warmup sleeps 1 s before each GET /model_info
WARMUP_TRIES = 120
WARMUP_GET_TIMEOUT_S = 5.0
WARMUP_GENERATE_TIMEOUT_S = 600.0  # PD: 1800
BUSY_PORT_WARMUP_TRIES = 3  # the busy-port warm-up uses short timeouts (a stranger may never answer)
BUSY_PORT_TIMEOUT_S = 2.0

# When the drain watchdog looks for "no requests left" after SIGTERM. SGLang's sigterm_watchdog
# is `while not gracefully_exit: await asyncio.sleep(5)` started with the handler (the first
# /generate), then checks at once and every 5 s: the first check comes 0-5 s after SIGTERM.
#   "clock":     ticks at handler-install + k * period (SGLang's)
#   "sigterm":   first check one period after SIGTERM, then every period
#   "immediate": first check at SIGTERM, then every period
DRAIN_CLOCK = "clock"

# Share of STARTUP_S for each loading phase (the rest is short steps between them).
#: SGLang's GPU_MEMORY_ALL_TYPES and the share of the held MiB each is here (_load's holds:
#: 0.45 after the weights, 0.95 after the KV pool, 1.0 after the CUDA graphs)
MEMORY_TAG_SHARE = {"weights": 0.45, "kv_cache": 0.5, "cuda_graph": 0.05}
WEIGHTS_SHARE = 0.52
KV_SHARE = 0.05
GRAPHS_SHARE = 0.37
PROGRESS_HZ = 4.0  # tqdm updates per second during a bar
GRAPH_BATCH_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
                     136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256]

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
INFO, WARNING, ERROR = 20, 30, 40
SGLANG_SRC = "/usr/local/lib/python3.12/dist-packages/sglang"
SCHEDULER_SRC = f"{SGLANG_SRC}/srt/managers/scheduler.py"


# --- Stand-in settings (environment) ----------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """An injected failure: `kind` is one of FAULT_KINDS, `seconds` its parameter."""

    kind: str
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> Fault | None:
        if not text:
            return None
        kind, _, arg = text.strip().partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        needs_seconds = kind in SECONDS_FAULTS
        if needs_seconds != bool(arg):
            raise ValueError(f"fault {kind!r} {'needs' if needs_seconds else 'takes no'} ':SECONDS'")
        return cls(kind, float(arg) if arg else 0.0)


def _parse_stall(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    seconds, sep, duration = text.partition(":")
    if not sep:
        raise ValueError(f"{ENV_HEALTH_STALL} must be SECONDS:DURATION, not {text!r}")
    return float(seconds), float(duration)


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """What the environment tells the stand-in (the command line stays SGLang's)."""

    startup_s: float = DEFAULT_STARTUP_S
    mib: int = DEFAULT_MIB
    simgpu_dir: str | None = None
    fault: Fault | None = None
    ready_file: str | None = None
    ready_at_file: str | None = None
    token_s: float = 0.0
    silent_s: float = 0.0
    jit_s: float = 0.0
    health_stall: tuple[float, float] | None = None
    drain_poll_s: float = DEFAULT_DRAIN_POLL_S
    schedulers: str = "children"
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    killpg_on_exception: bool = False
    force_shutdown: bool = False
    health_generation: bool = True
    mm_shm: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str]) -> Settings:
        mode = (env.get(ENV_SCHEDULERS) or "children").strip()
        if mode not in SCHEDULER_MODES:
            raise ValueError(f"{ENV_SCHEDULERS} must be one of {', '.join(SCHEDULER_MODES)}, not {mode!r}")
        poll = float(env.get(ENV_DRAIN_POLL_S) or DEFAULT_DRAIN_POLL_S)
        if poll <= 0:
            raise ValueError(f"{ENV_DRAIN_POLL_S} must be > 0")
        return cls(
            startup_s=float(env.get(ENV_STARTUP_S) or DEFAULT_STARTUP_S),
            mib=int(float(env.get(ENV_MIB) or DEFAULT_MIB)),
            simgpu_dir=env.get(ENV_SIMGPU_DIR) or None,
            fault=Fault.parse(env.get(ENV_FAULT)),
            ready_file=env.get(ENV_READY_FILE) or None,
            ready_at_file=env.get(ENV_READY_AT_FILE) or None,
            token_s=float(env.get(ENV_TOKEN_S) or 0.0),
            silent_s=float(env.get(ENV_SILENT_S) or 0.0),
            jit_s=float(env.get(ENV_JIT_S) or 0.0),
            health_stall=_parse_stall(env.get(ENV_HEALTH_STALL)),
            drain_poll_s=poll,
            schedulers=mode,
            health_timeout_s=float(env.get(ENV_HEALTH_TIMEOUT) or DEFAULT_HEALTH_TIMEOUT_S),
            killpg_on_exception=_flag(env.get(ENV_KILLPG)),
            force_shutdown=_flag(env.get(ENV_FORCE_SHUTDOWN)),
            health_generation=(env.get(ENV_HEALTH_GENERATION) or "1").strip().lower() not in ("0", "false", "no"),
            mm_shm=max(0, int(env.get(ENV_MM_SHM) or 0)),
        )


class StartupError(Exception):
    """A failure SGLang would also hit (bad device, out of memory): exit 1, children stopped."""


def resolve_gpus(args: argparse.Namespace, env: dict[str, str] | os._Environ[str],
                 uuids: dict[str, int] | None = None) -> list[int]:
    """Physical GPU indices this server uses.

    SGLang uses devices base_gpu_id .. base_gpu_id + world - 1 (step --gpu-id-step; world is tp x pp
    over --nnodes: each node runs its share of the ranks) of
    the visible ones; CUDA_VISIBLE_DEVICES maps those to physical devices.
    """
    world = max(1, args.tp_size * args.dp_size * (args.pp_size or 1) // max(1, getattr(args, "nnodes", 1) or 1))
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


def reported_model_path(model_path: str | None) -> str | None:
    """The model_path /server_info reports: the given one where it exists here, else the stand-in's."""
    if model_path is None or os.path.exists(model_path):
        return model_path
    return str(STANDIN_MODEL_DIR)


def cache_key(model_path: str, tp_size: int) -> str:
    """What the stand-in's "compiled kernels" depend on: model, TP size, SGLang version."""
    import hashlib

    return hashlib.sha256(f"{model_path}\0{tp_size}\0{SGLANG_VERSION}".encode()).hexdigest()[:16]


def cache_dirs(env: dict[str, str] | os._Environ[str]) -> list[Path]:
    """DeepGEMM's and Triton's cache directories, as SGLang 0.5.23 resolves them."""
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    dg = env.get("SGLANG_DG_CACHE_DIR")
    if not dg:
        dg = str(Path(env["SGLANG_CACHE_DIR"]) / "deep_gemm") if env.get("SGLANG_CACHE_DIR") else str(
            home / ".cache" / "deep_gemm")
    triton = env.get("TRITON_CACHE_DIR") or str(home / ".triton" / "cache")
    return [Path(dg), Path(triton)]


# --- tqdm, as SGLang's bars print it -----------------------------------------------------


def _fmt_interval(seconds: float) -> str:
    mins, s = divmod(int(seconds), 60)
    h, m = divmod(mins, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Bar:
    """A tqdm progress bar on stderr: "\\r" + text per update, "\\n" at close.

    `style` "shards" is SGLang's weight-loading format ("{desc}: {percentage:3.0f}% Completed |
    {n}/{total} [...]"), "bar" tqdm's default ("{desc}: {percentage:3.0f}%|{bar}| {n}/{total}
    [...]", 10 characters of bar when the output is not a terminal).
    """

    BLOCKS = " ▏▎▍▌▋▊▉█"

    def __init__(self, desc: str, total: int, style: str = "bar") -> None:
        self.desc, self.total, self.style = desc, max(1, total), style
        self.n = 0
        self.t0 = time.monotonic()
        self.last_len = 0
        self._show()

    def _text(self) -> str:
        elapsed = time.monotonic() - self.t0
        frac = self.n / self.total
        rate = self.n / elapsed if elapsed > 0 and self.n else 0.0
        if not rate:
            rate_fmt, remaining = "?it/s", "?"
        else:
            rate_fmt = f"{rate:5.2f}it/s" if rate >= 1 else f"{1 / rate:5.2f}s/it"
            remaining = _fmt_interval((self.total - self.n) / rate)
        tail = f"{self.n}/{self.total} [{_fmt_interval(elapsed)}<{remaining}, {rate_fmt}]"
        if self.style == "shards":
            return f"{self.desc}: {frac * 100:3.0f}% Completed | {tail}"
        eighths = int(frac * 10 * 8)
        full, part = divmod(eighths, 8)
        bar = "█" * full + (self.BLOCKS[part] if full < 10 and part else "")
        return f"{self.desc}: {frac * 100:3.0f}%|{bar:<10}| {tail}"

    def _show(self) -> None:
        text = self._text()
        write_raw("\r" + text + " " * max(0, self.last_len - len(text)))
        self.last_len = len(text)

    def update(self, n: int = 1, desc: str | None = None) -> None:
        self.n = min(self.total, self.n + n)
        if desc is not None:
            self.desc = desc
        self._show()

    def close(self) -> None:
        write_raw("\n")


# --- Children: schedulers and the detokenizer -------------------------------------------

_PR_SET_PDEATHSIG = 1


def _arm_pdeathsig() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL), as each SGLang child does (kill_itself_when_parent_died)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


@dataclass
class Child:
    """A scheduler or the detokenizer: pid, our end of its command pipe, what it holds."""

    label: str  # "scheduler_0", "detokenizer": the name SGLang's watchdog reports
    rank: int
    pid: int
    wfd: int
    gpus: list[int] = field(default_factory=list)
    shm: list[str] = field(default_factory=list)
    ack_fd: int = -1  # readable once the child's real GPU memory (torch mode) is allocated
    detached: bool = False
    exit_code: int | None = None
    reaped: bool = False

    def poll(self) -> bool:
        """True when it has died; then exit_code is SGLang's (negative: killed by that signal)."""
        if self.reaped:
            return True
        if self.detached:
            if _pid_gone(self.pid):
                self.reaped = True
                return True
            return False
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.reaped = True
            return True
        if pid == 0:
            return False
        self.reaped = True
        self.exit_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return True


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


def loads_path(instance_id: str | None = None) -> str:
    """SGLang's shm_path_for(instance_id), instance_id a uuid4's first 12 hex digits."""
    import hashlib
    import uuid

    iid = instance_id or os.environ.get(ENV_LOADS_ID) or uuid.uuid4().hex[:12]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in iid)
    return f"{LOADS_PREFIX}{safe}_{hashlib.blake2s(iid.encode(), digest_size=4).hexdigest()}.shm"


def _map_shm(path: str) -> tuple[int, Any]:
    """Create and map a small /dev/shm segment (what SGLang's and NCCL's shared memory look like)."""
    import mmap

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    return fd, mmap.mmap(fd, 4096)


def _child_body(rfd: int, ack_w: int, name: str, rank: int, shm: list[str], quiet: bool,
                hold_gpu: bool) -> NoReturn:
    """Body of a forked child: map its shm segments, then sleep until told to exit.

    A cheap forked copy of the parent (no exec, no new imports) that blocks on a pipe. A b"q"
    on the pipe is the graceful stop: it unlinks its segments and exits 0. End-of-file without
    it means the main process died abruptly: it stays (PDEATHSIG has killed it already unless
    it is detached, which is the upstream bug a supervisor must survive).
    """
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)  # a group-wide SIGTERM kills a scheduler at once, as in SGLang
    set_process_name(name)
    import gc

    gc.disable()  # touch as few copy-on-write pages as possible
    keep = sorted({rfd, ack_w} - {-1})
    lo = 3
    for fd in keep:  # drop inherited fds: listeners, ipc sockets, other children's pipes
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 65536)
    if quiet:  # detached: never keep the log pipe open (a reader would never see EOF)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
    mapped = []
    for path in shm:
        try:
            mapped.append(_map_shm(path))
        except OSError:
            pass
    held = _hold_real_gpu_memory(rank) if hold_gpu else None  # noqa: F841  (kept until death)
    if ack_w >= 0:
        try:
            os.write(ack_w, b"1")  # "weights loaded": the main process may go on
        except OSError:
            pass  # it did not wait for us (no torch mode) and closed its end: EPIPE is no reason to die
        os.close(ack_w)
    while True:
        try:
            data = os.read(rfd, 1)
        except InterruptedError:
            continue
        if data == b"q":
            for path in shm:
                if path.startswith(LOADS_PREFIX):
                    continue  # the real server never removes it
                try:
                    os.unlink(path)
                except OSError:
                    pass
            os._exit(0)
        if data == b"":
            break
    while True:
        signal.pause()


def spawn_child(label: str, title: str, rank: int, gpus: list[int], shm: list[str], detached: bool,
                hold_gpu: bool) -> Child:
    """Fork a child (scheduler or detokenizer) and return it once it has armed PDEATHSIG.

    children mode: a direct child in our session and process group, PR_SET_PDEATHSIG(SIGKILL),
    getppid() checked afterwards (the parent may have died in between). detached mode (the
    middle child calls setsid() and forks again, then exits): re-parented to PID 1 or the
    nearest subreaper; tree walks, parent-death signals and process-group kills miss it.
    """
    rfd, wfd = os.pipe()
    ack_r, ack_w = os.pipe()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    if not detached:
        pid = os.fork()
        if pid == 0:
            try:
                _arm_pdeathsig()
                if os.getppid() != parent:
                    os._exit(0)  # the parent died before PDEATHSIG was armed
                os.close(wfd)
                os.close(ack_r)
                _child_body(rfd, ack_w, title, rank, shm, quiet=False, hold_gpu=hold_gpu)
            finally:
                os._exit(0)
    else:
        report_r, report_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            try:
                os.close(wfd)
                os.close(report_r)
                os.close(ack_r)
                os.setsid()
                grandchild = os.fork()
                if grandchild == 0:
                    os.close(report_w)
                    _child_body(rfd, ack_w, title, rank, shm, quiet=True, hold_gpu=hold_gpu)
                os.write(report_w, str(grandchild).encode())
            finally:
                os._exit(0)
        os.close(report_w)
        chunks = []
        while True:
            chunk = os.read(report_r, 32)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(report_r)
        os.waitpid(middle, 0)
        pid = int(b"".join(chunks))
    os.close(rfd)
    os.close(ack_w)
    os.set_inheritable(wfd, False)
    os.set_inheritable(ack_r, False)
    return Child(label=label, rank=rank, pid=pid, wfd=wfd, gpus=gpus, shm=shm, ack_fd=ack_r, detached=detached)


def _pid_gone(pid: int) -> bool:
    """True when pid is dead or a zombie (a zombie holds no GPU memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def _stopped(pid: int) -> bool:
    """True when pid is stopped (SIGSTOP, or a tracer): /proc/PID/stat state T or t."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except OSError:
        return False


def _alnum(n: int) -> str:
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(random.choice(chars) for _ in range(n))


# --- The server -------------------------------------------------------------------------


@dataclass
class Request:
    """A generation in flight, as SGLang's rid_to_state holds it."""

    rid: str
    ends_at: float  # time.monotonic() when it would complete if nothing held it up
    health: bool = False
    admitted: bool = False  # past the pause gate (holds model_update_lock's reader side)
    aborted: bool = False  # pause_generation(abort) aborted it: answered with finish_reason abort
    scheduled: bool = False  # the scheduler is done with it; its output may still wait on the detokenizer


class StandinServer:
    """One stand-in SGLang server: start-up script, children, HTTP front, drain and crash paths."""

    def __init__(self, args: argparse.Namespace, settings: Settings, argv: Sequence[str]) -> None:
        self.args = args
        self.settings = settings
        self.argv = list(argv)
        self.served_model_name = args.served_model_name or args.model_path
        self.model_path = reported_model_path(args.model_path)
        self.context_len = args.context_length or 131072
        self.is_generation = not args.is_embedding
        self.pd_mode = args.disaggregation_mode
        self.tp = max(1, args.tp_size)
        self.level = LEVELS.get(str(args.log_level).lower(), INFO)
        http_level = getattr(args, "log_level_http", None)
        self.http_level = LEVELS.get(str(http_level).lower(), self.level) if http_level else self.level
        self.lock = threading.Lock()
        self.up = False  # warm-up done: SGLang's server_status Up
        self.unhealthy = False  # the last /health timed out: status UnHealthy
        self.draining = False
        self.hung = False
        self.first_health_200 = False
        self.seen_ready = False
        self.ready_at: float | None = None  # monotonic
        self.startup_time: float | None = None
        self.max_total_num_tokens: int | None = None
        self.requests: dict[str, Request] = {}
        self.last_receive = 0.0  # monotonic: the last time a generation completed
        self.paused = False  # POST /pause_generation ... /continue_generation: TokenizerManager.is_pause
        self.released: set[str] = set()  # memory-saver tags released (/release_memory_occupation)
        self.pause_mode = "abort"
        self.resumed_at = 0.0  # monotonic: the last /continue_generation
        self.pause_cond = threading.Condition(self.lock)  # is_pause_cond
        self.stuck = False  # watchdog-timeout fault: a forward pass never returns
        #: the scheduler's forward_ct as its WatchdogRaw reads it: one more per step of a batch
        self.forward_ct = 0
        self._slow_steps = -1
        #: the front end's SIGQUIT handler is in its crash diagnostics: its event loop answers nothing
        self.dying = False
        #: POST /slow_down's forward_sleep_time: the scheduler sleeps this long before each batch
        self.forward_sleep: float | None = None
        self.slowed_at = 0.0  # monotonic: when it was set (its step clock starts there)
        self.mm_segments: set[str] = set()  # sgl_shm_mm_* created and not yet unlinked
        self.sigints = 0
        self._warmup_thread: threading.Thread | None = None
        self.stats = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.children: list[Child] = []
        self.children_lock = threading.Lock()
        self.watchdog_off = False
        self.crashing = threading.Lock()
        self.gpus: list[int] = []
        self.sim: Any = None
        self.total_mib = 143771
        self.reserved_mib = 615
        self.ipc: list[tuple[str, socket.socket | None]] = []
        self.http: StandinHTTPServer | None = None
        self.bootstrap: StandinHTTPServer | None = None
        # main-thread control: the signal handler and the HTTP threads write bytes to this pipe
        self._ctl_r, self._ctl_w = os.pipe()
        os.set_blocking(self._ctl_r, False)
        os.set_blocking(self._ctl_w, False)
        self.handler_installed = threading.Event()
        self.handler_installed_at: float | None = None
        self.term_at: float | None = None
        self.term_seen = False
        self.nnodes = max(1, int(getattr(args, "nnodes", 1) or 1))
        self.node_rank = int(getattr(args, "node_rank", 0) or 0)
        self.rendezvous: Rendezvous | None = None

    # -- output -------------------------------------------------------------------------

    def log(self, message: str, level: int = INFO, rank: int | None = None) -> None:
        """A main-process line (rank None) or a scheduler line (TP<rank> prefix when TP > 1)."""
        if level < self.level:
            return
        tag = f"TP{rank}" if rank is not None and self.tp > 1 else None
        _log_line(message, tag=tag)

    def log_ranks(self, message: str | Callable[[int], str], level: int = INFO) -> None:
        """A line every scheduler prints, one per TP rank."""
        for rank in range(self.n_schedulers() if self.children else 1):
            self.log(message(rank) if callable(message) else message, level, rank)

    def uvicorn(self, message: str, level: int = INFO) -> None:
        """uvicorn's error logger with SGLang's format: "[stamp] INFO:     message" on stderr."""
        if level < self.http_level:
            return
        name = {INFO: "INFO", WARNING: "WARNING", ERROR: "ERROR"}.get(level, "INFO")
        _log_line(f"{name + ':':<9} {message}")

    def access_log(self, client: tuple[Any, ...], request_line: str, status: int, phrase: str) -> None:
        if INFO < self.http_level:
            return
        excluded = getattr(self.args, "uvicorn_access_log_exclude_prefixes", None) or []
        path = request_line.split(" ")[1] if " " in request_line else ""
        if any(path.startswith(p) for p in excluded):
            return
        _log_line(f'INFO:     {client[0]}:{client[1]} - "{request_line}" {status} {phrase}', stream=sys.stdout)

    # -- lifecycle ----------------------------------------------------------------------

    def run(self) -> int:
        """The whole life of the server; a SIGINT anywhere ends as SGLang's KeyboardInterrupt does."""
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's: KeyboardInterrupt
        # A process-directed signal may land on any thread (an HTTP handler's, the bootstrap
        # server's); Python runs its handler only in the main thread, which sleeps in select()
        # on the control pipe. The wakeup fd makes the C-level handler write to that pipe from
        # whichever thread took the signal, so the main thread wakes and runs the handler.
        # SGLang's main thread is uvicorn's asyncio loop, which does the same (loop.add_signal_handler).
        signal.set_wakeup_fd(self._ctl_w, warn_on_full_buffer=False)
        try:
            return self._run()
        except KeyboardInterrupt:
            self._die_of_keyboard_interrupt()

    def _run(self) -> int:
        a, s = self.args, self.settings
        if s.fault and s.fault.kind in ("hang-on-term", "exit-on-term-slow"):
            self._install_sigterm()  # these faults model a SIGTERM path, whatever the phase
        if a.model_path is None:
            self.log("ValueError: --model-path is required", ERROR)
            return 1
        if self.pd_mode == "prefill" and a.disaggregation_transfer_backend == "fake":
            return _fake_backend_on_a_prefill()
        self._create_ipc()
        # engine.py:1185 logs redact_watermark_secrets(server_args.resolved_dict()): every field, keys included
        shown = redaction.redact_watermark_secrets({k: getattr(a, k) for k in (
            "model_path", "tp_size", "dp_size", "host", "port", "disaggregation_mode", "base_gpu_id", "api_key",
            "admin_api_key")})
        self.log(f"server_args={shown}  [stand-in: a few of the fields]")
        if self.model_path != a.model_path:
            self.log(f"stand-in: {a.model_path} is not on this machine; /server_info reports {self.model_path} "
                     "as model_path (a stand-in tokenizer, which the router loads instead of asking the hub)")
        try:
            self._prepare_gpus()
            self._spawn_children()
        except StartupError as e:
            self.log(str(e), ERROR)
            return self._exit_after_startup_error()
        threading.Thread(target=self._watchdog, name="subprocess-watchdog", daemon=True).start()
        if self.pd_mode == "prefill":
            threading.Thread(target=self._start_bootstrap, name="bootstrap", daemon=True).start()
        if s.fault and s.fault.kind == "crash-at-init":
            self._wait(0.5)
            self.crash_exception("scheduler.init_model_worker", "injected fault crash-at-init: Cannot find model module")
        try:
            self._load()
        except StartupError as e:
            self.log(str(e), ERROR, rank=0)
            return self._exit_after_startup_error()
        if self.node_rank > 0:
            return self._serve_as_follower()
        if self.rendezvous is not None:
            self.rendezvous.watch(self._peer_lost)
        return self._serve()

    # -- spanning nodes -----------------------------------------------------------------

    def _meet_the_other_nodes(self) -> None:
        """The TCPStore rendezvous, before any weight is loaded: rank 0 waits for every rank."""
        a = self.args
        if not a.dist_init_addr:
            raise StartupError("--nnodes > 1 without --dist-init-addr: the ranks would never meet "
                               "(each would wait on its own 127.0.0.1 NCCL port)")
        self.rendezvous = Rendezvous(self.nnodes, self.node_rank, a.dist_init_addr, a.dist_timeout,
                                     self._wait, lambda line: self.log(line, WARNING, rank=0))
        try:
            self.rendezvous.meet()
        except RendezvousError as e:
            self.crash_exception("init_torch_distributed", str(e))

    def _peer_lost(self, rank: int) -> None:
        """Rank 0: a node's ranks went away (killed, or stopped before us): the gloo group breaks."""
        if self.term_seen:
            return  # we are stopping anyway; the follower left first
        self.crash_exception("event_loop_normal", f"RuntimeError: [gloo] Connection closed by peer [node rank {rank}]")

    def _serve_as_follower(self) -> int:
        """Node rank > 0: no tokenizer, no HTTP API; a dummy /health on --host:--port once its
        schedulers are ready, then wait for rank 0. SIGTERM only says it waits for rank 0's
        shutdown broadcast; the end comes when rank 0 goes (its connection closes)."""
        a = self.args
        try:
            self.http = StandinHTTPServer(a.host, a.port, _FollowerHealthHandler)
        except OSError as e:
            return self._busy_port(e)
        serve_in_thread(self.http, "dummy-health")
        self.log(f"Dummy health check server started in background thread at {a.host}:{a.port}")
        signal.signal(signal.SIGTERM, lambda *_: os.write(self._ctl_w, b"t"))
        lost = threading.Event()

        def rank0_gone(rank: int) -> None:
            lost.set()
            os.write(self._ctl_w, b"l")

        assert self.rendezvous is not None
        self.rendezvous.watch(rank0_gone)
        while not lost.is_set():
            ready, _, _ = select.select([self._ctl_r], [], [], None)
            if ready:
                data = os.read(self._ctl_r, 4096)
                if b"t" in data and not self.term_seen:
                    self.term_seen = True
                    self.log("Received SIGTERM on node rank > 0; waiting for the rank-0 ShutdownReq broadcast", WARNING)
        self._stop_children()
        for child in self.schedulers():
            self.log(f"Scheduler or DataParallelController {child.pid} terminated with {0 if self.term_seen else 1}")
        self._remove_files()
        self.http.server_close()
        return 0

    def _exit_after_startup_error(self) -> int:
        self._stop_children()
        self._remove_files()
        return 1

    def _create_ipc(self) -> None:
        """Three ipc:// endpoints named by tempfile, each a bound AF_UNIX socket at that path."""
        for _ in range(3):
            with tempfile.NamedTemporaryFile(delete=False) as f:
                path = f.name
            sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                os.unlink(path)
                sock.bind(path)  # type: ignore[union-attr]
                sock.listen(8)  # type: ignore[union-attr]
                sock.set_inheritable(False)  # type: ignore[union-attr]
            except OSError:  # a path too long for AF_UNIX: the plain temporary file stays
                sock.close()  # type: ignore[union-attr]
                sock = None
                Path(path).touch()
            self.ipc.append((path, sock))

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
            fraction = getattr(self.args, "mem_fraction_static", None)
            if fraction:  # like SGLang's pool: the fraction of the card (config/sharing.py), not the setting's MiB
                from ..records import replace

                self.settings = replace(self.settings, mib=int(fraction * self.total_mib))
        else:
            self.gpus = resolve_gpus(self.args, os.environ)

    def n_schedulers(self) -> int:
        return max(1, min(MAX_SCHEDULERS, len(self.gpus) or 1))

    def schedulers(self) -> list[Child]:
        return [c for c in self.children if c.label.startswith("scheduler_")]

    def _spawn_children(self) -> None:
        """Schedulers (one per rank, at most 8) and the detokenizer; before any thread starts."""
        n = self.n_schedulers()
        per = -(-len(self.gpus) // n)  # contiguous chunks when more GPUs than schedulers
        detached = self.settings.schedulers == "detached"
        hold_gpu = bool(int(os.environ.get(ENV_TORCH_MIB) or 0))
        for rank in range(n):
            title = "sglang::scheduler" if self.tp == 1 else f"sglang::scheduler_TP{rank}"
            shm = [f"/dev/shm/sgl_shm_{os.urandom(8).hex()}"] + ([loads_path()] if rank == 0 else [])
            if self.tp > 1:
                shm.append(f"/dev/shm/nccl-{_alnum(6)}")
            child = spawn_child(f"scheduler_{rank}", title, rank, self.gpus[rank * per:(rank + 1) * per], shm,
                                detached, hold_gpu)
            self.children.append(child)
        self.children.append(spawn_child("detokenizer", "sglang::detokenizer", 0, [], [], False, False))

    def _start_bootstrap(self) -> None:
        a = self.args
        try:
            self.bootstrap = StandinHTTPServer(a.host, a.disaggregation_bootstrap_port, _BootstrapHandler)
        except OSError as e:
            self.log(f"Failed to start the bootstrap server on {a.host}:{a.disaggregation_bootstrap_port}: "
                     f"[Errno {e.errno}] {e.strerror}", ERROR)
            return
        serve_in_thread(self.bootstrap, "bootstrap-http")
        self.log(f"CommonKVBootstrapServer started successfully on {a.host}:{a.disaggregation_bootstrap_port}")

    # -- waiting in the main thread -----------------------------------------------------

    def _wait(self, seconds: float) -> None:
        """Sleep in the main thread, handling control bytes (lazy handler install, SIGTERM)."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready, _, _ = select.select([self._ctl_r], [], [], remaining)
            if ready:
                self._handle_control()

    def _handle_control(self) -> None:
        try:
            data = os.read(self._ctl_r, 4096)
        except BlockingIOError:
            return
        if b"i" in data:
            self._install_sigterm()
        if b"t" in data and not self.term_seen:
            self.term_seen = True
            self._on_sigterm()

    def _install_sigterm(self) -> None:
        """The lazy SIGTERM handler (main thread only, as Python requires)."""
        if self.handler_installed.is_set():
            return
        signal.signal(signal.SIGTERM, self._sigterm_handler)
        self.handler_installed_at = time.monotonic()
        self.handler_installed.set()

    def _sigterm_handler(self, signum: int, frame: object) -> None:
        if self.term_at is None:
            self.term_at = time.monotonic()
        try:
            os.write(self._ctl_w, b"t")
        except OSError:
            pass

    def request_sigterm_handler(self) -> None:
        """Called by the first /generate (a handler thread): have the main thread install it."""
        if self.handler_installed.is_set():
            return
        try:
            os.write(self._ctl_w, b"i")
        except OSError:
            pass
        self.handler_installed.wait(2.0)

    def _on_sigterm(self) -> None:
        """SIGTERM seen by the main thread: SGLang's handler only sets gracefully_exit."""
        self.log("SIGTERM received. signum=None frame=None. Draining requests and shutting down...", WARNING)
        with self.lock:
            self.draining = True
        fault = self.settings.fault
        if fault and fault.kind == "hang-on-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.hung = True
            while True:  # the main thread is stuck; HTTP threads still serve, /health hangs
                time.sleep(3600)
        if self.http is None:  # still loading (only the fault handlers are installed this early)
            self._wait(max(0.0, self.term_at + (fault.seconds if fault else 0.0) - time.monotonic())
                       if self.term_at is not None else 0.0)
            self._graceful_exit()

    # -- loading ------------------------------------------------------------------------

    def _free_mib(self, gpu: int) -> int:
        """Free MiB on `gpu` counting everyone's live holdings but our schedulers'."""
        ours = {c.pid for c in self.children}
        used = sum(h.mib for h in self.sim.holders() if gpu in h.gpus and h.pid not in ours)
        return self.total_mib - self.reserved_mib - used

    def _wait_real_allocations(self) -> None:
        """Torch mode: like SGLang, weights are in GPU memory before "Load weight end"."""
        wait = bool(int(os.environ.get(ENV_TORCH_MIB) or 0))
        for child in self.children:
            if child.ack_fd >= 0:
                if wait and child.label.startswith("scheduler_"):
                    os.read(child.ack_fd, 1)  # b"" if it died: then it holds nothing either
                os.close(child.ack_fd)
                child.ack_fd = -1

    def _hold(self, fraction: float) -> None:
        """Make each scheduler hold `fraction` of the configured MiB on its GPUs."""
        if self.sim is None:
            return
        mib = int(self.settings.mib * fraction)
        for c in self.schedulers():
            try:
                self.sim.hold(c.gpus, mib, pid=c.pid)
            except Exception:  # scheduler already gone (killed from outside)
                pass

    def _avail_gb(self, held_fraction: float) -> float:
        if self.sim is None:
            return (self.total_mib - self.reserved_mib - self.settings.mib * held_fraction) / 1024
        return (self._free_mib(self.gpus[0]) - self.settings.mib * held_fraction) / 1024

    def _bar(self, desc: str | Callable[[int], str], total: int, seconds: float, style: str = "bar",
             at_half: Callable[[], None] | None = None) -> None:
        """Run a tqdm bar for `seconds`, `total` equal steps (a callable desc sees the step)."""
        t0 = time.monotonic()
        bar = Bar(desc(0) if callable(desc) else desc, total, style)
        for i in range(1, total + 1):
            if at_half is not None and i == total // 2 + 1:
                at_half()
            self._wait(t0 + seconds * i / total - time.monotonic())
            bar.update(1, desc(i) if callable(desc) and i < total else None)
        bar.close()

    def _load(self) -> None:
        """Weights, KV cache, CUDA graphs, JIT, silence: the minutes with the port closed."""
        a, s = self.args, self.settings
        total = max(0.0, s.startup_s)
        fault = s.fault
        self.log_ranks("Init torch distributed begin.")
        if self.nnodes > 1:
            self._meet_the_other_nodes()
        self._wait(total * 0.03)
        self.log_ranks("Init torch distributed ends. elapsed=0.05 s, mem usage=0.00 GB")
        avail0 = self._avail_gb(0.0)
        self.log_ranks(f"Load weight begin. avail mem={avail0:.2f} GB")
        if self.sim is not None:
            for g in self.gpus:
                free = self._free_mib(g)
                if free < s.mib:
                    raise StartupError(
                        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {s.mib / 1024:.2f} GiB. "
                        f"GPU {g} has a total capacity of {self.total_mib / 1024:.2f} GiB of which "
                        f"{max(free, 0) / 1024:.2f} GiB is free. (stand-in: other processes hold the rest)")
        weights_s = total * WEIGHTS_SHARE
        shards = max(2, round(weights_s * PROGRESS_HZ))
        crash = None
        if fault and fault.kind == "crash-on-start":
            crash = lambda: self.crash_exception("model_runner.load_model", "injected fault crash-on-start")  # noqa: E731
        self._bar("Loading safetensors checkpoint shards", shards, weights_s, "shards", at_half=crash)
        self._hold(0.45)
        self._wait_real_allocations()
        avail1 = self._avail_gb(0.45)
        self.log_ranks(f"Load weight end. elapsed={weights_s:.2f} s, type=LlamaForCausalLM, dtype=torch.bfloat16, "
                       f"avail mem={avail1:.2f} GB, mem usage={avail0 - avail1:.2f} GB.")
        self._wait(total * KV_SHARE)
        self._hold(0.95)
        kv_gb = s.mib * 0.50 / 1024
        tokens = int(kv_gb * 1024**3 / (160 * 1024))
        self.max_total_num_tokens = tokens
        self.log_ranks(f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, "
                       f"K size: {kv_gb / 2:.2f} GB, V size: {kv_gb / 2:.2f} GB")
        avail2 = self._avail_gb(0.95)
        self.log_ranks(f"Memory pool end. avail mem={avail2:.2f} GB")
        self.log_ranks(f"Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
                       f"avail mem={avail2:.2f} GB")
        graphs_s = total * GRAPHS_SHARE
        n_bs = max(2, min(len(GRAPH_BATCH_SIZES), round(graphs_s * PROGRESS_HZ)))
        bs_list = GRAPH_BATCH_SIZES[:n_bs][::-1]
        self._bar(lambda i: f"Capturing batches (bs={bs_list[min(i, n_bs - 1)]} avail_mem={avail2 - 0.02 * i:.2f} GB)",
                  n_bs, graphs_s)
        self._hold(1.0)
        avail3 = self._avail_gb(1.0)
        self.log_ranks(f"Capture target decode CUDA graph end. bs={bs_list[::-1]}, elapsed={graphs_s:.2f} s, "
                       f"mem usage={avail2 - avail3:.2f} GB, avail mem={avail3:.2f} GB.")
        self.log(f"max_total_num_tokens={tokens}, chunked_prefill_size={a.chunked_prefill_size or 8192}, "
                 f"max_prefill_tokens={a.max_prefill_tokens}, max_running_requests={a.max_running_requests or 2048}, "
                 f"context_len={self.context_len}, available_gpu_mem={avail3:.2f} GB", rank=0)
        self._wait(max(0.0, total * (1 - 0.03 - WEIGHTS_SHARE - KV_SHARE - GRAPHS_SHARE)))
        self._jit()
        self._wait(s.silent_s)  # no output at all: a JIT that looks hung

    def _jit(self) -> None:
        """DeepGEMM's JIT warm-up: minutes on a cache miss, nothing on a hit."""
        key = f"standin-{cache_key(self.args.model_path, self.tp)}"
        markers = [d / key for d in cache_dirs(os.environ)]
        if all(m.is_file() for m in markers):
            self.log(f"DeepGEMM JIT: using cached kernels ({markers[0]})", rank=0)
            return
        self.log("DeepGEMM JIT warmup: compiling kernels, which may take a long time (typically 10-20 mins)",
                 WARNING, rank=0)
        jit_s = max(0.0, self.settings.jit_s)
        self._bar("DeepGEMM warmup", max(2, round(jit_s * PROGRESS_HZ)), jit_s)
        for m in markers:
            try:
                m.parent.mkdir(parents=True, exist_ok=True)
                m.write_text(f"{SGLANG_VERSION} {self.args.model_path} tp={self.tp}\n")
            except OSError as e:
                self.log(f"Failed to write the JIT cache {m}: {e.strerror or e}; kernels will be compiled "
                         f"again at the next start", WARNING, rank=0)

    # -- HTTP and warm-up ---------------------------------------------------------------

    def url(self) -> str:
        a = self.args
        host = f"[{a.host}]" if ":" in a.host else a.host
        return f"http://{host}:{a.port}"

    def _serve(self) -> int:
        a = self.args
        signal.signal(signal.SIGINT, self._uvicorn_sigint)  # uvicorn's Server.capture_signals
        self.uvicorn(f"Started server process [{os.getpid()}]")
        self.uvicorn("Waiting for application startup.")
        self.uvicorn("Application startup complete.")
        try:
            self.http = StandinHTTPServer(a.host, a.port, _make_handler(self))
        except OSError as e:
            return self._busy_port(e)
        serve_in_thread(self.http, "http")
        self.uvicorn(f"Uvicorn running on {self.url()} (Press CTRL+C to quit)")
        self._warmup_thread = threading.Thread(target=self._warmup, name="warmup", daemon=True)
        self._warmup_thread.start()
        return self._control_loop()

    # -- SIGINT: uvicorn's graceful stop, then KeyboardInterrupt ---------------------------

    def _uvicorn_sigint(self, signum: int, frame: object) -> None:
        """uvicorn's handle_exit: the first SIGINT asks for a stop, a second forces it."""
        self.sigints += 1
        try:
            os.write(self._ctl_w, b"c")
        except OSError:
            pass

    def _uvicorn_shutdown(self) -> None:
        """uvicorn's Server.shutdown after a SIGINT (uvicorn/server.py): close the listener, wait
        for the requests in flight (no time limit), lifespan shutdown (SGLang's joins the warm-up
        thread, http_server.py:458-468), "Finished server process"; a second SIGINT skips the waits."""
        assert self.http is not None
        self.uvicorn("Shutting down")
        self.http.shutdown()
        self.http.socket.close()
        if self.http.inflight.count and self.sigints < 2:
            self.uvicorn("Waiting for connections to close. (CTRL+C to force quit)")
            while self.http.inflight.count and self.sigints < 2:
                time.sleep(0.1)
        if self.sigints < 2:
            self.uvicorn("Waiting for application shutdown.")
            while self._warmup_thread is not None and self._warmup_thread.is_alive() and self.sigints < 2:
                self._warmup_thread.join(0.1)
            self.uvicorn("Application shutdown complete.")
        self.uvicorn(f"Finished server process [{os.getpid()}]")

    def _die_of_keyboard_interrupt(self) -> NoReturn:
        """KeyboardInterrupt out of launch_server: launch_server.py's `finally:
        kill_process_tree(os.getpid(), include_parent=False)` SIGKILLs the children (the ones
        it can find), Python prints the traceback and, since 3.8, ends by SIGINT (status -2)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        pid = os.getpid()
        self.log(f"kill_process_tree called: parent_pid={pid}, include_parent=False, pid={pid}")
        self._kill_children()
        for c in self.children:
            if not c.detached:
                try:
                    os.waitpid(c.pid, 0)
                except ChildProcessError:
                    pass
        write_raw('Traceback (most recent call last):\n'
                  f'  File "{SGLANG_SRC}/launch_server.py", line 84, in <module>\n'
                  '    run_server(server_args)\n'
                  f'  File "{SGLANG_SRC}/srt/entrypoints/http_server.py", line 3009, in _setup_and_run_http_server\n'
                  '    server.run()\n'
                  'KeyboardInterrupt\n')
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(pid, signal.SIGINT)
        os._exit(130)

    def _busy_port(self, e: OSError) -> int:
        """uvicorn cannot bind: it says so, the warm-up still talks to the port's holder, exit 3."""
        a = self.args
        self.uvicorn(f"[Errno {e.errno}] error while attempting to bind on address ({a.host!r}, {a.port}): "
                     f"{(e.strerror or str(e)).lower()}", ERROR)
        self.uvicorn("Waiting for application shutdown.")
        self.uvicorn("Application shutdown complete.")
        ok = self._warmup_requests(BUSY_PORT_WARMUP_TRIES, BUSY_PORT_TIMEOUT_S, BUSY_PORT_TIMEOUT_S)
        if ok is None:
            self.log("The server is fired up and ready to roll!")
        else:
            self.log(f"Initialization failed. warmup error: {ok}", ERROR)
        self._kill_children()
        return 3

    def _warmup_requests(self, tries: int, get_timeout: float, generate_timeout: float) -> str | None:
        """SGLang's _execute_server_warmup against host:port; None on success, else the error."""
        a = self.args
        last = "no attempt"
        info: Any = None
        for _ in range(tries):
            time.sleep(WARMUP_FIRST_SLEEP_S)
            try:
                code, _, body = fetch("GET", self.url() + "/model_info", timeout=get_timeout)
                if code == 200:
                    info = json.loads(body or b"{}")
                    break
                last = f"GET /model_info: {code}"
            except (OSError, ValueError) as e:
                last = f"GET /model_info: {e!r}"
        else:
            return last
        is_generation = info.get("is_generation", True) if isinstance(info, dict) else True
        path = "/generate" if is_generation else "/encode"
        n = max(1, a.dp_size)
        request: dict[str, Any] = {"sampling_params": {"temperature": 0, "max_new_tokens": 8 if is_generation else 1},
                                   "text": ["The capital city of France is"] * n}
        if self.pd_mode != "null":
            self.log("Start of pd disaggregation warmup ...")
            request["sampling_params"]["ignore_eos"] = True
            request["bootstrap_host"] = ["2.2.2.2"] * n  # SGLang's FAKE_BOOTSTRAP_HOST
            request["bootstrap_room"] = [random.getrandbits(63) for _ in range(n)]
        try:
            code, _, reply = fetch("POST", self.url() + path, json.dumps(request).encode(), timeout=generate_timeout)
        except OSError as e:
            return f"POST {path}: {e!r}"
        if code != 200:
            return f"POST {path}: {code} {reply[:200]!r}"
        if self.pd_mode != "null":
            self.log(f"End of prefill disaggregation mode warmup with status {code}, resp: {reply[:200].decode(errors='replace')}")
        return None

    def _warmup(self) -> None:
        """The warm-up thread: then "fired up", and the server is Up."""
        fault = self.settings.fault
        if not self.args.skip_server_warmup:
            timeout = WARMUP_GENERATE_TIMEOUT_S * (3 if self.pd_mode != "null" else 1)
            error = self._warmup_requests(WARMUP_TRIES, WARMUP_GET_TIMEOUT_S, timeout)
            if error is not None and self.pd_mode == "null":
                self.log(f"Initialization failed. warmup error: {error}", ERROR)
                self._kill_children()
                os.kill(os.getpid(), signal.SIGKILL)
            if error is not None:
                self.log(f"Prefill disaggregation mode warm Up Failed: {error}")
                with self.lock:
                    self.unhealthy = True
        if fault and fault.kind == "never-ready":
            return
        if fault and fault.kind == "crash-after-ready":
            try:
                os.write(self._ctl_w, b"r")  # the main loop arms the crash timer (before any "seen ready")
            except OSError:
                pass
        with self.lock:
            self.up = True
            self.ready_at = time.monotonic()
            self.startup_time = time.time()
        if self.settings.ready_at_file:
            with open(self.settings.ready_at_file, "a") as f:
                f.write(f"{self.startup_time!r}\n")
        self.log("The server is fired up and ready to roll!")
        if fault and fault.kind == "watchdog-timeout":
            threading.Thread(target=self._stuck_forward, args=(fault.seconds,), name="scheduler-watchdog",
                             daemon=True).start()
        elif self.is_generation:
            threading.Thread(target=self._scheduler_watchdog, name="scheduler-watchdog", daemon=True).start()

    def _stuck_forward(self, seconds: float) -> None:
        """The watchdog-timeout fault: a forward pass that never returns, found by the scheduler's
        watchdog (utils/watchdog.py:133-161, WatchdogRaw created in
        scheduler_components/invariant_checker.py:518 with --watchdog-timeout). The pass sticks
        --watchdog-timeout before the watchdog fires (at once when SECONDS is shorter), the
        watchdog fires SECONDS after ready, then sleeps 5 s and SIGQUITs the main process."""
        assert self.ready_at is not None
        timeout = self.args.watchdog_timeout
        time.sleep(max(0.0, self.ready_at + max(0.0, seconds - float(timeout)) - time.monotonic()))
        self.stuck = True  # no batch advances, /health and /server_info get no answer
        time.sleep(max(0.0, self.ready_at + seconds - time.monotonic()))
        self.watchdog_lines(timeout)
        time.sleep(WATCHDOG_SIGQUIT_DELAY_S)
        self.crash([], diagnostics=True)

    def _scheduler_watchdog(self) -> None:
        """The scheduler's WatchdogRaw as SGLang 0.5.23 runs it (utils/watchdog.py:124-161 with
        scheduler_components/invariant_checker.py:494-528): every --watchdog-timeout / 2 it reads
        forward_ct while the scheduler is active (cur_batch_for_debug set), and a count unchanged
        for longer than --watchdog-timeout ends the server. A pause in place keeps the batch (the
        H100, 2026-12-07: a 10-minute pause with 2 requests running was ended 447 s in); a
        retract or abort pause, or an idle server, has none; a /slow_down sleep longer than the
        timeout holds it. A stopped scheduler's watchdog thread is stopped with it."""
        timeout = float(self.args.watchdog_timeout)
        last_counter, last_time = 0, time.monotonic()
        while True:
            until = time.monotonic() + timeout / 2
            while time.monotonic() < until:
                time.sleep(min(WATCHDOG_COUNT_POLL_S, max(0.0, until - time.monotonic())))
                self._count_steps()
            if not self.scheduler_responsive() and not self.stuck:
                continue  # SIGSTOPped: its watchdog thread too
            now = time.monotonic()
            if self._batch_held_or_running():
                if self.forward_ct == last_counter:
                    if now > last_time + timeout:
                        break
                else:
                    last_counter, last_time = self.forward_ct, now
        self.watchdog_lines(timeout)
        time.sleep(WATCHDOG_SIGQUIT_DELAY_S)
        self.crash([], diagnostics=True)

    def _batch_held_or_running(self) -> bool:
        """cur_batch_for_debug is set: requests in the running batch, not retracted by a pause
        (a pause in place keeps them; abort leaves none)."""
        with self.lock:
            # a /health's generation waits at the pause gate while paused (is_pause_cond): no batch
            running = any((r.admitted and not r.aborted) or (r.health and not self.paused)
                          for r in self.requests.values())
            retracted = self.paused and self.pause_mode == "retract"
        return running and not retracted

    def _count_steps(self) -> None:
        """forward_ct goes up by one per step the scheduler runs: while a batch runs and is not
        held (a pause, a stuck pass, a stop), and, under /slow_down, once per step period."""
        if not self._batch_held_or_running() or not self._scheduler_runs_batches():
            return
        if self.forward_sleep:
            steps = int((time.monotonic() - self.slowed_at) / self.step_period())
            if steps != self._slow_steps:
                self._slow_steps = steps
                self.forward_ct += 1
        else:
            self.forward_ct += 1

    def watchdog_lines(self, timeout: float) -> None:
        """What WatchdogRaw._watchdog_once prints in each scheduler: its debug info, py-spy's
        failure (no py-spy in the image), the timeout line, one empty line on stderr and stdout."""
        with self.lock:
            reqs = [r.rid for r in self.requests.values() if r.admitted or r.health]
        for c in self.schedulers():
            r = c.rank
            self.log(f"Scheduler debug info:\nscheduler.cur_batch_for_debug.batch_size()={len(reqs)}\n"
                     f"scheduler.cur_batch_for_debug.reqs={[f'Req(rid={rid})' for rid in reqs]}", ERROR, r)
            self._pyspy_failed(c.pid, r)
            self.log(f"Scheduler watchdog timeout (self.watchdog_timeout={timeout!r}, self.soft=False)", ERROR, r)
        sys.stderr.write("\n")
        sys.stderr.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _control_loop(self) -> int:
        """The main thread while serving: lazy handler, SIGTERM, the drain watchdog, injected crash."""
        s = self.settings
        crash_at: float | None = None
        next_check: float | None = None
        while True:
            if self.dying:  # the SIGQUIT handler's diagnostics block SGLang's event loop: no SIGTERM
                time.sleep(1.0)  # handler and no drain check run before its kill (a thread's)
                continue
            now = time.monotonic()
            deadlines = [d for d in (crash_at, next_check) if d is not None]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready, _, _ = select.select([self._ctl_r], [], [], 1.0 if timeout is None else min(timeout, 1.0))
            if self.dying:
                continue  # (what came meanwhile is left unread, as on SGLang's blocked loop)
            if ready:
                try:
                    data = os.read(self._ctl_r, 4096)
                except BlockingIOError:
                    data = b""
                if b"i" in data:
                    self._install_sigterm()
                if s.fault and s.fault.kind == "crash-after-ready":
                    if b"r" in data:  # up: armed, for when nobody probes
                        crash_at = time.monotonic() + s.fault.seconds + s.health_timeout_s
                    if b"s" in data and crash_at is not None:  # first seen ready by a prober
                        crash_at = time.monotonic() + s.fault.seconds
                if b"t" in data and not self.term_seen:
                    self.term_seen = True
                    self._on_sigterm()
                    next_check = self._first_drain_check()
                if b"c" in data:
                    self._uvicorn_shutdown()
                    raise KeyboardInterrupt  # capture_signals re-raises the SIGINT it caught
            now = time.monotonic()
            if crash_at is not None and now >= crash_at and s.fault is not None:
                self.crash_exception("event_loop_overlap", f"injected fault crash-after-ready:{s.fault.seconds:g}")
            if next_check is not None and now >= next_check:
                if self._drain_check():
                    return self._graceful_exit()
                next_check += s.drain_poll_s
                while next_check <= time.monotonic():
                    next_check += s.drain_poll_s

    def _first_drain_check(self) -> float:
        poll = self.settings.drain_poll_s
        t_term = self.term_at if self.term_at is not None else time.monotonic()
        if DRAIN_CLOCK == "immediate":
            return t_term
        if DRAIN_CLOCK == "sigterm" or self.handler_installed_at is None:
            return t_term + poll
        t0 = self.handler_installed_at
        k = int((t_term - t0) // poll) + 1
        return t0 + k * poll

    def _drain_check(self) -> bool:
        """One wake-up of SGLang's sigterm watchdog after SIGTERM; True when it may exit."""
        with self.lock:
            rids = list(self.requests)
            unhealthy = self.unhealthy
        if unhealthy:
            self.log("Signal SIGTERM received while health check failed. Force exiting.", ERROR)
            return True
        if self.settings.force_shutdown:
            self.log("Signal SIGTERM received while force shutdown flag set. Force exiting.", ERROR)
            return True
        self.log(f"Gracefully exiting... Remaining number of requests {len(rids)}. "
                 f"Remaining requests remaining_rids={rids}.")
        return not rids

    def _graceful_exit(self) -> int:
        """After the drain: stop the children (15 s, then SIGKILL), remove our files, exit 0."""
        fault = self.settings.fault
        if fault and fault.kind == "exit-on-term-slow" and self.term_at is not None:
            time.sleep(max(0.0, self.term_at + fault.seconds - time.monotonic()))
        self._stop_children()
        self.log("Gracefully exiting... all schedulers stopped.")
        self._remove_files()
        for srv in (self.bootstrap, self.http):
            if srv is not None:
                srv.server_close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # -- children: watchdog, stop, crash ------------------------------------------------

    def _watchdog(self) -> None:
        """SGLang's SubprocessWatchdog: a dead child sends the server down its crash path."""
        while True:
            time.sleep(WATCHDOG_POLL_S)
            with self.children_lock:
                if self.watchdog_off:
                    return
                dead = next((c for c in self.children if c.poll()), None)
            if dead is not None:
                self.crash([f"Subprocess {dead.label} (pid={dead.pid}) crashed with exit code {dead.exit_code}. "
                            f"Triggering SIGQUIT for cleanup..."])

    def _stop_children(self) -> None:
        """Tell every child to exit, wait up to 15 s, then SIGKILL stragglers."""
        with self.children_lock:
            self.watchdog_off = True
        for c in self.children:
            try:
                os.write(c.wfd, b"q")
            except OSError:
                pass
        deadline = time.monotonic() + SCHEDULER_STOP_WAIT_S
        pending = list(self.children)
        while pending and time.monotonic() < deadline:
            pending = [c for c in pending if not c.poll()]
            if pending:
                time.sleep(0.005)
        for c in pending:
            try:
                os.kill(c.pid, signal.SIGKILL)
            except OSError:
                pass
        for c in pending:
            if not c.detached:
                try:
                    os.waitpid(c.pid, 0)
                except ChildProcessError:
                    pass

    def _kill_children(self) -> None:
        """SIGKILL every child we can find (kill_process_tree): detached schedulers are not found."""
        with self.children_lock:
            self.watchdog_off = True
        for c in self.children:
            if not c.detached:
                try:
                    os.kill(c.pid, signal.SIGKILL)
                except OSError:
                    pass

    def _remove_files(self) -> None:
        for path, sock in self.ipc:
            if sock is not None:
                sock.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        for c in self.children:
            for path in c.shm:
                if path.startswith(LOADS_PREFIX):
                    continue  # the real server never removes it
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def files(self) -> list[str]:
        return [p for p, _ in self.ipc] + [p for c in self.children for p in c.shm]

    def crash_exception(self, where: str, message: str) -> NoReturn:
        """A scheduler raised: SGLang's scheduler logs it and SIGQUITs the main process."""
        tb = (f"Scheduler hit an exception: Traceback (most recent call last):\n"
              f'  File "{SCHEDULER_SRC}", line 3012, in run_scheduler_process\n'
              f"    scheduler.event_loop_overlap()\n"
              f'  File "{SCHEDULER_SRC}", line 1187, in {where.rpartition(".")[2]}\n'
              f"    raise RuntimeError(...)\n"
              f"RuntimeError: {message} (stand-in)")
        self.log(tb, ERROR, rank=0)
        if self.settings.killpg_on_exception:
            sys.stderr.flush()
            os.killpg(0, signal.SIGKILL)  # the whole group: ours, or whoever started us in theirs
        self.crash([])

    def sigquit_line(self) -> str:
        """What the main process's SIGQUIT handler says: the launch-phase handler
        (entrypoints/engine.py:1976-1982) until the lazy handlers are installed, then
        SignalHandler.running_phase_sigquit_handler (tokenizer_manager.py:2457, :4072-4083),
        called by the event loop without arguments. Both end in kill_process_tree: SIGKILL."""
        if self.handler_installed.is_set():
            return "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
        return "Received sigquit from a child process. It usually means the child failed."

    def crash(self, lines: list[str], diagnostics: bool = False) -> NoReturn:
        """SGLang's SIGQUIT path: kill the children (tree), then SIGKILL itself. Files stay.

        `diagnostics`: the schedulers are alive (their watchdog sent the SIGQUIT), and the
        running-phase handler's dump_requests_before_crash (tokenizer_manager.py:3394-3506)
        first sleeps 5 s, runs py-spy on them and asks for CUDA coredumps, then waits
        SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS (60 s) before the kill: its event loop is
        blocked all that time, so the front end answers nothing (seen on the H100, 2026-12-07)."""
        if not self.crashing.acquire(blocking=False):
            while True:  # another thread is already taking the process down
                time.sleep(3600)
        for line in lines:
            self.log(line, ERROR)
        self.log(self.sigquit_line(), ERROR)
        if diagnostics and self.handler_installed.is_set():
            self._crash_diagnostics()
        self._kill_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)

    def _pyspy_failed(self, pid: int, rank: int | None = None) -> None:
        """pyspy_dump_schedulers with no py-spy in the image: its two tries (the second with two
        spaces, as the H100 logged it), then its verdict."""
        for cmd in (f"py-spy dump --native --pid {pid}", f"py-spy dump  --pid {pid}"):
            self.log(f"Pyspy failed ({cmd}). Error: /bin/sh: 1: py-spy: not found\n", ERROR, rank)
        self.log(f"All pyspy dump attempts failed for PID {pid}.", ERROR, rank)

    def _crash_diagnostics(self) -> None:
        """dump_requests_before_crash's py-spy and CUDA coredump steps, with their waits."""
        def flag(name: str) -> bool:
            return os.environ.get(name, "true").strip().lower() not in ("0", "false", "no", "off", "")
        pyspy, coredump = flag(ENV_PYSPY_BEFORE_CRASH), flag(ENV_COREDUMP_BEFORE_CRASH)
        if not (pyspy or coredump):
            return
        self.dying = True
        self.log("Sleeping 5 seconds before crash diagnostics to let GPU activity settle.")
        time.sleep(CRASH_DIAGNOSTICS_SLEEP_S)
        for c in self.schedulers():
            if pyspy:
                self._pyspy_failed(c.pid)
        if coredump:
            self.log("CUDA user-triggered coredump is not enabled. Set CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 "
                     "before CUDA initialization.", WARNING)
            try:
                wait = float(os.environ.get(ENV_COREDUMP_WAIT, "60"))
            except ValueError:
                wait = 60.0
            if wait > 0:
                self.log(f"Waiting {wait:.1f} seconds for CUDA coredumps before exiting.")
                time.sleep(wait)

    # -- request handling (called from handler threads) --------------------------------

    def health_stall_s(self) -> float | None:
        st = self.settings.health_stall
        if st is None or self.ready_at is None:
            return None
        seconds, duration = st
        return seconds if time.monotonic() < self.ready_at + duration else None

    def step_s(self) -> float:
        """One scheduler step: what a generation joining the running batch waits for its token."""
        return self.settings.token_s or DEFAULT_STEP_S

    def scheduler_responsive(self) -> bool:
        """False while the scheduler loop cannot run: a scheduler SIGSTOPped, or a forward stuck."""
        if self.stuck:
            return False
        return not any(_stopped(c.pid) for c in self.schedulers())

    def detokenizer_stopped(self) -> bool:
        """The detokenizer SIGSTOPped: the scheduler runs on (it answers /server_info, /ready stays
        200), but no output reaches the front end: every generation, /health's too, waits."""
        return any(_stopped(c.pid) for c in self.children if c.label == "detokenizer")

    def step_period(self) -> float:
        """One scheduler step with /slow_down: its sleep before the batch, then the batch."""
        return self.step_s() + (self.forward_sleep or 0.0)

    def _scheduler_sleeping(self) -> bool:
        """In a /slow_down sleep: only while it has a batch to run (run_batch sleeps, an idle loop does not)."""
        with self.lock:
            has_batch = any(r.admitted or r.health for r in self.requests.values())
        return self.forward_sleep is not None and has_batch

    def _wait_for_step_boundary(self) -> None:
        """A control request (/server_info, /slow_down) waits for the end of the scheduler's step:
        with /slow_down and a batch, the end of its sleep and batch; an unbounded sleep never ends."""
        if not self._scheduler_sleeping():
            return
        period = self.step_period()
        since = time.monotonic() - self.slowed_at
        boundary = self.slowed_at + (int(since / period) + 1) * period
        while self._scheduler_sleeping() and time.monotonic() < boundary:
            time.sleep(SCHEDULER_ASK_POLL_S)

    def slow_down(self, body: dict[str, Any]) -> tuple[int, Any]:
        """POST /slow_down {"forward_sleep_time": SECONDS | null} (SlowDownReqInput; the scheduler's
        slow_down sets forward_sleep_time, None or <= 0 clears it, and run_batch sleeps it before each
        batch). A control request: answered by the scheduler between two steps, so a scheduler asleep
        for ever with requests in flight never answers the one that would wake it."""
        value = body.get("forward_sleep_time")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return 422, {"detail": [{"type": "float_type", "loc": ["body", "forward_sleep_time"],
                                     "msg": "Input should be a valid number", "input": value}]}
        self.ask_scheduler()
        self.forward_sleep = float(value) if value is not None and value > 0 else None
        self.slowed_at = time.monotonic()
        return 200, None

    def _scheduler_runs_batches(self) -> bool:
        """Batches advance: not paused in place/retracted (abort mode has none left), not stopped."""
        with self.lock:
            held = self.paused and self.pause_mode != "abort"
        return not held and self.scheduler_responsive()

    def health(self) -> int:
        """/health = /health_generate: SGLang's one-token generation, polled every 1 s.

        http_server.py:721-799 (0.5.23): the generation goes through generate_request, so it
        first waits for a pause to end (tokenizer_manager.py:938-939); then it joins the
        running batch and its token comes after one scheduler step, busy or idle. Success
        sets the status back to Up (:784), which clears the /ready latch; a timeout sets
        UnHealthy (:798).
        """
        with self.lock:
            draining, up = self.draining, self.up
        if draining:
            self.log("Health check request received during shutdown. Returning 503.")
            return 503
        if not up:
            return 503
        tic = time.monotonic()
        tic_wall = time.time()
        timeout = self.settings.health_timeout_s
        stall = self.health_stall_s()
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        with self.lock:
            self.requests[rid] = Request(rid, tic + timeout, health=True)
        try:
            k = 0
            while time.monotonic() < tic + timeout:
                k += 1
                time.sleep(max(0.0, tic + k * HEALTH_POLL_S - time.monotonic()))
                if self._health_answered(tic, stall, timeout):
                    with self.lock:
                        self.unhealthy = False
                    return 200
            with self.lock:
                heartbeat = time.time() - (time.monotonic() - self.last_receive) if self.last_receive else tic_wall
            self.log(f"Health check failed. Server couldn't get a response from detokenizer for last "
                     f"{timeout:g} seconds. tic start time: {time.strftime('%H:%M:%S', time.localtime(tic_wall))}. "
                     f"last_heartbeat time: {time.strftime('%H:%M:%S', time.localtime(heartbeat))}", ERROR)
            with self.lock:
                self.unhealthy = True
            return 503
        finally:
            with self.lock:
                self.requests.pop(rid, None)

    def _health_answered(self, tic: float, stall: float | None, timeout: float) -> bool:
        """Has the health generation sent at `tic` come back by now?"""
        now = time.monotonic()
        if stall is not None:  # HEALTH_STALL: the scheduler answers only SECONDS after the probe began
            return (stall < timeout and now >= tic + stall - 1e-3 and self.scheduler_responsive()
                    and not self.detokenizer_stopped())
        with self.lock:
            if self.paused:
                return False  # still waiting on is_pause_cond: nothing was sent to the scheduler
            sent = max(tic, self.resumed_at)
        return (now >= sent + self.step_period() - 1e-3 and self.scheduler_responsive()
                and not self.detokenizer_stopped())

    def ready_status(self) -> int:
        """/ready: is_ready() = not is_pause and not gracefully_exit and status Up
        (tokenizer_manager.py:728-734); Up excludes UnHealthy, so a failed /health latches it."""
        with self.lock:
            code = 200 if self.up and not self.paused and not self.draining and not self.unhealthy else 503
        if code == 200:
            self._seen_ready()
        return code

    def plain_health(self) -> int:
        """/health with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0: 503 only while starting or
        shutting down (http_server.py:731-748); neither a pause nor UnHealthy matters."""
        with self.lock:
            draining, up = self.draining, self.up
        if draining:
            self.log("Health check request received during shutdown. Returning 503.")
        return 200 if up and not draining else 503

    def pause_generation(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST /pause_generation (tokenizer_manager.py:2267-2280, http_server.py:1831-1841).

        Sets is_pause at once (/ready 503, new generations wait). "abort": aborts everything in
        flight and answers only when no admitted request is left, checking again every 1 s;
        "retract"/"in_place": the scheduler holds its batch, the answer is immediate.
        """
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return 422, {"detail": [{"type": "literal_error", "loc": ["body", "mode"],
                                     "msg": f"Input should be {', '.join(repr(m) for m in PAUSE_MODES)}",
                                     "input": mode}]}
        with self.pause_cond:
            self.paused = True
            self.pause_mode = mode
        while mode == "abort":
            with self.lock:
                admitted = [r for r in self.requests.values() if r.admitted and not r.health]
                for r in admitted:
                    r.aborted = True
            if not admitted:
                break
            time.sleep(PAUSE_ABORT_RECHECK_S)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _checkpointed_scheduler(self) -> Child | None:
        """A scheduler whose simulated GPU memory is parked (parking/simulated.py moves its
        holding to holders/<uid>/.parked.<pid>.json): it is checkpointed."""
        if self.sim is None:
            return None
        me = os.geteuid()
        try:  # only our own user's word counts: its directory and the file, ours, no link
            dirs = [e.path for e in os.scandir(self.sim.directory / "holders")
                    if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid == me]
        except OSError:
            return None
        for c in self.schedulers():
            for d in dirs:
                try:
                    st = os.lstat(os.path.join(d, f".parked.{c.pid}.json"))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_uid == me:
                    return c
        return None

    def release_memory(self, body: dict[str, Any]) -> tuple[int, Any]:
        """POST /release_memory_occupation {"tags": [...] | null} (scheduler_components/weight_updater.py:337):
        without --enable-memory-saver a warning and nothing freed; with it, each tag's share of the
        held memory goes back to the (simulated) GPU, answered null. The scheduler asserts it idle
        unless generation is paused (retract empties the running batch, in_place does not): an
        admitted request in flight then is an AssertionError, the scheduler's crash path."""
        tags = [t for t in (body.get("tags") or list(MEMORY_TAG_SHARE)) if t in MEMORY_TAG_SHARE]
        if not self.args.enable_memory_saver:
            self.log("`release_memory_occupation` will not save memory because torch_memory_saver is not enabled. "
                     "Potential causes: `enable_memory_saver` is false, or torch_memory_saver has installation issues.",
                     WARNING)
            return 200, None
        with self.lock:
            running = [r for r in self.requests.values() if r.admitted and not r.health and not r.scheduled]
        if running and not (self.paused and self.pause_mode == "retract"):
            self.crash_exception("weight_updater.release_memory_occupation",
                                 "AssertionError: release_memory_occupation should be called only when server is idle.")
        self.released |= set(tags)
        self._hold(1.0 - sum(MEMORY_TAG_SHARE[t] for t in self.released))
        return 200, None

    def resume_memory(self, body: dict[str, Any]) -> tuple[int, Any]:
        """POST /resume_memory_occupation {"tags": [...] | null}: the tags' memory held again, null."""
        tags = [t for t in (body.get("tags") or list(MEMORY_TAG_SHARE)) if t in MEMORY_TAG_SHARE]
        if self.args.enable_memory_saver:
            self.released -= set(tags)
            self._hold(1.0 - sum(MEMORY_TAG_SHARE[t] for t in self.released))
        return 200, None

    def continue_generation(self) -> tuple[int, dict[str, Any]]:
        """POST /continue_generation: is_pause off, waiting generations go on (tokenizer_manager.py:2282-2286).
        An UnHealthy status from a /health that failed during the pause stays: /ready stays 503."""
        with self.pause_cond:
            self.paused = False
            self.resumed_at = time.monotonic()
            self.pause_cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _seen_ready(self) -> None:
        """The first 200 on /health or /ready: crash-after-ready counts from here."""
        with self.lock:
            first = not self.seen_ready
            self.seen_ready = True
        if first:
            try:
                os.write(self._ctl_w, b"s")
            except OSError:
                pass

    def note_health_200(self) -> None:
        self._seen_ready()
        with self.lock:
            first = not self.first_health_200
            self.first_health_200 = True
        if first and self.settings.ready_file:
            with open(self.settings.ready_file, "a") as f:
                f.write(f"{time.time()!r}\n")

    def model_info(self) -> dict[str, Any]:
        a = self.args
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": a.tokenizer_path or self.model_path,
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

    def ask_scheduler(self) -> None:
        """get_internal_state's round trip (tokenizer_control_mixin.py:967-974): the scheduler
        answers control requests between batches, also while generation is paused (its loop
        runs process_input_requests before it looks at _engine_paused), but not while a
        scheduler is stopped or stuck, nor before a HEALTH_STALL is over. The communicator
        (managers/communicator.py) has no timeout: the caller waits as long as it takes."""
        self.request_sigterm_handler()  # get_internal_state calls auto_create_handle_loop
        t0 = time.monotonic()
        stall = self.health_stall_s()
        if stall is not None:
            time.sleep(max(0.0, t0 + stall - time.monotonic()))
        while not self.scheduler_responsive():
            time.sleep(SCHEDULER_ASK_POLL_S)
        self._wait_for_step_boundary()

    def server_info(self) -> dict[str, Any]:
        self.ask_scheduler()
        info: dict[str, Any] = dict(vars(self.args))
        with self.lock:
            status = "ready" if self.up else "starting"
        info.update({
            "model_path": self.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.model_path,
            "served_model_name": self.served_model_name,
            "context_length": self.args.context_length,
            "launch_command": redaction.redact_watermark_command_line(
                [sys.executable, "-m", "sglang.launch_server", *self.argv]),
            "status": status,
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
            "scheduler_pids": [c.pid for c in self.children],
            "detokenizer_pid": next((c.pid for c in self.children if c.label == "detokenizer"), None),
            "stand_in_files": self.files(),
            "stand_in_mm_segments": self.live_mm_segments(),
        })
        return redaction.redact_watermark_secrets(info)  # http_server.py:880: admin_api_key stays in

    def _without_bootstrap_room(self, body: dict[str, Any]) -> tuple[int, Any] | None:
        """A decode answers only requests a router paired with a prefill (bootstrap_room set):
        a client that reaches it directly gets 400, as from the real scheduler (measured on the
        device machine, 2026-12-06). With the `fake` backend SGLang numbers the rooms itself."""
        if self.pd_mode != "decode" or self.args.disaggregation_transfer_backend == "fake" or body.get("bootstrap_room") is not None:
            return None
        message = "Invalid request: Disaggregated request received without bootstrap room id."
        self.log(f"[http_server] Error: {message}", ERROR)
        return 400, {"error": {"message": message}}

    def running(self) -> int:
        """The scheduler's running requests (its metrics gauge): a request whose tokens are all
        made is no longer one, even while the detokenizer holds its output."""
        with self.lock:
            return sum(1 for r in self.requests.values() if not r.health and not r.scheduled)

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        """Answer a /generate body like SGLang; honours a simulated duration.

        The duration comes from sampling_params.sleep or a top-level stub_sleep_s, so
        tests can keep a request in flight while they stop the server; the router drops
        both, so behind it max_new_tokens x SUPERVISORD_GPU_STANDIN_TOKEN_S is used.
        """
        self.request_sigterm_handler()  # SGLang's auto_create_handle_loop
        if refused := self._without_bootstrap_room(body):
            return refused
        if self.args.log_requests:
            self.log(f"Receive: obj=GenerateReqInput({json.dumps(body, sort_keys=True)})")
        sp = body.get("sampling_params") or {}
        if isinstance(sp, list):
            sp = sp[0] if sp else {}
        delay = float(sp.get("sleep") or body.get("stub_sleep_s") or 0.0)
        if not delay and self.settings.token_s:  # what survives a router: time grows with the tokens asked for
            delay = self.settings.token_s * float(sp.get("max_new_tokens") or 16)
        started = time.monotonic()
        rid_value = body.get("rid")
        if isinstance(rid_value, list):  # a batch's rids: tokenizer_manager.py:3836 refuses a repeat
            seen: set[str] = set()
            for one in map(str, rid_value):
                if one in seen:
                    self.log(f"[http_server] Error: Duplicate request ID detected: {one}", ERROR)
                    return 400, {"error": {"message": f"Duplicate request ID detected: {one}"}}
                seen.add(one)
        rid = rid_value if isinstance(rid_value, str) and rid_value else f"{random.getrandbits(64):032x}"
        req = Request(rid, started + max(0.0, delay))
        with self.lock:
            if rid in self.requests:
                req.rid = rid = f"{rid}-{random.getrandbits(32):08x}"
            self.requests[rid] = req
        segments: list[str] = []
        try:
            self._wait_for_pause_to_end(req)
            if (parked := self._checkpointed_scheduler()) is not None and not req.health:
                # the real 0.5.23 on an H100 (2026-12-07, the driver API): a request that reached a
                # checkpointed scheduler killed it a second later (SIGSEGV in cudaEventQuery, from
                # the pinned host allocator); SGLang's watchdog then took the server down
                os.kill(parked.pid, signal.SIGSEGV)
                time.sleep(3 * WATCHDOG_POLL_S)
            if "kv_cache" in self.released and not req.health:
                # the real 0.5.23 on an H100 (2026-12-07): a prefill writes to the released pool
                self.crash_exception("schedule_batch.prepare_for_extend",
                                     "ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
            segments = self.create_mm_segments(self.settings.mm_shm)
            self._run_on_scheduler(req, delay)
            req.scheduled = True
            while self.detokenizer_stopped():  # its output goes through the detokenizer
                time.sleep(SCHEDULER_ASK_POLL_S)
        finally:
            with self.lock:
                self.requests.pop(rid, None)
                self.last_receive = time.monotonic()
            self.unlink_mm_segments(segments)
        batch = isinstance(body.get("text"), list) or (
            isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list))
        n = len(body.get("text") or body.get("input_ids") or []) if batch else 1
        max_new = int(sp.get("max_new_tokens") or 16)
        out_tokens = 0 if req.aborted else max(0, min(max_new, 16))
        finish: dict[str, Any] = ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                                  if req.aborted else {"type": "length", "length": out_tokens})
        results = []
        for i in range(n):
            prompt = body["text"][i] if batch and body.get("text") else body.get("text")
            prompt_tokens = len(str(prompt or "").split()) or len(body.get("input_ids") or []) or 1
            results.append({
                "text": " stand-in" * out_tokens,
                "output_ids": list(range(1000, 1000 + out_tokens)),
                "meta_info": {
                    "id": rid if n == 1 else f"{rid}-{i}",
                    "finish_reason": finish,
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

    def _wait_for_pause_to_end(self, req: Request) -> None:
        """generate_request waits on is_pause_cond before tokenizing (tokenizer_manager.py:938-939)."""
        with self.pause_cond:
            while self.paused:
                self.pause_cond.wait()
            req.admitted = True

    def _run_on_scheduler(self, req: Request, seconds: float) -> None:
        """`seconds` of scheduler time: frozen while the batch is held (pause in place/retract, a
        stopped or stuck scheduler); cut short, at the next step, by an abort."""
        remaining = seconds
        last = time.monotonic()
        while remaining > 0 and not req.aborted:
            time.sleep(min(SCHEDULER_ASK_POLL_S, remaining))
            now = time.monotonic()
            if self._scheduler_runs_batches():  # slowed down: one step's work per step and its sleep
                remaining -= (now - last) * self.step_s() / self.step_period()
            last = now

    def create_mm_segments(self, n: int) -> list[str]:
        """The tokenizer side's multimodal features (MM_SHM): SharedMemory(create=True) named by
        make_shm_name("mm") (utils/stale_shm_cleanup.py:31-33), closed at once (mm_utils.py:1377-1394)."""
        paths = []
        for _ in range(n):
            path = f"/dev/shm/sgl_shm_mm_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError:
                continue
            try:
                os.ftruncate(fd, MM_SEGMENT_BYTES)
            finally:
                os.close(fd)
            paths.append(path)
        with self.lock:
            self.mm_segments.update(paths)
        return paths

    def unlink_mm_segments(self, paths: list[str]) -> None:
        """The consumer's close_and_unlink: only a request that completes gets here."""
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        with self.lock:
            self.mm_segments.difference_update(paths)

    def live_mm_segments(self) -> list[str]:
        with self.lock:
            return sorted(self.mm_segments)

    def metrics_text(self) -> str:
        label = f'model_name="{self.served_model_name}"'
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{label}}} {self.running()}",
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


def _fake_backend_on_a_prefill() -> int:
    """SGLang's ServerArgs refuses `fake` on a prefill with an assertion, before any child or
    port (the prefill needs a real KV sender): its traceback on stderr, exit 1."""
    sys.stderr.write("Traceback (most recent call last):\n  File \"sglang/srt/server_args.py\", in _handle_pd_disaggregation\n"
                     "AssertionError: Prefill server does not support 'fake' as the transfer backend\n")
    sys.stderr.flush()
    return 1


class _BootstrapHandler(JSONHandler):
    """The prefill's KV bootstrap port: only has to accept connections and answer."""

    def do_GET(self) -> None:
        self.send_json(200, {"status": "ok"})

    do_PUT = do_POST = do_GET


class _FollowerHealthHandler(JSONHandler):
    """launch_dummy_health_check_server: /ping, /health and /health_generate answer 200, nothing else."""

    def do_GET(self) -> None:
        if self.path.split("?")[0] in ("/ping", "/health", "/health_generate"):
            self.send_empty(200)
        else:
            self.send_json(404, {"detail": "Not Found"})

    do_POST = do_GET


def _make_handler(app: StandinServer) -> type[JSONHandler]:
    class Handler(JSONHandler):
        def log_request(self, code: Any = "-", size: Any = "-") -> None:
            try:
                status = int(code)
            except (TypeError, ValueError):
                return
            phrase = self.responses.get(status, ("",))[0]
            app.access_log(self.client_address, self.requestline, status, phrase)

        def _health(self, generation: bool = True) -> None:
            if app.hung:
                while True:  # after SIGTERM with hang-on-term: never answer
                    time.sleep(3600)
            if not generation:
                status = app.plain_health()
            else:
                status = app.health()
            if status == 200:
                app.note_health_200()
            self.send_empty(status)

        def _models(self) -> None:
            self.send_json(200, {"object": "list", "data": [{
                "id": app.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "sglang", "root": app.served_model_name, "parent": None,
                "max_model_len": app.context_len}]})

        def _loads(self) -> None:
            n = app.running()
            self.send_json(200, {"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
                "dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0, "num_total_reqs": n,
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
            if status == 200 and isinstance(body, dict) and body.get("stream"):
                self._stream(result)
            else:
                self.send_json(status, result)

        def _stream(self, result: Any) -> None:
            chunks = result if isinstance(result, list) else [result]
            payload = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            self.send_bytes(200, payload, "text/event-stream")

        def _pause(self) -> None:
            try:
                body = self.read_json()
            except ValueError:
                self.send_json(400, {"error": {"message": "invalid JSON body"}})
                return
            self.send_json(*app.pause_generation(body if isinstance(body, dict) else {}))

        def _memory(self, call: Callable[[dict[str, Any]], tuple[int, Any]]) -> None:
            try:
                body = self.read_json()
            except ValueError:
                self.send_json(400, {"error": {"message": "invalid JSON body"}})
                return
            self.send_json(*call(body if isinstance(body, dict) else {}))

        def _slow_down(self) -> None:
            try:
                body = self.read_json() if self.command == "POST" else {}
            except ValueError:
                self.send_json(400, {"error": {"message": "invalid JSON body"}})
                return
            self.send_json(*app.slow_down(body if isinstance(body, dict) else {}))

        def _refused(self) -> bool:
            """SGLang's key check (auth.py), before any route: 401 {"error": "Unauthorized"}."""
            status = redaction.refusal(self.command, self.path.split("?")[0], self.headers.get("Authorization"),
                                       app.args.api_key, app.args.admin_api_key)
            if status is not None:
                if self.command == "POST":
                    self.read_body()  # read, so closing the connection does not reset it under the answer
                self.send_json(status, {"error": "Unauthorized"})
            return status is not None

        def do_GET(self) -> None:
            with self.server.inflight:
                self._unless_dying()
                if not self._refused():
                    self._get()

        def do_POST(self) -> None:
            with self.server.inflight:
                self._unless_dying()
                if not self._refused():
                    self._post()

        def _unless_dying(self) -> None:
            """The SIGQUIT handler's crash diagnostics block the event loop: no answer, ever."""
            while app.dying:
                time.sleep(3600)

        def _get(self) -> None:
            self.dispatch({
                "/health": lambda: self._health(app.settings.health_generation),
                "/health_generate": self._health,
                "/ready": lambda: self.send_empty(app.ready_status()),
                "/v1/models": self._models,
                "/model_info": lambda: self.send_json(200, app.model_info()),
                "/get_model_info": self._deprecated_model_info,
                "/server_info": lambda: self.send_json(200, app.server_info()),
                "/get_server_info": lambda: self.send_json(200, app.server_info()),
                "/v1/loads": self._loads, "/metrics": self._metrics, "/slow_down": self._slow_down,
                "/flush_cache": lambda: self.send_text(200, "Cache flushed.\n"),
            })

        def _deprecated_model_info(self) -> None:
            """http_server.py:805: anyone's GET /get_model_info writes a WARNING line (not the access log)."""
            app.log("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                    "Please use '/model_info' instead.", WARNING)
            self.send_json(200, app.model_info())

        def _post(self) -> None:
            self.dispatch({
                "/generate": self._generate,
                "/pause_generation": self._pause,
                "/continue_generation": lambda: self.send_json(*app.continue_generation()),
                "/release_memory_occupation": lambda: self._memory(app.release_memory),
                "/resume_memory_occupation": lambda: self._memory(app.resume_memory),
                "/slow_down": self._slow_down,
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
