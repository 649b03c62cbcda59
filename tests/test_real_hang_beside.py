"""bench/device/real_hang.py --beside N: the profile it writes puts N paused servers beside
`server` on GPU 0, and the product's own loader takes it (every server `share_gpus`, each naming
its memory fraction, together within a card). Rendering only, no server: the fast tier. The run
itself is checked on the stand-in (docs/real-sglang.md) and on the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "device"))
import real_hang  # noqa: E402

from supervisord_gpu.config.loader import load_daemon_config, load_profile  # noqa: E402


def written(tmp_path: Path, beside: int) -> tuple[real_hang.HangRun, object]:
    args = real_hang.parser().parse_args(["--mode", "standin", "--out", str(tmp_path / "out"),
                                          "--work", str(tmp_path / "work"), "--beside", str(beside)])
    args.group, args.code, args.router, args.only = "hang", "tree", "standin", set()
    run = real_hang.HangRun(args)
    run.model = run.work / "model"
    run.write_config()
    return run, load_profile(load_daemon_config(run.etc), real_hang.PROFILE)


@pytest.mark.parametrize("beside", [0, 2, 6])
def test_the_profile_holds_server_and_n_paused_servers_the_loader_takes(tmp_path: Path, beside: int) -> None:
    _run, profile = written(tmp_path, beside)
    servers = {p.name: p for p in profile.processes if p.name != "router"}
    assert set(servers) == {"server", *(f"paused{k}" for k in range(1, beside + 1))}
    for k in range(1, beside + 1):
        assert servers[f"paused{k}"].port == real_hang.beside_port(k)
    assert len({s.port for s in servers.values()}) == len(servers)


def test_the_old_profile_stays_one_server(tmp_path: Path) -> None:
    run, _ = written(tmp_path, 3)
    old = load_profile(load_daemon_config(run.etc), real_hang.OLD_PROFILE)
    assert [p.name for p in old.processes] == ["server"]


def test_more_than_six_beside_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        real_hang.parser().parse_args(["--mode", "standin", "--out", "/nonexistent", "--beside", "7"])
    assert e.value.code == 2
