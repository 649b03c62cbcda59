"""Servers that share a GPU: only where every one of them asks for it and names its fraction, the
fractions within the card, one after the other at start, and a card with the room for them."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from supervisord_gpu.checks.gpu_room import CONTEXT_MIB, room_problems
from supervisord_gpu.checks.gpus import GpuState, SimulatedInventory
from supervisord_gpu.checks.simgpu import SimulatedGpus
from supervisord_gpu.cli import daemon as daemon_cli
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.config.loader import parse_profile, read_toml
from supervisord_gpu.config.model import Profile
from supervisord_gpu.config.sharing import SHARED_FRACTION_MAX, start_waits, startable
from supervisord_gpu.controller.preflight import check_profile
from supervisord_gpu.errors import EXIT_PRECONDITIONS, PreconditionError

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "pd-one-gpu.toml"

#: a prefill and a decode on GPU 0, both asking to share it, 0.2 of it each
SHARED = """
[servers.prefill]
role = "prefill"
gpus = [0]
share_gpus = true
port = 31000
model_path = "/m"
[servers.prefill.options]
mem-fraction-static = 0.2
[servers.decode]
role = "decode"
gpus = [0]
share_gpus = true
port = 31001
model_path = "/m"
[servers.decode.options]
mem-fraction-static = 0.2
[router]
mode = "pd"
port = 31002
[router.options]
prometheus-port = 31009
"""

NODES = """
[nodes.a]
address = "10.9.0.1"
[nodes.b]
address = "10.9.0.2"
"""


def setup_dir(tmp_path: Path, profile_text: str) -> Path:
    (tmp_path / "profiles").mkdir(exist_ok=True)
    (tmp_path / "supervisord-gpu.toml").write_text("[daemon]\ndefault_user = \"root\"\n")
    (tmp_path / "profiles" / "p.toml").write_text(textwrap.dedent(profile_text))
    return tmp_path


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def profile_of(tmp_path: Path, text: str) -> Profile:
    path = setup_dir(tmp_path, text) / "profiles" / "p.toml"
    return parse_profile("p", path, read_toml(path), "root")


# ----------------------------------------------------------------------------- refusals

BAD = [
    ("a share neither side asked for",
     SHARED.replace("share_gpus = true\n", ""),
     "servers.decode.gpus: GPU 0 is also used by servers.prefill (servers.prefill and servers.decode do not set "
     "share_gpus = true); to share a GPU, set share_gpus = true and options.mem-fraction-static on every server that uses it"),
    ("a share one side did not ask for",
     SHARED.replace('role = "decode"\ngpus = [0]\nshare_gpus = true\n', 'role = "decode"\ngpus = [0]\n'),
     "servers.decode.gpus: GPU 0 is also used by servers.prefill (servers.decode does not set share_gpus = true); "
     "to share a GPU"),
    ("a sharer without its fraction",
     SHARED.replace("[servers.decode.options]\nmem-fraction-static = 0.2\n", ""),
     "servers.decode.options.mem-fraction-static: is required with share_gpus = true: say how much of each GPU "
     "servers.decode takes (e.g. mem-fraction-static = 0.2); the fractions of a GPU's servers may add up to 0.90"),
    ("a fraction that is not a fraction",
     SHARED.replace("mem-fraction-static = 0.2\n[servers.decode]", "mem-fraction-static = 1.5\n[servers.decode]"),
     "servers.prefill.options.mem-fraction-static: must be a number above 0 and below 1 with share_gpus = true, not 1.5"),
    ("a fraction given as text",
     SHARED.replace("mem-fraction-static = 0.2\n[servers.decode]", 'mem-fraction-static = "0.2"\n[servers.decode]'),
     "servers.prefill.options.mem-fraction-static: must be a number above 0 and below 1 with share_gpus = true, not '0.2'"),
    ("fractions over the card",
     SHARED.replace("mem-fraction-static = 0.2\n[servers.decode]", "mem-fraction-static = 0.5\n[servers.decode]")
     .replace("mem-fraction-static = 0.2\n[router]", "mem-fraction-static = 0.45\n[router]"),
     "servers.decode.options.mem-fraction-static: GPU 0 is shared by servers.prefill 0.5, servers.decode 0.45: their "
     "mem-fraction-static add up to 0.95, more than 0.90 of the card (each server also holds its CUDA context, "
     "activations and CUDA graphs outside its fraction); lower the fractions"),
    ("a share on one node of a cluster profile",
     NODES + SHARED.replace('role = "prefill"', 'role = "prefill"\nnode = "b"\nhost = "0.0.0.0"')
     .replace('role = "decode"', 'role = "decode"\nnode = "b"\nhost = "0.0.0.0"')
     .replace('mode = "pd"', 'mode = "pd"\nnode = "a"').replace("0.2", "0.5"),
     "servers.decode.options.mem-fraction-static: GPU 0 on node 'b' is shared by servers.prefill 0.5, servers.decode 0.5"),
]


@pytest.mark.parametrize("case,text,expected", BAD, ids=[c[0] for c in BAD])
def test_a_refused_share_is_one_line_naming_file_servers_and_figures_with_exit_2(tmp_path, capsys, case, text, expected):
    cdir = setup_dir(tmp_path, text)
    assert gpusupctl.main(["render", "p", "--config-dir", str(cdir)]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"gpusupctl: {cdir}/profiles/p.toml: "), err
    assert expected in err, err


def test_the_daemon_refuses_a_share_not_asked_for_before_starting_anything(tmp_path, capsys):
    cdir = setup_dir(tmp_path, SHARED.replace("share_gpus = true\n", ""))
    assert daemon_cli.main(["run", "p", "--config-dir", str(cdir), "--rehearsal", "--stderr"]) == 2
    err = one_line_error(capsys)
    assert "GPU 0 is also used by servers.prefill" in err and "share_gpus = true" in err
    assert "started pid" not in err


def test_fractions_that_fill_the_card_to_the_bound_are_allowed(tmp_path):
    third = ('[servers.third]\ngpus = [0]\nshare_gpus = true\nport = 31003\nmodel_path = "/m"\n'
             "[servers.third.options]\nmem-fraction-static = 0.3\n")
    profile = profile_of(tmp_path, SHARED.replace("0.2", "0.3") + third)
    assert sum(p.option("mem-fraction-static") or 0 for p in profile.processes) == pytest.approx(SHARED_FRACTION_MAX)


def test_the_same_gpu_index_on_two_nodes_is_not_a_share(tmp_path):
    text = NODES + SHARED.replace("share_gpus = true\n", "").replace(
        'role = "prefill"', 'role = "prefill"\nnode = "a"\nhost = "0.0.0.0"').replace(
        'role = "decode"', 'role = "decode"\nnode = "b"\nhost = "0.0.0.0"').replace('mode = "pd"', 'mode = "pd"\nnode = "a"')
    profile = profile_of(tmp_path, text)
    assert start_waits(profile.processes)["decode"] == ()


def test_the_example_profile_shares_gpu_0_between_prefill_and_decode():
    profile = parse_profile("pd-one-gpu", EXAMPLE, read_toml(EXAMPLE), "root")
    by_name = {p.name: p for p in profile.processes}
    assert by_name["prefill"].gpus == by_name["decode"].gpus == (0,)
    assert by_name["prefill"].share_gpus and by_name["decode"].share_gpus
    assert by_name["prefill"].option("disaggregation-transfer-backend") == "mooncake"
    assert dict(by_name["decode"].env)["MOONCAKE_PROTOCOL"] == "tcp"


# ----------------------------------------------------------------------------- start order


def test_servers_on_a_shared_gpu_start_one_after_the_other_and_the_router_last(tmp_path):
    procs = profile_of(tmp_path, SHARED).processes
    assert startable(procs, started=[], ready=[]) == ["prefill"]
    assert startable(procs, started=["prefill"], ready=[]) == []  # the decode waits for a READY prefill
    assert startable(procs, started=["prefill"], ready=["prefill"]) == ["decode"]
    assert startable(procs, started=["prefill", "decode"], ready=["prefill", "decode"]) == ["router"]


def test_servers_on_their_own_gpus_still_start_together(tmp_path):
    procs = profile_of(tmp_path, SHARED.replace("share_gpus = true\n", "").replace(
        'role = "decode"\ngpus = [0]', 'role = "decode"\ngpus = [1]')).processes
    assert startable(procs, started=[], ready=[]) == ["prefill", "decode"]


def test_a_server_waits_for_every_earlier_sharer_of_any_of_its_gpus(tmp_path):
    text = SHARED.replace('role = "decode"\ngpus = [0]', 'role = "decode"\ngpus = [1]') + (
        '[servers.both]\ngpus = [0, 1]\nshare_gpus = true\nport = 31003\nmodel_path = "/m"\n'
        "[servers.both.options]\nmem-fraction-static = 0.2\ntp-size = 2\n")
    waits = start_waits(profile_of(tmp_path, text).processes)
    # in the start order prefill, then both (a regular server), then decode: each waits for those before it
    assert waits["prefill"] == () and waits["both"] == ("prefill",) and waits["decode"] == ("both",)


# ----------------------------------------------------------------------------- room on the card


def gpu(total: int = 81559, used: int = 0, reserved: int = 0, baseline: int = 0, idle: bool = True) -> GpuState:
    return GpuState(0, "GPU-0", "H100", total, used, reserved, baseline, (), idle)


def test_an_idle_card_has_room_for_two_servers_at_a_fifth_each(tmp_path):
    assert room_problems(profile_of(tmp_path, SHARED), [gpu(used=4)], 256) == []


def test_a_card_whose_baseline_leaves_too_little_names_every_figure(tmp_path):
    profile = profile_of(tmp_path, SHARED.replace("0.2", "0.45"))
    lines = room_problems(profile, [gpu(total=10000, used=900, reserved=200, baseline=900)], 256)
    need = 2 * 4500 + 2 * CONTEXT_MIB
    assert lines == [f"GPU 0 has 8900 MiB free of 10000 MiB (200 MiB reserved by the driver, 900 MiB in use), but "
                     f"servers.prefill (0.45), servers.decode (0.45) need {need} MiB (their mem-fraction-static of the "
                     f"total, and {CONTEXT_MIB} MiB of CUDA context each)"]


def test_a_card_still_busy_is_judged_as_it_will_be_once_idle(tmp_path):
    profile = profile_of(tmp_path, SHARED)
    assert room_problems(profile, [gpu(used=60000, idle=False)], 256) == []  # ours, to be taken over
    small = room_problems(profile, [gpu(total=2200, used=2000, baseline=100, idle=False)], 256)
    assert small and "has 1844 MiB free of 2200 MiB (0 MiB reserved by the driver, 356 MiB in use once idle)" in small[0]


def test_the_preflight_refuses_a_shared_card_too_small_with_exit_3(tmp_path):
    sim = SimulatedGpus.create(tmp_path / "sim", 1, total_mib=8192, reserved_mib=615)
    profile = profile_of(tmp_path, SHARED.replace("0.2", "0.45"))
    with pytest.raises(PreconditionError) as caught:
        asyncio.run(check_profile(profile, SimulatedInventory(sim)))
    assert caught.value.exit_code == EXIT_PRECONDITIONS == 3
    assert str(caught.value) == ("refusing to start: GPU 0 has 7577 MiB free of 8192 MiB (615 MiB reserved by the driver, "
                                 "0 MiB in use), but servers.prefill (0.45), servers.decode (0.45) need 8398 MiB (their "
                                 "mem-fraction-static of the total, and 512 MiB of CUDA context each)")


def test_the_preflight_passes_a_shared_card_with_room(tmp_path):
    sim = SimulatedGpus.create(tmp_path / "sim", 1)
    report = asyncio.run(check_profile(profile_of(tmp_path, SHARED), SimulatedInventory(sim)))
    assert report.ok
