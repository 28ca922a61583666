"""fsm_agent.hosts: this node found by address (loopback only here; the namespaced hosts are in
tests/schedulers/test_hostnames.py)."""

from __future__ import annotations

import socket

import pytest

from fsm_agent import hosts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ("node0:29400", [("node0", 29400)]),
        ("[fd00::1]:29400", [("fd00::1", 29400)]),
        ("http://10.0.0.1:2379,http://10.0.0.2:2379/", [("10.0.0.1", 2379), ("10.0.0.2", 2379)]),
        ("fd00::1", [("fd00::1", 9)]),
        ("node0", [("node0", 9)]),
        ("", []),
    ],
)
def test_split_endpoints(endpoint, expected):
    assert hosts.split_endpoints(endpoint) == expected


def test_a_loopback_endpoint_is_this_host_and_advertises_loopback():
    assert hosts.is_this_host("localhost") and hosts.is_this_host("127.0.0.1") and hosts.is_this_host("::1")
    assert hosts.advertised_address("127.0.0.1:29400") == "127.0.0.1"
    assert hosts.route_address("127.0.0.1", 29400) == "127.0.0.1"


def test_an_address_of_this_machine_is_this_host_and_others_are_not():
    mine = sorted(a for a in hosts.local_addresses() if ":" not in a)
    assert "127.0.0.1" in mine
    assert all(hosts.is_this_host(a) for a in mine)
    other = "192.0.2.77"  # TEST-NET-1: on no interface here
    assert other not in mine and not hosts.is_this_host(other)


def test_this_machines_own_names_are_this_host_without_resolving(monkeypatch):
    """The name as written decides before any lookup; a name that does not resolve is this host
    only when its first label is the hostname (a pod ``job-node-0-0`` and ``job-node-0-0.job``)."""
    monkeypatch.setattr(socket, "gethostname", lambda: "job-node-0-0")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "job-node-0-0")
    assert hosts.is_this_host("job-node-0-0")
    assert hosts.is_this_host("job-node-0-0.job.invalid")
    assert not hosts.is_this_host("job-node-0-1.job.invalid")


def test_an_unresolvable_endpoint_falls_back_to_an_interface_address():
    addr = hosts.advertised_address("no-such-host.invalid:29400")
    assert addr is None or (addr in hosts.local_addresses() and not hosts.is_loopback(addr))
    assert hosts.route_address("no-such-host.invalid") is None


def test_a_name_that_resolves_to_loopback_here_advertises_an_interface_address():
    """Debian's ``127.0.1.1 <hostname>``: the endpoint ``<hostname>:port`` routes to loopback on this
    machine only; the peers must get an address of an interface instead."""
    name = socket.gethostname()
    if not all(hosts.is_loopback(a) for a in hosts.resolve(name) or ["no"]):
        pytest.skip(f"this machine's hostname {name!r} does not resolve to loopback only")
    addr = hosts.advertised_address(f"{name}:29400")
    assert addr is not None and not hosts.is_loopback(addr) and addr in hosts.local_addresses()
