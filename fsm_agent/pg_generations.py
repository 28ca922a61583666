"""Process-group generations: a worker may destroy and re-create its process group, repeatedly.

Runs inside worker processes (never in the agent). ``init_process_group`` ->
``destroy_process_group`` -> ``init_process_group`` (evaluation loops, Megatron's
re-initialization; pytorch #114585) fails under torchrun in two ways: a store that outlives the
group hands the second group the first one's keys (torch names the default group "0" again after
a destroy, so gloo reads the old addresses), and a store re-created by rank 0 races with the old
one (a fast rank > 0 connects to rank 0's previous server before rank 0's destroy frees it, then
loses that connection).

This module wraps torch's ``env://`` and ``tcp://`` rendezvous handlers in the worker: the first
store one makes (per address, port, rank and world size) is kept for the life of the process and
each later ``init_process_group`` gets a fresh key prefix on it: generation 0 gets torch's own
store, generation g >= 1 ``PrefixStore("fsm_agent/pg_generation_<g>", store)``. The server never
goes away under a rank that re-initializes early, and no generation reads another's keys. Ranks
agree on g because every rank re-creates the group the same number of times (a collective
requirement anyway). ``file://`` and ``store=`` are untouched.

Ranks > 0 also wait for rank 0's generation-0 store to listen before torch's client connects
(:func:`_wait_until_listening`): refused, that client backs off about 0.5 s, most of a fast restart.

The launchers install it: the subprocess launcher through ``fsm_agent/_worker_site/sitecustomize.py``
on the worker's PYTHONPATH (removed again at start-up, so the worker's environment is torchrun's),
the preload launcher in its forked worker, callables in their process. A worker started with
``python -S`` or ``-I`` (or a non-Python ``--no-python`` program) runs with torch's handlers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

#: The torch module whose ``env`` and ``tcp`` handlers are wrapped, once it has been imported.
RENDEZVOUS_MODULE = "torch.distributed.rendezvous"

#: Key prefix of generation g >= 1 (generation 0 uses the store as torch made it).
GENERATION_PREFIX = "fsm_agent/pg_generation_{}"

#: The folder whose sitecustomize.py installs the generations in a ``python`` worker at start-up.
WORKER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_site")

#: Connection attempts per second that all ranks > 0 of a job together make at rank 0's store port
#: while it does not listen yet: each rank pauses at most ``max(PROBE_PAUSE_MAX_S, world_size /
#: this)`` seconds between two, so rank 0's host sees a bounded storm whatever the job's size.
PROBES_PER_S_AT_RANK0 = 20_000
#: The longest pause (seconds) between two attempts in a job of up to 1,000 ranks.
PROBE_PAUSE_MAX_S = 0.05

# (address, port, rank, world size) -> [store, times handed out]
_stores: dict[tuple[str, str, int, int], list[Any]] = {}


def with_generations_site(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`WORKER_SITE` first on PYTHONPATH (the worker removes it at start-up)."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": WORKER_SITE + (os.pathsep + path if path else "")}


def install() -> None:
    """Wrap torch's ``env://`` and ``tcp://`` rendezvous handlers in this process, now or when torch
    imports them. Never imports torch itself (a worker that does not use torch pays nothing)."""
    module = sys.modules.get(RENDEZVOUS_MODULE)
    if module is not None:
        _replace_handlers(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _replace_handlers(module: Any) -> None:
    """Wrap torch's ``env`` and ``tcp`` handlers: both make the workers' TCPStore at an address
    they are given (``tcp://MASTER_ADDR:MASTER_PORT`` is a common spelling of ``env://``)."""
    handlers = module._rendezvous_handlers  # torch's registry; register_rendezvous_handler refuses a second one
    for scheme in ("env", "tcp"):
        torch_handler = handlers.get(scheme)
        if torch_handler is not None and not getattr(torch_handler, "_fsm_agent_generations", False):
            handlers[scheme] = _with_generations(module, scheme, torch_handler)


def _with_generations(module: Any, scheme: str, torch_handler: Any) -> Any:
    def handler_with_generations(
        url: str, timeout: timedelta = module.default_pg_timeout, **kwargs: Any
    ) -> Iterator[tuple[Any, int, int]]:
        parsed = urlparse(url)
        query = dict(parse_qsl(parsed.query))
        # the address, rank and world size as torch's handlers read them: tcp:// from the URL;
        # env:// from the environment unless init_process_group put explicit ones in the query
        env: Mapping[str, str] = os.environ if scheme == "env" else {}
        host, port = (
            (env.get("MASTER_ADDR"), env.get("MASTER_PORT")) if env is os.environ else (parsed.hostname, parsed.port)
        )
        rank = int(query.get("rank") or env.get("RANK") or -1)
        world_size = int(query.get("world_size") or env.get("WORLD_SIZE") or -1)
        key = (str(host), str(port), rank, world_size)
        entry = _stores.get(key)
        if entry is None:  # generation 0: torch's own handler and store
            if rank > 0 and host and str(port).isdigit() and not module._torchelastic_use_agent_store():
                _wait_until_listening(str(host), int(str(port)), timeout.total_seconds(), world_size)
            store, rank, world_size = next(torch_handler(url, timeout, **kwargs))
            _stores[key] = [store, 1]
        else:
            from torch.distributed import PrefixStore  # type: ignore[attr-defined]

            store = PrefixStore(GENERATION_PREFIX.format(entry[1]), entry[0])
            entry[1] += 1
        yield store, rank, world_size
        raise RuntimeError(f"Unable to perform re-rendezvous using {scheme}:// method")  # as torch's handlers

    handler_with_generations._fsm_agent_generations = True  # type: ignore[attr-defined]
    return handler_with_generations


def _wait_until_listening(host: str, port: int, timeout_s: float, world_size: int) -> bool:
    """Wait until rank 0's store listens at ``host:port`` (a connection is accepted, then closed),
    at most ``timeout_s`` seconds; True once it does.

    torch's TCPStore client backs off about 0.5 s after a refused connection (its
    ``ExponentialBackoffWithJitter``): ranks that start before rank 0 has imported torch lose that
    on every fast restart. Here they try again after 5 ms, then after pauses that double up to
    ``max(PROBE_PAUSE_MAX_S, world_size / PROBES_PER_S_AT_RANK0)`` seconds, so they connect
    within one short pause of rank 0 listening. (The launcher cannot bind the port for rank 0
    ahead of time: a worker that makes its own ``TCPStore(is_master=True)`` there, as code
    honouring ``TORCHELASTIC_USE_AGENT_STORE`` does, would find it taken.)
    """
    deadline = time.monotonic() + timeout_s
    pause, longest = 0.005, max(PROBE_PAUSE_MAX_S, world_size / PROBES_PER_S_AT_RANK0)
    while True:
        remaining = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, remaining))).close()
            return True
        except OSError:
            if remaining <= pause:
                return False  # torch's client then tries, and says why it cannot, as it would have
            time.sleep(pause)
            pause = min(longest, pause * 2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Replaces the handler right after ``torch.distributed.rendezvous`` has run (Python has no
    post-import hook; this finder wraps that one module's loader, then leaves ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != RENDEZVOUS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            _replace_handlers(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
