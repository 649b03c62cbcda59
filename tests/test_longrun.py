"""bench/device/longrun.py: `collect`'s exit codes, which tell the lead's device calls whether to
call again (3), stop with a pass (0) or with a failure (1), on a fake run directory: a run.json
naming a sleeping process (running), one that has ended (died) or an exit.json (finished).
Starts no server: the fast tier."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "device"))
import longrun  # noqa: E402

SCRIPT = Path("real_hang.py")


def fake_run(d: Path, pid: int, results: dict[str, str] | None = None, code: int | None = None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    ticks = longrun.start_ticks(pid)
    (d / "run.json").write_text(json.dumps({"pid": pid, "start_ticks": ticks if ticks is not None else 12345,
                                            "started": time.time(), "argv": ["x"], "work": str(d / "work")}))
    (d / "run.log").write_text("=== case\n--- case: PASS\n")
    if results is not None:
        (d / "out").mkdir(exist_ok=True)
        (d / "out" / "real-hang-standin.json").write_text(
            json.dumps({"scenarios": {k: {"result": v} for k, v in results.items()}}))
    if code is not None:
        (d / "exit.json").write_text(json.dumps({"code": code}))


def collect(d: Path, dest: Path, wait: float = 0.0) -> int:
    code: int = longrun.collect(["--out-dir", str(d), "--out", str(dest), "--wait", str(wait)], SCRIPT)
    return code


@pytest.fixture
def sleeper() -> object:
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_running_exits_3_and_copies_progress(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    fake_run(tmp_path / "d", sleeper.pid, {"busy_first_start": "PASS"})
    began = time.monotonic()
    assert collect(tmp_path / "d", tmp_path / "o", wait=1.0) == longrun.RUNNING
    assert time.monotonic() - began >= 1.0  # it waited
    assert {p.name for p in (tmp_path / "o").iterdir()} >= {"run.json", "run.log", "real-hang-standin.json"}


def test_finished_all_pass_exits_0(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    fake_run(tmp_path / "d", sleeper.pid, {"a": "PASS", "b": "PASS"}, code=0)
    assert collect(tmp_path / "d", tmp_path / "o", wait=30.0) == longrun.FINISHED_PASS  # no wait: exit.json is there


@pytest.mark.parametrize("results,code", [({"a": "PASS", "b": "FAIL"}, 0), ({"a": "PASS", "b": "NOT RUN"}, 1),
                                          ({"a": "PASS"}, 2), ({}, 0)])
def test_finished_with_a_failure_exits_1(tmp_path: Path, results: dict[str, str], code: int) -> None:
    fake_run(tmp_path / "d", 4194300, results, code=code)
    assert collect(tmp_path / "d", tmp_path / "o") == longrun.FAILED


def test_died_without_exit_record_exits_1(tmp_path: Path) -> None:
    p = subprocess.Popen(["true"])
    pid = p.pid
    p.wait()
    fake_run(tmp_path / "d", pid, {"a": "PASS"})
    assert collect(tmp_path / "d", tmp_path / "o", wait=30.0) == longrun.FAILED


def test_a_reused_pid_is_not_the_run(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """Identity is the pid AND its start time: another process now holding the pid is not the run."""
    fake_run(tmp_path / "d", sleeper.pid, {"a": "PASS"})
    rec = json.loads((tmp_path / "d" / "run.json").read_text())
    rec["start_ticks"] += 1
    (tmp_path / "d" / "run.json").write_text(json.dumps(rec))
    assert collect(tmp_path / "d", tmp_path / "o", wait=30.0) == longrun.FAILED


@pytest.mark.parametrize("text,names", [(None, "no detached run"), ("{", "not readable JSON"),
                                        ('{"pid": "1; rm", "start_ticks": 1, "started": 1, "argv": [], "work": "w"}', "key pid"),
                                        ('{"pid": 99, "start_ticks": 1, "started": 1, "argv": "x", "work": "w"}', "key argv")])
def test_a_bad_run_record_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              text: str | None, names: str) -> None:
    (tmp_path / "d").mkdir()
    if text is not None:
        (tmp_path / "d" / "run.json").write_text(text)
    assert collect(tmp_path / "d", tmp_path / "o") == longrun.BAD_RECORD
    err = capsys.readouterr().err.strip()
    assert names in err and "run.json" in err and "\n" not in err


def test_detach_starts_its_own_session_and_returns(tmp_path: Path) -> None:
    """detach returns at once; the run it starts leads a new session (it outlives the device
    command) and writes exit.json with the run's code when it ends."""
    script = tmp_path / "fake_bench.py"
    script.write_text("import sys, os, time\n"
                      f"sys.path.insert(0, {str(Path(longrun.__file__).parent)!r})\n"
                      "import longrun\n"
                      "def main(argv):\n"
                      "    print('sid', os.getsid(0) == os.getpid(), flush=True)\n"
                      "    time.sleep(0.5)\n"
                      "    return 0\n"
                      "sys.exit(longrun.dispatch(sys.argv[1:], main, None, None))\n")
    began = time.monotonic()
    assert longrun.detach(["--out-dir", str(tmp_path / "d"), "--mode", "standin"], _parser, script, _work) == 0
    assert time.monotonic() - began < 0.5
    assert collect(tmp_path / "d", tmp_path / "o", wait=0.0) == longrun.RUNNING
    assert collect(tmp_path / "d", tmp_path / "o", wait=20.0) == longrun.FAILED  # finished, code 0, but no results
    assert json.loads((tmp_path / "d" / "exit.json").read_text())["code"] == 0
    assert "sid True" in (tmp_path / "d" / "run.log").read_text()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work")
    return ap


def _work(args: argparse.Namespace) -> str:
    return str(args.work or f"/tmp/longrun-test-{args.mode}")


def test_detach_refuses_out_and_a_run_still_going(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """--out is the run's own (D/out); a second detach into D while its run goes on would wipe
    the first run's results: both refused, exit 2, nothing started."""
    assert longrun.detach(["--out-dir", str(tmp_path / "a"), "--mode", "standin", "--out", str(tmp_path / "x")],
                          _parser, Path("x.py"), _work) == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "x").exists()
    fake_run(tmp_path / "d", sleeper.pid, {"a": "PASS"})
    assert longrun.detach(["--out-dir", str(tmp_path / "d"), "--mode", "standin"], _parser, Path("x.py"), _work) == 2
    assert (tmp_path / "d" / "out" / "real-hang-standin.json").exists()
