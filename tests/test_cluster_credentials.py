"""etcd's client key and password file are readable by root alone: group read and ACLs count (#37).

A local user who reads either writes etcd as this node, and etcd's orders are run as root. The
old check looked at the "other" bits only: a 0600 key with a POSIX ACL read grant (shown as 0640
root:root, the group bits being the ACL's mask) and a 0640 root:users key were accepted. Each
case here first reads the file as `nobody` (the local user of the finding), then is refused in
one line naming the `[cluster]` key, the file and what is wrong.
"""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisord_gpu.cluster.credentials import checked, read_password
from supervisord_gpu.errors import ConfigError

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the files are root's, the reader `nobody`"),
    pytest.mark.skipif(shutil.which("setfacl") is None or shutil.which("setpriv") is None,
                       reason="needs setfacl (apt package acl, in the Makefile's TEST_APT_PKGS) and setpriv"),
]


@pytest.fixture
def etcd_dir() -> Iterator[Path]:
    """A root 0755 directory as /etc/supervisord-gpu/etcd is: `nobody` may go through it."""
    path = Path(f"/tmp/etcd-creds-{uuid.uuid4().hex[:10]}")
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def secret(directory: Path, name: str, mode: int, group: str = "root") -> Path:
    path = directory / name
    path.write_text("the-password\n")
    os.chown(path, 0, grp.getgrnam(group).gr_gid)
    os.chmod(path, mode)
    return path


def nobody_reads(path: Path, group: str = "nogroup") -> bool:
    """Whether `nobody` (with `group` as its only group) can read the file: the attack itself."""
    done = subprocess.run(["setpriv", "--reuid=nobody", f"--regid={group}", "--clear-groups", "cat", str(path)],
                          capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def users_group() -> str:
    try:
        return grp.getgrgid(100).gr_name
    except KeyError:
        pytest.skip("needs the group `users` (gid 100)")


@pytest.mark.parametrize("grant, words", [
    ("u:nobody:r", "has an ACL letting user 65534 (nobody) read it"),
    ("g:nogroup:r", "has an ACL letting group 65534 (nogroup) read it"),
])
def test_a_0600_key_with_an_acl_read_grant_is_refused_naming_it(etcd_dir, grant, words):
    key = secret(etcd_dir, "node.key", 0o600)
    subprocess.run(["setfacl", "-m", grant, str(key)], check=True)
    assert nobody_reads(key), "the ACL did not give nobody read: the case is not the finding's"
    with pytest.raises(ConfigError) as refused:
        checked(str(key), "key", secret=True)
    message = str(refused.value)
    assert message.startswith(f"{key}: cluster.key: {words}") and f"setfacl -b {key}" in message, message
    assert "\n" not in message


def test_a_0640_password_file_of_group_users_is_refused_naming_the_group(etcd_dir):
    users = users_group()
    password = secret(etcd_dir, "password", 0o640, group=users)
    assert nobody_reads(password, group=users)
    with pytest.raises(ConfigError) as refused:
        read_password(str(password))
    assert str(refused.value).startswith(f"{password}: cluster.password_file: is readable by group {users} (mode 0640)")


def test_an_acl_that_names_no_one_else_and_a_0640_root_group_key_are_accepted(etcd_dir):
    key = secret(etcd_dir, "node.key", 0o640)
    assert not nobody_reads(key)
    assert checked(str(key), "key", secret=True) == str(key)
    subprocess.run(["setfacl", "-m", "u:root:r", str(key)], check=True)  # an ACL, but root's own entry
    assert checked(str(key), "key", secret=True) == str(key)


def test_the_ca_certificate_may_be_read_by_anyone(etcd_dir):
    """It is public: only who may *write* it matters (config/trust.py's walk)."""
    ca = secret(etcd_dir, "ca.crt", 0o644, group=users_group())
    subprocess.run(["setfacl", "-m", "u:nobody:r", str(ca)], check=True)
    assert checked(str(ca), "cacert", secret=False) == str(ca)
