"""The man pages say what the programs do: every subcommand and option of gpusupctl's and
supervisord-gpu's parsers is in the page's SYNOPSIS and COMMANDS, and every exit code of
errors.py in its EXIT STATUS. The pages had fallen behind the README (exit codes 4 and 6,
`switch --dry-run/--from/--wait`, `status --cluster`): a new option now fails here until the
page has it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from supervisord_gpu import errors
from supervisord_gpu.cli import daemon, gpusupctl

REPO = Path(__file__).resolve().parent.parent
PAGES = {"gpusupctl": (REPO / "packaging/man/gpusupctl.1", gpusupctl.parser),
         "supervisord-gpu": (REPO / "packaging/man/supervisord-gpu.8", daemon.parser)}


def plain(roff: str) -> str:
    """A roff line as a person reads it: macros, font escapes and quotes gone, `\\-` a dash."""
    text = re.sub(r"^\.(?:B|I|BR|RB|BI|IB|RI|IR)\s+", "", roff)
    text = re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace('"', "")
    return text


def sections(path: Path) -> dict[str, list[str]]:
    """`.SH NAME` -> its lines."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in path.read_text().splitlines():
        if line.startswith(".SH "):
            current = line[4:].strip().strip('"')
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def synopsis_blocks(prog: str, lines: list[str]) -> list[str]:
    """The SYNOPSIS, one string per command form (forms are separated by .br or .PP)."""
    blocks, block = [], []
    for line in lines:
        if line in (".br", ".PP"):
            blocks.append(" ".join(block))
            block = []
        else:
            block.append(plain(line))
    blocks.append(" ".join(block))
    return [b for b in blocks if b.startswith(prog)]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> list[list[str]]:
    """Each option's spellings (-f, --follow), help excepted."""
    return [list(a.option_strings) for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def words(text: str) -> set[str]:
    return set(re.findall(r"-{1,2}[A-Za-z][A-Za-z0-9-]*|[A-Za-z][A-Za-z0-9-]*", text))


CASES = [(prog, verb) for prog, (_page, make) in PAGES.items() for verb in subcommands(make())]


@pytest.mark.parametrize("prog,verb", CASES)
def test_every_subcommand_and_its_options_are_in_the_synopsis(prog: str, verb: str) -> None:
    page, make = PAGES[prog]
    forms = [b for b in synopsis_blocks(prog, sections(page)["SYNOPSIS"]) if verb in words(b.split("[", 1)[0])]
    assert forms, f"{page.name}: SYNOPSIS has no form of `{prog} {verb}`"
    shown = set().union(*(words(f) for f in forms))
    missing = [" or ".join(spellings) for spellings in options(subcommands(make())[verb]) if not set(spellings) & shown]
    assert not missing, f"{page.name}: SYNOPSIS of `{prog} {verb}` lacks {', '.join(missing)}"


@pytest.mark.parametrize("prog,verb", CASES)
def test_every_subcommand_and_each_spelling_of_its_options_is_described(prog: str, verb: str) -> None:
    page, make = PAGES[prog]
    described = sections(page)["COMMANDS"]
    headings = [plain(described[i + 1]) for i, line in enumerate(described[:-1]) if line == ".TP"]
    assert any(verb in words(h.split("[", 1)[0]) for h in headings), f"{page.name}: COMMANDS has no entry for `{verb}`"
    text = words("\n".join(plain(line) for line in page.read_text().splitlines()))
    missing = [s for spellings in options(subcommands(make())[verb]) for s in spellings if s not in text]
    assert not missing, f"{page.name}: `{prog} {verb}` options never described: {', '.join(missing)}"


def exit_codes() -> set[int]:
    """Every exit code errors.py defines: its EXIT_ constants and its errors' own codes."""
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
    codes |= {c.exit_code for c in vars(errors).values()
              if isinstance(c, type) and issubclass(c, errors.SupervisorError)}
    return codes


@pytest.mark.parametrize("prog", PAGES)
def test_every_exit_code_is_in_exit_status(prog: str) -> None:
    page, _ = PAGES[prog]
    lines = sections(page)["EXIT STATUS"]
    listed = {int(plain(lines[i + 1])) for i, line in enumerate(lines[:-1])
              if line == ".TP" and plain(lines[i + 1]).isdigit()}
    assert exit_codes() <= listed, f"{page.name}: EXIT STATUS lacks {sorted(exit_codes() - listed)}"
    assert {0, 1, 2, 3, 4, 5, 6} <= exit_codes()  # the test reads the table it means to

