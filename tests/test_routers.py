"""Both routers, first class: which one runs, its option table, what renders for it, when it is ready.

Fast: nothing here starts a router (tests/test_routers_real.py runs the real ones). The tables
are checked against the installed routers' own parsers where they are installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.render import Programs, render
from supervisord_gpu.engine.traffic import WorkerCheck, draining, router_verdict, serving
from supervisord_gpu.errors import ConfigError
from supervisord_gpu.rehearsal import standin_router
from supervisord_gpu.sglang import routers
from supervisord_gpu.sglang.routers import SGLANG_ROUTER, SMG
from support import free_ports, pd_profile, write_config

BOTH = [pytest.param(SGLANG_ROUTER, id="sglang-router"), pytest.param(SMG, id="smg")]


def only(*names: str):  # type: ignore[no-untyped-def]
    """A find_spec that finds exactly these packages."""
    return lambda package: object() if package in names else None


# --------------------------------------------------------------------------- which router runs


def test_smg_is_picked_when_both_are_installed_and_sglang_router_when_only_it_is() -> None:
    assert routers.pick(only("smg", "sglang_router")) is SMG
    assert routers.pick(only("sglang_router")) is SGLANG_ROUTER
    assert routers.pick(only("smg")) is SMG


def test_no_router_installed_is_one_line_naming_both_and_the_key() -> None:
    with pytest.raises(routers.NoRouterInstalled) as e:
        routers.pick(only())
    text = str(e.value)
    assert "\n" not in text and "smg.launch_router" in text and "sglang_router.launch_router" in text
    assert "router_command" in text


def test_a_named_router_command_wins_and_is_known_by_its_module() -> None:
    assert routers.resolve(["/opt/py", "-m", "sglang_router.launch_router"], only("smg")) == (
        ("/opt/py", "-m", "sglang_router.launch_router"), SGLANG_ROUTER)
    assert routers.resolve(["python3", "-m", "smg.launch_router"], only())[1] is SMG
    assert routers.resolve(["/usr/local/bin/my-router"], only("smg"))[1] is None
    # found in the daemon's Python, run by it: `python3` on the children's PATH may lack it (a venv)
    assert routers.resolve([], only("smg", "sglang_router")) == ((sys.executable, "-m", "smg.launch_router"), SMG)
    assert routers.resolve([], only()) == ((), None)


def profile(tmp_path: Path, kind: str, router_options: str = "", stop_timeout: int = 10) -> tuple[Path, object]:
    text = pd_profile(free_ports(5)).replace("stop_timeout = 10", f"stop_timeout = {stop_timeout}") + router_options
    cdir = write_config(tmp_path, {"p": text}, tmp_path / "cg", router_kind=kind)
    toml = cdir / "supervisord-gpu.toml"
    toml.write_text(toml.read_text().replace("enabled = true", "enabled = false"))  # the real programs
    cfg = load_daemon_config(cdir)
    return cdir, cfg


def router_argv(tmp_path: Path, kind: str, **kw: object) -> tuple[str, ...]:
    _, cfg = profile(tmp_path, kind, **kw)  # type: ignore[arg-type]
    launches = render(load_profile(cfg, "p"), cfg)  # type: ignore[arg-type]
    return next(launch.argv for launch in launches if launch.spec.kind == "router")


def test_no_router_installed_and_none_named_is_exit_2_naming_the_daemon_file(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cdir, _ = profile(tmp_path, "smg")
    toml = cdir / "supervisord-gpu.toml"
    toml.write_text(toml.read_text().replace('router_command = ["python3", "-m", "smg.launch_router"]', ""))
    cfg = load_daemon_config(cdir)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    from supervisord_gpu.controller.backends import Backends
    from supervisord_gpu.controller.preflight import validate

    programs = Programs.of(cfg)
    # `gpusupctl render` still shows what would run (the preferred router's command) ...
    argv = next(x.argv for x in render(load_profile(cfg, "p"), cfg, programs) if x.spec.kind == "router")
    assert "smg.launch_router" in argv
    backends = Backends(programs, lambda: None, lambda servers: [], model_paths_must_exist=False)  # type: ignore[arg-type, return-value]
    # ... a start refuses before anything runs, naming the daemon's file and key ...
    with pytest.raises(ConfigError) as e:
        validate(load_profile(cfg, "p"), cfg, backends)
    assert e.value.exit_code == 2 and e.value.key == "sglang.router_command" and e.value.path == str(toml)
    assert "no router installed" in str(e.value) and "No module named" not in str(e.value)
    # ... and `check` / `switch --dry-run` list it beside the other problems
    said: list[str] = []
    validate(load_profile(cfg, "p"), cfg, backends, warn=said.append)
    assert len(said) == 1 and "sglang.router_command: no router installed" in said[0]


# --------------------------------------------------------------------------- its options


@pytest.mark.parametrize("kind", BOTH)
def test_each_packaged_table_is_what_the_installed_router_parses(kind: routers.RouterKind) -> None:
    if not kind.installed():
        pytest.skip(f"{kind.name} not installed")
    dumped = subprocess.run([sys.executable, "-m", "supervisord_gpu.sglang.routers", "dump", kind.name],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(dumped) == json.loads((routers.DATA / kind.options_file).read_text())


def test_the_tables_hold_the_differences_that_matter() -> None:
    names = {k.name: {o.name for o in routers.options(k).values()} for k in routers.ROUTERS}
    assert len(names["sglang-router"]) == 98 and len(names["smg"]) == 212
    assert "--mini-lb" in names["sglang-router"] and "--mini-lb" not in names["smg"]
    for new in ("--disable-tokenizer-autoload", "--worker-wedge-secs", "--worker-stall-secs", "--health-check-port",
                "--pd-admission-wait-secs", "--enable-rl"):
        assert new in names["smg"] and new not in names["sglang-router"], new


@pytest.mark.parametrize("kind", BOTH)
def test_the_standin_parses_with_the_same_table(kind: routers.RouterKind) -> None:
    parser = standin_router.build_parser(kind)
    table = {o.name for o in routers.options(kind).values()}
    assert {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"} == table
    assert not hasattr(standin_router, "_OPTIONS")  # no second copy


def test_an_option_smg_does_not_have_is_exit_2_naming_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        router_argv(tmp_path, "smg", router_options="mini-lb = true\n")
    assert e.value.exit_code == 2 and e.value.key == "router.options.mini-lb" and e.value.path.endswith("p.toml")
    assert "smg 1.13.0 has no option --mini-lb" in str(e.value) and "\n" not in str(e.value)
    assert "--mini-lb" in router_argv(tmp_path / "old", "sglang-router", router_options="mini-lb = true\n")


def test_an_smg_option_under_sglang_router_is_refused_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"router\.options\.worker-wedge-secs: sglang-router 0\.3\.2 has no option"):
        router_argv(tmp_path, "sglang-router", router_options="worker-wedge-secs = 30\n")


def test_tokenizer_autoload_is_turned_off_where_the_router_has_the_flag(tmp_path: Path) -> None:
    smg = router_argv(tmp_path / "a", "smg")
    assert smg.count("--disable-tokenizer-autoload") == 1 and "smg.launch_router" in smg
    assert "--disable-tokenizer-autoload" not in router_argv(tmp_path / "b", "sglang-router")
    named = router_argv(tmp_path / "c", "smg", router_options="disable-tokenizer-autoload = true\n")
    assert named.count("--disable-tokenizer-autoload") == 1


def test_a_router_stop_timeout_shorter_than_smgs_own_stop_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        router_argv(tmp_path / "a", "smg", stop_timeout=3)
    assert e.value.key == "router.stop_timeout" and "5 s after SIGTERM" in str(e.value)
    assert router_argv(tmp_path / "b", "sglang-router", stop_timeout=3)
    assert router_argv(tmp_path / "c", "sglang-router", stop_timeout=1)  # it exits once drained: no fixed window


# --------------------------------------------------------------------------- --enable-rl


def test_enable_rl_is_refused_where_the_control_plane_key_cannot_reach_the_router(tmp_path: Path) -> None:
    """smg's /v1/rl pauses every worker and loads weights into them; without a key it answers anyone."""
    _, cfg = profile(tmp_path, "smg", router_options="enable-rl = true\n")
    programs = Programs(("python3", "-m", "sglang.launch_server"), ("/usr/local/bin/smg", "launch"),
                        router_kind=SMG)
    with pytest.raises(ConfigError) as e:
        render(load_profile(cfg, "p"), cfg, programs)  # type: ignore[arg-type]
    assert e.value.key == "router.options.enable-rl" and "control-plane key" in str(e.value)


def test_enable_rl_renders_behind_the_key_shim(tmp_path: Path) -> None:
    argv = router_argv(tmp_path, "smg", router_options="enable-rl = true\n")
    assert "--enable-rl" in argv and argv[1] == "-c" and "control-plane-api-keys" in argv[2]


# --------------------------------------------------------------------------- readiness


def test_a_pd_router_is_ready_only_with_both_workers_and_a_first_request_answered() -> None:
    both = WorkerCheck(2, 2, healthy_types=("decode", "prefill"))
    assert router_verdict(both, pd=True, first_request=200) == ""
    assert "503" in router_verdict(both, pd=True, first_request=503)  # "No prefill workers available"
    assert "nothing" in router_verdict(both, pd=True, first_request=None)
    # /readiness 200 with one decode listed: the real 0.3.2 before it had its prefill
    assert "1 of the profile's 2" in router_verdict(WorkerCheck(1, 2, healthy_types=("decode",)), True, 200)
    assert "prefill" in router_verdict(WorkerCheck(2, 2, healthy_types=("decode",)), True, 200)
    assert router_verdict(WorkerCheck(2, 2, ("http://x (regular, id 1)",), "foreign worker(s) still in the router: x",
                                      ("decode", "prefill")), True, 200).startswith("foreign")


def test_a_regular_router_needs_no_first_request() -> None:
    assert router_verdict(WorkerCheck(2, 2, healthy_types=("regular",)), pd=False, first_request=None) == ""
    assert router_verdict(WorkerCheck(1, 2, healthy_types=("regular",)), pd=False, first_request=None)


def test_an_smg_worker_is_serving_only_when_healthy_and_ready() -> None:
    assert serving({"is_healthy": True})  # 0.3.2: no status field
    assert serving({"is_healthy": True, "status": "ready"})
    assert not serving({"is_healthy": False, "status": "draining"})
    assert not serving({"is_healthy": True, "status": "pending"})
    assert not serving({"status": "ready"})  # a list without the field never counts as healthy
    assert draining({"status": "draining"}) and not draining({"is_healthy": True})
