"""The routers we drive, one table each: sglang-router 0.3.2 and its successor smg 1.13.0.

Why a table: everything the supervisor must know of a router (its module, the process title
its holders show, its options, how long it takes to let go of its port after SIGTERM, whether
its worker API answers before the change is done) differs between the two, and each of these
is read by several places (the loader's default command and option check, the renderer, the
stop budgets, the worker API in engine/traffic.py, the stand-in router). Supporting a new
release means adding one `RouterKind` and its option file, not editing branches.

The option tables are data (`data/router-options-*.json`), written by `dump_options` from the
router's own argparse parser, the very one its `--help` prints (run
`python -m supervisord_gpu.sglang.routers dump smg` where that router is installed). Nothing here
imports a router: the daemon never loads one into its own process.

Facts from shared/reference/sglang-router.md (0.3.2: verified 2026-11-30; smg 1.13.0: on CPU in
front of stand-in servers, 2026-12-06).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from ..records import dataclass

DATA = Path(__file__).resolve().parent.parent / "data"
#: importlib.util.find_spec, or a test's fake (looked up at each call, never bound at import)
FindSpec = Callable[[str], object | None]
#: which router the rehearsal's stand-in plays (a RouterKind name; sglang-router when unset)
STANDIN_KIND_ENV = "SUPERVISORD_GPU_STANDIN_ROUTER"


@dataclass(frozen=True)
class RouterKind:
    """One router release, as a supervisor sees it."""

    #: the package name ("sglang-router", "smg")
    name: str
    version: str
    #: what `python -m MODULE` runs; the package half decides whether it is installed
    module: str
    #: its process title (setproctitle), what `ps` and our port-holder messages show
    title: str
    #: data/ file with its option table (dump_options)
    options_file: str
    #: after SIGTERM its listener stays open this long (smg: a "load-balancer propagation
    #: window" of 5 s, no flag changes it); 0.3.2 closes at once
    stop_listen_s: float
    #: an idle router's exit after SIGTERM (0.3.2: ~0.1 s; smg: ~6.5 s, measured)
    stop_idle_exit_s: float
    #: /workers POST/DELETE answer 202 and the change happens later: a 202 is never "done", the
    #: list is polled until it shows the change (smg lists a deleted worker as "draining", and a
    #: posted one only after its registration, ~2 s later)
    workers_async: bool
    #: flag that stops the router fetching a tokenizer from the hub at start ("" if it has none)
    no_tokenizer_fetch: str = ""
    #: flag that opens /v1/rl/... (pause, weight updates fanned out to every worker) ("" if none)
    rl_flag: str = ""

    @property
    def package(self) -> str:
        return self.module.split(".", 1)[0]

    def command(self, python: str = "python3") -> tuple[str, ...]:
        return (python, "-m", self.module)

    @property
    def stop_extra_s(self) -> float:
        """What a stop must allow on top of the drain: the time it keeps its port and exits idle."""
        return max(self.stop_listen_s, 0.0) + self.stop_idle_exit_s

    def installed(self, find_spec: FindSpec | None = None) -> bool:
        try:
            return (find_spec or importlib.util.find_spec)(self.package) is not None
        except (ImportError, ValueError):
            return False


SGLANG_ROUTER = RouterKind(
    name="sglang-router", version="0.3.2", module="sglang_router.launch_router", title="sglang::router",
    options_file="router-options-sglang-router-0.3.2.json", stop_listen_s=0.0, stop_idle_exit_s=0.1,
    workers_async=False,
)
SMG = RouterKind(
    name="smg", version="1.13.0", module="smg.launch_router", title="smg::router",
    options_file="router-options-smg-1.13.0.json", stop_listen_s=5.0, stop_idle_exit_s=6.5,
    workers_async=True, no_tokenizer_fetch="--disable-tokenizer-autoload", rl_flag="--enable-rl",
)
#: in order of preference when the config names no router_command and both are installed: smg is
#: the one maintained (0.3.2 was sglang-router's last release), and what a fresh install brings
ROUTERS: tuple[RouterKind, ...] = (SMG, SGLANG_ROUTER)
#: the names a config or the stand-in's environment may use
BY_NAME: dict[str, RouterKind] = {k.name: k for k in ROUTERS}


class NoRouterInstalled(Exception):
    """Neither router's package can be imported, and the config names no router_command."""

    def __str__(self) -> str:
        return ("no router installed: neither " + " nor ".join(f"{k.name} ({k.module})" for k in ROUTERS)
                + " can be imported; install one (pip install smg) or set [sglang] router_command")


def installed(find_spec: FindSpec | None = None) -> list[RouterKind]:
    """The routers this Python can run, most preferred first."""
    return [k for k in ROUTERS if k.installed(find_spec)]


def pick(find_spec: FindSpec | None = None) -> RouterKind:
    """The router to run when the config names none: the preferred one installed."""
    found = installed(find_spec)
    if not found:
        raise NoRouterInstalled()
    return found[0]


def resolve(command: Sequence[str],
            find_spec: FindSpec | None = None) -> tuple[tuple[str, ...], RouterKind | None]:
    """(the router's program, which router it is): the config's `router_command` when it names one
    (its kind None when it runs neither known module), else the preferred router installed; ((), None)
    when none is (said where a router is rendered, as one line: `NoRouterInstalled`).

    The router found installed is found in this Python (the daemon's), so this Python runs it:
    `python3` from the children's PATH may be another interpreter (a daemon installed in a venv,
    a system python3 without the router), which would fail at start with "No module named smg"."""
    if command:
        return tuple(command), of_command(command)
    try:
        kind = pick(find_spec)
    except NoRouterInstalled:
        return (), None
    return kind.command(sys.executable or "python3"), kind


def of_command(command: Sequence[str]) -> RouterKind | None:
    """Which router a command runs (`... -m MODULE`, or the stand-in told which to play); None: unknown."""
    argv = list(command)
    for i, token in enumerate(argv[:-1]):
        if token == "-m":
            return next((k for k in ROUTERS if k.module == argv[i + 1]), None)
    return None


# --- the option tables --------------------------------------------------------------------

@dataclass(frozen=True)
class RouterOption:
    """One option of a router's parser: enough to rebuild it (argparse) and to check a profile."""

    names: tuple[str, ...]
    #: store, store_true, append, extend, boolean_optional
    action: str
    #: argparse's nargs (None: one value; 0 for flags; "*", "+", "?" or a count)
    nargs: int | str | None = None
    #: int, float or str (the routers' own converters are recorded as str: a stand-in needs no more)
    type: str = "str"
    choices: tuple[str, ...] = ()
    default: Any = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def takes_value(self) -> bool:
        return self.action not in ("store_true", "boolean_optional")


@cache
def options(kind: RouterKind) -> dict[str, RouterOption]:
    """Every spelling of every option of `kind` (the packaged table), spelling -> option."""
    rows = json.loads((DATA / kind.options_file).read_text())["options"]
    table: dict[str, RouterOption] = {}
    for row in rows:
        option = RouterOption(tuple(row["names"]), row["action"], row.get("nargs"), row.get("type", "str"),
                              tuple(row.get("choices") or ()), row.get("default"))
        for name in option.names:
            table[name] = option
    return table


def has_option(kind: RouterKind, key: str) -> bool:
    """Does `kind` take `--key` (a profile's [router.options] key, without the dashes)?"""
    return f"--{key}" in options(kind)


_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def build_parser(kind: RouterKind, prog: str = "launch_router.py") -> argparse.ArgumentParser:
    """`kind`'s command line rebuilt from its table: what the stand-in parses and exits 2 on.

    Stricter than the real parser on one point: abbreviations are rejected (allow_abbrev=False).
    """
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description=f"Stand-in for `python -m {kind.module}` {kind.version}.")
    seen: set[str] = set()
    for option in options(kind).values():
        if option.name in seen:
            continue
        seen.add(option.name)
        dest = option.name[2:].replace("-", "_")
        kwargs: dict[str, Any] = {"dest": dest, "default": option.default}
        if option.action == "store_true":
            kwargs["action"] = "store_true"
        elif option.action == "boolean_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = {"store": "store", "append": "append", "extend": "extend"}[option.action]
            if option.nargs is not None:
                kwargs["nargs"] = option.nargs
            kwargs["type"] = _TYPES.get(option.type, str)
            if option.choices:
                kwargs["choices"] = list(option.choices)
        parser.add_argument(*option.names, **kwargs)
    return parser


_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_AppendAction": "append",
            "_ExtendAction": "extend", "BooleanOptionalAction": "boolean_optional"}


def dump_options(package: str) -> dict[str, Any]:
    """The table of the router installed here, read from its own parser (the one `--help` prints).

    Both releases build it with `RouterArgs.add_cli_args(parser, use_router_prefix=False)`.
    """
    import importlib

    router_args = importlib.import_module(f"{package}.router_args").RouterArgs
    parser = argparse.ArgumentParser(add_help=False)
    router_args.add_cli_args(parser, use_router_prefix=False)
    rows = []
    for action in parser._actions:
        kind = _ACTIONS.get(type(action).__name__)
        if kind is None or not action.option_strings:
            continue
        row: dict[str, Any] = {"names": list(action.option_strings), "action": kind}
        if kind not in ("store_true", "boolean_optional"):
            row["nargs"] = action.nargs
            row["type"] = action.type.__name__ if action.type in (int, float) else "str"
            if action.choices:
                row["choices"] = sorted(str(c) for c in action.choices)  # some come from a Rust map: any order
        default = action.default
        try:
            json.dumps(default)
        except TypeError:
            default = None
        row["default"] = default
        rows.append(row)
    return {"package": package, "options": rows}


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "dump" or argv[1] not in BY_NAME:
        print(f"usage: python -m supervisord_gpu.sglang.routers dump {{{','.join(BY_NAME)}}}", file=sys.stderr)
        return 2
    kind = BY_NAME[argv[1]]
    from importlib.metadata import version

    table = dump_options(kind.package)
    table["version"] = version(kind.name)  # the wheel's (smg's own version.py says 1.1.0 in 1.13.0)
    if table["version"] != kind.version:
        print(f"{kind.name} {table['version']} is installed, the table is for {kind.version}", file=sys.stderr)
        return 1
    rows = ",\n".join(json.dumps(row) for row in table["options"])  # one option a line: diffs read well
    sys.stdout.write(f'{{"package": "{table["package"]}", "version": "{table["version"]}", "options": [\n{rows}\n]}}\n')
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
