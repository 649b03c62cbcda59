"""etcd as a deployment runs it, for the tests that need one: a throw-away CA (openssl), etcd's
server certificate, client certificates for the nodes, and etcd's authentication switched on
the way the README tells an operator to (a `root` user for the operator, a `gpusup` role that
may read and write only under our prefix, a `gpusup` user with that role, and a user with no
role at all). Used by test_cluster_tls.py (one etcd on the host) and by the three hosts of
test_cluster_systemd.py (etcd on host c, the nodes a and b its clients).

`python tests/etcd_pki.py enable-auth URL CA CERT KEY PREFIX PASSWORD` runs `enable_auth`
inside a test host (etcd there listens where only the hosts reach it).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

#: the password of the `gpusup` etcd user the nodes log in as (tests only)
PASSWORD = "s3cret-of-the-nodes"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"), "-days", "1", "-subj", f"/CN={name}")


def signed(d: Path, name: str, subject: str, ca: str, usage: str, san: str = "") -> tuple[Path, Path]:
    key, csr, crt, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    ext.write_text(f"extendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else ""))
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
            "-out", str(csr), "-subj", subject)
    openssl("x509", "-req", "-in", str(csr), "-CA", str(d / f"{ca}.crt"), "-CAkey", str(d / f"{ca}.key"),
            "-CAcreateserial", "-out", str(crt), "-days", "1", "-extfile", str(ext))
    os.chmod(key, 0o600)
    return crt, key


def make_pki(d: Path, server_ips: tuple[str, ...] = ("127.0.0.1",), nodes: tuple[str, ...] = ("node-a",)) -> Path:
    """ca.crt/key, rogue-ca (a CA etcd does not trust), server.crt/key for `server_ips`, one
    client certificate per node (and `neighbour`, one that rogue-ca signed), the password file."""
    os.chmod(d, 0o755)
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    # the server's CN names no etcd user: the JSON gateway reaches etcd with this certificate
    signed(d, "server", "/CN=etcd-server", "ca", "serverAuth,clientAuth", ",".join(f"IP:{ip}" for ip in server_ips))
    # no CN: with authentication on, etcd's JSON gateway refuses a client certificate that has one
    for node in nodes:
        signed(d, node, f"/O=supervisord-gpu/OU={node}", "ca", "clientAuth", f"DNS:{node}")
    signed(d, "neighbour", f"/O=supervisord-gpu/OU={nodes[0]}", "rogue-ca", "clientAuth", f"DNS:{nodes[0]}")
    (d / "password").write_text(PASSWORD + "\n")
    os.chmod(d / "password", 0o600)
    return d


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def admin(url: str, ca: str, cert: str, key: str, path: str, body: dict, token: str = ""):  # type: ignore[no-untyped-def]
    """One call of etcd's JSON gateway with a client certificate (and a token)."""
    import requests

    return requests.post(f"{url}/v3/{path}", json=body, verify=ca, timeout=5, cert=(cert, key),
                         headers={"Authorization": token} if token else {})


def enable_auth(url: str, ca: str, cert: str, key: str, prefix: str, password: str = PASSWORD) -> None:
    """What the operator does once (etcdctl in the README; the same calls through the gateway)."""
    end = prefix + "0"  # the key after every PREFIX/...: '/' + 1
    for path, body in [
        ("auth/user/add", {"name": "root", "password": "root-pw"}),
        ("auth/role/add", {"name": "root"}),
        ("auth/user/grant", {"user": "root", "role": "root"}),
        ("auth/role/add", {"name": "gpusup"}),
        ("auth/role/grant", {"name": "gpusup", "perm": {"permType": "READWRITE", "key": b64(prefix + "/"),
                                                        "range_end": b64(end)}}),
        ("auth/user/add", {"name": "gpusup", "password": password}),
        ("auth/user/grant", {"user": "gpusup", "role": "gpusup"}),
        ("auth/user/add", {"name": "nobody", "password": "nobody-pw"}),
        ("auth/enable", {}),
    ]:
        r = admin(url, ca, cert, key, path, body)
        assert r.status_code == 200, (path, r.status_code, r.text)


if __name__ == "__main__":
    if sys.argv[1:2] != ["enable-auth"] or len(sys.argv) != 8:
        sys.exit("usage: etcd_pki.py enable-auth URL CA CERT KEY PREFIX PASSWORD")
    enable_auth(*sys.argv[2:8])
