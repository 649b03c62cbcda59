"""The version is written once (supervisord_gpu/__init__.py): the package metadata reads it from
there (pyproject's dynamic version), both commands print it, and the Debian changelog, which
dpkg needs in its own file, is held to it here."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

import supervisord_gpu
from supervisord_gpu.cli import daemon, gpusupctl

REPO = Path(__file__).resolve().parents[1]


def test_metadata_and_the_debian_changelog_carry_the_packages_version():
    upstream = re.match(r"\S+ \(([^)-]+)-[^)]+\)", (REPO / "packaging/debian/changelog").read_text())
    assert upstream is not None and upstream.group(1) == supervisord_gpu.__version__
    assert version("supervisord-gpu") == supervisord_gpu.__version__
    assert 'version = "' not in (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0]


@pytest.mark.parametrize("main,prog", [(gpusupctl.main, "gpusupctl"), (daemon.main, "supervisord-gpu")])
def test_both_commands_print_it(main, prog, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"{prog} {supervisord_gpu.__version__}"
