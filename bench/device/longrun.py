"""One device benchmark across several device calls: `detach` starts it, `collect` follows it.

WHY: a device command may run 600 s at most, and processes it leaves behind are killed when it
returns, except one that started a new process session. A benchmark longer than one call (issue
38's 10-minute pause next to a server start, 20 rounds of busy cases) therefore runs in its own
session (setsid), and the calls after it only wait for it and bring back its progress. The
machine goes back after 30 s idle between calls, and a fresh machine has an empty /tmp: the
`collect` calls must follow each other within 30 s.

    SCRIPT detach --out-dir D <the run's options>   # starts it, writes D/run.json, exit 0 at once
    SCRIPT collect --out-dir D --out $OUT --wait S   # waits up to S s, copies progress to $OUT

`collect` exits 0 when the run finished and every case passed, 3 while it still runs (call it
again within 30 s), 1 when it finished with a failure or died without its exit record, 2 when
D holds no readable run record. Layout of D: run.json (pid, its start time in clock ticks, the
start, argv), run.log (the run's stdout and stderr), out/ (the run's --out: results JSON written
after each case, the logs tarball at its end), exit.json (the run's exit code, written last).

Owner of every file read here: this script, as the same user, in a directory named on the command
line; still, run.json and exit.json are parsed into typed records, and a bad one is one line and
exit 2 (run.json) or "died without results" (exit.json), never a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FINISHED_PASS, FAILED, BAD_RECORD, RUNNING = 0, 1, 2, 3
LOG_TAIL_LINES = 40
LIVE_LOGS_CAP_BYTES = 40 << 20  # a tarball of the run's logs so far, when they are this small or less


class BadRecord(Exception):
    """run.json missing or not what detach writes: one line naming the file and what is wrong."""


@dataclass(frozen=True)
class Detached:
    pid: int
    start_ticks: int  # /proc/PID/stat field 22: with the pid, the exact identity (a pid is reused)
    started: float
    argv: list[str]
    work: str  # the run's work directory (its logs so far are under work/logs)

    @classmethod
    def parse(cls, path: Path) -> Detached:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadRecord(f"{path}: no detached run here (run `detach --out-dir {path.parent}` first)") from None
        except (OSError, ValueError) as e:
            raise BadRecord(f"{path}: not readable JSON ({e.__class__.__name__})") from None
        if not isinstance(raw, dict):
            raise BadRecord(f"{path}: not a JSON object")
        pid, ticks, started, argv, work = (raw.get(k) for k in ("pid", "start_ticks", "started", "argv", "work"))
        if not (isinstance(pid, int) and not isinstance(pid, bool) and pid > 1):
            raise BadRecord(f"{path}: key pid: not a process id above 1: {pid!r}")
        if not (isinstance(ticks, int) and not isinstance(ticks, bool) and ticks >= 0):
            raise BadRecord(f"{path}: key start_ticks: not a count of clock ticks: {ticks!r}")
        if not isinstance(started, (int, float)) or isinstance(started, bool):
            raise BadRecord(f"{path}: key started: not a time: {started!r}")
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            raise BadRecord(f"{path}: key argv: not a list of strings")
        if not isinstance(work, str):
            raise BadRecord(f"{path}: key work: not a path")
        return cls(pid, ticks, float(started), argv, work)


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None when there is none or it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the comm, which may hold spaces and parentheses
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def running(rec: Detached) -> bool:
    return start_ticks(rec.pid) == rec.start_ticks


def exit_code(out_dir: Path) -> int | None:
    """The run's own exit code, from the exit.json it writes last; None when absent or not an int."""
    try:
        code = json.loads((out_dir / "exit.json").read_text()).get("code")
    except (OSError, ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


# ============================================================================ detach

def detach(argv: list[str], parser: Callable[[], argparse.ArgumentParser], script: Path,
           work_dir: Callable[[argparse.Namespace], str]) -> int:
    ap = argparse.ArgumentParser(prog=f"{script.name} detach", description="start the run in its own session",
                                 allow_abbrev=False)  # else the run's --out would be taken for --out-dir
    ap.add_argument("--out-dir", required=True, help="where run.json, run.log, out/ and exit.json go (on the device: under /tmp)")
    mine, rest = ap.parse_known_args(argv)
    if any(a == "--out" or a.startswith("--out=") for a in rest):
        print(f"{script.name} detach: --out is the run's own ({mine.out_dir}/out): leave it out", file=sys.stderr)
        return 2
    out_dir = Path(mine.out_dir)
    run_argv = [*rest, "--out", str(out_dir / "out")]
    args = parser().parse_args(run_argv)  # bad options: argparse's line and exit 2 here, not in the detached run
    try:
        old = Detached.parse(out_dir / "run.json")
    except BadRecord:
        old = None
    if old is not None and running(old):
        print(f"{script.name} detach: a run is still going in {out_dir} (pid {old.pid}): `collect` it first", file=sys.stderr)
        return 2
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    work = work_dir(args)  # the bench's own choice, so that collect finds its logs where the run writes them
    cmd = [sys.executable, str(script), "_detached", "--out-dir", str(out_dir), "--", *run_argv, "--work", work]
    with open(out_dir / "run.log", "wb") as log:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=os.getcwd(), env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ticks = start_ticks(child.pid)
    rec = {"pid": child.pid, "start_ticks": ticks if ticks is not None else 0, "started": time.time(),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": cmd, "work": work}
    (out_dir / "run.json").write_text(json.dumps(rec, indent=1))
    print(f"detached: pid {child.pid} (its own session), log {out_dir / 'run.log'}, results {out_dir / 'out'}")
    print("  " + " ".join(cmd))
    print(f"follow it: {script.name} collect --out-dir {out_dir} --out $OUT --wait 540  (again within 30 s while it exits 3)")
    return 0


def run_detached(argv: list[str], main: Callable[[list[str]], int]) -> int:
    """The detached process: the run, then exit.json with its code (written last: its presence means finished)."""
    ap = argparse.ArgumentParser(prog="_detached", allow_abbrev=False)
    ap.add_argument("--out-dir", required=True)
    mine, rest = ap.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    code = FAILED
    try:
        code = main(rest)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else FAILED
    finally:
        sys.stdout.flush()
        path = Path(mine.out_dir) / "exit.json"
        path.with_suffix(".tmp").write_text(json.dumps({"code": code, "ended": time.time()}))
        os.replace(path.with_suffix(".tmp"), path)
    return code


# ============================================================================ collect

def collect(argv: list[str], script: Path) -> int:
    ap = argparse.ArgumentParser(prog=f"{script.name} collect", description="wait for the detached run, copy its progress",
                                 allow_abbrev=False)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--out", required=True, help="where its results and logs so far are copied ($OUT)")
    ap.add_argument("--wait", type=float, default=540.0, help="seconds to wait for it to finish (under ~560: one device call)")
    args = ap.parse_args(argv)
    out_dir, dest = Path(args.out_dir), Path(args.out)
    try:
        rec = Detached.parse(out_dir / "run.json")
    except BadRecord as e:
        print(f"{script.name} collect: {e}", file=sys.stderr)
        return BAD_RECORD
    deadline = time.monotonic() + max(0.0, args.wait)
    while exit_code(out_dir) is None and running(rec) and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    code, alive = exit_code(out_dir), running(rec)
    copy_progress(out_dir, dest, Path(rec.work), finished=code is not None or not alive)
    print_progress(out_dir, rec)
    if code is None and alive:
        print(f"\nSTILL RUNNING (pid {rec.pid}, {time.time() - rec.started:.0f} s): collect again within 30 s")
        return RUNNING
    if code is None:
        print(f"\nDIED: pid {rec.pid} is gone and wrote no exit record (killed? see run.log)")
        return FAILED
    results = summary(out_dir)
    ok = code == 0 and bool(results) and all(v == "PASS" for v in results.values())
    print(f"\nFINISHED: exit {code}, {'all PASS' if ok else 'not all PASS'}")
    return FINISHED_PASS if ok else FAILED


def copy_progress(out_dir: Path, dest: Path, work: Path, finished: bool) -> None:
    """The run's results and logs so far into dest (emptied before each device command)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in [out_dir / "run.json", out_dir / "run.log", out_dir / "exit.json", *sorted((out_dir / "out").glob("*"))]:
        if f.is_file() and not f.name.endswith(".tmp"):
            shutil.copyfile(f, dest / f.name)
    logs = work / "logs"
    if finished or not logs.is_dir():
        return  # at its end the run tars its logs into out/ itself
    files = [p for p in logs.rglob("*") if p.is_file()]
    if sum(p.stat().st_size for p in files if p.exists()) > LIVE_LOGS_CAP_BYTES:
        return
    try:
        with tarfile.open(dest / "logs-so-far.tar.gz", "w:gz") as tf:
            tf.add(logs, arcname="logs-so-far")
    except (OSError, tarfile.TarError) as e:  # a log that shrank or vanished while read: the next call's copy
        print(f"(logs so far not copied: {e.__class__.__name__}: {e})")


def summary(out_dir: Path) -> dict[str, str]:
    """Case -> result, from the results JSON the run saves after each case ({} when none yet)."""
    for f in sorted((out_dir / "out").glob("*.json")):
        try:
            scen = json.loads(f.read_text()).get("scenarios") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(scen, dict):
            return {str(k): str(v.get("result", "RUNNING")) if isinstance(v, dict) else "?" for k, v in scen.items()}
    return {}


def print_progress(out_dir: Path, rec: Detached) -> None:
    try:
        lines = (out_dir / "run.log").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    print(f"== run.log, last {LOG_TAIL_LINES} of {len(lines)} lines")
    for line in lines[-LOG_TAIL_LINES:]:
        print("  " + line)
    results = summary(out_dir)
    print(f"== results so far ({len(results)} cases, {time.time() - rec.started:.0f} s since detach)")
    for k, v in results.items():
        print(f"  {v:<8} {k}")


def dispatch(argv: list[str], main: Callable[[list[str]], int], parser: Callable[[], argparse.ArgumentParser],
             work_dir: Callable[[argparse.Namespace], str], script: Path | None = None) -> int:
    """The script's verbs: detach, collect, _detached (the detached process itself); else the run as before."""
    script = script or Path(sys.argv[0]).resolve()
    verb, rest = (argv[0], argv[1:]) if argv else ("", [])
    if verb == "detach":
        return detach(rest, parser, script, work_dir)
    if verb == "collect":
        return collect(rest, script)
    if verb == "_detached":
        return run_detached(rest, main)
    return main(argv)
