"""Every gpusupctl verb that reads the configuration, called as the README and the man page
show it: without --config-dir, so from the package's /etc/supervisord-gpu (overlaid for the
test, package_etc.py says how), and from $SUPERVISORD_GPU_CONFIG_DIR. Every other test passes
--config-dir, and so missed `rehearse` building Path(None) from the option it was not given.
(`rehearse` itself starts servers: test_cli_local.py. The installed package: test_deb.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from package_etc import GPUSUPCTL, available, run_as_installed
from support import free_ports, pd_profile

WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

#: no system bus for these: `status` and `switch` must say what they cannot know, not reach a real systemd
NO_BUS = {"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent"}


def make_config(where: Path, name: str) -> Path:
    """A daemon config and one profile `name` (its model path missing: not a rehearsal)."""
    cdir = where / "supervisord-gpu"
    (cdir / "profiles").mkdir(parents=True)
    (cdir / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        default_user = "root"
        runtime_dir = "{where / 'run'}"
        """))
    (cdir / "profiles" / f"{name}.toml").write_text(textwrap.dedent(pd_profile(free_ports(5))))
    return cdir


@pytest.fixture(params=["the package's /etc/supervisord-gpu", "SUPERVISORD_GPU_CONFIG_DIR"])
def gpusupctl(request, tmp_path: Path):  # type: ignore[no-untyped-def]
    """gpusupctl(*args) -> CompletedProcess: the command line as an admin types it, its config
    found by the default directory or by the environment variable, never by --config-dir."""
    cdir = make_config(tmp_path, "mine")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        if request.param == "SUPERVISORD_GPU_CONFIG_DIR":
            env = {**os.environ, **NO_BUS, "SUPERVISORD_GPU_CONFIG_DIR": str(cdir)}
            return subprocess.run([*GPUSUPCTL, *args], env=env, capture_output=True, text=True, timeout=60)
        r = run_as_installed(cdir, [*GPUSUPCTL, *args], env=NO_BUS)
        assert r.returncode != 97, f"overlay on /etc refused: {r.stderr}"
        return r

    return run


def test_render_finds_the_profile(gpusupctl) -> None:  # type: ignore[no-untyped-def]
    r = gpusupctl("render", "mine")
    assert r.returncode == 0 and r.stdout.startswith("# mine: test pd"), r.stdout + r.stderr
    rehearsal = gpusupctl("render", "mine", "--rehearsal", "--json")
    assert any("standin_server" in " ".join(p["argv"]) for p in json.loads(rehearsal.stdout)["start_order"])


def test_check_reads_the_profile_and_reports_it_all(gpusupctl) -> None:  # type: ignore[no-untyped-def]
    r = gpusupctl("check", "mine", "--rehearsal")
    assert r.returncode == 0 and r.stdout.startswith("mine: profile valid; GPUs [0, 1] idle"), r.stdout + r.stderr
    real = gpusupctl("check", "mine")  # not a rehearsal: the model path is checked, and is missing
    assert real.returncode == 2 and "/supervisord-gpu/profiles/mine.toml: servers.prefill.model_path" in real.stderr, \
        real.stdout + real.stderr


def test_gpus_shows_the_configured_simulated_gpus(gpusupctl) -> None:  # type: ignore[no-untyped-def]
    r = gpusupctl("gpus", "--rehearsal", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["backend"] == "simulated", r.stdout + r.stderr


def test_status_lists_the_profiles_even_without_a_bus(gpusupctl) -> None:  # type: ignore[no-untyped-def]
    r = gpusupctl("status", "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 4 and [i["instance"] for i in data["instances"]] == ["mine"], r.stdout + r.stderr
    assert data["instances"][0]["profile_exists"] is True and not any(n.startswith("config:") for n in data["notes"])


def test_switch_dry_run_plans_from_the_profile(gpusupctl) -> None:  # type: ignore[no-untyped-def]
    r = gpusupctl("switch", "mine", "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith("plan: switch to mine"), r.stdout + r.stderr
    assert "servers.prefill.model_path" in r.stderr  # a warning in a dry run


def test_a_profile_only_elsewhere_is_not_found_by_default(tmp_path: Path) -> None:
    """The default really is /etc/supervisord-gpu: a profile in another directory is not read."""
    cdir = make_config(tmp_path, "mine")
    other = make_config(tmp_path / "other", "elsewhere")
    r = run_as_installed(cdir, [*GPUSUPCTL, "render", "elsewhere"])
    assert r.returncode == 2 and "/etc/supervisord-gpu/profiles/elsewhere.toml" in r.stderr, r.stderr
    r = run_as_installed(cdir, [*GPUSUPCTL, "render", "elsewhere"], env={"SUPERVISORD_GPU_CONFIG_DIR": str(other)})
    assert r.returncode == 0, r.stderr  # the variable wins over the default
    r = run_as_installed(cdir, [*GPUSUPCTL, "render", "mine", "--config-dir", str(other)],
                         env={"SUPERVISORD_GPU_CONFIG_DIR": str(cdir)})
    assert r.returncode == 2 and f"{other}/profiles/mine.toml" in r.stderr, r.stderr  # and --config-dir over both
