"""`gpusupctl check NAME`: every reason a profile cannot start now, at once, each naming its
cause, and the most severe exit code (2, a profile to fix, beats 3, something in the way).

Before, it stopped at the first: with the model path missing, the stranger on the router's
port was never named, and the operator fixed one thing per round trip."""

from __future__ import annotations

import json
import os
import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import free_ports, pd_profile
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.cli import gpusupctl


def config_dir(tmp_path: Path, profile: str) -> Path:
    """A config whose GPUs are simulated (4 of them) but which is not a rehearsal: model paths
    are checked, as on a production machine."""
    cdir = tmp_path / "etc"
    (cdir / "profiles").mkdir(parents=True)
    (cdir / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        default_user = "root"
        runtime_dir = "{tmp_path / 'run'}"
        [gpus]
        backend = "simulated"
        [rehearsal]
        gpu_count = 4
        simgpu_dir = "{tmp_path / 'simgpu'}"
        """))
    (cdir / "profiles" / "pd.toml").write_text(textwrap.dedent(profile))
    return cdir


@pytest.fixture
def listening() -> Iterator[list[int]]:
    """Two ports held by this very process (pytest): the holder `check` must name."""
    socks = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        s.listen()
        socks.append(s)
    yield [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = gpusupctl.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_names_every_problem_at_once_and_exits_with_the_most_severe(tmp_path, capsys, listening):
    """Model paths missing, a GPU the machine lacks, a GPU held, the HTTP port and the bootstrap
    port held: all named in one run, the holders by PID and command line; exit 2."""
    held_http, held_bootstrap = listening
    decode, router, metrics = free_ports(3)
    profile = pd_profile([held_http, decode, router, held_bootstrap, metrics]).replace("gpus = [1]", "gpus = [7]")
    cdir = config_dir(tmp_path, profile)
    SimulatedGpus.create(tmp_path / "simgpu", 4).hold([0], 5000)  # GPU 0 held by this process
    me = f"pid {os.getpid()}"

    code, out, err = run(["check", "pd", "--config-dir", str(cdir)], capsys)
    assert code == 2, out + err
    problems = err.splitlines()
    assert all(line.startswith("gpusupctl: ") and "pd.toml: servers." in line for line in problems), err
    assert any("servers.prefill.model_path: /models/test does not exist" in line for line in problems), err
    assert any("servers.decode.model_path: /models/test does not exist" in line for line in problems), err
    assert any("servers.decode.gpus[0]: GPU 7 does not exist (this machine has 4 visible GPU(s))" in line
               for line in problems), err
    assert "preconditions are not met either" in out, out
    assert f"GPU 0 not idle: 5000 MiB used; held by {me}" in out, out
    assert f"port 127.0.0.1:{held_http} (prefill) held by {me}" in out, out
    assert f"port 127.0.0.1:{held_bootstrap} (prefill bootstrap) held by {me}" in out, out
    assert "pytest" in out.split(f"port 127.0.0.1:{held_http} (prefill) held by {me}", 1)[1].splitlines()[0], out

    code, out, err = run(["check", "pd", "--json", "--config-dir", str(cdir)], capsys)
    data = json.loads(out)
    assert code == 2 and data["exit_code"] == 2 and data["ok"] is False and err == "", err
    assert len(data["profile_problems"]) == 3 and data["missing_gpus"] == [7], data
    assert {p["port"] for p in data["ports"] if not p["free"]} == {held_http, held_bootstrap}, data
    assert len(data["problems"]) == 3 + 3, data["problems"]  # the profile's three, GPU 0 and the two ports


def test_a_profile_refused_early_still_names_its_missing_model_paths_and_holders(tmp_path, capsys, listening):
    """Validation stops at its first refusal (here a user this machine lacks); the model paths,
    its last step, and the GPUs and ports are still checked and named."""
    held_http, _ = listening
    decode, router, boot, metrics = free_ports(4)
    profile = pd_profile([held_http, decode, router, boot, metrics]).replace(
        "[servers.decode]", '[servers.decode]\nuser = "no-such-user-here"')
    cdir = config_dir(tmp_path, profile)
    code, out, err = run(["check", "pd", "--config-dir", str(cdir)], capsys)
    assert code == 2, out + err
    lines = err.splitlines()
    assert "servers.decode.user: no such user 'no-such-user-here'" in lines[0], err
    assert any("servers.prefill.model_path: /models/test does not exist" in line for line in lines[1:]), err
    assert f"port 127.0.0.1:{held_http} (prefill) held by pid {os.getpid()}" in out, out


def test_only_something_in_the_way_is_exit_3_and_a_clear_profile_is_0(tmp_path, capsys, listening):
    held_http, _ = listening
    decode, router, boot, metrics = free_ports(4)
    profile = pd_profile([held_http, decode, router, boot, metrics]).replace('"/models/test"', f'"{tmp_path}"')
    cdir = config_dir(tmp_path, profile)
    code, out, err = run(["check", "pd", "--config-dir", str(cdir)], capsys)
    assert (code, err) == (3, ""), out + err
    assert out.startswith("pd: profile valid, but preconditions are not met:") and f"held by pid {os.getpid()}" in out, out
    free = pd_profile(free_ports(5)).replace('"/models/test"', f'"{tmp_path}"')
    (cdir / "profiles" / "pd.toml").write_text(textwrap.dedent(free))
    code, out, err = run(["check", "pd", "--config-dir", str(cdir)], capsys)
    assert (code, err) == (0, ""), out + err
    assert out.startswith("pd: profile valid; GPUs [0, 1] idle; ports "), out


def test_gpus_that_cannot_be_read_still_leave_the_ports_checked(tmp_path, capsys, listening):
    """No NVML on this machine (or a driver in trouble): said, and the port holder still named."""
    held_http, _ = listening
    decode, router, boot, metrics = free_ports(4)
    profile = pd_profile([held_http, decode, router, boot, metrics]).replace('"/models/test"', f'"{tmp_path}"')
    cdir = config_dir(tmp_path, profile)
    toml = cdir / "supervisord-gpu.toml"
    toml.write_text(toml.read_text().replace('backend = "simulated"', 'backend = "nvml"'))
    from supervisord_gpu.checks import gpus

    def no_nvml(*_a: object, **_k: object) -> None:
        from supervisord_gpu.errors import PreconditionError

        raise PreconditionError("cannot check GPUs: libnvidia-ml.so.1 (NVML) not found")

    mp = pytest.MonkeyPatch()
    mp.setattr(gpus, "open_inventory", no_nvml)
    try:
        code, out, err = run(["check", "pd", "--config-dir", str(cdir)], capsys)
    finally:
        mp.undo()
    assert code == 3 and err == "", out + err
    assert "GPUs not checked: cannot check GPUs: libnvidia-ml.so.1 (NVML) not found" in out, out
    assert f"port 127.0.0.1:{held_http} (prefill) held by pid {os.getpid()}" in out, out
