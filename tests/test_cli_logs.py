"""`gpusupctl logs NAME [PROCESS]` shows one instance's journal, named exactly (#37).

journalctl's `-u` takes a pattern: `gpusupctl logs 'x*'` handed it on and showed every dsv4@x…
unit. A name is checked with the daemon's own rule (INSTANCE_NAME_RE, no `*?[]`) before
journalctl runs, as `start`/`stop` check theirs; a bad one is one line, exit 2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from supervisord_gpu.cli import gpusupctl

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def execs(monkeypatch) -> list[list[str]]:
    """What `logs` would exec, instead of exec'ing it."""
    ran: list[list[str]] = []

    def fake_exec(_file: str, argv: list[str]) -> None:
        ran.append(list(argv))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvp", fake_exec)
    return ran


@pytest.mark.parametrize("name", ["x*", "dsv4?", "[ab]", "a/b", "a b", "x\\*"])
def test_a_pattern_or_a_bad_name_is_one_line_exit_2_and_journalctl_never_runs(capsys, execs, name):
    assert gpusupctl.main(["logs", name]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gpusupctl: {name!r} is not a valid instance name (logs takes one exact name, no patterns)", err
    assert execs == []


def test_a_bad_process_name_is_refused_too(capsys, execs):
    assert gpusupctl.main(["logs", "alpha", "GPUSUP_PROCESS=x"]) == 2
    assert "is not a valid process name" in capsys.readouterr().err and execs == []


def test_an_exact_name_asks_journalctl_for_that_one_unit(execs):
    with pytest.raises(SystemExit):
        gpusupctl.main(["logs", "pd-1p1d", "router", "-n", "5"])
    assert execs == [["journalctl", "-u", "dsv4@pd-1p1d.service", "--no-hostname", "GPUSUP_PROCESS=router", "-n", "5"]]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as nobody")
def test_as_a_local_user_a_glob_never_reaches_journalctl():
    """The finding's party: `nobody` runs `gpusupctl logs 'x*'`; a journalctl first on its PATH
    (in a root 0755 directory nobody can reach) says whether it ran."""
    bin_dir = Path(f"/tmp/logs-bin-{uuid.uuid4().hex[:10]}")
    bin_dir.mkdir(mode=0o755)
    try:
        os.chmod(bin_dir, 0o755)
        (bin_dir / "journalctl").write_text("#!/bin/sh\necho JOURNALCTL-RAN \"$@\"\n")
        (bin_dir / "journalctl").chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                     sys.executable, "-m", "supervisord_gpu.cli.gpusupctl", "logs"]
        good = subprocess.run([*as_nobody, "alpha"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert "JOURNALCTL-RAN -u dsv4@alpha.service" in good.stdout, (good.stdout, good.stderr)  # the probe works
        done = subprocess.run([*as_nobody, "x*"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
    assert done.returncode == 2 and "JOURNALCTL-RAN" not in done.stdout, (done.stdout, done.stderr)
    assert "'x*' is not a valid instance name" in done.stderr, done.stderr
