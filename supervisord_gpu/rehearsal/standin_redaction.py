"""The stand-in's copy of SGLang 0.5.23's secret redaction and endpoint key rules.

Redaction: srt/sampling/watermarking/core.py has the only redaction SGLang applies to what it
shows about its own arguments (GET /server_info, the start-up `server_args={...}` line):
watermark secrets. Nothing else is hidden, so an `--admin-api-key` shows in both. The stand-in
calls these two functions where SGLang does, so the daemon's server shim (sglang/admin_key.py),
which wraps them to hide the admin key too, is exercised on the stand-in as it is on SGLang.

Key rules: srt/utils/auth.py decide_request_auth with the levels http_server.py gives its
routes (0.5.23 marks none ADMIN_FORCE). The check runs only when --api-key or --admin-api-key
is set (http_server.py:2887-2898); a route matched by path but not method is NORMAL there
(Starlette's partial match), and so is a path with no route.
"""

from __future__ import annotations

import secrets
from typing import Any
from collections.abc import Sequence

WATERMARK_KEYS = ("watermark_key", "watermark_key_b", "watermark_config")

#: http_server.py 0.5.23's @auth_level(AuthLevel.ADMIN_OPTIONAL) routes and their methods
ADMIN_OPTIONAL: dict[str, frozenset[str]] = {
    path: frozenset(methods.split()) for path, methods in {
        "/set_internal_state": "POST PUT", "/flush_cache": "GET POST",
        "/add_external_corpus": "POST", "/remove_external_corpus": "POST", "/list_external_corpora": "GET",
        "/hicache/storage-backend/clear": "POST", "/hicache/storage-backend": "PUT DELETE GET",
        "/start_profile": "GET POST", "/stop_profile": "GET POST", "/set_trace_level": "GET POST",
        "/freeze_gc": "GET POST", "/start_expert_distribution_record": "GET POST",
        "/stop_expert_distribution_record": "GET POST", "/dump_expert_distribution_record": "GET POST",
        "/update_weights_from_disk": "POST", "/init_weights_send_group_for_remote_instance": "POST",
        "/send_weights_to_remote_instance": "POST", "/get_remote_instance_transfer_engine_info": "GET",
        "/remote_instance_transfer_engine_info": "GET", "/init_weights_update_group": "POST",
        "/destroy_weights_update_group": "POST", "/update_weights_from_tensor": "POST",
        "/begin_weight_update": "POST", "/end_weight_update": "POST",
        "/update_weights_from_distributed": "POST", "/update_weights_from_ipc": "POST",
        "/update_weight_version": "POST", "/get_weights_by_name": "GET POST",
        "/release_memory_occupation": "GET POST", "/resume_memory_occupation": "GET POST",
        "/weights_checker": "GET POST", "/slow_down": "GET POST", "/pd_role_switch": "POST",
        "/load_lora_adapter": "POST", "/load_lora_adapter_from_tensors": "POST",
        "/unload_lora_adapter": "POST", "/configure_logging": "GET POST", "/abort_request": "POST",
        "/pause_generation": "POST", "/continue_generation": "POST",
    }.items()
}
ALWAYS_OPEN = ("/health", "/ready", "/metrics")  # by prefix: /health_generate too


def refusal(method: str, path: str, authorization: str | None, api_key: str | None,
            admin_api_key: str | None) -> int | None:
    """None: let it through; else the status SGLang answers ({"error": "Unauthorized"})."""
    if not (api_key or admin_api_key) or method == "OPTIONS" or path.startswith(ALWAYS_OPEN):
        return None
    if method in ADMIN_OPTIONAL.get(path, ()):
        wanted = admin_api_key or api_key  # both set: only the admin key opens these
    else:
        wanted = api_key  # the admin key alone leaves NORMAL routes open
    if not wanted:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    ok = scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), wanted.encode())
    return None if ok else 401


def redact_watermark_secrets(value: Any, *, in_watermark_config: bool = False) -> Any:
    """What SGLang hides: the watermark fields, nothing else."""
    if isinstance(value, dict):
        return {k: ("<redacted>" if k in WATERMARK_KEYS and v is not None
                    else redact_watermark_secrets(v, in_watermark_config=in_watermark_config))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_watermark_secrets(v, in_watermark_config=in_watermark_config) for v in value]
    return value


def redact_watermark_command_line(argv: Sequence[str], watermark_config: str | None = None) -> str:
    """The launch command as SGLang reports it: argv, with only --watermark-config's value hidden."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next or (watermark_config is not None and arg == watermark_config):
            out.append("<redacted>")
            hide_next = False
        elif arg == "--watermark-config":
            out.append(arg)
            hide_next = True
        elif arg.startswith("--watermark-config="):
            out.append("--watermark-config=<redacted>")
        else:
            out.append(arg)
    return " ".join(out)
