"""The network check's analysis on synthetic measurements (``fsm_agent.plugins.node_check_network``):
who is blamed from the ring, when round 2 is asked for and what it decides, and the options' checks."""

from __future__ import annotations

import pytest

from fsm_agent import config, settings
from fsm_agent.node_checks import CheckRound
from fsm_agent.plugins import node_check_network as net
from fsm_agent.plugins.manager import get_plugin_manager
from fsm_agent.plugins.node_check_network import Reference, Thresholds, analyse_ring, analyse_tests

pytestmark = pytest.mark.unit

HEALTHY = 2000.0  # Mbit/s, the order of a veth under load on 2 cores
SLOW = 20.0  # a tbf rate limit


def link(up=HEALTHY, down=HEALTHY, rtt=0.5):
    return {"up_mbps": up, "down_mbps": down, "rtt_ms": rtt}


def ring(n, **changes):
    """``links[i]``: node i's link to i + 1; ``changes`` as ``l3=...``: link 3 replaced."""
    links = {i: link(up=HEALTHY * (0.6 + 0.1 * (i % 5))) for i in range(n)}  # healthy spread: 0.6 to 1.0
    links.update({int(name[1:]): value for name, value in changes.items()})
    return links


def test_healthy_ring_blames_nobody_and_needs_no_second_round():
    verdict = analyse_ring(8, ring(8), Thresholds())
    assert (dict(verdict.blamed), list(verdict.tests), list(verdict.undecided)) == ({}, [], [])
    assert HEALTHY * 0.6 < verdict.reference.mbps <= HEALTHY


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_node_with_slow_egress_is_the_common_node_of_its_two_slow_links(n):
    # Node 2 sends slowly: its upload to 3 (link 2 up) and node 1's download from it (link 1 down).
    verdict = analyse_ring(n, ring(n, l2=link(up=SLOW), l1=link(down=SLOW)), Thresholds())
    assert list(verdict.blamed) == [2] and list(verdict.tests) == []
    assert "both ring links bad" in verdict.blamed[2] and "0.25 x median" in verdict.blamed[2]


def test_a_node_with_slow_ingress_is_found_the_same_way():
    verdict = analyse_ring(8, ring(8, l5=link(down=SLOW), l4=link(up=SLOW)), Thresholds())
    assert list(verdict.blamed) == [5] and list(verdict.tests) == []


def test_a_node_whose_link_is_down_is_blamed_for_its_missing_result():
    # Node 6 never reached the store: no result; node 5 could not get its address.
    links = ring(8, l5={"error": "node 6 published no address within 2 s"})
    links[6] = None
    verdict = analyse_ring(8, links, Thresholds())
    assert list(verdict.blamed) == [6] and list(verdict.tests) == []
    assert verdict.blamed[6] == "published no network result before the deadline"


def test_a_node_that_publishes_but_answers_no_peer_is_the_common_node():
    verdict = analyse_ring(
        8,
        ring(8, l3={"error": "connect to 10.0.0.5:4000 failed: timed out"}, l4={"error": "connect failed"}),
        Thresholds(),
    )
    assert list(verdict.blamed) == [4]


def test_a_high_rtt_link_counts_as_bad_above_ratio_and_floor():
    verdict = analyse_ring(8, ring(8, l1=link(rtt=80.0), l2=link(rtt=80.0)), Thresholds())
    assert list(verdict.blamed) == [2] and "rtt 80.00 ms > 10.00 ms" in verdict.blamed[2]
    # Below the floor (10 ms) a high ratio is noise: nobody.
    assert dict(analyse_ring(8, ring(8, l1=link(rtt=8.0), l2=link(rtt=8.0)), Thresholds()).blamed) == {}


def test_a_single_slow_link_is_ambiguous_and_round_2_decides():
    verdict = analyse_ring(8, ring(8, l3=link(up=SLOW)), Thresholds())
    assert dict(verdict.blamed) == {}
    suspects = [suspect for _, suspect in verdict.tests]
    testers = [good for good, _ in verdict.tests]
    assert suspects == [3, 4] and not set(testers) & {3, 4} and len(set(testers)) == 2
    slow_4 = {(testers[0], 3): link(), (testers[1], 4): link(down=SLOW)}
    assert list(analyse_tests(verdict.tests, slow_4, verdict.reference, Thresholds())) == [4]
    # A transient: both endpoints fine against good nodes -> nobody.
    fine = {(testers[0], 3): link(), (testers[1], 4): link()}
    assert analyse_tests(verdict.tests, fine, verdict.reference, Thresholds()) == {}
    # A test whose good node published nothing blames nobody; one that cannot connect blames the suspect.
    assert analyse_tests(verdict.tests, {}, verdict.reference, Thresholds()) == {}
    unreachable = {(testers[0], 3): {"error": "connect failed"}, (testers[1], 4): link()}
    assert "known-good node" in analyse_tests(verdict.tests, unreachable, verdict.reference, Thresholds())[3]


def test_two_slow_nodes_two_apart_go_to_round_2_instead_of_blaming_the_healthy_one_between():
    # Nodes 2 and 4 slow: links 1, 2, 3, 4 bad; node 3 has two bad links but is healthy.
    bad = {f"l{i}": link(up=SLOW, down=SLOW) for i in (1, 2, 3, 4)}
    verdict = analyse_ring(8, ring(8, **bad), Thresholds())
    assert 3 not in verdict.blamed and sorted(s for _, s in verdict.tests) == [1, 2, 3, 4, 5]
    results = {(g, s): link(up=SLOW) if s in (2, 4) else link() for g, s in verdict.tests}
    assert sorted(analyse_tests(verdict.tests, results, verdict.reference, Thresholds())) == [2, 4]


def test_without_a_known_good_node_nobody_is_blamed():
    verdict = analyse_ring(3, ring(3, l0=link(up=SLOW), l1=link(up=SLOW), l2=link(up=SLOW)), Thresholds())
    assert (dict(verdict.blamed), list(verdict.tests)) == ({}, [])


def test_two_nodes_only_an_absent_node_is_found():
    assert dict(analyse_ring(2, {0: link(up=SLOW), 1: link()}, Thresholds()).blamed) == {}
    assert list(analyse_ring(2, {0: {"error": "x"}, 1: None}, Thresholds()).blamed) == [1]


def test_reference_ignores_failed_links():
    assert Reference.of([link(up=1.0, down=3.0, rtt=2.0), {"error": "x"}, None]) == Reference(2.0, 2.0)
    assert Reference.of([None]) == Reference(None, None)


def network_options():
    options = config.OptionRegistry(current_plugin=net.PLUGIN_NAME)
    net.fsm_agent_addoption(options)
    return {option.name: option for option in options}


def test_options_flags_and_defaults():
    options = network_options()
    assert {name: (o.flag, o.default) for name, o in options.items()} == {
        "network": ("--node-check-network", False),
        "min_bandwidth_ratio": ("--node-check-min-bandwidth-ratio", 0.25),
        "max_rtt_ratio": ("--node-check-max-rtt-ratio", 10.0),
        "rtt_floor_ms": ("--node-check-rtt-floor-ms", 10.0),
        "network_seconds": ("--node-check-network-seconds", 0.2),
    }


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("min_bandwidth_ratio", "1.5", "expected a ratio in (0, 1), got 1.5"),
        ("min_bandwidth_ratio", "0", "expected a ratio in (0, 1), got 0.0"),
        ("min_bandwidth_ratio", "nan", "expected a number, got NaN"),
        ("max_rtt_ratio", "0.5", "expected a ratio > 1, got 0.5"),
        ("rtt_floor_ms", "-1", "expected milliseconds >= 0, got -1.0"),
        ("network_seconds", "60", "expected seconds in (0, 5], got 60.0"),
    ],
)
def test_a_bad_threshold_is_one_line(name, text, message):
    with pytest.raises(settings.Rejected) as caught:
        network_options()[name].from_string(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_thresholds_in_python_are_checked_too():
    with pytest.raises(ValueError, match=r"expected a ratio in \(0, 1\), got 2"):
        Thresholds(min_bandwidth_ratio=2)


class Config:
    """What ``fsm_agent_configure`` reads: the plugin's resolved options."""

    def __init__(self, **values):
        self.values = values

    def plugin_options(self, plugin):
        assert plugin == net.PLUGIN_NAME
        return self.values


class Agent:
    def __init__(self):
        self.plugin_manager = get_plugin_manager(load_entry_points=False)


def network_checks(agent):
    return [p for p in agent.plugin_manager.get_plugins() if isinstance(p, net.NetworkCheck)]


def test_the_check_is_registered_only_when_switched_on():
    off, on = Agent(), Agent()
    net.fsm_agent_configure(Config(network=False), off)
    net.fsm_agent_configure(Config(network=True, min_bandwidth_ratio=0.1, rtt_floor_ms=0.0, network_seconds=0.5), on)
    assert network_checks(off) == []
    (check,) = network_checks(on)  # registered against the hookspec: the hookimpl's arguments match it
    assert (check.thresholds, check.seconds) == (Thresholds(0.1, 10.0, 0.0), 0.5)
    alone = CheckRound(
        store=None,
        key_prefix="",
        group_rank=0,
        group_world_size=1,
        node_addr="127.0.0.1",
        hostname="h",
        timeout_s=5.0,
        deadline=0.0,
    )
    assert on.plugin_manager.hook.fsm_agent_node_check(check_round=alone) == []  # one node: nothing to say


@pytest.mark.parametrize("garbage", ["text", {"up_mbps": "fast"}, {"up_mbps": 1.0}, {"error": 3}, [1, 2]])
def test_a_malformed_measurement_is_a_bad_link_not_a_crash(garbage):
    links = ring(8, l4=garbage, l3=link(down=SLOW))
    verdict = analyse_ring(8, links, Thresholds())
    assert list(verdict.blamed) == [4] and "malformed measurement" in verdict.blamed[4]
    assert analyse_tests([(0, 4)], {(0, 4): garbage}, verdict.reference, Thresholds()) == {
        4: "bad link to known-good node 0 (round 2): malformed measurement"
    }
