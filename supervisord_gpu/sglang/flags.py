"""Does each server's rendered command line parse in the SGLang that will run it?

Flags change between SGLang releases (`--cuda-graph-max-bs` is gone in 0.5.23), so a
transition validates the new profile before it tears anything down. With SGLang installed,
its own parser decides (in a subprocess: importing SGLang costs seconds and a GPU stack we
must not load into the daemon). Without it, the 0.5.23 option table that the stand-in carries
decides, and the result says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
from collections.abc import Iterable

from ..records import dataclass

_REAL_CHECK = (
    "import sys\n"
    "from sglang.srt.server_args import prepare_server_args\n"
    "prepare_server_args(sys.argv[1:])\n"
)


@dataclass
class FlagCheck:
    process: str
    ok: bool
    how: str
    error: str = ""


def check_server_flags(servers: Iterable[tuple[str, list[str]]], python: str | None = None,
                       use_real: bool | None = None) -> list[FlagCheck]:
    """(name, the server's rendered arguments) for each server: does each parse?"""
    real = importlib.util.find_spec("sglang") is not None if use_real is None else use_real
    return [_check_real(name, args, python) if real else _check_table(name, args) for name, args in servers]


def _check_real(name: str, args: list[str], python: str | None) -> FlagCheck:
    import sys

    try:
        proc = subprocess.run([python or sys.executable, "-c", _REAL_CHECK, *args], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return FlagCheck(name, False, "installed SGLang's parser", f"could not run it: {e}")
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return FlagCheck(name, proc.returncode == 0, "installed SGLang's parser", last if proc.returncode else "")


def _check_table(name: str, args: list[str]) -> FlagCheck:
    from .options import SGLANG_VERSION, build_parser

    how = f"SGLang {SGLANG_VERSION} option table (SGLang not installed here)"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(args)
    except SystemExit as e:
        if e.code:
            lines = [line for line in err.getvalue().strip().splitlines() if line]
            return FlagCheck(name, False, how, lines[-1] if lines else f"exit {e.code}")
    return FlagCheck(name, True, how)
