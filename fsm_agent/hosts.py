"""This node as its peers see it: found by address, never by asking what the hostname resolves to.

In a cluster the hostname often tells nothing: a Kubernetes pod's name resolves only once its
headless Service publishes it (or never, without a ``subdomain``), a container's may resolve to
nothing, and Debian's ``/etc/hosts`` maps it to ``127.0.1.1``. torch asks it in two places: the
c10d backend's ``is_host`` inference (``rendezvous.utils._matches_machine_hostname`` calls
``getaddrinfo(gethostname())`` unguarded, so an unresolvable hostname raises ``gaierror``), and
``MASTER_ADDR``/the node's identity (``local_addr or socket.getfqdn()``), which the peers then
cannot reach. fsm-agent uses addresses instead:

* ``advertised_address(endpoint)``: what MASTER_ADDR and the rendezvous identity use when
  ``--local-addr`` is not given: the address of the interface that routes to the rendezvous
  endpoint (the kernel's route lookup: a UDP socket ``connect``, which sends nothing).
* ``is_this_host(host)``: whether the store at ``host`` is this machine's: loopback, this
  machine's own name, or a name that resolves to an address of one of its interfaces (psutil).

Which interface the workers' collectives use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) is
the user's setting, read by gloo and NCCL themselves: docs/schedulers.md#hosts-in-clusters.
"""

from __future__ import annotations

import ipaddress
import socket

#: The port a route is looked up for when the endpoint names none (no packet is ever sent to it).
_ANY_PORT = 9


def split_endpoints(endpoint: str | None) -> list[tuple[str, int]]:
    """``host:port``, ``[v6]:port``, ``http://host:port`` or a comma-separated list of them -> [(host, port)].

    A part without a port gets port 9 (only used for a route lookup); empty parts are skipped.
    """
    pairs = []
    for part in (endpoint or "").split(","):
        text = part.strip().split("://", 1)[-1].rstrip("/")
        if not text:
            continue
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif text.count(":") == 1:
            host, _, port = text.partition(":")
        else:  # a bare IPv6 address, or a host without a port
            host, port = text, ""
        pairs.append((host or "localhost", int(port) if port.isdigit() else _ANY_PORT))
    return pairs


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to (IPv4 and IPv6), or [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):  # UnicodeError: not a valid host name at all
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def local_addresses() -> set[str]:
    """Every IPv4/IPv6 address on this machine's interfaces (psutil), loopback included."""
    import psutil

    found = set()
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                found.add(addr.address.split("%", 1)[0])  # fe80::1%eth0 -> fe80::1
    return found


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (never resolves anything)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_this_host(host: str) -> bool:
    """Whether ``host`` (a rendezvous endpoint's host) is this machine; torch's ``_matches_machine_hostname``
    without its hostname lookup.

    True for ``localhost`` and loopback addresses, for this machine's hostname or FQDN as written,
    and for a name or address that resolves to an address of one of this machine's interfaces.
    A name that does not resolve (yet: a Kubernetes headless Service publishes a pod's name once the
    pod runs) is this machine when its first label is this machine's hostname (a pod named
    ``job-node-0-0`` and the endpoint ``job-node-0-0.job``). Never raises.
    """
    if is_loopback(host):
        return True
    hostname = socket.gethostname()
    if host in (hostname, socket.getfqdn()):
        return True
    addrs = resolve(host)
    if not addrs:
        return bool(hostname) and host.split(".", 1)[0] == hostname.split(".", 1)[0]
    return bool(set(addrs) & local_addresses())


def route_address(host: str, port: int = _ANY_PORT) -> str | None:
    """The source address this machine uses to reach ``host:port`` (the kernel's route lookup: a UDP
    ``connect``, no packet sent); None when ``host`` does not resolve or no route leads there."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0])
        except OSError:  # no route for this family
            continue
    return None


def advertised_address(endpoint: str | None) -> str | None:
    """This node's address for MASTER_ADDR and its rendezvous identity when ``--local-addr`` is not given.

    Args:
        endpoint: ``--rdzv-endpoint`` (one ``host:port`` or a comma-separated list).

    Returns:
        The address of the interface that routes to the first endpoint host that resolves
        (``127.0.0.1`` for a loopback endpoint such as ``localhost``); else the first address of an
        interface that is up and not loopback (IPv4 first), also for a name that resolves to
        loopback here only (Debian's ``127.0.1.1 <hostname>``: the peers resolve it elsewhere);
        None when there is none (the caller keeps torch's ``socket.getfqdn()``).
    """
    looped = None
    for host, port in split_endpoints(endpoint):
        addr = route_address(host, port)
        if addr is not None and is_loopback(addr) and not is_loopback(host):
            looped = looped or addr  # this machine's name mapped to loopback: no address for peers
        elif addr is not None:
            return addr
    return _first_interface_address() or looped


def _first_interface_address() -> str | None:
    import psutil

    stats = psutil.net_if_stats()
    candidates = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name in stats and not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(addr.address.split("%", 1)[0])
            if not (ip.is_loopback or ip.is_link_local):
                candidates.append((addr.family != socket.AF_INET, str(ip)))
    candidates.sort(key=lambda c: c[0])  # stable: IPv4 first, otherwise in interface order
    return candidates[0][1] if candidates else None
