"""torch.distributed's TCPStore rendezvous, as a server spanning nodes meets it (stand-in only).

What SGLang 0.5.23 does with `--nnodes N --node-rank R --dist-init-addr HOST:PORT`, read from
its wheel (srt/entrypoints/engine.py `_launch_subprocesses`, srt/distributed/bootstrap.py,
parallel_state.py) and torch's c10d (rendezvous.py, socket.cpp, TCPStore.cpp):
- world rank 0 (node rank 0) binds PORT on every address and waits, *before loading any
  weights*, until the other N-1 ranks have connected; after `--dist-timeout` (torch's default
  600 s) it fails with "Timed out after T seconds waiting for clients. k/N clients joined." and
  SGLang's SIGQUIT path kills the tree;
- the other ranks dial HOST:PORT, retrying a refused connection with back-off and saying "No
  socket on (HOST, PORT) is listening yet, will retry." about every 30 s, until the same deadline;
- once met, the ranks stay connected (gloo's CPU group): a peer that dies is seen at once as a
  closed connection.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

RETRY_NOTICE_S = 30.0  # torch prints the retry line about this often
DEFAULT_TIMEOUT_S = 600.0


class RendezvousError(Exception):
    """The message torch would raise, verbatim in shape."""


def split_addr(addr: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port", as SGLang's NetworkAddress.parse takes it."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise RendezvousError(f"ValueError: invalid --dist-init-addr {addr!r} (expected HOST:PORT)")
    return host.strip("[]"), int(port)


class Rendezvous:
    """One rank's side of the meeting; `peers` stay open for the life of the server."""

    def __init__(self, nnodes: int, rank: int, addr: str, timeout_s: float | None,
                 wait: Callable[[float], None], log: Callable[[str], None]) -> None:
        self.nnodes, self.rank = nnodes, rank
        self.host, self.port = split_addr(addr)
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else DEFAULT_TIMEOUT_S
        self.wait, self.log = wait, log  # `wait` sleeps while handling the server's control bytes
        self.peers: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def meet(self) -> None:
        if self.rank == 0:
            self._host_the_store()
        else:
            self._join_the_store()

    def _host_the_store(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        srv = socket.socket(family, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", self.port))
        except OSError as e:
            srv.close()
            raise RendezvousError(f"torch.distributed.DistStoreError: The server socket has failed to listen on any "
                                  f"local network address. port: {self.port}, useIpv6: {family == socket.AF_INET6}, "
                                  f"code: -{e.errno}, name: {e.strerror}") from None
        srv.listen(64)
        srv.setblocking(False)
        self.listener = srv
        deadline = time.monotonic() + self.timeout_s
        while len(self.peers) < self.nnodes - 1:
            if time.monotonic() >= deadline:
                raise RendezvousError(f"torch.distributed.DistStoreError: Timed out after {self.timeout_s:g} seconds "
                                      f"waiting for clients. {len(self.peers) + 1}/{self.nnodes} clients joined.")
            try:
                conn, _ = srv.accept()
            except BlockingIOError:
                self.wait(0.05)
                continue
            conn.setblocking(True)
            conn.settimeout(5.0)
            try:
                hello = conn.recv(64)
            except OSError:
                hello = b""
            conn.settimeout(None)
            if hello.startswith(b"rank "):
                self.peers.append(conn)
            else:  # not a rank of ours (a port scanner, a stranger): torch drops it too
                conn.close()

    def _join_the_store(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        next_notice = time.monotonic() + RETRY_NOTICE_S
        backoff = 0.05
        while True:
            try:
                conn = socket.create_connection((self.host, self.port), timeout=2.0)
                conn.sendall(f"rank {self.rank}\n".encode())
                conn.settimeout(None)
                self.peers.append(conn)
                return
            except OSError:
                now = time.monotonic()
                if now >= deadline:
                    raise RendezvousError(f"torch.distributed.DistNetworkError: The client socket has timed out after "
                                          f"{self.timeout_s:g}s while trying to connect to ({self.host}, {self.port}).") from None
                if now >= next_notice:
                    self.log(f"[c10d] No socket on ({self.host}, {self.port}) is listening yet, will retry.")
                    next_notice = now + RETRY_NOTICE_S
                self.wait(min(backoff, max(0.0, deadline - now)))
                backoff = min(backoff * 2, 1.0)

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """Call `on_lost(rank)` from a thread when a peer's connection closes (it died or stopped)."""
        for i, peer in enumerate(self.peers):
            rank = i + 1 if self.rank == 0 else 0
            threading.Thread(target=self._watch_one, args=(peer, rank, on_lost), name=f"gloo-peer-{rank}",
                             daemon=True).start()

    @staticmethod
    def _watch_one(peer: socket.socket, rank: int, on_lost: Callable[[int], None]) -> None:
        try:
            while peer.recv(4096):
                pass
        except OSError:
            pass
        on_lost(rank)

    def close(self) -> None:
        for s in [*self.peers, *([self.listener] if self.listener else [])]:
            try:
                s.close()
            except OSError:
                pass
