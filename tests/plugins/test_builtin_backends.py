"""The built-in backends pass fsm_agent.testing.conformance: rendezvous c10d and static (real
TCPStores on 127.0.0.1), and the subprocess launcher (real worker processes).

Each backend is created the way the agent creates it: through the backend registry that the
built-in plugins fill (``fsm_agent_register_backends``).
"""

from __future__ import annotations

import os

import pytest

from fsm_agent.plugins.manager import build_registry, get_plugin_manager
from fsm_agent.testing.conformance import LauncherConformance, RendezvousConformance

pytestmark = pytest.mark.conformance


def backend(kind: str, name: str):
    return build_registry(get_plugin_manager(load_entry_points=False)).get(kind, name)


def torch_parameters(backend_name: str, setup, **config):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend=backend_name,
        endpoint=setup.endpoint,
        run_id=setup.run_id,
        min_nodes=setup.min_nodes,
        max_nodes=setup.max_nodes,
        local_addr=setup.host,
        **config,
    )


class TestC10dRendezvous(RendezvousConformance):
    def make_handler(self, setup, node):
        params = torch_parameters(
            "c10d",
            setup,
            join_timeout=str(setup.join_timeout),
            last_call_timeout=str(setup.last_call_timeout),
            is_host=str(node == 0).lower(),
        )
        return backend("rendezvous", "c10d")(params)


class TestStaticRendezvous(RendezvousConformance):
    elastic = False  # a fixed world of --nnodes agents
    closable = False  # torch's StaticTCPRendezvous.set_closed() does nothing

    def make_handler(self, setup, node):
        return backend("rendezvous", "static")(torch_parameters("static", setup, rank=node, timeout=setup.join_timeout))


class TestSubprocessLauncher(LauncherConformance):
    def make_launcher(self):
        return backend("launcher", "subprocess")(None)


class TestFsmRendezvous(RendezvousConformance):
    """fsm-agent's own torch-free backend ``fsm`` (its own store server, no TCPStore)."""

    def make_handler(self, setup, node):
        fsm = pytest.importorskip("fsm_agent.plugins.rendezvous_fsm")
        params = fsm.FsmRendezvousParameters(
            backend="fsm",
            endpoint=setup.endpoint,
            run_id=setup.run_id,
            min_nodes=setup.min_nodes,
            max_nodes=setup.max_nodes,
            local_addr=setup.host,
            join_timeout=setup.join_timeout,
            last_call_timeout=setup.last_call_timeout,
            is_host=int(node == 0),
            node_rank=node,
        )
        return fsm.create_fsm_handler(params)


class _AgentStandIn:
    """What PreloadLauncher reads from its agent: the config with its plugin options."""

    def __init__(self, **options):
        from fsm_agent.config import LaunchConfig

        self.config = LaunchConfig(plugins={"launcher-preload": options})


class TestPreloadLauncher(LauncherConformance):
    """The built-in ``preload`` launcher: workers forked from a zygote (here one that imports only
    ``json``, so that the suite does not wait for ``import torch``)."""

    callables = False  # scripts, modules and binaries only

    def make_launcher(self):
        return backend("launcher", "preload")(_AgentStandIn(modules="json"))

    def test_a_worker_gone_before_its_pidfd_is_opened_is_still_reported(self, workers, monkeypatch):
        """A worker may exit, and the zygote reap it, before the launcher opens its pidfd (seen in
        CI: the agent then failed in INIT). The race is forced here: every pidfd_open finds no process."""

        def no_such_process(pid):
            raise ProcessLookupError(3, "No such process")

        monkeypatch.setattr(os, "pidfd_open", no_such_process)
        workers.start("if _rank == 1:\n    sys.exit(7)\n")
        assert workers.wait_exits([0, 1]) == {0: 0, 1: 7}
