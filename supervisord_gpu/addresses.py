"""What an address means, decided from its text: loopback names and addresses, IPv4-mapped IPv6.

Below everything that reads an address: the configuration (two listeners on one port that
conflict) and the port checks (what blocks a bind) must agree on what loopback is.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


#: names every resolver maps to loopback (RFC 6761 reserves *.localhost; Debian's /etc/hosts
#: has ip6-localhost and ip6-loopback)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def loopback_name(host: str) -> bool:
    """A host *name* that means loopback, of either family: decided from the name, not a lookup."""
    name = host.lower().rstrip(".")
    return name in LOOPBACK_NAMES or name.endswith(".localhost")


def is_loopback(host: str) -> bool:
    """A loopback name or a loopback address (127.0.0.0/8, ::1, ::ffff:127.x.y.z)."""
    if loopback_name(host):
        return True
    try:
        return unmap(ipaddress.ip_address(host.strip("[]"))).is_loopback
    except ValueError:
        return False


def unmap(a: IPAddress) -> IPAddress:
    """::ffff:a.b.c.d as a.b.c.d; any other address as it is."""
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a
