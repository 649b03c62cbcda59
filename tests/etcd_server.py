"""A real etcd (Debian's etcd-server) for one test: its own data dir and free ports, stopped after.
With `tls` (tests/test_cluster_tls.py makes the files), clients must come over TLS with a
certificate the CA signed (--client-cert-auth), as a deployment's etcd should."""

from __future__ import annotations

import shutil
import signal
import subprocess
import ssl
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from support import free_ports


class Tls(NamedTuple):
    """etcd's server certificate and key, the CA clients must be signed by, and one client's
    certificate and key (for the health check and the test's own admin requests)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


class EtcdServer:
    def __init__(self, tmp: Path, tls: Tls | None = None) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        client, peer = free_ports(2)
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{client}"
        self.log = tmp / "etcd.log"
        secure = ["--cert-file", str(tls.cert), "--key-file", str(tls.key), "--trusted-ca-file", str(tls.ca),
                  "--client-cert-auth"] if tls else []
        self.proc = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", str(tmp / "etcd-data"), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}", *secure],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not come up: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1, context=self.ssl_context()) as r:
                return r.status == 200
        except OSError:
            return False

    def pause(self) -> None:
        """etcd unreachable, as a partition looks to its clients: SIGSTOP, returning once every
        thread of it reads stopped: a stop reaches each thread on its own, and once in CI (2-core,
        loaded, at 2ebefbd) a read sent right after the signal was answered, so the test that
        expects it to time out failed; waiting for state T closes that window."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                states = [Path(t, "stat").read_text().rsplit(")", 1)[1].split()[0]
                          for t in Path(f"/proc/{self.proc.pid}/task").iterdir()]
            except (OSError, IndexError):
                break
            if all(st in "Tt" for st in states):
                return
            time.sleep(0.01)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def history(url: str, prefix: str, quiet_s: float = 1.0) -> list[tuple[str, str]]:
    """Every change under `prefix` since etcd began, in etcd's own (global) order: (key, state),
    state "" for a deletion. etcd's revisions order writes from every node, so this is the one
    trustworthy clock for what happened first across machines. `url` is a plain etcd's, or
    `config:DIR`: read as the node whose configuration is in DIR (its etcd, CA, certificate
    and login)."""
    return _history(_kv(url).client, prefix, quiet_s)


def _history(client, prefix: str, quiet_s: float) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    import json
    import queue

    now = int(client.status()["header"]["revision"])  # up to here: the agents never fall silent
    events, cancel = client.watch_prefix(prefix, start_revision=1)
    got: queue.Queue = queue.Queue()

    def drain() -> None:
        for e in events:
            got.put(e)

    import threading

    threading.Thread(target=drain, daemon=True).start()
    out: list[tuple[str, str]] = []
    try:
        while True:
            try:
                e = got.get(timeout=quiet_s)
            except queue.Empty:
                break
            kv = e["kv"]
            if int(kv.get("mod_revision", 0)) > now:
                break
            key = kv["key"].decode() if isinstance(kv["key"], bytes) else kv["key"]
            value = kv.get("value")
            try:
                record = json.loads(value) if e.get("type") != "DELETE" and value else {}
            except ValueError:
                record = {}  # not one of our JSON records (the current transition's id)
            out.append((key[len(prefix):], str(record.get("state", "")) if isinstance(record, dict) else ""))
    finally:
        cancel()
    return out


def value(url: str, key: str) -> str | None:
    """One key's value (None: absent), read as `history` reads."""
    kv = _kv(url)
    return next((e.value.decode(errors="replace") for e in kv.range(key)[1]), None)


def _kv(url: str):  # type: ignore[no-untyped-def]
    from supervisord_gpu.cluster.etcd import EtcdKV
    from supervisord_gpu.config.loader import load_daemon_config
    from supervisord_gpu.config.model import ClusterConfig

    if url.startswith("config:"):
        cluster = load_daemon_config(Path(url.removeprefix("config:"))).cluster
        assert cluster is not None, f"{url}: no [cluster] table"
    else:
        cluster = ClusterConfig(node="history", etcd=(url,))
    return EtcdKV(cluster)


if __name__ == "__main__":  # run inside a test host, as a node reads etcd (URL or config:DIR):
    import json as _json  # `etcd_server.py URL PREFIX`: the history; `etcd_server.py URL --get KEY`: a value
    import sys as _sys

    if _sys.argv[2] == "--get":
        print(_json.dumps(value(_sys.argv[1], _sys.argv[3])))
    else:
        print(_json.dumps(history(_sys.argv[1], _sys.argv[2])))
