"""Each server's admin key: SGLang's `--admin-api-key`, and how it reaches the server.

Why: SGLang 0.5.23 (srt/utils/auth.py, srt/entrypoints/http_server.py) gives each endpoint a
level. NORMAL endpoints (/generate, /v1/*, /server_info, /model_info, /v1/loads) want `--api-key`
when one is set, never the admin key. ADMIN_OPTIONAL ones (/pause_generation,
/continue_generation, /release_memory_occupation, /resume_memory_occupation, /slow_down,
/update_weights_from_disk and the rest of the weight-update family, /pd_role_switch,
/flush_cache, /abort_request, /set_internal_state, /start_profile, the LoRA loaders, ...)
answer anyone when neither key is set: one local user's `POST /pause_generation` stopped all
generation behind the router. With `--admin-api-key KEY` they want `Authorization: Bearer KEY`
(401 "Unauthorized" without it; --api-key is then not accepted there). Paths starting with
/health, /ready or /metrics are always open; so all of the daemon's own calls (/health, /ready,
/server_info, /v1/loads, /metrics) need no key.

Where the key lives: one per server and instance, `<runtime_dir>/<instance>/<server>.admin.key`,
made and checked exactly like the router's control-plane key (sglang/router_key.py: 0600, the
daemon's, O_EXCL|O_NOFOLLOW, fstat-checked on every read). The server gets it in its environment
and SERVER_SHIM moves it into the server's in-process argv, so /proc/PID/cmdline (world-readable)
never shows it. The server's own user can read it anyway, by design: SGLang hands it to every
scheduler process, where the model code runs; that user can stop or kill its own server already.

Upstream's leak, closed by the shim: SGLang 0.5.23 puts every ServerArgs field, admin_api_key
included, and the launch command line into GET /server_info (a NORMAL endpoint, open to anyone
who reaches the port, and proxied by the router's open /get_server_info) and into its start-up
log line `server_args={...}`. Both pass through SGLang's own secret redaction
(srt/sampling/watermarking/core.py: redact_watermark_secrets, redact_watermark_command_line),
so the shim wraps those two to replace the key with "<redacted>" as well. If that module is not
there (another SGLang), the shim refuses to start rather than run with a key anyone can read.
"""

from __future__ import annotations

from pathlib import Path

KEY_ENV = "SUPERVISORD_GPU_ADMIN_KEY"
KEY_SUFFIX = ".admin.key"
REDACTED = "<redacted>"

#: where each server program keeps SGLang's secret redaction (the stand-in imitates it)
REDACTION_MODULES = {
    "sglang.launch_server": "sglang.srt.sampling.watermarking.core",
    "supervisord_gpu.rehearsal.standin_server": "supervisord_gpu.rehearsal.standin_redaction",
}

#: Run as `PYTHON -c SERVER_SHIM MODULE ARGS...` (or `PYTHON -c SERVER_SHIM SCRIPT.py ARGS...`):
#: the key goes from the environment into the server's own argv (`ps` shows it without), the
#: redaction learns the key, then the program runs as `python -m MODULE ARGS...` would.
SERVER_SHIM = (
    f"import importlib, os, runpy, sys; key = os.environ.pop({KEY_ENV!r}, ''); "
    f"key or sys.exit('supervisord-gpu: no admin key in {KEY_ENV}; refusing to start the server open'); "
    "program = sys.argv.pop(1); "
    f"where = {REDACTION_MODULES!r}.get(program); "
    "r = importlib.import_module(where) if where else None; "
    f"scrub = lambda v: v.replace(key, {REDACTED!r}) if isinstance(v, str) else "
    "({scrub(k): scrub(x) for k, x in v.items()} if isinstance(v, dict) else "
    "(type(v)._make(map(scrub, v)) if hasattr(v, '_make') else type(v)(map(scrub, v)) "
    "if isinstance(v, (list, tuple)) else v)); "
    "secrets, line = (r.redact_watermark_secrets, r.redact_watermark_command_line) if r else (None, None); "
    "r and setattr(r, 'redact_watermark_secrets', lambda v, **kw: scrub(secrets(v, **kw))); "
    "r and setattr(r, 'redact_watermark_command_line', lambda *a, **kw: scrub(line(*a, **kw))); "
    "sys.argv.append('--admin-api-key=' + key); "  # one token: a key may start with '-'

    "script = program.endswith('.py'); "
    "script and sys.path.__setitem__(0, os.path.dirname(os.path.abspath(program))); "  # as `python SCRIPT.py`
    "runpy.run_path(program, run_name='__main__') if script else "
    "runpy.run_module(program, run_name='__main__', alter_sys=True)"
)  # one line: it shows in ps and in the journal's port-holder messages


def key_path(runtime_dir: Path, instance: str, server: str) -> Path:
    """Where a server's key lives (RuntimeDirectory=supervisord-gpu/%i: gone when the unit stops)."""
    return runtime_dir / instance / f"{server}{KEY_SUFFIX}"


def shim_argv(program: tuple[str, ...]) -> tuple[str, ...]:
    """`PYTHON ... -m MODULE` -> `PYTHON ... -c SERVER_SHIM MODULE`, `PYTHON SCRIPT.py` ->
    `PYTHON -c SERVER_SHIM SCRIPT.py`; () when the program is neither (the key could then reach
    it only on its world-readable command line)."""
    if len(program) >= 3 and program[-2] == "-m":
        return (*program[:-2], "-c", SERVER_SHIM, program[-1])
    if len(program) >= 2 and program[-1].endswith(".py"):
        return (*program[:-1], "-c", SERVER_SHIM, program[-1])
    return ()


def auth_header(key: str) -> dict[str, str]:
    """SGLang takes `Bearer` in any case (auth.py lowers it); we send it as written there."""
    return {"Authorization": f"Bearer {key}"}
