"""etcd as a deployment should run it, and as Patroni uses it: TLS with client certificates
(--client-cert-auth) and etcd's authentication, a `gpusup` user whose role may read and write
only under our prefix. A real etcd (Debian's etcd-server), a throw-away CA made with openssl.

What it shows: a neighbour without a certificate (or with one another CA signed) is refused; a
certificate alone, a wrong password or an etcd user without our role writes nothing; our user
writes nothing outside the prefix; a local user cannot read the key or the password file, and
the daemon refuses those files when others could; our client with the right files works."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

import etcd_pki
from etcd_pki import PASSWORD, b64, make_pki
from etcd_server import EtcdServer, Tls
from supervisord_gpu.cluster.plan import ClusterPlan
from supervisord_gpu.cluster.records import LockRecord, NodeRecord, ProcessRecord, StepReport
from supervisord_gpu.cluster.store import ClusterStore, ClusterUnavailable
from supervisord_gpu.config.loader import load_daemon_config
from supervisord_gpu.config.model import ClusterConfig
from supervisord_gpu.errors import ConfigError

PREFIX = "/gpusup-test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_pki(tmp_path_factory.mktemp("pki"))


def admin(etcd: EtcdServer, path: str, body: dict, token: str = ""):  # type: ignore[no-untyped-def]
    tls = etcd.tls
    assert tls is not None
    return etcd_pki.admin(etcd.url, str(tls.ca), str(tls.client_cert), str(tls.client_key), path, body, token)


def enable_auth(etcd: EtcdServer) -> None:
    tls = etcd.tls
    assert tls is not None
    etcd_pki.enable_auth(etcd.url, str(tls.ca), str(tls.client_cert), str(tls.client_key), PREFIX)


@pytest.fixture
def etcd(tmp_path, pki):  # type: ignore[no-untyped-def]
    server = EtcdServer(tmp_path, Tls(pki / "ca.crt", pki / "server.crt", pki / "server.key",
                                      pki / "node-a.crt", pki / "node-a.key"))
    try:
        enable_auth(server)
        yield server
    finally:
        server.stop()


def config(server: EtcdServer, pki: Path, **changes: object) -> ClusterConfig:
    fields: dict = dict(node="a", etcd=(server.url,), prefix=PREFIX, lease_ttl_s=5, cacert=str(pki / "ca.crt"),
                        cert=str(pki / "node-a.crt"), key=str(pki / "node-a.key"), user="gpusup",
                        password_file=str(pki / "password"))
    fields.update(changes)
    return ClusterConfig(**fields)


def test_our_client_with_the_right_files_does_all_a_transition_needs(etcd, pki):
    store = ClusterStore(config(etcd, pki))
    lease = store.grant()
    store.announce(NodeRecord("a", pid=1), lease)
    me = LockRecord("a", "tp", starting=("tp",), pid=1, tid="t1")
    assert store.acquire(lease, me) is None and store.holder() is not None
    store.put_plan("t1", ClusterPlan("tp", (), ()), lease)
    assert store.current() == ("t1", ClusterPlan("tp", (), ()))
    store.report("t1", 1, "a", StepReport("done"), lease)
    assert set(store.wait_step("t1", 1, ("a",), time.monotonic() + 5)) == {"a"}
    store.publish_process(ProcessRecord("tp", "a", "router", "ready"), lease)
    assert store.process_states("tp") == {"a/router": "ready"} and set(store.nodes()) == {"a"}
    assert store.refresh(lease)
    store.release(me)
    assert store.holder() is None
    store.revoke(lease)


def test_a_neighbour_without_a_certificate_of_our_ca_is_refused(etcd, pki):
    with pytest.raises(ClusterUnavailable, match="cannot be reached"):  # no certificate: the TLS handshake fails
        ClusterStore(config(etcd, pki, cert=None, key=None, user=None, password_file=None)).holder()
    with pytest.raises(ClusterUnavailable, match="cannot be reached"):  # a certificate of another CA
        ClusterStore(config(etcd, pki, cert=str(pki / "neighbour.crt"), key=str(pki / "neighbour.key"))).holder()
    with pytest.raises(ClusterUnavailable, match="cannot be reached"):  # plain HTTP to etcd's TLS port
        ClusterStore(config(etcd, pki, etcd=(etcd.url.replace("https", "http"),), cacert=None, cert=None, key=None)).holder()


def test_a_certificate_alone_a_wrong_password_or_another_user_writes_nothing(etcd, pki, tmp_path):
    put = {"key": b64(PREFIX + "/current"), "value": b64("t666")}
    r = admin(etcd, "kv/put", put)  # our CA's certificate, no token
    assert r.status_code != 200 and "user name is empty" in r.text, r.text
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    os.chmod(wrong, 0o600)
    with pytest.raises(ClusterUnavailable, match="etcd refused user 'gpusup'"):
        ClusterStore(config(etcd, pki, password_file=str(wrong))).holder()
    r = admin(etcd, "auth/authenticate", {"name": "nobody", "password": "nobody-pw"})  # a user without our role
    token = r.json()["token"]
    r = admin(etcd, "kv/put", put, token)
    assert r.status_code != 200 and "permission denied" in r.text, r.text
    r = admin(etcd, "kv/range", {"key": b64(PREFIX + "/lock")}, token)
    assert r.status_code != 200 and "permission denied" in r.text, r.text
    ours = admin(etcd, "auth/authenticate", {"name": "gpusup", "password": PASSWORD}).json()["token"]
    r = admin(etcd, "kv/put", {"key": b64("/elsewhere/x"), "value": b64("y")}, ours)  # outside our prefix
    assert r.status_code != 200 and "permission denied" in r.text, r.text
    r = admin(etcd, "kv/put", {"key": b64(PREFIX), "value": b64("y")}, ours)  # the prefix itself is not under it
    assert r.status_code != 200 and "permission denied" in r.text, r.text
    assert admin(etcd, "kv/put", put, ours).status_code == 200  # inside it: what the nodes need


def test_an_expired_token_is_renewed_once_and_the_request_repeated(etcd, pki):
    store = ClusterStore(config(etcd, pki))
    assert store.holder() is None
    session = store.kv.client.session  # type: ignore[attr-defined]
    session._shared.value = "not-a-token-etcd-knows"
    assert store.holder() is None and session._shared.value != "not-a-token-etcd-knows"


@pytest.mark.skipif(os.geteuid() != 0, reason="file ownership checks apply to the root daemon")
def test_the_key_and_password_files_are_root_s_alone(etcd, pki, tmp_path):
    for name in ("node-a.key", "password"):  # a local user cannot read them
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(pki / name)],
                           capture_output=True, text=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
    loose = tmp_path / "loose"
    loose.mkdir()
    for name, key in (("node-a.key", "key"), ("password", "password_file")):
        copy = loose / name
        copy.write_bytes((pki / name).read_bytes())
        os.chmod(copy, 0o644)
        with pytest.raises(ConfigError) as e:
            ClusterStore(config(etcd, pki, **{key: str(copy)}))
        assert f"cluster.{key}: is readable by every user (mode 0644)" in str(e.value), str(e.value)
    ca = loose / "ca.crt"
    ca.write_bytes((pki / "ca.crt").read_bytes())
    os.chmod(ca, 0o666)  # whoever could replace the CA could make us trust their etcd
    with pytest.raises(ConfigError, match="cluster.cacert: is writable by non-root users"):
        ClusterStore(config(etcd, pki, cacert=str(ca)))
    os.chown(ca, 65534, 65534)
    os.chmod(ca, 0o644)
    with pytest.raises(ConfigError, match="cluster.cacert: is writable by non-root users"):
        ClusterStore(config(etcd, pki, cacert=str(ca)))


CLUSTER_TABLE = """
[cluster]
node = "a"
etcd = ["https://10.0.0.1:2379"]
cacert = "/etc/supervisord-gpu/etcd/ca.crt"
cert = "/etc/supervisord-gpu/etcd/node.crt"
key = "/etc/supervisord-gpu/etcd/node.key"
user = "gpusup"
password_file = "/etc/supervisord-gpu/etcd/password"
"""


def test_the_cluster_table_takes_the_tls_and_auth_files(tmp_path):
    (tmp_path / "supervisord-gpu.toml").write_text(textwrap.dedent(CLUSTER_TABLE))
    c = load_daemon_config(tmp_path).cluster
    assert (c.cacert, c.cert, c.key, c.user, c.password_file) == (
        "/etc/supervisord-gpu/etcd/ca.crt", "/etc/supervisord-gpu/etcd/node.crt", "/etc/supervisord-gpu/etcd/node.key",
        "gpusup", "/etc/supervisord-gpu/etcd/password")


@pytest.mark.parametrize("edit, key, words", [
    (lambda t: t.replace('key = "/etc/supervisord-gpu/etcd/node.key"\n', ""), "cluster.key", "cert and key go together"),
    (lambda t: t.replace('user = "gpusup"\n', ""), "cluster.user", "user and password_file go together"),
    (lambda t: t.replace("https://", "http://"), "cluster.etcd", "must be https:// URLs"),
    (lambda t: t.replace('"/etc/supervisord-gpu/etcd/ca.crt"', '"ca.crt"'), "cluster.cacert", "must be an absolute path"),
    (lambda t: t.replace('user = "gpusup"', 'user = "a b"'), "cluster.user", "must be an etcd user name"),
    (lambda t: t + 'password = "inline"\n', "cluster.password", "unknown key"),
])
def test_a_bad_tls_or_auth_key_is_one_line_naming_it(tmp_path, edit, key, words):
    (tmp_path / "supervisord-gpu.toml").write_text(edit(textwrap.dedent(CLUSTER_TABLE)))
    with pytest.raises(ConfigError) as e:
        load_daemon_config(tmp_path)
    assert f"{key}: " in str(e.value) and words in str(e.value), str(e.value)
