"""A real etcd (Debian's etcd-server) for one test: its own data dir and free ports, stopped after."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from support import free_ports


class EtcdServer:
    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        client, peer = free_ports(2)
        self.url = f"http://127.0.0.1:{client}"
        self.log = tmp / "etcd.log"
        self.proc = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", str(tmp / "etcd-data"), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not come up: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def pause(self) -> None:
        """etcd unreachable, as a partition looks to its clients: SIGSTOP."""
        self.proc.send_signal(signal.SIGSTOP)

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
    trustworthy clock for what happened first across machines."""
    import json
    import queue
    from urllib.parse import urlsplit

    from etcd3gw.client import Etcd3Client

    u = urlsplit(url)
    client = Etcd3Client(host=u.hostname, port=u.port, api_path="/v3/")
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


if __name__ == "__main__":  # `python tests/etcd_server.py URL PREFIX`: the history as JSON (run inside a test host)
    import json as _json
    import sys as _sys

    print(_json.dumps(history(_sys.argv[1], _sys.argv[2])))
