"""Is a TCP port free for a server to listen on, and if not, who holds it.

The test is the server's own: bind the same address with SO_REUSEADDR, as uvicorn and the
router do. A leftover TIME_WAIT connection therefore does not count as "held" (the server
would bind fine), while any listener whose address overlaps does: 127.0.0.1:P blocks a bind
of 0.0.0.0:P and the other way round, and a dual-stack [::]:P blocks both.

A listener of the other address family holds the port too where our clients could reach it
instead of us, although our bind would succeed: [::]:P with IPV6_V6ONLY=1 for a server on
0.0.0.0:P or 127.0.0.1:P, [::1]:P for one on 127.0.0.1:P (and the same the other way round).
`localhost` resolves to ::1 first on Debian, and a client of `localhost:P` or of a host
name with an AAAA record then talks to the stranger: our traffic, API keys in its headers
included. The readiness check (`listener_ownership`) refuses such a listener once the
servers have loaded; this check names it before anything loads. It costs one more bind of
the other family's wildcard (IPV6_V6ONLY), and the socket tables only when that bind fails.

When the bind fails, the holder is named from the kernel's socket tables: /proc/net/tcp and
tcp6 give the sockets on that port (address, state, uid, inode), then /proc/*/fd maps the
inodes to PIDs. That walk costs about what psutil.net_connections() costs, so it runs only
when a port is found held, never on a poll that found it free.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from ..records import dataclass
from typing import Any
from collections.abc import Iterable, Iterator

from ..addresses import IPAddress, unmap
from ..ownership.procfs import all_pids, fd_targets
from .holders import Holder, describe_pid

_LISTEN = "0A"
_TIME_WAIT = "06"


@dataclass(frozen=True)
class PortStatus:
    """One required port. error says why the address cannot be used at all (not "held")."""

    host: str
    port: int
    label: str
    free: bool
    holders: tuple[Holder, ...] = ()
    error: str | None = None
    holder_uids: tuple[int, ...] = ()  # owners of sockets whose process could not be seen

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def problem(self) -> str | None:
        """One line naming every holder, or None when the port is free."""
        if self.free:
            return None
        where = f"port {self.address}" + (f" ({self.label})" if self.label else "")
        if self.error:
            return f"{where} cannot be used: {self.error}"
        if self.holders:
            return f"{where} held by " + " and ".join(h.describe() for h in self.holders)
        if self.holder_uids:
            uids = ", ".join(str(u) for u in self.holder_uids)
            return f"{where} held by a process of uid {uids} that cannot be seen from here (run as root to name it)"
        return f"{where} in use, holder not found in this network or PID namespace"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "label": self.label,
            "free": self.free,
            "error": self.error,
            "holders": [h.to_json() for h in self.holders],
        }


def check_port(host: str, port: int, label: str = "") -> PortStatus:
    """Bind test, and on failure the holders named (see the module docstring)."""
    return check_ports([(host, port, label)])[0]


def check_ports(specs: Iterable[tuple[str, int, str]]) -> list[PortStatus]:
    """check_port for several ports, reading the socket tables and /proc/*/fd once for all held ones."""
    specs = list(specs)
    tests = [bind_test(host, port) for host, port, _ in specs]
    held = [(host, port) for (host, port, _), (free, error) in zip(specs, tests, strict=True) if not free and not error]
    blocking = _blocking_sockets(held) if held else {}
    pids_by_inode = _pids_of_inodes({i for socks in blocking.values() for i in socks})
    described: dict[int, Holder] = {}
    out = []
    for (host, port, label), (free, error) in zip(specs, tests, strict=True):
        if free or error:
            out.append(PortStatus(host, port, label, free, (), error))
            continue
        socks = blocking.get((host, port), {})
        pids = sorted({pid for inode in socks for pid in pids_by_inode.get(inode, ())})
        holders = tuple(described.setdefault(pid, describe_pid(pid)) for pid in pids)
        uids = () if pids else tuple(sorted(set(socks.values())))
        out.append(PortStatus(host, port, label, False, holders, None, uids))
    return out


def bind_test(host: str, port: int) -> tuple[bool, str | None]:
    """(free, error): can a server bind host:port right now, and is it alone there? Costs
    two sockets, ~40 µs.

    Held also by a listener of the other address family where clients could reach it
    instead of us (see the module docstring): the name `localhost` may resolve to 127.0.0.1
    or ::1 depending on /etc/hosts, so a stranger on [::1]:P holds `localhost:P` and
    `127.0.0.1:P` as surely as one on 127.0.0.1:P, and one on [::]:P (IPV6_V6ONLY) holds
    0.0.0.0:P."""
    try:
        addr = resolve(host)
    except (OSError, ValueError) as e:
        return False, f"cannot resolve {host!r}: {e}"
    free, error = _bind(addr, host, port)
    if free and _other_family_listens(addr, port):
        return False, None
    return free, error


def _other_family_listens(addr: IPAddress, port: int) -> bool:
    """A listener of the other family that clients of addr:port could reach instead of us.

    The other family's wildcard (IPV6_V6ONLY for [::]) binds unless something of that family
    listens on the port; only then are the socket tables read, to keep what overlaps as
    `_overlaps_any_family` says (the rule readiness applies). No IPv6 on the machine (the
    socket or the bind fails otherwise) is no reason to refuse."""
    want = unmap(addr)
    other: IPAddress = ipaddress.IPv6Address("::") if want.version == 4 else ipaddress.IPv4Address("0.0.0.0")
    free, error = _bind(other, str(other), port, v6only=True)
    if free or error is not None:
        return False
    return any(state == _LISTEN and inode and unmap(have).version != want.version and _overlaps_any_family(want, have)
               for have, sport, state, _uid, inode in _sockets_on_ports({port}) if sport == port)


def _bind(addr: IPAddress, host: str, port: int, v6only: bool = False) -> tuple[bool, str | None]:
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        return False, f"cannot bind: {e.strerror or e}"
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6only and family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind((str(addr), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False, None
            if e.errno == errno.EADDRNOTAVAIL:
                return False, f"address {host} is not configured on this machine"
            return False, f"cannot bind: {e.strerror or e}"
    return True, None


def resolve(host: str) -> IPAddress:
    """The address a server given `host` would bind ("" and "*" mean all IPv4 addresses)."""
    if host in ("", "*"):
        return ipaddress.IPv4Address("0.0.0.0")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    return ipaddress.ip_address(infos[0][4][0])


@dataclass(frozen=True)
class ListenerOwnership:
    """Who listens on a port a process of ours should be serving: what readiness may trust.

    ours: a listener overlapping the address is held by one of our process's PIDs;
    foreign: everyone else listening there, named (an IPv6 listener counts for an IPv4
    address and the other way round: clients of `localhost` reach either).
    """

    ours: bool
    foreign: tuple[Holder, ...] = ()
    foreign_uids: tuple[int, ...] = ()

    @property
    def strangers(self) -> bool:
        """Someone other than our process listens there (seen by PID, or only by its socket's uid)."""
        return bool(self.foreign or self.foreign_uids)

    def describe_foreign(self) -> str:
        if self.foreign:
            return " and ".join(h.describe() for h in self.foreign)
        if self.foreign_uids:
            return "a process of uid " + ", ".join(map(str, self.foreign_uids)) + " that cannot be seen from here"
        return ""


def listener_ownership(host: str, port: int, our_pids: Iterable[int]) -> ListenerOwnership:
    """Which of the listeners on host:port (either address family) belong to `our_pids`.

    The kernel's socket tables give the listening sockets and their inodes; our processes'
    /proc/PID/fd say which inodes are theirs (a few PIDs: cheap). Only the foreign ones are
    mapped to PIDs by the walk over /proc, and only when there are any.
    """
    try:
        want = resolve(host)
    except (OSError, ValueError):
        return ListenerOwnership(False)
    listening = {inode: uid for addr, sport, state, uid, inode in _sockets_on_ports({port})
                 if state == _LISTEN and inode and _overlaps_any_family(want, addr)}
    if not listening:
        return ListenerOwnership(False)
    mine = _socket_inodes_of(our_pids) & listening.keys()
    others = {inode: uid for inode, uid in listening.items() if inode not in mine}
    if not others:
        return ListenerOwnership(bool(mine))
    pids = sorted({pid for ps in _pids_of_inodes(set(others)).values() for pid in ps})
    holders = tuple(describe_pid(pid) for pid in pids)
    return ListenerOwnership(bool(mine), holders, () if pids else tuple(sorted(set(others.values()))))


@dataclass(frozen=True)
class Acceptance:
    """Who holds the other end of one of our connections (`accepted_by`)."""

    #: one of our processes accepted it
    ours: bool
    #: who did instead, in one line ("" when nothing accepted it in time)
    stranger: str = ""

    def why_not(self) -> str:
        """Why nothing may be sent on it ("" when it is ours)."""
        if self.ours:
            return ""
        return f"it was accepted by {self.stranger}" if self.stranger else "nothing accepted it in time"


def accepted_by(ours: tuple[str, int], theirs: tuple[str, int], our_pids: Iterable[int]) -> Acceptance | None:
    """Was the connection from `ours` (our socket's address) to `theirs` (its peer) accepted by
    one of `our_pids`, and if not, by whom; None while nobody has accepted it yet.

    The exact answer to "who am I talking to", for what must reach only our process (a
    control-plane key, a liveness verdict): not which listeners exist (a stranger may bind the
    port the moment ours closes, between any check and our connect; and one on ::1 says nothing
    about who answers a connect to 127.0.0.1), but which process holds the accepted socket of
    this very connection: its row in /proc/net/tcp{,6} (local = `theirs`, remote = `ours`),
    which has no inode while it waits in the accept queue (the caller asks again: see
    engine/probe.py, `who_accepted`).
    """
    found = _connection((_ip(theirs[0]), theirs[1]), (_ip(ours[0]), ours[1]))
    if found is None or not found[1]:
        return None
    uid, inode = found
    if inode in _socket_inodes_of(our_pids):
        return Acceptance(True)
    pids = sorted(_pids_of_inodes({inode}).get(inode, ()))
    if pids:
        return Acceptance(False, " and ".join(describe_pid(pid).describe() for pid in pids))
    return Acceptance(False, f"a process of uid {uid} that cannot be seen from here")


def _ip(host: str) -> IPAddress:
    return unmap(ipaddress.ip_address(host.partition("%")[0]))  # getsockname's scope id, if any


def _connection(local: tuple[IPAddress, int], remote: tuple[IPAddress, int]) -> tuple[int, int] | None:
    """(uid, inode) of the TCP socket of this network namespace bound to `local` and connected to `remote`."""
    for v6, fields in _socket_rows():
        laddr, _, lport = fields[1].partition(":")
        raddr, _, rport = fields[2].partition(":")
        if int(lport, 16) != local[1] or int(rport, 16) != remote[1]:
            continue
        if unmap(_parse_addr(laddr, v6)) == local[0] and unmap(_parse_addr(raddr, v6)) == remote[0]:
            return int(fields[7]), int(fields[9])
    return None


def _socket_inodes_of(pids: Iterable[int]) -> set[int]:
    return {int(link[8:-1]) for pid in pids for link in fd_targets(pid) if link.startswith("socket:[")}


def _overlaps_any_family(want: IPAddress, have: IPAddress) -> bool:
    """Like _overlaps, but a listener of the other family counts where clients could reach it
    instead of us: either side a wildcard, or both loopback (`localhost` may be ::1 or 127.0.0.1)."""
    if _overlaps(want, have):
        return True
    want, have = unmap(want), unmap(have)
    if want.version == have.version:
        return False
    return want.is_unspecified or have.is_unspecified or (want.is_loopback and have.is_loopback)


def _blocking_sockets(wanted: list[tuple[str, int]]) -> dict[tuple[str, int], dict[int, int]]:
    """For each (host, port): {inode: uid} of the sockets that block a bind there.

    Listeners are preferred; only when none overlaps are other bound sockets (bound but not
    listening, or connections a listener without SO_REUSEADDR left behind) taken instead.
    """
    resolved = {}
    for host, port in wanted:
        try:
            resolved[(host, port)] = resolve(host)
        except (OSError, ValueError):
            continue
    table = _sockets_on_ports({port for _, port in resolved})
    out: dict[tuple[str, int], dict[int, int]] = {}
    for (host, port), want in resolved.items():
        listening: dict[int, int] = {}
        other: dict[int, int] = {}
        for addr, sport, state, uid, inode in table:
            if sport != port or inode == 0 or state == _TIME_WAIT:
                continue
            if state == _LISTEN and _overlaps_any_family(want, addr):  # as bind_test
                listening[inode] = uid
            elif _overlaps(want, addr):
                other[inode] = uid
        out[(host, port)] = listening or other
    return out


def _overlaps(want: IPAddress, have: IPAddress) -> bool:
    """Would a bind of `want` collide with a socket bound to `have` (same port)?

    A wildcard overlaps every address of its family; [::] also every IPv4 address (dual
    stack, the Linux default); IPv4-mapped IPv6 addresses count as IPv4.
    """
    want, have = unmap(want), unmap(have)
    if want.version == have.version:
        return want == have or want.is_unspecified or have.is_unspecified
    v6 = want if want.version == 6 else have
    return v6.is_unspecified


def _sockets_on_ports(ports: set[int]) -> list[tuple[IPAddress, int, str, int, int]]:
    """(local address, port, state, uid, inode) of the TCP sockets of this network namespace on `ports`.

    Reading these tables walks the kernel's whole connection hash: ~4 ms each on a
    small VM, more on big hosts. Read once per check, and only when a port is held.
    """
    found = []
    for v6, fields in _socket_rows():
        hexaddr, _, hexport = fields[1].partition(":")
        port = int(hexport, 16)
        if port in ports:
            found.append((_parse_addr(hexaddr, v6), port, fields[3], int(fields[7]), int(fields[9])))
    return found


def _socket_rows() -> Iterator[tuple[bool, list[str]]]:
    """(is IPv6, the row's fields) of every row of /proc/net/tcp, then of /proc/net/tcp6 (a
    table that cannot be read, as without IPv6, has none)."""
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield v6, line.split()


def _parse_addr(hexaddr: str, v6: bool) -> IPAddress:
    """/proc/net/tcp prints addresses as 32-bit words in host byte order (little-endian here)."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if _LITTLE else raw
    return ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words)


_LITTLE = sys.byteorder == "little"


def _pids_of_inodes(inodes: set[int]) -> dict[int, set[int]]:
    """{inode: PIDs with a file descriptor on that socket} (forked workers share one socket)."""
    found: dict[int, set[int]] = {}
    if not inodes:
        return found
    targets = {f"socket:[{i}]": i for i in inodes}
    for pid in all_pids():
        for link in fd_targets(pid):
            inode = targets.get(link)
            if inode is not None:
                found.setdefault(inode, set()).add(pid)
    return found
