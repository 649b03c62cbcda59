"""A private network for test hosts: one network namespace per host, joined by veth pairs to a
bridge in a namespace of its own. Traffic goes only between those hosts; the machine's own
network never sees it. Made with iproute2 (`ip netns`, `ip link`), removed at close."""

from __future__ import annotations

import subprocess
import uuid


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class TestNetwork:
    """`net.add("a")` -> the netns name for host "a", reachable from the others at `net.address("a")`."""

    def __init__(self, subnet: str = "10.77.0") -> None:
        self.id = uuid.uuid4().hex[:6]
        self.subnet = subnet
        self.switch = f"sgt-{self.id}-sw"
        self.hosts: dict[str, tuple[str, str]] = {}  # name -> (netns, address)
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)

    def add(self, name: str) -> str:
        n = len(self.hosts) + 1
        netns, address = f"sgt-{self.id}-{name}", f"{self.subnet}.{n}"
        _ip("netns", "add", netns)
        _ip("link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", f"p{n}", netns=self.switch)
        _ip("link", "set", f"p{n}", "master", "br0", "up", netns=self.switch)
        _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        self.hosts[name] = (netns, address)
        return netns

    def address(self, name: str) -> str:
        return self.hosts[name][1]

    def close(self) -> None:
        for netns, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
