"""Every server's admin key, decided before anything runs: who may set it (nobody but the daemon),
where it shows (never on argv, never in `gpusupctl render`), which requests it closes (SGLang's
ADMIN_OPTIONAL routes, as the stand-in copies them), and that the server shim hides it where
SGLang 0.5.23 would print it (GET /server_info, the start-up `server_args=` line).
No server starts here: the fast tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import free_ports, write_config
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.render import render
from supervisord_gpu.errors import ConfigError
from supervisord_gpu.rehearsal.standin_redaction import refusal
from supervisord_gpu.sglang import admin_key, router_key


def one_server(port: int, options: str = "", extra: str = "") -> str:
    return f"""
        [servers.alpha]
        gpus = [0]
        port = {port}
        model_path = "/m"
        {extra}
        [servers.alpha.options]
        {options}
        """


def config(tmp_path: Path, text: str) -> Path:
    return write_config(tmp_path, {"p": text}, tmp_path / "cg")


# --------------------------------------------------------------------------- the profile may not set it


@pytest.mark.parametrize("option, words", [
    ('admin-api-key = "visible-in-ps"', "admin-api-key: is the daemon's own"),
    ("tokenizer-worker-num = 4", "tokenizer-worker-num: SGLang 0.5.23 checks no API key"),
    ("grpc-port = 31001", "grpc-port: SGLang 0.5.23's gRPC servers do not check the admin key"),
    ("smg-grpc-mode = true", "smg-grpc-mode: SGLang 0.5.23's gRPC servers do not check the admin key"),
])
def test_a_profile_that_sets_or_disarms_the_admin_key_is_exit_2_in_one_line(tmp_path: Path, capsys, option: str,
                                                                             words: str) -> None:
    cdir = config(tmp_path, one_server(free_ports(1)[0], option))
    code = gpusupctl.main(["render", "--config-dir", str(cdir), "p"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"p.toml: servers.alpha.options.{words}" in err, err
    assert "visible-in-ps" not in err


@pytest.mark.parametrize("name", ["SGLANG_RUST_SERVER", "SGLANG_GRPC_PORT"])
def test_an_environment_that_replaces_sglangs_http_server_is_exit_2(tmp_path: Path, capsys, name: str) -> None:
    cdir = config(tmp_path, one_server(free_ports(1)[0]) + f'[servers.alpha.env]\n{name} = "1"\n')
    code = gpusupctl.main(["render", "--config-dir", str(cdir), "p"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"servers.alpha.env.{name}: replaces or bypasses" in err, err


def test_one_tokenizer_worker_keeps_the_key_checked_and_is_accepted(tmp_path: Path) -> None:
    cfg = load_daemon_config(config(tmp_path, one_server(free_ports(1)[0], "tokenizer-worker-num = 1")))
    assert load_profile(cfg, "p").process("alpha").option("tokenizer-worker-num") == 1


# --------------------------------------------------------------------------- render


def test_render_gives_each_server_a_key_file_and_never_the_key(tmp_path: Path, capsys) -> None:
    cdir = config(tmp_path, one_server(free_ports(1)[0]))
    cfg = load_daemon_config(cdir)
    (launch,) = render(load_profile(cfg, "p"), cfg)  # the real programs: what production runs
    assert launch.admin_key == admin_key.key_path(cfg.runtime_dir, "p", "alpha")
    assert not launch.admin_key.exists()  # rendering makes no key
    assert admin_key.SERVER_SHIM in launch.argv and "--admin-api-key" not in launch.argv
    assert all(k != admin_key.KEY_ENV for k, _ in launch.env)
    env = launch.environment({})  # what the engine does at spawn
    key = router_key.read_key(launch.admin_key)
    assert env[admin_key.KEY_ENV] == key and not any(key in a for a in launch.argv)
    assert gpusupctl.main(["render", "--config-dir", str(cdir), "p"]) == 0
    out = capsys.readouterr().out
    assert key not in out and f"<admin key: {launch.admin_key}>" in out, out


def test_a_server_command_the_key_cannot_reach_off_argv_is_refused(tmp_path: Path) -> None:
    cdir = config(tmp_path, one_server(free_ports(1)[0]))
    toml = cdir / "supervisord-gpu.toml"
    toml.write_text(toml.read_text().replace("enabled = true", "enabled = false").replace(
        "[sglang]\n", '[sglang]\nserver_command = ["/usr/local/bin/sglang", "serve"]\n', 1))
    cfg = load_daemon_config(cdir)
    with pytest.raises(ConfigError, match="server_command.*admin key"):
        render(load_profile(cfg, "p"), cfg)


# --------------------------------------------------------------------------- the stand-in's copy of SGLang's rule


@pytest.mark.parametrize("method, path", [
    ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"), ("POST", "/update_weights_from_disk"), ("GET", "/slow_down"),
    ("POST", "/pd_role_switch"), ("POST", "/update_weights_from_tensor"), ("POST", "/flush_cache"),
])
def test_admin_routes_want_the_admin_key_once_one_is_set(method: str, path: str) -> None:
    assert refusal(method, path, None, None, None) is None  # no key set: open, as SGLang 0.5.23 is
    assert refusal(method, path, None, None, "K") == 401
    assert refusal(method, path, "Bearer guess", None, "K") == 401
    assert refusal(method, path, "Basic K", None, "K") == 401
    assert refusal(method, path, "Bearer K", None, "K") is None
    assert refusal(method, path, "bearer K", None, "K") is None  # auth.py lowers the scheme
    assert refusal(method, path, "Bearer A", "A", "K") == 401  # both set: the API key does not open them


def test_normal_and_probe_routes_stay_as_they_were() -> None:
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert refusal("GET", path, None, "A", "K") is None  # always open, even with --api-key
    for method, path in (("POST", "/generate"), ("GET", "/server_info"), ("GET", "/v1/loads"),
                         ("GET", "/pause_generation")):  # a POST-only route by GET is NORMAL (then 405)
        assert refusal(method, path, None, None, "K") is None  # the admin key alone leaves them open
        assert refusal(method, path, None, "A", "K") == 401
        assert refusal(method, path, "Bearer K", "A", "K") == 401  # the admin key is not the API key
        assert refusal(method, path, "Bearer A", "A", "K") is None


# --------------------------------------------------------------------------- the shim


FAKE_SERVER = """
import argparse, json, sys
from collections import namedtuple
Point = namedtuple("Point", "host port")  # SGLang's resolved_dict keeps namedtuples as they are
from fakeredact import redact_watermark_command_line, redact_watermark_secrets
parser = argparse.ArgumentParser()  # as SGLang's: a value that begins with '-' must be --flag=value
parser.add_argument("--admin-api-key")
parser.add_argument("--port")
key = parser.parse_args(sys.argv[1:]).admin_api_key
print(json.dumps({"argv_key": key,
                  "server_info": redact_watermark_secrets({"admin_api_key": key, "nested": [key + " x"], "point": Point(key, 1),
                                                           "watermark_key": "w"}),
                  "launch": redact_watermark_command_line(["launch", "--admin-api-key=" + key])}))
"""
FAKE_REDACT = """
def redact_watermark_secrets(value, *, in_watermark_config=False):
    return {k: ("<redacted>" if k == "watermark_key" else v) for k, v in value.items()}
def redact_watermark_command_line(argv, watermark_config=None):
    return " ".join(argv)
"""


def run_shim(tmp_path: Path, key: str, module: str = "fakeserver") -> subprocess.CompletedProcess[str]:
    (tmp_path / "fakeserver.py").write_text(textwrap.dedent(FAKE_SERVER))
    (tmp_path / "fakeredact.py").write_text(textwrap.dedent(FAKE_REDACT))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    if key:
        env[admin_key.KEY_ENV] = key
    return subprocess.run([sys.executable, "-c", admin_key.SERVER_SHIM.replace(
        repr(admin_key.REDACTION_MODULES), repr({**admin_key.REDACTION_MODULES, "fakeserver": "fakeredact"})),
        module, "--port", "1"], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("key", ["k" * 43, "-k" + "k" * 41])  # token_urlsafe may begin with '-'
def test_the_shim_hands_the_key_to_the_server_and_hides_it_where_sglang_would_print_it(tmp_path: Path,
                                                                                      key: str) -> None:
    r = run_shim(tmp_path, key)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["argv_key"] == key  # the server got it, in its own argv
    assert key not in json.dumps(seen["server_info"]) + seen["launch"], seen
    assert seen["server_info"]["admin_api_key"] == "<redacted>" and seen["server_info"]["watermark_key"] == "<redacted>"
    assert seen["launch"] == "launch --admin-api-key=<redacted>"


def test_the_shim_refuses_to_start_a_server_without_a_key(tmp_path: Path) -> None:
    r = run_shim(tmp_path, "")
    assert r.returncode == 1 and "refusing to start the server open" in r.stderr and not r.stdout


def test_the_shim_refuses_a_known_server_whose_redaction_is_missing(tmp_path: Path) -> None:
    """Another SGLang without srt/sampling/watermarking/core.py: no start, rather than a key anyone can read."""
    (tmp_path / "fakeserver.py").write_text(textwrap.dedent(FAKE_SERVER))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), **{admin_key.KEY_ENV: "k" * 43})
    r = subprocess.run([sys.executable, "-c", admin_key.SERVER_SHIM.replace(
        repr(admin_key.REDACTION_MODULES), repr({"fakeserver": "no_such_redaction_module"})), "fakeserver"],
        env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "no_such_redaction_module" in r.stderr and not r.stdout


# --------------------------------------------------------------------------- status


def test_status_shows_since_when_a_ready_server_has_not_been_serving() -> None:
    import time

    from supervisord_gpu.cli.status_view import render as status_text

    since = 1_000_000.0
    process = {"name": "alpha", "role": "regular", "pid": 4711, "port": 30100, "gpus": [0], "phase": "serving",
               "phase_elapsed_s": 5.0, "restarts": 0, "state": "ready", "serving": False,
               "not_serving_since": since}
    data = {"at": since + 125, "gpus": None, "gpu_backend": "", "notes": [], "instances": [{
        "unit": "dsv4@p.service", "active_state": "active", "sub_state": "", "since": 50.0, "result": "success",
        "status_text": "", "last_status_text": "", "daemon": {"state": "ready", "reason": "", "processes": [process]}}]}
    text = status_text(data, colour=False)
    assert f"since {time.strftime('%H:%M:%S', time.localtime(since))} (2m05s)" in text, text
