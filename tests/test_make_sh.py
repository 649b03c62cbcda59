"""`sh make.sh`, the README's first command, on a tree unpacked as root from a tarball or
`git archive` (modes 0664/0775): it used to install everything (78 s) and then have the
rehearsal refuse the group-writable tree one directory at a time."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="make.sh fixes modes only as root")


def unpacked(top: Path) -> Path:
    """make.sh in a tree as a tarball unpacked by root leaves it: everything group-writable."""
    tree = top / "supervisord-gpu"
    (tree / "etc" / "supervisord-gpu" / "profiles").mkdir(parents=True)
    (tree / "etc" / "supervisord-gpu" / "profiles" / "pd-1p1d.toml").write_text("# a profile\n")
    shutil.copy(REPO / "make.sh", tree / "make.sh")
    for path in [tree, *tree.rglob("*")]:
        path.chmod(0o775 if path.is_dir() else 0o664)
    return tree


def run_make_sh(tree: Path, tmp_path: Path, target: str = "rehearse") -> subprocess.CompletedProcess[str]:
    """`sh make.sh TARGET` with a `make` that only says it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "make").write_text('#!/bin/sh\necho "make ran: $*"\n')
    (bin_dir / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["sh", "make.sh", target], cwd=tree, env=env, capture_output=True, text=True, timeout=60)


def test_as_root_make_sh_takes_group_write_off_its_own_tree_and_says_so(tmp_path: Path) -> None:
    top = tmp_path / "src"
    top.mkdir(mode=0o755)
    top.chmod(0o755)
    tree = unpacked(top)
    r = run_make_sh(tree, tmp_path)
    assert r.returncode == 0 and "make ran: --no-print-directory rehearse" in r.stdout, r.stdout + r.stderr
    assert f"make.sh: {tree}: took group and other write permission off 6 files and directories" in r.stdout, r.stdout
    modes = {p.relative_to(tree).as_posix(): p.stat().st_mode & 0o777 for p in [tree, *tree.rglob("*")]}
    assert set(modes.values()) <= {0o755, 0o644}, modes
    again = run_make_sh(tree, tmp_path)
    assert "took group" not in again.stdout, again.stdout  # said once: nothing left to fix


def test_directories_above_the_tree_that_others_may_write_are_all_named_before_anything_is_installed(tmp_path: Path) -> None:
    top = tmp_path / "shared"
    (top / "deeper").mkdir(parents=True)
    top.chmod(0o775)
    (top / "deeper").chmod(0o777)
    tree = unpacked(top / "deeper")
    r = run_make_sh(tree, tmp_path)
    assert r.returncode == 2 and "make ran" not in r.stdout, r.stdout + r.stderr
    both = f"{top / 'deeper'} {top}"
    assert f"below them: {both}; fix them all with: chmod go-w {both}\n" in r.stderr, r.stderr
    assert (tree / "make.sh").stat().st_mode & 0o777 == 0o644  # its own tree is still fixed, and said


def test_a_tree_of_another_user_is_named_and_left_alone(tmp_path: Path) -> None:
    """A user's clone run as root: the daemon would refuse it whatever its modes, so make.sh
    changes nothing of that user's and says how out, before installing anything."""
    top = tmp_path / "home"
    top.mkdir(mode=0o755)
    top.chmod(0o755)
    tree = unpacked(top)
    os.chown(tree, 65534, 65534)  # nobody's
    r = run_make_sh(tree, tmp_path)
    assert r.returncode == 2 and "make ran" not in r.stdout, r.stdout + r.stderr
    assert f"these are not root's: {tree} (nobody); copy the tree to a directory of root's" in r.stderr, r.stderr
    assert (tree / "make.sh").stat().st_mode & 0o777 == 0o664  # untouched


def test_the_suite_still_runs_from_a_tree_the_rehearsal_refuses_and_leaves_another_users_tree_alone(tmp_path: Path) -> None:
    """`sh make.sh test` from a checkout anywhere (the README's promise, and CI's clone): what
    the rehearsal refuses (a user's tree, a directory above that others may write) is said as a
    warning, make runs, and the user's files keep their modes."""
    top = tmp_path / "shared"
    top.mkdir(mode=0o777)
    top.chmod(0o777)  # writable by others, not sticky
    tree = unpacked(top)
    os.chown(tree, 65534, 65534)  # nobody's
    r = run_make_sh(tree, tmp_path, "test")
    assert r.returncode == 0 and "make ran: --no-print-directory test" in r.stdout, r.stdout + r.stderr
    assert f"these are not root's: {tree} (nobody)" in r.stderr and "may write, so as root the daemon" in r.stderr, r.stderr
    assert (tree / "make.sh").stat().st_mode & 0o777 == 0o664  # untouched
