"""Bad input: one line naming the file, the key and what is wrong; exit 2; nothing started."""

from __future__ import annotations

import textwrap

import pytest

from supervisord_gpu.cli import daemon as daemon_cli
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.config.loader import load_daemon_config, load_profile

GOOD = """
[servers.prefill]
role = "prefill"
gpus = [0, 1]
port = 31000
model_path = "/m"
[servers.prefill.options]
tp-size = 2
[servers.decode]
role = "decode"
gpus = [2, 3]
port = 31001
model_path = "/m"
[router]
mode = "pd"
port = 31002
[router.options]
prometheus-port = 31009
"""


def setup_dir(tmp_path, profile_text: str, daemon_text: str = "[daemon]\ndefault_user = \"root\"\n"):
    (tmp_path / "profiles").mkdir(exist_ok=True)
    (tmp_path / "supervisord-gpu.toml").write_text(daemon_text)
    (tmp_path / "profiles" / "p.toml").write_text(textwrap.dedent(profile_text))
    return tmp_path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_the_shipped_profiles_are_valid_and_share_port_30001():
    cfg = load_daemon_config("etc/supervisord-gpu")
    pd, tp4 = load_profile(cfg, "pd-1p1d"), load_profile(cfg, "tp4-512k")
    assert [p.name for p in pd.processes] == ["prefill", "decode", "router"]
    assert pd.stop_order == ("router", "decode", "prefill")
    assert pd.process("prefill").gpus == (0, 1, 2, 3) and pd.process("decode").gpus == (4, 5, 6, 7)
    assert tp4.process("server").gpus == (0, 1, 2, 3)
    assert tp4.process("server").option("context-length") == 524288
    assert 30001 in {l.port for l in pd.listens()} & {l.port for l in tp4.listens()}


TWO_DECODES = """
[servers.prefill]
role = "prefill"
gpus = [0]
port = 31000
model_path = "/m"
[servers.decode0]
role = "decode"
gpus = [1]
port = 31001
model_path = "/m"
[servers.decode1]
role = "decode"
gpus = [2]
port = 31003
model_path = "/m"
{decode1_extra}
[router]
mode = "pd"
port = 31002
[router.options]
prometheus-port = 31009
"""


@pytest.mark.parametrize(
    "decode1_extra, waves",
    [
        ("", (("router",), ("decode1", "decode0"), ("prefill",))),
        # decode1 waits for decode0 at start, so decode0 must outlive it at stop
        ('after = ["decode0"]', (("router",), ("decode1",), ("decode0",), ("prefill",))),
    ],
)
def test_stop_waves_join_same_role_neighbours_unless_one_depends_on_the_other(tmp_path, decode1_extra, waves):
    cfg = load_daemon_config(setup_dir(tmp_path, TWO_DECODES.format(decode1_extra=decode1_extra)))
    profile = load_profile(cfg, "p")
    assert profile.stop_waves == waves
    assert [n for w in profile.stop_waves for n in w] == list(profile.stop_order)


def test_the_shipped_pd_profile_keeps_one_process_per_stop_wave():
    pd = load_profile(load_daemon_config("etc/supervisord-gpu"), "pd-1p1d")
    assert pd.stop_waves == (("router",), ("decode",), ("prefill",))
    assert pd.describe_stop_order() == "router -> decode -> prefill"


def test_a_good_profile_renders_full_flag_names(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 0
    out = capsys.readouterr().out
    assert "--tp-size 2" in out and "--tp " not in out
    assert "--pd-disaggregation --prefill http://127.0.0.1:31000 8998 --decode http://127.0.0.1:31001" in out


BAD_PROFILES = [
    ("unknown key", GOOD + "\n[servers.extra]\ngpus=[5]\nport=1\nmodel_path='/m'\ncolour='red'\n",
     "servers.extra.colour: unknown key"),
    ("wrong type", GOOD.replace("port = 31000", 'port = "31000"'), "servers.prefill.port: must be an integer, not a string"),
    ("GPU listed twice", GOOD.replace("gpus = [0, 1]", "gpus = [0, 0]"), "servers.prefill.gpus: GPU 0 is listed twice"),
    ("GPU shared by two servers", GOOD.replace("gpus = [2, 3]", "gpus = [1, 3]"),
     "servers.decode.gpus: GPU 1 is also used by servers.prefill"),
    ("two processes on one port", GOOD.replace("port = 31001", "port = 31000"),
     "servers.decode.port: port 31000 (decode) is also used by prefill (servers.prefill)"),
    ("router fronts a missing server", GOOD.replace('mode = "pd"', 'mode = "pd"\ndecode = ["ghost"]'),
     "router.decode[0]: no server named 'ghost'"),
    ("dependency cycle", GOOD.replace('role = "prefill"', 'role = "prefill"\nafter = ["decode"]')
     .replace('role = "decode"', 'role = "decode"\nafter = ["prefill"]'), "after: dependency cycle: prefill -> decode -> prefill"),
    ("invalid TOML", GOOD + "\nthis is not toml\n", "is not valid TOML: Expected '=' after a key in a key/value pair (at line 20"),
    ("context length not a number", GOOD.replace("tp-size = 2", 'tp-size = 2\ncontext-length = "lots"'),
     "servers.prefill.options.context-length: must be a number of tokens"),
    ("abbreviated flag", GOOD.replace("tp-size = 2", "tp_size = 2"), "servers.prefill.options.tp_size: must be a full long option name"),
    ("managed flag in options", GOOD.replace("tp-size = 2", "port = 5"), "servers.prefill.options.port: is set by the profile key 'port'"),
    ("too few GPUs for tp", GOOD.replace("tp-size = 2", "tp-size = 4"), "servers.prefill.gpus: lists 2 GPU(s) but the parallelism options need 4"),
    ("negative GPU", GOOD.replace("gpus = [0, 1]", "gpus = [-1, 1]"), "servers.prefill.gpus[0]: must be a GPU index between 0 and 1023"),
    ("no servers", "[router]\nport = 1\n", "servers: is required"),
    ("port in SGLang's NCCL range", GOOD.replace("port = 31001", "port = 25000"),
     "servers.decode.port: port 25000 is in SGLang's random NCCL port range 22000-29999"),
    ("router metrics port left at its default", GOOD.replace("prometheus-port = 31009\n", ""),
     "router.options.prometheus-port: not set, and the router's default 29000 is in SGLang's random NCCL port range"),
    ("a dp-attention server's own ports", GOOD.replace("tp-size = 2", "tp-size = 2\nenable-dp-attention = true")
     .replace("port = 31002", "port = 31233"),
     "router.port: port 31233 is one of the ports servers.prefill binds with enable-dp-attention (its port +13, +233"),
    ("readiness probe shorter than SGLang's /health", GOOD.replace('role = "decode"', 'role = "decode"\nprobe = { timeout = 0.5 }'),
     "servers.decode.probe.timeout: 0.5 s is too short for /health: SGLang answers it with a one-token generation"),
    ("liveness stricter than SGLang's own verdict", GOOD.replace('role = "decode"',
     'role = "decode"\nprobe = { liveness_path = "/health", liveness_timeout = 5 }'),
     "servers.decode.probe.liveness_timeout: 5 s would kill a busy healthy server: SGLang's own /health verdict allows 20 s"),
    ("a port option that is not a number", GOOD.replace("prometheus-port = 31009", 'prometheus-port = ""'),
     "router.options.prometheus-port: must be a port number between 1 and 65535, not ''"),
    ("a port option out of range", GOOD.replace("tp-size = 2", "tp-size = 2\ndisaggregation-bootstrap-port = 70000"),
     "servers.prefill.options.disaggregation-bootstrap-port: must be a port number between 1 and 65535, not 70000"),
    ("a list value smuggling a managed flag", GOOD.replace("tp-size = 2", 'tp-size = 2\ngc-threshold = ["1", "--host", "0.0.0.0"]'),
     "servers.prefill.options.gc-threshold[1]: value '--host' would be read as a flag"),
    ("a list item SGLang would take for its help flag", GOOD.replace("tp-size = 2", 'tp-size = 2\nserved-model-name = ["a", "-h"]'),
     "servers.prefill.options.served-model-name[1]: value '-h' would be read as a flag"),
    ("a NUL in a path a list option names", GOOD.replace("tp-size = 2", 'tp-size = 2\nlora-paths = ["/a\\u0000b"]'),
     "servers.prefill.options.lora-paths[0]: must not contain NUL characters"),
    ("a key with a newline stays one line", GOOD + '\n"bad\\nkey" = 1\n', "router.options.bad\\nkey: must be a full long option name"),
    ("unknown user", GOOD.replace('role = "decode"', 'role = "decode"\nuser = "no-such-user-here"'),
     "servers.decode.user: no such user 'no-such-user-here' on this machine"),
]


@pytest.mark.parametrize("case,text,expected", BAD_PROFILES, ids=[c[0] for c in BAD_PROFILES])
def test_a_bad_profile_is_one_line_naming_file_and_key_with_exit_2(tmp_path, capsys, case, text, expected):
    cdir = setup_dir(tmp_path, text)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"gpusupctl: {cdir}/profiles/p.toml: "), err
    assert expected in err, err


def test_an_unknown_profile_name_lists_the_known_ones(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD)
    assert gpusupctl.main(["render", "nope", "--config-dir", str(cdir)]) == 2
    assert "unknown profile 'nope' (profiles in" in one_line_error(capsys)


def test_the_daemon_refuses_a_bad_profile_before_starting_anything(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD.replace("gpus = [0, 1]", "gpus = [0, 0]"))
    assert daemon_cli.main(["run", "p", "--config-dir", str(cdir), "--rehearsal", "--stderr"]) == 2
    err = one_line_error(capsys)
    assert "GPU 0 is listed twice" in err
    assert "started pid" not in err


@pytest.mark.parametrize(
    "daemon_text,expected",
    [
        ("[daemon]\nownership = 'magic'\n", "daemon.ownership: must be one of auto, systemd, cgroupfs, session"),
        ("[gpus]\nidle_tolerance_mib = -5\n", "gpus.idle_tolerance_mib: must be at least 0"),
        ("[metrics]\nport = 70000\n", "metrics.port: must be at most 65535"),
        ("[bogus]\n", "bogus: unknown key"),
    ],
)
def test_a_bad_daemon_config_names_its_key(tmp_path, capsys, daemon_text, expected):
    cdir = setup_dir(tmp_path, GOOD, daemon_text)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    err = one_line_error(capsys)
    assert f"{cdir}/supervisord-gpu.toml: " in err and expected in err, err


def test_non_utf8_and_directory_profiles_are_clear_errors(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD)
    (cdir / "profiles" / "p.toml").write_bytes(b"description = '\xff\xfe'\n")
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    assert "is not valid UTF-8 (line 1" in one_line_error(capsys)
    (cdir / "profiles" / "p.toml").unlink()
    (cdir / "profiles" / "p.toml").mkdir()
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    assert "is a directory, not a file" in one_line_error(capsys)


def test_a_profile_writable_by_others_is_refused_when_running_as_root(tmp_path, capsys):
    import os

    if os.geteuid() != 0:
        pytest.skip("strict modes apply to a daemon running as root")
    cdir = setup_dir(tmp_path, GOOD, "[daemon]\nstrict_modes = true\n")
    os.chmod(cdir, 0o755)
    os.chmod(cdir / "profiles", 0o755)
    (cdir / "profiles" / "p.toml").chmod(0o666)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    assert "is writable by non-root users" in one_line_error(capsys)


def test_a_process_without_a_user_is_refused_and_root_must_be_asked_for(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD, "[daemon]\n")
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    assert "servers.prefill.user: is not set, so it would run as the daemon's user (root)" in one_line_error(capsys)
    cdir = setup_dir(tmp_path, "[defaults]\nuser = \"root\"\n" + GOOD, "[daemon]\n")
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 0


def test_a_name_with_a_trailing_newline_is_not_a_profile_name(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD)
    assert gpusupctl.main(["render", "p\n", "--config-dir", str(cdir)]) == 2
    assert "is not a valid profile name" in one_line_error(capsys)


@pytest.mark.parametrize("what", ["daemon config", "config directory", "profiles directory"])
def test_as_root_a_config_anyone_could_have_written_is_refused(tmp_path, capsys, what):
    import os

    if os.geteuid() != 0:
        pytest.skip("strict modes apply to a daemon running as root")
    cdir = setup_dir(tmp_path, GOOD)
    os.chmod(cdir, 0o755)
    target = {"daemon config": cdir / "supervisord-gpu.toml", "config directory": cdir,
              "profiles directory": cdir / "profiles"}[what]
    os.chmod(target, 0o777 if target.is_dir() else 0o666)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    err = one_line_error(capsys)
    assert f"{target}: is writable by non-root users" in err, err


def test_strict_modes_cannot_be_switched_off(tmp_path, capsys):
    cdir = setup_dir(tmp_path, GOOD, "[daemon]\nstrict_modes = false\n")
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    assert "daemon.strict_modes: can no longer be turned off" in one_line_error(capsys)


def _render(tmp_path, text: str):  # type: ignore[no-untyped-def]
    from supervisord_gpu.config.render import render

    cdir = setup_dir(tmp_path, text)
    cfg = load_daemon_config(cdir)
    return {launch.spec.name: launch for launch in render(load_profile(cfg, "p"), cfg)}


def test_cute_dsl_compiles_into_the_persistent_cache_and_the_hub_stays_where_the_user_keeps_it(tmp_path):
    launches = _render(tmp_path, GOOD)
    env = dict(launches["prefill"].env)
    root = str(launches["prefill"].cache_root)
    # CuTe DSL would otherwise compile into the private TMPDIR we empty at every start
    assert env["CUTE_DSL_CACHE_DIR"] == f"{root}/sglang/cute_dsl"
    # our XDG_CACHE_HOME must not move the user's hub and token: HF_HOME pinned to ~/.cache/huggingface
    assert env["XDG_CACHE_HOME"] == root and env["HF_HOME"] == f"{env['HOME']}/.cache/huggingface"


def test_a_user_without_a_home_gets_a_hub_in_its_persistent_cache_and_a_profile_hf_home_wins(tmp_path):
    from supervisord_gpu.sglang.caches import hub_home

    assert hub_home(tmp_path / "c", "/nonexistent") == str(tmp_path / "c" / "huggingface")
    text = GOOD.replace("[servers.decode]\n", "[servers.decode]\nenv = { HF_HOME = \"/srv/hub\" }\n")
    env = _render(tmp_path, text)["decode"]
    assert env.environment({})["HF_HOME"] == "/srv/hub"


def test_servers_sharing_a_machine_each_get_their_own_nccl_port_and_it_is_checked_like_any_port(tmp_path):
    launches = _render(tmp_path, GOOD)
    argv = {name: " ".join(launch.argv) for name, launch in launches.items()}
    assert "--nccl-port 31050" in argv["prefill"] and "--nccl-port 31051" in argv["decode"]
    assert "nccl" in " ".join(listen.label for listen in launches["prefill"].spec.listens())
    single = "[servers.only]\ngpus = [0]\nport = 31000\nmodel_path = \"/m\"\n"
    assert "--nccl-port" not in " ".join(_render(tmp_path, single)["only"].argv)  # nothing to collide with


@pytest.mark.parametrize("text,expected", [
    (GOOD.replace("port = 31002", "port = 31050"), "router.port: port 31050 (router) is also used by prefill nccl"),
    (GOOD.replace("tp-size = 2", "tp-size = 2\nnccl-port = 25000"), "servers.prefill.options.nccl-port: port 25000 is in SGLang's random NCCL"),
    (GOOD.replace('role = "decode"', 'role = "decode"\nstart_timeout = 600\nstart_timeout_max = 60'),
     "servers.decode.start_timeout_max: 60 s is shorter than start_timeout (600 s)"),
    (GOOD.replace('mode = "pd"', 'mode = "pd"\nprobe = { scheduler_timeout = 5 }'), "router.probe.scheduler_timeout: unknown key"),
])
def test_new_keys_refuse_what_cannot_work_in_one_line(tmp_path, capsys, text, expected):
    cdir = setup_dir(tmp_path, text)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    assert expected in one_line_error(capsys)


def test_a_scheduler_is_given_sglangs_own_watchdog_time_before_it_counts_as_hung(tmp_path):
    launches = _render(tmp_path, GOOD.replace("tp-size = 2", "tp-size = 2\nwatchdog-timeout = 900"))
    assert launches["prefill"].spec.probe.scheduler_timeout_s == 900
    assert launches["decode"].spec.probe.scheduler_timeout_s == 300
    assert launches["router"].spec.probe.scheduler_path is None


def test_start_timeout_max_reaches_each_process_from_its_table_or_the_defaults(tmp_path):
    """It was read and checked, then dropped: every process had the 4 h default."""
    text = "[defaults]\nstart_timeout_max = 1800\n" + GOOD.replace('role = "decode"', 'role = "decode"\nstart_timeout_max = 3600')
    cdir = setup_dir(tmp_path, text)
    profile = load_profile(load_daemon_config(cdir), "p")
    assert {p.name: p.start_timeout_max_s for p in profile.processes} == {"prefill": 1800, "decode": 3600, "router": 1800}
